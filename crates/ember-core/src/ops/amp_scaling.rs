//! GradScaler's device side (`torch._amp_foreach_non_finite_check_and_unscale_`,
//! `torch._amp_update_scale_`): [`non_finite_check_and_unscale_`] multiplies many gradients in
//! place by an inverse scale and raises a found-inf flag when any value is inf or NaN (one
//! multi-tensor kernel per dtype on CUDA), and [`update_scale_`] backs the scale off or grows
//! it from that flag (one single-thread kernel). This file checks the tensors and locks their
//! storages; the backends run the kernels (`AmpOps::non_finite_check_and_unscale` /
//! `update_scale`, operands described in `backend/step.rs`).
//!
//! Note [AMP scalars live on the device]: the scale, inverse scale and found-inf flag are 0-d
//! (or one-element) f32 tensors, and the growth tracker a one-element i32 tensor, on the
//! gradients' device; the kernels read and write them there. Nothing here reads a value back to
//! the host, so a mixed-precision step never waits for the GPU (and can be captured in a CUDA
//! graph); the fused optimizer steps take the same tensors (`ember_core::fused::GradScaling`)
//! and skip on the device. On the CPU the "device" is host memory, read directly.
//!
//! These ops write in place outside autograd: each written storage's version is bumped once,
//! and writing a tensor that requires grad is an error while grad mode is on.

use crate::autograd;
use crate::backend::{Elems, ForeachNorm, ScaleUpdate, UnscaleGrads};
use crate::dispatch::{self, policy};
use crate::storage::{Storage, StorageRef};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// Checks that `t` is a one-element tensor of `dtype` on `device`; `what` names it in errors.
pub(crate) fn check_scalar(
    op: &'static str,
    what: &str,
    t: &Tensor,
    dtype: DType,
    device: Device,
) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::invalid(
            op,
            format!("{what} must be a {dtype} tensor, got {}", t.dtype()),
        ));
    }
    if t.numel() != 1 {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be a one-element tensor, it has {} elements",
                t.numel()
            ),
        ));
    }
    if t.device() != device {
        return Err(crate::dispatch::device_mismatch(op, device, t.device()));
    }
    Ok(())
}

/// Errors when `t` is written in place while it takes part in autograd.
pub(crate) fn check_writable(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if autograd::is_grad_enabled() && t.requires_grad() {
        return Err(Error::Autograd(format!(
            "{op} writes {what}, which requires grad, in place; wrap the call in no_grad()"
        )));
    }
    Ok(())
}

/// True when the elements of `t` fill one gap-free range of its storage (any order of dims):
/// an elementwise in-place kernel may then run over `numel` elements from its first one.
fn is_dense(t: &Tensor) -> bool {
    let mut dims: Vec<(usize, usize)> = t
        .stride()
        .iter()
        .copied()
        .zip(t.dims().iter().copied())
        .filter(|&(_, d)| d != 1)
        .collect();
    dims.sort_unstable();
    let mut expected = 1;
    for (stride, size) in dims {
        if stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// A held lock on one storage.
enum Lock<'a> {
    Read(RwLockReadGuard<'a, Storage>),
    Write(RwLockWriteGuard<'a, Storage>),
}

/// The storages of one call, each locked once (several tensors may share one), in the order of
/// their ids so that two calls never wait on each other.
struct Locks<'a> {
    ids: Vec<usize>,
    locks: Vec<Lock<'a>>,
}

impl<'a> Locks<'a> {
    /// Locks every storage of `written` for writing (bumping its version once) and every one of
    /// `read` for reading. A storage both written and read is an error naming `op`.
    fn take(op: &'static str, written: &[&'a StorageRef], read: &[&'a StorageRef]) -> Result<Locks<'a>> {
        let mut all: Vec<(usize, bool, &'a StorageRef)> = written
            .iter()
            .map(|s| (s.id(), true, *s))
            .chain(read.iter().map(|s| (s.id(), false, *s)))
            .collect();
        all.sort_by_key(|&(id, write, _)| (id, !write));
        all.dedup_by(|b, a| a.0 == b.0 && a.1 == b.1);
        if all.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid(
                op,
                "a tensor that is read shares its storage with one that is written; pass separate tensors",
            ));
        }
        let ids = all.iter().map(|a| a.0).collect();
        let locks = all
            .into_iter()
            .map(|(_, write, s)| {
                if write {
                    Lock::Write(s.write())
                } else {
                    Lock::Read(s.read())
                }
            })
            .collect();
        Ok(Locks { ids, locks })
    }

    /// The locked storages with their ids, in id order: the written ones and the read ones.
    #[allow(clippy::type_complexity)]
    fn split(&mut self) -> (Vec<(usize, &mut Storage)>, Vec<(usize, &Storage)>) {
        let (mut written, mut read) = (Vec::new(), Vec::new());
        for (&id, lock) in self.ids.iter().zip(&mut self.locks) {
            match lock {
                Lock::Write(g) => written.push((id, &mut **g)),
                Lock::Read(g) => read.push((id, &**g)),
            }
        }
        (written, read)
    }
}

/// Removes the storage of id `id` from `storages` (it was locked).
fn take<S>(storages: &mut Vec<(usize, S)>, id: usize) -> S {
    let i = storages
        .iter()
        .position(|s| s.0 == id)
        .expect("storage was locked");
    storages.remove(i).1
}

/// The one element of a locked one-element tensor.
fn scalar<S>(storage: S, t: &Tensor) -> Elems<S> {
    Elems {
        storage,
        offset: t.storage_offset(),
        len: 1,
    }
}

/// Multiplies every gradient of `grads` in place by `inv_scale` and sets `found_inf` to 1.0
/// when any of their values is inf or NaN before the multiplication; `found_inf` is never
/// cleared here (`torch._amp_foreach_non_finite_check_and_unscale_`).
///
/// `found_inf` and `inv_scale` are one-element f32 tensors on the gradients' device (Note [AMP
/// scalars live on the device]). The gradients may be f32, f64, f16 or bf16, mixed: each dtype
/// is one multi-tensor kernel on CUDA (a few launches past 128 tensors), with no host
/// synchronization. They may be views of one buffer as long as no two overlap; a view whose
/// elements do not fill one range of its storage is unscaled through a contiguous copy.
pub fn non_finite_check_and_unscale_(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    let line = &policy::AMP_NON_FINITE_CHECK_AND_UNSCALE_;
    dispatch::enter(line, found_inf.device(), |_| {
        unscale_checked(grads, found_inf, inv_scale)
    })
}

fn unscale_checked(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    const OP: &str = "non_finite_check_and_unscale_";
    let device = found_inf.device();
    settle_list(grads)?;
    check_scalar(OP, "found_inf", found_inf, DType::F32, device)?;
    check_scalar(OP, "inv_scale", inv_scale, DType::F32, device)?;
    check_writable(OP, "found_inf", found_inf)?;
    for g in grads {
        if !g.dtype().is_floating_point() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: g.dtype(),
                hint: "; gradients to unscale are floating-point",
            });
        }
        if g.device() != device {
            return Err(crate::dispatch::device_mismatch(OP, device, g.device()));
        }
        check_writable(OP, "a gradient", g)?;
        if g.storage().same_storage(found_inf.storage()) {
            return Err(Error::invalid(OP, "found_inf shares its storage with a gradient"));
        }
    }
    // The tensors the kernels run over: the dense gradients themselves, and a contiguous copy
    // of each other one, written back below.
    let _g = autograd::no_grad();
    let mut work: Vec<Tensor> = Vec::with_capacity(grads.len());
    let mut copied: Vec<(usize, usize)> = Vec::new();
    for (i, g) in grads.iter().enumerate() {
        if g.numel() == 0 {
            continue;
        }
        if is_dense(g) {
            work.push(g.clone());
        } else {
            copied.push((i, work.len()));
            work.push(g.contiguous()?);
        }
    }
    {
        let mut written: Vec<&StorageRef> = work.iter().map(|t| t.storage()).collect();
        written.push(found_inf.storage());
        let mut locks = Locks::take(OP, &written, &[inv_scale.storage()])?;
        let (mut written, mut read) = locks.split();
        let found = scalar(take(&mut written, found_inf.storage().id()), found_inf);
        let inv = scalar(take(&mut read, inv_scale.storage().id()), inv_scale);
        // The other written storages are the gradients', in id order.
        let ids: Vec<usize> = written.iter().map(|w| w.0).collect();
        let grads = UnscaleGrads {
            storages: written.into_iter().map(|w| w.1).collect(),
            grads: work
                .iter()
                .map(|t| Elems {
                    storage: ids
                        .binary_search(&t.storage().id())
                        .expect("gradient storage was locked"),
                    offset: t.storage_offset(),
                    len: t.numel(),
                })
                .collect(),
        };
        // The locks are held until the backend has run (every launch enqueued).
        Storage::non_finite_check_and_unscale(grads, found, inv)?;
    }
    for (i, w) in copied {
        grads[i].copy_(&work[w])?;
    }
    Ok(())
}

/// Updates `scale` and `growth_tracker` in place from `found_inf`
/// (`torch._amp_update_scale_`): when `found_inf` is nonzero the scale is multiplied by
/// `backoff_factor` and the tracker reset to 0; otherwise the tracker counts one more clean
/// step and, when it reaches `growth_interval`, the scale is multiplied by `growth_factor`
/// (unless that overflows f32) and the tracker reset. The products are taken in f64 and rounded
/// to f32, as PyTorch's kernel does.
///
/// `scale` and `found_inf` are one-element f32 tensors, `growth_tracker` a one-element i32
/// tensor, all on one device (Note [AMP scalars live on the device]); on CUDA this is one
/// single-thread kernel and the host never waits.
pub fn update_scale_(
    scale: &Tensor,
    growth_tracker: &Tensor,
    found_inf: &Tensor,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
) -> Result<()> {
    dispatch::enter(&policy::AMP_UPDATE_SCALE_, scale.device(), |_| {
        update_scale_checked(
            scale,
            growth_tracker,
            found_inf,
            growth_factor,
            backoff_factor,
            growth_interval,
        )
    })
}

fn update_scale_checked(
    scale: &Tensor,
    growth_tracker: &Tensor,
    found_inf: &Tensor,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
) -> Result<()> {
    const OP: &str = "update_scale_";
    let device = scale.device();
    check_scalar(OP, "scale", scale, DType::F32, device)?;
    check_scalar(OP, "growth_tracker", growth_tracker, DType::I32, device)?;
    check_scalar(OP, "found_inf", found_inf, DType::F32, device)?;
    check_writable(OP, "scale", scale)?;
    let interval = i32::try_from(growth_interval).map_err(|_| {
        Error::invalid(
            OP,
            format!("growth_interval {growth_interval} does not fit the i32 growth tracker"),
        )
    })?;
    if scale.storage().same_storage(growth_tracker.storage()) {
        return Err(Error::invalid(OP, "scale and growth_tracker share a storage"));
    }
    let mut locks = Locks::take(
        OP,
        &[scale.storage(), growth_tracker.storage()],
        &[found_inf.storage()],
    )?;
    let (mut written, mut read) = locks.split();
    let s = scalar(take(&mut written, scale.storage().id()), scale);
    let g = scalar(take(&mut written, growth_tracker.storage().id()), growth_tracker);
    let f = scalar(take(&mut read, found_inf.storage().id()), found_inf);
    let rule = ScaleUpdate {
        growth_factor,
        backoff_factor,
        growth_interval: interval,
    };
    Storage::update_scale(&rule, s, g, f)
}

/// The dispatch point's step 1b for a list these ops read and write (Note [Copies in row
/// blocks] in `storage/row_blocks.rs`): a tensor still arriving (a gradient
/// DistributedDataParallel is still averaging) is waited for, as any other op's operand is.
fn settle_list(tensors: &[Tensor]) -> Result<()> {
    let refs: Vec<&Tensor> = tensors.iter().collect();
    dispatch::row_blocks::settle(&refs, |_, _| false)
}

/// The norm of order `ord` (2, or `f64::INFINITY` for the largest |x|) of each of `tensors`, as
/// one f32 tensor `[tensors.len()]` on their device (`torch._foreach_norm`, stacked): on a GPU
/// two launches per 128 tensors whatever their number, deterministic, with nothing read back
/// (`kernels/amp.cu`). The tensors are of one floating dtype, on one device, any layout (a
/// view whose elements do not fill one range of its storage is read through a contiguous
/// copy); squares are summed in f32 (f64 on the CPU, and for f64 tensors on the GPU in f64
/// per chunk, f32 across chunks). Not differentiable. Used by `clip_grad_norm_`.
pub fn foreach_norm(tensors: &[Tensor], ord: f64) -> Result<Tensor> {
    const OP: &str = "_foreach_norm";
    let Some(first) = tensors.first() else {
        return Err(Error::invalid(OP, "no tensors: pass at least one"));
    };
    let device = first.device();
    let line = &policy::FOREACH_NORM;
    dispatch::enter(line, device, |_| {
        let inf_norm = match ord {
            o if o == 2.0 => false,
            o if o == f64::INFINITY => true,
            o => {
                return Err(Error::invalid(
                    OP,
                    format!("ord {o} is not supported: pass 2.0 or f64::INFINITY (other orders: Tensor::norm per tensor)"),
                ))
            }
        };
        for t in tensors {
            if !t.dtype().is_floating_point() || t.dtype() != first.dtype() {
                return Err(Error::UnsupportedDType {
                    op: OP,
                    dtype: t.dtype(),
                    hint: "; the tensors are of one floating-point dtype (group them by dtype)",
                });
            }
            if t.device() != device {
                return Err(crate::dispatch::device_mismatch(OP, device, t.device()));
            }
        }
        settle_list(tensors)?;
        let _g = autograd::no_grad();
        let work: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                if is_dense(t) {
                    Ok(t.clone())
                } else {
                    t.contiguous()
                }
            })
            .collect::<Result<_>>()?;
        let norms = Tensor::zeros([tensors.len()], DType::F32, device)?;
        {
            let read: Vec<&StorageRef> = work.iter().map(|t| t.storage()).collect();
            let mut locks = Locks::take(OP, &[norms.storage()], &read)?;
            let (mut written, read) = locks.split();
            let out = Elems {
                storage: take(&mut written, norms.storage().id()),
                offset: norms.storage_offset(),
                len: tensors.len(),
            };
            let ids: Vec<usize> = read.iter().map(|r| r.0).collect();
            let list = ForeachNorm {
                storages: read.into_iter().map(|r| r.1).collect(),
                tensors: work
                    .iter()
                    .map(|t| Elems {
                        storage: ids
                            .binary_search(&t.storage().id())
                            .expect("tensor storage was locked"),
                        offset: t.storage_offset(),
                        len: t.numel(),
                    })
                    .collect(),
                inf_norm,
            };
            Storage::foreach_norm(list, out)?;
        }
        Ok(norms)
    })
}

/// Multiplies every tensor of `tensors` in place by the one-element f32 tensor `scalar` on
/// their device (`torch._foreach_mul_` with a tensor): one launch per dtype and 128 tensors,
/// nothing read back; the multiplication is skipped where `scalar` is exactly 1, which leaves
/// the same values. The tensors are floating, on one device, and may be views of one buffer
/// as long as no two overlap.
pub fn foreach_mul_(tensors: &[Tensor], scalar: &Tensor) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    let line = &policy::FOREACH_MUL_;
    dispatch::enter(line, first.device(), |_| {
        // GradScaler's unscale kernel multiplies by a device scalar; its found-inf flag is
        // not wanted here.
        let found = Tensor::zeros([1], DType::F32, first.device())?;
        unscale_checked(tensors, &found, scalar)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_views() {
        let t = Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap();
        assert!(is_dense(&t));
        assert!(is_dense(&t.t().unwrap()));
        assert!(!is_dense(&t.narrow(1, 0, 2).unwrap()));
        assert!(is_dense(&t.narrow(0, 1, 1).unwrap()));
    }
}
