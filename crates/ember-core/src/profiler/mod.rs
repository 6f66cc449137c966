//! The profiler, as `torch.profiler`: CPU time per op and per user range, GPU time per op,
//! memory per op, grouped into a `key_averages()` table, exported as a chrome trace in
//! Kineto's format (`chrome://tracing`, Perfetto, TensorBoard), on a schedule of steps.
//!
//! ```
//! use ember_core::profiler::{self, ProfilerActivity};
//! use ember_core::{DType, Device, Tensor};
//! # fn main() -> ember_core::Result<()> {
//! let x = Tensor::randn([8, 16], DType::F32, Device::Cpu)?;
//! let w = Tensor::randn([16, 4], DType::F32, Device::Cpu)?;
//! let mut prof = profiler::profile()
//!     .activities([ProfilerActivity::Cpu])
//!     .record_shapes(true)
//!     .start()?;
//! {
//!     let _r = profiler::record_function("model_inference");
//!     x.matmul(&w)?.relu()?;
//! }
//! prof.stop()?;
//! let averages = prof.key_averages();
//! println!("{}", averages.table("cpu_time_total", 10)?);
//! # Ok(())
//! # }
//! ```
//!
//! Files: `recorder` (sessions, the per-thread stack of open ops and ranges, the dispatch
//! observer, the hook before device work), `key_averages` (events grouped by name and the
//! table), `chrome_trace` (the export); the GPU side of the timing is `cuda::cupti` (with
//! the record layouts in `cuda::cupti_records`) and, as the fallback, `cuda::kernel_timing`.
//!
//! Note [Profiler timing and attribution]:
//! - *CPU time.* The profiler is an observer of the dispatch point (step 4 of
//!   `dispatch::call`): every op call reports entering and leaving with its thread and a call
//!   id. Each thread keeps a stack of what is open (ops, `record_function` ranges, backward
//!   nodes, profiler steps); an entry's parent is the entry below it, its CPU total is its
//!   wall-clock time between entering and leaving, its self CPU time is that minus its
//!   children's totals. Ops of all threads are recorded (as PyTorch does); each event names
//!   its thread.
//! - *Backward.* The autograd engine opens a range named as PyTorch names the node
//!   (`mul` → `MulBackward0`) around each node's backward rule, so the ops of the rule pass
//!   the dispatch point as its children.
//! - *GPU time: CUPTI (the default).* While CUDA is profiled, every place that enqueues
//!   device work (kernel launches, cuBLASLt and cuDNN calls, device copies and fills) first
//!   calls `kernel_timing::note_work(stream)`, which calls the hook the recorder registered at
//!   the session's start (the backend never names the profiler). With CUPTI's activity
//!   API loaded (`cuda::cupti`: kinds CONCURRENT_KERNEL, MEMCPY, MEMSET, DRIVER, RUNTIME and
//!   EXTERNAL_CORRELATION enabled for the session), the recorder pushes the innermost open
//!   CUDA op's id as the thread's external correlation id (`CUSTOM0`) before its first device
//!   work and pops it when the op closes; CUPTI then writes, for every CUDA API call made
//!   meanwhile, a record linking the call's correlation id to the op's id, and for every
//!   kernel, memcpy and memset a record with its device start and end and the correlation id
//!   of the call that launched it. At the end of the session the recorder waits for the
//!   GPU (Note [Profiler waits]), flushes CUPTI's buffers and attributes each activity to its op
//!   (correlation id → external id → event): an op's self CUDA time is the sum of its own
//!   activities' durations, its total that plus its children's totals, and a range (no
//!   device work of its own) gets its children's totals. Activity timestamps are put on the
//!   trace's clock by a (CUPTI timestamp, host instant) pair taken at the session's start.
//!   The trace shows each activity as its own event on its device stream, with a flow from
//!   the launching op. Work no open op launched (other threads outside ops) is in the trace
//!   without an op.
//! - *GPU time: CUDA events (the fallback where CUPTI cannot be loaded or started, or when
//!   asked for with [`ProfileBuilder::cuda_timing`]).* `note_work` then records one timing
//!   event on the stream, shared as the start of every open CUDA op of
//!   the thread that has none yet, and counts a launch for the innermost open op; when such
//!   an op leaves, an end event is recorded on the same stream. An op's CUDA total is the
//!   time between its two events, its self CUDA time that minus its children's totals; ranges
//!   get their children's totals and no self time. Events are read when the cycle ends (one
//!   wait for the GPU). The first event of a device in a cycle is its reference: GPU
//!   timestamps in the trace are the host time it was recorded plus the event time since it
//!   (exact when the stream was idle then). Limits of the fallback, which CUPTI removes: an
//!   interval covers everything the stream ran between the events (work other threads
//!   enqueued on the same stream included), and idle GPU time between an op's kernels while
//!   the host launches the next one counts as the op's time; the trace shows one device
//!   interval per op, named after the op, not one per kernel. [`Trace::cuda_timing_source`]
//!   says which method ran (and [`Trace::cupti_unavailable`] why CUPTI did not).
//! - *Memory* (`profile_memory`): Note [Profiled memory] in `memory.rs`.
//! - *Cost without a profiler:* the dispatch point's observer check (one relaxed atomic
//!   load), `record_function` and the backward range (one each), the hook before device work
//!   (one), and storage creation and drop (one). Nothing of CUPTI is loaded or called
//!   until a profiler that records CUDA starts; after one has, each copy takes a shared lock,
//!   and CUPTI, still attached to the driver, adds about 1 us to each launch and copy (Note
//!   [CUPTI beside other threads' CUDA work] in `cuda_backend/cupti.rs`). A profile timed by CUDA
//!   events (`cuda_timing(CudaTimingSource::CudaEvents)`) never loads CUPTI, so a program
//!   that profiles a few steps of a long run can keep the rest of the run free of that cost.
//!
//! Note [Profiler waits]: the thread that stops a profiler waits for its current device and
//! for the devices it launched work on itself during the cycle (as PyTorch's exit waits for
//! the current device), never for a device that only other threads used. Another thread's
//! work is read as far as it finished: its CUPTI records arrive when complete (an unfinished
//! kernel's is dropped), its timing events are queried, not waited for. History: the stop
//! waited for every device that got work. With DDP ranks as threads of one process, rank 0
//! stopping its profiler then waited for cuda:1, whose queue could hold rank 1's next
//! all-reduce, which waits on the GPU for rank 0's matching one, issued only after the stop:
//! a deadlock until NCCL's timeout aborted the communicators, and the step's gradients came
//! out wrong (rank 1's its own, unaveraged). On two H100s 5 of 12 profiled runs hung or went
//! wrong (some perhaps in CUPTI itself: the next note).
//!
//! Note [CUPTI and ranks as threads]: CUPTI is process-wide, so with ranks as threads one
//! rank's profiler turns it on and off under the other ranks' running collectives. On two
//! H100s, a test where rank 0 starts and later stops a CUPTI profiler, each time while rank
//! 1's all-reduce waits on cuda:1 for rank 0's, hung for good (past NCCL's timeout), even with
//! the waits above; which CUPTI call blocks was not pinned down.
//! So while collectives whose kernels wait on the GPU for peers run on several devices of
//! this process (NCCL communicators register theirs: `cuda::register_collectives`), a
//! profiler does not start CUPTI: it times CUDA by events and says why
//! ([`Trace::cupti_unavailable`]). One rank per process (`ember-run`, as `torchrun` runs
//! PyTorch's) keeps CUPTI's kernel records.

mod chrome_trace;
mod key_averages;
pub(crate) mod recorder;

pub use crate::cuda_backend::cupti_records::GpuActivityKind;
pub use key_averages::{EventAvg, KeyAverages};

use crate::{Device, Error, Result};
use recorder::{OpenRange, Options, Session};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What a profiler records (`torch.profiler.ProfilerActivity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProfilerActivity {
    /// Ops and ranges on host threads, CPU time.
    Cpu,
    /// GPU time of the ops that enqueue CUDA work.
    Cuda,
}

/// How a profiler measures GPU time (Note [Profiler timing and attribution]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaTimingSource {
    /// CUPTI's activity API: every kernel, memcpy and memset with its device start and end,
    /// attributed to the op that launched it. Falls back to [`CudaTimingSource::CudaEvents`]
    /// when libcupti cannot be loaded or started.
    Cupti,
    /// CUDA events recorded around each op's device work: one interval per op.
    CudaEvents,
}

impl CudaTimingSource {
    /// `"cupti"` or `"cuda events"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CudaTimingSource::Cupti => "cupti",
            CudaTimingSource::CudaEvents => "cuda events",
        }
    }
}

impl std::fmt::Display for CudaTimingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the profiler does during a step (`torch.profiler.ProfilerAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfilerAction {
    /// Not recording.
    None,
    /// Recording, to be discarded (the first steps of a cycle carry start-up costs).
    Warmup,
    /// Recording.
    Record,
    /// Recording the cycle's last step; the trace is handed to `on_trace_ready` after it.
    RecordAndSave,
}

/// Which steps a profiler records (`torch.profiler.schedule`): after `skip_first` steps,
/// cycles of `wait` idle steps, `warmup` recorded-and-discarded steps and `active` recorded
/// steps, `repeat` times (0: until the profiler stops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub wait: usize,
    pub warmup: usize,
    pub active: usize,
    pub repeat: usize,
    pub skip_first: usize,
}

/// A [`Schedule`] (`torch.profiler.schedule(wait=, warmup=, active=, repeat=)`).
pub fn schedule(wait: usize, warmup: usize, active: usize, repeat: usize) -> Schedule {
    Schedule {
        wait,
        warmup,
        active,
        repeat,
        skip_first: 0,
    }
}

impl Schedule {
    /// The same schedule after `n` steps of doing nothing.
    pub fn skip_first(self, n: usize) -> Schedule {
        Schedule {
            skip_first: n,
            ..self
        }
    }

    /// What to do at step `step` (counted from 0), as PyTorch's schedule function answers.
    pub fn action(&self, step: usize) -> ProfilerAction {
        if step < self.skip_first {
            return ProfilerAction::None;
        }
        let step = step - self.skip_first;
        let cycle = self.wait + self.warmup + self.active;
        if cycle == 0 || self.active == 0 || (self.repeat > 0 && step / cycle >= self.repeat) {
            return ProfilerAction::None;
        }
        let m = step % cycle;
        if m < self.wait {
            ProfilerAction::None
        } else if m < self.wait + self.warmup {
            ProfilerAction::Warmup
        } else if m < cycle - 1 {
            ProfilerAction::Record
        } else {
            ProfilerAction::RecordAndSave
        }
    }
}

type TraceHandler = Box<dyn FnMut(&Trace) + Send>;

/// The options of a profiler (`torch.profiler.profile(...)`'s arguments); [`profile`] makes
/// one and [`ProfileBuilder::start`] starts recording.
pub struct ProfileBuilder {
    activities: Vec<ProfilerActivity>,
    record_shapes: bool,
    profile_memory: bool,
    emit_nvtx: bool,
    cuda_timing: CudaTimingSource,
    schedule: Option<Schedule>,
    on_trace_ready: Option<TraceHandler>,
}

/// A profiler's options, defaulting to PyTorch's: CPU activity, and CUDA when a GPU is
/// present; no shapes, no memory, no schedule (every step recorded).
pub fn profile() -> ProfileBuilder {
    let mut activities = vec![ProfilerActivity::Cpu];
    if crate::cuda_backend::is_available() {
        activities.push(ProfilerActivity::Cuda);
    }
    ProfileBuilder {
        activities,
        record_shapes: false,
        profile_memory: false,
        emit_nvtx: false,
        cuda_timing: CudaTimingSource::Cupti,
        schedule: None,
        on_trace_ready: None,
    }
}

impl ProfileBuilder {
    /// What to record (`activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]`).
    pub fn activities(mut self, activities: impl IntoIterator<Item = ProfilerActivity>) -> Self {
        self.activities = activities.into_iter().collect();
        self
    }

    /// Records each op's input shapes (`record_shapes=True`), for
    /// [`Trace::key_averages_by_input_shape`] and the trace's `Input Dims`.
    pub fn record_shapes(mut self, on: bool) -> Self {
        self.record_shapes = on;
        self
    }

    /// Records the bytes of tensor storages each op makes and frees (`profile_memory=True`;
    /// Note [Profiled memory] in `memory.rs`).
    pub fn profile_memory(mut self, on: bool) -> Self {
        self.profile_memory = on;
        self
    }

    /// Also emits an NVTX range per op and range while recording, for Nsight Systems
    /// (`torch.autograd.profiler.emit_nvtx`); see [`crate::cuda::nvtx`].
    pub fn emit_nvtx(mut self, on: bool) -> Self {
        self.emit_nvtx = on;
        self
    }

    /// How to time CUDA: [`CudaTimingSource::Cupti`] (the default, falling back to CUDA events
    /// where libcupti cannot be loaded or started) or [`CudaTimingSource::CudaEvents`]. CUPTI
    /// stays attached after the profile, at about 1 us per later launch and copy; CUDA events
    /// leave nothing behind (see "Cost without a profiler" in the module docs).
    pub fn cuda_timing(mut self, source: CudaTimingSource) -> Self {
        self.cuda_timing = source;
        self
    }

    /// Records only the steps `schedule` says (`schedule=torch.profiler.schedule(...)`);
    /// [`Profiler::step`] marks the end of each step.
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// Called with each finished cycle's trace (`on_trace_ready=`), on the thread that calls
    /// [`Profiler::step`] or [`Profiler::stop`]; see [`tensorboard_trace_handler`].
    pub fn on_trace_ready(mut self, handler: impl FnMut(&Trace) + Send + 'static) -> Self {
        self.on_trace_ready = Some(Box::new(handler));
        self
    }

    /// Starts profiling (entering `with profile(...) as prof:`). An error while another
    /// profiler runs in the process.
    pub fn start(self) -> Result<Profiler> {
        if RUNNING.swap(true, Ordering::AcqRel) {
            return Err(Error::invalid(
                "profiler::profile",
                "another profiler is already running in this process; stop it first",
            ));
        }
        let options = Options {
            record_shapes: self.record_shapes,
            profile_memory: self.profile_memory,
            cuda: self.activities.contains(&ProfilerActivity::Cuda) && crate::cuda_backend::is_available(),
            cuda_timing: self.cuda_timing,
            emit_nvtx: self.emit_nvtx,
        };
        let mut p = Profiler {
            options,
            cpu: self.activities.contains(&ProfilerActivity::Cpu),
            schedule: self.schedule,
            on_trace_ready: self.on_trace_ready,
            step_num: 0,
            action: ProfilerAction::None,
            session: None,
            step_range: None,
            last: None,
            running: true,
        };
        p.action = p.action_at(0);
        p.transit(ProfilerAction::None, p.action);
        p.open_step_range();
        Ok(p)
    }
}

/// True while a [`Profiler`] exists and has not stopped.
static RUNNING: AtomicBool = AtomicBool::new(false);

/// A running profiler (`torch.profiler.profile` inside its `with`); stops when dropped.
/// After [`Profiler::stop`] it holds the last cycle's [`Trace`].
pub struct Profiler {
    options: Options,
    cpu: bool,
    schedule: Option<Schedule>,
    on_trace_ready: Option<TraceHandler>,
    step_num: usize,
    action: ProfilerAction,
    session: Option<Arc<Session>>,
    step_range: Option<OpenRange>,
    last: Option<Trace>,
    running: bool,
}

impl Profiler {
    fn action_at(&self, step: usize) -> ProfilerAction {
        match &self.schedule {
            Some(s) => s.action(step),
            None => ProfilerAction::Record,
        }
    }

    fn open_step_range(&mut self) {
        if self.schedule.is_some() && self.session.is_some() {
            let name = format!("ProfilerStep#{}", self.step_num);
            self.step_range = OpenRange::open(Cow::Owned(name), EventKind::ProfilerStep, None);
        }
    }

    fn begin(&mut self) {
        self.session = Some(Session::begin(self.options));
    }

    /// Ends the session; hands its trace to `on_trace_ready` when `save`.
    fn end(&mut self, save: bool) {
        self.step_range = None;
        let Some(session) = self.session.take() else {
            return;
        };
        let (start_unix_us, options) = (session.start_unix_us, session.options);
        let (timing, cupti_unavailable) = (session.timing, session.cupti_unavailable.clone());
        let recorder::Finish {
            mut events,
            activities: mut gpu_activities,
            mut api_calls,
            threads,
        } = session.finish();
        if !self.cpu {
            // CUDA activity only: keep the events that ran GPU work (indices renumbered).
            let mut new_index = vec![None; events.len()];
            let mut n = 0;
            for (i, e) in events.iter().enumerate() {
                if e.cuda_time_total_ns > 0 {
                    new_index[i] = Some(n);
                    n += 1;
                }
            }
            events.retain(|e| e.cuda_time_total_ns > 0);
            let map = |i: usize| new_index.get(i).copied().flatten();
            for e in &mut events {
                e.parent = e.parent.and_then(map);
                e.children = e.children.iter().filter_map(|&c| map(c)).collect();
            }
            for a in &mut gpu_activities {
                a.event = a.event.and_then(map);
            }
            api_calls.retain_mut(|c| map(c.event).map(|e| c.event = e).is_some());
        }
        if !save {
            return;
        }
        let trace = Trace {
            events,
            threads,
            start_unix_us,
            step_num: self.step_num,
            profile_memory: options.profile_memory,
            cuda: options.cuda,
            timing,
            cupti_unavailable,
            gpu_activities,
            api_calls,
        };
        if let Some(handler) = self.on_trace_ready.as_mut() {
            handler(&trace);
        }
        self.last = Some(trace);
    }

    /// PyTorch's action transitions (`torch.profiler.profile._transit_action`).
    fn transit(&mut self, from: ProfilerAction, to: ProfilerAction) {
        use ProfilerAction as A;
        match (from, to) {
            (A::None, A::None) | (A::Record, A::Record) | (A::Record, A::RecordAndSave) => {}
            (A::None, _) => self.begin(),
            (A::Warmup, A::None) => self.end(false),
            (A::Warmup, A::Warmup) => {}
            (A::Warmup, _) => {
                // The warm-up steps are discarded: the active steps start a fresh session.
                self.end(false);
                self.begin();
            }
            (A::Record, A::None) => self.end(true),
            (A::Record, A::Warmup) => {
                self.end(true);
                self.begin();
            }
            (A::RecordAndSave, A::None) => self.end(true),
            (A::RecordAndSave, _) => {
                self.end(true);
                self.begin();
            }
        }
    }

    /// Marks the end of a step (`prof.step()`): moves along the schedule, closing, saving and
    /// starting cycles as it says. Each recorded step is a `ProfilerStep#N` range.
    pub fn step(&mut self) -> Result<()> {
        if !self.running {
            return Err(Error::invalid("Profiler::step", "the profiler has stopped"));
        }
        self.step_range = None;
        let from = self.action;
        self.step_num += 1;
        self.action = self.action_at(self.step_num);
        self.transit(from, self.action);
        self.open_step_range();
        Ok(())
    }

    /// The number of [`Profiler::step`] calls so far (`prof.step_num`).
    pub fn step_num(&self) -> usize {
        self.step_num
    }

    /// Stops profiling (leaving the `with` block): a cycle being recorded is saved and handed
    /// to `on_trace_ready`. Waits for the GPU when CUDA was timed. Stopping twice is a no-op.
    pub fn stop(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        self.step_range = None;
        match self.action {
            ProfilerAction::None => {}
            ProfilerAction::Warmup => self.end(false),
            ProfilerAction::Record | ProfilerAction::RecordAndSave => self.end(true),
        }
        self.running = false;
        RUNNING.store(false, Ordering::Release);
        Ok(())
    }

    /// The last saved cycle's trace (None before one was saved).
    pub fn trace(&self) -> Option<&Trace> {
        self.last.as_ref()
    }

    /// The last saved cycle's events (`prof.events()`); empty before one was saved.
    pub fn events(&self) -> &[FunctionEvent] {
        self.last.as_ref().map_or(&[], |t| &t.events)
    }

    /// The last saved cycle's events grouped by name (`prof.key_averages()`).
    pub fn key_averages(&self) -> KeyAverages {
        self.last
            .as_ref()
            .map_or_else(KeyAverages::empty, Trace::key_averages)
    }

    /// The last saved cycle's events grouped by name and input shapes
    /// (`prof.key_averages(group_by_input_shape=True)`).
    pub fn key_averages_by_input_shape(&self) -> KeyAverages {
        self.last
            .as_ref()
            .map_or_else(KeyAverages::empty, Trace::key_averages_by_input_shape)
    }

    /// How the last saved cycle timed CUDA (None when it did not, or before a cycle was
    /// saved): `"cupti"` or `"cuda events"` by [`CudaTimingSource::as_str`].
    pub fn cuda_timing_source(&self) -> Option<CudaTimingSource> {
        self.last.as_ref().and_then(Trace::cuda_timing_source)
    }

    /// Writes the last saved cycle as a chrome trace (`prof.export_chrome_trace(path)`).
    pub fn export_chrome_trace(&self, path: impl AsRef<Path>) -> Result<()> {
        match &self.last {
            Some(t) => t.export_chrome_trace(path),
            None => Err(Error::invalid(
                "Profiler::export_chrome_trace",
                "no trace recorded yet: stop the profiler (or finish a scheduled cycle) first",
            )),
        }
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// What kind of range an event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// An op that passed the dispatch point (`cpu_op` in traces).
    Op,
    /// A [`record_function`] range (`user_annotation`).
    UserAnnotation,
    /// A backward node's rule run by the autograd engine (`MulBackward0`).
    Backward,
    /// A step of a scheduled profiler (`ProfilerStep#3`).
    ProfilerStep,
}

/// Where and for how long an op's GPU work ran (Note [Profiler timing and attribution]):
/// with CUDA events, the interval between its two events; with CUPTI, from its first own
/// activity's start to its last one's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInterval {
    /// The CUDA device index.
    pub device: usize,
    /// With CUDA events, the raw stream handle the op's work went to (0: the legacy default
    /// stream); with CUPTI, CUPTI's stream id of its first activity.
    pub stream: u64,
    /// Nanoseconds since the trace started, on the host's clock.
    pub start_ns: u64,
    pub duration_ns: u64,
    /// Device work enqueued by the op itself: with CUDA events, the calls that enqueued it
    /// (kernel launches, library calls, copies and fills); with CUPTI, the kernels, copies and
    /// fills that ran.
    pub launches: u32,
}

/// One kernel, memcpy or memset CUPTI reported (a `kernel`, `gpu_memcpy` or `gpu_memset`
/// event of Kineto's traces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuActivity {
    pub kind: GpuActivityKind,
    /// The kernel's symbol as CUPTI gives it (not demangled), or Kineto's name of a copy or
    /// fill (`Memcpy HtoD (Pinned -> Device)`, `Memset (Device)`).
    pub name: String,
    pub device: usize,
    /// CUPTI's context and stream ids (the trace's `tid` is the stream id).
    pub context: u32,
    pub stream: u64,
    /// Nanoseconds since the trace started, on the host's clock.
    pub start_ns: u64,
    pub duration_ns: u64,
    /// The correlation id of the CUDA call that launched it.
    pub correlation: u32,
    /// The id of the op that launched it ([`FunctionEvent::id`]), when one was open.
    pub external_id: Option<u64>,
    /// That op's index in the trace's events (None when it is not among them).
    pub event: Option<usize>,
    /// A kernel's grid and block dimensions, registers per thread and shared memory (static
    /// plus dynamic, bytes); zero for copies and fills.
    pub grid: [i32; 3],
    pub block: [i32; 3],
    pub registers_per_thread: u16,
    pub shared_memory: i32,
    /// Bytes a copy or fill moved; zero for kernels.
    pub bytes: u64,
}

/// A CUDA driver or runtime call that launched device work (`cuLaunchKernel`,
/// `cudaLaunchKernel`, `cuMemcpyHtoDAsync`, ...), as CUPTI recorded it; Kineto's
/// `cuda_driver` and `cuda_runtime` trace events. It carries the correlation id of the work it
/// launched, which is how trace tools tie a kernel to the host.
#[derive(Debug, Clone)]
pub struct CudaApiCall {
    /// The call's name as CUPTI gives it (a runtime call without its `_v` suffix).
    pub name: String,
    /// A driver call, else a runtime call.
    pub driver: bool,
    /// The profiler's number for the host thread that made it (the op's thread).
    pub thread: u64,
    /// Nanoseconds since the trace started, on the host's clock.
    pub start_ns: u64,
    pub duration_ns: u64,
    /// The correlation id of the call and of the work it launched.
    pub correlation: u32,
    /// The id of the op it was made in ([`FunctionEvent::id`]) and its index in the events.
    pub external_id: u64,
    pub event: usize,
}

/// One recorded op or range (`torch.autograd.profiler_util.FunctionEvent`).
#[derive(Debug, Clone)]
pub struct FunctionEvent {
    /// Unique in the process; also the correlation id linking a launch to its GPU interval.
    pub id: u64,
    pub name: String,
    pub kind: EventKind,
    /// The profiler's number for the host thread (as in the trace's `tid`).
    pub thread: u64,
    /// Nanoseconds since the trace started.
    pub start_ns: u64,
    pub end_ns: u64,
    /// The device of the op's inputs (None for ranges).
    pub device: Option<Device>,
    /// The op's input shapes, with `record_shapes`.
    pub input_shapes: Option<Vec<Vec<usize>>>,
    /// Index in the trace's events of the enclosing op or range.
    pub parent: Option<usize>,
    pub children: Vec<usize>,
    /// Net bytes of CPU / CUDA tensor storages made during the event, children included
    /// (`profile_memory`), and without them.
    pub cpu_memory_usage: i64,
    pub cuda_memory_usage: i64,
    pub self_cpu_memory_usage: i64,
    pub self_cuda_memory_usage: i64,
    /// The op's own GPU interval, when it enqueued device work while CUDA was profiled.
    pub gpu: Option<GpuInterval>,
    /// With CUPTI: indices in [`Trace::gpu_activities`] of the kernels, copies and fills the
    /// op launched itself (its children's are theirs).
    pub gpu_activities: Vec<usize>,
    /// GPU time of the event and its children, and of the event alone.
    pub cuda_time_total_ns: u64,
    pub self_cuda_time_total_ns: u64,
}

impl FunctionEvent {
    /// Wall-clock time between entering and leaving, children included.
    pub fn cpu_time_total_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }

    /// [`FunctionEvent::cpu_time_total_ns`] minus the children's (`self_cpu_time_total`).
    pub fn self_cpu_time_total_ns(&self, events: &[FunctionEvent]) -> u64 {
        let children: u64 = self.children.iter().map(|&c| events[c].cpu_time_total_ns()).sum();
        self.cpu_time_total_ns().saturating_sub(children)
    }
}

/// One saved cycle: its events and what the exports need.
#[derive(Debug, Clone)]
pub struct Trace {
    events: Vec<FunctionEvent>,
    threads: Vec<(u64, String)>,
    start_unix_us: f64,
    step_num: usize,
    profile_memory: bool,
    cuda: bool,
    timing: Option<CudaTimingSource>,
    cupti_unavailable: Option<String>,
    gpu_activities: Vec<GpuActivity>,
    api_calls: Vec<CudaApiCall>,
}

impl Trace {
    /// The recorded ops and ranges, ordered by start.
    pub fn events(&self) -> &[FunctionEvent] {
        &self.events
    }

    /// The step at which the cycle was saved (`prof.step_num` in a trace handler).
    pub fn step_num(&self) -> usize {
        self.step_num
    }

    /// How GPU time was measured, as a string: `"cupti"` or `"cuda events"` (the fallback of
    /// Note [Profiler timing and attribution]); None when CUDA was not profiled.
    pub fn gpu_timing(&self) -> Option<&'static str> {
        self.timing.map(CudaTimingSource::as_str)
    }

    /// How GPU time was measured; None when CUDA was not profiled.
    pub fn cuda_timing_source(&self) -> Option<CudaTimingSource> {
        self.timing
    }

    /// Why CUPTI was not used although preferred (library missing or refused, or collectives
    /// of several ranks on several GPUs of this process: Note [CUPTI and ranks as threads]),
    /// when CUDA events timed the cycle instead.
    pub fn cupti_unavailable(&self) -> Option<&str> {
        self.cupti_unavailable.as_deref()
    }

    /// With CUPTI, every kernel, memcpy and memset of the cycle, ordered by start.
    pub fn gpu_activities(&self) -> &[GpuActivity] {
        &self.gpu_activities
    }

    /// With CUPTI, the CUDA driver and runtime calls that launched the cycle's device work
    /// from inside a recorded op, ordered by start.
    pub fn cuda_api_calls(&self) -> &[CudaApiCall] {
        &self.api_calls
    }

    /// The events grouped by name (`key_averages()`).
    pub fn key_averages(&self) -> KeyAverages {
        KeyAverages::new(&self.events, false, self.profile_memory, self.cuda).with_source(self.gpu_timing())
    }

    /// The events grouped by name and input shapes (`key_averages(group_by_input_shape=True)`).
    pub fn key_averages_by_input_shape(&self) -> KeyAverages {
        KeyAverages::new(&self.events, true, self.profile_memory, self.cuda).with_source(self.gpu_timing())
    }

    /// The trace in Kineto's chrome-trace JSON.
    pub fn chrome_trace_json(&self) -> String {
        chrome_trace::to_json(self)
    }

    /// Writes [`Trace::chrome_trace_json`] to `path` (`export_chrome_trace`).
    pub fn export_chrome_trace(&self, path: impl AsRef<Path>) -> Result<()> {
        std::fs::write(path, self.chrome_trace_json())?;
        Ok(())
    }
}

/// A handler for [`ProfileBuilder::on_trace_ready`] writing each cycle's chrome trace into
/// `dir` as `<host>_<pid>.<milliseconds since the epoch>.pt.trace.json`, the names
/// `torch.profiler.tensorboard_trace_handler` gives (TensorBoard's profiler plugin reads
/// them). The folder is made when missing; a write error is printed, not raised.
pub fn tensorboard_trace_handler(dir: impl Into<PathBuf>) -> impl FnMut(&Trace) + Send + 'static {
    let dir = dir.into();
    let worker = format!("{}_{}", host_name(), std::process::id());
    move |trace: &Trace| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let path = dir.join(format!("{worker}.{ms}.pt.trace.json"));
        let written = std::fs::create_dir_all(&dir)
            .map_err(Error::from)
            .and_then(|_| trace.export_chrome_trace(&path));
        if let Err(e) = written {
            eprintln!("ember profiler: cannot write {}: {e}", path.display());
        }
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A named range around the ops it encloses (`torch.profiler.record_function`), ended when
/// the guard drops. Without a running profiler it records nothing and costs one relaxed
/// atomic load.
#[must_use = "the range ends when the guard drops"]
pub struct RecordFunction {
    _range: Option<OpenRange>,
}

/// Opens a [`RecordFunction`] range named `name`.
pub fn record_function(name: impl Into<Cow<'static, str>>) -> RecordFunction {
    if !recorder::is_recording() {
        return RecordFunction { _range: None };
    }
    RecordFunction {
        _range: OpenRange::open(name.into(), EventKind::UserAnnotation, None),
    }
}

/// The range the autograd engine opens around a node's backward rule while a profiler
/// records: named as PyTorch names the node (`log_softmax` → `LogSoftmaxBackward0`). The
/// engine reaches it through the hook a session registers when it begins
/// (`dispatch::observer::set_backward_range`), not by naming the profiler.
pub(crate) fn backward_range(op: &'static str, device: Device) -> Option<OpenRange> {
    if !recorder::is_recording() {
        return None;
    }
    OpenRange::open(
        Cow::Borrowed(backward_name(op)),
        EventKind::Backward,
        Some(device),
    )
}

/// `mul` → `MulBackward0`, made once per op name.
fn backward_name(op: &'static str) -> &'static str {
    static NAMES: Mutex<Option<HashMap<&'static str, &'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names
        .get_or_insert_with(HashMap::new)
        .entry(op)
        .or_insert_with(|| {
            let mut s: String = op
                .split(['_', ':', '.'])
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let mut c = p.chars();
                    c.next()
                        .map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
                })
                .collect();
            s.push_str("Backward0");
            // Bounded: one name per op of the policy table (and custom ops' names).
            Box::leak(s.into_boxed_str())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_pytorch() {
        use ProfilerAction::*;
        let s = schedule(1, 1, 2, 2);
        let got: Vec<_> = (0..10).map(|i| s.action(i)).collect();
        assert_eq!(
            got,
            [
                None,
                Warmup,
                Record,
                RecordAndSave,
                None,
                Warmup,
                Record,
                RecordAndSave,
                None,
                None
            ]
        );
        let s = schedule(0, 0, 1, 0).skip_first(2);
        assert_eq!(s.action(1), None);
        assert_eq!(s.action(2), RecordAndSave);
        assert_eq!(s.action(100), RecordAndSave);
    }

    /// Sessions begun and ended while other threads run ops and ranges: the current session
    /// is swapped under a lock while those threads read its id without one (Note
    /// [Concurrency checks] in `memory.rs`: this also runs under Miri). Every trace is well
    /// formed (each event inside its parent, on its parent's thread, listed among its
    /// children), and what the main thread did inside each session is in that session's trace.
    #[test]
    fn sessions_begun_and_ended_while_threads_run_ops_record_well_formed_traces() {
        use crate::{DType, Device, Tensor};
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        let (threads, cycles) = if cfg!(miri) { (3, 3) } else { (8, 30) };
        let work = || {
            let _r = record_function("stress");
            let x = Tensor::ones([4], DType::F32, Device::Cpu).unwrap();
            x.add(&x).unwrap().mul(&x).unwrap()
        };
        let done = AtomicBool::new(false);
        // Ranges each worker completed so far.
        let completed: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for c in &completed {
                let done = &done;
                s.spawn(move || {
                    while !done.load(Ordering::Relaxed) {
                        work();
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            for cycle in 0..cycles {
                // `profile()` without asking whether there is a GPU (Miri cannot load libcuda).
                let cpu_only = ProfileBuilder {
                    activities: vec![ProfilerActivity::Cpu],
                    record_shapes: false,
                    profile_memory: false,
                    emit_nvtx: false,
                    cuda_timing: CudaTimingSource::CudaEvents,
                    schedule: None,
                    on_trace_ready: None,
                };
                let mut p = cpu_only.start().unwrap();
                let begun: Vec<usize> = completed.iter().map(|c| c.load(Ordering::Relaxed)).collect();
                let mine = {
                    let _r = record_function(format!("main {cycle}"));
                    work()
                };
                assert_eq!(mine.to_vec::<f32>().unwrap(), [2.0; 4]);
                // Until a worker has completed two ranges since the session began: its second
                // began and ended inside the session.
                let waited = std::time::Instant::now();
                while !completed
                    .iter()
                    .zip(&begun)
                    .any(|(c, &b)| c.load(Ordering::Relaxed) >= b + 2)
                {
                    assert!(
                        waited.elapsed().as_secs() < 60,
                        "cycle {cycle}: no worker made progress in 60 s"
                    );
                    std::thread::yield_now();
                }
                p.stop().unwrap();
                let events = p.events();
                for (i, e) in events.iter().enumerate() {
                    assert!(
                        e.start_ns <= e.end_ns,
                        "cycle {cycle}: {} ends before it starts",
                        e.name
                    );
                    if let Some(pi) = e.parent {
                        let parent = &events[pi];
                        assert!(
                            parent.start_ns <= e.start_ns && e.end_ns <= parent.end_ns,
                            "cycle {cycle}: {} lies outside its parent {}",
                            e.name,
                            parent.name
                        );
                        assert_eq!(
                            parent.thread, e.thread,
                            "cycle {cycle}: {} on another thread than its parent",
                            e.name
                        );
                        assert!(
                            parent.children.contains(&i),
                            "cycle {cycle}: {} not among its parent's children",
                            e.name
                        );
                    }
                }
                let main = events
                    .iter()
                    .find(|e| e.name == format!("main {cycle}"))
                    .unwrap_or_else(|| panic!("cycle {cycle}: the main thread's range is missing"));
                let stress = &events[main.children[0]];
                assert_eq!(stress.name, "stress");
                let ops: Vec<&str> = stress.children.iter().map(|&c| events[c].name.as_str()).collect();
                assert!(
                    ops.contains(&"add") && ops.contains(&"mul"),
                    "cycle {cycle}: {ops:?}"
                );
                assert!(
                    events
                        .iter()
                        .all(|e| !e.name.starts_with("main ") || e.name == main.name),
                    "cycle {cycle}: another session's range leaked in"
                );
                let worker_ranges = events
                    .iter()
                    .filter(|e| e.name == "stress" && e.thread != main.thread)
                    .count();
                assert!(
                    worker_ranges > 0,
                    "cycle {cycle}: the session missed the other threads' ranges"
                );
            }
            done.store(true, Ordering::Relaxed);
        });
    }

    #[test]
    fn backward_names() {
        assert_eq!(backward_name("mul"), "MulBackward0");
        assert_eq!(backward_name("log_softmax"), "LogSoftmaxBackward0");
    }
}
