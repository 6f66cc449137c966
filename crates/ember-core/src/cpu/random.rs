//! CPU kernels of the random family: each fills a new row-major `Vec` following Note
//! [Philox stream] (`random/mod.rs`, with the block function of `random/philox.rs`), in parallel over chunks of whole counter blocks above
//! [`PAR_THRESHOLD`] elements, so the result does not depend on the number of threads.

use super::philox::{
    block_counter, box_muller, join_u64, philox4x32_10, seed_key, uniform_bits_f32, uniform_f32, uniform_f64,
    uniform_open0_f32, uniform_open0_f64,
};
use super::{CpuElement, CpuStorage, PAR_THRESHOLD};
use crate::backend::op::{randint_range, Distribution, RngState, RANDPERM_PER_BLOCK};
use crate::backend::{BackendStorage, CopyOps, PhiloxState, RandomOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Counter blocks one rayon task generates.
const BLOCKS_PER_TASK: usize = 2048;

/// Calls `f(words of block offset + j, elements j*per_block ..)` for each block `j` covering
/// `out`; the last part may be shorter than `per_block`.
fn fill_blocks<T, F>(out: &mut [T], per_block: usize, state: RngState, f: F)
where
    T: Send,
    F: Fn(&[u32; 4], &mut [T]) + Sync,
{
    let key = seed_key(state.seed);
    let run = |first: u64, chunk: &mut [T]| {
        for (j, part) in chunk.chunks_mut(per_block).enumerate() {
            let words = philox4x32_10(block_counter(first.wrapping_add(j as u64)), key);
            f(&words, part);
        }
    };
    if out.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            out.par_chunks_mut(per_block * BLOCKS_PER_TASK)
                .enumerate()
                .for_each(|(c, chunk)| run(state.offset.wrapping_add((c * BLOCKS_PER_TASK) as u64), chunk))
        });
    } else {
        run(state.offset, out);
    }
}

/// `n` elements of `dtype` drawn from `dist` (Note [Philox stream]).
pub(crate) fn random(dtype: DType, n: usize, dist: Distribution, state: RngState) -> Result<CpuStorage> {
    let float_only = |op| match dtype {
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Ok(()),
        _ => Err(Error::dtype(op, dtype)),
    };
    Ok(match dist {
        Distribution::Uniform { low, high } => {
            float_only("uniform")?;
            match dtype {
                DType::F64 => f64::wrap(uniform_wide(n, low, high, state)),
                DType::F16 => f16::wrap(uniform_narrow(n, 11, low, high, state)),
                DType::BF16 => bf16::wrap(uniform_narrow(n, 8, low, high, state)),
                _ => f32::wrap(uniform_narrow(n, 24, low, high, state)),
            }
        }
        Distribution::Normal { mean, std } => {
            float_only("normal")?;
            match dtype {
                DType::F64 => f64::wrap(normal_wide(n, mean, std, state)),
                DType::F16 => f16::wrap(normal_narrow(n, mean, std, state)),
                DType::BF16 => bf16::wrap(normal_narrow(n, mean, std, state)),
                _ => f32::wrap(normal_narrow(n, mean, std, state)),
            }
        }
        Distribution::Bernoulli { p } => {
            let mut v = vec![p; n];
            bernoulli_in_place(&mut v, state);
            CpuStorage::F64(v).to_dtype(&Layout::contiguous([n]), dtype)?
        }
        Distribution::RandInt { low, high } => {
            if dtype != DType::I64 {
                return Err(Error::dtype("randint", dtype));
            }
            i64::wrap(randint(n, low, high, state))
        }
    })
}

/// Uniforms of an f32-computed dtype with `bits` random bits each (24 f32, 11 f16, 8 bf16).
fn uniform_narrow<T: CpuElement>(n: usize, bits: u32, low: f64, high: f64, state: RngState) -> Vec<T> {
    let (lo, hi) = (low as f32, high as f32);
    let range = hi - lo;
    let (lo_t, hi_t) = (T::from_f64(lo as f64), T::from_f64(hi as f64));
    let mut out = vec![T::zero(); n];
    fill_blocks(&mut out, 4, state, |w, part| {
        for (o, &x) in part.iter_mut().zip(w) {
            let v = T::from_f64((lo + uniform_bits_f32(x, bits) * range) as f64);
            // Rounding may reach `high`; PyTorch maps that value to `low`.
            *o = if v == hi_t { lo_t } else { v };
        }
    });
    out
}

fn uniform_wide(n: usize, low: f64, high: f64, state: RngState) -> Vec<f64> {
    let range = high - low;
    let mut out = vec![0.0; n];
    fill_blocks(&mut out, 2, state, |w, part| {
        for (s, o) in part.iter_mut().enumerate() {
            let v = low + uniform_f64(w[2 * s], w[2 * s + 1]) * range;
            *o = if v == high { low } else { v };
        }
    });
    out
}

fn normal_narrow<T: CpuElement>(n: usize, mean: f64, std: f64, state: RngState) -> Vec<T> {
    let mut out = vec![T::zero(); n];
    fill_blocks(&mut out, 4, state, |w, part| {
        let (a0, a1) = box_muller(uniform_open0_f32(w[0]) as f64, uniform_f32(w[1]) as f64);
        let (b0, b1) = box_muller(uniform_open0_f32(w[2]) as f64, uniform_f32(w[3]) as f64);
        for (o, z) in part.iter_mut().zip([a0, a1, b0, b1]) {
            *o = T::from_f64(mean + std * z);
        }
    });
    out
}

fn normal_wide(n: usize, mean: f64, std: f64, state: RngState) -> Vec<f64> {
    let mut out = vec![0.0; n];
    fill_blocks(&mut out, 2, state, |w, part| {
        let (z0, z1) = box_muller(uniform_open0_f64(w[0], w[1]), uniform_f64(w[2], w[3]));
        for (o, z) in part.iter_mut().zip([z0, z1]) {
            *o = mean + std * z;
        }
    });
    out
}

/// Replaces each probability `p` by 1.0 with probability `p`, else 0.0.
fn bernoulli_in_place(p: &mut [f64], state: RngState) {
    fill_blocks(p, 4, state, |w, part| {
        for (o, &x) in part.iter_mut().zip(w) {
            *o = if (uniform_f32(x) as f64) < *o { 1.0 } else { 0.0 };
        }
    });
}

fn randint(n: usize, low: i64, high: i64, state: RngState) -> Vec<i64> {
    let r = randint_range(low, high);
    let mut out = vec![0i64; n];
    if r <= 1 << 32 {
        fill_blocks(&mut out, 4, state, |w, part| {
            for (o, &x) in part.iter_mut().zip(w) {
                *o = low.wrapping_add((x as u64 % r) as i64);
            }
        });
    } else {
        fill_blocks(&mut out, 2, state, |w, part| {
            for (s, o) in part.iter_mut().enumerate() {
                *o = low.wrapping_add((join_u64(w[2 * s], w[2 * s + 1]) % r) as i64);
            }
        });
    }
    out
}

/// `0..n` sorted by one random 64-bit key each (ties by index), as i64.
pub(crate) fn randperm(n: usize, state: RngState) -> CpuStorage {
    let mut keyed: Vec<(u64, i64)> = (0..n as i64).map(|i| (0, i)).collect();
    fill_blocks(&mut keyed, RANDPERM_PER_BLOCK, state, |w, part| {
        for (s, o) in part.iter_mut().enumerate() {
            o.0 = join_u64(w[2 * s], w[2 * s + 1]);
        }
    });
    // Keys paired with their index are distinct, so an unstable sort is deterministic.
    if n >= PAR_THRESHOLD {
        super::threads::parallel(|| keyed.par_sort_unstable());
    } else {
        keyed.sort_unstable();
    }
    CpuStorage::I64(keyed.into_iter().map(|(_, i)| i).collect())
}

/// Bernoulli draws with the probabilities of `layout`, in the storage's dtype.
pub(crate) fn bernoulli(s: &CpuStorage, layout: &Layout, state: RngState) -> Result<CpuStorage> {
    let CpuStorage::F64(mut p) = s.to_dtype(layout, DType::F64)? else {
        unreachable!("converted to f64 above")
    };
    if let Some(bad) = p.iter().find(|&&x| !(0.0..=1.0).contains(&x)) {
        return Err(Error::invalid(
            "bernoulli",
            format!("expected all probabilities in [0, 1], found {bad}"),
        ));
    }
    bernoulli_in_place(&mut p, state);
    CpuStorage::F64(p).to_dtype(&Layout::contiguous([layout.numel()]), s.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_follow_the_documented_mapping() {
        let state = RngState {
            seed: 0x1234_5678_9abc_def0,
            offset: 5,
        };
        let CpuStorage::F32(v) = random(
            DType::F32,
            9,
            Distribution::Uniform { low: 0.0, high: 1.0 },
            state,
        )
        .unwrap() else {
            panic!("f32 expected")
        };
        for (i, &x) in v.iter().enumerate() {
            let w = philox4x32_10(block_counter(5 + i as u64 / 4), seed_key(state.seed));
            assert_eq!(x, (w[i % 4] >> 8) as f32 / (1u32 << 24) as f32, "element {i}");
        }
    }

    #[test]
    fn parallel_chunks_match_serial_blocks() {
        let state = RngState {
            seed: 3,
            offset: u64::MAX - 10,
        };
        let n = PAR_THRESHOLD + 13;
        let big = randint(n, -5, 1 << 40, state);
        for i in [0, 1, 2, 4 * BLOCKS_PER_TASK + 1, n - 1] {
            let w = philox4x32_10(
                block_counter(state.offset.wrapping_add(i as u64 / 2)),
                seed_key(3),
            );
            let s = i % 2;
            assert_eq!(
                big[i],
                -5 + (join_u64(w[2 * s], w[2 * s + 1]) % ((1 << 40) + 5)) as i64
            );
        }
    }
}

impl RandomOps for CpuStorage {
    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<CpuStorage> {
        let state = state.value("bernoulli")?;
        check_host_alloc("bernoulli", layout.numel(), DType::F64)?;
        self::bernoulli(self, layout, state)
    }
}
