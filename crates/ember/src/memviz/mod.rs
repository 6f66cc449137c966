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
        "{path} is not a memory snapshot: {source}. Write one with ember::cuda::dump_snapshot(path) \
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
        ". Record one with ember::cuda::record_memory_history(true, max_entries) and then \
         ember::cuda::dump_snapshot(path)"
    } else {
        ""
    }
}

/// The snapshot in `bytes`, read from `path` (named in errors).
pub fn parse(bytes: &[u8], path: &Path) -> Result<Snapshot, MemvizError> {
    let value = ember::pickle::loads(bytes).map_err(|source| MemvizError::NotPickle {
        path: path.to_path_buf(),
        source,
    })?;
    Snapshot::from_value(&value).map_err(|what| MemvizError::NotSnapshot {
        path: path.to_path_buf(),
        what,
    })
}

/// The page of the snapshot in `bytes`, read from `path` (its file name is the page's title).
/// Whatever the bytes, this returns: the fuzz target `memviz` (`fuzz/`) runs it.
pub fn page_of(bytes: &[u8], path: &Path) -> Result<String, MemvizError> {
    let snapshot = parse(bytes, path)?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(page::render(&snapshot, &name))
}

/// Reads the snapshot, draws it and writes the page; the page's title names the snapshot file.
pub fn run(args: &MemvizArgs) -> Result<(), MemvizError> {
    let bytes = std::fs::read(&args.snapshot).map_err(|source| MemvizError::Read {
        path: args.snapshot.clone(),
        source,
    })?;
    let html = page_of(&bytes, &args.snapshot)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use ember::pickle::{dumps, Value};

    fn event(action: &str, addr: u64, size: u64) -> Value {
        Value::dict([
            ("action", action.into()),
            ("addr", addr.into()),
            ("size", size.into()),
        ])
    }

    fn segment(address: u64, total_size: u64, blocks: Vec<Value>) -> Value {
        Value::dict([
            ("address", address.into()),
            ("total_size", total_size.into()),
            ("blocks", Value::List(blocks)),
        ])
    }

    /// Sizes near `u64::MAX` in a corrupt snapshot: each of these overflowed a sum and
    /// panicked (found by reading, each reproduced with the `memviz` fuzz target's binary);
    /// the page is drawn instead.
    #[test]
    fn sizes_near_u64_max_draw_a_page_without_overflow() {
        let big = 1u64 << 63;
        let block = |size: u64| Value::dict([("size", size.into()), ("state", "active_allocated".into())]);
        let cases = [
            // Two allocations whose sizes add up past u64::MAX (the timeline's stack height),
            // then freed in turn.
            Value::dict([
                ("segments", Value::List(vec![])),
                (
                    "device_traces",
                    Value::List(vec![Value::List(vec![
                        event("alloc", 0, big),
                        event("alloc", 1, big),
                        event("alloc", 2, big),
                        event("free_completed", 0, big),
                        event("free_completed", 2, big),
                        event("free_completed", 1, big),
                        event("segment_alloc", 0, u64::MAX),
                        event("segment_alloc", 1, u64::MAX),
                    ])]),
                ),
            ]),
            // Blocks without addresses follow each other from the segment's: past u64::MAX.
            Value::dict([(
                "segments",
                Value::List(vec![segment(u64::MAX - 1, 5, vec![block(4), block(1)])]),
            )]),
            // Segments whose sizes add up past u64::MAX (the summary and the y axis).
            Value::dict([(
                "segments",
                Value::List(vec![
                    segment(0, u64::MAX, vec![block(u64::MAX)]),
                    segment(0, u64::MAX, vec![block(u64::MAX)]),
                ]),
            )]),
        ];
        for (i, snapshot) in cases.iter().enumerate() {
            let page = page_of(&dumps(snapshot), Path::new("corrupt.pickle"))
                .unwrap_or_else(|e| panic!("case {i}: {e}"));
            assert!(page.starts_with("<!DOCTYPE html>"), "case {i}");
        }
    }
}
