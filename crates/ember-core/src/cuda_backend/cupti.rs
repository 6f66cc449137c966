//! CUPTI's activity API, loaded at run time: the profiler's kernel-level GPU timing (Note
//! [Profiler timing and attribution] in `profiler/mod.rs`). The records and their layouts
//! are `cupti_records.rs`; this file finds and loads `libcupti`, hands CUPTI its buffers,
//! turns the buffers it returns into [`Collected`] activities, and starts and stops a
//! profiling session.
//!
//! Finding the library, first that loads and reports a CUPTI 13 API version (130000 to
//! 139999, the record layouts `cupti_records.rs` reads): `$EMBER_CUPTI_LIBRARY` (a file),
//! `libcupti.so.13` and `libcupti.so` through the dynamic loader (`LD_LIBRARY_PATH`, the
//! loader cache), then the CUDA toolkit (`$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda*`:
//! `extras/CUPTI/lib64`, `lib64`, `targets/*/lib`), then the lib folders of NVIDIA's Python
//! wheels (`nvidia/cu13/lib`, `nvidia/cuda_cupti/lib`) in the site-packages of
//! `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr` and `/opt/conda`,
//! where PyTorch's wheels put it. The library, once loaded, stays loaded.
//!
//! Rules: CUPTI is process-wide and one profiler runs at a time (`profiler::RUNNING`), so at
//! most one session is underway. Buffers are 8 MiB, 8-byte aligned, given to CUPTI on request
//! and freed after their records are read in the completion callback (which CUPTI calls
//! from its own thread or from `cuptiActivityFlushAll`). External correlation ids are a
//! per-thread stack inside CUPTI: every push is popped on the thread that pushed it, in
//! reverse order (the recorder pushes the innermost open op's id before its first device
//! work and pops when the op closes).
//!
//! Note [CUPTI beside other threads' CUDA work]: CUPTI is turned on and off while other
//! threads launch and copy, so three rules:
//! - No copy or fill is enqueued or in flight while the kinds change. Once CUPTI has started,
//!   every copy, every fill (`cuMemsetD*Async`), every cuBLASLt and cuDNN call (which copy,
//!   fill and load kernels of their own) and every graph replay is made under [`GATE`] held
//!   shared ([`work_guard`]); [`start`] and [`stop`] hold it exclusively, and inside wait for
//!   every device ember has a runtime on (but one capturing a CUDA graph, where a wait would
//!   end the capture) before they enable or disable the kinds. Only ember's own kernel
//!   launches stay outside (see below).
//! - A stop disables the kinds only once no thread has a correlation id pushed (every op
//!   that pushed one while the session recorded has closed; the recorder pops its own
//!   thread's before it stops), waiting at most five seconds: an op that blocks longer (a
//!   read of a busy GPU's result) is not waited for past that.
//! - Starting and stopping never overlap the load of a kernel unit: loads hold [`GATE`]
//!   shared too.
//!
//! Why: turning the kinds on and off while other threads load kernel units, launch and copy
//! made libcupti crash or hang. Measured on two H100s (driver 580, CUPTI 13.0) with the test
//! `cuda_cupti_sessions_cycle_while_other_threads_load_kernels`, one process per run, builds
//! alternating in each run ("died": a SIGSEGV, always in the same libcupti code, mostly on a
//! thread CUPTI started, or a hang past 30 s):
//! - No rule: 15 of 89 died. The wait alone: 7 of 89. The wait and the gate: 1 of 47, and 6
//!   of 100 in a later run.
//! - No wait and no gate, one group of kinds kept enabled after the first start, 29 runs
//!   each: none kept, 6 died; the API kinds, 10; the kernel kind, 9; the external correlation
//!   kind, 7; the copy and fill kinds, 1 (a hang, the build's first run; no crash). A second
//!   run, 24 each: none kept, 5; the copy kinds, 1 (a crash, its first run); the fill kind, 5.
//!   All kinds kept: 0 of 47.
//! - The wait and the gate, and the copy and fill kinds kept enabled after the first start
//!   instead of the first rule: 0 crashes in 57 runs (and a hang on the first run on a fresh
//!   machine, which compiles every kernel the test loads); without the copy kinds kept, 1 of
//!   57.
//! - A later run, 64 runs each after one uncounted warm-up run: this rule (no kind kept), 0
//!   died; the copy and fill kinds kept, 0; only the copy kinds kept (the fill kind toggled), 3.
//!
//! Several fault addresses looked like glibc's mangled free-list pointers (a heap address
//! shifted right by 12): CUPTI reading memory it had freed, it seems its state of a copy in
//! flight when the copy kinds were disabled. The core suite had died once in libcupti too,
//! inside `cuLaunchKernel` on a test thread just after a profiler test stopped.
//!
//! Why not keep the copy kinds enabled: then CUPTI keeps recording after the session, at a
//! cost to every copy and fill, and to the steps around them (host time on an H100, min of
//! five rounds, two runs, before a profile and after one): a 1 KiB round trip 12.8-13.3 us
//! against 17.1-18.2; a 1 KiB zero fill 1.44-1.64 against 3.14-3.15; a small MLP's step that
//! reads its loss 413-472 against 476-553. The first rule costs one atomic load per copy
//! before CUPTI ever started and an uncontended shared lock after, and each start and stop a
//! wait for the devices (the profiler waits for the devices it used at a stop anyway).
//!
//! What a profile still leaves behind with no kind enabled (same probe, same H100, two rounds,
//! before and after one profile): a round trip 13.5-16.4 against 14.6-18.3 us, a zero fill
//! 1.57-2.28 against 1.83-2.41, one small launch 4.2-5.5 against 5.1-6.1, the MLP step
//! 440-566 against 519-702. That is CUPTI itself staying attached to the driver; the kept
//! copy and fill kinds cost more on top (round trip 14.1-16.7 against 19.0-20.6). Only
//! `cuptiFinalize` detaches it. Tried (branch `cupti-detach`): each stop finalized CUPTI from
//! a driver API call's exit callback, as CUPTI's sample and Kineto (PR 686) do, and the next
//! start attached it again. On two H200s the cost went away (the MLP step 542 against 554 us,
//! 524 against 515; one launch 5.5 against 5.5), and the kernel-loading stress test passed 63
//! of 63 runs; but the core GPU suite (four test threads) died in libcupti inside another
//! thread's `cuCtxSetCurrent`, just after a CUPTI test's stop had detached. Finalizing safely
//! would need every driver call of every thread held off, not only copies and loads.
//!
//! Fills and library calls were outside the gate until session 54, when the core suite run
//! whole on an H200 (CUDA 13, driver 580) died with SIGSEGV, no panic, after 12-56 s in two
//! runs of two (and once after 292 of 419 tests in session 52), while its 20 profiler tests
//! alone passed and so did the other 407 without them. Beside the CUPTI tests' cycles the
//! other tests zero tensors (`cuMemsetD32Async`), multiply and convolve on every thread; the
//! stress test's workers run ember's unary kernels and copies only, so the measurements above
//! never had fills or library calls beside the cycles (the 3 of 64 with the fill kind toggled
//! say fills matter as copies do). Gated, the suite run whole ran to its end in three runs of
//! three (419 tests; in the first, one test counted another thread's kernel, a test fault
//! fixed since; session 55, docs/benchmarks.md).
//!
//! Left: NCCL's calls and ember's own kernel launches are not gated (with copies and loads
//! gated, the stress test's launches beside the cycles killed none of 64 runs, and a launch
//! is the hot path), nor the one-time fill of a device's error record when its runtime is
//! made; a device capturing a graph is not waited for.
//!
//! Note [GATE shares nest]: shares are counted per thread and only the outermost takes the
//! lock ([`gate_share`]). A library call holds a share and may copy, fill or load a kernel
//! unit inside; std's `RwLock` blocks a second `read` while a writer waits, so a thread
//! taking the lock twice would deadlock against a [`start`] or [`stop`]. For the same reason
//! a share is taken before any lock that a share holder may wait for (the device error
//! record's, in `device_errors.rs`), never while holding one.
//!
//! Note [CUPTI under compute-sanitizer]: compute-sanitizer injects itself into the process it
//! checks, and CUPTI's activity API beside it killed every test process that profiled CUDA
//! work with SIGSEGV, under each of the four tools (session 49 run 11 and session 50's sweep:
//! 8 tests, the rest of their process's tests lost with them). So where the tool's injection
//! variables are set (`NV_SANITIZER_INJECTION_PORT_BASE`, which compute-sanitizer 2025.3 sets
//! in its target), CUPTI is not loaded: the profiler records CUDA events instead and says why,
//! as where CUPTI is missing. Tests that count kernels from CUPTI's records then fail with a
//! message instead of taking their process down.

use super::cupti_records::{self as records, RawActivity, RawApi, Record};
use std::alloc::Layout;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

type CuptiResult = u32;
const CUPTI_SUCCESS: CuptiResult = 0;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: also deliver buffers with incomplete records.
const FLUSH_FORCED: u32 = 1;
/// `CUpti_CallbackDomain`: the driver and runtime API domains.
const CB_DOMAIN_DRIVER_API: u32 = 1;
const CB_DOMAIN_RUNTIME_API: u32 = 2;
/// Bytes of one activity buffer.
const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_LAYOUT: Layout = match Layout::from_size_align(BUFFER_BYTES, 8) {
    Ok(l) => l,
    Err(_) => panic!("8 MiB aligned to 8 is a valid layout"),
};
/// The activity kinds a session enables: device work, and the driver and runtime API records
/// that the external correlation records come with.
const KINDS: [u32; 7] = [
    records::KIND_CONCURRENT_KERNEL,
    records::KIND_MEMCPY,
    records::KIND_MEMCPY2,
    records::KIND_MEMSET,
    records::KIND_DRIVER,
    records::KIND_RUNTIME,
    records::KIND_EXTERNAL_CORRELATION,
];

/// True once a session started: copies, fills and library calls then hold [`GATE`] shared
/// while they are enqueued (Note [CUPTI beside other threads' CUDA work]).
static WORK_GATED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Shares of [`GATE`] this thread holds (Note [GATE shares nest]).
    static SHARES: Cell<u32> = const { Cell::new(0) };
}

/// A share of [`GATE`] held by this thread; the lock is released with the outermost.
pub(crate) struct GateShare {
    _lock: Option<RwLockReadGuard<'static, ()>>,
}

impl Drop for GateShare {
    fn drop(&mut self) {
        // The count drops first, then `_lock` (fields drop after this body).
        SHARES.with(|n| n.set(n.get() - 1));
    }
}

/// Holds [`GATE`] shared until dropped: no CUPTI start or stop meanwhile. Nests (Note [GATE
/// shares nest]).
pub(crate) fn gate_share() -> GateShare {
    let outermost = SHARES.with(|n| {
        let held = n.get();
        n.set(held + 1);
        held == 0
    });
    GateShare {
        _lock: outermost.then(|| GATE.read().unwrap_or_else(|e| e.into_inner())),
    }
}

/// Held by a copy, a fill, a cuBLASLt or cuDNN call or a graph replay while it is made, once
/// CUPTI has started (Note [CUPTI beside other threads' CUDA work]); None before, at the cost
/// of one atomic load.
pub(crate) fn work_guard() -> Option<GateShare> {
    WORK_GATED.load(Ordering::Acquire).then(gate_share)
}

/// Waits for all work on every device ember has a runtime on, but those capturing a CUDA
/// graph; under [`GATE`] held exclusively, no copy or fill is in flight after.
fn quiesce_copies() {
    for rt in super::runtime::initialized() {
        if !super::capture::any_on_device(rt.ordinal) && rt.bind().is_ok() {
            // An error here (a device fault) is reported by the next op on that device.
            let _ = cudarc::driver::result::ctx::synchronize();
        }
    }
}

type BufferRequested = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type BufferCompleted = unsafe extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);

/// The entry points of `libcupti` ember calls (`cupti_activity.h`, `cupti_result.h`).
struct Api {
    get_version: unsafe extern "C" fn(*mut u32) -> CuptiResult,
    get_timestamp: unsafe extern "C" fn(*mut u64) -> CuptiResult,
    enable: unsafe extern "C" fn(u32) -> CuptiResult,
    disable: unsafe extern "C" fn(u32) -> CuptiResult,
    register_callbacks: unsafe extern "C" fn(BufferRequested, BufferCompleted) -> CuptiResult,
    flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    get_next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut c_void) -> CuptiResult,
    push_external: unsafe extern "C" fn(u32, u64) -> CuptiResult,
    pop_external: unsafe extern "C" fn(u32, *mut u64) -> CuptiResult,
    result_string: unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult,
    callback_name: unsafe extern "C" fn(u32, u32, *mut *const c_char) -> CuptiResult,
}

/// A loaded CUPTI 13 with its callbacks registered.
struct Cupti {
    api: Api,
    version: u32,
    path: String,
    _lib: libloading::Library,
}

static CUPTI: OnceLock<Result<Cupti, String>> = OnceLock::new();

/// True between [`start`] and [`stop`]: while the recorder pushes correlation ids.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Held shared while a kernel unit loads, a copy or fill is enqueued or a library called
/// ([`gate_share`], [`work_guard`]), exclusively while CUPTI starts or stops (Note [CUPTI
/// beside other threads' CUDA work]).
static GATE: RwLock<()> = RwLock::new(());

/// Correlation ids pushed and not yet popped, on all threads. A stop comes after the stopping
/// thread popped its own (the recorder releases them first), so it waits for this to be 0.
static PUSHED: AtomicUsize = AtomicUsize::new(0);

/// How long [`stop`] waits for other threads' pushed ids to be popped.
const PUSH_WAIT: Duration = Duration::from_secs(5);

/// What the completion callback gathered since [`start`].
static COLLECTED: Mutex<Option<Collected>> = Mutex::new(None);

/// Where to look for `libcupti`, in order (the module's doc).
fn candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("EMBER_CUPTI_LIBRARY") {
        out.push(PathBuf::from(p));
    }
    out.extend(["libcupti.so.13", "libcupti.so"].map(PathBuf::from));
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    roots.extend(
        [
            "/usr/local/cuda",
            "/usr/local/cuda-13",
            "/usr/local/cuda-13.0",
            "/opt/cuda",
        ]
        .map(PathBuf::from),
    );
    for root in roots {
        for sub in [
            "extras/CUPTI/lib64",
            "lib64",
            "targets/x86_64-linux/lib",
            "targets/sbsa-linux/lib",
        ] {
            dirs.push(root.join(sub));
        }
    }
    let env = |k: &str| std::env::var(k).ok();
    for packages in super::libraries::python_package_dirs(&env) {
        for lib in ["nvidia/cu13/lib", "nvidia/cuda_cupti/lib"] {
            dirs.push(packages.join(lib));
        }
    }
    for dir in dirs {
        for name in ["libcupti.so.13", "libcupti.so"] {
            let p = dir.join(name);
            if p.is_file() {
                out.push(p);
            }
        }
    }
    out
}

/// Copies symbol `name` of `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the function pointer type of the C declaration of `name`.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller gives the symbol's true type; the pointer is used only while `lib`
    // stays loaded (it is kept with the pointers, in a static, forever).
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name}: {e}"))
}

fn load_from(path: &Path) -> Result<Cupti, String> {
    // SAFETY: loading libcupti runs its initializers, which have no preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    // SAFETY: each type below is the declaration of its function in CUDA 13's
    // `cupti_activity.h` / `cupti_version.h` / `cupti_result.h` (`CUPTIAPI` is the C calling
    // convention on Linux; enums are `int`-sized, passed here as u32).
    let api = unsafe {
        Api {
            get_version: symbol(&lib, "cuptiGetVersion")?,
            get_timestamp: symbol(&lib, "cuptiGetTimestamp")?,
            enable: symbol(&lib, "cuptiActivityEnable")?,
            disable: symbol(&lib, "cuptiActivityDisable")?,
            register_callbacks: symbol(&lib, "cuptiActivityRegisterCallbacks")?,
            flush_all: symbol(&lib, "cuptiActivityFlushAll")?,
            get_next_record: symbol(&lib, "cuptiActivityGetNextRecord")?,
            push_external: symbol(&lib, "cuptiActivityPushExternalCorrelationId")?,
            pop_external: symbol(&lib, "cuptiActivityPopExternalCorrelationId")?,
            result_string: symbol(&lib, "cuptiGetResultString")?,
            callback_name: symbol(&lib, "cuptiGetCallbackName")?,
        }
    };
    let mut version = 0u32;
    // SAFETY: `version` is a valid out-pointer.
    let r = unsafe { (api.get_version)(&mut version) };
    if r != CUPTI_SUCCESS {
        return Err(format!("cuptiGetVersion failed ({r})"));
    }
    if !(130_000..140_000).contains(&version) {
        return Err(format!(
            "CUPTI API version {version}, not CUDA 13's (130000 to 139999), whose record layouts ember reads"
        ));
    }
    Ok(Cupti {
        api,
        version,
        path: path.display().to_string(),
        _lib: lib,
    })
}

/// Finds and loads CUPTI 13 and registers the buffer callbacks, once per process; the reason
/// when it cannot.
fn cupti() -> Result<&'static Cupti, &'static str> {
    CUPTI
        .get_or_init(|| {
            // Note [CUPTI under compute-sanitizer].
            if super::under_compute_sanitizer() {
                return Err("compute-sanitizer is attached to this process and CUPTI beside it \
                            crashes (Note [CUPTI under compute-sanitizer]); profile without the tool \
                            for kernel records"
                    .to_string());
            }
            let mut tried = Vec::new();
            for path in candidates() {
                match load_from(&path) {
                    Ok(c) => {
                        // SAFETY: both callbacks have the types CUPTI declares and stay valid
                        // for the life of the process.
                        let r = unsafe { (c.api.register_callbacks)(buffer_requested, buffer_completed) };
                        if r != CUPTI_SUCCESS {
                            return Err(format!(
                                "{}: cuptiActivityRegisterCallbacks: {}",
                                c.path,
                                c.error_string(r)
                            ));
                        }
                        return Ok(c);
                    }
                    Err(e) => tried.push(format!("{}: {e}", path.display())),
                }
            }
            Err(format!(
                "no CUPTI 13 library could be loaded (set EMBER_CUPTI_LIBRARY to libcupti.so.13, or add its folder to LD_LIBRARY_PATH); tried: {}",
                tried.join("; ")
            ))
        })
        .as_ref()
        .map_err(String::as_str)
}

/// The static string a CUPTI getter writes through its out-pointer; None when it fails or
/// writes null.
fn static_string(get: impl FnOnce(*mut *const c_char) -> CuptiResult) -> Option<String> {
    let mut s: *const c_char = std::ptr::null();
    if get(&mut s) != CUPTI_SUCCESS || s.is_null() {
        return None;
    }
    // SAFETY: on success CUPTI's getters point `s` at a NUL-terminated static string.
    Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

impl Cupti {
    fn error_string(&self, r: CuptiResult) -> String {
        // SAFETY: `s` is a valid out-pointer.
        static_string(|s| unsafe { (self.api.result_string)(r, s) })
            .unwrap_or_else(|| format!("CUPTI error {r}"))
    }

    /// The name of driver (else runtime) call `cbid` (`cuLaunchKernel`, `cudaLaunchKernel`).
    fn callback_name(&self, driver: bool, cbid: u32) -> String {
        let domain = if driver {
            CB_DOMAIN_DRIVER_API
        } else {
            CB_DOMAIN_RUNTIME_API
        };
        // SAFETY: `s` is a valid out-pointer.
        let Some(name) = static_string(|s| unsafe { (self.api.callback_name)(domain, cbid, s) }) else {
            let api = if driver { "CUDA driver" } else { "CUDA runtime" };
            return format!("{api} call {cbid}");
        };
        // Runtime names carry a version suffix (`cudaLaunchKernel_v7000`); Kineto drops it.
        match name.rsplit_once("_v") {
            Some((base, v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => base.to_string(),
            _ => name,
        }
    }

    fn timestamp(&self) -> Option<u64> {
        let mut t = 0u64;
        // SAFETY: `t` is a valid out-pointer.
        (unsafe { (self.api.get_timestamp)(&mut t) } == CUPTI_SUCCESS).then_some(t)
    }
}

/// The loaded CUPTI's API version (`cuptiGetVersion`, e.g. 130001) and the file it came from;
/// the reason as [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) when no CUPTI 13
/// loads (the profiler then times CUDA by events).
pub fn cupti_version() -> crate::Result<(u32, String)> {
    cupti()
        .map(|c| (c.version, c.path.clone()))
        .map_err(|reason| crate::Error::CudaUnavailable {
            reason: reason.to_string(),
        })
}

/// Live registrations per device index (Note [CUPTI and ranks as threads] in
/// `profiler/mod.rs`).
static COLLECTIVES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A device whose kernels wait on the GPU for other ranks (an NCCL communicator's), registered
/// by [`register_collectives`] until dropped.
#[must_use = "the device is registered only while the registration lives"]
#[derive(Debug)]
pub struct CollectivesRegistration {
    device: usize,
}

/// Registers `device` as running collectives whose kernels wait on the GPU for other ranks,
/// for as long as the returned value lives (a communicator holds it). While such devices of
/// this process are several (ranks as threads of one process), the profiler times CUDA by
/// events instead of starting CUPTI (Note [CUPTI and ranks as threads] in `profiler/mod.rs`).
pub fn register_collectives(device: usize) -> CollectivesRegistration {
    let mut counts = COLLECTIVES.lock().unwrap_or_else(|e| e.into_inner());
    if counts.len() <= device {
        counts.resize(device + 1, 0);
    }
    counts[device] += 1;
    CollectivesRegistration { device }
}

impl Drop for CollectivesRegistration {
    fn drop(&mut self) {
        let mut counts = COLLECTIVES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(self.device) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Why a profiler must not start CUPTI now (Note [CUPTI and ranks as threads]); None when it
/// may.
pub(crate) fn refusal() -> Option<String> {
    let counts = COLLECTIVES.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<String> = (0..counts.len())
        .filter(|&d| counts[d] > 0)
        .map(|d| format!("cuda:{d}"))
        .collect();
    (devices.len() > 1).then(|| {
        format!(
            "collectives of several ranks of this process run on {} (ranks as threads): CUPTI is not started there, as starting or stopping it hung while one rank's collective waited on its GPU for another's; run one rank per process (ember-run) for CUPTI's kernel records",
            devices.join(", ")
        )
    })
}

/// A CUPTI timestamp and the host instant taken with it: converts activity times to the
/// trace's host clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClockRef {
    pub cupti_ns: u64,
    pub host: Instant,
}

impl ClockRef {
    /// `cupti_ns` on the host clock, as nanoseconds since `origin` (0 when before it).
    pub(crate) fn host_ns(&self, cupti_ns: u64, origin: Instant) -> u64 {
        let base = self.host.saturating_duration_since(origin).as_nanos() as i128;
        (base + cupti_ns as i128 - self.cupti_ns as i128).max(0) as u64
    }
}

/// One kernel, copy or fill with its name.
#[derive(Debug, Clone)]
pub(crate) struct Activity {
    pub raw: RawActivity,
    pub name: Arc<str>,
}

/// What a session's buffers held.
#[derive(Debug, Default)]
pub(crate) struct Collected {
    pub activities: Vec<Activity>,
    /// CUDA API correlation id → the external id pushed around the call (`CUSTOM0`).
    pub external: HashMap<u32, u64>,
    /// The driver and runtime calls.
    pub api: Vec<RawApi>,
    /// Their names by (driver, callback id), filled when the session stops.
    pub api_names: HashMap<(bool, u32), Arc<str>>,
    /// Kernel names by their pointer (CUPTI shares one string per kernel).
    names: HashMap<usize, Arc<str>>,
}

impl Collected {
    /// Adds one decoded record.
    ///
    /// # Safety
    /// A kernel record's `name_ptr` is null or points to a NUL-terminated string (CUPTI's
    /// contract for the `name` field while the buffer is being read).
    pub(crate) unsafe fn absorb(&mut self, record: Record) {
        match record {
            Record::Activity(raw) => {
                if raw.start == 0 && raw.end == 0 {
                    return; // no timing collected (CUPTI's documented marker)
                }
                if raw.end < raw.start {
                    return; // still running when a forced flush took it (another thread's work)
                }
                let name = match raw.transfer_name() {
                    Some(n) => Arc::from(n),
                    None if raw.name_ptr == 0 => Arc::from("<unnamed kernel>"),
                    None => self
                        .names
                        .entry(raw.name_ptr)
                        .or_insert_with(|| {
                            // SAFETY: the caller's contract: a NUL-terminated string.
                            let s = unsafe { CStr::from_ptr(raw.name_ptr as *const c_char) };
                            Arc::from(s.to_string_lossy().as_ref())
                        })
                        .clone(),
                };
                self.activities.push(Activity { raw, name });
            }
            Record::ExternalCorrelation {
                correlation,
                external_kind,
                external_id,
            } => {
                if external_kind == records::EXTERNAL_KIND_CUSTOM0 {
                    self.external.insert(correlation, external_id);
                }
            }
            Record::Api(raw) => self.api.push(raw),
            Record::Other(_) => {}
        }
    }
}

/// CUPTI asks for a buffer.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc(BUFFER_LAYOUT) };
    // SAFETY: CUPTI passes valid out-pointers.
    unsafe {
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

/// CUPTI returns a buffer: its records are read into [`COLLECTED`] and it is freed.
unsafe extern "C" fn buffer_completed(
    _ctx: *mut c_void,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    // A panic must not unwind into CUPTI; the buffer is freed either way.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let Some(Ok(c)) = CUPTI.get() else {
            return;
        };
        let mut collected = COLLECTED.lock().unwrap_or_else(|e| e.into_inner());
        let Some(into) = collected.as_mut() else {
            return; // no session: records after a stop are dropped
        };
        let mut record: *mut c_void = std::ptr::null_mut();
        loop {
            // SAFETY: `buffer` holds `valid` bytes of records; `record` is null or the last
            // record CUPTI returned from it.
            if unsafe { (c.api.get_next_record)(buffer, valid, &mut record) } != CUPTI_SUCCESS {
                break;
            }
            let offset = (record as usize).wrapping_sub(buffer as usize);
            if record.is_null() || offset >= valid {
                break;
            }
            // SAFETY: the record lies inside the buffer's `valid` initialized bytes.
            let bytes = unsafe { std::slice::from_raw_parts(record as *const u8, valid - offset) };
            if let Some(r) = records::decode(bytes) {
                // SAFETY: kernel name pointers come from CUPTI, valid while its buffer is read.
                unsafe { into.absorb(r) };
            }
        }
    }));
    // SAFETY: `buffer` came from `buffer_requested` with this layout, and CUPTI gave it back.
    unsafe { std::alloc::dealloc(buffer, BUFFER_LAYOUT) };
}

/// Starts a session: enables the activity kinds and takes the clock reference. The reason
/// when CUPTI is missing or refuses (the profiler then falls back to CUDA events).
pub(crate) fn start() -> Result<ClockRef, String> {
    let c = cupti().map_err(str::to_string)?;
    {
        let _gate = GATE.write().unwrap_or_else(|e| e.into_inner());
        WORK_GATED.store(true, Ordering::Release);
        quiesce_copies();
        // Records of work an earlier session did not wait for are dropped here, not absorbed.
        // SAFETY: the callbacks were registered when CUPTI was loaded.
        unsafe { (c.api.flush_all)(FLUSH_FORCED) };
        *COLLECTED.lock().unwrap_or_else(|e| e.into_inner()) = Some(Collected::default());
        for (i, &kind) in KINDS.iter().enumerate() {
            // SAFETY: `kind` is a valid `CUpti_ActivityKind`.
            let r = unsafe { (c.api.enable)(kind) };
            if r != CUPTI_SUCCESS {
                for &k in &KINDS[..i] {
                    // SAFETY: as above.
                    unsafe { (c.api.disable)(k) };
                }
                *COLLECTED.lock().unwrap_or_else(|e| e.into_inner()) = None;
                return Err(format!(
                    "cuptiActivityEnable({kind}): {} (CUPTI at {})",
                    c.error_string(r),
                    c.path
                ));
            }
        }
    }
    // The tightest of a few (host, CUPTI, host) samples, at the host midpoint.
    let mut best: Option<(std::time::Duration, ClockRef)> = None;
    for _ in 0..5 {
        let t0 = Instant::now();
        let Some(ts) = c.timestamp() else { continue };
        let t1 = Instant::now();
        let width = t1 - t0;
        if best.is_none_or(|(w, _)| width < w) {
            best = Some((
                width,
                ClockRef {
                    cupti_ns: ts,
                    host: t0 + width / 2,
                },
            ));
        }
    }
    let Some((_, clock)) = best else {
        stop();
        return Err("cuptiGetTimestamp failed".to_string());
    };
    ACTIVE.store(true, Ordering::Release);
    Ok(clock)
}

/// Ends the session: disables the kinds once no thread has a correlation id pushed and no
/// copy is in flight (Note [CUPTI beside other threads' CUDA work]), flushes every buffer and
/// returns what they held. Records are complete once the work they describe finished: the caller
/// waited for the devices whose records it needs.
pub(crate) fn stop() -> Collected {
    // SeqCst with `push`'s count-then-check: a push either sees the session over or is
    // counted here.
    ACTIVE.store(false, Ordering::SeqCst);
    let Ok(c) = cupti() else {
        return Collected::default();
    };
    let since = Instant::now();
    while PUSHED.load(Ordering::SeqCst) > 0 && since.elapsed() < PUSH_WAIT {
        std::thread::yield_now();
    }
    {
        let _gate = GATE.write().unwrap_or_else(|e| e.into_inner());
        quiesce_copies();
        for &kind in &KINDS {
            // SAFETY: `kind` is a valid `CUpti_ActivityKind`.
            unsafe { (c.api.disable)(kind) };
        }
        // SAFETY: the callbacks were registered when CUPTI was loaded.
        unsafe { (c.api.flush_all)(FLUSH_FORCED) };
    }
    let mut collected = COLLECTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_default();
    for call in &collected.api {
        collected
            .api_names
            .entry((call.driver, call.cbid))
            .or_insert_with(|| Arc::from(c.callback_name(call.driver, call.cbid)));
    }
    collected
}

/// Pushes `id` as this thread's external correlation id (`CUSTOM0`); true when pushed.
pub(crate) fn push(id: u64) -> bool {
    if !ACTIVE.load(Ordering::Acquire) {
        return false;
    }
    let Ok(c) = cupti() else { return false };
    PUSHED.fetch_add(1, Ordering::SeqCst);
    // SAFETY: CUSTOM0 is a valid external correlation kind.
    if !ACTIVE.load(Ordering::SeqCst)
        || unsafe { (c.api.push_external)(records::EXTERNAL_KIND_CUSTOM0, id) } != CUPTI_SUCCESS
    {
        PUSHED.fetch_sub(1, Ordering::SeqCst);
        return false;
    }
    true
}

/// Pops this thread's last pushed external correlation id (one [`push`] that returned true).
pub(crate) fn pop() {
    if let Ok(c) = cupti() {
        let mut last = 0u64;
        // SAFETY: `last` is a valid out-pointer.
        unsafe { (c.api.pop_external)(records::EXTERNAL_KIND_CUSTOM0, &mut last) };
        PUSHED.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::super::cupti_records::tests::{api, bytes_of, external, kernel, memcpy};
    use super::*;

    /// Note [CUPTI and ranks as threads]: CUPTI is refused exactly while collectives are
    /// registered on more than one device, and the reason names them.
    #[test]
    fn cupti_is_refused_while_collectives_run_on_several_devices() {
        assert_eq!(refusal(), None);
        let first = register_collectives(0);
        let same_device = register_collectives(0);
        assert_eq!(refusal(), None, "two communicators on one device");
        let other = register_collectives(3);
        let why = refusal().expect("refused with cuda:0 and cuda:3");
        assert!(
            why.contains("cuda:0, cuda:3") && why.contains("ember-run"),
            "{why}"
        );
        drop((first, same_device));
        assert_eq!(refusal(), None, "only cuda:3 left");
        drop(other);
        assert_eq!(refusal(), None);
    }

    /// Note [GATE shares nest]: a thread holding a share takes another while a start or stop
    /// waits for the lock (a second `read` would block behind the writer for good).
    #[test]
    fn gate_shares_nest_while_a_writer_waits() {
        let outer = gate_share();
        let writer = std::thread::spawn(|| drop(GATE.write().unwrap_or_else(|e| e.into_inner())));
        std::thread::sleep(Duration::from_millis(50)); // the writer queues behind `outer`
        let inner = gate_share();
        assert!(inner._lock.is_none() && outer._lock.is_some());
        drop(inner);
        assert!(
            !writer.is_finished(),
            "the outer share still holds the writer off"
        );
        drop(outer);
        writer.join().unwrap();
        assert!(gate_share()._lock.is_some(), "the count is back to 0");
    }

    #[test]
    fn buffers_are_absorbed_with_names_and_correlations() {
        let name = c"gemm_kernel";
        let mut c = Collected::default();
        let buffer = [
            bytes_of(&external(10, 501)),
            bytes_of(&kernel(10, 100, 200, 7, name.as_ptr())),
            bytes_of(&kernel(11, 300, 400, 7, name.as_ptr())),
            bytes_of(&memcpy(12, 0, 0, 64)), // no timing: left out
            bytes_of(&kernel(13, 500, 0, 7, name.as_ptr())), // still running: left out
            bytes_of(&api(10, 90, 95)),
        ];
        for b in &buffer {
            // SAFETY: the kernel records name a C string literal.
            unsafe { c.absorb(records::decode(b).unwrap()) };
        }
        assert_eq!(c.activities.len(), 2);
        assert_eq!(&*c.activities[0].name, "gemm_kernel");
        assert!(Arc::ptr_eq(&c.activities[0].name, &c.activities[1].name));
        assert_eq!(c.external.get(&10), Some(&501));
        assert_eq!(c.external.get(&11), None);
        assert_eq!(c.api.len(), 1);
        assert_eq!((c.api[0].correlation, c.api[0].start), (10, 90));
    }

    #[test]
    fn clock_reference_maps_cupti_time_to_the_host_clock() {
        let origin = Instant::now();
        let clock = ClockRef {
            cupti_ns: 1_000_000,
            host: origin + std::time::Duration::from_nanos(5_000),
        };
        assert_eq!(clock.host_ns(1_000_000, origin), 5_000);
        assert_eq!(clock.host_ns(1_002_500, origin), 7_500);
        assert_eq!(clock.host_ns(990_000, origin), 0);
    }

    #[test]
    fn candidates_start_with_the_loader_names() {
        let c = candidates();
        assert!(c.iter().any(|p| p == Path::new("libcupti.so.13")));
    }

    #[test]
    fn loading_answers_with_a_version_or_a_typed_reason() {
        match cupti_version() {
            Ok((version, path)) => {
                println!("CUPTI {version} from {path}");
                assert!((130_000..140_000).contains(&version), "{version}");
            }
            Err(crate::Error::CudaUnavailable { reason }) => {
                println!("no CUPTI: {reason}");
                assert!(reason.contains("libcupti.so.13"), "{reason}");
            }
            Err(e) => panic!("not a typed CudaUnavailable: {e}"),
        }
    }
}
