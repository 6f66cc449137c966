//! ember-distributed: process groups, the rendezvous store, the `ember-run` launcher
//! (`torch.distributed`) and `DistributedDataParallel` (`torch.nn.parallel`). It builds on
//! `ember-core`, and on `ember-nn` for the modules DDP wraps.
//!
//! - [`store`]: the key-value store ranks meet through ([`TcpStore`], [`PrefixStore`]).
//! - [`rendezvous`]: rank, world size and master from `env://`, `tcp://`, SLURM or Open MPI.
//! - [`backend`]: the [`Backend`] trait a library implements to move bytes, [`ReduceOp`],
//!   and the [`Work`] handle of an asynchronous operation.
//! - [`cpu_backend`]: ember's CPU backend over TCP ("gloo").
//! - [`nccl`]: the NCCL backend for CUDA tensors, NCCL loaded at run time.
//! - [`group`]: [`ProcessGroup`] and the default group's functions ([`init_process_group`],
//!   [`all_reduce`], [`new_group`], ...), re-exported here as in `torch.distributed`.
//! - [`launch`]: the launcher behind the `ember-run` program (torchrun's flags).
//! - [`ddp`]: [`DistributedDataParallel`], gradient averaging overlapped with backward, and its
//!   communication hooks ([`GradBucket`], [`CommFuture`], [`default_hooks`]).
//! - [`mesh`] and [`dtensor`]: [`DeviceMesh`] and the sharded tensor [`DTensor`]
//!   (`torch.distributed.tensor`: [`distribute_tensor`], `from_local`, `full_tensor`).
//! - [`checkpoint`] (also [`dcp`]): distributed checkpoints, one safetensors file per rank plus
//!   metadata, resharded on load (`torch.distributed.checkpoint`).
//! - [`fsdp`]: [`fully_shard`] and [`FSDPModule`], parameters sharded along dim 0, gathered
//!   for forward and backward, gradients reduce-scattered (`torch.distributed.fsdp`, FSDP2).
//! - [`optim`]: [`ZeroRedundancyOptimizer`], optimizer state sharded across ranks
//!   (`torch.distributed.optim`).
//!
//! Every blocking call is bounded by a timeout and reports failures as [`ember_core::Error`]:
//! a timeout is [`ember_core::Error::Io`] of kind `TimedOut`, a peer that died is kind
//! `UnexpectedEof`, `ConnectionReset` or `BrokenPipe`, bad arguments are `InvalidArgument`.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use ember_core::{Device, Tensor};
//! use ember_distributed::{BackendKind, ProcessGroup, ReduceOp, Store, TcpStore};
//! # fn main() -> ember_core::Result<()> {
//! // Two ranks as threads of one process (normally: processes started by ember-run).
//! let master = TcpStore::new("127.0.0.1", 0, true, Duration::from_secs(10))?;
//! let port = master.port();
//! let master: Arc<dyn Store> = Arc::new(master);
//! let other = std::thread::spawn(move || -> ember_core::Result<Vec<f32>> {
//!     let store: Arc<dyn Store> = Arc::new(TcpStore::new("127.0.0.1", port, false, Duration::from_secs(10))?);
//!     let pg = ProcessGroup::new(BackendKind::Gloo, store, 1, 2, Duration::from_secs(10))?;
//!     let t = Tensor::from_vec(vec![10.0f32, 20.0], 2, Device::Cpu)?;
//!     pg.all_reduce(&t, ReduceOp::Sum)?;
//!     t.to_vec::<f32>()
//! });
//! let pg = ProcessGroup::new(BackendKind::Gloo, master, 0, 2, Duration::from_secs(10))?;
//! let t = Tensor::from_vec(vec![1.0f32, 2.0], 2, Device::Cpu)?;
//! pg.all_reduce(&t, ReduceOp::Sum)?;
//! assert_eq!(t.to_vec::<f32>()?, [11.0, 22.0]);
//! assert_eq!(other.join().unwrap()?, [11.0, 22.0]);
//! # Ok(())
//! # }
//! ```
// Unsafe code lives only in the NCCL backend's FFI edge (`nccl/library.rs`, `nccl/comm.rs`
// and the calls in `nccl/mod.rs`), each use allowed where it is.
#![deny(unsafe_code)]

pub mod backend;
mod buffer;
pub mod checkpoint;
pub mod cpu_backend;
pub mod ddp;
pub mod dtensor;
pub mod fsdp;
pub mod group;
pub mod launch;
pub mod mesh;
pub mod nccl;
pub mod optim;
pub mod rendezvous;
pub mod store;
mod wire;

pub use backend::{Backend, ReduceOp, Work, WorkHandle};
/// `torch.distributed.checkpoint as dcp`: [`dcp::save`], [`dcp::load`].
pub use checkpoint as dcp;
pub use cpu_backend::CpuBackend;
pub use ddp::{
    default_hooks, BuiltinCommHookType, CommFuture, DdpOptions, DistributedDataParallel, ForwardOutput,
    GradBucket, NoSyncGuard,
};
pub use dtensor::{distribute_tensor, distribute_tensor_from, DTensor, Placement};
pub use fsdp::{
    fully_shard, get_model_state_dict, get_optimizer_state_dict, FSDPModule, FullyShardOptions,
    MixedPrecisionPolicy, ShardedGradScaler,
};
pub use group::{
    all_gather, all_gather_async, all_gather_into_tensor, all_gather_into_tensor_async, all_reduce,
    all_reduce_async, barrier, barrier_async, broadcast, broadcast_async, default_group,
    destroy_process_group, get_rank, get_world_size, init_process_group, init_process_group_with_env, irecv,
    is_initialized, isend, new_group, recv, reduce_scatter, reduce_scatter_async, reduce_scatter_tensor,
    reduce_scatter_tensor_async, send, BackendKind, InitOptions, IntoInitOptions, ProcessGroup,
};
pub use mesh::{init_device_mesh, DeviceMesh};
pub use nccl::NcclBackend;
pub use optim::ZeroRedundancyOptimizer;
pub use store::{PrefixStore, Store, TcpStore};
