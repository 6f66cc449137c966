//! CUDA launchers for `kernels/norm.cu`: the fused layer normalization (one kernel) and its
//! backward (one kernel for dx and the per-block parameter sums, one small kernel adding the
//! blocks in order), with the CPU backend's formulas (`cpu/norm.rs`). Operands are contiguous
//! rows of `n` elements (the op layer makes them so).
//!
//! Note [Layer norm launch]: one warp a row, 8 warps (256 threads) a block forward. Backward,
//! each warp accumulates the parameter sums of its rows in shared memory (2n math-type values a
//! warp), so a block holds as many warps as 48 KiB allows (at most 8: n = 768 in f32 is
//! 6 KiB a warp); the grid is 4 blocks an SM (32 warps), so `partial` has 4 · SMs rows of 2n
//! (3.2 MiB for n = 768 on 132 SMs, 8% of the bf16 backward's traffic of g, x and dx at
//! [8192, 768]). A row
//! too long for one warp's sums in 48 KiB (n > 6144 in f32) takes one-warp blocks that
//! accumulate in their row of `partial` in global memory instead. Rows, weights, bias and the
//! sums move as 16-byte vectors when aligned: with scalar weight loads and scalar shared-memory
//! sums (a lane's slots 8 apart: 8-way bank conflicts) and 2 blocks an SM, the bf16 [8192, 768]
//! backward took 43.8 µs on an H200; vectorized, with 4 blocks an SM, 27.8 µs (PyTorch 2.11's
//! two kernels: 45.9 µs), and the forward 13.5 µs (PyTorch 19.4 µs); GPU time from the
//! profiler, `cuda_layernorm_bf16_kernel_time` in `tests/it/layer_norm.rs`. Rows of at most 768
//! vectorized elements of a 4- or 2-byte dtype take `layer_norm_backward_rows` instead, which
//! holds a row in registers, with a grid of the 2 blocks an SM its launch bounds keep room for
//! (Note [Layer norm backward in registers] in `norm.cu`: f32 [8192, 768] 36.2 -> 26.8 µs,
//! bf16 24.1 -> 17.3 µs).

use super::kernels::Grid;
use super::launch;
use super::runtime::DeviceRuntime;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{LayerNormGrads, NormOps};
use crate::layout::Layout;
use crate::{DType, Error, Result};

const OP: &str = "layer_norm";
const ADD_OP: &str = "add_layer_norm";
/// Warps (rows) a forward block.
const FORWARD_WARPS: u32 = 8;
/// Most warps a backward block.
const BACKWARD_WARPS: usize = 8;
/// Backward blocks an SM (4 blocks of 48 KiB fit an H100/H200 SM's 228 KiB).
const BACKWARD_BLOCKS_PER_SM: usize = 4;
/// `layer_norm_backward_rows` blocks an SM: what its launch bounds keep registers for
/// (`LN_BWD_ROWS_MIN_BLOCKS` in `norm.cu`), so that every block runs at once.
const ROWS_BLOCKS_PER_SM: usize = 2;
/// Most elements of a row `layer_norm_backward_rows` takes (`32 · LN_LANE_ELEMS` in `norm.cu`).
const ROWS_MAX_N: usize = 32 * 24;
/// Dynamic shared memory a backward block may use, bytes (the default limit without opting in).
const SHARED_LIMIT: usize = 48 * 1024;

/// The math type of x's dtype: the dtype of mean, rstd and the parameter sums.
fn math(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The element offset of a contiguous operand, or the error for another layout.
fn contiguous(l: &Layout) -> Result<()> {
    match l.contiguous_range() {
        Some(_) => Ok(()),
        None => Err(Error::invalid(OP, "the fused kernel takes contiguous operands")),
    }
}

/// The parameters' dtype (x's, or f32 for an f16/bf16 x), checked.
fn param_dtype(x: DType, p: DType) -> Result<DType> {
    match (x, p) {
        (DType::F32 | DType::F64 | DType::F16 | DType::BF16, p) if p == x => Ok(p),
        (DType::F16 | DType::BF16, DType::F32) => Ok(p),
        (x, p) if x.is_floating_point() => Err(Error::DTypeMismatch {
            op: OP,
            expected: x,
            found: p,
        }),
        (x, _) => Err(Error::dtype(OP, x)),
    }
}

/// Room for the bf16 twin of `numel` f32 results when `twin` asks for it (Note [Cast twins] in
/// `storage/mod.rs`; the kernels write it beside the f32 elements). Other dtypes get none.
fn low_twin(
    rt: &DeviceRuntime,
    dtype: DType,
    twin: Option<DType>,
    numel: usize,
) -> Result<Option<CudaStorage>> {
    match (dtype, twin) {
        (DType::F32, Some(DType::BF16)) => Ok(Some(CudaStorage::alloc_on(rt, DType::BF16, numel)?)),
        _ => Ok(None),
    }
}

/// 1 when every address is 16-byte aligned and rows are whole 16-byte vectors.
fn vectorized(n: usize, dtype: DType, addrs: &[u64]) -> i32 {
    let v = 16 / dtype.size_in_bytes();
    (n % v == 0 && addrs.iter().all(|a| a % 16 == 0)) as i32
}

fn check_device(a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.ordinal() != b.ordinal() {
        return Err(Error::DeviceMismatch {
            op: OP,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}

/// Whether the backward of rows of `n` takes `layer_norm_backward_rows`: a 4- or 2-byte dtype,
/// rows of at most [`ROWS_MAX_N`] in 16-byte vectors (`vec`), the sums (when wanted) in shared
/// memory.
fn backward_in_rows(n: usize, dtype: DType, vec: i32, sums: bool, shared: bool) -> bool {
    dtype != DType::F64 && vec == 1 && n <= ROWS_MAX_N && (shared || !sums)
}

/// The backward's block shape: (warps a block, whether the sums are in shared memory).
fn backward_shape(n: usize, math: DType) -> (usize, bool) {
    let per_warp = 2 * n * math.size_in_bytes();
    match SHARED_LIMIT / per_warp.max(1) {
        0 => (1, false),
        w => (w.min(BACKWARD_WARPS), true),
    }
}

/// The forward of `layer_norm` (`residual` None) or of `add_layer_norm` (the sum written too):
/// one kernel either way, with one geometry (Note [Layer norm launch]).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn forward(
    x: &CudaStorage,
    layout: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    weight: Option<(&CudaStorage, &Layout)>,
    bias: Option<(&CudaStorage, &Layout)>,
    n: usize,
    eps: f64,
    twin: Option<DType>,
) -> Result<(
    Option<CudaStorage>,
    (CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>),
)> {
    let dtype = x.dtype();
    contiguous(layout)?;
    let pd = weight
        .or(bias)
        .map_or(Ok(dtype), |(s, _)| param_dtype(dtype, s.dtype()))?;
    for (s, l) in weight.iter().chain(bias.iter()) {
        contiguous(l)?;
        check_device(x, s)?;
        if s.dtype() != pd {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: pd,
                found: s.dtype(),
            });
        }
    }
    let numel = layout.numel();
    // The residual: x's dtype, or a half dtype beside an f32 x (`add_layer_norm_mixed_<R>`).
    let mixed = match residual {
        None => false,
        Some((r, rl)) => {
            contiguous(rl)?;
            check_device(x, r)?;
            if rl.numel() != numel {
                return Err(Error::invalid(
                    ADD_OP,
                    format!("the residual holds {} elements, x {numel}", rl.numel()),
                ));
            }
            match (dtype, r.dtype()) {
                (d, r) if d == r => false,
                (DType::F32, DType::BF16 | DType::F16) => true,
                (d, r) => {
                    return Err(Error::DTypeMismatch {
                        op: ADD_OP,
                        expected: d,
                        found: r,
                    })
                }
            }
        }
    };
    let rt = x.runtime()?;
    let rows = numel.checked_div(n).unwrap_or(0);
    let sum = residual
        .map(|_| CudaStorage::alloc_on(rt, dtype, numel))
        .transpose()?;
    let y = CudaStorage::alloc_on(rt, dtype, numel)?;
    let mean = CudaStorage::alloc_on(rt, math(dtype), rows)?;
    let rstd = CudaStorage::alloc_on(rt, math(dtype), rows)?;
    let low = low_twin(rt, dtype, twin, numel)?;
    if numel == 0 {
        return Ok((sum, (y, mean, rstd, low)));
    }
    let xp = x.dev_ptr(layout);
    let (w, b) = (weight.map(|(s, l)| s.dev_ptr(l)), bias.map(|(s, l)| s.dev_ptr(l)));
    let yp = y.dev_ptr_mut_at(0);
    let mut addrs = vec![xp.addr(), yp.addr()];
    addrs.extend(w.iter().chain(b.iter()).map(|p| p.addr()));
    let rp = residual.map(|(r, l)| r.dev_ptr(l));
    let sp = sum.as_ref().map(|s| s.dev_ptr_mut_at(0));
    addrs.extend(sp.map(|p| p.addr()));
    // A half residual beside f32 x is read element by element (`ln_load` of 8 bytes).
    addrs.extend(rp.filter(|_| !mixed).map(|p| p.addr()));
    let vec = vectorized(n, dtype, &addrs);
    let grid = Grid {
        grid: (
            rows.div_ceil(FORWARD_WARPS as usize)
                .clamp(1, rt.sm_count as usize * 16) as u32,
            1,
            1,
        ),
        block: (32, FORWARD_WARPS, 1),
        shared_bytes: 0,
    };
    let (lowp, meanp, rstdp) = (
        low.as_ref().map(|l| l.dev_ptr_mut_at(0)),
        Some(mean.dev_ptr_mut_at(0)),
        Some(rstd.dev_ptr_mut_at(0)),
    );
    // x (and the residual, and the sum) hold rows · n contiguous elements from their offsets,
    // y as many, mean and rstd `rows`; weight and bias n each (checked contiguous above,
    // shapes by the op layer).
    match (rp, sp) {
        (Some(rp), Some(sp)) => {
            let (kernel, dtypes) = if mixed {
                (
                    launch::add_layer_norm::add_layer_norm_mixed,
                    vec![residual.map_or(dtype, |r| r.0.dtype())],
                )
            } else {
                (launch::add_layer_norm::add_layer_norm, vec![dtype, pd])
            };
            launch::add_layer_norm(
                rt,
                kernel,
                &dtypes,
                grid,
                xp,
                rp,
                w,
                b,
                sp,
                yp,
                lowp,
                meanp,
                rstdp,
                rows as i64,
                n as i64,
                eps,
                vec,
            )?
        }
        _ => launch::layer_norm(
            rt,
            &[dtype, pd],
            grid,
            xp,
            w,
            b,
            yp,
            lowp,
            meanp,
            rstdp,
            rows as i64,
            n as i64,
            eps,
            vec,
        )?,
    }
    Ok((sum, (y, mean, rstd, low)))
}

impl NormOps for CudaStorage {
    fn layer_norm(
        &self,
        layout: &Layout,
        weight: Option<(&CudaStorage, &Layout)>,
        bias: Option<(&CudaStorage, &Layout)>,
        n: usize,
        eps: f64,
        twin: Option<DType>,
    ) -> Result<(CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>)> {
        Ok(forward(self, layout, None, weight, bias, n, eps, twin)?.1)
    }

    fn add_layer_norm(
        &self,
        layout: &Layout,
        residual: (&CudaStorage, &Layout),
        weight: Option<(&CudaStorage, &Layout)>,
        bias: Option<(&CudaStorage, &Layout)>,
        n: usize,
        eps: f64,
        twin: Option<DType>,
    ) -> Result<(
        CudaStorage,
        (CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>),
    )> {
        match forward(self, layout, Some(residual), weight, bias, n, eps, twin)? {
            (Some(sum), rest) => Ok((sum, rest)),
            (None, _) => Err(Error::invalid(ADD_OP, "the fused kernel wrote no sum")),
        }
    }

    fn layer_norm_backward(
        &self,
        layout: &Layout,
        x: (&CudaStorage, &Layout),
        mean: &CudaStorage,
        rstd: &CudaStorage,
        weight: Option<(&CudaStorage, &Layout)>,
        n: usize,
        want: LayerNormGrads,
        dx_into: Option<&mut CudaStorage>,
        addend: Option<&CudaStorage>,
        twin: Option<DType>,
    ) -> Result<[Option<CudaStorage>; 4]> {
        let dtype = self.dtype();
        let (xs, xl) = x;
        if dx_into.is_some() && addend.is_some() {
            return Err(Error::invalid(
                OP,
                "a gradient to add dx into and one to add it to: pass one",
            ));
        }
        let into = dx_into.filter(|_| want.input);
        let addend = addend.filter(|_| want.input);
        if let Some(a) = addend {
            check_device(self, a)?;
            if a.dtype() != dtype || a.len() < layout.numel() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the gradient to add dx to ({} elements of {:?}) is not x's ({} of {dtype:?})",
                        a.len(),
                        a.dtype(),
                        layout.numel()
                    ),
                ));
            }
        }
        if let Some(d) = &into {
            check_device(self, d)?;
            if d.dtype() != dtype || d.len() != layout.numel() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the gradient to add dx to ({} elements of {:?}) is not x's ({} of {dtype:?})",
                        d.len(),
                        d.dtype(),
                        layout.numel()
                    ),
                ));
            }
        }
        contiguous(layout)?;
        contiguous(xl)?;
        if xs.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: xs.dtype(),
                found: dtype,
            });
        }
        let a = math(dtype);
        for s in [xs, mean, rstd] {
            check_device(self, s)?;
        }
        for s in [mean, rstd] {
            if s.dtype() != a {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: a,
                    found: s.dtype(),
                });
            }
        }
        let pd = match (weight, want.weight.or(want.bias)) {
            (Some((w, l)), _) => {
                contiguous(l)?;
                check_device(self, w)?;
                param_dtype(dtype, w.dtype())?
            }
            (None, Some(p)) => param_dtype(dtype, p)?,
            (None, None) => dtype,
        };
        for p in [want.weight, want.bias].into_iter().flatten() {
            if p != pd {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: pd,
                    found: p,
                });
            }
        }
        let rt = self.runtime()?;
        let numel = layout.numel();
        let rows = numel.checked_div(n).unwrap_or(0);
        let add = into.is_some();
        let dx = (want.input && !add)
            .then(|| CudaStorage::alloc_on(rt, dtype, numel))
            .transpose()?;
        let dw = want.weight.map(|d| CudaStorage::alloc_on(rt, d, n)).transpose()?;
        let db = want.bias.map(|d| CudaStorage::alloc_on(rt, d, n)).transpose()?;
        let sums = dw.is_some() || db.is_some();
        let low = match want.input {
            true => low_twin(rt, dtype, twin, numel)?,
            false => None,
        };
        if n == 0 {
            return Ok([dx, dw, db, low]);
        }
        let (warps, shared) = backward_shape(n, a);
        let (g, xp) = (self.dev_ptr(layout), xs.dev_ptr(xl));
        let w = weight.map(|(s, l)| s.dev_ptr(l));
        let dxp = match &into {
            Some(d) => Some(d.dev_ptr_mut_at(0)),
            None => dx.as_ref().map(|d| d.dev_ptr_mut_at(0)),
        };
        // What dx is added to: dx itself (in place), the read-only `addend`, or nothing.
        let ap = match &into {
            Some(_) => dxp.map(|d| d.read_only()),
            None => addend.map(|a| a.dev_ptr_at(0)),
        };
        let mut addrs = vec![g.addr(), xp.addr()];
        addrs.extend(dxp.map(|d| d.addr()));
        addrs.extend(ap.map(|d| d.addr()));
        addrs.extend(w.map(|d| d.addr()));
        // `layer_norm_backward_rows` reads and writes `partial` element by element.
        let in_rows = backward_in_rows(n, dtype, vectorized(n, dtype, &addrs), sums, shared);
        let per_sm = if in_rows {
            ROWS_BLOCKS_PER_SM
        } else {
            BACKWARD_BLOCKS_PER_SM
        };
        let blocks = if rows == 0 {
            1
        } else {
            rows.div_ceil(warps).clamp(1, rt.sm_count as usize * per_sm)
        };
        let partial = sums
            .then(|| CudaStorage::alloc_on(rt, a, blocks * 2 * n))
            .transpose()?;
        if rows > 0 && (dxp.is_some() || sums) {
            addrs.extend(partial.as_ref().map(|p| p.dev_ptr_at(0).addr()));
            let vec = vectorized(n, dtype, &addrs);
            let grid = Grid {
                grid: (blocks as u32, 1, 1),
                block: (32, warps as u32, 1),
                shared_bytes: if sums && shared {
                    (warps * 2 * n * a.size_in_bytes()) as u32
                } else {
                    0
                },
            };
            // g, x and dx hold rows · n contiguous elements (the addend, read first: `into` or
            // `addend`, checked above, x's dtype and at least its size), mean and rstd `rows`, weight n,
            // `partial` blocks · 2n; the shared memory holds warps · 2n math values (Note [Layer
            // norm launch]); for the rows kernel, every operand but `partial` is 16-byte aligned
            // and n is at most ROWS_MAX_N in whole vectors (`backward_in_rows`).
            if in_rows {
                launch::layer_norm_backward_rows(
                    rt,
                    &[dtype, pd],
                    grid,
                    g,
                    xp,
                    mean.dev_ptr_at(0),
                    rstd.dev_ptr_at(0),
                    w,
                    dxp,
                    low.as_ref().map(|l| l.dev_ptr_mut_at(0)),
                    partial.as_ref().map(|p| p.dev_ptr_mut_at(0)),
                    rows as i64,
                    n as i64,
                    ap,
                )?;
            } else {
                launch::layer_norm_backward(
                    rt,
                    &[dtype, pd],
                    grid,
                    g,
                    xp,
                    mean.dev_ptr_at(0),
                    rstd.dev_ptr_at(0),
                    w,
                    dxp,
                    low.as_ref().map(|l| l.dev_ptr_mut_at(0)),
                    partial.as_ref().map(|p| p.dev_ptr_mut_at(0)),
                    rows as i64,
                    n as i64,
                    vec,
                    shared as i32,
                    ap,
                )?;
            }
        }
        if let Some(p) = &partial {
            // Blocks of (32, 32): 32 columns each, 32 threads summing the blocks' rows
            // (`LN_PARAM_ROWS` in `norm.cu`).
            let grid = Grid {
                grid: (n.div_ceil(32).clamp(1, rt.sm_count as usize * 8) as u32, 1, 1),
                block: (32, 32, 1),
                shared_bytes: 0,
            };
            let blocks = if rows == 0 { 0 } else { blocks };
            // `partial` holds blocks · 2n values, dw and db n each.
            launch::layer_norm_backward_params(
                rt,
                &[pd],
                grid,
                p.dev_ptr_at(0),
                blocks as i64,
                n as i64,
                dw.as_ref().map(|d| d.dev_ptr_mut_at(0)),
                db.as_ref().map(|d| d.dev_ptr_mut_at(0)),
            )?;
        }
        Ok([dx, dw, db, low])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_blocks_fit_their_shared_memory() {
        // GPT-2's rows: 8 warps of 6 KiB (f32 sums).
        assert_eq!(backward_shape(768, DType::F32), (8, true));
        assert_eq!(backward_shape(4099, DType::F32), (1, true));
        // Past 48 KiB for one warp: sums in global memory.
        assert_eq!(backward_shape(6145, DType::F32), (1, false));
        assert_eq!(backward_shape(3073, DType::F64), (1, false));
        assert_eq!(vectorized(768, DType::BF16, &[0, 32]), 1);
        // GPT-2's rows take the rows kernel; f64, unaligned and longer rows the two-pass one.
        assert!(backward_in_rows(768, DType::F32, 1, true, true));
        assert!(backward_in_rows(768, DType::BF16, 1, false, false));
        assert!(!backward_in_rows(768, DType::F64, 1, true, true));
        assert!(!backward_in_rows(768, DType::F32, 0, true, true));
        assert!(!backward_in_rows(1024, DType::F32, 1, true, true));
        assert_eq!(vectorized(769, DType::BF16, &[0, 32]), 0);
        assert_eq!(vectorized(768, DType::BF16, &[0, 34]), 0);
    }
}
