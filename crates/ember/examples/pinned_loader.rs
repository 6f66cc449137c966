//! Pinned host memory and non-blocking copies, as PyTorch's
//! `DataLoader(ds, pin_memory=True, num_workers=2)` with `x.to(device, non_blocking=True)`:
//! the loader's workers collate each batch into page-locked memory, from which the copy to
//! the GPU is queued on the stream and the host goes on at once. The example trains a linear
//! regression from such a loader, then times a copy from pageable and from pinned memory.
//!
//! Without a GPU there is nothing to pin: the loader warns once (on stderr) and continues with
//! pageable batches, `to_non_blocking` is an ordinary copy, and the same program trains on the
//! CPU.
//!
//! Run: `cargo run --release -p ember --example pinned_loader`

use ember::cuda;
use ember::data::{DataLoader, TensorDataset};
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Linear, MSELoss};
use ember::prelude::*;
use std::time::Instant;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let x = Tensor::randn([4096, 64], DType::F32, Device::Cpu)?;
    let y = x.matmul(&Tensor::randn([64, 1], DType::F32, Device::Cpu)?)?;
    let loader = DataLoader::builder(TensorDataset::new(vec![x, y])?)
        .batch_size(256)
        .shuffle(true)
        .num_workers(2)
        .pin_memory(true)
        .build()?;
    println!("training on {device}; the loader pins its batches: {}", loader.pin_memory());

    let model = Linear::new(64, 1, device)?;
    let mut opt = SGD::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    let loss_fn = MSELoss::new();
    let mut losses = Vec::new();
    for epoch in 1..=3 {
        let mut epoch_loss = 0.0;
        for batch in &loader {
            let batch = batch?;
            if batch[0].is_pinned() != loader.pin_memory() {
                return Err("a batch is not in the memory the loader promised".into());
            }
            // Queued on the current stream from pinned memory; the host does not wait.
            let (x, y) = (batch[0].to_non_blocking(device)?, batch[1].to_non_blocking(device)?);
            let loss = loss_fn.forward(&model.forward(&x)?, &y)?;
            opt.zero_grad()?;
            loss.backward()?;
            opt.step()?;
            epoch_loss += loss.item_f64()? / loader.len() as f64;
        }
        println!("epoch {epoch}: mean squared error {epoch_loss:.5}");
        losses.push(epoch_loss);
    }
    if !(losses[2] < 0.01 * losses[0]) {
        return Err(format!("the loss did not fall: {losses:?}").into());
    }

    if device.is_cuda() {
        // 64 MiB from pageable memory (staged by the driver) and from pinned memory.
        let host = Tensor::randn([16 << 20], DType::F32, Device::Cpu)?;
        let pinned = host.pin_memory()?;
        let gib = 64.0 / 1024.0;
        for (name, source) in [("pageable", &host), ("pinned", &pinned)] {
            source.to_non_blocking(device)?; // warm-up: the allocator's first blocks
            cuda::synchronize()?;
            let t = Instant::now();
            let _on_device = source.to_non_blocking(device)?;
            let queued = t.elapsed().as_secs_f64();
            cuda::synchronize()?;
            let done = t.elapsed().as_secs_f64();
            println!(
                "{name:>8}: the host went on after {:.3} ms, the copy was done after {:.3} ms ({:.1} GiB/s)",
                queued * 1e3,
                done * 1e3,
                gib / done
            );
        }
    }
    Ok(())
}
