//! 2-d max and average pooling on every device: [`pool2d`] runs through the backend's pooling
//! calls (CPU: `cpu/pool.rs`; CUDA: cuDNN, `cuda_backend/cudnn_pool.rs`) and records a backward that
//! uses the backend's pooling backward. Where the backend does not run the problem (cuDNN
//! missing or switched off with [`crate::backends::cudnn::set_enabled`], an empty tensor, sizes
//! past cuDNN's limits) the composite path of `conv_composite.rs` (a window gather, then
//! `max_dim` or `mean_dims`) runs instead, with the same semantics. [`adaptive_avg_pool2d`]
//! is a composite of two products with constant pooling matrices.

use super::conv::{as_isize, packed};
use super::conv_composite;
use crate::autograd::{self, SavedTensor};
use crate::backend::PoolParams;
use crate::dispatch::{self, policy, Door};
use crate::{DType, Device, Error, Result, Shape, Tensor};

pub use crate::backend::op::PoolMode;

fn op_name(mode: PoolMode) -> &'static str {
    match mode {
        PoolMode::Max => "max_pool2d",
        PoolMode::Avg => "avg_pool2d",
    }
}

/// 2-d pooling of a floating-point `[N, C, H, W]` `input` over `kernel` windows moved by
/// `stride`, with implicit `padding` on both sides of each spatial dim, dilation 1 and floor
/// output sizes (`ceil_mode=False`), as `F.max_pool2d` / `F.avg_pool2d(count_include_pad=True)`.
///
/// Max pooling treats padding as -inf, propagates NaN, and sends each window's gradient to one
/// position: on the CPU the first maximum (the last NaN), as PyTorch's CPU kernel; with cuDNN,
/// which one of tied maxima is cuDNN's choice. Errors for a rank other than 4, an integer
/// dtype, a zero kernel or stride, padding over half the kernel, or a window larger than the
/// padded input.
///
/// It enters the dispatch point as `max_pool2d` or `avg_pool2d`.
pub fn pool2d(
    input: &Tensor,
    mode: PoolMode,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
) -> Result<Tensor> {
    let line = match mode {
        PoolMode::Max => &policy::MAX_POOL2D,
        PoolMode::Avg => &policy::AVG_POOL2D,
    };
    dispatch::composite_kernel(line, [input], |[input], door| {
        pool2d_prepared(input, mode, kernel, stride, padding, door)
    })
}

fn pool2d_prepared(
    input: &Tensor,
    mode: PoolMode,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    door: Door,
) -> Result<Tensor> {
    let op = op_name(mode);
    if input.rank() != 4 {
        return Err(Error::invalid(
            op,
            format!("expected a 4-D [N, C, H, W] input, got shape {}", input.shape()),
        ));
    }
    if !input.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: input.dtype(),
            hint: "pooling takes floating point inputs",
        });
    }
    if kernel.contains(&0) || stride.contains(&0) {
        return Err(Error::invalid(
            op,
            format!("kernel_size {kernel:?} and stride {stride:?} must be positive"),
        ));
    }
    if (0..2).any(|d| 2 * padding[d] > kernel[d]) {
        return Err(Error::invalid(
            op,
            format!("pad should be at most half of kernel size, but got pad={padding:?} and kernel_size={kernel:?}"),
        ));
    }
    let d = input.dims();
    let params = PoolParams {
        dtype: input.dtype(),
        mode,
        input: [d[0], d[1], d[2], d[3]],
        kernel,
        stride,
        padding,
    };
    let Some(out_dims) = params.output() else {
        return Err(Error::invalid(
            op,
            format!(
                "input size {:?} with padding {padding:?} is smaller than the kernel {kernel:?}: the output would be empty",
                &d[2..]
            ),
        ));
    };
    Shape::from(out_dims.as_slice()).checked_elements(op)?;
    let x = packed(input, door)?;
    let y = x.storage().read().pool_forward(&params)?;
    let Some(y) = y else {
        return conv_composite::pool2d(input, &params);
    };
    let y = door.tensor(y, out_dims.as_slice());
    if !autograd::needs_grad(&[input]) {
        return Ok(y);
    }
    // `y` is saved before `record` (detached, no cycle); it shares its storage, and so its
    // version counter, with the recorded output.
    let (xs, ys) = (SavedTensor::new(op, &x), SavedTensor::new(op, &y));
    let in_dims = input.dims().to_vec();
    Ok(door.record(op, &[input], y, move |g, _needs| {
        let g = packed(&g.to_dtype(params.dtype)?.reshape(&as_isize(&out_dims))?, door)?;
        let (x, y) = (xs.get()?, ys.get()?);
        let dx = {
            let (sx, sy, sg) = (x.storage().read(), y.storage().read(), g.storage().read());
            sx.pool_backward(&sy, &sg, &params)?
        };
        let dx = match dx {
            Some(dx) => door.tensor(dx, in_dims.as_slice()),
            None => {
                // The backend ran the forward but declines the backward: the composite path's.
                let _grad = autograd::enable_grad();
                let x = x.detach().requires_grad_(true)?;
                let y = conv_composite::pool2d(&x, &params)?;
                let grads = autograd::grad(
                    &[y],
                    std::slice::from_ref(&x),
                    Some(std::slice::from_ref(&g)),
                    false,
                )?;
                match grads.into_iter().next().flatten() {
                    Some(dx) => dx,
                    None => x.zeros_like()?,
                }
            }
        };
        Ok(vec![Some(dx)])
    }))
}

/// Adaptive average pooling of a floating-point `[N, C, H, W]` (or unbatched `[C, H, W]`)
/// `input` to `output_size` (`F.adaptive_avg_pool2d`): output `i` of a dim of input size `n`
/// and output size `o` averages `floor(i·n/o) .. ceil((i+1)·n/o)`. Separable: the mean over a
/// window is a row average then a column average, so it is two small GEMMs with constant
/// pooling matrices, `P_h @ x @ P_wᵀ`, whose backward is two GEMMs as well. It enters the
/// dispatch point as `adaptive_avg_pool2d`.
pub fn adaptive_avg_pool2d(input: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    const OP: &str = "adaptive_avg_pool2d";
    if !input.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: input.dtype(),
            hint: "pooling takes floating point inputs",
        });
    }
    dispatch::named(&policy::ADAPTIVE_AVG_POOL2D, &[input], || {
        adaptive_avg_pool2d_composite(input, output_size)
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

#[cfg(test)]
mod tests {
    //! The CPU backend's pooling against the composite path, on random problems.

    use super::*;
    use crate::ops::conv::tests::{assert_close, Rng};
    use crate::DType;

    #[test]
    fn cpu_backend_matches_the_composite_path() {
        let mut rng = Rng::new(11);
        for case in 0..40 {
            let mode = if case % 2 == 0 {
                PoolMode::Max
            } else {
                PoolMode::Avg
            };
            let kernel = [rng.int(1, 4), rng.int(1, 4)];
            let stride = [rng.int(1, 3), rng.int(1, 3)];
            let padding = [0, 1].map(|d| rng.int(0, kernel[d] / 2));
            let hw = [0, 1].map(|d| kernel[d] + rng.int(0, 5));
            let input = [rng.int(1, 2), rng.int(1, 3), hw[0], hw[1]];
            let params = PoolParams {
                dtype: DType::F64,
                mode,
                input,
                kernel,
                stride,
                padding,
            };
            let what = format!("case {case}: {params:?}");
            let x = rng.tensor(&input);
            let g = rng.tensor(&params.output().unwrap());
            let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
                let x = x.detach().requires_grad_(true).unwrap();
                let y = f(&x).unwrap();
                y.backward_with(Some(&g), false).unwrap();
                [y.detach(), x.grad().unwrap()]
            };
            let backend = run(&|x| pool2d(x, mode, kernel, stride, padding));
            let composite = run(&|x| conv_composite::pool2d(x, &params));
            assert_close(&format!("{what} output"), &backend[0], &composite[0]);
            assert_close(&format!("{what} input gradient"), &backend[1], &composite[1]);
        }
    }
}
