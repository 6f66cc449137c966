//! The all-gather stream of [`super::FSDPModule`]s on a GPU: FSDP2's implicit forward
//! prefetch, through stream order alone.
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
//!
//! The values are those of a gather on the compute stream: the same copies and collective,
//! in another order in time only. The CPU backend has no streams: units there gather in line.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use ember_core::cuda::{self, Event, Stream};
use ember_core::{Result, Tensor};

/// Gathered parameter sets ahead of the compute stream at once: the one computing and the
/// next one (Note [FSDP streams]).
const IN_FLIGHT: usize = 2;

/// One device's all-gather stream and the release events of the buffers gathered on it.
struct DeviceStreams {
    device: usize,
    all_gather: Stream,
    released: VecDeque<Event>,
}

thread_local! {
    static STREAMS: RefCell<Vec<DeviceStreams>> = const { RefCell::new(Vec::new()) };
    /// Unit forwards running on this thread (their modules' forwards, which nest).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `gather` (allocations, copies and the all-gather of one unit) with the all-gather
/// stream of GPU `device` as the current stream, and makes the compute stream (the current
/// stream before) wait for it; the result is marked used on the compute stream (Note [FSDP
/// streams]).
pub(super) fn gather_on_all_gather_stream(
    device: usize,
    gather: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let compute = cuda::current_stream(device)?;
    let all_gather = STREAMS.with(|s| -> Result<Stream> {
        let mut streams = s.borrow_mut();
        let at = match streams.iter().position(|d| d.device == device) {
            Some(at) => at,
            None => {
                streams.push(DeviceStreams {
                    device,
                    all_gather: Stream::new_on(device)?,
                    released: VecDeque::new(),
                });
                streams.len() - 1
            }
        };
        let d = &mut streams[at];
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
    compute.wait_stream(&all_gather)?;
    flat.record_stream(&compute)?;
    Ok(flat)
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
