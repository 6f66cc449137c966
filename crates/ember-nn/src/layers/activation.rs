//! Activation layers: [`ReLU`], [`GELU`], [`SiLU`], [`Tanh`], [`Sigmoid`], [`Softmax`],
//! [`LogSoftmax`], each the ember-core op of the same name.

use super::stateless_module;

macro_rules! simple_activation {
    ($(#[$doc:meta] $ty:ident => $method:ident;)*) => {$(
        #[$doc]
        #[derive(Debug, Clone)]
        pub struct $ty {
            training: crate::module::Training,
        }

        impl $ty {
            #[doc = concat!("A new `", stringify!($ty), "`.")]
            pub fn new() -> $ty {
                $ty { training: crate::module::Training::new(true) }
            }
        }

        impl Default for $ty {
            fn default() -> $ty {
                $ty::new()
            }
        }

        stateless_module!($ty, |_s, x| x.$method());
    )*};
}

simple_activation! {
    /// `max(x, 0)` elementwise (`nn.ReLU`).
    ReLU => relu;
    /// `x σ(x)` elementwise (`nn.SiLU`).
    SiLU => silu;
    /// Hyperbolic tangent elementwise (`nn.Tanh`).
    Tanh => tanh;
    /// Logistic function elementwise (`nn.Sigmoid`).
    Sigmoid => sigmoid;
}

pub use crate::functional::GeluApproximate;

/// Gaussian error linear unit `x Φ(x)` (`nn.GELU(approximate=..)`).
#[derive(Debug, Clone)]
pub struct GELU {
    /// Exact or tanh-approximated.
    pub approximate: GeluApproximate,
    training: crate::module::Training,
}

impl GELU {
    /// `nn.GELU()` (exact).
    pub fn new() -> GELU {
        GELU::with_approximate(GeluApproximate::None)
    }

    /// `nn.GELU(approximate=..)`.
    pub fn with_approximate(approximate: GeluApproximate) -> GELU {
        GELU {
            approximate,
            training: crate::module::Training::new(true),
        }
    }
}

impl Default for GELU {
    fn default() -> GELU {
        GELU::new()
    }
}

stateless_module!(GELU, |s, x| match s.approximate {
    GeluApproximate::None => x.gelu(),
    GeluApproximate::Tanh => x.gelu_tanh(),
});

/// Softmax over `dim` (`nn.Softmax(dim)`; the dim is required, PyTorch's implicit choice is
/// deprecated).
#[derive(Debug, Clone)]
pub struct Softmax {
    /// The dim the values sum to 1 over (negative counts from the end).
    pub dim: isize,
    training: crate::module::Training,
}

impl Softmax {
    /// `nn.Softmax(dim)`.
    pub fn new(dim: isize) -> Softmax {
        Softmax {
            dim,
            training: crate::module::Training::new(true),
        }
    }
}

stateless_module!(Softmax, |s, x| x.softmax(s.dim));

/// Log of the softmax over `dim` (`nn.LogSoftmax(dim)`).
#[derive(Debug, Clone)]
pub struct LogSoftmax {
    /// The dim normalized over (negative counts from the end).
    pub dim: isize,
    training: crate::module::Training,
}

impl LogSoftmax {
    /// `nn.LogSoftmax(dim)`.
    pub fn new(dim: isize) -> LogSoftmax {
        LogSoftmax {
            dim,
            training: crate::module::Training::new(true),
        }
    }
}

stateless_module!(LogSoftmax, |s, x| x.log_softmax(s.dim));
