//! `ember memviz SNAPSHOT -o memory.html`: draws a memory snapshot (ember's
//! `cuda::dump_snapshot` or PyTorch's `torch.cuda.memory._dump_snapshot`) as one self-contained
//! HTML page, for users without PyTorch's visualizer: the active-memory timeline of each device
//! (allocations stacked as PyTorch's `trace_plot` draws them, reserved memory and OOMs marked)
//! and the segment map (each segment a bar, its blocks coloured by state).
//!
//! `snapshot` reads the pickle into a typed model, `timeline` turns a device's trace into the
//! stacked bands, `page` writes the HTML (inline SVG and CSS, no script, nothing fetched).

mod page;
mod snapshot;
mod timeline;

use clap::Args;
use std::path::{Path, PathBuf};

pub use snapshot::Snapshot;

/// `ember memviz`'s arguments.
#[derive(Args, Debug)]
pub struct MemvizArgs {
    /// The snapshot pickle (`ember::cuda::dump_snapshot` or `torch.cuda.memory._dump_snapshot`).
    pub snapshot: PathBuf,
    /// The HTML page to write.
    #[arg(short, long, default_value = "memory.html")]
    pub output: PathBuf,
}

/// Why `ember memviz` could not draw a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum MemvizError {
    /// The snapshot file could not be read.
    #[error("cannot read the memory snapshot {path}: {source}{hint}", hint = read_hint(source))]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a pickle of plain data.
    #[error(
        "{path} is not a memory snapshot: {source}. Write one with ember::cuda::dump_snapshot(device, path) \
         or torch.cuda.memory._dump_snapshot(path)"
    )]
    NotPickle {
        /// The file.
        path: PathBuf,
        /// What the reader found.
        source: ember::pickle::PickleError,
    },
    /// A pickle, but not of a snapshot's structure.
    #[error(
        "{path} is a pickle but not a memory snapshot: {what} (expected a dict with \"segments\" and \
         \"device_traces\", as torch.cuda.memory._snapshot() returns)"
    )]
    NotSnapshot {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the field's place.
        what: String,
    },
    /// The page could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The page's path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn read_hint(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::NotFound {
        ". Record one with ember::cuda::record_memory_history(device, true, max_entries) and then \
         ember::cuda::dump_snapshot(device, path)"
    } else {
        ""
    }
}

/// Reads the snapshot at `path`.
pub fn read(path: &Path) -> Result<Snapshot, MemvizError> {
    let bytes = std::fs::read(path).map_err(|source| MemvizError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let value = ember::pickle::loads(&bytes).map_err(|source| MemvizError::NotPickle {
        path: path.to_path_buf(),
        source,
    })?;
    Snapshot::from_value(&value).map_err(|what| MemvizError::NotSnapshot {
        path: path.to_path_buf(),
        what,
    })
}

/// Reads the snapshot, draws it and writes the page; the page's title names the snapshot file.
pub fn run(args: &MemvizArgs) -> Result<(), MemvizError> {
    let snapshot = read(&args.snapshot)?;
    let name = args.snapshot.file_name().map_or_else(
        || args.snapshot.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let html = page::render(&snapshot, &name);
    std::fs::write(&args.output, html).map_err(|source| MemvizError::Write {
        path: args.output.clone(),
        source,
    })
}

/// `ember memviz`: on error, the message and exit status 2.
pub fn main(args: MemvizArgs) {
    match run(&args) {
        Ok(()) => eprintln!("ember memviz: wrote {}", args.output.display()),
        Err(e) => {
            eprintln!("ember memviz: {e}");
            std::process::exit(2);
        }
    }
}
