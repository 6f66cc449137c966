//! Convolution through cuDNN: [`convolution`] runs 1-d and 2-d convolutions of CUDA tensors
//! with cuDNN's forward call and records a backward that uses cuDNN's backward data and
//! backward filter calls (the bias gradient, a sum over N and the spatial dims, comes from the
//! broadcast addition's own backward). Where cuDNN cannot run the problem (a CPU tensor, cuDNN
//! missing or switched off with [`crate::backends::cudnn::set_enabled`], an integer dtype,
//! sizes past its 32-bit limits) it answers `Ok(None)` and the caller takes its own path
//! (ember-nn's im2col + GEMM, which has the same semantics).

use crate::autograd::{self, SavedTensor};
use crate::cuda::cudnn::{self, ConvParams};
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

const OP: &str = "convolution";

/// `input` row-major from its storage's first element (cuDNN reads it from there), detached.
pub(crate) fn packed(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() && t.storage_offset() == 0 {
        return Ok(t.detach());
    }
    let storage = t.storage().read().to_dtype(t.layout(), t.dtype())?;
    Ok(Tensor::from_storage(storage, t.shape().clone()))
}

/// Runs `f` on the CUDA storages of `a` and `b` (both packed, see [`packed`]).
fn with_cuda<T>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&crate::cuda::CudaStorage, &crate::cuda::CudaStorage) -> Result<T>,
) -> Result<T> {
    let (sa, sb) = (a.storage().read(), b.storage().read());
    match (&*sa, &*sb) {
        (Storage::Cuda(x), Storage::Cuda(y)) => f(x, y),
        _ => Err(Error::DeviceMismatch {
            op: OP,
            lhs: a.device(),
            rhs: b.device(),
        }),
    }
}

fn as_isize(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

/// The convolution (cross-correlation, zero padding) of `input` `[N, C, L]` or `[N, C, H, W]`
/// with `weight` `[O, C/groups, K..]` and an optional `bias` `[O]`, as `torch.convolution`
/// without transposition; `stride`, `padding` and `dilation` hold one value per spatial dim.
///
/// Returns `Ok(Some(output))` when cuDNN ran it (CUDA tensors, cuDNN loadable and enabled, a
/// float dtype, sizes within cuDNN's limits) and `Ok(None)` when it did not, so that callers
/// fall back to another implementation; bad arguments (ranks, groups, dtypes, devices that
/// differ) are errors either way.
pub fn convolution(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: &[usize],
    padding: &[usize],
    dilation: &[usize],
    groups: usize,
) -> Result<Option<Tensor>> {
    let rank = input.rank();
    if !(rank == 3 || rank == 4) || weight.rank() != rank {
        return Err(Error::invalid(
            OP,
            format!(
                "expected a batched [N, C, L] or [N, C, H, W] input and a weight of the same rank, got {} and {}",
                input.shape(),
                weight.shape()
            ),
        ));
    }
    let spatial = rank - 2;
    if stride.len() != spatial || padding.len() != spatial || dilation.len() != spatial {
        return Err(Error::invalid(
            OP,
            format!(
                "stride {stride:?}, padding {padding:?} and dilation {dilation:?} must hold one value per spatial dim ({spatial})"
            ),
        ));
    }
    for t in std::iter::once(weight).chain(bias) {
        if t.device() != input.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: input.device(),
                rhs: t.device(),
            });
        }
    }
    if weight.dtype() != input.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: input.dtype(),
            found: weight.dtype(),
        });
    }
    let (c, o, cg) = (input.dims()[1], weight.dims()[0], weight.dims()[1]);
    if groups == 0 || o % groups != 0 || cg * groups != c {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: input.shape().clone(),
            rhs: weight.shape().clone(),
            hint: "groups must divide in_channels and out_channels, and the weight must be [out_channels, in_channels/groups, kernel...]",
        });
    }
    if let Some(b) = bias.filter(|b| b.dims() != [o]) {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: weight.shape().clone(),
            rhs: b.shape().clone(),
            hint: "the bias must be 1-D with out_channels elements",
        });
    }
    if !matches!(input.device(), Device::Cuda(_)) || !cudnn::enabled() || !cudnn::is_available() {
        return Ok(None);
    }
    // 1-d runs as 2-d with a height of 1.
    let four = |d: &[usize]| -> [usize; 4] {
        if spatial == 1 {
            [d[0], d[1], 1, d[2]]
        } else {
            [d[0], d[1], d[2], d[3]]
        }
    };
    let two = |v: &[usize], pad: usize| -> [usize; 2] {
        if spatial == 1 {
            [pad, v[0]]
        } else {
            [v[0], v[1]]
        }
    };
    let params = ConvParams {
        dtype: input.dtype(),
        input: four(input.dims()),
        weight: four(weight.dims()),
        stride: two(stride, 1),
        padding: two(padding, 0),
        dilation: two(dilation, 1),
        groups,
    };
    if !params.supported() {
        return Ok(None);
    }
    let out4 = params.output().expect("supported() checks the output");
    let out_dims: Vec<usize> = if spatial == 1 {
        vec![out4[0], out4[1], out4[3]]
    } else {
        out4.to_vec()
    };
    let (x, w) = (packed(input)?, packed(weight)?);
    let y = with_cuda(&x, &w, |xs, ws| cudnn::conv_forward(xs, ws, &params))?;
    let mut y = Tensor::from_storage(Storage::Cuda(y), out_dims.as_slice());
    if autograd::needs_grad(&[input, weight]) {
        let (xs, ws) = (SavedTensor::new(OP, &x), SavedTensor::new(OP, &w));
        let (in_dims, w_dims, g_dims) = (input.dims().to_vec(), weight.dims().to_vec(), out_dims.clone());
        y = autograd::record(OP, &[input, weight], y, move |g, needs| {
            let g = packed(&g.to_dtype(params.dtype)?.reshape(&as_isize(&g_dims))?)?;
            let dx = if needs[0] {
                let w = ws.get()?;
                let dx = with_cuda(w, &g, |w, g| cudnn::conv_backward_data(w, g, &params))?;
                Some(Tensor::from_storage(Storage::Cuda(dx), in_dims.as_slice()))
            } else {
                None
            };
            let dw = if needs[1] {
                let x = xs.get()?;
                let dw = with_cuda(x, &g, |x, g| cudnn::conv_backward_filter(x, g, &params))?;
                Some(Tensor::from_storage(Storage::Cuda(dw), w_dims.as_slice()))
            } else {
                None
            };
            Ok(vec![dx, dw])
        });
    }
    match bias {
        Some(b) => {
            let mut shape = vec![1, o as isize];
            shape.resize(rank, 1);
            Ok(Some(y.add(&b.reshape(&shape)?)?))
        }
        None => Ok(Some(y)),
    }
}
