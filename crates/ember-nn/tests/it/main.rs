//! ember-nn's integration tests: one binary, one module per feature (see DESIGN.md, Testing).

// ember-core's test helpers (devices(), gradcheck, closeness checks), shared by path.
#[path = "../../../ember-core/tests/it/common.rs"]
mod common;

mod attention_mha;
mod attention_modules;
mod autocast;
mod checkpoint_modules;
mod concurrency;
mod conformance;
mod containers;
mod data_parallel;
mod derive;
mod functional;
mod functional_door;
mod functional_loss;
mod grad_scaler;
mod graphed_training;
mod loss_modules;
mod modules;
mod optim_capture;
mod optim_fused;
mod optim_groups;
mod pytorch_checkpoints;
mod recurrent;
mod recurrent_modules;
mod transformer_modules;
