// scratch probe, not committed
use ember::cuda::{self, CUDAGraph, Stream};
use ember::nn::optim::{Adam, AdamConfig, Optimizer};
use ember::nn::{CrossEntropyLoss, Forward, Linear, ModuleExt, ReLU, Sequential, Conv2d, MaxPool2d, Flatten};
use ember::nn::layers::Conv2dConfig;
use ember::nn::functional::Pair;
use ember::{DType, Device, Result, Tensor};
use std::time::Instant;

fn run(name: &str, model: Sequential, shape: &[usize], classes: i64) -> Result<()> {
    let d = Device::cuda();
    let x = Tensor::randn(shape, DType::F32, d)?;
    let y = Tensor::randint(0, classes, [shape[0]], d)?;
    let mut opt = Adam::new(model.parameters(), AdamConfig::default())?;
    let ce = CrossEntropyLoss::new();
    let side = Stream::new(0)?;
    let main = cuda::current_stream(0)?;
    side.wait_stream(&main)?;
    {
        let _s = cuda::stream(&side);
        for _ in 0..3 { opt.zero_grad()?; ce.forward(&model.forward(&x)?, &y)?.backward()?; opt.step()?; }
    }
    main.wait_stream(&side)?;
    if std::env::var("PROBE_NCU").is_ok() {
        cuda::synchronize_on(0)?;
        eprintln!("=== PROBE STEP {name}");
        opt.zero_grad()?; ce.forward(&model.forward(&x)?, &y)?.backward()?; opt.step()?;
        cuda::synchronize_on(0)?;
        return Ok(());
    }
    // eager timing
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..10 { f()?; }
        cuda::synchronize_on(0)?;
        let mut v = vec![];
        for _ in 0..5 { let t = Instant::now(); for _ in 0..50 { f()?; } cuda::synchronize_on(0)?; v.push(t.elapsed().as_secs_f64()*1000.0/50.0); }
        v.sort_by(f64::total_cmp); Ok(v[2])
    };
    let eager = time(&mut || { opt.zero_grad()?; ce.forward(&model.forward(&x)?, &y)?.backward()?; opt.step() })?;
    opt.zero_grad()?;
    let mut g = CUDAGraph::new();
    {
        let _c = cuda::graph(&mut g)?;
        ce.forward(&model.forward(&x)?, &y)?.backward()?; opt.step()?;
    }
    let graphed = time(&mut || g.replay())?;
    println!("{name}: eager(debug host) {eager:.4} ms, graph replay {graphed:.4} ms");
    Ok(())
}

fn main() -> Result<()> {
    ember::manual_seed(0)?;
    let d = Device::cuda();
    let mut m = Sequential::new();
    m.push(Linear::new(2000, 1000, d)?); m.push(ReLU::new()); m.push(Linear::new(1000, 100, d)?);
    if std::env::var("PROBE_NCU").is_err() { run("mlp_small", m, &[128, 2000], 100)?; }
    let cfg = Conv2dConfig { padding: Pair([1, 1]), ..Default::default() };
    let mut c = Sequential::new();
    c.push(Conv2d::with_config(3, 16, 3, cfg.clone(), d)?); c.push(ReLU::new()); c.push(MaxPool2d::new(2));
    c.push(Conv2d::with_config(16, 32, 3, cfg, d)?); c.push(ReLU::new()); c.push(MaxPool2d::new(2));
    c.push(Flatten::new()); c.push(Linear::new(1568, 128, d)?); c.push(ReLU::new()); c.push(Linear::new(128, 10, d)?);
    run("cnn", c, &[256, 3, 28, 28], 10)?;
    Ok(())
}
