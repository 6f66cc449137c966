//! Recurrent layers as functions, with PyTorch's arguments: the single-step cells
//! (`rnn_tanh_cell`, `rnn_relu_cell`, `lstm_cell`, `gru_cell`) and the multi-layer,
//! unidirectional sequence forms (`rnn`, `lstm`, `gru`) are ember-core's ops
//! (`ember_core::ops::recurrent`, PyTorch's weight layout, gate order and equations), whose
//! arguments are already PyTorch's.

pub use ember_core::ops::recurrent::{
    gru, gru_cell, lstm, lstm_cell, rnn, rnn_relu_cell, rnn_tanh_cell, RnnNonlinearity,
};
