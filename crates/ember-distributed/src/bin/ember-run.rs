//! `ember-run`: starts the workers of a distributed ember program (`torchrun`); see
//! [`ember_distributed::launch`] and `ember-run --help`.
#![forbid(unsafe_code)]

use ember_distributed::launch::{run, LaunchConfig, LaunchOutcome, USAGE};

fn main() {
    let cfg = match LaunchConfig::parse(std::env::args().skip(1)) {
        Ok(Some(cfg)) => cfg,
        Ok(None) => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("ember-run: {e}");
            std::process::exit(2);
        }
    };
    match run(&cfg) {
        Ok(LaunchOutcome::Succeeded) => {}
        Ok(LaunchOutcome::Failed { rank, status }) => {
            eprintln!(
                "ember-run: worker rank {rank} failed ({status}); stopped the other workers of this node"
            );
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("ember-run: {e}");
            std::process::exit(1);
        }
    }
}
