//! `torch.cuda.make_graphed_callables`: a differentiable function's forward and backward, each
//! captured once into a CUDA graph, behind a callable that replays them inside autograd, so a
//! model part runs graphed while the rest of the training step (data loading, logging, an
//! optimizer that reads the host) stays eager.
//!
//! Note [Graphed callables]: as PyTorch's `_make_graphed_callables`:
//! - every callable is warmed up (`num_warmup_iters` forward and `autograd::grad` passes on a
//!   side stream: kernels load and libraries set up outside any capture);
//! - the forwards are captured in order, then the backwards in reverse order, all into one
//!   memory pool, so that a backward captured later may reuse what an earlier-captured one
//!   freed: the replays run in the same order (forwards, then backwards in reverse), which is
//!   the order a training step runs them;
//! - a backward graph computes `autograd::grad` of the captured output, weighted by a static
//!   gradient tensor, with respect to the arguments and parameters that require grad; the
//!   gradients land in static tensors of the pool;
//! - a call copies its arguments into the static ones (unless they are those very tensors),
//!   replays the forward graph and returns the static output, detached and joined to autograd
//!   through a node whose backward copies the incoming gradient into the static gradient,
//!   replays the backward graph and returns the static input gradients. The autograd engine
//!   copies a gradient it did not make before storing it as a parameter's `.grad`, so
//!   accumulating over several backward passes sums correctly.
//!
//! The output of a call is the static output itself, as in PyTorch: the next call overwrites
//! it. Clone it to keep it. Calls must use arguments of the sample arguments' shapes, dtypes
//! and device; anything else is an error.

use super::graph::{graph_pool_handle, graph_with, CUDAGraph, GraphOptions};
use crate::autograd::{self, custom_op};
use crate::cuda_backend::allocator::MempoolId;
use crate::cuda_backend::stream::{current_stream, stream, Stream};
use crate::{Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

const OP: &str = "make_graphed_callables";

/// One function to graph, with what it is captured with (one entry of PyTorch's `callables` and
/// `sample_args`).
pub struct Callable<'f> {
    /// The function: its arguments in, one tensor out.
    pub func: &'f dyn Fn(&[Tensor]) -> Result<Tensor>,
    /// Arguments of the shapes, dtypes and device of every later call, on one CUDA device; those
    /// that require grad get gradients.
    pub sample_args: Vec<Tensor>,
    /// The parameters the function reads (a module's `parameters()`): they receive gradients in
    /// `.grad`, as with the eager function. Each must require grad.
    pub params: Vec<Tensor>,
}

/// Options of [`make_graphed_callables`] (its keyword arguments in PyTorch).
#[derive(Clone, Copy, Debug)]
pub struct GraphedOptions {
    /// Forward and backward passes run before capture (3).
    pub num_warmup_iters: usize,
    /// Allow arguments or parameters the output does not depend on (their gradient is `None`);
    /// false makes them an error, as in PyTorch.
    pub allow_unused_input: bool,
    /// The memory pool to capture into; None: a new one shared by all the graphs made here.
    pub pool: Option<MempoolId>,
}

impl Default for GraphedOptions {
    fn default() -> Self {
        GraphedOptions {
            num_warmup_iters: 3,
            allow_unused_input: false,
            pool: None,
        }
    }
}

/// The captured graphs and static tensors of one graphed callable.
struct Graphed {
    /// In a mutex because a graph is not `Sync` (one graph is never launched from two threads
    /// at once), and a callable is shared with autograd nodes that run on any thread.
    forward: Mutex<CUDAGraph>,
    backward: Mutex<CUDAGraph>,
    static_args: Vec<Tensor>,
    /// The arguments, then the parameters: the inputs of the autograd node.
    surface: Vec<Tensor>,
    static_output: Tensor,
    /// `None` when the output does not require grad (no backward graph then).
    static_grad_output: Option<Tensor>,
    /// One per entry of `surface`: its gradient, `None` where it needs none or is unused.
    static_grad_inputs: Vec<Option<Tensor>>,
}

/// A function whose forward and backward replay CUDA graphs; made by
/// [`make_graphed_callables`]. See Note [Graphed callables].
#[derive(Clone)]
pub struct GraphedCallable(Arc<Graphed>);

impl std::fmt::Debug for GraphedCallable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphedCallable")
            .field("args", &self.0.static_args.len())
            .field("params", &(self.0.surface.len() - self.0.static_args.len()))
            .finish()
    }
}

/// A graph's lock; a replay that panicked left nothing half-done on the host.
fn lock(g: &Mutex<CUDAGraph>) -> MutexGuard<'_, CUDAGraph> {
    g.lock().unwrap_or_else(|e| e.into_inner())
}

/// Checks the arguments of a call against the captured ones.
fn check_args(args: &[Tensor], static_args: &[Tensor]) -> Result<()> {
    if args.len() != static_args.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "the graphed callable takes {} arguments, as its sample arguments, but got {}",
                static_args.len(),
                args.len()
            ),
        ));
    }
    for (i, (a, s)) in args.iter().zip(static_args).enumerate() {
        if a.dims() != s.dims() || a.dtype() != s.dtype() || a.device() != s.device() {
            return Err(Error::invalid(
                OP,
                format!(
                    "argument {i} is {} {:?} on {}, but the graph was captured with {} {:?} on {}: a graphed \
                     callable replays fixed shapes; graph one callable per shape, or call the function eagerly",
                    a.dtype(),
                    a.dims(),
                    a.device(),
                    s.dtype(),
                    s.dims(),
                    s.device()
                ),
            ));
        }
    }
    Ok(())
}

impl GraphedCallable {
    /// Replays the forward graph on `args` (copied into the static arguments) and returns the
    /// static output (overwritten by the next call: clone it to keep it). With grad mode on and
    /// an output that requires grad, the output joins autograd: its backward replays the
    /// backward graph and hands the gradients to the arguments and parameters.
    pub fn call(&self, args: &[Tensor]) -> Result<Tensor> {
        let g = &self.0;
        check_args(args, &g.static_args)?;
        {
            let _no_grad = autograd::no_grad();
            for (s, a) in g.static_args.iter().zip(args) {
                if s.data_ptr() != a.data_ptr() {
                    s.copy_(a)?;
                }
            }
        }
        lock(&g.forward).replay()?;
        let output = g.static_output.detach();
        if g.static_grad_output.is_none() || !autograd::is_grad_enabled() {
            return Ok(output);
        }
        // The node's inputs: the call's arguments (the autograd graph continues through them)
        // and the parameters.
        let params = &g.surface[g.static_args.len()..];
        let inputs: Vec<&Tensor> = args.iter().chain(params).collect();
        let inner = Arc::clone(&self.0);
        Ok(custom_op("Graphed", &inputs, output, move |grad, _| {
            let static_grad = inner
                .static_grad_output
                .as_ref()
                .expect("only outputs that require grad get a backward");
            if static_grad.data_ptr() != grad.data_ptr() {
                let _no_grad = autograd::no_grad();
                static_grad.copy_(grad)?;
            }
            lock(&inner.backward).replay()?;
            Ok(inner
                .static_grad_inputs
                .iter()
                .map(|g| g.as_ref().map(Tensor::detach))
                .collect())
        }))
    }
}

/// The CUDA device of a callable's tensors, all of which must be on it.
fn device_of(c: &Callable<'_>, i: usize) -> Result<usize> {
    let mut device = None;
    for t in c.sample_args.iter().chain(&c.params) {
        match (t.device(), device) {
            (Device::Cpu, _) => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "callable {i} has a CPU tensor among its sample arguments or parameters: CUDA graphs \
                         capture CUDA work; move the module and the sample arguments to the GPU"
                    ),
                ))
            }
            (Device::Cuda(d), None) => device = Some(d),
            (Device::Cuda(d), Some(e)) if d != e => {
                return Err(Error::DeviceMismatch {
                    op: OP,
                    lhs: Device::Cuda(e),
                    rhs: Device::Cuda(d),
                })
            }
            _ => {}
        }
    }
    device.ok_or_else(|| {
        Error::invalid(
            OP,
            format!("callable {i} has neither sample arguments nor parameters: there is nothing to graph"),
        )
    })
}

/// One forward and `autograd::grad` pass of `c`, as captured: the gradient of the output (if
/// it requires grad) weighted by `grad_output` (a new uninitialized tensor when `None`, as
/// PyTorch's warm-up) with respect to the surface entries that require grad.
fn forward_backward(
    c: &Callable<'_>,
    i: usize,
    options: &GraphedOptions,
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let output = (c.func)(&c.sample_args)?;
    let grads = backward_of(c, i, &output, None, options)?;
    Ok((output, grads))
}

/// `autograd::grad` of `output` weighted by `grad_output` (or an uninitialized tensor) with
/// respect to `c`'s arguments and parameters that require grad; one entry per argument and
/// parameter.
fn backward_of(
    c: &Callable<'_>,
    i: usize,
    output: &Tensor,
    grad_output: Option<&Tensor>,
    options: &GraphedOptions,
) -> Result<Vec<Option<Tensor>>> {
    let surface: Vec<&Tensor> = c.sample_args.iter().chain(&c.params).collect();
    if !output.requires_grad() {
        return Ok(vec![None; surface.len()]);
    }
    let wanted: Vec<Tensor> = surface
        .iter()
        .filter(|t| t.requires_grad())
        .map(|t| (*t).clone())
        .collect();
    // The warm-up's gradient: zeros, where PyTorch's `make_graphed_callables` passes
    // `empty_like` (its values are never used): compute-sanitizer's initcheck reported the
    // warm-up's products reading it as uninitialized memory (session 54).
    let grad_output = match grad_output {
        Some(g) => g.clone(),
        None => output.zeros_like()?,
    };
    let mut grads =
        autograd::grad(std::slice::from_ref(output), &wanted, Some(&[grad_output]), false)?.into_iter();
    let mut out = Vec::with_capacity(surface.len());
    for (k, t) in surface.iter().enumerate() {
        if !t.requires_grad() {
            out.push(None);
            continue;
        }
        let g = grads.next().flatten();
        if g.is_none() && !options.allow_unused_input {
            let what = if k < c.sample_args.len() {
                format!("argument {k}")
            } else {
                format!("parameter {}", k - c.sample_args.len())
            };
            return Err(Error::invalid(
                OP,
                format!(
                    "the output of callable {i} does not depend on its {what}, which requires grad: set \
                     GraphedOptions::allow_unused_input if this is intended"
                ),
            ));
        }
        out.push(g);
    }
    Ok(out)
}

/// Captures each callable's forward and backward into CUDA graphs and returns one
/// [`GraphedCallable`] per callable, in order (`torch.cuda.make_graphed_callables`); see Note
/// [Graphed callables]. The callables' graphs share one memory pool, so call the graphed
/// callables in the order given, as one training step would, and run their backwards in reverse.
///
/// Errors: a parameter that does not require grad, CPU tensors, tensors on several devices, an
/// unused argument or parameter without `allow_unused_input`, and whatever the capture refuses
/// (Note [Operations refused during capture] in `capture.rs`): a function that reads values back
/// to the host cannot be graphed.
///
/// ```no_run
/// use ember_core::cuda::{make_graphed_callables, Callable, GraphedOptions};
/// use ember_core::{DType, Device, Tensor};
/// # fn main() -> ember_core::Result<()> {
/// let d = Device::Cuda(0);
/// let w = Tensor::randn([64, 32], DType::F32, d)?.requires_grad_(true)?;
/// let f = |x: &[Tensor]| x[0].matmul(&w)?.relu();
/// let sample = vec![Tensor::randn([16, 64], DType::F32, d)?];
/// let graphed = make_graphed_callables(
///     &[Callable { func: &f, sample_args: sample, params: vec![w.clone()] }],
///     GraphedOptions::default(),
/// )?;
/// let y = graphed[0].call(&[Tensor::randn([16, 64], DType::F32, d)?])?;
/// y.sum_all()?.backward()?; // replays the backward graph; w.grad() is set
/// # Ok(())
/// # }
/// ```
pub fn make_graphed_callables(
    callables: &[Callable<'_>],
    options: GraphedOptions,
) -> Result<Vec<GraphedCallable>> {
    let mut devices = Vec::with_capacity(callables.len());
    for (i, c) in callables.iter().enumerate() {
        if let Some(k) = c.params.iter().position(|p| !p.requires_grad()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "parameter {k} of callable {i} does not require grad: graphed callables hand gradients to \
                     every parameter they are given; leave frozen parameters out of `params`"
                ),
            ));
        }
        devices.push(device_of(c, i)?);
    }
    let Some(&device) = devices.first() else {
        return Ok(Vec::new());
    };
    if let Some(&other) = devices.iter().find(|&&d| d != device) {
        return Err(Error::DeviceMismatch {
            op: OP,
            lhs: Device::Cuda(device),
            rhs: Device::Cuda(other),
        });
    }

    // Warm up on a side stream (PyTorch synchronizes around it).
    crate::cuda_backend::synchronize(device)?;
    {
        let previous = current_stream(device)?;
        let side = Stream::new_on(device)?;
        side.wait_stream(&previous)?;
        {
            let _s = stream(&side);
            for (i, c) in callables.iter().enumerate() {
                for _ in 0..options.num_warmup_iters {
                    drop(forward_backward(c, i, &options)?);
                }
            }
        }
        previous.wait_stream(&side)?;
    }
    crate::cuda_backend::synchronize(device)?;

    let pool = options.pool.unwrap_or_else(graph_pool_handle);
    let capture = |g: &mut CUDAGraph, body: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        let guard = graph_with(
            g,
            GraphOptions {
                pool: Some(pool),
                ..Default::default()
            },
        )?;
        let ran = body();
        let ended = guard.end();
        ran.and(ended)
    };

    // Forwards in order.
    let mut forwards = Vec::with_capacity(callables.len());
    for c in callables {
        let mut g = CUDAGraph::new();
        let mut output = None;
        capture(&mut g, &mut || {
            output = Some((c.func)(&c.sample_args)?);
            Ok(())
        })?;
        forwards.push((g, output.expect("set when the capture succeeded")));
    }

    // Backwards in reverse order.
    let mut backwards: Vec<Option<(CUDAGraph, Option<Tensor>, Vec<Option<Tensor>>)>> =
        callables.iter().map(|_| None).collect();
    for (i, c) in callables.iter().enumerate().rev() {
        let output = &forwards[i].1;
        let static_grad_output = if output.requires_grad() {
            Some(output.empty_like()?)
        } else {
            None
        };
        let mut g = CUDAGraph::new();
        let mut grads = Vec::new();
        if static_grad_output.is_some() {
            capture(&mut g, &mut || {
                grads = backward_of(c, i, output, static_grad_output.as_ref(), &options)?;
                Ok(())
            })?;
        } else {
            grads = vec![None; c.sample_args.len() + c.params.len()];
        }
        backwards[i] = Some((g, static_grad_output, grads));
    }

    Ok(callables
        .iter()
        .zip(forwards)
        .zip(backwards)
        .map(|((c, (forward, output)), backward)| {
            let (backward, static_grad_output, static_grad_inputs) =
                backward.expect("every backward was captured");
            GraphedCallable(Arc::new(Graphed {
                forward: Mutex::new(forward),
                backward: Mutex::new(backward),
                static_args: c.sample_args.clone(),
                surface: c.sample_args.iter().chain(&c.params).cloned().collect(),
                static_output: output.detach(),
                static_grad_output,
                static_grad_inputs,
            }))
        })
        .collect())
}
