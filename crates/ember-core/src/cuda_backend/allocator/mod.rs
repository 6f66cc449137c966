//! The caching allocator of one CUDA device: PyTorch's policy (`c10/cuda/CUDACachingAllocator.cpp`)
//! over a small [`Driver`] trait, so that the whole policy is std-only and tested with a fake
//! driver. It owns block bookkeeping, statistics, snapshots (`snapshot.rs`: PyTorch's snapshot
//! structure) and the alloc/free trace; the real driver and the public `cuda::memory_*`
//! functions live elsewhere.
//!
//! The rules, as PyTorch states them:
//! - Requests round up to multiples of 512 B; a 0-byte request gets a null allocation and
//!   touches nothing.
//! - Requests up to 1 MiB come from the small pool, carved out of 2 MiB segments. Larger ones
//!   come from the large pool: below 10 MiB out of 20 MiB segments, from 10 MiB on out of a
//!   segment of the request rounded up to 2 MiB.
//! - Best fit: the smallest free block of the same stream and pool that is large enough.
//!   Once freed, a block is reused on the stream that allocated it, never on another stream.
//! - A block used on other streams (`record_stream`) returns to its pool only after an event
//!   recorded on each of those streams at free time has completed. Each allocation first
//!   looks for completed events stream by stream, oldest first, and stops at a stream's first
//!   event not yet complete (the later ones, recorded after it on the same stream, are not
//!   either): one query per stream with frees pending, where it used to be one per pending
//!   event. FSDP's buffers are used on three streams and wait on events while the host runs
//!   ahead, and its per-op host time in a profile was twice DDP's. With this and one launch for
//!   the pieces of a view gradient (autograd's Note [Gradients of views]), fsdp_gpt2 on two
//!   H200s went from 18.95-19.14 to 18.55-18.74 ms a step at N = 2 and from 18.17 to 17.75-17.80
//!   at N = 1 (session 54 runs 1-3, not measured apart; docs/benchmarks.md); the per-op host
//!   time in the profile stayed about twice DDP's.
//! - A found block splits when the remainder is >= 512 B (small pool) or > 1 MiB (large pool);
//!   a freed block merges with the free neighbours of its segment.
//! - When the driver is out of memory: synchronize pending frees, release the fully free
//!   segments of the request's pool, retry; then release those of both pools, retry; only then
//!   fail with [`OutOfMemory`]. The allocator stays usable after a failure.
//!
//! - While a CUDA graph is being captured, the capture's allocations come from a private pool,
//!   and the allocator neither waits for nor queries events nor returns memory to the driver:
//!   Note [Interaction with CUDA graph capture] in `private_pools.rs`.
//!
//! Locking: all state sits behind one `Mutex`; every public method takes it once. The driver is
//! called under the lock (it is the allocator's own collaborator); no other user code is, except
//! the closure given to [`CachingAllocator::with_driver`], which must not call the allocator.

mod private_pools;
mod snapshot;
mod stats;
#[cfg(test)]
mod tests;

use private_pools::PrivatePool;
pub use private_pools::{CaptureId, MempoolId};

pub use snapshot::{snapshot_json, snapshot_value};
use stats::format_bytes;
pub use stats::{
    memory_stats_map, memory_summary, MemoryStats, SegmentInfo, Stat, StatArray, TraceAction, TraceEntry,
};

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

/// Every block size is a multiple of this (bytes; PyTorch's `kMinBlockSize`).
const MIN_BLOCK_SIZE: usize = 512;
/// Largest rounded request served by the small pool (1 MiB; `kSmallSize`).
const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool (2 MiB; `kSmallBuffer`).
const SMALL_BUFFER: usize = 2 << 20;
/// Segment size for large requests below `MIN_LARGE_ALLOC` (20 MiB; `kLargeBuffer`).
const LARGE_BUFFER: usize = 20 << 20;
/// From this request size on, a segment is sized to the request (10 MiB; `kMinLargeAlloc`).
const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Rounding of request-sized segments (2 MiB; `kRoundLarge`).
const ROUND_LARGE: usize = 2 << 20;

/// A raw CUstream as an integer (0 = the legacy default stream).
pub type StreamId = u64;
/// An opaque event handle from the driver.
pub type EventId = u64;

/// What the allocator needs from the device; the real one wraps cuMemAlloc/cuMemFree/cuEvent*.
pub trait Driver: Send {
    /// A new device segment of exactly `bytes`, or None when the device is out of memory.
    fn malloc(&mut self, bytes: usize) -> Option<u64>;
    /// Returns a segment obtained from `malloc` (whole segment, its base address).
    fn free(&mut self, ptr: u64);
    /// (free, total) bytes of the device, as cuMemGetInfo.
    fn mem_get_info(&mut self) -> (usize, usize);
    /// Creates an event and records it on `stream`.
    fn record_event(&mut self, stream: StreamId) -> EventId;
    /// True when the work before `event` has completed (cuEventQuery).
    fn event_done(&mut self, event: EventId) -> bool;
    /// Blocks until `event` completed.
    fn synchronize_event(&mut self, event: EventId);
    /// Destroys an event created by `record_event`.
    fn destroy_event(&mut self, event: EventId);
    /// The id of the capture sequence `stream` takes part in while that capture is active
    /// (cuStreamGetCaptureInfo), None when the stream is not capturing. Asked only while a
    /// capture allocates to a private pool (Note [Interaction with CUDA graph capture]).
    fn capture_id(&mut self, stream: StreamId) -> Option<CaptureId>;
}

/// Freed blocks waiting on events (PyTorch's `cuda_events`): per stream, the events recorded
/// on it in order, each with its block (one stream completes them in that order); per block,
/// how many of its events have not been seen complete.
#[derive(Debug, Default)]
struct PendingFrees {
    by_stream: BTreeMap<StreamId, VecDeque<(EventId, u64)>>,
    left: HashMap<u64, usize>,
}

/// The two block pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pool {
    /// Rounded requests up to 1 MiB, carved out of 2 MiB segments.
    Small,
    /// Rounded requests above 1 MiB.
    Large,
}

impl Pool {
    /// The pool serving a rounded size.
    fn for_size(size: usize) -> Pool {
        if size <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }

    /// Index into the per-pool free sets.
    fn index(self) -> usize {
        match self {
            Pool::Small => 0,
            Pool::Large => 1,
        }
    }

    /// PyTorch's `segment_type` name: "small" or "large".
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Small => "small",
            Pool::Large => "large",
        }
    }
}

/// One allocation handed out: device address, rounded size, requested size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Device address (0 for a 0-byte request).
    pub ptr: u64,
    /// Size of the block, the request rounded up to 512 B.
    pub size: usize,
    /// Size asked for.
    pub requested: usize,
    /// Stream that owns the block.
    pub stream: StreamId,
}

/// Why an allocation failed after freeing cache and retrying (all bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// The rounded request.
    pub requested: usize,
    /// Device capacity.
    pub total: usize,
    /// Free device memory reported by the driver.
    pub free: usize,
    /// Bytes in blocks handed out by this allocator.
    pub allocated: usize,
    /// Bytes in segments held by this allocator.
    pub reserved: usize,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |v: usize| format_bytes(v as i64);
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU has a total capacity of {} of which {} is \
             free. Of the allocated memory {} is allocated by ember, and {} is reserved by ember but \
             unallocated. If reserved but unallocated memory is large, call empty_cache() or reuse \
             tensor sizes to avoid fragmentation; otherwise reduce the batch size.",
            s(self.requested),
            s(self.total),
            s(self.free),
            s(self.allocated),
            s(self.reserved.saturating_sub(self.allocated)),
        )
    }
}

impl std::error::Error for OutOfMemory {}

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    Allocated,
    PendingFree,
    Free,
}

/// A block of a segment; blocks are keyed by address in `State::blocks`.
#[derive(Debug)]
struct Block {
    size: usize,
    requested: usize,
    stream: StreamId,
    pool: Pool,
    state: Use,
    /// Neighbouring blocks of the same segment, by address.
    prev: Option<u64>,
    next: Option<u64>,
    /// Streams other than `stream` that used the block (`record_stream`).
    stream_uses: BTreeSet<StreamId>,
    /// The private pool of its segment, None for the default pools.
    private: Option<MempoolId>,
}

impl Block {
    fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// A driver segment; its first block starts at its base address.
#[derive(Debug)]
struct Segment {
    size: usize,
    stream: StreamId,
    pool: Pool,
    /// The private pool that owns it, None for the default pools.
    private: Option<MempoolId>,
}

/// Everything behind the allocator's lock.
struct State<D> {
    driver: D,
    /// Every block of every segment, by start address.
    blocks: HashMap<u64, Block, foldhash::fast::FixedState>,
    /// Free blocks of the default pools per size class (`Pool::index`), ordered for best fit:
    /// (stream, size, address).
    free_blocks: [FreeSet; 2],
    /// Private pools by id, each with free sets of its own (Note [Interaction with CUDA graph
    /// capture]).
    private: BTreeMap<MempoolId, PrivatePool>,
    /// Captures allocating to a private pool: the pool, and the capture's id once it is known.
    captures: Vec<(MempoolId, Option<CaptureId>)>,
    /// Blocks freed while a capture was underway that other streams used: their events are
    /// recorded once no capture is underway.
    deferred: Vec<u64>,
    /// Segments by base address.
    segments: BTreeMap<u64, Segment>,
    /// Freed blocks waiting on events.
    pending: PendingFrees,
    stats: MemoryStats,
    recording: bool,
    max_entries: usize,
    trace: VecDeque<TraceEntry>,
}

/// Free blocks ordered for best fit: (stream, size, address).
type FreeSet = BTreeSet<(StreamId, usize, u64)>;

/// A PyTorch-style caching allocator for one device (all methods take `&self`).
pub struct CachingAllocator<D: Driver> {
    state: Mutex<State<D>>,
}

/// Rounded block size and segment size for a request, None on arithmetic overflow.
fn sizes(bytes: usize) -> Option<(usize, usize)> {
    let size = bytes.checked_next_multiple_of(MIN_BLOCK_SIZE)?;
    let segment = if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.checked_next_multiple_of(ROUND_LARGE)?
    };
    Some((size, segment))
}

/// Whether a found block keeps `remaining` bytes as a new free block.
fn should_split(pool: Pool, remaining: usize) -> bool {
    match pool {
        Pool::Small => remaining >= MIN_BLOCK_SIZE,
        Pool::Large => remaining > SMALL_SIZE,
    }
}

impl<D: Driver> State<D> {
    fn record(&mut self, action: TraceAction, addr: u64, size: usize, stream: StreamId) {
        if !self.recording {
            return;
        }
        let time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        self.trace.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
        });
        while self.trace.len() > self.max_entries {
            self.trace.pop_front();
        }
    }

    fn block(&self, addr: u64) -> &Block {
        self.blocks
            .get(&addr)
            .expect("allocator invariant: linked block exists")
    }

    fn block_mut(&mut self, addr: u64) -> &mut Block {
        self.blocks
            .get_mut(&addr)
            .expect("allocator invariant: linked block exists")
    }

    /// The free set of size class `pool` in the default pools (`private` None) or in a private
    /// pool.
    fn free_set(&mut self, private: Option<MempoolId>, pool: Pool) -> &mut FreeSet {
        match private {
            None => &mut self.free_blocks[pool.index()],
            Some(id) => {
                &mut self
                    .private
                    .get_mut(&id)
                    .expect("allocator invariant: a private pool exists while it has segments or users")
                    .free_blocks[pool.index()]
            }
        }
    }

    /// Removes the best-fitting free block of `pool` (of the default pools or of a private
    /// one) for `stream` from its free set.
    fn take_best_fit(
        &mut self,
        private: Option<MempoolId>,
        pool: Pool,
        stream: StreamId,
        size: usize,
    ) -> Option<u64> {
        let set = self.free_set(private, pool);
        let key = *set.range((stream, size, 0)..).next().filter(|k| k.0 == stream)?;
        set.remove(&key);
        Some(key.2)
    }

    fn malloc(&mut self, bytes: usize, stream: StreamId) -> Result<Allocation, OutOfMemory> {
        if bytes == 0 {
            return Ok(Allocation {
                ptr: 0,
                size: 0,
                requested: 0,
                stream,
            });
        }
        // Note [Interaction with CUDA graph capture]: no event queries while a capture is
        // underway; an allocation on a capturing stream comes from its capture's private pool.
        let private = if self.captures.is_empty() {
            self.process_events();
            None
        } else {
            self.capture_pool(stream)
        };
        let Some((size, segment_size)) = sizes(bytes) else {
            return Err(self.out_of_memory(bytes, stream));
        };
        let pool = Pool::for_size(size);
        let addr = match self.take_best_fit(private, pool, stream, size) {
            Some(addr) => addr,
            None => self.new_block(size, segment_size, stream, pool, private)?,
        };
        Ok(self.hand_out(addr, size, bytes))
    }

    /// A free block (not in any free set) for a request no cached block fits: a new segment,
    /// or, when the driver is out of memory, whatever flushing the cache makes available.
    fn new_block(
        &mut self,
        size: usize,
        segment_size: usize,
        stream: StreamId,
        pool: Pool,
        private: Option<MempoolId>,
    ) -> Result<u64, OutOfMemory> {
        if let Some(addr) = self.new_segment(segment_size, stream, pool, private) {
            return Ok(addr);
        }
        if !self.captures.is_empty() {
            // Note [Interaction with CUDA graph capture]: waiting for events and cuMemFree are
            // not allowed while a capture is underway, so there is nothing to retry with.
            return Err(self.out_of_memory(size, stream));
        }
        self.stats.num_alloc_retries += 1;
        // (1) Blocks waiting on events may fit once synchronized; else drop this pool's cache.
        self.synchronize_and_free_events();
        if let Some(addr) = self.take_best_fit(private, pool, stream, size) {
            return Ok(addr);
        }
        if self.release_cached(Some(pool)) > 0 {
            if let Some(addr) = self.new_segment(segment_size, stream, pool, private) {
                return Ok(addr);
            }
        }
        // (2) Drop every fully free segment of both pools, and of private pools no graph uses.
        self.release_cached(None);
        if let Some(addr) = self.new_segment(segment_size, stream, pool, private) {
            return Ok(addr);
        }
        Err(self.out_of_memory(size, stream))
    }

    /// Counts and records (as PyTorch's `OOM` trace entry: free device bytes, request) a
    /// failed request.
    fn out_of_memory(&mut self, requested: usize, stream: StreamId) -> OutOfMemory {
        self.stats.num_ooms += 1;
        let (free, total) = self.driver.mem_get_info();
        self.record(TraceAction::Oom, free as u64, requested, stream);
        OutOfMemory {
            requested,
            total,
            free,
            allocated: self.stats.allocated_bytes.all.current.max(0) as usize,
            reserved: self.stats.reserved_bytes.all.current.max(0) as usize,
        }
    }

    /// A new driver segment as one free, unsplit block (not in a free set), of the default
    /// pools or of the private pool `private`.
    fn new_segment(
        &mut self,
        size: usize,
        stream: StreamId,
        pool: Pool,
        private: Option<MempoolId>,
    ) -> Option<u64> {
        let addr = self.driver.malloc(size)?;
        self.stats.num_device_alloc += 1;
        self.stats.segment.update(pool, 1);
        self.stats.reserved_bytes.update(pool, size as i64);
        if let Some(id) = private {
            self.private
                .get_mut(&id)
                .expect("allocator invariant: a capture's private pool exists")
                .segments += 1;
        }
        self.segments.insert(
            addr,
            Segment {
                size,
                stream,
                pool,
                private,
            },
        );
        let block = Block {
            size,
            requested: 0,
            stream,
            pool,
            state: Use::Free,
            prev: None,
            next: None,
            stream_uses: BTreeSet::new(),
            private,
        };
        self.blocks.insert(addr, block);
        self.record(TraceAction::SegmentAlloc, addr, size, stream);
        Some(addr)
    }

    /// Hands out the free block at `addr` (taken out of its free set), splitting off the rest.
    fn hand_out(&mut self, addr: u64, size: usize, requested: usize) -> Allocation {
        let (pool, stream, block_size, next, already_split, private) = {
            let b = self.block(addr);
            (b.pool, b.stream, b.size, b.next, b.is_split(), b.private)
        };
        let remaining = block_size - size;
        let size = if should_split(pool, remaining) {
            // The block keeps the low `size` bytes; the rest becomes a free block after it.
            let rest = addr + size as u64;
            if let Some(n) = next {
                self.block_mut(n).prev = Some(rest);
            }
            let b = self.block_mut(addr);
            b.size = size;
            b.next = Some(rest);
            let block = Block {
                size: remaining,
                requested: 0,
                stream,
                pool,
                state: Use::Free,
                prev: Some(addr),
                next,
                stream_uses: BTreeSet::new(),
                private,
            };
            self.blocks.insert(rest, block);
            self.free_set(private, pool).insert((stream, remaining, rest));
            let stats = &mut self.stats;
            if already_split {
                // An inactive split block shrinks by `size`.
                stats.inactive_split_bytes.update(pool, -(size as i64));
            } else {
                // A new inactive split block appears out of an unsplit one.
                stats.inactive_split_bytes.update(pool, remaining as i64);
                stats.inactive_split.update(pool, 1);
            }
            size
        } else {
            if already_split {
                // An inactive split block becomes active whole.
                let stats = &mut self.stats;
                stats.inactive_split_bytes.update(pool, -(block_size as i64));
                stats.inactive_split.update(pool, -1);
            }
            block_size
        };
        let b = self.block_mut(addr);
        b.state = Use::Allocated;
        b.requested = requested;
        let s = &mut self.stats;
        s.allocation.update(pool, 1);
        s.allocated_bytes.update(pool, size as i64);
        s.active.update(pool, 1);
        s.active_bytes.update(pool, size as i64);
        s.requested_bytes.update(pool, requested as i64);
        self.record(TraceAction::Alloc, addr, size, stream);
        Allocation {
            ptr: addr,
            size,
            requested,
            stream,
        }
    }

    fn free(&mut self, ptr: u64) -> bool {
        if ptr == 0 {
            return true;
        }
        let Some(b) = self.blocks.get_mut(&ptr).filter(|b| b.state == Use::Allocated) else {
            return false;
        };
        // Note [Interaction with CUDA graph capture]: an event recorded now could be recorded
        // into a capture, and could not be queried; record it once no capture is underway.
        let defer = !b.stream_uses.is_empty() && !self.captures.is_empty();
        let uses = if defer {
            BTreeSet::new()
        } else {
            std::mem::take(&mut b.stream_uses)
        };
        b.state = if uses.is_empty() && !defer {
            Use::Free
        } else {
            Use::PendingFree
        };
        let (pool, size, stream) = (b.pool, b.size, b.stream);
        self.stats.allocation.update(pool, -1);
        self.stats.allocated_bytes.update(pool, -(size as i64));
        self.record(TraceAction::FreeRequested, ptr, size, stream);
        if defer {
            self.deferred.push(ptr);
        } else if uses.is_empty() {
            self.free_block(ptr);
        } else {
            self.wait_for_uses(ptr, uses);
        }
        true
    }

    /// Makes the freed block at `addr` wait for an event on each stream of `uses` (at least
    /// one) before it returns to its pool.
    fn wait_for_uses(&mut self, addr: u64, uses: BTreeSet<StreamId>) {
        if uses.is_empty() {
            return self.free_block(addr);
        }
        self.pending.left.insert(addr, uses.len());
        for stream in uses {
            let event = self.driver.record_event(stream);
            self.pending
                .by_stream
                .entry(stream)
                .or_default()
                .push_back((event, addr));
        }
    }

    /// Counts one of `addr`'s events complete; returns the block to its pool after its last.
    fn event_completed(&mut self, addr: u64) {
        let left = self
            .pending
            .left
            .get_mut(&addr)
            .expect("allocator invariant: a pending block counts its events");
        *left -= 1;
        if *left == 0 {
            self.pending.left.remove(&addr);
            self.free_block(addr);
        }
    }

    /// Returns the block at `addr` to its pool, merging it with free neighbours.
    fn free_block(&mut self, addr: u64) {
        let mut b = self
            .blocks
            .remove(&addr)
            .expect("allocator invariant: freed block exists");
        let (orig_size, requested, pool, private) = (b.size, b.requested, b.pool, b.private);
        self.record(TraceAction::FreeCompleted, addr, orig_size, b.stream);
        let (mut split_blocks, mut split_bytes) = (0i64, 0i64);
        let mut start = addr;
        for neighbour in [b.prev, b.next].into_iter().flatten() {
            if self.block(neighbour).state != Use::Free {
                continue;
            }
            let n = self
                .blocks
                .remove(&neighbour)
                .expect("allocator invariant: checked above");
            self.free_set(private, pool)
                .remove(&(n.stream, n.size, neighbour));
            if neighbour < start {
                start = neighbour;
                b.prev = n.prev;
            } else {
                b.next = n.next;
            }
            b.size += n.size;
            split_blocks -= 1;
            split_bytes -= n.size as i64;
        }
        if let Some(p) = b.prev {
            self.block_mut(p).next = Some(start);
        }
        if let Some(n) = b.next {
            self.block_mut(n).prev = Some(start);
        }
        if b.is_split() {
            split_blocks += 1;
            split_bytes += b.size as i64;
        }
        b.state = Use::Free;
        b.requested = 0;
        self.free_set(private, pool).insert((b.stream, b.size, start));
        self.blocks.insert(start, b);
        let s = &mut self.stats;
        s.inactive_split.update(pool, split_blocks);
        s.inactive_split_bytes.update(pool, split_bytes);
        s.active.update(pool, -1);
        s.active_bytes.update(pool, -(orig_size as i64));
        s.requested_bytes.update(pool, -(requested as i64));
    }

    /// Completes the pending frees whose events have all completed (queries, never blocks).
    /// Only while no capture is underway.
    /// Stream by stream, oldest first, up to the first event not complete (module docs).
    fn process_events(&mut self) {
        self.insert_deferred_events();
        let mut completed = Vec::new();
        for queue in self.pending.by_stream.values_mut() {
            while let Some(&(event, addr)) = queue.front() {
                if !self.driver.event_done(event) {
                    break;
                }
                self.driver.destroy_event(event);
                queue.pop_front();
                completed.push(addr);
            }
        }
        self.pending.by_stream.retain(|_, q| !q.is_empty());
        for addr in completed {
            self.event_completed(addr);
        }
    }

    /// Waits for every pending event and completes every pending free. Only while no capture
    /// is underway.
    fn synchronize_and_free_events(&mut self) {
        self.insert_deferred_events();
        self.stats.num_sync_all_streams += 1;
        for (_, queue) in std::mem::take(&mut self.pending.by_stream) {
            for (event, addr) in queue {
                self.driver.synchronize_event(event);
                self.driver.destroy_event(event);
                self.event_completed(addr);
            }
        }
    }

    /// Returns every fully free segment of the default pools (of size class `pool`, or of
    /// both) to the driver, and with `pool` None also those of private pools no graph uses any
    /// more (Note [Interaction with CUDA graph capture]); bytes released. Only while no capture
    /// is underway.
    fn release_cached(&mut self, pool: Option<Pool>) -> usize {
        let bases: Vec<u64> = self
            .segments
            .iter()
            .filter(|(base, seg)| {
                let b = self.block(**base);
                let releasable = match seg.private {
                    None => pool.is_none_or(|p| p == seg.pool),
                    Some(id) => pool.is_none() && self.private.get(&id).is_some_and(|p| p.use_count == 0),
                };
                releasable && b.state == Use::Free && !b.is_split()
            })
            .map(|(base, _)| *base)
            .collect();
        let mut released = 0;
        for base in bases {
            let seg = self
                .segments
                .remove(&base)
                .expect("allocator invariant: listed above");
            self.blocks.remove(&base);
            self.free_set(seg.private, seg.pool)
                .remove(&(seg.stream, seg.size, base));
            if let Some(id) = seg.private {
                self.private_segment_released(id);
            }
            self.driver.free(base);
            self.stats.num_device_free += 1;
            self.stats.segment.update(seg.pool, -1);
            self.stats.reserved_bytes.update(seg.pool, -(seg.size as i64));
            self.record(TraceAction::SegmentFree, base, seg.size, seg.stream);
            released += seg.size;
        }
        released
    }
}

impl<D: Driver> CachingAllocator<D> {
    /// An allocator with an empty cache over `driver`.
    pub fn new(driver: D) -> Self {
        let state = State {
            driver,
            blocks: HashMap::with_hasher(foldhash::fast::FixedState::default()),
            free_blocks: [BTreeSet::new(), BTreeSet::new()],
            private: BTreeMap::new(),
            captures: Vec::new(),
            deferred: Vec::new(),
            segments: BTreeMap::new(),
            pending: PendingFrees::default(),
            stats: MemoryStats::default(),
            recording: false,
            max_entries: 0,
            trace: VecDeque::new(),
        };
        CachingAllocator {
            state: Mutex::new(state),
        }
    }

    /// The state; a poisoned lock (a panicking driver) is taken over as it is.
    fn lock(&self) -> MutexGuard<'_, State<D>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Best-fit from the stream's pool for the size class, else a new segment.
    pub fn malloc(&self, bytes: usize, stream: StreamId) -> Result<Allocation, OutOfMemory> {
        self.lock().malloc(bytes, stream)
    }

    /// Returns the block at `ptr` to its pool (after events of streams recorded with
    /// `record_stream` have completed); merges with free neighbours. False when `ptr` is not an
    /// allocated block (unknown or already freed); freeing 0 is a no-op returning true.
    pub fn free(&self, ptr: u64) -> bool {
        self.lock().free(ptr)
    }

    /// Marks the block at `ptr` as used on `stream` (cross-stream use); ignored for the
    /// block's own stream and for addresses that are not allocated blocks.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) {
        let mut state = self.lock();
        if let Some(b) = state.blocks.get_mut(&ptr) {
            if b.state == Use::Allocated && b.stream != stream {
                b.stream_uses.insert(stream);
            }
        }
    }

    /// Releases every fully free cached segment to the driver (after completing pending
    /// cross-stream frees), those of private pools that no graph uses included; segments of a
    /// private pool a graph still uses stay. Does nothing and returns false while a capture is
    /// underway (Note [Interaction with CUDA graph capture]).
    pub fn empty_cache(&self) -> bool {
        let mut state = self.lock();
        if !state.captures.is_empty() {
            return false;
        }
        state.synchronize_and_free_events();
        state.release_cached(None);
        true
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut state = self.lock();
        for array in state.stats.each_mut() {
            for stat in array.each_mut() {
                stat.peak = stat.current;
            }
        }
    }

    /// Zeroes every `allocated`/`freed` total and the `num_*` counters.
    pub fn reset_accumulated_stats(&self) {
        let mut state = self.lock();
        for array in state.stats.each_mut() {
            for stat in array.each_mut() {
                stat.allocated = 0;
                stat.freed = 0;
            }
        }
        let s = &mut state.stats;
        s.num_alloc_retries = 0;
        s.num_ooms = 0;
        s.num_sync_all_streams = 0;
        s.num_device_alloc = 0;
        s.num_device_free = 0;
    }

    /// Every segment with its blocks, in address order.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        self.lock().snapshot()
    }

    /// Start/stop recording alloc/free events (keeping at most `max_entries`, oldest dropped).
    /// Starting clears the previous trace; stopping keeps it for [`history`](Self::history).
    pub fn record_history(&self, enabled: bool, max_entries: usize) {
        let mut state = self.lock();
        if enabled {
            state.trace.clear();
            state.max_entries = max_entries;
        }
        state.recording = enabled;
    }

    /// The recorded trace, oldest first.
    pub fn history(&self) -> Vec<TraceEntry> {
        self.lock().trace.iter().copied().collect()
    }

    /// Driver access for the owner (e.g. to create events); runs `f` under the allocator lock,
    /// so `f` must not call this allocator.
    #[allow(dead_code)]
    pub fn with_driver<R>(&self, f: impl FnOnce(&mut D) -> R) -> R {
        f(&mut self.lock().driver)
    }
}
