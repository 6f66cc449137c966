//! CUDA against the CPU for copies, casts and elementwise ops: every dtype, contiguous,
//! strided, broadcast and offset views, sizes that do not divide the vector width.

use crate::common::{cpu_vs_cuda, gpu, tolerance, values, ReadBack};
use ember_core::backend::op::Bools;
use ember_core::ops::binary::BinaryOp;
use ember_core::{DType, Device, Error, Result, Tensor};

/// Every dtype ember has.
const ALL: [DType; 8] = crate::common::ALL_DTYPES;

/// Values of `dtype` on `device`: small integers for integer dtypes (u8 non-negative), signed
/// fractions for floats, a mix for bool.
fn input(n: usize, seed: u64, dtype: DType, device: Device) -> Result<Tensor> {
    let v: Vec<f64> = values(n, seed)
        .into_iter()
        .map(|x| match dtype {
            DType::U8 => (x.abs() * 9.0).floor(),
            DType::I32 | DType::I64 => (x * 9.0).round(),
            DType::Bool => (x > 0.0) as u8 as f64,
            _ => x * 3.0,
        })
        .collect();
    Tensor::from_slice(&v, [n], Device::Cpu)?
        .to_dtype(dtype)?
        .to(device)
}

/// The view shapes every op is checked on: (name, builder of two operands from a device).
fn operand_cases(dtype: DType) -> Vec<(&'static str, Box<dyn Fn(Device) -> Result<(Tensor, Tensor)>>)> {
    vec![
        (
            "contiguous 1027",
            Box::new(move |d| Ok((input(1027, 1, dtype, d)?, input(1027, 2, dtype, d)?))),
        ),
        (
            "empty",
            Box::new(move |d| Ok((input(0, 1, dtype, d)?, input(0, 2, dtype, d)?))),
        ),
        (
            "one element",
            Box::new(move |d| Ok((input(1, 1, dtype, d)?, input(1, 2, dtype, d)?))),
        ),
        (
            "large 1<<20 + 3",
            Box::new(move |d| {
                Ok((
                    input((1 << 20) + 3, 3, dtype, d)?,
                    input((1 << 20) + 3, 4, dtype, d)?,
                ))
            }),
        ),
        (
            "scalar rhs",
            Box::new(move |d| Ok((input(515, 5, dtype, d)?, input(1, 6, dtype, d)?.reshape(())?))),
        ),
        (
            "scalar lhs",
            Box::new(move |d| Ok((input(1, 5, dtype, d)?.reshape(())?, input(515, 6, dtype, d)?))),
        ),
        (
            "row broadcast",
            Box::new(move |d| {
                Ok((
                    input(33 * 17, 7, dtype, d)?.reshape(&[33, 17])?,
                    input(17, 8, dtype, d)?,
                ))
            }),
        ),
        (
            "column broadcast",
            Box::new(move |d| {
                Ok((
                    input(33 * 17, 7, dtype, d)?.reshape(&[33, 17])?,
                    input(33, 8, dtype, d)?.reshape(&[33, 1])?,
                ))
            }),
        ),
        (
            "transposed",
            Box::new(move |d| {
                let a = input(24 * 19, 9, dtype, d)?.reshape(&[24, 19])?.t()?;
                Ok((a, input(19 * 24, 10, dtype, d)?.reshape(&[19, 24])?))
            }),
        ),
        (
            "sliced with offset and step",
            Box::new(move |d| {
                let a = input(300, 11, dtype, d)?.slice(0, 3, 297, 2)?;
                let b = input(200, 12, dtype, d)?.narrow(0, 50, 147)?;
                Ok((a, b))
            }),
        ),
        (
            "rank 4 permuted",
            Box::new(move |d| {
                let a = input(2 * 3 * 5 * 7, 13, dtype, d)?
                    .reshape(&[2, 3, 5, 7])?
                    .permute(&[3, 1, 0, 2])?;
                let b = input(7 * 3 * 2 * 5, 14, dtype, d)?.reshape(&[7, 3, 2, 5])?;
                Ok((a, b))
            }),
        ),
    ]
}

#[test]
#[ignore = "needs a CUDA device"]
fn values_round_trip_every_dtype() {
    let gpu = gpu();
    for dtype in ALL {
        let host = input(1001, 21, dtype, Device::Cpu).unwrap();
        let back = host.to(gpu).unwrap().to(Device::Cpu).unwrap();
        assert_eq!(back.to_vec_f64().unwrap(), host.to_vec_f64().unwrap(), "{dtype}");
        assert_eq!(host.to(gpu).unwrap().device(), gpu);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn casts_between_every_pair_of_dtypes() {
    gpu();
    for src in ALL {
        for dst in ALL {
            let what = format!("{src} -> {dst}");
            cpu_vs_cuda(&what, 0.0, 0.0, |d| input(1027, 31, src, d)?.to_dtype(dst));
            cpu_vs_cuda(&format!("{what} transposed"), 0.0, 0.0, |d| {
                input(40 * 30, 32, src, d)?.reshape(&[40, 30])?.t()?.to_dtype(dst)
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn strided_copies_and_fills() {
    gpu();
    for dtype in ALL {
        cpu_vs_cuda(
            &format!("contiguous of a permuted view, {dtype}"),
            0.0,
            0.0,
            |d| {
                input(4 * 5 * 6, 41, dtype, d)?
                    .reshape(&[4, 5, 6])?
                    .permute(&[2, 0, 1])?
                    .contiguous()
            },
        );
        cpu_vs_cuda(
            &format!("contiguous of an expanded view, {dtype}"),
            0.0,
            0.0,
            |d| {
                input(6, 42, dtype, d)?
                    .reshape(&[6, 1])?
                    .expand(&[6, 9])?
                    .contiguous()
            },
        );
        cpu_vs_cuda(&format!("copy_ into a strided region, {dtype}"), 0.0, 0.0, |d| {
            let dst = Tensor::zeros([8, 10], dtype, d)?;
            let src = input(8 * 4, 43, dtype, Device::Cpu)?.reshape(&[8, 4])?;
            dst.narrow(1, 3, 4)?.copy_(&src)?;
            let src_dev = input(5, 44, dtype, d)?;
            dst.select(0, 2)?.slice(0, 0, 10, 2)?.copy_(&src_dev)?;
            Ok(dst)
        });
        // Note [Copies in words]: rows into a slice of wider rows move as 8-byte words when
        // every row start and length divides into them (the first two: `narrow`'s backward),
        // element by element otherwise (an odd start, an odd length).
        for (start, len) in [(8, 16), (0, 24), (1, 16), (8, 15)] {
            cpu_vs_cuda(
                &format!("rows of {len} into a slice from {start} of rows of 40, {dtype}"),
                0.0,
                0.0,
                |d| {
                    let dst = Tensor::zeros([7, 40], dtype, d)?;
                    let src = input(7 * len, 45, dtype, d)?.reshape(&[7, len])?;
                    dst.narrow(1, start, len)?.copy_(&src)?;
                    // And back out of the slice: the source strided, the destination dense.
                    Ok(Tensor::cat(
                        &[&dst, &dst.narrow(1, start, len)?.contiguous()?],
                        1,
                    )?)
                },
            );
        }
        cpu_vs_cuda(&format!("full and fill_, {dtype}"), 0.0, 0.0, |d| {
            let t = Tensor::full([3, 1001], 1.0, dtype, d)?;
            t.narrow(0, 1, 1)?.fill_(0.0)?;
            Ok(t)
        });
    }
    cpu_vs_cuda("fill_ of i64 beyond 2^53", 0.0, 0.0, |d| {
        Tensor::full([9], (1i64 << 40) as f64 + 3.0, DType::I64, d)
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn arithmetic_matches_the_cpu_on_every_dtype_and_layout() {
    gpu();
    let ops = BinaryOp::ALL.iter().copied();
    for dtype in ALL {
        let (rtol, atol) = tolerance(dtype);
        for (case, make) in operand_cases(dtype) {
            for op in ops.clone() {
                if dtype == DType::Bool && op.bools() == Bools::No {
                    continue; // an error on both devices, checked below
                }
                let what = format!("{} {dtype} {case}", op.name());
                // GELU's backward of integers computes in float32 (a transcendental, whose last
                // bits differ between the CPU's libm and CUDA's): float32's tolerance.
                let gelu = matches!(op, BinaryOp::GeluBackward | BinaryOp::GeluTanhBackward);
                let (rtol, atol) = if gelu && !dtype.is_floating_point() {
                    tolerance(DType::F32)
                } else {
                    (rtol, atol)
                };
                cpu_vs_cuda(&what, rtol, atol, |d| {
                    let (a, b) = make(d)?;
                    let b = if op == BinaryOp::Pow && !dtype.is_floating_point() {
                        b.maximum_scalar(0)?
                    } else {
                        b
                    };
                    match op {
                        BinaryOp::Add => a.add(&b),
                        BinaryOp::Sub => a.sub(&b),
                        BinaryOp::Mul => a.mul(&b),
                        BinaryOp::Div => a.div(&b),
                        BinaryOp::Pow => a.pow(&b),
                        BinaryOp::Maximum => a.maximum(&b),
                        BinaryOp::Minimum => a.minimum(&b),
                        BinaryOp::Xlogy => a.xlogy(&b),
                        BinaryOp::GeluBackward => a.gelu_backward(&b),
                        BinaryOp::GeluTanhBackward => a.gelu_tanh_backward(&b),
                    }
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn comparisons_logical_ops_and_where() {
    let gpu = gpu();
    for dtype in ALL {
        for (case, make) in operand_cases(dtype) {
            let what = format!("{dtype} {case}");
            cpu_vs_cuda(&format!("lt {what}"), 0.0, 0.0, |d| {
                make(d).and_then(|(a, b)| a.lt(&b))
            });
            cpu_vs_cuda(&format!("eq {what}"), 0.0, 0.0, |d| {
                make(d).and_then(|(a, b)| a.eq(&b))
            });
            cpu_vs_cuda(&format!("ge {what}"), 0.0, 0.0, |d| {
                make(d).and_then(|(a, b)| a.ge(&b))
            });
            cpu_vs_cuda(&format!("where {what}"), 0.0, 0.0, |d| {
                let (a, b) = make(d)?;
                Tensor::where_cond(&a.gt(&b)?, &a, &b)
            });
        }
    }
    for (case, make) in operand_cases(DType::Bool) {
        cpu_vs_cuda(&format!("logical_xor {case}"), 0.0, 0.0, |d| {
            make(d).and_then(|(a, b)| a.logical_xor(&b))
        });
        cpu_vs_cuda(&format!("logical_and {case}"), 0.0, 0.0, |d| {
            make(d).and_then(|(a, b)| a.logical_and(&b))
        });
    }
    // NaN semantics of maximum and comparisons.
    cpu_vs_cuda("NaN propagation", 0.0, 0.0, |d| {
        let a = Tensor::from_vec(vec![f32::NAN, 1.0, f32::NAN, -0.0], [4], d)?;
        let b = Tensor::from_vec(vec![1.0f32, f32::NAN, f32::NAN, 0.0], [4], d)?;
        Tensor::cat(
            &[&a.maximum(&b)?, &a.minimum(&b)?, &a.eq(&b)?.to_dtype(DType::F32)?],
            0,
        )
    });
    // Scalar forms keep the tensor's dtype.
    let h = input(10, 51, DType::F16, gpu).unwrap().mul_scalar(2.5).unwrap();
    assert_eq!((h.dtype(), h.device()), (DType::F16, gpu));
}

#[test]
#[ignore = "needs a CUDA device"]
fn errors_on_the_gpu_match_the_cpu() {
    let gpu = gpu();
    let a = Tensor::ones([3], DType::F32, gpu).unwrap();
    let c = Tensor::ones([3], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(a.add(&c), Err(Error::DeviceMismatch { .. })));
    let b = Tensor::ones([3], DType::Bool, gpu).unwrap();
    assert!(matches!(b.sub(&b), Err(Error::UnsupportedDType { .. })));
    let i = Tensor::from_vec(vec![2i64, 3], [2], gpu).unwrap();
    let e = Tensor::from_vec(vec![1i64, -1], [2], gpu).unwrap();
    // A negative integer exponent is found on the device, reported at the read-back, with the
    // CPU's message; a scalar one at once (it is known on the host).
    let err = i.pow(&e).read_back().unwrap_err();
    let cpu_err = i
        .to(Device::Cpu)
        .unwrap()
        .pow(&e.to(Device::Cpu).unwrap())
        .unwrap_err();
    assert_eq!(err.to_string(), cpu_err.to_string());
    assert!(matches!(err, Error::InvalidArgument { op: "pow", .. }), "{err}");
    assert!(matches!(i.pow_scalar(-2), Err(Error::InvalidArgument { .. })));
    // Reported once: the device is usable again.
    assert_eq!(i.pow(&i).unwrap().to_vec::<i64>().unwrap(), [4, 27]);
    assert!(matches!(
        a.add(&Tensor::ones([4], DType::F32, gpu).unwrap()),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn add_out_writes_into_the_given_tensor() {
    let gpu = gpu();
    let a = input(4099, 61, DType::F32, gpu).unwrap();
    let b = input(4099, 62, DType::F32, gpu).unwrap();
    let out = Tensor::zeros([4099], DType::F32, gpu).unwrap();
    let r = a.add_out(&b, &out).unwrap();
    assert!(r.shares_storage_with(&out));
    assert_eq!(
        out.to_vec::<f32>().unwrap(),
        a.add(&b).unwrap().to_vec::<f32>().unwrap()
    );
    // Aliased output works too.
    a.add_out(&b, &a).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), out.to_vec::<f32>().unwrap());
    let wrong = Tensor::zeros([4099], DType::F64, gpu).unwrap();
    assert!(matches!(a.add_out(&b, &wrong), Err(Error::DTypeMismatch { .. })));
}

/// Note [Mixed operands] (`elementwise.cu`): add, sub and mul of a float32 and a half operand
/// (either order) read each in its own dtype on CUDA, where the CPU casts the half one to
/// float32 first; both give the same bits on every layout, and the gradients come back in each
/// operand's dtype.
#[test]
#[ignore = "needs a CUDA device"]
fn float32_beside_a_half_operand_matches_the_cast_on_the_cpu() {
    gpu();
    for half in [DType::BF16, DType::F16] {
        for (case, make) in operand_cases(DType::F32) {
            for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul] {
                for half_first in [false, true] {
                    let what = format!("{} f32 with {half} ({case}, half first: {half_first})", op.name());
                    cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                        let (a, b) = make(d)?;
                        let (a, b) = if half_first {
                            (a.to_dtype(half)?, b)
                        } else {
                            (a, b.to_dtype(half)?)
                        };
                        let out = match op {
                            BinaryOp::Add => a.add(&b)?,
                            BinaryOp::Sub => a.sub(&b)?,
                            _ => a.mul(&b)?,
                        };
                        assert_eq!(out.dtype(), DType::F32, "{what}");
                        Ok(out)
                    });
                }
            }
        }
        // Gradients: each in its operand's dtype, as through the cast (b's sums 5 rows, whose
        // order may differ between the devices: the half dtype's tolerance).
        let (rtol, atol) = tolerance(half);
        for which in 0..2 {
            let what = format!("gradients of f32 * {half}, operand {which}");
            cpu_vs_cuda(&what, rtol, atol, |d| {
                let a = input(515, 21, DType::F32, d)?
                    .reshape(&[5, 103])?
                    .requires_grad_(true)?;
                let b = input(103, 22, DType::F32, d)?
                    .to_dtype(half)?
                    .requires_grad_(true)?;
                let y = a.mul(&b)?.add(&b)?;
                y.sum_all()?.backward()?;
                let (ga, gb) = (a.grad().expect("a's gradient"), b.grad().expect("b's gradient"));
                assert_eq!((ga.dtype(), gb.dtype()), (DType::F32, half), "{what}");
                Ok(if which == 0 { ga } else { gb })
            });
        }
    }
}

/// The in-place scalar ops on a GPU (`add_scalar_`, `sub_scalar_`, `mul_scalar_`,
/// `div_scalar_`): over a row-major float tensor, whole or an offset view whose pointer is not
/// 16-byte aligned, the scalar op's one kernel reads and writes it, with no copy after; a
/// strided view has the out-of-place result written back. Every case ends with the
/// out-of-place op's values, bit for bit, and a bumped version.
#[test]
#[ignore = "needs a CUDA device"]
fn inplace_scalar_ops_run_one_kernel_over_row_major_floats() {
    type Op = fn(&Tensor, f64) -> Result<Tensor>;
    let gpu = gpu();
    let ops: [(&str, Op, Op); 4] = [
        ("add_scalar_", |t, v| t.add_scalar(v), |t, v| t.add_scalar_(v)),
        ("sub_scalar_", |t, v| t.sub_scalar(v), |t, v| t.sub_scalar_(v)),
        ("mul_scalar_", |t, v| t.mul_scalar(v), |t, v| t.mul_scalar_(v)),
        ("div_scalar_", |t, v| t.div_scalar(v), |t, v| t.div_scalar_(v)),
    ];
    // 4,099 elements: not a multiple of any vector width.
    let n = 4099;
    type View = fn(&Tensor) -> Result<Tensor>;
    let views: [(&str, View, bool); 3] = [
        ("whole", |t| Ok(t.clone()), true),
        ("offset by one", |t| t.narrow(0, 1, 4098), true),
        ("strided", |t| t.narrow(0, 0, 4096)?.reshape([64, 64])?.t(), false),
    ];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (name, out_of_place, in_place) in ops {
            for (view, make, direct) in views {
                let what = format!("{name} {dtype} {view}");
                let x = input(n, 11, dtype, gpu).unwrap();
                let v = make(&x).unwrap();
                let expected = out_of_place(&v, 0.3).unwrap().to_vec_f64().unwrap();
                let before = x.version();
                let names = crate::common::kernels_of(0, || {
                    in_place(&v, 0.3).unwrap();
                });
                assert_eq!(v.to_vec_f64().unwrap(), expected, "{what}");
                assert!(x.version() > before, "{what}: the version is bumped");
                if direct {
                    assert_eq!(names.len(), 1, "{what}: {names:?}");
                    assert!(names[0].starts_with("unary_"), "{what}: {names:?}");
                } else {
                    assert!(names.len() >= 2, "{what}: the op, then the write back: {names:?}");
                }
            }
        }
    }
}
