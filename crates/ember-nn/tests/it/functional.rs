//! `ember_nn::functional` layers: hand-computed values, f64 finite-difference gradient checks,
//! and argument errors, for linear/conv, pooling, normalization, attention and dropout.

use crate::common::{assert_close, assert_close_slice, devices, gradcheck, t64, values};
use ember_core::{manual_seed, no_grad, DType, Device, Error, Generator, Tensor};
use ember_nn::functional as F;

const CPU: Device = Device::Cpu;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    t64(&values(shape.iter().product(), seed), shape, CPU)
}

/// A direct (loop) 2-D convolution of f64 data, the reference for `conv2d`.
#[allow(clippy::too_many_arguments)]
fn conv2d_reference(
    x: &Tensor,
    w: &Tensor,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> (Vec<f64>, [usize; 4]) {
    let (xd, wd) = (x.dims().to_vec(), w.dims().to_vec());
    let (xv, wv) = (x.to_vec_f64().unwrap(), w.to_vec_f64().unwrap());
    let (n, c, h, wi) = (xd[0], xd[1], xd[2], xd[3]);
    let (o, cg, kh, kw) = (wd[0], wd[1], wd[2], wd[3]);
    let oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) / stride[0] + 1;
    let ow = (wi + 2 * padding[1] - dilation[1] * (kw - 1) - 1) / stride[1] + 1;
    let og = o / groups;
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for y in 0..oh {
                for xo in 0..ow {
                    let mut acc = 0.0;
                    for ci in 0..cg {
                        let ic = g * cg + ci;
                        for i in 0..kh {
                            for j in 0..kw {
                                let yy = (y * stride[0] + i * dilation[0]) as i64 - padding[0] as i64;
                                let xx = (xo * stride[1] + j * dilation[1]) as i64 - padding[1] as i64;
                                if yy < 0 || xx < 0 || yy >= h as i64 || xx >= wi as i64 {
                                    continue;
                                }
                                let xi = ((b * c + ic) * h + yy as usize) * wi + xx as usize;
                                let wj = ((oc * cg + ci) * kh + i) * kw + j;
                                acc += xv[xi] * wv[wj];
                            }
                        }
                    }
                    out[((b * o + oc) * oh + y) * ow + xo] = acc;
                }
            }
        }
    }
    (out, [n, o, oh, ow])
}

#[test]
fn conv2d_matches_a_direct_convolution() {
    let cases = [
        ([1, 1], [0, 0], [1, 1], 1),
        ([2, 1], [1, 2], [1, 1], 1),
        ([1, 2], [2, 1], [2, 1], 2),
        ([3, 3], [1, 1], [1, 2], 4),
    ];
    for (k, (stride, padding, dilation, groups)) in cases.into_iter().enumerate() {
        let x = rand(&[2, 4, 7, 6], 10 + k as u64);
        let w = rand(&[8, 4 / groups, 3, 2], 20 + k as u64);
        let (expected, dims) = conv2d_reference(&x, &w, stride, padding, dilation, groups);
        let y = F::conv2d(&x, &w, None, stride, padding, dilation, groups).unwrap();
        assert_eq!(y.dims(), dims, "case {k}");
        assert!(y.is_contiguous());
        assert_close_slice(&y.to_vec_f64().unwrap(), &expected, 1e-12, 1e-12);
    }
}

#[test]
fn conv2d_unbatched_and_bias() {
    let x = rand(&[2, 4, 4], 1);
    let w = rand(&[3, 2, 2, 2], 2);
    let b = t64(&[1.0, -2.0, 0.5], &[3], CPU);
    let y = F::conv2d(&x, &w, Some(&b), 1, 0, 1, 1).unwrap();
    assert_eq!(y.dims(), [3, 3, 3]);
    let y0 = F::conv2d(&x.unsqueeze(0).unwrap(), &w, None, 1, 0, 1, 1).unwrap();
    let expected = y0
        .squeeze_dim(0)
        .unwrap()
        .add(&b.reshape(&[3, 1, 1]).unwrap())
        .unwrap();
    assert_close(&y, &expected, 1e-12, 1e-12);
}

#[test]
fn conv1d_is_conv2d_of_height_one() {
    // [1, 2, 3] * [1, 1] with padding 1: [0+1, 1+2, 2+3, 3+0].
    let x = t64(&[1.0, 2.0, 3.0], &[1, 1, 3], CPU);
    let w = t64(&[1.0, 1.0], &[1, 1, 2], CPU);
    let y = F::conv1d(&x, &w, None, 1, 1, 1, 1).unwrap();
    assert_eq!(y.dims(), [1, 1, 4]);
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![1.0, 3.0, 5.0, 3.0]);
    let y = F::conv1d(&x, &w, None, 2, 1, 1, 1).unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![1.0, 5.0]);
}

#[test]
fn conv_gradients() {
    let x = rand(&[2, 2, 4, 5], 3);
    let w = rand(&[4, 1, 2, 3], 4);
    let b = rand(&[4], 5);
    gradcheck(
        |t| F::conv2d(&t[0], &t[1], Some(&t[2]), [2, 1], [1, 1], [1, 2], 2),
        &[x, w, b],
    );
    let x = rand(&[2, 3, 6], 6);
    let w = rand(&[2, 3, 3], 7);
    gradcheck(|t| F::conv1d(&t[0], &t[1], None, 2, 1, 1, 1), &[x, w]);
}

#[test]
fn linear_and_unfold() {
    let x = rand(&[2, 3, 5], 8);
    let w = rand(&[4, 5], 9);
    let b = rand(&[4], 10);
    gradcheck(|t| F::linear(&t[0], &t[1], Some(&t[2])), &[x, w, b]);
    let x = Tensor::arange(0.0, 9.0, 1.0, DType::F64, CPU)
        .unwrap()
        .reshape(&[1, 1, 3, 3])
        .unwrap();
    let cols = F::unfold(&x, 2, 1, 0, 1).unwrap();
    assert_eq!(cols.dims(), [1, 4, 4]);
    #[rustfmt::skip]
    let expected = vec![
        0.0, 1.0, 3.0, 4.0,
        1.0, 2.0, 4.0, 5.0,
        3.0, 4.0, 6.0, 7.0,
        4.0, 5.0, 7.0, 8.0,
    ];
    assert_eq!(cols.to_vec::<f64>().unwrap(), expected);
}

#[test]
fn conv_argument_errors() {
    let x = rand(&[1, 4, 5, 5], 1);
    let w = rand(&[6, 4, 3, 3], 2);
    let err = |r: ember_core::Result<Tensor>| r.expect_err("expected an error");
    // groups that do not divide, and a weight whose in_channels/groups is wrong
    assert!(matches!(
        err(F::conv2d(&x, &w, None, 1, 0, 1, 3)),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        err(F::conv2d(&x, &w, None, 1, 0, 1, 2)),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        err(F::conv2d(&x, &w, None, 0, 0, 1, 1)),
        Error::InvalidArgument { .. }
    ));
    assert!(matches!(
        err(F::conv2d(&x, &w, None, 1, 0, 3, 1)),
        Error::InvalidArgument { .. }
    ));
    let b = rand(&[5], 3);
    assert!(matches!(
        err(F::conv2d(&x, &w, Some(&b), 1, 0, 1, 1)),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        err(F::conv2d(&rand(&[4, 5], 1), &w, None, 1, 0, 1, 1)),
        Error::InvalidArgument { .. }
    ));
    let w32 = w.to_dtype(DType::F32).unwrap();
    assert!(matches!(
        err(F::conv2d(&x, &w32, None, 1, 0, 1, 1)),
        Error::DTypeMismatch { .. }
    ));
    assert!(matches!(
        err(F::conv1d(&x, &w, None, 1, 0, 1, 1)),
        Error::InvalidArgument { .. }
    ));
}

#[test]
fn max_pool2d_values_and_first_max_gradient() {
    #[rustfmt::skip]
    let x = t64(&[
        1.0, 3.0, 2.0, 2.0,
        3.0, 0.0, 1.0, 0.0,
        -1.0, -2.0, 5.0, 6.0,
        -3.0, -1.0, 7.0, 6.0,
    ], &[1, 1, 4, 4], CPU).requires_grad_(true).unwrap();
    let y = F::max_pool2d(&x, 2, 2, 0).unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![3.0, 2.0, -1.0, 7.0]);
    y.sum_all().unwrap().backward().unwrap();
    // Ties (3, 3) and (2, 2) send the gradient to the first in row-major window order.
    #[rustfmt::skip]
    let expected = vec![
        0.0, 1.0, 1.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
        1.0, 0.0, 0.0, 0.0,
        0.0, 0.0, 1.0, 0.0,
    ];
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), expected);
    // Padding reads -inf: a window of negatives keeps its maximum.
    let neg = t64(&[-5.0, -4.0, -3.0, -2.0], &[1, 2, 2], CPU);
    let y = F::max_pool2d(&neg, 2, 1, 1).unwrap();
    assert_eq!(y.dims(), [1, 3, 3]);
    assert_eq!(
        y.to_vec::<f64>().unwrap(),
        vec![-5.0, -4.0, -4.0, -3.0, -2.0, -2.0, -3.0, -2.0, -2.0]
    );
}

#[test]
fn avg_pools_values() {
    let x = Tensor::arange(0.0, 16.0, 1.0, DType::F64, CPU)
        .unwrap()
        .reshape(&[1, 1, 4, 4])
        .unwrap();
    let y = F::avg_pool2d(&x, 2, 2, 0).unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), vec![2.5, 4.5, 10.5, 12.5]);
    // count_include_pad: the corner window [0 pad; pad pad] holds one element of four.
    let y = F::avg_pool2d(&x, 2, 2, 1).unwrap();
    assert_eq!(y.dims(), [1, 1, 3, 3]);
    assert_close_slice(
        &y.to_vec_f64().unwrap()[..2],
        &[0.0, (1.0 + 2.0) / 4.0],
        1e-15,
        0.0,
    );
    // adaptive 4 -> 3: windows [0, 2), [1, 3), [2, 4) in each dim.
    let y = F::adaptive_avg_pool2d(&x, 3).unwrap();
    let first = (0.0 + 1.0 + 4.0 + 5.0) / 4.0;
    assert_close_slice(&y.to_vec_f64().unwrap()[..1], &[first], 1e-15, 0.0);
    let y = F::adaptive_avg_pool2d(&x, 1).unwrap();
    assert_close_slice(&y.to_vec_f64().unwrap(), &[7.5], 1e-15, 0.0);
}

#[test]
fn pooling_gradients() {
    let x = rand(&[2, 2, 5, 5], 11);
    gradcheck(|t| F::max_pool2d(&t[0], 3, 2, 1), std::slice::from_ref(&x));
    gradcheck(
        |t| F::avg_pool2d(&t[0], [2, 3], [1, 2], [1, 1]),
        std::slice::from_ref(&x),
    );
    gradcheck(|t| F::adaptive_avg_pool2d(&t[0], (3, 2)), &[x]);
}

#[test]
fn pooling_argument_errors() {
    let x = rand(&[1, 1, 4, 4], 1);
    assert!(
        F::max_pool2d(&x, 2, 2, 2).is_err(),
        "padding over half the kernel"
    );
    assert!(
        F::avg_pool2d(&x, 5, 1, 0).is_err(),
        "kernel larger than the input"
    );
    assert!(F::max_pool2d(&x, 2, 0, 0).is_err(), "zero stride");
    assert!(F::adaptive_avg_pool2d(&x, 0).is_err());
    assert!(F::max_pool2d(&rand(&[4, 4], 1), 2, 2, 0).is_err());
    let ints = Tensor::zeros([1, 1, 4, 4], DType::I64, CPU).unwrap();
    assert!(matches!(
        F::max_pool2d(&ints, 2, 2, 0),
        Err(Error::UnsupportedDType { .. })
    ));
}

#[test]
fn batch_norm_training_updates_running_stats() {
    // Channel 0 holds 1, 3 (mean 2, biased var 1, unbiased 2); channel 1 holds 0, 0.
    let x = t64(&[1.0, 0.0, 3.0, 0.0], &[2, 2], CPU);
    let rm = t64(&[0.0, 1.0], &[2], CPU);
    let rv = t64(&[1.0, 1.0], &[2], CPU);
    let y = F::batch_norm(&x, Some(&rm), Some(&rv), None, None, true, 0.1, 0.0).unwrap();
    assert_close_slice(
        &y.to_vec_f64().unwrap(),
        &[-1.0, f64::NAN, 1.0, f64::NAN],
        1e-12,
        0.0,
    );
    assert_close_slice(&rm.to_vec_f64().unwrap(), &[0.2, 0.9], 1e-15, 1e-15);
    assert_close_slice(&rv.to_vec_f64().unwrap(), &[0.9 + 0.2, 0.9], 1e-15, 1e-15);
    // Evaluation uses the running stats and leaves them alone.
    let y = F::batch_norm(&x, Some(&rm), Some(&rv), None, None, false, 0.1, 0.0).unwrap();
    let expected = [(1.0 - 0.2) / 1.1f64.sqrt(), -0.9 / 0.9f64.sqrt()];
    assert_close_slice(&y.to_vec_f64().unwrap()[..2], &expected, 1e-12, 0.0);
    assert_close_slice(&rm.to_vec_f64().unwrap(), &[0.2, 0.9], 1e-15, 1e-15);
}

#[test]
fn normalization_gradients() {
    let x = rand(&[3, 2, 2, 2], 12);
    let (w, b) = (rand(&[2], 13), rand(&[2], 14));
    gradcheck(
        |t| {
            let (rm, rv) = (
                Tensor::zeros([2], DType::F64, CPU)?,
                Tensor::ones([2], DType::F64, CPU)?,
            );
            F::batch_norm(
                &t[0],
                Some(&rm),
                Some(&rv),
                Some(&t[1]),
                Some(&t[2]),
                true,
                0.1,
                1e-5,
            )
        },
        &[x.clone(), w.clone(), b.clone()],
    );
    gradcheck(
        |t| F::batch_norm(&t[0], None, None, Some(&t[1]), Some(&t[2]), true, 0.1, 1e-5),
        &[x.clone(), w.clone(), b.clone()],
    );
    let (rm, rv) = (
        rand(&[2], 15),
        rand(&[2], 16).abs().unwrap().add_scalar(0.5).unwrap(),
    );
    gradcheck(
        |t| {
            F::batch_norm(
                &t[0],
                Some(&rm),
                Some(&rv),
                Some(&t[1]),
                Some(&t[2]),
                false,
                0.1,
                1e-5,
            )
        },
        &[x, w, b],
    );
    let x = rand(&[2, 3, 4], 17);
    let (w, b) = (rand(&[3, 4], 18), rand(&[3, 4], 19));
    gradcheck(
        |t| F::layer_norm(&t[0], &[3, 4], Some(&t[1]), Some(&t[2]), 1e-5),
        &[x.clone(), w, b],
    );
    gradcheck(|t| F::layer_norm(&t[0], &[4], None, None, 1e-5), &[x]);
}

#[test]
fn layer_norm_values_and_errors() {
    let x = t64(&[1.0, 2.0, 3.0, 4.0, 4.0, 4.0], &[2, 3], CPU);
    let y = F::layer_norm(&x, &[3], None, None, 0.0).unwrap();
    let s = (2.0f64 / 3.0).sqrt();
    assert_close_slice(
        &y.to_vec_f64().unwrap()[..3],
        &[-1.0 / s, 0.0, 1.0 / s],
        1e-12,
        1e-12,
    );
    assert!(F::layer_norm(&x, &[2], None, None, 1e-5).is_err());
    assert!(F::layer_norm(&x, &[], None, None, 1e-5).is_err());
    assert!(F::layer_norm(&x, &[3], Some(&rand(&[2], 1)), None, 1e-5).is_err());
    let one = t64(&[1.0, 2.0], &[1, 2], CPU);
    assert!(
        F::batch_norm(&one, None, None, None, None, true, 0.1, 1e-5).is_err(),
        "one value per channel"
    );
    assert!(
        F::batch_norm(&one, None, None, None, None, false, 0.1, 1e-5).is_err(),
        "eval needs stats"
    );
    assert!(F::batch_norm(&x, Some(&rand(&[2], 1)), None, None, None, true, 0.1, 1e-5).is_err());
}

/// PyTorch refuses integer inputs to batch norm; so does ember, with a typed error, also
/// where float32 statistics and affine parameters would promote the input, and through the
/// `BatchNorm1d` layer.
#[test]
fn batch_norm_refuses_integer_and_bool_inputs() {
    let stats = |v: f64| Tensor::full([2], v, DType::F32, CPU).unwrap();
    for dtype in [DType::I64, DType::I32, DType::U8, DType::Bool] {
        let x = Tensor::ones([3, 2], dtype, CPU).unwrap();
        for affine in [false, true] {
            let (w, b) = (stats(1.0), stats(0.0));
            let (w, b) = if affine {
                (Some(&w), Some(&b))
            } else {
                (None, None)
            };
            for training in [true, false] {
                let (rm, rv) = (stats(0.0), stats(1.0));
                let err = F::batch_norm(&x, Some(&rm), Some(&rv), w, b, training, 0.1, 1e-5)
                    .expect_err("an integer input is refused");
                match &err {
                    Error::UnsupportedDType { op, dtype: d, hint } => {
                        assert_eq!((*op, *d), ("batch_norm", dtype));
                        assert!(hint.contains("to_dtype"), "the hint says what to do: {hint}");
                    }
                    other => panic!("expected UnsupportedDType, got {other:?}"),
                }
                assert_eq!(rm.to_vec::<f32>().unwrap(), [0.0, 0.0], "nothing was updated");
            }
        }
    }
    let bn = ember_nn::BatchNorm1d::new(2, CPU).unwrap();
    let x = Tensor::ones([3, 2], DType::I64, CPU).unwrap();
    assert!(matches!(
        ember_nn::Forward::forward(&bn, &x),
        Err(Error::UnsupportedDType { op: "batch_norm", .. })
    ));
}

#[test]
fn grouped_query_attention_repeats_each_key_value_head_for_its_query_heads() {
    // 4 query heads over 2 key/value heads: query heads 0, 1 use kv head 0; 2, 3 use kv head 1.
    let (q, k, v) = (
        rand(&[1, 4, 3, 2], 30),
        rand(&[1, 2, 5, 2], 31),
        rand(&[1, 2, 5, 3], 32),
    );
    let gqa = F::SdpaOptions::new().enable_gqa(true).is_causal(true);
    let y = F::scaled_dot_product_attention_with(&q, &k, &v, gqa).unwrap();
    assert_eq!(y.dims(), &[1, 4, 3, 3]);
    let causal = F::SdpaOptions::new().is_causal(true);
    for head in 0..4isize {
        let kv = head / 2;
        let one = |t: &Tensor, i: isize| t.narrow(1, i as usize, 1).unwrap();
        let want =
            F::scaled_dot_product_attention_with(&one(&q, head), &one(&k, kv), &one(&v, kv), causal).unwrap();
        assert_close(&one(&y, head), &want, 1e-12, 1e-12);
    }
    // Without the flag the head counts must agree (the product fails to broadcast 4 over 2),
    // and with it they must divide.
    assert!(F::scaled_dot_product_attention_with(&q, &k, &v, causal).is_err());
    let k3 = rand(&[1, 3, 5, 2], 33);
    assert!(F::scaled_dot_product_attention_with(&q, &k3, &k3, gqa).is_err());
}

#[test]
fn attention_matches_its_definition() {
    let (q, k, v) = (rand(&[2, 3, 4], 20), rand(&[2, 5, 4], 21), rand(&[2, 5, 2], 22));
    let y = F::scaled_dot_product_attention(&q, &k, &v).unwrap();
    let scores = q
        .matmul(&k.transpose(1, 2).unwrap())
        .unwrap()
        .div_scalar(2.0)
        .unwrap();
    let expected = scores.softmax(-1).unwrap().matmul(&v).unwrap();
    assert_close(&y, &expected, 1e-12, 1e-12);
    // A bool mask equal to the causal one gives the causal result; a float mask is added.
    let (k, v) = (rand(&[2, 3, 4], 23), rand(&[2, 3, 2], 24));
    let causal = F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: None,
            dropout_p: 0.0,
            is_causal: true,
            scale: None,
            enable_gqa: false,
        },
    )
    .unwrap();
    let keep = t64(&[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0], &[3, 3], CPU)
        .gt_scalar(0.5)
        .unwrap();
    let masked = F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: Some(&keep),
            dropout_p: 0.0,
            is_causal: false,
            scale: None,
            enable_gqa: false,
        },
    )
    .unwrap();
    assert_close(&masked, &causal, 1e-12, 1e-12);
    let additive = keep
        .to_dtype(DType::F64)
        .unwrap()
        .sub_scalar(1.0)
        .unwrap()
        .mul_scalar(1e9)
        .unwrap();
    let added = F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: Some(&additive),
            dropout_p: 0.0,
            is_causal: false,
            scale: None,
            enable_gqa: false,
        },
    )
    .unwrap();
    assert_close(&added, &causal, 1e-9, 1e-12);
    // The first query sees only the first key: its output is v[0].
    assert_close_slice(
        &causal.to_vec_f64().unwrap()[..2],
        &v.to_vec_f64().unwrap()[..2],
        1e-12,
        0.0,
    );
    // A custom scale.
    let s = F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: None,
            dropout_p: 0.0,
            is_causal: false,
            scale: Some(0.25),
            enable_gqa: false,
        },
    )
    .unwrap();
    let expected = q
        .matmul(&k.transpose(1, 2).unwrap())
        .unwrap()
        .mul_scalar(0.25)
        .unwrap()
        .softmax(-1)
        .unwrap()
        .matmul(&v)
        .unwrap();
    assert_close(&s, &expected, 1e-12, 1e-12);
}

#[test]
fn attention_gradients_and_errors() {
    let (q, k, v) = (rand(&[2, 3, 4], 25), rand(&[2, 3, 4], 26), rand(&[2, 3, 2], 27));
    gradcheck(
        |t| {
            F::scaled_dot_product_attention_with(
                &t[0],
                &t[1],
                &t[2],
                F::SdpaOptions {
                    attn_mask: None,
                    dropout_p: 0.0,
                    is_causal: true,
                    scale: None,
                    enable_gqa: false,
                },
            )
        },
        &[q.clone(), k.clone(), v.clone()],
    );
    let bad_k = rand(&[2, 3, 5], 1);
    assert!(matches!(
        F::scaled_dot_product_attention(&q, &bad_k, &v),
        Err(Error::ShapeMismatch { .. })
    ));
    let bad_v = rand(&[2, 4, 2], 1);
    assert!(F::scaled_dot_product_attention(&q, &k, &bad_v).is_err());
    let mask = Tensor::ones([3, 3], DType::Bool, CPU).unwrap();
    assert!(F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: Some(&mask),
            dropout_p: 0.0,
            is_causal: true,
            scale: None,
            enable_gqa: false,
        }
    )
    .is_err());
    let int_mask = Tensor::ones([3, 3], DType::I64, CPU).unwrap();
    assert!(F::scaled_dot_product_attention_with(
        &q,
        &k,
        &v,
        F::SdpaOptions {
            attn_mask: Some(&int_mask),
            dropout_p: 0.0,
            is_causal: false,
            scale: None,
            enable_gqa: false,
        }
    )
    .is_err());
}

#[test]
fn dropout_scales_kept_elements_and_is_reproducible() {
    let x = Tensor::ones([1000], DType::F64, CPU).unwrap();
    let gen = Generator::new(7);
    let y = F::dropout_with(&x, 0.25, true, &gen)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-15));
    assert!((650..850).contains(&kept), "kept {kept} of 1000 at p = 0.25");
    let again = F::dropout_with(&x, 0.25, true, &Generator::new(7)).unwrap();
    assert_eq!(again.to_vec::<f64>().unwrap(), y);
    // Evaluation and p = 0 are the identity; p = 1 zeroes; p outside [0, 1] is an error.
    assert_eq!(
        F::dropout(&x, 0.5, false).unwrap().to_vec::<f64>().unwrap(),
        vec![1.0; 1000]
    );
    assert_eq!(
        F::dropout(&x, 0.0, true).unwrap().to_vec::<f64>().unwrap(),
        vec![1.0; 1000]
    );
    assert_eq!(
        F::dropout(&x, 1.0, true).unwrap().to_vec::<f64>().unwrap(),
        vec![0.0; 1000]
    );
    assert!(F::dropout(&x, 1.5, true).is_err());
    assert!(F::dropout(&x, -0.1, true).is_err());
}

#[test]
fn dropout_gradient_is_the_mask() {
    manual_seed(3).unwrap();
    let x = Tensor::ones([64], DType::F64, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = F::dropout(&x, 0.5, true).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let (y, g) = (
        y.to_vec::<f64>().unwrap(),
        x.grad().unwrap().to_vec::<f64>().unwrap(),
    );
    assert_eq!(y, g, "d(x·m/(1-p))/dx = m/(1-p), which is y at x = 1");
}

#[test]
fn layers_agree_across_devices() {
    // On a GPU machine, every layer's output and input gradient on CUDA equals the CPU's.
    let _g = no_grad();
    for device in devices().into_iter().skip(1) {
        let x = rand(&[2, 4, 6, 5], 30);
        let w = rand(&[6, 2, 3, 3], 31);
        let on = |t: &Tensor| t.to(device).unwrap();
        let cpu = F::conv2d(&x, &w, None, 1, 1, 1, 2).unwrap();
        let gpu = F::conv2d(&on(&x), &on(&w), None, 1, 1, 1, 2).unwrap();
        assert_close(&gpu.to(CPU).unwrap(), &cpu, 1e-10, 1e-10);
        let cpu = F::max_pool2d(&x, 3, 2, 1).unwrap();
        let gpu = F::max_pool2d(&on(&x), 3, 2, 1).unwrap();
        assert_close(&gpu.to(CPU).unwrap(), &cpu, 0.0, 0.0);
        let cpu = F::avg_pool2d(&x, 3, 2, 1).unwrap();
        let gpu = F::avg_pool2d(&on(&x), 3, 2, 1).unwrap();
        assert_close(&gpu.to(CPU).unwrap(), &cpu, 1e-10, 1e-10);
        let cpu = F::layer_norm(&x, &[5], None, None, 1e-5).unwrap();
        let gpu = F::layer_norm(&on(&x), &[5], None, None, 1e-5).unwrap();
        assert_close(&gpu.to(CPU).unwrap(), &cpu, 1e-10, 1e-10);
    }
}

/// Issue 14: dropout draws the same mask on the CPU and on CUDA for one seed, in every floating
/// dtype, bitwise.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_dropout_masks_are_bitwise_equal() {
    let gpu = crate::common::gpu();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for p in [0.1, 0.5, 0.9] {
            let run = |device: Device| {
                ember_core::manual_seed(99).unwrap();
                let x = Tensor::ones([1001], dtype, device).unwrap();
                let y = ember_nn::functional::dropout(&x, p, true).unwrap();
                y.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
            };
            let bits = |v: Vec<f64>| v.iter().map(|v| v.to_bits()).collect::<Vec<u64>>();
            // Other tests draw from the default generators concurrently; a draw between the
            // seed and the mask shifts a stream, so retry until one pair ran undisturbed (a
            // real difference never matches, and fails after the deadline).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let (cb, gb) = loop {
                let (cb, gb) = (bits(run(Device::Cpu)), bits(run(gpu)));
                if cb == gb || std::time::Instant::now() > deadline {
                    break (cb, gb);
                }
            };
            assert!(cb == gb, "dropout p={p} {dtype}: the CPU and CUDA masks differ");
        }
    }
}

/// Issue 11: dropout drawn while its generator captures a CUDA graph (the mask kernel reads
/// Philox's seed and offset through device pointers; Note [Philox under graph capture] in
/// ember-core) equals dropout drawn eagerly, by value, from the same generator state, bitwise,
/// in every float dtype; the capture reports the blocks the masks consumed.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_dropout_through_device_philox_equals_eager_dropout() {
    let gpu = crate::common::gpu();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for p in [0.1, 0.5] {
            let x = Tensor::ones([1001, 3], dtype, gpu).unwrap();
            let gen = Generator::new(1234);
            gen.set_state(ember_core::RngState {
                seed: 1234,
                offset: 77,
            });
            let start = gen.get_state();
            let bits = |y: Tensor| -> Vec<u64> {
                let v = y.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
                v.iter().map(|v| v.to_bits()).collect()
            };
            let eager = [
                bits(F::dropout_with(&x, p, true, &gen).unwrap()),
                bits(F::dropout_with(&x, p, true, &gen).unwrap()),
            ];
            let after = gen.get_state();
            gen.set_state(start);
            gen.begin_capture(0).unwrap();
            let captured = [
                bits(F::dropout_with(&x, p, true, &gen).unwrap()),
                bits(F::dropout_with(&x, p, true, &gen).unwrap()),
            ];
            let increment = gen.end_capture().unwrap();
            assert_eq!(captured, eager, "dropout p={p} {dtype}: the masks differ");
            assert_eq!(increment, after.offset - start.offset, "dropout p={p} {dtype}");
            assert_eq!(gen.get_state(), start);
        }
    }
}

#[test]
fn functional_activations_and_options_forms_have_pytorchs_names_and_defaults() {
    let x = Tensor::from_slice(&[-1.0f32, 0.5, 2.0], [3], Device::Cpu).unwrap();
    // F.gelu(x, approximate="tanh") and the exact default.
    let tanh: F::GeluApproximate = "tanh".parse().unwrap();
    assert_eq!(
        F::gelu(&x, tanh).unwrap().to_vec::<f32>().unwrap(),
        x.gelu_tanh().unwrap().to_vec::<f32>().unwrap()
    );
    assert_eq!(
        F::gelu(&x, F::GeluApproximate::default())
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        x.gelu().unwrap().to_vec::<f32>().unwrap()
    );
    assert!("fast".parse::<F::GeluApproximate>().is_err());
    assert_eq!(F::relu(&x).unwrap().to_vec::<f32>().unwrap(), [0.0, 0.5, 2.0]);
    assert_eq!(F::softmax(&x, -1).unwrap().dims(), [3]);
    // cross_entropy(x, y) is the options form with PyTorch's defaults; builder-style options.
    let logits = Tensor::from_slice(&[1.0f32, 2.0, 0.5, 0.1, 0.2, 3.0], [2, 3], Device::Cpu).unwrap();
    let y = Tensor::from_slice(&[1i64, -1], [2], Device::Cpu).unwrap();
    let y_ok = Tensor::from_slice(&[1i64, 2], [2], Device::Cpu).unwrap();
    let short = F::cross_entropy(&logits, &y_ok).unwrap();
    let full = F::cross_entropy_with(&logits, &y_ok, F::CrossEntropyOptions::default()).unwrap();
    assert_eq!(short.item::<f32>().unwrap(), full.item::<f32>().unwrap());
    let ignored = F::cross_entropy_with(&logits, &y, F::CrossEntropyOptions::new().ignore_index(-1)).unwrap();
    let first = F::cross_entropy(&logits.narrow(0, 0, 1).unwrap(), &y_ok.narrow(0, 0, 1).unwrap()).unwrap();
    assert!((ignored.item::<f32>().unwrap() - first.item::<f32>().unwrap()).abs() < 1e-6);
    // sdpa(q, k, v) with PyTorch's defaults; is_causal builder-style.
    let q = Tensor::randn([1, 4, 8], DType::F32, Device::Cpu).unwrap();
    let plain = F::scaled_dot_product_attention(&q, &q, &q).unwrap();
    let same = F::scaled_dot_product_attention_with(&q, &q, &q, F::SdpaOptions::new()).unwrap();
    assert_eq!(plain.to_vec::<f32>().unwrap(), same.to_vec::<f32>().unwrap());
    let causal =
        F::scaled_dot_product_attention_with(&q, &q, &q, F::SdpaOptions::new().is_causal(true)).unwrap();
    // The first position sees only itself: its output is its own value row.
    assert_eq!(
        causal.narrow(1, 0, 1).unwrap().to_vec::<f32>().unwrap(),
        q.narrow(1, 0, 1).unwrap().to_vec::<f32>().unwrap()
    );
}
