//! CUDA launcher for `kernels/amp.cu`: GradScaler's fused inf check and unscale of many
//! gradients ([`non_finite_check_and_unscale`]) and its scale update ([`update_scale`]), for
//! `ops/amp_scaling.rs` (reached through `cuda/backend.rs`). The tensors of the multi-tensor
//! kernel travel in an [`AmpTensorList`] passed by value, at most [`MAX_TENSORS`] per launch
//! (the chunked geometry of `cuda/optim.rs`); every launch goes on the current stream and the
//! host never waits.

use super::kernels::{launch, Grid, KernelKey, KernelParam, Module};
use super::runtime::runtime;
use super::stream::current_raw;
use crate::{DType, Result};

/// Tensors per launch (`EMBER_AMP_MAX_TENSORS` in the kernel file).
const MAX_TENSORS: usize = 128;
/// Elements per chunk, the unit of work of one block (`EMBER_AMP_CHUNK`).
const CHUNK: usize = 4096;

/// The kernel's `AmpTensorList`: the address, size and chunk prefix count of up to
/// [`MAX_TENSORS`] tensors. Same field order and size (3088 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct AmpTensorList {
    n: i32,
    pad: i32,
    ptr: [u64; MAX_TENSORS],
    numel: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `AmpTensorList`.
unsafe impl KernelParam for AmpTensorList {}

/// Multiplies every element of each tensor in `tensors` (device address of its first element,
/// element count; all of floating `dtype`, on device `ordinal`, no two overlapping) by the f32
/// at `inv_scale` and stores 1.0 into the f32 at `found_inf` when any element was inf or NaN
/// (`torch._amp_foreach_non_finite_check_and_unscale_`). Empty tensors are skipped.
pub(crate) fn non_finite_check_and_unscale(
    ordinal: usize,
    dtype: DType,
    tensors: &[(u64, usize)],
    found_inf: u64,
    inv_scale: u64,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let f = rt.function(KernelKey::new(Module::Amp, "non_finite_check_and_unscale", dtype))?;
    let stream = current_raw(rt.ordinal);
    let nonempty: Vec<&(u64, usize)> = tensors.iter().filter(|t| t.1 > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = AmpTensorList {
            n: group.len() as i32,
            pad: 0,
            ptr: [0; MAX_TENSORS],
            numel: [0; MAX_TENSORS],
            chunk_start: [0; MAX_TENSORS + 1],
        };
        let mut chunks = 0usize;
        for (t, &&(ptr, numel)) in group.iter().enumerate() {
            list.ptr[t] = ptr;
            list.numel[t] = numel as i64;
            list.chunk_start[t] = chunks as i64;
            chunks += numel.div_ceil(CHUNK);
        }
        list.chunk_start[group.len()] = chunks as i64;
        let grid = Grid::multi_tensor(rt, chunks);
        // SAFETY: `non_finite_check_and_unscale_T(AmpTensorList l, float* found_inf, const
        // float* inv_scale)`; the caller guarantees each pointer of `list` is valid for its
        // `numel` elements of `dtype` on this device, that `found_inf` and `inv_scale` each
        // point at one f32 there, and that the storages stay alive in stream order (freed
        // through the caching allocator on this stream); `chunk_start` is the prefix count of
        // `numel.div_ceil(CHUNK)`, so no block indexes past a tensor's end.
        unsafe { launch(f, grid, stream, &[&list, &found_inf, &inv_scale])? };
    }
    Ok(())
}

/// Updates the f32 scale at `scale` and the i32 at `growth_tracker` from the f32 at
/// `found_inf` in one single-thread kernel (`torch._amp_update_scale_`; the rule is in the
/// kernel file's launch contract).
pub(crate) fn update_scale(
    ordinal: usize,
    [scale, growth_tracker, found_inf]: [u64; 3],
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i32,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let f = rt.function(KernelKey::plain(Module::Amp, "update_scale"))?;
    let grid = Grid {
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: `update_scale(float* scale, i32* growth_tracker, const float* found_inf, f64
    // growth_factor, f64 backoff_factor, i32 growth_interval)`; the caller guarantees the three
    // pointers address one f32, one i32 and one f32 on this device, alive in stream order.
    unsafe {
        launch(
            f,
            grid,
            current_raw(rt.ordinal),
            &[
                &scale,
                &growth_tracker,
                &found_inf,
                &growth_factor,
                &backoff_factor,
                &growth_interval,
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_list_matches_the_kernel_struct() {
        // 8 + 128 * 8 + 128 * 8 + 129 * 8, under the 4 KB parameter limit with two pointers.
        assert_eq!(std::mem::size_of::<AmpTensorList>(), 3088);
        assert_eq!(std::mem::align_of::<AmpTensorList>(), 8);
        assert!(std::mem::size_of::<AmpTensorList>() + 2 * 8 <= 4096);
    }
}
