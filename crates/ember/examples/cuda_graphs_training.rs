//! CUDA graphs in training, as the PyTorch CUDA semantics tutorial's two snippets:
//! - whole-network capture: forward, loss, backward and the optimizer step captured once
//!   (after warm-up on a side stream, with the gradients released before the capture), then
//!   replayed with new data copied into the static input and target;
//! - partial-network capture: `make_graphed_callables` on three modules of an eager loop whose
//!   control flow (a branch on a value read back) cannot be captured.
//!
//! Run: `cargo run --release -p ember --example cuda_graphs_training` (needs a GPU).

use ember::cuda::{self, CUDAGraph, Stream};
use ember::nn::graphs::make_graphed_module;
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Dropout, Linear, MSELoss, Sequential};
use ember::prelude::*;

const N: usize = 640;
const D_IN: usize = 4096;
const H: usize = 2048;
const D_OUT: usize = 1024;

fn whole_network(device: Device) -> Result<()> {
    let mut model = Sequential::new();
    model.push(Linear::new(D_IN, H, device)?);
    model.push(Dropout::new(0.2)?);
    model.push(Linear::new(H, D_OUT, device)?);
    model.push(Dropout::new(0.1)?);
    let loss_fn = MSELoss::new();
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;

    // Placeholders used for capture.
    let static_input = Tensor::randn([N, D_IN], DType::F32, device)?;
    let static_target = Tensor::randn([N, D_OUT], DType::F32, device)?;

    // Warm up on a side stream.
    let side = Stream::new()?;
    let main = cuda::current_stream()?;
    side.wait_stream(&main)?;
    {
        let _s = cuda::stream(&side);
        for _ in 0..3 {
            optimizer.zero_grad()?;
            let loss = loss_fn.forward(&model.forward(&static_input)?, &static_target)?;
            loss.backward()?;
            optimizer.step()?;
        }
    }
    main.wait_stream(&side)?;

    // Capture: the gradients are released first, so the captured backward allocates them from
    // the graph's pool and every replay writes them there.
    let mut g = CUDAGraph::new();
    optimizer.zero_grad()?;
    let static_loss = {
        let _capture = cuda::graph(&mut g)?;
        let static_y_pred = model.forward(&static_input)?;
        let static_loss = loss_fn.forward(&static_y_pred, &static_target)?;
        static_loss.backward()?;
        optimizer.step()?;
        static_loss
    };

    let mut losses = Vec::new();
    for _ in 0..10 {
        // Fills the graph's input memory with new data to compute on.
        static_input.copy_(&static_input.rand_like()?)?;
        static_target.copy_(&static_target.rand_like()?)?;
        // replay() includes forward, backward, and step; no zero_grad between iterations.
        g.replay()?;
        // The parameters are updated; static_y_pred, static_loss and the .grad attributes hold
        // the values of this iteration's data.
        losses.push(static_loss.item_f64()?);
    }
    println!("whole network: 10 replays, losses {losses:.3?}");
    if losses.iter().any(|l| !l.is_finite()) {
        return Err(ember::Error::invalid("whole_network", "a replay gave a non-finite loss"));
    }
    Ok(())
}

fn partial_network(device: Device) -> Result<()> {
    let module1 = Linear::new(D_IN, H, device)?;
    let module2 = Linear::new(H, D_OUT, device)?;
    let module3 = Linear::new(H, D_OUT, device)?;
    let loss_fn = MSELoss::new();
    let params = [module1.parameters(), module2.parameters(), module3.parameters()].concat();
    let mut optimizer = SGD::new(params, SgdConfig { lr: 0.1, ..Default::default() })?;

    // Sample inputs used for capture; requires_grad of each matches the real inputs'.
    let x = Tensor::randn([N, D_IN], DType::F32, device)?;
    let h = Tensor::randn([N, H], DType::F32, device)?.requires_grad_(true)?;
    let module1 = make_graphed_module(module1, &x)?;
    let module2 = make_graphed_module(module2, &h)?;
    let module3 = make_graphed_module(module3, &h)?;

    let (mut took2, mut took3) = (0, 0);
    for _ in 0..10 {
        let data = x.rand_like()?;
        let target = Tensor::randn([N, D_OUT], DType::F32, device)?;
        optimizer.zero_grad()?;
        let tmp = module1.forward(&data)?; // forward ops run as a graph
        let tmp = if tmp.sum_all()?.item_f64()? > 0.0 {
            took2 += 1;
            module2.forward(&tmp)? // forward ops run as a graph
        } else {
            took3 += 1;
            module3.forward(&tmp)?
        };
        let loss = loss_fn.forward(&tmp, &target)?;
        loss.backward()?; // the backward ops of module2 or module3, then module1, run as graphs
        optimizer.step()?;
    }
    let graded = module1.parameters().iter().all(|p| p.grad().is_some());
    println!(
        "partial network: 10 steps, module2 {took2}x, module3 {took3}x; module1 has gradients: {graded}"
    );
    if !graded {
        return Err(ember::Error::invalid("partial_network", "module1 received no gradients"));
    }
    Ok(())
}

fn main() -> Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: CUDA graphs need a GPU");
        return Ok(());
    }
    let device = Device::cuda();
    ember::manual_seed(0)?;
    whole_network(device)?;
    partial_network(device)
}
