//! ember-nn: `torch.nn` and `torch.optim` for ember. `functional` holds the stateless layer
//! ops and losses (`torch.nn.functional`), `optim` the optimizers, gradient clipping and LR
//! schedulers. Module types (`Linear`, `Conv2d`, ...) come next. Builds on `ember-core` only.
#![forbid(unsafe_code)]

pub mod functional;
pub mod optim;
