//! 2-D pooling: `max_pool2d`, `avg_pool2d`, `adaptive_avg_pool2d` over `[N, C, H, W]` (or
//! unbatched `[C, H, W]`) inputs, floor output sizes (`ceil_mode=False`).
//!
//! `max_pool2d` and `avg_pool2d` are ember-core's `ops::pool::pool2d`, which runs on every
//! device through the backend's pooling (CPU kernels, cuDNN on CUDA) and falls back to a
//! composite window gather where the backend does not run the problem; the one difference
//! between devices: with tied maxima in a window, cuDNN may route max pooling's gradient to
//! another of the tied positions than the first. Adaptive average pooling is composed here
//! and separable: the mean over a window is a row average then a column average, so it is two
//! small GEMMs with constant pooling matrices, `P_h @ x @ P_wᵀ`, whose backward is two GEMMs
//! as well.

use super::Pair;
use ember_core::dispatch::{self, policy};
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

/// Maximum over each `kernel_size` window moved by `stride`, with implicit -inf `padding`
/// (`F.max_pool2d`, dilation 1). PyTorch's default stride is `kernel_size`: pass it.
pub fn max_pool2d(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
) -> Result<Tensor> {
    let (k, s, p) = (kernel_size.into().0, stride.into().0, padding.into().0);
    batched("max_pool2d", input, |x| pool2d(x, PoolMode::Max, k, s, p))
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
    let (k, s, p) = (kernel_size.into().0, stride.into().0, padding.into().0);
    batched("avg_pool2d", input, |x| pool2d(x, PoolMode::Avg, k, s, p))
}

/// Mean over the `output_size` windows that PyTorch's adaptive pooling uses: output `i` of a
/// dim of input size `n` and output size `o` averages `floor(i·n/o) .. ceil((i+1)·n/o)`
/// (`F.adaptive_avg_pool2d`).
pub fn adaptive_avg_pool2d(input: &Tensor, output_size: impl Into<Pair>) -> Result<Tensor> {
    const OP: &str = "adaptive_avg_pool2d";
    let out = output_size.into().0;
    check_float(OP, input)?;
    dispatch::named(&policy::ADAPTIVE_AVG_POOL2D, &[input], || {
        adaptive_avg_pool2d_composite(input, out)
    })
}

/// [`adaptive_avg_pool2d`] behind the dispatch point: two pooling matrices applied by products.
fn adaptive_avg_pool2d_composite(input: &Tensor, out: [usize; 2]) -> Result<Tensor> {
    const OP: &str = "adaptive_avg_pool2d";
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
