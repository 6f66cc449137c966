//! The allocator's bookkeeping, exercised against a fake driver (no GPU needed).

use super::stats::{BlockInfo, BlockState};
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
    /// Streams capturing, with their capture's id.
    captures: HashMap<StreamId, CaptureId>,
    /// Event queries and capture-id questions asked.
    queries: usize,
    capture_questions: usize,
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
            captures: HashMap::new(),
            queries: 0,
            capture_questions: 0,
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
        self.queries += 1;
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
    fn capture_id(&mut self, stream: StreamId) -> Option<CaptureId> {
        self.capture_questions += 1;
        self.captures.get(&stream).copied()
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
fn pending_frees_are_queried_stream_by_stream_oldest_first() {
    let a = allocator(1 << 30);
    // Ten blocks of stream 1 used on stream 2, one of them on stream 3 too, all freed.
    let blocks: Vec<u64> = (0..10).map(|_| a.malloc(4096, 1).unwrap().ptr).collect();
    for &b in &blocks {
        a.record_stream(b, 2);
        assert!(a.free(b));
    }
    let y = a.malloc(4096, 1).unwrap();
    a.record_stream(y.ptr, 3);
    a.record_stream(y.ptr, 2);
    assert!(a.free(y.ptr));
    // Stream 2's events are 1..=11 (y's last), stream 3's is 12.
    let queries = |a: &CachingAllocator<FakeDriver>| a.with_driver(|d| d.queries);
    let before = queries(&a);
    let z = a.malloc(4096, 1).unwrap();
    assert_eq!(queries(&a) - before, 2, "one query per stream: its oldest event");
    assert!(!blocks.contains(&z.ptr) && z.ptr != y.ptr);
    a.free(z.ptr);
    // Stream 2 completes its first three, stream 3 its only one: three blocks come back, and
    // y waits for its event on stream 2 still.
    a.with_driver(|d| {
        for e in [1, 2, 3, 12] {
            d.events.get_mut(&e).unwrap().1 = true;
        }
    });
    let before = queries(&a);
    let got: Vec<u64> = (0..4).map(|_| a.malloc(4096, 1).unwrap().ptr).collect();
    assert_eq!(
        queries(&a) - before,
        4 + 1 + 3,
        "3 done and 1 not on stream 2, 1 on stream 3, then 1 per malloc"
    );
    assert_eq!(
        got.iter().filter(|p| blocks[..3].contains(p)).count(),
        3,
        "{got:x?}"
    );
    assert!(!got.contains(&y.ptr));
    assert_eq!(a.with_driver(|d| d.destroyed.clone()), vec![1, 2, 3, 12]);
    // empty_cache waits for the rest, in order, and returns every block.
    for p in got {
        a.free(p);
    }
    a.empty_cache();
    assert_eq!(a.with_driver(|d| (d.synchronized, d.events.len())), (8, 0));
    assert_eq!(a.stats().active.all.current, 0);
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
    let small: Vec<(usize, BlockState)> = a.snapshot()[0].blocks.iter().map(|b| (b.size, b.state)).collect();
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

// ---------------------------------------------------------------------------------------------
// Private pools and capture (Note [Interaction with CUDA graph capture]).

const P: MempoolId = MempoolId(1, 0);

/// Begins a capture into `pool` on `stream`, whose driver id is `id`, as `CUDAGraph` does:
/// routing registered first, then the stream captures, then the id is known.
fn begin(a: &CachingAllocator<FakeDriver>, pool: MempoolId, stream: StreamId, id: CaptureId) {
    assert!(a.begin_allocate_to_pool(pool));
    a.with_driver(|d| d.captures.insert(stream, id));
    a.set_capture_id(pool, id);
}

/// Ends the capture on `stream` into `pool`.
fn end(a: &CachingAllocator<FakeDriver>, pool: MempoolId, stream: StreamId) {
    a.with_driver(|d| d.captures.remove(&stream));
    assert!(a.end_allocate_to_pool(pool));
}

fn segment_pools(a: &CachingAllocator<FakeDriver>) -> Vec<(u64, Option<MempoolId>)> {
    a.snapshot().iter().map(|s| (s.address, s.private_pool)).collect()
}

#[test]
fn capture_allocations_come_from_a_private_pool() {
    let a = allocator(1 << 30);
    let eager = a.malloc(4096, 1).unwrap();
    assert!(a.free(eager.ptr)); // cached in the default small pool, stream 1
    assert_eq!(
        a.with_driver(|d| d.capture_questions),
        0,
        "no capture: no question asked"
    );
    begin(&a, P, 1, 7);
    let x = a.malloc(4096, 1).unwrap();
    assert_ne!(
        x.ptr, eager.ptr,
        "a capture never gets blocks of the default pools"
    );
    let other = a.malloc(4096, 2).unwrap(); // stream 2 is not capturing: default pools
    a.with_driver(|d| d.captures.insert(3, 7)); // stream 3 forked into the capture
    let forked = a.malloc(4096, 3).unwrap();
    a.with_driver(|d| d.captures.remove(&3));
    end(&a, P, 1);
    let mib2 = (2 * MIB) as u64;
    assert_eq!(
        segment_pools(&a),
        vec![
            (BASE, None),
            (BASE + mib2, Some(P)),
            (BASE + 2 * mib2, None),
            (BASE + 3 * mib2, Some(P))
        ]
    );
    assert_eq!(
        (x.ptr, other.ptr, forked.ptr),
        (BASE + mib2, BASE + 2 * mib2, BASE + 3 * mib2)
    );
    // Statistics count the private pool's blocks and segments like any others.
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all.current, 3 * 4096);
    assert_eq!(s.allocation.small_pool.current, 3);
    assert_eq!(s.reserved_bytes.all.current, (8 * MIB) as i64);
    assert_eq!(s.segment.small_pool.current, 4);
    assert_eq!(s.num_device_alloc, 4);
    // After the capture: eager work reuses the default pools, never the private one.
    assert_eq!(a.malloc(4096, 1).unwrap().ptr, eager.ptr);
    assert!(a.free(x.ptr)); // back to the private pool
    let y = a.malloc(4096, 1).unwrap();
    assert_ne!(y.ptr, x.ptr);
    // A later capture into the same pool, on the same stream, reuses it.
    begin(&a, P, 1, 8);
    assert_eq!(a.malloc(4096, 1).unwrap().ptr, x.ptr);
    end(&a, P, 1);
    assert_eq!(a.private_pool_use_count(P), Some(2));
}

#[test]
fn blocks_freed_during_capture_are_reused_only_on_their_stream() {
    let a = allocator(1 << 30);
    begin(&a, P, 1, 7);
    a.with_driver(|d| d.captures.insert(3, 7));
    let t = a.malloc(8192, 1).unwrap();
    assert!(a.free(t.ptr));
    let u = a.malloc(8192, 1).unwrap();
    assert_eq!(
        u.ptr, t.ptr,
        "a later allocation of the same capture on the same stream"
    );
    assert!(a.free(u.ptr));
    let v = a.malloc(8192, 3).unwrap();
    assert_ne!(v.ptr, t.ptr, "another stream of the capture does not get it");
    assert_eq!(a.malloc(8192, 1).unwrap().ptr, t.ptr);
    end(&a, P, 1);
    assert!(!a.end_allocate_to_pool(P), "already ended");
    let s = a.stats();
    assert_eq!((s.allocation.all.current, s.allocation.all.allocated), (2, 4));
    assert_eq!(
        s.inactive_split.small_pool.current, 2,
        "the tails of two 2 MiB segments"
    );
}

#[test]
fn no_event_queries_waits_or_frees_during_capture() {
    let a = allocator(1 << 30);
    let x = a.malloc(4096, 1).unwrap();
    a.record_stream(x.ptr, 2);
    let y = a.malloc(4096, 1).unwrap();
    a.record_stream(y.ptr, 2);
    assert!(a.free(y.ptr)); // before the capture: event 1 recorded on stream 2
    let cached = a.malloc(3 * MIB, 4).unwrap();
    assert!(a.free(cached.ptr)); // a fully free large segment
    let q0 = a.with_driver(|d| d.queries); // the allocation above queried event 1
    begin(&a, P, 1, 7);
    assert!(a.free(x.ptr)); // during the capture: its event waits
    assert_eq!(a.with_driver(|d| d.events.len()), 1);
    assert_eq!(a.snapshot()[0].blocks[0].state, BlockState::ActivePendingFree);
    let z = a.malloc(4096, 1).unwrap();
    assert_eq!(a.with_driver(|d| d.queries), q0, "no cuEventQuery during capture");
    a.with_driver(|d| d.complete_all());
    assert!(!a.empty_cache(), "empty_cache does nothing during capture");
    assert_eq!(
        a.with_driver(|d| (d.synchronized, d.live.len(), d.queries)),
        (0, 3, q0)
    );
    end(&a, P, 1);
    // The next allocation records the deferred event and queries both: y's (completed during
    // the capture) is done, x's new one is not.
    let w = a.malloc(512, 9).unwrap();
    assert_eq!(
        a.with_driver(|d| (d.events.len(), d.queries, d.destroyed.clone())),
        (1, q0 + 2, vec![1])
    );
    a.with_driver(|d| d.complete_all());
    let _ = a.malloc(512, 9).unwrap();
    assert_eq!(a.with_driver(|d| d.destroyed.clone()), vec![1, 2]);
    let s = a.stats();
    assert_eq!(s.active.all.current, 3, "z, w and the last one; x and y are free");
    assert_eq!(s.allocated_bytes.all.current, (4096 + 512 + 512) as i64);
    assert_ne!(z.ptr, x.ptr);
    assert!(a.free(w.ptr));
    assert!(a.empty_cache());
    assert_eq!(a.with_driver(|d| d.synchronized), 0, "nothing was pending");
}

#[test]
fn out_of_memory_during_capture_fails_without_waiting_or_freeing() {
    let a = allocator(24 * MIB);
    let x = a.malloc(20 * MIB, 0).unwrap();
    a.record_stream(x.ptr, 5);
    assert!(a.free(x.ptr)); // a cached 20 MiB segment, pending on stream 5: 4 MiB free
    begin(&a, P, 1, 7);
    let err = a.malloc(10 * MIB, 1).unwrap_err();
    assert_eq!(
        (err.requested, err.free, err.reserved),
        (10 * MIB, 4 * MIB, 20 * MIB)
    );
    let s = a.stats();
    assert_eq!(
        (
            s.num_ooms,
            s.num_alloc_retries,
            s.num_sync_all_streams,
            s.num_device_free
        ),
        (1, 0, 0, 0)
    );
    assert_eq!(a.with_driver(|d| (d.synchronized, d.live.len())), (0, 1));
    let small = a.malloc(1000, 1).unwrap(); // a 2 MiB segment still fits
    end(&a, P, 1);
    // After the capture the same request succeeds by releasing the cache, as always.
    let y = a.malloc(10 * MIB, 1).unwrap();
    assert_eq!(y.size, 10 * MIB);
    let s = a.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_sync_all_streams, s.num_device_free),
        (1, 1, 1)
    );
    assert_eq!(segment_pools(&a).iter().filter(|(_, p)| p.is_some()).count(), 1);
    assert_eq!(
        a.snapshot()
            .iter()
            .find(|s| s.private_pool == Some(P))
            .unwrap()
            .address,
        small.ptr
    );
}

#[test]
fn a_released_pool_returns_its_memory_at_empty_cache() {
    let a = allocator(1 << 30);
    begin(&a, P, 1, 7);
    let tmp = a.malloc(3 * MIB, 1).unwrap();
    let out = a.malloc(1000, 1).unwrap(); // the graph's output, kept by the user
    assert!(a.free(tmp.ptr));
    end(&a, P, 1);
    let reserved = |a: &CachingAllocator<FakeDriver>| a.stats().reserved_bytes.all.current as usize;
    assert_eq!(reserved(&a), 22 * MIB);
    assert!(a.empty_cache());
    assert_eq!(reserved(&a), 22 * MIB, "a live graph's pool keeps its memory");
    assert!(a.release_pool(P));
    assert_eq!(a.private_pool_use_count(P), Some(0));
    assert!(!a.release_pool(P), "no user left to release");
    assert!(a.empty_cache());
    assert_eq!(
        reserved(&a),
        2 * MIB,
        "the free segment went back; the output's stays"
    );
    assert!(a.free(out.ptr)); // back to the released pool, which serves nobody
    let eager = a.malloc(1000, 1).unwrap();
    assert_ne!(eager.ptr, out.ptr);
    assert!(a.free(eager.ptr));
    assert!(a.empty_cache());
    assert_eq!(reserved(&a), 0);
    assert_eq!(
        a.private_pool_use_count(P),
        None,
        "no users and no segments: forgotten"
    );
    let s = a.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free), (3, 3));
    assert_eq!((s.allocated_bytes.all.current, s.segment.all.current), (0, 0));
    assert!(a.with_driver(|d| d.live.is_empty()));
}

#[test]
fn graphs_share_a_pool_until_the_last_releases_it() {
    let a = allocator(1 << 30);
    let h = MempoolId(0, 1);
    begin(&a, h, 1, 7);
    let t1 = a.malloc(4096, 1).unwrap();
    let y1 = a.malloc(4096, 1).unwrap();
    assert!(a.free(t1.ptr));
    end(&a, h, 1);
    begin(&a, h, 1, 8);
    assert!(!a.begin_allocate_to_pool(h), "one capture at a time per pool");
    let y2 = a.malloc(4096, 1).unwrap();
    assert_eq!(
        y2.ptr, t1.ptr,
        "the second graph reuses the first one's freed block"
    );
    end(&a, h, 1);
    assert_eq!(
        (a.private_pool_use_count(h), a.stats().num_device_alloc),
        (Some(2), 1)
    );
    // Two pools capturing at once (two threads) stay apart.
    begin(&a, MempoolId(2, 0), 5, 9);
    begin(&a, MempoolId(3, 0), 6, 10);
    let p2 = a.malloc(512, 5).unwrap();
    let p3 = a.malloc(512, 6).unwrap();
    end(&a, MempoolId(2, 0), 5);
    end(&a, MempoolId(3, 0), 6);
    assert_eq!(
        segment_pools(&a),
        vec![
            (BASE, Some(h)),
            (p2.ptr, Some(MempoolId(2, 0))),
            (p3.ptr, Some(MempoolId(3, 0)))
        ]
    );
    assert!(a.release_pool(h));
    for p in [y1.ptr, y2.ptr] {
        assert!(a.free(p));
    }
    assert!(a.empty_cache());
    assert_eq!(a.private_pool_use_count(h), Some(1), "one graph still uses it");
    assert_eq!(segment_pools(&a).len(), 3);
    assert!(a.release_pool(h));
    // Reviving: a capture into a pool nobody uses takes its cached blocks back.
    begin(&a, h, 1, 11);
    assert_eq!(a.malloc(4096, 1).unwrap().ptr, t1.ptr);
    end(&a, h, 1);
    assert_eq!(a.private_pool_use_count(h), Some(1));
}

mod snapshot;

/// Many threads allocating and freeing on their own streams at once, some blocks used on
/// another thread's stream too (`record_stream`): no two live blocks overlap, a block is
/// always the caller's stream's, and once all is freed the books balance (Note [Concurrency
/// checks] in `memory.rs`: this also runs under Miri).
#[test]
fn threads_allocating_at_once_never_share_a_block_and_balance_the_books() {
    let (threads, steps) = if cfg!(miri) { (4, 40) } else { (8, 4000) };
    let a = allocator(1 << 40);
    // Live blocks of every thread: start address -> (end, thread).
    let live: Mutex<BTreeMap<u64, (u64, usize)>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (a, live) = (&a, &live);
            s.spawn(move || {
                let stream = t as StreamId + 1;
                let mut mine: Vec<Allocation> = Vec::new();
                let mut x = t as u64 * 0x9e37_79b9 + 1;
                for _ in 0..steps {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if mine.len() < 6 && x % 3 != 0 || mine.is_empty() {
                        // Small and large pools, split and whole segments.
                        let bytes = [700, 64 * KIB, MIB, 3 * MIB + 5, 12 * MIB][(x >> 8) as usize % 5];
                        let b = a.malloc(bytes, stream).unwrap();
                        assert_eq!(b.stream, stream, "a block of another stream was handed out");
                        let end = b.ptr + b.size as u64;
                        let mut l = live.lock().unwrap();
                        let before = l.range(..end).next_back().map(|(&p, &(e, o))| (p, e, o));
                        if let Some((p, e, owner)) = before {
                            assert!(
                                e <= b.ptr,
                                "[{:#x}, {end:#x}) of thread {t} overlaps [{p:#x}, {e:#x}) of thread {owner}",
                                b.ptr
                            );
                        }
                        l.insert(b.ptr, (end, t));
                        drop(l);
                        if x % 5 == 0 {
                            // Used on the next thread's stream as well.
                            a.record_stream(b.ptr, (t + 1) as StreamId % threads as StreamId + 1);
                        }
                        mine.push(b);
                    } else {
                        let b = mine.swap_remove((x >> 16) as usize % mine.len());
                        assert_eq!(
                            live.lock().unwrap().remove(&b.ptr),
                            Some((b.ptr + b.size as u64, t))
                        );
                        assert!(a.free(b.ptr));
                    }
                }
                for b in mine {
                    live.lock().unwrap().remove(&b.ptr);
                    assert!(a.free(b.ptr));
                }
            });
        }
        // Meanwhile another thread reads the statistics and completes events.
        s.spawn(|| {
            for _ in 0..steps / 4 {
                let st = a.stats();
                assert!(st.allocated_bytes.all.current <= st.reserved_bytes.all.current);
                a.with_driver(|d| d.complete_all());
            }
        });
    });
    let st = a.stats();
    assert_eq!(st.allocation.all.current, 0);
    assert_eq!(st.allocated_bytes.all.current, 0);
    assert!(
        st.allocation.all.allocated >= (threads * steps / 2) as i64,
        "{st:?}"
    );
    assert!(a.empty_cache());
    let st = a.stats();
    assert_eq!(
        (
            st.active.all.current,
            st.reserved_bytes.all.current,
            st.segment.all.current
        ),
        (0, 0, 0)
    );
    a.with_driver(|d| {
        assert_eq!(d.used, 0, "every segment went back to the driver");
        assert!(d.events.is_empty(), "every event was destroyed");
    });
}
