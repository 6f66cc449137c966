//! Fully sharded data parallelism (`torch.distributed.fsdp.fully_shard`, FSDP2), first
//! version: [`fully_shard`] turns a module into an [`FSDPModule`] whose parameters are dim-0
//! shards ([`DTensor`] layout, Note [Shard layout] in `dtensor.rs`), gathered for its forward
//! and backward, with gradients reduce-scattered back onto the shards.
//!
//! Note [FSDP mechanism]: ember-nn has no forward hooks, so the module is wrapped instead of
//! hooked: [`FSDPModule`] owns the module, behind a lock, with every parameter field replaced
//! by an empty placeholder (one per parameter, tied fields sharing theirs), and keeps the local
//! shards (leaf tensors, what `parameters()` lists and the optimizer steps). Its forward:
//! 1. all-gathers every parameter in one flat collective (FSDP2's `FSDPParamGroup`): each rank
//!    packs its shards, each padded to `ceil(rows / world)` rows, into one buffer (cast to the
//!    [`MixedPrecisionPolicy`]'s `param_dtype`, all in one `foreach_copy_`), and
//!    `all_gather_into_tensor` makes `[world, S]`; one more `foreach_copy_` (FSDP2's copy-out)
//!    lays it out parameter by parameter, each parameter's `world` blocks one after another,
//!    so that each full parameter is a view, its padding rows dropped (Note [FSDP copy-out]);
//! 2. puts the full parameters into the fields that hold its placeholders (`visit_mut`,
//!    recognizing the placeholders by identity), runs the module's forward, and puts the
//!    placeholders back;
//! 3. autograd connects the full parameters to the shards through one custom node
//!    (`fsdp_all_gather`), whose backward receives the gradient of the whole buffer in that
//!    layout (the views' backward writes each full gradient into its place, zeros in the
//!    padding), lays it out as `[world, S]` again while casting it to `reduce_dtype` (one
//!    `foreach_copy_`) and reduce-scatters it with `ReduceOp::Avg`
//!    (`reduce_scatter_tensor`): each rank gets the average over ranks of its own rows, cast to
//!    the shards' dtype, which autograd accumulates into the shards' `.grad`. That is DDP's
//!    averaged gradient, cut to the rank's rows.
//!
//! Note [FSDP copy-out]: the all-gather's `[world, S]` holds a parameter's rows rank by rank,
//! each rank's block with every parameter's shard in it, so over two ranks or more a full
//! parameter was a strided view of it, and every use copied it (`contiguous`: 148 copies in a
//! step of fsdp_gpt2 on two GPUs, 1.6 ms of the host's 24 in a CUPTI trace, and their
//! backward nodes). One `foreach_copy_` per gather (on the all-gather stream, one launch per
//! 64 pieces) now lays the parameters out one after another, and the backward's gradient goes
//! back the other way in the cast it made anyway. Over one rank the two layouts are one and
//! nothing is copied. fsdp_gpt2 at N = 2 on two H200s: 19.83 ms a step before, 19.29 and
//! 19.11 after (session 53 runs 4, 5 and 7; docs/benchmarks.md).
//!
//! Note [Reshard after forward]: as PyTorch's FSDP2, `reshard_after_forward = true` (the
//! default) frees the full parameters after the unit's forward although autograd saved views
//! of them, and gathers them again before the unit's backward, without recomputing anything:
//! the gathered buffer's storage is swapped with an empty one after the forward
//! (`Tensor::swap_storage_`, PyTorch's `untyped_storage().resize_(0)`; Note [Swapping storages]
//! in ember-core), an `fsdp_pre_backward` node over the forward's output (run when backward
//! reaches it, before any of the unit's backward nodes; a node, not a tensor hook, which would
//! die with an output the caller drops) gathers the shards again and swaps the new buffer in, and the
//! `fsdp_all_gather` node frees it again once it reduce-scattered (every node reading the
//! parameters ran before it). That node also gathers the next unit's parameters in backward
//! ahead of time (Note [Backward prefetch] in `reshard.rs`). The values are those of a unit that kept them gathered, bit for
//! bit. Between forward and backward the unit holds its shards and the activations its
//! backward needs; with activation checkpointing inside the unit (ember-nn's `checkpoint` in
//! its forward, as PyTorch applies `checkpoint_wrapper` before `fully_shard`) only the
//! unit's input. With `reshard_after_forward = false` the full parameters stay alive in the
//! graph until backward (FSDP2's `False`: no second all-gather). Without grad mode (evaluation)
//! the gathered buffer is dropped when the forward ends either way.
//!
//! Note [FSDP nesting]: as with FSDP2, shard the blocks first, then the root: `fully_shard`
//! of a module that contains [`FSDPModule`]s leaves their parameters to them (while it shards,
//! an [`FSDPModule`] hides its parameters from the traversal) and shards the rest, and each
//! unit gathers and reduce-scatters its own parameters when its forward and backward run.
//! `parameters()` of the root lists every shard, the inner units' included. A unit that
//! contains other units (the root) does not reshard after forward, whatever the options say,
//! as PyTorch sets its root's `reshard_after_forward` to false: backward needs its parameters
//! (the embedding, the head) first, so freeing them would only gather them again at once.
//!
//! Note [FSDP gradient accumulation]: after [`FSDPModule::set_requires_gradient_sync`]`(false)`
//! the backward keeps the unsharded gradient (summed over the backward passes) instead of
//! reduce-scattering it and leaves the shards' `.grad` alone; the first backward with sync on
//! again adds it to its own gradient and reduce-scatters the sum, as DDP's `no_sync` and
//! FSDP2 do. It costs one unsharded gradient buffer per unit in between.
//!
//! Note [FSDP state dicts]: [`get_model_state_dict`] and [`get_optimizer_state_dict`] (PyTorch's
//! `torch.distributed.checkpoint.state_dict` functions) give state dicts for
//! [`crate::dcp::save`] and [`crate::dcp::load`] in which every shard is a [`DTensor`] (each
//! rank writes and reads its own rows; a load reshards to another world size or to an
//! unsharded model). A model's tensors do not say which unit shards them, nested units
//! included, so every live [`FSDPModule`] is registered (weakly) when it is made, and the
//! functions ask the registry which unit, if any, owns each tensor.
//!
//! Two of ember-nn's tools look at gradients rank by rank, which shards would let part: clip
//! with this module's [`clip_grad_norm_`] (the norm over every rank's rows), and scale losses
//! with [`ShardedGradScaler`] (an overflow in any rank's rows skips every rank's step).
//!
//! Every rank must run the same forward and backward passes (the collectives are matched in
//! order). The parameters' initial values are taken as they are on each rank, as FSDP2 does
//! (no broadcast): initialize them identically (a seed) or load a checkpoint afterwards.
//!
//! Overlap (Note [FSDP streams] in `streams.rs`): on a GPU the all-gathers run on their own
//! stream, so a unit's gather overlaps the previous unit's forward (FSDP2's implicit forward
//! prefetch, at most two gathered units ahead), and the reduce-scatters on another, each
//! accumulating its rows into the shards' `.grad` there, so it overlaps the next unit's
//! backward; the compute stream waits for them when the backward pass ends; and in
//! backward a unit's gather runs while the unit after it computes (Note [Backward prefetch]).

mod clip;
mod reshard;
mod sharded_grad_scaler;
mod state_dict;
mod streams;

pub use clip::clip_grad_norm_;
use reshard::Resharded;
pub use sharded_grad_scaler::ShardedGradScaler;
pub use state_dict::{get_model_state_dict, get_optimizer_state_dict};
use state_dict::{register, Unit};
use streams::{Prefetched, UnitForward};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use ember_core::{autograd, is_grad_enabled, no_grad, DType, Device, Error, Result, Shape, Tensor};
use ember_nn::{Forward, Module, TensorKind};

use crate::backend::ReduceOp;
use crate::dtensor::{chunk_range, DTensor, Placement};
use crate::group::ProcessGroup;
use crate::mesh::DeviceMesh;

const OP: &str = "fully_shard";

/// The dtypes of an [`FSDPModule`]'s computation and gradient reduction
/// (`MixedPrecisionPolicy(param_dtype, reduce_dtype)`); `None` keeps the shards' dtype. The
/// shards (what the optimizer steps) keep theirs whatever the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MixedPrecisionPolicy {
    /// The dtype the parameters are gathered in and the forward computes in (floating-point
    /// inputs of [`Forward::forward`] are cast to it, PyTorch's `cast_forward_inputs`).
    pub param_dtype: Option<DType>,
    /// The dtype gradients are reduce-scattered in; `None` takes `param_dtype`.
    pub reduce_dtype: Option<DType>,
}

/// The keyword arguments of `fully_shard` (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullyShardOptions {
    /// Free the full parameters after forward and gather them again in backward (Note
    /// [Reshard after forward]).
    pub reshard_after_forward: bool,
    /// The dtypes of computation and reduction (`mp_policy`).
    pub mp_policy: MixedPrecisionPolicy,
}

impl Default for FullyShardOptions {
    fn default() -> Self {
        FullyShardOptions {
            reshard_after_forward: true,
            mp_policy: MixedPrecisionPolicy::default(),
        }
    }
}

/// One sharded parameter: where its shard sits in the flat buffers, and its global shape.
#[derive(Debug, Clone)]
struct ParamLayout {
    /// The global shape (`Shard(0)` of it is the local shard).
    shape: Shape,
    /// Rows of dim 0 (1 for a 0-d parameter) and elements per row.
    rows: usize,
    row_numel: usize,
    /// Rows each rank's padded shard holds (`ceil(rows / world)`), and this rank's real rows.
    padded_rows: usize,
    local_rows: usize,
    /// Offset of this parameter's padded shard in a rank's block of the flat buffers.
    offset: usize,
}

impl ParamLayout {
    fn padded_numel(&self) -> usize {
        self.padded_rows * self.row_numel
    }

    fn local_numel(&self) -> usize {
        self.local_rows * self.row_numel
    }

    /// The local shard's dims: this rank's rows of dim 0 (a 0-d parameter's shard is 1-d).
    fn local_dims(&self) -> Vec<usize> {
        let mut dims = self.shape.dims().to_vec();
        match dims.first_mut() {
            Some(r) => *r = self.local_rows,
            None => dims.push(self.local_rows),
        }
        dims
    }
}

/// What the gradient reduction of a unit needs in backward (Note [FSDP mechanism] step 3,
/// Note [FSDP gradient accumulation]).
struct Reduction {
    group: ProcessGroup,
    layouts: Vec<ParamLayout>,
    /// Elements of one rank's block of the flat buffers.
    block: usize,
    reduce_dtype: Option<DType>,
    requires_gradient_sync: AtomicBool,
    /// The unsharded gradient summed over backward passes without sync.
    pending: Mutex<Option<Tensor>>,
}

/// What the forward passes and the refills in backward share.
struct FsdpState<M> {
    /// The module, its parameter fields holding placeholders between forwards.
    module: Mutex<M>,
    /// The local shards (leaves), one per distinct parameter, in visit order.
    shards: RwLock<Vec<Tensor>>,
    /// Per distinct parameter: the empty tensor its fields hold between forwards, and its
    /// first dotted name.
    placeholders: Vec<Tensor>,
    names: Vec<String>,
    reduction: Arc<Reduction>,
    param_dtype: Option<DType>,
    mesh: DeviceMesh,
}

/// A module whose parameters are sharded over a [`DeviceMesh`] (`FSDPModule`; Note [FSDP
/// mechanism]). [`Module::visit`] lists the local shards under the parameters' names (so
/// `parameters()` gives the optimizer the shards) and the module's buffers as they are. A
/// clone is another handle to the same sharded module.
pub struct FSDPModule<M> {
    state: Arc<FsdpState<M>>,
    reshard_after_forward: bool,
}

thread_local! {
    /// While [`fully_shard`] visits a module's parameters: the number of [`FSDPModule`]s met
    /// there, which hide their own parameters (Note [FSDP nesting]); `None` otherwise.
    static SHARDING: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Sets [`SHARDING`] for its lifetime.
struct ShardingScope;

impl ShardingScope {
    fn enter() -> ShardingScope {
        SHARDING.with(|s| s.set(Some(0)));
        ShardingScope
    }

    /// The [`FSDPModule`]s met so far.
    fn inner_units(&self) -> usize {
        SHARDING.with(|s| s.get().unwrap_or(0))
    }
}

impl Drop for ShardingScope {
    fn drop(&mut self) {
        SHARDING.with(|s| s.set(None));
    }
}

/// Inside [`fully_shard`]'s traversal, counts one more inner unit and says so.
fn met_by_fully_shard() -> bool {
    SHARDING.with(|s| match s.get() {
        Some(n) => {
            s.set(Some(n + 1));
            true
        }
        None => false,
    })
}

/// The index of the tensor in `list` that `t` is (the same tensor, not equal values).
fn index_of(list: &[Tensor], t: &Tensor) -> Option<usize> {
    list.iter().position(|x| x.is_same(t))
}

/// Shards `module`'s parameters along dim 0 over `mesh` and wraps it (`fully_shard(module,
/// mesh=mesh, reshard_after_forward=..., mp_policy=...)`). Each rank keeps its rows of every
/// parameter (`torch.chunk`'s split, unpadded), moved to the mesh's device; the module's own
/// tensors are released. Parameters of [`FSDPModule`]s inside `module` stay theirs (Note [FSDP
/// nesting]). No communication: every rank must hold the same initial values (Note [FSDP
/// mechanism]).
///
/// Errors: parameters of different dtypes (one flat buffer holds them all; cast the module
/// first), or no parameter left to shard.
pub fn fully_shard<M: Module + 'static>(
    mut module: M,
    mesh: &DeviceMesh,
    options: FullyShardOptions,
) -> Result<FSDPModule<M>> {
    let (world, rank) = (mesh.size(), mesh.get_local_rank());
    let device = mesh.device_type();
    let mut shards: Vec<Tensor> = Vec::new();
    let mut originals: Vec<Tensor> = Vec::new();
    let mut placeholders: Vec<Tensor> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut layouts: Vec<ParamLayout> = Vec::new();
    let mut dtype = None;
    let mut block = 0;
    let scope = ShardingScope::enter();
    module.visit_mut("", &mut |name, t, kind| {
        if kind != TensorKind::Parameter {
            return Ok(());
        }
        if let Some(i) = index_of(&originals, t) {
            // A tied parameter: the same shard under another name.
            *t = placeholders[i].clone();
            return Ok(());
        }
        match dtype {
            None => dtype = Some(t.dtype()),
            Some(d) if d != t.dtype() => {
                return Err(Error::invalid(
                    OP,
                    format!("parameter {name} is {} while the module's first parameter is {d}: one flat buffer holds them all, so cast the module to one dtype first (module.to_dtype)", t.dtype()),
                ))
            }
            Some(_) => {}
        }
        let dims = t.dims();
        let rows = dims.first().copied().unwrap_or(1);
        let row_numel: usize = dims.iter().skip(1).product();
        let range = chunk_range(rows, world, rank);
        let layout = ParamLayout {
            shape: t.shape().clone(),
            rows,
            row_numel,
            padded_rows: rows.div_ceil(world),
            local_rows: range.len(),
            offset: block,
        };
        block += layout.padded_numel();
        let shard = {
            let _g = no_grad();
            let by_rows = t.detach().reshape([rows as isize, row_numel as isize])?;
            let mine = by_rows.narrow(0, range.start, range.len())?;
            mine.to(device)?.deep_clone()?.reshape(layout.local_dims())?
        };
        if t.requires_grad() {
            shard.requires_grad_(true)?;
        }
        let placeholder = Tensor::empty([0usize], t.dtype(), t.device())?;
        originals.push(t.clone());
        placeholders.push(placeholder.clone());
        names.push(name.to_owned());
        shards.push(shard);
        layouts.push(layout);
        *t = placeholder;
        Ok(())
    })?;
    let contains_units = scope.inner_units() > 0;
    drop(scope);
    if dtype.is_none() {
        return Err(Error::invalid(
            OP,
            "the module has no parameters to shard (or all of them belong to FSDPModules inside it already)",
        ));
    }
    let mp = options.mp_policy;
    let state = Arc::new(FsdpState {
        module: Mutex::new(module),
        shards: RwLock::new(shards),
        placeholders,
        names,
        reduction: Arc::new(Reduction {
            group: mesh.get_group().clone(),
            layouts,
            block,
            reduce_dtype: mp.reduce_dtype.or(mp.param_dtype),
            requires_gradient_sync: AtomicBool::new(true),
            pending: Mutex::new(None),
        }),
        param_dtype: mp.param_dtype,
        mesh: mesh.clone(),
    });
    register(Arc::downgrade(&state) as Weak<dyn Unit>);
    Ok(FSDPModule {
        state,
        // Note [FSDP nesting]: the root keeps its parameters gathered after forward.
        reshard_after_forward: options.reshard_after_forward && !contains_units,
    })
}

impl<M> FsdpState<M> {
    /// Shard `i` (`shard`) as a [`DTensor`]: a 0-d parameter is the DTensor of its one row,
    /// shape `[1]`.
    fn dtensor(&self, i: usize, shard: &Tensor) -> Result<DTensor> {
        let layout = &self.reduction.layouts[i];
        let shape = match layout.shape.dims() {
            [] => Shape::new(vec![1]),
            _ => layout.shape.clone(),
        };
        DTensor::from_local(shard.clone(), &self.mesh, &[Placement::Shard(0)], Some(shape))
    }
}

impl<M> FsdpState<M> {
    fn lock(&self) -> MutexGuard<'_, M> {
        self.module.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn shards(&self) -> Vec<Tensor> {
        self.shards.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The shards, checked to be of one dtype on one device, and the dtype they are gathered
    /// in.
    fn checked_shards(&self) -> Result<(Vec<Tensor>, DType)> {
        let shards = self.shards();
        let first = &shards[0];
        let device = first.device();
        if let Some(s) = shards
            .iter()
            .find(|s| (s.device(), s.dtype()) != (device, first.dtype()))
        {
            return Err(Error::invalid(
                "FSDPModule::forward",
                format!(
                    "the shards are of {} on {} and of {} on {}: move or cast the whole FSDPModule, not single parameters",
                    first.dtype(),
                    device,
                    s.dtype(),
                    s.device()
                ),
            ));
        }
        let dtype = self.param_dtype.unwrap_or(first.dtype());
        Ok((shards, dtype))
    }

    /// The flat all-gather of `shards` in `dtype` (Note [FSDP mechanism] step 1), outside
    /// autograd; on a GPU on the all-gather stream, waited for at once with `now`, else its end
    /// handed back (Note [FSDP streams]).
    fn gather_flat(
        &self,
        shards: &[Tensor],
        dtype: DType,
        now: bool,
    ) -> Result<(Tensor, Option<Prefetched>)> {
        let world = self.mesh.size();
        let red = &self.reduction;
        let device = shards[0].device();
        let gather = || -> Result<Tensor> {
            let _g = no_grad();
            // Zeros only where this rank's shards leave padding rows, which the gather's
            // copies read: the shards fill the rest.
            let input = match red.layouts.iter().any(|l| l.local_numel() < l.padded_numel()) {
                true => Tensor::zeros([red.block], dtype, device)?,
                false => Tensor::empty([red.block], dtype, device)?,
            };
            // Every shard into its slot, cast to `dtype`, as one `foreach_copy_`: one launch
            // per 64 shards on a GPU where a `copy_` each launched a cast kernel each (Note
            // [Foreach copies] in ember-core). The shards are leaves that require grad:
            // detached, the list takes the one-launch path (a read outside autograd either way).
            let (mut slots, mut flat_shards) = (Vec::new(), Vec::new());
            for (s, l) in shards.iter().zip(&red.layouts) {
                if l.local_numel() > 0 {
                    slots.push(input.narrow(0, l.offset, l.local_numel())?);
                    flat_shards.push(s.detach().reshape(&[-1])?);
                }
            }
            ember_core::foreach_copy_(&slots, &flat_shards)?;
            let out = Tensor::empty([world * red.block], dtype, device)?;
            red.group.all_gather_into_tensor(&out, &input)?;
            if world == 1 {
                return Ok(out);
            }
            // Note [FSDP copy-out]: parameter by parameter.
            let full = Tensor::empty([world * red.block], dtype, device)?;
            let (by_param, by_rank) = red.relayout(&full, &out)?;
            ember_core::foreach_copy_(&by_param, &by_rank)?;
            Ok(full)
        };
        match device {
            Device::Cuda(i) => streams::gather_on_all_gather_stream(i, now, gather),
            Device::Cpu => Ok((gather()?, None)),
        }
    }

    /// All-gathers every parameter (Note [FSDP mechanism] steps 1 and 3): the full
    /// parameters, connected to the shards by the `fsdp_all_gather` node when grad mode is on,
    /// and the gathered buffer they are views of (a handle outside autograd). With `reshard`,
    /// the node frees the buffer's storage once it reduce-scattered (Note [Reshard after
    /// forward]).
    fn unshard(&self, reshard: Option<Arc<AtomicBool>>) -> Result<(Vec<Tensor>, Tensor)> {
        let world = self.mesh.size();
        let (shards, dtype) = self.checked_shards()?;
        let red = &self.reduction;
        let (flat, _) = self.gather_flat(&shards, dtype, true)?;
        let refs: Vec<&Tensor> = shards.iter().collect();
        let reduction = red.clone();
        let shard_dtype = shards[0].dtype();
        let release = reshard.map(|filled| (flat.clone(), filled));
        let leaves = shards.clone();
        let full = autograd::custom_op("fsdp_all_gather", &refs, flat.clone(), move |grad, needs| {
            let grads = reduction.reduce_scatter(grad, needs, shard_dtype, &leaves)?;
            if let Some((flat, filled)) = &release {
                free_storage(flat)?;
                filled.store(false, Ordering::Release);
            }
            Ok(grads)
        });
        // Views of the buffer laid out parameter by parameter (Note [FSDP copy-out]).
        let params = red
            .layouts
            .iter()
            .map(|l| {
                // The real rows come first, the padding rows after them: one cut, and a view
                // unless the parameter is 1-D (two autograd nodes where four were).
                let cut = full.narrow(0, world * l.offset, l.rows * l.row_numel)?;
                match l.shape.dims() == cut.dims() {
                    true => Ok(cut),
                    false => {
                        let dims: Vec<isize> = l.shape.dims().iter().map(|&d| d as isize).collect();
                        cut.view(&dims)
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((params, flat))
    }

    /// Gathers the parameters again into `flat`'s storage, freed after the forward (Note
    /// [Reshard after forward]): a new gather, swapped in; without `now`, a prefetch whose end
    /// is handed back (Note [Backward prefetch]).
    fn refill(&self, flat: &Tensor, now: bool) -> Result<Option<Prefetched>> {
        let (shards, dtype) = self.checked_shards()?;
        let (gathered, end) = self.gather_flat(&shards, dtype, now)?;
        flat.swap_storage_(&gathered)?;
        Ok(end)
    }

    /// Runs `f` on the module with its full parameters in place (Note [FSDP mechanism] step 2).
    fn with_full_params<T>(&self, f: impl FnOnce(&M) -> Result<T>) -> Result<T>
    where
        M: Module,
    {
        Ok(self.with_full_params_of(None, f)?.0)
    }

    /// [`FsdpState::with_full_params`], also handing back the gathered buffer (whose storage
    /// the backward frees with `reshard`, clearing the flag).
    fn with_full_params_of<T>(
        &self,
        reshard: Option<Arc<AtomicBool>>,
        f: impl FnOnce(&M) -> Result<T>,
    ) -> Result<(T, Tensor)>
    where
        M: Module,
    {
        let mut module = self.lock();
        let (full, flat) = self.unshard(reshard)?;
        let unit = UnitForward::enter(match self.mesh.device_type() {
            Device::Cuda(i) => Some(i),
            Device::Cpu => None,
        });
        module.visit_mut("", &mut |_, t, kind| {
            if kind == TensorKind::Parameter {
                if let Some(i) = index_of(&self.placeholders, t) {
                    *t = full[i].clone();
                }
            }
            Ok(())
        })?;
        let out = f(&module);
        let restored = module.visit_mut("", &mut |_, t, kind| {
            if kind == TensorKind::Parameter {
                if let Some(i) = index_of(&full, t) {
                    *t = self.placeholders[i].clone();
                }
            }
            Ok(())
        });
        drop(full);
        let released = unit.release();
        drop(unit);
        let out = out?;
        restored?;
        released?;
        Ok((out, flat))
    }
}

/// Frees the storage of a gathered buffer, whose views autograd may hold (Note [Reshard after
/// forward]): swapped with an empty one, which takes the memory away and drops it.
fn free_storage(flat: &Tensor) -> Result<()> {
    flat.swap_storage_(&Tensor::empty([0usize], flat.dtype(), flat.device())?)
}

impl Reduction {
    /// The pieces of a unit's flat buffer laid out parameter by parameter (`by_param`) and of
    /// the same buffer rank by rank (`by_rank`, the collectives' `[world, S]`), in matching
    /// order: each parameter's padded shard of each rank (Note [FSDP copy-out]). Both buffers
    /// hold `world * block` elements.
    fn relayout(&self, by_param: &Tensor, by_rank: &Tensor) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let world = self.group.size();
        let (mut p, mut r) = (Vec::new(), Vec::new());
        for l in self.layouts.iter().filter(|l| l.padded_numel() > 0) {
            let n = l.padded_numel();
            for rank in 0..world {
                p.push(by_param.narrow(0, world * l.offset + rank * n, n)?);
                r.push(by_rank.narrow(0, rank * self.block + l.offset, n)?);
            }
        }
        Ok((p, r))
    }

    /// The backward of `fsdp_all_gather` (Note [FSDP mechanism] step 3): the gradient of the
    /// gathered buffer (laid out parameter by parameter, Note [FSDP copy-out]), averaged over
    /// ranks by a reduce-scatter, each shard's rows of it in `shard_dtype`; or, without
    /// gradient sync, nothing yet (Note [FSDP gradient accumulation]). On a GPU the rows are accumulated into the `shards`' `.grad` on the
    /// reduce-scatter stream instead and nothing is returned (Note [FSDP streams]).
    fn reduce_scatter(
        &self,
        grad: &Tensor,
        needs: &[bool],
        shard_dtype: DType,
        shards: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let _g = no_grad();
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let grad = match pending.take() {
            Some(sum) => {
                sum.add_scaled_(grad, 1.0)?;
                sum
            }
            None => grad.clone(),
        };
        if !self.requires_gradient_sync.load(Ordering::Relaxed) {
            *pending = Some(grad.contiguous()?.deep_clone()?);
            return Ok(vec![None; needs.len()]);
        }
        drop(pending);
        // This rank's rows of the average, in the shards' dtype.
        let scatter = |grad: &Tensor| -> Result<Tensor> {
            let dtype = self.reduce_dtype.unwrap_or(grad.dtype());
            let world = self.group.size();
            let input = match world {
                1 => grad.to_dtype(dtype)?.contiguous()?,
                // Rank by rank again, cast on the way (Note [FSDP copy-out]).
                _ => {
                    let input = Tensor::empty([world * self.block], dtype, grad.device())?;
                    let (by_param, by_rank) = self.relayout(grad, &input)?;
                    ember_core::foreach_copy_(&by_rank, &by_param)?;
                    input
                }
            };
            let out = Tensor::empty([self.block], dtype, grad.device())?;
            self.group.reduce_scatter_tensor(&out, &input, ReduceOp::Avg)?;
            out.to_dtype(shard_dtype)
        };
        let rows = |out: &Tensor, l: &ParamLayout| -> Result<Tensor> {
            out.narrow(0, l.offset, l.local_numel())?.reshape(l.local_dims())
        };
        let Device::Cuda(device) = grad.device() else {
            let out = scatter(&grad)?;
            return self
                .layouts
                .iter()
                .zip(needs)
                .map(|(l, &need)| need.then(|| rows(&out, l)).transpose())
                .collect();
        };
        // Note [FSDP streams]: reduced and accumulated into the shards' `.grad` on the
        // reduce-scatter stream, which the compute stream waits for when the backward ends.
        streams::reduce_on_reduce_scatter_stream(device, &grad, |side, compute| {
            let out = scatter(&grad)?;
            out.record_stream(compute)?;
            for ((l, &need), shard) in self.layouts.iter().zip(needs).zip(shards) {
                if !need {
                    continue;
                }
                let g = rows(&out, l)?;
                match shard.grad() {
                    None => shard.set_grad(Some(g))?,
                    Some(acc) => {
                        acc.record_stream(side)?;
                        acc.add_(&g)?;
                    }
                }
            }
            Ok(())
        })?;
        Ok(vec![None; needs.len()])
    }
}

impl<M> Clone for FSDPModule<M> {
    /// Another handle to the same sharded module (the same shards and module), as a shared
    /// child of a container.
    fn clone(&self) -> Self {
        FSDPModule {
            state: self.state.clone(),
            reshard_after_forward: self.reshard_after_forward,
        }
    }
}

impl<M: Module> FSDPModule<M> {
    /// The mesh the parameters are sharded over.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.state.mesh
    }

    /// Whether the forward frees the full parameters (Note [Reshard after forward]): the
    /// option given, except for a unit that contains other units (Note [FSDP nesting]).
    pub fn reshard_after_forward(&self) -> bool {
        self.reshard_after_forward
    }

    /// Whether the next backward passes reduce-scatter the gradients (the default) or keep
    /// them unsharded for a later one (`set_requires_gradient_sync`, Note [FSDP gradient
    /// accumulation]). This unit only: call it on every [`FSDPModule`] of a nested model.
    pub fn set_requires_gradient_sync(&self, requires_gradient_sync: bool) {
        self.state
            .reduction
            .requires_gradient_sync
            .store(requires_gradient_sync, Ordering::Relaxed);
    }

    /// The sharded parameters of this unit as [`DTensor`]s under their names (what PyTorch's
    /// `named_parameters()` of an FSDP module gives; [`DTensor::full_tensor`] gathers one, and
    /// [`crate::dcp::save`] writes them shard by shard). The local tensors are the shards
    /// themselves. A 0-d parameter is the DTensor of its one row, shape `[1]`.
    pub fn named_dtensors(&self) -> Result<Vec<(String, DTensor)>> {
        let shards = self.state.shards();
        self.state
            .names
            .iter()
            .zip(&shards)
            .enumerate()
            .map(|(i, (name, shard))| Ok((name.clone(), self.state.dtensor(i, shard)?)))
            .collect()
    }

    /// Runs `f` with the module's full parameters in place: the way to call a module whose
    /// forward takes other arguments than one tensor. The full parameters stay alive in the
    /// graph until backward (as `reshard_after_forward = false`, whatever the options), and
    /// the inputs are not cast to the policy's `param_dtype`.
    pub fn forward_with<T>(&self, f: impl FnOnce(&M) -> Result<T>) -> Result<T> {
        self.state.with_full_params(f)
    }
}

impl<M: Module> Module for FSDPModule<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        let shards = self.state.shards();
        let module = self.state.lock();
        module.visit(
            prefix,
            &mut |name, t, kind| match index_of(&self.state.placeholders, t)
                .filter(|_| kind == TensorKind::Parameter)
            {
                Some(i) => f(name, &shards[i], kind),
                None => f(name, t, kind),
            },
        );
    }

    /// Hands out the shards in place of the parameters (so `to_dtype` casts the shards), the
    /// module's other tensors as they are; inside [`fully_shard`], nothing of this unit's
    /// parameters (Note [FSDP nesting]).
    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        let hide = met_by_fully_shard();
        let state = &self.state;
        let mut shards = state.shards.write().unwrap_or_else(|p| p.into_inner());
        let mut module = state.lock();
        let mut seen = vec![false; shards.len()];
        module.visit_mut(prefix, &mut |name, t, kind| {
            match index_of(&state.placeholders, t).filter(|_| kind == TensorKind::Parameter) {
                // A tied parameter is handed out once.
                Some(i) if hide || std::mem::replace(&mut seen[i], true) => Ok(()),
                Some(i) => f(name, &mut shards[i], kind),
                None => f(name, t, kind),
            }
        })
    }

    fn set_training(&self, training: bool) {
        self.state.lock().set_training(training)
    }

    fn is_training(&self) -> bool {
        self.state.lock().is_training()
    }
}

impl<M: Forward + 'static> Forward for FSDPModule<M> {
    /// Gathers, runs the module, frees (Note [FSDP mechanism]); with `reshard_after_forward`
    /// and grad mode on, frees the parameters autograd saved and gathers them again when
    /// backward reaches the output (Note [Reshard after forward]). A floating-point `x` is cast
    /// to the policy's `param_dtype`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.state.param_dtype {
            Some(d) if x.dtype().is_floating_point() && x.dtype() != d => x.to_dtype(d)?,
            _ => x.clone(),
        };
        if streams::depth() == 0 {
            Resharded::new_pass();
        }
        if !(self.reshard_after_forward && is_grad_enabled()) {
            return self.state.with_full_params(|m| m.forward(&x));
        }
        let filled = Arc::new(AtomicBool::new(true));
        let (out, flat) = self
            .state
            .with_full_params_of(Some(filled.clone()), |m| m.forward(&x))?;
        if !out.requires_grad() {
            return Ok(out); // no graph holds the parameters
        }
        // Note [Reshard after forward]: freed now, gathered again when backward reaches `out`
        // (or before, Note [Backward prefetch]).
        free_storage(&flat)?;
        filled.store(false, Ordering::Release);
        let state = self.state.clone();
        let unit = Resharded::after_forward(filled, move |now| state.refill(&flat, now));
        // A node over the output rather than a hook on it: a tensor's hooks live as long as
        // the tensor, and a unit inside another's forward hands its output on and drops it
        // (its buffer was then never filled again); the node lives as long as the graph, as
        // FSDP2's pre-backward autograd Function does.
        Ok(autograd::custom_op(
            "fsdp_pre_backward",
            &[&out],
            out.clone(),
            move |grad, _| {
                let _g = no_grad();
                unit.before_backward()?;
                Ok(vec![Some(grad.clone())])
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_pad_every_shard_to_the_chunk_rows() {
        // 5 rows of 3 on 4 ranks: chunks of 2 rows, rank 3 holds none.
        let l = |rank| ParamLayout {
            shape: Shape::new(vec![5, 3]),
            rows: 5,
            row_numel: 3,
            padded_rows: 2,
            local_rows: chunk_range(5, 4, rank).len(),
            offset: 0,
        };
        assert_eq!(l(0).local_dims(), [2, 3]);
        assert_eq!(l(2).local_dims(), [1, 3]);
        assert_eq!(l(3).local_dims(), [0, 3]);
        assert_eq!((l(2).padded_numel(), l(2).local_numel()), (6, 3));
        let scalar = ParamLayout {
            shape: Shape::new(vec![]),
            rows: 1,
            row_numel: 1,
            padded_rows: 1,
            local_rows: 1,
            offset: 4,
        };
        assert_eq!(scalar.local_dims(), [1]);
    }
}
