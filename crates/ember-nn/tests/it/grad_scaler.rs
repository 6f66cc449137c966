//! `ember_nn::amp::GradScaler`: PyTorch's defaults and state rules, scale backoff and growth,
//! skipped steps that leave parameters and optimizer state alone, `unscale_` before
//! `clip_grad_norm_`, state dicts, the three `grad_scaler` cases PyTorch generated
//! (`tests/fixtures/conformance_amp/`, from `../shared/conformance/amp/`), and on a GPU the same
//! on CUDA plus a check that a scaled step never waits for the device.

use crate::common;
use ember_core::{no_grad, DType, Device, Error, Result, Tensor};
use ember_nn::amp::{GradScaler, GradScalerConfig, OptState};
use ember_nn::functional::cross_entropy;
use ember_nn::optim::{clip_grad_norm_, Adam, AdamConfig, AdamW, Optimizer, SgdConfig, SGD};

fn param(values: &[f32], device: Device) -> Tensor {
    Tensor::from_slice(values, [values.len()], device)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

fn set_grad(p: &Tensor, values: &[f32]) {
    let g = Tensor::from_slice(values, [values.len()], Device::Cpu)
        .unwrap()
        .to(p.device())
        .unwrap();
    p.set_grad(Some(g)).unwrap();
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

fn config(init_scale: f64, growth_interval: i64) -> GradScalerConfig {
    GradScalerConfig {
        init_scale,
        growth_interval,
        ..Default::default()
    }
}

fn message(r: Result<()>) -> String {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => e.to_string(),
        other => panic!("expected an InvalidArgument error, got {other:?}"),
    }
}

/// A loss whose gradient with respect to `p` is `g` (loss = Σ p·g), scaled and backpropagated.
fn scaled_backward(scaler: &mut GradScaler, p: &Tensor, g: &[f32]) {
    let g = Tensor::from_slice(g, [g.len()], Device::Cpu)
        .unwrap()
        .to(p.device())
        .unwrap();
    let loss = p.mul(&g).unwrap().sum_all().unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
}

#[test]
fn defaults_match_pytorch() {
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval,
            d.enabled
        ),
        (65536.0, 2.0, 0.5, 2000, true)
    );
    let mut s = GradScaler::default();
    assert!(s.is_enabled());
    assert_eq!(s.get_scale().unwrap(), 65536.0);
    assert_eq!(s.get_growth_tracker().unwrap(), 0);
    assert!(s.get_scale_async().is_none(), "the scale is made lazily");
    assert_eq!(
        (
            s.get_growth_factor(),
            s.get_backoff_factor(),
            s.get_growth_interval()
        ),
        (2.0, 0.5, 2000)
    );
    s.set_growth_factor(3.0);
    s.set_backoff_factor(0.25);
    s.set_growth_interval(7);
    assert_eq!(
        (
            s.get_growth_factor(),
            s.get_backoff_factor(),
            s.get_growth_interval()
        ),
        (3.0, 0.25, 7)
    );
    // The first scale() makes a 0-d f32 scale on the loss's device.
    let loss = Tensor::scalar(1.5, DType::F32, Device::Cpu).unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.item::<f32>().unwrap(), 1.5 * 65536.0);
    let st = s.get_scale_async().unwrap();
    assert_eq!((st.dtype(), st.rank(), st.device()), (DType::F32, 0, Device::Cpu));
    // Invalid factors are refused as PyTorch's asserts do.
    for bad in [
        GradScalerConfig {
            growth_factor: 1.0,
            ..Default::default()
        },
        GradScalerConfig {
            backoff_factor: 1.0,
            ..Default::default()
        },
    ] {
        assert!(GradScaler::with_config(bad).is_err());
    }
}

#[test]
fn new_takes_no_argument_and_builds_like_the_losses() {
    // `GradScaler()` and `GradScaler(init_scale=1024, growth_interval=1)`.
    let mut s = GradScaler::new();
    let loss = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
    assert_eq!(s.scale(&loss).unwrap().item::<f32>().unwrap(), 65536.0);
    let mut s = GradScaler::new()
        .init_scale(1024.0)
        .growth_interval(1)
        .growth_factor(4.0);
    let p = param(&[1.0], Device::Cpu);
    let mut opt = SGD::new(
        vec![p.clone()],
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    scaled_backward(&mut s, &p, &[1.0]);
    s.step(&mut opt).unwrap();
    s.update().unwrap(); // one clean step with growth_interval 1: x4
    assert_eq!(s.get_scale().unwrap(), 4096.0);
    // `update(new_scale)` is `update_with`.
    scaled_backward(&mut s, &p, &[1.0]);
    s.step(&mut opt).unwrap();
    s.update_with(8.0).unwrap();
    assert_eq!(s.get_scale().unwrap(), 8.0);
    // Bad settings given builder-style are a typed error at the first scale(), not a panic.
    let mut bad = GradScaler::new().backoff_factor(2.0);
    assert!(matches!(
        bad.scale(&loss),
        Err(Error::InvalidArgument { op: "GradScaler", .. })
    ));
    // Disabled, the bad factor does not matter (PyTorch checks only when enabled).
    let mut off = GradScaler::new().growth_factor(0.5).enabled(false);
    assert_eq!(off.scale(&loss).unwrap().item::<f32>().unwrap(), 1.0);
}

#[test]
fn scale_keeps_the_output_dtype() {
    let mut s = GradScaler::with_config(config(1024.0, 2000)).unwrap();
    let x = Tensor::from_slice(&[0.5f64, -2.0], [2], Device::Cpu).unwrap();
    let y = s.scale(&x).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    assert_eq!(y.to_vec::<f64>().unwrap(), [512.0, -2048.0]);
    let h = x.to_dtype(DType::F16).unwrap();
    let y = s.scale(&h).unwrap();
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(y.to_vec_f64().unwrap(), [512.0, -2048.0]);
    let many = s.scale_all(&[x.clone(), h]).unwrap();
    assert_eq!(many.len(), 2);
    // Gradients through a scaled loss carry the scale.
    let p = param(&[1.0, 2.0], Device::Cpu);
    scaled_backward(&mut s, &p, &[0.25, -1.0]);
    assert_eq!(vals(&p.grad().unwrap()), [256.0, -1024.0]);
}

#[test]
fn state_rules() {
    let p = param(&[1.0, 2.0], Device::Cpu);
    let mut opt = SGD::new(vec![p.clone()], SgdConfig::default()).unwrap();
    let mut s = GradScaler::default();
    // Before scale(): nothing to unscale, step or update with.
    assert!(message(s.unscale_(&mut opt)).contains("did not use scaler.scale"));
    assert!(message(s.step(&mut opt)).contains("_scale is None"));
    assert!(message(s.update()).contains("_scale is None"));
    scaled_backward(&mut s, &p, &[1.0, 1.0]);
    assert!(message(s.update()).contains("No inf checks were recorded prior to update."));
    assert_eq!(s.optimizer_state(&opt), OptState::Ready);
    s.unscale_(&mut opt).unwrap();
    assert_eq!(s.optimizer_state(&opt), OptState::Unscaled);
    assert_eq!(
        message(s.unscale_(&mut opt)),
        "invalid argument to GradScaler.unscale_: unscale_() has already been called on this optimizer since the last update()."
    );
    s.step(&mut opt).unwrap();
    assert_eq!(s.optimizer_state(&opt), OptState::Stepped);
    assert!(message(s.step(&mut opt)).contains("step() has already been called since the last update()."));
    assert!(message(s.unscale_(&mut opt)).contains("unscale_() is being called after step()."));
    s.update().unwrap();
    // update() starts a new iteration: unscale_ and step are allowed again.
    assert_eq!(s.optimizer_state(&opt), OptState::Ready);
    scaled_backward(&mut s, &p, &[1.0, 1.0]);
    s.unscale_(&mut opt).unwrap();
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    // An optimizer without gradients has nothing to check.
    let q = param(&[1.0], Device::Cpu);
    let mut other = SGD::new(vec![q], SgdConfig::default()).unwrap();
    assert!(message(s.step(&mut other)).contains("No inf checks were recorded for this optimizer."));
}

#[test]
fn unscale_refuses_fp16_gradients() {
    let p = Tensor::zeros([2], DType::F16, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    p.set_grad(Some(Tensor::ones([2], DType::F16, Device::Cpu).unwrap()))
        .unwrap();
    let mut opt = SGD::new(vec![p], SgdConfig::default()).unwrap();
    let mut s = GradScaler::default();
    s.scale(&Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap())
        .unwrap();
    let m = message(s.unscale_(&mut opt));
    assert!(m.contains("Attempting to unscale FP16 gradients."), "{m}");
}

#[test]
fn unscale_divides_the_gradients_and_step_skips_on_inf() {
    let p = param(&[1.0, 2.0], Device::Cpu);
    let mut opt = SGD::new(
        vec![p.clone()],
        SgdConfig {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    let mut s = GradScaler::with_config(config(8.0, 2000)).unwrap();
    scaled_backward(&mut s, &p, &[0.5, -1.0]);
    assert_eq!(vals(&p.grad().unwrap()), [4.0, -8.0]);
    s.unscale_(&mut opt).unwrap();
    assert_eq!(vals(&p.grad().unwrap()), [0.5, -1.0]);
    s.step(&mut opt).unwrap();
    assert_eq!(vals(&p), [0.75, 2.5]);
    s.update().unwrap();
    // Without unscale_, step unscales inside the fused step (and writes the gradient back).
    opt.zero_grad().unwrap();
    scaled_backward(&mut s, &p, &[1.0, 1.0]);
    s.step(&mut opt).unwrap();
    assert_eq!(vals(&p.grad().unwrap()), [1.0, 1.0]);
    assert_eq!(vals(&p), [0.25, 2.0]);
    s.update().unwrap();
    opt.zero_grad().unwrap();
    scaled_backward(&mut s, &p, &[f32::INFINITY, 1.0]);
    s.step(&mut opt).unwrap();
    assert_eq!(vals(&p), [0.25, 2.0], "a step with an inf gradient is skipped");
    s.update().unwrap();
    assert_eq!(s.get_scale().unwrap(), 4.0);
}

#[test]
fn scale_backs_off_on_inf_and_nan_and_grows_after_the_interval() {
    let p = param(&[1.0], Device::Cpu);
    let mut opt = SGD::new(vec![p.clone()], SgdConfig::default()).unwrap();
    let mut s = GradScaler::with_config(config(1024.0, 3)).unwrap();
    // (gradient, scale and tracker after update)
    let script = [
        (1.0, 1024.0, 1),
        (1.0, 1024.0, 2),
        (1.0, 2048.0, 0),
        (f32::INFINITY, 1024.0, 0),
        (1.0, 1024.0, 1),
        (f32::NAN, 512.0, 0),
        (1.0, 512.0, 1),
        (1.0, 512.0, 2),
        (1.0, 1024.0, 0),
        (f32::NEG_INFINITY, 512.0, 0),
    ];
    for (i, (g, scale, tracker)) in script.into_iter().enumerate() {
        opt.zero_grad().unwrap();
        scaled_backward(&mut s, &p, &[g]);
        s.step(&mut opt).unwrap();
        s.update().unwrap();
        assert_eq!(
            (s.get_scale().unwrap(), s.get_growth_tracker().unwrap()),
            (scale, tracker),
            "step {i}"
        );
    }
    // A given new scale is set as is; the tracker stays.
    s.update().unwrap_err();
    scaled_backward(&mut s, &p, &[1.0]);
    s.step(&mut opt).unwrap();
    s.update_with(3.0).unwrap();
    assert_eq!(s.get_scale().unwrap(), 3.0);
    let t = Tensor::scalar(5.0, DType::F32, Device::Cpu).unwrap();
    s.update_to_tensor(&t).unwrap();
    assert_eq!(s.get_scale().unwrap(), 5.0);
    assert!(s
        .update_to_tensor(&Tensor::scalar(5.0, DType::F64, Device::Cpu).unwrap())
        .is_err());
}

/// The optimizers of the skip tests: SGD with momentum, SGD with dampened momentum (whose new
/// buffers make the step read the flag on the host), Adam with amsgrad, AdamW.
fn optimizers(params: &[Tensor]) -> Vec<(&'static str, Box<dyn Optimizer>)> {
    let v = || params.to_vec();
    vec![
        (
            "sgd",
            Box::new(
                SGD::new(
                    v(),
                    SgdConfig {
                        lr: 0.1,
                        momentum: 0.9,
                        nesterov: true,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
        ),
        (
            "sgd dampening",
            Box::new(
                SGD::new(
                    v(),
                    SgdConfig {
                        lr: 0.1,
                        momentum: 0.9,
                        dampening: 0.5,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
        ),
        (
            "adam",
            Box::new(
                Adam::new(
                    v(),
                    AdamConfig {
                        lr: 0.01,
                        amsgrad: true,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
        ),
        (
            "adamw",
            Box::new(
                AdamW::new(
                    v(),
                    AdamConfig {
                        lr: 0.01,
                        ..AdamConfig::adamw()
                    },
                )
                .unwrap(),
            ),
        ),
    ]
}

fn state_values(opt: &dyn Optimizer) -> Vec<(String, Vec<f64>)> {
    opt.state_dict()
        .into_iter()
        .map(|(k, t)| (k, t.to_vec_f64().unwrap()))
        .collect()
}

/// Skipped steps (the first one included) change no parameter and no state, the step count of
/// Adam included; the clean steps around them give exactly what the same optimizer gives on
/// the unscaled gradients without a scaler.
fn skipped_steps_leave_everything_untouched(device: Device) {
    let grads: [[f32; 3]; 5] = [
        [f32::NAN, 1.0, 2.0],
        [0.5, -1.0, 0.25],
        [1.0, f32::INFINITY, 0.0],
        [-0.75, 0.5, 2.0],
        [0.125, 0.25, -0.5],
    ];
    let p0 = [1.0f32, -2.0, 0.5];
    let amp_params = [param(&p0, device)];
    let ref_params = [param(&p0, device)];
    let amp = optimizers(&amp_params);
    let plain = optimizers(&ref_params);
    for ((name, mut amp_opt), (_, mut ref_opt)) in amp.into_iter().zip(plain) {
        {
            let _g = no_grad();
            amp_params[0].copy_(&param(&p0, device)).unwrap();
            ref_params[0].copy_(&param(&p0, device)).unwrap();
        }
        let mut s = GradScaler::with_config(config(4096.0, 2)).unwrap();
        for (i, g) in grads.iter().enumerate() {
            let skip = g.iter().any(|x| !x.is_finite());
            let before_params = vals(&amp_params[0]);
            let before_state = state_values(amp_opt.as_ref());
            amp_opt.zero_grad().unwrap();
            scaled_backward(&mut s, &amp_params[0], g);
            s.step(amp_opt.as_mut()).unwrap();
            s.update().unwrap();
            if skip {
                assert_eq!(vals(&amp_params[0]), before_params, "{name} step {i}: params");
                // Every entry keeps its bits; a skipped first step may leave new state, as in
                // PyTorch (Adam's step 0 and zero moments, SGD's zero-filled buffer), which is
                // all zeros and acts as no state.
                let after = state_values(amp_opt.as_ref());
                for (k, v) in &after {
                    match before_state.iter().find(|(b, _)| b == k) {
                        Some((_, old)) => assert!(
                            v.iter().zip(old).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{name} step {i}: {k} changed from {old:?} to {v:?}"
                        ),
                        None if k.starts_with("state.") => {
                            assert!(v.iter().all(|&x| x == 0.0), "{name} step {i}: new {k} = {v:?}")
                        }
                        None => panic!("{name} step {i}: new entry {k}"),
                    }
                }
                assert!(before_state
                    .iter()
                    .all(|(k, _)| after.iter().any(|(a, _)| a == k)));
            } else {
                set_grad(&ref_params[0], g);
                ref_opt.step().unwrap();
                assert_eq!(
                    vals(&amp_params[0]),
                    vals(&ref_params[0]),
                    "{name} step {i}: a clean scaled step differs from the plain one"
                );
            }
        }
        // Adam counted the 3 clean steps only.
        if name.starts_with("adam") {
            let state = amp_opt.state_dict();
            let step = &state.iter().find(|(k, _)| k == "state.0.step").unwrap().1;
            assert_eq!(
                (step.device(), step.to_vec::<f32>().unwrap()),
                (Device::Cpu, vec![3.0])
            );
        }
    }
}

#[test]
fn skipped_steps_leave_params_and_optimizer_state_untouched() {
    skipped_steps_leave_everything_untouched(Device::Cpu);
}

#[test]
fn unscale_then_clip_grad_norm() {
    let p = param(&[3.0, 4.0], Device::Cpu);
    let q = param(&[0.0, 0.0], Device::Cpu);
    let mut opt = SGD::new(
        vec![p.clone()],
        SgdConfig {
            lr: 1.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut s = GradScaler::with_config(config(1024.0, 2000)).unwrap();
    scaled_backward(&mut s, &p, &[3.0, 4.0]);
    s.unscale_(&mut opt).unwrap();
    assert_eq!(vals(&p.grad().unwrap()), [3.0, 4.0]);
    let total = clip_grad_norm_(&[p.clone(), q], 1.0, 2.0).unwrap();
    assert_eq!(total.item::<f32>().unwrap(), 5.0);
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    let coef = (1.0 / (5.0f32 + 1e-6)).min(1.0);
    let expected = [3.0 - 3.0 * coef, 4.0 - 4.0 * coef];
    common::assert_close_slice(
        &vals(&p).iter().map(|&x| x as f64).collect::<Vec<_>>(),
        &expected.map(|x| x as f64),
        1e-6,
        1e-6,
    );
}

#[test]
fn state_dict_round_trip() {
    let p = param(&[1.0], Device::Cpu);
    let mut opt = SGD::new(vec![p.clone()], SgdConfig::default()).unwrap();
    let mut a = GradScaler::with_config(GradScalerConfig {
        init_scale: 256.0,
        growth_factor: 4.0,
        backoff_factor: 0.25,
        growth_interval: 5,
        enabled: true,
    })
    .unwrap();
    for g in [1.0, f32::INFINITY, 1.0, 1.0] {
        opt.zero_grad().unwrap();
        scaled_backward(&mut a, &p, &[g]);
        a.step(&mut opt).unwrap();
        a.update().unwrap();
    }
    let state = a.state_dict().unwrap();
    let keys: Vec<&str> = state.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker"
        ]
    );
    let values: Vec<f64> = state.iter().map(|(_, t)| t.item_f64().unwrap()).collect();
    assert_eq!(values, [64.0, 4.0, 0.25, 5.0, 2.0]);
    assert!(state
        .iter()
        .all(|(_, t)| t.rank() == 0 && t.device() == Device::Cpu));
    // Into a fresh scaler (used before its first scale()) and into one already running.
    let mut b = GradScaler::default();
    b.load_state_dict(&state).unwrap();
    assert_eq!(
        (b.get_scale().unwrap(), b.get_growth_tracker().unwrap()),
        (64.0, 2)
    );
    let one = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
    assert_eq!(b.scale(&one).unwrap().item::<f32>().unwrap(), 64.0);
    assert_eq!(b.get_growth_tracker().unwrap(), 2);
    assert_eq!(
        (
            b.get_growth_factor(),
            b.get_backoff_factor(),
            b.get_growth_interval()
        ),
        (4.0, 0.25, 5)
    );
    let mut c = GradScaler::default();
    c.scale(&one).unwrap();
    c.load_state_dict(&state).unwrap();
    assert_eq!(c.state_dict().unwrap().len(), 5);
    assert_eq!(
        (c.get_scale().unwrap(), c.get_growth_tracker().unwrap()),
        (64.0, 2)
    );
    // Errors: empty, incomplete, unknown keys.
    assert!(message(c.load_state_dict(&[])).contains("The source state dict is empty"));
    assert!(c.load_state_dict(&state[..4]).is_err());
    let mut extra = state.clone();
    extra.push(("scale_bias".to_string(), one.clone()));
    assert!(c.load_state_dict(&extra).is_err());
}

#[test]
fn a_disabled_scaler_passes_through() {
    let p = param(&[1.0], Device::Cpu);
    let mut opt = SGD::new(
        vec![p.clone()],
        SgdConfig {
            lr: 1.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut s = GradScaler::with_config(GradScalerConfig {
        enabled: false,
        growth_factor: 0.0, // not checked when disabled, as in PyTorch
        ..Default::default()
    })
    .unwrap();
    assert!(!s.is_enabled());
    let loss = p.mul_scalar(2.0).unwrap().sum_all().unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.item::<f32>().unwrap(), 2.0);
    scaled.backward().unwrap();
    s.unscale_(&mut opt).unwrap();
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    assert_eq!(vals(&p), [-1.0]);
    assert_eq!(s.get_scale().unwrap(), 1.0);
    assert!(s.state_dict().unwrap().is_empty());
}

/// An optimizer that does not declare `supports_amp_scaling`: the scaler unscales, reads the
/// flag on the host and calls `step()` (PyTorch's generic path).
struct Generic(SGD);

impl Optimizer for Generic {
    fn step(&mut self) -> Result<()> {
        self.0.step()
    }
    fn params(&self) -> &[Tensor] {
        Optimizer::params(&self.0)
    }
    fn zero_grad(&mut self) -> Result<()> {
        self.0.zero_grad()
    }
    fn lr(&self) -> f64 {
        self.0.lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.0.set_lr(lr)
    }
    fn initial_lr(&self) -> Option<f64> {
        self.0.initial_lr()
    }
    fn set_initial_lr(&mut self, lr: f64) {
        self.0.set_initial_lr(lr)
    }
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> ember_nn::state_dict::StateDictResult<()> {
        self.0.load_state_dict(state)
    }
}

#[test]
fn other_optimizers_take_the_host_path() {
    let p = param(&[1.0, 1.0], Device::Cpu);
    let sgd = SGD::new(
        vec![p.clone()],
        SgdConfig {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    let mut opt = Generic(sgd);
    assert!(!opt.supports_amp_scaling());
    let mut s = GradScaler::with_config(config(16.0, 2000)).unwrap();
    scaled_backward(&mut s, &p, &[1.0, -2.0]);
    s.step(&mut opt).unwrap();
    assert_eq!(s.optimizer_state(&opt), OptState::Stepped);
    s.update().unwrap();
    assert_eq!(vals(&p), [0.5, 2.0]);
    opt.zero_grad().unwrap();
    scaled_backward(&mut s, &p, &[f32::NAN, 1.0]);
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    assert_eq!(vals(&p), [0.5, 2.0]);
    assert_eq!(s.get_scale().unwrap(), 8.0);
    // The trait's default step_scaled divides by the given scale.
    opt.zero_grad().unwrap();
    set_grad(&p, &[4.0, 4.0]);
    let scale = Tensor::scalar(4.0, DType::F32, Device::Cpu).unwrap();
    let clean = Tensor::scalar(0.0, DType::F32, Device::Cpu).unwrap();
    opt.step_scaled(Some(&scale), &clean).unwrap();
    assert_eq!(vals(&p), [0.0, 1.5]);
}

// ---------------------------------------------------------------------------------------------
// PyTorch's `grad_scaler` cases.

mod reference {
    use ember_core::{Device, Tensor};
    use safetensors::{Dtype, SafeTensors};
    use serde_json::Value;

    static MANIFEST: &str = include_str!("../fixtures/conformance_amp/manifest.json");
    static REFERENCE: &[u8] = include_bytes!("../fixtures/conformance_amp/reference.safetensors");

    pub struct Fixture {
        pub cases: Vec<Value>,
        tensors: SafeTensors<'static>,
    }

    impl Fixture {
        pub fn load() -> Fixture {
            let m: Value = serde_json::from_str(MANIFEST).expect("manifest.json is valid JSON");
            Fixture {
                cases: m["cases"].as_array().expect("cases").clone(),
                tensors: SafeTensors::deserialize(REFERENCE).expect("reference.safetensors is valid"),
            }
        }

        /// Tensor `<case>/<name>` (f32 or i64 in these cases) on `device`.
        pub fn tensor(&self, case: &str, name: &str, device: Device) -> Tensor {
            let key = format!("{case}/{name}");
            let v = self.tensors.tensor(&key).unwrap_or_else(|e| panic!("{key}: {e}"));
            let shape = v.shape().to_vec();
            let t = match v.dtype() {
                Dtype::F32 => Tensor::from_vec(
                    v.data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<f32>>(),
                    shape,
                    Device::Cpu,
                ),
                Dtype::I64 => Tensor::from_vec(
                    v.data()
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<i64>>(),
                    shape,
                    Device::Cpu,
                ),
                Dtype::I32 => Tensor::from_vec(
                    v.data()
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<i32>>(),
                    shape,
                    Device::Cpu,
                ),
                other => panic!("{key}: unexpected dtype {other:?}"),
            };
            t.unwrap().to(device).unwrap()
        }
    }
}

/// `cross_entropy(linear(x, w, b), y)` under float16 autocast, as the generator runs it.
fn autocast_f16_linear_loss(x: &Tensor, w: &Tensor, b: &Tensor, y: &Tensor) -> Result<Tensor> {
    let _ac = ember_core::amp::autocast(x.device().device_type(), DType::F16)?;
    let logits = ember_nn::functional::linear(x, w, Some(b))?;
    cross_entropy(&logits, y)
}

fn close(got: f64, want: f64, rtol: f64, atol: f64) -> bool {
    (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= atol + rtol * want.abs()
}

/// Runs one `grad_scaler` case on `device`; `Err` names the first step and value that differ.
fn run_case(
    fx: &reference::Fixture,
    case: &serde_json::Value,
    device: Device,
) -> std::result::Result<(), String> {
    let id = case["id"].as_str().unwrap();
    let kw = &case["kwargs"];
    let (rtol, atol) = (case["rtol"].as_f64().unwrap(), case["atol"].as_f64().unwrap());
    let params: Vec<Tensor> = (0..2)
        .map(|i| {
            fx.tensor(id, &format!("param{i}"), device)
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let lr = kw["optim"]["lr"].as_f64().unwrap();
    let mut opt: Box<dyn Optimizer> = match case["op"].as_str().unwrap() {
        "SGD" => Box::new(
            SGD::new(
                params.clone(),
                SgdConfig {
                    lr,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
        "Adam" => Box::new(
            Adam::new(
                params.clone(),
                AdamConfig {
                    lr,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
        other => return Err(format!("{id}: optimizer {other} not mapped")),
    };
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        init_scale: kw["init_scale"].as_f64().unwrap(),
        growth_factor: kw["growth_factor"].as_f64().unwrap(),
        backoff_factor: kw["backoff_factor"].as_f64().unwrap(),
        growth_interval: kw["growth_interval"].as_i64().unwrap(),
        enabled: true,
    })
    .unwrap();
    let clip = kw["clip"].as_f64();
    let steps = case["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 10);
    let e = |what: &str, err: ember_core::Error| format!("{id} on {device}: {what}: {err}");
    for (s, step) in steps.iter().enumerate() {
        let t = |name: &str| fx.tensor(id, &format!("step{s}_{name}"), device);
        let before: Vec<Vec<f32>> = params.iter().map(vals).collect();
        opt.zero_grad().map_err(|err| e("zero_grad", err))?;
        let loss = autocast_f16_linear_loss(&t("x"), &params[0], &params[1], &t("y"))
            .map_err(|err| e("forward", err))?;
        scaler
            .scale(&loss)
            .and_then(|l| l.backward())
            .map_err(|err| e("backward", err))?;
        if let Some(max_norm) = clip {
            scaler.unscale_(opt.as_mut()).map_err(|err| e("unscale_", err))?;
            clip_grad_norm_(&params, max_norm, 2.0).map_err(|err| e("clip", err))?;
        }
        scaler.step(opt.as_mut()).map_err(|err| e("step", err))?;
        scaler.update().map_err(|err| e("update", err))?;
        let checks = [
            (
                "loss",
                loss.item_f64().unwrap(),
                t("loss").to_vec_f64().unwrap()[0],
            ),
            (
                "scale",
                scaler.get_scale().unwrap(),
                t("scale").to_vec_f64().unwrap()[0],
            ),
            (
                "growth tracker",
                scaler.get_growth_tracker().unwrap() as f64,
                t("growth_tracker").to_vec_f64().unwrap()[0],
            ),
        ];
        for (what, got, want) in checks {
            if !close(got, want, rtol, atol) {
                return Err(format!(
                    "{id} on {device}, step {s}: {what} {got}, PyTorch {want}"
                ));
            }
        }
        let skipped = step["skipped"].as_bool().unwrap();
        for (i, p) in params.iter().enumerate() {
            let got = p.to_vec_f64().unwrap();
            let want = t(&format!("param{i}")).to_vec_f64().unwrap();
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                if !close(*g, *w, rtol, atol) {
                    return Err(format!(
                        "{id} on {device}, step {s}: param{i}[{k}] {g}, PyTorch {w}"
                    ));
                }
            }
            if skipped && vals(p) != before[i] {
                return Err(format!(
                    "{id} on {device}, step {s}: skipped, but param{i} changed"
                ));
            }
        }
    }
    Ok(())
}

fn grad_scaler_cases(fx: &reference::Fixture) -> Vec<&serde_json::Value> {
    let cases: Vec<&serde_json::Value> = fx.cases.iter().filter(|c| c["group"] == "grad_scaler").collect();
    assert_eq!(cases.len(), 3, "the fixture has three grad_scaler cases");
    cases
}

#[test]
fn pytorch_grad_scaler_cases_on_the_cpu() {
    let fx = reference::Fixture::load();
    for case in grad_scaler_cases(&fx) {
        run_case(&fx, case, Device::Cpu).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// On a GPU.

#[test]
#[ignore = "needs a CUDA device"]
fn pytorch_grad_scaler_cases_on_cuda() {
    let gpu = common::gpu();
    let fx = reference::Fixture::load();
    for case in grad_scaler_cases(&fx) {
        run_case(&fx, case, gpu).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn skipped_steps_leave_params_and_optimizer_state_untouched_on_cuda() {
    skipped_steps_leave_everything_untouched(common::gpu());
}

/// A scaled training step (scale, unscale_, clip_grad_norm_, step, update) with SGD, Adam and
/// AdamW never waits for the GPU: `cuda::host_sync_count` does not move. Steps with and without
/// an inf gradient, after a warm-up step (Adam moves its step counts to the device once).
#[test]
#[ignore = "needs a CUDA device"]
fn a_scaled_step_does_not_synchronize() {
    let gpu = common::gpu();
    let p = param(&[1.0, -2.0, 0.5, 4.0], gpu);
    for (name, mut opt) in optimizers(std::slice::from_ref(&p)) {
        if name == "sgd dampening" {
            continue; // its first step reads the flag on the host (see `optim::sgd_scaled`)
        }
        let mut s = GradScaler::with_config(config(1024.0, 2)).unwrap();
        for (i, g) in [
            [1.0f32, 2.0, 3.0, 4.0],
            [f32::INFINITY, 0.0, 1.0, 1.0],
            [0.5, 0.5, -1.0, 2.0],
        ]
        .iter()
        .enumerate()
        {
            opt.zero_grad().unwrap();
            let gt = Tensor::from_slice(g, [4], Device::Cpu).unwrap().to(gpu).unwrap();
            let loss = p.mul(&gt).unwrap().sum_all().unwrap();
            let before = ember_core::cuda::host_sync_count();
            let scaled = s.scale(&loss).unwrap();
            assert_eq!(
                ember_core::cuda::host_sync_count(),
                before,
                "{name}: scale() waited"
            );
            scaled.backward().unwrap();
            let before = ember_core::cuda::host_sync_count();
            s.unscale_(opt.as_mut()).unwrap();
            clip_grad_norm_(std::slice::from_ref(&p), 10.0, 2.0).unwrap();
            s.step(opt.as_mut()).unwrap();
            s.update().unwrap();
            let waits = ember_core::cuda::host_sync_count() - before;
            assert_eq!(waits, 0, "{name} step {i}: {waits} host synchronizations");
            // The same without unscale_ (the fused step divides by the scale).
            opt.zero_grad().unwrap();
            p.set_grad(Some(gt.mul_scalar(1024.0).unwrap())).unwrap();
            let before = ember_core::cuda::host_sync_count();
            s.step(opt.as_mut()).unwrap();
            s.update().unwrap();
            let waits = ember_core::cuda::host_sync_count() - before;
            assert_eq!(
                waits, 0,
                "{name} step {i} without unscale_: {waits} host synchronizations"
            );
            // The counter does count: reading the scale waits.
            let before = ember_core::cuda::host_sync_count();
            s.get_scale().unwrap();
            assert_eq!(ember_core::cuda::host_sync_count(), before + 1);
        }
    }
}

/// The scaler and the fused steps on CUDA agree with the CPU over many parameters of several
/// shapes (more than one launch's worth), skipped steps included.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_matches_cpu_over_many_parameters() {
    let gpu = common::gpu();
    let sizes: Vec<usize> = (0..60).map(|i| 1 + (i * 37) % 300).collect();
    let run = |device: Device, adam: bool| -> Vec<Vec<f64>> {
        let params: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v: Vec<f32> = common::values(n, i as u64).iter().map(|&x| x as f32).collect();
                param(&v, device)
            })
            .collect();
        let mut opt: Box<dyn Optimizer> = if adam {
            Box::new(Adam::new(params.clone(), AdamConfig::default()).unwrap())
        } else {
            Box::new(
                SGD::new(
                    params.clone(),
                    SgdConfig {
                        lr: 0.1,
                        momentum: 0.9,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        };
        let mut s = GradScaler::with_config(config(256.0, 2)).unwrap();
        for step in 0..5u64 {
            opt.zero_grad().unwrap();
            let mut loss = Tensor::scalar(0.0, DType::F32, device).unwrap();
            for (i, p) in params.iter().enumerate() {
                let mut g: Vec<f32> = common::values(p.numel(), 100 * step + i as u64)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                if step == 2 && i == 41 {
                    g[0] = f32::INFINITY;
                }
                let gt = Tensor::from_slice(&g, [g.len()], Device::Cpu)
                    .unwrap()
                    .to(device)
                    .unwrap();
                loss = loss.add(&p.mul(&gt).unwrap().sum_all().unwrap()).unwrap();
            }
            s.scale(&loss).unwrap().backward().unwrap();
            s.step(opt.as_mut()).unwrap();
            s.update().unwrap();
        }
        let mut out: Vec<Vec<f64>> = params.iter().map(|p| p.to_vec_f64().unwrap()).collect();
        out.push(vec![
            s.get_scale().unwrap(),
            s.get_growth_tracker().unwrap() as f64,
        ]);
        out
    };
    for adam in [false, true] {
        let (c, g) = (run(Device::Cpu, adam), run(gpu, adam));
        for (a, b) in g.iter().zip(&c) {
            common::assert_close_slice(a, b, 1e-5, 1e-6);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// PyTorch's `amp_train` cases: an MLP trained 20 Adam steps under autocast.

/// Runs one `amp_train` case on `device`: `Linear(64, 128) ReLU Linear(128, 10)` from the
/// case's initial weights, 20 steps of `zero_grad`, forward and cross-entropy under autocast,
/// backward, step, through a default GradScaler for float16 and without one for bfloat16
/// (PyTorch's `GradScaler(enabled=False)`), comparing every loss and the final weights.
fn run_train_case(
    fx: &reference::Fixture,
    case: &serde_json::Value,
    device: Device,
) -> std::result::Result<(), String> {
    let id = case["id"].as_str().unwrap();
    let kw = &case["kwargs"];
    let (rtol, atol) = (case["rtol"].as_f64().unwrap(), case["atol"].as_f64().unwrap());
    let dtype = match kw["autocast"].as_str() {
        Some("float16") => DType::F16,
        Some("bfloat16") => DType::BF16,
        other => return Err(format!("{id}: autocast {other:?} not mapped")),
    };
    let e = |what: &str, err: ember_core::Error| format!("{id} on {device}: {what}: {err}");
    let params: Vec<Tensor> = (0..4)
        .map(|i| {
            fx.tensor(id, &format!("param{i}"), device)
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let (x, y) = (fx.tensor(id, "x", device), fx.tensor(id, "y", device));
    let mut opt = Adam::new(
        params.clone(),
        AdamConfig {
            lr: kw["lr"].as_f64().unwrap(),
            ..Default::default()
        },
    )
    .map_err(|err| e("Adam", err))?;
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        enabled: kw["grad_scaler"].as_bool().unwrap(),
        ..Default::default()
    })
    .map_err(|err| e("GradScaler", err))?;
    let want_losses = fx.tensor(id, "losses", Device::Cpu).to_vec_f64().unwrap();
    for (s, want) in want_losses.iter().enumerate() {
        opt.zero_grad().map_err(|err| e("zero_grad", err))?;
        let loss = {
            let _ac =
                ember_core::amp::autocast(device.device_type(), dtype).map_err(|err| e("autocast", err))?;
            let h = ember_nn::functional::linear(&x, &params[0], Some(&params[1]))
                .and_then(|h| h.relu())
                .and_then(|h| ember_nn::functional::linear(&h, &params[2], Some(&params[3])))
                .map_err(|err| e("forward", err))?;
            cross_entropy(&h, &y).map_err(|err| e("loss", err))?
        };
        scaler
            .scale(&loss)
            .and_then(|l| l.backward())
            .map_err(|err| e("backward", err))?;
        scaler.step(&mut opt).map_err(|err| e("step", err))?;
        scaler.update().map_err(|err| e("update", err))?;
        let got = loss.item_f64().unwrap();
        if !close(got, *want, rtol, atol) {
            return Err(format!("{id} on {device}, step {s}: loss {got}, PyTorch {want}"));
        }
    }
    for (i, p) in params.iter().enumerate() {
        let want = fx
            .tensor(id, &format!("final_param{i}"), Device::Cpu)
            .to_vec_f64()
            .unwrap();
        let got = p.to_vec_f64().unwrap();
        let misses = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| !close(**g, **w, rtol, atol))
            .count();
        if misses > 0 {
            return Err(format!(
                "{id} on {device}: final param{i}: {misses} of {} values differ",
                want.len()
            ));
        }
    }
    Ok(())
}

fn amp_train_cases(fx: &reference::Fixture) -> Vec<&serde_json::Value> {
    let cases: Vec<&serde_json::Value> = fx.cases.iter().filter(|c| c["group"] == "amp_train").collect();
    assert_eq!(cases.len(), 2, "the fixture has two amp_train cases");
    cases
}

#[test]
fn pytorch_amp_train_cases_on_the_cpu() {
    let fx = reference::Fixture::load();
    for case in amp_train_cases(&fx) {
        run_train_case(&fx, case, Device::Cpu).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn pytorch_amp_train_cases_on_cuda() {
    let gpu = common::gpu();
    let fx = reference::Fixture::load();
    for case in amp_train_cases(&fx) {
        run_train_case(&fx, case, gpu).unwrap();
    }
}
