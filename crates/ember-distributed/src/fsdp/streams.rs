//! The all-gather and reduce-scatter streams of [`super::FSDPModule`]s on a GPU: FSDP2's
//! implicit forward prefetch and its reduce-scatter overlapped with backward, through stream
//! order alone.
//!
//! Note [FSDP streams]: on a GPU each unit's all-gather (the copy of the shards into the flat
//! input, cast to `param_dtype`, and the collective) runs on an all-gather stream of the
//! device, one per thread and device, not on the compute stream; the compute stream then waits
//! for it (an event, no host wait) before the unit's forward. The rules, after FSDP2's
//! `FSDPCommContext`:
//! - The all-gather stream waits for the compute stream only when a unit gathers outside any
//!   unit's forward (the root's forward, a unit used alone, a recomputation in backward): what
//!   the shards hold (the optimizer's last step) is then ordered before every gather. A unit
//!   gathering inside another's forward (a block under the root) does not wait, so its gather
//!   does not queue behind the compute stream's pending work: the host runs ahead of the GPU,
//!   issues block `i + 1`'s gather while block `i` computes, and the two overlap.
//! - The gathered buffers are allocated on the all-gather stream and used on the compute
//!   stream, so each is marked used there (`record_stream`): the caching allocator hands its
//!   memory out again only after the compute stream is done with it.
//! - At most [`IN_FLIGHT`] gathered buffers are ahead of the compute stream (FSDP2's limit):
//!   after each unit's forward is queued, an event on the compute stream marks its buffer
//!   released, and a gather waits for the release from [`IN_FLIGHT`] gathers before it, so a
//!   host far ahead of the GPU does not gather every block of a large model at once.
//! - A unit's gradient is reduce-scattered on a reduce-scatter stream, after the compute
//!   stream's work so far, and this rank's rows are accumulated into the shards' `.grad`
//!   there (FSDP2's post-reduce on its reduce-scatter stream): the next unit's backward runs
//!   on meanwhile. The backward node hands autograd no gradient for the shards, so nothing on
//!   the compute stream reads them before its wait for the reduce-scatter stream, a final
//!   callback of the backward pass (`autograd::queue_callback`: the pass that ran the node,
//!   the inner one when the unit runs inside a checkpoint). Before that wait, `.grad` is set
//!   on the host but not computed on the device: a post-accumulate-grad hook of a shard that
//!   launches work reading it (an optimizer stepping in backward) must wait for the pass to
//!   end. The gradient buffers live on the side stream and are marked used on the compute
//!   stream, and the other way round.
//!
//! The values are those of collectives on the compute stream: the same copies, collectives
//! and additions, in another order in time only. The CPU backend has no streams: units there
//! gather and reduce in line, and hand autograd the shards' gradients.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use ember_core::cuda::{self, Event, Stream};
use ember_core::{autograd, Result, Tensor};

/// Gathered parameter sets ahead of the compute stream at once: the one computing and the
/// next one (Note [FSDP streams]).
const IN_FLIGHT: usize = 2;

/// One device's all-gather stream and the release events of the buffers gathered on it, and
/// its reduce-scatter stream.
struct DeviceStreams {
    device: usize,
    all_gather: Stream,
    released: VecDeque<Event>,
    reduce_scatter: Stream,
}

thread_local! {
    static STREAMS: RefCell<Vec<DeviceStreams>> = const { RefCell::new(Vec::new()) };
    /// Unit forwards running on this thread (their modules' forwards, which nest).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` on this thread's streams of GPU `device`, made on first use.
fn with_streams<T>(device: usize, f: impl FnOnce(&mut DeviceStreams) -> Result<T>) -> Result<T> {
    STREAMS.with(|s| {
        let mut streams = s.borrow_mut();
        let at = match streams.iter().position(|d| d.device == device) {
            Some(at) => at,
            None => {
                streams.push(DeviceStreams {
                    device,
                    all_gather: Stream::new_on(device)?,
                    released: VecDeque::new(),
                    reduce_scatter: Stream::new_on(device)?,
                });
                streams.len() - 1
            }
        };
        f(&mut streams[at])
    })
}

/// Runs `reduce` (one unit's reduce-scatter and the accumulation of its rows into the shards'
/// `.grad`) with the reduce-scatter stream of GPU `device` as the current stream, after the
/// compute stream's work so far (`grad`, computed there, is marked used on the side stream);
/// `reduce` gets the side stream and the compute stream, to mark what it hands to each. The
/// compute stream waits for the side stream when the backward pass ends (a final callback per
/// reduction: a failed pass drops its callbacks, so no flag may outlive one), before anything
/// reads the gradients (Note [FSDP streams]).
pub(super) fn reduce_on_reduce_scatter_stream(
    device: usize,
    grad: &Tensor,
    reduce: impl FnOnce(&Stream, &Stream) -> Result<()>,
) -> Result<()> {
    let compute = cuda::current_stream(device)?;
    let side = with_streams(device, |d| Ok(d.reduce_scatter.clone()))?;
    side.wait_stream(&compute)?;
    grad.record_stream(&side)?;
    {
        let _side = cuda::stream(&side);
        reduce(&side, &compute)?;
    }
    let (waiting, waited) = (compute.clone(), side.clone());
    if autograd::queue_callback(move || waiting.wait_stream(&waited)).is_err() {
        // Not inside a backward pass: wait at once.
        compute.wait_stream(&side)?;
    }
    Ok(())
}

/// The end of a unit's gather that the compute stream has not waited for yet: a backward
/// prefetch (Note [Backward prefetch] in `reshard.rs`).
pub(super) struct Prefetched {
    device: usize,
    end: Event,
}

impl Prefetched {
    /// Makes the current stream of the gather's device wait for its end (no host wait).
    pub(super) fn wait(&self) -> Result<()> {
        cuda::current_stream(self.device)?.wait_event(&self.end)
    }
}

/// Runs `gather` (allocations, copies and the all-gather of one unit) with the all-gather
/// stream of GPU `device` as the current stream; the result is marked used on the compute
/// stream (the current stream before) (Note [FSDP streams]). With `now`, the compute stream
/// waits for the gather at once; otherwise its end is handed back, for the compute stream to
/// wait for just before the unit's backward (a prefetch: waited for at once, it would hold the
/// backward of the unit between, Note [Backward prefetch]).
pub(super) fn gather_on_all_gather_stream(
    device: usize,
    now: bool,
    gather: impl FnOnce() -> Result<Tensor>,
) -> Result<(Tensor, Option<Prefetched>)> {
    let compute = cuda::current_stream(device)?;
    let all_gather = with_streams(device, |d| {
        if DEPTH.with(Cell::get) == 0 {
            // Every release so far is before the compute stream's current point.
            d.all_gather.wait_stream(&compute)?;
            d.released.clear();
        }
        while d.released.len() >= IN_FLIGHT {
            let release = d.released.pop_front().expect("the queue is not empty");
            d.all_gather.wait_event(&release)?;
        }
        Ok(d.all_gather.clone())
    })?;
    let flat = {
        let _side = cuda::stream(&all_gather);
        gather()?
    };
    flat.record_stream(&compute)?;
    if now {
        compute.wait_stream(&all_gather)?;
        return Ok((flat, None));
    }
    let end = all_gather.record_event()?;
    Ok((flat, Some(Prefetched { device, end })))
}

/// Unit forwards running on this thread now: 0 outside any unit's forward.
pub(super) fn depth() -> usize {
    DEPTH.with(Cell::get)
}

/// One unit's forward on this thread (its module's forward runs inside it): units gathering
/// meanwhile are nested (Note [FSDP streams]). On a GPU, its end records the release of its
/// gathered buffer on the compute stream.
pub(super) struct UnitForward {
    device: Option<usize>,
}

impl UnitForward {
    /// Enters a unit's forward on `device` (`None`: the CPU).
    pub(super) fn enter(device: Option<usize>) -> UnitForward {
        DEPTH.with(|d| d.set(d.get() + 1));
        UnitForward { device }
    }

    /// Records the release of the unit's gathered buffer: the compute stream's point after the
    /// unit's forward was queued.
    pub(super) fn release(&self) -> Result<()> {
        let Some(device) = self.device else {
            return Ok(());
        };
        let event = cuda::current_stream(device)?.record_event()?;
        STREAMS.with(|s| {
            if let Some(d) = s.borrow_mut().iter_mut().find(|d| d.device == device) {
                d.released.push_back(event);
            }
        });
        Ok(())
    }
}

impl Drop for UnitForward {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}
