//! The CPU backend's intra-op thread count (`torch.set_num_threads` / `torch.get_num_threads`).
//!
//! Rules:
//! - Until [`set_num_threads`] is called, kernels run on rayon's global pool (one thread per
//!   core, or `RAYON_NUM_THREADS`), and [`get_num_threads`] reports its size.
//! - [`set_num_threads`]`(n)` builds a pool of `n` threads; from then on every kernel that goes
//!   parallel (above `PAR_THRESHOLD` elements) runs inside it through [`parallel`], so `gemm`'s
//!   and rayon's splitting see `n` threads. `n == 1` makes every kernel single-threaded.
//! - Kernels below the threshold never touch the pool: small ops pay nothing for the setting.
//! - The setting is process-wide, as PyTorch's is, and may change at any time; a kernel already
//!   running keeps the pool it started on (the `Arc` keeps it alive).

use std::sync::{Arc, RwLock};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::{Error, Result};

/// The pool of [`set_num_threads`], `None` while rayon's global pool is used.
static POOL: RwLock<Option<Arc<ThreadPool>>> = RwLock::new(None);

/// Sets the number of threads the CPU backend uses for intra-op parallelism
/// (`torch.set_num_threads`). `n == 0` is an [`Error::InvalidArgument`].
pub fn set_num_threads(n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::invalid(
            "set_num_threads",
            "the number of threads must be at least 1",
        ));
    }
    if get_num_threads() == n && POOL.read().map(|p| p.is_some()).unwrap_or(false) {
        return Ok(());
    }
    let pool = ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("ember-cpu-{i}"))
        .build()
        .map_err(|e| Error::invalid("set_num_threads", format!("could not start {n} threads: {e}")))?;
    *POOL.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(pool));
    Ok(())
}

/// The number of threads the CPU backend uses for intra-op parallelism
/// (`torch.get_num_threads`).
pub fn get_num_threads() -> usize {
    match current_pool() {
        Some(pool) => pool.current_num_threads(),
        None => rayon::current_num_threads(),
    }
}

fn current_pool() -> Option<Arc<ThreadPool>> {
    POOL.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Runs a parallel kernel body `f` on the pool of [`set_num_threads`] (directly when none is
/// set or when already on one of its threads).
pub(crate) fn parallel<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match current_pool() {
        Some(pool) if pool.current_thread_index().is_none() => pool.install(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_threads_is_a_typed_error() {
        assert!(matches!(
            set_num_threads(0),
            Err(Error::InvalidArgument {
                op: "set_num_threads",
                ..
            })
        ));
    }

    #[test]
    fn parallel_runs_on_the_pool_of_the_setting() {
        // The only test of this binary that sets the count (others would race with it).
        set_num_threads(3).unwrap();
        assert_eq!(get_num_threads(), 3);
        assert_eq!(parallel(rayon::current_num_threads), 3);
        set_num_threads(1).unwrap();
        assert_eq!(parallel(rayon::current_num_threads), 1);
        assert_eq!(get_num_threads(), 1);
        set_num_threads(rayon::current_num_threads()).unwrap();
    }
}
