//! Pooling through cuDNN: [`pool2d`] runs 2-d max pooling and average pooling (counting the
//! padding) of CUDA tensors with cuDNN's forward call and records a backward that uses cuDNN's
//! backward call (`cuda/cudnn_pool.rs`). Where cuDNN cannot run the problem (a CPU tensor, cuDNN
//! missing or switched off with [`crate::backends::cudnn::set_enabled`], an integer dtype, an
//! empty tensor, a window larger than the padded input, sizes past its 32-bit limits) it answers
//! `Ok(None)` and the caller takes its own path (ember-nn's `functional::pooling`, which has the
//! same semantics).

use crate::autograd::{self, SavedTensor};
use crate::cuda::cudnn;
use crate::cuda::cudnn_pool::{self, PoolParams};
use crate::ops::conv::packed;
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

/// Which pooling [`pool2d`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolMode {
    /// The maximum over each window; padding acts as -inf, NaN propagates (`F.max_pool2d`).
    Max,
    /// The mean over each window with the padding counted as zeros in the divisor `KH·KW`
    /// (`F.avg_pool2d` with `count_include_pad=True`).
    Avg,
}

fn op_name(mode: PoolMode) -> &'static str {
    match mode {
        PoolMode::Max => "max_pool2d",
        PoolMode::Avg => "avg_pool2d",
    }
}

fn as_isize(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

/// Runs `f` on the CUDA storages of `ts` (all packed, see [`packed`]).
fn with_cuda<T, const K: usize>(
    op: &'static str,
    ts: [&Tensor; K],
    f: impl FnOnce([&crate::cuda::CudaStorage; K]) -> Result<T>,
) -> Result<T> {
    let guards = ts.map(|t| t.storage().read());
    let mut storages = Vec::with_capacity(K);
    for (g, t) in guards.iter().zip(ts) {
        match &**g {
            Storage::Cuda(s) => storages.push(s),
            _ => {
                return Err(Error::DeviceMismatch {
                    op,
                    lhs: ts[0].device(),
                    rhs: t.device(),
                })
            }
        }
    }
    let storages: [&crate::cuda::CudaStorage; K] = storages
        .try_into()
        .unwrap_or_else(|_| unreachable!("one storage per tensor"));
    f(storages)
}

/// 2-d pooling of a `[N, C, H, W]` `input` over `kernel` windows moved by `stride`, with
/// implicit `padding` on both sides of each spatial dim, dilation 1 and floor output sizes
/// (`ceil_mode=False`), as `F.max_pool2d` / `F.avg_pool2d(count_include_pad=True)`.
///
/// Returns `Ok(Some(output))` when cuDNN ran it (a CUDA float tensor, cuDNN loadable and
/// enabled, a window that fits the padded input, sizes within cuDNN's limits) and `Ok(None)`
/// when it did not, so that callers fall back to another implementation; bad arguments (a rank
/// other than 4, a zero kernel or stride, padding over half the kernel) are errors either way.
/// A non-contiguous input is copied first. The gradient of max pooling goes to one position
/// per window (the maximum; which one of tied maxima cuDNN picks is its choice).
pub fn pool2d(
    input: &Tensor,
    mode: PoolMode,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
) -> Result<Option<Tensor>> {
    let op = op_name(mode);
    if input.rank() != 4 {
        return Err(Error::invalid(
            op,
            format!("expected a 4-D [N, C, H, W] input, got shape {}", input.shape()),
        ));
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
    if !matches!(input.device(), Device::Cuda(_)) || !cudnn::enabled() || !cudnn::is_available() {
        return Ok(None);
    }
    let d = input.dims();
    let params = PoolParams {
        dtype: input.dtype(),
        max: mode == PoolMode::Max,
        input: [d[0], d[1], d[2], d[3]],
        kernel,
        stride,
        padding,
    };
    if !params.supported() {
        return Ok(None);
    }
    let out_dims = params.output().expect("supported() checks the output").to_vec();
    let x = packed(input)?;
    let Some(y) = with_cuda(op, [&x], |[xs]| cudnn_pool::pool_forward(xs, &params))? else {
        return Ok(None);
    };
    let mut y = Tensor::from_storage(Storage::Cuda(y), out_dims.as_slice());
    if autograd::needs_grad(&[input]) {
        // `y` is saved before `record` (detached, no cycle); it shares its storage, and so its
        // version counter, with the recorded output.
        let (xs, ys) = (SavedTensor::new(op, &x), SavedTensor::new(op, &y));
        let in_dims = input.dims().to_vec();
        y = autograd::record(op, &[input], y, move |g, _needs| {
            let g = packed(&g.to_dtype(params.dtype)?.reshape(&as_isize(&out_dims))?)?;
            let (x, y) = (xs.get()?, ys.get()?);
            let dx = with_cuda(op, [x, y, &g], |[x, y, g]| {
                cudnn_pool::pool_backward(x, y, g, &params)
            })?;
            Ok(vec![Some(Tensor::from_storage(
                Storage::Cuda(dx),
                in_dims.as_slice(),
            ))])
        });
    }
    Ok(Some(y))
}
