//! CUDA launcher for `kernels/optim.cu`: the fused multi-tensor Adam/AdamW and SGD steps of
//! `ops/fused_optim.rs`. The tensors go to the kernel in a [`TensorList`] passed by value, at
//! most [`MAX_TENSORS`] per launch; a step over more tensors is a few launches, all on the
//! current stream, with no host synchronization.

use super::kernels::{launch, Grid, KernelKey, KernelParam, Module};
use super::runtime::runtime;
use super::stream::current_raw;
use crate::backend::OptimKernel;
use crate::{DType, Result};

/// Tensors per launch (`EMBER_OPTIM_MAX_TENSORS` in the kernel file).
pub(crate) const MAX_TENSORS: usize = 48;
/// Elements per chunk, the unit of work of one block (`EMBER_OPTIM_CHUNK`).
const CHUNK: usize = 4096;
/// Threads per block.
const BLOCK: u32 = 256;
/// Resident blocks per SM to aim for (256-thread blocks: 8 fill an H100 SM's 2048 threads).
const BLOCKS_PER_SM: usize = 8;

/// The kernel's `TensorList`: pointers, sizes, chunk prefix counts and per-tensor scalars of up
/// to [`MAX_TENSORS`] tensors. Same field order and size (3472 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorList {
    n: i32,
    pad: i32,
    ptr: [[u64; MAX_TENSORS]; 5],
    numel: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
    scalar: [[f64; MAX_TENSORS]; 2],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `TensorList`.
unsafe impl KernelParam for TensorList {}

/// One tensor of a fused step: device addresses of its first elements (param, grad, then the
/// state tensors in the kernel's order, 0 where unused), its element count, and its per-tensor
/// scalars (Adam: step size and `sqrt(bias_correction2)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OptimTensor {
    pub ptrs: [u64; 5],
    pub numel: usize,
    pub scalars: [f64; 2],
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
    let rt = runtime(ordinal)?;
    let base = match kernel {
        OptimKernel::Adam { .. } => "adam",
        OptimKernel::Sgd { .. } => "sgd",
    };
    let f = rt.function(KernelKey::new(Module::Optim, base, dtype))?;
    let stream = current_raw(rt.ordinal);
    let nonempty: Vec<&OptimTensor> = tensors.iter().filter(|t| t.numel > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = TensorList {
            n: group.len() as i32,
            pad: 0,
            ptr: [[0; MAX_TENSORS]; 5],
            numel: [0; MAX_TENSORS],
            chunk_start: [0; MAX_TENSORS + 1],
            scalar: [[0.0; MAX_TENSORS]; 2],
        };
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
        let blocks = chunks.clamp(1, rt.sm_count as usize * BLOCKS_PER_SM);
        let grid = Grid {
            grid: (blocks as u32, 1, 1),
            block: (BLOCK, 1, 1),
            shared_bytes: 0,
        };
        match kernel {
            OptimKernel::Adam {
                lr,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                decay,
                flags,
            } => {
                // SAFETY: `adam_T(TensorList l, f64 lr, f64 omb1, f64 beta2, f64 omb2, f64 eps,
                // f64 wd, f64 decay, i32 flags)`; the caller guarantees every pointer of `list`
                // is valid for its tensor's `numel` elements of `dtype` on this device (the
                // state pointer 4 only when the amsgrad flag is set) and that the storages stay
                // alive in stream order (they are freed through the caching allocator on this
                // stream); `chunk_start` is the prefix count of `numel.div_ceil(CHUNK)`, so no
                // block indexes past a tensor's end.
                unsafe {
                    launch(
                        f,
                        grid,
                        stream,
                        &[
                            &list,
                            &lr,
                            &one_minus_beta1,
                            &beta2,
                            &one_minus_beta2,
                            &eps,
                            &weight_decay,
                            &decay,
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
                flags,
            } => {
                // SAFETY: `sgd_T(TensorList l, f64 lr, f64 momentum, f64 omd, f64 wd, i32
                // flags)`; pointers as for Adam above (the buffer pointer 2 is read and written
                // only when momentum != 0, and then the caller set it).
                unsafe {
                    launch(
                        f,
                        grid,
                        stream,
                        &[&list, &lr, &momentum, &one_minus_dampening, &weight_decay, &flags],
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
        // 8 + 5 * 48 * 8 + 48 * 8 + 49 * 8 + 2 * 48 * 8, under the 4 KB parameter limit with
        // the other arguments.
        assert_eq!(std::mem::size_of::<TensorList>(), 3472);
        assert_eq!(std::mem::align_of::<TensorList>(), 8);
        assert!(std::mem::size_of::<TensorList>() + 8 * 8 + 4 <= 4096);
    }
}
