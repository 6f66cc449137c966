//! The backward pass: a topological walk from the roots that sums the gradients reaching each
//! node before calling its backward closure once, then accumulates into leaves. Ready entries
//! run in the order of Note [Ready order] (`ready_queue.rs`); leaves' post-accumulate hooks and
//! the final callbacks run as `callbacks.rs` says.

use super::callbacks::{
    post_accumulate_grad_hooks, run_post_accumulate_grad_hooks, Frame, PostAccumulateGradHook,
};
use super::ready_queue::ReadyQueue;
use super::{Edge, Node};
use crate::tensor::TensorImpl;
use crate::{Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Gradients of `outputs` (weighted by `grad_outputs`) with respect to `inputs`, without
/// touching any `.grad` (as `torch.autograd.grad`). An input that the outputs do not depend on
/// gets `None`. The graph is kept when `retain_graph` is true.
pub fn grad(
    outputs: &[Tensor],
    inputs: &[Tensor],
    grad_outputs: Option<&[Tensor]>,
    retain_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let roots = roots_with_grads(outputs, grad_outputs)?;
    let targets = inputs
        .iter()
        .map(|t| {
            Edge::of(t).map(|e| e.key()).ok_or_else(|| {
                Error::Autograd(
                    "one of the inputs does not require grad; call requires_grad_(true) on it".into(),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    run_backward(roots, retain_graph, Some(&targets))
}

/// Pairs each output with its upstream gradient (ones for a scalar output when none given).
pub(crate) fn roots_with_grads(
    outputs: &[Tensor],
    grad_outputs: Option<&[Tensor]>,
) -> Result<Vec<(Tensor, Tensor)>> {
    match grad_outputs {
        Some(g) if g.len() != outputs.len() => Err(Error::Autograd(format!(
            "got {} outputs but {} gradients for them",
            outputs.len(),
            g.len()
        ))),
        Some(g) => Ok(outputs.iter().cloned().zip(g.iter().cloned()).collect()),
        None => outputs
            .iter()
            .map(|o| {
                if o.numel() != 1 {
                    return Err(Error::Autograd(format!(
                        "grad can be implicitly created only for scalar outputs, but the output has shape {}; pass a gradient of the same shape",
                        o.shape()
                    )));
                }
                Ok((o.clone(), o.ones_like()?))
            })
            .collect(),
    }
}

struct Pending {
    deps: usize,
    grad: Option<Tensor>,
    edge: Edge,
}

/// Runs backward from `roots`. Without `capture`, gradients accumulate into the leaves'
/// `.grad`; with it, the gradient reaching each captured key is returned instead and no
/// `.grad` changes.
pub(crate) fn run_backward(
    roots: Vec<(Tensor, Tensor)>,
    retain_graph: bool,
    capture: Option<&[usize]>,
) -> Result<Vec<Option<Tensor>>> {
    let _no_grad = super::no_grad();
    let frame = Frame::enter();
    let mut pending: HashMap<usize, Pending> = HashMap::new();
    let mut root_edges = Vec::with_capacity(roots.len());
    for (i, (t, g)) in roots.into_iter().enumerate() {
        let edge = Edge::of(&t).ok_or_else(|| {
            Error::Autograd(format!(
                "element {i} of tensors does not require grad and does not have a grad_fn"
            ))
        })?;
        if g.shape() != t.shape() {
            return Err(Error::ShapeMismatch {
                op: "backward",
                lhs: t.shape().clone(),
                rhs: g.shape().clone(),
                hint: "the gradient must have the output's shape",
            });
        }
        root_edges.push((edge, g));
    }
    count_dependencies(root_edges.iter().map(|(e, _)| e.clone()), &mut pending);
    let mut ready = ReadyQueue::default();
    let mut ready_roots = Vec::new();
    for (edge, g) in root_edges {
        let p = pending.get_mut(&edge.key()).expect("counted above");
        p.grad = Some(accumulate(p.grad.take(), g)?);
        if p.deps == 0 && !ready_roots.contains(&edge.key()) {
            ready_roots.push(edge.key());
            ready.push(edge.priority(), edge.key());
        }
    }
    let mut captured: HashMap<usize, Tensor> = HashMap::new();
    while let Some(key) = ready.pop() {
        let p = pending.remove(&key).expect("ready keys are pending");
        match (p.edge, p.grad) {
            (Edge::Leaf(leaf), Some(grad)) => {
                let grad = apply_hooks(&leaf, grad)?;
                match capture {
                    Some(c) if c.contains(&key) => {
                        captured.insert(key, grad);
                    }
                    Some(_) => {}
                    None => {
                        let hooks = accumulate_leaf(&leaf, grad)?;
                        if !hooks.is_empty() {
                            run_post_accumulate_grad_hooks(&Tensor(leaf), hooks)?;
                        }
                    }
                }
            }
            // Reached, but every path's gradient was left out as zero: the hooks still run.
            (Edge::Leaf(leaf), None) if capture.is_none() => {
                let hooks = post_accumulate_grad_hooks(&leaf);
                if !hooks.is_empty() {
                    run_post_accumulate_grad_hooks(&Tensor(leaf), hooks)?;
                }
            }
            (Edge::Leaf(_), None) => {}
            (Edge::Node(node), grad) => {
                // A node that no gradient reached still releases its inputs' dependencies.
                let input_grads = match grad {
                    Some(grad) => {
                        let grad = match node.output() {
                            Some(out) => {
                                let grad = apply_hooks(&out.0, grad)?;
                                if capture.is_none() && out.retains_grad() {
                                    accumulate_leaf(&out.0, grad.clone())?;
                                }
                                grad
                            }
                            None => grad,
                        };
                        if capture.is_some_and(|c| c.contains(&key)) {
                            captured.insert(key, grad.clone());
                        }
                        call_backward(&node, &grad, retain_graph)?
                    }
                    None => vec![None; node.edges.len()],
                };
                for (edge, g) in node.edges.iter().zip(input_grads) {
                    let Some(edge) = edge else { continue };
                    let p = pending.get_mut(&edge.key()).expect("counted above");
                    if let Some(g) = g {
                        p.grad = Some(accumulate(p.grad.take(), g)?);
                    }
                    p.deps -= 1;
                    if p.deps == 0 {
                        ready.push(edge.priority(), edge.key());
                    }
                }
            }
        }
    }
    frame.finish()?;
    Ok(match capture {
        Some(c) => c.iter().map(|k| captured.remove(k)).collect(),
        None => Vec::new(),
    })
}

/// Fills `pending` with every node and leaf reachable from `roots` and the number of edges
/// that reach it.
fn count_dependencies(roots: impl Iterator<Item = Edge>, pending: &mut HashMap<usize, Pending>) {
    let mut stack: Vec<Edge> = Vec::new();
    for edge in roots {
        if let std::collections::hash_map::Entry::Vacant(v) = pending.entry(edge.key()) {
            v.insert(Pending {
                deps: 0,
                grad: None,
                edge: edge.clone(),
            });
            stack.push(edge);
        }
    }
    while let Some(edge) = stack.pop() {
        let Edge::Node(node) = edge else { continue };
        for next in node.edges.iter().flatten() {
            let entry = pending.entry(next.key()).or_insert_with(|| {
                stack.push(next.clone());
                Pending {
                    deps: 0,
                    grad: None,
                    edge: next.clone(),
                }
            });
            entry.deps += 1;
        }
    }
}

fn call_backward(node: &Arc<Node>, grad: &Tensor, retain_graph: bool) -> Result<Vec<Option<Tensor>>> {
    let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
    let Some(backward) = slot.as_ref() else {
        return Err(Error::Autograd(format!(
            "trying to backward through the graph a second time (through {}); pass retain_graph=true to the first backward",
            node.name
        )));
    };
    let needs: Vec<bool> = node.edges.iter().map(Option::is_some).collect();
    let grads = {
        let _range = crate::profiler::backward_range(node.name, grad.device());
        backward(grad, &needs)?
    };
    if grads.len() != node.edges.len() {
        return Err(Error::Autograd(format!(
            "{} returned {} gradients for {} inputs",
            node.name,
            grads.len(),
            node.edges.len()
        )));
    }
    if !retain_graph {
        *slot = None;
    }
    Ok(grads)
}

fn apply_hooks(t: &Arc<TensorImpl>, mut grad: Tensor) -> Result<Tensor> {
    let hooks = t.meta().hooks.clone();
    for (_, hook) in hooks {
        if let Some(g) = hook(&grad)? {
            grad = g;
        }
    }
    Ok(grad)
}

fn accumulate(acc: Option<Tensor>, g: Tensor) -> Result<Tensor> {
    match acc {
        None => Ok(g),
        Some(a) => a.add(&g),
    }
}

/// Stores `grad` into `leaf`'s `.grad` (summing with what is there); returns the leaf's
/// post-accumulate-grad hooks to run, read under the same lock (none: no allocation).
fn accumulate_leaf(leaf: &Arc<TensorImpl>, grad: Tensor) -> Result<Vec<PostAccumulateGradHook>> {
    let mut meta = leaf.meta();
    let grad = match meta.grad.take() {
        Some(old) => old.add(&grad)?,
        // A stored gradient owns dense memory that nothing else sees: a broadcast view (from
        // sum's backward) or a tensor the caller still holds (the gradient given to
        // backward) is copied, as PyTorch's AccumulateGrad does; a fresh one is kept as is.
        None => {
            // Moved, not converted, when the dtype already matches: `to_dtype` would hand back
            // a second handle, and the count below would always see two.
            let grad = match grad.dtype() == leaf.dtype {
                true => grad,
                false => grad.to_dtype(leaf.dtype)?,
            };
            if grad.is_contiguous() && Arc::strong_count(&grad.0) == 1 && grad.storage().is_unique() {
                grad
            } else {
                grad.deep_clone()?
            }
        }
    };
    meta.grad = Some(grad);
    Ok(meta
        .post_accumulate_grad_hooks
        .iter()
        .map(|(_, h)| h.clone())
        .collect())
}
