//! CPU kernels of 2-d pooling ([`PoolParams`]), with the semantics of PyTorch's CPU kernels
//! (`MaxPoolKernel.cpp`, `AvgPoolKernel.cpp`), one rayon task per `[H, W]` plane:
//! - max: the maximum over the window's elements inside the input (padding acts as -inf); NaN
//!   propagates (`val > max || isnan(val)` selects, so the last NaN of a window wins); the
//!   gradient goes to that one position per window (the first maximum otherwise), found again
//!   from the input by the same scan in backward;
//! - average with `count_include_pad=True`: the sum over the window's elements inside the input
//!   divided by the window's size clipped to the padded input (`KH·KW` whenever the padding is
//!   at most half the kernel, as the op layer requires); its gradient spreads evenly.
//!
//! f32 and f64 compute in their own type; f16 and bf16 widen to f32 once and round once;
//! other dtypes answer `None`.

use super::conv::{in_compute_type, ConvFloat};
use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::PoolOps;
use crate::backend::{BackendStorage, PoolMode, PoolParams};
use crate::memory::check_host_alloc;
use crate::Result;
use rayon::prelude::*;

/// Sizes of one problem, as the kernels index it.
#[derive(Debug, Clone, Copy)]
struct Dims {
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    p: PoolParams,
}

/// One window: the rows and columns it covers inside the input, and the average's divisor.
struct Window {
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    divisor: usize,
}

impl Dims {
    fn new(p: &PoolParams) -> Option<Dims> {
        let out = p.output()?;
        Some(Dims {
            planes: p.input[0] * p.input[1],
            h: p.input[2],
            w: p.input[3],
            oh: out[2],
            ow: out[3],
            p: *p,
        })
    }

    /// The window of output `(oy, ox)`, as PyTorch computes it.
    #[inline]
    fn window(&self, oy: usize, ox: usize) -> Window {
        let (p, k) = (&self.p, &self.p.kernel);
        let start = |o: usize, d: usize| (o * p.stride[d]) as isize - p.padding[d] as isize;
        let (ys, xs) = (start(oy, 0), start(ox, 1));
        let ye = (ys + k[0] as isize).min((self.h + p.padding[0]) as isize);
        let xe = (xs + k[1] as isize).min((self.w + p.padding[1]) as isize);
        let divisor = ((ye - ys) * (xe - xs)) as usize;
        let clip = |v: isize, n: usize| v.clamp(0, n as isize) as usize;
        Window {
            rows: clip(ys, self.h)..clip(ye, self.h),
            cols: clip(xs, self.w)..clip(xe, self.w),
            divisor,
        }
    }

    /// Position (in its plane) and value of the maximum of `win` in `plane`: the first strict
    /// maximum, or the last NaN; the window's first position when every value is -inf.
    #[inline]
    fn argmax<T: ConvFloat>(&self, plane: &[T], win: &Window) -> (usize, T) {
        let mut best = (win.rows.start * self.w + win.cols.start, T::neg_infinity());
        for y in win.rows.clone() {
            for x in win.cols.clone() {
                let i = y * self.w + x;
                let v = plane[i];
                if v > best.1 || v.is_nan() {
                    best = (i, v);
                }
            }
        }
        best
    }

    fn in_plane(&self) -> usize {
        self.h * self.w
    }

    fn out_plane(&self) -> usize {
        self.oh * self.ow
    }
}

/// Runs `f(plane index, output plane)` over the planes of `out`, in parallel when large.
fn per_plane<T: Send>(out: &mut [T], plane: usize, work: usize, f: impl Fn(usize, &mut [T]) + Send + Sync) {
    if plane == 0 {
        return;
    }
    if work >= PAR_THRESHOLD {
        super::threads::parallel(|| out.par_chunks_mut(plane).enumerate().for_each(|(i, o)| f(i, o)));
    } else {
        out.chunks_mut(plane).enumerate().for_each(|(i, o)| f(i, o));
    }
}

fn forward_t<T: ConvFloat>(d: &Dims, x: &[T]) -> Vec<T> {
    let mut y = vec![T::zero(); d.planes * d.out_plane()];
    let work = d.planes * d.out_plane() * d.p.kernel[0] * d.p.kernel[1];
    per_plane(&mut y, d.out_plane(), work, |i, yp| {
        let xp = &x[i * d.in_plane()..(i + 1) * d.in_plane()];
        for oy in 0..d.oh {
            for ox in 0..d.ow {
                let win = d.window(oy, ox);
                yp[oy * d.ow + ox] = match d.p.mode {
                    PoolMode::Max => d.argmax(xp, &win).1,
                    PoolMode::Avg => {
                        let mut sum = T::zero();
                        for r in win.rows.clone() {
                            for v in &xp[r * d.w + win.cols.start..r * d.w + win.cols.end] {
                                sum = sum + *v;
                            }
                        }
                        sum / T::from(win.divisor).expect("window sizes are small")
                    }
                };
            }
        }
    });
    y
}

fn backward_t<T: ConvFloat>(d: &Dims, x: &[T], dy: &[T]) -> Vec<T> {
    let mut dx = vec![T::zero(); d.planes * d.in_plane()];
    let work = d.planes * d.out_plane() * d.p.kernel[0] * d.p.kernel[1];
    per_plane(&mut dx, d.in_plane(), work, |i, dxp| {
        let xp = &x[i * d.in_plane()..(i + 1) * d.in_plane()];
        let dyp = &dy[i * d.out_plane()..(i + 1) * d.out_plane()];
        for oy in 0..d.oh {
            for ox in 0..d.ow {
                let win = d.window(oy, ox);
                let g = dyp[oy * d.ow + ox];
                match d.p.mode {
                    PoolMode::Max => {
                        let (at, _) = d.argmax(xp, &win);
                        dxp[at] = dxp[at] + g;
                    }
                    PoolMode::Avg => {
                        let share = g / T::from(win.divisor).expect("window sizes are small");
                        for r in win.rows.clone() {
                            for v in &mut dxp[r * d.w + win.cols.start..r * d.w + win.cols.end] {
                                *v = *v + share;
                            }
                        }
                    }
                }
            }
        }
    });
    dx
}

/// The problem's sizes, or `None` when it is malformed or the operands are too short.
fn dims(p: &PoolParams, operands: &[(&CpuStorage, usize)]) -> Option<Dims> {
    let d = Dims::new(p)?;
    operands
        .iter()
        .all(|(s, len)| s.dtype() == p.dtype && s.len() >= *len)
        .then_some(d)
}

/// `y = pool(x)`: a new `[N, C, OH, OW]` storage, or `None` for a dtype without a kernel.
pub(crate) fn forward(x: &CpuStorage, p: &PoolParams) -> Result<Option<CpuStorage>> {
    let Some(d) = dims(p, &[(x, d_len(p.input))]) else {
        return Ok(None);
    };
    Ok(in_compute_type(
        [x],
        |[x]| forward_t(&d, x),
        |[x]| forward_t(&d, x),
    ))
}

/// The input gradient from the forward's input and the output gradient (max pooling finds
/// each window's maximum again from the input, so the forward's output is not read).
pub(crate) fn backward(x: &CpuStorage, dy: &CpuStorage, p: &PoolParams) -> Result<Option<CpuStorage>> {
    let out = p.output().map_or(0, d_len);
    let Some(d) = dims(p, &[(x, d_len(p.input)), (dy, out)]) else {
        return Ok(None);
    };
    Ok(in_compute_type(
        [x, dy],
        |[x, dy]| backward_t(&d, x, dy),
        |[x, dy]| backward_t(&d, x, dy),
    ))
}

fn d_len(dims: [usize; 4]) -> usize {
    dims.iter().product()
}

impl PoolOps for CpuStorage {
    fn pool_forward(&self, p: &PoolParams) -> Result<Option<CpuStorage>> {
        if let Some(out) = p.output() {
            check_host_alloc("pool2d", out.iter().product(), p.dtype)?;
        }
        self::forward(self, p)
    }

    fn pool_backward(
        &self,
        _output: &CpuStorage,
        grad_out: &CpuStorage,
        p: &PoolParams,
    ) -> Result<Option<CpuStorage>> {
        check_host_alloc("pool2d_backward", p.input.iter().product(), p.dtype)?;
        self::backward(self, grad_out, p)
    }
}
