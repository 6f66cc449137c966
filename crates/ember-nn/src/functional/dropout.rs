//! Dropout with PyTorch's functional arguments: ember-core's `ops::dropout` (each element
//! zeroed with probability `p` while training, the kept ones scaled by `1 / (1 - p)`; the
//! identity in evaluation; the mask a Bernoulli draw from ember's Philox generators).

use ember_core::{Generator, Result, Tensor};

/// `F.dropout(input, p, training)` drawing from the default generator of `input`'s device.
pub fn dropout(input: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    ember_core::ops::dropout::dropout(input, p, training)
}

/// [`dropout`] drawing its mask from `gen`.
pub fn dropout_with(input: &Tensor, p: f64, training: bool, gen: &Generator) -> Result<Tensor> {
    ember_core::ops::dropout::dropout_with(input, p, training, gen)
}
