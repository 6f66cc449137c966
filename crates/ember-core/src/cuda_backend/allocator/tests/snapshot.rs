//! The snapshot in PyTorch's structure, from allocator states built with the fake driver: its
//! figures agree with the statistics, and CPython reads the pickle `dump_snapshot` writes.

use super::super::snapshot::snapshot_value;
use super::*;
use crate::pickle::{self, Value};

/// An allocator with every kind of segment, block state and trace action it records:
/// an out-of-memory request, a small segment holding a freed and a live block, a large
/// segment whose only block waits on another stream, a request-sized large segment on
/// stream 7, a private pool's segment, and a segment returned to the driver.
fn busy_allocator() -> CachingAllocator<FakeDriver> {
    let a = allocator(64 * MIB);
    a.record_history(true, 1000);
    assert!(a.malloc(100 * MIB, 0).is_err());
    let s1 = a.malloc(1000, 0).unwrap();
    let _s2 = a.malloc(5000, 0).unwrap();
    let l1 = a.malloc(3 * MIB, 0).unwrap();
    let _l2 = a.malloc(12 * MIB, 7).unwrap();
    let gone = a.malloc(12 * MIB, 5).unwrap();
    assert!(a.free(gone.ptr));
    assert!(a.empty_cache()); // the stream-5 segment goes back to the driver
    a.record_stream(l1.ptr, 9);
    assert!(a.free(l1.ptr)); // pending on stream 9's event
    assert!(a.free(s1.ptr));
    begin(&a, MempoolId(0, 3), 1, 11);
    let _graph = a.malloc(4096, 1).unwrap();
    end(&a, MempoolId(0, 3), 1);
    a
}

fn value_of(a: &CachingAllocator<FakeDriver>, device: usize, devices: usize) -> Value {
    snapshot_value(device, devices, &a.snapshot(), &a.history())
}

fn int(v: &Value, key: &str) -> i128 {
    v.get(key)
        .and_then(Value::as_int)
        .unwrap_or_else(|| panic!("no int {key} in {v}"))
}

fn seq<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_seq)
        .unwrap_or_else(|| panic!("no list {key} in {v}"))
}

#[test]
fn snapshot_blocks_add_up_to_the_statistics() {
    let a = busy_allocator();
    let stats = a.stats();
    let v = value_of(&a, 0, 1);
    let segments = seq(&v, "segments");
    assert_eq!(segments.len(), 4);
    let (mut allocated, mut active, mut requested, mut reserved) = (0, 0, 0, 0);
    for seg in segments {
        let blocks = seq(seg, "blocks");
        let covered: i128 = blocks.iter().map(|b| int(b, "size")).sum();
        assert_eq!(
            covered,
            int(seg, "total_size"),
            "blocks cover their segment: {seg}"
        );
        let mut address = int(seg, "address");
        for b in blocks {
            assert_eq!(int(b, "address"), address, "blocks back to back: {seg}");
            address += int(b, "size");
            let state = b.get("state").and_then(Value::as_str).unwrap();
            if state == "active_allocated" {
                allocated += int(b, "size");
            }
            if state != "inactive" {
                active += int(b, "size");
                requested += int(b, "requested_size");
            }
        }
        reserved += int(seg, "total_size");
    }
    assert_eq!(allocated, stats.allocated_bytes.all.current as i128);
    assert_eq!(active, stats.active_bytes.all.current as i128);
    assert_eq!(requested, stats.requested_bytes.all.current as i128);
    assert_eq!(reserved, stats.reserved_bytes.all.current as i128);
    let per_segment = |key| segments.iter().map(|s| int(s, key)).sum::<i128>();
    assert_eq!(per_segment("allocated_size"), allocated);
    assert_eq!(per_segment("active_size"), active);
    assert_eq!(per_segment("requested_size"), requested);
    // 1000 + 5000 B live (rounded 1024 + 5120), 3 MiB pending, 12 MiB, 4 KiB in the graph's pool.
    assert_eq!(allocated, (5120 + 12 * MIB + 4096) as i128);
    assert_eq!(active, allocated + (3 * MIB) as i128);
    assert_eq!(reserved, (2 * MIB + 20 * MIB + 12 * MIB + 2 * MIB) as i128);
}

#[test]
fn snapshot_has_pytorchs_fields_and_trace_actions() {
    let a = busy_allocator();
    let v = value_of(&a, 1, 2);
    let keys = |d: &Value| match d {
        Value::Dict(items) => items
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_string())
            .collect::<Vec<_>>(),
        _ => panic!("not a dict: {d}"),
    };
    assert_eq!(
        keys(&v),
        [
            "segments",
            "device_traces",
            "allocator_settings",
            "external_annotations"
        ]
    );
    let segments = seq(&v, "segments");
    assert_eq!(
        keys(&segments[0]),
        [
            "device",
            "address",
            "total_size",
            "allocated_size",
            "active_size",
            "requested_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "is_expandable",
            "frames",
            "blocks"
        ]
    );
    assert_eq!(
        keys(&seq(&segments[0], "blocks")[0]),
        ["address", "size", "requested_size", "state", "frames"]
    );
    let field = |i: usize, key: &str| segments[i].get(key).unwrap().to_string();
    let summary: Vec<String> = (0..4)
        .map(|i| {
            format!(
                "{} {} {} {}",
                field(i, "device"),
                field(i, "segment_type"),
                field(i, "stream"),
                field(i, "segment_pool_id")
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            "1 'small' 0 (0, 0)",
            "1 'large' 0 (0, 0)",
            "1 'large' 7 (0, 0)",
            "1 'small' 1 (0, 3)"
        ]
    );
    let states: Vec<String> = seq(&segments[1], "blocks")
        .iter()
        .map(|b| b.get("state").unwrap().to_string())
        .collect();
    assert_eq!(states, ["'active_pending_free'", "'inactive'"]);

    let traces = seq(&v, "device_traces");
    assert_eq!(traces.len(), 2);
    assert_eq!(traces[0], Value::List(vec![]), "device 0 has no events");
    let trace = traces[1].as_seq().unwrap();
    let actions: Vec<&str> = trace
        .iter()
        .map(|e| e.get("action").and_then(Value::as_str).unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "oom",
            "segment_alloc",
            "alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "free_requested",
            "free_completed",
            "segment_free",
            "free_requested",
            "free_requested",
            "free_completed",
            "segment_alloc",
            "alloc",
        ]
    );
    // PyTorch's OOM entry: the device's free bytes under `device_free`, the request as size.
    assert_eq!(
        keys(&trace[0]),
        ["action", "device_free", "size", "stream", "time_us", "frames"]
    );
    assert_eq!(
        (int(&trace[0], "device_free"), int(&trace[0], "size")),
        ((64 * MIB) as i128, (100 * MIB) as i128)
    );
    assert_eq!(
        keys(&trace[1]),
        ["action", "addr", "size", "stream", "time_us", "frames"]
    );
    assert!(trace
        .windows(2)
        .all(|w| int(&w[0], "time_us") <= int(&w[1], "time_us")));

    let settings = v.get("allocator_settings").unwrap();
    assert_eq!(
        keys(settings),
        [
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size",
            "garbage_collection_threshold",
            "expandable_segments",
            "pinned_num_register_threads",
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "roundup_power2_divisions"
        ]
    );
    assert_eq!(keys(settings.get("roundup_power2_divisions").unwrap()).len(), 16);
    // The JSON rendering names the OOM field as PyTorch does too.
    let json = snapshot_json(&a.snapshot(), &a.history());
    assert!(
        json.contains(r#"{"action":"oom","device_free":67108864,"size":104857600,"#),
        "{json}"
    );
}

#[test]
fn snapshot_of_an_empty_allocator() {
    let a = allocator(MIB);
    let v = value_of(&a, 0, 1);
    assert_eq!(v.get("segments"), Some(&Value::List(vec![])));
    assert_eq!(
        v.get("device_traces"),
        Some(&Value::List(vec![Value::List(vec![])]))
    );
    assert_eq!(pickle::loads(&pickle::dumps(&v)), Ok(v));
}

/// CPython loads the pickle and checks it with the figures of the statistics; the script also
/// runs the checks PyTorch's `_memory_viz.segsum` asserts. python3 is part of the toolchain
/// here and on CI: a missing python3 fails the test.
#[test]
fn cpython_reads_the_dumped_snapshot() {
    let a = busy_allocator();
    let stats = a.stats();
    let v = value_of(&a, 0, 1);
    let dir = std::env::temp_dir().join(format!("ember-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("snapshot.pickle");
    pickle::dump(&v, &path).unwrap();
    const SCRIPT: &str = r#"
import pickle, sys
path, allocated, reserved, active = sys.argv[1], *map(int, sys.argv[2:5])
with open(path, "rb") as f:
    raw = f.read()
assert raw[:2] == b"\x80\x02", raw[:2]
d = pickle.loads(raw)
assert list(d) == ["segments", "device_traces", "allocator_settings", "external_annotations"], list(d)
segs = d["segments"]
got_alloc = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
got_active = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] != "inactive")
got_reserved = sum(s["total_size"] for s in segs)
assert (got_alloc, got_reserved, got_active) == (allocated, reserved, active), (got_alloc, got_reserved, got_active)
for s in segs:
    assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
    assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert isinstance(s["segment_pool_id"], tuple) and len(s["segment_pool_id"]) == 2
    assert s["segment_type"] in ("small", "large") and s["is_expandable"] is False and s["frames"] == []
    assert all(b["state"] in ("active_allocated", "active_pending_free", "inactive") for b in s["blocks"])
trace = d["device_traces"][0]
actions = [e["action"] for e in trace]
assert actions[:3] == ["oom", "segment_alloc", "alloc"], actions
assert actions.count("segment_free") == 1 and actions.count("free_completed") == 2, actions
assert trace[0]["device_free"] == 64 << 20 and trace[0]["size"] == 100 << 20, trace[0]
assert all(isinstance(e["time_us"], int) and e["frames"] == [] for e in trace)
assert d["allocator_settings"]["expandable_segments"] is False
assert d["allocator_settings"]["garbage_collection_threshold"] == 0.0
# Python's own pickle of what it read back loads to the same value.
assert pickle.loads(pickle.dumps(d, protocol=2)) == d
print("ok", len(segs), len(trace))
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(&path)
        .arg(stats.allocated_bytes.all.current.to_string())
        .arg(stats.reserved_bytes.all.current.to_string())
        .arg(stats.active_bytes.all.current.to_string())
        .output()
        .expect("python3 must be installed to run this test (it checks that CPython reads the pickle)");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "python3 could not check the snapshot:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok 4 18");
}
