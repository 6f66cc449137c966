//! `torch.cuda` for ember programs: everything of `ember_core::cuda`, with PyTorch's
//! no-argument forms for the current device.
//!
//! Note [Current-device forms]: PyTorch's `torch.cuda.synchronize(device=None)`,
//! `memory_allocated(device=None)`, ... act on the current device when called without one.
//! Rust has no default arguments, so here the PyTorch name is the no-argument form, acting on
//! [`current_device`] (the thread's device of [`set_device`] or a [`DeviceGuard`]), and the
//! form with an explicit device index carries `_on`: `synchronize()` /
//! `synchronize_on(1)`, `memory_allocated()` / `memory_allocated_on(1)`. `ember_core::cuda`
//! keeps the explicit forms under the plain names, as the backend's API. [`empty_cache`]
//! releases the cache of every device, as it always did. The [`Stream`] type is core's, so its
//! constructors follow this rule in core: `Stream::new()` / `Stream::new_on(1)`.
//!
//! The random-number functions are `torch.cuda`'s: [`manual_seed`] seeds the current
//! device's default generator, [`manual_seed_all`] every device's; [`get_rng_state`] /
//! [`set_rng_state`] read and restore the current device's state (`_on` forms for another
//! device); [`seed`] / [`seed_all`] seed from a non-deterministic source; [`initial_seed`] is
//! the current device's seed. They need no GPU: a generator's state is (seed, offset) on the
//! host (Philox, counter-based), so seeding before the first CUDA use or on a machine without
//! one is fine, as in PyTorch.

pub use ember_core::cuda::*;

use ember_core::{default_generator, Device, Result, RngState};

/// Blocks until all work on the current device has finished, on every stream
/// (`torch.cuda.synchronize()`); Note [Current-device forms].
pub fn synchronize() -> Result<()> {
    ember_core::cuda::synchronize(current_device())
}

/// Blocks until all work on `device` has finished (`torch.cuda.synchronize(device)`).
pub fn synchronize_on(device: usize) -> Result<()> {
    ember_core::cuda::synchronize(device)
}

macro_rules! current_device_forms {
    ($($name:ident, $on:ident -> $ret:ty, $doc:literal;)*) => {$(
        #[doc = concat!($doc, " of the current device (`torch.cuda.", stringify!($name), "()`); Note [Current-device forms].")]
        pub fn $name() -> $ret {
            ember_core::cuda::$name(current_device())
        }

        #[doc = concat!($doc, " of `device` (`torch.cuda.", stringify!($name), "(device)`).")]
        pub fn $on(device: usize) -> $ret {
            ember_core::cuda::$name(device)
        }
    )*};
}

current_device_forms! {
    memory_allocated, memory_allocated_on -> usize, "Bytes held by tensors";
    max_memory_allocated, max_memory_allocated_on -> usize, "Peak bytes held by tensors since the last reset";
    memory_reserved, memory_reserved_on -> usize, "Bytes the caching allocator holds";
    max_memory_reserved, max_memory_reserved_on -> usize, "Peak bytes the caching allocator held since the last reset";
    memory_summary, memory_summary_on -> String, "A readable table of the allocator's statistics";
    memory_stats, memory_stats_on -> std::collections::BTreeMap<String, i64>, "Every allocator statistic under PyTorch's key names";
    reset_peak_memory_stats, reset_peak_memory_stats_on -> (), "Resets the peak statistics";
    reset_accumulated_memory_stats, reset_accumulated_memory_stats_on -> (), "Resets the accumulated (count) statistics";
    mem_get_info, mem_get_info_on -> Result<(usize, usize)>, "Free and total bytes of device memory, from the driver,";
    memory_snapshot, memory_snapshot_on -> Result<String>, "The allocator's segments and blocks as text";
    snapshot, snapshot_on -> Result<ember_core::pickle::Value>, "The memory snapshot in PyTorch's structure (`torch.cuda.memory._snapshot`)";
    current_stream, current_stream_on -> Result<Stream>, "The current stream";
}

/// Starts (`enabled`) or stops recording allocation history of the current device, keeping at
/// most `max_entries` events (`torch.cuda.memory._record_memory_history(max_entries=..)`);
/// Note [Current-device forms].
pub fn record_memory_history(enabled: bool, max_entries: usize) -> Result<()> {
    ember_core::cuda::record_memory_history(current_device(), enabled, max_entries)
}

/// [`record_memory_history`] of `device`.
pub fn record_memory_history_on(device: usize, enabled: bool, max_entries: usize) -> Result<()> {
    ember_core::cuda::record_memory_history(device, enabled, max_entries)
}

/// Writes the current device's memory snapshot to `path` as PyTorch's pickle
/// (`torch.cuda.memory._dump_snapshot(path)`); Note [Current-device forms].
pub fn dump_snapshot(path: impl AsRef<std::path::Path>) -> Result<()> {
    ember_core::cuda::dump_snapshot(current_device(), path)
}

/// [`dump_snapshot`] of `device`.
pub fn dump_snapshot_on(device: usize, path: impl AsRef<std::path::Path>) -> Result<()> {
    ember_core::cuda::dump_snapshot(device, path)
}

/// Whether the current device runs bfloat16 (`torch.cuda.is_bf16_supported()`, whose default
/// `including_emulation=True` this is): `true` on any usable CUDA device, since ember's bf16
/// kernels keep bf16 as 16-bit integers converted in software; `false` without CUDA. Choose
/// the autocast dtype with [`is_bf16_supported_with`]`(false)`, which asks for native bf16
/// arithmetic (Ampere, compute capability 8.0, and later), as PyTorch's
/// `is_bf16_supported(including_emulation=False)` does.
pub fn is_bf16_supported() -> bool {
    is_bf16_supported_with(true)
}

/// `torch.cuda.is_bf16_supported(including_emulation)` for the current device; see
/// [`is_bf16_supported`].
pub fn is_bf16_supported_with(including_emulation: bool) -> bool {
    if !is_available() {
        return false;
    }
    match get_device_capability(current_device()) {
        Ok((major, _)) => native_bf16(major) || including_emulation,
        Err(_) => false,
    }
}

/// Whether the current device has TF32 tensor cores (`torch.cuda.is_tf32_supported()`):
/// compute capability 8.0 and later; `false` without CUDA. Whether matmuls use them is
/// [`set_float32_matmul_precision`] / [`set_allow_tf32`].
pub fn is_tf32_supported() -> bool {
    is_bf16_supported_with(false)
}

/// Native bf16 (and TF32) arithmetic: compute capability 8.0 (Ampere) and later.
fn native_bf16(major: u32) -> bool {
    major >= 8
}

/// The default generator of CUDA device `device`.
fn generator(device: usize) -> &'static ember_core::Generator {
    default_generator(Device::Cuda(device))
}

/// Seeds the current device's default generator (`torch.cuda.manual_seed`).
pub fn manual_seed(seed: u64) {
    generator(current_device()).manual_seed(seed);
}

/// Seeds the default generator of every CUDA device (`torch.cuda.manual_seed_all`); nothing
/// to do without CUDA.
pub fn manual_seed_all(seed: u64) {
    for device in 0..device_count() {
        generator(device).manual_seed(seed);
    }
}

/// Seeds the current device's generator from a non-deterministic source and returns the seed
/// (`torch.cuda.seed`).
pub fn seed() -> u64 {
    generator(current_device()).seed()
}

/// Seeds every CUDA device's generator from one non-deterministic seed, returned
/// (`torch.cuda.seed_all`).
pub fn seed_all() -> u64 {
    let s = generator(current_device()).seed();
    manual_seed_all(s);
    s
}

/// The seed of the current device's generator (`torch.cuda.initial_seed`).
pub fn initial_seed() -> u64 {
    generator(current_device()).initial_seed()
}

/// The state of the current device's generator (`torch.cuda.get_rng_state()`).
pub fn get_rng_state() -> RngState {
    generator(current_device()).get_state()
}

/// The state of `device`'s generator (`torch.cuda.get_rng_state(device)`).
pub fn get_rng_state_on(device: usize) -> RngState {
    generator(device).get_state()
}

/// Restores the state of the current device's generator (`torch.cuda.set_rng_state`).
pub fn set_rng_state(state: RngState) {
    generator(current_device()).set_state(state)
}

/// Restores the state of `device`'s generator (`torch.cuda.set_rng_state(state, device)`).
pub fn set_rng_state_on(state: RngState, device: usize) {
    generator(device).set_state(state)
}

/// The states of every CUDA device's generator, by ordinal (`torch.cuda.get_rng_state_all`).
pub fn get_rng_state_all() -> Vec<RngState> {
    (0..device_count()).map(get_rng_state_on).collect()
}

/// Restores the states of [`get_rng_state_all`] (`torch.cuda.set_rng_state_all`).
pub fn set_rng_state_all(states: &[RngState]) {
    for (device, state) in states.iter().enumerate() {
        set_rng_state_on(*state, device);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_device_forms_agree_with_the_explicit_ones() {
        // Without a GPU every statistic is zero and synchronize is a typed error, not a panic.
        // With one, other tests of this binary allocate concurrently: the two forms agree when
        // nothing allocates between the two reads, which some of 100 tries catch.
        let dev = current_device();
        assert!((0..100).any(|_| memory_allocated() == memory_allocated_on(dev)));
        assert!((0..100).any(|_| memory_summary() == memory_summary_on(dev)));
        assert!((0..100).any(|_| memory_stats() == memory_stats_on(dev)));
        if !is_available() {
            assert!(synchronize().is_err() && synchronize_on(0).is_err());
            // Without a GPU the device forms are typed errors or no-ops, never panics.
            assert!(mem_get_info().is_err() && mem_get_info_on(0).is_err());
            assert!(current_stream().is_err() && current_stream_on(0).is_err());
            assert!(
                Stream::new().is_err() && Stream::new_on(0).is_err() && Stream::with_priority(-1).is_err()
            );
            assert!(
                record_memory_history(true, 10).is_err() && record_memory_history_on(0, true, 10).is_err()
            );
            assert!(dump_snapshot(std::env::temp_dir().join("ember-no-gpu.pickle")).is_err());
            reset_accumulated_memory_stats();
            reset_accumulated_memory_stats_on(dev);
        }
    }

    #[test]
    fn bf16_and_tf32_support_follow_the_compute_capability() {
        assert!(!native_bf16(7) && native_bf16(8) && native_bf16(9));
        if !is_available() {
            assert!(!is_bf16_supported() && !is_bf16_supported_with(false) && !is_tf32_supported());
        } else {
            let (major, _) = get_device_capability(current_device()).unwrap();
            assert!(is_bf16_supported());
            assert_eq!(is_tf32_supported(), major >= 8);
            assert_eq!(is_bf16_supported_with(false), major >= 8);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_hopper_gpu_has_native_bf16_and_tf32() {
        assert!(is_available(), "this test needs a CUDA device");
        assert!(is_bf16_supported() && is_bf16_supported_with(false) && is_tf32_supported());
    }

    #[test]
    fn cuda_rng_names_seed_and_restore_the_current_devices_generator() {
        manual_seed(1234);
        assert_eq!(initial_seed(), 1234);
        assert_eq!(get_rng_state().seed, 1234);
        let saved = get_rng_state();
        set_rng_state(RngState {
            seed: 7,
            offset: saved.offset + 8,
        });
        assert_eq!(get_rng_state_on(current_device()).seed, 7);
        set_rng_state(saved);
        assert_eq!(get_rng_state(), saved);
        let s = seed();
        assert_eq!(initial_seed(), s);
        // `torch.manual_seed` seeds every device, CUDA included.
        ember_core::manual_seed(99).unwrap();
        assert_eq!((ember_core::initial_seed(), initial_seed()), (99, 99));
        assert_eq!(get_rng_state_all().len(), device_count());
    }

    #[test]
    fn cuda_graphs_have_pytorchs_names() {
        let mut g: CUDAGraph = CUDAGraph::new();
        let handle: MempoolId = graph_pool_handle();
        assert_eq!(handle.0, 0);
        assert!(!is_current_stream_capturing());
        assert!(g.replay().is_err() && g.pool().is_err());
        let _scoped: fn(&mut CUDAGraph) -> Result<GraphCapture<'_>> = graph;
        let options = GraphOptions {
            pool: Some(handle),
            capture_error_mode: CaptureErrorMode::ThreadLocal,
            ..Default::default()
        };
        if !is_available() {
            assert!(graph_with(&mut g, options).is_err());
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn plain_cuda_follows_the_device_guard_on_a_gpu() -> Result<()> {
        assert!(is_available(), "this test needs a CUDA device");
        let last = device_count() - 1;
        let _g = DeviceGuard::new(last)?;
        assert_eq!(Device::parse("cuda")?, Device::Cuda(last));
        let before = memory_allocated();
        let t = ember_core::Tensor::zeros([1024], ember_core::DType::F32, Device::cuda())?;
        assert_eq!(t.device(), Device::Cuda(last));
        synchronize()?;
        assert!(memory_allocated() >= before + 4096);
        assert_eq!(memory_allocated(), memory_allocated_on(last));
        assert!(memory_summary().contains("Allocated"), "{}", memory_summary());
        Ok(())
    }
}
