//! In-place ops: writes through views, version counters, dtype rules, autograd guards.

use crate::common::{devices, t64};
use ember_core::{autograd, DType, Device, Error, Tensor};

#[test]
fn inplace_ops_write_through_views_and_bump_versions() {
    for dev in devices() {
        let x = Tensor::zeros([2, 3], DType::F32, dev).unwrap();
        let v0 = x.version();
        let col = x.select(1, 2).unwrap();
        col.add_scalar_(2.0).unwrap();
        col.mul_scalar_(3.0).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 6.0, 0.0, 0.0, 6.0]);
        assert!(x.version() >= v0 + 2, "each in-place op bumps the shared version");
        let row = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], dev).unwrap();
        x.copy_(&row).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        x.sub_(&row).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.0; 6]);
        x.fill_(7).unwrap().zero_().unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.0; 6]);
    }
}

#[test]
fn optimizer_style_updates() {
    let p = t64(&[1.0, 2.0], &[2], Device::Cpu);
    let g = t64(&[0.5, -0.5], &[2], Device::Cpu);
    p.add_scaled_(&g, -0.1).unwrap();
    assert_eq!(p.to_vec::<f64>().unwrap(), vec![0.95, 2.05]);
    let m = t64(&[0.0, 0.0], &[2], Device::Cpu);
    m.addcmul_(&g, &g, 2.0).unwrap();
    assert_eq!(m.to_vec::<f64>().unwrap(), vec![0.5, 0.5]);
    m.addcdiv_(&g, &t64(&[2.0, 2.0], &[2], Device::Cpu), 1.0).unwrap();
    assert_eq!(m.to_vec::<f64>().unwrap(), vec![0.75, 0.25]);
    m.lerp_(&t64(&[1.75, 1.25], &[2], Device::Cpu), 0.5).unwrap();
    assert_eq!(m.to_vec::<f64>().unwrap(), vec![1.25, 0.75]);
}

#[test]
fn self_aliasing_sources_are_read_before_writing() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], Device::Cpu).unwrap();
    x.add_(&x).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
    x.copy_(&x.t().unwrap()).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![2.0, 6.0, 4.0, 8.0]);
}

#[test]
fn inplace_errors() {
    let ints = Tensor::from_vec(vec![1i64, 2], [2], Device::Cpu).unwrap();
    let err = ints.mul_scalar_(0.5).unwrap_err();
    assert!(
        err.to_string()
            .contains("can't be cast to the desired output type int64"),
        "{err}"
    );
    ints.mul_scalar_(3).unwrap();
    assert_eq!(ints.to_vec::<i64>().unwrap(), vec![3, 6]);
    let x = Tensor::zeros([3], DType::F32, Device::Cpu).unwrap();
    let bad = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(
        x.copy_(&bad).unwrap_err(),
        Error::ShapeMismatch { op: "copy_", .. }
    ));
    let e = x.unsqueeze(0).unwrap().expand(&[4, 3]).unwrap();
    assert!(e
        .fill_(1.0)
        .unwrap_err()
        .to_string()
        .contains("single memory location"));
    let w = t64(&[1.0], &[1], Device::Cpu).requires_grad_(true).unwrap();
    let err = w.add_scalar_(1.0).unwrap_err();
    assert!(
        err.to_string().contains("leaf tensor that requires grad"),
        "{err}"
    );
    {
        let _g = autograd::no_grad();
        w.add_scalar_(1.0).unwrap();
    }
    assert_eq!(w.item::<f64>().unwrap(), 2.0);
}
