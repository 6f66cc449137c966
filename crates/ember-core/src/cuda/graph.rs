//! CUDA graphs, as `torch.cuda.CUDAGraph` and `torch.cuda.graph`: capture the device work of a
//! region (a whole training step) once, then replay it with one launch.
//!
//! A capture records what the region enqueues on the capturing stream (and on streams forked
//! into it) instead of running it; [`CUDAGraph::replay`] runs the recorded work again on the
//! same device addresses. The recipe is PyTorch's:
//! - Warm up first, on a side stream, a few iterations of the region: the first use of a kernel
//!   loads (or compiles) its module, and cuBLASLt and cuDNN set up workspaces; none of that may
//!   happen during capture.
//! - Capture on a side stream, never the default stream: [`graph`] does it all (synchronizes,
//!   empties the cache, makes the default capture stream wait for the current stream and current
//!   until the capture ends).
//! - Inputs and outputs are static: copy new data into the tensors the capture read
//!   (`x.copy_(&batch)`) before `replay`, and read the tensors it wrote after. Tensors made during
//!   the capture live in the graph's private memory pool (Note [Interaction with CUDA graph
//!   capture] in `allocator/private_pools.rs`) and keep their addresses across replays.
//! - What cannot be captured (reads into host memory, copies from host memory, synchronizing)
//!   fails with [`Error::IllegalDuringCapture`] and ends the capture (Note [Operations refused
//!   during capture] in `capture.rs`).
//! - Graphs sharing a pool ([`graph_pool_handle`], or another graph's [`CUDAGraph::pool`]) must be
//!   replayed in the order they were captured.
//!
//! Random ops draw through the device's default generator in capture mode: the capture reads
//! the seed and offset from device memory, and every replay writes them there first and moves
//! the generator past the draws, so each replay draws new numbers, the ones an eager run from
//! the same state would (Note [Philox under graph capture] in `random/mod.rs`).

use crate::cuda_backend::allocator::MempoolId;
use crate::cuda_backend::capture;
use crate::cuda_backend::runtime::runtime;
use crate::cuda_backend::stream::{
    current_device, current_raw, current_stream, DeviceGuard, Stream, StreamGuard,
};
use crate::layout::Layout;
use crate::random::default_generator;
use crate::storage::graph_casts::HeldCast;
use crate::{Device, Error, Result};
use cudarc::driver::sys;
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Which other CUDA calls a capture tolerates (`capture_error_mode` of PyTorch's
/// `torch.cuda.graph`; CUDA's `CUstreamCaptureMode`). The driver refuses "potentially unsafe"
/// calls (cuMemAlloc, synchronous copies, ...) made while a capture is underway: in any thread
/// in [`Global`](Self::Global) mode, in the capturing thread in
/// [`ThreadLocal`](Self::ThreadLocal) mode, never in [`Relaxed`](Self::Relaxed) mode. ember's own
/// checks (Note [Operations refused during capture]) apply in every mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureErrorMode {
    /// PyTorch's default ("global").
    #[default]
    Global,
    /// "thread_local".
    ThreadLocal,
    /// "relaxed".
    Relaxed,
}

impl CaptureErrorMode {
    fn raw(self) -> sys::CUstreamCaptureMode {
        match self {
            CaptureErrorMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureErrorMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureErrorMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// Pools made by a graph's own capture: `(n, 0)`.
static GRAPH_POOLS: AtomicU64 = AtomicU64::new(1);
/// Pools made by [`graph_pool_handle`]: `(0, n)`.
static USER_POOLS: AtomicU64 = AtomicU64::new(1);
/// Identities of graphs (the capture registry's keys).
static SERIALS: AtomicU64 = AtomicU64::new(1);

/// A new private memory pool id that graphs can share: give it to
/// [`CUDAGraph::capture_begin`] or [`GraphOptions::pool`] of each (`torch.cuda.graph_pool_handle`).
/// The pool is made by the first capture into it and its memory returns to the device once no
/// graph uses it.
pub fn graph_pool_handle() -> MempoolId {
    MempoolId(0, USER_POOLS.fetch_add(1, Ordering::Relaxed))
}

/// An instantiated graph (`CUgraphExec`).
#[derive(Debug)]
struct Exec(sys::CUgraphExec);

#[derive(Debug)]
enum State {
    /// Nothing captured (new, or reset).
    Empty,
    /// Capture underway on this stream.
    Capturing { stream: u64 },
    /// Captured and instantiated: ready to replay.
    Ready(Exec),
    /// The last capture ended without a graph (`failure` says why).
    Failed,
}

/// A captured CUDA graph (`torch.cuda.CUDAGraph`): [`capture_begin`](Self::capture_begin) /
/// [`capture_end`](Self::capture_end) around the work to record (or the scoped [`graph`]), then
/// [`replay`](Self::replay). Dropping it (or [`reset`](Self::reset)) destroys the graph and gives
/// its memory pool back. Capture methods must be called on the thread that began the capture;
/// a captured graph may be replayed from any thread.
#[derive(Debug)]
pub struct CUDAGraph {
    serial: u64,
    device: usize,
    state: State,
    /// The pool of the last capture, and whether this graph holds a use of it.
    pool: Option<MempoolId>,
    holds_pool: bool,
    /// Why the last capture produced no graph.
    failure: Option<Error>,
    /// Philox counter blocks the captured draws consume per replay (Note [Philox under graph
    /// capture] in `random/mod.rs`).
    rng_increment: u64,
    /// The parameters' casts the captured forward reads from buffers this graph holds (Note
    /// [Casts a captured step keeps] in `storage/graph_casts.rs`), with the source's version
    /// when the buffer last held its cast outside a replay.
    casts: Vec<(HeldCast, Cell<u64>)>,
    /// The replay count (`storage::graph_replays`) after this graph's last replay; `u64::MAX`
    /// before its first.
    last_replay: Cell<u64>,
    /// The streams this graph was replayed on while it holds casts, whose work the buffers
    /// wait for when the graph lets them go.
    replay_streams: std::cell::RefCell<Vec<Stream>>,
}

// SAFETY: a CUgraphExec may be launched and destroyed from any thread with the device's context
// current (`runtime()` binds it); `&self` methods only launch, and the type is not Sync, so one
// graph is never launched from two threads at once.
unsafe impl Send for CUDAGraph {}

impl Default for CUDAGraph {
    fn default() -> Self {
        CUDAGraph::new()
    }
}

impl CUDAGraph {
    /// An empty graph (no GPU needed until capture).
    pub fn new() -> CUDAGraph {
        CUDAGraph {
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            device: 0,
            state: State::Empty,
            pool: None,
            holds_pool: false,
            failure: None,
            rng_increment: 0,
            casts: Vec::new(),
            last_replay: Cell::new(u64::MAX),
            replay_streams: Default::default(),
        }
    }

    /// Begins capturing the work enqueued on the current stream of the current device, which
    /// must not be the default stream; allocations of the capture come from `pool` (shared with
    /// the graphs captured into it) or, with None, from a new private pool of this graph. Uses
    /// [`CaptureErrorMode::Global`], as PyTorch.
    pub fn capture_begin(&mut self, pool: Option<MempoolId>) -> Result<()> {
        self.capture_begin_with_mode(pool, CaptureErrorMode::Global)
    }

    /// [`capture_begin`](Self::capture_begin) with a capture mode.
    pub fn capture_begin_with_mode(&mut self, pool: Option<MempoolId>, mode: CaptureErrorMode) -> Result<()> {
        const OP: &str = "CUDAGraph::capture_begin";
        match self.state {
            State::Empty => {}
            State::Failed => self.reset(),
            State::Capturing { .. } => {
                return Err(Error::invalid(OP, "a capture is already underway on this graph"))
            }
            State::Ready(_) => {
                return Err(Error::invalid(
                    OP,
                    "this graph already holds a captured graph: reset() it first, or use a new CUDAGraph",
                ))
            }
        }
        let device = current_device();
        let rt = runtime(device)?;
        let stream = current_raw(device);
        if stream == 0 {
            return Err(Error::invalid(
                OP,
                "CUDA graphs must be captured on a side stream, not the default stream: use cuda::graph(&mut g), \
                 which captures on a side stream, or make a Stream current (cuda::stream(&s)) after warming up on it",
            ));
        }
        if capture::capture_status(stream).is_some() {
            return Err(Error::invalid(OP, "the current stream is already capturing"));
        }
        let pool = pool.unwrap_or_else(|| MempoolId(GRAPH_POOLS.fetch_add(1, Ordering::Relaxed), 0));
        if pool == MempoolId(0, 0) {
            return Err(Error::invalid(
                OP,
                "MempoolId(0, 0) names no pool: use graph_pool_handle()",
            ));
        }
        if !rt.allocator.begin_allocate_to_pool(pool) {
            return Err(Error::invalid(
                OP,
                format!(
                    "another capture is underway into pool {pool:?}: captures sharing a pool must follow one another"
                ),
            ));
        }
        // The device's default generator hands the capture's draws device pointers to its seed
        // and offset, written now on the stream, before it captures (PyTorch's
        // `capture_prologue`); each replay writes them anew (`replay`).
        let generator = default_generator(Device::Cuda(device));
        if let Err(e) = generator.begin_capture(device) {
            rt.allocator.end_allocate_to_pool(pool);
            rt.allocator.release_pool(pool);
            return Err(e);
        }
        capture::set_end_hook(|device| {
            let _ = default_generator(Device::Cuda(device)).end_capture();
        });
        capture::register(self.serial, device, stream, pool);
        let undo = || {
            capture::unregister(self.serial);
            let _ = generator.end_capture();
            rt.allocator.end_allocate_to_pool(pool);
            rt.allocator.release_pool(pool);
        };
        // SAFETY: `stream` is a live pool stream of this device, whose context `runtime` bound.
        if let Err(e) = unsafe { sys::cuStreamBeginCapture_v2(stream as sys::CUstream, mode.raw()) }.result()
        {
            undo();
            return Err(Error::Cuda {
                op: "cuStreamBeginCapture",
                msg: format!("{e:?}"),
            });
        }
        let Some(id) = capture::active_capture_id(stream) else {
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: the capture began on `stream` just above, on this thread.
            let _ = unsafe { sys::cuStreamEndCapture(stream as sys::CUstream, &mut graph) };
            if !graph.is_null() {
                // SAFETY: the graph was just returned and is owned here.
                let _ = unsafe { sys::cuGraphDestroy(graph) };
            }
            undo();
            return Err(Error::Cuda {
                op: "cuStreamGetCaptureInfo",
                msg: "the stream is not capturing right after cuStreamBeginCapture".into(),
            });
        };
        rt.allocator.set_capture_id(pool, id);
        capture::set_id(self.serial, id);
        self.device = device;
        self.state = State::Capturing { stream };
        self.pool = Some(pool);
        self.holds_pool = true;
        self.failure = None;
        Ok(())
    }

    /// Ends the capture and instantiates the graph. The current stream must be the one the
    /// capture began on. An error when the capture was ended early by an operation that cannot
    /// be captured, or invalidated; the graph then cannot be replayed until captured again.
    pub fn capture_end(&mut self) -> Result<()> {
        const OP: &str = "CUDAGraph::capture_end";
        let State::Capturing { stream } = self.state else {
            return Err(Error::invalid(
                OP,
                "no capture is underway: call capture_begin first",
            ));
        };
        if let Some(err) = capture::take_ended(self.serial) {
            return Err(self.fail(err));
        }
        if !capture::begun_on_this_thread(self.serial) {
            return Err(Error::invalid(
                OP,
                "a capture must end on the thread that began it",
            ));
        }
        if current_raw(self.device) != stream {
            return Err(Error::invalid(
                OP,
                "the current stream is not the one the capture began on: capture must end on the same stream",
            ));
        }
        let rt = runtime(self.device)?;
        let casts = crate::storage::graph_casts::take(self.serial);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the capture began on `stream` (a live pool stream) on this thread; `graph` is a
        // local the driver writes.
        let ended = unsafe { sys::cuStreamEndCapture(stream as sys::CUstream, &mut graph) }.result();
        capture::unregister(self.serial);
        self.rng_increment = default_generator(Device::Cuda(self.device))
            .end_capture()
            .unwrap_or(0);
        if let Some(pool) = self.pool {
            rt.allocator.end_allocate_to_pool(pool);
        }
        if let Err(e) = ended.as_ref().map_err(|e| e.0).and_then(|_| {
            if graph.is_null() {
                Err(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
            } else {
                Ok(())
            }
        }) {
            if !graph.is_null() {
                // SAFETY: returned by the driver, owned here.
                let _ = unsafe { sys::cuGraphDestroy(graph) };
            }
            return Err(self.fail(Error::Cuda {
                op: "cuStreamEndCapture",
                msg: format!(
                    "{e:?}: the capture was invalidated by an operation that cannot be captured (a synchronizing \
                     CUDA call, a copy with pageable host memory, a kernel loaded for the first time: warm up on a \
                     side stream before capturing), by a stream forked into the capture and not joined back, or by \
                     an unsafe CUDA call from another thread in global capture mode"
                ),
            }));
        }
        // SAFETY: `graph` is the valid graph just captured; auto-free-on-launch as PyTorch.
        let exec = unsafe {
            cudarc::driver::result::graph::instantiate(
                graph,
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
        };
        // SAFETY: the executable graph does not need the graph it was instantiated from.
        let _ = unsafe { cudarc::driver::result::graph::destroy(graph) };
        match exec {
            Ok(exec) => {
                self.state = State::Ready(Exec(exec));
                self.casts = casts.into_iter().map(|c| (c, Cell::new(0))).collect();
                self.last_replay.set(u64::MAX);
                Ok(())
            }
            Err(e) => Err(self.fail(Error::Cuda {
                op: "cuGraphInstantiateWithFlags",
                msg: format!("{e:?}"),
            })),
        }
    }

    /// Marks the capture failed with `err` and returns it.
    fn fail(&mut self, err: Error) -> Error {
        self.state = State::Failed;
        self.failure = Some(err.clone());
        err
    }

    /// Launches the captured work on the current stream of the graph's device.
    pub fn replay(&self) -> Result<()> {
        const OP: &str = "CUDAGraph::replay";
        let exec = match &self.state {
            State::Ready(exec) => exec,
            State::Empty => return Err(Error::invalid(OP, "nothing was captured: capture first")),
            State::Capturing { .. } => {
                return Err(Error::invalid(
                    OP,
                    "the capture has not ended: call capture_end first",
                ))
            }
            State::Failed => {
                let why = self
                    .failure
                    .as_ref()
                    .map_or_else(String::new, |e| format!(": {e}"));
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the capture failed, there is no graph to replay (reset() and capture again){why}"
                    ),
                ));
            }
        };
        runtime(self.device)?;
        if self.rng_increment > 0 {
            // The seed and offset this replay's draws read, on the stream it launches on, and the
            // generator moved past them (PyTorch's `replay_prologue`): every replay draws new
            // numbers, those an eager run from the same state would draw.
            default_generator(Device::Cuda(self.device)).replay_prologue(self.device, self.rng_increment)?;
        }
        self.refresh_kept_casts()?;
        // The replay writes storages without counting their versions (Note [Cast twins]).
        let count = crate::storage::note_graph_replay();
        // A replay's copies and fills as eager ones (Note [CUPTI beside other threads' CUDA
        // work] in `cuda_backend/cupti.rs`).
        let _gate = crate::cuda_backend::cupti::work_guard();
        // SAFETY: `exec` is a live executable graph of this device, whose context `runtime`
        // bound; the current stream of that device is live. Its memory (the private pool) lives
        // as long as this graph holds it.
        let launched = unsafe {
            cudarc::driver::result::graph::launch(exec.0, current_raw(self.device) as sys::CUstream)
        };
        launched.map_err(|e| Error::Cuda {
            op: "cuGraphLaunch",
            msg: format!("{e:?}"),
        })?;
        self.last_replay.set(count);
        Ok(())
    }

    /// Casts the parameters into the buffers the captured forward reads, on the replay's
    /// stream, where a buffer may not hold its parameter's cast: every replay for a cast the
    /// captured step does not keep; for the others before the first replay, after another
    /// graph's replay, after a write outside the graph (Note [Casts a captured step keeps] in
    /// `storage/graph_casts.rs`).
    fn refresh_kept_casts(&self) -> Result<()> {
        if self.casts.is_empty() {
            return Ok(());
        }
        let stream = current_stream(self.device)?;
        {
            let mut seen = self.replay_streams.borrow_mut();
            if !seen.contains(&stream) {
                seen.push(stream);
            }
        }
        let stale = self.last_replay.get() != crate::storage::graph_replays();
        for (c, seen_version) in &self.casts {
            let version = c.source.version();
            if !c.kept || stale || version != seen_version.get() {
                let source = c.source.read();
                let all = Layout::contiguous([source.len()]);
                c.target.write().copy_strided_from(&all, &source, &all)?;
                seen_version.set(version);
            }
        }
        Ok(())
    }

    /// How many casts of parameters the captured step keeps from one replay to the next, so
    /// that the captured forward has no cast kernel for them and no cast runs before a replay
    /// that follows this graph's own (Note [Casts a captured step keeps] in
    /// `storage/graph_casts.rs`): for tests and profiling.
    #[doc(hidden)]
    pub fn kept_casts(&self) -> usize {
        self.casts.iter().filter(|(c, _)| c.kept).count()
    }

    /// Destroys the graph (ending a capture underway) and gives back its use of the memory
    /// pool: once no graph uses the pool, `empty_cache` returns its memory to the device
    /// (tensors made during the capture keep theirs until dropped). The graph can capture again.
    pub fn reset(&mut self) {
        // The buffers go back to the allocator once the replays' work is done.
        for stream in self.replay_streams.take() {
            for (c, _) in &self.casts {
                let _ = c.target.read().record_stream(&stream);
            }
        }
        self.casts.clear();
        crate::storage::graph_casts::forget(self.serial);
        match std::mem::replace(&mut self.state, State::Empty) {
            State::Capturing { .. } => {
                if capture::take_ended(self.serial).is_none() && !capture::abandon(self.serial) {
                    // Underway on another thread, which alone may end it: the capture keeps its
                    // pool (leaked with it) rather than hand it to another user.
                    self.holds_pool = false;
                }
            }
            State::Ready(exec) => {
                if runtime(self.device).is_ok() {
                    // SAFETY: `exec` is owned by this graph and not used after; the driver frees
                    // an executable graph still running once it completes.
                    let _ = unsafe { cudarc::driver::result::graph::exec_destroy(exec.0) };
                }
            }
            State::Empty | State::Failed => {}
        }
        if self.holds_pool {
            if let (Some(pool), Ok(rt)) = (self.pool, runtime(self.device)) {
                rt.allocator.release_pool(pool);
            }
            self.holds_pool = false;
        }
        self.failure = None;
    }

    /// The id of the memory pool of the last capture, for another graph to share
    /// (`CUDAGraph.pool()`); an error before a capture has ended.
    pub fn pool(&self) -> Result<MempoolId> {
        match (&self.state, self.pool) {
            (State::Ready(_) | State::Failed, Some(pool)) => Ok(pool),
            _ => Err(Error::invalid(
                "CUDAGraph::pool",
                "no capture has ended on this graph (or it was reset)",
            )),
        }
    }

    /// True when a capture ended successfully and the graph can be replayed.
    pub fn is_captured(&self) -> bool {
        matches!(self.state, State::Ready(_))
    }
}

impl Drop for CUDAGraph {
    fn drop(&mut self) {
        self.reset();
    }
}

/// Options of [`graph_with`] (the keyword arguments of `torch.cuda.graph`).
#[derive(Clone, Debug, Default)]
pub struct GraphOptions {
    /// The memory pool to capture into, shared with other graphs (`pool=`): from
    /// [`graph_pool_handle`] or another graph's [`CUDAGraph::pool`]. None: a pool of its own.
    pub pool: Option<MempoolId>,
    /// The side stream to capture on (`stream=`). None: the device's default capture stream.
    pub stream: Option<Stream>,
    /// `capture_error_mode=`.
    pub capture_error_mode: CaptureErrorMode,
}

/// A capture underway on a side stream (`with torch.cuda.graph(g):`): made by [`graph`], ended
/// by [`end`](Self::end) or by dropping it, which also makes the previous stream current again.
#[must_use = "the capture ends when this guard drops"]
pub struct GraphCapture<'g> {
    graph: &'g mut CUDAGraph,
    previous: Stream,
    capture_stream: Stream,
    ended: bool,
    // Dropped in this order after `Drop::drop` ended the capture: the stream, then the device.
    _stream: StreamGuard,
    _device: Option<DeviceGuard>,
    /// A capture must end on the thread that began it.
    _not_send: PhantomData<*const ()>,
}

impl GraphCapture<'_> {
    /// Ends the capture (see [`CUDAGraph::capture_end`]) and makes the previous stream current.
    pub fn end(mut self) -> Result<()> {
        self.finish()
    }

    /// The stream the capture runs on.
    pub fn stream(&self) -> &Stream {
        &self.capture_stream
    }

    fn finish(&mut self) -> Result<()> {
        self.ended = true;
        let r = self.graph.capture_end();
        // Work the region ran eagerly after a refused op is ordered before what follows.
        let _ = self.previous.wait_stream(&self.capture_stream);
        r
    }
}

impl Drop for GraphCapture<'_> {
    fn drop(&mut self) {
        if !self.ended {
            // The error, if any, stays with the graph: `replay` reports it.
            let _ = self.finish();
        }
    }
}

/// The side stream [`graph`] captures on by default, one per device (as PyTorch's
/// `torch.cuda.graph.default_capture_stream`), so graphs sharing a pool reuse its blocks.
fn default_capture_stream(device: usize) -> Result<Stream> {
    static STREAMS: OnceLock<Vec<OnceLock<Stream>>> = OnceLock::new();
    let slots = STREAMS.get_or_init(|| {
        (0..crate::cuda_backend::device_count())
            .map(|_| OnceLock::new())
            .collect()
    });
    let slot = slots
        .get(device)
        .ok_or_else(|| Error::invalid("cuda::graph", format!("device ordinal {device} is out of range")))?;
    if let Some(s) = slot.get() {
        return Ok(s.clone());
    }
    let s = Stream::new_on(device)?;
    Ok(slot.get_or_init(|| s).clone())
}

/// Begins capturing `g` on a side stream until the returned guard drops
/// (`with torch.cuda.graph(g):`): synchronizes the device and empties its cache (as PyTorch,
/// to give the graph as much memory as possible; skipped while another capture is underway on
/// the device), makes the capture stream wait for the current stream, and makes it current.
pub fn graph(g: &mut CUDAGraph) -> Result<GraphCapture<'_>> {
    graph_with(g, GraphOptions::default())
}

/// [`graph`] with a shared pool, a chosen stream or a capture mode.
pub fn graph_with(g: &mut CUDAGraph, options: GraphOptions) -> Result<GraphCapture<'_>> {
    let device = options
        .stream
        .as_ref()
        .map_or_else(current_device, Stream::device_index);
    let rt = runtime(device)?;
    let previous = current_stream(device)?;
    if !capture::any_on_device(device) {
        crate::cuda_backend::synchronize(device)?;
        rt.allocator.empty_cache();
    }
    let capture_stream = match options.stream {
        Some(s) => s,
        None => default_capture_stream(device)?,
    };
    capture_stream.wait_stream(&previous)?;
    let device_guard = if device != current_device() {
        Some(DeviceGuard::new(device)?)
    } else {
        None
    };
    let stream_guard = crate::cuda_backend::stream(&capture_stream);
    g.capture_begin_with_mode(options.pool, options.capture_error_mode)?;
    Ok(GraphCapture {
        graph: g,
        previous,
        capture_stream,
        ended: false,
        _stream: stream_guard,
        _device: device_guard,
        _not_send: PhantomData,
    })
}
