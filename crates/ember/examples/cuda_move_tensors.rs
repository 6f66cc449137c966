//! Moving tensors and a small model between devices (`x.to(device)`, `torch.randn(...,
//! device=device)`, `model.to(device)`), computing on the GPU, and bringing results back to the
//! host (`y.cpu()`); mixing devices in one op is an error naming both. Without a GPU everything
//! stays on the CPU and the same program runs.
//!
//! Run with `cargo run --release -p ember --example cuda_move_tensors`.

use ember::cuda;
use ember::nn::Linear;
use ember::prelude::*;

/// A two-layer perceptron.
#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    ember::manual_seed(0)?;
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    // Made on the host and moved, or made where it is used.
    let x_cpu = Tensor::randn([64, 784], DType::F32, Device::Cpu)?;
    let x = x_cpu.to(device)?;
    let noise = Tensor::randn([64, 784], DType::F32, device)?.mul_scalar(0.01)?;
    println!("x on {}, noise on {}", x.device(), noise.device());

    let mut model = Mlp { fc1: Linear::new(784, 256, Device::Cpu)?, fc2: Linear::new(256, 10, Device::Cpu)? };
    let y_ref = model.forward(&(&x_cpu + &noise.to(Device::Cpu)?)?)?;
    model.to_device(device)?; // model.to(device): parameters move in place
    let y = model.forward(&(&x + &noise)?)?;
    println!("output {:?} on {}", y.dims(), y.device());

    // Mixing devices is an error that names both, not a crash.
    if device != Device::Cpu {
        let err = model.forward(&x_cpu).unwrap_err();
        println!("as expected: {err}");
    }

    // Back to the host and compare with the CPU computation.
    let y_back = y.to(Device::Cpu)?;
    let diff = (&y_back - &y_ref)?.abs()?.max_all()?.item_f64()?;
    println!("max |{device} - cpu| = {diff:.2e}");
    println!("logits of the first sample: {:?}", &y_back.to_vec::<f32>()?[..10]);
    if diff > 1e-3 {
        return Err(format!("the {device} result differs from the CPU's by {diff:e}").into());
    }
    Ok(())
}
