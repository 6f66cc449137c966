//! DistributedDataParallel over the CPU backend, ranks as threads (`common::run_ranks`):
//! gradients against one process's full-batch gradients, `no_sync` accumulation, unused
//! parameters, the bucket rebuild, buffer broadcasts and the checks at construction. The same
//! training as processes under `ember-run` is in `processes.rs` (scenario "ddp").

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_core::{no_grad, DType, Device, Error, Tensor};
use ember_distributed::{DdpOptions, DistributedDataParallel, ProcessGroup};
use ember_nn::functional::mse_loss;
use ember_nn::optim::{Optimizer, SgdConfig, SGD};
use ember_nn::{BatchNorm1d, Forward, Linear, Module, ModuleExt, Reduction, Sequential, Tanh};

use crate::common::run_ranks;

const CPU: Device = Device::Cpu;
const TIMEOUT: Duration = Duration::from_secs(20);

/// Overwrites every parameter with values that depend on `salt` (a rank gives its own, so
/// that only the broadcast at construction can make the replicas equal).
pub(crate) fn fill_params<M: Module + ?Sized>(m: &M, salt: f64) {
    let _g = no_grad();
    for (k, p) in m.parameters().iter().enumerate() {
        let v: Vec<f64> = (0..p.numel())
            .map(|i| ((i * 7 + k * 13) % 11) as f64 * 0.1 - 0.5 + salt)
            .collect();
        let src = Tensor::from_vec(v, p.dims(), CPU).unwrap();
        p.copy_(&src).unwrap();
    }
}

pub(crate) fn mlp() -> Sequential {
    let mut m = Sequential::new()
        .with(Linear::new(4, 8, CPU).unwrap())
        .with(Tanh::new())
        .with(Linear::new(8, 8, CPU).unwrap())
        .with(Tanh::new())
        .with(Linear::new(8, 3, CPU).unwrap());
    m.to_dtype(DType::F64).unwrap();
    m
}

/// `rows` rows of inputs (4 features) and targets (3), the same in every call.
pub(crate) fn data(rows: usize) -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..rows * 4).map(|i| ((i * 5) % 17) as f64 / 8.0 - 1.0).collect();
    let y: Vec<f64> = (0..rows * 3).map(|i| ((i * 3) % 7) as f64 / 3.0 - 1.0).collect();
    (
        Tensor::from_vec(x, [rows, 4], CPU).unwrap(),
        Tensor::from_vec(y, [rows, 3], CPU).unwrap(),
    )
}

pub(crate) fn grads<M: Module + ?Sized>(m: &M) -> Vec<Option<Vec<f64>>> {
    m.parameters()
        .iter()
        .map(|p| p.grad().map(|g| g.to_vec_f64().unwrap()))
        .collect()
}

fn values<M: Module + ?Sized>(m: &M) -> Vec<Vec<f64>> {
    m.parameters().iter().map(|p| p.to_vec_f64().unwrap()).collect()
}

pub(crate) fn assert_close(a: &[Option<Vec<f64>>], b: &[Option<Vec<f64>>], what: &str) {
    assert_close_tol(a, b, 1e-12, 1e-9, what);
}

/// [`assert_close`] within `atol + rtol * |expected|`.
pub(crate) fn assert_close_tol(
    a: &[Option<Vec<f64>>],
    b: &[Option<Vec<f64>>],
    atol: f64,
    rtol: f64,
    what: &str,
) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (x.as_ref().expect(what), y.as_ref().expect(what));
        for (u, v) in x.iter().zip(y) {
            assert!(
                (u - v).abs() <= atol + rtol * v.abs(),
                "{what}: parameter {i}: {u} vs {v}"
            );
        }
    }
}

/// One process's reference: the full-batch gradients and SGD steps of rank 0's model.
pub(crate) fn reference(steps: usize, rows: usize) -> Vec<Vec<Option<Vec<f64>>>> {
    let m = mlp();
    fill_params(&m, 0.0);
    let mut opt = SGD::new(
        m.parameters(),
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let (x, y) = data(rows);
    sgd_steps(&m, &mut opt, &x, &y, steps)
}

/// `steps` SGD steps of `m` on the MSE of (`x`, `y`), each step's gradients (before the step).
fn sgd_steps<M: Forward>(
    m: &M,
    opt: &mut SGD,
    x: &Tensor,
    y: &Tensor,
    steps: usize,
) -> Vec<Vec<Option<Vec<f64>>>> {
    (0..steps).map(|_| sgd_step(m, opt, x, y)).collect()
}

/// One SGD step of `m` on the MSE of (`x`, `y`): the gradients before the step.
pub(crate) fn sgd_step<M: Forward>(m: &M, opt: &mut SGD, x: &Tensor, y: &Tensor) -> Vec<Option<Vec<f64>>> {
    m.zero_grad().unwrap();
    mse_loss(&m.forward(x).unwrap(), y, Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    let g = grads(m);
    opt.step().unwrap();
    g
}

/// DDP training on `n` ranks, each on its shard of the same batch; the gradients each rank
/// holds after each backward.
pub(crate) fn ddp_run(
    pg: ProcessGroup,
    options: DdpOptions,
    steps: usize,
    rows: usize,
) -> Vec<Vec<Option<Vec<f64>>>> {
    ddp_run_on(pg, options, steps, rows, CPU)
}

/// One rank's share of a DDP run on `device`: the wrapped [`mlp`] (its weights differ per rank
/// until DDP broadcasts rank 0's), SGD over it, and the rank's rows of [`data`].
pub(crate) type RankSetup = (DistributedDataParallel<Sequential>, SGD, Tensor, Tensor);

pub(crate) fn ddp_setup(pg: ProcessGroup, options: DdpOptions, rows: usize, device: Device) -> RankSetup {
    let (r, n) = (pg.rank(), pg.size());
    let mut m = mlp();
    fill_params(&m, r as f64);
    m.to_device(device).unwrap();
    let ddp = DistributedDataParallel::new(m, options.process_group(pg)).unwrap();
    let opt = SGD::new(
        ddp.parameters(),
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let (x, y) = data(rows);
    let share = rows / n;
    let mine = |t: Tensor| t.narrow(0, r * share, share).unwrap().to(device).unwrap();
    (ddp, opt, mine(x), mine(y))
}

/// [`ddp_run`] with the model and each rank's data on `device`.
pub(crate) fn ddp_run_on(
    pg: ProcessGroup,
    options: DdpOptions,
    steps: usize,
    rows: usize,
    device: Device,
) -> Vec<Vec<Option<Vec<f64>>>> {
    let (ddp, mut opt, x, y) = ddp_setup(pg, options, rows, device);
    sgd_steps(&ddp, &mut opt, &x, &y, steps)
}

/// [`ddp_run_on`] with the step captured into a CUDA graph (Note [NCCL under capture]): `warmup`
/// eager steps on a side stream (the first one rebuilds the buckets), then forward, loss and
/// backward captured once with the gradients released before, so the graph makes them in its
/// pool and every replay writes them again; each of the `replays` steps replays the graph and
/// takes the SGD step eagerly. The gradients each rank holds after each backward, warm-up
/// steps first.
pub(crate) fn ddp_graph_run_on(
    pg: ProcessGroup,
    options: DdpOptions,
    (warmup, replays): (usize, usize),
    rows: usize,
    device: usize,
) -> Vec<Vec<Option<Vec<f64>>>> {
    use ember_core::cuda::{self, CUDAGraph, CaptureErrorMode, GraphOptions};
    let _guard = cuda::DeviceGuard::new(device).unwrap();
    let (ddp, mut opt, x, y) = ddp_setup(pg, options, rows, Device::Cuda(device));
    let side = cuda::Stream::new_on(device).unwrap();
    side.wait_stream(&cuda::current_stream(device).unwrap()).unwrap();
    let mut out = {
        let _side = cuda::stream(&side);
        sgd_steps(&ddp, &mut opt, &x, &y, warmup)
    };
    cuda::current_stream(device).unwrap().wait_stream(&side).unwrap();
    ddp.zero_grad().unwrap();
    let mut graph = CUDAGraph::new();
    // Thread-local: the other rank is a thread of this process, capturing or running beside.
    let options = GraphOptions {
        capture_error_mode: CaptureErrorMode::ThreadLocal,
        ..Default::default()
    };
    let capture = cuda::graph_with(&mut graph, options).unwrap();
    let captured = mse_loss(&ddp.forward(&x).unwrap(), &y, Reduction::Mean).and_then(|l| l.backward());
    capture.end().unwrap();
    captured.unwrap();
    for _ in 0..replays {
        graph.replay().unwrap();
        out.push(grads(&ddp));
        opt.step().unwrap();
    }
    out
}

#[test]
fn ddp_gradients_equal_single_process_full_batch_gradients() {
    let steps = 3;
    let expected = reference(steps, 12);
    let configs: Vec<(&str, fn() -> DdpOptions)> = vec![
        ("default buckets", DdpOptions::new),
        ("one parameter per bucket", || {
            DdpOptions::new().bucket_cap_mb(1e-6)
        }),
        ("buckets of ~100 bytes", || DdpOptions::new().bucket_cap_mb(1e-4)),
        ("gradient_as_bucket_view", || {
            DdpOptions::new()
                .bucket_cap_mb(1e-4)
                .gradient_as_bucket_view(true)
        }),
    ];
    for n in [2, 3] {
        for (what, options) in &configs {
            let per_rank = run_ranks(n, TIMEOUT, |pg| ddp_run(pg, options(), steps, 12));
            for (rank, got) in per_rank.iter().enumerate() {
                for s in 0..steps {
                    assert_close(
                        &got[s],
                        &expected[s],
                        &format!("{n} ranks, {what}, rank {rank}, step {s}"),
                    );
                }
            }
        }
    }
}

#[test]
fn gradient_as_bucket_view_makes_grad_a_view_of_the_bucket() {
    run_ranks(2, TIMEOUT, |pg| {
        let ddp = DistributedDataParallel::new(
            mlp(),
            DdpOptions::new().process_group(pg).gradient_as_bucket_view(true),
        )
        .unwrap();
        let (x, y) = data(4);
        mse_loss(&ddp.forward(&x).unwrap(), &y, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        let p = ddp.parameters();
        // All parameters fit the default first bucket: their gradients share its storage.
        assert_eq!(ddp.bucket_indices().len(), 1);
        let g0 = p[0].grad().unwrap();
        assert!(p.iter().all(|q| q.grad().unwrap().shares_storage_with(&g0)));
    });
}

#[test]
fn no_sync_accumulates_locally_then_averages_everything() {
    // Two micro-batches per rank: the first under no_sync, the second synchronized.
    let rows = 16;
    let (x, y) = data(rows);
    let chunk = |k: usize| (x.narrow(0, k * 4, 4).unwrap(), y.narrow(0, k * 4, 4).unwrap());
    // Reference: (1/2) * sum over the four chunks of the chunk's mean loss.
    let m = mlp();
    fill_params(&m, 0.0);
    for k in 0..4 {
        let (cx, cy) = chunk(k);
        mse_loss(&m.forward(&cx).unwrap(), &cy, Reduction::Mean)
            .unwrap()
            .mul_scalar(0.5)
            .unwrap()
            .backward()
            .unwrap();
    }
    let expected = grads(&m);
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let r = pg.rank();
        let m = mlp();
        fill_params(&m, 0.0);
        let ddp =
            DistributedDataParallel::new(m, DdpOptions::new().process_group(pg).bucket_cap_mb(1e-4)).unwrap();
        let local = {
            let _guard = ddp.no_sync();
            let (cx, cy) = chunk(r);
            mse_loss(&ddp.forward(&cx).unwrap(), &cy, Reduction::Mean)
                .unwrap()
                .backward()
                .unwrap();
            grads(&ddp)
        };
        let (cx, cy) = chunk(2 + r);
        mse_loss(&ddp.forward(&cx).unwrap(), &cy, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        (local, grads(&ddp))
    });
    // Under no_sync the ranks kept their own gradients (they saw different data)...
    assert_ne!(per_rank[0].0, per_rank[1].0, "no_sync still synchronized");
    // ...and the synchronized step averaged everything accumulated.
    for (rank, (_, synced)) in per_rank.iter().enumerate() {
        assert_close(synced, &expected, &format!("rank {rank} after no_sync + sync"));
    }
}

/// A model with a head that forward may leave out.
#[derive(ember_nn::Module)]
#[module(crate = ember_nn)]
pub(crate) struct TwoHeads {
    body: Linear,
    head: Linear,
    extra: Linear,
    training: ember_nn::Training,
}

impl TwoHeads {
    pub(crate) fn new() -> TwoHeads {
        let mut m = TwoHeads {
            body: Linear::new(4, 6, CPU).unwrap(),
            head: Linear::new(6, 3, CPU).unwrap(),
            extra: Linear::new(6, 3, CPU).unwrap(),
            training: ember_nn::Training::new(true),
        };
        m.to_dtype(DType::F64).unwrap();
        fill_params(&m, 0.0);
        m
    }

    pub(crate) fn forward(&self, x: &Tensor, use_extra: bool) -> ember_core::Result<Tensor> {
        let h = self.body.forward(x)?.tanh()?;
        let out = self.head.forward(&h)?;
        if use_extra {
            out.add(&self.extra.forward(&h)?)
        } else {
            Ok(out)
        }
    }
}

#[test]
fn find_unused_parameters_completes_the_reduction() {
    let (x, y) = data(8);
    let shard = |r: usize| (x.narrow(0, r * 4, 4).unwrap(), y.narrow(0, r * 4, 4).unwrap());
    // Reference gradients of rank 0's and rank 1's losses, separately.
    let single = |r: usize, use_extra: bool| {
        let m = TwoHeads::new();
        let (cx, cy) = shard(r);
        mse_loss(&m.forward(&cx, use_extra).unwrap(), &cy, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        grads(&m)
    };
    let (g0, g1) = (single(0, true), single(1, false));
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let r = pg.rank();
        let options = DdpOptions::new()
            .process_group(pg)
            .bucket_cap_mb(1e-4)
            .find_unused_parameters(true);
        let ddp = DistributedDataParallel::new(TwoHeads::new(), options).unwrap();
        let (cx, cy) = shard(r);
        let mut out = Vec::new();
        // Iteration 1: nobody uses `extra`; iteration 2: only rank 0 does.
        for use_extra in [false, r == 0] {
            ddp.zero_grad().unwrap();
            let pred = ddp.forward_with(|m| m.forward(&cx, use_extra)).unwrap();
            mse_loss(&pred, &cy, Reduction::Mean).unwrap().backward().unwrap();
            out.push(grads(&ddp));
        }
        out
    });
    // Parameters: body.weight, body.bias, head.weight, head.bias, extra.weight, extra.bias.
    for (rank, got) in per_rank.iter().enumerate() {
        let first = &got[0];
        assert!(
            first[4].is_none() && first[5].is_none(),
            "rank {rank}: no rank used extra, so no grad"
        );
        assert!(first[..4].iter().all(Option::is_some));
        // Second iteration: every parameter gets the average of the ranks' gradients, extra
        // included (rank 1 contributes zeros for it).
        let second = &got[1];
        for i in 0..6 {
            let a = g0[i].clone().unwrap();
            let b = g1[i].clone().unwrap_or_else(|| vec![0.0; a.len()]);
            let avg: Vec<f64> = a.iter().zip(&b).map(|(u, v)| (u + v) / 2.0).collect();
            assert_close(
                &second[i..=i],
                &[Some(avg)],
                &format!("rank {rank}, parameter {i}"),
            );
        }
    }
}

#[test]
fn unused_parameters_without_find_unused_parameters_is_a_typed_error_not_a_hang() {
    let start = Instant::now();
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let r = pg.rank();
        let ddp = DistributedDataParallel::new(
            TwoHeads::new(),
            DdpOptions::new().process_group(pg).bucket_cap_mb(1e-4),
        )
        .unwrap();
        let (x, y) = data(4);
        let pred = ddp.forward_with(|m| m.forward(&x, false)).unwrap();
        let err = mse_loss(&pred, &y, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap_err();
        // The ranks stay usable: a forward using everything synchronizes again.
        ddp.zero_grad().unwrap();
        let pred = ddp.forward_with(|m| m.forward(&x, true)).unwrap();
        mse_loss(&pred, &y, Reduction::Mean).unwrap().backward().unwrap();
        assert!(ddp.parameters().iter().all(|p| p.grad().is_some()), "rank {r}");
        err
    });
    assert!(start.elapsed() < TIMEOUT, "took {:?}", start.elapsed());
    for err in per_rank {
        match &err {
            Error::UnusedParameters { names, .. } => {
                assert_eq!(names, &["extra.weight", "extra.bias"], "{err}");
                assert!(err.to_string().contains("find_unused_parameters"), "{err}");
            }
            other => panic!("expected UnusedParameters, got {other:?}"),
        }
    }
}

/// Layers registered in one order (a, b, c) and used in another (c, a, b).
#[derive(ember_nn::Module)]
#[module(crate = ember_nn)]
struct Shuffled {
    a: Linear,
    b: Linear,
    c: Linear,
    training: ember_nn::Training,
}

impl Forward for Shuffled {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let h = self.c.forward(x)?.tanh()?;
        let h = self.a.forward(&h)?.tanh()?;
        self.b.forward(&h)
    }
}

#[test]
fn buckets_are_rebuilt_in_the_order_gradients_became_ready() {
    let make = || {
        let mut m = Shuffled {
            a: Linear::new(5, 5, CPU).unwrap(),
            b: Linear::new(5, 2, CPU).unwrap(),
            c: Linear::new(3, 5, CPU).unwrap(),
            training: ember_nn::Training::new(true),
        };
        m.to_dtype(DType::F64).unwrap();
        fill_params(&m, 0.0);
        m
    };
    let x = Tensor::from_vec(
        (0..12).map(|i| i as f64 / 6.0 - 1.0).collect::<Vec<_>>(),
        [4, 3],
        CPU,
    )
    .unwrap();
    // Reference gradients, and the order in which backward stored them.
    let m = make();
    let order = Arc::new(Mutex::new(Vec::new()));
    for (i, p) in m.parameters().iter().enumerate() {
        let order = order.clone();
        p.register_post_accumulate_grad_hook(move |_| Ok(order.lock().unwrap().push(i)))
            .unwrap();
    }
    m.forward(&x)
        .unwrap()
        .pow_scalar(2.0)
        .unwrap()
        .mean_all()
        .unwrap()
        .backward()
        .unwrap();
    let expected = grads(&m);
    let ready_order = order.lock().unwrap().clone();
    // a = 0, 1; b = 2, 3; c = 4, 5 (weight, bias): b's first, then a's, then c's.
    let blocks: Vec<usize> = ready_order.iter().map(|i| i / 2).collect();
    assert_eq!(blocks, [1, 1, 0, 0, 2, 2], "ready order {ready_order:?}");

    for cap_mb in [1e-6, 1.2e-4] {
        let per_rank = run_ranks(2, TIMEOUT, |pg| {
            let ddp = DistributedDataParallel::new(
                make(),
                DdpOptions::new().process_group(pg).bucket_cap_mb(cap_mb),
            )
            .unwrap();
            let initial = ddp.bucket_indices();
            assert!(!ddp.has_rebuilt_buckets());
            let mut per_step = Vec::new();
            for _ in 0..2 {
                ddp.zero_grad().unwrap();
                ddp.forward(&x)
                    .unwrap()
                    .pow_scalar(2.0)
                    .unwrap()
                    .mean_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                per_step.push(grads(&ddp));
            }
            assert!(ddp.has_rebuilt_buckets());
            (initial, ddp.bucket_indices(), per_step)
        });
        for (initial, rebuilt, per_step) in per_rank {
            // Initially: reverse registration order.
            let flat: Vec<usize> = initial.concat();
            assert_eq!(flat, [5, 4, 3, 2, 1, 0], "cap {cap_mb}");
            // Rebuilt: the order the gradients became ready in.
            assert_eq!(rebuilt.concat(), ready_order, "cap {cap_mb}: buckets {rebuilt:?}");
            if cap_mb == 1e-6 {
                assert_eq!(rebuilt.len(), 6, "one parameter per bucket");
            } else {
                assert!(rebuilt.len() > 1 && rebuilt.len() < 6, "{rebuilt:?}");
            }
            // The same data on both ranks: the average is the single-process gradient, with the
            // first buckets and with the rebuilt ones.
            for g in &per_step {
                assert_close(g, &expected, &format!("cap {cap_mb}"));
            }
        }
    }
}

#[test]
fn buffers_are_broadcast_from_rank_0_every_forward() {
    for broadcast in [true, false] {
        let per_rank = run_ranks(2, TIMEOUT, |pg| {
            let r = pg.rank();
            let bn = Sequential::new()
                .with(Linear::new(3, 2, CPU).unwrap())
                .with(BatchNorm1d::new(2, CPU).unwrap());
            {
                let _g = no_grad();
                // Different buffers per rank before wrapping: construction makes them equal.
                for b in bn.buffers() {
                    b.fill_(100.0 + r as f64).unwrap();
                }
            }
            bn.eval(); // running statistics used, not updated
            let ddp = DistributedDataParallel::new(
                bn,
                DdpOptions::new().process_group(pg).broadcast_buffers(broadcast),
            )
            .unwrap();
            let at_construction: Vec<f64> = ddp.buffers()[0].to_vec_f64().unwrap();
            {
                let _g = no_grad();
                for b in ddp.buffers() {
                    b.fill_(10.0 + r as f64).unwrap();
                }
            }
            let x = Tensor::ones([4, 3], DType::F32, CPU).unwrap();
            ddp.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
            (at_construction, ddp.buffers()[0].to_vec_f64().unwrap())
        });
        for (r, (at_construction, after_forward)) in per_rank.into_iter().enumerate() {
            assert_eq!(
                at_construction,
                [100.0, 100.0],
                "rank {r}: rank 0's buffers at construction"
            );
            let expected = if broadcast { 10.0 } else { 10.0 + r as f64 };
            assert_eq!(
                after_forward, [expected; 2],
                "rank {r}, broadcast_buffers={broadcast}"
            );
        }
    }
}

#[test]
fn ranks_wrapping_different_models_get_an_error_on_every_rank() {
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let m = if pg.rank() == 0 {
            Sequential::new().with(Linear::new(4, 3, CPU).unwrap())
        } else {
            Sequential::new().with(Linear::new(3, 4, CPU).unwrap())
        };
        DistributedDataParallel::new(m, DdpOptions::new().process_group(pg)).map(drop)
    });
    for r in per_rank {
        assert!(
            matches!(
                r,
                Err(Error::InvalidArgument {
                    op: "DistributedDataParallel",
                    ..
                })
            ),
            "{r:?}"
        );
    }
    // Bad options are refused before anything is sent.
    run_ranks(1, TIMEOUT, |pg| {
        let m = Sequential::new().with(Linear::new(4, 3, CPU).unwrap());
        assert!(
            DistributedDataParallel::new(m, DdpOptions::new().process_group(pg).bucket_cap_mb(-1.0)).is_err()
        );
    });
}

#[test]
fn a_single_rank_trains_as_without_ddp() {
    let expected = reference(2, 8);
    let got = run_ranks(1, TIMEOUT, |pg| ddp_run(pg, DdpOptions::new(), 2, 8)).remove(0);
    for s in 0..2 {
        assert_close(&got[s], &expected[s], &format!("step {s}"));
    }
    // And the wrapped module's names carry PyTorch's `module.` prefix.
    run_ranks(1, TIMEOUT, |pg| {
        let ddp = DistributedDataParallel::new(mlp(), DdpOptions::new().process_group(pg)).unwrap();
        assert_eq!(ddp.named_parameters()[0].0, "module.0.weight");
        assert_eq!(values(&ddp), values(ddp.module()));
    });
}

#[test]
fn grad_scaler_skips_the_step_on_every_rank_when_one_rank_overflows() {
    use ember_nn::amp::{GradScaler, GradScalerConfig};
    for poison in [false, true] {
        let per_rank = run_ranks(2, TIMEOUT, |pg| {
            let r = pg.rank();
            let ddp = DistributedDataParallel::new(mlp(), DdpOptions::new().process_group(pg)).unwrap();
            let mut opt = SGD::new(
                ddp.parameters(),
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )
            .unwrap();
            let mut scaler = GradScaler::with_config(GradScalerConfig::default()).unwrap();
            let before = values(&ddp);
            let (mut x, y) = data(4);
            if poison && r == 1 {
                x = x.mul_scalar(f64::INFINITY).unwrap(); // only rank 1's gradients overflow
            }
            let loss = mse_loss(&ddp.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            (before == values(&ddp), scaler.get_scale().unwrap())
        });
        // The averaged gradients carry rank 1's inf/NaN to every rank, so all skip (and back
        // the scale off) together; without it all step.
        for (r, (unchanged, scale)) in per_rank.into_iter().enumerate() {
            assert_eq!(unchanged, poison, "rank {r}, poison {poison}");
            assert_eq!(scale, if poison { 32768.0 } else { 65536.0 }, "rank {r}");
        }
    }
}

/// DDP over CUDA parameters (the CPU backend reduces them through host copies).
#[test]
#[ignore = "needs a CUDA device"]
fn ddp_on_cuda_parameters_matches_the_cpu_reference() {
    assert!(
        ember_core::cuda::is_available(),
        "this test needs a CUDA device; run it on a GPU machine (CUDA_TESTS_REQUIRED=1 makes its absence a failure)"
    );
    let gpu = Device::Cuda(0);
    let expected = reference(2, 8);
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let r = pg.rank();
        let mut m = mlp();
        fill_params(&m, r as f64);
        m.to_device(gpu).unwrap();
        let ddp =
            DistributedDataParallel::new(m, DdpOptions::new().process_group(pg).bucket_cap_mb(1e-4)).unwrap();
        let mut opt = SGD::new(
            ddp.parameters(),
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
        let (x, y) = data(8);
        let (x, y) = (
            x.narrow(0, r * 4, 4).unwrap().to(gpu).unwrap(),
            y.narrow(0, r * 4, 4).unwrap().to(gpu).unwrap(),
        );
        (0..2)
            .map(|_| {
                ddp.zero_grad().unwrap();
                mse_loss(&ddp.forward(&x).unwrap(), &y, Reduction::Mean)
                    .unwrap()
                    .backward()
                    .unwrap();
                assert!(ddp.parameters().iter().all(|p| p.grad().unwrap().device() == gpu));
                let g = grads(&ddp);
                opt.step().unwrap();
                g
            })
            .collect::<Vec<_>>()
    });
    for (r, got) in per_rank.iter().enumerate() {
        for s in 0..2 {
            for (a, b) in got[s].iter().zip(&expected[s]) {
                for (u, v) in a.as_ref().unwrap().iter().zip(b.as_ref().unwrap()) {
                    assert!(
                        (u - v).abs() <= 1e-9 + 1e-6 * v.abs(),
                        "rank {r}, step {s}: {u} vs {v}"
                    );
                }
            }
        }
    }
}

/// A weight shared by two layers (tied) and a frozen one.
#[derive(ember_nn::Module)]
#[module(crate = ember_nn)]
struct Tied {
    first: Linear,
    second: Linear,
    frozen: Linear,
    training: ember_nn::Training,
}

impl Forward for Tied {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let h = self.first.forward(x)?.tanh()?;
        self.frozen.forward(&self.second.forward(&h)?.tanh()?)
    }
}

#[test]
fn tied_parameters_are_reduced_once_and_frozen_ones_not_at_all() {
    let make = || {
        let first = Linear::new(4, 4, CPU).unwrap();
        let mut second = Linear::new(4, 4, CPU).unwrap();
        second.weight = first.weight.clone(); // tied, as PyTorch's `second.weight = first.weight`
        let frozen = Linear::new(4, 2, CPU).unwrap();
        for p in frozen.parameters() {
            p.requires_grad_(false).unwrap();
        }
        let mut m = Tied {
            first,
            second,
            frozen,
            training: ember_nn::Training::new(true),
        };
        m.to_dtype(DType::F64).unwrap();
        // to_dtype replaces tensors: tie again and refreeze.
        m.second.weight = m.first.weight.clone();
        for p in m.frozen.parameters() {
            p.requires_grad_(false).unwrap();
        }
        fill_params(&m, 0.0);
        m
    };
    let (x, y) = data(8);
    let m = make();
    mse_loss(
        &m.forward(&x).unwrap(),
        &y.narrow(1, 0, 2).unwrap(),
        Reduction::Mean,
    )
    .unwrap()
    .backward()
    .unwrap();
    let expected = grads(&m);
    let per_rank = run_ranks(2, TIMEOUT, |pg| {
        let r = pg.rank();
        let ddp =
            DistributedDataParallel::new(make(), DdpOptions::new().process_group(pg).bucket_cap_mb(1e-6))
                .unwrap();
        // first.weight (= second.weight), first.bias, second.bias: the frozen layer is left out.
        assert_eq!(ddp.bucket_indices().concat().len(), 3);
        let (cx, cy) = (
            x.narrow(0, r * 4, 4).unwrap(),
            y.narrow(0, r * 4, 4).unwrap().narrow(1, 0, 2).unwrap(),
        );
        mse_loss(&ddp.forward(&cx).unwrap(), &cy, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        grads(&ddp)
    });
    for got in per_rank {
        assert!(
            got[got.len() - 2..].iter().all(Option::is_none),
            "frozen: no gradient"
        );
        let n = got.len() - 2;
        assert_close(&got[..n], &expected[..n], "tied and free parameters");
    }
}

/// Note [DDP one-parameter buckets]: with every parameter in a bucket of its own, backward
/// averages each `.grad` where it lies: no gradient is copied into a bucket or back, while one
/// shared bucket copies every gradient both ways.
#[test]
fn one_parameter_buckets_average_grad_where_it_lies() {
    use ember_core::profiler::{self, ProfilerActivity};
    // The `copy_` ops backward runs on the calling thread (the CPU backend writes each
    // collective's result back on a thread of its own), and the gradients.
    let copies = |options: DdpOptions| {
        run_ranks(1, TIMEOUT, |pg| {
            let ddp = DistributedDataParallel::new(mlp(), options.clone().process_group(pg)).unwrap();
            fill_params(&ddp, 0.0);
            let (x, y) = data(4);
            let loss = mse_loss(&ddp.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
            let mut prof = profiler::profile()
                .activities([ProfilerActivity::Cpu])
                .start()
                .unwrap();
            {
                let _r = profiler::record_function("backward under test");
                loss.backward().unwrap();
            }
            prof.stop().unwrap();
            // This thread's ops inside the range: other tests run beside this one.
            let events = prof.events();
            let range = events.iter().find(|e| e.name == "backward under test").unwrap();
            let copies = events
                .iter()
                .filter(|e| e.name == "copy_" && e.thread == range.thread)
                .filter(|e| e.start_ns >= range.start_ns && e.end_ns <= range.end_ns)
                .count();
            (copies, grads(&ddp))
        })
        .remove(0)
    };
    let (shared, expected) = copies(DdpOptions::new());
    let (own, got) = copies(DdpOptions::new().bucket_cap_mb(1e-6));
    let n = mlp().parameters().len();
    assert_eq!(
        shared,
        2 * n,
        "one shared bucket: a copy in and out per parameter"
    );
    assert_eq!(own, 0, "one-parameter buckets copy nothing");
    assert_eq!(got, expected);
}
