//! `Tensor::nll_loss_forward` (the fused end of cross_entropy) against its definition, on
//! the CPU and on a GPU: sums and weighted means over rows with ignored targets, int64 and
//! int32 targets, every float dtype, the gradient, and out-of-range targets as errors.

use crate::common::{self, assert_close_slice, values, ReadBack};
use ember_core::{DType, Device, Error, Tensor};

const M: usize = 7;
const C: usize = 5;
/// Row 2 and row 5 are ignored (-100); the others hit every class.
const TARGETS: [i64; M] = [3, 0, -100, 4, 1, -100, 2];

/// loss and d loss / d logp from the definition, in f64.
fn reference(logp: &[f64], weight: Option<&[f64]>, mean: bool) -> (f64, Vec<f64>) {
    let w = |t: i64| weight.map_or(1.0, |w| w[t as usize]);
    let counted = || TARGETS.iter().enumerate().filter(|(_, &t)| t != -100);
    let total: f64 = counted().map(|(_, &t)| w(t)).sum();
    let scale = if mean { total } else { 1.0 };
    let loss = counted()
        .map(|(i, &t)| -w(t) * logp[i * C + t as usize])
        .sum::<f64>()
        / scale;
    let mut grad = vec![0.0; M * C];
    for (i, &t) in counted() {
        grad[i * C + t as usize] = -w(t) / scale;
    }
    (loss, grad)
}

fn check(dev: Device, dtype: DType, (rtol, atol): (f64, f64)) {
    let logp0 = values(M * C, 3);
    let w0: Vec<f64> = (0..C).map(|c| 0.5 + c as f64 / 4.0).collect();
    for (weighted, mean, int32) in [
        (false, true, false),
        (true, true, true),
        (true, false, false),
        (false, false, true),
    ] {
        let what = format!("{dev:?} {dtype} weighted={weighted} mean={mean} int32={int32}");
        let logp = Tensor::from_slice(&logp0, [M, C], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to(dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let mut target = Tensor::from_slice(&TARGETS, [M], dev).unwrap();
        if int32 {
            target = target.to_dtype(DType::I32).unwrap();
        }
        let weight = weighted.then(|| {
            Tensor::from_slice(&w0, [C], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap()
        });
        let loss = logp
            .nll_loss_forward(&target, weight.as_ref(), mean, -100)
            .unwrap();
        assert_eq!(loss.dims(), &[] as &[usize], "{what}");
        assert_eq!(loss.dtype(), dtype, "{what}");
        let exact = |v: &[f64]| {
            Tensor::from_slice(v, [v.len()], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_vec_f64()
                .unwrap()
        };
        let (l, g) = reference(&exact(&logp0), weighted.then_some(&exact(&w0)[..]), mean);
        eprintln!("checking {what}");
        assert_close_slice(&loss.to_vec_f64().unwrap(), &[l], rtol, atol);
        loss.backward().unwrap();
        assert_close_slice(&logp.grad().unwrap().to_vec_f64().unwrap(), &g, rtol, atol);
    }
}

#[test]
fn nll_loss_forward_matches_its_definition() {
    check(Device::Cpu, DType::F64, (1e-12, 1e-12));
    check(Device::Cpu, DType::F32, (1e-5, 1e-6));
    check(Device::Cpu, DType::BF16, (2e-2, 2e-2));
}

#[test]
fn nll_loss_forward_bad_arguments_are_errors() {
    let logp = Tensor::zeros([M, C], DType::F32, Device::Cpu).unwrap();
    let t = Tensor::from_slice(&TARGETS, [M], Device::Cpu).unwrap();
    let bad = Tensor::from_slice(&[0i64, 5, 1, 1, 1, 1, 1], [M], Device::Cpu).unwrap();
    assert!(matches!(
        logp.nll_loss_forward(&bad, None, true, -100),
        Err(Error::IndexOutOfRange { index: 5, .. })
    ));
    let short = Tensor::from_slice(&[0i64, 1], [2], Device::Cpu).unwrap();
    assert!(matches!(
        logp.nll_loss_forward(&short, None, true, -100),
        Err(Error::ShapeMismatch { .. })
    ));
    let float_t = t.to_dtype(DType::F32).unwrap();
    assert!(logp.nll_loss_forward(&float_t, None, true, -100).is_err());
    let w = Tensor::ones([C + 1], DType::F32, Device::Cpu).unwrap();
    assert!(logp.nll_loss_forward(&t, Some(&w), true, -100).is_err());
    let w64 = Tensor::ones([C], DType::F64, Device::Cpu).unwrap();
    assert!(logp.nll_loss_forward(&t, Some(&w64), true, -100).is_err());
    // Every row ignored: the mean is 0 / 0, as PyTorch's.
    let ignored = Tensor::from_slice(&[-100i64; M], [M], Device::Cpu).unwrap();
    assert!(logp
        .nll_loss_forward(&ignored, None, true, -100)
        .unwrap()
        .to_vec_f64()
        .unwrap()[0]
        .is_nan());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_nll_loss_forward_matches_its_definition_and_reports_bad_targets() {
    let dev = common::gpu();
    check(dev, DType::F64, (1e-12, 1e-12));
    check(dev, DType::F32, (1e-5, 1e-6));
    check(dev, DType::F16, (1e-2, 1e-2));
    check(dev, DType::BF16, (2e-2, 2e-2));
    let logp = Tensor::zeros([M, C], DType::F32, dev).unwrap();
    let bad = Tensor::from_slice(&[0i64, 1, 7, 1, -3, 1, 1], [M], dev).unwrap();
    // Reported at the read-back (the op itself queues the kernel and returns).
    let e = logp
        .nll_loss_forward(&bad, None, true, -100)
        .read_back()
        .unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { index: 7, .. }), "{e}");
    // The device stays usable.
    let t = Tensor::from_slice(&TARGETS, [M], dev).unwrap();
    assert_eq!(
        logp.nll_loss_forward(&t, None, false, -100)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        vec![0.0]
    );
}
