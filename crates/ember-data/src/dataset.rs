//! [`Dataset`] (`torch.utils.data.Dataset`) and [`TensorDataset`].
//!
//! A dataset maps an index in `0..len()` to a [`Sample`]: a tuple-like `Vec<Tensor>` whose
//! fields are in a fixed order (e.g. `[image, label]`). [`Dataset::get_batch`] returns a whole
//! collated batch; its default implementation stacks `get` calls, and datasets that can index
//! many rows at once (as [`TensorDataset`] with one `index_select` per tensor) override it.
//! The `DataLoader` calls `get_batch` unless it was given its own collate function.

use crate::collate::default_collate;
use ember_core::{DType, Error, Result, Tensor};
use std::sync::Arc;

/// One sample, or one collated batch: the fields in a fixed order (e.g. `[image, label]`).
pub type Sample = Vec<Tensor>;

/// A map-style dataset (`torch.utils.data.Dataset` with `__len__` and `__getitem__`).
///
/// It is `Send + Sync` because `DataLoader` workers read it from several threads at once.
pub trait Dataset: Send + Sync {
    /// The number of samples.
    fn len(&self) -> usize;

    /// True when the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index` (`dataset[index]`); an index `>= len()` is an
    /// [`Error::IndexOutOfRange`].
    fn get(&self, index: usize) -> Result<Sample>;

    /// The samples at `indices` collated into one batch: each field stacked along a new dim 0
    /// (as [`default_collate`] of the `get` calls, which is the default implementation).
    /// Override it where a batch can be read at once.
    fn get_batch(&self, indices: &[usize]) -> Result<Sample> {
        let samples = indices.iter().map(|&i| self.get(i)).collect::<Result<Vec<_>>>()?;
        default_collate(samples)
    }
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        (**self).get(index)
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Sample> {
        (**self).get_batch(indices)
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        (**self).get(index)
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Sample> {
        (**self).get_batch(indices)
    }
}

/// Tensors indexed together along their first dimension (`torch.utils.data.TensorDataset`):
/// sample `i` is `[t[i] for t in tensors]`, and a batch is one `index_select` per tensor.
#[derive(Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
}

impl TensorDataset {
    /// A dataset over `tensors`, which must be non-empty, each of rank >= 1, all with the same
    /// size of dim 0 (else [`Error::InvalidArgument`] or [`Error::ShapeMismatch`]).
    pub fn new(tensors: Vec<Tensor>) -> Result<TensorDataset> {
        const OP: &str = "TensorDataset::new";
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid(OP, "expected at least one tensor"))?;
        for (i, t) in tensors.iter().enumerate() {
            if t.rank() == 0 {
                return Err(Error::invalid(
                    OP,
                    format!("tensor {i} is zero-dimensional; every tensor needs a first dimension to index"),
                ));
            }
        }
        let n = first.dims()[0];
        if let Some(bad) = tensors.iter().find(|t| t.dims()[0] != n) {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: first.shape().clone(),
                rhs: bad.shape().clone(),
                hint: "size mismatch between tensors: all must have the same size of dim 0",
            });
        }
        Ok(TensorDataset { tensors })
    }

    /// The tensors, in field order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The tensors, in field order, by value.
    pub fn into_tensors(self) -> Vec<Tensor> {
        self.tensors
    }

    fn check(&self, index: usize) -> Result<()> {
        let size = self.len();
        if index >= size {
            return Err(Error::IndexOutOfRange {
                op: "TensorDataset::get",
                index: index as i64,
                dim: 0,
                size,
            });
        }
        Ok(())
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.tensors[0].dims()[0]
    }

    fn get(&self, index: usize) -> Result<Sample> {
        self.check(index)?;
        self.tensors.iter().map(|t| t.select(0, index as isize)).collect()
    }

    /// One `index_select` along dim 0 per tensor (no per-sample stacking).
    fn get_batch(&self, indices: &[usize]) -> Result<Sample> {
        for &i in indices {
            self.check(i)?;
        }
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let mut index_on: Vec<(ember_core::Device, Tensor)> = Vec::new();
        self.tensors
            .iter()
            .map(|t| {
                let device = t.device();
                let index = match index_on.iter().find(|(d, _)| *d == device) {
                    Some((_, index)) => index.clone(),
                    None => {
                        let index =
                            Tensor::from_slice(&idx, [idx.len()], ember_core::Device::Cpu)?.to(device)?;
                        index_on.push((device, index.clone()));
                        index
                    }
                };
                debug_assert_eq!(index.dtype(), DType::I64);
                t.index_select(0, &index)
            })
            .collect()
    }
}

impl std::fmt::Debug for TensorDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shapes: Vec<String> = self.tensors.iter().map(|t| t.shape().to_string()).collect();
        write!(
            f,
            "TensorDataset(len={}, tensors=[{}])",
            self.len(),
            shapes.join(", ")
        )
    }
}
