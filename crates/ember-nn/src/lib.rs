//! ember-nn: `torch.nn` and `torch.optim` for ember. `functional` holds the stateless layer
//! ops and losses (`torch.nn.functional`), `optim` the optimizers, gradient clipping and LR
//! schedulers. `module` holds the `Module`
//! trait, `layers` the layer types (`Linear`, `Conv2d`, ...), `init` `torch.nn.init`, and
//! `state_dict` loading checks and safetensors checkpoints. Builds on `ember-core` only.
#![forbid(unsafe_code)]

pub mod functional;
pub mod init;
pub mod layers;
pub mod module;
pub mod optim;
pub mod state_dict;

pub use layers::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, Dropout, Embedding, Flatten,
    LayerNorm, Linear, LogSoftmax, MaxPool2d, ModuleList, ReLU, Sequential, SiLU, Sigmoid, Softmax, Tanh,
    GELU,
};
pub use module::{Module, ModuleExt, TensorKind};
pub use state_dict::{load_safetensors, save_safetensors, IncompatibleKeys, StateDictError};
