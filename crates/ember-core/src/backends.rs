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
