//! CUDA unary ops against the CPU: every op in every dtype, on contiguous (aligned and
//! misaligned, odd and large), transposed, sliced (with an offset), broadcast and empty inputs,
//! with special values (±0, ±1, halves for rounding, NaN, ±inf, large magnitudes); the integer
//! kernels at their wrapping extremes; and the dtype errors.

use crate::common::{cpu_vs_cuda, gpu, tolerance, values};
use ember_core::ops::unary::{UnaryOp, SELU_ALPHA, SELU_SCALE};
use ember_core::{DType, Device, Error, Result, Tensor};

/// Every dtype ember has.
const DTYPES: [DType; 8] = crate::common::ALL_DTYPES;

/// Every op, parametrized ones with PyTorch's defaults and with other parameters.
pub(crate) fn all_ops() -> Vec<UnaryOp> {
    use UnaryOp::*;
    // Every op of the table without parameters, then the parametrized ones.
    let parametrized = |op: &UnaryOp| {
        matches!(
            op,
            LeakyRelu { .. }
                | Elu { .. }
                | Hardtanh { .. }
                | Softplus { .. }
                | AddScalar { .. }
                | SubScalar { .. }
                | MulScalar { .. }
                | DivScalar { .. }
        )
    };
    let mut ops: Vec<UnaryOp> = UnaryOp::ALL
        .iter()
        .copied()
        .filter(|op| !parametrized(op))
        .collect();
    ops.extend([
        LeakyRelu { negative_slope: 0.01 },
        LeakyRelu { negative_slope: -1.7 },
        Elu {
            alpha: 1.0,
            scale: 1.0,
            input_scale: 1.0,
        },
        Elu {
            alpha: SELU_ALPHA,
            scale: SELU_SCALE,
            input_scale: 1.0,
        },
        // CELU with alpha 0.7.
        Elu {
            alpha: 0.7,
            scale: 1.0,
            input_scale: 1.0 / 0.7,
        },
        Hardtanh { min: -1.0, max: 1.0 },
        Hardtanh { min: 0.0, max: 6.0 },
        Softplus {
            beta: 1.0,
            threshold: 20.0,
        },
        Softplus {
            beta: 2.5,
            threshold: 3.0,
        },
        AddScalar { value: 0.1 },
        SubScalar { value: -2.5 },
        MulScalar { value: 0.3 },
        DivScalar { value: 7.0 },
    ]);
    ops
}

/// Special values first, then `n` deterministic values in [-6, 6).
fn special_and_random(n: usize, seed: u64) -> Vec<f64> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        -0.5,
        1.5,
        2.5,
        -2.5,
        3.0,
        -3.0,
        6.0,
        20.0,
        -20.0,
        100.0,
        -100.0,
        1e-7,
        -1e-7,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.999,
        -0.999,
    ];
    v.extend(values(n, seed).into_iter().map(|x| x * 6.0));
    v
}

/// A CPU tensor of `dtype` holding `v` (cast on the CPU, so both devices see the same input).
fn cpu_input(v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    let v: Vec<f64> = match dtype {
        // Integers: keep NaN/inf out of the casts and use magnitudes that fit.
        DType::U8 => v
            .iter()
            .map(|x| {
                if x.is_finite() {
                    x.abs().min(255.0).round()
                } else {
                    7.0
                }
            })
            .collect(),
        d if !d.is_floating_point() => v
            .iter()
            .map(|x| if x.is_finite() { x.round() } else { -7.0 })
            .collect(),
        _ => v.to_vec(),
    };
    Tensor::from_slice(&v, dims, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Tolerance of a CUDA-vs-CPU comparison of `op`'s result in `dtype` (one or two ulp of the
/// compute type apart: CUDA's math library and the CPU's libm round differently).
fn unary_tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-5, 1e-6),
        DType::F64 => (1e-12, 1e-13),
        d if d.is_floating_point() => tolerance(d),
        // Integer inputs of float ops compute in f32.
        _ => tolerance(DType::F32),
    }
}

/// `op` on both devices over `x` (a CPU tensor moved to the device) seen through `view`.
fn check(what: &str, op: UnaryOp, x: &Tensor, view: impl Fn(&Tensor) -> Result<Tensor>) {
    let dtype = x.dtype();
    if op.result_dtype(dtype).is_err() {
        return; // error cases are checked separately
    }
    let (rtol, atol) = unary_tolerance(dtype);
    cpu_vs_cuda(&format!("{} {dtype} {what}", op.name()), rtol, atol, |dev| {
        view(&x.to(dev)?)?.unary_op(op)
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_op_every_dtype_every_layout() {
    gpu();
    for dtype in DTYPES {
        // 67 + 23 specials: odd, not a multiple of the vector width.
        let flat = special_and_random(67, 1);
        let n = flat.len();
        let x1 = cpu_input(&flat, &[n], dtype);
        let grid = special_and_random(9 * 13 - 23, 2);
        let x2 = cpu_input(&grid, &[9, 13], dtype);
        let row = cpu_input(&special_and_random(7, 3)[18..25], &[1, 7], dtype);
        let empty = cpu_input(&[], &[0, 5], dtype);
        let scalar = cpu_input(&[-2.5], &[], dtype);
        for op in all_ops() {
            check("contiguous", op, &x1, |t| Ok(t.clone()));
            // Starts one element in: misaligned for the vector path, then the scalar tail.
            check("offset 1", op, &x1, |t| t.narrow(0, 1, n - 1));
            check("transposed", op, &x2, |t| t.t());
            check("sliced step 2", op, &x2, |t| t.slice(1, 1, 13, 2));
            check("broadcast", op, &row, |t| t.expand(&[5, 7]));
            check("empty", op, &empty, |t| Ok(t.clone()));
            check("0-d", op, &scalar, |t| Ok(t.clone()));
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn large_inputs() {
    gpu();
    // 1 << 20 (+ 3: a vector tail) elements, contiguous and strided, for a spread of ops.
    let n = (1 << 20) + 3;
    let v: Vec<f64> = values(n, 5).into_iter().map(|x| x * 5.0).collect();
    let ops = [
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Gelu,
        UnaryOp::Round,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Softplus {
            beta: 1.0,
            threshold: 20.0,
        },
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32] {
        let x = cpu_input(&v, &[n], dtype);
        let m = cpu_input(&v[..1024 * 1024], &[1024, 1024], dtype);
        for op in ops {
            check("large", op, &x, |t| Ok(t.clone()));
            check("large transposed", op, &m, |t| t.t());
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn integer_ops_wrap_at_the_extremes() {
    let dev = gpu();
    let int_ops = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Square,
        UnaryOp::Relu,
        UnaryOp::Floor,
        UnaryOp::Round,
    ];
    let i64s = Tensor::from_slice(
        &[i64::MIN, i64::MIN + 1, -5, -1, 0, 1, 7, 3_037_000_500, i64::MAX],
        [9],
        Device::Cpu,
    )
    .unwrap();
    let i32s =
        Tensor::from_slice(&[i32::MIN, -46_341, -1, 0, 1, 46_341, i32::MAX], [7], Device::Cpu).unwrap();
    let u8s = Tensor::from_slice(&[0u8, 1, 2, 15, 16, 128, 200, 255], [8], Device::Cpu).unwrap();
    for x in [&i64s, &i32s, &u8s] {
        for op in int_ops {
            let want = x.unary_op(op).unwrap();
            let got = x.to(dev).unwrap().unary_op(op).unwrap();
            assert_eq!(got.dtype(), want.dtype(), "{} {}", op.name(), x.dtype());
            assert_eq!(got.device(), dev);
            // Exact: compare the raw integers (f64 would lose i64's low bits).
            let got_cpu = got.to(Device::Cpu).unwrap();
            let eq = got_cpu.eq(&want).unwrap().to_vec_f64().unwrap();
            assert!(
                eq.iter().all(|&e| e == 1.0),
                "{} {}: cuda {:?} cpu {:?}",
                op.name(),
                x.dtype(),
                got_cpu.to_vec_f64().unwrap(),
                want.to_vec_f64().unwrap()
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bool_inputs_and_dtype_errors() {
    let dev = gpu();
    let b = Tensor::from_slice(&[true, false, true], [3], Device::Cpu).unwrap();
    // abs/sign keep bool, square gives int64, float ops give f32.
    for (op, dtype) in [
        (UnaryOp::Abs, DType::Bool),
        (UnaryOp::Sign, DType::Bool),
        (UnaryOp::Square, DType::I64),
        (UnaryOp::Exp, DType::F32),
        (UnaryOp::Sigmoid, DType::F32),
    ] {
        let got = b.to(dev).unwrap().unary_op(op).unwrap();
        assert_eq!(got.dtype(), dtype, "{}", op.name());
        assert_eq!(
            got.to_vec_f64().unwrap(),
            b.unary_op(op).unwrap().to_vec_f64().unwrap(),
            "{}",
            op.name()
        );
    }
    // Integer inputs of float ops give f32 on both devices.
    let i = Tensor::from_slice(&[-3i64, 0, 5], [3], Device::Cpu).unwrap();
    assert_eq!(i.to(dev).unwrap().sqrt().unwrap().dtype(), DType::F32);
    for op in [UnaryOp::Neg, UnaryOp::Relu, UnaryOp::Floor, UnaryOp::Round] {
        let cpu = b.unary_op(op).unwrap_err();
        let cuda = b.to(dev).unwrap().unary_op(op).unwrap_err();
        assert!(matches!(cpu, Error::UnsupportedDType { .. }), "{cpu}");
        assert!(
            matches!(cuda, Error::UnsupportedDType { .. }),
            "{}: {cuda}",
            op.name()
        );
        assert_eq!(cpu.to_string(), cuda.to_string());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn named_methods_dispatch_to_the_kernels() {
    let dev = gpu();
    let x = cpu_input(&special_and_random(41, 9), &[64], DType::F32);
    let (rtol, atol) = unary_tolerance(DType::F32);
    type F = fn(&Tensor) -> Result<Tensor>;
    let methods: [(&str, F); 8] = [
        ("relu6", |t| t.relu6()),
        ("selu", |t| t.selu()),
        ("softplus", |t| t.softplus()),
        ("leaky_relu", |t| t.leaky_relu(0.2)),
        ("elu", |t| t.elu(1.3)),
        ("celu", |t| t.celu(0.5)),
        ("hardtanh", |t| t.hardtanh(-2.0, 0.5)),
        ("gelu_tanh", |t| t.gelu_tanh()),
    ];
    for (name, f) in methods {
        cpu_vs_cuda(name, rtol, atol, |d| f(&x.to(d)?));
    }
    assert_eq!(x.to(dev).unwrap().relu().unwrap().device(), dev);
}
