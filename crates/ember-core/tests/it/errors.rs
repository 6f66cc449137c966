//! Every error variant, produced by real misuse where this build can produce it, with the
//! message a user sees.

use ember_core::{memory, DType, Device, Error, Tensor};

fn x() -> Tensor {
    Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], Device::Cpu).unwrap()
}

#[test]
fn shape_mismatch() {
    let err = x()
        .add(&Tensor::zeros([3, 2], DType::F32, Device::Cpu).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { op: "add", .. }));
    assert_eq!(
        err.to_string(),
        "shape mismatch in add: [2, 3] and [3, 2]; the shapes cannot be broadcast together"
    );
}

#[test]
fn dtype_mismatch() {
    let err = x().to_vec::<f64>().unwrap_err();
    assert!(matches!(
        err,
        Error::DTypeMismatch {
            op: "to_vec",
            expected: DType::F64,
            found: DType::F32
        }
    ));
    assert_eq!(
        err.to_string(),
        "dtype mismatch in to_vec: expected float64, found float32; convert with .to_dtype()"
    );
}

#[test]
fn unsupported_dtype() {
    let err = x()
        .requires_grad_(true)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
        .requires_grad_(true)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::UnsupportedDType {
            op: "requires_grad_",
            dtype: DType::I64,
            ..
        }
    ));
    assert!(err
        .to_string()
        .contains("only floating point tensors can require gradients"));
}

#[test]
fn dim_and_index_out_of_range() {
    let err = x().narrow(2, 0, 1).unwrap_err();
    assert_eq!(
        err.to_string(),
        "dimension out of range in narrow: expected to be in range of [-2, 1], but got 2"
    );
    let err = x().select(1, 3).unwrap_err();
    assert!(matches!(
        err,
        Error::IndexOutOfRange {
            op: "select",
            index: 3,
            dim: 1,
            size: 3
        }
    ));
}

#[test]
fn invalid_argument_and_device_strings() {
    let err = Tensor::from_vec(vec![1.0f32; 5], [2, 3], Device::Cpu).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument to from_vec: 5 elements cannot have shape [2, 3] (6 elements)"
    );
    let err = Device::parse("tpu").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid device string \"tpu\": expected \"cpu\", \"cuda\" or \"cuda:N\""
    );
}

#[test]
fn device_mismatch_and_cuda_unavailable() {
    let err = Error::DeviceMismatch {
        op: "matmul",
        lhs: Device::Cpu,
        rhs: Device::Cuda(1),
    };
    assert_eq!(
        err.to_string(),
        "expected all tensors on the same device, found cpu and cuda:1 in matmul; move them with .to(device) first"
    );
    if !ember_core::cuda::is_available() {
        let err = x().to(Device::Cuda(0)).unwrap_err();
        assert!(matches!(err, Error::CudaUnavailable { .. }));
        assert!(err.to_string().starts_with("CUDA is not available"));
    }
    let err = x().to(Device::Cuda(99)).unwrap_err();
    assert!(
        matches!(err, Error::CudaUnavailable { .. } | Error::InvalidArgument { .. }),
        "{err}"
    );
}

#[test]
fn autograd_errors() {
    let err = x().backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)));
    let err = x().retain_grad().unwrap_err();
    assert_eq!(
        err.to_string(),
        "autograd: can't retain_grad on a tensor that has requires_grad=false"
    );
}

#[test]
fn oversized_allocations_are_errors_not_aborts() {
    let err = Tensor::zeros([1 << 40, 1 << 40], DType::F32, Device::Cpu).unwrap_err();
    assert!(
        err.to_string().contains("more elements than memory can address"),
        "{err}"
    );
    let err = Tensor::zeros([1 << 60], DType::U8, Device::Cpu).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { device: Device::Cpu, requested, .. } if requested == 1 << 60),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("CPU out of memory: tried to allocate 1.00 EiB"),
        "{err}"
    );
}

/// The host byte count is kept per thread (Note [Host byte shards]): a storage made on one
/// thread and dropped on another leaves one shard up and another down, and the total must
/// still follow it.
#[test]
fn host_memory_allocated_follows_a_storage_made_and_dropped_on_different_threads() {
    const BYTES: usize = 256 << 20;
    // Other tests make and drop CPU tensors meanwhile: they are allowed BYTES / 2 either way.
    let slack = BYTES / 2;
    let before = memory::host_memory_allocated();
    let t = std::thread::spawn(|| Tensor::zeros([BYTES], DType::U8, Device::Cpu))
        .join()
        .unwrap()
        .unwrap();
    let held = memory::host_memory_allocated();
    assert!(
        held.abs_diff(before + BYTES) < slack,
        "before {before}, holding {BYTES} more: {held}"
    );
    drop(t);
    let after = memory::host_memory_allocated();
    assert!(
        after.abs_diff(before) < slack,
        "before {before}, after the drop on another thread: {after}"
    );
}
