//! The NCCL backend. Without GPUs (CI): creating an NCCL group is a typed error, never a
//! panic. On two GPUs (ignored by default; run with `--include-ignored`): every collective
//! against expected values, with ranks as threads and as processes under `ember-run`, and DDP's
//! gradients against one process's full-batch gradients.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ember_core::{cuda, DType, Device, Error, Tensor};
use ember_distributed::{BackendKind, DdpOptions, ProcessGroup, ReduceOp, Store, TcpStore};
use half::{bf16, f16};

const TIMEOUT: Duration = Duration::from_secs(60);

/// One test at a time makes NCCL groups in this process. NCCL's kernels wait on the device for
/// their peers, so the operations of two communicators on the same GPUs, issued concurrently
/// from several threads, can deadlock: NCCL's guide ("Using multiple NCCL communicators
/// concurrently") asks for a lock. The test harness runs tests on parallel threads; two of these
/// tests at once hung until the harness's timeout on two H100s.
static ONE_NCCL_TEST: Mutex<()> = Mutex::new(());

/// Holds [`ONE_NCCL_TEST`] (a test that failed while holding it does not poison the others).
fn one_nccl_test() -> MutexGuard<'static, ()> {
    ONE_NCCL_TEST.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` as `n` ranks, each a thread with its own NCCL group on `cuda:{rank}`.
pub fn run_nccl_ranks<T: Send>(n: usize, f: impl Fn(ProcessGroup, usize) -> T + Sync) -> Vec<T> {
    let _one = one_nccl_test();
    crate::common::run_ranks_with(
        n,
        TIMEOUT,
        |store, rank| ProcessGroup::on_device(BackendKind::Nccl, store, rank, n, TIMEOUT, rank),
        f,
    )
}

fn on<T: ember_core::cpu::CpuElement>(v: Vec<T>, dev: usize) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, Device::Cpu)
        .unwrap()
        .to(Device::Cuda(dev))
        .unwrap()
}

/// Every collective of an NCCL group on `cuda:{dev}` against values computed here.
pub fn check_nccl_collectives(pg: &ProcessGroup, dev: usize) {
    let (r, n) = (pg.rank(), pg.size());
    let nf = n as f64;
    let tri = (n * (n + 1) / 2) as f32;

    // all_reduce: every op, several dtypes; uneven length.
    let len = 1001;
    let x = on((0..len).map(|i| (r + 1) as f32 * i as f32).collect(), dev);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(
        x.to_vec::<f32>().unwrap(),
        (0..len).map(|i| tri * i as f32).collect::<Vec<_>>()
    );
    let x = on(vec![r as f64, 1.0 + r as f64], dev);
    pg.all_reduce(&x, ReduceOp::Avg).unwrap();
    assert_eq!(x.to_vec::<f64>().unwrap(), [(nf - 1.0) / 2.0, (nf + 1.0) / 2.0]);
    let x = on(vec![r as i32, -(r as i32), 7], dev);
    pg.all_reduce(&x, ReduceOp::Max).unwrap();
    assert_eq!(x.to_vec::<i32>().unwrap(), [n as i32 - 1, 0, 7]);
    let x = on(vec![r as i64 + 5, -(r as i64)], dev);
    pg.all_reduce(&x, ReduceOp::Min).unwrap();
    assert_eq!(x.to_vec::<i64>().unwrap(), [5, -(n as i64 - 1)]);
    let x = on(vec![(r + 1) as f32, 2.0], dev);
    pg.all_reduce(&x, ReduceOp::Product).unwrap();
    let fact: f32 = (1..=n).map(|k| k as f32).product();
    assert_eq!(x.to_vec::<f32>().unwrap(), [fact, 2f32.powi(n as i32)]);
    let x = on(vec![f16::from_f32(0.5 * (r + 1) as f32); 5], dev);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(x.to_vec::<f16>().unwrap(), vec![f16::from_f32(0.5 * tri); 5]);
    let x = on(vec![bf16::from_f32((r + 1) as f32); 3], dev);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(x.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(tri); 3]);
    let x = on(vec![r == 0, false], dev);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap(); // logical or
    assert_eq!(x.to_vec::<bool>().unwrap(), [true, false]);

    // Async on a 2-D tensor: wait() orders the current stream after NCCL's, then a host read.
    let x = Tensor::full([4usize, 8], (r + 1) as f64, DType::F32, Device::Cuda(dev)).unwrap();
    let work = pg.all_reduce_async(&x, ReduceOp::Sum).unwrap();
    work.wait().unwrap();
    assert_eq!(x.dims(), [4, 8]);
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![tri; 32]);
    assert!(work.is_completed());

    // broadcast from the last rank and from rank 0.
    let x = on(vec![r as i64 * 10, r as i64 * 10 + 1], dev);
    pg.broadcast(&x, pg.global_rank(n - 1).unwrap()).unwrap();
    assert_eq!(
        x.to_vec::<i64>().unwrap(),
        [(n as i64 - 1) * 10, (n as i64 - 1) * 10 + 1]
    );
    let x = on(vec![r as f32; 3], dev);
    pg.broadcast_async(&x, 0).unwrap().wait().unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), [0.0; 3]);

    // all_gather into separate outputs, one of them 2-D.
    let input = on(vec![r as f32, r as f32 + 0.5], dev);
    let outputs: Vec<Tensor> = (0..n).map(|_| on(vec![0f32; 2], dev)).collect();
    pg.all_gather(&outputs, &input).unwrap();
    for (i, o) in outputs.iter().enumerate() {
        assert_eq!(o.to_vec::<f32>().unwrap(), [i as f32, i as f32 + 0.5]);
    }
    let outputs: Vec<Tensor> = (0..n)
        .map(|_| Tensor::zeros([1usize, 2], DType::I32, Device::Cuda(dev)).unwrap())
        .collect();
    pg.all_gather_async(&outputs, &on(vec![r as i32 * 3, 1], dev))
        .unwrap()
        .wait()
        .unwrap();
    for (i, o) in outputs.iter().enumerate() {
        assert_eq!(o.dims(), [1, 2]);
        assert_eq!(o.to_vec::<i32>().unwrap(), [i as i32 * 3, 1]);
    }

    // reduce_scatter: inputs[j] = [r + j, 1]; rank j gets [sum_r (r + j), n]; then Avg.
    let inputs: Vec<Tensor> = (0..n).map(|j| on(vec![(r + j) as f64, 1.0], dev)).collect();
    let out = on(vec![0f64; 2], dev);
    pg.reduce_scatter(&out, &inputs, ReduceOp::Sum).unwrap();
    let s: f64 = (0..n).map(|k| (k + r) as f64).sum();
    assert_eq!(out.to_vec::<f64>().unwrap(), [s, nf]);
    let out = on(vec![0f32; 2], dev);
    let inputs: Vec<Tensor> = (0..n).map(|j| on(vec![(r * j) as f32, 2.0], dev)).collect();
    pg.reduce_scatter_async(&out, &inputs, ReduceOp::Avg)
        .unwrap()
        .wait()
        .unwrap();
    let s: f32 = (0..n).map(|k| (k * r) as f32).sum();
    assert_eq!(out.to_vec::<f32>().unwrap(), [s / n as f32, 2.0]);

    pg.barrier().unwrap();
    pg.barrier_async().unwrap().wait().unwrap();

    // send/recv around the ring, even ranks sending first (ncclSend/ncclRecv are matched in
    // order; crossing first sends between two ranks could wait on each other's connection).
    let right = pg.global_rank((r + 1) % n).unwrap();
    let left = pg.global_rank((r + n - 1) % n).unwrap();
    let payload = on((0..100_000).map(|i| i as f32 + r as f32).collect(), dev);
    let into = on(vec![0f32; 100_000], dev);
    if r % 2 == 0 {
        pg.send(&payload, right).unwrap();
        pg.recv(&into, left).unwrap();
    } else {
        pg.recv(&into, left).unwrap();
        pg.send(&payload, right).unwrap();
    }
    let lr = (r + n - 1) % n;
    assert_eq!(
        into.to_vec::<f32>().unwrap()[..3],
        [lr as f32, 1.0 + lr as f32, 2.0 + lr as f32]
    );

    // Tensors the backend cannot take: typed errors, and the group stays usable.
    let cpu = Tensor::from_vec(vec![1f32], 1, Device::Cpu).unwrap();
    assert!(matches!(
        pg.all_reduce(&cpu, ReduceOp::Sum),
        Err(Error::DeviceMismatch { .. })
    ));
    let strided = Tensor::zeros([4usize, 4], DType::F32, Device::Cuda(dev))
        .unwrap()
        .narrow(1, 0, 2)
        .unwrap();
    assert!(matches!(
        pg.all_reduce(&strided, ReduceOp::Sum),
        Err(Error::InvalidArgument { .. })
    ));

    // A 64 MiB all_reduce.
    let big = Tensor::full(1usize << 24, 1.0, DType::F32, Device::Cuda(dev)).unwrap();
    pg.all_reduce(&big, ReduceOp::Sum).unwrap();
    assert!(big.to_vec::<f32>().unwrap().iter().all(|&v| v == n as f32));
}

#[test]
fn an_nccl_group_without_a_usable_gpu_or_library_is_a_typed_error() {
    // cuda:1000 exists nowhere: without NCCL or CUDA this is CudaUnavailable (saying what to
    // install), with them an InvalidArgument naming the device; never a panic.
    let store: Arc<dyn Store> = Arc::new(TcpStore::new("127.0.0.1", 0, true, TIMEOUT).unwrap());
    let e =
        ProcessGroup::on_device(BackendKind::Nccl, store, 0, 1, Duration::from_secs(5), 1000).unwrap_err();
    match &e {
        Error::CudaUnavailable { reason } => {
            assert!(reason.contains("NCCL") || reason.contains("CUDA"), "{e}")
        }
        Error::InvalidArgument { msg, .. } => assert!(msg.contains("cuda:1000"), "{e}"),
        other => panic!("unexpected error {other:?}"),
    }
    if ember_distributed::nccl::nccl().is_err() {
        assert!(e.to_string().contains("pip install nvidia-nccl"), "{e}");
    }
}

/// A group of one rank: every reduction leaves the tensor as it is (the backend skips NCCL's
/// kernel there), and work still orders the current stream.
#[test]
#[ignore = "needs a CUDA device"]
fn nccl_all_reduce_over_one_rank_leaves_the_tensor() {
    assert!(cuda::is_available(), "this test needs a CUDA device");
    run_nccl_ranks(1, |pg, dev| {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
        ] {
            let x = on(vec![1.5f32, -2.0, 3.25], dev);
            let y = x.mul_scalar(2.0).unwrap(); // queued before: the reduction comes after it
            let work = pg.all_reduce_async(&y, op).unwrap();
            work.wait().unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), [3.0, -4.0, 6.5], "{op:?}");
        }
    });
}

/// The flat collectives over one rank: NCCL copies (gather) or reduces over one rank
/// (scatter) straight between the caller's tensors.
#[test]
#[ignore = "needs a CUDA device"]
fn nccl_flat_collectives_over_one_rank() {
    assert!(cuda::is_available(), "this test needs a CUDA device");
    run_nccl_ranks(1, |pg, dev| {
        crate::common::check_flat_collectives(&pg, Device::Cuda(dev));
    });
}

/// fully_shard (with its clip_grad_norm_) and ZeroRedundancyOptimizer on one GPU against DDP +
/// AdamW there: the flat collectives, the all-gather node, the parameters freed after forward
/// and gathered again in backward, and the side streams (Note [FSDP streams]) on CUDA tensors.
#[test]
#[ignore = "needs a CUDA device"]
fn nccl_fully_shard_and_zero_over_one_gpu_match_ddp() {
    assert!(cuda::is_available(), "this test needs a CUDA device");
    run_nccl_ranks(1, |pg, dev| {
        crate::fsdp::fsdp_matches_ddp(&pg, Device::Cuda(dev));
        crate::fsdp::clip_matches_ddp(&pg, Device::Cuda(dev));
        crate::zero::zero_matches_ddp(&pg, Device::Cuda(dev));
    });
}

/// fully_shard's gather of f32 shards in bf16 and f16 on one GPU: the full parameters are the
/// parameters' `to_dtype` casts, bit for bit (the shards packed by one `foreach_copy_` of
/// casts, one launch).
#[test]
#[ignore = "needs a CUDA device"]
fn nccl_fully_shard_gathers_f32_shards_in_half_dtypes_over_one_gpu() {
    assert!(cuda::is_available(), "this test needs a CUDA device");
    run_nccl_ranks(1, |pg, _| crate::fsdp::gathers_in_half_dtypes(&pg));
}

/// The same on two GPUs (shards, reduce-scatters and ZeRO's broadcasts between them), and the
/// ShardedGradScaler keeping the ranks together; the gather in bf16 and f16.
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_fully_shard_and_zero_on_two_gpus_match_ddp() {
    crate::common::require_two_gpus();
    run_nccl_ranks(2, |pg, dev| {
        crate::fsdp::fsdp_matches_ddp(&pg, Device::Cuda(dev));
        crate::fsdp::clip_matches_ddp(&pg, Device::Cuda(dev));
        crate::fsdp::sharded_scaler_keeps_ranks_together(&pg, Device::Cuda(dev));
        crate::zero::zero_matches_ddp(&pg, Device::Cuda(dev));
        crate::fsdp::gathers_in_half_dtypes(&pg);
    });
}

#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_collectives_on_two_gpus_as_threads() {
    crate::common::require_two_gpus();
    run_nccl_ranks(2, |pg, dev| {
        check_nccl_collectives(&pg, dev);
        crate::common::check_flat_collectives(&pg, Device::Cuda(dev));
        // A subgroup of both ranks, on the parent's device.
        let sub = pg.new_group(&[0, 1]).unwrap().unwrap();
        let x = on(vec![pg.rank() as f32], dev);
        sub.all_reduce(&x, ReduceOp::Max).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), [1.0]);
    });
}

#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_work_wait_on_two_gpus_orders_the_current_stream_without_a_host_wait() {
    crate::common::require_two_gpus();
    run_nccl_ranks(2, |pg, dev| {
        let x = Tensor::full(1usize << 20, 1.0, DType::F32, Device::Cuda(dev)).unwrap();
        let before = cuda::host_sync_count();
        let work = pg.all_reduce_async(&x, ReduceOp::Sum).unwrap();
        work.wait().unwrap();
        assert_eq!(cuda::host_sync_count(), before, "wait() must not block the host");
        let y = (&x * 3.0).unwrap(); // queued after the all_reduce on the current stream
        assert!(y.to_vec::<f32>().unwrap().iter().all(|&v| v == 6.0));
    });
}

/// Each step's gradients on `rank` against one process's full-batch ones (float64 summed in
/// another order on the GPU: within 1e-10 + 1e-7 relative).
fn assert_steps_close(got: &[Vec<Option<Vec<f64>>>], expected: &[Vec<Option<Vec<f64>>>], rank: usize) {
    assert_eq!(got.len(), expected.len(), "rank {rank}: steps");
    for (s, (g, e)) in got.iter().zip(expected).enumerate() {
        crate::ddp::assert_close_tol(g, e, 1e-10, 1e-7, &format!("rank {rank}, step {s}"));
    }
}

#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_ddp_gradients_on_two_gpus_equal_single_process_full_batch_gradients() {
    crate::common::require_two_gpus();
    let steps = 3;
    let expected = crate::ddp::reference(steps, 12);
    for options in [
        DdpOptions::new as fn() -> DdpOptions,
        || DdpOptions::new().bucket_cap_mb(1e-4),
        || {
            DdpOptions::new()
                .bucket_cap_mb(1e-4)
                .gradient_as_bucket_view(true)
        },
    ] {
        let per_rank = run_nccl_ranks(2, |pg, dev| {
            crate::ddp::ddp_run_on(pg, options(), steps, 12, Device::Cuda(dev))
        });
        for (rank, got) in per_rank.iter().enumerate() {
            assert_steps_close(got, &expected, rank);
        }
    }
}

/// Note [NCCL under capture]: a DDP step captured into a CUDA graph on each of two GPUs (its
/// bucket all-reduces captured with it) gives, replay after replay, the gradients of one
/// process on the full batch. The captured operations are not the watchdog's: after waiting
/// past the group's timeout, the group still runs an eager all-reduce (a watchdog waiting
/// for a captured operation to finish would have aborted it).
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_ddp_step_on_two_gpus_captured_in_a_cuda_graph_averages_on_every_replay() {
    crate::common::require_two_gpus();
    let (warmup, replays) = (2, 3);
    let expected = crate::ddp::reference(warmup + replays, 12);
    let timeout = Duration::from_secs(10);
    let _one = one_nccl_test();
    for (k, options) in [DdpOptions::new as fn() -> DdpOptions, || {
        DdpOptions::new().bucket_cap_mb(1e-4)
    }]
    .into_iter()
    .enumerate()
    {
        let per_rank = crate::common::run_ranks_with(
            2,
            timeout,
            |store, rank| ProcessGroup::on_device(BackendKind::Nccl, store, rank, 2, timeout, rank),
            |pg, dev| {
                let got = crate::ddp::ddp_graph_run_on(pg.clone(), options(), (warmup, replays), 12, dev);
                if k == 0 {
                    std::thread::sleep(timeout + Duration::from_secs(1));
                }
                let one = Tensor::ones([3usize], DType::F32, Device::Cuda(dev)).unwrap();
                pg.all_reduce(&one, ReduceOp::Sum).unwrap();
                (got, one.to_vec::<f32>().unwrap())
            },
        );
        for (rank, (got, sum)) in per_rank.iter().enumerate() {
            assert_eq!(
                sum,
                &vec![2.0f32; 3],
                "rank {rank}: an eager all_reduce after the graph"
            );
            assert_steps_close(got, &expected, rank);
        }
    }
}

/// Note [Profiler waits] and Note [CUPTI and ranks as threads]: with DDP ranks as threads of
/// one process, rank 0 profiles two steps while rank 1 runs ahead: when rank 0 starts and when
/// it stops the profiler, rank 1 has already queued its next all-reduce on cuda:1, which waits
/// on the GPU for rank 0's. Nothing hangs, every step's gradients on both ranks are one
/// process's full-batch ones, and rank 0's trace says why CUPTI did not run and times its
/// linear layers on cuda:0 by events. Before, the stop waited for cuda:1 as well, and CUPTI
/// was started and stopped under rank 1's all-reduce: both hung.
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_ddp_rank_profiles_while_the_other_runs_ahead_on_two_gpus() {
    use ember_core::profiler::{self, CudaTimingSource, ProfilerActivity};
    crate::common::require_two_gpus();
    let steps = 5;
    let expected = crate::ddp::reference(steps, 12);
    let timeout = Duration::from_secs(20);
    let _one = one_nccl_test();
    let per_rank = crate::common::run_ranks_with(
        2,
        timeout,
        |store, rank| ProcessGroup::on_device(BackendKind::Nccl, store, rank, 2, timeout, rank),
        |pg, dev| {
            let _device = cuda::DeviceGuard::new(dev).unwrap();
            let rank = pg.rank();
            let (ddp, mut opt, x, y) = crate::ddp::ddp_setup(pg, DdpOptions::new(), 12, Device::Cuda(dev));
            // Rank 1 reaches its next all-reduce meanwhile and waits in reading its gradients.
            let let_rank_1_run_ahead = || std::thread::sleep(Duration::from_millis(500));
            let (mut prof, mut timing, mut got) = (None, None, Vec::new());
            for step in 0..steps {
                if rank == 0 && step == 1 {
                    let_rank_1_run_ahead();
                    prof = Some(
                        profiler::profile()
                            .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
                            .start()
                            .unwrap(),
                    );
                }
                got.push(crate::ddp::sgd_step(&ddp, &mut opt, &x, &y));
                if let Some(mut p) = prof.take_if(|_| step == 2) {
                    let_rank_1_run_ahead();
                    p.stop().unwrap();
                    let trace = p.trace().unwrap();
                    let timed_products = trace
                        .events()
                        .iter()
                        .filter(|e| e.name == "linear" && e.gpu.as_ref().is_some_and(|g| g.device == dev))
                        .count();
                    timing = Some((
                        trace.cuda_timing_source(),
                        trace.cupti_unavailable().map(str::to_string),
                        timed_products,
                    ));
                }
            }
            (got, timing)
        },
    );
    for (rank, (got, timing)) in per_rank.iter().enumerate() {
        assert_steps_close(got, &expected, rank);
        if rank == 0 {
            let (source, why, timed_products) = timing.as_ref().expect("rank 0 profiled");
            assert_eq!(*source, Some(CudaTimingSource::CudaEvents));
            let why = why.as_deref().unwrap_or("");
            assert!(why.contains("cuda:0, cuda:1"), "why CUPTI did not run: {why}");
            // Three linear layers forward in each of the two steps.
            assert_eq!(*timed_products, 6, "linear ops timed on cuda:0");
        }
    }
}

/// Note [DDP row blocks] and Note [DDP early copy back]: a 128 MiB weight between small layers,
/// buckets of 0.5 MiB. The weight's gradient is computed and all-reduced in three row blocks,
/// and the fused Adam step updates each block once its all-reduce is done; the last layers'
/// bucket is copied back into `.grad` at the end of backward, the first layer's, reduced after
/// the large weight, on a side stream as its all-reduce starts, handed on to Adam as arriving. Every step, on each rank: the
/// averaged `.grad` equals one process's full-batch gradient, and the parameters equal, bit for
/// bit, those of a twin updated by the same Adam from that complete gradient (an update that did
/// not wait for a block or a copy would have read the rank's own, unaveraged gradient).
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_ddp_on_two_gpus_all_reduces_a_large_weight_in_row_blocks_that_adam_updates_as_they_arrive() {
    use ember_nn::optim::{Adam, AdamConfig, Optimizer};
    use ember_nn::{Forward, Linear, ModuleExt, Sequential};
    crate::common::require_two_gpus();
    let (features, inputs, outputs, batch, steps) = (16usize, 4096usize, 8192usize, 8usize, 3);
    let layer = |from: usize, to: usize| {
        let w: Vec<f32> = (0..to * from)
            .map(|i| ((i * 7) % 13) as f32 / 1300.0 - 0.005)
            .collect();
        let fc = Linear::new(from, to, Device::Cpu).unwrap();
        {
            let _g = ember_core::no_grad();
            fc.weight
                .copy_(&Tensor::from_vec(w, [to, from], Device::Cpu).unwrap())
                .unwrap();
            fc.bias.as_ref().unwrap().fill_(0.01).unwrap();
        }
        fc
    };
    let linear = |dev: usize| {
        let mut m = Sequential::new()
            .with(layer(features, inputs))
            .with(layer(inputs, outputs))
            .with(layer(outputs, features))
            .with(layer(features, features));
        m.to_device(Device::Cuda(dev)).unwrap();
        m
    };
    let data = |rank: usize, dev: usize| {
        let x: Vec<f32> = (0..batch * features)
            .map(|i| (((i + 3 * rank) * 5) % 17) as f32 / 8.0 - 1.0)
            .collect();
        Tensor::from_vec(x, [batch, features], Device::Cpu)
            .unwrap()
            .to(Device::Cuda(dev))
            .unwrap()
    };
    let config = || AdamConfig {
        lr: 1e-3,
        ..Default::default()
    };
    let loss = |y: Tensor| y.pow_scalar(2.0).unwrap().mean_all().unwrap();
    let per_rank = run_nccl_ranks(2, |pg, dev| {
        let _device = cuda::DeviceGuard::new(dev).unwrap();
        let rank = pg.rank();
        let options = DdpOptions::new().process_group(pg).bucket_cap_mb(0.5);
        let ddp = ember_distributed::DistributedDataParallel::new(linear(dev), options).unwrap();
        let mut opt = Adam::new(ddp.parameters(), config()).unwrap();
        let twin = linear(dev);
        let mut twin_opt = Adam::new(twin.parameters(), config()).unwrap();
        let full = linear(dev);
        let (x, x_full) = (
            data(rank, dev),
            Tensor::cat(&[&data(0, dev), &data(1, dev)], 0).unwrap(),
        );
        for step in 0..steps {
            opt.zero_grad().unwrap();
            loss(ddp.forward(&x).unwrap()).backward().unwrap();
            opt.step().unwrap();
            // One process's full-batch gradient, from the same weights.
            full.zero_grad().unwrap();
            {
                let _g = ember_core::no_grad();
                for (f, t) in full.parameters().iter().zip(twin.parameters()) {
                    f.copy_(&t).unwrap();
                }
            }
            loss(full.forward(&x_full).unwrap()).backward().unwrap();
            // The twin takes the same Adam step from the complete averaged gradient.
            for (t, d) in twin.parameters().iter().zip(ddp.parameters()) {
                t.set_grad(Some(d.grad().unwrap().deep_clone().unwrap())).unwrap();
            }
            twin_opt.step().unwrap();
            for ((d, t), f) in ddp
                .parameters()
                .iter()
                .zip(twin.parameters())
                .zip(full.parameters())
            {
                let (g, e) = (
                    d.grad().unwrap().to_vec::<f32>().unwrap(),
                    f.grad().unwrap().to_vec::<f32>().unwrap(),
                );
                let worst = g
                    .iter()
                    .zip(&e)
                    .map(|(a, b)| (a - b).abs() / (1e-3 + b.abs()))
                    .fold(0f32, f32::max);
                assert!(
                    worst < 1e-3,
                    "rank {rank}, step {step}: gradient off by {worst} (relative)"
                );
                assert!(
                    d.to_vec::<f32>().unwrap() == t.to_vec::<f32>().unwrap(),
                    "rank {rank}, step {step}: the parameters differ from the twin's"
                );
            }
        }
        assert!(ddp.has_rebuilt_buckets());
        ddp.bucket_indices()
    });
    for buckets in per_rank {
        // The large weight (parameter 2) alone, after a bucket of the last layer's parameters
        // (6, 7) and before one of the first layer's (0, 1).
        let at = |i: usize| buckets.iter().position(|b| b.contains(&i)).unwrap();
        assert_eq!(buckets[at(2)], vec![2], "{buckets:?}");
        assert!(at(6) == at(7) && at(7) < at(2), "{buckets:?}");
        assert!(at(0) == at(1) && at(1) > at(2), "{buckets:?}");
    }
}

/// Note [DDP comm hooks] over NCCL: the built-in hooks on two GPUs give, bit for bit, what
/// their steps compute from the two ranks' local gradients (halves halved, summed once,
/// rounded once), for a weight of 64 MiB that DDP would otherwise all-reduce in row blocks
/// beside a small bias: registered as functions (a hook sees the weight whole) and as built-in
/// hooks (called on its two row blocks as backward computes them).
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_ddp_comm_hooks_on_two_gpus_reduce_as_their_steps_compute() {
    use crate::ddp_hooks::{builtin_type, compressed_average, register, Hook};
    use ember_distributed::DistributedDataParallel;
    use ember_nn::{Forward, Linear, ModuleExt};
    crate::common::require_two_gpus();
    let n = 4096; // the weight: n × n float32, 64 MiB
    let rows = 4;
    let hooks = [Hook::AllReduce, Hook::Fp16, Hook::Bf16];
    for (hook, builtin) in hooks.into_iter().flat_map(|h| [(h, false), (h, true)]) {
        let per_rank = run_nccl_ranks(2, |pg, dev| {
            let _guard = cuda::DeviceGuard::new(dev).unwrap();
            let device = Device::Cuda(dev);
            let r = pg.rank();
            let ddp = DistributedDataParallel::new(
                Linear::new(n, n, device).unwrap(),
                DdpOptions::new().process_group(pg),
            )
            .unwrap();
            match builtin {
                // Note [DDP comm hooks]: the weight's two row blocks reduced one by one.
                true => ddp.register_builtin_comm_hook(builtin_type(hook)).unwrap(),
                false => register(&ddp, hook),
            }
            // The same parameters without DDP: this rank's local gradients.
            let plain = Linear::new(n, n, device).unwrap();
            for (p, q) in plain.parameters().iter().zip(ddp.parameters()) {
                let _g = ember_core::no_grad();
                p.copy_(&q).unwrap();
            }
            let x: Vec<f32> = (0..rows * n)
                .map(|i| ((i * 7 + r * 5) % 13) as f32 / 6.0 - 1.0)
                .collect();
            let x = Tensor::from_vec(x, [rows, n], Device::Cpu)
                .unwrap()
                .to(device)
                .unwrap();
            let grads = |m: &dyn Forward| -> Vec<Vec<f32>> {
                m.forward(&x)
                    .unwrap()
                    .tanh()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                m.parameters()
                    .iter()
                    .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
                    .collect()
            };
            (grads(&plain), grads(&ddp))
        });
        let (local0, local1) = (&per_rank[0].0, &per_rank[1].0);
        for (rank, (_, got)) in per_rank.iter().enumerate() {
            for (k, g) in got.iter().enumerate() {
                let expected: Vec<f32> = local0[k]
                    .iter()
                    .zip(&local1[k])
                    .map(|(&a, &b)| compressed_average(a, b, hook))
                    .collect();
                let bad = g.iter().zip(&expected).filter(|(u, v)| u != v).count();
                assert_eq!(
                    bad,
                    0,
                    "{hook:?} (built-in {builtin}), rank {rank}, parameter {k}: {bad} of {} values differ",
                    g.len()
                );
            }
        }
    }
}
