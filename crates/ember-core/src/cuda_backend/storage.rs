//! [`CudaStorage`]: a tensor's elements in device memory from the caching allocator, and the
//! copies and casts every other CUDA op builds on (host ↔ device, device ↔ device, strided
//! copies, fills).
//!
//! Ops enqueue on the current stream of the storage's device and return at once; only reads
//! into host memory wait, and only for that stream.
//!
//! Note [Peer copies]: a copy from one GPU to another ([`CudaStorage::to_device`]) never waits
//! on the host, as PyTorch's: it runs on the source device's current stream, which first waits
//! (an event) for the work queued on the target's current stream (the destination block may
//! still be in use there), and the target's current stream then waits (a second event) for the
//! copy, so work queued on either current stream afterwards is ordered after it. A strided
//! source is first made contiguous on its device; that staging buffer is freed to its pool on
//! the stream that ran the copy, so it is not reused early. The first copy between two devices
//! enables peer access both ways where the hardware allows (as PyTorch's `get_p2p_access`):
//! without it cuMemcpyPeerAsync is staged through host memory by the driver, several times
//! slower than a direct NVLink copy.
//!
//! A copy whose source nothing touches afterwards (a gradient on its way back to another
//! device in backward: `to_device_private`) runs on a side stream of the source device
//! instead, which waits for both current streams. The source's stream then goes on at once:
//! with the engine's device threads (Note [Device threads]) the target's queue often holds a
//! whole replica's backward when the copy is issued, and waiting for it on the source's stream
//! stalled the other replica's backward behind it (dp_mlp_large on two H100s: 4.64 to 4.70 ms
//! per step, against 3.93 with the side stream and 3.95 to 3.97 with one thread for backward).
//!
//! A private copy of a gradient computed in row blocks (`to_device_private_in_blocks`, Note
//! [Gradients in row blocks]) waits for neither current stream: each block waits for its own
//! event, on a second side stream (behind the first one's copies it would wait for whatever
//! they wait for), and its output comes from the pool of that second side stream of the target
//! (recorded on the target's current stream, which reads it), so no block of the target's own
//! queued work can be reused under it.

use super::kernels::{Grid, KernelShape};
use super::launch::{self, DevPtr, DevPtrMut};
use super::multi_copy::{multi_copy, CopyKind, ListCopy};
use super::runtime::{runtime, DeviceRuntime};
use super::stream::current_raw;
use crate::backend::host::{with_cpu_storage, CpuElement, CpuStorage};
use crate::backend::{BackendDevice, BackendStorage, Distribution, PhiloxState};
use crate::backend::{CopyOps, ForeachCopy};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cudarc::driver::{result, sys};
use std::sync::Arc;

/// Elements of one tensor storage in the memory of one GPU.
#[derive(Debug, Clone)]
pub struct CudaStorage {
    buf: Arc<DeviceBuffer>,
    dtype: DType,
    len: usize,
}

/// A block from the caching allocator, returned to it on drop (to the pool of the stream it
/// was allocated on; see `allocator.rs`).
#[derive(Debug)]
struct DeviceBuffer {
    ptr: u64,
    device: usize,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            if let Ok(rt) = runtime(self.device) {
                rt.allocator.free(self.ptr);
            }
        }
    }
}

impl CudaStorage {
    /// Uninitialized room for `len` elements of `dtype` on `device`, allocated on the current
    /// stream; an [`Error::OutOfMemory`] when the device cannot hold it.
    pub fn alloc(device: usize, dtype: DType, len: usize) -> Result<CudaStorage> {
        let rt = runtime(device)?;
        CudaStorage::alloc_on(rt, dtype, len)
    }

    pub(crate) fn alloc_on(rt: &DeviceRuntime, dtype: DType, len: usize) -> Result<CudaStorage> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            Error::invalid(
                "allocate",
                format!("{len} elements of {dtype} overflow the address space"),
            )
        })?;
        let a = rt
            .allocator
            .malloc(bytes, current_raw(rt.ordinal))
            .map_err(|oom| {
                crate::memory::out_of_memory(
                    crate::Device::Cuda(rt.ordinal),
                    oom.requested,
                    oom.total,
                    oom.free,
                    oom.allocated,
                    oom.reserved,
                )
            })?;
        Ok(CudaStorage {
            buf: Arc::new(DeviceBuffer {
                ptr: a.ptr,
                device: rt.ordinal,
            }),
            dtype,
            len,
        })
    }

    /// The GPU the elements live on (the index of [`BackendStorage::device`]).
    pub fn ordinal(&self) -> usize {
        self.buf.device
    }

    /// Device address of element `offset`.
    #[inline]
    pub(crate) fn ptr_at(&self, offset: usize) -> u64 {
        self.buf.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }

    /// Device address of the first element of `layout`.
    #[inline]
    pub(crate) fn ptr(&self, layout: &Layout) -> u64 {
        self.ptr_at(layout.offset())
    }

    /// Element `offset` (a layout's offset, or one checked against the storage) as an operand
    /// a kernel reads (Note [Typed launchers] in `launch.rs`).
    #[inline]
    pub(crate) fn dev_ptr_at(&self, offset: usize) -> DevPtr<'_> {
        // SAFETY: the address is element `offset` of this storage's block: inside it, or past
        // its end only for a view with no elements (the offset of `narrow` on a tensor with a
        // zero dim); the block stays allocated while `self` is borrowed (the `Arc` holds it)
        // and the caching allocator reuses it after its free only in stream order.
        unsafe { DevPtr::new(self.ptr_at(offset)) }
    }

    /// The first element of `layout` as an operand a kernel reads.
    #[inline]
    pub(crate) fn dev_ptr(&self, layout: &Layout) -> DevPtr<'_> {
        self.dev_ptr_at(layout.offset())
    }

    /// Element `offset` as an operand a kernel writes. Takes `&self`, as every CUDA op that
    /// writes a storage does: the caller holds the storage's write access (a fresh output, or
    /// the write lock of the dispatch point).
    #[inline]
    pub(crate) fn dev_ptr_mut_at(&self, offset: usize) -> DevPtrMut<'_> {
        // SAFETY: as in `dev_ptr_at`.
        unsafe { DevPtrMut::new(self.ptr_at(offset)) }
    }

    /// The first element of `layout` as an operand a kernel writes.
    #[inline]
    pub(crate) fn dev_ptr_mut(&self, layout: &Layout) -> DevPtrMut<'_> {
        self.dev_ptr_mut_at(layout.offset())
    }

    /// The runtime of this storage's device, bound to the calling thread.
    #[inline]
    pub(crate) fn runtime(&self) -> Result<&'static DeviceRuntime> {
        runtime(self.buf.device)
    }

    /// Marks the memory as used on `stream` (`Tensor.record_stream`): the allocator will not
    /// reuse it until the work queued there at free time has finished.
    pub fn record_stream(&self, stream: &super::Stream) -> Result<()> {
        if stream.device_index() != self.buf.device {
            return Err(Error::invalid(
                "record_stream",
                format!(
                    "the tensor is on cuda:{} and the stream on cuda:{}",
                    self.buf.device,
                    stream.device_index()
                ),
            ));
        }
        self.runtime()?
            .allocator
            .record_stream(self.buf.ptr, stream.as_raw());
        Ok(())
    }

    /// Copies a host storage to `device` (asynchronously with respect to the device; the host
    /// buffer is staged by the driver before this returns).
    pub fn from_cpu(cpu: &CpuStorage, device: usize) -> Result<CudaStorage> {
        let rt = runtime(device)?;
        // A replay would read the host buffer again, long gone (Note [Operations refused during
        // capture]); the pageable copy would also invalidate the capture.
        super::capture::refuse_during_capture(device, "a copy from host memory to the device")?;
        let out = CudaStorage::alloc_on(rt, cpu.dtype(), cpu.len())?;
        let bytes = host_bytes(cpu);
        if !bytes.is_empty() {
            super::kernel_timing::note_work(current_raw(device));
            // SAFETY: `out` holds exactly `bytes.len()` bytes; pageable host memory is copied to
            // a staging buffer before cuMemcpyHtoDAsync returns, so `cpu` may go away after.
            let _gate = super::cupti::work_guard();
            unsafe { result::memcpy_htod_async(out.buf.ptr, bytes, current_raw(device) as sys::CUstream) }
                .map_err(cuda_error("copy to device"))?;
        }
        Ok(out)
    }

    /// Enqueues a copy of `bytes` from host memory into this storage from element `offset` on,
    /// on the current stream, without waiting. The caller keeps `bytes` alive and unchanged
    /// until the copy has finished (see `cuda_backend/pinned.rs`).
    pub(crate) fn copy_from_host_async(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        let rt = self.runtime()?;
        super::capture::refuse_during_capture(rt.ordinal, "a copy from host memory to the device")?;
        if bytes.len() > (self.len - offset.min(self.len)) * self.dtype.size_in_bytes() {
            return Err(Error::invalid(
                "copy",
                "the source is larger than the destination",
            ));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        super::kernel_timing::note_work(current_raw(rt.ordinal));
        let _gate = super::cupti::work_guard();
        // SAFETY: the destination range holds `bytes.len()` bytes (checked above); the caller
        // keeps the host buffer alive until the stream has run the copy.
        unsafe {
            result::memcpy_htod_async(
                self.ptr_at(offset),
                bytes,
                current_raw(rt.ordinal) as sys::CUstream,
            )
        }
        .map_err(cuda_error("copy to device"))
    }

    /// Enqueues a copy of pageable host `bytes` into this storage from element `offset` on, on
    /// the current stream. The driver copies pageable memory to a staging buffer before
    /// returning (as in [`CudaStorage::from_cpu`]), so `bytes` may go away at once.
    pub(crate) fn write_pageable(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        // The staging makes the copy's "keep alive until done" contract hold at return.
        self.copy_from_host_async(offset, bytes)
    }

    /// `n` elements of `dtype`, all `value` (converted as a cast would), on `device`.
    pub fn full(device: usize, dtype: DType, n: usize, value: f64) -> Result<CudaStorage> {
        let rt = runtime(device)?;
        let out = CudaStorage::alloc_on(rt, dtype, n)?;
        out.fill(rt, 0, n, value)?;
        Ok(out)
    }

    /// Sets elements `start..start + n` to `value`.
    fn fill(&self, rt: &DeviceRuntime, start: usize, n: usize, value: f64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let stream = current_raw(rt.ordinal);
        let one = CpuStorage::full(self.dtype, 1, value)?;
        let mut pattern = [0u8; 8];
        let bytes = host_bytes(&one);
        pattern[..bytes.len()].copy_from_slice(bytes);
        if bytes.len() == 8 {
            let (dst, word) = (self.dev_ptr_mut_at(start), u64::from_ne_bytes(pattern));
            return launch::fill_u64(rt, &[], Grid::linear(rt, n, 256), dst, word, n as i64);
        }
        let dst = self.ptr_at(start);
        super::kernel_timing::note_work(stream);
        let s = stream as sys::CUstream;
        // Fills as copies (Note [CUPTI beside other threads' CUDA work] in `cupti.rs`).
        let _gate = super::cupti::work_guard();
        // SAFETY: `dst` points at `n` elements of this storage, which the stream may write.
        let r = unsafe {
            match bytes.len() {
                1 => sys::cuMemsetD8Async(dst, pattern[0], n, s),
                2 => sys::cuMemsetD16Async(dst, u16::from_ne_bytes([pattern[0], pattern[1]]), n, s),
                _ => sys::cuMemsetD32Async(dst, u32::from_ne_bytes(pattern[..4].try_into().unwrap()), n, s),
            }
        };
        r.result().map_err(cuda_error("fill"))
    }

    /// Writes `src` at `src_layout` into `self` at `dst_layout` (same shapes, any dtypes), both
    /// on this device, in stream order.
    fn copy_from_device(&self, dst_layout: &Layout, src: &CudaStorage, src_layout: &Layout) -> Result<()> {
        let n = dst_layout.numel();
        if n == 0 {
            return Ok(());
        }
        let rt = self.runtime()?;
        let stream = current_raw(rt.ordinal);
        let (dst, srcp) = (self.ptr(dst_layout), src.ptr(src_layout));
        // Under compute-sanitizer a copy captured into a graph is a kernel (Note [Graph copies
        // under initcheck] in `mod.rs`).
        let memcpy = !(super::sanitizer_workarounds() && super::capture::any_on_device(rt.ordinal));
        if memcpy && src.dtype == self.dtype && dst_layout.is_contiguous() && src_layout.is_contiguous() {
            super::kernel_timing::note_work(stream);
            let _gate = super::cupti::work_guard();
            // SAFETY: both ranges hold `n` elements of one dtype inside their storages.
            return unsafe {
                result::memcpy_dtod_async(dst, srcp, n * self.dtype.size_in_bytes(), stream as sys::CUstream)
            }
            .map_err(cuda_error("device copy"));
        }
        let shape = KernelShape::new(
            "copy",
            dst_layout.dims(),
            &[src_layout.strides(), dst_layout.strides()],
        )?;
        let (dtypes, grid, n64) = ([src.dtype, self.dtype], Grid::linear(rt, n, 256), n as i64);
        let (srcp, dst) = (src.dev_ptr(src_layout), self.dev_ptr_mut(dst_layout));
        // Both hold `n` elements; the strides come from valid layouts of each.
        if shape.is_contiguous(0) && shape.is_contiguous(1) {
            return launch::cast_contig(rt, &dtypes, grid, srcp, dst, n64);
        }
        // Note [Copies in words]: a strided copy in one dtype whose rows are contiguous (a
        // gradient written into a slice of a wider one, `narrow`'s backward: GPT-2's q, k and v
        // into the qkv projection's gradient) moves 8-byte words, 4 bf16 a thread: the
        // element-wise kernel spent its time on index arithmetic, 38 µs for 12.6 MB of bf16
        // (660 GB/s on an H200), in words 12 µs (docs/benchmarks.md, session 44). The identity
        // cast of i64 copies the words' bits.
        let words = (src.dtype == self.dtype)
            .then(|| {
                shape.in_words(
                    self.dtype.size_in_bytes(),
                    [src.ptr(src_layout), self.ptr(dst_layout)],
                )
            })
            .flatten();
        if let Some(words) = words {
            let count = n * self.dtype.size_in_bytes() / 8;
            let grid = Grid::linear(rt, count, 256);
            // The same bytes as the element copy: every word lies inside both layouts' ranges.
            return launch::cast_strided(
                rt,
                &[DType::I64, DType::I64],
                grid,
                srcp,
                dst,
                &words,
                count as i64,
            );
        }
        launch::cast_strided(rt, &dtypes, grid, srcp, dst, &shape, n64)
    }

    /// The elements of `layout` as a row-major storage on GPU `device`: a peer copy when it is
    /// another GPU, enqueued without waiting (Note [Peer copies]).
    pub fn to_device(&self, layout: &Layout, device: usize) -> Result<CudaStorage> {
        self.copy_to_device(layout, device, Source::Shared)
    }

    /// As [`CudaStorage::to_device`], for a source that nothing reads or writes after this
    /// call (a gradient the autograd engine hands on): a copy to another GPU runs on a side
    /// stream of the source's device, so the source's current stream does not wait for the
    /// target's queued work (Note [Peer copies]).
    pub fn to_device_private(&self, layout: &Layout, device: usize) -> Result<CudaStorage> {
        self.copy_to_device(layout, device, Source::Private)
    }

    /// [`CudaStorage::to_device_private`] of a contiguous gradient computed in row blocks
    /// (Note [Gradients in row blocks]): the rows of each block are copied once its event has
    /// completed, while the later blocks are still being computed. `blocks` are the gradient's
    /// events, rows of `row_len` elements.
    pub(crate) fn to_device_private_in_blocks(
        &self,
        layout: &Layout,
        device: usize,
        blocks: &[super::RowBlockEvent],
        row_len: usize,
    ) -> Result<CudaStorage> {
        self.copy_to_device(layout, device, Source::Blocks { blocks, row_len })
    }

    fn copy_to_device(&self, layout: &Layout, device: usize, source: Source<'_>) -> Result<CudaStorage> {
        let private = !matches!(source, Source::Shared);
        if device != self.buf.device {
            super::capture::refuse_during_capture(self.buf.device, "a copy between GPUs")?;
            super::capture::refuse_during_capture(device, "a copy between GPUs")?;
        }
        if device == self.buf.device {
            return self.to_dtype(layout, self.dtype);
        }
        // A strided source is first made contiguous on its own device; a contiguous one is
        // copied from where it lies.
        let staged = match layout.is_contiguous() {
            true => None,
            false => Some(self.to_dtype(layout, self.dtype)?),
        };
        let src_ptr = match &staged {
            Some(s) => s.buf.ptr,
            None => self.ptr(layout),
        };
        let n = layout.numel();
        let src_rt = self.runtime()?;
        let rt = runtime(device)?;
        // Blocks cover a contiguous source, their rows counted from its first; anything else
        // is copied whole once the source's stream has written it.
        let blocks = match source {
            Source::Blocks { blocks, row_len } if staged.is_none() && tile(blocks, row_len, n) => {
                Some((blocks, row_len))
            }
            _ => None,
        };
        // A copy in blocks must not wait for the target's queued work (the target's own share
        // of the same GEMM, say), which a block of the target stream's pool may still be used
        // by: its output comes from the pool of a side stream of the target that runs nothing
        // but such copies, and is then recorded on the target's stream that reads it.
        let alloc_stream = match blocks {
            Some(_) => Some(peer_copy_stream(device, 1)?),
            None => None,
        };
        let out = {
            let _on_side = alloc_stream.as_ref().map(super::stream::stream);
            CudaStorage::alloc_on(rt, self.dtype, n)?
        };
        let bytes = n * self.dtype.size_in_bytes();
        if bytes == 0 {
            return Ok(out);
        }
        super::runtime::enable_peer_access(rt, src_rt);
        super::runtime::enable_peer_access(src_rt, rt);
        let (src_stream, dst_stream) = (
            super::stream::current_stream(src_rt.ordinal)?,
            super::stream::current_stream(device)?,
        );
        let copy_stream = match private {
            false => src_stream.clone(),
            true => {
                let side = peer_copy_stream(src_rt.ordinal, usize::from(blocks.is_some()))?;
                if blocks.is_none() {
                    side.wait_event(&src_stream.record_event()?)?;
                }
                // The source (or its staging copy) returns to its pool on the source's stream
                // when dropped: not reused before the side stream has read it.
                match &staged {
                    Some(s) => s.record_stream(&side)?,
                    None => self.record_stream(&side)?,
                }
                side
            }
        };
        // `out` may be a block whose previous use on the stream it was allocated for is still
        // queued.
        let dst_ready = alloc_stream.as_ref().unwrap_or(&dst_stream).record_event()?;
        copy_stream.wait_event(&dst_ready)?;
        if alloc_stream.is_some() {
            out.record_stream(&dst_stream)?;
        }
        src_rt.bind()?;
        super::kernel_timing::note_work(copy_stream.as_raw());
        // Bytes `start..end` of the source into the same bytes of `out`, on `copy_stream`.
        let copy = |start: usize, end: usize| {
            // SAFETY: both ranges hold `end <= bytes` bytes from `start`. The copy runs on
            // `copy_stream`, after the work queued on the stream `out` was allocated for (the
            // target's, or the target's side stream; waited above), and after what wrote its
            // bytes: the staging copy that wrote `staged`, or the work that wrote a contiguous
            // source (the source's current stream itself, or a side stream that waited for it
            // or for the event of this block's rows). Neither source block is reused while the
            // copy reads it: on the source's stream, its later work comes after the copy; on a
            // side stream, `record_stream` keeps the blocks from their pool until the copy has
            // run, and a private source is written by nothing after this call.
            unsafe { peer_copy_bytes((rt, out.buf.ptr), (src_rt, src_ptr), start..end, &copy_stream) }
        };
        match blocks {
            // Each block once the event that says it is written has completed.
            Some((blocks, row_len)) => {
                let row_bytes = row_len * self.dtype.size_in_bytes();
                for b in blocks {
                    copy_stream.wait_event(&b.event)?;
                    copy(b.rows.start * row_bytes, b.rows.end * row_bytes)?;
                }
            }
            None => copy(0, bytes)?,
        }
        let copied = copy_stream.record_event()?;
        dst_stream.wait_event(&copied)?;
        rt.bind()?;
        Ok(out)
    }
}

impl CudaStorage {
    /// The contiguous `self` (at `layout`, rows of `row_len` elements) copied to GPU `device` in
    /// the row blocks `ranges`, each followed by an event, with the event of the whole copy
    /// (Note [Copies in row blocks] in `storage/row_blocks.rs`). Neither device's current stream waits
    /// for the copy: the caller records it (`row_blocks::record_copy`) so that the dispatch
    /// point orders every other use of either storage after it. The copy runs on a side
    /// stream of the source's device once the source's current stream has written it, into
    /// memory from the pool of a side stream of the target (which waits for the whole copy,
    /// so the memory is not handed out again before it is written).
    pub(crate) fn to_device_in_row_blocks(
        &self,
        layout: &Layout,
        device: usize,
        ranges: &[std::ops::Range<usize>],
        row_len: usize,
    ) -> Result<(CudaStorage, Vec<super::RowBlockEvent>, super::Event)> {
        let n = layout.numel();
        let tiles = ranges.first().is_some_and(|r| r.start == 0)
            && ranges
                .windows(2)
                .all(|w| w[0].end == w[1].start && w[1].start < w[1].end)
            && ranges.last().and_then(|r| r.end.checked_mul(row_len)) == Some(n);
        if device == self.buf.device || !layout.is_contiguous() || !tiles {
            return Err(Error::invalid(
                "to_device_in_row_blocks",
                "expected a contiguous source, another GPU and row blocks that tile the rows",
            ));
        }
        super::capture::refuse_during_capture(self.buf.device, "a copy between GPUs")?;
        super::capture::refuse_during_capture(device, "a copy between GPUs")?;
        let (src_rt, rt) = (self.runtime()?, runtime(device)?);
        let alloc_stream = peer_copy_stream(device, 2)?;
        let out = {
            let _on_side = super::stream::stream(&alloc_stream);
            CudaStorage::alloc_on(rt, self.dtype, n)?
        };
        super::runtime::enable_peer_access(rt, src_rt);
        super::runtime::enable_peer_access(src_rt, rt);
        let (src_stream, dst_stream) = (
            super::stream::current_stream(src_rt.ordinal)?,
            super::stream::current_stream(device)?,
        );
        let copy_stream = peer_copy_stream(src_rt.ordinal, 2)?;
        copy_stream.wait_event(&src_stream.record_event()?)?;
        copy_stream.wait_event(&alloc_stream.record_event()?)?;
        self.record_stream(&copy_stream)?;
        out.record_stream(&dst_stream)?;
        src_rt.bind()?;
        super::kernel_timing::note_work(copy_stream.as_raw());
        let (src_ptr, row_bytes) = (self.ptr(layout), row_len * self.dtype.size_in_bytes());
        let mut events = Vec::with_capacity(ranges.len());
        for rows in ranges {
            let (start, end) = (rows.start * row_bytes, rows.end * row_bytes);
            // SAFETY: both ranges lie inside the `n` elements of the source (contiguous at
            // `src_ptr`) and of `out`. The copy runs on `copy_stream`, after the source's current
            // stream has written the source and after the work queued on the pool stream `out`
            // came from; the source is kept from its pool until the copy has run
            // (`record_stream`), `out` is given back to its pool only after the copy (the pool
            // stream waits for it below), and every other reader or writer of either storage
            // waits for the copy at the dispatch point (the caller records the copy).
            unsafe { peer_copy_bytes((rt, out.buf.ptr), (src_rt, src_ptr), start..end, &copy_stream)? };
            events.push(super::RowBlockEvent {
                rows: rows.clone(),
                event: copy_stream.record_event()?,
            });
        }
        let done = copy_stream.record_event()?;
        alloc_stream.wait_event(&done)?;
        rt.bind()?;
        Ok((out, events, done))
    }
}

/// Copies bytes `bytes` from `src` (a device address of `src_rt`'s GPU) into the same bytes
/// from `dst` (of `rt`'s GPU), on `stream`.
///
/// # Safety
/// Both byte ranges lie inside live allocations of their devices, and the caller orders the
/// copy after what writes the source and before what else reads or writes either range.
unsafe fn peer_copy_bytes(
    (rt, dst): (&DeviceRuntime, u64),
    (src_rt, src): (&DeviceRuntime, u64),
    bytes: std::ops::Range<usize>,
    stream: &super::Stream,
) -> Result<()> {
    let _gate = super::cupti::work_guard();
    // SAFETY: the caller's contract; the contexts are the devices' primary contexts.
    unsafe {
        result::memcpy_peer_async(
            rt.context(),
            dst + bytes.start as u64,
            src_rt.context(),
            src + bytes.start as u64,
            bytes.len(),
            stream.as_raw() as sys::CUstream,
        )
    }
    .map_err(cuda_error("peer copy"))
}

/// What a copy to another GPU may assume of its source.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Read on the source's current stream, after its queued work.
    Shared,
    /// Written by nothing after the call: read on a side stream once the current stream has
    /// written it.
    Private,
    /// As `Private`, written in row blocks of `row_len` elements, each done at its event.
    Blocks {
        blocks: &'a [super::RowBlockEvent],
        row_len: usize,
    },
}

/// Whether `blocks` are consecutive row ranges of `row_len` elements covering all `n`.
pub(crate) fn tile(blocks: &[super::RowBlockEvent], row_len: usize, n: usize) -> bool {
    let mut next = 0;
    for b in blocks {
        if b.rows.start != next || b.rows.end <= b.rows.start {
            return false;
        }
        next = b.rows.end;
    }
    row_len > 0 && next.checked_mul(row_len) == Some(n)
}

/// The side stream of `device` that private peer copies run on
/// ([`CudaStorage::to_device_private`]): one per device, from the stream pool.
/// `lane` 1 is a second such stream, for the copies of gradients in row blocks: each of those
/// waits for its rows alone, and behind another private copy (which waits for everything its
/// source's stream had queued, such as the rest of the blocked GEMM) it would wait for that.
/// `lane` 2 runs the copies of [`CudaStorage::to_device_in_row_blocks`] (on the source's
/// device) and gives their targets' memory (on the target's).
fn peer_copy_stream(device: usize, lane: usize) -> Result<super::Stream> {
    type Lanes = [Option<super::Stream>; 3];
    static STREAMS: std::sync::Mutex<Vec<Lanes>> = std::sync::Mutex::new(Vec::new());
    let mut streams = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    if streams.len() <= device {
        streams.resize(device + 1, [None, None, None]);
    }
    match &streams[device][lane] {
        Some(s) => Ok(s.clone()),
        None => Ok(streams[device][lane]
            .insert(super::Stream::new_on(device)?)
            .clone()),
    }
}

/// The bytes of a host storage (every dtype is plain data: bool is one byte, 0 or 1).
pub(crate) fn host_bytes(cpu: &CpuStorage) -> &[u8] {
    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: T is one of ember's element types: plain data without padding or invalid
        // byte patterns when read as u8; the slice covers exactly the vector's elements.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    with_cpu_storage!(cpu, v => bytes(v))
}

pub(crate) fn cuda_error(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

impl CopyOps for CudaStorage {
    /// The elements of `layout` in a new row-major storage of `dtype` on the same device.
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let out = CudaStorage::alloc_on(rt, dtype, layout.numel())?;
        out.copy_from_device(&Layout::contiguous(layout.shape().clone()), self, layout)?;
        Ok(out)
    }

    /// The elements of `layout` copied into host memory, row-major; waits for the current stream.
    /// An error a kernel recorded on this device (an index out of range, ...) is returned here
    /// instead of the elements (Note [Deferred device errors] in `device_errors.rs`). An error
    /// while the current stream is capturing a CUDA graph (Note [Operations refused during
    /// capture]).
    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        self.runtime()?;
        super::capture::refuse_during_capture(
            self.buf.device,
            "a copy from the device to host memory (to_vec, item, to(Device::Cpu), printing)",
        )?;
        let src = if layout.is_contiguous() && layout.offset() == 0 && layout.numel() == self.len {
            None
        } else {
            Some(self.to_dtype(layout, self.dtype)?)
        };
        let src = src.as_ref().unwrap_or(self);
        fn read<T: CpuElement + Default + Clone>(src: &CudaStorage, n: usize) -> Result<CpuStorage> {
            let mut host = vec![T::default(); n];
            if n > 0 {
                super::stream::note_host_sync();
                super::kernel_timing::note_work(current_raw(src.buf.device));
                let stream = current_raw(src.buf.device) as sys::CUstream;
                let _gate = super::cupti::work_guard();
                // SAFETY: `host` has room for `n` elements of T, the size of src's dtype; the
                // stream is synchronized before `host` is read.
                unsafe {
                    result::memcpy_dtoh_async(&mut host[..], src.buf.ptr, stream)
                        .and_then(|_| result::stream::synchronize(stream))
                }
                .map_err(cuda_error("copy to host"))?;
            }
            Ok(T::wrap(host))
        }
        let n = layout.numel();
        let rt = src.runtime()?;
        let host = match self.dtype {
            DType::Bool => read::<bool>(src, n),
            DType::U8 => read::<u8>(src, n),
            DType::I32 => read::<i32>(src, n),
            DType::I64 => read::<i64>(src, n),
            DType::F16 => read::<half::f16>(src, n),
            DType::BF16 => read::<half::bf16>(src, n),
            DType::F32 => read::<f32>(src, n),
            DType::F64 => read::<f64>(src, n),
        }?;
        if n > 0 {
            rt.errors.check()?;
        }
        Ok(host)
    }

    /// Writes `src` at `src_layout` (on any GPU) into `self` at `dst_layout`; a source on another
    /// GPU is first copied here (see [`CudaStorage::to_device`]).
    fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
    ) -> Result<()> {
        if src.buf.device == self.buf.device {
            return self.copy_from_device(dst_layout, src, src_layout);
        }
        let staged = src.to_device(src_layout, self.buf.device)?;
        self.copy_from_device(
            dst_layout,
            &staged,
            &Layout::contiguous(src_layout.shape().clone()),
        )
    }

    fn foreach_copy(list: ForeachCopy<'_, CudaStorage>) -> Result<()> {
        let Some(first) = list.written.first() else {
            return Ok(());
        };
        let ordinal = first.ordinal();
        if let Some(other) = list
            .written
            .iter()
            .map(|s| s.ordinal())
            .chain(list.read.iter().map(|s| s.ordinal()))
            .find(|&o| o != ordinal)
        {
            return Err(crate::Error::DeviceMismatch {
                op: "_foreach_copy_",
                lhs: Device::Cuda(ordinal),
                rhs: Device::Cuda(other),
            });
        }
        let copies = list
            .copies
            .iter()
            .map(|(d, s)| {
                let (dst, src) = (&list.written[d.storage], list.read[s.storage]);
                Ok(ListCopy {
                    dst: dst.ptr_at(d.offset),
                    src: src.ptr_at(s.offset),
                    elems: d.len,
                    dst_dtype: dst.dtype(),
                    kind: CopyKind::of(dst.dtype(), src.dtype())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let _device = super::DeviceGuard::new(ordinal)?;
        // SAFETY: each run lies inside its storage (`ForeachCopy::check`: runs of one length,
        // so a cast reads `elems` elements of its source's dtype), the written storages
        // are borrowed mutably and the read ones shared for the call, all on device `ordinal`;
        // no two written runs overlap and no storage is both written and read (the list's
        // contract); the storages are freed through the caching allocator, in stream order.
        unsafe { multi_copy(ordinal, &copies) }
    }
}

/// GPU `.0` (its ordinal), as a backend device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDevice(pub usize);

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;

    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<CudaStorage> {
        CudaStorage::from_cpu(&cpu, self.0)
    }

    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<CudaStorage> {
        CudaStorage::full(self.0, dtype, n, value)
    }

    fn alloc(&self, dtype: DType, n: usize) -> Result<CudaStorage> {
        CudaStorage::alloc(self.0, dtype, n)
    }

    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: PhiloxState) -> Result<CudaStorage> {
        CudaStorage::random(self.0, dtype, n, dist, state)
    }

    fn arange_i64(&self, start: i64, step: i64, n: usize) -> Result<CudaStorage> {
        let rt = runtime(self.0)?;
        let out = CudaStorage::alloc_on(rt, DType::I64, n)?;
        if n > 0 {
            // `out` holds the `n` elements the kernel writes.
            launch::arange_i64(
                rt,
                &[],
                Grid::linear(rt, n, 256),
                out.dev_ptr_mut_at(0),
                start,
                step,
                n as i64,
            )?;
        }
        Ok(out)
    }
}

impl BackendStorage for CudaStorage {
    #[inline]
    fn device(&self) -> Device {
        Device::Cuda(self.buf.device)
    }

    #[inline]
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[inline]
    fn len(&self) -> usize {
        self.len
    }
}
