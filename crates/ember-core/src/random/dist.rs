//! The backend boundary of random generation: the [`Distribution`] op enum, how many Philox
//! counter blocks a draw consumes, and the `impl Storage` block that dispatches each draw to a
//! backend's kernel (`random/cpu.rs` now; a CUDA arm later). Kernels return a new row-major
//! storage; see Note [Philox stream] in `random/mod.rs` for the exact values.

use super::cpu;
use super::RngState;
use crate::cuda::CudaStorage;
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Device, Result};

/// What to draw, backend-independent (the op enum of the random family).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Uniform on `[low, high)`, floating dtypes.
    Uniform { low: f64, high: f64 },
    /// Normal with this mean and standard deviation, floating dtypes.
    Normal { mean: f64, std: f64 },
    /// 1 with probability `p`, else 0, any dtype.
    Bernoulli { p: f64 },
    /// Integers uniform on `[low, high)`, i64.
    RandInt { low: i64, high: i64 },
}

impl Distribution {
    /// Elements drawn from one counter block (`E` in Note [Philox stream]).
    pub fn per_block(self, dtype: DType) -> usize {
        match self {
            Distribution::Uniform { .. } | Distribution::Normal { .. } => {
                if dtype == DType::F64 {
                    2
                } else {
                    4
                }
            }
            Distribution::Bernoulli { .. } => 4,
            Distribution::RandInt { low, high } => {
                if randint_range(low, high) <= 1 << 32 {
                    4
                } else {
                    2
                }
            }
        }
    }

    /// Counter blocks a draw of `n` elements of `dtype` consumes.
    pub fn blocks(self, n: usize, dtype: DType) -> u64 {
        blocks_for(n, self.per_block(dtype))
    }
}

/// `high - low` of a randint as u64 (callers ensure `low < high`).
pub(crate) fn randint_range(low: i64, high: i64) -> u64 {
    (high as i128 - low as i128) as u64
}

/// `ceil(n / per_block)`.
pub(crate) fn blocks_for(n: usize, per_block: usize) -> u64 {
    n.div_ceil(per_block) as u64
}

/// Elements of one randperm key block (two words per key).
pub(crate) const RANDPERM_PER_BLOCK: usize = 2;

impl Storage {
    /// `n` elements of `dtype` drawn from `dist` at `state`, row-major, on `device`.
    pub(crate) fn random(
        device: Device,
        dtype: DType,
        n: usize,
        dist: Distribution,
        state: RngState,
    ) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(cpu::random(dtype, n, dist, state)?)),
            Device::Cuda(i) => Ok(Storage::Cuda(CudaStorage::random(i, dtype, n, dist, state)?)),
        }
    }

    /// A random permutation of `0..n` as i64 on `device`.
    pub(crate) fn randperm(device: Device, n: usize, state: RngState) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(cpu::randperm(n, state))),
            Device::Cuda(i) => Ok(Storage::Cuda(CudaStorage::randperm(i, n, state)?)),
        }
    }

    /// Bernoulli draws with the probabilities of `layout` (row-major order), in the same dtype;
    /// fails when a probability is outside [0, 1].
    pub(crate) fn bernoulli(&self, layout: &Layout, state: RngState) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::bernoulli(s, layout, state)?)),
            Storage::Cuda(s) => Ok(Storage::Cuda(s.bernoulli(layout, state)?)),
        }
    }
}
