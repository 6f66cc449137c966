//! `multi_head_attention_forward`: the forward of `nn.MultiheadAttention`
//! (`F.multi_head_attention_forward`), ember-core's
//! [`ember_core::ops::multihead_attention::multi_head_attention_forward`], with the key padding
//! mask and the dropout on the attention weights as options ([`MhaOptions`]), which
//! `nn.MultiheadAttention` uses.

use ember_core::ops::multihead_attention;
use ember_core::{Result, Tensor};

/// The arguments of `F.multi_head_attention_forward` that [`multi_head_attention_forward`]
/// leaves at their defaults (no padding mask, no dropout).
#[derive(Debug, Clone, Copy, Default)]
pub struct MhaOptions<'a> {
    /// `[N, S]` (`[S]` unbatched): bool `true` marks a key position to ignore, a float mask
    /// (of the query's dtype) is added to the scores of every query and head.
    pub key_padding_mask: Option<&'a Tensor>,
    /// Probability of zeroing an attention weight (PyTorch's `dropout_p` with
    /// `training=True`); pass 0 in evaluation mode.
    pub dropout_p: f64,
}

/// `nn.MultiheadAttention`'s forward (`F.multi_head_attention_forward`) with packed
/// projections, no dropout and no key padding mask; returns `(attn_output, attn_weights)`.
///
/// `query` is `[L, N, E]`, `key`/`value` `[S, N, E]` (`[N, L, E]`/`[N, S, E]` with
/// `batch_first`; unbatched `[L, E]`/`[S, E]` too), `E = embed_dim` split over `num_heads`
/// heads. `in_proj_weight` is `[3E, E]` stacking the q, k, v projections, `in_proj_bias`
/// `[3E]`, `out_proj_weight` `[E, E]`, `out_proj_bias` `[E]`. `attn_mask` is `[L, S]` or
/// `[N·num_heads, L, S]`, bool (`true` = may not attend) or float (added to the scores).
/// `is_causal` is PyTorch's hint that `attn_mask` is the causal mask: the causal mask is
/// applied and `attn_mask` is not read, unless `need_weights` asks for the weights, which are
/// then computed with `attn_mask`; without `attn_mask` it builds the causal mask (where
/// PyTorch raises). `attn_weights` (with `need_weights`) is the softmax
/// averaged over heads, `[N, L, S]` (`[L, S]` unbatched).
#[allow(clippy::too_many_arguments)]
pub fn multi_head_attention_forward(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    embed_dim: usize,
    num_heads: usize,
    in_proj_weight: &Tensor,
    in_proj_bias: Option<&Tensor>,
    out_proj_weight: &Tensor,
    out_proj_bias: Option<&Tensor>,
    attn_mask: Option<&Tensor>,
    is_causal: bool,
    batch_first: bool,
    need_weights: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    multi_head_attention_forward_with(
        query,
        key,
        value,
        embed_dim,
        num_heads,
        in_proj_weight,
        in_proj_bias,
        out_proj_weight,
        out_proj_bias,
        attn_mask,
        is_causal,
        batch_first,
        need_weights,
        MhaOptions::default(),
    )
}

/// [`multi_head_attention_forward`] with a key padding mask and attention dropout
/// ([`MhaOptions`]). With a key padding mask the masks are merged into one float mask, as
/// PyTorch does: `is_causal` then stands for the causal mask (built when `attn_mask` is absent)
/// plus the padding mask. With `need_weights` the returned weights are those after dropout,
/// averaged over heads, as PyTorch's.
#[allow(clippy::too_many_arguments)]
pub fn multi_head_attention_forward_with(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    embed_dim: usize,
    num_heads: usize,
    in_proj_weight: &Tensor,
    in_proj_bias: Option<&Tensor>,
    out_proj_weight: &Tensor,
    out_proj_bias: Option<&Tensor>,
    attn_mask: Option<&Tensor>,
    is_causal: bool,
    batch_first: bool,
    need_weights: bool,
    options: MhaOptions<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    multihead_attention::multi_head_attention_forward(
        query,
        key,
        value,
        embed_dim,
        num_heads,
        in_proj_weight,
        in_proj_bias,
        out_proj_weight,
        out_proj_bias,
        attn_mask,
        is_causal,
        batch_first,
        need_weights,
        options.key_padding_mask,
        options.dropout_p,
    )
}
