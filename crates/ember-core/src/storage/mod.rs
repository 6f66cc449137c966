//! [`Storage`]: the enum over backends that the op layer calls, and the one place where a call
//! meets a backend. The methods of each op family forward to that family's backend trait
//! (`backend/`, one trait per family, gathered by
//! [`BackendStorage`]; [`BackendDevice`] here) on the backend
//! of their first operand, one `forward!` per family in `families.rs`, with one
//! device-mismatch error path; everything above (`ops/`, `tensor/`, `autograd/`, `random/`)
//! calls these methods and never names a backend. Copies between backends (host ↔ GPU) are
//! the only methods that match on two different variants.
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
//!
//! Note [Swapping storages]: FSDP frees a unit's gathered parameters after its forward while
//! autograd still holds views of them, and fills them again before the unit's backward (PyTorch's
//! `untyped_storage().resize_(0)`, then `resize_(n)` and a copy, under
//! `_unsafe_preserve_version_counter`). `StorageRef::swap` does both in one move: two cells of
//! one dtype and device exchange their elements (and accounting entries) under both write
//! locks, taken in address order, without bumping either version counter, so every view of
//! each cell sees the other's elements and autograd's saved-tensor checks still pass; their
//! cast twins (Note [Cast twins]), valid by version, are dropped. Until it
//! is filled again, a cell swapped with an empty one holds fewer elements than its views
//! address: running an op on such a view is the caller's error (FSDP never does).

#![deny(unsafe_code)]

use crate::backend::{
    Arrives, BackendDevice, BackendStorage, CopyOps, Distribution, PhiloxState, RngState, Variant,
};
use crate::cpu::{CpuDevice, CpuStorage};
use crate::cuda_backend::{current_device, CudaDevice, CudaStorage, Event};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) mod graph_casts;
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
            ($($s,)+) => Err(crate::storage::mismatch($op, &[$(&*$s),+])),
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

mod families;

/// Only the CUDA backend's tensors arrive in row blocks (Note [Arrivals in row blocks] in
/// `storage/row_blocks.rs`).
impl Arrives for Storage {
    type Event = Event;
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

    /// An arriving block is a GPU's (its event is recorded before the block is handed on), so
    /// it never belongs to a CPU step: the device of its event.
    fn variant_event(event: &Event) -> std::result::Result<&Infallible, Device> {
        Err(Device::Cuda(event.device_index().unwrap_or_else(current_device)))
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

    fn variant_event(event: &Event) -> std::result::Result<&Event, Device> {
        Ok(event)
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
    /// A copy of the elements in a lower float dtype, while it is known to equal their cast
    /// (Note [Cast twins]).
    twin: Mutex<TwinSlot>,
}

/// Note [Cast twins]: under autocast a float32 tensor is often cast to bf16 right after the
/// kernel that wrote it (a LayerNorm output going into a linear, a residual gradient going into
/// a bf16 branch, a parameter after the optimizer step), and the cast reads 4 and writes 2
/// bytes an element again. Where a kernel can write the bf16 copy beside its f32 result for 2
/// bytes an element, it hands that copy to the storage as its twin, and the next `to_dtype` of
/// the whole storage to the twin's dtype takes the twin instead of casting: the same values (a
/// twin is only ever the correctly rounded cast of the elements it sits beside, rounded as the
/// cast kernel rounds) and the same autograd node. The cast takes the twin out (it becomes the
/// cast's own storage, so two casts never share one) and leaves word that a twin of that dtype
/// is wanted, which a producer that writes twins only on demand (the optimizer step) reads. A
/// twin is valid while the storage was not written since it was set (its version counter), on
/// the same device; one set apart from the kernel that wrote the elements (`bound` false, the
/// optimizer's) also dies at the next CUDA graph replay, which writes storages without counting
/// versions, and is neither set nor taken while a capture is underway (a captured step keeps
/// its casts another way: Note [Casts a captured step keeps] in `storage/graph_casts.rs`).
/// Producers: LayerNorm's
/// forward and backward (`cuda_backend/norm.rs`) and the fused Adam step
/// (`ops/fused_optim.rs`). On GPT-2's eager bf16 step (H200) the 146 casts f32 -> bf16 (0.84 ms)
/// went, for 0.1 ms more in Adam and 0.05 ms more in LayerNorm (docs/benchmarks.md, session 47).
#[derive(Debug, Default)]
struct TwinSlot {
    twin: Option<Twin>,
    /// The dtype a cast of the whole storage asked for since a twin was last set.
    wanted: Option<DType>,
}

#[derive(Debug)]
struct Twin {
    storage: StorageRef,
    dtype: DType,
    source_version: u64,
    /// The graph replay count when set, for a twin not written by the source's own kernel.
    epoch: Option<u64>,
}

/// CUDA graph replays so far (Note [Cast twins]).
static GRAPH_REPLAYS: AtomicU64 = AtomicU64::new(0);

/// Counts a CUDA graph replay: every twin set apart from its source's kernel before it dies.
/// Returns the count with this replay.
pub(crate) fn note_graph_replay() -> u64 {
    GRAPH_REPLAYS.fetch_add(1, Ordering::AcqRel) + 1
}

/// The calling thread's current streams on every device, as a value another thread can make
/// its own: the autograd engine runs a backward's nodes on the streams their forward ran on
/// (for the op layer, which names no backend).
#[derive(Debug, Clone)]
pub(crate) struct ThreadStreams(Vec<Option<crate::cuda_backend::Stream>>);

impl ThreadStreams {
    /// The calling thread's.
    pub(crate) fn current() -> ThreadStreams {
        ThreadStreams(crate::cuda_backend::current_streams())
    }

    /// Makes these the calling thread's current streams until the guard is dropped.
    #[must_use = "the streams are current only while the guard lives"]
    pub(crate) fn make_current(&self) -> impl Drop {
        crate::cuda_backend::use_streams(&self.0)
    }
}

/// Makes GPU `device` the calling thread's current device (an autograd device thread's).
pub(crate) fn set_thread_device(device: usize) -> Result<()> {
    crate::cuda_backend::set_device(device)
}

/// True while a CUDA graph capture is underway in the process (for the op layer, which names
/// no backend).
pub(crate) fn capture_underway() -> bool {
    crate::cuda_backend::capture::any_underway()
}

/// CUDA graph replays so far.
pub(crate) fn graph_replays() -> u64 {
    GRAPH_REPLAYS.load(Ordering::Acquire)
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
            twin: Mutex::default(),
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
            twin: Mutex::default(),
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
            twin: Mutex::default(),
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

    /// Exchanges the elements of this storage and `other` (Note [Swapping storages]): same
    /// dtype and device, any lengths; neither version counter is bumped.
    pub(crate) fn swap(&self, other: &StorageRef) -> Result<()> {
        const OP: &str = "swap_storage_";
        if self.same_storage(other) {
            return Ok(());
        }
        if self.is_pinned() || other.is_pinned() {
            return Err(Error::invalid(
                OP,
                "pinned host memory keeps its buffer; swap storages that are not pinned",
            ));
        }
        // Address order, so that two swaps of one pair never wait on each other.
        let (first, second) = if self.id() < other.id() {
            (self, other)
        } else {
            (other, self)
        };
        let mut a = first.0.data.write().unwrap_or_else(|e| e.into_inner());
        let mut b = second.0.data.write().unwrap_or_else(|e| e.into_inner());
        if (a.dtype(), a.device()) != (b.dtype(), b.device()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the storages hold {} on {} and {} on {}: only storages of one dtype and device swap",
                    a.dtype(),
                    a.device(),
                    b.dtype(),
                    b.device()
                ),
            ));
        }
        std::mem::swap(&mut *a, &mut *b);
        let mut ta = first.0.tracking.lock().unwrap_or_else(|e| e.into_inner());
        let mut tb = second.0.tracking.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut *ta, &mut *tb);
        // A twin is valid for its cell's elements as of a version, which a swap does not bump:
        // the elements moved, so neither cell keeps one (Note [Cast twins]).
        first.twin_slot().twin = None;
        second.twin_slot().twin = None;
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

    /// Sets `twin` (a storage of a lower float dtype on the same device, that nothing else
    /// holds, with the correctly rounded cast of every element of this one as of now) as this
    /// storage's twin (Note [Cast twins]); `bound`: written by the same kernel as these
    /// elements. Ignored while a capture is underway when not `bound`.
    pub(crate) fn set_twin(&self, twin: Storage, bound: bool) {
        let epoch = if bound {
            None
        } else if crate::cuda_backend::capture::any_underway() {
            return;
        } else {
            Some(GRAPH_REPLAYS.load(Ordering::Acquire))
        };
        let t = Twin {
            dtype: twin.dtype(),
            storage: StorageRef::new(twin),
            source_version: self.version(),
            epoch,
        };
        let mut slot = self.twin_slot();
        slot.twin = Some(t);
        slot.wanted = None;
    }

    /// Takes out the twin of `dtype` when it is valid (Note [Cast twins]), and notes that a twin
    /// of `dtype` is wanted either way; with whether the twin was written by its source's own
    /// kernel (`bound`). `for_capture`: for a capture underway to keep (Note [Casts a captured
    /// step keeps] in `storage/graph_casts.rs`), which takes a twin set apart from its source's
    /// kernel too, while no replay came since.
    pub(crate) fn take_twin(&self, dtype: DType, for_capture: bool) -> Option<(StorageRef, bool)> {
        let mut slot = self.twin_slot();
        slot.wanted = Some(dtype);
        let t = slot.twin.take()?;
        let valid = t.dtype == dtype
            && t.source_version == self.version()
            && t.storage.device() == self.device()
            && match t.epoch {
                None => true,
                Some(e) => {
                    e == GRAPH_REPLAYS.load(Ordering::Acquire)
                        && (for_capture || !crate::cuda_backend::capture::any_underway())
                }
            };
        valid.then_some((t.storage, t.epoch.is_none()))
    }

    /// The dtype of twin a cast of the whole storage asked for since a twin was last set (Note
    /// [Cast twins]).
    pub(crate) fn wanted_twin(&self) -> Option<DType> {
        self.twin_slot().wanted
    }

    fn twin_slot(&self) -> std::sync::MutexGuard<'_, TwinSlot> {
        self.0.twin.lock().unwrap_or_else(|e| e.into_inner())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    /// Note [Cast twins]: a cast of the whole storage takes a valid twin instead of casting
    /// (shown with a twin that is not the cast, so that taking it is visible), once; a write to
    /// the source, a graph replay (for a twin set apart from the kernel) or another dtype leave
    /// the cast to be computed; a cast notes the dtype wanted until a twin is set.
    #[test]
    fn a_cast_takes_a_valid_twin_once() {
        let x = Tensor::from_slice(&[1.0f32, 2.5, -3.0, 4.0], [2, 2], Device::Cpu).unwrap();
        let marked = || {
            Storage::Cpu(CpuStorage::BF16(
                [7.0f32, 8.0, 9.0, 10.0].map(half::bf16::from_f32).to_vec(),
            ))
        };
        let cast = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap();
        assert_eq!(x.storage().wanted_twin(), None);
        x.storage().set_twin(marked(), true);
        assert_eq!(cast(&x), [7.0, 8.0, 9.0, 10.0]);
        // Taken: the next cast computes, and asks for a twin again.
        assert_eq!(x.storage().wanted_twin(), Some(DType::BF16));
        assert_eq!(cast(&x), [1.0, 2.5, -3.0, 4.0]);
        // A write to the source.
        x.storage().set_twin(marked(), true);
        assert_eq!(x.storage().wanted_twin(), None);
        x.storage().bump_version();
        assert_eq!(cast(&x), [1.0, 2.5, -3.0, 4.0]);
        // Another dtype, and a view of part of the storage.
        x.storage().set_twin(marked(), true);
        assert_eq!(
            x.to_dtype(DType::F16).unwrap().to_vec_f64().unwrap(),
            [1.0, 2.5, -3.0, 4.0]
        );
        x.storage().set_twin(marked(), true);
        assert_eq!(cast(&x.narrow(0, 1, 1).unwrap()), [-3.0, 4.0]);
        assert_eq!(cast(&x), [7.0, 8.0, 9.0, 10.0]);
        // A graph replay ends a twin set apart from the source's kernel, not a bound one.
        x.storage().set_twin(marked(), false);
        note_graph_replay();
        assert_eq!(cast(&x), [1.0, 2.5, -3.0, 4.0]);
        x.storage().set_twin(marked(), true);
        note_graph_replay();
        assert_eq!(cast(&x), [7.0, 8.0, 9.0, 10.0]);
        // The twin becomes the cast's own storage: nothing else holds it.
        x.storage().set_twin(marked(), false);
        let y = x.to_dtype(DType::BF16).unwrap();
        assert!(y.storage().is_unique());
    }

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
