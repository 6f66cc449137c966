//! Matrix products with PyTorch's semantics: `matmul` (1-D, 2-D, batched with broadcasting),
//! `mm`, `bmm`, `linear`, with backward rules.

use super::not_built;
use crate::{Result, Tensor};

impl Tensor {
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let _ = other;
        Err(not_built("matmul"))
    }

    pub fn mm(&self, other: &Tensor) -> Result<Tensor> {
        let _ = other;
        Err(not_built("mm"))
    }

    pub fn bmm(&self, other: &Tensor) -> Result<Tensor> {
        let _ = other;
        Err(not_built("bmm"))
    }

    /// `self @ weight.T + bias` (`F.linear`).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _ = (weight, bias);
        Err(not_built("linear"))
    }
}
