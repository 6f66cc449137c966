//! Events grouped by name (and optionally input shapes), and the table PyTorch prints for
//! them (`torch.autograd.profiler_util._build_table`: the same columns, widths, number formats
//! and footers).

use super::{EventKind, FunctionEvent};
use crate::{Error, Result};

/// The events of one name (and input shapes, when grouped by them) summed
/// (`FunctionEventAvg`). Times in microseconds, memory in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct EventAvg {
    /// The name (`key`).
    pub key: String,
    /// The input shapes, when grouped by them.
    pub input_shapes: Option<Vec<Vec<usize>>>,
    /// Calls (`# of Calls`).
    pub count: usize,
    pub cpu_time_total_us: f64,
    pub self_cpu_time_total_us: f64,
    pub cuda_time_total_us: f64,
    pub self_cuda_time_total_us: f64,
    pub cpu_memory_usage: i64,
    pub self_cpu_memory_usage: i64,
    pub cuda_memory_usage: i64,
    pub self_cuda_memory_usage: i64,
    /// True for `record_function` ranges (whose GPU time is their children's and is left out
    /// of the self-CUDA total).
    pub is_user_annotation: bool,
}

impl EventAvg {
    /// CPU total per call (`CPU time avg`).
    pub fn cpu_time_avg_us(&self) -> f64 {
        self.cpu_time_total_us / self.count.max(1) as f64
    }

    /// CUDA total per call (`CUDA time avg`).
    pub fn cuda_time_avg_us(&self) -> f64 {
        self.cuda_time_total_us / self.count.max(1) as f64
    }
}

/// The columns a table may be sorted by, PyTorch's names (`sort_by=`), largest first.
const SORT_KEYS: [&str; 13] = [
    "cpu_time_total",
    "self_cpu_time_total",
    "cpu_time",
    "cuda_time_total",
    "self_cuda_time_total",
    "cuda_time",
    "cpu_memory_usage",
    "self_cpu_memory_usage",
    "cuda_memory_usage",
    "self_cuda_memory_usage",
    "count",
    "device_time_total",
    "self_device_time_total",
];

/// Events grouped by key (`prof.key_averages()`), in order of first appearance.
#[derive(Debug, Clone)]
pub struct KeyAverages {
    rows: Vec<EventAvg>,
    profile_memory: bool,
    cuda: bool,
    /// How CUDA time was measured (`"cupti"`, `"cuda events"`), for the table's footer.
    source: Option<&'static str>,
}

impl KeyAverages {
    pub(crate) fn empty() -> KeyAverages {
        KeyAverages {
            rows: Vec::new(),
            profile_memory: false,
            cuda: false,
            source: None,
        }
    }

    /// The same groups, saying how CUDA time was measured.
    pub(crate) fn with_source(mut self, source: Option<&'static str>) -> KeyAverages {
        self.source = source;
        self
    }

    /// How CUDA time was measured: `"cupti"` or `"cuda events"`; None when it was not.
    pub fn cuda_timing_source(&self) -> Option<&'static str> {
        self.source
    }

    pub(crate) fn new(
        events: &[FunctionEvent],
        by_shapes: bool,
        profile_memory: bool,
        cuda: bool,
    ) -> KeyAverages {
        let mut rows: Vec<EventAvg> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for e in events {
            let shapes = if by_shapes {
                Some(e.input_shapes.clone().unwrap_or_default())
            } else {
                None
            };
            let at = *index.entry((e.name.clone(), shapes.clone())).or_insert_with(|| {
                rows.push(EventAvg {
                    key: e.name.clone(),
                    input_shapes: shapes,
                    count: 0,
                    cpu_time_total_us: 0.0,
                    self_cpu_time_total_us: 0.0,
                    cuda_time_total_us: 0.0,
                    self_cuda_time_total_us: 0.0,
                    cpu_memory_usage: 0,
                    self_cpu_memory_usage: 0,
                    cuda_memory_usage: 0,
                    self_cuda_memory_usage: 0,
                    is_user_annotation: e.kind == EventKind::UserAnnotation,
                });
                rows.len() - 1
            });
            let r = &mut rows[at];
            r.count += 1;
            r.cpu_time_total_us += e.cpu_time_total_ns() as f64 / 1e3;
            r.self_cpu_time_total_us += e.self_cpu_time_total_ns(events) as f64 / 1e3;
            r.cuda_time_total_us += e.cuda_time_total_ns as f64 / 1e3;
            r.self_cuda_time_total_us += e.self_cuda_time_total_ns as f64 / 1e3;
            r.cpu_memory_usage += e.cpu_memory_usage;
            r.self_cpu_memory_usage += e.self_cpu_memory_usage;
            r.cuda_memory_usage += e.cuda_memory_usage;
            r.self_cuda_memory_usage += e.self_cuda_memory_usage;
        }
        KeyAverages {
            rows,
            profile_memory,
            cuda,
            source: None,
        }
    }

    /// The groups, in order of first appearance.
    pub fn iter(&self) -> std::slice::Iter<'_, EventAvg> {
        self.rows.iter()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The first group named `key`.
    pub fn get(&self, key: &str) -> Option<&EventAvg> {
        self.rows.iter().find(|r| r.key == key)
    }

    /// The sum of every group's self CPU time (the table's `Self CPU time total`), in µs.
    pub fn self_cpu_time_total_us(&self) -> f64 {
        self.rows.iter().map(|r| r.self_cpu_time_total_us).sum()
    }

    /// The sum of the self CUDA time of every group but `record_function` ranges (the
    /// table's `Self CUDA time total`), in µs.
    pub fn self_cuda_time_total_us(&self) -> f64 {
        self.rows
            .iter()
            .filter(|r| !r.is_user_annotation)
            .map(|r| r.self_cuda_time_total_us)
            .sum()
    }

    /// The table `key_averages().table(sort_by=..., row_limit=...)` prints: rows sorted by
    /// `sort_by` (one of PyTorch's keys: `cpu_time_total`, `self_cpu_time_total`, `cpu_time`,
    /// `cuda_time_total`, `self_cuda_time_total`, `cuda_time`, the `*_memory_usage` keys,
    /// `count`; `""` keeps the order of appearance), largest first, at most `row_limit` of
    /// them. An error for another key.
    pub fn table(&self, sort_by: &str, row_limit: usize) -> Result<String> {
        let mut rows: Vec<&EventAvg> = self.rows.iter().collect();
        if !sort_by.is_empty() {
            if !SORT_KEYS.contains(&sort_by) {
                return Err(Error::invalid(
                    "KeyAverages::table",
                    format!("unknown sort_by {sort_by:?}; expected one of {SORT_KEYS:?}"),
                ));
            }
            let key = |r: &EventAvg| -> f64 {
                match sort_by.replace("device", "cuda").as_str() {
                    "cpu_time_total" => r.cpu_time_total_us,
                    "self_cpu_time_total" => r.self_cpu_time_total_us,
                    "cpu_time" => r.cpu_time_avg_us(),
                    "cuda_time_total" => r.cuda_time_total_us,
                    "self_cuda_time_total" => r.self_cuda_time_total_us,
                    "cuda_time" => r.cuda_time_avg_us(),
                    "cpu_memory_usage" => r.cpu_memory_usage as f64,
                    "self_cpu_memory_usage" => r.self_cpu_memory_usage as f64,
                    "cuda_memory_usage" => r.cuda_memory_usage as f64,
                    "self_cuda_memory_usage" => r.self_cuda_memory_usage as f64,
                    _ => r.count as f64,
                }
            };
            rows.sort_by(|a, b| key(b).total_cmp(&key(a)));
        }
        Ok(build_table(self, &rows, row_limit))
    }
}

impl<'a> IntoIterator for &'a KeyAverages {
    type Item = &'a EventAvg;
    type IntoIter = std::slice::Iter<'a, EventAvg>;
    fn into_iter(self) -> Self::IntoIter {
        self.rows.iter()
    }
}

/// The widths PyTorch uses: 12 per numeric column, the name column as wide as the longest
/// name plus 4 up to 55, the shapes column likewise up to 80; two spaces between columns.
const DEFAULT_COLUMN_WIDTH: usize = 12;
const MAX_NAME_COLUMN_WIDTH: usize = 55;
const MAX_SHAPES_COLUMN_WIDTH: usize = 80;
const SPACING: usize = 2;

fn build_table(all: &KeyAverages, rows: &[&EventAvg], row_limit: usize) -> String {
    let has_cuda_time = all.cuda && all.rows.iter().any(|r| r.self_cuda_time_total_us > 0.0);
    let has_cuda_mem = all.cuda && all.rows.iter().any(|r| r.self_cuda_memory_usage > 0);
    let has_shapes = all
        .rows
        .iter()
        .any(|r| r.input_shapes.as_ref().is_some_and(|s| !s.is_empty()));
    let name_width =
        (rows.iter().map(|r| r.key.chars().count()).max().unwrap_or(0) + 4).min(MAX_NAME_COLUMN_WIDTH);
    let shapes_width = (rows
        .iter()
        .map(|r| shapes_str(&r.input_shapes).chars().count())
        .max()
        .unwrap_or(0)
        + 4)
    .min(MAX_SHAPES_COLUMN_WIDTH);

    let mut headers: Vec<&str> = vec![
        "Name",
        "Self CPU %",
        "Self CPU",
        "CPU total %",
        "CPU total",
        "CPU time avg",
    ];
    if has_cuda_time {
        headers.extend(["Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg"]);
    }
    if all.profile_memory {
        headers.extend(["CPU Mem", "Self CPU Mem"]);
        if has_cuda_mem {
            headers.extend(["CUDA Mem", "Self CUDA Mem"]);
        }
    }
    headers.push("# of Calls");
    let mut widths = vec![name_width];
    widths.extend(std::iter::repeat_n(DEFAULT_COLUMN_WIDTH, headers.len() - 1));
    if has_shapes {
        headers.push("Input Shapes");
        widths.push(shapes_width);
    }
    let format_row = |values: &[String]| -> String {
        let mut line = String::new();
        for (v, w) in values.iter().zip(&widths) {
            line.push_str(&format!("{v:>w$}", w = *w));
            line.push_str(&" ".repeat(SPACING));
        }
        line
    };
    let separator: String = widths
        .iter()
        .map(|w| "-".repeat(*w) + &" ".repeat(SPACING))
        .collect();

    let sum_self_cpu = all.self_cpu_time_total_us();
    let sum_self_cuda = all.self_cuda_time_total_us();
    let mut out = String::new();
    let mut push = |s: &str| {
        out.push_str(s);
        out.push('\n');
    };
    push(&separator);
    push(&format_row(
        &headers.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
    ));
    push(&separator);
    for r in rows.iter().take(row_limit) {
        let mut name = r.key.clone();
        if name.chars().count() >= MAX_NAME_COLUMN_WIDTH - 3 {
            name = name.chars().take(MAX_NAME_COLUMN_WIDTH - 3).collect::<String>() + "...";
        }
        let mut v = vec![
            name,
            time_share(r.self_cpu_time_total_us, sum_self_cpu),
            format_time(r.self_cpu_time_total_us),
            time_share(r.cpu_time_total_us, sum_self_cpu),
            format_time(r.cpu_time_total_us),
            format_time(r.cpu_time_avg_us()),
        ];
        if has_cuda_time {
            v.extend([
                format_time(r.self_cuda_time_total_us),
                time_share(r.self_cuda_time_total_us, sum_self_cuda),
                format_time(r.cuda_time_total_us),
                format_time(r.cuda_time_avg_us()),
            ]);
        }
        if all.profile_memory {
            v.extend([
                format_memory(r.cpu_memory_usage),
                format_memory(r.self_cpu_memory_usage),
            ]);
            if has_cuda_mem {
                v.extend([
                    format_memory(r.cuda_memory_usage),
                    format_memory(r.self_cuda_memory_usage),
                ]);
            }
        }
        v.push(r.count.to_string());
        if has_shapes {
            v.push(shapes_str(&r.input_shapes).chars().take(shapes_width).collect());
        }
        push(&format_row(&v));
    }
    push(&separator);
    push(&format!("Self CPU time total: {}", format_time(sum_self_cpu)));
    if has_cuda_time {
        push(&format!("Self CUDA time total: {}", format_time(sum_self_cuda)));
        if let Some(source) = all.source {
            // Not in PyTorch's table: which of ember's two ways measured the CUDA columns.
            push(&format!("CUDA time measured by: {source}"));
        }
    }
    out
}

/// Python's `str()` of a list of shapes: `[[2, 3], []]`.
fn shapes_str(shapes: &Option<Vec<Vec<usize>>>) -> String {
    match shapes {
        None => "[]".to_string(),
        Some(s) => {
            let inner: Vec<String> = s
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
    }
}

/// PyTorch's `_format_time`: `1.234s`, `1.234ms` or `1.234us`.
pub(crate) fn format_time(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.3}s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.3}ms", us / 1e3)
    } else {
        format!("{us:.3}us")
    }
}

/// PyTorch's `_format_time_share`: `12.34%`, `NaN` when the total is 0.
fn time_share(us: f64, total: f64) -> String {
    if total == 0.0 {
        "NaN".to_string()
    } else {
        format!("{:.2}%", us * 100.0 / total)
    }
}

/// PyTorch's `_format_memory`: `1.50 Mb`, `-512 b`.
fn format_memory(bytes: i64) -> String {
    const KB: f64 = 1024.0;
    let (b, a) = (bytes as f64, bytes.unsigned_abs() as f64);
    if a >= KB * KB * KB {
        format!("{:.2} Gb", b / (KB * KB * KB))
    } else if a >= KB * KB {
        format!("{:.2} Mb", b / (KB * KB))
    } else if a >= KB {
        format!("{:.2} Kb", b / KB)
    } else {
        format!("{bytes} b")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_match_pytorch() {
        assert_eq!(format_time(12.3456), "12.346us");
        assert_eq!(format_time(1234.5), "1.234ms");
        assert_eq!(format_time(2_500_000.0), "2.500s");
        assert_eq!(time_share(1.0, 4.0), "25.00%");
        assert_eq!(time_share(0.0, 0.0), "NaN");
        assert_eq!(format_memory(512), "512 b");
        assert_eq!(format_memory(-2048), "-2.00 Kb");
        assert_eq!(format_memory(3 << 20), "3.00 Mb");
        assert_eq!(shapes_str(&Some(vec![vec![2, 3], vec![]])), "[[2, 3], []]");
    }
}
