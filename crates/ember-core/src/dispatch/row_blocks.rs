//! The dispatch point's step 1b (Note [Copies in row blocks] in `storage/row_blocks.rs`, where
//! the state is, a field of each storage): an op's operands wait for copies and arrivals in
//! row blocks still in flight into or out of them, as do host reads. The public hooks that
//! start them are `torch.cuda`'s (`cuda/row_blocks.rs`).

use super::tensor_impl::Tensor;
use crate::Result;

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
