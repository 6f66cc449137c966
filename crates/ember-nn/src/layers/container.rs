//! Containers: [`Sequential`] (children named `"0"`, `"1"`, ... and applied in order; each a
//! [`Forward`] layer), [`ModuleList`] (any [`Module`]s held and named the same way, no
//! forward), and [`Flatten`].
//!
//! Note [Container clones]: both containers are `Clone`, as every built-in layer is, so a
//! `Sequential` can be wrapped by `DataParallel` or checkpointed. A clone is what cloning a
//! layer gives: a new structure whose tensors are handles to the same storage (replace them
//! through `visit_mut`, as `DataParallel` does for its replicas, or deep-copy them). Children
//! added with `push`/`with` are `Clone` and are cloned; a child added already boxed
//! (`push_boxed`, for a module that is not `Clone`) is shared between the clones, and
//! `visit_mut` on a container whose boxed child is shared answers a typed error instead of
//! replacing the other clone's tensors.

use super::stateless_module;
use crate::module::{join_name, Forward, Module, TensorKind, Training};
use ember_core::{Error, Result, Tensor};
use std::sync::Arc;

/// One child: cloned with the container (`Owned`), or shared with its clones (`Shared`,
/// from `push_boxed`); Note [Container clones].
enum Child<O: ?Sized, S: ?Sized> {
    Owned(Box<O>),
    Shared(Arc<S>),
}

macro_rules! container {
    ($(#[$doc:meta])* $ty:ident, $bound:ident, $item:ident) => {
        /// A child that can be cloned behind a `Box` (every `Clone` module).
        trait $item: $bound {
            fn clone_item(&self) -> Box<dyn $item>;
            fn as_dyn(&self) -> &dyn $bound;
            fn as_dyn_mut(&mut self) -> &mut dyn $bound;
        }

        impl<T: $bound + Clone + 'static> $item for T {
            fn clone_item(&self) -> Box<dyn $item> {
                Box::new(self.clone())
            }

            fn as_dyn(&self) -> &dyn $bound {
                self
            }

            fn as_dyn_mut(&mut self) -> &mut dyn $bound {
                self
            }
        }

        impl Clone for Child<dyn $item, dyn $bound> {
            fn clone(&self) -> Self {
                match self {
                    Child::Owned(m) => Child::Owned(m.clone_item()),
                    Child::Shared(m) => Child::Shared(m.clone()),
                }
            }
        }

        impl Child<dyn $item, dyn $bound> {
            fn get(&self) -> &dyn $bound {
                match self {
                    Child::Owned(m) => m.as_dyn(),
                    Child::Shared(m) => &**m,
                }
            }

            fn get_mut(&mut self) -> Option<&mut dyn $bound> {
                match self {
                    Child::Owned(m) => Some(m.as_dyn_mut()),
                    Child::Shared(m) => Arc::get_mut(m).map(|m| m as &mut dyn $bound),
                }
            }
        }

        $(#[$doc])*
        #[derive(Clone)]
        pub struct $ty {
            modules: Vec<Child<dyn $item, dyn $bound>>,
            training: Training,
        }

        impl $ty {
            #[doc = concat!("An empty `", stringify!($ty), "` in training mode.")]
            pub fn new() -> $ty {
                $ty {
                    modules: Vec::new(),
                    training: Training::new(true),
                }
            }

            fn push_child(&mut self, child: Child<dyn $item, dyn $bound>) -> &mut $ty {
                child.get().set_training(self.training.get());
                self.modules.push(child);
                self
            }

            /// Appends `module` as the next child (`append`); it takes the container's mode.
            /// Every built-in layer is `Clone`; derive `Clone` on a model to add it here, or
            /// add it boxed with `push_boxed`.
            pub fn push<M: $bound + Clone + 'static>(&mut self, module: M) -> &mut $ty {
                self.push_child(Child::Owned(Box::new(module)))
            }

            /// Appends an already boxed module (one that need not be `Clone`); clones of the
            /// container share it (Note [Container clones]).
            pub fn push_boxed(&mut self, module: Box<dyn $bound>) -> &mut $ty {
                self.push_child(Child::Shared(Arc::from(module)))
            }

            /// `self` with `module` appended, for building in one expression.
            pub fn with<M: $bound + Clone + 'static>(mut self, module: M) -> $ty {
                self.push(module);
                self
            }

            /// Number of children.
            pub fn len(&self) -> usize {
                self.modules.len()
            }

            /// True without children.
            pub fn is_empty(&self) -> bool {
                self.modules.is_empty()
            }

            /// Child `index` (`container[index]`).
            pub fn get(&self, index: usize) -> Option<&dyn $bound> {
                self.modules.get(index).map(|m| m.get())
            }

            /// Child `index`, mutably; `None` also for a boxed child shared with a clone of
            /// the container (Note [Container clones]).
            pub fn get_mut(&mut self, index: usize) -> Option<&mut dyn $bound> {
                self.modules.get_mut(index).and_then(|m| m.get_mut())
            }

            /// The children in order.
            pub fn iter(&self) -> impl Iterator<Item = &dyn $bound> {
                self.modules.iter().map(|m| m.get())
            }
        }

        impl Default for $ty {
            fn default() -> $ty {
                $ty::new()
            }
        }

        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!(stringify!($ty), "(len={})"), self.len())
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                for (i, m) in self.modules.iter().enumerate() {
                    m.get().visit(&join_name(prefix, &i.to_string()), f);
                }
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                for (i, m) in self.modules.iter_mut().enumerate() {
                    let name = join_name(prefix, &i.to_string());
                    let m = m.get_mut().ok_or_else(|| {
                        Error::invalid(
                            concat!(stringify!($ty), "::visit_mut"),
                            format!(
                                "child {name} was added with push_boxed and is shared with a clone of this container, \
                                 so its tensors cannot be replaced here; add it with push (a Clone module) instead"
                            ),
                        )
                    })?;
                    m.visit_mut(&name, f)?;
                }
                Ok(())
            }

            fn set_training(&self, training: bool) {
                self.training.set(training);
                for m in &self.modules {
                    m.get().set_training(training);
                }
            }

            fn is_training(&self) -> bool {
                self.training.get()
            }
        }
    };
}

container!(
    /// Children applied in order, each to the previous one's output (`nn.Sequential`).
    Sequential, Forward, ForwardItem
);
container!(
    /// A list of children without a forward of its own (`nn.ModuleList`).
    ModuleList, Module, ModuleItem
);

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for m in &self.modules {
            y = m.get().forward(&y)?;
        }
        Ok(y)
    }
}

/// Flattens dims `start_dim..=end_dim` into one (`nn.Flatten`, default dims 1 to -1).
#[derive(Debug, Clone)]
pub struct Flatten {
    /// First dim flattened (default 1).
    pub start_dim: isize,
    /// Last dim flattened (default -1).
    pub end_dim: isize,
    training: crate::module::Training,
}

impl Flatten {
    /// `nn.Flatten()`: keeps the batch dim, flattens the rest.
    pub fn new() -> Flatten {
        Flatten::with_dims(1, -1)
    }

    /// `nn.Flatten(start_dim, end_dim)`.
    pub fn with_dims(start_dim: isize, end_dim: isize) -> Flatten {
        Flatten {
            start_dim,
            end_dim,
            training: crate::module::Training::new(true),
        }
    }
}

impl Default for Flatten {
    fn default() -> Flatten {
        Flatten::new()
    }
}

stateless_module!(Flatten, |s, x| x.flatten(s.start_dim, s.end_dim));
