//! `scaled_dot_product_attention` with PyTorch's keyword arguments ([`SdpaOptions`]):
//! ember-core's `ops::sdpa` (the fused cuDNN path where it runs the problem, else the math
//! path `softmax(q kᵀ · scale + mask) v`).

use ember_core::{Result, Tensor};

/// The keyword arguments of [`scaled_dot_product_attention_with`]; `Default` is PyTorch's
/// (no mask, no dropout, not causal, scale `1 / √E`). Build it as a struct or builder-style:
/// `SdpaOptions::new().is_causal(true)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SdpaOptions<'a> {
    /// Broadcasts to `[.., L, S]`: a bool mask keeps the positions where it is true, a float
    /// mask is added to the scores (`attn_mask=`).
    pub attn_mask: Option<&'a Tensor>,
    /// Dropout on the attention weights (`dropout_p=`, 0.0).
    pub dropout_p: f64,
    /// Keeps position `j <= i` only; excludes `attn_mask` (`is_causal=`, false).
    pub is_causal: bool,
    /// The factor of the scores (`scale=`, `1 / √E` when `None`).
    pub scale: Option<f64>,
    /// Grouped-query attention (`enable_gqa=`, false): key and value may have fewer heads
    /// (dim -3) than the query, a divisor of its count; each serves that many query heads.
    pub enable_gqa: bool,
}

impl<'a> SdpaOptions<'a> {
    /// PyTorch's defaults.
    pub fn new() -> SdpaOptions<'a> {
        SdpaOptions::default()
    }

    /// Sets `attn_mask=`.
    pub fn attn_mask(mut self, mask: &'a Tensor) -> SdpaOptions<'a> {
        self.attn_mask = Some(mask);
        self
    }

    /// Sets `dropout_p=`.
    pub fn dropout_p(mut self, p: f64) -> SdpaOptions<'a> {
        self.dropout_p = p;
        self
    }

    /// Sets `is_causal=`.
    pub fn is_causal(mut self, is_causal: bool) -> SdpaOptions<'a> {
        self.is_causal = is_causal;
        self
    }

    /// Sets `scale=`.
    pub fn scale(mut self, scale: f64) -> SdpaOptions<'a> {
        self.scale = Some(scale);
        self
    }

    /// Sets `enable_gqa=`.
    pub fn enable_gqa(mut self, enable_gqa: bool) -> SdpaOptions<'a> {
        self.enable_gqa = enable_gqa;
        self
    }
}

/// Attention of `query` `[.., L, E]` over `key` `[.., S, E]` and `value` `[.., S, Ev]`, giving
/// `[.., L, Ev]` (`F.scaled_dot_product_attention(q, k, v)` with PyTorch's defaults); the
/// keyword arguments are [`scaled_dot_product_attention_with`]'s options.
pub fn scaled_dot_product_attention(query: &Tensor, key: &Tensor, value: &Tensor) -> Result<Tensor> {
    scaled_dot_product_attention_with(query, key, value, SdpaOptions::default())
}

/// `F.scaled_dot_product_attention(q, k, v, attn_mask=.., dropout_p=.., is_causal=..,
/// scale=..)`: see [`SdpaOptions`]. nanoGPT's causal self-attention is
/// `scaled_dot_product_attention_with(&q, &k, &v, SdpaOptions::new().is_causal(true))`.
pub fn scaled_dot_product_attention_with(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    options: SdpaOptions<'_>,
) -> Result<Tensor> {
    let SdpaOptions {
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
    } = options;
    ember_core::ops::sdpa::scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    )
}
