//! `ember train --nproc-per-node N`: data-parallel training in N processes on one machine, as
//! `torchrun --nproc-per-node N train.py` runs PyTorch's DDP tutorial. Without RANK in the
//! environment the command is the launcher: it starts N copies of itself through ember-run's
//! machinery (each with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; their output
//! passes through unchanged, as under torchrun; when one fails the others are stopped and the command fails). A worker
//! (WORLD_SIZE > 1 in its environment, also when started by ember-run, torchrun-style
//! launchers or srun) joins the process group (NCCL on GPUs, each worker on `cuda:LOCAL_RANK`;
//! the CPU backend otherwise), wraps the model in DistributedDataParallel, and reads its share
//! of every epoch through a DistributedSampler; `--batch-size` is per process, as in PyTorch.
//! Rank 0 alone prints, profiles and writes checkpoints; the reported loss and sample counts
//! are summed over the ranks.

use super::CliResult;
use ember::distributed::launch::{self, LaunchConfig, LaunchOutcome};
use ember::distributed::{self, BackendKind, InitOptions, ReduceOp};
use ember::{DType, Device, Tensor};

/// This worker's place in the job.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dist {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
}

fn env_usize(name: &str) -> CliResult<Option<usize>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("{name}={v:?} in the environment is not a non-negative integer").into()),
    }
}

/// The worker's place from the launcher's variables; None for a single process.
pub(super) fn from_env() -> CliResult<Option<Dist>> {
    let Some(world) = env_usize("WORLD_SIZE")?.filter(|&w| w > 1) else {
        return Ok(None);
    };
    let rank = env_usize("RANK")?.ok_or("WORLD_SIZE is set but RANK is not: start the workers with `ember train --nproc-per-node N` or ember-run")?;
    if rank >= world {
        return Err(format!("RANK={rank} is not below WORLD_SIZE={world}").into());
    }
    let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(rank);
    Ok(Some(Dist {
        rank,
        world,
        local_rank,
    }))
}

/// This command's arguments without `--nproc-per-node N` (or `--nproc-per-node=N`).
fn worker_args() -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--nproc-per-node" {
            args.next();
        } else if !a.starts_with("--nproc-per-node=") {
            out.push(a);
        }
    }
    out
}

/// The launcher: runs this command in `nproc` worker processes and waits for them.
pub(super) fn launch(nproc: usize) -> CliResult<()> {
    let program = std::env::current_exe()
        .map_err(|e| format!("--nproc-per-node: cannot find this program to start its workers: {e}"))?;
    let cfg = LaunchConfig {
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        standalone: true,
        tee: launch::Std::None,
        redirects: launch::Std::None,
        log_dir: None,
        program: program.display().to_string(),
        args: worker_args(),
    };
    match launch::run(&cfg)? {
        LaunchOutcome::Succeeded => Ok(()),
        LaunchOutcome::Failed { rank, status } => {
            Err(format!("worker rank {rank} failed ({status}); the other workers were stopped").into())
        }
    }
}

impl Dist {
    /// Joins the default process group: NCCL for a job on GPUs, the CPU backend otherwise.
    pub(super) fn init(&self, device: Device) -> CliResult<()> {
        let backend = if device.is_cuda() {
            BackendKind::Nccl
        } else {
            BackendKind::Gloo
        };
        distributed::init_process_group(InitOptions::new(backend).world_size(self.world).rank(self.rank))?;
        Ok(())
    }

    /// `values` summed over the ranks (on `device`, as the backend needs).
    pub(super) fn sum(&self, values: &[f64], device: Device) -> CliResult<Vec<f64>> {
        let t = Tensor::from_slice(values, [values.len()], Device::Cpu)?
            .to_dtype(DType::F64)?
            .to(device)?;
        distributed::all_reduce(&t, ReduceOp::Sum)?;
        Ok(t.to_vec_f64()?)
    }
}
