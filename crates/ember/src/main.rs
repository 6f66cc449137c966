//! The `ember` program: `ember info` reports the build and the devices found.
#![forbid(unsafe_code)]

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
    /// Print the version, build features and the devices found (like `torch.utils.collect_env`).
    Info,
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => print!("{}", ember_info()),
    }
}

fn ember_info() -> String {
    let mut s = String::new();
    s += &format!("ember {}\n", ember::VERSION);
    s += &format!(
        "build: {} {}, profile {}\n",
        std::env::consts::OS,
        std::env::consts::ARCH,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    s += &format!("cpu threads (rayon): {}\n", rayon_threads());
    s += "devices:\n  cpu\n";
    s += "cuda: not available (this build has no CUDA backend yet)\n";
    s
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
