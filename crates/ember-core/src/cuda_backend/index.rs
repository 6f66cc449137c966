//! CUDA launchers for `kernels/index.cu`: index_select and gather (reads), scatter /
//! scatter_value / scatter_add / index_add (out-of-place writes) and one_hot, with the CPU
//! backend's semantics (`cpu/index.rs`).
//!
//! Note [Index range check on CUDA]: the CPU returns [`Error::IndexOutOfRange`] naming the first
//! bad index. Here `check_index_I` runs over the index tensor and records the first index
//! outside the indexed dim in the device's error record; the op's kernels are enqueued right
//! after it and skip bad indices, so they stay in bounds. Nothing is read back: the error is
//! reported, naming the same index, dim and size as the CPU, by the next call that waits for the
//! device (`to_vec`, `item`, a synchronize; Note [Deferred device errors] in
//! `device_errors.rs`), and the op's result is then unspecified. So the ops never synchronize
//! and can be captured into a CUDA graph. `one_hot` with `num_classes = None` needs the maximum
//! on the host anyway (its output size), so it copies the indices there and checks them there,
//! failing at once like the CPU.
//!
//! Scatter keeps the last write of repeated indices, as on the CPU, with a two-pass
//! deterministic scheme (see the top of `index.cu`); scatter_add and index_add use atomics.

use super::device_errors::Kind;
use super::kernels::{Grid, KernelShape};
use super::launch::{self, gather, scatter, select_rows};
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::op::{IndexOp, ScatterOp};
use crate::backend::CpuStorage;
use crate::backend::{BackendStorage, CopyOps, IndexOps};
use crate::layout::Layout;
use crate::{DType, Error, Result};

/// The index dtype (int64 or int32), or the CPU's error for any other.
fn index_dtype(op: &'static str, index: &CudaStorage) -> Result<DType> {
    match index.dtype() {
        d @ (DType::I64 | DType::I32) => Ok(d),
        dtype => Err(Error::UnsupportedDType {
            op,
            dtype,
            hint: "index tensors must be int64 (or int32)",
        }),
    }
}

fn same_device(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.ordinal() != b.ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}

/// The dtype-agnostic gather kernel moving elements of `dtype` (`gather_w4`, ...).
fn gather_kernel(dtype: DType) -> gather::Name {
    match dtype.size_in_bytes() {
        1 => gather::gather_w1,
        2 => gather::gather_w2,
        4 => gather::gather_w4,
        _ => gather::gather_w8,
    }
}

/// The dtype-agnostic scatter kernel writing elements of `dtype` (`scatter_w4`, ...).
fn scatter_kernel(dtype: DType) -> scatter::Name {
    match dtype.size_in_bytes() {
        1 => scatter::scatter_w1,
        2 => scatter::scatter_w2,
        4 => scatter::scatter_w4,
        _ => scatter::scatter_w8,
    }
}

/// The index values at `il` on the host, in row-major order.
fn host_indices(index: &CudaStorage, il: &Layout) -> Result<Vec<i64>> {
    Ok(match index.to_cpu(il)? {
        CpuStorage::I64(v) => v,
        CpuStorage::I32(v) => v.into_iter().map(i64::from).collect(),
        other => {
            return Err(Error::UnsupportedDType {
                op: "index",
                dtype: other.dtype(),
                hint: "index tensors must be int64 (or int32)",
            })
        }
    })
}

/// The CPU's error for the first index outside `0..size`, if any.
fn first_out_of_range(op: &'static str, idx: &[i64], dim: usize, size: usize) -> Result<()> {
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

/// Enqueues `check_index_I` over the (non-empty) index at `il` against `0..size` of dim `dim`:
/// Note [Index range check on CUDA].
fn check_range(
    rt: &DeviceRuntime,
    op: &'static str,
    index: &CudaStorage,
    il: &Layout,
    dim: usize,
    size: usize,
) -> Result<()> {
    let n = il.numel();
    let shape = KernelShape::new(op, il.dims(), &[il.strides()])?;
    let check = rt.errors.check_args(op, Kind::Index, dim, size);
    // `idx` reaches the `n` elements of a valid layout of `index`.
    launch::check_index(
        rt,
        &[index.dtype()],
        Grid::linear(rt, n, 256),
        index.dev_ptr(il),
        &shape,
        n as i64,
        &check,
    )
}

/// Runs `body` after enqueueing the range check of the (possibly empty) index.
fn validated<T>(
    rt: &DeviceRuntime,
    op: &'static str,
    index: &CudaStorage,
    il: &Layout,
    dim: usize,
    size: usize,
    body: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if il.numel() > 0 {
        check_range(rt, op, index, il, dim, size)?;
    }
    body()
}

impl CudaStorage {
    /// index_select of a row-major `self`: whole rows of the dims after `dim` move in the
    /// widest unit (up to 16 bytes) that divides a row and fits the pointers' alignment.
    fn select_rows(
        &self,
        rt: &DeviceRuntime,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        il: &Layout,
        out: &CudaStorage,
    ) -> Result<()> {
        let dims = layout.dims();
        let outer: usize = dims[..dim].iter().product();
        let row_bytes = dims[dim + 1..].iter().product::<usize>() * self.dtype().size_in_bytes();
        let (x, i, o) = (self.dev_ptr(layout), index.dev_ptr(il), out.dev_ptr_mut_at(0));
        let aligned = |b: usize| row_bytes % b == 0 && x.addr() % b as u64 == 0 && o.addr() % b as u64 == 0;
        let unit = [16usize, 8, 4, 2, 1]
            .into_iter()
            .find(|&b| aligned(b))
            .unwrap_or(1);
        let kernel = match unit {
            16 => select_rows::select_rows_w16,
            8 => select_rows::select_rows_w8,
            4 => select_rows::select_rows_w4,
            2 => select_rows::select_rows_w2,
            _ => select_rows::select_rows_w1,
        };
        let nidx = il.numel();
        let inner = row_bytes / unit;
        let units = outer * nidx * inner;
        let (outer64, nidx64, size64, inner64, istride) = (
            outer as i64,
            nidx as i64,
            dims[dim] as i64,
            inner as i64,
            il.strides()[0] as i64,
        );
        // `x` is row-major [outer, size, inner units] from its offset (indices outside 0..size
        // are skipped), `idx` holds nidx elements at stride istride, `out` holds outer * nidx *
        // inner units; all B-aligned (checked above).
        let grid = Grid::linear(rt, units, 256);
        launch::select_rows(
            rt,
            kernel,
            &[index.dtype()],
            grid,
            x,
            i,
            o,
            outer64,
            nidx64,
            size64,
            inner64,
            istride,
        )
    }
}

impl IndexOps for CudaStorage {
    /// `self` (at `layout`) read at `index` along `dim` (see [`IndexOp`]), row-major.
    fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        il: &Layout,
    ) -> Result<CudaStorage> {
        let idt = index_dtype(name, index)?;
        same_device(name, self, index)?;
        let rt = self.runtime()?;
        let rank = layout.dims().len();
        let size = layout.dims()[dim];
        // The position shape W (the output's) and the index position of each of its elements.
        let (w, istrides) = match op {
            IndexOp::Select => {
                let mut w = layout.dims().to_vec();
                w[dim] = il.numel();
                let mut s = vec![0; rank];
                s[dim] = il.strides()[0];
                (w, s)
            }
            IndexOp::Gather => (il.dims().to_vec(), il.strides().to_vec()),
        };
        let n: usize = w.iter().product();
        let out = CudaStorage::alloc_on(rt, self.dtype(), n)?;
        validated(rt, name, index, il, dim, size, || {
            if n == 0 {
                return Ok(());
            }
            if op == IndexOp::Select && layout.is_contiguous() {
                return self.select_rows(rt, layout, dim, index, il, &out);
            }
            let mut xs = layout.strides().to_vec();
            xs[dim] = 0;
            let shape = KernelShape::new(name, &w, &[&xs, &istrides])?;
            let (x, i, o) = (self.dev_ptr(layout), index.dev_ptr(il), out.dev_ptr_mut_at(0));
            let (n64, ds, size64) = (n as i64, layout.strides()[dim] as i64, size as i64);
            // `x` reaches its layout's elements (indices outside 0..size are skipped), `idx` its
            // layout's, `out` holds n; the kernel moves elements of the dtype's size.
            let kernel = gather_kernel(self.dtype());
            launch::gather(
                rt,
                kernel,
                &[idt],
                Grid::linear(rt, n, 256),
                x,
                i,
                o,
                &shape,
                n64,
                ds,
                size64,
            )
        })?;
        Ok(out)
    }

    /// A row-major copy of `self` at `layout` with `src` at `sl` written at `index` along `dim`
    /// (see [`ScatterOp`]).
    #[allow(clippy::too_many_arguments)]
    fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &CudaStorage,
        il: &Layout,
        src: &CudaStorage,
        sl: &Layout,
    ) -> Result<CudaStorage> {
        let name = op.name();
        if src.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: name,
                expected: self.dtype(),
                found: src.dtype(),
            });
        }
        let idt = index_dtype(name, index)?;
        same_device(name, self, index)?;
        same_device(name, self, src)?;
        let rt = self.runtime()?;
        let size = layout.dims()[dim];
        let out = self.to_dtype(layout, self.dtype())?;
        let cs = layout.shape().contiguous_strides();
        let mut base = cs.clone();
        base[dim] = 0;
        // The position shape W and, over it, the index position and source element.
        let (w, istrides) = match op {
            ScatterOp::Scatter | ScatterOp::ScatterAdd => (il.dims().to_vec(), il.strides().to_vec()),
            ScatterOp::IndexAdd => {
                let mut s = vec![0; sl.dims().len()];
                s[dim] = il.strides()[0];
                (sl.dims().to_vec(), s)
            }
        };
        let n: usize = w.iter().product();
        validated(rt, name, index, il, dim, size, || {
            if n == 0 {
                return Ok(());
            }
            let shape = KernelShape::new(name, &w, &[&base, &istrides, sl.strides()])?;
            let (o, i, s) = (out.dev_ptr_mut_at(0), index.dev_ptr(il), src.dev_ptr(sl));
            let (n64, ds, size64) = (n as i64, cs[dim] as i64, size as i64);
            let grid = Grid::linear(rt, n, 256);
            // `out` is row-major with `layout`'s shape and the base strides are its own with
            // dim's zeroed, so base + v * dim_stride is inside it for v in 0..size (others are
            // skipped); idx and src reach their layouts.
            if op != ScatterOp::Scatter {
                let dtypes = [self.dtype(), idt];
                return launch::scatter_add(rt, &dtypes, grid, o, i, s, &shape, n64, ds, size64);
            }
            // Last write wins: mark the winning position of each target, then let it write.
            let winner = if n < u32::MAX as usize {
                Some(CudaStorage::full(rt.ordinal, DType::I32, out.len(), 0.0)?)
            } else {
                None
            };
            if let Some(winner) = &winner {
                // One u32 per element of `out`, so reached exactly where `out` would be.
                let wp = winner.dev_ptr_mut_at(0);
                launch::scatter_mark(rt, &[idt], grid, i, wp, &shape, n64, ds, size64)?;
            }
            // `winner` null or as marked by the previous launch on the same stream.
            let wp = winner.as_ref().map(|w| w.dev_ptr_at(0));
            let kernel = scatter_kernel(self.dtype());
            launch::scatter(rt, kernel, &[idt], grid, o, i, s, wp, &shape, n64, ds, size64)
        })?;
        Ok(out)
    }

    /// int64 one-hot rows of the class indices at `layout`, and the number of classes.
    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(CudaStorage, usize)> {
        const OP: &str = "one_hot";
        let idt = index_dtype(OP, self)?;
        let rt = self.runtime()?;
        let rows = layout.numel();
        let dim = layout.shape().rank();
        let classes = match num_classes {
            Some(n) => n,
            None => {
                // The maximum is needed on the host (it sizes the output): copy the indices
                // there and check them there too.
                let idx = host_indices(self, layout)?;
                let n = idx
                    .iter()
                    .max()
                    .map_or(0, |&m| if m < 0 { 0 } else { m as usize + 1 });
                first_out_of_range(OP, &idx, dim, n)?;
                n
            }
        };
        let len = rows.checked_mul(classes).ok_or_else(|| {
            Error::invalid(
                OP,
                format!("{rows} rows of {classes} classes overflow the address space"),
            )
        })?;
        let out = CudaStorage::full(rt.ordinal, DType::I64, len, 0.0)?;
        if rows == 0 {
            return Ok((out, classes));
        }
        let shape = KernelShape::new(OP, layout.dims(), &[layout.strides()])?;
        let (i, o) = (self.dev_ptr(layout), out.dev_ptr_mut_at(0));
        let (n64, c64) = (rows as i64, classes as i64);
        // With num_classes = None the host checked the indices above; the kernel then finds
        // nothing to report.
        let check = rt.errors.check_args(OP, Kind::Index, dim, classes);
        // `idx` reaches the `rows` elements of its layout, `out` holds rows * classes i64 and
        // is written only at in-range classes.
        launch::one_hot(
            rt,
            &[idt],
            Grid::linear(rt, rows, 256),
            i,
            &shape,
            n64,
            c64,
            o,
            &check,
        )?;
        Ok((out, classes))
    }

    /// See `IndexOps::embedding_backward`.
    fn embedding_backward(
        &self,
        index: &CudaStorage,
        n: usize,
        d: usize,
        rows: usize,
        into: Option<&mut CudaStorage>,
    ) -> Result<Option<CudaStorage>> {
        const OP: &str = "embedding_backward";
        let dtype = self.dtype();
        if !dtype.is_floating_point() {
            return Err(Error::dtype(OP, dtype));
        }
        let idt = match index.dtype() {
            d @ (DType::I64 | DType::I32) => d,
            other => return Err(Error::dtype(OP, other)),
        };
        if n >= 1 << 32 || rows >= 1 << 31 || self.len() < n.saturating_mul(d) || index.len() < n {
            return Err(Error::invalid(
                OP,
                format!(
                    "{n} positions of {d} into {rows} rows: past the kernels' 2^32 positions / 2^31 rows"
                ),
            ));
        }
        let rt = self.runtime()?;
        let len = rows
            .checked_mul(d)
            .ok_or_else(|| Error::invalid(OP, format!("{rows} rows of {d} overflow the address space")))?;
        if let Some(d) = &into {
            if d.ordinal() != self.ordinal() || d.dtype() != dtype || d.len() != len {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the gradient to add into ({} elements of {:?} on cuda:{}) is not the table's ({len} of {dtype:?} on cuda:{})",
                        d.len(),
                        d.dtype(),
                        d.ordinal(),
                        self.ordinal()
                    ),
                ));
            }
        }
        let out = match into {
            Some(_) => None,
            None => Some(CudaStorage::alloc_on(rt, dtype, len)?),
        };
        if len == 0 {
            return Ok(out);
        }
        let out_ptr = match (&out, &into) {
            (Some(o), _) => o.dev_ptr_mut_at(0),
            (None, Some(d)) => d.dev_ptr_mut_at(0),
            (None, None) => unreachable!("one of them is set above"),
        };
        // The keys: n u64 (held as i64 elements).
        let keys = CudaStorage::alloc_on(rt, DType::I64, n.max(1))?;
        if n > 0 {
            // `index` holds n indices (in range: checked by the read this is the backward of);
            // `keys` n u64, written only below n.
            let grid = Grid {
                grid: (n.div_ceil(1024) as u32, 1, 1),
                block: (1024, 1, 1),
                shared_bytes: 0,
            };
            launch::embedding_sort(
                rt,
                &[idt],
                grid,
                index.dev_ptr_at(0),
                n as i64,
                keys.dev_ptr_mut_at(0),
            )?;
        }
        // `self` holds n·d gradient elements, read at keys' positions (< n); `out` (or `into`,
        // checked above to hold rows·d of the dtype) rows·d, each row read (with `add`) and
        // written by its own warp only.
        let grid = Grid::linear(rt, rows.saturating_mul(32), 256);
        launch::embedding_backward(
            rt,
            &[dtype],
            grid,
            self.dev_ptr_at(0),
            keys.dev_ptr_at(0),
            n as i64,
            d as i64,
            rows as i64,
            out_ptr,
            into.is_some() as i32,
        )?;
        Ok(out)
    }
}

// Note [Deterministic embedding backward]: the weight gradient of `embedding` (and of
// `index_select` along dim 0) sums, for each table row, the gradient rows of the positions that
// read it. Scattering them with float atomics (the composite `zeros` + `index_add`) gives sums
// in the order the atomics land, different bits from run to run, after a zero fill of the whole
// table. Instead, as llm.c buckets the positions by token: (1) `embedding_sort` sorts each chunk
// of 1,024 positions by (index, position) in shared memory, so the chunks are sorted runs; (2)
// `embedding_backward` gives each table row one warp, which finds the row's segment in every run
// by binary search (lane b searches run b) and sums the gradient rows run by run, position by
// position, in f32 (f64 for f64), writing the row once (zeros for a row never read). The order
// is the positions' order, the CPU's (`cpu/loss.rs`), so both devices give the same bits in
// f32. Capture-safe: no host sync, and the only scratch (n u64 keys) is sized by the shapes.
// Cost for GPT-2 (8,192 positions, 50,257 x 768 f32): 8 runs, a 10-step search per row, and
// one write of the table.
