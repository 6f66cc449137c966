//! Row blocks seen from tensors (the notes are in `storage/row_blocks.rs`, the state is a field
//! of each storage): DataParallel's and DistributedDataParallel's public hooks, and the dispatch
//! point's step 1b.

use super::tensor_impl::Tensor;
use crate::cuda_backend::row_blocks::wait_for;
use crate::cuda_backend::{ArrivingElements, RowBlockEvent};
use crate::{Device, Error, Result};

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

/// The dispatch point's step 1b (Note [Copies in row blocks]): every input that is the source
/// or the target of a copy in row blocks still in flight makes the current stream of its
/// device wait for the whole copy, unless `allowed(i, is_source)` says the op uses input `i`
/// as the copy allows (reading a source; `linear` consuming a target block by block itself).
pub(crate) fn settle(inputs: &[&Tensor], allowed: impl Fn(usize, bool) -> bool) -> Result<()> {
    if !crate::storage::row_blocks::any_in_flight() {
        return Ok(());
    }
    for (i, t) in inputs.iter().enumerate() {
        t.storage().settle_row_blocks(|is_source| allowed(i, is_source))?;
    }
    Ok(())
}

/// Orders the current stream after any copy or arrival in flight into or out of `t`'s
/// storage, before the host reads it.
pub(crate) fn settle_read(t: &Tensor) -> Result<()> {
    settle(&[t], |_, _| false)
}

/// The blocks of `t`, arriving in row blocks, taken (the caller orders its reads of each range
/// after its event); `None` when nothing arrives into `t`'s storage. When `t` is not the whole
/// tensor that arrives (a view of part of it), the current stream waits for every block
/// instead and `None` is returned.
pub(crate) fn take_arriving_elements(t: &Tensor) -> Result<Option<Vec<ArrivingElements>>> {
    let Some((blocks, order)) = t.storage().take_arrivals() else {
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
