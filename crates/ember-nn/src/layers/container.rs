//! Containers: [`Sequential`] (children named `"0"`, `"1"`, ... and applied in order; each a
//! [`Forward`] layer), [`ModuleList`] (any [`Module`]s held and named the same way, no
//! forward), and [`Flatten`].

use super::stateless_module;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{Result, Tensor};

/// Children named by their index, shared by both containers.
struct Children<M: ?Sized> {
    modules: Vec<Box<M>>,
    training: bool,
}

impl<M: Module + ?Sized> Children<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        for (i, m) in self.modules.iter().enumerate() {
            m.visit(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        for (i, m) in self.modules.iter_mut().enumerate() {
            m.visit_mut(&join_name(prefix, &i.to_string()), f)?;
        }
        Ok(())
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        for m in &mut self.modules {
            m.set_training(training);
        }
    }

    fn push(&mut self, mut module: Box<M>) {
        module.set_training(self.training);
        self.modules.push(module);
    }
}

macro_rules! container {
    ($(#[$doc:meta])* $ty:ident, $bound:ident) => {
        $(#[$doc])*
        pub struct $ty {
            children: Children<dyn $bound>,
        }

        impl $ty {
            #[doc = concat!("An empty `", stringify!($ty), "` in training mode.")]
            pub fn new() -> $ty {
                $ty {
                    children: Children { modules: Vec::new(), training: true },
                }
            }

            /// Appends `module` as the next child (`append`); it takes the container's mode.
            pub fn push<M: $bound + 'static>(&mut self, module: M) -> &mut $ty {
                self.children.push(Box::new(module));
                self
            }

            /// Appends an already boxed module.
            pub fn push_boxed(&mut self, module: Box<dyn $bound>) -> &mut $ty {
                self.children.push(module);
                self
            }

            /// `self` with `module` appended, for building in one expression.
            pub fn with<M: $bound + 'static>(mut self, module: M) -> $ty {
                self.push(module);
                self
            }

            /// Number of children.
            pub fn len(&self) -> usize {
                self.children.modules.len()
            }

            /// True without children.
            pub fn is_empty(&self) -> bool {
                self.children.modules.is_empty()
            }

            /// Child `index` (`container[index]`).
            pub fn get(&self, index: usize) -> Option<&dyn $bound> {
                self.children.modules.get(index).map(|m| &**m)
            }

            /// Child `index`, mutably.
            pub fn get_mut(&mut self, index: usize) -> Option<&mut Box<dyn $bound>> {
                self.children.modules.get_mut(index)
            }

            /// The children in order.
            pub fn iter(&self) -> impl Iterator<Item = &dyn $bound> {
                self.children.modules.iter().map(|m| &**m)
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
    };
}

container!(
    /// Children applied in order, each to the previous one's output (`nn.Sequential`).
    Sequential, Forward
);
container!(
    /// A list of children without a forward of its own (`nn.ModuleList`).
    ModuleList, Module
);

macro_rules! container_module {
    ($ty:ty) => {
        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                self.children.visit(prefix, f)
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                self.children.visit_mut(prefix, f)
            }

            fn set_training(&mut self, training: bool) {
                self.children.set_training(training)
            }

            fn is_training(&self) -> bool {
                self.children.training
            }
        }
    };
}

container_module!(Sequential);
container_module!(ModuleList);

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for m in &self.children.modules {
            y = m.forward(&y)?;
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
    training: bool,
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
            training: true,
        }
    }
}

impl Default for Flatten {
    fn default() -> Flatten {
        Flatten::new()
    }
}

stateless_module!(Flatten, |s, x| x.flatten(s.start_dim, s.end_dim));
