//! [`Shape`]: the sizes of a tensor's dimensions, broadcasting, and dimension normalization.

use crate::{Error, Result};
use smallvec::SmallVec;
use std::fmt;

/// Dims (or strides) held inline up to this rank, so that making the shape and layout of an
/// op's output allocates nothing on the heap (part of the per-op host cost budget).
pub const INLINE_DIMS: usize = 6;

/// Sizes or strides of up to [`INLINE_DIMS`] dims without a heap allocation.
pub type Dims = SmallVec<[usize; INLINE_DIMS]>;

/// The size of each dimension; `[]` is a scalar (0-d tensor) with one element.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Dims);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(Dims::from_vec(dims.into()))
    }

    /// The 0-d shape.
    pub fn scalar() -> Shape {
        Shape(Dims::new())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Number of elements, or `None` when the product of the sizes overflows `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The number of elements of a tensor of this shape, after checking that one can exist:
    /// the product of the sizes, with a size of 0 counted as 1 so that every contiguous stride
    /// is in range too, must not exceed [`MAX_ELEMENTS`]. An `Error::InvalidArgument` of `op`
    /// naming the sizes otherwise (Note [Checked sizes]).
    pub fn checked_elements(&self, op: &'static str) -> Result<usize> {
        let extent = self
            .0
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)));
        match extent {
            Some(e) if e <= MAX_ELEMENTS => Ok(self.numel()),
            _ => Err(Error::invalid(
                op,
                format!(
                    "a tensor of shape {self} would have more elements than memory can address (at most {MAX_ELEMENTS}); use smaller sizes"
                ),
            )),
        }
    }

    /// Row-major (C-contiguous) strides, in elements.
    pub fn contiguous_strides(&self) -> Dims {
        let mut strides: Dims = smallvec::smallvec![0; self.0.len()];
        let mut acc = 1;
        for (s, &d) in strides.iter_mut().zip(&self.0).rev() {
            *s = acc;
            acc *= d;
        }
        strides
    }

    /// Maps a PyTorch-style dim (negative counts from the end) into `0..rank`.
    pub fn dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        normalize_dim(op, dim, self.rank())
    }

    /// The shape both operands broadcast to (NumPy/PyTorch rules, aligned at the right).
    pub fn broadcast(&self, other: &Shape, op: &'static str) -> Result<Shape> {
        let (a, b) = (&self.0, &other.0);
        let n = a.len().max(b.len());
        let mut out: Dims = smallvec::smallvec![0; n];
        for (i, o) in out.iter_mut().enumerate() {
            let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
            let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
            *o = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => {
                    return Err(Error::ShapeMismatch {
                        op,
                        lhs: self.clone(),
                        rhs: other.clone(),
                        hint: "the shapes cannot be broadcast together",
                    })
                }
            };
        }
        let out = Shape(out);
        out.checked_elements(op)?;
        Ok(out)
    }
}

// Note [Checked sizes]
// Every tensor ember makes has a shape whose size product (zeros counted as ones) is at most
// `MAX_ELEMENTS` = isize::MAX, and every storage spans at most isize::MAX bytes (Rust's limit
// for one allocation). Shapes from the user (creation, reshape, expand) and shapes an op
// derives from its operands (broadcasting, matmul, cat, conv, pooling, one_hot) are checked
// where they are made, so `numel()` and `contiguous_strides()` of an existing tensor never
// overflow and need no check; byte sizes are checked where storage is allocated
// ([`checked_bytes`]). Overflow is `Error::InvalidArgument` naming the sizes, never a wrapped
// product (a tensor of [2^32, 2^32] with 0 elements) or a "capacity overflow" panic.

/// The most elements (and the largest size product) a tensor may have: `isize::MAX`.
pub const MAX_ELEMENTS: usize = isize::MAX as usize;

/// `n` elements of `dtype` in bytes, or an `Error::InvalidArgument` of `op` naming both when
/// that exceeds `isize::MAX` bytes (the most one allocation can hold).
pub fn checked_bytes(op: &'static str, n: usize, dtype: crate::DType) -> Result<usize> {
    n.checked_mul(dtype.size_in_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "{n} elements of {dtype} would take more than {} bytes, more than memory can address; use smaller sizes",
                    isize::MAX
                ),
            )
        })
}

/// `a * b` or an `Error::InvalidArgument` of `op` naming `what` and both factors.
pub fn checked_mul(op: &'static str, what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .filter(|&p| p <= MAX_ELEMENTS)
        .ok_or_else(|| Error::invalid(op, format!("{what} {a} × {b} overflows; use smaller sizes")))
}

/// Maps `dim` in `[-rank, rank)` into `0..rank`; a scalar accepts -1 and 0 as PyTorch does.
pub fn normalize_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let r = rank.max(1) as isize;
    if dim < -r || dim >= r {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            min: -r,
            max: r - 1,
        });
    }
    Ok(if dim < 0 { (dim + r) as usize } else { dim as usize })
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Shape {
        Shape(Dims::from_vec(v))
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Shape {
        Shape(Dims::from_slice(v))
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Shape {
        Shape(Dims::from_slice(&v))
    }
}

impl From<&Shape> for Shape {
    fn from(v: &Shape) -> Shape {
        v.clone()
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Shape {
        Shape::scalar()
    }
}

impl From<usize> for Shape {
    fn from(v: usize) -> Shape {
        Shape(smallvec::smallvec![v])
    }
}

/// The sizes argument of [`reshape`](crate::Tensor::reshape), [`view`](crate::Tensor::view)
/// and [`expand`](crate::Tensor::expand): one size per dim, where `-1` means "infer this one"
/// (reshape, view) or "keep this one" (expand), as PyTorch's `x.view(-1, n)`.
///
/// Note [Size arguments]: it is built from what a program has at hand, so no cast is needed:
/// arrays, slices and `Vec`s of `usize` (the type of creation shapes and `dims()`), of `isize`,
/// `i64` or `i32` (so literals like `[-1, 4]` work), a [`Shape`], a single size, or a tuple of
/// up to six sizes of mixed types for a `-1` beside `usize` sizes:
/// `x.view((-1, ntokens))` for PyTorch's `x.view(-1, ntokens)`. A `usize` beyond `isize::MAX`
/// cannot be a size and becomes an invalid (negative) one, reported by the op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes(SmallVec<[isize; INLINE_DIMS]>);

impl Sizes {
    /// The sizes, `-1` where one is inferred or kept.
    pub fn as_slice(&self) -> &[isize] {
        &self.0
    }
}

/// An integer that can be a size in [`Sizes`] (Note [Size arguments]).
pub trait SizeInt: Copy {
    /// The size as `isize`; out of range becomes `isize::MIN` (an invalid size).
    fn to_size(self) -> isize;
}

macro_rules! size_ints {
    ($($t:ty),*) => {$(
        impl SizeInt for $t {
            fn to_size(self) -> isize {
                isize::try_from(self).unwrap_or(isize::MIN)
            }
        }

        impl From<$t> for Sizes {
            fn from(v: $t) -> Sizes {
                Sizes(smallvec::smallvec![v.to_size()])
            }
        }
    )*};
}
size_ints!(usize, isize, i64, i32, u32);

impl<T: SizeInt> From<&[T]> for Sizes {
    fn from(v: &[T]) -> Sizes {
        Sizes(v.iter().map(|&d| d.to_size()).collect())
    }
}

impl<T: SizeInt, const N: usize> From<[T; N]> for Sizes {
    fn from(v: [T; N]) -> Sizes {
        Sizes::from(&v[..])
    }
}

impl<T: SizeInt, const N: usize> From<&[T; N]> for Sizes {
    fn from(v: &[T; N]) -> Sizes {
        Sizes::from(&v[..])
    }
}

impl<T: SizeInt> From<Vec<T>> for Sizes {
    fn from(v: Vec<T>) -> Sizes {
        Sizes::from(&v[..])
    }
}

impl<T: SizeInt> From<&Vec<T>> for Sizes {
    fn from(v: &Vec<T>) -> Sizes {
        Sizes::from(&v[..])
    }
}

impl From<&Shape> for Sizes {
    fn from(v: &Shape) -> Sizes {
        Sizes::from(v.dims())
    }
}

impl From<Shape> for Sizes {
    fn from(v: Shape) -> Sizes {
        Sizes::from(v.dims())
    }
}

impl From<()> for Sizes {
    /// No sizes: the 0-d shape (`x.reshape(())`, PyTorch's `x.reshape([])`).
    fn from(_: ()) -> Sizes {
        Sizes(SmallVec::new())
    }
}

impl From<&Sizes> for Sizes {
    fn from(v: &Sizes) -> Sizes {
        v.clone()
    }
}

macro_rules! size_tuples {
    ($(($($t:ident $v:ident),+)),*) => {$(
        impl<$($t: SizeInt),+> From<($($t,)+)> for Sizes {
            fn from(($($v,)+): ($($t,)+)) -> Sizes {
                Sizes(smallvec::smallvec![$($v.to_size()),+])
            }
        }
    )*};
}
size_tuples!(
    (A a),
    (A a, B b),
    (A a, B b, C c),
    (A a, B b, C c, D d),
    (A a, B b, C c, D d, E e),
    (A a, B b, C c, D d, E e, F f)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_come_from_every_integer_form() {
        let want = [-1isize, 4];
        assert_eq!(Sizes::from([-1, 4]).as_slice(), want);
        assert_eq!(Sizes::from(&[-1i64, 4]).as_slice(), want);
        assert_eq!(Sizes::from((-1, 4usize)).as_slice(), want);
        assert_eq!(Sizes::from(vec![2usize, 3]).as_slice(), [2, 3]);
        assert_eq!(Sizes::from(&Shape::new([5, 6])).as_slice(), [5, 6]);
        assert_eq!(Sizes::from(7usize).as_slice(), [7]);
        assert_eq!(Sizes::from([usize::MAX]).as_slice(), [isize::MIN]);
    }

    #[test]
    fn broadcasting_aligns_right() {
        let s = |v: &[usize]| Shape::from(v);
        assert_eq!(s(&[3, 1, 5]).broadcast(&s(&[2, 1]), "t").unwrap(), s(&[3, 2, 5]));
        assert_eq!(s(&[]).broadcast(&s(&[4]), "t").unwrap(), s(&[4]));
        let err = s(&[3]).broadcast(&s(&[4]), "add").unwrap_err();
        assert!(err.to_string().contains("[3] and [4]"), "{err}");
    }

    #[test]
    fn dims_normalize_like_pytorch() {
        assert_eq!(normalize_dim("t", -1, 3).unwrap(), 2);
        assert_eq!(normalize_dim("t", 0, 0).unwrap(), 0);
        let err = normalize_dim("sum", 3, 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dimension out of range in sum: expected to be in range of [-3, 2], but got 3"
        );
    }
}
