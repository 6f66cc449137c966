//! Elementwise ops of one tensor: math functions and activations, with backward rules.

use super::not_built;
use crate::{Result, Tensor};

macro_rules! stub_unary {
    ($($name:ident),*) => {
        impl Tensor {$(
            pub fn $name(&self) -> Result<Tensor> {
                Err(not_built(stringify!($name)))
            }
        )*}
    };
}

stub_unary!(
    neg, abs, exp, log, log1p, sqrt, rsqrt, sin, cos, tanh, sigmoid, relu, gelu, gelu_tanh, silu, softplus,
    sign, floor, ceil, round, reciprocal, square
);
