//! ember-data: `Dataset`, `DataLoader`, samplers and dataset readers (`torch.utils.data`).
//!
//! - [`Dataset`] maps an index to a sample (a `Vec<Tensor>`, e.g. `[image, label]`);
//!   [`TensorDataset`] indexes the first dimension of a few tensors.
//! - Samplers choose the order: [`SequentialSampler`], [`RandomSampler`] (a permutation from an
//!   ember [`Generator`](ember_core::Generator), so a seed gives a reproducible order), and
//!   [`BatchSampler`], which groups indices into batches, and [`DistributedSampler`], each
//!   rank's share of the dataset in a distributed job.
//! - [`DataLoader`] puts them together: batches in sampler order, loaded in the caller or by
//!   worker threads ahead of use, collated by [`default_collate`] or a closure of yours.
//! - [`idx`] reads IDX files (the MNIST format, gzipped or not); [`datasets::FashionMnist`]
//!   reads Fashion-MNIST with them.
//!
//! It builds on `ember-core` only, and every error is an [`ember_core::Error`].
//!
//! ```
//! use ember_core::{DType, Device, Generator, Tensor};
//! use ember_data::{DataLoader, TensorDataset};
//! # fn main() -> ember_core::Result<()> {
//! let x = Tensor::arange(0.0, 10.0, 1.0, DType::F32, Device::Cpu)?.reshape(&[5, 2])?;
//! let y = Tensor::arange(0.0, 5.0, 1.0, DType::I64, Device::Cpu)?;
//! let loader = DataLoader::builder(TensorDataset::new(vec![x, y])?)
//!     .batch_size(2)
//!     .shuffle(true)
//!     .generator(Generator::new(0))
//!     .build()?;
//! assert_eq!(loader.len(), 3); // 2 + 2 + 1
//! for batch in &loader {
//!     let batch = batch?; // [x of [2, 2] (or [1, 2] last), y of [2] (or [1])]
//!     assert_eq!(batch[0].dims()[0], batch[1].dims()[0]);
//! }
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod collate;
pub mod dataset;
pub mod datasets;
pub mod idx;
pub mod loader;
pub mod sampler;

pub use collate::{default_collate, CollateFn};
pub use dataset::{Dataset, Sample, TensorDataset};
pub use loader::{DataLoader, DataLoaderBuilder, DataLoaderIter, Unpacked};
pub use sampler::{BatchSampler, DistributedSampler, RandomSampler, Sampler, SequentialSampler};
