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

#[cfg(test)]
mod tests {
    use super::*;

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
