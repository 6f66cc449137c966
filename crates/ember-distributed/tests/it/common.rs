//! Helpers: ranks as threads of this process, and the checks every collective must pass.

use std::sync::Arc;
use std::time::Duration;

use ember_core::{DType, Device, Tensor};
use ember_distributed::{BackendKind, ProcessGroup, ReduceOp, Store, TcpStore};
use half::{bf16, f16};

/// The `ember-run` program: where cargo built it, else beside this test binary (test binaries
/// run on another machine from one folder, as `crates/ember/tests/cli.rs` does for `ember`).
pub fn ember_run() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_ember-run"));
    if built.exists() {
        return built;
    }
    let here = std::env::current_exe().expect("the test binary has a path");
    here.parent()
        .expect("the test binary sits in a folder")
        .join("ember-run")
}

/// Fails (never skips) when the machine has fewer than two GPUs: the first line of every test
/// marked `#[ignore = "needs two CUDA devices"]`.
pub fn require_two_gpus() {
    let n = if ember_core::cuda::is_available() {
        ember_core::cuda::device_count()
    } else {
        0
    };
    assert!(n >= 2, "this test needs two CUDA devices, found {n}");
}

/// Runs `f` as `n` ranks, each a thread with its own store client and process group.
pub fn run_ranks<T: Send>(n: usize, timeout: Duration, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    run_ranks_with(
        n,
        timeout,
        |store, rank| ProcessGroup::new(BackendKind::Gloo, store, rank, n, timeout),
        |pg, _| f(pg),
    )
}

/// Runs `f` as `n` ranks, each a thread with its own store client (rank 0's hosts the store)
/// and the process group `group` makes from it for its rank.
pub fn run_ranks_with<T: Send>(
    n: usize,
    timeout: Duration,
    group: impl Fn(Arc<dyn Store>, usize) -> ember_core::Result<ProcessGroup> + Sync,
    f: impl Fn(ProcessGroup, usize) -> T + Sync,
) -> Vec<T> {
    let master = TcpStore::new("127.0.0.1", 0, true, timeout).unwrap();
    let port = master.port();
    let master: Arc<dyn Store> = Arc::new(master);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, group, master) = (&f, &group, master.clone());
                s.spawn(move || {
                    let store: Arc<dyn Store> = if rank == 0 {
                        master
                    } else {
                        Arc::new(TcpStore::new("127.0.0.1", port, false, timeout).unwrap())
                    };
                    f(group(store, rank).unwrap(), rank)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn t<T: ember_core::cpu::CpuElement>(v: Vec<T>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, Device::Cpu).unwrap()
}

/// Every collective of `pg` against values computed here; panics on a mismatch.
pub fn check_all_collectives(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    let nf = n as f64;

    // all_reduce, every op, several dtypes; 1001 elements so the ring's chunks are uneven.
    let len = 1001;
    let x = t((0..len).map(|i| (r + 1) as f32 * i as f32).collect());
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    let tri = (n * (n + 1) / 2) as f32;
    assert_eq!(
        x.to_vec::<f32>().unwrap(),
        (0..len).map(|i| tri * i as f32).collect::<Vec<_>>()
    );

    let x = t(vec![r as f64, 1.0 + r as f64]);
    pg.all_reduce(&x, ReduceOp::Avg).unwrap();
    assert_eq!(x.to_vec::<f64>().unwrap(), [(nf - 1.0) / 2.0, (nf + 1.0) / 2.0]);

    let x = t(vec![r as i32, -(r as i32), 7]);
    pg.all_reduce(&x, ReduceOp::Max).unwrap();
    assert_eq!(x.to_vec::<i32>().unwrap(), [n as i32 - 1, 0, 7]);

    let x = t(vec![r as i64 + 5, -(r as i64)]);
    pg.all_reduce(&x, ReduceOp::Min).unwrap();
    assert_eq!(x.to_vec::<i64>().unwrap(), [5, -(n as i64 - 1)]);

    let x = t(vec![(r + 1) as f32, 2.0]);
    pg.all_reduce(&x, ReduceOp::Product).unwrap();
    let fact: f32 = (1..=n).map(|k| k as f32).product();
    assert_eq!(x.to_vec::<f32>().unwrap(), [fact, 2f32.powi(n as i32)]);

    let x = t(vec![f16::from_f32(0.5 * (r + 1) as f32); 5]);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(x.to_vec::<f16>().unwrap(), vec![f16::from_f32(0.5 * tri); 5]);
    let x = t(vec![bf16::from_f32((r + 1) as f32); 3]);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    assert_eq!(x.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(tri); 3]);

    // A 2-D tensor keeps its shape; async form.
    let x = Tensor::full([4usize, 8], (r + 1) as f64, DType::F32, Device::Cpu).unwrap();
    let work = pg.all_reduce_async(&x, ReduceOp::Sum).unwrap();
    work.wait().unwrap();
    assert!(work.is_completed());
    assert_eq!(x.dims(), [4, 8]);
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![tri; 32]);

    // Avg of integers is refused before anything is sent.
    assert!(pg.all_reduce(&t(vec![1i64]), ReduceOp::Avg).is_err());

    // broadcast from the last rank (src is a global rank), sync and async.
    let x = t(vec![r as i64 * 10, r as i64 * 10 + 1]);
    pg.broadcast(&x, pg.global_rank(n - 1).unwrap()).unwrap();
    assert_eq!(
        x.to_vec::<i64>().unwrap(),
        [(n as i64 - 1) * 10, (n as i64 - 1) * 10 + 1]
    );
    let x = t(vec![r as f32; 3]);
    pg.broadcast_async(&x, pg.global_rank(0).unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), [0.0; 3]);

    // all_gather: rank i's [i, i+0.5] in outputs[i].
    let input = t(vec![r as f32, r as f32 + 0.5]);
    let outputs: Vec<Tensor> = (0..n).map(|_| t(vec![0f32; 2])).collect();
    pg.all_gather(&outputs, &input).unwrap();
    for (i, o) in outputs.iter().enumerate() {
        assert_eq!(o.to_vec::<f32>().unwrap(), [i as f32, i as f32 + 0.5]);
    }
    let outputs: Vec<Tensor> = (0..n).map(|_| t(vec![0i32; 1])).collect();
    pg.all_gather_async(&outputs, &t(vec![r as i32 * 3]))
        .unwrap()
        .wait()
        .unwrap();
    let got: Vec<i32> = outputs.iter().map(|o| o.to_vec::<i32>().unwrap()[0]).collect();
    assert_eq!(got, (0..n as i32).map(|i| i * 3).collect::<Vec<_>>());

    // reduce_scatter: inputs[j] = [r + j, 1]; rank j gets [sum_r (r + j), n].
    let inputs: Vec<Tensor> = (0..n).map(|j| t(vec![(r + j) as f64, 1.0])).collect();
    let out = t(vec![0f64; 2]);
    pg.reduce_scatter(&out, &inputs, ReduceOp::Sum).unwrap();
    let s: f64 = (0..n).map(|k| (k + r) as f64).sum();
    assert_eq!(out.to_vec::<f64>().unwrap(), [s, nf]);
    let out = t(vec![0f32; 2]);
    let inputs: Vec<Tensor> = (0..n).map(|j| t(vec![(r * j) as f32, 2.0])).collect();
    pg.reduce_scatter_async(&out, &inputs, ReduceOp::Avg)
        .unwrap()
        .wait()
        .unwrap();
    let s: f32 = (0..n).map(|k| (k * r) as f32).sum();
    assert_eq!(out.to_vec::<f32>().unwrap(), [s / n as f32, 2.0]);
    // A list of the wrong length is refused.
    assert!(pg.reduce_scatter(&out, &inputs[..n - 1], ReduceOp::Sum).is_err());

    pg.barrier().unwrap();
    pg.barrier_async().unwrap().wait().unwrap();

    // send/recv around the ring, started together (isend + irecv cannot deadlock).
    let right = pg.global_rank((r + 1) % n).unwrap();
    let left = pg.global_rank((r + n - 1) % n).unwrap();
    let payload = t((0..100_000).map(|i| i as f32 + r as f32).collect());
    let into = t(vec![0f32; 100_000]);
    let s = pg.isend(&payload, right).unwrap();
    let rv = pg.irecv(&into, left).unwrap();
    s.wait().unwrap();
    rv.wait().unwrap();
    let lr = (r + n - 1) % n;
    assert_eq!(
        into.to_vec::<f32>().unwrap()[..3],
        [lr as f32, 1.0 + lr as f32, 2.0 + lr as f32]
    );
    if n == 2 {
        // Blocking forms: rank 0 sends, rank 1 receives.
        let x = t(vec![r as i64 + 40]);
        if r == 0 {
            pg.send(&x, right).unwrap();
        } else {
            pg.recv(&x, left).unwrap();
            assert_eq!(x.to_vec::<i64>().unwrap(), [40]);
        }
    }

    // An MB-sized all_reduce (1 MiB of f32).
    let big = Tensor::full(1usize << 18, 1.0, DType::F32, Device::Cpu).unwrap();
    pg.all_reduce(&big, ReduceOp::Sum).unwrap();
    assert!(big.to_vec::<f32>().unwrap().iter().all(|&v| v == n as f32));
}

/// The flat collectives (`all_gather_into_tensor`, `reduce_scatter_tensor`) of `pg` on
/// `device` against values computed here, and their argument errors (which leave the group
/// usable); panics on a mismatch.
pub fn check_flat_collectives(pg: &ProcessGroup, device: Device) {
    use ember_core::Error;
    let (r, n) = (pg.rank(), pg.size());
    let on = |v: Vec<f32>, dims: &[usize]| {
        Tensor::from_vec(v, dims, Device::Cpu)
            .unwrap()
            .to(device)
            .unwrap()
    };

    // all_gather_into_tensor: rank i's [2, 3] block of i·100 + k, concatenated along dim 0 and
    // stacked; then f64 and i64.
    let input = on((0..6).map(|k| (r * 100 + k) as f32).collect(), &[2, 3]);
    let expected: Vec<f32> = (0..n)
        .flat_map(|i| (0..6).map(move |k| (i * 100 + k) as f32))
        .collect();
    let cat = Tensor::zeros([2 * n, 3], DType::F32, device).unwrap();
    pg.all_gather_into_tensor(&cat, &input).unwrap();
    assert_eq!(cat.to_vec::<f32>().unwrap(), expected);
    let stack = Tensor::zeros([n, 2, 3], DType::F32, device).unwrap();
    pg.all_gather_into_tensor_async(&stack, &input)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stack.to_vec::<f32>().unwrap(), expected);
    let x = Tensor::from_vec(vec![r as i64 - 7], 1, Device::Cpu)
        .unwrap()
        .to(device)
        .unwrap();
    let out = Tensor::zeros(n, DType::I64, device).unwrap();
    pg.all_gather_into_tensor(&out, &x).unwrap();
    assert_eq!(
        out.to_vec::<i64>().unwrap(),
        (0..n as i64).map(|i| i - 7).collect::<Vec<_>>()
    );

    // reduce_scatter_tensor: input[j] = r + j (j over n·4 elements); rank r gets block r of the
    // sum over ranks, then of the average.
    let len = 4;
    let input = on((0..n * len).map(|j| (r + j) as f32).collect(), &[n * len]);
    let out = Tensor::zeros([len], DType::F32, device).unwrap();
    pg.reduce_scatter_tensor(&out, &input, ReduceOp::Sum).unwrap();
    let ranks_sum = (n * (n - 1) / 2) as f32;
    let block: Vec<f32> = (0..len)
        .map(|k| ranks_sum + n as f32 * (r * len + k) as f32)
        .collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), block);
    let stacked = input.reshape([n as isize, 2, 2]).unwrap();
    let out = Tensor::zeros([2usize, 2], DType::F32, device).unwrap();
    pg.reduce_scatter_tensor_async(&out, &stacked, ReduceOp::Avg)
        .unwrap()
        .wait()
        .unwrap();
    let avg: Vec<f32> = block.iter().map(|v| v / n as f32).collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), avg);
    let input = Tensor::full(n * 3, (r + 1) as f64, DType::F64, Device::Cpu)
        .unwrap()
        .to(device)
        .unwrap();
    let out = Tensor::zeros(3usize, DType::F64, device).unwrap();
    pg.reduce_scatter_tensor(&out, &input, ReduceOp::Max).unwrap();
    assert_eq!(out.to_vec::<f64>().unwrap(), [n as f64; 3]);

    // Bad arguments: typed errors before anything is sent.
    let small = Tensor::zeros([3usize], DType::F32, device).unwrap();
    let wrong = Tensor::zeros([3 * n + 1], DType::F32, device).unwrap();
    match pg.all_gather_into_tensor(&wrong, &small) {
        Err(Error::ShapeMismatch { op, lhs, .. }) => {
            assert_eq!((op, lhs.dims()), ("all_gather_into_tensor", &[3 * n][..]))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        pg.reduce_scatter_tensor(&small, &wrong, ReduceOp::Sum),
        Err(Error::ShapeMismatch { .. })
    ));
    let doubles = Tensor::zeros([3 * n], DType::F64, device).unwrap();
    assert!(matches!(
        pg.all_gather_into_tensor(&doubles, &small),
        Err(Error::DTypeMismatch { .. })
    ));
    let ints = Tensor::zeros([3 * n], DType::I64, device).unwrap();
    let int_out = Tensor::zeros([3usize], DType::I64, device).unwrap();
    assert!(matches!(
        pg.reduce_scatter_tensor(&int_out, &ints, ReduceOp::Avg),
        Err(Error::UnsupportedDType { .. })
    ));
    let strided = Tensor::zeros([3 * n, 2], DType::F32, device)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap();
    assert!(matches!(
        pg.all_gather_into_tensor(&strided, &small),
        Err(Error::InvalidArgument { .. })
    ));
    if device != Device::Cpu {
        let host = Tensor::zeros([3 * n], DType::F32, Device::Cpu).unwrap();
        assert!(matches!(
            pg.all_gather_into_tensor(&host, &small),
            Err(Error::DeviceMismatch { .. })
        ));
    }
    // Nothing was sent: the group still works.
    let one = on(vec![1.0], &[1]);
    pg.all_reduce(&one, ReduceOp::Sum).unwrap();
    assert_eq!(one.to_vec::<f32>().unwrap(), [n as f32]);
}
