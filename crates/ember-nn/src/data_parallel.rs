//! [`DataParallel`] (`torch.nn.DataParallel`): one process drives several devices. Each forward
//! splits the batch along dim 0 into one chunk per device (`scatter`), copies the module to the
//! other devices (`replicate`: its parameters through differentiable copies, so every replica's
//! gradients flow back and add up in the original parameters' `.grad`; buffers copied
//! detached), runs the replicas in parallel (`parallel_apply`: the first device's on the
//! calling thread, each other device's on a worker thread of its own, under the caller's grad
//! mode and autocast state), and concatenates the outputs on the output device (`gather`). Backward needs nothing more: the original parameters get the sum of the
//! replicas' gradients, which is the full batch's gradient when the loss sums (or averages)
//! over the gathered batch.
//!
//! As in PyTorch, the module's parameters and buffers must live on the first device; with one
//! device (or none: a machine without GPUs) the wrapper just calls the module. Replicating on
//! every forward costs a copy of the parameters per extra device, which is why PyTorch
//! recommends DistributedDataParallel; buffer updates made by replicas (batch-norm running
//! statistics) are lost, as in PyTorch.
//!
//! Note [DataParallel workers]: PyTorch's `parallel_apply` starts a thread per device on every
//! forward, which is cheap there because cuDNN's algorithm choices and cuBLAS's state are
//! process-wide. ember keeps its cuDNN and cuBLASLt plans, workspaces and bound context per
//! thread (Note [cuDNN state], Note [cuBLASLt state]), so a fresh thread per forward chose
//! every convolution's algorithm again on every step. The wrapper therefore keeps one
//! long-lived worker per extra device, started on the first parallel forward and stopped
//! (joined) when the wrapper is dropped, and runs the first device's replica (the module
//! itself) on the caller's thread. Each replica's nodes are numbered from 0, as on a fresh
//! thread (`autograd::with_fresh_sequence_nr`, see `apply`).
//!
//! Backward needs nothing of the wrapper: the engine runs each other device's share of the
//! graph on that device's thread (Note [Device threads] in ember-core's `autograd/engine.rs`),
//! the first device's on the calling thread, so the replicas' backward passes overlap on the
//! host as their forward passes do, as in PyTorch. Before, the calling thread ran every
//! replica's backward. On two H100s dp_mlp_large went from 3.95 to 3.93 ms per step; dp_cnn,
//! host-bound, measured 1.19 to 1.92 ms against 1.43 to 2.13 before, on a host too noisy that
//! day to tell them apart better.
//!
//! Note [DataParallel row blocks]: the replicas' gradients come back to the first device
//! through their copies' backward (`to`), each once complete. The gradient of an MLP's first
//! layer is the last one backward makes, so its copy runs after its whole GEMM with nothing
//! left to overlap: mlp_large's 200 MB weight leaves a 0.53 ms copy after a 0.56 ms GEMM on two
//! H100s. A replica's copy of a 2-D float weight of at least 16 MiB has its gradient
//! computed in row blocks of 32 MiB (at least one, at most 4), an event after each (Note
//! [Gradients in row blocks] in ember-core), and the gradient crosses back block by block,
//! each copy started once its rows are written, on the copy engines, so the first blocks
//! travel while the last ones are computed. Each block's copy runs on a side stream of its own
//! (behind another private copy, which waits for everything its source's stream had queued,
//! it would wait for the whole GEMM), into memory from the pool of a side stream of the first
//! device (from the first device's own stream, it would wait for that device's share of the
//! same GEMM). On two H100s dp_mlp_large went from 3.91 to 3.52 ms per step (one GPU: 2.20 ms
//! either way); the four blocks' GEMMs take 0.60 ms against 0.55 ms for one. (DDP all-reduces
//! such a gradient block by block too: Note [DDP row blocks] in ember-distributed.)
//! A weight of one block (mlp_large's 40 MB second layer) gets its one event too. Without it,
//! its gradient crossed when the copy's backward ran, which the engine reaches only after the
//! first layer's backward is queued (the copy was made before the forward), so the copy
//! waited for the first layer's whole GEMM: in a trace on two H200s the second layer's
//! gradient was written 1.28 ms into the step and crossed at 2.06 ms, and the first device
//! waited for it before the optimizer step. With the event, dp_mlp_large on two H200s went
//! from 2.905 to 2.801 ms per step (one GPU: 2.07 ms).
//!
//! The same weights go out in the same row blocks (`cuda::comm::to_in_row_blocks`, Note
//! [Copies in row blocks] in ember-core), after the small tensors (a replica needs its biases
//! before its first product): the copies run on a side stream, so the first device's own
//! replica starts at once, and each other device's `linear` computes the columns of each
//! block as soon as its rows have arrived, so the first layer's product overlaps the copy
//! instead of following it. Blocks going out were 8 MiB before: mlp_large's 40 MB second
//! layer crossed in four, and on two H200s the replica's four products took 176 us against
//! 107 us for one, while that copy was done before the replica reached it; with one block,
//! dp_mlp_large on two H200s went from 2.801 to 2.739 ms per step.
//! Tried and left out: Adam updating the first layer's weight in row blocks, first, and each
//! block's copy to the replica starting once its update was written (the copy waits for the
//! whole optimizer step). The first device's wait for the replica's output went from ~200 to
//! ~60 us, but the updates, now beside the copies, took 552 against 492 us, and the batch's
//! scatter and the small tensors' copy, on the first device's stream, queued behind the
//! weight's copies on the copy engine: 2.741-2.747 against 2.735-2.739 ms per step (2.83 ms
//! with the second layer's weight updated and copied that way too).

use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::amp;
use ember_core::{cuda, Device, DeviceType, Error, Result, Tensor};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

/// The size of one row block of a large weight, going out to a replica and its gradient
/// coming back (Note [DataParallel row blocks]).
const ROW_BLOCK_BYTES: usize = 32 << 20;
/// At most this many row blocks per weight.
const MAX_ROW_BLOCKS: usize = 4;
/// Weights from this size on cross on their own, after the small tensors.
const LARGE_BYTES: usize = 16 << 20;

/// The row blocks a parameter crosses to a replica in, and the replica's gradient of it is
/// computed and crosses back in (Note [DataParallel row blocks]): for 2-D float weights of at
/// least [`LARGE_BYTES`] that require grad, one per [`ROW_BLOCK_BYTES`], at least one, at most
/// [`MAX_ROW_BLOCKS`]; 0 for the others, which cross together.
fn row_blocks(source: &Tensor) -> usize {
    let bytes = source.numel() * source.dtype().size_in_bytes();
    let large = source.rank() == 2 && source.dtype().is_floating_point() && source.requires_grad();
    match large && bytes >= LARGE_BYTES {
        true => (bytes / ROW_BLOCK_BYTES).clamp(1, MAX_ROW_BLOCKS),
        false => 0,
    }
}

/// A module run data-parallel over several devices in one process (`nn.DataParallel`).
pub struct DataParallel<M> {
    module: M,
    devices: Vec<Device>,
    output_device: Device,
    /// One worker per device after the first (Note [DataParallel workers]).
    workers: OnceLock<Vec<Worker>>,
}

type Job = Box<dyn FnOnce() + Send>;

/// A long-lived thread running one device's replicas (Note [DataParallel workers]).
struct Worker {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn start(device: Device) -> Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("DataParallel {device}"))
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| {
                Error::invalid(
                    "DataParallel",
                    format!("cannot start the worker thread of {device}: {e}"),
                )
            })?;
        Ok(Worker {
            jobs: Mutex::new(Some(tx)),
            thread: Some(thread),
        })
    }

    /// Queues `job`; false when the worker is gone.
    fn run(&self, job: Job) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop once its queued jobs ran.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<M> std::fmt::Debug for DataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("devices", &self.devices)
            .field("output_device", &self.output_device)
            .finish_non_exhaustive()
    }
}

impl<M: Forward + Clone + 'static> DataParallel<M> {
    /// Over every visible GPU (`cuda:0`, `cuda:1`, ...), gathering on `cuda:0`; on a machine
    /// without GPUs the wrapper calls the module as it is.
    pub fn new(module: M) -> Result<DataParallel<M>> {
        let devices: Vec<Device> = (0..cuda::device_count()).map(Device::Cuda).collect();
        DataParallel::with_devices(module, devices)
    }

    /// Over `devices` (`device_ids`), gathering on the first. The module's parameters and
    /// buffers must be on the first device (an error otherwise, as PyTorch's).
    pub fn with_devices(module: M, devices: impl IntoIterator<Item = Device>) -> Result<DataParallel<M>> {
        let devices: Vec<Device> = devices.into_iter().collect();
        let output_device = devices.first().copied().unwrap_or(Device::Cpu);
        if let Some(&first) = devices.first() {
            let mut misplaced = None;
            module.visit("", &mut |name, t, _| {
                if misplaced.is_none() && t.device() != first {
                    misplaced = Some((name.to_string(), t.device()));
                }
            });
            if let Some((name, device)) = misplaced {
                return Err(Error::invalid(
                    "DataParallel",
                    format!(
                        "module must have its parameters and buffers on device {first} (device_ids[0]) but found {name} on {device}; move it with module.to_device({first})"
                    ),
                ));
            }
        }
        Ok(DataParallel {
            module,
            devices,
            output_device,
            workers: OnceLock::new(),
        })
    }

    /// The wrapped module (`dp.module`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped module, mutably.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The devices the batch is split over (`device_ids`).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Copies of the module on `devices` (`nn.parallel.replicate`) whose parameters are
    /// differentiable copies of the module's (their gradients flow back into the originals)
    /// and whose buffers are plain copies. Between GPUs every tensor travels in one
    /// `broadcast_coalesced` (Note [Coalesced broadcast] in ember-core's `cuda/comm.rs`),
    /// elsewhere (the CPU "devices" of tests) through `to`.
    fn replicate(&self, devices: &[Device]) -> Result<Vec<M>> {
        let mut sources = Vec::new();
        self.module.visit("", &mut |_, t, kind| {
            sources.push(match kind {
                TensorKind::Parameter => t.clone(),
                TensorKind::Buffer => t.detach(),
            })
        });
        let ordinals: Option<Vec<usize>> = std::iter::once(&self.devices[0])
            .chain(devices)
            .map(|d| match d {
                Device::Cuda(i) => Some(*i),
                Device::Cpu => None,
            })
            .collect();
        let copies: Vec<Vec<Tensor>> = match ordinals {
            Some(ordinals) => {
                // The small tensors cross together first (a replica needs its biases before
                // its first product), then the large weights, each in row blocks that the
                // replica's `linear` reads as they arrive (Note [DataParallel row blocks]).
                let blocks: Vec<usize> = sources.iter().map(row_blocks).collect();
                let small: Vec<Tensor> = sources
                    .iter()
                    .zip(&blocks)
                    .filter(|(_, &b)| b == 0)
                    .map(|(t, _)| t.clone())
                    .collect();
                let mut lists =
                    cuda::comm::broadcast_coalesced(&small, &ordinals, cuda::comm::DEFAULT_BUFFER_SIZE)?;
                lists.remove(0);
                let mut large: Vec<Vec<Tensor>> = vec![Vec::new(); devices.len()];
                for (t, &b) in sources.iter().zip(&blocks).filter(|(_, &b)| b > 0) {
                    for (list, &d) in large.iter_mut().zip(&ordinals[1..]) {
                        list.push(cuda::comm::to_in_row_blocks(t, d, b)?);
                    }
                }
                let mut merged = Vec::with_capacity(lists.len());
                for (small, large) in lists.into_iter().zip(large) {
                    let (mut small, mut large) = (small.into_iter(), large.into_iter());
                    let list: Vec<Tensor> = blocks
                        .iter()
                        .filter_map(|&b| if b > 0 { large.next() } else { small.next() })
                        .collect();
                    for (copy, &b) in list.iter().zip(&blocks).filter(|(_, &b)| b > 0) {
                        cuda::set_gradient_row_blocks(copy, b)?;
                    }
                    merged.push(list);
                }
                merged
            }
            None => devices
                .iter()
                .map(|&d| sources.iter().map(|t| t.to(d)).collect())
                .collect::<Result<_>>()?,
        };
        copies
            .into_iter()
            .map(|list| {
                let mut replica = self.module.clone();
                let mut list = list.into_iter();
                replica.visit_mut("", &mut |name, t, _| {
                    *t = list.next().ok_or_else(|| {
                        mismatch(&format!("visit_mut reaches {name}, which visit does not"))
                    })?;
                    Ok(())
                })?;
                match list.next() {
                    Some(_) => Err(mismatch("visit_mut reaches fewer tensors than visit")),
                    None => Ok(replica),
                }
            })
            .collect()
    }

    /// Scatter, replicate, run the replicas in parallel, gather (see the module docs).
    fn forward_parallel(&self, x: &Tensor) -> Result<Tensor> {
        // A batch smaller than the device count uses as many devices as it has rows.
        let chunks = x.chunk(self.devices.len(), 0)?;
        let used = chunks.len();
        let inputs = chunks
            .iter()
            .zip(&self.devices)
            .map(|(c, &d)| c.to(d))
            .collect::<Result<Vec<_>>>()?;
        let replicas = self.replicate(&self.devices[1..used])?;
        // Each thread starts with the defaults of thread-local state: carry the caller's.
        let grad = ember_core::is_grad_enabled();
        let autocast: Vec<(DeviceType, ember_core::DType)> = [DeviceType::Cuda, DeviceType::Cpu]
            .into_iter()
            .filter(|&dt| amp::is_autocast_enabled(dt))
            .map(|dt| (dt, amp::get_autocast_dtype(dt)))
            .collect();
        let workers = match self.workers.get() {
            Some(w) => w,
            None => {
                let started = self.devices[1..]
                    .iter()
                    .map(|&d| Worker::start(d))
                    .collect::<Result<Vec<_>>>()?;
                self.workers.get_or_init(|| started)
            }
        };
        // The other devices' replicas go to their workers, then the first runs here.
        let mut pending = Vec::with_capacity(used - 1);
        for (i, (replica, x)) in replicas.into_iter().zip(inputs[1..].iter().cloned()).enumerate() {
            let (tx, rx) = mpsc::channel();
            let autocast = autocast.clone();
            let job: Job = Box::new(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    apply(&replica, &x, grad, &autocast)
                }));
                let _ = tx.send(out.ok());
            });
            if !workers[i].run(job) {
                return Err(Error::invalid(
                    "DataParallel",
                    format!("the worker thread of {} has stopped", self.devices[i + 1]),
                ));
            }
            pending.push(rx);
        }
        let first = apply(&self.module, &inputs[0], grad, &autocast);
        let mut outputs = Vec::with_capacity(used);
        outputs.push(first);
        for (i, rx) in pending.into_iter().enumerate() {
            outputs.push(rx.recv().ok().flatten().unwrap_or_else(|| {
                Err(Error::invalid(
                    "DataParallel",
                    format!("the replica on {} panicked in its forward", self.devices[i + 1]),
                ))
            }));
        }
        let outputs = outputs.into_iter().collect::<Result<Vec<_>>>()?;
        let gathered = outputs
            .iter()
            .map(|o| o.to(self.output_device))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&gathered, 0)
    }
}

/// The error for a module whose `visit` and `visit_mut` disagree on its tensors (`what`): a
/// hand-written `Module` impl must reach the same tensors in the same order in both.
fn mismatch(what: &str) -> Error {
    Error::invalid(
        "DataParallel",
        format!("cannot replicate the module: {what}; a Module's visit and visit_mut must reach the same tensors in the same order"),
    )
}

/// `module.forward(x)` under grad mode `grad` and the autocast states `autocast` (this
/// thread's own state is put back afterwards), its nodes numbered from 0 as on the fresh thread
/// PyTorch's `parallel_apply` would start (`autograd::with_fresh_sequence_nr`): every replica's
/// backward then runs in one order, after the calling thread's later nodes (the copies that
/// carry its parameters' gradients back), whatever the worker recorded before.
fn apply<M: Forward>(
    module: &M,
    x: &Tensor,
    grad: bool,
    autocast: &[(DeviceType, ember_core::DType)],
) -> Result<Tensor> {
    ember_core::autograd::with_fresh_sequence_nr(|| {
        let previous = ember_core::set_grad_enabled(grad);
        let guards = autocast
            .iter()
            .map(|&(dt, dtype)| amp::autocast(dt, dtype))
            .collect::<Result<Vec<_>>>();
        let out = guards.and_then(|_guards| module.forward(x));
        ember_core::set_grad_enabled(previous);
        out
    })
}

impl<M: Forward + Clone + 'static> Forward for DataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.devices.as_slice() {
            [] => self.module.forward(x),
            [only] => self.module.forward(&x.to(*only)?),
            _ => self.forward_parallel(x),
        }
    }
}

/// The wrapper is a module whose only child is `module` (names `module.fc.weight`, as PyTorch).
impl<M: Module> Module for DataParallel<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.module.visit(&join_name(prefix, "module"), f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.module.visit_mut(&join_name(prefix, "module"), f)
    }

    fn set_training(&mut self, training: bool) {
        self.module.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.module.is_training()
    }
}
