//! Automatic mixed precision, as PyTorch's AMP recipe (`torch.autocast` + `torch.amp.GradScaler`):
//! the forward pass and the loss run under autocast (matrix products in float16, the loss in
//! float32), the loss is scaled before backward so small float16 gradients do not flush to
//! zero, the gradients are unscaled before clipping, and the scaler skips steps whose
//! gradients overflowed and adapts the scale.
//!
//! ```python
//! scaler = torch.amp.GradScaler("cuda")
//! for x, y in loader:
//!     opt.zero_grad()
//!     with torch.autocast(device_type="cuda", dtype=torch.float16):
//!         loss = F.cross_entropy(model(x), y)
//!     scaler.scale(loss).backward()
//!     scaler.unscale_(opt)
//!     torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
//!     scaler.step(opt)
//!     scaler.update()
//! ```
//!
//! On a CPU-only machine the same program autocasts to bfloat16 (CPU autocast's dtype) and the
//! scaler is disabled, as PyTorch does for bfloat16, which has float32's range.
//!
//! Run: `cargo run --release -p ember --example mixed_precision`

use ember::amp::{self, GradScaler};
use ember::data::datasets::FashionMnist;
use ember::data::{DataLoader, TensorDataset};
use ember::nn::optim::{clip_grad_norm_, Adam, AdamConfig};
use ember::nn::{CrossEntropyLoss, Flatten, Linear, ReLU, Sequential};
use ember::prelude::*;
use ember::{cuda, Generator};

const IMAGES: &[u8] = include_bytes!("../data/fashion-mnist/t10k-images-idx3-ubyte.gz");
const LABELS: &[u8] = include_bytes!("../data/fashion-mnist/t10k-labels-idx1-ubyte.gz");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (device, dtype) =
        if cuda::is_available() { (Device::cuda(), DType::F16) } else { (Device::Cpu, DType::BF16) };
    println!("training on {device} with autocast to {dtype}");
    ember::manual_seed(0)?;

    // The first 2,048 images of the bundled split: enough to see the loss fall (half precision
    // on a CPU is slow in a debug build).
    let data = FashionMnist::from_idx_bytes(IMAGES, LABELS)?;
    let subset =
        TensorDataset::new(vec![data.images().narrow(0, 0, 2048)?, data.labels().narrow(0, 0, 2048)?])?;
    let loader = DataLoader::builder(subset)
        .batch_size(128)
        .shuffle(true)
        .generator(Generator::new(0))
        .pin_memory(device.is_cuda())
        .build()?;
    let mut model = Sequential::new()
        .with(Flatten::new())
        .with(Linear::new(784, 512, Device::Cpu)?)
        .with(ReLU::new())
        .with(Linear::new(512, 10, Device::Cpu)?);
    model.to_device(device)?;
    let params = model.parameters();
    let mut opt = Adam::new(params.clone(), AdamConfig::default())?;
    let loss_fn = CrossEntropyLoss::new();
    let mut scaler = GradScaler::new().enabled(dtype == DType::F16); // GradScaler("cuda", enabled=..)

    let mut losses = Vec::new();
    for epoch in 1..=2 {
        let (mut loss_sum, mut seen) = (0.0, 0usize);
        for batch in loader.unpacked() {
            let [x, y] = batch?;
            let (x, y) = (x.to_non_blocking(device)?, y.to_non_blocking(device)?);
            opt.zero_grad()?;
            let (logits, loss) = {
                let _autocast = amp::autocast(device.device_type(), dtype)?;
                let logits = model.forward(&x)?; // float16: Linear is a lower-precision op
                let loss = loss_fn.forward(&logits, &y)?; // float32
                (logits, loss)
            };
            if (logits.dtype(), loss.dtype()) != (dtype, DType::F32) {
                return Err("autocast did not give the dtypes of PyTorch's policy".into());
            }
            scaler.scale(&loss)?.backward()?;
            scaler.unscale_(&mut opt)?; // the gradients are true gradients from here on
            clip_grad_norm_(&params, 1.0, 2.0)?;
            scaler.step(&mut opt)?; // skipped on the device when a gradient is inf or NaN
            scaler.update()?;
            let n = y.dims()[0];
            loss_sum += loss.item_f64()? * n as f64;
            seen += n;
        }
        let scale =
            if scaler.is_enabled() { format!(", loss scale {}", scaler.get_scale()?) } else { String::new() };
        println!("epoch {epoch}: loss {:.4}{scale}", loss_sum / seen as f64);
        losses.push(loss_sum / seen as f64);
    }
    if losses[1] >= losses[0] {
        return Err(format!("the loss did not fall: {losses:?}").into());
    }
    // The weights and the optimizer state stayed in float32.
    println!("weight dtype: {}", params[0].dtype());
    Ok(())
}
