//! Tests of indexing by index tensors: index_select, gather, scatter / scatter_value /
//! scatter_add, index_add, embedding and one_hot: values (PyTorch's documented examples),
//! dtypes, errors (never panics) and gradchecks.

use crate::common::{devices, gradcheck, t64, values, ReadBack};
use ember_core::{DType, Device, Error, Tensor};

fn idx(values: &[i64], shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_slice(values, shape, dev).unwrap()
}

/// `0, 1, 2, ...` as f64 with `shape`.
fn iota(shape: &[usize], dev: Device) -> Tensor {
    let n: usize = shape.iter().product();
    t64(&(0..n).map(|i| i as f64).collect::<Vec<_>>(), shape, dev)
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[test]
fn index_select_picks_entries_in_index_order() {
    for dev in devices() {
        let x = iota(&[3, 4], dev);
        let rows = x.index_select(0, &idx(&[2, 0, 2], &[3], dev)).unwrap();
        assert_eq!(rows.dims(), &[3, 4]);
        assert_eq!(
            f64s(&rows),
            vec![8., 9., 10., 11., 0., 1., 2., 3., 8., 9., 10., 11.]
        );
        let cols = x.index_select(-1, &idx(&[3, 1], &[2], dev)).unwrap();
        assert_eq!(f64s(&cols), vec![3., 1., 7., 5., 11., 9.]);
        // Non-contiguous input, int32 index, integer dtype kept.
        let xt = x.t().unwrap().to_dtype(DType::I64).unwrap(); // [4, 3]
        let i32_index = Tensor::from_slice(&[1i32, 3], [2], dev).unwrap();
        let picked = xt.index_select(0, &i32_index).unwrap();
        assert_eq!(picked.dtype(), DType::I64);
        assert_eq!(picked.to_vec::<i64>().unwrap(), vec![1, 5, 9, 3, 7, 11]);
        // A 0-d index selects one entry and keeps the dim; an empty index gives size 0.
        let one = x
            .index_select(1, &Tensor::from_slice(&[2i64], [], dev).unwrap())
            .unwrap();
        assert_eq!(one.dims(), &[3, 1]);
        assert_eq!(f64s(&one), vec![2., 6., 10.]);
        let none = x.index_select(0, &idx(&[], &[0], dev)).unwrap();
        assert_eq!(none.dims(), &[0, 4]);
        // A 0-d input.
        let s = Tensor::scalar(5.0, DType::F32, dev).unwrap();
        let r = s.index_select(0, &idx(&[0], &[1], dev)).unwrap();
        assert_eq!(r.dims(), &[] as &[usize]);
        assert_eq!(r.item::<f32>().unwrap(), 5.0);
    }
}

#[test]
fn large_selects_and_gathers_match_their_definition() {
    for dev in devices() {
        let (r, c) = (300, 257);
        let x = t64(&values(r * c, 9), &[r, c], dev);
        let xv = f64s(&x);
        let picks: Vec<i64> = (0..400).map(|i| (i * 7 % r) as i64).collect();
        let out = x.index_select(0, &idx(&picks, &[400], dev)).unwrap();
        let want: Vec<f64> = picks
            .iter()
            .flat_map(|&p| xv[p as usize * c..(p as usize + 1) * c].to_vec())
            .collect();
        assert_eq!(f64s(&out), want);
        // The same through the strided path (transposed input, dim 1).
        let out_t = x.t().unwrap().index_select(1, &idx(&picks, &[400], dev)).unwrap();
        assert_eq!(f64s(&out_t.t().unwrap()), want);
        // gather along dim 1 with an index narrower than the input.
        let gi: Vec<i64> = (0..r * 200).map(|i| ((i * 13) % c) as i64).collect();
        let g = x.gather(1, &idx(&gi, &[r, 200], dev)).unwrap();
        let want: Vec<f64> = (0..r * 200).map(|i| xv[(i / 200) * c + gi[i] as usize]).collect();
        assert_eq!(f64s(&g), want);
    }
}

#[test]
fn gather_follows_torch_examples() {
    for dev in devices() {
        let t = t64(&[1., 2., 3., 4.], &[2, 2], dev);
        let g = t.gather(1, &idx(&[0, 0, 1, 0], &[2, 2], dev)).unwrap();
        assert_eq!(f64s(&g), vec![1., 1., 4., 3.]);
        let g0 = t
            .gather(0, &idx(&[1, 0, 1], &[1, 3], dev).narrow(1, 0, 2).unwrap())
            .unwrap();
        assert_eq!(g0.dims(), &[1, 2]);
        assert_eq!(f64s(&g0), vec![3., 2.]);
        // The index may be larger than the input along `dim` only.
        let g2 = t.gather(0, &idx(&[1, 1, 0, 0, 1, 0], &[3, 2], dev)).unwrap();
        assert_eq!(f64s(&g2), vec![3., 4., 1., 2., 3., 2.]);
    }
}

#[test]
fn scatter_family_follows_torch_examples() {
    for dev in devices() {
        let src = t64(&(1..=10).map(|i| i as f64).collect::<Vec<_>>(), &[2, 5], dev);
        let zeros = Tensor::zeros([3, 5], DType::F64, dev).unwrap();
        let index = idx(&[0, 1, 2, 0], &[1, 4], dev);
        let s = zeros.scatter(0, &index, &src).unwrap();
        #[rustfmt::skip]
        assert_eq!(f64s(&s), vec![1., 0., 0., 4., 0., 0., 2., 0., 0., 0., 0., 0., 3., 0., 0.]);
        // Out of place: the input is unchanged.
        assert_eq!(f64s(&zeros), vec![0.; 15]);

        let z24 = Tensor::zeros([2, 4], DType::F64, dev).unwrap();
        let v = z24.scatter_value(1, &idx(&[2, 3], &[2, 1], dev), 1.23).unwrap();
        assert_eq!(f64s(&v), vec![0., 0., 1.23, 0., 0., 0., 0., 1.23]);

        let ones = Tensor::ones([2, 5], DType::F64, dev).unwrap();
        let a1 = zeros
            .scatter_add(0, &idx(&[0, 1, 2, 0, 0], &[1, 5], dev), &ones)
            .unwrap();
        #[rustfmt::skip]
        assert_eq!(f64s(&a1), vec![1., 0., 0., 1., 1., 0., 1., 0., 0., 0., 0., 0., 1., 0., 0.]);
        let a2 = zeros
            .scatter_add(0, &idx(&[0, 1, 2, 0, 0, 0, 1, 2, 2, 2], &[2, 5], dev), &ones)
            .unwrap();
        #[rustfmt::skip]
        assert_eq!(f64s(&a2), vec![2., 0., 0., 1., 1., 0., 2., 0., 0., 0., 0., 0., 2., 1., 1.]);
        // Integer dtypes and a non-contiguous self.
        let xi = Tensor::zeros([5, 3], DType::I32, dev).unwrap().t().unwrap(); // [3, 5]
        let si = Tensor::ones([2, 5], DType::I32, dev).unwrap();
        let ai = xi
            .scatter_add(0, &idx(&[0, 1, 2, 0, 0], &[1, 5], dev), &si)
            .unwrap();
        assert_eq!(ai.dtype(), DType::I32);
        assert_eq!(
            ai.to_vec::<i32>().unwrap(),
            vec![1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0]
        );
    }
}

#[test]
fn index_add_accumulates_rows() {
    for dev in devices() {
        let x = Tensor::ones([5, 3], DType::F64, dev).unwrap();
        let t = t64(&[1., 2., 3., 4., 5., 6., 7., 8., 9.], &[3, 3], dev);
        let out = x.index_add(0, &idx(&[0, 4, 2], &[3], dev), &t).unwrap();
        #[rustfmt::skip]
        assert_eq!(f64s(&out), vec![2., 3., 4., 1., 1., 1., 8., 9., 10., 1., 1., 1., 5., 6., 7.]);
        // Repeated indices add up; dim 1 with a transposed source takes the strided path.
        let dup = x.index_add(0, &idx(&[1, 1, 1], &[3], dev), &t).unwrap();
        assert_eq!(f64s(&dup)[3..6], [13., 16., 19.]);
        let cols = x
            .index_add(
                1,
                &idx(&[2, 0], &[2], dev),
                &t64(&values(10, 1), &[2, 5], dev).t().unwrap(),
            )
            .unwrap();
        let v = values(10, 1); // source[r][j] = v[j * 5 + r]
        let got = f64s(&cols);
        for r in 0..5 {
            assert!((got[r * 3] - (1.0 + v[5 + r])).abs() < 1e-15);
            assert_eq!(got[r * 3 + 1], 1.0);
            assert!((got[r * 3 + 2] - (1.0 + v[r])).abs() < 1e-15);
        }
    }
}

#[test]
fn embedding_looks_up_rows() {
    for dev in devices() {
        let w = iota(&[4, 3], dev);
        let e = Tensor::embedding(&idx(&[0, 2, 3, 0], &[2, 2], dev), &w).unwrap();
        assert_eq!(e.dims(), &[2, 2, 3]);
        assert_eq!(f64s(&e), vec![0., 1., 2., 6., 7., 8., 9., 10., 11., 0., 1., 2.]);
        let e0 = Tensor::embedding(&Tensor::from_slice(&[1i32], [], dev).unwrap(), &w).unwrap();
        assert_eq!(e0.dims(), &[3]);
        assert_eq!(f64s(&e0), vec![3., 4., 5.]);
        let err = Tensor::embedding(&idx(&[4], &[1], dev), &w)
            .read_back()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "embedding",
                    index: 4,
                    size: 4,
                    ..
                }
            ),
            "{err}"
        );
        let err = Tensor::embedding(&idx(&[0], &[1], dev), &iota(&[4], dev))
            .read_back()
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { op: "embedding", .. }),
            "{err}"
        );
        let err = Tensor::embedding(&t64(&[0.], &[1], dev), &w)
            .read_back()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnsupportedDType {
                    dtype: DType::F64,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn one_hot_matches_f_one_hot() {
    for dev in devices() {
        let x = idx(&[0, 2, 1], &[3], dev);
        let o = x.one_hot(-1).unwrap();
        assert_eq!(o.dtype(), DType::I64);
        assert_eq!(o.dims(), &[3, 3]);
        assert_eq!(o.to_vec::<i64>().unwrap(), vec![1, 0, 0, 0, 0, 1, 0, 1, 0]);
        let o5 = idx(&[0, 3, 1, 4], &[2, 2], dev).one_hot(5).unwrap();
        assert_eq!(o5.dims(), &[2, 2, 5]);
        assert_eq!(o5.to_vec::<i64>().unwrap()[5..10], [0, 0, 0, 1, 0]);
        let empty = idx(&[], &[0], dev).one_hot(4).unwrap();
        assert_eq!(empty.dims(), &[0, 4]);
        let err = x.one_hot(2).read_back().unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "one_hot",
                    index: 2,
                    size: 2,
                    ..
                }
            ),
            "{err}"
        );
        let err = idx(&[1, -1], &[2], dev).one_hot(3).read_back().unwrap_err();
        assert!(matches!(err, Error::IndexOutOfRange { index: -1, .. }), "{err}");
        assert!(matches!(
            idx(&[], &[0], dev).one_hot(-1).read_back().unwrap_err(),
            Error::InvalidArgument { .. }
        ));
        assert!(matches!(
            x.one_hot(-2).read_back().unwrap_err(),
            Error::InvalidArgument { .. }
        ));
        let err = t64(&[1.], &[1], dev).one_hot(2).read_back().unwrap_err();
        // The hint names both index dtypes one_hot takes (int32 beside PyTorch's int64).
        assert!(
            matches!(err, Error::UnsupportedDType { hint, .. } if hint.contains("int64") && hint.contains("int32")),
            "{err}"
        );
        let i32s = idx(&[0, 2, 1], &[3], dev).to_dtype(DType::I32).unwrap();
        assert_eq!(
            i32s.one_hot(-1).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 0, 0, 0, 0, 1, 0, 1, 0]
        );
    }
}

#[test]
fn bad_indices_are_errors_not_panics() {
    // On CUDA an index out of range is reported when the result is read back (`read_back`).
    for dev in devices() {
        let x = iota(&[3, 4], dev);
        let err = x
            .index_select(0, &idx(&[0, 3], &[2], dev))
            .read_back()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "index_select",
                    index: 3,
                    dim: 0,
                    size: 3
                }
            ),
            "{err}"
        );
        // Negative indices do not wrap (as in PyTorch for these ops).
        let err = x.index_select(1, &idx(&[-1], &[1], dev)).read_back().unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    index: -1,
                    dim: 1,
                    size: 4,
                    ..
                }
            ),
            "{err}"
        );
        let err = x.gather(1, &idx(&[0, 4], &[1, 2], dev)).read_back().unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "gather",
                    index: 4,
                    ..
                }
            ),
            "{err}"
        );
        let err = x
            .scatter_value(0, &idx(&[-1], &[1, 1], dev), 1.0)
            .read_back()
            .unwrap_err();
        assert!(
            matches!(err, Error::IndexOutOfRange { op: "scatter", .. }),
            "{err}"
        );
        let err = x
            .scatter_add(0, &idx(&[3], &[1, 1], dev), &x)
            .read_back()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "scatter_add",
                    ..
                }
            ),
            "{err}"
        );
        let err = x
            .index_add(0, &idx(&[5], &[1], dev), &iota(&[1, 4], dev))
            .read_back()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::IndexOutOfRange {
                    op: "index_add",
                    index: 5,
                    ..
                }
            ),
            "{err}"
        );
        // Index dtype, rank and shape checks.
        let err = x.index_select(0, &t64(&[0.], &[1], dev)).read_back().unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnsupportedDType {
                    op: "index_select",
                    dtype: DType::F64,
                    ..
                }
            ),
            "{err}"
        );
        assert!(matches!(
            x.index_select(0, &idx(&[0, 1], &[1, 2], dev))
                .read_back()
                .unwrap_err(),
            Error::InvalidArgument { .. }
        ));
        assert!(matches!(
            x.index_select(2, &idx(&[0], &[1], dev)).read_back().unwrap_err(),
            Error::DimOutOfRange { .. }
        ));
        assert!(matches!(
            x.gather(0, &idx(&[0], &[1], dev)).read_back().unwrap_err(),
            Error::InvalidArgument { op: "gather", .. }
        ));
        let err = x.gather(0, &idx(&[0; 5], &[1, 5], dev)).read_back().unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { op: "gather", .. }), "{err}");
        let err = x
            .scatter(0, &idx(&[0; 3], &[1, 3], dev), &iota(&[1, 2], dev))
            .read_back()
            .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { op: "scatter", .. }), "{err}");
        let err = x
            .scatter(0, &idx(&[0], &[1, 1], dev), &x.to_dtype(DType::F32).unwrap())
            .read_back()
            .unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { op: "scatter", .. }), "{err}");
        let err = x
            .index_add(0, &idx(&[0, 1], &[2], dev), &iota(&[1, 4], dev))
            .read_back()
            .unwrap_err();
        assert!(
            matches!(err, Error::ShapeMismatch { op: "index_add", .. }),
            "{err}"
        );
    }
}

#[test]
fn gradcheck_reads() {
    for dev in devices() {
        let x = t64(&values(12, 1), &[3, 4], dev);
        let rows = idx(&[2, 0, 2], &[3], dev);
        gradcheck(|t| t[0].index_select(0, &rows), std::slice::from_ref(&x));
        let cols = idx(&[2, 2, 0], &[3], dev);
        gradcheck(|t| t[0].t()?.index_select(1, &cols), std::slice::from_ref(&x));
        let gi = idx(&[0, 0, 3, 1, 2, 2], &[3, 2], dev);
        gradcheck(|t| t[0].gather(1, &gi), std::slice::from_ref(&x));
        let w = t64(&values(15, 2), &[5, 3], dev);
        let tokens = idx(&[4, 0, 4, 2], &[2, 2], dev);
        gradcheck(|t| Tensor::embedding(&tokens, &t[0]), &[w]);
    }
}

#[test]
fn gradcheck_writes() {
    for dev in devices() {
        let x = t64(&values(15, 1), &[3, 5], dev);
        // Unique targets for scatter (its src gradient is ambiguous with repeats, as in PyTorch);
        // src larger than the index gets zero gradient outside it.
        let si = idx(&[0, 1, 2, 0, 2, 0, 1, 1], &[2, 4], dev);
        let src = t64(&values(12, 2), &[2, 6], dev);
        gradcheck(|t| t[0].scatter(0, &si, &t[1]), &[x.clone(), src.clone()]);
        gradcheck(|t| t[0].scatter_value(0, &si, 2.5), std::slice::from_ref(&x));
        let ai = idx(&[0, 0, 2, 0, 2, 2, 0, 1], &[2, 4], dev);
        gradcheck(|t| t[0].scatter_add(0, &ai, &t[1]), &[x.clone(), src]);
        let source = t64(&values(20, 3), &[4, 5], dev);
        let ii = idx(&[2, 0, 2, 1], &[4], dev);
        gradcheck(|t| t[0].index_add(0, &ii, &t[1]), &[x.clone(), source]);
        let source1 = t64(&values(6, 4), &[3, 2], dev);
        gradcheck(
            |t| t[0].index_add(1, &idx(&[4, 4], &[2], dev), &t[1]),
            &[x, source1],
        );
    }
}
