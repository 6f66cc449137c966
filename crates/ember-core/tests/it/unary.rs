//! Tests of the unary family: values against f64 references and known PyTorch values for every
//! dtype, PyTorch's dtype rules, error cases, gradients (finite differences and the conventions
//! at kinks), and the strided / parallel kernel paths.

use crate::common::{assert_close, assert_close_slice, devices, gradcheck, t64, values};
use ember_core::{DType, Device, Error, Result, Tensor};
use std::f64::consts::{FRAC_1_SQRT_2, PI};

type Op = fn(&Tensor) -> Result<Tensor>;

/// Where an op's reference is checked (its domain, away from overflow).
#[derive(Clone, Copy)]
enum Domain {
    /// [-4, 4]
    Wide,
    /// (0.05, 4]
    Positive,
    /// [-0.95, 0.95]
    Unit,
}

fn points(domain: Domain, n: usize, seed: u64) -> Vec<f64> {
    let v = values(n, seed);
    match domain {
        Domain::Wide => v.iter().map(|x| x * 4.0).collect(),
        Domain::Positive => v.iter().map(|x| 0.05 + (x + 1.0) * 1.975).collect(),
        Domain::Unit => v.iter().map(|x| x * 0.95).collect(),
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn hardsigmoid(x: f64) -> f64 {
    ((x + 3.0).clamp(0.0, 6.0)) / 6.0
}

const SELU_ALPHA: f64 = 1.6732632423543772848170429916717;
const SELU_SCALE: f64 = 1.0507009873554804934193349852946;

/// Ops whose f64 reference is written with `std` alone (erf-based ops are checked against
/// known values in `erf_family_matches_known_values`).
fn std_table() -> Vec<(&'static str, Op, fn(f64) -> f64, Domain)> {
    use Domain::*;
    vec![
        ("neg", Tensor::neg, |x| -x, Wide),
        ("abs", Tensor::abs, f64::abs, Wide),
        ("square", Tensor::square, |x| x * x, Wide),
        ("reciprocal", Tensor::reciprocal, |x| 1.0 / x, Positive),
        ("sqrt", Tensor::sqrt, f64::sqrt, Positive),
        ("rsqrt", Tensor::rsqrt, |x| 1.0 / x.sqrt(), Positive),
        ("exp", Tensor::exp, f64::exp, Wide),
        ("exp2", Tensor::exp2, f64::exp2, Wide),
        ("expm1", Tensor::expm1, f64::exp_m1, Wide),
        ("log", Tensor::log, f64::ln, Positive),
        ("log2", Tensor::log2, f64::log2, Positive),
        ("log10", Tensor::log10, f64::log10, Positive),
        ("log1p", Tensor::log1p, f64::ln_1p, Unit),
        ("sin", Tensor::sin, f64::sin, Wide),
        ("cos", Tensor::cos, f64::cos, Wide),
        ("tan", Tensor::tan, f64::tan, Unit),
        ("asin", Tensor::asin, f64::asin, Unit),
        ("acos", Tensor::acos, f64::acos, Unit),
        ("atan", Tensor::atan, f64::atan, Wide),
        ("sinh", Tensor::sinh, f64::sinh, Wide),
        ("cosh", Tensor::cosh, f64::cosh, Wide),
        ("tanh", Tensor::tanh, f64::tanh, Wide),
        ("sigmoid", Tensor::sigmoid, sigmoid, Wide),
        ("logsigmoid", Tensor::logsigmoid, |x| sigmoid(x).ln(), Wide),
        ("relu", Tensor::relu, |x| x.max(0.0), Wide),
        ("relu6", Tensor::relu6, |x| x.clamp(0.0, 6.0), Wide),
        (
            "leaky_relu",
            |t| t.leaky_relu(0.1),
            |x| if x > 0.0 { x } else { 0.1 * x },
            Wide,
        ),
        (
            "elu",
            |t| t.elu(0.7),
            |x| if x > 0.0 { x } else { 0.7 * x.exp_m1() },
            Wide,
        ),
        (
            "celu",
            |t| t.celu(2.0),
            |x| x.max(0.0) + (2.0 * (x / 2.0).exp_m1()).min(0.0),
            Wide,
        ),
        (
            "selu",
            Tensor::selu,
            |x| SELU_SCALE * if x > 0.0 { x } else { SELU_ALPHA * x.exp_m1() },
            Wide,
        ),
        (
            "hardtanh",
            |t| t.hardtanh(-0.5, 1.5),
            |x| x.clamp(-0.5, 1.5),
            Wide,
        ),
        ("hardsigmoid", Tensor::hardsigmoid, hardsigmoid, Wide),
        ("hardswish", Tensor::hardswish, |x| x * hardsigmoid(x), Wide),
        (
            "gelu_tanh",
            Tensor::gelu_tanh,
            |x| 0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh()),
            Wide,
        ),
        ("silu", Tensor::silu, |x| x * sigmoid(x), Wide),
        ("mish", Tensor::mish, |x| x * softplus(x).tanh(), Wide),
        ("softplus", Tensor::softplus, softplus, Wide),
        (
            "softplus_beta",
            |t| t.softplus_with(2.0, 3.0),
            |x| {
                if 2.0 * x > 3.0 {
                    x
                } else {
                    (2.0 * x).exp().ln_1p() / 2.0
                }
            },
            Wide,
        ),
        ("softsign", Tensor::softsign, |x| x / (1.0 + x.abs()), Wide),
        ("floor", Tensor::floor, f64::floor, Wide),
        ("ceil", Tensor::ceil, f64::ceil, Wide),
        ("round", Tensor::round, f64::round_ties_even, Wide),
        ("trunc", Tensor::trunc, f64::trunc, Wide),
        (
            "sign",
            Tensor::sign,
            |x| if x == 0.0 { 0.0 } else { x.signum() },
            Wide,
        ),
    ]
}

/// Checks every `std_table` op in `dtype`: the inputs are rounded to `dtype` first and the
/// reference is evaluated on the rounded inputs in f64.
fn check_table_in(dtype: DType, rtol: f64, atol: f64) {
    for dev in devices() {
        for (k, (name, op, reference, domain)) in std_table().into_iter().enumerate() {
            let x = t64(&points(domain, 64, k as u64), &[8, 8], dev)
                .to_dtype(dtype)
                .unwrap();
            let y = op(&x).unwrap();
            assert_eq!(y.dtype(), dtype, "{name}");
            let expected: Vec<f64> = x.to_vec_f64().unwrap().into_iter().map(reference).collect();
            let got = y.to_vec_f64().unwrap();
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (g - e).abs() <= atol + rtol * e.abs(),
                    "{name} in {dtype}, element {i}: got {g}, expected {e}"
                );
            }
        }
    }
}

#[test]
fn values_match_references_f64() {
    check_table_in(DType::F64, 1e-14, 1e-15);
}

#[test]
fn values_match_references_f32() {
    check_table_in(DType::F32, 2e-6, 1e-6);
}

#[test]
fn values_match_references_f16() {
    check_table_in(DType::F16, 1e-3, 1e-3);
}

#[test]
fn values_match_references_bf16() {
    check_table_in(DType::BF16, 8e-3, 8e-3);
}

/// `torch.erfinv`: the inverse of erf on (-1, 1), ±inf at ±1, NaN outside; float32 and the
/// half dtypes compute through float64 and round once.
#[test]
fn erfinv_inverts_erf() {
    // Known values (erfinv(0.5), erfinv(0.9), erfinv(-0.999)) and the special values.
    let xs = [0.5, 0.9, -0.999, 0.0, 1.0, -1.0, 1.5, -2.0, f64::NAN];
    let expected = [
        0.4769362762044699,
        1.1630871536766743,
        -2.3267537655135246,
        0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        f64::NAN,
        f64::NAN,
    ];
    for dev in devices() {
        let x = t64(&xs, &[xs.len()], dev);
        assert_close_slice(&x.erfinv().unwrap().to_vec_f64().unwrap(), &expected, 1e-13, 0.0);
        // erf(erfinv(y)) = y across the open interval, in f64 and f32.
        let ys = points(Domain::Unit, 64, 41);
        let y = t64(&ys, &[ys.len()], dev);
        let back = y.erfinv().unwrap().erf().unwrap().to_vec_f64().unwrap();
        assert_close_slice(&back, &ys, 1e-14, 1e-15);
        for (dtype, tol) in [(DType::F32, 2e-6), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
            let r = y.to_dtype(dtype).unwrap().erfinv().unwrap();
            assert_eq!(r.dtype(), dtype);
            let want = y
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .erfinv()
                .unwrap();
            assert_close_slice(&r.to_vec_f64().unwrap(), &want.to_vec_f64().unwrap(), tol, tol);
        }
        // Integers compute in float32 (a float op).
        let i = Tensor::from_vec(vec![0i64, 1, -1], [3], dev)
            .unwrap()
            .erfinv()
            .unwrap();
        assert_eq!(i.dtype(), DType::F32);
        assert_eq!(
            i.to_vec::<f32>().unwrap(),
            vec![0.0, f32::INFINITY, f32::NEG_INFINITY]
        );
    }
}

#[test]
fn erf_family_matches_known_values() {
    // Reference values of erf, erfc and exact GELU (x Φ(x)) to full f64 precision.
    let xs = [1e-10, 0.01, 0.1, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let erf = [
        1.1283791670955126e-10,
        0.011283415555849616,
        0.1124629160182849,
        0.5204998778130465,
        0.8427007929497149,
        0.9661051464753108,
        0.9953222650189527,
        0.9999779095030014,
        0.9999999845827421,
        1.0,
    ];
    let erfc_x = [-1.0, 0.5, 3.0, 5.0, 10.0, 20.0];
    let erfc = [
        1.842700792949715,
        0.4795001221869535,
        2.2090496998585438e-05,
        1.5374597944280351e-12,
        2.088487583762545e-45,
        5.3958656116079005e-176,
    ];
    let gelu_x = [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0];
    let gelu = [
        -0.00404969409489031,
        -0.15865525393145707,
        -0.15426876936299344,
        0.0,
        0.34573123063700656,
        0.8413447460685429,
        1.9544997361036416,
        2.99595030590511,
    ];
    let gelu_tanh = [
        -0.0036373920817729943,
        -0.15880800939172324,
        -0.15428599017485606,
        0.0,
        0.34571400982514394,
        0.8411919906082768,
        1.954597694087775,
        2.996362607918227,
    ];
    for dev in devices() {
        let x = t64(&xs, &[xs.len()], dev);
        assert_close_slice(&x.erf().unwrap().to_vec_f64().unwrap(), &erf, 1e-15, 0.0);
        let neg: Vec<f64> = erf.iter().map(|v| -v).collect();
        assert_close_slice(
            &x.neg().unwrap().erf().unwrap().to_vec_f64().unwrap(),
            &neg,
            1e-15,
            0.0,
        );
        let x = t64(&erfc_x, &[erfc_x.len()], dev);
        assert_close_slice(&x.erfc().unwrap().to_vec_f64().unwrap(), &erfc, 1e-14, 0.0);
        let x = t64(&gelu_x, &[gelu_x.len()], dev);
        assert_close_slice(&x.gelu().unwrap().to_vec_f64().unwrap(), &gelu, 1e-15, 1e-300);
        assert_close_slice(
            &x.gelu_tanh().unwrap().to_vec_f64().unwrap(),
            &gelu_tanh,
            1e-15,
            1e-300,
        );
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
            let y = x.to_dtype(dtype).unwrap().gelu().unwrap();
            assert_eq!(y.dtype(), dtype);
            assert_close_slice(&y.to_vec_f64().unwrap(), &gelu, tol, tol);
        }
        // The exact form is x Φ(x), Φ through erf: check the identity at random points.
        let r = t64(&points(Domain::Wide, 50, 3), &[50], dev);
        let phi: Vec<f64> = r
            .mul_scalar(FRAC_1_SQRT_2)
            .unwrap()
            .erf()
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let expect: Vec<f64> = r
            .to_vec_f64()
            .unwrap()
            .iter()
            .zip(&phi)
            .map(|(x, e)| x * 0.5 * (1.0 + e))
            .collect();
        assert_close_slice(&r.gelu().unwrap().to_vec_f64().unwrap(), &expect, 1e-15, 1e-300);
    }
}

#[test]
fn round_is_half_to_even_in_every_float_dtype() {
    let x = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 2.4, -2.6, 7.0];
    let expect = [-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, 4.0, 2.0, -3.0, 7.0];
    for dev in devices() {
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let y = t64(&x, &[10], dev).to_dtype(dtype).unwrap().round().unwrap();
            assert_eq!(y.dtype(), dtype);
            assert_eq!(y.to_vec_f64().unwrap(), expect, "{dtype}");
        }
        let y = t64(&[-1.5, -0.2, 0.0, 1.7], &[4], dev);
        assert_eq!(y.floor().unwrap().to_vec_f64().unwrap(), [-2.0, -1.0, 0.0, 1.0]);
        assert_eq!(y.ceil().unwrap().to_vec_f64().unwrap(), [-1.0, -0.0, 0.0, 2.0]);
        assert_eq!(y.trunc().unwrap().to_vec_f64().unwrap(), [-1.0, -0.0, 0.0, 1.0]);
    }
}

#[test]
fn special_values_follow_pytorch() {
    for dev in devices() {
        let x = t64(&[f64::NAN, -0.0, 0.0, -3.0, 2.0], &[5], dev);
        // sign(NaN) = 0 and sign(-0) = 0 (PyTorch's CPU and CUDA kernels).
        assert_eq!(
            x.sign().unwrap().to_vec_f64().unwrap(),
            [0.0, 0.0, 0.0, -1.0, 1.0]
        );
        let r = x.relu().unwrap().to_vec_f64().unwrap();
        assert!(r[0].is_nan(), "relu propagates NaN");
        assert_eq!(&r[1..], &[0.0, 0.0, 0.0, 2.0]);
        let a = x.abs().unwrap().to_vec_f64().unwrap();
        assert!(a[1].is_sign_positive(), "abs(-0.0) is +0.0");
        assert!(x.hardtanh(-1.0, 1.0).unwrap().to_vec_f64().unwrap()[0].is_nan());
        assert!(x.hardsigmoid().unwrap().to_vec_f64().unwrap()[0].is_nan());

        // Saturating functions stay finite and exact far out.
        let big = t64(&[-1000.0, 1000.0], &[2], dev);
        assert_eq!(big.sigmoid().unwrap().to_vec_f64().unwrap(), [0.0, 1.0]);
        assert_eq!(big.logsigmoid().unwrap().to_vec_f64().unwrap(), [-1000.0, 0.0]);
        assert_eq!(big.tanh().unwrap().to_vec_f64().unwrap(), [-1.0, 1.0]);
        assert_eq!(big.softplus().unwrap().to_vec_f64().unwrap(), [0.0, 1000.0]);
        assert_eq!(big.gelu().unwrap().to_vec_f64().unwrap(), [-0.0, 1000.0]);
        assert_eq!(big.mish().unwrap().to_vec_f64().unwrap(), [-0.0, 1000.0]);

        // softplus: x itself above the threshold (strictly), log1p(exp(βx))/β at or below it.
        let s = t64(&[0.0, 1.0, 20.0, 21.0], &[4], dev).softplus().unwrap();
        let expect = [2f64.ln(), 1f64.exp().ln_1p(), 20.000000002061153, 21.0];
        assert_close_slice(&s.to_vec_f64().unwrap(), &expect, 1e-15, 0.0);
        let s = t64(&[1.0, 10.5], &[2], dev).softplus_with(2.0, 20.0).unwrap();
        assert_close_slice(&s.to_vec_f64().unwrap(), &[1.0634640055214863, 10.5], 1e-15, 0.0);

        let h = t64(&[-4.0, -3.0, -1.5, 0.0, 1.5, 3.0, 4.0, 7.0], &[8], dev);
        let expect = [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0];
        assert_close_slice(
            &h.hardsigmoid().unwrap().to_vec_f64().unwrap(),
            &expect,
            1e-15,
            0.0,
        );
        let expect = [-0.0, -0.0, -0.375, 0.0, 1.125, 3.0, 4.0, 7.0];
        assert_close_slice(&h.hardswish().unwrap().to_vec_f64().unwrap(), &expect, 1e-15, 0.0);
        let expect = [0.0, 0.0, 0.0, 0.0, 1.5, 3.0, 4.0, 6.0];
        assert_eq!(h.relu6().unwrap().to_vec_f64().unwrap(), expect);
        let expect = [-0.04, -0.03, -0.015, 0.0, 1.5, 3.0, 4.0, 7.0];
        assert_close_slice(
            &h.leaky_relu(0.01).unwrap().to_vec_f64().unwrap(),
            &expect,
            1e-15,
            0.0,
        );
    }
}

#[test]
fn float_ops_promote_integers_and_bools_to_f32() {
    for dev in devices() {
        let ints = [-3.0, -1.0, 0.0, 1.0, 2.0, 5.0];
        for dtype in [DType::I64, DType::I32, DType::U8, DType::Bool] {
            let x = Tensor::from_slice(&ints, [6], dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let xf = x.to_dtype(DType::F32).unwrap();
            for (name, op, _, _) in std_table() {
                let y = match op(&x) {
                    Ok(y) => y,
                    Err(e) => {
                        let bool_error = dtype == DType::Bool
                            && ["neg", "relu", "floor", "ceil", "round", "trunc"].contains(&name);
                        assert!(bool_error, "{name} on {dtype} failed: {e}");
                        continue;
                    }
                };
                let keeps = [
                    "neg", "abs", "sign", "relu", "square", "floor", "ceil", "round", "trunc",
                ]
                .contains(&name);
                let expected_dtype = match (dtype, name) {
                    (DType::Bool, "abs" | "sign") => DType::Bool,
                    (DType::Bool, "square") => DType::I64,
                    (d, _) if keeps => d,
                    _ => DType::F32,
                };
                assert_eq!(y.dtype(), expected_dtype, "{name} on {dtype}");
                if expected_dtype == DType::F32 {
                    // Promoted ops compute exactly as on an f32 tensor of the same values.
                    assert_close(&y, &op(&xf).unwrap(), 0.0, 0.0);
                }
            }
        }
        let e = Tensor::from_slice(&[0i64, 1, 2], [3], dev)
            .unwrap()
            .exp()
            .unwrap();
        assert_eq!(e.to_vec::<f32>().unwrap(), vec![1.0, 1f32.exp(), 2f32.exp()]);
        let s = Tensor::from_slice(&[4i32, 9], [2], dev).unwrap().sqrt().unwrap();
        assert_eq!(s.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
    }
}

#[test]
fn integer_preserving_ops_keep_dtype_and_wrap() {
    for dev in devices() {
        let x = Tensor::from_slice(&[-7i64, 0, 5, i64::MIN], [4], dev).unwrap();
        assert_eq!(
            x.neg().unwrap().to_vec::<i64>().unwrap(),
            vec![7, 0, -5, i64::MIN]
        );
        assert_eq!(x.abs().unwrap().to_vec::<i64>().unwrap(), vec![7, 0, 5, i64::MIN]);
        assert_eq!(x.sign().unwrap().to_vec::<i64>().unwrap(), vec![-1, 0, 1, -1]);
        assert_eq!(x.relu().unwrap().to_vec::<i64>().unwrap(), vec![0, 0, 5, 0]);
        assert_eq!(x.square().unwrap().to_vec::<i64>().unwrap(), vec![49, 0, 25, 0]);

        let x = Tensor::from_slice(&[-3i32, 4], [2], dev).unwrap();
        assert_eq!(x.square().unwrap().to_vec::<i32>().unwrap(), vec![9, 16]);
        assert_eq!(x.neg().unwrap().to_vec::<i32>().unwrap(), vec![3, -4]);

        let u = Tensor::from_slice(&[0u8, 1, 3, 255], [4], dev).unwrap();
        assert_eq!(u.neg().unwrap().to_vec::<u8>().unwrap(), vec![0, 255, 253, 1]);
        assert_eq!(u.abs().unwrap().to_vec::<u8>().unwrap(), vec![0, 1, 3, 255]);
        assert_eq!(u.sign().unwrap().to_vec::<u8>().unwrap(), vec![0, 1, 1, 1]);
        assert_eq!(u.square().unwrap().to_vec::<u8>().unwrap(), vec![0, 1, 9, 1]);

        // floor/ceil/round/trunc of integers: an equal copy with its own storage.
        let x = Tensor::from_slice(&[-2i64, 3, 9], [3], dev).unwrap();
        for y in [x.floor(), x.ceil(), x.round(), x.trunc()] {
            let y = y.unwrap();
            assert_eq!(y.dtype(), DType::I64);
            assert_eq!(y.to_vec::<i64>().unwrap(), vec![-2, 3, 9]);
            assert!(!y.shares_storage_with(&x));
        }

        let b = Tensor::from_slice(&[true, false], [2], dev).unwrap();
        assert_eq!(b.abs().unwrap().to_vec::<bool>().unwrap(), vec![true, false]);
        assert_eq!(b.sign().unwrap().to_vec::<bool>().unwrap(), vec![true, false]);
        assert_eq!(b.square().unwrap().to_vec::<i64>().unwrap(), vec![1, 0]);
        assert_eq!(
            b.sigmoid().unwrap().to_vec::<f32>().unwrap(),
            vec![sigmoid(1.0) as f32, 0.5]
        );
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    for dev in devices() {
        let b = Tensor::from_slice(&[true, false], [2], dev).unwrap();
        for (name, r) in [
            ("neg", b.neg()),
            ("relu", b.relu()),
            ("floor", b.floor()),
            ("round", b.round()),
        ] {
            match r {
                Err(Error::UnsupportedDType { op, dtype, .. }) => {
                    assert_eq!((op, dtype), (name, DType::Bool));
                }
                other => panic!(
                    "{name} on bool: expected UnsupportedDType, got {:?}",
                    other.map(|t| t.dtype())
                ),
            }
        }
        let msg = b.neg().unwrap_err().to_string();
        assert!(msg.contains("logical_not"), "{msg}");

        let x = t64(&[1.0], &[1], dev);
        let is_invalid = |r: Result<Tensor>, want: &str| match r {
            Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, want),
            other => panic!(
                "{want}: expected InvalidArgument, got {:?}",
                other.map(|t| t.dtype())
            ),
        };
        is_invalid(x.hardtanh(1.0, -1.0), "hardtanh");
        is_invalid(x.celu(0.0), "celu");
        is_invalid(x.softplus_with(0.0, 20.0), "softplus");
    }
}

/// Shifts values in [-1, 1) away from 0 to `±(gap + 3|v|)`, so kinks at 0 are not straddled.
fn off_zero(n: usize, seed: u64, gap: f64) -> Vec<f64> {
    values(n, seed)
        .into_iter()
        .map(|v| v.signum() * (gap + 3.0 * v.abs()))
        .collect()
}

#[test]
fn gradients_match_finite_differences() {
    let wide = |seed| off_zero(12, seed, 0.05);
    let pos = |seed| points(Domain::Positive, 12, seed);
    let unit = |seed| points(Domain::Unit, 12, seed);
    // Inputs kept away from each op's kinks (0, ±3, the hardtanh bounds).
    let kinked: Vec<f64> = [-4.2, -2.5, -1.2, -0.6, -0.3, 0.2, 0.7, 1.1, 2.0, 2.9, 3.6, 6.5].to_vec();
    let cases: Vec<(&str, Op, Vec<f64>)> = vec![
        ("neg", Tensor::neg, wide(1)),
        ("abs", Tensor::abs, wide(2)),
        ("square", Tensor::square, wide(3)),
        ("reciprocal", Tensor::reciprocal, pos(4)),
        ("sqrt", Tensor::sqrt, pos(5)),
        ("rsqrt", Tensor::rsqrt, pos(6)),
        ("exp", Tensor::exp, wide(7)),
        ("exp2", Tensor::exp2, wide(8)),
        ("expm1", Tensor::expm1, wide(9)),
        ("log", Tensor::log, pos(10)),
        ("log2", Tensor::log2, pos(11)),
        ("log10", Tensor::log10, pos(12)),
        ("log1p", Tensor::log1p, unit(13)),
        ("sin", Tensor::sin, wide(14)),
        ("cos", Tensor::cos, wide(15)),
        ("tan", Tensor::tan, unit(16)),
        ("asin", Tensor::asin, unit(17)),
        ("acos", Tensor::acos, unit(18)),
        ("atan", Tensor::atan, wide(19)),
        ("sinh", Tensor::sinh, wide(20)),
        ("cosh", Tensor::cosh, wide(21)),
        ("tanh", Tensor::tanh, wide(22)),
        ("erf", Tensor::erf, wide(23)),
        ("erfc", Tensor::erfc, wide(24)),
        ("erfinv", Tensor::erfinv, unit(40)),
        ("sigmoid", Tensor::sigmoid, wide(25)),
        ("logsigmoid", Tensor::logsigmoid, wide(26)),
        ("relu", Tensor::relu, wide(27)),
        ("leaky_relu", |t| t.leaky_relu(0.2), wide(28)),
        ("elu", |t| t.elu(0.7), wide(29)),
        ("celu", |t| t.celu(1.5), wide(30)),
        ("selu", Tensor::selu, wide(31)),
        ("hardtanh", |t| t.hardtanh(-1.0, 1.5), kinked.clone()),
        ("relu6", Tensor::relu6, kinked.clone()),
        ("hardsigmoid", Tensor::hardsigmoid, kinked.clone()),
        ("hardswish", Tensor::hardswish, kinked.clone()),
        ("gelu", Tensor::gelu, wide(32)),
        ("gelu_tanh", Tensor::gelu_tanh, wide(33)),
        ("silu", Tensor::silu, wide(34)),
        ("mish", Tensor::mish, wide(35)),
        ("softplus", Tensor::softplus, wide(36)),
        // βx crosses the threshold inside the data: both branches are checked.
        ("softplus_beta", |t| t.softplus_with(2.0, 1.0), wide(37)),
        ("softsign", Tensor::softsign, wide(38)),
        ("sign", Tensor::sign, wide(39)),
        (
            "floor",
            Tensor::floor,
            off_zero(12, 40, 0.1).iter().map(|v| v + 0.5).collect(),
        ),
        (
            "ceil",
            Tensor::ceil,
            off_zero(12, 41, 0.1).iter().map(|v| v + 0.5).collect(),
        ),
        (
            "round",
            Tensor::round,
            off_zero(12, 42, 0.1).iter().map(|v| v + 0.7).collect(),
        ),
        (
            "trunc",
            Tensor::trunc,
            off_zero(12, 43, 0.1).iter().map(|v| v + 0.5).collect(),
        ),
    ];
    for dev in devices() {
        for (name, op, xs) in &cases {
            eprintln!("gradcheck {name}");
            // A transposed (non-contiguous) input also exercises the strided kernel path.
            let x = t64(xs, &[3, 4], dev);
            gradcheck(|t| op(&t[0].t()?), &[x]);
        }
    }
}

/// The gradient of `f` at `xs` for an upstream gradient of ones.
fn grad_at(f: impl Fn(&Tensor) -> Result<Tensor>, xs: &[f64], dev: Device) -> Vec<f64> {
    let x = t64(xs, &[xs.len()], dev).requires_grad_(true).unwrap();
    let y = f(&x).unwrap();
    assert!(y.requires_grad());
    y.backward_with(Some(&y.ones_like().unwrap()), false).unwrap();
    x.grad().unwrap().to_vec_f64().unwrap()
}

#[test]
fn gradients_at_kinks_follow_pytorch() {
    for dev in devices() {
        assert_eq!(grad_at(Tensor::abs, &[-2.0, 0.0, 3.0], dev), [-1.0, 0.0, 1.0]);
        assert_eq!(grad_at(Tensor::relu, &[-2.0, 0.0, 3.0], dev), [0.0, 0.0, 1.0]);
        assert_eq!(
            grad_at(|t| t.leaky_relu(0.1), &[-2.0, 0.0, 3.0], dev),
            [0.1, 0.1, 1.0]
        );
        // elu at 0 takes the x <= 0 branch: α·scale·input_scale.
        assert_eq!(grad_at(|t| t.elu(0.5), &[0.0, 1.0], dev), [0.5, 1.0]);
        assert_eq!(
            grad_at(|t| t.hardtanh(-1.0, 1.0), &[-1.0, 0.0, 1.0, 2.0], dev),
            [0.0, 1.0, 0.0, 0.0]
        );
        assert_eq!(grad_at(Tensor::relu6, &[0.0, 6.0], dev), [0.0, 0.0]);
        let hs = grad_at(Tensor::hardsigmoid, &[-3.0, 0.0, 3.0], dev);
        assert_close_slice(&hs, &[0.0, 1.0 / 6.0, 0.0], 1e-15, 0.0);
        assert_eq!(
            grad_at(Tensor::hardswish, &[-4.0, -3.0, 0.0, 3.0, 4.0], dev),
            [0.0, -0.5, 0.5, 1.5, 1.0]
        );
        assert_eq!(grad_at(Tensor::sqrt, &[0.0, 4.0], dev), [f64::INFINITY, 0.25]);
        assert_eq!(grad_at(|t| t.softplus_with(1.0, 20.0), &[25.0], dev), [1.0]);
        assert_eq!(grad_at(Tensor::gelu, &[0.0], dev), [0.5]);
        assert_eq!(grad_at(Tensor::gelu_tanh, &[0.0], dev), [0.5]);
        for op in [
            Tensor::sign,
            Tensor::floor,
            Tensor::ceil,
            Tensor::round,
            Tensor::trunc,
        ] {
            assert_eq!(grad_at(op, &[-1.5, 0.0, 0.5, 2.0], dev), [0.0; 4]);
        }
    }
}

#[test]
fn half_precision_gradients_keep_dtype() {
    for dev in devices() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let x = t64(&[0.5, 1.0, 2.0], &[3], dev)
                .to_dtype(dtype)
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            let y = x.exp().unwrap();
            y.backward_with(Some(&y.ones_like().unwrap()), false).unwrap();
            let g = x.grad().unwrap();
            assert_eq!(g.dtype(), dtype);
            let expect: Vec<f64> = [0.5f64, 1.0, 2.0].iter().map(|v| v.exp()).collect();
            assert_close_slice(&g.to_vec_f64().unwrap(), &expect, 1e-2, 0.0);
        }
    }
}

#[test]
fn strided_and_parallel_paths_agree_with_contiguous() {
    for dev in devices() {
        // 300 × 257 elements: above the parallel threshold; the transpose is not contiguous.
        let (r, c) = (300, 257);
        let x = t64(&points(Domain::Wide, r * c, 7), &[r, c], dev);
        let xt = x.t().unwrap();
        let xt_copy = xt.contiguous().unwrap();
        assert!(!xt.is_contiguous() && xt_copy.is_contiguous());
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let (a, b) = (xt.to_dtype(dtype).unwrap(), xt_copy.to_dtype(dtype).unwrap());
            for op in [
                Tensor::exp,
                Tensor::gelu,
                Tensor::relu,
                Tensor::round,
                Tensor::silu,
            ] {
                let (y, z) = (op(&a).unwrap(), op(&b).unwrap());
                assert_eq!(y.dims(), &[c, r]);
                assert_close(&y, &z, 0.0, 0.0);
            }
        }
        // A small strided view (serial strided path) and a broadcast (stride-0) view.
        let small = t64(&values(12, 1), &[3, 4], dev).t().unwrap();
        assert_close(
            &small.tanh().unwrap(),
            &small.contiguous().unwrap().tanh().unwrap(),
            0.0,
            0.0,
        );
        let e = t64(&[0.25], &[1], dev).expand(&[5]).unwrap();
        assert_eq!(e.sqrt().unwrap().to_vec_f64().unwrap(), vec![0.5; 5]);
        // Integers through the parallel and strided paths.
        let xi = x
            .mul_scalar(100.0)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
            .t()
            .unwrap();
        let want: Vec<i64> = xi
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .map(|v| v.wrapping_neg())
            .collect();
        assert_eq!(xi.neg().unwrap().to_vec::<i64>().unwrap(), want);
    }
}
