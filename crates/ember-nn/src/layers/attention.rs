//! [`MultiheadAttention`] (`nn.MultiheadAttention`) over
//! `crate::functional::multi_head_attention_forward_with`, with query, key and value of the same
//! feature size (`kdim = vdim = embed_dim`) and no `add_bias_kv`/`add_zero_attn`.
//!
//! Parameters as PyTorch's: `in_proj_weight` `[3E, E]` (Xavier uniform), `in_proj_bias` `[3E]`
//! (zeros), `out_proj.weight` `[E, E]` (`Linear`'s default init) and `out_proj.bias` `[E]`
//! (zeros); without `bias` neither bias exists. Dropout on the attention weights applies in
//! training mode only.

use super::{new_param, visit_opt, visit_opt_mut, Linear, LinearConfig};
use crate::functional::{self, MhaOptions};
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{Device, Error, Result, Tensor};

/// Keyword options of [`MultiheadAttention`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiheadAttentionConfig {
    /// Dropout on the attention weights while training (default 0).
    pub dropout: f64,
    /// Whether the input and output projections have biases (default `true`).
    pub bias: bool,
    /// Inputs and outputs are `[N, L, E]` when true, `[L, N, E]` otherwise (default `false`).
    pub batch_first: bool,
}

impl Default for MultiheadAttentionConfig {
    fn default() -> Self {
        MultiheadAttentionConfig {
            dropout: 0.0,
            bias: true,
            batch_first: false,
        }
    }
}

/// Multi-head attention (`nn.MultiheadAttention(embed_dim, num_heads)`).
#[derive(Debug, Clone)]
pub struct MultiheadAttention {
    /// `[3·embed_dim, embed_dim]`: the q, k and v projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3·embed_dim]`, zeros initially; `None` without bias.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection (`out_proj.weight`, `out_proj.bias`, the bias zero initially).
    pub out_proj: Linear,
    /// Total features of the model.
    pub embed_dim: usize,
    /// Parallel heads; each has `embed_dim / num_heads` features.
    pub num_heads: usize,
    /// Dropout on the attention weights while training.
    pub dropout: f64,
    /// Whether inputs and outputs are `[N, L, E]`.
    pub batch_first: bool,
    training: crate::module::Training,
}

impl MultiheadAttention {
    /// `nn.MultiheadAttention(embed_dim, num_heads)` on `device`.
    pub fn new(embed_dim: usize, num_heads: usize, device: Device) -> Result<MultiheadAttention> {
        MultiheadAttention::with_config(embed_dim, num_heads, MultiheadAttentionConfig::default(), device)
    }

    /// `nn.MultiheadAttention(embed_dim, num_heads, dropout=.., bias=.., batch_first=..)` on
    /// `device`.
    pub fn with_config(
        embed_dim: usize,
        num_heads: usize,
        config: MultiheadAttentionConfig,
        device: Device,
    ) -> Result<MultiheadAttention> {
        const OP: &str = "MultiheadAttention";
        if embed_dim == 0 || num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(Error::invalid(
                OP,
                format!("embed_dim ({embed_dim}) must be positive and divisible by num_heads ({num_heads})"),
            ));
        }
        if !(0.0..=1.0).contains(&config.dropout) {
            return Err(Error::invalid(
                OP,
                format!(
                    "dropout should be a number in range [0, 1], got {}",
                    config.dropout
                ),
            ));
        }
        let e = embed_dim;
        let in_proj_weight = new_param(&[3 * e, e], device, |w| init::xavier_uniform_(w, 1.0))?;
        let in_proj_bias = config
            .bias
            .then(|| new_param(&[3 * e], device, init::zeros_))
            .transpose()?;
        let out_proj = Linear::with_config(e, e, LinearConfig { bias: config.bias }, device)?;
        if let Some(b) = &out_proj.bias {
            init::zeros_(b)?;
        }
        Ok(MultiheadAttention {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            embed_dim,
            num_heads,
            dropout: config.dropout,
            batch_first: config.batch_first,
            training: crate::module::Training::new(true),
        })
    }

    /// `mha(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)`:
    /// returns `(attn_output, attn_weights)`, the weights (with `need_weights`) averaged over
    /// heads, `[N, L, S]` (`[L, S]` unbatched).
    ///
    /// `query` is `[L, N, E]`, `key`/`value` `[S, N, E]` (`[N, L, E]`/`[N, S, E]` with
    /// `batch_first`, or unbatched `[L, E]`/`[S, E]`). `key_padding_mask` is `[N, S]` (`[S]`)
    /// and `attn_mask` `[L, S]` or `[N·num_heads, L, S]`: bool `true` masks a position out,
    /// a float mask is added to the scores. `is_causal` is PyTorch's hint that `attn_mask` is
    /// the causal mask (the causal mask is built when `attn_mask` is `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_attention(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        key_padding_mask: Option<&Tensor>,
        need_weights: bool,
        attn_mask: Option<&Tensor>,
        is_causal: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let options = MhaOptions {
            key_padding_mask,
            dropout_p: if self.training.get() { self.dropout } else { 0.0 },
        };
        functional::multi_head_attention_forward_with(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            &self.in_proj_weight,
            self.in_proj_bias.as_ref(),
            &self.out_proj.weight,
            self.out_proj.bias.as_ref(),
            attn_mask,
            is_causal,
            self.batch_first,
            need_weights,
            options,
        )
    }
}

impl Forward for MultiheadAttention {
    /// Self-attention of `x` without masks or weights: `mha(x, x, x, need_weights=False)[0]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_attention(x, x, x, None, false, None, false)?.0)
    }
}

impl Module for MultiheadAttention {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(
            &join_name(prefix, "in_proj_weight"),
            &self.in_proj_weight,
            TensorKind::Parameter,
        );
        visit_opt(
            prefix,
            "in_proj_bias",
            &self.in_proj_bias,
            TensorKind::Parameter,
            f,
        );
        self.out_proj.visit(&join_name(prefix, "out_proj"), f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        f(
            &join_name(prefix, "in_proj_weight"),
            &mut self.in_proj_weight,
            TensorKind::Parameter,
        )?;
        visit_opt_mut(
            prefix,
            "in_proj_bias",
            &mut self.in_proj_bias,
            TensorKind::Parameter,
            f,
        )?;
        self.out_proj.visit_mut(&join_name(prefix, "out_proj"), f)
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
        self.out_proj.set_training(training);
    }

    fn is_training(&self) -> bool {
        self.training.get()
    }
}
