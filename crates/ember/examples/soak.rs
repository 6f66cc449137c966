//! A soak: many training steps fed by a `DataLoader` with worker threads and pinned memory,
//! printing the memory curves as CSV, so that a leak shows as a slope. What it watches:
//! - `reserved`: bytes the CUDA caching allocator holds (`torch.cuda.memory_reserved()`);
//!   after the first steps every block a step needs is cached and this stays flat;
//! - `allocated`: bytes held by live tensors (`torch.cuda.memory_allocated()`) between steps;
//! - `rss`: the process's resident host memory (`VmRSS`), which the loader's workers, the
//!   pinned host cache, the autograd graphs and the kernel cache all draw on;
//! - `host_tensors`: bytes in CPU tensor storages, and the pinned host cache's counters.
//!
//! The loader starts new worker threads every epoch (as PyTorch's without
//! `persistent_workers`), so a run of 10^5 steps (256 batches an epoch) also starts and ends
//! some 390 sets of 4 workers.
//!
//! Run: `cargo run --release -p ember --example soak -- --steps 100000 --every 1000 > soak.csv`
//!
//! Options: `--steps N` (default 100: a check that runs in seconds), `--every K` steps between
//! rows (default 20), `--device cpu|cuda` (default cuda when there is one), `--max-seconds S`
//! (stop early, saying so, when the time is up: the curves up to there are still printed and
//! checked), `--warmup-fraction F` (default 0.1: where the flatness check starts),
//! `--rss-slack-mib M` (default 64). It ends with a summary on stderr and fails (exit status 1)
//! when `reserved` grew after warm-up or the resident memory grew by more than the slack.

use ember::cuda;
use ember::data::{DataLoader, TensorDataset};
use ember::nn::functional as F;
use ember::nn::optim::{Adam, AdamConfig};
use ember::nn::{LayerNorm, Linear};
use ember::prelude::*;
use std::time::Instant;

type Failure = Box<dyn std::error::Error>;

/// A classifier of 64 features into 10 classes.
#[derive(Module)]
struct Net {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
    fc3: Linear,
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> ember::Result<Tensor> {
        let h = self.norm.forward(&self.fc1.forward(x)?)?.gelu()?;
        self.fc3.forward(&self.fc2.forward(&h)?.relu()?)
    }
}

struct Options {
    steps: u64,
    every: u64,
    device: Device,
    max_seconds: f64,
    warmup_fraction: f64,
    rss_slack_mib: f64,
}

fn parse() -> Result<Options, Failure> {
    let mut o = Options {
        steps: 100,
        every: 20,
        device: if cuda::is_available() { Device::cuda() } else { Device::Cpu },
        max_seconds: f64::INFINITY,
        warmup_fraction: 0.1,
        rss_slack_mib: 64.0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!("soak [--steps N] [--every K] [--device cpu|cuda] [--max-seconds S] [--warmup-fraction F] [--rss-slack-mib M]");
            std::process::exit(0);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--steps" => o.steps = value.parse().map_err(|e| bad(&e))?,
            "--every" => o.every = value.parse().map_err(|e| bad(&e))?,
            "--device" => o.device = value.parse().map_err(|e| bad(&e))?,
            "--max-seconds" => o.max_seconds = value.parse().map_err(|e| bad(&e))?,
            "--warmup-fraction" => o.warmup_fraction = value.parse().map_err(|e| bad(&e))?,
            "--rss-slack-mib" => o.rss_slack_mib = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown argument {flag} (try --help)").into()),
        }
    }
    if o.steps == 0 || o.every == 0 {
        return Err("--steps and --every must be at least 1".into());
    }
    if !(0.0..1.0).contains(&o.warmup_fraction) {
        return Err("--warmup-fraction must be in [0, 1)".into());
    }
    Ok(o)
}

/// Resident host memory of this process in bytes (0 where /proc is not there).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// One CSV row of the memory curves.
#[derive(Clone, Copy)]
struct Row {
    step: u64,
    reserved: usize,
    rss: u64,
}

fn main() -> Result<(), Failure> {
    let o = parse()?;
    let device = o.device;
    if let Device::Cuda(i) = device {
        if !cuda::is_available() || i >= cuda::device_count() {
            return Err(format!("{device} is not available on this machine").into());
        }
    }
    ember::manual_seed(0)?;
    // 16384 samples of 64 features; the label is the argmax of a fixed linear map.
    let x = Tensor::randn([16384, 64], DType::F32, Device::Cpu)?;
    let y = x.matmul(&Tensor::randn([64, 10], DType::F32, Device::Cpu)?)?.argmax(Some(1), false)?;
    let loader = DataLoader::builder(TensorDataset::new(vec![x, y])?)
        .batch_size(64)
        .shuffle(true)
        .drop_last(true)
        .num_workers(4)
        .pin_memory(true)
        .build()?;
    let model = Net {
        fc1: Linear::new(64, 256, device)?,
        norm: LayerNorm::new(&[256], device)?,
        fc2: Linear::new(256, 256, device)?,
        fc3: Linear::new(256, 10, device)?,
    };
    let mut opt = Adam::new(model.parameters(), AdamConfig { lr: 1e-3, ..Default::default() })?;
    let memory = |d: Device| match d {
        Device::Cuda(i) => (cuda::memory_reserved_on(i), cuda::memory_allocated_on(i)),
        _ => (0, 0),
    };
    eprintln!(
        "soak: {} steps on {device}, {} batches of 64 an epoch, 4 workers, pinned batches: {}",
        o.steps,
        loader.len(),
        loader.pin_memory()
    );
    println!("step,seconds,loss,allocated,reserved,rss,host_tensors,pinned_cached_bytes,pinned_allocs");
    let start = Instant::now();
    let warmup = (o.steps as f64 * o.warmup_fraction) as u64;
    let mut rows: Vec<Row> = Vec::new();
    let mut step = 0u64;
    let mut stopped_early = false;
    'epochs: loop {
        for batch in &loader {
            let batch = batch?;
            let (xb, yb) = (batch[0].to_non_blocking(device)?, batch[1].to_non_blocking(device)?);
            opt.zero_grad()?;
            let loss = F::cross_entropy(&model.forward(&xb)?, &yb)?;
            loss.backward()?;
            opt.step()?;
            step += 1;
            let last = step == o.steps;
            if step % o.every == 0 || last || step == 1 {
                let loss = loss.item_f64()?; // waits for the step
                drop((xb, yb, batch));
                let (reserved, allocated) = memory(device);
                let rss = rss_bytes();
                let pinned = cuda::host_memory_stats();
                let seconds = start.elapsed().as_secs_f64();
                println!(
                    "{step},{seconds:.3},{loss:.5},{allocated},{reserved},{rss},{},{},{}",
                    ember_core::memory::host_memory_allocated(),
                    pinned.cached_bytes,
                    pinned.num_host_alloc
                );
                rows.push(Row { step, reserved, rss });
                if !last && seconds > o.max_seconds {
                    eprintln!(
                        "soak: stopped after {step} of {} steps: --max-seconds {} is up",
                        o.steps, o.max_seconds
                    );
                    stopped_early = true;
                    break 'epochs;
                }
            }
            if last {
                break 'epochs;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    // The flatness check: from the first row at or after warm-up to the end.
    let after: Vec<Row> = rows.iter().copied().filter(|r| r.step >= warmup.max(1)).collect();
    let first = after.first().copied().unwrap_or(rows[0]);
    let max_reserved = after.iter().map(|r| r.reserved).max().unwrap_or(first.reserved);
    let last = *rows.last().expect("a row at step 1");
    let rss_growth = last.rss as f64 - first.rss as f64;
    let max_rss = after.iter().map(|r| r.rss).max().unwrap_or(first.rss);
    eprintln!(
        "soak: {step} steps in {seconds:.1} s ({:.3} ms a step){}",
        seconds * 1e3 / step as f64,
        if stopped_early { ", stopped early" } else { "" }
    );
    eprintln!(
        "soak: reserved {} B at step {} (after warm-up), {} B at step {}, at most {} B in between",
        first.reserved, first.step, last.reserved, last.step, max_reserved
    );
    eprintln!(
        "soak: rss {:.1} MiB at step {}, {:.1} MiB at step {}, at most {:.1} MiB in between ({:+.1} MiB)",
        first.rss as f64 / 1048576.0,
        first.step,
        last.rss as f64 / 1048576.0,
        last.step,
        max_rss as f64 / 1048576.0,
        rss_growth / 1048576.0
    );
    let mut failed = false;
    if max_reserved > first.reserved {
        eprintln!("soak: FAILED: the allocator's reserved memory grew after warm-up");
        failed = true;
    }
    if rss_growth > o.rss_slack_mib * 1048576.0 {
        eprintln!("soak: FAILED: resident host memory grew by more than {} MiB", o.rss_slack_mib);
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
    eprintln!("soak: flat");
    Ok(())
}
