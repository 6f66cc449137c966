//! Gradient checkpointing: the same gradients as without it (for inputs and for the parameters
//! the function captures), dropout-like randomness replayed, inputs without gradients.

use crate::common::{assert_close, devices, in_own_process, values};
use ember_core::{autograd, manual_seed, no_grad, DType, Device, Result, Tensor};

fn param(n: usize, dims: &[usize], seed: u64, device: Device) -> Tensor {
    Tensor::from_slice(&values(n, seed), dims, device)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

/// A two-layer block with a random mask (like dropout) in the middle.
fn block(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w1)?.tanh()?;
    let keep = Tensor::rand(h.dims(), DType::F64, h.device())?
        .gt_scalar(0.3)?
        .to_dtype(DType::F64)?;
    h.mul(&keep)?.matmul(w2)?.sigmoid()
}

/// (output, x.grad, w1.grad, w2.grad) of `block`, checkpointed or not, from one seed.
fn run(checkpointed: bool, x_requires_grad: bool, device: Device) -> Vec<Option<Tensor>> {
    let x = Tensor::from_slice(&values(12, 1), [3, 4], device).unwrap();
    let x = if x_requires_grad {
        x.requires_grad_(true).unwrap()
    } else {
        x
    };
    let (w1, w2) = (param(20, &[4, 5], 2, device), param(10, &[5, 2], 3, device));
    manual_seed(7).unwrap();
    let y = if checkpointed {
        let (a, b) = (w1.clone(), w2.clone());
        autograd::checkpoint(move |xs: &[Tensor]| block(&xs[0], &a, &b), &[x.clone()]).unwrap()
    } else {
        block(&x, &w1, &w2).unwrap()
    };
    // Draws between forward and backward must not change what the recomputation sees.
    Tensor::rand([100], DType::F32, device).unwrap();
    y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
    vec![Some(y.detach()), x.grad(), w1.grad(), w2.grad()]
}

/// The two runs draw their masks from the default generators after the same `manual_seed`,
/// which other tests of this binary draw from concurrently (the H100 run saw a mask differ), so
/// the body runs in a process of its own.
#[test]
fn checkpoint_matches_the_plain_gradients() {
    in_own_process(
        "checkpoint::checkpoint_matches_the_plain_gradients",
        checkpoint_matches_the_plain_gradients_body,
    );
}

fn checkpoint_matches_the_plain_gradients_body() {
    for device in devices() {
        for x_requires_grad in [true, false] {
            let plain = run(false, x_requires_grad, device);
            let ckpt = run(true, x_requires_grad, device);
            for (i, (p, c)) in plain.iter().zip(&ckpt).enumerate() {
                match (p, c) {
                    (Some(p), Some(c)) => assert_close(c, p, 1e-12, 1e-12),
                    (None, None) => assert!(i == 1 && !x_requires_grad),
                    _ => panic!("entry {i}: one run has a gradient and the other not"),
                }
            }
        }
    }
}

#[test]
fn checkpoint_keeps_no_graph_inside() {
    let x = param(12, &[3, 4], 1, Device::Cpu);
    let w = param(20, &[4, 5], 2, Device::Cpu);
    let w2 = w.clone();
    let y = autograd::checkpoint(move |xs: &[Tensor]| xs[0].matmul(&w2)?.tanh(), &[x.clone()]).unwrap();
    assert!(y.requires_grad());
    // One node over the inputs, not the matmul and tanh of the function.
    assert_eq!(y.grad_fn_name(), Some("checkpoint"));
    let _g = no_grad();
    let z = autograd::checkpoint(|xs: &[Tensor]| xs[0].exp(), &[x]).unwrap();
    assert!(!z.requires_grad());
}

#[test]
fn custom_op_rejects_a_gradient_of_the_wrong_shape() {
    let x = param(4, &[4], 1, Device::Cpu);
    let y = autograd::custom_op("bad", &[&x], x.detach().exp().unwrap(), |g, _| {
        Ok(vec![Some(g.sum_all()?)])
    });
    let err = y.sum_all().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("shape"), "{err}");
}
