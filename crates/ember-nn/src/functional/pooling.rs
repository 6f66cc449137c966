//! 2-D pooling: `max_pool2d`, `avg_pool2d`, `adaptive_avg_pool2d` over `[N, C, H, W]` (or
//! unbatched `[C, H, W]`) inputs, floor output sizes (`ceil_mode=False`).
//!
//! On CUDA, `max_pool2d` and `avg_pool2d` first try cuDNN (`ember_core::ops::pool::pool2d`, one
//! forward and one backward call each, no window buffer); where it does not run (a CPU tensor,
//! cuDNN missing or switched off with `backends::cudnn::set_enabled(false)`, an unsupported
//! case) they take the composed path below, which has the same semantics and is the CPU path.
//! The one difference: with tied maxima in a window, cuDNN may route max pooling's gradient
//! to another of the tied positions than the first.
//!
//! Max pooling gathers the windows as convolution does (Note [im2col by gather] in `conv.rs`,
//! padding reading -inf) and takes `max_dim` over each window, whose gradient goes to the
//! first maximum in row-major window order, as PyTorch's. Average pooling is separable: the
//! mean over a `KH`×`KW` window is a row average then a column average, so both average
//! pools are two small GEMMs with constant pooling matrices, `P_h @ x @ P_wᵀ`, whose backward
//! is two GEMMs as well.

use super::conv::{windows, Window};
use super::{idims, Pair};
use ember_core::ops::pool::{pool2d, PoolMode};
use ember_core::{DType, Device, Error, Result, Tensor};

/// Runs `f` on a 4-D view of `input` (adding a batch dim of 1 to a 3-D input).
fn batched(op: &'static str, input: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    match input.rank() {
        4 => f(input),
        3 => f(&input.unsqueeze(0)?)?.squeeze_dim(0),
        _ => Err(Error::invalid(
            op,
            format!(
                "expected a 3-D [C, H, W] or 4-D [N, C, H, W] input, got shape {}",
                input.shape()
            ),
        )),
    }
}

fn check_float(op: &'static str, input: &Tensor) -> Result<()> {
    if input.dtype().is_floating_point() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            op,
            dtype: input.dtype(),
            hint: "pooling takes floating point inputs",
        })
    }
}

/// PyTorch's limit: padding at most half the kernel, so every window holds an input element.
fn check_padding(op: &'static str, kernel: [usize; 2], padding: [usize; 2]) -> Result<()> {
    if (0..2).any(|d| 2 * padding[d] > kernel[d]) {
        return Err(Error::invalid(
            op,
            format!("pad should be at most half of kernel size, but got pad={padding:?} and kernel_size={kernel:?}"),
        ));
    }
    Ok(())
}

/// cuDNN's pooling of a 4-D CUDA `x` (made contiguous), or None where it does not run.
fn cudnn_pool(x: &Tensor, mode: PoolMode, win: &Window) -> Result<Option<Tensor>> {
    if !matches!(x.device(), Device::Cuda(_)) {
        return Ok(None);
    }
    pool2d(&x.contiguous()?, mode, win.kernel, win.stride, win.padding)
}

/// Maximum over each `kernel_size` window moved by `stride`, with implicit -inf `padding`
/// (`F.max_pool2d`, dilation 1). PyTorch's default stride is `kernel_size`: pass it.
pub fn max_pool2d(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d";
    let win = Window {
        kernel: kernel_size.into().0,
        stride: stride.into().0,
        padding: padding.into().0,
        dilation: [1, 1],
    };
    check_float(OP, input)?;
    check_padding(OP, win.kernel, win.padding)?;
    batched(OP, input, |x| {
        if let Some(y) = cudnn_pool(x, PoolMode::Max, &win)? {
            return Ok(y);
        }
        let (cols, out) = windows(OP, x, &win, f64::NEG_INFINITY)?;
        let (max, _) = cols.max_dim(2, false)?;
        max.reshape(&idims(&[x.dims()[0], x.dims()[1], out[0], out[1]]))
    })
}

/// `[rows, size]` matrix averaging `size` positions into `rows` windows: row `i` holds
/// `1 / (end - start)` over `start..end` of `bounds(i)` (positions outside `0..size` dropped,
/// as zero padding would add nothing).
fn pooling_matrix(
    rows: usize,
    size: usize,
    dtype: DType,
    device: Device,
    bounds: impl Fn(usize) -> (i64, i64, f64),
) -> Result<Tensor> {
    let mut m = vec![0.0f64; rows * size];
    for i in 0..rows {
        let (start, end, divisor) = bounds(i);
        for j in start.max(0)..end.min(size as i64) {
            m[i * size + j as usize] = 1.0 / divisor;
        }
    }
    Tensor::from_vec(m, [rows, size], device)?.to_dtype(dtype)
}

/// `P_h @ x @ P_wᵀ` for a 4-D `x`.
fn separable(x: &Tensor, ph: &Tensor, pw: &Tensor) -> Result<Tensor> {
    ph.matmul(&x.matmul(&pw.t()?)?)
}

/// Mean over each `kernel_size` window moved by `stride`, with zero `padding` counted in the
/// divisor (`F.avg_pool2d` with `count_include_pad=True`). PyTorch's default stride is
/// `kernel_size`: pass it.
pub fn avg_pool2d(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
) -> Result<Tensor> {
    const OP: &str = "avg_pool2d";
    let win = Window {
        kernel: kernel_size.into().0,
        stride: stride.into().0,
        padding: padding.into().0,
        dilation: [1, 1],
    };
    check_float(OP, input)?;
    check_padding(OP, win.kernel, win.padding)?;
    batched(OP, input, |x| {
        if let Some(y) = cudnn_pool(x, PoolMode::Avg, &win)? {
            return Ok(y);
        }
        let hw = [x.dims()[2], x.dims()[3]];
        let out = win.output_size(OP, hw)?;
        let m = |d: usize| {
            pooling_matrix(out[d], hw[d], x.dtype(), x.device(), |i| {
                let start = (i * win.stride[d]) as i64 - win.padding[d] as i64;
                (start, start + win.kernel[d] as i64, win.kernel[d] as f64)
            })
        };
        separable(x, &m(0)?, &m(1)?)
    })
}

/// Mean over the `output_size` windows that PyTorch's adaptive pooling uses: output `i` of a
/// dim of input size `n` and output size `o` averages `floor(i·n/o) .. ceil((i+1)·n/o)`
/// (`F.adaptive_avg_pool2d`).
pub fn adaptive_avg_pool2d(input: &Tensor, output_size: impl Into<Pair>) -> Result<Tensor> {
    const OP: &str = "adaptive_avg_pool2d";
    let out = output_size.into().0;
    check_float(OP, input)?;
    batched(OP, input, |x| {
        let hw = [x.dims()[2], x.dims()[3]];
        if hw.contains(&0) || out.contains(&0) {
            return Err(Error::invalid(
                OP,
                format!("input spatial size {hw:?} and output_size {out:?} must be non-zero"),
            ));
        }
        let m = |d: usize| {
            let (n, o) = (hw[d], out[d]);
            pooling_matrix(o, n, x.dtype(), x.device(), |i| {
                let start = (i * n / o) as i64;
                let end = ((i + 1) * n).div_ceil(o) as i64;
                (start, end, (end - start) as f64)
            })
        };
        separable(x, &m(0)?, &m(1)?)
    })
}
