//! The interface between process groups and the libraries that move the bytes: the
//! [`Backend`] trait, [`ReduceOp`], and the [`Work`] handle of an asynchronous operation.
//!
//! Note [Backend contract]: a backend serves one group of `size` processes, in which this
//! process has rank `rank` (group ranks, `0..size`). Each method *starts* an operation and
//! returns a [`Work`] at once; the operation reads its inputs and writes its outputs in place,
//! in the caller's tensors, by the time `Work::wait` returns. Operations of one group run in
//! the order they were issued (every rank must issue collectives in the same order, as in
//! PyTorch). Arguments are checked by [`crate::ProcessGroup`] before they reach a backend
//! (counts, shapes, dtypes, ranks in range), so a backend checks only what only it knows
//! (devices it supports). Every blocking step is bounded by the group's timeout, and a failure
//! (timeout, a peer that died) leaves the backend broken: that operation and every later one
//! fail with an error saying so, the way PyTorch aborts a communicator.
//!
//! A CPU backend completes its work on host threads ([`Work::wait`] blocks); the NCCL backend
//! ([`crate::nccl`]) enqueues on the group's communication stream and completes a `Work` by
//! making the caller's current stream wait on an event, so `wait` does not block the host
//! there. That is why `Work` wraps a trait object: each backend brings its own notion of done.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ember_core::{Error, Result, Tensor};

/// How a reduction combines the ranks' values (`torch.distributed.ReduceOp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group size (floating-point dtypes only).
    Avg,
    Product,
    Max,
    Min,
}

/// A collective or point-to-point operation's backend (`c10d::Backend`). See
/// Note [Backend contract] in this module: ranks are group ranks, every method starts the
/// operation and returns its [`Work`].
pub trait Backend: Send + Sync {
    /// The backend's name ("gloo", "nccl").
    fn name(&self) -> &'static str;

    /// This process's rank in the group.
    fn rank(&self) -> usize;

    /// The number of processes in the group.
    fn size(&self) -> usize;

    /// Reduces `tensor` across the group under `op`; every rank ends with the result.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work>;

    /// Copies `root`'s `tensor` into every other rank's `tensor`.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work>;

    /// Writes rank `i`'s `input` into `outputs[i]` on every rank (`outputs.len() == size`).
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work>;

    /// Writes the reduction over ranks of their `inputs[rank]` into `output`.
    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work>;

    /// Writes rank `i`'s `input` into the `i`-th of `size` equal consecutive blocks of
    /// `output` (`all_gather_into_tensor`; `output.numel() == size * input.numel()`, both
    /// contiguous, checked by the group). The default runs [`Backend::all_gather`] into views
    /// of `output`; a backend with a flat collective (NCCL) overrides it.
    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let outputs = flat_blocks(output, self.size())?;
        self.all_gather(&outputs, input)
    }

    /// Writes into `output` the reduction over ranks of their `input`'s block `rank` (of
    /// `size` equal consecutive blocks: `reduce_scatter_tensor`; `input.numel() == size *
    /// output.numel()`, both contiguous, checked by the group). The default runs
    /// [`Backend::reduce_scatter`] over views of `input`.
    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        let inputs = flat_blocks(input, self.size())?;
        self.reduce_scatter(output, &inputs, op)
    }

    /// Completes when every rank has reached it.
    fn barrier(&self) -> Result<Work>;

    /// Sends `tensor` to `dst`; messages between two ranks are matched in order and carry `tag`.
    fn send(&self, tensor: &Tensor, dst: usize, tag: u32) -> Result<Work>;

    /// Receives into `tensor` the next message from `src`, which must carry `tag`.
    fn recv(&self, tensor: &Tensor, src: usize, tag: u32) -> Result<Work>;

    /// Aborts: closes every connection so that pending and later operations fail at once, on
    /// this rank and on the peers waiting for it (`destroy_process_group`, `abort`).
    fn shutdown(&self);
}

/// `t` (contiguous) as `n` equal consecutive 1-d blocks: the per-rank views of the flat
/// collectives.
pub fn flat_blocks(t: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let flat = t.reshape(&[-1])?;
    let each = t.numel() / n.max(1);
    (0..n).map(|i| flat.narrow(0, i * each, each)).collect()
}

/// A backend's notion of a finished operation, behind [`Work`].
pub trait WorkHandle: Send + Sync {
    /// Blocks until the operation finished (bounded by the group timeout); its outcome.
    fn wait(&self) -> Result<()>;

    /// Whether the operation has finished, successfully or not, without waiting.
    fn is_completed(&self) -> bool;
}

/// The handle of an asynchronous operation (`torch.distributed.Work`): the outputs may be read
/// after [`Work::wait`] returned `Ok`.
#[derive(Clone)]
pub struct Work(Arc<dyn WorkHandle>);

impl Work {
    /// A handle over a backend's own completion.
    pub fn new(handle: Arc<dyn WorkHandle>) -> Work {
        Work(handle)
    }

    /// A handle that is already done with `outcome`.
    pub fn done(outcome: Result<()>) -> Work {
        let c = Completion::new();
        c.complete(outcome);
        Work(c)
    }

    /// Waits for the operation; its error if it failed (timeout, a dead peer, a broken group).
    pub fn wait(&self) -> Result<()> {
        self.0.wait()
    }

    /// Whether the operation has finished, successfully or not.
    pub fn is_completed(&self) -> bool {
        self.0.is_completed()
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work(completed={})", self.is_completed())
    }
}

/// A [`WorkHandle`] completed by a host thread: an outcome slot and a condition variable.
#[derive(Default)]
pub struct Completion {
    outcome: Mutex<Option<Result<()>>>,
    done: Condvar,
}

impl Completion {
    pub fn new() -> Arc<Completion> {
        Arc::new(Completion::default())
    }

    /// Records the outcome (the first one wins) and wakes the waiters.
    pub fn complete(&self, outcome: Result<()>) {
        let mut slot = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(outcome);
        }
        self.done.notify_all();
    }

    /// Waits at most `timeout`: `None` when not done by then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let slot = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        let (slot, _) = self
            .done
            .wait_timeout_while(slot, timeout, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        slot.clone()
    }
}

impl WorkHandle for Completion {
    fn wait(&self) -> Result<()> {
        let slot = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        let slot = self
            .done
            .wait_while(slot, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        slot.clone()
            .unwrap_or_else(|| Err(Error::invalid("Work::wait", "no outcome")))
    }

    fn is_completed(&self) -> bool {
        self.outcome.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
}

/// A completion that must be completed: dropped without an outcome (its job was discarded by
/// a shut-down or a panicking worker), it completes with an error, so no `wait` hangs.
pub struct Pending(pub Arc<Completion>);

impl Pending {
    pub fn complete(self, outcome: Result<()>) {
        self.0.complete(outcome);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.complete(Err(Error::invalid(
            "Work::wait",
            "the operation was dropped before it ran: its process group was destroyed",
        )));
    }
}
