//! CPU kernels of the fused layer normalization and its backward, with the formulas of
//! `kernels/norm.cu`, in the accumulator type (f32 for f16/bf16/f32, f64 for f64), rounded once:
//!
//! - forward: `mean = Σx / n`, `var = Σ(x - mean)² / n` (two passes over the row),
//!   `rstd = 1 / √(var + eps)`, `y = (x - mean) · rstd · w + b`;
//! - backward: `xhat = (x - mean) · rstd`, `dxhat = g · w`,
//!   `dx = rstd · (dxhat - mean(dxhat) - xhat · mean(dxhat · xhat))`, `dw = Σ_rows g · xhat`,
//!   `db = Σ_rows g`. The parameter sums run over fixed blocks of rows in parallel and the
//!   blocks' partial sums are added in order, so the result does not depend on the threads.

use super::reduce::{Acc, Float, FloatElem};
use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::host::CpuElement;
use crate::backend::{BackendStorage, LayerNormGrads, NormOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "layer_norm";

/// Rows per block of the parameter sums (a fixed split: the sums do not depend on threads).
const ROWS_PER_BLOCK: usize = 64;

/// The elements of a contiguous operand.
fn rows_of<'a, T>(data: &'a [T], l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_range() {
        Some(r) => Ok(&data[r]),
        None => Err(Error::invalid(OP, "the fused kernel takes contiguous operands")),
    }
}

/// The weight or bias of a layer norm, as its accumulator values (None: absent).
fn params<W: FloatElem>(p: Option<&[W]>) -> Option<Vec<W::A>> {
    p.map(|p| p.iter().map(|&v| v.to_acc()).collect())
}

/// Mean and `1/√(var + eps)` of one row.
fn stats<T: FloatElem>(x: &[T], eps: T::A) -> (T::A, T::A) {
    let n = T::A::from_f64(x.len() as f64);
    let sum = x.iter().fold(T::A::ZERO, |s, &v| s.add(v.to_acc()));
    let m = sum / n;
    let q = x.iter().fold(T::A::ZERO, |s, &v| {
        let d = v.to_acc() - m;
        s.add(d.mul(d))
    });
    (m, T::A::ONE / (q / n).add(eps).sqrt())
}

fn forward<T: FloatElem>(
    x: &[T],
    w: Option<Vec<T::A>>,
    b: Option<Vec<T::A>>,
    n: usize,
    eps: f64,
) -> (Vec<T>, Vec<T::A>, Vec<T::A>) {
    let rows = x.len() / n.max(1);
    let mut y = vec![T::from_acc(T::A::ZERO); x.len()];
    let mut st = vec![(T::A::ZERO, T::A::ZERO); rows];
    let eps = T::A::from_f64(eps);
    let row = |(yr, s): (&mut [T], &mut (T::A, T::A)), xr: &[T]| {
        let (m, rs) = stats(xr, eps);
        *s = (m, rs);
        for (c, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
            let mut t = (v.to_acc() - m).mul(rs);
            if let Some(w) = &w {
                t = t.mul(w[c]);
            }
            if let Some(b) = &b {
                t = t.add(b[c]);
            }
            *o = T::from_acc(t);
        }
    };
    if n > 0 {
        if x.len() >= PAR_THRESHOLD {
            super::threads::parallel(|| {
                y.par_chunks_mut(n)
                    .zip(st.par_iter_mut())
                    .zip(x.par_chunks(n))
                    .for_each(|(o, xr)| row(o, xr))
            });
        } else {
            for (o, xr) in y.chunks_mut(n).zip(st.iter_mut()).zip(x.chunks(n)) {
                row(o, xr);
            }
        }
    }
    let (mean, rstd) = st.into_iter().unzip();
    (y, mean, rstd)
}

/// dx of one block of rows, and the block's partial sums `[Σ g · xhat, Σ g]` (2n) when `sums`.
#[allow(clippy::too_many_arguments)]
fn backward_block<T: FloatElem>(
    g: &[T],
    x: &[T],
    mean: &[T::A],
    rstd: &[T::A],
    w: Option<&[T::A]>,
    n: usize,
    dx: Option<&mut [T]>,
    add: bool,
    sums: bool,
) -> Vec<T::A> {
    let mut acc = if sums { vec![T::A::ZERO; 2 * n] } else { Vec::new() };
    let inv_n = T::A::ONE / T::A::from_f64(n as f64);
    let mut dx = dx;
    for (r, (gr, xr)) in g.chunks(n).zip(x.chunks(n)).enumerate() {
        let (m, rs) = (mean[r], rstd[r]);
        let dxhat = |c: usize, gv: T::A| match w {
            Some(w) => gv.mul(w[c]),
            None => gv,
        };
        let (mut s1, mut s2) = (T::A::ZERO, T::A::ZERO);
        for (c, (&gv, &xv)) in gr.iter().zip(xr).enumerate() {
            let xh = (xv.to_acc() - m).mul(rs);
            let d = dxhat(c, gv.to_acc());
            s1 = s1.add(d);
            s2 = s2.add(d.mul(xh));
        }
        let (s1, s2) = (s1.mul(inv_n), s2.mul(inv_n));
        let mut out = dx.as_deref_mut().map(|d| &mut d[r * n..(r + 1) * n]);
        for (c, (&gv, &xv)) in gr.iter().zip(xr).enumerate() {
            let (gg, xh) = (gv.to_acc(), (xv.to_acc() - m).mul(rs));
            if let Some(o) = out.as_deref_mut() {
                let d = ((dxhat(c, gg) - s1) - xh.mul(s2)).mul(rs);
                o[c] = T::from_acc(if add { o[c].to_acc().add(d) } else { d });
            }
            if sums {
                acc[c] = acc[c].add(gg.mul(xh));
                acc[n + c] = acc[n + c].add(gg);
            }
        }
    }
    acc
}

type Grads<T> = (Option<Vec<T>>, Option<Vec<<T as FloatElem>::A>>);

/// dx (when `want_dx`; added to `into` instead when that is given) and the summed
/// `[Σ g · xhat, Σ g]` (2n, when `sums`).
#[allow(clippy::too_many_arguments)]
fn backward<T: FloatElem>(
    g: &[T],
    x: &[T],
    mean: &[T::A],
    rstd: &[T::A],
    w: Option<&[T::A]>,
    n: usize,
    want_dx: bool,
    into: Option<&mut [T]>,
    sums: bool,
) -> Grads<T> {
    let add = into.is_some();
    let mut dx = (want_dx && !add).then(|| vec![T::from_acc(T::A::ZERO); x.len()]);
    if n == 0 || x.is_empty() {
        return (dx, sums.then(|| vec![T::A::ZERO; 2 * n]));
    }
    let block = ROWS_PER_BLOCK * n;
    let run = |i: usize, d: Option<&mut [T]>| {
        let (lo, hi) = (i * block, ((i + 1) * block).min(x.len()));
        let (r0, r1) = (lo / n, hi / n);
        backward_block(
            &g[lo..hi],
            &x[lo..hi],
            &mean[r0..r1],
            &rstd[r0..r1],
            w,
            n,
            d,
            add,
            sums,
        )
    };
    let blocks = x.len().div_ceil(block);
    let target = match into {
        Some(d) => Some(d),
        None => dx.as_deref_mut(),
    };
    let parts: Vec<Vec<T::A>> = match target {
        Some(d) if x.len() >= PAR_THRESHOLD => super::threads::parallel(|| {
            d.par_chunks_mut(block)
                .enumerate()
                .map(|(i, d)| run(i, Some(d)))
                .collect()
        }),
        Some(d) => d
            .chunks_mut(block)
            .enumerate()
            .map(|(i, d)| run(i, Some(d)))
            .collect(),
        None if x.len() >= PAR_THRESHOLD => {
            super::threads::parallel(|| (0..blocks).into_par_iter().map(|i| run(i, None)).collect())
        }
        None => (0..blocks).map(|i| run(i, None)).collect(),
    };
    let total = sums.then(|| {
        let mut t = vec![T::A::ZERO; 2 * n];
        for p in &parts {
            for (a, &b) in t.iter_mut().zip(p) {
                *a = a.add(b);
            }
        }
        t
    });
    (dx, total)
}

/// The storage of `v` rounded to `dtype` (the parameters' dtype).
fn param_storage<A: Float + Into<f64>>(v: &[A], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v.iter().map(|&a| a.into() as f32).collect()),
        DType::F64 => CpuStorage::F64(v.iter().map(|&a| a.into()).collect()),
        DType::F16 => CpuStorage::F16(v.iter().map(|&a| f16::from_f32(a.into() as f32)).collect()),
        DType::BF16 => CpuStorage::BF16(v.iter().map(|&a| bf16::from_f32(a.into() as f32)).collect()),
        d => return Err(Error::dtype(OP, d)),
    })
}

/// The weight or bias as slices of `W`, which must be x's dtype or (half x) f32.
fn param_slice<'a, W: CpuElement>(p: Option<(&'a CpuStorage, &Layout)>) -> Result<Option<&'a [W]>> {
    match p {
        None => Ok(None),
        Some((s, l)) => match W::slice(s) {
            Some(v) => Ok(Some(rows_of(v, l)?)),
            None => Err(Error::DTypeMismatch {
                op: OP,
                expected: W::DTYPE,
                found: s.dtype(),
            }),
        },
    }
}

/// The statistics of the forward, in the math type `A`.
fn stat<A: CpuElement>(s: &CpuStorage) -> Result<&[A]> {
    A::slice(s).ok_or(Error::DTypeMismatch {
        op: OP,
        expected: A::DTYPE,
        found: s.dtype(),
    })
}

/// Runs `$body` with `$T` the element type of x's dtype `$d` and `$W` the parameters' (`$pd`).
macro_rules! with_types {
    ($d:expr, $pd:expr, $T:ident, $W:ident => $body:expr) => {
        match ($d, $pd) {
            (DType::F32, DType::F32) => {
                type $T = f32;
                type $W = f32;
                $body
            }
            (DType::F64, DType::F64) => {
                type $T = f64;
                type $W = f64;
                $body
            }
            (DType::F16, DType::F16) => {
                type $T = f16;
                type $W = f16;
                $body
            }
            (DType::BF16, DType::BF16) => {
                type $T = bf16;
                type $W = bf16;
                $body
            }
            (DType::F16, DType::F32) => {
                type $T = f16;
                type $W = f32;
                $body
            }
            (DType::BF16, DType::F32) => {
                type $T = bf16;
                type $W = f32;
                $body
            }
            (d, p) if d.is_floating_point() && p.is_floating_point() => {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: d,
                    found: p,
                })
            }
            (d, p) => return Err(Error::dtype(OP, if d.is_floating_point() { p } else { d })),
        }
    };
}

impl NormOps for CpuStorage {
    fn layer_norm(
        &self,
        layout: &Layout,
        weight: Option<(&CpuStorage, &Layout)>,
        bias: Option<(&CpuStorage, &Layout)>,
        n: usize,
        eps: f64,
        _twin: Option<DType>,
    ) -> Result<(CpuStorage, CpuStorage, CpuStorage, Option<CpuStorage>)> {
        check_host_alloc(OP, layout.numel(), self.dtype())?;
        let pd = weight.or(bias).map_or(self.dtype(), |(s, _)| s.dtype());
        with_types!(self.dtype(), pd, T, W => {
            let x = rows_of(T::slice(self).ok_or_else(|| Error::dtype(OP, self.dtype()))?, layout)?;
            let (w, b) = (param_slice::<W>(weight)?, param_slice::<W>(bias)?);
            let (y, mean, rstd) = forward::<T>(x, params(w), params(b), n, eps);
            Ok((T::wrap(y), <T as FloatElem>::A::wrap(mean), <T as FloatElem>::A::wrap(rstd), None))
        })
    }

    fn add_layer_norm(
        &self,
        layout: &Layout,
        residual: (&CpuStorage, &Layout),
        weight: Option<(&CpuStorage, &Layout)>,
        bias: Option<(&CpuStorage, &Layout)>,
        n: usize,
        eps: f64,
        _twin: Option<DType>,
    ) -> Result<(
        CpuStorage,
        (CpuStorage, CpuStorage, CpuStorage, Option<CpuStorage>),
    )> {
        const ADD_OP: &str = "add_layer_norm";
        check_host_alloc(ADD_OP, 2 * layout.numel(), self.dtype())?;
        if residual.0.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: ADD_OP,
                expected: self.dtype(),
                found: residual.0.dtype(),
            });
        }
        if residual.1.numel() != layout.numel() {
            return Err(Error::invalid(
                ADD_OP,
                format!(
                    "the residual holds {} elements, x {}",
                    residual.1.numel(),
                    layout.numel()
                ),
            ));
        }
        let pd = weight.or(bias).map_or(self.dtype(), |(s, _)| s.dtype());
        with_types!(self.dtype(), pd, T, W => {
            let missing = || Error::dtype(ADD_OP, self.dtype());
            let x = rows_of(T::slice(self).ok_or_else(missing)?, layout)?;
            let r = rows_of(T::slice(residual.0).ok_or_else(missing)?, residual.1)?;
            // The sum as `add` writes it (in the math type, rounded once), then the layer norm
            // of that rounded sum: the same bits as the two ops.
            let sum: Vec<T> = if x.len() >= PAR_THRESHOLD {
                super::threads::parallel(|| {
                    x.par_iter().zip(r).map(|(&a, &b)| T::from_acc(a.to_acc().add(b.to_acc()))).collect()
                })
            } else {
                x.iter().zip(r).map(|(&a, &b)| T::from_acc(a.to_acc().add(b.to_acc()))).collect()
            };
            let (w, b) = (param_slice::<W>(weight)?, param_slice::<W>(bias)?);
            let (y, mean, rstd) = forward::<T>(&sum, params(w), params(b), n, eps);
            Ok((
                T::wrap(sum),
                (T::wrap(y), <T as FloatElem>::A::wrap(mean), <T as FloatElem>::A::wrap(rstd), None),
            ))
        })
    }

    fn layer_norm_backward(
        &self,
        layout: &Layout,
        x: (&CpuStorage, &Layout),
        mean: &CpuStorage,
        rstd: &CpuStorage,
        weight: Option<(&CpuStorage, &Layout)>,
        n: usize,
        want: LayerNormGrads,
        dx_into: Option<&mut CpuStorage>,
        addend: Option<&CpuStorage>,
        _twin: Option<DType>,
    ) -> Result<[Option<CpuStorage>; 4]> {
        check_host_alloc(OP, layout.numel(), self.dtype())?;
        if self.dtype() != x.0.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: x.0.dtype(),
                found: self.dtype(),
            });
        }
        let pd = weight
            .map(|(s, _)| s.dtype())
            .or(want.weight)
            .or(want.bias)
            .unwrap_or(self.dtype());
        with_types!(self.dtype(), pd, T, W => {
            type A = <T as FloatElem>::A;
            let missing = || Error::dtype(OP, self.dtype());
            let g = rows_of(T::slice(self).ok_or_else(missing)?, layout)?;
            let xs = rows_of(T::slice(x.0).ok_or_else(missing)?, x.1)?;
            let (m, rs) = (stat::<A>(mean)?, stat::<A>(rstd)?);
            let w = params(param_slice::<W>(weight)?);
            let sums = want.weight.is_some() || want.bias.is_some();
            // A gradient only read: dx starts as its copy and is added into in place.
            let mut copied = match addend {
                Some(a) if want.input && dx_into.is_none() => {
                    let a = T::slice(a).ok_or_else(missing)?;
                    if a.len() < xs.len() {
                        return Err(Error::invalid(OP, format!(
                            "the gradient to add dx to holds {} elements, x {}",
                            a.len(),
                            xs.len()
                        )));
                    }
                    Some(a[..xs.len()].to_vec())
                }
                Some(_) if dx_into.is_some() => {
                    return Err(Error::invalid(OP, "a gradient to add dx into and one to add it to: pass one"));
                }
                _ => None,
            };
            let into = match dx_into {
                None if copied.is_some() => copied.as_deref_mut(),
                Some(d) if want.input => {
                    let d = T::slice_mut(d).ok_or_else(missing)?;
                    if d.len() != xs.len() {
                        return Err(Error::invalid(OP, format!(
                            "the gradient to add dx to holds {} elements, x {}",
                            d.len(),
                            xs.len()
                        )));
                    }
                    Some(d)
                }
                _ => None,
            };
            let (dx, total) = backward::<T>(g, xs, m, rs, w.as_deref(), n, want.input, into, sums);
            let dx = dx.or(copied);
            let part = |dtype: Option<DType>, half: usize| -> Result<Option<CpuStorage>> {
                match (dtype, &total) {
                    (Some(d), Some(t)) => Ok(Some(param_storage(&t[half * n..(half + 1) * n], d)?)),
                    _ => Ok(None),
                }
            };
            Ok([dx.map(T::wrap), part(want.weight, 0)?, part(want.bias, 1)?, None])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_and_gradients_of_a_small_row() {
        // x = [1, 2, 3, 4]: mean 2.5, var 1.25.
        let x = [1.0f64, 2.0, 3.0, 4.0];
        let (y, mean, rstd) = forward::<f64>(&x, None, None, 4, 0.0);
        assert_eq!(mean, [2.5]);
        assert!((rstd[0] - 1.0 / 1.25f64.sqrt()).abs() < 1e-15);
        assert!((y.iter().sum::<f64>()).abs() < 1e-12);
        // A constant output gradient gives no input gradient (the output's mean is fixed).
        let g = [1.0f64; 4];
        let (dx, sums) = backward::<f64>(&g, &x, &mean, &rstd, None, 4, true, None, true);
        assert!(dx.unwrap().iter().all(|d| d.abs() < 1e-12));
        let sums = sums.unwrap();
        assert_eq!(&sums[4..], &[1.0; 4]);
    }
}
