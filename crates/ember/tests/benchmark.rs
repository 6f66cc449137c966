//! `ember::utils::benchmark::Timer` on the CPU with closures of known cost: a sleep bounds each
//! run from below, a counter checks how many runs were made. Only relations that hold on any
//! machine load are asserted.

use ember::utils::benchmark::Timer;
use ember::{Device, Error, Result};
use std::cell::Cell;
use std::time::Duration;

const NAP: Duration = Duration::from_millis(1);

fn check_statistics(m: &ember::utils::benchmark::Measurement) {
    let times = m.times();
    let (min, max) = times
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    assert!(times.iter().all(|&t| t > 0.0));
    // A relative slack of 1e-12 covers the rounding of sums and interpolations.
    let (lo, hi) = (min * (1.0 - 1e-12), max * (1.0 + 1e-12));
    assert!(lo <= m.median() && m.median() <= hi);
    assert!(lo <= m.mean() && m.mean() <= hi);
    assert!(m.iqr() >= 0.0 && m.iqr() <= hi - lo);
    // Every run sleeps at least NAP.
    assert!(min >= NAP.as_secs_f64());
}

#[test]
fn timeit_runs_the_closure_number_times_after_a_warmup() -> Result<()> {
    let calls = Cell::new(0usize);
    let mut timer = Timer::new(|| {
        calls.set(calls.get() + 1);
        std::thread::sleep(NAP);
        Ok(())
    })
    .label("sleep(1 ms)")
    .device(Device::Cpu);
    let m = timer.timeit(5)?;
    // Warm-up of max(5 / 100, 2) runs, then the 5 timed ones.
    assert_eq!(calls.get(), 2 + 5);
    assert_eq!((m.number_per_run, m.len(), m.runs()), (5, 1, 5));
    assert_eq!(m.raw_times.len(), 1);
    assert!(m.raw_times[0] >= 5.0 * NAP.as_secs_f64());
    check_statistics(&m);
    let text = m.to_string();
    assert!(text.starts_with("sleep(1 ms)\n  "), "{text}");
    assert!(text.ends_with("1 measurement, 5 runs"), "{text}");
    Ok(())
}

#[test]
fn blocked_autorange_times_blocks_until_the_minimum_run_time() -> Result<()> {
    let calls = Cell::new(0usize);
    let min_run_time = Duration::from_millis(30);
    let mut timer = Timer::new(|| {
        calls.set(calls.get() + 1);
        std::thread::sleep(NAP);
        Ok(())
    });
    let m = timer.blocked_autorange_with(min_run_time)?;
    assert!(m.len() >= 1 && m.number_per_run >= 1);
    // The block size is a power of ten, and the blocks add up to the minimum run time.
    assert!(m
        .number_per_run
        .to_string()
        .trim_start_matches('1')
        .chars()
        .all(|c| c == '0'));
    assert!(m.raw_times.iter().sum::<f64>() >= min_run_time.as_secs_f64());
    // The timed runs come after the block-size estimate's runs (at least one).
    assert!(calls.get() > m.runs());
    check_statistics(&m);
    let text = m.to_string();
    assert!(text.contains("ms") || text.contains(" s\n"), "{text}");
    Ok(())
}

#[test]
fn an_error_of_the_closure_ends_the_measurement() {
    let calls = Cell::new(0usize);
    let mut timer = Timer::new(|| {
        calls.set(calls.get() + 1);
        if calls.get() == 3 {
            return Err(Error::invalid("stmt", "third call fails"));
        }
        Ok(calls.get())
    });
    assert!(timer.timeit(10).is_err());
    assert_eq!(calls.get(), 3);
}
