//! Tensor operations, one file per family. Each file holds the `Tensor` methods of its family,
//! their backward rules next to the forward code, and the `impl Storage` block that dispatches
//! to each backend's kernels (`cpu/<family>.rs`).

pub mod amp_scaling;
pub mod binary;
pub mod conv;
pub mod fused_optim;
pub mod index;
pub mod inplace;
pub mod matmul;
pub mod pool;
pub mod reduce;
pub mod rnn;
pub mod softmax;
pub mod unary;
pub mod view;
