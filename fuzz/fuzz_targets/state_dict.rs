//! State dicts from a safetensors file loaded into a module (strictly and not), into Adam and
//! SGD, and into a GradScaler: every check of names, shapes, dtypes and optimizer keys.
#![no_main]

use ember::nn::optim::Optimizer;
use ember::nn::state_dict::load_tensors_from_bytes;
use ember::nn::ModuleExt;
use ember::Device;
use ember_fuzz::{adam, scaler, sgd, Zoo};

ember_fuzz::reader_target!(|data| {
    let Ok(state) = load_tensors_from_bytes(data, Device::Cpu) else {
        return;
    };
    let mut zoo = Zoo::new().expect("the model builds");
    let _ = zoo.load_state_dict(&state, true);
    let _ = zoo.load_state_dict(&state, false);
    let _ = adam(zoo.parameters())
        .expect("Adam builds")
        .load_state_dict(&state);
    let _ = sgd(zoo.parameters()).expect("SGD builds").load_state_dict(&state);
    let _ = scaler().expect("the scaler builds").load_state_dict(&state);
});
