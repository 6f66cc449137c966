//! `ember bench`: the shared benchmark workloads (`shared/bench/WORKLOADS.md`) as JSON lines,
//! timed by the same rule as PyTorch's reference script so the two compare line by line.

use crate::models;
use ember::amp::{GradScaler, GradScalerConfig};
use ember::nn::optim::{Adam, AdamConfig, Optimizer};
use ember::nn::{CrossEntropyLoss, Forward, ModuleExt};
use ember::profiler::ProfilerActivity;
use ember::{cuda, DType, Device, Result, Tensor};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// `--profile DIR`: where the workload being timed writes its profile (`DIR/NAME.txt` and
/// `DIR/NAME.json`), and what it records (`--profile-activities`; empty: the default); None
/// without the flag. Set by [`bench`] around each workload.
static PROFILE_TO: Mutex<Option<(PathBuf, String, Vec<ProfilerActivity>)>> = Mutex::new(None);

/// Steps profiled after the timed ones.
const PROFILED_STEPS: usize = 3;

/// Every workload, in the reference script's order; those not built yet report an error line.
pub const WORKLOADS: [&str; 25] = [
    "mlp_small",
    "mlp_large",
    "cnn",
    "lstm",
    "mlp_large_amp_bf16",
    "mlp_large_amp_fp16",
    "mlp_small_graph",
    "cnn_graph",
    "gpt2_124m_bf16",
    "gpt2_124m_bf16_graph",
    "sdpa_causal_bf16",
    "layernorm_bf16",
    "cross_entropy_50304",
    "matmul_bf16_8192",
    "add_f32_256M",
    "h2d_pinned_1GiB",
    "op_overhead_add",
    "mlp_large_tf32",
    "gpt2_124m_bf16_compiled",
    "ddp_mlp_large",
    "ddp_cnn",
    "dp_mlp_large",
    "dp_cnn",
    "ddp_gpt2",
    "fsdp_gpt2",
];

/// Reference points run only when named: not workloads to match.
const REFERENCE_ONLY: [&str; 2] = ["mlp_large_tf32", "gpt2_124m_bf16_compiled"];

/// Workloads run only when named: the reference points and the multi-GPU workloads
/// (`torch_ddp_reference.py`'s: `ddp_*` run under a launcher, `ember-run --standalone
/// --nproc-per-node N ember bench --only ddp_cnn`, and only rank 0 prints; `dp_*` drive every
/// visible GPU).
fn only_when_named(name: &str) -> bool {
    REFERENCE_ONLY.contains(&name)
        || name.starts_with("ddp_")
        || name.starts_with("dp_")
        || name.starts_with("fsdp_")
}

/// `--comm-hook`: the DDP communication hook the `ddp_*` workloads register, a built-in one
/// (`register_builtin_comm_hook`, the functions of `ember_distributed::default_hooks`, which
/// DDP may call on a large weight's row blocks), named in their JSON line as `comm_hook`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CommHook {
    /// `allreduce_hook`: DDP's average, by a hook.
    Allreduce,
    /// `fp16_compress_hook`: the gradients all-reduced in float16.
    Fp16,
    /// `bf16_compress_hook`: the gradients all-reduced in bfloat16.
    Bf16,
}

impl CommHook {
    /// The flag's value, as the JSON line names it.
    pub fn name(self) -> &'static str {
        match self {
            CommHook::Allreduce => "allreduce",
            CommHook::Fp16 => "fp16",
            CommHook::Bf16 => "bf16",
        }
    }

    /// Registers the hook on `ddp`, before its first forward.
    fn register<M: ember::nn::Module>(
        self,
        ddp: &ember::distributed::DistributedDataParallel<M>,
    ) -> Result<()> {
        use ember::distributed::BuiltinCommHookType as Hook;
        ddp.register_builtin_comm_hook(match self {
            CommHook::Allreduce => Hook::Allreduce,
            CommHook::Fp16 => Hook::Fp16Compress,
            CommHook::Bf16 => Hook::Bf16Compress,
        })
    }
}

/// Timing figures of one workload: median, min and max ms per step, and peak MiB on a GPU.
struct Timing {
    median: f64,
    min: f64,
    max: f64,
    peak_mb: Option<f64>,
}

fn sync(device: Device) -> Result<()> {
    if let Device::Cuda(i) = device {
        cuda::synchronize_on(i)?;
    }
    Ok(())
}

/// The reference's `time_steps`: warm up, synchronize, reset the peak, then the median over
/// `repeats` of the mean time of `steps` consecutive calls.
fn time_steps(
    device: Device,
    warmup: usize,
    steps: usize,
    repeats: usize,
    mut step: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    for _ in 0..warmup {
        step()?;
    }
    sync(device)?;
    if let Device::Cuda(i) = device {
        cuda::reset_peak_memory_stats_on(i);
    }
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        sync(device)?;
        let t0 = Instant::now();
        for _ in 0..steps {
            step()?;
        }
        sync(device)?;
        samples.push(t0.elapsed().as_secs_f64() * 1000.0 / steps as f64);
    }
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    let peak_mb = match device {
        Device::Cuda(i) => Some(cuda::max_memory_allocated_on(i) as f64 / (1u64 << 20) as f64),
        Device::Cpu => None,
    };
    let target = PROFILE_TO.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some((dir, name, activities)) = target {
        profile_steps(device, &dir, &name, &activities, &mut step)?;
    }
    Ok(Timing {
        median,
        min: sorted[0],
        max: sorted[sorted.len() - 1],
        peak_mb,
    })
}

/// Runs [`PROFILED_STEPS`] steps under the profiler, recording `activities` (none given: the
/// CPU, and CUDA on a GPU), and writes `dir/name.txt` (the op table, sorted by self CPU time:
/// where the host's time goes) and `dir/name.json` (the trace).
fn profile_steps(
    device: Device,
    dir: &Path,
    name: &str,
    activities: &[ProfilerActivity],
    step: &mut impl FnMut() -> Result<()>,
) -> Result<()> {
    use ember::profiler;
    let mut activities = activities.to_vec();
    if activities.is_empty() {
        activities.push(ProfilerActivity::Cpu);
        if device.is_cuda() {
            activities.push(ProfilerActivity::Cuda);
        }
    }
    let mut prof = profiler::profile().activities(activities).start()?;
    for _ in 0..PROFILED_STEPS {
        let _step = profiler::record_function("bench_step");
        step()?;
    }
    prof.stop()?;
    let Some(trace) = prof.trace() else {
        return Ok(());
    };
    let io = |path: PathBuf| {
        move |e: std::io::Error| ember::Error::Io {
            kind: e.kind(),
            msg: format!("--profile: cannot write {}: {e}", path.display()),
        }
    };
    let table = dir.join(format!("{name}.txt"));
    std::fs::write(
        &table,
        trace.key_averages().table("self_cpu_time_total", 40)? + "\n",
    )
    .map_err(io(table.clone()))?;
    trace.export_chrome_trace(dir.join(format!("{name}.json")))
}

fn row(name: &str, t: &Timing, per: f64, extra: Value) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("workload".into(), json!(name));
    m.insert("ms_per_step".into(), json!(t.median / per));
    m.insert("ms_min".into(), json!(t.min / per));
    m.insert("ms_max".into(), json!(t.max / per));
    m.insert("peak_mem_mb".into(), json!(t.peak_mb));
    if let Value::Object(extra) = extra {
        m.extend(extra);
    }
    m
}

/// Mixed precision of a training workload: autocast to `dtype`, with a GradScaler or not.
#[derive(Clone, Copy)]
struct Amp {
    dtype: DType,
    scaler: bool,
}

/// The state of the reference's `run_classifier` before timing: seed 0, the model, then
/// `x = randn(shape)` and `y = randint(0, classes)` once, Adam (lr 1e-3), mean cross-entropy
/// and, under `amp` with a scaler, a GradScaler. The eager and the graphed workloads share it.
struct Classifier {
    device: Device,
    model: Box<dyn Forward>,
    x: Tensor,
    y: Tensor,
    opt: Adam,
    scaler: GradScaler,
    loss_fn: CrossEntropyLoss,
    amp: Option<Amp>,
    batch: usize,
    /// Processes whose batches one step trains on (DDP's world size; 1 otherwise).
    world: usize,
}

impl Classifier {
    fn new(
        device: Device,
        build: impl FnOnce(Device) -> Result<Box<dyn Forward>>,
        shape: &[usize],
        classes: i64,
        amp: Option<Amp>,
    ) -> Result<Classifier> {
        ember::manual_seed(0)?;
        let model = build(device)?;
        let x = Tensor::randn(shape, DType::F32, device)?;
        let y = Tensor::randint(0, classes, [shape[0]], device)?;
        let opt = Adam::new(model.parameters(), AdamConfig::default())?;
        let scaler = GradScaler::with_config(GradScalerConfig {
            enabled: amp.is_some_and(|a| a.scaler),
            ..Default::default()
        })?;
        Ok(Classifier {
            device,
            model,
            x,
            y,
            opt,
            scaler,
            loss_fn: CrossEntropyLoss::new(),
            amp,
            batch: shape[0],
            world: 1,
        })
    }

    /// Forward and mean cross-entropy (under autocast with `amp`), backward, Adam step
    /// (through the GradScaler's scale/step/update when `amp` has one), on gradients released
    /// before: the part of a step that a CUDA graph captures.
    fn forward_backward_step(&mut self) -> Result<()> {
        let loss = {
            let _autocast = self
                .amp
                .map(|a| ember::amp::autocast(self.device.device_type(), a.dtype))
                .transpose()?;
            self.loss_fn.forward(&self.model.forward(&self.x)?, &self.y)?
        };
        self.scaler.scale(&loss)?.backward()?;
        self.scaler.step(&mut self.opt)?;
        self.scaler.update()
    }

    /// One eager step: `zero_grad` (set to none), then [`Classifier::forward_backward_step`].
    fn step(&mut self) -> Result<()> {
        self.opt.zero_grad()?;
        self.forward_backward_step()
    }

    /// Steps per timed repeat: 50 on a GPU, 20 on the CPU.
    fn steps(&self) -> usize {
        if self.device == Device::Cpu {
            20
        } else {
            50
        }
    }

    fn row(&self, name: &str, t: &Timing) -> Map<String, Value> {
        let samples = self.batch as f64 * self.world as f64 * 1000.0 / t.median;
        let mut r = row(name, t, 1.0, json!({ "samples_per_s": samples }));
        if name.starts_with("dp_") || name.starts_with("ddp_") {
            r.insert("world_size".into(), json!(self.world));
        }
        r
    }

    /// The reference's `run_classifier` without a graph: each timed step is [`Classifier::step`].
    fn run_eager(mut self, name: &str) -> Result<Map<String, Value>> {
        let (device, steps) = (self.device, self.steps());
        let t = time_steps(device, 10, steps, 5, || self.step())?;
        Ok(self.row(name, &t))
    }

    /// The reference's `run_classifier(..., graph=True)`: 3 eager steps on a side stream (Adam's
    /// state, kernel modules and library workspaces exist before the capture), the current
    /// stream waits for it, the gradients are released (so the captured backward makes them in
    /// the graph's pool, where they stay, held by the parameters, for every replay), then
    /// forward, loss, backward and Adam step are captured into a CUDA graph; each timed step is
    /// one replay. Adam reads its lr and step counts from the device (Note [Learning rate on the
    /// device] of `ember_nn::optim`), so replays train as eager steps would.
    fn run_graphed(mut self, name: &str) -> Result<Map<String, Value>> {
        let Device::Cuda(i) = self.device else {
            return Err(ember::Error::invalid(
                "ember bench",
                format!("{name}: CUDA graphs need a CUDA device"),
            ));
        };
        let _device = cuda::DeviceGuard::new(i)?;
        let side = cuda::Stream::new_on(i)?;
        side.wait_stream(&cuda::current_stream_on(i)?)?;
        {
            let _side = cuda::stream(&side);
            for _ in 0..3 {
                self.step()?;
            }
        }
        cuda::current_stream_on(i)?.wait_stream(&side)?;
        let mut g = cuda::CUDAGraph::new();
        self.opt.zero_grad()?;
        let capture = cuda::graph(&mut g)?;
        let captured = self.forward_backward_step();
        // The capture ends before an error of the region is returned; the region's own error
        // says more than the capture's.
        let ended = capture.end();
        captured?;
        ended?;
        let t = time_steps(self.device, 10, self.steps(), 5, || g.replay())?;
        Ok(self.row(name, &t))
    }
}

/// `mlp_small`, `mlp_large`, `cnn`, `lstm`, `mlp_large_amp_{bf16,fp16}` or, captured in a CUDA
/// graph, `mlp_small_graph` and `cnn_graph` (WORKLOADS.md's training table).
fn training(name: &str, device: Device) -> Result<Map<String, Value>> {
    fn boxed<M: Forward + 'static>(m: Result<M>) -> Result<Box<dyn Forward>> {
        Ok(Box::new(m?))
    }
    let amp = match name {
        "mlp_large_amp_bf16" => Some(Amp {
            dtype: DType::BF16,
            scaler: false,
        }),
        "mlp_large_amp_fp16" => Some(Amp {
            dtype: DType::F16,
            scaler: true,
        }),
        _ => None,
    };
    let classifier = match name {
        "mlp_small" | "mlp_small_graph" => Classifier::new(
            device,
            |d| boxed(models::mlp(&[2000, 1000, 100], false, d)),
            &[128, 2000],
            100,
            amp,
        ),
        "mlp_large" | "mlp_large_amp_bf16" | "mlp_large_amp_fp16" => Classifier::new(
            device,
            |d| boxed(models::mlp(&[10000, 5000, 2000, 10], false, d)),
            &[256, 10000],
            10,
            amp,
        ),
        "cnn" | "cnn_graph" => Classifier::new(
            device,
            |d| boxed(models::Cnn::new(3, 16, 32, d)),
            &[256, 3, 28, 28],
            10,
            amp,
        ),
        _ => Classifier::new(
            device,
            |d| boxed(models::LstmClassifier::new(256, 512, 2, 10, d)),
            &[64, 128, 256],
            10,
            amp,
        ),
    }?;
    if name.ends_with("_graph") {
        classifier.run_graphed(name)
    } else {
        classifier.run_eager(name)
    }
}

/// A process of a launched job (`ember-run`, `torchrun`): its world size and the ordinal of
/// its GPU (`cuda:LOCAL_RANK`), after joining the default process group over NCCL (once per
/// process); an error saying how to launch it outside such a job.
fn join_launched_job(name: &str) -> Result<(usize, usize)> {
    use ember::distributed::{self as dist, BackendKind, InitOptions};
    let world = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse::<usize>().ok());
    let Some(world) = world else {
        return Err(ember::Error::invalid(
            "ember bench",
            format!("{name} runs in a launched job: ember-run --standalone --nproc-per-node N ember bench --only {name}"),
        ));
    };
    let local = launched_local_rank().unwrap_or(0);
    if !dist::is_initialized() {
        dist::init_process_group(InitOptions::new(BackendKind::Nccl))?;
    }
    Ok((world, local))
}

/// The multi-GPU workloads (`torch_ddp_reference.py`): `ddp_*` wraps the model in
/// DistributedDataParallel in a process of a launched job (NCCL, `cuda:LOCAL_RANK`, 256
/// samples per GPU; samples_per_s counts every rank's), `dp_*` in DataParallel over every
/// visible GPU in this process (256 × GPUs samples per step). `comm_hook`: the communication
/// hook `ddp_*` registers (`--comm-hook`), named in the line.
fn multi_gpu(name: &str, comm_hook: Option<CommHook>) -> Result<Map<String, Value>> {
    use ember::distributed::{DdpOptions, DistributedDataParallel};
    use ember::nn::DataParallel;
    let cnn = name.ends_with("_cnn");
    let build = move |d: Device| -> Result<Box<dyn Forward>> {
        Ok(if cnn {
            Box::new(models::Cnn::new(3, 16, 32, d)?)
        } else {
            Box::new(models::LinearStack::new(&[10000, 5000, 2000, 10], d)?)
        })
    };
    let per_gpu: Vec<usize> = if cnn {
        vec![256, 3, 28, 28]
    } else {
        vec![256, 10000]
    };
    if name.starts_with("dp_") {
        let gpus = cuda::device_count();
        let mut shape = per_gpu.clone();
        shape[0] *= gpus.max(1);
        let devices: Vec<Device> = (0..gpus).map(Device::Cuda).collect();
        let wrap = move |d: Device| -> Result<Box<dyn Forward>> {
            Ok(if cnn {
                Box::new(DataParallel::with_devices(
                    models::Cnn::new(3, 16, 32, d)?,
                    devices,
                )?)
            } else {
                Box::new(DataParallel::with_devices(
                    models::LinearStack::new(&[10000, 5000, 2000, 10], d)?,
                    devices,
                )?)
            })
        };
        let mut c = Classifier::new(Device::Cuda(0), wrap, &shape, 10, None)?;
        // samples_per_s: the whole batch of every GPU; world_size: the GPUs.
        c.batch = per_gpu[0];
        c.world = gpus.max(1);
        return c.run_eager(name);
    }
    let (world, local) = join_launched_job(name)?;
    let device = Device::Cuda(local);
    let _guard = cuda::DeviceGuard::new(local)?;
    let wrap = move |d: Device| -> Result<Box<dyn Forward>> {
        let ddp = DistributedDataParallel::new(build(d)?, DdpOptions::new())?;
        if let Some(hook) = comm_hook {
            hook.register(&ddp)?;
        }
        Ok(Box::new(ddp))
    };
    let mut c = Classifier::new(device, wrap, &per_gpu, 10, None)?;
    c.world = world;
    let mut line = c.run_eager(name)?;
    if let Some(hook) = comm_hook {
        line.insert("comm_hook".into(), json!(hook.name()));
    }
    Ok(line)
}

/// `gpt2_124m_bf16` (the reference's `run_gpt`): GPT-2 124M ([`models::Gpt`]) on tokens and
/// targets `[8, 1024]` drawn once, AdamW (lr 3e-4, weight decay 0.1), each step zero_grad,
/// forward under bfloat16 autocast, mean cross-entropy of the logits, backward and step.
/// The loss takes the bfloat16 logits as they are: cross-entropy runs in float32 under
/// autocast (PyTorch's policy), where the reference converts them with `.float()` first.
/// `gpt2_124m_bf16_graph` captures forward, backward and step into one CUDA graph, as
/// [`Classifier::run_graphed`] does, and times its replays (ember's own: the reference has no
/// graphed GPT-2). GEMM algorithms are chosen by timing ([`cuda::tunable`], Note [Timed GEMM
/// algorithms]; off by default, and in the reference's run), which the row reports as
/// `gemm_tuning`.
fn gpt2(device: Device, graphed: bool) -> Result<Map<String, Value>> {
    use ember::nn::functional as F;
    use ember::nn::optim::AdamW;
    let (batch, seq, vocab) = (8usize, 1024usize, 50304usize);
    // EMBER_GEMM_TUNING=0 measures the heuristic's first choices instead.
    let tuning = std::env::var("EMBER_GEMM_TUNING").as_deref() != Ok("0");
    cuda::tunable::enable(tuning);
    ember::manual_seed(0)?;
    let model = models::Gpt::new(vocab, seq, 768, 12, 12, device)?;
    let config = AdamConfig {
        lr: 3e-4,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = AdamW::new(model.parameters(), config)?;
    let idx = Tensor::randint(0, 50257, [batch, seq], device)?;
    let tgt = Tensor::randint(0, 50257, [batch * seq], device)?;
    let forward_backward_step = |opt: &mut AdamW| -> Result<()> {
        let loss = {
            let _autocast = ember::amp::autocast(device.device_type(), DType::BF16)?;
            let logits = model.forward(&idx)?;
            F::cross_entropy(&logits.view([-1, vocab as isize])?, &tgt)?
        };
        loss.backward()?;
        opt.step()
    };
    let step = |opt: &mut AdamW| -> Result<()> {
        opt.zero_grad()?;
        forward_backward_step(opt)
    };
    let name = if graphed {
        "gpt2_124m_bf16_graph"
    } else {
        "gpt2_124m_bf16"
    };
    let t = if graphed {
        let Device::Cuda(i) = device else {
            return Err(ember::Error::invalid(
                "ember bench",
                "CUDA graphs need a CUDA device",
            ));
        };
        let _device = cuda::DeviceGuard::new(i)?;
        let side = cuda::Stream::new_on(i)?;
        side.wait_stream(&cuda::current_stream_on(i)?)?;
        {
            let _side = cuda::stream(&side);
            for _ in 0..3 {
                step(&mut opt)?;
            }
        }
        cuda::current_stream_on(i)?.wait_stream(&side)?;
        let mut g = cuda::CUDAGraph::new();
        opt.zero_grad()?;
        let capture = cuda::graph(&mut g)?;
        let captured = forward_backward_step(&mut opt);
        let ended = capture.end();
        captured?;
        ended?;
        time_steps(device, 3, 10, 5, || g.replay())?
    } else {
        time_steps(device, 3, 10, 5, || step(&mut opt))?
    };
    // Host waits inside an eager step (none expected): counted over 5 more steps. A graph's
    // replays never wait.
    let before = cuda::host_sync_count();
    if !graphed {
        for _ in 0..5 {
            step(&mut opt)?;
        }
    }
    let host_syncs = (cuda::host_sync_count() - before) as f64 / 5.0;
    cuda::tunable::enable(false);
    let tokens = (batch * seq) as f64 * 1000.0 / t.median;
    Ok(row(
        name,
        &t,
        1.0,
        json!({ "tokens_per_s": tokens, "gemm_tuning": tuning, "host_syncs_per_step": host_syncs }),
    ))
}

/// `ddp_gpt2` and `fsdp_gpt2` (the reference's `run_gpt` of `torch_ddp_reference.py`): the
/// model of `gpt2_124m_bf16` ([`models::Gpt`], seed 0) per GPU in a launched job, tokens and
/// targets `[8, 1024]` drawn once after it, AdamW (lr 3e-4, weight decay 0.1), each step
/// zero_grad, forward, mean cross-entropy, backward and step; tokens_per_s counts every rank's.
/// - `ddp_gpt2`: DistributedDataParallel, the forward under bfloat16 autocast (as
///   [`gpt2`]).
/// - `fsdp_gpt2`: `fully_shard` on every block, then on the whole model (FSDP2's recipe,
///   default `reshard_after_forward`), `MixedPrecisionPolicy(param_dtype=bf16,
///   reduce_dtype=f32)`, no autocast: the parameters arrive in bfloat16. The reference takes
///   the loss of `logits.float()`; ember takes it of the bfloat16 logits under autocast (fp32
///   inside the fused kernel, the same loss as in [`gpt2`]).
///
/// Besides the reference's fields: `state_mem_mb`, this rank's GPU memory of the parameters
/// the optimizer steps, their gradients and the optimizer's state after the timed steps, and
/// `state_mem_mb_unsharded`, that of one whole copy (for `fsdp_gpt2` the ranks' figures
/// summed, as the shards partition the parameters; for `ddp_gpt2` this rank's own), whose
/// ratio shows FSDP's ≈ 1/N. `comm_hook`: the hook `ddp_gpt2` registers (`--comm-hook`).
fn gpt2_distributed(name: &str, comm_hook: Option<CommHook>) -> Result<Map<String, Value>> {
    use ember::distributed::{
        self as dist, fully_shard, DdpOptions, DeviceMesh, DistributedDataParallel, FullyShardOptions,
        MixedPrecisionPolicy, ReduceOp,
    };
    use ember::nn::functional as F;
    use ember::nn::optim::AdamW;
    let (world, local) = join_launched_job(name)?;
    let device = Device::Cuda(local);
    let _guard = cuda::DeviceGuard::new(local)?;
    let (batch, seq, vocab) = (8usize, 1024usize, 50304usize);
    let fsdp = name == "fsdp_gpt2";
    // As gpt2_124m_bf16, whose figure is the N=1 point of the scaling efficiency.
    let tuning = std::env::var("EMBER_GEMM_TUNING").as_deref() != Ok("0");
    cuda::tunable::enable(tuning);
    ember::manual_seed(0)?;
    let model: Box<dyn Forward> = if fsdp {
        let mesh = DeviceMesh::new(dist::default_group()?);
        let options = FullyShardOptions {
            mp_policy: MixedPrecisionPolicy {
                param_dtype: Some(DType::BF16),
                reduce_dtype: Some(DType::F32),
            },
            ..Default::default()
        };
        // Each block sharded as soon as it is drawn (the same weights as Gpt::new), then the root.
        let gpt = models::Gpt::new_with(vocab, seq, 768, 12, 12, device, |b| {
            fully_shard(b, &mesh, options)
        })?;
        Box::new(fully_shard(gpt, &mesh, options)?)
    } else {
        let gpt = models::Gpt::new(vocab, seq, 768, 12, 12, device)?;
        let ddp = DistributedDataParallel::new(gpt, DdpOptions::new())?;
        if let Some(hook) = comm_hook {
            hook.register(&ddp)?;
        }
        Box::new(ddp)
    };
    let params = model.parameters();
    let config = AdamConfig {
        lr: 3e-4,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = AdamW::new(params.clone(), config)?;
    let idx = Tensor::randint(0, 50257, [batch, seq], device)?;
    let tgt = Tensor::randint(0, 50257, [batch * seq], device)?;
    let mut step = || -> Result<()> {
        opt.zero_grad()?;
        let logits = {
            let _autocast = (!fsdp)
                .then(|| ember::amp::autocast(device.device_type(), DType::BF16))
                .transpose()?;
            model.forward(&idx)?
        };
        let loss = {
            let _autocast = ember::amp::autocast(device.device_type(), DType::BF16)?;
            F::cross_entropy(&logits.view([-1, vocab as isize])?, &tgt)?
        };
        loss.backward()?;
        opt.step()
    };
    let t = time_steps(device, 3, 10, 5, &mut step)?;
    cuda::tunable::enable(false);
    let state = training_state_bytes(&params, &opt) as f64;
    let unsharded = if fsdp {
        let total = Tensor::from_slice(&[state], [1], Device::Cpu)?.to(device)?;
        dist::all_reduce(&total, ReduceOp::Sum)?;
        total.item_f64()?
    } else {
        state
    };
    let mib = (1u64 << 20) as f64;
    let tokens = (batch * seq * world) as f64 * 1000.0 / t.median;
    let mut line = row(
        name,
        &t,
        1.0,
        json!({
            "world_size": world,
            "tokens_per_s": tokens,
            "gemm_tuning": tuning,
            "state_mem_mb": state / mib,
            "state_mem_mb_unsharded": unsharded / mib,
        }),
    );
    if let Some(hook) = comm_hook.filter(|_| !fsdp) {
        line.insert("comm_hook".into(), json!(hook.name()));
    }
    Ok(line)
}

/// Bytes of `params`, of their gradients and of `opt`'s state tensors on a GPU (the step
/// counts AdamW keeps on the host aside): what FSDP and ZeRO shard.
fn training_state_bytes(params: &[Tensor], opt: &impl Optimizer) -> usize {
    let bytes = |t: &Tensor| {
        if t.device().is_cuda() {
            t.numel() * t.dtype().size_in_bytes()
        } else {
            0
        }
    };
    let own: usize = params
        .iter()
        .map(|p| bytes(p) + p.grad().as_ref().map_or(0, bytes))
        .sum();
    own + opt.state_dict().iter().map(|(_, t)| bytes(t)).sum::<usize>()
}

/// `sdpa_causal_bf16` (the reference's `run_sdpa`): causal attention over q, k, v
/// `[8, 12, 1024, 64]` bfloat16, forward and backward from a given output gradient.
fn sdpa_causal(device: Device) -> Result<Map<String, Value>> {
    use ember::nn::functional as F;
    let (b, h, t, d) = (8usize, 12usize, 1024usize, 64usize);
    ember::manual_seed(0)?;
    let draw = || Tensor::randn([b, h, t, d], DType::BF16, device)?.requires_grad_(true);
    let (q, k, v) = (draw()?, draw()?, draw()?);
    let g = Tensor::randn([b, h, t, d], DType::BF16, device)?;
    let options = F::SdpaOptions::new().is_causal(true);
    let timing = time_steps(device, 5, 20, 5, || {
        F::scaled_dot_product_attention_with(&q, &k, &v, options)?.backward_with(Some(&g), false)
    })?;
    // Forward 4·B·H·T²·D halved by the mask; backward 2.5× the forward.
    let flops = 3.5 * 4.0 * (b * h * t * t * d) as f64 / 2.0;
    let tflops = flops / (timing.median * 1e-3) / 1e12;
    Ok(row("sdpa_causal_bf16", &timing, 1.0, json!({ "tflops": tflops })))
}

fn matmul_bf16(device: Device) -> Result<Map<String, Value>> {
    let n = 8192usize;
    let a = Tensor::randn([n, n], DType::BF16, device)?;
    let b = Tensor::randn([n, n], DType::BF16, device)?;
    let t = time_steps(device, 5, 20, 5, || a.matmul(&b).map(drop))?;
    let tflops = 2.0 * (n as f64).powi(3) / (t.median * 1e-3) / 1e12;
    Ok(row("matmul_bf16_8192", &t, 1.0, json!({ "tflops": tflops })))
}

fn add_f32(device: Device) -> Result<Map<String, Value>> {
    let n = 1usize << 28;
    let a = Tensor::randn([n], DType::F32, device)?;
    let b = Tensor::randn([n], DType::F32, device)?;
    let out = Tensor::empty([n], DType::F32, device)?;
    let t = time_steps(device, 5, 20, 5, || a.add_out(&b, &out).map(drop))?;
    let gbs = 12.0 * n as f64 / (t.median * 1e-3) / 1e9;
    Ok(row("add_f32_256M", &t, 1.0, json!({ "gb_per_s": gbs })))
}

fn small_adds(device: Device) -> Result<Map<String, Value>> {
    let (n, ops) = (1000usize, 10_000usize);
    let a = Tensor::randn([n], DType::F32, device)?;
    let b = Tensor::randn([n], DType::F32, device)?;
    let t = time_steps(device, 2, 1, 5, || {
        for _ in 0..ops {
            a.add(&b)?;
        }
        Ok(())
    })?;
    let us = t.median * 1000.0 / ops as f64;
    // The host's share: the time until the last add returns, before waiting for the device.
    // Equal to `us_per_op` when launching is the bottleneck, less when the GPU is.
    sync(device)?;
    let t0 = Instant::now();
    for _ in 0..ops {
        a.add(&b)?;
    }
    let host_us = t0.elapsed().as_secs_f64() * 1e6 / ops as f64;
    sync(device)?;
    // The in-place form beside it (`a.add_(b)`, one kernel writing `a`, no allocation).
    let acc = Tensor::zeros([n], DType::F32, device)?;
    let inplace = time_steps(device, 2, 1, 5, || {
        for _ in 0..ops {
            acc.add_(&b)?;
        }
        Ok(())
    })?;
    let inplace_us = inplace.median * 1000.0 / ops as f64;
    Ok(row(
        "op_overhead_add",
        &t,
        ops as f64,
        json!({ "us_per_op": us, "host_us_per_op": host_us, "inplace_us_per_op": inplace_us }),
    ))
}

fn h2d_pinned(device: Device) -> Result<Map<String, Value>> {
    let n = 1usize << 28;
    let host = Tensor::randn([n], DType::F32, Device::Cpu)?.pin_memory()?;
    let dev = Tensor::empty([n], DType::F32, device)?;
    let t = time_steps(device, 3, 10, 5, || dev.copy_non_blocking_(&host).map(drop))?;
    let gbs = 4.0 * n as f64 / (t.median * 1e-3) / 1e9;
    Ok(row("h2d_pinned_1GiB", &t, 1.0, json!({ "gb_per_s": gbs })))
}

/// The reference's `run_layernorm`: `nn.LayerNorm(768)` in bf16 on x [8192, 768] bf16 that
/// requires grad, forward and backward with a bf16 output gradient (gradients accumulate into
/// x and the parameters, as PyTorch's `.backward(g)`).
fn layernorm_bf16(device: Device) -> Result<Map<String, Value>> {
    let (n, c) = (8192usize, 768usize);
    ember::manual_seed(0)?;
    let mut ln = ember::nn::LayerNorm::new(&[c], device)?;
    ln.to_dtype(DType::BF16)?;
    let x = Tensor::randn([n, c], DType::BF16, device)?.requires_grad_(true)?;
    let g = Tensor::randn([n, c], DType::BF16, device)?;
    let t = time_steps(device, 5, 50, 5, || {
        ln.forward(&x)?.backward_with(Some(&g), false)
    })?;
    let gbs = 5.0 * 2.0 * (n * c) as f64 / (t.median * 1e-3) / 1e9;
    Ok(row("layernorm_bf16", &t, 1.0, json!({ "gb_per_s": gbs })))
}

/// `run_cross_entropy` of the reference: mean cross-entropy of bf16 logits [8192, 50304]
/// (requires grad) against int64 targets, the loss in fp32, forward and backward. PyTorch's
/// step is `F.cross_entropy(logits.float(), y).backward()`; ember's is the same loss as
/// autocast computes it (cross_entropy is on the fp32 list): the fused classifier reads the
/// bf16 logits, computes in f32 inside and gives an f32 loss, without the f32 copy. The
/// gradient is released before each step (`zero_grad(set_to_none=True)`, as a training loop
/// does), so each step writes it once; the reference's loop accumulates into it instead.
fn cross_entropy_50304(device: Device) -> Result<Map<String, Value>> {
    let (n, v) = (8192usize, 50304usize);
    let logits = Tensor::randn([n, v], DType::BF16, device)?.requires_grad_(true)?;
    let y = Tensor::randint(0, v as i64, [n], device)?;
    let t = time_steps(device, 3, 20, 5, || {
        logits.set_grad(None)?;
        let loss = {
            let _ac = ember::amp::autocast(device.device_type(), DType::BF16)?;
            ember::nn::functional::cross_entropy(&logits, &y)?
        };
        debug_assert_eq!(loss.dtype(), DType::F32);
        loss.backward()
    })?;
    let gbs = 2.0 * 2.0 * (n * v) as f64 / (t.median * 1e-3) / 1e9;
    Ok(row("cross_entropy_50304", &t, 1.0, json!({ "gb_per_s": gbs })))
}

fn run(
    name: &str,
    device: Device,
    comm_hook: Option<CommHook>,
) -> std::result::Result<Map<String, Value>, String> {
    let gpu = matches!(device, Device::Cuda(_));
    let outcome =
        match name {
            "mlp_small" | "mlp_large" | "cnn" | "lstm" | "mlp_large_amp_bf16" | "mlp_large_amp_fp16" => {
                training(name, device)
            }
            "mlp_small_graph" | "cnn_graph" if gpu => training(name, device),
            "mlp_small_graph" | "cnn_graph" => return Err("CUDA graphs need a CUDA device".into()),
            "ddp_mlp_large" | "ddp_cnn" | "dp_mlp_large" | "dp_cnn" if gpu => multi_gpu(name, comm_hook),
            "ddp_gpt2" | "fsdp_gpt2" if gpu => gpt2_distributed(name, comm_hook),
            "ddp_mlp_large" | "ddp_cnn" | "dp_mlp_large" | "dp_cnn" | "ddp_gpt2" | "fsdp_gpt2" => {
                return Err("the multi-GPU workloads run on CUDA devices only".into())
            }
            "gpt2_124m_bf16" if gpu => gpt2(device, false),
            "gpt2_124m_bf16_graph" if gpu => gpt2(device, true),
            "sdpa_causal_bf16" if gpu => sdpa_causal(device),
            "gpt2_124m_bf16" | "gpt2_124m_bf16_graph" | "sdpa_causal_bf16" => return Err(
                "the transformer workloads run on CUDA devices only (GPT-2 124M is far too slow on a CPU)"
                    .into(),
            ),
            "gpt2_124m_bf16_compiled" | "mlp_large_tf32" => {
                return Err(
                    "a PyTorch reference point (torch.compile, TF32 matmuls), not an ember workload".into(),
                )
            }
            "matmul_bf16_8192" if gpu => matmul_bf16(device),
            "add_f32_256M" if gpu => add_f32(device),
            "h2d_pinned_1GiB" if gpu => h2d_pinned(device),
            "op_overhead_add" if gpu => small_adds(device),
            "matmul_bf16_8192" | "add_f32_256M" | "h2d_pinned_1GiB" | "op_overhead_add" => {
                return Err("kernel workloads run on CUDA devices only".into())
            }
            // The fused kernels of issue 37.
            "layernorm_bf16" if gpu => layernorm_bf16(device),
            "layernorm_bf16" => return Err("kernel workloads run on CUDA devices only".into()),
            "cross_entropy_50304" if gpu => cross_entropy_50304(device),
            "cross_entropy_50304" => return Err("kernel workloads run on CUDA devices only".into()),
            _ if WORKLOADS.contains(&name) => return Err("not implemented yet in ember bench".into()),
            _ => return Err(format!("unknown workload; known: {}", WORKLOADS.join(", "))),
        };
    outcome.map_err(|e| e.to_string())
}

/// `LOCAL_RANK` as a launcher (ember-run, torchrun) sets it; None outside a launched job.
pub fn launched_local_rank() -> Option<usize> {
    std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok())
}

/// Runs the workloads `only` names (all when empty) on `device`, printing one JSON line each
/// (and with `profile`, a folder and what to record there, none meaning the default, writing
/// each one's profile there; with `comm_hook`, the `ddp_*` workloads registering that DDP
/// communication hook); an error naming the known workloads, before anything runs, when
/// `only` names an unknown one, one when CUDA activity is asked for on the CPU, and one when
/// a communication hook is asked for without a `ddp_*` workload.
pub fn bench(
    device: Device,
    only: &[String],
    profile: Option<(&Path, &[ProfilerActivity])>,
    comm_hook: Option<CommHook>,
) -> std::result::Result<(), String> {
    if let Some((dir, activities)) = profile {
        if !device.is_cuda() && activities.contains(&ProfilerActivity::Cuda) {
            return Err(format!(
                "--profile-activities cuda needs a GPU, but the workloads run on {device}; leave cuda out or pass --device cuda"
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("--profile: cannot make {}: {e}", dir.display()))?;
    }
    if let Some(bad) = only.iter().find(|n| !WORKLOADS.contains(&n.as_str())) {
        return Err(format!(
            "unknown workload {bad:?} in --only; the workloads are: {}",
            WORKLOADS.join(", ")
        ));
    }
    let names: Vec<&str> = if only.is_empty() {
        WORKLOADS
            .iter()
            .copied()
            .filter(|n| !only_when_named(n))
            .collect()
    } else {
        only.iter().map(String::as_str).collect()
    };
    if let Some(hook) = comm_hook {
        if !names.iter().any(|n| n.starts_with("ddp_")) {
            return Err(format!(
                "--comm-hook {} applies to the ddp_* workloads only; name one with --only (e.g. --only ddp_mlp_large, under ember-run)",
                hook.name()
            ));
        }
    }
    let device_name = match device {
        Device::Cuda(i) => cuda::get_device_name(i).unwrap_or_else(|_| "unknown".into()),
        Device::Cpu => "cpu".into(),
    };
    // In a launched job (the ddp_* workloads) rank 0 alone prints.
    let rank = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
        .unwrap_or(0);
    for name in names {
        eprintln!("ember bench: {name} on {device}");
        // Every rank of a launched job profiles (they step together); each writes its own files.
        let file = match rank {
            0 => name.to_string(),
            r => format!("{name}.rank{r}"),
        };
        *PROFILE_TO.lock().unwrap_or_else(|e| e.into_inner()) =
            profile.map(|(dir, activities)| (dir.to_path_buf(), file, activities.to_vec()));
        let mut line = run(name, device, comm_hook).unwrap_or_else(|e| {
            let mut m = Map::new();
            m.insert("workload".into(), json!(name));
            m.insert("error".into(), json!(e));
            m
        });
        line.insert("framework".into(), json!("ember"));
        line.insert("version".into(), json!(ember::VERSION));
        line.insert(
            "device".into(),
            json!(if device == Device::Cpu { "cpu" } else { "cuda" }),
        );
        line.insert("device_name".into(), json!(device_name));
        if rank == 0 {
            println!("{}", Value::Object(line));
        }
    }
    Ok(())
}
