//! [`Dropout`] (`nn.Dropout`): `crate::functional::dropout` while training, the identity in
//! evaluation mode.

use super::stateless_module;
use crate::functional;
use ember_core::{Error, Result};

/// Zeroes elements with probability `p` while training, scaling the rest by `1/(1-p)`
/// (`nn.Dropout(p)`); masks come from the default generator of the input's device.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    training: crate::module::Training,
}

impl Dropout {
    /// `nn.Dropout(p)`; `p` must be in `[0, 1]`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                "Dropout",
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        Ok(Dropout {
            p,
            training: crate::module::Training::new(true),
        })
    }
}

stateless_module!(Dropout, |s, x| functional::dropout(x, s.p, s.training.get()));
