//! CPU kernels of the index family: reads (index_select, gather) and out-of-place writes
//! (scatter, scatter_add, index_add), plus one_hot.
//!
//! Every kernel walks a "position" shape `W` (the output for reads, the index or source for
//! writes) with up to three layouts of that shape: the base offset of each position in the
//! indexed tensor with the indexed dim's stride set to 0, the position of its index value, and
//! (for writes) the offset of its source element. The target is then
//! `base + index * stride[dim]`. Indices are read into an `i64` vector and range-checked before
//! any element moves, so a bad index is an error and never a panic.
//!
//! Reads are parallel (each output element is independent); writes run sequentially, since
//! repeated indices make several positions write one element.

use super::loss::targets_named;
use super::{gather_strided, map_strided, CpuElement, CpuStorage, PAR_THRESHOLD};
use crate::backend::op::{IndexOp, ScatterOp};
use crate::backend::{BackendStorage, IndexOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{with_cpu_storage, Error, Result, Shape};
use half::{bf16, f16};
use rayon::prelude::*;

/// The index values at `il` in row-major order (int64 or int32 storage).
fn read_indices(op: &'static str, index: &CpuStorage, il: &Layout) -> Result<Vec<i64>> {
    match index {
        CpuStorage::I64(v) => Ok(map_strided(v, il, |x| x)),
        CpuStorage::I32(v) => Ok(map_strided(v, il, |x| x as i64)),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other.dtype(),
            hint: "index tensors must be int64 (or int32)",
        }),
    }
}

/// The first index outside `0..size`, as the error naming it.
fn check_range(op: &'static str, idx: &[i64], dim: usize, size: usize) -> Result<()> {
    match idx.iter().find(|&&i| i < 0 || i as usize >= size) {
        Some(&bad) => Err(Error::IndexOutOfRange {
            op,
            index: bad,
            dim,
            size,
        }),
        None => Ok(()),
    }
}

/// The index values at `il` in row-major order, each checked to lie in `0..size`.
fn index_values(
    op: &'static str,
    index: &CpuStorage,
    il: &Layout,
    dim: usize,
    size: usize,
) -> Result<Vec<i64>> {
    let idx = read_indices(op, index, il)?;
    check_range(op, &idx, dim, size)?;
    Ok(idx)
}

/// `strides` with `dim`'s set to 0, over `w`: the base offset of each position of `w` in the
/// indexed tensor.
fn base_layout(w: &Shape, strides: &[usize], offset: usize, dim: usize) -> Layout {
    let mut s = strides.to_vec();
    s[dim] = 0;
    Layout::new(w.clone(), s, offset)
}

/// A layout over `w` giving each position's coordinate along `dim` (for 1-D indices).
fn coordinate_layout(w: &Shape, dim: usize) -> Layout {
    let mut s = vec![0; w.rank()];
    s[dim] = 1;
    Layout::new(w.clone(), s, 0)
}

/// `f(a, b)` over the offsets of two layouts of one shape, row-major; parallel over the outer
/// dim above [`PAR_THRESHOLD`] elements.
fn walk2<U, F>(a: &Layout, b: &Layout, f: F) -> Vec<U>
where
    U: Send,
    F: Fn(usize, usize) -> U + Send + Sync,
{
    if a.numel() >= PAR_THRESHOLD && a.shape().rank() > 1 && a.dims()[0] > 1 {
        let parts: Vec<Vec<U>> = super::threads::parallel(|| {
            (0..a.dims()[0])
                .into_par_iter()
                .map(|i| {
                    let (sa, sb) = (
                        a.select(0, i).expect("in range"),
                        b.select(0, i).expect("in range"),
                    );
                    sa.offsets().zip(sb.offsets()).map(|(x, y)| f(x, y)).collect()
                })
                .collect()
        });
        return parts.into_iter().flatten().collect();
    }
    a.offsets().zip(b.offsets()).map(|(x, y)| f(x, y)).collect()
}

/// `index_select` of a contiguous tensor: whole blocks of the dims after `dim` are copied.
fn select_contiguous<T: CpuElement>(src: &[T], layout: &Layout, dim: usize, idx: &[i64]) -> Vec<T> {
    let dims = layout.dims();
    let inner: usize = dims[dim + 1..].iter().product();
    let (size, n) = (dims[dim], idx.len());
    let outer: usize = dims[..dim].iter().product();
    let mut out = vec![T::zero(); outer * n * inner];
    if out.is_empty() {
        return out;
    }
    let src = &src[layout.offset()..];
    let copy = |c: usize, dst: &mut [T]| {
        let (o, i) = (c / n, c % n);
        let start = (o * size + idx[i] as usize) * inner;
        dst.copy_from_slice(&src[start..start + inner]);
    };
    if out.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            out.par_chunks_mut(inner)
                .enumerate()
                .for_each(|(c, d)| copy(c, d))
        });
    } else {
        out.chunks_mut(inner).enumerate().for_each(|(c, d)| copy(c, d));
    }
    out
}

fn read<T: CpuElement>(
    op: IndexOp,
    name: &'static str,
    src: &[T],
    layout: &Layout,
    dim: usize,
    index: &CpuStorage,
    il: &Layout,
) -> Result<Vec<T>> {
    let idx = index_values(name, index, il, dim, layout.dims()[dim])?;
    let stride = layout.strides()[dim];
    let (w, kl) = match op {
        IndexOp::Select => {
            if layout.is_contiguous() {
                return Ok(select_contiguous(src, layout, dim, &idx));
            }
            let mut dims = layout.dims().to_vec();
            dims[dim] = idx.len();
            let w = Shape::new(dims);
            let kl = coordinate_layout(&w, dim);
            (w, kl)
        }
        IndexOp::Gather => (il.shape().clone(), Layout::contiguous(il.shape().clone())),
    };
    let base = base_layout(&w, layout.strides(), layout.offset(), dim);
    Ok(walk2(&base, &kl, |b, k| src[b + idx[k] as usize * stride]))
}

/// Elements that can be summed by `scatter_add` / `index_add`: floats add (half types through
/// f32, rounding once per add), integers wrap, booleans or.
trait AddElement: CpuElement {
    fn add(self, other: Self) -> Self;
}

macro_rules! add_element {
    ($($t:ty => |$a:ident, $b:ident| $e:expr),*) => {$(
        impl AddElement for $t {
            #[inline]
            fn add(self, other: $t) -> $t {
                let ($a, $b) = (self, other);
                $e
            }
        }
    )*};
}
add_element!(
    f32 => |a, b| a + b,
    f64 => |a, b| a + b,
    f16 => |a, b| f16::from_f32(a.to_f32() + b.to_f32()),
    bf16 => |a, b| bf16::from_f32(a.to_f32() + b.to_f32()),
    i64 => |a, b| a.wrapping_add(b),
    i32 => |a, b| a.wrapping_add(b),
    u8 => |a, b| a.wrapping_add(b),
    bool => |a, b| a | b
);

#[allow(clippy::too_many_arguments)]
fn write<T: AddElement>(
    op: ScatterOp,
    dst: &[T],
    layout: &Layout,
    dim: usize,
    index: &CpuStorage,
    il: &Layout,
    src: &CpuStorage,
    sl: &Layout,
) -> Result<Vec<T>> {
    let src = T::slice(src).ok_or(Error::DTypeMismatch {
        op: op.name(),
        expected: T::DTYPE,
        found: src.dtype(),
    })?;
    let size = layout.dims()[dim];
    let idx = index_values(op.name(), index, il, dim, size)?;
    let mut out = gather_strided(dst, layout);
    let cs = layout.shape().contiguous_strides();
    let stride = cs[dim];
    let (w, kl, sl) = match op {
        ScatterOp::Scatter | ScatterOp::ScatterAdd => {
            let w = il.shape().clone();
            // `src` may be larger than the index: walk its leading box of the index's shape.
            let sub = Layout::new(w.clone(), sl.strides().to_vec(), sl.offset());
            (w.clone(), Layout::contiguous(w), sub)
        }
        ScatterOp::IndexAdd => {
            let w = sl.shape().clone();
            if let Some(r) = sl.contiguous_range() {
                index_add_contiguous(&mut out, &src[r], &w, dim, size, &idx);
                return Ok(out);
            }
            (w.clone(), coordinate_layout(&w, dim), sl.clone())
        }
    };
    let base = base_layout(&w, &cs, 0, dim);
    let targets = base
        .offsets()
        .zip(kl.offsets())
        .map(|(b, k)| b + idx[k] as usize * stride);
    match op {
        ScatterOp::Scatter => {
            for (t, s) in targets.zip(sl.offsets()) {
                out[t] = src[s];
            }
        }
        ScatterOp::ScatterAdd | ScatterOp::IndexAdd => {
            for (t, s) in targets.zip(sl.offsets()) {
                out[t] = out[t].add(src[s]);
            }
        }
    }
    Ok(out)
}

/// `index_add` with a row-major source of shape `w`: rows of the dims after `dim` are added as
/// slices (the embedding-gradient case).
fn index_add_contiguous<T: AddElement>(
    out: &mut [T],
    src: &[T],
    w: &Shape,
    dim: usize,
    size: usize,
    idx: &[i64],
) {
    let inner: usize = w.dims()[dim + 1..].iter().product();
    let outer: usize = w.dims()[..dim].iter().product();
    let n = idx.len();
    if inner == 0 {
        return;
    }
    for o in 0..outer {
        for (i, &t) in idx.iter().enumerate() {
            let s = (o * n + i) * inner;
            let d = (o * size + t as usize) * inner;
            for (x, &y) in out[d..d + inner].iter_mut().zip(&src[s..s + inner]) {
                *x = x.add(y);
            }
        }
    }
}

impl IndexOps for CpuStorage {
    /// `self` at `layout` read at `index` along `dim` (see [`IndexOp`]), row-major.
    fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &CpuStorage,
        il: &Layout,
    ) -> Result<CpuStorage> {
        check_host_alloc(name, with_dim_len(name, layout, dim, il.numel())?, self.dtype())?;
        with_cpu_storage!(self, v => Ok(CpuElement::wrap(read(op, name, v, layout, dim, index, il)?)))
    }

    /// A row-major copy of `self` at `layout` with `src` at `sl` written at `index` along `dim`
    /// (see [`ScatterOp`]); `src` must have `self`'s dtype.
    #[allow(clippy::too_many_arguments)]
    fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &CpuStorage,
        il: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<CpuStorage> {
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
        with_cpu_storage!(self, v => Ok(CpuElement::wrap(write(op, v, layout, dim, index, il, src, sl)?)))
    }

    /// int64 one-hot rows for the class indices at `layout`, and the number of classes
    /// (`num_classes`, or max + 1 when `None`; the caller rejects empty input in that case).
    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(CpuStorage, usize)> {
        const OP: &str = "one_hot";
        let idx = read_indices(OP, self, layout)?;
        let n = match num_classes {
            Some(n) => n,
            None => idx
                .iter()
                .max()
                .map_or(0, |&m| if m < 0 { 0 } else { m as usize + 1 }),
        };
        check_range(OP, &idx, layout.shape().rank(), n)?;
        let len = crate::shape::checked_mul(OP, "rows × classes", idx.len(), n)?;
        let mut out = crate::memory::try_filled(OP, len, crate::DType::I64, 0i64)?;
        for (row, &i) in idx.iter().enumerate() {
            out[row * n + i as usize] = 1;
        }
        Ok((CpuStorage::I64(out), n))
    }

    fn embedding_backward(
        &self,
        index: &CpuStorage,
        n: usize,
        d: usize,
        rows: usize,
        into: Option<&mut CpuStorage>,
    ) -> Result<Option<CpuStorage>> {
        let sum = embedding_row_sums(self, index, n, d, rows)?;
        let Some(into) = into else { return Ok(Some(sum)) };
        const OP: &str = "embedding_backward";
        if into.dtype() != sum.dtype() || into.len() != sum.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "the gradient to add into ({} elements of {:?}) is not the table's ({} of {:?})",
                    into.len(),
                    into.dtype(),
                    sum.len(),
                    sum.dtype()
                ),
            ));
        }
        // Each element rounded once from the f32 (f64) sum, as the engine's add would.
        match (into, &sum) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => a.iter_mut().zip(b).for_each(|(a, b)| *a += b),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => a.iter_mut().zip(b).for_each(|(a, b)| *a += b),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => a
                .iter_mut()
                .zip(b)
                .for_each(|(a, b)| *a = half::f16::from_f32(a.to_f32() + b.to_f32())),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => a
                .iter_mut()
                .zip(b)
                .for_each(|(a, b)| *a = half::bf16::from_f32(a.to_f32() + b.to_f32())),
            (other, _) => return Err(Error::dtype(OP, other.dtype())),
        }
        Ok(None)
    }
}

/// The weight gradient of a read of `rows` rows at `index` from the gradient `grad` of the
/// rows read (see `IndexOps::embedding_backward`): the positions in order, accumulated in f32
/// (f64 for f64), each row rounded once.
fn embedding_row_sums(
    grad: &CpuStorage,
    index: &CpuStorage,
    n: usize,
    d: usize,
    rows: usize,
) -> Result<CpuStorage> {
    const OP: &str = "embedding_backward";
    let idx = targets_named(OP, index, n, rows, i64::MIN)?;
    check_host_alloc(OP, rows.saturating_mul(d), grad.dtype())?;
    if grad.len() < n.saturating_mul(d) {
        return Err(Error::invalid(
            OP,
            format!("{} gradient elements for {n} rows of {d}", grad.len()),
        ));
    }
    // f32 sums round to T as the GPU's `cast<T>(float)` does (`half`'s from_f32, round to
    // nearest even), so both devices give the same bits.
    fn go<T: CpuElement>(
        g: &[T],
        idx: &[i64],
        d: usize,
        rows: usize,
        wide: bool,
        round: fn(f32) -> T,
    ) -> CpuStorage {
        if wide {
            let mut acc = vec![0.0f64; rows * d];
            for (i, &r) in idx.iter().enumerate() {
                let dst = &mut acc[r as usize * d..][..d];
                for (a, x) in dst.iter_mut().zip(&g[i * d..(i + 1) * d]) {
                    *a += x.to_f64();
                }
            }
            T::wrap(acc.into_iter().map(T::from_f64).collect())
        } else {
            let mut acc = vec![0.0f32; rows * d];
            for (i, &r) in idx.iter().enumerate() {
                let dst = &mut acc[r as usize * d..][..d];
                for (a, x) in dst.iter_mut().zip(&g[i * d..(i + 1) * d]) {
                    *a += x.to_f64() as f32;
                }
            }
            T::wrap(acc.into_iter().map(round).collect())
        }
    }
    Ok(match grad {
        CpuStorage::F32(g) => go(g, &idx, d, rows, false, |a| a),
        CpuStorage::F64(g) => go(g, &idx, d, rows, true, |a| a as f64),
        CpuStorage::F16(g) => go(g, &idx, d, rows, false, f16::from_f32),
        CpuStorage::BF16(g) => go(g, &idx, d, rows, false, bf16::from_f32),
        other => return Err(Error::dtype(OP, other.dtype())),
    })
}

/// Elements of `layout` with `dim` replaced by `len` (an index op's output), checked.
fn with_dim_len(op: &'static str, layout: &Layout, dim: usize, len: usize) -> Result<usize> {
    let others = layout
        .dims()
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != dim)
        .try_fold(1usize, |acc, (_, &d)| acc.checked_mul(d));
    others.and_then(|o| o.checked_mul(len)).ok_or_else(|| {
        Error::invalid(
            op,
            format!("the output of {:?} with {len} indices overflows", layout.dims()),
        )
    })
}
