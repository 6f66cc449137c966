//! CUDA graphs, as the PyTorch CUDA semantics tutorial's snippet: warm up on a side stream,
//! capture `static_output = static_input * 2 + 1` into a `CUDAGraph`, then replay it 100 times,
//! each time with new data copied into the static input. A replay launches the whole captured
//! work with one call, which is what makes small steps cheap.
//!
//! Run: `cargo run --release -p ember --example cuda_graphs` (needs a GPU).

use ember::cuda::{self, CUDAGraph, Stream};
use ember::prelude::*;

fn main() -> Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: CUDA graphs need a GPU");
        return Ok(());
    }
    let device = Device::cuda();
    let static_input = Tensor::zeros([5], DType::F32, device)?;
    let region = || static_input.mul_scalar(2.0)?.add_scalar(1.0);

    // Warm up on a side stream: kernels load on first use, which a capture must not do.
    let side = Stream::new()?;
    side.wait_stream(&cuda::current_stream()?)?;
    {
        let _s = cuda::stream(&side);
        for _ in 0..3 {
            region()?;
        }
    }
    cuda::current_stream()?.wait_stream(&side)?;

    let mut g = CUDAGraph::new();
    let static_output = {
        let _capture = cuda::graph(&mut g)?;
        region()?
    };

    for i in 0..100 {
        static_input.copy_(&Tensor::full([5], i as f64, DType::F32, Device::Cpu)?)?;
        g.replay()?;
        let got = static_output.to_vec::<f32>()?;
        if got != vec![2.0 * i as f32 + 1.0; 5] {
            return Err(ember::Error::invalid("replay", format!("replay {i} gave {got:?}")));
        }
    }
    println!("100 replays: static_output = {:?}", static_output.to_vec::<f32>()?);
    Ok(())
}
