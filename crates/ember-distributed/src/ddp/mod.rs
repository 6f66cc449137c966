//! [`DistributedDataParallel`]: data-parallel training of one module replicated on every rank
//! of a process group (`torch.nn.parallel.DistributedDataParallel`).
//!
//! Each rank runs forward and backward on its own share of the batch; DDP averages the
//! gradients across ranks during backward, so after `backward` every rank holds the gradient of
//! the whole batch and the same optimizer step keeps the replicas equal. What it does, when:
//! - construction: checks that every rank wraps a module of the same parameter shapes, then
//!   broadcasts rank 0's parameters and buffers, so all replicas start equal;
//! - forward ([`DistributedDataParallel::forward`], [`DistributedDataParallel::forward_with`]):
//!   broadcasts rank 0's buffers (batch-norm statistics) first when `broadcast_buffers` (the
//!   default) and the previous forward synchronized, runs the module, then arms the gradient
//!   reduction for the coming backward (unless under [`DistributedDataParallel::no_sync`] or
//!   grad mode is off);
//! - backward: gradients are bucketed and each bucket all-reduced as soon as it is full,
//!   overlapping the rest of backward; backward returns once every average is in `.grad`
//!   (`reducer.rs`: Note [DDP buckets], Note [DDP reduction order], Note [DDP unused
//!   parameters]).
//! - communication hooks ([`DistributedDataParallel::register_comm_hook`], [`comm_hook`]):
//!   a function of the caller's that reduces each bucket instead of the built-in average,
//!   e.g. in bfloat16 ([`default_hooks::bf16_compress_hook`]; Note [DDP comm hooks]).
//!
//! Every rank must run the same sequence of synchronizing forward/backward passes. Parameters
//! that do not require grad are left out of the reduction. Move the module to its device
//! before wrapping it: the buckets are made on the parameters' devices. DDP uses only the
//! group's [`crate::Backend`]: over NCCL the parameters must be on the group's GPU
//! ([`crate::ProcessGroup::device`]), and a bucket's `wait` orders the current stream after
//! the all-reduce without blocking the host, so the copies into `.grad` queue behind it.

pub mod comm_hook;
mod reducer;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ember_core::{is_grad_enabled, Device, Error, HookHandle, Result, Tensor};
use ember_nn::{Forward, Module, ModuleExt, TensorKind};

use crate::backend::ReduceOp;
use crate::group::{default_group, ProcessGroup};
pub use comm_hook::{default_hooks, BuiltinCommHookType, CommFuture, GradBucket};
use reducer::Reducer;
pub use reducer::{DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES};

/// The keyword arguments of `DistributedDataParallel(...)`, with PyTorch's defaults.
#[derive(Clone)]
pub struct DdpOptions {
    /// The group to reduce over; `None`: the default group ([`crate::init_process_group`]).
    pub process_group: Option<ProcessGroup>,
    /// `None`: 25 MiB buckets with a 1 MiB first bucket; `Some(mb)`: buckets of `mb` MiB (the
    /// first one too), as PyTorch's `bucket_cap_mb`.
    pub bucket_cap_mb: Option<f64>,
    /// Walk the graph after each forward and mark the parameters it does not reach as ready,
    /// so that a forward that leaves some parameters out still completes its reduction.
    pub find_unused_parameters: bool,
    /// After backward, each `.grad` is a view into its bucket (no copy back).
    pub gradient_as_bucket_view: bool,
    /// Broadcast rank 0's buffers at the start of each forward (default true).
    pub broadcast_buffers: bool,
}

impl Default for DdpOptions {
    fn default() -> DdpOptions {
        DdpOptions {
            process_group: None,
            bucket_cap_mb: None,
            find_unused_parameters: false,
            gradient_as_bucket_view: false,
            broadcast_buffers: true,
        }
    }
}

impl DdpOptions {
    pub fn new() -> DdpOptions {
        DdpOptions::default()
    }
    pub fn process_group(mut self, group: ProcessGroup) -> Self {
        self.process_group = Some(group);
        self
    }
    pub fn bucket_cap_mb(mut self, mb: f64) -> Self {
        self.bucket_cap_mb = Some(mb);
        self
    }
    pub fn find_unused_parameters(mut self, yes: bool) -> Self {
        self.find_unused_parameters = yes;
        self
    }
    pub fn gradient_as_bucket_view(mut self, yes: bool) -> Self {
        self.gradient_as_bucket_view = yes;
        self
    }
    pub fn broadcast_buffers(mut self, yes: bool) -> Self {
        self.broadcast_buffers = yes;
        self
    }
}

/// What a forward pass returns, as far as DDP needs to see it: its tensors (the roots that
/// `find_unused_parameters` walks the graph from).
pub trait ForwardOutput {
    fn tensors(&self) -> Vec<Tensor>;
}

impl ForwardOutput for Tensor {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.clone()]
    }
}

impl ForwardOutput for Vec<Tensor> {
    fn tensors(&self) -> Vec<Tensor> {
        self.clone()
    }
}

impl ForwardOutput for (Tensor, Tensor) {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.0.clone(), self.1.clone()]
    }
}

impl ForwardOutput for (Tensor, Tensor, Tensor) {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.0.clone(), self.1.clone(), self.2.clone()]
    }
}

/// A module replicated across the ranks of a process group, whose gradients backward averages
/// across them (`torch.nn.parallel.DistributedDataParallel`; see the module docs).
///
/// ```no_run
/// use ember_core::{DType, Device, Tensor};
/// use ember_distributed::{self as dist, DdpOptions, DistributedDataParallel};
/// use ember_nn::optim::{self, Optimizer};
/// use ember_nn::{Linear, ModuleExt};
/// # fn main() -> ember_core::Result<()> {
/// dist::init_process_group(dist::InitOptions::new(dist::BackendKind::Gloo))?; // under ember-run
/// let ddp = DistributedDataParallel::new(Linear::new(10, 5, Device::Cpu)?, DdpOptions::new())?;
/// let mut opt = optim::SGD::new(ddp.parameters(), optim::SgdConfig { lr: 0.01, ..Default::default() })?;
/// let x = Tensor::randn([20, 10], DType::F32, Device::Cpu)?;
/// ddp.forward(&x)?.pow_scalar(2.0)?.mean_all()?.backward()?; // gradients averaged here
/// opt.step()?;
/// # Ok(())
/// # }
/// ```
pub struct DistributedDataParallel<M: Module> {
    module: M,
    group: ProcessGroup,
    reducer: Arc<Reducer>,
    /// The post-accumulate-grad hooks on the parameters, removed on drop.
    hooks: Mutex<Vec<HookHandle>>,
    broadcast_buffers: bool,
    /// False under [`DistributedDataParallel::no_sync`].
    require_backward_grad_sync: Arc<AtomicBool>,
    /// Whether the last forward synchronized, so that the next one broadcasts the buffers.
    require_forward_param_sync: AtomicBool,
    /// Whether a forward ran (a communication hook is registered before the first one).
    forwarded: AtomicBool,
}

impl<M: Module> std::fmt::Debug for DistributedDataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DistributedDataParallel({:?}, {} buckets)",
            self.group,
            self.reducer.bucket_indices().len()
        )
    }
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `module`: a collective over the group (every rank calls it with a module of the
    /// same parameter shapes). Rank 0's parameters and buffers are broadcast to the others.
    pub fn new(module: M, options: DdpOptions) -> Result<DistributedDataParallel<M>> {
        let group = match options.process_group {
            Some(g) => g,
            None => default_group()?,
        };
        let limits = match options.bucket_cap_mb {
            None => [
                DEFAULT_FIRST_BUCKET_BYTES,
                (DEFAULT_BUCKET_CAP_MB * (1 << 20) as f64) as usize,
            ],
            Some(mb) if mb.is_finite() && mb > 0.0 => {
                let bytes = ((mb * (1 << 20) as f64) as usize).max(1);
                [bytes, bytes]
            }
            Some(mb) => {
                return Err(Error::invalid(
                    "DistributedDataParallel",
                    format!("bucket_cap_mb must be a positive number, got {mb}"),
                ))
            }
        };
        // Parameters that require grad, each once (a tied weight is listed under each name).
        let mut names = Vec::new();
        let mut params: Vec<Tensor> = Vec::new();
        for (name, p) in module.named_parameters() {
            let seen = params
                .iter()
                .any(|q| q.shares_storage_with(&p) && q.data_ptr() == p.data_ptr() && q.dims() == p.dims());
            if p.requires_grad() && !seen {
                names.push(name);
                params.push(p);
            }
        }
        if params.is_empty() {
            return Err(Error::invalid(
                "DistributedDataParallel",
                "the module has no parameter that requires a gradient",
            ));
        }
        verify_param_shape_across_processes(&group, &module)?;
        sync_module_states(&group, &module)?;
        let (reducer, hooks) = Reducer::new(
            params,
            names,
            group.clone(),
            limits,
            options.find_unused_parameters,
            options.gradient_as_bucket_view,
        )?;
        Ok(DistributedDataParallel {
            module,
            group,
            reducer,
            hooks: Mutex::new(hooks),
            broadcast_buffers: options.broadcast_buffers,
            require_backward_grad_sync: Arc::new(AtomicBool::new(true)),
            require_forward_param_sync: AtomicBool::new(true),
            forwarded: AtomicBool::new(false),
        })
    }

    /// The wrapped module (`ddp.module`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped module, mutably (e.g. for `train()`/`eval()`). Replacing its tensors
    /// (`to_dtype`) detaches them from the reduction; `to_device` moves them in place.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The process group gradients are averaged over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The parameters of each gradient bucket, in reduction order, as indices into the
    /// module's parameters that require grad, in `parameters()` order with tied ones listed
    /// once (PyTorch's logging data `rebuilt_per_bucket_param_indices` after the rebuild).
    pub fn bucket_indices(&self) -> Vec<Vec<usize>> {
        self.reducer.bucket_indices()
    }

    /// Whether the buckets were rebuilt from the order the gradients became ready in (after
    /// the first iteration that synchronized, without `find_unused_parameters`).
    pub fn has_rebuilt_buckets(&self) -> bool {
        self.reducer.has_rebuilt_buckets()
    }

    /// A guard under which forward/backward passes accumulate gradients locally without
    /// synchronizing (`with ddp.no_sync():`); the first forward/backward after it averages
    /// everything accumulated.
    pub fn no_sync(&self) -> NoSyncGuard {
        let previous = self.require_backward_grad_sync.swap(false, Ordering::SeqCst);
        NoSyncGuard {
            flag: self.require_backward_grad_sync.clone(),
            previous,
        }
    }

    /// Registers a communication hook (`ddp.register_comm_hook(state, hook)`): from now on each
    /// bucket of gradients is reduced by `hook(&state, &bucket)` instead of DDP's average, once
    /// per bucket per synchronizing backward, in bucket order, as soon as the bucket is full.
    /// The hook starts its collectives and returns a [`CommFuture`] at once; DDP waits for the
    /// futures at the end of backward and copies each value (the reduced bucket) into the
    /// gradients. The bucket's buffer holds this rank's local gradients, undivided: averaging
    /// is the hook's job. See Note [DDP comm hooks] in [`comm_hook`]; the built-in hooks are
    /// in [`default_hooks`].
    ///
    /// Every rank registers the same hook. An [`Error::InvalidArgument`] when a hook is
    /// registered already (one per DDP, as in PyTorch), or when a forward has run (the hook
    /// must be registered before the first forward). A hook must not call back into this DDP.
    ///
    /// ```no_run
    /// use std::sync::Mutex;
    /// use ember_core::Device;
    /// use ember_distributed::{self as dist, CommFuture, DdpOptions, DistributedDataParallel, ReduceOp};
    /// use ember_nn::Linear;
    /// # fn main() -> ember_core::Result<()> {
    /// dist::init_process_group(dist::InitOptions::new(dist::BackendKind::Gloo))?; // under ember-run
    /// let ddp = DistributedDataParallel::new(Linear::new(10, 5, Device::Cpu)?, DdpOptions::new())?;
    /// // A hook that sums (no average) and counts the buckets it reduced; its state is the count.
    /// ddp.register_comm_hook(Mutex::new(0usize), |count, bucket| {
    ///     *count.lock().unwrap() += 1;
    ///     let buffer = bucket.buffer().clone();
    ///     let work = bucket.process_group().all_reduce_async(&buffer, ReduceOp::Sum)?;
    ///     Ok(CommFuture::new(work, buffer))
    /// })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_comm_hook<S, F>(&self, state: S, hook: F) -> Result<()>
    where
        S: Send + Sync + 'static,
        F: Fn(&S, &GradBucket) -> Result<CommFuture> + Send + Sync + 'static,
    {
        self.set_comm_hook(Box::new(move |bucket: &GradBucket| hook(&state, bucket)), false)
    }

    /// [`DistributedDataParallel::register_comm_hook`] of a boxed hook, which the reducer may
    /// call on row blocks with `by_blocks`.
    fn set_comm_hook(&self, hook: comm_hook::BoxedCommHook, by_blocks: bool) -> Result<()> {
        if self.forwarded.load(Ordering::SeqCst) {
            return Err(Error::invalid(
                "DistributedDataParallel::register_comm_hook",
                "register_comm_hook must be called before the first forward: the forward that ran already \
                 armed the built-in reduction; register the hook right after DistributedDataParallel::new",
            ));
        }
        self.reducer.set_comm_hook(hook, by_blocks)
    }

    /// Registers one of the built-in communication hooks (PyTorch's
    /// `ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)`): the same
    /// values as [`DistributedDataParallel::register_comm_hook`] with the matching function of
    /// [`default_hooks`] and the DDP's own group, but DDP knows what the hook does to a bucket,
    /// element by element: over more than one GPU, the bucket of a large weight is handed to it
    /// in row blocks, each as soon as backward has computed it (Note [DDP comm hooks]), so its
    /// compression and collective overlap the rest of the product instead of following it.
    /// The same errors as `register_comm_hook`.
    ///
    /// ```no_run
    /// use ember_core::Device;
    /// use ember_distributed::{self as dist, BuiltinCommHookType, DdpOptions, DistributedDataParallel};
    /// use ember_nn::Linear;
    /// # fn main() -> ember_core::Result<()> {
    /// dist::init_process_group(dist::InitOptions::new(dist::BackendKind::Nccl))?; // under ember-run
    /// let ddp = DistributedDataParallel::new(Linear::new(10, 5, Device::Cuda(0))?, DdpOptions::new())?;
    /// ddp.register_builtin_comm_hook(BuiltinCommHookType::Bf16Compress)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_builtin_comm_hook(&self, hook: BuiltinCommHookType) -> Result<()> {
        let f = hook.function();
        self.set_comm_hook(Box::new(move |bucket: &GradBucket| f(&None, bucket)), true)
    }

    /// Runs a forward pass of the module through `f` (for modules whose forward takes or
    /// returns more than one tensor), with DDP's steps around it (see the module docs).
    pub fn forward_with<T: ForwardOutput>(&self, f: impl FnOnce(&M) -> Result<T>) -> Result<T> {
        if self.broadcast_buffers
            && self.group.size() > 1
            && self.require_forward_param_sync.load(Ordering::SeqCst)
        {
            sync_buffers(&self.group, &self.module)?;
        }
        self.forwarded.store(true, Ordering::SeqCst);
        let out = f(&self.module)?;
        if is_grad_enabled() && self.require_backward_grad_sync.load(Ordering::SeqCst) {
            self.require_forward_param_sync.store(true, Ordering::SeqCst);
            self.reducer.prepare_for_backward(&out.tensors())?;
        } else {
            self.require_forward_param_sync.store(false, Ordering::SeqCst);
            self.reducer.disarm();
        }
        Ok(out)
    }
}

impl<M: Forward> DistributedDataParallel<M> {
    /// `ddp(x)`: the module's forward with DDP's steps around it.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(|m| m.forward(x))
    }
}

impl<M: Forward> Forward for DistributedDataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        DistributedDataParallel::forward(self, x)
    }
}

/// The wrapper is a module whose only child is `module`, so names carry PyTorch's `module.`
/// prefix (`module.fc.weight`) and `parameters()` lists the module's parameters.
impl<M: Module> Module for DistributedDataParallel<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.module
            .visit(&ember_nn::module::join_name(prefix, "module"), f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.module
            .visit_mut(&ember_nn::module::join_name(prefix, "module"), f)
    }

    fn set_training(&self, training: bool) {
        self.module.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.module.is_training()
    }
}

impl<M: Module> Drop for DistributedDataParallel<M> {
    fn drop(&mut self) {
        let hooks = std::mem::take(&mut *self.hooks.lock().unwrap_or_else(|p| p.into_inner()));
        for h in hooks {
            h.remove();
        }
        self.reducer.release_row_blocks();
    }
}

/// Restores gradient synchronization when dropped (see [`DistributedDataParallel::no_sync`]).
#[must_use = "gradients are synchronized again as soon as the guard is dropped"]
pub struct NoSyncGuard {
    flag: Arc<AtomicBool>,
    previous: bool,
}

impl Drop for NoSyncGuard {
    fn drop(&mut self) {
        self.flag.store(self.previous, Ordering::SeqCst);
    }
}

/// Fails on every rank alike when the ranks' modules differ in parameter count or shapes
/// (PyTorch's `_verify_param_shape_across_processes`): one all-reduce of a fingerprint and its
/// negation under Max, so every rank sees both the largest and the smallest.
fn verify_param_shape_across_processes<M: Module>(group: &ProcessGroup, module: &M) -> Result<()> {
    let params = module.parameters();
    let mut numel: i64 = 0;
    let mut hash: i64 = 0;
    for p in &params {
        numel += p.numel() as i64;
        for &d in p.dims() {
            hash = hash.wrapping_mul(1_000_003).wrapping_add(d as i64 + 1);
        }
        hash = hash.wrapping_mul(31).wrapping_add(p.rank() as i64);
    }
    let hash = hash & 0x3fff_ffff_ffff; // non-negative, so its negation cannot overflow
    let mine = [params.len() as i64, numel, hash];
    let both: Vec<i64> = mine.iter().copied().chain(mine.iter().map(|v| -v)).collect();
    let t = Tensor::from_vec(both, 6, Device::Cpu)?.to(group.device())?;
    group.all_reduce(&t, ReduceOp::Max)?;
    let v = t.to_vec::<i64>()?;
    if (0..3).any(|i| v[i] != -v[i + 3]) {
        return Err(Error::invalid(
            "DistributedDataParallel",
            format!(
                "the ranks' modules differ: this rank has {} parameters of {} elements, and across ranks the counts range over {}..={} parameters and {}..={} elements (or their shapes differ); every rank must wrap the same model",
                mine[0], mine[1], -v[3], v[0], -v[4], v[1]
            ),
        ));
    }
    Ok(())
}

/// Broadcasts rank 0's parameters and buffers (PyTorch's `_sync_module_states`).
fn sync_module_states<M: Module>(group: &ProcessGroup, module: &M) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    let src = group.global_rank(0)?;
    let mut tensors = Vec::new();
    module.visit("", &mut |_, t, _| tensors.push(t.clone()));
    for t in tensors {
        group.broadcast(&t, src)?;
    }
    Ok(())
}

/// Broadcasts rank 0's buffers (PyTorch's `_sync_buffers`, every forward by default).
fn sync_buffers<M: Module>(group: &ProcessGroup, module: &M) -> Result<()> {
    let src = group.global_rank(0)?;
    for b in module.buffers() {
        group.broadcast(&b, src)?;
    }
    Ok(())
}
