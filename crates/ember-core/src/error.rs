//! The one error type of ember-core: every fallible public operation returns [`Result`].
//!
//! Variants carry structured fields (the op, both shapes, both devices, ...) so a caller can
//! match on them, and their messages say what went wrong and what to do about it.

use crate::{DType, Device, Shape};

/// Result alias used throughout ember.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a tensor operation.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two operands live on different devices.
    #[error("expected all tensors on the same device, found {lhs} and {rhs} in {op}; move them with .to(device) first")]
    DeviceMismatch {
        op: &'static str,
        lhs: Device,
        rhs: Device,
    },

    /// Two shapes that must agree (or broadcast) do not.
    #[error("shape mismatch in {op}: {lhs} and {rhs}{hint}", hint = hint_suffix(.hint))]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
        hint: &'static str,
    },

    /// Two dtypes that must be equal are not.
    #[error("dtype mismatch in {op}: expected {expected}, found {found}; convert with .to_dtype()")]
    DTypeMismatch {
        op: &'static str,
        expected: DType,
        found: DType,
    },

    /// An op does not support this dtype.
    #[error("{op} does not support dtype {dtype}{hint}", hint = hint_suffix(.hint))]
    UnsupportedDType {
        op: &'static str,
        dtype: DType,
        hint: &'static str,
    },

    /// A dimension argument is outside `[-ndim, ndim)`.
    #[error("dimension out of range in {op}: expected to be in range of [{min}, {max}], but got {dim}")]
    DimOutOfRange {
        op: &'static str,
        dim: isize,
        min: isize,
        max: isize,
    },

    /// An index into a dimension is out of range.
    #[error("index {index} is out of bounds for dimension {dim} with size {size} in {op}")]
    IndexOutOfRange {
        op: &'static str,
        index: i64,
        dim: usize,
        size: usize,
    },

    /// An argument has a value the op cannot take.
    #[error("invalid argument to {op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A device string could not be parsed.
    #[error("invalid device string {0:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
    InvalidDevice(String),

    /// The CUDA backend cannot be used on this machine or in this build.
    #[error(
        "CUDA is not available: {reason}; use Device::Cpu, or run on a machine with an NVIDIA GPU and driver"
    )]
    CudaUnavailable { reason: String },

    /// A device could not satisfy an allocation: host memory on the CPU, or a GPU after its
    /// caching allocator released its cache and retried. The message names the largest live
    /// allocations on the device and what to try (`crate::memory::out_of_memory` builds it).
    #[error("{}", crate::memory::oom_message(.device, *.requested, *.total, *.free, *.allocated, *.reserved, .largest))]
    OutOfMemory {
        device: Device,
        requested: usize,
        total: usize,
        free: usize,
        allocated: usize,
        reserved: usize,
        /// The largest live tensor storages on the device when the request failed, largest
        /// first (Note [Live allocation list] in `memory.rs`).
        largest: Vec<crate::memory::LiveAllocation>,
    },

    /// A CUDA driver or library call failed (a kernel fault, a launch error, a compile error).
    #[error("CUDA error in {op}: {msg}")]
    Cuda { op: &'static str, msg: String },

    /// An operation that cannot be part of a CUDA graph (a read into host memory, a copy from
    /// host memory, a wait for the device) ran while its stream, or for a device-wide wait its
    /// device, was capturing one. When the calling thread had begun that capture, it was ended so
    /// that the program goes on eagerly (Note [Operations refused during capture] in
    /// `cuda_backend/capture.rs`).
    #[error("{op} cannot run while a CUDA graph is being captured on {device}: a capture records device work to replay it later, so reads into host memory, copies from host memory and waits for the device belong before capture_begin or after replay(){}", capture_suffix(*.ended))]
    IllegalDuringCapture {
        op: &'static str,
        device: Device,
        /// Whether the capture was ended by this error (it was begun by the calling thread).
        ended: bool,
    },

    /// The autograd engine was asked for something it cannot do.
    #[error("autograd: {0}")]
    Autograd(String),

    /// A tensor saved for backward was modified in place after it was saved.
    #[error("one of the tensors needed for gradient computation has been modified by an in-place operation: it is at version {found}, expected version {expected} (saved by {op}); clone it before modifying it, or modify it outside the graph")]
    InplaceModified {
        op: &'static str,
        expected: u64,
        found: u64,
    },

    /// A data-parallel gradient reduction could not finish: these parameters (by name)
    /// received no gradient in the backward pass, so the buckets holding them were never
    /// reduced (`DistributedDataParallel` without `find_unused_parameters`).
    #[error("{op}: expected every parameter to receive a gradient in the backward pass before reducing, but {} did not: {names:?}; if the forward pass does not use all parameters, pass find_unused_parameters(true), and make sure every output of forward takes part in the loss", names.len())]
    UnusedParameters { op: &'static str, names: Vec<String> },

    /// A file or stream operation failed (`From<std::io::Error>`, so `?` works on I/O).
    #[error("I/O error ({kind:?}): {msg}")]
    Io { kind: std::io::ErrorKind, msg: String },
}

fn capture_suffix(ended: bool) -> &'static str {
    if ended {
        "; the capture was ended: reset() the graph and capture again without it"
    } else {
        "; the capture, begun by another thread, goes on"
    }
}

fn hint_suffix(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!("; {hint}")
    }
}

/// `bytes` as a short human-readable size ("1.50 GiB").
pub(crate) fn fmt_bytes(bytes: usize) -> String {
    const UNITS: [&str; 7] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_convert_keeping_kind_and_message() {
        fn read() -> crate::Result<String> {
            Ok(std::fs::read_to_string("/nonexistent/ember/file.txt")?)
        }
        let err = read().unwrap_err();
        assert!(
            matches!(
                err,
                Error::Io {
                    kind: std::io::ErrorKind::NotFound,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("NotFound"), "{err}");
    }
}

/// `?` on file and network I/O in a function returning [`Result`] (`fn main() ->
/// ember::Result<()>`): the error's kind and message are kept (`std::io::Error` is not `Clone`,
/// [`Error`] is).
impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Io {
            kind: e.kind(),
            msg: e.to_string(),
        }
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { op, msg: msg.into() }
    }

    /// Shorthand for [`Error::ShapeMismatch`] without a hint.
    pub fn shape(op: &'static str, lhs: &Shape, rhs: &Shape) -> Self {
        Error::ShapeMismatch {
            op,
            lhs: lhs.clone(),
            rhs: rhs.clone(),
            hint: "",
        }
    }

    /// The same error, naming `op` if it is an [`Error::IllegalDuringCapture`]: a host read
    /// refused below the public op that asked for it (`to_vec`, `item`) reports that op.
    pub(crate) fn in_op(self, op: &'static str) -> Self {
        match self {
            Error::IllegalDuringCapture { device, ended, .. } => {
                Error::IllegalDuringCapture { op, device, ended }
            }
            other => other,
        }
    }

    /// Shorthand for [`Error::UnsupportedDType`] without a hint.
    pub fn dtype(op: &'static str, dtype: DType) -> Self {
        Error::UnsupportedDType { op, dtype, hint: "" }
    }
}
