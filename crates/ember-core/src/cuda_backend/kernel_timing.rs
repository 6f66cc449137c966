//! The hook before device work, and GPU time per op by CUDA events: the profiler's fallback
//! for kernel timing where CUPTI's activity API (`cupti.rs`) cannot be loaded or started
//! (Note [Profiler timing and attribution] in `profiler/mod.rs`).
//!
//! Every place that enqueues device work (`kernels::launch`, the cuBLASLt and cuDNN calls,
//! the copies (host to device, device to host, device to device) and fills of `storage.rs`)
//! calls [`note_work`] with its stream first. With no profiler timing CUDA that is one relaxed
//! atomic load. While one times by CUPTI, the profiler pushes the launching op's id as CUPTI's
//! correlation id; while one times by events, it records a timing event on that stream for
//! every open op that has none yet, so an op's interval starts right before its first kernel
//! instead of when it entered (the host time between the two is not counted as GPU time).
//!
//! Events come from a per-device pool and go back to it when dropped (creating one costs
//! about a microsecond of driver time); they are never destroyed.

use super::runtime::runtime;
use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Profilers timing CUDA now.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// What [`note_work`] calls while a profiler times CUDA: registered by the profiler (the
/// layer above), so the backend never names it.
static HOOK: OnceLock<fn(u64)> = OnceLock::new();

/// Idle timing events per device (raw `CUevent` handles).
static POOL: Mutex<Vec<Vec<u64>>> = Mutex::new(Vec::new());

/// Makes [`note_work`] call `hook` with each stream from now on (one call per profiler; the
/// first hook registered is the one called).
pub(crate) fn start(hook: fn(u64)) {
    HOOK.get_or_init(|| hook);
    ACTIVE.fetch_add(1, Ordering::Relaxed);
}

/// Undoes one [`start`].
pub(crate) fn stop() {
    ACTIVE.fetch_sub(1, Ordering::Relaxed);
}

/// Called with its stream before any device work is enqueued: reports it to the profiler
/// when one times CUDA (one relaxed atomic load otherwise).
#[inline]
pub(crate) fn note_work(stream: u64) {
    if ACTIVE.load(Ordering::Relaxed) != 0 {
        if let Some(hook) = HOOK.get() {
            hook(stream);
        }
    }
}

/// Waits for all work on `devices`, so that what the profiler timed there is complete (Note
/// [Profiler waits] in `profiler/mod.rs`); then makes the calling thread's current device's
/// context current again. A device that cannot be waited for (a CUDA graph capture underway
/// there, which a device-wide wait would invalidate) gives what finished.
pub(crate) fn wait_for(devices: &[usize]) {
    for &d in devices {
        if super::capture::refuse_device_wide(d, "the profiler's wait for the GPU").is_ok()
            && runtime(d).is_ok()
        {
            super::stream::note_host_sync();
            let _ = result::ctx::synchronize();
        }
    }
    let _ = runtime(super::current_device());
}

fn cuda_error(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// A timing event recorded on a stream; back to its device's pool when dropped.
#[derive(Debug)]
pub(crate) struct TimingEvent {
    raw: u64,
    device: usize,
    /// The raw stream it was recorded on.
    pub(crate) stream: u64,
}

impl TimingEvent {
    /// Records a timing event on `stream` of `device`. None while `stream` is capturing a CUDA
    /// graph (an event recorded there would become a node of the graph, not a timestamp).
    pub(crate) fn record(device: usize, stream: u64) -> Result<Option<TimingEvent>> {
        runtime(device)?;
        if super::capture::capture_status(stream).is_some() {
            return Ok(None);
        }
        let pooled = POOL
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(device)
            .and_then(Vec::pop);
        let raw = match pooled {
            Some(raw) => raw,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(cuda_error("cuEventCreate"))? as u64,
        };
        let event = TimingEvent { raw, device, stream };
        // SAFETY: `raw` is a live event of `device`, whose context `runtime` made current;
        // `stream` is a live stream of that device (the caller's current stream).
        unsafe { result::event::record(raw as sys::CUevent, stream as sys::CUstream) }
            .map_err(cuda_error("cuEventRecord"))?;
        Ok(Some(event))
    }

    /// The device it was recorded on.
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// True once the work before it finished (never waits).
    pub(crate) fn is_complete(&self) -> bool {
        if runtime(self.device).is_err() {
            return false;
        }
        // SAFETY: a live timing event of this device, recorded (above).
        unsafe { result::event::query(self.raw as sys::CUevent) }.is_ok()
    }

    /// Milliseconds from `self` to `later` (both recorded on one device), waiting for `later`
    /// to complete.
    pub(crate) fn elapsed_ms(&self, later: &TimingEvent) -> Result<f32> {
        runtime(self.device)?;
        super::stream::note_host_sync();
        // SAFETY: both are live timing events of this device, recorded (above).
        unsafe {
            result::event::synchronize(later.raw as sys::CUevent)
                .map_err(cuda_error("cuEventSynchronize"))?;
            result::event::elapsed(self.raw as sys::CUevent, later.raw as sys::CUevent)
                .map_err(cuda_error("cuEventElapsedTime"))
        }
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() <= self.device {
            pool.resize_with(self.device + 1, Vec::new);
        }
        // Re-recording a pooled event later is allowed even while this record is pending.
        pool[self.device].push(self.raw);
    }
}
