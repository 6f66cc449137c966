//! The fused classifier (`Tensor::cross_entropy_loss`) against PyTorch's definition computed in
//! f64, on the CPU and on a GPU: every float dtype, odd class counts, ignored rows, class
//! weights, label smoothing, the three reductions, the gradient; bf16 logits under autocast
//! against their f32 upcast; and the deterministic embedding backward (`embedding` /
//! `index_select` along dim 0) against the sum of the rows, bitwise across runs on the GPU.

use crate::common::{self, assert_close_slice, gradcheck, values, ReadBack};
use ember_core::{amp, DType, Device, DeviceType, Error, Reduction, Tensor};

/// One problem: n rows of c logits, targets (some `IGNORE`), optional class weights.
struct Case {
    n: usize,
    c: usize,
    logits: Vec<f64>,
    targets: Vec<i64>,
    weight: Option<Vec<f64>>,
}

const IGNORE: i64 = -100;

impl Case {
    fn new(n: usize, c: usize, weighted: bool, seed: u64) -> Case {
        // Logits spread over [-6, 6) so the softmax is far from uniform.
        let logits = values(n * c, seed).iter().map(|v| 6.0 * v).collect();
        let targets = (0..n)
            .map(|i| {
                if i % 4 == 2 {
                    IGNORE
                } else {
                    ((i * 7919 + 3) % c) as i64
                }
            })
            .collect();
        let weight = weighted.then(|| (0..c).map(|k| 0.5 + (k % 5) as f64 / 4.0).collect());
        Case {
            n,
            c,
            logits,
            targets,
            weight,
        }
    }

    /// The values rounded to `dtype` (what the op reads), as f64.
    fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
        Tensor::from_slice(v, [v.len()], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_vec_f64()
            .unwrap()
    }

    /// PyTorch's loss and its gradient for the upstream gradient `up` (one value, or one per
    /// row for `none`), in f64 from the rounded logits and weights.
    fn reference(&self, dtype: DType, red: Reduction, eps: f64, up: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (n, c) = (self.n, self.c);
        let x = Case::rounded(&self.logits, dtype);
        let w: Vec<f64> = match &self.weight {
            Some(w) => Case::rounded(w, dtype),
            None => vec![1.0; c],
        };
        let big_w: f64 = w.iter().sum();
        let mut losses = vec![0.0; n];
        let mut total = 0.0;
        let mut probs = vec![0.0; n * c];
        for i in 0..n {
            let row = &x[i * c..(i + 1) * c];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            for j in 0..c {
                probs[i * c + j] = (row[j] - lse).exp();
            }
            let t = self.targets[i];
            if t == IGNORE {
                continue;
            }
            let t = t as usize;
            let smooth: f64 = (0..c).map(|j| w[j] * (lse - row[j])).sum();
            losses[i] = (1.0 - eps) * w[t] * (lse - row[t]) + eps / c as f64 * smooth;
            total += w[t];
        }
        let loss = match red {
            Reduction::None => losses.clone(),
            Reduction::Sum => vec![losses.iter().sum()],
            Reduction::Mean => vec![losses.iter().sum::<f64>() / total],
        };
        let mut grad = vec![0.0; n * c];
        for i in 0..n {
            let t = self.targets[i];
            if t == IGNORE {
                continue;
            }
            let t = t as usize;
            let s = match red {
                Reduction::None => up[i],
                Reduction::Sum => up[0],
                Reduction::Mean => up[0] / total,
            };
            for j in 0..c {
                let p = probs[i * c + j];
                let hot = if j == t { 1.0 } else { 0.0 };
                grad[i * c + j] = s * ((1.0 - eps) * w[t] * (p - hot) + eps / c as f64 * (big_w * p - w[j]));
            }
        }
        (loss, grad)
    }

    fn tensors(&self, dev: Device, dtype: DType, int32: bool) -> (Tensor, Tensor, Option<Tensor>) {
        let x = Tensor::from_slice(&self.logits, [self.n, self.c], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to(dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let mut t = Tensor::from_slice(&self.targets, [self.n], dev).unwrap();
        if int32 {
            t = t.to_dtype(DType::I32).unwrap();
        }
        let w = self.weight.as_ref().map(|w| {
            Tensor::from_slice(w, [self.c], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap()
        });
        (x, t, w)
    }
}

/// Loss and gradient of every configuration against the f64 reference.
fn check(dev: Device, dtype: DType, c: usize, (rtol, atol): (f64, f64)) {
    let configs = [
        (false, Reduction::Mean, 0.0, false),
        (true, Reduction::Mean, 0.1, true),
        (false, Reduction::Sum, 0.0, true),
        (true, Reduction::None, 0.0, false),
        (false, Reduction::None, 0.25, false),
        (true, Reduction::Sum, 0.05, false),
    ];
    for (k, &(weighted, red, eps, int32)) in configs.iter().enumerate() {
        let case = Case::new(6, c, weighted, 11 + k as u64);
        let what = format!("{dev:?} {dtype} c={c} weighted={weighted} {red:?} eps={eps} int32={int32}");
        let (x, t, w) = case.tensors(dev, dtype, int32);
        let loss = x.cross_entropy_loss(&t, w.as_ref(), red, IGNORE, eps).unwrap();
        assert_eq!(loss.dtype(), dtype, "{what}");
        let up: Vec<f64> = if red == Reduction::None {
            values(case.n, 5).iter().map(|v| v + 1.5).collect()
        } else {
            vec![0.75]
        };
        let up = Case::rounded(&up, dtype);
        let (l, g) = case.reference(dtype, red, eps, &up);
        eprintln!("checking {what}");
        assert_close_slice(&loss.to_vec_f64().unwrap(), &l, rtol, atol);
        let up_t = Tensor::from_slice(&up, loss.dims(), Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to(dev)
            .unwrap();
        loss.backward_with(Some(&up_t), false).unwrap();
        let grad = x.grad().unwrap();
        assert_eq!(grad.dtype(), dtype, "{what}");
        assert_close_slice(&grad.to_vec_f64().unwrap(), &g, rtol, atol);
    }
}

const F64_TOL: (f64, f64) = (1e-12, 1e-13);
const F32_TOL: (f64, f64) = (2e-5, 2e-6);
const F16_TOL: (f64, f64) = (5e-3, 1e-3);
const BF16_TOL: (f64, f64) = (2e-2, 4e-3);

#[test]
fn cross_entropy_matches_its_definition_on_the_cpu() {
    for c in [7, 130] {
        check(Device::Cpu, DType::F64, c, F64_TOL);
        check(Device::Cpu, DType::F32, c, F32_TOL);
        check(Device::Cpu, DType::F16, c, F16_TOL);
        check(Device::Cpu, DType::BF16, c, BF16_TOL);
    }
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let case = Case::new(5, 6, true, 3);
    let t = Tensor::from_slice(&case.targets, [case.n], Device::Cpu).unwrap();
    let w = Tensor::from_slice(case.weight.as_ref().unwrap(), [case.c], Device::Cpu).unwrap();
    let x = Tensor::from_slice(&case.logits, [case.n, case.c], Device::Cpu).unwrap();
    for (red, eps) in [
        (Reduction::Mean, 0.0),
        (Reduction::None, 0.2),
        (Reduction::Sum, 0.1),
    ] {
        gradcheck(
            |i| i[0].cross_entropy_loss(&t, Some(&w), red, IGNORE, eps),
            &[x.clone()],
        );
        gradcheck(
            |i| i[0].cross_entropy_loss(&t, None, red, IGNORE, eps),
            &[x.clone()],
        );
    }
}

#[test]
fn cross_entropy_edge_cases_and_bad_arguments() {
    let d = Device::Cpu;
    let x = Tensor::zeros([3, 4], DType::F32, d).unwrap();
    // Every row ignored: the mean is 0 / 0 = NaN, as PyTorch's; the sum is 0.
    let ignored = Tensor::from_slice(&[IGNORE; 3], [3], d).unwrap();
    let mean = x
        .cross_entropy_loss(&ignored, None, Reduction::Mean, IGNORE, 0.0)
        .unwrap();
    assert!(mean.to_vec_f64().unwrap()[0].is_nan());
    let sum = x
        .cross_entropy_loss(&ignored, None, Reduction::Sum, IGNORE, 0.0)
        .unwrap();
    assert_eq!(sum.to_vec_f64().unwrap(), [0.0]);
    // Uniform logits: ln C per row.
    let t = Tensor::from_slice(&[0i64, 3, 1], [3], d).unwrap();
    let l = x
        .cross_entropy_loss(&t, None, Reduction::Mean, IGNORE, 0.0)
        .unwrap();
    assert!((l.to_vec_f64().unwrap()[0] - 4f64.ln()).abs() < 1e-6);
    // Bad input: typed errors.
    let bad = Tensor::from_slice(&[0i64, 4, 1], [3], d).unwrap();
    assert!(matches!(
        x.cross_entropy_loss(&bad, None, Reduction::Mean, IGNORE, 0.0),
        Err(Error::IndexOutOfRange { index: 4, .. })
    ));
    let short = Tensor::from_slice(&[0i64, 1], [2], d).unwrap();
    assert!(matches!(
        x.cross_entropy_loss(&short, None, Reduction::Mean, IGNORE, 0.0),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(x
        .cross_entropy_loss(
            &t.to_dtype(DType::F32).unwrap(),
            None,
            Reduction::Mean,
            IGNORE,
            0.0
        )
        .is_err());
    assert!(x
        .cross_entropy_loss(&t, None, Reduction::Mean, IGNORE, 1.5)
        .is_err());
    let w5 = Tensor::ones([5], DType::F32, d).unwrap();
    assert!(x
        .cross_entropy_loss(&t, Some(&w5), Reduction::Mean, IGNORE, 0.0)
        .is_err());
    let w64 = Tensor::ones([4], DType::F64, d).unwrap();
    assert!(x
        .cross_entropy_loss(&t, Some(&w64), Reduction::Mean, IGNORE, 0.0)
        .is_err());
    assert!(x
        .to_dtype(DType::I64)
        .unwrap()
        .cross_entropy_loss(&t, None, Reduction::Mean, IGNORE, 0.0)
        .is_err());
}

/// Under autocast bf16 logits give their f32 upcast's loss (an f32 loss) and a bf16 gradient.
fn check_autocast(dev: Device) {
    let case = Case::new(8, 37, true, 21);
    let (x, t, w) = case.tensors(dev, DType::BF16, false);
    let up = x
        .detach()
        .to_dtype(DType::F32)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let w32 = w.as_ref().map(|w| w.to_dtype(DType::F32).unwrap());
    let expected = up
        .cross_entropy_loss(&t, w32.as_ref(), Reduction::Mean, IGNORE, 0.1)
        .unwrap();
    expected.backward().unwrap();
    let loss = {
        let _ac = amp::autocast(dev.device_type(), DType::BF16).unwrap();
        x.cross_entropy_loss(&t, w.as_ref(), Reduction::Mean, IGNORE, 0.1)
            .unwrap()
    };
    assert_eq!(loss.dtype(), DType::F32);
    // The same f32 math on the same values (on a GPU the vector width differs, so the order of
    // the sums, within f32 rounding).
    assert_close_slice(
        &loss.to_vec_f64().unwrap(),
        &expected.to_vec_f64().unwrap(),
        1e-6,
        0.0,
    );
    loss.backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::BF16);
    let g_up = up.grad().unwrap().to_dtype(DType::BF16).unwrap();
    assert_close_slice(&g.to_vec_f64().unwrap(), &g_up.to_vec_f64().unwrap(), 8e-3, 1e-6);
}

#[test]
fn cross_entropy_under_autocast_is_its_f32_upcast() {
    check_autocast(Device::Cpu);
    assert!(!amp::is_autocast_enabled(DeviceType::Cpu));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cross_entropy_matches_its_definition() {
    let dev = common::gpu();
    for c in [7, 1000] {
        check(dev, DType::F64, c, F64_TOL);
        check(dev, DType::F32, c, F32_TOL);
        check(dev, DType::F16, c, F16_TOL);
        check(dev, DType::BF16, c, BF16_TOL);
    }
    check_autocast(dev);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cross_entropy_matches_the_cpu_on_a_wide_vocabulary() {
    // 50,304 + 1 classes: rows that start off the 16-byte boundaries.
    let c = 50_305;
    for dtype in [DType::BF16, DType::F32, DType::F16] {
        for (weighted, red, eps) in [(false, Reduction::Mean, 0.0), (true, Reduction::None, 0.1)] {
            let case = Case::new(5, c, weighted, 7);
            let run = |dev: Device| -> (Tensor, Tensor) {
                let (x, t, w) = case.tensors(dev, dtype, false);
                let loss = x.cross_entropy_loss(&t, w.as_ref(), red, IGNORE, eps).unwrap();
                loss.sum_all().unwrap().backward().unwrap();
                (loss, x.grad().unwrap())
            };
            let ((lc, gc), (lg, gg)) = (run(Device::Cpu), run(common::gpu()));
            let (rtol, atol) = common::tolerance(dtype);
            eprintln!("checking {dtype} c={c} {red:?}");
            assert_close_slice(&lg.to_vec_f64().unwrap(), &lc.to_vec_f64().unwrap(), rtol, atol);
            assert_close_slice(&gg.to_vec_f64().unwrap(), &gc.to_vec_f64().unwrap(), rtol, 1e-6);
        }
    }
    // A view with an offset (the op packs it), every row ignored, and a bad target.
    let dev = common::gpu();
    let x = Tensor::zeros([4, 9], DType::BF16, dev).unwrap();
    let ignored = Tensor::from_slice(&[IGNORE; 4], [4], dev).unwrap();
    let mean = x
        .cross_entropy_loss(&ignored, None, Reduction::Mean, IGNORE, 0.0)
        .unwrap();
    assert!(mean.to_vec_f64().unwrap()[0].is_nan());
    let bad = Tensor::from_slice(&[0i64, 9, 1, 1], [4], dev).unwrap();
    let e = x
        .cross_entropy_loss(&bad, None, Reduction::Sum, IGNORE, 0.0)
        .read_back()
        .unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { index: 9, .. }), "{e}");
    let t = Tensor::from_slice(&[0i64, 8, 1, 1], [4], dev).unwrap();
    let l = x
        .cross_entropy_loss(&t, None, Reduction::Mean, IGNORE, 0.0)
        .unwrap();
    assert!((l.to_vec_f64().unwrap()[0] - 9f64.ln()).abs() < 1e-2);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_one_pass_classifier_writes_the_gradient_in_the_forward() {
    // Note [One-pass classifier]: rows in whole 16-byte vectors, the mean and the sum, with and
    // without class weights, smoothing and ignored rows; the implicit 1 of `backward()` takes
    // the forward's gradient as it is, another gradient multiplies it.
    let dev = common::gpu();
    let cases = [
        (DType::BF16, 50_304, false, Reduction::Mean, 0.0),
        (DType::BF16, 1_024, true, Reduction::Mean, 0.1),
        (DType::BF16, 4_096, false, Reduction::Sum, 0.05),
        (DType::F32, 8_192, true, Reduction::Mean, 0.0),
        (DType::F32, 32_768, false, Reduction::Sum, 0.0),
    ];
    for (k, &(dtype, c, weighted, red, eps)) in cases.iter().enumerate() {
        let case = Case::new(6, c, weighted, 31 + k as u64);
        let (rtol, atol) = if dtype == DType::BF16 { BF16_TOL } else { F32_TOL };
        for scale in [None, Some(0.3)] {
            let what = format!("{dtype} c={c} weighted={weighted} {red:?} eps={eps} scale={scale:?}");
            let (x, t, w) = case.tensors(dev, dtype, false);
            let up = Case::rounded(&[scale.unwrap_or(1.0)], DType::F32);
            let (l, g) = case.reference(dtype, red, eps, &up);
            let mut loss = None;
            let names = common::kernels_of(1, || {
                x.set_grad(None).unwrap();
                let l = x.cross_entropy_loss(&t, w.as_ref(), red, IGNORE, eps).unwrap();
                match scale {
                    None => l.backward().unwrap(),
                    Some(s) => (&l * s).unwrap().backward().unwrap(),
                }
                loss = Some(l);
            });
            eprintln!("checking {what}");
            let ran = |prefix: &str| names.iter().any(|n| n.starts_with(prefix));
            assert!(ran("cross_entropy_forward_grad_"), "{what}: {names:?}");
            assert!(!ran("cross_entropy_backward_"), "{what}: {names:?}");
            assert_eq!(
                ran("cross_entropy_rescale_"),
                scale.is_some(),
                "{what}: {names:?}"
            );
            assert_close_slice(&loss.unwrap().to_vec_f64().unwrap(), &l, rtol, atol);
            let grad = x.grad().unwrap();
            assert_eq!(grad.dtype(), dtype, "{what}");
            assert_close_slice(&grad.to_vec_f64().unwrap(), &g, rtol, atol);
        }
    }
    // Rows the kernel does not hold (more than 65,536 bf16 classes, rows off the 16-byte
    // boundaries), f16 logits (Note [One-pass classifier]) and per-row losses take the two
    // passes.
    for (dtype, c, red) in [
        (DType::BF16, 65_544, Reduction::Mean),
        (DType::BF16, 1_001, Reduction::Mean),
        (DType::F16, 1_024, Reduction::Mean),
        (DType::BF16, 1_024, Reduction::None),
    ] {
        let case = Case::new(3, c, false, 5);
        let (x, t, _) = case.tensors(dev, dtype, false);
        let names = common::kernels_of(1, || {
            x.set_grad(None).unwrap();
            let l = x.cross_entropy_loss(&t, None, red, IGNORE, 0.0).unwrap();
            l.sum_all().unwrap().backward().unwrap();
        });
        let ran = |prefix: &str| names.iter().any(|n| n.starts_with(prefix));
        assert!(
            !ran("cross_entropy_forward_grad_"),
            "{dtype} c={c} {red:?}: {names:?}"
        );
        assert!(ran("cross_entropy_backward_"), "{dtype} c={c} {red:?}: {names:?}");
        let (_, g) = case.reference(dtype, red, 0.0, &vec![1.0; 3]);
        let (rtol, atol) = common::tolerance(dtype);
        assert_close_slice(&x.grad().unwrap().to_vec_f64().unwrap(), &g, rtol, atol);
    }
}

// ---- the deterministic embedding backward ----

/// The weight gradient of `embedding(idx, w)` for the upstream gradient `g`, and the exact sum.
fn embedding_grad(dev: Device, dtype: DType, rows: usize, d: usize, idx: &[i64], g: &[f64]) -> Tensor {
    let w = Tensor::zeros([rows, d], dtype, dev)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let i = Tensor::from_slice(idx, [idx.len()], dev).unwrap();
    let out = Tensor::embedding(&i, &w).unwrap();
    let up = Tensor::from_slice(g, [idx.len(), d], Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to(dev)
        .unwrap();
    out.backward_with(Some(&up), false).unwrap();
    w.grad().unwrap()
}

fn embedding_case(n: usize, rows: usize, d: usize) -> (Vec<i64>, Vec<f64>) {
    // Repeated indices, skewed to the low rows (as token ids are), some rows never read.
    let idx = values(n, 4)
        .iter()
        .map(|v| ((v * v) * (rows as f64 - 1.0)) as i64)
        .collect();
    (idx, values(n * d, 8))
}

fn expected_sum(idx: &[i64], g: &[f64], rows: usize, d: usize, dtype: DType) -> Vec<f64> {
    let g = Case::rounded(g, dtype);
    let mut out = vec![0.0; rows * d];
    for (p, &r) in idx.iter().enumerate() {
        for k in 0..d {
            out[r as usize * d + k] += g[p * d + k];
        }
    }
    out
}

#[test]
fn embedding_backward_sums_the_rows_read() {
    let (rows, d) = (13, 5);
    let (idx, g) = embedding_case(40, rows, d);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let grad = embedding_grad(Device::Cpu, dtype, rows, d, &idx, &g);
        assert_eq!(grad.dtype(), dtype);
        let exp = expected_sum(&idx, &g, rows, d, dtype);
        assert_close_slice(&grad.to_vec_f64().unwrap(), &exp, tol, tol);
    }
    // index_select along dim 0 of a 3-D table shares the path.
    let x = Tensor::from_slice(&values(24, 2), [4, 3, 2], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let i = Tensor::from_slice(&[3i64, 0, 3, 3], [4], Device::Cpu).unwrap();
    x.index_select(0, &i)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap().to_vec_f64().unwrap();
    let per_row: Vec<f64> = (0..4).map(|r| g[r * 6]).collect();
    assert_eq!(per_row, [1.0, 0.0, 0.0, 3.0]);
    gradcheck(
        |t| t[0].index_select(0, &i).map(|y| y.mul_scalar(1.5).unwrap()),
        &[x.detach()],
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_embedding_backward_is_the_sum_and_the_same_bits_every_run() {
    let dev = common::gpu();
    // Several chunks of 1,024 positions, more than 256 columns; then more than 32 chunks.
    for (n, rows, d) in [(3000, 50, 300), (33 * 1024 + 5, 97, 3), (1, 4, 1)] {
        let (idx, g) = embedding_case(n, rows, d);
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let a = embedding_grad(dev, dtype, rows, d, &idx, &g)
                .to_vec_f64()
                .unwrap();
            let b = embedding_grad(dev, dtype, rows, d, &idx, &g)
                .to_vec_f64()
                .unwrap();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{dtype} n={n}: two runs differ");
            // Same order as the CPU's, so the same bits.
            let cpu = embedding_grad(Device::Cpu, dtype, rows, d, &idx, &g)
                .to_vec_f64()
                .unwrap();
            assert_eq!(bits(&a), bits(&cpu), "{dtype} n={n}: GPU and CPU differ");
            let exp = expected_sum(&idx, &g, rows, d, dtype);
            let tol = if dtype == DType::F64 { 1e-12 } else { 3e-2 };
            assert_close_slice(&a, &exp, tol, tol);
        }
    }
}

/// Note [Gradients added in place]: a tied table (read by `embedding` and, recorded later, by
/// another op whose gradient reaches it first) gets the rows' sums added into that gradient's
/// own buffer, rows never read untouched; where the first gradient is held elsewhere, the
/// engine adds as before. Both against the exact sum, on every device.
#[test]
fn embedding_backward_adds_into_the_tied_weights_waiting_gradient() {
    use std::sync::{Arc, Mutex};
    let (rows, d) = (13, 40);
    let (idx, g) = embedding_case(50, rows, d);
    for dev in common::devices() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            for held in [false, true] {
                let w = Tensor::zeros([rows, d], dtype, dev)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap();
                let i = Tensor::from_slice(&idx, [idx.len()], dev).unwrap();
                let rows_read = Tensor::embedding(&i, &w).unwrap();
                let other = values(rows * d, 9);
                let other_t = Tensor::from_slice(&other, [rows, d], Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to(dev)
                    .unwrap();
                let made = Arc::new(Mutex::new((0usize, None::<Tensor>)));
                let seen = made.clone();
                // Recorded after the read, so its gradient reaches the table first.
                let tied = ember_core::autograd::custom_op(
                    "tied",
                    &[&w],
                    w.detach().sum_all().unwrap(),
                    move |_, _| {
                        let buf = other_t.deep_clone()?;
                        let mut m = seen.lock().unwrap();
                        m.0 = buf.data_ptr();
                        if held {
                            m.1 = Some(buf.clone());
                        }
                        Ok(vec![Some(buf)])
                    },
                );
                let up = Tensor::from_slice(&g, [idx.len(), d], Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to(dev)
                    .unwrap();
                let loss = rows_read.mul(&up).unwrap().sum_all().unwrap().add(&tied).unwrap();
                loss.backward().unwrap();
                let grad = w.grad().unwrap();
                let other_r = Case::rounded(&other, dtype);
                let exp: Vec<f64> = expected_sum(&idx, &g, rows, d, dtype)
                    .iter()
                    .zip(&other_r)
                    .map(|(a, b)| a + b)
                    .collect();
                assert_close_slice(&grad.to_vec_f64().unwrap(), &exp, tol, tol);
                assert_eq!(
                    grad.data_ptr() == made.lock().unwrap().0,
                    !held,
                    "{dev} {dtype:?}: the first gradient's buffer holds the sum exactly when nothing else holds it"
                );
            }
        }
    }
}
