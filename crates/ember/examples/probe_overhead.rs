// Temporary probe (not committed): host cost of pieces of the launch path.
use ember::{cuda, DType, Device, Tensor};
use std::time::Instant;

fn time(name: &str, mut f: impl FnMut() -> ember::Result<()>) -> ember::Result<()> {
    let (bursts, per) = (300, 100);
    for _ in 0..per {
        f()?;
    }
    cuda::synchronize(0)?;
    let mut samples = Vec::new();
    for _ in 0..bursts {
        let t0 = Instant::now();
        for _ in 0..per {
            f()?;
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / per as f64);
        cuda::synchronize(0)?;
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "{name:>24}: median {:.3} us, p10 {:.3}",
        samples[bursts / 2],
        samples[bursts / 10]
    );
    Ok(())
}

fn main() -> ember::Result<()> {
    let d = Device::Cuda(0);
    let a = Tensor::randn([1000], DType::F32, d)?;
    let b = Tensor::randn([1000], DType::F32, d)?;
    let out = Tensor::empty([1000], DType::F32, d)?;
    let ev = cuda::Event::new(false);
    for round in 0..2 {
        println!("round {round}");
        time("event record", || ev.record())?;
        time("detach", || {
            std::hint::black_box(a.detach());
            Ok(())
        })?;
        time("full f32 (memset)", || {
            std::hint::black_box(Tensor::full([1000], 1.0, DType::F32, d)?);
            Ok(())
        })?;
        time("full f64 (3-param kernel)", || {
            std::hint::black_box(Tensor::full([1000], 1.0, DType::F64, d)?);
            Ok(())
        })?;
        time("add_out", || a.add_out(&b, &out).map(drop))?;
        time("add", || a.add(&b).map(drop))?;
        time("relu", || a.relu().map(drop))?;
        time("mul_scalar", || a.mul_scalar(2.0).map(drop))?;
    }
    Ok(())
}
