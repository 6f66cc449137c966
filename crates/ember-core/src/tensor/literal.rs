//! Tensors from Rust values with the shape in their type (`torch.tensor(data)`): `From` for
//! `Vec`s, slices and nested arrays of any element type, and the [`tensor!`](crate::tensor!)
//! macro for literals.
//!
//! Note [Literal dtypes]: `torch.tensor([1.0, 2.0])` is float32 and `torch.tensor([1, 2])`
//! int64. Rust literals take the type the context asks for, so the macro's trait
//! ([`TensorLiteral`]) is implemented for `f32`, `i64` and `bool` only: an untyped float
//! literal becomes `f32` and an untyped integer `i64`, as in PyTorch. Typed data of another
//! element type (`Vec<f64>`, `[u8; 4]`) goes through `Tensor::from`, which takes every element
//! type. All of these are CPU tensors; move them with `.to(device)`.
//!
//! Nested arrays are never ragged, and a `Vec` or an array holds at most `isize::MAX` bytes,
//! below `MAX_ELEMENTS`: every conversion here is infallible.

use half::{bf16, f16};

use crate::backend::host::CpuElement;
use crate::storage::Storage;
use crate::{Shape, Tensor};

/// A CPU tensor of `data` with `dims` (the length of `data` is their product by construction).
fn host_tensor<T: CpuElement>(data: Vec<T>, dims: &[usize]) -> Tensor {
    debug_assert_eq!(data.len(), dims.iter().product::<usize>());
    crate::dispatch::enter(&crate::dispatch::policy::TENSOR, crate::Device::Cpu, |door| {
        door.tensor(Storage::Cpu(T::wrap(data)), Shape::from(dims))
    })
}

macro_rules! from_host_data {
    ($($t:ty),*) => {$(
        impl From<Vec<$t>> for Tensor {
            /// A 1-D CPU tensor of the elements (`torch.tensor(list)`).
            fn from(v: Vec<$t>) -> Tensor {
                let n = v.len();
                host_tensor(v, &[n])
            }
        }

        impl From<&[$t]> for Tensor {
            /// A 1-D CPU tensor of a copy of the elements.
            fn from(v: &[$t]) -> Tensor {
                host_tensor(v.to_vec(), &[v.len()])
            }
        }

        impl<const N: usize> From<[$t; N]> for Tensor {
            /// A 1-D CPU tensor `[N]`.
            fn from(v: [$t; N]) -> Tensor {
                host_tensor(v.to_vec(), &[N])
            }
        }

        impl<const N: usize, const M: usize> From<[[$t; N]; M]> for Tensor {
            /// A 2-D CPU tensor `[M, N]`.
            fn from(v: [[$t; N]; M]) -> Tensor {
                host_tensor(v.concat(), &[M, N])
            }
        }

        impl<const N: usize, const M: usize, const K: usize> From<[[[$t; N]; M]; K]> for Tensor {
            /// A 3-D CPU tensor `[K, M, N]`.
            fn from(v: [[[$t; N]; M]; K]) -> Tensor {
                host_tensor(v.concat().concat(), &[K, M, N])
            }
        }
    )*};
}
from_host_data!(f32, f64, f16, bf16, i64, i32, u8, bool);

/// A literal the [`tensor!`](crate::tensor!) macro takes: `f32`, `i64` or `bool` values,
/// nested in arrays (Note [Literal dtypes]).
pub trait TensorLiteral {
    /// The tensor of the literal.
    fn into_tensor(self) -> Tensor;
}

macro_rules! literal_elements {
    ($($t:ty),*) => {$(
        impl TensorLiteral for $t {
            fn into_tensor(self) -> Tensor {
                host_tensor(vec![self], &[])
            }
        }

        impl<const N: usize> TensorLiteral for [$t; N] {
            fn into_tensor(self) -> Tensor {
                Tensor::from(self)
            }
        }

        impl<const N: usize, const M: usize> TensorLiteral for [[$t; N]; M] {
            fn into_tensor(self) -> Tensor {
                Tensor::from(self)
            }
        }

        impl<const N: usize, const M: usize, const K: usize> TensorLiteral for [[[$t; N]; M]; K] {
            fn into_tensor(self) -> Tensor {
                Tensor::from(self)
            }
        }
    )*};
}
literal_elements!(f32, i64, bool);

/// What [`tensor!`](crate::tensor!) expands to.
#[doc(hidden)]
pub fn from_literal<L: TensorLiteral>(literal: L) -> Tensor {
    literal.into_tensor()
}

/// `torch.tensor(data)`: a CPU tensor of a literal, its shape from the nesting and its dtype
/// PyTorch's default (float literals `F32`, integer literals `I64`; Note [Literal dtypes]).
///
/// ```
/// use ember_core::{tensor, DType};
/// let x = tensor!([[1.0, 2.0], [3.0, 4.0]]); // [2, 2], f32
/// assert_eq!((x.dims(), x.dtype()), (&[2usize, 2][..], DType::F32));
/// let i = tensor![1, 2, 3]; // [3], i64
/// assert_eq!((i.dims(), i.dtype()), (&[3usize][..], DType::I64));
/// let s = tensor!(0.5); // 0-d
/// assert_eq!(s.rank(), 0);
/// ```
#[macro_export]
macro_rules! tensor {
    ($x:expr $(,)?) => {
        $crate::tensor::from_literal($x)
    };
    ($($x:expr),+ $(,)?) => {
        $crate::tensor::from_literal([$($x),+])
    };
}

#[cfg(test)]
mod tests {
    use crate::DType;

    #[test]
    fn literals_take_pytorchs_default_dtypes_and_nested_shapes() {
        let x = crate::tensor!([[[1.0, 2.0]], [[3.0, 4.0]]]);
        assert_eq!((x.dims(), x.dtype()), (&[2usize, 1, 2][..], DType::F32));
        assert_eq!(x.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        let b = crate::tensor![true, false];
        assert_eq!(b.dtype(), DType::Bool);
        let v = crate::Tensor::from(vec![1.5f64, 2.5]);
        assert_eq!((v.dims(), v.dtype()), (&[2usize][..], DType::F64));
        let m = crate::Tensor::from([[1u8, 2, 3], [4, 5, 6]]);
        assert_eq!(
            (m.dims(), m.to_vec::<u8>().unwrap()),
            (&[2usize, 3][..], vec![1, 2, 3, 4, 5, 6])
        );
        let empty = crate::Tensor::from(Vec::<f32>::new());
        assert_eq!(empty.dims(), [0]);
    }
}
