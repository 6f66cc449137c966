//! Timing GPU work with events, as `torch.cuda.Event(enable_timing=True)`: record, run,
//! record, synchronize, `elapsed_time`. Host timers would measure only the launches.
//!
//! Run with `cargo run --release -p ember --example cuda_event_timing`.

use ember::cuda::{self, Event};
use ember::prelude::*;

fn main() -> ember::Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: events time GPU work");
        return Ok(());
    }
    let dev = Device::cuda();
    for &(n, dtype) in &[(4096usize, DType::F32), (4096, DType::BF16), (8192, DType::BF16)] {
        let a = Tensor::randn([n, n], dtype, dev)?;
        let b = Tensor::randn([n, n], dtype, dev)?;
        a.matmul(&b)?; // warm-up: kernel selection, workspace
        let (start, end) = (Event::new(true), Event::new(true));
        let reps = 10;
        start.record()?;
        for _ in 0..reps {
            a.matmul(&b)?;
        }
        end.record()?;
        end.synchronize()?;
        let ms = start.elapsed_time(&end)? as f64 / reps as f64;
        let tflops = 2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12;
        println!("{n}x{n} {dtype} matmul: {ms:.3} ms, {tflops:.1} TFLOP/s");
    }
    Ok(())
}
