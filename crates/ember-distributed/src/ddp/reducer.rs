//! The gradient reducer of [`super::DistributedDataParallel`] (PyTorch's `c10d::Reducer`):
//! buckets, the per-parameter autograd hooks that fill them, the asynchronous all-reduce of
//! each bucket, and the end-of-backward step that waits and writes the averages into `.grad`.
//!
//! Note [DDP buckets]: the gradients of the parameters are reduced in buckets, one flat tensor
//! per bucket (one dtype and device each), so that a model of many small parameters makes few
//! collectives and the first ones start while backward still runs.
//! - Assignment (PyTorch's `compute_bucket_assignment_by_size`): parameters are taken in an
//!   order and put into the open bucket of their (dtype, device); a bucket closes when it holds
//!   at least its size limit. A parameter as large as the limit by itself goes into a bucket of
//!   its own (PyTorch would add it to the open bucket). The limits are 1 MiB for the first bucket of each kind and
//!   25 MiB after it (with `bucket_cap_mb` set by the user: that size for every bucket).
//! - The first assignment takes the parameters in reverse order (backward usually produces the
//!   gradients of the last layers first), buckets sorted by their first parameter in that order.
//! - After the first iteration that synchronized, the buckets are rebuilt from the order in
//!   which the gradients actually became ready, taken from rank 0 (broadcast) so that every
//!   rank has the same buckets. Not with `find_unused_parameters` (the graph may change from
//!   one iteration to the next), as in PyTorch.
//!
//! Note [DDP reduction order]: during backward, each parameter's post-accumulate-grad hook
//! takes its new `.grad` for its slot of its bucket ("marks it ready"; Note [DDP bucket
//! copies]). A bucket whose slots
//! are all ready is all-reduced (averaged) asynchronously, but only in bucket order: bucket
//! `i + 1` starts after bucket `i` started, so every rank issues the same collectives in the
//! same order whatever order its hooks ran in. The first hook of a backward pass queues the
//! end-of-backward callback (`finalize_backward`), which waits for every bucket in order and
//! copies each average into its parameter's `.grad` (or, with `gradient_as_bucket_view`, makes
//! `.grad` the bucket's view). With a communication hook, a bucket that starts goes to the
//! hook instead, and finalize waits for the hook's future in its place (Note [DDP comm hooks]
//! in `comm_hook.rs`). A bucket that never filled means some parameter received no
//! gradient: finalize reports [`Error::UnusedParameters`] (on every rank in the same state, so
//! no collective is left waiting on one rank while another goes on).
//!
//! Note [DDP unused parameters]: with `find_unused_parameters`, forward walks the graph from
//! its outputs ([`ember_core::autograd::reachable`]) and the parameters it does not reach are
//! marked ready (their slot zeroed) when the first hook runs, so their buckets complete. Which
//! parameters some rank used is all-reduced too; a parameter no rank used keeps its `.grad`
//! untouched, one that another rank used gets the average.
//!
//! Note [DDP one-parameter buckets]: a bucket that holds a single parameter (every parameter
//! larger than the bucket cap gets one) all-reduces that parameter's `.grad` where it lies
//! instead of copying it into the bucket and the average back out, when `.grad` is a dense
//! tensor of the bucket's dtype and device. `.grad` ends up holding the average either way, as
//! PyTorch's copy back into it leaves it; only the two copies are gone (mlp_large's 40 MB
//! and 200 MB weights: ddp_mlp_large on two H100s went from 3.25 to 3.04 ms per step). Not with `find_unused_parameters`, whose globally unused parameters must keep their
//! `.grad` untouched. With `gradient_as_bucket_view`, such a `.grad` stays a tensor of its own
//! rather than becoming a view of the bucket: no copy is made either way.
//!
//! Note [DDP bucket copies]: PyTorch copies each gradient into its bucket slot in the
//! gradient's hook and each average back into `.grad` after the all-reduce: two copies per
//! parameter per step, each a launch on the host (16 `copy_` calls per step of the bench's
//! eight-parameter cnn). Here the hook only records the gradient; when the bucket starts, its
//! gradients go into their slots with one `foreach_copy_`, and the averages come back with
//! another: one launch each way per bucket on a GPU (Note [Foreach copies] in ember-core), the
//! same copies pair by pair elsewhere. The stream order is unchanged for the bucket's last
//! gradient, and the earlier ones could not be all-reduced sooner anyway. A hook registered
//! after DDP's that changes `.grad` in place before the bucket starts changes what is reduced
//! (PyTorch would reduce the value the gradient had at DDP's hook).
//!
//! Note [DDP row blocks]: the first layer's weight gradient is the last one backward makes,
//! and the largest (mlp_large: 200 MB of 240 MB), so its all-reduce had nothing left to
//! overlap, and the optimizer step waited for all of it. Over more than one rank, a
//! one-parameter bucket of a 2-D float weight on a GPU of at least two [`ROW_BLOCK_BYTES`] (at
//! most [`MAX_ROW_BLOCKS`]) has its gradient computed in row blocks, an event after each (Note
//! [Gradients in row blocks] in ember-core), and all-reduced block by block, each after its
//! event, so the first rows travel while the last ones are computed. The one-parameter
//! buckets from the first such bucket on are handed on as they arrive as soon as their
//! all-reduces start (`cuda::arriving_in_row_blocks`, Note [Arrivals in row blocks] in
//! ember-core): the current stream does not wait for them, the fused Adam step updates each
//! block once its all-reduce is done (and the other parameters first), and every other op
//! waits for the whole.
//! - The blocks are always all-reduced separately, events or not (a gradient summed from two
//!   uses, one computed under capture), so every rank issues the same collectives.
//! - A block's all-reduce is issued from a side stream that waits for the block's event: the
//!   NCCL stream waits for the caller's current stream, here that side stream.
//! - Such a bucket goes before the bucket its parameter closed (`compute_bucket_assignment_by_size`):
//!   that one ends with the gradients the same backward node makes after the weight's (the
//!   layer's bias), so started first, its all-reduce waited for the whole product and held the
//!   blocks' all-reduces behind it on the NCCL stream (a CUPTI trace showed all four after the
//!   product). The bias's bucket, now last, is handed on too, so the optimizer step of the
//!   other parameters does not wait for it.
//! - Buckets of several parameters are waited for as before: their averages are copied back
//!   into `.grad` on the current stream.
//! - Under CUDA graph capture everything is waited for (a side stream would have to rejoin the
//!   capture). Over one rank nothing is all-reduced, and the blocks would only slow the
//!   product (ddp_mlp_large at N=1: 2.31 against 2.22 ms per step).
//! - Two H100s, ddp_mlp_large at N=2: 2.96 ms per step before; blocks alone (the end of
//!   backward waiting for them) 2.80; blocks handed on to Adam 2.66 (N=1 2.22: 83% scaling).
//! - Where the rest goes (two H200s, CUPTI traces of one rank per process): at N=2 the
//!   compute stream is busy 2.41-2.43 ms of a 2.49-2.51 ms step, with no gap over 20 us; the
//!   all-reduces end ~50 us before the Adam block that reads them. The step is longer than one
//!   GPU's (2.09 ms) because its kernels run beside NCCL's, which take SMs and memory
//!   bandwidth: the first layer's four gradient blocks 785 us against 550 us for the whole
//!   product alone, the Adam updates 662 against 492 us. Other block counts and NCCL settings
//!   (ms per step at N=2, two runs, four blocks 2.486-2.489 in both): 3 blocks
//!   2.440-2.442, 2 blocks 2.455-2.465, 1 block 2.827-2.830, 8 blocks of 16 MiB 2.634-2.638;
//!   NCCL_MAX_NCHANNELS=8 3.03-3.04 and =4 4.48 (the all-reduces no longer hidden);
//!   NCCL_MIN_NCHANNELS=16 or 32, NCCL_ALGO=Ring, NCCL_PROTO=Simple or LL128,
//!   NCCL_CTA_POLICY=1 all 2.48-2.49; NCCL_NTHREADS=256 2.76. A third run (one machine,
//!   three rounds each) confirmed three blocks: 2.448, 2.455, 2.448 against four 2.502, 2.499,
//!   2.504 (N=1 2.098-2.102), so at most three: 85.7% scaling.
//!   Updating the first layer's blocks on a side stream as they arrive (tried, reverted)
//!   slowed the step to 2.62 ms: the updates ran beside the all-reduces and products and were
//!   slowed by them.
//!
//! Note [DDP early copy back]: on a GPU outside capture (and without `find_unused_parameters`,
//! `gradient_as_bucket_view` or a hook), a bucket of several parameters reduced after the
//! first bucket all-reduced in row blocks (Note [DDP row blocks]) has its averages copied back
//! into `.grad` as soon as its all-reduce is issued, on the reducer's side stream, which waits
//! for the all-reduce, and each gradient is handed on as arriving whole, an event after its
//! copy (Note [Arrivals in row blocks] in ember-core). Finalize used to wait for such a bucket
//! and copy it back on the compute stream, behind the all-reduces of the row blocks before it,
//! so the optimizer step of every parameter waited for all of them: in GPT-2 124M the tied
//! embedding's gradient is complete only after the last node of backward (its 154 MB
//! all-reduced in three blocks, 740 us after backward in a CUPTI trace of ddp_gpt2 on two
//! H200s, then the whole 1 ms Adam step). Now the fused Adam step updates the other
//! parameters while those all-reduces run, then the arrivals in the order they were reduced:
//! 1.47 ms from the end of backward to the end of the step against 1.77 in the same kind of
//! trace (session 53 runs 3 and 5), though ddp_gpt2's step time at N = 2 moved within the
//! runs' noise (19.28, 19.81, 19.52 ms; docs/benchmarks.md).
//! An op that reads such a gradient waits for its copy: a hook after DDP's reading `.grad`
//! in backward sees the average, where PyTorch's sees the local gradient until the end of
//! backward. The buckets before keep finalize's copy. Copying every bucket early made
//! backward 350 us longer in session 53's trace, the host's time between kernels, when every
//! allocation still queried every pending event. Once the caching allocator queried only each
//! stream's oldest (ember-core's `allocator/mod.rs`), every bucket early was the faster: it
//! takes the buckets' 290 us of copies off the compute stream at the end of backward
//! (ddp_gpt2 at N = 2 on two H200s, alternating in one run: 19.29, 19.29, 19.39 ms a step
//! against 19.53, 19.63, 19.52 for the tail only; session 54 run 7, unwrapped 16.93;
//! docs/benchmarks.md). Tried in session 55 and reverted: its GPU tests passed (distributed
//! `it` 85 of 85) and ddp_gpt2 took 19.17 ms at N = 2 (scaling 0.878, against 0.879 in
//! session 54's run 6), but `cli`'s replicated GPT-2 then followed the sharded one less
//! closely: mean |loss difference| 0.0096 over 60 steps, against 0.0008 in sessions 53 and 54
//! (the same curves had 0.179 when list ops did not wait for arriving gradients). Copies alone
//! cannot change values, and the test repeats: `ember train`'s replicated GPT-2 with the
//! tail-only copy, run twice with the test's arguments on two H200s, gave 60 losses equal to
//! the bit (session 56). So with every bucket early some reader of `.grad` most likely does
//! not wait for an early copy, or a copy starts before its all-reduce ends; it is not found.
//! The condition is `first_blocked.is_some_and(|f| index > f)` in `mark_variable_ready`;
//! `first_blocked.is_some()` copies every bucket early. Before adopting it, find that reader
//! and run the cli test twice.
//! A slot with no `.grad`, or whose `.grad` was replaced since its hook, is written by finalize
//! as before, after the all-reduce; so is a bucket with a 0-d or strided gradient, which cannot
//! arrive.
//!
//! Locking: one mutex over the reducer's state, taken by the hooks and by finalize (all on the
//! thread running backward) and by forward; never held while calling into autograd.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use ember_core::{autograd, cuda, DType, Device, Error, Result, Tensor};

use super::comm_hook::{BoxedCommHook, CommFuture, GradBucket};
use crate::backend::{ReduceOp, Work};
use crate::group::ProcessGroup;

/// 1 MiB: the size limit of the first bucket (`dist._DEFAULT_FIRST_BUCKET_BYTES`).
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;
/// 25 MiB: the size limit of later buckets (`bucket_cap_mb`'s default).
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// The size of one row block of a large weight's gradient (Note [DDP row blocks]).
const ROW_BLOCK_BYTES: usize = 32 << 20;
/// At most this many row blocks per gradient (three measured faster than four and two).
const MAX_ROW_BLOCKS: usize = 3;

/// The row blocks a one-parameter bucket's gradient is computed and all-reduced in (Note [DDP
/// row blocks]): 2-D float weights on a GPU of at least two blocks; 0 for the others.
fn row_blocks(p: &Tensor) -> usize {
    match p.rank() == 2 && p.dtype().is_floating_point() && matches!(p.device(), Device::Cuda(_)) {
        true => row_blocks_of(p.numel() * p.dtype().size_in_bytes()),
        false => 0,
    }
}

/// [`row_blocks`] of a weight of `bytes`: 0 below two blocks (one block would still ask
/// `set_gradient_row_blocks` for an event after the product, which nothing here takes).
fn row_blocks_of(bytes: usize) -> usize {
    match (bytes / ROW_BLOCK_BYTES).min(MAX_ROW_BLOCKS) {
        b if b >= 2 => b,
        _ => 0,
    }
}

/// One flat tensor holding the gradients of some parameters, and its reduction.
struct Bucket {
    /// The parameters (indices into `Reducer::params`), in slot order.
    params: Vec<usize>,
    /// The flat tensor all slots view; what is all-reduced.
    flat: Tensor,
    /// One view of `flat` per slot, shaped as its parameter.
    views: Vec<Tensor>,
    /// Slots not yet ready in this backward pass.
    pending: usize,
    /// Row blocks of the one parameter's gradient, all-reduced one by one (Note [DDP row
    /// blocks]); 0 or 1: the bucket in one all-reduce.
    row_blocks: usize,
    /// The all-reduce (one per row block), once started.
    work: Vec<Work>,
    /// What the communication hook returned for this pass, instead of `work` (Note [DDP comm
    /// hooks]): one future, or one per row block for a built-in hook.
    futures: Vec<CommFuture>,
    /// What this pass all-reduces instead of `flat`: the one parameter's own `.grad` (Note
    /// [DDP one-parameter buckets]).
    in_place: Option<Tensor>,
    /// Per slot: the gradient to copy into the slot when the bucket starts (Note [DDP bucket
    /// copies]).
    gathered: Vec<Option<Tensor>>,
    /// Gradients the average was copied back into as soon as the all-reduce started, on the
    /// side stream, handed on as arriving (Note [DDP early copy back]).
    copied_back: Vec<Tensor>,
    /// `in_place` was handed on as arriving when its all-reduce started (Note [DDP row
    /// blocks]).
    handed_on: bool,
}

/// What changes while training.
struct State {
    buckets: Vec<Bucket>,
    /// Per parameter: (bucket, slot).
    locator: Vec<(usize, usize)>,
    /// The next bucket to start (Note [DDP reduction order]).
    next_bucket: usize,
    /// Per parameter: marked ready in this backward pass.
    ready: Vec<bool>,
    /// Set by `prepare_for_backward`: the next backward pass synchronizes.
    expect_autograd_hooks: bool,
    /// The end-of-backward callback is queued (a hook of this pass ran).
    callback_queued: bool,
    /// Parameters that forward did not reach (with `find_unused_parameters`).
    unused_parameters: Vec<usize>,
    has_marked_unused_parameters: bool,
    /// Per parameter: reached by this rank's backward (with `find_unused_parameters`).
    locally_used: Vec<bool>,
    has_rebuilt_buckets: bool,
    /// The order the gradients became ready in, recorded until the buckets are rebuilt.
    rebuilt_param_order: Vec<usize>,
    /// Per parameter: the row blocks its gradient is all-reduced in (Note [DDP row blocks]);
    /// 0 over one rank, where nothing is all-reduced, and with a hook that is not a built-in.
    row_blocks: Vec<usize>,
    /// The side stream that waits for the all-reduces on a GPU (Note [DDP row blocks], Note
    /// [DDP early copy back]), made on first use.
    side: Option<cuda::Stream>,
}

/// Reduces the gradients of `params` across a process group (see the module notes).
pub(crate) struct Reducer {
    params: Vec<Tensor>,
    names: Vec<String>,
    group: ProcessGroup,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
    /// Bucket size limits in bytes: first bucket, then the rest.
    limits: [usize; 2],
    /// The communication hook that reduces each bucket instead of the built-in average (Note
    /// [DDP comm hooks]); set at most once.
    comm_hook: OnceLock<BoxedCommHook>,
    state: Mutex<State>,
}

impl Reducer {
    /// A reducer over `params` (named `names`), with the buckets of the first iteration, and
    /// a post-accumulate-grad hook on every parameter (removed when `hooks` are dropped).
    pub(crate) fn new(
        params: Vec<Tensor>,
        names: Vec<String>,
        group: ProcessGroup,
        limits: [usize; 2],
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
    ) -> Result<(Arc<Reducer>, Vec<ember_core::HookHandle>)> {
        let n = params.len();
        let order: Vec<usize> = (0..n).rev().collect();
        let blocks: Vec<usize> = match group.size() {
            1 => vec![0; n],
            _ => params.iter().map(row_blocks).collect(),
        };
        let assignment = compute_bucket_assignment_by_size(&params, &order, &limits, true, |i| blocks[i] > 1);
        let (buckets, locator) = build_buckets(&params, &assignment, &blocks)?;
        let reducer = Arc::new(Reducer {
            params,
            names,
            group,
            find_unused_parameters,
            gradient_as_bucket_view,
            limits,
            comm_hook: OnceLock::new(),
            state: Mutex::new(State {
                buckets,
                locator,
                next_bucket: 0,
                ready: vec![false; n],
                expect_autograd_hooks: false,
                callback_queued: false,
                unused_parameters: Vec::new(),
                has_marked_unused_parameters: false,
                locally_used: vec![false; n],
                has_rebuilt_buckets: false,
                rebuilt_param_order: Vec::new(),
                row_blocks: blocks,
                side: None,
            }),
        });
        let mut hooks = Vec::with_capacity(n);
        for (index, p) in reducer.params.iter().enumerate() {
            let weak = Arc::downgrade(&reducer);
            hooks.push(
                p.register_post_accumulate_grad_hook(move |_| match weak.upgrade() {
                    Some(r) => r.autograd_hook(index, &weak),
                    None => Ok(()),
                })?,
            );
        }
        Ok((reducer, hooks))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops computing the parameters' gradients in row blocks (DDP is dropped).
    pub(crate) fn release_row_blocks(&self) {
        let st = self.lock();
        for (p, _) in self.params.iter().zip(&st.row_blocks).filter(|(_, &b)| b > 1) {
            // Cannot fail: a 2-D tensor on a GPU.
            let _ = cuda::set_gradient_row_blocks(p, 0);
        }
    }

    /// The parameters of each bucket, in reduction order (indices into the parameter list).
    pub(crate) fn bucket_indices(&self) -> Vec<Vec<usize>> {
        self.lock().buckets.iter().map(|b| b.params.clone()).collect()
    }

    pub(crate) fn has_rebuilt_buckets(&self) -> bool {
        self.lock().has_rebuilt_buckets
    }

    /// Sets the communication hook (Note [DDP comm hooks]); an error when one is set already.
    /// Before the first forward: unless the hook reduces a bucket `by_blocks` (a built-in
    /// one), the buckets of the first iteration are made again without row blocks (a hook sees
    /// whole buckets).
    pub(crate) fn set_comm_hook(&self, hook: BoxedCommHook, by_blocks: bool) -> Result<()> {
        let mut st = self.lock();
        if self.comm_hook.set(hook).is_err() {
            return Err(Error::invalid(
                "DistributedDataParallel::register_comm_hook",
                "a communication hook is registered already, and it can only be registered once; \
                 register one hook that does all the work (it may call others)",
            ));
        }
        if !by_blocks && st.row_blocks.iter().any(|&b| b > 1) {
            st.row_blocks.iter_mut().for_each(|b| *b = 0);
            let order: Vec<usize> = (0..self.params.len()).rev().collect();
            let assignment =
                compute_bucket_assignment_by_size(&self.params, &order, &self.limits, true, |_| false);
            let (buckets, locator) = build_buckets(&self.params, &assignment, &st.row_blocks)?;
            st.buckets = buckets;
            st.locator = locator;
        }
        Ok(())
    }

    /// Arms the hooks for the backward pass of the forward that produced `outputs`
    /// (PyTorch's `prepare_for_backward`); with `find_unused_parameters`, finds the parameters
    /// the outputs do not reach. An error when the previous synchronizing backward did not
    /// finish its reduction.
    pub(crate) fn prepare_for_backward(&self, outputs: &[Tensor]) -> Result<()> {
        let mut st = self.lock();
        if st.callback_queued || st.next_bucket > 0 {
            reset_iteration(&mut st);
            return Err(Error::invalid(
                "DistributedDataParallel",
                "expected to have finished reduction in the prior iteration before starting a new one: \
                 its backward pass failed or was interrupted; the ranks may now disagree, so restart the job",
            ));
        }
        reset_iteration(&mut st);
        st.expect_autograd_hooks = true;
        if self.find_unused_parameters {
            let reached = autograd::reachable(outputs, &self.params);
            st.unused_parameters = (0..self.params.len()).filter(|&i| !reached[i]).collect();
        }
        Ok(())
    }

    /// Disarms the hooks (a forward that will not synchronize).
    pub(crate) fn disarm(&self) {
        self.lock().expect_autograd_hooks = false;
    }

    /// The hook of parameter `index`: its gradient was just accumulated into `.grad`.
    fn autograd_hook(&self, index: usize, weak: &Weak<Reducer>) -> Result<()> {
        let mut st = self.lock();
        if !st.expect_autograd_hooks {
            return Ok(()); // under no_sync, or forward ran without grad
        }
        if self.find_unused_parameters {
            st.locally_used[index] = true;
        }
        if !st.callback_queued {
            st.callback_queued = true;
            let weak = weak.clone();
            autograd::queue_callback(move || match weak.upgrade() {
                Some(r) => r.finalize_backward(),
                None => Ok(()),
            })?;
        }
        if !st.has_marked_unused_parameters {
            st.has_marked_unused_parameters = true;
            for u in std::mem::take(&mut st.unused_parameters) {
                self.mark_variable_ready(&mut st, u)?;
            }
        }
        self.mark_variable_ready(&mut st, index)
    }

    /// Takes parameter `index`'s gradient for its slot (zeros the slot without one) and starts the
    /// buckets that are complete, in order (Note [DDP reduction order]).
    fn mark_variable_ready(&self, st: &mut State, index: usize) -> Result<()> {
        if std::mem::replace(&mut st.ready[index], true) {
            return Err(Error::Autograd(format!(
                "DistributedDataParallel: parameter {index} ({}) was marked ready twice in one backward pass; \
                 run one backward per forward (retain_graph backward twice is not supported)",
                self.names[index]
            )));
        }
        if !st.has_rebuilt_buckets {
            st.rebuilt_param_order.push(index);
        }
        let (b, slot) = st.locator[index];
        let bucket = &mut st.buckets[b];
        let view = &bucket.views[slot];
        match self.params[index].grad() {
            Some(g) if same_tensor(&g, view) => {}
            Some(g)
                if bucket.params.len() == 1
                    && !self.find_unused_parameters
                    && reducible_in_place(&g, &bucket.flat) =>
            {
                bucket.in_place = Some(g);
            }
            Some(g) => {
                bucket.gathered[slot] = Some(g);
            }
            None => {
                view.zero_()?;
            }
        }
        bucket.pending -= 1;
        let n_buckets = st.buckets.len();
        let side = match st.buckets[st.next_bucket.min(n_buckets - 1)].pending {
            0 => self.hand_on_stream(st)?,
            _ => None,
        };
        // Only where buckets are handed on (Note [DDP row blocks]).
        let first_blocked = side
            .as_ref()
            .and_then(|_| st.buckets.iter().position(|b| b.row_blocks > 1));
        while st.next_bucket < n_buckets && st.buckets[st.next_bucket].pending == 0 {
            let index = st.next_bucket;
            let next = &mut st.buckets[index];
            let (views, grads): (Vec<Tensor>, Vec<Tensor>) = next
                .gathered
                .iter_mut()
                .zip(&next.views)
                .filter_map(|(g, v)| g.take().map(|g| (v.clone(), g)))
                .unzip();
            ember_core::foreach_copy_(&views, &grads)?;
            let target = next.in_place.as_ref().unwrap_or(&next.flat);
            match self.comm_hook.get() {
                Some(hook) => {
                    let bucket = self.grad_bucket(next, index, n_buckets)?;
                    let dims = self.params[next.params[0]].dims().to_vec();
                    next.futures = self.hook_in_row_blocks(hook, &bucket, &dims, next.row_blocks)?;
                }
                None => {
                    let dims = self.params[next.params[0]].dims().to_vec();
                    next.work = self.all_reduce_in_row_blocks(target, &dims, next.row_blocks)?;
                    match (&side, &next.in_place) {
                        (Some(side), Some(g)) if first_blocked.is_some_and(|f| index >= f) => {
                            hand_on(g, next.row_blocks, &next.work, side)?;
                            next.handed_on = true;
                        }
                        (Some(side), None)
                            if first_blocked.is_some_and(|f| index > f)
                                && !self.find_unused_parameters
                                && !self.gradient_as_bucket_view =>
                        {
                            next.copied_back = copy_back_early(&next.work, grads, &views, &next.flat, side)?;
                        }
                        _ => {}
                    }
                }
            }
            st.next_bucket += 1;
        }
        Ok(())
    }

    /// The side stream on which gradients are handed on as arriving as soon as their
    /// all-reduce starts (Note [DDP row blocks], Note [DDP early copy back]): on a GPU outside
    /// capture and without a hook; None where finalize waits for every bucket.
    fn hand_on_stream(&self, st: &mut State) -> Result<Option<cuda::Stream>> {
        match self.group.device() {
            Device::Cuda(d) if self.comm_hook.get().is_none() && !cuda::is_current_stream_capturing() => {
                if st.side.is_none() {
                    st.side = Some(cuda::Stream::new_on(d)?);
                }
                Ok(st.side.clone())
            }
            _ => Ok(None),
        }
    }

    /// What the communication hook sees of bucket `index` of `count`, full and about to be
    /// reduced: its flat buffer (the one parameter's own `.grad` when the bucket reduces that
    /// in place), its parameters and their offsets.
    fn grad_bucket(&self, bucket: &Bucket, index: usize, count: usize) -> Result<GradBucket> {
        let buffer = match &bucket.in_place {
            Some(g) => g.reshape([g.numel()])?,
            None => bucket.flat.clone(),
        };
        let mut offsets = Vec::with_capacity(bucket.params.len());
        let mut at = 0;
        for &i in &bucket.params {
            offsets.push(at);
            at += self.params[i].numel();
        }
        Ok(GradBucket {
            index,
            is_last: index + 1 == count,
            buffer,
            parameters: bucket.params.iter().map(|&i| self.params[i].clone()).collect(),
            offsets,
            group: self.group.clone(),
        })
    }

    /// Starts the averaging all-reduce of `t`, the flat gradient of a parameter of `dims`, in
    /// `blocks` row blocks, each after its rows are computed when the gradient was computed in
    /// those blocks (Note [DDP row blocks]); one all-reduce for `blocks` below 2.
    fn all_reduce_in_row_blocks(&self, t: &Tensor, dims: &[usize], blocks: usize) -> Result<Vec<Work>> {
        if blocks < 2 {
            return Ok(vec![self.group.all_reduce_async(t, ReduceOp::Avg)?]);
        }
        let Device::Cuda(device) = t.device() else {
            return Ok(vec![self.group.all_reduce_async(t, ReduceOp::Avg)?]);
        };
        after_row_blocks(device, t, dims, blocks, |part| {
            self.group.all_reduce_async(part, ReduceOp::Avg)
        })
    }

    /// Calls the communication hook on `bucket`, or, for a built-in hook and a bucket of one
    /// parameter of `dims` whose gradient is computed in `blocks` row blocks, on each block's
    /// part of the buffer once the block is computed (Note [DDP comm hooks]).
    fn hook_in_row_blocks(
        &self,
        hook: &BoxedCommHook,
        bucket: &GradBucket,
        dims: &[usize],
        blocks: usize,
    ) -> Result<Vec<CommFuture>> {
        let buffer = bucket.buffer();
        match buffer.device() {
            // Blocks only for a built-in hook: the others' buckets have none (`set_comm_hook`).
            Device::Cuda(device) if blocks > 1 => {
                let compute = cuda::current_stream(device)?;
                after_row_blocks(device, buffer, dims, blocks, |part| {
                    let future = hook(&GradBucket {
                        buffer: part.clone(),
                        ..bucket.clone()
                    })?;
                    // Read by the continuation, on the compute stream.
                    future.record_value_stream(&compute)?;
                    Ok(future)
                })
            }
            _ => Ok(vec![hook(bucket)?]),
        }
    }

    /// The end-of-backward callback (PyTorch's `finalize_backward`): waits for every bucket
    /// and writes the averages into `.grad`; rebuilds the buckets after the first iteration.
    fn finalize_backward(&self) -> Result<()> {
        let mut st = self.lock();
        st.expect_autograd_hooks = false;
        if st.next_bucket < st.buckets.len() {
            // Some bucket never filled: wait for the ones started (so that this rank's group
            // stays in step with the others), then report which parameters got no gradient.
            let names: Vec<String> = (0..self.params.len())
                .filter(|&i| !st.ready[i])
                .map(|i| self.names[i].clone())
                .collect();
            let started: Vec<Work> = st.buckets.iter().flat_map(|b| b.work.clone()).collect();
            let futures: Vec<CommFuture> = st
                .buckets
                .iter_mut()
                .flat_map(|b| std::mem::take(&mut b.futures))
                .collect();
            reset_iteration(&mut st);
            drop(st);
            for w in started {
                w.wait()?;
            }
            for f in futures {
                f.wait()?;
            }
            return Err(Error::UnusedParameters {
                op: "DistributedDataParallel",
                names,
            });
        }
        let globally_used = if self.find_unused_parameters {
            let used: Vec<i32> = st.locally_used.iter().map(|&u| u as i32).collect();
            let n = used.len();
            let used = Tensor::from_vec(used, n, Device::Cpu)?.to(self.group.device())?;
            self.group.all_reduce(&used, ReduceOp::Max)?;
            Some(
                used.to_vec::<i32>()?
                    .into_iter()
                    .map(|u| u != 0)
                    .collect::<Vec<bool>>(),
            )
        } else {
            None
        };
        // Note [DDP row blocks], Note [DDP early copy back]: what was handed on as arriving
        // when its all-reduce started is not waited for; the rest is, here.
        for b in 0..st.buckets.len() {
            let works = std::mem::take(&mut st.buckets[b].work);
            let futures = std::mem::take(&mut st.buckets[b].futures);
            let copied = std::mem::take(&mut st.buckets[b].copied_back);
            let early = !copied.is_empty();
            let bucket = &st.buckets[b];
            if !futures.is_empty() {
                let target = bucket.in_place.as_ref().unwrap_or(&bucket.flat);
                let dims = self.params[bucket.params[0]].dims().to_vec();
                let parts = row_block_parts(target, &dims, futures.len())?;
                for (future, part) in futures.into_iter().zip(&parts) {
                    write_hook_result(b, future.wait()?, part)?;
                }
            }
            // A copy back waited for the all-reduce; a slot it missed waits below.
            if !(bucket.handed_on || early) {
                works.iter().try_for_each(Work::wait)?;
            }
            if let Some(g) = &bucket.in_place {
                // Averaged where it lies, unless a hook replaced `.grad` since.
                let i = bucket.params[0];
                match self.params[i].grad() {
                    Some(now) if same_tensor(&now, g) => {}
                    _ => self.params[i].set_grad(Some(g.clone()))?,
                }
                continue;
            }
            // The averages go back into the gradients as one copy (Note [DDP bucket copies]),
            // unless they went back as the all-reduce started (Note [DDP early copy back]).
            let (mut grads, mut views, mut from_bucket) = (Vec::new(), Vec::new(), Vec::new());
            for (slot, &i) in bucket.params.iter().enumerate() {
                if globally_used.as_ref().is_some_and(|u| !u[i]) {
                    continue; // no rank used it: its .grad stays as it was
                }
                let view = &bucket.views[slot];
                match self.params[i].grad() {
                    // Averaged already, arriving.
                    Some(g) if copied.iter().any(|c| same_tensor(c, &g)) => {}
                    Some(g) if !self.gradient_as_bucket_view && !g.shares_storage_with(view) => {
                        grads.push(g);
                        views.push(view.clone());
                    }
                    _ => from_bucket.push((i, view.clone())),
                }
            }
            if early && !(grads.is_empty() && from_bucket.is_empty()) {
                works.iter().try_for_each(Work::wait)?;
            }
            for (i, view) in from_bucket {
                self.set_grad_from_bucket(i, &view)?;
            }
            ember_core::foreach_copy_(&grads, &views)?;
        }
        let rebuild = !st.has_rebuilt_buckets && !self.find_unused_parameters;
        let order = std::mem::take(&mut st.rebuilt_param_order);
        reset_iteration(&mut st);
        if rebuild {
            self.rebuild_buckets(&mut st, order)?;
        }
        Ok(())
    }

    /// Sets `.grad` of a parameter whose average the batched copy back does not cover: the
    /// bucket's view with `gradient_as_bucket_view`, else a copy of it (no `.grad` to copy into,
    /// or one that is itself a view of the bucket).
    fn set_grad_from_bucket(&self, index: usize, view: &Tensor) -> Result<()> {
        let p = &self.params[index];
        if self.gradient_as_bucket_view {
            return p.set_grad(Some(view.clone()));
        }
        p.set_grad(Some(view.deep_clone()?))
    }

    /// Rebuilds the buckets from the order the gradients became ready in, rank 0's order for
    /// all (PyTorch's `rebuild_buckets` and `sync_bucket_indices`); a collective.
    fn rebuild_buckets(&self, st: &mut State, mut order: Vec<usize>) -> Result<()> {
        let n = self.params.len();
        if order.len() != n {
            // Cannot happen after a complete reduction; keep the current buckets.
            return Ok(());
        }
        let shared = Tensor::from_vec(
            order.iter().map(|&i| i as i64).collect::<Vec<i64>>(),
            n,
            Device::Cpu,
        )?
        .to(self.group.device())?;
        self.group.broadcast(&shared, self.group.global_rank(0)?)?;
        order = shared.to_vec::<i64>()?.into_iter().map(|i| i as usize).collect();
        let blocked = |i: usize| st.row_blocks[i] > 1;
        let assignment =
            compute_bucket_assignment_by_size(&self.params, &order, &self.limits, false, blocked);
        let (buckets, locator) = build_buckets(&self.params, &assignment, &st.row_blocks)?;
        st.buckets = buckets;
        st.locator = locator;
        st.has_rebuilt_buckets = true;
        Ok(())
    }
}

/// Hands `grad`, averaged in place by `works` (one per row block of `blocks`, or one for the
/// whole), on as arriving (Note [Arrivals in row blocks] in ember-core): `side` waits for each
/// all-reduce and marks its end with an event, and the current stream waits for none of them.
/// A gradient that cannot arrive in row blocks (0-d, strided) is waited for instead.
fn hand_on(grad: &Tensor, blocks: usize, works: &[Work], side: &cuda::Stream) -> Result<()> {
    if grad.rank() == 0 || !grad.is_contiguous() || grad.storage_offset() != 0 {
        return works.iter().try_for_each(Work::wait);
    }
    let rows = match works.len() {
        1 => vec![0..grad.dims()[0]],
        _ => cuda::row_block_ranges(grad.dims()[0], blocks),
    };
    let mut arrivals = Vec::with_capacity(works.len());
    {
        // One side stream waits for each block's end in turn and records an event after each:
        // the events complete in block order, as the all-reduces do.
        let _on_side = cuda::stream(side);
        for (rows, work) in rows.into_iter().zip(works) {
            work.wait()?;
            arrivals.push(cuda::RowBlockEvent {
                rows,
                event: side.record_event()?,
            });
        }
    }
    cuda::arriving_in_row_blocks(grad, arrivals)
}

/// Runs `start` on each row block's part of `t` (the gradient of a weight of `dims`, computed
/// in `blocks` row blocks, or its flat copy), in block order (Note [DDP row blocks]): a block
/// whose event the product recorded is started from a side stream that waits for that event,
/// so the first rows travel while the last ones are computed; the others on the current stream.
fn after_row_blocks<T>(
    device: usize,
    t: &Tensor,
    dims: &[usize],
    blocks: usize,
    mut start: impl FnMut(&Tensor) -> Result<T>,
) -> Result<Vec<T>> {
    let computed = match cuda::is_current_stream_capturing() {
        true => None,
        false => cuda::take_gradient_row_events(t),
    };
    // One side stream for all blocks: it waits for each block's event in turn. High priority,
    // as the NCCL stream: a built-in hook's cast of a block (Note [DDP comm hooks]) runs on it
    // beside the next block's product, and at the default priority waited for that product's
    // last wave (ddp_mlp_large with the bf16 hook on two H200s: the first block's cast began
    // 200 us after its rows were done).
    let side = cuda::Stream::with_priority_on(device, -1)?;
    let ranges = cuda::row_block_ranges(dims[0], blocks);
    let mut started = Vec::with_capacity(ranges.len());
    for (r, part) in ranges.iter().zip(row_block_parts(t, dims, blocks)?) {
        match computed.iter().flatten().find(|b| b.rows == *r) {
            Some(block) => {
                side.wait_event(&block.event)?;
                let _on_side = cuda::stream(&side);
                started.push(start(&part)?);
            }
            None => started.push(start(&part)?),
        }
    }
    Ok(started)
}

/// The flat parts of `t` (a weight's gradient of `dims`, or its flat copy) that hold its
/// `blocks` row blocks; `t` whole, flat, for `blocks` below 2.
fn row_block_parts(t: &Tensor, dims: &[usize], blocks: usize) -> Result<Vec<Tensor>> {
    let flat = t.reshape(&[-1])?;
    if blocks < 2 {
        return Ok(vec![flat]);
    }
    let cols = dims[1];
    cuda::row_block_ranges(dims[0], blocks)
        .into_iter()
        .map(|r| flat.narrow(0, r.start * cols, r.len() * cols))
        .collect()
}

/// Copies the averages of a bucket (`views` of its `flat` tensor) back into `grads` on `side`
/// once `works`, the bucket's all-reduce, is done, and hands each gradient on as arriving whole
/// after its copy (Note [DDP early copy back]); the gradients copied (none when one cannot
/// arrive in row blocks: 0-d or strided, left to finalize). Both sides are marked used on
/// `side`, so the caching allocator hands neither out again before the copy has run.
fn copy_back_early(
    works: &[Work],
    grads: Vec<Tensor>,
    views: &[Tensor],
    flat: &Tensor,
    side: &cuda::Stream,
) -> Result<Vec<Tensor>> {
    let arrivable = |g: &Tensor| g.rank() > 0 && g.is_contiguous() && g.storage_offset() == 0;
    if grads.is_empty() || !grads.iter().all(arrivable) {
        return Ok(Vec::new());
    }
    {
        let _on_side = cuda::stream(side);
        works.iter().try_for_each(Work::wait)?;
        ember_core::foreach_copy_(&grads, views)?;
    }
    flat.record_stream(side)?;
    for g in &grads {
        g.record_stream(side)?;
        let rows = 0..g.dims()[0];
        let event = side.record_event()?;
        cuda::arriving_in_row_blocks(g, vec![cuda::RowBlockEvent { rows, event }])?;
    }
    Ok(grads)
}

/// Whether `a` and `b` are the same tensor's data (the same storage, from the same element).
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage_with(b) && a.data_ptr() == b.data_ptr()
}

/// Puts what the communication hook returned for bucket `index` into the bucket's `target`
/// (its flat tensor, or the `.grad` it reduces in place), unless it is `target` itself.
fn write_hook_result(index: usize, value: Tensor, target: &Tensor) -> Result<()> {
    if value.numel() != target.numel() {
        return Err(Error::invalid(
            "DistributedDataParallel",
            format!(
                "the communication hook returned a tensor of {} elements ({:?}) for bucket {index}, which holds {}: \
                 its future's value must be the reduced bucket, shaped as bucket.buffer()",
                value.numel(),
                value.dims(),
                target.numel()
            ),
        ));
    }
    let same = same_tensor(&value, target) && value.dtype() == target.dtype() && value.is_contiguous();
    if !same {
        let dims: Vec<isize> = target.dims().iter().map(|&d| d as isize).collect();
        target.copy_(&value.reshape(dims)?)?;
    }
    Ok(())
}

/// Clears what one backward pass marked.
fn reset_iteration(st: &mut State) {
    st.rebuilt_param_order.clear();
    st.next_bucket = 0;
    st.ready.iter_mut().for_each(|r| *r = false);
    st.locally_used.iter_mut().for_each(|u| *u = false);
    st.callback_queued = false;
    st.expect_autograd_hooks = false;
    st.unused_parameters.clear();
    st.has_marked_unused_parameters = false;
    for b in &mut st.buckets {
        b.pending = b.params.len();
        b.work.clear();
        b.futures.clear();
        b.in_place = None;
        b.gathered.iter_mut().for_each(|g| *g = None);
        b.copied_back.clear();
        b.handed_on = false;
    }
}

/// PyTorch's `compute_bucket_assignment_by_size`: the parameters of `order` grouped into
/// buckets by (dtype, device), each closed once it holds `limits[k]` bytes (`k`: the bucket's
/// rank among its kind, the last limit repeating). Unlike PyTorch's, a parameter of at least
/// the limit by itself closes the open bucket before it and gets a bucket of its own, which it
/// all-reduces without copies (Note [DDP one-parameter buckets]). With `sort`, the buckets are
/// ordered by their first parameter's position in `order`; without it, closed buckets come in
/// the order they closed, the still-open ones last. Then a parameter for which `first` holds
/// (one whose gradient is all-reduced in row blocks, Note [DDP row blocks]) goes before the
/// bucket it closed: that bucket's last gradients are usually made by the same backward node
/// (a bias), after it, and started first its all-reduce would wait for the whole product that
/// the blocks' all-reduces are meant to overlap.
pub(crate) fn compute_bucket_assignment_by_size(
    params: &[Tensor],
    order: &[usize],
    limits: &[usize],
    sort: bool,
    first: impl Fn(usize) -> bool,
) -> Vec<Vec<usize>> {
    struct Open {
        kind: (DType, Device),
        indices: Vec<usize>,
        bytes: usize,
        limit: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut result: Vec<Vec<usize>> = Vec::new();
    // (first parameter of a closed bucket, the parameter that closed it and goes first)
    let mut swaps: Vec<(usize, usize)> = Vec::new();
    for &i in order {
        let p = &params[i];
        let kind = (p.dtype(), p.device());
        let k = match open.iter().position(|o| o.kind == kind) {
            Some(k) => k,
            None => {
                open.push(Open {
                    kind,
                    indices: Vec::new(),
                    bytes: 0,
                    limit: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[k];
        let bytes = p.numel() * p.dtype().size_in_bytes();
        if bytes >= limits[o.limit.min(limits.len() - 1)] && !o.indices.is_empty() {
            // A parameter that fills a bucket by itself gets one of its own.
            if first(i) {
                swaps.push((o.indices[0], i));
            }
            result.push(std::mem::take(&mut o.indices));
            o.bytes = 0;
            o.limit += 1;
        }
        o.indices.push(i);
        o.bytes += bytes;
        if o.bytes >= limits[o.limit.min(limits.len() - 1)] {
            result.push(std::mem::take(&mut o.indices));
            o.bytes = 0;
            o.limit += 1;
        }
    }
    result.extend(open.into_iter().map(|o| o.indices).filter(|b| !b.is_empty()));
    if sort {
        let position = |i: usize| order.iter().position(|&j| j == i).unwrap_or(usize::MAX);
        result.sort_by_key(|b| position(b[0]));
    }
    for (closed, big) in swaps {
        let at = |p: usize| result.iter().position(|b| b[0] == p);
        if let (Some(a), Some(b)) = (at(closed), at(big)) {
            if b == a + 1 {
                result.swap(a, b);
            }
        }
    }
    result
}

/// Whether a one-parameter bucket can all-reduce `grad` itself instead of `flat` (Note [DDP
/// one-parameter buckets]): a dense gradient of the bucket's dtype, device and size, not
/// already a view of the bucket.
fn reducible_in_place(grad: &Tensor, flat: &Tensor) -> bool {
    grad.is_contiguous()
        && grad.dtype() == flat.dtype()
        && grad.device() == flat.device()
        && grad.numel() == flat.numel()
        && !grad.shares_storage_with(flat)
}

/// The buckets of `assignment` (flat tensors and views) and each parameter's place in them.
fn build_buckets(
    params: &[Tensor],
    assignment: &[Vec<usize>],
    row_blocks: &[usize],
) -> Result<(Vec<Bucket>, Vec<(usize, usize)>)> {
    let mut locator = vec![(0, 0); params.len()];
    let mut buckets = Vec::with_capacity(assignment.len());
    for (b, indices) in assignment.iter().enumerate() {
        let first = &params[indices[0]];
        let total: usize = indices.iter().map(|&i| params[i].numel()).sum();
        let flat = Tensor::zeros([total], first.dtype(), first.device())?;
        let mut views = Vec::with_capacity(indices.len());
        let mut offset = 0;
        for (slot, &i) in indices.iter().enumerate() {
            let p = &params[i];
            let dims: Vec<isize> = p.dims().iter().map(|&d| d as isize).collect();
            views.push(flat.narrow(0, offset, p.numel())?.view(&dims)?);
            offset += p.numel();
            locator[i] = (b, slot);
        }
        let blocks = match indices[..] {
            [i] => row_blocks[i],
            _ => 0,
        };
        // Registered for gradients in row blocks exactly when alone in a bucket that uses them.
        for &i in indices {
            let p = &params[i];
            if matches!(p.device(), Device::Cuda(_)) && p.rank() == 2 {
                cuda::set_gradient_row_blocks(p, blocks)?;
            }
        }
        buckets.push(Bucket {
            params: indices.clone(),
            flat,
            views,
            pending: indices.len(),
            row_blocks: blocks,
            work: Vec::new(),
            futures: Vec::new(),
            in_place: None,
            gathered: vec![None; indices.len()],
            copied_back: Vec::new(),
            handed_on: false,
        });
    }
    Ok((buckets, locator))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(sizes: &[usize], dtype: DType) -> Vec<Tensor> {
        sizes
            .iter()
            .map(|&n| Tensor::zeros([n], dtype, Device::Cpu).unwrap())
            .collect()
    }

    #[test]
    fn first_bucket_small_later_ones_capped_in_reverse_order() {
        // f32: 4 bytes per element. Limits 16 B then 40 B.
        let p = params(&[2, 2, 3, 5, 1, 4], DType::F32);
        let order: Vec<usize> = (0..p.len()).rev().collect();
        let b = compute_bucket_assignment_by_size(&p, &order, &[16, 40], true, |_| false);
        // 5 (16 B) closes the first bucket; then 4,3,2 (9 el = 36 B) + 1 = 44 B >= 40.
        assert_eq!(b, vec![vec![5], vec![4, 3, 2, 1], vec![0]]);
    }

    #[test]
    fn a_parameter_as_large_as_the_limit_gets_a_bucket_of_its_own() {
        // Limits 16 B then 40 B: 5 and 4 (8 B + 12 B) fill the first bucket; 3 (8 B) opens the
        // next; 2 (48 B) is over the limit alone, so it closes [3] and goes alone; 1 and 0
        // share the last.
        let p = params(&[1, 1, 12, 2, 3, 2], DType::F32);
        let order: Vec<usize> = (0..p.len()).rev().collect();
        let b = compute_bucket_assignment_by_size(&p, &order, &[16, 40], true, |_| false);
        assert_eq!(b, vec![vec![5, 4], vec![3], vec![2], vec![1, 0]]);
    }

    #[test]
    fn only_weights_of_two_blocks_or_more_are_reduced_in_row_blocks() {
        const MIB: usize = 1 << 20;
        // mlp_large: the 40 MB second layer stays whole, the 200 MB first one takes three.
        assert_eq!(row_blocks_of(40_000_000), 0);
        assert_eq!(row_blocks_of(200_000_000), 3);
        assert_eq!(row_blocks_of(64 * MIB - 1), 0);
        assert_eq!(row_blocks_of(64 * MIB), 2);
        assert_eq!(row_blocks_of(100 * MIB), 3);
    }

    #[test]
    fn a_row_blocked_parameter_goes_before_the_bucket_it_closed() {
        // mlp_large's shape in reverse order (Note [DDP row blocks]): b3, W3, b2, W2, b1, W1,
        // limits 16 B then 40 B. W1 (index 0) closes [b1] and is all-reduced in row blocks:
        // its bucket goes first, so b1's does not hold up its blocks.
        let p = params(&[100, 1, 50, 2, 10, 1], DType::F32);
        let order: Vec<usize> = (0..p.len()).rev().collect();
        for sort in [true, false] {
            let plain = compute_bucket_assignment_by_size(&p, &order, &[16, 40], sort, |_| false);
            assert_eq!(plain, vec![vec![5], vec![4], vec![3], vec![2], vec![1], vec![0]]);
            let b = compute_bucket_assignment_by_size(&p, &order, &[16, 40], sort, |i| i == 0);
            assert_eq!(
                b,
                vec![vec![5], vec![4], vec![3], vec![2], vec![0], vec![1]],
                "sort {sort}"
            );
        }
        // A row-blocked parameter that closed no bucket stays where it is.
        let b = compute_bucket_assignment_by_size(&p, &order, &[16, 40], true, |i| i == 5);
        assert_eq!(b, vec![vec![5], vec![4], vec![3], vec![2], vec![1], vec![0]]);
    }

    #[test]
    fn dtypes_get_their_own_buckets_sorted_by_first_position() {
        let mut p = params(&[4, 4], DType::F32);
        p.extend(params(&[4], DType::F64));
        let order = [2, 1, 0];
        let b = compute_bucket_assignment_by_size(&p, &order, &[1 << 20], true, |_| false);
        assert_eq!(b, vec![vec![2], vec![1, 0]]);
        // Unsorted (a rebuild): closed buckets first, in closing order, then the open ones.
        let b = compute_bucket_assignment_by_size(&p, &[0, 2, 1], &[16], false, |_| false);
        assert_eq!(b, vec![vec![0], vec![2], vec![1]]);
    }

    #[test]
    fn views_tile_the_flat_bucket() {
        let p = vec![
            Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap(),
            Tensor::zeros([4], DType::F32, Device::Cpu).unwrap(),
        ];
        let (buckets, locator) = build_buckets(&p, &[vec![1, 0]], &[0, 0]).unwrap();
        assert_eq!(locator, [(0, 1), (0, 0)]);
        let b = &buckets[0];
        b.views[1].fill_(2.0).unwrap();
        b.views[0].fill_(1.0).unwrap();
        assert_eq!(b.views[1].dims(), [2, 3]);
        assert_eq!(
            b.flat.to_vec::<f32>().unwrap(),
            [1., 1., 1., 1., 2., 2., 2., 2., 2., 2.]
        );
    }
}
