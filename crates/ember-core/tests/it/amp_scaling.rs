//! GradScaler's device side (`ember_core::amp_scaling`) and the fused steps under gradient
//! scaling (`ember_core::fused::{adam_scaled_, sgd_scaled_}`): the unscale and inf check over
//! dtypes and views, the scale update rule, skipped steps that write nothing, device step
//! counts against host ones; on a GPU, CUDA against the CPU.

use crate::common::{self, values};
use ember_core::amp_scaling::{non_finite_check_and_unscale_, update_scale_};
use ember_core::fused::{adam_, adam_scaled_, sgd_, sgd_scaled_, AdamStep, AdamSteps, GradScaling, SgdStep};
use ember_core::{DType, Device, Error, Tensor};

fn f32s(v: &[f32], device: Device) -> Tensor {
    Tensor::from_slice(v, [v.len()], device).unwrap()
}

fn scalar(v: f64, dtype: DType, device: Device) -> Tensor {
    Tensor::scalar(v, dtype, device).unwrap()
}

fn unscale_over_dtypes_and_views(device: Device) {
    let found = scalar(0.0, DType::F32, device);
    let inv = scalar(0.25, DType::F32, device);
    let a = f32s(&[4.0, -8.0, 1.0], device);
    let b = Tensor::from_slice(&[2.0f64, 6.0], [2], device).unwrap();
    let h = f32s(&[12.0, 0.5], device).to_dtype(DType::F16).unwrap();
    let bf = f32s(&[-4.0], device).to_dtype(DType::BF16).unwrap();
    // A transposed matrix (dense, in place) and a column slice (not dense: through a copy).
    let m = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], device).unwrap();
    let mt = m.t().unwrap();
    let buf = Tensor::from_slice(&[8.0f32, 16.0, 32.0, 64.0], [2, 2], device).unwrap();
    let col = buf.narrow(1, 1, 1).unwrap();
    let empty = Tensor::zeros([0], DType::F32, device).unwrap();
    let grads = [a.clone(), b.clone(), h.clone(), bf.clone(), mt, col, empty];
    non_finite_check_and_unscale_(&grads, &found, &inv).unwrap();
    assert_eq!(found.item::<f32>().unwrap(), 0.0);
    assert_eq!(a.to_vec::<f32>().unwrap(), [1.0, -2.0, 0.25]);
    assert_eq!(b.to_vec::<f64>().unwrap(), [0.5, 1.5]);
    assert_eq!(h.to_vec_f64().unwrap(), [3.0, 0.125]);
    assert_eq!(bf.to_vec_f64().unwrap(), [-1.0]);
    assert_eq!(m.to_vec::<f32>().unwrap(), [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]);
    assert_eq!(buf.to_vec::<f32>().unwrap(), [8.0, 4.0, 32.0, 16.0]);
    // Two views of one buffer, one holding an inf: found, and the flag is never cleared.
    let flat = f32s(&[1.0, 2.0, f32::INFINITY, 4.0], device);
    let (lo, hi) = (flat.narrow(0, 0, 2).unwrap(), flat.narrow(0, 2, 2).unwrap());
    let inv_half = scalar(0.5, DType::F32, device);
    non_finite_check_and_unscale_(&[lo, hi], &found, &inv_half).unwrap();
    assert_eq!(found.item::<f32>().unwrap(), 1.0);
    assert_eq!(flat.to_vec::<f32>().unwrap(), [0.5, 1.0, f32::INFINITY, 2.0]);
    non_finite_check_and_unscale_(&[f32s(&[1.0], device)], &found, &inv_half).unwrap();
    assert_eq!(found.item::<f32>().unwrap(), 1.0);
    // NaN in f16, with an inverse scale of 1 (only the check): values untouched.
    let found = scalar(0.0, DType::F32, device);
    let one = scalar(1.0, DType::F32, device);
    let h = f32s(&[f32::NAN, 3.0], device).to_dtype(DType::F16).unwrap();
    non_finite_check_and_unscale_(std::slice::from_ref(&h), &found, &one).unwrap();
    assert_eq!(found.item::<f32>().unwrap(), 1.0);
    assert_eq!(h.to_vec_f64().unwrap()[1], 3.0);
}

#[test]
fn unscale_and_check_over_dtypes_and_views() {
    unscale_over_dtypes_and_views(Device::Cpu);
}

#[test]
fn unscale_errors() {
    let d = Device::Cpu;
    let (found, inv) = (scalar(0.0, DType::F32, d), scalar(1.0, DType::F32, d));
    let ints = Tensor::zeros([2], DType::I64, d).unwrap();
    assert!(matches!(
        non_finite_check_and_unscale_(&[ints], &found, &inv),
        Err(Error::UnsupportedDType { .. })
    ));
    let f64_flag = scalar(0.0, DType::F64, d);
    assert!(non_finite_check_and_unscale_(&[], &f64_flag, &inv).is_err());
    let two = f32s(&[0.0, 0.0], d);
    assert!(non_finite_check_and_unscale_(&[], &two, &inv).is_err());
    // A gradient that requires grad is not written while grad mode is on.
    let g = f32s(&[1.0], d).requires_grad_(true).unwrap();
    assert!(matches!(
        non_finite_check_and_unscale_(std::slice::from_ref(&g), &found, &inv),
        Err(Error::Autograd(_))
    ));
    // The flag must not be one of the gradients.
    assert!(non_finite_check_and_unscale_(std::slice::from_ref(&found), &found, &inv).is_err());
}

fn scale_update_rule(device: Device) {
    let scale = scalar(1024.0, DType::F32, device);
    let tracker = scalar(0.0, DType::I32, device);
    let clean = scalar(0.0, DType::F32, device);
    let inf = scalar(1.0, DType::F32, device);
    let nan = scalar(f64::NAN, DType::F32, device);
    let read = || (scale.item::<f32>().unwrap(), tracker.item::<i32>().unwrap());
    update_scale_(&scale, &tracker, &clean, 2.0, 0.5, 2).unwrap();
    assert_eq!(read(), (1024.0, 1));
    update_scale_(&scale, &tracker, &clean, 2.0, 0.5, 2).unwrap();
    assert_eq!(read(), (2048.0, 0));
    update_scale_(&scale, &tracker, &inf, 2.0, 0.5, 2).unwrap();
    assert_eq!(read(), (1024.0, 0));
    update_scale_(&scale, &tracker, &clean, 2.0, 0.5, 2).unwrap();
    update_scale_(&scale, &tracker, &nan, 2.0, 0.5, 2).unwrap();
    assert_eq!(read(), (512.0, 0));
    // Factors are applied in f64 and rounded to f32; growth past f32's range is refused.
    update_scale_(&scale, &tracker, &inf, 2.0, 0.1, 2).unwrap();
    assert_eq!(read().0, (512.0f64 * 0.1) as f32);
    let big = scalar(f32::MAX as f64, DType::F32, device);
    update_scale_(&big, &tracker, &clean, 2.0, 0.5, 1).unwrap();
    assert_eq!(
        (big.item::<f32>().unwrap(), tracker.item::<i32>().unwrap()),
        (f32::MAX, 0)
    );
}

#[test]
fn scale_update_follows_pytorch_rule() {
    scale_update_rule(Device::Cpu);
    let d = Device::Cpu;
    let (s, t, f) = (
        scalar(1.0, DType::F32, d),
        scalar(0.0, DType::I32, d),
        scalar(0.0, DType::F32, d),
    );
    assert!(update_scale_(&s, &scalar(0.0, DType::I64, d), &f, 2.0, 0.5, 1).is_err());
    assert!(update_scale_(&s, &t, &f, 2.0, 0.5, 1 << 40).is_err());
    assert!(
        update_scale_(&s, &t, &s, 2.0, 0.5, 1).is_err(),
        "found_inf aliasing the scale"
    );
}

fn adam_cfg() -> AdamStep {
    AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        amsgrad: true,
        maximize: false,
        decoupled_weight_decay: true,
    }
}

fn sgd_cfg(first_step: bool) -> SgdStep {
    SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 0.01,
        maximize: false,
        first_step,
    }
}

fn tensors(sizes: &[usize], seed: u64, dtype: DType, device: Device) -> Vec<Tensor> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            Tensor::from_vec(values(n, seed + i as u64), [n], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(device)
                .unwrap()
        })
        .collect()
}

fn all_values(ts: &[Tensor]) -> Vec<Vec<f64>> {
    ts.iter().map(|t| t.to_vec_f64().unwrap()).collect()
}

/// Scaled steps give the bits of plain steps on pre-divided gradients (the scale a power of
/// two), write the unscaled gradients back, and a found-inf step writes nothing; device step
/// counts give the bits of host ones (on the CPU) and do not advance on a skipped step.
fn scaled_steps_match_plain_steps(device: Device, dtype: DType) {
    let sizes = [5, 1, 300];
    let scale = scalar(64.0, DType::F32, device);
    let (clean, inf) = (scalar(0.0, DType::F32, device), scalar(1.0, DType::F32, device));
    // Adam: plain (host steps) vs scaled (device steps), two steps with a skipped one between.
    let (p_a, p_b) = (
        tensors(&sizes, 1, dtype, device),
        tensors(&sizes, 1, dtype, device),
    );
    let zeros = |p: &[Tensor]| -> Vec<Tensor> { p.iter().map(|t| t.zeros_like().unwrap()).collect() };
    let (m_a, v_a, x_a) = (zeros(&p_a), zeros(&p_a), zeros(&p_a));
    let (m_b, v_b, x_b) = (zeros(&p_b), zeros(&p_b), zeros(&p_b));
    let steps_b: Vec<Tensor> = sizes.iter().map(|_| scalar(0.0, DType::F32, device)).collect();
    let mut host_step = 0.0;
    for (k, found) in [&clean, &inf, &clean].into_iter().enumerate() {
        let g = tensors(&sizes, 100 + k as u64, dtype, device);
        let g_scaled: Vec<Tensor> = g.iter().map(|t| t.mul_scalar(64.0).unwrap()).collect();
        let before = (
            all_values(&p_b),
            all_values(&m_b),
            all_values(&x_b),
            all_values(&steps_b),
        );
        adam_scaled_(
            &p_b,
            &g_scaled,
            &m_b,
            &v_b,
            Some(&x_b),
            AdamSteps::Device(&steps_b),
            &adam_cfg(),
            GradScaling {
                grad_scale: Some(&scale),
                found_inf: Some(found),
            },
            None,
        )
        .unwrap();
        if found.item::<f32>().unwrap() != 0.0 {
            let after = (
                all_values(&p_b),
                all_values(&m_b),
                all_values(&x_b),
                all_values(&steps_b),
            );
            assert_eq!(before, after, "a skipped Adam step wrote something");
            continue;
        }
        host_step += 1.0;
        adam_(
            &p_a,
            &g,
            &m_a,
            &v_a,
            Some(&x_a),
            &vec![host_step; sizes.len()],
            &adam_cfg(),
        )
        .unwrap();
        assert_eq!(
            all_values(&g_scaled),
            all_values(&g),
            "gradients written back unscaled"
        );
        let tol = if device == Device::Cpu { 0.0 } else { 1e-6 };
        for (a, b) in all_values(&p_a).iter().zip(all_values(&p_b)) {
            common::assert_close_slice(&b, a, tol, tol);
        }
        assert!(steps_b
            .iter()
            .all(|s| s.item::<f32>().unwrap() == host_step as f32));
    }
    // SGD: a skipped first step with zero-filled buffers, then scaled steps equal plain ones.
    let (p_a, p_b) = (
        tensors(&sizes, 7, dtype, device),
        tensors(&sizes, 7, dtype, device),
    );
    let b_a: Vec<Tensor> = p_a.iter().map(|t| t.empty_like().unwrap()).collect();
    let b_b: Vec<Tensor> = p_b.iter().map(|t| t.zeros_like().unwrap()).collect();
    let g = tensors(&sizes, 300, dtype, device);
    let g_scaled: Vec<Tensor> = g.iter().map(|t| t.mul_scalar(64.0).unwrap()).collect();
    let before = (all_values(&p_b), all_values(&b_b));
    let skip = GradScaling {
        grad_scale: Some(&scale),
        found_inf: Some(&inf),
    };
    sgd_scaled_(&p_b, &g_scaled, Some(&b_b), &sgd_cfg(false), skip, None).unwrap();
    assert_eq!(
        before,
        (all_values(&p_b), all_values(&b_b)),
        "a skipped SGD step wrote something"
    );
    for (k, first) in [true, false].into_iter().enumerate() {
        let g = tensors(&sizes, 400 + k as u64, dtype, device);
        let g_scaled: Vec<Tensor> = g.iter().map(|t| t.mul_scalar(64.0).unwrap()).collect();
        sgd_(&p_a, &g, Some(&b_a), &sgd_cfg(first)).unwrap();
        let on = GradScaling {
            grad_scale: Some(&scale),
            found_inf: Some(&clean),
        };
        sgd_scaled_(&p_b, &g_scaled, Some(&b_b), &sgd_cfg(false), on, None).unwrap();
        assert_eq!(all_values(&p_a), all_values(&p_b), "SGD step {k}");
        assert_eq!(all_values(&b_a), all_values(&b_b), "SGD buffers after step {k}");
    }
}

#[test]
fn scaled_fused_steps_on_the_cpu() {
    for dtype in [DType::F32, DType::F64] {
        scaled_steps_match_plain_steps(Device::Cpu, dtype);
    }
}

#[test]
fn scaled_fused_step_errors() {
    let d = Device::Cpu;
    let p = [f32s(&[1.0], d)];
    let g = [f32s(&[1.0], d)];
    let (m, v) = ([f32s(&[0.0], d)], [f32s(&[0.0], d)]);
    let found = scalar(0.0, DType::F32, d);
    let cfg = AdamStep {
        amsgrad: false,
        ..adam_cfg()
    };
    let with_found = GradScaling {
        grad_scale: None,
        found_inf: Some(&found),
    };
    // Host step counts cannot be skipped on the device.
    let err = adam_scaled_(
        &p,
        &g,
        &m,
        &v,
        None,
        AdamSteps::Host(&[1.0]),
        &cfg,
        with_found,
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("AdamSteps::Device"), "{err}");
    // Step counts are one-element f32 tensors; flags too.
    let bad_steps = [scalar(0.0, DType::F64, d)];
    assert!(adam_scaled_(
        &p,
        &g,
        &m,
        &v,
        None,
        AdamSteps::Device(&bad_steps),
        &cfg,
        with_found,
        None
    )
    .is_err());
    let steps = [scalar(0.0, DType::F32, d)];
    let bad_flag = scalar(0.0, DType::F64, d);
    let bad = GradScaling {
        grad_scale: None,
        found_inf: Some(&bad_flag),
    };
    assert!(adam_scaled_(&p, &g, &m, &v, None, AdamSteps::Device(&steps), &cfg, bad, None).is_err());
    assert!(sgd_scaled_(&p, &g, None, &sgd_cfg(false), bad, None).is_err());
    // The flag sharing a storage with a written tensor is refused.
    let alias = GradScaling {
        grad_scale: None,
        found_inf: Some(&steps[0]),
    };
    assert!(adam_scaled_(&p, &g, &m, &v, None, AdamSteps::Device(&steps), &cfg, alias, None).is_err());
    // A device lr is a one-element f64 tensor on the parameters' device.
    let lr32 = scalar(0.1, DType::F32, d);
    let no_scaling = GradScaling::default();
    assert!(adam_scaled_(
        &p,
        &g,
        &m,
        &v,
        None,
        AdamSteps::Device(&steps),
        &cfg,
        no_scaling,
        Some(&lr32)
    )
    .is_err());
    assert!(sgd_scaled_(&p, &g, None, &sgd_cfg(false), no_scaling, Some(&lr32)).is_err());
    // Plain calls are unchanged.
    adam_scaled_(
        &p,
        &g,
        &m,
        &v,
        None,
        AdamSteps::Device(&steps),
        &cfg,
        GradScaling::default(),
        None,
    )
    .unwrap();
    assert_eq!(steps[0].item::<f32>().unwrap(), 1.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_unscale_and_update_scale() {
    let gpu = common::gpu();
    unscale_over_dtypes_and_views(gpu);
    scale_update_rule(gpu);
    // Many tensors of odd sizes (several launches), against the CPU.
    let sizes: Vec<usize> = (0..300).map(|i| 1 + (i * 7919) % 9000).collect();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for poison in [None, Some(211usize)] {
            let run = |device: Device| {
                let g = tensors(&sizes, 5, dtype, device);
                if let Some(i) = poison {
                    let _g = ember_core::no_grad();
                    g[i].narrow(0, g[i].numel() - 1, 1)
                        .unwrap()
                        .fill_(f64::NAN)
                        .unwrap();
                }
                let found = scalar(0.0, DType::F32, device);
                let inv = scalar(1.0 / 3.0, DType::F32, device);
                non_finite_check_and_unscale_(&g, &found, &inv).unwrap();
                (all_values(&g), found.item::<f32>().unwrap())
            };
            let (c, g) = (run(Device::Cpu), run(gpu));
            assert_eq!(c.1, g.1, "{dtype} found_inf");
            assert_eq!(g.1, poison.is_some() as i32 as f32);
            for (a, b) in g.0.iter().zip(&c.0) {
                let same = a
                    .iter()
                    .zip(b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
                assert!(same, "{dtype}: CUDA and CPU unscale differ");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_scaled_fused_steps() {
    let gpu = common::gpu();
    for dtype in [DType::F32, DType::F64] {
        scaled_steps_match_plain_steps(gpu, dtype);
    }
    // Device step counts on CUDA against the CPU, over more than one launch of tensors.
    let sizes: Vec<usize> = (0..70).map(|i| 1 + (i * 131) % 5000).collect();
    let run = |device: Device| {
        let p = tensors(&sizes, 1, DType::F32, device);
        let zeros = |p: &[Tensor]| -> Vec<Tensor> { p.iter().map(|t| t.zeros_like().unwrap()).collect() };
        let (m, v, x) = (zeros(&p), zeros(&p), zeros(&p));
        let steps: Vec<Tensor> = sizes.iter().map(|_| scalar(0.0, DType::F32, device)).collect();
        let scale = scalar(8.0, DType::F32, device);
        for k in 0..4u64 {
            let g = tensors(&sizes, 50 + k, DType::F32, device);
            let found = scalar((k == 2) as i32 as f64, DType::F32, device);
            let s = GradScaling {
                grad_scale: Some(&scale),
                found_inf: Some(&found),
            };
            adam_scaled_(
                &p,
                &g,
                &m,
                &v,
                Some(&x),
                AdamSteps::Device(&steps),
                &adam_cfg(),
                s,
                None,
            )
            .unwrap();
        }
        (all_values(&p), all_values(&steps))
    };
    let (c, g) = (run(Device::Cpu), run(gpu));
    assert!(g.1.iter().all(|s| s == &[3.0]));
    for (a, b) in g.0.iter().zip(&c.0) {
        common::assert_close_slice(a, b, 1e-6, 1e-7);
    }
}
