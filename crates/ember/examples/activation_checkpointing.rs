//! Activation checkpointing, as `torch.utils.checkpoint.checkpoint(block, h)`: each block of a
//! model runs without keeping its activations, and backward runs it again to get them back.
//! The gradients equal those of the ordinary run, dropout included (the checkpoint restores
//! the random state for the recomputation); what changes is the memory, which on a GPU the
//! example prints for both runs.
//!
//! Run: `cargo run --release -p ember --example activation_checkpointing`

use ember::cuda;
use ember::nn::{CrossEntropyLoss, Dropout, Linear};
use ember::prelude::*;
use ember::utils::checkpoint::checkpoint;

/// `fc2(dropout(relu(fc1(x)))) + x`: one residual block.
#[derive(Module, Clone)]
struct Block {
    fc1: Linear,
    dropout: Dropout,
    fc2: Linear,
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        &self.fc2.forward(&self.dropout.forward(&self.fc1.forward(x)?.relu()?)?)? + x
    }
}

#[derive(Module)]
struct Model {
    blocks: Vec<Block>,
    head: Linear,
}

impl Model {
    fn new(width: usize, depth: usize, classes: usize, device: Device) -> Result<Model> {
        let block = || -> Result<Block> {
            Ok(Block {
                fc1: Linear::new(width, 4 * width, device)?,
                dropout: Dropout::new(0.1)?,
                fc2: Linear::new(4 * width, width, device)?,
            })
        };
        Ok(Model {
            blocks: (0..depth).map(|_| block()).collect::<Result<_>>()?,
            head: Linear::new(width, classes, device)?,
        })
    }

    fn forward(&self, x: &Tensor, checkpointed: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for block in &self.blocks {
            h = if checkpointed { checkpoint(block, &h)? } else { block.forward(&h)? };
        }
        self.head.forward(&h)
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let model = Model::new(128, 4, 10, device)?;
    let x = Tensor::randn([64, 128], DType::F32, device)?;
    let y = Tensor::randint(0, 10, [64], device)?;
    let loss_fn = CrossEntropyLoss::new();

    // The gradients of one step, with and without checkpoints, from the same random state, and
    // the step's peak memory on a GPU.
    let gradients = |checkpointed: bool| -> Result<(Vec<Tensor>, usize)> {
        model.zero_grad()?;
        ember::manual_seed(1)?; // the same dropout masks for both runs
        if device.is_cuda() {
            cuda::synchronize()?;
            cuda::reset_peak_memory_stats();
        }
        let before = cuda::memory_allocated();
        loss_fn.forward(&model.forward(&x, checkpointed)?, &y)?.backward()?;
        let peak = cuda::max_memory_allocated() - before;
        if device.is_cuda() {
            println!(
                "checkpointed {checkpointed:5}: peak memory of the step {:.1} MiB",
                peak as f64 / 1048576.0
            );
        }
        Ok((
            model.parameters().iter().map(|p| p.grad().expect("a parameter without gradient")).collect(),
            peak,
        ))
    };
    let (plain, plain_peak) = gradients(false)?;
    let (checkpointed, checkpointed_peak) = gradients(true)?;
    if device.is_cuda() && checkpointed_peak >= plain_peak {
        return Err("checkpoints did not lower the peak memory".into());
    }
    let mut worst = 0.0f64;
    for (a, b) in plain.iter().zip(&checkpointed) {
        worst = worst.max((a - b)?.abs()?.max_all()?.item_f64()?);
    }
    println!("{} gradients; largest difference with checkpoints: {worst:.1e}", plain.len());
    if worst > 1e-6 {
        return Err(format!("checkpointed gradients differ from the plain ones by {worst:e}").into());
    }
    Ok(())
}
