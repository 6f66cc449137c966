//! Callbacks queued during a backward pass to run when it ends (PyTorch's
//! `Variable._execution_engine.queue_callback`), and the hooks that run after a gradient was
//! accumulated into a leaf's `.grad` (`Tensor.register_post_accumulate_grad_hook`).
//!
//! Note [Final callbacks]: each backward pass (`backward`, `grad`) opens a frame on a
//! thread-local stack, and [`queue_callback`] adds to the innermost one, so a callback queued
//! by a hook of a nested backward (a checkpoint's recomputation) runs when that nested pass
//! ends, as in PyTorch. When every node has run, the frame's callbacks run in the order they
//! were queued, on the thread that called backward, under `no_grad`; a callback may queue
//! more, which run in the same loop. The first error stops the loop and is backward's result.
//! If backward fails before it ends, the frame's callbacks are dropped without running. Without
//! a queued callback the cost is one thread-local push and pop per backward pass.
//!
//! Note [Post-accumulate-grad hooks]: a leaf's hooks run right after backward stored the
//! leaf's new `.grad`, once per backward pass that reaches the leaf, with the leaf itself, so
//! a hook reads `.grad` and may act on it (start a gradient all-reduce, step an optimizer per
//! parameter). Backward rules may leave out a gradient that is zero (`None`); when every path
//! to a reached leaf did, `.grad` stays as it was and the hooks still run, so a hook can count
//! on running once per pass for every leaf the graph reaches (DDP's buckets do). PyTorch runs
//! them only when a gradient was accumulated, but it never leaves one out there.
//! `torch.autograd.grad` stores no `.grad`, so it runs none. A leaf without such hooks pays
//! nothing: the engine reads the hook list under the lock it already holds to store the
//! gradient.

pub(super) use crate::dispatch::tensor_impl::PostAccumulateGradHook;
use crate::{Error, Result, Tensor};
use std::cell::RefCell;
use std::sync::Arc;

type Callback = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    /// One frame per backward pass running on this thread, innermost last.
    static FRAMES: RefCell<Vec<Vec<Callback>>> = const { RefCell::new(Vec::new()) };
}

/// Queues `callback` to run when the backward pass running on this thread ends (after every
/// node and hook ran; see Note [Final callbacks]). An error outside a backward pass, as
/// PyTorch's "Final callbacks can only be installed during the backward pass".
///
/// ```
/// use ember_core::{autograd, Device, Tensor};
/// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
/// let x = Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)?.requires_grad_(true)?;
/// let ran = Arc::new(AtomicBool::new(false));
/// let seen = ran.clone();
/// let y = x.mul_scalar(2.0)?;
/// y.register_hook(move |_| {
///     let seen = seen.clone();
///     autograd::queue_callback(move || Ok(seen.store(true, Ordering::SeqCst)))?;
///     Ok(None)
/// })?;
/// y.sum_all()?.backward()?;
/// assert!(ran.load(Ordering::SeqCst));
/// assert!(autograd::queue_callback(|| Ok(())).is_err()); // no backward running now
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn queue_callback(callback: impl FnOnce() -> Result<()> + 'static) -> Result<()> {
    FRAMES.with(|f| match f.borrow_mut().last_mut() {
        Some(frame) => {
            frame.push(Box::new(callback));
            Ok(())
        }
        None => Err(Error::Autograd(
            "final callbacks can only be queued during the backward pass (from a hook)".into(),
        )),
    })
}

/// The callback frame of one backward pass: opened by the engine, run at its end, dropped
/// (callbacks discarded) if the pass fails.
pub(super) struct Frame {
    depth: usize,
}

impl Frame {
    pub(super) fn enter() -> Frame {
        let depth = FRAMES.with(|f| {
            let mut f = f.borrow_mut();
            f.push(Vec::new());
            f.len()
        });
        Frame { depth }
    }

    /// Runs the frame's callbacks until none is left, then closes it.
    pub(super) fn finish(self) -> Result<()> {
        loop {
            let next = FRAMES.with(|f| {
                let mut f = f.borrow_mut();
                let frame = f.get_mut(self.depth - 1)?;
                (!frame.is_empty()).then(|| frame.remove(0))
            });
            match next {
                Some(callback) => callback()?,
                None => return Ok(()),
            }
        }
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        // Frames close innermost first; draining from this depth also closes any frame a
        // panic left open above it.
        let dropped = FRAMES.with(|f| {
            let mut f = f.borrow_mut();
            let rest: Vec<Vec<Callback>> = f.drain(self.depth - 1..).collect();
            rest
        });
        drop(dropped);
    }
}

/// A leaf's post-accumulate-grad hooks, for a pass that reached it without a gradient.
pub(super) fn post_accumulate_grad_hooks(
    leaf: &Arc<crate::dispatch::tensor_impl::TensorImpl>,
) -> Vec<PostAccumulateGradHook> {
    leaf.meta()
        .post_accumulate_grad_hooks
        .iter()
        .map(|(_, h)| h.clone())
        .collect()
}

/// Runs a leaf's post-accumulate-grad hooks (Note [Post-accumulate-grad hooks]).
pub(super) fn run_post_accumulate_grad_hooks(
    leaf: &Tensor,
    hooks: Vec<PostAccumulateGradHook>,
) -> Result<()> {
    for hook in hooks {
        hook(leaf)?;
    }
    Ok(())
}
