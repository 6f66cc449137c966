//! Integration tests of ember-data, one module per feature (one test binary).

mod common;
mod dataset;
mod fashion_mnist;
mod idx;
mod loader;
mod sampler;
