//! Work on a side stream overlapping the default stream, ordered with `wait_stream`, as in
//! PyTorch's CUDA semantics notes: `with torch.cuda.stream(s): ...; torch.cuda.current_stream().wait_stream(s)`.
//!
//! Run with `cargo run --release -p ember --example cuda_streams`.

use ember::cuda;
use ember::prelude::*;

fn main() -> ember::Result<()> {
    if !cuda::is_available() {
        println!("no CUDA device: streams are a GPU feature");
        return Ok(());
    }
    let dev = Device::cuda();
    let main = cuda::current_stream()?;
    let side = cuda::Stream::new()?;
    let a = Tensor::randn([4096, 4096], DType::F32, dev)?;
    let b = Tensor::randn([4096, 4096], DType::F32, dev)?;

    // The side stream must see `a` and `b` fully written before it reads them.
    side.wait_stream(&main)?;
    let c = {
        let _guard = cuda::stream(&side); // ops below are queued on `side`
        a.matmul(&b)?
    };
    let d = a.add(&b)?; // runs on the default stream at the same time

    // Before the default stream uses `c`, it waits for the side stream's work.
    main.wait_stream(&side)?;
    let e = c.add(&d)?;
    println!("side stream {:#x}, priority {}", side.as_raw(), side.priority());
    println!("e[0, :4] = {:?}", &e.to_vec::<f32>()?[..4]);
    println!("side stream idle: {}", side.query()?);
    Ok(())
}
