//! Step 4 of the dispatch point: observers that see every op enter and leave (the profiler's
//! and NVTX's entry point, and tests' way to count ops).
//!
//! Observers are process-wide, as PyTorch's profiler records every thread: each event carries
//! the thread it ran on, and an observer that wants one thread filters by it. Events nest: an
//! op called inside another (a composite op's inner ops, the ops of a backward rule) reports
//! `depth` one more than its caller.
//!
//! Cost: with no observer installed, entering an op is one relaxed atomic load and nothing is
//! allocated or timed; observers are called only while at least one is installed.

use super::policy::Op;
use crate::{Device, Tensor};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::ThreadId;
use std::time::Instant;

/// An op entering the dispatch point, after autocast and promotion (its inputs are what the
/// backend receives).
pub struct OpEnter<'a> {
    /// This op call's number, unique in the process while observers are installed (the same
    /// in the matching [`OpExit`]): the profiler's correlation id.
    pub id: u64,
    pub op: &'static Op,
    pub device: Device,
    pub inputs: &'a [Tensor],
    /// Ops already open on this thread when this one entered.
    pub depth: usize,
    pub thread: ThreadId,
    /// When the op entered.
    pub start: Instant,
}

/// An op leaving the dispatch point (successfully or with an error).
pub struct OpExit {
    /// The number its [`OpEnter`] carried.
    pub id: u64,
    pub op: &'static Op,
    pub device: Device,
    pub depth: usize,
    pub thread: ThreadId,
    pub start: Instant,
    pub end: Instant,
}

/// Sees ops pass the dispatch point. Called on the thread that runs the op, so keep it short.
pub trait Observer: Send + Sync {
    fn on_enter(&self, event: &OpEnter<'_>);
    fn on_exit(&self, event: &OpExit);
}

type Observers = Arc<[(u64, Arc<dyn Observer>)]>;

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static OBSERVERS: RwLock<Option<Observers>> = RwLock::new(None);
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);
/// Numbers op calls while observed (taken only on the observed path).
static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn observers() -> Option<Observers> {
    OBSERVERS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Installs `observer` until the returned handle drops.
pub fn add_observer(observer: Arc<dyn Observer>) -> ObserverHandle {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) as u64;
    let mut list = OBSERVERS.write().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<(u64, Arc<dyn Observer>)> = list.as_deref().map(<[_]>::to_vec).unwrap_or_default();
    v.push((id, observer));
    ACTIVE.store(v.len(), Ordering::Relaxed);
    *list = Some(v.into());
    ObserverHandle { id }
}

/// Removes its observer when dropped.
#[must_use = "the observer is removed when the handle is dropped"]
pub struct ObserverHandle {
    id: u64,
}

impl Drop for ObserverHandle {
    fn drop(&mut self) {
        let mut list = OBSERVERS.write().unwrap_or_else(|e| e.into_inner());
        let v: Vec<(u64, Arc<dyn Observer>)> = list
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|(id, _)| *id != self.id)
            .cloned()
            .collect();
        ACTIVE.store(v.len(), Ordering::Relaxed);
        *list = (!v.is_empty()).then(|| v.into());
    }
}

/// True while at least one observer is installed.
#[inline]
pub fn is_active() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// An op's stay in the dispatch point: observers saw it enter and see it leave on drop.
pub struct Scope(Option<Box<Open>>);

struct Open {
    id: u64,
    observers: Observers,
    op: &'static Op,
    device: Device,
    depth: usize,
    thread: ThreadId,
    start: Instant,
}

impl Scope {
    /// Reports `op` entering with `inputs` to every observer (nothing when none is installed).
    #[inline]
    pub(crate) fn enter(op: &'static Op, device: Device, inputs: &[Tensor]) -> Scope {
        if !is_active() {
            return Scope(None);
        }
        Scope::enter_observed(op, device, inputs)
    }

    #[cold]
    fn enter_observed(op: &'static Op, device: Device, inputs: &[Tensor]) -> Scope {
        let Some(observers) = observers() else {
            return Scope(None);
        };
        let depth = DEPTH.with(|d| d.replace(d.get() + 1));
        let open = Open {
            id: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
            observers,
            op,
            device,
            depth,
            thread: std::thread::current().id(),
            start: Instant::now(),
        };
        let event = OpEnter {
            id: open.id,
            op,
            device,
            inputs,
            depth,
            thread: open.thread,
            start: open.start,
        };
        for (_, o) in open.observers.iter() {
            o.on_enter(&event);
        }
        Scope(Some(Box::new(open)))
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(open) = self.0.take() {
            DEPTH.with(|d| d.set(open.depth));
            let event = OpExit {
                id: open.id,
                op: open.op,
                device: open.device,
                depth: open.depth,
                thread: open.thread,
                start: open.start,
                end: Instant::now(),
            };
            for (_, o) in open.observers.iter() {
                o.on_exit(&event);
            }
        }
    }
}
