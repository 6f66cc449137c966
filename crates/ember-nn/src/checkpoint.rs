//! `torch.utils.checkpoint` for modules: run a block without keeping its activations and
//! recompute them in backward, called as PyTorch's `checkpoint(self.block, x)` is.
//!
//! Note [Checkpointing a borrowed module]: the recomputation runs during `backward`, long
//! after the forward call returned, so the function it calls must outlive every borrow the
//! forward had (a closure borrowing `self` cannot be kept that long, which is why
//! [`ember_core::autograd::checkpoint`] takes `'static` closures). A module's parameters are
//! shared handles, so a clone of the module is the same function over the same parameter
//! tensors: [`checkpoint`] clones the borrowed module into the graph node (a few reference
//! counts, no tensor data), and the gradients the recomputation produces land in the `.grad`
//! of the original parameters.

use crate::Forward;
use ember_core::{autograd, Result, Tensor};

/// `torch.utils.checkpoint.checkpoint(module, x)`: `module.forward(x)` without storing the
/// activations inside `module`; backward runs the forward again to get them. Memory falls from
/// every activation inside the block to its input and output, for one more forward of the
/// block in backward. The module is borrowed (Note [Checkpointing a borrowed module]), so
/// inside a model's own `forward` it reads `checkpoint(&self.block, &x)`.
///
/// Dropout inside the block draws the same mask in the recomputation (the random state is
/// restored). The module's training mode is the one it had at this call.
///
/// ```
/// use ember_nn::{checkpoint::checkpoint, Forward, Linear, ModuleExt};
/// use ember_core::{DType, Device, Tensor};
/// let block = Linear::new(4, 4, Device::Cpu)?;
/// let x = Tensor::randn([2, 4], DType::F32, Device::Cpu)?.requires_grad_(true)?;
/// let y = checkpoint(&block, &x)?;
/// y.sum_all()?.backward()?;
/// assert!(block.parameters().iter().all(|p| p.grad().is_some()));
/// assert!(x.grad().is_some());
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn checkpoint<M>(module: &M, x: &Tensor) -> Result<Tensor>
where
    M: Forward + Clone + Send + Sync + 'static,
{
    let block = module.clone();
    autograd::checkpoint(
        move |xs: &[Tensor]| block.forward(&xs[0]),
        std::slice::from_ref(x),
    )
}
