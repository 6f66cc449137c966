//! PyTorch's profiler recipe ("PyTorch Profiler"): profile a model's forward pass, print
//! `key_averages().table(sort_by="cpu_time_total", row_limit=10)`, group by input shapes,
//! look at memory, export a chrome trace (open it in `chrome://tracing` or Perfetto), and
//! profile a few training steps on a schedule with a trace handler; on a GPU, NVTX ranges and
//! a memory snapshot for PyTorch's memory visualizer (the "Understanding CUDA Memory Usage"
//! recipe).
//!
//! The model is the CIFAR-10 `Net` of the classifier tutorial on a batch of 5 images (the
//! recipe profiles a ResNet-18 on 5 × 3 × 224 × 224), on the GPU when there is one (then the
//! tables add CUDA columns, timed by CUDA events: Note [Profiler timing and attribution]).
//!
//! Run: `cargo run --release -p ember --example profiling`

use ember::cuda;
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Conv2d, CrossEntropyLoss, Linear, MaxPool2d};
use ember::prelude::*;
use ember::profiler::{self, ProfilerActivity};

#[derive(Module)]
struct Net {
    conv1: Conv2d,
    pool: MaxPool2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Net {
    fn new(device: Device) -> Result<Net> {
        Ok(Net {
            conv1: Conv2d::new(3, 6, 5, device)?,
            pool: MaxPool2d::new(2),
            conv2: Conv2d::new(6, 16, 5, device)?,
            fc1: Linear::new(16 * 5 * 5, 120, device)?,
            fc2: Linear::new(120, 84, device)?,
            fc3: Linear::new(84, 10, device)?,
        })
    }
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.pool.forward(&self.conv1.forward(x)?.relu()?)?;
        let x = self.pool.forward(&self.conv2.forward(&x)?.relu()?)?;
        let x = x.flatten(1, -1)?;
        let x = self.fc1.forward(&x)?.relu()?;
        let x = self.fc2.forward(&x)?.relu()?;
        self.fc3.forward(&x)
    }
}

fn main() -> Result<()> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    let mut activities = vec![ProfilerActivity::Cpu];
    if device.is_cuda() {
        activities.push(ProfilerActivity::Cuda);
    }
    ember::manual_seed(0)?;
    let model = Net::new(device)?;
    let inputs = Tensor::randn([5, 3, 32, 32], DType::F32, device)?;
    model.forward(&inputs)?; // warm-up (kernel compilation, library plans)

    // 1. Execution time.
    let mut prof = profiler::profile().activities(activities.clone()).record_shapes(true).start()?;
    {
        let _r = profiler::record_function("model_inference");
        model.forward(&inputs)?;
    }
    prof.stop()?;
    let sort = if device.is_cuda() { "cuda_time_total" } else { "cpu_time_total" };
    println!("{}", prof.key_averages().table(sort, 10)?);
    println!("{}", prof.key_averages_by_input_shape().table(sort, 10)?);

    // 2. Memory: bytes of the tensors each op makes (and frees).
    let mut prof = profiler::profile()
        .activities(activities.clone())
        .profile_memory(true)
        .record_shapes(true)
        .start()?;
    model.forward(&inputs)?;
    prof.stop()?;
    println!("{}", prof.key_averages().table("self_cpu_memory_usage", 10)?);

    // 3. A chrome trace.
    let path = std::env::temp_dir().join("ember_profiling_trace.json");
    let mut prof = profiler::profile().activities(activities.clone()).start()?;
    model.forward(&inputs)?;
    prof.stop()?;
    prof.export_chrome_trace(&path)?;
    println!("chrome trace written to {} (open it in chrome://tracing or ui.perfetto.dev)\n", path.display());

    // 4. Long-running jobs: a schedule (skip 1 step, warm up 1, record 2), and a handler called
    // with each recorded cycle (here printing its table; `profiler::tensorboard_trace_handler(dir)`
    // writes trace files TensorBoard reads).
    let criterion = CrossEntropyLoss::new();
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 0.01, ..Default::default() })?;
    let labels = Tensor::randint(0, 10, [5], device)?;
    let mut prof = profiler::profile()
        .activities(activities)
        .schedule(profiler::schedule(1, 1, 2, 1))
        .on_trace_ready(move |trace| {
            let table = trace.key_averages().table(sort, 10).unwrap_or_else(|e| e.to_string());
            println!("cycle ending at step {}:\n{table}", trace.step_num());
        })
        .start()?;
    let mut train_step = || -> Result<()> {
        optimizer.zero_grad()?;
        let loss = criterion.forward(&model.forward(&inputs)?, &labels)?;
        loss.backward()?;
        optimizer.step()
    };
    for _ in 0..5 {
        train_step()?;
        prof.step()?;
    }
    prof.stop()?;

    // 5. On a GPU: NVTX ranges around the steps (Nsight Systems shows them; without a tool
    // attached they cost nothing), and the memory-snapshot recipe: record the allocator's
    // history (torch.cuda.memory._record_memory_history), run, dump a snapshot in PyTorch's
    // pickle format (_dump_snapshot) for pytorch.org/memory_viz or `ember memviz`.
    if let Device::Cuda(ordinal) = device {
        cuda::record_memory_history_on(ordinal, true, 100_000)?;
        for step in 0..3 {
            let _range = cuda::nvtx::range(&format!("step {step}"));
            train_step()?;
        }
        let snapshot = std::env::temp_dir().join("ember_memory_snapshot.pickle");
        cuda::dump_snapshot_on(ordinal, &snapshot)?;
        cuda::record_memory_history_on(ordinal, false, 0)?;
        println!(
            "memory snapshot written to {} (open it at pytorch.org/memory_viz, or `ember memviz {} -o memory.html`)",
            snapshot.display(),
            snapshot.display()
        );
    }
    Ok(())
}
