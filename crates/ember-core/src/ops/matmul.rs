//! Matrix products with PyTorch's semantics: `matmul` (1-D, 2-D, batched with broadcasting),
//! `mm`, `bmm`, `linear`, with backward rules.
//!
//! Every product reaches the backend as one batched GEMM (`Storage::matmul`): operands of
//! shapes `[B.., m, k]` and `[B.., k, n]` whose batch dims were already broadcast by strides
//! (stride 0, no copy), and whose matrix dims may have any strides (a transposed view is read
//! in place). 1-D operands are handled here by views (unsqueeze, then squeeze) whose own
//! backward rules compose with the product's, as in PyTorch. `linear` with a bias vector is one
//! product with a bias (`Storage::matmul_bias`) whose sum rounds once, as PyTorch's `addmm`.

use super::binary::{same_device, sum_to_shape};
use crate::autograd::{self, SavedTensor};
use crate::dispatch::{self, policy, Door};
use crate::storage::row_blocks::Arrivals;
use crate::{DType, Error, Result, Shape, Tensor};

/// Device and dtype checks shared by every product (matmul requires equal dtypes, as PyTorch).
fn check_operands(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    same_device(op, &[a, b])?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            found: b.dtype(),
        });
    }
    Ok(())
}

fn inner_mismatch(op: &'static str, a: &Tensor, b: &Tensor) -> Error {
    Error::ShapeMismatch {
        op,
        lhs: a.shape().clone(),
        rhs: b.shape().clone(),
        hint: "the last dim of the first operand must equal the second-to-last dim of the second (the inner dimension)",
    }
}

/// `a @ b` for `a: [.., m, k]`, `b: [.., k, n]` (ranks >= 2) with batch dims broadcast;
/// `user` are the operands as the caller gave them, named in errors.
fn product(op: &'static str, a: &Tensor, b: &Tensor, user: (&Tensor, &Tensor), door: Door) -> Result<Tensor> {
    product_as(op, a, b, user, [false; 2], door)
}

/// Note [Widened gradients]: under autocast a float32 weight (and a float32 activation, such
/// as a LayerNorm's output) reaches a product as its bfloat16 cast, and the gradient that
/// comes back is a bfloat16 product that the cast's backward converts to float32: a rounding
/// and a kernel per operand. cuBLASLt accumulates in float32 either way and writes a float32
/// D from bfloat16 A and B as fast, so where an operand of `linear` is the cast of a float32
/// tensor, its gradient is written in float32 directly, and the cast's backward has nothing
/// left to convert. In GPT-2's step that is the 49 weight gradients and 25 LayerNorm-input
/// gradients: the bfloat16 → float32 casts went from 122 launches and 0.56 ms to the 48 bias
/// gradients' 0.06 ms (docs/benchmarks.md, session 45). The value
/// differs from PyTorch's (which rounds to bfloat16 first) by less than bfloat16's rounding,
/// in the accurate direction. On backends without a widened product (the CPU), and under
/// `create_graph`, the gradient is the product in the operands' dtype as before.
///
/// Whether `t`'s gradient may be computed in float32: a half tensor cast from float32.
fn widens(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::BF16 | DType::F16) && autograd::cast_from(t) == Some(DType::F32)
}

/// A product inside a backward rule: in float32 when `wide` and the backend writes half
/// products so (Note [Widened gradients]), else [`product`]. Not under `create_graph`, whose
/// graph would take the float32 gradient for one of the half dtype.
fn grad_product(op: &'static str, a: &Tensor, b: &Tensor, wide: bool, door: Door) -> Result<Tensor> {
    if wide && matrices(a, b) && a.dtype() == b.dtype() && !autograd::is_grad_enabled() {
        let widened = {
            let (sa, sb) = (a.storage().read(), b.storage().read());
            sa.matmul_widened(a.layout(), &sb, b.layout())?
        };
        if let Some(storage) = widened {
            return Ok(door.tensor(storage, Shape::from([a.dims()[0], b.dims()[1]])));
        }
    }
    product(op, a, b, (a, b), door)
}

/// [`product`], with `wide` saying which operand's gradient may be computed in float32
/// (Note [Widened gradients]).
fn product_as(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    user: (&Tensor, &Tensor),
    wide: [bool; 2],
    door: Door,
) -> Result<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    debug_assert!(ra >= 2 && rb >= 2);
    let (m, k, n) = (a.dims()[ra - 2], a.dims()[ra - 1], b.dims()[rb - 1]);
    if b.dims()[rb - 2] != k {
        return Err(inner_mismatch(op, user.0, user.1));
    }
    let batch = Shape::from(&a.dims()[..ra - 2])
        .broadcast(&Shape::from(&b.dims()[..rb - 2]), op)
        .map_err(|e| match e {
            Error::ShapeMismatch { .. } => Error::ShapeMismatch {
                op,
                lhs: user.0.shape().clone(),
                rhs: user.1.shape().clone(),
                hint: "the batch dimensions (all but the last two) cannot be broadcast together",
            },
            other => other,
        })?;
    let with = |x: usize, y: usize| {
        let mut d = batch.dims().to_vec();
        d.extend([x, y]);
        Shape::new(d)
    };
    let al = a.layout().broadcast_as(&with(m, k), op)?;
    let bl = b.layout().broadcast_as(&with(k, n), op)?;
    with(m, n).checked_elements(op)?;
    let storage = {
        let (sa, sb) = (a.storage().read(), b.storage().read());
        sa.matmul(&al, &sb, &bl)?
    };
    let out = door.tensor(storage, with(m, n));
    if !autograd::needs_grad(&[a, b]) {
        return Ok(out);
    }
    let (xa, xb) = (SavedTensor::new(op, a), SavedTensor::new(op, b));
    let (sa, sb) = (a.shape().clone(), b.shape().clone());
    Ok(door.record(op, &[a, b], out, move |g, needs| {
        // d(a@b)/da = g @ bᵀ, d(a@b)/db = aᵀ @ g; broadcast batch dims are summed back.
        let ga = if needs[0] {
            let (a, b) = (xa.get()?, xb.get()?);
            Some(if matrices(&a, &b) && column_major(&a) {
                // (b @ gᵀ)ᵀ: the gradient in `a`'s own layout.
                let gt = g.t()?;
                grad_product(op, &b, &gt, wide[0], door)?.t()?
            } else if matrices(&a, &b) {
                grad_product(op, g, &b.t()?, wide[0], door)?
            } else {
                let bt = b.transpose(-1, -2)?;
                sum_to_shape(&product(op, g, &bt, (g, &bt), door)?, &sa)?
            })
        } else {
            None
        };
        let gb = if needs[1] {
            let (a, b) = (xa.get()?, xb.get()?);
            Some(if matrices(&a, &b) && column_major(&b) {
                weight_grad(op, g, &a, &b, wide[1], door)?
            } else if matrices(&a, &b) {
                grad_product(op, &a.t()?, g, wide[1], door)?
            } else {
                let at = a.transpose(-1, -2)?;
                sum_to_shape(&product(op, &at, g, (&at, g), door)?, &sb)?
            })
        } else {
            None
        };
        Ok(vec![ga, gb])
    }))
}

/// Both operands plain matrices (`mm`, and `linear`'s folded product): no batch dims to sum.
fn matrices(a: &Tensor, b: &Tensor) -> bool {
    a.rank() == 2 && b.rank() == 2
}

/// Whether a matrix is stored column-major: a transposed view of a dense matrix, as
/// `weight.t()` in every `linear`. Its gradient is computed in that layout, as PyTorch's
/// `mm_mat1_backward`/`mm_mat2_backward` do, so that after the transpose's own backward the
/// weight receives a dense row-major gradient; computed row-major, it would reach the weight
/// as a transposed view, and every later kernel on it (the autocast cast's backward, the
/// accumulation into `.grad`) would gather it element by element.
fn column_major(t: &Tensor) -> bool {
    let (d, s) = (t.dims(), t.layout().strides());
    t.rank() == 2 && d[0] > 1 && d[1] > 1 && s[0] == 1 && s[1] == d[0]
}

/// The gradient of the column-major `b` in `a @ b` (`b: [k, n]`): `(gᵀ @ a)ᵀ`, a `[k, n]`
/// view of a dense `[n, k]` product; in row blocks of that product when `b` views a tensor
/// registered for it (Note [Gradients in row blocks] in `storage/row_blocks.rs`).
fn weight_grad(
    op: &'static str,
    g: &Tensor,
    a: &Tensor,
    b: &Tensor,
    wide: bool,
    door: Door,
) -> Result<Tensor> {
    let gt = g.t()?;
    let blocks = b
        .storage()
        .requested_row_blocks()
        .filter(|_| !autograd::needs_grad(&[&gt, a]));
    let Some(blocks) = blocks else {
        return grad_product(op, &gt, a, wide, door)?.t();
    };
    let (storage, events) = {
        let (sg, sa) = (gt.storage().read(), a.storage().read());
        sg.matmul_row_blocks(gt.layout(), &sa, a.layout(), blocks)?
    };
    let out = door.tensor(storage, Shape::from([gt.dims()[0], a.dims()[1]]));
    if !events.is_empty() {
        out.storage().record_row_block_events(events);
    }
    out.t()
}

/// `x @ wt + bias` for `x: [m, k]`, `wt: [k, n]` and `bias: [n]`, with the bias added before
/// the product rounds (PyTorch's `addmm`), and its backward rule: the product's, plus the
/// bias's gradient (the output gradient summed over the rows).
/// With `arrivals`, `wt`'s rows (the weight's) are still arriving in those blocks (Note
/// [Copies in row blocks] in `storage/row_blocks.rs`).
///
/// `x` and `wt` are views of `linear`'s own input and weight (`input` folded to rows and
/// `weight.t()`, taken without recording): the node is recorded over `input`, `weight` and
/// `bias` themselves, and its output has `out_dims`, so no reshape or transpose node sits between
/// a linear and the ops around it (Note [Activation epilogues] in `autograd/engine.rs` needs the
/// activation's node as the linear's direct input).
#[allow(clippy::too_many_arguments)]
fn product_bias(
    op: &'static str,
    (x, input): (&Tensor, &Tensor),
    (wt, weight): (&Tensor, &Tensor),
    bias: &Tensor,
    out_dims: &[usize],
    arrivals: Option<&Arrivals>,
    wide: [bool; 2],
    door: Door,
) -> Result<Tensor> {
    debug_assert!(x.rank() == 2 && wt.rank() == 2 && bias.rank() == 1);
    let (m, k, n) = (x.dims()[0], x.dims()[1], wt.dims()[1]);
    let storage = {
        let (sx, sw, sb) = (x.storage().read(), wt.storage().read(), bias.storage().read());
        match arrivals {
            Some(blocks) => {
                sx.matmul_bias_in_column_blocks(x.layout(), (&sw, wt.layout()), (&sb, bias.layout()), blocks)?
            }
            None => sx.matmul_bias(x.layout(), &sw, wt.layout(), &sb, bias.layout())?,
        }
    };
    let out = door.tensor(storage, Shape::from(out_dims.to_vec()));
    if !autograd::needs_grad(&[input, weight, bias]) {
        return Ok(out);
    }
    let (saved_x, saved_w) = (SavedTensor::new(op, input), SavedTensor::new(op, weight));
    let (bias_shape, in_dims) = (bias.shape().clone(), input.shape().clone());
    let rows = move |t: &Tensor, cols: usize| t.reshape(&[m as isize, cols as isize]);
    let out = door.record(op, &[input, weight, bias], out, move |g, needs| {
        let g = rows(g, n)?;
        let gx = if needs[0] {
            let w = saved_w.get()?;
            let gx = match autograd::take_activation() {
                // Note [Activation epilogues] in `autograd/engine.rs`: the gradient of the
                // GELU's input, straight from the product.
                Some((autograd::Activation::GeluTanh, aux)) => {
                    dgelu_product(op, &g, w, &rows(&aux, k)?, door)?
                }
                None => grad_product(op, &g, w, wide[0], door)?,
            };
            Some(gx.reshape(&in_dims)?)
        } else {
            None
        };
        let gw = if needs[1] {
            let (x, wt) = (rows(saved_x.get()?, k)?, saved_w.get()?.t()?);
            Some(
                if column_major(&wt) {
                    weight_grad(op, &g, &x, &wt, wide[1], door)?
                } else {
                    grad_product(op, &x.t()?, &g, wide[1], door)?
                }
                .t()?,
            )
        } else {
            None
        };
        let gb = if needs[2] {
            Some(sum_to_shape(&g, &bias_shape)?)
        } else {
            None
        };
        Ok(vec![gx, gw, gb])
    });
    autograd::mark_applies_activation(&out);
    Ok(out)
}

/// `(g @ w) · gelu_tanh'(aux)`: the gradient of a tanh-GELU's input `aux` (`[m, k]`) from the
/// product that is the gradient of its output, in one cuBLASLt call where the backend has the
/// DGELU epilogue, else the product and GELU's backward kernel (Note [Activation epilogues] in
/// `autograd/engine.rs`).
fn dgelu_product(op: &'static str, g: &Tensor, w: &Tensor, aux: &Tensor, door: Door) -> Result<Tensor> {
    let (m, k) = (g.dims()[0], w.dims()[1]);
    if !autograd::is_grad_enabled() && g.dtype() == w.dtype() && aux.dtype() == g.dtype() {
        let fused = {
            let (sg, sw, sa) = (g.storage().read(), w.storage().read(), aux.storage().read());
            sg.matmul_dgelu(g.layout(), &sw, w.layout(), (&sa, aux.layout()))?
        };
        if let Some(storage) = fused {
            return Ok(door.tensor(storage, Shape::from([m, k])));
        }
    }
    product(op, g, w, (g, w), door)?.gelu_tanh_backward(aux)
}

fn isize_dims(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

impl Tensor {
    /// Matrix product with `torch.matmul`'s rules: 1-D·1-D is a dot product (0-d), a 1-D
    /// operand gets a dim prepended (left) or appended (right) that is removed afterwards, and
    /// batch dims (all but the last two) broadcast.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::MATMUL, [self, other], |[a, b], door| {
            a.matmul_prepared(b, door)
        })
    }

    fn matmul_prepared(&self, other: &Tensor, door: Door) -> Result<Tensor> {
        const OP: &str = "matmul";
        check_operands(OP, self, other)?;
        let (ra, rb) = (self.rank(), other.rank());
        if ra == 0 || rb == 0 {
            return Err(Error::invalid(
                OP,
                format!("both arguments to matmul need to be at least 1D, but they are {ra}D and {rb}D"),
            ));
        }
        let k_b = if rb == 1 {
            other.dims()[0]
        } else {
            other.dims()[rb - 2]
        };
        if self.dims()[ra - 1] != k_b {
            return Err(inner_mismatch(OP, self, other));
        }
        let user = (self, other);
        match (ra, rb) {
            (1, 1) => product(OP, &self.unsqueeze(0)?, &other.unsqueeze(1)?, user, door)?.reshape(()),
            (2, 1) => product(OP, self, &other.unsqueeze(1)?, user, door)?.squeeze_dim(-1),
            (1, 2) => product(OP, &self.unsqueeze(0)?, other, user, door)?.squeeze_dim(0),
            (2, 2) => product(OP, self, other, user, door),
            (_, 2) => {
                // Fold the batch dims of `self` into its rows: one GEMM, and a weight gradient
                // that needs no reduction over a broadcast batch.
                let lead = &self.dims()[..ra - 1];
                let rows = lead.iter().product::<usize>() as isize;
                let a2 = self.reshape(&[rows, self.dims()[ra - 1] as isize])?;
                let out = product(OP, &a2, other, user, door)?;
                let mut dims = isize_dims(lead);
                dims.push(other.dims()[1] as isize);
                out.reshape(&dims)
            }
            _ => {
                let a = if ra == 1 { self.unsqueeze(0)? } else { self.clone() };
                let b = if rb == 1 {
                    other.unsqueeze(1)?
                } else {
                    other.clone()
                };
                let out = product(OP, &a, &b, user, door)?;
                match (ra, rb) {
                    (1, _) => out.squeeze_dim(-2),
                    (_, 1) => out.squeeze_dim(-1),
                    _ => Ok(out),
                }
            }
        }
    }

    /// Product of two matrices (`torch.mm`); no broadcasting.
    pub fn mm(&self, other: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::MM, [self, other], |[a, b], door| a.mm_prepared(b, door))
    }

    fn mm_prepared(&self, other: &Tensor, door: Door) -> Result<Tensor> {
        check_operands("mm", self, other)?;
        for (name, t) in [("self", self), ("mat2", other)] {
            if t.rank() != 2 {
                return Err(Error::invalid(
                    "mm",
                    format!(
                        "{name} must be a matrix, got a {}D tensor of shape {}",
                        t.rank(),
                        t.shape()
                    ),
                ));
            }
        }
        product("mm", self, other, (self, other), door)
    }

    /// Batched product of `[b, n, m]` and `[b, m, p]` (`torch.bmm`); batch sizes must be equal.
    pub fn bmm(&self, other: &Tensor) -> Result<Tensor> {
        dispatch::call_with(&policy::BMM, [self, other], |[a, b], door| {
            a.bmm_prepared(b, door)
        })
    }

    fn bmm_prepared(&self, other: &Tensor, door: Door) -> Result<Tensor> {
        check_operands("bmm", self, other)?;
        for (name, t) in [("batch1", self), ("batch2", other)] {
            if t.rank() != 3 {
                return Err(Error::invalid(
                    "bmm",
                    format!(
                        "{name} must be a 3D tensor, got a {}D tensor of shape {}",
                        t.rank(),
                        t.shape()
                    ),
                ));
            }
        }
        if self.dims()[0] != other.dims()[0] {
            return Err(Error::ShapeMismatch {
                op: "bmm",
                lhs: self.shape().clone(),
                rhs: other.shape().clone(),
                hint: "the batch sizes must be equal (bmm does not broadcast; use matmul)",
            });
        }
        product("bmm", self, other, (self, other), door)
    }

    /// `self @ weight.T + bias` (`F.linear`). With a 2-D weight and a bias of `[out_features]`
    /// (float dtypes), where PyTorch's `linear` uses `addmm` (a 2-D input, or a contiguous input
    /// and bias), the bias joins the product's accumulator and the sum rounds once; elsewhere
    /// the bias broadcasts and is added to the rounded product, as in PyTorch.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        // Fixed-size operand arrays: `linear` is on every MLP's hot path, and the list form
        // of the dispatch point allocates.
        match bias {
            Some(b) => dispatch::composite_kernel(&policy::LINEAR, [self, weight, b], |[x, w, b], door| {
                x.linear_prepared(w, Some(b), door)
            }),
            None => dispatch::composite_kernel(&policy::LINEAR, [self, weight], |[x, w], door| {
                x.linear_prepared(w, None, door)
            }),
        }
    }

    fn linear_prepared(&self, weight: &Tensor, bias: Option<&Tensor>, door: Door) -> Result<Tensor> {
        // A weight still arriving in row blocks is read here before any other op touches it
        // (an op on it would wait for the whole copy; Note [Copies in row blocks]).
        let mut arrivals = weight.storage().take_row_arrivals();
        let result = self.linear_checked(weight, bias, &mut arrivals, door);
        if let Some(blocks) = arrivals {
            // Not read block by block (an error, or another path): ordered after the whole.
            blocks.wait(weight.device())?;
        }
        result
    }

    fn linear_checked(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        arrivals: &mut Option<Arrivals>,
        door: Door,
    ) -> Result<Tensor> {
        const OP: &str = "linear";
        check_operands(OP, self, weight)?;
        if let Some(b) = bias {
            check_operands(OP, self, b)?;
        }
        if weight.rank() == 0 || weight.rank() > 2 || self.rank() == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected an input of at least 1 dim and a 1-D or 2-D weight, got input {} and weight {}",
                    self.shape(),
                    weight.shape()
                ),
            ));
        }
        let in_features = weight.dims()[weight.rank() - 1];
        if self.dims()[self.rank() - 1] != in_features {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().clone(),
                rhs: weight.shape().clone(),
                hint: "the input's last dim must equal weight's in_features (weight is [out_features, in_features])",
            });
        }
        if let Some(b) = bias {
            // ATen's `linear` takes `addmm` (one rounding) for a 2-D input, and for an input of
            // another rank when it and the bias are contiguous (it flattens the input's leading
            // dims); any other input is matmul then add, and rounds twice there too.
            let fused = weight.rank() == 2
                && b.dims() == [weight.dims()[0]]
                && self.dtype().is_floating_point()
                && (self.rank() == 2 || (self.is_contiguous() && b.is_contiguous()));
            if fused {
                return self.linear_with_bias(weight, b, arrivals, door);
            }
        }
        if let Some(blocks) = arrivals.take() {
            blocks.wait(weight.device())?;
        }
        if bias.is_none() && weight.rank() == 2 && self.dtype().is_floating_point() {
            // The input's leading dims fold into rows, as `matmul` does, here with the
            // operands' casts in sight (Note [Widened gradients]).
            let lead = &self.dims()[..self.rank() - 1];
            let rows = lead.iter().product::<usize>() as isize;
            let x = self.reshape(&[rows, weight.dims()[1] as isize])?;
            let wide = [widens(self), widens(weight)];
            let out = product_as(OP, &x, &weight.t()?, (self, weight), wide, door)?;
            let mut dims = isize_dims(lead);
            dims.push(weight.dims()[0] as isize);
            return out.reshape(&dims);
        }
        let out = self.matmul_prepared(&weight.t()?, door)?;
        match bias {
            Some(b) => {
                if !matches!(out.shape().broadcast(b.shape(), OP), Ok(s) if &s == out.shape()) {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: out.shape().clone(),
                        rhs: b.shape().clone(),
                        hint: "the bias must broadcast to the output's shape [.., out_features]",
                    });
                }
                out.add(b)
            }
            None => Ok(out),
        }
    }

    /// `linear` with a 2-D weight and a bias of `[out_features]` (checked by the caller): the
    /// input's leading dims fold into the rows of one product with a bias, whose sum rounds
    /// once, as PyTorch's `addmm` (Note [Bias epilogue] in `cuda_backend/blas.rs`).
    /// With `arrivals` (taken), the weight's rows are still arriving in those blocks.
    fn linear_with_bias(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        arrivals: &mut Option<Arrivals>,
        door: Door,
    ) -> Result<Tensor> {
        let lead = &self.dims()[..self.rank() - 1];
        let rows = lead.iter().product::<usize>() as isize;
        let (x, wt) = {
            let _views = autograd::no_grad();
            (self.reshape(&[rows, weight.dims()[1] as isize])?, weight.t()?)
        };
        let wide = [widens(self), widens(weight)];
        let mut dims = lead.to_vec();
        dims.push(weight.dims()[0]);
        let out = product_bias(
            "linear",
            (&x, self),
            (&wt, weight),
            bias,
            &dims,
            arrivals.as_ref(),
            wide,
            door,
        )?;
        // Every block was waited for on the way.
        *arrivals = None;
        Ok(out)
    }
}
