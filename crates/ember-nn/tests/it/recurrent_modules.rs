//! `nn::RNN`, `nn::LSTM`, `nn::GRU` and the cells: PyTorch's state-dict keys and shapes, the
//! uniform `±1/√H` init, forward against the functional forms (both layouts, with and without
//! initial states), state hand-over between two halves of a sequence, gradients reaching every
//! parameter (finite differences on a small f64 LSTM), dropout only in training mode, input
//! errors, and CPU-vs-CUDA (ignored).

use crate::attention_modules::{
    assert_grads_reach_every_parameter, cpu_vs_cuda_module, gradcheck_module, keys, keys_and_shapes, rand32,
    rand64,
};
use crate::common::assert_close;
use ember_core::{manual_seed, Device, Tensor};
use ember_nn::functional::{self as F, RnnNonlinearity};
use ember_nn::layers::{CellConfig, RNNCellConfig, RNNConfig, RecurrentConfig};
use ember_nn::{Forward, GRUCell, LSTMCell, Module, ModuleExt, RNNCell, GRU, LSTM, RNN};

const CPU: Device = Device::Cpu;

type CellFn = fn(
    &Tensor,
    Option<&Tensor>,
    &Tensor,
    &Tensor,
    Option<&Tensor>,
    Option<&Tensor>,
) -> ember_core::Result<Tensor>;

fn config(num_layers: usize, batch_first: bool) -> RecurrentConfig {
    RecurrentConfig {
        num_layers,
        batch_first,
        ..Default::default()
    }
}

/// The weight lists of a module's layers, for the functional forms.
fn lists(layers: &[ember_nn::layers::RecurrentWeights]) -> Vec<Vec<Tensor>> {
    layers
        .iter()
        .map(|w| {
            let mut v = vec![w.weight_ih.clone(), w.weight_hh.clone()];
            v.extend(w.bias_ih.clone());
            v.extend(w.bias_hh.clone());
            v
        })
        .collect()
}

fn refs(l: &[Vec<Tensor>]) -> Vec<&[Tensor]> {
    l.iter().map(|v| &v[..]).collect()
}

#[test]
fn recurrent_state_dict_keys_and_shapes_are_pytorchs() {
    let lstm = LSTM::with_config(4, 3, config(2, false), CPU).unwrap();
    let expect = |g: usize, input: usize, h: usize, layers: usize| -> Vec<(String, Vec<usize>)> {
        (0..layers)
            .flat_map(|l| {
                let i = if l == 0 { input } else { h };
                [
                    (format!("weight_ih_l{l}"), vec![g * h, i]),
                    (format!("weight_hh_l{l}"), vec![g * h, h]),
                    (format!("bias_ih_l{l}"), vec![g * h]),
                    (format!("bias_hh_l{l}"), vec![g * h]),
                ]
            })
            .collect()
    };
    assert_eq!(keys_and_shapes(&lstm), expect(4, 4, 3, 2));
    assert_eq!(
        keys(&lstm),
        [
            "weight_ih_l0",
            "weight_hh_l0",
            "bias_ih_l0",
            "bias_hh_l0",
            "weight_ih_l1",
            "weight_hh_l1",
            "bias_ih_l1",
            "bias_hh_l1"
        ]
    );
    let gru = GRU::with_config(5, 2, config(3, true), CPU).unwrap();
    assert_eq!(keys_and_shapes(&gru), expect(3, 5, 2, 3));
    let rnn = RNN::new(5, 6, CPU).unwrap();
    assert_eq!(keys_and_shapes(&rnn), expect(1, 5, 6, 1));
    let no_bias = GRU::with_config(
        5,
        2,
        RecurrentConfig {
            bias: false,
            ..config(2, false)
        },
        CPU,
    )
    .unwrap();
    assert_eq!(
        keys(&no_bias),
        ["weight_ih_l0", "weight_hh_l0", "weight_ih_l1", "weight_hh_l1"]
    );

    let cell = |g: usize, i: usize, h: usize| -> Vec<(String, Vec<usize>)> {
        vec![
            ("weight_ih".into(), vec![g * h, i]),
            ("weight_hh".into(), vec![g * h, h]),
            ("bias_ih".into(), vec![g * h]),
            ("bias_hh".into(), vec![g * h]),
        ]
    };
    assert_eq!(keys_and_shapes(&LSTMCell::new(3, 2, CPU).unwrap()), cell(4, 3, 2));
    assert_eq!(keys_and_shapes(&GRUCell::new(3, 2, CPU).unwrap()), cell(3, 3, 2));
    assert_eq!(keys_and_shapes(&RNNCell::new(3, 2, CPU).unwrap()), cell(1, 3, 2));
    let c = LSTMCell::with_config(3, 2, CellConfig { bias: false }, CPU).unwrap();
    assert_eq!(keys(&c), ["weight_ih", "weight_hh"]);
}

#[test]
fn recurrent_init_is_uniform_on_inverse_sqrt_hidden() {
    manual_seed(1).unwrap();
    let h = 16;
    let bound = 1.0 / (h as f64).sqrt();
    let modules: Vec<Box<dyn Forward>> = vec![
        Box::new(LSTM::with_config(8, h, config(2, false), CPU).unwrap()),
        Box::new(GRU::new(8, h, CPU).unwrap()),
        Box::new(RNN::new(8, h, CPU).unwrap()),
        Box::new(LSTMCell::new(8, h, CPU).unwrap()),
        Box::new(GRUCell::new(8, h, CPU).unwrap()),
        Box::new(RNNCell::new(8, h, CPU).unwrap()),
    ];
    for m in &modules {
        for (name, p) in m.named_parameters() {
            assert!(p.requires_grad() && p.is_leaf(), "{name}");
            let v = p.to_vec_f64().unwrap();
            assert!(v.iter().all(|x| x.abs() <= bound), "{name} outside ±1/√H");
            // At least 16 values uniform on ±0.25: the largest is near the bound.
            assert!(
                v.iter().any(|x| x.abs() > 0.6 * bound),
                "{name} does not span its range"
            );
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            assert!(mean.abs() < 0.6 * bound, "{name} mean {mean}");
        }
    }
}

#[test]
fn sequence_modules_match_the_functional_forms() {
    manual_seed(2).unwrap();
    for batch_first in [false, true] {
        let (t, n, i, h, layers) = (5, 3, 4, 6, 2);
        let dims = if batch_first { [n, t, i] } else { [t, n, i] };
        let out_dims = if batch_first { [n, t, h] } else { [t, n, h] };
        let x = rand32(&dims, 1);
        let (h0, c0) = (rand32(&[layers, n, h], 2), rand32(&[layers, n, h], 3));

        let lstm = LSTM::with_config(i, h, config(layers, batch_first), CPU).unwrap();
        let w = lists(&lstm.layers);
        let (out, (hn, cn)) = lstm.forward_with(&x, Some((&h0, &c0))).unwrap();
        let (fo, (fh, fc)) =
            F::lstm(&x, Some((&h0, &c0)), &refs(&w), layers, batch_first, 0.0, true).unwrap();
        assert_eq!(out.dims(), out_dims);
        assert_eq!(hn.dims(), [layers, n, h]);
        assert_eq!(cn.dims(), [layers, n, h]);
        assert_close(&out, &fo, 0.0, 0.0);
        assert_close(&hn, &fh, 0.0, 0.0);
        assert_close(&cn, &fc, 0.0, 0.0);
        // Forward::forward: zero initial states, output only.
        let (zo, _) = F::lstm(&x, None, &refs(&w), layers, batch_first, 0.0, true).unwrap();
        assert_close(&lstm.forward(&x).unwrap(), &zo, 0.0, 0.0);

        let gru = GRU::with_config(i, h, config(layers, batch_first), CPU).unwrap();
        let w = lists(&gru.layers);
        let (out, hn) = gru.forward_with(&x, Some(&h0)).unwrap();
        let (fo, fh) = F::gru(&x, Some(&h0), &refs(&w), layers, batch_first, 0.0, true).unwrap();
        assert_eq!(out.dims(), out_dims);
        assert_close(&out, &fo, 0.0, 0.0);
        assert_close(&hn, &fh, 0.0, 0.0);

        let rc = RNNConfig {
            nonlinearity: RnnNonlinearity::Relu,
            num_layers: layers,
            batch_first,
            ..Default::default()
        };
        let rnn = RNN::with_config(i, h, rc, CPU).unwrap();
        let w = lists(&rnn.layers);
        let (out, hn) = rnn.forward_with(&x, Some(&h0)).unwrap();
        let (fo, fh) = F::rnn(
            &x,
            Some(&h0),
            &refs(&w),
            RnnNonlinearity::Relu,
            layers,
            batch_first,
            0.0,
            true,
        )
        .unwrap();
        assert_eq!(out.dims(), out_dims);
        assert_close(&out, &fo, 0.0, 0.0);
        assert_close(&hn, &fh, 0.0, 0.0);
    }
    // Unbatched [T, in] input: [T, H] output, [layers, H] states.
    let lstm = LSTM::with_config(4, 3, config(2, false), CPU).unwrap();
    let (out, (hn, cn)) = lstm.forward_with(&rand32(&[5, 4], 9), None).unwrap();
    assert_eq!(
        (out.dims(), hn.dims(), cn.dims()),
        (&[5, 3][..], &[2, 3][..], &[2, 3][..])
    );
}

#[test]
fn cells_match_the_functional_cells() {
    manual_seed(3).unwrap();
    let x = rand32(&[3, 4], 1);
    let (h, c) = (rand32(&[3, 5], 2), rand32(&[3, 5], 3));
    let lstm = LSTMCell::new(4, 5, CPU).unwrap();
    let w = &lstm.weights;
    let (h1, c1) = lstm.forward_with(&x, Some((&h, &c))).unwrap();
    let (fh, fc) = F::lstm_cell(
        &x,
        Some((&h, &c)),
        &w.weight_ih,
        &w.weight_hh,
        w.bias_ih.as_ref(),
        w.bias_hh.as_ref(),
    )
    .unwrap();
    assert_close(&h1, &fh, 0.0, 0.0);
    assert_close(&c1, &fc, 0.0, 0.0);
    let (zh, _) = F::lstm_cell(
        &x,
        None,
        &w.weight_ih,
        &w.weight_hh,
        w.bias_ih.as_ref(),
        w.bias_hh.as_ref(),
    )
    .unwrap();
    assert_close(&lstm.forward(&x).unwrap(), &zh, 0.0, 0.0);

    let gru = GRUCell::new(4, 5, CPU).unwrap();
    let w = &gru.weights;
    let f = F::gru_cell(
        &x,
        Some(&h),
        &w.weight_ih,
        &w.weight_hh,
        w.bias_ih.as_ref(),
        w.bias_hh.as_ref(),
    )
    .unwrap();
    assert_close(&gru.forward_with(&x, Some(&h)).unwrap(), &f, 0.0, 0.0);
    assert_eq!(gru.forward(&x).unwrap().dims(), [3, 5]);

    for (nl, cell) in [
        (RnnNonlinearity::Tanh, F::rnn_tanh_cell as CellFn),
        (RnnNonlinearity::Relu, F::rnn_relu_cell),
    ] {
        let rnn = RNNCell::with_config(
            4,
            5,
            RNNCellConfig {
                nonlinearity: nl,
                ..Default::default()
            },
            CPU,
        )
        .unwrap();
        let w = &rnn.weights;
        let f = cell(
            &x,
            Some(&h),
            &w.weight_ih,
            &w.weight_hh,
            w.bias_ih.as_ref(),
            w.bias_hh.as_ref(),
        )
        .unwrap();
        assert_close(&rnn.forward_with(&x, Some(&h)).unwrap(), &f, 0.0, 0.0);
    }
    // Unbatched cell input.
    assert_eq!(gru.forward(&rand32(&[4], 5)).unwrap().dims(), [5]);
}

#[test]
fn initial_states_carry_a_sequence_across_two_calls() {
    manual_seed(4).unwrap();
    let x = rand32(&[2, 6, 3], 1);
    let (first, second) = (x.narrow(1, 0, 4).unwrap(), x.narrow(1, 4, 2).unwrap());
    let lstm = LSTM::with_config(3, 4, config(2, true), CPU).unwrap();
    let (full, (hn, cn)) = lstm.forward_with(&x, None).unwrap();
    let (_, (h1, c1)) = lstm.forward_with(&first, None).unwrap();
    let (rest, (h2, c2)) = lstm.forward_with(&second, Some((&h1, &c1))).unwrap();
    assert_close(&rest, &full.narrow(1, 4, 2).unwrap(), 1e-6, 1e-7);
    assert_close(&h2, &hn, 1e-6, 1e-7);
    assert_close(&c2, &cn, 1e-6, 1e-7);
    // The state matters: starting the second half from zeros gives something else.
    let (cold, _) = lstm.forward_with(&second, None).unwrap();
    assert_ne!(cold.to_vec_f64().unwrap(), rest.to_vec_f64().unwrap());

    let gru = GRU::with_config(3, 4, config(2, true), CPU).unwrap();
    let (full, hn) = gru.forward_with(&x, None).unwrap();
    let (_, h1) = gru.forward_with(&first, None).unwrap();
    let (rest, h2) = gru.forward_with(&second, Some(&h1)).unwrap();
    assert_close(&rest, &full.narrow(1, 4, 2).unwrap(), 1e-6, 1e-7);
    assert_close(&h2, &hn, 1e-6, 1e-7);
    // The final h of the last layer is the last output step.
    assert_close(&hn.select(0, 1).unwrap(), &full.select(1, 5).unwrap(), 0.0, 0.0);
}

#[test]
fn recurrent_gradients_reach_every_parameter_and_match_finite_differences() {
    manual_seed(5).unwrap();
    let lstm = LSTM::with_config(2, 3, config(2, true), CPU).unwrap();
    let x = rand64(&[2, 3, 2], 7);
    let (h0, c0) = (rand64(&[2, 2, 3], 8), rand64(&[2, 2, 3], 9));
    gradcheck_module(&lstm, &x, |m, x| {
        let (out, (hn, cn)) = m.forward_with(x, Some((&h0, &c0)))?;
        out.sum_all()?.add(&hn.mul(&cn)?.sum_all()?)
    });
    let gru = GRU::with_config(2, 3, config(1, false), CPU).unwrap();
    let g0 = rand64(&[1, 3, 3], 10);
    gradcheck_module(&gru, &x, |m, x| Ok(m.forward_with(x, Some(&g0))?.1));

    let modules: Vec<Box<dyn Forward>> = vec![
        Box::new(LSTM::with_config(3, 4, config(2, false), CPU).unwrap()),
        Box::new(GRU::with_config(3, 4, config(2, false), CPU).unwrap()),
        Box::new(
            RNN::with_config(
                3,
                4,
                RNNConfig {
                    num_layers: 2,
                    ..Default::default()
                },
                CPU,
            )
            .unwrap(),
        ),
    ];
    for m in &modules {
        m.forward(&rand32(&[5, 2, 3], 1))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_grads_reach_every_parameter(&**m);
    }
    // Cells from a non-zero state (from zeros `weight_hh` gets no gradient, rightly).
    let (x, h, c) = (rand32(&[2, 3], 1), rand32(&[2, 4], 2), rand32(&[2, 4], 3));
    let lstm_cell = LSTMCell::new(3, 4, CPU).unwrap();
    let (h1, c1) = lstm_cell.forward_with(&x, Some((&h, &c))).unwrap();
    h1.add(&c1).unwrap().sum_all().unwrap().backward().unwrap();
    assert_grads_reach_every_parameter(&lstm_cell);
    let gru_cell = GRUCell::new(3, 4, CPU).unwrap();
    gru_cell
        .forward_with(&x, Some(&h))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_grads_reach_every_parameter(&gru_cell);
    let rnn_cell = RNNCell::new(3, 4, CPU).unwrap();
    rnn_cell
        .forward_with(&x, Some(&h))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_grads_reach_every_parameter(&rnn_cell);
}

#[test]
fn recurrent_dropout_only_between_layers_in_training_mode() {
    manual_seed(6).unwrap();
    let cfg = RecurrentConfig {
        dropout: 0.5,
        ..config(2, false)
    };
    let lstm = LSTM::with_config(3, 8, cfg, CPU).unwrap();
    let x = rand32(&[4, 2, 3], 1);
    let w = lists(&lstm.layers);
    let (no_dropout, _) = F::lstm(&x, None, &refs(&w), 2, false, 0.0, true).unwrap();
    let a = lstm.forward(&x).unwrap();
    let b = lstm.forward(&x).unwrap();
    assert_ne!(
        a.to_vec_f64().unwrap(),
        b.to_vec_f64().unwrap(),
        "training: fresh masks"
    );
    lstm.eval();
    let c = lstm.forward(&x).unwrap();
    assert_eq!(
        c.to_vec_f64().unwrap(),
        lstm.forward(&x).unwrap().to_vec_f64().unwrap()
    );
    assert_close(&c, &no_dropout, 0.0, 0.0);

    // A single layer has no dropout even in training (PyTorch warns and applies none).
    let gru = GRU::with_config(
        3,
        4,
        RecurrentConfig {
            dropout: 0.5,
            ..config(1, false)
        },
        CPU,
    )
    .unwrap();
    let a = gru.forward(&x).unwrap();
    assert_eq!(
        a.to_vec_f64().unwrap(),
        gru.forward(&x).unwrap().to_vec_f64().unwrap()
    );
    gru.eval();
    gru.train();
    assert!(gru.is_training());
}

#[test]
fn recurrent_modules_reject_bad_inputs_and_options() {
    let lstm = LSTM::new(3, 4, CPU).unwrap();
    assert!(
        lstm.forward(&rand32(&[5, 2, 4], 1)).is_err(),
        "wrong feature size"
    );
    assert!(lstm
        .forward_with(
            &rand32(&[5, 2, 3], 1),
            Some((&rand32(&[1, 3, 4], 2), &rand32(&[1, 2, 4], 3)))
        )
        .is_err());
    assert!(LSTM::with_config(
        3,
        4,
        RecurrentConfig {
            dropout: 1.5,
            ..Default::default()
        },
        CPU
    )
    .is_err());
    assert!(GRU::with_config(3, 0, RecurrentConfig::default(), CPU).is_err());
    assert!(RNN::with_config(
        3,
        4,
        RNNConfig {
            num_layers: 0,
            ..Default::default()
        },
        CPU
    )
    .is_err());
    assert!(GRUCell::new(3, 4, CPU)
        .unwrap()
        .forward(&rand32(&[2, 5], 1))
        .is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn recurrent_modules_cpu_vs_cuda_forward_and_parameter_gradients() {
    manual_seed(7).unwrap();
    let x = rand32(&[3, 7, 5], 1);
    let (h0, c0) = (rand32(&[2, 3, 6], 2), rand32(&[2, 3, 6], 3));
    let lstm = LSTM::with_config(5, 6, config(2, true), CPU).unwrap();
    cpu_vs_cuda_module(
        "LSTM",
        &lstm,
        |m, d| {
            let (out, (hn, cn)) = m.forward_with(&x.to(d)?, Some((&h0.to(d)?, &c0.to(d)?)))?;
            Tensor::cat(&[out.flatten(0, -1)?, hn.flatten(0, -1)?, cn.flatten(0, -1)?], 0)
        },
        1e-4,
        1e-5,
    );
    let gru = GRU::with_config(5, 6, config(2, true), CPU).unwrap();
    cpu_vs_cuda_module(
        "GRU",
        &gru,
        |m, d| {
            let (out, hn) = m.forward_with(&x.to(d)?, Some(&h0.to(d)?))?;
            Tensor::cat(&[out.flatten(0, -1)?, hn.flatten(0, -1)?], 0)
        },
        1e-4,
        1e-5,
    );
    let rnn = RNN::with_config(
        5,
        6,
        RNNConfig {
            num_layers: 2,
            batch_first: true,
            ..Default::default()
        },
        CPU,
    )
    .unwrap();
    cpu_vs_cuda_module("RNN", &rnn, |m, d| m.forward(&x.to(d)?), 1e-4, 1e-5);
    let xs = rand32(&[3, 5], 4);
    let (h, c) = (rand32(&[3, 6], 5), rand32(&[3, 6], 6));
    let lstm_cell = LSTMCell::new(5, 6, CPU).unwrap();
    cpu_vs_cuda_module(
        "LSTMCell",
        &lstm_cell,
        |m, d| {
            let (h1, c1) = m.forward_with(&xs.to(d)?, Some((&h.to(d)?, &c.to(d)?)))?;
            h1.add(&c1.mul_scalar(0.5)?)
        },
        1e-4,
        1e-5,
    );
    let gru_cell = GRUCell::new(5, 6, CPU).unwrap();
    cpu_vs_cuda_module(
        "GRUCell",
        &gru_cell,
        |m, d| m.forward_with(&xs.to(d)?, Some(&h.to(d)?)),
        1e-4,
        1e-5,
    );
    let rnn_cell = RNNCell::new(5, 6, CPU).unwrap();
    cpu_vs_cuda_module(
        "RNNCell",
        &rnn_cell,
        |m, d| m.forward_with(&xs.to(d)?, Some(&h.to(d)?)),
        1e-4,
        1e-5,
    );
}
