//! The allocator's snapshot in PyTorch's structure (`torch.cuda.memory._snapshot()`, which
//! `torch.cuda.memory._dump_snapshot` pickles): as a pickle value for PyTorch's own tools
//! (`torch.cuda._memory_viz`, the memory_viz page) and as JSON.
//!
//! The structure, field for field as PyTorch's `THCPModule_memorySnapshot` builds it:
//! - `segments`: one dict per driver segment, in address order: `device`, `address`,
//!   `total_size`, `allocated_size` (bytes of `active_allocated` blocks), `active_size` (bytes
//!   of blocks not `inactive`), `requested_size` (requested bytes of those), `stream`,
//!   `segment_type` (`"small"`/`"large"`), `segment_pool_id` (a tuple of two ints, `(0, 0)` for
//!   the default pools), `is_expandable`, `frames`, and `blocks`: dicts of `address`, `size`,
//!   `requested_size`, `state` (`"active_allocated"`, `"active_pending_free"`, `"inactive"`),
//!   `frames`. The blocks of a segment cover it exactly.
//! - `device_traces`: one list per device, indexed by device ordinal, of dicts: `action`,
//!   `addr` (`device_free` for `"oom"`), `size`, `stream`, `time_us`, `frames`.
//! - `allocator_settings`: PyTorch's allocator configuration keys with the values that
//!   describe ember's allocator (no `PYTORCH_CUDA_ALLOC_CONF`, no split limit, no garbage
//!   collection threshold, no expandable segments, no power-of-two rounding).
//! - `external_annotations`: empty (PyTorch 2.6 and later list user annotations there).
//!
//! ember records no stack traces, so every `frames` is an empty list, as PyTorch writes for
//! entries recorded without context.

use super::stats::{BlockState, SegmentInfo, TraceAction, TraceEntry};
use crate::pickle::Value;

/// PyTorch's `kRoundUpPowerOfTwoIntervals`: entries of `roundup_power2_divisions`.
const ROUNDUP_INTERVALS: u32 = 16;

/// The snapshot of one device's allocator as PyTorch's `_snapshot()` dict: `device`'s segments
/// and trace, and `devices` trace lists (at least `device + 1`; the others empty).
pub fn snapshot_value(
    device: usize,
    devices: usize,
    segments: &[SegmentInfo],
    trace: &[TraceEntry],
) -> Value {
    let no_frames = || Value::List(Vec::new());
    let segments = segments
        .iter()
        .map(|seg| {
            let blocks = seg
                .blocks
                .iter()
                .map(|b| {
                    Value::dict([
                        ("address", b.address.into()),
                        ("size", b.size.into()),
                        ("requested_size", b.requested_size.into()),
                        ("state", b.state.as_str().into()),
                        ("frames", no_frames()),
                    ])
                })
                .collect();
            let active = |s: BlockState| s != BlockState::Inactive;
            let requested: usize = seg
                .blocks
                .iter()
                .filter(|b| active(b.state))
                .map(|b| b.requested_size)
                .sum();
            let pool_id = seg.private_pool.map_or((0, 0), |p| (p.0, p.1));
            Value::dict([
                ("device", device.into()),
                ("address", seg.address.into()),
                ("total_size", seg.total_size.into()),
                (
                    "allocated_size",
                    seg.bytes_where(|s| s == BlockState::ActiveAllocated).into(),
                ),
                ("active_size", seg.bytes_where(active).into()),
                ("requested_size", requested.into()),
                ("stream", seg.stream.into()),
                ("segment_type", seg.pool.as_str().into()),
                (
                    "segment_pool_id",
                    Value::Tuple(vec![pool_id.0.into(), pool_id.1.into()]),
                ),
                ("is_expandable", false.into()),
                ("frames", no_frames()),
                ("blocks", Value::List(blocks)),
            ])
        })
        .collect();
    let entries = trace
        .iter()
        .map(|t| {
            let addr_key = if t.action == TraceAction::Oom {
                "device_free"
            } else {
                "addr"
            };
            Value::dict([
                ("action", t.action.as_str().into()),
                (addr_key, t.addr.into()),
                ("size", t.size.into()),
                ("stream", t.stream.into()),
                ("time_us", t.time_us.into()),
                ("frames", no_frames()),
            ])
        })
        .collect();
    let mut traces: Vec<Value> = (0..devices.max(device + 1))
        .map(|_| Value::List(Vec::new()))
        .collect();
    traces[device] = Value::List(entries);
    Value::dict([
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(traces)),
        ("allocator_settings", allocator_settings()),
        ("external_annotations", Value::List(Vec::new())),
    ])
}

/// PyTorch's `allocator_settings` keys, valued for ember's allocator.
fn allocator_settings() -> Value {
    let roundup = (0..ROUNDUP_INTERVALS).map(|i| ((1u32 << i).to_string(), Value::Int(0)));
    Value::dict([
        ("PYTORCH_CUDA_ALLOC_CONF", "".into()),
        // PyTorch writes its "no limit" (SIZE_MAX) as an int64: -1.
        ("max_split_size", Value::Int(-1)),
        ("garbage_collection_threshold", 0.0.into()),
        ("expandable_segments", false.into()),
        ("pinned_num_register_threads", 1.into()),
        ("release_lock_on_cudamalloc", false.into()),
        ("pinned_use_cuda_host_register", false.into()),
        ("roundup_power2_divisions", Value::dict(roundup)),
    ])
}

/// The snapshot as JSON, in the same shape with fewer fields (no device, requested sizes, pool
/// ids, frames or settings; one device's trace); what [`crate::cuda_backend::memory_snapshot`] returns.
pub fn snapshot_json(segments: &[SegmentInfo], trace: &[TraceEntry]) -> String {
    let segs: Vec<String> = segments
        .iter()
        .map(|seg| {
            let blocks: Vec<String> = seg
                .blocks
                .iter()
                .map(|b| {
                    format!(
                        r#"{{"address":{},"size":{},"requested_size":{},"state":"{}"}}"#,
                        b.address,
                        b.size,
                        b.requested_size,
                        b.state.as_str()
                    )
                })
                .collect();
            format!(
                concat!(
                    r#"{{"address":{},"total_size":{},"stream":{},"segment_type":"{}","#,
                    r#""allocated_size":{},"active_size":{},"blocks":[{}]}}"#
                ),
                seg.address,
                seg.total_size,
                seg.stream,
                seg.pool.as_str(),
                seg.bytes_where(|s| s == BlockState::ActiveAllocated),
                seg.bytes_where(|s| s != BlockState::Inactive),
                blocks.join(",")
            )
        })
        .collect();
    let entries: Vec<String> = trace
        .iter()
        .map(|t| {
            format!(
                r#"{{"action":"{}","{}":{},"size":{},"stream":{},"time_us":{}}}"#,
                t.action.as_str(),
                if t.action == TraceAction::Oom {
                    "device_free"
                } else {
                    "addr"
                },
                t.addr,
                t.size,
                t.stream,
                t.time_us
            )
        })
        .collect();
    format!(
        r#"{{"segments":[{}],"device_traces":[[{}]]}}"#,
        segs.join(","),
        entries.join(",")
    )
}
