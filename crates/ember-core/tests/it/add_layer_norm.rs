//! The fused residual add + LayerNorm (`fused::add_layer_norm`, issue 37): `(x + residual,
//! layer_norm(x + residual))` and its gradients against float64 values computed here by hand and
//! against the unfused composition (`add` then `layer_norm`) on the CPU, in f64, f32, bf16 and
//! f16; a gradient check in f64; on CUDA against float64, the CPU backend and the composition,
//! and the kernels it launches each way.

use super::common::{assert_close_slice, cpu_vs_cuda, gpu, gradcheck, kernels_of, values};
use ember_core::fused::add_layer_norm;
use ember_core::{amp, autograd, DType, Device, DeviceType, Result, Tensor};

/// Float64 values of the fused op over `rows` rows of `n`: (sum, normed, d(sum), dw, db) for
/// the gradients `gs` of the sum (from its other uses; None: zero) and `gy` of the output: the
/// layer norm's float64 reference over the sum, its dx plus `gs`.
#[allow(clippy::type_complexity)]
fn reference(
    x: &[f64],
    r: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    gs: Option<&[f64]>,
    gy: &[f64],
    n: usize,
    eps: f64,
) -> [Vec<f64>; 5] {
    let sum: Vec<f64> = x.iter().zip(r).map(|(a, b)| a + b).collect();
    let (y, mut ds, dw, db) = super::layer_norm::reference(&sum, w, b, gy, n, eps);
    if let Some(gs) = gs {
        ds.iter_mut().zip(gs).for_each(|(d, g)| *d += g);
    }
    [sum, y, ds, dw, db]
}

/// One case: x and the residual `[rows, n]` in their dtypes, weight and bias in `pdtype` (each
/// present or not), and whether the sum gets a gradient of its own.
#[derive(Clone, Copy, Debug)]
struct Case {
    xd: DType,
    rd: DType,
    pdtype: DType,
    rows: usize,
    n: usize,
    affine: (bool, bool),
    sum_grad: bool,
}

/// The case's inputs as f64 values rounded to their dtypes: x, residual, weight, bias, the sum's
/// gradient and the output's.
fn inputs(c: Case) -> [Vec<f64>; 6] {
    let round = |v: Vec<f64>, d: DType| -> Vec<f64> {
        Tensor::from_slice(&v, [v.len()], Device::Cpu)
            .and_then(|t| t.to_dtype(d))
            .and_then(|t| t.to_vec_f64())
            .unwrap()
    };
    let (len, n) = (c.rows * c.n, c.n);
    // The sum's dtype: the wider of the two (a mixed pair sums in float32).
    let sd = if c.xd == c.rd { c.xd } else { DType::F32 };
    [
        round(values(len, 1).iter().map(|v| 3.0 * v + 0.5).collect(), c.xd),
        round(values(len, 2).iter().map(|v| 2.0 * v - 0.25).collect(), c.rd),
        round(values(n, 3).iter().map(|v| 1.0 + v).collect(), c.pdtype),
        round(values(n, 4), c.pdtype),
        round(values(len, 5), sd),
        round(values(len, 6), sd),
    ]
}

/// The fused op (or, `fused` false, `add` then `layer_norm`) of the case on `device`, forward and
/// backward through `autograd::grad`: [sum, normed, dx, dresidual, dw, db] as f64 values (empty
/// where absent).
fn run(device: Device, c: Case, fused: bool) -> Result<[Vec<f64>; 6]> {
    let [x, r, w, b, gs, gy] = inputs(c);
    let on = |v: &[f64], dims: &[usize], d: DType| -> Result<Tensor> {
        Tensor::from_slice(v, dims, device)?
            .to_dtype(d)?
            .requires_grad_(true)
    };
    let dims = [c.rows, c.n];
    let (tx, tr) = (on(&x, &dims, c.xd)?, on(&r, &dims, c.rd)?);
    let (tw, tb) = (on(&w, &[c.n], c.pdtype)?, on(&b, &[c.n], c.pdtype)?);
    let (w, b) = (c.affine.0.then_some(&tw), c.affine.1.then_some(&tb));
    let (sum, y) = if fused {
        add_layer_norm(&tx, &tr, &[c.n], w, b, 1e-5)?
    } else {
        let sum = tx.add(&tr)?;
        let y = sum.layer_norm(&[c.n], w, b, 1e-5)?;
        (sum, y)
    };
    let mut leaves = vec![tx.clone(), tr.clone()];
    leaves.extend(w.cloned());
    leaves.extend(b.cloned());
    let gy = Tensor::from_slice(&gy, dims, device)?.to_dtype(y.dtype())?;
    let gs = Tensor::from_slice(&gs, dims, device)?.to_dtype(sum.dtype())?;
    let grads = if c.sum_grad {
        autograd::grad(&[y.clone(), sum.clone()], &leaves, Some(&[gy, gs]), false)?
    } else {
        autograd::grad(&[y.clone()], &leaves, Some(&[gy]), false)?
    };
    let f64s = |t: Option<&Tensor>| -> Result<Vec<f64>> { t.map_or(Ok(vec![]), |t| t.to_vec_f64()) };
    let mut it = grads.iter().map(Option::as_ref);
    let (dx, dr) = (it.next().flatten(), it.next().flatten());
    assert_eq!(
        dx.map(Tensor::dtype),
        Some(c.xd),
        "{c:?}: x's gradient in x's dtype"
    );
    assert_eq!(
        dr.map(Tensor::dtype),
        Some(c.rd),
        "{c:?}: the residual's in its own"
    );
    let dw = if c.affine.0 { it.next().flatten() } else { None };
    let db = if c.affine.1 { it.next().flatten() } else { None };
    Ok([
        sum.to_vec_f64()?,
        y.to_vec_f64()?,
        f64s(dx)?,
        f64s(dr)?,
        f64s(dw)?,
        f64s(db)?,
    ])
}

/// Tolerances of a result rounded once to `dtype` (computed in f32 below f64) against float64
/// values of magnitude about 1.
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (2e-3, 2e-3),
        _ => (1e-2, 1e-2),
    }
}

/// Checks the case on `device` against float64 values.
fn check_float64(device: Device, c: Case) {
    let what = format!("{device} {c:?}");
    eprintln!("{what}");
    let [x, r, w, b, gs, gy] = inputs(c);
    let [sum, y, dx, dr, dw, db] = run(device, c, true).unwrap_or_else(|e| panic!("{what}: {e}"));
    let [esum, ey, eds, edw, edb] = reference(
        &x,
        &r,
        c.affine.0.then_some(&w[..]),
        c.affine.1.then_some(&b[..]),
        c.sum_grad.then_some(&gs[..]),
        &gy,
        c.n,
        1e-5,
    );
    let sd = if c.xd == c.rd { c.xd } else { DType::F32 };
    let (rtol, atol) = tol(sd);
    assert_close_slice(&sum, &esum, rtol, atol * 4.0);
    // The output: of the sum rounded to its dtype, whose rounding the row's statistics carry.
    assert_close_slice(&y, &ey, rtol * 2.0, atol * 2.0);
    let (xr, xa) = tol(c.xd);
    assert_close_slice(&dx, &eds, xr.max(rtol) * 4.0, xa.max(atol) * 8.0);
    let (rr, ra) = tol(c.rd);
    assert_close_slice(&dr, &eds, rr.max(rtol) * 4.0, ra.max(atol) * 8.0);
    let (pr, pa) = tol(c.pdtype);
    let slack = (c.rows as f64).sqrt() * 4.0;
    if c.affine.0 {
        assert_close_slice(&dw, &edw, pr.max(rtol) * 2.0, pa.max(atol) * slack);
    }
    if c.affine.1 {
        assert_close_slice(&db, &edb, pr.max(rtol) * 2.0, pa.max(atol) * slack);
    }
}

/// The dtypes of x and the residual with the parameters' (x's, or f32 beside half inputs).
const SAME: [(DType, DType); 6] = [
    (DType::F64, DType::F64),
    (DType::F32, DType::F32),
    (DType::BF16, DType::BF16),
    (DType::F16, DType::F16),
    (DType::BF16, DType::F32),
    (DType::F16, DType::F32),
];
const AFFINE: [(bool, bool); 4] = [(true, true), (false, false), (true, false), (false, true)];

#[test]
fn add_layer_norm_matches_float64_on_the_cpu() {
    for (dtype, pdtype) in SAME {
        for (rows, n) in [(3, 7), (2, 1), (5, 64), (1, 33)] {
            for affine in AFFINE {
                for sum_grad in [true, false] {
                    let c = Case {
                        xd: dtype,
                        rd: dtype,
                        pdtype,
                        rows,
                        n,
                        affine,
                        sum_grad,
                    };
                    check_float64(Device::Cpu, c);
                }
            }
        }
    }
}

/// The fused op gives the composition's values and gradients, bit for bit (the sum is rounded
/// before it is normalized, as `add` rounds it; the graph is the two ops' nodes), in every
/// dtype, and where it does not fuse (a mixed pair on the CPU) it is the composition.
#[test]
fn add_layer_norm_equals_add_then_layer_norm_on_the_cpu() {
    let mut cases: Vec<(DType, DType, DType)> = SAME.iter().map(|&(d, p)| (d, d, p)).collect();
    cases.push((DType::F32, DType::BF16, DType::F32));
    cases.push((DType::F16, DType::F32, DType::F32));
    for (xd, rd, pdtype) in cases {
        for (rows, n) in [(4, 24), (3, 7), (70, 768)] {
            for affine in [(true, true), (false, false)] {
                for sum_grad in [true, false] {
                    let c = Case {
                        xd,
                        rd,
                        pdtype,
                        rows,
                        n,
                        affine,
                        sum_grad,
                    };
                    let fused = run(Device::Cpu, c, true).unwrap();
                    let unfused = run(Device::Cpu, c, false).unwrap();
                    for (i, name) in ["sum", "normed", "dx", "dresidual", "dw", "db"]
                        .iter()
                        .enumerate()
                    {
                        assert_eq!(fused[i], unfused[i], "{c:?}: {name}");
                    }
                }
            }
        }
    }
}

#[test]
fn add_layer_norm_gradcheck_f64() {
    let (rows, n) = (3, 5);
    let t = |seed: u64, dims: &[usize], scale: f64| {
        let v: Vec<f64> = values(dims.iter().product(), seed)
            .iter()
            .map(|v| v * scale)
            .collect();
        Tensor::from_slice(&v, dims, Device::Cpu).unwrap()
    };
    let (x, r) = (t(1, &[rows, n], 2.0), t(2, &[rows, n], 1.0));
    let (w, b) = (t(3, &[n], 1.0).add_scalar(1.0).unwrap(), t(4, &[n], 1.0));
    // Both outputs, the sum weighed apart from the normalized rows.
    gradcheck(
        |t| {
            let (s, y) = add_layer_norm(&t[0], &t[1], &[n], Some(&t[2]), Some(&t[3]), 1e-5)?;
            s.mul_scalar(0.3)?.add(&y.mul(&y)?)
        },
        &[x, r, w, b],
    );
}

/// Where `add` broadcasts or promotes, the op is the composition, errors included.
#[test]
fn add_layer_norm_runs_the_composition_where_it_does_not_fuse_and_refuses_bad_input() {
    let x = Tensor::from_slice(&values(12, 1), [3, 4], Device::Cpu).unwrap();
    let row = Tensor::from_slice(&values(4, 2), [4], Device::Cpu).unwrap();
    let (s, y) = add_layer_norm(&x, &row, &[4], None, None, 1e-5).unwrap();
    let es = x.add(&row).unwrap();
    assert_eq!(s.to_vec_f64().unwrap(), es.to_vec_f64().unwrap());
    let ey = es.layer_norm(&[4], None, None, 1e-5).unwrap();
    assert_eq!(y.to_vec_f64().unwrap(), ey.to_vec_f64().unwrap());
    // f32 beside f64 on the CPU: promoted to f64 by `add`.
    let x64 = x.to_dtype(DType::F64).unwrap();
    let (s, y) = add_layer_norm(&x.to_dtype(DType::F32).unwrap(), &x64, &[4], None, None, 1e-5).unwrap();
    assert_eq!((s.dtype(), y.dtype()), (DType::F64, DType::F64));
    // A normalized shape that is not the input's last dims, integer inputs, a weight of
    // another shape: typed errors.
    let err = add_layer_norm(&x, &x, &[3], None, None, 1e-5).unwrap_err();
    assert!(err.to_string().contains("normalized_shape"), "{err}");
    let ints = Tensor::zeros([3, 4], DType::I64, Device::Cpu).unwrap();
    assert!(add_layer_norm(&ints, &ints, &[4], None, None, 1e-5).is_err());
    let w = Tensor::ones([5], DType::F32, Device::Cpu).unwrap();
    let err = add_layer_norm(&x, &x, &[4], Some(&w), None, 1e-5).unwrap_err();
    assert!(err.to_string().contains("weight"), "{err}");
    let wh = Tensor::ones([4], DType::F16, Device::Cpu).unwrap();
    assert!(add_layer_norm(&x, &x, &[4], Some(&wh), None, 1e-5).is_err());
}

/// Under autocast `layer_norm` runs in float32: a float32 sum fuses (the same bits as the two
/// ops), a bfloat16 one is the composition's (sum bf16, normed f32).
#[test]
fn add_layer_norm_under_cpu_autocast_is_the_composition() {
    let (rows, n) = (6, 32);
    for dtype in [DType::F32, DType::BF16] {
        let t = |seed| {
            Tensor::from_slice(&values(rows * n, seed), [rows, n], Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        };
        let (x, r) = (t(1), t(2));
        let w = Tensor::ones([n], DType::F32, Device::Cpu).unwrap();
        let _ac = amp::autocast(DeviceType::Cpu, DType::BF16).unwrap();
        let (s, y) = add_layer_norm(&x, &r, &[n], Some(&w), Some(&w), 1e-5).unwrap();
        let es = x.add(&r).unwrap();
        let ey = es.layer_norm(&[n], Some(&w), Some(&w), 1e-5).unwrap();
        assert_eq!((s.dtype(), y.dtype()), (dtype, DType::F32));
        assert_eq!(s.to_vec_f64().unwrap(), es.to_vec_f64().unwrap());
        assert_eq!(y.to_vec_f64().unwrap(), ey.to_vec_f64().unwrap());
    }
}

/// The observers see one `add_layer_norm` (its policy is its parts').
#[test]
fn add_layer_norm_enters_under_its_name() {
    let x = Tensor::from_slice(&values(8, 1), [2, 4], Device::Cpu).unwrap();
    let (out, seen) = super::common::seen(|| add_layer_norm(&x, &x, &[4], None, None, 1e-5).map(drop));
    out.unwrap();
    assert_eq!(seen.first(), Some(&"add_layer_norm"), "{seen:?}");
}

// ---- CUDA ----

/// Row lengths: GPT-2's (16-byte vectors, rows in registers backward), one past a multiple of
/// 8 lanes' vectors, and an odd one (element by element).
const CUDA_ROWS: [(usize, usize); 3] = [(33, 768), (9, 1000), (17, 37)];

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_add_layer_norm_matches_float64_and_the_cpu() {
    let dev = gpu();
    let mut cases: Vec<(DType, DType, DType)> = SAME.iter().map(|&(d, p)| (d, d, p)).collect();
    // The mixed pairs GPT-2's residual stream adds under autocast (read without a cast).
    cases.push((DType::F32, DType::BF16, DType::F32));
    cases.push((DType::F16, DType::F32, DType::F32));
    for (xd, rd, pdtype) in cases {
        for (rows, n) in CUDA_ROWS {
            for affine in AFFINE {
                for sum_grad in [true, false] {
                    let c = Case {
                        xd,
                        rd,
                        pdtype,
                        rows,
                        n,
                        affine,
                        sum_grad,
                    };
                    check_float64(dev, c);
                    // Against the CPU backend (for a mixed pair, the CPU's composition in f32,
                    // within the half operand's tolerance: its gradient is in its dtype, where
                    // the two backends' reduction orders may round one ulp apart).
                    let sd = match (xd, rd) {
                        _ if xd == rd => xd,
                        (DType::F32, half) | (half, DType::F32) => half,
                        _ => DType::F32,
                    };
                    let (rtol, atol) = super::common::tolerance(sd);
                    let atol = match sd {
                        DType::F64 => 1e-10,
                        DType::F32 => 1e-4,
                        _ => atol * (rows as f64).sqrt() * 4.0,
                    };
                    cpu_vs_cuda(&format!("{c:?}"), rtol * 4.0, atol, |d| {
                        let parts: Vec<Tensor> = run(d, c, true)?
                            .into_iter()
                            .map(|v| Tensor::from_slice(&v, [v.len()], Device::Cpu))
                            .collect::<Result<_>>()?;
                        Tensor::cat(&parts, 0)?.to(d)
                    });
                }
            }
        }
    }
}

/// On the GPU too the fused op gives the composition's bits: the sum is `add`'s value, the rows
/// are reduced in the layer norm kernel's order (the same vector width: every operand here is
/// a fresh, aligned allocation), and backward is the same kernels.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_add_layer_norm_equals_add_then_layer_norm() {
    let dev = gpu();
    let mut cases: Vec<(DType, DType, DType)> = SAME.iter().map(|&(d, p)| (d, d, p)).collect();
    cases.push((DType::F32, DType::BF16, DType::F32));
    cases.push((DType::BF16, DType::F32, DType::F32));
    for (xd, rd, pdtype) in cases {
        for (rows, n) in CUDA_ROWS {
            for (affine, sum_grad) in [((true, true), true), ((false, false), false)] {
                let c = Case {
                    xd,
                    rd,
                    pdtype,
                    rows,
                    n,
                    affine,
                    sum_grad,
                };
                let fused = run(dev, c, true).unwrap();
                let unfused = run(dev, c, false).unwrap();
                for (i, name) in ["sum", "normed", "dx", "dresidual", "dw", "db"]
                    .iter()
                    .enumerate()
                {
                    assert_eq!(fused[i], unfused[i], "{c:?}: {name}");
                }
            }
        }
    }
}

/// One kernel forward (`add_layer_norm_*`, where `add` then `layer_norm` launch two) and one
/// backward for the sum's gradient (LayerNorm's, reading the sum's other gradient and writing
/// `it + dx`: no add kernel), plus the parameters' sums kernel when weight and bias learn; for
/// GPT-2's float32 stream beside a bfloat16 branch under autocast as well, whose normalized
/// output comes with its bf16 twin (no cast kernel before the next linear).
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_add_layer_norm_launches_one_kernel_each_way() {
    let dev = gpu();
    let (rows, n) = (64, 768);
    let on = |seed: u64, dims: &[usize], d: DType| {
        Tensor::from_slice(&values(dims.iter().product(), seed), dims, dev)
            .and_then(|t| t.to_dtype(d))
            .unwrap()
    };
    for (xd, rd, autocast) in [
        (DType::F32, DType::F32, false),
        (DType::BF16, DType::BF16, false),
        (DType::F32, DType::BF16, true),
    ] {
        for affine in [false, true] {
            let what = format!("{xd}+{rd} autocast {autocast} affine {affine}");
            let x = on(1, &[rows, n], xd).requires_grad_(true).unwrap();
            let r = on(2, &[rows, n], rd).requires_grad_(true).unwrap();
            // Float32 parameters: x's dtype, or beside bfloat16 inputs PyTorch's mixed kernels.
            let w = on(3, &[n], DType::F32).requires_grad_(affine).unwrap();
            let b = on(4, &[n], DType::F32).requires_grad_(affine).unwrap();
            let (w, b) = (affine.then_some(&w), affine.then_some(&b));
            let fwd = || {
                let _ac = autocast.then(|| amp::autocast(DeviceType::Cuda, DType::BF16).unwrap());
                add_layer_norm(&x, &r, &[n], w, b, 1e-5).unwrap()
            };
            let mut out = None;
            let names = kernels_of(1, || out = Some(fwd()));
            assert_eq!(names.len(), 1, "{what}: forward {names:?}");
            assert!(names[0].starts_with("add_layer_norm"), "{what}: {names:?}");
            let (sum, y) = out.take().unwrap();
            let sd = if xd == rd { xd } else { DType::F32 };
            assert_eq!((sum.dtype(), y.dtype()), (sd, sd), "{what}");
            if autocast {
                // The normalized rows' bf16 cast was written beside them.
                let names = kernels_of(0, || drop(y.to_dtype(DType::BF16).unwrap()));
                assert!(!names.iter().any(|k| k.starts_with("cast_")), "{what}: {names:?}");
            }
            let mut leaves = vec![x.clone(), r.clone()];
            leaves.extend(w.cloned());
            leaves.extend(b.cloned());
            let (gy, gs) = (on(5, &[rows, n], sd), on(6, &[rows, n], sd));
            let mut grads = None;
            let names = kernels_of(0, || {
                grads = Some(
                    autograd::grad(
                        &[y.clone(), sum.clone()],
                        &leaves,
                        Some(&[gy.clone(), gs.clone()]),
                        false,
                    )
                    .unwrap(),
                );
            });
            // The sum's gradient: LayerNorm's kernel (+ the parameters' sums); a half residual
            // takes its gradient's bf16 twin or one cast.
            let norm: Vec<&String> = names.iter().filter(|k| k.contains("layer_norm")).collect();
            assert_eq!(norm.len(), 1 + affine as usize, "{what}: backward {names:?}");
            assert!(
                !names.iter().any(|k| k.starts_with("binary_")),
                "{what}: no add kernel: {names:?}"
            );
            assert!(names.len() <= norm.len() + 1, "{what}: backward {names:?}");
            // And the values: the sum's gradient is gs + LayerNorm's dx, x's and the residual's.
            let grads = grads.unwrap();
            let dx = grads[0].as_ref().unwrap();
            let dr = grads[1].as_ref().unwrap();
            assert_eq!(dx.dtype(), xd);
            assert_eq!(dr.dtype(), rd);
            let dx64 = dx.to_vec_f64().unwrap();
            let dr64 = dr.to_dtype(DType::F64).unwrap().to_vec_f64().unwrap();
            let dx_as_r = dx.to_dtype(rd).unwrap().to_vec_f64().unwrap();
            assert_eq!(
                dr64, dx_as_r,
                "{what}: the residual's gradient is the sum's, cast"
            );
            assert!(dx64.iter().all(|v| v.is_finite()));
        }
    }
}
