//! How long a program waits for its first GPU ops: prints, in milliseconds since `main` began,
//! when the first tensor reached the GPU and when the first add, matmul, softmax and sum
//! (each read back to the host, so the time includes its kernel's compile or load) completed.
//!
//! Kernels compile on first use and are cached on disk (`EMBER_KERNEL_CACHE` moves the cache),
//! so a run against an empty cache shows a fresh machine and a second run the warm case:
//!
//! ```text
//! cargo build --release -p ember --example first_op
//! export EMBER_KERNEL_CACHE=$(mktemp -d)
//! target/release/examples/first_op   # cold: compiles the kernels it uses
//! target/release/examples/first_op   # warm: reads them from the cache
//! ```
//!
//! `EMBER_KERNEL_LOG=1` prints each kernel unit compiled and how long it took.

use ember::cuda;
use ember::prelude::*;
use std::time::Instant;

fn main() -> Result<()> {
    let start = Instant::now();
    let mark = |what: &str| println!("{:>8.1} ms  {what}", start.elapsed().as_secs_f64() * 1e3);
    if !cuda::is_available() {
        println!("no CUDA device: nothing to measure");
        return Ok(());
    }
    let device = Device::cuda();
    mark("CUDA available");
    let x = Tensor::from_vec((0..64 * 64).map(|i| i as f32 / 4096.0).collect(), [64, 64], Device::Cpu)?;
    let a = x.to(device)?;
    cuda::synchronize()?;
    mark("first tensor on the GPU");
    let sum = a.add(&a)?;
    let first: Vec<f32> = sum.to_vec()?;
    mark(&format!("first add (x + x)[1] = {}", first[1]));
    let product = a.matmul(&a)?;
    let first: Vec<f32> = product.to_vec()?;
    mark(&format!("first matmul (x @ x)[0] = {:.4}", first[0]));
    let probs = product.softmax(-1)?;
    let first: Vec<f32> = probs.to_vec()?;
    mark(&format!("first softmax [0] = {:.5}", first[0]));
    let total = probs.sum_all()?.item::<f32>()?;
    mark(&format!("first sum = {total:.3} (64 rows of 1)"));
    Ok(())
}
