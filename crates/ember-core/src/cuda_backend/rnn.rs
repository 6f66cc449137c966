//! CUDA launchers for `kernels/rnn.cu`: the pointwise halves of a fused LSTM time step (Note
//! [Fused LSTM recurrence] in `ops/rnn.rs`), one thread per element of the `[N, H]` state, with
//! the CPU backend's formulas (`cpu/rnn.rs`). Operands are whole buffers plus element offsets of
//! the step's rows, which `Storage::lstm_forward_step` / `lstm_backward_step` (`storage/families.rs`,
//! with the checks of `backend/step.rs`) have checked to lie inside them.

use super::kernels::Grid;
use super::launch;
use super::storage::CudaStorage;
use crate::backend::step::{LstmBackwardStep, LstmForwardStep};
use crate::backend::BackendStorage;
use crate::backend::RnnOps;
use crate::{Error, Result};

/// Threads per block.
const BLOCK: u32 = 256;

/// Checks that every operand has `first`'s dtype (a float) and device.
fn same(op: &'static str, first: &CudaStorage, rest: &[&CudaStorage]) -> Result<()> {
    if !first.dtype().is_floating_point() {
        return Err(Error::dtype(op, first.dtype()));
    }
    for s in rest {
        if s.dtype() != first.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                expected: first.dtype(),
                found: s.dtype(),
            });
        }
        if s.ordinal() != first.ordinal() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: first.device(),
                rhs: s.device(),
            });
        }
    }
    Ok(())
}

impl RnnOps for CudaStorage {
    /// One forward step (see [`LstmForwardStep`]), enqueued on the current stream.
    fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &CudaStorage,
        hh: &CudaStorage,
        h: &mut CudaStorage,
        c: &mut CudaStorage,
        gates: &mut CudaStorage,
    ) -> Result<()> {
        const OP: &str = "lstm_recurrence";
        same(OP, gi, &[hh, h, c, gates])?;
        let nh = s.n * s.hidden;
        if nh == 0 {
            return Ok(());
        }
        let rt = gi.runtime()?;
        let (pgi, phh) = (gi.dev_ptr_at(s.gi), hh.dev_ptr_at(s.hh));
        let (pcp, pc, ph) = (
            c.dev_ptr_at(s.c_prev),
            c.dev_ptr_mut_at(s.c),
            h.dev_ptr_mut_at(s.h),
        );
        let pcc = s.c_copy.map(|o| h.dev_ptr_mut_at(o));
        let pg = gates.dev_ptr_mut_at(s.gates);
        let (n, hidden) = (s.n as i64, s.hidden as i64);
        // All of the dtype checked above. `LstmForwardStep::check` verified that gi and hh hold
        // N·4H elements from their offsets, c_prev, c, h and c_copy N·H, gates N·4H, and that
        // c_prev and c are disjoint rows of `c` (the kernel reads and writes them through
        // restrict pointers); h and c_copy are disjoint rows of `h`.
        let (dtypes, grid) = ([gi.dtype()], Grid::linear(rt, nh, BLOCK));
        launch::lstm_forward(rt, &dtypes, grid, pgi, phh, pcp, ph, pc, pcc, pg, n, hidden)
    }

    /// One backward step (see [`LstmBackwardStep`]), enqueued on the current stream.
    fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &CudaStorage,
        dh_rec: Option<&CudaStorage>,
        gates: &CudaStorage,
        c: &CudaStorage,
        dc: &mut CudaStorage,
        dgates: &mut CudaStorage,
    ) -> Result<()> {
        const OP: &str = "lstm_recurrence_backward";
        same(OP, dh_out, &[gates, c, dc, dgates])?;
        if let Some(r) = dh_rec {
            same(OP, dh_out, &[r])?;
        }
        let nh = s.n * s.hidden;
        if nh == 0 {
            return Ok(());
        }
        let rt = dh_out.runtime()?;
        let pdh = dh_out.dev_ptr_at(s.dh_out);
        let prec = match (dh_rec, s.dh_rec) {
            (Some(r), Some(off)) => Some(r.dev_ptr_at(off)),
            _ => None,
        };
        let (pg, pc, pcp) = (
            gates.dev_ptr_at(s.gates),
            c.dev_ptr_at(s.c),
            c.dev_ptr_at(s.c_prev),
        );
        let (pdc, pdg) = (dc.dev_ptr_mut_at(s.dc), dgates.dev_ptr_mut_at(s.dgates));
        let (n, hidden) = (s.n as i64, s.hidden as i64);
        // All of the dtype checked above. `LstmBackwardStep::check` verified that dh_out, dh_rec,
        // c, c_prev and dc hold N·H elements from their offsets and gates and dgates N·4H; the
        // only written operands (dc, dgates) are buffers of their own, and dc is read and
        // written by the same thread only.
        let (dtypes, grid) = ([dh_out.dtype()], Grid::linear(rt, nh, BLOCK));
        launch::lstm_backward(rt, &dtypes, grid, pdh, prec, pg, pc, pcp, pdc, pdg, n, hidden)
    }
}
