//! Shape ops. Views (reshape when possible, permute, transpose, narrow, slice, select,
//! squeeze, unsqueeze, expand, flatten, split, chunk) share storage with their input and only
//! make a new layout; cat and stack copy. Backward of a view scatters the gradient into zeros
//! of the input's shape through the same view (`grad_through_view`).

use super::binary::{same_device, sum_to_shape};
use crate::autograd::{self};
use crate::dispatch::{self, policy, Op};
use crate::layout::Layout;
use crate::shape::normalize_dim;
use crate::{Error, Result, Shape, Tensor};
use std::borrow::Borrow;

/// Resolves a shape with at most one `-1` against `numel` elements.
fn infer_shape(op: &'static str, dims: &[isize], numel: usize) -> Result<Shape> {
    let mut infer = None;
    let mut known = 1usize;
    for (i, &d) in dims.iter().enumerate() {
        match d {
            -1 if infer.is_none() => infer = Some(i),
            -1 => return Err(Error::invalid(op, "only one dimension can be inferred (-1)")),
            d if d < 0 => return Err(Error::invalid(op, format!("invalid shape dimension {d}"))),
            d => {
                known = known.checked_mul(d as usize).ok_or_else(|| {
                    Error::invalid(
                        op,
                        format!("shape {dims:?} has more elements than memory can address"),
                    )
                })?
            }
        }
    }
    let mut out: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    if let Some(i) = infer {
        if known == 0 || numel % known != 0 {
            return Err(Error::invalid(
                op,
                format!("shape {dims:?} is invalid for input of size {numel}"),
            ));
        }
        out[i] = numel / known;
    } else if known != numel {
        return Err(Error::invalid(
            op,
            format!("shape {dims:?} is invalid for input of size {numel}"),
        ));
    }
    let out = Shape::new(out);
    out.checked_elements(op)?;
    Ok(out)
}

/// The pieces of a split as an array of exactly `N`.
fn pieces_array<const N: usize>(op: &'static str, pieces: Vec<Tensor>) -> Result<[Tensor; N]> {
    let got = pieces.len();
    pieces.try_into().map_err(|_| {
        Error::invalid(
            op,
            format!("the split gives {got} pieces, but {N} are destructured; check split_size against the dim's size"),
        )
    })
}

/// `len` elements of `dim` from `start`, every `step`-th.
fn strided_slice(l: &Layout, d: usize, start: usize, len: usize, step: usize) -> Result<Layout> {
    let span = if len == 0 { 0 } else { (len - 1) * step + 1 };
    let n = l.narrow(d, start, span)?;
    let mut strides = n.strides().to_vec();
    // With two or more elements the step stays inside the dim (so the product is in range);
    // with one, the stride is never used and a huge step must not overflow it.
    if len > 1 {
        strides[d] *= step;
    }
    let mut dims = n.dims().to_vec();
    dims[d] = len;
    Ok(Layout::new(dims.into(), strides, n.offset()))
}

/// Zeros of `shape` with `g` written into the region that `view` selects: the gradient of a
/// view op with respect to its input.
fn grad_through_view(
    g: &Tensor,
    shape: &Shape,
    view: impl FnOnce(&Layout) -> Result<Layout>,
) -> Result<Tensor> {
    let z = Tensor::zeros(shape.clone(), g.dtype(), g.device())?;
    let dst = view(z.layout())?;
    {
        let src = g.storage().read();
        z.storage().write().copy_strided_from(&dst, &src, g.layout())?;
    }
    Ok(z)
}

impl Tensor {
    /// A view of `self` with `layout` that is the region `region` gives of any layout of
    /// `self`'s shape (`narrow`, `slice`, `select`): its node tells the engine that region, so
    /// the input's gradient travels as a slice until it is summed (Note [Gradients of views] in
    /// `autograd/engine.rs`); its backward writes the gradient into zeros of that region.
    fn region_view<R>(&self, op: &'static Op, layout: Layout, region: R) -> Result<Tensor>
    where
        R: Fn(&Layout) -> Result<Layout> + Send + Sync + 'static,
    {
        dispatch::call_with(op, [self], |[x], door| {
            let out = x.view_with(layout);
            if !autograd::needs_grad(&[x]) {
                return Ok(out);
            }
            let shape = x.shape().clone();
            let view = autograd::ViewOf {
                region: region(&Layout::contiguous(shape.clone()))?,
                shape: shape.clone(),
            };
            Ok(door.record_view(op.name, x, out, view, move |g, _| {
                Ok(vec![Some(grad_through_view(g, &shape, &region)?)])
            }))
        })
    }

    /// A view of `self` with `layout`: the op `op` of the dispatch point (device check and
    /// observers; views are never cast), recorded with `backward` when autograd needs it.
    fn view_op<F>(&self, op: &'static Op, layout: Layout, backward: F) -> Result<Tensor>
    where
        F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
    {
        dispatch::call_with(op, [self], |[x], door| {
            let out = x.view_with(layout);
            if !autograd::needs_grad(&[x]) {
                return Ok(out);
            }
            Ok(door.record(op.name, &[x], out, move |g, _| Ok(vec![Some(backward(g)?)])))
        })
    }

    /// A view with sizes `shape` (one may be -1) if the layout allows one, else a contiguous
    /// copy. `shape` is any [`Sizes`](crate::shape::Sizes) form: `[2, 3]`, `[-1, 4]`, `&dims`,
    /// `(-1, n)` with `n: usize` (Note [Size arguments]).
    pub fn reshape(&self, shape: impl Into<crate::shape::Sizes>) -> Result<Tensor> {
        self.reshape_sizes(shape.into().as_slice())
    }

    fn reshape_sizes(&self, dims: &[isize]) -> Result<Tensor> {
        let shape = infer_shape("reshape", dims, self.numel())?;
        match self.layout().view(&shape) {
            Some(layout) => self.reshape_view(&policy::RESHAPE, layout),
            None => self.contiguous()?.reshape_sizes(dims),
        }
    }

    /// A view with sizes `shape` (one may be -1; any [`Sizes`](crate::shape::Sizes) form); an
    /// error if the strides do not allow one.
    pub fn view(&self, shape: impl Into<crate::shape::Sizes>) -> Result<Tensor> {
        let sizes = shape.into();
        let dims = sizes.as_slice();
        let shape = infer_shape("view", dims, self.numel())?;
        let layout = self.layout().view(&shape).ok_or_else(|| {
            Error::invalid(
                "view",
                format!(
                    "view size {shape} is not compatible with input size {} and strides {:?}; use reshape() instead",
                    self.shape(),
                    self.stride()
                ),
            )
        })?;
        self.reshape_view(&policy::VIEW, layout)
    }

    fn reshape_view(&self, op: &'static Op, layout: Layout) -> Result<Tensor> {
        let src: Vec<isize> = self.dims().iter().map(|&d| d as isize).collect();
        self.view_op(op, layout, move |g| g.reshape(&src))
    }

    /// Dimensions reordered (`permute`); negative dims count from the end.
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        let dims = dims
            .iter()
            .map(|&d| normalize_dim("permute", d, self.rank()))
            .collect::<Result<Vec<_>>>()?;
        let layout = self.layout().permute(&dims)?;
        let mut inverse = vec![0isize; dims.len()];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i as isize;
        }
        self.view_op(&policy::PERMUTE, layout, move |g| g.permute(&inverse))
    }

    /// Swaps two dimensions (`transpose`).
    pub fn transpose(&self, dim0: isize, dim1: isize) -> Result<Tensor> {
        let (d0, d1) = (
            self.shape().dim("transpose", dim0)?,
            self.shape().dim("transpose", dim1)?,
        );
        if self.rank() == 0 {
            return Ok(self.clone());
        }
        let layout = self.layout().transpose(d0, d1);
        self.view_op(&policy::TRANSPOSE, layout, move |g| {
            g.transpose(d0 as isize, d1 as isize)
        })
    }

    /// The transpose of a matrix; vectors and scalars are returned as they are (`t`).
    pub fn t(&self) -> Result<Tensor> {
        match self.rank() {
            0 | 1 => Ok(self.clone()),
            2 => dispatch::named(&policy::T, &[self], || self.transpose(0, 1)),
            r => Err(Error::invalid(
                "t",
                format!("t() expects a tensor with <= 2 dimensions, but self is {r}D; use transpose()"),
            )),
        }
    }

    /// `length` elements of `dim` starting at `start` (`narrow`).
    pub fn narrow(&self, dim: isize, start: usize, length: usize) -> Result<Tensor> {
        let d = self.shape().dim("narrow", dim)?;
        if self.rank() == 0 {
            return Err(Error::invalid(
                "narrow",
                "narrow() cannot be applied to a 0-dim tensor",
            ));
        }
        let layout = self.layout().narrow(d, start, length)?;
        self.region_view(&policy::NARROW, layout, move |l| l.narrow(d, start, length))
    }

    /// Elements `start..end` of `dim` taking every `step`-th (`x[:, start:end:step]`);
    /// negative bounds count from the end and out-of-range bounds are clamped, as in Python.
    pub fn slice(&self, dim: isize, start: isize, end: isize, step: usize) -> Result<Tensor> {
        let d = self.shape().dim("slice", dim)?;
        if step == 0 {
            return Err(Error::invalid("slice", "slice step must be positive"));
        }
        if self.rank() == 0 {
            return Err(Error::invalid("slice", "cannot slice a 0-dim tensor"));
        }
        let size = self.dims()[d] as isize;
        let clamp = |i: isize| if i < 0 { (i + size).max(0) } else { i.min(size) } as usize;
        let (start, end) = (clamp(start), clamp(end));
        let len = if end > start {
            (end - start).div_ceil(step)
        } else {
            0
        };
        if step == 1 {
            return self.narrow(dim, start, len);
        }
        let layout = strided_slice(self.layout(), d, start, len, step)?;
        self.region_view(&policy::SLICE, layout, move |l| {
            strided_slice(l, d, start, len, step)
        })
    }
    /// Element `index` of `dim`, removing that dim (`select`, `x[:, i]`); negative `index`
    /// counts from the end.
    pub fn select(&self, dim: isize, index: isize) -> Result<Tensor> {
        let d = self.shape().dim("select", dim)?;
        if self.rank() == 0 {
            return Err(Error::invalid(
                "select",
                "select() cannot be applied to a 0-dim tensor",
            ));
        }
        let size = self.dims()[d];
        let i = if index < 0 { index + size as isize } else { index };
        if i < 0 || i as usize >= size {
            return Err(Error::IndexOutOfRange {
                op: "select",
                index: index as i64,
                dim: d,
                size,
            });
        }
        let i = i as usize;
        let layout = self.layout().select(d, i)?;
        self.region_view(&policy::SELECT, layout, move |l| l.select(d, i))
    }

    /// Inserts a dim of size 1 at `dim` (in `[-rank-1, rank]`).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("unsqueeze", dim, self.rank() + 1)?;
        let layout = self.layout().unsqueeze(d);
        self.view_op(&policy::UNSQUEEZE, layout, move |g| g.squeeze_dim(d as isize))
    }

    /// Removes `dim` if it has size 1 (otherwise a view of the same shape).
    pub fn squeeze_dim(&self, dim: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            self.shape().dim("squeeze", dim)?;
            return Ok(self.clone());
        }
        let d = self.shape().dim("squeeze", dim)?;
        let layout = self.layout().squeeze(d);
        let src: Vec<isize> = self.dims().iter().map(|&x| x as isize).collect();
        self.view_op(&policy::SQUEEZE, layout, move |g| g.reshape(&src))
    }

    /// Removes every dim of size 1.
    pub fn squeeze(&self) -> Result<Tensor> {
        let dims: Vec<isize> = self
            .dims()
            .iter()
            .filter(|&&d| d != 1)
            .map(|&d| d as isize)
            .collect();
        dispatch::named(&policy::SQUEEZE, &[self], || self.reshape(&dims))
    }

    /// A broadcast view with `sizes`; -1 keeps a dim's size (`expand`). Any
    /// [`Sizes`](crate::shape::Sizes) form.
    pub fn expand(&self, sizes: impl Into<crate::shape::Sizes>) -> Result<Tensor> {
        let sizes = sizes.into();
        let sizes = sizes.as_slice();
        if sizes.len() < self.rank() {
            return Err(Error::invalid(
                "expand",
                format!(
                    "the number of sizes provided ({}) must be at least the number of dimensions ({})",
                    sizes.len(),
                    self.rank()
                ),
            ));
        }
        let lead = sizes.len() - self.rank();
        let dims = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| match s {
                -1 if i >= lead => Ok(self.dims()[i - lead]),
                s if s >= 0 => Ok(s as usize),
                _ => Err(Error::invalid(
                    "expand",
                    format!("invalid size {s} for dimension {i}"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        self.broadcast_view(&Shape::new(dims))
    }

    /// A broadcast view with `shape` (`broadcast_to`).
    pub fn broadcast_to(&self, shape: &Shape) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        dispatch::named(&policy::BROADCAST_TO, &[self], || self.broadcast_view(shape))
    }

    /// [`Tensor::broadcast_to`] as `expand`'s view.
    pub(crate) fn broadcast_view(&self, shape: &Shape) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let layout = self.layout().broadcast_as(shape, "expand")?;
        let src = self.shape().clone();
        self.view_op(&policy::EXPAND, layout, move |g| sum_to_shape(g, &src))
    }

    /// Dims `start..=end` merged into one (`flatten`).
    /// A 0-d tensor accepts dims -1 and 0 and becomes `[1]`, as in PyTorch.
    pub fn flatten(&self, start_dim: isize, end_dim: isize) -> Result<Tensor> {
        dispatch::named(&policy::FLATTEN, &[self], || {
            self.flatten_composite(start_dim, end_dim)
        })
    }

    fn flatten_composite(&self, start_dim: isize, end_dim: isize) -> Result<Tensor> {
        let (s, e) = (
            self.shape().dim("flatten", start_dim)?,
            self.shape().dim("flatten", end_dim)?,
        );
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        if s > e {
            return Err(Error::invalid("flatten", "start_dim cannot come after end_dim"));
        }
        let mut dims: Vec<isize> = self.dims()[..s].iter().map(|&d| d as isize).collect();
        dims.push(self.dims()[s..=e].iter().product::<usize>() as isize);
        dims.extend(self.dims()[e + 1..].iter().map(|&d| d as isize));
        self.reshape(&dims)
    }

    /// Pieces of `split_size` along `dim` (the last may be smaller), as views (`split`).
    pub fn split(&self, split_size: usize, dim: isize) -> Result<Vec<Tensor>> {
        dispatch::named(&policy::SPLIT, &[self], || self.split_composite(split_size, dim))
    }

    fn split_composite(&self, split_size: usize, dim: isize) -> Result<Vec<Tensor>> {
        self.require_dims("split", dim)?;
        let d = self.shape().dim("split", dim)?;
        if split_size == 0 {
            return Err(Error::invalid("split", "split_size must be positive"));
        }
        let size = self.dims()[d];
        let mut out = Vec::new();
        let mut start = 0;
        while start < size || (size == 0 && out.is_empty()) {
            let len = split_size.min(size - start);
            out.push(self.narrow(dim, start, len)?);
            start = start.saturating_add(split_size);
        }
        Ok(out)
    }

    /// [`Tensor::split`] into exactly `N` pieces, as an array to destructure:
    /// `let [q, k, v] = x.split_into(c, 2)?;` for PyTorch's `q, k, v = x.split(c, dim=2)`
    /// (`N` comes from the pattern). An [`Error::InvalidArgument`] naming both counts when the
    /// split gives another number of pieces.
    pub fn split_into<const N: usize>(&self, split_size: usize, dim: isize) -> Result<[Tensor; N]> {
        pieces_array("split_into", self.split(split_size, dim)?)
    }

    /// [`Tensor::chunk`] into exactly `N` pieces, as an array to destructure:
    /// `let [a, b] = x.chunk_into(-1)?;` splits the last dim in halves (`x.chunk(2, -1)`).
    pub fn chunk_into<const N: usize>(&self, dim: isize) -> Result<[Tensor; N]> {
        pieces_array("chunk_into", self.chunk(N, dim)?)
    }

    /// Pieces of the given sizes along `dim` (`split` with a list of sizes).
    pub fn split_with_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        dispatch::named(&policy::SPLIT_WITH_SIZES, &[self], || {
            self.split_with_sizes_composite(sizes, dim)
        })
    }

    fn split_with_sizes_composite(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        self.require_dims("split_with_sizes", dim)?;
        let d = self.shape().dim("split_with_sizes", dim)?;
        let total = sizes.iter().try_fold(0usize, |acc, &s| acc.checked_add(s));
        if total != Some(self.dims()[d]) {
            return Err(Error::invalid(
                "split_with_sizes",
                format!(
                    "sizes {sizes:?} must sum to the size of dimension {d} ({})",
                    self.dims()[d]
                ),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(dim, start, len);
                start += len;
                t
            })
            .collect()
    }

    /// At most `chunks` pieces of equal size (the last may be smaller) along `dim` (`chunk`).
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        self.require_dims("chunk", dim)?;
        let d = self.shape().dim("chunk", dim)?;
        if chunks == 0 {
            return Err(Error::invalid("chunk", "chunks must be positive"));
        }
        let size = self.dims()[d];
        dispatch::named(&policy::CHUNK, &[self], || {
            self.split_composite(size.div_ceil(chunks).max(1), dim)
        })
    }

    /// Tensors joined along an existing `dim` (`torch.cat`); shapes must agree elsewhere.
    pub fn cat<T: Borrow<Tensor>>(tensors: &[T], dim: isize) -> Result<Tensor> {
        let ts: Vec<&Tensor> = tensors.iter().map(|t| t.borrow()).collect();
        dispatch::call_list(&policy::CAT, &ts, |ts, door| Tensor::cat_prepared(ts, dim, door))
    }

    fn cat_prepared(tensors: &[Tensor], dim: isize, door: dispatch::Door) -> Result<Tensor> {
        let ts: Vec<&Tensor> = tensors.iter().collect();
        let first = *ts
            .first()
            .ok_or_else(|| Error::invalid("cat", "expected a non-empty list of tensors"))?;
        same_device("cat", &ts)?;
        let d = first.shape().dim("cat", dim)?;
        if first.rank() == 0 {
            return Err(Error::invalid(
                "cat",
                "zero-dimensional tensors cannot be concatenated",
            ));
        }
        let dtype = ts
            .iter()
            .skip(1)
            .fold(first.dtype(), |acc, t| acc.promote(t.dtype()));
        let mut dims = first.dims().to_vec();
        dims[d] = 0;
        for t in &ts {
            let same_rank = t.rank() == first.rank();
            let same_other = same_rank && (0..t.rank()).all(|i| i == d || t.dims()[i] == first.dims()[i]);
            if !same_other {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().clone(),
                    rhs: t.shape().clone(),
                    hint: "sizes must match except in the concatenated dimension",
                });
            }
            dims[d] = dims[d].checked_add(t.dims()[d]).ok_or_else(|| {
                Error::invalid(
                    "cat",
                    "the concatenated size overflows; use fewer or smaller tensors",
                )
            })?;
        }
        Shape::from(dims.as_slice()).checked_elements("cat")?;
        let out = Tensor::zeros(dims, dtype, first.device())?;
        let mut start = 0;
        let mut sizes = Vec::with_capacity(ts.len());
        {
            let mut dst = out.storage().write();
            for t in &ts {
                let len = t.dims()[d];
                let region = out.layout().narrow(d, start, len)?;
                dst.copy_strided_from(&region, &t.storage().read(), t.layout())?;
                start += len;
                sizes.push(len);
            }
        }
        if !autograd::needs_grad(&ts) {
            return Ok(out);
        }
        let dtypes: Vec<_> = ts.iter().map(|t| t.dtype()).collect();
        Ok(door.record("cat", &ts, out, move |g, needs| {
            let mut start = 0;
            let mut grads = Vec::with_capacity(sizes.len());
            for (i, &len) in sizes.iter().enumerate() {
                grads.push(if needs[i] {
                    Some(g.narrow(d as isize, start, len)?.to_dtype(dtypes[i])?)
                } else {
                    None
                });
                start += len;
            }
            Ok(grads)
        }))
    }

    /// Tensors of one shape joined along a new `dim` (`torch.stack`).
    pub fn stack<T: Borrow<Tensor>>(tensors: &[T], dim: isize) -> Result<Tensor> {
        let ts: Vec<&Tensor> = tensors.iter().map(|t| t.borrow()).collect();
        dispatch::named(&policy::STACK, &ts, || Tensor::stack_composite(&ts, dim))
    }

    fn stack_composite(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("stack", "expected a non-empty list of tensors"))?;
        let first_shape = first.shape().clone();
        let d = normalize_dim("stack", dim, first_shape.rank() + 1)? as isize;
        let parts = tensors
            .iter()
            .map(|t| {
                if t.shape() != &first_shape {
                    return Err(Error::ShapeMismatch {
                        op: "stack",
                        lhs: first_shape.clone(),
                        rhs: t.shape().clone(),
                        hint: "stack expects each tensor to be equal size",
                    });
                }
                t.unsqueeze(d)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, d)
    }

    /// Views of each element along `dim`, with that dim removed (`unbind`).
    pub fn unbind(&self, dim: isize) -> Result<Vec<Tensor>> {
        self.require_dims("unbind", dim)?;
        let d = self.shape().dim("unbind", dim)?;
        dispatch::named(&policy::UNBIND, &[self], || {
            (0..self.dims()[d])
                .map(|i| self.select(dim, i as isize))
                .collect()
        })
    }
}
