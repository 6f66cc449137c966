//! The soak test of issue 14: 10,000 training steps on a GPU (an MLP with dropout, Adam,
//! cross-entropy, gradient clipping) with the caching allocator's reserved memory flat after
//! warm-up and the process's host memory flat. Prints the figures at steps 100 and 10,000.
//! Ignored without a GPU; on a GPU machine:
//! `cargo test -p ember-nn --test soak -- --include-ignored --nocapture`.
//!
//! A test binary of its own: the host memory and allocator figures are the whole process's,
//! and the tests of the `it` binary run beside each other in one process.

use ember_core::{cuda, manual_seed, DType, Tensor};
use ember_nn::functional::cross_entropy;
use ember_nn::optim::{Adam, AdamConfig, Optimizer};
use ember_nn::{Dropout, Forward, Linear, ModuleExt, ReLU, Sequential};

/// The resident set size of this process, in bytes (`VmRSS` of `/proc/self/status`).
fn host_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

#[test]
#[ignore = "needs a CUDA device"]
fn soak_ten_thousand_steps_with_flat_memory() {
    const STEPS: usize = 10_000;
    const WARMUP: usize = 100;
    assert!(
        cuda::is_available(),
        "this test needs a CUDA device; run it on a GPU machine"
    );
    let gpu = ember_core::Device::Cuda(0);
    let dev = 0;
    manual_seed(14).unwrap();
    let model = Sequential::new()
        .with(Linear::new(256, 512, gpu).unwrap())
        .with(ReLU::new())
        .with(Dropout::new(0.1).unwrap())
        .with(Linear::new(512, 10, gpu).unwrap());
    let mut opt = Adam::new(model.parameters(), AdamConfig::default()).unwrap();
    let (mut at_warmup, mut at_end) = ((0, 0, 0), (0, 0, 0));
    for step in 1..=STEPS {
        // Batches of varying size, as a last partial batch of an epoch makes.
        let batch = if step % 7 == 0 { 17 } else { 64 };
        let x = Tensor::randn([batch, 256], DType::F32, gpu).unwrap();
        let y = Tensor::randint(0, 10, [batch], gpu).unwrap();
        opt.zero_grad().unwrap();
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        if step == WARMUP || step == STEPS {
            cuda::synchronize(dev).unwrap();
            let figures = (
                cuda::memory_reserved(dev),
                cuda::memory_allocated(dev),
                host_rss(),
            );
            println!(
                "step {step}: reserved {} bytes, allocated {} bytes, host RSS {} bytes, loss {:.4}",
                figures.0,
                figures.1,
                figures.2,
                loss.item_f64().unwrap()
            );
            if step == WARMUP {
                at_warmup = figures;
            } else {
                at_end = figures;
            }
        }
    }
    assert_eq!(
        at_end.0, at_warmup.0,
        "reserved memory grew after warm-up: {} -> {} bytes",
        at_warmup.0, at_end.0
    );
    assert!(
        at_end.1 <= at_warmup.1 + (1 << 20),
        "allocated memory grew: {} -> {} bytes",
        at_warmup.1,
        at_end.1
    );
    // Host memory: flat within 16 MiB (allocator arenas and the kernel cache settle early).
    assert!(
        at_end.2 <= at_warmup.2 + (16 << 20),
        "host memory grew: {} -> {} bytes",
        at_warmup.2,
        at_end.2
    );
}
