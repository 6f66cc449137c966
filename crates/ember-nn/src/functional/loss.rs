//! Losses: `cross_entropy`, `nll_loss`, `mse_loss`, `l1_loss` and
//! `binary_cross_entropy_with_logits`, with PyTorch's reductions: ember-core's ops
//! (`ember_core::ops::loss`, which enter the dispatch point under these names), with
//! `F.cross_entropy`'s keyword arguments as [`CrossEntropyOptions`]. The other losses' arguments
//! are already PyTorch's, so they are ember-core's functions themselves.

use ember_core::{Result, Tensor};

pub use ember_core::ops::loss::{binary_cross_entropy_with_logits, l1_loss, mse_loss, nll_loss};
/// How a loss reduces its per-element values (`reduction=` in PyTorch): ember-core's, where
/// the losses live.
pub use ember_core::Reduction;

/// The keyword arguments of [`cross_entropy_with`]; `Default` is PyTorch's (no weights,
/// `ignore_index` -100, mean, no smoothing). Build it as a struct or builder-style:
/// `CrossEntropyOptions::new().ignore_index(-1)`.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyOptions<'a> {
    /// Per-class weights `[C]` (`weight=`).
    pub weight: Option<&'a Tensor>,
    /// Class-index targets equal to this count for nothing (`ignore_index=`, -100).
    pub ignore_index: i64,
    /// How the per-element losses are reduced (`reduction=`, mean).
    pub reduction: Reduction,
    /// Mixes the target with the uniform distribution, in `[0, 1]` (`label_smoothing=`, 0).
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions<'_> {
    fn default() -> Self {
        CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
        }
    }
}

impl<'a> CrossEntropyOptions<'a> {
    /// PyTorch's defaults.
    pub fn new() -> CrossEntropyOptions<'a> {
        CrossEntropyOptions::default()
    }

    /// Sets `weight=`.
    pub fn weight(mut self, weight: &'a Tensor) -> CrossEntropyOptions<'a> {
        self.weight = Some(weight);
        self
    }

    /// Sets `ignore_index=`.
    pub fn ignore_index(mut self, ignore_index: i64) -> CrossEntropyOptions<'a> {
        self.ignore_index = ignore_index;
        self
    }

    /// Sets `reduction=`.
    pub fn reduction(mut self, reduction: Reduction) -> CrossEntropyOptions<'a> {
        self.reduction = reduction;
        self
    }

    /// Sets `label_smoothing=`.
    pub fn label_smoothing(mut self, label_smoothing: f64) -> CrossEntropyOptions<'a> {
        self.label_smoothing = label_smoothing;
        self
    }
}

/// Cross-entropy of the logits `input` (`[C]` or `[N, C, d1, ..]`, classes in dim 1) against
/// `target` (`F.cross_entropy(input, target)` with PyTorch's defaults): either class indices
/// (int64, `[]` or `[N, d1, ..]`) or class probabilities of the input's shape and dtype. The
/// keyword arguments are [`cross_entropy_with`]'s options.
pub fn cross_entropy(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    cross_entropy_with(input, target, CrossEntropyOptions::default())
}

/// `F.cross_entropy(input, target, weight=.., ignore_index=.., reduction=..,
/// label_smoothing=..)`: see [`CrossEntropyOptions`]; `label_smoothing` must be in `[0, 1]`.
/// ember-core's [`ember_core::ops::loss::cross_entropy`] with these arguments.
pub fn cross_entropy_with(
    input: &Tensor,
    target: &Tensor,
    options: CrossEntropyOptions<'_>,
) -> Result<Tensor> {
    let CrossEntropyOptions {
        weight,
        ignore_index,
        reduction,
        label_smoothing,
    } = options;
    ember_core::ops::loss::cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)
}
