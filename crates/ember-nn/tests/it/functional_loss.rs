//! `ember_nn::functional` losses: hand-computed values (PyTorch's weighted mean, ignore_index,
//! label smoothing, probability targets), f64 gradient checks, and argument errors.

use crate::common::{assert_close_slice, gradcheck, t64, values};
use ember_core::{DType, Device, Error, Tensor};
use ember_nn::functional as F;
use ember_nn::functional::Reduction;

const CPU: Device = Device::Cpu;

fn idx(v: &[i64]) -> Tensor {
    Tensor::from_slice(v, [v.len()], CPU).unwrap()
}

/// log-softmax of one row, on the host.
fn log_softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    row.iter().map(|x| x - lse).collect()
}

#[test]
fn cross_entropy_reductions_with_ignore_index_and_weights() {
    let logits = values(12, 1);
    let x = t64(&logits, &[4, 3], CPU);
    let t = idx(&[2, -100, 0, 1]);
    let lp: Vec<Vec<f64>> = logits.chunks(3).map(log_softmax).collect();
    let per = [-lp[0][2], 0.0, -lp[2][0], -lp[3][1]];
    let none = F::cross_entropy_with(
        &x,
        &t,
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::None,
            label_smoothing: 0.0,
        },
    )
    .unwrap();
    assert_close_slice(&none.to_vec_f64().unwrap(), &per, 1e-12, 1e-12);
    let sum: f64 = per.iter().sum();
    let s = F::cross_entropy_with(
        &x,
        &t,
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Sum,
            label_smoothing: 0.0,
        },
    )
    .unwrap();
    assert_close_slice(&[s.item_f64().unwrap()], &[sum], 1e-12, 0.0);
    // The mean is over the 3 targets that are not ignored.
    let m = F::cross_entropy(&x, &t).unwrap();
    assert_close_slice(&[m.item_f64().unwrap()], &[sum / 3.0], 1e-12, 0.0);
    // Class weights: the mean divides by the weights of the counted targets.
    let w = t64(&[0.5, 2.0, 3.0], &[3], CPU);
    let wm = F::cross_entropy_with(
        &x,
        &t,
        F::CrossEntropyOptions {
            weight: Some(&w),
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
        },
    )
    .unwrap();
    let num = 3.0 * per[0] + 0.5 * per[2] + 2.0 * per[3];
    assert_close_slice(&[wm.item_f64().unwrap()], &[num / 5.5], 1e-12, 0.0);
    // nll_loss of log-probabilities equals cross_entropy of the logits.
    let lpt = x.log_softmax(1).unwrap();
    let n = F::nll_loss(&lpt, &t, Some(&w), -100, Reduction::Mean).unwrap();
    assert_close_slice(&[n.item_f64().unwrap()], &[num / 5.5], 1e-12, 0.0);
}

#[test]
fn cross_entropy_label_smoothing_and_probability_targets() {
    let logits = values(8, 2);
    let x = t64(&logits, &[2, 4], CPU);
    let t = idx(&[3, 1]);
    let eps = 0.2;
    let lp: Vec<Vec<f64>> = logits.chunks(4).map(log_softmax).collect();
    let expected: f64 = (0..2)
        .map(|i| {
            let target = [3, 1][i];
            let smooth: f64 = lp[i].iter().map(|v| -v).sum();
            (1.0 - eps) * -lp[i][target] + eps / 4.0 * smooth
        })
        .sum::<f64>()
        / 2.0;
    let got = F::cross_entropy_with(
        &x,
        &t,
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: eps,
        },
    )
    .unwrap();
    assert_close_slice(&[got.item_f64().unwrap()], &[expected], 1e-12, 0.0);
    // The same loss from the smoothed one-hot distribution as probability targets.
    let probs = t.one_hot(4).unwrap().to_dtype(DType::F64).unwrap();
    let soft = F::cross_entropy_with(
        &x,
        &probs,
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: eps,
        },
    )
    .unwrap();
    assert_close_slice(&[soft.item_f64().unwrap()], &[expected], 1e-12, 0.0);
}

#[test]
fn cross_entropy_spatial_targets() {
    // [N, C, d] logits: each (n, d) position is one row over the C classes.
    let x = t64(&values(2 * 3 * 2, 3), &[2, 3, 2], CPU);
    let t = Tensor::from_slice(&[0i64, 2, 1, 1], [2, 2], CPU).unwrap();
    let got = F::cross_entropy_with(
        &x,
        &t,
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::None,
            label_smoothing: 0.0,
        },
    )
    .unwrap();
    assert_eq!(got.dims(), [2, 2]);
    let flat = x.permute(&[0, 2, 1]).unwrap().reshape(&[4, 3]).unwrap();
    let rows = F::cross_entropy_with(
        &flat,
        &t.reshape(&[4]).unwrap(),
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::None,
            label_smoothing: 0.0,
        },
    )
    .unwrap();
    assert_close_slice(
        &got.to_vec_f64().unwrap(),
        &rows.to_vec_f64().unwrap(),
        1e-15,
        0.0,
    );
    // An unbatched [C] input with a 0-d target.
    let one = F::cross_entropy(
        &t64(&[1.0, 2.0, 3.0], &[3], CPU),
        &Tensor::from_slice(&[2i64], (), CPU).unwrap(),
    )
    .unwrap();
    assert_close_slice(
        &[one.item_f64().unwrap()],
        &[-log_softmax(&[1.0, 2.0, 3.0])[2]],
        1e-12,
        0.0,
    );
}

#[test]
fn loss_gradients() {
    let x = t64(&values(15, 4), &[5, 3], CPU);
    let t = idx(&[0, 2, -100, 1, 2]);
    let w = t64(&[0.3, 1.0, 2.0], &[3], CPU);
    for smoothing in [0.0, 0.1] {
        for r in [Reduction::None, Reduction::Mean, Reduction::Sum] {
            gradcheck(
                |a| {
                    F::cross_entropy_with(
                        &a[0],
                        &t,
                        F::CrossEntropyOptions {
                            weight: Some(&w),
                            ignore_index: -100,
                            reduction: r,
                            label_smoothing: smoothing,
                        },
                    )
                },
                std::slice::from_ref(&x),
            );
            gradcheck(
                |a| {
                    F::cross_entropy_with(
                        &a[0],
                        &t,
                        F::CrossEntropyOptions {
                            weight: None,
                            ignore_index: -100,
                            reduction: r,
                            label_smoothing: smoothing,
                        },
                    )
                },
                std::slice::from_ref(&x),
            );
        }
    }
    let probs = t64(&values(15, 5), &[5, 3], CPU).softmax(1).unwrap();
    gradcheck(
        |a| {
            F::cross_entropy_with(
                &a[0],
                &a[1],
                F::CrossEntropyOptions {
                    weight: Some(&w),
                    ignore_index: -100,
                    reduction: Reduction::Mean,
                    label_smoothing: 0.1,
                },
            )
        },
        &[x.clone(), probs.clone()],
    );
    gradcheck(
        |a| F::nll_loss(&a[0], &t, Some(&w), -100, Reduction::Mean),
        std::slice::from_ref(&x),
    );
    let y = t64(&values(15, 6), &[5, 3], CPU);
    gradcheck(
        |a| F::mse_loss(&a[0], &a[1], Reduction::Mean),
        &[x.clone(), y.clone()],
    );
    gradcheck(
        |a| F::l1_loss(&a[0], &a[1], Reduction::Sum),
        &[x.clone(), y.clone()],
    );
    let pw = t64(&[2.0, 0.5, 1.0], &[3], CPU);
    gradcheck(
        |a| F::binary_cross_entropy_with_logits(&a[0], &a[1], Some(&a[2]), Some(&pw), Reduction::Mean),
        &[x, probs, y],
    );
}

#[test]
fn pointwise_loss_values() {
    let a = t64(&[1.0, -2.0, 3.0], &[3], CPU);
    let b = t64(&[0.0, 0.0, 1.0], &[3], CPU);
    let v = |t: Tensor| t.to_vec_f64().unwrap();
    assert_eq!(v(F::mse_loss(&a, &b, Reduction::Mean).unwrap()), vec![3.0]);
    assert_eq!(
        v(F::mse_loss(&a, &b, Reduction::None).unwrap()),
        vec![1.0, 4.0, 4.0]
    );
    assert_eq!(v(F::l1_loss(&a, &b, Reduction::Sum).unwrap()), vec![5.0]);
    // BCE with logits stays finite where the naive log(σ(x)) would underflow.
    let x = t64(&[-1000.0, 0.0, 1000.0], &[3], CPU);
    let t = t64(&[1.0, 0.5, 0.0], &[3], CPU);
    let loss = v(F::binary_cross_entropy_with_logits(&x, &t, None, None, Reduction::None).unwrap());
    assert_close_slice(&loss, &[1000.0, std::f64::consts::LN_2, 1000.0], 1e-12, 0.0);
    // pos_weight multiplies the positive term: t = 1 gives pw · softplus(-x).
    let pw = t64(&[3.0], &[1], CPU);
    let x = t64(&[0.0], &[1], CPU);
    let one = t64(&[1.0], &[1], CPU);
    let loss = v(F::binary_cross_entropy_with_logits(&x, &one, None, Some(&pw), Reduction::Sum).unwrap());
    assert_close_slice(&loss, &[3.0 * std::f64::consts::LN_2], 1e-12, 0.0);
}

#[test]
fn loss_argument_errors() {
    let x = t64(&values(6, 7), &[2, 3], CPU);
    let f = |t: Tensor| t.to_dtype(DType::F32).unwrap();
    assert!(matches!(
        F::cross_entropy(&x, &idx(&[0, 1, 2])),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        F::cross_entropy(&x, &idx(&[0, 3])),
        Err(Error::IndexOutOfRange { .. })
    ));
    assert!(F::cross_entropy_with(
        &x,
        &idx(&[0, 1]),
        F::CrossEntropyOptions {
            weight: None,
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 1.5
        }
    )
    .is_err());
    assert!(F::cross_entropy_with(
        &x,
        &idx(&[0, 1]),
        F::CrossEntropyOptions {
            weight: Some(&t64(&[1.0], &[1], CPU)),
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0
        }
    )
    .is_err());
    let bool_t = Tensor::zeros([2], DType::Bool, CPU).unwrap();
    assert!(matches!(
        F::nll_loss(&x, &bool_t, None, -100, Reduction::Mean),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        F::mse_loss(&x, &f(x.clone()), Reduction::Mean),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(F::mse_loss(&x, &t64(&[1.0; 4], &[4], CPU), Reduction::Mean).is_err());
    assert!(
        F::binary_cross_entropy_with_logits(&x, &t64(&[1.0; 3], &[3], CPU), None, None, Reduction::Mean)
            .is_err()
    );
    assert!(Reduction::parse("avg").is_err());
    assert_eq!(Reduction::parse("sum").unwrap(), Reduction::Sum);
    // Every target ignored: the mean is 0/0, NaN, as PyTorch.
    let m = F::cross_entropy(&x, &idx(&[-100, -100])).unwrap();
    assert!(m.item_f64().unwrap().is_nan());
}
