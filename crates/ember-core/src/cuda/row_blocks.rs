//! Weight gradients computed in row blocks, each block's completion an event, so that a
//! consumer can start moving the first rows of a large gradient while the GPU still computes
//! the last ones.
//!
//! Note [Gradients in row blocks]: DataParallel copies each replica's gradient back to the
//! first device once it is complete; the gradient of the first layer of an MLP is the last one
//! backward makes, so its copy waits for its whole GEMM and then runs with nothing left to
//! overlap (mlp_large's 200 MB first-layer weight: a 0.56 ms GEMM, then a 0.53 ms copy between
//! two H100s). A tensor registered with [`set_gradient_row_blocks`] has its weight gradient
//! (`linear`'s and `mm`'s `gᵀ @ x`, where the weight is the column-major operand, as in every
//! `linear`) computed as that many GEMMs over row blocks of one output, with an event recorded
//! on the stream after each; [`take_gradient_row_events`] hands the events of a gradient to
//! whoever holds it, who can then move block `i` once event `i` completes, while the later
//! blocks are still being computed. The blocks are rows of the weight (`[out, in]`, row-major),
//! so each is a contiguous range of the gradient.
//! - Only where nothing records the product (no `create_graph`), on a GPU, outside a CUDA graph
//!   capture, for float weights; elsewhere the gradient is one product, with no events.
//! - The events describe the storage the product wrote. A gradient that was then summed with
//!   another (a weight used twice) is another storage, and [`take_gradient_row_events`] finds
//!   no events for it: the consumer waits for the whole.
//! - Registration and events are held by weak handles: neither keeps a tensor or a gradient
//!   alive, and `.grad` can still take over the product's memory without a copy.
//!
//! Note [Copies in row blocks]: the mirror image, for the forward. DataParallel copies each
//! parameter to the other GPUs on every forward, and the replica's first product waited for
//! the whole copy (mlp_large's 200 MB first-layer weight: 0.64 ms of peer copies before the
//! second GPU could start, and on the first GPU's own stream, so it waited too).
//! [`super::comm::to_in_row_blocks`] copies a 2-D tensor in row blocks on a side stream of
//! the source's device, an event after each, and neither device's stream waits for it. The
//! copy is recorded here, and the dispatch point (`settle_copies`, every op's step 1b) makes
//! any op that takes the copy or its source wait for the whole copy first, with three
//! exceptions: views (they read no element; the ops on them wait), another copy of the
//! source (reads only), and `linear` with either as its weight. `linear` on the source only
//! reads it; `linear` on the copy takes its events ([`take_arrivals`]) before any other op
//! touches it and computes each block of its output's columns (rows of the weight) after that
//! block's event, so the product runs while the later rows travel. Each side is recorded once
//! and forgotten once waited for, or when its storage is gone.
//! - The copy's memory comes from the pool of a side stream of the target that waits for the
//!   whole copy, so it is not handed out again before the copy has written it.
//! - Only ops that pass the dispatch point are ordered, and host reads (`to_vec`, `item`):
//!   other code reading a storage behind it (none in ember outside the ops themselves) would
//!   have to wait itself.
//!
//! Note [Arrivals in row blocks]: the same ordering for a tensor written in place in row
//! blocks by another stream, such as a gradient that DistributedDataParallel all-reduces block
//! by block (Note [DDP row blocks] in ember-distributed): [`arriving_in_row_blocks`] records it
//! as the target of a copy with no source. Every op through the dispatch point that takes it
//! waits for the whole (so does a host read), except views and the fused Adam step, which
//! takes the blocks' events: one launch over the parameters whose gradients are complete, then,
//! in the order the arrivals were handed on, each block's rows after its event (tensors that
//! arrive whole one after another share a launch), so the optimizer step of the first rows
//! runs while the last ones are still being all-reduced. The fused SGD step waits for the
//! whole. Every arrival is taken once: whoever waits for it or takes it removes it.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::storage::{StorageRef, WeakStorageRef};
use crate::{Device, Error, Result, Tensor};

use super::Event;

/// Completion of some rows of a gradient computed in row blocks.
#[derive(Debug)]
pub struct RowBlockEvent {
    /// The rows of the gradient (dim 0 of the weight) this block wrote.
    pub rows: Range<usize>,
    /// Recorded on the computing stream after the block's product.
    pub event: Event,
}

/// Tensors registered, with their block counts.
static REQUESTS: Mutex<Vec<(WeakStorageRef, usize)>> = Mutex::new(Vec::new());
/// Whether `REQUESTS` may hold a live entry: the check on every weight gradient is one load
/// while no one registered.
static ANY_REQUEST: AtomicBool = AtomicBool::new(false);
/// Gradients computed in blocks, not yet taken.
static EVENTS: Mutex<Vec<(WeakStorageRef, Vec<RowBlockEvent>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Computes the gradient of `weight` (a 2-D tensor on a GPU) in `blocks` row blocks from now
/// on (Note [Gradients in row blocks]); `blocks` of 1 keeps the product whole with one event
/// after it (its consumer starts once it is written, not once backward reaches the consumer);
/// 0 turns it off.
pub fn set_gradient_row_blocks(weight: &Tensor, blocks: usize) -> Result<()> {
    if !matches!(weight.device(), Device::Cuda(_)) || weight.rank() != 2 {
        return Err(Error::invalid(
            "set_gradient_row_blocks",
            format!(
                "expected a 2-D weight on a GPU, got a {}-D tensor on {}",
                weight.rank(),
                weight.device()
            ),
        ));
    }
    let mut requests = lock(&REQUESTS);
    requests.retain(|(w, _)| !w.is_dead() && !w.is(weight.storage()));
    if blocks > 0 {
        requests.push((weight.storage().downgrade(), blocks));
    }
    ANY_REQUEST.store(!requests.is_empty(), Ordering::Relaxed);
    Ok(())
}

/// The row ranges a gradient of `rows` rows is computed in with `blocks` blocks: about
/// `rows / blocks` rows each, a multiple of 64 (so that every block starts as aligned as the
/// whole), the last one shorter.
pub fn row_block_ranges(rows: usize, blocks: usize) -> Vec<Range<usize>> {
    let step = rows.div_ceil(blocks.max(1)).next_multiple_of(64).max(64);
    (0..rows)
        .step_by(step)
        .map(|r0| r0..(r0 + step).min(rows))
        .collect()
}

/// The block count registered for the tensor whose storage `weight` views. Registrations of
/// tensors that are gone are dropped here too, so that once none is left the check is one
/// load again.
pub(crate) fn requested(weight: &StorageRef) -> Option<usize> {
    if !ANY_REQUEST.load(Ordering::Relaxed) {
        return None;
    }
    let mut requests = lock(&REQUESTS);
    requests.retain(|(w, _)| !w.is_dead());
    ANY_REQUEST.store(!requests.is_empty(), Ordering::Relaxed);
    requests.iter().find(|(w, _)| w.is(weight)).map(|&(_, b)| b)
}

/// Keeps the events of a gradient just computed in blocks into `grad`.
pub(crate) fn record(grad: &StorageRef, events: Vec<RowBlockEvent>) {
    let mut kept = lock(&EVENTS);
    kept.retain(|(w, _)| !w.is_dead());
    kept.push((grad.downgrade(), events));
}

/// The events of `grad`'s row blocks, when `grad` is (a view of) the storage a blocked weight
/// gradient was computed into and nothing took them before; they cover the whole storage.
pub fn take_gradient_row_events(grad: &Tensor) -> Option<Vec<RowBlockEvent>> {
    let mut kept = lock(&EVENTS);
    let i = kept.iter().position(|(w, _)| w.is(grad.storage()))?;
    Some(kept.swap_remove(i).1)
}

// ---------------------------------------------------------------------------------------------
// Copies in flight (Note [Copies in row blocks]).

/// Which side of a copy in row blocks a storage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The copy's target: its rows are valid once their block's event has completed.
    Target,
    /// The copy's source: read by the copy until its last event has completed.
    Source,
}

/// A copy in row blocks still in flight, seen from one side: the storage, its side, its
/// device and the copy's block events (the last one completes after all the others: one
/// stream records them all), and for an arrival the order it was recorded in.
struct InFlight {
    storage: WeakStorageRef,
    side: Side,
    device: usize,
    blocks: Vec<RowBlockEvent>,
    order: u64,
}

static IN_FLIGHT: Mutex<Vec<InFlight>> = Mutex::new(Vec::new());
/// Whether `IN_FLIGHT` may hold an entry: the dispatch point's check is one load otherwise.
static ANY_IN_FLIGHT: AtomicBool = AtomicBool::new(false);
/// The next arrival's order (Note [Arrivals in row blocks]).
static NEXT_ORDER: AtomicU64 = AtomicU64::new(0);

/// Adds `entries` to the copies in flight.
fn push_in_flight(entries: impl IntoIterator<Item = InFlight>) {
    let mut in_flight = lock(&IN_FLIGHT);
    in_flight.retain(|f| !f.storage.is_dead());
    in_flight.extend(entries);
    ANY_IN_FLIGHT.store(true, Ordering::Relaxed);
}

/// Records a copy in row blocks from `source` (on GPU `from`) into `target` (on GPU `to`),
/// whose blocks are done at `events` and the whole at `done`, all recorded on one stream.
pub(crate) fn record_copy(
    (source, from): (&StorageRef, usize),
    (target, to): (&StorageRef, usize),
    events: Vec<RowBlockEvent>,
    done: Event,
) {
    let rows = events.first().map_or(0, |b| b.rows.start)..events.last().map_or(0, |b| b.rows.end);
    push_in_flight([
        InFlight {
            storage: source.downgrade(),
            side: Side::Source,
            device: from,
            blocks: vec![RowBlockEvent { rows, event: done }],
            order: 0,
        },
        InFlight {
            storage: target.downgrade(),
            side: Side::Target,
            device: to,
            blocks: events,
            order: 0,
        },
    ]);
}

/// The dispatch point's step 1b (Note [Copies in row blocks]): every input that is the source
/// or the target of a copy in row blocks still in flight makes the current stream of its
/// device wait for the whole copy, unless `allowed(i, is_source)` says the op uses input `i`
/// as the copy allows (reading a source; `linear` consuming a target block by block itself).
pub(crate) fn settle(inputs: &[&Tensor], allowed: impl Fn(usize, bool) -> bool) -> Result<()> {
    if !ANY_IN_FLIGHT.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut in_flight = lock(&IN_FLIGHT);
    in_flight.retain(|f| !f.storage.is_dead());
    for (i, t) in inputs.iter().enumerate() {
        let waits = |f: &InFlight| f.storage.is(t.storage()) && !allowed(i, f.side == Side::Source);
        while let Some(at) = in_flight.iter().position(waits) {
            let f = in_flight.swap_remove(at);
            wait_for(Device::Cuda(f.device), &f.blocks)?;
        }
    }
    ANY_IN_FLIGHT.store(!in_flight.is_empty(), Ordering::Relaxed);
    Ok(())
}

/// Hands `t` on as arriving in row blocks (Note [Arrivals in row blocks]): the rows (indices
/// of dim 0) of each block of `blocks` are written by the time its event completes, the
/// events recorded in block order on one stream. `t` must be a dense tensor of at least one
/// dimension on a GPU, from the start of its storage (a gradient), and the blocks must
/// tile its rows in order. Arrivals are taken in the order they were handed on.
pub fn arriving_in_row_blocks(t: &Tensor, blocks: Vec<RowBlockEvent>) -> Result<()> {
    let Device::Cuda(device) = t.device() else {
        return Err(Error::invalid(
            "arriving_in_row_blocks",
            format!("expected a tensor on a GPU, got one on {}", t.device()),
        ));
    };
    let rows = t.dims().first().copied().unwrap_or(0);
    let tiled = blocks.first().map_or(rows == 0, |b| b.rows.start == 0)
        && blocks.windows(2).all(|w| w[0].rows.end == w[1].rows.start)
        && blocks.last().map_or(true, |b| b.rows.end == rows);
    if t.rank() == 0 || !t.is_contiguous() || t.storage_offset() != 0 || !tiled {
        return Err(Error::invalid(
            "arriving_in_row_blocks",
            format!(
                "expected a dense tensor of at least one dimension from the start of its storage and blocks that tile its {rows} rows in order, \
                 got dims {:?} at offset {} and blocks {:?}",
                t.dims(),
                t.storage_offset(),
                blocks.iter().map(|b| b.rows.clone()).collect::<Vec<_>>()
            ),
        ));
    }
    let order = NEXT_ORDER.fetch_add(blocks.len() as u64, Ordering::Relaxed);
    push_in_flight([InFlight {
        storage: t.storage().downgrade(),
        side: Side::Target,
        device,
        blocks,
        order,
    }]);
    Ok(())
}

/// One block of a tensor arriving in row blocks, taken by its reader: a range of the tensor's
/// elements, the event after which they are written, and the block's place in the order
/// arrivals were handed on.
#[derive(Debug)]
pub struct ArrivingElements {
    pub elements: Range<usize>,
    pub event: Event,
    pub order: u64,
}

/// The blocks of `t`, arriving in row blocks, taken (the caller orders its reads of each range
/// after its event); `None` when nothing arrives into `t`'s storage. When `t` is not the whole
/// tensor that arrives (a view of part of it), the current stream waits for every block
/// instead and `None` is returned.
pub(crate) fn take_arriving_elements(t: &Tensor) -> Result<Option<Vec<ArrivingElements>>> {
    let Some((blocks, order)) = take_target(t.storage()) else {
        return Ok(None);
    };
    let whole = t.rank() >= 1 && t.is_contiguous() && t.storage_offset() == 0;
    let rows = blocks.last().map_or(0, |b| b.rows.end);
    if !whole || t.dims()[0] != rows || rows == 0 {
        wait_for(t.device(), &blocks)?;
        return Ok(None);
    }
    let row_len = t.numel() / rows;
    Ok(Some(
        blocks
            .into_iter()
            .zip(order..)
            .map(|(b, order)| ArrivingElements {
                elements: b.rows.start * row_len..b.rows.end * row_len,
                event: b.event,
                order,
            })
            .collect(),
    ))
}

/// Whether a copy or an arrival in row blocks may be in flight (one load): callers that gather
/// operands for [`settle`] skip the gathering otherwise.
pub(crate) fn any_in_flight() -> bool {
    ANY_IN_FLIGHT.load(Ordering::Relaxed)
}

/// Orders the current stream after any copy or arrival in flight into or out of `t`'s
/// storage, before the host reads it.
pub(crate) fn settle_read(t: &Tensor) -> Result<()> {
    settle(&[t], |_, _| false)
}

/// The block events of a copy in flight into `target`, taken (the caller now orders its reads
/// after them); `None` when no copy into it is in flight.
pub(crate) fn take_arrivals(target: &StorageRef) -> Option<Vec<RowBlockEvent>> {
    take_target(target).map(|(blocks, _)| blocks)
}

/// [`take_arrivals`] with the arrival's order.
fn take_target(target: &StorageRef) -> Option<(Vec<RowBlockEvent>, u64)> {
    if !ANY_IN_FLIGHT.load(Ordering::Relaxed) {
        return None;
    }
    let mut in_flight = lock(&IN_FLIGHT);
    in_flight.retain(|f| !f.storage.is_dead());
    let at = in_flight
        .iter()
        .position(|f| f.side == Side::Target && f.storage.is(target))?;
    let f = in_flight.swap_remove(at);
    ANY_IN_FLIGHT.store(!in_flight.is_empty(), Ordering::Relaxed);
    Some((f.blocks, f.order))
}

/// Orders the current stream of `device` after every one of `events`.
pub(crate) fn wait_for_events<'e>(device: Device, events: impl Iterator<Item = &'e Event>) -> Result<()> {
    if let Device::Cuda(d) = device {
        let stream = super::stream::current_stream(d)?;
        for e in events {
            stream.wait_event(e)?;
        }
    }
    Ok(())
}

/// Orders the current stream of `device` after all of `blocks` (the last one completes last).
pub(crate) fn wait_for(device: Device, blocks: &[RowBlockEvent]) -> Result<()> {
    match (device, blocks.last()) {
        (Device::Cuda(d), Some(last)) => super::stream::current_stream(d)?.wait_event(&last.event),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::row_block_ranges;

    #[test]
    fn row_blocks_tile_the_rows_in_multiples_of_64() {
        assert_eq!(
            row_block_ranges(5000, 4),
            [0..1280, 1280..2560, 2560..3840, 3840..5000]
        );
        assert_eq!(row_block_ranges(100, 4), [0..64, 64..100]);
        assert_eq!(row_block_ranges(64, 1), [0..64]);
        assert_eq!(row_block_ranges(0, 4), []);
    }
}
