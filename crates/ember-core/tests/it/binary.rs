//! Binary ops: values, broadcasting, promotion, comparisons, where, clamp, and gradients.

use crate::common::{devices, gradcheck, t64, values};
use ember_core::{DType, Device, Error, Tensor};
use half::{bf16, f16};

#[test]
fn arithmetic_broadcasts_like_pytorch() {
    for dev in devices() {
        let a = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], dev);
        let b = t64(&[10.0, 20.0, 30.0], &[3], dev);
        let col = t64(&[1.0, 2.0], &[2, 1], dev);
        assert_eq!(
            a.add(&b).unwrap().to_vec::<f64>().unwrap(),
            vec![11.0, 22.0, 33.0, 14.0, 25.0, 36.0]
        );
        assert_eq!(
            a.sub(&col).unwrap().to_vec::<f64>().unwrap(),
            vec![0.0, 1.0, 2.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(
            a.mul(&b).unwrap().to_vec::<f64>().unwrap(),
            vec![10.0, 40.0, 90.0, 40.0, 100.0, 180.0]
        );
        assert_eq!(
            b.div(&a).unwrap().to_vec::<f64>().unwrap(),
            vec![10.0, 10.0, 10.0, 2.5, 4.0, 5.0]
        );
        let outer = col.mul(&b).unwrap();
        assert_eq!(outer.dims(), &[2, 3]);
        assert_eq!(
            outer.to_vec::<f64>().unwrap(),
            vec![10.0, 20.0, 30.0, 20.0, 40.0, 60.0]
        );
        assert_eq!(
            a.pow_scalar(2.0).unwrap().to_vec::<f64>().unwrap(),
            vec![1.0, 4.0, 9.0, 16.0, 25.0, 36.0]
        );
        let m = a.maximum(&t64(&[3.5], &[1], dev)).unwrap();
        assert_eq!(m.to_vec::<f64>().unwrap(), vec![3.5, 3.5, 3.5, 4.0, 5.0, 6.0]);
    }
}

#[test]
fn non_contiguous_operands_read_through_strides() {
    let a = Tensor::from_vec((0..12).map(|x| x as f32).collect(), [3, 4], Device::Cpu).unwrap();
    let at = a.t().unwrap(); // [4, 3], strides [1, 4]
    let s = at.add(&at).unwrap();
    let expect: Vec<f32> = (0..4)
        .flat_map(|j| (0..3).map(move |i| 2.0 * (i * 4 + j) as f32))
        .collect();
    assert_eq!(s.to_vec::<f32>().unwrap(), expect);
}

#[test]
fn large_add_matches_serial_sum() {
    // Above the parallel threshold, contiguous and broadcast paths.
    let n = 1 << 17;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let t = Tensor::from_vec(a.clone(), [n / 4, 4], Device::Cpu).unwrap();
    let r = t.add(&t).unwrap().to_vec::<f32>().unwrap();
    assert!(r.iter().zip(&a).all(|(x, y)| *x == 2.0 * y));
    let row = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [4], Device::Cpu).unwrap();
    let r = t
        .t()
        .unwrap()
        .add(&row.unsqueeze(1).unwrap())
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(r[0], 1.0);
    assert_eq!(r[n / 4], 1.0 + 2.0);
}

#[test]
fn promotion_follows_pytorch() {
    let i = Tensor::from_vec(vec![1i64, 2, 3], [3], Device::Cpu).unwrap();
    let f = Tensor::from_vec(vec![0.5f32, 0.5, 0.5], [3], Device::Cpu).unwrap();
    assert_eq!(i.add(&f).unwrap().dtype(), DType::F32);
    assert_eq!(i.mul_scalar(2).unwrap().dtype(), DType::I64);
    assert_eq!(i.mul_scalar(2.5).unwrap().dtype(), DType::F32);
    assert_eq!(
        i.mul_scalar(2.5).unwrap().to_vec::<f32>().unwrap(),
        vec![2.5, 5.0, 7.5]
    );
    // True division of integers gives float.
    let q = i
        .div(&Tensor::from_vec(vec![2i64, 2, 2], [3], Device::Cpu).unwrap())
        .unwrap();
    assert_eq!(q.dtype(), DType::F32);
    assert_eq!(q.to_vec::<f32>().unwrap(), vec![0.5, 1.0, 1.5]);
    let h = Tensor::from_vec(vec![f16::from_f32(1.5)], [1], Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![bf16::from_f32(2.0)], [1], Device::Cpu).unwrap();
    assert_eq!(h.add(&b).unwrap().dtype(), DType::F32);
    assert_eq!(h.mul_scalar(3.0).unwrap().dtype(), DType::F16);
    assert_eq!(
        h.mul_scalar(3.0).unwrap().to_vec::<f16>().unwrap(),
        vec![f16::from_f32(4.5)]
    );
    let bools = Tensor::from_vec(vec![true, false], [2], Device::Cpu).unwrap();
    assert_eq!(bools.add_scalar(1).unwrap().dtype(), DType::I64);
}

#[test]
fn comparisons_and_logic_give_bools() {
    let a = t64(&[1.0, 2.0, 3.0], &[3], Device::Cpu);
    let b = t64(&[2.0], &[1], Device::Cpu);
    assert_eq!(
        a.lt(&b).unwrap().to_vec::<bool>().unwrap(),
        vec![true, false, false]
    );
    assert_eq!(
        a.ge(&b).unwrap().to_vec::<bool>().unwrap(),
        vec![false, true, true]
    );
    assert_eq!(
        a.eq_scalar(3).unwrap().to_vec::<bool>().unwrap(),
        vec![false, false, true]
    );
    let m = a
        .gt_scalar(1.5)
        .unwrap()
        .logical_and(&a.lt_scalar(2.5).unwrap())
        .unwrap();
    assert_eq!(m.to_vec::<bool>().unwrap(), vec![false, true, false]);
    assert_eq!(
        m.logical_not().unwrap().to_vec::<bool>().unwrap(),
        vec![true, false, true]
    );
}

#[test]
fn where_masked_fill_and_clamp() {
    let x = t64(&[-2.0, -0.5, 0.5, 2.0], &[4], Device::Cpu);
    let mask = x.gt_scalar(0.0).unwrap();
    let w = Tensor::where_cond(&mask, &x, &t64(&[0.0], &[1], Device::Cpu)).unwrap();
    assert_eq!(w.to_vec::<f64>().unwrap(), vec![0.0, 0.0, 0.5, 2.0]);
    assert_eq!(
        x.masked_fill(&mask, 9.0).unwrap().to_vec::<f64>().unwrap(),
        vec![-2.0, -0.5, 9.0, 9.0]
    );
    assert_eq!(
        x.clamp(Some(-1.0), Some(1.0)).unwrap().to_vec::<f64>().unwrap(),
        vec![-1.0, -0.5, 0.5, 1.0]
    );
    let err = Tensor::where_cond(&x, &x, &x).unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedDType { op: "where", .. }),
        "{err}"
    );
}

#[test]
fn errors_name_the_op_shapes_and_dtypes() {
    let a = t64(&[1.0, 2.0, 3.0], &[3], Device::Cpu);
    let b = t64(&[1.0, 2.0, 3.0, 4.0], &[4], Device::Cpu);
    let err = a.add(&b).unwrap_err();
    assert!(matches!(&err, Error::ShapeMismatch { op: "add", .. }));
    assert_eq!(
        err.to_string(),
        "shape mismatch in add: [3] and [4]; the shapes cannot be broadcast together"
    );
    let i = Tensor::from_vec(vec![1i64, 2], [2], Device::Cpu).unwrap();
    let err = i.pow_scalar(-1).unwrap_err();
    assert!(err.to_string().contains("negative integer powers"), "{err}");
    let flags = Tensor::from_vec(vec![true, false], [2], Device::Cpu).unwrap();
    assert!(matches!(
        flags.sub(&flags).unwrap_err(),
        Error::UnsupportedDType { op: "sub", .. }
    ));
}

#[test]
fn device_mismatch_names_both_devices() {
    let err = Error::DeviceMismatch {
        op: "add",
        lhs: Device::Cpu,
        rhs: Device::Cuda(0),
    };
    assert!(err
        .to_string()
        .starts_with("expected all tensors on the same device, found cpu and cuda:0 in add"));
    // A GPU that is not there is a typed error, not a panic.
    let err = Tensor::zeros([2], DType::F32, Device::Cuda(99)).unwrap_err();
    assert!(
        matches!(err, Error::CudaUnavailable { .. } | Error::InvalidArgument { .. }),
        "{err}"
    );
}

#[test]
fn gradients_of_arithmetic() {
    let a = t64(&values(6, 1), &[2, 3], Device::Cpu);
    let b = t64(&values(6, 2), &[2, 3], Device::Cpu);
    let pos = t64(
        &values(6, 3).iter().map(|v| v.abs() + 0.5).collect::<Vec<_>>(),
        &[2, 3],
        Device::Cpu,
    );
    gradcheck(|x| x[0].add(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].sub(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].mul(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].div(&x[1]), &[a.clone(), pos.clone()]);
    gradcheck(|x| x[0].pow(&x[1]), &[pos.clone(), b.clone()]);
    gradcheck(|x| x[0].maximum(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].minimum(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].mul_scalar(3.0)?.sub_scalar(1.0), &[a.clone()]);
    gradcheck(|x| x[0].clamp(Some(-0.3), Some(0.4)), &[a.clone()]);
    let mask = a.gt_scalar(0.0).unwrap();
    gradcheck(
        move |x| Tensor::where_cond(&mask, &x[0], &x[1]),
        &[a.clone(), b.clone()],
    );
}

/// `torch.xlogy`: `x · log(y)`, 0 where x is 0 unless y is NaN; integers compute as float32;
/// its gradient is `log y` (0 where x is 0) and `x / y`.
#[test]
fn xlogy_follows_pytorch() {
    let ln = f64::ln;
    for dev in devices() {
        let x = t64(&[0.0, 0.0, 2.0, -1.0, 3.0, 0.0, 1.5], &[7], dev);
        let y = t64(&[0.0, f64::NAN, 3.0, 2.0, 0.0, -1.0, 0.5], &[7], dev);
        let expected = [
            0.0,
            f64::NAN,
            2.0 * ln(3.0),
            -ln(2.0),
            f64::NEG_INFINITY,
            0.0,
            1.5 * ln(0.5),
        ];
        let got = x.xlogy(&y).unwrap().to_vec::<f64>().unwrap();
        for (g, e) in got.iter().zip(expected) {
            assert!(
                g == &e || (g.is_nan() && e.is_nan()) || (g - e).abs() < 1e-15,
                "{got:?}"
            );
        }
        // Broadcast scalar form, and integers as float32 (PyTorch: int64 xlogy gives float32).
        let xi = Tensor::from_vec(vec![0i64, 2, 5], [3], dev).unwrap();
        let yi = Tensor::from_vec(vec![7i64, 3, 1], [3], dev).unwrap();
        let r = xi.xlogy(&yi).unwrap();
        assert_eq!(r.dtype(), DType::F32);
        let r = r.to_vec::<f32>().unwrap();
        assert_eq!(r[0], 0.0);
        assert!((r[1] - 2.0 * 3f32.ln()).abs() < 1e-6 && r[2] == 0.0, "{r:?}");
        let s = xi.xlogy_scalar(2.0).unwrap().to_vec::<f32>().unwrap();
        assert!((s[2] - 5.0 * 2f32.ln()).abs() < 1e-5, "{s:?}");
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let r = x
                .to_dtype(dtype)
                .unwrap()
                .xlogy(&y.to_dtype(dtype).unwrap())
                .unwrap();
            assert_eq!(r.dtype(), dtype);
            let r = r.to_vec_f64().unwrap();
            assert!(
                (r[2] - 2.0 * ln(3.0)).abs() < 1e-2 && r[0] == 0.0 && r[1].is_nan(),
                "{r:?}"
            );
        }
    }
    let a = t64(&values(6, 7), &[2, 3], Device::Cpu);
    let pos = t64(
        &values(6, 8).iter().map(|v| v.abs() + 0.5).collect::<Vec<_>>(),
        &[2, 3],
        Device::Cpu,
    );
    gradcheck(|x| x[0].xlogy(&x[1]), &[a, pos]);
    // At x = 0 the gradient for x is 0 (PyTorch's `xlogy(x != 0, y)`), for y it is 0 / y.
    let x = t64(&[0.0, 2.0], &[2], Device::Cpu).requires_grad_(true).unwrap();
    let y = t64(&[0.5, 4.0], &[2], Device::Cpu).requires_grad_(true).unwrap();
    x.xlogy(&y).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.0, 4f64.ln()]);
    assert_eq!(y.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.0, 0.5]);
}

#[test]
fn gradients_reduce_over_broadcast_dims() {
    let a = t64(&values(12, 4), &[3, 1, 4], Device::Cpu);
    let b = t64(&values(2, 5), &[2, 1], Device::Cpu);
    gradcheck(|x| x[0].mul(&x[1]), &[a.clone(), b.clone()]);
    gradcheck(|x| x[0].div(&x[1].add_scalar(3.0)?), &[a, b]);
}

#[test]
fn maximum_splits_ties_evenly() {
    let a = t64(&[1.0, 2.0], &[2], Device::Cpu).requires_grad_(true).unwrap();
    let b = t64(&[1.0, 3.0], &[2], Device::Cpu).requires_grad_(true).unwrap();
    let ones = t64(&[1.0, 1.0], &[2], Device::Cpu);
    a.maximum(&b).unwrap().backward_with(Some(&ones), false).unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.5, 0.0]);
    assert_eq!(b.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.5, 1.0]);
}

/// A scalar operand is rounded to the compute type only (float32 for half tensors), as
/// PyTorch's wrapped Python numbers: bf16 9 · 0.1 is bf16(9 · 0.1f32) = 0.8984375, where
/// rounding 0.1 to bfloat16 first would give 0.90234375. The values are those rounding rules
/// worked out by hand (float32 products rounded half-to-even to 8 significant bits).
#[test]
fn scalar_operands_keep_float32_precision_with_half_tensors() {
    for device in devices() {
        let x: Vec<bf16> = [9.0f32, 13.0, 77.0].map(bf16::from_f32).to_vec();
        let x = Tensor::from_vec(x, [3], device).unwrap();
        let y = x.mul_scalar(0.1).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let want: Vec<bf16> = [0.8984375f32, 1.296875, 7.6875].map(bf16::from_f32).to_vec();
        assert_eq!(y.to_vec::<bf16>().unwrap(), want, "on {device}");
        // x / 10 and x - 0.1 + 0.1 go through the same path; the gradient of x · s is g · s.
        let q = x.div_scalar(10.0).unwrap().to_vec::<bf16>().unwrap();
        let by_hand: Vec<bf16> = [9.0f32, 13.0, 77.0].map(|v| bf16::from_f32(v / 10.0)).to_vec();
        assert_eq!(q, by_hand, "on {device}");
        let w = Tensor::from_vec(vec![1.0f32, 2.0], [2], device)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        w.mul_scalar(3.0)
            .unwrap()
            .sub_scalar(1.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    }
}
