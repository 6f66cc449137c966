//! Memory accounting common to every device: the list of large live tensor storages (what
//! an out-of-memory error names), the bytes held in host storages, fallible host allocation,
//! and the one builder of `Error::OutOfMemory`.
//!
//! Note [Live allocation list]: a storage of at least [`TRACK_MIN_BYTES`] is entered in one
//! process-wide list when its `StorageRef` is made and leaves it when the last view drops, with
//! its device, bytes, dtype, the shape of the first tensor made over it and the op last
//! entered on the making thread (the dispatch point and the creation functions set it). Smaller
//! storages cost one relaxed atomic add (host bytes, Note [Host byte shards]) and nothing else,
//! so the per-op host cost of small tensors does not change; the list's lock is taken only for
//! storages of a MiB or more, whose allocation and fill cost far more.
//!
//! Note [Host byte shards]: the bytes held in host storages were one process-wide atomic that
//! every CPU storage made or dropped added to. Threads making CPU tensors at once (DataParallel
//! over CPU devices, data-loading workers beside training) then wrote one cache line from every
//! core, and the flag every op reads (`dispatch::observer`'s, which the linker had put in the
//! same line) missed too. In a perf profile of two threads each running a small CPU MLP (8
//! linear layers of 8x8 and their ReLUs, batch 2, no grad), the add took 91% of
//! `Tracking::new`'s samples and the flag's load 61% of `dispatch::prepare`'s. Each thread now
//! adds to one of `HOST_SHARDS` (64) counters of its own cache line (picked once per thread, in
//! turn); the total is their sum, read only for error messages. A storage dropped on another
//! thread than the one that made it subtracts from another shard, so one shard may go below
//! zero; the sum stays exact. Two threads on two cores, five alternating runs: 7.7-8.1 us per
//! forward against 8.4-8.7 before (one thread alone: 7.2-7.4).

use crate::error::fmt_bytes;
use crate::{DType, Device, Error, Result, Shape};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Storages of at least this many bytes (1 MiB) are entered in the live allocation list.
pub const TRACK_MIN_BYTES: usize = 1 << 20;

/// How many of the largest live allocations an out-of-memory error names.
pub const OOM_LARGEST: usize = 5;

/// One large live tensor storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveAllocation {
    pub device: Device,
    pub bytes: usize,
    pub dtype: DType,
    /// The shape of the first tensor made over the storage, when one was.
    pub shape: Option<Shape>,
    /// The op last entered on the thread that made the storage ("" when none).
    pub op: &'static str,
}

impl std::fmt::Display for LiveAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} on {}", fmt_bytes(self.bytes), self.dtype, self.device)?;
        if let Some(shape) = &self.shape {
            write!(f, " {shape}")?;
        }
        if !self.op.is_empty() {
            write!(f, " made by {}", self.op)?;
        }
        Ok(())
    }
}

static LIVE: Mutex<Option<HashMap<u64, LiveAllocation>>> = Mutex::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Counters of host storage bytes (Note [Host byte shards]).
const HOST_SHARDS: usize = 64;

/// One shard of the host byte count, alone in its cache line (128 bytes: adjacent lines are
/// prefetched in pairs).
#[repr(align(128))]
struct HostShard(AtomicIsize);

/// A count added to from many threads at once (Note [Host byte shards]): each thread adds to
/// its own shard, picked once per thread in turn; the count is the shards' sum. A shard may go
/// below zero (a value added on one thread and taken away on another); the sum stays exact once
/// the adding threads are done, or joined.
struct ShardedCount([HostShard; HOST_SHARDS]);

impl ShardedCount {
    const fn new() -> ShardedCount {
        ShardedCount([const { HostShard(AtomicIsize::new(0)) }; HOST_SHARDS])
    }

    /// Adds `delta` to the calling thread's shard.
    fn add(&self, delta: isize) {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % HOST_SHARDS;
        }
        let shard = SHARD.try_with(|s| *s).unwrap_or(0);
        self.0[shard].0.fetch_add(delta, Ordering::Relaxed);
    }

    /// The sum of the shards.
    fn sum(&self) -> isize {
        self.0.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }
}

/// Bytes of every live host storage (tracked or not), spread over shards: their sum.
static HOST_BYTES: ShardedCount = ShardedCount::new();

/// Adds `bytes` to the calling thread's shard of [`HOST_BYTES`].
fn add_host_bytes(bytes: isize) {
    HOST_BYTES.add(bytes);
}

thread_local! {
    static CURRENT_OP: Cell<&'static str> = const { Cell::new("") };
    /// Net bytes of [CPU, CUDA] storages made minus dropped on this thread while memory
    /// profiling was on (Note [Profiled memory]).
    static PROFILED_BYTES: Cell<[i64; 2]> = const { Cell::new([0, 0]) };
}

/// Profilers with `profile_memory` running now.
static MEMORY_PROFILERS: AtomicUsize = AtomicUsize::new(0);

// Note [Profiled memory]: while a profiler with `profile_memory` runs, every tensor storage
// made adds its bytes to a per-thread counter for its device type and every storage dropped
// subtracts them, on the thread that drops it (as PyTorch's allocators report to the profiler
// of the calling thread). The profiler reads the counter when an op enters and leaves: the
// difference is the op's "CPU Mem" / "CUDA Mem" (negative when it freed more than it made).
// Bytes are the storage's elements times the dtype's size, not the caching allocator's rounded
// block sizes. With no such profiler the cost is one relaxed atomic load per storage made or
// dropped.

/// Counts storages in the per-thread byte counters from now on (one call per profiler).
pub(crate) fn start_memory_profiling() {
    MEMORY_PROFILERS.fetch_add(1, Ordering::Relaxed);
}

/// Undoes one [`start_memory_profiling`].
pub(crate) fn stop_memory_profiling() {
    MEMORY_PROFILERS.fetch_sub(1, Ordering::Relaxed);
}

/// The calling thread's net profiled bytes of [CPU, CUDA] storages (Note [Profiled memory]).
pub(crate) fn profiled_bytes() -> [i64; 2] {
    PROFILED_BYTES.with(Cell::get)
}

#[inline]
fn note_profiled(device: Device, bytes: i64) {
    if MEMORY_PROFILERS.load(Ordering::Relaxed) != 0 {
        let which = usize::from(device != Device::Cpu);
        PROFILED_BYTES.with(|c| {
            let mut v = c.get();
            v[which] += bytes;
            c.set(v);
        });
    }
}

/// Names the op that storages made on this thread from now on belong to (Note [Live allocation
/// list]); one thread-local write.
#[inline]
pub fn set_current_op(op: &'static str) {
    CURRENT_OP.with(|c| c.set(op));
}

fn live() -> std::sync::MutexGuard<'static, Option<HashMap<u64, LiveAllocation>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A storage's entry in the accounting; undoes it when dropped (held by the `StorageRef`).
#[derive(Debug)]
pub(crate) struct Tracking {
    /// The id in the live list, 0 when the storage is too small to be listed.
    id: u64,
    host_bytes: usize,
    /// The storage's bytes and device, for the memory profiler.
    bytes: usize,
    device: Device,
}

impl Tracking {
    /// Enters a storage of `len` elements of `dtype` on `device` in the accounting.
    pub(crate) fn new(device: Device, dtype: DType, len: usize) -> Tracking {
        let bytes = len.saturating_mul(dtype.size_in_bytes());
        let host_bytes = if device == Device::Cpu { bytes } else { 0 };
        note_profiled(device, bytes as i64);
        if host_bytes > 0 {
            add_host_bytes(host_bytes as isize);
        }
        let mut id = 0;
        if bytes >= TRACK_MIN_BYTES {
            id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            let entry = LiveAllocation {
                device,
                bytes,
                dtype,
                shape: None,
                op: CURRENT_OP.with(Cell::get),
            };
            live().get_or_insert_with(HashMap::new).insert(id, entry);
        }
        Tracking {
            id,
            host_bytes,
            bytes,
            device,
        }
    }

    /// Records the shape of the first tensor over a listed storage.
    pub(crate) fn note_shape(&self, shape: &Shape) {
        if self.id == 0 {
            return;
        }
        if let Some(e) = live().as_mut().and_then(|m| m.get_mut(&self.id)) {
            e.shape.get_or_insert_with(|| shape.clone());
        }
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        note_profiled(self.device, -(self.bytes as i64));
        if self.host_bytes > 0 {
            add_host_bytes(-(self.host_bytes as isize));
        }
        if self.id != 0 {
            if let Some(m) = live().as_mut() {
                m.remove(&self.id);
            }
        }
    }
}

/// Bytes held in host (CPU) tensor storages now.
pub fn host_memory_allocated() -> usize {
    HOST_BYTES.sum().max(0) as usize
}

/// The `n` largest live allocations on `device` (storages of at least [`TRACK_MIN_BYTES`]),
/// largest first.
pub fn largest_live_allocations(device: Device, n: usize) -> Vec<LiveAllocation> {
    let mut all: Vec<LiveAllocation> = live()
        .as_ref()
        .map(|m| m.values().filter(|a| a.device == device).cloned().collect())
        .unwrap_or_default();
    all.sort_by(|a, b| b.bytes.cmp(&a.bytes));
    all.truncate(n);
    all
}

/// The one builder of `Error::OutOfMemory`: the figures of the failed request plus the largest
/// live allocations on `device`.
pub fn out_of_memory(
    device: Device,
    requested: usize,
    total: usize,
    free: usize,
    allocated: usize,
    reserved: usize,
) -> Error {
    Error::OutOfMemory {
        device,
        requested,
        total,
        free,
        allocated,
        reserved,
        largest: largest_live_allocations(device, OOM_LARGEST),
    }
}

/// `Error::OutOfMemory` for a host request of `requested` bytes, with the machine's total and
/// available memory (`/proc/meminfo` where there is one, else 0).
#[cold]
pub fn host_out_of_memory(requested: usize) -> Error {
    let (total, free) = host_meminfo();
    let held = host_memory_allocated();
    out_of_memory(Device::Cpu, requested, total, free, held, held)
}

/// (MemTotal, MemAvailable) in bytes, or zeros where `/proc/meminfo` cannot be read.
fn host_meminfo() -> (usize, usize) {
    (meminfo_field("MemTotal:"), meminfo_field("MemAvailable:"))
}

/// One `/proc/meminfo` field in bytes (0 where it cannot be read).
fn meminfo_field(name: &str) -> usize {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return 0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kib| kib.saturating_mul(1024))
}

/// A `Vec` with room for exactly `n` elements, or `Error::OutOfMemory` (host) when the machine
/// cannot hold them; an `Error::InvalidArgument` of `op` when `n` elements of `dtype` exceed
/// the address space.
pub(crate) fn try_vec<T>(op: &'static str, n: usize, dtype: DType) -> Result<Vec<T>> {
    let bytes = crate::shape::checked_bytes(op, n, dtype)?;
    let mut v = Vec::new();
    try_reserve_bytes(&mut v, n, bytes)?;
    Ok(v)
}

/// Reserves `bytes` of host memory for a `Vec` of `T` (`bytes / size_of::<T>()` elements), or
/// `Error::OutOfMemory`: a request larger than the machine's memory and swap together is
/// refused before the allocator is asked (under Linux's `overcommit_memory = 1` the allocator
/// would grant it and the fill would be killed), a request the allocator refuses after.
fn try_reserve_bytes<T>(v: &mut Vec<T>, n: usize, bytes: usize) -> Result<()> {
    if bytes >= CHECK_TOTAL_MIN_BYTES {
        let (total, _) = host_meminfo();
        let swap = host_swap();
        if total > 0 && bytes > total.saturating_add(swap) {
            return Err(host_out_of_memory(bytes));
        }
    }
    v.try_reserve_exact(n).map_err(|_| host_out_of_memory(bytes))
}

/// Requests of at least this many bytes (1 GiB) are compared with the machine's memory first.
const CHECK_TOTAL_MIN_BYTES: usize = 1 << 30;

/// SwapTotal in bytes (0 where `/proc/meminfo` cannot be read).
fn host_swap() -> usize {
    meminfo_field("SwapTotal:")
}

/// `n` copies of `value` in a new `Vec`, fallibly (see [`try_vec`]).
pub(crate) fn try_filled<T: Clone>(op: &'static str, n: usize, dtype: DType, value: T) -> Result<Vec<T>> {
    let mut v = try_vec(op, n, dtype)?;
    v.resize(n, value);
    Ok(v)
}

/// Host allocations of at least this many bytes (1 MiB) are probed before a CPU kernel makes
/// them (Note [Fallible host allocation]).
pub const PROBE_MIN_BYTES: usize = 1 << 20;

// Note [Fallible host allocation]
// Rust aborts the process when a `Vec` cannot get its memory. The CPU backend's storages are
// made fallibly instead: creation (`full`, `zeros`, the random family, ranges) reserves with
// `try_reserve_exact` ([`try_vec`]), and a CPU kernel whose output buffer grows inside a
// parallel `collect` first calls [`check_host_alloc`] with the output's size: for a MiB or more
// it reserves that many bytes and frees them at once (an mmap and munmap of untouched pages,
// microseconds beside the kernel), so a request the machine cannot hold is
// `Error::OutOfMemory` before the kernel starts. Smaller requests are not probed. A request of
// a GiB or more that exceeds the machine's memory and swap together is refused without asking
// the allocator, so the answer does not depend on the kernel's overcommit policy. The probe is
// a check, not a reservation: memory taken by another thread between the probe and the kernel
// can still end in the allocator's abort, as any Rust allocation can.

/// Checks that `n` elements of `dtype` can be allocated on the host (see the note above).
pub(crate) fn check_host_alloc(op: &'static str, n: usize, dtype: DType) -> Result<()> {
    let bytes = crate::shape::checked_bytes(op, n, dtype)?;
    if bytes < PROBE_MIN_BYTES {
        return Ok(());
    }
    let mut probe: Vec<u8> = Vec::new();
    try_reserve_bytes(&mut probe, bytes, bytes)
}

/// The text of an `Error::OutOfMemory`.
pub(crate) fn oom_message(
    device: &Device,
    requested: usize,
    total: usize,
    free: usize,
    allocated: usize,
    reserved: usize,
    largest: &[LiveAllocation],
) -> String {
    let mut msg = match device {
        Device::Cpu => format!(
            "CPU out of memory: tried to allocate {} ({requested} bytes) in host memory; the machine has {} in total, of which {} is available; ember holds {} in host tensors",
            fmt_bytes(requested),
            fmt_bytes(total),
            fmt_bytes(free),
            fmt_bytes(allocated)
        ),
        Device::Cuda(i) => format!(
            "CUDA out of memory on cuda:{i}: tried to allocate {} ({requested} bytes); the GPU has {} in total, of which {} is free; ember holds {} in tensors and {} reserved by the caching allocator",
            fmt_bytes(requested),
            fmt_bytes(total),
            fmt_bytes(free),
            fmt_bytes(allocated),
            fmt_bytes(reserved)
        ),
    };
    if !largest.is_empty() {
        msg += "; largest live allocations: ";
        msg += &largest
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
    }
    msg += "; to fit: use a smaller batch, free tensors you no longer need";
    if device.is_cuda() {
        msg += " and call ember::cuda::empty_cache()";
    }
    msg += ", train in mixed precision (ember::amp::autocast with bfloat16 or float16), or recompute activations with gradient checkpointing (ember::autograd::checkpoint)";
    msg
}

// Note [Concurrency checks]: the parts of ember that threads share without a lock (the sharded
// host byte count here, the dispatch point's observer count and list, the profiler's current
// session) and the caching allocator's bookkeeping (one lock, taken by every thread that
// allocates) have tests that run them from many threads at once and check the books balance
// afterwards. They are sized down under Miri, whose data-race detector runs them too:
//   MIRIFLAGS=-Zmiri-disable-isolation cargo +nightly miri test -p ember-core --lib -- \
//     across_threads while_threads
// (README, "Checking concurrency").

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_count_sums_exactly_across_threads() {
        let (threads, per_thread) = if cfg!(miri) { (4, 60) } else { (8, 20_000) };
        let count = ShardedCount::new();
        // Each thread adds values and hands every other one to the next thread, which takes it
        // away again (a storage made on one thread and dropped on another).
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..threads).map(|_| std::sync::mpsc::channel::<isize>()).unzip();
        let kept: isize = std::thread::scope(|s| {
            let handles: Vec<_> = receivers
                .into_iter()
                .enumerate()
                .map(|(t, rx)| {
                    let next = senders[(t + 1) % threads].clone();
                    let count = &count;
                    s.spawn(move || {
                        let mut kept = 0;
                        for i in 0..per_thread {
                            let v = (t * per_thread + i) as isize + 1;
                            count.add(v);
                            if i % 2 == 0 {
                                kept += v;
                            } else {
                                next.send(v).unwrap();
                            }
                        }
                        drop(next);
                        // Take away what the previous thread handed over, as it arrives.
                        for _ in 0..per_thread / 2 {
                            count.add(-rx.recv().unwrap());
                        }
                        kept
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(count.sum(), kept);
        let total: isize = (1..=(threads * per_thread) as isize).sum();
        assert!(
            kept > 0 && kept < total,
            "some values were kept and some taken away"
        );
    }
}
