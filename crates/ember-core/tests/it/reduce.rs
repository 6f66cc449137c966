//! Tests of reductions (sum, mean, prod, max/min, amax/amin, argmax/argmin, var/std,
//! logsumexp, norm) and softmax / log_softmax: values, dtypes, errors and gradients.

use crate::common::{self, assert_close, assert_close_slice, devices, gradcheck, t64};
use ember_core::{DType, Device, Error, Tensor};

fn f32s(values: &[f32], shape: &[usize], device: Device) -> Tensor {
    Tensor::from_slice(values, shape, device).unwrap()
}

/// 0..n as f64 values reshaped to `shape`.
fn iota(shape: &[usize], device: Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| i as f64).collect();
    t64(&v, shape, device)
}

/// Reference: sum of `x` (row-major values of `shape`) over `dim`.
fn ref_sum(x: &[f64], shape: &[usize], dim: usize) -> Vec<f64> {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let k = shape[dim];
    let mut out = vec![0.0; outer * inner];
    for o in 0..outer {
        for kk in 0..k {
            for i in 0..inner {
                out[o * inner + i] += x[(o * k + kk) * inner + i];
            }
        }
    }
    out
}

#[test]
fn sum_over_dims_matches_hand_values() {
    for dev in devices() {
        let x = iota(&[2, 3], dev);
        assert_eq!(x.sum_all().unwrap().item_f64().unwrap(), 15.0);
        assert_eq!(x.sum_all().unwrap().dims(), &[] as &[usize]);
        assert_eq!(
            x.sum_dims(&[0], false).unwrap().to_vec_f64().unwrap(),
            vec![3.0, 5.0, 7.0]
        );
        assert_eq!(
            x.sum_dim(-1, false).unwrap().to_vec_f64().unwrap(),
            vec![3.0, 12.0]
        );
        let k = x.sum_dims(&[1], true).unwrap();
        assert_eq!(k.dims(), &[2, 1]);
        // An empty dims list reduces everything, keepdim keeps every dim as 1.
        let all = x.sum_dims(&[], true).unwrap();
        assert_eq!(all.dims(), &[1, 1]);
        assert_eq!(all.to_vec_f64().unwrap(), vec![15.0]);
        assert_eq!(x.sum_dims(&[-1, 0], false).unwrap().item_f64().unwrap(), 15.0);
    }
}

#[test]
fn sum_layouts_agree_with_reference() {
    // Rows (last dim), columns (first dim), and gathered (middle / permuted) paths, large
    // enough to run in parallel.
    for dev in devices() {
        let shape = [37, 64, 29];
        let v = common::values(shape.iter().product(), 3);
        let x = t64(&v, &shape, dev);
        for dim in 0..3 {
            let got = x.sum_dim(dim as isize, false).unwrap().to_vec_f64().unwrap();
            assert_close_slice(&got, &ref_sum(&v, &shape, dim), 1e-12, 1e-12);
        }
        // A permuted (non-contiguous) view.
        let p = x.permute(&[2, 0, 1]).unwrap();
        let pc = p.contiguous().unwrap();
        let pv = pc.to_vec_f64().unwrap();
        for dim in 0..3 {
            let got = p.sum_dim(dim as isize, false).unwrap().to_vec_f64().unwrap();
            assert_close_slice(&got, &ref_sum(&pv, &[29, 37, 64], dim), 1e-12, 1e-12);
        }
        // Two dims at once equals one after the other.
        let two = x.sum_dims(&[0, 2], false).unwrap();
        let seq = x.sum_dim(2, false).unwrap().sum_dim(0, false).unwrap();
        assert_close(&two, &seq, 1e-12, 1e-12);
    }
}

#[test]
fn f32_sums_are_accurate() {
    for dev in devices() {
        // 0.1 four million times: a running f32 sum is off by ~1%, a pairwise one by ~1e-7.
        let n = 4_000_000;
        let x = Tensor::full([n], 0.1, DType::F32, dev).unwrap();
        let s = x.sum_all().unwrap().item_f64().unwrap();
        let exact = n as f64 * 0.1f32 as f64;
        assert!(((s - exact) / exact).abs() < 1e-6, "{s} vs {exact}");
        // Columns: the same over the first dim.
        let c = Tensor::full([n / 4, 4], 0.1, DType::F32, dev).unwrap();
        for s in c.sum_dim(0, false).unwrap().to_vec_f64().unwrap() {
            let exact = exact / 4.0;
            assert!(((s - exact) / exact).abs() < 1e-6, "{s} vs {exact}");
        }
        // Half types accumulate in f32: an f16 running sum of ones stalls at 2048.
        let h = Tensor::ones([4096], DType::F16, dev).unwrap();
        let hs = h.sum_all().unwrap();
        assert_eq!(hs.dtype(), DType::F16);
        assert_eq!(hs.item_f64().unwrap(), 4096.0);
        let b = Tensor::ones([4096], DType::BF16, dev)
            .unwrap()
            .mean_all()
            .unwrap();
        assert_eq!(b.item_f64().unwrap(), 1.0);
    }
}

#[test]
fn integer_and_bool_sums_give_int64() {
    for dev in devices() {
        let x = Tensor::from_slice(&[1i32, 2, 3, 4], [2, 2], dev).unwrap();
        let s = x.sum_dims(&[0], false).unwrap();
        assert_eq!(s.dtype(), DType::I64);
        assert_eq!(s.to_vec::<i64>().unwrap(), vec![4, 6]);
        let b = Tensor::from_slice(&[true, false, true], [3], dev).unwrap();
        let bs = b.sum_all().unwrap();
        assert_eq!(bs.dtype(), DType::I64);
        assert_eq!(bs.item::<i64>().unwrap(), 2);
        let u = Tensor::from_slice(&[200u8, 100], [2], dev).unwrap();
        assert_eq!(u.sum_all().unwrap().item::<i64>().unwrap(), 300);
        let p = x.prod_all().unwrap();
        assert_eq!(p.dtype(), DType::I64);
        assert_eq!(p.item::<i64>().unwrap(), 24);
        assert_eq!(x.prod_dim(1, true).unwrap().to_vec::<i64>().unwrap(), vec![2, 12]);
        // Float dtypes are kept.
        assert_eq!(
            Tensor::ones([3], DType::F32, dev)
                .unwrap()
                .sum_all()
                .unwrap()
                .dtype(),
            DType::F32
        );
    }
}

#[test]
fn mean_values_and_dtype_errors() {
    for dev in devices() {
        let x = iota(&[2, 3], dev);
        assert_eq!(x.mean_all().unwrap().item_f64().unwrap(), 2.5);
        assert_eq!(
            x.mean_dims(&[1], false).unwrap().to_vec_f64().unwrap(),
            vec![1.0, 4.0]
        );
        assert_eq!(x.mean_dims(&[0], true).unwrap().dims(), &[1, 3]);
        let i = Tensor::from_slice(&[1i64, 2], [2], dev).unwrap();
        let err = i.mean_all().unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnsupportedDType {
                    op: "mean",
                    dtype: DType::I64,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("to_dtype"), "{err}");
        assert!(matches!(
            i.var(&[], 1.0, false),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            i.std(&[], 1.0, false),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            i.norm(2.0, &[], false),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            i.softmax(0),
            Err(Error::UnsupportedDType { op: "softmax", .. })
        ));
        assert!(matches!(i.log_softmax(0), Err(Error::UnsupportedDType { .. })));
        // Empty reductions: sum 0, prod 1, mean NaN.
        let e = Tensor::zeros([0, 3], DType::F32, dev).unwrap();
        assert_eq!(
            e.sum_dims(&[0], false).unwrap().to_vec_f64().unwrap(),
            vec![0.0; 3]
        );
        assert_eq!(e.prod_dim(0, false).unwrap().to_vec_f64().unwrap(), vec![1.0; 3]);
        assert!(e.mean_all().unwrap().item_f64().unwrap().is_nan());
        assert_eq!(e.sum_dims(&[1], false).unwrap().dims(), &[0]);
    }
}

#[test]
fn bad_dims_are_reported() {
    for dev in devices() {
        let x = iota(&[2, 3], dev);
        let err = x.sum_dims(&[2], false).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DimOutOfRange {
                    op: "sum",
                    dim: 2,
                    min: -2,
                    max: 1
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "dimension out of range in sum: expected to be in range of [-2, 1], but got 2"
        );
        let err = x.sum_dims(&[1, -1], false).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { op: "sum", .. }), "{err}");
        assert!(err.to_string().contains("dim 1 appears multiple times"), "{err}");
        assert!(matches!(x.max_dim(-3, false), Err(Error::DimOutOfRange { .. })));
        assert!(matches!(
            x.softmax(2),
            Err(Error::DimOutOfRange { op: "softmax", .. })
        ));
        assert!(matches!(
            x.argmax(Some(5), false),
            Err(Error::DimOutOfRange { .. })
        ));
    }
}

#[test]
fn scalars_reduce_over_dim_zero() {
    for dev in devices() {
        let s = Tensor::scalar(4.0, DType::F64, dev).unwrap();
        assert_eq!(s.sum_dims(&[0], false).unwrap().item_f64().unwrap(), 4.0);
        assert_eq!(s.sum_dims(&[-1], true).unwrap().dims(), &[] as &[usize]);
        let (v, i) = s.max_dim(0, false).unwrap();
        assert_eq!((v.item_f64().unwrap(), i.item::<i64>().unwrap()), (4.0, 0));
        assert_eq!(s.softmax(0).unwrap().item_f64().unwrap(), 1.0);
        assert_eq!(s.log_softmax(-1).unwrap().item_f64().unwrap(), 0.0);
        assert_eq!(s.argmax(None, false).unwrap().item::<i64>().unwrap(), 0);
        assert_eq!(s.var(&[], 0.0, false).unwrap().item_f64().unwrap(), 0.0);
    }
}

#[test]
fn max_min_with_indices() {
    for dev in devices() {
        let x = t64(&[1.0, 5.0, 5.0, -2.0, 0.0, -2.0], &[2, 3], dev);
        let (v, i) = x.max_dim(1, false).unwrap();
        assert_eq!(v.to_vec_f64().unwrap(), vec![5.0, 0.0]);
        assert_eq!(i.dtype(), DType::I64);
        assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 1]); // first of the tie
        let (v, i) = x.min_dim(1, true).unwrap();
        assert_eq!(v.dims(), &[2, 1]);
        assert_eq!(v.to_vec_f64().unwrap(), vec![1.0, -2.0]);
        assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 0]);
        let (v, i) = x.max_dim(0, false).unwrap();
        assert_eq!(v.to_vec_f64().unwrap(), vec![1.0, 5.0, 5.0]);
        assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 0, 0]);
        // NaN is the maximum (and the minimum), at its first position.
        let n = f32s(&[1.0, f32::NAN, 3.0, f32::NAN], &[4], dev);
        let (v, i) = n.max_dim(0, false).unwrap();
        assert!(v.item_f64().unwrap().is_nan());
        assert_eq!(i.item::<i64>().unwrap(), 1);
        assert!(n.min_all().unwrap().item_f64().unwrap().is_nan());
        assert!(n.amax(&[], false).unwrap().item_f64().unwrap().is_nan());
        assert_eq!(n.argmax(None, false).unwrap().item::<i64>().unwrap(), 1);
        assert_eq!(n.argmin(Some(0), false).unwrap().item::<i64>().unwrap(), 1);
        // Integer dtypes are kept.
        let q = Tensor::from_slice(&[3i32, -7, 9, 9], [2, 2], dev).unwrap();
        let m = q.max_all().unwrap();
        assert_eq!((m.dtype(), m.item::<i32>().unwrap()), (DType::I32, 9));
        assert_eq!(q.min_all().unwrap().item::<i32>().unwrap(), -7);
        let (v, i) = q.max_dim(1, false).unwrap();
        assert_eq!(v.to_vec::<i32>().unwrap(), vec![3, 9]);
        assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 0]);
        let b = Tensor::from_slice(&[false, true, true], [3], dev).unwrap();
        assert!(b.max_all().unwrap().item::<bool>().unwrap());
        assert_eq!(b.argmax(None, false).unwrap().item::<i64>().unwrap(), 1);
    }
}

#[test]
fn amax_amin_over_several_dims() {
    for dev in devices() {
        let x = iota(&[2, 3, 4], dev)
            .sub_scalar(7.0)
            .unwrap()
            .mul(&iota(&[2, 3, 4], dev))
            .unwrap();
        // x = i (i - 7): values 0, -6, -10, -12, -12, -10, -6, 0, 8, ...
        let a = x.amax(&[0, 2], false).unwrap();
        let b = x.amin(&[0, 2], true).unwrap();
        assert_eq!(b.dims(), &[1, 3, 1]);
        let v = x.to_vec_f64().unwrap();
        for j in 0..3 {
            let group: Vec<f64> = (0..2)
                .flat_map(|i| (0..4).map(move |k| (i, k)))
                .map(|(i, k)| v[i * 12 + j * 4 + k])
                .collect();
            let mx = group.iter().cloned().fold(f64::MIN, f64::max);
            let mn = group.iter().cloned().fold(f64::MAX, f64::min);
            assert_eq!(a.to_vec_f64().unwrap()[j], mx);
            assert_eq!(b.to_vec_f64().unwrap()[j], mn);
        }
    }
}

#[test]
fn max_on_empty_is_an_error() {
    for dev in devices() {
        let e = Tensor::zeros([2, 0], DType::F32, dev).unwrap();
        assert!(matches!(
            e.max_all(),
            Err(Error::InvalidArgument { op: "max", .. })
        ));
        assert!(matches!(e.max_dim(1, false), Err(Error::InvalidArgument { .. })));
        assert!(matches!(
            e.argmin(None, false),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            e.norm(f64::INFINITY, &[], false),
            Err(Error::InvalidArgument { .. })
        ));
        // Reducing a non-empty dim of an empty tensor is fine.
        assert_eq!(e.amax(&[0], false).unwrap().dims(), &[0]);
        assert_eq!(e.norm(2.0, &[], false).unwrap().item_f64().unwrap(), 0.0);
    }
}

#[test]
fn argmax_over_flattened_and_dims() {
    for dev in devices() {
        let x = t64(&[0.0, 9.0, 2.0, 9.0, -1.0, 4.0], &[2, 3], dev);
        let a = x.argmax(None, false).unwrap();
        assert_eq!((a.dtype(), a.dims().len()), (DType::I64, 0));
        assert_eq!(a.item::<i64>().unwrap(), 1);
        assert_eq!(x.argmax(None, true).unwrap().dims(), &[1, 1]);
        assert_eq!(x.argmin(None, false).unwrap().item::<i64>().unwrap(), 4);
        assert_eq!(
            x.argmax(Some(0), false).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 0, 1]
        );
        assert_eq!(
            x.argmin(Some(-1), true).unwrap().to_vec::<i64>().unwrap(),
            vec![0, 1]
        );
        // Non-contiguous input.
        let t = x.t().unwrap();
        assert_eq!(
            t.argmax(Some(1), false).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 0, 1]
        );
        // A long row splits across threads and still finds the first maximum.
        let mut v = common::values(100_000, 5);
        v[70_000] = 2.0;
        v[90_000] = 2.0;
        let l = t64(&v, &[100_000], dev);
        assert_eq!(l.argmax(None, false).unwrap().item::<i64>().unwrap(), 70_000);
    }
}

#[test]
fn var_and_std_values() {
    for dev in devices() {
        let x = t64(&[1.0, 2.0, 3.0, 4.0], &[4], dev);
        assert_close(
            &x.var(&[], 1.0, false).unwrap(),
            &t64(&[5.0 / 3.0], &[], dev),
            1e-14,
            0.0,
        );
        assert_close(
            &x.var(&[0], 0.0, false).unwrap(),
            &t64(&[1.25], &[], dev),
            1e-14,
            0.0,
        );
        assert_close(
            &x.std(&[], 1.0, true).unwrap(),
            &t64(&[(5.0f64 / 3.0).sqrt()], &[1], dev),
            1e-14,
            0.0,
        );
        let m = t64(&[1.0, 3.0, 10.0, 10.0, 2.0, 6.0], &[3, 2], dev);
        assert_close(
            &m.var(&[1], 1.0, false).unwrap(),
            &t64(&[2.0, 0.0, 8.0], &[3], dev),
            1e-14,
            0.0,
        );
        // One element with Bessel's correction divides by zero: NaN, as PyTorch.
        assert!(t64(&[3.0], &[1], dev)
            .var(&[], 1.0, false)
            .unwrap()
            .item_f64()
            .unwrap()
            .is_nan());
        // Large offsets do not cancel catastrophically (two passes).
        let big = f32s(&[1e6 + 1.0, 1e6 + 2.0, 1e6 + 3.0], &[3], dev);
        assert_eq!(big.var(&[], 1.0, false).unwrap().item_f64().unwrap(), 1.0);
    }
}

#[test]
fn logsumexp_is_stable() {
    for dev in devices() {
        let x = t64(&[1000.0, 1000.0, -1000.0, 0.0], &[2, 2], dev);
        let l = x.logsumexp(&[1], false).unwrap();
        assert_close(&l, &t64(&[1000.0 + 2f64.ln(), 0.0], &[2], dev), 1e-15, 1e-15);
        let s = t64(&[1.0, 2.0, 3.0], &[3], dev).logsumexp(&[], false).unwrap();
        let exact = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((s.item_f64().unwrap() - exact).abs() < 1e-14);
        let ninf = t64(&[f64::NEG_INFINITY; 2], &[2], dev)
            .logsumexp(&[], false)
            .unwrap();
        assert_eq!(ninf.item_f64().unwrap(), f64::NEG_INFINITY);
        let inf = t64(&[f64::INFINITY, 1.0], &[2], dev)
            .logsumexp(&[], false)
            .unwrap();
        assert_eq!(inf.item_f64().unwrap(), f64::INFINITY);
        // Integers compute in float32.
        let i = Tensor::from_slice(&[0i64, 0], [2], dev)
            .unwrap()
            .logsumexp(&[0], false)
            .unwrap();
        assert_eq!(i.dtype(), DType::F32);
        assert!((i.item_f64().unwrap() - 2f64.ln()).abs() < 1e-7);
        // Several dims.
        let y = iota(&[2, 3, 2], dev).logsumexp(&[0, 2], true).unwrap();
        assert_eq!(y.dims(), &[1, 3, 1]);
        let v: Vec<f64> = [0.0, 1.0, 6.0, 7.0].iter().map(|&a: &f64| a.exp()).collect();
        assert!((y.to_vec_f64().unwrap()[0] - v.iter().sum::<f64>().ln()).abs() < 1e-13);
    }
}

#[test]
fn norms_of_every_order() {
    for dev in devices() {
        let x = t64(&[3.0, -4.0, 0.0, 12.0], &[2, 2], dev);
        let n = |p: f64| x.norm(p, &[], false).unwrap().item_f64().unwrap();
        assert_eq!(n(2.0), 13.0);
        assert_eq!(n(1.0), 19.0);
        assert_eq!(n(f64::INFINITY), 12.0);
        assert_eq!(n(f64::NEG_INFINITY), 0.0);
        assert_eq!(n(0.0), 3.0);
        assert!((n(3.0) - (27.0f64 + 64.0 + 1728.0).powf(1.0 / 3.0)).abs() < 1e-12);
        let rows = x.norm(2.0, &[1], true).unwrap();
        assert_eq!(rows.dims(), &[2, 1]);
        assert_eq!(rows.to_vec_f64().unwrap(), vec![5.0, 12.0]);
        let h = Tensor::from_slice(&[3.0f32, 4.0], [2], dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let hn = h.norm(2.0, &[], false).unwrap();
        assert_eq!((hn.dtype(), hn.item_f64().unwrap()), (DType::BF16, 5.0));
        assert!(matches!(
            x.norm(f64::NAN, &[], false),
            Err(Error::InvalidArgument { .. })
        ));
    }
}

/// Reference softmax / log_softmax over the last dim, in f64.
fn ref_log_softmax(v: &[f64], k: usize) -> Vec<f64> {
    v.chunks(k)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f64::MIN, f64::max);
            let s: f64 = r.iter().map(|x| (x - m).exp()).sum();
            r.iter().map(move |x| x - m - s.ln()).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn softmax_values_and_stability() {
    for dev in devices() {
        let x = t64(&[1.0, 2.0, 3.0, 1000.0, 1000.0, -1000.0], &[2, 3], dev);
        let s = x.softmax(-1).unwrap();
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|a| (a - 3.0).exp()).collect();
        let z: f64 = e.iter().sum();
        let expect = vec![e[0] / z, e[1] / z, e[2] / z, 0.5, 0.5, 0.0];
        assert_close_slice(&s.to_vec_f64().unwrap(), &expect, 1e-14, 1e-300);
        let ls = x.log_softmax(1).unwrap().to_vec_f64().unwrap();
        assert_close_slice(&ls, &ref_log_softmax(&x.to_vec_f64().unwrap(), 3), 1e-14, 1e-14);
        assert_eq!(ls[5], -2000.0 - 2f64.ln());
        // Softmax over dim 0 sums to one down each column.
        let c = x.softmax(0).unwrap().sum_dim(0, false).unwrap();
        assert_close(&c, &t64(&[1.0; 3], &[3], dev), 1e-15, 1e-15);
        // An all -inf row gives NaN, as PyTorch.
        let ninf = t64(&[f64::NEG_INFINITY; 2], &[2], dev).softmax(0).unwrap();
        assert!(ninf.to_vec_f64().unwrap().iter().all(|v| v.is_nan()));
    }
}

#[test]
fn log_softmax_of_wide_inputs_is_exact_in_f32() {
    for dev in devices() {
        // Like 100 * randn: a naive log(softmax) gives -inf and exp overflows.
        let (rows, k) = (300, 1000);
        let v: Vec<f32> = common::values(rows * k, 11)
            .iter()
            .map(|x| (x * 300.0) as f32)
            .collect();
        let x = f32s(&v, &[rows, k], dev);
        let got = x.log_softmax(-1).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let got = got.to_vec_f64().unwrap();
        let v64: Vec<f64> = v.iter().map(|&a| a as f64).collect();
        let want = ref_log_softmax(&v64, k);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(a.is_finite(), "element {i} is {a}");
            assert!(
                (a - b).abs() <= 4.0 * f32::EPSILON as f64 * b.abs().max(1.0),
                "element {i}: {a} vs {b}"
            );
        }
        let s = x.softmax(-1).unwrap().sum_dim(-1, false).unwrap();
        assert_close(&s, &Tensor::ones([rows], DType::F32, dev).unwrap(), 1e-5, 0.0);
    }
}

#[test]
fn softmax_over_every_dim_and_layout() {
    for dev in devices() {
        let shape = [4, 5, 300];
        let v = common::values(shape.iter().product(), 21);
        let v: Vec<f64> = v.iter().map(|x| x * 20.0).collect();
        let x = t64(&v, &shape, dev);
        for dim in 0..3isize {
            // Reference: move the dim last, softmax rows, move it back.
            let moved = x.transpose(dim, 2).unwrap().contiguous().unwrap();
            let k = moved.dims()[2];
            let want = ref_log_softmax(&moved.to_vec_f64().unwrap(), k);
            let want = t64(&want, moved.dims(), dev).transpose(dim, 2).unwrap();
            assert_close(
                &x.log_softmax(dim).unwrap(),
                &want.contiguous().unwrap(),
                1e-12,
                1e-12,
            );
            // Non-contiguous input: the same dim of a permuted view.
            let p = x.permute(&[2, 0, 1]).unwrap();
            let pd = (dim + 1) % 3;
            let got = p.softmax(pd).unwrap();
            let want = p.contiguous().unwrap().softmax(pd).unwrap();
            assert_close(&got, &want, 1e-15, 1e-15);
        }
        let h = x.to_dtype(DType::F16).unwrap().softmax(1).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        let want = x
            .to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .softmax(1)
            .unwrap();
        assert_close(&h, &want, 1e-3, 1e-4);
    }
}

#[test]
fn prod_gradient_with_zeros() {
    for dev in devices() {
        // One zero: only it gets a gradient, the product of the others.
        let x = t64(&[2.0, 0.0, 3.0, 4.0], &[4], dev)
            .requires_grad_(true)
            .unwrap();
        x.prod_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 24.0, 0.0, 0.0]);
        // Two zeros: every gradient is zero.
        let y = t64(&[2.0, 0.0, 0.0, 4.0], &[2, 2], dev)
            .requires_grad_(true)
            .unwrap();
        y.prod_dim(0, false)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        // Columns [2, 0] and [0, 4]: each zero gets the other element.
        assert_eq!(y.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 4.0, 2.0, 0.0]);
        let z = t64(&[2.0, 0.0, 0.0, 4.0], &[4], dev)
            .requires_grad_(true)
            .unwrap();
        z.prod_all().unwrap().backward().unwrap();
        assert_eq!(z.grad().unwrap().to_vec_f64().unwrap(), vec![0.0; 4]);
    }
}

#[test]
fn extreme_gradients_follow_pytorch() {
    for dev in devices() {
        // max_dim: only the returned (first) index.
        let x = t64(&[1.0, 3.0, 3.0, 0.0], &[4], dev)
            .requires_grad_(true)
            .unwrap();
        x.max_dim(0, false).unwrap().0.backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 1.0, 0.0, 0.0]);
        // amax / max_all: split evenly among ties.
        let y = t64(&[1.0, 3.0, 3.0, 0.0], &[4], dev)
            .requires_grad_(true)
            .unwrap();
        y.amax(&[0], false).unwrap().backward().unwrap();
        assert_eq!(y.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 0.5, 0.5, 0.0]);
        let z = t64(&[0.0, 0.0, 2.0, 5.0], &[4], dev)
            .requires_grad_(true)
            .unwrap();
        z.min_all().unwrap().backward().unwrap();
        assert_eq!(z.grad().unwrap().to_vec_f64().unwrap(), vec![0.5, 0.5, 0.0, 0.0]);
        // norm: zero gradient at zero norm; inf norm ties split with the sign.
        let w = t64(&[0.0, 0.0], &[2], dev).requires_grad_(true).unwrap();
        w.norm(2.0, &[], false).unwrap().backward().unwrap();
        assert_eq!(w.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 0.0]);
        let u = t64(&[-2.0, 1.0, 2.0], &[3], dev).requires_grad_(true).unwrap();
        u.norm(f64::INFINITY, &[], false).unwrap().backward().unwrap();
        assert_eq!(u.grad().unwrap().to_vec_f64().unwrap(), vec![-0.5, 0.0, 0.5]);
        // Integer outputs record nothing.
        let i = Tensor::from_slice(&[1i64, 2], [2], dev).unwrap();
        assert!(i.sum_all().unwrap().grad_fn_name().is_none());
    }
}

// ---- gradient checks (f64, finite differences) ----

fn input(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    t64(&common::values(n, seed), shape, Device::Cpu)
}

/// Values with distinct magnitudes, away from zero (no ties for max/min/norm-inf).
fn distinct(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut v: Vec<f64> = (0..n).map(|i| 0.5 + i as f64 * 0.37).collect();
    let r = common::values(n, seed);
    // Shuffle deterministically by sorting on the random keys, and give random signs.
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| r[a].partial_cmp(&r[b]).unwrap());
    v = idx.iter().map(|&i| v[i]).collect();
    for (i, x) in v.iter_mut().enumerate() {
        if r[(i * 7) % n] < 0.0 {
            *x = -*x;
        }
    }
    t64(&v, shape, Device::Cpu)
}

#[test]
fn gradcheck_sum_mean() {
    let x = input(&[3, 4, 2], 1);
    gradcheck(|t| t[0].sum_dims(&[0, 2], false), &[x.clone()]);
    gradcheck(|t| t[0].sum_dims(&[1], true), &[x.clone()]);
    gradcheck(|t| t[0].sum_all(), &[x.clone()]);
    gradcheck(|t| t[0].mean_dims(&[-1], false), &[x.clone()]);
    gradcheck(|t| t[0].mean_dims(&[], true), &[x.clone()]);
    gradcheck(|t| t[0].t().unwrap().mean_all(), &[input(&[3, 5], 2)]);
}

#[test]
fn gradcheck_prod() {
    gradcheck(|t| t[0].prod_dim(1, false), &[input(&[3, 4], 3)]);
    gradcheck(|t| t[0].prod_dims(&[0, 2], true), &[input(&[2, 3, 2], 4)]);
    // A single zero per group (prod is linear in each element, so differences are exact).
    let z = t64(&[0.5, 0.0, -2.0, 1.5, 3.0, 0.0], &[2, 3], Device::Cpu);
    gradcheck(|t| t[0].prod_dim(1, false), &[z.clone()]);
    gradcheck(|t| t[0].prod_all(), &[t64(&[0.5, 0.0, -2.0], &[3], Device::Cpu)]);
}

#[test]
fn gradcheck_max_min() {
    let x = distinct(&[3, 4, 5], 5);
    gradcheck(|t| Ok(t[0].max_dim(1, false)?.0), &[x.clone()]);
    gradcheck(|t| Ok(t[0].min_dim(-1, true)?.0), &[x.clone()]);
    gradcheck(|t| t[0].amax(&[0, 2], false), &[x.clone()]);
    gradcheck(|t| t[0].amin(&[1], true), &[x.clone()]);
    gradcheck(|t| t[0].max_all(), &[x.clone()]);
    gradcheck(|t| t[0].min_all(), &[x.clone()]);
}

#[test]
fn gradcheck_var_std() {
    let x = input(&[4, 3, 2], 6);
    gradcheck(|t| t[0].var(&[1], 1.0, false), &[x.clone()]);
    gradcheck(|t| t[0].var(&[0, 2], 0.0, true), &[x.clone()]);
    gradcheck(|t| t[0].std(&[], 1.0, false), &[x.clone()]);
    gradcheck(|t| t[0].std(&[-1], 0.5, true), &[x.clone()]);
}

#[test]
fn gradcheck_logsumexp() {
    let x = input(&[3, 4, 2], 7).mul_scalar(5.0).unwrap();
    gradcheck(|t| t[0].logsumexp(&[1], false), &[x.clone()]);
    gradcheck(|t| t[0].logsumexp(&[0, 2], true), &[x.clone()]);
    gradcheck(|t| t[0].logsumexp(&[], false), &[x.clone()]);
}

#[test]
fn gradcheck_norm() {
    let x = input(&[3, 4], 8);
    for p in [2.0, 1.0, 3.0, 1.5, 0.5, -1.0] {
        gradcheck(|t| t[0].norm(p, &[1], false), &[x.clone()]);
        gradcheck(|t| t[0].norm(p, &[], true), &[x.clone()]);
    }
    let d = distinct(&[3, 4], 9);
    gradcheck(|t| t[0].norm(f64::INFINITY, &[0], false), &[d.clone()]);
    gradcheck(|t| t[0].norm(f64::NEG_INFINITY, &[], false), &[d.clone()]);
}

#[test]
fn gradcheck_softmax() {
    let x = input(&[3, 4, 5], 10).mul_scalar(3.0).unwrap();
    for dim in [0isize, 1, -1] {
        gradcheck(|t| t[0].softmax(dim), &[x.clone()]);
        gradcheck(|t| t[0].log_softmax(dim), &[x.clone()]);
    }
    // Non-contiguous input, and a gradient that arrives expanded (through sum).
    gradcheck(|t| t[0].permute(&[2, 0, 1])?.log_softmax(1), &[x.clone()]);
    gradcheck(|t| t[0].log_softmax(-1)?.sum_dim(0, false), &[x.clone()]);
    gradcheck(|t| t[0].softmax(1)?.mean_dims(&[0, 2], false), &[x.clone()]);
}
