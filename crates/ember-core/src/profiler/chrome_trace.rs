//! A trace as Kineto writes it (`libkineto/src/output_json.cpp`), which `chrome://tracing`,
//! Perfetto, TensorBoard's profiler plugin and PyTorch's trace tools read:
//!
//! - top level: `schemaVersion`, `deviceProperties` (one entry per GPU in the trace),
//!   `traceEvents`, `traceName`, `displayTimeUnit`, `baseTimeNanoseconds`;
//! - complete events (`ph: "X"`, `ts` and `dur` in µs; `ts` counts from
//!   `baseTimeNanoseconds`, the trace's start in ns since the Unix epoch, as Kineto's relative
//!   timestamps do): ops (`cpu_op`)
//!   and ranges (`user_annotation`) on the host process (`pid` = process id, `tid` = the
//!   profiler's thread number), each op's GPU interval (`kernel`) on the device (`pid` = the
//!   device index, `tid` = the stream's number: 7 for the default stream, as CUDA numbers it,
//!   then 8, 9, ... in order of appearance);
//! - flow events linking an op to its GPU interval (`ph: "s"` on the op, `ph: "f"` with
//!   `bp: "e"` on the interval, `cat: "ac2g"`, `id` = the op's id, also its `correlation`);
//! - metadata events (`ph: "M"`) naming the processes (`process_name`, `process_labels`,
//!   `process_sort_index`) and the threads and streams (`thread_name`, `thread_sort_index`).

use super::{EventKind, Trace};
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
    for e in &trace.events {
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

        if let Some(g) = &e.gpu {
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
            let p = crate::cuda::get_device_properties(d).ok()?;
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
}
