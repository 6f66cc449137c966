//! [`Tensor`]'s creation (`create.rs`: factories, `from_vec`, ...), conversions (`convert.rs`:
//! dtype casts, device moves, contiguous copies, reads to the host), printing (`display.rs`)
//! and literals (`literal.rs`, the `tensor!` macro).
//!
//! The handle itself (storage, layout, dtype and autograd state) is the dispatch layer's
//! (`dispatch/tensor_impl.rs`), re-exported here; the ops are `crate::ops`'s.

#![deny(unsafe_code)]

mod convert;
mod create;
mod display;
mod literal;

pub use crate::dispatch::tensor_impl::{Hook, HookHandle, PostAccumulateGradHook, Tensor};
pub use literal::{from_literal, TensorLiteral};
