//! CPU kernels of the reduce family: sum, prod, mean, max/min, argmax/argmin, logsumexp,
//! var/std and vector norms over a set of dims, each returning a new row-major storage of
//! the kept dims.
//!
//! Note [Reduction access plans]: a reduction over `dims` is M outputs each reducing K inputs.
//! When the layout with the kept dims first and the reduced dims last is contiguous, the input
//! is read in place as M rows of K ("rows"); when the reduced dims come first in memory (a sum
//! over the batch dim), it is read in place as K rows of M and accumulated column-wise
//! ("columns"); otherwise the input is gathered once into rows. A full reduction is one row.
//!
//! Note [Accurate sums]: floats accumulate in their own type (f32 for f16/bf16, rounded once at
//! the end), as PyTorch does, but never in one running sum: a row is summed pairwise (halves
//! split recursively down to blocks of 256, each block summed in 8 interleaved lanes), and
//! columns as a cascade (every 16 rows the running partials are carried into the next level,
//! every 16 carries into the one above, ...). The error grows with log K instead of K, and
//! the split points depend only on K and M, so results are deterministic whatever the thread
//! count. Integer and bool sums/products accumulate in i64 and wrap.

use super::{gather_strided, CpuElement, CpuStorage, PAR_THRESHOLD};
use crate::backend::op::ReduceOp;
use crate::backend::{BackendStorage, ReduceOps};
use crate::layout::Layout;
use crate::{Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;

/// Elements summed in one pairwise leaf (see Note [Accurate sums]).
const BLOCK: usize = 256;
/// Rows accumulated into one level of a column cascade before it is carried up.
const FAN: usize = 16;
/// Interleaved accumulators inside a leaf (lets the compiler vectorize).
const LANES: usize = 8;

/// Accumulator arithmetic: f32 and f64 for floats, i64 (wrapping) for integers and bools.
pub(crate) trait Acc: Copy + Send + Sync + PartialOrd + 'static {
    const ZERO: Self;
    const ONE: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
}

impl Acc for i64 {
    const ZERO: i64 = 0;
    const ONE: i64 = 1;
    #[inline]
    fn add(self, o: i64) -> i64 {
        self.wrapping_add(o)
    }
    #[inline]
    fn mul(self, o: i64) -> i64 {
        self.wrapping_mul(o)
    }
}

/// Float accumulators (f32, f64).
pub(crate) trait Float: Acc + std::ops::Sub<Output = Self> + std::ops::Div<Output = Self> {
    const INF: Self;
    const NEG_INF: Self;
    fn from_f64(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, p: Self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! float_acc {
    ($t:ident) => {
        impl Acc for $t {
            const ZERO: $t = 0.0;
            const ONE: $t = 1.0;
            #[inline]
            fn add(self, o: $t) -> $t {
                self + o
            }
            #[inline]
            fn mul(self, o: $t) -> $t {
                self * o
            }
        }
        impl Float for $t {
            const INF: $t = $t::INFINITY;
            const NEG_INF: $t = $t::NEG_INFINITY;
            #[inline]
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            #[inline]
            fn exp(self) -> $t {
                $t::exp(self)
            }
            #[inline]
            fn ln(self) -> $t {
                $t::ln(self)
            }
            #[inline]
            fn sqrt(self) -> $t {
                $t::sqrt(self)
            }
            #[inline]
            fn abs(self) -> $t {
                $t::abs(self)
            }
            #[inline]
            fn powf(self, p: $t) -> $t {
                $t::powf(self, p)
            }
            #[inline]
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
        }
    };
}
float_acc!(f32);
float_acc!(f64);

/// A float element type and the accumulator it computes in (f32 for f16, bf16 and f32).
pub(crate) trait FloatElem: CpuElement {
    type A: Float;
    fn to_acc(self) -> Self::A;
    fn from_acc(a: Self::A) -> Self;
}

macro_rules! float_elem {
    ($t:ty, $a:ty, $to:expr, $from:expr) => {
        impl FloatElem for $t {
            type A = $a;
            #[inline]
            fn to_acc(self) -> $a {
                $to(self)
            }
            #[inline]
            fn from_acc(a: $a) -> $t {
                $from(a)
            }
        }
    };
}
float_elem!(f32, f32, |x| x, |a| a);
float_elem!(f64, f64, |x| x, |a| a);
float_elem!(f16, f32, f16::to_f32, f16::from_f32);
float_elem!(bf16, f32, bf16::to_f32, bf16::from_f32);

/// The smallest and largest value of an element type: the identities of max and min.
pub(crate) trait Extremes: CpuElement {
    const LOWEST: Self;
    const HIGHEST: Self;
}

macro_rules! extremes {
    ($($t:ty: $lo:expr, $hi:expr;)*) => {$(
        impl Extremes for $t {
            const LOWEST: $t = $lo;
            const HIGHEST: $t = $hi;
        }
    )*};
}
extremes! {
    bool: false, true;
    u8: u8::MIN, u8::MAX;
    i32: i32::MIN, i32::MAX;
    i64: i64::MIN, i64::MAX;
    f16: f16::NEG_INFINITY, f16::INFINITY;
    bf16: bf16::NEG_INFINITY, bf16::INFINITY;
    f32: f32::NEG_INFINITY, f32::INFINITY;
    f64: f64::NEG_INFINITY, f64::INFINITY;
}

/// The larger of two values; NaN wins (`x != x` only for NaN), ties keep `a`.
#[inline]
pub(crate) fn max_nan<T: PartialOrd>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    if b > a || b != b {
        b
    } else {
        a
    }
}

/// The smaller of two values; NaN wins, ties keep `a`.
#[inline]
pub(crate) fn min_nan<T: PartialOrd>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    if b < a || b != b {
        b
    } else {
        a
    }
}

/// `map` of every element combined with the associative `comb` starting from its identity
/// `id`, pairwise (see Note [Accurate sums]); halves run in parallel on long slices.
pub(crate) fn fold<T, A, M, C>(xs: &[T], id: A, map: &M, comb: &C) -> A
where
    T: Copy + Sync,
    A: Copy + Send + Sync,
    M: Fn(T) -> A + Sync,
    C: Fn(A, A) -> A + Sync,
{
    if xs.len() <= BLOCK {
        let mut lanes = [id; LANES];
        let chunks = xs.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..LANES {
                lanes[j] = comb(lanes[j], map(c[j]));
            }
        }
        for (j, &x) in rest.iter().enumerate() {
            lanes[j] = comb(lanes[j], map(x));
        }
        let l = lanes;
        let (a, b) = (comb(l[0], l[1]), comb(l[2], l[3]));
        let (c, d) = (comb(l[4], l[5]), comb(l[6], l[7]));
        return comb(comb(a, b), comb(c, d));
    }
    let mid = (xs.len() / 2).next_multiple_of(LANES);
    let (lo, hi) = xs.split_at(mid);
    let (a, b) = if xs.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| rayon::join(|| fold(lo, id, map, comb), || fold(hi, id, map, comb)))
    } else {
        (fold(lo, id, map, comb), fold(hi, id, map, comb))
    };
    comb(a, b)
}

/// `f` of each row of `k` elements, in parallel when there is enough work.
pub(crate) fn map_rows<T, O, F>(rows: &[T], k: usize, f: F) -> Vec<O>
where
    T: Sync,
    O: Send,
    F: Fn(&[T]) -> O + Sync + Send,
{
    if rows.len() >= PAR_THRESHOLD && rows.len() > k {
        super::threads::parallel(|| rows.par_chunks(k).map(f).collect())
    } else {
        rows.chunks(k).map(f).collect()
    }
}

/// How a reduction reads its input (see Note [Reduction access plans]).
enum Access<'a, T: Clone> {
    /// M rows of K contiguous elements.
    Rows(Cow<'a, [T]>),
    /// K rows of M contiguous elements; each output reduces one column.
    Cols(&'a [T]),
}

/// The number of outputs M and of inputs per output K of reducing `dims` of `layout`.
pub(crate) fn reduce_sizes(layout: &Layout, dims: &[usize]) -> (usize, usize) {
    let k: usize = dims.iter().map(|&d| layout.dims()[d]).product();
    let m = if k == 0 {
        (0..layout.dims().len())
            .filter(|d| !dims.contains(d))
            .map(|d| layout.dims()[d])
            .product()
    } else {
        layout.numel() / k
    };
    (m, k)
}

/// Chooses the access plan for reducing `dims` (sorted, unique) of `layout`; needs M, K > 0.
fn plan<'a, T: Copy + Send + Sync>(
    data: &'a [T],
    layout: &Layout,
    dims: &[usize],
    cols: bool,
) -> Access<'a, T> {
    let rank = layout.dims().len();
    let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let rows_perm: Vec<usize> = kept.iter().chain(dims).copied().collect();
    let rows = layout
        .permute(&rows_perm)
        .expect("kept and reduced dims partition 0..rank");
    if let Some(r) = rows.contiguous_range() {
        return Access::Rows(Cow::Borrowed(&data[r]));
    }
    if cols {
        let cols_perm: Vec<usize> = dims.iter().chain(&kept).copied().collect();
        let cl = layout
            .permute(&cols_perm)
            .expect("kept and reduced dims partition 0..rank");
        if let Some(r) = cl.contiguous_range() {
            return Access::Cols(&data[r]);
        }
    }
    Access::Rows(Cow::Owned(gather_strided(data, &rows)))
}

/// Column-wise fold of `data` seen as `k` rows of `m`, as a cascade (see Note [Accurate sums]).
fn fold_cols<T, A, M, C>(data: &[T], k: usize, m: usize, id: A, map: &M, comb: &C) -> Vec<A>
where
    T: Copy + Sync,
    A: Copy + Send + Sync,
    M: Fn(T) -> A + Sync,
    C: Fn(A, A) -> A + Sync,
{
    // Rows r0..r1, columns c0..c1.
    let part = |r0: usize, r1: usize, c0: usize, c1: usize| -> Vec<A> {
        let w = c1 - c0;
        let mut levels: Vec<Vec<A>> = vec![vec![id; w]];
        for (i, r) in (r0..r1).enumerate() {
            let row = &data[r * m + c0..r * m + c1];
            for (a, &x) in levels[0].iter_mut().zip(row) {
                *a = comb(*a, map(x));
            }
            // Every FAN rows a level is full: carry it into the next one.
            let (mut n, mut l) = (i + 1, 0);
            while n % FAN == 0 {
                if levels.len() == l + 1 {
                    levels.push(vec![id; w]);
                }
                let (lo, hi) = levels.split_at_mut(l + 1);
                for (b, a) in hi[0].iter_mut().zip(lo[l].iter_mut()) {
                    *b = comb(*b, *a);
                    *a = id;
                }
                n /= FAN;
                l += 1;
            }
        }
        let mut acc = levels.pop().expect("at least one level");
        while let Some(level) = levels.pop() {
            for (a, b) in acc.iter_mut().zip(level) {
                *a = comb(*a, b);
            }
        }
        acc
    };
    if k * m < PAR_THRESHOLD {
        return part(0, k, 0, m);
    }
    const COLS: usize = 512;
    if m >= 2 * COLS {
        // Wide: independent column groups.
        let groups: Vec<Vec<A>> = super::threads::parallel(|| {
            (0..m.div_ceil(COLS))
                .into_par_iter()
                .map(|g| part(0, k, g * COLS, ((g + 1) * COLS).min(m)))
                .collect()
        });
        return groups.concat();
    }
    // Narrow and tall: row chunks of whole blocks, combined pairwise in a fixed order.
    let rows_per = (PAR_THRESHOLD / m).max(1).next_multiple_of(FAN * FAN);
    let parts: Vec<Vec<A>> = super::threads::parallel(|| {
        (0..k.div_ceil(rows_per))
            .into_par_iter()
            .map(|c| part(c * rows_per, ((c + 1) * rows_per).min(k), 0, m))
            .collect()
    });
    combine_pairwise(parts, comb)
}

fn combine_pairwise<A: Copy, C: Fn(A, A) -> A>(mut parts: Vec<Vec<A>>, comb: &C) -> Vec<A> {
    while parts.len() > 1 {
        let mut next = Vec::with_capacity(parts.len().div_ceil(2));
        let mut it = parts.into_iter();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next() {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = comb(*x, y);
                }
            }
            next.push(a);
        }
        parts = next;
    }
    parts.pop().unwrap_or_default()
}

/// A fold reduction (`map`, associative `comb` with identity `id`, then `finish`) of `dims`.
fn fold_reduce<T, A, O, M, C, F>(
    data: &[T],
    l: &Layout,
    dims: &[usize],
    id: A,
    map: M,
    comb: C,
    finish: F,
) -> Vec<O>
where
    T: Copy + Send + Sync,
    A: Copy + Send + Sync,
    O: Copy + Send,
    M: Fn(T) -> A + Sync + Send,
    C: Fn(A, A) -> A + Sync + Send,
    F: Fn(A) -> O + Sync + Send,
{
    let (m, k) = reduce_sizes(l, dims);
    if m == 0 || k == 0 {
        return vec![finish(id); m];
    }
    match plan(data, l, dims, true) {
        Access::Rows(rows) => map_rows(&rows, k, |r| finish(fold(r, id, &map, &comb))),
        Access::Cols(cols) => fold_cols(cols, k, m, id, &map, &comb)
            .into_iter()
            .map(finish)
            .collect(),
    }
}

/// `f` of each row of reduced elements (gathered into rows when needed).
fn rows_reduce<T, O, F>(data: &[T], l: &Layout, dims: &[usize], f: F) -> Vec<O>
where
    T: Copy + Send + Sync,
    O: Clone + Send,
    F: Fn(&[T]) -> O + Sync + Send,
{
    let (m, k) = reduce_sizes(l, dims);
    if m == 0 {
        return Vec::new(); // no rows: `f` (argmax of nothing) must not run
    }
    if k == 0 {
        return vec![f(&[]); m];
    }
    match plan(data, l, dims, false) {
        Access::Rows(rows) => map_rows(&rows, k, f),
        Access::Cols(_) => unreachable!("columns were not allowed"),
    }
}

/// Sum, prod, mean, logsumexp, var, std and norms of a float storage.
fn float_reduce<T: FloatElem>(v: &[T], l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Vec<T>> {
    let to = |x: T| x.to_acc();
    let add = <T::A as Acc>::add;
    let zero = <T::A as Acc>::ZERO;
    Ok(match op {
        ReduceOp::Sum => fold_reduce(v, l, dims, zero, to, add, T::from_acc),
        ReduceOp::Prod => fold_reduce(v, l, dims, T::A::ONE, to, T::A::mul, T::from_acc),
        ReduceOp::Mean => {
            let k = T::A::from_f64(reduce_sizes(l, dims).1 as f64);
            fold_reduce(v, l, dims, zero, to, add, move |s| T::from_acc(s / k))
        }
        ReduceOp::LogSumExp => rows_reduce(v, l, dims, |r| T::from_acc(logsumexp_row(r))),
        ReduceOp::Var { correction } => rows_reduce(v, l, dims, |r| T::from_acc(var_row(r, correction))),
        ReduceOp::Std { correction } => {
            rows_reduce(v, l, dims, |r| T::from_acc(var_row(r, correction).sqrt()))
        }
        ReduceOp::Norm { p } => norm(v, l, dims, p),
        _ => return Err(Error::invalid(op.name(), "not a float reduction")),
    })
}

/// `log Σ exp(x)` of one row, shifted by its max so that no exp overflows.
fn logsumexp_row<T: FloatElem>(r: &[T]) -> T::A {
    let m = fold(r, T::A::NEG_INF, &|x: T| x.to_acc(), &max_nan);
    if m.is_nan() || m == T::A::INF || m == T::A::NEG_INF {
        // NaN propagates; +inf is the answer; all -inf (or empty) gives -inf.
        return m;
    }
    let s = fold(r, T::A::ZERO, &|x: T| (x.to_acc() - m).exp(), &T::A::add);
    m.add(s.ln())
}

/// Two-pass variance of one row with `correction` (divides by max(0, K - correction)).
fn var_row<T: FloatElem>(r: &[T], correction: f64) -> T::A {
    let n = T::A::from_f64(r.len() as f64);
    let mean = fold(r, T::A::ZERO, &|x: T| x.to_acc(), &T::A::add) / n;
    let ss = fold(
        r,
        T::A::ZERO,
        &|x: T| {
            let d = x.to_acc() - mean;
            d.mul(d)
        },
        &T::A::add,
    );
    ss / T::A::from_f64((r.len() as f64 - correction).max(0.0))
}

/// `linalg.vector_norm` of order `p` (0 counts nonzeros; ±inf are the max/min of |x|).
fn norm<T: FloatElem>(v: &[T], l: &Layout, dims: &[usize], p: f64) -> Vec<T> {
    let (zero, add) = (T::A::ZERO, T::A::add);
    let abs = |x: T| x.to_acc().abs();
    if p == 2.0 {
        let sq = |x: T| {
            let a = x.to_acc();
            a.mul(a)
        };
        fold_reduce(v, l, dims, zero, sq, add, |s| T::from_acc(s.sqrt()))
    } else if p == 1.0 {
        fold_reduce(v, l, dims, zero, abs, add, T::from_acc)
    } else if p == f64::INFINITY {
        fold_reduce(v, l, dims, zero, abs, max_nan, T::from_acc)
    } else if p == f64::NEG_INFINITY {
        fold_reduce(v, l, dims, T::A::INF, abs, min_nan, T::from_acc)
    } else if p == 0.0 {
        let nonzero = |x: T| if x.to_acc() != zero { T::A::ONE } else { zero };
        fold_reduce(v, l, dims, zero, nonzero, add, T::from_acc)
    } else {
        let (pa, inv) = (T::A::from_f64(p), T::A::from_f64(1.0 / p));
        let powp = move |x: T| x.to_acc().abs().powf(pa);
        fold_reduce(v, l, dims, zero, powp, add, move |s| T::from_acc(s.powf(inv)))
    }
}

/// Index (within the row) and value of the first max (`MAX`) or min; a NaN wins over numbers.
fn arg_row<T: Copy + PartialOrd + Send + Sync, const MAX: bool>(r: &[T]) -> (T, usize) {
    #[allow(clippy::eq_op)]
    let better = |b: T, a: T| (if MAX { b > a } else { b < a }) || (b != b && a == a);
    if r.len() >= PAR_THRESHOLD {
        let mid = r.len() / 2;
        let (a, b) = super::threads::parallel(|| {
            rayon::join(|| arg_row::<T, MAX>(&r[..mid]), || arg_row::<T, MAX>(&r[mid..]))
        });
        return if better(b.0, a.0) { (b.0, b.1 + mid) } else { a };
    }
    let mut best = (r[0], 0);
    for (i, &x) in r.iter().enumerate().skip(1) {
        if better(x, best.0) {
            best = (x, i);
        }
    }
    best
}

/// Values and i64 indices of the max or min over `dims` (indices into the flattened dims).
fn arg_reduce<T: Copy + PartialOrd + Send + Sync>(
    v: &[T],
    l: &Layout,
    dims: &[usize],
    max: bool,
) -> (Vec<T>, Vec<i64>) {
    let f = if max {
        arg_row::<T, true>
    } else {
        arg_row::<T, false>
    };
    let pairs = rows_reduce(v, l, dims, |r| {
        let (x, i) = f(r);
        (x, i as i64)
    });
    pairs.into_iter().unzip()
}

/// Max or min of any dtype (NaN propagates).
fn extreme<T: Extremes + Send + Sync>(v: &[T], l: &Layout, dims: &[usize], max: bool) -> Vec<T> {
    if max {
        fold_reduce(v, l, dims, T::LOWEST, |x| x, max_nan, |a| a)
    } else {
        fold_reduce(v, l, dims, T::HIGHEST, |x| x, min_nan, |a| a)
    }
}

/// Sum or product of an integer or bool storage, in i64.
fn int_reduce<T: CpuElement>(v: &[T], l: &Layout, dims: &[usize], prod: bool) -> Vec<i64> {
    let to = |x: T| x.to_i64();
    if prod {
        fold_reduce(v, l, dims, 1i64, to, i64::mul, |a| a)
    } else {
        fold_reduce(v, l, dims, 0i64, to, i64::add, |a| a)
    }
}

/// The error for max/min/argmax over zero elements, which have no identity.
pub(crate) fn empty_reduction(op: &'static str) -> Error {
    Error::invalid(
        op,
        "expected the reduced dims to have a non-zero size: the operation has no identity",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_sum_is_accurate_for_long_f32_rows() {
        // 1 + 2^-24 repeated: a running f32 sum stalls at 2^24; pairwise stays exact-ish.
        let n = 1 << 25;
        let v = vec![1.0f32; n];
        let s = fold(&v, 0.0f32, &|x| x, &f32::add);
        assert_eq!(s, n as f32);
    }

    #[test]
    fn column_and_row_plans_agree() {
        let (k, m) = (1000, 70);
        let data: Vec<f64> = (0..k * m).map(|i| ((i * 7919) % 1013) as f64 - 500.0).collect();
        let l = Layout::contiguous([k, m]);
        let cols = fold_reduce(&data, &l, &[0], 0.0, |x| x, f64::add, |a| a);
        let t = l.transpose(0, 1);
        let gathered = gather_strided(&data, &t);
        let rows: Vec<f64> = gathered.chunks(k).map(|r| r.iter().sum()).collect();
        assert_eq!(cols, rows);
    }

    #[test]
    fn argmax_takes_first_of_ties_and_nan() {
        assert_eq!(arg_row::<f32, true>(&[1.0, 3.0, 3.0]), (3.0, 1));
        let (v, i) = arg_row::<f32, true>(&[1.0, f32::NAN, 5.0, f32::NAN]);
        assert!(v.is_nan());
        assert_eq!(i, 1);
        assert_eq!(arg_row::<i32, false>(&[4, 2, 2, 9]), (2, 1));
    }
}

impl ReduceOps for CpuStorage {
    /// `op` over `dims` (sorted, unique) of `layout`; the result is row-major over the kept
    /// dims. Sum/prod of integers and bools give i64, argmax/argmin give i64 indices.
    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CpuStorage> {
        use CpuStorage::*;
        let (_, k) = reduce_sizes(layout, dims);
        if k == 0
            && matches!(
                op,
                ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin
            )
        {
            return Err(empty_reduction(op.name()));
        }
        Ok(match op {
            ReduceOp::Max | ReduceOp::Min => {
                let max = op == ReduceOp::Max;
                crate::with_cpu_storage!(self, v => CpuElement::wrap(extreme(v, layout, dims, max)))
            }
            ReduceOp::ArgMax | ReduceOp::ArgMin => {
                let max = op == ReduceOp::ArgMax;
                I64(crate::with_cpu_storage!(self, v => arg_reduce(v, layout, dims, max).1))
            }
            _ => match self {
                F32(v) => F32(float_reduce(v, layout, dims, op)?),
                F64(v) => F64(float_reduce(v, layout, dims, op)?),
                F16(v) => F16(float_reduce(v, layout, dims, op)?),
                BF16(v) => BF16(float_reduce(v, layout, dims, op)?),
                _ if matches!(op, ReduceOp::Sum | ReduceOp::Prod) => {
                    let prod = op == ReduceOp::Prod;
                    I64(crate::with_cpu_storage!(self, v => int_reduce(v, layout, dims, prod)))
                }
                _ => return Err(Error::dtype(op.name(), self.dtype())),
            },
        })
    }

    /// Max or min over `dims` with the index of its first occurrence (`torch.max(x, dim)`).
    fn reduce_with_indices(
        &self,
        layout: &Layout,
        op: ReduceOp,
        dims: &[usize],
    ) -> Result<(CpuStorage, CpuStorage)> {
        let max = match op {
            ReduceOp::Max => true,
            ReduceOp::Min => false,
            _ => return Err(Error::invalid(op.name(), "only max and min return indices")),
        };
        if reduce_sizes(layout, dims).1 == 0 {
            return Err(empty_reduction(op.name()));
        }
        Ok(crate::with_cpu_storage!(self, v => {
            let (vals, idx) = arg_reduce(v, layout, dims, max);
            (CpuElement::wrap(vals), CpuStorage::I64(idx))
        }))
    }
}
