//! `scaled_dot_product_attention` (`torch.nn.functional.scaled_dot_product_attention`, the
//! aten op of that name): PyTorch's backend choice, the fused path of `attention.rs` (cuDNN's
//! kernels) where it runs the problem, else the math path, `softmax(q kᵀ · scale + mask) v`
//! with an optional boolean or additive mask, a causal mask, and dropout on the attention
//! weights.
//!
//! The math path materializes the `[.., L, S]` score matrix (two batched GEMMs, a softmax and
//! the masking ops).

use super::attention;
use super::dropout::dropout;
use crate::dispatch::{self, policy};
use crate::{DType, Error, Result, Tensor};

/// Attention of `query` `[.., L, E]` over `key` `[.., S, E]` and `value` `[.., S, Ev]`, giving
/// `[.., L, Ev]`, with PyTorch's arguments: `attn_mask` broadcasts to `[.., L, S]` (a bool mask
/// keeps the positions where it is true, a float mask is added to the scores); `dropout_p`
/// drops attention weights; `is_causal` keeps position `j <= i` only and excludes
/// `attn_mask`; `scale` is the factor of the scores (`1 / √E` when `None`); with `enable_gqa`
/// key and value may have fewer heads (dim -3) than the query, a divisor of its count.
/// ember-nn's `F::scaled_dot_product_attention_with` takes them as keyword options.
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
) -> Result<Tensor> {
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
    // PyTorch's backend choice, cuDNN's kernels (`attention.rs`).
    if attn_mask.is_none() && dropout_p == 0.0 {
        if let Some(out) = attention::scaled_dot_product_cudnn_attention(query, key, value, is_causal, scale)?
        {
            return Ok(out);
        }
    }
    if !crate::backends::cuda::math_sdp_enabled() {
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
