//! Conversions: dtype casts, device moves, contiguous copies, and reading values to the host.

use crate::backend::host::{CpuElement, CpuStorage};
use crate::backend::CopyOps;
use crate::dispatch::{self, policy};
use crate::layout::Layout;
use crate::storage::{Storage, StorageRef};
use crate::{DType, Device, Error, Result, Tensor};

impl Tensor {
    /// The elements converted to `dtype` (a no-op returning `self` when already of it, which
    /// does not enter the dispatch point).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        dispatch::call_with(&policy::TO, [self], |[x], door| x.cast(dtype, door))
    }

    /// [`Tensor::to_dtype`]'s body, behind the dispatch point.
    fn cast(&self, dtype: DType, door: dispatch::Door) -> Result<Tensor> {
        let out = match self.twin(dtype) {
            Some(twin) => door.tensor_at(twin, Layout::contiguous(self.shape().clone())),
            None => {
                let storage = self.storage().read().to_dtype(self.layout(), dtype)?;
                door.tensor(storage, self.shape())
            }
        };
        if !dtype.is_floating_point() || !dispatch::graph::needs_grad(&[self]) {
            return Ok(out);
        }
        let src = self.dtype();
        Ok(door.record_cast("to_dtype", self, out, move |g, _| {
            Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }

    /// The valid twin of `dtype` of this tensor's storage, taken out, when the tensor is the
    /// whole storage, row-major (Note [Cast twins] in `storage/mod.rs`). A float32 parameter's
    /// bf16 twin taken by a capture becomes the buffer the captured step keeps its cast in
    /// (Note [Casts a captured step keeps] in `storage/graph_casts.rs`).
    fn twin(&self, dtype: DType) -> Option<crate::storage::StorageRef> {
        use crate::storage::graph_casts;
        if !self.is_whole_storage() {
            return None;
        }
        let s = self.storage();
        let graph = (self.dtype() == DType::F32 && dtype == DType::BF16)
            .then(|| graph_casts::capturing(self.device()))
            .flatten();
        let (twin, bound) = s
            .take_twin(dtype, graph.is_some())
            .filter(|(t, _)| t.read().len() == self.numel())?;
        Some(match graph {
            Some(g) if !bound => graph_casts::adopt(g, s, twin),
            _ => twin,
        })
    }

    /// [`Tensor::to_dtype`] keeping the strides of a dense view (a permutation of a row-major
    /// layout, with no gaps or overlaps), as PyTorch's `.to(dtype)` (`preserve_format`) does;
    /// autocast casts this way, so that an op sees the layout it would see in PyTorch (a
    /// transposed input stays transposed). Other layouts come out row-major.
    pub(crate) fn to_dtype_preserving_strides(&self, dtype: DType) -> Result<Tensor> {
        let l = self.layout();
        if dtype == self.dtype() || l.is_contiguous() || !is_dense(l) {
            return self.to_dtype(dtype);
        }
        dispatch::call_with(&policy::TO, [self], |[x], door| x.cast_dense(dtype, door))
    }

    /// [`Tensor::to_dtype_preserving_strides`] of a dense, non-contiguous view.
    fn cast_dense(&self, dtype: DType, door: dispatch::Door) -> Result<Tensor> {
        let l = self.layout();
        // The elements are exactly the storage range [offset, offset + numel): cast it flat.
        let flat = Layout::new(crate::Shape::from(self.numel()), vec![1usize], l.offset());
        let storage = self.storage().read().to_dtype(&flat, dtype)?;
        let out = door.tensor_at(
            crate::storage::StorageRef::new(storage),
            Layout::new(l.shape().clone(), l.strides(), 0),
        );
        if !dispatch::graph::needs_grad(&[self]) {
            return Ok(out);
        }
        let src = self.dtype();
        Ok(door.record_cast("to_dtype", self, out, move |g, _| {
            Ok(vec![Some(g.to_dtype(src)?)])
        }))
    }

    /// The tensor on `device` (a no-op returning `self` when already there, which does not
    /// enter the dispatch point).
    pub fn to(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        dispatch::call_with(&policy::TO, [self], |[x], door| x.move_to(device, door))
    }

    /// [`Tensor::to`]'s body, behind the dispatch point.
    fn move_to(&self, device: Device, door: dispatch::Door) -> Result<Tensor> {
        let storage = self.storage().read().to_device(self.layout(), device)?;
        Ok(door.tensor(storage, self.shape()).into_copy_of(self, door))
    }

    /// `self`, a copy of `source` on another device, as [`Tensor::to`] returns it: under grad
    /// mode and when `source` requires grad, with the node that carries its gradient back to
    /// `source`'s device (also the copies of `cuda::comm::broadcast_coalesced`).
    pub(crate) fn into_copy_of(self, source: &Tensor, door: dispatch::Door) -> Tensor {
        if !dispatch::graph::needs_grad(&[source]) {
            return self;
        }
        let src = source.device();
        door.record("to_device", &[source], self, move |g, _| {
            Ok(vec![Some(g.gradient_to(src)?)])
        })
    }

    /// `to(device)` for a gradient in backward: when nothing but the engine holds it (its
    /// handle and its memory), nothing reads or writes it after the copy, and a copy between
    /// GPUs runs on a side stream (`to_device_private`, Note [Peer copies]).
    pub(crate) fn gradient_to(&self, device: Device) -> Result<Tensor> {
        match (self.is_private(), self.device(), device) {
            (true, Device::Cuda(from), Device::Cuda(to)) if from != to => {
                dispatch::call_with(&policy::TO, [self], |[x], door| {
                    // A weight gradient computed in row blocks crosses block by block
                    // (Note [Gradients in row blocks]).
                    let blocks = x.storage().take_row_block_events().filter(|_| x.rank() == 2);
                    let row_len = x.dims().get(1).copied().unwrap_or(0);
                    let storage =
                        x.storage()
                            .read()
                            .to_device_private(x.layout(), to, blocks.as_deref(), row_len)?;
                    Ok(door.tensor(storage, x.shape()))
                })
            }
            _ => self.to(device),
        }
    }

    /// Whether nothing but this handle holds the tensor and its memory.
    pub(crate) fn is_private(&self) -> bool {
        std::sync::Arc::strong_count(&self.0) == 1 && self.storage().is_unique()
    }

    /// A copy in page-locked host memory (`Tensor.pin_memory()`), from which copies to a GPU
    /// are faster and can be asynchronous; `self` when already pinned. Needs a CUDA driver.
    pub fn pin_memory(&self) -> Result<Tensor> {
        if self.device() != Device::Cpu {
            return Err(Error::invalid(
                "pin_memory",
                format!("only CPU tensors can be pinned, this one is on {}", self.device()),
            ));
        }
        if self.is_pinned() && self.is_contiguous() && self.storage_offset() == 0 {
            return Ok(self.clone());
        }
        dispatch::call_with(&policy::PIN_MEMORY, [self], |_, door| {
            let storage = StorageRef::pinned_copy(&self.to_cpu_storage()?)?;
            Ok(door.tensor_at(storage, crate::layout::Layout::contiguous(self.shape().clone())))
        })
    }

    /// True when the tensor's memory is page-locked host memory (`Tensor.is_pinned()`).
    pub fn is_pinned(&self) -> bool {
        self.storage().is_pinned()
    }

    /// As [`Tensor::to`], but a copy from pinned host memory to a GPU returns at once and runs
    /// on the current stream (`tensor.to(device, non_blocking=True)`); the source is kept alive
    /// until the copy is done. Other copies behave as `to`.
    pub fn to_non_blocking(&self, device: Device) -> Result<Tensor> {
        let Device::Cuda(ordinal) = device else {
            return self.to(device);
        };
        if !(self.is_pinned() && self.is_contiguous()) || dispatch::graph::needs_grad(&[self]) {
            return self.to(device);
        }
        dispatch::call_with(&policy::TO, [self], |[x], door| {
            let out = Storage::alloc(Device::Cuda(ordinal), x.dtype(), x.numel())?;
            x.storage()
                .copy_pinned_async(x.storage_offset(), x.numel(), &out, 0)?;
            Ok(door.tensor(out, x.shape().clone()))
        })
    }

    /// Copies `src` into `self` as [`Tensor::copy_`] does, asynchronously when `src` is pinned
    /// host memory and `self` a contiguous GPU tensor of the same dtype and shape
    /// (`dst.copy_(src, non_blocking=True)`).
    pub fn copy_non_blocking_(&self, src: &Tensor) -> Result<Tensor> {
        let direct = src.is_pinned()
            && src.is_contiguous()
            && self.is_contiguous()
            && self.dtype() == src.dtype()
            && self.shape() == src.shape()
            && matches!(self.device(), Device::Cuda(_))
            && !dispatch::graph::needs_grad(&[self, src]);
        if !direct {
            return self.copy_(src);
        }
        // Only the destination enters the dispatch point (as `copy_`): the source is on the host.
        dispatch::call_with(&policy::COPY_, [self], |[this], _| {
            let dst = this.storage().write();
            src.storage().copy_pinned_async(
                src.storage_offset(),
                src.numel(),
                &dst,
                this.storage_offset(),
            )?;
            Ok(self.clone())
        })
    }

    /// A row-major copy, or `self` when already contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy_out(&policy::CONTIGUOUS)
    }

    /// A copy with its own storage (`Tensor.clone()` in PyTorch; gradients flow through).
    pub fn deep_clone(&self) -> Result<Tensor> {
        self.copy_out(&policy::CLONE)
    }

    /// A row-major copy into new storage, entering as `op`; the gradient passes unchanged.
    fn copy_out(&self, op: &'static dispatch::Op) -> Result<Tensor> {
        dispatch::call(
            op,
            [self],
            |[x], door| {
                let storage = x.storage().read().to_dtype(x.layout(), x.dtype())?;
                Ok(door.tensor(storage, x.shape()))
            },
            |_, _, _| Ok(|g: &Tensor, _: &[bool]| Ok(vec![Some(g.clone())])),
        )
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
        let cpu = self.to_cpu_storage().map_err(|e| e.in_op("Tensor::to_vec"))?;
        Ok(T::slice(&cpu).expect("dtype checked above").to_vec())
    }

    /// The elements converted to f64, in row-major order (any dtype).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        crate::dispatch::row_blocks::settle_read(self)?;
        let cpu = self.storage().read().to_cpu(self.layout());
        let cpu = cpu.map_err(|e| e.in_op("Tensor::to_vec_f64"))?;
        let cpu = CopyOps::to_dtype(&cpu, &Layout::contiguous(self.shape()), DType::F64)?;
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
        dispatch::named(&policy::ITEM, &[self], || {
            Ok(self.to_vec::<T>().map_err(|e| e.in_op("Tensor::item"))?[0])
        })
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
        Ok(self.to_vec_f64().map_err(|e| e.in_op("Tensor::item_f64"))?[0])
    }

    /// Row-major host copy of the elements.
    pub(crate) fn to_cpu_storage(&self) -> Result<CpuStorage> {
        crate::dispatch::row_blocks::settle_read(self)?;
        self.storage().read().to_cpu(self.layout())
    }
}

/// True when `l` covers a gap-free range of its storage exactly once: its dims of size > 1,
/// ordered by stride, are row-major packed.
fn is_dense(l: &Layout) -> bool {
    if l.numel() == 0 {
        return false;
    }
    let mut dims: crate::shape::Dims = (0..l.dims().len()).filter(|&d| l.dims()[d] > 1).collect();
    dims.sort_by_key(|&d| l.strides()[d]);
    let mut expected = 1;
    for d in dims {
        if l.strides()[d] != expected {
            return false;
        }
        expected *= l.dims()[d];
    }
    true
}
