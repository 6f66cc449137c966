//! `scaled_dot_product_attention`: `softmax(q kᵀ · scale + mask) v`, as PyTorch's math
//! backend computes it, with an optional boolean or additive mask, a causal mask, and dropout
//! on the attention weights.
//!
//! It materializes the `[.., L, S]` score matrix (two batched GEMMs, a softmax and the
//! masking ops); a fused (flash) attention kernel would keep the scores on chip and save that
//! memory traffic and the extra kernels, forward and backward.

use super::dropout::dropout;
use ember_core::dispatch::{self, policy};
use ember_core::ops::attention;
use ember_core::{DType, Error, Result, Tensor};

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
    let inputs = [Some(query), Some(key), Some(value), attn_mask];
    dispatch::composite_list(&policy::SCALED_DOT_PRODUCT_ATTENTION, &inputs, |ins| {
        let [Some(q), Some(k), Some(v), mask] = ins else {
            unreachable!("query, key and value are always given")
        };
        let (k, v) = if enable_gqa {
            (repeat_heads(q, k)?, repeat_heads(q, v)?)
        } else {
            (k.clone(), v.clone())
        };
        sdpa_prepared(q, &k, &v, mask.as_ref(), dropout_p, is_causal, scale)
    })
}

fn sdpa_prepared(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    for (name, t) in [("query", query), ("key", key), ("value", value)] {
        if t.rank() < 2 {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name} must have at least 2 dims [.., seq, features], got shape {}",
                    t.shape()
                ),
            ));
        }
    }
    let (l, e) = (query.dims()[query.rank() - 2], query.dims()[query.rank() - 1]);
    let s = key.dims()[key.rank() - 2];
    if key.dims()[key.rank() - 1] != e {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: query.shape().clone(),
            rhs: key.shape().clone(),
            hint: "query and key must have the same feature size (last dim)",
        });
    }
    if value.dims()[value.rank() - 2] != s {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: key.shape().clone(),
            rhs: value.shape().clone(),
            hint: "key and value must have the same sequence length (second-to-last dim)",
        });
    }
    if is_causal && attn_mask.is_some() {
        return Err(Error::invalid(
            OP,
            "explicit attn_mask should not be set when is_causal=True",
        ));
    }
    let scale = scale.unwrap_or(1.0 / (e as f64).sqrt());
    // The fused backend where it runs the problem (no mask but the causal one, no dropout):
    // PyTorch's backend choice, cuDNN's kernels (`ember_core::ops::attention`).
    if attn_mask.is_none() && dropout_p == 0.0 {
        if let Some(out) = attention::scaled_dot_product_cudnn_attention(query, key, value, is_causal, scale)?
        {
            return Ok(out);
        }
    }
    if !ember_core::backends::cuda::math_sdp_enabled() {
        return Err(Error::invalid(
            OP,
            "no attention backend is enabled for this problem: the math path is off \
             (ember::backends::cuda::enable_math_sdp(true)) and the fused one does not run it",
        ));
    }
    // Half-precision inputs: the scores and the softmax in float32 and the weights rounded to
    // the input dtype for the second product, as PyTorch's fused (flash / memory-efficient)
    // kernels keep them on chip; rounding the scores to half first moves the softmax enough to
    // change gradients.
    let dtype = query.dtype();
    let half = matches!(dtype, DType::F16 | DType::BF16);
    let (q, k) = if half {
        (query.to_dtype(DType::F32)?, key.to_dtype(DType::F32)?)
    } else {
        (query.clone(), key.clone())
    };
    let scores = q.mul_scalar(scale)?.matmul(&k.transpose(-2, -1)?)?;
    let scores = if is_causal {
        // Keep j <= i: the upper triangle above the diagonal is masked.
        let i = Tensor::arange(0.0, l as f64, 1.0, DType::I64, query.device())?.unsqueeze(1)?;
        let j = Tensor::arange(0.0, s as f64, 1.0, DType::I64, query.device())?.unsqueeze(0)?;
        scores.masked_fill(&j.gt(&i)?, f64::NEG_INFINITY)?
    } else {
        match attn_mask {
            Some(m) if m.dtype() == DType::Bool => {
                scores.masked_fill(&m.logical_not()?, f64::NEG_INFINITY)?
            }
            Some(m) if m.dtype().is_floating_point() => scores.add(m)?,
            Some(m) => {
                return Err(Error::UnsupportedDType {
                    op: OP,
                    dtype: m.dtype(),
                    hint: "attn_mask must be a bool mask or a float mask of the query's dtype",
                })
            }
            None => scores,
        }
    };
    let weights = scores.softmax(-1)?.to_dtype(dtype)?;
    let weights = if dropout_p > 0.0 {
        dropout(&weights, dropout_p, true)?
    } else {
        weights
    };
    weights.matmul(value)
}

/// Grouped-query attention: `kv` (`[.., Hkv, S, E]`) with each head repeated for the
/// `H / Hkv` query heads it serves (`[.., H, S, E]`), as PyTorch's `enable_gqa=True`.
fn repeat_heads(query: &Tensor, kv: &Tensor) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    let (qr, kr) = (query.rank(), kv.rank());
    if qr < 3 || kr < 3 {
        return Err(Error::invalid(
            OP,
            "enable_gqa needs a heads dim: query and key/value of at least 3 dims [.., heads, seq, features]",
        ));
    }
    let (h, hkv) = (query.dims()[qr - 3], kv.dims()[kr - 3]);
    if hkv == 0 || h % hkv != 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "with enable_gqa the query heads ({h}) must be a multiple of the key/value heads ({hkv})"
            ),
        ));
    }
    if h == hkv {
        return Ok(kv.clone());
    }
    let mut grouped: Vec<usize> = kv.dims().to_vec();
    grouped.insert(kr - 2, h / hkv);
    let mut out: Vec<usize> = kv.dims().to_vec();
    out[kr - 3] = h;
    let to = |d: &[usize]| d.iter().map(|&x| x as isize).collect::<Vec<_>>();
    kv.unsqueeze(kr as isize - 2)?
        .expand(&to(&grouped))?
        .reshape(&to(&out))
}
