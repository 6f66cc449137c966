//! A trace as Kineto writes it (`libkineto/src/output_json.cpp`), which `chrome://tracing`,
//! Perfetto, TensorBoard's profiler plugin and PyTorch's trace tools read:
//!
//! - top level: `schemaVersion`, `deviceProperties` (one entry per GPU in the trace),
//!   `traceEvents`, `traceName`, `displayTimeUnit`, `baseTimeNanoseconds`;
//! - complete events (`ph: "X"`, `ts` and `dur` in µs; `ts` counts from
//!   `baseTimeNanoseconds`, the trace's start in ns since the Unix epoch, as Kineto's relative
//!   timestamps do): ops (`cpu_op`)
//!   and ranges (`user_annotation`) on the host process (`pid` = process id, `tid` = the
//!   profiler's thread number); on the device (`pid` = the device index), with CUPTI each
//!   kernel, memcpy and memset (`kernel`, `gpu_memcpy`, `gpu_memset`, `tid` = CUPTI's stream
//!   id, `args` as Kineto writes them: `External id` (the launching op's id), `correlation`,
//!   `device`, `context`, `stream`, and the grid, block, registers and shared memory of a
//!   kernel or the bytes and bandwidth of a copy or fill); with CUDA events each op's GPU
//!   interval (`kernel`, named after the op, `tid` = the stream's number: 7 for the default
//!   stream, as CUDA numbers it, then 8, 9, ... in order of appearance);
//! - with CUPTI, the driver and runtime calls that launched device work from inside an op
//!   (`cuda_driver` / `cuda_runtime`, on the op's thread, `args`: `External id`,
//!   `correlation`), which is how trace tools (HolisticTraceAnalysis) tie a kernel to the host;
//! - flow events linking a launch to its device work (`ph: "s"` on the launching call, or on
//!   the op at its start where no call was recorded, `ph: "f"` with `bp: "e"` on the device
//!   event, `cat: "ac2g"`; `id` = CUPTI's correlation id, or with CUDA events the op's id,
//!   which is then also the `correlation`);
//! - metadata events (`ph: "M"`) naming the processes (`process_name`, `process_labels`,
//!   `process_sort_index`) and the threads and streams (`thread_name`, `thread_sort_index`).

use super::{CudaTimingSource, EventKind, GpuActivityKind, Trace};
use std::collections::HashMap;
use std::fmt::Write;

/// Appends `s` as a JSON string.
fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// µs with ns precision, as Kineto prints timestamps.
fn micros(us: f64) -> String {
    format!("{us:.3}")
}

fn shapes_json(shapes: &[Vec<usize>]) -> String {
    let inner: Vec<String> = shapes
        .iter()
        .map(|d| {
            format!(
                "[{}]",
                d.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    format!("[{}]", inner.join(", "))
}

pub(super) fn to_json(trace: &Trace) -> String {
    let pid = std::process::id() as u64;
    let ts = |ns: u64| ns as f64 / 1e3;
    let mut streams: HashMap<(usize, u64), u64> = HashMap::new();
    let mut devices: Vec<usize> = Vec::new();
    let cupti = trace.timing == Some(CudaTimingSource::Cupti);
    for a in &trace.gpu_activities {
        if !devices.contains(&a.device) {
            devices.push(a.device);
        }
        streams.insert((a.device, a.stream), a.stream);
    }
    for e in trace.events.iter().filter(|_| !cupti) {
        if let Some(g) = &e.gpu {
            if !devices.contains(&g.device) {
                devices.push(g.device);
            }
            let next = 8 + streams.iter().filter(|((_, raw), _)| *raw != 0).count() as u64;
            streams
                .entry((g.device, g.stream))
                .or_insert(if g.stream == 0 { 7 } else { next });
        }
    }
    devices.sort_unstable();

    let mut events: Vec<String> = Vec::new();
    for (i, e) in trace.events.iter().enumerate() {
        let cat = match e.kind {
            EventKind::Op | EventKind::Backward => "cpu_op",
            EventKind::UserAnnotation | EventKind::ProfilerStep => "user_annotation",
        };
        let mut s = String::from("{\"ph\": \"X\", \"cat\": ");
        string(&mut s, cat);
        s.push_str(", \"name\": ");
        string(&mut s, &e.name);
        let _ = write!(
            s,
            ", \"pid\": {pid}, \"tid\": {}, \"ts\": {}, \"dur\": {}, \"args\": {{\"External id\": {}, \"Ev Idx\": {i}",
            e.thread,
            micros(ts(e.start_ns)),
            micros(e.cpu_time_total_ns() as f64 / 1e3),
            e.id
        );
        if let Some(shapes) = &e.input_shapes {
            let _ = write!(s, ", \"Input Dims\": {}", shapes_json(shapes));
        }
        if let Some(d) = e.device {
            s.push_str(", \"Device\": ");
            string(&mut s, &d.to_string());
        }
        s.push_str("}}");
        events.push(s);

        if let Some(g) = e.gpu.as_ref().filter(|_| !cupti) {
            let tid = streams[&(g.device, g.stream)];
            let gpu_ts = micros(ts(g.start_ns));
            let mut k = String::from("{\"ph\": \"X\", \"cat\": \"kernel\", \"name\": ");
            string(&mut k, &e.name);
            let _ = write!(
                k,
                ", \"pid\": {}, \"tid\": {tid}, \"ts\": {gpu_ts}, \"dur\": {}, \"args\": {{\"External id\": {}, \"correlation\": {}, \"device\": {}, \"stream\": {tid}, \"launches\": {}, \"timing\": \"cuda events\"}}}}",
                g.device,
                micros(g.duration_ns as f64 / 1e3),
                e.id,
                e.id,
                g.device,
                g.launches
            );
            events.push(k);
            events.push(format!(
                "{{\"ph\": \"s\", \"id\": {}, \"pid\": {pid}, \"tid\": {}, \"ts\": {}, \"cat\": \"ac2g\", \"name\": \"ac2g\"}}",
                e.id,
                e.thread,
                micros(ts(e.start_ns))
            ));
            events.push(format!(
                "{{\"ph\": \"f\", \"id\": {}, \"pid\": {}, \"tid\": {tid}, \"ts\": {gpu_ts}, \"cat\": \"ac2g\", \"name\": \"ac2g\", \"bp\": \"e\"}}",
                e.id, g.device
            ));
        }
    }

    let launches: HashMap<u32, &super::CudaApiCall> =
        trace.api_calls.iter().map(|c| (c.correlation, c)).collect();
    for c in &trace.api_calls {
        let mut e = String::from("{\"ph\": \"X\", \"cat\": ");
        string(&mut e, if c.driver { "cuda_driver" } else { "cuda_runtime" });
        e.push_str(", \"name\": ");
        string(&mut e, &c.name);
        let _ = write!(
            e,
            ", \"pid\": {pid}, \"tid\": {}, \"ts\": {}, \"dur\": {}, \"args\": {{\"External id\": {}, \"correlation\": {}}}}}",
            c.thread,
            micros(ts(c.start_ns)),
            micros(c.duration_ns as f64 / 1e3),
            c.external_id,
            c.correlation
        );
        events.push(e);
    }
    for a in &trace.gpu_activities {
        events.extend(activity_json(
            trace,
            a,
            pid,
            launches.get(&a.correlation).copied(),
        ));
    }

    // Metadata: the host process and its threads, each device and its streams.
    let meta = |name: &str, pid: u64, tid: u64, args: String| {
        format!(
            "{{\"name\": \"{name}\", \"ph\": \"M\", \"ts\": {}, \"pid\": {pid}, \"tid\": {tid}, \"args\": {{{args}}}}}",
            micros(0.0)
        )
    };
    let quoted = |s: &str| {
        let mut q = String::new();
        string(&mut q, s);
        q
    };
    events.push(meta(
        "process_name",
        pid,
        0,
        format!("\"name\": {}", quoted("ember")),
    ));
    events.push(meta("process_labels", pid, 0, "\"labels\": \"CPU\"".to_string()));
    events.push(meta(
        "process_sort_index",
        pid,
        0,
        format!("\"sort_index\": {pid}"),
    ));
    for (n, name) in &trace.threads {
        events.push(meta(
            "thread_name",
            pid,
            *n,
            format!("\"name\": {}", quoted(name)),
        ));
        events.push(meta("thread_sort_index", pid, *n, format!("\"sort_index\": {n}")));
    }
    for &d in &devices {
        let d64 = d as u64;
        events.push(meta(
            "process_name",
            d64,
            0,
            format!("\"name\": {}", quoted("ember")),
        ));
        events.push(meta("process_labels", d64, 0, format!("\"labels\": \"GPU {d}\"")));
        events.push(meta(
            "process_sort_index",
            d64,
            0,
            format!("\"sort_index\": {}", 0x1000000 + d64),
        ));
        let mut ours: Vec<u64> = streams
            .iter()
            .filter(|((dev, _), _)| *dev == d)
            .map(|(_, t)| *t)
            .collect();
        ours.sort_unstable();
        for tid in ours {
            events.push(meta(
                "thread_name",
                d64,
                tid,
                format!("\"name\": \"stream {tid}\""),
            ));
            events.push(meta(
                "thread_sort_index",
                d64,
                tid,
                format!("\"sort_index\": {tid}"),
            ));
        }
    }

    let mut out = String::from("{\n  \"schemaVersion\": 1,\n  \"deviceProperties\": [");
    let props: Vec<String> = devices
        .iter()
        .filter_map(|&d| {
            let p = crate::cuda_backend::get_device_properties(d).ok()?;
            Some(format!(
                "\n    {{\"id\": {d}, \"name\": {}, \"totalGlobalMem\": {}, \"computeMajor\": {}, \"computeMinor\": {}, \"maxThreadsPerMultiprocessor\": {}, \"warpSize\": {}, \"numSms\": {}, \"l2CacheSize\": {}}}",
                quoted(&p.name),
                p.total_memory,
                p.major,
                p.minor,
                p.max_threads_per_multi_processor,
                p.warp_size,
                p.multi_processor_count,
                p.l2_cache_size
            ))
        })
        .collect();
    out.push_str(&props.join(","));
    if !props.is_empty() {
        out.push_str("\n  ");
    }
    out.push_str("],\n  \"traceEvents\": [\n    ");
    out.push_str(&events.join(",\n    "));
    let _ = write!(
        out,
        "\n  ],\n  \"traceName\": \"\",\n  \"displayTimeUnit\": \"ms\",\n  \"baseTimeNanoseconds\": {}\n}}\n",
        (trace.start_unix_us * 1e3) as u128
    );
    out
}

/// A CUPTI activity as Kineto writes it, and the flow from the call that launched it (or its
/// op) when it has one.
fn activity_json(
    trace: &Trace,
    a: &super::GpuActivity,
    pid: u64,
    launch: Option<&super::CudaApiCall>,
) -> Vec<String> {
    let ts = micros(a.start_ns as f64 / 1e3);
    let mut k = String::from("{\"ph\": \"X\", \"cat\": ");
    string(&mut k, a.kind.category());
    k.push_str(", \"name\": ");
    string(&mut k, &a.name);
    let _ = write!(
        k,
        ", \"pid\": {}, \"tid\": {}, \"ts\": {ts}, \"dur\": {}, \"args\": {{\"External id\": {}, \"device\": {}, \"context\": {}, \"stream\": {}, \"correlation\": {}",
        a.device,
        a.stream,
        micros(a.duration_ns as f64 / 1e3),
        a.external_id.unwrap_or(0),
        a.device,
        a.context,
        a.stream,
        a.correlation
    );
    match a.kind {
        GpuActivityKind::Kernel => {
            let _ = write!(
                k,
                ", \"registers per thread\": {}, \"shared memory\": {}, \"grid\": [{}, {}, {}], \"block\": [{}, {}, {}]",
                a.registers_per_thread,
                a.shared_memory,
                a.grid[0],
                a.grid[1],
                a.grid[2],
                a.block[0],
                a.block[1],
                a.block[2]
            );
        }
        GpuActivityKind::Memcpy | GpuActivityKind::Memset => {
            // Bytes per ns are GB/s.
            let bandwidth = a.bytes as f64 / a.duration_ns.max(1) as f64;
            let _ = write!(
                k,
                ", \"bytes\": {}, \"memory bandwidth (GB/s)\": {bandwidth:.6}",
                a.bytes
            );
        }
    }
    k.push_str("}}");
    let mut out = vec![k];
    let from = match (launch, a.event.and_then(|i| trace.events.get(i))) {
        (Some(call), _) => Some((call.thread, call.start_ns)),
        (None, Some(op)) => Some((op.thread, op.start_ns)),
        (None, None) => None,
    };
    if let Some((thread, start_ns)) = from {
        out.push(format!(
            "{{\"ph\": \"s\", \"id\": {}, \"pid\": {pid}, \"tid\": {thread}, \"ts\": {}, \"cat\": \"ac2g\", \"name\": \"ac2g\"}}",
            a.correlation,
            micros(start_ns as f64 / 1e3)
        ));
        out.push(format!(
            "{{\"ph\": \"f\", \"id\": {}, \"pid\": {}, \"tid\": {}, \"ts\": {ts}, \"cat\": \"ac2g\", \"name\": \"ac2g\", \"bp\": \"e\"}}",
            a.correlation, a.device, a.stream
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{FunctionEvent, GpuInterval};
    use super::*;

    fn event(id: u64, name: &str, start_ns: u64, end_ns: u64, gpu: Option<GpuInterval>) -> FunctionEvent {
        FunctionEvent {
            id,
            name: name.to_string(),
            kind: EventKind::Op,
            thread: 1,
            start_ns,
            end_ns,
            device: Some(crate::Device::Cuda(0)),
            input_shapes: Some(vec![vec![2, 3], vec![]]),
            parent: None,
            children: Vec::new(),
            cpu_memory_usage: 0,
            cuda_memory_usage: 0,
            self_cpu_memory_usage: 0,
            self_cuda_memory_usage: 0,
            gpu_activities: Vec::new(),
            cuda_time_total_ns: gpu.as_ref().map_or(0, |g| g.duration_ns),
            self_cuda_time_total_ns: gpu.as_ref().map_or(0, |g| g.duration_ns),
            gpu,
        }
    }

    #[test]
    fn gpu_intervals_get_kernel_events_and_flows() {
        let gpu = |stream, start_ns| GpuInterval {
            device: 0,
            stream,
            start_ns,
            duration_ns: 2500,
            launches: 2,
        };
        let trace = Trace {
            events: vec![
                event(5, "matmul", 1000, 9000, Some(gpu(0, 4000))),
                event(6, "add \"quoted\"", 9000, 12000, Some(gpu(0xdead, 12000))),
                event(7, "view", 12000, 12500, None),
            ],
            threads: vec![(1, "thread 1 (main)".to_string())],
            start_unix_us: 1.7e15,
            step_num: 0,
            profile_memory: false,
            cuda: true,
            timing: Some(CudaTimingSource::CudaEvents),
            cupti_unavailable: None,
            gpu_activities: Vec::new(),
            api_calls: Vec::new(),
        };
        let v: serde_json::Value = serde_json::from_str(&to_json(&trace)).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let kernels: Vec<_> = events.iter().filter(|e| e["cat"] == "kernel").collect();
        assert_eq!(kernels.len(), 2);
        assert_eq!(kernels[0]["ts"].as_f64(), Some(4.0));
        assert_eq!(kernels[0]["dur"].as_f64(), Some(2.5));
        assert_eq!(
            (kernels[0]["pid"].as_u64(), kernels[0]["tid"].as_u64()),
            (Some(0), Some(7))
        );
        assert_eq!(kernels[1]["tid"].as_u64(), Some(8));
        assert_eq!(kernels[1]["name"], "add \"quoted\"");
        for id in [5, 6] {
            let flow: Vec<_> = events.iter().filter(|e| e["id"] == id).collect();
            assert_eq!(flow.len(), 2);
            assert_eq!(
                (flow[0]["ph"].as_str(), flow[1]["ph"].as_str()),
                (Some("s"), Some("f"))
            );
            assert_eq!(flow[1]["bp"], "e");
        }
        let stream_names: Vec<_> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == 0)
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(stream_names, ["stream 7", "stream 8"]);
        assert_eq!(v["baseTimeNanoseconds"].as_u64(), Some(1_700_000_000_000_000_000));
    }

    /// A trace timed by CUPTI, from fake activity buffers laid out as CUPTI 13 writes them:
    /// `matmul` (id 5) launched two kernels, its child `fill` (id 6) a memset, `copy` (id 7)
    /// a memcpy; one kernel ran outside any op.
    fn cupti_trace() -> Trace {
        use crate::cuda_backend::cupti::Collected;
        use crate::cuda_backend::cupti_records::{decode, tests as rec};
        let gemm = c"sm90_xmma_gemm_f32f32_tn";
        let stray = c"stray_kernel";
        let mut matmul = event(5, "matmul", 1_000, 20_000, None);
        let mut fill = event(6, "fill_", 2_000, 3_000, None);
        matmul.children = vec![1];
        fill.parent = Some(0);
        let copy = event(7, "copy_", 21_000, 30_000, None);
        let mut events = vec![matmul, fill, copy];
        let buffer: Vec<Vec<u8>> = vec![
            rec::bytes_of(&rec::external(100, 5)),
            rec::bytes_of(&rec::external(101, 6)),
            rec::bytes_of(&rec::external(102, 5)),
            rec::bytes_of(&rec::external(103, 7)),
            // CUPTI's clock: 1_000_000 is the trace's 0.
            rec::bytes_of(&rec::memset(101, 1_004_000, 1_004_500)),
            rec::bytes_of(&rec::kernel(100, 1_005_000, 1_008_000, 7, gemm.as_ptr())),
            rec::bytes_of(&rec::kernel(102, 1_008_000, 1_009_000, 7, gemm.as_ptr())),
            rec::bytes_of(&rec::memcpy(103, 1_025_000, 1_029_096, 4096)),
            rec::bytes_of(&rec::kernel(999, 1_030_000, 1_031_000, 13, stray.as_ptr())),
            // The launches: of matmul's first kernel, of the copy, of the stray kernel (no op),
            // and a call that launched nothing.
            rec::bytes_of(&rec::api(100, 1_001_500, 1_001_800)),
            rec::bytes_of(&rec::api(103, 1_022_000, 1_023_000)),
            rec::bytes_of(&rec::api(999, 1_029_500, 1_029_600)),
            rec::bytes_of(&rec::api(555, 1_002_000, 1_002_100)),
        ];
        let mut collected = Collected::default();
        for b in &buffer {
            // SAFETY: the kernel records name C string literals.
            unsafe { collected.absorb(decode(b).unwrap()) };
        }
        // `cupti::stop` names the calls.
        collected.api_names.insert((true, 307), "cuLaunchKernel".into());
        let (activities, api_calls) =
            super::super::recorder::attribute(&mut events, collected, |ns| ns - 1_000_000);
        Trace {
            events,
            threads: vec![(1, "thread 1 (main)".to_string())],
            start_unix_us: 1.7e15,
            step_num: 0,
            profile_memory: false,
            cuda: true,
            timing: Some(CudaTimingSource::Cupti),
            cupti_unavailable: None,
            gpu_activities: activities,
            api_calls,
        }
    }

    #[test]
    fn cupti_records_are_attributed_to_their_ops() {
        let trace = cupti_trace();
        let (e, a) = (&trace.events, &trace.gpu_activities);
        assert_eq!(a.len(), 5);
        let names: Vec<_> = a.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "Memset (Device)",
                "sm90_xmma_gemm_f32f32_tn",
                "sm90_xmma_gemm_f32f32_tn",
                "Memcpy HtoD (Pinned -> Device)",
                "stray_kernel"
            ]
        );
        assert_eq!(e[0].gpu_activities, [1, 2]);
        assert_eq!(e[1].gpu_activities, [0]);
        assert_eq!(e[2].gpu_activities, [3]);
        assert_eq!((a[4].external_id, a[4].event), (None, None));
        assert_eq!(
            (a[1].external_id, a[1].event, a[1].start_ns),
            (Some(5), Some(0), 5_000)
        );
        // matmul: own kernels 3 µs + 1 µs, its child's memset 0.5 µs.
        assert_eq!(
            (e[0].self_cuda_time_total_ns, e[0].cuda_time_total_ns),
            (4_000, 4_500)
        );
        assert_eq!(
            (e[1].self_cuda_time_total_ns, e[1].cuda_time_total_ns),
            (500, 500)
        );
        assert_eq!(e[2].cuda_time_total_ns, 4_096);
        let g = e[0].gpu.as_ref().unwrap();
        assert_eq!(
            (g.start_ns, g.duration_ns, g.stream, g.launches),
            (5_000, 4_000, 7, 2)
        );
        let averages = trace.key_averages();
        assert_eq!(averages.get("matmul").unwrap().self_cuda_time_total_us, 4.0);
        let table = averages.table("self_cuda_time_total", 10).unwrap();
        assert!(table.ends_with("CUDA time measured by: cupti\n"), "{table}");
        assert_eq!(trace.gpu_timing(), Some("cupti"));
        // The launches of device work made inside an op, on its thread.
        let calls: Vec<_> = trace
            .cuda_api_calls()
            .iter()
            .map(|c| (c.correlation, c.external_id, c.event, c.start_ns, c.duration_ns))
            .collect();
        assert_eq!(calls, [(100, 5, 0, 1_500, 300), (103, 7, 2, 22_000, 1_000)]);
    }

    #[test]
    fn cupti_activities_become_kineto_events_with_paired_flows() {
        let trace = cupti_trace();
        let v: serde_json::Value = serde_json::from_str(&to_json(&trace)).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let device: Vec<_> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == 0)
            .collect();
        let cats: Vec<_> = device.iter().map(|e| e["cat"].as_str().unwrap()).collect();
        assert_eq!(cats, ["gpu_memset", "kernel", "kernel", "gpu_memcpy", "kernel"]);
        for e in &device {
            for key in ["External id", "correlation", "stream", "device", "context"] {
                assert!(e["args"][key].is_u64(), "{key} in {e}");
            }
            assert!(e["dur"].as_f64().unwrap() > 0.0 && e["ts"].is_number(), "{e}");
        }
        let k = device[1];
        assert_eq!((k["ts"].as_f64(), k["dur"].as_f64()), (Some(5.0), Some(3.0)));
        assert_eq!(
            (k["tid"].as_u64(), k["args"]["External id"].as_u64()),
            (Some(7), Some(5))
        );
        assert_eq!(k["args"]["correlation"].as_u64(), Some(100));
        assert_eq!(k["args"]["grid"], serde_json::json!([4, 2, 1]));
        assert_eq!(device[3]["args"]["bytes"].as_u64(), Some(4096));
        assert_eq!(device[3]["args"]["memory bandwidth (GB/s)"].as_f64(), Some(1.0));
        // No per-op interval events with CUPTI.
        assert!(!device.iter().any(|e| e["name"] == "matmul"));
        // Every flow pairs up: one start on the op's thread, one finish on the device event.
        let mut flows: HashMap<u64, Vec<&serde_json::Value>> = HashMap::new();
        for e in events.iter().filter(|e| e["cat"] == "ac2g") {
            flows.entry(e["id"].as_u64().unwrap()).or_default().push(e);
        }
        let mut ids: Vec<_> = flows.keys().copied().collect();
        ids.sort_unstable();
        assert_eq!(ids, [100, 101, 102, 103], "the stray kernel has no flow");
        let launches: Vec<_> = events.iter().filter(|e| e["cat"] == "cuda_driver").collect();
        assert_eq!(launches.len(), 2);
        for l in &launches {
            assert_eq!(l["name"], "cuLaunchKernel");
            assert_eq!(l["tid"].as_u64(), Some(1));
            assert!(
                l["args"]["correlation"].is_u64() && l["args"]["External id"].is_u64(),
                "{l}"
            );
            // It lies inside its op on the host, so tools find the op around it.
            let op = trace
                .events
                .iter()
                .find(|e| Some(e.id) == l["args"]["External id"].as_u64())
                .unwrap();
            let ts = l["ts"].as_f64().unwrap();
            assert!(
                op.start_ns as f64 / 1e3 <= ts && ts <= op.end_ns as f64 / 1e3,
                "{l}"
            );
        }
        for (id, pair) in &flows {
            assert_eq!(pair.len(), 2, "flow {id}");
            let (s, f) = (pair[0], pair[1]);
            assert_eq!((s["ph"].as_str(), f["ph"].as_str()), (Some("s"), Some("f")));
            assert_eq!(s["pid"].as_u64(), Some(std::process::id() as u64));
            assert_eq!((f["pid"].as_u64(), f["bp"].as_str()), (Some(0), Some("e")));
            let target = device
                .iter()
                .find(|e| e["args"]["correlation"].as_u64() == Some(*id))
                .unwrap();
            assert_eq!(f["ts"], target["ts"]);
            assert_eq!(f["tid"], target["tid"]);
            // A flow starts on the call that launched the work where it was recorded, else
            // on the op at its start.
            let from = launches
                .iter()
                .find(|l| l["args"]["correlation"].as_u64() == Some(*id))
                .map_or_else(
                    || {
                        let op = target["args"]["External id"].as_u64().unwrap();
                        trace.events.iter().find(|e| e.id == op).unwrap().start_ns as f64 / 1e3
                    },
                    |l| l["ts"].as_f64().unwrap(),
                );
            assert_eq!(s["ts"].as_f64(), Some(from), "flow {id}");
        }
        let stream_names: Vec<_> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == 0)
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(stream_names, ["stream 7", "stream 13"]);
    }
}
