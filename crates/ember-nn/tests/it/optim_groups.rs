//! Issue 37: parameter groups (Note [Param groups] in `optim/param_group.rs`). One optimizer of
//! two groups steps as two optimizers of one group each over the same parameters, on every
//! device, eagerly and under a grad scale, with one fused call per group.

use crate::common;
use ember_core::{DType, Device, Tensor};
use ember_nn::optim::{Adam, AdamConfig, AdamW, LRScheduler, Optimizer, ParamGroup, SgdConfig, StepLR, SGD};

/// A weight matrix and a bias-like vector (group 0, with decay) and a norm-like vector
/// (group 1), f32 on `device`, each with its own values.
fn params(device: Device) -> Vec<Tensor> {
    [vec![3usize, 4], vec![4], vec![5]]
        .into_iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = common::values(n, 100 + i as u64)
                .iter()
                .map(|&x| x as f32)
                .collect();
            Tensor::from_vec(v, shape, Device::Cpu)
                .unwrap()
                .to(device)
                .unwrap()
                .requires_grad_(true)
                .unwrap()
        })
        .collect()
}

fn copies(ps: &[Tensor]) -> Vec<Tensor> {
    ps.iter()
        .map(|p| p.detach().deep_clone().unwrap().requires_grad_(true).unwrap())
        .collect()
}

/// Sets the step-`t` gradient of each of `ps` (the same values for every copy), times `scale`.
fn set_grads(ps: &[Tensor], t: u64, scale: f32) {
    for (i, p) in ps.iter().enumerate() {
        let g: Vec<f32> = common::values(p.numel(), 10 * t + i as u64)
            .iter()
            .map(|&x| x as f32 * scale)
            .collect();
        let g = Tensor::from_vec(g, p.shape().clone(), Device::Cpu)
            .unwrap()
            .to(p.device())
            .unwrap();
        p.set_grad(Some(g)).unwrap();
    }
}

type Make = fn(&[Tensor]) -> Box<dyn Optimizer>;

/// One optimizer's case: one of two groups over `ps` (the first two parameters, then the
/// third), two optimizers of one group each with the same hyperparameters, and one group of
/// the defaults only.
struct Case {
    name: &'static str,
    grouped: Make,
    split: Make,
    defaults_only: Make,
}

const ADAM: AdamConfig = AdamConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.1,
    amsgrad: true,
    maximize: false,
    fused: None,
};

/// What group 1 of the Adam cases sets over [`ADAM`].
const ADAM_GROUP1: AdamConfig = AdamConfig {
    lr: 0.03,
    weight_decay: 0.0,
    betas: (0.8, 0.95),
    eps: 1e-6,
    ..ADAM
};

fn adam_group1(ps: &[Tensor]) -> ParamGroup {
    ParamGroup::new(ps[2..].to_vec())
        .lr(0.03)
        .weight_decay(0.0)
        .betas((0.8, 0.95))
        .eps(1e-6)
}

const SGD_DEFAULTS: SgdConfig = SgdConfig {
    lr: 0.1,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.01,
    nesterov: false,
    maximize: false,
};

/// What group 1 of the SGD case sets over [`SGD_DEFAULTS`].
const SGD_GROUP1: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.5,
    nesterov: true,
    weight_decay: 0.0,
    ..SGD_DEFAULTS
};

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "AdamW",
            grouped: |ps| {
                let g0 = ParamGroup::new(ps[..2].to_vec());
                Box::new(AdamW::with_groups(vec![g0, adam_group1(ps)], ADAM).unwrap())
            },
            split: |ps| {
                Box::new(Split(
                    vec![
                        Box::new(AdamW::new(ps[..2].to_vec(), ADAM).unwrap()),
                        Box::new(AdamW::new(ps[2..].to_vec(), ADAM_GROUP1).unwrap()),
                    ],
                    ps.to_vec(),
                ))
            },
            defaults_only: |ps| Box::new(AdamW::new(ps.to_vec(), ADAM).unwrap()),
        },
        Case {
            name: "Adam",
            grouped: |ps| {
                let g0 = ParamGroup::new(ps[..2].to_vec());
                Box::new(Adam::with_groups(vec![g0, adam_group1(ps)], ADAM).unwrap())
            },
            split: |ps| {
                Box::new(Split(
                    vec![
                        Box::new(Adam::new(ps[..2].to_vec(), ADAM).unwrap()),
                        Box::new(Adam::new(ps[2..].to_vec(), ADAM_GROUP1).unwrap()),
                    ],
                    ps.to_vec(),
                ))
            },
            defaults_only: |ps| Box::new(Adam::new(ps.to_vec(), ADAM).unwrap()),
        },
        Case {
            name: "SGD",
            grouped: |ps| {
                let g1 = ParamGroup::new(ps[2..].to_vec())
                    .lr(0.05)
                    .momentum(0.5)
                    .nesterov(true)
                    .weight_decay(0.0);
                let g0 = ParamGroup::new(ps[..2].to_vec());
                Box::new(SGD::with_groups(vec![g0, g1], SGD_DEFAULTS).unwrap())
            },
            split: |ps| {
                Box::new(Split(
                    vec![
                        Box::new(SGD::new(ps[..2].to_vec(), SGD_DEFAULTS).unwrap()),
                        Box::new(SGD::new(ps[2..].to_vec(), SGD_GROUP1).unwrap()),
                    ],
                    ps.to_vec(),
                ))
            },
            defaults_only: |ps| Box::new(SGD::new(ps.to_vec(), SGD_DEFAULTS).unwrap()),
        },
    ]
}

/// Several optimizers stepped as one, over `ps`; group `g` is optimizer `g`.
struct Split(Vec<Box<dyn Optimizer>>, Vec<Tensor>);

impl Split {
    fn step_each(
        &mut self,
        f: impl Fn(&mut dyn Optimizer) -> ember_core::Result<()>,
    ) -> ember_core::Result<()> {
        self.0.iter_mut().try_for_each(|o| f(o.as_mut()))
    }
}

impl Optimizer for Split {
    fn step(&mut self) -> ember_core::Result<()> {
        self.step_each(|o| o.step())
    }
    fn params(&self) -> &[Tensor] {
        &self.1
    }
    fn supports_amp_scaling(&self) -> bool {
        true
    }
    fn step_scaled(&mut self, grad_scale: Option<&Tensor>, found_inf: &Tensor) -> ember_core::Result<()> {
        self.step_each(|o| o.step_scaled(grad_scale, found_inf))
    }
    fn zero_grad(&mut self) -> ember_core::Result<()> {
        self.step_each(|o| o.zero_grad())
    }
    fn lr(&self) -> f64 {
        self.0[0].lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.0.iter_mut().for_each(|o| o.set_lr(lr))
    }
    fn initial_lr(&self) -> Option<f64> {
        self.0[0].initial_lr()
    }
    fn set_initial_lr(&mut self, lr: f64) {
        self.0.iter_mut().for_each(|o| o.set_initial_lr(lr))
    }
    fn num_param_groups(&self) -> usize {
        self.0.len()
    }
    fn group_lr(&self, group: usize) -> f64 {
        self.0[group].lr()
    }
    fn set_group_lr(&mut self, group: usize, lr: f64) {
        self.0[group].set_lr(lr)
    }
    fn group_initial_lr(&self, group: usize) -> Option<f64> {
        self.0[group].initial_lr()
    }
    fn set_group_initial_lr(&mut self, group: usize, lr: f64) {
        self.0[group].set_initial_lr(lr)
    }
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        unreachable!("these tests save no state")
    }
    fn load_state_dict(&mut self, _: &[(String, Tensor)]) -> ember_nn::state_dict::StateDictResult<()> {
        unreachable!("these tests load no state")
    }
}

fn bits(ps: &[Tensor]) -> Vec<Vec<f32>> {
    ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

/// Six steps of `opt` over `ps` under a StepLR halving every group's lr every two steps; with
/// `scaled`, through `step_scaled` with gradients 1024 times larger (a power of two, so the
/// division is exact), and a seventh step whose found-inf flag is set.
fn train(opt: &mut dyn Optimizer, ps: &[Tensor], scaled: bool) {
    let device = ps[0].device();
    let mut sched = StepLR::new(opt, 2, 0.5).unwrap();
    let scale = Tensor::scalar(1024.0, DType::F32, device).unwrap();
    let (zero, one) = (
        Tensor::scalar(0.0, DType::F32, device).unwrap(),
        Tensor::scalar(1.0, DType::F32, device).unwrap(),
    );
    for t in 0..6 {
        if scaled {
            set_grads(ps, t, 1024.0);
            opt.step_scaled(Some(&scale), &zero).unwrap();
        } else {
            set_grads(ps, t, 1.0);
            opt.step().unwrap();
        }
        sched.step(opt);
    }
    if scaled {
        let before = bits(ps);
        set_grads(ps, 6, f32::INFINITY);
        opt.step_scaled(Some(&scale), &one).unwrap();
        assert_eq!(
            bits(ps),
            before,
            "a step with found_inf set changed the parameters"
        );
    }
}

#[test]
fn two_groups_step_as_two_optimizers() {
    for device in common::devices() {
        for case in cases() {
            for scaled in [false, true] {
                let what = format!("{} on {device}, scaled {scaled}", case.name);
                let ps = params(device);
                let qs = copies(&ps);
                let mut a = (case.grouped)(&ps);
                let mut b = (case.split)(&qs);
                train(a.as_mut(), &ps, scaled);
                train(b.as_mut(), &qs, scaled);
                assert_eq!(a.group_lrs(), b.group_lrs(), "{what}");
                assert_eq!(bits(&ps), bits(&qs), "{what}");
                // Group 1's own hyperparameters made the difference: under the defaults its
                // parameter ends elsewhere, and group 0's where it did.
                let rs = params(device);
                train((case.defaults_only)(&rs).as_mut(), &rs, scaled);
                assert_eq!(bits(&rs[..2]), bits(&ps[..2]), "{what}");
                assert_ne!(
                    bits(&rs[2..]),
                    bits(&ps[2..]),
                    "{what}: group 1's settings had no effect"
                );
            }
        }
    }
}

/// The parameters of a GPT-like model's two groups in f32 (decay: the matrices; no decay: the
/// vectors), with shapes no other test uses, so that their fused calls can be told apart.
fn gpt_like(device: Device) -> (Vec<Tensor>, Vec<Tensor>) {
    let make = |shape: &[usize]| {
        Tensor::zeros(shape.to_vec(), DType::F32, device)
            .unwrap()
            .requires_grad_(true)
            .unwrap()
    };
    (
        vec![make(&[37, 41]), make(&[41, 37])],
        vec![make(&[41]), make(&[37]), make(&[43])],
    )
}

/// The input shapes of each `_fused_adam_` call of one step of `opt` over `ps`.
fn fused_calls(opt: &mut dyn Optimizer, ps: &[Tensor]) -> Vec<Vec<Vec<usize>>> {
    use ember_core::profiler::{self, ProfilerActivity};
    for p in ps {
        p.set_grad(Some(p.ones_like().unwrap())).unwrap();
    }
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu])
        .record_shapes(true)
        .start()
        .unwrap();
    opt.step().unwrap();
    prof.stop().unwrap();
    let ours: Vec<Vec<usize>> = ps.iter().map(|p| p.shape().dims().to_vec()).collect();
    prof.events()
        .iter()
        .filter(|e| e.name == "_fused_adam_")
        .filter_map(|e| e.input_shapes.clone())
        .filter(|shapes| shapes.iter().all(|s| ours.contains(s)))
        .collect()
}

#[test]
fn one_fused_call_per_group() {
    // nanoGPT's configure_optimizers: one AdamW, decay on the matrices, none on the vectors.
    // Its step is one fused call per group (on one device and dtype), and one optimizer over
    // all the parameters is one call, as before groups.
    for device in common::devices() {
        let (decay, no_decay) = gpt_like(device);
        let mut opt = AdamW::with_groups(
            vec![
                ParamGroup::new(decay.clone()),
                ParamGroup::new(no_decay.clone()).weight_decay(0.0),
            ],
            AdamConfig::adamw(),
        )
        .unwrap();
        let all: Vec<Tensor> = decay.iter().chain(&no_decay).cloned().collect();
        let calls = fused_calls(&mut opt, &all);
        assert_eq!(
            calls,
            [
                vec![vec![37, 41], vec![41, 37]],
                vec![vec![41], vec![37], vec![43]]
            ],
            "on {device}"
        );
        let mut single = AdamW::new(all.clone(), AdamConfig::adamw()).unwrap();
        assert_eq!(fused_calls(&mut single, &all).len(), 1, "on {device}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_groups_follow_the_lr_scheduler() {
    // Each group's lr lives in its own device tensor (Note [Learning rate on the device]): a
    // scheduler's per-group set_group_lr reaches the next step, and the result is the CPU's.
    let gpu = common::gpu();
    for case in cases() {
        let run = |device: Device| {
            let ps = params(device);
            let mut opt = (case.grouped)(&ps);
            train(opt.as_mut(), &ps, true);
            bits(&ps)
        };
        let (cpu, cuda) = (run(Device::Cpu), run(gpu));
        for (a, b) in cuda.iter().zip(&cpu) {
            let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
            let b: Vec<f64> = b.iter().map(|&x| x as f64).collect();
            common::assert_close_slice(&a, &b, 1e-5, 1e-6);
        }
    }
}
