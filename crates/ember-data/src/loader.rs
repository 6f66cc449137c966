//! [`DataLoader`] (`torch.utils.data.DataLoader`): batches of a [`Dataset`] in sampler order.
//!
//! Note [Worker order]: with `num_workers > 0`, `iter()` starts that many threads
//! (`ember-data-worker-{i}`) and hands batch `b` to worker `b % num_workers`, as PyTorch does.
//! At most `prefetch_factor * num_workers` batches are outstanding (sent to a worker and not
//! yet yielded): the main thread sends a new task only when it yields a batch, so the bounded
//! result channel of that capacity never blocks a worker. Workers finish out of order; the
//! iterator keeps early results in a reorder buffer (also within that bound) and yields
//! batches strictly in sampler order, so the batches are exactly those of `num_workers = 0`.
//! A worker that panics reports the panic as an `Err` batch instead of leaving a hole.
//! Dropping the iterator raises a stop flag and closes the task channels; each worker finishes
//! at most the batch in its hands, and the drop joins them all.
//!
//! Collation: without a collate function a batch is `Dataset::get_batch(indices)` (one
//! `index_select` per tensor for a `TensorDataset`; stacked `get` calls otherwise); with one,
//! it is `collate(indices.map(get))`. With `pin_memory`, each CPU tensor of the batch is then
//! copied to page-locked memory (`Tensor::pin_memory`) in the thread that loaded it.

use crate::collate::CollateFn;
use crate::dataset::{Dataset, Sample};
use crate::sampler::{BatchSampler, RandomSampler, Sampler, SequentialSampler};
use ember_core::{Device, Error, Generator, Result, Tensor};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The `prefetch_factor` used when workers are asked for and none is given (PyTorch's).
pub const DEFAULT_PREFETCH_FACTOR: usize = 2;

/// Batches of a dataset, in the order of a batch sampler (`torch.utils.data.DataLoader`).
/// Build one with [`DataLoader::builder`]; iterate with `for batch in &loader`.
pub struct DataLoader {
    fetcher: Arc<Fetcher>,
    batch_sampler: BatchSampler,
    num_workers: usize,
    prefetch_factor: usize,
}

/// What a loading thread (the caller or a worker) needs to turn indices into a batch.
struct Fetcher {
    dataset: Arc<dyn Dataset>,
    collate: Option<Arc<CollateFn>>,
    pin_memory: bool,
}

impl Fetcher {
    fn fetch(&self, indices: &[usize]) -> Result<Sample> {
        let batch = match &self.collate {
            Some(collate) => {
                let samples = indices
                    .iter()
                    .map(|&i| self.dataset.get(i))
                    .collect::<Result<Vec<_>>>()?;
                collate(samples)?
            }
            None => self.dataset.get_batch(indices)?,
        };
        if !self.pin_memory {
            return Ok(batch);
        }
        batch
            .into_iter()
            .map(|t| {
                if t.device() == Device::Cpu {
                    t.pin_memory()
                } else {
                    Ok(t)
                }
            })
            .collect()
    }
}

impl DataLoader {
    /// A builder over `dataset` with PyTorch's defaults: `batch_size` 1, no shuffle, no
    /// `drop_last`, `num_workers` 0, no pinned memory, [`default_collate`](crate::default_collate).
    /// An `Arc<D>` is a dataset too, to share one dataset between loaders.
    pub fn builder(dataset: impl Dataset + 'static) -> DataLoaderBuilder {
        DataLoaderBuilder {
            dataset: Arc::new(dataset),
            batch_size: 1,
            shuffle: false,
            generator: None,
            sampler: None,
            drop_last: false,
            num_workers: 0,
            prefetch_factor: None,
            pin_memory: false,
            collate: None,
        }
    }

    /// Sequential batches of `batch_size` in the caller's thread (the last one may be smaller).
    pub fn new(dataset: impl Dataset + 'static, batch_size: usize) -> Result<DataLoader> {
        DataLoader::builder(dataset).batch_size(batch_size).build()
    }

    /// The number of batches in one epoch (`len(loader)`).
    pub fn len(&self) -> usize {
        self.batch_sampler.len()
    }

    /// True when an epoch has no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.fetcher.dataset
    }

    pub fn batch_size(&self) -> usize {
        self.batch_sampler.batch_size()
    }

    pub fn drop_last(&self) -> bool {
        self.batch_sampler.drop_last()
    }

    pub fn num_workers(&self) -> usize {
        self.num_workers
    }

    /// Batches each worker may have in flight (0 without workers).
    pub fn prefetch_factor(&self) -> usize {
        self.prefetch_factor
    }

    pub fn pin_memory(&self) -> bool {
        self.fetcher.pin_memory
    }

    /// One epoch (`iter(loader)`): draws the epoch's order from the sampler and, with
    /// workers, starts them. A failure to do either is the iterator's first and only item.
    pub fn iter(&self) -> DataLoaderIter {
        let mut it = DataLoaderIter {
            fetcher: self.fetcher.clone(),
            batches: Vec::new().into_iter(),
            total: 0,
            next_out: 0,
            pending_error: None,
            pool: None,
        };
        let batches = match self.batch_sampler.batches() {
            Ok(b) => b,
            Err(e) => {
                it.pending_error = Some(e);
                return it;
            }
        };
        it.total = batches.len();
        it.batches = batches.into_iter();
        if self.num_workers > 0 && it.total > 0 {
            match Pool::start(&self.fetcher, self.num_workers, self.prefetch_factor) {
                Ok(pool) => {
                    it.pool = Some(pool);
                    it.dispatch();
                }
                Err(e) => it.pending_error = Some(e),
            }
        }
        it
    }
}

impl DataLoader {
    /// One epoch whose batches are arrays of exactly `N` fields, to unpack as PyTorch's
    /// `for inputs, labels in loader`:
    /// `for batch in loader.unpacked() { let [inputs, labels] = batch?; .. }` (`N` comes from
    /// the pattern). A batch with another number of fields is an [`Error::InvalidArgument`]
    /// naming both counts.
    pub fn unpacked<const N: usize>(&self) -> Unpacked<N> {
        Unpacked { inner: self.iter() }
    }
}

/// The iterator of [`DataLoader::unpacked`]: each batch as `[Tensor; N]`.
pub struct Unpacked<const N: usize> {
    inner: DataLoaderIter,
}

impl<const N: usize> Iterator for Unpacked<N> {
    type Item = Result<[Tensor; N]>;

    fn next(&mut self) -> Option<Result<[Tensor; N]>> {
        let batch = self.inner.next()?;
        Some(batch.and_then(|fields| {
            let got = fields.len();
            fields.try_into().map_err(|_| {
                Error::invalid(
                    "DataLoader::unpacked",
                    format!("the batch has {got} fields, but {N} are unpacked"),
                )
            })
        }))
    }
}

impl IntoIterator for &DataLoader {
    type Item = Result<Sample>;
    type IntoIter = DataLoaderIter;

    fn into_iter(self) -> DataLoaderIter {
        self.iter()
    }
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("dataset_len", &self.fetcher.dataset.len())
            .field("batch_sampler", &self.batch_sampler)
            .field("num_workers", &self.num_workers)
            .field("prefetch_factor", &self.prefetch_factor)
            .field("pin_memory", &self.fetcher.pin_memory)
            .field("custom_collate", &self.fetcher.collate.is_some())
            .finish()
    }
}

/// Options of a [`DataLoader`], named as PyTorch's arguments; [`DataLoaderBuilder::build`]
/// checks them together.
pub struct DataLoaderBuilder {
    dataset: Arc<dyn Dataset>,
    batch_size: usize,
    shuffle: bool,
    generator: Option<Generator>,
    sampler: Option<Box<dyn Sampler>>,
    drop_last: bool,
    num_workers: usize,
    prefetch_factor: Option<usize>,
    pin_memory: bool,
    collate: Option<Arc<CollateFn>>,
}

impl DataLoaderBuilder {
    /// Samples per batch (>= 1; default 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// A new random order each epoch (a [`RandomSampler`]); default false.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The generator the shuffle draws from (default: the CPU default generator).
    pub fn generator(mut self, generator: Generator) -> Self {
        self.generator = Some(generator);
        self
    }

    /// A sampler of your own for the order of indices (not together with `shuffle`).
    pub fn sampler(mut self, sampler: impl Sampler + 'static) -> Self {
        self.sampler = Some(Box::new(sampler));
        self
    }

    /// Leave out the last batch when it would be smaller than `batch_size`; default false.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Worker threads that load batches ahead; 0 (the default) loads in the caller's thread.
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Batches each worker loads ahead (>= 1; default 2; only with `num_workers > 0`).
    pub fn prefetch_factor(mut self, prefetch_factor: usize) -> Self {
        self.prefetch_factor = Some(prefetch_factor);
        self
    }

    /// Copy each batch's CPU tensors to page-locked memory. Without CUDA there is nothing to
    /// pin with: as PyTorch, [`build`](Self::build) then warns once per process (on stderr)
    /// and the loader continues unpinned, so device-agnostic code runs on any machine.
    pub fn pin_memory(mut self, pin_memory: bool) -> Self {
        self.pin_memory = pin_memory;
        self
    }

    /// Your own collate function, from the batch's samples (in order) to one batch; it
    /// replaces [`Dataset::get_batch`] and [`default_collate`](crate::default_collate).
    pub fn collate_fn<F>(mut self, collate: F) -> Self
    where
        F: Fn(Vec<Sample>) -> Result<Sample> + Send + Sync + 'static,
    {
        self.collate = Some(Arc::new(collate));
        self
    }

    /// The loader, after checking the options (each bad one is an [`Error::InvalidArgument`]
    /// naming it; `pin_memory` without CUDA warns once and is turned off).
    pub fn build(self) -> Result<DataLoader> {
        const OP: &str = "DataLoader";
        if self.batch_size == 0 {
            return Err(Error::invalid(
                OP,
                "batch_size should be a positive integer, got 0",
            ));
        }
        let prefetch_factor = match (self.num_workers, self.prefetch_factor) {
            (0, Some(_)) => {
                return Err(Error::invalid(
                    OP,
                    "prefetch_factor option could only be specified in multiprocessing: let num_workers > 0 to enable it",
                ))
            }
            (0, None) => 0,
            (_, Some(0)) => return Err(Error::invalid(OP, "prefetch_factor should be a positive integer, got 0")),
            (_, Some(p)) => p,
            (_, None) => DEFAULT_PREFETCH_FACTOR,
        };
        let pin_memory = self.pin_memory && ember_core::cuda::is_available();
        if self.pin_memory && !pin_memory {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "warning: DataLoader: 'pin_memory' is set but no CUDA device is available, so no \
                     memory is pinned (batches stay in pageable memory)"
                )
            });
        }
        let n = self.dataset.len();
        let sampler: Box<dyn Sampler> = match (self.sampler, self.shuffle) {
            (Some(_), true) => {
                return Err(Error::invalid(
                    OP,
                    "sampler option is mutually exclusive with shuffle",
                ))
            }
            (Some(s), false) => s,
            (None, true) => Box::new(match self.generator {
                Some(g) => RandomSampler::with_generator(n, g),
                None => RandomSampler::new(n),
            }),
            (None, false) => Box::new(SequentialSampler::new(n)),
        };
        let batch_sampler = BatchSampler::from_boxed(sampler, self.batch_size, self.drop_last)?;
        Ok(DataLoader {
            fetcher: Arc::new(Fetcher {
                dataset: self.dataset,
                collate: self.collate,
                pin_memory,
            }),
            batch_sampler,
            num_workers: self.num_workers,
            prefetch_factor,
        })
    }
}

/// One epoch of a [`DataLoader`]: `Result<Sample>` batches in sampler order.
pub struct DataLoaderIter {
    fetcher: Arc<Fetcher>,
    /// Batches not yet loaded (caller) or not yet sent to a worker.
    batches: std::vec::IntoIter<Vec<usize>>,
    total: usize,
    /// The index of the next batch to yield.
    next_out: usize,
    /// A failure of `iter()` itself, yielded first and alone.
    pending_error: Option<Error>,
    pool: Option<Pool>,
}

/// Worker threads of one epoch (Note [Worker order]).
struct Pool {
    tasks: Vec<Sender<(usize, Vec<usize>)>>,
    results: Receiver<(usize, Result<Sample>)>,
    reorder: HashMap<usize, Result<Sample>>,
    /// The index of the next batch to send to a worker.
    next_send: usize,
    /// Batches allowed outstanding: `prefetch_factor * num_workers`.
    window: usize,
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
}

impl Pool {
    fn start(fetcher: &Arc<Fetcher>, num_workers: usize, prefetch_factor: usize) -> Result<Pool> {
        let window = num_workers.saturating_mul(prefetch_factor);
        let (result_tx, results) = mpsc::sync_channel(window);
        let stop = Arc::new(AtomicBool::new(false));
        let mut pool = Pool {
            tasks: Vec::with_capacity(num_workers),
            results,
            reorder: HashMap::new(),
            next_send: 0,
            window,
            stop: stop.clone(),
            handles: Vec::with_capacity(num_workers),
        };
        for id in 0..num_workers {
            let (task_tx, task_rx) = mpsc::channel();
            let (fetcher, result_tx, stop) = (fetcher.clone(), result_tx.clone(), stop.clone());
            let handle = std::thread::Builder::new()
                .name(format!("ember-data-worker-{id}"))
                .spawn(move || worker_loop(id, &fetcher, &task_rx, &result_tx, &stop))
                .map_err(|e| {
                    Error::invalid("DataLoader", format!("could not start worker thread {id}: {e}"))
                })?;
            pool.tasks.push(task_tx);
            pool.handles.push(handle);
        }
        Ok(pool)
    }
}

fn worker_loop(
    id: usize,
    fetcher: &Fetcher,
    tasks: &Receiver<(usize, Vec<usize>)>,
    results: &SyncSender<(usize, Result<Sample>)>,
    stop: &AtomicBool,
) {
    while let Ok((batch, indices)) = tasks.recv() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let out = catch_unwind(AssertUnwindSafe(|| fetcher.fetch(&indices))).unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic payload".into());
            Err(Error::invalid(
                "DataLoader",
                format!("worker {id} panicked while loading batch {batch}: {msg}"),
            ))
        });
        if results.send((batch, out)).is_err() {
            return;
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.tasks.clear(); // closes the task channels: idle workers return from `recv`
        for handle in self.handles.drain(..) {
            // A worker's panics are caught in `worker_loop`; nothing else can fail in a join.
            let _ = handle.join();
        }
    }
}

impl DataLoaderIter {
    /// Sends batches to workers until the window of outstanding batches is full.
    fn dispatch(&mut self) {
        let Some(pool) = &mut self.pool else { return };
        while pool.next_send < self.total && pool.next_send - self.next_out < pool.window {
            let indices = self.batches.next().expect("one index list per batch");
            let worker = pool.next_send % pool.tasks.len();
            // A send fails only when that worker has exited; `next` then reports it.
            let _ = pool.tasks[worker].send((pool.next_send, indices));
            pool.next_send += 1;
        }
    }

    fn next_from_pool(&mut self) -> Result<Sample> {
        let pool = self.pool.as_mut().expect("called with workers");
        loop {
            if let Some(batch) = pool.reorder.remove(&self.next_out) {
                return batch;
            }
            match pool.results.recv_timeout(std::time::Duration::from_millis(100)) {
                Ok((i, batch)) => {
                    pool.reorder.insert(i, batch);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(dead) = pool.handles.iter().position(|h| h.is_finished()) {
                        // Workers exit early only when a task channel broke: this batch is lost.
                        return Err(Error::invalid(
                            "DataLoader",
                            format!(
                                "worker {dead} exited unexpectedly before batch {} was loaded",
                                self.next_out
                            ),
                        ));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::invalid(
                        "DataLoader",
                        format!("all workers exited before batch {} was loaded", self.next_out),
                    ))
                }
            }
        }
    }
}

impl Iterator for DataLoaderIter {
    type Item = Result<Sample>;

    fn next(&mut self) -> Option<Result<Sample>> {
        if let Some(e) = self.pending_error.take() {
            self.next_out = self.total;
            self.pool = None;
            return Some(Err(e));
        }
        if self.next_out >= self.total {
            self.pool = None; // the epoch is over: stop and join the workers now
            return None;
        }
        let batch = if self.pool.is_some() {
            let batch = self.next_from_pool();
            if batch.is_err()
                && self
                    .pool
                    .as_ref()
                    .is_some_and(|p| p.handles.iter().any(|h| h.is_finished()))
            {
                // A broken pool cannot deliver the rest in order: end the epoch with this error.
                self.next_out = self.total;
                self.pool = None;
                return Some(batch);
            }
            batch
        } else {
            let indices = self.batches.next().expect("one index list per batch");
            self.fetcher.fetch(&indices)
        };
        self.next_out += 1;
        self.dispatch();
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.total - self.next_out + usize::from(self.pending_error.is_some());
        (left, Some(left))
    }
}
