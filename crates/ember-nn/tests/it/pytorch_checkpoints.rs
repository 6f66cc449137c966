//! Safetensors files written by PyTorch (`tests/fixtures/pytorch/`, made by `make.py` with
//! torch 2.11 and `safetensors.torch.save_file(model.state_dict(), path)`) load into the same
//! ember models, on every device, and give PyTorch's outputs: a small CNN with batch-norm
//! running statistics (eval mode) and a two-layer batch-first LSTM.

use crate::common::{assert_close, devices};
use ember_core::{Device, Tensor};
use ember_nn::functional::Pair;
use ember_nn::layers::{Conv2dConfig, RecurrentConfig};
use ember_nn::state_dict::load_tensors;
use ember_nn::{
    load_safetensors, BatchNorm2d, Conv2d, Flatten, Forward, Linear, ModuleExt, ReLU, Sequential, LSTM,
};
use std::path::PathBuf;

/// The fixture `name` as a file, written from the bytes built into this binary: the test
/// binary also runs away from the checkout (the GPU bundle), where the repository's path does
/// not exist. One folder for every run; each write goes to a name of its own (process and
/// thread) and is renamed into place, so that a test reading the file never sees it half
/// written and nothing piles up.
fn fixture(name: &str) -> PathBuf {
    let bytes: &[u8] = match name {
        "cnn.safetensors" => include_bytes!("../fixtures/pytorch/cnn.safetensors"),
        "cnn_io.safetensors" => include_bytes!("../fixtures/pytorch/cnn_io.safetensors"),
        "lstm.safetensors" => include_bytes!("../fixtures/pytorch/lstm.safetensors"),
        "lstm_io.safetensors" => include_bytes!("../fixtures/pytorch/lstm_io.safetensors"),
        _ => panic!("no fixture {name}"),
    };
    let dir = std::env::temp_dir().join("ember-tests-pytorch-fixtures");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let part = dir.join(format!(
        "{name}.{}.{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&part, bytes).unwrap();
    std::fs::rename(&part, &path).unwrap();
    path
}

/// The named tensors of a fixture file, on `device`.
fn tensors(name: &str, device: Device) -> Vec<(String, Tensor)> {
    load_tensors(fixture(name), device).unwrap()
}

fn get<'a>(ts: &'a [(String, Tensor)], key: &str) -> &'a Tensor {
    &ts.iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}"))
        .1
}

#[test]
fn pytorch_cnn_checkpoint_loads_and_matches_pytorch_output() {
    for device in devices() {
        let conv = Conv2dConfig {
            padding: Pair([1, 1]),
            ..Default::default()
        };
        let mut model = Sequential::new()
            .with(Conv2d::with_config(1, 2, 3, conv, device).unwrap())
            .with(BatchNorm2d::new(2, device).unwrap())
            .with(ReLU::new())
            .with(Flatten::new())
            .with(Linear::new(2 * 4 * 4, 3, device).unwrap());
        load_safetensors(&mut model, fixture("cnn.safetensors")).unwrap();
        let state = tensors("cnn.safetensors", Device::Cpu);
        // Every entry PyTorch wrote, the running statistics and the i64 counter included.
        let ours = model.state_dict();
        assert_eq!(ours.len(), state.len());
        for (k, t) in &state {
            let (_, mine) = ours
                .iter()
                .find(|(n, _)| n == k)
                .unwrap_or_else(|| panic!("{k} not loaded"));
            assert_eq!(mine.dtype(), t.dtype(), "{k}");
            assert_eq!(
                mine.to(Device::Cpu).unwrap().to_vec_f64().unwrap(),
                t.to_vec_f64().unwrap(),
                "{k}"
            );
        }
        model.eval();
        let io = tensors("cnn_io.safetensors", device);
        let out = model.forward(get(&io, "input")).unwrap();
        assert_close(&out, get(&io, "output"), 1e-5, 1e-6);
    }
}

#[test]
fn pytorch_lstm_checkpoint_loads_and_matches_pytorch_output() {
    for device in devices() {
        let config = RecurrentConfig {
            num_layers: 2,
            batch_first: true,
            ..Default::default()
        };
        let mut lstm = LSTM::with_config(3, 4, config, device).unwrap();
        load_safetensors(&mut lstm, fixture("lstm.safetensors")).unwrap();
        let io = tensors("lstm_io.safetensors", device);
        let (out, (h, c)) = lstm.forward_with(get(&io, "input"), None).unwrap();
        assert_close(&out, get(&io, "output"), 1e-5, 1e-6);
        assert_close(&h, get(&io, "h_n"), 1e-5, 1e-6);
        assert_close(&c, get(&io, "c_n"), 1e-5, 1e-6);
    }
}

#[test]
fn a_pytorch_checkpoint_of_another_model_is_rejected_with_its_keys() {
    let mut lstm = LSTM::new(3, 4, Device::Cpu).unwrap();
    let err = load_safetensors(&mut lstm, fixture("cnn.safetensors")).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("weight_ih_l0") && msg.contains("running_mean"),
        "{msg}"
    );
}
