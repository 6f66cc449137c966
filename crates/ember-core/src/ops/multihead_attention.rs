//! `multi_head_attention_forward` (`F.multi_head_attention_forward`): the forward of
//! `nn.MultiheadAttention` with packed input projection weights (`in_proj_weight` `[3E, E]`,
//! `in_proj_bias`) and an output projection (`out_proj.weight`, `out_proj.bias`). As in
//! PyTorch, where it is Python over aten ops, it has no dispatch entry of its own: its
//! projections enter as `linear`, its attention as `scaled_dot_product_attention`.
//!
//! The work is the q/k/v projection (one GEMM when query, key and value are the same tensor,
//! three otherwise), a split into heads by view, [`scaled_dot_product_attention`] over
//! `[N, heads, L, head_dim]`, a merge of the heads and the output GEMM. With `need_weights`
//! the attention weights are computed explicitly (sdpa does not return them) and averaged over
//! the heads, as PyTorch's default `average_attn_weights=True`. ember-nn's functional API
//! takes the key padding mask and the attention dropout as options (`MhaOptions`).

use super::conv::as_isize;
use super::dropout::dropout;
use super::sdpa::scaled_dot_product_attention;
use crate::{DType, Error, Result, Tensor};

/// Whether `a` and `b` are the same view of the same storage (self-attention).
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage_with(b)
        && a.dims() == b.dims()
        && a.stride() == b.stride()
        && a.storage_offset() == b.storage_offset()
        && a.dtype() == b.dtype()
}

/// `[N, T, E]` to `[N, heads, T, E / heads]`.
fn split_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, len, e) = (t.dims()[0], t.dims()[1], t.dims()[2]);
    t.reshape(&as_isize(&[n, len, heads, e / heads]))?.transpose(1, 2)
}

/// The attention mask in sdpa's terms, broadcasting to `[N, heads, L, S]`: PyTorch's MHA mask
/// is `[L, S]` or `[N·heads, L, S]`, bool `true` meaning "may NOT attend" (the opposite of
/// sdpa's bool mask) or float, added to the scores.
fn sdpa_mask(
    op: &'static str,
    mask: &Tensor,
    like: &Tensor,
    n: usize,
    heads: usize,
    l: usize,
    s: usize,
) -> Result<Tensor> {
    let m = match mask.dims() {
        [ml, ms] if (*ml, *ms) == (l, s) => mask.clone(),
        [b, ml, ms] if (*b, *ml, *ms) == (n * heads, l, s) => mask.reshape(&as_isize(&[n, heads, l, s]))?,
        _ => {
            return Err(Error::invalid(
                op,
                format!(
                "attn_mask must be [L, S] = [{l}, {s}] or [N·num_heads, L, S] = [{}, {l}, {s}], got shape {}",
                n * heads,
                mask.shape()
            ),
            ))
        }
    };
    match m.dtype() {
        DType::Bool => m.logical_not(),
        d if d == like.dtype() => Ok(m),
        d => Err(Error::UnsupportedDType {
            op,
            dtype: d,
            hint: "attn_mask must be bool (true = masked out) or of the query's float dtype",
        }),
    }
}

/// `true` where key position `j` is after query position `i` (masked out by a causal mask),
/// `[L, S]`.
fn causal_mask(l: usize, s: usize, like: &Tensor) -> Result<Tensor> {
    let i = Tensor::arange(0.0, l as f64, 1.0, DType::I64, like.device())?.unsqueeze(1)?;
    let j = Tensor::arange(0.0, s as f64, 1.0, DType::I64, like.device())?.unsqueeze(0)?;
    j.gt(&i)
}

/// A bool mask (`true` = masked out) as a float mask of `like`'s dtype: `-inf` where masked.
fn bool_to_float(masked: &Tensor, like: &Tensor) -> Result<Tensor> {
    Tensor::zeros(masked.shape(), like.dtype(), like.device())?.masked_fill(masked, f64::NEG_INFINITY)
}

/// The key padding mask (`[N, S]`, or `[S]` unbatched; bool `true` = ignore, or float) as a
/// float mask `[N, 1, 1, S]` that broadcasts over heads and queries.
fn padding_mask(
    op: &'static str,
    kpm: &Tensor,
    like: &Tensor,
    batched: bool,
    n: usize,
    s: usize,
) -> Result<Tensor> {
    let expected: &[usize] = if batched { &[n, s] } else { &[s] };
    if kpm.dims() != expected {
        return Err(Error::invalid(
            op,
            format!(
                "key_padding_mask must be {expected:?} ([batch, source length]{}), got shape {}",
                if batched {
                    ""
                } else {
                    " without the batch dim for unbatched input"
                },
                kpm.shape()
            ),
        ));
    }
    let m = match kpm.dtype() {
        DType::Bool => bool_to_float(kpm, like)?,
        d if d == like.dtype() => kpm.clone(),
        d => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: d,
                hint: "key_padding_mask must be bool (true = ignored) or of the query's float dtype",
            })
        }
    };
    m.reshape(&as_isize(&[n, 1, 1, s]))
}

/// `nn.MultiheadAttention`'s forward (`F.multi_head_attention_forward`) with packed
/// projections; returns `(attn_output, attn_weights)`.
///
/// `query` is `[L, N, E]`, `key`/`value` `[S, N, E]` (`[N, L, E]`/`[N, S, E]` with
/// `batch_first`; unbatched `[L, E]`/`[S, E]` too), `E = embed_dim` split over `num_heads`
/// heads. `in_proj_weight` is `[3E, E]` stacking the q, k, v projections, `in_proj_bias`
/// `[3E]`, `out_proj_weight` `[E, E]`, `out_proj_bias` `[E]`. `attn_mask` is `[L, S]` or
/// `[N·num_heads, L, S]`, bool (`true` = may not attend) or float (added to the scores).
/// `is_causal` is PyTorch's hint that `attn_mask` is the causal mask: the causal mask is
/// applied and `attn_mask` is not read, unless `need_weights` asks for the weights, which are
/// then computed with `attn_mask`; without `attn_mask` it builds the causal mask (where
/// PyTorch raises). `attn_weights` (with `need_weights`) is the softmax averaged over heads,
/// `[N, L, S]` (`[L, S]` unbatched).
///
/// `key_padding_mask` is `[N, S]` (`[S]` unbatched): bool `true` marks a key position to
/// ignore, a float mask (of the query's dtype) is added to the scores of every query and head.
/// With it the masks are merged into one float mask, as PyTorch does: `is_causal` then stands
/// for the causal mask (built when `attn_mask` is absent) plus the padding mask. `dropout_p` is
/// the probability of zeroing an attention weight (PyTorch's `dropout_p` with `training=True`;
/// pass 0 in evaluation); with `need_weights` the returned weights are those after dropout,
/// averaged over heads, as PyTorch's.
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
    key_padding_mask: Option<&Tensor>,
    dropout_p: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "multi_head_attention_forward";
    let e = embed_dim;
    if num_heads == 0 || e == 0 || !e.is_multiple_of(num_heads) {
        return Err(Error::invalid(
            OP,
            format!("embed_dim ({e}) must be positive and divisible by num_heads ({num_heads})"),
        ));
    }
    if !query.dtype().is_floating_point() {
        return Err(Error::dtype(OP, query.dtype()));
    }
    let batched = query.rank() == 3;
    for (name, t) in [("query", query), ("key", key), ("value", value)] {
        let rank_ok = if batched { t.rank() == 3 } else { t.rank() == 2 };
        if !rank_ok || t.dims()[t.rank() - 1] != e {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name} must be {} with embed_dim = {e} features (query has shape {}), got shape {}",
                    if batched {
                        "3-D [L or S, N, E] ([N, L or S, E] with batch_first)"
                    } else {
                        "2-D [L or S, E] (unbatched)"
                    },
                    query.shape(),
                    t.shape()
                ),
            ));
        }
        if t.dtype() != query.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: query.dtype(),
                found: t.dtype(),
            });
        }
    }
    if key.dims() != value.dims() {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: key.shape().clone(),
            rhs: value.shape().clone(),
            hint: "key and value must have the same shape",
        });
    }
    let params = [
        ("in_proj_weight", Some(in_proj_weight), vec![3 * e, e]),
        ("in_proj_bias", in_proj_bias, vec![3 * e]),
        ("out_proj.weight", Some(out_proj_weight), vec![e, e]),
        ("out_proj.bias", out_proj_bias, vec![e]),
    ];
    for (name, t, shape) in params {
        if let Some(t) = t {
            if t.dims() != shape.as_slice() {
                return Err(Error::invalid(
                    OP,
                    format!("{name} must have shape {shape:?}, got {}", t.shape()),
                ));
            }
        }
    }

    // Work batch-first: [N, L, E]. The in-projection reads the inputs as PyTorch does,
    // sequence-first ([L, N, E]: a transposed view when batch_first), and then goes batch-first:
    // `linear` with a bias rounds once for a contiguous input and twice for a transposed one, as
    // PyTorch's does.
    let projected = |t: &Tensor, w: &Tensor, b: Option<&Tensor>| -> Result<Tensor> {
        match (batched, batch_first) {
            (false, _) => t.unsqueeze(1)?.linear(w, b)?.transpose(0, 1),
            (true, true) => t.transpose(0, 1)?.linear(w, b)?.transpose(0, 1),
            (true, false) => t.linear(w, b)?.transpose(0, 1),
        }
    };
    let self_attention = same_tensor(query, key) && same_tensor(key, value);
    let (q, k, v) = if self_attention {
        let qkv = projected(query, in_proj_weight, in_proj_bias)?.chunk(3, -1)?;
        (qkv[0].clone(), qkv[1].clone(), qkv[2].clone())
    } else {
        let w = in_proj_weight.chunk(3, 0)?;
        let b = in_proj_bias.map(|b| b.chunk(3, 0)).transpose()?;
        let proj = |t: &Tensor, i: usize| projected(t, &w[i], b.as_ref().map(|b| &b[i]));
        (proj(query, 0)?, proj(key, 1)?, proj(value, 2)?)
    };
    let (n, l, s) = (q.dims()[0], q.dims()[1], k.dims()[1]);
    if k.dims()[0] != n {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: query.shape().clone(),
            rhs: key.shape().clone(),
            hint: "query and key must have the same batch size",
        });
    }
    let mut mask = attn_mask
        .map(|m| sdpa_mask(OP, m, query, n, num_heads, l, s))
        .transpose()?;
    let mut is_causal = is_causal;
    if let Some(kpm) = key_padding_mask {
        let padding = padding_mask(OP, kpm, query, batched, n, s)?;
        let base = match mask {
            Some(m) if m.dtype() == DType::Bool => Some(bool_to_float(&m.logical_not()?, query)?),
            Some(m) => Some(m),
            None if is_causal => Some(bool_to_float(&causal_mask(l, s, query)?, query)?),
            None => None,
        };
        mask = Some(match base {
            Some(b) => b.add(&padding)?,
            None => padding,
        });
        is_causal = false;
    }
    if !(0.0..=1.0).contains(&dropout_p) {
        return Err(Error::invalid(
            OP,
            format!("dropout_p should be a number in range [0, 1], got {dropout_p}"),
        ));
    }
    let (q, k, v) = (
        split_heads(&q, num_heads)?,
        split_heads(&k, num_heads)?,
        split_heads(&v, num_heads)?,
    );

    let (heads_out, weights) = if need_weights {
        let scale = 1.0 / ((e / num_heads) as f64).sqrt();
        let mut scores = q.mul_scalar(scale)?.matmul(&k.transpose(-2, -1)?)?;
        scores = match &mask {
            Some(m) if m.dtype() == DType::Bool => {
                scores.masked_fill(&m.logical_not()?, f64::NEG_INFINITY)?
            }
            Some(m) => scores.add(m)?,
            None if is_causal => scores.masked_fill(&causal_mask(l, s, query)?, f64::NEG_INFINITY)?,
            None => scores,
        };
        let mut w = scores.softmax(-1)?;
        if dropout_p > 0.0 {
            w = dropout(&w, dropout_p, true)?;
        }
        let out = w.matmul(&v)?;
        (out, Some(w.mean_dims(&[1], false)?))
    } else if is_causal {
        // PyTorch's hint: attn_mask is the causal mask, so sdpa applies it itself.
        (
            scaled_dot_product_attention(&q, &k, &v, None, dropout_p, true, None, false)?,
            None,
        )
    } else {
        (
            scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), dropout_p, false, None, false)?,
            None,
        )
    };

    // [N, heads, L, hd] -> [N, L, E] -> output projection.
    let merged = heads_out.transpose(1, 2)?.reshape(&as_isize(&[n, l, e]))?;
    let out = merged.linear(out_proj_weight, out_proj_bias)?;
    let out = match (batched, batch_first) {
        (false, _) => out.squeeze_dim(0)?,
        (true, true) => out,
        (true, false) => out.transpose(0, 1)?,
    };
    let weights = match weights {
        Some(w) if !batched => Some(w.squeeze_dim(0)?),
        w => w,
    };
    Ok((out, weights))
}
