//! What `#[derive(Module)]` (crate `ember-derive`) generates code against: [`ModuleField`],
//! implemented for every kind of field a module struct can hold, so that the derive learns
//! from a field's type (not its spelling) whether it holds tensors, children or nothing.
//!
//! - `Tensor`: a tensor of the kind the field's attribute says (parameter by default);
//! - every [`Module`] (layers, containers, `Box<dyn Module>`, derived models): a child;
//! - `Option<T>`, `Vec<T>`, `[T; N]`: what `T` holds; elements are named by index
//!   (`layers.0`), a `None` is skipped;
//! - plain data (numbers, `bool`, `char`, `String`, `&'static str`, `Device`, `DType`,
//!   `Reduction`, `PhantomData`): nothing.
//!
//! Not part of the public API: the derive is.

pub use crate::module::{join_name, Module, TensorKind, Training};
use ember_core::{DType, Device};
pub use ember_core::{Result, Tensor};

/// What a field holds, for the derive's visit order (own tensors before children).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldRole {
    /// Tensors of the module itself (parameters or buffers).
    Tensor,
    /// Child modules.
    Child,
    /// Neither: plain data.
    Nothing,
}

/// A field of a module struct, as `#[derive(Module)]` sees it.
pub trait ModuleField {
    /// What the field holds.
    const ROLE: FieldRole;

    /// Calls `f` with each tensor under `name` (children: with `name` as their prefix).
    fn visit_field(&self, name: &str, kind: TensorKind, f: &mut dyn FnMut(&str, &Tensor, TensorKind));

    /// As [`ModuleField::visit_field`], mutably.
    fn visit_field_mut(
        &mut self,
        name: &str,
        kind: TensorKind,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()>;

    /// Tells children the mode; nothing for tensors and data.
    fn set_training_field(&self, _training: bool) {}

    /// The mode of the first child held, if any.
    fn is_training_field(&self) -> Option<bool> {
        None
    }
}

impl ModuleField for Tensor {
    const ROLE: FieldRole = FieldRole::Tensor;

    fn visit_field(&self, name: &str, kind: TensorKind, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(name, self, kind)
    }

    fn visit_field_mut(
        &mut self,
        name: &str,
        kind: TensorKind,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        f(name, self, kind)
    }
}

impl<M: Module + ?Sized> ModuleField for M {
    const ROLE: FieldRole = FieldRole::Child;

    fn visit_field(&self, name: &str, _kind: TensorKind, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.visit(name, f)
    }

    fn visit_field_mut(
        &mut self,
        name: &str,
        _kind: TensorKind,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.visit_mut(name, f)
    }

    fn set_training_field(&self, training: bool) {
        self.set_training(training)
    }

    fn is_training_field(&self) -> Option<bool> {
        Some(self.is_training())
    }
}

impl<T: ModuleField> ModuleField for Option<T> {
    const ROLE: FieldRole = T::ROLE;

    fn visit_field(&self, name: &str, kind: TensorKind, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        if let Some(t) = self {
            t.visit_field(name, kind, f)
        }
    }

    fn visit_field_mut(
        &mut self,
        name: &str,
        kind: TensorKind,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        match self {
            Some(t) => t.visit_field_mut(name, kind, f),
            None => Ok(()),
        }
    }

    fn set_training_field(&self, training: bool) {
        if let Some(t) = self {
            t.set_training_field(training)
        }
    }

    fn is_training_field(&self) -> Option<bool> {
        self.as_ref().and_then(T::is_training_field)
    }
}

/// `Vec<T>` and `[T; N]`: elements named by index, as `nn.ModuleList` and
/// `nn.ParameterList` name theirs.
macro_rules! indexed_field {
    ($([$($g:tt)*] $ty:ty),*) => {$(
        impl<$($g)*> ModuleField for $ty {
            const ROLE: FieldRole = T::ROLE;

            fn visit_field(&self, name: &str, kind: TensorKind, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                for (i, t) in self.iter().enumerate() {
                    t.visit_field(&join_name(name, &i.to_string()), kind, f);
                }
            }

            fn visit_field_mut(
                &mut self,
                name: &str,
                kind: TensorKind,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                for (i, t) in self.iter_mut().enumerate() {
                    t.visit_field_mut(&join_name(name, &i.to_string()), kind, f)?;
                }
                Ok(())
            }

            fn set_training_field(&self, training: bool) {
                for t in self.iter() {
                    t.set_training_field(training);
                }
            }

            fn is_training_field(&self) -> Option<bool> {
                self.iter().find_map(T::is_training_field)
            }
        }
    )*};
}

indexed_field!([T: ModuleField] Vec<T>, [T: ModuleField, const N: usize] [T; N]);

/// Plain data: holds no tensors and no children.
macro_rules! data_field {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        impl<$($g)*> ModuleField for $ty {
            const ROLE: FieldRole = FieldRole::Nothing;

            fn visit_field(&self, _: &str, _: TensorKind, _: &mut dyn FnMut(&str, &Tensor, TensorKind)) {}

            fn visit_field_mut(
                &mut self,
                _: &str,
                _: TensorKind,
                _: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                Ok(())
            }
        }
    )*};
}

data_field!(
    [] bool, [] char, [] u8, [] u16, [] u32, [] u64, [] u128, [] usize,
    [] i8, [] i16, [] i32, [] i64, [] i128, [] isize, [] f32, [] f64,
    [] String, [] &'static str, [] Device, [] DType, [] crate::functional::Reduction, [] crate::module::Training, [T: ?Sized] std::marker::PhantomData<T>,
);
