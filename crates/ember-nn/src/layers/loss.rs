//! Loss modules: [`CrossEntropyLoss`], [`NLLLoss`], [`MSELoss`], [`L1Loss`] and
//! [`BCEWithLogitsLoss`], each holding PyTorch's keyword options and calling the functional
//! form of [`crate::functional::loss`] in `forward(input, target)`.
//!
//! Options are set builder-style on PyTorch's defaults
//! (`CrossEntropyLoss::new().label_smoothing(0.1).ignore_index(0)`) and stay readable as public
//! fields (`loss.ignore_index`), as the attributes of PyTorch's loss modules. The class weights
//! (`weight`) and `pos_weight` are buffers, as PyTorch registers them: they appear in the
//! state dict and move with `to_device` / `to_dtype`.

use crate::functional::{self as F, Reduction};
use ember_core::{Result, Tensor};

/// PyTorch's default `ignore_index` (-100).
const DEFAULT_IGNORE_INDEX: i64 = -100;

/// Cross-entropy of logits against class indices or class probabilities
/// (`nn.CrossEntropyLoss`; see [`F::cross_entropy`] for the shapes).
#[derive(Debug, Clone, crate::Module)]
pub struct CrossEntropyLoss {
    /// Per-class weights `[C]` (`weight=`), a buffer.
    #[module(buffer)]
    pub weight: Option<Tensor>,
    /// Class-index targets equal to this count for nothing (`ignore_index=`, default -100).
    pub ignore_index: i64,
    /// How the per-element losses are reduced (`reduction=`, default mean).
    pub reduction: Reduction,
    /// Mixes the target with the uniform distribution, in `[0, 1]` (`label_smoothing=`).
    pub label_smoothing: f64,
    training: crate::module::Training,
}

impl CrossEntropyLoss {
    /// `nn.CrossEntropyLoss()` with PyTorch's defaults.
    pub fn new() -> CrossEntropyLoss {
        CrossEntropyLoss {
            weight: None,
            ignore_index: DEFAULT_IGNORE_INDEX,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
            training: crate::module::Training::new(true),
        }
    }

    /// Sets the per-class weights (`weight=`).
    pub fn weight(mut self, weight: Tensor) -> CrossEntropyLoss {
        self.weight = Some(weight);
        self
    }

    /// Sets the ignored target index (`ignore_index=`).
    pub fn ignore_index(mut self, ignore_index: i64) -> CrossEntropyLoss {
        self.ignore_index = ignore_index;
        self
    }

    /// Sets the reduction (`reduction=`).
    pub fn reduction(mut self, reduction: Reduction) -> CrossEntropyLoss {
        self.reduction = reduction;
        self
    }

    /// Sets the label smoothing (`label_smoothing=`); checked in `forward`.
    pub fn label_smoothing(mut self, label_smoothing: f64) -> CrossEntropyLoss {
        self.label_smoothing = label_smoothing;
        self
    }

    /// The loss of the logits `input` at `target` (`loss_fn(input, target)`).
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        F::cross_entropy_with(
            input,
            target,
            F::CrossEntropyOptions {
                weight: self.weight.as_ref(),
                ignore_index: self.ignore_index,
                reduction: self.reduction,
                label_smoothing: self.label_smoothing,
            },
        )
    }
}

impl Default for CrossEntropyLoss {
    fn default() -> CrossEntropyLoss {
        CrossEntropyLoss::new()
    }
}

/// Negative log-likelihood of log-probabilities at class indices (`nn.NLLLoss`; see
/// [`F::nll_loss`]).
#[derive(Debug, Clone, crate::Module)]
pub struct NLLLoss {
    /// Per-class weights `[C]` (`weight=`), a buffer.
    #[module(buffer)]
    pub weight: Option<Tensor>,
    /// Targets equal to this count for nothing (`ignore_index=`, default -100).
    pub ignore_index: i64,
    /// How the per-element losses are reduced (`reduction=`, default mean).
    pub reduction: Reduction,
    training: crate::module::Training,
}

impl NLLLoss {
    /// `nn.NLLLoss()` with PyTorch's defaults.
    pub fn new() -> NLLLoss {
        NLLLoss {
            weight: None,
            ignore_index: DEFAULT_IGNORE_INDEX,
            reduction: Reduction::Mean,
            training: crate::module::Training::new(true),
        }
    }

    /// Sets the per-class weights (`weight=`).
    pub fn weight(mut self, weight: Tensor) -> NLLLoss {
        self.weight = Some(weight);
        self
    }

    /// Sets the ignored target index (`ignore_index=`).
    pub fn ignore_index(mut self, ignore_index: i64) -> NLLLoss {
        self.ignore_index = ignore_index;
        self
    }

    /// Sets the reduction (`reduction=`).
    pub fn reduction(mut self, reduction: Reduction) -> NLLLoss {
        self.reduction = reduction;
        self
    }

    /// The loss of the log-probabilities `input` at `target` (`loss_fn(input, target)`).
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        F::nll_loss(
            input,
            target,
            self.weight.as_ref(),
            self.ignore_index,
            self.reduction,
        )
    }
}

impl Default for NLLLoss {
    fn default() -> NLLLoss {
        NLLLoss::new()
    }
}

/// A pointwise loss whose only option is the reduction.
macro_rules! pointwise_loss {
    ($(#[$doc:meta] $ty:ident => $f:ident, $torch:literal;)*) => {$(
        #[$doc]
        #[derive(Debug, Clone, crate::Module)]
        pub struct $ty {
            /// How the per-element losses are reduced (`reduction=`, default mean).
            pub reduction: Reduction,
            training: crate::module::Training,
        }

        impl $ty {
            #[doc = concat!("`", $torch, "()` with PyTorch's defaults.")]
            pub fn new() -> $ty {
                $ty {
                    reduction: Reduction::Mean,
                    training: crate::module::Training::new(true),
                }
            }

            /// Sets the reduction (`reduction=`).
            pub fn reduction(mut self, reduction: Reduction) -> $ty {
                self.reduction = reduction;
                self
            }

            /// The loss of `input` against `target` (`loss_fn(input, target)`).
            pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
                F::$f(input, target, self.reduction)
            }
        }

        impl Default for $ty {
            fn default() -> $ty {
                $ty::new()
            }
        }
    )*};
}

pointwise_loss! {
    /// Squared error `(input - target)²` (`nn.MSELoss`; see [`F::mse_loss`]).
    MSELoss => mse_loss, "nn.MSELoss";
    /// Absolute error `|input - target|` (`nn.L1Loss`; see [`F::l1_loss`]).
    L1Loss => l1_loss, "nn.L1Loss";
}

/// Binary cross-entropy of logits against probabilities (`nn.BCEWithLogitsLoss`; see
/// [`F::binary_cross_entropy_with_logits`]).
#[derive(Debug, Clone, crate::Module)]
pub struct BCEWithLogitsLoss {
    /// Weight of each element, broadcast against the input (`weight=`), a buffer.
    #[module(buffer)]
    pub weight: Option<Tensor>,
    /// Weight of the positive examples, broadcast against the input, usually one value per
    /// class (`pos_weight=`), a buffer.
    #[module(buffer)]
    pub pos_weight: Option<Tensor>,
    /// How the per-element losses are reduced (`reduction=`, default mean).
    pub reduction: Reduction,
    training: crate::module::Training,
}

impl BCEWithLogitsLoss {
    /// `nn.BCEWithLogitsLoss()` with PyTorch's defaults.
    pub fn new() -> BCEWithLogitsLoss {
        BCEWithLogitsLoss {
            weight: None,
            pos_weight: None,
            reduction: Reduction::Mean,
            training: crate::module::Training::new(true),
        }
    }

    /// Sets the element weights (`weight=`).
    pub fn weight(mut self, weight: Tensor) -> BCEWithLogitsLoss {
        self.weight = Some(weight);
        self
    }

    /// Sets the positive-example weights (`pos_weight=`).
    pub fn pos_weight(mut self, pos_weight: Tensor) -> BCEWithLogitsLoss {
        self.pos_weight = Some(pos_weight);
        self
    }

    /// Sets the reduction (`reduction=`).
    pub fn reduction(mut self, reduction: Reduction) -> BCEWithLogitsLoss {
        self.reduction = reduction;
        self
    }

    /// The loss of the logits `input` against the probabilities `target`.
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        F::binary_cross_entropy_with_logits(
            input,
            target,
            self.weight.as_ref(),
            self.pos_weight.as_ref(),
            self.reduction,
        )
    }
}

impl Default for BCEWithLogitsLoss {
    fn default() -> BCEWithLogitsLoss {
        BCEWithLogitsLoss::new()
    }
}
