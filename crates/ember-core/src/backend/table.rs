//! The op table of the elementwise families: one line per op, read by every layer. PyTorch's
//! `native_functions.yaml` is the model: a line holds what is true of the op everywhere (its
//! name, autocast and promotion policy, dtype rule, what backward saves and the backward rule
//! itself), and each layer expands the table into its own code:
//!
//! - `backend/op.rs`: the op enums ([`UnaryOp`](super::op::UnaryOp), ...), their names and
//!   kernel names (`unary_<stem>`, `binary_<stem>`, ...: derived from the op's name, never an
//!   integer code) and their dtype rules;
//! - `dispatch/policy.rs`: the op's policy line (autocast, promotion), part of `policy::ALL`;
//! - `ops/unary.rs`, `ops/binary.rs`: the `Tensor` methods and the backward rules;
//! - `cuda_backend/kernel_units.rs`: the compile units (one kernel per op and dtype).
//!
//! What the table cannot say is written once per backend: the CPU formula (a match arm in
//! `cpu/unary.rs` or `cpu/binary.rs`) and the CUDA expression (a line of `kernels/unary.cu` or
//! `kernels/elementwise.cu`, found by the kernel name). Adding an op is its line here, its CPU
//! formula and its CUDA expression; CI's NVRTC compile checks that every kernel the table names
//! is in the source, and the CPU match is exhaustive.
//!
//! Each table is a macro that hands its lines to the macro named by its caller (the X-macro
//! pattern): `unary_table!(expand)` calls `expand! { lines }`. Rules are Rust tokens that only
//! the op layer compiles; names in them resolve where the table is expanded (`ops/<family>.rs`).

/// The unary family: math functions and activations of one operand. A line is
///
/// `(Variant [{ fields }] [[kernel parameters]], stem [as BinaryOp], autocast, ints, saves)
///  |g, s| backward, "doc";`
///
/// - `stem`: PyTorch's name, the kernel's name (`unary_<stem>_<dtype>`) and, for an op without
///   fields, the `Tensor` method's. `as Add` marks the scalar forms of a binary op: PyTorch
///   names them as the binary op, whose policy line they share.
/// - kernel parameters: up to three `f64`s the CUDA kernel gets as `c0..c2` (rounded once to
///   the compute type), computed from the fields.
/// - autocast: PyTorch's policy (`CastPolicy`); one operand needs no promotion.
/// - ints (Note [Unary dtypes] in `ops/unary.rs`): `Float` computes integer and bool inputs in
///   float32; `Int` keeps integer dtypes (wrapping kernels); `Whole` keeps them as a copy (the
///   rounding ops).
/// - saves: what backward reads, `Input`, `Output` or `Nothing`; `s()` returns it.
/// - backward: `g` is the output's gradient; the value is the input's gradient; a third name,
///   where given, binds the op's `dispatch::Door` (a rule that runs a kernel itself).
macro_rules! unary_table {
    ($expand:ident) => {
        $expand! {
            (Neg, neg, Inputs, Int, Nothing) |g, s| g.neg()?,
                "Elementwise `-x` (integers wrap; an error for bool).";
            (Abs, abs, Inputs, Int, Input) |g, s| g.mul(&s()?.sign()?)?,
                "Elementwise `|x|`.";
            (Sign, sign, Inputs, Int, Nothing) |g, s| g.zeros_like()?,
                "Elementwise sign: -1, 0 or 1 (0 for NaN, as PyTorch).";
            (Square, square, Inputs, Int, Input) |g, s| g.mul(s()?)?.mul_scalar(2.0)?,
                "Elementwise `x²` (bool gives int64).";
            // y = 1/x: dy/dx = -y².
            (Reciprocal, reciprocal, Fp32, Float, Output) |g, s| g.mul(&s()?.square()?)?.neg()?,
                "Elementwise `1 / x` (integers compute in float32).";
            (Sqrt, sqrt, Inputs, Float, Output) |g, s| g.div(&s()?.mul_scalar(2.0)?)?,
                "Elementwise square root.";
            // y = x^(-1/2): dy/dx = -y³/2.
            (Rsqrt, rsqrt, Fp32, Float, Output) |g, s| g.mul(&s()?.square()?.mul(s()?)?)?.mul_scalar(-0.5)?,
                "Elementwise `1 / √x`.";
            (Exp, exp, Fp32, Float, Output) |g, s| g.mul(s()?)?,
                "Elementwise `eˣ`.";
            (Exp2, exp2, Inputs, Float, Output) |g, s| g.mul(s()?)?.mul_scalar(LN_2)?,
                "Elementwise `2ˣ`.";
            (Expm1, expm1, Fp32, Float, Output) |g, s| g.mul(&s()?.add_scalar(1.0)?)?,
                "Elementwise `eˣ - 1`, accurate near 0.";
            (Log, log, Fp32, Float, Input) |g, s| g.div(s()?)?,
                "Elementwise natural logarithm.";
            (Log2, log2, Fp32, Float, Input) |g, s| g.div(&s()?.mul_scalar(LN_2)?)?,
                "Elementwise base-2 logarithm.";
            (Log10, log10, Fp32, Float, Input) |g, s| g.div(&s()?.mul_scalar(LN_10)?)?,
                "Elementwise base-10 logarithm.";
            (Log1p, log1p, Fp32, Float, Input) |g, s| g.div(&s()?.add_scalar(1.0)?)?,
                "Elementwise `ln(1 + x)`, accurate near 0.";
            (Sin, sin, Inputs, Float, Input) |g, s| g.mul(&s()?.cos()?)?,
                "Elementwise sine.";
            (Cos, cos, Inputs, Float, Input) |g, s| g.mul(&s()?.sin()?)?.neg()?,
                "Elementwise cosine.";
            (Tan, tan, Fp32, Float, Output) |g, s| g.mul(&s()?.square()?.add_scalar(1.0)?)?,
                "Elementwise tangent.";
            (Asin, asin, Fp32, Float, Input) |g, s| g.div(&one_minus_square_sqrt(s()?)?)?,
                "Elementwise arcsine.";
            (Acos, acos, Fp32, Float, Input) |g, s| g.div(&one_minus_square_sqrt(s()?)?)?.neg()?,
                "Elementwise arccosine.";
            (Atan, atan, Inputs, Float, Input) |g, s| g.div(&s()?.square()?.add_scalar(1.0)?)?,
                "Elementwise arctangent.";
            (Sinh, sinh, Fp32, Float, Input) |g, s| g.mul(&s()?.cosh()?)?,
                "Elementwise hyperbolic sine.";
            (Cosh, cosh, Fp32, Float, Input) |g, s| g.mul(&s()?.sinh()?)?,
                "Elementwise hyperbolic cosine.";
            (Tanh, tanh, Inputs, Float, Output) |g, s| g.mul(&s()?.square()?.neg()?.add_scalar(1.0)?)?,
                "Elementwise hyperbolic tangent.";
            (Erf, erf, Inputs, Float, Input)
                |g, s| g.mul(&s()?.square()?.neg()?.exp()?)?.mul_scalar(FRAC_2_SQRT_PI)?,
                "Elementwise Gauss error function.";
            (Erfc, erfc, Inputs, Float, Input)
                |g, s| g.mul(&s()?.square()?.neg()?.exp()?)?.mul_scalar(-FRAC_2_SQRT_PI)?,
                "Elementwise complementary error function `1 - erf(x)`.";
            // y = erfinv(x): dy/dx = √π/2 · e^(y²).
            (Erfinv, erfinv, Fp32, Float, Output)
                |g, s| g.mul(&s()?.square()?.exp()?)?.mul_scalar(PI.sqrt() / 2.0)?,
                "Elementwise inverse error function: `erf(erfinv(x)) = x` on (-1, 1), ±inf at ±1, NaN outside.";
            (Floor, floor, Inputs, Whole, Nothing) |g, s| g.zeros_like()?,
                "Elementwise floor (integers: a copy).";
            (Ceil, ceil, Inputs, Whole, Nothing) |g, s| g.zeros_like()?,
                "Elementwise ceiling (integers: a copy).";
            (Round, round, Inputs, Whole, Nothing) |g, s| g.zeros_like()?,
                "Elementwise rounding, half to even as `torch.round` (integers: a copy).";
            (Trunc, trunc, Inputs, Whole, Nothing) |g, s| g.zeros_like()?,
                "Elementwise rounding toward zero (integers: a copy).";
            (Sigmoid, sigmoid, Inputs, Float, Output)
                |g, s| { let y = s()?; g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)? },
                "Elementwise logistic `1 / (1 + e⁻ˣ)`.";
            // d/dx log σ(x) = σ(-x).
            (LogSigmoid, logsigmoid, Inputs, Float, Input) |g, s| g.mul(&s()?.neg()?.sigmoid()?)?,
                "Elementwise `log σ(x)`, computed stably (`F.logsigmoid`).";
            // Saves the output: y > 0 exactly where x > 0 (PyTorch's threshold_backward).
            (Relu, relu, Inputs, Int, Output) |g, s, door| relu_backward(g, s()?, door)?,
                "Elementwise `max(x, 0)` (NaN propagates; an error for bool).";
            (LeakyRelu { negative_slope } [negative_slope], leaky_relu, Inputs, Float, Input)
                |g, s| Tensor::where_cond(&s()?.gt_scalar(0.0)?, g, &g.mul_scalar(negative_slope)?)?,
                "`x > 0 ? x : negative_slope · x`.";
            // The CPU rounds `alpha * scale` (computed in f64) to the compute type once: the
            // kernel gets the same product.
            (Elu { alpha, scale, input_scale } [alpha * scale, scale, input_scale], elu, Inputs, Float, Input)
                |g, s| elu_backward(g, s()?, alpha, scale, input_scale)?,
                "`x > 0 ? scale · x : scale · alpha · (e^(input_scale · x) - 1)` (ELU, SELU, CELU).";
            (Hardtanh { min, max } [min, max], hardtanh, Inputs, Float, Input)
                |g, s| { let x = s()?; pass_inside(g, &x.gt_scalar(min)?.logical_and(&x.lt_scalar(max)?)?)? },
                "`x` clamped to `[min, max]` (hardtanh, relu6).";
            (Hardsigmoid, hardsigmoid, Inputs, Float, Input)
                |g, s| {
                    let x = s()?;
                    pass_inside(&g.mul_scalar(1.0 / 6.0)?, &x.gt_scalar(-3.0)?.logical_and(&x.lt_scalar(3.0)?)?)?
                },
                "Elementwise `clamp(x / 6 + 1/2, 0, 1)`.";
            (Hardswish, hardswish, Inputs, Float, Input) |g, s| hardswish_backward(g, s()?)?,
                "Elementwise `x · hardsigmoid(x)`.";
            (Gelu, gelu, Inputs, Float, Input) |g, s| gelu_backward(g, s()?)?,
                "Elementwise GELU `x Φ(x)` with the exact normal CDF (PyTorch's default).";
            (GeluTanh, gelu_tanh, Inputs, Float, Input) |g, s| gelu_tanh_backward(g, s()?)?,
                "Elementwise GELU, tanh approximation (`approximate='tanh'`).";
            // σ(x) (1 + x (1 - σ(x))).
            (Silu, silu, Inputs, Float, Input)
                |g, s| {
                    let (x, sig) = (s()?, s()?.sigmoid()?);
                    g.mul(&sig.mul(&x.mul(&sig.neg()?.add_scalar(1.0)?)?.add_scalar(1.0)?)?)?
                },
                "Elementwise SiLU (swish) `x σ(x)`.";
            // tanh(sp) + x σ(x) (1 - tanh²(sp)), sp = log(1 + eˣ).
            (Mish, mish, Inputs, Float, Input)
                |g, s| {
                    let x = s()?;
                    let t = x.softplus_with(1.0, f64::INFINITY)?.tanh()?;
                    g.mul(&t.add(&x.mul(&x.sigmoid()?)?.mul(&t.square()?.neg()?.add_scalar(1.0)?)?)?)?
                },
                "Elementwise Mish `x tanh(softplus(x))`.";
            (Softplus { beta, threshold } [beta, threshold], softplus, Fp32, Float, Input)
                |g, s| {
                    let bx = s()?.mul_scalar(beta)?;
                    Tensor::where_cond(&bx.gt_scalar(threshold)?, g, &g.mul(&bx.sigmoid()?)?)?
                },
                "`βx > threshold ? x : log(1 + e^(βx)) / β`.";
            // 1 / (1 + |x|)².
            (Softsign, softsign, Inputs, Float, Input) |g, s| g.div(&s()?.abs()?.add_scalar(1.0)?.square()?)?,
                "Elementwise `x / (1 + |x|)`.";
            // The scalar forms of `+ - * /` on a float tensor: the scalar is rounded once to the
            // compute type (float32 for half dtypes), as PyTorch computes a tensor with a Python
            // number: never rounded to the tensor's half dtype first.
            (AddScalar { value } [value], add_scalar as Add, Inputs, Float, Nothing) |g, s| g.clone(),
                "`x + value` for a float tensor and a scalar.";
            (SubScalar { value } [value], sub_scalar as Sub, Inputs, Float, Nothing) |g, s| g.clone(),
                "`x - value` for a float tensor and a scalar.";
            (MulScalar { value } [value], mul_scalar as Mul, Inputs, Float, Nothing) |g, s| g.mul_scalar(value)?,
                "`x * value` for a float tensor and a scalar.";
            (DivScalar { value } [value], div_scalar as Div, Inputs, Float, Nothing) |g, s| g.div_scalar(value)?,
                "`x / value` for a float tensor and a scalar.";
        }
    };
}
pub(crate) use unary_table;

/// The binary arithmetic family: two operands of one dtype after promotion (or, promoted with
/// `CommonMixed`, a float32 and a half operand on CUDA: `binary_<stem>_<a>_<b>` kernels, Note
/// [Mixed operands] in `kernels/elementwise.cu`). A line is
///
/// `(Variant, [stem scalar stem_ scalar_], autocast, promotion, ints, bools, saves)
///  |g, a, b, out| (grad of a, grad of b), "doc";`
///
/// - `stem`: PyTorch's name, the kernel's (`binary_<stem>_<dtype>`) and the `Tensor` method's;
///   the scalar method takes a number as the other operand; `stem_` and `scalar_` are the
///   in-place forms (`add_`, PyTorch's name of the in-place op too). A line with the stem alone
///   (`[gelu_backward]`) has no scalar or in-place forms.
/// - ints: `Int` has integer kernels; `Float` never sees integers (its promotion,
///   `CommonFloat`, computes them in float32).
/// - bools: `Or` or `And` is the op on bool operands; `No` refuses them.
/// - saves: `Nothing`, `Operands` (`a()`, `b()`) or `All` (and `out()`).
/// - backward: each gradient is computed only when its input needs one, then summed back to
///   the input's shape (broadcasting in reverse).
macro_rules! binary_table {
    ($expand:ident) => {
        $expand! {
            (Add, [add add_scalar add_ add_scalar_], Inputs, CommonMixed, Int, Or, Nothing)
                |g, a, b, out| (g.clone(), g.clone()),
                "Elementwise `self + other` with broadcasting.";
            (Sub, [sub sub_scalar sub_ sub_scalar_], Inputs, CommonMixed, Int, No, Nothing)
                |g, a, b, out| (g.clone(), g.neg()?),
                "Elementwise `self - other` with broadcasting.";
            (Mul, [mul mul_scalar mul_ mul_scalar_], Inputs, CommonMixed, Int, And, Operands)
                |g, a, b, out| (g.mul(b()?)?, g.mul(a()?)?),
                "Elementwise `self * other` with broadcasting.";
            // d(a/b)/db = -a / b².
            (Div, [div div_scalar div_ div_scalar_], Inputs, CommonFloat, Float, No, Operands)
                |g, a, b, out| (g.div(b()?)?, g.mul(a()?)?.div(&b()?.mul(b()?)?)?.neg()?),
                "Elementwise true division `self / other` (integers divide as floats).";
            (Pow, [pow pow_scalar pow_ pow_scalar_], Fp32, Common, Int, No, All)
                |g, a, b, out| (pow_grad_base(g, a()?, b()?)?, pow_grad_exponent(g, a()?, b()?, out()?)?),
                "Elementwise `self ** other`.";
            (Maximum, [maximum maximum_scalar maximum_ maximum_scalar_], Inputs, Common, Int, Or, Operands)
                |g, a, b, out| (select_grad(g, a()?, b()?, true)?, select_grad(g, b()?, a()?, true)?),
                "Elementwise maximum (NaN propagates); the gradient goes to the larger, halved on ties.";
            (Minimum, [minimum minimum_scalar minimum_ minimum_scalar_], Inputs, Common, Int, And, Operands)
                |g, a, b, out| (select_grad(g, a()?, b()?, false)?, select_grad(g, b()?, a()?, false)?),
                "Elementwise minimum (NaN propagates); the gradient goes to the smaller, halved on ties.";
            // d/da = log b where a != 0 (0 elsewhere, as PyTorch's `xlogy(a != 0, b)`); d/db = a / b.
            (Xlogy, [xlogy xlogy_scalar xlogy_ xlogy_scalar_], Inputs, CommonFloat, Float, No, Operands)
                |g, a, b, out| (g.mul(&a()?.ne_scalar(0.0)?.to_dtype(g.dtype())?.xlogy(b()?)?)?, g.mul(a()?)?.div(b()?)?),
                "Elementwise `self · log(other)`, 0 where `self` is 0 (NaN `other` gives NaN), as `torch.xlogy`.";
            // GELU's backward as one kernel (PyTorch's `gelu_backward(grad_output, self,
            // approximate)`): the output gradient `a` times GELU's derivative at its input `b`,
            // computed in fp32 (f64 for f64) and rounded once, where the composite took ~19
            // kernels each rounding to the tensor's dtype. No scalar or in-place forms. Its own
            // gradient: d/da = gelu'(b), d/db = a · gelu''(b).
            (GeluBackward, [gelu_backward], Inputs, CommonFloat, Float, No, Operands)
                |g, a, b, out| (g.gelu_backward(b()?)?, gelu_second(g, a()?, b()?, false)?),
                "GELU's input gradient (exact form) from the output gradient `self` and GELU's input `other`.";
            (GeluTanhBackward, [gelu_tanh_backward], Inputs, CommonFloat, Float, No, Operands)
                |g, a, b, out| (g.gelu_tanh_backward(b()?)?, gelu_second(g, a()?, b()?, true)?),
                "GELU's input gradient (tanh approximation) from the output gradient `self` and GELU's input `other`.";
        }
    };
}
pub(crate) use binary_table;

/// The comparisons: `(Variant, stem, scalar method)`; bool results, no gradient; kernels
/// `compare_<stem>_<dtype>`.
macro_rules! compare_table {
    ($expand:ident) => {
        $expand! {
            (Eq, eq, eq_scalar);
            (Ne, ne, ne_scalar);
            (Lt, lt, lt_scalar);
            (Le, le, le_scalar);
            (Gt, gt, gt_scalar);
            (Ge, ge, ge_scalar);
        }
    };
}
pub(crate) use compare_table;

/// The logical ops of two bool tensors (other dtypes are converted with `!= 0` first):
/// `(Variant, stem)`; no gradient; kernels `logical_<stem>` (the stem without `logical_`).
macro_rules! logical_table {
    ($expand:ident) => {
        $expand! {
            (And, logical_and, and);
            (Or, logical_or, or);
            (Xor, logical_xor, xor);
        }
    };
}
pub(crate) use logical_table;
