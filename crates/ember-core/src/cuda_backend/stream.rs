//! Streams and events, as `torch.cuda.Stream` and `torch.cuda.Event`, and the current device
//! and current stream of each thread.
//!
//! Every CUDA op enqueues its work on the current stream of its device and returns; the
//! current stream is the device's default (legacy) stream until a [`StreamGuard`] or
//! [`set_stream`] changes it for the calling thread.
//!
//! Note [Stream pool]: like PyTorch, streams handed out by [`Stream::new`] come from a pool of
//! 32 per device and priority level, created on first use and never destroyed: the caching
//! allocator tags blocks with the stream that allocated them, and a destroyed stream's handle
//! could be reused by the driver for an unrelated stream. Pool streams do not synchronize
//! implicitly with the default stream; order work between streams with [`Stream::wait_stream`]
//! or events.
//!
//! Note [Counting host waits]: every place where the host blocks on the device (stream, event
//! and device synchronizations, copies to the host that wait for their stream, the allocator
//! waiting for an event, reading a recorded device error) calls [`note_host_sync`], which counts
//! per thread;
//! [`host_sync_count`] reads the count, so a test can check that a path meant to stay
//! asynchronous (a GradScaler step) never waits.

use super::runtime::runtime;
use crate::{Device, Error, Result};
use cudarc::driver::{result, sys};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

const POOL_SIZE: usize = 32;

thread_local! {
    static HOST_SYNCS: Cell<u64> = const { Cell::new(0) };
}

/// Counts one wait of the calling thread for the device (Note [Counting host waits]).
pub(crate) fn note_host_sync() {
    HOST_SYNCS.with(|c| c.set(c.get() + 1));
}

/// How many times the calling thread has waited for a GPU so far: stream, event and device
/// synchronizations and the reads that wait for the device (`to_vec`, `item`, device-to-host
/// copies; peer copies do not wait). A hook for tests that a path does no hidden synchronization (Note
/// [Counting host waits]); it never decreases.
pub fn host_sync_count() -> u64 {
    HOST_SYNCS.with(Cell::get)
}

fn cuda_error(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// A queue of GPU work on one device (`torch.cuda.Stream`). Cheap to clone; clones are the
/// same stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stream {
    raw: u64,
    device: usize,
    priority: i32,
}

struct Pool {
    next: [AtomicUsize; 2],
    streams: Mutex<[[u64; POOL_SIZE]; 2]>,
}

fn pool(device: usize) -> &'static Pool {
    static POOLS: OnceLock<Vec<Pool>> = OnceLock::new();
    let pools = POOLS.get_or_init(|| {
        (0..super::device_count().max(1))
            .map(|_| Pool {
                next: [AtomicUsize::new(0), AtomicUsize::new(0)],
                streams: Mutex::new([[0; POOL_SIZE]; 2]),
            })
            .collect()
    });
    &pools[device.min(pools.len() - 1)]
}

impl Stream {
    /// A stream on the current device from the pool (Note [Stream pool]), with the default
    /// priority (`torch.cuda.Stream()`).
    pub fn new() -> Result<Stream> {
        Stream::with_priority_on(current_device(), 0)
    }

    /// A stream on `device` from the pool, with the default priority
    /// (`torch.cuda.Stream(device)`).
    pub fn new_on(device: usize) -> Result<Stream> {
        Stream::with_priority_on(device, 0)
    }

    /// A stream on the current device with `priority` (`torch.cuda.Stream(priority=p)`); see
    /// [`Stream::with_priority_on`].
    pub fn with_priority(priority: i32) -> Result<Stream> {
        Stream::with_priority_on(current_device(), priority)
    }

    /// A stream on `device` with `priority`: 0 is the default, negative values are higher
    /// priority (as in CUDA and PyTorch); any negative value gives the device's greatest.
    pub fn with_priority_on(device: usize, priority: i32) -> Result<Stream> {
        runtime(device)?;
        let (_least, greatest) =
            result::stream::get_priority_range().map_err(cuda_error("stream priority"))?;
        let level = usize::from(priority < 0);
        let prio = if level == 1 { greatest } else { 0 };
        let pool = pool(device);
        let i = pool.next[level].fetch_add(1, Ordering::Relaxed) % POOL_SIZE;
        let mut streams = pool.streams.lock().unwrap_or_else(|e| e.into_inner());
        if streams[level][i] == 0 {
            let raw = result::stream::create_with_priority(result::stream::StreamKind::NonBlocking, prio)
                .map_err(cuda_error("cuStreamCreateWithPriority"))?;
            streams[level][i] = raw as u64;
        }
        Ok(Stream {
            raw: streams[level][i],
            device,
            priority: prio,
        })
    }

    /// The default (legacy) stream of `device`, where work goes unless a stream is chosen.
    pub fn default_stream(device: usize) -> Result<Stream> {
        runtime(device)?;
        Ok(Stream {
            raw: 0,
            device,
            priority: 0,
        })
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    pub fn device_index(&self) -> usize {
        self.device
    }

    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// The raw `CUstream` handle as an integer (0 for the default stream).
    pub fn as_raw(&self) -> u64 {
        self.raw
    }

    /// Blocks until all work queued on this stream has finished; then reports an error a
    /// kernel recorded on the device (Note [Deferred device errors] in `device_errors.rs`). An
    /// error while this stream or the current one is capturing a CUDA graph (Note [Operations
    /// refused during capture]).
    pub fn synchronize(&self) -> Result<()> {
        let rt = runtime(self.device)?;
        super::capture::refuse_on_stream(self.device, self.raw, "Stream::synchronize")?;
        note_host_sync();
        // SAFETY: the stream is the null stream or a pool stream, which is never destroyed.
        unsafe { result::stream::synchronize(self.raw as sys::CUstream) }
            .map_err(cuda_error("cuStreamSynchronize"))?;
        rt.errors.check()
    }

    /// True when all work queued on this stream has finished. An error while this stream or the
    /// current one is capturing a CUDA graph.
    pub fn query(&self) -> Result<bool> {
        runtime(self.device)?;
        super::capture::refuse_on_stream(self.device, self.raw, "Stream::query")?;
        // SAFETY: the stream is the null stream or a live pool stream.
        match unsafe { sys::cuStreamQuery(self.raw as sys::CUstream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(Error::Cuda {
                op: "cuStreamQuery",
                msg: format!("{e:?}"),
            }),
        }
    }

    /// Makes future work on this stream wait for the work queued on `other` so far.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if other == self {
            return Ok(());
        }
        let event = Event::new(false);
        event.record_on(other)?;
        self.wait_event(&event)
    }

    /// Makes future work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        runtime(self.device)?;
        let Some(raw) = event.raw() else {
            return Ok(()); // never recorded: nothing to wait for, as in PyTorch
        };
        // SAFETY: both handles are live; the event is destroyed only when the last Event drops.
        unsafe {
            result::stream::wait_event(
                self.raw as sys::CUstream,
                raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_error("cuStreamWaitEvent"))
    }

    /// Records a new event on this stream.
    pub fn record_event(&self) -> Result<Event> {
        let event = Event::new(false);
        event.record_on(self)?;
        Ok(event)
    }
}

thread_local! {
    static CURRENT_STREAMS: RefCell<Vec<Option<Stream>>> = const { RefCell::new(Vec::new()) };
}

/// The raw handle of the calling thread's current stream on `device` (0 = default stream).
#[inline]
pub(crate) fn current_raw(device: usize) -> u64 {
    CURRENT_STREAMS.with(|s| {
        s.borrow()
            .get(device)
            .and_then(|s| s.as_ref())
            .map_or(0, |s| s.raw)
    })
}

/// The calling thread's current stream on `device` (`torch.cuda.current_stream`).
pub fn current_stream(device: usize) -> Result<Stream> {
    let current = CURRENT_STREAMS.with(|s| s.borrow().get(device).cloned().flatten());
    match current {
        Some(s) => Ok(s),
        None => Stream::default_stream(device),
    }
}

/// The default stream of `device` (`torch.cuda.default_stream`).
pub fn default_stream(device: usize) -> Result<Stream> {
    Stream::default_stream(device)
}

/// Makes `stream` the calling thread's current stream on its device (`torch.cuda.set_stream`).
pub fn set_stream(stream: &Stream) {
    swap_current(stream.device, Some(stream.clone()));
}

fn swap_current(device: usize, stream: Option<Stream>) -> Option<Stream> {
    CURRENT_STREAMS.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() <= device {
            s.resize(device + 1, None);
        }
        std::mem::replace(&mut s[device], stream)
    })
}

/// The calling thread's current streams, indexed by device (`None`: the default stream), for
/// running work on another thread as if on this one ([`use_streams`]).
pub(crate) fn current_streams() -> Vec<Option<Stream>> {
    CURRENT_STREAMS.with(|s| s.borrow().clone())
}

/// Makes `streams` (from [`current_streams`]) the calling thread's current streams until the
/// guard is dropped.
pub(crate) fn use_streams(streams: &[Option<Stream>]) -> StreamsGuard {
    StreamsGuard {
        previous: CURRENT_STREAMS.with(|s| std::mem::replace(&mut *s.borrow_mut(), streams.to_vec())),
    }
}

/// Puts back the current streams [`use_streams`] replaced.
#[must_use = "the streams are current only while the guard lives"]
pub(crate) struct StreamsGuard {
    previous: Vec<Option<Stream>>,
}

impl Drop for StreamsGuard {
    fn drop(&mut self) {
        let previous = std::mem::take(&mut self.previous);
        CURRENT_STREAMS.with(|s| *s.borrow_mut() = previous);
    }
}

/// Makes a stream current for its device until dropped (`with torch.cuda.stream(s):`).
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    device: usize,
    previous: Option<Stream>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        swap_current(self.device, self.previous.take());
    }
}

/// Makes `s` the current stream of its device until the guard drops (`torch.cuda.stream(s)`).
pub fn stream(s: &Stream) -> StreamGuard {
    StreamGuard {
        device: s.device,
        previous: swap_current(s.device, Some(s.clone())),
    }
}

/// The calling thread's current CUDA device index (`torch.cuda.current_device`).
pub fn current_device() -> usize {
    crate::device::current_cuda_index()
}

/// Sets the calling thread's current CUDA device (`torch.cuda.set_device`).
pub fn set_device(device: usize) -> Result<()> {
    runtime(device)?;
    crate::device::set_current_cuda_index(device);
    Ok(())
}

/// Makes a device current until dropped (`with torch.cuda.device(i):`).
#[must_use = "the device is current only while the guard lives"]
pub struct DeviceGuard {
    previous: usize,
}

impl DeviceGuard {
    pub fn new(device: usize) -> Result<DeviceGuard> {
        let previous = current_device();
        set_device(device)?;
        Ok(DeviceGuard { previous })
    }
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        crate::device::set_current_cuda_index(self.previous);
    }
}

/// Blocks until all work on `device` has finished, on every stream (`torch.cuda.synchronize`);
/// then reports an error a kernel recorded on the device, such as an index out of range (Note
/// [Deferred device errors] in `device_errors.rs`). An error while a CUDA graph capture is
/// underway on the device (Note [Operations refused during capture]).
pub fn synchronize(device: usize) -> Result<()> {
    let rt = runtime(device)?;
    super::capture::refuse_device_wide(device, "cuda::synchronize")?;
    note_host_sync();
    result::ctx::synchronize().map_err(cuda_error("cuCtxSynchronize"))?;
    super::pinned::release_finished();
    rt.errors.check()
}

/// A marker in a stream's work, for ordering and timing (`torch.cuda.Event`). Created on the
/// device of the first stream it is recorded on.
#[derive(Debug)]
pub struct Event {
    timing: bool,
    raw: OnceLock<(u64, usize)>,
}

// SAFETY: a CUevent may be recorded, queried and waited on from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// A new event; `enable_timing` allows [`Event::elapsed_time`] (at a small recording cost).
    pub fn new(enable_timing: bool) -> Event {
        Event {
            timing: enable_timing,
            raw: OnceLock::new(),
        }
    }

    fn raw(&self) -> Option<sys::CUevent> {
        self.raw.get().map(|&(e, _)| e as sys::CUevent)
    }

    /// The GPU the event belongs to (that of the first stream it was recorded on); `None`
    /// before it is first recorded.
    pub(crate) fn device_index(&self) -> Option<usize> {
        self.raw.get().map(|&(_, device)| device)
    }

    /// Records the event on the current stream of the current device.
    pub fn record(&self) -> Result<()> {
        self.record_on(&current_stream(current_device())?)
    }

    /// Records the event on `stream`.
    pub fn record_on(&self, stream: &Stream) -> Result<()> {
        runtime(stream.device)?;
        if self.raw.get().is_none() {
            let flags = if self.timing {
                sys::CUevent_flags::CU_EVENT_DEFAULT
            } else {
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
            };
            let raw = result::event::create(flags).map_err(cuda_error("cuEventCreate"))?;
            if self.raw.set((raw as u64, stream.device)).is_err() {
                // Another thread created it first.
                // SAFETY: `raw` was just created and is not shared.
                let _ = unsafe { result::event::destroy(raw) };
            }
        }
        let &(raw, device) = self.raw.get().expect("set above");
        if device != stream.device {
            return Err(Error::invalid(
                "Event::record",
                format!(
                    "the event belongs to cuda:{device} and cannot be recorded on a stream of cuda:{}",
                    stream.device
                ),
            ));
        }
        // SAFETY: `raw` is a live event of this device; the stream is live.
        unsafe { result::event::record(raw as sys::CUevent, stream.raw as sys::CUstream) }
            .map_err(cuda_error("cuEventRecord"))
    }

    /// Makes future work on `stream` wait for this event.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        stream.wait_event(self)
    }

    /// True when the work before the event has finished (or it was never recorded). An error
    /// while the current stream of the event's device is capturing a CUDA graph.
    pub fn query(&self) -> Result<bool> {
        let Some(&(raw, device)) = self.raw.get() else {
            return Ok(true);
        };
        runtime(device)?;
        super::capture::refuse_during_capture(device, "Event::query")?;
        // SAFETY: `raw` is a live event.
        match unsafe { sys::cuEventQuery(raw as sys::CUevent) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(Error::Cuda {
                op: "cuEventQuery",
                msg: format!("{e:?}"),
            }),
        }
    }

    /// Blocks until the work before the event has finished; then reports an error a kernel
    /// recorded on the device (Note [Deferred device errors] in `device_errors.rs`). An error
    /// while the current stream of the event's device is capturing a CUDA graph.
    pub fn synchronize(&self) -> Result<()> {
        let Some(&(raw, device)) = self.raw.get() else {
            return Ok(());
        };
        let rt = runtime(device)?;
        super::capture::refuse_during_capture(device, "Event::synchronize")?;
        note_host_sync();
        // SAFETY: `raw` is a live event.
        unsafe { result::event::synchronize(raw as sys::CUevent) }
            .map_err(cuda_error("cuEventSynchronize"))?;
        rt.errors.check()
    }

    /// Milliseconds between this event and `end`, both recorded and completed, both created
    /// with timing enabled.
    pub fn elapsed_time(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::invalid(
                "Event::elapsed_time",
                "both events must be created with Event::new(true) (enable_timing)",
            ));
        }
        let (Some(&(start, device)), Some(&(stop, _))) = (self.raw.get(), end.raw.get()) else {
            return Err(Error::invalid(
                "Event::elapsed_time",
                "both events must be recorded before elapsed_time",
            ));
        };
        runtime(device)?;
        // SAFETY: both are live events with timing enabled.
        unsafe { result::event::elapsed(start as sys::CUevent, stop as sys::CUevent) }
            .map_err(cuda_error("cuEventElapsedTime"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some(&(raw, device)) = self.raw.get() {
            if runtime(device).is_ok() {
                // SAFETY: the event is owned by this value and used by no one after drop;
                // the driver defers destruction until recorded work completes.
                let _ = unsafe { result::event::destroy(raw as sys::CUevent) };
            }
        }
    }
}
