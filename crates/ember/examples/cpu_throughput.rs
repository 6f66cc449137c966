//! CPU throughput of two kernels that bound most workloads: a 1024×1024 f32 matmul (GFLOP/s)
//! and an elementwise add of 2^24 f32 elements (GB/s, counting 12 bytes per element: two
//! reads and one write). Run with `cargo run --release -p ember --example cpu_throughput`; a
//! debug build runs smaller sizes, only to check that it works.

use ember::prelude::*;
use std::time::Instant;

/// Median seconds per call of `f` over `reps` timed calls, after one warm-up call.
fn time(reps: usize, mut f: impl FnMut() -> ember::Result<()>) -> ember::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

fn main() -> ember::Result<()> {
    ember::manual_seed(0)?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("cpu threads: {threads}");
    let (n, len, reps) = if cfg!(debug_assertions) {
        println!("a debug build: the figures mean nothing, run with --release");
        (256, 1usize << 20, 2)
    } else {
        (1024, 1usize << 24, 10)
    };

    let a = Tensor::randn([n, n], DType::F32, Device::Cpu)?;
    let b = Tensor::randn([n, n], DType::F32, Device::Cpu)?;
    let s = time(reps, || a.matmul(&b).map(drop))?;
    let flops = 2.0 * (n as f64).powi(3);
    println!("matmul f32 {n}x{n}: {:.2} ms, {:.1} GFLOP/s", s * 1e3, flops / s / 1e9);

    let x = Tensor::randn([len], DType::F32, Device::Cpu)?;
    let y = Tensor::randn([len], DType::F32, Device::Cpu)?;
    let s = time(reps, || x.add(&y).map(drop))?;
    println!("add f32 {len}: {:.2} ms, {:.1} GB/s", s * 1e3, 12.0 * len as f64 / s / 1e9);
    Ok(())
}
