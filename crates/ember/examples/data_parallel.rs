//! PyTorch's "Optional: Data Parallelism" tutorial: a model that prints the size of the input
//! it gets, wrapped in `nn::DataParallel`, fed batches of 30 from a random dataset of 100
//! samples. With several GPUs each replica prints its share of the batch ("In Model: input
//! size [15, 5]" twice on two GPUs) and the gathered output has the whole batch ("Outside:
//! input size [30, 5] output_size [30, 2]"); with one GPU or none the model sees whole
//! batches.
//!
//! Run: `cargo run --release -p ember --example data_parallel`

use ember::cuda;
use ember::data::{DataLoader, TensorDataset};
use ember::nn::{DataParallel, Linear};
use ember::prelude::*;

const INPUT_SIZE: usize = 5;
const OUTPUT_SIZE: usize = 2;
const BATCH_SIZE: usize = 30;
const DATA_SIZE: usize = 100;

#[derive(Module, Clone)]
struct Model {
    fc: Linear,
}

impl Forward for Model {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let output = self.fc.forward(input)?;
        println!(
            "\tIn Model: input size {:?} output size {:?} on {}",
            input.dims(),
            output.dims(),
            input.device()
        );
        Ok(output)
    }
}

fn main() -> Result<()> {
    let device = if cuda::is_available() { Device::Cuda(0) } else { Device::Cpu };
    let data = Tensor::randn([DATA_SIZE, INPUT_SIZE], DType::F32, Device::Cpu)?;
    let loader =
        DataLoader::builder(TensorDataset::new(vec![data])?).batch_size(BATCH_SIZE).shuffle(true).build()?;

    let model = Model { fc: Linear::new(INPUT_SIZE, OUTPUT_SIZE, Device::Cpu)? };
    if cuda::device_count() > 1 {
        println!("Let's use {} GPUs!", cuda::device_count());
        // Every visible GPU (none on a machine without: then the model runs as it is).
    }
    // The tutorial's order: wrap, then move (devices are checked at the forward).
    let mut model = DataParallel::new(model)?;
    model.to_device(device)?;

    for batch in loader.unpacked() {
        let [input] = batch?;
        let input = input.to(device)?;
        let output = model.forward(&input)?;
        println!("Outside: input size {:?} output_size {:?}", input.dims(), output.dims());
        assert_eq!(output.dims(), [input.dims()[0], OUTPUT_SIZE]);
    }
    Ok(())
}
