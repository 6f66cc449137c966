//! The negative log-likelihood of class-index targets (`nll_loss_forward` /
//! `nll_loss_backward`, the fused end of `cross_entropy`), as `cuda_backend/loss.rs` computes it: the
//! weighted sum accumulates in f64 over the rows in order, then rounds once to the dtype.

use super::{CpuElement, CpuStorage};
use crate::backend::LossOps;
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result};
use half::{bf16, f16};

const OP: &str = "nll_loss";

/// The `m` targets as i64, each checked to be `ignore_index` or a class in `0..c`.
fn targets(target: &CpuStorage, m: usize, c: usize, ignore_index: i64) -> Result<Vec<i64>> {
    let t: Vec<i64> = match target {
        CpuStorage::I64(v) => v[..m].to_vec(),
        CpuStorage::I32(v) => v[..m].iter().map(|&x| x as i64).collect(),
        other => return Err(Error::dtype(OP, other.dtype())),
    };
    match t
        .iter()
        .find(|&&i| i != ignore_index && (i < 0 || i as usize >= c))
    {
        Some(&bad) => Err(Error::IndexOutOfRange {
            op: OP,
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

impl CpuStorage {
    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at
    /// `target` (see `LossOps::nll_loss_forward`).
    pub(crate) fn nll_loss_forward(
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
    pub(crate) fn nll_loss_backward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        total_weight: &CpuStorage,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CpuStorage> {
        let t = targets(target, m, c, ignore_index)?;
        let w = weight.unwrap_or(self);
        float_rows!(self, w, total_weight; g, o => {
            let (w, total) = o;
            let w = if weight.is_some() { Some(same_dtype(w, self.dtype())?) } else { None };
            backward(g, &t, w, same_dtype(total, self.dtype())?, c, ignore_index, mean)
        })
    }
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
    fn nll_loss_forward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CpuStorage, CpuStorage)> {
        CpuStorage::nll_loss_forward(self, target, weight, mc, ignore_index, mean)
    }

    fn nll_loss_backward(
        &self,
        target: &CpuStorage,
        weight: Option<&CpuStorage>,
        total_weight: &CpuStorage,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CpuStorage> {
        check_host_alloc("nll_loss_backward", mc.0.saturating_mul(mc.1), self.dtype())?;
        CpuStorage::nll_loss_backward(self, target, weight, total_weight, mc, ignore_index, mean)
    }
}
