//! Convolution on every device: [`convolution`] runs 1-d and 2-d convolutions (groups, stride,
//! zero padding, dilation) through the backend's convolution calls (CPU: im2col + GEMM in
//! `cpu/conv.rs`; CUDA: cuDNN) and records a backward that uses the backend's backward-data and
//! backward-filter calls. The bias goes into the output through the backend's bias call where
//! it has one (cuDNN's `cudnnAddTensor`), its gradient then being a sum over N and the spatial
//! dims (`bias_grad`); elsewhere it is a broadcast addition with that addition's backward.
//! Where the backend does not run the problem (cuDNN missing or switched off with
//! [`crate::backends::cudnn::set_enabled`], a size past cuDNN's limits, an integer dtype) the
//! composite path of `conv_composite.rs` runs instead, with the same semantics. [`unfold`] is
//! that path's window gather (`F.unfold`).

use super::conv_composite::{self, Window};
use crate::autograd::{self, SavedTensor};
use crate::backend::ConvParams;
use crate::dispatch::{self, policy, Door};
use crate::shape::checked_mul;
use crate::{Error, Result, Shape, Tensor};

const OP: &str = "convolution";

/// `t` row-major from its storage's first element (the backends read it from there), detached.
pub(crate) fn packed(t: &Tensor, door: Door) -> Result<Tensor> {
    if t.is_contiguous() && t.storage_offset() == 0 {
        return Ok(t.detach());
    }
    let storage = t.storage().read().to_dtype(t.layout(), t.dtype())?;
    Ok(door.tensor(storage, t.shape().clone()))
}

pub(crate) fn as_isize(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

/// The convolution (cross-correlation, zero padding) of `input` `[N, C, L]` or `[N, C, H, W]`
/// with `weight` `[O, C/groups, K..]` and an optional `bias` `[O]`, as `torch.convolution`
/// without transposition; `stride`, `padding` and `dilation` hold one value per spatial dim.
/// Errors for bad arguments: ranks, groups, dtypes or devices that differ, a zero stride or
/// dilation, a (dilated) kernel larger than the padded input.
///
/// It enters the dispatch point as `conv1d` or `conv2d` (by the input's rank: autocast runs it
/// in the lower precision, as PyTorch's list does), the backend's kernels or the composite
/// fallback running inside.
pub fn convolution(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: &[usize],
    padding: &[usize],
    dilation: &[usize],
    groups: usize,
) -> Result<Tensor> {
    let line = if input.rank() == 3 {
        &policy::CONV1D
    } else {
        &policy::CONV2D
    };
    dispatch::composite_list_kernel(line, &[Some(input), Some(weight), bias], |ins, door| {
        let [Some(input), Some(weight), bias] = ins else {
            unreachable!("the input and weight are always given")
        };
        convolution_prepared(
            input,
            weight,
            bias.as_ref(),
            stride,
            padding,
            dilation,
            groups,
            door,
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn convolution_prepared(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: &[usize],
    padding: &[usize],
    dilation: &[usize],
    groups: usize,
    door: Door,
) -> Result<Tensor> {
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
    if weight.dtype() != input.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: input.dtype(),
            found: weight.dtype(),
        });
    }
    if !input.dtype().is_floating_point() {
        // As PyTorch ("slow_conv2d_cpu" not implemented for 'Long').
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: input.dtype(),
            hint:
                "convolution needs a floating point input and weight; convert them with .to_dtype(DType::F32)",
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
    if stride.contains(&0) || dilation.contains(&0) {
        return Err(Error::invalid(
            OP,
            format!("stride {stride:?} and dilation {dilation:?} must be positive"),
        ));
    }
    let Some(out4) = params.output() else {
        return Err(Error::invalid(
            OP,
            format!(
                "input size {:?} with padding {padding:?} is smaller than the (dilated) kernel {:?}: the output would be empty",
                &input.dims()[2..],
                &weight.dims()[2..]
            ),
        ));
    };
    let out_dims: Vec<usize> = if spatial == 1 {
        vec![out4[0], out4[1], out4[3]]
    } else {
        out4.to_vec()
    };
    // Note [Checked sizes]: the output, and the im2col columns of one image
    // (C/groups·KH·KW × OH·OW), must be addressable.
    Shape::from(out_dims.as_slice()).checked_elements(OP)?;
    let window = params.weight[1..].iter().product::<usize>();
    checked_mul(OP, "im2col columns", window, out4[2] * out4[3])?;
    let x = packed(input, door)?.reshape(&as_isize(&params.input))?;
    let w = packed(weight, door)?.reshape(&as_isize(&params.weight))?;
    let y = {
        let (sx, sw) = (x.storage().read(), w.storage().read());
        sx.conv_forward(&sw, &params)?
    };
    let (y, bias) = match y {
        Some(y) => {
            // The backend's own bias addition into the fresh output (one kernel, where the
            // broadcast addition is a strided one) when it takes the bias as it is.
            let fused = match bias.filter(|b| b.dtype() == params.dtype) {
                Some(b) => {
                    let b = packed(b, door)?;
                    let added = y.conv_bias_add(&b.storage().read(), &params)?;
                    added.then_some(b)
                }
                None => None,
            };
            let y = door.tensor(y, out_dims.as_slice());
            let inputs: Vec<&Tensor> = match (&fused, bias) {
                (Some(_), Some(b)) => vec![input, weight, b],
                _ => vec![input, weight],
            };
            let y = if autograd::needs_grad(&inputs) {
                record_backward(&inputs, &x, &w, params, y, door)
            } else {
                y
            };
            (y, if fused.is_some() { None } else { bias })
        }
        None => {
            // The composite path, with its own autograd through the tensor ops it is made of.
            let x = input.reshape(&as_isize(&params.input))?;
            let w = weight.reshape(&as_isize(&params.weight))?;
            let y = conv_composite::conv2d(&x, &w, &params)?.reshape(&as_isize(&out_dims))?;
            (y, bias)
        }
    };
    match bias {
        Some(b) => {
            let mut shape = vec![1, o as isize];
            shape.resize(rank, 1);
            y.add(&b.reshape(&shape)?)
        }
        None => Ok(y),
    }
}

/// Records the backward of a backend convolution `y` of the packed 4-D `x` and `w`; `inputs`
/// are the op's input and weight, and its bias where the backend added it into `y`.
fn record_backward(
    inputs: &[&Tensor],
    x: &Tensor,
    w: &Tensor,
    params: ConvParams,
    y: Tensor,
    door: Door,
) -> Tensor {
    let (xs, ws) = (SavedTensor::new(OP, x), SavedTensor::new(OP, w));
    let (in_dims, w_dims) = (inputs[0].dims().to_vec(), inputs[1].dims().to_vec());
    let out4 = params.output().expect("checked before the forward ran");
    door.record(OP, inputs, y, move |g, needs| {
        let g = packed(&g.to_dtype(params.dtype)?.reshape(&as_isize(&out4))?, door)?;
        let (x, w) = (xs.get()?, ws.get()?);
        let (sg, sx, sw) = (g.storage().read(), x.storage().read(), w.storage().read());
        let dx = if needs[0] {
            sw.conv_backward_data(&sg, &params)?
        } else {
            None
        };
        let dw = if needs[1] {
            sx.conv_backward_filter(&sg, &params)?
        } else {
            None
        };
        let missing = (needs[0] && dx.is_none()) || (needs[1] && dw.is_none());
        drop((sg, sx, sw));
        let db = if needs.get(2) == Some(&true) {
            Some(bias_grad(&g)?)
        } else {
            None
        };
        let mut grads = if missing {
            // The backend ran the forward but declines the backward: the composite path's.
            let grads = composite_grads(x, w, &g, &params, &needs[..2])?;
            vec![
                grads[0]
                    .as_ref()
                    .map(|t| t.reshape(&as_isize(&in_dims)))
                    .transpose()?,
                grads[1]
                    .as_ref()
                    .map(|t| t.reshape(&as_isize(&w_dims)))
                    .transpose()?,
            ]
        } else {
            vec![
                dx.map(|s| door.tensor(s, in_dims.as_slice())),
                dw.map(|s| door.tensor(s, w_dims.as_slice())),
            ]
        };
        if needs.len() == 3 {
            grads.push(db);
        }
        Ok(grads)
    })
}

/// The bias gradient `[O]` from the 4-d output gradient `g`: its sum over N and the spatial
/// dims, taken as two reductions, first over each (image, channel)'s contiguous spatial run,
/// then over the images. On an H100/H200 this is several times faster than one reduction over
/// the non-adjacent dims 0, 2 and 3, and than cuDNN's `cudnnConvolutionBackwardBias` (65 and
/// 114 µs for the CNN workload's two convolutions, measured with ncu).
fn bias_grad(g: &Tensor) -> Result<Tensor> {
    g.sum_dims(&[2, 3], false)?.sum_dim(0, false)
}

/// The input and weight gradients (as `needs` says) of the composite convolution of the 4-D
/// `x` and `w` for the output gradient `g`.
fn composite_grads(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    params: &ConvParams,
    needs: &[bool],
) -> Result<[Option<Tensor>; 2]> {
    let _grad = autograd::enable_grad();
    let (x, w) = (
        x.detach().requires_grad_(needs[0])?,
        w.detach().requires_grad_(needs[1])?,
    );
    let y = conv_composite::conv2d(&x, &w, params)?;
    let targets: Vec<Tensor> = [&x, &w]
        .into_iter()
        .zip(needs)
        .filter(|(_, &n)| n)
        .map(|(t, _)| t.clone())
        .collect();
    let mut grads = autograd::grad(&[y], &targets, Some(std::slice::from_ref(g)), false)?.into_iter();
    Ok([
        if needs[0] { grads.next().flatten() } else { None },
        if needs[1] { grads.next().flatten() } else { None },
    ])
}

/// Sliding local blocks of a batched `[N, C, H, W]` input as `[N, C·KH·KW, L]` (`F.unfold`,
/// im2col), zero padded; `L` is the number of window positions. Differentiable (the gather's
/// backward); see Note [im2col by gather] in `conv_composite.rs`.
pub fn unfold(
    input: &Tensor,
    kernel: [usize; 2],
    dilation: [usize; 2],
    padding: [usize; 2],
    stride: [usize; 2],
) -> Result<Tensor> {
    dispatch::named(&policy::IM2COL, &[input], || {
        unfold_composite(input, kernel, dilation, padding, stride)
    })
}

fn unfold_composite(
    input: &Tensor,
    kernel: [usize; 2],
    dilation: [usize; 2],
    padding: [usize; 2],
    stride: [usize; 2],
) -> Result<Tensor> {
    const OP: &str = "unfold";
    if input.rank() != 4 {
        return Err(Error::invalid(
            OP,
            format!("expected a 4-D [N, C, H, W] input, got shape {}", input.shape()),
        ));
    }
    let win = Window {
        kernel,
        stride,
        padding,
        dilation,
    };
    let hw = [input.dims()[2], input.dims()[3]];
    let Some(out) = win.output_size(hw) else {
        return Err(Error::invalid(
            OP,
            format!(
                "kernel size {kernel:?}, stride {stride:?} and dilation {dilation:?} must be positive and the (dilated) kernel must fit the input {hw:?} with padding {padding:?}"
            ),
        ));
    };
    let (n, c) = (input.dims()[0], input.dims()[1]);
    let positions = checked_mul(OP, "output positions", out[0], out[1])?;
    let rows = checked_mul(OP, "channels × kernel positions", c, kernel[0] * kernel[1])?;
    Shape::from([n, rows, positions]).checked_elements(OP)?;
    let cols = conv_composite::windows(input, &win, out, 0.0)?;
    cols.reshape(&as_isize(&[n, c * kernel[0] * kernel[1], out[0] * out[1]]))
}

#[cfg(test)]
pub(crate) mod tests {
    //! The CPU backend's convolution against the composite path, on random problems.

    use super::*;
    use crate::{DType, Device};

    /// A small xorshift generator: sizes and values without an RNG crate.
    pub(crate) struct Rng(u64);

    impl Rng {
        pub(crate) fn new(seed: u64) -> Rng {
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Uniform in `lo..=hi`.
        pub(crate) fn int(&mut self, lo: usize, hi: usize) -> usize {
            lo + (self.next() % (hi - lo + 1) as u64) as usize
        }

        /// An f64 tensor of uniform values in [-1, 1).
        pub(crate) fn tensor(&mut self, dims: &[usize]) -> Tensor {
            let v: Vec<f64> = (0..dims.iter().product::<usize>())
                .map(|_| (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
                .collect();
            Tensor::from_vec(v, dims, Device::Cpu).unwrap()
        }
    }

    pub(crate) fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
        assert_eq!(a.dims(), b.dims(), "{what}: shapes");
        for (i, (x, y)) in a
            .to_vec_f64()
            .unwrap()
            .iter()
            .zip(b.to_vec_f64().unwrap())
            .enumerate()
        {
            assert!(
                (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                "{what}: element {i}: {x} vs {y}"
            );
        }
    }

    /// Output, input gradient and weight gradient of `f` for the output gradient `g`.
    fn run(
        f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
        x: &Tensor,
        w: &Tensor,
        g_seed: u64,
    ) -> [Tensor; 3] {
        let (x, w) = (
            x.detach().requires_grad_(true).unwrap(),
            w.detach().requires_grad_(true).unwrap(),
        );
        let y = f(&x, &w).unwrap();
        let g = Rng::new(g_seed).tensor(y.dims());
        y.backward_with(Some(&g), false).unwrap();
        [y.detach(), x.grad().unwrap(), w.grad().unwrap()]
    }

    #[test]
    fn cpu_backend_matches_the_composite_path() {
        let mut rng = Rng::new(7);
        for case in 0..40 {
            let one_d = case % 4 == 3;
            let groups = rng.int(1, 3);
            let (cg, og) = (rng.int(1, 3), rng.int(1, 3));
            let n = rng.int(1, 3);
            let k = [if one_d { 1 } else { rng.int(1, 3) }, rng.int(1, 3)];
            let stride = [if one_d { 1 } else { rng.int(1, 3) }, rng.int(1, 3)];
            let padding = [if one_d { 0 } else { rng.int(0, 2) }, rng.int(0, 2)];
            let dilation = [if one_d { 1 } else { rng.int(1, 2) }, rng.int(1, 2)];
            // Inputs large enough for the dilated kernel.
            let hw = [0, 1].map(|d| dilation[d] * (k[d] - 1) + 1 + rng.int(0, 4));
            let params = ConvParams {
                dtype: DType::F64,
                input: [n, cg * groups, if one_d { 1 } else { hw[0] }, hw[1]],
                weight: [og * groups, cg, k[0], k[1]],
                stride,
                padding,
                dilation,
                groups,
            };
            let x = rng.tensor(&params.input);
            let w = rng.tensor(&params.weight);
            let what = format!("case {case}: {params:?}");
            let (x, w, d) = if one_d {
                (x.squeeze_dim(2).unwrap(), w.squeeze_dim(2).unwrap(), 1)
            } else {
                (x, w, 0)
            };
            let backend = run(
                |x, w| convolution(x, w, None, &stride[d..], &padding[d..], &dilation[d..], groups),
                &x,
                &w,
                case,
            );
            let composite = run(
                |x, w| {
                    let x4 = x.reshape(&as_isize(&params.input))?;
                    let w4 = w.reshape(&as_isize(&params.weight))?;
                    let y = conv_composite::conv2d(&x4, &w4, &params)?;
                    let mut dims = y.dims().to_vec();
                    if one_d {
                        dims.remove(2);
                    }
                    y.reshape(&as_isize(&dims))
                },
                &x,
                &w,
                case,
            );
            for (i, name) in ["output", "input gradient", "weight gradient"].iter().enumerate() {
                assert_close(&format!("{what} {name}"), &backend[i], &composite[i]);
            }
        }
    }

    #[test]
    fn half_precision_computes_in_f32_and_rounds_once() {
        let mut rng = Rng::new(3);
        let (x, w) = (rng.tensor(&[2, 3, 6, 5]), rng.tensor(&[4, 3, 3, 3]));
        for dtype in [DType::F16, DType::BF16] {
            let (xh, wh) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
            let y = convolution(&xh, &wh, None, &[1, 2], &[1, 1], &[1, 1], 1).unwrap();
            assert_eq!(y.dtype(), dtype);
            let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let y32 = convolution(&wide(&xh), &wide(&wh), None, &[1, 2], &[1, 1], &[1, 1], 1).unwrap();
            assert_eq!(
                y.to_vec_f64().unwrap(),
                y32.to_dtype(dtype).unwrap().to_vec_f64().unwrap(),
                "{dtype}"
            );
        }
    }
}
