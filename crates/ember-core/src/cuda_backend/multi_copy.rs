//! CUDA launcher for `multi_copy` in `kernels/copy.cu`: many contiguous copies on one device in
//! one launch, [`MAX_TENSORS`] a launch, on the current stream (the fast path of
//! `ops/foreach.rs`'s `foreach_copy_`). One launch costs the host about as much as one
//! `cuMemcpyDtoDAsync`, so a bucket of DDP gradients or a module's parameters move for the
//! price of one copy instead of one per tensor.

use super::kernels::{Grid, KernelParam};
use super::launch;
use super::runtime::runtime;
use crate::Result;

/// Copies per launch (`EMBER_COPY_MAX_TENSORS` in the kernel file).
const MAX_TENSORS: usize = 64;
/// Bytes per chunk, the unit of work of one block (`EMBER_COPY_CHUNK`).
const CHUNK: usize = 16384;

/// The kernel's `CopyList`. Same field order and size (2064 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CopyList {
    n: i32,
    pad: i32,
    dst: [u64; MAX_TENSORS],
    src: [u64; MAX_TENSORS],
    bytes: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `CopyList`.
unsafe impl KernelParam for CopyList {}

/// One copy: `bytes` bytes from device address `src` to device address `dst`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ByteCopy {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
}

/// Runs `copies` on device `ordinal`'s current stream, [`MAX_TENSORS`] a launch; empty ones
/// are skipped.
///
/// # Safety
/// Every `src` must be readable and every `dst` writable for its `bytes` on device `ordinal`,
/// alive in stream order until the copies have run; no destination may overlap another
/// destination or any source.
pub(crate) unsafe fn multi_copy(ordinal: usize, copies: &[ByteCopy]) -> Result<()> {
    let rt = runtime(ordinal)?;
    let nonempty: Vec<&ByteCopy> = copies.iter().filter(|c| c.bytes > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = CopyList {
            n: group.len() as i32,
            pad: 0,
            dst: [0; MAX_TENSORS],
            src: [0; MAX_TENSORS],
            bytes: [0; MAX_TENSORS],
            chunk_start: [0; MAX_TENSORS + 1],
        };
        let mut chunks = 0usize;
        for (t, c) in group.iter().enumerate() {
            list.dst[t] = c.dst;
            list.src[t] = c.src;
            list.bytes[t] = c.bytes as i64;
            list.chunk_start[t] = chunks as i64;
            chunks += c.bytes.div_ceil(CHUNK);
        }
        list.chunk_start[group.len()] = chunks as i64;
        let grid = Grid::multi_tensor(rt, chunks);
        // The ranges are the caller's part (see above); `chunk_start` is the prefix count of
        // `bytes.div_ceil(CHUNK)`, so no block reads or writes past a range's end.
        launch::multi_copy(rt, &[], grid, &list)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_list_matches_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<CopyList>(), 2064);
        assert_eq!(std::mem::align_of::<CopyList>(), 8);
    }
}
