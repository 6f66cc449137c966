//! Step descriptions of the fused families, whose kernels update buffers in place: one time
//! step of the fused LSTM recurrence ([`LstmForwardStep`], [`LstmBackwardStep`]; Note [Fused
//! LSTM recurrence] in `ops/rnn.rs`). The fused optimizer steps do not cross the boundary
//! through the traits yet: `ops/fused_optim.rs` calls `cpu::optim` and `cuda::optim` itself
//! (with the GradScaler's device scalars), to be moved behind `BackendStorage` next.

use crate::{Error, Result};

const OP: &str = "lstm_recurrence";

/// Element offsets of one forward step's rows in its operands (see Note [Fused LSTM
/// recurrence] in `ops/rnn.rs`): `gi` and `hh` `[N, 4H]` rows are read, `c_prev` (a row of
/// the `c` buffer before `c`) is read, `h` and `c` are written, `c_copy` (a row of the `h`
/// buffer, on the last step) receives `c` again, `gates` `[N, 4H]` the activated gates.
#[derive(Debug, Clone, Copy)]
pub struct LstmForwardStep {
    pub n: usize,
    pub hidden: usize,
    pub gi: usize,
    pub hh: usize,
    pub c_prev: usize,
    pub c: usize,
    pub h: usize,
    pub c_copy: Option<usize>,
    pub gates: usize,
}

/// Element offsets of one backward step's rows: `dh_out` (the output gradient's row `t`) and
/// `dh_rec` (the recurrent gradient, absent on the last step) `[N, H]`, the saved `gates`
/// `[N, 4H]`, `c` (`c_t`) and `c_prev` in the `c` buffer; `dc` `[N, H]` is updated in place
/// from `dc_t` to `dc_{t-1}`, `dgates` `[N, 4H]` receives the pre-activation gradients.
#[derive(Debug, Clone, Copy)]
pub struct LstmBackwardStep {
    pub n: usize,
    pub hidden: usize,
    pub dh_out: usize,
    pub dh_rec: Option<usize>,
    pub gates: usize,
    pub c: usize,
    pub c_prev: usize,
    pub dc: usize,
    pub dgates: usize,
}

/// An error unless `[off, off + len)` lies in a storage of `have` elements.
fn fits(what: &str, off: usize, len: usize, have: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|end| end > have) {
        return Err(Error::invalid(
            OP,
            format!("internal: {what} rows [{off}, +{len}) exceed a buffer of {have} elements"),
        ));
    }
    Ok(())
}

impl LstmForwardStep {
    /// Checks every row against its storage's length, and that `c_prev` precedes `c` and
    /// `h` and `c_copy` do not overlap (the kernels rely on both).
    pub(crate) fn check(&self, gi: usize, hh: usize, h: usize, c: usize, gates: usize) -> Result<()> {
        let (nh, n4h) = (self.n * self.hidden, self.n * self.hidden * 4);
        fits("gi", self.gi, n4h, gi)?;
        fits("hh", self.hh, n4h, hh)?;
        fits("c_prev", self.c_prev, nh, c)?;
        fits("c", self.c, nh, c)?;
        fits("h", self.h, nh, h)?;
        fits("gates", self.gates, n4h, gates)?;
        if self.c_prev + nh > self.c {
            return Err(Error::invalid(OP, "internal: c_prev must precede c"));
        }
        if let Some(cc) = self.c_copy {
            fits("c_copy", cc, nh, h)?;
            if cc < self.h + nh && self.h < cc + nh {
                return Err(Error::invalid(OP, "internal: h and its c copy overlap"));
            }
        }
        Ok(())
    }
}

impl LstmBackwardStep {
    pub(crate) fn check(
        &self,
        dh_out: usize,
        dh_rec: Option<usize>,
        gates: usize,
        c: usize,
        dc: usize,
        dgates: usize,
    ) -> Result<()> {
        let (nh, n4h) = (self.n * self.hidden, self.n * self.hidden * 4);
        fits("dh_out", self.dh_out, nh, dh_out)?;
        match (self.dh_rec, dh_rec) {
            (Some(off), Some(len)) => fits("dh_rec", off, nh, len)?,
            (None, None) => {}
            _ => return Err(Error::invalid(OP, "internal: dh_rec offset without storage")),
        }
        fits("gates", self.gates, n4h, gates)?;
        fits("c", self.c, nh, c)?;
        fits("c_prev", self.c_prev, nh, c)?;
        fits("dc", self.dc, nh, dc)?;
        fits("dgates", self.dgates, n4h, dgates)
    }
}
