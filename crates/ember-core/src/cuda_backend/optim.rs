//! CUDA launcher for `kernels/optim.cu`: the fused multi-tensor Adam/AdamW and SGD steps of
//! `ops/fused_optim.rs` (reached through its `OptimOps` below). The tensors go to the kernel in a [`TensorList`] passed by value, at
//! most [`MAX_TENSORS`] per launch; a step over more tensors is a few launches, all on the
//! current stream, with no host synchronization (the GradScaler's grad scale and found-inf
//! flag, the learning rate when it lives in a device tensor, and Adam's device step counts are
//! read by the kernels from device memory; Note [Capturable optimizer steps]).
//!
//! Note [Capturable optimizer steps]: a CUDA graph replays launches with the arguments they
//! were captured with, so a value that changes between steps must be read on the device, not
//! passed by value: the lr (an LR scheduler changes it between replays; `lr_ptr`, a one-element
//! f64 tensor that `set_lr` writes on the stream), the step counts (f32 tensors that
//! `increment_steps` advances on the device) and Adam's bias corrections (computed by the kernel
//! from the device step count and lr). What stays by value is fixed for the optimizer's life
//! (betas, eps, weight decay, the flags) or for the captured step (pointers, sizes). Reading
//! the lr on the device changes no bits: the kernel forms `lr / bias_correction1` and
//! `1 - lr * weight_decay` with the same correctly rounded f64 operations the host used.

use std::ops::Range;

use super::kernels::{Grid, KernelKey, KernelParam, Module};
use super::launch::{self, DevPtr, DevPtrMut};
use super::runtime::{runtime, DeviceRuntime};
use super::stream::{current_stream, Event};
use super::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::Elems;
use crate::backend::GradElems;
use crate::backend::{
    AdamStep, AdamTensor, Arrival, Arrives, OptimOps, SgdStep, SgdTensor, StepCount, StepScalars,
};
use crate::{DType, Result};
use std::ops::Deref;

/// Tensors per launch (`EMBER_OPTIM_MAX_TENSORS` in the kernel file).
pub(crate) const MAX_TENSORS: usize = 48;
/// Elements per chunk, the unit of work of one block (`EMBER_OPTIM_CHUNK`).
const CHUNK: usize = 4096;

/// The kernel's `TensorList`: pointers, sizes, chunk prefix counts and per-tensor scalars of up
/// to [`MAX_TENSORS`] tensors. Same field order and size (3856 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct TensorList {
    n: i32,
    pad: i32,
    ptr: [[u64; MAX_TENSORS]; 6],
    numel: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
    scalar: [[f64; MAX_TENSORS]; 2],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `TensorList`.
unsafe impl KernelParam for TensorList {}

/// One tensor of a fused step: its first elements (param, grad, then the state tensors in the
/// kernel's order, `None` where unused; Adam's device step count last), its element count, and
/// its per-tensor scalars (Adam with host steps: `bias_correction1` and `sqrt(bias_correction2)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OptimTensor<'a> {
    pub ptrs: [Option<DevPtrMut<'a>>; 6],
    pub numel: usize,
    pub scalars: [f64; 2],
}

/// Which update, with the scalars every tensor shares (see `adam` and `sgd` in `launch.rs`).
/// `grad_scale` and `found_inf` are one f32 each, or `None`; `lr_ptr` one f64 that replaces
/// `lr`, or `None`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum OptimKernel<'a> {
    Adam {
        lr: f64,
        beta1: f64,
        one_minus_beta1: f64,
        beta2: f64,
        one_minus_beta2: f64,
        eps: f64,
        weight_decay: f64,
        grad_scale: Option<DevPtr<'a>>,
        found_inf: Option<DevPtr<'a>>,
        lr_ptr: Option<DevPtr<'a>>,
        flags: i32,
    },
    Sgd {
        lr: f64,
        momentum: f64,
        one_minus_dampening: f64,
        weight_decay: f64,
        grad_scale: Option<DevPtr<'a>>,
        found_inf: Option<DevPtr<'a>>,
        lr_ptr: Option<DevPtr<'a>>,
        flags: i32,
    },
}

/// Flag of `adam_T`: the step counts are read from `ptrs[5]` (see `adam` in `launch.rs`).
pub(crate) const ADAM_DEVICE_STEPS: i32 = 8;
/// Flag of `adam_T`: `ptrs[4]` holds bf16 twins (or null), not max_exp_avg_sq.
const ADAM_TWINS: i32 = 16;

/// An empty list for `n` tensors, for the launches to fill.
fn empty_list(n: usize) -> TensorList {
    TensorList {
        n: n as i32,
        pad: 0,
        ptr: [[0; MAX_TENSORS]; 6],
        numel: [0; MAX_TENSORS],
        chunk_start: [0; MAX_TENSORS + 1],
        scalar: [[0.0; MAX_TENSORS]; 2],
    }
}

/// Runs `kernel` over `tensors` (all of `dtype`, all on device `ordinal`, every pointer valid
/// for `numel` row-major elements and none overlapping another written one) on the current
/// stream, [`MAX_TENSORS`] at a time. Empty tensors are skipped.
pub(crate) fn multi_tensor_step(
    ordinal: usize,
    dtype: DType,
    tensors: &[OptimTensor<'_>],
    kernel: OptimKernel<'_>,
) -> Result<()> {
    multi_tensor_step_arriving(ordinal, dtype, tensors, &[], kernel)
}

/// A block of tensor `tensor` of a step's list whose gradient is still arriving (Note
/// [Arrivals in row blocks] in `storage/row_blocks.rs`).
pub(crate) struct Arriving<'a> {
    pub tensor: usize,
    pub block: Arrival<&'a Event>,
}

impl Arrives for CudaStorage {
    type Event = Event;
}

impl<'a> OptimTensor<'a> {
    /// The same update restricted to `elements` (the step count is the whole tensor's).
    fn part(&self, elements: &Range<usize>, elem_bytes: usize) -> OptimTensor<'a> {
        let mut ptrs = self.ptrs;
        for p in ptrs.iter_mut().take(5).flatten() {
            *p = p.add_bytes(elements.start * elem_bytes);
        }
        OptimTensor {
            ptrs,
            numel: elements.len(),
            scalars: self.scalars,
        }
    }
}

/// [`multi_tensor_step`] where the gradients of some tensors arrive in blocks (`arrivals`,
/// which tile each such tensor): the step counts advance first, then one update over the other
/// tensors, then each block's update after its event.
pub(crate) fn multi_tensor_step_arriving(
    ordinal: usize,
    dtype: DType,
    tensors: &[OptimTensor<'_>],
    arrivals: &[Arriving<'_>],
    kernel: OptimKernel<'_>,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    // The update's kernel is loaded first, so that one that cannot be loaded fails the step
    // before the step counts advance.
    let base = match kernel {
        OptimKernel::Adam { .. } => "adam",
        OptimKernel::Sgd { .. } => "sgd",
    };
    rt.function(KernelKey::new(Module::Optim, base, dtype))?;
    if let OptimKernel::Adam { flags, found_inf, .. } = kernel {
        if flags & ADAM_DEVICE_STEPS != 0 {
            // Every tensor's count, empty ones included, before the updates that read them.
            for group in tensors.chunks(MAX_TENSORS) {
                let mut list = empty_list(group.len());
                for (t, x) in group.iter().enumerate() {
                    list.ptr[5][t] = address(x.ptrs[5]);
                }
                let grid = Grid {
                    grid: (1, 1, 1),
                    block: (64, 1, 1),
                    shared_bytes: 0,
                };
                // Each `ptrs[5]` addresses one f32 (the caller's part).
                launch::increment_steps(rt, &[], grid, &list, found_inf)?;
            }
        }
    }
    if arrivals.is_empty() {
        return update(rt, dtype, tensors, kernel);
    }
    let arriving = |i: usize| arrivals.iter().any(|a| a.tensor == i);
    let whole: Vec<OptimTensor<'_>> = (0..tensors.len())
        .filter(|&i| !arriving(i))
        .map(|i| tensors[i])
        .collect();
    update(rt, dtype, &whole, kernel)?;
    // In the order they arrive: the tensors that arrive whole one after another share a
    // launch after all their events; each block of one arriving in several has its own.
    let mut order: Vec<&Arriving<'_>> = arrivals.iter().collect();
    order.sort_by_key(|a| a.block.order);
    let current = current_stream(rt.ordinal)?;
    let mut batch = Vec::new();
    for (k, a) in order.iter().enumerate() {
        current.wait_event(a.block.event)?;
        let t = &tensors[a.tensor];
        batch.push(t.part(&a.block.elements, dtype.size_in_bytes()));
        let is_whole = |a: &Arriving<'_>| a.block.elements.len() == tensors[a.tensor].numel;
        if !is_whole(a) || order.get(k + 1).map_or(true, |next| !is_whole(next)) {
            update(rt, dtype, &batch, kernel)?;
            batch.clear();
        }
    }
    Ok(())
}

/// The device address in a [`TensorList`] of an optional operand (0 for none).
fn address(p: Option<DevPtrMut<'_>>) -> u64 {
    p.map_or(0, DevPtrMut::addr)
}

/// The update launches of [`multi_tensor_step`]: `kernel` over `tensors` (of `dtype`) on the
/// current stream, [`MAX_TENSORS`] at a time.
fn update(
    rt: &DeviceRuntime,
    dtype: DType,
    tensors: &[OptimTensor<'_>],
    kernel: OptimKernel<'_>,
) -> Result<()> {
    let nonempty: Vec<&OptimTensor<'_>> = tensors.iter().filter(|t| t.numel > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = empty_list(group.len());
        let mut chunks = 0usize;
        for (t, x) in group.iter().enumerate() {
            for (k, &p) in x.ptrs.iter().enumerate() {
                list.ptr[k][t] = address(p);
            }
            list.numel[t] = x.numel as i64;
            list.scalar[0][t] = x.scalars[0];
            list.scalar[1][t] = x.scalars[1];
            list.chunk_start[t] = chunks as i64;
            chunks += x.numel.div_ceil(CHUNK);
        }
        list.chunk_start[group.len()] = chunks as i64;
        let grid = Grid::multi_tensor(rt, chunks);
        match kernel {
            OptimKernel::Adam {
                lr,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                grad_scale,
                found_inf,
                lr_ptr,
                flags,
            } => {
                // The caller's part: every pointer of `list` reaches its tensor's `numel`
                // elements of `dtype` (the state pointer 4 when the amsgrad flag is set; the
                // step pointer 5 one f32, with device steps); `chunk_start` is the prefix count
                // of `numel.div_ceil(CHUNK)`, so no block indexes past a tensor's end.
                launch::adam(
                    rt,
                    &[dtype],
                    grid,
                    &list,
                    lr,
                    beta1,
                    one_minus_beta1,
                    beta2,
                    one_minus_beta2,
                    eps,
                    weight_decay,
                    grad_scale,
                    found_inf,
                    lr_ptr,
                    flags,
                )?;
            }
            OptimKernel::Sgd {
                lr,
                momentum,
                one_minus_dampening,
                weight_decay,
                grad_scale,
                found_inf,
                lr_ptr,
                flags,
            } => {
                // Pointers as for Adam above (the buffer pointer 2 is read and written only when
                // momentum != 0, and then the caller set it).
                launch::sgd(
                    rt,
                    &[dtype],
                    grid,
                    &list,
                    lr,
                    momentum,
                    one_minus_dampening,
                    weight_decay,
                    grad_scale,
                    found_inf,
                    lr_ptr,
                    flags,
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_list_matches_the_kernel_struct() {
        // 8 + 6 * 48 * 8 + 48 * 8 + 49 * 8 + 2 * 48 * 8, under the 4 KB parameter limit with
        // the other arguments (Adam's: 7 f64, 3 pointers, 1 i32).
        assert_eq!(std::mem::size_of::<TensorList>(), 3856);
        assert_eq!(std::mem::align_of::<TensorList>(), 8);
        assert!(std::mem::size_of::<TensorList>() + 7 * 8 + 3 * 8 + 4 <= 4096);
    }
}

impl OptimOps for CudaStorage {
    fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, CudaStorage>>,
        amp: StepScalars<'_, CudaStorage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let (ordinal, dtype) = (first.param.storage.ordinal(), first.param.storage.dtype());
        let device_steps = matches!(first.step, StepCount::Device(_));
        let list: Vec<OptimTensor> = tensors
            .iter()
            .map(|t| OptimTensor {
                ptrs: [
                    Some(ptr_mut(&t.param)),
                    Some(grad_ptr(&t.grad)),
                    Some(ptr_mut(&t.exp_avg)),
                    Some(ptr_mut(&t.exp_avg_sq)),
                    t.max_exp_avg_sq.as_ref().or(t.twin.as_ref()).map(ptr_mut),
                    match &t.step {
                        StepCount::Device(c) => Some(ptr_mut(c)),
                        StepCount::Host(_) => None,
                    },
                ],
                numel: t.param.len,
                scalars: match t.step {
                    StepCount::Host(n) => step.bias_correction_terms(n),
                    StepCount::Device(_) => [0.0; 2],
                },
            })
            .collect();
        // A twin goes where max_exp_avg_sq would (the op asks for none with amsgrad), and only
        // with the whole gradient at hand (`OptimTensor::part` offsets ptrs[4] in T's size).
        let twins = tensors.iter().any(|t| t.twin.is_some());
        if twins && (step.amsgrad || tensors.iter().any(|t| !t.arrivals.is_empty()) || dtype != DType::F32) {
            return Err(crate::Error::invalid(
                "adam_",
                "a parameter's bf16 twin needs float32 parameters, no amsgrad and whole gradients",
            ));
        }
        let flags = step.amsgrad as i32
            | (step.maximize as i32) << 1
            | (step.decoupled_weight_decay as i32) << 2
            | if device_steps { ADAM_DEVICE_STEPS } else { 0 }
            | if twins { ADAM_TWINS } else { 0 };
        let kernel = OptimKernel::Adam {
            lr: step.lr,
            beta1: step.beta1,
            one_minus_beta1: 1.0 - step.beta1,
            beta2: step.beta2,
            one_minus_beta2: 1.0 - step.beta2,
            eps: step.eps,
            weight_decay: step.weight_decay,
            grad_scale: amp.grad_scale.as_ref().map(ptr),
            found_inf: amp.found_inf.as_ref().map(ptr),
            lr_ptr: amp.lr.as_ref().map(ptr),
            flags,
        };
        let arrivals: Vec<Arriving<'_>> = tensors
            .iter()
            .enumerate()
            .flat_map(|(tensor, t)| {
                t.arrivals.iter().map(move |a| Arriving {
                    tensor,
                    block: a.clone(),
                })
            })
            .collect();
        // The operands stay borrowed (their storages locked) until every launch is enqueued.
        multi_tensor_step_arriving(ordinal, dtype, &list, &arrivals, kernel)
    }

    fn sgd_step(
        step: &SgdStep,
        tensors: Vec<SgdTensor<'_, CudaStorage>>,
        amp: StepScalars<'_, CudaStorage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let (ordinal, dtype) = (first.param.storage.ordinal(), first.param.storage.dtype());
        let list: Vec<OptimTensor> = tensors
            .iter()
            .map(|t| OptimTensor {
                ptrs: [
                    Some(ptr_mut(&t.param)),
                    Some(grad_ptr(&t.grad)),
                    t.momentum_buffer.as_ref().map(ptr_mut),
                    None,
                    None,
                    None,
                ],
                numel: t.param.len,
                scalars: [0.0; 2],
            })
            .collect();
        let flags = step.nesterov as i32 | (step.maximize as i32) << 1 | (step.first_step as i32) << 2;
        let kernel = OptimKernel::Sgd {
            lr: step.lr,
            momentum: step.momentum,
            one_minus_dampening: 1.0 - step.dampening,
            weight_decay: step.weight_decay,
            grad_scale: amp.grad_scale.as_ref().map(ptr),
            found_inf: amp.found_inf.as_ref().map(ptr),
            lr_ptr: amp.lr.as_ref().map(ptr),
            flags,
        };
        multi_tensor_step(ordinal, dtype, &list, kernel)
    }
}

/// An operand's first element, read by the kernel.
pub(super) fn ptr<S: Deref<Target = CudaStorage>>(e: &Elems<S>) -> DevPtr<'_> {
    e.storage.dev_ptr_at(e.offset)
}

/// An operand's first element, written by the kernel.
pub(super) fn ptr_mut<S: Deref<Target = CudaStorage>>(e: &Elems<S>) -> DevPtrMut<'_> {
    e.storage.dev_ptr_mut_at(e.offset)
}

/// A gradient's first element (read, or written back unscaled with a grad scale).
pub(super) fn grad_ptr<'a>(g: &'a GradElems<'_, CudaStorage>) -> DevPtrMut<'a> {
    match g {
        GradElems::Read(e) => ptr_mut(e),
        GradElems::Unscaled(e) => ptr_mut(e),
    }
}
