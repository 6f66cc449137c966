//! Convolution and pooling on the CPU backend (`cpu/conv.rs`, `cpu/pool.rs`): forward and
//! every gradient against direct f64 loops on the host (the cases of `cudnn.rs`: groups,
//! stride, padding, dilation, 1-d) in every float dtype, f64 finite-difference checks, PyTorch's
//! max-pooling rules (NaN, -inf padding, the first maximum gets the gradient), the composite
//! path for integer dtypes, and argument errors. The CPU backend against the composite path on
//! random shapes is a unit test beside `ops/conv.rs` and `ops/pool.rs`.

use crate::common::{gradcheck, t64, values};
use crate::cudnn::{check_conv, check_nan_and_padding, check_pool, tolerance};
use ember_core::ops::conv::{convolution, unfold};
use ember_core::ops::pool::{pool2d, PoolMode};
use ember_core::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    t64(&values(shape.iter().product(), seed), shape, CPU)
}

#[test]
fn cpu_conv_matches_direct_convolution_all_dtypes() {
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        check_conv(CPU, dtype, tolerance(dtype, false));
    }
}

#[test]
fn cpu_pooling_matches_direct_pooling_all_dtypes() {
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        for mode in [PoolMode::Max, PoolMode::Avg] {
            check_pool(CPU, dtype, mode);
        }
    }
}

#[test]
fn conv_gradcheck() {
    // 2-d with groups, stride, padding and dilation, and a bias.
    let x = rand(&[2, 4, 5, 6], 1);
    let w = rand(&[6, 2, 2, 3], 2);
    let b = rand(&[6], 3);
    gradcheck(
        |t| convolution(&t[0], &t[1], Some(&t[2]), &[2, 1], &[1, 2], &[1, 2], 2),
        &[x, w, b],
    );
    // 1-d, and a 1×1 kernel (the GEMM reads the input in place).
    let x = rand(&[3, 2, 7], 4);
    let w = rand(&[4, 2, 3], 5);
    gradcheck(|t| convolution(&t[0], &t[1], None, &[2], &[1], &[2], 1), &[x, w]);
    let x = rand(&[2, 3, 3, 4], 6);
    let w = rand(&[5, 3, 1, 1], 7);
    gradcheck(
        |t| convolution(&t[0], &t[1], None, &[1, 1], &[0, 0], &[1, 1], 1),
        &[x, w],
    );
}

#[test]
fn pool_gradcheck() {
    let x = rand(&[2, 3, 5, 6], 8);
    gradcheck(
        |t| pool2d(&t[0], PoolMode::Max, [3, 2], [2, 1], [1, 1]),
        std::slice::from_ref(&x),
    );
    gradcheck(
        |t| pool2d(&t[0], PoolMode::Avg, [3, 2], [2, 1], [1, 1]),
        std::slice::from_ref(&x),
    );
    // A non-contiguous input.
    gradcheck(
        |t| pool2d(&t[0].transpose(2, 3)?, PoolMode::Avg, [2, 2], [1, 2], [1, 0]),
        &[x],
    );
}

#[test]
fn max_pool_nan_padding_and_first_maximum() {
    check_nan_and_padding(CPU);
    // Tied maxima: the gradient goes to the first, as PyTorch's CPU kernel.
    let x = t64(&[1.0, 3.0, 3.0, 0.0], &[1, 1, 2, 2], CPU)
        .requires_grad_(true)
        .unwrap();
    let y = pool2d(&x, PoolMode::Max, [2, 2], [2, 2], [0, 0]).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), [0.0, 1.0, 0.0, 0.0]);
    // Overlapping windows add their gradients at a shared maximum.
    let x = t64(&[0.0, 9.0, 0.0, 0.0, 0.0, 0.0], &[1, 1, 2, 3], CPU)
        .requires_grad_(true)
        .unwrap();
    let y = pool2d(&x, PoolMode::Max, [2, 2], [1, 1], [0, 0]).unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), [9.0, 9.0]);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f64>().unwrap(),
        [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    );
}

#[test]
fn integer_convolution_is_refused_as_in_pytorch() {
    // PyTorch: "slow_conv2d_cpu" not implemented for 'Long'.
    let x = Tensor::zeros([2, 4, 5, 5], DType::I64, CPU).unwrap();
    let w = Tensor::zeros([4, 2, 3, 3], DType::I64, CPU).unwrap();
    let err = convolution(&x, &w, None, &[1, 2], &[1, 1], &[1, 1], 2).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedDType {
                dtype: DType::I64,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("floating point"), "{err}");
}

#[test]
fn unfold_is_the_window_gather() {
    let x = Tensor::arange(0.0, 9.0, 1.0, DType::F64, CPU)
        .unwrap()
        .reshape(&[1, 1, 3, 3])
        .unwrap();
    let cols = unfold(&x, [2, 2], [1, 1], [0, 0], [1, 1]).unwrap();
    assert_eq!(cols.dims(), [1, 4, 4]);
    assert_eq!(
        cols.to_vec::<f64>().unwrap(),
        [0.0, 1.0, 3.0, 4.0, 1.0, 2.0, 4.0, 5.0, 3.0, 4.0, 6.0, 7.0, 4.0, 5.0, 7.0, 8.0]
    );
    assert!(unfold(&x, [4, 4], [1, 1], [0, 0], [1, 1]).is_err());
    assert!(unfold(&x, [2, 2], [1, 1], [0, 0], [0, 1]).is_err());
}

#[test]
fn bad_geometry_is_an_error() {
    let x = rand(&[1, 2, 4, 4], 11);
    let w = rand(&[3, 2, 3, 3], 12);
    assert!(
        convolution(&x, &w, None, &[0, 1], &[0, 0], &[1, 1], 1).is_err(),
        "zero stride"
    );
    assert!(
        convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 0], 1).is_err(),
        "zero dilation"
    );
    assert!(
        convolution(&x, &w, None, &[1, 1], &[0, 0], &[2, 2], 1).is_err(),
        "dilated kernel too large"
    );
    assert!(
        pool2d(&x, PoolMode::Max, [5, 5], [1, 1], [0, 0]).is_err(),
        "window too large"
    );
    let xi = x.to_dtype(DType::I32).unwrap();
    assert!(
        pool2d(&xi, PoolMode::Avg, [2, 2], [2, 2], [0, 0]).is_err(),
        "integer pooling"
    );
    // An empty batch gives an empty output.
    let e = Tensor::zeros([0, 2, 4, 4], DType::F32, CPU).unwrap();
    let y = convolution(
        &e,
        &w.to_dtype(DType::F32).unwrap(),
        None,
        &[1, 1],
        &[1, 1],
        &[1, 1],
        1,
    )
    .unwrap();
    assert_eq!(y.dims(), [0, 3, 4, 4]);
    assert_eq!(
        pool2d(&e, PoolMode::Max, [2, 2], [2, 2], [0, 0]).unwrap().dims(),
        [0, 2, 2, 2]
    );
}
