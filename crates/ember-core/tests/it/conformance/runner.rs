//! The shared part of the PyTorch conformance runner: running one case (load inputs, run the
//! group's forward mapping, compare outputs, backpropagate PyTorch's upstream gradients and
//! compare input gradients), running a group on a device, and the report.
//!
//! ember-core's test (`mod.rs` here, group `core`) and ember-nn's (group `nn`) both include
//! this file with `fixture.rs`, `compare.rs` and `kwargs.rs` (ember-nn through `#[path]`, so
//! the crates need no dependency on each other); each keeps its own forward mapping.

#![allow(dead_code)]

use super::compare::compare;
use super::fixture::{Case, Fixture};
use super::kwargs::Kwargs;
use ember_core::{Device, Error, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a case did not pass.
#[derive(Debug)]
pub enum Fail {
    Failed(String),
    Skipped(String),
}

impl Fail {
    /// The runner does not map this op or argument yet.
    pub fn unmapped(what: String) -> Fail {
        Fail::Skipped(format!("not mapped by the runner: {what}"))
    }

    pub fn context(self, stage: &str) -> Fail {
        match self {
            Fail::Failed(m) => Fail::Failed(format!("{stage}: {m}")),
            Fail::Skipped(m) => Fail::Skipped(format!("{stage}: {m}")),
        }
    }
}

/// True for the placeholder error of an op whose kernel is not built yet (`ops::not_built`).
fn is_not_built(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { msg, .. } if msg == "not built yet")
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        if is_not_built(&e) {
            Fail::Skipped(e.to_string())
        } else {
            Fail::Failed(format!("error: {e}"))
        }
    }
}

/// A group's mapping: (op, case id, kwargs, inputs in manifest order) to PyTorch's outputs.
pub type Forward = fn(&str, &str, &Kwargs, &[Tensor]) -> Result<Vec<Tensor>, Fail>;

/// (rtol, atol) for `case` on `device`: the manifest's, unless a backend needs its own.
pub fn tolerances(case: &Case, device: Device) -> (f64, f64) {
    match device {
        Device::Cpu | Device::Cuda(_) => (case.rtol, case.atol),
    }
}

pub enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

pub fn run_case(fx: &Fixture, case: &Case, device: Device, forward: Forward) -> Outcome {
    match catch_unwind(AssertUnwindSafe(|| try_case(fx, case, device, forward))) {
        Ok(Ok(())) => Outcome::Passed,
        Ok(Err(Fail::Failed(m))) => Outcome::Failed(m),
        Ok(Err(Fail::Skipped(m))) => Outcome::Skipped(m),
        Err(p) => Outcome::Failed(format!("panicked: {}", panic_message(p.as_ref()))),
    }
}

fn try_case(fx: &Fixture, case: &Case, device: Device, forward: Forward) -> Result<(), Fail> {
    let (rtol, atol) = tolerances(case, device);
    let load = |name: &String| fx.tensor(case, name, device).map_err(Fail::Failed);
    let reference = |name: &str| fx.reference(case, name).map_err(Fail::Failed);
    let mut inputs = Vec::with_capacity(case.inputs.len());
    for name in &case.inputs {
        let t = load(name)?;
        let wants_grad = case.grad_of(name).is_some();
        inputs.push(if wants_grad {
            t.requires_grad_(true)
                .map_err(|e| Fail::from(e).context("requires_grad"))?
        } else {
            t
        });
    }

    let outputs =
        forward(&case.op, &case.id, &Kwargs(&case.kwargs), &inputs).map_err(|f| f.context("forward"))?;
    if outputs.len() != case.outputs.len() {
        return Err(Fail::Failed(format!(
            "forward: {} outputs, PyTorch has {}",
            outputs.len(),
            case.outputs.len()
        )));
    }
    let mut misses = Vec::new();
    let mut float_outputs = Vec::new();
    for (out, name) in outputs.iter().zip(&case.outputs) {
        let r = reference(name)?;
        if let Err(m) = compare(out, &r, rtol, atol) {
            misses.push(format!("output {name}: {m}"));
        }
        // PyTorch's grad_out pairs with the floating outputs that require grad (outputs such as
        // batch norm's updated running stats are floating but outside the graph).
        if r.dtype.is_floating_point() && out.requires_grad() {
            float_outputs.push(out.clone());
        }
    }

    if !case.grad_out.is_empty() {
        if float_outputs.len() != case.grad_out.len() {
            return Err(Fail::Failed(format!(
                "runner: {} floating outputs that require grad but {} grad_out",
                float_outputs.len(),
                case.grad_out.len()
            )));
        }
        let grad_out = case.grad_out.iter().map(load).collect::<Result<Vec<_>, _>>()?;
        let wrt: Vec<(&String, &Tensor)> = case
            .inputs
            .iter()
            .zip(&inputs)
            .filter(|(n, _)| case.grad_of(n).is_some())
            .collect();
        let targets: Vec<Tensor> = wrt.iter().map(|(_, t)| (*t).clone()).collect();
        match ember_core::autograd::grad(&float_outputs, &targets, Some(&grad_out), false) {
            Ok(grads) => {
                for ((name, x), g) in wrt.iter().zip(grads) {
                    let r = reference(case.grad_of(name).expect("filtered above"))?;
                    // PyTorch reports an unused input's gradient as zeros.
                    let g = match g {
                        Some(g) => g,
                        None => x.zeros_like().map_err(|e| Fail::from(e).context("backward"))?,
                    };
                    if let Err(m) = compare(&g, &r, rtol, atol) {
                        misses.push(format!("grad of {name}: {m}"));
                    }
                }
            }
            Err(e) if misses.is_empty() => return Err(Fail::from(e).context("backward")),
            Err(e) => misses.push(format!("backward: {e}")),
        }
    }
    if misses.is_empty() {
        Ok(())
    } else {
        Err(Fail::Failed(misses.join("; ")))
    }
}

/// The outcome counts of one group on one device, with a line per failed or skipped case.
pub struct Report {
    pub group: String,
    pub device: Device,
    pub passed: usize,
    pub failed: Vec<String>,
    pub skipped: Vec<String>,
    /// Ids of the cases left out on purpose (ops the crate does not run yet).
    pub not_run: Vec<String>,
}

impl Report {
    /// Cases run: passed, failed or skipped (not those left out).
    pub fn ran(&self) -> usize {
        self.passed + self.failed.len() + self.skipped.len()
    }

    pub fn print(&self) {
        println!(
            "conformance {} on {}: {} ran, {} passed, {} failed, {} skipped",
            self.group,
            self.device,
            self.ran(),
            self.passed,
            self.failed.len(),
            self.skipped.len()
        );
        for line in &self.failed {
            println!("  FAILED  {line}");
        }
        for line in &self.skipped {
            println!("  SKIPPED {line}");
        }
        if !self.not_run.is_empty() {
            println!(
                "  NOT RUN {} case(s), not built yet: {}",
                self.not_run.len(),
                self.not_run.join(", ")
            );
        }
    }
}

/// The distinct groups of the manifest, in order of first appearance.
pub fn groups(fx: &Fixture) -> Vec<&str> {
    let mut gs: Vec<&str> = Vec::new();
    for c in &fx.cases {
        if !gs.contains(&c.group.as_str()) {
            gs.push(&c.group);
        }
    }
    gs
}

/// Runs the cases of `group` on `device`, leaving out (as "not run yet", never as passed) the
/// cases whose op is in `not_run`.
pub fn run_group(fx: &Fixture, group: &str, device: Device, forward: Forward, not_run: &[&str]) -> Report {
    let mut report = Report {
        group: group.to_owned(),
        device,
        passed: 0,
        failed: Vec::new(),
        skipped: Vec::new(),
        not_run: Vec::new(),
    };
    for case in fx.cases.iter().filter(|c| c.group == group) {
        if not_run.contains(&case.op.as_str()) {
            report.not_run.push(case.id.clone());
            continue;
        }
        let label = format!("{} ({}):", case.id, case.op);
        match run_case(fx, case, device, forward) {
            Outcome::Passed => report.passed += 1,
            Outcome::Failed(m) => report.failed.push(format!("{label} {m}")),
            Outcome::Skipped(m) => report.skipped.push(format!("{label} {m}")),
        }
    }
    report
}

/// Runs `group` on each of `devices` and asserts that every case it runs passed (none failed,
/// none skipped); the group must be in the manifest.
pub fn assert_group_passes(
    fx: &Fixture,
    group: &str,
    forward: Forward,
    devices: &[Device],
    not_run: &[&str],
) {
    let n = fx.cases.iter().filter(|c| c.group == group).count();
    assert!(n > 0, "group {group} is missing from the manifest");
    let mut bad = Vec::new();
    for &device in devices {
        let report = run_group(fx, group, device, forward, not_run);
        report.print();
        assert_eq!(report.ran() + report.not_run.len(), n);
        if !report.failed.is_empty() || !report.skipped.is_empty() {
            bad.push(format!(
                "{group} on {device}: {} failed, {} skipped",
                report.failed.len(),
                report.skipped.len()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "conformance cases failed or skipped (see the report above): {}",
        bad.join("; ")
    );
}
