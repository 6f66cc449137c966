//! CUDA launcher for `kernels/amp.cu`: GradScaler's fused inf check and unscale of many
//! gradients ([`non_finite_check_and_unscale`]) and its scale update ([`update_scale`]), for
//! `ops/amp_scaling.rs` (reached through its `AmpOps` below). The tensors of the multi-tensor
//! kernel travel in an [`AmpTensorList`] passed by value, at most [`MAX_TENSORS`] per launch
//! (the chunked geometry of `cuda_backend/optim.rs`); every launch goes on the current stream and the
//! host never waits.

use super::kernels::{Grid, KernelParam};
use super::launch::{self, DevPtr, DevPtrMut};
use super::optim::{ptr, ptr_mut};
use super::runtime::runtime;
use super::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{AmpOps, Elems, ForeachNorm, ScaleUpdate, UnscaleGrads};
use crate::{DType, Result};

/// Tensors per launch (`EMBER_AMP_MAX_TENSORS` in the kernel file).
const MAX_TENSORS: usize = 128;
/// Elements per chunk, the unit of work of one block (`EMBER_AMP_CHUNK`).
const CHUNK: usize = 4096;

/// The kernel's `AmpTensorList`: the address, size and chunk prefix count of up to
/// [`MAX_TENSORS`] tensors. Same field order and size (3088 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AmpTensorList {
    n: i32,
    pad: i32,
    ptr: [u64; MAX_TENSORS],
    numel: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `AmpTensorList`.
unsafe impl KernelParam for AmpTensorList {}

impl AmpTensorList {
    /// The list of `tensors` (address, element count; at most [`MAX_TENSORS`]) and its chunk
    /// count.
    fn of(tensors: impl ExactSizeIterator<Item = (u64, usize)>) -> (AmpTensorList, usize) {
        let mut list = AmpTensorList {
            n: tensors.len() as i32,
            pad: 0,
            ptr: [0; MAX_TENSORS],
            numel: [0; MAX_TENSORS],
            chunk_start: [0; MAX_TENSORS + 1],
        };
        let mut chunks = 0usize;
        for (t, (addr, numel)) in tensors.enumerate() {
            list.ptr[t] = addr;
            list.numel[t] = numel as i64;
            list.chunk_start[t] = chunks as i64;
            chunks += numel.div_ceil(CHUNK);
        }
        list.chunk_start[list.n as usize] = chunks as i64;
        (list, chunks)
    }
}

/// Multiplies every element of each tensor in `tensors` (its first element, element count; all
/// of floating `dtype`, on device `ordinal`, no two overlapping) by the f32 at `inv_scale` and
/// stores 1.0 into the f32 at `found_inf` when any element was inf or NaN
/// (`torch._amp_foreach_non_finite_check_and_unscale_`). Empty tensors are skipped.
pub(crate) fn non_finite_check_and_unscale(
    ordinal: usize,
    dtype: DType,
    tensors: &[(DevPtrMut<'_>, usize)],
    found_inf: DevPtrMut<'_>,
    inv_scale: DevPtr<'_>,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let nonempty: Vec<&(DevPtrMut<'_>, usize)> = tensors.iter().filter(|t| t.1 > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let (list, chunks) = AmpTensorList::of(group.iter().map(|&&(ptr, numel)| (ptr.addr(), numel)));
        let grid = Grid::multi_tensor(rt, chunks);
        // The caller's part: each pointer of `list` reaches its `numel` elements of `dtype`, and
        // `found_inf` and `inv_scale` one f32 each; `chunk_start` is the prefix count of
        // `numel.div_ceil(CHUNK)`, so no block indexes past a tensor's end.
        launch::non_finite_check_and_unscale(rt, &[dtype], grid, &list, found_inf, inv_scale)?;
    }
    Ok(())
}

/// The norm of every tensor of `tensors` (its first element, element count; all of floating
/// `dtype`, on device `ordinal`), of order 2 or, with `inf_norm`, infinity, into the f32 at
/// `norms + i` (`torch._foreach_norm`): two launches per [`MAX_TENSORS`] tensors, each
/// deterministic (`amp.cu`). An empty tensor's norm is 0.
pub(crate) fn foreach_norm(
    ordinal: usize,
    dtype: DType,
    tensors: &[(DevPtr<'_>, usize)],
    norms: DevPtrMut<'_>,
    inf_norm: bool,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let flags = i32::from(inf_norm);
    let chunks: usize = tensors.iter().map(|t| t.1.div_ceil(CHUNK)).sum();
    // Each chunk's partial, for all groups: written by the first launch of a group, read by
    // its second, in stream order (freed after the launches are enqueued: the caching
    // allocator reuses it only for work ordered after them).
    let partials = CudaStorage::alloc(ordinal, DType::F32, chunks.max(1))?;
    let partials_ptr = partials.dev_ptr_mut_at(0);
    let mut chunk_base = 0usize;
    for (g, group) in tensors.chunks(MAX_TENSORS).enumerate() {
        let (list, group_chunks) = AmpTensorList::of(group.iter().map(|&(ptr, numel)| (ptr.addr(), numel)));
        let part = partials_ptr.add_bytes(chunk_base * 4);
        // The caller's part: each pointer reaches its `numel` elements of `dtype`; `part` has
        // room for this group's `group_chunks` partials (all groups' add up to `chunks`), and
        // `norms` for one f32 per tensor of `tensors`.
        if group_chunks > 0 {
            launch::foreach_norm_partials(
                rt,
                &[dtype],
                Grid::multi_tensor(rt, group_chunks),
                &list,
                part,
                flags,
            )?;
        }
        let finish = Grid {
            grid: (group.len() as u32, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        let out = norms.add_bytes(g * MAX_TENSORS * 4);
        launch::foreach_norm_finish(rt, &[], finish, &list, part.read_only(), out, flags)?;
        chunk_base += group_chunks;
    }
    drop(partials);
    Ok(())
}

/// Updates the f32 scale at `scale` and the i32 at `growth_tracker` from the f32 at
/// `found_inf` in one single-thread kernel (`torch._amp_update_scale_`; the rule is in the
/// kernel file).
pub(crate) fn update_scale(
    ordinal: usize,
    [scale, growth_tracker]: [DevPtrMut<'_>; 2],
    found_inf: DevPtr<'_>,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i32,
) -> Result<()> {
    let rt = runtime(ordinal)?;
    let grid = Grid {
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
    };
    launch::update_scale(
        rt,
        &[],
        grid,
        scale,
        growth_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
    )
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

impl AmpOps for CudaStorage {
    fn non_finite_check_and_unscale(
        grads: UnscaleGrads<'_, CudaStorage>,
        found_inf: Elems<&mut CudaStorage>,
        inv_scale: Elems<&CudaStorage>,
    ) -> Result<()> {
        let ordinal = found_inf.storage.ordinal();
        let (found_ptr, inv_ptr) = (ptr_mut(&found_inf), ptr(&inv_scale));
        // One multi-tensor kernel per dtype, in this order.
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let group: Vec<(DevPtrMut<'_>, usize)> = grads
                .grads
                .iter()
                .map(|g| (&*grads.storages[g.storage], g))
                .filter(|(s, _)| s.dtype() == dtype)
                .map(|(s, g)| (s.dev_ptr_mut_at(g.offset), g.len))
                .collect();
            if !group.is_empty() {
                self::non_finite_check_and_unscale(ordinal, dtype, &group, found_ptr, inv_ptr)?;
            }
        }
        Ok(())
    }

    fn foreach_norm(list: ForeachNorm<'_, CudaStorage>, norms: Elems<&mut CudaStorage>) -> Result<()> {
        let Some(first) = list.storages.first() else {
            return Ok(());
        };
        let (ordinal, dtype) = (first.ordinal(), first.dtype());
        let tensors: Vec<(DevPtr<'_>, usize)> = list
            .tensors
            .iter()
            .map(|r| (list.storages[r.storage].dev_ptr_at(r.offset), r.len))
            .collect();
        self::foreach_norm(ordinal, dtype, &tensors, ptr_mut(&norms), list.inf_norm)
    }

    fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut CudaStorage>,
        growth_tracker: Elems<&mut CudaStorage>,
        found_inf: Elems<&CudaStorage>,
    ) -> Result<()> {
        self::update_scale(
            scale.storage.ordinal(),
            [ptr_mut(&scale), ptr_mut(&growth_tracker)],
            ptr(&found_inf),
            u.growth_factor,
            u.backoff_factor,
            u.growth_interval,
        )
    }
}
