//! The `ember` program: `ember train` trains a classifier on Fashion-MNIST (or, with `--model
//! gpt2`, a byte-level GPT on a text file), `ember info`
//! reports the build and the devices found, `ember bench` runs the shared benchmark workloads,
//! `ember memviz` draws a memory snapshot as an HTML page.
#![forbid(unsafe_code)]

mod bench;
mod memviz;
mod models;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ember",
    version,
    about = "ember: deep learning in Rust on CPU and NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train an MLP or a CNN on Fashion-MNIST (embedded t10k split by default) and report the
    /// test accuracy, or (--model gpt2) a byte-level GPT on a text file and sample from it.
    Train(train::TrainArgs),
    /// Print the version, build features and the devices found (like `torch.utils.collect_env`).
    Info,
    /// Run the shared benchmark workloads and print one JSON line each (shared/bench/WORKLOADS.md).
    Bench {
        /// cpu, cuda or cuda:N (default: cuda:LOCAL_RANK in a launched job, else cuda:0, when a
        /// GPU is present).
        #[arg(long)]
        device: Option<String>,
        /// Comma-separated workload names (default: all).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// After timing each workload, profile 3 more steps (CPU and CUDA) and write the op
        /// table (DIR/WORKLOAD.txt, sorted by self CPU time) and a chrome trace
        /// (DIR/WORKLOAD.json) into DIR.
        #[arg(long, value_name = "DIR")]
        profile: Option<std::path::PathBuf>,
        /// With --profile: what the profile records, `cpu` and/or `cuda` (PyTorch's
        /// `activities`; default: both on a GPU). CUPTI's records about double the host time
        /// of every op, so `cpu` alone shows a host-bound workload's host time as it is.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            requires = "profile",
            value_name = "cpu,cuda"
        )]
        profile_activities: Vec<Activity>,
        /// The DDP communication hook the ddp_* workloads register (PyTorch's
        /// `ddp_comm_hooks.default_hooks`): `bf16` and `fp16` all-reduce the gradients in half
        /// precision, `allreduce` averages as DDP does. Named in the JSON line as `comm_hook`.
        #[arg(long, value_enum, value_name = "allreduce|fp16|bf16")]
        comm_hook: Option<bench::CommHook>,
    },
    /// Draw a memory snapshot (`cuda::dump_snapshot`, or PyTorch's `_dump_snapshot`) as one
    /// self-contained HTML page: the active-memory timeline and the segment map.
    Memviz(memviz::MemvizArgs),
}

/// `--profile-activities` values.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Activity {
    Cpu,
    Cuda,
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Train(args) => train::main(args),
        Command::Info => print!("{}", ember_info()),
        Command::Memviz(args) => memviz::main(args),
        Command::Bench {
            device,
            only,
            profile,
            profile_activities,
            comm_hook,
        } => {
            let device = match device.as_deref().map(ember::Device::parse) {
                Some(Ok(d)) => d,
                Some(Err(e)) => {
                    eprintln!("ember bench: {e}");
                    std::process::exit(2);
                }
                // In a launched job each rank takes its own GPU (torchrun's LOCAL_RANK), as the
                // ddp_* workloads do, so no two ranks time a workload on one GPU.
                None if ember::cuda::is_available() => ember::Device::Cuda(
                    bench::launched_local_rank()
                        .filter(|&r| r < ember::cuda::device_count())
                        .unwrap_or(0),
                ),
                None => ember::Device::Cpu,
            };
            use ember::profiler::ProfilerActivity;
            let activities: Vec<ProfilerActivity> = profile_activities
                .iter()
                .map(|a| match a {
                    Activity::Cpu => ProfilerActivity::Cpu,
                    Activity::Cuda => ProfilerActivity::Cuda,
                })
                .collect();
            let profile = profile.as_deref().map(|dir| (dir, activities.as_slice()));
            if let Err(e) = bench::bench(device, &only, profile, comm_hook) {
                eprintln!("ember bench: {e}");
                std::process::exit(2);
            }
        }
    }
}

fn ember_info() -> String {
    use ember::cuda;
    let mut s = String::new();
    s += &format!("ember {}\n", ember::VERSION);
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    s += &format!(
        "build: {} {}, profile {profile}, CUDA 13 bindings (loaded at run time)\n",
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    s += &format!(
        "cpu threads: {}\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    s += "devices:\n  cpu\n";
    for i in 0..cuda::device_count() {
        match cuda::get_device_properties(i) {
            Ok(p) => {
                s += &format!(
                    "  cuda:{i}  {}  sm_{}{}  {:.1} GiB  {} SMs\n",
                    p.name,
                    p.major,
                    p.minor,
                    p.total_memory as f64 / (1u64 << 30) as f64,
                    p.multi_processor_count
                )
            }
            Err(e) => s += &format!("  cuda:{i}  error: {e}\n"),
        }
    }
    match cuda::driver_version() {
        Some(v) => {
            s += &format!(
                "cuda: available, driver supports CUDA {}.{}\n",
                v / 1000,
                (v % 1000) / 10
            )
        }
        None => s += "cuda: not available (no NVIDIA driver or device found); ember runs on the CPU\n",
    }
    s += "cuda libraries:\n";
    for lib in cuda::library_report() {
        s += &format!(
            "  {:<18} {}\n",
            lib.name,
            lib.found.as_deref().unwrap_or("missing")
        );
    }
    let dnn = ember::backends::cudnn::version();
    s += &match dnn {
        Some(v) => {
            // cudnnGetVersion: major*10000 + minor*100 + patch from cuDNN 9, major*1000 + ... before.
            let (major, minor, patch) = if v >= 90000 {
                (v / 10000, (v % 10000) / 100, v % 100)
            } else {
                (v / 1000, (v % 1000) / 100, v % 100)
            };
            let on = |b: bool| if b { "on" } else { "off" };
            format!(
                "cudnn: {major}.{minor}.{patch} (enabled {}, benchmark {}, deterministic {}, allow_tf32 {})\n",
                on(ember::backends::cudnn::enabled()),
                on(ember::backends::cudnn::benchmark()),
                on(ember::backends::cudnn::deterministic()),
                on(ember::backends::cudnn::allow_tf32()),
            )
        }
        None => "cudnn: not available; convolutions on CUDA use im2col + GEMM\n".into(),
    };
    s
}
