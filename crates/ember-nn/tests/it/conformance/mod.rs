//! PyTorch conformance of group `nn`: the reference cases of ember-core's
//! `tests/fixtures/conformance/` run through `ember_nn::functional` on every device of
//! `common::devices()`, comparing outputs and input gradients with PyTorch's.
//!
//! The generic runner (fixture loading, comparison, kwargs, the run loop) is ember-core's test
//! code, included by path so that neither crate depends on the other for it; this file keeps
//! the `nn` op table (`nn_ops.rs`) and the test.

#[allow(dead_code)]
#[path = "../../../../ember-core/tests/it/conformance/compare.rs"]
mod compare;
#[allow(dead_code)]
#[path = "../../../../ember-core/tests/it/conformance/fixture.rs"]
mod fixture;
#[allow(dead_code)]
#[path = "../../../../ember-core/tests/it/conformance/kwargs.rs"]
mod kwargs;
#[allow(dead_code)]
#[path = "../../../../ember-core/tests/it/conformance/runner.rs"]
mod runner;

#[allow(dead_code)]
#[path = "../../../../ember-core/tests/it/conformance/core_ops.rs"]
mod core_ops;

mod amp;
mod nn_ops;
mod optim_cases;

use crate::common;
use fixture::Fixture;
use runner::Fail;

/// Ops of group `nn` whose layers are not built yet: their cases are reported as not run.
const NOT_RUN_YET: &[&str] = &[];

#[test]
fn pytorch_reference_cases_nn() {
    let fx = Fixture::load();
    println!(
        "conformance: {} cases from PyTorch {}",
        fx.cases.len(),
        fx.torch_version
    );
    runner::assert_group_passes(&fx, "nn", nn_ops::forward, &common::devices(), NOT_RUN_YET);
}

#[test]
fn every_nn_op_is_mapped_or_listed_as_not_run() {
    // A new case of an op nobody maps must show up here rather than as a silent skip.
    let fx = Fixture::load();
    let ops: Vec<&str> = fx
        .cases
        .iter()
        .filter(|c| c.group == "nn")
        .map(|c| c.op.as_str())
        .collect();
    assert_eq!(ops.len(), 27);
    for op in ops {
        assert!(
            nn_ops::MAPPED.contains(&op) || NOT_RUN_YET.contains(&op),
            "nn op {op} is neither mapped nor listed as not run yet"
        );
    }
}
