//! The NCCL backend (`ProcessGroupNCCL`): collectives between GPUs through NVIDIA's library,
//! loaded at run time (Note [Loading NCCL] in `library.rs`).
//!
//! Note [NCCL backend design], after PyTorch's `ProcessGroupNCCL`:
//! - One communicator per group, on one device: the group's device (`cuda:{LOCAL_RANK}` unless
//!   told, see [`crate::InitOptions::device_id`]). Rank 0 creates the `ncclUniqueId` and
//!   publishes it under the group's store prefix (`nccl/unique_id`); the others wait for it
//!   (bounded by the store's timeout), then every rank calls `ncclCommInitRank` (bounded by the
//!   group's timeout). The communicator is blocking (NCCL's default configuration).
//! - Streams: every operation runs on the group's NCCL stream (one from ember's stream pool),
//!   which first waits on the caller's current stream (an event), so inputs written there are
//!   ready. The tensors are marked used on the NCCL stream (`record_stream`), so the caching
//!   allocator does not hand their memory out again before NCCL is done with it, even when the
//!   caller drops them at once. An event recorded after the operation completes its [`Work`].
//! - [`Work::wait`] makes the caller's *current* stream wait on that event and returns without
//!   blocking the host (PyTorch's semantics); the outputs can then be used by any work queued
//!   on that stream (a host read such as `to_vec` synchronizes). `barrier` is an all_reduce of
//!   one element whose `wait` does block the host until it finished, as PyTorch's does.
//! - Flat forms: `all_gather_into_tensor` and `reduce_scatter_tensor` hand the caller's
//!   tensors to `ncclAllGather` and `ncclReduceScatter` as they are, no copies (FSDP's and
//!   ZeRO's collectives).
//! - List forms: `all_gather` gathers into one flat buffer (`ncclAllGather`) and copies the
//!   slices into the outputs; `reduce_scatter` copies the inputs into one flat buffer and runs
//!   `ncclReduceScatter`. Both copies run on the NCCL stream; the buffer is allocated there, so
//!   it needs no `record_stream`.
//! - send/recv: each is `ncclSend`/`ncclRecv` in its own NCCL group, matched in order
//!   between two ranks. Unlike the CPU backend, a blocking communicator connects a pair of
//!   ranks at their first send/recv inside the enqueue, so two ranks that both start with a
//!   send to each other can wait on each other there: order the first exchange (one sends while
//!   the other receives), as the tests do.
//! - Environment: NCCL reads its variables when the first communicator is created. `ember-run`
//!   sets `NCCL_NVLS_ENABLE=0` (NVLink multicast off) unless set; a program started otherwise
//!   gets whatever its environment says. Loading NCCL sets `NCCL_RUNTIME_CONNECT=0` unless
//!   set: NCCL then connects the ranks inside `ncclCommInitRank`, which the group's timeout
//!   bounds, instead of at the first collective (NCCL's default since 2.22). Connecting lazily,
//!   a rank that died after init blocks the survivors' first collective inside NCCL's enqueue,
//!   out of the watchdog's reach, for about 60 s of socket retries; connected at init, that
//!   collective is enqueued, waits on the dead peer, and the watchdog aborts it after the
//!   timeout. The cost is the buffers of connections a job may never use.
//! - Reductions: Sum, Product, Max, Min and Avg (`ncclAvg`) on every dtype NCCL has (f32,
//!   f64, f16, bf16, i64, i32, u8, bool as u8 with Sum as Max and Product as Min, as PyTorch).
//! - Failures, Note [NCCL watchdog]: a watchdog thread per group checks, every 50 ms, the
//!   in-flight operations' events and `ncclCommGetAsyncError`. When NCCL reports an error, or
//!   an operation has not finished within the group's timeout (a peer died or stopped calling
//!   collectives), it records the error and aborts the communicator (`ncclCommAbort`): the
//!   stuck kernels end, so streams waiting on them go on and no host read hangs forever; that
//!   operation's `wait` and every later operation fail with the recorded error. The outputs
//!   of an aborted operation are undefined. `shutdown` (`destroy_process_group`) aborts too.
//!   Limit: an enqueue blocked inside NCCL (the first send/recv to a peer connects to it) holds
//!   the communicator's lock and is bounded by NCCL's own socket timeouts, not ours (Note
//!   [Communicator locking] in `comm.rs`).
//! - CUDA graphs, Note [NCCL under capture]: an operation issued while the caller's current
//!   stream captures a graph is captured with it (NCCL supports capture since 2.9.6): the NCCL
//!   stream joins the capture through the event it waits on, and the caller's stream joins it
//!   back when the work is waited on, as every captured fork must be before the capture ends.
//!   Such an operation only runs when the graph is replayed, and its end event was recorded in
//!   a capturing stream, which the driver refuses to query; so it is not handed to the
//!   watchdog (it would never see it finish and would abort the communicator after the
//!   timeout), as PyTorch's `ProcessGroupNCCL` leaves captured work out of its watchdog. A
//!   captured `barrier` is an error: its wait blocks the host, which a capture cannot.

pub mod comm;
pub mod library;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};
use ember_core::cuda::{self, DeviceGuard, Event, Stream};
use ember_core::{DType, Device, Error, Result, Tensor};

use crate::backend::{Backend, ReduceOp, Work, WorkHandle};
use crate::store::Store;
use comm::Communicator;
pub use library::nccl;
use library::RawStream;

/// The store key (under the group's prefix) of rank 0's unique id.
const UNIQUE_ID_KEY: &str = "nccl/unique_id";
/// What rank 0 publishes instead of an id when it could not make one, so peers fail at once.
const ERROR_PREFIX: &[u8] = b"error:";
/// How often the watchdog looks at in-flight operations (Note [NCCL watchdog]).
const WATCHDOG_PERIOD: Duration = Duration::from_millis(50);

/// NCCL's datatype for `dtype`, and whether it is bool (reduced as u8, Note [NCCL backend
/// design]).
pub fn nccl_dtype(op: &'static str, dtype: DType) -> Result<(ncclDataType_t, bool)> {
    use ncclDataType_t::*;
    Ok(match dtype {
        DType::F32 => (ncclFloat32, false),
        DType::F64 => (ncclFloat64, false),
        DType::F16 => (ncclFloat16, false),
        DType::BF16 => (ncclBfloat16, false),
        DType::I64 => (ncclInt64, false),
        DType::I32 => (ncclInt32, false),
        DType::U8 => (ncclUint8, false),
        DType::Bool => (ncclUint8, true),
        #[allow(unreachable_patterns)]
        other => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: other,
                hint: "the NCCL backend takes f32, f64, f16, bf16, i64, i32, u8 and bool tensors",
            })
        }
    })
}

/// NCCL's reduction for `op` on a tensor of that kind.
pub fn nccl_op(op: ReduceOp, is_bool: bool) -> ncclRedOp_t {
    use ncclRedOp_t::*;
    match (op, is_bool) {
        (ReduceOp::Sum, true) => ncclMax,     // logical or
        (ReduceOp::Product, true) => ncclMin, // logical and
        (ReduceOp::Sum, false) => ncclSum,
        (ReduceOp::Product, false) => ncclProd,
        (ReduceOp::Max, _) => ncclMax,
        (ReduceOp::Min, _) => ncclMin,
        (ReduceOp::Avg, _) => ncclAvg,
    }
}

/// Checks that `t` can be handed to NCCL by address: a CUDA tensor on `device`, contiguous.
pub fn check_tensor(op: &'static str, t: &Tensor, device: usize) -> Result<()> {
    if t.device() != Device::Cuda(device) {
        return Err(Error::DeviceMismatch {
            op,
            lhs: Device::Cuda(device),
            rhs: t.device(),
        });
    }
    if !t.is_contiguous() {
        return Err(Error::invalid(
            op,
            "the NCCL backend needs contiguous tensors; call contiguous() first (and copy the result back)",
        ));
    }
    Ok(())
}

/// The device an NCCL group uses: `explicit` if given, else `local_rank`, else `rank` modulo
/// the number of devices (PyTorch's guess when no device was set).
pub fn group_device(explicit: Option<usize>, local_rank: Option<usize>, rank: usize) -> Result<usize> {
    if let Some(d) = explicit.or(local_rank) {
        return Ok(d);
    }
    if !cuda::is_available() {
        return Err(Error::CudaUnavailable {
            reason: "the NCCL backend needs a CUDA device".into(),
        });
    }
    Ok(rank % cuda::device_count().max(1))
}

/// An operation still running on the NCCL stream, watched by the watchdog.
struct InFlight {
    op: &'static str,
    end: Arc<Event>,
    started: Instant,
}

/// What the backend, its works and its watchdog share.
struct Shared {
    comm: Communicator,
    device: usize,
    timeout: Duration,
    /// The first failure; once set, every operation fails with it (Note [NCCL watchdog]).
    broken: Mutex<Option<Error>>,
    inflight: Mutex<Vec<InFlight>>,
    stop: AtomicBool,
    /// NCCL's kernels on `device` wait on the GPU for the peers (the profiler reads this:
    /// Note [CUPTI and ranks as threads] in ember-core's `profiler`).
    _collectives: cuda::CollectivesRegistration,
}

impl Shared {
    fn broken(&self) -> Option<Error> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn fail(&self, e: Error) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            *b = Some(e);
        }
    }

    /// One watchdog pass: retire finished operations, then abort on an asynchronous error or
    /// an operation older than the timeout.
    fn watch(&self) {
        let overdue = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            inflight.retain(|w| !matches!(w.end.query(), Ok(true)));
            inflight
                .iter()
                .find(|w| w.started.elapsed() > self.timeout)
                .map(|w| (w.op, w.started.elapsed()))
        };
        let error = if let Some(msg) = self.comm.async_error() {
            Some(Error::Cuda {
                op: "nccl",
                msg: format!("NCCL reported an asynchronous error: {msg}; the communicator was aborted"),
            })
        } else {
            overdue.map(|(op, age)| Error::Io {
                kind: std::io::ErrorKind::TimedOut,
                msg: format!(
                    "NCCL {op} on cuda:{} has not finished after {age:?} (timeout {:?}): a peer died or \
                     did not call the same collective; the communicator was aborted",
                    self.device, self.timeout
                ),
            })
        };
        if let Some(e) = error {
            self.fail(e);
            if self.comm.abort(false) {
                self.inflight.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
        }
    }
}

/// The NCCL backend of one process group (Note [NCCL backend design]).
pub struct NcclBackend {
    shared: Arc<Shared>,
    stream: Stream,
    rank: usize,
    size: usize,
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

impl NcclBackend {
    /// Connects `rank` of `size` on `cuda:{device}`, meeting the peers through `store`
    /// (already prefixed for the group). Errors: [`Error::CudaUnavailable`] without NCCL or a
    /// GPU; an out-of-range device; a timeout when a peer does not come.
    pub fn new(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        device: usize,
    ) -> Result<NcclBackend> {
        let setup = Self::local_setup(device).and_then(|(lib, stream)| {
            let id = if rank == 0 {
                Some(comm::unique_id(lib)?)
            } else {
                None
            };
            Ok((lib, stream, id))
        });
        let (lib, stream, id) = match setup {
            Ok(s) => s,
            Err(e) => {
                // Rank 0 tells the others at once instead of leaving them to time out.
                if rank == 0 {
                    let msg = [ERROR_PREFIX, e.to_string().as_bytes()].concat();
                    let _ = store.set(UNIQUE_ID_KEY, &msg);
                }
                return Err(e);
            }
        };
        let id = match id {
            Some(id) => {
                store.set(UNIQUE_ID_KEY, &id)?;
                id
            }
            None => {
                let id = store.get(UNIQUE_ID_KEY)?;
                if let Some(msg) = id.strip_prefix(ERROR_PREFIX) {
                    return Err(Error::Cuda {
                        op: "init_process_group",
                        msg: format!("rank 0 could not set up NCCL: {}", String::from_utf8_lossy(msg)),
                    });
                }
                id
            }
        };
        let comm = Communicator::new(lib, device, &id, rank, size, timeout)?;
        let shared = Arc::new(Shared {
            comm,
            device,
            timeout,
            broken: Mutex::new(None),
            inflight: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            _collectives: cuda::register_collectives(device),
        });
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || {
                while !watched.stop.load(Ordering::Acquire) {
                    std::thread::sleep(WATCHDOG_PERIOD);
                    watched.watch();
                }
            })
            .map_err(|e| Error::invalid("init_process_group", format!("cannot start a thread: {e}")))?;
        Ok(NcclBackend {
            shared,
            stream,
            rank,
            size,
            watchdog: Mutex::new(Some(watchdog)),
        })
    }

    /// What a rank checks and creates before meeting the others: the library, the device,
    /// the group's stream.
    fn local_setup(device: usize) -> Result<(&'static library::Nccl, Stream)> {
        let lib = library::nccl()?;
        if !cuda::is_available() {
            return Err(Error::CudaUnavailable {
                reason: "the NCCL backend needs a CUDA device, and none is usable here".into(),
            });
        }
        let count = cuda::device_count();
        if device >= count {
            return Err(Error::invalid(
                "init_process_group",
                format!(
                    "the NCCL group's device cuda:{device} does not exist ({count} CUDA device(s)); \
                     pass device_id or set LOCAL_RANK"
                ),
            ));
        }
        let _guard = DeviceGuard::new(device)?;
        // High priority (PyTorch's `is_high_priority_stream`, off there by default): a
        // collective queued while a large GEMM fills every SM gets the first SMs that free up
        // instead of waiting for the GEMM's last wave, so DDP's bucket all-reduces overlap
        // the rest of backward (mlp_large on two H100s: the 40 MB bucket started only as the
        // 0.56 ms first-layer weight-gradient GEMM ended).
        Ok((lib, Stream::with_priority_on(device, -1)?))
    }

    /// The device the group's communicator is on.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The loaded NCCL's version code (e.g. 22803 for 2.28.3).
    pub fn nccl_version(&self) -> i32 {
        self.shared.comm.lib().version
    }

    fn check_broken(&self) -> Result<()> {
        match self.shared.broken() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs one operation on the NCCL stream (Note [NCCL backend design]): waits for the
    /// current stream, runs `body` with the NCCL stream current (ember ops inside it, such as
    /// the list forms' copies, go there), marks `used` as used there, records the end event.
    fn launch(
        &self,
        op: &'static str,
        used: &[&Tensor],
        blocking: bool,
        body: impl FnOnce(&Communicator, RawStream) -> Result<()>,
    ) -> Result<Work> {
        self.check_broken()?;
        for t in used {
            if t.device() != Device::Cuda(self.shared.device) {
                return Err(Error::DeviceMismatch {
                    op,
                    lhs: Device::Cuda(self.shared.device),
                    rhs: t.device(),
                });
            }
        }
        let _device = DeviceGuard::new(self.shared.device)?;
        let current = cuda::current_stream(self.shared.device)?;
        // Note [NCCL under capture].
        let captured = cuda::is_current_stream_capturing();
        if captured && blocking {
            return Err(Error::invalid(
                op,
                "a barrier blocks the host until every rank reached it, which a CUDA graph capture cannot; call it outside the captured region",
            ));
        }
        self.stream.wait_stream(&current)?;
        {
            let _on_nccl = cuda::stream(&self.stream);
            body(&self.shared.comm, self.stream.as_raw() as RawStream)?;
        }
        for t in used {
            t.record_stream(&self.stream)?;
        }
        let end = Arc::new(self.stream.record_event()?);
        if !captured {
            self.shared
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(InFlight {
                    op,
                    end: end.clone(),
                    started: Instant::now(),
                });
        }
        Ok(Work::new(Arc::new(NcclWork {
            shared: self.shared.clone(),
            end,
            blocking,
        })))
    }
}

/// Addresses of a tensor's first element, for NCCL.
fn ptr(t: &Tensor) -> *mut std::ffi::c_void {
    t.data_ptr() as *mut std::ffi::c_void
}

/// Converts NCCL's status into the closure form [`Communicator::call`] takes.
macro_rules! nccl_call {
    ($comm:expr, $op:expr, |$lib:ident, $c:ident| $body:expr) => {
        $comm.call($op, |$lib, $c| {
            // SAFETY: every buffer is a live, contiguous CUDA tensor of the communicator's
            // device holding at least `count` elements of the datatype passed (checked by
            // `check_tensor` and the group's argument checks); the tensors are kept from reuse
            // until the NCCL stream passed them (`record_stream`); the stream is a live pool
            // stream of that device.
            #[allow(unsafe_code)]
            unsafe {
                $body
            }
        })
    };
}

impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let (dt, is_bool) = nccl_dtype("all_reduce", tensor.dtype())?;
        check_tensor("all_reduce", tensor, self.shared.device)?;
        let red = nccl_op(op, is_bool);
        let count = tensor.numel();
        self.launch("all_reduce", &[tensor], false, |comm, stream| {
            if self.size == 1 {
                // Any reduction over one rank leaves the tensor as it is; NCCL would still run
                // a kernel over it for `Avg` (0.23 ms per step of mlp_large's DDP on an H100).
                return Ok(());
            }
            let p = ptr(tensor);
            nccl_call!(comm, "ncclAllReduce", |lib, c| (lib.all_reduce)(
                p, p, count, dt, red, c, stream
            ))
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let (dt, _) = nccl_dtype("broadcast", tensor.dtype())?;
        check_tensor("broadcast", tensor, self.shared.device)?;
        let count = tensor.numel();
        let root = root as std::ffi::c_int;
        self.launch("broadcast", &[tensor], false, |comm, stream| {
            let p = ptr(tensor);
            nccl_call!(comm, "ncclBroadcast", |lib, c| (lib.broadcast)(
                p, p, count, dt, root, c, stream
            ))
        })
    }

    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        let (dt, _) = nccl_dtype("all_gather", input.dtype())?;
        check_tensor("all_gather", input, self.shared.device)?;
        let count = input.numel();
        let (n, device) = (self.size, Device::Cuda(self.shared.device));
        // The outputs are written by copies on the NCCL stream: any layout will do.
        let used: Vec<&Tensor> = std::iter::once(input).chain(outputs).collect();
        self.launch("all_gather", &used, false, |comm, stream| {
            // Allocated with the NCCL stream current: reused only in that stream's order.
            let flat = Tensor::empty([n * count], input.dtype(), device)?;
            let (src, dst) = (ptr(input), ptr(&flat));
            nccl_call!(comm, "ncclAllGather", |lib, c| (lib.all_gather)(
                src, dst, count, dt, c, stream
            ))?;
            // Out of the flat result with one `foreach_copy_` (one launch where the outputs
            // are plain, Note [Foreach copies] in ember-core).
            let parts = (0..outputs.len())
                .map(|i| flat.narrow(0, i * count, count)?.reshape(outputs[i].dims()))
                .collect::<Result<Vec<_>>>()?;
            ember_core::foreach_copy_(outputs, &parts)
        })
    }

    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        let (dt, is_bool) = nccl_dtype("reduce_scatter", output.dtype())?;
        check_tensor("reduce_scatter", output, self.shared.device)?;
        let red = nccl_op(op, is_bool);
        let count = output.numel();
        let (n, device) = (self.size, Device::Cuda(self.shared.device));
        // The inputs are read by copies on the NCCL stream: any layout will do.
        let used: Vec<&Tensor> = std::iter::once(output).chain(inputs).collect();
        self.launch("reduce_scatter", &used, false, |comm, stream| {
            let flat = Tensor::empty([n * count], output.dtype(), device)?;
            let slots = (0..inputs.len())
                .map(|j| flat.narrow(0, j * count, count)?.reshape(inputs[j].dims()))
                .collect::<Result<Vec<_>>>()?;
            ember_core::foreach_copy_(&slots, inputs)?;
            let (src, dst) = (ptr(&flat), ptr(output));
            nccl_call!(comm, "ncclReduceScatter", |lib, c| (lib.reduce_scatter)(
                src, dst, count, dt, red, c, stream
            ))
        })
    }

    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        const OP: &str = "all_gather_into_tensor";
        let (dt, _) = nccl_dtype(OP, input.dtype())?;
        check_tensor(OP, input, self.shared.device)?;
        check_tensor(OP, output, self.shared.device)?;
        let count = input.numel();
        if output.numel() != count * self.size {
            return Err(Error::invalid(
                OP,
                format!(
                    "the output has {} elements where {} ranks × {count} are needed",
                    output.numel(),
                    self.size
                ),
            ));
        }
        self.launch(OP, &[input, output], false, |comm, stream| {
            let (src, dst) = (ptr(input), ptr(output));
            nccl_call!(comm, "ncclAllGather", |lib, c| (lib.all_gather)(
                src, dst, count, dt, c, stream
            ))
        })
    }

    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        const OP: &str = "reduce_scatter_tensor";
        let (dt, is_bool) = nccl_dtype(OP, output.dtype())?;
        check_tensor(OP, input, self.shared.device)?;
        check_tensor(OP, output, self.shared.device)?;
        let red = nccl_op(op, is_bool);
        let count = output.numel();
        if input.numel() != count * self.size {
            return Err(Error::invalid(
                OP,
                format!(
                    "the input has {} elements where {} ranks × {count} are needed",
                    input.numel(),
                    self.size
                ),
            ));
        }
        self.launch(OP, &[input, output], false, |comm, stream| {
            let (src, dst) = (ptr(input), ptr(output));
            nccl_call!(comm, "ncclReduceScatter", |lib, c| (lib.reduce_scatter)(
                src, dst, count, dt, red, c, stream
            ))
        })
    }

    fn barrier(&self) -> Result<Work> {
        let device = Device::Cuda(self.shared.device);
        self.launch("barrier", &[], true, |comm, stream| {
            let one = Tensor::zeros([1usize], DType::F32, device)?;
            let p = ptr(&one);
            nccl_call!(comm, "ncclAllReduce", |lib, c| (lib.all_reduce)(
                p,
                p,
                1,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                c,
                stream
            ))
        })
    }

    fn send(&self, tensor: &Tensor, dst: usize, _tag: u32) -> Result<Work> {
        let (dt, _) = nccl_dtype("send", tensor.dtype())?;
        check_tensor("send", tensor, self.shared.device)?;
        let count = tensor.numel();
        let peer = dst as std::ffi::c_int;
        self.launch("send", &[tensor], false, |comm, stream| {
            let p = ptr(tensor);
            nccl_call!(comm, "ncclSend", |lib, c| {
                let rc = (lib.group_start)();
                if rc != library::NCCL_SUCCESS {
                    return rc;
                }
                let rc = (lib.send)(p, count, dt, peer, c, stream);
                let end = (lib.group_end)();
                if rc != library::NCCL_SUCCESS {
                    rc
                } else {
                    end
                }
            })
        })
    }

    fn recv(&self, tensor: &Tensor, src: usize, _tag: u32) -> Result<Work> {
        let (dt, _) = nccl_dtype("recv", tensor.dtype())?;
        check_tensor("recv", tensor, self.shared.device)?;
        let count = tensor.numel();
        let peer = src as std::ffi::c_int;
        self.launch("recv", &[tensor], false, |comm, stream| {
            let p = ptr(tensor);
            nccl_call!(comm, "ncclRecv", |lib, c| {
                let rc = (lib.group_start)();
                if rc != library::NCCL_SUCCESS {
                    return rc;
                }
                let rc = (lib.recv)(p, count, dt, peer, c, stream);
                let end = (lib.group_end)();
                if rc != library::NCCL_SUCCESS {
                    rc
                } else {
                    end
                }
            })
        })
    }

    fn shutdown(&self) {
        self.shared.fail(Error::invalid(
            "ProcessGroup",
            "the NCCL process group was shut down (destroy_process_group); create a new one",
        ));
        self.shared.comm.abort(true);
        self.shared
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.watchdog.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

/// The completion of one NCCL operation: its end event on the NCCL stream.
struct NcclWork {
    shared: Arc<Shared>,
    end: Arc<Event>,
    /// Whether `wait` blocks the host (barrier) rather than the current stream.
    blocking: bool,
}

impl WorkHandle for NcclWork {
    fn wait(&self) -> Result<()> {
        if let Some(e) = self.shared.broken() {
            return Err(e);
        }
        if self.blocking {
            // Host wait, bounded: the watchdog aborts an operation past the timeout, which
            // ends its kernels and completes the event.
            let deadline = Instant::now() + self.shared.timeout + WATCHDOG_PERIOD * 4;
            while !self.end.query()? {
                if let Some(e) = self.shared.broken() {
                    return Err(e);
                }
                if Instant::now() > deadline {
                    return Err(Error::Io {
                        kind: std::io::ErrorKind::TimedOut,
                        msg: format!("NCCL barrier did not finish within {:?}", self.shared.timeout),
                    });
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            return match self.shared.broken() {
                Some(e) => Err(e),
                None => Ok(()),
            };
        }
        let _device = DeviceGuard::new(self.shared.device)?;
        let current = cuda::current_stream(self.shared.device)?;
        current.wait_event(&self.end)
    }

    fn is_completed(&self) -> bool {
        self.shared.broken().is_some() || matches!(self.end.query(), Ok(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ember_dtype_maps_to_an_nccl_type() {
        use ncclDataType_t::*;
        let cases = [
            (DType::F32, ncclFloat32),
            (DType::F64, ncclFloat64),
            (DType::F16, ncclFloat16),
            (DType::BF16, ncclBfloat16),
            (DType::I64, ncclInt64),
            (DType::I32, ncclInt32),
            (DType::U8, ncclUint8),
            (DType::Bool, ncclUint8),
        ];
        for (d, n) in cases {
            assert_eq!(nccl_dtype("t", d).unwrap().0, n);
        }
        assert!(nccl_dtype("t", DType::Bool).unwrap().1);
    }

    #[test]
    fn reductions_map_as_pytorch_maps_them() {
        use ncclRedOp_t::*;
        assert_eq!(nccl_op(ReduceOp::Sum, false), ncclSum);
        assert_eq!(nccl_op(ReduceOp::Avg, false), ncclAvg);
        assert_eq!(nccl_op(ReduceOp::Product, false), ncclProd);
        assert_eq!(nccl_op(ReduceOp::Max, false), ncclMax);
        assert_eq!(nccl_op(ReduceOp::Min, false), ncclMin);
        assert_eq!(nccl_op(ReduceOp::Sum, true), ncclMax);
        assert_eq!(nccl_op(ReduceOp::Product, true), ncclMin);
    }

    #[test]
    fn cpu_and_strided_tensors_are_refused_with_typed_errors() {
        let t = Tensor::zeros([2usize, 3], DType::F32, Device::Cpu).unwrap();
        match check_tensor("all_reduce", &t, 1) {
            Err(Error::DeviceMismatch { op, lhs, rhs }) => {
                assert_eq!((op, lhs, rhs), ("all_reduce", Device::Cuda(1), Device::Cpu));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_group_device_is_explicit_then_local_rank() {
        assert_eq!(group_device(Some(3), Some(1), 5).unwrap(), 3);
        assert_eq!(group_device(None, Some(1), 5).unwrap(), 1);
    }
}
