//! Row blocks seen from tensors (the notes and the state, a field of each storage, are in
//! `storage/row_blocks.rs`): the hooks DataParallel and DistributedDataParallel use to compute a
//! weight's gradient in row blocks, take the blocks' events, and hand a tensor on as arriving
//! in row blocks.

use crate::cuda_backend::RowBlockEvent;
use crate::{Device, Error, Result, Tensor};

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
    weight.storage().set_gradient_row_blocks(blocks);
    Ok(())
}

/// The events of `grad`'s row blocks, when `grad` is (a view of) the storage a blocked weight
/// gradient was computed into and nothing took them before; they cover the whole storage.
pub fn take_gradient_row_events(grad: &Tensor) -> Option<Vec<RowBlockEvent>> {
    grad.storage().take_row_block_events()
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
    t.storage().arriving_in_row_blocks(device, blocks);
    Ok(())
}
