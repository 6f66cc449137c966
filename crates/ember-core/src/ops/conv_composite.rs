//! The composite sliding-window path: convolution and pooling written with other tensor ops
//! (an index gather, a batched GEMM, a reduction), so they run on every device and backend and
//! differentiate through those ops' own backward rules. [`super::conv::convolution`] and
//! [`super::pool::pool2d`] take it where the backend answers `None` (CUDA without cuDNN or
//! with it switched off, a problem cuDNN cannot take, a dtype without a kernel), and
//! [`super::conv::unfold`] is its window gather.
//!
//! Note [im2col by gather]: the windows of an `[N, C, H, W]` input are read with one
//! `index_select` over its flattened `H·W` positions, with an index built on the host once
//! per geometry (kernel, stride, padding, dilation, input size, device) and cached. Padding
//! costs one extra element per channel row: the input is flattened and one constant (0 for
//! convolution and average pooling, -inf for max pooling) is appended, and every padded
//! position of a window points at it. The gather gives `[N, C, KH·KW, L]` (`L = OH·OW`), which
//! for convolution is already the `[N, G, C/G·KH·KW, L]` right-hand side of ONE batched GEMM
//! with the weight as `[G, O/G, C/G·KH·KW]` broadcast over the batch: the output comes out as
//! `[N, O, OH·OW]`, i.e. NCHW with no permute. Backward is the GEMM's and `index_add` into the
//! flat input. Pooling reduces the window dim: `max_dim` (whose gradient goes to the first
//! maximum in row-major window order) or `mean_dims` (the padding's zeros counted, as
//! `count_include_pad=True`). CUDA's `index_select` checks its index on the device (one small
//! host synchronization per call, see `cuda_backend/index.rs`), which a fused im2col kernel would not.

use crate::backend::{ConvParams, PoolMode, PoolParams};
use crate::{Device, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Geometry of one 2-D sliding-window op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Window {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl Window {
    /// The output size `[OH, OW]` for an `[h, w]` input, or None when the (dilated) kernel
    /// does not fit the padded input or a size is zero.
    pub(crate) fn output_size(&self, hw: [usize; 2]) -> Option<[usize; 2]> {
        let mut out = [0; 2];
        for d in 0..2 {
            if self.kernel[d] == 0 || self.stride[d] == 0 || self.dilation[d] == 0 {
                return None;
            }
            let span = self.dilation[d].checked_mul(self.kernel[d] - 1)?.checked_add(1)?;
            let padded = self.padding[d].checked_mul(2)?.checked_add(hw[d])?;
            out[d] = padded.checked_sub(span)? / self.stride[d] + 1;
        }
        Some(out)
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

fn idims(d: &[usize]) -> Vec<isize> {
    d.iter().map(|&v| v as isize).collect()
}

/// The windows of `x` (`[N, C, H, W]`) as `[N, C, KH·KW, OH·OW]`, padded positions reading
/// `pad_value` (Note [im2col by gather]), and `[OH, OW]`. The caller has checked that the
/// windows fit (`Window::output_size` is `Some`).
pub(crate) fn windows(x: &Tensor, win: &Window, out: [usize; 2], pad_value: f64) -> Result<Tensor> {
    let (n, c, h, w) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
    let index = window_index(win, [h, w], out, x.device())?;
    let flat = x.reshape(&idims(&[n, c, h * w]))?;
    let src = if win.padding == [0, 0] {
        flat
    } else {
        let fill = Tensor::full([1, 1, 1], pad_value, x.dtype(), x.device())?.expand(&idims(&[n, c, 1]))?;
        Tensor::cat(&[flat, fill], 2)?
    };
    let kk = win.kernel[0] * win.kernel[1];
    src.index_select(2, &index)?
        .reshape(&idims(&[n, c, kk, out[0] * out[1]]))
}

/// The convolution `p` of the 4-D `x` and `w` (no bias), `[N, O, OH, OW]`.
pub(crate) fn conv2d(x: &Tensor, w: &Tensor, p: &ConvParams) -> Result<Tensor> {
    let win = Window {
        kernel: [p.weight[2], p.weight[3]],
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
    };
    let out = p.output().expect("the op layer checks the output size");
    let [n, _, oh, ow] = out;
    let (o, cg, g) = (p.weight[0], p.weight[1], p.groups);
    let kk = win.kernel[0] * win.kernel[1];
    let cols = windows(x, &win, [oh, ow], 0.0)?.reshape(&idims(&[n, g, cg * kk, oh * ow]))?;
    let w = w.reshape(&idims(&[g, o / g, cg * kk]))?;
    w.matmul(&cols)?.reshape(&idims(&out))
}

/// The pooling `p` of the 4-D `x`, `[N, C, OH, OW]`.
pub(crate) fn pool2d(x: &Tensor, p: &PoolParams) -> Result<Tensor> {
    let win = Window {
        kernel: p.kernel,
        stride: p.stride,
        padding: p.padding,
        dilation: [1, 1],
    };
    let out = p.output().expect("the op layer checks the output size");
    let pad = match p.mode {
        PoolMode::Max => f64::NEG_INFINITY,
        PoolMode::Avg => 0.0,
    };
    let cols = windows(x, &win, [out[2], out[3]], pad)?;
    let y = match p.mode {
        PoolMode::Max => cols.max_dim(2, false)?.0,
        PoolMode::Avg => cols.mean_dims(&[2], false)?,
    };
    y.reshape(&idims(&out))
}
