//! The profiler: ops and call counts, self and total times, record_function ranges, backward
//! nodes, memory, the schedule and its trace handler, the table's layout, the chrome trace's
//! fields; on a GPU, CUDA time attributed to the launching ops, by CUPTI (each kernel, copy
//! and fill) and by the CUDA-events fallback (an interval per op).
//!
//! One profiler runs at a time in a process, so these tests take `LOCK`. The profiler records
//! every thread (as PyTorch's does) and the other tests of this binary run beside these, so
//! the tests look at what happened inside a range of their own.

use super::common;
use ember_core::profiler::{
    self, CudaTimingSource, EventKind, FunctionEvent, GpuActivityKind, ProfilerActivity, Trace,
};
use ember_core::{DType, Device, Result, Tensor};
use std::sync::{Arc, Mutex};

pub(crate) fn lock() -> std::sync::MutexGuard<'static, ()> {
    crate::common::profiler_lock()
}

/// The direct children of the first range named `range`, by name, in order.
fn children_of<'a>(events: &'a [FunctionEvent], range: &str) -> (&'a FunctionEvent, Vec<&'a FunctionEvent>) {
    let r = events
        .iter()
        .find(|e| e.name == range)
        .unwrap_or_else(|| panic!("no range {range} among {} events", events.len()));
    (r, r.children.iter().map(|&c| &events[c]).collect())
}

fn count(events: &[&FunctionEvent], name: &str) -> usize {
    events.iter().filter(|e| e.name == name).count()
}

fn known_ops(device: Device) -> Result<()> {
    let a = Tensor::randn([64, 64], DType::F32, device)?;
    let b = Tensor::randn([64, 64], DType::F32, device)?;
    let _r = profiler::record_function("known_ops");
    for _ in 0..3 {
        a.add(&b)?;
    }
    for _ in 0..2 {
        a.matmul(&b)?;
    }
    a.relu()?;
    Ok(())
}

#[test]
fn known_ops_appear_with_their_call_counts() {
    let _l = lock();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    known_ops(Device::Cpu).unwrap();
    prof.stop().unwrap();
    let (range, ops) = children_of(prof.events(), "known_ops");
    assert_eq!(range.kind, EventKind::UserAnnotation);
    assert_eq!(
        count(&ops, "add"),
        3,
        "{:?}",
        ops.iter().map(|e| &e.name).collect::<Vec<_>>()
    );
    assert_eq!(count(&ops, "matmul"), 2);
    assert_eq!(count(&ops, "relu"), 1);
    let averages = prof.key_averages();
    assert!(averages.get("add").unwrap().count >= 3);
    assert_eq!(averages.get("known_ops").unwrap().count, 1);
    assert!(prof.trace().unwrap().gpu_timing().is_none());
}

/// A range of an earlier session that is still open (a guard on another thread, a backward
/// node that straddles the stop) keeps that session alive, and its observer installed: the
/// next session still records every op (the earlier one's observer once took the new
/// session's ops off the stack as they left, and they were lost).
#[test]
fn a_range_left_open_by_an_earlier_session_loses_no_op_of_the_next() {
    let _l = lock();
    let cpu = || profiler::profile().activities([ProfilerActivity::Cpu]);
    let mut first = cpu().start().unwrap();
    let (open_tx, open_rx) = std::sync::mpsc::channel();
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let straddling = std::thread::spawn(move || {
        let _r = profiler::record_function("straddles the stop");
        open_tx.send(()).unwrap();
        close_rx.recv().unwrap();
    });
    open_rx.recv().unwrap();
    first.stop().unwrap();
    let x = Tensor::ones([4], DType::F32, Device::Cpu).unwrap();
    let mut second = cpu().start().unwrap();
    {
        let _r = profiler::record_function("the next session");
        for _ in 0..3 {
            x.add(&x).unwrap();
        }
    }
    second.stop().unwrap();
    close_tx.send(()).unwrap();
    straddling.join().unwrap();
    let (_, ops) = children_of(second.events(), "the next session");
    assert_eq!(
        count(&ops, "add"),
        3,
        "{:?}",
        ops.iter().map(|e| &e.name).collect::<Vec<_>>()
    );
    assert!(
        second.events().iter().all(|e| e.name != "straddles the stop"),
        "a range of the first session is not the second's"
    );
}

/// Profiling cycles started and stopped while two other threads run forward and backward
/// passes over `devices` (the second device's share crossing with `to`) in a loop: every cycle
/// records each of the profiling thread's own ops. The workers' backward nodes open ranges
/// that straddle the cycles' stops (on the engine's device threads on a GPU), and an ended
/// session's observer once took the next session's ops as they left.
fn cycles_beside_backward_passes(devices: [Device; 2], profile: impl Fn(&dyn Fn()) -> profiler::Profiler) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let _l = lock();
    let stop = Arc::new(AtomicBool::new(false));
    let passes = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (stop, passes) = (stop.clone(), passes.clone());
            std::thread::spawn(move || -> Result<()> {
                let [d0, d1] = devices;
                let w = Tensor::randn([64, 64], DType::F32, d0)?.requires_grad_(true)?;
                while !stop.load(Relaxed) {
                    let far = w.to(d1)?;
                    let b = far.matmul(&far)?.sin()?.to(d0)?;
                    w.matmul(&w)?.sin()?.add(&b)?.sum_all()?.backward()?;
                    passes.fetch_add(1, Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    // The cycles begin once the workers run (on a busy machine they may start late).
    let since = std::time::Instant::now();
    while passes.load(Relaxed) < 2 {
        assert!(since.elapsed().as_secs() < 60, "the workers made no pass in 60 s");
        std::thread::yield_now();
    }
    for cycle in 0..50 {
        let device = devices[cycle % 2];
        let prof = profile(&|| known_ops(device).unwrap());
        let (_, ops) = children_of(prof.events(), "known_ops");
        let counts = ["add", "matmul", "relu"].map(|n| count(&ops, n));
        assert_eq!(counts, [3, 2, 1], "cycle {cycle} on {device}");
    }
    stop.store(true, Relaxed);
    for w in workers {
        w.join().unwrap().unwrap();
    }
}

#[test]
fn cycles_beside_backward_passes_on_other_threads_record_every_op() {
    cycles_beside_backward_passes([Device::Cpu; 2], |body| {
        let mut prof = profiler::profile()
            .activities([ProfilerActivity::Cpu])
            .start()
            .unwrap();
        body();
        prof.stop().unwrap();
        prof
    });
}

#[test]
fn ranges_contain_their_ops_and_self_time_is_at_most_total() {
    let _l = lock();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    {
        let _outer = profiler::record_function(String::from("outer"));
        let x = Tensor::randn([32, 32], DType::F32, Device::Cpu).unwrap();
        let _inner = profiler::record_function("inner");
        x.exp().unwrap().sum_all().unwrap();
    }
    prof.stop().unwrap();
    let events = prof.events();
    let (outer, outer_children) = children_of(events, "outer");
    let (inner, inner_children) = children_of(events, "inner");
    assert!(outer_children.iter().any(|e| e.name == "inner"));
    assert_eq!(count(&inner_children, "exp"), 1);
    assert_eq!(count(&inner_children, "sum"), 1, "{inner_children:?}");
    for c in &inner_children {
        assert!(c.start_ns >= inner.start_ns && c.end_ns <= inner.end_ns);
        assert_eq!(c.parent.map(|p| events[p].name.as_str()), Some("inner"));
    }
    assert!(inner.start_ns >= outer.start_ns && inner.end_ns <= outer.end_ns);
    for e in events {
        assert!(e.self_cpu_time_total_ns(events) <= e.cpu_time_total_ns());
    }
    let averages = prof.key_averages();
    let mut self_sum = 0.0;
    for r in &averages {
        assert!(r.self_cpu_time_total_us <= r.cpu_time_total_us + 1e-6, "{r:?}");
        self_sum += r.self_cpu_time_total_us;
    }
    assert!((self_sum - averages.self_cpu_time_total_us()).abs() < 1e-6);
    // The table's Self CPU % column adds up to 100 (each share is rounded to 0.01%).
    let table = averages.table("self_cpu_time_total", usize::MAX).unwrap();
    let percents: f64 = table
        .lines()
        .skip(3)
        .filter_map(|l| l.split_whitespace().find(|w| w.ends_with('%')))
        .map(|w| w.trim_end_matches('%').parse::<f64>().unwrap())
        .sum();
    assert!(
        (percents - 100.0).abs() < 0.01 * averages.len() as f64 + 0.01,
        "{percents}\n{table}"
    );
}

#[test]
fn backward_nodes_appear_under_their_own_names() {
    let _l = lock();
    let x = Tensor::randn([8, 8], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    {
        let _r = profiler::record_function("fwd_bwd");
        let y = x.mul(&x).unwrap().log_softmax(1).unwrap().sum_all().unwrap();
        y.backward().unwrap();
    }
    prof.stop().unwrap();
    let events = prof.events();
    let (_, children) = children_of(events, "fwd_bwd");
    for name in ["MulBackward0", "LogSoftmaxBackward0", "SumBackward0"] {
        let node = children.iter().find(|e| e.name == name).unwrap_or_else(|| {
            panic!(
                "no {name} in {:?}",
                children.iter().map(|e| &e.name).collect::<Vec<_>>()
            )
        });
        assert_eq!(node.kind, EventKind::Backward);
    }
    let mul_backward = children.iter().find(|e| e.name == "MulBackward0").unwrap();
    assert!(
        mul_backward.children.iter().any(|&c| events[c].name == "mul"),
        "the backward rule's ops are the node's children"
    );
}

#[test]
fn memory_and_shapes_are_recorded_when_asked() {
    let _l = lock();
    let a = Tensor::randn([128, 256], DType::F32, Device::Cpu).unwrap();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .record_shapes(true)
        .profile_memory(true)
        .start()
        .unwrap();
    {
        let _r = profiler::record_function("mem");
        let _kept = a.add(&a).unwrap();
        a.mul(&a).unwrap(); // made and dropped inside the range
    }
    prof.stop().unwrap();
    let events = prof.events();
    let (range, children) = children_of(events, "mem");
    let add = children.iter().find(|e| e.name == "add").unwrap();
    assert_eq!(add.cpu_memory_usage, 128 * 256 * 4);
    assert_eq!(
        add.input_shapes.as_deref(),
        Some(&[vec![128, 256], vec![128, 256]][..])
    );
    // The kept sum was made and freed inside the range's time; the mul's output too.
    assert_eq!(range.cpu_memory_usage, 0, "{range:?}");
    // Every row: the profiler records every thread's ops (as PyTorch's), and tests running
    // beside this one can fill the first rows with larger allocations.
    let by_shape = prof.key_averages_by_input_shape();
    let table = by_shape.table("cpu_memory_usage", usize::MAX).unwrap();
    let header = table.lines().nth(1).unwrap();
    for h in ["CPU Mem", "Self CPU Mem", "# of Calls", "Input Shapes"] {
        assert!(header.contains(h), "{header}");
    }
    assert!(table.contains("[[128, 256], [128, 256]]"), "{table}");
    assert!(table.contains("128.00 Kb"), "{table}");
}

#[test]
fn a_schedule_records_the_active_steps_and_hands_over_each_cycle() {
    let _l = lock();
    let traces: Arc<Mutex<Vec<Trace>>> = Arc::default();
    let sink = traces.clone();
    let x = Tensor::randn([16, 16], DType::F32, Device::Cpu).unwrap();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .schedule(profiler::schedule(1, 1, 2, 2))
        .on_trace_ready(move |t| sink.lock().unwrap().push(t.clone()))
        .start()
        .unwrap();
    for step in 0..10 {
        let range = profiler::record_function(format!("work_{step}"));
        x.tanh().unwrap();
        drop(range);
        prof.step().unwrap();
    }
    prof.stop().unwrap();
    let traces = traces.lock().unwrap();
    assert_eq!(traces.len(), 2, "one trace per cycle");
    for (trace, steps) in traces.iter().zip([[2, 3], [6, 7]]) {
        let names: Vec<&str> = trace.events().iter().map(|e| e.name.as_str()).collect();
        let work: Vec<&str> = names.iter().copied().filter(|n| n.starts_with("work_")).collect();
        assert_eq!(work, steps.map(|s| format!("work_{s}")), "{names:?}");
        let step_ranges: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| n.starts_with("ProfilerStep#"))
            .collect();
        assert_eq!(step_ranges, steps.map(|s| format!("ProfilerStep#{s}")));
        let (_, inside) = children_of(trace.events(), &format!("ProfilerStep#{}", steps[0]));
        assert!(inside.iter().any(|e| e.name == format!("work_{}", steps[0])));
    }
    assert_eq!(traces[1].step_num(), 8);
}

#[test]
fn a_second_profiler_is_refused_while_one_runs() {
    let _l = lock();
    let mut first = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    assert!(profiler::profile().start().is_err());
    first.stop().unwrap();
    let mut second = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    second.stop().unwrap();
}

#[test]
fn the_table_has_pytorchs_headers_and_footer() {
    let _l = lock();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .start()
        .unwrap();
    known_ops(Device::Cpu).unwrap();
    prof.stop().unwrap();
    let table = prof.key_averages().table("cpu_time_total", 3).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    let header: Vec<&str> = lines[1]
        .split("  ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(
        header,
        [
            "Name",
            "Self CPU %",
            "Self CPU",
            "CPU total %",
            "CPU total",
            "CPU time avg",
            "# of Calls"
        ]
    );
    assert!(lines[0].starts_with("---") && lines[2].starts_with("---"));
    assert_eq!(lines.len(), 3 + 3 + 2, "{table}");
    assert!(lines[6].starts_with("---"));
    assert!(lines[7].starts_with("Self CPU time total: "), "{table}");
    assert!(prof.key_averages().table("bogus", 3).is_err());
}

/// Checks what every event of a chrome trace needs for its phase; returns the events.
fn check_trace(json: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(json).expect("the trace is valid JSON");
    for key in [
        "schemaVersion",
        "deviceProperties",
        "traceEvents",
        "traceName",
        "displayTimeUnit",
    ] {
        assert!(v.get(key).is_some(), "top-level {key}");
    }
    let events = v["traceEvents"].as_array().unwrap().clone();
    let (mut starts, mut finishes) = (Vec::new(), Vec::new());
    for e in &events {
        let ph = e["ph"].as_str().expect("ph");
        assert!(
            e["name"].is_string() && e["pid"].is_u64() && e["tid"].is_u64(),
            "{e}"
        );
        assert!(e["ts"].is_number(), "{e}");
        match ph {
            "X" => {
                assert!(
                    e["dur"].as_f64().is_some_and(|d| d >= 0.0) && e["cat"].is_string(),
                    "{e}"
                );
            }
            "s" | "f" => {
                assert_eq!(e["cat"], "ac2g");
                let id = e["id"].as_u64().expect("flow id");
                if ph == "s" { &mut starts } else { &mut finishes }.push(id);
            }
            "M" => assert!(e["args"].is_object(), "{e}"),
            other => panic!("unexpected phase {other}"),
        }
    }
    starts.sort_unstable();
    finishes.sort_unstable();
    assert_eq!(starts, finishes, "every flow start has a finish");
    events
}

#[test]
fn the_chrome_trace_has_the_fields_each_phase_needs() {
    let _l = lock();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .record_shapes(true)
        .start()
        .unwrap();
    known_ops(Device::Cpu).unwrap();
    prof.stop().unwrap();
    let path = std::env::temp_dir().join(format!("ember_trace_{}.json", std::process::id()));
    prof.export_chrome_trace(&path).unwrap();
    let json = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let events = check_trace(&json);
    let ops: Vec<_> = events.iter().filter(|e| e["cat"] == "cpu_op").collect();
    assert!(
        ops.iter()
            .any(|e| e["name"] == "matmul"
                && e["args"]["Input Dims"] == serde_json::json!([[64, 64], [64, 64]]))
    );
    assert!(events
        .iter()
        .any(|e| e["cat"] == "user_annotation" && e["name"] == "known_ops"));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["name"] == "thread_name"));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["name"] == "process_name"));
}

#[test]
fn record_function_without_a_profiler_records_nothing() {
    let _l = lock();
    let _r = profiler::record_function("nobody listens");
    Tensor::ones([2], DType::F32, Device::Cpu).unwrap().neg().unwrap();
}

// ---- GPU: CUDA time by events, attributed to the launching ops ----

/// Checks that `range`'s CUDA time is its `ops`' (none of its own) and that the matmul has
/// self CUDA time in the averages; returns the table sorted by CUDA total.
fn cuda_totals_add_up(prof: &profiler::Profiler, range: &FunctionEvent, ops: &[&FunctionEvent]) -> String {
    let op_total: u64 = ops.iter().map(|e| e.cuda_time_total_ns).sum();
    assert_eq!(
        range.cuda_time_total_ns, op_total,
        "a range's CUDA time is its ops'"
    );
    assert_eq!(range.self_cuda_time_total_ns, 0);
    let averages = prof.key_averages();
    assert!(averages.get("matmul").unwrap().self_cuda_time_total_us > 0.0);
    averages.table("cuda_time_total", 10).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_time_is_attributed_to_the_launching_ops() {
    let _l = lock();
    let dev = common::gpu();
    known_ops(dev).unwrap(); // warm-up: kernels compiled, cuBLASLt plans made
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .cuda_timing(CudaTimingSource::CudaEvents)
        .start()
        .unwrap();
    known_ops(dev).unwrap();
    prof.stop().unwrap();
    let trace = prof.trace().unwrap();
    assert_eq!(trace.gpu_timing(), Some("cuda events"));
    assert_eq!(prof.cuda_timing_source(), Some(CudaTimingSource::CudaEvents));
    let events = prof.events();
    let (range, ops) = children_of(events, "known_ops");
    for name in ["add", "matmul", "relu"] {
        for op in ops.iter().filter(|e| e.name == name) {
            let gpu = op
                .gpu
                .as_ref()
                .unwrap_or_else(|| panic!("{name} has no GPU interval"));
            assert!(gpu.duration_ns > 0 && gpu.launches > 0, "{name}: {gpu:?}");
            assert!(op.self_cuda_time_total_ns > 0, "{name}");
        }
    }
    let table = cuda_totals_add_up(&prof, range, &ops);
    for h in ["Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg"] {
        assert!(table.lines().nth(1).unwrap().contains(h), "{table}");
    }
    assert!(table.contains("Self CUDA time total: "), "{table}");
    let events = check_trace(&trace.chrome_trace_json());
    let kernels: Vec<_> = events.iter().filter(|e| e["cat"] == "kernel").collect();
    assert!(kernels.iter().any(|e| e["name"] == "matmul"));
    assert!(
        events.iter().any(|e| e["ph"] == "s"),
        "launches are linked to their GPU intervals"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_backward_kernels_are_under_backward_nodes() {
    let _l = lock();
    let dev = common::gpu();
    let run = || -> Result<()> {
        let a = Tensor::randn([256, 256], DType::F32, dev)?.requires_grad_(true)?;
        let b = Tensor::randn([256, 256], DType::F32, dev)?.requires_grad_(true)?;
        a.matmul(&b)?.relu()?.sum_all()?.backward()
    };
    run().unwrap(); // warm-up
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .profile_memory(true)
        .start()
        .unwrap();
    {
        let _r = profiler::record_function("step");
        run().unwrap();
    }
    prof.stop().unwrap();
    let events = prof.events();
    let (_, children) = children_of(events, "step");
    let node = children
        .iter()
        .find(|e| e.name == "MatmulBackward0")
        .unwrap_or_else(|| panic!("{:?}", children.iter().map(|e| &e.name).collect::<Vec<_>>()));
    // The node's products run inside its backward rule (no dispatched op of their own), so
    // their kernels are the node's own CUDA time.
    assert!(node.self_cuda_time_total_ns > 0, "{node:?}");
    assert!(
        node.self_cuda_time_total_ns <= node.cuda_time_total_ns,
        "{node:?}"
    );
    let relu = children
        .iter()
        .find(|e| e.name == "ReluBackward0")
        .expect("relu's backward node is recorded");
    assert!(relu.cuda_time_total_ns > 0, "{relu:?}");
    let matmul = children.iter().find(|e| e.name == "matmul").unwrap();
    assert!(
        matmul.cuda_memory_usage > 0,
        "the product's output is CUDA memory"
    );
}

// ---- GPU: CUDA time by CUPTI, each kernel attributed through correlation ids ----

/// Note [CUPTI under compute-sanitizer]: where compute-sanitizer's injection variable is set,
/// the default timing (CUPTI) falls back to CUDA events and says why, and the ops still get
/// their GPU time.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_profiler_keeps_off_cupti_under_compute_sanitizer() {
    common::in_own_process_with_env(
        "profiler::cuda_profiler_keeps_off_cupti_under_compute_sanitizer",
        &[("NV_SANITIZER_INJECTION_PORT_BASE", "49152")],
        || {
            let dev = common::gpu();
            known_ops(dev).unwrap(); // warm-up
            let mut prof = profiler::profile()
                .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
                .start()
                .unwrap();
            known_ops(dev).unwrap();
            prof.stop().unwrap();
            assert_eq!(prof.cuda_timing_source(), Some(CudaTimingSource::CudaEvents));
            let trace = prof.trace().unwrap();
            let why = trace.cupti_unavailable().expect("the reason CUPTI was not used");
            assert!(why.contains("compute-sanitizer"), "{why}");
            assert!(trace.gpu_activities().is_empty());
            let (_, ops) = children_of(prof.events(), "known_ops");
            let matmul = ops.iter().find(|e| e.name == "matmul").expect("the matmul op");
            assert!(matmul.self_cuda_time_total_ns > 0, "{:?}", matmul.gpu);
        },
    );
}

/// Profiles `body` on the GPU with the default timing (CUPTI), asserting CUPTI ran.
pub(crate) fn cupti_profile(body: impl FnOnce()) -> profiler::Profiler {
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .start()
        .unwrap();
    body();
    prof.stop().unwrap();
    let trace = prof.trace().unwrap();
    assert_eq!(
        prof.cuda_timing_source(),
        Some(CudaTimingSource::Cupti),
        "CUPTI did not run: {:?} (ember_core::cuda::cupti_version: {:?})",
        trace.cupti_unavailable(),
        ember_core::cuda::cupti_version()
    );
    assert_eq!(trace.gpu_timing(), Some("cupti"));
    prof
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cupti_attributes_each_kernel_to_the_launching_op() {
    let _l = lock();
    let dev = common::gpu();
    known_ops(dev).unwrap(); // warm-up
    let prof = cupti_profile(|| known_ops(dev).unwrap());
    let trace = prof.trace().unwrap();
    let (events, activities) = (trace.events(), trace.gpu_activities());
    let (range, ops) = children_of(events, "known_ops");
    for name in ["add", "matmul", "relu"] {
        let mut seen = 0;
        for op in ops.iter().filter(|e| e.name == name) {
            seen += 1;
            assert!(
                op.gpu_activities
                    .iter()
                    .any(|&a| activities[a].kind == GpuActivityKind::Kernel),
                "{name} has no kernels: {op:?}"
            );
            let mut own = 0;
            for &a in &op.gpu_activities {
                let k = &activities[a];
                assert_eq!(k.external_id, Some(op.id), "{name}: {k:?}");
                assert!(k.duration_ns > 0 && !k.name.is_empty(), "{k:?}");
                assert!(
                    k.start_ns + 1_000_000 >= op.start_ns,
                    "a kernel starts after its launch (1 ms of clock slack): {k:?} {op:?}"
                );
                own += k.duration_ns;
            }
            assert_eq!(op.self_cuda_time_total_ns, own, "{name}");
            assert!(op.self_cuda_time_total_ns > 0, "{name}");
        }
        assert!(seen > 0, "no {name} op");
    }
    let table = cuda_totals_add_up(&prof, range, &ops);
    assert!(table.contains("CUDA time measured by: cupti"), "{table}");

    // The trace: each matmul kernel is a `kernel` event with the op's id and a flow from it.
    let json = check_trace(&trace.chrome_trace_json());
    let matmul = ops.iter().find(|e| e.name == "matmul").unwrap();
    let kernels: Vec<_> = json
        .iter()
        .filter(|e| {
            ["kernel", "gpu_memset", "gpu_memcpy"].contains(&e["cat"].as_str().unwrap_or(""))
                && e["args"]["External id"].as_u64() == Some(matmul.id)
        })
        .collect();
    assert_eq!(kernels.len(), matmul.gpu_activities.len());
    for k in kernels {
        for key in ["correlation", "stream", "device", "context"] {
            assert!(k["args"][key].is_u64(), "{key}: {k}");
        }
        let corr = k["args"]["correlation"].as_u64().unwrap();
        let flow: Vec<_> = json
            .iter()
            .filter(|e| e["cat"] == "ac2g" && e["id"].as_u64() == Some(corr))
            .collect();
        assert_eq!(flow.len(), 2, "{k}");
        assert_eq!(flow[1]["tid"], k["tid"]);
        assert_eq!(flow[0]["tid"].as_u64(), Some(matmul.thread));
        // The driver or runtime call that launched it, on the op's thread, where the flow
        // starts (trace tools tie kernels to the host through these).
        let launch: Vec<_> = json
            .iter()
            .filter(|e| {
                ["cuda_driver", "cuda_runtime"].contains(&e["cat"].as_str().unwrap_or(""))
                    && e["args"]["correlation"].as_u64() == Some(corr)
            })
            .collect();
        assert_eq!(launch.len(), 1, "{k}");
        let l = launch[0];
        assert_eq!(l["args"]["External id"].as_u64(), Some(matmul.id), "{l}");
        assert_eq!(l["tid"].as_u64(), Some(matmul.thread), "{l}");
        assert_eq!(flow[0]["ts"], l["ts"], "{l}");
        let name = l["name"].as_str().unwrap();
        assert!(
            name.starts_with("cu") && !name.contains(' '),
            "named by CUPTI: {l}"
        );
    }
    assert!(!trace.cuda_api_calls().is_empty());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cupti_reports_copies_and_fills_and_backward_kernels() {
    let _l = lock();
    let dev = common::gpu();
    let run = || -> Result<()> {
        let host = Tensor::randn([256, 256], DType::F32, Device::Cpu)?;
        let a = host.to(dev)?.requires_grad_(true)?;
        let b = Tensor::randn([256, 256], DType::F32, dev)?.requires_grad_(true)?;
        let z = Tensor::ones([1024], DType::F32, dev)?;
        z.fill_(0.0)?;
        a.matmul(&b)?.relu()?.sum_all()?.backward()
    };
    run().unwrap(); // warm-up
    let prof = cupti_profile(|| {
        let _r = profiler::record_function("step");
        run().unwrap();
    });
    let trace = prof.trace().unwrap();
    let (events, activities) = (trace.events(), trace.gpu_activities());
    let ours = |a: &&profiler::GpuActivity| a.event.is_some_and(|i| under(events, i, "step"));
    let copies: Vec<_> = activities
        .iter()
        .filter(ours)
        .filter(|a| a.kind == GpuActivityKind::Memcpy)
        .collect();
    assert!(
        copies
            .iter()
            .any(|a| a.name.starts_with("Memcpy HtoD") && a.bytes >= 256 * 256 * 4),
        "the host-to-device copy of `to`: {copies:?}"
    );
    let fills: Vec<_> = activities
        .iter()
        .filter(ours)
        .filter(|a| a.kind == GpuActivityKind::Memset)
        .collect();
    // `Tensor::ones` on a GPU is a memset outside any op: it belongs to the open range.
    assert!(
        fills.iter().any(|a| a.bytes >= 1024 * 4),
        "Tensor::ones as a memset under the range: {fills:?}"
    );
    let (_, children) = children_of(events, "step");
    let node = children
        .iter()
        .find(|e| e.name == "MatmulBackward0")
        .unwrap_or_else(|| panic!("{:?}", children.iter().map(|e| &e.name).collect::<Vec<_>>()));
    assert!(node.self_cuda_time_total_ns > 0, "{node:?}");
    assert!(node
        .gpu_activities
        .iter()
        .any(|&a| activities[a].kind == GpuActivityKind::Kernel));
    check_trace(&trace.chrome_trace_json());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cupti_records_every_cycle_of_a_schedule() {
    // A warm-up cycle stops CUPTI and the active cycle starts it again; each saved cycle must
    // still hold the kernels of its own steps, attributed to their ops.
    let _l = lock();
    let dev = common::gpu();
    known_ops(dev).unwrap(); // warm-up
    let traces: Arc<Mutex<Vec<Trace>>> = Arc::default();
    let sink = traces.clone();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .schedule(profiler::schedule(1, 1, 2, 2))
        .on_trace_ready(move |t| sink.lock().unwrap().push(t.clone()))
        .start()
        .unwrap();
    for _ in 0..10 {
        known_ops(dev).unwrap();
        prof.step().unwrap();
    }
    prof.stop().unwrap();
    let traces = traces.lock().unwrap();
    assert_eq!(traces.len(), 2, "one trace per cycle");
    for trace in traces.iter() {
        assert_eq!(
            trace.gpu_timing(),
            Some("cupti"),
            "{:?}",
            trace.cupti_unavailable()
        );
        let (events, activities) = (trace.events(), trace.gpu_activities());
        // This thread's: the tests running beside this one make matmuls of their own.
        let mine = events
            .iter()
            .find(|e| e.name == "known_ops")
            .map(|e| e.thread)
            .expect("a known_ops range in the cycle");
        let matmuls: Vec<_> = events
            .iter()
            .filter(|e| e.name == "matmul" && e.thread == mine)
            .collect();
        assert_eq!(matmuls.len(), 2 * 2, "two matmuls in each of two active steps");
        for op in matmuls {
            assert!(
                op.gpu_activities
                    .iter()
                    .any(|&a| activities[a].kind == GpuActivityKind::Kernel),
                "a matmul of an active step has no kernel ({} activities in the cycle): {op:?}",
                activities.len()
            );
        }
        let json = check_trace(&trace.chrome_trace_json());
        let kernels = json.iter().filter(|e| e["cat"] == "kernel").count();
        assert!(kernels >= 2 * 6, "{kernels} kernel events in the cycle's trace");
        let launches = json
            .iter()
            .filter(|e| ["cuda_driver", "cuda_runtime"].contains(&e["cat"].as_str().unwrap_or("")))
            .count();
        assert!(launches >= 2 * 6, "{launches} launch calls in the cycle's trace");
    }
}

/// True when event `i` is `name` or lies under it.
fn under(events: &[FunctionEvent], mut i: usize, name: &str) -> bool {
    loop {
        if events[i].name == name {
            return true;
        }
        match events[i].parent {
            Some(p) => i = p,
            None => return false,
        }
    }
}

/// CUPTI sessions start and stop while four other threads launch kernels for the first time
/// in the process (every unary op on every dtype, contiguous and transposed: units loaded
/// and functions first launched under the sessions' starts and stops). Before Note [CUPTI
/// beside other threads' CUDA work] (`cuda_backend/cupti.rs`), 15 of 89 processes of this test died
/// in libcupti or hung.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cupti_sessions_cycle_while_other_threads_load_kernels() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let dev = common::gpu();
    let _l = lock();
    let launched = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = common::ALL_DTYPES
        .chunks(2)
        .map(|dtypes| {
            let dtypes = dtypes.to_vec();
            let (launched, go) = (launched.clone(), go.clone());
            std::thread::spawn(move || -> Result<()> {
                let flat = Tensor::from_vec(common::values(9 * 13, 5), [9, 13], Device::Cpu)?;
                while !go.load(Relaxed) {
                    std::thread::yield_now();
                }
                for dtype in dtypes {
                    let x = flat.to_dtype(dtype)?.to(dev)?;
                    for op in super::cuda_unary::all_ops() {
                        if op.result_dtype(dtype).is_err() {
                            continue;
                        }
                        x.unary_op(op)?;
                        x.t()?.unary_op(op)?;
                        launched.fetch_add(2, Relaxed);
                    }
                }
                Ok(())
            })
        })
        .collect();
    known_ops(dev).unwrap(); // the cycles' own kernels are loaded before the workers start
    go.store(true, Relaxed);
    let mut cycle = 0;
    // Until every worker has ended (done, failed or panicked: the joins below say which).
    while !workers.iter().all(|w| w.is_finished()) || cycle < 20 {
        let prof = cupti_profile(|| known_ops(dev).unwrap());
        let (_, ops) = children_of(prof.events(), "known_ops");
        let counts = ["add", "matmul", "relu"].map(|n| count(&ops, n));
        assert_eq!(counts, [3, 2, 1], "cycle {cycle}");
        cycle += 1;
    }
    for w in workers {
        w.join().unwrap().unwrap();
    }
    assert!(launched.load(Relaxed) > 100, "{} ops", launched.load(Relaxed));
}

/// As `cycles_beside_backward_passes_on_other_threads_record_every_op`, with CUPTI turned on
/// and off by every cycle while the workers launch on two GPUs and their backward passes run
/// the second GPU's nodes on the engine's device thread. Runs on a two-GPU machine (`--skip
/// two_gpus` elsewhere).
#[test]
#[ignore = "needs two CUDA devices"]
fn cuda_cupti_cycles_beside_backward_passes_over_two_gpus_record_every_op() {
    let (d0, d1) = common::two_gpus();
    cycles_beside_backward_passes([d0, d1], |body| cupti_profile(body));
}

/// `Tensor::empty` on a GPU takes memory from the caching allocator and queues no work (as
/// `torch.empty`); `zeros` queues its fill, which CUPTI reports under the range that made it.
/// Only the work of this thread's own two ranges counts: their names are the test's own (a
/// range named `zeros` would also match the `zeros` op of any test running beside this one,
/// whose fill CUPTI attributes to that op), and an activity counts when the op that launched
/// it lies under the range event itself, so on this thread.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_empty_queues_no_fill_and_zeros_one_per_cupti() {
    const RANGES: [&str; 2] = ["empty_queues_no_fill: empty", "empty_queues_no_fill: zeros"];
    let dev = common::gpu();
    let _l = lock();
    let mut made = Vec::new();
    let prof = cupti_profile(|| {
        for range in RANGES {
            let _r = profiler::record_function(range);
            let t = if range == RANGES[0] {
                Tensor::empty([1 << 20], DType::F32, dev)
            } else {
                Tensor::zeros([1 << 20], DType::F32, dev)
            };
            made.push(t.unwrap());
        }
    });
    for t in &made {
        assert_eq!(
            (t.dims(), t.dtype(), t.device()),
            (&[1usize << 20][..], DType::F32, dev)
        );
    }
    let trace = prof.trace().unwrap();
    let (events, activities) = (trace.events(), trace.gpu_activities());
    let work_under = |range: &str| -> Vec<GpuActivityKind> {
        let mut ours = events.iter().enumerate().filter(|(_, e)| e.name == range);
        let (r, _) = ours.next().unwrap_or_else(|| panic!("no range {range}"));
        assert!(ours.next().is_none(), "one range {range}");
        activities
            .iter()
            .filter(|a| a.event.is_some_and(|i| under_event(events, i, r)))
            .map(|a| a.kind)
            .collect()
    };
    assert_eq!(work_under(RANGES[0]), vec![], "empty queued work");
    assert_eq!(
        work_under(RANGES[1]),
        vec![GpuActivityKind::Memset],
        "zeros' one fill"
    );
}

/// True when event `i` is event `r` or lies under it (so on `r`'s thread).
fn under_event(events: &[FunctionEvent], mut i: usize, r: usize) -> bool {
    loop {
        if i == r {
            return true;
        }
        match events[i].parent {
            Some(p) => i = p,
            None => return false,
        }
    }
}
