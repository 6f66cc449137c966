//! `torch.cuda.make_graphed_callables` for modules: a module whose forward and backward replay
//! CUDA graphs captured once (Note [Graphed callables] in ember-core's `cuda/graphed.rs`), used
//! in place of the module in an otherwise eager training loop.
//!
//! As in PyTorch, the graphs are used only while the module is in the training mode it was
//! captured in; in the other mode (e.g. `eval()` for validation) the module runs eagerly. The
//! output of a graphed forward is the graph's static output, overwritten by the next call.
//! Keep the module's parameters where they are after graphing it: `to_device`/`to_dtype`
//! replace the parameter tensors, which the graphs no longer see (graph the module again).

use crate::{Forward, Module, ModuleExt, TensorKind};
use ember_core::cuda::{make_graphed_callables, Callable, GraphedCallable, GraphedOptions};
use ember_core::{Result, Tensor};

/// A module with its forward and backward captured into CUDA graphs; made by
/// [`make_graphed_module`]. Its parameters and state-dict names are the module's own.
#[derive(Debug)]
pub struct GraphedModule<M> {
    module: M,
    graphed: GraphedCallable,
    /// The training mode of the capture.
    training: bool,
}

/// Captures `module`'s forward on inputs like `sample_input` (shape, dtype and CUDA device of
/// every later call) and its backward into CUDA graphs, after warm-up passes
/// (`torch.cuda.make_graphed_callables(module, (sample_input,))`). Every parameter must
/// require grad.
///
/// ```no_run
/// use ember_core::{DType, Device, Tensor};
/// use ember_nn::graphs::make_graphed_module;
/// use ember_nn::{Forward, Linear, ModuleExt};
/// # fn main() -> ember_core::Result<()> {
/// let d = Device::Cuda(0);
/// let x = Tensor::randn([32, 64], DType::F32, d)?;
/// let block = make_graphed_module(Linear::new(64, 10, d)?, &x)?;
/// block.forward(&x)?.sum_all()?.backward()?; // two graph replays
/// assert!(block.parameters().iter().all(|p| p.grad().is_some()));
/// # Ok(())
/// # }
/// ```
pub fn make_graphed_module<M: Forward>(module: M, sample_input: &Tensor) -> Result<GraphedModule<M>> {
    make_graphed_module_with(module, sample_input, GraphedOptions::default())
}

/// [`make_graphed_module`] with the warm-up count, `allow_unused_input` or a memory pool.
pub fn make_graphed_module_with<M: Forward>(
    module: M,
    sample_input: &Tensor,
    options: GraphedOptions,
) -> Result<GraphedModule<M>> {
    let func = |args: &[Tensor]| module.forward(&args[0]);
    let mut graphed = make_graphed_callables(
        &[Callable {
            func: &func,
            sample_args: vec![sample_input.clone()],
            params: module.parameters(),
        }],
        options,
    )?;
    let graphed = graphed.remove(0);
    let training = module.is_training();
    Ok(GraphedModule {
        module,
        graphed,
        training,
    })
}

impl<M> GraphedModule<M> {
    /// The module itself (its eager forward).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The module, dropping the graphs.
    pub fn into_inner(self) -> M {
        self.module
    }
}

impl<M: Module> Module for GraphedModule<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.module.visit(prefix, f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.module.visit_mut(prefix, f)
    }

    fn set_training(&self, training: bool) {
        self.module.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.module.is_training()
    }
}

impl<M: Forward> Forward for GraphedModule<M> {
    /// The graphs' replay while the module is in the training mode of the capture (an error for
    /// an input of another shape, dtype or device), the eager forward otherwise.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.module.is_training() == self.training {
            self.graphed.call(std::slice::from_ref(x))
        } else {
            self.module.forward(x)
        }
    }
}
