//! Moving a model between devices (PyTorch's `model.to(device)` / `model.cpu()`): a model
//! built on the CPU moves to the GPU, trains a step there, comes back, and gives the same
//! outputs on both devices.
//!
//! Run: `cargo run --release -p ember --example move_model`

use ember::cuda;
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Linear, ReLU, Sequential};
use ember::prelude::*;

fn main() -> ember::Result<()> {
    ember::manual_seed(0)?;
    let mut model = Sequential::new()
        .with(Linear::new(16, 32, Device::Cpu)?)
        .with(ReLU::new())
        .with(Linear::new(32, 4, Device::Cpu)?);
    let x = Tensor::randn([8, 16], DType::F32, Device::Cpu)?;
    let on_cpu = model.forward(&x)?;
    if !cuda::is_available() {
        println!("no CUDA device: the model stays on the CPU; output {:?}", on_cpu.dims());
        return Ok(());
    }
    let gpu = Device::Cuda(0);
    let before = cuda::memory_allocated();
    model.to_device(gpu)?;
    println!(
        "moved {} parameters to {gpu}: every one is there: {}; {} bytes more allocated",
        model.num_parameters(),
        model.parameters().iter().all(|p| p.device() == gpu),
        cuda::memory_allocated() - before
    );
    let on_gpu = model.forward(&x.to(gpu)?)?;
    let diff = on_gpu.to(Device::Cpu)?.sub(&on_cpu)?.abs()?.max_all()?.item_f64()?;
    println!("largest CPU/GPU output difference: {diff:.2e}");

    // An optimizer made after the move updates the GPU parameters in place.
    let mut opt = SGD::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    model.forward(&x.to(gpu)?)?.pow_scalar(2.0)?.mean_all()?.backward()?;
    opt.step()?;

    model.to_device(Device::Cpu)?;
    let back = model.forward(&x)?;
    println!(
        "back on the CPU after one GPU step: output changed by {:.2e}, parameters on cpu: {}",
        back.sub(&on_cpu)?.abs()?.max_all()?.item_f64()?,
        model.parameters().iter().all(|p| p.device() == Device::Cpu)
    );
    Ok(())
}
