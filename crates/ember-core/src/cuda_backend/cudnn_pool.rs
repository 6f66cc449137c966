//! 2-D max and average pooling on CUDA through cuDNN's pooling API (`cudnnPoolingForward`,
//! `cudnnPoolingBackward`), for `ops::pool::pool2d`. Handles come from `cudnn.rs` (Note [cuDNN
//! state]); pooling needs no workspace and no algorithm choice, so its descriptors (one pooling,
//! two tensor descriptors: host-side structs, cheap to make) are created per call and destroyed
//! when it returns.
//!
//! Semantics, as PyTorch's `max_pool2d` / `avg_pool2d(count_include_pad=True)` with floor output
//! sizes and padding at most half the kernel (so no window lies wholly in the padding, and none
//! reaches past the padded input): max pooling takes the maximum over the window's elements
//! inside the input (padding acts as -inf) and propagates NaN (`CUDNN_PROPAGATE_NAN`); its
//! gradient goes to one position per window (`CUDNN_POOLING_MAX_DETERMINISTIC`). Average pooling
//! divides by `KH·KW` whatever part of the window is padding
//! (`CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING`).

use super::cudnn;
use super::cudnn::cudnn_on;
use super::cudnn::{data_type, with_handle};
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::PoolOps;
use crate::backend::{PoolMode, PoolParams};
use crate::{DType, Error, Result};
use cudarc::cudnn::sys;
use std::ffi::c_void;

const OP: &str = "pool2d";

/// Whether cuDNN can take the problem: a float dtype, no empty dims, padding at most half the
/// kernel, and every count, tensor size and geometry value within its 32-bit limits.
pub(crate) fn supported(p: &PoolParams) -> bool {
    let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
    let Some(out) = p.output() else { return false };
    matches!(p.dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        && [p.input, out]
            .iter()
            .all(|t| t.iter().all(|&d| fits(d)) && fits(t.iter().product()))
        && p.kernel.iter().chain(&p.stride).all(|&v| fits(v))
        && (0..2).all(|d| 2 * p.padding[d] <= p.kernel[d])
}

fn check(what: &'static str, status: sys::cudnnStatus_t) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            op: OP,
            msg: format!("cuDNN {what}: {status:?}"),
        })
    }
}

/// The pooling descriptor and the input and output tensor descriptors of one problem
/// (destroyed on drop).
struct Descriptors {
    pool: sys::cudnnPoolingDescriptor_t,
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Descriptors::new` (or is null) and is destroyed
        // only here; destroying a null descriptor is a no-op in cuDNN.
        unsafe {
            let _ = sys::cudnnDestroyPoolingDescriptor(self.pool);
            let _ = sys::cudnnDestroyTensorDescriptor(self.x);
            let _ = sys::cudnnDestroyTensorDescriptor(self.y);
        }
    }
}

fn set_tensor(desc: sys::cudnnTensorDescriptor_t, dtype: DType, dims: [usize; 4]) -> Result<()> {
    let d = dims.map(|v| v as i32);
    let s = [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1];
    // SAFETY: `desc` is live; `d` and `s` hold 4 values each (their products fit in i32, checked
    // by `supported`, so the strides do not overflow).
    check("cudnnSetTensorNdDescriptor", unsafe {
        sys::cudnnSetTensorNdDescriptor(desc, data_type(dtype), 4, d.as_ptr(), s.as_ptr())
    })
}

impl Descriptors {
    fn new(p: &PoolParams) -> Result<Descriptors> {
        let mut desc = Descriptors {
            pool: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
        };
        // SAFETY: out-pointers to this struct's fields; whatever was created is freed by Drop.
        unsafe {
            check(
                "cudnnCreatePoolingDescriptor",
                sys::cudnnCreatePoolingDescriptor(&mut desc.pool),
            )?;
            check(
                "cudnnCreateTensorDescriptor",
                sys::cudnnCreateTensorDescriptor(&mut desc.x),
            )?;
            check(
                "cudnnCreateTensorDescriptor",
                sys::cudnnCreateTensorDescriptor(&mut desc.y),
            )?;
        }
        let mode = if p.mode == PoolMode::Max {
            sys::cudnnPoolingMode_t::CUDNN_POOLING_MAX_DETERMINISTIC
        } else {
            sys::cudnnPoolingMode_t::CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING
        };
        let (k, s, pad) = (
            p.kernel.map(|v| v as i32),
            p.stride.map(|v| v as i32),
            p.padding.map(|v| v as i32),
        );
        // SAFETY: the descriptor is live; the values are positive (padding non-negative) and fit
        // in i32 (checked by `supported`: padding <= kernel / 2).
        check("cudnnSetPooling2dDescriptor", unsafe {
            sys::cudnnSetPooling2dDescriptor(
                desc.pool,
                mode,
                sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                k[0],
                k[1],
                pad[0],
                pad[1],
                s[0],
                s[1],
            )
        })?;
        set_tensor(desc.x, p.dtype, p.input)?;
        set_tensor(desc.y, p.dtype, p.output().expect("checked by supported()"))?;
        Ok(desc)
    }
}

fn check_operand(what: &str, s: &CudaStorage, dtype: DType, len: usize) {
    assert!(
        s.dtype() == dtype && s.len() >= len,
        "cudnn pooling {what}: caller passes contiguous {dtype} storages of the problem's shapes"
    );
}

/// Runs `f` with the handle, the descriptors and the host scalars (alpha = 1, beta = 0) of the
/// scale type cuDNN reads for the dtype: double for f64, float otherwise.
fn call(
    rt: &DeviceRuntime,
    p: &PoolParams,
    f: impl FnOnce(sys::cudnnHandle_t, &Descriptors, *const c_void, *const c_void) -> sys::cudnnStatus_t,
) -> Result<sys::cudnnStatus_t> {
    let desc = Descriptors::new(p)?;
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if p.dtype == DType::F64 {
        ((&one64 as *const f64).cast(), (&zero64 as *const f64).cast())
    } else {
        ((&one32 as *const f32).cast(), (&zero32 as *const f32).cast())
    };
    super::kernel_timing::note_work(super::stream::current_raw(rt.ordinal));
    with_handle(OP, rt, |handle| Ok(f(handle, &desc, alpha, beta)))
}

impl PoolOps for CudaStorage {
    /// `y = pool(x)` for a contiguous `x` (`p.input`) starting at its first element: a new
    /// contiguous `[N, C, OH, OW]` storage, or None where cuDNN does not support the problem
    /// (`CUDNN_STATUS_NOT_SUPPORTED`, e.g. a dtype this cuDNN build cannot pool).
    fn pool_forward(&self, p: &PoolParams) -> Result<Option<CudaStorage>> {
        if !cudnn_on() || !supported(p) {
            return Ok(None);
        }
        let x = self;
        let out = p.output().expect("checked by supported()");
        check_operand("forward", x, p.dtype, p.input.iter().product());
        let rt = x.runtime()?;
        let y = CudaStorage::alloc_on(rt, p.dtype, out.iter().product())?;
        let (xp, yp) = (x.ptr_at(0) as *const c_void, y.ptr_at(0) as *mut c_void);
        let status = call(rt, p, |handle, d, alpha, beta| {
            // SAFETY: the descriptors describe exactly the contiguous buffers (`x` holds at least
            // the input's elements, `y` was allocated with the output's); beta = 0, so `y` is only
            // written. alpha/beta are host scalars of the scale type that outlive the call; the
            // handle is this thread's alone, bound to the current stream (Note [cuDNN state]).
            unsafe { sys::cudnnPoolingForward(handle, d.pool, alpha, d.x, xp, beta, d.y, yp) }
        })?;
        if status == sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED {
            return Ok(None);
        }
        check("cudnnPoolingForward", status)?;
        Ok(Some(y))
    }

    /// The input gradient from the forward's input `x`, its output `y` and the output gradient
    /// `dy` (all contiguous, of the problem's shapes): a new contiguous `[N, C, H, W]` storage.
    fn pool_backward(
        &self,
        output: &CudaStorage,
        grad_out: &CudaStorage,
        p: &PoolParams,
    ) -> Result<Option<CudaStorage>> {
        if !cudnn::is_available() || !supported(p) {
            return Ok(None);
        }
        let (x, y, dy) = (self, output, grad_out);
        let out: usize = p.output().expect("checked by supported()").iter().product();
        let len: usize = p.input.iter().product();
        check_operand("backward", x, p.dtype, len);
        check_operand("backward", y, p.dtype, out);
        check_operand("backward", dy, p.dtype, out);
        let rt = x.runtime()?;
        let dx = CudaStorage::alloc_on(rt, p.dtype, len)?;
        let (xp, yp, dyp, dxp) = (
            x.ptr_at(0) as *const c_void,
            y.ptr_at(0) as *const c_void,
            dy.ptr_at(0) as *const c_void,
            dx.ptr_at(0) as *mut c_void,
        );
        let status = call(rt, p, |handle, d, alpha, beta| {
            // SAFETY: as in `pool_forward`: `y` and `dy` have the output's shape (descriptor `d.y`),
            // `x` and `dx` the input's (`d.x`); beta = 0, so `dx` is only written (every element:
            // positions no window reads get zero).
            unsafe {
                sys::cudnnPoolingBackward(handle, d.pool, alpha, d.y, yp, d.y, dyp, d.x, xp, beta, d.x, dxp)
            }
        })?;
        check("cudnnPoolingBackward", status)?;
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(input: [usize; 4], kernel: usize, stride: usize, padding: usize) -> PoolParams {
        PoolParams {
            dtype: DType::F32,
            mode: PoolMode::Max,
            input,
            kernel: [kernel; 2],
            stride: [stride; 2],
            padding: [padding; 2],
        }
    }

    #[test]
    fn supported_problems() {
        assert!(supported(&params([2, 3, 8, 8], 3, 2, 1)));
        assert!(!supported(&params([0, 3, 8, 8], 2, 2, 0)));
        assert!(!supported(&params([2, 3, 8, 8], 2, 2, 2)));
        let mut p = params([2, 3, 8, 8], 2, 2, 0);
        p.dtype = DType::I64;
        assert!(!supported(&p));
        assert!(!supported(&params([1, 1, 1 << 16, 1 << 16], 1, 1, 0)));
    }
}
