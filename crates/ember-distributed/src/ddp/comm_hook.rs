//! DDP communication hooks (`DistributedDataParallel.register_comm_hook`): what a hook is
//! given ([`GradBucket`]), what it hands back ([`CommFuture`]), and the built-in hooks of
//! PyTorch's `ddp_comm_hooks.default_hooks` ([`default_hooks`]).
//!
//! Note [DDP comm hooks]: a hook replaces the averaging all-reduce of each bucket. It is
//! called once per bucket per synchronizing backward, in bucket order (the order every rank
//! issues its collectives in, Note [DDP reduction order]), as soon as the bucket is full; it
//! starts its collectives and returns at once with a [`CommFuture`]: the [`crate::Work`]s it
//! started, the tensor they write, and continuations to run after them. DDP waits for the
//! futures at the end of backward, in bucket order, so the collectives overlap the rest of
//! backward as the built-in reduction does; the future's value (the reduced bucket, as many
//! elements as the buffer) is copied into the buffer unless it is the buffer, and from there
//! into the parameters' `.grad` (or it is `.grad`, with `gradient_as_bucket_view`).
//! - The buffer holds the sum of this rank's local gradients, not divided by the world size:
//!   dividing is the hook's job, as in PyTorch (the built-in reduction divides instead).
//! - Continuations run on the thread running backward, after the collectives' `wait`: on a
//!   GPU, with the current stream ordered after the collective, so what they enqueue runs
//!   after it without the host waiting.
//! - A bucket that holds one parameter may hand the parameter's own `.grad` (flattened) as the
//!   buffer (Note [DDP one-parameter buckets]); a hook registered with `register_comm_hook`
//!   sees whole buckets, never row blocks (Note [DDP row blocks]): what it does with a bucket
//!   is its own. A built-in hook ([`BuiltinCommHookType`], `register_builtin_comm_hook`)
//!   works element by element, so a one-parameter bucket whose gradient is computed in row
//!   blocks is handed to it block by block, each part of the buffer (a `GradBucket` of the same
//!   index and parameter) as soon as its rows are computed, from a side stream that waits for
//!   them; DDP then waits for each block's future and writes its value into that part. The
//!   compression and the collective of the first rows run while the product computes the last
//!   ones: ddp_mlp_large with the bfloat16 hook on two H200s, where the 200 MB first-layer
//!   bucket used to be cast, divided, all-reduced and cast back after the whole product (its
//!   last all-reduce ended 645 us after the product), now ends 190 us after it: 2.76 ms a step
//!   before, 2.55 after (the division moved into the collective as well; one GPU, 2.39 and
//!   2.23: scaling 0.866 and 0.878; docs/benchmarks.md, session 53).
//! - A hook runs while DDP's reducer holds its lock: it must not call back into the
//!   `DistributedDataParallel` it is registered on.

use ember_core::{Result, Tensor};

use crate::backend::Work;
use crate::group::ProcessGroup;

/// The continuation of a [`CommFuture`]: takes the value so far, returns the next one.
type Then = Box<dyn FnOnce(Tensor) -> Result<Tensor> + Send>;

/// The registered hook, its state bound in.
pub(crate) type BoxedCommHook = Box<dyn Fn(&GradBucket) -> Result<CommFuture> + Send + Sync>;

/// The result of a communication hook (`torch.futures.Future[torch.Tensor]`): the
/// asynchronous operations it started, the tensor they write, and what to do with it after
/// them ([`CommFuture::then`]). [`CommFuture::wait`] waits for the operations, runs the
/// continuations in order and returns the last value.
///
/// ```
/// use ember_core::{Device, Tensor};
/// use ember_distributed::{CommFuture, Work};
/// # fn main() -> ember_core::Result<()> {
/// let t = Tensor::from_vec(vec![2.0f32, 4.0], 2, Device::Cpu)?;
/// // In a hook: `CommFuture::new(group.all_reduce_async(&t, ReduceOp::Sum)?, t)`.
/// let fut = CommFuture::new(Work::done(Ok(())), t).then(|t| t.div_scalar_(2.0));
/// assert_eq!(fut.wait()?.to_vec::<f32>()?, [1.0, 2.0]);
/// # Ok(())
/// # }
/// ```
#[must_use = "a CommFuture does nothing until waited for: return it from the hook"]
pub struct CommFuture {
    works: Vec<Work>,
    value: Tensor,
    then: Vec<Then>,
}

impl CommFuture {
    /// The future of `work`, whose value is `value` once `work` is done
    /// (`dist.all_reduce(value, async_op=True).get_future()`).
    pub fn new(work: Work, value: Tensor) -> CommFuture {
        CommFuture::from_works(vec![work], value)
    }

    /// The future of several operations that all write into `value`.
    pub fn from_works(works: Vec<Work>, value: Tensor) -> CommFuture {
        CommFuture {
            works,
            value,
            then: Vec::new(),
        }
    }

    /// A future already done, of value `value` (a hook that communicates nothing, or did so
    /// synchronously; `fut.set_result(value)`).
    pub fn ready(value: Tensor) -> CommFuture {
        CommFuture::from_works(Vec::new(), value)
    }

    /// Chains `f` after the operations and the continuations before it (`fut.then(f)`): it
    /// takes the value so far and returns the next one.
    pub fn then(mut self, f: impl FnOnce(Tensor) -> Result<Tensor> + Send + 'static) -> CommFuture {
        self.then.push(Box::new(f));
        self
    }

    /// Marks the value used on `stream` (`record_stream`): the continuations read it there.
    pub(crate) fn record_value_stream(&self, stream: &ember_core::cuda::Stream) -> Result<()> {
        self.value.record_stream(stream)
    }

    /// Whether the operations have finished (the continuations run in [`CommFuture::wait`]).
    pub fn is_completed(&self) -> bool {
        self.works.iter().all(Work::is_completed)
    }

    /// Waits for the operations, then runs the continuations in order; the last value
    /// (`fut.wait()`). The first error (a failed collective, a failed continuation) ends it.
    pub fn wait(self) -> Result<Tensor> {
        for w in &self.works {
            w.wait()?;
        }
        let mut value = self.value;
        for f in self.then {
            value = f(value)?;
        }
        Ok(value)
    }
}

impl std::fmt::Debug for CommFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CommFuture({} works, completed={}, {} continuations)",
            self.works.len(),
            self.is_completed(),
            self.then.len()
        )
    }
}

/// The built-in communication hooks DDP can call on part of a bucket
/// (`torch.distributed.BuiltinCommHookType`, with bfloat16 besides float16), registered with
/// [`crate::DistributedDataParallel::register_builtin_comm_hook`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuiltinCommHookType {
    /// [`default_hooks::allreduce_hook`] (`ALLREDUCE`).
    Allreduce,
    /// [`default_hooks::fp16_compress_hook`] (`FP16_COMPRESS`).
    Fp16Compress,
    /// [`default_hooks::bf16_compress_hook`].
    Bf16Compress,
}

/// A built-in hook's function.
type HookFn = fn(&Option<ProcessGroup>, &GradBucket) -> Result<CommFuture>;

impl BuiltinCommHookType {
    /// The function of [`default_hooks`] that reduces a bucket for this hook.
    pub(crate) fn function(self) -> HookFn {
        match self {
            BuiltinCommHookType::Allreduce => default_hooks::allreduce_hook,
            BuiltinCommHookType::Fp16Compress => default_hooks::fp16_compress_hook,
            BuiltinCommHookType::Bf16Compress => default_hooks::bf16_compress_hook,
        }
    }
}

/// One bucket of gradients as a communication hook sees it (`torch.distributed.GradBucket`):
/// its flat buffer, its place among the buckets, and its parameters.
#[derive(Clone)]
pub struct GradBucket {
    pub(crate) index: usize,
    pub(crate) is_last: bool,
    pub(crate) buffer: Tensor,
    pub(crate) parameters: Vec<Tensor>,
    pub(crate) offsets: Vec<usize>,
    pub(crate) group: ProcessGroup,
}

impl GradBucket {
    /// The bucket's index, 0 for the first one reduced (`bucket.index()`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this is the last bucket of the backward pass (`bucket.is_last()`).
    pub fn is_last(&self) -> bool {
        self.is_last
    }

    /// The flat 1-D tensor of the bucket's gradients, this rank's local sums
    /// (`bucket.buffer()`). A hook may reduce it in place and return it.
    pub fn buffer(&self) -> &Tensor {
        &self.buffer
    }

    /// The parameters whose gradients the bucket holds, in buffer order (`bucket.parameters()`).
    pub fn parameters(&self) -> &[Tensor] {
        &self.parameters
    }

    /// Where each parameter's gradient starts in the buffer, in elements.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The gradients as views of the buffer, shaped as their parameters (`bucket.gradients()`).
    pub fn gradients(&self) -> Result<Vec<Tensor>> {
        self.parameters
            .iter()
            .zip(&self.offsets)
            .map(|(p, &at)| {
                let dims: Vec<isize> = p.dims().iter().map(|&d| d as isize).collect();
                self.buffer.narrow(0, at, p.numel())?.view(&dims)
            })
            .collect()
    }

    /// The process group of the `DistributedDataParallel` the bucket belongs to; the built-in
    /// hooks use it when their state names no group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }
}

impl std::fmt::Debug for GradBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GradBucket(index={}, {} parameters, {} elements of {}, is_last={})",
            self.index,
            self.parameters.len(),
            self.buffer.numel(),
            self.buffer.dtype(),
            self.is_last
        )
    }
}

/// PyTorch's `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`: each takes as state
/// the group to reduce over (`None`: the DDP's own group, which is the default group unless
/// [`crate::DdpOptions::process_group`] named another; PyTorch's `None` is always the default
/// group) and the bucket, and is registered with
/// [`crate::DistributedDataParallel::register_comm_hook`].
///
/// ```no_run
/// use ember_core::Device;
/// use ember_distributed::{self as dist, default_hooks, DdpOptions, DistributedDataParallel};
/// use ember_nn::Linear;
/// # fn main() -> ember_core::Result<()> {
/// dist::init_process_group(dist::InitOptions::new(dist::BackendKind::Nccl))?; // under ember-run
/// let ddp = DistributedDataParallel::new(Linear::new(10, 5, Device::Cuda(0))?, DdpOptions::new())?;
/// // Gradients travel as bfloat16: half the bytes of float32.
/// ddp.register_comm_hook(None, default_hooks::bf16_compress_hook)?;
/// # Ok(())
/// # }
/// ```
pub mod default_hooks {
    use ember_core::{DType, Result, Tensor};

    use super::{CommFuture, GradBucket};
    use crate::backend::ReduceOp;
    use crate::group::ProcessGroup;

    fn group<'a>(state: &'a Option<ProcessGroup>, bucket: &'a GradBucket) -> &'a ProcessGroup {
        state.as_ref().unwrap_or(&bucket.group)
    }

    /// Averages the bucket as DDP does without a hook (`allreduce_hook`): the buffer divided
    /// by the world size first (so that half-precision sums do not overflow), then summed
    /// across ranks in place. The same values as DDP's own reduction where dividing is exact
    /// (a world size that is a power of two).
    pub fn allreduce_hook(state: &Option<ProcessGroup>, bucket: &GradBucket) -> Result<CommFuture> {
        let group = group(state, bucket);
        let buffer = bucket.buffer().clone();
        buffer.div_scalar_(group.size() as f64)?;
        Ok(CommFuture::new(
            group.all_reduce_async(&buffer, ReduceOp::Sum)?,
            buffer,
        ))
    }

    /// Averages the bucket in float16 (`fp16_compress_hook`): the buffer cast to float16 and
    /// divided by the world size, summed across ranks in float16, then cast back into the
    /// buffer. Half the bytes of float32 on the wire, at float16's precision (11 significant
    /// bits) and range (a gradient beyond 65504 becomes infinite).
    pub fn fp16_compress_hook(state: &Option<ProcessGroup>, bucket: &GradBucket) -> Result<CommFuture> {
        compress_hook(group(state, bucket), bucket, DType::F16)
    }

    /// Averages the bucket in bfloat16 (`bf16_compress_hook`): as
    /// [`fp16_compress_hook`] with bfloat16, whose range is float32's (8 significant bits).
    pub fn bf16_compress_hook(state: &Option<ProcessGroup>, bucket: &GradBucket) -> Result<CommFuture> {
        compress_hook(group(state, bucket), bucket, DType::BF16)
    }

    /// PyTorch's order: `compressed = buffer.to(dtype).div_(world_size)`, all-reduce (sum)
    /// `compressed`, then `buffer.copy_(compressed)` (decompressed in place, so the peak
    /// memory is the buffer plus its compressed copy). The division is the collective's
    /// (`ReduceOp::Avg`): NCCL's average of a floating type multiplies each rank's values by
    /// 1/world before it sums them, PyTorch's order in one pass, where a division kernel and
    /// the copy of its result took 110 us of ddp_mlp_large's step on two H200s; over two ranks
    /// (halving is exact) the values are PyTorch's bit for bit. The CPU backend divides the sum.
    fn compress_hook(group: &ProcessGroup, bucket: &GradBucket, dtype: DType) -> Result<CommFuture> {
        let buffer = bucket.buffer().clone();
        let compressed = buffer.to_dtype(dtype)?;
        let work = group.all_reduce_async(&compressed, ReduceOp::Avg)?;
        Ok(CommFuture::new(work, compressed).then(move |reduced: Tensor| buffer.copy_(&reduced)))
    }
}
