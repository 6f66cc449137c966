//! DistributedDataParallel, as in PyTorch's DDP tutorials ("Getting Started with Distributed
//! Data Parallel" and the torchrun-based multi-GPU training series): `init_process_group`
//! from the environment the launcher sets, a `ToyModel` wrapped in `DistributedDataParallel`,
//! a `DistributedSampler` giving each rank its share of the data (reshuffled per epoch with
//! `set_epoch`), and a few epochs of SGD. Gradients are averaged across ranks during backward,
//! so every replica takes the same step; the example checks that the replicas end equal.
//!
//! Run on 2 processes: `cargo build -p ember --example ddp_training -p ember-distributed --bin
//! ember-run`, then `target/debug/ember-run --standalone --nproc-per-node 2
//! target/debug/examples/ddp_training` (ember-run sets RANK, WORLD_SIZE, MASTER_ADDR, ...).
//! Run directly (`cargo run -p ember --example ddp_training`), without RANK and WORLD_SIZE in
//! the environment, it trains as a world of one process.
//!
//! The process group uses ember's CPU backend ("gloo"); with a GPU each rank trains on
//! `cuda:LOCAL_RANK` and the backend reduces through host copies.

use std::sync::Arc;
use std::time::Duration;

use ember::cuda;
use ember::data::{DataLoader, DistributedSampler, TensorDataset};
use ember::distributed::{
    self as dist, BackendKind, DdpOptions, DistributedDataParallel, InitOptions, TcpStore,
};
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Linear, MSELoss, ReLU, Sequential};
use ember::prelude::*;

const SAMPLES: usize = 512;
const BATCH_SIZE: usize = 32;
const EPOCHS: u64 = 3;

/// `ToyModel` of the tutorial: net1 = Linear(10, 10), relu, net2 = Linear(10, 5).
fn toy_model() -> ember::Result<Sequential> {
    Ok(Sequential::new().with(Linear::new(10, 10, Device::Cpu)?).with(ReLU::new()).with(Linear::new(
        10,
        5,
        Device::Cpu,
    )?))
}

/// `init_process_group` from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by
/// `ember-run`, as by torchrun); run directly, a world of one process with a store of its own.
fn init() -> ember::Result<()> {
    let timeout = Duration::from_secs(60);
    let mut options = InitOptions::new(BackendKind::Gloo).timeout(timeout);
    if std::env::var_os("RANK").is_none() {
        let store = TcpStore::new("127.0.0.1", 0, true, timeout)?;
        options = options.store(Arc::new(store)).rank(0).world_size(1);
    }
    dist::init_process_group(options)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    init()?;
    let (rank, world_size) = (dist::get_rank()?, dist::get_world_size()?);
    let local_rank: usize = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let device =
        if cuda::is_available() { Device::Cuda(local_rank % cuda::device_count()) } else { Device::Cpu };
    println!("Start running basic DDP example on rank {rank} of {world_size} ({device}).");

    // The same synthetic regression data on every rank (same seed): y = x W + b + noise.
    ember::manual_seed(0)?;
    let x = Tensor::randn([SAMPLES, 10], DType::F32, Device::Cpu)?;
    let w = Tensor::randn([10, 5], DType::F32, Device::Cpu)?;
    let noise = Tensor::randn([SAMPLES, 5], DType::F32, Device::Cpu)?.mul_scalar(0.01)?;
    let y = x.matmul(&w)?.add_scalar(0.5)?.add(&noise)?;
    let dataset = TensorDataset::new(vec![x, y])?;
    // World size and rank from the default group, as PyTorch's DistributedSampler(dataset).
    let sampler = Arc::new(DistributedSampler::new(&dataset)?.seed(0));
    let loader = DataLoader::builder(dataset).batch_size(BATCH_SIZE).sampler(sampler.clone()).build()?;

    // Each rank builds its model (here from its own seed): DDP broadcasts rank 0's parameters.
    ember::manual_seed(rank as u64)?;
    let mut model = toy_model()?;
    model.to_device(device)?;
    let ddp_model = DistributedDataParallel::new(model, DdpOptions::new())?;
    let loss_fn = MSELoss::new();
    let mut optimizer = SGD::new(ddp_model.parameters(), SgdConfig { lr: 0.05, ..Default::default() })?;

    let mut first_loss = None;
    let mut last_loss = 0.0;
    for epoch in 0..EPOCHS {
        sampler.set_epoch(epoch); // a new shuffle each epoch, the same on every rank
        let (mut sum, mut batches) = (0.0, 0);
        for batch in loader.iter() {
            let batch = batch?;
            let (inputs, labels) = (batch[0].to(device)?, batch[1].to(device)?);
            optimizer.zero_grad()?;
            let outputs = ddp_model.forward(&inputs)?;
            let loss = loss_fn.forward(&outputs, &labels)?;
            loss.backward()?; // gradients averaged across ranks here
            optimizer.step()?;
            sum += loss.item_f64()?;
            batches += 1;
        }
        last_loss = sum / batches as f64;
        first_loss.get_or_insert(last_loss);
        if rank == 0 {
            println!("epoch {epoch}: {batches} batches of {BATCH_SIZE} per rank, mean loss {last_loss:.4}");
        }
    }

    // The replicas took the same steps: rank 0's parameters equal everyone's.
    let mut largest_difference = 0.0f64;
    for p in ddp_model.parameters() {
        let theirs = p.to(Device::Cpu)?.deep_clone()?;
        dist::broadcast(&theirs, 0)?;
        let diff = theirs.sub(&p.to(Device::Cpu)?)?.abs()?.max_all()?.item_f64()?;
        largest_difference = largest_difference.max(diff);
    }
    println!("rank {rank}: largest difference from rank 0's parameters: {largest_difference:.1e}");
    dist::destroy_process_group();
    if largest_difference > 0.0 {
        return Err(format!("rank {rank}: the replicas diverged").into());
    }
    if last_loss >= first_loss.unwrap_or(f64::INFINITY) {
        return Err(format!("rank {rank}: the loss did not fall ({first_loss:?} -> {last_loss})").into());
    }
    println!("Finished running basic DDP example on rank {rank}.");
    Ok(())
}
