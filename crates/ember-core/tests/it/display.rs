//! Tests of printing: `Display` must give exactly what PyTorch 2.x prints for the same tensor
//! (each expected string is `repr(torch_expression)` with default print options), and `Debug`
//! stays short.

use crate::common;
use ember_core::{DType, Device, Tensor};

fn f32s(values: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(values, shape, Device::Cpu).unwrap()
}

fn arange(n: usize, dtype: DType) -> Tensor {
    Tensor::arange(0.0, n as f64, 1.0, dtype, Device::Cpu).unwrap()
}

#[test]
fn floats_print_with_four_decimals_and_aligned() {
    // torch.tensor([[1.0, -2.5], [3.0, 4.0]])
    assert_eq!(
        f32s(&[1.0, -2.5, 3.0, 4.0], &[2, 2]).to_string(),
        "tensor([[ 1.0000, -2.5000],\n        [ 3.0000,  4.0000]])"
    );
    // torch.tensor([0.1, 100.0])
    assert_eq!(
        f32s(&[0.1, 100.0], &[2]).to_string(),
        "tensor([  0.1000, 100.0000])"
    );
    // torch.tensor([0.0, 0.5])
    assert_eq!(f32s(&[0.0, 0.5], &[2]).to_string(), "tensor([0.0000, 0.5000])");
    // torch.tensor(1.23456)
    assert_eq!(
        Tensor::scalar(1.23456, DType::F32, Device::Cpu)
            .unwrap()
            .to_string(),
        "tensor(1.2346)"
    );
}

#[test]
fn integer_valued_floats_print_with_a_trailing_dot() {
    assert_eq!(f32s(&[1.0, 2.0, 3.0], &[3]).to_string(), "tensor([1., 2., 3.])");
    assert_eq!(f32s(&[-1.0, 2.0], &[2]).to_string(), "tensor([-1.,  2.])");
    // torch.zeros(3), torch.tensor(2.), torch.tensor([-0.])
    assert_eq!(
        Tensor::zeros([3], DType::F32, Device::Cpu).unwrap().to_string(),
        "tensor([0., 0., 0.])"
    );
    assert_eq!(
        Tensor::scalar(2.0, DType::F32, Device::Cpu).unwrap().to_string(),
        "tensor(2.)"
    );
    assert_eq!(f32s(&[-0.0], &[1]).to_string(), "tensor([-0.])");
}

#[test]
fn scientific_notation_when_the_range_demands_it() {
    // torch.tensor([1e-5, 1.0])
    assert_eq!(
        f32s(&[1e-5, 1.0], &[2]).to_string(),
        "tensor([1.0000e-05, 1.0000e+00])"
    );
    // torch.tensor([1e10, 1.0]): integers, but above 1e8
    assert_eq!(
        f32s(&[1e10, 1.0], &[2]).to_string(),
        "tensor([1.0000e+10, 1.0000e+00])"
    );
    // torch.tensor([-1e-5, 1.0], dtype=torch.float64)
    assert_eq!(
        common::t64(&[-1e-5, 1.0], &[2], Device::Cpu).to_string(),
        "tensor([-1.0000e-05,  1.0000e+00], dtype=torch.float64)"
    );
    // torch.tensor([0.0, 1e-5]): zeros do not count toward the range
    assert_eq!(
        f32s(&[0.0, 1e-5], &[2]).to_string(),
        "tensor([0.0000e+00, 1.0000e-05])"
    );
    // torch.tensor([1.0, 1000.0]) stays fixed (ratio not above 1000); 1001 switches.
    assert_eq!(f32s(&[1.0, 1000.0], &[2]).to_string(), "tensor([   1., 1000.])");
    assert_eq!(
        f32s(&[1.0, 1001.0], &[2]).to_string(),
        "tensor([1.0000e+00, 1.0010e+03])"
    );
}

#[test]
fn non_finite_values() {
    // torch.tensor([1.0, float('inf'), float('nan')])
    assert_eq!(
        f32s(&[1.0, f32::INFINITY, f32::NAN], &[3]).to_string(),
        "tensor([1., inf, nan])"
    );
    // torch.tensor([0.5, float('-inf')])
    assert_eq!(
        f32s(&[0.5, f32::NEG_INFINITY], &[2]).to_string(),
        "tensor([0.5000,   -inf])"
    );
    // torch.tensor([float('nan')])
    assert_eq!(f32s(&[f32::NAN], &[1]).to_string(), "tensor([nan])");
}

#[test]
fn integers_and_bools_print_plainly() {
    assert_eq!(
        arange(10, DType::I64).to_string(),
        "tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])"
    );
    let b = Tensor::from_vec(vec![true, false], [2], Device::Cpu).unwrap();
    assert_eq!(b.to_string(), "tensor([ True, False])");
    let b = Tensor::from_vec(vec![true], [], Device::Cpu).unwrap();
    assert_eq!(b.to_string(), "tensor(True)");
    let i = Tensor::from_vec(vec![-5i32, 120], [2], Device::Cpu).unwrap();
    assert_eq!(i.to_string(), "tensor([ -5, 120], dtype=torch.int32)");
    let u = Tensor::from_vec(vec![7u8, 255], [2], Device::Cpu).unwrap();
    assert_eq!(u.to_string(), "tensor([  7, 255], dtype=torch.uint8)");
    assert_eq!(
        Tensor::scalar(3.0, DType::I64, Device::Cpu).unwrap().to_string(),
        "tensor(3)"
    );
}

#[test]
fn non_default_dtypes_are_named() {
    assert_eq!(
        common::t64(&[1.5, 2.0], &[2], Device::Cpu).to_string(),
        "tensor([1.5000, 2.0000], dtype=torch.float64)"
    );
    let h = f32s(&[1.5, 2.0], &[2]).to_dtype(DType::F16).unwrap();
    assert_eq!(h.to_string(), "tensor([1.5000, 2.0000], dtype=torch.float16)");
    let b = f32s(&[0.5, -3.0], &[2]).to_dtype(DType::BF16).unwrap();
    assert_eq!(b.to_string(), "tensor([ 0.5000, -3.0000], dtype=torch.bfloat16)");
}

#[test]
fn nested_dimensions_get_blank_lines() {
    // torch.arange(8).reshape(2, 2, 2)
    let t = arange(8, DType::I64).reshape(&[2, 2, 2]).unwrap();
    assert_eq!(
        t.to_string(),
        "tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]])"
    );
    // A non-contiguous view prints in its own order: torch.arange(6.).reshape(2, 3).t()
    let t = arange(6, DType::F32).reshape(&[2, 3]).unwrap().t().unwrap();
    assert_eq!(
        t.to_string(),
        "tensor([[0., 3.],\n        [1., 4.],\n        [2., 5.]])"
    );
}

#[test]
fn long_rows_wrap_at_eighty_columns() {
    // torch.arange(30)
    assert_eq!(
        arange(30, DType::I64).to_string(),
        "tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17,\n        18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29])"
    );
    // torch.arange(14, dtype=torch.float64): the dtype suffix moves to its own line
    assert_eq!(
        arange(14, DType::F64).to_string(),
        "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.],\n       dtype=torch.float64)"
    );
}

#[test]
fn large_tensors_are_summarized() {
    // torch.arange(10000)
    assert_eq!(
        arange(10000, DType::I64).to_string(),
        "tensor([   0,    1,    2,  ..., 9997, 9998, 9999])"
    );
    // torch.arange(2000.)
    assert_eq!(
        arange(2000, DType::F32).to_string(),
        "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n        1.9990e+03])"
    );
    // torch.arange(10000).reshape(100, 100)
    assert_eq!(
        arange(10000, DType::I64)
            .reshape(&[100, 100])
            .unwrap()
            .to_string(),
        "tensor([[   0,    1,    2,  ...,   97,   98,   99],
        [ 100,  101,  102,  ...,  197,  198,  199],
        [ 200,  201,  202,  ...,  297,  298,  299],
        ...,
        [9700, 9701, 9702,  ..., 9797, 9798, 9799],
        [9800, 9801, 9802,  ..., 9897, 9898, 9899],
        [9900, 9901, 9902,  ..., 9997, 9998, 9999]])"
    );
    // 1000 elements exactly are not summarized: torch.zeros(1000, dtype=torch.bool) prints all.
    let s = Tensor::zeros([1000], DType::Bool, Device::Cpu)
        .unwrap()
        .to_string();
    assert!(!s.contains("..."));
    assert_eq!(s.matches("False").count(), 1000);
}

#[test]
fn empty_tensors() {
    assert_eq!(
        Tensor::zeros([0], DType::F32, Device::Cpu).unwrap().to_string(),
        "tensor([])"
    );
    assert_eq!(
        Tensor::zeros([0, 3], DType::F32, Device::Cpu)
            .unwrap()
            .to_string(),
        "tensor([], size=(0, 3))"
    );
    assert_eq!(
        Tensor::zeros([0], DType::I64, Device::Cpu).unwrap().to_string(),
        "tensor([], dtype=torch.int64)"
    );
}

#[test]
fn autograd_state_is_shown() {
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true).unwrap();
    assert_eq!(x.to_string(), "tensor([1., 2.], requires_grad=True)");
    let y = x.mul(&x).unwrap();
    assert_eq!(y.to_string(), "tensor([1., 4.], grad_fn=<MulBackward0>)");
    let z = y.add_scalar(0.5).unwrap();
    assert_eq!(z.to_string(), "tensor([1.5000, 4.5000], grad_fn=<AddBackward0>)");
    assert_eq!(x.detach().to_string(), "tensor([1., 2.])");
}

#[test]
fn precision_comes_from_the_format_string() {
    // torch.set_printoptions(precision=2); torch.tensor([1.2345, -0.5])
    assert_eq!(
        format!("{:.2}", f32s(&[1.2345, -0.5], &[2])),
        "tensor([ 1.23, -0.50])"
    );
    assert_eq!(
        format!("{:.2}", f32s(&[1e-5, 1.0], &[2])),
        "tensor([1.00e-05, 1.00e+00])"
    );
}

#[test]
fn debug_is_short() {
    let t = Tensor::zeros([2, 3], DType::F16, Device::Cpu).unwrap();
    assert_eq!(format!("{t:?}"), "Tensor[[2, 3], dtype=float16, device=cpu]");
}
