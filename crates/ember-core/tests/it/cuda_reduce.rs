//! CUDA reductions and softmax against the CPU backend: every op and dtype, contiguous,
//! transposed, sliced (non-zero offset) and broadcast inputs, empty and size-1 shapes, large
//! reductions split over many blocks, NaN/inf handling, ties, and the error cases.

use crate::common::{self, cpu_vs_cuda, tolerance};
use ember_core::{DType, Device, Error, Result, Tensor};

/// Every dtype ember has.
const ALL: [DType; 8] = crate::common::ALL_DTYPES;
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// How the input of a check is laid out on the device.
#[derive(Debug, Clone, Copy)]
enum View {
    Contiguous,
    /// The last two dims transposed (strided, not contiguous).
    Transposed,
    /// A narrow of dim 0 starting at 1 (non-zero storage offset).
    Sliced,
    /// Dim 0 broadcast from size 1 (stride 0).
    Broadcast,
}
const VIEWS: [View; 4] = [View::Contiguous, View::Transposed, View::Sliced, View::Broadcast];

/// Values in [-1, 1) scaled for `dtype` (small integers for integer types, signs for bool).
fn host_values(n: usize, seed: u64, dtype: DType) -> Vec<f64> {
    common::values(n, seed)
        .into_iter()
        .map(|v| match dtype {
            DType::Bool => (v > 0.0) as u8 as f64,
            DType::U8 => ((v + 1.0) * 8.0).floor(),
            d if !d.is_floating_point() => (v * 8.0).trunc(),
            _ => v * 3.0,
        })
        .collect()
}

/// A tensor of `shape` and `dtype` on `device`, laid out as `view`; the same values on every
/// device (built on the CPU, moved, then viewed on the device).
fn input(shape: &[usize], dtype: DType, view: View, seed: u64, device: Device) -> Tensor {
    let mut base_shape = shape.to_vec();
    match view {
        View::Transposed if shape.len() >= 2 => base_shape.swap(shape.len() - 2, shape.len() - 1),
        View::Sliced if !shape.is_empty() => base_shape[0] += 2,
        View::Broadcast if !shape.is_empty() => base_shape[0] = 1,
        _ => {}
    }
    let n: usize = base_shape.iter().product();
    let base = Tensor::from_slice(&host_values(n, seed, dtype), base_shape.as_slice(), Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to(device)
        .unwrap();
    let r = shape.len() as isize;
    match view {
        View::Transposed if shape.len() >= 2 => base.transpose(r - 2, r - 1).unwrap(),
        View::Sliced if !shape.is_empty() => base.narrow(0, 1, shape[0]).unwrap(),
        View::Broadcast if !shape.is_empty() => base.broadcast_to(&shape.into()).unwrap(),
        _ => base,
    }
}

/// Tolerance of a reduction result of `dtype` over `k` elements: the half types round the
/// f32 result once, f32/f64 sums differ from the CPU's pairwise order by a few ulps of the
/// magnitudes summed.
fn tol(dtype: DType, k: usize) -> (f64, f64) {
    let (r, a) = tolerance(dtype);
    let grow = (k.max(1) as f64).sqrt();
    match dtype {
        DType::F32 => (r * 10.0, a * grow * 10.0),
        DType::F64 => (r, a * grow),
        _ => (r, a),
    }
}

type Op = fn(&Tensor, &[isize]) -> Result<Tensor>;

/// Every reduction (name, float-only, the call on a tensor over dims).
fn reductions() -> Vec<(&'static str, bool, Op)> {
    vec![
        ("sum", false, |x, d| x.sum_dims(d, false)),
        ("sum keepdim", false, |x, d| x.sum_dims(d, true)),
        ("prod", false, |x, d| x.prod_dims(d, false)),
        ("amax", false, |x, d| x.amax(d, false)),
        ("amin", false, |x, d| x.amin(d, true)),
        ("mean", true, |x, d| x.mean_dims(d, false)),
        ("logsumexp", true, |x, d| x.logsumexp(d, false)),
        ("var", true, |x, d| x.var(d, 1.0, false)),
        ("std", true, |x, d| x.std(d, 0.0, true)),
        ("norm2", true, |x, d| x.norm(2.0, d, false)),
        ("norm1", true, |x, d| x.norm(1.0, d, false)),
        ("norm_inf", true, |x, d| x.norm(f64::INFINITY, d, false)),
        ("norm_-inf", true, |x, d| x.norm(f64::NEG_INFINITY, d, false)),
        ("norm0", true, |x, d| x.norm(0.0, d, false)),
        ("norm3", true, |x, d| x.norm(3.0, d, false)),
        ("norm0.5", true, |x, d| x.norm(0.5, d, false)),
    ]
}

/// Runs every reduction over `dims` of `shape` on every dtype and view.
fn check_shape(shape: &[usize], dims_list: &[&[isize]]) {
    let numel: usize = shape.iter().product();
    for dtype in ALL {
        for view in VIEWS {
            for &dims in dims_list {
                let k: usize = if dims.is_empty() {
                    numel
                } else {
                    dims.iter()
                        .map(|&d| shape[d.rem_euclid(shape.len() as isize) as usize])
                        .product()
                };
                for (name, float_only, op) in reductions() {
                    if float_only && !dtype.is_floating_point() {
                        continue;
                    }
                    let no_identity = name.starts_with("am") || name.contains("inf");
                    if k == 0 && no_identity {
                        continue;
                    }
                    // Products of many elements under/overflow: keep them short.
                    if name == "prod" && k > 64 {
                        continue;
                    }
                    let (rtol, atol) = tol(dtype, k);
                    let what = format!("{name} {dtype:?} {shape:?} dims {dims:?} {view:?}");
                    cpu_vs_cuda(&what, rtol, atol, |dev| {
                        op(&input(shape, dtype, view, 7, dev), dims)
                    });
                }
                if k > 0 && dims.len() <= 1 && !shape.is_empty() {
                    let dim = dims.first().copied();
                    let what = format!("argmax/argmin {dtype:?} {shape:?} dim {dim:?} {view:?}");
                    cpu_vs_cuda(&what, 0.0, 0.0, |dev| {
                        input(shape, dtype, view, 7, dev).argmax(dim, false)
                    });
                    cpu_vs_cuda(&what, 0.0, 0.0, |dev| {
                        input(shape, dtype, view, 7, dev).argmin(dim, true)
                    });
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn reductions_match_cpu_on_small_shapes() {
    common::gpu();
    check_shape(&[3, 5, 7], &[&[], &[0], &[1], &[2], &[0, 2], &[1, 2], &[0, 1]]);
    check_shape(&[17], &[&[], &[0]]);
    check_shape(&[1], &[&[0]]);
    check_shape(&[1, 1], &[&[0], &[1], &[]]);
    check_shape(&[6, 1, 9], &[&[1], &[0, 2], &[2]]);
    check_shape(&[2, 3, 4, 5], &[&[1, 3], &[0, 2], &[3]]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn reductions_match_cpu_on_rows_longer_than_a_block() {
    common::gpu();
    // Row mode with several lanes per element, col mode with lanes along y, and K split.
    check_shape(&[5, 1000], &[&[1], &[0], &[]]);
    check_shape(&[33, 301], &[&[0], &[1]]);
    check_shape(&[3, 4097, 2], &[&[1], &[0, 1], &[1, 2]]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn empty_and_zero_dim_reductions() {
    common::gpu();
    // K == 0 (filled with the identity's result) and M == 0 (empty output).
    check_shape(&[0, 5], &[&[0], &[1], &[]]);
    check_shape(&[4, 0, 3], &[&[1], &[0, 2], &[2]]);
    // A 0-d tensor reduces nothing.
    for dtype in ALL {
        for (name, float_only, op) in reductions() {
            if float_only && !dtype.is_floating_point() {
                continue;
            }
            cpu_vs_cuda(&format!("{name} of a scalar {dtype:?}"), 0.0, 0.0, |dev| {
                let x = Tensor::scalar(1.0, dtype, Device::Cpu)?.to(dev)?;
                op(&x, &[])
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn large_reductions_use_many_blocks() {
    common::gpu();
    let n = 1 << 24;
    for dtype in [DType::F32, DType::F16, DType::I32] {
        cpu_vs_cuda(&format!("sum_all of 2^24 {dtype:?}"), 1e-4, 1e-2, |dev| {
            input(&[n], dtype, View::Contiguous, 3, dev).sum_all()
        });
    }
    let big: &[(&[usize], &[isize])] = &[
        (&[4, 1 << 20], &[0]),
        (&[4, 1 << 20], &[1]),
        (&[1 << 20, 4], &[0]),
        (&[1 << 20, 4], &[1]),
        (&[1 << 10, 1 << 10], &[0]),
        (&[1 << 20], &[0]),
    ];
    for &(shape, dims) in big {
        let k: usize = dims.iter().map(|&d| shape[d as usize]).product();
        for view in [View::Contiguous, View::Transposed] {
            for (name, _, op) in reductions() {
                if name == "prod" {
                    continue;
                }
                let what = format!("{name} f32 {shape:?} dims {dims:?} {view:?}");
                let (rtol, atol) = (1e-4, 1e-5 * (k as f64).sqrt());
                cpu_vs_cuda(&what, rtol, atol, |dev| {
                    op(&input(shape, DType::F32, view, 5, dev), dims)
                });
            }
            let what = format!("argmax f32 {shape:?} dims {dims:?} {view:?}");
            cpu_vs_cuda(&what, 0.0, 0.0, |dev| {
                input(shape, DType::F32, view, 5, dev).argmax(Some(dims[0]), false)
            });
        }
    }
    // var of a large row with a large mean: Welford must not cancel.
    cpu_vs_cuda("var of shifted values", 1e-4, 1e-6, |dev| {
        input(&[1 << 20], DType::F32, View::Contiguous, 9, dev)
            .add_scalar(1000.0)?
            .var(&[], 1.0, false)
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn ties_take_the_first_index_even_across_blocks() {
    let gpu = common::gpu();
    // All equal: index 0 everywhere, including a full reduction split over many blocks.
    for n in [5usize, 1000, 1 << 20] {
        for dtype in ALL {
            let x = Tensor::zeros([n], dtype, gpu).unwrap();
            assert_eq!(x.argmax(None, false).unwrap().to_vec_f64().unwrap(), vec![0.0]);
            assert_eq!(x.argmin(None, false).unwrap().to_vec_f64().unwrap(), vec![0.0]);
            let (v, i) = x.max_dim(0, false).unwrap();
            assert_eq!(
                (v.to_vec_f64().unwrap(), i.to_vec_f64().unwrap()),
                (vec![0.0], vec![0.0])
            );
        }
    }
    // The max twice, far apart: the first wins; the min at the lowest value of the dtype.
    let n = 1 << 20;
    let mut v = vec![0.0f32; n];
    v[700_001] = 5.0;
    v[900_000] = 5.0;
    v[12_345] = -1.0;
    v[800_000] = -1.0;
    let x = Tensor::from_slice(&v, [n], gpu).unwrap();
    assert_eq!(
        x.argmax(None, false).unwrap().to_vec_f64().unwrap(),
        vec![700_001.0]
    );
    assert_eq!(
        x.argmin(None, false).unwrap().to_vec_f64().unwrap(),
        vec![12_345.0]
    );
    let y = Tensor::from_slice(&[i64::MIN, 3, i64::MIN], [3], gpu).unwrap();
    assert_eq!(y.argmin(None, false).unwrap().to_vec_f64().unwrap(), vec![0.0]);
    let y = Tensor::from_slice(&[-1i64, i64::MIN, i64::MIN], [3], gpu).unwrap();
    assert_eq!(y.argmin(None, false).unwrap().to_vec_f64().unwrap(), vec![1.0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn max_min_with_indices_match_cpu() {
    common::gpu();
    for dtype in ALL {
        for view in VIEWS {
            for (shape, dim) in [
                (&[3usize, 5, 7][..], 1isize),
                (&[3, 5, 7], 2),
                (&[3, 5, 7], 0),
                (&[4, 3000], 1),
            ] {
                for max in [true, false] {
                    let what = format!("max_dim={max} {dtype:?} {shape:?} dim {dim} {view:?}");
                    let run = |dev: Device| -> Result<(Tensor, Tensor)> {
                        let x = input(shape, dtype, view, 11, dev);
                        if max {
                            x.max_dim(dim, false)
                        } else {
                            x.min_dim(dim, true)
                        }
                    };
                    cpu_vs_cuda(&format!("{what} values"), 0.0, 0.0, |dev| Ok(run(dev)?.0));
                    cpu_vs_cuda(&format!("{what} indices"), 0.0, 0.0, |dev| Ok(run(dev)?.1));
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn nan_and_inf_like_cpu() {
    common::gpu();
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let rows: Vec<Vec<f64>> = vec![
        vec![1.0, nan, 3.0, nan, -2.0],
        vec![1.0, inf, 3.0, -inf, 0.0],
        vec![inf, inf, 1.0, 2.0, 3.0],
        vec![-inf, -inf, -inf, -inf, -inf],
        vec![nan, inf, -inf, 0.0, 1.0],
        vec![2.0, 2.0, -0.0, 0.0, 2.0],
    ];
    let flat: Vec<f64> = rows.concat();
    for dtype in FLOATS {
        let make = |dev: Device| -> Tensor {
            Tensor::from_slice(&flat, [rows.len(), 5], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap()
        };
        let (rtol, atol) = tolerance(dtype);
        for (name, _, op) in reductions() {
            for dims in [&[1isize][..], &[0], &[]] {
                let what = format!("{name} with NaN/inf {dtype:?} dims {dims:?}");
                cpu_vs_cuda(&what, rtol, atol, |dev| op(&make(dev), dims));
            }
        }
        for dim in [0isize, 1] {
            cpu_vs_cuda(&format!("argmax NaN {dtype:?} {dim}"), 0.0, 0.0, |dev| {
                make(dev).argmax(Some(dim), false)
            });
            cpu_vs_cuda(&format!("argmin NaN {dtype:?} {dim}"), 0.0, 0.0, |dev| {
                make(dev).argmin(Some(dim), false)
            });
            cpu_vs_cuda(&format!("max_dim NaN {dtype:?} {dim}"), 0.0, 0.0, |dev| {
                Ok(make(dev).max_dim(dim, false)?.0)
            });
            for log in [false, true] {
                cpu_vs_cuda(
                    &format!("softmax NaN/inf {dtype:?} {dim} log={log}"),
                    rtol,
                    atol,
                    |dev| {
                        let x = make(dev);
                        if log {
                            x.log_softmax(dim)
                        } else {
                            x.softmax(dim)
                        }
                    },
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn reduction_errors_match_cpu() {
    let gpu = common::gpu();
    for dev in [Device::Cpu, gpu] {
        let ints = Tensor::zeros([3, 4], DType::I32, dev).unwrap();
        for r in [
            ints.mean_dims(&[0], false),
            ints.var(&[0], 1.0, false),
            ints.norm(2.0, &[], false),
            ints.softmax(0),
            ints.log_softmax(1),
        ] {
            assert!(matches!(r, Err(Error::UnsupportedDType { .. })), "{dev}: {r:?}");
        }
        let empty = Tensor::zeros([3, 0], DType::F32, dev).unwrap();
        for r in [
            empty.amax(&[1], false),
            empty.amin(&[], false),
            empty.argmax(Some(1), false),
            empty.argmin(None, false),
            empty.max_dim(1, false).map(|p| p.0),
            empty.norm(f64::INFINITY, &[1], false),
        ] {
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{dev}: {r:?}");
        }
        let x = Tensor::zeros([3, 4], DType::F32, dev).unwrap();
        assert!(matches!(
            x.sum_dims(&[0, 0], false),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(x.sum_dims(&[2], false), Err(_)));
        assert!(matches!(x.softmax(2), Err(_)));
    }
    // The messages are the CPU's.
    let msg = |dev| {
        Tensor::zeros([3, 0], DType::F32, dev)
            .unwrap()
            .amax(&[1], false)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(msg(gpu), msg(Device::Cpu));
}

/// Softmax and log_softmax of `shape` along every dim, every float dtype and view, forward
/// and backward (through autograd, weighted by fixed values so the backward is not trivial).
fn check_softmax(shape: &[usize]) {
    let rank = shape.len().max(1) as isize;
    for dtype in FLOATS {
        let (rtol, atol) = tolerance(dtype);
        for view in VIEWS {
            for dim in -rank..rank {
                for log in [false, true] {
                    let what = format!("softmax log={log} {dtype:?} {shape:?} dim {dim} {view:?}");
                    let fwd = |x: &Tensor| if log { x.log_softmax(dim) } else { x.softmax(dim) };
                    cpu_vs_cuda(&what, rtol, atol, |dev| fwd(&input(shape, dtype, view, 13, dev)));
                    if shape.contains(&0) {
                        continue;
                    }
                    cpu_vs_cuda(&format!("{what} backward"), rtol * 2.0, atol * 2.0, |dev| {
                        let x = input(shape, dtype, view, 13, dev).detach().requires_grad_(true)?;
                        let n: usize = shape.iter().product();
                        let w = Tensor::from_slice(&common::values(n, 17), shape, Device::Cpu)?
                            .to_dtype(dtype)?
                            .to(dev)?;
                        fwd(&x)?.mul(&w)?.sum_all()?.backward()?;
                        Ok(x.grad().expect("x has a gradient"))
                    });
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn softmax_matches_cpu() {
    common::gpu();
    check_softmax(&[]);
    check_softmax(&[1]);
    check_softmax(&[7]);
    check_softmax(&[3, 5]);
    check_softmax(&[2, 3, 4]);
    check_softmax(&[1, 1]);
    check_softmax(&[0, 4]);
    check_softmax(&[4, 0]);
    check_softmax(&[9, 33]);
    check_softmax(&[5, 1031]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn softmax_on_large_rows_and_columns() {
    common::gpu();
    for (shape, dim) in [
        (&[8usize, 50_257][..], 1isize),
        (&[4096, 1024], 1),
        (&[4096, 1024], 0),
        (&[50_000, 3], 0),
        (&[3, 50_000], 0),
        (&[1 << 20], 0),
        (&[64, 128, 32], 1),
    ] {
        for dtype in FLOATS {
            let (rtol, atol) = tolerance(dtype);
            for view in [View::Contiguous, View::Transposed] {
                for log in [false, true] {
                    let what = format!("softmax log={log} {dtype:?} {shape:?} dim {dim} {view:?}");
                    cpu_vs_cuda(&what, rtol, atol, |dev| {
                        let x = input(shape, dtype, view, 21, dev);
                        if log {
                            x.log_softmax(dim)
                        } else {
                            x.softmax(dim)
                        }
                    });
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn reductions_stay_on_the_gpu_and_keep_dtypes() {
    let gpu = common::gpu();
    for dtype in ALL {
        let x = Tensor::zeros([2, 3], dtype, gpu).unwrap();
        let sum_dtype = if dtype.is_floating_point() {
            dtype
        } else {
            DType::I64
        };
        assert_eq!(x.sum_all().unwrap().dtype(), sum_dtype);
        assert_eq!(x.prod_dims(&[1], false).unwrap().dtype(), sum_dtype);
        assert_eq!(x.amax(&[0], false).unwrap().dtype(), dtype);
        assert_eq!(x.argmax(Some(1), false).unwrap().dtype(), DType::I64);
        let (v, i) = x.min_dim(1, false).unwrap();
        assert_eq!(
            (v.dtype(), i.dtype(), v.device(), i.device()),
            (dtype, DType::I64, gpu, gpu)
        );
    }
}

/// Note [Column sums] in `cuda_backend/reduce.rs`: sums over dim 0 of matrices with
/// contiguous rows, the bias gradients of linear layers, in every float dtype against a float64
/// sum of the same (rounded) values; shapes that take the column kernel (whole 16-byte words,
/// one chunk or many) and shapes that do not (an odd column count, a row start off a word, rows
/// of a wider matrix). The result is the same bits when run twice.
#[test]
#[ignore = "needs a CUDA device"]
fn column_sums_match_float64() {
    let gpu = common::gpu();
    let cases: &[(usize, usize, usize, usize)] = &[
        // (rows, columns, columns of the matrix the rows are taken from, first column)
        (8192, 768, 768, 0),
        (8192, 2304, 2304, 0),
        (64, 3072, 3072, 0),
        (9, 16, 16, 0),
        (1000, 24, 40, 8),
        (1000, 24, 40, 1),
        (333, 13, 13, 0),
    ];
    for &(rows, cols, width, first) in cases {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let base = Tensor::from_slice(
                &host_values(rows * width, 11, DType::F32),
                [rows, width],
                Device::Cpu,
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let x = base.narrow(1, first, cols).unwrap();
            let exact = x.to_dtype(DType::F64).unwrap().sum_dim(0, false).unwrap();
            let on_gpu = x.to(gpu).unwrap();
            let got = on_gpu.sum_dim(0, false).unwrap();
            assert_eq!(got.dtype(), dtype);
            let again = on_gpu.sum_dim(0, false).unwrap();
            let (got, again) = (got.to_vec_f64().unwrap(), again.to_vec_f64().unwrap());
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype:?} [{rows}, {cols}] of {width} from {first}: two runs differ"
            );
            // One rounding of an f32 (or f64) accumulation over `rows` values of magnitude <= 3.
            let (rtol, atol) = match dtype {
                DType::F64 => (1e-12, 1e-12 * rows as f64),
                DType::F32 => (1e-5, 1e-6 * rows as f64),
                DType::F16 => (2f64.powi(-10), 1e-5 * rows as f64),
                _ => (2f64.powi(-7), 1e-5 * rows as f64),
            };
            for (c, (g, e)) in got.iter().zip(exact.to_vec_f64().unwrap()).enumerate() {
                assert!(
                    (g - e).abs() <= atol + rtol * e.abs(),
                    "{dtype:?} [{rows}, {cols}] of {width} from {first}, column {c}: {g} vs {e}"
                );
            }
        }
    }
}
