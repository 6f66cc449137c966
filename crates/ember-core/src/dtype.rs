//! Runtime element types ([`DType`]), PyTorch's type-promotion rules, and the [`Element`] trait
//! that ties each dtype to its Rust type.

use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor, chosen at run time (as `torch.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

/// Category used by promotion: a higher category wins over a wider type of a lower one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Category {
    Bool,
    Int,
    Float,
}

impl DType {
    /// Every dtype, in promotion order within each category.
    pub const ALL: [DType; 8] = [
        DType::Bool,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// True for f16, bf16, f32, f64 (as `torch.is_floating_point`).
    pub fn is_floating_point(self) -> bool {
        self.category() == Category::Float
    }

    /// True for u8, i32, i64 (bool is not an integer type here, as in PyTorch).
    pub fn is_integer(self) -> bool {
        self.category() == Category::Int
    }

    /// PyTorch's name without the `torch.` prefix ("float32", "bfloat16", "int64", ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    fn category(self) -> Category {
        match self {
            DType::Bool => Category::Bool,
            DType::U8 | DType::I32 | DType::I64 => Category::Int,
            _ => Category::Float,
        }
    }

    /// The dtype two tensor operands promote to (`torch.promote_types`).
    ///
    /// Within a category the wider type wins; across categories the higher category wins;
    /// f16 with bf16 gives f32.
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        if self == other {
            return self;
        }
        match (self.category(), other.category()) {
            (a, b) if a > b => self,
            (a, b) if a < b => other,
            _ => match (self, other) {
                (F16, BF16) | (BF16, F16) => F32,
                _ => {
                    let rank = |d: DType| DType::ALL.iter().position(|&x| x == d);
                    if rank(self) > rank(other) {
                        self
                    } else {
                        other
                    }
                }
            },
        }
    }

    /// The dtype of `tensor <op> scalar`: a scalar never widens a tensor of its own category,
    /// but a float scalar makes an integer or bool tensor float (the default dtype, f32), and an
    /// int scalar makes a bool tensor i64.
    pub fn promote_with_scalar(self, scalar: ScalarKind) -> DType {
        match (self.category(), scalar) {
            (Category::Float, _) => self,
            (_, ScalarKind::Float) => DType::F32,
            (Category::Int, _) => self,
            (Category::Bool, ScalarKind::Int) => DType::I64,
            (Category::Bool, ScalarKind::Bool) => DType::Bool,
        }
    }
}

/// What kind of Rust scalar an operand is, for promotion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalarKind {
    Bool,
    Int,
    Float,
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element type of some [`DType`].
///
/// Conversions go through `f64`, which holds every value of every supported type exactly
/// except i64 beyond 2^53; integer paths use [`Element::to_i64`] for that reason.
pub trait Element: Copy + Send + Sync + PartialOrd + fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// `v` rounded once to this type. `from_f64` of the same value can differ for bfloat16:
    /// `half`'s `bf16::from_f64` rounds from the f64's high 32 bits, which drops the low 3
    /// bits of an f32's significand (a tie there rounds to even where the f32 is above it).
    fn from_f32(v: f32) -> Self {
        Self::from_f64(v as f64)
    }
    fn to_i64(self) -> i64 {
        self.to_f64() as i64
    }
    fn from_i64(v: i64) -> Self {
        Self::from_f64(v as f64)
    }
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
    fn one() -> Self {
        Self::from_f64(1.0)
    }
}

macro_rules! element_via_cast {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
element_via_cast!(f32, DType::F32);
element_via_cast!(f64, DType::F64);
element_via_cast!(i64, DType::I64);
element_via_cast!(i32, DType::I32);
element_via_cast!(u8, DType::U8);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    #[inline]
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    #[inline]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline]
    fn from_i64(v: i64) -> Self {
        v != 0
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    #[test]
    fn promotion_follows_pytorch() {
        assert_eq!(I64.promote(F32), F32);
        assert_eq!(F16.promote(BF16), F32);
        assert_eq!(F16.promote(F32), F32);
        assert_eq!(U8.promote(I32), I32);
        assert_eq!(Bool.promote(U8), U8);
        assert_eq!(F64.promote(F16), F64);
        assert_eq!(I32.promote(BF16), BF16);
    }

    #[test]
    fn scalars_do_not_widen_tensors() {
        assert_eq!(F16.promote_with_scalar(ScalarKind::Float), F16);
        assert_eq!(I32.promote_with_scalar(ScalarKind::Int), I32);
        assert_eq!(I64.promote_with_scalar(ScalarKind::Float), F32);
        assert_eq!(Bool.promote_with_scalar(ScalarKind::Int), I64);
    }
}

/// A Rust number used as an operand (`x.add_scalar(2)`, `x.mul_scalar(0.5)`): like a Python
/// scalar in PyTorch, it takes part in promotion by kind only (see [`DType::promote_with_scalar`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl Scalar {
    pub fn kind(self) -> ScalarKind {
        match self {
            Scalar::Bool(_) => ScalarKind::Bool,
            Scalar::Int(_) => ScalarKind::Int,
            Scalar::Float(_) => ScalarKind::Float,
        }
    }

    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as u8 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }
}

macro_rules! scalar_from {
    ($($t:ty => $variant:ident as $as:ty),*) => {$(
        impl From<$t> for Scalar {
            fn from(v: $t) -> Scalar {
                Scalar::$variant(v as $as)
            }
        }
    )*};
}
scalar_from!(f64 => Float as f64, f32 => Float as f64, i64 => Int as i64, i32 => Int as i64,
             u8 => Int as i64, usize => Int as i64);

impl From<bool> for Scalar {
    fn from(v: bool) -> Scalar {
        Scalar::Bool(v)
    }
}
