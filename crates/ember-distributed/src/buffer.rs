//! Host copies of tensors as the CPU backend sends and reduces them.
//!
//! A [`HostBuffer`] holds the elements of one tensor, or of several concatenated, in their own
//! dtype; [`HostBuffer::bytes`] gives a range of them in little-endian order for the wire, and
//! [`HostBuffer::reduce_from`] folds a peer's bytes into a range. Integer sums and products wrap
//! (as PyTorch's do); float max/min propagate NaN; f16 and bf16 are combined in f32 and rounded
//! back after each step, as NCCL's half-precision ring does; bool sum/max are "or",
//! product/min "and".

use std::ops::Range;

use ember_core::cpu::CpuElement;
use ember_core::{no_grad, DType, Device, Error, Result, Tensor};
use half::{bf16, f16};

use crate::backend::ReduceOp;

/// An element as it travels: little-endian bytes and the reduction ops.
trait Wire: CpuElement + Copy {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn take(b: &[u8]) -> Self;
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
}

macro_rules! float_wire {
    ($t:ty, $n:expr) => {
        impl Wire for $t {
            const SIZE: usize = $n;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunks of SIZE"))
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Product => a * b,
                    _ if a.is_nan() || b.is_nan() => <$t>::NAN,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
        }
    };
}
float_wire!(f32, 4);
float_wire!(f64, 8);

macro_rules! half_wire {
    ($t:ty) => {
        impl Wire for $t {
            const SIZE: usize = 2;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunks of SIZE"))
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                <$t>::from_f32(f32::combine(a.to_f32(), b.to_f32(), op))
            }
        }
    };
}
half_wire!(f16);
half_wire!(bf16);

macro_rules! int_wire {
    ($t:ty, $n:expr) => {
        impl Wire for $t {
            const SIZE: usize = $n;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunks of SIZE"))
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
        }
    };
}
int_wire!(u8, 1);
int_wire!(i32, 4);
int_wire!(i64, 8);

impl Wire for bool {
    const SIZE: usize = 1;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn take(b: &[u8]) -> Self {
        b[0] != 0
    }
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max => a | b,
            ReduceOp::Product | ReduceOp::Min => a & b,
        }
    }
}

/// The elements of one or more tensors on the host, in their dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    Bool(Vec<bool>),
    U8(Vec<u8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Runs `$body` with `$v` bound to the buffer's vector, whatever its element type.
macro_rules! each {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            HostBuffer::Bool($v) => $body,
            HostBuffer::U8($v) => $body,
            HostBuffer::I32($v) => $body,
            HostBuffer::I64($v) => $body,
            HostBuffer::F16($v) => $body,
            HostBuffer::BF16($v) => $body,
            HostBuffer::F32($v) => $body,
            HostBuffer::F64($v) => $body,
        }
    };
}

fn range_bytes<T: Wire>(v: &[T], r: Range<usize>) -> Vec<u8> {
    let mut out = Vec::with_capacity(r.len() * T::SIZE);
    for &x in &v[r] {
        x.put(&mut out);
    }
    out
}

fn fold<T: Wire>(v: &mut [T], r: Range<usize>, bytes: &[u8], op: Option<ReduceOp>) {
    for (x, b) in v[r].iter_mut().zip(bytes.chunks_exact(T::SIZE)) {
        let y = T::take(b);
        *x = match op {
            Some(op) => T::combine(*x, y, op),
            None => y,
        };
    }
}

impl HostBuffer {
    /// The elements of `tensors`, concatenated in row-major order; all must share a dtype.
    pub fn from_tensors(op: &'static str, tensors: &[Tensor]) -> Result<HostBuffer> {
        let dtype = tensors.first().map_or(DType::F32, Tensor::dtype);
        for t in tensors {
            if t.dtype() != dtype {
                return Err(Error::DTypeMismatch {
                    op,
                    expected: dtype,
                    found: t.dtype(),
                });
            }
        }
        fn gather<T: CpuElement>(ts: &[Tensor]) -> Result<Vec<T>> {
            let mut out = Vec::new();
            for t in ts {
                out.extend(t.to_vec::<T>()?);
            }
            Ok(out)
        }
        Ok(match dtype {
            DType::Bool => HostBuffer::Bool(gather(tensors)?),
            DType::U8 => HostBuffer::U8(gather(tensors)?),
            DType::I32 => HostBuffer::I32(gather(tensors)?),
            DType::I64 => HostBuffer::I64(gather(tensors)?),
            DType::F16 => HostBuffer::F16(gather(tensors)?),
            DType::BF16 => HostBuffer::BF16(gather(tensors)?),
            DType::F32 => HostBuffer::F32(gather(tensors)?),
            DType::F64 => HostBuffer::F64(gather(tensors)?),
        })
    }

    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> HostBuffer {
        match dtype {
            DType::Bool => HostBuffer::Bool(vec![false; n]),
            DType::U8 => HostBuffer::U8(vec![0; n]),
            DType::I32 => HostBuffer::I32(vec![0; n]),
            DType::I64 => HostBuffer::I64(vec![0; n]),
            DType::F16 => HostBuffer::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::ZERO; n]),
            DType::F32 => HostBuffer::F32(vec![0.0; n]),
            DType::F64 => HostBuffer::F64(vec![0.0; n]),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::Bool(_) => DType::Bool,
            HostBuffer::U8(_) => DType::U8,
            HostBuffer::I32(_) => DType::I32,
            HostBuffer::I64(_) => DType::I64,
            HostBuffer::F16(_) => DType::F16,
            HostBuffer::BF16(_) => DType::BF16,
            HostBuffer::F32(_) => DType::F32,
            HostBuffer::F64(_) => DType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        each!(self, v => v.len())
    }

    /// The elements of `r` as little-endian bytes.
    pub fn bytes(&self, r: Range<usize>) -> Vec<u8> {
        each!(self, v => range_bytes(v, r))
    }

    /// Overwrites the elements of `r` with `bytes` (as made by [`HostBuffer::bytes`]).
    pub fn assign_from(&mut self, r: Range<usize>, bytes: &[u8]) {
        each!(self, v => fold(v, r, bytes, None))
    }

    /// Combines the elements of `r` with `bytes` under `op`.
    pub fn reduce_from(&mut self, r: Range<usize>, bytes: &[u8], op: ReduceOp) {
        each!(self, v => fold(v, r, bytes, Some(op)))
    }

    /// Divides every element by `n` (the last step of [`ReduceOp::Avg`]; floats only, checked
    /// before the collective starts).
    pub fn divide(&mut self, n: usize) {
        match self {
            HostBuffer::F32(v) => v.iter_mut().for_each(|x| *x /= n as f32),
            HostBuffer::F64(v) => v.iter_mut().for_each(|x| *x /= n as f64),
            HostBuffer::F16(v) => v
                .iter_mut()
                .for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32)),
            HostBuffer::BF16(v) => v
                .iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32)),
            _ => {}
        }
    }

    /// Copies the elements of `r` into `dst` (which has `r.len()` elements), in place, on
    /// whatever device `dst` lives.
    pub fn write_into(&self, r: Range<usize>, dst: &Tensor) -> Result<()> {
        let shape = dst.dims().to_vec();
        let src = each!(self, v => Tensor::from_slice(&v[r], shape, Device::Cpu))?;
        let _guard = no_grad();
        dst.copy_(&src)?;
        Ok(())
    }
}

/// Bytes per element of `dtype` on the wire.
pub fn wire_size(dtype: DType) -> usize {
    match dtype {
        DType::Bool | DType::U8 => 1,
        DType::F16 | DType::BF16 => 2,
        DType::I32 | DType::F32 => 4,
        DType::I64 | DType::F64 => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_reduce() {
        let a = Tensor::from_vec(vec![1.0f32, -2.0, 3.5], 3, Device::Cpu).unwrap();
        let mut buf = HostBuffer::from_tensors("t", &[a]).unwrap();
        let bytes = buf.bytes(0..3);
        assert_eq!(bytes.len(), 12);
        buf.reduce_from(0..3, &bytes, ReduceOp::Sum);
        assert_eq!(buf, HostBuffer::F32(vec![2.0, -4.0, 7.0]));
        buf.reduce_from(1..2, &HostBuffer::F32(vec![f32::NAN]).bytes(0..1), ReduceOp::Max);
        let HostBuffer::F32(v) = &buf else { unreachable!() };
        assert!(v[1].is_nan());
        let mut i = HostBuffer::I32(vec![i32::MAX, 3]);
        i.reduce_from(0..2, &HostBuffer::I32(vec![1, 5]).bytes(0..2), ReduceOp::Sum);
        assert_eq!(i, HostBuffer::I32(vec![i32::MIN, 8]));
        let mut h = HostBuffer::BF16(vec![bf16::from_f32(1.5)]);
        h.reduce_from(
            0..1,
            &HostBuffer::BF16(vec![bf16::from_f32(2.0)]).bytes(0..1),
            ReduceOp::Product,
        );
        assert_eq!(h, HostBuffer::BF16(vec![bf16::from_f32(3.0)]));
    }
}
