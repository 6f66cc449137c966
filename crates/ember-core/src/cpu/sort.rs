//! The CPU kernel of `sort`, `argsort` and `topk` (`SortOps::sort_indices`): the first k
//! positions of each row in PyTorch's order, found with the keys the CUDA kernels use
//! (`kernels/sort.cu`), so both backends give the same positions by construction.
//!
//! Every element becomes a `u64` whose unsigned order is the order asked for (`SortKey`:
//! floats by their bits with the sign folded, -0.0 as 0.0, every NaN above +inf; integers
//! offset to unsigned; descending is the complement), and each row's `(key, position)` pairs
//! are ordered as pairs: positions are distinct, so the order is total and equal elements keep
//! their positions (stable) with an unstable sort. For `k < n` the first k pairs are selected
//! first (`select_nth_unstable`, linear) and only they are sorted. Elements compare in their
//! own dtype: int64 beyond 2^53 keep their order (the host sort before this one compared in
//! f64). Rows run in parallel above `PAR_THRESHOLD` elements.

use super::{gather_strided, CpuStorage, PAR_THRESHOLD};
use crate::backend::host::CpuElement;
use crate::backend::{BackendStorage, SortOps, SortParams};
use crate::layout::Layout;
use crate::{DType, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;

/// An element's ascending sort key (`sort_key` in `kernels/sort.cu`, bit for bit).
pub(crate) trait SortKey: Copy + Send + Sync {
    fn sort_key(self) -> u64;
}

/// The key of an IEEE float of `bits` bits whose magnitude bits above `inf` are NaN.
#[inline]
fn float_key(bits: u64, width: u32, inf: u64) -> u64 {
    let sign = 1u64 << (width - 1);
    let all = if width == 64 {
        u64::MAX
    } else {
        (1u64 << width) - 1
    };
    let magnitude = bits & (sign - 1);
    if magnitude > inf {
        return all; // NaN, whatever its sign: above every number
    }
    let bits = if magnitude == 0 { 0 } else { bits }; // -0.0 as 0.0
    if bits & sign != 0 {
        !bits & all
    } else {
        bits | sign
    }
}

impl SortKey for f32 {
    fn sort_key(self) -> u64 {
        float_key(u64::from(self.to_bits()), 32, 0x7f80_0000)
    }
}
impl SortKey for f64 {
    fn sort_key(self) -> u64 {
        float_key(self.to_bits(), 64, 0x7ff0_0000_0000_0000)
    }
}
impl SortKey for f16 {
    fn sort_key(self) -> u64 {
        float_key(u64::from(self.to_bits()), 16, 0x7c00)
    }
}
impl SortKey for bf16 {
    fn sort_key(self) -> u64 {
        float_key(u64::from(self.to_bits()), 16, 0x7f80)
    }
}
impl SortKey for i64 {
    fn sort_key(self) -> u64 {
        (self as u64) ^ (1 << 63)
    }
}
impl SortKey for i32 {
    fn sort_key(self) -> u64 {
        u64::from((self as u32) ^ (1 << 31))
    }
}
impl SortKey for u8 {
    fn sort_key(self) -> u64 {
        u64::from(self)
    }
}
impl SortKey for bool {
    fn sort_key(self) -> u64 {
        u64::from(self)
    }
}

/// Writes the first `k = out.len()` positions of `row` in the order of `flip` (0 ascending,
/// all ones descending), using `pairs` as scratch.
fn order_row<T: SortKey>(row: &[T], flip: u64, out: &mut [i64], pairs: &mut Vec<(u64, usize)>) {
    let k = out.len();
    pairs.clear();
    pairs.extend(row.iter().enumerate().map(|(i, x)| (x.sort_key() ^ flip, i)));
    if k < pairs.len() {
        if k > 0 {
            pairs.select_nth_unstable(k - 1);
        }
        pairs.truncate(k);
    }
    pairs.sort_unstable();
    for (o, &(_, i)) in out.iter_mut().zip(pairs.iter()) {
        *o = i as i64;
    }
}

fn order<T: SortKey + CpuElement>(data: &[T], layout: &Layout, p: &SortParams) -> Result<CpuStorage> {
    let mut out = crate::memory::try_filled("sort", p.rows * p.k, DType::I64, 0i64)?;
    if p.rows == 0 || p.k == 0 {
        return Ok(CpuStorage::I64(out));
    }
    let x: Cow<'_, [T]> = match layout.contiguous_range() {
        Some(r) => Cow::Borrowed(&data[r]),
        None => Cow::Owned(gather_strided(data, layout)),
    };
    let flip = if p.descending { u64::MAX } else { 0 };
    let n = p.n;
    if p.rows > 1 && p.rows * n >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            out.par_chunks_mut(p.k)
                .zip(x.par_chunks(n))
                .for_each_init(Vec::new, |pairs, (o, row)| order_row(row, flip, o, pairs))
        });
    } else {
        let mut pairs = Vec::new();
        for (o, row) in out.chunks_mut(p.k).zip(x.chunks(n)) {
            order_row(row, flip, o, &mut pairs);
        }
    }
    Ok(CpuStorage::I64(out))
}

impl SortOps for CpuStorage {
    fn sort_indices(&self, layout: &Layout, p: &SortParams) -> Result<CpuStorage> {
        p.check(self.dtype(), layout.offset(), self.len())?;
        if layout.numel() != p.rows * p.n {
            return Err(crate::Error::invalid(
                "sort",
                format!(
                    "internal: a layout of {} elements for {} rows of {}",
                    layout.numel(),
                    p.rows,
                    p.n
                ),
            ));
        }
        match self {
            CpuStorage::F32(v) => order(v, layout, p),
            CpuStorage::F64(v) => order(v, layout, p),
            CpuStorage::F16(v) => order(v, layout, p),
            CpuStorage::BF16(v) => order(v, layout, p),
            CpuStorage::I64(v) => order(v, layout, p),
            CpuStorage::I32(v) => order(v, layout, p),
            CpuStorage::U8(v) => order(v, layout, p),
            CpuStorage::Bool(v) => order(v, layout, p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: a stable sort of the positions comparing the elements as f64 (exact for
    /// every value these tests use), NaN above every number.
    fn reference(row: &[f64], k: usize, descending: bool) -> Vec<i64> {
        let asc = |a: f64, b: f64| match (a.is_nan(), b.is_nan()) {
            (false, false) => a.partial_cmp(&b).unwrap(),
            (x, y) => x.cmp(&y),
        };
        let mut perm: Vec<usize> = (0..row.len()).collect();
        if descending {
            perm.sort_by(|&a, &b| asc(row[b], row[a]));
        } else {
            perm.sort_by(|&a, &b| asc(row[a], row[b]));
        }
        perm[..k].iter().map(|&i| i as i64).collect()
    }

    fn run(s: &CpuStorage, rows: usize, n: usize, k: usize, descending: bool) -> Vec<i64> {
        let p = SortParams {
            rows,
            n,
            k,
            dtype: s.dtype(),
            descending,
        };
        let out = s.sort_indices(&Layout::contiguous([rows, n]), &p).unwrap();
        match out {
            CpuStorage::I64(v) => v,
            other => panic!("int64 positions expected, got {:?}", other.dtype()),
        }
    }

    /// Every k and both orders of `values` (rows of `n`) against the reference.
    fn check_all<T: CpuElement>(values: &[f64], n: usize) {
        let rows = values.len() / n;
        let s = T::wrap(values.iter().map(|&v| T::from_f64(v)).collect());
        let exact: Vec<f64> = values.iter().map(|&v| T::from_f64(v).to_f64()).collect();
        for descending in [false, true] {
            for k in 0..=n {
                let got = run(&s, rows, n, k, descending);
                let want: Vec<i64> = exact
                    .chunks(n)
                    .flat_map(|r| reference(r, k, descending))
                    .collect();
                assert_eq!(got, want, "{:?} k={k} descending={descending}", T::DTYPE);
            }
        }
    }

    #[test]
    fn keys_order_as_the_values_with_nan_above_and_signed_zeros_equal() {
        let nan = f32::NAN;
        let ordered = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-40,
            0.0,
            1e-40,
            2.0,
            f32::INFINITY,
            nan,
        ];
        for w in ordered.windows(2) {
            assert!(w[0].sort_key() < w[1].sort_key(), "{} < {}", w[0], w[1]);
        }
        assert_eq!((-0.0f32).sort_key(), 0.0f32.sort_key());
        assert_eq!((-nan).sort_key(), nan.sort_key());
        assert_eq!((-0.0f64).sort_key(), 0.0f64.sort_key());
        assert!(f64::NAN.sort_key() > f64::INFINITY.sort_key());
        assert!(f64::MAX.sort_key() < f64::INFINITY.sort_key());
        for h in [f16::NAN, -f16::NAN] {
            assert!(h.sort_key() > f16::INFINITY.sort_key());
        }
        assert!(bf16::NAN.sort_key() > bf16::INFINITY.sort_key());
        assert!(bf16::from_f32(-1.0).sort_key() < bf16::from_f32(-0.5).sort_key());
        assert_eq!(bf16::from_f32(-0.0).sort_key(), bf16::from_f32(0.0).sort_key());
        assert!(i64::MIN.sort_key() < (-1i64).sort_key());
        assert!((-1i64).sort_key() < 0i64.sort_key());
        assert!((i64::MAX - 1).sort_key() < i64::MAX.sort_key());
        assert!(i32::MIN.sort_key() < i32::MAX.sort_key());
        assert!(false.sort_key() < true.sort_key());
    }

    #[test]
    fn ties_nans_and_every_k_match_a_stable_reference_sort() {
        let nan = f64::NAN;
        let values = [
            3.0, nan, 1.0, 3.0, -2.0, 0.5, -0.0, 0.0, // row 0: ties, NaN, signed zeros
            nan, 9.0, nan, -1.0, 9.0, -1.0, 0.0, -0.0, // row 1: two NaNs
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, // row 2: all equal
        ];
        check_all::<f32>(&values, 8);
        check_all::<f64>(&values, 8);
        check_all::<f16>(&values, 8);
        check_all::<bf16>(&values, 8);
    }

    #[test]
    fn integer_rows_order_exactly_past_two_to_the_53() {
        let ints = [5.0, -7.0, 5.0, 0.0, 255.0, 1.0, 5.0, -7.0, 0.0, 3.0];
        check_all::<i64>(&ints, 5);
        check_all::<i32>(&ints, 5);
        check_all::<u8>(&[5.0, 7.0, 5.0, 0.0, 255.0, 1.0, 5.0, 7.0, 0.0, 3.0], 5);
        check_all::<bool>(&[1.0, 0.0, 1.0, 0.0, 0.0, 1.0], 3);
        // 2^53 + 1 and 2^53 are one f64 but two int64: they do not tie.
        let big = CpuStorage::I64(vec![(1 << 53) + 1, 1 << 53, i64::MAX, i64::MIN]);
        assert_eq!(run(&big, 1, 4, 4, false), [3, 1, 0, 2]);
        assert_eq!(run(&big, 1, 4, 2, true), [2, 0]);
    }

    #[test]
    fn empty_rows_and_strided_layouts() {
        let s = CpuStorage::F32(vec![]);
        assert!(run(&s, 0, 5, 3, false).is_empty());
        assert!(run(&s, 4, 0, 0, true).is_empty());
        // A transposed [3, 2] view of a row-major [2, 3]: rows are the columns.
        let s = CpuStorage::F32(vec![3.0, 1.0, 2.0, 0.0, 5.0, 2.0]);
        let layout = Layout::contiguous([2, 3]).transpose(0, 1);
        let p = SortParams {
            rows: 3,
            n: 2,
            k: 2,
            dtype: DType::F32,
            descending: false,
        };
        let CpuStorage::I64(v) = s.sort_indices(&layout, &p).unwrap() else {
            panic!("int64 expected")
        };
        assert_eq!(v, [1, 0, 0, 1, 0, 1]);
        // k > n, a dtype that is not the storage's: typed errors.
        assert!(s.sort_indices(&layout, &SortParams { k: 3, ..p }).is_err());
        assert!(s
            .sort_indices(
                &layout,
                &SortParams {
                    dtype: DType::F64,
                    ..p
                }
            )
            .is_err());
    }

    #[test]
    fn long_rows_in_parallel_match_the_reference() {
        // 3 rows of 20,000 (past PAR_THRESHOLD): many ties, NaNs, both orders, small and full k.
        let n = 20_000;
        let values: Vec<f64> = (0..3 * n)
            .map(|i| {
                if i % 997 == 0 {
                    f64::NAN
                } else {
                    ((i * 7919) % 1000) as f64 - 500.0
                }
            })
            .collect();
        let s = CpuStorage::F32(values.iter().map(|&v| v as f32).collect());
        for descending in [false, true] {
            for k in [1, 50, 1024, n] {
                let got = run(&s, 3, n, k, descending);
                let want: Vec<i64> = values
                    .chunks(n)
                    .flat_map(|r| reference(r, k, descending))
                    .collect();
                assert_eq!(got, want, "k={k} descending={descending}");
            }
        }
    }
}
