//! Page-locked ("pinned") host memory, as `Tensor.pin_memory()`: copies from it to the GPU run
//! by DMA at full PCIe/NVLink speed and, with `non_blocking`, truly overlap with host work.
//!
//! Note [Pinned host memory]: a pinned CPU tensor is an ordinary CPU storage whose buffer is
//! registered with the driver (`cuMemHostRegister`, portable to every context); the
//! registration ([`HostPin`]) lives in the storage cell beside the buffer and is undone before
//! the buffer is freed. CPU ops write pinned buffers in place, never reallocate them, so the
//! registered range stays the buffer's. An asynchronous copy out of a pinned buffer keeps the
//! source storage alive until an event recorded after the copy has completed
//! ([`keep_alive_until_done`]); finished entries are dropped on later copies and on
//! [`synchronize`](super::synchronize).

use super::runtime::runtime;
use super::stream::{Event, Stream};
use crate::storage::StorageRef;
use crate::{Error, Result};
use cudarc::driver::sys;
use std::sync::Mutex;

/// A registration of a host buffer with the driver, undone on drop.
#[derive(Debug)]
pub struct HostPin {
    ptr: usize,
}

impl HostPin {
    /// Page-locks `bytes` (which must stay allocated and in place until the pin drops).
    pub(crate) fn new(bytes: &[u8]) -> Result<HostPin> {
        runtime(0)?;
        if bytes.is_empty() {
            return Ok(HostPin { ptr: 0 });
        }
        // SAFETY: `bytes` is a live host allocation of this length; the caller keeps it in
        // place until this pin is dropped (Note [Pinned host memory]).
        unsafe {
            sys::cuMemHostRegister_v2(
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| Error::Cuda {
            op: "pin_memory",
            msg: format!("cuMemHostRegister of {} bytes failed: {e:?}", bytes.len()),
        })?;
        Ok(HostPin {
            ptr: bytes.as_ptr() as usize,
        })
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if self.ptr != 0 && runtime(0).is_ok() {
            // SAFETY: `ptr` was registered by `new` and its buffer is still allocated (the pin is
            // dropped before the buffer, see StorageCell).
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

static IN_FLIGHT: Mutex<Vec<(Event, StorageRef)>> = Mutex::new(Vec::new());

/// Keeps `storage` alive until the work queued on `stream` so far has finished.
pub(crate) fn keep_alive_until_done(stream: &Stream, storage: StorageRef) -> Result<()> {
    let event = Event::new(false);
    event.record_on(stream)?;
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    in_flight.retain(|(e, _)| !e.query().unwrap_or(true));
    in_flight.push((event, storage));
    Ok(())
}

/// Drops every kept-alive storage whose copy has finished.
pub(crate) fn release_finished() {
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    in_flight.retain(|(e, _)| !e.query().unwrap_or(true));
}
