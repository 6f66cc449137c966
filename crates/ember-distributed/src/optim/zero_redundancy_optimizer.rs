//! [`ZeroRedundancyOptimizer`] (`torch.distributed.optim.ZeroRedundancyOptimizer`): an
//! optimizer whose state is sharded across the ranks of a process group, each rank stepping
//! only the parameters it owns and then sending them to the others (ZeRO stage 1, as llm.c's
//! ZeRO-1 and PyTorch's class).
//!
//! Note [ZeRO partition]: parameters are partitioned whole, as PyTorch's class does, by its
//! sorted-greedy rule: sorted by element count, largest first (ties in the order given), each
//! goes to the rank with the fewest elements so far (the lowest such rank). Every rank computes
//! the same partition from the shapes alone, which [`ZeroRedundancyOptimizer::new`] checks are
//! the same on every rank. Whole parameters rather than flat dim-0 shards because:
//! - any optimizer works unchanged: the local optimizer is the user's own (AdamW, SGD, ...)
//!   over ordinary parameters, fused steps included, and an update that looks at a whole
//!   parameter (a norm, as LAMB's trust ratio) still sees it whole;
//! - the local optimizer's state dict is a sub-dict of the unsharded one, so the consolidated
//!   state dict is exactly the state dict of the same optimizer without ZeRO (indices remapped);
//! - parameters keep their storage (no flattening into buckets that would change `.data`).
//!
//! The cost is balance at the granularity of a parameter (one huge embedding can leave its rank
//! the largest share); flat shards balance exactly and are what `fully_shard` (FSDP2) does.
//!
//! Note [ZeRO step]: [`Optimizer::step`] runs the local optimizer over this rank's parameters
//! (which are the only ones to get optimizer state), then, rank by rank, the owner copies its
//! parameters into one flat buffer per (device, dtype) and broadcasts it, and the others copy it
//! back into their parameters. Rank by rank bounds the extra memory by the largest rank's share;
//! the ranks' broadcasts run one after the other on the wire anyway. A step therefore costs one
//! broadcast per rank and dtype, moving every parameter once (the all-gather of ZeRO's papers,
//! as broadcasts since the shares are uneven). With DDP the gradients arrive averaged on every
//! rank, so the result equals DDP with the unsharded optimizer, bit for bit (the elementwise
//! updates see the same values in the same order; only which rank computes them differs).
//!
//! Every rank must call `step`, `consolidate_state_dict` and the constructor in the same order
//! (they are collective over the group).

use ember_core::{no_grad, DType, Device, Error, Result, Tensor};
use ember_nn::optim::Optimizer;
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
    params: Vec<Tensor>,
    /// `partition[r]`: the indices into `params` that rank `r` owns, in assignment order (the
    /// order of the local optimizer's parameters on rank `r`).
    partition: Vec<Vec<usize>>,
    /// `buckets[r]`: rank `r`'s parameters grouped by (device, dtype), one broadcast each.
    buckets: Vec<Vec<Vec<usize>>>,
    /// The optimizer over this rank's share; `None` when it owns no parameter (more ranks than
    /// parameters).
    optim: Option<O>,
    group: ProcessGroup,
    /// The group's lr and initial lr, kept here too for a rank without a local optimizer.
    lr: f64,
    initial_lr: Option<f64>,
    supports_amp_scaling: bool,
    /// The local state dicts of every rank, by rank, after `consolidate_state_dict` to this one.
    all_state_dicts: Vec<Vec<(String, Tensor)>>,
}

/// Note [ZeRO partition]: the sorted-greedy assignment of parameters of `numels` elements to
/// `world` ranks; per rank, the parameter indices in assignment order.
pub(crate) fn partition_parameters(numels: &[usize], world: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..numels.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(numels[i])); // stable: ties keep their order
    let mut sizes = vec![0usize; world];
    let mut out = vec![Vec::new(); world];
    for i in order {
        let r = (0..world).min_by_key(|&r| sizes[r]).unwrap_or(0); // the first minimum
        out[r].push(i);
        sizes[r] += numels[i];
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

/// Errors unless every rank of `group` passed parameters of the same count, shapes and dtypes
/// (one all-gather), so that every rank computes the same partition.
fn check_same_params(group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
    let world = group.size();
    if world == 1 {
        return Ok(());
    }
    let numel: usize = params.iter().map(Tensor::numel).sum();
    let mine = [params.len() as i64, numel as i64, fingerprint(params)];
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
                    "rank {r} of the group passed {} parameter(s) of {} elements, rank {} passed {} of {} (or the shapes or dtypes differ): every rank must pass the same parameters (the same shapes and dtypes, in the same order), e.g. its replica's model.parameters()",
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
        format!("unexpected key {key:?} in state dict: expected \"state.<param index>.<name>\" or \"param_groups.0.<name>\""),
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
    /// optimizer over all of them once, to learn its lr, and keeps none.
    ///
    /// Errors: an empty `params`; parameters that differ between ranks; no default group when
    /// `process_group` is `None`; whatever `optimizer_class` returns.
    pub fn new(
        params: Vec<Tensor>,
        optimizer_class: impl Fn(Vec<Tensor>) -> Result<O>,
        process_group: Option<ProcessGroup>,
    ) -> Result<ZeroRedundancyOptimizer<O>> {
        if params.is_empty() {
            return Err(Error::invalid(
                OP,
                "ZeroRedundancyOptimizer got an empty parameter list; pass model.parameters()",
            ));
        }
        let group = match process_group {
            Some(g) => g,
            None => default_group()?,
        };
        check_same_params(&group, &params)?;
        let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let partition = partition_parameters(&numels, group.size());
        let buckets = partition
            .iter()
            .map(|owned| bucket_by_kind(&params, owned))
            .collect();
        let mine: Vec<Tensor> = partition[group.rank()]
            .iter()
            .map(|&i| params[i].clone())
            .collect();
        // A rank without parameters builds the optimizer over all of them, only to read its
        // hyperparameters (no state exists before a step).
        let owns = !mine.is_empty();
        let built = optimizer_class(if owns { mine } else { params.clone() })?;
        let (lr, initial_lr, supports_amp_scaling) =
            (built.lr(), built.initial_lr(), built.supports_amp_scaling());
        let optim = owns.then_some(built);
        Ok(ZeroRedundancyOptimizer {
            params,
            partition,
            buckets,
            optim,
            group,
            lr,
            initial_lr,
            supports_amp_scaling,
            all_state_dicts: Vec::new(),
        })
    }

    /// This rank's optimizer over its share of the parameters (PyTorch's `optim` attribute);
    /// `None` on a rank that owns no parameter.
    pub fn optim(&self) -> Option<&O> {
        self.optim.as_ref()
    }

    /// The process group the state is sharded over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The partition (Note [ZeRO partition]): for each rank of the group, the indices into
    /// [`Optimizer::params`] of the parameters it owns and steps, in the order of its local
    /// optimizer's parameters.
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
                let mut offset = 0;
                let mut slices = Vec::with_capacity(bucket.len());
                for &i in bucket {
                    let p = &self.params[i];
                    let slice = flat.narrow(0, offset, p.numel())?;
                    if r == me {
                        slice.copy_(&p.reshape(&[-1])?)?;
                    }
                    slices.push((p, slice));
                    offset += p.numel();
                }
                self.group.broadcast(&flat, src)?;
                if r != me {
                    for (p, slice) in slices {
                        p.copy_(&slice.reshape(p.dims())?)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// This rank's local state dict, copied to the CPU (empty without a local optimizer).
    fn local_state_on_cpu(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(o) = &self.optim else {
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
    /// (`state.{i}.*` under the global parameter indices of [`Optimizer::params`], and
    /// `param_groups.0.*`), from the state last consolidated on this rank (PyTorch's
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
        let n = self.params.len();
        let mut out: Vec<(String, Tensor)> = state.into_iter().map(|(_, k, t)| (k, t)).collect();
        out.push((
            "param_groups.0.params".into(),
            Tensor::arange_i64(0, n as i64, 1, Device::Cpu)?,
        ));
        out.push((
            "param_groups.0.lr".into(),
            Tensor::scalar(self.lr, DType::F64, Device::Cpu)?,
        ));
        if let Some(v) = self.initial_lr {
            out.push((
                "param_groups.0.initial_lr".into(),
                Tensor::scalar(v, DType::F64, Device::Cpu)?,
            ));
        }
        Ok(out)
    }

    /// Loads a whole optimizer's state dict (as [`ZeroRedundancyOptimizer::state_dict`] or
    /// the same optimizer without ZeRO returns it): each rank keeps the entries of the
    /// parameters it owns, renumbered for its local optimizer, and every rank the lr. Checks
    /// every key before anything changes. Not collective.
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
        if groups > 1 {
            return Err(StateDictError::ParamGroupCount {
                optimizer: OP,
                expected: 1,
                found: groups,
            });
        }
        let (mut lr, mut initial_lr) = (self.lr, self.initial_lr);
        let mut local = Vec::new();
        for (key, t) in state {
            match key.strip_prefix("param_groups.0.") {
                Some("params") => {
                    let listed = t.to_vec_f64()?;
                    if listed.len() != n {
                        return Err(StateDictError::ParamGroupSize {
                            optimizer: OP,
                            group: 0,
                            expected: n,
                            found: listed.len(),
                        });
                    }
                    if listed.iter().enumerate().any(|(i, &v)| v != i as f64) {
                        return Err(Error::invalid(
                            OP,
                            format!("\"param_groups.0.params\" lists parameters {listed:?}, expected 0..{n}"),
                        )
                        .into());
                    }
                }
                Some("lr") => lr = t.item_f64()?,
                Some("initial_lr") => initial_lr = Some(t.item_f64()?),
                Some(_) => return Err(bad_key(key).into()),
                None => {
                    let (g, name) = state_key(key).ok_or_else(|| bad_key(key))?;
                    if g >= n {
                        return Err(Error::invalid(
                            OP,
                            format!("state dict key {key:?} names parameter {g}, but the optimizer has {n} parameters"),
                        )
                        .into());
                    }
                    if let Some(i) = local_of[g] {
                        local.push((format!("state.{i}.{name}"), t.clone()));
                    }
                }
            }
        }
        if let Some(o) = &mut self.optim {
            let owned = self.partition[me].len() as i64;
            local.push((
                "param_groups.0.params".into(),
                Tensor::arange_i64(0, owned, 1, Device::Cpu)?,
            ));
            local.push((
                "param_groups.0.lr".into(),
                Tensor::scalar(lr, DType::F64, Device::Cpu)?,
            ));
            if let Some(v) = initial_lr {
                local.push((
                    "param_groups.0.initial_lr".into(),
                    Tensor::scalar(v, DType::F64, Device::Cpu)?,
                ));
            }
            o.load_state_dict(&local)?;
        }
        self.lr = lr;
        self.initial_lr = initial_lr;
        Ok(())
    }
}

impl<O: Optimizer> Optimizer for ZeroRedundancyOptimizer<O> {
    /// The local optimizer's step over this rank's parameters, then the exchange that gives
    /// every rank all of them (Note [ZeRO step]). Collective.
    fn step(&mut self) -> Result<()> {
        if let Some(o) = &mut self.optim {
            o.step()?;
        }
        self.sync_params()
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn supports_amp_scaling(&self) -> bool {
        self.supports_amp_scaling
    }

    /// The local optimizer's scaled step, then the exchange (Note [ZeRO step]). A skipped step
    /// (`found_inf` set) changes nothing anywhere: with DDP every rank holds the same averaged
    /// gradients, so every rank's flag agrees.
    fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> Result<()> {
        if let Some(o) = &mut self.optim {
            o.step_scaled(grad_scale, found_inf)?;
        }
        self.sync_params()
    }

    /// Releases the gradient of every parameter, owned or not.
    fn zero_grad(&mut self) -> Result<()> {
        self.params.iter().try_for_each(|p| p.set_grad(None))
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
        if let Some(o) = &mut self.optim {
            o.set_lr(lr);
        }
    }

    fn initial_lr(&self) -> Option<f64> {
        self.initial_lr
    }

    fn set_initial_lr(&mut self, lr: f64) {
        self.initial_lr = Some(lr);
        if let Some(o) = &mut self.optim {
            o.set_initial_lr(lr);
        }
    }

    /// See [`ZeroRedundancyOptimizer::state_dict`]: the consolidated state when there is one,
    /// else this rank's own parameters' state and the param groups.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        if let Ok(s) = ZeroRedundancyOptimizer::state_dict(self) {
            return s;
        }
        let own = self.optim.as_ref().map(|o| o.state_dict()).unwrap_or_default();
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
        assert_eq!(
            partition_parameters(&[32, 8, 64, 8, 24, 3], 2),
            [vec![2, 3], vec![0, 4, 1, 5]]
        );
        assert_eq!(
            partition_parameters(&[32, 8, 64, 8, 24, 3], 3),
            [vec![2], vec![0, 3], vec![4, 1, 5]]
        );
        // More ranks than parameters: the last ranks own nothing.
        assert_eq!(partition_parameters(&[5, 7], 3), [vec![1], vec![0], vec![]]);
        assert_eq!(partition_parameters(&[5, 7], 1), [vec![1, 0]]);
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
