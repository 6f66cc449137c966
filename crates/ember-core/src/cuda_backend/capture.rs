//! The CUDA graph captures underway in the process, and the checks that keep what cannot be
//! captured out of them.
//!
//! Note [Operations refused during capture]: while a stream captures, its work is recorded into
//! a graph, not run. An operation that makes the host wait for the device (a read of device
//! memory into host memory: `to_vec`, `item`, printing, `to(Device::Cpu)`; a peer copy;
//! `cuda::synchronize`, `Stream::synchronize`/`query`, `Event::synchronize`/`query`;
//! `empty_cache`) would wait for work that never runs, and the driver answers it by invalidating
//! the capture; a copy from host memory would be replayed from a host buffer that is gone by
//! then. So each of them first calls [`refuse_during_capture`] (or a variant): when the calling
//! thread's current stream on that device is capturing (or the stream the op names, or, for the
//! device-wide ones, any stream of the device), the op is not made. Instead the capture is ended
//! at once when the calling thread began it (cuStreamEndCapture, its graph destroyed, the
//! allocator told: Note [Interaction with CUDA graph capture]), so that the process goes on
//! eagerly, and the op returns [`Error::IllegalDuringCapture`] naming itself; the graph's
//! `capture_end` returns the same error. A capture begun by another thread is left running (only
//! its own thread may end it) and the op still fails. CPU work during a capture is fine: it
//! never touches a stream.
//!
//! The check costs one atomic load when no capture is underway (the common case); otherwise one
//! cuStreamGetCaptureInfo per stream concerned.

use super::allocator::{CaptureId, MempoolId};
use super::runtime::runtime;
use super::stream::current_raw;
use crate::{Device, Error, Result};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread::ThreadId;

/// Captures begun (or beginning) through `CUDAGraph` and not yet ended.
static UNDERWAY: AtomicUsize = AtomicUsize::new(0);

/// A capture underway, begun by graph `graph`.
#[derive(Debug)]
struct Active {
    graph: u64,
    device: usize,
    /// The stream the capture began on (where it must end).
    stream: u64,
    /// The driver's id for the capture sequence, once it has begun.
    id: Option<CaptureId>,
    thread: ThreadId,
    pool: MempoolId,
}

struct Registry {
    active: Vec<Active>,
    /// Why the capture of a graph (by serial) was ended early (Note [Operations refused during
    /// capture]), until the graph asks.
    ended: Vec<(u64, Error)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    active: Vec::new(),
    ended: Vec::new(),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// True while any capture begun through `CUDAGraph` is underway in the process.
#[inline]
pub(crate) fn any_underway() -> bool {
    UNDERWAY.load(Ordering::Acquire) > 0
}

/// True while a capture begun through `CUDAGraph` is underway on `device`.
pub(crate) fn any_on_device(device: usize) -> bool {
    any_underway() && registry().active.iter().any(|a| a.device == device)
}

/// Records that graph `graph` is about to begin capturing on `stream` of `device` into `pool`
/// (before cuStreamBeginCapture, so that the checks and the relaxed cuMemAlloc apply from the
/// first moment).
pub(crate) fn register(graph: u64, device: usize, stream: u64, pool: MempoolId) {
    let mut r = registry();
    r.ended.retain(|(g, _)| *g != graph);
    r.active.push(Active {
        graph,
        device,
        stream,
        id: None,
        thread: std::thread::current().id(),
        pool,
    });
    UNDERWAY.fetch_add(1, Ordering::AcqRel);
}

/// The graph (by serial) whose capture, begun through `CUDAGraph` on this thread, the calling
/// thread's current stream on `device` takes part in.
pub(crate) fn capture_of_current_stream(device: usize) -> Option<u64> {
    if !any_underway() || runtime(device).is_err() {
        return None;
    }
    let id = active_capture_id(current_raw(device))?;
    let me = std::thread::current().id();
    registry()
        .active
        .iter()
        .find(|a| a.device == device && a.id == Some(id) && a.thread == me)
        .map(|a| a.graph)
}

/// The driver's id for graph `graph`'s capture, once it has begun.
pub(crate) fn set_id(graph: u64, id: CaptureId) {
    if let Some(a) = registry().active.iter_mut().find(|a| a.graph == graph) {
        a.id = Some(id);
    }
}

/// Forgets graph `graph`'s capture (ended or failed to begin); true when it was underway.
pub(crate) fn unregister(graph: u64) -> bool {
    let mut r = registry();
    let before = r.active.len();
    r.active.retain(|a| a.graph != graph);
    let removed = before - r.active.len();
    UNDERWAY.fetch_sub(removed, Ordering::AcqRel);
    removed > 0
}

/// The error that ended graph `graph`'s capture early, taken (asked once, by the graph).
pub(crate) fn take_ended(graph: u64) -> Option<Error> {
    let mut r = registry();
    let i = r.ended.iter().position(|(g, _)| *g == graph)?;
    Some(r.ended.swap_remove(i).1)
}

/// True when graph `graph`'s capture was begun by the calling thread (or is not underway).
pub(crate) fn begun_on_this_thread(graph: u64) -> bool {
    let me = std::thread::current().id();
    registry()
        .active
        .iter()
        .find(|a| a.graph == graph)
        .is_none_or(|a| a.thread == me)
}

/// The capture state of `stream`: None when it is not capturing; otherwise whether the capture
/// is still valid, and its id (given by the driver for an active capture only).
pub(crate) fn capture_status(stream: u64) -> Option<(bool, Option<CaptureId>)> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: `stream` is the legacy stream or a live pool stream (never destroyed); the status
    // and id outputs point at locals, and the optional outputs are null (allowed by the driver).
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream as sys::CUstream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Some((true, Some(id))),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Some((false, None)),
        _ => None,
    }
}

/// The id of the active capture `stream` takes part in (the allocator's routing question).
pub(crate) fn active_capture_id(stream: u64) -> Option<CaptureId> {
    capture_status(stream).and_then(|(_, id)| id)
}

/// Switches the calling thread to relaxed capture mode until dropped, when a capture is
/// underway: cuMemAlloc and cuMemFree of the caching allocator are not captured, and the
/// default (global) mode would refuse them (Note [Interaction with CUDA graph capture]).
pub(crate) struct RelaxedCaptureMode(Option<sys::CUstreamCaptureMode>);

impl RelaxedCaptureMode {
    pub(crate) fn new() -> RelaxedCaptureMode {
        if !any_underway() {
            return RelaxedCaptureMode(None);
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a local the driver swaps with the thread's mode.
        let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        RelaxedCaptureMode((r == sys::CUresult::CUDA_SUCCESS).then_some(mode))
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Some(mut previous) = self.0.take() {
            // SAFETY: as in `new`; restores the mode the thread had.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut previous) };
        }
    }
}

/// True when the calling thread's current stream on the current device is capturing a CUDA
/// graph (`torch.cuda.is_current_stream_capturing`).
pub fn is_current_stream_capturing() -> bool {
    if !any_underway() {
        return false;
    }
    let device = super::stream::current_device();
    runtime(device).is_ok() && capture_status(current_raw(device)).is_some()
}

/// Ends the capture `a` now: cuStreamEndCapture on the stream it began on (the graph, if any,
/// destroyed), the allocator's routing and the default generator's capture ended. The caller
/// removed `a` from the registry.
fn end_now(a: &Active) {
    if let Ok(rt) = runtime(a.device) {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `a.stream` is the live pool stream the capture began on, by this thread.
        let _ = unsafe { sys::cuStreamEndCapture(a.stream as sys::CUstream, &mut graph) };
        if !graph.is_null() {
            // SAFETY: the graph was just returned by the driver and is owned here.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
        }
        rt.allocator.end_allocate_to_pool(a.pool);
    }
    // Eager draws on the device read their seed and offset by value again.
    if let Some(hook) = END_HOOK.get() {
        hook(a.device);
    }
}

/// What else ends with a capture ended here (a refused op's or an abandoned graph's): the
/// default generator's capture, which the graph layer above registers before its first capture
/// begins (`crate::cuda::graph`), so that this backend file imports nothing of the generators.
static END_HOOK: std::sync::OnceLock<fn(usize)> = std::sync::OnceLock::new();

/// Registers `hook(device)` to run whenever a capture on `device` is ended by this module; the
/// first registration stays.
pub(crate) fn set_end_hook(hook: fn(usize)) {
    let _ = END_HOOK.set(hook);
}

/// Ends graph `graph`'s capture without a graph (its `reset` or drop while capturing); true
/// when it was underway on this thread and is ended now.
pub(crate) fn abandon(graph: u64) -> bool {
    let me = std::thread::current().id();
    let entry = {
        let mut r = registry();
        let Some(i) = r.active.iter().position(|a| a.graph == graph && a.thread == me) else {
            return false;
        };
        r.active.remove(i)
    };
    end_now(&entry);
    UNDERWAY.fetch_sub(1, Ordering::AcqRel);
    true
}

/// Refuses `op` when the calling thread's current stream on `device` is capturing (Note
/// [Operations refused during capture]).
#[inline]
pub(crate) fn refuse_during_capture(device: usize, op: &'static str) -> Result<()> {
    if !any_underway() {
        return Ok(());
    }
    refuse(device, op, &[current_raw(device)], false)
}

/// Refuses `op` on `stream` of `device` when that stream or the calling thread's current stream
/// there is capturing.
#[inline]
pub(crate) fn refuse_on_stream(device: usize, stream: u64, op: &'static str) -> Result<()> {
    if !any_underway() {
        return Ok(());
    }
    refuse(device, op, &[stream, current_raw(device)], false)
}

/// Refuses `op`, which waits for the whole of `device`, when any capture is underway there.
#[inline]
pub(crate) fn refuse_device_wide(device: usize, op: &'static str) -> Result<()> {
    if !any_underway() {
        return Ok(());
    }
    refuse(device, op, &[current_raw(device)], true)
}

fn refuse(device: usize, op: &'static str, streams: &[u64], device_wide: bool) -> Result<()> {
    // The legacy stream never captures (capture refuses it), so a device without a capture of
    // ours needs no driver query while its streams concerned are the legacy one; otherwise
    // query with the device's context current (the legacy stream is the current context's).
    if streams.iter().all(|&s| s == 0) && !any_on_device(device) {
        return Ok(());
    }
    runtime(device)?;
    let states: Vec<(u64, bool, Option<CaptureId>)> = streams
        .iter()
        .filter_map(|&s| capture_status(s).map(|(valid, id)| (s, valid, id)))
        .collect();
    let me = std::thread::current().id();
    let (err, mine) = {
        let mut r = registry();
        let concerned = |a: &Active| {
            (device_wide && a.device == device)
                || states.iter().any(|&(s, valid, id)| {
                    a.device == device && ((id.is_some() && a.id == id) || (!valid && a.stream == s))
                })
        };
        if states.is_empty() && !r.active.iter().any(concerned) {
            return Ok(());
        }
        // Only the thread that began a capture may end it (global and thread-local modes).
        let mine: Vec<usize> = (0..r.active.len())
            .filter(|&i| concerned(&r.active[i]) && r.active[i].thread == me)
            .collect();
        let err = Error::IllegalDuringCapture {
            op,
            device: Device::Cuda(device),
            ended: !mine.is_empty(),
        };
        let mut taken = Vec::with_capacity(mine.len());
        for &i in mine.iter().rev() {
            let a = r.active.remove(i);
            r.ended.push((a.graph, err.clone()));
            taken.push(a);
        }
        (err, taken)
    };
    for a in &mine {
        end_now(a);
        UNDERWAY.fetch_sub(1, Ordering::AcqRel);
    }
    Err(err)
}
