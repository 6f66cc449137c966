//! Elementwise ops over two tensors with broadcasting and type promotion: arithmetic,
//! comparisons, logical ops, `where`, `masked_fill`, `clamp`, and their scalar forms.
//!
//! Each op passes the dispatch point (`crate::dispatch`: device check, autocast, promotion,
//! observers, autograd) with its line of the op table; the kernel closures broadcast and call
//! the backend. Backward rules sit beside the forward and reduce gradients back to each input's
//! shape with `sum_to_shape` (broadcasting in reverse).

use crate::autograd::{self, SavedTensor};
use crate::backend::table::{binary_table, compare_table, logical_table};
use crate::dispatch::{self, policy, Promotion};
use crate::dtype::Scalar;
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

use crate::backend::op::UnaryOp;
pub use crate::backend::op::{BinaryOp, CmpOp, LogicalOp};

/// The device all operands share, or the mismatch error naming the first two that differ
/// (the dispatch point's check, for the helpers that take operands apart).
pub(crate) use crate::dispatch::check_devices as same_device;

/// Runs `f` on the storages of `a` and `b` with their layouts broadcast to a common shape.
fn with_broadcast<R>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&Storage, &Layout, &Storage, &Layout) -> Result<R>,
) -> Result<(Shape, R)> {
    // The dispatch point checked the devices.
    let shape = a.shape().broadcast(b.shape(), op)?;
    let al = a.layout().broadcast_as(&shape, op)?;
    let bl = b.layout().broadcast_as(&shape, op)?;
    // Reading the same storage twice is fine: both are shared read locks.
    let (sa, sb) = (a.storage().read(), b.storage().read());
    let r = f(&sa, &al, &sb, &bl)?;
    Ok((shape, r))
}

/// The dtype `op` computes in for operands of dtypes `a` and `b`.
pub(crate) fn result_dtype(op: BinaryOp, a: DType, b: DType) -> DType {
    let d = a.promote(b);
    match op.line().promotion {
        // True division and the like: integers compute as floats (the default float dtype).
        Promotion::CommonFloat if !d.is_floating_point() => DType::F32,
        _ => d,
    }
}

/// Reduces `g` to `shape` by summing the dims that broadcasting expanded.
pub(crate) fn sum_to_shape(g: &Tensor, shape: &Shape) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let lead = g.rank() - shape.rank();
    let mut dims: Vec<isize> = (0..lead as isize).collect();
    for (i, &d) in shape.dims().iter().enumerate() {
        if d == 1 && g.dims()[lead + i] != 1 {
            dims.push((lead + i) as isize);
        }
    }
    let summed = if dims.is_empty() {
        g.clone()
    } else {
        g.sum_dims(&dims, true)?
    };
    let dims: Vec<isize> = shape.dims().iter().map(|&d| d as isize).collect();
    summed.reshape(&dims)
}

/// `a op b` with broadcasting, promotion and autograd, through the dispatch point.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    dispatch::call(
        op.line(),
        [a, b],
        |[a, b], door| {
            let (shape, storage) =
                with_broadcast(op.name(), a, b, |sa, al, sb, bl| sa.binary(op, al, sb, bl))?;
            Ok(door.tensor(storage, shape))
        },
        |[a, b], out, _| {
            let saves = saves(op);
            let save = |t: &Tensor, when: bool| when.then(|| SavedTensor::new(op.name(), t));
            let saved = BinarySaved {
                a_like: (a.shape().clone(), a.dtype()),
                b_like: (b.shape().clone(), b.dtype()),
                a: save(a, saves != Saves::Nothing),
                b: save(b, saves != Saves::Nothing),
                out: save(out, saves == Saves::All),
            };
            Ok(move |g: &Tensor, needs: &[bool]| binary_backward(op, &saved, g, needs))
        },
    )
}

/// What the backward of a binary op keeps: the input shapes (to undo broadcasting) and dtypes,
/// and, for the ops whose derivative needs them, the inputs and (pow) the output.
struct BinarySaved {
    a_like: (Shape, DType),
    b_like: (Shape, DType),
    a: Option<SavedTensor>,
    b: Option<SavedTensor>,
    out: Option<SavedTensor>,
}

fn saved(s: &Option<SavedTensor>) -> Result<&Tensor> {
    s.as_ref()
        .ok_or_else(|| Error::Autograd("binary op backward: a needed tensor was not saved".into()))?
        .get()
}

/// What backward of a binary op keeps (the table's `saves` column).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Saves {
    Nothing,
    Operands,
    All,
}

/// The methods, `saves` and backward of each op: the binary table (`backend/table.rs`)
/// expanded in the op layer.
macro_rules! binary_ops {
    ($( ($v:ident, [$stem:ident $($scalar:ident $inplace:ident $inplace_scalar:ident)?], $cast:ident, $promote:ident, $ints:ident, $bools:ident, $saves:ident)
        |$g:ident, $a:ident, $b:ident, $out:ident| ($da:expr, $db:expr), $doc:literal; )*) => {
        impl Tensor {$(
            #[doc = $doc]
            pub fn $stem(&self, other: &Tensor) -> Result<Tensor> {
                binary(BinaryOp::$v, self, other)
            }
            $(
            #[doc = $doc]
            #[doc = " With a scalar operand, which does not widen the tensor's dtype."]
            pub fn $scalar(&self, other: impl Into<Scalar>) -> Result<Tensor> {
                binary_scalar(BinaryOp::$v, self, other.into())
            }

            #[doc = $doc]
            #[doc = " In place: written over `self` (other broadcast to its shape); returns `self`."]
            pub fn $inplace(&self, other: &Tensor) -> Result<Tensor> {
                self.binary_(BinaryOp::$v, other)
            }

            #[doc = $doc]
            #[doc = " In place, with a scalar operand; returns `self`."]
            pub fn $inplace_scalar(&self, other: impl Into<Scalar>) -> Result<Tensor> {
                self.binary_scalar_(BinaryOp::$v, other.into())
            }
            )?
        )*}

        fn saves(op: BinaryOp) -> Saves {
            match op {
                $(BinaryOp::$v => Saves::$saves,)*
            }
        }

        /// The gradients of `a op b` for the output gradient `g`: each computed only when its
        /// input needs one, and reduced to the input's shape.
        #[allow(unused_variables)]
        fn binary_backward(op: BinaryOp, s: &BinarySaved, g: &Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
            let (a, b, out) = (|| saved(&s.a), || saved(&s.b), || saved(&s.out));
            // Each gradient in its input's dtype: operands of a mixed pair (`CommonMixed`) keep
            // theirs, and the gradient computed in float32 is cast back, as the cast's would be.
            let grad = |i: usize, f: &dyn Fn() -> Result<Tensor>, (shape, dtype): &(Shape, DType)| -> Result<Option<Tensor>> {
                if !needs[i] {
                    return Ok(None);
                }
                let g = sum_to_shape(&f()?, shape)?;
                Ok(Some(if g.dtype() == *dtype { g } else { g.to_dtype(*dtype)? }))
            };
            Ok(match op {
                $(BinaryOp::$v => {
                    let ($g, $a, $b, $out) = (g, a, b, out);
                    vec![grad(0, &|| Ok($da), &s.a_like)?, grad(1, &|| Ok($db), &s.b_like)?]
                })*
            })
        }
    };
}
binary_table!(binary_ops);

/// The gradient of `a ** b` for `a`: `b · a^(b-1)`, with 0 where b == 0 (PyTorch's convention
/// for 0^0).
fn pow_grad_base(g: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let d = b.mul(&a.pow(&b.sub_scalar(1)?)?)?;
    g.mul(&d.masked_fill(&b.eq_scalar(0)?, 0.0)?)
}

/// The gradient of `a ** b` for `b`: `a^b · ln a`, with 0 where a == 0 and b >= 0.
fn pow_grad_exponent(g: &Tensor, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<Tensor> {
    let d = out.mul(&a.log()?)?;
    let zero = a.eq_scalar(0)?.logical_and(&b.ge_scalar(0)?)?;
    g.mul(&d.masked_fill(&zero, 0.0)?)
}

/// The gradient of maximum (`max`) or minimum for its operand `x` against the other, `y`: `g`
/// where `x` is selected, half of it on ties, 0 elsewhere.
fn select_grad(g: &Tensor, x: &Tensor, y: &Tensor, max: bool) -> Result<Tensor> {
    let wins = if max { x.gt(y)? } else { x.lt(y)? };
    let share = Tensor::where_cond(&x.eq(y)?, &g.mul_scalar(0.5)?, &g.zeros_like()?)?;
    Tensor::where_cond(&wins, g, &share)
}

/// The gradient of `gelu_backward(a, b)` (or the tanh form's) for `b`: `g · a · gelu''(b)`,
/// composed of elementwise ops (a second derivative is off the hot path).
///   erf:  gelu''(b) = φ(b) (2 - b²),  φ(b) = e^(-b²/2) / √(2π)
///   tanh: with u' = k(1 + 3κb²), t = tanh(k(b + κb³)):  gelu''(b) = (1 - t²)(u' - b t u'² + 3kκb²)
fn gelu_second(g: &Tensor, a: &Tensor, b: &Tensor, tanh: bool) -> Result<Tensor> {
    use std::f64::consts::PI;
    let b2 = b.square()?;
    let second = if tanh {
        let (k, kappa) = ((2.0 / PI).sqrt(), crate::backend::op::GELU_TANH_KAPPA);
        let t = b2
            .mul_scalar(kappa)?
            .add_scalar(1.0)?
            .mul(b)?
            .mul_scalar(k)?
            .tanh()?;
        let du = b2.mul_scalar(3.0 * kappa * k)?.add_scalar(k)?;
        let inner = du
            .sub(&b.mul(&t)?.mul(&du.square()?)?)?
            .add(&b2.mul_scalar(3.0 * k * kappa)?)?;
        t.square()?.neg()?.add_scalar(1.0)?.mul(&inner)?
    } else {
        let pdf = b2.mul_scalar(-0.5)?.exp()?.mul_scalar(1.0 / (2.0 * PI).sqrt())?;
        pdf.mul(&b2.neg()?.add_scalar(2.0)?)?
    };
    g.mul(a)?.mul(&second)
}

/// A 0-d tensor of `value` in the dtype `t op value` computes in, on `t`'s device.
fn scalar_operand(t: &Tensor, value: Scalar) -> Result<Tensor> {
    let dtype = t.dtype().promote_with_scalar(value.kind());
    Tensor::scalar(value.to_f64(), dtype, t.device())
}

/// `t op value` for the `*_scalar` methods. A floating-point result of `+ - * /` is one
/// unary kernel with the scalar as its argument, rounded once to the compute type, as PyTorch
/// computes a tensor with a Python number: `bf16 * 0.1` multiplies by float32 0.1, not by
/// 0.1 rounded to bfloat16 first, and no device tensor is made for the scalar (a launch and an
/// allocation saved). Other ops (pow, maximum, minimum) and integer results take the tensor
/// path.
pub(crate) fn binary_scalar(op: BinaryOp, t: &Tensor, value: Scalar) -> Result<Tensor> {
    let v = value.to_f64();
    if op == BinaryOp::Pow
        && v < 0.0
        && matches!(
            t.dtype().promote_with_scalar(value.kind()),
            DType::I64 | DType::I32
        )
    {
        // The exponent is on the host: refuse it here, at once on every device, rather than
        // through the device's deferred check (Note [Deferred device errors]).
        return Err(Error::invalid(
            "pow",
            "integers to negative integer powers are not allowed",
        ));
    }
    match scalar_unary(op, t.dtype(), value) {
        Some((unary, dtype)) => super::unary::unary(unary, &t.to_dtype(dtype)?),
        None => binary(op, t, &scalar_operand(t, value)?),
    }
}

/// The unary op (with the scalar as its argument) and its dtype that compute `t op value` for
/// a `t` of `dtype`: the floating-point results of `+ - * /`; None for the others, which take
/// the tensor path.
pub(crate) fn scalar_unary(op: BinaryOp, dtype: DType, value: Scalar) -> Option<(UnaryOp, DType)> {
    let v = value.to_f64();
    let unary = match op {
        BinaryOp::Add => UnaryOp::AddScalar { value: v },
        BinaryOp::Sub => UnaryOp::SubScalar { value: v },
        BinaryOp::Mul => UnaryOp::MulScalar { value: v },
        BinaryOp::Div => UnaryOp::DivScalar { value: v },
        _ => return None,
    };
    let out = result_dtype(op, dtype, dtype.promote_with_scalar(value.kind()));
    out.is_floating_point().then_some((unary, out))
}

fn compare(op: CmpOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    dispatch::call_with(op.line(), [a, b], |[a, b], door| {
        let (shape, storage) = with_broadcast(op.name(), a, b, |sa, al, sb, bl| sa.compare(op, al, sb, bl))?;
        Ok(door.tensor(storage, shape))
    })
}

fn logical(op: LogicalOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    dispatch::call_with(op.line(), [a, b], |[a, b], door| {
        let (a, b) = (a.to_dtype(DType::Bool)?, b.to_dtype(DType::Bool)?);
        let (shape, storage) =
            with_broadcast(op.name(), &a, &b, |sa, al, sb, bl| sa.logical(op, al, sb, bl))?;
        Ok(door.tensor(storage, shape))
    })
}

impl Tensor {
    /// `self op other` written into `out` (`torch.add(a, b, out=out)`): `out` must be
    /// contiguous with the broadcast shape and the result dtype; no new memory is allocated on
    /// the GPU. Not differentiable, as in PyTorch.
    pub fn binary_out(&self, op: BinaryOp, other: &Tensor, out: &Tensor) -> Result<Tensor> {
        // The operands pass the dispatch point (device check, autocast, promotion, observers)
        // as the plain op's do; `out` is checked against the result here.
        dispatch::call_with(op.line(), [self, other], |[a, b], _| {
            binary_into_out(op, a, b, out)
        })
    }
}

/// `a op b` (prepared by the dispatch point) written into `out`; see [`Tensor::binary_out`].
fn binary_into_out(op: BinaryOp, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<Tensor> {
    let name = op.name();
    let dtype = result_dtype(op, a.dtype(), b.dtype());
    if autograd::needs_grad(&[a, b, out]) {
        return Err(Error::invalid(
            name,
            "out= forms don't support automatic differentiation; call it under no_grad or use the plain op",
        ));
    }
    same_device(name, &[a, b, out])?;
    if out.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op: name,
            expected: dtype,
            found: out.dtype(),
        });
    }
    let shape = a.shape().broadcast(b.shape(), name)?;
    if out.shape() != &shape || !out.is_contiguous() {
        return Err(Error::ShapeMismatch {
            op: name,
            lhs: shape,
            rhs: out.shape().clone(),
            hint: "out must be contiguous with the broadcast shape of the operands",
        });
    }
    let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
    if out.shares_storage_with(&a) || out.shares_storage_with(&b) || out.device() == Device::Cpu {
        // Aliased operands (or the CPU, whose kernels return new buffers) go through a
        // temporary: a storage cannot be locked for reading and writing at once.
        // The kernel alone: the dispatch point was passed once, for the whole `out=` op.
        let (shape, r) = with_broadcast(name, &a, &b, |sa, al, sb, bl| sa.binary(op, al, sb, bl))?;
        out.storage()
            .write()
            .copy_strided_from(out.layout(), &r, &Layout::contiguous(shape))?;
        return Ok(out.clone());
    }
    let al = a.layout().broadcast_as(&shape, name)?;
    let bl = b.layout().broadcast_as(&shape, name)?;
    let (sa, sb) = (a.storage().read(), b.storage().read());
    sa.binary_into(op, &al, &sb, &bl, &mut out.storage().write(), out.layout())?;
    Ok(out.clone())
}

impl Tensor {
    /// `self + other` written into `out` (`torch.add(a, b, out=out)`); see [`Tensor::binary_out`].
    pub fn add_out(&self, other: &Tensor, out: &Tensor) -> Result<Tensor> {
        self.binary_out(BinaryOp::Add, other, out)
    }

    /// `self * other` written into `out`; see [`Tensor::binary_out`].
    pub fn mul_out(&self, other: &Tensor, out: &Tensor) -> Result<Tensor> {
        self.binary_out(BinaryOp::Mul, other, out)
    }
}

macro_rules! compare_methods {
    ($( ($v:ident, $stem:ident, $scalar:ident); )*) => {
        impl Tensor {$(
            #[doc = concat!("Elementwise `", stringify!($stem), "` comparison, giving a bool tensor.")]
            pub fn $stem(&self, other: &Tensor) -> Result<Tensor> {
                compare(CmpOp::$v, self, other)
            }

            #[doc = concat!("Elementwise `", stringify!($stem), "` comparison with a scalar, giving a bool tensor.")]
            pub fn $scalar(&self, other: impl Into<Scalar>) -> Result<Tensor> {
                compare(CmpOp::$v, self, &scalar_operand(self, other.into())?)
            }
        )*}
    };
}
compare_table!(compare_methods);

macro_rules! logical_methods {
    ($( ($v:ident, $stem:ident, $short:ident); )*) => {
        impl Tensor {$(
            #[doc = concat!("Elementwise `", stringify!($stem), "` of two tensors taken as bool (nonzero is true).")]
            pub fn $stem(&self, other: &Tensor) -> Result<Tensor> {
                logical(LogicalOp::$v, self, other)
            }
        )*}
    };
}
logical_table!(logical_methods);

impl Tensor {
    /// Elementwise `!self` (nonzero is true).
    pub fn logical_not(&self) -> Result<Tensor> {
        dispatch::named(&policy::LOGICAL_NOT, &[self], || {
            self.to_dtype(DType::Bool)?.eq_scalar(false)
        })
    }

    /// `cond ? a : b` elementwise with broadcasting (`torch.where(cond, a, b)`).
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        dispatch::call(
            &policy::WHERE,
            [cond, a, b],
            |[cond, a, b], door| {
                if cond.dtype() != DType::Bool {
                    return Err(Error::UnsupportedDType {
                        op: "where",
                        dtype: cond.dtype(),
                        hint: "the condition must be a bool tensor; compare first, e.g. x.gt_scalar(0)",
                    });
                }
                let shape = cond
                    .shape()
                    .broadcast(a.shape(), "where")?
                    .broadcast(b.shape(), "where")?;
                let cl = cond.layout().broadcast_as(&shape, "where")?;
                let al = a.layout().broadcast_as(&shape, "where")?;
                let bl = b.layout().broadcast_as(&shape, "where")?;
                let storage = {
                    let (sc, sa, sb) = (cond.storage().read(), a.storage().read(), b.storage().read());
                    sc.where_cond(&cl, &sa, &al, &sb, &bl)?
                };
                Ok(door.tensor(storage, shape))
            },
            |[cond, a, b], _, _| {
                let (sa, sb) = (a.shape().clone(), b.shape().clone());
                let c = SavedTensor::new("where", cond);
                Ok(move |g: &Tensor, needs: &[bool]| {
                    let c = c.get()?;
                    // One zero, broadcast by the select (no zeros tensor to fill and read).
                    let zero = Tensor::scalar(0.0, g.dtype(), g.device())?;
                    let ga = if needs[1] {
                        Some(sum_to_shape(&Tensor::where_cond(c, g, &zero)?, &sa)?)
                    } else {
                        None
                    };
                    let gb = if needs[2] {
                        Some(sum_to_shape(&Tensor::where_cond(c, &zero, g)?, &sb)?)
                    } else {
                        None
                    };
                    Ok(vec![None, ga, gb])
                })
            },
        )
    }

    /// `value` where `mask` is true, `self` elsewhere (`masked_fill`).
    pub fn masked_fill(&self, mask: &Tensor, value: impl Into<Scalar>) -> Result<Tensor> {
        let value = value.into().to_f64();
        dispatch::named(&policy::MASKED_FILL, &[self, mask], || {
            self.masked_fill_composite(mask, value)
        })
    }

    fn masked_fill_composite(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let v = Tensor::scalar(value, self.dtype(), self.device())?;
        let out = Tensor::where_cond(mask, &v, self)?;
        if out.shape() != self.shape() {
            return Err(Error::ShapeMismatch {
                op: "masked_fill",
                lhs: self.shape().clone(),
                rhs: mask.shape().clone(),
                hint: "the mask must broadcast to the tensor's shape",
            });
        }
        Ok(out)
    }

    /// Values limited to `[min, max]`; either bound may be `None` (`clamp`). The gradient
    /// passes where `min <= x <= max`.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        if min.is_none() && max.is_none() {
            return Err(Error::invalid(
                "clamp",
                "at least one of min and max must be given",
            ));
        }
        dispatch::call(
            &policy::CLAMP,
            [self],
            |[x], _| {
                let _g = autograd::no_grad();
                let mut out = x.clone();
                if let Some(lo) = min {
                    out = out.maximum_scalar(lo)?;
                }
                if let Some(hi) = max {
                    out = out.minimum_scalar(hi)?;
                }
                Ok(out)
            },
            |[x], _, _| {
                let x = SavedTensor::new("clamp", x);
                Ok(move |g: &Tensor, _: &[bool]| {
                    let x = x.get()?;
                    // The gradient passes where every given bound holds (NaN inputs get none).
                    let pass = match (min, max) {
                        (Some(lo), Some(hi)) => x.ge_scalar(lo)?.logical_and(&x.le_scalar(hi)?)?,
                        (Some(lo), None) => x.ge_scalar(lo)?,
                        (None, Some(hi)) => x.le_scalar(hi)?,
                        (None, None) => unreachable!("clamp checks that a bound is given"),
                    };
                    Ok(vec![Some(Tensor::where_cond(&pass, g, &g.zeros_like()?)?)])
                })
            },
        )
    }

    /// `clamp(min=value)`.
    pub fn clamp_min(&self, min: f64) -> Result<Tensor> {
        dispatch::named(&policy::CLAMP_MIN, &[self], || self.clamp(Some(min), None))
    }

    /// `clamp(max=value)`.
    pub fn clamp_max(&self, max: f64) -> Result<Tensor> {
        dispatch::named(&policy::CLAMP_MAX, &[self], || self.clamp(None, Some(max)))
    }
}
