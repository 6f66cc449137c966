//! Is CUDA available, how many GPUs, and what are they? The first lines of every PyTorch CUDA
//! tutorial (`torch.cuda.is_available()`, `device_count()`, `get_device_properties(i)`), plus
//! the device-agnostic idiom `device = cuda if available else cpu`.
//!
//! Run with `cargo run --release -p ember --example cuda_device_info`.

use ember::cuda;
use ember::prelude::*;

fn main() -> ember::Result<()> {
    println!("CUDA available: {}", cuda::is_available());
    println!("device count:   {}", cuda::device_count());
    if let Some(v) = cuda::driver_version() {
        println!("driver supports CUDA {}.{}", v / 1000, (v % 1000) / 10);
    }
    for i in 0..cuda::device_count() {
        let p = cuda::get_device_properties(i)?;
        println!(
            "cuda:{i}: {} (compute capability {}.{}), {:.1} GiB, {} SMs, {} KiB L2",
            p.name,
            p.major,
            p.minor,
            p.total_memory as f64 / (1u64 << 30) as f64,
            p.multi_processor_count,
            p.l2_cache_size / 1024
        );
    }
    println!("kernels are compiled for: {:?}", cuda::get_arch_list());

    // Device-agnostic code: pick the device once, write the rest without caring.
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    let x = Tensor::randn([3, 4], DType::F32, device)?;
    println!("a tensor on {}:\n{}", x.device(), x.relu()?);
    Ok(())
}
