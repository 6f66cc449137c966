//! Gradient clipping over FSDP shards (`torch.nn.utils.clip_grad_norm_` of DTensor gradients):
//! the norm of the whole gradients, not of this rank's rows.
//!
//! ember-nn's `clip_grad_norm_` over the shards would compute each rank's norm of its own
//! rows, clip each rank by its own coefficient, and so let the ranks' parameters part. Here
//! each shard's gradient contributes `‖g‖ₚᵖ` (its largest `|g|` for the inf-norm) to a partial
//! that is all-reduced (sum, or max) over its unit's group, unsharded gradients count once,
//! and every rank clips by the same coefficient, computed as ember-nn's is.

use ember_core::{no_grad, DType, Device, Result, Tensor};

use super::state_dict::find_dtensor;
use crate::backend::ReduceOp;
use crate::group::ProcessGroup;

/// Scales the gradients of `params` (FSDP shards, any others) so that the `norm_type`-norm of
/// the whole gradients, over every rank's rows, is at most `max_norm`; returns that total norm
/// before clipping, a 0-d tensor, the same on every rank (`torch.nn.utils.clip_grad_norm_`
/// over an FSDP2 model's parameters). `norm_type` may be `f64::INFINITY`. Collective over each
/// sharded unit's group: every rank must pass the same parameters.
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Tensor> {
    let _g = no_grad();
    let mut replicated: Vec<Tensor> = Vec::new();
    // Per group of ranks: a group and its shards' gradients.
    let mut sharded: Vec<(ProcessGroup, Vec<Tensor>)> = Vec::new();
    for p in params {
        let Some(g) = p.grad() else { continue };
        match find_dtensor(p).transpose()? {
            Some(d) => {
                let group = d.device_mesh().get_group();
                match sharded.iter_mut().find(|(pg, _)| pg.ranks() == group.ranks()) {
                    Some((_, grads)) => grads.push(g),
                    None => sharded.push((group.clone(), vec![g])),
                }
            }
            None => replicated.push(g),
        }
    }
    let Some(first) = sharded
        .iter()
        .flat_map(|(_, g)| g.first())
        .chain(replicated.first())
        .next()
        .cloned()
    else {
        return Tensor::scalar(0.0, DType::F32, Device::Cpu);
    };
    let (device, dtype) = (first.device(), first.dtype());
    let inf = norm_type.is_infinite();
    // As ember-nn's: float32 gradients on one GPU take the multi-tensor norm and multiply (a
    // few launches for any number of gradients), the others a norm and a multiply each.
    let all = || sharded.iter().flat_map(|(_, g)| g).chain(&replicated);
    let foreach = device.is_cuda()
        && (norm_type == 2.0 || norm_type == f64::INFINITY)
        && all().all(|g| g.device() == device && g.dtype() == DType::F32);
    // `‖g‖ₚᵖ` summed (max of `‖g‖∞`) over `grads`, as a 0-d tensor on `device`.
    let partial = |grads: &[Tensor]| -> Result<Tensor> {
        let grads: Vec<Tensor> = grads.iter().filter(|g| g.numel() > 0).cloned().collect();
        if grads.is_empty() {
            return Tensor::scalar(0.0, dtype, device);
        }
        let norms = if foreach {
            ember_core::fused::foreach_norm(&grads, norm_type)?
        } else {
            let norms = grads
                .iter()
                .map(|g| g.norm(norm_type, &[], false)?.to_dtype(dtype)?.to(device))
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&norms, 0)?
        };
        if inf {
            norms.max_all()
        } else {
            norms.pow_scalar(norm_type)?.sum_all()
        }
    };
    let mut parts = vec![partial(&replicated)?];
    for (group, grads) in &sharded {
        let local = partial(grads)?.to(group.device())?;
        let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
        group.all_reduce(&local, op)?;
        parts.push(local.to(device)?);
    }
    let parts = Tensor::stack(&parts, 0)?;
    let total_norm = if inf {
        parts.max_all()?
    } else {
        parts.sum_all()?.pow_scalar(1.0 / norm_type)?
    };
    // As ember-nn's clip_grad_norm_: `max_norm / (total + 1e-6)`, at most 1, always applied.
    let clip_coef = total_norm.add_scalar(1e-6)?.reciprocal()?.mul_scalar(max_norm)?;
    let clip_coef = clip_coef.clamp(None, Some(1.0))?;
    if foreach {
        let grads: Vec<Tensor> = all().filter(|g| g.numel() > 0).cloned().collect();
        ember_core::fused::foreach_mul_(&grads, &clip_coef.reshape([1])?)?;
    } else {
        for g in all() {
            g.mul_(&clip_coef.to(g.device())?)?;
        }
    }
    Ok(total_norm)
}
