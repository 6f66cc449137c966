//! The allocator's statistics (PyTorch's `memory_stats` meanings), snapshot and trace types,
//! and the renderings of the statistics: the `memory_stats()` map and the `memory_summary()`
//! table (the snapshot's renderings are in `snapshot.rs`).

use super::{Driver, Pool, State, StreamId, Use};
use std::collections::BTreeMap;

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
    pub(super) fn update(&mut self, delta: i64) {
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
    pub(super) fn update(&mut self, pool: Pool, delta: i64) {
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
    pub(super) fn named(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("large_pool", &self.large_pool),
            ("small_pool", &self.small_pool),
        ]
    }

    /// The three statistics, mutably.
    pub(super) fn each_mut(&mut self) -> [&mut Stat; 3] {
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
    /// Mallocs that failed with [`crate::Error::OutOfMemory`].
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
    pub(super) fn named(&self) -> [(&'static str, &StatArray); 9] {
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
    pub(super) fn each_mut(&mut self) -> [&mut StatArray; 9] {
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
    /// The private pool (of a CUDA graph) that owns it, None for the default pools.
    pub private_pool: Option<super::MempoolId>,
    /// Blocks covering the segment.
    pub blocks: Vec<BlockInfo>,
}

impl SegmentInfo {
    /// Bytes of blocks in the given states.
    pub(super) fn bytes_where(&self, keep: impl Fn(BlockState) -> bool) -> usize {
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
    /// A request failed with out of memory after the retries; the entry's `addr` holds the
    /// device's free bytes then and `size` the request (PyTorch's `OOM` entry, whose snapshot
    /// key for that field is `device_free`).
    Oom,
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
            TraceAction::Oom => "oom",
        }
    }
}

/// One recorded allocator event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address (for [`TraceAction::Oom`], the device's free bytes).
    pub addr: u64,
    /// Block or segment size in bytes.
    pub size: usize,
    /// Stream of the block or segment.
    pub stream: StreamId,
    /// Microseconds since the UNIX epoch.
    pub time_us: u64,
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
pub(super) fn format_bytes(bytes: i64) -> String {
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

impl<D: Driver> State<D> {
    /// Every segment with its blocks, in address order.
    pub(super) fn snapshot(&self) -> Vec<SegmentInfo> {
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
                private_pool: seg.private,
                blocks,
            });
        }
        out
    }
}
