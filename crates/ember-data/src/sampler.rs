//! Samplers (`torch.utils.data.Sampler`): the order in which a `DataLoader` visits indices.
//!
//! A [`Sampler`] hands out one epoch's indices at a time; [`RandomSampler`] draws a fresh
//! permutation each epoch from its ember [`Generator`] (the CPU default generator unless given
//! one), so `Generator::new(seed)` makes the whole sequence of epochs reproducible.
//! [`BatchSampler`] groups another sampler's indices into batches. [`DistributedSampler`]
//! gives each of the ranks of a distributed job its own share of the dataset.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

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

/// A shared sampler samples as itself: hand an `Arc` clone to the `DataLoader` and keep one,
/// e.g. to call [`DistributedSampler::set_epoch`] between epochs.
impl<S: Sampler + ?Sized> Sampler for Arc<S> {
    fn len(&self) -> usize {
        (**self).len()
    }

    fn indices(&self) -> Result<Vec<usize>> {
        (**self).indices()
    }
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

/// Where [`DistributedSampler::new`] reads `(world size, rank)` of the default process group
/// (Note [Sampler and the default group]); `None` until ember-distributed registers it.
static DEFAULT_GROUP: RwLock<Option<fn() -> Option<(usize, usize)>>> = RwLock::new(None);

/// Registers how to read the default process group's `(world size, rank)`, `None` while there
/// is none (Note [Sampler and the default group]). ember-distributed calls it from
/// `init_process_group`; a program has no reason to.
pub fn register_default_group(source: fn() -> Option<(usize, usize)>) {
    *DEFAULT_GROUP.write().unwrap_or_else(|e| e.into_inner()) = Some(source);
}

/// Rank `rank`'s share of a dataset of `len` samples split among `num_replicas` ranks
/// (`torch.utils.data.distributed.DistributedSampler`).
///
/// Every rank gets [`DistributedSampler::num_samples`] indices: the epoch's order (a
/// permutation when shuffling, else `0..len`) is padded by repeating its first indices up to
/// `num_samples * num_replicas` (or, with `drop_last`, cut down to it), and rank `r` takes
/// every `num_replicas`-th index from position `r` (`indices[rank:total_size:num_replicas]`),
/// PyTorch's arithmetic exactly.
///
/// Note [DistributedSampler permutations]: as in PyTorch, each epoch's permutation comes from
/// a generator seeded with `seed + epoch`, so every rank draws the same permutation without
/// communicating, and [`DistributedSampler::set_epoch`] must be called before each epoch for
/// the order to change. The generator is ember's (Philox, `Tensor::randperm_with`), so the
/// permutation for a seed differs from the one PyTorch draws; the padding and the split are
/// the same.
///
/// Note [Sampler and the default group]: [`DistributedSampler::new`]`(&dataset)` takes the
/// world size and rank from the default process group, as PyTorch's does. ember-data sits
/// below ember-distributed, so it cannot ask the group itself: ember-distributed registers
/// where to read them ([`register_default_group`]) when `init_process_group` succeeds, and
/// without an initialized group `new` is an error saying so. [`DistributedSampler::with_replicas`]
/// takes them explicitly (PyTorch's `num_replicas=`, `rank=`), as `new` did before.
///
/// ```
/// use std::sync::Arc;
/// use ember_data::{DistributedSampler, Sampler};
/// # fn main() -> ember_core::Result<()> {
/// let sampler = Arc::new(DistributedSampler::with_replicas(10, 4, 1)?.shuffle(false));
/// assert_eq!(sampler.indices()?, [1, 5, 9]); // 10 padded to 12: [0..10, 0, 1]
/// sampler.set_epoch(1); // between epochs (a no-op for the order without shuffle)
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: AtomicU64,
}

impl DistributedSampler {
    /// `DistributedSampler(dataset)`: this process's share of `dataset`, with the world size
    /// and rank of the default process group (Note [Sampler and the default group]) and
    /// PyTorch's defaults: shuffled, seed 0, no `drop_last` (change them builder-style). An
    /// [`Error::InvalidArgument`] when no default group is initialized.
    pub fn new<D: crate::Dataset + ?Sized>(dataset: &D) -> Result<DistributedSampler> {
        let source = *DEFAULT_GROUP.read().unwrap_or_else(|e| e.into_inner());
        let Some((num_replicas, rank)) = source.and_then(|f| f()) else {
            return Err(Error::invalid(
                "DistributedSampler::new",
                "the default process group is not initialized: call init_process_group first, \
                 or give num_replicas and rank with DistributedSampler::with_replicas",
            ));
        };
        DistributedSampler::with_replicas(dataset.len(), num_replicas, rank)
    }

    /// Rank `rank` of `num_replicas` over a dataset of `len` samples (PyTorch's
    /// `num_replicas=`, `rank=`), with PyTorch's defaults: shuffled, seed 0, no `drop_last`.
    /// [`Error::InvalidArgument`] when `num_replicas` is 0 or `rank` is not below it.
    pub fn with_replicas(len: usize, num_replicas: usize, rank: usize) -> Result<DistributedSampler> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(Error::invalid(
                "DistributedSampler::new",
                format!(
                    "invalid rank {rank}, rank should be in the interval [0, {}] (num_replicas = {num_replicas})",
                    num_replicas as i64 - 1
                ),
            ));
        }
        Ok(DistributedSampler {
            len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: AtomicU64::new(0),
        })
    }

    /// Whether each epoch is a permutation (true by default).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the permutations, the same on every rank (0 by default).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drops the tail that does not split evenly instead of padding (false by default).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch the next [`Sampler::indices`] draws its permutation for
    /// (Note [DistributedSampler permutations]).
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The epoch set last.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Indices per rank and epoch: `ceil(len / num_replicas)`, or `floor` with `drop_last`.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.num_replicas
        } else {
            self.len.div_ceil(self.num_replicas)
        }
    }

    /// Indices per epoch over all ranks, padding included.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }
}

impl Sampler for DistributedSampler {
    fn len(&self) -> usize {
        self.num_samples()
    }

    fn indices(&self) -> Result<Vec<usize>> {
        let mut indices: Vec<usize> = if self.shuffle {
            let gen = Generator::new(self.seed.wrapping_add(self.epoch()));
            let perm = Tensor::randperm_with(self.len, Device::Cpu, &gen)?.to_vec::<i64>()?;
            perm.into_iter().map(|i| i as usize).collect()
        } else {
            (0..self.len).collect()
        };
        let total = self.total_size();
        if self.drop_last {
            indices.truncate(total);
        } else if total > indices.len() && !indices.is_empty() {
            // indices += (indices * ceil(padding / len))[:padding]
            let padding = total - indices.len();
            let pad: Vec<usize> = indices.iter().copied().cycle().take(padding).collect();
            indices.extend(pad);
        }
        Ok(indices
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect())
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
