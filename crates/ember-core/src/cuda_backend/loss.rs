//! CUDA launchers of the class-index negative log-likelihood (`nll_loss_T_I` and
//! `nll_loss_backward_T_I` of `kernels/index.cu`), with the CPU's semantics (`cpu/loss.rs`).
//! The forward is one block: a loss reduces to one value, and the rows of a classifier batch
//! are few (the kernel walks any number). A target out of range is recorded on the device and
//! reported at the next synchronizing call (Note [Deferred device errors]), so the loss can be
//! captured into a CUDA graph.

use super::device_errors::Kind;
use super::kernels::Grid;
use super::launch::{self, DevPtr};
use super::storage::CudaStorage;
use crate::backend::LossOps;
use crate::{DType, Error, Result};

const OP: &str = "nll_loss";

/// The optional class weights (`c` of them), checked to be of `dtype`.
fn weight_ptr(weight: Option<&CudaStorage>, dtype: DType, c: usize) -> Result<Option<DevPtr<'_>>> {
    match weight {
        None => Ok(None),
        Some(w) if w.dtype() == dtype && w.len() >= c => Ok(Some(w.dev_ptr_at(0))),
        Some(w) => Err(Error::DTypeMismatch {
            op: OP,
            expected: dtype,
            found: w.dtype(),
        }),
    }
}

fn target_dtype(target: &CudaStorage) -> Result<DType> {
    match target.dtype() {
        d @ (DType::I64 | DType::I32) => Ok(d),
        dtype => Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            hint: "class-index targets must be int64 (or int32)",
        }),
    }
}

impl CudaStorage {
    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at
    /// `target` (see `LossOps::nll_loss_forward`).
    pub(crate) fn nll_loss_forward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let (dtype, idt) = (self.dtype(), target_dtype(target)?);
        if !dtype.is_floating_point() {
            return Err(Error::dtype(OP, dtype));
        }
        let rt = self.runtime()?;
        let w = weight_ptr(weight, dtype, c)?;
        let loss = CudaStorage::alloc_on(rt, dtype, 1)?;
        let total = CudaStorage::alloc_on(rt, dtype, 1)?;
        let (x, t) = (self.dev_ptr_at(0), target.dev_ptr_at(0));
        let (l, tw) = (loss.dev_ptr_mut_at(0), total.dev_ptr_mut_at(0));
        let (m64, c64, mean32) = (m as i64, c as i64, i32::from(mean));
        let check = rt.errors.check_args(OP, Kind::Index, 1, c);
        let block = (m.next_multiple_of(32)).clamp(32, 1024) as u32;
        // The caller passes contiguous storages of m·c log-probabilities and m targets (the
        // weight, when given, holds c values of T, checked above); `loss` and `total` hold one
        // T each; the kernel reads logp only at in-range targets; one block of a multiple of 32
        // threads.
        let grid = Grid {
            grid: (1, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        };
        let dtypes = [dtype, idt];
        launch::nll_loss(
            rt,
            &dtypes,
            grid,
            x,
            t,
            w,
            m64,
            c64,
            ignore_index,
            mean32,
            l,
            tw,
            &check,
        )?;
        Ok((loss, total))
    }

    /// The `[m, c]` gradient of that loss for its gradient `self` (one element).
    pub(crate) fn nll_loss_backward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        total_weight: &CudaStorage,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CudaStorage> {
        let (dtype, idt) = (self.dtype(), target_dtype(target)?);
        let rt = self.runtime()?;
        let w = weight_ptr(weight, dtype, c)?;
        let len = m.checked_mul(c).ok_or_else(|| {
            Error::invalid(
                "nll_loss_backward",
                format!("{m} rows of {c} classes overflow the address space"),
            )
        })?;
        let grad = CudaStorage::full(rt.ordinal, dtype, len, 0.0)?;
        if m == 0 {
            return Ok(grad);
        }
        let (g, t) = (self.dev_ptr_at(0), target.dev_ptr_at(0));
        let (tw, o) = (total_weight.dev_ptr_at(0), grad.dev_ptr_mut_at(0));
        let (m64, c64, mean32) = (m as i64, c as i64, i32::from(mean));
        // `g` and `total_weight` hold one T each, `target` m indices, the weight (when given) c
        // values; `grad` holds m·c zeros and is written only at in-range targets.
        let (dtypes, grid) = ([dtype, idt], Grid::linear(rt, m, 256));
        launch::nll_loss_backward(rt, &dtypes, grid, g, t, w, tw, m64, c64, ignore_index, mean32, o)?;
        Ok(grad)
    }
}

impl LossOps for CudaStorage {
    fn nll_loss_forward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CudaStorage, CudaStorage)> {
        CudaStorage::nll_loss_forward(self, target, weight, mc, ignore_index, mean)
    }

    fn nll_loss_backward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        total_weight: &CudaStorage,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CudaStorage> {
        CudaStorage::nll_loss_backward(self, target, weight, total_weight, mc, ignore_index, mean)
    }
}
