//! Casts of parameters that a captured training step keeps from one replay to the next (Note
//! [Casts a captured step keeps]).
//!
//! Note [Casts a captured step keeps]: in an eager step the fused Adam step writes a float32
//! parameter's bf16 twin beside it, and the next forward's cast takes the twin instead of
//! casting (Note [Cast twins] in `storage/mod.rs`). A captured step keeps its casts the same
//! way, with one buffer a parameter for the life of the graph: a cast during a capture that
//! finds the parameter's valid twin (the last eager step's, before the capture) takes it as
//! that buffer, so the captured forward has no cast kernel and reads the buffer; the captured
//! Adam step of the parameter writes its bf16 twin into the same buffer; and each replay's
//! forward then reads what the last replay's step wrote, the cast of the parameter's values.
//! The buffer was made outside the capture, so no allocation of the graph's pool shares its
//! memory, and the graph holds it, so nothing else gets it while the graph lives.
//!
//! The buffer is the cast of the parameter at the start of a replay when, within the capture,
//! the step wrote it after the cast, nothing else wrote the parameter or the buffer after that,
//! and no tensor over the buffer was left for later ops to read (the step checks this and
//! writes the twin only then); the graph "keeps" such a cast. Outside the graph the buffer can
//! fall behind: before the first replay, after the parameter was written outside the graph (its
//! version moved), after another graph's replay (replays write without counting versions); the
//! graph then casts the parameter into the buffer on the replay's stream before launching
//! (`cuda/graph.rs`). A cast the graph does not keep (no step wrote it: an evaluation graph
//! captured after eager training steps) is cast into its buffer before every replay, which
//! costs what the captured cast kernel would have.
//!
//! On GPT-2's bf16 step (H200) the graphed step was no faster than the eager one once the eager
//! step took its casts from Adam's twins (17.181 against 17.125 ms, session 47); with the
//! captured step keeping them it is 0.40 ms faster (17.222 against 17.617 ms, session 48 run 3
//! in docs/benchmarks.md). The first attempt kept the cast kernel's own output from the
//! graph's pool and disabled the cast's node: the pool had handed that block to a temporary of
//! an earlier op in the same capture, which a replay then overwrote before the forward read it,
//! so the buffer must come from outside the capture.

use super::StorageRef;
use crate::cuda_backend::capture;
use crate::Device;
use std::sync::Mutex;

/// One twin a capture took as a parameter's cast.
#[derive(Debug)]
struct GraphCast {
    source: StorageRef,
    /// The buffer: the twin, made outside the capture.
    target: StorageRef,
    /// The source's version when the buffer last became its cast (the taking, then each step).
    version: u64,
    /// The target's version then.
    target_version: u64,
    /// Whether a captured step wrote the buffer since the cast.
    stepped: bool,
}

/// A cast a captured graph holds: the parameter, the buffer the captured forward reads, and
/// whether the captured step keeps the buffer its cast (otherwise it is cast before every
/// replay).
#[derive(Debug)]
pub(crate) struct HeldCast {
    pub(crate) source: StorageRef,
    pub(crate) target: StorageRef,
    pub(crate) kept: bool,
}

/// The casts recorded so far, by the serial of the graph whose capture recorded them.
static CASTS: Mutex<Vec<(u64, Vec<GraphCast>)>> = Mutex::new(Vec::new());

fn casts() -> std::sync::MutexGuard<'static, Vec<(u64, Vec<GraphCast>)>> {
    CASTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The graph (by serial) whose capture the calling thread's current stream on `device` takes
/// part in, if a capture begun on this thread.
pub(crate) fn capturing(device: Device) -> Option<u64> {
    match device {
        Device::Cuda(d) if capture::any_underway() => capture::capture_of_current_stream(d),
        _ => None,
    }
}

/// Records that graph `graph`'s capture took `twin` as the cast of all of `source` (Note
/// [Casts a captured step keeps]), and returns it. A source is taken once a capture: its twin
/// is gone after the first cast.
pub(crate) fn adopt(graph: u64, source: &StorageRef, twin: StorageRef) -> StorageRef {
    let mut all = casts();
    let list = match all.iter().position(|(g, _)| *g == graph) {
        Some(i) => &mut all[i].1,
        None => {
            all.push((graph, Vec::new()));
            &mut all.last_mut().expect("just pushed").1
        }
    };
    list.push(GraphCast {
        source: source.clone(),
        target: twin.clone(),
        version: source.version(),
        target_version: twin.version(),
        stepped: false,
    });
    twin
}

/// The buffer a step of `source` captured now writes its bf16 twin into: the cast's the
/// capture took, while it still holds the cast of the source's current values and nothing but
/// the record holds it (no tensor is left that a later op could read the old cast through).
pub(crate) fn step_target(source: &StorageRef) -> Option<StorageRef> {
    let graph = capturing(source.device())?;
    let all = casts();
    let (_, list) = all.iter().find(|(g, _)| *g == graph)?;
    let c = list.iter().find(|c| c.source.same_storage(source))?;
    let ok = c.version == source.version() && c.target_version == c.target.version() && c.target.is_unique();
    ok.then(|| c.target.clone())
}

/// Notes that the step captured just now wrote `source` and its twin into its cast's buffer.
pub(crate) fn stepped(source: &StorageRef) {
    let Some(graph) = capturing(source.device()) else {
        return;
    };
    let mut all = casts();
    if let Some((_, list)) = all.iter_mut().find(|(g, _)| *g == graph) {
        if let Some(c) = list.iter_mut().find(|c| c.source.same_storage(source)) {
            c.version = source.version();
            c.target_version = c.target.version();
            c.stepped = true;
        }
    }
}

/// The casts graph `graph`'s capture took, for the graph to hold: kept when stepped and
/// neither storage written since.
pub(crate) fn take(graph: u64) -> Vec<HeldCast> {
    let mut all = casts();
    let Some(i) = all.iter().position(|(g, _)| *g == graph) else {
        return Vec::new();
    };
    let (_, list) = all.swap_remove(i);
    drop(all);
    list.into_iter()
        .map(|c| HeldCast {
            kept: c.stepped && c.version == c.source.version() && c.target_version == c.target.version(),
            source: c.source,
            target: c.target,
        })
        .collect()
}

/// Forgets what graph `graph`'s capture took (a capture that failed or was abandoned).
pub(crate) fn forget(graph: u64) {
    casts().retain(|(g, _)| *g != graph);
}
