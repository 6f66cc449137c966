//! Tensor operations, one file per family. Each file holds the `Tensor` methods of its family
//! (and, for the ops `torch.nn.functional` names, such as `loss`, `pool`, `batch_norm` and
//! `multihead_attention`, their functions) and their backward rules next to the forward code,
//! and calls the backends through [`Storage`](crate::storage::Storage) (the backend boundary,
//! `backend/`); the op enums each family's backends see are defined in `backend/op.rs` and
//! re-exported here (`ops::binary::BinaryOp`, ...). `conv_composite` is the composite
//! sliding-window path that convolution and pooling take where a backend does not run them.

#![deny(unsafe_code)]

pub mod amp_scaling;
pub mod attention;
pub mod batch_norm;
pub mod binary;
pub mod conv;
mod conv_composite;
pub mod dropout;
pub mod foreach;
pub mod fused_optim;
pub mod index;
pub mod inplace;
pub mod loss;
pub mod matmul;
pub mod multihead_attention;
pub mod norm;
pub mod operators;
pub mod pool;
pub mod recurrent;
pub mod reduce;
pub mod rnn;
pub mod sdpa;
pub mod slice_scatter;
pub mod softmax;
pub mod sort;
pub mod unary;
pub mod view;
