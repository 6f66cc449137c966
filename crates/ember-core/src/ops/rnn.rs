//! Fused recurrences: [`lstm_recurrence`] runs a whole LSTM layer over a sequence as one
//! autograd node with a hand-written backward, the way cuDNN's RNN API does, instead of about
//! nine tensor ops (and nodes) per time step.
//!
//! Note [Fused LSTM recurrence]: the caller projects the input sequence once (`gi = x W_ihᵀ +
//! b_ih + b_hh`, `[T, N, 4H]`, gates `i, f, g, o`). Each forward step is then ONE GEMM
//! (`hh = h_{t-1} W_hhᵀ`, `W_hhᵀ` a view) and ONE pointwise kernel that adds `gi_t`, activates
//! the gates, and writes `c_t`, `h_t` and the activated gates straight into buffers allocated
//! once per sequence; the GEMM's output is the only per-step allocation. The buffers:
//! - `hbuf` `[T+2, N, H]`: `h0, h_1 .. h_T, c_T`. Rows `1..T+2` are the op's output (so one
//!   node covers the layer output, `h_n = out[T-1]` and `c_n = out[T]`), and rows `0..T` are
//!   the `h_{t-1}` of every step, contiguous, for the weight gradient;
//! - `cbuf` `[T+1, N, H]`: `c0, c_1 .. c_T`;
//! - `gates` `[T, N, 4H]`: the activated gates (what cuDNN and PyTorch save).
//!
//! Backward walks the steps in reverse with ONE pointwise kernel per step (pre-activation gate
//! gradients `dG_t` and `dc_{t-1}` from `dh_t` = the output's gradient plus the recurrent one,
//! and `dc_t`, kept in one in-place `[N, H]` buffer) and ONE GEMM (`dh_{t-1} = dG_t W_hh`). The
//! weight gradient is ONE GEMM after the loop: `dW_hh = dGᵀ H_prev` with `dG` `[T·N, 4H]` and
//! `H_prev` = `hbuf` rows `0..T`. `gi`'s gradient is `dG` itself.
//!
//! Both backends share this loop; only the pointwise steps are backend kernels
//! (`Storage::lstm_forward_step` and `Storage::lstm_backward_step`, whose step descriptions
//! live in `backend/step.rs`; kernels in `cpu/rnn.rs`, `cuda_backend/rnn.rs` + `kernels/rnn.cu`).

use super::binary::same_device;
use crate::autograd::{self, SavedTensor};
use crate::backend::step::{LstmBackwardStep, LstmForwardStep};
use crate::dispatch::{self, policy, Door};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};

const OP: &str = "lstm_recurrence";

/// Checks the operands of [`lstm_recurrence`]; returns `(T, N, H)`.
fn check(gi: &Tensor, w_hh: &Tensor, h0: &Tensor, c0: &Tensor) -> Result<(usize, usize, usize)> {
    same_device(OP, &[gi, w_hh, h0, c0])?;
    if !gi.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: gi.dtype(),
            hint: "the LSTM recurrence takes floating-point tensors; convert with .to_dtype(DType::F32)",
        });
    }
    for t in [w_hh, h0, c0] {
        if t.dtype() != gi.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                expected: gi.dtype(),
                found: t.dtype(),
            });
        }
    }
    if w_hh.rank() != 2 || w_hh.dims()[0] != 4 * w_hh.dims()[1] {
        return Err(Error::invalid(
            OP,
            format!(
                "w_hh must be [4·hidden_size, hidden_size] (gates i, f, g, o stacked), got shape {}",
                w_hh.shape()
            ),
        ));
    }
    let hidden = w_hh.dims()[1];
    if gi.rank() != 3 || gi.dims()[2] != 4 * hidden {
        return Err(Error::invalid(
            OP,
            format!(
                "gi must be [seq_len, batch, {}] (the projected input, 4·hidden_size gates, time-major), got shape {}",
                4 * hidden,
                gi.shape()
            ),
        ));
    }
    let (steps, n) = (gi.dims()[0], gi.dims()[1]);
    if steps == 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "expected a sequence of at least one step, got gi of shape {}",
                gi.shape()
            ),
        ));
    }
    for (name, t) in [("h0", h0), ("c0", c0)] {
        if t.dims() != [n, hidden] {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name} must be [batch, hidden_size] = [{n}, {hidden}], got shape {}",
                    t.shape()
                ),
            ));
        }
    }
    Ok((steps, n, hidden))
}

/// A new row-major tensor whose elements the caller writes in full before reading them
/// (uninitialized on a GPU, zeros on the CPU).
fn scratch(dims: [usize; 3], dtype: DType, device: Device, door: Door) -> Result<Tensor> {
    let storage = Storage::alloc(device, dtype, dims.iter().product())?;
    Ok(door.tensor(storage, dims))
}

/// The buffers a forward pass fills (see Note [Fused LSTM recurrence]).
struct Forward {
    hbuf: Tensor,
    cbuf: Tensor,
    gates: Tensor,
}

/// The forward loop (grad mode off).
fn forward(
    gi: &Tensor,
    w_hh: &Tensor,
    h0: &Tensor,
    c0: &Tensor,
    (steps, n, hidden): (usize, usize, usize),
    door: Door,
) -> Result<Forward> {
    let (dtype, device) = (gi.dtype(), gi.device());
    let gi = gi.contiguous()?;
    let hbuf = scratch([steps + 2, n, hidden], dtype, device, door)?;
    let cbuf = scratch([steps + 1, n, hidden], dtype, device, door)?;
    let gates = scratch([steps, n, 4 * hidden], dtype, device, door)?;
    hbuf.select(0, 0)?.copy_(h0)?;
    cbuf.select(0, 0)?.copy_(c0)?;
    let w_t = w_hh.t()?;
    let (nh, n4h) = (n * hidden, n * 4 * hidden);
    for t in 0..steps {
        let hh = hbuf.select(0, t as isize)?.matmul(&w_t)?;
        let step = LstmForwardStep {
            n,
            hidden,
            gi: gi.layout().offset() + t * n4h,
            hh: hh.layout().offset(),
            c_prev: t * nh,
            c: (t + 1) * nh,
            h: (t + 1) * nh,
            c_copy: (t + 1 == steps).then_some((steps + 1) * nh),
            gates: t * n4h,
        };
        let (gs, hs) = (gi.storage().read(), hh.storage().read());
        let (mut hb, mut cb, mut gb) = (
            hbuf.storage().write(),
            cbuf.storage().write(),
            gates.storage().write(),
        );
        Storage::lstm_forward_step(&step, &gs, &hs, &mut hb, &mut cb, &mut gb)?;
    }
    Ok(Forward { hbuf, cbuf, gates })
}

/// The saved buffers' backward: gradients of `gi`, `w_hh`, `h0`, `c0` (each only if `needs`).
fn backward(
    g: &Tensor,
    needs: &[bool],
    hbuf: &Tensor,
    cbuf: &Tensor,
    gates: &Tensor,
    w_hh: &Tensor,
    door: Door,
) -> Result<Vec<Option<Tensor>>> {
    let (steps, n, hidden) = (gates.dims()[0], gates.dims()[1], w_hh.dims()[1]);
    let (nh, n4h) = (n * hidden, n * 4 * hidden);
    same_device(OP, &[g, gates])?;
    let g = if g.dtype() == gates.dtype() {
        g.contiguous()?
    } else {
        g.to_dtype(gates.dtype())?.contiguous()?
    };
    let dgates = scratch([steps, n, 4 * hidden], gates.dtype(), gates.device(), door)?;
    // dc_T is the gradient of the output's last row; copied, since it is updated in place.
    let dc = g.select(0, steps as isize)?.deep_clone()?;
    let mut dh_rec: Option<Tensor> = None;
    for t in (0..steps).rev() {
        let step = LstmBackwardStep {
            n,
            hidden,
            dh_out: g.layout().offset() + t * nh,
            dh_rec: dh_rec.as_ref().map(|d| d.layout().offset()),
            gates: t * n4h,
            c: (t + 1) * nh,
            c_prev: t * nh,
            dc: dc.layout().offset(),
            dgates: t * n4h,
        };
        {
            let (gs, ga, cb) = (g.storage().read(), gates.storage().read(), cbuf.storage().read());
            let rec = dh_rec.as_ref().map(|d| d.storage().read());
            let (mut dcs, mut dgs) = (dc.storage().write(), dgates.storage().write());
            Storage::lstm_backward_step(&step, &gs, rec.as_deref(), &ga, &cb, &mut dcs, &mut dgs)?;
        }
        // dh_{t-1} = dG_t W_hh: the recurrent gradient of the step before, or h0's.
        dh_rec = if t > 0 || needs[2] {
            Some(dgates.select(0, t as isize)?.matmul(w_hh)?)
        } else {
            None
        };
    }
    let d_w = if needs[1] {
        let dg = dgates.reshape(&[(steps * n) as isize, (4 * hidden) as isize])?;
        let h_prev = hbuf
            .narrow(0, 0, steps)?
            .reshape(&[(steps * n) as isize, hidden as isize])?;
        Some(dg.t()?.matmul(&h_prev)?)
    } else {
        None
    };
    Ok(vec![
        needs[0].then_some(dgates),
        d_w,
        if needs[2] { dh_rec } else { None },
        needs[3].then_some(dc),
    ])
}

/// A whole LSTM layer's recurrence over a sequence, fused (see Note [Fused LSTM recurrence]).
///
/// `gi` `[T, N, 4H]` is the projected input `x W_ihᵀ + b_ih + b_hh` with the gates `i, f, g, o`
/// stacked as in PyTorch's weights, time-major; `w_hh` `[4H, H]`; `h0` and `c0` `[N, H]`. Per
/// step: `a = gi_t + h_{t-1} W_hhᵀ`, `c_t = σ(a_f) c_{t-1} + σ(a_i) tanh(a_g)`,
/// `h_t = σ(a_o) tanh(c_t)`. Returns ONE tensor `[T+1, N, H]`: rows `0..T` are `h_1 .. h_T` (the
/// layer's output) and row `T` is `c_T`, so `h_n = out[T-1]` and `c_n = out[T]`. Differentiable
/// with respect to all four inputs. All four share one float dtype and one device; `T >= 1`.
///
/// ```
/// use ember_core::{ops::rnn::lstm_recurrence, DType, Device, Tensor};
/// let (t, n, h) = (3, 2, 4);
/// let gi = Tensor::zeros([t, n, 4 * h], DType::F32, Device::Cpu)?;
/// let w = Tensor::zeros([4 * h, h], DType::F32, Device::Cpu)?;
/// let h0 = Tensor::zeros([n, h], DType::F32, Device::Cpu)?;
/// let c0 = Tensor::ones([n, h], DType::F32, Device::Cpu)?;
/// let out = lstm_recurrence(&gi, &w, &h0, &c0)?;
/// assert_eq!(out.dims(), &[t + 1, n, h]);
/// // All gates σ(0) = 0.5, tanh(0) = 0: c halves every step.
/// assert_eq!(out.select(0, t as isize)?.to_vec::<f32>()?, vec![0.125; n * h]);
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn lstm_recurrence(gi: &Tensor, w_hh: &Tensor, h0: &Tensor, c0: &Tensor) -> Result<Tensor> {
    dispatch::composite_kernel(
        &policy::LSTM_RECURRENCE,
        [gi, w_hh, h0, c0],
        |[gi, w_hh, h0, c0], door| lstm_recurrence_prepared(gi, w_hh, h0, c0, door),
    )
}

fn lstm_recurrence_prepared(
    gi: &Tensor,
    w_hh: &Tensor,
    h0: &Tensor,
    c0: &Tensor,
    door: Door,
) -> Result<Tensor> {
    let dims = check(gi, w_hh, h0, c0)?;
    let steps = dims.0;
    let fwd = {
        let _g = autograd::no_grad();
        forward(gi, w_hh, h0, c0, dims, door)?
    };
    let out = fwd.hbuf.narrow(0, 1, steps + 1)?;
    if !autograd::needs_grad(&[gi, w_hh, h0, c0]) {
        return Ok(out);
    }
    let saved = [
        SavedTensor::new(OP, &fwd.hbuf),
        SavedTensor::new(OP, &fwd.cbuf),
        SavedTensor::new(OP, &fwd.gates),
        SavedTensor::new(OP, w_hh),
    ];
    Ok(door.record(OP, &[gi, w_hh, h0, c0], out, move |g, needs| {
        let [hbuf, cbuf, gates, w] = [&saved[0], &saved[1], &saved[2], &saved[3]];
        backward(g, needs, hbuf.get()?, cbuf.get()?, gates.get()?, w.get()?, door)
    }))
}
