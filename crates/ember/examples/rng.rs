//! Reproducible random numbers, as PyTorch's reproducibility notes and `torch.random`:
//! `manual_seed` makes draws repeat, `get_rng_state` / `set_rng_state` replay a draw,
//! `initial_seed` says which seed is in use, `torch.cuda.manual_seed(_all)` seeds the GPUs'
//! generators, and a `Generator` of one's own is a stream apart from the global one.
//! ember's generator is counter-based Philox, so one seed gives the same numbers on the CPU
//! and on a GPU.
//!
//! Run: `cargo run --release -p ember --example rng`

use ember::prelude::*;
use ember::{cuda, Generator};

/// Prints `what` and fails the example when it did not hold.
fn check(holds: bool, what: &str) -> Result<(), String> {
    println!("{}: {what}", if holds { "ok" } else { "FAILED" });
    holds.then_some(()).ok_or_else(|| format!("not reproduced: {what}"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    let draw = |dev: Device| Tensor::randn([4], DType::F32, dev)?.to_vec::<f32>();

    // torch.manual_seed(42): every default generator, CPU and CUDA, restarts from 42.
    ember::manual_seed(42)?;
    println!("initial_seed() = {}", ember::initial_seed());
    let a = draw(Device::Cpu)?;
    ember::manual_seed(42)?;
    let b = draw(Device::Cpu)?;
    println!("randn(4) after manual_seed(42), twice: {a:?}");
    check(a == b && ember::initial_seed() == 42, "manual_seed repeats a draw")?;

    // state = torch.get_rng_state(); ...; torch.set_rng_state(state) replays the draws.
    let state = ember::get_rng_state();
    let c = draw(Device::Cpu)?;
    ember::set_rng_state(state);
    let d = draw(Device::Cpu)?;
    println!("CPU generator state {state:?}, now {:?}", ember::get_rng_state());
    check(c == d && c != a, "set_rng_state replays the draw after get_rng_state")?;

    // torch.cuda.manual_seed_all / manual_seed / get_rng_state: the GPUs' generators. Their
    // state is (seed, offset) on the host, so this runs without a GPU too.
    cuda::manual_seed_all(7);
    cuda::manual_seed(7);
    let gpu_state = cuda::get_rng_state();
    println!("cuda initial_seed() = {}, state {gpu_state:?}", cuda::initial_seed());
    check(cuda::initial_seed() == 7, "cuda::manual_seed seeds the current GPU's generator")?;
    if device.is_cuda() {
        let e = draw(device)?;
        cuda::set_rng_state(gpu_state);
        check(draw(device)? == e, "cuda::set_rng_state replays a GPU draw")?;
    }

    // Philox: one seed, the same numbers on every device.
    ember::manual_seed(3)?;
    let on_cpu = draw(Device::Cpu)?;
    ember::manual_seed(3)?;
    let on_device = draw(device)?;
    check(on_cpu == on_device, &format!("seed 3 draws the same on cpu and {device}"))?;

    // torch.Generator().manual_seed(0): a private stream the global seed does not touch.
    let g = Generator::new(0);
    let mine = Tensor::rand_with([3], DType::F32, device, &g)?.to_vec::<f32>()?;
    ember::manual_seed(123)?;
    g.manual_seed(0);
    let again = Tensor::rand_with([3], DType::F32, device, &g)?.to_vec::<f32>()?;
    check(mine == again, "a Generator of its own repeats whatever the global seed")?;
    Ok(())
}
