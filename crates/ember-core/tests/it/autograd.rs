//! Autograd engine: accumulation, graph retention, grad modes, leaves, hooks, `grad`, and the
//! in-place version check.

use crate::common::t64;
use ember_core::{autograd, DType, Device, Error, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn leaf(v: &[f64]) -> Tensor {
    t64(v, &[v.len()], Device::Cpu).requires_grad_(true).unwrap()
}

fn ones(n: usize) -> Tensor {
    Tensor::ones([n], DType::F64, Device::Cpu).unwrap()
}

#[test]
fn gradients_accumulate_across_backward_calls() {
    let x = leaf(&[1.0, 2.0]);
    for _ in 0..2 {
        let y = x.mul(&x).unwrap(); // dy/dx = 2x
        y.backward_with(Some(&ones(2)), false).unwrap();
    }
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![4.0, 8.0]);
    x.set_grad(None).unwrap();
    assert!(x.grad().is_none());
}

#[test]
fn shared_subexpressions_sum_their_gradients() {
    let x = leaf(&[3.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let z = y.mul(&y).unwrap().add(&y).unwrap(); // z = 4x² + 2x, dz/dx = 8x + 2
    z.backward().unwrap();
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 26.0);
}

#[test]
fn second_backward_needs_retain_graph() {
    let x = leaf(&[1.0]);
    let y = x.mul(&x).unwrap();
    y.backward_with(None, true).unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 4.0);
    let err = y.backward().unwrap_err();
    assert!(
        err.to_string()
            .contains("backward through the graph a second time"),
        "{err}"
    );
}

#[test]
fn non_scalar_backward_needs_a_gradient() {
    let x = leaf(&[1.0, 2.0]);
    let err = x.mul_scalar(2.0).unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("only for scalar outputs"), "{err}");
    let err = Tensor::ones([1], DType::F64, Device::Cpu)
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
}

#[test]
fn no_grad_and_enable_grad_scopes() {
    let x = leaf(&[1.0]);
    {
        let _g = autograd::no_grad();
        assert!(!autograd::is_grad_enabled());
        let y = x.mul_scalar(2.0).unwrap();
        assert!(!y.requires_grad());
        {
            let _e = autograd::enable_grad();
            assert!(x.mul_scalar(2.0).unwrap().requires_grad());
        }
        assert!(!autograd::is_grad_enabled());
    }
    assert!(autograd::is_grad_enabled());
    // Grad mode is per thread.
    let _g = autograd::no_grad();
    std::thread::spawn(|| assert!(autograd::is_grad_enabled()))
        .join()
        .unwrap();
}

#[test]
fn leaves_detach_and_retain_grad() {
    let x = leaf(&[2.0]);
    assert!(x.is_leaf());
    let y = x.mul(&x).unwrap();
    assert!(!y.is_leaf());
    assert_eq!(y.grad_fn_name(), Some("mul"));
    let d = y.detach();
    assert!(!d.requires_grad() && d.is_leaf() && d.shares_storage_with(&y));
    y.retain_grad().unwrap();
    let z = y.mul_scalar(3.0).unwrap();
    z.backward().unwrap();
    assert_eq!(y.grad().unwrap().item::<f64>().unwrap(), 3.0);
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 12.0);
    assert!(y.requires_grad_(false).is_err());
    let ints = Tensor::zeros([2], DType::I64, Device::Cpu).unwrap();
    assert!(matches!(
        ints.requires_grad_(true).unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
}

#[test]
fn hooks_see_and_replace_gradients() {
    let x = leaf(&[1.0, 2.0]);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let handle = x
        .register_hook(move |g| {
            seen.fetch_add(1, Ordering::SeqCst);
            Ok(Some(g.mul_scalar(10.0)?))
        })
        .unwrap();
    // x is used twice: the hook sees the summed gradient once, as in PyTorch.
    let y = x.mul_scalar(2.0).unwrap().add(&x).unwrap();
    y.backward_with(Some(&ones(2)), false).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![30.0, 30.0]);
    handle.remove();
    x.set_grad(None).unwrap();
    x.mul_scalar(2.0)
        .unwrap()
        .backward_with(Some(&ones(2)), false)
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 2.0]);
}

#[test]
fn hooks_on_intermediate_tensors_change_what_flows_upstream() {
    let x = leaf(&[1.0, 2.0]);
    let h = x.mul_scalar(3.0).unwrap();
    h.register_hook(|g| Ok(Some(g.mul_scalar(0.5)?))).unwrap();
    h.mul_scalar(2.0)
        .unwrap()
        .backward_with(Some(&ones(2)), false)
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn grad_returns_gradients_without_touching_dot_grad() {
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    let y = a.mul(&b).unwrap();
    let g = autograd::grad(&[y], &[a.clone(), b.clone()], Some(&[ones(2)]), false).unwrap();
    assert_eq!(g[0].as_ref().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 4.0]);
    assert_eq!(g[1].as_ref().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
    assert!(a.grad().is_none() && b.grad().is_none());
    let c = leaf(&[0.0]);
    let y = a.mul_scalar(2.0).unwrap();
    let g = autograd::grad(&[y], &[c], Some(&[ones(2)]), false).unwrap();
    assert!(g[0].is_none(), "an unused input gets no gradient");
}

#[test]
fn modifying_a_saved_tensor_fails_backward() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let z = y.mul(&y).unwrap(); // saves y
    {
        let _g = autograd::no_grad();
        y.add_scalar_(1.0).unwrap();
    }
    let err = z.backward_with(Some(&ones(2)), false).unwrap_err();
    assert!(matches!(err, Error::InplaceModified { op: "mul", .. }), "{err}");
    assert!(err.to_string().contains("modified by an in-place operation"));
}
