//! CUDA launchers for `kernels/rnn.cu`: the pointwise halves of a fused LSTM time step (Note
//! [Fused LSTM recurrence] in `ops/rnn.rs`), one thread per element of the `[N, H]` state, with
//! the CPU backend's formulas (`cpu/rnn.rs`). Operands are whole buffers plus element offsets of
//! the step's rows, which `Storage::lstm_forward_step` / `lstm_backward_step` (`storage.rs`,
//! with the checks of `backend/step.rs`) have checked to lie inside them.

use super::kernels::{launch, Grid, KernelKey, Module};
use super::storage::CudaStorage;
use super::stream::current_raw;
use crate::backend::step::{LstmBackwardStep, LstmForwardStep};
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

impl CudaStorage {
    /// One forward step (see [`LstmForwardStep`]), enqueued on the current stream.
    pub(crate) fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &CudaStorage,
        hh: &CudaStorage,
        h: &CudaStorage,
        c: &CudaStorage,
        gates: &CudaStorage,
    ) -> Result<()> {
        const OP: &str = "lstm_recurrence";
        same(OP, gi, &[hh, h, c, gates])?;
        let nh = s.n * s.hidden;
        if nh == 0 {
            return Ok(());
        }
        let rt = gi.runtime()?;
        let f = rt.function(KernelKey::new(Module::Rnn, "lstm_forward", gi.dtype()))?;
        let (pgi, phh) = (gi.ptr_at(s.gi), hh.ptr_at(s.hh));
        let (pcp, pc, ph) = (c.ptr_at(s.c_prev), c.ptr_at(s.c), h.ptr_at(s.h));
        let pcc: u64 = s.c_copy.map_or(0, |o| h.ptr_at(o));
        let pg = gates.ptr_at(s.gates);
        let (n, hidden) = (s.n as i64, s.hidden as i64);
        // SAFETY: `lstm_forward_T(const T* gi, const T* hh, const T* c_prev, T* h, T* c,
        // T* c_copy, T* gates, i64 n, i64 h)`, all T the dtype checked above. `LstmForwardStep::
        // check` verified that gi and hh hold N·4H elements from their offsets, c_prev, c, h and
        // c_copy (0 = none) N·H, gates N·4H, and that c_prev and c are disjoint rows of `c` (the
        // kernel reads and writes them through restrict pointers); h and c_copy are disjoint
        // rows of `h`. Every buffer was allocated on this device and is used on the current stream.
        unsafe {
            launch(
                f,
                Grid::linear(rt, nh, BLOCK),
                current_raw(rt.ordinal),
                &[&pgi, &phh, &pcp, &ph, &pc, &pcc, &pg, &n, &hidden],
            )
        }
    }

    /// One backward step (see [`LstmBackwardStep`]), enqueued on the current stream.
    pub(crate) fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &CudaStorage,
        dh_rec: Option<&CudaStorage>,
        gates: &CudaStorage,
        c: &CudaStorage,
        dc: &CudaStorage,
        dgates: &CudaStorage,
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
        let f = rt.function(KernelKey::new(Module::Rnn, "lstm_backward", dh_out.dtype()))?;
        let pdh = dh_out.ptr_at(s.dh_out);
        let prec: u64 = match (dh_rec, s.dh_rec) {
            (Some(r), Some(off)) => r.ptr_at(off),
            _ => 0,
        };
        let (pg, pc, pcp) = (gates.ptr_at(s.gates), c.ptr_at(s.c), c.ptr_at(s.c_prev));
        let (pdc, pdg) = (dc.ptr_at(s.dc), dgates.ptr_at(s.dgates));
        let (n, hidden) = (s.n as i64, s.hidden as i64);
        // SAFETY: `lstm_backward_T(const T* dh_out, const T* dh_rec, const T* gates, const T* c,
        // const T* c_prev, T* dc, T* dgates, i64 n, i64 h)`, all T the dtype checked above.
        // `LstmBackwardStep::check` verified that dh_out, dh_rec (0 = none), c, c_prev and dc
        // hold N·H elements from their offsets and gates and dgates N·4H; the only written
        // operands (dc, dgates) are buffers of their own, and dc is read and written by the same
        // thread only. Every buffer is on this device and used on the current stream.
        unsafe {
            launch(
                f,
                Grid::linear(rt, nh, BLOCK),
                current_raw(rt.ordinal),
                &[&pdh, &prec, &pg, &pc, &pcp, &pdc, &pdg, &n, &hidden],
            )
        }
    }
}
