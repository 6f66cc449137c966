//! ember-nn: `Module`, layers, losses, initialization and optimizers (`torch.nn`,
//! `torch.optim`). The layers arrive with the training work; this crate already fixes where
//! they live in the dependency order: it builds on `ember-core` only.
#![forbid(unsafe_code)]

pub mod functional;
pub mod optim;
