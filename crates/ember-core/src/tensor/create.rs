//! Tensor creation: from host data, constant fills, ranges and `*_like` forms
//! (random creation is in `random/tensor.rs`).

use crate::cpu::{CpuElement, CpuStorage};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

impl Tensor {
    /// A tensor holding `data` with `shape` on `device` (`torch.tensor(data).reshape(shape)`).
    pub fn from_vec<T: CpuElement>(data: Vec<T>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::invalid(
                "from_vec",
                format!(
                    "{} elements cannot have shape {shape} ({} elements)",
                    data.len(),
                    shape.numel()
                ),
            ));
        }
        Ok(Tensor::from_storage(
            Storage::from_cpu(T::wrap(data), device)?,
            shape,
        ))
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: CpuElement>(data: &[T], shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-d tensor holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full((), value, dtype, device)
    }

    pub fn full(shape: impl Into<Shape>, value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let numel = shape.dims().iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let numel = numel.filter(|n| {
            n.checked_mul(dtype.size_in_bytes())
                .is_some_and(|b| b <= isize::MAX as usize)
        });
        let numel = numel.ok_or_else(|| {
            Error::invalid(
                "full",
                format!("shape {shape} has more elements than memory can address"),
            )
        })?;
        let storage = Storage::full(device, dtype, numel, value)?;
        Ok(Tensor::from_storage(storage, shape))
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// A tensor whose contents are unspecified (zero-filled on the CPU).
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::zeros(shape, dtype, device)
    }

    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.shape(), value, self.dtype(), self.device())
    }

    pub fn zeros_like(&self) -> Result<Tensor> {
        self.full_like(0.0)
    }

    pub fn ones_like(&self) -> Result<Tensor> {
        self.full_like(1.0)
    }

    pub fn empty_like(&self) -> Result<Tensor> {
        self.full_like(0.0)
    }

    /// Values `start, start + step, ...` below `end` (`torch.arange`).
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("step must be finite and nonzero, got {step}"),
            ));
        }
        if (end - start) * step < 0.0 {
            return Err(Error::invalid(
                "arange",
                format!("upper bound and lower bound inconsistent with step sign ({start}..{end} by {step})"),
            ));
        }
        let n = ((end - start) / step).ceil() as usize;
        let values: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
        Tensor::from_f64s(values, n, dtype, device)
    }

    /// `steps` values evenly spaced from `start` to `end` inclusive (`torch.linspace`).
    pub fn linspace(start: f64, end: f64, steps: usize, dtype: DType, device: Device) -> Result<Tensor> {
        let step = if steps > 1 {
            (end - start) / (steps - 1) as f64
        } else {
            0.0
        };
        // PyTorch fills the second half backwards from `end` so that the last value is exact.
        let half = steps / 2;
        let values: Vec<f64> = (0..steps)
            .map(|i| {
                if i < half {
                    start + step * i as f64
                } else {
                    end - step * (steps - 1 - i) as f64
                }
            })
            .collect();
        Tensor::from_f64s(values, steps, dtype, device)
    }

    /// The `n`×`n` identity matrix (`torch.eye`).
    pub fn eye(n: usize, dtype: DType, device: Device) -> Result<Tensor> {
        let mut values = vec![0.0; n * n];
        for i in 0..n {
            values[i * n + i] = 1.0;
        }
        Tensor::from_f64s(values, [n, n], dtype, device)
    }

    fn from_f64s(values: Vec<f64>, shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let cpu = CpuStorage::F64(values).to_dtype(&crate::layout::Layout::contiguous(shape.clone()), dtype);
        Ok(Tensor::from_storage(Storage::from_cpu(cpu, device)?, shape))
    }
}
