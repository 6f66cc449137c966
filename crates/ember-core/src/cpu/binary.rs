//! CPU kernels for elementwise ops over two or three operands whose layouts were already
//! broadcast to one shape: arithmetic, comparisons, logical ops and `where`.

use super::{map_strided, CpuStorage, PAR_CHUNK, PAR_THRESHOLD};
use crate::backend::op::{BinaryOp, CmpOp, LogicalOp};
use crate::layout::Layout;
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
            a.par_iter().zip(b.par_iter()).map(|(&x, &y)| f(x, y)).collect()
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
        let parts: Vec<Vec<U>> = (0..n.div_ceil(PAR_CHUNK))
            .into_par_iter()
            .map(|c| {
                let (ia, ib) = (al.offsets_from(c * PAR_CHUNK), bl.offsets_from(c * PAR_CHUNK));
                ia.zip(ib).take(PAR_CHUNK).map(|(i, j)| f(a[i], b[j])).collect()
            })
            .collect();
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

macro_rules! float_arith {
    ($op:expr, $a:expr, $al:expr, $b:expr, $bl:expr) => {
        match $op {
            BinaryOp::Add => binary_map($a, $al, $b, $bl, |x, y| x + y),
            BinaryOp::Sub => binary_map($a, $al, $b, $bl, |x, y| x - y),
            BinaryOp::Mul => binary_map($a, $al, $b, $bl, |x, y| x * y),
            BinaryOp::Div => binary_map($a, $al, $b, $bl, |x, y| x / y),
            BinaryOp::Pow => binary_map($a, $al, $b, $bl, |x, y| x.powf(y)),
            // NaN propagates, as in PyTorch.
            BinaryOp::Maximum => binary_map($a, $al, $b, $bl, |x, y| if x.is_nan() || x > y { x } else { y }),
            BinaryOp::Minimum => binary_map($a, $al, $b, $bl, |x, y| if x.is_nan() || x < y { x } else { y }),
        }
    };
}

macro_rules! int_arith {
    ($t:ty, $op:expr, $a:expr, $al:expr, $b:expr, $bl:expr) => {
        match $op {
            BinaryOp::Add => Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| x.wrapping_add(y))),
            BinaryOp::Sub => Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| x.wrapping_sub(y))),
            BinaryOp::Mul => Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| x.wrapping_mul(y))),
            BinaryOp::Maximum => Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| x.max(y))),
            BinaryOp::Minimum => Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| x.min(y))),
            BinaryOp::Pow => {
                #[allow(unused_comparisons)]
                let negative = $bl.offsets().any(|i| $b[i] < 0);
                if negative {
                    return Err(Error::invalid(
                        "pow",
                        "integers to negative integer powers are not allowed",
                    ));
                }
                Ok(binary_map($a, $al, $b, $bl, |x: $t, y: $t| {
                    x.wrapping_pow(y as u32)
                }))
            }
            // Division of integers is promoted to float by the caller (true division).
            BinaryOp::Div => Err(Error::dtype("div", <$t as crate::Element>::DTYPE)),
        }
    };
}

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
    let f = |x: f32, y: f32| -> f32 {
        match op {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
            BinaryOp::Pow => x.powf(y),
            BinaryOp::Maximum => {
                if x.is_nan() || x > y {
                    x
                } else {
                    y
                }
            }
            BinaryOp::Minimum => {
                if x.is_nan() || x < y {
                    x
                } else {
                    y
                }
            }
        }
    };
    binary_map(a, al, b, bl, |x, y| from(f(to(x), to(y))))
}

impl CpuStorage {
    /// `lhs op rhs` for two storages of one dtype, layouts broadcast to one shape.
    pub fn binary(&self, op: BinaryOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
        use CpuStorage::*;
        Ok(match (self, rhs) {
            (F32(a), F32(b)) => F32(float_arith!(op, a, al, b, bl)),
            (F64(a), F64(b)) => F64(float_arith!(op, a, al, b, bl)),
            (F16(a), F16(b)) => F16(half_arith(op, a, al, b, bl, f16::to_f32, f16::from_f32)),
            (BF16(a), BF16(b)) => BF16(half_arith(op, a, al, b, bl, bf16::to_f32, bf16::from_f32)),
            (I64(a), I64(b)) => I64(int_arith!(i64, op, a, al, b, bl)?),
            (I32(a), I32(b)) => I32(int_arith!(i32, op, a, al, b, bl)?),
            (U8(a), U8(b)) => U8(int_arith!(u8, op, a, al, b, bl)?),
            (Bool(a), Bool(b)) => Bool(match op {
                BinaryOp::Add | BinaryOp::Maximum => binary_map(a, al, b, bl, |x, y| x | y),
                BinaryOp::Mul | BinaryOp::Minimum => binary_map(a, al, b, bl, |x, y| x & y),
                _ => {
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

    /// Elementwise comparison producing booleans.
    pub fn compare(&self, op: CmpOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
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
    pub fn logical(&self, op: LogicalOp, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
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
    pub fn where_cond(
        &self,
        cl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<CpuStorage> {
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
