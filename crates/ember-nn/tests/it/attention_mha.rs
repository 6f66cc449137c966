//! `multi_head_attention_forward`: against a host loop over batch and head, in every layout
//! (batch-first, sequence-first, unbatched), with bool, float, per-head and causal masks,
//! self-attention's packed projection, `need_weights`, an f64 gradient check and errors.

use crate::common::{assert_close, assert_close_slice, gradcheck};
use crate::recurrent::{rand, row_dot, rows};
use ember_core::{DType, Device, Error, Tensor};
use ember_nn::functional as F;

const CPU: Device = Device::Cpu;

struct Mha {
    w_in: Tensor,
    b_in: Tensor,
    w_out: Tensor,
    b_out: Tensor,
}

fn mha_params(e: usize, seed: u64) -> Mha {
    Mha {
        w_in: rand(&[3 * e, e], seed),
        b_in: rand(&[3 * e], seed + 1),
        w_out: rand(&[e, e], seed + 2),
        b_out: rand(&[e], seed + 3),
    }
}

/// MHA of batch-first `[N, L, E]` inputs by loops over batch and head on the host, with a bool
/// mask (`true` = masked out) of `[L, S]`.
fn mha_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    p: &Mha,
    mask: Option<&[bool]>,
) -> Vec<f64> {
    let (n, l, e) = (q.dims()[0], q.dims()[1], q.dims()[2]);
    let s = k.dims()[1];
    let hd = e / heads;
    let (wi, bi) = (p.w_in.to_vec_f64().unwrap(), p.b_in.to_vec_f64().unwrap());
    let (wo, bo) = (p.w_out.to_vec_f64().unwrap(), p.b_out.to_vec_f64().unwrap());
    let proj = |t: &Tensor, part: usize| -> Vec<Vec<f64>> {
        rows(t)
            .iter()
            .map(|x| {
                (0..e)
                    .map(|r| row_dot(&wi, part * e + r, x) + bi[part * e + r])
                    .collect()
            })
            .collect()
    };
    let (qp, kp, vp) = (proj(q, 0), proj(k, 1), proj(v, 2));
    let mut out = Vec::new();
    for b in 0..n {
        for i in 0..l {
            let mut merged = vec![0.0; e];
            for hh in 0..heads {
                let qi = &qp[b * l + i][hh * hd..(hh + 1) * hd];
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        if mask.is_some_and(|m| m[i * s + j]) {
                            f64::NEG_INFINITY
                        } else {
                            let kj = &kp[b * s + j][hh * hd..(hh + 1) * hd];
                            qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>() / (hd as f64).sqrt()
                        }
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ex: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = ex.iter().sum();
                for j in 0..s {
                    for d in 0..hd {
                        merged[hh * hd + d] += ex[j] / z * vp[b * s + j][hh * hd + d];
                    }
                }
            }
            out.extend((0..e).map(|r| row_dot(&wo, r, &merged) + bo[r]));
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn mha(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    p: &Mha,
    mask: Option<&Tensor>,
    causal: bool,
    batch_first: bool,
    need_weights: bool,
) -> ember_core::Result<(Tensor, Option<Tensor>)> {
    let e = q.dims()[q.rank() - 1];
    F::multi_head_attention_forward(
        q,
        k,
        v,
        e,
        heads,
        &p.w_in,
        Some(&p.b_in),
        &p.w_out,
        Some(&p.b_out),
        mask,
        causal,
        batch_first,
        need_weights,
    )
}

fn causal_mask(l: usize, s: usize) -> (Tensor, Vec<bool>) {
    let m: Vec<bool> = (0..l * s).map(|k| k % s > k / s).collect();
    (Tensor::from_slice(&m, [l, s], CPU).unwrap(), m)
}

#[test]
fn mha_matches_reference_in_every_form() {
    let (n, l, s, e, heads) = (2, 3, 4, 6, 2);
    let p = mha_params(e, 10);
    let q = rand(&[n, l, e], 1);
    let k = rand(&[n, s, e], 2);
    let v = rand(&[n, s, e], 3);
    let expected = mha_reference(&q, &k, &v, heads, &p, None);
    let (out, w) = mha(&q, &k, &v, heads, &p, None, false, true, false).unwrap();
    assert!(w.is_none());
    assert_eq!(out.dims(), [n, l, e]);
    assert_close_slice(&out.to_vec_f64().unwrap(), &expected, 1e-12, 1e-13);

    // Sequence-first layout: the same numbers transposed.
    let tf = |t: &Tensor| t.transpose(0, 1).unwrap().contiguous().unwrap();
    let (out_s, _) = mha(&tf(&q), &tf(&k), &tf(&v), heads, &p, None, false, false, false).unwrap();
    assert_eq!(out_s.dims(), [l, n, e]);
    assert_close(&tf(&out_s), &out, 1e-13, 1e-14);

    // need_weights: the same output, weights [N, L, S] averaged over heads, rows summing to 1.
    let (out_w, w) = mha(&q, &k, &v, heads, &p, None, false, true, true).unwrap();
    assert_close(&out_w, &out, 1e-12, 1e-13);
    let w = w.unwrap();
    assert_eq!(w.dims(), [n, l, s]);
    let ones = Tensor::ones([n, l], DType::F64, CPU).unwrap();
    assert_close(&w.sum_dim(-1, false).unwrap(), &ones, 1e-13, 0.0);

    // Unbatched [L, E].
    let (out_u, _) = mha(
        &q.select(0, 1).unwrap(),
        &k.select(0, 1).unwrap(),
        &v.select(0, 1).unwrap(),
        heads,
        &p,
        None,
        false,
        true,
        false,
    )
    .unwrap();
    assert_close(&out_u, &out.select(0, 1).unwrap(), 1e-13, 1e-14);
}

#[test]
fn mha_masks_and_self_attention() {
    let (n, l, e, heads) = (2, 4, 4, 2);
    let p = mha_params(e, 20);
    let x = rand(&[n, l, e], 1);
    let (mask, host_mask) = causal_mask(l, l);
    let expected = mha_reference(&x, &x, &x, heads, &p, Some(&host_mask));

    // Self-attention (one packed projection) with a bool mask.
    let (out, _) = mha(&x, &x, &x, heads, &p, Some(&mask), false, true, false).unwrap();
    assert_close_slice(&out.to_vec_f64().unwrap(), &expected, 1e-12, 1e-13);
    // The same through three projections of equal copies.
    let (y, z) = (x.deep_clone().unwrap(), x.deep_clone().unwrap());
    let (out3, _) = mha(&x, &y, &z, heads, &p, Some(&mask), false, true, false).unwrap();
    assert_close(&out3, &out, 1e-12, 1e-13);
    // A float mask of -inf, a [N·heads, L, S] mask, the is_causal hint, and need_weights.
    let fmask = Tensor::zeros([l, l], DType::F64, CPU)
        .unwrap()
        .masked_fill(&mask, f64::NEG_INFINITY)
        .unwrap();
    let (o, _) = mha(&x, &x, &x, heads, &p, Some(&fmask), false, true, false).unwrap();
    assert_close(&o, &out, 1e-12, 1e-13);
    let m3 = mask
        .unsqueeze(0)
        .unwrap()
        .expand(&[(n * heads) as isize, l as isize, l as isize])
        .unwrap();
    let (o, _) = mha(&x, &x, &x, heads, &p, Some(&m3), false, true, false).unwrap();
    assert_close(&o, &out, 1e-12, 1e-13);
    for need_weights in [false, true] {
        let (o, w) = mha(&x, &x, &x, heads, &p, Some(&mask), true, true, need_weights).unwrap();
        assert_close(&o, &out, 1e-12, 1e-13);
        if let Some(w) = w {
            // Row i attends to positions j <= i only.
            let wv = w.to_vec_f64().unwrap();
            for (k, wk) in wv.iter().enumerate() {
                if host_mask[k % (l * l)] {
                    assert_eq!(*wk, 0.0);
                }
            }
        }
    }
    let (o, _) = mha(&x, &x, &x, heads, &p, None, true, true, false).unwrap();
    assert_close(&o, &out, 1e-12, 1e-13);
}

#[test]
fn mha_gradcheck_and_errors() {
    let (n, l, s, e, heads) = (2, 3, 2, 4, 2);
    let p = mha_params(e, 30);
    let (mask, _) = causal_mask(l, s);
    gradcheck(
        |a| {
            let pp = Mha {
                w_in: a[3].clone(),
                b_in: a[4].clone(),
                w_out: a[5].clone(),
                b_out: a[6].clone(),
            };
            Ok(mha(&a[0], &a[1], &a[2], heads, &pp, Some(&mask), false, true, false)?.0)
        },
        &[
            rand(&[n, l, e], 1),
            rand(&[n, s, e], 2),
            rand(&[n, s, e], 3),
            p.w_in.clone(),
            p.b_in.clone(),
            p.w_out.clone(),
            p.b_out.clone(),
        ],
    );

    let q = rand(&[n, l, e], 1);
    let k = rand(&[n, s, e], 2);
    let inv = |r: ember_core::Result<(Tensor, Option<Tensor>)>| {
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "got {r:?}");
    };
    // embed_dim not divisible by num_heads.
    inv(mha(&q, &k, &k, 3, &p, None, false, true, false));
    // Wrong feature size; wrong mask shape; wrong in_proj shape.
    inv(mha(
        &rand(&[n, l, 3], 1),
        &k,
        &k,
        heads,
        &p,
        None,
        false,
        true,
        false,
    ));
    inv(mha(
        &q,
        &k,
        &k,
        heads,
        &p,
        Some(&causal_mask(l, l).0),
        false,
        true,
        false,
    ));
    let bad = Mha {
        w_in: rand(&[2 * e, e], 1),
        ..mha_params(e, 30)
    };
    inv(mha(&q, &k, &k, heads, &bad, None, false, true, false));
    // key and value of different shapes; batch sizes that differ.
    let r = mha(
        &q,
        &k,
        &rand(&[n, s + 1, e], 4),
        heads,
        &p,
        None,
        false,
        true,
        false,
    );
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "got {r:?}");
    let r = mha(
        &q,
        &rand(&[n + 1, s, e], 4),
        &rand(&[n + 1, s, e], 5),
        heads,
        &p,
        None,
        false,
        true,
        false,
    );
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "got {r:?}");
}
