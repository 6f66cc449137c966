//! The CUDA side of row blocks (Note [Gradients in row blocks] and the notes beside it in
//! `storage/row_blocks.rs`): the event of one block, the row ranges of a product in blocks,
//! and the waits for them.

use std::ops::Range;

use super::Event;
use crate::{Device, Result};

/// Completion of some rows of a gradient computed in row blocks.
#[derive(Debug)]
pub struct RowBlockEvent {
    /// The rows of the gradient (dim 0 of the weight) this block wrote.
    pub rows: Range<usize>,
    /// Recorded on the computing stream after the block's product.
    pub event: Event,
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
