//! `ember train --resume`: a checkpoint's bytes restored into a model, Adam, a GradScaler and
//! the generators, by `ember train`'s own code (included by path).
#![no_main]

#[allow(dead_code)]
#[path = "../../crates/ember/src/train/checkpoint.rs"]
mod checkpoint;

use ember::nn::ModuleExt;
use ember_fuzz::{adam, scaler, Mlp};

ember_fuzz::reader_target!(|data| {
    let mut model = Mlp::new().expect("the model builds");
    let mut opt = adam(model.parameters()).expect("Adam builds");
    let mut scaler = scaler().expect("the scaler builds");
    let _ = checkpoint::restore_checkpoint(data, "mlp", &mut model, &mut opt, &mut scaler);
});
