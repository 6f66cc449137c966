//! `sort`, `argsort`, `topk`, `multinomial`, `tril`, `triu` against values worked by hand and
//! PyTorch's conventions (NaN above every number, stable ties, gradients through the values).

use ember_core::{manual_seed, DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

#[test]
fn sort_orders_rows_stably_with_nan_last() {
    let x = t(&[3.0, f32::NAN, 1.0, 3.0, -2.0, 0.5, 0.5, 9.0], &[2, 4]);
    let (v, i) = x.sort(1, false).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![2, 0, 3, 1, 0, 1, 2, 3]);
    let v = v.to_vec::<f32>().unwrap();
    assert_eq!(&v[..3], &[1.0, 3.0, 3.0]);
    assert!(v[3].is_nan());
    // Descending: NaN first (it is the largest), ties still in order.
    let (_, i) = x.sort(-1, true).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 0, 3, 2, 3, 1, 2, 0]);
    // Along dim 0, column by column: (3, -2), (NaN, 0.5), (1, 0.5), (3, 9).
    assert_eq!(
        x.argsort(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 1, 1, 0, 0, 0, 0, 1]
    );
    assert!(matches!(
        x.sort(2, false),
        Err(Error::DimOutOfRange { .. }) | Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn topk_takes_the_largest_or_smallest_in_order_and_passes_gradients_to_them() {
    let x = t(&[0.1, 0.7, -0.3, 0.7, 0.2], &[5]).requires_grad_(true).unwrap();
    let (v, i) = x.topk(3, 0, true).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![0.7, 0.7, 0.2]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 3, 4]);
    v.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 0.0, 1.0, 1.0]
    );
    let (v, _) = x.detach().topk(2, 0, false).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![-0.3, 0.1]);
    assert!(matches!(x.topk(6, 0, true), Err(Error::InvalidArgument { .. })));
}

#[test]
fn multinomial_draws_in_proportion_and_never_a_zero_weight() {
    manual_seed(7).unwrap();
    let w = t(&[0.0, 1.0, 3.0, 0.0], &[4]);
    let draws = w.multinomial(20_000, true).unwrap().to_vec::<i64>().unwrap();
    assert!(
        draws.iter().all(|&d| d == 1 || d == 2),
        "zero weights are never drawn"
    );
    let twos = draws.iter().filter(|&&d| d == 2).count() as f64 / draws.len() as f64;
    // 3/4 expected; 20,000 draws put 4 standard deviations at ±0.012.
    assert!(
        (twos - 0.75).abs() < 0.012,
        "frequency of the weight-3 category: {twos}"
    );
    // Without replacement: each row's draws are distinct and of positive weight.
    let rows = t(&[1.0, 1.0, 0.0, 5.0, 2.0, 2.0, 2.0, 2.0], &[2, 4]);
    let d = rows.multinomial(3, false).unwrap();
    assert_eq!(d.dims(), &[2, 3]);
    let d = d.to_vec::<i64>().unwrap();
    let mut first = d[..3].to_vec();
    first.sort();
    assert_eq!(first, vec![0, 1, 3]);
    let mut second = d[3..].to_vec();
    second.sort();
    second.dedup();
    assert_eq!(second.len(), 3);
    // Same seed, same draws.
    manual_seed(7).unwrap();
    assert_eq!(
        w.multinomial(20_000, true).unwrap().to_vec::<i64>().unwrap(),
        draws
    );
    // Bad input: a typed error that says what to do.
    assert!(matches!(
        rows.multinomial(4, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t(&[1.0, -1.0], &[2]).multinomial(1, true),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t(&[0.0, 0.0], &[2]).multinomial(1, true),
        Err(Error::InvalidArgument { .. })
    ));
    let ints = Tensor::ones([3], DType::I64, CPU).unwrap();
    assert!(matches!(
        ints.multinomial(1, true),
        Err(Error::UnsupportedDType { .. })
    ));
}

#[test]
fn tril_and_triu_keep_their_triangles_of_the_last_two_dims() {
    let x = Tensor::arange(1.0, 13.0, 1.0, DType::F32, CPU)
        .unwrap()
        .reshape(&[1, 3, 4])
        .unwrap();
    assert_eq!(
        x.tril(0).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 9.0, 10.0, 11.0, 0.0]
    );
    assert_eq!(
        x.triu(1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 2.0, 3.0, 4.0, 0.0, 0.0, 7.0, 8.0, 0.0, 0.0, 0.0, 12.0]
    );
    assert_eq!(
        x.tril(-1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 9.0, 10.0, 0.0, 0.0]
    );
    let causal = Tensor::ones([3, 3], DType::Bool, CPU).unwrap().tril(0).unwrap();
    assert_eq!(
        causal.to_vec::<bool>().unwrap(),
        vec![true, false, false, true, true, false, true, true, true]
    );
    assert!(matches!(
        t(&[1.0], &[1]).tril(0),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn every_dtype_sorts_exactly_in_its_own_values() {
    // Integers compare exactly: 2^60 + 1 and 2^60 are one f64 but two int64.
    let big = Tensor::from_vec(vec![(1i64 << 60) + 1, 1 << 60, -3, i64::MAX, i64::MIN], [5], CPU).unwrap();
    let (v, i) = big.sort(0, false).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![4, 2, 1, 0, 3]);
    assert_eq!(
        v.to_vec::<i64>().unwrap(),
        vec![i64::MIN, -3, 1 << 60, (1 << 60) + 1, i64::MAX]
    );
    let (_, i) = big.topk(2, 0, true).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![3, 0]);
    // Each dtype, ties stable both ways; signed zeros tie.
    for dtype in [DType::I32, DType::U8, DType::F16, DType::BF16, DType::F64] {
        let x = Tensor::from_slice(&[2.0f64, 0.0, 7.0, 2.0, 1.0, 7.0], [6], CPU)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(
            x.argsort(0, false).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 4, 0, 3, 2, 5],
            "{dtype}"
        );
        assert_eq!(
            x.argsort(0, true).unwrap().to_vec::<i64>().unwrap(),
            vec![2, 5, 0, 3, 4, 1],
            "{dtype}"
        );
    }
    let zeros = t(&[0.0, -0.0, -1.0, 0.0], &[4]);
    assert_eq!(
        zeros.argsort(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![2, 0, 1, 3]
    );
    let b = Tensor::from_slice(&[true, false, true, false], [4], CPU).unwrap();
    assert_eq!(
        b.argsort(0, true).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 2, 1, 3]
    );
}

#[test]
fn orderings_of_views_along_inner_dims_and_of_empty_rows() {
    // A transposed view sorted along each dim equals the sort of its contiguous copy.
    let base = Tensor::from_slice(&common::values(4 * 5 * 6, 3), [4, 5, 6], CPU).unwrap();
    let view = base.permute(&[2, 0, 1]).unwrap().narrow(1, 1, 3).unwrap();
    let dense = view.contiguous().unwrap();
    for dim in 0..3isize {
        for descending in [false, true] {
            let (a, ai) = view.sort(dim, descending).unwrap();
            let (b, bi) = dense.sort(dim, descending).unwrap();
            assert_eq!(
                ai.to_vec::<i64>().unwrap(),
                bi.to_vec::<i64>().unwrap(),
                "dim {dim}"
            );
            assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap(), "dim {dim}");
            let (tv, ti) = view.topk(2, dim, descending).unwrap();
            assert_eq!(ti.dims()[dim as usize], 2);
            assert_eq!(
                ti.to_vec::<i64>().unwrap(),
                bi.narrow(dim, 0, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .to_vec::<i64>()
                    .unwrap()
            );
            assert_eq!(
                tv.to_vec_f64().unwrap(),
                view.gather(dim, &ti).unwrap().to_vec_f64().unwrap()
            );
        }
    }
    // Empty rows, no rows, k = 0.
    let empty = Tensor::zeros([3, 0], DType::F32, CPU).unwrap();
    let (v, i) = empty.sort(1, false).unwrap();
    assert_eq!((v.dims(), i.dims()), (&[3usize, 0][..], &[3usize, 0][..]));
    let none = Tensor::zeros([0, 4], DType::BF16, CPU).unwrap();
    assert_eq!(none.topk(2, 1, true).unwrap().1.dims(), &[0, 2]);
    let (v, i) = t(&[1.0, 2.0], &[2]).topk(0, 0, true).unwrap();
    assert_eq!((v.numel(), i.numel()), (0, 0));
}

// ---- On a GPU: the device sort against the CPU backend (Note [Device sort]) ----

use crate::common;

/// Values with many ties (a few dozen distinct), NaNs and signed zeros for the floats, and
/// int64 values past 2^53 that differ by 1, as a CPU tensor of `dtype`.
fn sample(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v = common::values(n, seed);
    if dtype == DType::I64 {
        let ints: Vec<i64> = v
            .iter()
            .enumerate()
            .map(|(i, x)| (x * 40.0).floor() as i64 + if i % 3 == 0 { 1 << 60 } else { 0 })
            .collect();
        return Tensor::from_vec(ints, shape, CPU).unwrap();
    }
    let f: Vec<f64> = v
        .iter()
        .enumerate()
        .map(|(i, x)| match dtype {
            DType::Bool => (*x > 0.0) as u8 as f64,
            DType::U8 => ((x + 1.0) * 100.0).floor(),
            _ if dtype.is_floating_point() && i % 37 == 5 => f64::NAN,
            _ if dtype.is_floating_point() && i % 41 == 7 => -0.0,
            _ => (x * 40.0).floor() / 4.0,
        })
        .collect();
    Tensor::from_vec(f, shape, CPU).unwrap().to_dtype(dtype).unwrap()
}

/// `f` on the CPU tensor `x` and on its copy on the GPU give the same values (bit for bit) and
/// positions.
fn same_on_gpu(what: &str, x: &Tensor, f: impl Fn(&Tensor) -> Result<(Tensor, Tensor), Error>) {
    let gpu = common::gpu();
    let (cv, ci) = f(x).unwrap();
    let (gv, gi) = f(&x.to(gpu).unwrap()).unwrap();
    assert_eq!(gi.device(), gpu, "{what}");
    assert_eq!(gi.dims(), ci.dims(), "{what}: shape");
    let (gi, ci) = (gi.to_vec::<i64>().unwrap(), ci.to_vec::<i64>().unwrap());
    if let Some(at) = gi.iter().zip(&ci).position(|(a, b)| a != b) {
        panic!(
            "{what}: position {at} of {}: GPU index {}, CPU {}",
            ci.len(),
            gi[at],
            ci[at]
        );
    }
    assert_eq!(common::bits(&gv), common::bits(&cv), "{what}: values");
}

/// The stable f64 reference of the first `k` positions of each row of the 2-D `x` (rows along
/// dim 1), NaN above every number.
fn reference(x: &Tensor, k: usize, descending: bool) -> Vec<i64> {
    let n = x.dims()[1];
    let v = x.to_dtype(DType::F64).unwrap().to_vec_f64().unwrap();
    let asc = |a: f64, b: f64| match (a.is_nan(), b.is_nan()) {
        (false, false) => a.partial_cmp(&b).unwrap(),
        (p, q) => p.cmp(&q),
    };
    v.chunks(n.max(1))
        .flat_map(|r| {
            let mut perm: Vec<usize> = (0..r.len()).collect();
            if descending {
                perm.sort_by(|&a, &b| asc(r[b], r[a]));
            } else {
                perm.sort_by(|&a, &b| asc(r[a], r[b]));
            }
            perm.truncate(k);
            perm.into_iter().map(|i| i as i64)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sort_matches_the_cpu_backend_over_row_lengths_dtypes_and_k() {
    // (rows, n): one block a row (up to 2048), then chunks merged at 1, 2, 5 and 7 levels.
    let shapes = [
        (7, 1),
        (5, 5),
        (3, 64),
        (4, 1000),
        (3, 2048),
        (3, 2049),
        (2, 4097),
        (2, 3 * 2048 + 1),
        (8, 50_304),
        (2, 200_000),
    ];
    let dtypes = [DType::BF16, DType::F16, DType::F32, DType::F64, DType::I64];
    for (s, &(rows, n)) in shapes.iter().enumerate() {
        for (d, &dtype) in dtypes.iter().enumerate() {
            let x = sample(&[rows, n], (s * 10 + d) as u64, dtype);
            for descending in [false, true] {
                let what = format!("{dtype} [{rows}, {n}] descending={descending}");
                same_on_gpu(&format!("sort {what}"), &x, |x| x.sort(1, descending));
                let mut ks = vec![1, 5, 50, 1024, 2048, 2049, n - 1, n];
                ks.retain(|&k| k <= n);
                ks.sort_unstable();
                ks.dedup();
                for k in ks {
                    same_on_gpu(&format!("topk k={k} {what}"), &x, |x| x.topk(k, 1, descending));
                }
            }
            // The CPU backend against the f64 reference (exact for these values, except
            // int64 past 2^53, which the reference cannot tell apart).
            if dtype != DType::I64 {
                for descending in [false, true] {
                    let k = n.min(1024);
                    let (_, i) = x.topk(k, 1, descending).unwrap();
                    assert_eq!(
                        i.to_vec::<i64>().unwrap(),
                        reference(&x, k, descending),
                        "{dtype} [{rows}, {n}]"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sort_takes_every_dtype_views_and_inner_dims() {
    for dtype in common::ALL_DTYPES {
        let x = sample(&[6, 3000], 11, dtype);
        for descending in [false, true] {
            same_on_gpu(&format!("{dtype} sort"), &x, |x| x.sort(1, descending));
            same_on_gpu(&format!("{dtype} topk"), &x, |x| x.topk(17, 1, descending));
        }
    }
    // Non-contiguous inputs, dims other than the last, an offset into the storage.
    for dtype in [DType::F32, DType::BF16, DType::I64] {
        let base = sample(&[4, 2100, 3], 5, dtype);
        let views = [
            base.clone(),
            base.permute(&[2, 0, 1]).unwrap(),
            base.narrow(1, 7, 2090).unwrap(),
            base.transpose(0, 2).unwrap().narrow(0, 1, 2).unwrap(),
        ];
        for (v, x) in views.iter().enumerate() {
            for dim in 0..3isize {
                let n = x.dims()[dim as usize];
                for descending in [false, true] {
                    let what = format!("{dtype} view {v} dim {dim} descending={descending}");
                    same_on_gpu(&what, x, |x| x.sort(dim, descending));
                    same_on_gpu(&what, x, |x| x.topk(n.min(3), dim, descending));
                    same_on_gpu(&what, x, |x| x.topk(n.min(2049), dim, descending));
                }
            }
        }
    }
    // Empty rows and no rows.
    let gpu = common::gpu();
    let e = Tensor::zeros([3, 0], DType::F32, gpu).unwrap();
    assert_eq!(e.sort(1, false).unwrap().1.dims(), &[3, 0]);
    let e = Tensor::zeros([0, 4], DType::F32, gpu).unwrap();
    assert_eq!(e.topk(2, 1, true).unwrap().1.dims(), &[0, 2]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sort_gradients_reach_the_chosen_elements() {
    // Ties but no NaN: floats of quarter steps.
    let v: Vec<f32> = common::values(4 * 5000, 2)
        .iter()
        .map(|x| (x * 40.0).floor() as f32 / 4.0)
        .collect();
    let x = Tensor::from_vec(v, [4, 5000], CPU).unwrap();
    let grads: Vec<Vec<f64>> = [CPU, common::gpu()]
        .iter()
        .map(|&dev| {
            // A leaf of its own on each device (`to(Cpu)` of a CPU tensor is the tensor itself).
            let x = x
                .to(dev)
                .unwrap()
                .deep_clone()
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            let (v, _) = x.topk(300, 1, true).unwrap();
            let w = Tensor::arange(0.0, 300.0, 1.0, DType::F32, dev).unwrap();
            v.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            x.grad().unwrap().to_vec_f64().unwrap()
        })
        .collect();
    assert_eq!(grads[0], grads[1]);
    assert_eq!(grads[0].iter().filter(|g| **g != 0.0).count(), 4 * 299);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sort_topk_and_sort_never_wait_for_the_device() {
    let gpu = common::gpu();
    let logits = sample(&[8, 50_304], 9, DType::F32).to(gpu).unwrap();
    let short = sample(&[64, 100], 9, DType::BF16).to(gpu).unwrap();
    // Warm-up: kernels loaded before counting.
    logits.topk(50, 1, true).unwrap();
    short.sort(1, false).unwrap();
    ember_core::cuda::synchronize(0).unwrap();
    let before = ember_core::cuda::host_sync_count();
    let (v, i) = logits.topk(50, 1, true).unwrap();
    let (sv, _) = logits.sort(1, true).unwrap();
    short.sort(1, false).unwrap();
    short.argsort(0, true).unwrap();
    assert_eq!(
        ember_core::cuda::host_sync_count() - before,
        0,
        "an ordering waited for the device"
    );
    // And the answers are right.
    let (cv, ci) = logits.to(CPU).unwrap().topk(50, 1, true).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), ci.to_vec::<i64>().unwrap());
    assert_eq!(common::bits(&v), common::bits(&cv));
    assert_eq!(common::bits(&sv.narrow(1, 0, 50).unwrap()), common::bits(&cv));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sort_topk_captured_in_a_graph_replays_over_new_logits() {
    common::gpu();
    common::in_own_process(
        "sort::cuda_sort_topk_captured_in_a_graph_replays_over_new_logits",
        cuda_sort_topk_captured_body,
    );
}

fn cuda_sort_topk_captured_body() {
    use ember_core::cuda::{self, CUDAGraph};
    let gpu = common::gpu();
    let logits = sample(&[8, 50_304], 21, DType::F32).to(gpu).unwrap();
    let short = sample(&[8, 300], 22, DType::BF16).to(gpu).unwrap();
    // Warm-up: kernels loaded and the allocator's blocks made before the capture.
    logits.topk(1024, 1, true).unwrap();
    short.sort(1, false).unwrap();
    cuda::synchronize(0).unwrap();
    let mut graph = CUDAGraph::new();
    let ((v, i), (sv, si)) = {
        let _capture = cuda::graph(&mut graph).unwrap();
        (logits.topk(1024, 1, true).unwrap(), short.sort(1, false).unwrap())
    };
    assert!(graph.is_captured());
    for seed in [21u64, 31, 41] {
        let fresh = sample(&[8, 50_304], seed, DType::F32);
        let fresh_short = sample(&[8, 300], seed + 1, DType::BF16);
        logits.copy_(&fresh.to(gpu).unwrap()).unwrap();
        short.copy_(&fresh_short.to(gpu).unwrap()).unwrap();
        graph.replay().unwrap();
        let (cv, ci) = fresh.topk(1024, 1, true).unwrap();
        assert_eq!(
            i.to_vec::<i64>().unwrap(),
            ci.to_vec::<i64>().unwrap(),
            "seed {seed}"
        );
        assert_eq!(common::bits(&v), common::bits(&cv), "seed {seed}");
        let (csv, csi) = fresh_short.sort(1, false).unwrap();
        assert_eq!(
            si.to_vec::<i64>().unwrap(),
            csi.to_vec::<i64>().unwrap(),
            "seed {seed}"
        );
        assert_eq!(common::bits(&sv), common::bits(&csv), "seed {seed}");
    }
}

/// The GPU time of a sampler's orderings over GPT-2's logits (`[8, 50,304]` f32): topk of 50
/// and of 1024, and a full descending sort, from the profiler's kernel records (`--nocapture`
/// prints `KT` lines: what Note [Device sort] leaves unmeasured).
#[test]
#[ignore = "needs a CUDA device; prints kernel times (--nocapture)"]
fn cuda_sort_topk_kernel_time() {
    // Alone in its process: the profile would count other tests' sort launches too.
    common::in_own_process("sort::cuda_sort_topk_kernel_time", sort_topk_kernel_time);
}

fn sort_topk_kernel_time() {
    let gpu = common::gpu();
    let logits = sample(&[8, 50_304], 4, DType::F32).to(gpu).unwrap();
    let steps = 20;
    for (label, k) in [("topk50", 50), ("topk1024", 1024), ("full_sort", 50_304)] {
        let prof = common::profile_steps(3, steps, || {
            logits.topk(k, 1, true).unwrap();
        });
        let launches = common::print_kernel_times(&prof, label, steps);
        // One chunk sort and five merge levels a call (50,304 = 25 chunks of 2048).
        assert_eq!(
            launches.get("sort_block_f32").copied(),
            Some(steps),
            "{label}: {launches:?}"
        );
        assert_eq!(
            launches.get("sort_merge").copied(),
            Some(5 * steps),
            "{label}: {launches:?}"
        );
        let us = prof.key_averages().self_cuda_time_total_us() / steps as f64;
        println!("{label} over [8, 50304] f32: {us:.1} us of GPU time a call");
    }
}
