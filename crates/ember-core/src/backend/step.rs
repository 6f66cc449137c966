//! Step descriptions of the fused families, whose kernels update buffers in place: one time
//! step of the fused LSTM recurrence ([`LstmForwardStep`], [`LstmBackwardStep`]; Note [Fused
//! LSTM recurrence] in `ops/rnn.rs`), the fused optimizer steps ([`AdamStep`] and
//! [`SgdStep`] over lists of [`AdamTensor`] / [`SgdTensor`]; `ops/fused_optim.rs`), and
//! GradScaler's unscale and scale update ([`UnscaleGrads`], [`ScaleUpdate`];
//! `ops/amp_scaling.rs`).
//!
//! The optimizer and GradScaler families are multi-tensor: one call runs over lists of
//! storages that the op layer has locked. Each operand is an [`Elems`]: a storage (`&S` when
//! read, `&mut S` when written) and the run of row-major elements of one tensor in it. The
//! descriptions are generic over the storage type `S`: the op layer builds them over the
//! `Storage` enum, and `storage/families.rs` casts them to one backend's storage ([`Variant`]) and
//! checks them (`check`: every run inside its storage, dtypes, flags that agree with their
//! operands) before the backend's kernels see them. GradScaler's grad scale, inverse scale and
//! found-inf flag, the growth tracker and Adam's device step counts are operands like the
//! others: one-element runs that the kernels read and write where they live, so that no backend
//! reads them back to the host (Note [AMP scalars live on the device] in `ops/amp_scaling.rs`).
//! A gradient of an Adam step may still be arriving, written block by block by another stream:
//! its blocks are [`Arrival`]s, whose event is the backend's own ([`Arrives`]).

use std::ops::Range;

use super::BackendStorage;
use crate::{DType, Device, Error, Result};

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

// Multi-tensor operands ---------------------------------------------------------------------------

/// The `len` row-major elements from element `offset` of a storage `storage` (`&S` read, `&mut
/// S` written): one tensor operand of a multi-tensor step. In [`UnscaleGrads`] `storage` is
/// an index into a list of storages instead.
#[derive(Debug)]
pub struct Elems<S> {
    pub storage: S,
    pub offset: usize,
    pub len: usize,
}

/// A storage enum one of whose variants holds a `B` (`storage/mod.rs` implements it for `Storage`
/// once per backend storage): how step operands are cast to one backend.
pub trait Variant<B>: Arrives {
    /// The `B` inside, or the device of the storage when it holds another backend's.
    fn variant(&self) -> std::result::Result<&B, Device>;
    /// As [`Variant::variant`], writable.
    fn variant_mut(&mut self) -> std::result::Result<&mut B, Device>;
    /// The event of an arriving block ([`Arrival`]) as `B`'s, or the device it belongs to when
    /// it is another backend's.
    fn variant_event(event: &Self::Event) -> std::result::Result<&B::Event, Device>
    where
        B: Arrives;
}

/// A storage whose tensors can arrive in row blocks: the event that marks one block written
/// ([`Arrival`]). Each backend's storage names its own (the CUDA backend's event; the CPU's is
/// [`std::convert::Infallible`], its tensors never arrive in blocks), and the `Storage` enum
/// that of the one backend whose tensors do.
pub trait Arrives {
    type Event: std::fmt::Debug;
}

/// One block of a tensor arriving in row blocks (Note [Arrivals in row blocks] in
/// `storage/row_blocks.rs`): a range of the tensor's elements, written once `event` completes,
/// and the block's place in the order arrivals were handed on. `E` is the event itself where
/// the storage's state hands the blocks over (`take_arriving_elements`), a reference to it in
/// a step's operands ([`AdamTensor::arrivals`]).
#[derive(Debug, Clone)]
pub struct Arrival<E> {
    pub elements: Range<usize>,
    pub event: E,
    pub order: u64,
}

impl<E> Arrival<E> {
    /// The same block, its event borrowed.
    pub fn as_ref(&self) -> Arrival<&E> {
        Arrival {
            elements: self.elements.clone(),
            event: &self.event,
            order: self.order,
        }
    }
}

/// The result of a cast: the operands on backend `B`, or the device of one that is not.
type Cast<T> = std::result::Result<T, Device>;

impl<'a, S> Elems<&'a S> {
    pub(crate) fn cast<B>(self) -> Cast<Elems<&'a B>>
    where
        S: Variant<B>,
    {
        Ok(Elems {
            storage: self.storage.variant()?,
            offset: self.offset,
            len: self.len,
        })
    }
}

impl<'a, S> Elems<&'a mut S> {
    pub(crate) fn cast<B>(self) -> Cast<Elems<&'a mut B>>
    where
        S: Variant<B>,
    {
        Ok(Elems {
            storage: self.storage.variant_mut()?,
            offset: self.offset,
            len: self.len,
        })
    }
}

/// An error unless the run of `len` elements from `offset` lies in `storage` and (when given)
/// the storage is of `dtype`; `what` names the operand of `op`.
fn check_run<B: BackendStorage>(
    op: &'static str,
    what: &str,
    storage: &B,
    offset: usize,
    len: usize,
    dtype: Option<DType>,
) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > storage.len()) {
        return Err(Error::invalid(
            op,
            format!(
                "internal: {what} elements [{offset}, +{len}) exceed a storage of {} elements",
                storage.len()
            ),
        ));
    }
    match dtype {
        Some(d) if storage.dtype() != d => Err(Error::invalid(
            op,
            format!("internal: {what} is {}, expected {d}", storage.dtype()),
        )),
        _ => Ok(()),
    }
}

impl<B: BackendStorage> Elems<&B> {
    fn check(&self, op: &'static str, what: &str, dtype: DType, len: usize) -> Result<()> {
        check_len(op, what, self.len, len)?;
        check_run(op, what, self.storage, self.offset, self.len, Some(dtype))
    }
}

impl<B: BackendStorage> Elems<&mut B> {
    fn check(&self, op: &'static str, what: &str, dtype: DType, len: usize) -> Result<()> {
        check_len(op, what, self.len, len)?;
        check_run(op, what, &*self.storage, self.offset, self.len, Some(dtype))
    }
}

fn check_len(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have != want {
        return Err(Error::invalid(
            op,
            format!("internal: {what} has {have} elements, expected {want}"),
        ));
    }
    Ok(())
}

/// The gradient of one tensor of a fused step: read as is, or, under a grad scale, divided by
/// it with the quotient written back.
#[derive(Debug)]
pub enum GradElems<'a, S> {
    Read(Elems<&'a S>),
    Unscaled(Elems<&'a mut S>),
}

impl<'a, S> GradElems<'a, S> {
    fn cast<B>(self) -> Cast<GradElems<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(match self {
            GradElems::Read(e) => GradElems::Read(e.cast()?),
            GradElems::Unscaled(e) => GradElems::Unscaled(e.cast()?),
        })
    }
}

impl<B: BackendStorage> GradElems<'_, B> {
    fn check(&self, op: &'static str, dtype: DType, len: usize, scaled: bool) -> Result<()> {
        match self {
            GradElems::Read(e) if !scaled => e.check(op, "gradient", dtype, len),
            GradElems::Unscaled(e) if scaled => e.check(op, "gradient", dtype, len),
            _ => Err(Error::invalid(
                op,
                "internal: a gradient is written exactly when there is a grad scale",
            )),
        }
    }
}

/// The scalars of a fused step that live on the device and are read there, so that the host
/// never waits for them and a captured step reads their current values at every replay:
/// GradScaler's `grad_scale` and `found_inf` (PyTorch's `grad_scale=` and `found_inf=` of
/// `_fused_adam_` / `_fused_sgd_`), one-element f32 operands, and the learning rate `lr`
/// (PyTorch's tensor `lr=`), a one-element f64 operand. With `grad_scale` each gradient is
/// divided by it (and written back); a nonzero `found_inf` makes the step write nothing; `lr`
/// replaces the step's `lr` field.
#[derive(Debug)]
pub struct StepScalars<'a, S> {
    pub grad_scale: Option<Elems<&'a S>>,
    pub found_inf: Option<Elems<&'a S>>,
    pub lr: Option<Elems<&'a S>>,
}

impl<'a, S> StepScalars<'a, S> {
    pub(crate) fn cast<B>(self) -> Cast<StepScalars<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(StepScalars {
            grad_scale: self.grad_scale.map(|e| e.cast()).transpose()?,
            found_inf: self.found_inf.map(|e| e.cast()).transpose()?,
            lr: self.lr.map(|e| e.cast()).transpose()?,
        })
    }
}

impl<B: BackendStorage> StepScalars<'_, B> {
    fn check(&self, op: &'static str) -> Result<()> {
        if let Some(s) = &self.grad_scale {
            s.check(op, "grad_scale", DType::F32, 1)?;
        }
        if let Some(f) = &self.found_inf {
            f.check(op, "found_inf", DType::F32, 1)?;
        }
        if let Some(l) = &self.lr {
            l.check(op, "lr", DType::F64, 1)?;
        }
        Ok(())
    }
}

// Fused optimizer steps ---------------------------------------------------------------------------

/// The hyperparameters of one fused Adam/AdamW step (`torch.optim.Adam` / `AdamW` arguments;
/// [`crate::fused::adam_`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment average.
    pub beta1: f64,
    /// Decay rate of the second moment average.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// L2 penalty (Adam) or decoupled decay rate (AdamW).
    pub weight_decay: f64,
    /// Use the running maximum of the second moments (`max_exp_avg_sqs` must be given).
    pub amsgrad: bool,
    /// Maximize the objective.
    pub maximize: bool,
    /// AdamW: `p *= 1 - lr * weight_decay` instead of adding `weight_decay * p` to the gradient.
    pub decoupled_weight_decay: bool,
}

/// The step count of one parameter of an Adam step.
#[derive(Debug)]
pub enum StepCount<'a, S> {
    /// The count *after* this step, known on the host, which computes the bias corrections.
    Host(f64),
    /// A one-element f32 operand holding the count *before* this step: the step adds 1 to it
    /// (unless `found_inf` is set) and computes the bias corrections from it where it lives.
    Device(Elems<&'a mut S>),
}

/// The operands of one parameter of an Adam step: parameter, gradient and state runs of equal
/// length (`max_exp_avg_sq` exactly with amsgrad) and the step count; every step count of one
/// call is of one kind.
#[derive(Debug)]
pub struct AdamTensor<'a, S: Arrives> {
    pub param: Elems<&'a mut S>,
    pub grad: GradElems<'a, S>,
    pub exp_avg: Elems<&'a mut S>,
    pub exp_avg_sq: Elems<&'a mut S>,
    pub max_exp_avg_sq: Option<Elems<&'a mut S>>,
    pub step: StepCount<'a, S>,
    /// Room for the parameter's bf16 twin (Note [Cast twins] in `storage/mod.rs`), which a
    /// backend that can writes beside the updated parameter (never with `max_exp_avg_sq`).
    pub twin: Option<Elems<&'a mut S>>,
    /// Ranges of the run whose gradient is written once an event completes, tiling the run
    /// (Note [Arrivals in row blocks] in `storage/row_blocks.rs`): each range is updated after
    /// its event. Empty: the gradient is complete. GPU operands only.
    pub arrivals: Vec<Arrival<&'a S::Event>>,
}

impl<'a, S: Arrives> AdamTensor<'a, S> {
    pub(crate) fn cast<B: Arrives>(self) -> Cast<AdamTensor<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(AdamTensor {
            param: self.param.cast()?,
            grad: self.grad.cast()?,
            exp_avg: self.exp_avg.cast()?,
            exp_avg_sq: self.exp_avg_sq.cast()?,
            max_exp_avg_sq: self.max_exp_avg_sq.map(|e| e.cast()).transpose()?,
            step: match self.step {
                StepCount::Host(n) => StepCount::Host(n),
                StepCount::Device(e) => StepCount::Device(e.cast()?),
            },
            twin: self.twin.map(|e| e.cast()).transpose()?,
            arrivals: self
                .arrivals
                .into_iter()
                .map(|a| {
                    Ok(Arrival {
                        elements: a.elements,
                        event: S::variant_event(a.event)?,
                        order: a.order,
                    })
                })
                .collect::<Cast<_>>()?,
        })
    }
}

impl AdamStep {
    /// The step size `lr / bias_correction1` and `sqrt(bias_correction2)` at step count `step`,
    /// in f64 as `_single_tensor_adam` computes them.
    pub(crate) fn bias_corrections(&self, step: f64) -> [f64; 2] {
        let [bias_correction1, bias_correction2_sqrt] = self.bias_correction_terms(step);
        [self.lr / bias_correction1, bias_correction2_sqrt]
    }

    /// `bias_correction1` and `sqrt(bias_correction2)` at step count `step`, in f64: what the
    /// CUDA kernel takes for host step counts, dividing the lr it reads by the first itself
    /// (the same f64 division as [`AdamStep::bias_corrections`], so the same bits).
    pub(crate) fn bias_correction_terms(&self, step: f64) -> [f64; 2] {
        let bias_correction1 = 1.0 - self.beta1.powf(step);
        let bias_correction2 = 1.0 - self.beta2.powf(step);
        [bias_correction1, bias_correction2.sqrt()]
    }

    /// Checks the operands of a call (one floating dtype, equal lengths inside their storages,
    /// the state that the flags need, one kind of step count); the kernels rely on all of it.
    pub(crate) fn check<B: BackendStorage>(
        &self,
        tensors: &[AdamTensor<'_, B>],
        amp: &StepScalars<'_, B>,
    ) -> Result<()> {
        const OP: &str = "adam_";
        amp.check(OP)?;
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let dtype = first.param.storage.dtype();
        let device_steps = matches!(first.step, StepCount::Device(_));
        if !dtype.is_floating_point() {
            return Err(Error::invalid(OP, format!("internal: parameters of {dtype}")));
        }
        for t in tensors {
            let n = t.param.len;
            t.param.check(OP, "parameter", dtype, n)?;
            t.grad.check(OP, dtype, n, amp.grad_scale.is_some())?;
            t.exp_avg.check(OP, "exp_avg", dtype, n)?;
            t.exp_avg_sq.check(OP, "exp_avg_sq", dtype, n)?;
            match &t.max_exp_avg_sq {
                Some(x) if self.amsgrad => x.check(OP, "max_exp_avg_sq", dtype, n)?,
                None if !self.amsgrad => {}
                _ => {
                    return Err(Error::invalid(
                        OP,
                        "internal: max_exp_avg_sq exactly with amsgrad",
                    ))
                }
            }
            match &t.step {
                StepCount::Host(_) if !device_steps => {}
                StepCount::Device(c) if device_steps => c.check(OP, "step count", DType::F32, 1)?,
                _ => return Err(Error::invalid(OP, "internal: step counts of two kinds")),
            }
        }
        if !device_steps && amp.found_inf.is_some() {
            return Err(Error::invalid(OP, "internal: found_inf with host step counts"));
        }
        Ok(())
    }
}

/// The hyperparameters of one fused SGD step (`torch.optim.SGD` arguments;
/// [`crate::fused::sgd_`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 disables the momentum buffers (then none need be given).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the buffer.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Maximize the objective.
    pub maximize: bool,
    /// The buffers are new: they are set to the (decayed) gradient instead of updated, as
    /// PyTorch does when a parameter has no `momentum_buffer` yet. Their old contents are
    /// never read, so `Tensor::empty_like`-style buffers are fine.
    pub first_step: bool,
}

/// The operands of one parameter of an SGD step: parameter, gradient and (exactly when
/// `momentum != 0`) momentum buffer runs of equal length.
#[derive(Debug)]
pub struct SgdTensor<'a, S> {
    pub param: Elems<&'a mut S>,
    pub grad: GradElems<'a, S>,
    pub momentum_buffer: Option<Elems<&'a mut S>>,
}

impl<'a, S> SgdTensor<'a, S> {
    pub(crate) fn cast<B>(self) -> Cast<SgdTensor<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(SgdTensor {
            param: self.param.cast()?,
            grad: self.grad.cast()?,
            momentum_buffer: self.momentum_buffer.map(|e| e.cast()).transpose()?,
        })
    }
}

impl SgdStep {
    /// Checks the operands of a call as [`AdamStep::check`] does.
    pub(crate) fn check<B: BackendStorage>(
        &self,
        tensors: &[SgdTensor<'_, B>],
        amp: &StepScalars<'_, B>,
    ) -> Result<()> {
        const OP: &str = "sgd_";
        amp.check(OP)?;
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let dtype = first.param.storage.dtype();
        if !dtype.is_floating_point() {
            return Err(Error::invalid(OP, format!("internal: parameters of {dtype}")));
        }
        let momentum = self.momentum != 0.0;
        for t in tensors {
            let n = t.param.len;
            t.param.check(OP, "parameter", dtype, n)?;
            t.grad.check(OP, dtype, n, amp.grad_scale.is_some())?;
            match &t.momentum_buffer {
                Some(b) if momentum => b.check(OP, "momentum_buffer", dtype, n)?,
                None if !momentum => {}
                _ => {
                    return Err(Error::invalid(
                        OP,
                        "internal: momentum buffers exactly with momentum",
                    ))
                }
            }
        }
        Ok(())
    }
}

// Foreach copies ---------------------------------------------------------------------------------

/// `_foreach_copy_`'s plain list on one device (Note [Foreach copies] in `ops/foreach.rs`):
/// the distinct storages written and read, and each copy as a run of `written[dst.storage]`
/// and a run of the same length of `read[src.storage]`, of one dtype or of two that
/// `foreach_copy_casts` takes (f32, bf16, f16, converted as `copy_` converts). No two written
/// runs overlap and no storage is both written and read (the op layer checks both; `check` the
/// rest).
#[derive(Debug)]
pub struct ForeachCopy<'a, S> {
    pub written: Vec<&'a mut S>,
    pub read: Vec<&'a S>,
    /// `(destination, source)` runs.
    pub copies: Vec<(Elems<usize>, Elems<usize>)>,
}

/// Whether a copy from `src` to `dst` elements belongs in a [`ForeachCopy`]: equal dtypes
/// (a byte copy), or both of f32, bf16 and f16 (the casts of mixed precision: f32 master
/// weights into a bf16 all-gather input, and back).
pub(crate) fn foreach_copy_casts(dst: DType, src: DType) -> bool {
    const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
    dst == src || (FLOATS.contains(&dst) && FLOATS.contains(&src))
}

impl<'a, S> ForeachCopy<'a, S> {
    pub(crate) fn cast<B>(self) -> Cast<ForeachCopy<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(ForeachCopy {
            written: self
                .written
                .into_iter()
                .map(Variant::variant_mut)
                .collect::<Cast<_>>()?,
            read: self.read.into_iter().map(Variant::variant).collect::<Cast<_>>()?,
            copies: self.copies,
        })
    }
}

impl<B: BackendStorage> ForeachCopy<'_, B> {
    /// Every run inside its storage, the two runs of a copy of one length, their dtypes equal
    /// or a pair `foreach_copy_casts` takes.
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid("_foreach_copy_", what));
        for (d, s) in &self.copies {
            let (Some(dst), Some(src)) = (self.written.get(d.storage), self.read.get(s.storage)) else {
                return bad(format!(
                    "a copy names storage {} or {} of a shorter list",
                    d.storage, s.storage
                ));
            };
            if d.len != s.len {
                return bad("a copy's runs differ in length".into());
            }
            if !foreach_copy_casts(dst.dtype(), src.dtype()) {
                return bad(format!(
                    "internal: a copy from {} to {} in one list",
                    src.dtype(),
                    dst.dtype()
                ));
            }
            if d.offset + d.len > dst.len() || s.offset + s.len > src.len() {
                return bad("a copy's run lies outside its storage".into());
            }
        }
        Ok(())
    }
}

// GradScaler ------------------------------------------------------------------------------------

/// The tensors of `torch._foreach_norm`: the distinct storages they live in, read, and each
/// tensor's run, whose `storage` is an index into `storages`; all of one floating dtype. The
/// norm is of order 2, or infinity (the largest |x|) with `inf_norm`.
#[derive(Debug)]
pub struct ForeachNorm<'a, S> {
    pub storages: Vec<&'a S>,
    pub tensors: Vec<Elems<usize>>,
    pub inf_norm: bool,
}

impl<'a, S> ForeachNorm<'a, S> {
    pub(crate) fn cast<B>(self) -> Cast<ForeachNorm<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(ForeachNorm {
            storages: self
                .storages
                .into_iter()
                .map(Variant::variant)
                .collect::<Cast<_>>()?,
            tensors: self.tensors,
            inf_norm: self.inf_norm,
        })
    }
}

/// The gradients of GradScaler's unscale (`torch._amp_foreach_non_finite_check_and_unscale_`):
/// the distinct storages they live in, written, and each gradient's run, whose `storage` is
/// an index into `storages` (several gradients may be views of one buffer; no two runs
/// overlap). The gradients are of any floating dtypes, mixed, and none is empty.
#[derive(Debug)]
pub struct UnscaleGrads<'a, S> {
    pub storages: Vec<&'a mut S>,
    pub grads: Vec<Elems<usize>>,
}

impl<'a, S> UnscaleGrads<'a, S> {
    pub(crate) fn cast<B>(self) -> Cast<UnscaleGrads<'a, B>>
    where
        S: Variant<B>,
    {
        Ok(UnscaleGrads {
            storages: self
                .storages
                .into_iter()
                .map(Variant::variant_mut)
                .collect::<Cast<_>>()?,
            grads: self.grads,
        })
    }
}

impl<B: BackendStorage> UnscaleGrads<'_, B> {
    /// Checks every run against its storage, and the two scalars.
    pub(crate) fn check(&self, found_inf: &Elems<&mut B>, inv_scale: &Elems<&B>) -> Result<()> {
        const OP: &str = "non_finite_check_and_unscale_";
        found_inf.check(OP, "found_inf", DType::F32, 1)?;
        inv_scale.check(OP, "inv_scale", DType::F32, 1)?;
        for g in &self.grads {
            let Some(s) = self.storages.get(g.storage) else {
                return Err(Error::invalid(OP, "internal: a gradient names no storage"));
            };
            if !s.dtype().is_floating_point() || g.len == 0 {
                return Err(Error::invalid(
                    OP,
                    "internal: gradients are floating and not empty",
                ));
            }
            check_run(OP, "gradient", &**s, g.offset, g.len, None)?;
        }
        Ok(())
    }
}

impl<B: BackendStorage> ForeachNorm<'_, B> {
    /// Checks every run against its storage (one floating dtype for all), and `norms`.
    pub(crate) fn check(&self, norms: &Elems<&mut B>) -> Result<()> {
        const OP: &str = "_foreach_norm";
        norms.check(OP, "norms", DType::F32, self.tensors.len())?;
        let dtype = self.storages.first().map(|s| s.dtype());
        for r in &self.tensors {
            let Some(s) = self.storages.get(r.storage) else {
                return Err(Error::invalid(OP, "internal: a tensor names no storage"));
            };
            if !s.dtype().is_floating_point() || Some(s.dtype()) != dtype {
                return Err(Error::invalid(
                    OP,
                    "internal: the tensors are of one floating dtype",
                ));
            }
            check_run(OP, "tensor", &**s, r.offset, r.len, None)?;
        }
        Ok(())
    }
}

/// The rule of GradScaler's scale update (`torch._amp_update_scale_`; `ops/amp_scaling.rs`):
/// the scale is multiplied by `backoff_factor` after a step with infs, and by `growth_factor`
/// after `growth_interval` clean steps in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleUpdate {
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i32,
}

impl ScaleUpdate {
    /// Checks the operands: one f32 scale, one i32 growth tracker, one f32 found-inf flag.
    pub(crate) fn check<B: BackendStorage>(
        &self,
        scale: &Elems<&mut B>,
        growth_tracker: &Elems<&mut B>,
        found_inf: &Elems<&B>,
    ) -> Result<()> {
        const OP: &str = "update_scale_";
        scale.check(OP, "scale", DType::F32, 1)?;
        growth_tracker.check(OP, "growth_tracker", DType::I32, 1)?;
        found_inf.check(OP, "found_inf", DType::F32, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuStorage;

    fn run(storage: &mut CpuStorage, offset: usize, len: usize) -> Elems<&mut CpuStorage> {
        Elems { storage, offset, len }
    }

    const ADAM: AdamStep = AdamStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: false,
    };

    fn tensor<'a>(
        p: &'a mut CpuStorage,
        g: &'a CpuStorage,
        m: &'a mut CpuStorage,
        v: &'a mut CpuStorage,
        len: usize,
        step: StepCount<'a, CpuStorage>,
    ) -> AdamTensor<'a, CpuStorage> {
        AdamTensor {
            param: run(p, 0, len),
            grad: GradElems::Read(Elems {
                storage: g,
                offset: 0,
                len,
            }),
            exp_avg: run(m, 0, len),
            exp_avg_sq: run(v, 0, len),
            max_exp_avg_sq: None,
            step,
            twin: None,
            arrivals: Vec::new(),
        }
    }

    #[test]
    fn adam_operands_are_checked_before_a_kernel_sees_them() {
        let no_amp = || StepScalars::<CpuStorage> {
            grad_scale: None,
            found_inf: None,
            lr: None,
        };
        let (mut p, g, mut m, mut v) = (
            CpuStorage::F32(vec![0.0; 4]),
            CpuStorage::F32(vec![0.0; 4]),
            CpuStorage::F32(vec![0.0; 4]),
            CpuStorage::F32(vec![0.0; 4]),
        );
        let mut count = CpuStorage::F32(vec![0.0]);
        let ok = [tensor(&mut p, &g, &mut m, &mut v, 4, StepCount::Host(1.0))];
        ADAM.check(&ok, &no_amp()).unwrap();
        let past_the_end = [tensor(&mut p, &g, &mut m, &mut v, 5, StepCount::Host(1.0))];
        assert!(ADAM.check(&past_the_end, &no_amp()).is_err());
        let device_count = [tensor(
            &mut p,
            &g,
            &mut m,
            &mut v,
            4,
            StepCount::Device(run(&mut count, 0, 1)),
        )];
        ADAM.check(&device_count, &no_amp()).unwrap();
        // A read gradient under a grad scale (the kernels would write through it).
        let scale = CpuStorage::F32(vec![2.0]);
        let scaled = StepScalars {
            grad_scale: Some(Elems {
                storage: &scale,
                offset: 0,
                len: 1,
            }),
            found_inf: None,
            lr: None,
        };
        assert!(ADAM.check(&device_count, &scaled).is_err());
        // A device lr must be one f64.
        let lr32 = CpuStorage::F32(vec![0.1]);
        let bad_lr = StepScalars {
            grad_scale: None,
            found_inf: None,
            lr: Some(Elems {
                storage: &lr32,
                offset: 0,
                len: 1,
            }),
        };
        assert!(ADAM.check(&device_count, &bad_lr).is_err());
    }
}
