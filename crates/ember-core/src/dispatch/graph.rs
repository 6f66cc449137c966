//! The autograd graph as the dispatch point records it (step 6): [`Node`]s with their
//! [`Edge`]s, made only through the [`Door`] (Note [The door] in `mod.rs`) or, for the user's
//! own differentiable functions, [`custom_op`]. The engine that runs the graph backward, the
//! hooks and the saved tensors are `autograd/`'s, above the op layer (PyTorch keeps the graph
//! vocabulary in `torch/csrc/autograd/function.h`, below its VariableType kernels).
//!
//! Note [Single-output nodes]: every node has exactly one output tensor. Ops with several
//! outputs (split, max with indices) make one node per differentiable output. The gradient
//! that reaches a node is therefore the gradient of that one tensor, which is where its hooks
//! and `retain_grad` apply.

use super::grad_mode::is_grad_enabled;
use super::tensor_impl::{Hook, Tensor, TensorImpl};
use super::Door;
use crate::{Error, Result};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Computes input gradients from the output gradient; `needs[i]` says whether input `i` needs
/// one (an entry may be `None` when it does not).
pub(crate) type BackwardFn = Box<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// One recorded operation. Made only here (two fields are private): by [`Door::record`] and
/// its forms, and by [`custom_op`].
pub(crate) struct Node {
    pub(crate) name: &'static str,
    /// Where each input's gradient goes; `None` for inputs that need no gradient.
    pub(crate) edges: Vec<Option<Edge>>,
    /// Taken after a backward pass unless the graph is retained.
    pub(crate) backward: Mutex<Option<BackwardFn>>,
    /// The node's output tensor, for its hooks and `retain_grad` (see Note [Single-output nodes]).
    output: OnceLock<Weak<TensorImpl>>,
    /// The order of recording on this thread; later nodes run first (Note [Ready order]).
    pub(crate) sequence_nr: u64,
    /// For a view op (`narrow`, `slice`, `select`): the region of its input that the output
    /// views, whose gradient the engine keeps as a slice (Note [Gradients of views] in
    /// `engine.rs`) instead of calling `backward`.
    pub(crate) view: Option<ViewOf>,
    /// For a cast (`to_dtype`): its input's dtype. A float32 gradient may reach the output of
    /// a cast from float32 (Note [Widened gradients] in `ops/matmul.rs`); the cast's backward
    /// then has nothing to convert.
    cast_from: Option<crate::DType>,
    /// Whether the backward may add its first input's gradient into the one already waiting
    /// for that input (Note [Gradients added in place] in `autograd/engine.rs`):
    /// `autograd::take_accumulator`.
    pub(crate) accumulates: std::sync::atomic::AtomicBool,
    /// For an activation whose gradient a product's epilogue can apply (Note [Activation
    /// epilogues] in `autograd/engine.rs`): which one, and its saved input.
    pub(crate) activation: OnceLock<(Activation, SavedTensor)>,
    /// Whether the backward may apply its first input's activation in its product
    /// (`autograd::take_activation`).
    pub(crate) applies_activation: std::sync::atomic::AtomicBool,
    /// The hooks registered on the output (`Tensor::register_hook` on a non-leaf), kept here
    /// so that they live as long as the graph, not the output tensor (PyTorch's
    /// `tensor_pre_hooks` of the grad_fn): a tensor handed on and dropped still has its hooks
    /// run when backward reaches it.
    pub(crate) hooks: Mutex<Vec<(u64, Hook)>>,
}

/// An activation whose gradient a matrix product can apply on its way out (cuBLASLt's DGELU
/// epilogue): Note [Activation epilogues] in `autograd/engine.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `gelu(x, approximate="tanh")`.
    GeluTanh,
}

/// The region of a view op's input that its output views: a layout over a row-major tensor of
/// the input's `shape`.
pub(crate) struct ViewOf {
    pub(crate) shape: crate::Shape,
    pub(crate) region: crate::layout::Layout,
}

/// Where a gradient flows: into a leaf's `.grad`, or into another node.
#[derive(Clone)]
pub(crate) enum Edge {
    Leaf(Arc<TensorImpl>),
    Node(Arc<Node>),
}

impl Edge {
    /// The edge that reaches `t`'s gradient, if `t` takes part in autograd.
    pub(crate) fn of(t: &Tensor) -> Option<Edge> {
        match &t.0.grad_fn {
            Some(node) => Some(Edge::Node(node.clone())),
            None if t.requires_grad() => Some(Edge::Leaf(t.0.clone())),
            None => None,
        }
    }

    pub(crate) fn key(&self) -> usize {
        match self {
            Edge::Leaf(t) => Arc::as_ptr(t) as *const () as usize,
            Edge::Node(n) => Arc::as_ptr(n) as *const () as usize,
        }
    }
}

impl Node {
    pub(crate) fn output(&self) -> Option<Tensor> {
        self.output.get().and_then(Weak::upgrade).map(Tensor)
    }
}

/// True when an op over `inputs` must record a node: grad mode is on and an input requires grad.
#[inline]
pub(crate) fn needs_grad(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

thread_local! {
    static SEQUENCE_NR: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The next node's sequence number on this thread (PyTorch's `sequence_nr`), below the
/// priority of leaves in the engine's ready queue (`autograd/ready_queue.rs`).
fn next_sequence_nr() -> u64 {
    SEQUENCE_NR.with(|c| {
        let n = c.get();
        c.set(n + 1);
        n
    })
}

/// Runs `f` with this thread's node numbering restarted at 0, as on a newly started thread,
/// and puts the numbering back afterwards (also when `f` panics).
///
/// Backward runs the ready node recorded last first (Note [Ready order] in `ready_queue.rs`),
/// and the numbering is per thread, as PyTorch's `sequence_nr`. Code that records shares of
/// one graph on long-lived threads and wants each share numbered as PyTorch's
/// `parallel_apply` gets from starting a thread per device on every call runs each share in
/// here: `nn::DataParallel` does, so that every replica's nodes rank below the nodes the
/// calling thread recorded after starting them, whatever the worker recorded before.
pub fn with_fresh_sequence_nr<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            SEQUENCE_NR.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(SEQUENCE_NR.with(|c| c.replace(0)));
    f()
}

/// Autograd records: only behind the dispatch point (Note [The door] in `dispatch/mod.rs`).
impl Door {
    /// Attaches a node computed by `backward` to `out`, whose inputs were `inputs`.
    ///
    /// Callers check [`needs_grad`] first so that they build the closure only when it is used.
    pub(crate) fn record<F>(self, name: &'static str, inputs: &[&Tensor], out: Tensor, backward: F) -> Tensor
    where
        F: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    {
        record_node(name, inputs, out, Box::new(backward), None, None)
    }

    /// [`Door::record`] for a cast of `input` to another dtype (see `Node::cast_from`).
    pub(crate) fn record_cast<F>(self, name: &'static str, input: &Tensor, out: Tensor, backward: F) -> Tensor
    where
        F: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    {
        let from = input.dtype();
        record_node(name, &[input], out, Box::new(backward), None, Some(from))
    }

    /// [`Door::record`] for a view op whose output views `view.region` of its one input: the
    /// engine hands the region's gradient on as a slice (Note [Gradients of views] in
    /// `engine.rs`); `backward` (the gradient written into zeros of the input's shape) is what
    /// [`Node::backward`] would compute, kept for the second-pass check.
    pub(crate) fn record_view<F>(
        self,
        name: &'static str,
        input: &Tensor,
        out: Tensor,
        view: ViewOf,
        backward: F,
    ) -> Tensor
    where
        F: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    {
        record_node(name, &[input], out, Box::new(backward), Some(view), None)
    }
}

/// The dtype `t` was cast from, when `t` is the output of a recorded cast.
pub(crate) fn cast_from(t: &Tensor) -> Option<crate::DType> {
    t.0.grad_fn.as_ref().and_then(|node| node.cast_from)
}

fn record_node(
    name: &'static str,
    inputs: &[&Tensor],
    out: Tensor,
    backward: BackwardFn,
    view: Option<ViewOf>,
    cast_from: Option<crate::DType>,
) -> Tensor {
    let node = Arc::new(Node {
        name,
        edges: inputs.iter().map(|t| Edge::of(t)).collect(),
        backward: Mutex::new(Some(backward)),
        output: OnceLock::new(),
        sequence_nr: next_sequence_nr(),
        view,
        cast_from,
        accumulates: std::sync::atomic::AtomicBool::new(false),
        activation: OnceLock::new(),
        applies_activation: std::sync::atomic::AtomicBool::new(false),
        hooks: Mutex::new(Vec::new()),
    });
    let out = out.with_grad_fn(node.clone());
    let _ = node.output.set(Arc::downgrade(&out.0));
    out
}

/// Makes `output` the result of a differentiable op over `inputs` whose input gradients
/// `backward` computes, as a `torch.autograd.Function` does: a fused kernel, or a function
/// that recomputes instead of storing, joins the graph like a built-in op.
///
/// `output` is computed by the caller (under [`no_grad`](crate::no_grad) or from detached inputs: it is
/// detached here either way). `backward` receives the gradient of `output` and, per input,
/// whether that input needs a gradient; it returns one entry per input, `None` where none is
/// needed or the gradient is zero, each of the input's shape. When grad mode is off or no input
/// requires a gradient, `output` is returned as it is and `backward` is dropped.
///
/// ```
/// use ember_core::{autograd, Device, Tensor};
/// // y = 3x with a hand-written backward.
/// let x = Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)?.requires_grad_(true)?;
/// let y = autograd::custom_op("triple", &[&x], x.detach().mul_scalar(3.0)?, |g, _| {
///     Ok(vec![Some(g.mul_scalar(3.0)?)])
/// });
/// y.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3.0, 3.0]);
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn custom_op<F>(name: &'static str, inputs: &[&Tensor], output: Tensor, backward: F) -> Tensor
where
    F: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    let output = output.detach();
    if !needs_grad(inputs) {
        return output;
    }
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.dims().to_vec()).collect();
    let backward = move |grad: &Tensor, needs: &[bool]| {
        let grads = backward(grad, needs)?;
        for (i, (g, shape)) in grads.iter().zip(&shapes).enumerate() {
            if let Some(g) = g.as_ref().filter(|g| g.dims() != shape.as_slice()) {
                return Err(Error::Autograd(format!(
                    "{name}: the gradient of input {i} has shape {:?}, but the input has shape {shape:?}",
                    g.dims()
                )));
            }
        }
        Ok(grads)
    };
    record_node(name, inputs, output, Box::new(backward), None, None)
}

/// A tensor kept for backward, with the storage version it had when saved.
#[derive(Clone)]
pub(crate) struct SavedTensor {
    tensor: Tensor,
    version: u64,
    op: &'static str,
}

impl SavedTensor {
    pub(crate) fn new(op: &'static str, t: &Tensor) -> SavedTensor {
        // Detached, so that saving an op's own output makes no reference cycle through the node.
        SavedTensor {
            tensor: t.detach(),
            version: t.0.storage.version(),
            op,
        }
    }

    /// The saved tensor, or an error if it was modified in place since it was saved.
    pub(crate) fn get(&self) -> Result<&Tensor> {
        let found = self.tensor.0.storage.version();
        if found != self.version {
            return Err(Error::InplaceModified {
                op: self.op,
                expected: self.version,
                found,
            });
        }
        Ok(&self.tensor)
    }
}
