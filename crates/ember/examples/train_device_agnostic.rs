//! A device-agnostic training loop, as in PyTorch's "device-agnostic code" recipe
//! (`device = "cuda" if torch.cuda.is_available() else "cpu"`): the same program trains a small
//! classifier on the GPU when there is one and on the CPU otherwise.
//!
//! Run: `cargo run --release -p ember --example train_device_agnostic`

use ember::data::datasets::FashionMnist;
use ember::data::DataLoader;
use ember::nn::optim::{Adam, AdamConfig};
use ember::nn::{CrossEntropyLoss, Flatten, Linear, ReLU, Sequential};
use ember::prelude::*;
use ember::{cuda, Generator};

const IMAGES: &[u8] = include_bytes!("../data/fashion-mnist/t10k-images-idx3-ubyte.gz");
const LABELS: &[u8] = include_bytes!("../data/fashion-mnist/t10k-labels-idx1-ubyte.gz");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    println!("training on {device}");
    ember::manual_seed(0)?;

    let data = FashionMnist::from_idx_bytes(IMAGES, LABELS)?;
    let loader = DataLoader::builder(data.to_tensor_dataset())
        .batch_size(128)
        .shuffle(true)
        .generator(Generator::new(0))
        .pin_memory(device.is_cuda()) // pinned batches copy to the GPU asynchronously
        .build()?;

    // Built once, moved to the device with its parameters.
    let mut model = Sequential::new()
        .with(Flatten::new())
        .with(Linear::new(784, 128, Device::Cpu)?)
        .with(ReLU::new())
        .with(Linear::new(128, 10, Device::Cpu)?);
    model.to_device(device)?;
    let mut opt = Adam::new(model.parameters(), AdamConfig::default())?;
    let loss_fn = CrossEntropyLoss::new();

    let mut losses = Vec::new();
    for epoch in 1..=2 {
        let (mut loss_sum, mut correct, mut seen) = (0.0, 0.0, 0usize);
        for batch in loader.unpacked() {
            let [x, y] = batch?;
            let (x, y) = (x.to_non_blocking(device)?, y.to_non_blocking(device)?);
            opt.zero_grad()?;
            let logits = model.forward(&x)?;
            let loss = loss_fn.forward(&logits, &y)?;
            loss.backward()?;
            opt.step()?;
            let n = y.dims()[0];
            loss_sum += loss.item_f64()? * n as f64;
            correct += logits.argmax(Some(1), false)?.eq(&y)?.to_dtype(DType::F64)?.sum_all()?.item_f64()?;
            seen += n;
        }
        println!(
            "epoch {epoch}: loss {:.4}, train accuracy {:.3}",
            loss_sum / seen as f64,
            correct / seen as f64
        );
        losses.push(loss_sum / seen as f64);
    }
    if losses[1] >= losses[0] {
        return Err(format!("the loss did not fall: {losses:?}").into());
    }
    let probe = Tensor::zeros([1, 1, 28, 28], DType::F32, device)?;
    println!("output device: {}", model.forward(&probe)?.device());
    Ok(())
}
