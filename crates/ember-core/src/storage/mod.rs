//! [`Storage`]: the enum over backends that the op layer calls, and the one place where a call
//! meets a backend. Each op family is one method here that forwards to the backend traits of
//! `backend/` (one per family, gathered by
//! [`BackendStorage`](crate::backend::BackendStorage); [`BackendDevice`]) on matching
//! variants, with one device-mismatch error path (`on_backend!`); everything above (`ops/`,
//! `tensor/`, `autograd/`, `random/`) calls these methods and never names a backend. Copies
//! between backends (host ↔ GPU) are the only methods that match on two different variants.
//!
//! Storage is shared between views through [`StorageRef`], which also carries the version
//! counter that autograd checks for in-place modification (see `autograd::SavedTensor`).
//!
//! Note [Moving a storage in place]: `Module::to_device` must leave every handle to a parameter
//! valid (an optimizer or DDP built before the move holds clones of the handles), as PyTorch's
//! `param.data = param.data.to(device)` does. A tensor's device is therefore the device of its
//! storage cell, not a field of the tensor, and `StorageRef::move_to` swaps the cell's
//! elements for a copy of all of them on the new device (the whole buffer, so the layout of
//! every view over it stays valid) under the write lock, then publishes the new device. The
//! memory accounting entry moves with it. Pinned host buffers are refused (their page-lock
//! registration belongs to the host buffer).

use crate::backend::CrossEntropyParams;
use crate::backend::{
    AdamStep, AdamTensor, AmpOps, AttentionOps, BackendDevice, BinaryOp, CmpOp, ConvOps, ConvParams, CopyOps,
    Distribution, ElementwiseOps, Elems, ForeachCopy, IndexOp, IndexOps, LogicalOp, LossOps,
    LstmBackwardStep, LstmForwardStep, MatmulOps, OptimOps, PhiloxState, PoolOps, PoolParams, RandomOps,
    ReduceOp, ReduceOps, RngState, RnnOps, ScaleUpdate, ScatterOp, SdpaGrads, SdpaParams, SgdStep, SgdTensor,
    SoftmaxOp, SoftmaxOps, StepScalars, UnaryOp, UnaryOps, UnscaleGrads, Variant,
};
use crate::backend::{LayerNormGrads, NormOps};
use crate::cpu::{CpuDevice, CpuStorage};
use crate::cuda_backend::{CudaDevice, CudaStorage};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) mod row_blocks;

/// Elements of one tensor storage on one backend.
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// Runs `$body` with each of the `Storage` operands `$s..` rebound to the backend storage inside
/// it when all are of one backend, and `$wrap` bound to that backend's `Storage` constructor;
/// otherwise returns the device-mismatch error of op `$op` (the one such error path: the op
/// layer checks devices first, so only internal callers that pass mixed storages reach it).
macro_rules! on_backend {
    ($op:expr, ($($s:ident),+), $wrap:ident => $body:expr) => {
        match ($($s,)+) {
            ($(Storage::Cpu($s),)+) => {
                #[allow(unused_variables)]
                let $wrap = Storage::Cpu;
                $body
            }
            ($(Storage::Cuda($s),)+) => {
                #[allow(unused_variables)]
                let $wrap = Storage::Cuda;
                $body
            }
            #[allow(unreachable_patterns)]
            ($($s,)+) => Err(mismatch($op, &[$(&*$s),+])),
        }
    };
}

/// Runs `$body` with `$d` bound to the backend device of `$device` and `$wrap` to its
/// backend's `Storage` constructor.
macro_rules! on_device {
    ($device:expr, $d:ident, $wrap:ident => $body:expr) => {
        match $device {
            Device::Cpu => {
                let ($d, $wrap) = (CpuDevice, Storage::Cpu);
                $body
            }
            Device::Cuda(i) => {
                let ($d, $wrap) = (CudaDevice(i), Storage::Cuda);
                $body
            }
        }
    };
}

/// Runs `$body` with `$B` the backend storage type of device `$device` (for the multi-tensor
/// steps, whose operand lists are cast to it with [`Variant`]).
macro_rules! on_backend_type {
    ($device:expr, $B:ident => $body:expr) => {
        match $device {
            Device::Cpu => {
                type $B = CpuStorage;
                $body
            }
            Device::Cuda(_) => {
                type $B = CudaStorage;
                $body
            }
        }
    };
}

impl Variant<CpuStorage> for Storage {
    fn variant(&self) -> std::result::Result<&CpuStorage, Device> {
        match self {
            Storage::Cpu(c) => Ok(c),
            other => Err(other.device()),
        }
    }

    fn variant_mut(&mut self) -> std::result::Result<&mut CpuStorage, Device> {
        match self {
            Storage::Cpu(c) => Ok(c),
            other => Err(other.device()),
        }
    }
}

impl Variant<CudaStorage> for Storage {
    fn variant(&self) -> std::result::Result<&CudaStorage, Device> {
        match self {
            Storage::Cuda(c) => Ok(c),
            other => Err(other.device()),
        }
    }

    fn variant_mut(&mut self) -> std::result::Result<&mut CudaStorage, Device> {
        match self {
            Storage::Cuda(c) => Ok(c),
            other => Err(other.device()),
        }
    }
}

/// The error of a multi-tensor step `op` on `device` given an operand on `other`.
fn list_mismatch(op: &'static str, device: Device) -> impl FnOnce(Device) -> Error {
    move |other| Error::DeviceMismatch {
        op,
        lhs: device,
        rhs: other,
    }
}

/// The error for the storages of one op on different backends, naming the first two devices
/// that differ (the one device-mismatch error of this layer).
#[cold]
#[inline(never)]
fn mismatch(op: &'static str, storages: &[&Storage]) -> Error {
    let lhs = storages[0].device();
    let rhs = storages
        .iter()
        .map(|s| s.device())
        .find(|&d| d != lhs)
        .unwrap_or(lhs);
    Error::DeviceMismatch { op, lhs, rhs }
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => s.device(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }

    /// Number of elements held.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address of element 0: a host address for CPU storage, a device address for GPU
    /// storage (`Tensor::data_ptr`; for identity checks and interop, not for dereferencing).
    pub(crate) fn address(&self) -> usize {
        match self {
            Storage::Cpu(c) => crate::cpu::with_cpu_storage!(c, v => v.as_ptr() as usize),
            Storage::Cuda(c) => c.ptr_at(0) as usize,
        }
    }
}

/// Shared handle to a storage and its version counter: all views of a tensor hold the same one.
#[derive(Debug, Clone)]
pub struct StorageRef(Arc<StorageCell>);

#[derive(Debug)]
struct StorageCell {
    /// The page-lock registration of a pinned host buffer; declared before `data` so it is
    /// undone before the buffer is freed (Note [Pinned host memory] in `cuda_backend/pinned.rs`).
    pin: Option<crate::cuda_backend::HostPin>,
    data: RwLock<Storage>,
    /// Bumped by every in-place write; autograd compares it with the version saved at record time.
    version: AtomicU64,
    /// The device `data` lives on, readable without the lock (`Tensor::device` reads it on
    /// every op); changed only by [`StorageRef::move_to`], under the write lock.
    device: AtomicUsize,
    /// The storage's entry in the memory accounting (Note [Live allocation list]); replaced
    /// when the storage moves to another device.
    tracking: Mutex<crate::memory::Tracking>,
    /// Row-block state: a block count asked for a weight's gradient, the block events of a
    /// gradient computed in blocks, copies and arrivals in row blocks in flight
    /// (`storage/row_blocks.rs`).
    row_blocks: Mutex<row_blocks::RowBlocks>,
}

/// `device` as one word: 0 for the host, `1 + ordinal` for a GPU.
fn encode_device(device: Device) -> usize {
    match device {
        Device::Cpu => 0,
        Device::Cuda(i) => i + 1,
    }
}

fn decode_device(code: usize) -> Device {
    match code {
        0 => Device::Cpu,
        i => Device::Cuda(i - 1),
    }
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        row_blocks::forget(self.row_blocks.get_mut().unwrap_or_else(|e| e.into_inner()));
        // A pinned buffer goes back to the pinned host cache, registration and all
        // (Note [Pinned host cache] in `cuda_backend/pinned.rs`).
        if let Some(pin) = self.pin.take() {
            let empty = Storage::Cpu(CpuStorage::Bool(Vec::new()));
            let data = std::mem::replace(self.data.get_mut().unwrap_or_else(|e| e.into_inner()), empty);
            match data {
                Storage::Cpu(cpu) => crate::cuda_backend::recycle_pinned(cpu, pin),
                other => {
                    drop(pin);
                    drop(other);
                }
            }
        }
    }
}

impl StorageRef {
    pub fn new(storage: Storage) -> StorageRef {
        StorageRef(Arc::new(StorageCell {
            tracking: Mutex::new(crate::memory::Tracking::new(
                storage.device(),
                storage.dtype(),
                storage.len(),
            )),
            device: AtomicUsize::new(encode_device(storage.device())),
            pin: None,
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
            row_blocks: Mutex::default(),
        }))
    }

    /// A host storage whose buffer `pin` has page-locked.
    pub(crate) fn new_pinned(storage: Storage, pin: crate::cuda_backend::HostPin) -> StorageRef {
        StorageRef(Arc::new(StorageCell {
            tracking: Mutex::new(crate::memory::Tracking::new(
                storage.device(),
                storage.dtype(),
                storage.len(),
            )),
            device: AtomicUsize::new(encode_device(storage.device())),
            pin: Some(pin),
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
            row_blocks: Mutex::default(),
        }))
    }

    /// A new storage whose entry in the memory accounting records `shape`, the shape of the
    /// first tensor made over it (a no-op for storages too small to be listed). Noted before
    /// the entry goes behind its lock, so creating a tensor takes no lock for it.
    pub(crate) fn with_shape(storage: Storage, shape: &crate::Shape) -> StorageRef {
        let tracking = crate::memory::Tracking::new(storage.device(), storage.dtype(), storage.len());
        tracking.note_shape(shape);
        StorageRef(Arc::new(StorageCell {
            tracking: Mutex::new(tracking),
            device: AtomicUsize::new(encode_device(storage.device())),
            pin: None,
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
            row_blocks: Mutex::default(),
        }))
    }

    /// The device the storage lives on.
    #[inline]
    pub fn device(&self) -> Device {
        decode_device(self.0.device.load(Ordering::Acquire))
    }

    /// Moves the whole storage to `device` in place (Note [Moving a storage in place]): every
    /// tensor and view over it sees the same elements, now on `device`, at the same offsets.
    /// The version counter is not bumped: the values did not change.
    pub(crate) fn move_to(&self, device: Device) -> Result<()> {
        if self.device() == device {
            return Ok(());
        }
        if self.is_pinned() {
            return Err(Error::invalid(
                "to_device_",
                "pinned host memory cannot be moved in place; use to(device), which copies",
            ));
        }
        self.replace_with(|data| data.to_device(&Layout::contiguous(data.len()), device))
    }

    /// Swaps the elements for `f(elements)` (same dtype and length, any device) under the
    /// write lock, then publishes the new device and accounting entry.
    fn replace_with(&self, f: impl FnOnce(&Storage) -> Result<Storage>) -> Result<()> {
        let mut data = self.0.data.write().unwrap_or_else(|e| e.into_inner());
        let new = f(&data)?;
        debug_assert!(new.dtype() == data.dtype() && new.len() == data.len());
        let tracking = crate::memory::Tracking::new(new.device(), new.dtype(), new.len());
        self.0
            .device
            .store(encode_device(new.device()), Ordering::Release);
        let old = std::mem::replace(&mut *data, new);
        let old_tracking = std::mem::replace(
            &mut *self.0.tracking.lock().unwrap_or_else(|e| e.into_inner()),
            tracking,
        );
        drop(data);
        drop((old, old_tracking));
        Ok(())
    }

    /// True for page-locked host storage.
    pub fn is_pinned(&self) -> bool {
        self.0.pin.is_some()
    }

    /// Read access. Poisoning cannot leave a storage half-written in a way readers could
    /// observe differently from a completed write, so a poisoned lock is still read.
    pub fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.data.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Write access for in-place ops; bumps the version counter.
    pub fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.0.version.fetch_add(1, Ordering::Relaxed);
        self.0.data.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn version(&self) -> u64 {
        self.0.version.load(Ordering::Relaxed)
    }

    /// Bumps the version counter without writing (for `mark_dirty`-like uses).
    pub fn bump_version(&self) {
        self.0.version.fetch_add(1, Ordering::Relaxed);
    }

    /// True when no other tensor or view holds this storage.
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }

    /// An identity of the shared storage (equal for two handles exactly when
    /// [`StorageRef::same_storage`]), for sorting and hashing.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    pub fn same_storage(&self, other: &StorageRef) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

// ---------------------------------------------------------------------------------------------
// Made from nothing on a device ([`BackendDevice`]).

impl Storage {
    /// Moves host elements onto `device`.
    pub fn from_cpu(cpu: CpuStorage, device: Device) -> Result<Storage> {
        on_device!(device, d, wrap => Ok(wrap(d.storage_from_cpu(cpu)?)))
    }

    /// `n` elements of `dtype`, all `value`, on `device`.
    pub fn full(device: Device, dtype: DType, n: usize, value: f64) -> Result<Storage> {
        on_device!(device, d, wrap => Ok(wrap(d.full(dtype, n, value)?)))
    }

    /// Room for `n` elements of `dtype` on `device` that the caller writes in full before
    /// reading them (uninitialized on a GPU, zeros on the CPU).
    pub(crate) fn alloc(device: Device, dtype: DType, n: usize) -> Result<Storage> {
        on_device!(device, d, wrap => Ok(wrap(d.alloc(dtype, n)?)))
    }

    /// `n` elements of `dtype` drawn from `dist` at `state`, row-major, on `device`.
    pub(crate) fn random(
        device: Device,
        dtype: DType,
        n: usize,
        dist: Distribution,
        state: PhiloxState,
    ) -> Result<Storage> {
        on_device!(device, d, wrap => Ok(wrap(d.random(dtype, n, dist, state)?)))
    }

    /// `n` int64 values `start, start + step, ...` made on `device` (`BackendDevice::arange_i64`).
    pub(crate) fn arange_i64(device: Device, start: i64, step: i64, n: usize) -> Result<Storage> {
        on_device!(device, d, wrap => Ok(wrap(d.arange_i64(start, step, n)?)))
    }

    /// A random permutation of `0..n` as i64 on `device`.
    pub(crate) fn randperm(device: Device, n: usize, state: RngState) -> Result<Storage> {
        // On every device the permutation is the CPU's, computed on the host and copied: a
        // sort of n random keys, rare and small beside the ops (`cuda_backend/random.rs`).
        crate::memory::check_host_alloc("randperm", n.saturating_mul(3), DType::I64)?; // (key, index) pairs, then the result
        Storage::from_cpu(crate::cpu::random::randperm(n, state), device)
    }
}

// ---------------------------------------------------------------------------------------------
// Copies, within a backend and across backends.

impl Storage {
    /// The elements of `layout` in a new row-major storage of `dtype` on the same device.
    pub fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Storage> {
        let s = self;
        on_backend!("to_dtype", (s), wrap => Ok(wrap(CopyOps::to_dtype(s, layout, dtype)?)))
    }

    /// The elements of `layout` copied to host memory, row-major.
    pub fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        let s = self;
        on_backend!("to_cpu", (s), _wrap => CopyOps::to_cpu(s, layout))
    }

    /// Writes `src` viewed through `src_layout` into `self` at `dst_layout` (same shapes),
    /// converting dtype; copies across devices when they differ.
    pub fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &Storage,
        src_layout: &Layout,
    ) -> Result<()> {
        let packed = || Layout::contiguous(src_layout.shape().clone());
        match (self, src) {
            (Storage::Cpu(d), Storage::Cpu(s)) => CopyOps::copy_strided_from(d, dst_layout, s, src_layout),
            (Storage::Cuda(d), Storage::Cuda(s)) => CopyOps::copy_strided_from(d, dst_layout, s, src_layout),
            (Storage::Cuda(d), Storage::Cpu(s)) => {
                let staged = CudaDevice(d.ordinal()).storage_from_cpu(s.contiguous(src_layout))?;
                CopyOps::copy_strided_from(d, dst_layout, &staged, &packed())
            }
            (Storage::Cpu(d), Storage::Cuda(s)) => {
                let host = CopyOps::to_cpu(s, src_layout)?;
                CopyOps::copy_strided_from(d, dst_layout, &host, &packed())
            }
        }
    }

    /// The elements of `layout` as a row-major storage on `device` (any pair of devices).
    pub fn to_device(&self, layout: &Layout, device: Device) -> Result<Storage> {
        match (self, device) {
            (Storage::Cuda(s), Device::Cuda(i)) => Ok(Storage::Cuda(s.to_device(layout, i)?)),
            (s, device) => Storage::from_cpu(s.to_cpu(layout)?, device),
        }
    }

    /// Writes a generator's `state` into this two-element I64 GPU storage (seed, then offset) on
    /// the current stream and returns the device addresses of both: the slot a captured graph's
    /// random kernels read (Note [Philox under graph capture] in `random/mod.rs`).
    pub(crate) fn write_philox_slot(&self, state: RngState) -> Result<(u64, u64)> {
        match self {
            Storage::Cuda(slot) if slot.dtype() == DType::I64 && slot.len() == 2 => {
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&state.seed.to_ne_bytes());
                bytes[8..].copy_from_slice(&state.offset.to_ne_bytes());
                slot.write_pageable(0, &bytes)?;
                Ok((slot.ptr_at(0), slot.ptr_at(1)))
            }
            _ => Err(Error::invalid(
                "Generator::begin_capture",
                "a generator's capture slot is two I64 elements in GPU memory",
            )),
        }
    }

    /// The elements of `layout` on GPU `device`, for a source that nothing reads or writes
    /// after this call (a gradient the autograd engine hands on; Note [Peer copies]): from a
    /// GPU on a side stream, and when `blocks` are given (a contiguous gradient computed in row
    /// blocks of `row_len` elements, Note [Gradients in row blocks]) block by block, each once
    /// its event has completed. From the host, an ordinary copy.
    pub(crate) fn to_device_private(
        &self,
        layout: &Layout,
        device: usize,
        blocks: Option<&[crate::cuda_backend::RowBlockEvent]>,
        row_len: usize,
    ) -> Result<Storage> {
        match (self, blocks) {
            (Storage::Cuda(s), Some(blocks)) => Ok(Storage::Cuda(
                s.to_device_private_in_blocks(layout, device, blocks, row_len)?,
            )),
            (Storage::Cuda(s), None) => Ok(Storage::Cuda(s.to_device_private(layout, device)?)),
            (s, _) => s.to_device(layout, Device::Cuda(device)),
        }
    }

    /// Marks GPU memory as used on `stream` (`Tensor.record_stream`); a no-op for host memory.
    pub(crate) fn record_stream(&self, stream: &crate::cuda_backend::Stream) -> Result<()> {
        match self {
            Storage::Cuda(s) => s.record_stream(stream),
            Storage::Cpu(_) => Ok(()),
        }
    }
}

impl StorageRef {
    /// A page-locked copy of host elements (`Tensor.pin_memory()`); needs a CUDA driver.
    pub(crate) fn pinned_copy(cpu: &CpuStorage) -> Result<StorageRef> {
        let (pinned, pin) = crate::cuda_backend::pinned_copy(cpu)?;
        // The Vec moves into the storage without reallocating, so the pinned range stays its own.
        Ok(StorageRef::new_pinned(Storage::Cpu(pinned), pin))
    }

    /// Enqueues the copy of `numel` elements of this pinned host storage, from element
    /// `offset` on, into the GPU storage `dst` from element `dst_offset` on, on the current
    /// stream, and keeps this storage alive until the copy has run (a non-blocking copy).
    pub(crate) fn copy_pinned_async(
        &self,
        offset: usize,
        numel: usize,
        dst: &Storage,
        dst_offset: usize,
    ) -> Result<()> {
        let Storage::Cuda(dst) = dst else {
            return Err(Error::invalid(
                "copy",
                "a non-blocking copy from pinned memory goes to a GPU",
            ));
        };
        {
            let guard = self.read();
            let Storage::Cpu(cpu) = &*guard else {
                return Err(Error::invalid(
                    "copy",
                    "a non-blocking copy to a GPU reads pinned host memory",
                ));
            };
            let size = cpu.dtype().size_in_bytes();
            let bytes = &crate::cuda_backend::host_bytes(cpu)[offset * size..(offset + numel) * size];
            dst.copy_from_host_async(dst_offset, bytes)?;
        }
        let stream = crate::cuda_backend::current_stream(dst.ordinal())?;
        crate::cuda_backend::keep_alive_until_done(&stream, self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// The op families ([`BackendStorage`]); arguments as in the trait.

impl Storage {
    pub(crate) fn binary(&self, op: BinaryOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Result<Storage> {
        let (a, b) = (self, rhs);
        on_backend!(op.name(), (a, b), wrap => Ok(wrap(ElementwiseOps::binary(a, op, al, b, bl)?)))
    }

    /// `self op rhs` written into `out` at `ol` (see [`ElementwiseOps::binary_into`]).
    pub(crate) fn binary_into(
        &self,
        op: BinaryOp,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
        out: &mut Storage,
        ol: &Layout,
    ) -> Result<()> {
        let (a, b, o) = (self, rhs, out);
        on_backend!(op.name(), (a, b, o), _wrap => ElementwiseOps::binary_into(a, op, al, b, bl, o, ol))
    }

    /// `self op rhs` over `self`'s elements at `al` (see [`ElementwiseOps::binary_inplace`]).
    pub(crate) fn binary_inplace(
        &mut self,
        op: BinaryOp,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
    ) -> Result<()> {
        let (a, b) = (self, rhs);
        on_backend!(op.name(), (a, b), _wrap => ElementwiseOps::binary_inplace(a, op, al, b, bl))
    }

    pub(crate) fn compare(&self, op: CmpOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Result<Storage> {
        let (a, b) = (self, rhs);
        on_backend!(op.name(), (a, b), wrap => Ok(wrap(ElementwiseOps::compare(a, op, al, b, bl)?)))
    }

    pub(crate) fn logical(&self, op: LogicalOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Result<Storage> {
        let (a, b) = (self, rhs);
        on_backend!(op.name(), (a, b), wrap => Ok(wrap(ElementwiseOps::logical(a, op, al, b, bl)?)))
    }

    pub(crate) fn where_cond(
        &self,
        cl: &Layout,
        a: &Storage,
        al: &Layout,
        b: &Storage,
        bl: &Layout,
    ) -> Result<Storage> {
        let c = self;
        on_backend!("where", (c, a, b), wrap => Ok(wrap(ElementwiseOps::where_cond(c, cl, a, al, b, bl)?)))
    }

    /// `op` applied to the elements of `layout`, in a new row-major storage of
    /// `op.result_dtype(self.dtype())`.
    pub(crate) fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<Storage> {
        let s = self;
        on_backend!(op.name(), (s), wrap => Ok(wrap(UnaryOps::unary(s, op, layout)?)))
    }

    /// `op` over `dims` (sorted, unique) of `layout`, as a row-major storage of the kept dims.
    pub(crate) fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Storage> {
        let s = self;
        on_backend!(op.name(), (s), wrap => Ok(wrap(ReduceOps::reduce(s, layout, op, dims)?)))
    }

    /// Max or min over `dims` and the i64 index of its first occurrence.
    pub(crate) fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(Storage, Storage)> {
        let s = self;
        on_backend!(op.name(), (s), wrap => {
            let (v, i) = ReduceOps::reduce_with_indices(s, layout, op, dims)?;
            Ok((wrap(v), wrap(i)))
        })
    }

    /// The batched product of `[B.., m, k]` (`al`) and `[B.., k, n]` (`bl`), two layouts with
    /// the same batch dims, as a new row-major storage of shape `[B.., m, n]`.
    pub(crate) fn matmul(&self, al: &Layout, rhs: &Storage, bl: &Layout) -> Result<Storage> {
        let (a, b) = (self, rhs);
        on_backend!("matmul", (a, b), wrap => Ok(wrap(MatmulOps::matmul(a, al, b, bl)?)))
    }

    /// [`MatmulOps::matmul_widened`]: a half product written in float32, where the backend can.
    pub(crate) fn matmul_widened(&self, al: &Layout, rhs: &Storage, bl: &Layout) -> Result<Option<Storage>> {
        let (a, b) = (self, rhs);
        on_backend!("matmul", (a, b), wrap => Ok(MatmulOps::matmul_widened(a, al, b, bl)?.map(wrap)))
    }

    /// [`MatmulOps::matmul_dgelu`].
    pub(crate) fn matmul_dgelu(
        &self,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
        (aux, xl): (&Storage, &Layout),
    ) -> Result<Option<Storage>> {
        let (a, b, x) = (self, rhs, aux);
        on_backend!("matmul", (a, b, x), wrap => {
            Ok(MatmulOps::matmul_dgelu(a, al, b, bl, (x, xl))?.map(wrap))
        })
    }

    /// [`Storage::matmul`] of two matrices in row blocks of the output, with the events that
    /// mark each block done (GPU only; Note [Gradients in row blocks] in `storage/row_blocks.rs`).
    pub(crate) fn matmul_row_blocks(
        &self,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
        blocks: usize,
    ) -> Result<(Storage, Vec<crate::cuda_backend::RowBlockEvent>)> {
        match (self, rhs) {
            (Storage::Cuda(a), Storage::Cuda(b)) => {
                let (out, events) = a.matmul_row_blocks(al, b, bl, blocks)?;
                Ok((Storage::Cuda(out), events))
            }
            _ => Ok((self.matmul(al, rhs, bl)?, Vec::new())),
        }
    }

    /// [`Storage::matmul`] plus `bias` (`[n]` at `bias_l`) added to every row, in the product's
    /// accumulator, before the one rounding to the output dtype (floats only).
    pub(crate) fn matmul_bias(
        &self,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
        bias: &Storage,
        bias_l: &Layout,
    ) -> Result<Storage> {
        let (a, b, c) = (self, rhs, bias);
        on_backend!("linear", (a, b, c), wrap => Ok(wrap(MatmulOps::matmul_bias(a, al, b, bl, c, bias_l)?)))
    }

    /// [`Storage::matmul_bias`] of a `linear` whose weight rows are still arriving on a GPU,
    /// block by block at `arrivals` (Note [Copies in row blocks] in `storage/row_blocks.rs`).
    pub(crate) fn matmul_bias_in_column_blocks(
        &self,
        al: &Layout,
        (rhs, bl): (&Storage, &Layout),
        (bias, bias_l): (&Storage, &Layout),
        arrivals: &[crate::cuda_backend::RowBlockEvent],
    ) -> Result<Storage> {
        match (self, rhs, bias) {
            (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) => Ok(Storage::Cuda(
                a.matmul_bias_in_column_blocks(al, (b, bl), (c, bias_l), arrivals)?,
            )),
            _ => self.matmul_bias(al, rhs, bl, bias, bias_l),
        }
    }

    /// `self` (at `layout`) read at `index` along `dim`, as a new row-major storage; `op`
    /// (`name` in errors) says how the index maps to positions.
    pub(crate) fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &Storage,
        il: &Layout,
    ) -> Result<Storage> {
        let (s, i) = (self, index);
        on_backend!(name, (s, i), wrap => Ok(wrap(IndexOps::index_read(s, op, name, layout, dim, i, il)?)))
    }

    /// A row-major copy of `self` (at `layout`) with `src` (at `sl`) written at `index` along
    /// `dim` as `op` says.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &Storage,
        il: &Layout,
        src: &Storage,
        sl: &Layout,
    ) -> Result<Storage> {
        let (s, i, x) = (self, index, src);
        on_backend!(op.name(), (s, i, x), wrap => {
            Ok(wrap(IndexOps::index_write(s, op, layout, dim, i, il, x, sl)?))
        })
    }

    /// int64 one-hot rows of the class indices at `layout`, and the number of classes used
    /// (`num_classes`, or max + 1 when `None`).
    pub(crate) fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(Storage, usize)> {
        let s = self;
        on_backend!("one_hot", (s), wrap => {
            let (out, n) = IndexOps::one_hot(s, layout, num_classes)?;
            Ok((wrap(out), n))
        })
    }

    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at the
    /// class indices `target` (`LossOps::nll_loss_forward`).
    pub(crate) fn nll_loss_forward(
        &self,
        target: &Storage,
        weight: Option<&Storage>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(Storage, Storage)> {
        let (x, t) = (self, target);
        match weight {
            None => on_backend!("nll_loss", (x, t), wrap => {
                let (l, tw) = LossOps::nll_loss_forward(x, t, None, mc, ignore_index, mean)?;
                Ok((wrap(l), wrap(tw)))
            }),
            Some(w) => on_backend!("nll_loss", (x, t, w), wrap => {
                let (l, tw) = LossOps::nll_loss_forward(x, t, Some(w), mc, ignore_index, mean)?;
                Ok((wrap(l), wrap(tw)))
            }),
        }
    }

    /// The `[m, c]` gradient of that loss for its gradient `self` (one element).
    pub(crate) fn nll_loss_backward(
        &self,
        target: &Storage,
        weight: Option<&Storage>,
        total_weight: &Storage,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<Storage> {
        let (g, t, tw) = (self, target, total_weight);
        match weight {
            None => on_backend!("nll_loss_backward", (g, t, tw), wrap => {
                Ok(wrap(LossOps::nll_loss_backward(g, t, None, tw, mc, ignore_index, mean)?))
            }),
            Some(w) => on_backend!("nll_loss_backward", (g, t, tw, w), wrap => {
                Ok(wrap(LossOps::nll_loss_backward(g, t, Some(w), tw, mc, ignore_index, mean)?))
            }),
        }
    }

    /// Fused attention of the query `self` over `key` and `value` (`AttentionOps::sdpa_forward`):
    /// the output and the row log-sum-exp, or `None` where the backend does not run `p`.
    pub(crate) fn sdpa_forward(
        &self,
        key: &Storage,
        value: &Storage,
        p: &SdpaParams,
    ) -> Result<Option<(Storage, Storage)>> {
        let (q, k, v) = (self, key, value);
        on_backend!("_scaled_dot_product_cudnn_attention", (q, k, v), wrap => {
            Ok(AttentionOps::sdpa_forward(q, k, v, p)?.map(|(o, l)| (wrap(o), wrap(l))))
        })
    }

    /// The query, key and value gradients of fused attention (`AttentionOps::sdpa_backward`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sdpa_backward(
        &self,
        key: &Storage,
        value: &Storage,
        out: &Storage,
        lse: &Storage,
        grad_out: &Storage,
        p: &SdpaParams,
    ) -> Result<Option<SdpaGrads<Storage>>> {
        let (q, k, v, o, l, g) = (self, key, value, out, lse, grad_out);
        on_backend!("_scaled_dot_product_cudnn_attention_backward", (q, k, v, o, l, g), wrap => {
            Ok(AttentionOps::sdpa_backward(q, k, v, o, l, g, p)?.map(|grads| grads.map(wrap)))
        })
    }

    /// `op` along `dim` of `layout`, as a row-major storage of the same shape.
    pub(crate) fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<Storage> {
        let s = self;
        on_backend!(op.name(), (s), wrap => Ok(wrap(SoftmaxOps::softmax(s, layout, op, dim)?)))
    }

    /// The input gradient of `op` along `dim` from its output (`self`) and output gradient.
    pub(crate) fn softmax_backward(
        &self,
        yl: &Layout,
        grad: &Storage,
        gl: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<Storage> {
        let (y, g) = (self, grad);
        on_backend!(op.name(), (y, g), wrap => {
            Ok(wrap(SoftmaxOps::softmax_backward(y, yl, g, gl, op, dim)?))
        })
    }

    /// Bernoulli draws with the probabilities of `layout` (row-major order), in the same dtype;
    /// fails when a probability is outside [0, 1].
    pub(crate) fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<Storage> {
        let s = self;
        on_backend!("bernoulli", (s), wrap => Ok(wrap(RandomOps::bernoulli(s, layout, state)?)))
    }

    /// The convolution of the input `self` with `weight` (both contiguous from their first
    /// element), or `None` where the backend does not run the problem.
    pub(crate) fn conv_forward(&self, weight: &Storage, p: &ConvParams) -> Result<Option<Storage>> {
        let (x, w) = (self, weight);
        on_backend!("convolution", (x, w), wrap => Ok(ConvOps::conv_forward(x, w, p)?.map(wrap)))
    }

    /// The input gradient of a convolution from its weight (`self`) and output gradient.
    pub(crate) fn conv_backward_data(&self, grad_out: &Storage, p: &ConvParams) -> Result<Option<Storage>> {
        let (w, g) = (self, grad_out);
        on_backend!("convolution_backward", (w, g), wrap => {
            Ok(ConvOps::conv_backward_data(w, g, p)?.map(wrap))
        })
    }

    /// The weight gradient of a convolution from its input (`self`) and output gradient.
    pub(crate) fn conv_backward_filter(&self, grad_out: &Storage, p: &ConvParams) -> Result<Option<Storage>> {
        let (x, g) = (self, grad_out);
        on_backend!("convolution_backward", (x, g), wrap => {
            Ok(ConvOps::conv_backward_filter(x, g, p)?.map(wrap))
        })
    }

    /// Adds the `[O]` `bias` to the fresh convolution output `self` in place; false where the
    /// backend leaves it to the broadcast addition.
    pub(crate) fn conv_bias_add(&self, bias: &Storage, p: &ConvParams) -> Result<bool> {
        let (y, b) = (self, bias);
        on_backend!("convolution", (y, b), wrap => ConvOps::conv_bias_add(y, b, p))
    }

    /// ReLU's input gradient from its output `self` and the output gradient (contiguous
    /// `len`-element storages), or `None` where the backend leaves it to the tensor ops.
    pub(crate) fn relu_backward(&self, grad_out: &Storage, len: usize) -> Result<Option<Storage>> {
        let (y, g) = (self, grad_out);
        on_backend!("relu_backward", (y, g), wrap => Ok(UnaryOps::relu_backward(y, g, len)?.map(wrap)))
    }

    /// Pooling of the input `self` (contiguous from its first element), or `None` where the
    /// backend does not run the problem.
    pub(crate) fn pool_forward(&self, p: &PoolParams) -> Result<Option<Storage>> {
        let x = self;
        on_backend!("pool2d", (x), wrap => Ok(PoolOps::pool_forward(x, p)?.map(wrap)))
    }

    /// The input gradient of pooling from its input (`self`), output and output gradient.
    pub(crate) fn pool_backward(
        &self,
        output: &Storage,
        grad_out: &Storage,
        p: &PoolParams,
    ) -> Result<Option<Storage>> {
        let (x, y, g) = (self, output, grad_out);
        on_backend!("pool2d_backward", (x, y, g), wrap => {
            Ok(PoolOps::pool_backward(x, y, g, p)?.map(wrap))
        })
    }

    /// One forward step of the fused LSTM recurrence (see [`LstmForwardStep`]); the offsets are
    /// checked against the storages here, before any kernel reads them.
    pub(crate) fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &Storage,
        hh: &Storage,
        h: &mut Storage,
        c: &mut Storage,
        gates: &mut Storage,
    ) -> Result<()> {
        s.check(gi.len(), hh.len(), h.len(), c.len(), gates.len())?;
        on_backend!("lstm_recurrence", (gi, hh, h, c, gates), _wrap => {
            RnnOps::lstm_forward_step(s, gi, hh, h, c, gates)
        })
    }

    /// One backward step of the fused LSTM recurrence (see [`LstmBackwardStep`]).
    pub(crate) fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &Storage,
        dh_rec: Option<&Storage>,
        gates: &Storage,
        c: &Storage,
        dc: &mut Storage,
        dgates: &mut Storage,
    ) -> Result<()> {
        s.check(
            dh_out.len(),
            dh_rec.map(Storage::len),
            gates.len(),
            c.len(),
            dc.len(),
            dgates.len(),
        )?;
        const OP: &str = "lstm_recurrence_backward";
        match dh_rec {
            None => on_backend!(OP, (dh_out, gates, c, dc, dgates), _wrap => {
                RnnOps::lstm_backward_step(s, dh_out, None, gates, c, dc, dgates)
            }),
            Some(r) => on_backend!(OP, (dh_out, r, gates, c, dc, dgates), _wrap => {
                RnnOps::lstm_backward_step(s, dh_out, Some(r), gates, c, dc, dgates)
            }),
        }
    }
}

// Multi-tensor steps: the operand lists are cast to the backend of their first storage (an
// operand on another backend is the device-mismatch error) and checked against their
// description (`backend/step.rs`) before a kernel sees them.
impl Storage {
    /// One fused Adam step (see [`AdamTensor`]); the device is that of the first parameter.
    pub(crate) fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, Storage>>,
        amp: StepScalars<'_, Storage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let device = first.param.storage.device();
        on_backend_type!(device, B => {
            let tensors: Vec<AdamTensor<'_, B>> = tensors
                .into_iter()
                .map(AdamTensor::cast)
                .collect::<std::result::Result<_, _>>()
                .map_err(list_mismatch("adam_", device))?;
            let amp = amp.cast::<B>().map_err(list_mismatch("adam_", device))?;
            step.check(&tensors, &amp)?;
            <B as OptimOps>::adam_step(step, tensors, amp)
        })
    }

    /// One fused SGD step (see [`SgdTensor`]); the device is that of the first parameter.
    pub(crate) fn sgd_step(
        step: &SgdStep,
        tensors: Vec<SgdTensor<'_, Storage>>,
        amp: StepScalars<'_, Storage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let device = first.param.storage.device();
        on_backend_type!(device, B => {
            let tensors: Vec<SgdTensor<'_, B>> = tensors
                .into_iter()
                .map(SgdTensor::cast)
                .collect::<std::result::Result<_, _>>()
                .map_err(list_mismatch("sgd_", device))?;
            let amp = amp.cast::<B>().map_err(list_mismatch("sgd_", device))?;
            step.check(&tensors, &amp)?;
            <B as OptimOps>::sgd_step(step, tensors, amp)
        })
    }

    /// GradScaler's inf check and unscale (see [`UnscaleGrads`]) on the device of `found_inf`.
    pub(crate) fn non_finite_check_and_unscale(
        grads: UnscaleGrads<'_, Storage>,
        found_inf: Elems<&mut Storage>,
        inv_scale: Elems<&Storage>,
    ) -> Result<()> {
        const OP: &str = "non_finite_check_and_unscale_";
        let device = found_inf.storage.device();
        on_backend_type!(device, B => {
            let grads = grads.cast::<B>().map_err(list_mismatch(OP, device))?;
            let found_inf = found_inf.cast::<B>().map_err(list_mismatch(OP, device))?;
            let inv_scale = inv_scale.cast::<B>().map_err(list_mismatch(OP, device))?;
            grads.check(&found_inf, &inv_scale)?;
            <B as AmpOps>::non_finite_check_and_unscale(grads, found_inf, inv_scale)
        })
    }

    /// `_foreach_copy_`'s plain list (see [`ForeachCopy`]) on the device of its first written
    /// storage.
    pub(crate) fn foreach_copy(list: ForeachCopy<'_, Storage>) -> Result<()> {
        const OP: &str = "_foreach_copy_";
        let Some(device) = list.written.first().map(|s| s.device()) else {
            return Ok(());
        };
        on_backend_type!(device, B => {
            let list = list.cast::<B>().map_err(list_mismatch(OP, device))?;
            list.check()?;
            <B as CopyOps>::foreach_copy(list)
        })
    }

    /// GradScaler's scale update (see [`ScaleUpdate`]) on the device of `scale`.
    pub(crate) fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut Storage>,
        growth_tracker: Elems<&mut Storage>,
        found_inf: Elems<&Storage>,
    ) -> Result<()> {
        const OP: &str = "update_scale_";
        let device = scale.storage.device();
        on_backend_type!(device, B => {
            let scale = scale.cast::<B>().map_err(list_mismatch(OP, device))?;
            let growth_tracker = growth_tracker.cast::<B>().map_err(list_mismatch(OP, device))?;
            let found_inf = found_inf.cast::<B>().map_err(list_mismatch(OP, device))?;
            u.check(&scale, &growth_tracker, &found_inf)?;
            <B as AmpOps>::update_scale(u, scale, growth_tracker, found_inf)
        })
    }
}

/// A storage operand of `op` as backend `B`'s, or the device-mismatch error against `first`.
fn as_backend<'a, B>(op: &'static str, first: &Storage, s: &'a Storage) -> Result<&'a B>
where
    Storage: Variant<B>,
{
    s.variant().map_err(|_| mismatch(op, &[first, s]))
}

/// An optional operand with its layout, as backend `B`'s.
fn opt_backend<'a, B>(
    op: &'static str,
    first: &Storage,
    p: Option<(&'a Storage, &'a Layout)>,
) -> Result<Option<(&'a B, &'a Layout)>>
where
    Storage: Variant<B>,
{
    p.map(|(s, l)| Ok((as_backend(op, first, s)?, l))).transpose()
}

/// The fused normalizations (`NormOps`): operands with optional parameters, so each is matched
/// to the first operand's backend one by one.
impl Storage {
    /// Layer normalization of the rows of `n` elements of `self` (contiguous at `layout`): the
    /// output, each row's mean and each row's `1/√(var + eps)` ([`NormOps::layer_norm`]).
    pub(crate) fn layer_norm(
        &self,
        layout: &Layout,
        weight: Option<(&Storage, &Layout)>,
        bias: Option<(&Storage, &Layout)>,
        n: usize,
        eps: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        fn run<B: NormOps>(
            x: &Storage,
            l: &Layout,
            weight: Option<(&Storage, &Layout)>,
            bias: Option<(&Storage, &Layout)>,
            n: usize,
            eps: f64,
            wrap: fn(B) -> Storage,
        ) -> Result<(Storage, Storage, Storage)>
        where
            Storage: Variant<B>,
        {
            const OP: &str = "layer_norm";
            let xs: &B = as_backend(OP, x, x)?;
            let (w, b) = (opt_backend(OP, x, weight)?, opt_backend(OP, x, bias)?);
            let (y, m, r) = xs.layer_norm(l, w, b, n, eps)?;
            Ok((wrap(y), wrap(m), wrap(r)))
        }
        match self {
            Storage::Cpu(_) => run::<CpuStorage>(self, layout, weight, bias, n, eps, Storage::Cpu),
            Storage::Cuda(_) => run::<CudaStorage>(self, layout, weight, bias, n, eps, Storage::Cuda),
        }
    }

    /// The gradients of [`Storage::layer_norm`] from the output gradient `self`
    /// ([`NormOps::layer_norm_backward`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_backward(
        &self,
        layout: &Layout,
        x: (&Storage, &Layout),
        mean: &Storage,
        rstd: &Storage,
        weight: Option<(&Storage, &Layout)>,
        n: usize,
        want: LayerNormGrads,
        dx_into: Option<&mut Storage>,
    ) -> Result<[Option<Storage>; 3]> {
        #[allow(clippy::too_many_arguments)]
        fn run<B: NormOps>(
            g: &Storage,
            l: &Layout,
            x: (&Storage, &Layout),
            mean: &Storage,
            rstd: &Storage,
            weight: Option<(&Storage, &Layout)>,
            n: usize,
            want: LayerNormGrads,
            dx_into: Option<&mut Storage>,
            wrap: fn(B) -> Storage,
        ) -> Result<[Option<Storage>; 3]>
        where
            Storage: Variant<B>,
        {
            const OP: &str = "layer_norm_backward";
            let gs: &B = as_backend(OP, g, g)?;
            let xs = (as_backend(OP, g, x.0)?, x.1);
            let (m, r) = (as_backend(OP, g, mean)?, as_backend(OP, g, rstd)?);
            let w = opt_backend(OP, g, weight)?;
            let into = match dx_into {
                Some(d) => Some(
                    d.variant_mut()
                        .map_err(|_| Error::invalid(OP, "the gradient to add dx to is on another backend"))?,
                ),
                None => None,
            };
            let grads = gs.layer_norm_backward(l, xs, m, r, w, n, want, into)?;
            Ok(grads.map(|t| t.map(wrap)))
        }
        match self {
            Storage::Cpu(_) => run::<CpuStorage>(
                self,
                layout,
                x,
                mean,
                rstd,
                weight,
                n,
                want,
                dx_into,
                Storage::Cpu,
            ),
            Storage::Cuda(_) => run::<CudaStorage>(
                self,
                layout,
                x,
                mean,
                rstd,
                weight,
                n,
                want,
                dx_into,
                Storage::Cuda,
            ),
        }
    }
}

/// The fused classifier and the deterministic embedding backward (issue 37): forwarding to
/// `LossOps` and `IndexOps`.
impl Storage {
    /// `(loss, lse, total)` of the contiguous `[n, c]` logits `self` at `target`
    /// (`LossOps::cross_entropy_forward`).
    pub(crate) fn cross_entropy_forward(
        &self,
        target: &Storage,
        weight: Option<&Storage>,
        p: &CrossEntropyParams,
    ) -> Result<(Storage, Storage, Storage)> {
        let (x, t) = (self, target);
        match weight {
            None => on_backend!("cross_entropy", (x, t), wrap => {
                let (l, lse, tw) = LossOps::cross_entropy_forward(x, t, None, p)?;
                Ok((wrap(l), wrap(lse), wrap(tw)))
            }),
            Some(w) => on_backend!("cross_entropy", (x, t, w), wrap => {
                let (l, lse, tw) = LossOps::cross_entropy_forward(x, t, Some(w), p)?;
                Ok((wrap(l), wrap(lse), wrap(tw)))
            }),
        }
    }

    /// The `[n, c]` gradient of that loss (`LossOps::cross_entropy_backward`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_backward(
        &self,
        target: &Storage,
        weight: Option<&Storage>,
        lse: &Storage,
        total: &Storage,
        grad: &Storage,
        p: &CrossEntropyParams,
    ) -> Result<Storage> {
        let (x, t, l, tw, g) = (self, target, lse, total, grad);
        match weight {
            None => on_backend!("cross_entropy_backward", (x, t, l, tw, g), wrap => {
                Ok(wrap(LossOps::cross_entropy_backward(x, t, None, l, tw, g, p)?))
            }),
            Some(w) => on_backend!("cross_entropy_backward", (x, t, l, tw, g, w), wrap => {
                Ok(wrap(LossOps::cross_entropy_backward(x, t, Some(w), l, tw, g, p)?))
            }),
        }
    }

    /// The `[rows, d]` gradient of a table read at the contiguous `[n]` `index` along dim 0,
    /// from the contiguous `[n, d]` gradient `self` (`IndexOps::embedding_backward`).
    pub(crate) fn embedding_backward(
        &self,
        index: &Storage,
        n: usize,
        d: usize,
        rows: usize,
        into: Option<&mut Storage>,
    ) -> Result<Option<Storage>> {
        let (g, i) = (self, index);
        match into {
            None => on_backend!("embedding_backward", (g, i), wrap => {
                Ok(IndexOps::embedding_backward(g, i, n, d, rows, None)?.map(wrap))
            }),
            Some(acc) => on_backend!("embedding_backward", (g, i, acc), wrap => {
                Ok(IndexOps::embedding_backward(g, i, n, d, rows, Some(acc))?.map(wrap))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    /// The swap behind an in-place device move (Note [Moving a storage in place]), exercised
    /// host to host: every handle and view over the storage sees the new buffer.
    #[test]
    fn replacing_the_elements_is_seen_by_every_handle_and_view() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], Device::Cpu).unwrap();
        let clone = t.clone();
        let row = t.narrow(0, 1, 1).unwrap();
        let address = t.data_ptr();
        let version = t.version();
        t.storage()
            .replace_with(|_| Ok(Storage::Cpu(CpuStorage::F32(vec![5.0, 6.0, 7.0, 8.0]))))
            .unwrap();
        assert_ne!(clone.data_ptr(), address, "a new buffer");
        assert_eq!(clone.to_vec::<f32>().unwrap(), [5.0, 6.0, 7.0, 8.0]);
        assert_eq!(row.to_vec::<f32>().unwrap(), [7.0, 8.0]);
        assert_eq!(row.device(), Device::Cpu);
        assert_eq!(t.version(), version, "a move is not a write");
        // Moving to the device it is on changes nothing.
        t.to_device_(Device::Cpu).unwrap();
        assert_eq!(t.data_ptr(), clone.data_ptr());
    }

    #[test]
    fn device_codes_round_trip() {
        for d in [Device::Cpu, Device::Cuda(0), Device::Cuda(7)] {
            assert_eq!(decode_device(encode_device(d)), d);
        }
    }
}
