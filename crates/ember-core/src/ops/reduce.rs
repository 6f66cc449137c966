//! Reductions over dimensions (sum, mean, prod, max/min, arg*, var/std, logsumexp, norm) and
//! softmax / log_softmax, with backward rules.

use super::not_built;
use crate::{Result, Tensor};

impl Tensor {
    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        Err(not_built("sum"))
    }

    /// Sum over `dims` (negative counts from the end), keeping them as size 1 if `keepdim`.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _ = (dims, keepdim);
        Err(not_built("sum"))
    }

    pub fn mean_all(&self) -> Result<Tensor> {
        Err(not_built("mean"))
    }

    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _ = (dims, keepdim);
        Err(not_built("mean"))
    }

    /// Maximum over `dim` and the index of its first occurrence (`torch.max(x, dim)`).
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let _ = (dim, keepdim);
        Err(not_built("max"))
    }

    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let _ = dim;
        Err(not_built("softmax"))
    }

    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let _ = dim;
        Err(not_built("log_softmax"))
    }
}
