//! Reductions over dimensions (sum, prod, mean, max/min, amax/amin, argmax/argmin, var/std,
//! logsumexp, vector norms), with backward rules. Softmax and log_softmax are in `softmax.rs`.
//!
//! Dims follow PyTorch: negative dims count from the end, an empty `dims` slice means every
//! dim, a repeated dim is an error, and a 0-d tensor accepts dim 0 or -1. dtypes follow
//! PyTorch too: sum/prod of integers or bools give int64; mean, var, std and norm need a
//! floating point input; logsumexp computes integers in float32; max/min keep the dtype and
//! argmax/argmin give int64 indices (first occurrence on ties, NaN counts as the max).

use crate::autograd::{self, SavedTensor};
use crate::dispatch::{self, policy, Door, Op};
use crate::{DType, Error, Result, Shape, Tensor};

pub use crate::backend::op::ReduceOp;

/// `dims` normalized, checked for repeats and sorted; empty means every dim. A 0-d tensor
/// accepts 0 and -1 and reduces nothing (its one element is the result).
pub(crate) fn reduce_dims(op: &'static str, shape: &Shape, dims: &[isize]) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..shape.rank()).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let n = shape.dim(op, d)?;
        if out.contains(&n) {
            return Err(Error::invalid(
                op,
                format!("dim {n} appears multiple times in the list of dims {dims:?}"),
            ));
        }
        out.push(n);
    }
    out.sort_unstable();
    if shape.rank() == 0 {
        out.clear();
    }
    Ok(out)
}

/// The shape after reducing `dims`: removed, or kept as size 1 with `keepdim`.
fn reduced_shape(shape: &Shape, dims: &[usize], keepdim: bool) -> Shape {
    let d = shape.dims().iter().enumerate();
    if keepdim {
        Shape::new(
            d.map(|(i, &s)| if dims.contains(&i) { 1 } else { s })
                .collect::<Vec<_>>(),
        )
    } else {
        Shape::new(
            d.filter(|(i, _)| !dims.contains(i))
                .map(|(_, &s)| s)
                .collect::<Vec<_>>(),
        )
    }
}

/// Number of elements each output of reducing `dims` combines.
fn reduced_count(shape: &Shape, dims: &[usize]) -> usize {
    dims.iter().map(|&d| shape.dims()[d]).product()
}

/// `t` (a reduction's output or gradient) reshaped to keep the reduced dims as size 1.
fn keep_dims(t: &Tensor, in_shape: &Shape, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    if keepdim {
        return Ok(t.clone());
    }
    let s = reduced_shape(in_shape, dims, true);
    t.reshape(&s.dims().iter().map(|&d| d as isize).collect::<Vec<_>>())
}

/// The gradient of a reduction's output broadcast back over the input's shape.
fn expand_back(g: &Tensor, in_shape: &Shape, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    keep_dims(g, in_shape, dims, keepdim)?.broadcast_to(in_shape)
}

/// The error for float-only reductions of integer or bool tensors.
fn needs_float(op: &'static str, dtype: DType) -> Error {
    Error::UnsupportedDType {
        op,
        dtype,
        hint: "it needs a floating point input; convert with .to_dtype(DType::F32) first",
    }
}

/// `1` where `x > 0`, `-1` where `x < 0`, else 0, in `x`'s dtype.
fn sign(x: &Tensor) -> Result<Tensor> {
    x.gt_scalar(0)?
        .to_dtype(x.dtype())?
        .sub(&x.lt_scalar(0)?.to_dtype(x.dtype())?)
}

/// A 0-d zero of `t`'s dtype and device.
fn zero_like(t: &Tensor) -> Result<Tensor> {
    Tensor::scalar(0.0, t.dtype(), t.device())
}

impl Tensor {
    /// The reduction `op` over `dims` (normalized) without autograd.
    fn reduce_raw(&self, op: ReduceOp, dims: &[usize], keepdim: bool, door: Door) -> Result<Tensor> {
        let storage = self.storage().read().reduce(self.layout(), op, dims)?;
        Ok(door.tensor(storage, reduced_shape(self.shape(), dims, keepdim)))
    }

    /// Sum of every element, as a 0-d tensor (int64 for integer and bool inputs).
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum_dims(&[], false)
    }

    /// Sum over `dims` (negative counts from the end, empty means all), keeping them as size 1
    /// if `keepdim`.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = reduce_dims("sum", self.shape(), dims)?;
        dispatch::call(
            &policy::SUM,
            [self],
            |[x], door| x.reduce_raw(ReduceOp::Sum, &d, keepdim, door),
            |[x], _, _| {
                let (shape, d) = (x.shape().clone(), d.clone());
                Ok(move |g: &Tensor, _: &[bool]| Ok(vec![Some(expand_back(g, &shape, &d, keepdim)?)]))
            },
        )
    }

    /// Sum over one dim (`x.sum(dim)`).
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.sum_dims(&[dim], keepdim)
    }

    /// Mean of every element, as a 0-d tensor (floating point inputs only).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean_dims(&[], false)
    }

    /// Mean over `dims` (empty means all); floating point inputs only, as PyTorch.
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_floating_point() {
            return Err(needs_float("mean", self.dtype()));
        }
        let d = reduce_dims("mean", self.shape(), dims)?;
        dispatch::call(
            &policy::MEAN,
            [self],
            |[x], door| x.reduce_raw(ReduceOp::Mean, &d, keepdim, door),
            |[x], _, _| {
                let (shape, d) = (x.shape().clone(), d.clone());
                let n = reduced_count(&shape, &d);
                Ok(move |g: &Tensor, _: &[bool]| {
                    let g = g.div_scalar(n as f64)?;
                    Ok(vec![Some(expand_back(&g, &shape, &d, keepdim)?)])
                })
            },
        )
    }

    /// Product of every element, as a 0-d tensor (int64 for integer and bool inputs).
    pub fn prod_all(&self) -> Result<Tensor> {
        self.prod_dims(&[], false)
    }

    /// Product over one dim (`x.prod(dim)`).
    pub fn prod_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        self.prod_dims(&[dim], keepdim)
    }

    /// Product over `dims` (empty means all). The gradient is correct with zeros in the input:
    /// with one zero in a group only that element gets a gradient (the product of the others).
    pub fn prod_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = reduce_dims("prod", self.shape(), dims)?;
        dispatch::call(
            &policy::PROD,
            [self],
            |[x], door| x.reduce_raw(ReduceOp::Prod, &d, keepdim, door),
            |[x], _, _| {
                let (shape, d) = (x.shape().clone(), d.clone());
                let x = SavedTensor::new("prod", x);
                Ok(move |g: &Tensor, _: &[bool]| prod_backward(&x, g, &shape, &d, keepdim))
            },
        )
    }

    /// Maximum over `dim` and the index of its first occurrence (`torch.max(x, dim)`); the
    /// gradient goes to that index only.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim(ReduceOp::Max, dim, keepdim)
    }
}

fn prod_backward(
    x: &SavedTensor,
    g: &Tensor,
    shape: &Shape,
    d: &[usize],
    keepdim: bool,
) -> Result<Vec<Option<Tensor>>> {
    {
        let x = x.get()?;
        let g = keep_dims(g, shape, d, keepdim)?;
        let id: Vec<isize> = d.iter().map(|&i| i as isize).collect();
        let is_zero = x.eq_scalar(0)?;
        let zeros = is_zero.sum_dims(&id, true)?;
        // Product of the nonzero elements of each group.
        let x_nz = x.masked_fill(&is_zero, 1.0)?;
        let p = x_nz.prod_dims(&id, true)?;
        let no_zero = p.div(&x_nz)?;
        let only_zero = is_zero.logical_and(&zeros.eq_scalar(1)?)?;
        let one_zero = Tensor::where_cond(&only_zero, &p, &zero_like(x)?)?;
        let dx = Tensor::where_cond(&zeros.eq_scalar(0)?, &no_zero, &one_zero)?;
        Ok(vec![Some(dx.mul(&g)?)])
    }
}

impl Tensor {
    /// Minimum over `dim` and the index of its first occurrence (`torch.min(x, dim)`).
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim(ReduceOp::Min, dim, keepdim)
    }

    fn extreme_dim(&self, op: ReduceOp, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let line = if op == ReduceOp::Max {
            &policy::MAX
        } else {
            &policy::MIN
        };
        dispatch::call_with(line, [self], |[x], door| {
            x.extreme_dim_prepared(op, dim, keepdim, door)
        })
    }

    fn extreme_dim_prepared(
        &self,
        op: ReduceOp,
        dim: isize,
        keepdim: bool,
        door: Door,
    ) -> Result<(Tensor, Tensor)> {
        let d = reduce_dims(op.name(), self.shape(), &[dim])?;
        let (vs, is) = self.storage().read().reduce_with_indices(self.layout(), op, &d)?;
        let shape = reduced_shape(self.shape(), &d, keepdim);
        let (values, indices) = (door.tensor(vs, shape.clone()), door.tensor(is, shape));
        if !self.dtype().is_floating_point() || !autograd::needs_grad(&[self]) {
            return Ok((values, indices));
        }
        let in_shape = self.shape().clone();
        let idx = SavedTensor::new(op.name(), &indices);
        let values = door.record(op.name(), &[self], values, move |g, _| {
            let g = keep_dims(g, &in_shape, &d, keepdim)?;
            if in_shape.rank() == 0 {
                return Ok(vec![Some(g)]);
            }
            let idx = keep_dims(idx.get()?, &in_shape, &d, keepdim)?;
            // One-hot of the index along the dim: arange(K) == index.
            let k = in_shape.dims()[d[0]];
            let mut at = vec![1isize; in_shape.rank()];
            at[d[0]] = k as isize;
            let range = Tensor::arange(0.0, k as f64, 1.0, DType::I64, g.device())?.reshape(&at)?;
            let hit = range.eq(&idx)?;
            Ok(vec![Some(Tensor::where_cond(&hit, &g, &zero_like(&g)?)?)])
        });
        Ok((values, indices))
    }

    /// Maximum of every element, as a 0-d tensor (`torch.max(x)`); the gradient is split
    /// evenly among ties.
    pub fn max_all(&self) -> Result<Tensor> {
        self.extreme_dims(ReduceOp::Max, &[], false)
    }

    /// Minimum of every element, as a 0-d tensor (`torch.min(x)`).
    pub fn min_all(&self) -> Result<Tensor> {
        self.extreme_dims(ReduceOp::Min, &[], false)
    }

    /// Maximum over `dims` (empty means all), without indices; the gradient is split evenly
    /// among the elements equal to the maximum (`torch.amax`).
    pub fn amax(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme_dims(ReduceOp::Max, dims, keepdim)
    }

    /// Minimum over `dims` (empty means all), without indices (`torch.amin`).
    pub fn amin(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme_dims(ReduceOp::Min, dims, keepdim)
    }

    fn extreme_dims(&self, op: ReduceOp, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = reduce_dims(op.name(), self.shape(), dims)?;
        let line = match (op, dims.is_empty()) {
            (ReduceOp::Max, true) => &policy::MAX,
            (ReduceOp::Max, false) => &policy::AMAX,
            (_, true) => &policy::MIN,
            (_, false) => &policy::AMIN,
        };
        self.reduce_reading_output(line, op, d, keepdim, evenly_distribute)
    }

    /// Index of the maximum over `dim`, or over the flattened tensor when `None`
    /// (`torch.argmax`); the first occurrence wins ties and NaN counts as the maximum.
    pub fn argmax(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(ReduceOp::ArgMax, dim, keepdim)
    }

    /// Index of the minimum over `dim`, or over the flattened tensor when `None` (`torch.argmin`).
    pub fn argmin(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(ReduceOp::ArgMin, dim, keepdim)
    }

    fn arg_extreme(&self, op: ReduceOp, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        let line = if op == ReduceOp::ArgMax {
            &policy::ARGMAX
        } else {
            &policy::ARGMIN
        };
        dispatch::call_with(line, [self], |[x], door| {
            x.arg_extreme_prepared(op, dim, keepdim, door)
        })
    }

    fn arg_extreme_prepared(
        &self,
        op: ReduceOp,
        dim: Option<isize>,
        keepdim: bool,
        door: Door,
    ) -> Result<Tensor> {
        let Some(dim) = dim else {
            let flat = self.detach().reshape(&[self.numel() as isize])?;
            let out = flat.reduce_raw(op, &[0], false, door)?;
            return if keepdim {
                out.reshape(&vec![1; self.rank()])
            } else {
                Ok(out)
            };
        };
        let d = reduce_dims(op.name(), self.shape(), &[dim])?;
        self.reduce_raw(op, &d, keepdim, door)
    }

    /// Variance over `dims` (empty means all) dividing by `N - correction`
    /// (`torch.var(x, dims, correction=c, keepdim=k)`; 1 is the unbiased estimate).
    pub fn var(&self, dims: &[isize], correction: f64, keepdim: bool) -> Result<Tensor> {
        self.var_std(ReduceOp::Var { correction }, dims, keepdim)
    }

    /// Standard deviation over `dims` (empty means all) dividing by `N - correction`.
    pub fn std(&self, dims: &[isize], correction: f64, keepdim: bool) -> Result<Tensor> {
        self.var_std(ReduceOp::Std { correction }, dims, keepdim)
    }

    fn var_std(&self, op: ReduceOp, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_floating_point() {
            return Err(needs_float(op.name(), self.dtype()));
        }
        let d = reduce_dims(op.name(), self.shape(), dims)?;
        let line = if matches!(op, ReduceOp::Var { .. }) {
            &policy::VAR
        } else {
            &policy::STD
        };
        dispatch::call(
            line,
            [self],
            |[x], door| x.reduce_raw(op, &d, keepdim, door),
            |[x], out, _| {
                let (x, y) = (SavedTensor::new(op.name(), x), SavedTensor::new(op.name(), out));
                let (shape, d) = (x.get()?.shape().clone(), d.clone());
                Ok(move |g: &Tensor, _: &[bool]| var_std_backward(op, &x, &y, g, &shape, &d, keepdim))
            },
        )
    }
}

fn var_std_backward(
    op: ReduceOp,
    x: &SavedTensor,
    y: &SavedTensor,
    g: &Tensor,
    shape: &Shape,
    d: &[usize],
    keepdim: bool,
) -> Result<Vec<Option<Tensor>>> {
    let n = reduced_count(shape, d) as f64;
    {
        let x = x.get()?;
        let g = keep_dims(g, shape, d, keepdim)?;
        let id: Vec<isize> = d.iter().map(|&i| i as isize).collect();
        let centered = x.sub(&x.mean_dims(&id, true)?)?;
        let dx = match op {
            // d var / dx = 2 (x - mean) / (N - c)
            ReduceOp::Var { correction } => centered.mul(&g.mul_scalar(2.0 / (n - correction))?)?,
            // d std / dx = (x - mean) / ((N - c) std), zero where std == 0.
            ReduceOp::Std { correction } => {
                let y = keep_dims(y.get()?, shape, d, keepdim)?;
                let scale = g.div(&y.mul_scalar(n - correction)?)?;
                let scale = scale.masked_fill(&y.eq_scalar(0)?, 0.0)?;
                centered.mul(&scale)?
            }
            _ => unreachable!("var_std is called with Var or Std"),
        };
        Ok(vec![Some(dx)])
    }
}

impl Tensor {
    /// `log Σ exp(x)` over `dims` (empty means all), computed without overflow
    /// (`torch.logsumexp`); integer inputs compute in float32.
    pub fn logsumexp(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = reduce_dims("logsumexp", self.shape(), dims)?;
        dispatch::call(
            &policy::LOGSUMEXP,
            [self],
            |[x], door| {
                if !x.dtype().is_floating_point() {
                    return x
                        .to_dtype(DType::F32)?
                        .reduce_raw(ReduceOp::LogSumExp, &d, keepdim, door);
                }
                x.reduce_raw(ReduceOp::LogSumExp, &d, keepdim, door)
            },
            |[x], _, _| {
                let x = SavedTensor::new("logsumexp", x);
                let (shape, d) = (x.get()?.shape().clone(), d.clone());
                Ok(move |g: &Tensor, _: &[bool]| {
                    // d lse / dx = exp(x - lse) = softmax of x over the reduced dims.
                    let g = keep_dims(g, &shape, &d, keepdim)?;
                    Ok(vec![Some(softmax_over(x.get()?, &d)?.mul(&g)?)])
                })
            },
        )
    }

    /// The vector p-norm over `dims` (empty means all), as `torch.linalg.vector_norm`:
    /// `(Σ |x|^p)^(1/p)`; `p = inf` is `max |x|`, `-inf` is `min |x|`, 0 counts nonzeros.
    /// The gradient at a zero norm is zero.
    pub fn norm(&self, p: f64, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let op = ReduceOp::Norm { p };
        if !self.dtype().is_floating_point() {
            return Err(needs_float(op.name(), self.dtype()));
        }
        if p.is_nan() {
            return Err(Error::invalid(op.name(), "the order p must not be NaN"));
        }
        let d = reduce_dims(op.name(), self.shape(), dims)?;
        if p.is_infinite() && reduced_count(self.shape(), &d) == 0 {
            return Err(Error::invalid(
                op.name(),
                "cannot compute the inf norm of an empty tensor: the operation has no identity",
            ));
        }
        self.reduce_reading_output(&policy::NORM, op, d, keepdim, move |x, y, g, d| {
            norm_backward(x, y, g, p, d)
        })
    }

    /// The reduction `op` over `d` as the op `line`, whose gradient reads the input and the
    /// output (amax/amin, norm): `rule(x, y, g, d)` gets the output and its gradient brought
    /// back to the input's rank.
    fn reduce_reading_output<F>(
        &self,
        line: &'static Op,
        op: ReduceOp,
        d: Vec<usize>,
        keepdim: bool,
        rule: F,
    ) -> Result<Tensor>
    where
        F: Fn(&Tensor, &Tensor, &Tensor, &[usize]) -> Result<Tensor> + Send + Sync + 'static,
    {
        dispatch::call(
            line,
            [self],
            |[x], door| x.reduce_raw(op, &d, keepdim, door),
            |[x], out, _| {
                let (x, y) = (SavedTensor::new(op.name(), x), SavedTensor::new(op.name(), out));
                let (shape, d) = (x.get()?.shape().clone(), d.clone());
                Ok(move |g: &Tensor, _: &[bool]| {
                    let x = x.get()?;
                    let y = keep_dims(y.get()?, &shape, &d, keepdim)?;
                    let g = keep_dims(g, &shape, &d, keepdim)?;
                    Ok(vec![Some(rule(x, &y, &g, &d)?)])
                })
            },
        )
    }
}

/// Gradient of amax/amin: `g` split evenly among the elements of `x` equal to the result `y`
/// (both `y` and `g` keep the reduced dims).
fn evenly_distribute(x: &Tensor, y: &Tensor, g: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let hit = x.eq(y)?;
    let id: Vec<isize> = dims.iter().map(|&i| i as isize).collect();
    let count = hit.sum_dims(&id, true)?;
    let share = g.div(&count.to_dtype(g.dtype())?)?;
    Tensor::where_cond(&hit, &share, &zero_like(g)?)
}

/// Gradient of `linalg.vector_norm` (PyTorch's `norm_backward`); `y` and `g` keep the dims.
fn norm_backward(x: &Tensor, y: &Tensor, g: &Tensor, p: f64, dims: &[usize]) -> Result<Tensor> {
    let zero = zero_like(x)?;
    if p == 0.0 {
        return x.zeros_like();
    }
    let sgn = sign(x)?;
    if p == 1.0 {
        return sgn.mul(g);
    }
    if p == 2.0 {
        let unit = Tensor::where_cond(&y.eq_scalar(0)?, &zero, &x.div(y)?)?;
        return unit.mul(g);
    }
    let abs = x.mul(&sgn)?;
    if p.is_infinite() {
        return sgn.mul(&evenly_distribute(&abs, y, g, dims)?);
    }
    if p < 1.0 {
        let scaled = sgn.mul(&abs.pow_scalar(p - 1.0)?)?;
        let scaled = scaled.masked_fill(&x.eq_scalar(0)?, 0.0)?;
        return scaled.mul(g)?.mul(&y.pow_scalar(1.0 - p)?);
    }
    // (Σ|x|^p)^(1/p) differentiates to sgn(x)|x|^(p-1) / norm^(p-1).
    let scaled = if p < 2.0 {
        sgn.mul(&abs.pow_scalar(p - 1.0)?)?
    } else {
        x.mul(&abs.pow_scalar(p - 2.0)?)?
    };
    let scale = g.div(&y.pow_scalar(p - 1.0)?)?;
    let scale = scale.masked_fill(&y.eq_scalar(0)?, 0.0)?;
    scaled.mul(&scale)
}

/// Softmax of `x` over several dims at once (`exp(x - logsumexp(x, dims))`), through the
/// softmax kernel over the dims moved last and flattened.
fn softmax_over(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let rank = x.rank();
    if rank == 0 || dims.is_empty() {
        return x.softmax(0);
    }
    if dims.len() == 1 {
        return x.softmax(dims[0] as isize);
    }
    let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<isize> = kept.iter().chain(dims).map(|&d| d as isize).collect();
    let moved = x.permute(&perm)?;
    let mut flat: Vec<isize> = kept.iter().map(|&d| x.dims()[d] as isize).collect();
    flat.push(reduced_count(x.shape(), dims) as isize);
    let moved_dims: Vec<isize> = moved.dims().iter().map(|&d| d as isize).collect();
    let s = moved.reshape(&flat)?.softmax(-1)?.reshape(&moved_dims)?;
    let mut inverse = vec![0isize; rank];
    for (i, &d) in perm.iter().enumerate() {
        inverse[d as usize] = i as isize;
    }
    s.permute(&inverse)
}
