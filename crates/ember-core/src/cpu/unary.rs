//! CPU kernels of the unary family.
//!
//! Each op is one monomorphized loop over a slice (the op is matched once, outside the loop);
//! [`run_chunked`] feeds it contiguous chunks, in parallel with rayon above `PAR_THRESHOLD`
//! elements, gathering a strided input first. The loop is passed as `&dyn Fn` per chunk, so the
//! rayon machinery is instantiated once per (input, output) type pair rather than once per op.
//!
//! Float math runs in [`Real`]: f64 for f64 tensors, f32 for everything else (f16 and bf16 load
//! into f32 and round once on store; integer and bool inputs of float ops convert straight to
//! f32, see Note [Unary dtypes] in `ops/unary.rs`). `erf`/`erfc` come from `libm` (fdlibm's
//! rational approximations, under 1 ulp in f64).

use super::{gather_strided, CpuElement, CpuStorage, PAR_THRESHOLD};
use crate::backend::op::{Ints, UnaryOp, GELU_TANH_KAPPA};
use crate::backend::{BackendStorage, UnaryOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Element, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::f64::consts::{FRAC_1_SQRT_2, PI};

/// A float type unary math computes in.
trait Real: num_traits::Float + Send + Sync + 'static {
    /// The constant `v` in this type.
    fn c(v: f64) -> Self;
    fn erf(self) -> Self;
    fn erfc(self) -> Self;
    fn erfinv(self) -> Self;
    /// Round half to even (`torch.round`).
    fn round_even(self) -> Self;
}

impl Real for f32 {
    #[inline]
    fn c(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn erf(self) -> Self {
        libm::erff(self)
    }
    #[inline]
    fn erfc(self) -> Self {
        libm::erfcf(self)
    }
    /// In f64, rounded once (as the CUDA kernel computes f32 transcendentals).
    #[inline]
    fn erfinv(self) -> Self {
        erfinv(self as f64) as f32
    }
    #[inline]
    fn round_even(self) -> Self {
        self.round_ties_even()
    }
}

impl Real for f64 {
    #[inline]
    fn c(v: f64) -> Self {
        v
    }
    #[inline]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline]
    fn erfc(self) -> Self {
        libm::erfc(self)
    }
    #[inline]
    fn erfinv(self) -> Self {
        erfinv(self)
    }
    #[inline]
    fn round_even(self) -> Self {
        self.round_ties_even()
    }
}

/// The inverse error function (PyTorch's `calc_erfinv`): a rational approximation (Pavlis's
/// MATLAB `erfinv` 2.0 coefficients) refined by two Newton steps on `erf(x) - y`; NaN outside
/// [-1, 1], ±inf at ±1.
fn erfinv(y: f64) -> f64 {
    const A: [f64; 4] = [0.886226899, -1.645349621, 0.914624893, -0.140543331];
    const B: [f64; 4] = [-2.118377725, 1.442710462, -0.329097515, 0.012229801];
    const C: [f64; 4] = [-1.970840454, -1.624906493, 3.429567803, 1.641345311];
    const D: [f64; 2] = [3.543889200, 1.637067800];
    let y_abs = y.abs();
    if y_abs.is_nan() || y_abs > 1.0 {
        return f64::NAN;
    }
    if y_abs == 1.0 {
        return f64::INFINITY.copysign(y);
    }
    let mut x = if y_abs <= 0.7 {
        let z = y * y;
        let num = ((A[3] * z + A[2]) * z + A[1]) * z + A[0];
        let dem = (((B[3] * z + B[2]) * z + B[1]) * z + B[0]) * z + 1.0;
        y * num / dem
    } else {
        let z = (-((1.0 - y_abs) / 2.0).ln()).sqrt();
        let num = ((C[3] * z + C[2]) * z + C[1]) * z + C[0];
        let dem = (D[1] * z + D[0]) * z + 1.0;
        num.copysign(y) / dem
    };
    for _ in 0..2 {
        x -= (libm::erf(x) - y) / (std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp());
    }
    x
}

/// An element that converts to the compute type `R` (integers convert directly, not via f64).
trait Load<R>: Copy + Send + Sync {
    fn load(self) -> R;
}

/// An element that a result in the compute type `R` rounds to.
trait Store<R>: Send {
    fn store(r: R) -> Self;
}

macro_rules! load_as_f32 {
    ($($t:ty),*) => {$(
        impl Load<f32> for $t {
            #[inline]
            fn load(self) -> f32 {
                self as f32
            }
        }
    )*};
}
load_as_f32!(f32, i64, i32, u8);

impl Load<f32> for bool {
    #[inline]
    fn load(self) -> f32 {
        self as u8 as f32
    }
}
impl Load<f32> for f16 {
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
}
impl Load<f32> for bf16 {
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
}
impl Load<f64> for f64 {
    #[inline]
    fn load(self) -> f64 {
        self
    }
}

impl Store<f32> for f32 {
    #[inline]
    fn store(r: f32) -> Self {
        r
    }
}
impl Store<f32> for f16 {
    #[inline]
    fn store(r: f32) -> Self {
        f16::from_f32(r)
    }
}
impl Store<f32> for bf16 {
    #[inline]
    fn store(r: f32) -> Self {
        bf16::from_f32(r)
    }
}
impl Store<f64> for f64 {
    #[inline]
    fn store(r: f64) -> Self {
        r
    }
}

/// Elements per parallel task (64 KiB of f64).
const CHUNK: usize = 8192;

/// A loop writing `out[i] = f(input[i])` over one chunk.
type ChunkFn<'a, S, O> = &'a (dyn Fn(&[S], &mut [O]) + Sync);

/// Runs `f` over the elements of `l` (row-major), chunk by chunk, in parallel above
/// `PAR_THRESHOLD`; returns the row-major output.
fn run_chunked<S, O>(src: &[S], l: &Layout, f: ChunkFn<'_, S, O>) -> Vec<O>
where
    S: Copy + Send + Sync,
    O: Element,
{
    let gathered;
    let input = match l.contiguous_range() {
        Some(r) => &src[r],
        None => {
            gathered = gather_strided(src, l);
            &gathered[..]
        }
    };
    let mut out = vec![O::zero(); input.len()];
    if input.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            out.par_chunks_mut(CHUNK)
                .zip(input.par_chunks(CHUNK))
                .for_each(|(o, i)| f(i, o))
        });
    } else {
        f(input, &mut out);
    }
    out
}

/// `op` over the elements of `l`, computed in `R` and stored as `O`.
fn float_map<S, R, O>(src: &[S], l: &Layout, op: UnaryOp) -> Vec<O>
where
    S: Load<R>,
    R: Real,
    O: Store<R> + Element,
{
    macro_rules! map {
        (|$x:ident| $body:expr) => {
            run_chunked(src, l, &|input: &[S], out: &mut [O]| {
                for (o, &s) in out.iter_mut().zip(input) {
                    let $x: R = s.load();
                    *o = O::store($body);
                }
            })
        };
    }
    let c = R::c;
    let (zero, one, half) = (R::zero(), R::one(), c(0.5));
    let (three, six) = (c(3.0), c(6.0));
    use UnaryOp::*;
    match op {
        Neg => map!(|x| -x),
        Abs => map!(|x| x.abs()),
        // NaN and ±0 give +0, as PyTorch's `(0 < x) - (x < 0)`.
        Sign => map!(|x| if x > zero {
            one
        } else if x < zero {
            -one
        } else {
            zero
        }),
        Square => map!(|x| x * x),
        Reciprocal => map!(|x| one / x),
        Sqrt => map!(|x| x.sqrt()),
        Rsqrt => map!(|x| one / x.sqrt()),
        Exp => map!(|x| x.exp()),
        Exp2 => map!(|x| x.exp2()),
        Expm1 => map!(|x| x.exp_m1()),
        Log => map!(|x| x.ln()),
        Log2 => map!(|x| x.log2()),
        Log10 => map!(|x| x.log10()),
        Log1p => map!(|x| x.ln_1p()),
        Sin => map!(|x| x.sin()),
        Cos => map!(|x| x.cos()),
        Tan => map!(|x| x.tan()),
        Asin => map!(|x| x.asin()),
        Acos => map!(|x| x.acos()),
        Atan => map!(|x| x.atan()),
        Sinh => map!(|x| x.sinh()),
        Cosh => map!(|x| x.cosh()),
        Tanh => map!(|x| x.tanh()),
        Erf => map!(|x| x.erf()),
        Erfc => map!(|x| x.erfc()),
        Erfinv => map!(|x| x.erfinv()),
        Floor => map!(|x| x.floor()),
        Ceil => map!(|x| x.ceil()),
        Round => map!(|x| x.round_even()),
        Trunc => map!(|x| x.trunc()),
        Sigmoid => map!(|x| one / (one + (-x).exp())),
        // min(x, 0) - log1p(e^-|x|): no overflow for any x.
        LogSigmoid => map!(|x| (if x < zero { x } else { zero }) - (-x.abs()).exp().ln_1p()),
        // `x <= 0` rather than `x > 0` so that NaN propagates.
        Relu => map!(|x| if x <= zero { zero } else { x }),
        LeakyRelu { negative_slope } => {
            let slope = c(negative_slope);
            map!(|x| if x > zero { x } else { x * slope })
        }
        Elu {
            alpha,
            scale,
            input_scale,
        } => {
            let (neg, pos, inp) = (c(alpha * scale), c(scale), c(input_scale));
            map!(|x| if x <= zero {
                (x * inp).exp_m1() * neg
            } else {
                x * pos
            })
        }
        Hardtanh { min, max } => {
            let (lo, hi) = (c(min), c(max));
            map!(|x| if x < lo {
                lo
            } else if x > hi {
                hi
            } else {
                x
            })
        }
        Hardsigmoid => map!(|x| hardsigmoid(x, zero, three, six)),
        Hardswish => map!(|x| x * hardsigmoid(x, zero, three, six)),
        Gelu => {
            let k = c(FRAC_1_SQRT_2);
            map!(|x| x * half * (one + (x * k).erf()))
        }
        GeluTanh => {
            let (k, kappa) = (c((2.0 / PI).sqrt()), c(GELU_TANH_KAPPA));
            map!(|x| half * x * (one + (k * (x + kappa * x * x * x)).tanh()))
        }
        Silu => map!(|x| x / (one + (-x).exp())),
        Mish => map!(|x| x * x.exp().ln_1p().tanh()),
        Softplus { beta, threshold } => {
            let (b, t) = (c(beta), c(threshold));
            map!(|x| if x * b > t { x } else { (x * b).exp().ln_1p() / b })
        }
        Softsign => map!(|x| x / (one + x.abs())),
        AddScalar { value } => {
            let v = c(value);
            map!(|x| x + v)
        }
        SubScalar { value } => {
            let v = c(value);
            map!(|x| x - v)
        }
        MulScalar { value } => {
            let v = c(value);
            map!(|x| x * v)
        }
        DivScalar { value } => {
            let v = c(value);
            map!(|x| x / v)
        }
    }
}

/// `min(max(x + 3, 0), 6) / 6`, with NaN propagating as in PyTorch's kernel.
#[inline]
fn hardsigmoid<R: Real>(x: R, zero: R, three: R, six: R) -> R {
    let t = x + three;
    let t = if t < zero { zero } else { t };
    let t = if six < t { six } else { t };
    t / six
}

/// Integer element types with the ops that keep integer dtypes.
trait IntElem: Element {
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    fn sign(self) -> Self;
    fn relu(self) -> Self;
    fn square(self) -> Self;
}

macro_rules! signed_int {
    ($($t:ty),*) => {$(
        impl IntElem for $t {
            #[inline]
            fn neg(self) -> Self {
                self.wrapping_neg()
            }
            #[inline]
            fn abs(self) -> Self {
                self.wrapping_abs()
            }
            #[inline]
            fn sign(self) -> Self {
                self.signum()
            }
            #[inline]
            fn relu(self) -> Self {
                self.max(0)
            }
            #[inline]
            fn square(self) -> Self {
                self.wrapping_mul(self)
            }
        }
    )*};
}
signed_int!(i32, i64);

impl IntElem for u8 {
    #[inline]
    fn neg(self) -> Self {
        self.wrapping_neg()
    }
    #[inline]
    fn abs(self) -> Self {
        self
    }
    #[inline]
    fn sign(self) -> Self {
        self.min(1)
    }
    #[inline]
    fn relu(self) -> Self {
        self
    }
    #[inline]
    fn square(self) -> Self {
        self.wrapping_mul(self)
    }
}

/// An integer-preserving `op` (see [`UnaryOp::keeps_integers`]) over the elements of `l`.
fn int_map<T: IntElem>(src: &[T], l: &Layout, op: UnaryOp) -> Vec<T> {
    macro_rules! map {
        ($f:expr) => {
            run_chunked(src, l, &|input: &[T], out: &mut [T]| {
                for (o, &x) in out.iter_mut().zip(input) {
                    *o = $f(x);
                }
            })
        };
    }
    use UnaryOp::*;
    match op {
        Neg => map!(T::neg),
        Abs => map!(T::abs),
        Sign => map!(T::sign),
        Relu => map!(T::relu),
        Square => map!(T::square),
        // Integers are already whole: a copy, as PyTorch.
        _ if op.ints() == Ints::Whole => gather_strided(src, l),
        _ => unreachable!("{} does not keep integer dtypes", op.name()),
    }
}

/// ReLU's input gradient from its output `y` and the output gradient `g` (contiguous, `len`
/// elements each, one float dtype): `g` where `y > 0`, else 0 (NaN in `y` gives 0, as
/// PyTorch's `threshold_backward`); None for other dtypes.
pub(crate) fn relu_backward(y: &CpuStorage, g: &CpuStorage, len: usize) -> Option<CpuStorage> {
    fn run<T: CpuElement>(y: &[T], g: &[T]) -> Vec<T> {
        let zero = T::zero();
        let pick = |(&y, &g): (&T, &T)| if y > zero { g } else { zero };
        if y.len() >= PAR_THRESHOLD {
            super::threads::parallel(|| y.par_iter().zip(g.par_iter()).map(pick).collect())
        } else {
            y.iter().zip(g).map(pick).collect()
        }
    }
    use CpuStorage::*;
    Some(match (y, g) {
        (F32(y), F32(g)) => F32(run(&y[..len], &g[..len])),
        (F64(y), F64(g)) => F64(run(&y[..len], &g[..len])),
        (F16(y), F16(g)) => F16(run(&y[..len], &g[..len])),
        (BF16(y), BF16(g)) => BF16(run(&y[..len], &g[..len])),
        _ => return None,
    })
}

impl UnaryOps for CpuStorage {
    /// `op` over the elements of `layout`, in a new row-major storage of
    /// `op.result_dtype(self.dtype())`.
    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<CpuStorage> {
        check_host_alloc(
            op.name(),
            layout.numel(),
            op.result_dtype(self.dtype()).unwrap_or(self.dtype()),
        )?;
        use CpuStorage::*;
        let int_out = op.result_dtype(self.dtype())?.is_integer();
        let l = layout;
        Ok(match self {
            F64(v) => F64(float_map::<_, f64, _>(v, l, op)),
            F32(v) => F32(float_map::<_, f32, _>(v, l, op)),
            F16(v) => F16(float_map::<_, f32, _>(v, l, op)),
            BF16(v) => BF16(float_map::<_, f32, _>(v, l, op)),
            I64(v) if int_out => I64(int_map(v, l, op)),
            I32(v) if int_out => I32(int_map(v, l, op)),
            U8(v) if int_out => U8(int_map(v, l, op)),
            I64(v) => F32(float_map::<_, f32, _>(v, l, op)),
            I32(v) => F32(float_map::<_, f32, _>(v, l, op)),
            U8(v) => F32(float_map::<_, f32, _>(v, l, op)),
            Bool(v) => match op.result_dtype(DType::Bool)? {
                // abs and sign of a bool are the bool itself.
                DType::Bool => Bool(gather_strided(v, l)),
                // square: true² = 1 as int64.
                DType::I64 => I64(gather_strided(v, l).into_iter().map(i64::from).collect()),
                _ => F32(float_map::<_, f32, _>(v, l, op)),
            },
        })
    }

    fn relu_backward(&self, grad_out: &CpuStorage, len: usize) -> Result<Option<CpuStorage>> {
        check_host_alloc("relu_backward", len, self.dtype())?;
        Ok(self::relu_backward(self, grad_out, len))
    }
}
