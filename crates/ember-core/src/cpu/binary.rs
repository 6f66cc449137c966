//! CPU kernels for elementwise ops over two or three operands whose layouts were already
//! broadcast to one shape: arithmetic, comparisons, logical ops and `where`.

use super::{map_strided, CpuStorage, PAR_CHUNK, PAR_THRESHOLD};
use crate::backend::op::{BinaryOp, Bools, CmpOp, LogicalOp, GELU_TANH_KAPPA};
use crate::backend::{BackendStorage, CopyOps, ElementwiseOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// `f(a[i], b[i])` for every element of the common shape of `al` and `bl`, row-major.
pub fn binary_map<T, U, F>(a: &[T], al: &Layout, b: &[T], bl: &Layout, f: F) -> Vec<U>
where
    T: Copy + Send + Sync,
    U: Send,
    F: Fn(T, T) -> U + Send + Sync,
{
    let n = al.numel();
    if let (Some(ra), Some(rb)) = (al.contiguous_range(), bl.contiguous_range()) {
        let (a, b) = (&a[ra], &b[rb]);
        return if n >= PAR_THRESHOLD {
            super::threads::parallel(|| a.par_iter().zip(b.par_iter()).map(|(&x, &y)| f(x, y)).collect())
        } else {
            a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
        };
    }
    if n > 0 && bl.strides().iter().all(|&s| s == 0) {
        let y = b[bl.offset()];
        return map_strided(a, al, |x| f(x, y));
    }
    if n > 0 && al.strides().iter().all(|&s| s == 0) {
        let x = a[al.offset()];
        return map_strided(b, bl, |y| f(x, y));
    }
    if n >= PAR_THRESHOLD {
        let parts: Vec<Vec<U>> = super::threads::parallel(|| {
            (0..n.div_ceil(PAR_CHUNK))
                .into_par_iter()
                .map(|c| {
                    let (ia, ib) = (al.offsets_from(c * PAR_CHUNK), bl.offsets_from(c * PAR_CHUNK));
                    ia.zip(ib).take(PAR_CHUNK).map(|(i, j)| f(a[i], b[j])).collect()
                })
                .collect()
        });
        let mut out = Vec::with_capacity(n);
        for p in parts {
            out.extend(p);
        }
        return out;
    }
    al.offsets()
        .zip(bl.offsets())
        .map(|(i, j)| f(a[i], b[j]))
        .collect()
}

/// Runs `$run!(args; formula)` with the CPU formula of float op `$op`, a closure over the compute
/// type `$R` (f64 for f64, f32 for the other floats): one monomorphized loop per op.
macro_rules! with_float_formula {
    ($op:expr, $R:ty, $run:ident($($args:tt)*)) => {
        match $op {
            BinaryOp::Add => $run!($($args)*; |x: $R, y: $R| x + y),
            BinaryOp::Sub => $run!($($args)*; |x: $R, y: $R| x - y),
            BinaryOp::Mul => $run!($($args)*; |x: $R, y: $R| x * y),
            BinaryOp::Div => $run!($($args)*; |x: $R, y: $R| x / y),
            BinaryOp::Pow => $run!($($args)*; |x: $R, y: $R| x.powf(y)),
            // NaN propagates, as in PyTorch.
            BinaryOp::Maximum => $run!($($args)*; |x: $R, y: $R| if x.is_nan() || x > y { x } else { y }),
            BinaryOp::Minimum => $run!($($args)*; |x: $R, y: $R| if x.is_nan() || x < y { x } else { y }),
            // 0 where x == 0 unless y is NaN (PyTorch's `xlogy`).
            BinaryOp::Xlogy => $run!($($args)*; |x: $R, y: $R| if y.is_nan() {
                y
            } else if x == 0.0 {
                0.0
            } else {
                x * y.ln()
            }),
            BinaryOp::GeluBackward => $run!($($args)*; |x: $R, y: $R| GeluGrad::gelu_grad(x, y)),
            BinaryOp::GeluTanhBackward => $run!($($args)*; |x: $R, y: $R| GeluGrad::gelu_tanh_grad(x, y)),
        }
    };
}

/// GELU's backward in its compute type (`kernels/elementwise.cu` has the same formulas):
/// `g` the output gradient, `v` GELU's input.
///   erf:  g · (Φ(v) + v φ(v)),  Φ(v) = (1 + erf(v / √2)) / 2,  φ(v) = e^(-v²/2) / √(2π)
///   tanh: with u = √(2/π) (v + κv³), t = tanh u:  g · (½(1 + t) + ½v (1 - t²) √(2/π) (1 + 3κv²))
trait GeluGrad: Sized {
    fn gelu_grad(g: Self, v: Self) -> Self;
    fn gelu_tanh_grad(g: Self, v: Self) -> Self;
}

macro_rules! gelu_grad {
    ($t:ty, $erf:path) => {
        impl GeluGrad for $t {
            #[inline]
            fn gelu_grad(g: $t, v: $t) -> $t {
                let cdf = 0.5 * (1.0 + $erf(v * std::f64::consts::FRAC_1_SQRT_2 as $t));
                let pdf = (-0.5 * v * v).exp() * (1.0 / (2.0 * std::f64::consts::PI).sqrt()) as $t;
                g * (cdf + v * pdf)
            }

            #[inline]
            fn gelu_tanh_grad(g: $t, v: $t) -> $t {
                let (k, kappa) = (
                    (2.0 / std::f64::consts::PI).sqrt() as $t,
                    GELU_TANH_KAPPA as $t,
                );
                let v2 = v * v;
                let t = (k * (v + kappa * v2 * v)).tanh();
                g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * kappa * v2))
            }
        }
    };
}
gelu_grad!(f32, libm::erff);
gelu_grad!(f64, libm::erf);

/// f32 and f64: floats that compute in their own type.
trait FloatFormula: Sized {
    fn arith(op: BinaryOp, a: &[Self], al: &Layout, b: &[Self], bl: &Layout) -> Vec<Self>;
}

macro_rules! float_formula {
    ($($t:ty),*) => {$(
        impl FloatFormula for $t {
            fn arith(op: BinaryOp, a: &[$t], al: &Layout, b: &[$t], bl: &Layout) -> Vec<$t> {
                macro_rules! run {
                    (; $f:expr) => {
                        binary_map(a, al, b, bl, $f)
                    };
                }
                with_float_formula!(op, $t, run())
            }
        }
    )*};
}
float_formula!(f32, f64);

/// Half types compute in f32 and round once.
fn half_arith<T: Copy + Send + Sync>(
    op: BinaryOp,
    a: &[T],
    al: &Layout,
    b: &[T],
    bl: &Layout,
    to: fn(T) -> f32,
    from: fn(f32) -> T,
) -> Vec<T> {
    macro_rules! run {
        (; $f:expr) => {{
            let f = $f;
            binary_map(a, al, b, bl, |x, y| from(f(to(x), to(y))))
        }};
    }
    with_float_formula!(op, f32, run())
}

/// Runs `$run!(args; formula)` with the integer formula of `$op` on `$t` (wrapping, as PyTorch),
/// or returns the error for an op whose integers compute as floats (true division, xlogy: the
/// caller promotes them, so they never arrive here). Integer pow's exponents `$b` at `$bl` are
/// checked first: a negative one is an error, as on every device.
macro_rules! with_int_formula {
    ($t:ty, $op:expr, $b:expr, $bl:expr, $run:ident($($args:tt)*)) => {
        match $op {
            BinaryOp::Add => Ok($run!($($args)*; |x: $t, y: $t| x.wrapping_add(y))),
            BinaryOp::Sub => Ok($run!($($args)*; |x: $t, y: $t| x.wrapping_sub(y))),
            BinaryOp::Mul => Ok($run!($($args)*; |x: $t, y: $t| x.wrapping_mul(y))),
            BinaryOp::Maximum => Ok($run!($($args)*; |x: $t, y: $t| x.max(y))),
            BinaryOp::Minimum => Ok($run!($($args)*; |x: $t, y: $t| x.min(y))),
            BinaryOp::Pow => {
                #[allow(unused_comparisons)]
                let negative = $bl.offsets().any(|i| $b[i] < 0);
                if negative {
                    return Err(Error::invalid(
                        "pow",
                        "integers to negative integer powers are not allowed",
                    ));
                }
                Ok($run!($($args)*; |x: $t, y: $t| x.wrapping_pow(y as u32)))
            }
            op => Err(Error::dtype(op.name(), <$t as crate::Element>::DTYPE)),
        }
    };
}

/// `a[i] = f(a[i], b[j])` over the elements of `a` (row-major) and the offsets of `bl` (of
/// `a`'s shape): an in-place binary op, in parallel above `PAR_THRESHOLD`.
fn apply_map<T, F>(a: &mut [T], b: &[T], bl: &Layout, f: F)
where
    T: Copy + Send + Sync,
    F: Fn(T, T) -> T + Send + Sync,
{
    if let Some(rb) = bl.contiguous_range() {
        let b = &b[rb];
        if a.len() >= PAR_THRESHOLD {
            super::threads::parallel(|| {
                a.par_iter_mut()
                    .zip(b.par_iter())
                    .for_each(|(x, &y)| *x = f(*x, y))
            });
        } else {
            a.iter_mut().zip(b).for_each(|(x, &y)| *x = f(*x, y));
        }
    } else if a.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            a.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, chunk)| {
                for (x, j) in chunk.iter_mut().zip(bl.offsets_from(c * PAR_CHUNK)) {
                    *x = f(*x, b[j]);
                }
            })
        });
    } else {
        for (x, j) in a.iter_mut().zip(bl.offsets()) {
            *x = f(*x, b[j]);
        }
    }
}

impl ElementwiseOps for CpuStorage {
    /// `lhs op rhs` for two storages of one dtype, layouts broadcast to one shape.
    #[inline]
    fn binary(&self, op: BinaryOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
        use CpuStorage::*;
        check_host_alloc(op.name(), al.numel(), self.dtype())?;
        macro_rules! run {
            ($a:expr, $b:expr; $f:expr) => {
                binary_map($a, al, $b, bl, $f)
            };
        }
        Ok(match (self, rhs) {
            (F32(a), F32(b)) => F32(f32::arith(op, a, al, b, bl)),
            (F64(a), F64(b)) => F64(f64::arith(op, a, al, b, bl)),
            (F16(a), F16(b)) => F16(half_arith(op, a, al, b, bl, f16::to_f32, f16::from_f32)),
            (BF16(a), BF16(b)) => BF16(half_arith(op, a, al, b, bl, bf16::to_f32, bf16::from_f32)),
            (I64(a), I64(b)) => I64(with_int_formula!(i64, op, b, bl, run(a, b))?),
            (I32(a), I32(b)) => I32(with_int_formula!(i32, op, b, bl, run(a, b))?),
            (U8(a), U8(b)) => U8(with_int_formula!(u8, op, b, bl, run(a, b))?),
            (Bool(a), Bool(b)) => Bool(match op.bools() {
                Bools::Or => binary_map(a, al, b, bl, |x, y| x | y),
                Bools::And => binary_map(a, al, b, bl, |x, y| x & y),
                Bools::No => {
                    return Err(Error::UnsupportedDType {
                        op: op.name(),
                        dtype: DType::Bool,
                        hint: "use logical_xor / logical_not for booleans, or convert with to_dtype",
                    })
                }
            }),
            _ => {
                return Err(Error::DTypeMismatch {
                    op: op.name(),
                    expected: self.dtype(),
                    found: rhs.dtype(),
                })
            }
        })
    }

    fn binary_into(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &CpuStorage,
        rhs_layout: &Layout,
        out: &mut CpuStorage,
        out_layout: &Layout,
    ) -> Result<()> {
        // The kernels write new buffers (`binary` checks the allocation); the result is copied
        // into place.
        let r = ElementwiseOps::binary(self, op, layout, rhs, rhs_layout)?;
        out.copy_strided_from(out_layout, &r, &Layout::contiguous(layout.shape().clone()))
    }

    /// `self op rhs` written over `self`'s elements at `al` (row-major, any offset), `rhs` at
    /// `bl` broadcast to `al`'s shape, both of one dtype: the in-place ops (`add_`), with no
    /// new buffer.
    fn binary_inplace(&mut self, op: BinaryOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<()> {
        use CpuStorage::*;
        let range = al.contiguous_range().ok_or_else(|| {
            Error::invalid(
                op.name(),
                "in-place binary kernels write a row-major destination; this is a bug",
            )
        })?;
        macro_rules! run {
            ($a:expr, $b:expr; $f:expr) => {
                apply_map(&mut $a[range], $b, bl, $f)
            };
        }
        macro_rules! run_half {
            ($a:expr, $b:expr, $half_of:expr; $f:expr) => {{
                let (f, half_of) = ($f, $half_of);
                apply_map(&mut $a[range], $b, bl, |x, y| {
                    half_of(f(x.to_f32(), y.to_f32()))
                })
            }};
        }
        let dtype = self.dtype();
        match (self, rhs) {
            (F32(a), F32(b)) => with_float_formula!(op, f32, run(a, b)),
            (F64(a), F64(b)) => with_float_formula!(op, f64, run(a, b)),
            (F16(a), F16(b)) => with_float_formula!(op, f32, run_half(a, b, f16::from_f32)),
            (BF16(a), BF16(b)) => with_float_formula!(op, f32, run_half(a, b, bf16::from_f32)),
            (I64(a), I64(b)) => with_int_formula!(i64, op, b, bl, run(a, b))?,
            (I32(a), I32(b)) => with_int_formula!(i32, op, b, bl, run(a, b))?,
            (U8(a), U8(b)) => with_int_formula!(u8, op, b, bl, run(a, b))?,
            (Bool(a), Bool(b)) => match op.bools() {
                Bools::Or => apply_map(&mut a[range], b, bl, |x, y| x | y),
                Bools::And => apply_map(&mut a[range], b, bl, |x, y| x & y),
                Bools::No => {
                    return Err(Error::UnsupportedDType {
                        op: op.name(),
                        dtype: DType::Bool,
                        hint: "use logical_xor / logical_not for booleans, or convert with to_dtype",
                    })
                }
            },
            (_, rhs) => {
                return Err(Error::DTypeMismatch {
                    op: op.name(),
                    expected: dtype,
                    found: rhs.dtype(),
                })
            }
        }
        Ok(())
    }

    /// Elementwise comparison producing booleans.
    fn compare(&self, op: CmpOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
        check_host_alloc(op.name(), al.numel(), DType::Bool)?;
        fn cmp<T: Copy + PartialOrd + Send + Sync>(
            op: CmpOp,
            a: &[T],
            al: &Layout,
            b: &[T],
            bl: &Layout,
        ) -> Vec<bool> {
            match op {
                CmpOp::Eq => binary_map(a, al, b, bl, |x, y| x == y),
                CmpOp::Ne => binary_map(a, al, b, bl, |x, y| x != y),
                CmpOp::Lt => binary_map(a, al, b, bl, |x, y| x < y),
                CmpOp::Le => binary_map(a, al, b, bl, |x, y| x <= y),
                CmpOp::Gt => binary_map(a, al, b, bl, |x, y| x > y),
                CmpOp::Ge => binary_map(a, al, b, bl, |x, y| x >= y),
            }
        }
        use CpuStorage::*;
        Ok(Bool(match (self, rhs) {
            (F32(a), F32(b)) => cmp(op, a, al, b, bl),
            (F64(a), F64(b)) => cmp(op, a, al, b, bl),
            (F16(a), F16(b)) => cmp(op, a, al, b, bl),
            (BF16(a), BF16(b)) => cmp(op, a, al, b, bl),
            (I64(a), I64(b)) => cmp(op, a, al, b, bl),
            (I32(a), I32(b)) => cmp(op, a, al, b, bl),
            (U8(a), U8(b)) => cmp(op, a, al, b, bl),
            (Bool(a), Bool(b)) => cmp(op, a, al, b, bl),
            _ => {
                return Err(Error::DTypeMismatch {
                    op: op.name(),
                    expected: self.dtype(),
                    found: rhs.dtype(),
                })
            }
        }))
    }

    /// Logical op on two boolean storages.
    fn logical(&self, op: LogicalOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
        check_host_alloc(op.name(), al.numel(), DType::Bool)?;
        let (CpuStorage::Bool(a), CpuStorage::Bool(b)) = (self, rhs) else {
            return Err(Error::dtype(
                op.name(),
                if self.dtype() == DType::Bool {
                    rhs.dtype()
                } else {
                    self.dtype()
                },
            ));
        };
        Ok(CpuStorage::Bool(match op {
            LogicalOp::And => binary_map(a, al, b, bl, |x, y| x & y),
            LogicalOp::Or => binary_map(a, al, b, bl, |x, y| x | y),
            LogicalOp::Xor => binary_map(a, al, b, bl, |x, y| x ^ y),
        }))
    }

    /// `cond ? a : b` elementwise; `self` is the boolean condition; all layouts share a shape.
    fn where_cond(
        &self,
        cl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<CpuStorage> {
        check_host_alloc("where", cl.numel(), a.dtype())?;
        fn pick<T: Copy + Send + Sync>(
            c: &[bool],
            cl: &Layout,
            a: &[T],
            al: &Layout,
            b: &[T],
            bl: &Layout,
        ) -> Vec<T> {
            cl.offsets()
                .zip(al.offsets())
                .zip(bl.offsets())
                .map(|((k, i), j)| if c[k] { a[i] } else { b[j] })
                .collect()
        }
        let CpuStorage::Bool(c) = self else {
            return Err(Error::UnsupportedDType {
                op: "where",
                dtype: self.dtype(),
                hint: "the condition must be a bool tensor",
            });
        };
        use CpuStorage::*;
        Ok(match (a, b) {
            (F32(a), F32(b)) => F32(pick(c, cl, a, al, b, bl)),
            (F64(a), F64(b)) => F64(pick(c, cl, a, al, b, bl)),
            (F16(a), F16(b)) => F16(pick(c, cl, a, al, b, bl)),
            (BF16(a), BF16(b)) => BF16(pick(c, cl, a, al, b, bl)),
            (I64(a), I64(b)) => I64(pick(c, cl, a, al, b, bl)),
            (I32(a), I32(b)) => I32(pick(c, cl, a, al, b, bl)),
            (U8(a), U8(b)) => U8(pick(c, cl, a, al, b, bl)),
            (Bool(a), Bool(b)) => Bool(pick(c, cl, a, al, b, bl)),
            _ => {
                return Err(Error::DTypeMismatch {
                    op: "where",
                    expected: a.dtype(),
                    found: b.dtype(),
                })
            }
        })
    }
}
