//! Indexing by index tensors: index_select, gather, scatter / scatter_add, index_add,
//! embedding lookup and one_hot, with backward rules.

use super::not_built;
use crate::{Result, Tensor};

impl Tensor {
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let _ = (dim, index);
        Err(not_built("index_select"))
    }

    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let _ = (dim, index);
        Err(not_built("gather"))
    }

    /// `self` with `src` added at `index` along `dim` (out of place; `torch.scatter_add`).
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _ = (dim, index, src);
        Err(not_built("scatter_add"))
    }

    /// `self` with rows of `source` added at `index` along `dim` (out of place; `index_add`).
    pub fn index_add(&self, dim: isize, index: &Tensor, source: &Tensor) -> Result<Tensor> {
        let _ = (dim, index, source);
        Err(not_built("index_add"))
    }
}
