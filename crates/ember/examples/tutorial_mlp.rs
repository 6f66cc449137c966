//! PyTorch's quickstart ("Learn the Basics"): the `NeuralNetwork` MLP (Flatten, then Linear
//! 784→512, ReLU, Linear 512→512, ReLU, Linear 512→10) trained with `CrossEntropyLoss` and SGD
//! by a `train` and a `test` function, saved, loaded back and asked for a prediction.
//!
//! The images are Fashion-MNIST-shaped (`[1, 28, 28]` f32, ten classes), made up in the program
//! (each class a fixed random pattern plus noise) so that it runs in seconds anywhere; the
//! `train_device_agnostic` example and `ember train` use the real Fashion-MNIST. Two epochs of
//! 12 steps at a learning rate of 0.01 (the tutorial's: 5 epochs of 938 steps at 0.001).
//!
//! Run: `cargo run --release -p ember --example tutorial_mlp`

use ember::cuda;
use ember::data::datasets::FashionMnist;
use ember::data::{DataLoader, Dataset, TensorDataset};
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{CrossEntropyLoss, Flatten, Linear, ReLU, Sequential};
use ember::prelude::*;

#[derive(Module)]
struct NeuralNetwork {
    flatten: Flatten,
    linear_relu_stack: Sequential,
}

impl NeuralNetwork {
    fn new(device: Device) -> Result<NeuralNetwork> {
        Ok(NeuralNetwork {
            flatten: Flatten::new(),
            linear_relu_stack: Sequential::new()
                .with(Linear::new(28 * 28, 512, device)?)
                .with(ReLU::new())
                .with(Linear::new(512, 512, device)?)
                .with(ReLU::new())
                .with(Linear::new(512, 10, device)?),
        })
    }
}

impl Forward for NeuralNetwork {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_relu_stack.forward(&self.flatten.forward(x)?)
    }
}

/// `n` labelled images: the pattern of the label plus unit noise.
fn fashion_like(patterns: &Tensor, n: usize) -> Result<TensorDataset> {
    let y = Tensor::randint(0, 10, [n], Device::Cpu)?;
    let noise = Tensor::randn([n, 1, 28, 28], DType::F32, Device::Cpu)?;
    TensorDataset::new(vec![(&patterns.index_select(0, &y)? + &noise)?, y])
}

fn train(
    loader: &DataLoader,
    model: &NeuralNetwork,
    loss_fn: &CrossEntropyLoss,
    opt: &mut SGD,
    device: Device,
) -> Result<()> {
    model.train();
    for (batch, b) in loader.unpacked().enumerate() {
        let [x, y] = b?;
        let (x, y) = (x.to(device)?, y.to(device)?);
        let loss = loss_fn.forward(&model.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        if batch % 5 == 0 {
            let current = batch * loader.batch_size() + x.dims()[0];
            println!("loss: {:>7.4}  [{current:>4}/{:>4}]", loss.item_f64()?, loader.dataset().len());
        }
    }
    Ok(())
}

/// The accuracy and mean loss over `loader`.
fn test(
    loader: &DataLoader,
    model: &NeuralNetwork,
    loss_fn: &CrossEntropyLoss,
    device: Device,
) -> Result<(f64, f64)> {
    model.eval();
    let _no_grad = ember::no_grad();
    let (mut loss, mut correct) = (0.0, 0.0);
    for b in loader.unpacked() {
        let [x, y] = b?;
        let (x, y) = (x.to(device)?, y.to(device)?);
        let pred = model.forward(&x)?;
        loss += loss_fn.forward(&pred, &y)?.item_f64()?;
        correct += pred.argmax(Some(1), false)?.eq(&y)?.to_dtype(DType::F64)?.sum_all()?.item_f64()?;
    }
    let (accuracy, loss) = (correct / loader.dataset().len() as f64, loss / loader.len() as f64);
    println!("Test Error: \n Accuracy: {:>4.1}%, Avg loss: {loss:>8.4}\n", 100.0 * accuracy);
    Ok((accuracy, loss))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    println!("Using {device} device");
    ember::manual_seed(0)?;
    let patterns = Tensor::randn([10, 1, 28, 28], DType::F32, Device::Cpu)?;
    let test_data = fashion_like(&patterns, 256)?;
    let train_dataloader =
        DataLoader::builder(fashion_like(&patterns, 768)?).batch_size(64).shuffle(true).build()?;
    let test_dataloader = DataLoader::builder(test_data.clone()).batch_size(64).build()?;

    let model = NeuralNetwork::new(device)?;
    let loss_fn = CrossEntropyLoss::new();
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 1e-2, ..Default::default() })?;
    let (accuracy_before, loss_before) = test(&test_dataloader, &model, &loss_fn, device)?;
    let (mut accuracy, mut loss) = (0.0, 0.0);
    for t in 1..=2 {
        println!("Epoch {t}\n-------------------------------");
        train(&train_dataloader, &model, &loss_fn, &mut optimizer, device)?;
        (accuracy, loss) = test(&test_dataloader, &model, &loss_fn, device)?;
    }
    println!("Done!");
    if !(loss < loss_before && accuracy > accuracy_before + 0.2) {
        return Err(format!("did not learn: loss {loss_before:.3} -> {loss:.3}, accuracy {accuracy_before:.3} -> {accuracy:.3}").into());
    }

    // torch.save(model.state_dict(), "model.pth"), then into a new model.
    let path = std::env::temp_dir().join(format!("ember-tutorial-mlp-{}.safetensors", std::process::id()));
    ember::nn::save_safetensors(&model, &path)?;
    println!("Saved model state to {}", path.display());
    let mut model = NeuralNetwork::new(device)?;
    ember::nn::load_safetensors(&mut model, &path)?;
    std::fs::remove_file(&path)?;

    model.eval();
    let sample = test_data.get(0)?;
    let (x, y) = (sample[0].to(device)?, sample[1].item::<i64>()?);
    let pred = {
        let _no_grad = ember::no_grad();
        model.forward(&x)?.argmax(Some(1), false)?.item::<i64>()?
    };
    println!(
        "Predicted: \"{}\", Actual: \"{}\"",
        FashionMnist::CLASSES[pred as usize],
        FashionMnist::CLASSES[y as usize]
    );
    Ok(())
}
