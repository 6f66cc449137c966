//! ZeroRedundancyOptimizer over the CPU backend, ranks as threads: DDP with ZeRO-sharded AdamW
//! against DDP with plain AdamW (the same parameters, bit for bit), each rank's state holding
//! only its partition, the consolidated state dict against plain AdamW's, loading it back, and
//! the errors.

use std::time::Duration;

use ember_core::{DType, Device, Error, Tensor};
use ember_distributed::{DdpOptions, DistributedDataParallel, ProcessGroup, ZeroRedundancyOptimizer};
use ember_nn::functional::mse_loss;
use ember_nn::optim::{AdamConfig, AdamW, Optimizer, ParamGroup, SgdConfig, SGD};
use ember_nn::{ModuleExt, Reduction, Sequential};

use crate::common::run_ranks;
use crate::ddp::{data, fill_params, mlp};

const T: Duration = Duration::from_secs(20);
const ROWS: usize = 12;

fn adamw(params: Vec<Tensor>) -> ember_core::Result<AdamW> {
    AdamW::new(
        params,
        AdamConfig {
            lr: 0.05,
            weight_decay: 0.1,
            ..AdamConfig::adamw()
        },
    )
}

/// The DDP-wrapped [`mlp`] of this rank on `device` (different weights per rank until DDP
/// broadcasts rank 0's) and the rank's rows of [`data`].
fn setup(pg: &ProcessGroup, device: Device) -> (DistributedDataParallel<Sequential>, Tensor, Tensor) {
    let (r, n) = (pg.rank(), pg.size());
    let mut m = mlp();
    fill_params(&m, r as f64);
    m.to_device(device).unwrap();
    let ddp = DistributedDataParallel::new(m, DdpOptions::new().process_group(pg.clone())).unwrap();
    let (x, y) = data(ROWS);
    let share = ROWS / n;
    let mine = |t: Tensor| t.narrow(0, r * share, share).unwrap().to(device).unwrap();
    (ddp, mine(x), mine(y))
}

fn train(
    ddp: &DistributedDataParallel<Sequential>,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
    steps: usize,
) {
    for _ in 0..steps {
        opt.zero_grad().unwrap();
        mse_loss(&ddp.forward(x).unwrap(), y, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
    }
}

fn values(ts: &[Tensor]) -> Vec<Vec<f64>> {
    ts.iter().map(|t| t.to_vec_f64().unwrap()).collect()
}

fn by_key(state: &[(String, Tensor)]) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    state
        .iter()
        .map(|(k, t)| (k.clone(), (t.dims().to_vec(), t.to_vec_f64().unwrap())))
        .collect()
}

/// DDP + ZeRO(AdamW) gives the parameters of DDP + AdamW bit for bit: the same averaged
/// gradients meet the same elementwise update, only on one rank instead of every rank, and the
/// broadcast copies bits. Each rank's local state covers its partition only, and the state
/// dict consolidated on rank 0 is plain AdamW's; loading it into a fresh ZeRO optimizer on every
/// rank continues the training exactly.
#[test]
fn zero_adamw_under_ddp_equals_plain_adamw_bit_for_bit() {
    for n in [2, 3] {
        run_ranks(n, T, |pg| zero_matches_ddp(&pg, Device::Cpu));
    }
}

/// The body of [`zero_adamw_under_ddp_equals_plain_adamw_bit_for_bit`] on `device` (the NCCL
/// tests run it on GPUs).
pub(crate) fn zero_matches_ddp(pg: &ProcessGroup, device: Device) {
    let n = pg.size();
    let steps = 3;
    // Plain DDP + AdamW.
    let (ddp, x, y) = setup(pg, device);
    let mut plain = adamw(ddp.module().parameters()).unwrap();
    train(&ddp, &mut plain, &x, &y, steps);
    let expected = values(&ddp.module().parameters());

    // DDP + ZeRO(AdamW), from the same start.
    let (zddp, x, y) = setup(pg, device);
    let params = zddp.module().parameters();
    let mut zero = ZeroRedundancyOptimizer::new(params.clone(), adamw, Some(pg.clone())).unwrap();
    train(&zddp, &mut zero, &x, &y, steps);
    assert_eq!(values(&params), expected, "rank {} of {n}", pg.rank());

    // The partition covers every parameter once; this rank's state is its share only.
    let partition = zero.partition_parameters().to_vec();
    let mut all: Vec<usize> = partition.concat();
    all.sort_unstable();
    assert_eq!(all, (0..params.len()).collect::<Vec<_>>());
    let mine = &partition[pg.rank()];
    let local = zero
        .optim()
        .expect("every rank owns a parameter here")
        .state_dict();
    let exp_avgs: Vec<_> = local.iter().filter(|(k, _)| k.ends_with(".exp_avg")).collect();
    assert_eq!(exp_avgs.len(), mine.len());
    for (k, t) in exp_avgs {
        let i: usize = k.split('.').nth(1).unwrap().parse().unwrap();
        assert_eq!(t.dims(), params[mine[i]].dims(), "{k}");
    }

    // The state dict consolidated on rank 0 is plain AdamW's; elsewhere an error.
    zero.consolidate_state_dict(0).unwrap();
    match (pg.rank(), zero.state_dict()) {
        (0, Ok(state)) => assert_eq!(by_key(&state), by_key(&plain.state_dict())),
        (0, Err(e)) => panic!("{e}"),
        (r, Err(Error::InvalidArgument { msg, .. })) => {
            assert!(msg.contains(&format!("consolidate_state_dict({r})")), "{msg}")
        }
        (_, other) => panic!("{other:?}"),
    }

    // Loading plain AdamW's state into a fresh ZeRO optimizer continues exactly.
    let mut resumed = ZeroRedundancyOptimizer::new(params.clone(), adamw, Some(pg.clone())).unwrap();
    resumed.load_state_dict(&plain.state_dict()).unwrap();
    train(&ddp, &mut plain, &x, &y, 1);
    train(&zddp, &mut resumed, &x, &y, 1);
    assert_eq!(values(&params), values(&ddp.module().parameters()));
}

/// More ranks than parameters: the last rank owns none and has no local optimizer, yet steps
/// (joining the exchange), follows lr changes, and every rank ends with SGD's result.
#[test]
fn a_rank_without_parameters_still_steps_and_keeps_the_lr() {
    run_ranks(3, T, |pg| {
        let make = || {
            vec![
                Tensor::full([3usize], 1.0, DType::F64, Device::Cpu)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap(),
                Tensor::full([2usize], 2.0, DType::F64, Device::Cpu)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap(),
            ]
        };
        let sgd = |p: Vec<Tensor>| {
            SGD::new(
                p,
                SgdConfig {
                    lr: 0.5,
                    ..Default::default()
                },
            )
        };
        let params = make();
        let mut zero = ZeroRedundancyOptimizer::new(params.clone(), sgd, Some(pg.clone())).unwrap();
        assert_eq!(zero.optim().is_none(), pg.rank() == 2);
        assert_eq!(zero.lr(), 0.5);
        zero.set_lr(0.25);
        for p in &params {
            p.set_grad(Some(p.full_like(4.0).unwrap())).unwrap();
        }
        zero.step().unwrap();
        assert_eq!(values(&params), [vec![0.0; 3], vec![1.0; 2]]);
        let state = zero.consolidate_state_dict(2).and_then(|_| match pg.rank() {
            2 => zero.state_dict(),
            _ => Ok(Vec::new()),
        });
        if pg.rank() == 2 {
            let lr = state
                .unwrap()
                .into_iter()
                .find(|(k, _)| k == "param_groups.0.lr")
                .unwrap();
            assert_eq!(lr.1.item_f64().unwrap(), 0.25);
        }
    });
}

/// Ranks that pass different parameters get a typed error on every rank (not a hang or a
/// wrong partition); an empty list and a bad state dict are typed errors too.
#[test]
fn mismatched_parameters_and_bad_state_dicts_are_typed_errors() {
    run_ranks(2, T, |pg| {
        let p = |n: usize| {
            Tensor::zeros([n], DType::F32, Device::Cpu)
                .unwrap()
                .requires_grad_(true)
                .unwrap()
        };
        let params = vec![p(4), p(2 + pg.rank())];
        let e = ZeroRedundancyOptimizer::new(params, adamw, Some(pg.clone()))
            .err()
            .unwrap();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("same parameters")),
            "{e}"
        );
        assert!(ZeroRedundancyOptimizer::new(Vec::new(), adamw, Some(pg.clone())).is_err());

        let mut zero = ZeroRedundancyOptimizer::new(vec![p(4), p(3)], adamw, Some(pg.clone())).unwrap();
        let bad = vec![("state.7.exp_avg".to_string(), p(4))];
        assert!(zero.load_state_dict(&bad).is_err());
        let two_groups = vec![(
            "param_groups.1.lr".to_string(),
            Tensor::scalar(0.1, DType::F64, Device::Cpu).unwrap(),
        )];
        assert!(matches!(
            zero.load_state_dict(&two_groups),
            Err(ember_nn::state_dict::StateDictError::ParamGroupCount { .. })
        ));
        assert!(zero.consolidate_state_dict(5).is_err());
        // The group still works.
        zero.step().unwrap();
    });
}

/// nanoGPT's two AdamW groups: weight decay 0.1 on the matrices, none on the biases, and a
/// group lr of its own on the second.
fn two_groups(params: &[Tensor]) -> Vec<ParamGroup> {
    let (decay, no_decay): (Vec<Tensor>, Vec<Tensor>) = params.iter().cloned().partition(|p| p.rank() >= 2);
    vec![
        ParamGroup::new(decay).weight_decay(0.1),
        ParamGroup::new(no_decay).weight_decay(0.0).lr(0.02),
    ]
}

fn adamw_groups(groups: Vec<ParamGroup>) -> ember_core::Result<AdamW> {
    AdamW::with_groups(
        groups,
        AdamConfig {
            lr: 0.05,
            ..AdamConfig::adamw()
        },
    )
}

/// ZeRO over two param groups of different weight decay and lr (Note [ZeRO partition]: each
/// group partitioned in turn, each rank's AdamW holding its share of both) gives DDP with the
/// unsharded two-group AdamW's parameters bit for bit, on 2 and 3 ranks; the consolidated
/// state dict is that AdamW's, groups included, and loads back. Built with the first group and
/// then `add_param_group` of the second, it is the same optimizer.
#[test]
fn zero_with_two_param_groups_equals_ddp_with_the_unsharded_optimizer() {
    for n in [2, 3] {
        run_ranks(n, T, |pg| {
            let steps = 3;
            let (ddp, x, y) = setup(&pg, Device::Cpu);
            let mut plain = adamw_groups(two_groups(&ddp.module().parameters())).unwrap();
            train(&ddp, &mut plain, &x, &y, steps);
            let expected = values(&ddp.module().parameters());

            let (zddp, x, y) = setup(&pg, Device::Cpu);
            let groups = two_groups(&zddp.module().parameters());
            let mut zero =
                ZeroRedundancyOptimizer::with_groups(groups.clone(), adamw_groups, Some(pg.clone())).unwrap();
            assert_eq!(zero.num_param_groups(), 2);
            assert_eq!(
                zero.optim().unwrap().num_param_groups(),
                2,
                "one local group per group"
            );
            assert_eq!(zero.group_lrs(), [0.05, 0.02]);
            train(&zddp, &mut zero, &x, &y, steps);
            assert_eq!(
                values(&zddp.module().parameters()),
                expected,
                "rank {} of {n}",
                pg.rank()
            );
            let params: Vec<Tensor> = groups.iter().flat_map(|g| g.params().to_vec()).collect();
            assert_eq!(zero.params().len(), params.len());

            zero.consolidate_state_dict(0).unwrap();
            if pg.rank() == 0 {
                let state = zero.state_dict().unwrap();
                assert_eq!(by_key(&state), by_key(&plain.state_dict()));
            }
            // Loaded into a fresh ZeRO optimizer, plain AdamW's state continues exactly.
            let mut resumed =
                ZeroRedundancyOptimizer::with_groups(groups.clone(), adamw_groups, Some(pg.clone())).unwrap();
            resumed.load_state_dict(&plain.state_dict()).unwrap();
            train(&ddp, &mut plain, &x, &y, 1);
            train(&zddp, &mut resumed, &x, &y, 1);
            assert_eq!(
                values(&zddp.module().parameters()),
                values(&ddp.module().parameters())
            );

            // The first group, then add_param_group of the second: the same partition and state.
            let mut added =
                ZeroRedundancyOptimizer::with_groups(vec![groups[0].clone()], adamw_groups, Some(pg.clone()))
                    .unwrap();
            Optimizer::add_param_group(&mut added, groups[1].clone()).unwrap();
            assert_eq!(added.partition_parameters(), resumed.partition_parameters());
            assert_eq!(added.group_lrs(), [0.05, 0.02]);
            added.load_state_dict(&plain.state_dict()).unwrap();
            train(&ddp, &mut plain, &x, &y, 1);
            train(&zddp, &mut added, &x, &y, 1);
            assert_eq!(
                values(&zddp.module().parameters()),
                values(&ddp.module().parameters())
            );

            // A state dict of one group does not load into two.
            let one = adamw(ddp.module().parameters()).unwrap();
            assert!(matches!(
                resumed.load_state_dict(&one.state_dict()),
                Err(ember_nn::state_dict::StateDictError::ParamGroupCount { .. })
                    | Err(ember_nn::state_dict::StateDictError::ParamGroupSize { .. })
            ));
        });
    }
}

/// Two AdamW groups that differ in every hyperparameter a group can set, over defaults with
/// amsgrad (what [`zero_state_dict_round_trips_every_group_hyperparameter`] saves).
fn distinct_groups(params: &[Tensor]) -> Vec<ParamGroup> {
    let (decay, no_decay): (Vec<Tensor>, Vec<Tensor>) = params.iter().cloned().partition(|p| p.rank() >= 2);
    vec![
        ParamGroup::new(decay).weight_decay(0.1).betas((0.8, 0.95)),
        ParamGroup::new(no_decay)
            .weight_decay(0.0)
            .lr(0.02)
            .betas((0.7, 0.9))
            .eps(1e-6),
    ]
}

fn amsgrad_adamw(groups: Vec<ParamGroup>) -> ember_core::Result<AdamW> {
    AdamW::with_groups(
        groups,
        AdamConfig {
            lr: 0.05,
            amsgrad: true,
            ..AdamConfig::adamw()
        },
    )
}

/// AdamW with other values of everything, and groups that set nothing.
fn other_adamw(groups: Vec<ParamGroup>) -> ember_core::Result<AdamW> {
    let groups = groups
        .iter()
        .map(|g| ParamGroup::new(g.params().to_vec()))
        .collect();
    AdamW::with_groups(
        groups,
        AdamConfig {
            lr: 0.3,
            betas: (0.5, 0.5),
            eps: 0.1,
            weight_decay: 0.5,
            amsgrad: false,
            maximize: true,
            fused: Some(false),
        },
    )
}

/// The state dict ZeRO consolidates holds every hyperparameter of each group as the unsharded
/// AdamW's does (betas, eps, weight decay, amsgrad, ..., not only the lr), and loaded into a
/// ZeRO optimizer built with other values everywhere it restores them on every rank: the
/// next step is the unsharded AdamW's, bit for bit. On 2 and 3 ranks, each loading the dict
/// consolidated on itself.
#[test]
fn zero_state_dict_round_trips_every_group_hyperparameter() {
    for n in [2, 3] {
        run_ranks(n, T, |pg| {
            let (ddp, x, y) = setup(&pg, Device::Cpu);
            let mut plain = amsgrad_adamw(distinct_groups(&ddp.module().parameters())).unwrap();
            train(&ddp, &mut plain, &x, &y, 2);

            let (zddp, x, y) = setup(&pg, Device::Cpu);
            let groups = distinct_groups(&zddp.module().parameters());
            let mut zero =
                ZeroRedundancyOptimizer::with_groups(groups.clone(), amsgrad_adamw, Some(pg.clone()))
                    .unwrap();
            train(&zddp, &mut zero, &x, &y, 2);
            let mut consolidated = Vec::new();
            for r in 0..n {
                zero.consolidate_state_dict(r).unwrap();
                if r == pg.rank() {
                    consolidated = zero.state_dict().unwrap();
                }
            }
            let want = plain.state_dict();
            assert_eq!(by_key(&consolidated), by_key(&want));
            let keyed = by_key(&consolidated);
            assert_eq!(keyed["param_groups.1.betas"], (vec![2], vec![0.7, 0.9]));
            assert_eq!(keyed["param_groups.0.amsgrad"], (vec![], vec![1.0]));
            assert_eq!(keyed["param_groups.1.eps"], (vec![], vec![1e-6]));

            let mut resumed =
                ZeroRedundancyOptimizer::with_groups(groups.clone(), other_adamw, Some(pg.clone())).unwrap();
            assert_ne!(
                by_key(&resumed.param_group_state(1)),
                by_key(&plain.param_group_state(1))
            );
            resumed.load_state_dict(&consolidated).unwrap();
            let local = resumed.optim().unwrap();
            for g in 0..2 {
                assert_eq!(
                    local.param_groups()[g].config(),
                    plain.param_groups()[g].config(),
                    "group {g} on rank {} of {n}",
                    pg.rank()
                );
                assert_eq!(
                    by_key(&resumed.param_group_state(g)),
                    by_key(&plain.param_group_state(g))
                );
            }
            train(&ddp, &mut plain, &x, &y, 1);
            train(&zddp, &mut resumed, &x, &y, 1);
            assert_eq!(
                values(&zddp.module().parameters()),
                values(&ddp.module().parameters())
            );
        });
    }
}

/// A rank that owns no parameter (more ranks than parameters) loads the hyperparameters too,
/// and the groups' entries of its state dict are the others'.
#[test]
fn a_rank_without_parameters_loads_every_hyperparameter() {
    run_ranks(3, T, |pg| {
        let make = || {
            (0..2)
                .map(|i| {
                    Tensor::full([3 - i], 1.0, DType::F64, Device::Cpu)
                        .unwrap()
                        .requires_grad_(true)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        };
        let saved = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..Default::default()
        };
        let plain = SGD::new(make(), saved).unwrap();
        let mut zero =
            ZeroRedundancyOptimizer::new(make(), |p| SGD::new(p, SgdConfig::default()), Some(pg.clone()))
                .unwrap();
        assert_eq!(zero.optim().is_none(), pg.rank() == 2);
        zero.load_state_dict(&plain.state_dict()).unwrap();
        assert_eq!(
            by_key(&zero.param_group_state(0)),
            by_key(&plain.param_group_state(0))
        );
        let groups = |s: Vec<(String, Tensor)>| {
            let s: Vec<_> = s
                .into_iter()
                .filter(|(k, _)| k.starts_with("param_groups."))
                .collect();
            by_key(&s)
        };
        assert_eq!(groups(Optimizer::state_dict(&zero)), groups(plain.state_dict()));
        assert_eq!(zero.lr(), 0.1);
    });
}
