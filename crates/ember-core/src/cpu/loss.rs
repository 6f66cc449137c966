//! The negative log-likelihood of class-index targets (`nll_loss_forward` /
//! `nll_loss_backward`, the fused end of `cross_entropy`), as `cuda_backend/loss.rs` computes it: the
//! weighted sum accumulates in f64 over the rows in order, then rounds once to the dtype.

use super::{CpuElement, CpuStorage};
use crate::backend::{BackendStorage, CrossEntropyParams, LossOps, Reduction};
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result};
use half::{bf16, f16};

const OP: &str = "nll_loss";

/// The `m` targets as i64, each checked to be `ignore_index` or a class in `0..c`.
fn targets(target: &CpuStorage, m: usize, c: usize, ignore_index: i64) -> Result<Vec<i64>> {
    targets_named(OP, target, m, c, ignore_index)
}

/// [`targets`] for op `op`.
pub(super) fn targets_named(
    op: &'static str,
    target: &CpuStorage,
    m: usize,
    c: usize,
    ignore_index: i64,
) -> Result<Vec<i64>> {
    let t: Vec<i64> = match target {
        CpuStorage::I64(v) => v[..m].to_vec(),
        CpuStorage::I32(v) => v[..m].iter().map(|&x| x as i64).collect(),
        other => return Err(Error::dtype(op, other.dtype())),
    };
    match t
        .iter()
        .find(|&&i| i != ignore_index && (i < 0 || i as usize >= c))
    {
        Some(&bad) => Err(Error::IndexOutOfRange {
            op,
            index: bad,
            dim: 1,
            size: c,
        }),
        None => Ok(t),
    }
}

/// The class weight of target `t`, as f64 (1 without weights).
fn weight_of<T: CpuElement>(weight: Option<&[T]>, t: i64) -> f64 {
    weight.map_or(1.0, |w| w[t as usize].to_f64())
}

fn forward<T: CpuElement>(
    logp: &[T],
    t: &[i64],
    weight: Option<&[T]>,
    c: usize,
    ignore_index: i64,
    mean: bool,
) -> (CpuStorage, CpuStorage) {
    let (mut loss, mut total) = (0.0f64, 0.0f64);
    for (row, &ti) in t.iter().enumerate().filter(|&(_, &ti)| ti != ignore_index) {
        let w = weight_of(weight, ti);
        loss -= w * logp[row * c + ti as usize].to_f64();
        total += w;
    }
    if mean {
        loss /= total;
    }
    (
        T::wrap(vec![T::from_f64(loss)]),
        T::wrap(vec![T::from_f64(total)]),
    )
}

fn backward<T: CpuElement>(
    g: &[T],
    t: &[i64],
    weight: Option<&[T]>,
    total: &[T],
    c: usize,
    ignore_index: i64,
    mean: bool,
) -> Result<CpuStorage> {
    let mut out = crate::memory::try_filled(OP, t.len() * c, T::DTYPE, T::zero())?;
    let scale = g[0].to_f64() / if mean { total[0].to_f64() } else { 1.0 };
    for (row, &ti) in t.iter().enumerate().filter(|&(_, &ti)| ti != ignore_index) {
        out[row * c + ti as usize] = T::from_f64(-weight_of(weight, ti) * scale);
    }
    Ok(T::wrap(out))
}

macro_rules! float_rows {
    ($x:expr, $($other:expr),* ; $v:ident, $o:ident => $body:expr) => {
        match $x {
            CpuStorage::F32($v) => { let $o = ($(<f32 as CpuElement>::slice($other)),*); $body }
            CpuStorage::F64($v) => { let $o = ($(<f64 as CpuElement>::slice($other)),*); $body }
            CpuStorage::F16($v) => { let $o = ($(<f16 as CpuElement>::slice($other)),*); $body }
            CpuStorage::BF16($v) => { let $o = ($(<bf16 as CpuElement>::slice($other)),*); $body }
            other => return Err(Error::dtype(OP, other.dtype())),
        }
    };
}

/// The slice of an operand that must have the loss's dtype.
fn same_dtype<T>(s: Option<&[T]>, dtype: DType) -> Result<&[T]> {
    s.ok_or(Error::UnsupportedDType {
        op: OP,
        dtype,
        hint: "the class weights and the log-probabilities must have one dtype",
    })
}

impl LossOps for CpuStorage {
    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at
    /// `target` (see `LossOps::nll_loss_forward`).
    fn nll_loss_forward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CpuStorage, CpuStorage)> {
        let t = targets(target, m, c, ignore_index)?;
        let w = weight.unwrap_or(self);
        float_rows!(self, w; logp, w => {
            let w = if weight.is_some() { Some(same_dtype(w, self.dtype())?) } else { None };
            Ok(forward(logp, &t, w, c, ignore_index, mean))
        })
    }

    /// The `[m, c]` gradient of the loss for its gradient `self` (one element).
    fn nll_loss_backward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        total_weight: &CpuStorage,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CpuStorage> {
        check_host_alloc("nll_loss_backward", m.saturating_mul(c), self.dtype())?;
        let t = targets(target, m, c, ignore_index)?;
        let w = weight.unwrap_or(self);
        float_rows!(self, w, total_weight; g, o => {
            let (w, total) = o;
            let w = if weight.is_some() { Some(same_dtype(w, self.dtype())?) } else { None };
            backward(g, &t, w, same_dtype(total, self.dtype())?, c, ignore_index, mean)
        })
    }

    fn cross_entropy_forward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        p: &CrossEntropyParams,
    ) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
        let (n, c) = (p.n, p.c);
        let acc = acc_dtype(self.dtype());
        let t = targets_named(CE, target, n, c, p.ignore_index)?;
        let w = ce_weights(weight, acc, c)?;
        let big_w = w.as_ref().map_or(c as f64, |w| w.iter().sum());
        let eps = p.label_smoothing;
        let rows = with_rows(self, n, c, |i, row| {
            let lse = log_sum_exp(row);
            if t[i] == p.ignore_index {
                return (lse, 0.0, 0.0);
            }
            let ti = t[i] as usize;
            let wt = w.as_ref().map_or(1.0, |w| w[ti]);
            let mut loss = (1.0 - eps) * wt * (lse - row[ti]);
            if eps > 0.0 {
                let wx: f64 = match &w {
                    Some(w) => w.iter().zip(row).map(|(a, b)| a * b).sum(),
                    None => row.iter().sum(),
                };
                loss += eps / c as f64 * (big_w * lse - wx);
            }
            (lse, loss, wt)
        })?;
        let total_w: f64 = rows.iter().map(|r| r.2).sum();
        let losses: Vec<f64> = rows.iter().map(|r| r.1).collect();
        let loss = match p.reduction {
            Reduction::None => losses,
            Reduction::Sum => vec![losses.iter().sum()],
            Reduction::Mean => vec![losses.iter().sum::<f64>() / total_w],
        };
        let lse: Vec<f64> = rows.iter().map(|r| r.0).collect();
        Ok((
            float_storage(p.out_dtype, &loss)?,
            float_storage(acc, &lse)?,
            float_storage(acc, &[total_w, big_w])?,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        lse: &CpuStorage,
        total: &CpuStorage,
        grad: &CpuStorage,
        p: &CrossEntropyParams,
    ) -> Result<CpuStorage> {
        check_host_alloc("cross_entropy_backward", p.n.saturating_mul(p.c), self.dtype())?;
        let (n, c) = (p.n, p.c);
        let acc = acc_dtype(self.dtype());
        let t = targets_named(CE, target, n, c, p.ignore_index)?;
        let w = ce_weights(weight, acc, c)?;
        let (lse, total, g) = (float_values(lse)?, float_values(total)?, float_values(grad)?);
        p.check_backward_lengths(lse.len(), total.len(), g.len())?;
        let eps = p.label_smoothing;
        let per_row = p.reduction == Reduction::None;
        let divisor = if p.reduction == Reduction::Mean {
            total[0]
        } else {
            1.0
        };
        let big_w = total[1];
        let mut out = Vec::with_capacity(n * c);
        with_rows(self, n, c, |i, row| {
            if t[i] == p.ignore_index {
                out.extend(std::iter::repeat_n(0.0, c));
                return;
            }
            let ti = t[i] as usize;
            let s = g[if per_row { i } else { 0 }] / divisor;
            let a = s * (1.0 - eps) * w.as_ref().map_or(1.0, |w| w[ti]);
            let b = s * eps / c as f64;
            for (j, &x) in row.iter().enumerate() {
                let pj = (x - lse[i]).exp();
                let wj = w.as_ref().map_or(1.0, |w| w[j]);
                let hot = if j == ti { a } else { 0.0 };
                out.push((a + b * big_w) * pj - hot - b * wj);
            }
        })?;
        float_storage(self.dtype(), &out)
    }
}

// ---- The fused classifier (cross_entropy_forward / cross_entropy_backward) ----
//
// The formulas of `kernels/loss.cu`, per row of logits x with target t, class weights w (1
// without), W = Σ_c w[c], C classes and smoothing ε:
//   lse  = max + ln Σ_c exp(x[c] - max)
//   loss = (1 - ε)·w[t]·(lse - x[t]) + ε/C·(W·lse - Σ_c w[c]·x[c])
//   dx[j] = s·((1 - ε)·w[t]·(p[j] - [j = t]) + ε/C·(W·p[j] - w[j])),  p[j] = exp(x[j] - lse)
// where s is the loss gradient of the row (divided by Σ w[t] over the counted rows for the
// mean). Here every row is computed in f64; the saved lse is rounded to the accumulation dtype
// as the GPU keeps it, and the backward reads that rounded value, as the GPU does.

const CE: &str = "cross_entropy";

/// Elements of a float storage as f64.
fn float_values(s: &CpuStorage) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v.clone(),
        CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        other => return Err(Error::dtype(CE, other.dtype())),
    })
}

/// A float storage of `dtype` holding `v`, each value rounded once.
fn float_storage(dtype: DType, v: &[f64]) -> Result<CpuStorage> {
    fn conv<T: CpuElement>(v: &[f64]) -> CpuStorage {
        T::wrap(v.iter().map(|&x| T::from_f64(x)).collect())
    }
    Ok(match dtype {
        DType::F32 => conv::<f32>(v),
        DType::F64 => conv::<f64>(v),
        DType::F16 => conv::<f16>(v),
        DType::BF16 => conv::<bf16>(v),
        other => return Err(Error::dtype(CE, other)),
    })
}

/// The accumulation dtype of logits of `dtype` (the GPU's `Acc<T>`).
fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The class weights as f64 (`c` of them), checked to be of the accumulation dtype.
fn ce_weights(weight: Option<&CpuStorage>, acc: DType, c: usize) -> Result<Option<Vec<f64>>> {
    match weight {
        None => Ok(None),
        Some(w) if w.dtype() == acc && w.len() >= c => Ok(Some(float_values(w)?[..c].to_vec())),
        Some(w) => Err(Error::DTypeMismatch {
            op: CE,
            expected: acc,
            found: w.dtype(),
        }),
    }
}

/// The first `n` rows of `c` logits of `x` as f64, one row at a time (no f64 copy of the
/// whole input; the storage may hold more than `n` rows).
fn with_rows<R>(x: &CpuStorage, n: usize, c: usize, mut f: impl FnMut(usize, &[f64]) -> R) -> Result<Vec<R>> {
    fn go<T: CpuElement, R>(
        v: &[T],
        n: usize,
        c: usize,
        f: &mut impl FnMut(usize, &[f64]) -> R,
    ) -> Result<Vec<R>> {
        if v.len() < n.saturating_mul(c) {
            return Err(Error::invalid(
                CE,
                format!("{} logits for {n} rows of {c}", v.len()),
            ));
        }
        let mut row = vec![0.0f64; c];
        Ok((0..n)
            .map(|i| {
                for (o, x) in row.iter_mut().zip(&v[i * c..(i + 1) * c]) {
                    *o = x.to_f64();
                }
                f(i, &row)
            })
            .collect())
    }
    match x {
        CpuStorage::F32(v) => go(v, n, c, &mut f),
        CpuStorage::F64(v) => go(v, n, c, &mut f),
        CpuStorage::F16(v) => go(v, n, c, &mut f),
        CpuStorage::BF16(v) => go(v, n, c, &mut f),
        other => Err(Error::dtype(CE, other.dtype())),
    }
}

/// ln Σ exp(row) in f64; NaN if any value is NaN, -inf for a row of -inf (or no class).
fn log_sum_exp(row: &[f64]) -> f64 {
    let mut m = f64::NEG_INFINITY;
    for &x in row {
        if x.is_nan() {
            return x;
        }
        m = m.max(x);
    }
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + row.iter().map(|&x| (x - m).exp()).sum::<f64>().ln()
}
