//! CPU kernels of softmax and log_softmax along one dim, and of their backward.
//!
//! The input is read contiguously (gathered once if it is not) and seen as [outer, K, inner]
//! with the softmax dim in the middle. With `inner == 1` (the last dim, the hot case) each row
//! of K is done in one go: its max, the sum of `exp(x - max)` (pairwise, see
//! `cpu::reduce`), then the outputs. Otherwise the per-column statistics are computed over
//! blocks of columns, vectorized across them, and every row of the output is then written in
//! parallel. Everything computes in the accumulator type (f32 for f16/bf16) and rounds once.
//!
//! Stability: softmax is `exp(x - max) / Σ exp(x - max)` and log_softmax is
//! `(x - max) - log Σ exp(x - max)`, so no exp overflows and large inputs stay exact.

use super::reduce::{fold, max_nan, Acc, Float, FloatElem};
use super::{gather_strided, CpuStorage, PAR_THRESHOLD};
use crate::backend::op::SoftmaxOp;
use crate::backend::{BackendStorage, SoftmaxOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{Error, Result};
use rayon::prelude::*;
use std::borrow::Cow;

/// Columns per statistics block in the [outer, K, inner] case.
const COLS: usize = 256;

/// The elements of `l` in row-major order, borrowed when they already are.
fn contiguous<'a, T: Copy + Send + Sync>(data: &'a [T], l: &Layout) -> Cow<'a, [T]> {
    match l.contiguous_range() {
        Some(r) => Cow::Borrowed(&data[r]),
        None => Cow::Owned(gather_strided(data, l)),
    }
}

/// The sizes (outer, K, inner) of `l` around `dim` (1, 1, 1 for a 0-d layout).
fn axis(l: &Layout, dim: usize) -> (usize, usize, usize) {
    let d = l.dims();
    if d.is_empty() {
        return (1, 1, 1);
    }
    (d[..dim].iter().product(), d[dim], d[dim + 1..].iter().product())
}

/// Calls `f(out_row, a_row, b_row, scratch)` on each row of `k`, in parallel when there is
/// enough work (each thread keeps its own scratch buffer).
fn for_rows<T, U, S, F>(out: &mut [U], a: &[T], b: &[T], k: usize, f: F)
where
    T: Sync,
    U: Send,
    S: Default + Send,
    F: Fn(&mut [U], &[T], &[T], &mut S) + Sync + Send,
{
    if out.len() >= PAR_THRESHOLD && out.len() > k {
        super::threads::parallel(|| {
            out.par_chunks_mut(k)
                .zip(a.par_chunks(k).zip(b.par_chunks(k)))
                .for_each_init(S::default, |s, (o, (a, b))| f(o, a, b, s))
        });
    } else {
        let mut s = S::default();
        for (o, (a, b)) in out.chunks_mut(k).zip(a.chunks(k).zip(b.chunks(k))) {
            f(o, a, b, &mut s);
        }
    }
}

/// Statistics of every (outer, inner) column: `unit(o, c0, c1)` gives those of columns
/// `c0..c1` of outer index `o`; the result is laid out as [outer, inner].
fn column_stats<S, F>(outer: usize, inner: usize, par: bool, unit: F) -> Vec<S>
where
    S: Send,
    F: Fn(usize, usize, usize) -> Vec<S> + Sync + Send,
{
    let per = inner.div_ceil(COLS);
    let run = |u: usize| {
        let (o, c) = (u / per, u % per);
        unit(o, c * COLS, ((c + 1) * COLS).min(inner))
    };
    let parts: Vec<Vec<S>> = if par {
        super::threads::parallel(|| (0..outer * per).into_par_iter().map(run).collect())
    } else {
        (0..outer * per).map(run).collect()
    };
    parts.into_iter().flatten().collect()
}

/// Softmax or log_softmax of one contiguous row.
/// Calls `f(r, chunk)` for each `len`-element chunk `r` of `out`, on rayon's pool if `par`.
fn each_chunk<U: Send, F: Fn(usize, &mut [U]) + Send + Sync>(out: &mut [U], len: usize, par: bool, f: F) {
    if par {
        super::threads::parallel(|| out.par_chunks_mut(len).enumerate().for_each(|(r, o)| f(r, o)));
    } else {
        out.chunks_mut(len).enumerate().for_each(|(r, o)| f(r, o));
    }
}

fn forward_row<T: FloatElem>(x: &[T], out: &mut [T], buf: &mut Vec<T::A>, log: bool) {
    let m = fold(x, T::A::NEG_INF, &|v: T| v.to_acc(), &max_nan);
    if log {
        let s = fold(x, T::A::ZERO, &|v: T| (v.to_acc() - m).exp(), &T::A::add);
        let ls = s.ln();
        for (o, &v) in out.iter_mut().zip(x) {
            *o = T::from_acc((v.to_acc() - m) - ls);
        }
    } else {
        buf.clear();
        buf.extend(x.iter().map(|&v| (v.to_acc() - m).exp()));
        let s = fold(buf, T::A::ZERO, &|e| e, &T::A::add);
        let inv = T::A::ONE / s;
        for (o, &e) in out.iter_mut().zip(buf.iter()) {
            *o = T::from_acc(e.mul(inv));
        }
    }
}

fn forward<T: FloatElem>(data: &[T], l: &Layout, dim: usize, log: bool) -> Vec<T> {
    let x = contiguous(data, l);
    let (outer, k, inner) = axis(l, dim);
    let mut out = vec![T::from_acc(T::A::ZERO); x.len()];
    if x.is_empty() {
        return out;
    }
    if inner == 1 {
        for_rows(&mut out, &x, &x, k, |o, r, _, buf: &mut Vec<T::A>| {
            forward_row(r, o, buf, log)
        });
        return out;
    }
    let par = x.len() >= PAR_THRESHOLD;
    let at =
        |o: usize, kk: usize, c0: usize, c1: usize| &x[(o * k + kk) * inner + c0..(o * k + kk) * inner + c1];
    // (max, then log Σ exp or 1 / Σ exp) of every column.
    let stats = column_stats(outer, inner, par, |o, c0, c1| {
        let mut m = vec![T::A::NEG_INF; c1 - c0];
        for kk in 0..k {
            for (mi, &v) in m.iter_mut().zip(at(o, kk, c0, c1)) {
                *mi = max_nan(*mi, v.to_acc());
            }
        }
        let mut s = vec![T::A::ZERO; c1 - c0];
        for kk in 0..k {
            for ((si, &mi), &v) in s.iter_mut().zip(&m).zip(at(o, kk, c0, c1)) {
                *si = si.add((v.to_acc() - mi).exp());
            }
        }
        let fin = |s: T::A| if log { s.ln() } else { T::A::ONE / s };
        m.into_iter().zip(s).map(|(m, s)| (m, fin(s))).collect()
    });
    let rows = |r: usize, o: &mut [T]| {
        let (x, st) = (
            &x[r * inner..(r + 1) * inner],
            &stats[(r / k) * inner..(r / k + 1) * inner],
        );
        for ((o, &v), &(m, t)) in o.iter_mut().zip(x).zip(st) {
            let d = v.to_acc() - m;
            *o = T::from_acc(if log { d - t } else { d.exp().mul(t) });
        }
    };
    each_chunk(&mut out, inner, par, rows);
    out
}

/// The input gradient from the output `y` and its gradient `g`:
/// softmax `y (g - Σ g y)`, log_softmax `g - exp(y) Σ g`.
fn backward<T: FloatElem>(y: &[T], yl: &Layout, g: &[T], gl: &Layout, dim: usize, log: bool) -> Vec<T> {
    let (y, g) = (contiguous(y, yl), contiguous(g, gl));
    let (outer, k, inner) = axis(yl, dim);
    let mut out = vec![T::from_acc(T::A::ZERO); y.len()];
    if y.is_empty() {
        return out;
    }
    let grad = move |y: T::A, g: T::A, s: T::A| if log { g - y.exp().mul(s) } else { y.mul(g - s) };
    if inner == 1 {
        for_rows(&mut out, &y, &g, k, |o, y, g, buf: &mut Vec<T::A>| {
            let s = if log {
                fold(g, T::A::ZERO, &|v: T| v.to_acc(), &T::A::add)
            } else {
                buf.clear();
                buf.extend(y.iter().zip(g).map(|(&a, &b)| a.to_acc().mul(b.to_acc())));
                fold(buf, T::A::ZERO, &|e| e, &T::A::add)
            };
            for ((o, &a), &b) in o.iter_mut().zip(y).zip(g) {
                *o = T::from_acc(grad(a.to_acc(), b.to_acc(), s));
            }
        });
        return out;
    }
    let par = y.len() >= PAR_THRESHOLD;
    let span =
        |o: usize, kk: usize, c0: usize, c1: usize| (o * k + kk) * inner + c0..(o * k + kk) * inner + c1;
    let stats = column_stats(outer, inner, par, |o, c0, c1| {
        let mut s = vec![T::A::ZERO; c1 - c0];
        for kk in 0..k {
            let r = span(o, kk, c0, c1);
            for ((si, &a), &b) in s.iter_mut().zip(&y[r.clone()]).zip(&g[r]) {
                let term = if log {
                    b.to_acc()
                } else {
                    a.to_acc().mul(b.to_acc())
                };
                *si = si.add(term);
            }
        }
        s
    });
    let rows = |r: usize, o: &mut [T]| {
        let span = r * inner..(r + 1) * inner;
        let st = &stats[(r / k) * inner..(r / k + 1) * inner];
        for (((o, &a), &b), &s) in o.iter_mut().zip(&y[span.clone()]).zip(&g[span]).zip(st) {
            *o = T::from_acc(grad(a.to_acc(), b.to_acc(), s));
        }
    };
    each_chunk(&mut out, inner, par, rows);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn middle_dim_matches_last_dim_after_transpose() {
        // [2, 3, 4] softmax over dim 1 equals softmax over the last dim of its [2, 4, 3] transpose.
        let data: Vec<f64> = (0..24).map(|i| ((i * 37) % 11) as f64 - 5.0).collect();
        let l = Layout::contiguous([2, 3, 4]);
        let mid = forward(&data, &l, 1, false);
        let t = l.transpose(1, 2);
        let last = forward(&data, &t, 2, false); // rows of the [2, 4, 3] view
        let back = gather_strided(&last, &Layout::contiguous([2, 4, 3]).transpose(1, 2));
        for (a, b) in mid.iter().zip(&back) {
            assert!((a - b).abs() < 1e-15, "{a} vs {b}");
        }
    }
}

impl SoftmaxOps for CpuStorage {
    /// Softmax or log_softmax along `dim` of `layout`, as a row-major storage of its shape.
    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<CpuStorage> {
        use CpuStorage::*;
        check_host_alloc(op.name(), layout.numel(), self.dtype())?;
        let log = op == SoftmaxOp::LogSoftmax;
        Ok(match self {
            F32(v) => F32(forward(v, layout, dim, log)),
            F64(v) => F64(forward(v, layout, dim, log)),
            F16(v) => F16(forward(v, layout, dim, log)),
            BF16(v) => BF16(forward(v, layout, dim, log)),
            _ => return Err(Error::dtype(op.name(), self.dtype())),
        })
    }

    /// The gradient of softmax/log_softmax along `dim` from its output (`self`) and the
    /// output's gradient, which has the same shape and dtype.
    fn softmax_backward(
        &self,
        yl: &Layout,
        grad: &CpuStorage,
        gl: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<CpuStorage> {
        use CpuStorage::*;
        check_host_alloc(op.name(), yl.numel(), self.dtype())?;
        let log = op == SoftmaxOp::LogSoftmax;
        Ok(match (self, grad) {
            (F32(y), F32(g)) => F32(backward(y, yl, g, gl, dim, log)),
            (F64(y), F64(g)) => F64(backward(y, yl, g, gl, dim, log)),
            (F16(y), F16(g)) => F16(backward(y, yl, g, gl, dim, log)),
            (BF16(y), BF16(g)) => BF16(backward(y, yl, g, gl, dim, log)),
            _ => {
                return Err(Error::DTypeMismatch {
                    op: op.name(),
                    expected: self.dtype(),
                    found: grad.dtype(),
                })
            }
        })
    }
}
