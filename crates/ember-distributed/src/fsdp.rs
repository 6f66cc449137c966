//! Fully sharded data parallelism (`torch.distributed.fsdp.fully_shard`, FSDP2), first
//! version: [`fully_shard`] turns a module into an [`FSDPModule`] whose parameters are dim-0
//! shards ([`DTensor`] layout, Note [Shard layout] in `dtensor.rs`), gathered for its forward
//! and backward, with gradients reduce-scattered back onto the shards.
//!
//! Note [FSDP mechanism]: ember-nn has no forward hooks, so the module is wrapped instead of
//! hooked: [`FSDPModule`] owns the module, behind a lock, with every parameter field replaced
//! by an empty placeholder, and keeps the local shards (leaf tensors that require grad, what
//! `parameters()` lists and the optimizer steps). Its forward:
//! 1. all-gathers every parameter in one flat collective (FSDP2's `FSDPParamGroup`): each rank
//!    packs its shards, each padded to `ceil(rows / world)` rows, into one buffer, and
//!    `all_gather_into_tensor` makes `[world, S]`, from which each full parameter is cut (a
//!    copy of its `world` column blocks, the padding rows dropped);
//! 2. puts the full parameters into the module's fields (`visit_mut`), runs the module's
//!    forward, and puts the placeholders back;
//! 3. autograd connects the full parameters to the shards through one custom node
//!    (`fsdp_all_gather`), whose backward receives the gradient of the whole `[world, S]`
//!    buffer (the cuts' backward writes each full gradient into its blocks, zeros in the
//!    padding) and reduce-scatters it with `ReduceOp::Avg` (`reduce_scatter_tensor`): each
//!    rank gets the average over ranks of its own rows, which autograd accumulates into the
//!    shards' `.grad`. That is DDP's averaged gradient, cut to the rank's rows.
//!
//! Note [Reshard after forward]: PyTorch frees the full parameters after forward by resizing
//! their storage to zero and gathers into the same storage again before backward, so the
//! tensors autograd saved come back to life. ember's tensors cannot release their storage
//! while autograd holds them, so `reshard_after_forward = true` (the default) runs the forward
//! under [`ember_core::autograd::checkpoint`] instead: the forward keeps nothing (neither the
//! full parameters nor the module's activations), and backward all-gathers again, recomputes
//! the module's forward (restoring the random state, so dropout draws the same masks), and
//! reduce-scatters. Memory is that of FSDP2 with activation checkpointing on each sharded
//! module, for one more forward of it in backward. With `reshard_after_forward = false` the
//! full parameters stay alive in the graph until backward (FSDP2's `False`: no second
//! all-gather, no recomputation).
//!
//! Every rank must run the same forward and backward passes (the collectives are matched in
//! order). The parameters' initial values are taken as they are on each rank, as FSDP2 does
//! (no broadcast): initialize them identically (a seed) or load a checkpoint afterwards.
//!
//! Not yet: nesting (`fully_shard` of a module that contains an [`FSDPModule`]: shard each
//! block and chain them, e.g. in a `Sequential`, instead), prefetching the next module's
//! all-gather on a separate stream, `MixedPrecisionPolicy`, `set_requires_gradient_sync` for
//! gradient accumulation without communication.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use ember_core::{autograd, is_grad_enabled, no_grad, DType, Device, Error, Result, Shape, Tensor};
use ember_nn::{Forward, Module, TensorKind};

use crate::backend::ReduceOp;
use crate::dtensor::{chunk_range, DTensor, Placement};
use crate::mesh::DeviceMesh;

const OP: &str = "fully_shard";

/// The keyword arguments of `fully_shard` (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullyShardOptions {
    /// Free the full parameters after forward and gather them again in backward (Note
    /// [Reshard after forward]: in ember this recomputes the module's forward in backward).
    pub reshard_after_forward: bool,
}

impl Default for FullyShardOptions {
    fn default() -> Self {
        FullyShardOptions {
            reshard_after_forward: true,
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
    /// Offset of this parameter's padded shard in a rank's block of the flat buffer.
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

/// What the forward passes (and the recomputation in backward) share.
struct FsdpState<M> {
    /// The module, its parameter fields holding placeholders between forwards.
    module: Mutex<M>,
    /// The local shards (leaves), one per distinct parameter, in visit order.
    shards: RwLock<Vec<Tensor>>,
    layouts: Vec<ParamLayout>,
    /// For each parameter visit of the module (a tied parameter is visited under each of its
    /// names): its dotted name and the index of its shard.
    slots: Vec<(String, usize)>,
    /// Elements of one rank's block of the flat buffers.
    block: usize,
    dtype: DType,
    device: Device,
    mesh: DeviceMesh,
}

/// A module whose parameters are sharded over a [`DeviceMesh`] (`FSDPModule`; Note [FSDP
/// mechanism]). [`Module::visit`] lists the local shards under the parameters' names (so
/// `parameters()` gives the optimizer the shards) and the module's buffers as they are.
pub struct FSDPModule<M> {
    state: Arc<FsdpState<M>>,
    options: FullyShardOptions,
}

/// Shards `module`'s parameters along dim 0 over `mesh` and wraps it (`fully_shard(module,
/// mesh=mesh, reshard_after_forward=...)`). Each rank keeps its rows of every parameter
/// (`torch.chunk`'s split, unpadded), moved to the mesh's device; the module's own tensors are
/// released. No communication: every rank must hold the same initial values (Note [FSDP
/// mechanism]).
///
/// Errors: parameters of different dtypes or devices (one flat buffer holds them all; cast
/// the module first), a module without parameters, or a module that already contains an
/// [`FSDPModule`] (shard the children and chain them instead).
pub fn fully_shard<M: Module>(
    mut module: M,
    mesh: &DeviceMesh,
    options: FullyShardOptions,
) -> Result<FSDPModule<M>> {
    let (world, rank) = (mesh.size(), mesh.get_local_rank());
    let device = mesh.device_type();
    let mut shards: Vec<Tensor> = Vec::new();
    let mut originals: Vec<Tensor> = Vec::new();
    let mut layouts: Vec<ParamLayout> = Vec::new();
    let mut slots: Vec<(String, usize)> = Vec::new();
    let mut dtype = None;
    let mut block = 0;
    let scope = ShardingScope::enter();
    module.visit_mut("", &mut |name, t, kind| {
        if kind != TensorKind::Parameter {
            return Ok(());
        }
        if let Some(i) = originals.iter().position(|o| o.is_same(t)) {
            // A tied parameter: the same shard under another name.
            slots.push((name.to_owned(), i));
            *t = placeholder(t)?;
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
            let flat_rows = t.detach().reshape([rows as isize, row_numel as isize])?;
            let mine = flat_rows.narrow(0, range.start, range.len())?;
            mine.to(device)?.deep_clone()?.reshape(layout.local_dims())?
        };
        if t.requires_grad() {
            shard.requires_grad_(true)?;
        }
        originals.push(t.clone());
        slots.push((name.to_owned(), shards.len()));
        shards.push(shard);
        layouts.push(layout);
        *t = placeholder(t)?;
        Ok(())
    })?;
    drop(scope);
    let Some(dtype) = dtype else {
        return Err(Error::invalid(OP, "the module has no parameters to shard"));
    };
    Ok(FSDPModule {
        state: Arc::new(FsdpState {
            module: Mutex::new(module),
            shards: RwLock::new(shards),
            layouts,
            slots,
            block,
            dtype,
            device,
            mesh: mesh.clone(),
        }),
        options,
    })
}

/// The empty tensor a parameter field holds while its module is sharded.
fn placeholder(t: &Tensor) -> Result<Tensor> {
    Tensor::empty([0usize], t.dtype(), t.device())
}

thread_local! {
    /// Set while [`fully_shard`] visits a module's parameters: an [`FSDPModule`] met there
    /// (nesting, not supported yet) refuses to hand its shards out.
    static SHARDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets [`SHARDING`] for its lifetime.
struct ShardingScope;

impl ShardingScope {
    fn enter() -> ShardingScope {
        SHARDING.with(|s| s.set(true));
        ShardingScope
    }
}

impl Drop for ShardingScope {
    fn drop(&mut self) {
        SHARDING.with(|s| s.set(false));
    }
}

impl<M> FsdpState<M> {
    fn lock(&self) -> MutexGuard<'_, M> {
        self.module.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn shards(&self) -> Vec<Tensor> {
        self.shards.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// All-gathers every parameter (Note [FSDP mechanism] steps 1 and 3): the full
    /// parameters, connected to the shards by the `fsdp_all_gather` node when grad mode is on.
    fn unshard(&self) -> Result<Vec<Tensor>> {
        let world = self.mesh.size();
        let shards = self.shards();
        let flat = {
            let _g = no_grad();
            let input = Tensor::zeros([self.block], self.dtype, self.device)?;
            for (s, l) in shards.iter().zip(&self.layouts) {
                if l.local_numel() > 0 {
                    input
                        .narrow(0, l.offset, l.local_numel())?
                        .copy_(&s.reshape(&[-1])?)?;
                }
            }
            let out = Tensor::empty([world * self.block], self.dtype, self.device)?;
            self.mesh.get_group().all_gather_into_tensor(&out, &input)?;
            out
        };
        let refs: Vec<&Tensor> = shards.iter().collect();
        let (group, layouts, block) = (self.mesh.get_group().clone(), self.layouts.clone(), self.block);
        let flat = autograd::custom_op("fsdp_all_gather", &refs, flat, move |grad, needs| {
            reduce_scatter_grads(&group, &layouts, block, grad, needs)
        });
        let grid = flat.reshape([world as isize, self.block as isize])?;
        self.layouts
            .iter()
            .map(|l| {
                let dims: Vec<isize> = l.shape.dims().iter().map(|&d| d as isize).collect();
                let rows_dims = [(world * l.padded_rows) as isize, l.row_numel as isize];
                let full = grid
                    .narrow(1, l.offset, l.padded_numel())?
                    .reshape(rows_dims)?
                    .narrow(0, 0, l.rows)?;
                full.reshape(dims)
            })
            .collect()
    }

    /// Runs `f` on the module with its full parameters in place (Note [FSDP mechanism] step 2).
    fn with_full_params<T>(&self, f: impl FnOnce(&M) -> Result<T>) -> Result<T>
    where
        M: Module,
    {
        let mut module = self.lock();
        let full = self.unshard()?;
        let mut k = 0;
        module.visit_mut("", &mut |_, t, kind| {
            if kind == TensorKind::Parameter {
                *t = full[self.slots[k].1].clone();
                k += 1;
            }
            Ok(())
        })?;
        let out = f(&module);
        module.visit_mut("", &mut |_, t, kind| {
            if kind == TensorKind::Parameter {
                *t = placeholder(t)?;
            }
            Ok(())
        })?;
        out
    }
}

/// The backward of `fsdp_all_gather`: the gradient of the gathered `[world, S]` buffer,
/// reduce-scattered with the average over ranks; each shard's rows of the result.
fn reduce_scatter_grads(
    group: &crate::ProcessGroup,
    layouts: &[ParamLayout],
    block: usize,
    grad: &Tensor,
    needs: &[bool],
) -> Result<Vec<Option<Tensor>>> {
    let _g = no_grad();
    let input = grad.contiguous()?;
    let out = Tensor::empty([block], grad.dtype(), grad.device())?;
    group.reduce_scatter_tensor(&out, &input, ReduceOp::Avg)?;
    layouts
        .iter()
        .zip(needs)
        .map(|(l, &need)| {
            if !need {
                return Ok(None);
            }
            Ok(Some(
                out.narrow(0, l.offset, l.local_numel())?
                    .reshape(l.local_dims())?,
            ))
        })
        .collect()
}

impl<M> Clone for FSDPModule<M> {
    /// Another handle to the same sharded module (the same shards and module), as a shared
    /// child of a container.
    fn clone(&self) -> Self {
        FSDPModule {
            state: self.state.clone(),
            options: self.options,
        }
    }
}

impl<M: Module> FSDPModule<M> {
    /// The mesh the parameters are sharded over.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.state.mesh
    }

    /// The options it was sharded with.
    pub fn options(&self) -> FullyShardOptions {
        self.options
    }

    /// The sharded parameters as [`DTensor`]s under their names (what PyTorch's
    /// `named_parameters()` of an FSDP module gives; [`DTensor::full_tensor`] gathers one, and
    /// [`crate::dcp::save`] writes them shard by shard). The local tensors are the shards
    /// themselves.
    pub fn named_dtensors(&self) -> Result<Vec<(String, DTensor)>> {
        let shards = self.state.shards();
        let mut seen = vec![false; shards.len()];
        let mut out = Vec::new();
        for (name, i) in &self.state.slots {
            if std::mem::replace(&mut seen[*i], true) {
                continue;
            }
            let shape = self.state.layouts[*i].shape.clone();
            // A 0-d parameter's shard is 1-d: the DTensor of its one row.
            let d = if shape.dims().is_empty() {
                DTensor::from_local(
                    shards[*i].clone(),
                    &self.state.mesh,
                    &[Placement::Shard(0)],
                    Some(Shape::new(vec![1])),
                )?
            } else {
                DTensor::from_local(
                    shards[*i].clone(),
                    &self.state.mesh,
                    &[Placement::Shard(0)],
                    Some(shape),
                )?
            };
            out.push((name.clone(), d));
        }
        Ok(out)
    }

    /// Runs `f` with the module's full parameters in place: the way to call a module whose
    /// forward takes other arguments than one tensor. The full parameters stay alive in the
    /// graph until backward (as `reshard_after_forward = false`, whatever the options).
    pub fn forward_with<T>(&self, f: impl FnOnce(&M) -> Result<T>) -> Result<T> {
        self.state.with_full_params(f)
    }
}

impl<M: Module> Module for FSDPModule<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        let shards = self.state.shards();
        let module = self.state.lock();
        let mut k = 0;
        module.visit(prefix, &mut |name, t, kind| match kind {
            TensorKind::Parameter => {
                let i = self.state.slots[k].1;
                k += 1;
                f(name, &shards[i], kind)
            }
            TensorKind::Buffer => f(name, t, kind),
        });
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        if SHARDING.with(|s| s.get()) {
            return Err(Error::invalid(
                OP,
                format!("{prefix} is already sharded (an FSDPModule): nested fully_shard is not supported yet; shard each block and chain the blocks instead (e.g. in a Sequential)"),
            ));
        }
        let state = &self.state;
        let mut shards = state.shards.write().unwrap_or_else(|p| p.into_inner());
        let mut module = state.lock();
        let mut k = 0;
        module.visit_mut(prefix, &mut |name, t, kind| match kind {
            TensorKind::Parameter => {
                let i = state.slots[k].1;
                k += 1;
                f(name, &mut shards[i], kind)
            }
            TensorKind::Buffer => f(name, t, kind),
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
    /// and grad mode on, under a checkpoint that gathers and recomputes in backward (Note
    /// [Reshard after forward]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.options.reshard_after_forward && is_grad_enabled() {
            let state = self.state.clone();
            return autograd::checkpoint(
                move |xs: &[Tensor]| state.with_full_params(|m| m.forward(&xs[0])),
                std::slice::from_ref(x),
            );
        }
        self.state.with_full_params(|m| m.forward(x))
    }
}
