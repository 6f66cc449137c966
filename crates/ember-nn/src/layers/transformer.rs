//! The Transformer of "Attention Is All You Need" as `torch.nn` builds it:
//! [`TransformerEncoderLayer`], [`TransformerDecoderLayer`], the stacks [`TransformerEncoder`]
//! and [`TransformerDecoder`] (N copies of a layer plus an optional final norm) and
//! [`Transformer`] (encoder and decoder, each with a final `LayerNorm`).
//!
//! Names and order of parameters are PyTorch's (`layers.0.self_attn.in_proj_weight`,
//! `layers.0.linear1.weight`, `layers.0.norm1.weight`, `norm.weight`, `encoder.layers.0...`,
//! `decoder.norm.bias`), so state dicts line up with a PyTorch model of the same
//! configuration. As in PyTorch, a stack's layers start as deep copies of the layer it is
//! given (equal values, separate tensors), and [`Transformer`] then re-initializes every
//! parameter of two or more dims with Xavier uniform.
//!
//! Masks follow PyTorch: attention masks are `[L, S]` or `[N·nhead, L, S]`, key padding masks
//! `[N, S]`; a bool `true` masks a position out and a float mask is added to the scores
//! ([`Transformer::generate_square_subsequent_mask`] builds the float causal mask). The
//! `*_is_causal` flags are PyTorch's hints that the matching mask is causal; without the mask
//! the causal mask is built. Dropout applies in training mode only.

use super::{deep_copy, Dropout, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use super::{MultiheadAttention, MultiheadAttentionConfig};
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{DType, Device, Error, Result, Tensor};

/// The activation of the feed-forward block (`activation="relu"` or `"gelu"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransformerActivation {
    /// ReLU (PyTorch's default).
    #[default]
    Relu,
    /// The exact GELU.
    Gelu,
}

impl TransformerActivation {
    /// Parses PyTorch's name: `"relu"` or `"gelu"`.
    pub fn parse(name: &str) -> Result<TransformerActivation> {
        match name {
            "relu" => Ok(TransformerActivation::Relu),
            "gelu" => Ok(TransformerActivation::Gelu),
            _ => Err(Error::invalid(
                "Transformer",
                format!("activation should be \"relu\" or \"gelu\", not {name:?}"),
            )),
        }
    }

    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            TransformerActivation::Relu => x.relu(),
            TransformerActivation::Gelu => x.gelu(),
        }
    }
}

/// Keyword options of [`TransformerEncoderLayer`] and [`TransformerDecoderLayer`], with
/// PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransformerLayerConfig {
    /// Width of the feed-forward block (default 2048).
    pub dim_feedforward: usize,
    /// Dropout in attention, after each block and inside the feed-forward block (default 0.1).
    pub dropout: f64,
    /// The feed-forward activation (default ReLU).
    pub activation: TransformerActivation,
    /// The `LayerNorm`s' eps (default 1e-5).
    pub layer_norm_eps: f64,
    /// Inputs and outputs are `[N, L, E]` when true, `[L, N, E]` otherwise (default `false`).
    pub batch_first: bool,
    /// Normalize before each block (pre-norm) instead of after the residual (default `false`).
    pub norm_first: bool,
    /// Whether the linear layers, attention and `LayerNorm`s have biases (default `true`).
    pub bias: bool,
}

impl Default for TransformerLayerConfig {
    fn default() -> Self {
        TransformerLayerConfig {
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: TransformerActivation::Relu,
            layer_norm_eps: 1e-5,
            batch_first: false,
            norm_first: false,
            bias: true,
        }
    }
}

/// The masks of an encoder layer or stack (`mask`/`src_mask`, `src_key_padding_mask`,
/// `is_causal`); all absent by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct EncoderMasks<'a> {
    /// Self-attention mask, `[S, S]` or `[N·nhead, S, S]`.
    pub mask: Option<&'a Tensor>,
    /// Padding of the source, `[N, S]`.
    pub key_padding_mask: Option<&'a Tensor>,
    /// Hint that `mask` is the causal mask.
    pub is_causal: bool,
}

/// `encoder.forward_with(&src, &src_mask)`: PyTorch's two-argument `encoder(src, src_mask)`.
impl<'a> From<&'a Tensor> for EncoderMasks<'a> {
    fn from(mask: &'a Tensor) -> EncoderMasks<'a> {
        EncoderMasks {
            mask: Some(mask),
            ..Default::default()
        }
    }
}

/// The masks of a decoder layer or stack; all absent by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecoderMasks<'a> {
    /// Self-attention mask of the target, `[T, T]` or `[N·nhead, T, T]`.
    pub tgt_mask: Option<&'a Tensor>,
    /// Cross-attention mask, `[T, S]` or `[N·nhead, T, S]`.
    pub memory_mask: Option<&'a Tensor>,
    /// Padding of the target, `[N, T]`.
    pub tgt_key_padding_mask: Option<&'a Tensor>,
    /// Padding of the memory, `[N, S]`.
    pub memory_key_padding_mask: Option<&'a Tensor>,
    /// Hint that `tgt_mask` is the causal mask.
    pub tgt_is_causal: bool,
    /// Hint that `memory_mask` is the causal mask.
    pub memory_is_causal: bool,
}

/// `decoder.forward_with(&tgt, &memory, &tgt_mask)`: PyTorch's `decoder(tgt, memory, tgt_mask)`.
impl<'a> From<&'a Tensor> for DecoderMasks<'a> {
    fn from(tgt_mask: &'a Tensor) -> DecoderMasks<'a> {
        DecoderMasks {
            tgt_mask: Some(tgt_mask),
            ..Default::default()
        }
    }
}

/// The masks of [`Transformer::forward_with`]; all absent by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransformerMasks<'a> {
    /// Encoder self-attention mask, `[S, S]`.
    pub src_mask: Option<&'a Tensor>,
    /// Decoder self-attention mask, `[T, T]`.
    pub tgt_mask: Option<&'a Tensor>,
    /// Cross-attention mask, `[T, S]`.
    pub memory_mask: Option<&'a Tensor>,
    /// Padding of the source, `[N, S]`.
    pub src_key_padding_mask: Option<&'a Tensor>,
    /// Padding of the target, `[N, T]`.
    pub tgt_key_padding_mask: Option<&'a Tensor>,
    /// Padding of the memory for cross-attention, `[N, S]`.
    pub memory_key_padding_mask: Option<&'a Tensor>,
    /// Hint that `src_mask` is causal.
    pub src_is_causal: bool,
    /// Hint that `tgt_mask` is causal.
    pub tgt_is_causal: bool,
    /// Hint that `memory_mask` is causal.
    pub memory_is_causal: bool,
}

/// The attention, linear and norm layers both layer types build from one config.
fn attention(
    d_model: usize,
    nhead: usize,
    c: &TransformerLayerConfig,
    device: Device,
) -> Result<MultiheadAttention> {
    let config = MultiheadAttentionConfig {
        dropout: c.dropout,
        bias: c.bias,
        batch_first: c.batch_first,
    };
    MultiheadAttention::with_config(d_model, nhead, config, device)
}

fn linear(i: usize, o: usize, c: &TransformerLayerConfig, device: Device) -> Result<Linear> {
    Linear::with_config(i, o, LinearConfig { bias: c.bias }, device)
}

fn norm(d_model: usize, eps: f64, bias: bool, device: Device) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        elementwise_affine: true,
        bias,
    };
    LayerNorm::with_config(&[d_model], config, device)
}

/// The feed-forward layers, built alike for both layer types.
#[derive(Debug, Clone)]
struct FeedForward {
    linear1: Linear,
    dropout: Dropout,
    linear2: Linear,
}

impl FeedForward {
    fn new(d_model: usize, c: &TransformerLayerConfig, device: Device) -> Result<FeedForward> {
        if c.dim_feedforward == 0 {
            return Err(Error::invalid("Transformer", "dim_feedforward must be positive"));
        }
        Ok(FeedForward {
            linear1: linear(d_model, c.dim_feedforward, c, device)?,
            dropout: Dropout::new(c.dropout)?,
            linear2: linear(c.dim_feedforward, d_model, c, device)?,
        })
    }
}

/// The feed-forward block `linear2(dropout(activation(linear1(x))))`.
fn feed_forward(
    linear1: &Linear,
    dropout: &Dropout,
    linear2: &Linear,
    act: TransformerActivation,
    x: &Tensor,
) -> Result<Tensor> {
    let h = act.apply(&linear1.forward(x)?)?;
    linear2.forward(&dropout.forward(&h)?)
}

/// Self-attention block: `mha(x, x, x)[0]`.
fn self_attention(
    attn: &MultiheadAttention,
    x: &Tensor,
    mask: Option<&Tensor>,
    kpm: Option<&Tensor>,
    is_causal: bool,
) -> Result<Tensor> {
    Ok(attn.forward_attention(x, x, x, kpm, false, mask, is_causal)?.0)
}

/// `x + dropout(block(norm(x)))` (pre-norm) or `norm(x + dropout(block(x)))` (post-norm).
fn residual(
    x: &Tensor,
    norm: &LayerNorm,
    dropout: &Dropout,
    norm_first: bool,
    block: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if norm_first {
        x.add(&dropout.forward(&block(&norm.forward(x)?)?)?)
    } else {
        norm.forward(&x.add(&dropout.forward(&block(x)?)?)?)
    }
}

/// One encoder layer: self-attention and feed-forward blocks, each with a residual connection
/// and a `LayerNorm` (`nn.TransformerEncoderLayer(d_model, nhead)`).
#[derive(Debug, Clone)]
pub struct TransformerEncoderLayer {
    /// `self_attn.*`.
    pub self_attn: MultiheadAttention,
    /// `linear1.*`: `[dim_feedforward, d_model]`.
    pub linear1: Linear,
    /// Dropout inside the feed-forward block.
    pub dropout: Dropout,
    /// `linear2.*`: `[d_model, dim_feedforward]`.
    pub linear2: Linear,
    /// `norm1.*`, around the attention block.
    pub norm1: LayerNorm,
    /// `norm2.*`, around the feed-forward block.
    pub norm2: LayerNorm,
    /// Dropout after the attention block.
    pub dropout1: Dropout,
    /// Dropout after the feed-forward block.
    pub dropout2: Dropout,
    /// The feed-forward activation.
    pub activation: TransformerActivation,
    /// Pre-norm when true.
    pub norm_first: bool,
    training: crate::module::Training,
}

impl TransformerEncoderLayer {
    /// `nn.TransformerEncoderLayer(d_model, nhead)` on `device`.
    pub fn new(d_model: usize, nhead: usize, device: Device) -> Result<Self> {
        Self::with_config(d_model, nhead, TransformerLayerConfig::default(), device)
    }

    /// `nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=.., dropout=.., ...)`.
    pub fn with_config(
        d_model: usize,
        nhead: usize,
        c: TransformerLayerConfig,
        device: Device,
    ) -> Result<Self> {
        let ff = FeedForward::new(d_model, &c, device)?;
        Ok(TransformerEncoderLayer {
            self_attn: attention(d_model, nhead, &c, device)?,
            linear1: ff.linear1,
            dropout: ff.dropout,
            linear2: ff.linear2,
            norm1: norm(d_model, c.layer_norm_eps, c.bias, device)?,
            norm2: norm(d_model, c.layer_norm_eps, c.bias, device)?,
            dropout1: Dropout::new(c.dropout)?,
            dropout2: Dropout::new(c.dropout)?,
            activation: c.activation,
            norm_first: c.norm_first,
            training: crate::module::Training::new(true),
        })
    }

    /// `layer(src, src_mask, src_key_padding_mask, is_causal)`.
    pub fn forward_with<'m>(&self, src: &Tensor, masks: impl Into<EncoderMasks<'m>>) -> Result<Tensor> {
        let masks = masks.into();
        let x = residual(src, &self.norm1, &self.dropout1, self.norm_first, |x| {
            self_attention(
                &self.self_attn,
                x,
                masks.mask,
                masks.key_padding_mask,
                masks.is_causal,
            )
        })?;
        residual(&x, &self.norm2, &self.dropout2, self.norm_first, |x| {
            feed_forward(&self.linear1, &self.dropout, &self.linear2, self.activation, x)
        })
    }
}

/// One decoder layer: self-attention, cross-attention over the encoder's output (`memory`)
/// and feed-forward blocks (`nn.TransformerDecoderLayer(d_model, nhead)`).
#[derive(Debug, Clone)]
pub struct TransformerDecoderLayer {
    /// `self_attn.*`.
    pub self_attn: MultiheadAttention,
    /// `multihead_attn.*`: attention over the memory.
    pub multihead_attn: MultiheadAttention,
    /// `linear1.*`.
    pub linear1: Linear,
    /// Dropout inside the feed-forward block.
    pub dropout: Dropout,
    /// `linear2.*`.
    pub linear2: Linear,
    /// `norm1.*`, around self-attention.
    pub norm1: LayerNorm,
    /// `norm2.*`, around cross-attention.
    pub norm2: LayerNorm,
    /// `norm3.*`, around the feed-forward block.
    pub norm3: LayerNorm,
    /// Dropout after self-attention.
    pub dropout1: Dropout,
    /// Dropout after cross-attention.
    pub dropout2: Dropout,
    /// Dropout after the feed-forward block.
    pub dropout3: Dropout,
    /// The feed-forward activation.
    pub activation: TransformerActivation,
    /// Pre-norm when true.
    pub norm_first: bool,
    training: crate::module::Training,
}

impl TransformerDecoderLayer {
    /// `nn.TransformerDecoderLayer(d_model, nhead)` on `device`.
    pub fn new(d_model: usize, nhead: usize, device: Device) -> Result<Self> {
        Self::with_config(d_model, nhead, TransformerLayerConfig::default(), device)
    }

    /// `nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward=.., dropout=.., ...)`.
    pub fn with_config(
        d_model: usize,
        nhead: usize,
        c: TransformerLayerConfig,
        device: Device,
    ) -> Result<Self> {
        let self_attn = attention(d_model, nhead, &c, device)?;
        let multihead_attn = attention(d_model, nhead, &c, device)?;
        let ff = FeedForward::new(d_model, &c, device)?;
        Ok(TransformerDecoderLayer {
            self_attn,
            multihead_attn,
            linear1: ff.linear1,
            dropout: ff.dropout,
            linear2: ff.linear2,
            norm1: norm(d_model, c.layer_norm_eps, c.bias, device)?,
            norm2: norm(d_model, c.layer_norm_eps, c.bias, device)?,
            norm3: norm(d_model, c.layer_norm_eps, c.bias, device)?,
            dropout1: Dropout::new(c.dropout)?,
            dropout2: Dropout::new(c.dropout)?,
            dropout3: Dropout::new(c.dropout)?,
            activation: c.activation,
            norm_first: c.norm_first,
            training: crate::module::Training::new(true),
        })
    }

    /// `layer(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, ...)`.
    pub fn forward_with<'m>(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        masks: impl Into<DecoderMasks<'m>>,
    ) -> Result<Tensor> {
        let masks = masks.into();
        let x = residual(tgt, &self.norm1, &self.dropout1, self.norm_first, |x| {
            self_attention(
                &self.self_attn,
                x,
                masks.tgt_mask,
                masks.tgt_key_padding_mask,
                masks.tgt_is_causal,
            )
        })?;
        let x = residual(&x, &self.norm2, &self.dropout2, self.norm_first, |x| {
            let (out, _) = self.multihead_attn.forward_attention(
                x,
                memory,
                memory,
                masks.memory_key_padding_mask,
                false,
                masks.memory_mask,
                masks.memory_is_causal,
            )?;
            Ok(out)
        })?;
        residual(&x, &self.norm3, &self.dropout3, self.norm_first, |x| {
            feed_forward(&self.linear1, &self.dropout, &self.linear2, self.activation, x)
        })
    }
}

/// Implements `Module` for a layer from its forward, its children with tensors (visited in
/// PyTorch's registration order) and its tensorless children (only told the mode).
macro_rules! layer_module {
    ($ty:ty, [$($child:ident),*], [$($flag:ident),*]) => {
        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                $(self.$child.visit(&join_name(prefix, stringify!($child)), f);)*
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                $(self.$child.visit_mut(&join_name(prefix, stringify!($child)), f)?;)*
                Ok(())
            }

            fn set_training(&self, training: bool) {
                self.training.set(training);
                $(self.$child.set_training(training);)*
                $(self.$flag.set_training(training);)*
            }

            fn is_training(&self) -> bool {
                self.training.get()
            }
        }
    };
}

layer_module!(
    TransformerEncoderLayer,
    [self_attn, linear1, linear2, norm1, norm2],
    [dropout, dropout1, dropout2]
);
layer_module!(
    TransformerDecoderLayer,
    [self_attn, multihead_attn, linear1, linear2, norm1, norm2, norm3],
    [dropout, dropout1, dropout2, dropout3]
);

/// `num_layers` deep copies of `layer`.
fn clones<M: Module + Clone>(layer: &M, num_layers: usize) -> Result<Vec<M>> {
    (0..num_layers).map(|_| deep_copy(layer)).collect()
}

/// Declares a stack of layers with an optional final norm.
macro_rules! stack {
    ($(#[$doc:meta])* $ty:ident, $layer:ty, $name:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $ty {
            /// `layers.{i}.*`: deep copies of the layer given to `new`.
            pub layers: Vec<$layer>,
            /// `norm.*`: applied to the last layer's output when present.
            pub norm: Option<LayerNorm>,
            training: crate::module::Training,
        }

        impl $ty {
            #[doc = concat!("`nn.", $name, "(layer, num_layers, norm)`: `num_layers` deep copies of `layer`.")]
            pub fn new(layer: &$layer, num_layers: usize, norm: Option<LayerNorm>) -> Result<$ty> {
                let stack = $ty {
                    layers: clones(layer, num_layers)?,
                    norm,
                    training: crate::module::Training::new(true),
                };
                let training = layer.is_training();
                stack.set_training(training);
                Ok(stack)
            }

            fn finish(&self, x: Tensor) -> Result<Tensor> {
                match &self.norm {
                    Some(n) => n.forward(&x),
                    None => Ok(x),
                }
            }

            fn visit_children(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                for (i, l) in self.layers.iter().enumerate() {
                    l.visit(&join_name(prefix, &format!("layers.{i}")), f);
                }
                if let Some(n) = &self.norm {
                    n.visit(&join_name(prefix, "norm"), f);
                }
            }

            fn visit_children_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                for (i, l) in self.layers.iter_mut().enumerate() {
                    l.visit_mut(&join_name(prefix, &format!("layers.{i}")), f)?;
                }
                if let Some(n) = &mut self.norm {
                    n.visit_mut(&join_name(prefix, "norm"), f)?;
                }
                Ok(())
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                self.visit_children(prefix, f)
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                self.visit_children_mut(prefix, f)
            }

            fn set_training(&self, training: bool) {
                self.training.set(training);
                for l in &self.layers {
                    l.set_training(training);
                }
                if let Some(n) = &self.norm {
                    n.set_training(training);
                }
            }

            fn is_training(&self) -> bool {
                self.training.get()
            }
        }
    };
}

stack!(
    /// A stack of encoder layers (`nn.TransformerEncoder`).
    TransformerEncoder, TransformerEncoderLayer, "TransformerEncoder"
);
stack!(
    /// A stack of decoder layers (`nn.TransformerDecoder`).
    TransformerDecoder, TransformerDecoderLayer, "TransformerDecoder"
);

impl TransformerEncoder {
    /// `encoder(src, mask, src_key_padding_mask, is_causal)`: every layer in turn, then the
    /// norm.
    pub fn forward_with<'m>(&self, src: &Tensor, masks: impl Into<EncoderMasks<'m>>) -> Result<Tensor> {
        let masks = masks.into();
        let mut x = src.clone();
        for l in &self.layers {
            x = l.forward_with(&x, masks)?;
        }
        self.finish(x)
    }
}

impl Forward for TransformerEncoder {
    /// `encoder(src)` without masks.
    fn forward(&self, src: &Tensor) -> Result<Tensor> {
        self.forward_with(src, EncoderMasks::default())
    }
}

impl Forward for TransformerEncoderLayer {
    /// `layer(src)` without masks.
    fn forward(&self, src: &Tensor) -> Result<Tensor> {
        self.forward_with(src, EncoderMasks::default())
    }
}

impl TransformerDecoderLayer {
    /// `layer(tgt, memory)` without masks.
    pub fn forward(&self, tgt: &Tensor, memory: &Tensor) -> Result<Tensor> {
        self.forward_with(tgt, memory, DecoderMasks::default())
    }
}

impl TransformerDecoder {
    /// `decoder(tgt, memory, tgt_mask, memory_mask, ...)`: every layer in turn, then the norm.
    pub fn forward_with<'m>(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        masks: impl Into<DecoderMasks<'m>>,
    ) -> Result<Tensor> {
        let masks = masks.into();
        let mut x = tgt.clone();
        for l in &self.layers {
            x = l.forward_with(&x, memory, masks)?;
        }
        self.finish(x)
    }

    /// `decoder(tgt, memory)` without masks.
    pub fn forward(&self, tgt: &Tensor, memory: &Tensor) -> Result<Tensor> {
        self.forward_with(tgt, memory, DecoderMasks::default())
    }
}

/// Keyword options of [`Transformer`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransformerConfig {
    /// Encoder layers (default 6).
    pub num_encoder_layers: usize,
    /// Decoder layers (default 6).
    pub num_decoder_layers: usize,
    /// Width of the feed-forward blocks (default 2048).
    pub dim_feedforward: usize,
    /// Dropout (default 0.1).
    pub dropout: f64,
    /// The feed-forward activation (default ReLU).
    pub activation: TransformerActivation,
    /// The `LayerNorm`s' eps (default 1e-5).
    pub layer_norm_eps: f64,
    /// Inputs and outputs are `[N, L, E]` when true (default `false`).
    pub batch_first: bool,
    /// Pre-norm layers (default `false`).
    pub norm_first: bool,
    /// Biases in linear layers, attention and norms (default `true`).
    pub bias: bool,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        let l = TransformerLayerConfig::default();
        TransformerConfig {
            num_encoder_layers: 6,
            num_decoder_layers: 6,
            dim_feedforward: l.dim_feedforward,
            dropout: l.dropout,
            activation: l.activation,
            layer_norm_eps: l.layer_norm_eps,
            batch_first: l.batch_first,
            norm_first: l.norm_first,
            bias: l.bias,
        }
    }
}

impl TransformerConfig {
    /// The options of each layer.
    pub fn layer_config(&self) -> TransformerLayerConfig {
        TransformerLayerConfig {
            dim_feedforward: self.dim_feedforward,
            dropout: self.dropout,
            activation: self.activation,
            layer_norm_eps: self.layer_norm_eps,
            batch_first: self.batch_first,
            norm_first: self.norm_first,
            bias: self.bias,
        }
    }
}

/// An encoder-decoder Transformer (`nn.Transformer`).
#[derive(Debug, Clone)]
pub struct Transformer {
    /// `encoder.*`, with a final norm.
    pub encoder: TransformerEncoder,
    /// `decoder.*`, with a final norm.
    pub decoder: TransformerDecoder,
    /// Features of the model.
    pub d_model: usize,
    /// Attention heads.
    pub nhead: usize,
    /// Whether inputs and outputs are `[N, L, E]`.
    pub batch_first: bool,
    training: crate::module::Training,
}

impl Transformer {
    /// `nn.Transformer(d_model, nhead)` with PyTorch's other defaults (6 + 6 layers, ...).
    pub fn new(d_model: usize, nhead: usize, device: Device) -> Result<Transformer> {
        Transformer::with_config(d_model, nhead, TransformerConfig::default(), device)
    }

    /// `nn.Transformer(d_model, nhead, num_encoder_layers=.., ...)` on `device`; every
    /// parameter of two or more dims is then Xavier uniform (PyTorch's `_reset_parameters`).
    pub fn with_config(
        d_model: usize,
        nhead: usize,
        c: TransformerConfig,
        device: Device,
    ) -> Result<Transformer> {
        let lc = c.layer_config();
        let enc_layer = TransformerEncoderLayer::with_config(d_model, nhead, lc, device)?;
        let dec_layer = TransformerDecoderLayer::with_config(d_model, nhead, lc, device)?;
        let encoder = TransformerEncoder::new(
            &enc_layer,
            c.num_encoder_layers,
            Some(norm(d_model, c.layer_norm_eps, c.bias, device)?),
        )?;
        let decoder = TransformerDecoder::new(
            &dec_layer,
            c.num_decoder_layers,
            Some(norm(d_model, c.layer_norm_eps, c.bias, device)?),
        )?;
        let t = Transformer {
            encoder,
            decoder,
            d_model,
            nhead,
            batch_first: c.batch_first,
            training: crate::module::Training::new(true),
        };
        let mut result = Ok(());
        t.visit("", &mut |_, p, kind| {
            if kind == TensorKind::Parameter && p.rank() > 1 && result.is_ok() {
                result = init::xavier_uniform_(p, 1.0).map(|_| ());
            }
        });
        result?;
        Ok(t)
    }

    /// `transformer(src, tgt)` without masks: [`Transformer::forward_with`] with
    /// `TransformerMasks::default()`.
    pub fn forward(&self, src: &Tensor, tgt: &Tensor) -> Result<Tensor> {
        self.forward_with(src, tgt, TransformerMasks::default())
    }

    /// `transformer(src, tgt, src_mask, tgt_mask, memory_mask, ...)`: encodes `src`
    /// (`[S, N, E]`, `[N, S, E]` with `batch_first`) and decodes `tgt` (`[T, N, E]`) against
    /// it, returning `[T, N, E]` (`[N, T, E]`).
    pub fn forward_with(&self, src: &Tensor, tgt: &Tensor, masks: TransformerMasks<'_>) -> Result<Tensor> {
        const OP: &str = "Transformer";
        let batched = src.rank() == 3;
        if src.rank() != tgt.rank() || !(2..=3).contains(&src.rank()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "src and tgt must both be 3-D (or both 2-D unbatched), got shapes {} and {}",
                    src.shape(),
                    tgt.shape()
                ),
            ));
        }
        let batch_dim = if self.batch_first { 0 } else { 1 };
        if batched && src.dims()[batch_dim] != tgt.dims()[batch_dim] {
            return Err(Error::invalid(
                OP,
                "the batch number of src and tgt must be equal",
            ));
        }
        if src.dims().last() != Some(&self.d_model) || tgt.dims().last() != Some(&self.d_model) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the feature number of src and tgt must be equal to d_model ({})",
                    self.d_model
                ),
            ));
        }
        let memory = self.encoder.forward_with(
            src,
            EncoderMasks {
                mask: masks.src_mask,
                key_padding_mask: masks.src_key_padding_mask,
                is_causal: masks.src_is_causal,
            },
        )?;
        self.decoder.forward_with(
            tgt,
            &memory,
            DecoderMasks {
                tgt_mask: masks.tgt_mask,
                memory_mask: masks.memory_mask,
                tgt_key_padding_mask: masks.tgt_key_padding_mask,
                memory_key_padding_mask: masks.memory_key_padding_mask,
                tgt_is_causal: masks.tgt_is_causal,
                memory_is_causal: masks.memory_is_causal,
            },
        )
    }

    /// The float causal mask `[sz, sz]`: `-inf` above the diagonal (position `j > i` masked),
    /// 0 elsewhere (`nn.Transformer.generate_square_subsequent_mask`), f32 on `device`.
    pub fn generate_square_subsequent_mask(sz: usize, device: Device) -> Result<Tensor> {
        let i = Tensor::arange(0.0, sz as f64, 1.0, DType::I64, device)?.unsqueeze(1)?;
        let j = Tensor::arange(0.0, sz as f64, 1.0, DType::I64, device)?.unsqueeze(0)?;
        Tensor::zeros([sz, sz], DType::F32, device)?.masked_fill(&j.gt(&i)?, f64::NEG_INFINITY)
    }
}

impl Module for Transformer {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.encoder.visit(&join_name(prefix, "encoder"), f);
        self.decoder.visit(&join_name(prefix, "decoder"), f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.encoder.visit_mut(&join_name(prefix, "encoder"), f)?;
        self.decoder.visit_mut(&join_name(prefix, "decoder"), f)
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
        self.encoder.set_training(training);
        self.decoder.set_training(training);
    }

    fn is_training(&self) -> bool {
        self.training.get()
    }
}
