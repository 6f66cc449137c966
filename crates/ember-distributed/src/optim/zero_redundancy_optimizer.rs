//! [`ZeroRedundancyOptimizer`] (`torch.distributed.optim.ZeroRedundancyOptimizer`): an
//! optimizer whose state is sharded across the ranks of a process group, each rank stepping
//! only the parameters it owns and then sending them to the others (ZeRO stage 1, as llm.c's
//! ZeRO-1 and PyTorch's class).
//!
//! Note [ZeRO partition]: parameters are partitioned whole, as PyTorch's class does, by its
//! sorted-greedy rule, param group by param group in order: a group's parameters sorted by
//! element count, largest first (ties in the order given), each goes to the rank with the
//! fewest elements so far, counting the earlier groups' (the lowest such rank). Each rank's
//! local optimizer holds one group per param group, with that group's hyperparameters and the
//! rank's share of its parameters (possibly none), so its parameters are numbered group by
//! group as the unsharded optimizer's are; `add_param_group` partitions the new group after
//! the others (the earlier groups' assignment does not change). Every rank computes the same
//! partition from the shapes alone, which the constructors check are the same on every rank.
//! Whole parameters rather than flat dim-0 shards because:
//! - any optimizer works unchanged: the local optimizer is the user's own (AdamW, SGD, ...)
//!   over ordinary parameters, fused steps included, and an update that looks at a whole
//!   parameter (a norm, as LAMB's trust ratio) still sees it whole;
//! - the local optimizer's state dict is a sub-dict of the unsharded one, so the consolidated
//!   state dict is exactly the state dict of the same optimizer without ZeRO (indices remapped,
//!   `param_groups.{g}.*` the groups' own);
//! - parameters keep their storage (no flattening into buckets that would change `.data`).
//!
//! The cost is balance at the granularity of a parameter (one huge embedding can leave its rank
//! the largest share); flat shards balance exactly and are what `fully_shard` (FSDP2) does.
//!
//! Note [ZeRO step]: [`Optimizer::step`] runs the local optimizer over this rank's parameters
//! (which are the only ones to get optimizer state), then, rank by rank, the owner copies its
//! parameters into one flat buffer per (device, dtype) and broadcasts it, and the others copy it
//! back into their parameters (one `foreach_copy_` each way per buffer). Rank by rank bounds
//! the extra memory by the largest rank's share; the ranks' broadcasts run one after the other
//! on the wire anyway. A step therefore costs one broadcast per rank and dtype, moving every
//! parameter once (the all-gather of ZeRO's papers, as broadcasts since the shares are uneven).
//! With DDP the gradients arrive averaged on every rank, so the result equals DDP with the
//! unsharded optimizer, bit for bit (the elementwise updates see the same values in the same
//! order; only which rank computes them differs).
//!
//! Every rank must call `step`, `consolidate_state_dict`, `add_param_group` and the
//! constructors in the same order (they are collective over the group).

use std::ops::Range;

use ember_core::{no_grad, DType, Device, Error, Result, Tensor};
use ember_nn::optim::{Optimizer, ParamGroup};
use ember_nn::state_dict::{load_tensors_from_bytes, save_tensors_to_bytes, StateDictError, StateDictResult};

use crate::group::{default_group, ProcessGroup};

const OP: &str = "ZeroRedundancyOptimizer";

/// An optimizer of type `O` over this rank's share of the parameters, and the parameter
/// exchange that keeps every rank's replicas equal (`ZeroRedundancyOptimizer`; Note [ZeRO
/// partition], Note [ZeRO step]). It is itself an [`Optimizer`] over all the parameters, so LR
/// schedulers and the GradScaler drive it as they drive `O`.
///
/// ```no_run
/// use ember_distributed::optim::ZeroRedundancyOptimizer;
/// use ember_distributed::{DdpOptions, DistributedDataParallel};
/// use ember_nn::optim::{AdamConfig, AdamW, Optimizer};
/// use ember_nn::{Linear, ModuleExt};
/// # fn main() -> ember_core::Result<()> {
/// ember_distributed::init_process_group("gloo")?; // under ember-run
/// let model = DistributedDataParallel::new(Linear::new(4, 2, ember_core::Device::Cpu)?, DdpOptions::new())?;
/// let mut opt = ZeroRedundancyOptimizer::new(
///     model.module().parameters(),
///     |params| AdamW::new(params, AdamConfig { lr: 1e-3, ..AdamConfig::adamw() }),
///     None,
/// )?;
/// // forward, backward, then:
/// opt.step()?;
/// # Ok(())
/// # }
/// ```
pub struct ZeroRedundancyOptimizer<O: Optimizer> {
    /// Every group's parameters, group 0's first (the unsharded optimizer's numbering).
    params: Vec<Tensor>,
    /// `groups[g]`: the indices into `params` of param group `g`.
    groups: Vec<Range<usize>>,
    /// `by_group[r][g]`: the indices of group `g` that rank `r` owns, in assignment order.
    by_group: Vec<Vec<Vec<usize>>>,
    /// `partition[r]`: the concatenation of `by_group[r]` (the order of the local optimizer's
    /// parameters on rank `r`).
    partition: Vec<Vec<usize>>,
    /// `buckets[r]`: rank `r`'s parameters grouped by (device, dtype), one broadcast each.
    buckets: Vec<Vec<Vec<usize>>>,
    /// The optimizer over this rank's share: one group per param group, empty where the rank
    /// owns none of the group's parameters. On an idle rank, one over every parameter, kept
    /// for its hyperparameters only and never stepped.
    optim: O,
    /// `idle[r]`: rank `r` was built by [`ZeroRedundancyOptimizer::new`] owning no parameter
    /// (more ranks than parameters; `new`'s closure takes a list of parameters, which an
    /// optimizer refuses empty), so it has no optimizer of its own.
    idle: Vec<bool>,
    group: ProcessGroup,
    /// The local state dicts of every rank, by rank, after `consolidate_state_dict` to this one.
    all_state_dicts: Vec<Vec<(String, Tensor)>>,
}

/// Note [ZeRO partition]: the sorted-greedy assignment of parameters of `numels` elements, in
/// param groups `groups` (ranges of indices, in order), to `world` ranks; per rank and group,
/// the parameter indices in assignment order.
pub(crate) fn partition_parameters(
    numels: &[usize],
    groups: &[Range<usize>],
    world: usize,
) -> Vec<Vec<Vec<usize>>> {
    let world = world.max(1);
    let mut sizes = vec![0usize; world];
    let mut out = vec![vec![Vec::new(); groups.len()]; world];
    for (g, range) in groups.iter().enumerate() {
        let mut order: Vec<usize> = range.clone().collect();
        order.sort_by_key(|&i| std::cmp::Reverse(numels[i])); // stable: ties keep their order
        for i in order {
            let r = (0..world).min_by_key(|&r| sizes[r]).unwrap_or(0); // the first minimum
            out[r][g].push(i);
            sizes[r] += numels[i];
        }
    }
    out
}

/// `owned` grouped by the (device, dtype) of `params[i]`, groups in order of first appearance.
fn bucket_by_kind(params: &[Tensor], owned: &[usize]) -> Vec<Vec<usize>> {
    let mut keyed: Vec<((Device, DType), Vec<usize>)> = Vec::new();
    for &i in owned {
        let key = (params[i].device(), params[i].dtype());
        match keyed.iter_mut().find(|(k, _)| *k == key) {
            Some((_, b)) => b.push(i),
            None => keyed.push((key, vec![i])),
        }
    }
    keyed.into_iter().map(|(_, b)| b).collect()
}

/// A fingerprint of the parameters' dtypes and shapes (FNV-1a), to compare across ranks.
fn fingerprint(params: &[Tensor]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for p in params {
        eat(p.dtype().to_string().as_bytes());
        eat(&(p.dims().len() as u64).to_le_bytes());
        for d in p.dims() {
            eat(&(*d as u64).to_le_bytes());
        }
    }
    h as i64
}

/// Errors unless every rank of `group` passed parameters of the same count, shapes and dtypes,
/// in groups of the same sizes `sizes` (one all-gather), so that every rank computes the same
/// partition.
fn check_same_params(group: &ProcessGroup, params: &[Tensor], sizes: &[usize]) -> Result<()> {
    let world = group.size();
    if world == 1 {
        return Ok(());
    }
    let numel: usize = params.iter().map(Tensor::numel).sum();
    let groups = sizes.iter().fold(fingerprint(params) as u64, |h, &n| {
        (h ^ n as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mine = [params.len() as i64, numel as i64, groups as i64];
    let device = group.device();
    let input = Tensor::from_vec(mine.to_vec(), [3], Device::Cpu)?.to(device)?;
    let all = Tensor::zeros([3 * world], DType::I64, device)?;
    group.all_gather_into_tensor(&all, &input)?;
    let all = all.to_vec::<i64>()?;
    for (r, theirs) in all.chunks(3).enumerate() {
        if theirs != mine {
            return Err(Error::invalid(
                OP,
                format!(
                    "rank {r} of the group passed {} parameter(s) of {} elements, rank {} passed {} of {} (or the shapes, dtypes or param groups differ): every rank must pass the same parameters (the same shapes and dtypes, in the same order and groups), e.g. its replica's model.parameters()",
                    theirs[0],
                    theirs[1],
                    group.rank(),
                    mine[0],
                    mine[1]
                ),
            ));
        }
    }
    Ok(())
}

/// Splits `state.{index}.{name}` into its index and name.
fn state_key(key: &str) -> Option<(usize, &str)> {
    let (i, name) = key.strip_prefix("state.")?.split_once('.')?;
    Some((i.parse().ok()?, name))
}

fn bad_key(key: &str) -> Error {
    Error::invalid(
        OP,
        format!("unexpected key {key:?} in state dict: expected \"state.<param index>.<name>\" or \"param_groups.<group index>.<name>\""),
    )
}

/// A copy of `t` on the CPU (a snapshot: later steps do not change it).
fn cpu_copy(t: &Tensor) -> Result<Tensor> {
    let _g = no_grad();
    match t.device() {
        Device::Cpu => t.deep_clone(),
        _ => t.to(Device::Cpu),
    }
}

impl<O: Optimizer> ZeroRedundancyOptimizer<O> {
    /// Partitions `params` over the ranks of `process_group` (the default group when `None`)
    /// and builds this rank's optimizer with `optimizer_class` over its share (PyTorch's
    /// `ZeroRedundancyOptimizer(params, optimizer_class, process_group, **defaults)`: the
    /// closure carries the defaults, e.g. `|p| AdamW::new(p, config)`). Collective: every rank
    /// must pass the same parameters (shapes and dtypes, in the same order), else a typed error
    /// on every rank. A rank that owns no parameter (more ranks than parameters) builds the
    /// optimizer over all of them once, to learn its hyperparameters, and keeps none. For
    /// several param groups see [`ZeroRedundancyOptimizer::with_groups`].
    ///
    /// Errors: an empty `params`; parameters that differ between ranks; no default group when
    /// `process_group` is `None`; whatever `optimizer_class` returns.
    pub fn new(
        params: Vec<Tensor>,
        optimizer_class: impl Fn(Vec<Tensor>) -> Result<O>,
        process_group: Option<ProcessGroup>,
    ) -> Result<ZeroRedundancyOptimizer<O>> {
        let all = params.clone();
        let idle = std::cell::Cell::new(false);
        let mut zero = ZeroRedundancyOptimizer::with_groups(
            vec![ParamGroup::new(params)],
            |groups| {
                let mine = groups
                    .into_iter()
                    .next()
                    .map(|g| g.params().to_vec())
                    .unwrap_or_default();
                idle.set(mine.is_empty());
                optimizer_class(if mine.is_empty() { all.clone() } else { mine })
            },
            process_group,
        )?;
        zero.idle = zero.partition.iter().map(Vec::is_empty).collect();
        debug_assert_eq!(zero.idle[zero.group.rank()], idle.get());
        Ok(zero)
    }

    /// [`ZeroRedundancyOptimizer::new`] over param groups (PyTorch's class given a list of
    /// dicts, e.g. nanoGPT's decay and no-decay groups): each group is partitioned in turn
    /// (Note [ZeRO partition]) and `optimizer_class` receives one group per param group, with
    /// its hyperparameters and this rank's share of its parameters (possibly empty), e.g.
    /// `|groups| AdamW::with_groups(groups, config)`. Collective, as `new`; every rank must pass
    /// the same groups.
    pub fn with_groups(
        groups: Vec<ParamGroup>,
        optimizer_class: impl Fn(Vec<ParamGroup>) -> Result<O>,
        process_group: Option<ProcessGroup>,
    ) -> Result<ZeroRedundancyOptimizer<O>> {
        if groups.iter().all(|g| g.params().is_empty()) {
            return Err(Error::invalid(
                OP,
                "ZeroRedundancyOptimizer got an empty parameter list; pass model.parameters()",
            ));
        }
        let group = match process_group {
            Some(g) => g,
            None => default_group()?,
        };
        let mut params = Vec::new();
        let mut ranges = Vec::new();
        for g in &groups {
            ranges.push(params.len()..params.len() + g.params().len());
            params.extend_from_slice(g.params());
        }
        let sizes: Vec<usize> = ranges.iter().map(Range::len).collect();
        check_same_params(&group, &params, &sizes)?;
        let by_group = partition_parameters(
            &params.iter().map(Tensor::numel).collect::<Vec<_>>(),
            &ranges,
            group.size(),
        );
        let local: Vec<ParamGroup> = groups
            .iter()
            .zip(&by_group[group.rank()])
            .map(|(g, owned)| g.with_params(owned.iter().map(|&i| params[i].clone()).collect()))
            .collect();
        let optim = optimizer_class(local)?;
        if optim.num_param_groups() != groups.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "optimizer_class made an optimizer of {} param group(s) from {}: build it with the groups it is given (e.g. AdamW::with_groups)",
                    optim.num_param_groups(),
                    groups.len()
                ),
            ));
        }
        let mut zero = ZeroRedundancyOptimizer {
            idle: vec![false; group.size()],
            params,
            groups: ranges,
            by_group,
            partition: Vec::new(),
            buckets: Vec::new(),
            optim,
            group,
            all_state_dicts: Vec::new(),
        };
        zero.index_partition();
        Ok(zero)
    }

    /// Sets `partition` and `buckets` from `by_group`.
    fn index_partition(&mut self) {
        self.partition = self.by_group.iter().map(|groups| groups.concat()).collect();
        self.buckets = self
            .partition
            .iter()
            .map(|owned| bucket_by_kind(&self.params, owned))
            .collect();
    }

    /// Appends a param group (PyTorch's `add_param_group`): partitioned after the others (Note
    /// [ZeRO partition]; earlier parameters stay where they are), and this rank's share added
    /// to its optimizer as a group of the same hyperparameters (possibly empty). Collective:
    /// every rank must add the same group. Errors as the constructors, or the local
    /// optimizer's own (an optimizer without groups refuses).
    pub fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        let first = self.params.len();
        let mut params = self.params.clone();
        params.extend_from_slice(group.params());
        let mut ranges = self.groups.clone();
        ranges.push(first..params.len());
        let sizes: Vec<usize> = ranges.iter().map(Range::len).collect();
        check_same_params(&self.group, &params, &sizes)?;
        let by_group = partition_parameters(
            &params.iter().map(Tensor::numel).collect::<Vec<_>>(),
            &ranges,
            self.group.size(),
        );
        if let Some(r) =
            (0..by_group.len()).find(|&r| self.idle[r] && by_group[r].last().is_some_and(|g| !g.is_empty()))
        {
            return Err(Error::invalid(
                OP,
                format!("the new group gives rank {r} parameters, but rank {r} owned none when ZeroRedundancyOptimizer::new built it and has no optimizer of its own; build the optimizer with ZeroRedundancyOptimizer::with_groups instead"),
            ));
        }
        let mine = by_group[self.group.rank()].last().cloned().unwrap_or_default();
        self.optim
            .add_param_group(group.with_params(mine.iter().map(|&i| params[i].clone()).collect()))?;
        debug_assert!(by_group
            .iter()
            .zip(&self.by_group)
            .all(|(new, old)| new[..old.len()] == old[..]));
        self.params = params;
        self.groups = ranges;
        self.by_group = by_group;
        self.all_state_dicts.clear();
        self.index_partition();
        Ok(())
    }

    /// This rank's optimizer over its share of the parameters (PyTorch's `optim` attribute):
    /// one group per param group, each holding the parameters of [`Self::partition_parameters`]
    /// of this rank that belong to it (possibly none); `None` on a rank that
    /// [`ZeroRedundancyOptimizer::new`] left without parameters.
    pub fn optim(&self) -> Option<&O> {
        (!self.idle[self.group.rank()]).then_some(&self.optim)
    }

    /// The process group the state is sharded over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The partition (Note [ZeRO partition]): for each rank of the group, the indices into
    /// [`Optimizer::params`] of the parameters it owns and steps, in the order of its local
    /// optimizer's parameters (group by group).
    pub fn partition_parameters(&self) -> &[Vec<usize>] {
        &self.partition
    }

    /// Sends every rank's parameters to the others (Note [ZeRO step]); collective.
    fn sync_params(&self) -> Result<()> {
        if self.group.size() == 1 {
            return Ok(());
        }
        let me = self.group.rank();
        let _g = no_grad();
        for (r, buckets) in self.buckets.iter().enumerate() {
            let src = self.group.global_rank(r)?;
            for bucket in buckets {
                let first = &self.params[bucket[0]];
                let total: usize = bucket.iter().map(|&i| self.params[i].numel()).sum();
                let flat = Tensor::empty([total], first.dtype(), first.device())?;
                // The bucket's parameters as views of `flat`, packed and unpacked with one
                // `foreach_copy_` each (one launch per 64 on a GPU, Note [Foreach copies] in
                // ember-core). The parameters are leaves that require grad: detached (the
                // same storage, written outside autograd either way), the list takes the
                // one-launch path.
                let mut offset = 0;
                let (mut params, mut slices) = (Vec::new(), Vec::new());
                for &i in bucket {
                    let p = self.params[i].detach();
                    slices.push(flat.narrow(0, offset, p.numel())?.reshape(p.dims())?);
                    offset += p.numel();
                    params.push(p);
                }
                if r == me {
                    ember_core::foreach_copy_(&slices, &params)?;
                }
                self.group.broadcast(&flat, src)?;
                if r != me {
                    ember_core::foreach_copy_(&params, &slices)?;
                }
            }
        }
        Ok(())
    }

    /// This rank's local state dict, copied to the CPU (empty without a local optimizer).
    fn local_state_on_cpu(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(o) = self.optim() else {
            return Ok(Vec::new());
        };
        o.state_dict()
            .into_iter()
            .map(|(k, t)| Ok((k, cpu_copy(&t)?)))
            .collect()
    }

    /// Gathers every rank's local optimizer state on group rank `to`, on the CPU
    /// (`consolidate_state_dict(to=0)`), for [`ZeroRedundancyOptimizer::state_dict`] there.
    /// Collective: every rank must call it. Each rank's state travels as safetensors bytes
    /// in two broadcasts (its length, then the bytes), as PyTorch's broadcasts of pickles.
    pub fn consolidate_state_dict(&mut self, to: usize) -> Result<()> {
        let (world, me) = (self.group.size(), self.group.rank());
        if to >= world {
            return Err(Error::invalid(
                "consolidate_state_dict",
                format!("rank {to} is not a rank of the optimizer's group of {world}"),
            ));
        }
        self.all_state_dicts.clear();
        let device = self.group.device();
        let mut gathered = Vec::with_capacity(world);
        for r in 0..world {
            if r == to {
                // Its own state needs no message.
                if me == to {
                    gathered.push(self.local_state_on_cpu()?);
                }
                continue;
            }
            let src = self.group.global_rank(r)?;
            let bytes = if r == me {
                save_tensors_to_bytes(&self.local_state_on_cpu()?)?
            } else {
                Vec::new()
            };
            let len = Tensor::from_vec(vec![bytes.len() as i64], [1], Device::Cpu)?.to(device)?;
            self.group.broadcast(&len, src)?;
            let len = len.to_vec::<i64>()?[0] as usize;
            let payload = if r == me {
                Tensor::from_vec(bytes, [len], Device::Cpu)?.to(device)?
            } else {
                Tensor::zeros([len], DType::U8, device)?
            };
            self.group.broadcast(&payload, src)?;
            if me == to {
                gathered.push(load_tensors_from_bytes(&payload.to_vec::<u8>()?, Device::Cpu)?);
            }
        }
        if me == to {
            self.all_state_dicts = gathered;
        }
        Ok(())
    }

    /// The state dict of the whole optimizer, as the optimizer without ZeRO would return it
    /// (`state.{i}.*` under the global parameter indices of [`Optimizer::params`], and for
    /// each group `param_groups.{g}.params` with the global indices and every hyperparameter
    /// of the local optimizer's group, [`Optimizer::param_group_state`]), from the state last
    /// consolidated on this rank (PyTorch's
    /// `state_dict()`: as recent as the last [`ZeroRedundancyOptimizer::consolidate_state_dict`]).
    /// An error on a rank the state was not consolidated on, saying to consolidate first.
    ///
    /// This inherent method is what `zero.state_dict()` calls; through the [`Optimizer`] trait
    /// (code generic over optimizers), `state_dict` returns the same when consolidated, and
    /// otherwise only this rank's own parameters' state with the param groups (never silently
    /// another rank's).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        if self.all_state_dicts.is_empty() {
            let me = self.group.rank();
            return Err(Error::invalid(
                "ZeroRedundancyOptimizer::state_dict",
                format!("the optimizer state has not been consolidated on rank {me}; call consolidate_state_dict({me}) on every rank first"),
            ));
        }
        self.global_state(
            self.all_state_dicts
                .iter()
                .enumerate()
                .map(|(r, s)| (r, s.as_slice())),
        )
    }

    /// The global state dict made of the local state dicts `locals` (rank, its state).
    fn global_state<'a>(
        &self,
        locals: impl Iterator<Item = (usize, &'a [(String, Tensor)])>,
    ) -> Result<Vec<(String, Tensor)>> {
        let mut state: Vec<(usize, String, Tensor)> = Vec::new();
        for (r, local) in locals {
            for (key, t) in local {
                if key.starts_with("param_groups.") {
                    continue;
                }
                let (i, name) = state_key(key).ok_or_else(|| bad_key(key))?;
                let global = *self.partition[r].get(i).ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "rank {r}'s state names its parameter {i}, but it owns {}",
                            self.partition[r].len()
                        ),
                    )
                })?;
                state.push((global, format!("state.{global}.{name}"), t.clone()));
            }
        }
        state.sort_by_key(|(g, _, _)| *g); // stable: a parameter's entries keep their order
        let mut out: Vec<(String, Tensor)> = state.into_iter().map(|(_, k, t)| (k, t)).collect();
        // Every group's entries as the unsharded optimizer's: its parameters' global indices,
        // then the local group's hyperparameters (each rank's group g has group g's).
        for (g, range) in self.groups.iter().enumerate() {
            out.push((
                format!("param_groups.{g}.params"),
                Tensor::arange_i64(range.start as i64, range.end as i64, 1, Device::Cpu)?,
            ));
            out.extend(
                self.optim
                    .param_group_state(g)
                    .into_iter()
                    .map(|(name, t)| (format!("param_groups.{g}.{name}"), t)),
            );
        }
        Ok(out)
    }

    /// Loads a whole optimizer's state dict (as [`ZeroRedundancyOptimizer::state_dict`] or
    /// the same optimizer without ZeRO returns it): each rank keeps the entries of the
    /// parameters it owns, renumbered for its local optimizer, and every rank each group's
    /// hyperparameters (all of them; those the state dict lacks keep their values, as the
    /// local optimizer's `load_state_dict` keeps them). A state dict of another number of
    /// groups, or whose group lists other parameters, is a typed error, as the optimizers' own;
    /// so is a hyperparameter the local optimizer does not have or refuses. Checks every key
    /// before anything changes. Not collective.
    pub fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()> {
        let n = self.params.len();
        let me = self.group.rank();
        let mut local_of = vec![None; n];
        for (i, &g) in self.partition[me].iter().enumerate() {
            local_of[g] = Some(i);
        }
        let mut groups = 0;
        for (key, _) in state {
            if let Some(rest) = key.strip_prefix("param_groups.") {
                let g: usize = rest
                    .split_once('.')
                    .and_then(|(g, _)| g.parse().ok())
                    .ok_or_else(|| bad_key(key))?;
                groups = groups.max(g + 1);
            }
        }
        if groups > 0 && groups != self.groups.len() {
            return Err(StateDictError::ParamGroupCount {
                optimizer: OP,
                expected: self.groups.len(),
                found: groups,
            });
        }
        // Each group's entries but `params`: its hyperparameters, which the local optimizer
        // checks and loads (PyTorch's ZeroRedundancyOptimizer hands the groups' dicts on too).
        let mut hyper: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); self.groups.len()];
        let mut local = Vec::new();
        for (key, t) in state {
            if let Some(rest) = key.strip_prefix("param_groups.") {
                let (g, name) = rest.split_once('.').ok_or_else(|| bad_key(key))?;
                let g: usize = g.parse().map_err(|_| bad_key(key))?;
                let range = self.groups[g].clone();
                match name {
                    "params" => {
                        let listed = t.to_vec_f64()?;
                        if listed.len() != range.len() {
                            return Err(StateDictError::ParamGroupSize {
                                optimizer: OP,
                                group: g,
                                expected: range.len(),
                                found: listed.len(),
                            });
                        }
                        if listed.iter().zip(range.clone()).any(|(&v, i)| v != i as f64) {
                            return Err(Error::invalid(
                                OP,
                                format!(
                                    "\"param_groups.{g}.params\" lists parameters {listed:?}, expected {}..{}",
                                    range.start, range.end
                                ),
                            )
                            .into());
                        }
                    }
                    _ => hyper[g].push((name.to_owned(), t.clone())),
                }
                continue;
            }
            let (g, name) = state_key(key).ok_or_else(|| bad_key(key))?;
            if g >= n {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "state dict key {key:?} names parameter {g}, but the optimizer has {n} parameters"
                    ),
                )
                .into());
            }
            if let Some(i) = local_of[g] {
                local.push((format!("state.{i}.{name}"), t.clone()));
            }
        }
        // The local optimizer's groups: this rank's share of each, numbered group by group.
        let hyper = hyper.into_iter().enumerate().flat_map(|(g, entries)| {
            entries
                .into_iter()
                .map(move |(name, t)| (format!("param_groups.{g}.{name}"), t))
        });
        if self.idle[me] {
            // No optimizer of its own (one over every parameter, in one group, never stepped):
            // only the hyperparameters, which leave it without state as before.
            return self.optim.load_state_dict(&hyper.collect::<Vec<_>>());
        }
        let mut next = 0i64;
        for (g, owned) in self.by_group[me].iter().enumerate() {
            let count = owned.len() as i64;
            local.push((
                format!("param_groups.{g}.params"),
                Tensor::arange_i64(next, next + count, 1, Device::Cpu)?,
            ));
            next += count;
        }
        local.extend(hyper);
        self.optim.load_state_dict(&local)
    }
}

impl<O: Optimizer> Optimizer for ZeroRedundancyOptimizer<O> {
    /// The local optimizer's step over this rank's parameters, then the exchange that gives
    /// every rank all of them (Note [ZeRO step]). Collective.
    fn step(&mut self) -> Result<()> {
        if !self.idle[self.group.rank()] {
            self.optim.step()?;
        }
        self.sync_params()
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn supports_amp_scaling(&self) -> bool {
        self.optim.supports_amp_scaling()
    }

    /// The local optimizer's scaled step, then the exchange (Note [ZeRO step]). A skipped step
    /// (`found_inf` set) changes nothing anywhere: with DDP every rank holds the same averaged
    /// gradients, so every rank's flag agrees.
    fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> Result<()> {
        if !self.idle[self.group.rank()] {
            self.optim.step_scaled(grad_scale, found_inf)?;
        }
        self.sync_params()
    }

    /// Releases the gradient of every parameter, owned or not.
    fn zero_grad(&mut self) -> Result<()> {
        self.params.iter().try_for_each(|p| p.set_grad(None))
    }

    fn lr(&self) -> f64 {
        self.optim.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.optim.set_lr(lr)
    }

    fn initial_lr(&self) -> Option<f64> {
        self.optim.initial_lr()
    }

    fn set_initial_lr(&mut self, lr: f64) {
        self.optim.set_initial_lr(lr)
    }

    /// [`ZeroRedundancyOptimizer::add_param_group`] (collective).
    fn add_param_group(&mut self, group: ParamGroup) -> Result<()> {
        ZeroRedundancyOptimizer::add_param_group(self, group)
    }

    fn num_param_groups(&self) -> usize {
        self.groups.len()
    }

    fn group_lr(&self, group: usize) -> f64 {
        self.optim.group_lr(group)
    }

    fn set_group_lr(&mut self, group: usize, lr: f64) {
        self.optim.set_group_lr(group, lr)
    }

    fn group_initial_lr(&self, group: usize) -> Option<f64> {
        self.optim.group_initial_lr(group)
    }

    fn param_group_state(&self, group: usize) -> Vec<(String, Tensor)> {
        self.optim.param_group_state(group)
    }

    fn set_group_initial_lr(&mut self, group: usize, lr: f64) {
        self.optim.set_group_initial_lr(group, lr)
    }

    /// See [`ZeroRedundancyOptimizer::state_dict`]: the consolidated state when there is one,
    /// else this rank's own parameters' state and the param groups.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        if let Ok(s) = ZeroRedundancyOptimizer::state_dict(self) {
            return s;
        }
        let own = self.optim().map(|o| o.state_dict()).unwrap_or_default();
        self.global_state(std::iter::once((self.group.rank(), own.as_slice())))
            .unwrap_or_default()
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> StateDictResult<()> {
        ZeroRedundancyOptimizer::load_state_dict(self, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_is_pytorchs_sorted_greedy() {
        // Sorted 64, 32, 24, 8, 8, 3: rank 0 takes 64, rank 1 32 + 24 + 8 (64), then the tie
        // goes to rank 0 (72) and the last to rank 1.
        let one = |numels: &[usize], world| -> Vec<Vec<usize>> {
            partition_parameters(numels, &[0..numels.len()], world)
                .into_iter()
                .map(|g| g.concat())
                .collect()
        };
        assert_eq!(one(&[32, 8, 64, 8, 24, 3], 2), [vec![2, 3], vec![0, 4, 1, 5]]);
        assert_eq!(
            one(&[32, 8, 64, 8, 24, 3], 3),
            [vec![2], vec![0, 3], vec![4, 1, 5]]
        );
        // More ranks than parameters: the last ranks own nothing.
        assert_eq!(one(&[5, 7], 3), [vec![1], vec![0], vec![]]);
        assert_eq!(one(&[5, 7], 1), [vec![1, 0]]);
        // Param groups in turn, the sizes counted across them (PyTorch's rule): group 0
        // (8, 64) puts 64 on rank 0 and 8 on rank 1; group 1 (24, 3, 32) starts from 64 | 8:
        // 32 and 24 go to rank 1 (64 | 64), then the tie puts 3 on rank 0.
        assert_eq!(
            partition_parameters(&[8, 64, 24, 3, 32], &[0..2, 2..5], 2),
            [vec![vec![1], vec![3]], vec![vec![0], vec![4, 2]]]
        );
    }

    #[test]
    fn fingerprints_tell_shapes_and_dtypes_apart() {
        let t = |dims: &[usize], d: DType| Tensor::zeros(dims, d, Device::Cpu).unwrap();
        let a = fingerprint(&[t(&[2, 3], DType::F32), t(&[3], DType::F32)]);
        assert_eq!(a, fingerprint(&[t(&[2, 3], DType::F32), t(&[3], DType::F32)]));
        assert_ne!(a, fingerprint(&[t(&[3, 2], DType::F32), t(&[3], DType::F32)]));
        assert_ne!(a, fingerprint(&[t(&[2, 3], DType::F64), t(&[3], DType::F32)]));
        assert_ne!(a, fingerprint(&[t(&[3], DType::F32), t(&[2, 3], DType::F32)]));
    }
}
