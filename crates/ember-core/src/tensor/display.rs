//! Printing tensors the way PyTorch does (`tensor([[1., 2.], ...])`). Filled in by the printing
//! work; for now `Debug` shows shape, dtype and device.

use crate::Tensor;
use std::fmt;

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor[{}, dtype={}, device={}]",
            self.shape(),
            self.dtype(),
            self.device()
        )
    }
}
