//! Moving tensors and a small model between devices (`x.to(device)`, `model.to(device)`),
//! computing on the GPU, and bringing results back to the host. A "model" here is a struct of
//! parameter tensors; `ember::nn` modules move the same way.
//!
//! Run with `cargo run --release -p ember --example cuda_move_tensors`.

use ember::{cuda, DType, Device, Result, Tensor};

/// A two-layer perceptron's parameters.
struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl Mlp {
    fn new(inputs: usize, hidden: usize, outputs: usize) -> Result<Mlp> {
        let scale = |fan_in: usize| 1.0 / (fan_in as f64).sqrt();
        Ok(Mlp {
            w1: Tensor::randn([hidden, inputs], DType::F32, Device::Cpu)?.mul_scalar(scale(inputs))?,
            b1: Tensor::zeros([hidden], DType::F32, Device::Cpu)?,
            w2: Tensor::randn([outputs, hidden], DType::F32, Device::Cpu)?.mul_scalar(scale(hidden))?,
            b2: Tensor::zeros([outputs], DType::F32, Device::Cpu)?,
        })
    }

    /// The same model on `device` (`model.to(device)`).
    fn to(&self, device: Device) -> Result<Mlp> {
        Ok(Mlp {
            w1: self.w1.to(device)?,
            b1: self.b1.to(device)?,
            w2: self.w2.to(device)?,
            b2: self.b2.to(device)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.w1, Some(&self.b1))?
            .relu()?
            .linear(&self.w2, Some(&self.b2))
    }
}

fn main() -> Result<()> {
    ember::manual_seed(0)?;
    let device = if cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    let model_cpu = Mlp::new(784, 256, 10)?;
    let x_cpu = Tensor::randn([64, 784], DType::F32, Device::Cpu)?;

    let model = model_cpu.to(device)?;
    let x = x_cpu.to(device)?;
    let y = model.forward(&x)?;
    println!("output {:?} on {}", y.dims(), y.device());

    // Mixing devices is an error that names both, not a crash.
    if device != Device::Cpu {
        let err = model.forward(&x_cpu).unwrap_err();
        println!("as expected: {err}");
    }

    // Back to the host and compare with the CPU computation.
    let y_back = y.to(Device::Cpu)?;
    let y_ref = model_cpu.forward(&x_cpu)?;
    let diff = y_back.sub(&y_ref)?.abs()?.amax(&[0, 1], false)?.item_f64()?;
    println!("max |gpu - cpu| = {diff:.2e}");
    println!("logits of the first sample: {:?}", &y_back.to_vec::<f32>()?[..10]);
    Ok(())
}
