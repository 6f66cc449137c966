//! CUDA launchers for `kernels/random.cu`: uniform, normal, bernoulli and randint draws that
//! reproduce the CPU backend bit for bit (Note [Philox stream] in `random/mod.rs`; the caveat on
//! f64 `ln`/`sin`/`cos` there applies to normals).
//!
//! - f16 results go through `half::f16::from_f64` on the CPU, which rounds differently depending
//!   on the host (through f32 with x86 F16C, or a software routine that ignores the low 32 bits
//!   of the f64). [`f16_mode`] probes which one this process uses and the kernels copy it.
//! - `bernoulli` with a probability tensor validates the probabilities in the same kernel and
//!   records the first one outside [0, 1] (or NaN) in the device's error record, reported with
//!   the CPU's message at the next synchronizing call (Note [Deferred device errors] in
//!   `device_errors.rs`): nothing is read back.
//! - Every kernel takes its Philox `(seed, offset)` as a [`PhiloxArgs`]: by value, or, for a
//!   generator capturing a CUDA graph, as device pointers (Note [Philox under graph capture] in
//!   `random/mod.rs`); `philox_seed_offset` in the prelude reads either, so both paths share
//!   every kernel.
//! - `randperm` is not here: on every device it is the CPU's permutation, computed on the host
//!   and copied (`Storage::randperm`), the simplest way to give exactly the CPU's permutation.

use super::device_errors::Kind;
use super::kernels::{Grid, KernelParam, KernelShape};
use super::launch;
use super::runtime::{runtime, DeviceRuntime};
use super::storage::CudaStorage;
use crate::backend::op::{randint_range, Distribution, PhiloxState, RngState};
use crate::backend::BackendStorage;
use crate::backend::RandomOps;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use std::sync::OnceLock;

/// The Philox `(seed, offset)` argument of every kernel of `random.cu` (`PhiloxArgs` in the
/// prelude, same layout): by value when `seed_ptr` is 0, else read on the device.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PhiloxArgs {
    seed: u64,
    offset: u64,
    seed_ptr: u64,
    offset_ptr: u64,
}

// SAFETY: repr(C) with the field order, types and size of the prelude's `PhiloxArgs`.
unsafe impl KernelParam for PhiloxArgs {}

impl PhiloxArgs {
    /// The kernel argument for `state` on `rt`'s device; an error for device pointers of
    /// another device.
    fn new(op: &'static str, rt: &DeviceRuntime, state: PhiloxState) -> Result<PhiloxArgs> {
        Ok(match state {
            PhiloxState::Value(RngState { seed, offset }) => PhiloxArgs {
                seed,
                offset,
                seed_ptr: 0,
                offset_ptr: 0,
            },
            PhiloxState::Device {
                device,
                seed_ptr,
                offset_ptr,
                offset,
            } => {
                if device != rt.ordinal {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "the generator is capturing on cuda:{device}, this draw is on cuda:{}",
                            rt.ordinal
                        ),
                    ));
                }
                PhiloxArgs {
                    seed: 0,
                    offset,
                    seed_ptr,
                    offset_ptr,
                }
            }
        })
    }
}

/// How this process's `half::f16::from_f64` rounds (the `f16_mode` argument of `random.cu`):
/// 0 correctly rounded, 1 through f32 (x86 F16C), 2 `half`'s software routine (truncates the
/// f64 to its high 32 bits before rounding). Probed once with values that tell them apart.
fn f16_mode() -> i32 {
    static MODE: OnceLock<i32> = OnceLock::new();
    *MODE.get_or_init(|| {
        let one = half::f16::from_f64(1.0).to_bits();
        // Just above a tie of f16 by 2^-40: only a correct rounding sees it.
        let a = half::f16::from_f64(1.0 + 2f64.powi(-11) + 2f64.powi(-40)).to_bits() != one;
        // Above the tie by 2^-21: exact in f32, dropped with the low 32 bits of the f64.
        let b = half::f16::from_f64(1.0 + 2f64.powi(-11) + 2f64.powi(-21)).to_bits() != one;
        match (a, b) {
            (true, _) => 0,
            (false, true) => 1,
            (false, false) => 2,
        }
    })
}

impl CudaStorage {
    /// `n` elements of `dtype` drawn from `dist` at `state` on GPU `device` (Note [Philox
    /// stream]); the same dtype rules and errors as the CPU.
    pub(crate) fn random(
        device: usize,
        dtype: DType,
        n: usize,
        dist: Distribution,
        state: PhiloxState,
    ) -> Result<CudaStorage> {
        let float_only = |op| {
            if dtype.is_floating_point() {
                Ok(())
            } else {
                Err(Error::dtype(op, dtype))
            }
        };
        match dist {
            Distribution::Uniform { .. } => float_only("uniform")?,
            Distribution::Normal { .. } => float_only("normal")?,
            Distribution::RandInt { .. } if dtype != DType::I64 => {
                return Err(Error::dtype("randint", dtype))
            }
            _ => {}
        }
        let rt = runtime(device)?;
        let out = CudaStorage::alloc_on(rt, dtype, n)?;
        if n == 0 {
            return Ok(out);
        }
        let per_block = dist.per_block(dtype);
        let grid = Grid::linear(rt, n.div_ceil(per_block), 256);
        let (o, n64) = (out.dev_ptr_mut_at(0), n as i64);
        // Device pointers in `rng` are the generator's live capture slots on this device.
        let rng = PhiloxArgs::new("random", rt, state)?;
        // `out` holds `n` elements of `dtype`.
        match dist {
            Distribution::Uniform { low, high } => {
                launch::uniform(rt, &[dtype], grid, o, n64, &rng, low, high, f16_mode())?
            }
            Distribution::Normal { mean, std } => {
                launch::normal(rt, &[dtype], grid, o, n64, &rng, mean, std, f16_mode())?
            }
            Distribution::Bernoulli { p } => launch::bernoulli_p(rt, &[dtype], grid, o, n64, &rng, p)?,
            Distribution::RandInt { low, high } => {
                // `range` >= 1: the caller checks low < high.
                let range = randint_range(low, high);
                launch::randint(rt, &[DType::I64], grid, o, n64, &rng, low, range)?
            }
        }
        Ok(out)
    }
}

impl RandomOps for CudaStorage {
    /// Bernoulli draws with the probabilities at `layout`, in this storage's dtype; the first
    /// probability outside [0, 1] is reported at the next synchronizing call with the CPU's
    /// error (see the module docs).
    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let n = layout.numel();
        let out = CudaStorage::alloc_on(rt, self.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        let shape = KernelShape::new("bernoulli", layout.dims(), &[layout.strides()])?;
        let (p, o, n64) = (self.dev_ptr(layout), out.dev_ptr_mut_at(0), n as i64);
        let rng = PhiloxArgs::new("bernoulli", rt, state)?;
        let check = rt.errors.check_args("bernoulli", Kind::Probability, 0, 0);
        // `prob` reaches the `n` elements of a valid layout, `out` holds `n` elements; `rng` as
        // in `random`.
        let (dtypes, grid) = ([self.dtype()], Grid::linear(rt, n.div_ceil(4), 256));
        launch::bernoulli(rt, &dtypes, grid, p, &shape, o, n64, &rng, &check)?;
        Ok(out)
    }
}
