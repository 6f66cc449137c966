//! Recurrent layers as ops (ember-nn's `F::rnn`, `F::lstm`, ... and its `nn.RNN`/`nn.LSTM`/
//! `nn.GRU` layers call these, each entering the dispatch point under its PyTorch name): the
//! single-step cells (`rnn_tanh_cell`, `rnn_relu_cell`,
//! `lstm_cell`, `gru_cell`) and the multi-layer, unidirectional sequence forms (`rnn`, `lstm`,
//! `gru`) with PyTorch's weight layout, gate order and equations.
//!
//! Weights follow PyTorch's state dict: per layer `k`, `weight_ih_l{k}` `[G·H, in]`,
//! `weight_hh_l{k}` `[G·H, H]` and optionally `bias_ih_l{k}`, `bias_hh_l{k}` `[G·H]`, with the
//! `G` gates stacked in PyTorch's order: LSTM `i, f, g, o`, GRU `r, z, n`, plain RNN one.
//!
//! Note [Input projection]: the sequence forms project the whole input sequence of a layer
//! with ONE GEMM (`x @ W_ih^T + b`, `[T, N, in] -> [T, N, G·H]`) before the time loop, so each
//! step does only the recurrent `h @ W_hh^T` plus elementwise gate math; `W_hh^T` is a view
//! taken once per layer. For the LSTM and the plain RNN `b_hh` is folded into that bias (the
//! two biases are only ever added together); the GRU keeps `b_hn` inside `r * (W_hn h + b_hn)`.
//!
//! The LSTM then runs each layer's whole recurrence as one fused op with its own backward
//! (`ops/rnn.rs`'s `lstm_recurrence`, Note [Fused LSTM recurrence] there): per step one
//! GEMM and one pointwise kernel, instead of about nine ops and autograd nodes. It works
//! time-major, so a `batch_first` input is transposed once before the first layer and the
//! output transposed back (a view) after the last. `lstm_cell` is the same op over one step.
//! The plain RNN and the GRU still compose their steps from tensor ops: their step outputs are
//! stacked along the time dim once per layer, in the caller's layout, so `batch_first` costs
//! no transpose.

use super::dropout::dropout;
use super::rnn::lstm_recurrence;
use crate::dispatch::{self, policy, Op};
use crate::{Error, Result, Tensor};

/// The activation of a plain (Elman) RNN: `nn.RNN(nonlinearity='tanh' | 'relu')`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RnnNonlinearity {
    /// `tanh` (PyTorch's default).
    #[default]
    Tanh,
    /// `relu`.
    Relu,
}

impl RnnNonlinearity {
    /// Parses PyTorch's name: `"tanh"` or `"relu"`.
    pub fn parse(name: &str) -> Result<RnnNonlinearity> {
        match name {
            "tanh" => Ok(RnnNonlinearity::Tanh),
            "relu" => Ok(RnnNonlinearity::Relu),
            _ => Err(Error::invalid(
                "rnn",
                format!("unknown nonlinearity {name:?}; expected \"tanh\" or \"relu\""),
            )),
        }
    }

    fn apply(self, t: &Tensor) -> Result<Tensor> {
        match self {
            RnnNonlinearity::Tanh => t.tanh(),
            RnnNonlinearity::Relu => t.relu(),
        }
    }
}

/// Which recurrence a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Rnn(RnnNonlinearity),
    Lstm,
    Gru,
}

impl Kind {
    /// The op table's line of the sequence form.
    fn line(self) -> &'static Op {
        match self {
            Kind::Rnn(RnnNonlinearity::Tanh) => &policy::RNN_TANH,
            Kind::Rnn(RnnNonlinearity::Relu) => &policy::RNN_RELU,
            Kind::Lstm => &policy::LSTM,
            Kind::Gru => &policy::GRU,
        }
    }

    /// Gates stacked in the weights' first dim.
    fn gates(self) -> usize {
        match self {
            Kind::Rnn(_) => 1,
            Kind::Lstm => 4,
            Kind::Gru => 3,
        }
    }
}

// ---------------------------------------------------------------------------------------
// One time step, shared by the cells and the sequence forms. `gi` is the input projection
// (with whatever bias the caller folded in), `w_hh_t` is `W_hh^T`.

fn rnn_step(
    nl: RnnNonlinearity,
    gi: &Tensor,
    h: &Tensor,
    w_hh_t: &Tensor,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    let mut pre = gi.add(&h.matmul(w_hh_t)?)?;
    if let Some(b) = b_hh {
        pre = pre.add(b)?;
    }
    nl.apply(&pre)
}

/// `r, z, n` gates: `n = tanh(W_in x + b_in + r (W_hn h + b_hn))`, `h' = (1 - z) n + z h`.
fn gru_step(gi: &Tensor, h: &Tensor, w_hh_t: &Tensor, b_hh: Option<&Tensor>) -> Result<Tensor> {
    let mut gh = h.matmul(w_hh_t)?;
    if let Some(b) = b_hh {
        gh = gh.add(b)?;
    }
    let hidden = h.dims()[h.rank() - 1];
    let rz = gi
        .narrow(-1, 0, 2 * hidden)?
        .add(&gh.narrow(-1, 0, 2 * hidden)?)?
        .sigmoid()?;
    // Narrowed rather than chunked: two halves even for a hidden size of 0.
    let (r, z) = (&rz.narrow(-1, 0, hidden)?, &rz.narrow(-1, hidden, hidden)?);
    let n = gi
        .narrow(-1, 2 * hidden, hidden)?
        .add(&r.mul(&gh.narrow(-1, 2 * hidden, hidden)?)?)?
        .tanh()?;
    // (1 - z) n + z h, written as n + z (h - n): three kernels instead of four.
    n.add(&z.mul(&h.sub(&n)?)?)
}

// ---------------------------------------------------------------------------------------
// Argument checks.

fn check_float(op: &'static str, name: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if !t.dtype().is_floating_point() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            hint: "recurrent layers take floating-point inputs, states and weights",
        });
    }
    if t.dtype() != like.dtype() {
        return Err(Error::invalid(
            op,
            format!(
                "{name} has dtype {} but the input has dtype {}; convert with .to_dtype()",
                t.dtype(),
                like.dtype()
            ),
        ));
    }
    Ok(())
}

/// One layer's weights, checked against PyTorch's shapes.
struct LayerWeights<'a> {
    w_ih: &'a Tensor,
    w_hh: &'a Tensor,
    b_ih: Option<&'a Tensor>,
    b_hh: Option<&'a Tensor>,
}

/// Checks `w_ih` `[G·H, input_size]`, `w_hh` `[G·H, H]`, biases `[G·H]` (with `H` taken
/// from `w_hh`, or `hidden` when given) and returns `H`.
fn check_weights(
    op: &'static str,
    kind: Kind,
    layer: usize,
    w: &LayerWeights,
    input_size: usize,
    hidden: Option<usize>,
    input: &Tensor,
) -> Result<usize> {
    let g = kind.gates();
    let name = |n: &str| format!("{n}_l{layer}");
    check_float(op, &name("weight_hh"), w.w_hh, input)?;
    check_float(op, &name("weight_ih"), w.w_ih, input)?;
    if w.w_hh.rank() != 2 || w.w_hh.dims()[0] != g * w.w_hh.dims()[1] {
        return Err(Error::invalid(
            op,
            format!(
                "{} must be [{g}·hidden_size, hidden_size] ({g} gate(s) stacked), got shape {}",
                name("weight_hh"),
                w.w_hh.shape()
            ),
        ));
    }
    let h = w.w_hh.dims()[1];
    if let Some(expected) = hidden {
        if h != expected {
            return Err(Error::invalid(
                op,
                format!(
                    "{} has hidden size {h} but layer 0 has {expected}, got shape {}",
                    name("weight_hh"),
                    w.w_hh.shape()
                ),
            ));
        }
    }
    if w.w_ih.dims() != [g * h, input_size] {
        return Err(Error::invalid(
            op,
            format!(
                "{} must be [{}, {input_size}] ([{g}·hidden_size, input features]), got shape {}",
                name("weight_ih"),
                g * h,
                w.w_ih.shape()
            ),
        ));
    }
    for (n, b) in [("bias_ih", w.b_ih), ("bias_hh", w.b_hh)] {
        if let Some(b) = b {
            check_float(op, &name(n), b, input)?;
            if b.dims() != [g * h] {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{} must be 1-D with {} elements, got shape {}",
                        name(n),
                        g * h,
                        b.shape()
                    ),
                ));
            }
        }
    }
    Ok(h)
}

/// Checks a cell's input (`[N, in]` or unbatched `[in]`) and weights; returns `H`.
fn check_cell(
    op: &'static str,
    kind: Kind,
    input: &Tensor,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<usize> {
    if input.rank() != 1 && input.rank() != 2 {
        return Err(Error::invalid(
            op,
            format!(
                "expected input to be 1-D [input_size] or 2-D [batch, input_size], got shape {}",
                input.shape()
            ),
        ));
    }
    check_float(op, "input", input, input)?;
    let w = LayerWeights {
        w_ih,
        w_hh,
        b_ih,
        b_hh,
    };
    check_weights(op, kind, 0, &w, input.dims()[input.rank() - 1], None, input)
}

/// A cell's state: `hx` batched like `input` (`[N, H]`, or `[H]` for an unbatched input), or
/// zeros when absent; returned as `[N, H]`.
fn cell_state(
    op: &'static str,
    name: &str,
    hx: Option<&Tensor>,
    input: &Tensor,
    hidden: usize,
) -> Result<Tensor> {
    let batched = input.rank() == 2;
    let n = if batched { input.dims()[0] } else { 1 };
    match hx {
        None => Tensor::zeros([n, hidden], input.dtype(), input.device()),
        Some(h) => {
            check_float(op, name, h, input)?;
            let expected: &[usize] = if batched { &[n, hidden] } else { &[hidden] };
            if h.dims() != expected {
                return Err(Error::invalid(
                    op,
                    format!(
                        "expected {name} of shape {expected:?} for an input of shape {}, got {}",
                        input.shape(),
                        h.shape()
                    ),
                ));
            }
            if batched {
                Ok(h.clone())
            } else {
                h.unsqueeze(0)
            }
        }
    }
}

/// `input` as `[N, in]` and a function undoing the batch dim added for an unbatched input.
fn batch_cell_input(input: &Tensor) -> Result<(Tensor, impl Fn(Tensor) -> Result<Tensor>)> {
    let batched = input.rank() == 2;
    let x = if batched {
        input.clone()
    } else {
        input.unsqueeze(0)?
    };
    Ok((x, move |t: Tensor| if batched { Ok(t) } else { t.squeeze_dim(0) }))
}

// ---------------------------------------------------------------------------------------
// Cells.

#[allow(clippy::too_many_arguments)]
fn rnn_cell(
    op: &'static str,
    nl: RnnNonlinearity,
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    let line = match nl {
        RnnNonlinearity::Tanh => &policy::RNN_TANH_CELL,
        RnnNonlinearity::Relu => &policy::RNN_RELU_CELL,
    };
    let inputs = [Some(input), hx, Some(w_ih), Some(w_hh), b_ih, b_hh];
    dispatch::composite_list(line, &inputs, |ins| {
        let [Some(input), hx, Some(w_ih), Some(w_hh), b_ih, b_hh] = ins else {
            unreachable!("the input and weights are always given")
        };
        rnn_cell_prepared(
            op,
            nl,
            input,
            hx.as_ref(),
            w_ih,
            w_hh,
            b_ih.as_ref(),
            b_hh.as_ref(),
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn rnn_cell_prepared(
    op: &'static str,
    nl: RnnNonlinearity,
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    let hidden = check_cell(op, Kind::Rnn(nl), input, w_ih, w_hh, b_ih, b_hh)?;
    let h = cell_state(op, "hx", hx, input, hidden)?;
    let (x, unbatch) = batch_cell_input(input)?;
    let gi = x.linear(w_ih, b_ih)?;
    unbatch(rnn_step(nl, &gi, &h, &w_hh.t()?, b_hh)?)
}

/// One step of an Elman RNN with tanh (`torch.rnn_tanh_cell`, `nn.RNNCell`):
/// `h' = tanh(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)`. `input` is `[N, in]` or unbatched `[in]`,
/// `hx` `[N, H]` (or `[H]`) or zeros when `None`; `w_ih` `[H, in]`, `w_hh` `[H, H]`.
pub fn rnn_tanh_cell(
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    rnn_cell(
        "rnn_tanh_cell",
        RnnNonlinearity::Tanh,
        input,
        hx,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
    )
}

/// [`rnn_tanh_cell`] with ReLU (`torch.rnn_relu_cell`, `nn.RNNCell(nonlinearity='relu')`).
pub fn rnn_relu_cell(
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    rnn_cell(
        "rnn_relu_cell",
        RnnNonlinearity::Relu,
        input,
        hx,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
    )
}

/// One LSTM step (`torch.lstm_cell`, `nn.LSTMCell`), returning `(h', c')`. The weights stack
/// the gates `i, f, g, o` (`w_ih` `[4H, in]`, `w_hh` `[4H, H]`):
/// `c' = σ(f) c + σ(i) tanh(g)`, `h' = σ(o) tanh(c')`. `hx` is `(h, c)`, each `[N, H]` (or
/// `[H]` for an unbatched `[in]` input), or zeros when `None`.
pub fn lstm_cell(
    input: &Tensor,
    hx: Option<(&Tensor, &Tensor)>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let inputs = [
        Some(input),
        hx.map(|s| s.0),
        hx.map(|s| s.1),
        Some(w_ih),
        Some(w_hh),
        b_ih,
        b_hh,
    ];
    dispatch::composite_list(&policy::LSTM_CELL, &inputs, |ins| {
        let [Some(input), h, c, Some(w_ih), Some(w_hh), b_ih, b_hh] = ins else {
            unreachable!("the input and weights are always given")
        };
        let hx = match (h, c) {
            (Some(h), Some(c)) => Some((h, c)),
            _ => None,
        };
        lstm_cell_prepared(input, hx, w_ih, w_hh, b_ih.as_ref(), b_hh.as_ref())
    })
}

fn lstm_cell_prepared(
    input: &Tensor,
    hx: Option<(&Tensor, &Tensor)>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "lstm_cell";
    let hidden = check_cell(OP, Kind::Lstm, input, w_ih, w_hh, b_ih, b_hh)?;
    let h = cell_state(OP, "hx", hx.map(|s| s.0), input, hidden)?;
    let c = cell_state(OP, "cx", hx.map(|s| s.1), input, hidden)?;
    let (x, unbatch) = batch_cell_input(input)?;
    let mut gi = x.linear(w_ih, b_ih)?;
    if let Some(b) = b_hh {
        gi = gi.add(b)?;
    }
    // The fused recurrence over one step: rows [h', c'].
    let out = lstm_recurrence(&gi.unsqueeze(0)?, w_hh, &h, &c)?;
    Ok((unbatch(out.select(0, 0)?)?, unbatch(out.select(0, 1)?)?))
}

/// One GRU step (`torch.gru_cell`, `nn.GRUCell`). The weights stack the gates `r, z, n`
/// (`w_ih` `[3H, in]`, `w_hh` `[3H, H]`): `r = σ(W_ir x + b_ir + W_hr h + b_hr)`, `z` alike,
/// `n = tanh(W_in x + b_in + r (W_hn h + b_hn))`, `h' = (1 - z) n + z h`. `hx` is `[N, H]` (or
/// `[H]`), zeros when `None`.
pub fn gru_cell(
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    let inputs = [Some(input), hx, Some(w_ih), Some(w_hh), b_ih, b_hh];
    dispatch::composite_list(&policy::GRU_CELL, &inputs, |ins| {
        let [Some(input), hx, Some(w_ih), Some(w_hh), b_ih, b_hh] = ins else {
            unreachable!("the input and weights are always given")
        };
        gru_cell_prepared(input, hx.as_ref(), w_ih, w_hh, b_ih.as_ref(), b_hh.as_ref())
    })
}

fn gru_cell_prepared(
    input: &Tensor,
    hx: Option<&Tensor>,
    w_ih: &Tensor,
    w_hh: &Tensor,
    b_ih: Option<&Tensor>,
    b_hh: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "gru_cell";
    let hidden = check_cell(OP, Kind::Gru, input, w_ih, w_hh, b_ih, b_hh)?;
    let h = cell_state(OP, "hx", hx, input, hidden)?;
    let (x, unbatch) = batch_cell_input(input)?;
    let gi = x.linear(w_ih, b_ih)?;
    unbatch(gru_step(&gi, &h, &w_hh.t()?, b_hh)?)
}

// ---------------------------------------------------------------------------------------
// Sequence forms.

/// The initial state `[num_layers, N, H]` (or `[num_layers, H]` unbatched, then given a batch
/// dim of 1), or zeros when absent.
#[allow(clippy::too_many_arguments)]
fn initial_state(
    op: &'static str,
    name: &str,
    state: Option<&Tensor>,
    input: &Tensor,
    batched: bool,
    num_layers: usize,
    batch: usize,
    hidden: usize,
) -> Result<Tensor> {
    match state {
        None => Tensor::zeros([num_layers, batch, hidden], input.dtype(), input.device()),
        Some(s) => {
            check_float(op, name, s, input)?;
            let expected: Vec<usize> = if batched {
                vec![num_layers, batch, hidden]
            } else {
                vec![num_layers, hidden]
            };
            if s.dims() != expected.as_slice() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "expected {name} of shape {expected:?} ([num_layers, batch, hidden_size]{}), got {}",
                        if batched {
                            ""
                        } else {
                            " without the batch dim for an unbatched input"
                        },
                        s.shape()
                    ),
                ));
            }
            if batched {
                Ok(s.clone())
            } else {
                s.unsqueeze(1)
            }
        }
    }
}

/// Runs `kind` over a sequence: the shared body of [`rnn`], [`lstm`] and [`gru`]. `states` are
/// the optional initial `h0` (and `c0` for the LSTM); returns the last layer's output and the
/// final states, each `[num_layers, N, H]` (batch dims removed again for an unbatched input).
#[allow(clippy::too_many_arguments)]
fn run_sequence(
    op: &'static str,
    kind: Kind,
    input: &Tensor,
    states: &[(&str, Option<&Tensor>)],
    weights: &[&[Tensor]],
    num_layers: usize,
    batch_first: bool,
    dropout_p: f64,
    training: bool,
) -> Result<(Tensor, Vec<Tensor>)> {
    // One op to the dispatch point (autocast casts the input, states and every weight once).
    let mut all: Vec<Option<&Tensor>> = vec![Some(input)];
    all.extend(states.iter().map(|(_, s)| *s));
    all.extend(weights.iter().flat_map(|l| l.iter().map(Some)));
    dispatch::composite_list(kind.line(), &all, |ins| {
        let [Some(input), rest @ ..] = ins else {
            unreachable!("the input is always given")
        };
        let (st, w) = rest.split_at(states.len());
        let states: Vec<(&str, Option<&Tensor>)> = states
            .iter()
            .zip(st)
            .map(|((n, _), t)| (*n, t.as_ref()))
            .collect();
        let flat: Vec<Tensor> = w.iter().flatten().cloned().collect();
        let mut layers: Vec<&[Tensor]> = Vec::with_capacity(weights.len());
        let mut at = 0;
        for l in weights {
            layers.push(&flat[at..at + l.len()]);
            at += l.len();
        }
        run_sequence_prepared(
            op,
            kind,
            input,
            &states,
            &layers,
            num_layers,
            batch_first,
            dropout_p,
            training,
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn run_sequence_prepared(
    op: &'static str,
    kind: Kind,
    input: &Tensor,
    states: &[(&str, Option<&Tensor>)],
    weights: &[&[Tensor]],
    num_layers: usize,
    batch_first: bool,
    dropout_p: f64,
    training: bool,
) -> Result<(Tensor, Vec<Tensor>)> {
    if input.rank() != 2 && input.rank() != 3 {
        return Err(Error::invalid(
            op,
            format!(
                "expected input to be 3-D ([seq, batch, features], or [batch, seq, features] with batch_first) or 2-D unbatched [seq, features], got shape {}",
                input.shape()
            ),
        ));
    }
    check_float(op, "input", input, input)?;
    if num_layers == 0 || weights.len() != num_layers {
        return Err(Error::invalid(
            op,
            format!(
                "expected num_layers >= 1 and one weight list per layer, got num_layers = {num_layers} and {} weight list(s)",
                weights.len()
            ),
        ));
    }
    if !(0.0..=1.0).contains(&dropout_p) {
        return Err(Error::invalid(
            op,
            format!("dropout should be a number in range [0, 1], got {dropout_p}"),
        ));
    }
    let batched = input.rank() == 3;
    // An unbatched [T, in] input runs as [T, 1, in], time-major.
    let (x, time) = if batched {
        (input.clone(), if batch_first { 1 } else { 0 })
    } else {
        (input.unsqueeze(1)?, 0)
    };
    let (steps, batch) = (x.dims()[time], x.dims()[1 - time]);
    if steps == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "expected a sequence of at least one step, got input of shape {}",
                input.shape()
            ),
        ));
    }

    let mut layers = Vec::with_capacity(num_layers);
    let mut hidden = None;
    for (l, w) in weights.iter().enumerate() {
        let lw = match w {
            [w_ih, w_hh] => LayerWeights {
                w_ih,
                w_hh,
                b_ih: None,
                b_hh: None,
            },
            [w_ih, w_hh, b_ih, b_hh] => LayerWeights {
                w_ih,
                w_hh,
                b_ih: Some(b_ih),
                b_hh: Some(b_hh),
            },
            _ => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "layer {l}: expected the weights [weight_ih, weight_hh, bias_ih, bias_hh] or [weight_ih, weight_hh], got {} tensor(s)",
                        w.len()
                    ),
                ))
            }
        };
        let in_size = match hidden {
            None => x.dims()[2],
            Some(h) => h,
        };
        hidden = Some(check_weights(op, kind, l, &lw, in_size, hidden, input)?);
        layers.push(lw);
    }
    let hidden = hidden.expect("num_layers >= 1");
    let init: Vec<Tensor> = states
        .iter()
        .map(|(name, s)| initial_state(op, name, *s, input, batched, num_layers, batch, hidden))
        .collect::<Result<_>>()?;

    let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(num_layers); init.len()];
    // The fused LSTM works time-major: one transpose of the input, and back at the end.
    let swap = kind == Kind::Lstm && time == 1;
    let (mut layer_input, time) = if swap {
        (x.transpose(0, 1)?.contiguous()?, 0)
    } else {
        (x, time)
    };
    for (l, w) in layers.iter().enumerate() {
        // Note [Input projection]: one GEMM for every step of this layer.
        let (in_bias, step_b_hh) = match (kind, w.b_ih, w.b_hh) {
            (Kind::Gru, b_ih, b_hh) => (b_ih.cloned(), b_hh),
            (_, Some(b_ih), Some(b_hh)) => (Some(b_ih.add(b_hh)?), None),
            (_, b_ih, b_hh) => (b_ih.or(b_hh).cloned(), None),
        };
        let projected = layer_input.linear(w.w_ih, in_bias.as_ref())?;
        let h0 = init[0].select(0, l as isize)?;
        let out = if kind == Kind::Lstm {
            // Rows h_1 .. h_T, then c_T, of one fused op.
            let c0 = init[1].select(0, l as isize)?;
            let hc = lstm_recurrence(&projected, w.w_hh, &h0, &c0)?;
            finals[0].push(hc.select(0, steps as isize - 1)?);
            finals[1].push(hc.select(0, steps as isize)?);
            hc.narrow(0, 0, steps)?
        } else {
            let w_hh_t = w.w_hh.t()?;
            let mut h = h0;
            let mut outs = Vec::with_capacity(steps);
            for gi in projected.unbind(time as isize)? {
                h = match kind {
                    Kind::Rnn(nl) => rnn_step(nl, &gi, &h, &w_hh_t, step_b_hh)?,
                    Kind::Gru => gru_step(&gi, &h, &w_hh_t, step_b_hh)?,
                    Kind::Lstm => unreachable!("the LSTM runs fused above"),
                };
                outs.push(h.clone());
            }
            finals[0].push(h);
            Tensor::stack(&outs, time as isize)?
        };
        // Dropout on every layer's output but the last, while training (as nn.LSTM).
        layer_input = if l + 1 < num_layers && training && dropout_p > 0.0 {
            dropout(&out, dropout_p, true)?
        } else {
            out
        };
    }
    if swap {
        layer_input = layer_input.transpose(0, 1)?;
    }
    let unbatch = |t: Tensor, dim: isize| if batched { Ok(t) } else { t.squeeze_dim(dim) };
    let output = unbatch(layer_input, 1)?;
    let finals = finals
        .iter()
        .map(|f| unbatch(Tensor::stack(f, 0)?, 1))
        .collect::<Result<Vec<_>>>()?;
    Ok((output, finals))
}

/// A multi-layer Elman RNN over a sequence (`nn.RNN`'s forward, unidirectional), returning
/// `(output, h_n)`.
///
/// `input` is `[T, N, in]` (`[N, T, in]` with `batch_first`) or unbatched `[T, in]`; `h0` is
/// `[num_layers, N, H]` (`[num_layers, H]` unbatched), zeros when `None`. `weights` holds one
/// list per layer, `[weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}]` (or just
/// the two weights for `bias=False`). `output` is the last layer's `h` at every step
/// (`[T, N, H]`, or `[N, T, H]` with `batch_first`), `h_n` every layer's last `h`. With
/// `training` and `dropout > 0`, dropout applies to the outputs of every layer but the last.
#[allow(clippy::too_many_arguments)]
pub fn rnn(
    input: &Tensor,
    h0: Option<&Tensor>,
    weights: &[&[Tensor]],
    nonlinearity: RnnNonlinearity,
    num_layers: usize,
    batch_first: bool,
    dropout: f64,
    training: bool,
) -> Result<(Tensor, Tensor)> {
    let (out, mut finals) = run_sequence(
        "rnn",
        Kind::Rnn(nonlinearity),
        input,
        &[("h0", h0)],
        weights,
        num_layers,
        batch_first,
        dropout,
        training,
    )?;
    Ok((out, finals.remove(0)))
}

/// A multi-layer LSTM over a sequence (`nn.LSTM`'s forward, unidirectional, no projection),
/// returning `(output, (h_n, c_n))`; `hx` is `(h0, c0)` or zeros when `None`. Shapes, weights
/// and dropout as for [`rnn`], with the four gates `i, f, g, o` stacked in each weight.
#[allow(clippy::too_many_arguments)]
pub fn lstm(
    input: &Tensor,
    hx: Option<(&Tensor, &Tensor)>,
    weights: &[&[Tensor]],
    num_layers: usize,
    batch_first: bool,
    dropout: f64,
    training: bool,
) -> Result<(Tensor, (Tensor, Tensor))> {
    let (out, mut finals) = run_sequence(
        "lstm",
        Kind::Lstm,
        input,
        &[("h0", hx.map(|s| s.0)), ("c0", hx.map(|s| s.1))],
        weights,
        num_layers,
        batch_first,
        dropout,
        training,
    )?;
    let c_n = finals.remove(1);
    Ok((out, (finals.remove(0), c_n)))
}

/// A multi-layer GRU over a sequence (`nn.GRU`'s forward, unidirectional), returning
/// `(output, h_n)`. Shapes, weights and dropout as for [`rnn`], with the three gates `r, z, n`
/// stacked in each weight.
#[allow(clippy::too_many_arguments)]
pub fn gru(
    input: &Tensor,
    h0: Option<&Tensor>,
    weights: &[&[Tensor]],
    num_layers: usize,
    batch_first: bool,
    dropout: f64,
    training: bool,
) -> Result<(Tensor, Tensor)> {
    let (out, mut finals) = run_sequence(
        "gru",
        Kind::Gru,
        input,
        &[("h0", h0)],
        weights,
        num_layers,
        batch_first,
        dropout,
        training,
    )?;
    Ok((out, finals.remove(0)))
}
