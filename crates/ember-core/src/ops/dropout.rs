//! Dropout (`torch.dropout`): zeroes each element with probability `p` while training and scales the kept ones
//! by `1 / (1 - p)` (inverted dropout), so evaluation is the identity.
//!
//! The keep mask is a Bernoulli(1 - p) draw from ember's Philox generators (the device's
//! default one, or one passed in), so a seed gives the same mask on CPU and CUDA. A fused
//! kernel would draw and apply the mask in one pass instead of a draw and a multiply.

use crate::dispatch::{self, policy};
use crate::{default_generator, Error, Generator, Result, Tensor};

/// `torch.dropout(input, p, train)` (`F.dropout`) drawing from the default generator of `input`'s device.
pub fn dropout(input: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    dropout_with(input, p, training, default_generator(input.device()))
}

/// [`dropout`] drawing its mask from `gen`.
pub fn dropout_with(input: &Tensor, p: f64, training: bool, gen: &Generator) -> Result<Tensor> {
    dispatch::composite(&policy::DROPOUT, [input], |[input]| {
        dropout_prepared(input, p, training, gen)
    })
}

fn dropout_prepared(input: &Tensor, p: f64, training: bool, gen: &Generator) -> Result<Tensor> {
    const OP: &str = "dropout";
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid(
            OP,
            format!("dropout probability has to be between 0 and 1, but got {p}"),
        ));
    }
    if !input.dtype().is_floating_point() {
        return Err(Error::dtype(OP, input.dtype()));
    }
    if !training || p == 0.0 {
        return Ok(input.clone());
    }
    if p == 1.0 {
        return input.mul_scalar(0.0);
    }
    // Drawn as a new tensor: `bernoulli_with_` into an empty one draws the same values into a
    // buffer of its own and copies them over.
    let mask = input.bernoulli_p_with(1.0 - p, gen)?;
    input.mul(&mask.mul_scalar(1.0 / (1.0 - p))?)
}
