//! [`Tensor`]: a cheap-to-clone handle to a strided view of a storage, with a runtime dtype and
//! device, and autograd state (its accessors and the autograd API: `requires_grad_`, `grad`,
//! hooks, `detach`).
//!
//! The handle lives in the dispatch layer, as c10's `TensorImpl` sits below ATen's ops: the
//! dispatch point takes and makes tensors, and a tensor holds the graph node that made it
//! (`graph.rs`), so the type and the graph are one layer, and nothing here imports the op
//! layer. `Tensor`'s ops are written above (`crate::ops`, one file per family; creation,
//! conversions and printing in `crate::tensor`). A `Tensor` is immutable as a view: ops return
//! new tensors; in-place ops (`add_`, `copy_`, ...) write through to the shared storage and
//! bump its version counter.

use super::graph::Node;
use super::Door;
use crate::layout::Layout;
use crate::storage::{Storage, StorageRef};
use crate::{DType, Device, Error, Result, Shape};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A gradient hook (`Tensor.register_hook`): sees the gradient of a tensor and may replace it.
pub type Hook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A hook run after a gradient was accumulated into a leaf's `.grad`; receives the leaf.
pub type PostAccumulateGradHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// An n-dimensional array on a device, as `torch.Tensor`. Cloning shares the data.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

pub(crate) struct TensorImpl {
    pub(crate) storage: StorageRef,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    /// The node that made this tensor; `None` for leaves.
    pub(crate) grad_fn: Option<Arc<Node>>,
    /// Whether this leaf requires grad: read by every op (the dispatch point's autograd step),
    /// so it lives outside the `meta` lock.
    requires_grad: AtomicBool,
    meta: Mutex<AutogradMeta>,
}

#[derive(Default)]
pub(crate) struct AutogradMeta {
    pub(crate) grad: Option<Tensor>,
    pub(crate) retains_grad: bool,
    pub(crate) hooks: Vec<(u64, Hook)>,
    /// Run after backward stored a new `.grad` in this leaf (see `autograd::callbacks`).
    pub(crate) post_accumulate_grad_hooks: Vec<(u64, PostAccumulateGradHook)>,
}

impl TensorImpl {
    pub(crate) fn meta(&self) -> MutexGuard<'_, AutogradMeta> {
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Removes a hook registered with [`Tensor::register_hook`] or
/// [`Tensor::register_post_accumulate_grad_hook`] when `remove` is called.
pub struct HookHandle {
    tensor: std::sync::Weak<TensorImpl>,
    /// The node a non-leaf's hook lives on.
    node: Option<std::sync::Weak<Node>>,
    id: u64,
}

impl HookHandle {
    pub fn remove(self) {
        if let Some(t) = self.tensor.upgrade() {
            let mut meta = t.meta();
            meta.hooks.retain(|(id, _)| *id != self.id);
            meta.post_accumulate_grad_hooks.retain(|(id, _)| *id != self.id);
        }
        if let Some(node) = self.node.as_ref().and_then(std::sync::Weak::upgrade) {
            node.hooks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(id, _)| *id != self.id);
        }
    }
}

static NEXT_HOOK_ID: AtomicU64 = AtomicU64::new(0);

/// Tensors made from storage: only behind the dispatch point (Note [The door] in
/// `mod.rs`).
impl Door {
    /// A tensor over all of `storage`, row-major with `shape`.
    pub(crate) fn tensor(self, storage: Storage, shape: impl Into<Shape>) -> Tensor {
        let layout = Layout::contiguous(shape);
        debug_assert_eq!(layout.numel(), storage.len());
        let dtype = storage.dtype();
        let storage = StorageRef::with_shape(storage, layout.shape());
        Tensor::from_parts_of(storage, layout, dtype)
    }

    /// A tensor over the shared `storage` at `layout`.
    pub(crate) fn tensor_at(self, storage: StorageRef, layout: Layout) -> Tensor {
        let dtype = storage.read().dtype();
        Tensor::from_parts_of(storage, layout, dtype)
    }
}

impl Tensor {
    fn from_parts_of(storage: StorageRef, layout: Layout, dtype: DType) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage,
            layout,
            dtype,
            grad_fn: None,
            requires_grad: AtomicBool::new(false),
            meta: Mutex::new(AutogradMeta::default()),
        }))
    }

    /// A new tensor over the same storage with another layout, outside autograd.
    pub(crate) fn view_with(&self, layout: Layout) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage: self.0.storage.clone(),
            layout,
            dtype: self.0.dtype,
            grad_fn: None,
            requires_grad: AtomicBool::new(false),
            meta: Mutex::new(AutogradMeta::default()),
        }))
    }

    /// The same data, made the output of `node` (see `Door::record`).
    pub(crate) fn with_grad_fn(self, node: Arc<Node>) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            grad_fn: Some(node),
            requires_grad: AtomicBool::new(false),
            meta: Mutex::new(AutogradMeta::default()),
        }))
    }

    pub(crate) fn storage(&self) -> &StorageRef {
        &self.0.storage
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.0.layout
    }

    pub fn shape(&self) -> &Shape {
        self.0.layout.shape()
    }

    pub fn dims(&self) -> &[usize] {
        self.0.layout.dims()
    }

    /// Number of dimensions (`Tensor.dim()` / `ndim`).
    pub fn rank(&self) -> usize {
        self.dims().len()
    }

    /// Size of dimension `dim` (negative counts from the end).
    ///
    /// A 0-d tensor has no dimensions, so every `dim` is an error there, as in PyTorch
    /// (`torch.tensor(1.).size(-1)` raises; `dims()` is the empty list).
    pub fn size(&self, dim: isize) -> Result<usize> {
        self.require_dims("size", dim)?;
        Ok(self.dims()[self.shape().dim("size", dim)?])
    }

    /// An error naming `op` and `dim` when `self` is 0-d, for the ops that PyTorch refuses on
    /// a tensor without dimensions (`size`, `split`, `chunk`, `unbind`, ...).
    pub(crate) fn require_dims(&self, op: &'static str, dim: isize) -> Result<()> {
        if self.rank() > 0 {
            return Ok(());
        }
        Err(Error::invalid(
            op,
            format!(
                "dimension specified as {dim} but tensor has no dimensions; {op} expects at least a 1-dimensional tensor (reshape the 0-d tensor to [1] first)"
            ),
        ))
    }

    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The device of the tensor's storage (which [`Tensor::to_device_`] can change in place).
    #[inline]
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }

    /// Moves this tensor's storage to `device` in place, so that this handle, its clones and
    /// every view of the same storage now refer to the data on `device` (what PyTorch's
    /// `param.data = param.data.to(device)` achieves for `module.to(device)`); a no-op when
    /// already there. Values, shape, strides, `requires_grad` and `.grad` are unchanged (move
    /// the gradient with its own call). See Note [Moving a storage in place] in `storage/mod.rs`.
    pub fn to_device_(&self, device: Device) -> Result<()> {
        if device == self.device() {
            return Ok(());
        }
        self.0.storage.move_to(device)
    }

    /// Exchanges the elements of this tensor's storage with those of `other`'s, in place:
    /// afterwards every handle and view of each storage sees the other's elements (at its own
    /// offsets and strides); shapes, autograd state and version counters are unchanged. Both
    /// storages hold one dtype on one device; their lengths may differ. FSDP frees gathered
    /// parameters that autograd saved by swapping with an empty tensor, and fills them again
    /// before backward by swapping with a new gather (PyTorch's `untyped_storage().resize_()`;
    /// Note [Swapping storages] in `storage/mod.rs`): a view whose storage holds fewer
    /// elements than it addresses must not be used until it is filled again.
    pub fn swap_storage_(&self, other: &Tensor) -> Result<()> {
        self.0.storage.swap(&other.0.storage)
    }

    /// Strides in elements.
    pub fn stride(&self) -> &[usize] {
        self.0.layout.strides()
    }

    pub fn storage_offset(&self) -> usize {
        self.0.layout.offset()
    }

    /// Whether this tensor is all of its storage, row-major from its first element (what a
    /// storage-wide state, such as a cast twin, describes).
    pub(crate) fn is_whole_storage(&self) -> bool {
        self.is_contiguous() && self.storage_offset() == 0 && self.storage().read().len() == self.numel()
    }

    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// Address of the first element (`Tensor.data_ptr()`): a host address for CPU tensors, a
    /// device address for GPU tensors. For identity checks and interop, not for dereferencing.
    pub fn data_ptr(&self) -> usize {
        let offset = self.storage_offset() * self.dtype().size_in_bytes();
        self.storage().read().address() + offset
    }

    /// True when both are handles of one tensor (Python's `a is b` on tensors): clones of a
    /// handle are the same tensor; a view or a detached handle of it is another.
    pub fn is_same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// True when both tensors view the same storage (views alias each other).
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        self.0.storage.same_storage(&other.0.storage)
    }

    /// The storage's version counter: bumped by each in-place write to it.
    pub fn version(&self) -> u64 {
        self.0.storage.version()
    }

    // ---- autograd ----------------------------------------------------------------------

    pub fn requires_grad(&self) -> bool {
        self.0.grad_fn.is_some() || self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Sets whether autograd records ops on this leaf; returns the tensor for chaining.
    pub fn requires_grad_(&self, requires_grad: bool) -> Result<Tensor> {
        if self.0.grad_fn.is_some() {
            if requires_grad {
                return Ok(self.clone());
            }
            return Err(Error::Autograd(
                "you can only change requires_grad flags of leaf tensors; use detach() to get a tensor without grad".into(),
            ));
        }
        if requires_grad && !self.dtype().is_floating_point() {
            return Err(Error::UnsupportedDType {
                op: "requires_grad_",
                dtype: self.dtype(),
                hint: "only floating point tensors can require gradients",
            });
        }
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
        Ok(self.clone())
    }

    /// True for tensors not produced by a recorded op (user-created, or not requiring grad).
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }

    /// The accumulated gradient, if backward has reached this tensor.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.meta().grad.clone()
    }

    /// Replaces the gradient (`x.grad = g`); `None` releases it (`x.grad = None`).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.shape() != self.shape() {
                return Err(Error::ShapeMismatch {
                    op: "set_grad",
                    lhs: self.shape().clone(),
                    rhs: g.shape().clone(),
                    hint: "a gradient must have its tensor's shape",
                });
            }
            if g.device() != self.device() {
                return Err(Error::DeviceMismatch {
                    op: "set_grad",
                    lhs: self.device(),
                    rhs: g.device(),
                });
            }
        }
        self.0.meta().grad = grad;
        Ok(())
    }

    /// Makes backward store this non-leaf tensor's gradient in `.grad`.
    pub fn retain_grad(&self) -> Result<()> {
        if !self.requires_grad() {
            return Err(Error::Autograd(
                "can't retain_grad on a tensor that has requires_grad=false".into(),
            ));
        }
        self.0.meta().retains_grad = true;
        Ok(())
    }

    pub fn retains_grad(&self) -> bool {
        self.0.meta().retains_grad
    }

    /// The name of the op that produced this tensor (`grad_fn` in PyTorch), if any.
    pub fn grad_fn_name(&self) -> Option<&'static str> {
        self.0.grad_fn.as_ref().map(|n| n.name)
    }

    /// Registers `hook`, called with this tensor's gradient each time backward computes it;
    /// a hook may return a replacement gradient.
    pub fn register_hook<F>(&self, hook: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    {
        if !self.requires_grad() {
            return Err(Error::Autograd(
                "cannot register a hook on a tensor that doesn't require gradient".into(),
            ));
        }
        let id = NEXT_HOOK_ID.fetch_add(1, Ordering::Relaxed);
        // A leaf keeps its hooks; a non-leaf's live on the node that made it, as long as the
        // graph (`Node::hooks`).
        let node = match &self.0.grad_fn {
            Some(node) => {
                node.hooks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((id, Arc::new(hook)));
                Some(Arc::downgrade(node))
            }
            None => {
                self.0.meta().hooks.push((id, Arc::new(hook)));
                None
            }
        };
        Ok(HookHandle {
            tensor: Arc::downgrade(&self.0),
            node,
            id,
        })
    }

    /// Registers `hook`, called with this leaf each time backward has accumulated a gradient
    /// into its `.grad` (`register_post_accumulate_grad_hook`); the hook reads `.grad` from the
    /// tensor it receives. Only leaves that require grad take one. See Note
    /// [Post-accumulate-grad hooks] in `autograd/callbacks.rs`.
    ///
    /// ```
    /// use ember_core::{Device, Tensor};
    /// let w = Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)?.requires_grad_(true)?;
    /// w.register_post_accumulate_grad_hook(|p| {
    ///     // E.g. scale the stored gradient in place (an optimizer step per parameter also fits).
    ///     p.grad().unwrap().mul_scalar_(0.5)?;
    ///     Ok(())
    /// })?;
    /// w.mul_scalar(4.0)?.sum_all()?.backward()?;
    /// assert_eq!(w.grad().unwrap().to_vec::<f32>()?, [2.0, 2.0]);
    /// # Ok::<(), ember_core::Error>(())
    /// ```
    pub fn register_post_accumulate_grad_hook<F>(&self, hook: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    {
        if !self.is_leaf() {
            return Err(Error::Autograd(
                "post accumulate grad hooks cannot be registered on non-leaf tensors".into(),
            ));
        }
        if !self.requires_grad() {
            return Err(Error::Autograd(
                "cannot register a hook on a tensor that doesn't require gradient".into(),
            ));
        }
        let id = NEXT_HOOK_ID.fetch_add(1, Ordering::Relaxed);
        self.0
            .meta()
            .post_accumulate_grad_hooks
            .push((id, Arc::new(hook)));
        Ok(HookHandle {
            tensor: Arc::downgrade(&self.0),
            node: None,
            id,
        })
    }

    /// A tensor sharing this one's data, cut from the graph (requires_grad false).
    pub fn detach(&self) -> Tensor {
        self.view_with(self.0.layout.clone())
    }
}
