//! `torch.nn.functional`: the functional ops under PyTorch's names and argument forms.
//!
//! The ops are ember-core's (`ember_core::ops`: convolution, pooling, normalization, dropout,
//! attention, recurrent layers, losses; activations are `Tensor` methods), which enter its
//! dispatch point under PyTorch's names, run on every device and record their own backward.
//! This module adds PyTorch's argument forms where they differ from ember-core's (keyword
//! options such as [`SdpaOptions`] and [`CrossEntropyOptions`], `F.batch_norm`'s argument
//! order, sizes as [`Pair`], unbatched inputs) and re-exports the ops whose arguments are
//! already PyTorch's.
//!
//! One file per family: [`activation`] (gelu, relu, softmax, ...), [`conv`] (linear,
//! convolution, unfold), [`pooling`], [`normalization`] (batch and layer norm),
//! [`dropout`](mod@dropout), [`attention`], [`attention_mha`] (multi-head attention),
//! [`recurrent`] (RNN, LSTM, GRU and their cells) and [`loss`]. The functions are re-exported
//! here under PyTorch's names (`functional::conv2d` is `F.conv2d`).

pub mod activation;
pub mod attention;
pub mod attention_mha;
pub mod conv;
pub mod dropout;
pub mod loss;
pub mod normalization;
pub mod pooling;
pub mod recurrent;

pub use activation::{gelu, log_softmax, relu, sigmoid, silu, softmax, tanh, GeluApproximate};
pub use attention::{scaled_dot_product_attention, scaled_dot_product_attention_with, SdpaOptions};
pub use attention_mha::{multi_head_attention_forward, multi_head_attention_forward_with, MhaOptions};
pub use conv::{conv1d, conv2d, linear, unfold};
pub use dropout::{dropout, dropout_with};
pub use loss::{
    binary_cross_entropy_with_logits, cross_entropy, cross_entropy_with, l1_loss, mse_loss, nll_loss,
    CrossEntropyOptions, Reduction,
};
pub use normalization::{batch_norm, layer_norm};
pub use pooling::{adaptive_avg_pool2d, avg_pool2d, max_pool2d};
pub use recurrent::{gru, gru_cell, lstm, lstm_cell, rnn, rnn_relu_cell, rnn_tanh_cell, RnnNonlinearity};

/// A size or step per spatial dim of a 2-D op (`kernel_size=3` or `kernel_size=(3, 2)`):
/// built from a `usize` (both dims), a `[usize; 2]` or a `(usize, usize)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pair(pub [usize; 2]);

impl From<usize> for Pair {
    fn from(n: usize) -> Pair {
        Pair([n, n])
    }
}

impl From<[usize; 2]> for Pair {
    fn from(p: [usize; 2]) -> Pair {
        Pair(p)
    }
}

impl From<(usize, usize)> for Pair {
    fn from((h, w): (usize, usize)) -> Pair {
        Pair([h, w])
    }
}
