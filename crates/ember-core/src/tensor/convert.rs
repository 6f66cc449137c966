//! Conversions: dtype casts, device moves, contiguous copies, and reading values to the host.

use crate::autograd;
use crate::cpu::{CpuElement, CpuStorage};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result, Tensor};

impl Tensor {
    /// The elements converted to `dtype` (a no-op returning `self` when already of it).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let storage = self.storage().read().to_dtype(self.layout(), dtype)?;
        let out = Tensor::from_storage(storage, self.shape());
        if !dtype.is_floating_point() || !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        let src = self.dtype();
        Ok(autograd::record("to_dtype", &[self], out, move |g, _| {
            Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }

    /// The tensor on `device` (a no-op returning `self` when already there).
    pub fn to(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let storage = self.storage().read().to_device(self.layout(), device)?;
        let out = Tensor::from_storage(storage, self.shape());
        if !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        let src = self.device();
        Ok(autograd::record("to_device", &[self], out, move |g, _| {
            Ok(vec![Some(g.to(src)?)])
        }))
    }

    /// A row-major copy, or `self` when already contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let storage = self.storage().read().to_dtype(self.layout(), self.dtype())?;
        let out = Tensor::from_storage(storage, self.shape());
        if !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        Ok(autograd::record("contiguous", &[self], out, |g, _| {
            Ok(vec![Some(g.clone())])
        }))
    }

    /// A copy with its own storage (`Tensor.clone()` in PyTorch; gradients flow through).
    pub fn deep_clone(&self) -> Result<Tensor> {
        let storage = self.storage().read().to_dtype(self.layout(), self.dtype())?;
        let out = Tensor::from_storage(storage, self.shape());
        if !autograd::needs_grad(&[self]) {
            return Ok(out);
        }
        Ok(autograd::record("clone", &[self], out, |g, _| {
            Ok(vec![Some(g.clone())])
        }))
    }

    /// The elements in row-major order; `T` must match the dtype (see [`Tensor::to_dtype`]).
    pub fn to_vec<T: CpuElement>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: "to_vec",
                expected: T::DTYPE,
                found: self.dtype(),
            });
        }
        let cpu = self.to_cpu_storage()?;
        Ok(T::slice(&cpu).expect("dtype checked above").to_vec())
    }

    /// The elements converted to f64, in row-major order (any dtype).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        let cpu = self.storage().read().to_cpu(self.layout())?;
        let cpu = cpu.to_dtype(&Layout::contiguous(self.shape()), DType::F64);
        match cpu {
            CpuStorage::F64(v) => Ok(v),
            _ => unreachable!("converted to f64 above"),
        }
    }

    /// The value of a one-element tensor (`Tensor.item()`); `T` must match the dtype.
    pub fn item<T: CpuElement>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!(
                    "a tensor with {} elements cannot be converted to a scalar",
                    self.numel()
                ),
            ));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// The value of a one-element tensor of any dtype, as f64.
    pub fn item_f64(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!(
                    "a tensor with {} elements cannot be converted to a scalar",
                    self.numel()
                ),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// Row-major host copy of the elements.
    pub(crate) fn to_cpu_storage(&self) -> Result<CpuStorage> {
        self.storage().read().to_cpu(self.layout())
    }
}
