//! [`DataParallel`] (`torch.nn.DataParallel`): one process drives several devices. Each forward
//! splits the batch along dim 0 into one chunk per device (`scatter`), copies the module to the
//! other devices (`replicate`; buffers and frozen parameters too), runs the replicas in
//! parallel (`parallel_apply`: the first device's on the calling thread, each other device's
//! on a worker thread of its own, under the caller's grad mode and autocast state), and
//! concatenates the outputs on the output device (`gather`). Backward gives the original
//! parameters the sum of the replicas' gradients, which is the full batch's gradient when the
//! loss sums (or averages) over the gathered batch (Note [DataParallel backward]).
//!
//! As in PyTorch, the module's parameters and buffers must live on the first device when a
//! forward runs (checked there, not at construction, so PyTorch's tutorial order
//! `DataParallel::new(model)?` then `dp.to_device(Device::cuda())?` works); with one device (or
//! none: a machine without GPUs) the wrapper just calls the module. Replicating on
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
//! (joined) when the wrapper and the graphs of its forwards are dropped, and runs the first
//! device's replica on the caller's thread. Each replica's nodes are numbered from 0, as on a
//! fresh thread (`autograd::with_fresh_sequence_nr`, see `apply`).
//!
//! Note [DataParallel backward]: the gathered output is one node over the module's trained
//! parameters (and the batch's chunks, when the batch requires grad). Each replica's graph
//! ends at leaves of its own: the first device's replica reads the parameters through
//! detached aliases (no copy), the others read copies; all are leaves that require grad.
//! The node's backward splits the gathered gradient by rows, runs each replica's backward
//! pass (`autograd::grad` to its leaves) on the thread that ran its forward, all at once, and
//! sums each parameter's gradients on the first device through one
//! `cuda::comm::reduce_add_coalesced` (Note [Coalesced reduce] in ember-core's
//! `cuda/comm.rs`), as PyTorch's `Broadcast` backward does; `.grad` keeps those fresh sums as
//! they are. Each replica's pass keeps its graph when the outer one does
//! (`autograd::retains_graph`).
//! Before, the copies were differentiable `to`s, each replica's backward ran on the engine's
//! thread for its device (Note [Device threads] in ember-core's `autograd/engine.rs`) and
//! every gradient came back through its copy's backward: one copy between GPUs and one add
//! per parameter, on the thread of the second replica, whose backward then took 700 us of host
//! time against the first's 430 in a CPU trace of dp_cnn on two H200s (1.29 ms per step).
//! With the one node and the coalesced sum (the same run on two H200s, three rounds, the
//! build before against this one): dp_cnn at N=2 1.167-1.200 ms per step against
//! 1.385-1.523 (N=1 0.53); dp_mlp_large 2.755-2.759 against 2.730-2.736, slower until the
//! sum's order was mended (Note [Coalesced reduce]): then 2.703-2.708 against 2.731-2.740,
//! and with the blocks added as they arrive 2.655-2.667 against 2.725-2.742 in four rounds
//! (N=1 2.07 ms: 77.8% scaling against 75.9%).
//!
//! Note [DataParallel row blocks]: the replicas' gradients come back to the first device
//! once their replica's backward pass is queued (Note [DataParallel backward]). The gradient
//! of an MLP's first layer is the last one backward makes, so copied whole it waits for its
//! whole GEMM with nothing left to overlap: mlp_large's 200 MB weight leaves a 0.53 ms copy
//! after a 0.56 ms GEMM on two H100s. A replica's copy of a 2-D float weight of at least 16
//! MiB has its gradient computed in row blocks of 32 MiB (at least one, at most 4), an event
//! after each (Note [Gradients in row blocks] in ember-core), and the gradient crosses back
//! block by block, each copy started once its rows are written, on the copy engines, so the
//! first blocks travel while the last ones are computed. Each block's copy runs on a side
//! stream of its own (behind another private copy, which waits for everything its source's
//! stream had queued, it would wait for the whole GEMM), into memory from the pool of a side stream of the first
//! device (from the first device's own stream, it would wait for that device's share of the
//! same GEMM). On two H100s dp_mlp_large went from 3.91 to 3.52 ms per step (one GPU: 2.20 ms
//! either way); the four blocks' GEMMs take 0.60 ms against 0.55 ms for one. (DDP all-reduces
//! such a gradient block by block too: Note [DDP row blocks] in ember-distributed.) Each
//! block is added into the first device's gradient once it has crossed (Note [Coalesced
//! reduce]).
//! A weight of one block (mlp_large's 40 MB second layer) gets its one event too: its
//! gradient crosses as soon as it is written, whenever the crossing is queued. Without it,
//! when gradients crossed through each copy's backward, the engine reached that one only
//! after the first layer's backward was queued, so the copy waited for the first layer's
//! whole GEMM: in a trace on two H200s the second layer's
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
//!
//! Note [DataParallel host time]: where dp_cnn's step goes at N=2 (two H100s, a program that
//! times each phase's host time with a device wait after every step, three rounds, one run).
//! One GPU alone: 360-480 us of host time per step (forward 99-130, backward 222-290).
//! Two independent trainings, one thread and one GPU each, in one process: 388-455 us each,
//! so nothing process-wide (allocator, autograd, the dispatch point, the driver) slows two
//! replicas down. DataParallel over both: 818-829 us (forward 283-299, backward 465-479). The
//! difference is this wrapper's own work on the calling thread, which the worker waits for:
//! in a perf profile the worker spends about 45% of its time polling for its next job. A CPU
//! trace of one step (profiled, so slower) puts 110 us before the first device's replica
//! starts (the batch's scatter and the replicate: module clone, broadcast, leaves), 50 us in
//! the gather, 100 us in the coalesced sum after backward, plus the waits for the worker's
//! results. Tried and left out: mimalloc as the global allocator (dp_cnn at N=2 within the
//! noise of glibc's), jemalloc (1.93-1.98 ms per step against glibc's 0.83-0.90), and the
//! threads waiting by spinning or asleep instead of yielding (no difference above the
//! machine's noise, which is about 30% between runs at N=2).
//! That noise is per process: each process keeps its pace, and processes differ. dp_cnn at
//! N=2 (`ember bench --only dp_cnn`, one process per run): ten runs on two H200s 0.655,
//! 0.659, 0.660, 0.763, 0.786, 0.866, 0.870, 0.917, 1.146 and 1.264 ms per step, each run's
//! min and max within 18% of its median; 21 runs on two H100s, 1.00-1.44 ms. Fast and slow
//! processes queue the same GPU work (CUPTI: 65 and 51 kernels, 513-523 and 467-471 us busy on
//! the two devices); in slow ones the worker thread's ops take about 45% more host time
//! (conv2d 163 against 110 us, profiled), the caller's the same. Not CPU placement: the guest
//! has one NUMA node and no SMT, and pinning the caller and the worker to two CPUs left five
//! of six runs slow. Not glibc's allocator: one arena, or no heap trimming, ran as the default
//! did (1.03-1.44 against 1.00-1.23 ms, interleaved), with the same page faults and context
//! switches. Not the waits' polling either: polling with PAUSE hints instead of yielding (ten
//! processes each, interleaved, two H100s) ran 0.907-1.107 ms against 0.863-1.202, medians
//! 1.07 both. The machines are virtual; what slows a whole thread is below what the guest
//! sees.

use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{amp, autograd};
use ember_core::{cuda, Device, DeviceType, Error, Result, Tensor};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The size of one row block of a large weight, going out to a replica and its gradient
/// coming back (Note [DataParallel row blocks]).
const ROW_BLOCK_BYTES: usize = 32 << 20;
/// At most this many row blocks per weight.
const MAX_ROW_BLOCKS: usize = 4;
/// Weights from this size on cross on their own, after the small tensors.
const LARGE_BYTES: usize = 16 << 20;

/// The row blocks a trained parameter crosses to a replica in, and the replica's gradient of
/// it is computed and crosses back in (Note [DataParallel row blocks]): for 2-D float weights
/// of at least [`LARGE_BYTES`], one per [`ROW_BLOCK_BYTES`], at least one, at most
/// [`MAX_ROW_BLOCKS`]; 0 for the others, which cross together.
fn row_blocks(source: &Tensor) -> usize {
    let bytes = source.numel() * source.dtype().size_in_bytes();
    let large = source.rank() == 2 && source.dtype().is_floating_point();
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
    /// One worker per device after the first (Note [DataParallel workers]), shared with the
    /// graphs of the forwards that backward has not run through yet.
    workers: OnceLock<Arc<Vec<Worker>>>,
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
                while let Some(job) = recv_polling(&rx) {
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

    /// Over `devices` (`device_ids`), gathering on the first. The module may be anywhere now;
    /// its parameters and buffers must be on the first device when [`Forward::forward`] runs
    /// (an error there otherwise, as PyTorch's).
    pub fn with_devices(module: M, devices: impl IntoIterator<Item = Device>) -> Result<DataParallel<M>> {
        let devices: Vec<Device> = devices.into_iter().collect();
        let output_device = devices.first().copied().unwrap_or(Device::Cpu);
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

    /// The module's replicas on `devices` (`nn.parallel.replicate`), the first device's
    /// included, and the parameters backward sums into (Note [DataParallel backward]). Each
    /// replica's tensors are detached: on the first device the module's own (no copy), on the
    /// others copies; under `track`, the copies of the parameters that require grad are
    /// leaves of the replica's graph (its `leaves`, in the order of the returned parameters).
    /// Between GPUs the small tensors travel in one `broadcast_coalesced` (Note [Coalesced
    /// broadcast] in ember-core's `cuda/comm.rs`) and the large weights in row blocks (Note
    /// [DataParallel row blocks]); elsewhere (the CPU "devices" of tests) the replicas share
    /// the module's tensors.
    fn replicate(&self, devices: &[Device], track: bool) -> Result<(Vec<Tensor>, Vec<Replica<M>>)> {
        let mut sources = Vec::new();
        let mut trained = Vec::new();
        let mut params = Vec::new();
        self.module.visit("", &mut |_, t, kind| {
            let train = track && matches!(kind, TensorKind::Parameter) && t.requires_grad();
            if train {
                params.push(t.clone());
            }
            trained.push(train);
            sources.push(t.detach());
        });
        let ordinals: Option<Vec<usize>> = devices
            .iter()
            .map(|d| match d {
                Device::Cuda(i) => Some(*i),
                Device::Cpu => None,
            })
            .collect();
        let blocks: Vec<usize> = sources
            .iter()
            .zip(&trained)
            .map(|(t, &train)| if train { row_blocks(t) } else { 0 })
            .collect();
        let mut copies: Vec<Vec<Tensor>> = vec![sources.iter().map(Tensor::detach).collect()];
        match ordinals {
            Some(ordinals) if devices.len() > 1 => {
                // The small tensors cross together first (a replica needs its biases before
                // its first product), then the large weights, each in row blocks that the
                // replica's `linear` reads as they arrive (Note [DataParallel row blocks]).
                let small: Vec<Tensor> = sources
                    .iter()
                    .zip(&blocks)
                    .filter(|(_, &b)| b == 0)
                    .map(|(t, _)| t.clone())
                    .collect();
                let mut lists =
                    cuda::comm::broadcast_coalesced(&small, &ordinals, cuda::comm::DEFAULT_BUFFER_SIZE)?;
                lists.remove(0);
                let mut large: Vec<Vec<Tensor>> = vec![Vec::new(); devices.len() - 1];
                for (t, &b) in sources.iter().zip(&blocks).filter(|(_, &b)| b > 0) {
                    for (list, &d) in large.iter_mut().zip(&ordinals[1..]) {
                        list.push(cuda::comm::to_in_row_blocks(t, d, b)?);
                    }
                }
                for (small, large) in lists.into_iter().zip(large) {
                    let (mut small, mut large) = (small.into_iter(), large.into_iter());
                    let list: Vec<Tensor> = blocks
                        .iter()
                        .filter_map(|&b| if b > 0 { large.next() } else { small.next() })
                        .collect();
                    for (copy, &b) in list.iter().zip(&blocks).filter(|(_, &b)| b > 0) {
                        cuda::set_gradient_row_blocks(copy, b)?;
                    }
                    copies.push(list);
                }
            }
            _ => copies.extend(
                devices[1..]
                    .iter()
                    .map(|_| sources.iter().map(Tensor::detach).collect()),
            ),
        }
        let replicas = copies
            .into_iter()
            .map(|list| {
                let mut leaves = Vec::with_capacity(params.len());
                for (t, &train) in list.iter().zip(&trained) {
                    if train {
                        leaves.push(t.requires_grad_(true)?);
                    }
                }
                let mut module = self.module.clone();
                let mut list = list.into_iter();
                module.visit_mut("", &mut |name, t, _| {
                    *t = list.next().ok_or_else(|| {
                        mismatch(&format!("visit_mut reaches {name}, which visit does not"))
                    })?;
                    Ok(())
                })?;
                match list.next() {
                    Some(_) => Err(mismatch("visit_mut reaches fewer tensors than visit")),
                    None => Ok(Replica { module, leaves }),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((params, replicas))
    }

    /// The worker threads, started on the first parallel forward.
    fn workers(&self) -> Result<&Arc<Vec<Worker>>> {
        if let Some(w) = self.workers.get() {
            return Ok(w);
        }
        let started = self.devices[1..]
            .iter()
            .map(|&d| Worker::start(d))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.workers.get_or_init(|| Arc::new(started)))
    }

    /// Scatter, replicate, run the replicas in parallel, gather (see the module docs).
    fn forward_parallel(&self, x: &Tensor) -> Result<Tensor> {
        // A batch smaller than the device count uses as many devices as it has rows.
        let chunks = x.chunk(self.devices.len(), 0)?;
        let devices = &self.devices[..chunks.len()];
        let inputs = chunks
            .iter()
            .zip(devices)
            .map(|(c, &d)| c.to(d))
            .collect::<Result<Vec<_>>>()?;
        let grad = ember_core::is_grad_enabled();
        let (params, replicas) = self.replicate(devices, grad)?;
        // Each replica reads its share of the batch as a leaf of its own graph.
        let track_x = grad && x.requires_grad();
        let xs = inputs
            .iter()
            .map(|t| match track_x {
                true => t.detach().requires_grad_(true),
                false => Ok(t.detach()),
            })
            .collect::<Result<Vec<_>>>()?;
        // Each thread starts with the defaults of thread-local state: carry the caller's.
        let autocast: Vec<(DeviceType, ember_core::DType)> = [DeviceType::Cuda, DeviceType::Cpu]
            .into_iter()
            .filter(|&dt| amp::is_autocast_enabled(dt))
            .map(|dt| (dt, amp::get_autocast_dtype(dt)))
            .collect();
        let workers = self.workers()?;
        let mut leaves = Vec::with_capacity(replicas.len());
        let mut replicas = replicas.into_iter();
        let first = replicas.next().expect("one replica per device used");
        leaves.push(first.leaves);
        // The other devices' replicas go to their workers, then the first runs here.
        let mut pending = Vec::with_capacity(devices.len() - 1);
        for (i, (replica, x)) in replicas.zip(xs[1..].iter().cloned()).enumerate() {
            leaves.push(replica.leaves);
            let module = replica.module;
            let autocast = autocast.clone();
            pending.push(run_on(workers, i, devices[i + 1], "forward", move || {
                apply(&module, &x, grad, &autocast)
            })?);
        }
        let first = apply(&first.module, &xs[0], grad, &autocast);
        let mut outputs = vec![first];
        outputs.extend(pending.into_iter().map(Pending::wait));
        let outputs = outputs.into_iter().collect::<Result<Vec<_>>>()?;
        let gathered = {
            let _no_grad = ember_core::no_grad();
            let parts = outputs
                .iter()
                .map(|o| o.to(self.output_device))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)?
        };
        if params.is_empty() && !track_x {
            return Ok(gathered);
        }
        for (list, x) in leaves.iter_mut().zip(&xs) {
            if track_x {
                list.push(x.clone());
            }
        }
        let inputs: Vec<&Tensor> = params.iter().chain(inputs.iter().filter(|_| track_x)).collect();
        let pass = Arc::new(ReplicaGraphs {
            outputs,
            leaves,
            devices: devices.to_vec(),
            workers: workers.clone(),
            params: params.len(),
        });
        Ok(autograd::custom_op(
            "DataParallel",
            &inputs,
            gathered,
            move |g, _| pass.backward(g),
        ))
    }
}

/// One device's copy of the module and the leaves of its graph that backward asks gradients
/// for (Note [DataParallel backward]).
struct Replica<M> {
    module: M,
    leaves: Vec<Tensor>,
}

/// A job's result on its way back from a worker.
struct Pending<T> {
    rx: mpsc::Receiver<Option<Result<T>>>,
    device: Device,
    what: &'static str,
}

impl<T> Pending<T> {
    /// The job's result; an error when it panicked or its worker stopped.
    fn wait(self) -> Result<T> {
        recv_polling(&self.rx).flatten().unwrap_or_else(|| {
            Err(Error::invalid(
                "DataParallel",
                format!("the replica on {} panicked in its {}", self.device, self.what),
            ))
        })
    }
}

/// How long a worker waiting for its next job, and the caller waiting for a worker's result,
/// poll before they sleep (Note [DataParallel polling]).
const POLL: Duration = Duration::from_millis(1);

/// The next message of `rx`, `None` once its senders are gone: polled (yielding the CPU
/// between tries) for up to [`POLL`], then waited for asleep.
///
/// Note [DataParallel polling]: each step hands work between threads four times (each
/// replica's forward and backward out to its worker, their results back), and a thread
/// asleep in the channel took 30 to 45 us to run again once woken, on the step's longest
/// path each time (CPU trace of dp_cnn on two H200s; the worker's first op then ran at half
/// the speed of the same op on the caller's thread). A thread that polls sees the message at
/// once; a step's idle spans are shorter than [`POLL`], so the workers poll throughout
/// training and sleep once it stops. Yielding rather than spinning leaves the core to other
/// threads on a busy machine. dp_cnn at N=2 on two H200s (with the sum of Note [Coalesced
/// reduce] ordered as it is now, same run): 0.99 and 1.02 ms per step against 1.17-1.20
/// without polling the run before; the old build, in the same run, 1.23-1.35. One round of
/// three took 2.88 ms, which no other run showed. Four rounds the next run: 0.90-1.12 ms
/// (N=1 0.54: 51-59% scaling), the build before this session's 1.24-1.65 (33-44%).
fn recv_polling<T>(rx: &mpsc::Receiver<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(message) => return Some(message),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if start.elapsed() < POLL => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// Runs `f` on worker `i` (of `device`); its result comes back through the returned handle.
fn run_on<T: Send + 'static>(
    workers: &[Worker],
    i: usize,
    device: Device,
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<Pending<T>> {
    let (tx, rx) = mpsc::channel();
    let job: Job = Box::new(move || {
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(out.ok());
    });
    match workers[i].run(job) {
        true => Ok(Pending { rx, device, what }),
        false => Err(Error::invalid(
            "DataParallel",
            format!("the worker thread of {device} has stopped"),
        )),
    }
}

/// What one parallel forward leaves for backward (Note [DataParallel backward]): each
/// replica's output and the leaves of its graph (its parameters' copies, then its share of
/// the batch when that requires grad).
struct ReplicaGraphs {
    outputs: Vec<Tensor>,
    leaves: Vec<Vec<Tensor>>,
    devices: Vec<Device>,
    workers: Arc<Vec<Worker>>,
    /// How many of each replica's leaves are parameters.
    params: usize,
}

impl ReplicaGraphs {
    /// The gradients of the module's parameters (summed over the replicas) and of each
    /// replica's share of the batch, from the gradient `g` of the gathered output.
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let retain = autograd::retains_graph();
        let mut rows = 0;
        let mut parts = Vec::with_capacity(self.outputs.len());
        for (y, &d) in self.outputs.iter().zip(&self.devices) {
            let n = y.dims().first().copied().unwrap_or(1);
            parts.push(g.narrow(0, rows, n)?.to(d)?);
            rows += n;
        }
        let pass = move |y: &Tensor, leaves: &[Tensor], g: Tensor| -> Result<Vec<Option<Tensor>>> {
            match y.requires_grad() && !leaves.is_empty() {
                true => autograd::grad(std::slice::from_ref(y), leaves, Some(&[g]), retain),
                false => Ok(vec![None; leaves.len()]),
            }
        };
        let mut pending = Vec::with_capacity(self.outputs.len() - 1);
        for i in 1..self.outputs.len() {
            let (y, leaves, g) = (self.outputs[i].clone(), self.leaves[i].clone(), parts[i].clone());
            pending.push(run_on(
                &self.workers,
                i - 1,
                self.devices[i],
                "backward",
                move || pass(&y, &leaves, g),
            )?);
        }
        let first = pass(&self.outputs[0], &self.leaves[0], parts.swap_remove(0));
        let mut per_replica = vec![first];
        per_replica.extend(pending.into_iter().map(Pending::wait));
        let per_replica = per_replica.into_iter().collect::<Result<Vec<_>>>()?;
        let (params, inputs): (Vec<_>, Vec<_>) = per_replica
            .into_iter()
            .map(|mut grads| {
                let rest = grads.split_off(self.params);
                (grads, rest.into_iter().next().flatten())
            })
            .unzip();
        let mut grads = sum_over_replicas(params, self.devices[0])?;
        if self.leaves[0].len() > self.params {
            grads.extend(inputs);
        }
        Ok(grads)
    }
}

/// Per parameter, the sum on `dest` of the replicas' gradients (`params[r][j]`: replica `r`'s
/// of parameter `j`), `None` where no replica has one. Between GPUs the parameters every
/// replica has a gradient for go through one `reduce_add_coalesced` (Note [Coalesced reduce]
/// in ember-core's `cuda/comm.rs`); the others, and the CPU "devices" of tests, add up one by
/// one.
fn sum_over_replicas(mut params: Vec<Vec<Option<Tensor>>>, dest: Device) -> Result<Vec<Option<Tensor>>> {
    let count = params.first().map_or(0, Vec::len);
    let mut sums: Vec<Option<Tensor>> = vec![None; count];
    if let Device::Cuda(d) = dest {
        let complete: Vec<usize> = (0..count)
            .filter(|&j| {
                params
                    .iter()
                    .all(|r| r[j].as_ref().is_some_and(|g| g.device().is_cuda()))
            })
            .collect();
        if !complete.is_empty() {
            let lists = params
                .iter_mut()
                .map(|r| complete.iter().map(|&j| r[j].take().expect("complete")).collect())
                .collect();
            let summed = cuda::comm::reduce_add_coalesced(lists, d, cuda::comm::DEFAULT_BUFFER_SIZE)?;
            for (&j, s) in complete.iter().zip(summed) {
                sums[j] = Some(s);
            }
        }
    }
    for replica in params {
        for (sum, g) in sums.iter_mut().zip(replica) {
            if let Some(g) = g {
                let g = g.to(dest)?;
                *sum = Some(match sum.take() {
                    None => g,
                    Some(s) => s.add(&g)?,
                });
            }
        }
    }
    Ok(sums)
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
        if let Some(&first) = self.devices.first() {
            let mut misplaced = None;
            self.module.visit("", &mut |name, t, _| {
                if misplaced.is_none() && t.device() != first {
                    misplaced = Some((name.to_string(), t.device()));
                }
            });
            if let Some((name, device)) = misplaced {
                return Err(Error::invalid(
                    "DataParallel",
                    format!(
                        "module must have its parameters and buffers on device {first} (device_ids[0]) but found {name} on {device}; move it with dp.to_device({first})"
                    ),
                ));
            }
        }
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

    fn set_training(&self, training: bool) {
        self.module.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.module.is_training()
    }
}
