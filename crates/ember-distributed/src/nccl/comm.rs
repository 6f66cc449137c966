//! The NCCL communicator as an RAII handle: creation (bounded by a timeout), calls into it,
//! its asynchronous error, abort and destruction.
//!
//! Note [Communicator locking]: the raw `ncclComm_t` sits behind a mutex. Every call into NCCL
//! holds it, and [`Communicator::abort`] swaps the handle for null under it, so no call can use
//! a communicator after `ncclCommAbort` freed it. The watchdog only ever *tries* the lock
//! (`try_lock`): when an enqueue is blocked inside NCCL (a first send/recv connecting to a peer
//! that died), the watchdog cannot abort it and NCCL's own socket timeouts bound that wait.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use cudarc::nccl::sys::{ncclComm_t, ncclUniqueId};
use ember_core::cuda::DeviceGuard;
use ember_core::{Error, Result};

use super::library::{Nccl, NcclResult, NCCL_IN_PROGRESS, NCCL_SUCCESS};

/// A communicator handle that may cross threads (NCCL communicators may be used from any
/// thread, one call at a time: Note [Communicator locking]).
struct Raw(ncclComm_t);

// SAFETY: the handle is an opaque pointer owned by NCCL; access is serialized by the mutex of
// `Communicator`, and NCCL allows a communicator to be used from any thread.
unsafe impl Send for Raw {}

/// One rank's NCCL communicator on one device.
pub struct Communicator {
    lib: &'static Nccl,
    raw: Mutex<Raw>,
    device: usize,
}

/// A unique id (`ncclUniqueId`) as the bytes published through the store.
pub fn unique_id(lib: &Nccl) -> Result<Vec<u8>> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: the out pointer is valid for one write of an ncclUniqueId.
    let rc = unsafe { (lib.get_unique_id)(&mut id) };
    check(lib, "ncclGetUniqueId", rc, None)?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn check(lib: &Nccl, op: &'static str, rc: NcclResult, comm: Option<ncclComm_t>) -> Result<()> {
    if rc == NCCL_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            op,
            msg: format!("NCCL: {}", lib.describe(rc, comm)),
        })
    }
}

impl Communicator {
    /// `ncclCommInitRank` on `device` for `rank` of `size`, with the id rank 0 published. The
    /// call blocks until every rank joined; it runs on a helper thread so that a peer that never
    /// comes makes this an error after `timeout` (the helper stays blocked inside NCCL).
    pub fn new(
        lib: &'static Nccl,
        device: usize,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        let mut uid = ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(Error::invalid(
                "init_process_group",
                format!(
                    "the NCCL unique id from the store has {} bytes, expected 128",
                    id.len()
                ),
            ));
        }
        for (d, &s) in uid.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        let (nranks, me) = (to_int("nranks", size)?, to_int("rank", rank)?);
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let outcome = DeviceGuard::new(device).and_then(|_guard| {
                    let mut comm: ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is valid for one write; the device's context is current
                    // on this thread (the guard), which is the device NCCL binds the
                    // communicator to.
                    let rc = unsafe { (lib.comm_init_rank)(&mut comm, nranks, uid, me) };
                    check(lib, "ncclCommInitRank", rc, None).map(|_| Raw(comm))
                });
                let _ = tx.send(outcome);
            })
            .map_err(|e| Error::invalid("init_process_group", format!("cannot start a thread: {e}")))?;
        match rx.recv_timeout(timeout) {
            Ok(outcome) => Ok(Communicator {
                lib,
                raw: Mutex::new(outcome?),
                device,
            }),
            Err(_) => Err(Error::Io {
                kind: std::io::ErrorKind::TimedOut,
                msg: format!(
                    "ncclCommInitRank (rank {rank} of {size}, cuda:{device}) did not finish within \
                     {timeout:?}: a rank did not join (died, or uses another store or world size)"
                ),
            }),
        }
    }

    pub fn lib(&self) -> &'static Nccl {
        self.lib
    }

    fn lock(&self) -> MutexGuard<'_, Raw> {
        self.raw.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the live communicator with the device's context current; `op` names it in
    /// errors. An error when the communicator was aborted.
    pub fn call(&self, op: &'static str, f: impl FnOnce(&Nccl, ncclComm_t) -> NcclResult) -> Result<()> {
        let raw = self.lock();
        if raw.0.is_null() {
            return Err(aborted(op));
        }
        let _guard = DeviceGuard::new(self.device)?;
        let rc = f(self.lib, raw.0);
        check(self.lib, op, rc, Some(raw.0))
    }

    /// The communicator's asynchronous error (`ncclCommGetAsyncError`): `Some(message)` when
    /// NCCL found one (a peer failed, a network error). `None` also when the lock is busy or
    /// the communicator is gone (Note [Communicator locking]).
    pub fn async_error(&self) -> Option<String> {
        let raw = self.raw.try_lock().ok()?;
        if raw.0.is_null() {
            return None;
        }
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: the communicator is live (non-null under the lock); `state` is valid for one
        // write.
        let rc = unsafe { (self.lib.comm_get_async_error)(raw.0, &mut state) };
        if rc != NCCL_SUCCESS {
            return Some(self.lib.describe(rc, Some(raw.0)));
        }
        (state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS).then(|| self.lib.describe(state, Some(raw.0)))
    }

    /// Aborts the communicator (`ncclCommAbort`): its kernels stop, so streams waiting on them
    /// go on; every later call fails. `blocking`: wait for the lock (false: give up when an
    /// enqueue holds it). True when this call aborted it.
    pub fn abort(&self, blocking: bool) -> bool {
        let mut raw = if blocking {
            self.lock()
        } else {
            match self.raw.try_lock() {
                Ok(r) => r,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        };
        if raw.0.is_null() {
            return false;
        }
        let _guard = DeviceGuard::new(self.device);
        // SAFETY: the communicator is live and no other call uses it (we hold the lock); it is
        // never used again (the handle is nulled below).
        let _ = unsafe { (self.lib.comm_abort)(raw.0) };
        raw.0 = std::ptr::null_mut();
        true
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let raw = self.raw.get_mut().unwrap_or_else(|p| p.into_inner());
        if raw.0.is_null() {
            return;
        }
        let _guard = DeviceGuard::new(self.device);
        // SAFETY: the communicator is live and this is its last use. ncclCommDestroy waits for
        // the operations already enqueued (their outputs may still be read by the program).
        let _ = unsafe { (self.lib.comm_destroy)(raw.0) };
        raw.0 = std::ptr::null_mut();
    }
}

fn aborted(op: &'static str) -> Error {
    Error::Cuda {
        op,
        msg: "the NCCL communicator was aborted (the process group was shut down or an earlier \
              operation failed); create a new process group"
            .into(),
    }
}

fn to_int(what: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| Error::invalid("init_process_group", format!("{what} {v} is too large for NCCL")))
}
