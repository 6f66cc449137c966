//! Process groups (`torch.distributed.ProcessGroup`) and the default group's functions
//! (`init_process_group`, `get_rank`, `all_reduce`, ...).
//!
//! A [`ProcessGroup`] is a set of ranks with a [`Backend`] that moves their bytes. It checks
//! every call's arguments (so backends need not), maps global ranks to group ranks (`src` and
//! `dst` are global ranks, as in PyTorch), and offers each operation in a blocking form and an
//! `_async` one returning a [`Work`].
//!
//! The default group is process-wide, set by [`init_process_group`] and cleared by
//! [`destroy_process_group`]; the free functions of this module act on it.
//!
//! Note [Group creation is collective]: [`new_group`] must be called by every rank of the
//! default group, with the same ranks, in the same order, members or not (as in PyTorch): the
//! groups are numbered by call order and each number is a key prefix in the store.
//!
//! Note [Group key prefixes]: a world group created on a store that already served one (a
//! store passed in [`InitOptions::store`], or [`ProcessGroup::new`] called again with the same
//! store) must not find the previous group's addresses. Each rank counts the world groups it
//! created on the store (`generation/<rank>`, an `add`); every rank creates the same sequence
//! of groups, so the counts agree, and the `k`-th world group and its subgroups keep their
//! keys under `g<k>/pg<n>/`.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember_core::{Error, Result, Tensor};

use crate::backend::{Backend, ReduceOp, Work};
use crate::cpu_backend::CpuBackend;
use crate::nccl::NcclBackend;
use crate::rendezvous;
use crate::store::{PrefixStore, Store, TcpStore, DEFAULT_TIMEOUT};

/// Which backend a group uses (`torch.distributed.Backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// ember's CPU backend over TCP, under PyTorch's name for the CPU backend ("gloo"; "cpu"
    /// is accepted too) so programs port unchanged. It also takes CUDA tensors, through host
    /// copies.
    Gloo,
    /// NCCL, for CUDA tensors on the group's device (see [`crate::nccl`]).
    Nccl,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<BackendKind> {
        match s.to_ascii_lowercase().as_str() {
            "gloo" | "cpu" => Ok(BackendKind::Gloo),
            "nccl" => Ok(BackendKind::Nccl),
            _ => Err(Error::invalid(
                "init_process_group",
                format!("unknown backend {s:?}; use \"gloo\" (CPU) or \"nccl\" (CUDA)"),
            )),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Gloo => "gloo",
            BackendKind::Nccl => "nccl",
        })
    }
}

impl BackendKind {
    /// Creates this backend for a group, meeting the peers through `store` (already prefixed
    /// for the group); NCCL's communicator goes on `cuda:{device}`. The one place where
    /// backends are chosen.
    fn create(
        self,
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        ip: IpAddr,
        device: usize,
    ) -> Result<Arc<dyn Backend>> {
        match self {
            BackendKind::Gloo => Ok(Arc::new(CpuBackend::new(store, rank, size, timeout, ip)?)),
            BackendKind::Nccl => Ok(Arc::new(NcclBackend::new(store, rank, size, timeout, device)?)),
        }
    }
}

/// The arguments of [`init_process_group`], with PyTorch's defaults: `init_method` `"env://"`,
/// rank and world size from the environment, a 30-minute timeout.
#[derive(Clone)]
pub struct InitOptions {
    pub backend: BackendKind,
    /// `"env://"` (or empty) or `"tcp://host:port"` (see [`crate::rendezvous`]).
    pub init_method: String,
    pub world_size: Option<usize>,
    pub rank: Option<usize>,
    /// The bound on every blocking step of initialization and of each operation.
    pub timeout: Duration,
    /// A store to meet through instead of the one `init_method` names (PyTorch's `store=`).
    pub store: Option<Arc<dyn Store>>,
    /// The CUDA device of an NCCL group (PyTorch's `device_id`); by default `LOCAL_RANK` (or
    /// `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`), else the rank modulo the device count.
    /// Subgroups use their parent's device. The CPU backend ignores it.
    pub device_id: Option<usize>,
}

/// What [`init_process_group`] accepts: full [`InitOptions`], a [`BackendKind`], or PyTorch's
/// backend string (`init_process_group("nccl")`, `"gloo"`), each with PyTorch's defaults for
/// the rest. An unknown backend string is an [`Error::InvalidArgument`].
pub trait IntoInitOptions {
    fn into_init_options(self) -> Result<InitOptions>;
}

impl IntoInitOptions for InitOptions {
    fn into_init_options(self) -> Result<InitOptions> {
        Ok(self)
    }
}

impl IntoInitOptions for BackendKind {
    fn into_init_options(self) -> Result<InitOptions> {
        Ok(InitOptions::new(self))
    }
}

impl IntoInitOptions for &str {
    fn into_init_options(self) -> Result<InitOptions> {
        Ok(InitOptions::new(self.parse()?))
    }
}

impl IntoInitOptions for String {
    fn into_init_options(self) -> Result<InitOptions> {
        self.as_str().into_init_options()
    }
}

impl InitOptions {
    pub fn new(backend: BackendKind) -> InitOptions {
        InitOptions {
            backend,
            init_method: "env://".into(),
            world_size: None,
            rank: None,
            timeout: DEFAULT_TIMEOUT,
            store: None,
            device_id: None,
        }
    }
    pub fn init_method(mut self, m: impl Into<String>) -> Self {
        self.init_method = m.into();
        self
    }
    pub fn world_size(mut self, n: usize) -> Self {
        self.world_size = Some(n);
        self
    }
    pub fn rank(mut self, r: usize) -> Self {
        self.rank = Some(r);
        self
    }
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn store(mut self, s: Arc<dyn Store>) -> Self {
        self.store = Some(s);
        self
    }
    pub fn device_id(mut self, cuda_index: usize) -> Self {
        self.device_id = Some(cuda_index);
        self
    }
}

/// A group of ranks and the backend that connects them (`ProcessGroup`). Cheap to clone.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<GroupInner>,
}

struct GroupInner {
    backend: Arc<dyn Backend>,
    kind: BackendKind,
    /// The global ranks of the members, sorted; a member's group rank is its index.
    ranks: Vec<usize>,
    store: Arc<dyn Store>,
    timeout: Duration,
    /// The address peers reach this process at.
    ip: IpAddr,
    /// Which world group on this store this one descends from (Note [Group key prefixes]).
    generation: i64,
    /// The CUDA device of an NCCL group's communicator (0 and unused for the CPU backend).
    device: usize,
    /// Groups created from this one so far (Note [Group creation is collective]).
    created: AtomicUsize,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup({}, rank {} of {}, ranks {:?})",
            self.inner.kind,
            self.rank(),
            self.size(),
            self.inner.ranks
        )
    }
}

impl ProcessGroup {
    /// A group of `world_size` ranks meeting through `store`, this process being `rank`
    /// (global ranks = group ranks). [`init_process_group`] makes one of these the default
    /// group; this constructor is for groups held by the caller (e.g. ranks as threads). The
    /// CPU backend listens on [`Store::local_ip`] (localhost when the store does not say). An
    /// NCCL group uses `cuda:{LOCAL_RANK}`, else `cuda:{rank % device_count}`; choose with
    /// [`ProcessGroup::on_device`].
    pub fn new(
        kind: BackendKind,
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(
                "ProcessGroup::new",
                format!("rank {rank} is not in a world of {world_size} process(es)"),
            ));
        }
        let device = match kind {
            BackendKind::Gloo => 0,
            BackendKind::Nccl => {
                let local = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok());
                crate::nccl::group_device(None, local, rank)?
            }
        };
        ProcessGroup::on_device(kind, store, rank, world_size, timeout, device)
    }

    /// [`ProcessGroup::new`] with the CUDA device an NCCL group uses (`cuda:{device}`; e.g.
    /// ranks as threads of one process, one GPU each). The CPU backend ignores it.
    pub fn on_device(
        kind: BackendKind,
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        device: usize,
    ) -> Result<ProcessGroup> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(
                "ProcessGroup::new",
                format!("rank {rank} is not in a world of {world_size} process(es)"),
            ));
        }
        let ip = store.local_ip().unwrap_or(IpAddr::from([127, 0, 0, 1]));
        ProcessGroup::with_ip(kind, store, rank, world_size, timeout, ip, device)
    }

    fn with_ip(
        kind: BackendKind,
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        ip: IpAddr,
        device: usize,
    ) -> Result<ProcessGroup> {
        // Note [Group key prefixes]: the k-th world group this rank creates on this store.
        let generation = store.add(&format!("generation/{rank}"), 1)?;
        let prefixed = PrefixStore::new(format!("g{generation}/pg0"), store.clone());
        let backend = kind.create(&prefixed, rank, world_size, timeout, ip, device)?;
        Ok(ProcessGroup {
            inner: Arc::new(GroupInner {
                backend,
                kind,
                ranks: (0..world_size).collect(),
                store,
                timeout,
                ip,
                generation,
                device,
                created: AtomicUsize::new(0),
            }),
        })
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.backend.rank()
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.backend.size()
    }

    /// The backend's kind.
    pub fn backend(&self) -> BackendKind {
        self.inner.kind
    }

    /// Where this group's tensors live: the CPU for the CPU backend, the communicator's GPU
    /// for NCCL (which takes tensors of that device only). Small tensors a caller exchanges
    /// for bookkeeping (DDP's bucket order, its used-parameter flags) are made here.
    pub fn device(&self) -> ember_core::Device {
        match self.inner.kind {
            BackendKind::Gloo => ember_core::Device::Cpu,
            BackendKind::Nccl => ember_core::Device::Cuda(self.inner.device),
        }
    }

    /// The global ranks of the members, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.inner.ranks
    }

    /// The group rank of global rank `global` (`get_group_rank`).
    pub fn group_rank(&self, global: usize) -> Result<usize> {
        self.inner.ranks.binary_search(&global).map_err(|_| {
            Error::invalid(
                "ProcessGroup",
                format!(
                    "global rank {global} is not in this group (ranks {:?})",
                    self.inner.ranks
                ),
            )
        })
    }

    /// The global rank of group rank `rank` (`get_global_rank`).
    pub fn global_rank(&self, rank: usize) -> Result<usize> {
        self.inner.ranks.get(rank).copied().ok_or_else(|| {
            Error::invalid(
                "ProcessGroup",
                format!(
                    "group rank {rank} is out of range for a group of {}",
                    self.inner.ranks.len()
                ),
            )
        })
    }

    /// A group of the given global `ranks` of this group (`new_group`); `None` on ranks that
    /// are not members. Collective over this group (Note [Group creation is collective]).
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.is_empty() {
            ranks = self.inner.ranks.clone();
        }
        if let Some(bad) = ranks.iter().find(|r| self.inner.ranks.binary_search(r).is_err()) {
            return Err(Error::invalid(
                "new_group",
                format!(
                    "rank {bad} is not in the parent group (ranks {:?})",
                    self.inner.ranks
                ),
            ));
        }
        let n = self.inner.created.fetch_add(1, Ordering::SeqCst) + 1;
        let me = self.inner.ranks[self.rank()];
        let Ok(rank) = ranks.binary_search(&me) else {
            return Ok(None);
        };
        let prefixed = PrefixStore::new(
            format!("g{}/pg{n}", self.inner.generation),
            self.inner.store.clone(),
        );
        let backend = self.inner.kind.create(
            &prefixed,
            rank,
            ranks.len(),
            self.inner.timeout,
            self.inner.ip,
            self.inner.device,
        )?;
        Ok(Some(ProcessGroup {
            inner: Arc::new(GroupInner {
                backend,
                kind: self.inner.kind,
                ranks,
                store: self.inner.store.clone(),
                timeout: self.inner.timeout,
                ip: self.inner.ip,
                generation: self.inner.generation,
                device: self.inner.device,
                created: AtomicUsize::new(0),
            }),
        }))
    }

    /// Closes the group's connections: pending and later operations fail, here and on the
    /// peers waiting for this rank.
    pub fn shutdown(&self) {
        self.inner.backend.shutdown();
    }

    fn check_op(&self, op: &'static str, t: &Tensor, reduce: Option<ReduceOp>) -> Result<()> {
        if reduce == Some(ReduceOp::Avg) && !t.dtype().is_floating_point() {
            return Err(Error::UnsupportedDType {
                op,
                dtype: t.dtype(),
                hint: "ReduceOp::Avg needs a floating-point tensor; use Sum and divide",
            });
        }
        Ok(())
    }

    /// A tensor the operation writes into must not have elements sharing memory (an expanded
    /// view): found before the operation starts, it is a plain argument error instead of a
    /// failure after the exchange that would break the group.
    fn check_writable(op: &'static str, t: &Tensor) -> Result<()> {
        let overlapping = t.numel() > 0 && t.dims().iter().zip(t.stride()).any(|(&d, &s)| d > 1 && s == 0);
        if overlapping {
            return Err(Error::invalid(
                op,
                "the output tensor is an expanded view (elements share memory); call contiguous() first",
            ));
        }
        Ok(())
    }

    fn check_same(op: &'static str, what: &Tensor, like: &Tensor) -> Result<()> {
        if what.dtype() != like.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                expected: like.dtype(),
                found: what.dtype(),
            });
        }
        if what.numel() != like.numel() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: like.shape().clone(),
                rhs: what.shape().clone(),
                hint: "every tensor of the list must have as many elements as the input",
            });
        }
        Ok(())
    }

    fn check_count(op: &'static str, n: usize, size: usize) -> Result<()> {
        if n != size {
            return Err(Error::invalid(
                op,
                format!("expected a list of {size} tensors (one per rank of the group), got {n}"),
            ));
        }
        Ok(())
    }

    /// Reduces `tensor` across the group in place (`all_reduce`).
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }

    /// [`ProcessGroup::all_reduce`], started (`async_op=True`).
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_op("all_reduce", tensor, Some(op))?;
        Self::check_writable("all_reduce", tensor)?;
        self.inner.backend.all_reduce(tensor, op)
    }

    /// Copies global rank `src`'s `tensor` into every member's `tensor` (`broadcast`).
    pub fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.broadcast_async(tensor, src)?.wait()
    }

    /// [`ProcessGroup::broadcast`], started.
    pub fn broadcast_async(&self, tensor: &Tensor, src: usize) -> Result<Work> {
        let root = self.group_rank(src)?;
        Self::check_writable("broadcast", tensor)?;
        self.inner.backend.broadcast(tensor, root)
    }

    /// Writes each member's `input` into `outputs[its group rank]` (`all_gather`).
    pub fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_async(outputs, input)?.wait()
    }

    /// [`ProcessGroup::all_gather`], started.
    pub fn all_gather_async(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        Self::check_count("all_gather", outputs.len(), self.size())?;
        for o in outputs {
            Self::check_same("all_gather", o, input)?;
            Self::check_writable("all_gather", o)?;
        }
        self.inner.backend.all_gather(outputs, input)
    }

    /// Writes into `output` the reduction over members of their `inputs[group rank of this
    /// rank]` (`reduce_scatter`).
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, inputs, op)?.wait()
    }

    /// [`ProcessGroup::reduce_scatter`], started.
    pub fn reduce_scatter_async(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        self.check_op("reduce_scatter", output, Some(op))?;
        Self::check_writable("reduce_scatter", output)?;
        Self::check_count("reduce_scatter", inputs.len(), self.size())?;
        for i in inputs {
            Self::check_same("reduce_scatter", i, output)?;
        }
        self.inner.backend.reduce_scatter(output, inputs, op)
    }

    /// Gathers every member's `input` into `output`, member `i`'s in the `i`-th of `size()`
    /// equal consecutive blocks (`all_gather_into_tensor`): `output` is the concatenation of
    /// the inputs along dim 0 (`[size·n, ...]` for inputs `[n, ...]`) or their stack
    /// (`[size, n, ...]`); only the element counts are checked, as PyTorch does. One flat
    /// collective, without the copies of the list form (FSDP's parameter all-gather).
    pub fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_into_tensor_async(output, input)?.wait()
    }

    /// [`ProcessGroup::all_gather_into_tensor`], started.
    pub fn all_gather_into_tensor_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.check_flat("all_gather_into_tensor", output, input, false)?;
        self.inner.backend.all_gather_into_tensor(output, input)
    }

    /// Reduces `input` across members under `op` and writes block `r` of the result (of
    /// `size()` equal consecutive blocks) into member `r`'s `output` (`reduce_scatter_tensor`):
    /// `input` is `[size·n, ...]` (or `[size, n, ...]`) for an `output` of `[n, ...]`; only
    /// the element counts are checked, as PyTorch does (FSDP's gradient reduce-scatter).
    pub fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_tensor_async(output, input, op)?.wait()
    }

    /// [`ProcessGroup::reduce_scatter_tensor`], started.
    pub fn reduce_scatter_tensor_async(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_op("reduce_scatter_tensor", output, Some(op))?;
        self.check_flat("reduce_scatter_tensor", input, output, true)?;
        self.inner.backend.reduce_scatter_tensor(output, input, op)
    }

    /// The checks of the flat collectives: `big` (the gathered output, or the input to
    /// reduce-scatter) holds `size()` times the elements of `small`, both of one dtype and
    /// device, both contiguous (which an expanded view is not).
    fn check_flat(&self, op: &'static str, big: &Tensor, small: &Tensor, scatter: bool) -> Result<()> {
        if big.dtype() != small.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                expected: small.dtype(),
                found: big.dtype(),
            });
        }
        if big.device() != small.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: small.device(),
                rhs: big.device(),
            });
        }
        let n = self.size();
        if big.numel() != n * small.numel() {
            let mut expected = small.dims().to_vec();
            match expected.first_mut() {
                Some(rows) => *rows *= n,
                None => expected.push(n),
            }
            return Err(Error::ShapeMismatch {
                op,
                lhs: ember_core::Shape::new(expected),
                rhs: big.shape().clone(),
                hint: if scatter {
                    "the input must hold world_size times the output's elements (the outputs of every rank concatenated along dim 0)"
                } else {
                    "the output must hold world_size times the input's elements (every rank's input concatenated along dim 0)"
                },
            });
        }
        if !big.is_contiguous() || !small.is_contiguous() {
            return Err(Error::invalid(
                op,
                "the flat collectives need contiguous tensors; call contiguous() first (and copy an output back)",
            ));
        }
        Ok(())
    }

    /// Returns when every member has reached it (`barrier`).
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    /// [`ProcessGroup::barrier`], started.
    pub fn barrier_async(&self) -> Result<Work> {
        self.inner.backend.barrier()
    }

    /// Sends `tensor` to global rank `dst` (`send`); it must call [`ProcessGroup::recv`].
    pub fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.isend(tensor, dst)?.wait()
    }

    /// [`ProcessGroup::send`], started (`isend`).
    pub fn isend(&self, tensor: &Tensor, dst: usize) -> Result<Work> {
        let peer = self.p2p_peer("send", dst)?;
        self.inner.backend.send(tensor, peer, 0)
    }

    /// Receives into `tensor` the next tensor global rank `src` sends to this rank (`recv`;
    /// messages between two ranks arrive in the order they were sent; unlike PyTorch, `src` is
    /// required).
    pub fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.irecv(tensor, src)?.wait()
    }

    /// [`ProcessGroup::recv`], started (`irecv`).
    pub fn irecv(&self, tensor: &Tensor, src: usize) -> Result<Work> {
        let peer = self.p2p_peer("recv", src)?;
        Self::check_writable("recv", tensor)?;
        self.inner.backend.recv(tensor, peer, 0)
    }

    fn p2p_peer(&self, op: &'static str, global: usize) -> Result<usize> {
        let peer = self.group_rank(global)?;
        if peer == self.rank() {
            return Err(Error::invalid(
                op,
                format!("rank {global} cannot {op} to or from itself"),
            ));
        }
        Ok(peer)
    }
}

/// The default group (`torch.distributed`'s `_default_pg`).
static DEFAULT: Mutex<Option<ProcessGroup>> = Mutex::new(None);

fn default_slot() -> std::sync::MutexGuard<'static, Option<ProcessGroup>> {
    DEFAULT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Initializes the default group (`torch.distributed.init_process_group`): finds the rank,
/// world size and master (see [`crate::rendezvous`]), starts the store server on rank 0 (at
/// `MASTER_PORT` on all interfaces) unless the launcher runs it (`ember-run`, torchrun:
/// `TORCHELASTIC_USE_AGENT_STORE=True`), connects to it, and connects the ranks.
///
/// ```no_run
/// use ember_distributed as dist;
/// # fn main() -> ember_core::Result<()> {
/// // Under `ember-run --nproc-per-node 2 prog`: RANK, WORLD_SIZE, MASTER_* come from it.
/// dist::init_process_group(dist::InitOptions::new(dist::BackendKind::Gloo))?;
/// let t = ember_core::Tensor::from_vec(vec![dist::get_rank()? as f32], 1, ember_core::Device::Cpu)?;
/// dist::all_reduce(&t, dist::ReduceOp::Sum)?; // 0 + 1 on every rank
/// dist::destroy_process_group();
/// # Ok(())
/// # }
/// ```
pub fn init_process_group(options: impl IntoInitOptions) -> Result<()> {
    let env = |k: &str| std::env::var(k).ok();
    init_process_group_with_env(options, &env)
}

/// `(world size, rank)` of the default group, for `DistributedSampler::new` (Note [Sampler and
/// the default group] in ember-data).
fn default_replicas() -> Option<(usize, usize)> {
    default_slot().as_ref().map(|g| (g.size(), g.rank()))
}

/// [`init_process_group`] reading variables through `env` instead of the process environment.
pub fn init_process_group_with_env(
    options: impl IntoInitOptions,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    let options = options.into_init_options()?;
    let already = || {
        Error::invalid(
            "init_process_group",
            "the default process group is already initialized; call destroy_process_group first",
        )
    };
    // The rendezvous runs without holding the default group's lock, so that get_rank and
    // friends on other threads answer at once meanwhile.
    if is_initialized() {
        return Err(already());
    }
    let (store, rank, world_size, ip, local_rank): (Arc<dyn Store>, usize, usize, IpAddr, Option<usize>) =
        match options.store {
            Some(store) => {
                let (Some(rank), Some(ws)) = (options.rank, options.world_size) else {
                    return Err(Error::invalid(
                        "init_process_group",
                        "with a store, pass rank and world_size too",
                    ));
                };
                let ip = store.local_ip().unwrap_or(IpAddr::from([127, 0, 0, 1]));
                let local = env("LOCAL_RANK").and_then(|v| v.parse().ok());
                (store, rank, ws, ip, local)
            }
            None => {
                let rv = rendezvous::resolve(&options.init_method, options.rank, options.world_size, env)?;
                let is_master = rv.rank == 0 && !rv.agent_store;
                let store = TcpStore::new(&rv.master_addr, rv.master_port, is_master, options.timeout)?;
                let ip = store.local_ip().unwrap_or(IpAddr::from([127, 0, 0, 1]));
                (Arc::new(store), rv.rank, rv.world_size, ip, rv.local_rank)
            }
        };
    if world_size == 0 || rank >= world_size {
        return Err(Error::invalid(
            "init_process_group",
            format!("rank {rank} is not in a world of {world_size} process(es)"),
        ));
    }
    let device = match options.backend {
        BackendKind::Gloo => 0,
        BackendKind::Nccl => crate::nccl::group_device(options.device_id, local_rank, rank)?,
    };
    let group = ProcessGroup::with_ip(
        options.backend,
        store,
        rank,
        world_size,
        options.timeout,
        ip,
        device,
    )?;
    let mut slot = default_slot();
    if slot.is_some() {
        group.shutdown();
        return Err(already());
    }
    *slot = Some(group);
    ember_data::sampler::register_default_group(default_replicas);
    Ok(())
}

/// Shuts the default group down and forgets it (`destroy_process_group`); a no-op when none.
pub fn destroy_process_group() {
    if let Some(g) = default_slot().take() {
        g.shutdown();
    }
}

/// Whether the default group is initialized (`is_initialized`).
pub fn is_initialized() -> bool {
    default_slot().is_some()
}

/// The default group (`group.WORLD`), or an error saying to initialize it.
pub fn default_group() -> Result<ProcessGroup> {
    default_slot().clone().ok_or_else(|| {
        Error::invalid(
            "torch.distributed",
            "the default process group is not initialized; call init_process_group first",
        )
    })
}

/// This process's rank in the default group (`get_rank`).
pub fn get_rank() -> Result<usize> {
    Ok(default_group()?.rank())
}

/// The number of ranks in the default group (`get_world_size`).
pub fn get_world_size() -> Result<usize> {
    Ok(default_group()?.size())
}

/// A group of the given global ranks (empty: all) (`new_group`); `None` on non-members.
/// Every rank must call it (Note [Group creation is collective]).
pub fn new_group(ranks: &[usize]) -> Result<Option<ProcessGroup>> {
    default_group()?.new_group(ranks)
}

/// [`ProcessGroup::all_reduce`] on the default group.
pub fn all_reduce(tensor: &Tensor, op: ReduceOp) -> Result<()> {
    default_group()?.all_reduce(tensor, op)
}
/// [`ProcessGroup::all_reduce_async`] on the default group.
pub fn all_reduce_async(tensor: &Tensor, op: ReduceOp) -> Result<Work> {
    default_group()?.all_reduce_async(tensor, op)
}
/// [`ProcessGroup::broadcast`] on the default group.
pub fn broadcast(tensor: &Tensor, src: usize) -> Result<()> {
    default_group()?.broadcast(tensor, src)
}
/// [`ProcessGroup::broadcast_async`] on the default group.
pub fn broadcast_async(tensor: &Tensor, src: usize) -> Result<Work> {
    default_group()?.broadcast_async(tensor, src)
}
/// [`ProcessGroup::all_gather`] on the default group.
pub fn all_gather(outputs: &[Tensor], input: &Tensor) -> Result<()> {
    default_group()?.all_gather(outputs, input)
}
/// [`ProcessGroup::all_gather_async`] on the default group.
pub fn all_gather_async(outputs: &[Tensor], input: &Tensor) -> Result<Work> {
    default_group()?.all_gather_async(outputs, input)
}
/// [`ProcessGroup::reduce_scatter`] on the default group.
pub fn reduce_scatter(output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
    default_group()?.reduce_scatter(output, inputs, op)
}
/// [`ProcessGroup::reduce_scatter_async`] on the default group.
pub fn reduce_scatter_async(output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
    default_group()?.reduce_scatter_async(output, inputs, op)
}
/// [`ProcessGroup::all_gather_into_tensor`] on the default group.
pub fn all_gather_into_tensor(output: &Tensor, input: &Tensor) -> Result<()> {
    default_group()?.all_gather_into_tensor(output, input)
}
/// [`ProcessGroup::all_gather_into_tensor_async`] on the default group.
pub fn all_gather_into_tensor_async(output: &Tensor, input: &Tensor) -> Result<Work> {
    default_group()?.all_gather_into_tensor_async(output, input)
}
/// [`ProcessGroup::reduce_scatter_tensor`] on the default group.
pub fn reduce_scatter_tensor(output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
    default_group()?.reduce_scatter_tensor(output, input, op)
}
/// [`ProcessGroup::reduce_scatter_tensor_async`] on the default group.
pub fn reduce_scatter_tensor_async(output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
    default_group()?.reduce_scatter_tensor_async(output, input, op)
}
/// [`ProcessGroup::barrier`] on the default group.
pub fn barrier() -> Result<()> {
    default_group()?.barrier()
}
/// [`ProcessGroup::barrier_async`] on the default group.
pub fn barrier_async() -> Result<Work> {
    default_group()?.barrier_async()
}
/// [`ProcessGroup::send`] on the default group.
pub fn send(tensor: &Tensor, dst: usize) -> Result<()> {
    default_group()?.send(tensor, dst)
}
/// [`ProcessGroup::isend`] on the default group.
pub fn isend(tensor: &Tensor, dst: usize) -> Result<Work> {
    default_group()?.isend(tensor, dst)
}
/// [`ProcessGroup::recv`] on the default group.
pub fn recv(tensor: &Tensor, src: usize) -> Result<()> {
    default_group()?.recv(tensor, src)
}
/// [`ProcessGroup::irecv`] on the default group.
pub fn irecv(tensor: &Tensor, src: usize) -> Result<Work> {
    default_group()?.irecv(tensor, src)
}
