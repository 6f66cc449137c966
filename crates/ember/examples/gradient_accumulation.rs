//! Gradient accumulation, as in PyTorch's tutorials: train with an effective batch of 256 from
//! micro-batches of 64 by scaling each micro-batch's loss by 1/4 and stepping the optimizer
//! every 4 micro-batches. The accumulated gradient equals the gradient of one 256-sample batch;
//! the example checks that before training.
//!
//! Run: `cargo run --release -p ember --example gradient_accumulation`

use ember::cuda;
use ember::data::datasets::FashionMnist;
use ember::data::DataLoader;
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{CrossEntropyLoss, Flatten, Linear, ReLU, Sequential};
use ember::prelude::*;

const IMAGES: &[u8] = include_bytes!("../data/fashion-mnist/t10k-images-idx3-ubyte.gz");
const LABELS: &[u8] = include_bytes!("../data/fashion-mnist/t10k-labels-idx1-ubyte.gz");
const MICRO_BATCH: usize = 64;
const ACCUMULATE: usize = 4;

fn loss_of(model: &Sequential, x: &Tensor, y: &Tensor) -> ember::Result<Tensor> {
    CrossEntropyLoss::new().forward(&model.forward(x)?, y)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let data = FashionMnist::from_idx_bytes(IMAGES, LABELS)?;
    let mut model = Sequential::new()
        .with(Flatten::new())
        .with(Linear::new(784, 64, Device::Cpu)?)
        .with(ReLU::new())
        .with(Linear::new(64, 10, Device::Cpu)?);
    model.to_device(device)?;

    // The accumulated gradient of 4 scaled micro-batches is the gradient of the whole batch.
    let x = data.images().narrow(0, 0, MICRO_BATCH * ACCUMULATE)?.to(device)?;
    let y = data.labels().narrow(0, 0, MICRO_BATCH * ACCUMULATE)?.to(device)?;
    loss_of(&model, &x, &y)?.backward()?;
    let full: Vec<Tensor> = model.parameters().iter().map(|p| p.grad().expect("grad")).collect();
    model.zero_grad()?;
    for i in 0..ACCUMULATE {
        let (xi, yi) =
            (x.narrow(0, i * MICRO_BATCH, MICRO_BATCH)?, y.narrow(0, i * MICRO_BATCH, MICRO_BATCH)?);
        loss_of(&model, &xi, &yi)?.div_scalar(ACCUMULATE as f64)?.backward()?;
    }
    let mut worst = 0.0f64;
    for (p, g) in model.parameters().iter().zip(&full) {
        let diff = p.grad().expect("grad").sub(g)?.abs()?.max_all()?.item_f64()?;
        worst = worst.max(diff);
    }
    println!("largest difference between accumulated and full-batch gradients: {worst:.2e}");
    if worst > 1e-5 {
        return Err("the accumulated gradients differ from the full batch's".into());
    }
    model.zero_grad()?;

    let mut opt = SGD::new(model.parameters(), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
    let loader = DataLoader::builder(data.to_tensor_dataset())
        .batch_size(MICRO_BATCH)
        .shuffle(true)
        .pin_memory(device.is_cuda())
        .build()?;
    let (mut steps, mut loss_sum) = (0, 0.0);
    for (i, batch) in loader.unpacked().enumerate() {
        let [x, y] = batch?;
        let (x, y) = (x.to_non_blocking(device)?, y.to_non_blocking(device)?);
        let loss = loss_of(&model, &x, &y)?;
        loss.div_scalar(ACCUMULATE as f64)?.backward()?;
        loss_sum += loss.item_f64()?;
        if (i + 1) % ACCUMULATE == 0 {
            opt.step()?;
            opt.zero_grad()?;
            steps += 1;
            if steps % 10 == 0 {
                println!("step {steps}: mean micro-batch loss {:.4}", loss_sum / ACCUMULATE as f64);
            }
            loss_sum = 0.0;
        }
    }
    let acc = model
        .forward(&data.images().to(device)?)?
        .argmax(Some(1), false)?
        .eq(&data.labels().to(device)?)?
        .to_dtype(DType::F64)?
        .mean_all()?
        .item_f64()?;
    println!("{steps} optimizer steps of {} samples; accuracy {acc:.3}", MICRO_BATCH * ACCUMULATE);
    Ok(())
}
