//! CUDA launchers for `kernels/random.cu`: uniform, normal, bernoulli and randint draws that
//! reproduce the CPU backend bit for bit (Note [Philox stream] in `random/mod.rs`; the caveat on
//! f64 `ln`/`sin`/`cos` there applies to normals), and randperm.
//!
//! - f16 results go through `half::f16::from_f64` on the CPU, which rounds differently depending
//!   on the host (through f32 with x86 F16C, or a software routine that ignores the low 32 bits
//!   of the f64). [`f16_mode`] probes which one this process uses and the kernels copy it.
//! - `bernoulli` with a probability tensor validates the probabilities in the same kernel and
//!   reads a device flag back (one host synchronization, as the CPU returns an error for a
//!   probability outside [0, 1]); only when the flag is set are they copied to the host to name
//!   the first bad one.
//! - `randperm` is computed on the host with the CPU kernel (O(n) host work plus a sort) and
//!   copied to the device: the simplest way to give exactly the CPU's permutation.

use super::kernels::{launch, Grid, KernelKey, KernelShape, Module};
use super::runtime::runtime;
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::op::{randint_range, Distribution, RngState};
use crate::cpu::CpuStorage;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use std::sync::OnceLock;

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
        state: RngState,
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
        let stream = current_raw(rt.ordinal);
        let (o, n64, seed, offset) = (out.ptr_at(0), n as i64, state.seed, state.offset);
        match dist {
            Distribution::Uniform { low: a, high: b } | Distribution::Normal { mean: a, std: b } => {
                let base = if matches!(dist, Distribution::Uniform { .. }) {
                    "uniform"
                } else {
                    "normal"
                };
                let f = rt.function(KernelKey::new(Module::Random, base, dtype))?;
                let mode = f16_mode();
                // SAFETY: `uniform_T` / `normal_T(T* out, i64 n, u64 seed, u64 offset, f64,
                // f64, i32 f16_mode)`; `out` holds `n` elements of T.
                unsafe { launch(f, grid, stream, &[&o, &n64, &seed, &offset, &a, &b, &mode])? };
            }
            Distribution::Bernoulli { p } => {
                let f = rt.function(KernelKey::new(Module::Random, "bernoulli_p", dtype))?;
                // SAFETY: `bernoulli_p_T(T* out, i64 n, u64 seed, u64 offset, f64 p)`; `out`
                // holds `n` elements of T.
                unsafe { launch(f, grid, stream, &[&o, &n64, &seed, &offset, &p])? };
            }
            Distribution::RandInt { low, high } => {
                let range = randint_range(low, high);
                let f = rt.function(KernelKey::new(Module::Random, "randint", DType::I64))?;
                // SAFETY: `randint_i64(i64* out, i64 n, u64 seed, u64 offset, i64 low,
                // u64 range)`; `out` holds `n` i64 and `range` >= 1 (the caller checks low < high).
                unsafe { launch(f, grid, stream, &[&o, &n64, &seed, &offset, &low, &range])? };
            }
        }
        Ok(out)
    }

    /// A random permutation of `0..n` as i64 on GPU `device`: the CPU's, computed on the host
    /// and copied (see the module docs).
    pub(crate) fn randperm(device: usize, n: usize, state: RngState) -> Result<CudaStorage> {
        CudaStorage::from_cpu(&crate::cpu::random::randperm(n, state), device)
    }

    /// Bernoulli draws with the probabilities at `layout`, in this storage's dtype; an error
    /// naming the first probability outside [0, 1], as on the CPU.
    pub(crate) fn bernoulli(&self, layout: &Layout, state: RngState) -> Result<CudaStorage> {
        let rt = self.runtime()?;
        let n = layout.numel();
        let out = CudaStorage::alloc_on(rt, self.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        let flag = CudaStorage::full(rt.ordinal, DType::I32, 1, 0.0)?;
        let shape = KernelShape::new("bernoulli", layout.dims(), &[layout.strides()])?;
        let f = rt.function(KernelKey::new(Module::Random, "bernoulli", self.dtype()))?;
        let (p, o, fl) = (self.ptr(layout), out.ptr_at(0), flag.ptr_at(0));
        let (n64, seed, offset) = (n as i64, state.seed, state.offset);
        // SAFETY: `bernoulli_T(const T* prob, Strided s, T* out, i64 n, u64 seed, u64 offset,
        // i32* flag)`; `prob` reaches the `n` elements of a valid layout, `out` holds `n`
        // elements, `flag` one i32.
        unsafe {
            launch(
                f,
                Grid::linear(rt, n.div_ceil(4), 256),
                current_raw(rt.ordinal),
                &[&p, &shape, &o, &n64, &seed, &offset, &fl],
            )?;
        }
        let CpuStorage::I32(set) = flag.to_cpu(&Layout::contiguous([1]))? else {
            unreachable!("the flag is an i32")
        };
        if set[0] != 0 {
            let CpuStorage::F64(probs) = self
                .to_cpu(layout)?
                .to_dtype(&Layout::contiguous([n]), DType::F64)
            else {
                unreachable!("converted to f64")
            };
            if let Some(bad) = probs.iter().find(|&&x| !(0.0..=1.0).contains(&x)) {
                return Err(Error::invalid(
                    "bernoulli",
                    format!("expected all probabilities in [0, 1], found {bad}"),
                ));
            }
        }
        Ok(out)
    }
}
