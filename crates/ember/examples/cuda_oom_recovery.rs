//! Out of memory as a recoverable error: the PyTorch pattern `try: big batch / except
//! torch.cuda.OutOfMemoryError: empty_cache(); smaller batch`. The process goes on.
//!
//! Run with `cargo run --release -p ember --example cuda_oom_recovery`.

use ember::cuda;
use ember::prelude::*;

fn main() -> ember::Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: nothing to run out of");
        return Ok(());
    }
    let (_, total) = cuda::mem_get_info_on(0)?;
    // Try a batch that cannot fit, then halve it until it does.
    let mut batch = 2 * total / (4 * 4096); // rows of 4096 f32: twice the device
    let x = loop {
        match Tensor::zeros([batch, 4096], DType::F32, Device::Cuda(0)) {
            Ok(x) => break x,
            Err(Error::OutOfMemory { requested, free, .. }) => {
                println!(
                    "batch {batch}: out of memory (asked {:.1} GiB, {:.1} GiB free); halving",
                    requested as f64 / (1u64 << 30) as f64,
                    free as f64 / (1u64 << 30) as f64
                );
                cuda::empty_cache()?;
                batch /= 2;
            }
            Err(e) => return Err(e),
        }
    };
    println!(
        "batch {batch} fits: {:?}, {:.1} GiB allocated",
        x.dims(),
        cuda::memory_allocated() as f64 / (1u64 << 30) as f64
    );
    println!("out-of-memory errors so far: {}", cuda::memory_stats()["num_ooms"]);
    Ok(())
}
