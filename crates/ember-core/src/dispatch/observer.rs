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
use super::tensor_impl::Tensor;
use crate::Device;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
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

/// A guard the autograd engine holds around a node's backward rule while something records
/// it: the range closes when the guard drops.
pub(crate) type BackwardRange = Box<dyn std::any::Any>;

/// Opens the range of a node's backward rule (named by its op) on a device, or `None` when
/// nothing records.
type BackwardRangeHook = fn(&'static str, Device) -> Option<BackwardRange>;

static BACKWARD_RANGE: OnceLock<BackwardRangeHook> = OnceLock::new();

/// Registers the hook that opens a range around each backward rule (the profiler's
/// `MulBackward0` rows), as the profiler registers its observer: the autograd engine calls it
/// here and never names the profiler. Once per process; later calls keep the first hook.
pub(crate) fn set_backward_range(hook: BackwardRangeHook) {
    let _ = BACKWARD_RANGE.set(hook);
}

/// The range of `node`'s backward rule on `device` while a registered hook records one: one
/// load when none was ever registered.
#[inline]
pub(crate) fn backward_range(node: &'static str, device: Device) -> Option<BackwardRange> {
    BACKWARD_RANGE.get().and_then(|hook| hook(node, device))
}

#[cfg(test)]
mod tests {
    //! The observer list is swapped under a lock while ops enter and leave on other threads,
    //! whose fast path reads only the `ACTIVE` count (Note [Concurrency checks] in
    //! `memory.rs`: these tests also run under Miri).
    use super::*;
    use crate::dispatch::policy;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    /// Counts the ops it sees and checks each one it saw enter leaves once, with its id.
    #[derive(Default)]
    struct Pairing {
        open: Mutex<HashSet<u64>>,
        enters: AtomicUsize,
        exits: AtomicUsize,
        unmatched: AtomicUsize,
    }

    impl Observer for Pairing {
        fn on_enter(&self, e: &OpEnter<'_>) {
            self.enters.fetch_add(1, Ordering::Relaxed);
            if !self.open.lock().unwrap().insert(e.id) {
                self.unmatched.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn on_exit(&self, e: &OpExit) {
            self.exits.fetch_add(1, Ordering::Relaxed);
            if !self.open.lock().unwrap().remove(&e.id) {
                self.unmatched.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn observers_added_and_removed_while_threads_run_ops_see_each_op_enter_and_leave() {
        let (threads, ops) = if cfg!(miri) { (3, 40) } else { (8, 20_000) };
        let done = AtomicBool::new(false);
        let mut seen = Vec::new();
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..ops {
                            let _outer = Scope::enter(&policy::ONE_HOT, Device::Cpu, &[]);
                            let _inner = Scope::enter(&policy::INDEX_ADD, Device::Cpu, &[]);
                        }
                        // Every scope closed: the thread's depth is back where it began.
                        DEPTH.with(|d| d.get())
                    })
                })
                .collect();
            let adder = s.spawn(|| {
                let mut seen = Vec::new();
                while !done.load(Ordering::Relaxed) || seen.is_empty() {
                    let o = Arc::new(Pairing::default());
                    let handle = add_observer(o.clone());
                    std::thread::yield_now();
                    drop(handle);
                    seen.push(o);
                }
                seen
            });
            for w in workers {
                assert_eq!(
                    w.join().unwrap(),
                    0,
                    "a thread's op depth after all its ops closed"
                );
            }
            done.store(true, Ordering::Relaxed);
            seen = adder.join().unwrap();
        });
        assert!(!seen.is_empty());
        for (i, o) in seen.iter().enumerate() {
            let (enters, exits) = (o.enters.load(Ordering::Relaxed), o.exits.load(Ordering::Relaxed));
            assert_eq!(enters, exits, "observer {i}: ops entered and left");
            assert_eq!(
                o.unmatched.load(Ordering::Relaxed),
                0,
                "observer {i}: an exit without its enter"
            );
            assert!(o.open.lock().unwrap().is_empty(), "observer {i}: ops still open");
        }
    }
}
