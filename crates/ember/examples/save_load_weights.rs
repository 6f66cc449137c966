//! Saving and loading weights (PyTorch's `torch.save(model.state_dict())` /
//! `model.load_state_dict(torch.load(...))`), in safetensors: PyTorch's
//! `safetensors.torch.save_file(model.state_dict(), path)` writes the same format, so weights
//! move between the two frameworks. The file is written atomically.
//!
//! Run: `cargo run --release -p ember --example save_load_weights`

use ember::cuda;
use ember::nn::state_dict::{load_safetensors, save_safetensors};
use ember::nn::{Linear, ReLU, Sequential};
use ember::prelude::*;

fn build(device: Device) -> ember::Result<Sequential> {
    Ok(Sequential::new()
        .with(Linear::new(8, 16, device)?)
        .with(ReLU::new())
        .with(Linear::new(16, 2, device)?))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(1)?;
    let model = build(device)?;
    let path = std::env::temp_dir().join(format!("ember-example-{}.safetensors", std::process::id()));
    save_safetensors(&model, &path)?;
    println!(
        "saved {:?} to {}",
        model.state_dict().iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        path.display()
    );

    // A freshly initialized model (other weights) loads the file, here onto the CPU.
    ember::manual_seed(2)?;
    let mut restored = build(Device::Cpu)?;
    let x = Tensor::randn([4, 8], DType::F32, Device::Cpu)?;
    let before =
        restored.forward(&x)?.sub(&model.forward(&x.to(device)?)?.to(Device::Cpu)?)?.abs()?.max_all()?;
    load_safetensors(&mut restored, &path)?;
    let after =
        restored.forward(&x)?.sub(&model.forward(&x.to(device)?)?.to(Device::Cpu)?)?.abs()?.max_all()?;
    println!(
        "output difference from the saved model: {:.3} before loading, {:.1e} after",
        before.item_f64()?,
        after.item_f64()?
    );
    std::fs::remove_file(&path)?;
    Ok(())
}
