//! PyTorch's "Training a Classifier" (the CIFAR-10 tutorial of the 60-minute blitz): its `Net`
//! (conv 3→6 5×5, max-pool 2, conv 6→16 5×5, max-pool 2, Linear 400→120→84→10 with ReLUs)
//! trained with `CrossEntropyLoss` and SGD with momentum, printing the running loss, then its
//! accuracy on test images, overall and per class.
//!
//! The images are CIFAR-10-shaped (`[3, 32, 32]` f32, ten classes), made up in the program
//! (each class a fixed random pattern plus noise) so that it runs in seconds anywhere; batches
//! of 8 and a learning rate of 0.02 (the tutorial's: 4 and 0.001) let 2 epochs of 25 steps show
//! it learn.
//!
//! Run: `cargo run --release -p ember --example tutorial_cnn`

use ember::cuda;
use ember::data::{DataLoader, Dataset, TensorDataset};
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Conv2d, CrossEntropyLoss, Linear, MaxPool2d};
use ember::prelude::*;

const CLASSES: [&str; 10] = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"];

#[derive(Module)]
struct Net {
    conv1: Conv2d,
    pool: MaxPool2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Net {
    fn new(device: Device) -> Result<Net> {
        Ok(Net {
            conv1: Conv2d::new(3, 6, 5, device)?,
            pool: MaxPool2d::new(2),
            conv2: Conv2d::new(6, 16, 5, device)?,
            fc1: Linear::new(16 * 5 * 5, 120, device)?,
            fc2: Linear::new(120, 84, device)?,
            fc3: Linear::new(84, 10, device)?,
        })
    }
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.pool.forward(&self.conv1.forward(x)?.relu()?)?;
        let x = self.pool.forward(&self.conv2.forward(&x)?.relu()?)?;
        let x = x.flatten(1, -1)?; // flatten all dimensions except batch
        let x = self.fc1.forward(&x)?.relu()?;
        let x = self.fc2.forward(&x)?.relu()?;
        self.fc3.forward(&x)
    }
}

/// `n` labelled images: the pattern of the label plus unit noise.
fn cifar_like(patterns: &Tensor, n: usize) -> Result<TensorDataset> {
    let y = Tensor::randint(0, 10, [n], Device::Cpu)?;
    let noise = Tensor::randn([n, 3, 32, 32], DType::F32, Device::Cpu)?;
    TensorDataset::new(vec![(&patterns.index_select(0, &y)? + &noise)?, y])
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let patterns = Tensor::randn([10, 3, 32, 32], DType::F32, Device::Cpu)?.mul_scalar(2.0)?;
    let trainloader = DataLoader::builder(cifar_like(&patterns, 200)?).batch_size(8).shuffle(true).build()?;
    let testloader = DataLoader::builder(cifar_like(&patterns, 100)?).batch_size(10).build()?;

    let net = Net::new(device)?;
    let criterion = CrossEntropyLoss::new();
    let mut optimizer =
        SGD::new(net.parameters(), SgdConfig { lr: 0.02, momentum: 0.9, ..Default::default() })?;
    let mut running_losses = Vec::new();
    for epoch in 1..=2 {
        let mut running_loss = 0.0;
        for (i, data) in trainloader.iter().enumerate() {
            let data = data?;
            let (inputs, labels) = (data[0].to(device)?, data[1].to(device)?);
            optimizer.zero_grad()?;
            let loss = criterion.forward(&net.forward(&inputs)?, &labels)?;
            loss.backward()?;
            optimizer.step()?;
            running_loss += loss.item_f64()?;
            if i % 5 == 4 {
                println!("[{epoch}, {:3}] loss: {:.3}", i + 1, running_loss / 5.0);
                running_losses.push(running_loss / 5.0);
                running_loss = 0.0;
            }
        }
    }
    println!("Finished Training");

    // Accuracy over the test images, overall and per class, without tracking gradients.
    let _no_grad = ember::no_grad();
    let (mut correct, mut total) = ([0usize; 10], [0usize; 10]);
    for data in &testloader {
        let data = data?;
        let predicted = net.forward(&data[0].to(device)?)?.argmax(Some(1), false)?;
        for (label, prediction) in data[1].to_vec::<i64>()?.into_iter().zip(predicted.to_vec::<i64>()?) {
            total[label as usize] += 1;
            correct[label as usize] += usize::from(label == prediction);
        }
    }
    let accuracy = correct.iter().sum::<usize>() as f64 / total.iter().sum::<usize>() as f64;
    println!(
        "Accuracy of the network on the {} test images: {:.0} %",
        testloader.dataset().len(),
        100.0 * accuracy
    );
    for (class, (c, t)) in CLASSES.iter().zip(correct.iter().zip(total)) {
        println!("Accuracy for class: {class:5} is {:.1} %", 100.0 * *c as f64 / t.max(1) as f64);
    }
    let (first, last) = (running_losses[0], running_losses[running_losses.len() - 1]);
    if !(last < 0.75 * first && accuracy > 0.5) {
        return Err(
            format!("did not learn: running loss {first:.3} -> {last:.3}, accuracy {accuracy:.2}").into()
        );
    }
    Ok(())
}
