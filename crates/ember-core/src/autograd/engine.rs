//! The backward pass: a topological walk from the roots that sums the gradients reaching each
//! node before calling its backward closure once, then accumulates into leaves. Ready entries
//! run in the order of Note [Ready order] (`ready_queue.rs`); leaves' post-accumulate hooks and
//! the final callbacks run as `callbacks.rs` says.
//!
//! Note [Device threads]: as in PyTorch's engine, the part of a graph that lies on another GPU
//! runs on a thread of that GPU, so that the host work of launching each device's kernels
//! overlaps (a model whose layers are spread over GPUs). `nn::DataParallel` used these
//! threads for its replicas' backward; it now runs each replica's pass on its own worker
//! (Note [DataParallel backward] in ember-nn).
//! - The calling thread runs the nodes whose gradient lies on the device of the first root's
//!   gradient (the "home" device) or on the CPU, every leaf (so `.grad`, post-accumulate
//!   hooks and final callbacks stay where Note [Final callbacks] wants them), and every node
//!   whose output has hooks or retains its gradient.
//! - A node whose incoming gradient lies on another GPU goes to that GPU's queue, drained by
//!   the GPU's thread (`device_threads.rs`: one per GPU, started on first use, kept for the
//!   life of the process) under `no_grad` and with the caller's current streams; each queue
//!   runs in Note [Ready order]. A graph on one device never leaves the calling thread, so
//!   its order and cost are those of a single-threaded walk.
//! - Dependencies and pending gradients live behind one lock per pass; summing two
//!   gradients of one entry and running a backward function both happen outside it (Note
//!   [Sums outside the task lock]).
//! - A backward started on a device thread (a checkpoint recomputing inside a node) runs
//!   entirely on that thread, so device threads never wait for one another.
//! - The first error, or a panic on a device thread, stops every thread from taking new
//!   entries; backward returns it once the entries already running have finished.

use super::callbacks::{
    post_accumulate_grad_hooks, run_post_accumulate_grad_hooks, Frame, PostAccumulateGradHook,
};
use super::device_threads;
use super::ready_queue::ReadyQueue;
use super::{Edge, Node};
use crate::dispatch::tensor_impl::{Hook, TensorImpl};
use crate::{Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

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
    grad: Option<Grad>,
    edge: Edge,
    /// The gradient is already past this entry's node: its consumer's product applied the
    /// node's activation (Note [Activation epilogues]); it goes on to the node's input as it is.
    through: bool,
}

/// Note [Gradients of views]: the gradient a view op (`narrow`, `slice`, `select`) hands its
/// input is zero but for the viewed region. Written out (zeros of the input's shape, the region
/// copied in) and summed with the other views' (`split`: q, k and v of one projection), each
/// costs a memset and a copy of the whole input and every sum a full add; in GPT-2's step that
/// was 1.6 of 20.4 ms of GPU time, where PyTorch's `split` is one node whose backward is one
/// `cat`; with slices the step's GPU time was 19.4 ms and its wall time 20.2 ms, from 21.5
/// (docs/benchmarks.md, session 44). So the engine carries such a gradient as the slice it is
/// (`Grad::Slices`), sums slices by listing them, and writes the input's gradient out only when
/// the entry runs: when the regions are blocks of one dim that tile the input (the pieces of a
/// split), into uninitialized memory with one copy each (on a GPU, one `foreach_copy_` launch
/// for them all when every piece and its slot are contiguous: FSDP's gathered buffer gets its
/// gradient from its parameters' pieces, 12 copies a GPT-2 block before), or with none where
/// the pieces are already views of one buffer laid out as the input (fused attention's q, k and v
/// gradients); otherwise into zeros, adding each region in place (regions may overlap). A slice
/// meeting a dense gradient is written out and added as before.
enum Grad {
    Dense(Tensor),
    /// Zero but for `parts`: each the gradient of its region, a layout over a row-major tensor
    /// of `shape`.
    Slices {
        shape: crate::Shape,
        parts: Vec<(crate::layout::Layout, Tensor)>,
    },
}

impl Grad {
    fn device(&self) -> Device {
        match self {
            Grad::Dense(t) => t.device(),
            Grad::Slices { parts, .. } => parts[0].1.device(),
        }
    }

    /// The sum of two gradients of one entry.
    fn add(self, other: Grad) -> Result<Grad> {
        Ok(match (self, other) {
            (Grad::Slices { shape, mut parts }, Grad::Slices { shape: s2, parts: p2 }) if shape == s2 => {
                parts.extend(p2);
                Grad::Slices { shape, parts }
            }
            (a, b) => Grad::Dense(a.into_dense()?.add(&b.into_dense()?)?),
        })
    }

    /// The gradient as one tensor (Note [Gradients of views]).
    fn into_dense(self) -> Result<Tensor> {
        let (shape, parts) = match self {
            Grad::Dense(t) => return Ok(t),
            Grad::Slices { shape, parts } => (shape, parts),
        };
        let (dtype, device) = (parts[0].1.dtype(), parts[0].1.device());
        if parts
            .iter()
            .any(|(_, g)| g.dtype() != dtype || g.device() != device)
        {
            let mut sum: Option<Tensor> = None;
            for part in parts {
                let one = Grad::Slices {
                    shape: shape.clone(),
                    parts: vec![part],
                }
                .into_dense()?;
                sum = Some(match sum {
                    Some(s) => s.add(&one)?,
                    None => one,
                });
            }
            return Ok(sum.expect("a slice gradient has parts"));
        }
        let tiles = tile_one_dim(&shape, &parts);
        if tiles && written_in_place(&parts) {
            // The pieces already lie where they belong in one buffer (Note [Attention gradients
            // in one buffer] in `ops/attention.rs`): that buffer is the gradient.
            return Ok(parts[0].1.view_with(crate::layout::Layout::contiguous(shape)));
        }
        let out = if tiles {
            Tensor::empty(shape, dtype, device)?
        } else {
            Tensor::zeros(shape, dtype, device)?
        };
        if tiles && device.is_cuda() && parts.len() > 1 {
            let slots: Vec<Tensor> = parts.iter().map(|(r, _)| out.view_with(r.clone())).collect();
            let plain = |t: &Tensor| t.is_contiguous() && !t.requires_grad();
            if slots.iter().all(plain) && parts.iter().all(|(_, g)| plain(g)) {
                let pieces: Vec<Tensor> = parts.into_iter().map(|(_, g)| g).collect();
                crate::foreach_copy_(&slots, &pieces)?;
                return Ok(out);
            }
        }
        for (region, g) in &parts {
            if tiles {
                let src = g.storage().read();
                out.storage()
                    .write()
                    .copy_strided_from(region, &src, g.layout())?;
            } else {
                out.view_with(region.clone()).add_(g)?;
            }
        }
        Ok(out)
    }
}

/// Note [Activation epilogues]: in a transformer's MLP, `fc2(gelu(fc(x)))`, the backward of
/// `fc2` computes the gradient of the GELU's output with a product (dh = g @ W2) and the GELU's
/// node then reads dh and its saved input a and writes da: on GPT-2's [8192, 3072] bf16 that
/// is a 50 MB write and a 150 MB pass a layer. cuBLASLt's DGELU epilogue multiplies the
/// product by gelu'(a) before it rounds (a = the epilogue's aux matrix), so the product writes
/// da itself: on an H200, 52.0 µs for the product and 40.1 for GELU's backward kernel, 74.6 µs
/// fused, with each call's fastest algorithm, in a microbenchmark whose aux stayed in L2; in
/// GPT-2's step, where a comes from HBM, 94 µs against 51 + 49 (0.06 ms a step;
/// docs/benchmarks.md, session 46). An activation's
/// node is marked with `mark_activation` (the tanh GELU, whose derivative is cuBLASLt's), and
/// a product's node that can apply one with `mark_applies_activation` (`linear` with a bias).
/// When the product's node runs and its first input is such an activation's output, the
/// engine offers it the activation (`take_activation`) if the product's gradient is the only
/// one that output will get (its entry waits for this node alone) and nothing may see that
/// gradient (no hook, no retained grad, not captured by `autograd::grad`). A node that takes
/// it returns the gradient of the activation's input; the engine marks the activation's entry
/// `through`, and when it runs it hands the gradient on to the activation's input without
/// calling its backward. Backends without the epilogue (the CPU), and float32 (where the
/// epilogue's derivative was 1.7e-5 from the f64-evaluated one of GELU's kernel, against
/// float32's 6e-8; bfloat16 and float16 round far above that), take the product and GELU's
/// backward kernel inside the product's node: the same bits as before. `linear` records one
/// node over its own input and weight (no reshape or transpose node in between), so that the
/// GELU is its first input's node.

/// Note [Gradients added in place]: a tensor used twice gets two gradients, and the engine sums
/// them with an add when the second arrives. On GPT-2's residual stream (`x + attn(ln(x))`)
/// that is 24 adds of [8192, 768] float32 a step: the residual's gradient waits while the
/// branch's runs back through LayerNorm, whose backward then writes its own dx and the add
/// reads both and writes a third buffer. A node marked with `mark_accumulating` is offered the
/// gradient already waiting for its first input, when nothing else holds it (`is_private`: not
/// a tensor the user or a hook can see, not a view); its backward may take it
/// (`take_accumulator`), add its own dx into it in the same kernel that computes dx, and return
/// it, so the entry holds the sum and no add runs. One not taken goes back into the entry.
/// LayerNorm's backward does this (`ops/norm.rs`), as llm.c's `layernorm_backward` adds into
/// `dinp`. The sum rounds once instead of twice. A gradient that others hold (a root's
/// gradient the user passed, one an add's backward handed to both its inputs) is offered too,
/// marked read-only: `take_addend` takes it, and LayerNorm's backward then writes `it + dx` to
/// a new buffer in its one kernel (`autograd::take_accumulator` never hands it out, so the
/// index ops, which only write in place, leave it to the engine's add).

/// Whether every part is a view of one storage laid out exactly as its region: the regions
/// being over a row-major tensor from element 0, that storage from element 0 is the tensor.
fn written_in_place(parts: &[(crate::layout::Layout, Tensor)]) -> bool {
    let first = &parts[0].1;
    parts
        .iter()
        .all(|(region, g)| g.shares_storage_with(first) && g.layout() == region)
}

/// Whether `parts`' regions are blocks along one dim of a row-major `shape` (every other dim
/// whole) that cover it exactly once: the pieces of a `split` or `chunk`.
fn tile_one_dim(shape: &crate::Shape, parts: &[(crate::layout::Layout, Tensor)]) -> bool {
    let full = crate::layout::Layout::contiguous(shape.clone());
    let (dims, strides) = (full.dims(), full.strides());
    let Some(first) = parts.first() else { return false };
    if dims.is_empty() {
        return false;
    }
    // The dim the first region narrows (any dim when it is whole).
    let d = (0..dims.len())
        .find(|&i| first.0.dims().get(i) != Some(&dims[i]))
        .unwrap_or(0);
    let mut spans = Vec::with_capacity(parts.len());
    for (region, _) in parts {
        let (rd, rs) = (region.dims(), region.strides());
        let same_elsewhere = rd.len() == dims.len()
            && (0..dims.len()).all(|i| i == d || rd[i] == dims[i])
            && (0..dims.len()).all(|i| rd[i] <= 1 || rs[i] == strides[i]);
        if !same_elsewhere || strides[d] == 0 || region.offset() % strides[d] != 0 {
            return false;
        }
        let start = region.offset() / strides[d];
        spans.push((start, start + rd[d]));
    }
    spans.sort_unstable();
    let mut at = 0;
    for (start, end) in spans {
        if start != at {
            return false;
        }
        at = end;
    }
    at == dims[d]
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
    let mut pending: KeyMap<Pending> = KeyMap::with_capacity_and_hasher(64, Default::default());
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
    let task = Arc::new(GraphTask {
        retain_graph,
        capture: capture.map(<[usize]>::to_vec),
        home: root_edges.first().map(|(_, g)| g.device()),
        offload: !device_threads::on_device_thread(),
        streams: crate::storage::ThreadStreams::current(),
        state: Mutex::new(TaskState {
            pending,
            queues: vec![DeviceQueue::new(None)],
            captured: KeyMap::default(),
            error: None,
        }),
        wake: Condvar::new(),
    });
    let mut start = Vec::new();
    {
        let mut st = task.lock();
        let mut ready_roots = Vec::new();
        for (edge, g) in root_edges {
            let p = st.pending.get_mut(&edge.key()).expect("counted above");
            p.grad = Some(match p.grad.take() {
                Some(old) => old.add(Grad::Dense(g))?,
                None => Grad::Dense(g),
            });
            if p.deps == 0 && !ready_roots.contains(&edge.key()) {
                ready_roots.push(edge.key());
                start.extend(task.make_ready(&mut st, edge.key()));
            }
        }
    }
    for q in start.into_iter().filter(|&q| q != 0) {
        task.start_drain(q);
    }
    task.run_calling_thread()?;
    frame.finish()?;
    let mut st = task.lock();
    Ok(match capture {
        Some(c) => c.iter().map(|k| st.captured.remove(k)).collect(),
        None => Vec::new(),
    })
}

/// A map keyed by node or leaf ([`Edge::key`]): looked up several times per node of every
/// backward pass, so hashed with foldhash rather than SipHash (in a perf profile of small CPU
/// training steps, SipHash and rehashing these maps took about 5% of the time).
type KeyMap<V> = HashMap<usize, V, foldhash::fast::FixedState>;

/// One backward pass, shared by the calling thread and the device threads it hands work to
/// (Note [Device threads]).
struct GraphTask {
    retain_graph: bool,
    /// The keys whose gradients `grad` returns; `None`: accumulate into `.grad`.
    capture: Option<Vec<usize>>,
    /// The device of the first root's gradient: its nodes run on the calling thread.
    home: Option<Device>,
    /// False when backward was called on a device thread: everything runs there.
    offload: bool,
    /// The calling thread's current streams, made current on the device threads.
    streams: crate::storage::ThreadStreams,
    state: Mutex<TaskState>,
    /// Signalled by the device threads when they queue work for the calling thread or stop.
    wake: Condvar,
}

struct TaskState {
    pending: KeyMap<Pending>,
    /// `queues[0]` is the calling thread's; then one per other GPU reached.
    queues: Vec<DeviceQueue>,
    captured: KeyMap<Tensor>,
    /// The first error; no thread takes new entries once it is set.
    error: Option<Error>,
}

struct DeviceQueue {
    /// The GPU whose thread drains the queue; `None` for the calling thread's.
    device: Option<usize>,
    ready: ReadyQueue,
    /// A device thread is draining the queue (set before its job is sent, cleared by the
    /// thread when it finds the queue empty).
    draining: bool,
}

impl DeviceQueue {
    fn new(device: Option<usize>) -> DeviceQueue {
        DeviceQueue {
            device,
            ready: ReadyQueue::default(),
            draining: false,
        }
    }
}

impl GraphTask {
    fn lock(&self) -> MutexGuard<'_, TaskState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues the entry `key`, whose dependencies are all in; returns 0 when it went to the
    /// calling thread's queue, a device queue whose thread must be started, or nothing.
    fn make_ready(&self, st: &mut TaskState, key: usize) -> Option<usize> {
        let p = &st.pending[&key];
        let device = match (&p.edge, &p.grad) {
            (Edge::Node(node), Some(g)) if self.offload => match g.device() {
                Device::Cuda(d) if self.home != Some(Device::Cuda(d)) && !runs_hooks(node) => Some(d),
                _ => None,
            },
            _ => None,
        };
        let priority = p.edge.priority();
        let q = match device {
            None => 0,
            Some(d) => match st.queues.iter().position(|q| q.device == Some(d)) {
                Some(q) => q,
                None => {
                    st.queues.push(DeviceQueue::new(Some(d)));
                    st.queues.len() - 1
                }
            },
        };
        let queue = &mut st.queues[q];
        queue.ready.push(priority, key);
        (q == 0 || !std::mem::replace(&mut queue.draining, true)).then_some(q)
    }

    /// Hands queue `q` to its device's thread.
    fn start_drain(self: &Arc<Self>, q: usize) {
        let device = self.lock().queues[q]
            .device
            .expect("queue 0 is the calling thread's");
        let task = self.clone();
        if let Err(e) = device_threads::run(device, Box::new(move || task.drain(q))) {
            let mut st = self.lock();
            st.queues[q].draining = false;
            st.error.get_or_insert(e);
        }
    }

    /// The calling thread's loop: runs its own queue, waiting while the device threads work,
    /// until nothing is left anywhere; then the first error, if any.
    fn run_calling_thread(self: &Arc<Self>) -> Result<()> {
        loop {
            let key = {
                let mut st = self.lock();
                loop {
                    if st.error.is_none() {
                        if let Some(key) = st.queues[0].ready.pop() {
                            break Some(key);
                        }
                    }
                    if st.queues[1..].iter().all(|q| !q.draining) {
                        break None;
                    }
                    st = self.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Some(key) = key else { break };
            if let Err(e) = self.run_entry(key, false) {
                self.lock().error.get_or_insert(e);
            }
        }
        match self.lock().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A device thread's job: runs queue `q` until it is empty (or an error stopped the pass).
    fn drain(self: Arc<Self>, q: usize) {
        let _no_grad = super::no_grad();
        let _streams = self.streams.make_current();
        loop {
            let key = {
                let mut st = self.lock();
                let next = match st.error {
                    None => st.queues[q].ready.pop(),
                    Some(_) => None,
                };
                match next {
                    Some(key) => key,
                    None => {
                        st.queues[q].ready = ReadyQueue::default();
                        st.queues[q].draining = false;
                        drop(st);
                        self.wake.notify_all();
                        return;
                    }
                }
            };
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_entry(key, true)));
            let error = match ran {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some(Error::Autograd(
                    "a backward function panicked on a device thread of the autograd engine".into(),
                )),
            };
            if let Some(e) = error {
                self.lock().error.get_or_insert(e);
            }
        }
    }

    /// Runs one ready entry: a leaf takes its gradient, a node computes its inputs'
    /// gradients, which go on to the entries they reach.
    fn run_entry(self: &Arc<Self>, key: usize, on_device_thread: bool) -> Result<()> {
        let p = self.lock().pending.remove(&key).expect("ready keys are pending");
        let capture = self.capture.as_deref();
        if let (true, Edge::Node(node)) = (p.through, &p.edge) {
            // Note [Activation epilogues]: the gradient is the activation input's already.
            release_backward(node, self.retain_graph);
            let grads = vec![p.grad];
            let (mut home, mut start) = (false, Vec::new());
            let delivered = self.deliver(node, grads, &mut home, &mut start);
            if on_device_thread && home {
                self.wake.notify_all();
            }
            for q in start {
                self.start_drain(q);
            }
            return delivered;
        }
        let grad = p.grad.map(Grad::into_dense).transpose()?;
        let (node, grad) = match (p.edge, grad) {
            (Edge::Leaf(leaf), Some(grad)) => {
                let grad = apply_hooks(&leaf, grad)?;
                match capture {
                    Some(c) if c.contains(&key) => {
                        self.lock().captured.insert(key, grad);
                    }
                    Some(_) => {}
                    None => {
                        let hooks = accumulate_leaf(&leaf, grad)?;
                        if !hooks.is_empty() {
                            run_post_accumulate_grad_hooks(&Tensor(leaf), hooks)?;
                        }
                    }
                }
                return Ok(());
            }
            // Reached, but every path's gradient was left out as zero: the hooks still run.
            (Edge::Leaf(leaf), None) if capture.is_none() => {
                let hooks = post_accumulate_grad_hooks(&leaf);
                if !hooks.is_empty() {
                    run_post_accumulate_grad_hooks(&Tensor(leaf), hooks)?;
                }
                return Ok(());
            }
            (Edge::Leaf(_), None) => return Ok(()),
            (Edge::Node(node), grad) => (node, grad),
        };
        // A node that no gradient reached still releases its inputs' dependencies.
        let input_grads = match grad {
            Some(grad) => {
                // The output's hooks live on the node (`Node::hooks`), whether or not the
                // output tensor is still alive; `retain_grad` needs the tensor.
                let grad = run_hooks(&node_hooks(&node), grad)?;
                let grad = match node.output() {
                    Some(out) => {
                        if capture.is_none() && out.retains_grad() {
                            accumulate_leaf(&out.0, grad.clone())?;
                        }
                        grad
                    }
                    None => grad,
                };
                if capture.is_some_and(|c| c.contains(&key)) {
                    self.lock().captured.insert(key, grad.clone());
                }
                match &node.view {
                    Some(view) => view_backward(&node, view, grad, self.retain_graph)?,
                    None => self
                        .call_with_offers(&node, &grad)?
                        .into_iter()
                        .map(|g| g.map(Grad::Dense))
                        .collect(),
                }
            }
            None => (0..node.edges.len()).map(|_| None).collect(),
        };
        let (mut home, mut start) = (false, Vec::new());
        let delivered = self.deliver(&node, input_grads, &mut home, &mut start);
        if on_device_thread && home {
            self.wake.notify_all();
        }
        // Also after an error: a queue marked as draining must get its thread.
        for q in start {
            self.start_drain(q);
        }
        delivered
    }

    /// [`call_backward`], offering a node marked accumulating the gradient already waiting for
    /// its first input (Note [Gradients added in place]), and a node that applies activations
    /// the activation that made its first input (Note [Activation epilogues]); what the node
    /// leaves is put back.
    fn call_with_offers(&self, node: &Arc<Node>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(Some(first)) = node.edges.first() else {
            return call_backward(node, grad, self.retain_graph);
        };
        let first_key = first.key();
        let accumulates = node.accumulates.load(Relaxed);
        let activation = match first {
            Edge::Node(consumer) if node.applies_activation.load(Relaxed) => consumer
                .activation
                .get()
                .map(|(kind, input)| (consumer, *kind, input)),
            _ => None,
        };
        if !accumulates && activation.is_none() {
            return call_backward(node, grad, self.retain_graph);
        }
        let (offer, act) = {
            let mut st = self.lock();
            let p = st.pending.get_mut(&first_key).expect("counted above");
            let offer = match p.grad.take() {
                Some(Grad::Dense(t)) if accumulates => {
                    let writable = t.is_private();
                    Some((t, writable))
                }
                other => {
                    p.grad = other;
                    None
                }
            };
            // The activation's node runs on this node's gradient alone, and nothing sees the
            // gradient of its output: no other input to it, no hook or retained grad, no capture.
            let act = activation.filter(|(consumer, _, _)| {
                p.deps == 1
                    && p.grad.is_none()
                    && !matches!(offer, Some((_, false)))
                    && !runs_hooks(consumer)
                    && !self.capture.as_deref().is_some_and(|c| c.contains(&first_key))
            });
            (offer, act)
        };
        let act = match act {
            Some((_, kind, input)) => Some((kind, input.get()?.clone())),
            None => None,
        };
        let outer = super::offer_accumulator(offer);
        let outer_act = super::offer_activation(act);
        let grads = call_backward(node, grad, self.retain_graph);
        let applied = super::end_activation_offer(outer_act);
        if applied {
            let mut st = self.lock();
            st.pending.get_mut(&first_key).expect("counted above").through = true;
        }
        if let Some((left, _)) = super::end_offer(outer) {
            // Not taken: back into the entry, summed with what reached it meanwhile (Note [Sums
            // outside the task lock]).
            let mut g = Grad::Dense(left);
            loop {
                let mut st = self.lock();
                let p = st.pending.get_mut(&first_key).expect("counted above");
                match p.grad.take() {
                    Some(old) => {
                        drop(st);
                        g = old.add(g)?;
                    }
                    None => {
                        p.grad = Some(g);
                        break;
                    }
                }
            }
        }
        grads
    }

    /// Adds `node`'s input gradients to the entries they reach and queues those whose
    /// dependencies are now all in; sets `home` when the calling thread's queue got one, and
    /// adds to `start` the device queues whose thread must be started.
    ///
    /// Note [Sums outside the task lock]: a gradient reaching an entry that already holds one
    /// is summed with it: a kernel launch and an allocation, about 7 µs of host time on an
    /// H100 host. Under the pass's lock, every other thread of the pass waited that long for
    /// it: in `nn::DataParallel`'s backward the device thread sums each parameter's replica
    /// gradients while the calling thread needs the lock for every entry it runs. So the sum
    /// takes the held gradient out, runs unlocked, and tries to put its result back. The
    /// entry's dependency count drops only once its gradient is back, so it cannot become
    /// ready in between, and a gradient another thread stored meanwhile is summed in on the
    /// next try. Timed in a diagnostic build (dp_cnn's model on two H100s), acquiring the lock
    /// took 13 to 17 µs per step in all, against 24 to 33 µs before; the step time did not
    /// change measurably. PyTorch sums under its graph task's mutex.
    fn deliver(
        &self,
        node: &Node,
        input_grads: Vec<Option<Grad>>,
        home: &mut bool,
        start: &mut Vec<usize>,
    ) -> Result<()> {
        for (edge, mut g) in node.edges.iter().zip(input_grads) {
            let Some(edge) = edge else { continue };
            // Note [Sums outside the task lock]
            let mut st = loop {
                let mut st = self.lock();
                let p = st.pending.get_mut(&edge.key()).expect("counted above");
                match (g.take(), p.grad.take()) {
                    (Some(new), Some(old)) => {
                        drop(st);
                        g = Some(old.add(new)?);
                    }
                    (new, old) => {
                        p.grad = new.or(old);
                        break st;
                    }
                }
            };
            let p = st.pending.get_mut(&edge.key()).expect("counted above");
            p.deps -= 1;
            if p.deps == 0 {
                match self.make_ready(&mut st, edge.key()) {
                    Some(0) => *home = true,
                    Some(q) => start.push(q),
                    None => {}
                }
            }
        }
        Ok(())
    }
}

/// Whether running `node` runs code attached to its output (tensor hooks, `retain_grad`),
/// which stays on the calling thread (Note [Device threads]).
fn runs_hooks(node: &Node) -> bool {
    !node_hooks(node).is_empty() || node.output().is_some_and(|out| out.retains_grad())
}

/// The hooks registered on `node`'s output (a snapshot: a hook may register more).
fn node_hooks(node: &Node) -> Vec<(u64, Hook)> {
    node.hooks.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Fills `pending` with every node and leaf reachable from `roots` and the number of edges
/// that reach it.
fn count_dependencies(roots: impl Iterator<Item = Edge>, pending: &mut KeyMap<Pending>) {
    let mut stack: Vec<Edge> = Vec::new();
    for edge in roots {
        if let std::collections::hash_map::Entry::Vacant(v) = pending.entry(edge.key()) {
            v.insert(Pending {
                deps: 0,
                grad: None,
                edge: edge.clone(),
                through: false,
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
                    through: false,
                }
            });
            entry.deps += 1;
        }
    }
}

/// A view node's step (Note [Gradients of views]): its output's gradient becomes the slice of
/// its input's; the node's backward function is released as [`call_backward`] would.
fn view_backward(
    node: &Arc<Node>,
    view: &super::ViewOf,
    grad: Tensor,
    retain_graph: bool,
) -> Result<Vec<Option<Grad>>> {
    let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        return Err(Error::Autograd(format!(
            "trying to backward through the graph a second time (through {}); pass retain_graph=true to the first backward",
            node.name
        )));
    }
    if !retain_graph {
        *slot = None;
    }
    if grad.dims() != view.region.dims() {
        return Err(Error::Autograd(format!(
            "{}: the gradient has shape {}, the view's region {:?}",
            node.name,
            grad.shape(),
            view.region.dims()
        )));
    }
    let slice = Grad::Slices {
        shape: view.shape.clone(),
        parts: vec![(view.region.clone(), grad)],
    };
    Ok(vec![node.edges[0].as_ref().map(|_| slice)])
}

/// Drops a node's backward function as [`call_backward`] does after running it, for a node
/// whose gradient went past it (Note [Activation epilogues]).
fn release_backward(node: &Node, retain_graph: bool) {
    if !retain_graph {
        *node.backward.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
        let _range = crate::dispatch::observer::backward_range(node.name, grad.device());
        let _retaining = Retaining::enter(retain_graph);
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

thread_local! {
    /// Whether the backward function running on this thread belongs to a pass that keeps the
    /// graph ([`retains_graph`]).
    static RETAINING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets [`RETAINING`] for the backward function being called; puts the previous value back
/// (a backward function may run a pass of its own).
struct Retaining(bool);

impl Retaining {
    fn enter(retain_graph: bool) -> Retaining {
        Retaining(RETAINING.with(|r| r.replace(retain_graph)))
    }
}

impl Drop for Retaining {
    fn drop(&mut self) {
        RETAINING.with(|r| r.set(self.0));
    }
}

/// Inside a backward function: whether the pass running it keeps the graph (`retain_graph`),
/// so that a function running a backward pass of its own over a graph it holds (the replicas
/// of `nn::DataParallel`) keeps that graph too, and a second pass through the function finds
/// it. False outside backward functions.
pub fn retains_graph() -> bool {
    RETAINING.with(std::cell::Cell::get)
}

fn apply_hooks(t: &Arc<TensorImpl>, grad: Tensor) -> Result<Tensor> {
    let hooks = t.meta().hooks.clone();
    run_hooks(&hooks, grad)
}

/// Runs `hooks` in order, each on what the one before it returned.
fn run_hooks(hooks: &[(u64, Hook)], mut grad: Tensor) -> Result<Tensor> {
    for (_, hook) in hooks {
        if let Some(g) = hook(&grad)? {
            grad = g;
        }
    }
    Ok(grad)
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
