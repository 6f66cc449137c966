//! [`Module`]: the `torch.nn.Module` of ember, and [`ModuleExt`], the methods every module
//! gets from it (`parameters`, `named_parameters`, `train`/`eval`, `to_device`, `to_dtype`,
//! `zero_grad`, `state_dict`, `load_state_dict`, ...).
//!
//! A module owns its tensors as plain fields and says what they are through two visitors:
//! `visit` hands each tensor to a callback with its dotted name (PyTorch's `fc1.weight`,
//! `0.bias`) and its [`TensorKind`]; `visit_mut` does the same with `&mut Tensor` so that
//! `to_device`/`to_dtype` can replace them. Everything else is built on these two.
//!
//! Note [Visit order]: a module visits its own parameters, then its own buffers, then its
//! children in registration order, each child under `prefix.child_name`. That is the order of
//! PyTorch's `named_parameters()` and `state_dict()` for the same model, so names and order
//! agree with a PyTorch checkpoint of the same architecture.
//!
//! Invariants: parameters are leaf tensors (they require grad unless the user froze them);
//! buffers (running statistics, counters) never require grad. `forward` takes `&self`: the
//! only state a forward pass changes is written in place into buffers (BatchNorm's running
//! statistics), which every clone of the tensor handle sees.

use crate::state_dict::{self, IncompatibleKeys, StateDictResult};
use ember_core::{no_grad, DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// What a module's tensor is: a trainable parameter or a buffer (`register_buffer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A learnable tensor, listed by `parameters()` and updated by optimizers.
    Parameter,
    /// State that is saved with the module but not trained (running statistics, counters).
    Buffer,
}

/// A module's mode (`module.training`): training (the default) or evaluation.
///
/// It sits in an atomic so that [`ModuleExt::train`] and [`ModuleExt::eval`] take `&self`, as
/// PyTorch's `model.eval()` needs no exclusive access: a model shared by reference with an
/// evaluation function can be switched there. Read it with [`Training::get`] in a forward
/// (`self.training.get()` for PyTorch's `self.training`). A clone holds its own flag with the
/// same value (a replica or a deep copy switches on its own).
pub struct Training(AtomicBool);

impl Training {
    /// A flag set to `training`.
    pub fn new(training: bool) -> Training {
        Training(AtomicBool::new(training))
    }

    /// True in training mode.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the mode.
    pub fn set(&self, training: bool) {
        self.0.store(training, Ordering::Relaxed)
    }
}

impl Default for Training {
    /// Training mode, as a new PyTorch module.
    fn default() -> Training {
        Training::new(true)
    }
}

impl Clone for Training {
    fn clone(&self) -> Training {
        Training::new(self.get())
    }
}

impl std::fmt::Debug for Training {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

impl From<bool> for Training {
    fn from(training: bool) -> Training {
        Training::new(training)
    }
}

/// A layer or a model (`torch.nn.Module`): its parameters, buffers, children and mode.
///
/// `forward` is not part of this trait, so that a module's forward can take and return what it
/// needs: layers that map one tensor to one tensor implement [`Forward`] (what
/// [`crate::Sequential`] chains); a model with several inputs or outputs (an RNN's
/// `(input, hidden)`, a Transformer's `(src, tgt)`) writes an inherent method, e.g.
/// `fn forward(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)>`.
/// `#[derive(Module)]` implements this trait from the struct's fields.
pub trait Module: Send + Sync {
    /// Calls `f` with each parameter and buffer, its dotted name under `prefix` and its kind,
    /// in the order of Note [Visit order].
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind));

    /// As [`Module::visit`], with mutable access so that tensors can be replaced.
    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()>;

    /// Sets training mode on this module and all its children (through `&self`: the flag is a
    /// [`Training`]).
    fn set_training(&self, training: bool);

    /// True in training mode (`module.training`).
    fn is_training(&self) -> bool;
}

/// The forward pass of a module that maps one tensor to one tensor (`module(x)`): every layer
/// of [`crate::layers`] with a single input, and what [`crate::Sequential`] chains.
pub trait Forward: Module {
    /// Computes the module's output for `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// `prefix.name`, or `name` when `prefix` is empty.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

impl<M: Forward + ?Sized> Forward for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        (**self).visit(prefix, f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        (**self).visit_mut(prefix, f)
    }

    fn set_training(&self, training: bool) {
        (**self).set_training(training)
    }

    fn is_training(&self) -> bool {
        (**self).is_training()
    }
}

/// The methods PyTorch's `nn.Module` provides, for every [`Module`] (also `dyn Module`).
pub trait ModuleExt: Module {
    /// The parameters in the order of Note [Visit order] (`module.parameters()`), each tensor
    /// once (Note [Tied parameters]).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }

    /// The parameters with their dotted names (`module.named_parameters()`); a tensor
    /// registered under several names (a tied weight) is listed once, under its first name
    /// (Note [Tied parameters]).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        named_of_kind(self, TensorKind::Parameter)
    }

    /// The buffers (`module.buffers()`).
    fn buffers(&self) -> Vec<Tensor> {
        self.named_buffers().into_iter().map(|(_, t)| t).collect()
    }

    /// The buffers with their dotted names (`module.named_buffers()`).
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        named_of_kind(self, TensorKind::Buffer)
    }

    /// Total number of elements over all parameters (a tied weight counted once).
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Tensor::numel).sum()
    }

    /// Switches to training mode (`module.train()`); `&self` is enough (see [`Training`]).
    fn train(&self) {
        self.set_training(true)
    }

    /// Switches to evaluation mode (`module.eval()`): dropout off, BatchNorm uses running stats.
    fn eval(&self) {
        self.set_training(false)
    }

    /// Moves every parameter, buffer and gradient to `device` in place (`module.to(device)`):
    /// the module keeps the same tensor handles, which now refer to storage on `device`, so an
    /// optimizer, a `DistributedDataParallel` or any clone of a parameter taken before the move
    /// stays valid and sees the moved tensor (see [`Tensor::to_device_`]). Parameters stay
    /// leaves with their `requires_grad` flag and hooks.
    fn to_device(&mut self, device: Device) -> Result<()> {
        let mut result = Ok(());
        self.visit("", &mut |_, t, _| {
            if result.is_ok() {
                result = move_in_place(t, device);
            }
        });
        result
    }

    /// Casts every floating-point parameter, buffer and gradient to the floating-point `dtype`
    /// (`module.to(dtype)`); integer buffers (`num_batches_tracked`) keep their dtype.
    fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_floating_point() {
            return Err(ember_core::Error::UnsupportedDType {
                op: "Module::to_dtype",
                dtype,
                hint: "modules can only be cast to floating point dtypes",
            });
        }
        // A tied tensor (visited under each of its names) is converted once and stays tied.
        let mut done: Vec<(Tensor, Tensor)> = Vec::new();
        self.visit_mut("", &mut |_, t, _| {
            if let Some((_, new)) = done.iter().find(|(old, _)| old.is_same(t)) {
                *t = new.clone();
            } else if t.dtype().is_floating_point() && t.dtype() != dtype {
                let new = convert(t, |x| x.to_dtype(dtype))?;
                done.push((t.clone(), new.clone()));
                *t = new;
            }
            Ok(())
        })
    }

    /// Releases every parameter's gradient (`zero_grad(set_to_none=True)`, PyTorch 2's default).
    fn zero_grad(&self) -> Result<()> {
        let mut result = Ok(());
        self.visit("", &mut |_, t, kind| {
            if kind == TensorKind::Parameter && result.is_ok() {
                result = t.set_grad(None);
            }
        });
        result
    }

    /// Parameters and buffers by dotted name, detached and sharing storage with the module
    /// (`module.state_dict()`).
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, t, _| out.push((name.to_owned(), t.detach())));
        out
    }

    /// Copies `state` into the module's tensors (`module.load_state_dict(state, strict)`); see
    /// [`crate::state_dict`] for the checks. Nothing is copied when a check fails.
    fn load_state_dict(
        &mut self,
        state: &[(String, Tensor)],
        strict: bool,
    ) -> StateDictResult<IncompatibleKeys> {
        state_dict::load_into(self, state, strict)
    }
}

impl<M: Module + ?Sized> ModuleExt for M {}

/// The tensors of `kind` with their names, each tensor once.
///
/// Note [Tied parameters]: a model may register one tensor under two names (GPT-2's
/// `lm_head.weight = transformer.wte.weight`). PyTorch's `named_parameters()` and
/// `named_buffers()` list it once (`remove_duplicate=True`, by object identity), so an
/// optimizer steps it once with the sum of both uses' gradients. Identity here is
/// [`Tensor::is_same`] (clones of one handle); a view or a detached copy of a parameter is
/// another tensor, as in PyTorch. `state_dict()` keeps every name, as PyTorch's does.
fn named_of_kind<M: Module + ?Sized>(m: &M, kind: TensorKind) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = Vec::new();
    m.visit("", &mut |name, t, k| {
        if k == kind && !out.iter().any(|(_, seen)| seen.is_same(t)) {
            out.push((name.to_owned(), t.clone()));
        }
    });
    out
}

/// Moves `t`'s storage and its gradient's to `device`, keeping every handle.
fn move_in_place(t: &Tensor, device: Device) -> Result<()> {
    t.to_device_(device)?;
    if let Some(g) = t.grad() {
        g.to_device_(device)?;
    }
    Ok(())
}

/// `f(t)` as a new leaf with `t`'s `requires_grad`, and `f(t.grad)` as its gradient.
fn convert(t: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let _g = no_grad();
    let new = f(&t.detach())?;
    let new = if new.shares_storage_with(t) {
        new.deep_clone()?
    } else {
        new
    };
    if t.requires_grad() {
        new.requires_grad_(true)?;
    }
    if let Some(g) = t.grad() {
        new.set_grad(Some(f(&g)?))?;
    }
    Ok(new)
}
