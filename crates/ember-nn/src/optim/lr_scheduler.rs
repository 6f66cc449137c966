//! Learning-rate schedulers (`torch.optim.lr_scheduler`): [`StepLR`], [`CosineAnnealingLR`],
//! [`LinearLR`], and the combinators [`SequentialLR`] and [`ChainedScheduler`].
//!
//! As in PyTorch, a scheduler is built on an optimizer and immediately sets the epoch-0 lr;
//! each `step` advances one epoch and writes the new lr into the optimizer. The optimizer is
//! passed to `new` and `step` rather than held, so it stays usable between steps:
//! ```text
//! let mut sched = StepLR::new(&mut opt, 30, 0.1)?;
//! for epoch in 0..100 { train(&mut opt)?; sched.step(&mut opt); }
//! ```
//! Each step uses PyTorch's chainable (recursive) `get_lr`, which reads the optimizer's
//! current lr, so values agree with PyTorch bit for bit and schedulers compose through
//! [`ChainedScheduler`]; [`EpochScheduler::step_to`] uses the closed form (`_get_closed_form_lr`),
//! as SequentialLR does at a milestone.
//!
//! Every scheduler scales each param group of the optimizer separately, as PyTorch's do: a
//! group's `base_lr` is its own `initial_lr`, recorded by the first scheduler built on the
//! optimizer (PyTorch's `group.setdefault("initial_lr", group["lr"])`), and each step reads and
//! writes the group's lr ([`Optimizer::group_lr`], [`Optimizer::set_group_lr`]): groups with
//! lrs 1e-3 and 1e-4 under a StepLR stay a factor 10 apart. [`LRScheduler::get_last_lr`]
//! is group 0's value, [`LRScheduler::get_last_lrs`] every group's (PyTorch's list). Groups
//! added to the optimizer after the scheduler was built are not scheduled (PyTorch's
//! `zip(param_groups, lrs)` leaves them out too).

use super::Optimizer;
use ember_core::{Error, Result};
use std::f64::consts::PI;

/// A learning-rate scheduler (`torch.optim.lr_scheduler.LRScheduler`) over every param group
/// of an optimizer.
pub trait LRScheduler {
    /// Advances one epoch and writes each group's new lr into `optimizer` (call after
    /// `optimizer.step()`).
    fn step(&mut self, optimizer: &mut dyn Optimizer);

    /// The lr of group 0 set by the latest step (or by `new`).
    fn get_last_lr(&self) -> f64;

    /// The lr of every group set by the latest step (or by `new`): PyTorch's `get_last_lr()`.
    /// The default is [`LRScheduler::get_last_lr`] alone, for a scheduler of one group.
    fn get_last_lrs(&self) -> Vec<f64> {
        vec![self.get_last_lr()]
    }
}

/// A scheduler with an epoch counter and a closed form: what [`SequentialLR`] sequences.
pub trait EpochScheduler: LRScheduler {
    /// The index of the last epoch (0 right after `new`).
    fn last_epoch(&self) -> i64;

    /// Jumps to `epoch` and sets the lr from the closed form (PyTorch's `_update_lr(epoch)`).
    fn step_to(&mut self, optimizer: &mut dyn Optimizer, epoch: i64);

    /// Moves the epoch counter back by one without touching the lr (SequentialLR's "undo").
    fn rewind(&mut self);

    /// Resets the step count and steps once, as at construction (PyTorch's `_initial_step`).
    fn initial_step(&mut self, optimizer: &mut dyn Optimizer);
}

/// The counters every epoch scheduler keeps; `base_lrs` and `last_lrs` hold one entry per
/// param group the scheduler drives.
#[derive(Debug, Clone)]
struct Progress {
    base_lrs: Vec<f64>,
    last_epoch: i64,
    step_count: u64,
    last_lrs: Vec<f64>,
    /// True while the construction step runs (PyTorch's `_is_initial`).
    is_initial: bool,
}

impl Progress {
    /// Attaches to `optimizer`: records each group's `initial_lr` if none is recorded yet.
    fn attach(optimizer: &mut dyn Optimizer) -> Progress {
        let base_lrs = (0..optimizer.num_param_groups())
            .map(|g| match optimizer.group_initial_lr(g) {
                Some(lr) => lr,
                None => {
                    let lr = optimizer.group_lr(g);
                    optimizer.set_group_initial_lr(g, lr);
                    lr
                }
            })
            .collect();
        Progress {
            base_lrs,
            last_epoch: -1,
            step_count: 0,
            last_lrs: optimizer.group_lrs(),
            is_initial: false,
        }
    }

    /// The number of groups driven: those of `optimizer` when the scheduler was built.
    fn groups(&self, optimizer: &dyn Optimizer) -> usize {
        self.base_lrs.len().min(optimizer.num_param_groups())
    }

    /// Writes `lrs` (one per driven group) into `optimizer` and records them.
    fn set_lrs(&mut self, optimizer: &mut dyn Optimizer, lrs: Vec<f64>) {
        for (g, &lr) in lrs.iter().enumerate() {
            optimizer.set_group_lr(g, lr);
        }
        self.last_lrs = lrs;
    }
}

/// Implements [`LRScheduler`] and [`EpochScheduler`] for a type with a `p: Progress` field and
/// `get_lr(&self, group, lr)` (the recursive form, from the group's current lr) and
/// `closed_form_lr(&self, group)` methods, each for one param group.
macro_rules! epoch_scheduler {
    ($ty:ident) => {
        impl LRScheduler for $ty {
            fn step(&mut self, optimizer: &mut dyn Optimizer) {
                self.p.step_count += 1;
                self.p.last_epoch += 1;
                let lrs = (0..self.p.groups(optimizer))
                    .map(|g| self.get_lr(g, optimizer.group_lr(g)))
                    .collect();
                self.p.set_lrs(optimizer, lrs);
            }

            fn get_last_lr(&self) -> f64 {
                self.p.last_lrs[0]
            }

            fn get_last_lrs(&self) -> Vec<f64> {
                self.p.last_lrs.clone()
            }
        }

        impl EpochScheduler for $ty {
            fn last_epoch(&self) -> i64 {
                self.p.last_epoch
            }

            fn step_to(&mut self, optimizer: &mut dyn Optimizer, epoch: i64) {
                self.p.last_epoch = epoch;
                let lrs = (0..self.p.groups(optimizer))
                    .map(|g| self.closed_form_lr(g))
                    .collect();
                self.p.set_lrs(optimizer, lrs);
            }

            fn rewind(&mut self) {
                self.p.last_epoch -= 1;
            }

            fn initial_step(&mut self, optimizer: &mut dyn Optimizer) {
                self.p.step_count = 0;
                self.p.is_initial = true;
                self.step(optimizer);
                self.p.is_initial = false;
            }
        }
    };
}

/// Multiplies the lr by `gamma` every `step_size` epochs (`StepLR`):
/// `lr = base_lr * gamma^(epoch / step_size)` (integer division).
#[derive(Debug, Clone)]
pub struct StepLR {
    step_size: i64,
    gamma: f64,
    p: Progress,
}

impl StepLR {
    /// A StepLR on `optimizer` (PyTorch's default `gamma` is 0.1); sets the epoch-0 lr.
    pub fn new(optimizer: &mut dyn Optimizer, step_size: usize, gamma: f64) -> Result<StepLR> {
        if step_size == 0 {
            return Err(Error::invalid("StepLR", "step_size must be positive"));
        }
        let mut s = StepLR {
            step_size: step_size as i64,
            gamma,
            p: Progress::attach(optimizer),
        };
        s.initial_step(optimizer);
        Ok(s)
    }

    fn get_lr(&self, _group: usize, lr: f64) -> f64 {
        let e = self.p.last_epoch;
        if e == 0 || e % self.step_size != 0 {
            lr
        } else {
            lr * self.gamma
        }
    }

    fn closed_form_lr(&self, group: usize) -> f64 {
        self.p.base_lrs[group]
            * self
                .gamma
                .powf(self.p.last_epoch.div_euclid(self.step_size) as f64)
    }
}

epoch_scheduler!(StepLR);

/// Scales the lr by a factor going linearly from `start_factor` to `end_factor` over
/// `total_iters` epochs, then constant (`LinearLR`):
/// `lr = base_lr * (start + (end - start) * min(epoch, total_iters) / total_iters)`.
#[derive(Debug, Clone)]
pub struct LinearLR {
    start_factor: f64,
    end_factor: f64,
    total_iters: i64,
    p: Progress,
}

impl LinearLR {
    /// A LinearLR on `optimizer` (PyTorch's defaults: `1/3`, `1.0`, `5`); sets the epoch-0 lr
    /// `base_lr * start_factor`.
    pub fn new(
        optimizer: &mut dyn Optimizer,
        start_factor: f64,
        end_factor: f64,
        total_iters: usize,
    ) -> Result<LinearLR> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(Error::invalid(
                "LinearLR",
                "Starting multiplicative factor expected to be greater than 0 and less or equal to 1.",
            ));
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(Error::invalid(
                "LinearLR",
                "Ending multiplicative factor expected to be between 0 and 1.",
            ));
        }
        if total_iters == 0 {
            return Err(Error::invalid("LinearLR", "total_iters must be positive"));
        }
        let mut s = LinearLR {
            start_factor,
            end_factor,
            total_iters: total_iters as i64,
            p: Progress::attach(optimizer),
        };
        s.initial_step(optimizer);
        Ok(s)
    }

    fn get_lr(&self, _group: usize, lr: f64) -> f64 {
        let e = self.p.last_epoch;
        if e == 0 {
            return lr * self.start_factor;
        }
        if self.p.is_initial || e > self.total_iters {
            return lr;
        }
        let delta = self.end_factor - self.start_factor;
        lr * (1.0 + delta / (self.total_iters as f64 * self.start_factor + (e - 1) as f64 * delta))
    }

    fn closed_form_lr(&self, group: usize) -> f64 {
        let progress = self.total_iters.min(self.p.last_epoch) as f64;
        self.p.base_lrs[group]
            * (self.start_factor + (self.end_factor - self.start_factor) * progress / self.total_iters as f64)
    }
}

epoch_scheduler!(LinearLR);

/// Anneals the lr from `base_lr` to `eta_min` along a half cosine over `t_max` epochs
/// (`CosineAnnealingLR`): `lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / t_max)) / 2`.
/// Past `t_max` it rises again (the cosine continues), as PyTorch's.
#[derive(Debug, Clone)]
pub struct CosineAnnealingLR {
    t_max: i64,
    eta_min: f64,
    p: Progress,
}

impl CosineAnnealingLR {
    /// A CosineAnnealingLR on `optimizer` (PyTorch's default `eta_min` is 0); the epoch-0 lr
    /// is the optimizer's lr, unchanged.
    pub fn new(optimizer: &mut dyn Optimizer, t_max: usize, eta_min: f64) -> Result<CosineAnnealingLR> {
        if t_max == 0 {
            return Err(Error::invalid("CosineAnnealingLR", "T_max must be positive"));
        }
        let mut s = CosineAnnealingLR {
            t_max: t_max as i64,
            eta_min,
            p: Progress::attach(optimizer),
        };
        s.initial_step(optimizer);
        Ok(s)
    }

    fn get_lr(&self, group: usize, lr: f64) -> f64 {
        let (e, t, eta_min, base) = (
            self.p.last_epoch,
            self.t_max as f64,
            self.eta_min,
            self.p.base_lrs[group],
        );
        if self.p.is_initial {
            lr
        } else if self.p.step_count == 1 && e > 0 {
            eta_min + (base - eta_min) * (1.0 + (e as f64 * PI / t).cos()) / 2.0
        } else if (e - 1 - self.t_max).rem_euclid(2 * self.t_max) == 0 {
            lr + (base - eta_min) * (1.0 - (PI / t).cos()) / 2.0
        } else {
            (1.0 + (PI * e as f64 / t).cos()) / (1.0 + (PI * (e - 1) as f64 / t).cos()) * (lr - eta_min)
                + eta_min
        }
    }

    fn closed_form_lr(&self, group: usize) -> f64 {
        let (e, t) = (self.p.last_epoch as f64, self.t_max as f64);
        self.eta_min + (self.p.base_lrs[group] - self.eta_min) * (1.0 + (PI * e / t).cos()) / 2.0
    }
}

epoch_scheduler!(CosineAnnealingLR);

/// Runs `schedulers[0]` until `milestones[0]`, then `schedulers[1]` restarted at its epoch 0,
/// and so on (`SequentialLR`).
pub struct SequentialLR {
    schedulers: Vec<Box<dyn EpochScheduler>>,
    milestones: Vec<i64>,
    last_epoch: i64,
    last_lrs: Vec<f64>,
}

impl SequentialLR {
    /// Sequences `schedulers` (all built on `optimizer`) switching at `milestones` (one fewer,
    /// ascending); resets each group's lr to its `initial_lr` and re-runs the first
    /// scheduler's epoch 0.
    pub fn new(
        optimizer: &mut dyn Optimizer,
        mut schedulers: Vec<Box<dyn EpochScheduler>>,
        milestones: Vec<usize>,
    ) -> Result<SequentialLR> {
        if schedulers.is_empty() {
            return Err(Error::invalid("SequentialLR", "expects at least one scheduler"));
        }
        if milestones.len() != schedulers.len() - 1 {
            return Err(Error::invalid(
                "SequentialLR",
                format!(
                    "Sequential Schedulers expects number of schedulers provided to be one more than the number of milestone points, but got number of schedulers {} and the number of milestones to be equal to {}",
                    schedulers.len(),
                    milestones.len()
                ),
            ));
        }
        if milestones.windows(2).any(|w| w[0] > w[1]) {
            return Err(Error::invalid(
                "SequentialLR",
                "milestones must be in ascending order",
            ));
        }
        for g in 0..optimizer.num_param_groups() {
            let initial_lr = optimizer
                .group_initial_lr(g)
                .unwrap_or_else(|| optimizer.group_lr(g));
            optimizer.set_group_lr(g, initial_lr);
        }
        for s in &mut schedulers {
            s.rewind();
        }
        schedulers[0].initial_step(optimizer);
        let last_lrs = schedulers[0].get_last_lrs();
        Ok(SequentialLR {
            schedulers,
            milestones: milestones.into_iter().map(|m| m as i64).collect(),
            last_epoch: 0,
            last_lrs,
        })
    }

    /// The index of the last epoch.
    pub fn last_epoch(&self) -> i64 {
        self.last_epoch
    }
}

impl LRScheduler for SequentialLR {
    fn step(&mut self, optimizer: &mut dyn Optimizer) {
        self.last_epoch += 1;
        // bisect_right: the number of milestones <= last_epoch.
        let idx = self.milestones.partition_point(|&m| m <= self.last_epoch);
        let scheduler = &mut self.schedulers[idx];
        if idx > 0 && self.milestones[idx - 1] == self.last_epoch {
            scheduler.step_to(optimizer, 0);
        } else {
            scheduler.step(optimizer);
        }
        self.last_lrs = scheduler.get_last_lrs();
    }

    fn get_last_lr(&self) -> f64 {
        self.last_lrs[0]
    }

    fn get_last_lrs(&self) -> Vec<f64> {
        self.last_lrs.clone()
    }
}

/// Steps every scheduler each epoch, so their factors multiply (`ChainedScheduler`).
pub struct ChainedScheduler {
    schedulers: Vec<Box<dyn LRScheduler>>,
    last_lrs: Vec<f64>,
}

impl ChainedScheduler {
    /// Chains `schedulers` (all built on `optimizer`, whose lr they already set together).
    pub fn new(optimizer: &dyn Optimizer, schedulers: Vec<Box<dyn LRScheduler>>) -> Result<ChainedScheduler> {
        if schedulers.is_empty() {
            return Err(Error::invalid(
                "ChainedScheduler",
                "expects at least one scheduler",
            ));
        }
        Ok(ChainedScheduler {
            schedulers,
            last_lrs: optimizer.group_lrs(),
        })
    }
}

impl LRScheduler for ChainedScheduler {
    fn step(&mut self, optimizer: &mut dyn Optimizer) {
        for s in &mut self.schedulers {
            s.step(optimizer);
        }
        self.last_lrs = optimizer.group_lrs();
    }

    fn get_last_lr(&self) -> f64 {
        self.last_lrs[0]
    }

    fn get_last_lrs(&self) -> Vec<f64> {
        self.last_lrs.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{SgdConfig, SGD};
    use ember_core::{Device, Tensor};

    fn sgd(lr: f64) -> SGD {
        let p = Tensor::from_slice(&[1.0f64], [1], Device::Cpu).unwrap();
        SGD::new(
            vec![p],
            SgdConfig {
                lr,
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn assert_close(got: f64, want: f64, what: &str) {
        assert!(
            (got - want).abs() <= 1e-14 * (1.0 + want.abs()),
            "{what}: got {got}, want {want}"
        );
    }

    /// Steps `sched` `n` times and checks the lr at each epoch (0 included) against `want`.
    fn check(opt: &mut SGD, sched: &mut dyn LRScheduler, n: i64, want: impl Fn(i64) -> f64) {
        for e in 0..=n {
            if e > 0 {
                sched.step(opt);
            }
            assert_close(sched.get_last_lr(), want(e), &format!("epoch {e}"));
            assert_eq!(sched.get_last_lr(), opt.lr(), "epoch {e}: optimizer lr");
        }
    }

    #[test]
    fn step_lr() {
        // lr = 1.0 * 0.1^(epoch / 3): 1, 1, 1, 0.1, 0.1, 0.1, 0.01, ...
        let mut opt = sgd(1.0);
        let mut s = StepLR::new(&mut opt, 3, 0.1).unwrap();
        assert_eq!(opt.initial_lr(), Some(1.0));
        check(&mut opt, &mut s, 10, |e| 0.1f64.powi((e / 3) as i32));
        assert_eq!(s.last_epoch(), 10);
    }

    #[test]
    fn linear_lr_warmup_and_decay() {
        // Warm-up: 0.1 * (0.25 + 0.75 * min(e, 4) / 4): 0.025, 0.04375, 0.0625, 0.08125, 0.1, 0.1...
        let mut opt = sgd(0.1);
        let mut s = LinearLR::new(&mut opt, 0.25, 1.0, 4).unwrap();
        check(&mut opt, &mut s, 10, |e| {
            0.1 * (0.25 + 0.75 * e.min(4) as f64 / 4.0)
        });
        assert_close(opt.lr(), 0.1, "after warm-up");
        // Decay: 2 * (1 - 0.9 * min(e, 5) / 5).
        let mut opt = sgd(2.0);
        let mut s = LinearLR::new(&mut opt, 1.0, 0.1, 5).unwrap();
        check(&mut opt, &mut s, 10, |e| {
            2.0 * (1.0 - 0.9 * e.min(5) as f64 / 5.0)
        });
    }

    #[test]
    fn cosine_annealing_matches_closed_form() {
        // eta_min + (base - eta_min) (1 + cos(pi e / T)) / 2, past T_max too (it rises again:
        // epoch T_max + 1 takes the recursion's special branch).
        let (base, eta_min, t_max) = (0.1, 0.01, 4);
        let mut opt = sgd(base);
        let mut s = CosineAnnealingLR::new(&mut opt, t_max, eta_min).unwrap();
        check(&mut opt, &mut s, 13, |e| {
            eta_min + (base - eta_min) * (1.0 + (PI * e as f64 / t_max as f64).cos()) / 2.0
        });
        let mut opt = sgd(1.0);
        let mut s = CosineAnnealingLR::new(&mut opt, 10, 0.0).unwrap();
        check(&mut opt, &mut s, 10, |e| {
            (1.0 + (PI * e as f64 / 10.0).cos()) / 2.0
        });
        assert!(opt.lr().abs() < 1e-15);
    }

    #[test]
    fn sequential_warmup_then_cosine() {
        // LinearLR(0.1 -> 1, 2 iters) for epochs 0..3, then CosineAnnealingLR(T_max 5) from its
        // epoch 0 at milestone 3: 0.1, 0.55, 1, then (1 + cos(pi k / 5)) / 2 at epoch 3 + k.
        let mut opt = sgd(1.0);
        let warm = LinearLR::new(&mut opt, 0.1, 1.0, 2).unwrap();
        let cos = CosineAnnealingLR::new(&mut opt, 5, 0.0).unwrap();
        let mut s = SequentialLR::new(&mut opt, vec![Box::new(warm), Box::new(cos)], vec![3]).unwrap();
        check(&mut opt, &mut s, 10, |e| {
            if e < 3 {
                0.1 + 0.9 * e.min(2) as f64 / 2.0
            } else {
                (1.0 + (PI * (e - 3) as f64 / 5.0).cos()) / 2.0
            }
        });
        assert_eq!(s.last_epoch(), 10);
    }

    #[test]
    fn sequential_three_stages() {
        // StepLR(2, 0.5) until 4, LinearLR(0.5 -> 1, 2) until 7, then StepLR(1, 0.9).
        let mut opt = sgd(1.0);
        let a = StepLR::new(&mut opt, 2, 0.5).unwrap();
        let b = LinearLR::new(&mut opt, 0.5, 1.0, 2).unwrap();
        let c = StepLR::new(&mut opt, 1, 0.9).unwrap();
        let mut s =
            SequentialLR::new(&mut opt, vec![Box::new(a), Box::new(b), Box::new(c)], vec![4, 7]).unwrap();
        check(&mut opt, &mut s, 10, |e| match e {
            0..4 => 0.5f64.powi((e / 2) as i32),
            4..7 => 0.5 + 0.5 * (e - 4).min(2) as f64 / 2.0,
            _ => 0.9f64.powi((e - 7) as i32),
        });
    }

    #[test]
    fn chained_factors_multiply() {
        // lr = 0.5^(e / 2) * (0.5 + 0.5 * min(e, 2) / 2).
        let mut opt = sgd(1.0);
        let a = StepLR::new(&mut opt, 2, 0.5).unwrap();
        let b = LinearLR::new(&mut opt, 0.5, 1.0, 2).unwrap();
        let mut s = ChainedScheduler::new(&opt, vec![Box::new(a), Box::new(b)]).unwrap();
        check(&mut opt, &mut s, 10, |e| {
            0.5f64.powi((e / 2) as i32) * (0.5 + 0.5 * e.min(2) as f64 / 2.0)
        });
    }

    #[test]
    fn step_to_uses_closed_form() {
        let mut opt = sgd(1.0);
        let mut s = StepLR::new(&mut opt, 3, 0.5).unwrap();
        s.step_to(&mut opt, 7);
        assert_close(opt.lr(), 0.25, "StepLR at 7");
        let mut opt = sgd(1.0);
        let mut s = CosineAnnealingLR::new(&mut opt, 4, 0.0).unwrap();
        s.step_to(&mut opt, 2);
        assert_close(opt.lr(), 0.5, "cosine at 2");
    }

    #[test]
    fn scheduler_drives_the_optimizer() {
        // SGD with lr 1 then 0.5 after StepLR(1, 0.5): p = 1 - 1 * 1 - 0.5 * 1 = -0.5.
        let p = Tensor::from_slice(&[1.0f64], [1], Device::Cpu).unwrap();
        let g = Tensor::from_slice(&[1.0f64], [1], Device::Cpu).unwrap();
        let mut opt = SGD::new(
            vec![p.clone()],
            SgdConfig {
                lr: 1.0,
                ..Default::default()
            },
        )
        .unwrap();
        let mut s = StepLR::new(&mut opt, 1, 0.5).unwrap();
        for _ in 0..2 {
            p.set_grad(Some(g.clone())).unwrap();
            opt.step().unwrap();
            s.step(&mut opt);
        }
        assert_eq!(p.to_vec_f64().unwrap(), [-0.5]);
    }

    #[test]
    fn errors() {
        let mut opt = sgd(1.0);
        assert!(StepLR::new(&mut opt, 0, 0.1).is_err());
        assert!(LinearLR::new(&mut opt, 0.0, 1.0, 5).is_err());
        assert!(LinearLR::new(&mut opt, 1.5, 1.0, 5).is_err());
        assert!(LinearLR::new(&mut opt, 0.5, -0.1, 5).is_err());
        assert!(LinearLR::new(&mut opt, f64::NAN, 1.0, 5).is_err());
        assert!(LinearLR::new(&mut opt, 0.5, 1.0, 0).is_err());
        assert!(CosineAnnealingLR::new(&mut opt, 0, 0.0).is_err());
        let a = StepLR::new(&mut opt, 1, 0.1).unwrap();
        let b = StepLR::new(&mut opt, 1, 0.1).unwrap();
        assert!(SequentialLR::new(&mut opt, vec![Box::new(a), Box::new(b)], vec![]).is_err());
        let a = StepLR::new(&mut opt, 1, 0.1).unwrap();
        let b = StepLR::new(&mut opt, 1, 0.1).unwrap();
        let c = StepLR::new(&mut opt, 1, 0.1).unwrap();
        let boxed: Vec<Box<dyn EpochScheduler>> = vec![Box::new(a), Box::new(b), Box::new(c)];
        assert!(SequentialLR::new(&mut opt, boxed, vec![5, 2]).is_err());
        assert!(SequentialLR::new(&mut opt, vec![], vec![]).is_err());
        assert!(ChainedScheduler::new(&opt, vec![]).is_err());
    }
}
