//! Linear and convolution layers as functions: `linear`, `conv1d`, `conv2d`, and `unfold`
//! (im2col), the window gather that convolution and max pooling share.
//!
//! Note [im2col by gather]: the windows of an `[N, C, H, W]` input are read with one
//! `index_select` over its flattened `H·W` positions, with an index built on the host once
//! per geometry (kernel, stride, padding, dilation, input size, device) and cached. Padding
//! costs one extra element per channel row: the input is flattened and one constant (0 for
//! convolution, -inf for max pooling) is appended, and every padded position of a window
//! points at it. The gather gives `[N, C, KH·KW, L]` (`L = OH·OW`), which for convolution is
//! already the `[N, G, C/G·KH·KW, L]` right-hand side of ONE batched GEMM with the weight as
//! `[G, O/G, C/G·KH·KW]` broadcast over the batch: the output comes out as `[N, O, OH·OW]`,
//! i.e. NCHW with no permute. Backward is the GEMM's and `index_add` into the flat input.
//! A fused im2col kernel would save the index tensor and the range check that ember-core's
//! CUDA `index_select` does (one small host synchronization per call, see
//! `cuda/index.rs`). On CUDA, `ember_core::ops::conv::convolution` (cuDNN) runs first and this
//! path is the fallback where cuDNN is missing, switched off, or cannot take the problem.

use super::{idims, Pair};
use ember_core::{Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// `input @ weight.T + bias` (`F.linear`): `input` is `[*, in_features]`, `weight`
/// `[out_features, in_features]`, `bias` `[out_features]`.
pub fn linear(input: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    input.linear(weight, bias)
}

/// Geometry of one 2-D sliding-window op over an `h`×`w` input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl Window {
    /// Checks the arguments and returns the output size `[OH, OW]` for an `[h, w]` input.
    pub(crate) fn output_size(&self, op: &'static str, hw: [usize; 2]) -> Result<[usize; 2]> {
        let mut out = [0; 2];
        for d in 0..2 {
            if self.kernel[d] == 0 || self.stride[d] == 0 || self.dilation[d] == 0 {
                return Err(Error::invalid(
                    op,
                    format!(
                        "kernel size, stride and dilation must be positive, got kernel {:?}, stride {:?}, dilation {:?}",
                        self.kernel, self.stride, self.dilation
                    ),
                ));
            }
            let span = self.dilation[d] * (self.kernel[d] - 1) + 1;
            let padded = hw[d] + 2 * self.padding[d];
            if padded < span {
                return Err(Error::invalid(
                    op,
                    format!(
                        "input size {:?} with padding {:?} is smaller than the (dilated) kernel {:?}: the output would be empty",
                        hw, self.padding, self.kernel
                    ),
                ));
            }
            out[d] = (padded - span) / self.stride[d] + 1;
        }
        Ok(out)
    }

    /// The flat input position (`h·W + w`, or `H·W` for padding) of window element `k` of
    /// output position `l`, laid out `[k][l]`.
    fn index(&self, hw: [usize; 2], out: [usize; 2]) -> Vec<i64> {
        let [h, w] = hw;
        let [kh, kw] = self.kernel;
        let pad = (h * w) as i64;
        let mut idx = Vec::with_capacity(kh * kw * out[0] * out[1]);
        for i in 0..kh {
            for j in 0..kw {
                for oh in 0..out[0] {
                    let y = (oh * self.stride[0] + i * self.dilation[0]) as i64 - self.padding[0] as i64;
                    for ow in 0..out[1] {
                        let x = (ow * self.stride[1] + j * self.dilation[1]) as i64 - self.padding[1] as i64;
                        let inside = y >= 0 && y < h as i64 && x >= 0 && x < w as i64;
                        idx.push(if inside { y * w as i64 + x } else { pad });
                    }
                }
            }
        }
        idx
    }
}

/// Index tensors of [`Window::index`], per geometry and device.
type IndexCache = HashMap<(Window, [usize; 2], Device), Tensor>;

/// Entries kept before the cache starts over (each is `KH·KW·OH·OW` int64 values).
const INDEX_CACHE_ENTRIES: usize = 64;

fn window_index(win: &Window, hw: [usize; 2], out: [usize; 2], device: Device) -> Result<Tensor> {
    static CACHE: OnceLock<Mutex<IndexCache>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (*win, hw, device);
    if let Some(t) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(t.clone());
    }
    let idx = win.index(hw, out);
    let n = idx.len();
    let t = Tensor::from_vec(idx, [n], device)?;
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    if c.len() >= INDEX_CACHE_ENTRIES {
        c.clear();
    }
    c.insert(key, t.clone());
    Ok(t)
}

/// The windows of `x` (`[N, C, H, W]`) as `[N, C, KH·KW, OH·OW]`, padded positions reading
/// `pad_value` (see Note [im2col by gather]); also returns `[OH, OW]`.
pub(crate) fn windows(
    op: &'static str,
    x: &Tensor,
    win: &Window,
    pad_value: f64,
) -> Result<(Tensor, [usize; 2])> {
    let (n, c, h, w) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
    let out = win.output_size(op, [h, w])?;
    let index = window_index(win, [h, w], out, x.device())?;
    let flat = x.reshape(&idims(&[n, c, h * w]))?;
    let src = if win.padding == [0, 0] {
        flat
    } else {
        let fill = Tensor::full([1, 1, 1], pad_value, x.dtype(), x.device())?.expand(&idims(&[n, c, 1]))?;
        Tensor::cat(&[flat, fill], 2)?
    };
    let kk = win.kernel[0] * win.kernel[1];
    let cols = src
        .index_select(2, &index)?
        .reshape(&idims(&[n, c, kk, out[0] * out[1]]))?;
    Ok((cols, out))
}

/// Sliding local blocks of a batched `[N, C, H, W]` input as `[N, C·KH·KW, L]` (`F.unfold`,
/// im2col), zero padded; `L` is the number of window positions.
pub fn unfold(
    input: &Tensor,
    kernel_size: impl Into<Pair>,
    dilation: impl Into<Pair>,
    padding: impl Into<Pair>,
    stride: impl Into<Pair>,
) -> Result<Tensor> {
    const OP: &str = "unfold";
    if input.rank() != 4 {
        return Err(Error::invalid(
            OP,
            format!("expected a 4-D [N, C, H, W] input, got shape {}", input.shape()),
        ));
    }
    let win = Window {
        kernel: kernel_size.into().0,
        stride: stride.into().0,
        padding: padding.into().0,
        dilation: dilation.into().0,
    };
    let (cols, out) = windows(OP, input, &win, 0.0)?;
    let (n, c) = (input.dims()[0], input.dims()[1]);
    cols.reshape(&idims(&[n, c * win.kernel[0] * win.kernel[1], out[0] * out[1]]))
}

/// 2-D convolution (cross-correlation) over `[N, C, H, W]` (or unbatched `[C, H, W]`) with
/// `weight` `[O, C/groups, KH, KW]` and optional `bias` `[O]` (`F.conv2d`); zero padding.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: impl Into<Pair>,
    padding: impl Into<Pair>,
    dilation: impl Into<Pair>,
    groups: usize,
) -> Result<Tensor> {
    let win = Window {
        kernel: [0, 0],
        stride: stride.into().0,
        padding: padding.into().0,
        dilation: dilation.into().0,
    };
    convolution("conv2d", input, weight, bias, win, groups, 2)
}

/// 1-D convolution over `[N, C, L]` (or unbatched `[C, L]`) with `weight` `[O, C/groups, K]`
/// and optional `bias` `[O]` (`F.conv1d`); zero padding.
pub fn conv1d(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
    dilation: usize,
    groups: usize,
) -> Result<Tensor> {
    let win = Window {
        kernel: [0, 0],
        stride: [1, stride],
        padding: [0, padding],
        dilation: [1, dilation],
    };
    convolution("conv1d", input, weight, bias, win, groups, 1)
}

/// The convolution of `spatial` (1 or 2) dims; 1-D runs as 2-D with a height of 1.
fn convolution(
    op: &'static str,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    mut win: Window,
    groups: usize,
    spatial: usize,
) -> Result<Tensor> {
    let batched = spatial + 2;
    if input.rank() != batched && input.rank() != batched - 1 {
        return Err(Error::invalid(
            op,
            format!(
                "expected a {}-D (batched) or {}-D (unbatched) input, got shape {}",
                batched,
                batched - 1,
                input.shape()
            ),
        ));
    }
    if input.rank() == batched - 1 {
        return convolution(op, &input.unsqueeze(0)?, weight, bias, win, groups, spatial)?.squeeze_dim(0);
    }
    if weight.rank() != batched {
        return Err(Error::invalid(
            op,
            format!(
                "expected a {batched}-D weight [out_channels, in_channels/groups, kernel...], got shape {}",
                weight.shape()
            ),
        ));
    }
    let (x, w) = if spatial == 1 {
        (input.unsqueeze(2)?, weight.unsqueeze(2)?)
    } else {
        (input.clone(), weight.clone())
    };
    let (n, c) = (x.dims()[0], x.dims()[1]);
    let (o, cg) = (w.dims()[0], w.dims()[1]);
    if groups == 0 || c % groups != 0 || o % groups != 0 || cg * groups != c {
        return Err(Error::ShapeMismatch {
            op,
            lhs: input.shape().clone(),
            rhs: weight.shape().clone(),
            hint: "groups must divide in_channels and out_channels, and the weight must be [out_channels, in_channels/groups, kernel...]",
        });
    }
    if let Some(b) = bias {
        if b.dims() != [o] {
            return Err(Error::ShapeMismatch {
                op,
                lhs: weight.shape().clone(),
                rhs: b.shape().clone(),
                hint: "the bias must be 1-D with out_channels elements",
            });
        }
    }
    if x.dtype() != w.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: x.dtype(),
            found: w.dtype(),
        });
    }
    // cuDNN first on CUDA (it answers None where it cannot run the problem).
    let d = 2 - spatial;
    if let Some(y) = ember_core::ops::conv::convolution(
        input,
        weight,
        bias,
        &win.stride[d..],
        &win.padding[d..],
        &win.dilation[d..],
        groups,
    )? {
        return Ok(y);
    }
    win.kernel = [w.dims()[2], w.dims()[3]];
    let (cols, out) = windows(op, &x, &win, 0.0)?;
    let (kk, l) = (win.kernel[0] * win.kernel[1], out[0] * out[1]);
    let cols = cols.reshape(&idims(&[n, groups, cg * kk, l]))?;
    let w = w.reshape(&idims(&[groups, o / groups, cg * kk]))?;
    let y = w.matmul(&cols)?;
    let mut dims = vec![n, o];
    if spatial == 2 {
        dims.push(out[0]);
    }
    dims.push(out[1]);
    let y = y.reshape(&idims(&dims))?;
    match bias {
        Some(b) => {
            let mut bd = vec![1, o];
            bd.resize(dims.len(), 1);
            y.add(&b.reshape(&idims(&bd))?)
        }
        None => Ok(y),
    }
}
