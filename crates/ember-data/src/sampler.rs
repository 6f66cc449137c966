//! Samplers (`torch.utils.data.Sampler`): the order in which a `DataLoader` visits indices.
//!
//! A [`Sampler`] hands out one epoch's indices at a time; [`RandomSampler`] draws a fresh
//! permutation each epoch from its ember [`Generator`] (the CPU default generator unless given
//! one), so `Generator::new(seed)` makes the whole sequence of epochs reproducible.
//! [`BatchSampler`] groups another sampler's indices into batches.

use ember_core::{default_generator, Device, Error, Generator, Result, Tensor};

/// An order of dataset indices (`torch.utils.data.Sampler`).
pub trait Sampler: Send + Sync {
    /// The number of indices in one epoch.
    fn len(&self) -> usize;

    /// True when an epoch has no indices.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indices of the next epoch, in order (`iter(sampler)`); each call starts an epoch.
    fn indices(&self) -> Result<Vec<usize>>;
}

/// `0, 1, ..., len - 1` (`SequentialSampler`).
#[derive(Debug, Clone)]
pub struct SequentialSampler {
    len: usize,
}

impl SequentialSampler {
    /// The indices of a dataset of `len` samples, in order.
    pub fn new(len: usize) -> SequentialSampler {
        SequentialSampler { len }
    }
}

impl Sampler for SequentialSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self) -> Result<Vec<usize>> {
        Ok((0..self.len).collect())
    }
}

/// A random permutation of `0..len`, a new one each epoch (`RandomSampler` without
/// replacement), drawn with `Tensor::randperm_with` from an ember [`Generator`].
#[derive(Debug, Clone)]
pub struct RandomSampler {
    len: usize,
    generator: Option<Generator>,
}

impl RandomSampler {
    /// Permutations drawn from the CPU default generator (so `manual_seed` fixes them).
    pub fn new(len: usize) -> RandomSampler {
        RandomSampler { len, generator: None }
    }

    /// Permutations drawn from `generator`: the same seed gives the same epochs.
    pub fn with_generator(len: usize, generator: Generator) -> RandomSampler {
        RandomSampler {
            len,
            generator: Some(generator),
        }
    }

    /// The generator of this sampler (`None`: the CPU default generator).
    pub fn generator(&self) -> Option<&Generator> {
        self.generator.as_ref()
    }
}

impl Sampler for RandomSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self) -> Result<Vec<usize>> {
        let gen = match &self.generator {
            Some(g) => g,
            None => default_generator(Device::Cpu),
        };
        let perm = Tensor::randperm_with(self.len, Device::Cpu, gen)?.to_vec::<i64>()?;
        Ok(perm.into_iter().map(|i| i as usize).collect())
    }
}

/// Another sampler's indices in batches of `batch_size` (`BatchSampler`); the last batch is
/// smaller when the length does not divide evenly, or left out when `drop_last`.
pub struct BatchSampler {
    sampler: Box<dyn Sampler>,
    batch_size: usize,
    drop_last: bool,
}

impl BatchSampler {
    /// Batches of `batch_size >= 1` indices from `sampler` (else [`Error::InvalidArgument`]).
    pub fn new(sampler: impl Sampler + 'static, batch_size: usize, drop_last: bool) -> Result<BatchSampler> {
        BatchSampler::from_boxed(Box::new(sampler), batch_size, drop_last)
    }

    /// As [`BatchSampler::new`] with a boxed sampler.
    pub fn from_boxed(sampler: Box<dyn Sampler>, batch_size: usize, drop_last: bool) -> Result<BatchSampler> {
        if batch_size == 0 {
            return Err(Error::invalid(
                "BatchSampler::new",
                "batch_size should be a positive integer, got 0",
            ));
        }
        Ok(BatchSampler {
            sampler,
            batch_size,
            drop_last,
        })
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// The number of batches in one epoch.
    pub fn len(&self) -> usize {
        let n = self.sampler.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// True when an epoch has no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batches of the next epoch, in order.
    pub fn batches(&self) -> Result<Vec<Vec<usize>>> {
        let indices = self.sampler.indices()?;
        let mut batches: Vec<Vec<usize>> = indices.chunks(self.batch_size).map(<[usize]>::to_vec).collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
            batches.pop();
        }
        Ok(batches)
    }
}

impl std::fmt::Debug for BatchSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BatchSampler(len={}, batch_size={}, drop_last={})",
            self.sampler.len(),
            self.batch_size,
            self.drop_last
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_and_batches() {
        let b = BatchSampler::new(SequentialSampler::new(7), 3, false).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b.batches().unwrap(), vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
        let b = BatchSampler::new(SequentialSampler::new(7), 3, true).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b.batches().unwrap(), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        let b = BatchSampler::new(SequentialSampler::new(6), 3, true).unwrap();
        assert_eq!(b.batches().unwrap().len(), 2);
        assert!(BatchSampler::new(SequentialSampler::new(6), 0, true).is_err());
    }

    #[test]
    fn random_sampler_epochs_differ_but_replay() {
        let a = RandomSampler::with_generator(50, Generator::new(3));
        let b = RandomSampler::with_generator(50, Generator::new(3));
        let (a1, a2) = (a.indices().unwrap(), a.indices().unwrap());
        assert_ne!(a1, a2, "each epoch draws a new permutation");
        assert_eq!(a1, b.indices().unwrap());
        assert_eq!(a2, b.indices().unwrap());
        let mut sorted = a1.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    }
}
