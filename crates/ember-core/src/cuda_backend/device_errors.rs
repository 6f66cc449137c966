//! Errors found on the device, reported at the next point where the host waits for it anyway:
//! each GPU's error record (written by kernels), the registry of the op codes kernels write
//! into it, and [`check`], which the synchronizing calls run.
//!
//! Note [Deferred device errors]: bad input that only the device sees (an index out of range in
//! index_select / gather / scatter / scatter_add / index_add / one_hot and everything built on
//! them: embedding, cross-entropy and its backward, the im2col fallback; a Bernoulli
//! probability outside [0, 1]; a negative exponent of an integer `pow`) must not make the op
//! read back from the device: a read-back in the hot path costs a host round trip per op and is
//! illegal while a CUDA graph is being captured. Instead, as PyTorch's "device-side assert" but
//! recoverable:
//! - the kernel skips the elements it cannot handle (it never touches memory out of bounds) and
//!   records the first bad element in the device's [`Record`] (`report_bad` in
//!   `kernels/prelude.cuh`): the op's code, the bad value and the op's dim and size. The first
//!   failing launch wins, and within it the smallest row-major position, so the error names the
//!   same element the CPU names. The op itself returns `Ok` with an unspecified result.
//! - after recording, the kernel rings a doorbell word in host-mapped pinned memory, so the host
//!   learns of an error with one memory read and no driver call. (Where the driver cannot map
//!   host memory there is no doorbell, and a check reads the record whenever checked launches
//!   were made since the last clean read.)
//! - every call where the host waits for the device anyway checks the doorbell after waiting:
//!   `to_vec` / `item` / every device-to-host copy (`CudaStorage::to_cpu`),
//!   [`synchronize`](super::synchronize), [`Stream::synchronize`](super::Stream::synchronize)
//!   and [`Event::synchronize`](super::Event::synchronize). When it is set, the record is read
//!   and cleared, and the call returns the error ([`Error::IndexOutOfRange`] naming the op, the
//!   index, dim and size, or [`Error::InvalidArgument`]) instead of its result.
//!
//! So on CUDA an out-of-range index is an error at the next read-back, not at the op: the
//! caller sees it where it reads a result, which may be an op or two later (PyTorch reports its
//! device-side asserts the same way, asynchronously, but then the context is lost; here the
//! error is reported once and the device stays usable). Each host thread has a record (and a
//! doorbell word) of its own on each device, a slot of [`SLOTS`]: a launch records into the
//! slot of the thread that launched it, and a synchronizing call reads and clears its own
//! thread's slot only, so an error is reported to the thread whose op it was and never to
//! another thread working on the same device (threads beyond [`SLOTS`] share slots). Errors
//! of one thread recorded before it synchronizes are reported as the first of them. A captured
//! graph records into the slot of the thread that captured it. The records live as long as the
//! process, is allocated when the device's runtime is created (never during a capture), and
//! its address, the op code and a launch number are plain kernel arguments, so a captured
//! graph records errors exactly like eager launches do.

use super::kernels::KernelParam;
use crate::{Error, Result};
use cudarc::driver::{result, sys};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// What a recorded error means, which decides how it is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An index outside `[0, size)` of dim `dim`: [`Error::IndexOutOfRange`].
    Index,
    /// A probability outside [0, 1] (the value holds its f64 bits): the CPU's message.
    Probability,
    /// A negative exponent of an integer power.
    NegativePower,
}

/// The error record of one device, as kernels write it (`DeviceErrorRecord` in
/// `kernels/prelude.cuh`, same layout: 64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record {
    lock: u32,
    code: u32,
    launch: u64,
    position: u64,
    value: i64,
    dim: i64,
    size: i64,
    reserved: [u64; 2],
}

/// The kernel argument of a launch that checks its input (`ErrorCheck` in the prelude, 48
/// bytes): where to record, which op, and the dim and size to report.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ErrorCheck {
    record: u64,
    doorbell: u64,
    launch: u64,
    code: u32,
    pad: u32,
    dim: i64,
    size: i64,
}

// SAFETY: repr(C) with the field order, types and size of the prelude's `ErrorCheck`.
unsafe impl KernelParam for ErrorCheck {}

/// Error records (and doorbell words) per device: one per host thread, up to this many threads
/// (Note [Deferred device errors]).
pub(crate) const SLOTS: usize = 256;

/// The calling thread's slot.
fn slot() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SLOT: usize = (NEXT.fetch_add(1, Ordering::Relaxed) as usize) % SLOTS;
    }
    SLOT.with(|s| *s)
}

/// The op names and kinds kernels record, by code (code `i + 1` is entry `i`; 0 means none).
static REGISTRY: Mutex<Vec<(&'static str, Kind)>> = Mutex::new(Vec::new());

/// The code of `(op, kind)` in the registry, added on first use. Codes stay valid for the
/// process (a graph captured with one keeps it).
fn code_of(op: &'static str, kind: Kind) -> u32 {
    let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    let i = match reg.iter().position(|&(o, k)| o == op && k == kind) {
        Some(i) => i,
        None => {
            reg.push((op, kind));
            reg.len() - 1
        }
    };
    i as u32 + 1
}

fn registered(code: u32) -> Option<(&'static str, Kind)> {
    let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    code.checked_sub(1).and_then(|i| reg.get(i as usize).copied())
}

/// The error a record holds (a code the registry does not know is reported as such).
fn to_error(r: &Record) -> Error {
    let Some((op, kind)) = registered(r.code) else {
        return Error::Cuda {
            op: "device error check",
            msg: format!("the device recorded an error with unknown code {}", r.code),
        };
    };
    match kind {
        Kind::Index => Error::IndexOutOfRange {
            op,
            index: r.value,
            dim: r.dim.max(0) as usize,
            size: r.size.max(0) as usize,
        },
        Kind::Probability => Error::invalid(
            op,
            format!(
                "expected all probabilities in [0, 1], found {}",
                f64::from_bits(r.value as u64)
            ),
        ),
        Kind::NegativePower => Error::invalid(op, "integers to negative integer powers are not allowed"),
    }
}

fn cuda_error(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// One device's error records (a slot per thread), their doorbells and the private stream the
/// records are read on.
pub(crate) struct DeviceErrors {
    /// Device address of the first of [`SLOTS`] [`Record`]s.
    record: u64,
    /// The first of [`SLOTS`] doorbell words (pinned, mapped into the device's address space):
    /// host and device addresses; `None` where the driver could not map host memory.
    doorbell: Option<(usize, u64)>,
    /// A non-blocking stream of this device's context, for reading and clearing the record
    /// without waiting for any other stream.
    stream: u64,
    /// Launch numbers handed out (`ErrorCheck::launch`).
    launches: AtomicU64,
    /// Without a doorbell: per slot, the number of launches made before its last clean read.
    reading: Mutex<Vec<u64>>,
}

// SAFETY: the addresses are of allocations that live (and stay in place) for the process; the
// doorbell is read and written with volatile accesses only, the record only through the driver.
unsafe impl Send for DeviceErrors {}
unsafe impl Sync for DeviceErrors {}

impl DeviceErrors {
    /// The record (zeroed) and doorbell of the device whose context is current on this thread.
    pub(crate) fn new() -> Result<DeviceErrors> {
        let bytes = SLOTS * std::mem::size_of::<Record>();
        // SAFETY: plain allocations in the current context, kept for the life of the process;
        // the record is zeroed before any kernel can see its address.
        unsafe {
            let record = result::malloc_sync(bytes).map_err(cuda_error("device error record"))?;
            result::memset_d8_sync(record, 0, bytes).map_err(cuda_error("device error record"))?;
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(cuda_error("device error stream"))?;
            Ok(DeviceErrors {
                record,
                doorbell: mapped_doorbell(),
                stream: stream as u64,
                launches: AtomicU64::new(0),
                reading: Mutex::new(vec![0; SLOTS]),
            })
        }
    }

    /// The kernel argument for one launch of `op` that checks its input for errors of `kind`,
    /// with the dim and size an index error names (0 for the other kinds).
    pub(crate) fn check_args(&self, op: &'static str, kind: Kind, dim: usize, size: usize) -> ErrorCheck {
        let slot = slot();
        ErrorCheck {
            record: self.record + (slot * std::mem::size_of::<Record>()) as u64,
            doorbell: self.doorbell.map_or(0, |(_, device)| device + 4 * slot as u64),
            launch: self.launches.fetch_add(1, Ordering::Relaxed) + 1,
            code: code_of(op, kind),
            pad: 0,
            dim: dim as i64,
            size: size as i64,
        }
    }

    /// Whether an error may have been recorded since the last read: the doorbell, or, without
    /// one, whether checked launches were made since the last clean read (`read_upto`).
    fn may_have_error(&self, slot: usize, read_upto: u64) -> bool {
        match self.doorbell {
            // SAFETY: the slot's doorbell is a live, aligned u32 of pinned host memory that
            // kernels write (`slot < SLOTS`).
            Some((host, _)) => unsafe { std::ptr::read_volatile((host as *const u32).add(slot)) != 0 },
            None => self.launches.load(Ordering::Acquire) != read_upto,
        }
    }

    /// The error a kernel launched by this thread recorded, if any; the thread's record and
    /// doorbell are cleared. Free when nothing was recorded (one read of host memory).
    pub(crate) fn check(&self) -> Result<()> {
        let slot = slot();
        if self.doorbell.is_some() && !self.may_have_error(slot, 0) {
            return Ok(());
        }
        // The CUPTI gate before `reading`: a thread holding a share (inside a library call)
        // may come here, and one waiting for a share must not hold `reading` meanwhile (Note
        // [GATE shares nest] in `cupti.rs`).
        let _gate = super::cupti::work_guard();
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let read_upto = &mut reading[slot];
        if !self.may_have_error(slot, *read_upto) {
            return Ok(()); // nothing was launched since the last clean read
        }
        let at = self.record + (slot * std::mem::size_of::<Record>()) as u64;
        let launched = self.launches.load(Ordering::Acquire);
        let mut record = [Record::default()];
        let s = self.stream as sys::CUstream;
        super::stream::note_host_sync();
        // SAFETY: the doorbell is a live u32 of pinned host memory. `record` has room for one
        // Record, the size of the device record; the private stream is synchronized before
        // `record` is read, and the clear is ordered after the read on that stream.
        unsafe {
            // The doorbell first: a kernel that records after this rings it again, so no error
            // is left in the record with a silent doorbell (kernels do not ring for an error
            // they find already recorded). One recorded between the read and the clear is lost,
            // a later error than the one reported.
            if let Some((host, _)) = self.doorbell {
                std::ptr::write_volatile((host as *mut u32).add(slot), 0);
            }
            result::memcpy_dtoh_async(&mut record[..], at, s)
                .and_then(|_| result::memset_d8_async(at, 0, std::mem::size_of::<Record>(), s))
                .and_then(|_| result::stream::synchronize(s))
                .map_err(cuda_error("device error check"))?;
        }
        *read_upto = launched;
        if record[0].code == 0 {
            return Ok(());
        }
        Err(to_error(&record[0]))
    }
}

/// [`SLOTS`] doorbell words in pinned host memory mapped into the current context's address
/// space (host and device addresses, zeroed), or `None` where the driver cannot map host memory.
fn mapped_doorbell() -> Option<(usize, u64)> {
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: a plain pinned allocation, kept for the life of the process (or freed below when
    // it cannot be mapped); the word is zeroed before any kernel sees its address.
    unsafe {
        sys::cuMemHostAlloc(
            &mut host,
            4 * SLOTS,
            sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )
        .result()
        .ok()?;
        std::ptr::write_bytes(host.cast::<u8>(), 0, 4 * SLOTS);
        let mut device: sys::CUdeviceptr = 0;
        if sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
            .result()
            .is_err()
        {
            let _ = sys::cuMemFreeHost(host);
            return None;
        }
        Some((host as usize, device))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_prelude() {
        assert_eq!(std::mem::size_of::<Record>(), 64);
        assert_eq!(std::mem::size_of::<ErrorCheck>(), 48);
        assert_eq!(std::mem::align_of::<ErrorCheck>(), 8);
    }

    #[test]
    fn records_become_the_errors_the_cpu_returns() {
        let index = Record {
            code: code_of("index_select", Kind::Index),
            value: 12,
            dim: 0,
            size: 10,
            ..Record::default()
        };
        let e = to_error(&index);
        assert!(
            matches!(
                e,
                Error::IndexOutOfRange {
                    op: "index_select",
                    index: 12,
                    dim: 0,
                    size: 10
                }
            ),
            "{e}"
        );
        assert_eq!(
            code_of("index_select", Kind::Index),
            index.code,
            "codes are stable"
        );
        let p = Record {
            code: code_of("bernoulli", Kind::Probability),
            value: 1.5f64.to_bits() as i64,
            ..Record::default()
        };
        assert_eq!(
            to_error(&p).to_string(),
            "invalid argument to bernoulli: expected all probabilities in [0, 1], found 1.5"
        );
        let pow = Record {
            code: code_of("pow", Kind::NegativePower),
            ..Record::default()
        };
        assert!(to_error(&pow).to_string().contains("negative integer powers"));
        assert!(matches!(
            to_error(&Record {
                code: 1 << 30,
                ..Record::default()
            }),
            Error::Cuda { .. }
        ));
    }
}
