//! Issue 14's findings as tests: 0-d tensors, sizes that overflow, host out of memory and edge
//! values each give a typed error (or PyTorch's result), never a panic, an abort or a hang.

use ember_core::backend::PoolMode;
use ember_core::ops::conv::convolution;
use ember_core::ops::pool::pool2d;
use ember_core::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn scalar() -> Tensor {
    Tensor::scalar(3.0, DType::F32, CPU).unwrap()
}

/// `r` is `Error::InvalidArgument` whose message contains `needle`.
#[track_caller]
fn invalid<T: std::fmt::Debug>(r: ember_core::Result<T>, needle: &str) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains(needle), "{e}")
        }
        other => panic!("expected InvalidArgument containing {needle:?}, got {other:?}"),
    }
}

/// `r` is a host `Error::OutOfMemory` of at least `bytes`.
#[track_caller]
fn host_oom<T: std::fmt::Debug>(r: ember_core::Result<T>, bytes: usize) {
    match r {
        Err(e @ Error::OutOfMemory { .. }) => {
            let Error::OutOfMemory {
                device, requested, ..
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(*device, CPU);
            assert!(*requested >= bytes, "requested {requested} < {bytes}");
            let msg = e.to_string();
            assert!(
                msg.contains("CPU out of memory")
                    && msg.contains("smaller batch")
                    && msg.contains("checkpoint"),
                "{msg}"
            );
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// 0-d tensors, as PyTorch.

#[test]
fn scalar_dims_are_refused_where_pytorch_refuses_them() {
    let s = scalar();
    for dim in [-1, 0] {
        invalid(s.size(dim), "tensor has no dimensions");
        invalid(s.split(1, dim), "split expects at least a 1-dimensional tensor");
        invalid(s.chunk(1, dim), "chunk expects at least a 1-dimensional tensor");
        invalid(s.unbind(dim), "unbind expects at least a 1-dimensional tensor");
    }
    invalid(s.split_with_sizes(&[], 0), "at least a 1-dimensional tensor");
    assert!(s.dims().is_empty());
}

#[test]
fn scalar_flatten_takes_dims_minus_one_and_zero_only() {
    let s = scalar();
    for (a, b) in [(0, 0), (-1, -1), (0, -1), (-1, 0)] {
        let f = s.flatten(a, b).unwrap();
        assert_eq!(f.dims(), &[1]);
        assert_eq!(f.to_vec::<f32>().unwrap(), vec![3.0]);
    }
    for (a, b) in [(1, 1), (0, 5), (-2, 0), (3, 7)] {
        assert!(
            matches!(s.flatten(a, b), Err(Error::DimOutOfRange { op: "flatten", .. })),
            "flatten({a}, {b})"
        );
    }
}

#[test]
fn scalar_dims_are_allowed_where_pytorch_allows_them() {
    let s = scalar();
    assert_eq!(s.sum_dim(-1, false).unwrap().item_f64().unwrap(), 3.0);
    assert_eq!(s.unsqueeze(0).unwrap().dims(), &[1]);
    assert_eq!(s.squeeze_dim(-1).unwrap().dims(), &[] as &[usize]);
    assert_eq!(s.softmax(0).unwrap().item_f64().unwrap(), 1.0);
}

// ---------------------------------------------------------------------------------------------
// Sizes that overflow (Note [Checked sizes]).

#[test]
fn shapes_whose_product_overflows_are_invalid() {
    invalid(
        Tensor::from_vec(Vec::<f32>::new(), [1 << 32, 1 << 32], CPU),
        "[4294967296, 4294967296]",
    );
    invalid(
        Tensor::randn([1_000_000, 1 << 62], DType::F32, CPU),
        "memory can address",
    );
    invalid(
        Tensor::rand([usize::MAX, 4], DType::F32, CPU),
        "memory can address",
    );
    invalid(
        Tensor::zeros([0, 1 << 40, 1 << 40], DType::F32, CPU),
        "memory can address",
    );
    invalid(Tensor::eye(1 << 48, DType::F32, CPU), "memory can address");
    invalid(Tensor::eye(usize::MAX, DType::F32, CPU), "memory can address");
    invalid(Tensor::randperm(usize::MAX, CPU), "memory can address");
}

#[test]
fn ranges_with_too_many_elements_are_invalid() {
    invalid(
        Tensor::linspace(0.0, 1.0, isize::MAX as usize, DType::F32, CPU),
        "more than memory can address",
    );
    invalid(Tensor::arange(0.0, 5.0, 5e-324, DType::F32, CPU), "elements");
    invalid(Tensor::arange(0.0, 1e300, 1e-300, DType::F64, CPU), "elements");
}

#[test]
fn broadcasts_and_views_that_overflow_are_invalid() {
    let a = Tensor::zeros([1 << 40, 1], DType::F32, CPU).unwrap_or_else(|_| {
        // A [2^40, 1] tensor is 4 TiB: use an expanded view instead.
        Tensor::zeros([1, 1], DType::F32, CPU)
            .unwrap()
            .expand(&[1isize << 40, 1])
            .unwrap()
    });
    let b = Tensor::zeros([1, 1], DType::F32, CPU)
        .unwrap()
        .expand(&[1, 1isize << 40])
        .unwrap();
    invalid(a.add(&b), "memory can address");
    let one = Tensor::zeros([1], DType::F32, CPU).unwrap();
    invalid(one.expand(&[1isize << 40, 1 << 40]), "memory can address");
    invalid(one.reshape(&[1isize << 40, 1 << 40, 0]), "memory can address");
    let big = one.expand(&[1isize << 61]).unwrap();
    invalid(Tensor::cat(&[&big, &big, &big, &big], 0), "cat");
}

#[test]
fn one_hot_of_a_huge_index_is_an_error() {
    let idx = Tensor::from_vec(vec![i64::MAX], [1], CPU).unwrap();
    invalid(idx.one_hot(-1), "overflows");
    // An index cast from +inf, as in the issue.
    let from_inf = Tensor::from_vec(vec![f32::INFINITY], [1], CPU)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    assert!(from_inf.one_hot(-1).is_err());
    // A huge class count is refused or out of memory, never an abort.
    let small = Tensor::from_vec(vec![0i64, 1], [2], CPU).unwrap();
    assert!(small.one_hot(i64::MAX).is_err());
}

#[test]
fn convolution_with_huge_padding_is_invalid_not_a_hang() {
    let x = Tensor::zeros([1, 1, 4, 4], DType::F32, CPU).unwrap();
    let w = Tensor::zeros([1, 1, 3, 3], DType::F32, CPU).unwrap();
    for pad in [1_000_000_000_000_000usize, 1 << 62, usize::MAX / 2 + 1] {
        let r = convolution(&x, &w, None, &[1, 1], &[pad, pad], &[1, 1], 1);
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "padding {pad}: {r:?}"
        );
    }
    let r = convolution(&x, &w, None, &[1, 1], &[1, 1], &[usize::MAX, 1], 1);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = pool2d(&x, PoolMode::Max, [2, 2], [1, 1], [1 << 62, 1 << 62]);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = pool2d(&x, PoolMode::Max, [2, 2], [1, 1], [1, 1]);
    assert_eq!(r.unwrap().dims(), &[1, 1, 5, 5]);
}

// ---------------------------------------------------------------------------------------------
// Host out of memory is an error, and the process goes on (Note [Fallible host allocation]).

#[test]
fn host_requests_the_machine_cannot_hold_are_out_of_memory() {
    host_oom(Tensor::rand([1 << 40, 3], DType::F32, CPU), 12 << 40);
    host_oom(Tensor::linspace(0.0, 1.0, 1 << 40, DType::F32, CPU), 4 << 40);
    host_oom(
        Tensor::arange(0.0, (1u64 << 48) as f64, 1.0, DType::F32, CPU),
        1 << 50,
    );
    host_oom(Tensor::zeros([1 << 45], DType::F64, CPU), 1 << 48);
    // A view of 2^40 × 10^6 elements made contiguous (4 EiB).
    let e = Tensor::zeros([1, 1], DType::F32, CPU)
        .unwrap()
        .expand(&[1isize << 40, 1_000_000])
        .unwrap();
    host_oom(e.contiguous(), 4_398_046_511_104_000_000);
    // A broadcast matmul whose output is 400 TB.
    let a = Tensor::zeros([10_000, 1, 1000, 1], DType::F32, CPU).unwrap();
    let b = Tensor::zeros([1, 10_000, 1, 1000], DType::F32, CPU).unwrap();
    host_oom(a.matmul(&b), 400_000_000_000_000);
    // ...and the process goes on.
    let ok = Tensor::ones([4], DType::F32, CPU).unwrap();
    assert_eq!(ok.sum_all().unwrap().item_f64().unwrap(), 4.0);
}

#[test]
fn the_out_of_memory_message_names_the_largest_live_allocations() {
    // 8 MiB, made by `full`, listed while alive.
    let big = Tensor::zeros([1024, 2048], DType::F32, CPU).unwrap();
    let product = big.add_scalar(1.0).unwrap();
    let err = Tensor::rand([1 << 40, 3], DType::F32, CPU).unwrap_err();
    let Error::OutOfMemory { largest, .. } = &err else {
        panic!("expected OutOfMemory, got {err}")
    };
    let mine: Vec<_> = largest
        .iter()
        .filter(|a| a.bytes == 8 << 20 && a.shape.as_ref().map(|s| s.dims()) == Some(&[1024, 2048][..]))
        .collect();
    assert!(!mine.is_empty(), "{largest:?}");
    assert!(mine.iter().all(|a| a.dtype == DType::F32 && a.device == CPU));
    let msg = err.to_string();
    assert!(
        msg.contains("largest live allocations: ") && msg.contains("8.00 MiB float32"),
        "{msg}"
    );
    assert!(
        msg.contains("mixed precision") && msg.contains("smaller batch"),
        "{msg}"
    );
    drop((big, product));
}

// ---------------------------------------------------------------------------------------------
// Edge values, as PyTorch.

#[test]
fn lerp_refuses_an_end_of_another_dtype_and_integers() {
    let a = Tensor::zeros([3], DType::F32, CPU).unwrap();
    let end64 = Tensor::ones([3], DType::F64, CPU).unwrap();
    assert!(matches!(
        a.lerp_(&end64, 0.5),
        Err(Error::DTypeMismatch { op: "lerp_", .. })
    ));
    let i = Tensor::zeros([3], DType::I64, CPU).unwrap();
    assert!(matches!(
        i.lerp_(&i, 0.5),
        Err(Error::UnsupportedDType { op: "lerp_", .. })
    ));
    let end = Tensor::ones([3], DType::F32, CPU).unwrap();
    a.lerp_(&end, 0.25).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.25; 3]);
}

#[test]
fn convolution_of_integers_is_refused() {
    for dtype in [DType::I64, DType::I32, DType::U8, DType::Bool] {
        let x = Tensor::zeros([1, 1, 4, 4], dtype, CPU).unwrap();
        let w = Tensor::zeros([1, 1, 3, 3], dtype, CPU).unwrap();
        let r = convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 1], 1);
        assert!(
            matches!(r, Err(Error::UnsupportedDType { dtype: d, .. }) if d == dtype),
            "{dtype}: {r:?}"
        );
    }
}
