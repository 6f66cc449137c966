//! Recurrent layers of `ember_nn::functional`: cells against scalar loop references and
//! hand-computed values, sequence forms against stepped cells, layouts (`batch_first`,
//! unbatched), default states, dropout between layers, f64 finite-difference gradient checks
//! and argument errors.

use crate::common::{assert_close, assert_close_slice, devices, gradcheck, t64, values};
use ember_core::{DType, Device, Error, Tensor};
use ember_nn::functional as F;
use ember_nn::functional::RnnNonlinearity;

const CPU: Device = Device::Cpu;

pub(crate) fn rand(shape: &[usize], seed: u64) -> Tensor {
    t64(&values(shape.iter().product(), seed), shape, CPU)
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Row `r` of `w @ x` for a row-major `[rows, x.len()]` matrix.
pub(crate) fn row_dot(w: &[f64], r: usize, x: &[f64]) -> f64 {
    (0..x.len()).map(|k| w[r * x.len() + k] * x[k]).sum()
}

/// Reference gate pre-activations `W_ih x + b_ih` and `W_hh h + b_hh` (`g·H` each) of one
/// batch row.
struct Pre {
    i: Vec<f64>,
    h: Vec<f64>,
}

fn pre(g: usize, x: &[f64], h: &[f64], w: &[Vec<f64>; 4]) -> Pre {
    let hs = h.len();
    Pre {
        i: (0..g * hs).map(|r| row_dot(&w[0], r, x) + w[2][r]).collect(),
        h: (0..g * hs).map(|r| row_dot(&w[1], r, h) + w[3][r]).collect(),
    }
}

/// One LSTM step of one batch row, by the equations (gates i, f, g, o).
fn lstm_ref(x: &[f64], h: &[f64], c: &[f64], w: &[Vec<f64>; 4]) -> (Vec<f64>, Vec<f64>) {
    let hs = h.len();
    let p = pre(4, x, h, w);
    let gate = |k: usize, j: usize| p.i[k * hs + j] + p.h[k * hs + j];
    let c2: Vec<f64> = (0..hs)
        .map(|j| sigmoid(gate(1, j)) * c[j] + sigmoid(gate(0, j)) * gate(2, j).tanh())
        .collect();
    let h2 = (0..hs).map(|j| sigmoid(gate(3, j)) * c2[j].tanh()).collect();
    (h2, c2)
}

/// One GRU step of one batch row (gates r, z, n; n uses r * (W_hn h + b_hn)).
fn gru_ref(x: &[f64], h: &[f64], w: &[Vec<f64>; 4]) -> Vec<f64> {
    let hs = h.len();
    let p = pre(3, x, h, w);
    (0..hs)
        .map(|j| {
            let r = sigmoid(p.i[j] + p.h[j]);
            let z = sigmoid(p.i[hs + j] + p.h[hs + j]);
            let n = (p.i[2 * hs + j] + r * p.h[2 * hs + j]).tanh();
            (1.0 - z) * n + z * h[j]
        })
        .collect()
}

/// One Elman step of one batch row.
fn rnn_ref(x: &[f64], h: &[f64], w: &[Vec<f64>; 4], relu: bool) -> Vec<f64> {
    let p = pre(1, x, h, w);
    (0..h.len())
        .map(|j| {
            let a = p.i[j] + p.h[j];
            if relu {
                a.max(0.0)
            } else {
                a.tanh()
            }
        })
        .collect()
}

/// Random `[w_ih, w_hh, b_ih, b_hh]` for `gates` gates.
fn layer(gates: usize, input: usize, hidden: usize, seed: u64) -> Vec<Tensor> {
    vec![
        rand(&[gates * hidden, input], seed),
        rand(&[gates * hidden, hidden], seed + 1),
        rand(&[gates * hidden], seed + 2),
        rand(&[gates * hidden], seed + 3),
    ]
}

fn host(ws: &[Tensor]) -> [Vec<f64>; 4] {
    [0, 1, 2, 3].map(|i| ws[i].to_vec_f64().unwrap())
}

pub(crate) fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    let v = t.to_vec_f64().unwrap();
    v.chunks(t.dims()[t.rank() - 1]).map(|c| c.to_vec()).collect()
}

fn refs(layers: &[Vec<Tensor>]) -> Vec<&[Tensor]> {
    layers.iter().map(|l| l.as_slice()).collect()
}

#[test]
fn cells_hand_computed() {
    // One unit, one feature: every gate pre-activation is w_ih·x + w_hh·h + b_ih + b_hh.
    let s = |v: &[f64]| t64(v, &[v.len(), 1], CPU);
    let b = |v: &[f64]| t64(v, &[v.len()], CPU);
    let x = t64(&[0.5], &[1, 1], CPU);
    let h = t64(&[-1.0], &[1, 1], CPU);
    let c = t64(&[2.0], &[1, 1], CPU);

    // tanh(0.5·2 + (-1)·0.5 + 0.1 + 0.2) = tanh(0.8)
    let (wi, wh, bi, bh) = (s(&[2.0]), s(&[0.5]), b(&[0.1]), b(&[0.2]));
    let out = F::rnn_tanh_cell(&x, Some(&h), &wi, &wh, Some(&bi), Some(&bh)).unwrap();
    assert_close_slice(&out.to_vec_f64().unwrap(), &[0.8f64.tanh()], 1e-15, 0.0);
    let wi_neg = s(&[-2.0]);
    let out = F::rnn_relu_cell(&x, Some(&h), &wi_neg, &wh, Some(&bi), Some(&bh)).unwrap();
    assert_eq!(out.to_vec_f64().unwrap(), [0.0]); // relu(-1 - 0.5 + 0.3) = 0
    let out = F::rnn_relu_cell(&x, Some(&h), &wi, &wh, None, None).unwrap();
    assert_close_slice(&out.to_vec_f64().unwrap(), &[0.5], 1e-15, 0.0);

    // LSTM, gates i, f, g, o with w_ih = [1, 2, 3, 4], w_hh = 0, no bias:
    // i = σ(0.5), f = σ(1), g = tanh(1.5), o = σ(2); c' = f·2 + i·g; h' = o·tanh(c').
    let wi = s(&[1.0, 2.0, 3.0, 4.0]);
    let wh = s(&[0.0; 4]);
    let (h2, c2) = F::lstm_cell(&x, Some((&h, &c)), &wi, &wh, None, None).unwrap();
    let c_exp = sigmoid(1.0) * 2.0 + sigmoid(0.5) * 1.5f64.tanh();
    assert_close_slice(&c2.to_vec_f64().unwrap(), &[c_exp], 1e-14, 0.0);
    assert_close_slice(
        &h2.to_vec_f64().unwrap(),
        &[sigmoid(2.0) * c_exp.tanh()],
        1e-14,
        0.0,
    );

    // GRU, gates r, z, n with w_ih = [1, 2, 3], w_hh = [1, 1, 1], b_hh = [0, 0, 0.5]:
    // r = σ(0.5 - 1), z = σ(1 - 1), n = tanh(1.5 + r·(-1 + 0.5)), h' = (1 - z) n + z·(-1).
    let wi = s(&[1.0, 2.0, 3.0]);
    let wh = s(&[1.0, 1.0, 1.0]);
    let bh = b(&[0.0, 0.0, 0.5]);
    let out = F::gru_cell(&x, Some(&h), &wi, &wh, None, Some(&bh)).unwrap();
    let r = sigmoid(-0.5);
    let n = (1.5 - 0.5 * r).tanh();
    assert_close_slice(&out.to_vec_f64().unwrap(), &[0.5 * n - 0.5], 1e-14, 0.0);
}

#[test]
fn cells_match_the_equations() {
    let (n, i, hs) = (3, 4, 5);
    let x = rand(&[n, i], 1);
    let h = rand(&[n, hs], 2);
    let c = rand(&[n, hs], 3);
    let (xr, hr, cr) = (rows(&x), rows(&h), rows(&c));

    let w = layer(4, i, hs, 10);
    let (h2, c2) = F::lstm_cell(&x, Some((&h, &c)), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
    assert_eq!(h2.dims(), [n, hs]);
    let wh = host(&w);
    for b in 0..n {
        let (he, ce) = lstm_ref(&xr[b], &hr[b], &cr[b], &wh);
        assert_close_slice(&rows(&h2)[b], &he, 1e-12, 1e-14);
        assert_close_slice(&rows(&c2)[b], &ce, 1e-12, 1e-14);
    }

    let w = layer(3, i, hs, 20);
    let out = F::gru_cell(&x, Some(&h), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
    let wh = host(&w);
    for b in 0..n {
        assert_close_slice(&rows(&out)[b], &gru_ref(&xr[b], &hr[b], &wh), 1e-12, 1e-14);
    }

    let w = layer(1, i, hs, 30);
    let wh = host(&w);
    for relu in [false, true] {
        let f = if relu { F::rnn_relu_cell } else { F::rnn_tanh_cell };
        let out = f(&x, Some(&h), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
        for b in 0..n {
            assert_close_slice(&rows(&out)[b], &rnn_ref(&xr[b], &hr[b], &wh, relu), 1e-12, 1e-14);
        }
    }
}

#[test]
fn cells_default_state_and_unbatched() {
    let x = rand(&[2, 3], 1);
    let w = layer(4, 3, 2, 5);
    let zeros = Tensor::zeros([2, 2], DType::F64, CPU).unwrap();
    let (h_a, c_a) = F::lstm_cell(&x, None, &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
    let (h_b, c_b) =
        F::lstm_cell(&x, Some((&zeros, &zeros)), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
    assert_close(&h_a, &h_b, 0.0, 0.0);
    assert_close(&c_a, &c_b, 0.0, 0.0);

    // An unbatched [in] input with an [H] state gives [H], as batch row 0 would.
    let x0 = x.select(0, 0).unwrap();
    let h0 = rand(&[2], 7);
    let g = layer(3, 3, 2, 9);
    let un = F::gru_cell(&x0, Some(&h0), &g[0], &g[1], Some(&g[2]), Some(&g[3])).unwrap();
    assert_eq!(un.dims(), [2]);
    let batched = F::gru_cell(
        &x0.unsqueeze(0).unwrap(),
        Some(&h0.unsqueeze(0).unwrap()),
        &g[0],
        &g[1],
        Some(&g[2]),
        Some(&g[3]),
    )
    .unwrap();
    assert_close(&un, &batched.squeeze_dim(0).unwrap(), 0.0, 0.0);
}

/// Steps a 2-layer sequence (time-major `[T, N, in]`) through the cells, the definition the
/// sequence forms must match.
fn lstm_by_cells(x: &Tensor, h0: &Tensor, c0: &Tensor, layers: &[Vec<Tensor>]) -> (Tensor, Tensor, Tensor) {
    let mut input: Vec<Tensor> = x.unbind(0).unwrap();
    let (mut hn, mut cn) = (Vec::new(), Vec::new());
    for (l, w) in layers.iter().enumerate() {
        let mut h = h0.select(0, l as isize).unwrap();
        let mut c = c0.select(0, l as isize).unwrap();
        let mut outs = Vec::new();
        for xt in &input {
            (h, c) = F::lstm_cell(xt, Some((&h, &c)), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
            outs.push(h.clone());
        }
        input = outs;
        hn.push(h);
        cn.push(c);
    }
    (
        Tensor::stack(&input, 0).unwrap(),
        Tensor::stack(&hn, 0).unwrap(),
        Tensor::stack(&cn, 0).unwrap(),
    )
}

#[test]
fn sequences_match_stepped_cells() {
    let (t, n, i, hs) = (4, 3, 5, 2);
    let x = rand(&[t, n, i], 1);
    let h0 = rand(&[2, n, hs], 2);
    let c0 = rand(&[2, n, hs], 3);

    let ls = vec![layer(4, i, hs, 10), layer(4, hs, hs, 20)];
    let (out, (h, c)) = F::lstm(&x, Some((&h0, &c0)), &refs(&ls), 2, false, 0.0, false).unwrap();
    let (out_e, h_e, c_e) = lstm_by_cells(&x, &h0, &c0, &ls);
    assert_eq!(out.dims(), [t, n, hs]);
    assert_eq!(h.dims(), [2, n, hs]);
    assert_close(&out, &out_e, 1e-12, 1e-14);
    assert_close(&h, &h_e, 1e-12, 1e-14);
    assert_close(&c, &c_e, 1e-12, 1e-14);

    // GRU and RNN, one layer, against their cells.
    let g = vec![layer(3, i, hs, 30)];
    let (out, h) = F::gru(
        &x,
        Some(&h0.narrow(0, 0, 1).unwrap()),
        &refs(&g),
        1,
        false,
        0.0,
        false,
    )
    .unwrap();
    let mut hh = h0.select(0, 0).unwrap();
    for (k, xt) in x.unbind(0).unwrap().iter().enumerate() {
        hh = F::gru_cell(xt, Some(&hh), &g[0][0], &g[0][1], Some(&g[0][2]), Some(&g[0][3])).unwrap();
        assert_close(&out.select(0, k as isize).unwrap(), &hh, 1e-12, 1e-14);
    }
    assert_close(&h.select(0, 0).unwrap(), &hh, 1e-12, 1e-14);

    let r = vec![layer(1, i, hs, 40), layer(1, hs, hs, 50)];
    let (out, h) = F::rnn(&x, None, &refs(&r), RnnNonlinearity::Relu, 2, false, 0.0, false).unwrap();
    let mut input = x.unbind(0).unwrap();
    for (l, w) in r.iter().enumerate() {
        let mut hh = Tensor::zeros([n, hs], DType::F64, CPU).unwrap();
        let mut outs = Vec::new();
        for xt in &input {
            hh = F::rnn_relu_cell(xt, Some(&hh), &w[0], &w[1], Some(&w[2]), Some(&w[3])).unwrap();
            outs.push(hh.clone());
        }
        assert_close(&h.select(0, l as isize).unwrap(), &hh, 1e-12, 1e-14);
        input = outs;
    }
    assert_close(&out, &Tensor::stack(&input, 0).unwrap(), 1e-12, 1e-14);
}

#[test]
fn batch_first_default_state_no_bias_and_unbatched() {
    let (t, n, i, hs) = (3, 2, 4, 3);
    let x = rand(&[t, n, i], 1);
    let ls = vec![layer(3, i, hs, 10), layer(3, hs, hs, 20)];
    let (out, h) = F::gru(&x, None, &refs(&ls), 2, false, 0.0, false).unwrap();

    // batch_first: the same numbers with time and batch swapped; h_n unchanged.
    let xb = x.transpose(0, 1).unwrap().contiguous().unwrap();
    let (out_b, h_b) = F::gru(&xb, None, &refs(&ls), 2, true, 0.0, false).unwrap();
    assert_eq!(out_b.dims(), [n, t, hs]);
    assert_close(&out_b.transpose(0, 1).unwrap(), &out, 1e-14, 0.0);
    assert_close(&h_b, &h, 1e-14, 0.0);

    // h0 = None is zeros.
    let zeros = Tensor::zeros([2, n, hs], DType::F64, CPU).unwrap();
    let (out_z, h_z) = F::gru(&x, Some(&zeros), &refs(&ls), 2, false, 0.0, false).unwrap();
    assert_close(&out_z, &out, 0.0, 0.0);
    assert_close(&h_z, &h, 0.0, 0.0);

    // Unbatched [T, in] is batch row 0 without its batch dim (batch_first has no effect).
    let x0 = x.select(1, 0).unwrap();
    let (out_u, h_u) = F::gru(&x0, None, &refs(&ls), 2, true, 0.0, false).unwrap();
    assert_eq!(out_u.dims(), [t, hs]);
    assert_eq!(h_u.dims(), [2, hs]);
    assert_close(&out_u, &out.select(1, 0).unwrap(), 1e-14, 0.0);
    assert_close(&h_u, &h.select(1, 0).unwrap(), 1e-14, 0.0);

    // bias=False: two weights per layer, the same as zero biases.
    let nb: Vec<Vec<Tensor>> = ls.iter().map(|l| l[..2].to_vec()).collect();
    let zb: Vec<Vec<Tensor>> = ls
        .iter()
        .map(|l| {
            let z = l[2].zeros_like().unwrap();
            vec![l[0].clone(), l[1].clone(), z.clone(), z]
        })
        .collect();
    let (o1, _) = F::gru(&x, None, &refs(&nb), 2, false, 0.0, false).unwrap();
    let (o2, _) = F::gru(&x, None, &refs(&zb), 2, false, 0.0, false).unwrap();
    assert_close(&o1, &o2, 1e-14, 0.0);
    let a = layer(4, i, hs, 60);
    let z = a[2].zeros_like().unwrap();
    let zb = [a[0].clone(), a[1].clone(), z.clone(), z];
    let (o1, _) = F::lstm(&x, None, &[&a[..2]], 1, false, 0.0, false).unwrap();
    let (o2, _) = F::lstm(&x, None, &[&zb[..]], 1, false, 0.0, false).unwrap();
    assert_close(&o1, &o2, 1e-14, 0.0);
}

#[test]
fn dropout_between_layers_only_in_training() {
    let x = rand(&[3, 2, 4], 1);
    let ls = vec![layer(4, 4, 3, 10), layer(4, 3, 3, 20)];
    let (a, _) = F::lstm(&x, None, &refs(&ls), 2, false, 0.0, false).unwrap();
    let (b, _) = F::lstm(&x, None, &refs(&ls), 2, false, 0.7, false).unwrap();
    assert_close(&a, &b, 0.0, 0.0);
    // p = 1 zeroes layer 0's output: layer 1 then sees only zeros.
    let (c, (h, _)) = F::lstm(&x, None, &refs(&ls), 2, false, 1.0, true).unwrap();
    let zeros = Tensor::zeros([3, 2, 3], DType::F64, CPU).unwrap();
    let (d, (h1, _)) = F::lstm(&zeros, None, &refs(&ls[1..]), 1, false, 0.0, false).unwrap();
    assert_close(&c, &d, 1e-14, 0.0);
    assert_close(&h.select(0, 1).unwrap(), &h1.select(0, 0).unwrap(), 1e-14, 0.0);
    // Dropout does not touch the last layer's output: one layer with p = 1 is unchanged.
    let (e, _) = F::lstm(&x, None, &refs(&ls[..1]), 1, false, 1.0, true).unwrap();
    let (f, _) = F::lstm(&x, None, &refs(&ls[..1]), 1, false, 0.0, false).unwrap();
    assert_close(&e, &f, 0.0, 0.0);
}

/// All of a recurrent result flattened into one tensor, for gradcheck.
fn flat(parts: &[&Tensor]) -> ember_core::Result<Tensor> {
    let f: Vec<Tensor> = parts
        .iter()
        .map(|t| t.reshape(&[-1]))
        .collect::<ember_core::Result<_>>()?;
    Tensor::cat(&f, 0)
}

#[test]
fn gradcheck_two_step_lstm_gru_rnn() {
    let (t, n, i, hs) = (2, 2, 3, 2);
    let x = rand(&[n, t, i], 1);
    let h0 = rand(&[2, n, hs], 2);
    let c0 = rand(&[2, n, hs], 3);
    let mut inputs = vec![x.clone(), h0.clone(), c0];
    inputs.extend(layer(4, i, hs, 10));
    inputs.extend(layer(4, hs, hs, 20));
    gradcheck(
        |a| {
            let ws = [&a[3..7], &a[7..11]];
            let (out, (h, c)) = F::lstm(&a[0], Some((&a[1], &a[2])), &ws, 2, true, 0.0, false)?;
            flat(&[&out, &h, &c])
        },
        &inputs,
    );

    let mut inputs = vec![x.clone(), h0.clone()];
    inputs.extend(layer(3, i, hs, 30));
    inputs.extend(layer(3, hs, hs, 40));
    gradcheck(
        |a| {
            let ws = [&a[2..6], &a[6..10]];
            let (out, h) = F::gru(&a[0], Some(&a[1]), &ws, 2, true, 0.0, false)?;
            flat(&[&out, &h])
        },
        &inputs,
    );

    let mut inputs = vec![x, h0.narrow(0, 0, 1).unwrap()];
    inputs.extend(layer(1, i, hs, 50));
    gradcheck(
        |a| {
            let (out, h) = F::rnn(
                &a[0],
                Some(&a[1]),
                &[&a[2..6]],
                RnnNonlinearity::Tanh,
                1,
                true,
                0.0,
                false,
            )?;
            flat(&[&out, &h])
        },
        &inputs,
    );
}

#[test]
fn gradcheck_cells() {
    let x = rand(&[2, 3], 1);
    let h = rand(&[2, 2], 2);
    let c = rand(&[2, 2], 3);
    let mut inputs = vec![x.clone(), h.clone(), c];
    inputs.extend(layer(4, 3, 2, 10));
    gradcheck(
        |a| {
            let (h, c) = F::lstm_cell(
                &a[0],
                Some((&a[1], &a[2])),
                &a[3],
                &a[4],
                Some(&a[5]),
                Some(&a[6]),
            )?;
            flat(&[&h, &c])
        },
        &inputs,
    );
    let mut inputs = vec![x, h];
    inputs.extend(layer(3, 3, 2, 20));
    gradcheck(
        |a| F::gru_cell(&a[0], Some(&a[1]), &a[2], &a[3], Some(&a[4]), Some(&a[5])),
        &inputs,
    );
}

#[test]
fn recurrent_argument_errors() {
    let x = rand(&[3, 2, 4], 1);
    let ls = vec![layer(4, 4, 3, 10)];
    let invalid = |r: ember_core::Result<(Tensor, (Tensor, Tensor))>| {
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "got {r:?}");
    };
    // Wrong input rank.
    invalid(F::lstm(&rand(&[4], 1), None, &refs(&ls), 1, false, 0.0, false));
    // Input features differ from weight_ih's.
    invalid(F::lstm(
        &rand(&[3, 2, 5], 1),
        None,
        &refs(&ls),
        1,
        false,
        0.0,
        false,
    ));
    // num_layers disagrees with the weight lists.
    invalid(F::lstm(&x, None, &refs(&ls), 2, false, 0.0, false));
    invalid(F::lstm(&x, None, &[], 0, false, 0.0, false));
    // Three tensors for a layer.
    invalid(F::lstm(&x, None, &[&ls[0][..3]], 1, false, 0.0, false));
    // weight_hh not [4H, H]; a GRU's weights given to the LSTM.
    let bad = vec![
        ls[0][0].clone(),
        rand(&[12, 4], 1),
        ls[0][2].clone(),
        ls[0][3].clone(),
    ];
    invalid(F::lstm(&x, None, &[bad.as_slice()], 1, false, 0.0, false));
    invalid(F::lstm(
        &x,
        None,
        &refs(&[layer(3, 4, 3, 1)]),
        1,
        false,
        0.0,
        false,
    ));
    // Bias of the wrong size; layer 1 with another hidden size.
    let bad = vec![
        ls[0][0].clone(),
        ls[0][1].clone(),
        rand(&[11], 1),
        ls[0][3].clone(),
    ];
    invalid(F::lstm(&x, None, &[bad.as_slice()], 1, false, 0.0, false));
    let two = vec![ls[0].clone(), layer(4, 3, 2, 5)];
    invalid(F::lstm(&x, None, &refs(&two), 2, false, 0.0, false));
    // States of the wrong shape (batch_first swaps the batch dim the state must match).
    let h0 = rand(&[1, 2, 3], 2);
    let c0 = rand(&[1, 3, 3], 3);
    invalid(F::lstm(&x, Some((&h0, &c0)), &refs(&ls), 1, false, 0.0, false));
    invalid(F::lstm(&x, Some((&h0, &h0)), &refs(&ls), 1, true, 0.0, false));
    assert!(F::lstm(&x, Some((&h0, &h0)), &refs(&ls), 1, false, 0.0, false).is_ok());
    // Dropout out of range; an empty sequence.
    invalid(F::lstm(&x, None, &refs(&ls), 1, false, 1.5, true));
    invalid(F::lstm(
        &rand(&[0, 2, 4], 1).reshape(&[0, 2, 4]).unwrap(),
        None,
        &refs(&ls),
        1,
        false,
        0.0,
        false,
    ));
    // dtype: integer input, f32 weights with an f64 input.
    let xi = x.to_dtype(DType::I64).unwrap();
    let r = F::lstm(&xi, None, &refs(&ls), 1, false, 0.0, false);
    assert!(matches!(r, Err(Error::UnsupportedDType { .. })), "got {r:?}");
    let l32: Vec<Tensor> = ls[0].iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
    invalid(F::lstm(&x, None, &[l32.as_slice()], 1, false, 0.0, false));

    // Cells: input rank, hx shape.
    let w = &ls[0];
    let r = F::lstm_cell(&x, None, &w[0], &w[1], None, None);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
    let r = F::rnn_tanh_cell(
        &rand(&[2, 4], 1),
        Some(&rand(&[2, 4], 1)),
        &rand(&[3, 4], 2),
        &rand(&[3, 3], 3),
        None,
        None,
    );
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "got {r:?}");
    assert_eq!(RnnNonlinearity::parse("relu").unwrap(), RnnNonlinearity::Relu);
    assert!(RnnNonlinearity::parse("sigmoid").is_err());
}

#[test]
fn lstm_runs_on_every_device() {
    for dev in devices() {
        let x = rand(&[3, 2, 4], 1).to(dev).unwrap().to_dtype(DType::F32).unwrap();
        let ls: Vec<Tensor> = layer(4, 4, 3, 10)
            .iter()
            .map(|t| {
                t.to(dev)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap()
            })
            .collect();
        let (out, (h, c)) = F::lstm(&x, None, &[ls.as_slice()], 1, false, 0.0, false).unwrap();
        assert_eq!(out.device(), dev);
        out.sum_all()
            .unwrap()
            .add(&h.sum_all().unwrap().add(&c.sum_all().unwrap()).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        assert!(ls.iter().all(|w| w.grad().is_some()));
    }
}

#[test]
fn cells_with_hidden_size_zero_give_empty_states() {
    // PyTorch returns [N, 0] for a hidden size of 0; ember did panic in gru_cell.
    let x = rand(&[2, 3], 1);
    let (wi3, wh3) = (rand(&[0, 3], 2), rand(&[0, 0], 3));
    let h = F::gru_cell(&x, None, &wi3, &wh3, None, None).unwrap();
    assert_eq!(h.dims(), &[2, 0]);
    let h = F::rnn_tanh_cell(&x, None, &wi3, &wh3, None, None).unwrap();
    assert_eq!(h.dims(), &[2, 0]);
    let (h, c) = F::lstm_cell(&x, None, &wi3, &wh3, None, None).unwrap();
    assert_eq!((h.dims(), c.dims()), (&[2, 0][..], &[2, 0][..]));
}
