//! Gradient checkpointing (`torch.utils.checkpoint.checkpoint`): run a function without
//! keeping its activations, and run it again in backward to get them.
//!
//! Note [Checkpoint recomputation]: the forward pass calls the function under `no_grad`, so
//! none of its intermediate tensors are saved; the graph gets one node over the inputs. Its
//! backward restores the random-number state the forward saw (so dropout draws the same mask),
//! calls the function again with grad mode on, on detached copies of the inputs, and runs
//! `backward` through that short graph with the incoming gradient. That accumulates into the
//! `.grad` of every parameter the function reads (as PyTorch's reentrant checkpoint does) and
//! yields the gradients of the input copies, which the node passes on. Parameters are found by
//! the recomputation itself, so the function may read any tensor it captures; when no input
//! requires a gradient (the first block of a network), a hidden anchor input keeps the node in
//! the graph so that the parameters still get theirs.

use super::{custom_op, enable_grad, is_grad_enabled, no_grad};
use crate::random::{default_generator, RngState};
use crate::{DType, Device, Result, Tensor};

/// Runs `f(inputs)` without storing its intermediate activations; backward recomputes them.
/// Memory falls from every activation inside `f` to its inputs and output, for one more
/// forward pass of `f` in backward.
///
/// `f` must compute the same function both times (it may use dropout: the random state is
/// restored for the recomputation). Gradients reach the inputs that require them and, through
/// `.grad`, the parameters `f` captures, so use it with [`Tensor::backward`]; under `no_grad`
/// it is just `f(inputs)`.
///
/// ```
/// use ember_core::{autograd, DType, Device, Tensor};
/// let w = Tensor::ones([3, 3], DType::F32, Device::Cpu)?.requires_grad_(true)?;
/// let x = Tensor::ones([2, 3], DType::F32, Device::Cpu)?;
/// let w2 = w.clone();
/// let y = autograd::checkpoint(move |xs: &[Tensor]| xs[0].matmul(&w2)?.tanh(), &[x])?;
/// y.sum_all()?.backward()?;
/// assert!(w.grad().is_some());
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn checkpoint<F>(f: F, inputs: &[Tensor]) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    if !is_grad_enabled() {
        return f(inputs);
    }
    let devices = rng_devices(inputs);
    let rng: Vec<RngState> = devices
        .iter()
        .map(|&d| default_generator(d).get_state())
        .collect();
    let output = {
        let _g = no_grad();
        f(inputs)?
    };
    let mut graph_inputs: Vec<Tensor> = inputs.to_vec();
    let anchored = !inputs.iter().any(Tensor::requires_grad);
    if anchored {
        graph_inputs.push(Tensor::zeros([], DType::F32, Device::Cpu)?.requires_grad_(true)?);
    }
    let saved: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
    let refs: Vec<&Tensor> = graph_inputs.iter().collect();
    Ok(custom_op("checkpoint", &refs, output, move |grad, needs| {
        // The random state of the recomputation is the forward's; the caller's is kept.
        let current: Vec<RngState> = devices
            .iter()
            .map(|&d| default_generator(d).get_state())
            .collect();
        for (&d, state) in devices.iter().zip(&rng) {
            default_generator(d).set_state(*state);
        }
        let result = recompute(&f, &saved, grad, &needs[..saved.len()]);
        for (&d, state) in devices.iter().zip(current) {
            default_generator(d).set_state(state);
        }
        let mut grads = result?;
        if anchored {
            grads.push(None);
        }
        Ok(grads)
    }))
}

/// Runs `f` again with grad mode on and backpropagates `grad` through it; the gradients of
/// the inputs that need one.
fn recompute<F>(f: &F, saved: &[Tensor], grad: &Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>>
where
    F: Fn(&[Tensor]) -> Result<Tensor>,
{
    let _g = enable_grad();
    let copies = saved
        .iter()
        .zip(needs)
        .map(|(t, &need)| {
            let t = t.detach();
            if need {
                t.requires_grad_(true)
            } else {
                Ok(t)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let output = f(&copies)?;
    if output.requires_grad() {
        output.backward_with(Some(grad), false)?;
    }
    Ok(copies
        .iter()
        .zip(needs)
        .map(|(t, &need)| if need { t.grad() } else { None })
        .collect())
}

/// The devices whose default generators the function may draw from: the CPU and every
/// input's device.
fn rng_devices(inputs: &[Tensor]) -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    for t in inputs {
        if !devices.contains(&t.device()) {
            devices.push(t.device());
        }
    }
    devices
}
