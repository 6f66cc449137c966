//! CUDA index ops against the CPU: index_select (row fast path and strided path), gather,
//! scatter (last write wins with repeated indices), scatter_value, scatter_add, index_add,
//! embedding and one_hot, for every dtype, int64 and int32 indices, contiguous, transposed,
//! sliced and broadcast inputs, empty and large shapes, and the out-of-range errors.

use crate::common::{self, cpu_vs_cuda, values, ReadBack};
use ember_core::{DType, Device, Error, Tensor};

/// Every dtype ember has.
const ALL: [DType; 8] = crate::common::ALL_DTYPES;

/// `n` deterministic values that every dtype holds exactly (small integers, or 0/1 for bool).
fn data(n: usize, seed: u64, dtype: DType) -> Vec<f64> {
    values(n, seed)
        .iter()
        .map(|v| match dtype {
            DType::Bool => (*v > 0.0) as u8 as f64,
            DType::U8 => ((v + 1.0) * 60.0).floor(),
            // bf16 holds integers exactly only up to 256: keep sums of several below that.
            DType::BF16 => (v * 8.0).floor(),
            _ => (v * 60.0).floor(),
        })
        .collect()
}

/// A tensor of `dtype` with `shape` on `dev`, built on the CPU and moved.
fn tensor(shape: &[usize], seed: u64, dtype: DType, dev: Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_slice(&data(n, seed, dtype), shape, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to(dev)
        .unwrap()
}

/// `n` indices in `0..bound` (repeats included) as `dtype` on `dev`.
fn indices(n: usize, bound: usize, seed: u64, dtype: DType, shape: &[usize], dev: Device) -> Tensor {
    let v: Vec<i64> = values(n, seed)
        .iter()
        .map(|x| (((x + 1.0) / 2.0) * bound as f64) as i64 % bound.max(1) as i64)
        .collect();
    Tensor::from_slice(&v, shape, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to(dev)
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn index_select_matches_cpu() {
    for dtype in ALL {
        for idt in [DType::I64, DType::I32] {
            // (shape, dim, number of indices)
            let cases: [(&[usize], isize, usize); 7] = [
                (&[5, 7], 0, 9),
                (&[5, 7], 1, 3),
                (&[4, 3, 5], 1, 6),
                (&[4, 3, 5], 2, 1),
                (&[1], 0, 4),
                (&[6, 0], 0, 2),
                (&[1000, 257], 0, 1500),
            ];
            for (shape, dim, k) in cases {
                let size = shape[dim as usize];
                let what = format!("index_select {dtype} {idt} {shape:?} dim {dim}");
                cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                    tensor(shape, 1, dtype, d).index_select(dim, &indices(k, size, 2, idt, &[k], d))
                });
                // Transposed input (strided kernel) and a sliced one (non-zero offset).
                cpu_vs_cuda(&format!("{what} transposed"), 0.0, 0.0, |d| {
                    let mut rev = shape.to_vec();
                    rev.reverse();
                    let x = tensor(&rev, 3, dtype, d)
                        .permute(&(0..rev.len() as isize).rev().collect::<Vec<_>>())?;
                    x.index_select(dim, &indices(k, size, 4, idt, &[k], d))
                });
                cpu_vs_cuda(&format!("{what} sliced"), 0.0, 0.0, |d| {
                    let mut big = shape.to_vec();
                    big[0] += 2;
                    let x = tensor(&big, 5, dtype, d).narrow(0, 1, shape[0])?;
                    x.index_select(dim, &indices(k, size, 6, idt, &[k], d))
                });
            }
            // Empty index, 0-d index, strided index.
            cpu_vs_cuda(&format!("index_select {dtype} {idt} empty"), 0.0, 0.0, |d| {
                tensor(&[4, 3], 1, dtype, d).index_select(0, &indices(0, 4, 2, idt, &[0], d))
            });
            cpu_vs_cuda(&format!("index_select {dtype} {idt} 0-d"), 0.0, 0.0, |d| {
                tensor(&[4, 3], 1, dtype, d).index_select(1, &indices(1, 3, 2, idt, &[], d))
            });
            cpu_vs_cuda(
                &format!("index_select {dtype} {idt} strided index"),
                0.0,
                0.0,
                |d| {
                    let i = indices(20, 4, 7, idt, &[10, 2], d).select(1, 1)?;
                    tensor(&[4, 33], 1, dtype, d).index_select(0, &i)
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn embedding_matches_cpu_for_large_tables() {
    // Rows of 1, 3 (odd bytes) and 64 f32: the fast path picks different copy widths.
    for dim in [1usize, 3, 64] {
        cpu_vs_cuda(&format!("embedding dim {dim}"), 0.0, 0.0, |d| {
            let w = tensor(&[5000, dim], 8, DType::F32, d);
            Tensor::embedding(&indices(1 << 14, 5000, 9, DType::I64, &[128, 128], d), &w)
        });
    }
    cpu_vs_cuda("embedding bf16 [1<<20 elements]", 0.0, 0.0, |d| {
        let w = tensor(&[4096, 256], 8, DType::BF16, d);
        Tensor::embedding(&indices(4096, 4096, 10, DType::I32, &[4096], d), &w)
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn gather_matches_cpu() {
    for dtype in ALL {
        for idt in [DType::I64, DType::I32] {
            for (shape, ishape, dim) in [
                (&[5usize, 7][..], &[3usize, 7][..], 0isize),
                (&[5, 7], &[5, 12], 1),
                (&[4, 3, 5], &[2, 3, 4], 2),
                (&[4, 3, 5], &[4, 0, 5], 1),
                (&[300, 1000], &[300, 1000], 1),
            ] {
                let size = shape[dim as usize];
                let k: usize = ishape.iter().product();
                let what = format!("gather {dtype} {idt} {shape:?} {ishape:?} dim {dim}");
                cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                    tensor(shape, 1, dtype, d).gather(dim, &indices(k, size, 2, idt, ishape, d))
                });
                cpu_vs_cuda(&format!("{what} transposed input and index"), 0.0, 0.0, |d| {
                    let r = shape.len() as isize;
                    let x = tensor(shape, 1, dtype, d)
                        .transpose(0, r - 1)?
                        .contiguous()?
                        .transpose(0, r - 1)?;
                    let mut irev = ishape.to_vec();
                    irev.swap(0, ishape.len() - 1);
                    let i = indices(k, size, 3, idt, &irev, d).transpose(0, r - 1)?;
                    x.gather(dim, &i)
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn scatter_keeps_the_last_write_like_the_cpu() {
    for dtype in ALL {
        for idt in [DType::I64, DType::I32] {
            for (shape, ishape, dim) in [
                (&[5usize, 7][..], &[9usize, 7][..], 0isize),
                (&[5, 7], &[5, 20], 1),
                (&[4, 3, 5], &[4, 3, 11], 2),
                (&[64, 1000], &[64, 4000], 1),
                (&[3, 3], &[0, 3], 0),
            ] {
                let size = shape[dim as usize];
                let k: usize = ishape.iter().product();
                let what = format!("scatter {dtype} {idt} {shape:?} {ishape:?} dim {dim}");
                // Many repeated indices: the result depends on which write wins.
                cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                    let src = tensor(ishape, 11, dtype, d);
                    tensor(shape, 1, dtype, d).scatter(dim, &indices(k, size, 2, idt, ishape, d), &src)
                });
                // A larger, sliced source and a transposed self.
                cpu_vs_cuda(&format!("{what} strided"), 0.0, 0.0, |d| {
                    let mut big = ishape.to_vec();
                    big[0] += 3;
                    let src = tensor(&big, 12, dtype, d).narrow(0, 2, ishape[0].max(1).min(big[0] - 2))?;
                    let r = shape.len() as isize;
                    let x = tensor(shape, 1, dtype, d)
                        .transpose(0, r - 1)?
                        .contiguous()?
                        .transpose(0, r - 1)?;
                    x.scatter(dim, &indices(k, size, 3, idt, ishape, d), &src)
                });
                cpu_vs_cuda(&format!("scatter_value {dtype} {idt} {shape:?}"), 0.0, 0.0, |d| {
                    tensor(shape, 1, dtype, d).scatter_value(dim, &indices(k, size, 2, idt, ishape, d), 1.0)
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn scatter_add_and_index_add_match_cpu() {
    for dtype in ALL {
        // Small integers: every order of atomic adds gives the CPU's exact sum (f16 holds
        // integers up to 2048 exactly, bf16 up to 256; keep the sums below).
        let few = matches!(dtype, DType::BF16 | DType::U8 | DType::Bool);
        for idt in [DType::I64, DType::I32] {
            for (shape, ishape, dim) in [
                (&[5usize, 7][..], &[4usize, 7][..], 0isize),
                (&[5, 7], &[5, 3], 1),
                (&[4, 3, 5], &[4, 3, 2], 2),
                (&[257, 300], &[257, if few { 2 } else { 30 }], 1),
            ] {
                let size = shape[dim as usize];
                let k: usize = ishape.iter().product();
                let what = format!("scatter_add {dtype} {idt} {shape:?} {ishape:?} dim {dim}");
                cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                    let src = tensor(ishape, 11, dtype, d);
                    tensor(shape, 1, dtype, d).scatter_add(dim, &indices(k, size, 2, idt, ishape, d), &src)
                });
                // index_add: source has self's shape except `dim`, which has the index's length.
                let mut sshape = shape.to_vec();
                let m = ishape[dim as usize];
                sshape[dim as usize] = m;
                let what = format!("index_add {dtype} {idt} {shape:?} dim {dim} m {m}");
                cpu_vs_cuda(&what, 0.0, 0.0, |d| {
                    let src = tensor(&sshape, 13, dtype, d);
                    tensor(shape, 1, dtype, d).index_add(dim, &indices(m, size, 4, idt, &[m], d), &src)
                });
                cpu_vs_cuda(&format!("{what} transposed source"), 0.0, 0.0, |d| {
                    let r = sshape.len() as isize;
                    let src = tensor(&sshape, 13, dtype, d)
                        .transpose(0, r - 1)?
                        .contiguous()?
                        .transpose(0, r - 1)?;
                    tensor(shape, 1, dtype, d).index_add(dim, &indices(m, size, 4, idt, &[m], d), &src)
                });
            }
        }
    }
    // Arbitrary float values with repeated indices: equal up to the order of the additions.
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (rtol, atol) = common::tolerance(dtype);
        cpu_vs_cuda(
            &format!("index_add {dtype} random values"),
            rtol * 10.0,
            atol * 10.0,
            |d| {
                let x = Tensor::from_slice(&values(1000 * 64, 1), [1000, 64], d)?.to_dtype(dtype)?;
                let src = Tensor::from_slice(&values(5000 * 64, 2), [5000, 64], d)?.to_dtype(dtype)?;
                x.index_add(0, &indices(5000, 1000, 3, DType::I64, &[5000], d), &src)
            },
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_hot_matches_cpu() {
    for idt in [DType::I64, DType::I32] {
        for (shape, classes) in [
            (&[7usize][..], -1i64),
            (&[3, 5][..], 10),
            (&[0][..], 4),
            (&[4096, 8][..], -1),
        ] {
            let n: usize = shape.iter().product();
            cpu_vs_cuda(&format!("one_hot {idt} {shape:?} {classes}"), 0.0, 0.0, |d| {
                indices(n, 9, 5, idt, shape, d).one_hot(classes)
            });
            cpu_vs_cuda(
                &format!("one_hot {idt} {shape:?} {classes} transposed"),
                0.0,
                0.0,
                |d| {
                    let i = indices(n, 9, 5, idt, shape, d);
                    if shape.len() == 2 {
                        i.t()?.one_hot(classes)
                    } else {
                        i.one_hot(classes)
                    }
                },
            );
        }
    }
}

/// Runs `f` on both devices and asserts both fail with the same error: on the GPU an index out
/// of range is found on the device and reported when the result is read back (Note [Deferred
/// device errors]), so the result is read back there.
fn same_error(what: &str, f: impl Fn(Device) -> ember_core::Result<Tensor>) -> Error {
    let gpu = common::gpu();
    let e_cpu = f(Device::Cpu).expect_err(what);
    let e_gpu = f(gpu).read_back().expect_err(what);
    assert_eq!(e_cpu.to_string(), e_gpu.to_string(), "{what}");
    assert_eq!(
        std::mem::discriminant(&e_cpu),
        std::mem::discriminant(&e_gpu),
        "{what}"
    );
    e_gpu
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_range_indices_are_errors_like_the_cpu() {
    let bad = |v: &[i64], shape: &[usize], d: Device| Tensor::from_slice(v, shape, d).unwrap();
    for (idx, what) in [
        (vec![0i64, 2, 5, 1, -1], "too large first"),
        (vec![0, -3, 1, 9, 1], "negative first"),
    ] {
        let e = same_error(&format!("index_select {what}"), |d| {
            tensor(&[5, 3], 1, DType::F32, d).index_select(0, &bad(&idx, &[5], d))
        });
        assert!(matches!(e, Error::IndexOutOfRange { .. }), "{e}");
        same_error(&format!("index_select int32 {what}"), |d| {
            tensor(&[5, 3], 1, DType::F32, d).index_select(1, &bad(&idx, &[5], d).to_dtype(DType::I32)?)
        });
        same_error(&format!("gather {what}"), |d| {
            tensor(&[4, 3], 1, DType::I64, d).gather(0, &bad(&idx[..3], &[1, 3], d))
        });
        same_error(&format!("scatter {what}"), |d| {
            let i = bad(&idx[..3], &[1, 3], d);
            tensor(&[4, 3], 1, DType::F16, d).scatter(0, &i, &tensor(&[1, 3], 2, DType::F16, d))
        });
        same_error(&format!("scatter_add {what}"), |d| {
            let i = bad(&idx[..3], &[1, 3], d);
            tensor(&[4, 3], 1, DType::U8, d).scatter_add(0, &i, &tensor(&[1, 3], 2, DType::U8, d))
        });
        same_error(&format!("index_add {what}"), |d| {
            tensor(&[4, 3], 1, DType::F64, d).index_add(
                0,
                &bad(&idx, &[5], d),
                &tensor(&[5, 3], 2, DType::F64, d),
            )
        });
        same_error(&format!("one_hot {what}"), |d| bad(&idx, &[5], d).one_hot(4));
    }
    // An index into an empty dim, with an empty output.
    same_error("index_select into an empty dim", |d| {
        tensor(&[0, 3], 1, DType::F32, d).index_select(0, &bad(&[0], &[1], d))
    });
    same_error("one_hot with a negative class and num_classes -1", |d| {
        bad(&[2, -1], &[2], d).one_hot(-1)
    });
    same_error("a float index", |d| {
        tensor(&[4, 3], 1, DType::F32, d).index_select(0, &tensor(&[2], 1, DType::F32, d))
    });
}
