//! The caching allocator of one CUDA device: PyTorch's policy (`c10/cuda/CUDACachingAllocator.cpp`)
//! over a small [`Driver`] trait, so that the whole policy is std-only and tested with a fake
//! driver. It owns block bookkeeping, statistics, snapshots and the alloc/free trace; the real
//! driver and the public `cuda::memory_*` functions live elsewhere.
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
//!   recorded on each of those streams at free time has completed.
//! - A found block splits when the remainder is >= 512 B (small pool) or > 1 MiB (large pool);
//!   a freed block merges with the free neighbours of its segment.
//! - When the driver is out of memory: synchronize pending frees, release the fully free
//!   segments of the request's pool, retry; then release those of both pools, retry; only then
//!   fail with [`OutOfMemory`]. The allocator stays usable after a failure.
//!
//! Locking: all state sits behind one `Mutex`; every public method takes it once. The driver is
//! called under the lock (it is the allocator's own collaborator); no other user code is, except
//! the closure given to [`CachingAllocator::with_driver`], which must not call the allocator.

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

/// One statistic, as PyTorch's `Stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Largest `current` since the last `reset_peak_stats`.
    pub peak: i64,
    /// Sum of increments since the last `reset_accumulated_stats`.
    pub allocated: i64,
    /// Sum of decrements since the last `reset_accumulated_stats`.
    pub freed: i64,
}

impl Stat {
    /// Adds `delta` (either sign), as PyTorch's `update_stat`.
    fn update(&mut self, delta: i64) {
        self.current += delta;
        self.peak = self.peak.max(self.current);
        if delta > 0 {
            self.allocated += delta;
        } else {
            self.freed -= delta;
        }
    }
}

/// One statistic for all blocks and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// The large pool only.
    pub large_pool: Stat,
    /// The small pool only.
    pub small_pool: Stat,
}

impl StatArray {
    /// The statistic of one pool.
    pub fn pool(&self, pool: Pool) -> &Stat {
        match pool {
            Pool::Small => &self.small_pool,
            Pool::Large => &self.large_pool,
        }
    }

    /// Adds `delta` to `all` and to `pool`.
    fn update(&mut self, pool: Pool, delta: i64) {
        if delta == 0 {
            return;
        }
        self.all.update(delta);
        match pool {
            Pool::Small => self.small_pool.update(delta),
            Pool::Large => self.large_pool.update(delta),
        }
    }

    /// The three statistics with PyTorch's names.
    fn named(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("large_pool", &self.large_pool),
            ("small_pool", &self.small_pool),
        ]
    }

    /// The three statistics, mutably.
    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.large_pool, &mut self.small_pool]
    }
}

/// The allocator's statistics, with PyTorch's `memory_stats()` meanings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Blocks handed out.
    pub allocation: StatArray,
    /// Segments obtained from the driver.
    pub segment: StatArray,
    /// Blocks handed out plus blocks freed but waiting on cross-stream events.
    pub active: StatArray,
    /// Free blocks that are parts of a split segment (not releasable).
    pub inactive_split: StatArray,
    /// Bytes of `allocation`.
    pub allocated_bytes: StatArray,
    /// Bytes of `segment`.
    pub reserved_bytes: StatArray,
    /// Bytes of `active`.
    pub active_bytes: StatArray,
    /// Bytes of `inactive_split`.
    pub inactive_split_bytes: StatArray,
    /// Un-rounded requested bytes of `active` blocks.
    pub requested_bytes: StatArray,
    /// Mallocs that failed at the driver and retried after flushing the cache.
    pub num_alloc_retries: i64,
    /// Mallocs that failed with [`OutOfMemory`].
    pub num_ooms: i64,
    /// Times every pending cross-stream free was synchronized.
    pub num_sync_all_streams: i64,
    /// Successful driver `malloc` calls.
    pub num_device_alloc: i64,
    /// Driver `free` calls.
    pub num_device_free: i64,
}

impl MemoryStats {
    /// The nine statistics with PyTorch's names.
    fn named(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// The nine statistics, mutably.
    fn each_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }
}

/// State of a block in a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out.
    ActiveAllocated,
    /// Freed, waiting on events of other streams.
    ActivePendingFree,
    /// Free, in its pool.
    Inactive,
}

impl BlockState {
    /// PyTorch's snapshot name.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// One block of a segment in a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Device address.
    pub address: u64,
    /// Size in bytes.
    pub size: usize,
    /// Requested bytes (0 when inactive).
    pub requested_size: usize,
    /// Allocated, pending or free.
    pub state: BlockState,
}

/// One driver segment in a snapshot, its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Base address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: usize,
    /// Owning stream.
    pub stream: StreamId,
    /// Pool of its blocks.
    pub pool: Pool,
    /// Blocks covering the segment.
    pub blocks: Vec<BlockInfo>,
}

impl SegmentInfo {
    /// Bytes of blocks in the given states.
    fn bytes_where(&self, keep: impl Fn(BlockState) -> bool) -> usize {
        self.blocks.iter().filter(|b| keep(b.state)).map(|b| b.size).sum()
    }
}

/// What a trace entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// `free` was called on a block.
    FreeRequested,
    /// The block returned to its pool (events done).
    FreeCompleted,
    /// A segment was obtained from the driver.
    SegmentAlloc,
    /// A segment was returned to the driver.
    SegmentFree,
}

impl TraceAction {
    /// PyTorch's trace name.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
        }
    }
}

/// One recorded allocator event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address.
    pub addr: u64,
    /// Block or segment size in bytes.
    pub size: usize,
    /// Stream of the block or segment.
    pub stream: StreamId,
    /// Microseconds since the UNIX epoch.
    pub time_us: u64,
}

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
}

/// Everything behind the allocator's lock.
struct State<D> {
    driver: D,
    /// Every block of every segment, by start address.
    blocks: HashMap<u64, Block>,
    /// Free blocks per pool (`Pool::index`), ordered for best fit: (stream, size, address).
    free_blocks: [BTreeSet<(StreamId, usize, u64)>; 2],
    /// Segments by base address.
    segments: BTreeMap<u64, Segment>,
    /// Freed blocks waiting on events: (block address, events not yet seen complete).
    pending: Vec<(u64, Vec<EventId>)>,
    stats: MemoryStats,
    recording: bool,
    max_entries: usize,
    trace: VecDeque<TraceEntry>,
}

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

    /// Removes the best-fitting free block of `pool` for `stream` from its free set.
    fn take_best_fit(&mut self, pool: Pool, stream: StreamId, size: usize) -> Option<u64> {
        let set = &mut self.free_blocks[pool.index()];
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
        self.process_events();
        let Some((size, segment_size)) = sizes(bytes) else {
            return Err(self.out_of_memory(bytes));
        };
        let pool = Pool::for_size(size);
        let addr = match self.take_best_fit(pool, stream, size) {
            Some(addr) => addr,
            None => self.new_block(size, segment_size, stream, pool)?,
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
    ) -> Result<u64, OutOfMemory> {
        if let Some(addr) = self.new_segment(segment_size, stream, pool) {
            return Ok(addr);
        }
        self.stats.num_alloc_retries += 1;
        // (1) Blocks waiting on events may fit once synchronized; else drop this pool's cache.
        self.synchronize_and_free_events();
        if let Some(addr) = self.take_best_fit(pool, stream, size) {
            return Ok(addr);
        }
        if self.release_cached(Some(pool)) > 0 {
            if let Some(addr) = self.new_segment(segment_size, stream, pool) {
                return Ok(addr);
            }
        }
        // (2) Drop every fully free segment of both pools.
        self.release_cached(None);
        if let Some(addr) = self.new_segment(segment_size, stream, pool) {
            return Ok(addr);
        }
        Err(self.out_of_memory(size))
    }

    fn out_of_memory(&mut self, requested: usize) -> OutOfMemory {
        self.stats.num_ooms += 1;
        let (free, total) = self.driver.mem_get_info();
        OutOfMemory {
            requested,
            total,
            free,
            allocated: self.stats.allocated_bytes.all.current.max(0) as usize,
            reserved: self.stats.reserved_bytes.all.current.max(0) as usize,
        }
    }

    /// A new driver segment as one free, unsplit block (not in a free set).
    fn new_segment(&mut self, size: usize, stream: StreamId, pool: Pool) -> Option<u64> {
        let addr = self.driver.malloc(size)?;
        self.stats.num_device_alloc += 1;
        self.stats.segment.update(pool, 1);
        self.stats.reserved_bytes.update(pool, size as i64);
        self.segments.insert(addr, Segment { size, stream, pool });
        let block = Block {
            size,
            requested: 0,
            stream,
            pool,
            state: Use::Free,
            prev: None,
            next: None,
            stream_uses: BTreeSet::new(),
        };
        self.blocks.insert(addr, block);
        self.record(TraceAction::SegmentAlloc, addr, size, stream);
        Some(addr)
    }

    /// Hands out the free block at `addr` (taken out of its free set), splitting off the rest.
    fn hand_out(&mut self, addr: u64, size: usize, requested: usize) -> Allocation {
        let (pool, stream, block_size, next, already_split) = {
            let b = self.block(addr);
            (b.pool, b.stream, b.size, b.next, b.is_split())
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
            };
            self.blocks.insert(rest, block);
            self.free_blocks[pool.index()].insert((stream, remaining, rest));
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
        let uses = std::mem::take(&mut b.stream_uses);
        b.state = if uses.is_empty() {
            Use::Free
        } else {
            Use::PendingFree
        };
        let (pool, size, stream) = (b.pool, b.size, b.stream);
        self.stats.allocation.update(pool, -1);
        self.stats.allocated_bytes.update(pool, -(size as i64));
        self.record(TraceAction::FreeRequested, ptr, size, stream);
        if uses.is_empty() {
            self.free_block(ptr);
        } else {
            let events = uses.into_iter().map(|s| self.driver.record_event(s)).collect();
            self.pending.push((ptr, events));
        }
        true
    }

    /// Returns the block at `addr` to its pool, merging it with free neighbours.
    fn free_block(&mut self, addr: u64) {
        let mut b = self
            .blocks
            .remove(&addr)
            .expect("allocator invariant: freed block exists");
        let (orig_size, requested, pool) = (b.size, b.requested, b.pool);
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
            self.free_blocks[pool.index()].remove(&(n.stream, n.size, neighbour));
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
        self.free_blocks[pool.index()].insert((b.stream, b.size, start));
        self.blocks.insert(start, b);
        let s = &mut self.stats;
        s.inactive_split.update(pool, split_blocks);
        s.inactive_split_bytes.update(pool, split_bytes);
        s.active.update(pool, -1);
        s.active_bytes.update(pool, -(orig_size as i64));
        s.requested_bytes.update(pool, -(requested as i64));
    }

    /// Completes the pending frees whose events have all completed (queries, never blocks).
    fn process_events(&mut self) {
        for (addr, mut events) in std::mem::take(&mut self.pending) {
            let driver = &mut self.driver;
            events.retain(|&e| {
                let done = driver.event_done(e);
                if done {
                    driver.destroy_event(e);
                }
                !done
            });
            if events.is_empty() {
                self.free_block(addr);
            } else {
                self.pending.push((addr, events));
            }
        }
    }

    /// Waits for every pending event and completes every pending free.
    fn synchronize_and_free_events(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for (addr, events) in std::mem::take(&mut self.pending) {
            for e in events {
                self.driver.synchronize_event(e);
                self.driver.destroy_event(e);
            }
            self.free_block(addr);
        }
    }

    /// Returns every fully free segment (of `pool`, or of both) to the driver; bytes released.
    fn release_cached(&mut self, pool: Option<Pool>) -> usize {
        let bases: Vec<u64> = self
            .segments
            .iter()
            .filter(|(base, seg)| {
                let b = self.block(**base);
                pool.is_none_or(|p| p == seg.pool) && b.state == Use::Free && !b.is_split()
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
            self.free_blocks[seg.pool.index()].remove(&(seg.stream, seg.size, base));
            self.driver.free(base);
            self.stats.num_device_free += 1;
            self.stats.segment.update(seg.pool, -1);
            self.stats.reserved_bytes.update(seg.pool, -(seg.size as i64));
            self.record(TraceAction::SegmentFree, base, seg.size, seg.stream);
            released += seg.size;
        }
        released
    }

    fn snapshot(&self) -> Vec<SegmentInfo> {
        let mut out = Vec::with_capacity(self.segments.len());
        for (&base, seg) in &self.segments {
            let mut blocks = Vec::new();
            let mut at = Some(base);
            while let Some(addr) = at {
                let b = self.block(addr);
                let state = match b.state {
                    Use::Allocated => BlockState::ActiveAllocated,
                    Use::PendingFree => BlockState::ActivePendingFree,
                    Use::Free => BlockState::Inactive,
                };
                blocks.push(BlockInfo {
                    address: addr,
                    size: b.size,
                    requested_size: b.requested,
                    state,
                });
                at = b.next;
            }
            out.push(SegmentInfo {
                address: base,
                total_size: seg.size,
                stream: seg.stream,
                pool: seg.pool,
                blocks,
            });
        }
        out
    }
}

impl<D: Driver> CachingAllocator<D> {
    /// An allocator with an empty cache over `driver`.
    pub fn new(driver: D) -> Self {
        let state = State {
            driver,
            blocks: HashMap::new(),
            free_blocks: [BTreeSet::new(), BTreeSet::new()],
            segments: BTreeMap::new(),
            pending: Vec::new(),
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
    /// cross-stream frees).
    pub fn empty_cache(&self) {
        let mut state = self.lock();
        state.synchronize_and_free_events();
        state.release_cached(None);
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

/// PyTorch's `memory_stats()` dictionary: 9 stats x 3 pools x 4 fields, plus 5 counters.
pub fn memory_stats_map(stats: &MemoryStats) -> BTreeMap<String, i64> {
    let mut map = BTreeMap::new();
    for (name, array) in stats.named() {
        for (pool, s) in array.named() {
            for (field, v) in [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ] {
                map.insert(format!("{name}.{pool}.{field}"), v);
            }
        }
    }
    for (name, v) in [
        ("num_alloc_retries", stats.num_alloc_retries),
        ("num_ooms", stats.num_ooms),
        ("num_sync_all_streams", stats.num_sync_all_streams),
        ("num_device_alloc", stats.num_device_alloc),
        ("num_device_free", stats.num_device_free),
    ] {
        map.insert(name.to_string(), v);
    }
    map
}

/// Bytes in binary units with two decimals ("512 B", "1.50 MiB").
fn format_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes.unsigned_abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// A readable table like `torch.cuda.memory_summary()`.
pub fn memory_summary(stats: &MemoryStats, device: usize) -> String {
    let rule = format!("|{}|\n", "-".repeat(75));
    let double = format!("|{}|\n", "=".repeat(75));
    let mut out = double.clone();
    out += &format!(
        "|{:^75}|\n",
        format!("ember CUDA memory summary, device ID {device}")
    );
    out += &rule;
    out += &format!(
        "|{:^37}|{:^37}|\n",
        format!("CUDA OOMs: {}", stats.num_ooms),
        format!("cudaMalloc retries: {}", stats.num_alloc_retries)
    );
    out += &double;
    out += &format!(
        "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |\n",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    let bytes: fn(i64) -> String = format_bytes;
    let count: fn(i64) -> String = |v| v.to_string();
    type Row<'a> = (&'a str, &'a StatArray, fn(i64) -> String);
    let rows: [Row; 9] = [
        ("Allocated memory", &stats.allocated_bytes, bytes),
        ("Active memory", &stats.active_bytes, bytes),
        ("Requested memory", &stats.requested_bytes, bytes),
        ("GPU reserved memory", &stats.reserved_bytes, bytes),
        ("Non-releasable memory", &stats.inactive_split_bytes, bytes),
        ("Allocations", &stats.allocation, count),
        ("Active allocs", &stats.active, count),
        ("GPU reserved segments", &stats.segment, count),
        ("Non-releasable allocs", &stats.inactive_split, count),
    ];
    for (label, array, show) in rows {
        out += &rule;
        for (name, s) in [
            (label, &array.all),
            ("      from large pool", &array.large_pool),
            ("      from small pool", &array.small_pool),
        ] {
            out += &format!(
                "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |\n",
                name,
                show(s.current),
                show(s.peak),
                show(s.allocated),
                show(s.freed)
            );
        }
    }
    out += &double;
    out
}

/// JSON shaped like PyTorch's `torch.cuda.memory._snapshot()` (one device's traces).
pub fn snapshot_json(segments: &[SegmentInfo], trace: &[TraceEntry]) -> String {
    let segs: Vec<String> = segments
        .iter()
        .map(|seg| {
            let blocks: Vec<String> = seg
                .blocks
                .iter()
                .map(|b| {
                    format!(
                        r#"{{"address":{},"size":{},"requested_size":{},"state":"{}"}}"#,
                        b.address,
                        b.size,
                        b.requested_size,
                        b.state.as_str()
                    )
                })
                .collect();
            format!(
                concat!(
                    r#"{{"address":{},"total_size":{},"stream":{},"segment_type":"{}","#,
                    r#""allocated_size":{},"active_size":{},"blocks":[{}]}}"#
                ),
                seg.address,
                seg.total_size,
                seg.stream,
                seg.pool.as_str(),
                seg.bytes_where(|s| s == BlockState::ActiveAllocated),
                seg.bytes_where(|s| s != BlockState::Inactive),
                blocks.join(",")
            )
        })
        .collect();
    let entries: Vec<String> = trace
        .iter()
        .map(|t| {
            format!(
                r#"{{"action":"{}","addr":{},"size":{},"stream":{},"time_us":{}}}"#,
                t.action.as_str(),
                t.addr,
                t.size,
                t.stream,
                t.time_us
            )
        })
        .collect();
    format!(
        r#"{{"segments":[{}],"device_traces":[[{}]]}}"#,
        segs.join(","),
        entries.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    const BASE: u64 = 0x1000_0000;

    /// Segments are handed out back to back from `BASE` (adjacent, so merging across segments
    /// would show); events complete only when the test says so.
    struct FakeDriver {
        capacity: usize,
        used: usize,
        next_addr: u64,
        live: HashMap<u64, usize>,
        events: HashMap<EventId, (StreamId, bool)>,
        next_event: EventId,
        destroyed: Vec<EventId>,
        synchronized: usize,
    }

    impl FakeDriver {
        fn new(capacity: usize) -> Self {
            FakeDriver {
                capacity,
                used: 0,
                next_addr: BASE,
                live: HashMap::new(),
                events: HashMap::new(),
                next_event: 1,
                destroyed: Vec::new(),
                synchronized: 0,
            }
        }

        fn complete_all(&mut self) {
            for e in self.events.values_mut() {
                e.1 = true;
            }
        }
    }

    impl Driver for FakeDriver {
        fn malloc(&mut self, bytes: usize) -> Option<u64> {
            if self.used + bytes > self.capacity {
                return None;
            }
            let addr = self.next_addr;
            self.next_addr += bytes as u64;
            self.used += bytes;
            self.live.insert(addr, bytes);
            Some(addr)
        }
        fn free(&mut self, ptr: u64) {
            let bytes = self.live.remove(&ptr).expect("driver free of an unknown segment");
            self.used -= bytes;
        }
        fn mem_get_info(&mut self) -> (usize, usize) {
            (self.capacity - self.used, self.capacity)
        }
        fn record_event(&mut self, stream: StreamId) -> EventId {
            let e = self.next_event;
            self.next_event += 1;
            self.events.insert(e, (stream, false));
            e
        }
        fn event_done(&mut self, event: EventId) -> bool {
            self.events[&event].1
        }
        fn synchronize_event(&mut self, event: EventId) {
            self.synchronized += 1;
            self.events.get_mut(&event).expect("unknown event").1 = true;
        }
        fn destroy_event(&mut self, event: EventId) {
            self.events.remove(&event).expect("destroying an unknown event");
            self.destroyed.push(event);
        }
    }

    fn allocator(capacity: usize) -> CachingAllocator<FakeDriver> {
        CachingAllocator::new(FakeDriver::new(capacity))
    }

    fn segment_sizes(a: &CachingAllocator<FakeDriver>) -> Vec<usize> {
        a.snapshot().iter().map(|s| s.total_size).collect()
    }

    #[test]
    fn rounding_and_size_classes() {
        let a = allocator(1 << 40);
        let x = a.malloc(1, 0).unwrap();
        assert_eq!((x.size, x.requested, x.ptr), (512, 1, BASE));
        let y = a.malloc(MIB + 1, 0).unwrap();
        assert_eq!(y.size, MIB + 512);
        let z = a.malloc(10 * MIB + 1, 1).unwrap(); // stream 0 would carve it out of y's segment
        assert_eq!(z.size, 10 * MIB + 512);
        let w = a.malloc(MIB, 0).unwrap(); // exactly 1 MiB: still small, shares x's segment
        assert_eq!(w.ptr, x.ptr + 512);
        assert_eq!(segment_sizes(&a), vec![2 * MIB, 20 * MIB, 12 * MIB]);
        let s = a.stats();
        assert_eq!(s.reserved_bytes.small_pool.current, (2 * MIB) as i64);
        assert_eq!(s.reserved_bytes.large_pool.current, (32 * MIB) as i64);
        assert_eq!(s.allocation.small_pool.current, 2);
        assert_eq!(s.allocation.large_pool.current, 2);
        let pools: Vec<Pool> = a.snapshot().iter().map(|s| s.pool).collect();
        assert_eq!(pools, vec![Pool::Small, Pool::Large, Pool::Large]);
    }

    #[test]
    fn zero_bytes_and_overflow() {
        let a = allocator(1 << 30);
        let z = a.malloc(0, 7).unwrap();
        assert_eq!(
            z,
            Allocation {
                ptr: 0,
                size: 0,
                requested: 0,
                stream: 7
            }
        );
        assert!(a.free(0));
        assert_eq!(a.stats(), MemoryStats::default());
        let err = a.malloc(usize::MAX, 0).unwrap_err();
        assert_eq!(err.requested, usize::MAX);
        assert_eq!(a.stats().num_ooms, 1);
        assert!(a.snapshot().is_empty());
    }

    #[test]
    fn small_requests_share_one_segment() {
        let a = allocator(1 << 30);
        let ptrs: Vec<u64> = (0..3).map(|_| a.malloc(1000, 0).unwrap().ptr).collect();
        assert_eq!(ptrs, vec![BASE, BASE + 1024, BASE + 2048]);
        assert_eq!(a.stats().num_device_alloc, 1);
        assert_eq!(segment_sizes(&a), vec![2 * MIB]);
    }

    #[test]
    fn reuse_after_free_and_double_free() {
        let a = allocator(1 << 30);
        let x = a.malloc(4096, 0).unwrap();
        assert!(a.free(x.ptr));
        assert!(!a.free(x.ptr), "double free must be refused");
        assert!(!a.free(x.ptr + 512), "an address inside a block is not a block");
        assert!(!a.free(12345));
        let y = a.malloc(4096, 0).unwrap();
        assert_eq!(y.ptr, x.ptr);
        let s = a.stats();
        assert_eq!(
            (s.num_device_alloc, s.allocation.all.current, s.active.all.current),
            (1, 1, 1)
        );
        assert_eq!(s.allocated_bytes.all.current, 4096);
    }

    #[test]
    fn best_fit_picks_the_smallest_fitting_block() {
        let a = allocator(1 << 30);
        let big = a.malloc(8 * KIB, 0).unwrap();
        let _sep1 = a.malloc(512, 0).unwrap();
        let small = a.malloc(4 * KIB, 0).unwrap();
        let _sep2 = a.malloc(512, 0).unwrap();
        assert!(a.free(big.ptr));
        assert!(a.free(small.ptr));
        assert_eq!(a.malloc(4 * KIB, 0).unwrap().ptr, small.ptr);
        let mid = a.malloc(5000, 0).unwrap(); // 5120 B: the 8 KiB block, not the segment's tail
        assert_eq!(mid.ptr, big.ptr);
        assert_eq!(
            a.malloc(3000, 0).unwrap().ptr,
            big.ptr + 5120,
            "the 3 KiB rest of the 8 KiB block"
        );
    }

    #[test]
    fn split_and_merge() {
        let a = allocator(1 << 30);
        let x = a.malloc(4096, 0).unwrap();
        let y = a.malloc(4096, 0).unwrap();
        let z = a.malloc(4096, 0).unwrap();
        let tail = (2 * MIB - 3 * 4096) as i64;
        let split = |a: &CachingAllocator<FakeDriver>| {
            let s = a.stats();
            (
                s.inactive_split.small_pool.current,
                s.inactive_split_bytes.small_pool.current,
            )
        };
        assert_eq!(split(&a), (1, tail));
        assert!(a.free(y.ptr));
        assert_eq!(split(&a), (2, tail + 4096));
        assert!(a.free(x.ptr)); // merges with y
        assert_eq!(split(&a), (2, tail + 8192));
        let blocks: Vec<(u64, usize)> = a.snapshot()[0]
            .blocks
            .iter()
            .map(|b| (b.address, b.size))
            .collect();
        assert_eq!(
            blocks,
            vec![(x.ptr, 8192), (z.ptr, 4096), (z.ptr + 4096, tail as usize)]
        );
        assert!(a.free(z.ptr)); // merges with both sides: one unsplit block
        assert_eq!(split(&a), (0, 0));
        let seg = &a.snapshot()[0];
        assert_eq!(
            seg.blocks,
            vec![BlockInfo {
                address: BASE,
                size: 2 * MIB,
                requested_size: 0,
                state: BlockState::Inactive
            }]
        );
    }

    #[test]
    fn merging_stays_inside_a_segment() {
        let a = allocator(1 << 30);
        let x = a.malloc(2 * MIB, 0).unwrap(); // 20 MiB segment at BASE, split
        let y = a.malloc(19 * MIB, 1).unwrap(); // another stream: a new, adjacent segment
        assert_eq!(y.ptr, BASE + (20 * MIB) as u64);
        assert!(a.free(x.ptr));
        assert!(a.free(y.ptr));
        assert_eq!(segment_sizes(&a), vec![20 * MIB, 20 * MIB]);
        assert!(a.snapshot().iter().all(|s| s.blocks.len() == 1));
    }

    #[test]
    fn blocks_stay_on_their_stream() {
        let a = allocator(1 << 30);
        let x = a.malloc(4096, 1).unwrap();
        assert!(a.free(x.ptr));
        let y = a.malloc(4096, 2).unwrap();
        assert_ne!(y.ptr, x.ptr);
        assert_eq!(a.stats().num_device_alloc, 2);
        let seg_streams: Vec<StreamId> = a.snapshot().iter().map(|s| s.stream).collect();
        assert_eq!(seg_streams, vec![1, 2]);
        assert_eq!(a.malloc(4096, 1).unwrap().ptr, x.ptr);
        assert!(a.free(y.ptr));
        let z = a.malloc(4096, 0).unwrap(); // stream 2's free block sorts after stream 0's range
        assert_ne!(z.ptr, y.ptr);
        assert_eq!(a.stats().num_device_alloc, 3);
    }

    #[test]
    fn large_blocks_split_only_above_one_mib() {
        let a = allocator(1 << 30);
        let x = a.malloc(23 * MIB / 2, 0).unwrap(); // 12 MiB segment, 0.5 MiB left: not split
        assert_eq!((x.size, x.requested), (12 * MIB, 23 * MIB / 2));
        let y = a.malloc(21 * MIB / 2, 1).unwrap(); // 12 MiB segment, 1.5 MiB left: split
        assert_eq!(y.size, 21 * MIB / 2);
        let s = a.stats();
        assert_eq!(
            s.allocated_bytes.large_pool.current,
            (12 * MIB + 21 * MIB / 2) as i64
        );
        assert_eq!(
            s.requested_bytes.large_pool.current,
            (23 * MIB / 2 + 21 * MIB / 2) as i64
        );
        assert_eq!(
            (s.inactive_split.all.current, s.inactive_split_bytes.all.current),
            (1, 3 * MIB as i64 / 2)
        );
        let blocks: Vec<usize> = a.snapshot().iter().map(|s| s.blocks.len()).collect();
        assert_eq!(blocks, vec![1, 2]);
    }

    #[test]
    fn record_stream_delays_reuse_until_the_event_completes() {
        let a = allocator(1 << 30);
        let x = a.malloc(4096, 1).unwrap();
        a.record_stream(x.ptr, 2);
        a.record_stream(x.ptr, 1); // own stream: ignored
        assert!(a.free(x.ptr));
        assert!(!a.free(x.ptr));
        let events: Vec<(StreamId, bool)> = a.with_driver(|d| d.events.values().copied().collect());
        assert_eq!(events, vec![(2, false)]);
        let s = a.stats();
        assert_eq!((s.allocation.all.current, s.allocated_bytes.all.current), (0, 0));
        assert_eq!((s.active.all.current, s.active_bytes.all.current), (1, 4096));
        assert_eq!(s.requested_bytes.all.current, 4096);
        assert_eq!(a.snapshot()[0].blocks[0].state, BlockState::ActivePendingFree);
        let y = a.malloc(4096, 1).unwrap();
        assert_ne!(
            y.ptr, x.ptr,
            "a block waiting on another stream must not be reused"
        );
        a.with_driver(|d| d.complete_all());
        let z = a.malloc(4096, 1).unwrap(); // processes the completed event first
        assert_eq!(z.ptr, x.ptr);
        assert_eq!(
            a.with_driver(|d| (d.destroyed.clone(), d.synchronized)),
            (vec![1], 0)
        );
        let s = a.stats();
        assert_eq!(
            (s.active.all.current, s.active.all.freed, s.num_sync_all_streams),
            (2, 1, 0)
        );
    }

    #[test]
    fn empty_cache_synchronizes_pending_frees() {
        let a = allocator(1 << 30);
        let x = a.malloc(3 * MIB, 0).unwrap();
        a.record_stream(x.ptr, 5);
        a.record_stream(x.ptr, 6);
        assert!(a.free(x.ptr));
        a.empty_cache();
        assert_eq!(
            a.with_driver(|d| (d.synchronized, d.destroyed.len(), d.live.len())),
            (2, 2, 0)
        );
        let s = a.stats();
        assert_eq!((s.num_sync_all_streams, s.num_device_free), (1, 1));
        assert_eq!((s.active.all.current, s.reserved_bytes.all.current), (0, 0));
        assert!(a.snapshot().is_empty());
    }

    #[test]
    fn out_of_memory_reports_exact_figures_and_recovers() {
        let a = allocator(64 * MIB);
        let x = a.malloc(30 * MIB, 0).unwrap();
        let _y = a.malloc(30 * MIB, 0).unwrap();
        let err = a.malloc(30 * MIB - 100, 0).unwrap_err();
        let want = OutOfMemory {
            requested: 30 * MIB,
            total: 64 * MIB,
            free: 4 * MIB,
            allocated: 60 * MIB,
            reserved: 60 * MIB,
        };
        assert_eq!(err, want);
        let msg = err.to_string();
        assert!(msg.contains("Tried to allocate 30.00 MiB"), "{msg}");
        assert!(
            msg.contains("total capacity of 64.00 MiB of which 4.00 MiB is free"),
            "{msg}"
        );
        let s = a.stats();
        assert_eq!(
            (
                s.num_ooms,
                s.num_alloc_retries,
                s.num_sync_all_streams,
                s.num_device_free
            ),
            (1, 1, 1, 0)
        );
        assert!(a.free(x.ptr));
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes.all.current, (30 * MIB) as i64);
        let z = a.malloc(20 * MIB, 0).unwrap();
        assert_eq!(z.size, 20 * MIB);
        let s = a.stats();
        assert_eq!(
            (
                s.num_ooms,
                s.num_alloc_retries,
                s.num_device_alloc,
                s.num_device_free
            ),
            (1, 1, 3, 1)
        );
        assert_eq!(s.allocated_bytes.all.current, (50 * MIB) as i64);
    }

    #[test]
    fn oom_path_releases_cached_segments_of_the_same_pool() {
        let a = allocator(42 * MIB);
        let x = a.malloc(30 * MIB, 0).unwrap();
        assert!(a.free(x.ptr)); // cached, 30 MiB reserved
        let small = a.malloc(1000, 0).unwrap();
        assert!(a.free(small.ptr)); // a cached small segment, which step (1) leaves alone
        let y = a.malloc(20 * MIB, 1).unwrap(); // other stream: needs a segment, only after release
        assert_eq!(y.size, 20 * MIB);
        let s = a.stats();
        assert_eq!((s.num_alloc_retries, s.num_ooms, s.num_device_free), (1, 0, 1));
        assert_eq!(s.reserved_bytes.all.current, (22 * MIB) as i64);
        assert_eq!(segment_sizes(&a), vec![2 * MIB, 20 * MIB]); // address order
    }

    #[test]
    fn oom_path_releases_cached_segments_of_the_other_pool() {
        let a = allocator(21 * MIB);
        let x = a.malloc(1000, 0).unwrap();
        assert!(a.free(x.ptr)); // a cached 2 MiB small segment
        let y = a.malloc(20 * MIB, 0).unwrap();
        assert_eq!(y.size, 20 * MIB);
        let s = a.stats();
        assert_eq!((s.num_alloc_retries, s.num_ooms, s.num_device_free), (1, 0, 1));
        assert_eq!(s.reserved_bytes.small_pool.current, 0);
        assert_eq!(s.segment.all.current, 1);
    }

    #[test]
    fn oom_path_uses_blocks_freed_by_synchronizing() {
        let a = allocator(20 * MIB);
        let x = a.malloc(20 * MIB, 0).unwrap();
        a.record_stream(x.ptr, 3);
        assert!(a.free(x.ptr));
        let y = a.malloc(20 * MIB, 0).unwrap();
        assert_eq!(y.ptr, x.ptr);
        let s = a.stats();
        assert_eq!(
            (s.num_alloc_retries, s.num_sync_all_streams, s.num_device_alloc),
            (1, 1, 1)
        );
    }

    #[test]
    fn empty_cache_drops_reserved_to_allocated() {
        let a = allocator(1 << 30);
        let keep = a.malloc(12 * MIB, 0).unwrap(); // a 12 MiB segment, used whole
        let small: Vec<u64> = (0..4).map(|_| a.malloc(10_000, 0).unwrap().ptr).collect();
        let big = a.malloc(3 * MIB, 0).unwrap();
        let other = a.malloc(1000, 9).unwrap();
        for p in small.into_iter().chain([big.ptr, other.ptr]) {
            assert!(a.free(p));
        }
        assert_eq!(
            a.stats().reserved_bytes.all.current,
            (12 * MIB + 20 * MIB + 4 * MIB) as i64
        );
        a.empty_cache();
        let s = a.stats();
        assert_eq!(s.reserved_bytes.all.current, s.allocated_bytes.all.current);
        assert_eq!(s.allocated_bytes.all.current, keep.size as i64);
        assert_eq!((s.num_device_free, s.segment.all.current), (3, 1));
        assert_eq!(a.with_driver(|d| d.used), 12 * MIB);
    }

    /// The scripted sequence of `exact_stats`, on stream 0 (a, b, c, d are allocations).
    fn script(a: &CachingAllocator<FakeDriver>) {
        let x = a.malloc(1000, 0).unwrap(); // a: 1024 B of a new 2 MiB small segment
        let y = a.malloc(3 * MIB, 0).unwrap(); // b: 3 MiB of a new 20 MiB large segment
        let _c = a.malloc(2000, 0).unwrap(); // c: 2048 B after a
        assert!(a.free(x.ptr));
        assert!(a.free(y.ptr)); // merges with the 17 MiB rest: large segment unsplit again
        let d = a.malloc(512, 0).unwrap(); // d: best fit is a's 1024 B block, split 512 + 512
        assert_eq!(d.ptr, x.ptr);
    }

    #[test]
    fn exact_stats() {
        // By hand, per step (a, b, c, free a, free b, d):
        // allocation.all: 1 2 3 2 1 2 -> current 2, peak 3, allocated 4, freed 2
        // allocation.small: 1 1 2 1 1 2 -> 2, 2, 3, 1; allocation.large: 0 1 1 1 0 0 -> 0, 1, 1, 1
        // allocated_bytes.all: 1024, 3146752, 3148800, 3147776, 2048, 2560
        //   -> current 2560, peak 3148800, allocated 3149312, freed 3146752
        // allocated_bytes.small: 1024 1024 3072 2048 2048 2560 -> 2560, 3072, 3584, 1024
        // requested_bytes.all: 1000, 3146728, 3148728, 3147728, 2000, 2512
        //   -> 2512, 3148728, 3149240, 3146728
        // reserved_bytes.all: 2 MiB + 20 MiB = 23068672 throughout the last five steps
        // inactive_split.all: 1 2 2 3 2 2 -> 2, 3, 3, 1; .large: 0 1 1 1 0 0 -> 0, 1, 1, 1
        // inactive_split_bytes.small: 2096128 (tail), =, 2094080 (-2048), 2095104 (+1024 a), =,
        //   2094592 (-512) -> current 2094592, peak 2096128, allocated 2097152, freed 2560
        // inactive_split_bytes.large: 0, 17825792, =, =, 0, 0 -> 0, 17825792, 17825792, 17825792
        let a = allocator(1 << 30);
        script(&a);
        let s = a.stats();
        let st = |current, peak, allocated, freed| Stat {
            current,
            peak,
            allocated,
            freed,
        };
        assert_eq!(s.allocation.all, st(2, 3, 4, 2));
        assert_eq!(s.allocation.small_pool, st(2, 2, 3, 1));
        assert_eq!(s.allocation.large_pool, st(0, 1, 1, 1));
        assert_eq!(s.active, s.allocation);
        assert_eq!(s.allocated_bytes.all, st(2560, 3148800, 3149312, 3146752));
        assert_eq!(s.allocated_bytes.small_pool, st(2560, 3072, 3584, 1024));
        assert_eq!(s.active_bytes, s.allocated_bytes);
        assert_eq!(s.requested_bytes.all, st(2512, 3148728, 3149240, 3146728));
        assert_eq!(s.reserved_bytes.all, st(23068672, 23068672, 23068672, 0));
        assert_eq!(s.segment.all, st(2, 2, 2, 0));
        assert_eq!(s.inactive_split.all, st(2, 3, 3, 1));
        assert_eq!(s.inactive_split.large_pool, st(0, 1, 1, 1));
        assert_eq!(
            s.inactive_split_bytes.small_pool,
            st(2094592, 2096128, 2097152, 2560)
        );
        assert_eq!(
            s.inactive_split_bytes.large_pool,
            st(0, 17825792, 17825792, 17825792)
        );
        assert_eq!(
            (
                s.num_device_alloc,
                s.num_device_free,
                s.num_alloc_retries,
                s.num_ooms
            ),
            (2, 0, 0, 0)
        );
        let small: Vec<(usize, BlockState)> =
            a.snapshot()[0].blocks.iter().map(|b| (b.size, b.state)).collect();
        use BlockState::{ActiveAllocated as A, Inactive as I};
        assert_eq!(small, vec![(512, A), (512, I), (2048, A), (2094080, I)]);
    }

    #[test]
    fn reset_peak_and_accumulated() {
        let a = allocator(1 << 30);
        script(&a);
        assert!(a.malloc(usize::MAX, 0).is_err());
        a.empty_cache(); // releases the large segment, synchronizes (nothing pending)
        a.reset_peak_stats();
        let s = a.stats();
        assert_eq!((s.num_ooms, s.num_sync_all_streams, s.num_device_free), (1, 1, 1));
        assert_eq!(
            s.allocation.all,
            Stat {
                current: 2,
                peak: 2,
                allocated: 4,
                freed: 2
            }
        );
        assert_eq!(s.allocated_bytes.all.peak, 2560);
        assert_eq!(s.inactive_split_bytes.large_pool.peak, 0);
        a.reset_accumulated_stats();
        let s = a.stats();
        assert_eq!(
            s.allocation.all,
            Stat {
                current: 2,
                peak: 2,
                allocated: 0,
                freed: 0
            }
        );
        assert_eq!(
            s.reserved_bytes.all,
            Stat {
                current: 2 * MIB as i64,
                peak: 2 * MIB as i64,
                allocated: 0,
                freed: 0
            }
        );
        let counters = (
            s.num_alloc_retries,
            s.num_ooms,
            s.num_sync_all_streams,
            s.num_device_alloc,
            s.num_device_free,
        );
        assert_eq!(counters, (0, 0, 0, 0, 0));
        let _ = a.malloc(100 * MIB, 0).unwrap();
        let s = a.stats();
        assert_eq!(
            s.allocated_bytes.all,
            Stat {
                current: 2560 + 100 * MIB as i64,
                peak: 2560 + 100 * MIB as i64,
                allocated: 100 * MIB as i64,
                freed: 0
            }
        );
        assert_eq!(s.num_device_alloc, 1);
    }

    #[test]
    fn stats_map_has_every_key() {
        let a = allocator(1 << 30);
        script(&a);
        let map = memory_stats_map(&a.stats());
        assert_eq!(map.len(), 9 * 3 * 4 + 5);
        for name in [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
        ] {
            for pool in ["all", "large_pool", "small_pool"] {
                for field in ["current", "peak", "allocated", "freed"] {
                    assert!(
                        map.contains_key(&format!("{name}.{pool}.{field}")),
                        "{name}.{pool}.{field}"
                    );
                }
            }
        }
        assert_eq!(map["allocated_bytes.all.peak"], 3148800);
        assert_eq!(map["inactive_split_bytes.small_pool.freed"], 2560);
        assert_eq!(map["requested_bytes.large_pool.current"], 0);
        assert_eq!(map["num_device_alloc"], 2);
        for k in [
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_free",
        ] {
            assert_eq!(map[k], 0, "{k}");
        }
    }

    #[test]
    fn summary_has_the_rows() {
        let a = allocator(1 << 30);
        let _x = a.malloc(3 * MIB / 2, 0).unwrap();
        let text = memory_summary(&a.stats(), 3);
        for row in [
            "device ID 3",
            "CUDA OOMs: 0",
            "Cur Usage",
            "Peak Usage",
            "Tot Alloc",
            "Tot Freed",
            "| Allocated memory      |   1.50 MiB |   1.50 MiB |   1.50 MiB |        0 B |",
            "|       from large pool |   1.50 MiB |",
            "|       from small pool |        0 B |",
            "Active memory",
            "Requested memory",
            "| GPU reserved memory   |  20.00 MiB |",
            "| Non-releasable memory |  18.50 MiB |",
            "| Allocations           |          1 |          1 |          1 |          0 |",
            "Active allocs",
            "GPU reserved segments",
            "Non-releasable allocs",
        ] {
            assert!(text.contains(row), "missing {row:?} in\n{text}");
        }
        assert!(text.lines().all(|l| l.chars().count() == 77), "{text}");
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 << 30), "3.00 GiB");
    }

    #[test]
    fn snapshot_and_history_json() {
        let a = allocator(1 << 30);
        let _before = a.malloc(1000, 0).unwrap(); // not recorded
        a.record_history(true, 100);
        let x = a.malloc(3 * MIB, 4).unwrap();
        assert!(a.free(x.ptr));
        a.empty_cache();
        a.record_history(false, 0);
        let _after = a.malloc(3 * MIB, 4).unwrap(); // not recorded; trace kept after stopping
        let trace = a.history();
        let actions: Vec<TraceAction> = trace.iter().map(|t| t.action).collect();
        use TraceAction::*;
        assert_eq!(
            actions,
            vec![SegmentAlloc, Alloc, FreeRequested, FreeCompleted, SegmentFree]
        );
        let seg_base = BASE + (2 * MIB) as u64;
        assert_eq!(
            (trace[0].addr, trace[0].size, trace[0].stream),
            (seg_base, 20 * MIB, 4)
        );
        assert_eq!((trace[1].addr, trace[1].size), (x.ptr, 3 * MIB));
        assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us) && trace[0].time_us > 0);
        let json = snapshot_json(&a.snapshot(), &trace);
        let first = concat!(
            r#"{"segments":[{"address":268435456,"total_size":2097152,"stream":0,"segment_type":"small","#,
            r#""allocated_size":1024,"active_size":1024,"blocks":["#,
            r#"{"address":268435456,"size":1024,"requested_size":1000,"state":"active_allocated"},"#,
            r#"{"address":268436480,"size":2096128,"requested_size":0,"state":"inactive"}]}"#
        );
        assert!(json.starts_with(first), "{json}");
        assert!(
            json.contains(r#""segment_type":"large","allocated_size":3145728,"active_size":3145728"#),
            "{json}"
        );
        let trace0 = format!(
            r#"],"device_traces":[[{{"action":"segment_alloc","addr":{seg_base},"size":20971520,"stream":4,"#
        );
        assert!(json.contains(&format!("{trace0}\"time_us\":")), "{json}");
        for action in [
            "\"alloc\"",
            "\"free_requested\"",
            "\"free_completed\"",
            "\"segment_free\"",
        ] {
            assert!(json.contains(action), "{action} in {json}");
        }
        assert!(json.ends_with("}]]}"), "{json}");
        assert_eq!(snapshot_json(&[], &[]), r#"{"segments":[],"device_traces":[[]]}"#);
    }

    #[test]
    fn history_keeps_the_newest_entries() {
        let a = allocator(1 << 30);
        a.record_history(true, 3);
        let ptrs: Vec<u64> = (0..4).map(|_| a.malloc(512, 0).unwrap().ptr).collect();
        let kept: Vec<(TraceAction, u64)> = a.history().iter().map(|t| (t.action, t.addr)).collect();
        assert_eq!(
            kept,
            vec![
                (TraceAction::Alloc, ptrs[1]),
                (TraceAction::Alloc, ptrs[2]),
                (TraceAction::Alloc, ptrs[3])
            ]
        );
        a.record_history(true, 10); // restarting clears
        assert!(a.history().is_empty());
    }

    #[test]
    fn concurrent_use_keeps_stats_consistent() {
        let a = std::sync::Arc::new(allocator(1 << 34));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for i in 0..200usize {
                        let x = a.malloc(512 * (i % 7 + 1) + (t as usize) * MIB, t).unwrap();
                        let y = a.malloc(100 + i, t).unwrap();
                        assert!(a.free(x.ptr));
                        assert!(a.free(y.ptr));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = a.stats();
        assert_eq!(
            (
                s.allocation.all.current,
                s.active_bytes.all.current,
                s.requested_bytes.all.current
            ),
            (0, 0, 0)
        );
        assert_eq!(s.allocation.all.allocated, 1600);
        assert_eq!(s.inactive_split.all.current, 0, "every segment merged back whole");
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
        assert!(a.with_driver(|d| d.live.is_empty()));
    }
}
