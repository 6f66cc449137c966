//! Issue 11: the fused optimizers on CUDA keep the lr and Adam's step counts on the device
//! (Note [Learning rate on the device] in `optim`), so an LR scheduler's `set_lr` reaches the
//! next step through the device tensor, and neither steps nor schedulers wait for the GPU.

use crate::common;
use ember_core::{DType, Device, Tensor};
use ember_nn::optim::{Adam, AdamConfig, AdamW, LRScheduler, Optimizer, SgdConfig, StepLR, SGD};

fn param(values: &[f32], device: Device) -> Tensor {
    Tensor::from_slice(values, [values.len()], Device::Cpu)
        .unwrap()
        .to(device)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

fn optimizers(params: &[Tensor]) -> Vec<(&'static str, Box<dyn Optimizer>)> {
    let p = params.to_vec();
    vec![
        (
            "sgd",
            Box::new(
                SGD::new(
                    p.clone(),
                    SgdConfig {
                        lr: 0.1,
                        momentum: 0.9,
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
                    p.clone(),
                    AdamConfig {
                        lr: 0.05,
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
                    p,
                    AdamConfig {
                        lr: 0.05,
                        ..AdamConfig::adamw()
                    },
                )
                .unwrap(),
            ),
        ),
    ]
}

/// Six steps under a StepLR halving the lr every two steps, on `device`; the parameters after,
/// and the host waits of the steps and scheduler calls.
fn run(device: Device, which: usize) -> (Vec<Vec<f64>>, u64) {
    let params = vec![
        param(&[1.0, -2.0, 0.5, 4.0], device),
        param(
            &(0..5000).map(|i| (i as f32 * 0.01).sin()).collect::<Vec<_>>(),
            device,
        ),
    ];
    let (_, mut opt) = optimizers(&params).into_iter().nth(which).unwrap();
    let mut sched = StepLR::new(opt.as_mut(), 2, 0.5).unwrap();
    let mut waits = 0;
    for step in 0..6u64 {
        for (i, p) in params.iter().enumerate() {
            let g: Vec<f32> = common::values(p.numel(), 10 * step + i as u64)
                .iter()
                .map(|&x| x as f32)
                .collect();
            p.set_grad(Some(
                Tensor::from_slice(&g, [g.len()], Device::Cpu)
                    .unwrap()
                    .to(device)
                    .unwrap(),
            ))
            .unwrap();
        }
        let before = ember_core::cuda::host_sync_count();
        opt.step().unwrap();
        sched.step(opt.as_mut());
        waits += ember_core::cuda::host_sync_count() - before;
    }
    assert!((opt.lr() - opt.initial_lr().unwrap() * 0.125).abs() < 1e-15);
    (params.iter().map(|p| p.to_vec_f64().unwrap()).collect(), waits)
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_optimizers_follow_the_lr_scheduler_without_waiting() {
    let gpu = common::gpu();
    for (which, name) in ["sgd", "adam", "adamw"].into_iter().enumerate() {
        let (cpu, _) = run(Device::Cpu, which);
        let (cuda, waits) = run(gpu, which);
        assert_eq!(waits, 0, "{name}: steps or set_lr waited for the GPU");
        for (a, b) in cuda.iter().zip(&cpu) {
            common::assert_close_slice(a, b, 1e-6, 1e-7);
        }
        if name == "sgd" {
            assert_eq!(cuda, cpu, "sgd: the device lr changed bits");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn adam_keeps_cuda_step_counts_on_the_device() {
    let gpu = common::gpu();
    let p = param(&[1.0, 2.0], gpu);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    for _ in 0..3 {
        p.set_grad(Some(Tensor::full([2], 0.5, DType::F32, gpu).unwrap()))
            .unwrap();
        opt.step().unwrap();
    }
    let state = opt.state_dict();
    let step = &state.iter().find(|(k, _)| k == "state.0.step").unwrap().1;
    // The state dict holds a CPU copy (Note [State dict format]).
    assert_eq!(step.device(), Device::Cpu);
    assert_eq!(step.to_vec::<f32>().unwrap(), [3.0]);
    // Loading puts the count back on the parameter's device at the next step.
    let mut again = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    again.load_state_dict(&state).unwrap();
    p.set_grad(Some(Tensor::full([2], 0.5, DType::F32, gpu).unwrap()))
        .unwrap();
    again.step().unwrap();
    let step = again
        .state_dict()
        .into_iter()
        .find(|(k, _)| k == "state.0.step")
        .unwrap()
        .1;
    assert_eq!(step.to_vec::<f32>().unwrap(), [4.0]);
}
