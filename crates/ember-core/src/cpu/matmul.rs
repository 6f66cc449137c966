//! CPU kernels of the matmul family: one batched GEMM over layouts `[B.., m, k]` × `[B.., k, n]`
//! whose batch dims are already broadcast (stride 0 allowed) and whose matrix dims may have any
//! strides, so transposed views are read in place.
//!
//! f32, f64 and f16 go through the `gemm` crate (the only `unsafe` of this module is its call);
//! bf16 converts to f32, multiplies, and rounds once; integers use a plain wrapping loop; bool is
//! not supported (as in PyTorch on the CPU). A product with a bias vector (`matmul_bias`, for
//! `linear`) adds the bias before f16/bf16 round, so the sum rounds once as PyTorch's `addmm`.
//!
//! Parallelism: one large product lets `gemm` split it over rayon's pool; many small products
//! in a batch run one per rayon task with a single-threaded `gemm`; tiny work stays on the
//! calling thread.

use super::{CpuElement, CpuStorage, PAR_THRESHOLD};
use crate::backend::{BackendStorage, MatmulOps};
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::{DType, Error, Result, Shape};
use gemm::Parallelism;
use half::{bf16, f16};
use rayon::prelude::*;

/// Multiply-adds (m·n·k) above which one product is worth `gemm`'s own threading.
const GEMM_PAR_FLOPS: usize = 1 << 18;

/// Sizes and strides of one batched product, read from the two layouts.
struct Problem {
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    /// Storage offset of each batch's lhs and rhs matrix.
    a_offsets: Vec<usize>,
    b_offsets: Vec<usize>,
    /// (row stride, column stride) of lhs and rhs, in elements.
    a_strides: (usize, usize),
    b_strides: (usize, usize),
}

impl Problem {
    fn new(al: &Layout, bl: &Layout) -> Problem {
        let r = al.shape().rank();
        assert!(
            r >= 2 && bl.shape().rank() == r,
            "matmul layouts must share rank >= 2"
        );
        let (m, k, n) = (al.dims()[r - 2], al.dims()[r - 1], bl.dims()[r - 1]);
        assert_eq!(bl.dims()[r - 2], k, "inner dims checked by the caller");
        let batch_offsets = |l: &Layout| -> Vec<usize> {
            let shape = Shape::from(&l.dims()[..r - 2]);
            Layout::new(shape, l.strides()[..r - 2].to_vec(), l.offset())
                .offsets()
                .collect()
        };
        let a_offsets = batch_offsets(al);
        let b_offsets = batch_offsets(bl);
        assert_eq!(
            a_offsets.len(),
            b_offsets.len(),
            "batch dims broadcast by the caller"
        );
        Problem {
            batch: a_offsets.len(),
            m,
            k,
            n,
            a_offsets,
            b_offsets,
            a_strides: (al.strides()[r - 2], al.strides()[r - 1]),
            b_strides: (bl.strides()[r - 2], bl.strides()[r - 1]),
        }
    }

    fn out_len(&self) -> usize {
        self.batch * self.m * self.n
    }
}

/// Element types the `gemm` crate multiplies (it panics on any other).
trait GemmElement: CpuElement {}
impl GemmElement for f32 {}
impl GemmElement for f64 {}
impl GemmElement for f16 {}

/// `dst = a[a_off..] @ b[b_off..]` for one matrix of `p`, `dst` row-major `m × n`.
fn gemm_one<T: GemmElement>(
    p: &Problem,
    dst: &mut [T],
    a: &[T],
    a_off: usize,
    b: &[T],
    b_off: usize,
    par: Parallelism,
) {
    let (m, k, n) = (p.m, p.k, p.n);
    assert!(m > 0 && k > 0 && n > 0 && dst.len() == m * n);
    let (ars, acs) = p.a_strides;
    let (brs, bcs) = p.b_strides;
    // The last element each operand's matrix reaches must lie inside its slice.
    assert!(
        a_off + (m - 1) * ars + (k - 1) * acs < a.len(),
        "lhs matrix exceeds its storage"
    );
    assert!(
        b_off + (k - 1) * brs + (n - 1) * bcs < b.len(),
        "rhs matrix exceeds its storage"
    );
    // SAFETY: `gemm` reads lhs at `a_off + i*ars + p*acs` for i < m, p < k, and rhs at
    // `b_off + p*brs + j*bcs` for p < k, j < n; the asserts above bound the largest of these by
    // the slices' lengths, so every read is in bounds (and `a_off`, `b_off` themselves are, as
    // the sums are). It writes `dst[i*n + j]` for i < m, j < n, exactly `dst`'s `m*n` elements,
    // and `dst` is a `&mut` borrow distinct from the shared borrows `a` and `b`, so the output
    // aliases no input. `read_dst == false` means `dst`'s old contents are never read.
    // T is f32, f64 or f16 (`GemmElement`), the types `gemm` accepts.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr().add(a_off),
            acs as isize,
            ars as isize,
            b.as_ptr().add(b_off),
            bcs as isize,
            brs as isize,
            T::zero(),
            T::one(),
            false,
            false,
            false,
            par,
        );
    }
}

/// The whole batched product through `gemm`, parallel across or within products by size.
fn gemm_batched<T: GemmElement>(a: &[T], al: &Layout, b: &[T], bl: &Layout) -> Vec<T> {
    let p = Problem::new(al, bl);
    let mut out = vec![T::zero(); p.out_len()];
    if out.is_empty() || p.k == 0 {
        return out; // an empty sum is 0
    }
    let flops = p.m * p.n * p.k;
    let mn = p.m * p.n;
    if p.batch == 1 || flops >= GEMM_PAR_FLOPS || flops * p.batch < PAR_THRESHOLD {
        let par = if flops >= GEMM_PAR_FLOPS {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        let run = |out: &mut [T]| {
            for (i, dst) in out.chunks_mut(mn).enumerate() {
                gemm_one(&p, dst, a, p.a_offsets[i], b, p.b_offsets[i], par);
            }
        };
        if flops >= GEMM_PAR_FLOPS {
            super::threads::parallel(|| run(&mut out)); // `gemm` splits over the pool it runs on
        } else {
            run(&mut out);
        }
    } else {
        super::threads::parallel(|| {
            out.par_chunks_mut(mn).enumerate().for_each(|(i, dst)| {
                gemm_one(&p, dst, a, p.a_offsets[i], b, p.b_offsets[i], Parallelism::None);
            })
        });
    }
    out
}

/// bf16 through f32: the referenced elements widen once, the product rounds once.
fn bf16_matmul(a: &[bf16], al: &Layout, b: &[bf16], bl: &Layout) -> Vec<bf16> {
    // Widen the whole storage when the view covers most of it (keeps broadcast strides, no
    // materialized batch); otherwise gather the view into a row-major copy.
    fn widen(x: &[bf16], l: &Layout) -> (Vec<f32>, Layout) {
        if x.len() <= 2 * l.numel().max(1) {
            (x.iter().map(|v| v.to_f32()).collect(), l.clone())
        } else {
            (
                super::map_strided(x, l, bf16::to_f32),
                Layout::contiguous(l.shape().clone()),
            )
        }
    }
    let (a32, al32) = widen(a, al);
    let (b32, bl32) = widen(b, bl);
    let out = gemm_batched(&a32, &al32, &b32, &bl32);
    if out.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| out.par_iter().map(|&v| bf16::from_f32(v)).collect())
    } else {
        out.iter().map(|&v| bf16::from_f32(v)).collect()
    }
}

/// `out[r, j] += bias[j]` for every row `r` of a row-major output with `bias.len()` columns.
fn add_bias<T: Copy + std::ops::Add<Output = T> + Send + Sync>(out: &mut [T], bias: &[T]) {
    if bias.is_empty() {
        return;
    }
    let row = |dst: &mut [T]| dst.iter_mut().zip(bias).for_each(|(o, &c)| *o = *o + c);
    if out.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| out.par_chunks_mut(bias.len()).for_each(row));
    } else {
        out.chunks_mut(bias.len()).for_each(row);
    }
}

/// f16 and bf16 with a bias, through f32: the referenced elements widen once, the bias joins
/// the f32 product, and the sum rounds once (as PyTorch's CPU `addmm`, which accumulates in
/// f32 and adds the bias before storing).
fn half_matmul_bias<T: Copy + Send + Sync>(
    (a, al): (&[T], &Layout),
    (b, bl): (&[T], &Layout),
    (bias, bias_l): (&[T], &Layout),
    widen: fn(T) -> f32,
    narrow: fn(f32) -> T,
) -> Vec<T> {
    // As `bf16_matmul`: widen the whole storage when the view covers most of it, otherwise
    // gather the view into a row-major copy.
    let widened = |x: &[T], l: &Layout| {
        if x.len() <= 2 * l.numel().max(1) {
            (x.iter().map(|&v| widen(v)).collect::<Vec<f32>>(), l.clone())
        } else {
            (
                super::map_strided(x, l, widen),
                Layout::contiguous(l.shape().clone()),
            )
        }
    };
    let (a32, al32) = widened(a, al);
    let (b32, bl32) = widened(b, bl);
    let mut out = gemm_batched(&a32, &al32, &b32, &bl32);
    add_bias(&mut out, &super::map_strided(bias, bias_l, widen));
    if out.len() >= PAR_THRESHOLD {
        super::threads::parallel(|| out.par_iter().map(|&v| narrow(v)).collect())
    } else {
        out.iter().map(|&v| narrow(v)).collect()
    }
}

/// Integer element types: products and sums wrap on overflow, as PyTorch's do.
trait IntElement: CpuElement {
    fn mul_add(self, x: Self, y: Self) -> Self;
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl IntElement for $t {
            #[inline]
            fn mul_add(self, x: $t, y: $t) -> $t {
                self.wrapping_add(x.wrapping_mul(y))
            }
        }
    )*};
}
int_element!(i64, i32, u8);

/// The batched product with a plain loop (integers), parallel over output rows when large.
fn int_matmul<T: IntElement>(a: &[T], al: &Layout, b: &[T], bl: &Layout) -> Vec<T> {
    let p = Problem::new(al, bl);
    let mut out = vec![T::zero(); p.out_len()];
    if out.is_empty() {
        return out;
    }
    let (ars, acs) = p.a_strides;
    let (brs, bcs) = p.b_strides;
    let row = |r: usize, dst: &mut [T]| {
        let (bi, i) = (r / p.m, r % p.m);
        let a0 = p.a_offsets[bi] + i * ars;
        let b0 = p.b_offsets[bi];
        for (j, o) in dst.iter_mut().enumerate() {
            let mut acc = T::zero();
            for q in 0..p.k {
                acc = acc.mul_add(a[a0 + q * acs], b[b0 + q * brs + j * bcs]);
            }
            *o = acc;
        }
    };
    if p.batch * p.m * p.n * p.k >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            out.par_chunks_mut(p.n)
                .enumerate()
                .for_each(|(r, dst)| row(r, dst))
        });
    } else {
        out.chunks_mut(p.n).enumerate().for_each(|(r, dst)| row(r, dst));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive reference over the same layouts.
    fn naive(a: &[f64], al: &Layout, b: &[f64], bl: &Layout) -> Vec<f64> {
        let p = Problem::new(al, bl);
        let mut out = vec![0.0; p.out_len()];
        for bi in 0..p.batch {
            for i in 0..p.m {
                for j in 0..p.n {
                    out[(bi * p.m + i) * p.n + j] = (0..p.k)
                        .map(|q| {
                            a[p.a_offsets[bi] + i * p.a_strides.0 + q * p.a_strides.1]
                                * b[p.b_offsets[bi] + q * p.b_strides.0 + j * p.b_strides.1]
                        })
                        .sum();
                }
            }
        }
        out
    }

    #[test]
    fn strided_and_broadcast_batches_match_naive_loop() {
        // lhs: [3, 5, 4] transposed from [3, 4, 5]; rhs: [4, 6] broadcast over the batch.
        let a: Vec<f64> = (0..60).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..24).map(|i| (i as f64 * 0.91).cos()).collect();
        let al = Layout::contiguous([3, 4, 5]).transpose(1, 2);
        let bl = Layout::contiguous([4, 6])
            .broadcast_as(&Shape::from([3, 4, 6]), "t")
            .unwrap();
        let got = gemm_batched(&a, &al, &b, &bl);
        let want = naive(&a, &al, &b, &bl);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "{g} vs {w}");
        }
        let ai: Vec<i64> = a.iter().map(|v| (v * 10.0) as i64).collect();
        let bi: Vec<i64> = b.iter().map(|v| (v * 10.0) as i64).collect();
        let af: Vec<f64> = ai.iter().map(|&v| v as f64).collect();
        let bf: Vec<f64> = bi.iter().map(|&v| v as f64).collect();
        let got = int_matmul(&ai, &al, &bi, &bl);
        let want = naive(&af, &al, &bf, &bl);
        assert_eq!(got.iter().map(|&v| v as f64).collect::<Vec<_>>(), want);
    }
}

impl MatmulOps for CpuStorage {
    /// The batched product of `[B.., m, k]` and `[B.., k, n]` (same batch dims), row-major.
    fn matmul(&self, al: &Layout, rhs: &CpuStorage, bl: &Layout) -> Result<CpuStorage> {
        use CpuStorage::*;
        check_host_alloc("matmul", matmul_out_len(al, bl)?, self.dtype())?;
        Ok(match (self, rhs) {
            (F32(a), F32(b)) => F32(gemm_batched(a, al, b, bl)),
            (F64(a), F64(b)) => F64(gemm_batched(a, al, b, bl)),
            (F16(a), F16(b)) => F16(gemm_batched(a, al, b, bl)),
            (BF16(a), BF16(b)) => BF16(bf16_matmul(a, al, b, bl)),
            (I64(a), I64(b)) => I64(int_matmul(a, al, b, bl)),
            (I32(a), I32(b)) => I32(int_matmul(a, al, b, bl)),
            (U8(a), U8(b)) => U8(int_matmul(a, al, b, bl)),
            (Bool(_), Bool(_)) => {
                return Err(Error::UnsupportedDType {
                    op: "matmul",
                    dtype: DType::Bool,
                    hint: "convert to an integer or float dtype first",
                })
            }
            _ => {
                return Err(Error::DTypeMismatch {
                    op: "matmul",
                    expected: self.dtype(),
                    found: rhs.dtype(),
                })
            }
        })
    }

    /// [`CpuStorage::matmul`] plus `bias` (`[n]` at `bias_l`, any stride) added to every row of
    /// the product: `out[.., i, j] = Σ_k a[.., i, k]·b[.., k, j] + bias[j]`. f16 and bf16 add the
    /// bias to the f32 accumulation and round once; f32 and f64 add it to the product. Floats
    /// only (an integer product plus a bias is exact as matmul then add).
    fn matmul_bias(
        &self,
        al: &Layout,
        rhs: &CpuStorage,
        bl: &Layout,
        bias: &CpuStorage,
        bias_l: &Layout,
    ) -> Result<CpuStorage> {
        use CpuStorage::*;
        check_host_alloc("linear", matmul_out_len(al, bl)?, self.dtype())?;
        let n = bl.dims()[bl.dims().len() - 1];
        assert_eq!(bias_l.dims(), [n], "bias of [n] checked by the caller");
        for other in [rhs, bias] {
            if other.dtype() != self.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "linear",
                    expected: self.dtype(),
                    found: other.dtype(),
                });
            }
        }
        Ok(match (self, rhs, bias) {
            (F32(a), F32(b), F32(c)) => {
                let mut out = gemm_batched(a, al, b, bl);
                add_bias(&mut out, &super::gather_strided(c, bias_l));
                F32(out)
            }
            (F64(a), F64(b), F64(c)) => {
                let mut out = gemm_batched(a, al, b, bl);
                add_bias(&mut out, &super::gather_strided(c, bias_l));
                F64(out)
            }
            (F16(a), F16(b), F16(c)) => F16(half_matmul_bias(
                (a, al),
                (b, bl),
                (c, bias_l),
                f16::to_f32,
                f16::from_f32,
            )),
            (BF16(a), BF16(b), BF16(c)) => BF16(half_matmul_bias(
                (a, al),
                (b, bl),
                (c, bias_l),
                bf16::to_f32,
                bf16::from_f32,
            )),
            _ => {
                return Err(Error::UnsupportedDType {
                    op: "matmul with a bias",
                    dtype: self.dtype(),
                    hint: "only float products take a fused bias; use matmul then add",
                })
            }
        })
    }
}

/// Elements of the `[B.., m, n]` product of `[B.., m, k]` at `a` and `[B.., k, n]` at `b`.
fn matmul_out_len(a: &Layout, b: &Layout) -> Result<usize> {
    let rows = a.dims()[..a.dims().len().saturating_sub(1)]
        .iter()
        .product::<usize>();
    crate::shape::checked_mul(
        "matmul",
        "the output rows × columns",
        rows,
        *b.dims().last().unwrap_or(&1),
    )
}
