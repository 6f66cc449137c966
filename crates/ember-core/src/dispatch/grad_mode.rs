//! Thread-local gradient mode: `no_grad` / `enable_grad` scopes (as `torch.no_grad()`).

use std::cell::Cell;
use std::marker::PhantomData;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the autograd graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Sets gradient mode on this thread and returns the previous mode.
pub fn set_grad_enabled(enabled: bool) -> bool {
    GRAD_ENABLED.with(|g| g.replace(enabled))
}

/// While alive, ops on this thread record no graph. Restores the previous mode on drop.
#[must_use = "gradient mode is restored when the guard is dropped"]
pub struct GradModeGuard {
    previous: bool,
    // The mode is thread-local: the guard must drop on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        set_grad_enabled(self.previous);
    }
}

/// Disables graph recording until the guard drops (`with torch.no_grad():`).
pub fn no_grad() -> GradModeGuard {
    GradModeGuard {
        previous: set_grad_enabled(false),
        _not_send: PhantomData,
    }
}

/// Enables graph recording until the guard drops, also inside a `no_grad` scope.
pub fn enable_grad() -> GradModeGuard {
    GradModeGuard {
        previous: set_grad_enabled(true),
        _not_send: PhantomData,
    }
}
