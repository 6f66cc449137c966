//! Indexing by index tensors: index_select, gather, scatter / scatter_value / scatter_add,
//! index_add, embedding lookup and one_hot, with backward rules.
//!
//! Index tensors are int64 (int32 is accepted too). Every index is checked against the size of
//! the dim it indexes; an out-of-range or negative one is [`Error::IndexOutOfRange`], never a
//! panic (none of these ops wraps negative indices, as in PyTorch). On the CPU the op returns
//! it; on CUDA the indices are checked on the device and the error is returned by the next call
//! that waits for the device (`to_vec`, `item`, a synchronize), as PyTorch reports its
//! device-side asserts (Note [Deferred device errors] in `cuda_backend/device_errors.rs`). The backend sees two op
//! families: reads ([`IndexOp`]: the output takes elements of `self` at the indices) and writes
//! ([`ScatterOp`]: a copy of `self` receives `src` at the indices). All writes are out of place.

use super::binary::same_device;
use super::conv::packed;
use crate::autograd::{self, SavedTensor};
use crate::dispatch::{self, policy, Door};
use crate::dtype::Scalar;
use crate::layout::Layout;
use crate::{DType, Error, Result, Shape, Tensor};

pub use crate::backend::op::{IndexOp, ScatterOp};

/// Checks that `index` is an int64 or int32 tensor on `t`'s device.
fn check_index(op: &'static str, t: &Tensor, index: &Tensor) -> Result<()> {
    same_device(op, &[t, index])?;
    match index.dtype() {
        DType::I64 | DType::I32 => Ok(()),
        dtype => Err(Error::UnsupportedDType {
            op,
            dtype,
            hint: "index tensors must be int64 (or int32); convert with .to_dtype(DType::I64)",
        }),
    }
}

fn check_same_dtype(op: &'static str, t: &Tensor, src: &Tensor) -> Result<()> {
    same_device(op, &[t, src])?;
    if t.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: t.dtype(),
            found: src.dtype(),
        });
    }
    Ok(())
}

/// A 0-d tensor viewed as 1-D of size 1 (these ops treat scalars so, as PyTorch does).
fn lift(t: &Tensor) -> Result<Tensor> {
    if t.rank() == 0 {
        t.reshape(&[1])
    } else {
        Ok(t.clone())
    }
}

fn isize_dims(shape: &Shape) -> Vec<isize> {
    shape.dims().iter().map(|&d| d as isize).collect()
}

/// `t` placed at the start of each dim of zeros of `shape` (every dim of `t` is at most
/// `shape`'s): the gradient of a `src` larger than the index it was read through.
fn pad_to(t: &Tensor, shape: &Shape) -> Result<Tensor> {
    if t.shape() == shape {
        return Ok(t.clone());
    }
    let z = Tensor::zeros(shape.clone(), t.dtype(), t.device())?;
    let mut region = z.layout().clone();
    for (d, &len) in t.dims().iter().enumerate() {
        region = region.narrow(d, 0, len)?;
    }
    {
        let src = t.storage().read();
        z.storage().write().copy_strided_from(&region, &src, t.layout())?;
    }
    Ok(z)
}

/// `index_select` under the name `op` (embedding reuses it).
fn index_select_as(op: &'static str, x: &Tensor, dim: isize, index: &Tensor, door: Door) -> Result<Tensor> {
    check_index(op, x, index)?;
    if index.rank() > 1 {
        return Err(Error::invalid(
            op,
            format!(
                "the index must be a vector (0-D or 1-D), got shape {}",
                index.shape()
            ),
        ));
    }
    let d = x.shape().dim(op, dim)?;
    if x.rank() == 0 {
        if index.numel() != 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "an index into a 0-D tensor must have 1 value, got {}",
                    index.numel()
                ),
            ));
        }
        return index_select_as(op, &lift(x)?, 0, index, door)?.reshape(());
    }
    let mut dims = x.dims().to_vec();
    dims[d] = index.numel();
    let il = if index.rank() == 0 {
        index.layout().unsqueeze(0)
    } else {
        index.layout().clone()
    };
    let storage = {
        let (s, i) = (x.storage().read(), index.storage().read());
        s.index_read(IndexOp::Select, op, x.layout(), d, &i, &il)?
    };
    let out = door.tensor(storage, dims);
    if !autograd::needs_grad(&[x]) {
        return Ok(out);
    }
    let idx = SavedTensor::new(op, index);
    let shape = x.shape().clone();
    let rows_grad = d == 0;
    let out = door.record(op, &[x], out, move |g, _| {
        if d == 0 && g.dtype().is_floating_point() {
            return Ok(vec![Some(rows_backward(g, idx.get()?, &shape, door)?)]);
        }
        let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
        Ok(vec![Some(z.index_add(d as isize, idx.get()?, g)?)])
    });
    if rows_grad {
        autograd::mark_accumulating(&out);
    }
    Ok(out)
}

/// The gradient of a read of whole rows (`index_select` along dim 0, `embedding`) from the
/// gradient `g` of the rows read: each row of the table the sum of the gradient rows read
/// from it, in the order of the positions, accumulated in f32 (f64 for f64) and written once:
/// deterministic, no zero fill, no atomics (Note [Deterministic embedding backward] in
/// `cuda_backend/index.rs`).
fn rows_backward(g: &Tensor, index: &Tensor, shape: &Shape, door: Door) -> Result<Tensor> {
    let rows = shape.dims()[0];
    let n = index.numel();
    let d: usize = shape.dims()[1..].iter().product();
    let (g, i) = (packed(g, door)?, packed(index, door)?);
    // Note [Gradients added in place] in `autograd/engine.rs`: a tied table (GPT-2's token
    // embedding, also the classifier's weight) gets the rows' sums added to the classifier's
    // gradient, which arrived first.
    let into = autograd::take_accumulator(|t| {
        t.dtype() == g.dtype()
            && t.shape() == shape
            && t.layout().is_contiguous()
            && t.layout().offset() == 0
            && t.device() == g.device()
    });
    let storage = {
        let (sg, si) = (g.storage().read(), i.storage().read());
        let mut acc = into.as_ref().map(|t| t.storage().write());
        sg.embedding_backward(&si, n, d, rows, acc.as_deref_mut())?
    };
    match (storage, into) {
        (Some(s), _) => Ok(door.tensor(s, shape.clone())),
        (None, Some(sum)) => Ok(sum),
        (None, None) => unreachable!("the backend returns the sum unless given `into`"),
    }
}

/// Rank and size checks shared by gather and the scatters: `index` has `x`'s rank, fits in
/// `x` outside `dim`, and fits in `src` (if any) everywhere.
fn check_gather_shapes(
    op: &'static str,
    x: &Tensor,
    d: usize,
    index: &Tensor,
    src: Option<&Tensor>,
) -> Result<()> {
    if index.rank() != x.rank() {
        return Err(Error::invalid(
            op,
            format!(
                "the index must have as many dims as self: index is {}, self is {}",
                index.shape(),
                x.shape()
            ),
        ));
    }
    let too_big = (0..x.rank()).any(|i| i != d && index.dims()[i] > x.dims()[i]);
    if too_big {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().clone(),
            rhs: index.shape().clone(),
            hint: "the index may not be larger than self in any dim except `dim`",
        });
    }
    if let Some(src) = src {
        if src.rank() != x.rank() || (0..x.rank()).any(|i| index.dims()[i] > src.dims()[i]) {
            return Err(Error::ShapeMismatch {
                op,
                lhs: src.shape().clone(),
                rhs: index.shape().clone(),
                hint: "src must have self's rank and be at least as large as the index in every dim",
            });
        }
    }
    Ok(())
}

/// The kernel call of every scatter: a copy of `x` with `src` (at `sl`) written at `index`.
fn scatter_kernel(
    op: ScatterOp,
    x: &Tensor,
    d: usize,
    index: &Tensor,
    src: &Tensor,
    sl: &Layout,
    door: Door,
) -> Result<Tensor> {
    let storage = {
        let (s, i, v) = (x.storage().read(), index.storage().read(), src.storage().read());
        s.index_write(op, x.layout(), d, &i, index.layout(), &v, sl)?
    };
    Ok(door.tensor(storage, x.shape()))
}

/// `scatter` / `scatter_add` with checks, scalar lifting and autograd.
fn scatter_tensor(
    op: ScatterOp,
    x: &Tensor,
    dim: isize,
    index: &Tensor,
    src: &Tensor,
    door: Door,
) -> Result<Tensor> {
    let name = op.name();
    check_index(name, x, index)?;
    check_same_dtype(name, x, src)?;
    let d = x.shape().dim(name, dim)?;
    if x.rank() == 0 || index.rank() == 0 || src.rank() == 0 {
        let out = scatter_tensor(op, &lift(x)?, d as isize, &lift(index)?, &lift(src)?, door)?;
        return out.reshape(&isize_dims(x.shape()));
    }
    check_gather_shapes(name, x, d, index, Some(src))?;
    let out = scatter_kernel(op, x, d, index, src, src.layout(), door)?;
    if !autograd::needs_grad(&[x, src]) {
        return Ok(out);
    }
    let idx = SavedTensor::new(name, index);
    let src_shape = src.shape().clone();
    Ok(door.record(name, &[x, src], out, move |g, needs| {
        let index = idx.get()?;
        let gx = match op {
            // Scattered positions were overwritten: no gradient reaches self there.
            ScatterOp::Scatter if needs[0] => Some(g.scatter_value(d as isize, index, 0.0)?),
            _ if needs[0] => Some(g.clone()),
            _ => None,
        };
        let gsrc = if needs[1] {
            Some(pad_to(&g.gather(d as isize, index)?, &src_shape)?)
        } else {
            None
        };
        Ok(vec![gx, gsrc])
    }))
}

impl Tensor {
    /// The entries of `dim` at the positions in the 1-D `index`, in that order
    /// (`torch.index_select`).
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::INDEX_SELECT, [self, index], |[x, i], door| {
            index_select_as("index_select", x, dim, i, door)
        })
    }

    /// `out[i][j] = self[index[i][j]][j]` for `dim` 0, and so on (`torch.gather`); the output has
    /// `index`'s shape.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::GATHER, [self, index], |[x, i], door| {
            x.gather_prepared(dim, i, door)
        })
    }

    fn gather_prepared(&self, dim: isize, index: &Tensor, door: Door) -> Result<Tensor> {
        const OP: &str = "gather";
        check_index(OP, self, index)?;
        let d = self.shape().dim(OP, dim)?;
        if self.rank() == 0 || index.rank() == 0 {
            return lift(self)?
                .gather(0, &lift(index)?)?
                .reshape(&isize_dims(index.shape()));
        }
        check_gather_shapes(OP, self, d, index, None)?;
        let storage = {
            let (s, i) = (self.storage().read(), index.storage().read());
            s.index_read(IndexOp::Gather, OP, self.layout(), d, &i, index.layout())?
        };
        let out = door.tensor(storage, index.shape());
        if !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        let idx = SavedTensor::new(OP, index);
        let shape = self.shape().clone();
        Ok(door.record(OP, &[self], out, move |g, _| {
            let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
            Ok(vec![Some(z.scatter_add(d as isize, idx.get()?, g)?)])
        }))
    }

    /// `self` with `src[p]` written at `p` with `p[dim] = index[p]`, for `p` over `index`'s
    /// shape (out of place; `torch.scatter`). With repeated indices the last write wins.
    pub fn scatter(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::SCATTER, [self, index, src], |[x, i, s], door| {
            scatter_tensor(ScatterOp::Scatter, x, dim, i, s, door)
        })
    }

    /// `self` with `value` written at the positions `scatter` would write (`torch.scatter` with
    /// a scalar `value`; out of place).
    pub fn scatter_value(&self, dim: isize, index: &Tensor, value: impl Into<Scalar>) -> Result<Tensor> {
        let value = value.into();
        dispatch::call_with(&policy::SCATTER, [self, index], |[x, i], door| {
            x.scatter_value_prepared(dim, i, value, door)
        })
    }

    fn scatter_value_prepared(
        &self,
        dim: isize,
        index: &Tensor,
        value: Scalar,
        door: Door,
    ) -> Result<Tensor> {
        const OP: &str = "scatter";
        check_index(OP, self, index)?;
        let d = self.shape().dim(OP, dim)?;
        if self.rank() == 0 || index.rank() == 0 {
            return lift(self)?
                .scatter_value(0, &lift(index)?, value)?
                .reshape(&isize_dims(self.shape()));
        }
        check_gather_shapes(OP, self, d, index, None)?;
        let v = Tensor::scalar(value.to_f64(), self.dtype(), self.device())?;
        let vl = v.layout().broadcast_as(index.shape(), OP)?;
        let out = scatter_kernel(ScatterOp::Scatter, self, d, index, &v, &vl, door)?;
        if !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        let idx = SavedTensor::new(OP, index);
        Ok(door.record(OP, &[self], out, move |g, _| {
            Ok(vec![Some(g.scatter_value(d as isize, idx.get()?, 0.0)?)])
        }))
    }

    /// `self` with `src` added at `index` along `dim` (out of place; `torch.scatter_add`).
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::SCATTER_ADD, [self, index, src], |[x, i, s], door| {
            scatter_tensor(ScatterOp::ScatterAdd, x, dim, i, s, door)
        })
    }

    /// `self` with rows of `source` added at `index` along `dim` (out of place; `index_add`).
    pub fn index_add(&self, dim: isize, index: &Tensor, source: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::INDEX_ADD, [self, index, source], |[x, i, s], door| {
            x.index_add_prepared(dim, i, s, door)
        })
    }

    fn index_add_prepared(&self, dim: isize, index: &Tensor, source: &Tensor, door: Door) -> Result<Tensor> {
        const OP: &str = "index_add";
        check_index(OP, self, index)?;
        check_same_dtype(OP, self, source)?;
        let d = self.shape().dim(OP, dim)?;
        if index.rank() > 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "the index must be a vector (0-D or 1-D), got shape {}",
                    index.shape()
                ),
            ));
        }
        if self.rank() == 0 || source.rank() == 0 {
            return lift(self)?
                .index_add(0, &lift(index)?, &lift(source)?)?
                .reshape(&isize_dims(self.shape()));
        }
        let fits = source.rank() == self.rank()
            && (0..self.rank()).all(|i| {
                if i == d {
                    source.dims()[i] == index.numel()
                } else {
                    source.dims()[i] == self.dims()[i]
                }
            });
        if !fits {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: source.shape().clone(),
                hint: "source must have self's shape except in `dim`, where its size must be the number of indices",
            });
        }
        let index = lift(index)?;
        let out = scatter_kernel(
            ScatterOp::IndexAdd,
            self,
            d,
            &index,
            source,
            source.layout(),
            door,
        )?;
        if !autograd::needs_grad(&[self, source]) {
            return Ok(out);
        }
        let idx = SavedTensor::new(OP, &index);
        Ok(door.record(OP, &[self, source], out, move |g, needs| {
            let gs = if needs[1] {
                Some(g.index_select(d as isize, idx.get()?)?)
            } else {
                None
            };
            Ok(vec![needs[0].then(|| g.clone()), gs])
        }))
    }

    /// Rows of `weight` (`[num_embeddings, embedding_dim]`) at `indices`: the output has shape
    /// `indices.shape + [embedding_dim]` (`F.embedding(input, weight)`). The weight's gradient
    /// adds each output row's gradient into the row it came from.
    pub fn embedding(indices: &Tensor, weight: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::EMBEDDING, [indices, weight], |[i, w], door| {
            Tensor::embedding_prepared(i, w, door)
        })
    }

    fn embedding_prepared(indices: &Tensor, weight: &Tensor, door: Door) -> Result<Tensor> {
        const OP: &str = "embedding";
        check_index(OP, weight, indices)?;
        if weight.rank() != 2 {
            return Err(Error::invalid(
                OP,
                format!("'weight' must be 2-D, got shape {}", weight.shape()),
            ));
        }
        let flat = indices.reshape(&[indices.numel() as isize])?;
        let rows = index_select_as(OP, weight, 0, &flat, door)?;
        let mut dims = isize_dims(indices.shape());
        dims.push(weight.dims()[1] as isize);
        rows.reshape(&dims)
    }

    /// One-hot int64 rows of the class indices in `self` (int64 or int32): shape
    /// `self.shape + [num_classes]`; `num_classes == -1` uses max + 1 (`F.one_hot`).
    pub fn one_hot(&self, num_classes: i64) -> Result<Tensor> {
        dispatch::call_with(&policy::ONE_HOT, [self], |[x], door| {
            x.one_hot_prepared(num_classes, door)
        })
    }

    fn one_hot_prepared(&self, num_classes: i64, door: Door) -> Result<Tensor> {
        const OP: &str = "one_hot";
        if !matches!(self.dtype(), DType::I64 | DType::I32) {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: self.dtype(),
                hint: "one_hot takes an int64 (or int32) tensor of class indices; convert with .to_dtype(DType::I64)",
            });
        }
        let nc = match num_classes {
            -1 => None,
            n if n >= 0 => Some(n as usize),
            n => {
                return Err(Error::invalid(
                    OP,
                    format!("num_classes should be -1 or non-negative, got {n}"),
                ))
            }
        };
        if nc.is_none() && self.numel() == 0 {
            return Err(Error::invalid(
                OP,
                "can not infer the number of classes from an empty tensor; pass num_classes",
            ));
        }
        let (storage, n) = self.storage().read().one_hot(self.layout(), nc)?;
        let mut dims = self.dims().to_vec();
        dims.push(n);
        Ok(door.tensor(storage, dims))
    }
}
