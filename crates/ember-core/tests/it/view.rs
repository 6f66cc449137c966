//! View ops: aliasing, strides, copies, cat/stack/split, and gradients through views.

use crate::common::{devices, gradcheck, t64, values};
use ember_core::{DType, Device, Error, Tensor};

fn arange(n: usize, shape: &[usize]) -> Tensor {
    Tensor::from_vec((0..n).map(|x| x as f64).collect(), shape, Device::Cpu).unwrap()
}

#[test]
fn views_alias_their_storage() {
    for dev in devices() {
        let x = Tensor::zeros([2, 3], DType::F32, dev).unwrap();
        let v = x.narrow(1, 1, 2).unwrap();
        assert!(v.shares_storage_with(&x));
        assert_eq!(v.storage_offset(), 1);
        v.fill_(5.0).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.0, 5.0, 5.0, 0.0, 5.0, 5.0]);
        let t = x.t().unwrap();
        assert!(t.shares_storage_with(&x));
        assert_eq!(t.stride(), &[1, 3]);
        t.select(0, 0).unwrap().fill_(-1.0).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![-1.0, 5.0, 5.0, -1.0, 5.0, 5.0]);
    }
}

#[test]
fn reshape_views_when_it_can_and_copies_when_it_must() {
    let x = arange(24, &[2, 3, 4]);
    let r = x.reshape(&[6, -1]).unwrap();
    assert!(r.shares_storage_with(&x));
    assert_eq!(r.dims(), &[6, 4]);
    let p = x.permute(&[2, 0, 1]).unwrap();
    assert_eq!(p.dims(), &[4, 2, 3]);
    assert!(!p.is_contiguous());
    let flat = p.reshape(&[-1]).unwrap();
    assert!(
        !flat.shares_storage_with(&x),
        "a permuted tensor cannot be flattened in place"
    );
    assert_eq!(&flat.to_vec::<f64>().unwrap()[..4], &[0.0, 4.0, 8.0, 12.0]);
    let err = p.view(&[-1]).unwrap_err();
    assert!(err.to_string().contains("use reshape() instead"), "{err}");
    assert!(matches!(
        x.reshape(&[5, -1]).unwrap_err(),
        Error::InvalidArgument { op: "reshape", .. }
    ));
    assert_eq!(x.flatten(1, 2).unwrap().dims(), &[2, 12]);
}

#[test]
fn squeeze_unsqueeze_expand_and_slices() {
    let x = arange(6, &[2, 1, 3]);
    assert_eq!(x.squeeze().unwrap().dims(), &[2, 3]);
    assert_eq!(x.squeeze_dim(1).unwrap().dims(), &[2, 3]);
    assert_eq!(x.squeeze_dim(0).unwrap().dims(), &[2, 1, 3]);
    assert_eq!(x.unsqueeze(-1).unwrap().dims(), &[2, 1, 3, 1]);
    let e = x.expand(&[2, 4, 3]).unwrap();
    assert_eq!(e.stride(), &[3, 0, 1]);
    assert_eq!(
        e.select(1, 3).unwrap().to_vec::<f64>().unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    let y = arange(10, &[10]);
    assert_eq!(
        y.slice(0, 1, -1, 3).unwrap().to_vec::<f64>().unwrap(),
        vec![1.0, 4.0, 7.0]
    );
    assert_eq!(
        y.slice(0, -3, 100, 1).unwrap().to_vec::<f64>().unwrap(),
        vec![7.0, 8.0, 9.0]
    );
    assert_eq!(y.select(0, -1).unwrap().item::<f64>().unwrap(), 9.0);
    let err = y.select(0, 10).unwrap_err();
    assert_eq!(
        err.to_string(),
        "index 10 is out of bounds for dimension 0 with size 10 in select"
    );
    let err = x.transpose(0, 3).unwrap_err();
    assert!(matches!(
        err,
        Error::DimOutOfRange {
            dim: 3,
            min: -3,
            max: 2,
            ..
        }
    ));
}

#[test]
fn cat_stack_split_chunk() {
    let a = arange(6, &[2, 3]);
    let b = arange(4, &[2, 2]).add_scalar(100.0).unwrap();
    let c = Tensor::cat(&[a.clone(), b.clone()], 1).unwrap();
    assert_eq!(c.dims(), &[2, 5]);
    assert_eq!(
        c.to_vec::<f64>().unwrap(),
        vec![0.0, 1.0, 2.0, 100.0, 101.0, 3.0, 4.0, 5.0, 102.0, 103.0]
    );
    let err = Tensor::cat(&[a.clone(), b.clone()], 0).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { op: "cat", .. }));
    let s = Tensor::stack(&[a.clone(), a.clone()], 1).unwrap();
    assert_eq!(s.dims(), &[2, 2, 3]);
    let parts = c.split(2, 1).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.dims()[1]).collect::<Vec<_>>(),
        vec![2, 2, 1]
    );
    let chunks = arange(7, &[7]).chunk(3, 0).unwrap();
    assert_eq!(
        chunks.iter().map(|p| p.numel()).collect::<Vec<_>>(),
        vec![3, 3, 1]
    );
    let mixed = Tensor::cat(
        &[a.clone(), Tensor::ones([2, 1], DType::I64, Device::Cpu).unwrap()],
        1,
    )
    .unwrap();
    assert_eq!(mixed.dtype(), DType::F64);
}

#[test]
fn gradients_through_views() {
    let x = t64(&values(24, 7), &[2, 3, 4], Device::Cpu);
    gradcheck(|t| t[0].permute(&[2, 0, 1])?.contiguous(), &[x.clone()]);
    gradcheck(|t| t[0].transpose(0, 2)?.reshape(&[4, -1]), &[x.clone()]);
    gradcheck(|t| t[0].narrow(2, 1, 2), &[x.clone()]);
    gradcheck(|t| t[0].slice(2, 0, 4, 2), &[x.clone()]);
    gradcheck(|t| t[0].select(1, -1), &[x.clone()]);
    gradcheck(|t| t[0].unsqueeze(1)?.squeeze_dim(1), &[x.clone()]);
    gradcheck(|t| t[0].narrow(1, 0, 1)?.expand(&[2, 5, 4]), &[x.clone()]);
    let y = t64(&values(8, 8), &[2, 4], Device::Cpu);
    gradcheck(
        |t| Tensor::cat(&[t[0].clone(), t[1].clone()], 1),
        &[y.clone(), y.clone()],
    );
    gradcheck(
        |t| Tensor::stack(&[t[0].clone(), t[1].mul(&t[1])?], 0),
        &[y.clone(), y.clone()],
    );
    gradcheck(|t| Ok(t[0].chunk(2, 1)?[1].clone()), &[y.clone()]);
}

#[test]
fn reshape_view_and_expand_take_usize_arrays_and_a_minus_one() {
    let x = arange(24, &[2, 3, 4]);
    let (b, t): (usize, usize) = (2, 12);
    // The sizes of creation (`usize`) and `dims()`, with no cast.
    assert_eq!(x.reshape([b, t]).unwrap().dims(), [2, 12]);
    assert_eq!(x.view(x.dims()).unwrap().dims(), [2, 3, 4]);
    // PyTorch's `view(-1, n)` beside a usize: a tuple of mixed integer types.
    assert_eq!(x.view((-1, t)).unwrap().dims(), [2, 12]);
    assert_eq!(x.reshape([-1, 4]).unwrap().dims(), [6, 4]);
    assert_eq!(x.reshape(vec![4usize, 6]).unwrap().dims(), [4, 6]);
    assert_eq!(x.reshape(24usize).unwrap().dims(), [24]);
    // The old slice form still works.
    assert_eq!(x.reshape(&[3isize, -1]).unwrap().dims(), [3, 8]);
    let one = arange(3, &[3, 1]);
    assert_eq!(one.expand([3usize, 5]).unwrap().dims(), [3, 5]);
    assert_eq!(one.expand((-1, 5usize)).unwrap().dims(), [3, 5]);
    // Bad sizes are typed errors, never panics.
    assert!(matches!(x.reshape([-1, -1]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        x.reshape([usize::MAX]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(x.view((5usize, -1)), Err(Error::InvalidArgument { .. })));
}

#[test]
fn split_into_destructures_and_checks_the_count() {
    let x = arange(12, &[2, 6]);
    let [q, k, v] = x.split_into(2, 1).unwrap();
    assert_eq!(
        (q.dims(), k.dims(), v.dims()),
        (&[2usize, 2][..], &[2usize, 2][..], &[2usize, 2][..])
    );
    assert_eq!(v.to_vec::<f64>().unwrap(), [4.0, 5.0, 10.0, 11.0]);
    let [a, b] = x.chunk_into(-1).unwrap();
    assert_eq!(
        (a.dims(), b.to_vec::<f64>().unwrap()),
        (&[2usize, 3][..], vec![3.0, 4.0, 5.0, 9.0, 10.0, 11.0])
    );
    let e = x.split_into::<2>(2, 1).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "split_into", .. }) && e.to_string().contains("3 pieces"),
        "{e}"
    );
}

#[test]
fn slice_scatter_replaces_a_strided_slice() {
    for dev in devices() {
        // The positional encoding's `pe[:, 0::2] = sin`, `pe[:, 1::2] = cos`.
        let pe = Tensor::zeros([2, 4], DType::F32, dev).unwrap();
        let sin = Tensor::ones([2, 2], DType::F32, dev).unwrap();
        let cos = sin.mul_scalar(2.0).unwrap();
        let pe = pe.slice_scatter(&sin, 1, 0, isize::MAX, 2).unwrap();
        let pe = pe.slice_scatter(&cos, 1, 1, isize::MAX, 2).unwrap();
        assert_eq!(
            pe.to_vec::<f32>().unwrap(),
            [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
        );
        // The input is left alone; a src of the wrong shape is a shape error.
        let base = Tensor::zeros([2, 4], DType::F32, dev).unwrap();
        let _ = base.slice_scatter(&sin, 1, 0, isize::MAX, 2).unwrap();
        assert_eq!(base.to_vec::<f32>().unwrap(), [0.0; 8]);
        assert!(matches!(
            base.slice_scatter(&cos.narrow(1, 0, 1).unwrap(), 1, 0, isize::MAX, 2),
            Err(Error::ShapeMismatch {
                op: "slice_scatter",
                ..
            })
        ));
    }
    // Gradients: the input's with the slice zeroed, src's at the slice.
    let x = t64(&values(12, 3), &[3, 4], Device::Cpu);
    let s = t64(&values(6, 4), &[3, 2], Device::Cpu);
    gradcheck(|t| t[0].slice_scatter(&t[1], 1, 1, 4, 2)?.square(), &[x, s]);
}

#[test]
fn integer_arange_is_int64_and_exact() {
    let t = Tensor::arange_i64(0, 5, 1, Device::Cpu).unwrap();
    assert_eq!(
        (t.dtype(), t.to_vec::<i64>().unwrap()),
        (DType::I64, vec![0, 1, 2, 3, 4])
    );
    let big = (1i64 << 60) + 1;
    assert_eq!(
        Tensor::arange_i64(big, big + 3, 1, Device::Cpu)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        [big, big + 1, big + 2]
    );
    assert_eq!(
        Tensor::arange_i64(5, 0, -2, Device::Cpu)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        [5, 3, 1]
    );
    assert!(Tensor::arange_i64(0, 5, 0, Device::Cpu).is_err());
    assert!(Tensor::arange_i64(0, 5, -1, Device::Cpu).is_err());
    assert!(Tensor::arange_i64(i64::MIN, i64::MAX, 1, Device::Cpu).is_err());
}

#[test]
fn tensor_literals_and_from_vec() {
    let x = ember_core::tensor!([[1.0, 2.0], [3.0, 4.0]]);
    assert_eq!(
        (x.dims(), x.dtype(), x.device()),
        (&[2usize, 2][..], DType::F32, Device::Cpu)
    );
    let i = ember_core::tensor![1, 2, 3];
    assert_eq!(
        (i.dtype(), i.to_vec::<i64>().unwrap()),
        (DType::I64, vec![1, 2, 3])
    );
    let v: Tensor = vec![1.0f64, 2.0].into();
    assert_eq!((v.dims(), v.dtype()), (&[2usize][..], DType::F64));
    assert_eq!(Tensor::from(&[1i32, 2][..]).dtype(), DType::I32);
}

/// Note [Gradients of views] in `autograd/engine.rs`: the gradients of views of one tensor are
/// summed as slices and written out once. Each case's gradient is compared with the same
/// function computed with every view's gradient written out by hand (`index_add`-free: a
/// one-hot mask product), on every device, in f32 and bf16.
#[test]
fn gradients_of_several_views_of_one_tensor() {
    for dev in devices() {
        for dtype in [DType::F32, DType::BF16] {
            let base = || {
                Tensor::from_slice(&values(4 * 3 * 12, 7), [4, 3, 12], Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to(dev)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap()
            };
            let w = Tensor::from_slice(&values(4 * 3 * 12, 8), [4, 3, 12], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap();
            // (name, the loss of x, the expected gradient of x: a function of w).
            type Case = (
                &'static str,
                fn(&Tensor, &Tensor) -> ember_core::Result<Tensor>,
                fn(&Tensor) -> Vec<f64>,
            );
            let cases: Vec<Case> = vec![
                // A split whose three pieces all reach the loss: they tile dim 2.
                (
                    "split, all used",
                    |x, w| {
                        let [a, b, c] = x.split_into(4, 2)?;
                        let [wa, wb, wc] = w.split_into(4, 2)?;
                        a.mul(&wa)?
                            .sum_all()?
                            .add(&b.mul(&wb)?.mul_scalar(2.0)?.sum_all()?)?
                            .add(&c.mul(&wc)?.mul_scalar(3.0)?.sum_all()?)
                    },
                    |w| {
                        let w = w.to_vec_f64().unwrap();
                        w.iter()
                            .enumerate()
                            .map(|(i, v)| v * (1 + (i % 12) / 4) as f64)
                            .collect()
                    },
                ),
                // Pieces along dim 0: contiguous pieces and slots (one list copy on a GPU).
                (
                    "split on dim 0",
                    |x, w| {
                        let [a, b] = x.split_into(2, 0)?;
                        let [wa, wb] = w.split_into(2, 0)?;
                        a.mul(&wa)?
                            .sum_all()?
                            .add(&b.mul(&wb)?.mul_scalar(2.0)?.sum_all()?)
                    },
                    |w| {
                        let w = w.to_vec_f64().unwrap();
                        w.iter()
                            .enumerate()
                            .map(|(i, v)| v * (1 + i / 72) as f64)
                            .collect()
                    },
                ),
                // Two of the three pieces: the third's region stays zero.
                (
                    "split, one unused",
                    |x, w| {
                        let [a, _b, c] = x.split_into(4, 2)?;
                        let [wa, _, wc] = w.split_into(4, 2)?;
                        a.mul(&wa)?.sum_all()?.add(&c.mul(&wc)?.sum_all()?)
                    },
                    |w| {
                        let w = w.to_vec_f64().unwrap();
                        w.iter()
                            .enumerate()
                            .map(|(i, v)| if (4..8).contains(&(i % 12)) { 0.0 } else { *v })
                            .collect()
                    },
                ),
                // Overlapping narrows, a select and a strided slice, plus x itself (dense).
                (
                    "overlaps, select, slice and the whole",
                    |x, w| {
                        let n1 = x.narrow(2, 0, 8)?.mul(&w.narrow(2, 0, 8)?)?.sum_all()?;
                        let n2 = x.narrow(2, 4, 8)?.mul(&w.narrow(2, 4, 8)?)?.sum_all()?;
                        let s = x.select(1, 2)?.sum_all()?;
                        let st = x.slice(2, 1, 12, 3)?.sum_all()?;
                        n1.add(&n2)?.add(&s)?.add(&st)?.add(&x.sum_all()?)
                    },
                    |w| {
                        let w = w.to_vec_f64().unwrap();
                        (0..w.len())
                            .map(|i| {
                                let (j, k) = ((i / 12) % 3, i % 12);
                                let mut g = 1.0;
                                if k < 8 {
                                    g += w[i];
                                }
                                if (4..12).contains(&k) {
                                    g += w[i];
                                }
                                if j == 2 {
                                    g += 1.0;
                                }
                                if k % 3 == 1 {
                                    g += 1.0;
                                }
                                g
                            })
                            .collect()
                    },
                ),
            ];
            for (name, loss, expected) in cases {
                let x = base();
                loss(&x, &w).unwrap().backward().unwrap();
                let got = x.grad().unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &[4, 3, 12]);
                // The expected values from w's (rounded) elements, rounded to the dtype once.
                let want = Tensor::from_slice(&expected(&w), [4, 3, 12], Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-6 };
                for (i, (g, e)) in got
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .zip(want.to_vec_f64().unwrap())
                    .enumerate()
                {
                    assert!(
                        (g - e).abs() <= tol * (1.0 + e.abs()),
                        "{name} {dtype} on {dev}: element {i}: {g} vs {e}"
                    );
                }
            }
        }
    }
}

/// The gradient of split pieces reaches hooks and `autograd::grad` as one tensor, and a second
/// backward through a view without `retain_graph` is refused as for any node.
#[test]
fn view_gradients_meet_hooks_grad_and_a_second_pass() {
    let x = Tensor::from_slice(&values(6, 3), [6], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = x.mul_scalar(2.0).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let _hook = y
        .register_hook(move |g| {
            s2.lock().unwrap().push(g.to_vec_f64()?);
            Ok(None)
        })
        .unwrap();
    let [a, b] = y.split_into(3, 0).unwrap();
    let loss = a
        .sum_all()
        .unwrap()
        .add(&b.mul_scalar(3.0).unwrap().sum_all().unwrap())
        .unwrap();
    let g = ember_core::autograd::grad(&[loss.clone()], &[x.clone()], None, true).unwrap();
    assert_eq!(
        g[0].as_ref().unwrap().to_vec_f64().unwrap(),
        vec![2.0, 2.0, 2.0, 6.0, 6.0, 6.0]
    );
    assert_eq!(seen.lock().unwrap()[0], vec![1.0, 1.0, 1.0, 3.0, 3.0, 3.0]);
    loss.backward().unwrap();
    assert!(matches!(loss.backward(), Err(Error::Autograd(_))));
}

/// Note [Gradients of views]: pieces of a split whose gradients come back as views of one
/// buffer, each where its piece lies (fused attention's q, k and v of one projection), give
/// the input that buffer as its gradient, without a copy; pieces in separate buffers are
/// copied into a new one.
#[test]
fn gradients_of_split_pieces_written_in_one_buffer_are_not_copied() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    for dev in devices() {
        for one_buffer in [true, false] {
            let x = Tensor::from_slice(&values(4 * 6, 3), [4, 6], Device::Cpu)
                .unwrap()
                .to(dev)
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            let [a, b] = x.split_into(3, 1).unwrap();
            let made = Arc::new(AtomicUsize::new(0));
            let seen = made.clone();
            // Where the pieces are copied, their buffer is kept, so that the new gradient
            // cannot be given its freed memory.
            let kept = Arc::new(std::sync::Mutex::new(None));
            let keep = kept.clone();
            let y = ember_core::autograd::custom_op("pair", &[&a, &b], a.add(&b).unwrap(), move |_, _| {
                let buf = Tensor::from_slice(&values(4 * 6, 9), [4, 6], Device::Cpu)?.to(dev)?;
                seen.store(buf.data_ptr(), Ordering::SeqCst);
                let [ga, gb] = buf.split_into(3, 1)?;
                if !one_buffer {
                    *keep.lock().unwrap() = Some(buf);
                }
                Ok(if one_buffer {
                    vec![Some(ga), Some(gb)]
                } else {
                    vec![Some(ga.contiguous()?), Some(gb.contiguous()?)]
                })
            });
            y.sum_all().unwrap().backward().unwrap();
            let grad = x.grad().unwrap();
            assert_eq!(
                grad.to_vec_f64().unwrap(),
                values(4 * 6, 9),
                "{dev} one buffer: {one_buffer}"
            );
            assert_eq!(
                grad.data_ptr() == made.load(Ordering::SeqCst),
                one_buffer,
                "{dev}: the gradient is the pieces' buffer exactly when they were written in one"
            );
        }
    }
}
