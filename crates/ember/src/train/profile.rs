//! `ember train --profile DIR`: PyTorch's profiler recipe over the first training steps: a
//! profiler with `schedule(wait=1, warmup=1, active=3, repeat=1)`, CPU activity (and CUDA on
//! a GPU), shapes and memory recorded, stepped after every training step; once the three
//! active steps are recorded it stops and writes into DIR the op table
//! (`key_averages().table(...)`, sorted by self CUDA time on a GPU and self CPU time on the
//! CPU) as `key_averages.txt` and the chrome trace (open it in Perfetto or chrome://tracing;
//! PyTorch's trace tools read it) as `trace.json`. The rest of the run is not profiled.

use super::CliResult;
use ember::profiler::{self, Profiler, ProfilerActivity};
use ember::Device;
use std::path::{Path, PathBuf};

/// Steps skipped, warmed up and recorded.
pub(super) const WAIT: usize = 1;
pub(super) const WARMUP: usize = 1;
pub(super) const ACTIVE: usize = 3;
/// Rows of the op table.
const ROWS: usize = 25;

/// The profiler of the first `WAIT + WARMUP + ACTIVE` training steps.
pub(super) struct StepProfiler {
    dir: PathBuf,
    prof: Option<Profiler>,
    sort: &'static str,
}

/// The files a finished profile wrote.
pub(super) struct Written {
    pub table: PathBuf,
    pub trace: PathBuf,
    /// How GPU time was measured (None on the CPU).
    pub gpu_timing: Option<&'static str>,
}

impl StepProfiler {
    /// Makes `dir` (a typed error when it cannot be made) and starts the profiler.
    pub(super) fn start(dir: &Path, device: Device) -> CliResult<StepProfiler> {
        std::fs::create_dir_all(dir).map_err(|e| format!("--profile: cannot make {}: {e}", dir.display()))?;
        let mut activities = vec![ProfilerActivity::Cpu];
        if device.is_cuda() {
            activities.push(ProfilerActivity::Cuda);
        }
        let prof = profiler::profile()
            .activities(activities)
            .record_shapes(true)
            .profile_memory(true)
            .schedule(profiler::schedule(WAIT, WARMUP, ACTIVE, 1))
            .start()?;
        Ok(StepProfiler {
            dir: dir.to_path_buf(),
            prof: Some(prof),
            sort: if device.is_cuda() {
                "self_cuda_time_total"
            } else {
                "self_cpu_time_total"
            },
        })
    }

    /// Called after every training step: moves the schedule on, and once the active steps are
    /// recorded stops the profiler and writes the files (returned once, then None).
    pub(super) fn step(&mut self) -> CliResult<Option<Written>> {
        let Some(prof) = self.prof.as_mut() else {
            return Ok(None);
        };
        prof.step()?;
        if prof.step_num() < WAIT + WARMUP + ACTIVE {
            return Ok(None);
        }
        self.finish().map(Some)
    }

    /// Stops the profiler and writes the table and the trace of the recorded steps; an error
    /// when the run ended before the schedule recorded them.
    pub(super) fn finish(&mut self) -> CliResult<Written> {
        let Some(mut prof) = self.prof.take() else {
            return Err("--profile: the profile was already written".into());
        };
        prof.stop()?;
        let complete = prof.step_num() >= WAIT + WARMUP + ACTIVE;
        let Some(trace) = prof.trace().filter(|_| complete) else {
            return Err(format!(
                "--profile records training steps {}..={} (wait {WAIT}, warm-up {WARMUP}, active {ACTIVE}), \
                 but the run had only {}: train on more samples or with a smaller --batch-size",
                WAIT + WARMUP + 1,
                WAIT + WARMUP + ACTIVE,
                prof.step_num()
            )
            .into());
        };
        let table = self.dir.join("key_averages.txt");
        let trace_path = self.dir.join("trace.json");
        let text = trace.key_averages().table(self.sort, ROWS)?;
        std::fs::write(&table, text + "\n")
            .map_err(|e| format!("--profile: cannot write {}: {e}", table.display()))?;
        trace
            .export_chrome_trace(&trace_path)
            .map_err(|e| format!("--profile: cannot write {}: {e}", trace_path.display()))?;
        Ok(Written {
            table,
            trace: trace_path,
            gpu_timing: trace.gpu_timing(),
        })
    }
}
