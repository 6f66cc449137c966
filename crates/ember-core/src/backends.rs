//! Switches of the libraries behind the CUDA ops, as `torch.backends`.

/// cuDNN, as `torch.backends.cudnn`: whether it loads and its version, and the switches that
/// steer convolutions on CUDA (`enabled`, `benchmark`, `deterministic`, `allow_tf32`; `enabled`
/// also covers max and average pooling, `ops::pool::pool2d`). The
/// switches are process-wide and read at each call (a changed switch chooses anew per shape).
pub mod cudnn {
    pub use crate::cuda_backend::cudnn::{
        allow_tf32, benchmark, deterministic, enabled, is_available, set_allow_tf32, set_benchmark,
        set_deterministic, set_enabled, version,
    };
}

/// The CUDA switches of `torch.backends.cuda` that ember has: which fused backends
/// `F.scaled_dot_product_attention` may take (`enable_cudnn_sdp`, `enable_math_sdp`).
/// Process-wide, read at each call. ember's fused attention is cuDNN's (`ops::attention`);
/// PyTorch's own flash and memory-efficient kernels have no counterpart here.
pub mod cuda {
    use std::sync::atomic::{AtomicBool, Ordering};

    static CUDNN_SDP: AtomicBool = AtomicBool::new(true);
    static MATH_SDP: AtomicBool = AtomicBool::new(true);

    /// Whether attention may run on cuDNN's fused kernels (`torch.backends.cuda.cudnn_sdp_enabled()`).
    pub fn cudnn_sdp_enabled() -> bool {
        CUDNN_SDP.load(Ordering::Relaxed)
    }

    /// Allows or forbids cuDNN's fused attention (`torch.backends.cuda.enable_cudnn_sdp`).
    pub fn enable_cudnn_sdp(enabled: bool) {
        CUDNN_SDP.store(enabled, Ordering::Relaxed)
    }

    /// Whether attention may take the math path (`torch.backends.cuda.math_sdp_enabled()`).
    pub fn math_sdp_enabled() -> bool {
        MATH_SDP.load(Ordering::Relaxed)
    }

    /// Allows or forbids the math path (`torch.backends.cuda.enable_math_sdp`); with both off,
    /// attention is an error that says so.
    pub fn enable_math_sdp(enabled: bool) {
        MATH_SDP.store(enabled, Ordering::Relaxed)
    }
}
