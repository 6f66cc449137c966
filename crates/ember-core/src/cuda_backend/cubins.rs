//! The process-wide table of compiled kernel units (one cubin per unit and architecture, shared
//! by every device of that architecture) and the background threads that compile the units a
//! program is likely to need next while it runs (Note [Loading kernel units] in `runtime.rs`).
//!
//! Note [Compiles at exit]: a process that exited while detached threads were inside NVRTC
//! aborted with glibc's `free(): invalid pointer` (seen on an H100 host): exit ran NVRTC's static
//! destructors under the running compiles. So the background threads take their jobs from a
//! queue guarded by one mutex, and a C `atexit` handler, registered once the first compile has
//! finished (NVRTC and its builtins library are loaded and have registered their destructors by
//! then, and handlers run in the reverse order of registration, so ours runs first), closes the
//! queue and waits for the compiles in flight. The cost is at most one unit's compile time at
//! the exit of a first run. Once the queue is closed the threads never return: a thread that
//! returned would exit while `exit` goes on into the libraries' static destructors, and a
//! thread that has compiled runs NVRTC's thread-local destructors as it exits, inside NVRTC
//! as surely as a compile is (a child test process that had passed died with SIGSEGV at exit
//! once; this race is the one candidate found in ember's exit path). So they wait on the
//! closed queue until the process ends, and run nothing more.

use super::kernel_units::{likely_units, Unit};
use super::nvrtc;
use crate::{DType, Error, Result};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

/// One unit's cubin for one architecture, and whether some thread has begun to produce it (so
/// that a background thread never sits waiting on a unit the program is compiling itself).
#[derive(Default)]
struct UnitSlot {
    started: AtomicBool,
    cubin: OnceLock<std::result::Result<Arc<Vec<u8>>, Error>>,
}

type Slot = Arc<UnitSlot>;

/// The longest the exit handler waits for compiles in flight.
const EXIT_WAIT: Duration = Duration::from_secs(120);

fn table() -> &'static Mutex<HashMap<(Unit, String), Slot>> {
    static TABLE: OnceLock<Mutex<HashMap<(Unit, String), Slot>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

fn slot(unit: &Unit, arch: &str) -> Slot {
    let mut table = table().lock().unwrap_or_else(|e| e.into_inner());
    table.entry((unit.clone(), arch.to_string())).or_default().clone()
}

/// The cubin of `unit` for `arch`: from memory, the disk cache, a background compile already
/// under way, or compiled now on the calling thread. A miss on the disk cache also starts the
/// background compiles of the units likely to follow (`dtype`, the kernel's first float dtype).
pub(crate) fn cubin(unit: &Unit, arch: &str, dtype: Option<DType>) -> Result<Arc<Vec<u8>>> {
    let slot = slot(unit, arch);
    slot.started.store(true, Ordering::Relaxed);
    slot.cubin
        .get_or_init(|| {
            build(unit, arch, || {
                if let Some(dtype) = dtype {
                    prefetch(dtype, arch);
                }
            })
        })
        .clone()
}

fn build(unit: &Unit, arch: &str, on_miss: impl FnOnce()) -> std::result::Result<Arc<Vec<u8>>, Error> {
    let mut compiled = false;
    let outcome = nvrtc::compile_unit_cached(unit, arch, || {
        compiled = true;
        on_miss();
    });
    if compiled {
        static REGISTER: Once = Once::new();
        REGISTER.call_once(|| {
            extern "C" {
                fn atexit(handler: extern "C" fn()) -> std::ffi::c_int;
            }
            // SAFETY: `wait_at_exit` is a plain function that neither unwinds nor calls `exit`.
            unsafe { atexit(wait_at_exit) };
        });
    }
    outcome.map(Arc::new)
}

/// The background compiles: a queue of (unit, arch) and how many are being compiled.
struct Queue {
    jobs: VecDeque<(Unit, String)>,
    in_flight: usize,
    closed: bool,
    workers: usize,
    /// The (dtype, arch) pairs whose likely units were queued already.
    queued: HashSet<(DType, String)>,
}

struct Pool {
    queue: Mutex<Queue>,
    changed: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        queue: Mutex::new(Queue {
            jobs: VecDeque::new(),
            in_flight: 0,
            closed: false,
            workers: 0,
            queued: HashSet::new(),
        }),
        changed: Condvar::new(),
    })
}

/// How many background compile threads to run: one fewer than the cores (the program's own
/// compile has the last), at least one; none when `EMBER_KERNEL_PREFETCH=0`.
fn worker_count() -> usize {
    if std::env::var_os("EMBER_KERNEL_PREFETCH").is_some_and(|v| v == "0") {
        return 0;
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cores - 1).clamp(1, 31)
}

/// Queues the units likely needed in `dtype` (once per dtype and architecture) for the
/// background threads, starting them on first use.
fn prefetch(dtype: DType, arch: &str) {
    let pool = pool();
    let mut q = pool.queue.lock().unwrap_or_else(|e| e.into_inner());
    if q.closed || !q.queued.insert((dtype, arch.to_string())) {
        return;
    }
    let wanted = worker_count();
    if wanted == 0 {
        return;
    }
    q.jobs
        .extend(likely_units(dtype).into_iter().map(|u| (u, arch.to_string())));
    while q.workers < wanted {
        let spawned = std::thread::Builder::new()
            .name(format!("ember-nvrtc-{}", q.workers))
            .spawn(work);
        if spawned.is_err() {
            break; // the units compile on first use instead
        }
        q.workers += 1;
    }
    pool.changed.notify_all();
}

/// A background thread: compiles queued units until the queue closes at exit, then waits for
/// the process to end (Note [Compiles at exit]: it must not exit during `exit`).
fn work() {
    let pool = pool();
    let mut q = pool.queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let job = if q.closed { None } else { q.jobs.pop_front() };
        let Some((unit, arch)) = job else {
            q = pool.changed.wait(q).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let slot = slot(&unit, &arch);
        if slot.started.swap(true, Ordering::Relaxed) {
            continue; // compiled, or being compiled, on first use
        }
        q.in_flight += 1;
        drop(q);
        // Not prefetching more from here: only the program's own misses queue units.
        slot.cubin.get_or_init(|| build(&unit, &arch, || {}));
        q = pool.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.in_flight -= 1;
        pool.changed.notify_all();
    }
}

/// The `atexit` handler of Note [Compiles at exit].
extern "C" fn wait_at_exit() {
    let pool = pool();
    let Ok(mut q) = pool.queue.lock() else {
        return;
    };
    q.closed = true;
    q.jobs.clear();
    pool.changed.notify_all();
    let deadline = Instant::now() + EXIT_WAIT;
    while q.in_flight > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match pool.changed.wait_timeout(q, left) {
            Ok((guard, _)) => q = guard,
            Err(_) => return,
        }
    }
}
