//! A resharded unit's gathered parameters between its forward and its backward (Note
//! [Reshard after forward] in `mod.rs`): freed, and filled again before the unit's backward
//! by the `fsdp_pre_backward` node over its output, or ahead of it by the unit after it (the
//! backward prefetch).
//!
//! Note [Backward prefetch]: backward reaches the units in the reverse order of their
//! forwards, so when backward reaches a unit's output, the unit whose forward ran just before
//! this one's is the next to need its parameters. The node fills its own unit's buffer, then
//! that one's (FSDP2's `backward_prefetch`, one unit ahead): on a GPU its all-gather then runs
//! on the all-gather stream while the compute stream runs this unit's backward (Note [FSDP
//! streams]). The compute stream waits for a prefetched gather only when the node of the unit
//! it is for fills that unit (finding it filled). It used to wait at once, as for a gather
//! needed now: before this unit's backward was queued, so this unit's backward could not
//! start before the prefetch ended, and the prefetch queued on the NCCL stream (one
//! collective at a time) behind the reduce-scatter of the unit after this one (fsdp_gpt2 at
//! N = 2 on two H200s: 20.33 ms a step before, 19.83 after; docs/benchmarks.md, session 53
//! runs 2 and 4, one run each). Each resharded forward links to the one before it on the
//! thread, back to the last forward outside any unit (the root's, which starts a new order); a
//! buffer already filled is not gathered again, so a prefetch that guessed wrong (a graph that
//! reaches units in another order) costs memory and a gather, never a value. Every rank runs
//! the same forwards and backward, so the ranks' gathers stay matched.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ember_core::Result;

use super::streams::Prefetched;

thread_local! {
    /// The last resharded unit's forward on this thread since the last forward outside any unit.
    static LAST: RefCell<Option<Weak<Resharded>>> = const { RefCell::new(None) };
}

/// A resharded unit's buffer between its forward and its backward.
pub(super) struct Resharded {
    /// Whether the buffer holds the gathered parameters (cleared when the backward node frees
    /// it after reduce-scattering).
    filled: Arc<AtomicBool>,
    /// Gathers the parameters into the buffer again: waited for at once with `true`, else a
    /// prefetch whose end (on a GPU) it hands back.
    refill: Box<dyn Fn(bool) -> Result<Option<Prefetched>> + Send + Sync>,
    /// The end of the prefetched gather of the buffer, not waited for yet.
    prefetched: Mutex<Option<Prefetched>>,
    /// The resharded unit whose forward ran just before this one's.
    previous: Option<Weak<Resharded>>,
}

impl Resharded {
    /// Forgets the order of the forwards so far: a forward outside any unit begins.
    pub(super) fn new_pass() {
        LAST.with(|l| *l.borrow_mut() = None);
    }

    /// After a unit's forward freed its buffer (`filled` now false): its place in the order,
    /// after the forward before it.
    pub(super) fn after_forward(
        filled: Arc<AtomicBool>,
        refill: impl Fn(bool) -> Result<Option<Prefetched>> + Send + Sync + 'static,
    ) -> Arc<Resharded> {
        LAST.with(|l| {
            let mut last = l.borrow_mut();
            let unit = Arc::new(Resharded {
                filled,
                refill: Box::new(refill),
                prefetched: Mutex::new(None),
                previous: last.take(),
            });
            *last = Some(Arc::downgrade(&unit));
            unit
        })
    }

    /// What the node over the unit's output runs when backward reaches it: fills this unit's
    /// buffer, then prefetches the previous unit's (Note [Backward prefetch]).
    pub(super) fn before_backward(&self) -> Result<()> {
        self.fill(true)?;
        match self.previous.as_ref().and_then(Weak::upgrade) {
            Some(previous) => previous.fill(false),
            None => Ok(()),
        }
    }

    /// Gathers into the buffer unless it holds the parameters already; with `now`, the
    /// parameters are used next, so a prefetched gather is waited for.
    fn fill(&self, now: bool) -> Result<()> {
        let mut prefetched = self.prefetched.lock().unwrap_or_else(|p| p.into_inner());
        if self.filled.swap(true, Ordering::AcqRel) {
            return match (now, prefetched.take()) {
                (true, Some(end)) => end.wait(),
                (_, end) => {
                    *prefetched = end;
                    Ok(())
                }
            };
        }
        match (self.refill)(now) {
            Ok(end) => {
                *prefetched = end;
                Ok(())
            }
            Err(e) => {
                self.filled.store(false, Ordering::Release);
                Err(e)
            }
        }
    }
}
