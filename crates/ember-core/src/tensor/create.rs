//! Tensor creation: from host data, constant fills, ranges and `*_like` forms
//! (random creation is in `random/tensor.rs`).

use crate::backend::host::{CpuElement, CpuStorage};
use crate::dispatch::{self, policy, Op};
use crate::memory::try_vec;
use crate::shape::MAX_ELEMENTS;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

impl Tensor {
    /// A tensor holding `data` with `shape` on `device` (`torch.tensor(data).reshape(shape)`).
    pub fn from_vec<T: CpuElement>(data: Vec<T>, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let numel = shape.checked_elements("from_vec")?;
        if data.len() != numel {
            return Err(Error::invalid(
                "from_vec",
                format!(
                    "{} elements cannot have shape {shape} ({numel} elements)",
                    data.len()
                ),
            ));
        }
        dispatch::enter(&policy::TENSOR, device, |door| {
            Ok(door.tensor(Storage::from_cpu(T::wrap(data), device)?, shape))
        })
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: CpuElement>(data: &[T], shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-d tensor holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        dispatch::enter(&policy::SCALAR_TENSOR, device, |_| {
            Tensor::full((), value, dtype, device)
        })
    }

    pub fn full(shape: impl Into<Shape>, value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::made(&policy::FULL, shape.into(), dtype, device, |n| {
            Storage::full(device, dtype, n, value)
        })
    }

    /// A tensor of `shape` over the storage `make` gives for its element count, once `shape`
    /// and its bytes pass `op`'s checks; `op` enters the dispatch point as a factory on `device`.
    fn made(
        op: &'static Op,
        shape: Shape,
        dtype: DType,
        device: Device,
        make: impl FnOnce(usize) -> Result<Storage>,
    ) -> Result<Tensor> {
        let numel = shape.checked_elements(op.name)?;
        crate::shape::checked_bytes(op.name, numel, dtype)?;
        dispatch::enter(op, device, |door| Ok(door.tensor(make(numel)?, shape)))
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        dispatch::enter(&policy::ZEROS, device, |_| {
            Tensor::full(shape, 0.0, dtype, device)
        })
    }

    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        dispatch::enter(&policy::ONES, device, |_| Tensor::full(shape, 1.0, dtype, device))
    }

    /// A tensor whose contents are unspecified (`torch.empty`): on a GPU, memory from the
    /// caching allocator with whatever it held (no fill is queued, as PyTorch queues none);
    /// zeros on the CPU, where safe Rust reads only initialized memory.
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::made(&policy::EMPTY, shape.into(), dtype, device, |n| {
            Storage::alloc(device, dtype, n)
        })
    }

    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        dispatch::named(&policy::FULL_LIKE, &[self], || {
            Tensor::full(self.shape(), value, self.dtype(), self.device())
        })
    }

    pub fn zeros_like(&self) -> Result<Tensor> {
        dispatch::named(&policy::ZEROS_LIKE, &[self], || {
            Tensor::full(self.shape(), 0.0, self.dtype(), self.device())
        })
    }

    pub fn ones_like(&self) -> Result<Tensor> {
        dispatch::named(&policy::ONES_LIKE, &[self], || {
            Tensor::full(self.shape(), 1.0, self.dtype(), self.device())
        })
    }

    /// [`Tensor::empty`] of this tensor's shape, dtype and device (`torch.empty_like`).
    pub fn empty_like(&self) -> Result<Tensor> {
        dispatch::named(&policy::EMPTY_LIKE, &[self], || {
            Tensor::empty(self.shape(), self.dtype(), self.device())
        })
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
        let count = ((end - start) / step).ceil();
        if !(count <= MAX_ELEMENTS as f64) {
            return Err(Error::invalid(
                "arange",
                format!("{start}..{end} by {step} would have {count} elements, more than memory can address; use a larger step or a smaller range"),
            ));
        }
        let n = count as usize;
        let integral = |v: f64| v.fract() == 0.0 && v.abs() < (1u64 << 53) as f64;
        if dtype == DType::I64 && integral(start) && integral(step) {
            // Made on the device (no host copy: capture-safe), as PyTorch's `torch.arange(T)`.
            return Tensor::arange_i64(
                start as i64,
                start as i64 + n as i64 * step as i64,
                step as i64,
                device,
            );
        }
        Tensor::from_fn(&policy::ARANGE, [n], dtype, device, |i| start + i as f64 * step)
    }

    /// The integers `start, start + step, ...` below `end` (above it for a negative `step`) as
    /// an `I64` tensor, exactly (`torch.arange(start, end, step)` of integers, whose dtype is
    /// int64): `Tensor::arange_i64(0, t, 1, device)` for `torch.arange(T)` of positions.
    pub fn arange_i64(start: i64, end: i64, step: i64, device: Device) -> Result<Tensor> {
        if step == 0 {
            return Err(Error::invalid("arange", "step must be nonzero"));
        }
        if (end as i128 - start as i128) * (step as i128) < 0 {
            return Err(Error::invalid(
                "arange",
                format!("upper bound and lower bound inconsistent with step sign ({start}..{end} by {step})"),
            ));
        }
        let span = (end as i128 - start as i128).unsigned_abs();
        let n = span.div_ceil(step.unsigned_abs() as u128);
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(|| {
                Error::invalid(
                    "arange",
                    format!("{start}..{end} by {step} has more elements than memory can address"),
                )
            })?;
        crate::memory::check_host_alloc("arange", n, DType::I64)?;
        dispatch::enter(&policy::ARANGE, device, |door| {
            Ok(door.tensor(Storage::arange_i64(device, start, step, n)?, [n]))
        })
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
        Tensor::from_fn(&policy::LINSPACE, [steps], dtype, device, |i| {
            if i < half {
                start + step * i as f64
            } else {
                end - step * (steps - 1 - i) as f64
            }
        })
    }

    /// The `n`×`n` identity matrix (`torch.eye`).
    pub fn eye(n: usize, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::from_fn(&policy::EYE, [n, n], dtype, device, |i| {
            if i % n == i / n {
                1.0
            } else {
                0.0
            }
        })
    }

    /// A tensor of `shape` whose element `i` (row-major) is `f(i)` converted to `dtype`, made on
    /// the host with fallible allocation (Note [Fallible host allocation]) and moved to `device`.
    fn from_fn(
        op: &'static Op,
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        f: impl Fn(usize) -> f64,
    ) -> Result<Tensor> {
        let name = op.name;
        fn fill<T: CpuElement>(op: &'static str, n: usize, f: impl Fn(usize) -> f64) -> Result<CpuStorage> {
            let mut v = try_vec::<T>(op, n, T::DTYPE)?;
            v.extend((0..n).map(|i| T::from_f64(f(i))));
            Ok(T::wrap(v))
        }
        let shape = shape.into();
        let n = shape.checked_elements(name)?;
        dispatch::enter(op, device, |door| {
            let op = name;
            let cpu = match dtype {
                DType::Bool => fill::<bool>(op, n, f),
                DType::U8 => fill::<u8>(op, n, f),
                DType::I32 => fill::<i32>(op, n, f),
                DType::I64 => fill::<i64>(op, n, f),
                DType::F16 => fill::<half::f16>(op, n, f),
                DType::BF16 => fill::<half::bf16>(op, n, f),
                DType::F32 => fill::<f32>(op, n, f),
                DType::F64 => fill::<f64>(op, n, f),
            }?;
            Ok(door.tensor(Storage::from_cpu(cpu, device)?, shape))
        })
    }
}
