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

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
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
/// on (Note [Gradients in row blocks]); `blocks` of 0 or 1 turns it off.
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
    if blocks > 1 {
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
