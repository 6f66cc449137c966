//! Reverse-mode automatic differentiation over a dynamic graph, as `torch.autograd`.
//!
//! An op whose inputs need gradients calls `Door::record` with a backward closure that sits next to
//! its forward code; the closure receives the gradient of the op's output and returns one
//! gradient per input. A node is recorded only when grad mode is on and some input requires a
//! gradient, so inference pays nothing. The graph's vocabulary (nodes, edges, grad mode,
//! `custom_op`) is the dispatch point's (`dispatch/graph.rs`, Note [Single-output nodes]
//! there); this module runs it backward (`engine.rs`) and holds the backward API (`backward`,
//! `grad`, hooks, checkpointing, saved tensors).
//!
//! Note [Saved tensors]: a backward closure keeps what it needs as `SavedTensor`, which
//! remembers the storage version at record time; if an in-place op changed the storage since,
//! backward fails with [`Error::InplaceModified`](crate::Error::InplaceModified) instead of computing a wrong gradient.

#![deny(unsafe_code)]

mod callbacks;
mod checkpoint;
mod device_threads;
mod engine;
mod ready_queue;

pub use crate::dispatch::tensor_impl::{Hook, PostAccumulateGradHook};
pub use callbacks::queue_callback;
pub use checkpoint::checkpoint;

pub use crate::dispatch::grad_mode::{
    enable_grad, is_grad_enabled, no_grad, set_grad_enabled, GradModeGuard,
};
pub(crate) use crate::dispatch::graph::{cast_from, needs_grad, Activation, Edge, Node, SavedTensor, ViewOf};
pub use crate::dispatch::graph::{custom_op, with_fresh_sequence_nr};
pub use engine::{grad, retains_graph};
pub(crate) use engine::{roots_with_grads as engine_roots, run_backward};

use crate::{Result, Tensor};
use std::sync::Arc;

/// The engine's order of an edge (Note [Ready order] in `ready_queue.rs`).
impl Edge {
    /// Where this edge's entry goes in the ready queue (Note [Ready order]).
    pub(crate) fn priority(&self) -> u64 {
        match self {
            Edge::Leaf(_) => ready_queue::LEAF_PRIORITY,
            Edge::Node(n) => n.sequence_nr,
        }
    }
}

/// Lets the backward of the node that made `out` take its first input's waiting gradient with
/// [`take_accumulator`] (Note [Gradients added in place] in `engine.rs`).
pub(crate) fn mark_accumulating(out: &Tensor) {
    if let Some(node) = &out.0.grad_fn {
        node.accumulates.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Marks `out` as the output of activation `kind` of `input` (Note [Activation epilogues] in
/// `engine.rs`).
pub(crate) fn mark_activation(out: &Tensor, kind: Activation, input: &Tensor) {
    if let Some(node) = &out.0.grad_fn {
        let _ = node.activation.set((kind, SavedTensor::new(node.name, input)));
    }
}

/// Lets the backward of the node that made `out` take its first input's activation with
/// [`take_activation`] (Note [Activation epilogues] in `engine.rs`).
pub(crate) fn mark_applies_activation(out: &Tensor) {
    if let Some(node) = &out.0.grad_fn {
        node.applies_activation
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

thread_local! {
    /// The activation whose output is the first input of the node whose backward runs on this
    /// thread, with that activation's input, offered by the engine (Note [Activation
    /// epilogues] in `engine.rs`); `true` once taken.
    static ACTIVATION: std::cell::RefCell<Option<(Activation, Tensor, bool)>> = const { std::cell::RefCell::new(None) };
}

/// Sets the activation offer for one backward call; the previous one comes back with
/// [`end_activation_offer`].
pub(crate) fn offer_activation(offer: Option<(Activation, Tensor)>) -> Option<(Activation, Tensor, bool)> {
    ACTIVATION.with(|a| a.replace(offer.map(|(k, t)| (k, t, false))))
}

/// Ends the offer of [`offer_activation`]: whether it was taken; puts `outer` back.
pub(crate) fn end_activation_offer(outer: Option<(Activation, Tensor, bool)>) -> bool {
    ACTIVATION
        .with(|a| a.replace(outer))
        .is_some_and(|(_, _, taken)| taken)
}

/// Inside a backward function marked with [`mark_applies_activation`]: the activation whose
/// output is the node's first input, and that activation's input, when the engine offers it.
/// A backward that takes it must return, as its first input's gradient, the gradient of the
/// activation's *input* (the activation's backward applied), which the engine then hands on
/// past the activation's node (Note [Activation epilogues] in `engine.rs`).
pub(crate) fn take_activation() -> Option<(Activation, Tensor)> {
    ACTIVATION.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_mut() {
            Some((kind, input, taken)) if !*taken => {
                *taken = true;
                Some((*kind, input.clone()))
            }
            _ => None,
        }
    })
}

thread_local! {
    /// The gradient already waiting for the first input of the node whose backward runs on this
    /// thread, offered by the engine, and whether the backward may write it (Note [Gradients
    /// added in place] in `engine.rs`).
    static ACCUMULATOR: std::cell::RefCell<Option<(Tensor, bool)>> = const { std::cell::RefCell::new(None) };
}

/// Sets the offer for one backward call (the gradient and whether it may be written); the
/// previous one (of an outer pass) comes back with [`end_offer`].
pub(crate) fn offer_accumulator(grad: Option<(Tensor, bool)>) -> Option<(Tensor, bool)> {
    ACCUMULATOR.with(|a| a.replace(grad))
}

/// Ends the offer of [`offer_accumulator`]: what the backward did not take, and puts `outer` back.
pub(crate) fn end_offer(outer: Option<(Tensor, bool)>) -> Option<(Tensor, bool)> {
    ACCUMULATOR.with(|a| a.replace(outer))
}

/// Inside a backward function marked with [`mark_accumulating`]: the gradient already summed
/// for the node's first input, when nothing else holds it and `fits` accepts it. A backward that
/// takes it must add its own gradient for that input into it and return it as that gradient
/// (Note [Gradients added in place] in `engine.rs`); one that does not leaves it to the engine
/// to sum.
pub(crate) fn take_accumulator(fits: impl FnOnce(&Tensor) -> bool) -> Option<Tensor> {
    ACCUMULATOR.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_ref() {
            Some((t, true)) if fits(t) => a.take().map(|(t, _)| t),
            _ => None,
        }
    })
}

/// [`take_accumulator`] for a backward that can also read the gradient without writing it:
/// the gradient, when `fits` accepts it, and whether it may be written in place. A backward
/// that takes one it may not write returns the sum of it and its own gradient as a new tensor
/// (one kernel that reads both, as LayerNorm's backward does).
pub(crate) fn take_addend(fits: impl FnOnce(&Tensor) -> bool) -> Option<(Tensor, bool)> {
    ACCUMULATOR.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_ref() {
            Some((t, _)) if fits(t) => a.take(),
            _ => None,
        }
    })
}

/// For each of `leaves`, whether a backward pass from `outputs` would reach it: the walk over
/// the recorded graph that PyTorch's DDP does after forward with `find_unused_parameters`.
/// A leaf that does not require grad is never reached; an output that is itself one of the
/// leaves reaches it.
///
/// ```
/// use ember_core::{autograd, Device, Tensor};
/// let a = Tensor::from_slice(&[1.0f32], [1], Device::Cpu)?.requires_grad_(true)?;
/// let b = Tensor::from_slice(&[2.0f32], [1], Device::Cpu)?.requires_grad_(true)?;
/// let y = a.mul_scalar(3.0)?.sum_all()?;
/// assert_eq!(autograd::reachable(&[y], &[a, b]), [true, false]);
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn reachable(outputs: &[Tensor], leaves: &[Tensor]) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    let mut stack: Vec<Edge> = outputs.iter().filter_map(Edge::of).collect();
    while let Some(edge) = stack.pop() {
        if !seen.insert(edge.key()) {
            continue;
        }
        if let Edge::Node(node) = &edge {
            stack.extend(node.edges.iter().flatten().cloned());
        }
    }
    leaves
        .iter()
        .map(|t| {
            t.is_leaf() && t.requires_grad() && seen.contains(&(Arc::as_ptr(&t.0) as *const () as usize))
        })
        .collect()
}

/// Backward from a tensor (`Tensor.backward`), written here so that `tensor/` needs nothing of
/// the engine.
impl Tensor {
    /// Backpropagates from this scalar tensor into every leaf that requires grad.
    pub fn backward(&self) -> Result<()> {
        self.backward_with(None, false)
    }

    /// Backpropagates with an explicit upstream `gradient` (needed for non-scalar outputs);
    /// `retain_graph` keeps the graph for another backward.
    pub fn backward_with(&self, gradient: Option<&Tensor>, retain_graph: bool) -> Result<()> {
        let grads = gradient.map(|g| vec![g.clone()]);
        let roots = engine_roots(std::slice::from_ref(self), grads.as_deref())?;
        run_backward(roots, retain_graph, None).map(drop)
    }
}
