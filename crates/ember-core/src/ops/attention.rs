//! Fused attention: PyTorch's `_scaled_dot_product_cudnn_attention`, the fused backend of
//! `F.scaled_dot_product_attention` that never writes the `[.., L, S]` score matrix (cuDNN's
//! flash-attention engines on CUDA, `cuda_backend/cudnn_sdpa.rs`). ember-nn's
//! `scaled_dot_product_attention` takes it where it runs the problem and its switches allow
//! (`backends::cuda::enable_cudnn_sdp`), and the math path otherwise.

use super::binary::same_device;
use crate::autograd::{self, SavedTensor};
use crate::backend::geometry::{bshd_strides, dense_like, pack_grads, SdpaGrads, SdpaParams};
use crate::dispatch::{self, policy};
use crate::layout::Layout;
use crate::{Error, Result, Tensor};

const OP: &str = "_scaled_dot_product_cudnn_attention";

/// The problem of `q` `[b, h, l, e]`, `k` `[b, h, s, e]`, `v` `[b, h, s, ev]` (one dtype);
/// None for other ranks and shapes (the math path reports those).
fn problem(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Option<SdpaParams> {
    let (&[b, h, s_q, d], &[kb, kh, s_kv, kd], &[vb, vh, vs, d_v]) = (q.dims(), k.dims(), v.dims()) else {
        return None;
    };
    if (kb, kh, kd) != (b, h, d)
        || (vb, vh, vs) != (b, h, s_kv)
        || k.dtype() != q.dtype()
        || v.dtype() != q.dtype()
    {
        return None;
    }
    let at = |t: &Tensor| -> ([usize; 4], usize) {
        let s = t.layout().strides();
        ([s[0], s[1], s[2], s[3]], t.layout().offset())
    };
    Some(SdpaParams {
        dtype: q.dtype(),
        b,
        h,
        s_q,
        s_kv,
        d,
        d_v,
        q: at(q),
        k: at(k),
        v: at(v),
        causal,
        scale,
        grads: [
            bshd_strides(h, s_q, d_v),
            bshd_strides(h, s_q, d),
            bshd_strides(h, s_kv, d),
            bshd_strides(h, s_kv, d_v),
        ],
        grads_packed: None,
    })
}

/// `t` (`[b, h, s, d]`) in `[b, s, h, d]` memory order from element 0 of its storage: itself
/// when it already is, else a copy.
fn bshd(t: &Tensor) -> Result<Tensor> {
    let rows = t.transpose(1, 2)?;
    let rows = if rows.is_contiguous() && rows.layout().offset() == 0 {
        rows
    } else {
        rows.deep_clone()?
    };
    rows.transpose(1, 2)
}

/// Attention of `query` `[b, h, l, e]` over `key` `[b, h, s, e]` and `value` `[b, h, s, ev]`
/// (one floating dtype) with scores scaled by `scale` and, with `is_causal`, key position `j`
/// kept for query position `i` only when `j <= i`: `softmax(q kᵀ · scale) v` computed without
/// writing the scores (PyTorch's `_scaled_dot_product_cudnn_attention`). The output is
/// `[b, h, l, ev]` laid out in `[b, l, h, ev]` memory order, so `out.transpose(1, 2)` is
/// contiguous. Differentiable in all three inputs.
///
/// `Ok(None)` where the backend does not run the problem: the CPU, cuDNN off or missing, other
/// dtypes than bfloat16 and float16, head dims past 128, unaligned operands; callers then take
/// the math path (`ember_nn::functional::scaled_dot_product_attention` does).
pub fn scaled_dot_product_cudnn_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    is_causal: bool,
    scale: f64,
) -> Result<Option<Tensor>> {
    dispatch::call_list(
        &policy::SCALED_DOT_PRODUCT_CUDNN_ATTENTION,
        &[query, key, value],
        |p, door| {
            let (q, k, v) = (&p[0], &p[1], &p[2]);
            if !crate::backends::cuda::cudnn_sdp_enabled() {
                return Ok(None);
            }
            let Some(params) = problem(q, k, v, is_causal, scale) else {
                return Ok(None);
            };
            let ran = {
                let (sq, sk, sv) = (q.storage().read(), k.storage().read(), v.storage().read());
                sq.sdpa_forward(&sk, &sv, &params)?
            };
            let Some((o, lse)) = ran else {
                return Ok(None);
            };
            let (b, h, l, ev) = (params.b, params.h, params.s_q, params.d_v);
            let rows = door.tensor(o, [b, l, h, ev]);
            let out = rows.view_with(Layout::contiguous([b, l, h, ev]).transpose(1, 2));
            if !autograd::needs_grad(&[q, k, v]) {
                return Ok(Some(out));
            }
            let lse = door.tensor(lse, [b, h, l]);
            let saved = [q, k, v, &out].map(|t| SavedTensor::new(OP, t));
            // The node is PyTorch's `ScaledDotProductCudnnAttentionBackward0`.
            Ok(Some(door.record(OP, &[q, k, v], out, move |g, _| {
                let [q, k, v, o] = [0, 1, 2, 3].map(|i| saved[i].get());
                let (q, k, v, o) = (q?, k?, v?, o?);
                same_device(OP, &[q, g])?;
                let g = g.to_dtype(q.dtype())?;
                let run = |g: &Tensor, p: &SdpaParams| {
                    let (sq, sk, sv) = (q.storage().read(), k.storage().read(), v.storage().read());
                    let (so, sl, sg) = (o.storage().read(), lse.storage().read(), g.storage().read());
                    sq.sdpa_backward(&sk, &sv, &so, &sl, &sg, p)
                };
                // Note [Attention gradients in place]: the output gradient is read where it
                // lies, and each input's gradient is written in that input's memory order (as
                // PyTorch's `empty_like`): a row-major q gets a row-major dq, which its
                // `.grad` keeps without a copy. Where the engine refuses those strides, the
                // layout of the forward's output for all four (one copy of g).
                //
                // Note [Attention gradients in one buffer]: where q, k and v are views of one
                // projection (GPT-2's `qkv.split(c, 2)`), their gradients are written into one
                // buffer at the views' own offsets and strides, so that the projection's
                // gradient is that buffer: the engine takes slices that tile their input and
                // lie where they belong as the input's gradient without a copy (Note
                // [Gradients of views] in `autograd/engine.rs`). Written separately, the three
                // were copied into the projection's gradient: 36 copies, 0.44 ms of GPT-2's
                // 19.4 ms step (docs/benchmarks.md, session 44).
                let mut own = params;
                let strides = |t: &Tensor| {
                    let s = t.layout().strides();
                    [s[0], s[1], s[2], s[3]]
                };
                let dims = |t: &Tensor| [t.dims()[0], t.dims()[1], t.dims()[2], t.dims()[3]];
                let mut grads = None;
                let gs = g.layout().strides();
                if g.layout().offset() == 0 && gs[3] == 1 && gs.iter().all(|&s| s > 0) {
                    own.grads[0] = strides(&g);
                    let one_projection = q.shares_storage_with(&k)
                        && q.shares_storage_with(&v)
                        && [&k, &v]
                            .iter()
                            .all(|t| t.dims() == q.dims() && t.layout().strides() == q.layout().strides());
                    own.grads_packed = one_projection
                        .then(|| pack_grads(dims(&q), strides(&q), [&q, &k, &v].map(|t| t.layout().offset())))
                        .flatten();
                    for (slot, t) in own.grads[1..].iter_mut().zip([&q, &k, &v]) {
                        *slot = match own.grads_packed {
                            Some(_) => strides(t),
                            None => dense_like(dims(t), strides(t)).unwrap_or(*slot),
                        };
                    }
                    grads = run(&g, &own)?.map(|r| (r, own));
                }
                if grads.is_none() {
                    grads = run(&bshd(&g)?, &params)?.map(|r| (r, params));
                }
                let Some((result, used)) = grads else {
                    return Err(Error::Cuda {
                    op: OP,
                    msg: "cuDNN ran this attention forward but no engine takes its backward; turn the fused \
                          path off for training (ember::backends::cuda::enable_cudnn_sdp(false)) and report \
                          the shapes"
                        .into(),
                });
                };
                let view = |t: &Tensor, seq: usize, dim: usize, strides: [usize; 4], offset: usize| {
                    let dims = [b, h, seq, dim];
                    t.view_with(Layout::new(dims.into(), strides.to_vec(), offset))
                };
                let (s, d, layouts) = (params.s_kv, params.d, used.grads);
                let (dq, dk, dv) = match (result, used.grads_packed) {
                    (SdpaGrads::Packed(buf), Some(pk)) => {
                        let buf = door.tensor(buf, [pk.len]);
                        let [oq, ok, ov] = pk.offsets;
                        (
                            view(&buf, l, d, layouts[1], oq),
                            view(&buf, s, d, layouts[2], ok),
                            view(&buf, s, ev, layouts[3], ov),
                        )
                    }
                    (SdpaGrads::Separate(dq, dk, dv), _) => (
                        view(&door.tensor(dq, [b * l * h * d]), l, d, layouts[1], 0),
                        view(&door.tensor(dk, [b * s * h * d]), s, d, layouts[2], 0),
                        view(&door.tensor(dv, [b * s * h * ev]), s, ev, layouts[3], 0),
                    ),
                    (SdpaGrads::Packed(_), None) => {
                        return Err(Error::Autograd(format!(
                            "{OP}: the backend wrote one gradient buffer where three were asked for"
                        )))
                    }
                };
                Ok(vec![Some(dq), Some(dk), Some(dv)])
            })))
        },
    )
}
