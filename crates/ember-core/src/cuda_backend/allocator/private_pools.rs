//! Private pools: the memory of CUDA graphs, and what the allocator does while a graph is being
//! captured.
//!
//! Note [Interaction with CUDA graph capture]
//! ==========================================
//! A CUDA graph (`cuda::CUDAGraph`) records the device addresses its kernels use, and every
//! replay uses the same addresses. The memory behind them must belong to the graph for as long
//! as it may be replayed, and no allocation outside the graph may be handed those addresses.
//! The rules, as PyTorch's allocator states them (`c10/cuda/CUDACachingAllocator.cpp`):
//!
//! 1. Private pools. A capture allocates from a private pool named by a [`MempoolId`]
//!    (PyTorch's `MempoolId_t`): `(n, 0)` for a pool a graph made for itself, `(0, n)` for one
//!    from `graph_pool_handle()`, which several graphs may share. A private pool has segments
//!    and free sets of its own (per size class, ordered as the default pools' are, stream
//!    first): its blocks never serve an allocation outside it, and blocks of the default pools
//!    never serve a capture.
//! 2. Routing. [`begin_allocate_to_pool`](CachingAllocator::begin_allocate_to_pool), called
//!    before cuStreamBeginCapture, creates the pool or raises its use count, and marks a capture
//!    underway; [`set_capture_id`](CachingAllocator::set_capture_id), called once the driver has
//!    given the capture its id, lets allocations find it. While a capture is underway, malloc
//!    asks the driver which capture its stream takes part in (cuStreamGetCaptureInfo): an
//!    allocation on the capturing stream, or on a stream forked into the capture (one that
//!    waited on an event recorded in it), comes from that capture's pool; other streams keep
//!    the default pools. [`end_allocate_to_pool`](CachingAllocator::end_allocate_to_pool), after
//!    cuStreamEndCapture, ends the routing. One capture at a time per pool.
//! 3. Frees during capture. A freed block returns to its own pool at once (a private block to
//!    its private pool) and, as always, is reused only on its own stream. So a block freed
//!    during the capture serves later allocations of the same capture on the same stream, which
//!    the graph's stream order makes safe on every replay, and later captures into the same pool
//!    (graphs sharing a pool must be replayed in the order they were captured, as in PyTorch).
//!    A block used on other streams (`record_stream`) needs events before it can be reused: an
//!    event recorded now could land in the capture, and none may be queried during capture, so
//!    the block stays pending and its events are recorded once no capture is underway.
//! 4. Nothing that breaks a capture. While a capture is underway the allocator neither queries
//!    nor waits for events (cross-stream frees complete after the capture) nor returns memory to
//!    the driver (cuMemFree synchronizes the device): out of memory fails at once, without the
//!    retries, and `empty_cache` does nothing and returns false. A new segment still comes from
//!    cuMemAlloc: not a stream operation, so not captured, it gives the graph fresh addresses
//!    that stay valid while the pool lives. The real driver calls it in relaxed capture mode
//!    (cuThreadExchangeStreamCaptureMode), as PyTorch's `cudaMallocMaybeCapturing` does, since
//!    the default (global) mode refuses it during a capture.
//! 5. Release. [`release_pool`](CachingAllocator::release_pool) (a graph's `reset` or drop)
//!    lowers the use count. At zero, the pool's fully free segments go back to the driver at
//!    the next `empty_cache` or out-of-memory full release, lazily as the rest of the cache;
//!    until then they serve nobody. A block still held by a tensor made during the capture (a
//!    graph's output) keeps its segment until it is freed. A pool with neither users nor
//!    segments is forgotten; beginning a capture into a pool no graph uses any more revives it
//!    with its cached blocks.
//! 6. Statistics count private pools as the default ones (by size class): `allocated_bytes`
//!    includes blocks handed out from them, `reserved_bytes` their segments, so a graph's
//!    memory shows in `memory_allocated`/`memory_reserved` until released. A replay allocates
//!    nothing, so the statistics stay flat over replays.
//!
//! "Underway" is per device: a capture registers with the allocator of its device only, as in
//! PyTorch.

use super::{CachingAllocator, Driver, FreeSet, State, StreamId};

/// A private memory pool's id (PyTorch's `MempoolId_t`): `(n, 0)` for the pool a graph's capture
/// made for itself, `(0, n)` for one from `cuda::graph_pool_handle()`; `(0, 0)` names no pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MempoolId(pub u64, pub u64);

/// The id the driver gives a stream-capture sequence, unique in the process.
pub type CaptureId = u64;

/// A private pool's bookkeeping (PyTorch's `PrivatePool`).
#[derive(Debug, Default)]
pub(super) struct PrivatePool {
    /// Graphs (and captures underway) using the pool.
    pub use_count: usize,
    /// Driver segments the pool holds.
    pub segments: usize,
    /// Free blocks per size class (`Pool::index`).
    pub free_blocks: [FreeSet; 2],
}

impl<D: Driver> State<D> {
    /// The private pool serving allocations on `stream`: the pool of the capture the stream
    /// takes part in, if that capture allocates to one.
    pub(super) fn capture_pool(&mut self, stream: StreamId) -> Option<MempoolId> {
        let id = self.driver.capture_id(stream)?;
        self.captures
            .iter()
            .find(|(_, capture)| *capture == Some(id))
            .map(|(pool, _)| *pool)
    }

    /// Records the events of blocks whose free was deferred by a capture (rule 3); only once no
    /// capture is underway.
    pub(super) fn insert_deferred_events(&mut self) {
        debug_assert!(self.captures.is_empty());
        for addr in std::mem::take(&mut self.deferred) {
            let uses = std::mem::take(&mut self.block_mut(addr).stream_uses);
            self.wait_for_uses(addr, uses);
        }
    }

    /// Bookkeeping after a segment of private pool `id` went back to the driver.
    pub(super) fn private_segment_released(&mut self, id: MempoolId) {
        let pool = self
            .private
            .get_mut(&id)
            .expect("allocator invariant: a private pool exists while it has segments");
        pool.segments -= 1;
        if pool.segments == 0 && pool.use_count == 0 {
            self.private.remove(&id);
        }
    }
}

impl<D: Driver> CachingAllocator<D> {
    /// Marks a capture underway that allocates to private pool `pool`, creating the pool or
    /// raising its use count (rule 2); call before cuStreamBeginCapture, then
    /// [`set_capture_id`](Self::set_capture_id). False (and nothing changes) when a capture is
    /// already allocating to `pool`.
    pub fn begin_allocate_to_pool(&self, pool: MempoolId) -> bool {
        let mut state = self.lock();
        if state.captures.iter().any(|(p, _)| *p == pool) {
            return false;
        }
        state.private.entry(pool).or_default().use_count += 1;
        state.captures.push((pool, None));
        true
    }

    /// Routes allocations of streams taking part in capture `capture` to `pool`, whose capture
    /// began with [`begin_allocate_to_pool`](Self::begin_allocate_to_pool).
    pub fn set_capture_id(&self, pool: MempoolId, capture: CaptureId) {
        let mut state = self.lock();
        if let Some(entry) = state.captures.iter_mut().find(|(p, _)| *p == pool) {
            entry.1 = Some(capture);
        }
    }

    /// Ends the routing to `pool` (after cuStreamEndCapture, or when beginning the capture
    /// failed); the pool keeps its use count until [`release_pool`](Self::release_pool). False
    /// when no capture was allocating to `pool`.
    pub fn end_allocate_to_pool(&self, pool: MempoolId) -> bool {
        let mut state = self.lock();
        let before = state.captures.len();
        state.captures.retain(|(p, _)| *p != pool);
        state.captures.len() < before
    }

    /// Lowers the use count of `pool` (a graph using it was reset or dropped); at zero its
    /// cached segments become releasable (rule 5). False for an unknown pool or one nobody uses.
    pub fn release_pool(&self, pool: MempoolId) -> bool {
        let mut state = self.lock();
        let Some(p) = state.private.get_mut(&pool).filter(|p| p.use_count > 0) else {
            return false;
        };
        p.use_count -= 1;
        if p.use_count == 0 && p.segments == 0 {
            state.private.remove(&pool);
        }
        true
    }

    /// How many graphs (and captures underway) use private pool `pool`; None once the pool is
    /// forgotten (no users, no segments).
    #[cfg(test)]
    pub fn private_pool_use_count(&self, pool: MempoolId) -> Option<usize> {
        self.lock().private.get(&pool).map(|p| p.use_count)
    }
}
