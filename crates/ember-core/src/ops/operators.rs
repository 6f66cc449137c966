//! `std::ops` on tensors, so formulas read like the math: `(&a + &b)?`, `(&a * 2.0)?`,
//! `(1.0 - &p)?`, `(-&x)?`. Each operator calls the named method (`add`, `mul_scalar`, `neg`,
//! ...) and returns its [`Result`]: a shape, dtype or device mismatch is an error to `?`, never
//! a panic, which is why the operators return `Result<Tensor>` and not `Tensor`.
//!
//! Operands: `&Tensor` or `Tensor` on either side of `+ - * /` (a `Tensor` operand is
//! consumed, so `((&a + &b)? * &c)?` chains without naming the temporary); on the right any
//! scalar (`f64`, `f32`, `i64`, `i32`, ...: `impl Into<Scalar>`), on the left `f64` and `i64`
//! (`2.0 * &x`, `1 - &x`; one float and one integer type keep literals unambiguous; write
//! `f64::from(v)` for an f32 `v`). A scalar follows PyTorch's rules for Python
//! numbers: it does not widen the tensor's dtype (`f16 * 2.0` stays f16, `i64 * 2.5` becomes
//! the default float dtype). `scalar - t` and `scalar / t` compute `scalar op t` directly
//! (`torch.rsub`, `torch.true_divide` with a scalar first), not through a negation or a
//! reciprocal, so they round once.

use crate::{Result, Scalar, Tensor};
use std::ops::{Add, Div, Mul, Neg, Sub};

macro_rules! tensor_tensor {
    ($($trait:ident, $method:ident => $op:ident;)*) => {$(
        impl $trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                self.$op(rhs)
            }
        }

        impl $trait<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                self.$op(&rhs)
            }
        }

        impl $trait<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                (&self).$op(rhs)
            }
        }

        impl $trait<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                (&self).$op(&rhs)
            }
        }
    )*};
}

tensor_tensor! {
    Add, add => add;
    Sub, sub => sub;
    Mul, mul => mul;
    Div, div => div;
}

/// `scalar op t` for the non-commutative ops: the scalar as a 0-d tensor of the dtype
/// `t op scalar` computes in, then the tensor-tensor op (one rounding, as PyTorch).
fn scalar_first(value: Scalar, t: &Tensor, op: fn(&Tensor, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let dtype = t.dtype().promote_with_scalar(value.kind());
    op(&Tensor::scalar(value.to_f64(), dtype, t.device())?, t)
}

macro_rules! tensor_scalar {
    ($($t:ty),*) => {$(
        impl<S: Into<Scalar>> Add<S> for $t {
            type Output = Result<Tensor>;
            fn add(self, rhs: S) -> Result<Tensor> {
                self.add_scalar(rhs)
            }
        }

        impl<S: Into<Scalar>> Sub<S> for $t {
            type Output = Result<Tensor>;
            fn sub(self, rhs: S) -> Result<Tensor> {
                self.sub_scalar(rhs)
            }
        }

        impl<S: Into<Scalar>> Mul<S> for $t {
            type Output = Result<Tensor>;
            fn mul(self, rhs: S) -> Result<Tensor> {
                self.mul_scalar(rhs)
            }
        }

        impl<S: Into<Scalar>> Div<S> for $t {
            type Output = Result<Tensor>;
            fn div(self, rhs: S) -> Result<Tensor> {
                self.div_scalar(rhs)
            }
        }
    )*};
}

tensor_scalar!(&Tensor, Tensor);

macro_rules! scalar_tensor {
    ($($s:ty),*) => {$(
        scalar_tensor!(@one $s, &Tensor);
        scalar_tensor!(@one $s, Tensor);
    )*};
    (@one $s:ty, $t:ty) => {
        impl Add<$t> for $s {
            type Output = Result<Tensor>;
            fn add(self, rhs: $t) -> Result<Tensor> {
                rhs.add_scalar(self)
            }
        }

        impl Sub<$t> for $s {
            type Output = Result<Tensor>;
            fn sub(self, rhs: $t) -> Result<Tensor> {
                scalar_first(self.into(), &rhs, Tensor::sub)
            }
        }

        impl Mul<$t> for $s {
            type Output = Result<Tensor>;
            fn mul(self, rhs: $t) -> Result<Tensor> {
                rhs.mul_scalar(self)
            }
        }

        impl Div<$t> for $s {
            type Output = Result<Tensor>;
            fn div(self, rhs: $t) -> Result<Tensor> {
                scalar_first(self.into(), &rhs, Tensor::div)
            }
        }
    };
}

// A scalar on the left: one float and one integer type, so that `2.0 * &x` and `2 * &x`
// infer their literal's type (with f32 beside f64 the literal would be ambiguous).
scalar_tensor!(f64, i64);

impl Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}

impl Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Tensor};

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), [v.len()], Device::Cpu).unwrap()
    }

    fn vals(t: crate::Result<Tensor>) -> Vec<f32> {
        t.unwrap().to_vec::<f32>().unwrap()
    }

    #[test]
    fn operators_match_the_named_methods() {
        let (a, b) = (t(&[1.0, 2.0, 3.0]), t(&[4.0, 5.0, 8.0]));
        assert_eq!(vals(&a + &b), [5.0, 7.0, 11.0]);
        assert_eq!(vals(&a - &b), [-3.0, -3.0, -5.0]);
        assert_eq!(vals(&a * &b), [4.0, 10.0, 24.0]);
        assert_eq!(vals(&b / &a), [4.0, 2.5, 8.0 / 3.0]);
        assert_eq!(vals(-&a), [-1.0, -2.0, -3.0]);
        assert_eq!(vals(&a * 2.0), [2.0, 4.0, 6.0]);
        assert_eq!(vals(&a + 1i64), [2.0, 3.0, 4.0]);
        assert_eq!(vals(&a - 0.5f32), [0.5, 1.5, 2.5]);
        assert_eq!(vals(&a * 2i32), [2.0, 4.0, 6.0]);
        assert_eq!(vals(2 * &a), [2.0, 4.0, 6.0]);
        assert_eq!(vals(&a / 2), [0.5, 1.0, 1.5]);
        assert_eq!(vals(2.0 * &a), [2.0, 4.0, 6.0]);
        assert_eq!(vals(1.0 - &a), [0.0, -1.0, -2.0]);
        assert_eq!(vals(6.0 / &a), [6.0, 3.0, 2.0]);
        // Owned operands chain without naming temporaries.
        let y = ((&a + &b).unwrap() * &a).unwrap();
        assert_eq!(vals(y - 1.0), [4.0, 13.0, 32.0]);
    }

    #[test]
    fn operators_keep_pytorch_dtype_rules_and_report_errors() {
        let i = Tensor::from_vec(vec![1i64, 2, 3], [3], Device::Cpu).unwrap();
        assert_eq!((&i * 2).unwrap().dtype(), DType::I64);
        assert_eq!((&i * 2.5).unwrap().dtype(), DType::F32);
        assert_eq!((1.0 - &i).unwrap().to_vec::<f32>().unwrap(), [0.0, -1.0, -2.0]);
        let h = t(&[1.0, 2.0]).to_dtype(DType::F16).unwrap();
        assert_eq!((&h * 2.0).unwrap().dtype(), DType::F16);
        assert_eq!((3.0 / &h).unwrap().dtype(), DType::F16);
        let err = (&t(&[1.0, 2.0]) + &t(&[1.0, 2.0, 3.0])).unwrap_err();
        assert!(
            err.to_string().contains("[2]") && err.to_string().contains("[3]"),
            "{err}"
        );
    }

    #[test]
    fn operators_record_gradients() {
        let x = t(&[1.0, 2.0]).requires_grad_(true).unwrap();
        // y = Σ (3x - 1/x) ⇒ dy/dx = 3 + 1/x²
        let y = ((3.0 * &x).unwrap() - (1.0 / &x).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        y.backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [4.0, 3.25]);
    }
}
