//! GradScaler's device side (`torch._amp_foreach_non_finite_check_and_unscale_`,
//! `torch._amp_update_scale_`): [`non_finite_check_and_unscale_`] multiplies many gradients in
//! place by an inverse scale and raises a found-inf flag when any value is inf or NaN (one
//! multi-tensor kernel per dtype on CUDA, `kernels/amp.cu`; `cpu/amp.rs` on the CPU), and
//! [`update_scale_`] backs the scale off or grows it from that flag (one single-thread kernel).
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
use crate::cpu::amp as cpu_amp;
use crate::cpu::optim::OptimElement;
use crate::cuda::amp as cuda_amp;
use crate::storage::{Storage, StorageRef};
use crate::{DType, Device, Error, Result, Tensor};
use half::{bf16, f16};
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// Checks that `t` is a one-element tensor of `dtype` on `device`; `what` names it in errors.
fn check_scalar(op: &'static str, what: &str, t: &Tensor, dtype: DType, device: Device) -> Result<()> {
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
fn check_writable(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
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

impl Lock<'_> {
    fn storage(&self) -> &Storage {
        match self {
            Lock::Read(g) => g,
            Lock::Write(g) => g,
        }
    }

    fn storage_mut(&mut self) -> &mut Storage {
        match self {
            Lock::Write(g) => &mut *g,
            Lock::Read(_) => unreachable!("written storages are write-locked"),
        }
    }
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

    fn get(&self, t: &Tensor) -> &Storage {
        let i = self
            .ids
            .binary_search(&t.storage().id())
            .expect("storage was locked");
        self.locks[i].storage()
    }

    fn get_mut(&mut self, t: &Tensor) -> &mut Storage {
        let i = self
            .ids
            .binary_search(&t.storage().id())
            .expect("storage was locked");
        self.locks[i].storage_mut()
    }
}

/// The first element of a locked one-element CPU tensor of `T`.
fn cpu_scalar<T: crate::cpu::CpuElement>(storage: &Storage, t: &Tensor) -> T {
    match storage {
        Storage::Cpu(c) => T::slice(c).expect("dtype checked")[t.storage_offset()],
        Storage::Cuda(_) => unreachable!("device checked"),
    }
}

/// The first element of a locked one-element CPU tensor of `T`, writable.
fn cpu_scalar_mut<'s, T: crate::cpu::CpuElement>(storage: &'s mut Storage, t: &Tensor) -> &'s mut T {
    match storage {
        Storage::Cpu(c) => &mut T::slice_mut(c).expect("dtype checked")[t.storage_offset()],
        Storage::Cuda(_) => unreachable!("device checked"),
    }
}

/// The device address of the first element of a locked CUDA tensor.
fn device_ptr(storage: &Storage, t: &Tensor) -> u64 {
    match storage {
        Storage::Cuda(c) => c.ptr(t.layout()),
        Storage::Cpu(_) => unreachable!("device checked"),
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
    const OP: &str = "non_finite_check_and_unscale_";
    let device = found_inf.device();
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
        match device {
            Device::Cpu => {
                let inv = cpu_scalar::<f32>(locks.get(inv_scale), inv_scale);
                let mut found = false;
                for t in &work {
                    fn run<T: OptimElement>(storage: &mut Storage, t: &Tensor, inv: f32) -> bool {
                        let (off, n) = (t.storage_offset(), t.numel());
                        match storage {
                            Storage::Cpu(c) => cpu_amp::non_finite_check_and_unscale(
                                &mut T::slice_mut(c).expect("dtype checked")[off..off + n],
                                inv,
                            ),
                            Storage::Cuda(_) => unreachable!("device checked"),
                        }
                    }
                    let s = locks.get_mut(t);
                    found |= match t.dtype() {
                        DType::F32 => run::<f32>(s, t, inv),
                        DType::F64 => run::<f64>(s, t, inv),
                        DType::F16 => run::<f16>(s, t, inv),
                        DType::BF16 => run::<bf16>(s, t, inv),
                        _ => unreachable!("floating dtype checked"),
                    };
                }
                if found {
                    *cpu_scalar_mut::<f32>(locks.get_mut(found_inf), found_inf) = 1.0;
                }
            }
            Device::Cuda(ordinal) => {
                let found_ptr = device_ptr(locks.get(found_inf), found_inf);
                let inv_ptr = device_ptr(locks.get(inv_scale), inv_scale);
                for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                    let group: Vec<(u64, usize)> = work
                        .iter()
                        .filter(|t| t.dtype() == dtype)
                        .map(|t| (device_ptr(locks.get(t), t), t.numel()))
                        .collect();
                    if !group.is_empty() {
                        // The locks are held until every launch is enqueued.
                        cuda_amp::non_finite_check_and_unscale(ordinal, dtype, &group, found_ptr, inv_ptr)?;
                    }
                }
            }
        }
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
    match device {
        Device::Cpu => {
            let found = cpu_scalar::<f32>(locks.get(found_inf), found_inf);
            let mut s = cpu_scalar::<f32>(locks.get(scale), scale);
            let mut t = cpu_scalar::<i32>(locks.get(growth_tracker), growth_tracker);
            cpu_amp::update_scale(&mut s, &mut t, found, growth_factor, backoff_factor, interval);
            *cpu_scalar_mut::<f32>(locks.get_mut(scale), scale) = s;
            *cpu_scalar_mut::<i32>(locks.get_mut(growth_tracker), growth_tracker) = t;
            Ok(())
        }
        Device::Cuda(ordinal) => {
            let ptrs = [
                device_ptr(locks.get(scale), scale),
                device_ptr(locks.get(growth_tracker), growth_tracker),
                device_ptr(locks.get(found_inf), found_inf),
            ];
            cuda_amp::update_scale(ordinal, ptrs, growth_factor, backoff_factor, interval)
        }
    }
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
