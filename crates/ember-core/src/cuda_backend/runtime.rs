//! One [`DeviceRuntime`] per GPU, created on first use and kept for the process: the device's
//! primary context, its caching allocator, and the kernels loaded on it.
//!
//! Note [Context binding]: the driver needs the device's context current on the calling
//! thread. Every entry point calls [`DeviceRuntime::bind`], which remembers per thread which
//! context it made current, so the common case (one device, one thread) costs a thread-local
//! read, not a driver call.
//!
//! Note [Loading kernel units]: a kernel's first launch on a device loads its compile unit
//! (Note [Kernel units] in `kernel_units.rs`) as a CUmodule of its own: the unit's cubin comes
//! from the process-wide table (`cubins.rs`), else the disk cache, else NVRTC on the calling
//! thread, and the launch waits only for that unit. A unit missing from the disk cache (a first
//! run, a new GPU generation, a new ember) also queues the units a program in that dtype most
//! likely needs next (`kernel_units::likely_units`) for background threads, one per core but
//! one, so a training step's dozens of units compile in parallel while the program runs instead
//! of one after the other. History: loading each whole `.cu` file on first use took 126 s for
//! the first CNN epoch of `ember train` on a fresh H100 (the sum of the compile times); all
//! files at once, 44-57 s before the first op (the slowest file).

use super::allocator::{CachingAllocator, CaptureId, Driver, EventId, StreamId};
use super::cubins;
use super::device_errors::DeviceErrors;
use super::kernel_units::Unit;
use super::kernels::{Function, KernelKey};
use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The per-device state of the CUDA backend.
pub(crate) struct DeviceRuntime {
    pub ordinal: usize,
    ctx: Context,
    /// `sm_XY` of the device, what kernels are compiled for.
    pub arch: String,
    pub sm_count: u32,
    pub allocator: CachingAllocator<DeviceMemory>,
    /// Where kernels record the errors they find (Note [Deferred device errors] in
    /// `device_errors.rs`); allocated with the runtime, so never during a graph capture.
    pub errors: DeviceErrors,
    /// Looked up on every launch: keyed with foldhash, not SipHash (host cost per op).
    functions: Mutex<HashMap<KernelKey, Function, foldhash::fast::FixedState>>,
    /// The compile units loaded on this device (Note [Loading kernel units]); consulted on a
    /// kernel's first launch only.
    units: Mutex<HashMap<Unit, Arc<OnceLock<std::result::Result<Module_, Error>>>>>,
}

#[derive(Clone, Copy)]
struct Context(sys::CUcontext);
// SAFETY: a primary context handle may be made current on any thread; it is retained for the
// life of the process and never destroyed.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

#[derive(Clone, Copy, Debug)]
#[allow(non_camel_case_types)]
struct Module_(sys::CUmodule);
// SAFETY: a loaded module is immutable and never unloaded; looking up its functions is
// thread-safe in the driver.
unsafe impl Send for Module_ {}
unsafe impl Sync for Module_ {}

thread_local! {
    static BOUND: Cell<usize> = const { Cell::new(0) };
}

fn driver_error(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// One slot per device, filled on its first use.
static RUNTIMES: OnceLock<Vec<OnceLock<std::result::Result<&'static DeviceRuntime, Error>>>> =
    OnceLock::new();

/// The devices' runtimes created so far.
pub(crate) fn initialized() -> impl Iterator<Item = &'static DeviceRuntime> {
    RUNTIMES
        .get()
        .into_iter()
        .flatten()
        .filter_map(|slot| slot.get()?.as_ref().ok().copied())
}

/// The runtime of device `ordinal`, created on first use; a typed error without CUDA or when
/// the ordinal is out of range.
pub(crate) fn runtime(ordinal: usize) -> Result<&'static DeviceRuntime> {
    let count = super::device_count();
    if count == 0 {
        // Goes through the same probe as `is_available` for the reason.
        super::get_device_name(ordinal)?;
    }
    let slots = RUNTIMES.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
    let slot = slots.get(ordinal).ok_or_else(|| {
        Error::invalid(
            "cuda device",
            format!("device ordinal {ordinal} is out of range: {count} CUDA device(s) present"),
        )
    })?;
    let rt = slot.get_or_init(|| {
        DeviceRuntime::create(ordinal).map(|rt| {
            let rt: &'static DeviceRuntime = Box::leak(Box::new(rt));
            rt
        })
    });
    let rt = rt.as_ref().map_err(Clone::clone)?;
    rt.bind()?;
    Ok(rt)
}

impl DeviceRuntime {
    fn create(ordinal: usize) -> Result<DeviceRuntime> {
        let (major, minor) = super::get_device_capability(ordinal)?;
        let sm_count = super::get_device_properties(ordinal)?.multi_processor_count;
        let dev = result::device::get(ordinal as i32).map_err(driver_error("cuDeviceGet"))?;
        // SAFETY: `dev` is a valid device after cuInit; the retained context is never released.
        let ctx =
            unsafe { result::primary_ctx::retain(dev) }.map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(driver_error("cuCtxSetCurrent"))?;
        BOUND.with(|b| b.set(ctx as usize));
        let errors = DeviceErrors::new()?;
        Ok(DeviceRuntime {
            ordinal,
            ctx: Context(ctx),
            arch: format!("sm_{major}{minor}"),
            sm_count,
            allocator: CachingAllocator::new(DeviceMemory { ctx: Context(ctx) }),
            errors,
            functions: Mutex::new(HashMap::with_hasher(foldhash::fast::FixedState::default())),
            units: Mutex::new(HashMap::default()),
        })
    }

    /// Makes this device's context current on the calling thread (Note [Context binding]).
    #[inline]
    pub fn bind(&self) -> Result<()> {
        bind_context(self.ctx)
    }

    /// The raw primary context of the device.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx.0
    }

    /// The kernel `key`, compiling (or reading from the disk cache) and loading its unit on
    /// first use (Note [Loading kernel units]).
    pub fn function(&self, key: KernelKey) -> Result<Function> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(*f);
        }
        let unit = Unit::of(&key);
        // No CUPTI start or stop while a unit loads (Note [CUPTI beside other threads' CUDA
        // work] in `cupti.rs`).
        let _gate = super::cupti::gate_share();
        let module = self.unit(&unit, key)?;
        let symbol = key.symbol();
        let name = std::ffi::CString::new(symbol.clone()).expect("kernel names have no NUL");
        // SAFETY: `module` is a loaded module of this context, which `unit()` made current.
        let f = unsafe { result::module::get_function(module.0, name) }.map_err(|e| Error::Cuda {
            op: "kernel lookup",
            msg: format!(
                "kernel {symbol} not found in unit {} of {}.cu (is it instantiated there?): {e:?}",
                unit.name,
                key.module.name()
            ),
        })?;
        let f = Function(f);
        self.functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, f);
        Ok(f)
    }

    /// `unit` loaded on this device, compiled or read from the disk cache first if needed.
    fn unit(&self, unit: &Unit, key: KernelKey) -> Result<Module_> {
        let slot = self
            .units
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(unit.clone())
            .or_default()
            .clone();
        slot.get_or_init(|| {
            let dtype = key
                .dtypes
                .iter()
                .flatten()
                .copied()
                .find(|d| d.is_floating_point());
            let cubin = cubins::cubin(unit, &self.arch, dtype)?;
            self.bind()?;
            // SAFETY: `cubin` is a complete cubin image for this device's architecture, alive
            // for the call.
            let module =
                unsafe { result::module::load_data(cubin.as_ptr().cast()) }.map_err(|e| Error::Cuda {
                    op: "cuModuleLoadData",
                    msg: format!(
                        "loading unit {} of {}.cu for {}: {e:?}",
                        unit.name,
                        unit.module.name(),
                        self.arch
                    ),
                })?;
            Ok(Module_(module))
        })
        .clone()
    }
}

/// Lets `from`'s context reach `to`'s memory directly (cuCtxEnablePeerAccess), once per pair;
/// true when it can (Note [Peer copies] in `storage.rs`). As PyTorch's `get_p2p_access`, a pair
/// that cannot (no NVLink or PCIe peer path, or the driver refuses) answers false and copies
/// still work, staged by the driver through the host. Leaves `from`'s context bound.
pub(crate) fn enable_peer_access(from: &DeviceRuntime, to: &DeviceRuntime) -> bool {
    static PAIRS: Mutex<Vec<(usize, usize, bool)>> = Mutex::new(Vec::new());
    let mut pairs = PAIRS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, _, ok)) = pairs.iter().find(|p| (p.0, p.1) == (from.ordinal, to.ordinal)) {
        return ok;
    }
    let ok = from.ordinal == to.ordinal
        || can_access_peer(from.ordinal, to.ordinal)
            && from.bind().is_ok()
            && matches!(
                // SAFETY: `to`'s context is a retained primary context; `from`'s is current.
                unsafe { sys::cuCtxEnablePeerAccess(to.context(), 0) },
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            );
    pairs.push((from.ordinal, to.ordinal, ok));
    ok
}

/// Whether device `a` can address device `b`'s memory (cuDeviceCanAccessPeer); false when the
/// driver cannot say.
fn can_access_peer(a: usize, b: usize) -> bool {
    let (Ok(a), Ok(b)) = (result::device::get(a as i32), result::device::get(b as i32)) else {
        return false;
    };
    let mut can = 0;
    // SAFETY: both are valid devices after cuInit and `can` is a valid out-pointer.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) };
    r == sys::CUresult::CUDA_SUCCESS && can != 0
}

#[inline]
fn bind_context(ctx: Context) -> Result<()> {
    if BOUND.with(|b| b.get()) == ctx.0 as usize {
        return Ok(());
    }
    // SAFETY: `ctx` is a retained primary context, valid for the life of the process.
    unsafe { result::ctx::set_current(ctx.0) }.map_err(driver_error("cuCtxSetCurrent"))?;
    BOUND.with(|b| b.set(ctx.0 as usize));
    Ok(())
}

/// The caching allocator's view of the device: raw segments and events.
pub(crate) struct DeviceMemory {
    ctx: Context,
}

impl DeviceMemory {
    fn bind(&self) {
        // The context was made current on this thread before, or this fails the call below
        // with a driver error the allocator reports as out of memory; never a panic.
        let _ = bind_context(self.ctx);
    }
}

impl Driver for DeviceMemory {
    fn malloc(&mut self, bytes: usize) -> Option<u64> {
        self.bind();
        // Not captured, and allowed during a capture in relaxed mode only (Note [Interaction
        // with CUDA graph capture]).
        let _relaxed = super::capture::RelaxedCaptureMode::new();
        // SAFETY: plain allocation in the current context; the result is checked.
        unsafe { result::malloc_sync(bytes) }.ok()
    }

    fn free(&mut self, ptr: u64) {
        self.bind();
        // The allocator never frees while a capture is underway on this device; a capture on
        // another device must not refuse it (global capture mode).
        let _relaxed = super::capture::RelaxedCaptureMode::new();
        // SAFETY: `ptr` is a segment base from `malloc` that the allocator no longer hands out;
        // cuMemFree synchronizes with work still using it.
        let _ = unsafe { result::free_sync(ptr) };
    }

    fn mem_get_info(&mut self) -> (usize, usize) {
        self.bind();
        result::mem_get_info().unwrap_or((0, 0))
    }

    fn record_event(&mut self, stream: StreamId) -> EventId {
        self.bind();
        let Ok(event) = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) else {
            // Without an event the block cannot be tracked: synchronize instead, so it is safe
            // to reuse at once (0 marks "already complete").
            super::stream::note_host_sync();
            // SAFETY: `stream` is a live stream of this context.
            let _ = unsafe { result::stream::synchronize(stream as sys::CUstream) };
            return 0;
        };
        // SAFETY: `event` was just created; `stream` is a live stream of this context.
        if unsafe { result::event::record(event, stream as sys::CUstream) }.is_err() {
            super::stream::note_host_sync();
            // SAFETY: as above.
            let _ = unsafe { result::stream::synchronize(stream as sys::CUstream) };
        }
        event as u64
    }

    fn event_done(&mut self, event: EventId) -> bool {
        if event == 0 {
            return true;
        }
        self.bind();
        // SAFETY: `event` came from `record_event` and was not destroyed.
        match unsafe { result::event::query(event as sys::CUevent) } {
            Ok(()) => true,
            // Not done yet, or not answerable now (a capture underway elsewhere in global
            // mode refuses the query): keep the block pending, never reuse it early.
            Err(cudarc::driver::DriverError(e)) => !matches!(
                e,
                sys::CUresult::CUDA_ERROR_NOT_READY
                    | sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                    | sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
                    | sys::CUresult::CUDA_ERROR_CAPTURED_EVENT
            ),
        }
    }

    fn synchronize_event(&mut self, event: EventId) {
        if event == 0 {
            return;
        }
        self.bind();
        super::stream::note_host_sync();
        // SAFETY: `event` came from `record_event` and was not destroyed.
        let _ = unsafe { result::event::synchronize(event as sys::CUevent) };
    }

    fn capture_id(&mut self, stream: StreamId) -> Option<CaptureId> {
        self.bind();
        super::capture::active_capture_id(stream)
    }

    fn destroy_event(&mut self, event: EventId) {
        if event == 0 {
            return;
        }
        self.bind();
        // SAFETY: `event` came from `record_event`; the allocator destroys each event once.
        let _ = unsafe { result::event::destroy(event as sys::CUevent) };
    }
}
