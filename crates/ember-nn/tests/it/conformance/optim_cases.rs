//! PyTorch conformance of group `optim`: each case's parameters, per-step gradients and
//! expected parameters after every step, run through `ember_nn::optim` on every device.

use super::compare::compare;
use super::fixture::{Case, Fixture};
use crate::common;
use ember_core::{Device, Tensor};
use ember_nn::optim::{Adam, AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use serde_json::Value;

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn f(case: &Case, key: &str, default: f64) -> f64 {
    case.kwargs.get(key).and_then(Value::as_f64).unwrap_or(default)
}

fn b(case: &Case, key: &str) -> bool {
    case.kwargs.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// The optimizer the case names, with its kwargs over PyTorch's defaults.
fn optimizer(case: &Case, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>, String> {
    let adam = |defaults: AdamConfig| {
        let betas = case.kwargs.get("betas").and_then(Value::as_array);
        AdamConfig {
            lr: f(case, "lr", defaults.lr),
            betas: betas
                .map(|b| (b[0].as_f64().unwrap(), b[1].as_f64().unwrap()))
                .unwrap_or(defaults.betas),
            eps: f(case, "eps", defaults.eps),
            weight_decay: f(case, "weight_decay", defaults.weight_decay),
            amsgrad: b(case, "amsgrad"),
            maximize: b(case, "maximize"),
            fused: None,
        }
    };
    let made: ember_core::Result<Box<dyn Optimizer>> = match case.op.as_str() {
        "SGD" => SGD::new(
            params,
            SgdConfig {
                lr: f(case, "lr", 1e-3),
                momentum: f(case, "momentum", 0.0),
                dampening: f(case, "dampening", 0.0),
                weight_decay: f(case, "weight_decay", 0.0),
                nesterov: b(case, "nesterov"),
                maximize: b(case, "maximize"),
            },
        )
        .map(|o| Box::new(o) as Box<dyn Optimizer>),
        "Adam" => Adam::new(params, adam(AdamConfig::default())).map(|o| Box::new(o) as Box<dyn Optimizer>),
        "AdamW" => AdamW::new(params, adam(AdamConfig::adamw())).map(|o| Box::new(o) as Box<dyn Optimizer>),
        other => return Err(format!("optimizer {other} is not mapped")),
    };
    made.map_err(|e| e.to_string())
}

/// Runs every step of `case` on `device`; `Err` names the first step and parameter that differ.
fn run(fx: &Fixture, case: &Case, device: Device) -> Result<(), String> {
    let params: Vec<Tensor> = names(&case.raw["params"])
        .iter()
        .map(|n| {
            fx.tensor(case, n, device)
                .and_then(|t| t.requires_grad_(true).map_err(|e| e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let mut opt = optimizer(case, params.clone())?;
    let steps = case.raw["steps"].as_array().ok_or("case without steps")?;
    for (s, step) in steps.iter().enumerate() {
        for (p, g) in params.iter().zip(names(&step["grads"])) {
            p.set_grad(Some(fx.tensor(case, &g, device)?))
                .map_err(|e| e.to_string())?;
        }
        opt.step().map_err(|e| format!("step {s}: {e}"))?;
        for (i, (p, expected)) in params.iter().zip(names(&step["params_after"])).enumerate() {
            compare(&p.detach(), &fx.reference(case, &expected)?, case.rtol, case.atol)
                .map_err(|e| format!("step {s}, param {i}: {e}"))?;
        }
    }
    Ok(())
}

#[test]
fn pytorch_reference_cases_optim() {
    let fx = Fixture::load();
    let cases: Vec<&Case> = fx.cases.iter().filter(|c| c.group == "optim").collect();
    assert_eq!(cases.len(), 6, "the fixture's optimizer cases");
    let mut failures = Vec::new();
    for device in common::devices() {
        let mut passed = 0;
        for case in &cases {
            match run(&fx, case, device) {
                Ok(()) => passed += 1,
                Err(e) => failures.push(format!("{} on {device}: {e}", case.id)),
            }
        }
        println!(
            "conformance optim on {device}: {} ran, {passed} passed, {} failed, 0 skipped",
            cases.len(),
            cases.len() - passed
        );
    }
    assert!(
        failures.is_empty(),
        "optimizer cases failed:\n{}",
        failures.join("\n")
    );
}
