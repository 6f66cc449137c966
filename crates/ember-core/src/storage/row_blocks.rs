//! A storage's row-block state (a field of the storage, [`RowBlocks`]): weight gradients
//! computed in row blocks, each block's completion an event, so that a consumer can start
//! moving the first rows of a large gradient while the GPU still computes the last ones, and
//! copies and arrivals in row blocks still in flight. The events and the products in blocks
//! are the CUDA backend's (`cuda_backend/row_blocks.rs`, `cuda_backend/blas.rs`); the public
//! hooks on tensors are `torch.cuda`'s (`cuda/row_blocks.rs`), the dispatch point's waits
//! `dispatch/row_blocks.rs`'s. Above this layer the blocks pass as opaque values
//! ([`Arrivals`], taken and handed back), so the ops name no CUDA type.
//!
//! Note [Gradients in row blocks]: DataParallel copies each replica's gradient back to the
//! first device once it is complete; the gradient of the first layer of an MLP is the last one
//! backward makes, so its copy waits for its whole GEMM and then runs with nothing left to
//! overlap (mlp_large's 200 MB first-layer weight: a 0.56 ms GEMM, then a 0.53 ms copy between
//! two H100s). A tensor registered with `set_gradient_row_blocks` has its weight gradient
//! (`linear`'s and `mm`'s `gᵀ @ x`, where the weight is the column-major operand, as in every
//! `linear`) computed as that many GEMMs over row blocks of one output, with an event recorded
//! on the stream after each; `take_gradient_row_events` hands the events of a gradient to
//! whoever holds it, who can then move block `i` once event `i` completes, while the later
//! blocks are still being computed. The blocks are rows of the weight (`[out, in]`, row-major),
//! so each is a contiguous range of the gradient.
//! - Only where nothing records the product (no `create_graph`), on a GPU, outside a CUDA graph
//!   capture, for float weights; elsewhere the gradient is one product, with no events.
//! - The events describe the storage the product wrote. A gradient that was then summed with
//!   another (a weight used twice) is another storage, and `take_gradient_row_events` finds
//!   no events for it: the consumer waits for the whole.
//! - Registration and events are fields of the storage: neither keeps a tensor or a gradient
//!   alive, and `.grad` can still take over the product's memory without a copy.
//!
//! Note [Copies in row blocks]: the mirror image, for the forward. DataParallel copies each
//! parameter to the other GPUs on every forward, and the replica's first product waited for
//! the whole copy (mlp_large's 200 MB first-layer weight: 0.64 ms of peer copies before the
//! second GPU could start, and on the first GPU's own stream, so it waited too).
//! `cuda::comm::to_in_row_blocks` copies a 2-D tensor in row blocks on a side stream of
//! the source's device, an event after each, and neither device's stream waits for it. The
//! copy is recorded here, and the dispatch point (`settle_copies`, every op's step 1b) makes
//! any op that takes the copy or its source wait for the whole copy first, with three
//! exceptions: views (they read no element; the ops on them wait), another copy of the
//! source (reads only), and `linear` with either as its weight. `linear` on the source only
//! reads it; `linear` on the copy takes its events ([`StorageRef::take_arrivals`]) before any other op
//! touches it and computes each block of its output's columns (rows of the weight) after that
//! block's event, so the product runs while the later rows travel. Each side is recorded once
//! and forgotten once waited for, or with its storage.
//! - The copy's memory comes from the pool of a side stream of the target that waits for the
//!   whole copy, so it is not handed out again before the copy has written it.
//! - Only ops that pass the dispatch point are ordered, and host reads (`to_vec`, `item`):
//!   other code reading a storage behind it (none in ember outside the ops themselves) would
//!   have to wait itself.
//!
//! Note [Arrivals in row blocks]: the same ordering for a tensor written in place in row
//! blocks by another stream, such as a gradient that DistributedDataParallel all-reduces block
//! by block (Note [DDP row blocks] in ember-distributed): `arriving_in_row_blocks` records it
//! as the target of a copy with no source. Every op through the dispatch point that takes it
//! waits for the whole (so does a host read), except views and the fused Adam step, which
//! takes the blocks' events: one launch over the parameters whose gradients are complete, then,
//! in the order the arrivals were handed on, each block's rows after its event (tensors that
//! arrive whole one after another share a launch), so the optimizer step of the first rows
//! runs while the last ones are still being all-reduced. The fused SGD step waits for the
//! whole. Every arrival is taken once: whoever waits for it or takes it removes it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::StorageRef;
use crate::backend::Arrival;
use crate::cuda_backend::row_blocks::{wait_for, wait_for_events};
use crate::cuda_backend::{Event, RowBlockEvent};
use crate::layout::Layout;
use crate::{Device, Result};

/// One storage's row-block state, behind its lock.
#[derive(Debug, Default)]
pub(crate) struct RowBlocks {
    /// Blocks asked for this weight's gradient (`set_gradient_row_blocks`); 0: none.
    requested: usize,
    /// The events of this gradient, computed in blocks and not taken yet.
    events: Option<Vec<RowBlockEvent>>,
    /// Copies in row blocks in flight into or out of this storage, and arrivals into it.
    in_flight: Vec<InFlight>,
}

/// The row blocks of a weight still arriving, taken by the op that reads them block by block
/// (`linear`): it hands them to the product ([`Storage::matmul_bias_in_column_blocks`]) or,
/// on another path, [`Arrivals::wait`]s for them. What the blocks are is the backend's.
///
/// [`Storage::matmul_bias_in_column_blocks`]: super::Storage::matmul_bias_in_column_blocks
#[derive(Debug)]
pub(crate) struct Arrivals(pub(super) Vec<RowBlockEvent>);

impl Arrivals {
    /// Orders the current stream of `device` after every block (the last one completes last).
    pub(crate) fn wait(self, device: Device) -> Result<()> {
        wait_for(device, &self.0)
    }
}

/// Orders the current stream of `device` after every block of `arrivals`, taken from
/// gradients ([`StorageRef::take_arriving_elements`]) that nothing read block by block (the
/// fused step failed): whatever comes next waits for them.
pub(crate) fn release_arrivals(device: Device, arrivals: &[Vec<Arrival<Event>>]) -> Result<()> {
    arrivals
        .iter()
        .try_for_each(|blocks| wait_for_events(device, blocks.iter().map(|b| &b.event)))
}

/// Which side of a copy in row blocks a storage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The copy's target: its rows are valid once their block's event has completed.
    Target,
    /// The copy's source: read by the copy until its last event has completed.
    Source,
}

/// A copy in row blocks still in flight, seen from one side: its side, its device and the
/// copy's block events (the last one completes after all the others: one stream records them
/// all), and for an arrival the order it was recorded in.
#[derive(Debug)]
struct InFlight {
    side: Side,
    device: usize,
    blocks: Vec<RowBlockEvent>,
    order: u64,
}

/// Entries in flight over all live storages: the dispatch point's check is one load while
/// none is.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// The next arrival's order (Note [Arrivals in row blocks]).
static NEXT_ORDER: AtomicU64 = AtomicU64::new(0);

/// Whether a copy or an arrival in row blocks may be in flight (one load): callers that gather
/// operands for a settle skip the gathering otherwise.
pub(crate) fn any_in_flight() -> bool {
    IN_FLIGHT.load(Ordering::Relaxed) > 0
}

/// A storage's state going away with it: its entries in flight leave the count.
pub(super) fn forget(state: &mut RowBlocks) {
    if !state.in_flight.is_empty() {
        IN_FLIGHT.fetch_sub(state.in_flight.len(), Ordering::Relaxed);
    }
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
    source.push_in_flight(InFlight {
        side: Side::Source,
        device: from,
        blocks: vec![RowBlockEvent { rows, event: done }],
        order: 0,
    });
    target.push_in_flight(InFlight {
        side: Side::Target,
        device: to,
        blocks: events,
        order: 0,
    });
}

impl StorageRef {
    fn row_blocks(&self) -> std::sync::MutexGuard<'_, RowBlocks> {
        self.0.row_blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Computes this weight's gradient in `blocks` row blocks from now on (0: whole again).
    pub(crate) fn set_gradient_row_blocks(&self, blocks: usize) {
        self.row_blocks().requested = blocks;
    }

    /// The block count asked for this weight's gradient; `None` when none is asked or the
    /// calling thread's current stream is being captured into a CUDA graph (the gradient is
    /// then one product, Note [Gradients in row blocks]).
    pub(crate) fn requested_row_blocks(&self) -> Option<usize> {
        Some(self.row_blocks().requested)
            .filter(|&b| b > 0 && !crate::cuda_backend::is_current_stream_capturing())
    }

    /// Keeps the events of a gradient just computed in blocks into this storage.
    pub(crate) fn record_row_block_events(&self, events: Vec<RowBlockEvent>) {
        self.row_blocks().events = Some(events);
    }

    /// The events of this gradient's row blocks, taken; `None` when it was not computed in
    /// blocks or something took them before.
    pub(crate) fn take_row_block_events(&self) -> Option<Vec<RowBlockEvent>> {
        self.row_blocks().events.take()
    }

    fn push_in_flight(&self, entry: InFlight) {
        self.row_blocks().in_flight.push(entry);
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
    }

    /// Hands this storage on as arriving in row blocks (Note [Arrivals in row blocks]) on GPU
    /// `device`; the caller checked that `blocks` tile its rows in order.
    pub(crate) fn arriving_in_row_blocks(&self, device: usize, blocks: Vec<RowBlockEvent>) {
        let order = NEXT_ORDER.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        self.push_in_flight(InFlight {
            side: Side::Target,
            device,
            blocks,
            order,
        });
    }

    /// Makes the current stream of each copy's device wait for the whole of every copy in flight
    /// into or out of this storage, but those of a side `allowed(is_source)` lets the caller use
    /// as it is (Note [Copies in row blocks]); the copies waited for are forgotten.
    pub(crate) fn settle_row_blocks(&self, allowed: impl Fn(bool) -> bool) -> Result<()> {
        if !any_in_flight() {
            return Ok(());
        }
        let waited: Vec<InFlight> = {
            let mut state = self.row_blocks();
            let (waited, kept) = std::mem::take(&mut state.in_flight)
                .into_iter()
                .partition(|f| !allowed(f.side == Side::Source));
            state.in_flight = kept;
            waited
        };
        IN_FLIGHT.fetch_sub(waited.len(), Ordering::Relaxed);
        for f in &waited {
            wait_for(Device::Cuda(f.device), &f.blocks)?;
        }
        Ok(())
    }

    /// The blocks of a copy or arrival in flight into this storage, taken by the op that reads
    /// them block by block (`linear`'s weight); `None` when none is.
    pub(crate) fn take_row_arrivals(&self) -> Option<Arrivals> {
        self.take_arrivals().map(|(blocks, _)| Arrivals(blocks))
    }

    /// The blocks of the tensor at `layout` on `device`, arriving in row blocks, taken as
    /// ranges of its elements (the caller orders its reads of each range after its event);
    /// `None` when nothing arrives into this storage. When the tensor is not the whole of what
    /// arrives (a view of part of it), the current stream waits for every block instead and
    /// `None` is returned.
    pub(crate) fn take_arriving_elements(
        &self,
        layout: &Layout,
        device: Device,
    ) -> Result<Option<Vec<Arrival<Event>>>> {
        let Some((blocks, order)) = self.take_arrivals() else {
            return Ok(None);
        };
        let dims = layout.dims();
        let whole = !dims.is_empty() && layout.is_contiguous() && layout.offset() == 0;
        let rows = blocks.last().map_or(0, |b| b.rows.end);
        if !whole || dims[0] != rows || rows == 0 {
            wait_for(device, &blocks)?;
            return Ok(None);
        }
        let row_len = layout.numel() / rows;
        Ok(Some(
            blocks
                .into_iter()
                .zip(order..)
                .map(|(b, order)| Arrival {
                    elements: b.rows.start * row_len..b.rows.end * row_len,
                    event: b.event,
                    order,
                })
                .collect(),
        ))
    }

    /// The block events of a copy or arrival in flight into this storage, taken, with the
    /// arrival's order (the caller now orders its reads after them); `None` when none is.
    fn take_arrivals(&self) -> Option<(Vec<RowBlockEvent>, u64)> {
        if !any_in_flight() {
            return None;
        }
        let mut state = self.row_blocks();
        let at = state.in_flight.iter().position(|f| f.side == Side::Target)?;
        let f = state.in_flight.swap_remove(at);
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        Some((f.blocks, f.order))
    }
}
