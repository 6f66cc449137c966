//! CUDA launcher for `kernels/optim.cu`: the fused multi-tensor Adam/AdamW and SGD steps of
//! `ops/fused_optim.rs` (reached through `cuda/backend.rs`). The tensors go to the kernel in a [`TensorList`] passed by value, at
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

use super::kernels::{launch, Function, Grid, KernelKey, KernelParam, Module};
use super::runtime::{runtime, DeviceRuntime};
use super::stream::{current_raw, current_stream, Event};
use crate::{DType, Result};

/// Tensors per launch (`EMBER_OPTIM_MAX_TENSORS` in the kernel file).
pub(crate) const MAX_TENSORS: usize = 48;
/// Elements per chunk, the unit of work of one block (`EMBER_OPTIM_CHUNK`).
const CHUNK: usize = 4096;

/// The kernel's `TensorList`: pointers, sizes, chunk prefix counts and per-tensor scalars of up
/// to [`MAX_TENSORS`] tensors. Same field order and size (3856 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorList {
    n: i32,
    pad: i32,
    ptr: [[u64; MAX_TENSORS]; 6],
    numel: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
    scalar: [[f64; MAX_TENSORS]; 2],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `TensorList`.
unsafe impl KernelParam for TensorList {}

/// One tensor of a fused step: device addresses of its first elements (param, grad, then the
/// state tensors in the kernel's order, 0 where unused; Adam's device step count last), its
/// element count, and its per-tensor scalars (Adam with host steps: `bias_correction1` and
/// `sqrt(bias_correction2)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OptimTensor {
    pub ptrs: [u64; 6],
    pub numel: usize,
    pub scalars: [f64; 2],
}

/// Which update, with the scalars every tensor shares (see the kernel file's launch contract).
/// `grad_scale` and `found_inf` are device addresses of one f32 each, or 0; `lr_ptr` the device
/// address of one f64 that replaces `lr`, or 0.
#[derive(Debug, Clone, Copy)]
pub(crate) enum OptimKernel {
    Adam {
        lr: f64,
        beta1: f64,
        one_minus_beta1: f64,
        beta2: f64,
        one_minus_beta2: f64,
        eps: f64,
        weight_decay: f64,
        grad_scale: u64,
        found_inf: u64,
        lr_ptr: u64,
        flags: i32,
    },
    Sgd {
        lr: f64,
        momentum: f64,
        one_minus_dampening: f64,
        weight_decay: f64,
        grad_scale: u64,
        found_inf: u64,
        lr_ptr: u64,
        flags: i32,
    },
}

/// Flag of `adam_T`: the step counts are read from `ptrs[5]` (see the kernel file).
pub(crate) const ADAM_DEVICE_STEPS: i32 = 8;

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
    tensors: &[OptimTensor],
    kernel: OptimKernel,
) -> Result<()> {
    multi_tensor_step_arriving(ordinal, dtype, tensors, &[], kernel)
}

/// Elements `elements` of tensor `tensor` of a step's list, whose gradient is written once
/// `event` completes; `order`: its place among the arrivals (Note [Arrivals in row blocks] in
/// `row_blocks.rs`).
pub(crate) struct Arrival<'a> {
    pub tensor: usize,
    pub elements: Range<usize>,
    pub event: &'a Event,
    pub order: u64,
}

impl OptimTensor {
    /// The same update restricted to `elements` (the step count is the whole tensor's).
    fn part(&self, elements: &Range<usize>, elem_bytes: usize) -> OptimTensor {
        let mut ptrs = self.ptrs;
        for p in ptrs.iter_mut().take(5).filter(|p| **p != 0) {
            *p += (elements.start * elem_bytes) as u64;
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
    tensors: &[OptimTensor],
    arrivals: &[Arrival<'_>],
    kernel: OptimKernel,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let base = match kernel {
        OptimKernel::Adam { .. } => "adam",
        OptimKernel::Sgd { .. } => "sgd",
    };
    let f = rt.function(KernelKey::new(Module::Optim, base, dtype))?;
    let stream = current_raw(rt.ordinal);
    if let OptimKernel::Adam { flags, found_inf, .. } = kernel {
        if flags & ADAM_DEVICE_STEPS != 0 {
            // Every tensor's count, empty ones included, before the updates that read them.
            let inc = rt.function(KernelKey::plain(Module::Optim, "increment_steps"))?;
            for group in tensors.chunks(MAX_TENSORS) {
                let mut list = empty_list(group.len());
                for (t, x) in group.iter().enumerate() {
                    list.ptr[5][t] = x.ptrs[5];
                }
                let grid = Grid {
                    grid: (1, 1, 1),
                    block: (64, 1, 1),
                    shared_bytes: 0,
                };
                // SAFETY: `increment_steps(TensorList l, const float* found_inf)`; the caller
                // guarantees each `ptrs[5]` addresses one f32 on this device and `found_inf` one
                // f32 or is 0, alive in stream order.
                unsafe { launch(inc, grid, stream, &[&list, &found_inf])? };
            }
        }
    }
    if arrivals.is_empty() {
        return update(rt, f, stream, tensors, kernel);
    }
    let arriving = |i: usize| arrivals.iter().any(|a| a.tensor == i);
    let whole: Vec<OptimTensor> = (0..tensors.len())
        .filter(|&i| !arriving(i))
        .map(|i| tensors[i])
        .collect();
    update(rt, f, stream, &whole, kernel)?;
    // In the order they arrive: the tensors that arrive whole one after another share a
    // launch after all their events; each block of one arriving in several has its own.
    let mut order: Vec<&Arrival<'_>> = arrivals.iter().collect();
    order.sort_by_key(|a| a.order);
    let current = current_stream(rt.ordinal)?;
    let mut batch = Vec::new();
    for (k, a) in order.iter().enumerate() {
        current.wait_event(a.event)?;
        let t = &tensors[a.tensor];
        batch.push(t.part(&a.elements, dtype.size_in_bytes()));
        let is_whole = |a: &Arrival<'_>| a.elements.len() == tensors[a.tensor].numel;
        if !is_whole(a) || order.get(k + 1).map_or(true, |next| !is_whole(next)) {
            update(rt, f, stream, &batch, kernel)?;
            batch.clear();
        }
    }
    Ok(())
}

/// The update launches of [`multi_tensor_step`]: `kernel` over `tensors` on `stream`,
/// [`MAX_TENSORS`] at a time.
fn update(
    rt: &DeviceRuntime,
    f: Function,
    stream: u64,
    tensors: &[OptimTensor],
    kernel: OptimKernel,
) -> Result<()> {
    let nonempty: Vec<&OptimTensor> = tensors.iter().filter(|t| t.numel > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = empty_list(group.len());
        let mut chunks = 0usize;
        for (t, x) in group.iter().enumerate() {
            for (k, &p) in x.ptrs.iter().enumerate() {
                list.ptr[k][t] = p;
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
                // SAFETY: `adam_T(TensorList l, f64 lr, f64 beta1, f64 omb1, f64 beta2, f64 omb2,
                // f64 eps, f64 wd, const float* grad_scale, const float* found_inf,
                // const double* lr_ptr, i32 flags)`; the caller guarantees every pointer of
                // `list` is valid for its tensor's `numel` elements of `dtype` on this device
                // (the state pointer 4 only when the amsgrad flag is set; the step pointer 5 one
                // f32, only with device steps; the gradient is written only with a grad scale),
                // that `grad_scale` and `found_inf` are 0 or address one f32 there, `lr_ptr` 0
                // or one f64, and that the storages stay alive
                // in stream order (they are freed through the caching allocator on this stream);
                // `chunk_start` is the prefix count of `numel.div_ceil(CHUNK)`, so no block
                // indexes past a tensor's end.
                unsafe {
                    launch(
                        f,
                        grid,
                        stream,
                        &[
                            &list,
                            &lr,
                            &beta1,
                            &one_minus_beta1,
                            &beta2,
                            &one_minus_beta2,
                            &eps,
                            &weight_decay,
                            &grad_scale,
                            &found_inf,
                            &lr_ptr,
                            &flags,
                        ],
                    )?;
                }
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
                // SAFETY: `sgd_T(TensorList l, f64 lr, f64 momentum, f64 omd, f64 wd, const
                // float* grad_scale, const float* found_inf, const double* lr_ptr, i32 flags)`;
                // pointers as for Adam above (the buffer pointer 2 is read and written only when
                // momentum != 0, and then the caller set it).
                unsafe {
                    launch(
                        f,
                        grid,
                        stream,
                        &[
                            &list,
                            &lr,
                            &momentum,
                            &one_minus_dampening,
                            &weight_decay,
                            &grad_scale,
                            &found_inf,
                            &lr_ptr,
                            &flags,
                        ],
                    )?;
                }
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
