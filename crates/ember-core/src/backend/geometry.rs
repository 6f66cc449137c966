//! Problem descriptions of the sliding-window families as the backends see them: one 2-d
//! convolution ([`ConvParams`]) and one 2-d pooling ([`PoolParams`]). 1-d problems run as 2-d
//! with a height of 1. Operands are contiguous NCHW storages read from their first element;
//! whether a backend can run a given problem is the backend's answer (`Ok(None)` when not).

use super::op::PoolMode;
use crate::DType;

/// One 2-D convolution problem (cross-correlation, zero padding), NCHW contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvParams {
    pub dtype: DType,
    /// Input `[N, C, H, W]`.
    pub input: [usize; 4],
    /// Weight `[O, C/groups, KH, KW]`.
    pub weight: [usize; 4],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl ConvParams {
    /// The output `[N, O, OH, OW]`, or None when the (dilated) kernel does not fit the padded
    /// input, a stride or dilation is zero, or the padded size overflows.
    pub fn output(&self) -> Option<[usize; 4]> {
        let mut out = [self.input[0], self.weight[0], 0, 0];
        for d in 0..2 {
            if self.stride[d] == 0 || self.dilation[d] == 0 {
                return None;
            }
            let span = self.dilation[d]
                .checked_mul(self.weight[2 + d].checked_sub(1)?)?
                .checked_add(1)?;
            let padded = self.padding[d].checked_mul(2)?.checked_add(self.input[2 + d])?;
            out[2 + d] = padded.checked_sub(span)? / self.stride[d] + 1;
        }
        Some(out)
    }

    /// Output channels per group.
    pub fn out_per_group(&self) -> usize {
        self.weight[0] / self.groups
    }

    /// Input channels per group (the weight's second dim).
    pub fn in_per_group(&self) -> usize {
        self.weight[1]
    }
}

/// One 2-D pooling problem on a contiguous NCHW input, dilation 1, floor output sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolParams {
    pub dtype: DType,
    pub mode: PoolMode,
    /// Input `[N, C, H, W]`.
    pub input: [usize; 4],
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl PoolParams {
    /// The output `[N, C, OH, OW]` (floor sizes), or None when a window does not fit the padded
    /// input, the kernel or stride is zero, or the padded size overflows.
    pub fn output(&self) -> Option<[usize; 4]> {
        let mut out = [self.input[0], self.input[1], 0, 0];
        for d in 0..2 {
            if self.kernel[d] == 0 || self.stride[d] == 0 {
                return None;
            }
            let padded = self.padding[d].checked_mul(2)?.checked_add(self.input[2 + d])?;
            out[2 + d] = padded.checked_sub(self.kernel[d])? / self.stride[d] + 1;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(
        input: [usize; 4],
        weight: [usize; 4],
        stride: usize,
        padding: usize,
        dilation: usize,
    ) -> ConvParams {
        ConvParams {
            dtype: DType::F32,
            input,
            weight,
            stride: [stride; 2],
            padding: [padding; 2],
            dilation: [dilation; 2],
            groups: 1,
        }
    }

    fn pool(input: [usize; 4], kernel: usize, stride: usize, padding: usize) -> PoolParams {
        PoolParams {
            dtype: DType::F32,
            mode: PoolMode::Max,
            input,
            kernel: [kernel; 2],
            stride: [stride; 2],
            padding: [padding; 2],
        }
    }

    #[test]
    fn conv_output_sizes() {
        assert_eq!(
            conv([2, 3, 8, 8], [4, 3, 3, 3], 1, 0, 1).output(),
            Some([2, 4, 6, 6])
        );
        assert_eq!(
            conv([2, 3, 8, 8], [4, 3, 3, 3], 2, 1, 1).output(),
            Some([2, 4, 4, 4])
        );
        assert_eq!(
            conv([2, 3, 9, 9], [4, 3, 3, 3], 1, 0, 2).output(),
            Some([2, 4, 5, 5])
        );
        assert_eq!(conv([1, 3, 2, 2], [4, 3, 3, 3], 1, 0, 1).output(), None);
        assert_eq!(conv([1, 3, 8, 8], [4, 3, 3, 3], 0, 0, 1).output(), None);
        assert_eq!(conv([1, 3, 8, 8], [4, 3, 3, 3], 1, 0, 0).output(), None);
        assert_eq!(conv([1, 3, 8, 8], [4, 3, 0, 3], 1, 0, 1).output(), None);
    }

    #[test]
    fn pool_output_sizes() {
        assert_eq!(pool([2, 3, 8, 8], 2, 2, 0).output(), Some([2, 3, 4, 4]));
        assert_eq!(pool([2, 3, 9, 7], 3, 2, 1).output(), Some([2, 3, 5, 4]));
        assert_eq!(pool([1, 1, 5, 5], 5, 1, 2).output(), Some([1, 1, 5, 5]));
        assert_eq!(pool([1, 1, 2, 2], 3, 1, 0).output(), None);
        assert_eq!(pool([1, 1, 8, 8], 2, 0, 0).output(), None);
    }
}

/// A fused attention problem (`ops/attention.rs`): `query` `[b, h, s_q, d]`, `key`
/// `[b, h, s_kv, d]`, `value` `[b, h, s_kv, d_v]`, each given by its strides (in elements,
/// the last one 1) and offset in its storage. Outputs are made in `[b, s, h, d]` memory order
/// (the strides of `bshd_strides`), so that `out.transpose(1, 2)` is row-major, as PyTorch's
/// fused kernels write them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpaParams {
    pub dtype: DType,
    pub b: usize,
    pub h: usize,
    pub s_q: usize,
    pub s_kv: usize,
    pub d: usize,
    pub d_v: usize,
    /// Strides and element offsets of query, key and value.
    pub q: ([usize; 4], usize),
    pub k: ([usize; 4], usize),
    pub v: ([usize; 4], usize),
    /// Keeps key position `j <= i` for query position `i` (the top-left causal mask).
    pub causal: bool,
    /// The factor of the scores.
    pub scale: f64,
    /// The backward's strides: of the output gradient it reads (at its storage's element 0,
    /// the last stride 1), and of the query, key and value gradients it writes (each a dense
    /// buffer of its own). [`bshd_strides`] for all four unless the caller chooses others
    /// (`ops/attention.rs` gives each gradient its input's memory order, as PyTorch's
    /// `empty_like`).
    pub grads: [[usize; 4]; 4],
    /// With `Some`, the query, key and value gradients are written into one buffer instead of
    /// three (Note [Attention gradients in one buffer] in `ops/attention.rs`).
    pub grads_packed: Option<PackedGrads>,
}

/// One buffer of `len` elements holding the query, key and value gradients at element
/// `offsets`, each with the strides of `SdpaParams::grads[1..]` (which are equal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedGrads {
    pub len: usize,
    pub offsets: [usize; 3],
}

/// The input gradients of fused attention: three buffers, or the one of
/// `SdpaParams::grads_packed`.
pub enum SdpaGrads<S> {
    Separate(S, S, S),
    Packed(S),
}

impl<S> SdpaGrads<S> {
    /// The same gradients with each buffer mapped by `f`.
    pub fn map<T>(self, f: impl Fn(S) -> T) -> SdpaGrads<T> {
        match self {
            SdpaGrads::Separate(q, k, v) => SdpaGrads::Separate(f(q), f(k), f(v)),
            SdpaGrads::Packed(b) => SdpaGrads::Packed(f(b)),
        }
    }
}

/// Where three views of one storage with these `dims` and `strides` at element `offsets` (the
/// q, k and v of one projection) can have their gradients written in one buffer that mirrors
/// the elements they span: when no view overlaps itself or another, and the span holds no more
/// than their elements (so the buffer is no larger than three separate ones).
pub fn pack_grads(dims: [usize; 4], strides: [usize; 4], offsets: [usize; 3]) -> Option<PackedGrads> {
    // The dims that step, by decreasing stride; each must step past all smaller ones together.
    let mut steps: Vec<(usize, usize)> = (0..4)
        .filter(|&i| dims[i] > 1)
        .map(|i| (strides[i], dims[i]))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let mut reach = 0usize;
    for &(s, n) in steps.iter().rev() {
        if s <= reach {
            return None;
        }
        reach = reach.checked_add(s.checked_mul(n - 1)?)?;
    }
    let numel = dims.iter().product::<usize>();
    if numel == 0 {
        return None;
    }
    for (i, j) in [(0, 1), (0, 2), (1, 2)] {
        if reachable(&steps, offsets[i].abs_diff(offsets[j]) as i128) {
            return None;
        }
    }
    let lo = *offsets.iter().min()?;
    let len = offsets.iter().max()? + reach + 1 - lo;
    (len <= 3 * numel).then(|| PackedGrads {
        len,
        offsets: offsets.map(|o| o - lo),
    })
}

/// Whether `delta` is `Σ δ_j s_j` with `|δ_j| < n_j` over `steps` (`(s_j, n_j)` by decreasing
/// stride, each past all smaller ones): whether two views of these steps `delta` apart meet.
fn reachable(steps: &[(usize, usize)], delta: i128) -> bool {
    let Some((&(s, n), rest)) = steps.split_first() else {
        return delta == 0;
    };
    let (s, n) = (s as i128, n as i128);
    let below: i128 = rest.iter().map(|&(s, n)| s as i128 * (n as i128 - 1)).sum();
    // The steps below reach at most `below` either way, and `s > below`: two candidates at most.
    let (lo, hi) = ((delta - below).div_euclid(s), (delta + below).div_euclid(s) + 1);
    (lo.max(1 - n)..=hi.min(n - 1)).any(|d| (delta - d * s).abs() <= below && reachable(rest, delta - d * s))
}

/// The strides of a `[b, h, s, d]` tensor laid out in `[b, s, h, d]` memory order.
pub fn bshd_strides(h: usize, s: usize, d: usize) -> [usize; 4] {
    [s * h * d, d, h * d, 1]
}

/// Dense strides for `dims` in the memory order of `strides` (dims ordered by decreasing
/// stride, ties by position), as PyTorch's `empty_like` keeps a tensor's layout; `None` unless
/// the last dim is innermost.
pub fn dense_like(dims: [usize; 4], strides: [usize; 4]) -> Option<[usize; 4]> {
    let mut order = [0usize, 1, 2, 3];
    // Size-1 dims hold no step, so they do not decide the order.
    let key = |i: usize| if dims[i] == 1 { usize::MAX } else { strides[i] };
    order.sort_by(|&a, &b| key(b).cmp(&key(a)).then(a.cmp(&b)));
    if order[3] != 3 {
        return None;
    }
    let mut out = [0usize; 4];
    let mut step = 1;
    for &i in order.iter().rev() {
        out[i] = step;
        step *= dims[i];
    }
    Some(out)
}

#[cfg(test)]
mod sdpa_tests {
    use super::*;

    #[test]
    fn gradients_keep_their_inputs_memory_order() {
        // Row-major [b, h, s, d] stays row-major.
        assert_eq!(dense_like([2, 3, 5, 8], [120, 40, 8, 1]), Some([120, 40, 8, 1]));
        // q of GPT-2's packed [b, t, 3, h, d] projection, transposed to [b, h, t, d]: dense in
        // [b, t, h, d] order, the strides of `bshd_strides`.
        let (t, h, d) = (16, 12, 64);
        let q = [t * 3 * h * d, d, 3 * h * d, 1];
        assert_eq!(dense_like([2, h, t, d], q), Some(bshd_strides(h, t, d)));
        // A size-1 dim does not reorder the others.
        assert_eq!(dense_like([1, 3, 5, 8], [7, 8, 24, 1]), Some([120, 8, 24, 1]));
        // The head dim not innermost: no dense layout the kernels take.
        assert_eq!(dense_like([2, 3, 5, 8], [120, 40, 1, 5]), None);
    }

    #[test]
    fn q_k_v_of_one_projection_pack_into_one_buffer() {
        // GPT-2's q, k and v: [b, h, t, d] views of a [b, t, 3·h·d] projection.
        let (b, t, h, d) = (2, 16, 12, 64);
        let c = h * d;
        let strides = [t * 3 * c, d, 3 * c, 1];
        let packed = pack_grads([b, h, t, d], strides, [0, c, 2 * c]);
        assert_eq!(
            packed,
            Some(PackedGrads {
                len: b * t * 3 * c,
                offsets: [0, c, 2 * c]
            })
        );
        // Given in another order, and from an offset: relative to the first element.
        let packed = pack_grads([b, h, t, d], strides, [7 + 2 * c, 7, 7 + c]);
        assert_eq!(
            packed,
            Some(PackedGrads {
                len: b * t * 3 * c,
                offsets: [2 * c, 0, c]
            })
        );
        // One head's width apart: k's first head is q's second.
        assert_eq!(pack_grads([b, h, t, d], strides, [0, d, 2 * c]), None);
        // The same view three times (q = k = v).
        assert_eq!(pack_grads([b, h, t, d], strides, [0, 0, 0]), None);
        // A row apart: k's row 0 is q's row 1.
        assert_eq!(pack_grads([b, h, t, d], strides, [0, 3 * c, 2 * c]), None);
        // Disjoint but far apart: the buffer would be larger than three.
        assert_eq!(
            pack_grads([b, h, t, d], strides, [0, c, 100 * b * t * 3 * c]),
            None
        );
        // A view overlapping itself (a broadcast batch).
        assert_eq!(pack_grads([b, h, t, d], [0, d, 3 * c, 1], [0, c, 2 * c]), None);
        // Interleaved heads ([b, t, h, 3, d]): q, k, v one head dim apart, disjoint.
        let strides = [t * 3 * c, 3 * d, 3 * c, 1];
        assert_eq!(
            pack_grads([b, h, t, d], strides, [0, d, 2 * d]),
            Some(PackedGrads {
                len: b * t * 3 * c,
                offsets: [0, d, 2 * d]
            })
        );
    }
}
