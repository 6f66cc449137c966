//! `torch.utils.benchmark` for ember: [`Timer`] runs a closure in timed blocks and returns a
//! [`Measurement`] (mean, median, interquartile range, number of runs) that prints as
//! PyTorch's does.
//!
//! ```
//! use ember::utils::benchmark::Timer;
//! use ember::{DType, Device, Tensor};
//! # fn main() -> ember::Result<()> {
//! let x = Tensor::ones([64, 64], DType::F32, Device::Cpu)?;
//! let m = Timer::new(|| x.matmul(&x)).label("x @ x").timeit(10)?;
//! assert_eq!(m.number_per_run, 10);
//! println!("{m}");
//! # Ok(())
//! # }
//! ```
//!
//! Note [Timing on the GPU]: CUDA ops are asynchronous, so a block is timed from a device
//! synchronization to a device synchronization, as PyTorch's timer does (it calls
//! `torch.cuda.synchronize()` before reading the clock whenever CUDA is available). By default
//! the device synchronized is the current CUDA device when a CUDA driver and device are
//! present, and nothing otherwise; [`Timer::device`] names it explicitly (`Device::Cpu` turns
//! synchronization off). Synchronizing once per block, not per run, keeps the cost of the
//! synchronization out of the per-run figure once blocks are long enough, which is what
//! [`Timer::blocked_autorange`] chooses them to be.

use crate::{cuda, Device, Result};
use std::fmt;
use std::time::{Duration, Instant};

/// PyTorch's default `min_run_time` for `blocked_autorange` (0.2 s).
const DEFAULT_MIN_RUN_TIME: Duration = Duration::from_millis(200);

/// Times a closure (`torch.utils.benchmark.Timer(stmt=...)`): `timeit(n)` for one block of
/// `n` runs, `blocked_autorange()` for as many blocks as fit in a minimum run time.
pub struct Timer<F> {
    stmt: F,
    label: Option<String>,
    device: Option<Device>,
    num_threads: Option<usize>,
}

/// Sets the CPU thread count for a measurement and restores the previous one when dropped.
struct ThreadsScope(Option<usize>);

impl ThreadsScope {
    fn new(num_threads: Option<usize>) -> Result<ThreadsScope> {
        match num_threads {
            Some(n) => {
                let before = crate::get_num_threads();
                crate::set_num_threads(n)?;
                Ok(ThreadsScope(Some(before)))
            }
            None => Ok(ThreadsScope(None)),
        }
    }
}

impl Drop for ThreadsScope {
    fn drop(&mut self) {
        if let Some(n) = self.0 {
            // `n` was a valid count a moment ago, so this cannot fail.
            let _ = crate::set_num_threads(n);
        }
    }
}

impl<F, T> Timer<F>
where
    F: FnMut() -> Result<T>,
{
    /// A timer of `stmt`, a closure returning `ember::Result` (its value is dropped); an
    /// error of a run ends the measurement with that error.
    pub fn new(stmt: F) -> Timer<F> {
        Timer {
            stmt,
            label: None,
            device: None,
            num_threads: None,
        }
    }

    /// The name printed above the figures (`label=` / `stmt=` in PyTorch).
    pub fn label(mut self, label: impl Into<String>) -> Timer<F> {
        self.label = Some(label.into());
        self
    }

    /// The device synchronized around each timed block; Note [Timing on the GPU].
    pub fn device(mut self, device: Device) -> Timer<F> {
        self.device = Some(device);
        self
    }

    /// The CPU backend's thread count while timing (`Timer(..., num_threads=1)`): set with
    /// [`set_num_threads`](crate::set_num_threads) before the runs and restored after them.
    /// Without it the current count is used (PyTorch's default is 1; ember keeps the setting
    /// of the program). A count of 0 is an error of the measurement.
    pub fn num_threads(mut self, num_threads: usize) -> Timer<F> {
        self.num_threads = Some(num_threads);
        self
    }

    /// Blocks until the device's queued work is done, when it is a CUDA device.
    fn synchronize(&self) -> Result<()> {
        let device = match self.device {
            Some(d) => d,
            None if cuda::is_available() => Device::Cuda(cuda::current_device()),
            None => Device::Cpu,
        };
        match device {
            Device::Cuda(i) => cuda::synchronize_on(i),
            Device::Cpu => Ok(()),
        }
    }

    /// Seconds for `number` runs, from a synchronization to a synchronization.
    fn time_block(&mut self, number: usize) -> Result<f64> {
        self.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..number {
            (self.stmt)()?;
        }
        self.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// One block of `number` runs after a warm-up of `max(number / 100, 2)` runs
    /// (`Timer.timeit(number)`).
    pub fn timeit(&mut self, number: usize) -> Result<Measurement> {
        let _threads = ThreadsScope::new(self.num_threads)?;
        self.time_block((number / 100).max(2))?;
        let t = self.time_block(number)?;
        Ok(self.measurement(number, vec![t]))
    }

    /// `blocked_autorange()` with PyTorch's minimum run time, 0.2 s.
    pub fn blocked_autorange(&mut self) -> Result<Measurement> {
        self.blocked_autorange_with(DEFAULT_MIN_RUN_TIME)
    }

    /// `Timer.blocked_autorange(min_run_time=..)`: picks a block size (a power of ten) whose
    /// time dwarfs the timer's own overhead, then times blocks of that size until their total
    /// reaches `min_run_time`. The estimate is the warm-up.
    pub fn blocked_autorange_with(&mut self, min_run_time: Duration) -> Result<Measurement> {
        let _threads = ThreadsScope::new(self.num_threads)?;
        let min_run_time = min_run_time.as_secs_f64();
        let number = self.estimate_block_size(min_run_time)?;
        let mut times = Vec::new();
        let mut total = 0.0;
        while total < min_run_time || times.is_empty() {
            let t = self.time_block(number)?;
            times.push(t);
            total += t;
        }
        Ok(self.measurement(number, times))
    }

    /// PyTorch's `_estimate_block_size`: grow the block tenfold until the overhead of an empty
    /// block is at most 1e-4 of it and it lasts a thousandth of `min_run_time`, or until one
    /// block alone exceeds `min_run_time`.
    fn estimate_block_size(&mut self, min_run_time: f64) -> Result<usize> {
        let mut empty = Vec::with_capacity(5);
        for _ in 0..5 {
            empty.push(self.time_block(0)?);
        }
        let overhead = quantile(&sorted(empty), 0.5);
        let mut number = 1usize;
        loop {
            let taken = self.time_block(number)?;
            if (overhead / taken <= 1e-4 && taken >= min_run_time / 1000.0)
                || taken > min_run_time
                || number > i32::MAX as usize / 10
            {
                return Ok(number);
            }
            number *= 10;
        }
    }

    fn measurement(&self, number_per_run: usize, raw_times: Vec<f64>) -> Measurement {
        Measurement {
            label: self.label.clone(),
            number_per_run,
            raw_times,
            num_threads: crate::get_num_threads(),
        }
    }
}

/// The result of a [`Timer`] (`torch.utils.benchmark.Measurement`): the seconds of each block
/// of `number_per_run` runs. The statistics are over the per-run times of the blocks, in
/// seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// The timer's label, printed above the figures.
    pub label: Option<String>,
    /// Runs per timed block.
    pub number_per_run: usize,
    /// The CPU backend's thread count during the runs (`task_spec.num_threads`).
    pub num_threads: usize,
    /// Seconds of each timed block (of `number_per_run` runs).
    pub raw_times: Vec<f64>,
}

impl Measurement {
    /// Seconds per run of each block (`raw_times / number_per_run`).
    pub fn times(&self) -> Vec<f64> {
        let n = self.number_per_run.max(1) as f64;
        self.raw_times.iter().map(|t| t / n).collect()
    }

    /// Number of timed blocks (PyTorch prints it as "measurements").
    pub fn len(&self) -> usize {
        self.raw_times.len()
    }

    /// True when no block was timed.
    pub fn is_empty(&self) -> bool {
        self.raw_times.is_empty()
    }

    /// Total number of timed runs (blocks × runs per block).
    pub fn runs(&self) -> usize {
        self.len() * self.number_per_run
    }

    /// Mean seconds per run.
    pub fn mean(&self) -> f64 {
        let t = self.times();
        t.iter().sum::<f64>() / t.len().max(1) as f64
    }

    /// Median seconds per run.
    pub fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    /// Interquartile range of the seconds per run (75th minus 25th percentile).
    pub fn iqr(&self) -> f64 {
        self.quantile(0.75) - self.quantile(0.25)
    }

    /// The `q` quantile of the seconds per run, interpolated linearly as `torch.quantile`.
    pub fn quantile(&self, q: f64) -> f64 {
        quantile(&sorted(self.times()), q)
    }
}

/// `v` in ascending order.
fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// The `q` quantile of ascending `v` with linear interpolation (NaN when empty).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// PyTorch's `select_unit`: the unit and its size in seconds for a time `t` in seconds.
fn select_unit(t: f64) -> (&'static str, f64) {
    if t <= 0.0 || !t.is_finite() {
        return ("s", 1.0);
    }
    match (t.log10() / 3.0).floor() as i32 {
        i32::MIN..=-3 => ("ns", 1e-9),
        -2 => ("us", 1e-6),
        -1 => ("ms", 1e-3),
        _ => ("s", 1.0),
    }
}

/// PyTorch's `Measurement.__repr__`, with a `Mean:` line added:
///
/// ```text
/// x @ x
///   Median: 5.73 us
///   Mean:   5.80 us
///   IQR:    0.25 us (5.61 to 5.86)
///   372 measurements, 100 runs per measurement
/// ```
///
/// The IQR line needs 4 blocks or more (as in PyTorch); a single block prints its time alone,
/// and an IQR above 10% of the median adds PyTorch's warning.
impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.len();
        let median = self.median();
        let (unit, scale) = select_unit(median);
        if let Some(label) = &self.label {
            writeln!(f, "{label}")?;
        }
        if n > 1 {
            writeln!(f, "  Median: {:.2} {unit}", median / scale)?;
            writeln!(f, "  Mean:   {:.2} {unit}", self.mean() / scale)?;
        } else {
            writeln!(f, "  {:.2} {unit}", median / scale)?;
        }
        if n >= 4 {
            writeln!(
                f,
                "  IQR:    {:.2} {unit} ({:.2} to {:.2})",
                self.iqr() / scale,
                self.quantile(0.25) / scale,
                self.quantile(0.75) / scale
            )?;
        }
        if n > 1 {
            write!(
                f,
                "  {n} measurements, {} runs per measurement",
                self.number_per_run
            )?;
        } else {
            write!(f, "  {n} measurement, {} runs", self.number_per_run)?;
        }
        if n >= 4 && median > 0.0 && self.iqr() / median > 0.1 {
            write!(
                f,
                "\n  WARNING: Interquartile range is {:.1}% of the median measurement.\n           This suggests significant environmental influence.",
                100.0 * self.iqr() / median
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(number_per_run: usize, raw_times: &[f64]) -> Measurement {
        Measurement {
            label: Some("x + y".into()),
            number_per_run,
            num_threads: 1,
            raw_times: raw_times.to_vec(),
        }
    }

    #[test]
    fn num_threads_holds_during_the_runs_and_is_restored() {
        // The only test of this binary that changes the count.
        let before = crate::get_num_threads();
        let mut seen = Vec::new();
        let m = Timer::new(|| {
            seen.push(crate::get_num_threads());
            Ok(())
        })
        .num_threads(1)
        .timeit(3)
        .unwrap();
        assert_eq!(m.num_threads, 1);
        assert!(!seen.is_empty() && seen.iter().all(|&n| n == 1), "{seen:?}");
        assert_eq!(crate::get_num_threads(), before);
        let err = Timer::new(|| Ok(())).num_threads(0).timeit(1).unwrap_err();
        assert!(matches!(
            err,
            crate::Error::InvalidArgument {
                op: "set_num_threads",
                ..
            }
        ));
    }

    #[test]
    fn statistics_are_per_run_with_linear_quantiles() {
        let m = m(10, &[40e-6, 10e-6, 30e-6, 20e-6, 50e-6]);
        assert_eq!(m.times().len(), 5);
        assert!((m.median() - 3e-6).abs() < 1e-15);
        assert!((m.mean() - 3e-6).abs() < 1e-15);
        assert!((m.iqr() - 2e-6).abs() < 1e-15);
        assert!((m.quantile(0.1) - 1.4e-6).abs() < 1e-15);
        assert_eq!(m.runs(), 50);
    }

    #[test]
    fn display_prints_like_pytorch() {
        let many = m(100, &[573e-6, 560e-6, 586e-6, 574e-6]);
        assert_eq!(
            many.to_string(),
            "x + y\n  Median: 5.74 us\n  Mean:   5.73 us\n  IQR:    0.07 us (5.70 to 5.77)\n  \
             4 measurements, 100 runs per measurement"
        );
        let one = m(1000, &[1.29e-3]);
        assert_eq!(one.to_string(), "x + y\n  1.29 us\n  1 measurement, 1000 runs");
        let noisy = m(1, &[1.0, 2.0, 3.0, 4.0]);
        assert!(noisy
            .to_string()
            .contains("WARNING: Interquartile range is 60.0%"));
        assert_eq!(select_unit(2e-9), ("ns", 1e-9));
        assert_eq!(select_unit(2e-3), ("ms", 1e-3));
        assert_eq!(select_unit(20.0), ("s", 1.0));
    }
}
