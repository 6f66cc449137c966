//! Step descriptions of the fused families, whose kernels update buffers in place: one time
//! step of the fused LSTM recurrence ([`LstmForwardStep`], [`LstmBackwardStep`]; Note [Fused
//! LSTM recurrence] in `ops/rnn.rs`) and one fused optimizer step ([`OptimKernel`] with one
//! [`OptimOperands`] per parameter; Note [Fused step preconditions] in `ops/fused_optim.rs`).

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

/// One parameter of a fused optimizer step, as the backends see it: its storage and those of
/// its gradient and state tensors (locked by the caller for the whole step; the written ones
/// mutably), the storage offset of each tensor's first element, its element count (all of
/// them contiguous, of one dtype, on one device), and its per-tensor scalars (Adam: step size
/// and `sqrt(bias_correction2)`).
#[derive(Debug)]
pub struct OptimOperands<'a, S> {
    pub param: &'a mut S,
    pub grad: &'a S,
    /// The state tensors in the kernel's order, `None` where the step has none: Adam
    /// `exp_avg, exp_avg_sq, max_exp_avg_sq` (the last with amsgrad only), SGD
    /// `momentum_buffer` (with momentum only).
    pub state: [Option<&'a mut S>; 3],
    /// Storage offsets of `param, grad, state[0], state[1], state[2]` (0 where absent).
    pub offsets: [usize; 5],
    pub numel: usize,
    pub scalars: [f64; 2],
}

/// Which update, with the scalars every tensor shares (see the launch contract of
/// `kernels/optim.cu`). `flags` bits: Adam `1` amsgrad, `2` maximize, `4` decoupled weight decay
/// (AdamW); SGD `1` nesterov, `2` maximize, `4` first step.
#[derive(Debug, Clone, Copy)]
pub enum OptimKernel {
    Adam {
        lr: f64,
        one_minus_beta1: f64,
        beta2: f64,
        one_minus_beta2: f64,
        eps: f64,
        weight_decay: f64,
        decay: f64,
        flags: i32,
    },
    Sgd {
        lr: f64,
        momentum: f64,
        one_minus_dampening: f64,
        weight_decay: f64,
        flags: i32,
    },
}

impl OptimKernel {
    /// The name of the step, as errors report it (`adam_`, `sgd_`).
    pub fn name(&self) -> &'static str {
        match self {
            OptimKernel::Adam { .. } => "adam_",
            OptimKernel::Sgd { .. } => "sgd_",
        }
    }
}
