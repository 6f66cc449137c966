//! [`ShardedGradScaler`] (`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`): AMP's
//! loss scaling for sharded gradients.
//!
//! With FSDP each rank checks only its own rows of the gradients for inf/NaN, so an overflow
//! in one rank's rows would skip that rank's step and back off its scale alone, and the ranks'
//! parameters and scales would part. This scaler all-reduces every found-inf flag with
//! `ReduceOp::Max` over the group right after the check (ember-nn's
//! [`GradScaler::found_inf_hook`]), as PyTorch's does after `_unscale_grads_`: every rank then
//! skips the same steps and keeps the same scale. Under DDP or ZeRO every rank holds the same
//! averaged gradients already, and the plain [`GradScaler`] agrees across ranks by itself.

use std::ops::{Deref, DerefMut};

use ember_core::{no_grad, Result, Tensor};
use ember_nn::amp::GradScaler;

use crate::backend::ReduceOp;
use crate::group::{default_group, ProcessGroup};

/// A [`GradScaler`] whose found-inf flags are the maximum over the ranks of a process group
/// (`ShardedGradScaler(process_group=...)`); see the module docs. It dereferences to the
/// [`GradScaler`], so `scale`, `unscale_`, `step` and `update` are called as on one. Every rank
/// must call `unscale_`/`step` for the same optimizers in the same order (each check is a
/// collective).
///
/// ```no_run
/// use ember_distributed::fsdp::ShardedGradScaler;
/// # fn main() -> ember_core::Result<()> {
/// # let (loss, mut opt): (ember_core::Tensor, ember_nn::optim::SGD) = todo!();
/// let mut scaler = ShardedGradScaler::new(None)?; // over the default group
/// scaler.scale(&loss)?.backward()?;
/// scaler.step(&mut opt)?; // skipped on every rank when any rank's shard overflowed
/// scaler.update()?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ShardedGradScaler(GradScaler);

impl ShardedGradScaler {
    /// A scaler with PyTorch's defaults over `process_group` (the default group when `None`).
    pub fn new(process_group: Option<ProcessGroup>) -> Result<ShardedGradScaler> {
        let group = match process_group {
            Some(g) => g,
            None => default_group()?,
        };
        Ok(ShardedGradScaler::with_scaler(GradScaler::new(), group))
    }

    /// `scaler` (its settings as configured) with its found-inf flags reduced over
    /// `process_group`.
    pub fn with_scaler(scaler: GradScaler, process_group: ProcessGroup) -> ShardedGradScaler {
        ShardedGradScaler(scaler.found_inf_hook(move |flag| all_reduce_max(&process_group, flag)))
    }

    /// The scaler inside.
    pub fn into_inner(self) -> GradScaler {
        self.0
    }
}

/// Replaces `flag` by its maximum over the ranks of `group` (through a copy on the group's
/// device when the flag lives elsewhere).
fn all_reduce_max(group: &ProcessGroup, flag: &Tensor) -> Result<()> {
    if flag.device() == group.device() {
        return group.all_reduce(flag, ReduceOp::Max);
    }
    let on_group = flag.to(group.device())?;
    group.all_reduce(&on_group, ReduceOp::Max)?;
    let _g = no_grad();
    flag.copy_(&on_group)?;
    Ok(())
}

impl Deref for ShardedGradScaler {
    type Target = GradScaler;
    fn deref(&self) -> &GradScaler {
        &self.0
    }
}

impl DerefMut for ShardedGradScaler {
    fn deref_mut(&mut self) -> &mut GradScaler {
        &mut self.0
    }
}
