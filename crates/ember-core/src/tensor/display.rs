//! Printing tensors the way PyTorch does: `Display` reproduces `repr(tensor)` of torch 2.x
//! (`torch/_tensor_str.py` with the default print options: precision 4, threshold 1000,
//! edgeitems 3, linewidth 80), e.g.
//!
//! ```text
//! tensor([[ 1.0000, -2.5000],
//!         [ 3.0000,  4.0000]])
//! ```
//!
//! Floats print with 4 decimals, or as `1.` when every value is an integer, or in scientific
//! notation when the nonzero finite magnitudes span more than 1000x, exceed 1e8, or (for
//! non-integers) go below 1e-4; all elements share one width. Above 1000 elements each dimension
//! longer than 6 shows its first and last 3 entries around `...`. Suffixes name a non-default
//! dtype (anything but float32, int64, bool), a non-CPU device, and `grad_fn=<MulBackward0>` or
//! `requires_grad=True`. A precision in the format string (`{:.2}`) replaces the 4 decimals.
//! `Debug` stays short: shape, dtype and device.

use crate::backend::CpuStorage;
use crate::{DType, Device, Tensor};
use std::fmt;

/// Elements above which printing summarizes (PyTorch's `threshold`).
const THRESHOLD: usize = 1000;
/// Entries shown at each end of a summarized dimension (`edgeitems`).
const EDGE_ITEMS: usize = 3;
/// Target line width in characters (`linewidth`).
const LINE_WIDTH: usize = 80;
/// Decimals of floats unless the format string gives a precision (`precision`).
const PRECISION: usize = 4;

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor[{}, dtype={}, device={}]",
            self.shape(),
            self.dtype(),
            self.device()
        )
    }
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&repr(self, f.precision().unwrap_or(PRECISION)))
    }
}

/// The elements of a tensor as read for printing.
enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl Values {
    fn read(t: &Tensor) -> crate::Result<Values> {
        let cpu = t.to_cpu_storage()?;
        Ok(match cpu {
            CpuStorage::Bool(v) => Values::Bool(v),
            CpuStorage::U8(v) => Values::Int(v.into_iter().map(i64::from).collect()),
            CpuStorage::I32(v) => Values::Int(v.into_iter().map(i64::from).collect()),
            CpuStorage::I64(v) => Values::Int(v),
            CpuStorage::F16(v) => Values::Float(v.into_iter().map(|x| x.to_f64()).collect()),
            CpuStorage::BF16(v) => Values::Float(v.into_iter().map(|x| x.to_f64()).collect()),
            CpuStorage::F32(v) => Values::Float(v.into_iter().map(f64::from).collect()),
            CpuStorage::F64(v) => Values::Float(v),
        })
    }

    /// Element `i` formatted by `fmt`, padded to its width.
    fn format(&self, i: usize, fmt: &ElementFormat) -> String {
        let s = match self {
            Values::Float(v) => fmt.float(v[i]),
            Values::Int(v) => v[i].to_string(),
            Values::Bool(v) => py_bool(v[i]).to_string(),
        };
        pad_left(s, fmt.width)
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

fn pad_left(s: String, width: usize) -> String {
    if s.len() >= width {
        s
    } else {
        format!("{}{s}", " ".repeat(width - s.len()))
    }
}

/// How every element of one tensor prints (PyTorch's `_Formatter`).
struct ElementFormat {
    int_mode: bool,
    sci_mode: bool,
    precision: usize,
    width: usize,
}

impl ElementFormat {
    /// The format for the elements at `indices` (all of them, or the summarized ones).
    fn new(values: &Values, indices: &[usize], precision: usize) -> ElementFormat {
        let mut fmt = ElementFormat {
            int_mode: true,
            sci_mode: false,
            precision,
            width: 1,
        };
        let floats = match values {
            Values::Float(v) => v,
            Values::Int(v) => {
                fmt.width = indices
                    .iter()
                    .map(|&i| v[i].to_string().len())
                    .fold(1, usize::max);
                return fmt;
            }
            Values::Bool(v) => {
                fmt.width = indices.iter().map(|&i| py_bool(v[i]).len()).fold(1, usize::max);
                return fmt;
            }
        };
        let nonzero: Vec<f64> = indices
            .iter()
            .map(|&i| floats[i])
            .filter(|x| x.is_finite() && *x != 0.0)
            .collect();
        if nonzero.is_empty() {
            return fmt;
        }
        let min = nonzero.iter().map(|x| x.abs()).fold(f64::INFINITY, f64::min);
        let max = nonzero.iter().map(|x| x.abs()).fold(0.0, f64::max);
        fmt.int_mode = nonzero.iter().all(|x| *x == x.ceil());
        let widths: Box<dyn Fn(f64) -> usize> = if fmt.int_mode {
            if max / min > 1000.0 || max > 1.0e8 {
                fmt.sci_mode = true;
                Box::new(|x| py_sci(x, precision).len())
            } else {
                Box::new(|x| format!("{x:.0}").len() + 1)
            }
        } else if max / min > 1000.0 || max > 1.0e8 || min < 1.0e-4 {
            fmt.sci_mode = true;
            Box::new(|x| py_sci(x, precision).len())
        } else {
            Box::new(|x| format!("{x:.precision$}").len())
        };
        fmt.width = nonzero.iter().map(|&x| widths(x)).fold(1, usize::max);
        fmt
    }

    /// One float as PyTorch writes it, before padding.
    fn float(&self, x: f64) -> String {
        if !x.is_finite() {
            return py_nonfinite(x).to_string();
        }
        if self.sci_mode {
            py_sci(x, self.precision)
        } else if self.int_mode {
            format!("{x:.0}.")
        } else {
            format!("{x:.prec$}", prec = self.precision)
        }
    }
}

fn py_nonfinite(x: f64) -> &'static str {
    if x.is_nan() {
        "nan"
    } else if x > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// Python's `'{:.Ne}'.format(x)`: mantissa with `precision` decimals, exponent signed and at
/// least two digits (`1.0000e+08`).
fn py_sci(x: f64, precision: usize) -> String {
    if !x.is_finite() {
        return py_nonfinite(x).to_string();
    }
    let s = format!("{x:.precision$e}");
    let (mantissa, exp) = s.split_once('e').expect("exponent format has an 'e'");
    let exp: i32 = exp.parse().expect("exponent is an integer");
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
}

/// The indices kept along a dimension of `size` (all, or the edges when summarizing).
fn kept(size: usize, summarize: bool) -> Vec<usize> {
    if summarize && size > 2 * EDGE_ITEMS {
        (0..EDGE_ITEMS).chain(size - EDGE_ITEMS..size).collect()
    } else {
        (0..size).collect()
    }
}

/// Row-major flat indices of the elements printing shows (`get_summarized_data`).
fn shown_indices(dims: &[usize], summarize: bool) -> Vec<usize> {
    let mut out = vec![0usize];
    let mut stride = 1;
    let strides: Vec<usize> = dims
        .iter()
        .rev()
        .map(|&d| {
            let s = stride;
            stride *= d;
            s
        })
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    for (&d, &s) in dims.iter().zip(&strides) {
        let k = kept(d, summarize);
        out = out
            .iter()
            .flat_map(|&base| k.iter().map(move |&i| base + i * s))
            .collect();
    }
    out
}

/// The bracketed body of the tensor whose first element is at `start` (`_tensor_str_with_formatter`).
fn body(
    values: &Values,
    dims: &[usize],
    start: usize,
    indent: usize,
    summarize: bool,
    fmt: &ElementFormat,
) -> String {
    match dims.len() {
        0 => values.format(start, fmt),
        1 => {
            let element_length = fmt.width + 2;
            let per_line = ((LINE_WIDTH as f64 - indent as f64) / element_length as f64)
                .floor()
                .max(1.0) as usize;
            let data: Vec<String> = if summarize && dims[0] > 2 * EDGE_ITEMS {
                let left = (0..EDGE_ITEMS).map(|i| values.format(start + i, fmt));
                let right = (dims[0] - EDGE_ITEMS..dims[0]).map(|i| values.format(start + i, fmt));
                left.chain(std::iter::once(" ...".to_string()))
                    .chain(right)
                    .collect()
            } else {
                (0..dims[0]).map(|i| values.format(start + i, fmt)).collect()
            };
            let lines: Vec<String> = data.chunks(per_line).map(|line| line.join(", ")).collect();
            format!("[{}]", lines.join(&format!(",\n{}", " ".repeat(indent + 1))))
        }
        rank => {
            let inner: usize = dims[1..].iter().product();
            let row = |i: usize| body(values, &dims[1..], start + i * inner, indent + 1, summarize, fmt);
            let slices: Vec<String> = if summarize && dims[0] > 2 * EDGE_ITEMS {
                let left = (0..EDGE_ITEMS).map(row);
                let right = (dims[0] - EDGE_ITEMS..dims[0]).map(row);
                left.chain(std::iter::once("...".to_string()))
                    .chain(right)
                    .collect()
            } else {
                (0..dims[0]).map(row).collect()
            };
            let sep = format!(",{}{}", "\n".repeat(rank - 1), " ".repeat(indent + 1));
            format!("[{}]", slices.join(&sep))
        }
    }
}

/// PyTorch's node class name for an ember op name: `mul` → `MulBackward0`.
fn grad_fn_class(name: &str) -> String {
    if name.contains("Backward") {
        return name.to_string();
    }
    let mut out: String = name
        .split('_')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map_or(String::new(), |f| f.to_uppercase().chain(c).collect())
        })
        .collect();
    out.push_str("Backward0");
    out
}

/// `(2, 0, 3)` as Python prints a tuple.
fn py_tuple(dims: &[usize]) -> String {
    match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// `repr(t)` in PyTorch (`_str_intern`).
fn repr(t: &Tensor, precision: usize) -> String {
    const PREFIX: &str = "tensor(";
    let indent = PREFIX.len();
    let dims = t.dims();
    let mut suffixes = Vec::new();
    if t.device() != Device::Cpu {
        suffixes.push(format!("device='{}'", t.device()));
    }
    let body_str = if t.numel() == 0 {
        if dims.len() != 1 {
            suffixes.push(format!("size={}", py_tuple(dims)));
        }
        if t.dtype() != DType::F32 {
            suffixes.push(format!("dtype=torch.{}", t.dtype().name()));
        }
        "[]".to_string()
    } else {
        if !matches!(t.dtype(), DType::F32 | DType::I64 | DType::Bool) {
            suffixes.push(format!("dtype=torch.{}", t.dtype().name()));
        }
        match Values::read(t) {
            Ok(values) => {
                let summarize = t.numel() > THRESHOLD;
                let fmt = ElementFormat::new(&values, &shown_indices(dims, summarize), precision);
                body(&values, dims, 0, indent, summarize, &fmt)
            }
            Err(e) => format!("<unreadable: {e}>"),
        }
    };
    if let Some(name) = t.grad_fn_name() {
        suffixes.push(format!("grad_fn=<{}>", grad_fn_class(name)));
    } else if t.requires_grad() {
        suffixes.push("requires_grad=True".to_string());
    }
    add_suffixes(format!("{PREFIX}{body_str}"), &suffixes, indent)
}

/// Appends `, suffix` to the last line, or on a new indented line past the line width
/// (`_add_suffixes`).
fn add_suffixes(mut s: String, suffixes: &[String], indent: usize) -> String {
    // Python: len(s) - s.rfind("\n") + 1, where rfind gives -1 when there is no newline.
    let mut last_line_len = match s.rfind('\n') {
        Some(p) => s.len() - p + 1,
        None => s.len() + 2,
    };
    for suffix in suffixes {
        if last_line_len + suffix.len() + 2 > LINE_WIDTH {
            s.push_str(&format!(",\n{}{suffix}", " ".repeat(indent)));
            last_line_len = indent + suffix.len();
        } else {
            s.push_str(&format!(", {suffix}"));
            last_line_len += suffix.len() + 2;
        }
    }
    s.push(')');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scientific_notation_is_pythons() {
        assert_eq!(py_sci(1e8, 4), "1.0000e+08");
        assert_eq!(py_sci(-1.23456e-5, 4), "-1.2346e-05");
        assert_eq!(py_sci(0.0, 4), "0.0000e+00");
        assert_eq!(py_sci(1e123, 2), "1.00e+123");
    }

    #[test]
    fn grad_fn_names_follow_pytorch_classes() {
        assert_eq!(grad_fn_class("mul"), "MulBackward0");
        assert_eq!(grad_fn_class("log_softmax"), "LogSoftmaxBackward0");
        assert_eq!(grad_fn_class("SumBackward1"), "SumBackward1");
    }

    #[test]
    fn summarized_indices_take_the_edges() {
        assert_eq!(shown_indices(&[8], true), vec![0, 1, 2, 5, 6, 7]);
        assert_eq!(shown_indices(&[2, 3], true), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(shown_indices(&[7, 1], true), vec![0, 1, 2, 4, 5, 6]);
    }
}
