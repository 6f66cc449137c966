//! Helpers shared by the test modules: the devices to run on, closeness checks, and a
//! finite-difference gradient check.

#![allow(dead_code)]

use ember_core::{DType, Device, Result, Tensor};

/// Every dtype ember has, floats first.
pub const ALL_DTYPES: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool,
];

/// Reads a result back to the host, for tests of errors that CUDA finds on the device (an index
/// out of range, a bad probability, a negative integer exponent): there the op returns `Ok` and
/// the error comes from the next call that waits for the device (Note [Deferred device errors]
/// in ember-core's `cuda_backend/device_errors.rs`), while the CPU returns it from the op itself.
/// `r.read_back()` is the op's own error, or the error of reading its result back.
pub trait ReadBack {
    fn read_back(self) -> Result<Tensor>;
}

impl ReadBack for Result<Tensor> {
    fn read_back(self) -> Result<Tensor> {
        let t = self?;
        t.to_vec_f64()?;
        // An empty result reads nothing back (no wait): synchronize to get the error.
        if let Device::Cuda(i) = t.device() {
            ember_core::cuda::synchronize(i)?;
        }
        Ok(t)
    }
}

/// Every device this machine can run tests on: the CPU, plus the first GPU when there is one.
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if ember_core::cuda::is_available() {
        devices.push(Device::Cuda(0));
    }
    devices
}

/// The GPU for a test marked `#[ignore = "needs a CUDA device"]`: fails (never passes
/// silently) when no CUDA device is present, e.g. when `CUDA_TESTS_REQUIRED=1` is set on a GPU
/// machine whose driver is broken.
pub fn gpu() -> Device {
    assert!(
        ember_core::cuda::is_available(),
        "this test needs a CUDA device; run it on a GPU machine (CUDA_TESTS_REQUIRED=1 makes its absence a failure)"
    );
    Device::Cuda(0)
}

/// The first two GPUs, for a test marked `#[ignore = "needs two CUDA devices"]` (whose name
/// contains `two_gpus` where single-GPU runs skip it): fails, never passes silently, on a
/// machine with fewer.
pub fn two_gpus() -> (Device, Device) {
    gpu();
    let n = ember_core::cuda::device_count();
    assert!(n >= 2, "this test needs two CUDA devices, found {n}");
    (Device::Cuda(0), Device::Cuda(1))
}

/// Runs `body` in a process of its own: this test binary re-run filtered to the test `path`
/// (`module::test_name`, the caller's own path) with `EMBER_TEST_CHILD` set to it, where the
/// call runs `body`; the parent asserts the child passed. For tests that need what concurrent
/// tests of the binary disturb: exact memory statistics, the default generators' streams, a
/// CUDA graph capture (whose global mode fails other threads' unsafe calls), a profile that
/// counts kernel launches (other tests' kernels would join it).
pub fn in_own_process(path: &str, body: impl FnOnce()) {
    in_own_process_with_env(path, &[], body)
}

/// [`in_own_process`] with `env` set in the child's environment besides.
pub fn in_own_process_with_env(path: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    const CHILD: &str = "EMBER_TEST_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(path) {
        body();
        println!("EMBER_TEST_CHILD_PASSED");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary has a path"))
        .args([
            "--exact",
            path,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, path)
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("EMBER_TEST_CHILD_PASSED"),
        "child {path} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // What the child printed (kernel-time lines), shown under `--nocapture`.
    print!("{stdout}");
}

/// Runs `f` on the CPU and on the GPU and asserts the results agree (same shape and dtype,
/// values within `rtol`/`atol`, NaNs in the same places).
pub fn cpu_vs_cuda(what: &str, rtol: f64, atol: f64, f: impl Fn(Device) -> Result<Tensor>) {
    let gpu = gpu();
    let expected = f(Device::Cpu).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let actual = f(gpu).unwrap_or_else(|e| panic!("{what} on {gpu}: {e}"));
    assert_eq!(actual.device(), gpu, "{what}: result left the GPU");
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(actual.shape(), expected.shape(), "{what}: shape");
    let (a, e) = (actual.to_vec_f64().unwrap(), expected.to_vec_f64().unwrap());
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let ok = (x - y).abs() <= atol + rtol * y.abs() || (x.is_nan() && y.is_nan()) || x == y;
        assert!(
            ok,
            "{what}: element {i}: cuda {x}, cpu {y} (rtol {rtol}, atol {atol})"
        );
    }
}

/// Tolerance for comparing CPU and GPU results of `dtype` (relative, absolute).
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F16 => (2e-3, 1e-3),
        DType::BF16 => (1.6e-2, 1e-2),
        DType::F32 => (1e-5, 1e-6),
        DType::F64 => (1e-12, 1e-12),
        _ => (0.0, 0.0),
    }
}

/// f64 tensor on `device` from values and a shape.
pub fn t64(values: &[f64], shape: &[usize], device: Device) -> Tensor {
    Tensor::from_slice(values, shape, device).unwrap()
}

/// Asserts `|a - b| <= atol + rtol * |b|` elementwise, with a message naming the first miss.
pub fn assert_close(actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(actual.shape(), expected.shape(), "shapes differ");
    let (a, e) = (actual.to_vec_f64().unwrap(), expected.to_vec_f64().unwrap());
    assert_close_slice(&a, &e, rtol, atol);
}

pub fn assert_close_slice(actual: &[f64], expected: &[f64], rtol: f64, atol: f64) {
    assert_eq!(actual.len(), expected.len(), "lengths differ");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let ok = (a - e).abs() <= atol + rtol * e.abs() || (a.is_nan() && e.is_nan()) || a == e;
        assert!(
            ok,
            "element {i}: got {a}, expected {e} (rtol {rtol}, atol {atol})"
        );
    }
}

/// Deterministic pseudo-random values in [-1, 1) (a small LCG: tests need no RNG crate).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// Checks the gradients of `f` at `inputs` (f64 tensors) against central finite differences.
///
/// The output is weighted by fixed pseudo-random values `w`, so the check covers
/// d(Σ w·f)/dx for every input element; each input must be f64 and is made to require grad.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    let eps = 1e-6;
    let inputs: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            assert_eq!(t.dtype(), DType::F64, "gradcheck needs f64 inputs");
            t.detach().requires_grad_(true).unwrap()
        })
        .collect();
    let out = f(&inputs).expect("forward failed");
    let w = values(out.numel(), 99);
    let w_t = Tensor::from_slice(&w, out.shape().dims(), out.device())
        .unwrap()
        .to_dtype(out.dtype())
        .unwrap();
    out.backward_with(Some(&w_t), false).expect("backward failed");
    for (k, x) in inputs.iter().enumerate() {
        let analytic = x
            .grad()
            .map(|g| g.to_vec_f64().unwrap())
            .unwrap_or_else(|| vec![0.0; x.numel()]);
        let base = x.to_vec_f64().unwrap();
        let mut numeric = vec![0.0; base.len()];
        for i in 0..base.len() {
            let eval = |delta: f64| -> f64 {
                let mut v = base.clone();
                v[i] += delta;
                let xi = Tensor::from_slice(&v, x.shape().dims(), x.device()).unwrap();
                let args: Vec<Tensor> = inputs
                    .iter()
                    .enumerate()
                    .map(|(j, t)| if j == k { xi.clone() } else { t.detach() })
                    .collect();
                let y = f(&args).unwrap().to_vec_f64().unwrap();
                y.iter().zip(&w).map(|(a, b)| a * b).sum()
            };
            numeric[i] = (eval(eps) - eval(-eps)) / (2.0 * eps);
        }
        for (i, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
            assert!(
                (a - n).abs() <= 1e-5 + 1e-4 * n.abs(),
                "input {k} element {i}: analytic gradient {a}, numeric {n}"
            );
        }
    }
}

/// The elements' bits (NaN payloads and signed zeros included, which `to_vec_f64` would blur),
/// widened to u64, for an exact comparison in any dtype; integers and bools as int64.
pub fn bits(t: &Tensor) -> Vec<u64> {
    fn each<T: ember_core::cpu::CpuElement>(t: &Tensor, widen: fn(T) -> u64) -> Vec<u64> {
        t.to_vec::<T>().unwrap().into_iter().map(widen).collect()
    }
    let t = t.to(Device::Cpu).unwrap();
    match t.dtype() {
        DType::F32 => each(&t, |v: f32| v.to_bits() as u64),
        DType::F64 => each(&t, f64::to_bits),
        DType::F16 => each(&t, |v: half::f16| v.to_bits() as u64),
        DType::BF16 => each(&t, |v: half::bf16| v.to_bits() as u64),
        DType::I64 => each(&t, |v: i64| v as u64),
        _ => each(&t.to_dtype(DType::I64).unwrap(), |v: i64| v as u64),
    }
}

/// How many times longer than usual tests that bound a duration should allow:
/// `EMBER_TEST_TIME_SCALE` (default 1; `scripts/sanitize.sh` sets 20, as compute-sanitizer slows
/// kernels 10-100x).
pub fn time_scale() -> u32 {
    std::env::var("EMBER_TEST_TIME_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&s| s >= 1)
        .unwrap_or(1)
}

/// One profiler runs in a process at a time: every test that starts one holds this lock.
pub fn profiler_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `step` `warmup` times, then `steps` times under the profiler (CPU and CUDA activities),
/// synchronizing device 0 before and after: the profiled cycle of a kernel-time test, holding
/// [`profiler_lock`].
pub fn profile_steps(warmup: usize, steps: usize, mut step: impl FnMut()) -> ember_core::profiler::Profiler {
    use ember_core::profiler::{self, ProfilerActivity};
    let _one_profiler = profiler_lock();
    for _ in 0..warmup {
        step();
    }
    ember_core::cuda::synchronize(0).unwrap();
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .start()
        .unwrap();
    for _ in 0..steps {
        step();
    }
    ember_core::cuda::synchronize(0).unwrap();
    prof.stop().unwrap();
    prof
}

/// The values of `t` cast to bf16 on the CPU (the cast a cast twin must equal), as f64.
pub fn cpu_bf16(t: &Tensor) -> Vec<f64> {
    t.to(Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_vec_f64()
        .unwrap()
}

/// The names of the GPU kernels (and copies and fills) that ops of this thread launched while
/// `step` ran once, after `warmup` runs: the profiler records every thread's work, and other
/// tests run beside this one.
pub fn kernels_of(warmup: usize, mut step: impl FnMut()) -> Vec<String> {
    const RANGE: &str = "kernels_of_step";
    let prof = profile_steps(warmup, 1, || {
        let _range = ember_core::profiler::record_function(RANGE);
        step()
    });
    let trace = prof.trace().expect("a saved cycle");
    let events = trace.events();
    let range = events
        .iter()
        .rev()
        .find(|e| e.name == RANGE)
        .expect("the step's range");
    trace
        .gpu_activities()
        .iter()
        .filter(|a| {
            a.event.is_some_and(|i| {
                let e = &events[i];
                e.thread == range.thread && e.start_ns >= range.start_ns && e.end_ns <= range.end_ns
            })
        })
        .map(|a| a.name.clone())
        .collect()
}

/// Prints, per kernel of the profiled cycle, its launches, mean time, grid, block and registers
/// (`KT <label> <kernel>: ...` lines, for the kernel-time tests of issue 37).
pub fn print_kernel_times(
    prof: &ember_core::profiler::Profiler,
    label: &str,
    steps: usize,
) -> std::collections::BTreeMap<String, usize> {
    let acts = prof.trace().expect("a saved cycle").gpu_activities();
    let mut names: Vec<&str> = acts.iter().map(|a| a.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let mut launches = std::collections::BTreeMap::new();
    for name in names {
        let of: Vec<_> = acts.iter().filter(|a| a.name == name).collect();
        launches.insert(name.to_string(), of.len());
        let total_us = of.iter().map(|a| a.duration_ns as f64).sum::<f64>() / 1e3;
        println!(
            "KT {label} {name}: {} launches, {:.2} us each, {:.1} us a step, grid {:?} block {:?} regs {}",
            of.len(),
            total_us / of.len() as f64,
            total_us / steps as f64,
            of[0].grid,
            of[0].block,
            of[0].registers_per_thread
        );
    }
    launches
}

/// Records the names of the ops entering the dispatch point on this thread.
pub struct Seen {
    thread: std::thread::ThreadId,
    names: std::sync::Mutex<Vec<&'static str>>,
}

impl ember_core::dispatch::observer::Observer for Seen {
    fn on_enter(&self, e: &ember_core::dispatch::observer::OpEnter<'_>) {
        if e.thread == self.thread {
            self.names.lock().unwrap().push(e.op.name);
        }
    }
    fn on_exit(&self, _: &ember_core::dispatch::observer::OpExit) {}
}

/// The op names entering the dispatch point on this thread while `f` runs, and `f`'s result
/// (the door tests of ember-core's ops and ember-nn's functional API).
pub fn seen(f: impl FnOnce() -> ember_core::Result<()>) -> (ember_core::Result<()>, Vec<&'static str>) {
    let rec = std::sync::Arc::new(Seen {
        thread: std::thread::current().id(),
        names: std::sync::Mutex::new(Vec::new()),
    });
    let handle = ember_core::dispatch::observer::add_observer(rec.clone());
    let out = f();
    drop(handle);
    let names = rec.names.lock().unwrap().clone();
    (out, names)
}

/// The names of the `pub fn`s in `sources` (methods at one indent, free functions at none),
/// outside test modules: what the door tests must run or list.
pub fn public_functions(sources: &[(&str, &'static str)]) -> std::collections::BTreeSet<&'static str> {
    let mut names = std::collections::BTreeSet::new();
    for (_, src) in sources {
        let body = src.split("\n#[cfg(test)]").next().unwrap_or(src);
        for line in body.lines() {
            let rest = line
                .strip_prefix("    pub fn ")
                .or_else(|| line.strip_prefix("pub fn "));
            if let Some(rest) = rest {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                names.insert(&rest[..end]);
            }
        }
    }
    names
}
