//! ember-nn: `torch.nn` and `torch.optim` for ember. Builds on `ember-core` only.
//!
//! - `functional`: stateless layer ops and losses (`torch.nn.functional`), recurrent and
//!   attention forms included;
//! - `module`: the `Module` trait and `ModuleExt` (parameters, train/eval, device moves, state dicts);
//! - `layers`: the layer types (`Linear`, `Conv2d`, `BatchNorm2d`, `LSTM`, `MultiheadAttention`,
//!   `Transformer`, `Sequential`, ...) and the loss modules (`CrossEntropyLoss`, `MSELoss`, ...);
//! - `init`: `torch.nn.init`; `state_dict`: load checks and safetensors checkpoints;
//! - `optim`: optimizers, gradient clipping and LR schedulers (`torch.optim`);
//! - `amp`: `GradScaler`, dynamic loss scaling for mixed precision (`torch.amp`);
//! - `checkpoint`: activation checkpointing of a borrowed module (`torch.utils.checkpoint`);
//! - `graphs`: a module's forward and backward replayed from CUDA graphs
//!   (`torch.cuda.make_graphed_callables`).
#![forbid(unsafe_code)]

// `#[derive(Module)]` names this crate `::ember_nn`, also inside it.
extern crate self as ember_nn;

pub mod amp;
pub mod checkpoint;
pub mod data_parallel;
#[doc(hidden)]
pub mod derive_support;
pub mod functional;
pub mod graphs;
pub mod init;
pub mod layers;
pub mod module;
pub mod optim;
pub mod state_dict;

pub use data_parallel::DataParallel;
/// `#[derive(Module)]`: implements [`Module`] from a struct's fields (see `ember-derive`).
pub use ember_derive::Module;
pub use functional::Reduction;
pub use layers::{
    AdaptiveAvgPool2d, AvgPool2d, BCEWithLogitsLoss, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d,
    CrossEntropyLoss, Dropout, Embedding, Flatten, GRUCell, L1Loss, LSTMCell, LayerNorm, Linear, LogSoftmax,
    MSELoss, MaxPool2d, ModuleList, MultiheadAttention, NLLLoss, RNNCell, ReLU, Sequential, SiLU, Sigmoid,
    Softmax, Tanh, Transformer, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
    TransformerEncoderLayer, GELU, GRU, LSTM, RNN,
};
pub use module::{Forward, Module, ModuleExt, TensorKind, Training};
pub use state_dict::{load_safetensors, save_safetensors, IncompatibleKeys, StateDictError};
