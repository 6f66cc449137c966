//! ember-core's integration tests: one binary, one module per feature (see DESIGN.md, Testing).

mod common;

mod amp_scaling;
mod autograd;
mod autograd_devices;
mod bad_input;
mod binary;
mod checkpoint;
mod conformance;
mod conv;
mod cuda;
mod cuda_capture;
mod cuda_elementwise;
mod cuda_graphs;
mod cuda_index;
mod cuda_matmul;
mod cuda_memory;
mod cuda_random;
mod cuda_reduce;
mod cuda_unary;
mod cudnn;
mod display;
mod errors;
mod fused_optim;
mod index;
mod inplace;
mod linear_bias;
mod matmul;
mod nll_loss;
mod profiler;
mod props;
mod random;
mod reduce;
mod rnn;
mod unary;
mod view;
