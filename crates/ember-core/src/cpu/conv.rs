//! CPU kernels of convolution ([`ConvParams`]: 2-d, groups, stride, zero padding, dilation;
//! 1-d arrives as 2-d with a height of 1), by im2col + GEMM through the `gemm` crate, as
//! `cpu/matmul.rs`. Operands are contiguous NCHW storages read from their first element.
//!
//! Per image `n` and group `g` (`Cg = C/G` input and `Og = O/G` output channels, `K = Cg·KH·KW`,
//! `L = OH·OW`), `col = im2col(x[n, g])` is `[K, L]` (zeros where a window reads padding) and
//! `W_g` the `[Og, K]` rows of the weight:
//! - forward: `y[n, g] = W_g · col`;
//! - backward data: `dx[n, g] = col2im(W_gᵀ · dy[n, g])` (overlapping windows add up);
//! - backward filter: `dW_g = Σ_n dy[n, g] · colᵀ`.
//!
//! Parallelism: images run as rayon tasks, each with its own `col` buffer and a
//! single-threaded GEMM, when there are at least as many as threads; otherwise images run in
//! turn and each GEMM splits itself over rayon's pool. The filter gradient sums fixed chunks of
//! [`FILTER_CHUNK`] images into partial gradients and adds the partials in chunk order, so its
//! result does not depend on the number of threads. f32 and f64 compute in their own type; f16
//! and bf16 widen to f32 once and round once; other dtypes answer `None`.

use super::{CpuElement, CpuStorage};
use crate::backend::ConvParams;
use crate::backend::{BackendStorage, ConvOps};
use crate::memory::check_host_alloc;
use crate::Result;
use gemm::Parallelism;
use half::{bf16, f16};
use rayon::prelude::*;

/// Images whose filter-gradient contributions one task sums (see the module docs).
const FILTER_CHUNK: usize = 4;

/// Multiply-adds below which a whole call stays on the calling thread.
const SERIAL_FLOPS: usize = 1 << 16;

/// Element types the kernels compute in.
pub(crate) trait ConvFloat: num_traits::Float + Send + Sync + 'static {}
impl ConvFloat for f32 {}
impl ConvFloat for f64 {}

/// `dst[m×n, row-major] (= or +=) a · b`, with `a` `m×k` at strides `(rows, cols)` and `b` `k×n`
/// likewise, all from their slices' first elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: ConvFloat>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    accumulate: bool,
    a: &[T],
    (ars, acs): (usize, usize),
    b: &[T],
    (brs, bcs): (usize, usize),
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(T::zero());
        }
        return;
    }
    assert!(dst.len() >= m * n, "gemm output smaller than m·n");
    assert!(
        (m - 1) * ars + (k - 1) * acs < a.len(),
        "gemm lhs exceeds its slice"
    );
    assert!(
        (k - 1) * brs + (n - 1) * bcs < b.len(),
        "gemm rhs exceeds its slice"
    );
    // SAFETY: `gemm` reads lhs at `i*ars + p*acs` (i < m, p < k) and rhs at `p*brs + j*bcs`
    // (p < k, j < n): the asserts bound the largest of these by the slices' lengths. It writes
    // (and with `accumulate` reads) `dst[i*n + j]`, inside the first `m*n` elements of `dst`,
    // a `&mut` borrow distinct from the shared borrows `a` and `b`. T is f32 or f64
    // (`ConvFloat`), types `gemm` accepts.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            acs as isize,
            ars as isize,
            b.as_ptr(),
            bcs as isize,
            brs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        );
    }
}

/// Sizes of one problem, as the kernels index it.
#[derive(Debug, Clone, Copy)]
struct Dims {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    groups: usize,
    /// Input and output channels per group.
    cg: usize,
    og: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    p: ConvParams,
}

impl Dims {
    fn new(p: &ConvParams) -> Option<Dims> {
        let out = p.output()?;
        let [n, c, h, w] = p.input;
        let [o, cg, kh, kw] = p.weight;
        if p.groups == 0 || cg * p.groups != c || o % p.groups != 0 {
            return None;
        }
        Some(Dims {
            n,
            c,
            h,
            w,
            o,
            groups: p.groups,
            cg,
            og: o / p.groups,
            kh,
            kw,
            oh: out[2],
            ow: out[3],
            p: *p,
        })
    }

    /// Rows of one group's `col` (`Cg·KH·KW`).
    fn k(&self) -> usize {
        self.cg * self.kh * self.kw
    }

    /// Output positions per image (`OH·OW`).
    fn l(&self) -> usize {
        self.oh * self.ow
    }

    /// A 1×1 kernel with stride 1, no padding: `col` is the input itself.
    fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.p.stride == [1, 1] && self.p.padding == [0, 0]
    }

    fn flops(&self) -> usize {
        self.n * self.o * self.l() * self.k()
    }

    /// Images run as parallel tasks (single-threaded GEMMs), or in turn with threaded GEMMs.
    fn plan(&self) -> (bool, Parallelism) {
        if self.flops() < SERIAL_FLOPS {
            (false, Parallelism::None)
        } else if self.n >= rayon::current_num_threads() {
            (true, Parallelism::None)
        } else {
            (false, Parallelism::Rayon(0))
        }
    }

    /// The input position `(y, x)` read by kernel tap `(i, j)` at output `(oy, ox)`, if inside.
    #[inline]
    fn source(&self, oy: usize, ox: usize, i: usize, j: usize) -> Option<usize> {
        let p = &self.p;
        let y = (oy * p.stride[0] + i * p.dilation[0]).checked_sub(p.padding[0])?;
        let x = (ox * p.stride[1] + j * p.dilation[1]).checked_sub(p.padding[1])?;
        (y < self.h && x < self.w).then_some(y * self.w + x)
    }

    /// `col [K, L]` of one group's input planes `x` (`Cg` planes of `H·W`).
    fn im2col<T: ConvFloat>(&self, x: &[T], col: &mut [T]) {
        let (l, hw) = (self.l(), self.h * self.w);
        for c in 0..self.cg {
            let plane = &x[c * hw..(c + 1) * hw];
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = &mut col[((c * self.kh + i) * self.kw + j) * l..][..l];
                    for oy in 0..self.oh {
                        for ox in 0..self.ow {
                            row[oy * self.ow + ox] =
                                self.source(oy, ox, i, j).map_or(T::zero(), |s| plane[s]);
                        }
                    }
                }
            }
        }
    }

    /// Adds `col [K, L]` back into one group's input planes `dx` (the adjoint of
    /// [`Dims::im2col`]).
    fn col2im<T: ConvFloat>(&self, col: &[T], dx: &mut [T]) {
        let (l, hw) = (self.l(), self.h * self.w);
        for c in 0..self.cg {
            let plane = &mut dx[c * hw..(c + 1) * hw];
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = &col[((c * self.kh + i) * self.kw + j) * l..][..l];
                    for oy in 0..self.oh {
                        for ox in 0..self.ow {
                            if let Some(s) = self.source(oy, ox, i, j) {
                                plane[s] = plane[s] + row[oy * self.ow + ox];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `y = conv(x, w)` for one dtype.
fn forward_t<T: ConvFloat>(d: &Dims, x: &[T], w: &[T]) -> Vec<T> {
    let (k, l) = (d.k(), d.l());
    let (x_img, y_img) = (d.c * d.h * d.w, d.o * l);
    let mut y = vec![T::zero(); d.n * y_img];
    if y.is_empty() {
        return y;
    }
    let (parallel, par) = d.plan();
    let one = |col: &mut Vec<T>, (img, yn): (usize, &mut [T])| {
        let xn = &x[img * x_img..(img + 1) * x_img];
        for g in 0..d.groups {
            let xg = &xn[g * d.cg * d.h * d.w..(g + 1) * d.cg * d.h * d.w];
            let rhs: &[T] = if d.pointwise() {
                xg
            } else {
                d.im2col(xg, col);
                col
            };
            let wg = &w[g * d.og * k..(g + 1) * d.og * k];
            let yg = &mut yn[g * d.og * l..(g + 1) * d.og * l];
            gemm((d.og, l, k), yg, false, wg, (k, 1), rhs, (l, 1), par);
        }
    };
    let col_len = if d.pointwise() { 0 } else { k * l };
    if parallel {
        y.par_chunks_mut(y_img)
            .enumerate()
            .for_each_init(|| vec![T::zero(); col_len], one);
    } else {
        let mut col = vec![T::zero(); col_len];
        y.chunks_mut(y_img).enumerate().for_each(|job| one(&mut col, job));
    }
    y
}

/// The input gradient from `w` and `dy` for one dtype.
fn backward_data_t<T: ConvFloat>(d: &Dims, w: &[T], dy: &[T]) -> Vec<T> {
    let (k, l) = (d.k(), d.l());
    let (x_img, y_img, plane_group) = (d.c * d.h * d.w, d.o * l, d.cg * d.h * d.w);
    let mut dx = vec![T::zero(); d.n * x_img];
    if dx.is_empty() {
        return dx;
    }
    let (parallel, par) = d.plan();
    let one = |col: &mut Vec<T>, (img, dxn): (usize, &mut [T])| {
        let dyn_ = &dy[img * y_img..(img + 1) * y_img];
        for g in 0..d.groups {
            let wg = &w[g * d.og * k..(g + 1) * d.og * k];
            let dyg = &dyn_[g * d.og * l..(g + 1) * d.og * l];
            let dxg = &mut dxn[g * plane_group..(g + 1) * plane_group];
            // W_gᵀ is `[K, Og]`: row stride 1, column stride K.
            if d.pointwise() {
                gemm((k, l, d.og), dxg, false, wg, (1, k), dyg, (l, 1), par);
            } else {
                gemm((k, l, d.og), col, false, wg, (1, k), dyg, (l, 1), par);
                d.col2im(col, dxg);
            }
        }
    };
    let col_len = if d.pointwise() { 0 } else { k * l };
    if parallel {
        dx.par_chunks_mut(x_img)
            .enumerate()
            .for_each_init(|| vec![T::zero(); col_len], one);
    } else {
        let mut col = vec![T::zero(); col_len];
        dx.chunks_mut(x_img)
            .enumerate()
            .for_each(|job| one(&mut col, job));
    }
    dx
}

/// The weight gradient from `x` and `dy` for one dtype.
fn backward_filter_t<T: ConvFloat>(d: &Dims, x: &[T], dy: &[T]) -> Vec<T> {
    let (k, l) = (d.k(), d.l());
    let (x_img, y_img, plane_group) = (d.c * d.h * d.w, d.o * l, d.cg * d.h * d.w);
    let w_len = d.o * k;
    let (parallel, par) = d.plan();
    // The partial gradient of images `first..first + FILTER_CHUNK`.
    let chunk = |first: usize| -> Vec<T> {
        let mut dw = vec![T::zero(); w_len];
        let mut col = vec![T::zero(); if d.pointwise() { 0 } else { k * l }];
        for img in first..(first + FILTER_CHUNK).min(d.n) {
            let xn = &x[img * x_img..(img + 1) * x_img];
            let dyn_ = &dy[img * y_img..(img + 1) * y_img];
            for g in 0..d.groups {
                let xg = &xn[g * plane_group..(g + 1) * plane_group];
                let rhs: &[T] = if d.pointwise() {
                    xg
                } else {
                    d.im2col(xg, &mut col);
                    &col
                };
                let dyg = &dyn_[g * d.og * l..(g + 1) * d.og * l];
                let dwg = &mut dw[g * d.og * k..(g + 1) * d.og * k];
                // colᵀ is `[L, K]`: row stride 1, column stride L.
                gemm((d.og, k, l), dwg, img != first, dyg, (l, 1), rhs, (1, l), par);
            }
        }
        dw
    };
    let firsts: Vec<usize> = (0..d.n).step_by(FILTER_CHUNK).collect();
    let partials: Vec<Vec<T>> = if parallel {
        firsts.par_iter().map(|&f| chunk(f)).collect()
    } else {
        firsts.iter().map(|&f| chunk(f)).collect()
    };
    let mut parts = partials.into_iter();
    let Some(mut dw) = parts.next() else {
        return vec![T::zero(); w_len];
    };
    for p in parts {
        for (a, b) in dw.iter_mut().zip(p) {
            *a = *a + b;
        }
    }
    dw
}

/// Runs `f` on the elements of `operands` in their compute type: f32 and f64 as they are,
/// f16 and bf16 widened to f32 with the result rounded back; `None` for other dtypes or
/// operands of different dtypes.
pub(super) fn in_compute_type<const K: usize>(
    operands: [&CpuStorage; K],
    f32_fn: impl FnOnce([&[f32]; K]) -> Vec<f32>,
    f64_fn: impl FnOnce([&[f64]; K]) -> Vec<f64>,
) -> Option<CpuStorage> {
    fn all<T: CpuElement, const K: usize>(s: [&CpuStorage; K]) -> Option<[&[T]; K]> {
        let v: Vec<&[T]> = s.iter().map(|x| T::slice(x)).collect::<Option<_>>()?;
        v.try_into().ok()
    }
    fn widen<T: CpuElement, const K: usize>(
        s: [&CpuStorage; K],
        f: impl Fn(T) -> f32,
    ) -> Option<[Vec<f32>; K]> {
        let v: Vec<Vec<f32>> = s
            .iter()
            .map(|x| T::slice(x).map(|v| v.iter().map(|&e| f(e)).collect()))
            .collect::<Option<_>>()?;
        v.try_into().ok()
    }
    match operands[0] {
        CpuStorage::F32(_) => Some(CpuStorage::F32(f32_fn(all::<f32, K>(operands)?))),
        CpuStorage::F64(_) => Some(CpuStorage::F64(f64_fn(all::<f64, K>(operands)?))),
        CpuStorage::F16(_) => {
            let wide = widen::<f16, K>(operands, f16::to_f32)?;
            let out = f32_fn(std::array::from_fn(|i| wide[i].as_slice()));
            Some(CpuStorage::F16(out.into_iter().map(f16::from_f32).collect()))
        }
        CpuStorage::BF16(_) => {
            let wide = widen::<bf16, K>(operands, bf16::to_f32)?;
            let out = f32_fn(std::array::from_fn(|i| wide[i].as_slice()));
            Some(CpuStorage::BF16(out.into_iter().map(bf16::from_f32).collect()))
        }
        _ => None,
    }
}

/// The problem's sizes, or `None` when it is malformed or the operands are too short.
fn dims(p: &ConvParams, operands: &[(&CpuStorage, usize)]) -> Option<Dims> {
    let d = Dims::new(p)?;
    operands
        .iter()
        .all(|(s, len)| s.dtype() == p.dtype && s.len() >= *len)
        .then_some(d)
}

fn input_len(p: &ConvParams) -> usize {
    p.input.iter().product()
}

fn weight_len(p: &ConvParams) -> usize {
    p.weight.iter().product()
}

fn output_len(p: &ConvParams) -> usize {
    p.output().map_or(0, |o| o.iter().product())
}

/// `y = conv(x, w)`: a new `[N, O, OH, OW]` storage, or `None` for a dtype without a kernel.
pub(crate) fn forward(x: &CpuStorage, w: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
    let Some(d) = dims(p, &[(x, input_len(p)), (w, weight_len(p))]) else {
        return Ok(None);
    };
    Ok(in_compute_type(
        [x, w],
        |[x, w]| forward_t(&d, x, w),
        |[x, w]| forward_t(&d, x, w),
    ))
}

/// The input gradient from the weight and the output gradient.
pub(crate) fn backward_data(w: &CpuStorage, dy: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
    let Some(d) = dims(p, &[(w, weight_len(p)), (dy, output_len(p))]) else {
        return Ok(None);
    };
    Ok(in_compute_type(
        [w, dy],
        |[w, dy]| backward_data_t(&d, w, dy),
        |[w, dy]| backward_data_t(&d, w, dy),
    ))
}

/// The weight gradient from the input and the output gradient.
pub(crate) fn backward_filter(x: &CpuStorage, dy: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
    let Some(d) = dims(p, &[(x, input_len(p)), (dy, output_len(p))]) else {
        return Ok(None);
    };
    Ok(in_compute_type(
        [x, dy],
        |[x, dy]| backward_filter_t(&d, x, dy),
        |[x, dy]| backward_filter_t(&d, x, dy),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    /// A direct convolution, its input and weight gradients for output gradient `gy`.
    fn direct(d: &Dims, x: &[f64], w: &[f64], gy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut y, mut dx, mut dw) = (
            vec![0.0; d.n * d.o * d.l()],
            vec![0.0; x.len()],
            vec![0.0; w.len()],
        );
        for n in 0..d.n {
            for o in 0..d.o {
                let g = o / d.og;
                for oy in 0..d.oh {
                    for ox in 0..d.ow {
                        let yi = ((n * d.o + o) * d.oh + oy) * d.ow + ox;
                        for ci in 0..d.cg {
                            for i in 0..d.kh {
                                for j in 0..d.kw {
                                    if let Some(s) = d.source(oy, ox, i, j) {
                                        let xi = (n * d.c + g * d.cg + ci) * d.h * d.w + s;
                                        let wi = ((o * d.cg + ci) * d.kh + i) * d.kw + j;
                                        y[yi] += x[xi] * w[wi];
                                        dx[xi] += gy[yi] * w[wi];
                                        dw[wi] += gy[yi] * x[xi];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        (y, dx, dw)
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
            })
            .collect()
    }

    #[test]
    fn kernels_match_a_direct_convolution() {
        let cases = [
            ([2, 4, 6, 5], [6, 2, 3, 2], [1, 2], [1, 0], [1, 2], 2),
            ([5, 3, 7, 7], [4, 3, 1, 1], [1, 1], [0, 0], [1, 1], 1),
            ([1, 3, 1, 9], [3, 1, 1, 3], [1, 2], [0, 2], [1, 1], 3),
            ([3, 2, 4, 4], [2, 2, 2, 2], [2, 2], [1, 1], [2, 1], 1),
        ];
        for (k, (input, weight, stride, padding, dilation, groups)) in cases.into_iter().enumerate() {
            let p = ConvParams {
                dtype: DType::F64,
                input,
                weight,
                stride,
                padding,
                dilation,
                groups,
            };
            let d = Dims::new(&p).unwrap();
            let (x, w) = (
                values(input_len(&p), k as u64),
                values(weight_len(&p), 10 + k as u64),
            );
            let gy = values(output_len(&p), 20 + k as u64);
            let (ry, rdx, rdw) = direct(&d, &x, &w, &gy);
            let close = |a: &[f64], b: &[f64]| {
                assert_eq!(a.len(), b.len());
                for (u, v) in a.iter().zip(b) {
                    assert!((u - v).abs() < 1e-12, "case {k}: {u} vs {v}");
                }
            };
            close(&forward_t(&d, &x, &w), &ry);
            close(&backward_data_t(&d, &w, &gy), &rdx);
            close(&backward_filter_t(&d, &x, &gy), &rdw);
        }
    }
}

impl ConvOps for CpuStorage {
    fn conv_forward(&self, weight: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        if let Some(out) = p.output() {
            check_host_alloc("convolution", out.iter().product(), p.dtype)?;
        }
        // On the pool of `set_num_threads`: `plan` and the threaded GEMMs size themselves by it.
        super::threads::parallel(|| self::forward(self, weight, p))
    }

    fn conv_backward_data(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        check_host_alloc("convolution_backward", p.input.iter().product(), p.dtype)?;
        super::threads::parallel(|| self::backward_data(self, grad_out, p))
    }

    fn conv_backward_filter(&self, grad_out: &CpuStorage, p: &ConvParams) -> Result<Option<CpuStorage>> {
        super::threads::parallel(|| self::backward_filter(self, grad_out, p))
    }
}
