//! Fused multi-tensor optimizer steps (`ember_core::fused::{adam_, sgd_}`): several steps
//! against the composed per-tensor ops (the same sequence as ember-nn's `optim::adam` /
//! `optim::sgd`, bit for bit in f32 and f64), a hand-computed step, f16/bf16 against f32,
//! versions, errors; on a GPU, CPU against CUDA over many tensors of odd sizes.

use crate::common::{self, print_kernel_times, profile_steps, values};
use ember_core::fused::{
    adam_, adam_scaled_, can_fuse, can_fuse_reading, sgd_, AdamStep, AdamSteps, GradScaling, SgdStep,
};
use ember_core::{no_grad, DType, Device, Error, Result, Tensor};

fn tensor(n: usize, seed: u64, dtype: DType, device: Device) -> Tensor {
    Tensor::from_vec(values(n, seed), [n], Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to(device)
        .unwrap()
}

/// Parameters of the given sizes and one gradient per parameter per step.
fn problem(sizes: &[usize], steps: usize, dtype: DType, device: Device) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
    let params = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| tensor(n, i as u64, dtype, device))
        .collect();
    let grads = (0..steps)
        .map(|s| {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| tensor(n, 1000 * (s as u64 + 1) + i as u64, dtype, device))
                .collect()
        })
        .collect();
    (params, grads)
}

fn deep(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.deep_clone().unwrap()).collect()
}

fn zeros(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.zeros_like().unwrap()).collect()
}

/// The composed per-tensor Adam step of ember-nn's `optim::adam` (PyTorch's
/// `_single_tensor_adam`).
fn adam_reference(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    x: Option<&Tensor>,
    step: f64,
    c: &AdamStep,
) -> Result<()> {
    let _g = no_grad();
    let g = if c.maximize { g.neg()? } else { g.clone() };
    let g = if c.weight_decay == 0.0 {
        g
    } else if c.decoupled_weight_decay {
        p.mul_scalar_(1.0 - c.lr * c.weight_decay)?;
        g
    } else {
        g.add(&p.mul_scalar(c.weight_decay)?)?
    };
    m.lerp_(&g, 1.0 - c.beta1)?;
    v.mul_scalar_(c.beta2)?.addcmul_(&g, &g, 1.0 - c.beta2)?;
    let bc1 = 1.0 - c.beta1.powf(step);
    let bc2 = 1.0 - c.beta2.powf(step);
    let second = match x {
        Some(x) => x.maximum_(v)?,
        None => v.clone(),
    };
    let denom = second.sqrt()?.div_scalar(bc2.sqrt())?.add_scalar(c.eps)?;
    p.addcdiv_(m, &denom, -(c.lr / bc1))?;
    Ok(())
}

/// The composed per-tensor SGD step of ember-nn's `optim::sgd`; `buf` is `None` before the
/// first step with momentum and is filled then.
fn sgd_reference(p: &Tensor, g: &Tensor, buf: &mut Option<Tensor>, c: &SgdStep) -> Result<()> {
    let _g = no_grad();
    let mut g = if c.maximize { g.neg()? } else { g.clone() };
    if c.weight_decay != 0.0 {
        g = g.add(&p.mul_scalar(c.weight_decay)?)?;
    }
    if c.momentum != 0.0 {
        let b = match buf {
            None => {
                let b = g.deep_clone()?;
                *buf = Some(b.clone());
                b
            }
            Some(b) => {
                b.mul_scalar_(c.momentum)?;
                b.add_scaled_(&g, 1.0 - c.dampening)?
            }
        };
        g = if c.nesterov {
            g.add(&b.mul_scalar(c.momentum)?)?
        } else {
            b
        };
    }
    p.add_scaled_(&g, -c.lr)?;
    Ok(())
}

/// Asserts `a` and `b` agree elementwise within `tol` relative to `max(|b|, 1)` (0: exactly).
fn assert_same(what: &str, a: &[Tensor], b: &[Tensor], tol: f64) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
        for (j, (u, w)) in x.iter().zip(&y).enumerate() {
            assert!(
                (u - w).abs() <= tol * w.abs().max(1.0) || u == w || (u.is_nan() && w.is_nan()),
                "{what}: tensor {i} element {j}: {u} vs {w}"
            );
        }
    }
}

fn adam_configs() -> Vec<AdamStep> {
    let base = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: false,
    };
    let mut out = Vec::new();
    for amsgrad in [false, true] {
        for maximize in [false, true] {
            for (weight_decay, decoupled_weight_decay) in [(0.0, false), (0.1, false), (0.05, true)] {
                out.push(AdamStep {
                    amsgrad,
                    maximize,
                    weight_decay,
                    decoupled_weight_decay,
                    ..base
                });
            }
        }
    }
    // Other betas and eps.
    out.push(AdamStep {
        beta1: 0.5,
        beta2: 0.75,
        eps: 1e-3,
        lr: 0.3,
        ..base
    });
    out
}

/// Runs `steps` fused Adam steps; returns params and states. Parameter i starts at step `i % 3`
/// (so their bias corrections differ), as after missing gradients.
fn run_adam_fused(params: &[Tensor], grads: &[Vec<Tensor>], c: &AdamStep) -> [Vec<Tensor>; 4] {
    let (p, m, v, x) = (deep(params), zeros(params), zeros(params), zeros(params));
    let mut steps: Vec<f64> = (0..params.len()).map(|i| (i % 3) as f64).collect();
    for g in grads {
        steps.iter_mut().for_each(|s| *s += 1.0);
        let _g = no_grad();
        adam_(&p, g, &m, &v, c.amsgrad.then_some(&x[..]), &steps, c).unwrap();
    }
    [p, m, v, x]
}

fn run_adam_reference(params: &[Tensor], grads: &[Vec<Tensor>], c: &AdamStep) -> [Vec<Tensor>; 4] {
    let (p, m, v, x) = (deep(params), zeros(params), zeros(params), zeros(params));
    let mut steps: Vec<f64> = (0..params.len()).map(|i| (i % 3) as f64).collect();
    for g in grads {
        for i in 0..p.len() {
            steps[i] += 1.0;
            let xi = c.amsgrad.then(|| &x[i]);
            adam_reference(&p[i], &g[i], &m[i], &v[i], xi, steps[i], c).unwrap();
        }
    }
    [p, m, v, x]
}

#[test]
fn adam_matches_composed_ops_bit_for_bit() {
    // 40000 elements take the multi-threaded path; 0 is an empty parameter.
    let sizes = [1, 3, 7, 40000, 0, 129];
    for dtype in [DType::F32, DType::F64] {
        let (params, grads) = problem(&sizes, 3, dtype, Device::Cpu);
        for c in adam_configs() {
            let fused = run_adam_fused(&params, &grads, &c);
            let reference = run_adam_reference(&params, &grads, &c);
            for (k, name) in ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
                .iter()
                .enumerate()
            {
                assert_same(&format!("{dtype} {c:?} {name}"), &fused[k], &reference[k], 0.0);
            }
        }
    }
}

fn sgd_configs() -> Vec<SgdStep> {
    let base = SgdStep {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        maximize: false,
        first_step: false,
    };
    let mut out = Vec::new();
    for maximize in [false, true] {
        for weight_decay in [0.0, 0.01] {
            for (momentum, dampening, nesterov) in [
                (0.0, 0.0, false),
                (0.9, 0.0, false),
                (0.9, 0.3, false),
                (0.8, 0.0, true),
            ] {
                out.push(SgdStep {
                    maximize,
                    weight_decay,
                    momentum,
                    dampening,
                    nesterov,
                    ..base
                });
            }
        }
    }
    out
}

fn run_sgd_fused(params: &[Tensor], grads: &[Vec<Tensor>], c: &SgdStep) -> [Vec<Tensor>; 2] {
    let p = deep(params);
    // Buffers start as garbage: the first step must not read them.
    let b: Vec<Tensor> = params.iter().map(|t| t.full_like(123.0).unwrap()).collect();
    for (s, g) in grads.iter().enumerate() {
        let step = SgdStep {
            first_step: s == 0,
            ..*c
        };
        let _g = no_grad();
        sgd_(&p, g, (c.momentum != 0.0).then_some(&b[..]), &step).unwrap();
    }
    [p, b]
}

fn run_sgd_reference(params: &[Tensor], grads: &[Vec<Tensor>], c: &SgdStep) -> [Vec<Tensor>; 2] {
    let p = deep(params);
    let mut bufs: Vec<Option<Tensor>> = vec![None; p.len()];
    for g in grads {
        for i in 0..p.len() {
            sgd_reference(&p[i], &g[i], &mut bufs[i], c).unwrap();
        }
    }
    let b = bufs
        .into_iter()
        .zip(params)
        .map(|(b, t)| b.unwrap_or_else(|| t.full_like(123.0).unwrap()))
        .collect();
    [p, b]
}

#[test]
fn sgd_matches_composed_ops_bit_for_bit() {
    let sizes = [1, 3, 40000, 0, 65];
    for dtype in [DType::F32, DType::F64] {
        let (params, grads) = problem(&sizes, 3, dtype, Device::Cpu);
        for c in sgd_configs() {
            let fused = run_sgd_fused(&params, &grads, &c);
            let reference = run_sgd_reference(&params, &grads, &c);
            assert_same(&format!("{dtype} {c:?} param"), &fused[0], &reference[0], 0.0);
            assert_same(
                &format!("{dtype} {c:?} momentum_buffer"),
                &fused[1],
                &reference[1],
                0.0,
            );
        }
    }
}

#[test]
fn adam_hand_computed_first_step() {
    // p = 1, g = 0.5, lr 0.1: m = 0.05, v = 0.00025, bias corrections 0.1 and 0.001, so
    // denom = sqrt(0.00025) / sqrt(0.001) + 1e-8 = 0.5 + 1e-8 and p = 1 - 1.0 * 0.05 / denom.
    let p = Tensor::from_slice(&[1.0f64], [1], Device::Cpu).unwrap();
    let g = Tensor::from_slice(&[0.5f64], [1], Device::Cpu).unwrap();
    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
    let c = AdamStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: false,
    };
    adam_(&[p.clone()], &[g], &[m.clone()], &[v.clone()], None, &[1.0], &c).unwrap();
    let expected = 1.0 - 0.05 / (0.5 + 1e-8);
    assert!((p.item_f64().unwrap() - expected).abs() < 1e-12);
    assert!((m.item_f64().unwrap() - 0.05).abs() < 1e-15);
    assert!((v.item_f64().unwrap() - 0.00025).abs() < 1e-15);
}

#[test]
fn sgd_hand_computed_nesterov_steps() {
    // As ember-nn's unit test: step 1: buf = 1, g = 1.9, p = 0.81; step 2: buf = 2.9,
    // g = 2 + 0.9 * 2.9 = 4.61, p = 0.349.
    let p = Tensor::from_slice(&[1.0f64], [1], Device::Cpu).unwrap();
    let b = p.zeros_like().unwrap();
    let c = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 0.0,
        maximize: false,
        first_step: true,
    };
    for (k, g) in [1.0f64, 2.0].into_iter().enumerate() {
        let g = Tensor::from_slice(&[g], [1], Device::Cpu).unwrap();
        let step = SgdStep {
            first_step: k == 0,
            ..c
        };
        sgd_(&[p.clone()], &[g], Some(&[b.clone()]), &step).unwrap();
    }
    assert!((p.item_f64().unwrap() - 0.349).abs() < 1e-12);
    assert!((b.item_f64().unwrap() - 2.9).abs() < 1e-12);
}

#[test]
fn half_dtypes_follow_f32() {
    // f16/bf16 compute in f32 and round once: the result is the f32 result rounded, give or
    // take the rounding of the inputs and of the state between steps.
    let sizes = [5, 300];
    for dtype in [DType::F16, DType::BF16] {
        let (params, grads) = problem(&sizes, 2, dtype, Device::Cpu);
        let to32 =
            |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect() };
        let (p32, g32): (Vec<Tensor>, Vec<Vec<Tensor>>) =
            (to32(&params), grads.iter().map(|g| to32(g)).collect());
        let c = adam_configs()[4];
        let half = run_adam_fused(&params, &grads, &c);
        let full = run_adam_fused(&p32, &g32, &c);
        assert_eq!(half[0][0].dtype(), dtype);
        let tol = if dtype == DType::F16 { 4e-3 } else { 3e-2 };
        assert_same(&format!("{dtype} adam param"), &half[0], &full[0], tol);
        let c = sgd_configs()[6];
        let half = run_sgd_fused(&params, &grads, &c);
        let full = run_sgd_fused(&p32, &g32, &c);
        assert_same(&format!("{dtype} sgd param"), &half[0], &full[0], tol);
    }
}

#[test]
fn steps_bump_versions_of_written_tensors_only() {
    let (params, grads) = problem(&[4, 2], 1, DType::F32, Device::Cpu);
    let (m, v, x) = (zeros(&params), zeros(&params), zeros(&params));
    let before = |ts: &[Tensor]| -> Vec<u64> { ts.iter().map(|t| t.version()).collect() };
    let (vp, vg, vm, vv, vx) = (
        before(&params),
        before(&grads[0]),
        before(&m),
        before(&v),
        before(&x),
    );
    let c = AdamStep {
        amsgrad: true,
        ..adam_configs()[0]
    };
    adam_(&params, &grads[0], &m, &v, Some(&x), &[1.0, 1.0], &c).unwrap();
    for (old, ts) in [(vp, &params), (vm, &m), (vv, &v), (vx, &x)] {
        for (o, t) in old.iter().zip(ts.iter()) {
            assert!(t.version() > *o, "a written tensor kept its version");
        }
    }
    assert_eq!(before(&grads[0]), vg, "the gradients were not written");
    let b = zeros(&params);
    let vb = before(&b);
    let vp = before(&params);
    let c = SgdStep {
        momentum: 0.9,
        first_step: true,
        ..sgd_configs()[0]
    };
    sgd_(&params, &grads[0], Some(&b), &c).unwrap();
    assert!(params.iter().zip(&vp).all(|(t, o)| t.version() > *o));
    assert!(b.iter().zip(&vb).all(|(t, o)| t.version() > *o));
}

#[test]
fn error_cases() {
    let (params, grads) = problem(&[4, 2], 1, DType::F32, Device::Cpu);
    let g = &grads[0];
    let (m, v) = (zeros(&params), zeros(&params));
    let c = adam_configs()[0];
    let invalid = |r: Result<()>| matches!(r, Err(Error::InvalidArgument { .. }));
    // Length mismatches: gradients, states, steps.
    assert!(invalid(adam_(&params, &g[..1], &m, &v, None, &[1.0, 1.0], &c)));
    assert!(invalid(adam_(&params, g, &m[..1], &v, None, &[1.0, 1.0], &c)));
    assert!(invalid(adam_(&params, g, &m, &v, None, &[1.0], &c)));
    // amsgrad without its state; momentum without buffers.
    let ams = AdamStep { amsgrad: true, ..c };
    assert!(invalid(adam_(&params, g, &m, &v, None, &[1.0, 1.0], &ams)));
    let s = SgdStep {
        momentum: 0.9,
        ..sgd_configs()[0]
    };
    assert!(invalid(sgd_(&params, g, None, &s)));
    assert!(invalid(sgd_(&params, &g[..1], None, &sgd_configs()[0])));
    // dtype mismatch.
    let g64: Vec<Tensor> = g.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    assert!(matches!(
        adam_(&params, &g64, &m, &v, None, &[1.0, 1.0], &c),
        Err(Error::DTypeMismatch { .. })
    ));
    // Shape mismatch (gradients swapped).
    let swapped = [g[1].clone(), g[0].clone()];
    assert!(matches!(
        sgd_(&params, &swapped, None, &sgd_configs()[0]),
        Err(Error::ShapeMismatch { .. })
    ));
    // Integer parameters.
    let ints = [Tensor::zeros([2], DType::I64, Device::Cpu).unwrap()];
    assert!(matches!(
        sgd_(&ints, &ints.clone(), None, &sgd_configs()[0]),
        Err(Error::UnsupportedDType { .. })
    ));
    // Non-contiguous and shared storages.
    let square = tensor(9, 7, DType::F32, Device::Cpu).reshape(&[3, 3]).unwrap();
    let t = square.t().unwrap();
    assert!(invalid(sgd_(
        &[t.clone()],
        &[square.clone()],
        None,
        &sgd_configs()[0]
    )));
    assert!(invalid(sgd_(
        &[square.clone()],
        &[square.clone()],
        None,
        &sgd_configs()[0]
    )));
    assert!(invalid(sgd_(
        &[params[0].clone(), params[0].clone()],
        &[g[0].clone(), g[0].deep_clone().unwrap()],
        None,
        &sgd_configs()[0]
    )));
    // A parameter that requires grad, with grad mode on.
    let leaf = params[0].deep_clone().unwrap().requires_grad_(true).unwrap();
    assert!(matches!(
        sgd_(&[leaf.clone()], &g[..1], None, &sgd_configs()[0]),
        Err(Error::Autograd(_))
    ));
    {
        let _g = no_grad();
        sgd_(&[leaf], &g[..1], None, &sgd_configs()[0]).unwrap();
    }
    // Nothing to do.
    sgd_(&[], &[], None, &sgd_configs()[0]).unwrap();
}

#[test]
fn can_fuse_checks_the_group() {
    let (params, _) = problem(&[4, 2], 0, DType::F32, Device::Cpu);
    let refs: Vec<&Tensor> = params.iter().collect();
    assert!(can_fuse(&refs));
    assert!(can_fuse(&[]));
    assert!(!can_fuse(&[&params[0], &params[0]]));
    let f64p = params[0].to_dtype(DType::F64).unwrap();
    assert!(!can_fuse(&[&params[0], &f64p]));
    let square = tensor(4, 1, DType::F32, Device::Cpu).reshape(&[2, 2]).unwrap();
    assert!(!can_fuse(&[&square.t().unwrap()]));
    assert!(!can_fuse(
        &[&Tensor::zeros([2], DType::I32, Device::Cpu).unwrap()]
    ));
    // Read tensors may share a storage with each other, never with a written one.
    let flat = Tensor::zeros([6], DType::F32, Device::Cpu).unwrap();
    let (a, b) = (flat.narrow(0, 0, 4).unwrap(), flat.narrow(0, 4, 2).unwrap());
    assert!(can_fuse_reading(&refs, &[&a, &b]));
    assert!(!can_fuse(&[&refs[0], &refs[1], &a, &b]));
    assert!(!can_fuse_reading(&[&a], &[&b]));
    assert!(!can_fuse_reading(&[&refs[0]], &[&refs[0]]));
}

/// `ts` as views of one buffer, each `gap` elements after the one before (the layout of a
/// sharded model's gradients in its reduce-scatter buffer).
fn views_of_one(ts: &[Tensor], gap: usize) -> Vec<Tensor> {
    let total: usize = ts.iter().map(|t| t.numel() + gap).sum();
    let flat = Tensor::zeros([total], ts[0].dtype(), ts[0].device()).unwrap();
    let mut at = 0;
    ts.iter()
        .map(|t| {
            let view = flat.narrow(0, at, t.numel()).unwrap();
            view.copy_(t).unwrap();
            at += t.numel() + gap;
            view
        })
        .collect()
}

/// Note [Fused step preconditions]: gradients the step only reads may be views of one
/// storage; the results are the bits of separate gradients. Under a grad scale the step writes
/// them, and shared ones are refused, as shared parameters are.
fn steps_read_gradients_that_share_a_storage(device: Device, dtype: DType) {
    let sizes = [5, 4096 + 3, 1, 64, 0, 300];
    let (params, grads) = problem(&sizes, 2, dtype, device);
    for c in [adam_configs()[0], adam_configs()[10], adam_configs()[12]] {
        let separate = run_adam_fused(&params, &grads, &c);
        let shared: Vec<Vec<Tensor>> = grads.iter().map(|g| views_of_one(g, 3)).collect();
        assert!(shared[0][0].shares_storage_with(&shared[0][1]));
        let got = run_adam_fused(&params, &shared, &c);
        for k in 0..4 {
            assert_same(
                &format!("{device:?} {dtype} {c:?} list {k}"),
                &got[k],
                &separate[k],
                0.0,
            );
        }
    }
    for c in sgd_configs() {
        let separate = run_sgd_fused(&params, &grads, &c);
        let shared: Vec<Vec<Tensor>> = grads.iter().map(|g| views_of_one(g, 1)).collect();
        let got = run_sgd_fused(&params, &shared, &c);
        for k in 0..2 {
            assert_same(
                &format!("{device:?} {dtype} {c:?} list {k}"),
                &got[k],
                &separate[k],
                0.0,
            );
        }
    }
    let _g = no_grad();
    let g = views_of_one(&grads[0], 0);
    let (p, m, v) = (deep(&params), zeros(&params), zeros(&params));
    let steps = vec![1.0; sizes.len()];
    let scale = Tensor::full([1usize], 2.0, DType::F32, device).unwrap();
    let scaled = GradScaling {
        grad_scale: Some(&scale),
        found_inf: None,
    };
    let c = adam_configs()[0];
    let refused = adam_scaled_(&p, &g, &m, &v, None, AdamSteps::Host(&steps), &c, scaled, None);
    assert!(
        matches!(refused, Err(Error::InvalidArgument { .. })),
        "{refused:?}"
    );
    let shared_params = views_of_one(&params, 0);
    let refused = adam_(&shared_params, &grads[0], &m, &v, None, &steps, &c);
    assert!(
        matches!(refused, Err(Error::InvalidArgument { .. })),
        "{refused:?}"
    );
    // Nothing was written by the refused calls.
    assert_same("refused", &p, &params, 0.0);
}

#[test]
fn steps_on_the_cpu_read_gradients_that_share_a_storage() {
    for dtype in [DType::F32, DType::F64] {
        steps_read_gradients_that_share_a_storage(Device::Cpu, dtype);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_steps_read_gradients_that_share_a_storage() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        steps_read_gradients_that_share_a_storage(common::gpu(), dtype);
    }
}

// ---- GPU --------------------------------------------------------------------------------

/// 53 tensors (more than the 48 of one launch) of sizes around the chunk and ILP bounds.
const GPU_SIZES: [usize; 9] = [1, 3, 1000, 65537, 4096, 4097, 0, 255, 1025];

fn gpu_sizes() -> Vec<usize> {
    (0..53).map(|i| GPU_SIZES[i % GPU_SIZES.len()]).collect()
}

fn gpu_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => 1e-6,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_adam_matches_cpu_over_many_tensors() {
    let gpu = common::gpu();
    let sizes = gpu_sizes();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let (pc, gc) = problem(&sizes, 3, dtype, Device::Cpu);
        let (pg, gg) = problem(&sizes, 3, dtype, gpu);
        for c in [
            adam_configs()[0],
            adam_configs()[10],
            adam_configs()[8],
            adam_configs()[12],
        ] {
            let cpu = run_adam_fused(&pc, &gc, &c);
            let cuda = run_adam_fused(&pg, &gg, &c);
            assert_eq!(cuda[0][0].device(), gpu);
            for k in 0..4 {
                assert_same(
                    &format!("{dtype} {c:?} list {k}"),
                    &cuda[k],
                    &cpu[k],
                    gpu_tolerance(dtype),
                );
            }
        }
    }
}

/// The CUDA step's 16-byte path and its element-by-element fallback: operands at element offsets
/// that leave all, some or none of them 16-byte aligned (and lengths that are not whole vectors)
/// give the CPU's step.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_adam_matches_cpu_at_unaligned_offsets() {
    let gpu = common::gpu();
    let sizes = [2 * 4096 + 5, 4099, 37, 8192];
    // Element offsets of (param, grad, exp_avg, exp_avg_sq and max_exp_avg_sq).
    let offsets = [
        [0, 0, 0, 0],
        [1, 1, 1, 1],
        [0, 1, 0, 0],
        [0, 0, 0, 3],
        [8, 8, 8, 8],
    ];
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let (pc, gc) = problem(&sizes, 2, dtype, Device::Cpu);
        for c in [adam_configs()[0], adam_configs()[10]] {
            let cpu = run_adam_fused(&pc, &gc, &c);
            for off in offsets {
                // Each tensor in a storage of its own, `at` elements into it.
                let place = |t: &Tensor, at: usize| {
                    let n = t.numel();
                    let view = Tensor::zeros([n + at], dtype, gpu)
                        .unwrap()
                        .narrow(0, at, n)
                        .unwrap();
                    view.copy_(&t.to(gpu).unwrap()).unwrap();
                    view
                };
                let _g = no_grad();
                let p: Vec<Tensor> = pc.iter().map(|t| place(t, off[0])).collect();
                let m: Vec<Tensor> = pc
                    .iter()
                    .map(|t| place(&t.zeros_like().unwrap(), off[2]))
                    .collect();
                let v: Vec<Tensor> = pc
                    .iter()
                    .map(|t| place(&t.zeros_like().unwrap(), off[3]))
                    .collect();
                let x: Vec<Tensor> = pc
                    .iter()
                    .map(|t| place(&t.zeros_like().unwrap(), off[3]))
                    .collect();
                let mut steps: Vec<f64> = (0..sizes.len()).map(|i| (i % 3) as f64).collect();
                for g in &gc {
                    steps.iter_mut().for_each(|s| *s += 1.0);
                    let g: Vec<Tensor> = g.iter().map(|t| place(t, off[1])).collect();
                    adam_(&p, &g, &m, &v, c.amsgrad.then_some(&x[..]), &steps, &c).unwrap();
                }
                for (k, got) in [p, m, v, x].iter().enumerate() {
                    assert_same(
                        &format!("{dtype} {c:?} offsets {off:?} list {k}"),
                        got,
                        &cpu[k],
                        gpu_tolerance(dtype),
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sgd_matches_cpu_over_many_tensors() {
    let gpu = common::gpu();
    let sizes = gpu_sizes();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let (pc, gc) = problem(&sizes, 3, dtype, Device::Cpu);
        let (pg, gg) = problem(&sizes, 3, dtype, gpu);
        for c in sgd_configs() {
            let cpu = run_sgd_fused(&pc, &gc, &c);
            let cuda = run_sgd_fused(&pg, &gg, &c);
            for k in 0..2 {
                assert_same(
                    &format!("{dtype} {c:?} list {k}"),
                    &cuda[k],
                    &cpu[k],
                    gpu_tolerance(dtype),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_adam_matches_composed_ops() {
    // The fused kernel against the per-tensor CUDA ops, f32.
    let gpu = common::gpu();
    let (params, grads) = problem(&[3, 70000, 17], 3, DType::F32, gpu);
    for c in adam_configs() {
        let fused = run_adam_fused(&params, &grads, &c);
        let reference = run_adam_reference(&params, &grads, &c);
        for k in 0..4 {
            assert_same(&format!("{c:?} list {k}"), &fused[k], &reference[k], 1e-5);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_fused_steps_reject_mixed_devices() {
    let gpu = common::gpu();
    let (pc, gc) = problem(&[4], 1, DType::F32, Device::Cpu);
    let gg: Vec<Tensor> = gc[0].iter().map(|t| t.to(gpu).unwrap()).collect();
    assert!(matches!(
        sgd_(&pc, &gg, None, &sgd_configs()[0]),
        Err(Error::DeviceMismatch { .. })
    ));
    assert!(!can_fuse(&[&pc[0], &gg[0]]));
}

/// A `[rows, cols]` f32 gradient on GPU 0 whose row blocks a side stream writes from
/// `values`, each after a long product so that the host has queued what follows well before,
/// handed on as arriving in those blocks (Note [Arrivals in row blocks]).
fn arriving_late(values: &Tensor, blocks: usize) -> Tensor {
    use ember_core::cuda::{self, RowBlockEvent};
    let (rows, cols) = (values.dims()[0], values.dims()[1]);
    let g = Tensor::zeros([rows, cols], DType::F32, values.device()).unwrap();
    let side = cuda::Stream::new_on(0).unwrap();
    side.wait_stream(&cuda::current_stream(0).unwrap()).unwrap();
    let mut events = Vec::new();
    {
        let _on_side = cuda::stream(&side);
        let a = Tensor::ones([4096usize, 4096], DType::F32, values.device()).unwrap();
        for r in cuda::row_block_ranges(rows, blocks) {
            a.matmul(&a).unwrap();
            g.narrow(0, r.start, r.len())
                .unwrap()
                .copy_(&values.narrow(0, r.start, r.len()).unwrap())
                .unwrap();
            events.push(RowBlockEvent {
                rows: r,
                event: side.record_event().unwrap(),
            });
        }
    }
    cuda::arriving_in_row_blocks(&g, events).unwrap();
    g
}

/// Note [Arrivals in row blocks]: a gradient arriving late in row blocks is read only after
/// its rows are written: the fused Adam step (block by block) and SGD give, bit for bit, the
/// step from the complete gradient; a reduction through the dispatch point and a host read
/// see every row. An arrival that is not a dense 2-D GPU tensor is a typed error.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_steps_and_reads_wait_for_a_gradient_arriving_in_row_blocks() {
    let gpu = common::gpu();
    let (rows, cols) = (1000usize, 300usize);
    let values = tensor(rows * cols, 7, DType::F32, gpu)
        .view(&[rows as isize, cols as isize])
        .unwrap();
    let params = || {
        vec![
            tensor(rows * cols, 1, DType::F32, gpu)
                .view(&[rows as isize, cols as isize])
                .unwrap(),
            tensor(33, 2, DType::F32, gpu),
        ]
    };
    let small_grad = tensor(33, 3, DType::F32, gpu);
    for c in [adam_configs()[0], adam_configs()[8]] {
        let (got, expected) = (params(), params());
        let state = |ps: &[Tensor]| (zeros(ps), zeros(ps), zeros(ps));
        let ((m1, v1, x1), (m2, v2, x2)) = (state(&got), state(&expected));
        let _g = no_grad();
        let arriving = arriving_late(&values, 4);
        adam_(
            &got,
            &[arriving, small_grad.clone()],
            &m1,
            &v1,
            Some(&x1),
            &[1.0, 1.0],
            &c,
        )
        .unwrap();
        adam_(
            &expected,
            &[values.clone(), small_grad.clone()],
            &m2,
            &v2,
            Some(&x2),
            &[1.0, 1.0],
            &c,
        )
        .unwrap();
        assert_same(&format!("adam {c:?}: parameters"), &got, &expected, 0.0);
        assert_same(&format!("adam {c:?}: exp_avg"), &m1, &m2, 0.0);
    }
    for c in [sgd_configs()[0]] {
        let (got, expected) = (params(), params());
        let _g = no_grad();
        let buf = |ps: &[Tensor]| zeros(ps);
        sgd_(
            &got,
            &[arriving_late(&values, 3), small_grad.clone()],
            Some(&buf(&got)),
            &c,
        )
        .unwrap();
        sgd_(
            &expected,
            &[values.clone(), small_grad.clone()],
            Some(&buf(&expected)),
            &c,
        )
        .unwrap();
        assert_same(&format!("sgd {c:?}"), &got, &expected, 0.0);
    }
    let sum = arriving_late(&values, 4)
        .sum_all()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()[0];
    let expected = values.sum_all().unwrap().to_vec::<f32>().unwrap()[0];
    assert_eq!(sum, expected, "a sum through the dispatch point sees every row");
    // The list ops clip_grad_norm_ and GradScaler run on gradients wait for them too.
    let norm = |t: &Tensor| {
        ember_core::fused::foreach_norm(std::slice::from_ref(t), 2.0)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    };
    assert_eq!(
        norm(&arriving_late(&values, 4)),
        norm(&values),
        "foreach_norm sees every row"
    );
    let half = Tensor::full([1], 0.5, DType::F32, gpu).unwrap();
    let (scaled, late) = (values.deep_clone().unwrap(), arriving_late(&values, 4));
    ember_core::fused::foreach_mul_(std::slice::from_ref(&scaled), &half).unwrap();
    ember_core::fused::foreach_mul_(std::slice::from_ref(&late), &half).unwrap();
    assert_eq!(
        late.to_vec::<f32>().unwrap(),
        scaled.to_vec::<f32>().unwrap(),
        "foreach_mul_ scales every row after it arrived"
    );
    let (found, late) = (
        Tensor::zeros([1], DType::F32, gpu).unwrap(),
        arriving_late(&values, 4),
    );
    ember_core::amp_scaling::non_finite_check_and_unscale_(std::slice::from_ref(&late), &found, &half)
        .unwrap();
    assert_eq!(
        late.to_vec::<f32>().unwrap(),
        scaled.to_vec::<f32>().unwrap(),
        "unscaling scales every row after it arrived"
    );
    assert_eq!(
        arriving_late(&values, 2).to_vec::<f32>().unwrap(),
        values.to_vec::<f32>().unwrap(),
        "a host read sees every row"
    );
    let flat = tensor(10, 4, DType::F32, gpu);
    assert!(matches!(
        ember_core::cuda::arriving_in_row_blocks(&flat, Vec::new()),
        Err(Error::InvalidArgument { .. })
    ));
}

/// GPT-2 124M's parameter shapes (148 tensors, 124.4 M elements; the LM head is tied to wte).
fn gpt2_sizes() -> Vec<usize> {
    let (c, v, t) = (768usize, 50257usize, 1024usize);
    let mut sizes = vec![v * c, t * c];
    for _ in 0..12 {
        sizes.extend([
            c,
            c,
            c * 3 * c,
            3 * c,
            c * c,
            c,
            c,
            c,
            c * 4 * c,
            4 * c,
            4 * c * c,
            c,
        ]);
    }
    sizes.extend([c, c]);
    sizes
}

/// The GPU time of the fused AdamW step of GPT-2 124M in f32 (issue 37), device step counts
/// and host step counts, from the profiler's kernel records (`--nocapture` prints them): the
/// step moves 28 bytes an element (reads p, g, m, v; writes p, m, v).
#[test]
#[ignore = "needs a CUDA device; prints kernel times (--nocapture)"]
fn cuda_fused_adamw_gpt2_kernel_time() {
    use ember_core::fused::{adam_scaled_, AdamSteps, GradScaling};
    let dev = common::gpu();
    let sizes = gpt2_sizes();
    let total: usize = sizes.iter().sum();
    let randn = |n: usize| Tensor::randn([n], DType::F32, dev).unwrap();
    let p: Vec<Tensor> = sizes.iter().map(|&n| randn(n)).collect();
    let g: Vec<Tensor> = sizes
        .iter()
        .map(|&n| randn(n).mul_scalar(1e-2).unwrap())
        .collect();
    let (m, v) = (zeros(&p), zeros(&p));
    let counts: Vec<Tensor> = sizes
        .iter()
        .map(|_| Tensor::scalar(0.0, DType::F32, dev).unwrap())
        .collect();
    let c = AdamStep {
        lr: 6e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: true,
    };
    let _g = no_grad();
    for device_steps in [true, false] {
        let mut host = 0.0;
        let step = || {
            host += 1.0;
            let hs = vec![host; sizes.len()];
            let steps = if device_steps {
                AdamSteps::Device(&counts)
            } else {
                AdamSteps::Host(&hs)
            };
            adam_scaled_(&p, &g, &m, &v, None, steps, &c, GradScaling::default(), None).unwrap();
        };
        let steps = 10;
        let prof = profile_steps(3, steps, step);
        let launches = print_kernel_times(&prof, &format!("adamw gpt2 device_steps={device_steps}"), steps);
        // GPT-2's 148 parameters in 4 multi-tensor launches a step (at least: the trace also
        // holds what tests running beside this one launch).
        assert!(
            launches.get("adam_f32").copied().unwrap_or(0) >= 4 * steps,
            "{launches:?}"
        );
        let us = prof
            .trace()
            .unwrap()
            .gpu_activities()
            .iter()
            .filter(|a| a.name.starts_with("adam_"))
            .map(|a| a.duration_ns as f64 / 1e3)
            .sum::<f64>()
            / steps as f64;
        let tbs = 28.0 * total as f64 / (us * 1e-6) / 1e12;
        println!("KT adamw gpt2 device_steps={device_steps}: adam kernels {us:.1} us a step = {tbs:.2} TB/s ({total} params)");
    }
}

/// Note [Cast twins]: a float32 parameter cast to bf16 since its last step gets its bf16 twin
/// written by the fused Adam step on a GPU; the next cast takes it (the CPU's cast of the new
/// values, no cast kernel), and a step after no cast writes none.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_adam_writes_the_bf16_twin_a_cast_asked_for_per_cupti() {
    let dev = common::gpu();
    let on = |v: Vec<f64>| {
        Tensor::from_slice(&v, [333, 77], Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to(dev)
            .unwrap()
    };
    let p = on(values(333 * 77, 1));
    let g = on(values(333 * 77, 2).iter().map(|v| v - 0.5).collect());
    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
    let c = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: true,
    };
    let casts = |names: &[String]| names.iter().filter(|k| k.starts_with("cast_")).count();
    let step = |n: f64| {
        adam_(
            &[p.clone()],
            &[g.clone()],
            &[m.clone()],
            &[v.clone()],
            None,
            &[n],
            &c,
        )
        .unwrap()
    };
    let mut cast = None;
    // No cast yet: the step writes no twin.
    step(1.0);
    let names = common::kernels_of(0, || cast = Some(p.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 1, "{names:?}");
    // That cast asked for one.
    step(2.0);
    let names = common::kernels_of(0, || cast = Some(p.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 0, "the step's twin was not taken: {names:?}");
    assert_eq!(cast.take().unwrap().to_vec_f64().unwrap(), common::cpu_bf16(&p));
    // An in-place write after the step ends the twin.
    step(3.0);
    p.mul_scalar_(0.5).unwrap();
    let names = common::kernels_of(0, || cast = Some(p.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 1, "{names:?}");
    assert_eq!(cast.take().unwrap().to_vec_f64().unwrap(), common::cpu_bf16(&p));
}

/// `foreach_norm` against float64 norms of the same values: order 2 and infinity, tensors of
/// many sizes (an empty one, ones of one chunk and of many), more than one launch's 128
/// tensors, and a NaN and an inf that must come through; then `foreach_mul_` scales them all.
fn foreach_norm_matches_float64(dev: Device, dtype: DType) {
    let sizes: Vec<usize> = (0..150)
        .map(|i| [0, 1, 7, 4096, 4097, 20_000, 33][i % 7] + i)
        .collect();
    let hosts: Vec<Vec<f64>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            values(n, 300 + i as u64)
                .iter()
                .map(|v| (v - 0.5) * 4.0)
                .collect()
        })
        .collect();
    let tensors: Vec<Tensor> = hosts
        .iter()
        .map(|h| {
            Tensor::from_slice(h, [h.len()], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap()
        })
        .collect();
    // The values as the tensors hold them (rounded to `dtype`).
    let held: Vec<Vec<f64>> = tensors.iter().map(|t| t.to_vec_f64().unwrap()).collect();
    let tol = |x: f64| 1e-5 * x.abs() + 1e-6;
    for ord in [2.0, f64::INFINITY] {
        let got = ember_core::fused::foreach_norm(&tensors, ord).unwrap();
        assert_eq!((got.dims(), got.dtype()), (&[tensors.len()][..], DType::F32));
        let got = got.to_vec_f64().unwrap();
        for (k, h) in held.iter().enumerate() {
            let want = if ord == 2.0 {
                h.iter().map(|v| v * v).sum::<f64>().sqrt()
            } else {
                h.iter().fold(0.0f64, |m, v| m.max(v.abs()))
            };
            assert!(
                (got[k] - want).abs() <= tol(want),
                "{dtype:?} ord {ord} tensor {k}: {} vs {want}",
                got[k]
            );
        }
    }
    // A NaN makes its tensor's norm NaN, an inf makes it inf; the others are untouched.
    let special = [
        Tensor::from_slice(&[1.0, f64::NAN, 2.0], [3], Device::Cpu).unwrap(),
        Tensor::from_slice(&[f64::INFINITY, -1.0], [2], Device::Cpu).unwrap(),
        Tensor::from_slice(&[3.0, 4.0], [2], Device::Cpu).unwrap(),
    ]
    .map(|t| t.to_dtype(dtype).unwrap().to(dev).unwrap());
    for ord in [2.0, f64::INFINITY] {
        let n = ember_core::fused::foreach_norm(&special, ord)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        assert!(n[0].is_nan() && n[1] == f64::INFINITY, "ord {ord}: {n:?}");
        assert_eq!(n[2], if ord == 2.0 { 5.0 } else { 4.0 });
    }
    // foreach_mul_ by a device scalar: every element times 0.5, rounded to the dtype once
    // (exact but for f16's subnormals).
    let half = Tensor::from_slice(&[0.5f32], [1], dev).unwrap();
    ember_core::fused::foreach_mul_(&tensors, &half).unwrap();
    for (t, h) in tensors.iter().zip(&held) {
        let want: Vec<f64> = h.iter().map(|v| v * 0.5).collect();
        let want = Tensor::from_slice(&want, [want.len()], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        assert_eq!(t.to_vec_f64().unwrap(), want, "{dtype:?}");
    }
}

#[test]
fn foreach_norm_on_the_cpu_matches_float64() {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        foreach_norm_matches_float64(Device::Cpu, dtype);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_foreach_norm_matches_float64_per_cupti() {
    let dev = common::gpu();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        foreach_norm_matches_float64(dev, dtype);
    }
    // A few launches for 150 tensors: two for the norms (two lists of at most 128), and the
    // zeros of the output; no kernel per tensor.
    let ts: Vec<Tensor> = (0..150)
        .map(|i| Tensor::ones([100 + i], DType::F32, dev).unwrap())
        .collect();
    let names = common::kernels_of(1, || {
        ember_core::fused::foreach_norm(&ts, 2.0).unwrap();
    });
    assert!(names.len() <= 6, "{names:?}");
    assert!(
        names.iter().any(|k| k.starts_with("foreach_norm_partials")),
        "{names:?}"
    );
}

#[test]
fn foreach_norm_refuses_what_it_cannot_do() {
    let a = Tensor::ones([3], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::ones([3], DType::F64, Device::Cpu).unwrap();
    let i = Tensor::ones([3], DType::I64, Device::Cpu).unwrap();
    let f = ember_core::fused::foreach_norm;
    assert!(f(&[], 2.0).unwrap_err().to_string().contains("at least one"));
    assert!(f(&[a.clone()], 1.0)
        .unwrap_err()
        .to_string()
        .contains("f64::INFINITY"));
    assert!(f(&[a.clone(), b], 2.0)
        .unwrap_err()
        .to_string()
        .contains("one floating-point dtype"));
    assert!(f(&[i], 2.0).is_err());
    assert_eq!(
        f(&[a], 2.0).unwrap().to_vec_f64().unwrap(),
        [3f64.sqrt() as f32 as f64]
    );
}
