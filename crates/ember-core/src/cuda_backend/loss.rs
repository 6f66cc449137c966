//! CUDA launchers of the class-index negative log-likelihood (`nll_loss_T_I` and
//! `nll_loss_backward_T_I` of `kernels/index.cu`), with the CPU's semantics (`cpu/loss.rs`).
//! The forward is one block: a loss reduces to one value, and the rows of a classifier batch
//! are few (the kernel walks any number). A target out of range is recorded on the device and
//! reported at the next synchronizing call (Note [Deferred device errors]), so the loss can be
//! captured into a CUDA graph.

use super::device_errors::Kind;
use super::kernels::Grid;
use super::launch::{self, DevPtr};
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{CrossEntropyParams, LossOps, Reduction};
use crate::{DType, Error, Result};

const OP: &str = "nll_loss";

/// The optional class weights (`c` of them), checked to be of `dtype`.
fn weight_ptr(weight: Option<&CudaStorage>, dtype: DType, c: usize) -> Result<Option<DevPtr<'_>>> {
    match weight {
        None => Ok(None),
        Some(w) if w.dtype() == dtype && w.len() >= c => Ok(Some(w.dev_ptr_at(0))),
        Some(w) => Err(Error::DTypeMismatch {
            op: OP,
            expected: dtype,
            found: w.dtype(),
        }),
    }
}

fn target_dtype(target: &CudaStorage) -> Result<DType> {
    match target.dtype() {
        d @ (DType::I64 | DType::I32) => Ok(d),
        dtype => Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            hint: "class-index targets must be int64 (or int32)",
        }),
    }
}

impl LossOps for CudaStorage {
    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at
    /// `target` (see `LossOps::nll_loss_forward`).
    fn nll_loss_forward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let (dtype, idt) = (self.dtype(), target_dtype(target)?);
        if !dtype.is_floating_point() {
            return Err(Error::dtype(OP, dtype));
        }
        let rt = self.runtime()?;
        let w = weight_ptr(weight, dtype, c)?;
        let loss = CudaStorage::alloc_on(rt, dtype, 1)?;
        let total = CudaStorage::alloc_on(rt, dtype, 1)?;
        let (x, t) = (self.dev_ptr_at(0), target.dev_ptr_at(0));
        let (l, tw) = (loss.dev_ptr_mut_at(0), total.dev_ptr_mut_at(0));
        let (m64, c64, mean32) = (m as i64, c as i64, i32::from(mean));
        let check = rt.errors.check_args(OP, Kind::Index, 1, c);
        let block = (m.next_multiple_of(32)).clamp(32, 1024) as u32;
        // The caller passes contiguous storages of m·c log-probabilities and m targets (the
        // weight, when given, holds c values of T, checked above); `loss` and `total` hold one
        // T each; the kernel reads logp only at in-range targets; one block of a multiple of 32
        // threads.
        let grid = Grid {
            grid: (1, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        };
        let dtypes = [dtype, idt];
        launch::nll_loss(
            rt,
            &dtypes,
            grid,
            x,
            t,
            w,
            m64,
            c64,
            ignore_index,
            mean32,
            l,
            tw,
            &check,
        )?;
        Ok((loss, total))
    }

    /// The `[m, c]` gradient of that loss for its gradient `self` (one element).
    fn nll_loss_backward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        total_weight: &CudaStorage,
        (m, c): (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<CudaStorage> {
        let (dtype, idt) = (self.dtype(), target_dtype(target)?);
        let rt = self.runtime()?;
        let w = weight_ptr(weight, dtype, c)?;
        let len = m.checked_mul(c).ok_or_else(|| {
            Error::invalid(
                "nll_loss_backward",
                format!("{m} rows of {c} classes overflow the address space"),
            )
        })?;
        let grad = CudaStorage::full(rt.ordinal, dtype, len, 0.0)?;
        if m == 0 {
            return Ok(grad);
        }
        let (g, t) = (self.dev_ptr_at(0), target.dev_ptr_at(0));
        let (tw, o) = (total_weight.dev_ptr_at(0), grad.dev_ptr_mut_at(0));
        let (m64, c64, mean32) = (m as i64, c as i64, i32::from(mean));
        // `g` and `total_weight` hold one T each, `target` m indices, the weight (when given) c
        // values; `grad` holds m·c zeros and is written only at in-range targets.
        let (dtypes, grid) = ([dtype, idt], Grid::linear(rt, m, 256));
        launch::nll_loss_backward(rt, &dtypes, grid, g, t, w, tw, m64, c64, ignore_index, mean32, o)?;
        Ok(grad)
    }

    /// `(loss, lse, total)` of the contiguous `[n, c]` logits `self` (see
    /// `LossOps::cross_entropy_forward`).
    fn cross_entropy_forward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        p: &CrossEntropyParams,
    ) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
        let (n, c) = (p.n, p.c);
        let (dtype, idt, acc) = ce_dtypes(self, target, weight, c)?;
        if acc_dtype(p.out_dtype) != acc {
            return Err(Error::DTypeMismatch {
                op: CE,
                expected: acc,
                found: p.out_dtype,
            });
        }
        let rt = self.runtime()?;
        let out_len = if p.reduction == Reduction::None { n } else { 1 };
        let loss = CudaStorage::alloc_on(rt, p.out_dtype, out_len)?;
        let lse = CudaStorage::alloc_on(rt, acc, n)?;
        let total = CudaStorage::alloc_on(rt, acc, 2)?;
        let row_loss = CudaStorage::alloc_on(rt, acc, n)?;
        let row_weight = CudaStorage::alloc_on(rt, acc, n)?;
        let w = weight.map(|w| w.dev_ptr_at(0));
        let (n64, c64) = (n as i64, c as i64);
        if n > 0 {
            let check = rt.errors.check_args(CE, Kind::Index, 1, c);
            // `self` holds n·c logits, `target` n indices, the weight (checked above) c values
            // of A; lse, row_loss and row_weight n values of A each: the kernel indexes
            // x[r·c + j] for j < c and the others at r < n, and x[r·c + t] only for t in [0, c).
            launch::cross_entropy(
                rt,
                &[dtype, idt],
                row_grid(n, c, dtype),
                self.dev_ptr_at(0),
                target.dev_ptr_at(0),
                w,
                n64,
                c64,
                p.ignore_index,
                p.label_smoothing,
                lse.dev_ptr_mut_at(0),
                row_loss.dev_ptr_mut_at(0),
                row_weight.dev_ptr_mut_at(0),
                &check,
            )?;
        }
        // One block: row_loss and row_weight hold n values, the weight c, `loss` out_len
        // (n for `none`), `total` 2.
        let one = Grid {
            grid: (1, 1, 1),
            block: (1024, 1, 1),
            shared_bytes: 0,
        };
        launch::cross_entropy_reduce(
            rt,
            &[p.out_dtype],
            one,
            row_loss.dev_ptr_at(0),
            row_weight.dev_ptr_at(0),
            w,
            n64,
            c64,
            mode(p.reduction),
            loss.dev_ptr_mut_at(0),
            total.dev_ptr_mut_at(0),
        )?;
        Ok((loss, lse, total))
    }

    /// The `[n, c]` gradient of that loss (see `LossOps::cross_entropy_backward`).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        target: &CudaStorage,
        weight: Option<&CudaStorage>,
        lse: &CudaStorage,
        total: &CudaStorage,
        grad: &CudaStorage,
        p: &CrossEntropyParams,
    ) -> Result<CudaStorage> {
        let (n, c) = (p.n, p.c);
        let (dtype, idt, acc) = ce_dtypes(self, target, weight, c)?;
        let per_row = p.reduction == Reduction::None;
        for s in [lse, total, grad] {
            if s.dtype() != acc {
                return Err(Error::DTypeMismatch {
                    op: CE,
                    expected: acc,
                    found: s.dtype(),
                });
            }
        }
        p.check_backward_lengths(lse.len(), total.len(), grad.len())?;
        let len = n.checked_mul(c).ok_or_else(|| {
            Error::invalid(
                "cross_entropy_backward",
                format!("{n} rows of {c} classes overflow the address space"),
            )
        })?;
        let rt = self.runtime()?;
        let out = CudaStorage::alloc_on(rt, dtype, len)?;
        if n == 0 || c == 0 {
            return Ok(out);
        }
        // `self` and `out` hold n·c elements of T (every one of `out` written), `target` n,
        // lse n values of A, total 2, grad n per row or 1 (read at r·g_stride), the weight c.
        launch::cross_entropy_backward(
            rt,
            &[dtype, idt],
            row_grid(n, c, dtype),
            self.dev_ptr_at(0),
            target.dev_ptr_at(0),
            weight.map(|w| w.dev_ptr_at(0)),
            lse.dev_ptr_at(0),
            total.dev_ptr_at(0),
            grad.dev_ptr_at(0),
            i64::from(per_row),
            n as i64,
            c as i64,
            p.ignore_index,
            p.label_smoothing,
            mode(p.reduction),
            out.dev_ptr_mut_at(0),
        )?;
        Ok(out)
    }
}

// ---- The fused classifier (`kernels/loss.cu`) ----
//
// Note [Classifier launch]: one block per row, as llm.c's fused classifier, of at most 256
// threads, each loading 4 16-byte vectors before using them (`CE_BATCH` in `loss.cu`), and the
// backward writing each 16-byte pack with one `st.global.v4.u32` (`ce_store`). Measured on an
// H200 for GPT-2's [8192, 50304] bf16 logits (forward + backward, the bench's
// `cross_entropy_50304`; PyTorch 5.95 ms): 1024-thread blocks with one vector in flight per
// thread, 2.26 ms; 256-thread blocks with batched loads, 2.18 ms, of which the forward took
// 0.34 ms (2.4 TB/s of logits read) and the backward 1.84 ms. NVRTC had split each pack's store
// into four 4-byte stores (PTX), hence `ce_store`; that version is not yet measured. Rows
// shorter than a block's share take 32 threads per 4 vectors (at least one warp). The grid is
// the row count (at most 65,535 blocks; the kernels stride over the rest). Forward and backward
// each read the logits once; the backward writes the gradient once, in the logits' dtype.
// Tried and reverted (session 47): a one-pass kernel writing the gradient in the forward for
// `backward()`'s implicit 1, each row held in the registers of one block of up to 1024 threads
// (one block an SM), took 1.35 ms against 0.39 + 0.52 ms for these two kernels: its two exps an
// element (about 0.4 ms of the SM's special-function units for GPT-2's logits) and its memory
// phases run one after the other with one row an SM, where the two kernels overlap them across
// many blocks. A one-pass kernel that pays would keep rows in shared memory (two 100 KB rows an
// SM, dynamic shared memory above 48 KB) so that one block loads while the other computes.

const CE: &str = "cross_entropy";

/// The accumulation dtype of logits of `dtype` (`Acc<T>` in the kernels).
fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The launch of the classifier's row kernels (Note [Classifier launch]).
fn row_grid(n: usize, c: usize, dtype: DType) -> Grid {
    let vectors = c.div_ceil(16 / dtype.size_in_bytes()).max(1);
    let block = vectors.div_ceil(4).next_multiple_of(32).clamp(32, 256) as u32;
    Grid {
        grid: (n.clamp(1, 65_535) as u32, 1, 1),
        block: (block, 1, 1),
        shared_bytes: 0,
    }
}

/// The classifier operands' checks: float logits, int64/int32 targets, weights of the
/// accumulation dtype.
fn ce_dtypes(
    x: &CudaStorage,
    target: &CudaStorage,
    weight: Option<&CudaStorage>,
    c: usize,
) -> Result<(DType, DType, DType)> {
    let dtype = x.dtype();
    if !dtype.is_floating_point() {
        return Err(Error::dtype(CE, dtype));
    }
    let idt = match target.dtype() {
        d @ (DType::I64 | DType::I32) => d,
        dtype => {
            return Err(Error::UnsupportedDType {
                op: CE,
                dtype,
                hint: "class-index targets must be int64 (or int32)",
            })
        }
    };
    let acc = acc_dtype(dtype);
    if let Some(w) = weight {
        if w.dtype() != acc || w.len() < c {
            return Err(Error::DTypeMismatch {
                op: CE,
                expected: acc,
                found: w.dtype(),
            });
        }
    }
    Ok((dtype, idt, acc))
}

fn mode(r: Reduction) -> i32 {
    match r {
        Reduction::None => 0,
        Reduction::Sum => 1,
        Reduction::Mean => 2,
    }
}
