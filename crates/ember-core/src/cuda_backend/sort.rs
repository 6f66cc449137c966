//! CUDA launchers for `kernels/sort.cu`: the positions of `sort`, `argsort` and `topk` found on
//! the device, in the CPU backend's order (`cpu/sort.rs`: the same keys, so the same positions).
//!
//! Note [Device sort]: a row of at most 2048 elements is sorted by one block, a bitonic network
//! over (key, position) pairs in shared memory (`sort_block`; a block of P / 2 threads for the
//! power of two P at or above the row, so short rows take small blocks). A longer row is cut
//! into chunks of 2048, each sorted so by its own block, and the chunks' runs are merged two
//! by two, one launch a level (`sort_merge`; ceil(log2(n / 2048)) levels: 5 for GPT-2's
//! 50,304 logits, 7 for 200,000). Each run keeps only its first k pairs, since the first k of
//! a union are among the first k of its parts: `topk` with a small k merges runs of k pairs,
//! and a full sort (k = n) is a full merge sort. Pairs are distinct (positions are), so a
//! pair's place in a merged run is its place in its own run plus a binary search in the
//! other: no two pairs land on one place, and the non-stable network and merge give the stable
//! order. Scratch for the runs (two buffers of fewer than rows * 2n pairs, 12 bytes each)
//! comes from the caching allocator and is freed once the launches are enqueued. Nothing is
//! read back and every size is known on the host, so the launches can be captured in a CUDA
//! graph. A bitonic network costs O(P log² P) and the merges O(n log n) binary-search steps a
//! level; chosen because it is short and plainly right. On an H200 over `[8, 50,304]` f32
//! (`cuda_sort_topk_kernel_time`, docs/benchmarks.md, session 49): `topk` 50 takes 62 µs of
//! kernels (the chunk sort 47, the merges 12, the gather 3), `topk` 1024 75 µs, a full sort
//! 127 µs, against ~1.6 ms of host sorting and a synchronization before. The chunk sort is
//! most of it: a radix select for `topk`, or a segmented radix sort for long rows, is the
//! faster known design when a sampler needs less.

use super::kernels::Grid;
use super::launch;
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, SortOps, SortParams};
use crate::layout::Layout;
use crate::{DType, Error, Result};

const OP: &str = "sort";
/// Elements a block sorts (`SORT_CHUNK` in `sort.cu`).
const CHUNK: usize = 2048;
/// Bytes of shared memory a pair takes (a u64 key, a u32 position).
const PAIR_BYTES: usize = 12;

/// The pairs a row of the largest level of runs holds: level 0 has `ceil(n / CHUNK)` runs of
/// `min(k, CHUNK)` slots, each merge halves the runs (rounding up) and doubles their span.
fn scratch_per_row(n: usize, k: usize) -> usize {
    let (mut runs, mut span) = (n.div_ceil(CHUNK), CHUNK);
    let mut most = runs * k.min(span);
    while runs > 1 {
        runs = runs.div_ceil(2);
        span *= 2;
        if runs > 1 {
            most = most.max(runs * k.min(span));
        }
    }
    most
}

impl SortOps for CudaStorage {
    fn sort_indices(&self, layout: &Layout, p: &SortParams) -> Result<CudaStorage> {
        p.check(self.dtype(), layout.offset(), self.len())?;
        if layout.contiguous_range().is_none() || layout.numel() != p.rows * p.n {
            return Err(Error::invalid(
                OP,
                "internal: the device sort reads contiguous rows (the op layer makes them so)",
            ));
        }
        let rt = self.runtime()?;
        let out = CudaStorage::alloc_on(rt, DType::I64, p.rows * p.k)?;
        if p.rows == 0 || p.k == 0 {
            return Ok(out);
        }
        let (n, k) = (p.n, p.k);
        if n >= u32::MAX as usize {
            return Err(Error::invalid(
                OP,
                format!("rows of {n} elements are too long for the device sort (at most 2^32 - 2); sort on the CPU"),
            ));
        }
        let chunks = n.div_ceil(CHUNK);
        let blocks = p.rows.checked_mul(chunks).filter(|&b| b <= i32::MAX as usize);
        let Some(blocks) = blocks else {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} rows of {n} elements are too many for the device sort's grid; sort fewer rows at a time",
                    p.rows
                ),
            ));
        };
        let width = n.min(CHUNK).next_power_of_two().max(64);
        let grid = Grid {
            grid: (blocks as u32, 1, 1),
            block: ((width / 2) as u32, 1, 1),
            shared_bytes: (width * PAIR_BYTES) as u32,
        };
        let x = self.dev_ptr(layout);
        let desc = i32::from(p.descending);
        let dtypes = [p.dtype];
        let result = out.dev_ptr_mut_at(0);
        // The caller's part: x holds rows * n elements of the dtype from `layout`'s offset
        // (checked above), `out` rows * k int64, and each scratch buffer the pairs of the
        // largest level (`scratch_per_row`), which bounds every level's runs.
        if chunks == 1 {
            launch::sort_block(
                rt,
                &dtypes,
                grid,
                x,
                n as i64,
                k as i64,
                1,
                desc,
                None,
                None,
                Some(result),
            )?;
            return Ok(out);
        }
        let slots = p.rows * scratch_per_row(n, k);
        let keys = [
            CudaStorage::alloc_on(rt, DType::I64, slots)?,
            CudaStorage::alloc_on(rt, DType::I64, slots)?,
        ];
        let idx = [
            CudaStorage::alloc_on(rt, DType::I32, slots)?,
            CudaStorage::alloc_on(rt, DType::I32, slots)?,
        ];
        launch::sort_block(
            rt,
            &dtypes,
            grid,
            x,
            n as i64,
            k as i64,
            chunks as i64,
            desc,
            Some(keys[0].dev_ptr_mut_at(0)),
            Some(idx[0].dev_ptr_mut_at(0)),
            None,
        )?;
        let (mut runs, mut span, mut from) = (chunks, CHUNK, 0usize);
        while runs > 1 {
            let runs_out = runs.div_ceil(2);
            let last = runs_out == 1;
            let to = 1 - from;
            let threads = p.rows * runs * k.min(span);
            launch::sort_merge(
                rt,
                &[],
                Grid::linear(rt, threads, 256),
                keys[from].dev_ptr_at(0),
                idx[from].dev_ptr_at(0),
                (!last).then(|| keys[to].dev_ptr_mut_at(0)),
                (!last).then(|| idx[to].dev_ptr_mut_at(0)),
                last.then_some(result),
                p.rows as i64,
                n as i64,
                k as i64,
                span as i64,
                runs as i64,
            )?;
            runs = runs_out;
            span *= 2;
            from = to;
        }
        // The scratch is freed after the launches are enqueued: the caching allocator reuses
        // it only for work ordered after them.
        drop((keys, idx));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_holds_every_level_of_runs() {
        for (n, k) in [
            (2049, 2049),
            (50_304, 1024),
            (50_304, 50_304),
            (200_000, 7),
            (6 * 2048, 5000),
            (5 * 2048, 5 * 2048),
        ] {
            let most = scratch_per_row(n, k);
            let (mut runs, mut span) = (n.div_ceil(CHUNK), CHUNK);
            assert!(runs * k.min(span) <= most);
            while runs > 1 {
                runs = runs.div_ceil(2);
                span *= 2;
                if runs > 1 {
                    assert!(runs * k.min(span) <= most, "n={n} k={k}");
                }
            }
            // Fewer than two rows' worth (a level's runs span less than the row and a run).
            assert!(most < 2 * n, "n={n} k={k}: {most}");
        }
        // Three chunks of a full sort: the middle level (two runs of 4096) is the largest.
        assert_eq!(scratch_per_row(3 * 2048, 3 * 2048), 2 * 4096);
    }
}
