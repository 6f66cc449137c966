//! The caching allocator's statistics before and after allocations, what `empty_cache` gives
//! back to the driver, and `memory_summary()`: the `torch.cuda.memory_*` tutorial.
//!
//! Run with `cargo run --release -p ember --example cuda_memory_stats`.

use ember::cuda;
use ember::prelude::*;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn report(label: &str) {
    println!(
        "{label:<28} allocated {:>8.1} MiB   reserved {:>8.1} MiB   peak allocated {:>8.1} MiB",
        mib(cuda::memory_allocated()),
        mib(cuda::memory_reserved()),
        mib(cuda::max_memory_allocated())
    );
}

fn main() -> ember::Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: the allocator statistics are a GPU feature (they read 0 here)");
        return Ok(());
    }
    let dev = Device::cuda();
    report("start");
    let a = Tensor::zeros([1024, 1024], DType::F32, dev)?; // 4 MiB
    report("after a 4 MiB tensor");
    let b = Tensor::zeros([64, 1024, 1024], DType::F32, dev)?; // 256 MiB
    report("after a 256 MiB tensor");
    drop(b);
    report("after dropping it (cached)");
    cuda::empty_cache()?;
    report("after empty_cache()");
    cuda::reset_peak_memory_stats();
    report("after reset_peak_memory_stats");
    let stats = cuda::memory_stats();
    println!(
        "num_device_alloc = {}, num_device_free = {}, allocation.all.current = {}",
        stats["num_device_alloc"], stats["num_device_free"], stats["allocation.all.current"]
    );
    let (free, total) = cuda::mem_get_info()?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!("device: {:.1} GiB free of {:.1} GiB", gib(free), gib(total));
    println!("{}", cuda::memory_summary());
    drop(a);
    Ok(())
}
