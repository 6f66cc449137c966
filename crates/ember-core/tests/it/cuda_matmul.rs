//! CUDA matrix products (cuBLASLt for floats, the tiled kernel for integers) against the CPU:
//! every dtype, odd and large shapes, batches with broadcast batch dims, transposed and sliced
//! operands read in place or copied, k = 0 and empty outputs, errors, and the TF32 switch.

use crate::common::{cpu_vs_cuda, gpu, values};
use ember_core::{cuda, DType, Device, Error, Tensor};
use std::sync::{Mutex, MutexGuard};

/// The float32 precision is process-wide: every test here holds this lock, so the TF32 test
/// cannot change the precision under another test's f32 products.
static PRECISION: Mutex<()> = Mutex::new(());

pub(crate) fn lock() -> MutexGuard<'static, ()> {
    PRECISION.lock().unwrap_or_else(|e| e.into_inner())
}

/// Resets the precision to the default even when a test panics.
struct ResetPrecision;
impl Drop for ResetPrecision {
    fn drop(&mut self) {
        cuda::set_float32_matmul_precision("highest").unwrap();
    }
}

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
];

/// A CPU tensor of `dims` with deterministic values suited to `dtype`: [-1, 1) for floats,
/// small integers (some negative) for signed types, 0..=20 for u8.
fn input(dims: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f64> = values(n, seed)
        .into_iter()
        .map(|x| match dtype {
            DType::U8 => (x.abs() * 20.0).round(),
            d if d.is_floating_point() => x,
            _ => (x * 20.0).round(),
        })
        .collect();
    Tensor::from_slice(&v, dims, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// CPU-vs-CUDA tolerance of a product with inner dimension `k` (the GPU sums in another order).
fn mm_tolerance(dtype: DType, k: usize) -> (f64, f64) {
    let s = (k.max(1) as f64).sqrt();
    match dtype {
        DType::F64 => (1e-11, 1e-12 * s),
        DType::F32 => (1e-4, 1e-5 * s),
        DType::F16 => (1e-2, 2e-3 * s),
        DType::BF16 => (2e-2, 1e-2 * s),
        _ => (0.0, 0.0),
    }
}

/// `f(a, b)` on both devices for `a`, `b` built on the CPU (then moved), compared.
fn check(
    what: &str,
    dtype: DType,
    k: usize,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(&Tensor, &Tensor) -> ember_core::Result<Tensor>,
) {
    let (rtol, atol) = mm_tolerance(dtype, k);
    cpu_vs_cuda(&format!("{what} {dtype}"), rtol, atol, |dev| {
        f(&a.to(dev)?, &b.to(dev)?)
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_shapes_every_dtype() {
    let _l = lock();
    gpu();
    let shapes = [
        (1, 1, 1),
        (2, 3, 4),
        (3, 5, 7),
        (1, 300, 1),
        (17, 1, 9),
        (64, 64, 64),
        (257, 129, 65),
        (33, 1000, 31),
    ];
    for dtype in DTYPES {
        for (i, &(m, k, n)) in shapes.iter().enumerate() {
            let a = input(&[m, k], 10 + i as u64, dtype);
            let b = input(&[k, n], 20 + i as u64, dtype);
            check(&format!("[{m},{k}]@[{k},{n}]"), dtype, k, &a, &b, |a, b| {
                a.matmul(b)
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_large_output() {
    let _l = lock();
    gpu();
    // 1 << 20 outputs, rows longer than any block.
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        let a = input(&[1024, 48], 1, dtype);
        let b = input(&[48, 1024], 2, dtype);
        check("[1024,48]@[48,1024]", dtype, 48, &a, &b, |a, b| a.matmul(b));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_transposed_operands() {
    let _l = lock();
    gpu();
    for dtype in DTYPES {
        let (m, k, n) = (37, 29, 23);
        // Stored transposed: a as [k, m], b as [n, k]; each combination of in-place forms.
        let at = input(&[k, m], 3, dtype);
        let bt = input(&[n, k], 4, dtype);
        let a = input(&[m, k], 5, dtype);
        let b = input(&[k, n], 6, dtype);
        check("aT@b", dtype, k, &at, &b, |x, y| x.t()?.matmul(y));
        check("a@bT", dtype, k, &a, &bt, |x, y| x.matmul(&y.t()?));
        check("aT@bT", dtype, k, &at, &bt, |x, y| x.t()?.matmul(&y.t()?));
        // Batched transposes.
        let at3 = input(&[4, k, m], 7, dtype);
        let bt3 = input(&[4, n, k], 8, dtype);
        check("bmm aT@bT", dtype, k, &at3, &bt3, |x, y| {
            x.transpose(-1, -2)?.bmm(&y.transpose(-1, -2)?)
        });
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_sliced_and_strided_operands() {
    let _l = lock();
    gpu();
    for dtype in DTYPES {
        // Columns 3..3+k of a wider matrix: ld larger than the row length, non-zero offset.
        let wide = input(&[19, 40], 9, dtype);
        let b = input(&[21, 11], 10, dtype);
        check("narrow cols", dtype, 21, &wide, &b, |x, y| {
            x.narrow(1, 3, 21)?.matmul(y)
        });
        // Rows 1.. of b (offset by one row, odd offset in elements).
        let tall = input(&[22, 11], 11, dtype);
        let a = input(&[19, 21], 12, dtype);
        check("narrow rows", dtype, 21, &a, &tall, |x, y| {
            x.matmul(&y.narrow(0, 1, 21)?)
        });
        // Every other column: neither stride is 1, so the operand is copied first.
        let a2 = input(&[19, 42], 13, dtype);
        check("step 2", dtype, 21, &a2, &b, |x, y| {
            x.slice(1, 0, 42, 2)?.matmul(y)
        });
        // A broadcast row expanded to a matrix (row stride 0): copied.
        let row = input(&[1, 21], 14, dtype);
        check("expanded rows", dtype, 21, &row, &b, |x, y| {
            x.expand(&[5, 21])?.matmul(y)
        });
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_batches_and_broadcast() {
    let _l = lock();
    gpu();
    for dtype in DTYPES {
        let (m, k, n) = (13, 9, 7);
        let a = input(&[5, m, k], 15, dtype);
        let b = input(&[5, k, n], 16, dtype);
        check("bmm", dtype, k, &a, &b, |x, y| x.bmm(y));
        // One side broadcast over the batch: a single batch stride of 0.
        let b1 = input(&[1, k, n], 17, dtype);
        check("batch bcast rhs", dtype, k, &a, &b1, |x, y| x.matmul(y));
        let a1 = input(&[1, m, k], 18, dtype);
        check("batch bcast lhs", dtype, k, &a1, &b, |x, y| x.matmul(y));
        // [2, 1, m, k] @ [3, k, n]: batch dims [2, 3] that do not collapse to one stride.
        let a4 = input(&[2, 1, m, k], 19, dtype);
        let b3 = input(&[3, k, n], 20, dtype);
        check("batch bcast 2d", dtype, k, &a4, &b3, |x, y| x.matmul(y));
        // Batch dims that collapse: [2, 3, m, k] @ [2, 3, k, n].
        let a5 = input(&[2, 3, m, k], 21, dtype);
        let b5 = input(&[2, 3, k, n], 22, dtype);
        check("batch 2d", dtype, k, &a5, &b5, |x, y| x.matmul(y));
        // Batch dims permuted (a non-contiguous batch): [3, 2, ..] viewed as [2, 3, ..].
        let a6 = input(&[3, 2, m, k], 23, dtype);
        check("permuted batch", dtype, k, &a6, &b5, |x, y| {
            x.transpose(0, 1)?.matmul(y)
        });
        // A 3-D lhs against a matrix (folded into one GEMM), vectors on either side, a dot.
        let w = input(&[k, n], 24, dtype);
        check("3d@2d", dtype, k, &a, &w, |x, y| x.matmul(y));
        let v = input(&[k], 25, dtype);
        check("mat@vec", dtype, k, &a, &v, |x, y| x.matmul(y));
        check("vec@mat", dtype, k, &v, &w, |x, y| x.matmul(y));
        let v2 = input(&[k], 26, dtype);
        check("dot", dtype, k, &v, &v2, |x, y| x.matmul(y));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_empty_and_k_zero() {
    let _l = lock();
    gpu();
    for dtype in DTYPES {
        // k = 0: zeros of [m, n] (an empty sum), also batched.
        check(
            "k=0",
            dtype,
            0,
            &input(&[3, 0], 1, dtype),
            &input(&[0, 4], 2, dtype),
            |x, y| x.matmul(y),
        );
        check(
            "k=0 batched",
            dtype,
            0,
            &input(&[2, 3, 0], 1, dtype),
            &input(&[2, 0, 4], 2, dtype),
            |x, y| x.matmul(y),
        );
        check(
            "m=0",
            dtype,
            5,
            &input(&[0, 5], 3, dtype),
            &input(&[5, 3], 4, dtype),
            |x, y| x.matmul(y),
        );
        check(
            "n=0",
            dtype,
            5,
            &input(&[4, 5], 5, dtype),
            &input(&[5, 0], 6, dtype),
            |x, y| x.matmul(y),
        );
        check(
            "batch=0",
            dtype,
            5,
            &input(&[0, 4, 5], 7, dtype),
            &input(&[0, 5, 3], 8, dtype),
            |x, y| x.matmul(y),
        );
    }
    // The k = 0 result really is zeros on the GPU.
    let z = Tensor::zeros([3, 0], DType::F32, gpu())
        .unwrap()
        .matmul(&Tensor::zeros([0, 4], DType::F32, gpu()).unwrap())
        .unwrap();
    assert_eq!(z.to_vec_f64().unwrap(), vec![0.0; 12]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_repeated_calls_reuse_plans_and_stay_correct() {
    let _l = lock();
    gpu();
    // The same shape many times (cached plan) and with operands at other alignments.
    let a = input(&[65, 33], 30, DType::F16);
    let b = input(&[34, 17], 31, DType::F16);
    for start in 0..4 {
        check("repeat", DType::F16, 33, &a, &b, |x, y| {
            x.matmul(&y.narrow(0, start % 2, 33)?)
        });
    }
    let wide = input(&[65, 40], 32, DType::F32);
    for start in 0..5 {
        check(
            "offsets",
            DType::F32,
            33,
            &wide,
            &b.to_dtype(DType::F32).unwrap(),
            |x, y| x.narrow(1, start, 33)?.matmul(&y.narrow(0, 0, 33)?),
        );
    }
}

/// Products from many threads at once, on the default stream and on pool streams: each must
/// be its own (a workspace shared between threads once gave threads each other's results; Note
/// [cuBLASLt state]).
#[test]
#[ignore = "needs a CUDA device"]
fn matmul_from_many_threads_at_once() {
    let _l = lock();
    let dev = gpu();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || {
                let dtype = if t % 2 == 0 { DType::BF16 } else { DType::F16 };
                let stream = (t % 4 >= 2).then(|| cuda::Stream::new_on(0).unwrap());
                let _guard = stream.as_ref().map(cuda::stream);
                let mut wrong = Vec::new();
                for i in 0..150 {
                    let seed = 1000 * t + i;
                    let a = input(&[8, 16], seed, dtype);
                    let b = input(&[16, 4], seed + 500, dtype);
                    let want = a.matmul(&b).unwrap().to_vec_f64().unwrap();
                    let got = a
                        .to(dev)
                        .unwrap()
                        .matmul(&b.to(dev).unwrap())
                        .unwrap()
                        .to_vec_f64()
                        .unwrap();
                    let (rtol, atol) = mm_tolerance(dtype, 16);
                    if got
                        .iter()
                        .zip(&want)
                        .any(|(g, w)| (g - w).abs() > atol + rtol * w.abs())
                    {
                        wrong.push(i);
                    }
                }
                wrong
            })
        })
        .collect();
    for (t, h) in threads.into_iter().enumerate() {
        let wrong = h.join().unwrap();
        assert!(
            wrong.is_empty(),
            "thread {t}: wrong products at iterations {wrong:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_errors_match_the_cpu() {
    let _l = lock();
    let dev = gpu();
    let f = |dt: DType, d: Device| Tensor::zeros([2, 2], dt, d).unwrap();
    for d in [Device::Cpu, dev] {
        let err = f(DType::Bool, d).matmul(&f(DType::Bool, d)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnsupportedDType {
                    dtype: DType::Bool,
                    ..
                }
            ),
            "{d}: {err}"
        );
        let err = f(DType::F32, d).matmul(&f(DType::F64, d)).unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{d}: {err}");
        let err = Tensor::zeros([2, 3], DType::F32, d)
            .unwrap()
            .matmul(&Tensor::zeros([2, 3], DType::F32, d).unwrap())
            .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{d}: {err}");
    }
    let err = f(DType::F32, dev)
        .matmul(&f(DType::F32, Device::Cpu))
        .unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
}

#[test]
fn float32_matmul_precision_switch() {
    let _l = lock();
    let _reset = ResetPrecision;
    assert_eq!(cuda::get_float32_matmul_precision(), "highest");
    assert!(!cuda::allow_tf32());
    cuda::set_allow_tf32(true);
    assert!(cuda::allow_tf32());
    assert_eq!(cuda::get_float32_matmul_precision(), "high");
    cuda::set_allow_tf32(false);
    assert_eq!(cuda::get_float32_matmul_precision(), "highest");
    cuda::set_float32_matmul_precision("medium").unwrap();
    assert!(cuda::allow_tf32());
    assert_eq!(cuda::get_float32_matmul_precision(), "medium");
    let err = cuda::set_float32_matmul_precision("fast").unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(cuda::get_float32_matmul_precision(), "medium");
    cuda::set_float32_matmul_precision("highest").unwrap();
    assert!(!cuda::allow_tf32());
}

#[test]
#[ignore = "needs a CUDA device"]
fn tf32_is_close_to_but_not_f32() {
    let _l = lock();
    let _reset = ResetPrecision;
    let dev = gpu();
    let a = input(&[512, 512], 40, DType::F32);
    let b = input(&[512, 512], 41, DType::F32);
    let run = |p: &str| {
        cuda::set_float32_matmul_precision(p).unwrap();
        let (x, y) = (a.to(dev).unwrap(), b.to(dev).unwrap());
        x.matmul(&y).unwrap().to_vec_f64().unwrap()
    };
    let highest = run("highest");
    let high = run("high");
    let medium = run("medium");
    cuda::set_float32_matmul_precision("highest").unwrap();
    let cpu = a.matmul(&b).unwrap().to_vec_f64().unwrap();
    let scale = cpu.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_diff = |x: &[f64], y: &[f64]| x.iter().zip(y).fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    // "highest" is true f32: CPU-close. "high" (TF32, 10-bit mantissas) differs, within 1e-2
    // relative to the largest output; "medium" may use bf16 and is looser.
    assert!(
        max_diff(&highest, &cpu) <= 1e-5 * scale,
        "highest vs cpu: {}",
        max_diff(&highest, &cpu)
    );
    let d_high = max_diff(&high, &highest);
    assert!(d_high < 1e-2 * scale, "high vs highest: {d_high} (scale {scale})");
    assert!(
        d_high > 0.0,
        "precision \"high\" gave bit-identical results: TF32 was not used"
    );
    let d_medium = max_diff(&medium, &highest);
    assert!(
        d_medium < 5e-2 * scale,
        "medium vs highest: {d_medium} (scale {scale})"
    );
    // Other dtypes ignore the switch.
    cuda::set_float32_matmul_precision("high").unwrap();
    let (a64, b64) = (a.to_dtype(DType::F64).unwrap(), b.to_dtype(DType::F64).unwrap());
    let g = a64
        .to(dev)
        .unwrap()
        .matmul(&b64.to(dev).unwrap())
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let c = a64.matmul(&b64).unwrap().to_vec_f64().unwrap();
    assert!(max_diff(&g, &c) <= 1e-10 * scale);
}

/// Note [Gradients in row blocks]: a weight registered with `set_gradient_row_blocks` gets,
/// through `linear` (with and without a bias) and through `matmul` with its transpose, the
/// gradient an unregistered copy gets, computed in the blocks `row_block_ranges` gives, each
/// with an event that has completed once the device is synchronized; the events are taken
/// once; one block is the whole product with one event; after unregistering, a gradient
/// comes with none.
#[test]
#[ignore = "needs a CUDA device"]
fn weight_gradients_in_row_blocks_equal_the_whole_product() {
    let _l = lock();
    let dev = gpu();
    let (rows, cols, batch) = (1000usize, 96usize, 40usize);
    let leaf = |v: Vec<f64>, dims: &[usize]| {
        Tensor::from_vec(v, dims, Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to(dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap()
    };
    let x = Tensor::from_vec(values(batch * cols, 3), [batch, cols], Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to(dev)
        .unwrap();
    let w_values = values(rows * cols, 4);
    let (w, plain) = (
        leaf(w_values.clone(), &[rows, cols]),
        leaf(w_values, &[rows, cols]),
    );
    let b = leaf(values(rows, 5), &[rows]);
    cuda::set_gradient_row_blocks(&w, 4).unwrap();
    let forwards: [(&str, &dyn Fn(&Tensor) -> Tensor); 3] = [
        ("linear with a bias", &|w| x.linear(w, Some(&b)).unwrap()),
        ("linear", &|w| x.linear(w, None).unwrap()),
        ("matmul", &|w| x.matmul(&w.t().unwrap()).unwrap()),
    ];
    let host = |t: &Tensor| t.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap();
    for (what, f) in forwards {
        for t in [&w, &plain] {
            t.set_grad(None).unwrap();
            f(t).square().unwrap().sum_all().unwrap().backward().unwrap();
        }
        let g = w.grad().unwrap();
        let events = cuda::take_gradient_row_events(&g).unwrap_or_else(|| panic!("{what}: no block events"));
        let blocks: Vec<_> = events.iter().map(|e| e.rows.clone()).collect();
        assert_eq!(blocks, cuda::row_block_ranges(rows, 4), "{what}");
        assert_eq!(blocks, [0..256, 256..512, 512..768, 768..1000], "{what}");
        cuda::synchronize(0).unwrap();
        assert!(events.iter().all(|e| e.event.query().unwrap()), "{what}");
        assert!(cuda::take_gradient_row_events(&g).is_none(), "{what}: taken once");
        for (got, want) in host(&g).iter().zip(host(&plain.grad().unwrap())) {
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{what}: {got} vs {want}"
            );
        }
        assert!(cuda::take_gradient_row_events(&plain.grad().unwrap()).is_none());
    }
    // One block: the product whole, with one event after it (the last forward above, `matmul`,
    // left `plain`'s gradient of the same loss).
    cuda::set_gradient_row_blocks(&w, 1).unwrap();
    w.set_grad(None).unwrap();
    x.linear(&w, None)
        .unwrap()
        .square()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = w.grad().unwrap();
    let events = cuda::take_gradient_row_events(&g).expect("one block: its event");
    assert_eq!(
        events.iter().map(|e| e.rows.clone()).collect::<Vec<_>>(),
        [0..rows]
    );
    for (got, want) in host(&g).iter().zip(host(&plain.grad().unwrap())) {
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "one block: {got} vs {want}"
        );
    }
    cuda::set_gradient_row_blocks(&w, 0).unwrap();
    w.set_grad(None).unwrap();
    x.linear(&w, None).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(cuda::take_gradient_row_events(&w.grad().unwrap()).is_none());
}

#[test]
fn gradient_row_blocks_are_for_gpu_weights() {
    let w = Tensor::zeros([4, 4], DType::F32, Device::Cpu).unwrap();
    let e = cuda::set_gradient_row_blocks(&w, 4).unwrap_err();
    assert!(e.to_string().contains("a 2-D weight on a GPU"), "{e}");
    assert!(e.to_string().contains("cpu"), "{e}");
}

#[test]
fn arrivals_in_row_blocks_are_for_gpu_tensors() {
    let g = Tensor::zeros([4, 4], DType::F32, Device::Cpu).unwrap();
    let e = cuda::arriving_in_row_blocks(&g, Vec::new()).unwrap_err();
    assert!(e.to_string().contains("expected a tensor on a GPU"), "{e}");
    assert!(e.to_string().contains("cpu"), "{e}");
}

/// Note [Timed GEMM algorithms]: with `cuda::tunable` on, each plan's first product times the
/// heuristic's candidates on its own operands and keeps the fastest. Products (plain, with the
/// bias epilogue, batched, transposed) still match the CPU, and a repeated product, which runs
/// the chosen algorithm without timing, gives the same bits.
#[test]
#[ignore = "needs a CUDA device"]
fn matmul_with_timed_algorithms_matches_the_cpu() {
    let _l = lock();
    let dev = gpu();
    struct Off;
    impl Drop for Off {
        fn drop(&mut self) {
            cuda::tunable::enable(false);
        }
    }
    let _off = Off;
    cuda::tunable::enable(true);
    assert!(cuda::tunable::is_enabled());
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (m, k, n) = (96, 256, 384);
        let a = input(&[m, k], 40, dtype);
        let w = input(&[n, k], 41, dtype);
        let bias = input(&[n], 42, dtype);
        check("tuned [96,256]@[256,384]", dtype, k, &a, &w, |a, w| {
            a.matmul(&w.t()?)
        });
        let (rtol, atol) = mm_tolerance(dtype, k);
        cpu_vs_cuda(&format!("tuned linear {dtype}"), rtol, atol, |d| {
            a.to(d)?.linear(&w.to(d)?, Some(&bias.to(d)?))
        });
        let batched = input(&[3, m, k], 43, dtype);
        check("tuned batched", dtype, k, &batched, &w, |x, w| {
            x.matmul(&w.t()?.unsqueeze(0)?)
        });
        let (ad, wd) = (a.to(dev).unwrap(), w.to(dev).unwrap());
        let first = ad.matmul(&wd.t().unwrap()).unwrap().to_vec_f64().unwrap();
        let again = ad.matmul(&wd.t().unwrap()).unwrap().to_vec_f64().unwrap();
        assert_eq!(first, again, "{dtype}: the chosen algorithm is kept");
    }
}

/// The initcheck probes' shape, `[m, k] @ [k, n]`: GPT-2's MLP (768 → 3072 over 1,024 tokens,
/// whose `c_fc` output goes through the tanh GELU), where cuBLASLt picks its Hopper kernels;
/// `EMBER_INITCHECK_SHAPE=m,k,n` tries another.
fn initcheck_shape() -> (usize, usize, usize) {
    let Ok(s) = std::env::var("EMBER_INITCHECK_SHAPE") else {
        return (1024, 768, 3072);
    };
    let v: Vec<usize> = s.split(',').map(|d| d.trim().parse().expect("m,k,n")).collect();
    assert_eq!(v.len(), 3, "EMBER_INITCHECK_SHAPE=m,k,n, got {s:?}");
    (v[0], v[1], v[2])
}

/// One initcheck probe: a bf16 product through `matmul` and the tanh GELU of it on the GPU,
/// after a small product that sets up this thread's cuBLASLt handle and workspace. With
/// `prefill`, the product's output block was first written by a plain fill of ember's (a
/// tensor of the same size, filled and dropped: the caching allocator hands its block to the
/// product, which the test checks). Its first rows are checked against the CPU, so the product
/// did write the block whatever initcheck says. It runs on a high-priority stream of the pool,
/// whose blocks the caching allocator keeps apart from the default stream's: on the default
/// stream another test's thread took the freed block first (session 54, core `it` run whole).
fn initcheck_probe(prefill: bool) {
    let _l = lock();
    let dev = gpu();
    let own = cuda::Stream::with_priority_on(0, -1).unwrap();
    own.wait_stream(&cuda::current_stream(0).unwrap()).unwrap();
    let _on_own = cuda::stream(&own);
    let (m, k, n) = initcheck_shape();
    let warm = input(&[64, 64], 50, DType::BF16).to(dev).unwrap();
    // Loads the product's kernels; its output is not read back, which initcheck would report
    // as a read of a block only cuBLASLt wrote (what the probe is about).
    warm.matmul(&warm).unwrap();
    ember_core::cuda::synchronize(0).unwrap();
    let (a, b) = (input(&[m, k], 51, DType::BF16), input(&[k, n], 52, DType::BF16));
    let (ad, bd) = (a.to(dev).unwrap(), b.to(dev).unwrap());
    let filled = prefill.then(|| {
        let t = Tensor::empty([m, n], DType::BF16, dev).unwrap();
        t.fill_(0.25).unwrap();
        t.data_ptr()
    });
    let y = ad.matmul(&bd).unwrap();
    if let Some(ptr) = filled {
        assert_eq!(
            y.data_ptr(),
            ptr,
            "the product's output is not the filled block: the probe would prove nothing"
        );
    }
    let z = y.gelu_tanh().unwrap();
    let rows = m.min(16);
    let expected = a
        .narrow(0, 0, rows)
        .unwrap()
        .matmul(&b)
        .unwrap()
        .gelu_tanh()
        .unwrap();
    let got = z.narrow(0, 0, rows).unwrap().to(Device::Cpu).unwrap();
    let (rtol, atol) = mm_tolerance(DType::BF16, k);
    crate::common::assert_close(&got, &expected, 2.0 * rtol, 2.0 * atol);
    println!(
        "initcheck probe [{m},{k}]@[{k},{n}] bf16 then gelu_tanh: output at {:#x} ({})",
        y.data_ptr(),
        if prefill { "filled first" } else { "fresh" }
    );
}

/// Run under `compute-sanitizer --tool initcheck` (`scripts/initcheck-probe.sh`): the tanh
/// GELU reads a fresh block that only cuBLASLt's product wrote. An "uninitialized __global__
/// memory read" in `unary_gelu_tanh_bf16` here, and none in the `prefilled` twin, means the
/// tool did not see the product's stores (a false positive), not that ember reads garbage.
#[test]
#[ignore = "needs a CUDA device"]
fn initcheck_probe_gelu_tanh_of_a_fresh_bf16_matmul_output() {
    initcheck_probe(false);
}

/// The twin of `initcheck_probe_gelu_tanh_of_a_fresh_bf16_matmul_output` whose product writes
/// over a block a plain fill wrote first: initcheck must report nothing here.
#[test]
#[ignore = "needs a CUDA device"]
fn initcheck_probe_gelu_tanh_of_a_prefilled_bf16_matmul_output() {
    initcheck_probe(true);
}
