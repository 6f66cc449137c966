//! The recording side of the profiler: one [`Session`] per recorded cycle, the per-thread
//! stack of open ops and ranges, the observer on the dispatch point, and the hook
//! `cuda::kernel_timing` calls before device work.
//!
//! Invariants: at most one session is current (`CURRENT`); entries on a thread's stack carry
//! the id of the session that opened them, and an entry of another session is never closed
//! into the current one (an op that entered before a session began, or leaves after it ended,
//! is dropped, as PyTorch drops ops that straddle a profiler's start or stop). Only the
//! session that opened an entry closes or drops it: an ended session's observer stays
//! installed while a range of it is open somewhere, and sees the next session's ops.

use super::{CudaApiCall, CudaTimingSource, EventKind, FunctionEvent, GpuActivity, GpuInterval};
use crate::cuda_backend::cupti::{self, ClockRef, Collected};
use crate::cuda_backend::kernel_timing::{self, TimingEvent};
use crate::dispatch::observer::{self, Observer, ObserverHandle, OpEnter, OpExit};
use crate::{memory, Device};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// What a session records.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    pub record_shapes: bool,
    pub profile_memory: bool,
    pub cuda: bool,
    /// The preferred way to time CUDA (CUPTI falls back to events when it cannot start).
    pub cuda_timing: CudaTimingSource,
    pub emit_nvtx: bool,
}

/// One range or op that finished while the session ran.
struct Finished {
    id: u64,
    parent: Option<u64>,
    name: Cow<'static, str>,
    kind: EventKind,
    thread: u64,
    start: Instant,
    end: Instant,
    device: Option<Device>,
    shapes: Option<Vec<Vec<usize>>>,
    memory: [i64; 2],
    gpu: Option<(Arc<TimingEvent>, TimingEvent)>,
    launches: u32,
}

/// One recorded cycle: what the observer and the ranges collect until [`Session::finish`].
pub(crate) struct Session {
    id: u64,
    pub(crate) options: Options,
    pub(crate) start: Instant,
    /// Microseconds since the Unix epoch at `start`.
    pub(crate) start_unix_us: f64,
    finished: Mutex<Vec<Finished>>,
    /// Per device: the first timing event of the session and when the host recorded it.
    gpu_refs: Mutex<HashMap<usize, (TimingEvent, Instant)>>,
    /// Threads seen: (profiler thread number, name).
    threads: Mutex<Vec<(u64, String)>>,
    /// How CUDA is timed in this session (None when it is not), and why CUPTI is not used
    /// when it was preferred.
    pub(crate) timing: Option<CudaTimingSource>,
    pub(crate) cupti_unavailable: Option<String>,
    /// With CUPTI: the clock reference of its timestamps.
    cupti_clock: Option<ClockRef>,
    _observer: Option<ObserverHandle>,
}

static CURRENT: RwLock<Option<Arc<Session>>> = RwLock::new(None);
/// The current session's id, 0 when none: the one load [`super::record_function`] costs
/// without a profiler.
static CURRENT_ID: AtomicU64 = AtomicU64::new(0);
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);
static NEXT_RECORD: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// An op or range open on this thread.
struct Open {
    session: u64,
    /// The observer's call id for ops, the record id for ranges: what closing matches on.
    key: u64,
    id: u64,
    name: Cow<'static, str>,
    kind: EventKind,
    start: Instant,
    device: Option<Device>,
    shapes: Option<Vec<Vec<usize>>>,
    memory: [i64; 2],
    gpu_start: Option<Arc<TimingEvent>>,
    launches: u32,
    /// True once the entry's id is pushed as CUPTI's external correlation id on this thread
    /// (popped when the entry leaves the stack).
    cupti_pushed: bool,
}

impl Open {
    /// Takes the entry off CUPTI's correlation stack if it was pushed.
    fn release(&mut self) {
        if std::mem::take(&mut self.cupti_pushed) {
            cupti::pop();
        }
    }
}

thread_local! {
    static STACK: RefCell<Vec<Open>> = const { RefCell::new(Vec::new()) };
    /// The devices this thread launched work on while a session timed CUDA: (the session's
    /// id, a bit per device index, capped at 63). Note [Profiler waits].
    static LAUNCHED: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// This thread's number in traces (0 until first recorded) and the session it was last
    /// announced to.
    static THREAD: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

fn current() -> Option<Arc<Session>> {
    CURRENT.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// True while a session records.
#[inline]
pub(crate) fn is_recording() -> bool {
    CURRENT_ID.load(Ordering::Relaxed) != 0
}

impl Session {
    /// Starts a session and makes it current (the caller made sure none is).
    pub(crate) fn begin(options: Options) -> Arc<Session> {
        let start = Instant::now();
        let start_unix_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_nanos() as f64 / 1e3);
        let mut session = Session {
            id: NEXT_SESSION.fetch_add(1, Ordering::Relaxed),
            options,
            start,
            start_unix_us,
            finished: Mutex::new(Vec::new()),
            gpu_refs: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            timing: None,
            cupti_unavailable: None,
            cupti_clock: None,
            _observer: None,
        };
        let recorder = Arc::new(Recorder {
            session: session.id,
            record_shapes: options.record_shapes,
        });
        session._observer = Some(observer::add_observer(recorder));
        observer::set_backward_range(|op, device| {
            super::backward_range(op, device).map(|r| Box::new(r) as observer::BackwardRange)
        });
        if options.profile_memory {
            memory::start_memory_profiling();
        }
        if options.cuda {
            session.timing = Some(CudaTimingSource::CudaEvents);
            if options.cuda_timing == CudaTimingSource::Cupti {
                match cupti::refusal().map_or_else(cupti::start, Err) {
                    Ok(clock) => {
                        session.timing = Some(CudaTimingSource::Cupti);
                        session.cupti_clock = Some(clock);
                    }
                    Err(reason) => session.cupti_unavailable = Some(reason),
                }
            }
            kernel_timing::start(on_device_work);
        }
        let session = Arc::new(session);
        *CURRENT.write().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        CURRENT_ID.store(session.id, Ordering::Relaxed);
        session
    }

    /// Stops recording and turns what was recorded into events (waiting for the GPU when CUDA
    /// was timed). Ops still open are left out.
    pub(crate) fn finish(self: Arc<Session>) -> Finish {
        {
            let mut cur = CURRENT.write().unwrap_or_else(|e| e.into_inner());
            if cur.as_ref().is_some_and(|s| s.id == self.id) {
                *cur = None;
                CURRENT_ID.store(0, Ordering::Relaxed);
            }
        }
        if self.options.profile_memory {
            memory::stop_memory_profiling();
        }
        if self.options.cuda {
            kernel_timing::stop();
        }
        if self.options.cuda {
            kernel_timing::wait_for(&self.devices_to_wait_for());
        }
        let collected = self.cupti_clock.map(|_| {
            // This thread's pushed ids come off before CUPTI stops (Note [CUPTI beside other
            // threads' CUDA work] in `cuda_backend/cupti.rs`); the entries stay open and push no more.
            STACK.with(|s| s.borrow_mut().iter_mut().rev().for_each(Open::release));
            cupti::stop()
        });
        let finished = std::mem::take(&mut *self.finished.lock().unwrap_or_else(|e| e.into_inner()));
        let refs = std::mem::take(&mut *self.gpu_refs.lock().unwrap_or_else(|e| e.into_inner()));
        let threads = self.threads.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut events = build_events(&self, finished, &refs);
        let (activities, api_calls) = match (collected, self.cupti_clock) {
            (Some(c), Some(clock)) => attribute(&mut events, c, |ns| clock.host_ns(ns, self.start)),
            _ => Default::default(),
        };
        Finish {
            events,
            activities,
            api_calls,
            threads,
        }
    }

    /// The devices the stopping thread waits for (Note [Profiler waits]): its current device
    /// and those it launched work on during the session.
    fn devices_to_wait_for(&self) -> Vec<usize> {
        let (session, launched) = LAUNCHED.with(Cell::get);
        let mask = if session == self.id { launched } else { 0 };
        let current = crate::cuda_backend::current_device();
        (0..64)
            .filter(|&d| d == current || mask & (1u64 << d) != 0)
            .collect()
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.start).as_nanos() as u64
    }

    fn push(&self, f: Finished) {
        self.finished.lock().unwrap_or_else(|e| e.into_inner()).push(f);
    }
}

/// What a finished session recorded.
pub(crate) struct Finish {
    pub events: Vec<FunctionEvent>,
    pub activities: Vec<GpuActivity>,
    pub api_calls: Vec<CudaApiCall>,
    pub threads: Vec<(u64, String)>,
}

/// Turns finished records into events: ordered by start, linked to parents and children, with
/// self times and memory, GPU intervals resolved against each device's reference event.
fn build_events(
    session: &Session,
    mut finished: Vec<Finished>,
    refs: &HashMap<usize, (TimingEvent, Instant)>,
) -> Vec<FunctionEvent> {
    finished.sort_by_key(|f| (f.start, std::cmp::Reverse(f.end)));
    let index: HashMap<u64, usize> = finished.iter().enumerate().map(|(i, f)| (f.id, i)).collect();
    let me = THREAD.with(Cell::get).0;
    let mut events: Vec<FunctionEvent> = finished
        .iter()
        .map(|f| {
            let gpu = f.gpu.as_ref().and_then(|(start, end)| {
                let (reference, host) = refs.get(&start.device())?;
                // Another thread's work is not waited for (Note [Profiler waits]).
                if f.thread != me && ![reference, &**start, end].iter().all(|e| e.is_complete()) {
                    return None;
                }
                let from_ref = reference.elapsed_ms(start).ok()?;
                let dur = start.elapsed_ms(end).ok()?;
                let ref_ns = session.ns(*host) as f64;
                Some(GpuInterval {
                    device: start.device(),
                    stream: start.stream,
                    start_ns: (ref_ns + from_ref as f64 * 1e6).max(session.ns(f.start) as f64) as u64,
                    duration_ns: (dur.max(0.0) as f64 * 1e6) as u64,
                    launches: f.launches,
                })
            });
            FunctionEvent {
                id: f.id,
                name: f.name.to_string(),
                kind: f.kind,
                thread: f.thread,
                start_ns: session.ns(f.start),
                end_ns: session.ns(f.end).max(session.ns(f.start)),
                device: f.device,
                input_shapes: f.shapes.clone(),
                parent: None,
                children: Vec::new(),
                cpu_memory_usage: f.memory[0],
                cuda_memory_usage: f.memory[1],
                self_cpu_memory_usage: f.memory[0],
                self_cuda_memory_usage: f.memory[1],
                gpu,
                gpu_activities: Vec::new(),
                cuda_time_total_ns: 0,
                self_cuda_time_total_ns: 0,
            }
        })
        .collect();
    for (i, f) in finished.iter().enumerate() {
        if let Some(&p) = f.parent.and_then(|p| index.get(&p)) {
            events[i].parent = Some(p);
            events[p].children.push(i);
        }
    }
    // Children start after their parents, so a reverse pass sees every child first.
    for i in (0..events.len()).rev() {
        let (mut cpu_mem, mut cuda_mem, mut cuda_ns) = (0i64, 0i64, 0u64);
        for &c in &events[i].children {
            cpu_mem += events[c].cpu_memory_usage;
            cuda_mem += events[c].cuda_memory_usage;
            cuda_ns += events[c].cuda_time_total_ns;
        }
        let e = &mut events[i];
        e.self_cpu_memory_usage = e.cpu_memory_usage - cpu_mem;
        e.self_cuda_memory_usage = e.cuda_memory_usage - cuda_mem;
        match &e.gpu {
            Some(g) => {
                e.cuda_time_total_ns = g.duration_ns.max(cuda_ns);
                e.self_cuda_time_total_ns = g.duration_ns.saturating_sub(cuda_ns);
            }
            None => e.cuda_time_total_ns = cuda_ns,
        }
    }
    events
}

/// Attributes CUPTI's activities to the events whose ids were pushed around the CUDA calls
/// that launched them (an activity's correlation id → the external id → the event), and sets
/// each event's CUDA times from them: its own activities' durations are its self CUDA time,
/// plus its children's totals its total (as PyTorch sums kernels). `to_host_ns` puts a CUPTI
/// timestamp on the trace's clock. Returns the activities ordered by start, and the driver and
/// runtime calls that launched them from inside an event (on that event's thread), ordered by
/// start.
pub(crate) fn attribute(
    events: &mut [FunctionEvent],
    collected: Collected,
    to_host_ns: impl Fn(u64) -> u64,
) -> (Vec<GpuActivity>, Vec<CudaApiCall>) {
    let index: HashMap<u64, usize> = events.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    let mut raw = collected.activities;
    raw.sort_by_key(|a| (a.raw.start, a.raw.end));
    let mut out = Vec::with_capacity(raw.len());
    for a in raw {
        let r = a.raw;
        let external_id = collected.external.get(&r.correlation).copied();
        let event = external_id.and_then(|id| index.get(&id).copied());
        if let Some(i) = event {
            events[i].gpu_activities.push(out.len());
        }
        out.push(GpuActivity {
            kind: r.kind,
            name: a.name.to_string(),
            device: r.device as usize,
            context: r.context,
            stream: r.stream as u64,
            start_ns: to_host_ns(r.start),
            duration_ns: r.end.saturating_sub(r.start),
            correlation: r.correlation,
            external_id,
            event,
            grid: r.grid,
            block: r.block,
            registers_per_thread: r.registers_per_thread,
            shared_memory: r.shared_memory,
            bytes: r.bytes,
        });
    }
    // Children start after their parents, so a reverse pass sees every child first.
    for i in (0..events.len()).rev() {
        let children: u64 = events[i]
            .children
            .iter()
            .map(|&c| events[c].cuda_time_total_ns)
            .sum();
        let e = &mut events[i];
        let own: u64 = e.gpu_activities.iter().map(|&a| out[a].duration_ns).sum();
        e.gpu = e.gpu_activities.first().map(|&first| {
            let start = e
                .gpu_activities
                .iter()
                .map(|&a| out[a].start_ns)
                .min()
                .unwrap_or(0);
            let end = e
                .gpu_activities
                .iter()
                .map(|&a| out[a].start_ns + out[a].duration_ns)
                .max()
                .unwrap_or(start);
            GpuInterval {
                device: out[first].device,
                stream: out[first].stream,
                start_ns: start,
                duration_ns: end - start,
                launches: e.gpu_activities.len() as u32,
            }
        });
        e.self_cuda_time_total_ns = own;
        e.cuda_time_total_ns = own + children;
    }
    let launched: std::collections::HashSet<u32> = out.iter().map(|a| a.correlation).collect();
    let mut calls: Vec<CudaApiCall> = collected
        .api
        .into_iter()
        .filter(|c| launched.contains(&c.correlation))
        .filter_map(|c| {
            let external_id = *collected.external.get(&c.correlation)?;
            let event = *index.get(&external_id)?;
            let name = collected.api_names.get(&(c.driver, c.cbid));
            Some(CudaApiCall {
                name: name.map_or_else(|| format!("CUDA call {}", c.cbid), |n| n.to_string()),
                driver: c.driver,
                thread: events[event].thread,
                start_ns: to_host_ns(c.start),
                duration_ns: c.end.saturating_sub(c.start),
                correlation: c.correlation,
                external_id,
                event,
            })
        })
        .collect();
    calls.sort_by_key(|c| (c.start_ns, c.correlation));
    (out, calls)
}

/// Notes that this thread launched work on `device` during session `id`.
fn note_launch(id: u64, device: usize) {
    LAUNCHED.with(|l| {
        let (session, mask) = l.get();
        let mask = if session == id { mask } else { 0 };
        l.set((id, mask | 1u64 << device.min(63)));
    });
}

/// This thread's number in the session's traces, announcing it (with its name) on first use.
fn thread_number(session: &Session) -> u64 {
    let (mut n, announced) = THREAD.with(Cell::get);
    if n == 0 {
        n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    }
    if announced != session.id {
        let name = std::thread::current()
            .name()
            .map_or_else(|| format!("thread {n}"), |s| format!("thread {n} ({s})"));
        session
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((n, name));
        THREAD.with(|t| t.set((n, session.id)));
    }
    n
}

fn memory_now(session: &Session) -> [i64; 2] {
    if session.options.profile_memory {
        memory::profiled_bytes()
    } else {
        [0, 0]
    }
}

/// Opens an entry on this thread's stack for the current session.
#[allow(clippy::too_many_arguments)]
fn open(
    session: &Session,
    key: Option<u64>,
    name: Cow<'static, str>,
    kind: EventKind,
    device: Option<Device>,
    shapes: Option<Vec<Vec<usize>>>,
) -> u64 {
    let id = NEXT_RECORD.fetch_add(1, Ordering::Relaxed);
    if session.options.emit_nvtx {
        crate::cuda::nvtx::range_push(&name);
    }
    let entry = Open {
        session: session.id,
        key: key.unwrap_or(id),
        id,
        name,
        kind,
        start: Instant::now(),
        device,
        shapes,
        memory: memory_now(session),
        gpu_start: None,
        launches: 0,
        cupti_pushed: false,
    };
    STACK.with(|s| s.borrow_mut().push(entry));
    id
}

/// Closes the entry `key` of this thread's stack (and any left open above it) into `session`.
fn close(session: &Session, key: u64, is_op: bool) {
    let end = Instant::now();
    let mut closed = Vec::new();
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        let Some(at) = s
            .iter()
            .rposition(|e| e.key == key && (e.kind == EventKind::Op) == is_op && e.session == session.id)
        else {
            return;
        };
        closed = s.split_off(at);
        // The parent: the nearest entry below of the same session.
        let parent = s.iter().rev().find(|e| e.session == session.id).map(|e| e.id);
        closed.reverse(); // innermost first
        let ids: Vec<u64> = closed.iter().map(|e| e.id).collect();
        for (i, e) in closed.iter_mut().enumerate() {
            // Entries above `key` were left open (a range guard dropped out of order): each
            // closes with its outer neighbour as parent.
            e.key = ids.get(i + 1).copied().or(parent).unwrap_or(0);
        }
    });
    for mut e in closed {
        if session.options.emit_nvtx {
            crate::cuda::nvtx::range_pop();
        }
        e.release();
        if e.session != session.id {
            continue;
        }
        let gpu = e.gpu_start.and_then(|start| {
            TimingEvent::record(start.device(), start.stream)
                .ok()
                .flatten()
                .map(|end| (start, end))
        });
        let memory = memory_now(session);
        let thread = thread_number(session);
        session.push(Finished {
            id: e.id,
            parent: (e.key != 0).then_some(e.key),
            name: e.name,
            kind: e.kind,
            thread,
            start: e.start,
            end,
            device: e.device,
            shapes: e.shapes,
            memory: [memory[0] - e.memory[0], memory[1] - e.memory[1]],
            gpu,
            launches: e.launches,
        });
    }
}

/// The observer a session installs on the dispatch point.
struct Recorder {
    session: u64,
    record_shapes: bool,
}

impl Observer for Recorder {
    fn on_enter(&self, event: &OpEnter<'_>) {
        let Some(session) = current().filter(|s| s.id == self.session) else {
            return;
        };
        let shapes = self
            .record_shapes
            .then(|| event.inputs.iter().map(|t| t.dims().to_vec()).collect());
        open(
            &session,
            Some(event.id),
            Cow::Borrowed(event.op.name),
            EventKind::Op,
            Some(event.device),
            shapes,
        );
    }

    fn on_exit(&self, event: &OpExit) {
        let Some(session) = current().filter(|s| s.id == self.session) else {
            // The session ended while the op ran: drop its entry, if it opened one. Every
            // installed observer sees every op, and this one stays installed while anything
            // holds its session (a range left open on some thread): the op's entry of the
            // session now current is not ours to drop.
            STACK.with(|s| {
                let mut s = s.borrow_mut();
                if let Some(at) = s
                    .iter()
                    .rposition(|e| e.kind == EventKind::Op && e.key == event.id && e.session == self.session)
                {
                    s.remove(at).release();
                }
            });
            return;
        };
        close(&session, event.id, true);
    }
}

/// A range open in the current session (a `record_function`, a backward node, a profiler
/// step); closed when dropped.
pub(crate) struct OpenRange {
    session: Arc<Session>,
    key: u64,
}

impl OpenRange {
    /// Opens `name` in the current session; None when no session records. A range given a
    /// CUDA `device` (a backward node, by its incoming gradient) is timed on the GPU like an op,
    /// so the kernels its body launches count as its own.
    pub(crate) fn open(
        name: Cow<'static, str>,
        kind: EventKind,
        device: Option<Device>,
    ) -> Option<OpenRange> {
        let session = current()?;
        let key = open(&session, None, name, kind, device, None);
        Some(OpenRange { session, key })
    }
}

impl Drop for OpenRange {
    fn drop(&mut self) {
        close(&self.session, self.key, false);
    }
}

/// The hook `cuda::kernel_timing::note_work` calls (registered at a session's start) before device work is enqueued on `stream`
/// while CUDA is timed (Note [Profiler timing and attribution]): with CUPTI, counts a launch
/// for the innermost open entry and pushes its id as CUPTI's correlation id if not yet done;
/// with CUDA events, counts a launch for the innermost open CUDA op and records a start event
/// for every open CUDA op that has none.
pub(crate) fn on_device_work(stream: u64) {
    let Some(session) = current().filter(|s| s.options.cuda) else {
        return;
    };
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if session.cupti_clock.is_some() {
            // CUPTI times the work: the innermost open entry (whatever its inputs' device: a
            // `to` from the host copies to a GPU) launched it. Its id goes on CUPTI's
            // correlation stack before its first launch, so every CUDA call it makes from here
            // is correlated to it.
            let Some(inner) = s.iter().rposition(|e| e.session == session.id) else {
                return;
            };
            let e = &mut s[inner];
            e.launches += 1;
            let device = match e.device {
                Some(Device::Cuda(d)) => d,
                _ => crate::cuda_backend::current_device(),
            };
            note_launch(session.id, device);
            if !e.cupti_pushed {
                e.cupti_pushed = cupti::push(e.id);
            }
            return;
        }
        let ours = |e: &Open| e.session == session.id && matches!(e.device, Some(Device::Cuda(_)));
        let Some(inner) = s.iter().rposition(|e| ours(e)) else {
            return;
        };
        s[inner].launches += 1;
        let Some(Device::Cuda(device)) = s[inner].device else {
            return;
        };
        note_launch(session.id, device);
        if s.iter().all(|e| !ours(e) || e.gpu_start.is_some()) {
            return;
        }
        {
            let mut refs = session.gpu_refs.lock().unwrap_or_else(|e| e.into_inner());
            if let std::collections::hash_map::Entry::Vacant(v) = refs.entry(device) {
                let host = Instant::now();
                if let Ok(Some(reference)) = TimingEvent::record(device, stream) {
                    v.insert((reference, host));
                }
            }
        }
        let Ok(Some(start)) = TimingEvent::record(device, stream) else {
            return;
        };
        let start = Arc::new(start);
        for e in s.iter_mut().filter(|e| ours(e) && e.gpu_start.is_none()) {
            if e.device == Some(Device::Cuda(device)) {
                e.gpu_start = Some(start.clone());
            }
        }
    });
}
