//! DDP communication hooks over the CPU backend, ranks as threads: the built-in hooks against
//! the gradients DDP's own reduction gives and against the rounding they must show, a user
//! hook's calls (once per bucket per synchronizing step, in bucket order, none under
//! `no_sync`), `find_unused_parameters`, and the registration errors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember_core::{DType, Device, Error, Tensor};
use ember_distributed::{
    default_hooks, BuiltinCommHookType, CommFuture, DdpOptions, DistributedDataParallel, GradBucket, ReduceOp,
};
use ember_nn::functional::mse_loss;
use ember_nn::{Forward, ModuleExt, Reduction, Sequential};
use half::{bf16, f16};

use crate::common::run_ranks;
use crate::ddp::{data, fill_params, grads, mlp, TwoHeads};

const TIMEOUT: Duration = Duration::from_secs(20);

/// [`mlp`] in float32, its parameters filled for `salt` (a rank's own until DDP broadcasts).
fn mlp32(salt: f64) -> Sequential {
    let mut m = mlp();
    m.to_dtype(DType::F32).unwrap();
    fill_params(&m, salt);
    m
}

fn grads32<M: ember_nn::Module>(m: &M) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Hook {
    None,
    AllReduce,
    Fp16,
    Bf16,
}

/// The built-in hook type of `hook` (not [`Hook::None`]).
pub(crate) fn builtin_type(hook: Hook) -> BuiltinCommHookType {
    match hook {
        Hook::None | Hook::AllReduce => BuiltinCommHookType::Allreduce,
        Hook::Fp16 => BuiltinCommHookType::Fp16Compress,
        Hook::Bf16 => BuiltinCommHookType::Bf16Compress,
    }
}

pub(crate) fn register<M: ember_nn::Module>(ddp: &DistributedDataParallel<M>, hook: Hook) {
    match hook {
        Hook::None => Ok(()),
        Hook::AllReduce => ddp.register_comm_hook(None, default_hooks::allreduce_hook),
        Hook::Fp16 => ddp.register_comm_hook(None, default_hooks::fp16_compress_hook),
        Hook::Bf16 => ddp.register_comm_hook(None, default_hooks::bf16_compress_hook),
    }
    .unwrap()
}

/// What the compress hooks compute from two ranks' local gradients `a` and `b`: each cast to
/// the half type and halved there, summed in float32 and rounded once (the CPU backend's sum
/// of halves), cast back.
pub(crate) fn compressed_average(a: f32, b: f32, hook: Hook) -> f32 {
    match hook {
        Hook::Fp16 => {
            let half = |v: f32| f16::from_f32(f16::from_f32(v).to_f32() / 2.0).to_f32();
            f16::from_f32(half(a) + half(b)).to_f32()
        }
        Hook::Bf16 => {
            let half = |v: f32| bf16::from_f32(bf16::from_f32(v).to_f32() / 2.0).to_f32();
            bf16::from_f32(half(a) + half(b)).to_f32()
        }
        _ => (a + b) / 2.0,
    }
}

#[test]
fn builtin_hooks_average_as_ddp_does_and_compress_hooks_round_as_pytorchs() {
    let (x, y) = data(8);
    let (x, y) = (x.to_dtype(DType::F32).unwrap(), y.to_dtype(DType::F32).unwrap());
    let shard = |r: usize| (x.narrow(0, r * 4, 4).unwrap(), y.narrow(0, r * 4, 4).unwrap());
    // Each rank's local gradients (rank 0's parameters, which DDP broadcasts), in one process.
    let local: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|r| {
            let m = mlp32(0.0);
            let (cx, cy) = shard(r);
            mse_loss(&m.forward(&cx).unwrap(), &cy, Reduction::Mean)
                .unwrap()
                .backward()
                .unwrap();
            grads32(&m)
        })
        .collect();
    let expected = |hook: Hook| -> Vec<Vec<f32>> {
        local[0]
            .iter()
            .zip(&local[1])
            .map(|(a, b)| {
                a.iter()
                    .zip(b)
                    .map(|(&u, &v)| compressed_average(u, v, hook))
                    .collect()
            })
            .collect()
    };
    type Config = (&'static str, fn() -> DdpOptions);
    let configs: Vec<Config> = vec![
        ("one bucket", DdpOptions::new),
        // Each parameter alone: the hook's buffer is the parameter's own .grad.
        ("one parameter per bucket", || {
            DdpOptions::new().bucket_cap_mb(1e-6)
        }),
        ("gradient_as_bucket_view", || {
            DdpOptions::new()
                .bucket_cap_mb(1e-4)
                .gradient_as_bucket_view(true)
        }),
    ];
    for (what, options) in &configs {
        let run_as = |hook: Hook, builtin: bool| {
            run_ranks(2, TIMEOUT, |pg| {
                let r = pg.rank();
                let ddp = DistributedDataParallel::new(mlp32(r as f64), options().process_group(pg)).unwrap();
                match builtin {
                    true => ddp.register_builtin_comm_hook(builtin_type(hook)).unwrap(),
                    false => register(&ddp, hook),
                }
                let (cx, cy) = shard(r);
                mse_loss(&ddp.forward(&cx).unwrap(), &cy, Reduction::Mean)
                    .unwrap()
                    .backward()
                    .unwrap();
                grads32(&ddp)
            })
        };
        let run = |hook: Hook| run_as(hook, false);
        let plain = run(Hook::None);
        // DDP's own average is the float32 mean of the local gradients (the premise of the
        // emulation below).
        assert_eq!(plain[0], expected(Hook::None), "{what}: DDP without a hook");
        assert_eq!(plain[1], plain[0], "{what}");
        // Halving before the sum is exact over two ranks: bitwise DDP's own.
        let allreduce = run(Hook::AllReduce);
        assert_eq!(allreduce, plain, "{what}: allreduce_hook");
        // The built-in registration calls the same functions.
        assert_eq!(run_as(Hook::AllReduce, true), plain, "{what}: built-in allreduce");
        for hook in [Hook::Fp16, Hook::Bf16] {
            let got = run(hook);
            assert_eq!(run_as(hook, true), got, "{what}: built-in {hook:?}");
            assert_eq!(got[1], got[0], "{what}: {hook:?}: the ranks disagree");
            assert_eq!(got[0], expected(hook), "{what}: {hook:?}");
            // The compression shows: most values are not the float32 average, and all are
            // within the half type's rounding (unit roundoff `u`) of the local gradients of it.
            let u = if hook == Hook::Bf16 {
                2f32.powi(-8)
            } else {
                2f32.powi(-11)
            };
            let (mut differ, mut total) = (0, 0);
            let locals = local[0].iter().flatten().zip(local[1].iter().flatten());
            for ((g, e), (a, b)) in got[0].iter().flatten().zip(plain[0].iter().flatten()).zip(locals) {
                total += 1;
                differ += (g != e) as usize;
                let bound = 2.0 * u * (a.abs() + b.abs()) + 1e-7;
                assert!((g - e).abs() <= bound, "{what}: {hook:?}: {g} vs {e}");
            }
            assert!(
                differ * 2 > total,
                "{what}: {hook:?}: only {differ} of {total} values were rounded"
            );
        }
    }
}

/// What a user hook saw of one bucket: its index, `is_last`, its parameters (positions in
/// `parameters()`), its offsets, and whether its buffer held the local gradients.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    index: usize,
    is_last: bool,
    params: Vec<usize>,
    offsets: Vec<usize>,
    buffer_was_local: bool,
}

/// A user hook: sums the bucket across ranks, then scales it by 1/4 (half the average over two
/// ranks), logging what it saw.
fn sum_then_quarter(
    log: &Mutex<Vec<Seen>>,
    positions: &[usize],
    bucket: &GradBucket,
) -> ember_core::Result<CommFuture> {
    let at = |p: &Tensor| positions.iter().position(|&q| q == p.data_ptr()).unwrap();
    let gradients = bucket.gradients()?;
    let buffer_was_local = bucket.parameters().iter().zip(&gradients).all(|(p, g)| {
        g.dims() == p.dims() && g.to_vec_f64().unwrap() == p.grad().unwrap().to_vec_f64().unwrap()
    });
    log.lock().unwrap().push(Seen {
        index: bucket.index(),
        is_last: bucket.is_last(),
        params: bucket.parameters().iter().map(at).collect(),
        offsets: bucket.offsets().to_vec(),
        buffer_was_local,
    });
    let buffer = bucket.buffer().clone();
    let work = bucket.process_group().all_reduce_async(&buffer, ReduceOp::Sum)?;
    // Out of place: DDP copies the new tensor into the bucket.
    Ok(CommFuture::new(work, buffer).then(|t| t.mul_scalar(0.25)))
}

#[test]
fn a_user_hook_runs_once_per_bucket_of_each_synchronizing_step() {
    let (x, y) = data(16);
    let chunk = |k: usize| (x.narrow(0, k * 4, 4).unwrap(), y.narrow(0, k * 4, 4).unwrap());
    // Per rank: the gradients after (no_sync step, then a synchronizing one), after a second
    // synchronizing step, and the hook's log.
    type Out = (
        Vec<Option<Vec<f64>>>,
        Vec<Option<Vec<f64>>>,
        Vec<Vec<Seen>>,
        Vec<Vec<Vec<usize>>>,
    );
    let run = |hooked: bool| -> Vec<Out> {
        run_ranks(2, TIMEOUT, |pg| {
            let r = pg.rank();
            let m = mlp();
            fill_params(&m, r as f64);
            let ddp =
                DistributedDataParallel::new(m, DdpOptions::new().process_group(pg).bucket_cap_mb(1e-4))
                    .unwrap();
            let log = Arc::new(Mutex::new(Vec::new()));
            if hooked {
                let positions: Vec<usize> = ddp.parameters().iter().map(Tensor::data_ptr).collect();
                let state = (log.clone(), positions);
                ddp.register_comm_hook(state, |(log, positions), bucket| {
                    sum_then_quarter(log, positions, bucket)
                })
                .unwrap();
            }
            let step = |k: usize| {
                let (cx, cy) = chunk(k);
                mse_loss(&ddp.forward(&cx).unwrap(), &cy, Reduction::Mean)
                    .unwrap()
                    .backward()
                    .unwrap();
            };
            let (mut seen, mut buckets) = (Vec::new(), Vec::new());
            {
                let _guard = ddp.no_sync();
                step(r);
            }
            assert!(log.lock().unwrap().is_empty(), "the hook ran under no_sync");
            buckets.push(ddp.bucket_indices());
            step(2 + r);
            seen.push(std::mem::take(&mut *log.lock().unwrap()));
            let first = grads(&ddp);
            // The second step reduces the buckets rebuilt after the first.
            assert!(ddp.has_rebuilt_buckets());
            ddp.zero_grad().unwrap();
            buckets.push(ddp.bucket_indices());
            step(r);
            seen.push(std::mem::take(&mut *log.lock().unwrap()));
            (first, grads(&ddp), seen, buckets)
        })
    };
    let plain = run(false);
    let hooked = run(true);
    let quarter = |g: &Vec<Option<Vec<f64>>>| -> Vec<Option<Vec<f64>>> {
        g.iter()
            .map(|v| v.as_ref().map(|v| v.iter().map(|x| x / 2.0).collect()))
            .collect()
    };
    for rank in 0..2 {
        let (first, second, seen, buckets) = &hooked[rank];
        // Sum / 4 is DDP's average halved, exactly (powers of two).
        assert_eq!(
            first,
            &quarter(&plain[rank].0),
            "rank {rank}: after no_sync + sync"
        );
        assert_eq!(second, &quarter(&plain[rank].1), "rank {rank}: second step");
        assert!(
            buckets[0].len() > 2,
            "the test wants several buckets: {:?}",
            buckets[0]
        );
        for (step, (seen, buckets)) in seen.iter().zip(buckets).enumerate() {
            let expected: Vec<Seen> = buckets
                .iter()
                .enumerate()
                .map(|(index, params)| {
                    let sizes: Vec<usize> = params.iter().map(|&i| mlp().parameters()[i].numel()).collect();
                    Seen {
                        index,
                        is_last: index + 1 == buckets.len(),
                        params: params.clone(),
                        offsets: sizes
                            .iter()
                            .scan(0, |at, n| Some(std::mem::replace(at, *at + n)))
                            .collect(),
                        buffer_was_local: true,
                    }
                })
                .collect();
            assert_eq!(seen, &expected, "rank {rank}, step {step}");
        }
    }
}

#[test]
fn hooks_work_with_find_unused_parameters() {
    let (x, y) = data(8);
    let shard = |r: usize| (x.narrow(0, r * 4, 4).unwrap(), y.narrow(0, r * 4, 4).unwrap());
    let run = |hooked: bool| {
        run_ranks(2, TIMEOUT, |pg| {
            let r = pg.rank();
            let options = DdpOptions::new()
                .process_group(pg)
                .bucket_cap_mb(1e-4)
                .find_unused_parameters(true);
            let ddp = DistributedDataParallel::new(TwoHeads::new(), options).unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            if hooked {
                ddp.register_comm_hook(calls.clone(), |calls, bucket| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    default_hooks::allreduce_hook(&None, bucket)
                })
                .unwrap();
            }
            let (cx, cy) = shard(r);
            let mut out = Vec::new();
            // Iteration 1: nobody uses `extra`; iteration 2: only rank 0 does.
            for use_extra in [false, r == 0] {
                ddp.zero_grad().unwrap();
                let pred = ddp.forward_with(|m| m.forward(&cx, use_extra)).unwrap();
                mse_loss(&pred, &cy, Reduction::Mean).unwrap().backward().unwrap();
                out.push(grads(&ddp));
            }
            (out, calls.load(Ordering::SeqCst), ddp.bucket_indices().len())
        })
    };
    let plain = run(false);
    let hooked = run(true);
    for rank in 0..2 {
        let (out, calls, buckets) = &hooked[rank];
        assert_eq!(out, &plain[rank].0, "rank {rank}");
        // extra (parameters 4 and 5): no gradient after the first iteration, as without a hook.
        assert!(out[0][4].is_none() && out[1][4].is_some(), "rank {rank}");
        assert_eq!(
            *calls,
            2 * buckets,
            "rank {rank}: one call per bucket per iteration"
        );
    }
}

#[test]
fn registering_twice_or_after_forward_is_refused_and_a_bad_hook_result_is_an_error() {
    run_ranks(1, TIMEOUT, |pg| {
        let options = || DdpOptions::new().process_group(pg.clone());
        let (x, y) = data(4);
        let loss = |ddp: &DistributedDataParallel<Sequential>| {
            mse_loss(&ddp.forward(&x)?, &y, Reduction::Mean)?.backward()
        };
        let message = |e: Error| match e {
            Error::InvalidArgument { msg, .. } => msg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };

        let ddp = DistributedDataParallel::new(mlp(), options()).unwrap();
        ddp.register_comm_hook(None, default_hooks::allreduce_hook)
            .unwrap();
        let again = ddp.register_comm_hook(None, default_hooks::bf16_compress_hook);
        assert!(message(again.unwrap_err()).contains("can only be registered once"));
        loss(&ddp).unwrap(); // the first hook still reduces

        let ddp = DistributedDataParallel::new(mlp(), options()).unwrap();
        loss(&ddp).unwrap();
        let late = ddp.register_comm_hook(None, default_hooks::allreduce_hook);
        assert!(message(late.unwrap_err()).contains("must be called before the first forward"));

        // A future whose value is not the bucket's size fails backward, naming the bucket.
        let ddp = DistributedDataParallel::new(mlp(), options()).unwrap();
        ddp.register_comm_hook((), |_, _| {
            Ok(CommFuture::ready(Tensor::zeros([1], DType::F64, Device::Cpu)?))
        })
        .unwrap();
        let msg = message(loss(&ddp).unwrap_err());
        assert!(msg.contains("returned a tensor of 1 elements"), "{msg}");

        // A hook's own error is backward's.
        let ddp = DistributedDataParallel::new(mlp(), options()).unwrap();
        ddp.register_comm_hook((), |_, _| Err(Error::invalid("my_hook", "no network today")))
            .unwrap();
        assert!(message(loss(&ddp).unwrap_err()).contains("no network today"));
    });
}
