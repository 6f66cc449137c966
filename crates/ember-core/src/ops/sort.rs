//! Orderings and sampling, what generating text needs: `sort`, `argsort`, `topk`,
//! `multinomial`, and the triangles `tril` / `triu`.
//!
//! Note [Orderings by the backend]: `sort`, `argsort` and `topk` find their positions with the
//! backend's ordering (`SortOps::sort_indices` over rows made contiguous with `dim` last: a copy
//! only when they are not already), then gather the values on the input's device, so their
//! gradients are `gather`'s. On a GPU the positions are found on the device (Note [Device sort] in
//! `cuda_backend/sort.rs`: one block a row of up to 2048, chunks of 2048 merged level by level
//! above that, keeping only the first k), with nothing read back: a sampler's `topk` over `[batch,
//! 50,304]` logits needs no host synchronization and can be captured in a CUDA graph (62 µs of
//! kernels for k = 50 on an H200). On the CPU each row's first k are selected in linear time and sorted
//! (`cpu/sort.rs`). Both backends order the same keys, so they give the same positions. The order
//! is PyTorch's: NaN above every number, -0.0 equal to 0.0, ties keep their positions (stable),
//! integers compared exactly in their own dtype. `multinomial` stays on the host: it reads the
//! weights and the generator's uniforms back with a synchronizing copy and searches there (a
//! sampler reads its token back anyway).

use crate::backend::SortParams;
use crate::dispatch::{self, policy, Door};
use crate::{DType, Device, Error, Result, Tensor};
use std::cmp::Ordering;

/// `a` before `b` ascending: numbers by value, NaN after every number (PyTorch's order).
fn ascending(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
        (a_nan, b_nan) => a_nan.cmp(&b_nan),
    }
}

/// The positions of the first `k` elements along `dim` of `x` (rank >= 1) in the order
/// `descending` asks (stable), int64 of `x`'s shape with `dim` of length `k`, contiguous, on
/// `x`'s device (Note [Orderings by the backend]).
fn order(x: &Tensor, dim: usize, k: usize, descending: bool, door: Door) -> Result<Tensor> {
    let last = x.rank() - 1;
    let moved = x.detach().transpose(dim as isize, last as isize)?.contiguous()?;
    let n = x.dims()[dim];
    let rows = moved.dims()[..last].iter().product();
    let p = SortParams {
        rows,
        n,
        k,
        dtype: x.dtype(),
        descending,
    };
    let storage = moved.storage().read().sort_indices(moved.layout(), &p)?;
    let mut shape = moved.dims().to_vec();
    shape[last] = k;
    let indices = door.tensor(storage, shape);
    if dim == last {
        Ok(indices)
    } else {
        indices.transpose(dim as isize, last as isize)?.contiguous()
    }
}

impl Tensor {
    /// The elements sorted along `dim` and their positions in `self` (`torch.sort(input, dim,
    /// descending, stable=True)`): `(values, indices)`, indices int64. Differentiable in the
    /// values. On a GPU sorted on the device (Note [Orderings by the backend]).
    pub fn sort(&self, dim: isize, descending: bool) -> Result<(Tensor, Tensor)> {
        dispatch::named_kernel(&policy::SORT, &[self], |door| {
            if self.rank() == 0 {
                return Ok((
                    self.clone(),
                    Tensor::zeros([0usize; 0], DType::I64, self.device())?,
                ));
            }
            let d = self.shape().dim("sort", dim)?;
            let indices = order(self, d, self.dims()[d], descending, door)?;
            Ok((self.gather(d as isize, &indices)?, indices))
        })
    }

    /// The positions that sort `self` along `dim` (`torch.argsort`), int64.
    pub fn argsort(&self, dim: isize, descending: bool) -> Result<Tensor> {
        dispatch::named(&policy::ARGSORT, &[self], || Ok(self.sort(dim, descending)?.1))
    }

    /// The `k` largest (or, with `largest = false`, smallest) elements along `dim` and their
    /// positions (`torch.topk(input, k, dim, largest, sorted=True)`), in that order.
    /// Differentiable in the values. On a GPU found on the device, nothing read back
    /// (Note [Orderings by the backend]).
    pub fn topk(&self, k: usize, dim: isize, largest: bool) -> Result<(Tensor, Tensor)> {
        dispatch::named_kernel(&policy::TOPK, &[self], |door| {
            let x = if self.rank() == 0 {
                self.reshape(&[1])?
            } else {
                self.clone()
            };
            let d = x.shape().dim("topk", dim)?;
            if k > x.dims()[d] {
                return Err(Error::invalid(
                    "topk",
                    format!(
                        "k ({k}) is larger than dim {dim}'s size ({}): ask for at most that many",
                        x.dims()[d]
                    ),
                ));
            }
            let indices = order(&x, d, k, largest, door)?;
            let values = x.gather(d as isize, &indices)?;
            if self.rank() == 0 {
                return Ok((values.reshape(&[0isize; 0])?, indices.reshape(&[0isize; 0])?));
            }
            Ok((values, indices))
        })
    }

    /// `num_samples` category indices drawn from each row of the non-negative weights `self`
    /// (1-D `[C]` or 2-D `[N, C]`, floating point, not necessarily summing to 1), as int64 of
    /// shape `[num_samples]` or `[N, num_samples]` (`torch.multinomial`). Without `replacement`
    /// a category is drawn at most once per row (so `num_samples <= C`); a row must have a
    /// positive weight (enough of them without replacement). The uniforms come from the
    /// default generator of the input's device (`manual_seed` makes draws repeatable); the
    /// search is on the host, after a synchronizing copy of the weights and uniforms
    /// (Note [Orderings by the backend]).
    pub fn multinomial(&self, num_samples: usize, replacement: bool) -> Result<Tensor> {
        const OP: &str = "multinomial";
        dispatch::named(&policy::MULTINOMIAL, &[self], || {
            if !self.dtype().is_floating_point() {
                return Err(Error::UnsupportedDType {
                    op: OP,
                    dtype: self.dtype(),
                    hint: "multinomial takes floating-point weights; convert with .to_dtype(DType::F32)",
                });
            }
            let (rows, c) = match self.dims() {
                &[c] => (1, c),
                &[n, c] => (n, c),
                _ => {
                    return Err(Error::invalid(
                        OP,
                        format!("weights must be 1-D or 2-D, got shape {}", self.shape()),
                    ))
                }
            };
            if num_samples == 0 {
                return Err(Error::invalid(OP, "num_samples must be positive"));
            }
            if !replacement && num_samples > c {
                return Err(Error::invalid(
                    OP,
                    format!("cannot draw {num_samples} samples without replacement from {c} categories; pass replacement = true or draw fewer"),
                ));
            }
            let w = self
                .detach()
                .to(Device::Cpu)?
                .to_dtype(DType::F64)?
                .to_vec_f64()?;
            if let Some(bad) = w.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
                return Err(Error::invalid(
                    OP,
                    format!("weights must be finite and non-negative, found {bad}"),
                ));
            }
            // Uniforms from the device's generator: one per draw with replacement, one per
            // category without (the exponential race below).
            let per_row = if replacement { num_samples } else { c };
            let u = Tensor::rand([rows, per_row], DType::F64, self.device())?
                .to(Device::Cpu)?
                .to_vec_f64()?;
            let mut out = Vec::with_capacity(rows * num_samples);
            for r in 0..rows {
                let wr = &w[r * c..(r + 1) * c];
                let ur = &u[r * per_row..(r + 1) * per_row];
                let positive = wr.iter().filter(|&&v| v > 0.0).count();
                if positive == 0 || (!replacement && positive < num_samples) {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "row {r} has {positive} categories of positive weight, fewer than the {} asked",
                            if replacement { 1 } else { num_samples }
                        ),
                    ));
                }
                if replacement {
                    let mut cdf = Vec::with_capacity(c);
                    let mut acc = 0.0;
                    for &v in wr {
                        acc += v;
                        cdf.push(acc);
                    }
                    for &x in ur {
                        let target = x * acc;
                        // The first category whose cumulative weight passes the target, never
                        // one of zero weight.
                        let mut i = cdf.partition_point(|&s| s <= target).min(c - 1);
                        while wr[i] == 0.0 && i > 0 {
                            i -= 1;
                        }
                        out.push(i as i64);
                    }
                } else {
                    // Exponential race: category i wins in the order of E_i / w_i with
                    // E_i = -ln(u_i), which draws without replacement in proportion to w.
                    let mut keys: Vec<(f64, usize)> = wr
                        .iter()
                        .zip(ur)
                        .enumerate()
                        .filter(|(_, (&v, _))| v > 0.0)
                        .map(|(i, (&v, &x))| (-(1.0 - x).ln() / v, i))
                        .collect();
                    keys.sort_by(|a, b| ascending(a.0, b.0));
                    out.extend(keys[..num_samples].iter().map(|&(_, i)| i as i64));
                }
            }
            let shape: Vec<usize> = if self.rank() == 1 {
                vec![num_samples]
            } else {
                vec![rows, num_samples]
            };
            Tensor::from_vec(out, shape, self.device())
        })
    }

    /// The lower triangle of the last two dims: elements `(i, j)` with `j - i <= diagonal`
    /// kept, the others zero (`torch.tril(input, diagonal)`). Made on the input's device from
    /// index comparisons (no host copy).
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        dispatch::named(&policy::TRIL, &[self], || triangle(self, diagonal, true))
    }

    /// The upper triangle of the last two dims: `j - i >= diagonal` kept (`torch.triu`).
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        dispatch::named(&policy::TRIU, &[self], || triangle(self, diagonal, false))
    }
}

fn triangle(x: &Tensor, diagonal: i64, lower: bool) -> Result<Tensor> {
    let op = if lower { "tril" } else { "triu" };
    if x.rank() < 2 {
        return Err(Error::invalid(
            op,
            format!("input must have at least 2 dims, got shape {}", x.shape()),
        ));
    }
    let (m, n) = (x.dims()[x.rank() - 2], x.dims()[x.rank() - 1]);
    let device = x.device();
    let i = Tensor::arange_i64(0, m as i64, 1, device)?.unsqueeze(1)?;
    let j = Tensor::arange_i64(0, n as i64, 1, device)?.unsqueeze(0)?;
    let offset = j.sub(&i)?;
    let keep = if lower {
        offset.le_scalar(diagonal)?
    } else {
        offset.ge_scalar(diagonal)?
    };
    let zero = Tensor::zeros([0usize; 0], x.dtype(), device)?;
    Tensor::where_cond(&keep, x, &zero)
}
