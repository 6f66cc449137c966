//! CUDA launcher for `multi_copy` in `kernels/copy.cu`: many contiguous copies on one device in
//! one launch, [`MAX_TENSORS`] a launch, on the current stream (the fast path of
//! `ops/foreach.rs`'s `foreach_copy_`). A copy moves bytes (one dtype) or casts elements
//! between f32, bf16 and f16, with the bits `copy_`'s cast kernels give. One launch costs the
//! host about as much as one `cuMemcpyDtoDAsync`, so a bucket of DDP gradients or a module's
//! parameters (cast to FSDP's bf16 all-gather input) move for the price of one copy instead of
//! one per tensor.

use super::kernels::{Grid, KernelParam};
use super::launch;
use super::runtime::runtime;
use crate::{DType, Error, Result};

/// Copies per launch (`EMBER_COPY_MAX_TENSORS` in the kernel file): the fused optimizers'
/// list size; 64 pairs keep the list at 2128 bytes, under the 4 KiB of kernel parameters every
/// driver takes, and FSDP's 148 GPT-2 shards at 3 launches.
const MAX_TENSORS: usize = 64;
/// Bytes per chunk of a byte copy, the unit of work of one block (`EMBER_COPY_CHUNK`).
const CHUNK: usize = 16384;
/// Elements per chunk of a cast (`EMBER_CAST_CHUNK`): 16 KiB of its f32 side.
const CAST_CHUNK: usize = 4096;

/// The kernel's `CopyList`. Same field order and size (2128 bytes) as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CopyList {
    n: i32,
    pad: i32,
    dst: [u64; MAX_TENSORS],
    src: [u64; MAX_TENSORS],
    /// Bytes of a byte copy, elements of a cast.
    len: [i64; MAX_TENSORS],
    chunk_start: [i64; MAX_TENSORS + 1],
    kind: [u8; MAX_TENSORS],
}

// SAFETY: repr(C) with the field order, types and size of the kernel file's `CopyList`.
unsafe impl KernelParam for CopyList {}

/// What one copy of a list does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyKind {
    /// `len` bytes as they are (a pair of one dtype).
    Bytes,
    /// `len` elements of `src` converted to `dst`, both of f32, bf16 and f16, unequal.
    Cast { src: DType, dst: DType },
}

impl CopyKind {
    /// The kind of a copy from `src` to `dst` elements, or an error for a pair the kernel
    /// does not convert.
    pub fn of(dst: DType, src: DType) -> Result<CopyKind> {
        if dst == src {
            return Ok(CopyKind::Bytes);
        }
        match (dtype_code(src), dtype_code(dst)) {
            (Some(_), Some(_)) => Ok(CopyKind::Cast { src, dst }),
            _ => Err(Error::invalid(
                "_foreach_copy_",
                format!("internal: no list cast from {src} to {dst}"),
            )),
        }
    }

    /// The kernel's `kind` code: `EMBER_COPY_BYTES`, or `EMBER_COPY_CAST(src, dst)`.
    fn code(self) -> u8 {
        match self {
            CopyKind::Bytes => 0,
            CopyKind::Cast { src, dst } => {
                let (s, d) = (dtype_code(src).unwrap_or(0), dtype_code(dst).unwrap_or(0));
                1 + 3 * s + d
            }
        }
    }

    /// The copy's units (bytes or elements) per chunk, and its length in those units for
    /// `elems` elements of `dtype` at its destination.
    fn units(self, elems: usize, dtype: DType) -> (usize, usize) {
        match self {
            CopyKind::Bytes => (CHUNK, elems * dtype.size_in_bytes()),
            CopyKind::Cast { .. } => (CAST_CHUNK, elems),
        }
    }
}

/// `EMBER_COPY_F32`, `_BF16`, `_F16` of the kernel file.
fn dtype_code(d: DType) -> Option<u8> {
    match d {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// One copy: `elems` elements from device address `src` to device address `dst`, of
/// `dst_dtype` there, converted as `kind` says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListCopy {
    pub dst: u64,
    pub src: u64,
    pub elems: usize,
    pub dst_dtype: DType,
    pub kind: CopyKind,
}

/// Runs `copies` on device `ordinal`'s current stream, [`MAX_TENSORS`] a launch; empty ones
/// are skipped.
///
/// # Safety
/// Every `src` must be readable for its `elems` elements of its dtype (`dst_dtype`, or the
/// cast's `src`) and every `dst` writable for its `elems` elements of `dst_dtype`, on device
/// `ordinal`, alive in stream order until the copies have run; no destination may overlap
/// another destination or any source.
pub(crate) unsafe fn multi_copy(ordinal: usize, copies: &[ListCopy]) -> Result<()> {
    let rt = runtime(ordinal)?;
    let nonempty: Vec<&ListCopy> = copies.iter().filter(|c| c.elems > 0).collect();
    for group in nonempty.chunks(MAX_TENSORS) {
        let mut list = CopyList {
            n: group.len() as i32,
            pad: 0,
            dst: [0; MAX_TENSORS],
            src: [0; MAX_TENSORS],
            len: [0; MAX_TENSORS],
            chunk_start: [0; MAX_TENSORS + 1],
            kind: [0; MAX_TENSORS],
        };
        let mut chunks = 0usize;
        for (t, c) in group.iter().enumerate() {
            let (chunk, len) = c.kind.units(c.elems, c.dst_dtype);
            list.dst[t] = c.dst;
            list.src[t] = c.src;
            list.len[t] = len as i64;
            list.kind[t] = c.kind.code();
            list.chunk_start[t] = chunks as i64;
            chunks += len.div_ceil(chunk);
        }
        list.chunk_start[group.len()] = chunks as i64;
        let grid = Grid::multi_tensor(rt, chunks);
        // The ranges are the caller's part (see above); `chunk_start` is the prefix count of
        // each copy's `len.div_ceil(chunk of its kind)`, so no block reads or writes past a
        // range's end.
        launch::multi_copy(rt, &[], grid, &list)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_list_matches_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<CopyList>(), 2128);
        assert_eq!(std::mem::align_of::<CopyList>(), 8);
    }

    /// The sizes and codes above are the kernel file's.
    #[test]
    fn constants_match_the_kernel_file() {
        let source = include_str!("../../kernels/copy.cu");
        let defined = |name: &str| {
            source
                .lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} is not defined in copy.cu"))
                .trim()
                .to_owned()
        };
        assert_eq!(defined("EMBER_COPY_MAX_TENSORS"), MAX_TENSORS.to_string());
        assert_eq!(defined("EMBER_COPY_CHUNK"), CHUNK.to_string());
        assert_eq!(defined("EMBER_CAST_CHUNK"), CAST_CHUNK.to_string());
        assert_eq!(defined("EMBER_COPY_BYTES"), CopyKind::Bytes.code().to_string());
        for (name, d) in [("F32", DType::F32), ("BF16", DType::BF16), ("F16", DType::F16)] {
            assert_eq!(
                defined(&format!("EMBER_COPY_{name}")),
                dtype_code(d).unwrap().to_string()
            );
        }
        assert_eq!(defined("EMBER_COPY_CAST(src, dst)"), "(1 + 3 * (src) + (dst))");
        let f32_bf16 = CopyKind::of(DType::BF16, DType::F32).unwrap();
        assert_eq!(f32_bf16.code(), 2);
        assert_eq!(CopyKind::of(DType::F32, DType::F16).unwrap().code(), 7);
        assert_eq!(CopyKind::of(DType::BF16, DType::BF16).unwrap(), CopyKind::Bytes);
        assert!(CopyKind::of(DType::F64, DType::F32).is_err());
    }

    #[test]
    fn chunks_count_bytes_for_copies_and_elements_for_casts() {
        let bytes = CopyKind::Bytes.units(5000, DType::F32);
        assert_eq!(bytes, (CHUNK, 20000));
        let cast = CopyKind::of(DType::BF16, DType::F32)
            .unwrap()
            .units(5000, DType::BF16);
        assert_eq!(cast, (CAST_CHUNK, 5000));
    }
}
