//! The fused kernels of issue 37: layer_norm (forward and backward) and GELU's backward, each
//! against float64 values computed here by hand, in f32, bf16 and f16 on the CPU (and f64);
//! gradient checks in f64; CUDA against the CPU on odd row lengths and non-contiguous inputs.

use super::common::{
    assert_close_slice, cpu_bf16, cpu_vs_cuda, gpu, gradcheck, kernels_of, print_kernel_times, profile_steps,
    values,
};
use ember_core::{amp, DType, Device, DeviceType, Result, Tensor};

/// Layer norm of `rows` rows of `n` in f64: (y, dx, dw, db) for output gradient `g`.
pub(crate) fn reference(
    x: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    g: &[f64],
    n: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut db) = (vec![0.0; n], vec![0.0; n]);
    for r in 0..x.len() / n {
        let xr = &x[r * n..(r + 1) * n];
        let gr = &g[r * n..(r + 1) * n];
        let m = xr.iter().sum::<f64>() / n as f64;
        let var = xr.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n as f64;
        let rs = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = xr.iter().map(|v| (v - m) * rs).collect();
        let wc = |c: usize| w.map_or(1.0, |w| w[c]);
        let dxh: Vec<f64> = (0..n).map(|c| gr[c] * wc(c)).collect();
        let s1 = dxh.iter().sum::<f64>() / n as f64;
        let s2 = dxh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / n as f64;
        for c in 0..n {
            y[r * n + c] = xh[c] * wc(c) + b.map_or(0.0, |b| b[c]);
            dx[r * n + c] = rs * (dxh[c] - s1 - xh[c] * s2);
            dw[c] += gr[c] * xh[c];
            db[c] += gr[c];
        }
    }
    (y, dx, dw, db)
}

/// Tolerances of a result rounded once to `dtype` (and computed in f32 for the floats below
/// f64), against float64 values of magnitude about 1.
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (2e-3, 2e-3),
        _ => (1e-2, 1e-2),
    }
}

/// The layer norm of x [rows, n] in `dtype` (parameters in `pdtype`) on `device`, forward and
/// backward: (y, dx, dw, db) as f64 values, with the inputs rounded to their dtypes first.
#[allow(clippy::type_complexity)]
fn run(
    device: Device,
    dtype: DType,
    pdtype: DType,
    rows: usize,
    n: usize,
    affine: (bool, bool),
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, [Vec<f64>; 4])> {
    let round = |v: Vec<f64>, d: DType| -> Result<Vec<f64>> {
        Tensor::from_slice(&v, [v.len()], Device::Cpu)?
            .to_dtype(d)?
            .to_vec_f64()
    };
    let x = round(values(rows * n, 1).iter().map(|v| 3.0 * v + 0.5).collect(), dtype)?;
    let g = round(values(rows * n, 2), dtype)?;
    let w = round(values(n, 3).iter().map(|v| 1.0 + v).collect(), pdtype)?;
    let b = round(values(n, 4), pdtype)?;
    let tx = Tensor::from_slice(&x, [rows, n], device)?
        .to_dtype(dtype)?
        .requires_grad_(true)?;
    let tw = Tensor::from_slice(&w, [n], device)?
        .to_dtype(pdtype)?
        .requires_grad_(true)?;
    let tb = Tensor::from_slice(&b, [n], device)?
        .to_dtype(pdtype)?
        .requires_grad_(true)?;
    let y = tx.layer_norm(&[n], affine.0.then_some(&tw), affine.1.then_some(&tb), 1e-5)?;
    assert_eq!(y.dtype(), dtype);
    let tg = Tensor::from_slice(&g, [rows, n], device)?.to_dtype(dtype)?;
    y.backward_with(Some(&tg), false)?;
    let grad = |t: &Tensor| -> Result<Vec<f64>> {
        match t.grad() {
            Some(g) => g.to_vec_f64(),
            None => Ok(vec![]),
        }
    };
    if affine.0 {
        assert_eq!(tw.grad().unwrap().dtype(), pdtype);
    }
    Ok((y.to_vec_f64()?, grad(&tx)?, grad(&tw)?, grad(&tb)?, [x, w, b, g]))
}

#[test]
fn layer_norm_matches_float64_in_every_float_dtype() {
    let cases = [
        (DType::F64, DType::F64),
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F32),
    ];
    for (dtype, pdtype) in cases {
        for (rows, n) in [(3, 7), (2, 1), (5, 64), (1, 33)] {
            for affine in [(true, true), (false, false), (true, false), (false, true)] {
                let what = format!("{dtype}/{pdtype} [{rows}, {n}] affine {affine:?}");
                let (y, dx, dw, db, [x, w, b, g]) = run(Device::Cpu, dtype, pdtype, rows, n, affine).unwrap();
                let (ey, edx, edw, edb) = reference(
                    &x,
                    affine.0.then_some(&w[..]),
                    affine.1.then_some(&b[..]),
                    &g,
                    n,
                    1e-5,
                );
                let (rtol, atol) = tol(dtype);
                // Rows of one element normalize to 0 (var 0): the input gradient is 0 too.
                eprintln!("{what}");
                assert_close_slice(&y, &ey, rtol, atol);
                assert_close_slice(&dx, &edx, rtol, atol * 4.0);
                if affine.0 {
                    let (r, a) = tol(pdtype);
                    assert_close_slice(&dw, &edw, r.max(rtol), a.max(atol) * rows as f64);
                }
                if affine.1 {
                    let (r, a) = tol(pdtype);
                    assert_close_slice(&db, &edb, r.max(rtol), a.max(atol) * rows as f64);
                }
            }
        }
    }
}

/// Note [Gradients added in place]: x feeds a LayerNorm and a residual branch whose gradient
/// reaches x first; LayerNorm's backward adds its dx into that gradient's own buffer, which
/// becomes x's `.grad` (no add, no new buffer). Where the residual gradient is still held
/// elsewhere, the engine sums as before. Both against float64: residual + LayerNorm's dx.
#[test]
fn layer_norm_adds_its_input_gradient_into_the_waiting_one() {
    use std::sync::{Arc, Mutex};
    let (rows, n) = (5, 24);
    for dev in super::common::devices() {
        for dtype in [DType::F32, DType::BF16] {
            for held in [false, true] {
                let round = |v: Vec<f64>| {
                    Tensor::from_slice(&v, [rows, n], Device::Cpu)
                        .and_then(|t| t.to_dtype(dtype))
                        .and_then(|t| t.to_vec_f64())
                        .unwrap()
                };
                let x = round(values(rows * n, 1).iter().map(|v| 2.0 * v + 0.25).collect());
                let r2 = round(values(rows * n, 2));
                let res = round(values(rows * n, 3));
                let w = values(n, 4).iter().map(|v| 1.0 + v).collect::<Vec<_>>();
                let on = |v: &[f64], shape: &[usize]| {
                    Tensor::from_slice(v, shape, dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let tx = on(&x, &[rows, n]).requires_grad_(true).unwrap();
                let tw = on(&w, &[n]);
                let made = Arc::new(Mutex::new((0usize, None::<Tensor>)));
                let seen = made.clone();
                let res_t = on(&res, &[rows, n]);
                // The layer norm first, so that the residual's node (recorded later) runs first.
                let y = tx.layer_norm(&[n], Some(&tw), None, 1e-5).unwrap();
                let branch = y.mul(&on(&r2, &[rows, n])).unwrap();
                let residual =
                    ember_core::autograd::custom_op("residual", &[&tx], tx.detach(), move |_, _| {
                        let buf = res_t.deep_clone()?;
                        let mut m = seen.lock().unwrap();
                        m.0 = buf.data_ptr();
                        if held {
                            m.1 = Some(buf.clone());
                        }
                        Ok(vec![Some(buf)])
                    });
                branch
                    .add(&residual)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let grad = tx.grad().unwrap();
                let (_, dx, _, _) = reference(&x, Some(&w), None, &r2, n, 1e-5);
                let expected: Vec<f64> = dx.iter().zip(&res).map(|(a, b)| a + b).collect();
                let (rtol, atol) = tol(dtype);
                assert_close_slice(&grad.to_vec_f64().unwrap(), &expected, rtol, atol);
                assert_eq!(
                    grad.data_ptr() == made.lock().unwrap().0,
                    !held,
                    "{dev} {dtype:?}: the residual's buffer holds the sum exactly when nothing else holds it"
                );
            }
        }
    }
}

#[test]
fn layer_norm_over_several_dims_and_strided_inputs() {
    // normalized_shape [3, 4] of a [2, 3, 4] input equals the rows of its [2, 12] view; a
    // transposed (non-contiguous) input equals its contiguous copy.
    let x = Tensor::from_slice(&values(24, 5), [2, 3, 4], Device::Cpu).unwrap();
    let a = x.layer_norm(&[3, 4], None, None, 1e-5).unwrap();
    let b = x
        .reshape(&[2, 12])
        .unwrap()
        .layer_norm(&[12], None, None, 1e-5)
        .unwrap();
    assert_close_slice(&a.to_vec_f64().unwrap(), &b.to_vec_f64().unwrap(), 0.0, 0.0);
    let t = x.transpose(0, 2).unwrap();
    assert!(!t.is_contiguous());
    let a = t.layer_norm(&[2], None, None, 1e-5).unwrap();
    let b = t
        .contiguous()
        .unwrap()
        .layer_norm(&[2], None, None, 1e-5)
        .unwrap();
    assert_close_slice(&a.to_vec_f64().unwrap(), &b.to_vec_f64().unwrap(), 0.0, 0.0);
}

#[test]
fn layer_norm_refuses_bad_arguments_with_typed_errors() {
    let x = Tensor::zeros([2, 4], DType::F32, Device::Cpu).unwrap();
    assert!(x.layer_norm(&[3], None, None, 1e-5).is_err());
    assert!(x.layer_norm(&[], None, None, 1e-5).is_err());
    let w64 = Tensor::ones([4], DType::F64, Device::Cpu).unwrap();
    assert!(
        x.layer_norm(&[4], Some(&w64), None, 1e-5).is_err(),
        "f64 weight on f32 x"
    );
    let w = Tensor::ones([3], DType::F32, Device::Cpu).unwrap();
    assert!(x.layer_norm(&[4], Some(&w), None, 1e-5).is_err(), "weight shape");
    let xi = Tensor::zeros([2, 4], DType::I64, Device::Cpu).unwrap();
    assert!(xi.layer_norm(&[4], None, None, 1e-5).is_err(), "integer input");
    // f32 parameters with a bf16 input are PyTorch's mixed type, but not f32 with f16 bias.
    let xb = x.to_dtype(DType::BF16).unwrap();
    let (wf, bh) = (
        Tensor::ones([4], DType::F32, Device::Cpu).unwrap(),
        Tensor::zeros([4], DType::BF16, Device::Cpu).unwrap(),
    );
    assert!(xb.layer_norm(&[4], Some(&wf), None, 1e-5).is_ok());
    assert!(xb.layer_norm(&[4], Some(&wf), Some(&bh), 1e-5).is_err());
}

#[test]
fn layer_norm_gradcheck_f64() {
    let x = Tensor::from_slice(&values(15, 7), [3, 5], Device::Cpu).unwrap();
    let w = Tensor::from_slice(&values(5, 8), [5], Device::Cpu).unwrap();
    let b = Tensor::from_slice(&values(5, 9), [5], Device::Cpu).unwrap();
    gradcheck(
        |t| t[0].layer_norm(&[5], Some(&t[1]), Some(&t[2]), 1e-5),
        &[x.clone(), w, b],
    );
    gradcheck(|t| t[0].layer_norm(&[5], None, None, 1e-5), &[x]);
}

/// GELU's derivative in f64: exact (erf) or tanh form.
fn gelu_grad(g: f64, v: f64, tanh: bool) -> f64 {
    use std::f64::consts::PI;
    if tanh {
        let (k, kappa) = ((2.0 / PI).sqrt(), 0.044715);
        let t = (k * (v + kappa * v * v * v)).tanh();
        g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * kappa * v * v))
    } else {
        let cdf = 0.5 * (1.0 + libm::erf(v / 2f64.sqrt()));
        g * (cdf + v * (-0.5 * v * v).exp() / (2.0 * PI).sqrt())
    }
}

#[test]
fn gelu_backward_matches_float64_in_every_float_dtype() {
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for tanh in [false, true] {
            let gv: Vec<f64> = values(257, 11);
            let xv: Vec<f64> = values(257, 12).iter().map(|v| 4.0 * v).collect();
            let g = Tensor::from_slice(&gv, [257], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let x = Tensor::from_slice(&xv, [257], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let out = if tanh {
                g.gelu_tanh_backward(&x)
            } else {
                g.gelu_backward(&x)
            }
            .unwrap();
            assert_eq!(out.dtype(), dtype);
            let (gr, xr) = (g.to_vec_f64().unwrap(), x.to_vec_f64().unwrap());
            let expected: Vec<f64> = gr.iter().zip(&xr).map(|(&a, &b)| gelu_grad(a, b, tanh)).collect();
            let (rtol, atol) = tol(dtype);
            assert_close_slice(&out.to_vec_f64().unwrap(), &expected, rtol, atol);
            // The GELU's autograd takes the same kernel.
            let xg = x.requires_grad_(true).unwrap();
            let y = if tanh { xg.gelu_tanh() } else { xg.gelu() }.unwrap();
            y.backward_with(Some(&g), false).unwrap();
            assert_close_slice(
                &xg.grad().unwrap().to_vec_f64().unwrap(),
                &out.to_vec_f64().unwrap(),
                0.0,
                0.0,
            );
        }
    }
}

#[test]
fn gelu_and_gelu_backward_gradcheck_f64() {
    let x = Tensor::from_slice(
        &values(9, 13).iter().map(|v| 3.0 * v).collect::<Vec<_>>(),
        [9],
        Device::Cpu,
    )
    .unwrap();
    let g = Tensor::from_slice(&values(9, 14), [9], Device::Cpu).unwrap();
    gradcheck(|t| t[0].gelu(), std::slice::from_ref(&x));
    gradcheck(|t| t[0].gelu_tanh(), std::slice::from_ref(&x));
    gradcheck(|t| t[0].gelu_backward(&t[1]), &[g.clone(), x.clone()]);
    gradcheck(|t| t[0].gelu_tanh_backward(&t[1]), &[g, x]);
}

/// Layer norm forward and backward on `device`, as one tensor: y, dx, dw and db flattened.
fn forward_backward(
    device: Device,
    x: &Tensor,
    n: usize,
    pdtype: DType,
    affine: bool,
    strided: bool,
) -> Result<Tensor> {
    let x = x.to(device)?.detach().requires_grad_(true)?;
    let w = Tensor::from_slice(&values(n, 3), [n], device)?
        .add_scalar(1.0)?
        .to_dtype(pdtype)?;
    let b = Tensor::from_slice(&values(n, 4), [n], device)?.to_dtype(pdtype)?;
    let (w, b) = (w.requires_grad_(true)?, b.requires_grad_(true)?);
    let xin = if strided {
        // The same values through a non-contiguous view.
        x.t()?.contiguous()?.t()?
    } else {
        x.clone()
    };
    let y = xin.layer_norm(&[n], affine.then_some(&w), affine.then_some(&b), 1e-5)?;
    let g = Tensor::from_slice(&values(y.numel(), 2), y.dims(), device)?.to_dtype(y.dtype())?;
    y.backward_with(Some(&g), false)?;
    let mut parts = vec![
        y.flatten(0, -1)?.to_dtype(DType::F64)?,
        x.grad().unwrap().flatten(0, -1)?.to_dtype(DType::F64)?,
    ];
    if affine {
        parts.push(w.grad().unwrap().to_dtype(DType::F64)?);
        parts.push(b.grad().unwrap().to_dtype(DType::F64)?);
    }
    Tensor::cat(&parts, 0)
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_layer_norm_matches_the_cpu() {
    gpu();
    let cases = [
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::F32, DType::F32),
        (DType::F64, DType::F64),
        (DType::BF16, DType::F32),
    ];
    for (dtype, pdtype) in cases {
        // Odd lengths (scalar path), 768 (16-byte vectors), past one warp's shared sums; rows
        // in registers (vectors, n up to 8 vectors a lane) with a last vector only some lanes
        // have (200, 136), with more rows than a grid has warps (2500), at the limit (1024 in
        // f32) and past it (2048 in f32, vectors from memory).
        for (rows, n) in [
            (5, 1),
            (9, 7),
            (33, 768),
            (7, 769),
            (3, 4099),
            (65, 256),
            (2, 6200),
            (17, 200),
            (2500, 136),
            (9, 1024),
            (5, 2048),
        ] {
            for (affine, strided) in [(true, false), (false, false), (true, true)] {
                let x = Tensor::from_slice(&values(rows * n, 1), [rows, n], Device::Cpu)
                    .unwrap()
                    .mul_scalar(3.0)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let what =
                    format!("layer_norm {dtype}/{pdtype} [{rows}, {n}] affine {affine} strided {strided}");
                let (rtol, atol) = super::common::tolerance(dtype);
                // The parameter gradients sum `rows` rounded terms: scale the absolute slack.
                // f32 sums over a row of thousands in another order differ by ~1e-5.
                let atol = match dtype {
                    DType::F64 => 1e-10,
                    DType::F32 => 1e-4,
                    _ => atol * (rows as f64).sqrt() * 4.0,
                };
                cpu_vs_cuda(&what, rtol * 4.0, atol, |d| {
                    forward_backward(d, &x, n, pdtype, affine, strided)
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gelu_backward_matches_the_cpu() {
    gpu();
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        for tanh in [false, true] {
            let (rtol, atol) = super::common::tolerance(dtype);
            cpu_vs_cuda(&format!("gelu backward {dtype} tanh {tanh}"), rtol, atol, |d| {
                let g = Tensor::from_slice(&values(4099, 1), [4099], d)?.to_dtype(dtype)?;
                let x = Tensor::from_slice(&values(4099, 2), [4099], d)?
                    .mul_scalar(4.0)?
                    .to_dtype(dtype)?;
                if tanh {
                    g.gelu_tanh_backward(&x)
                } else {
                    g.gelu_backward(&x)
                }
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (NVRTC)"]
fn cuda_norm_kernels_compile_with_nvrtc() {
    use ember_core::cuda;
    let units = cuda::Module::Norm.units();
    cuda::compile_units(cuda::Module::Norm, &units, "sm_90").unwrap();
    let units = cuda::Module::Elementwise.units();
    let gelu: Vec<_> = units.into_iter().filter(|u| u.name.contains("gelu")).collect();
    assert_eq!(gelu.len(), 8);
    cuda::compile_units(cuda::Module::Elementwise, &gelu, "sm_90").unwrap();
}

/// The GPU time of the `layernorm_bf16` bench workload's step (LayerNorm(768) in bf16 on x
/// [8192, 768], forward and backward with gradients accumulating), from the profiler's kernel
/// records: what the kernels cost without the host (a debug test binary's host is slow).
#[test]
#[ignore = "needs a CUDA device; prints kernel times (--nocapture)"]
fn cuda_layernorm_bf16_kernel_time() {
    let dev = gpu();
    let (n, c) = (8192usize, 768usize);
    let x = Tensor::randn([n, c], DType::BF16, dev)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let w = Tensor::ones([c], DType::BF16, dev)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let b = Tensor::zeros([c], DType::BF16, dev)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let g = Tensor::randn([n, c], DType::BF16, dev).unwrap();
    let step = || {
        let y = x.layer_norm(&[c], Some(&w), Some(&b), 1e-5).unwrap();
        y.backward_with(Some(&g), false).unwrap();
    };
    let steps = 20;
    let prof = profile_steps(5, steps, step);
    let avg = prof.key_averages();
    println!("{}", avg.table("cuda_time_total", 20).unwrap());
    let launches = print_kernel_times(&prof, "layernorm_bf16", steps);
    // Rows of 768 take the backward that keeps them in registers.
    let rows = launches
        .get("layer_norm_backward_rows_bf16_bf16")
        .copied()
        .unwrap_or(0);
    assert!(rows >= steps, "{launches:?}");
    let us = avg.self_cuda_time_total_us() / steps as f64;
    let gbs = 10.0 * (n * c) as f64 / (us * 1e-6) / 1e9;
    println!("layernorm_bf16 GPU time a step: {us:.1} us = {gbs:.0} GB/s of the workload's 10 bytes/element");
}

/// The GPU time of layer norm's kernels in GPT-2's autocast step (issue 37): f32 x [8192, 768]
/// with f32 weight and bias, forward and backward with every gradient, from the profiler's
/// kernel records (`--nocapture` prints them); bf16 x beside it, and f32 rows of 1024. The
/// backward's compulsory traffic is 12 bytes an f32 element (reads x and dy, writes dx).
#[test]
#[ignore = "needs a CUDA device; prints kernel times (--nocapture)"]
fn cuda_layernorm_f32_kernel_time() {
    let dev = gpu();
    // 768: rows in registers; 1024 in f32: past them (both passes read memory).
    for (dtype, n, c) in [
        (DType::F32, 8192usize, 768usize),
        (DType::BF16, 8192, 768),
        (DType::F32, 6144, 1024),
    ] {
        let x = Tensor::randn([n, c], dtype, dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let w = Tensor::randn([c], DType::F32, dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let b = Tensor::randn([c], DType::F32, dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let g = Tensor::randn([n, c], dtype, dev).unwrap();
        let step = || {
            let y = x.layer_norm(&[c], Some(&w), Some(&b), 1e-5).unwrap();
            y.backward_with(Some(&g), false).unwrap();
        };
        let steps = 25;
        let prof = profile_steps(5, steps, step);
        let launches = print_kernel_times(
            &prof,
            &format!("layernorm {dtype} x [{n}, {c}] weights f32"),
            steps,
        );
        // Which backward ran: rows of up to 768 in registers, longer rows the two-pass kernel
        // (at least once a step: the trace also holds what tests running beside this one launch).
        let suffix = if dtype == DType::F32 { "f32" } else { "bf16" };
        let kernel = if c <= 768 {
            format!("layer_norm_backward_rows_{suffix}_f32")
        } else {
            format!("layer_norm_backward_{suffix}_f32")
        };
        assert!(
            launches.get(&kernel).copied().unwrap_or(0) >= steps,
            "{dtype} [{n}, {c}]: {kernel} expected: {launches:?}"
        );
    }
}

/// Note [Activation epilogues]: in `gelu_tanh(x @ w1ᵀ + b1) @ w2ᵀ + b2`, the second linear's
/// backward returns the gradient of the GELU's input (cuBLASLt's DGELU epilogue on CUDA, the
/// product then GELU's backward kernel elsewhere), and the GELU's node is not run: no
/// `GeluTanhBackward0` in the profile. A hook on the GELU's output (which must see that
/// output's gradient) keeps the node. The gradients agree: bit for bit on the CPU (the same
/// kernels), within the dtype's rounding on CUDA.
#[test]
fn a_linear_applies_the_gelu_backward_of_its_input() {
    use ember_core::profiler::{self, ProfilerActivity};
    let _one_profiler = super::common::profiler_lock();
    let on = |v: Vec<f64>, shape: &[usize], dev: Device, dtype: DType| {
        Tensor::from_slice(&v, shape, Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to(dev))
            .and_then(|t| t.requires_grad_(true))
            .unwrap()
    };
    for dev in super::common::devices() {
        for dtype in [DType::F32, DType::BF16] {
            let run = |hooked: bool| -> (Vec<Vec<f64>>, usize) {
                let x = on(values(2 * 5 * 16, 1), &[2, 5, 16], dev, dtype);
                let w1 = on(values(32 * 16, 2), &[32, 16], dev, dtype);
                let b1 = on(values(32, 3), &[32], dev, dtype);
                let w2 = on(values(16 * 32, 4), &[16, 32], dev, dtype);
                let b2 = on(values(16, 5), &[16], dev, dtype);
                let r = on(values(2 * 5 * 16, 6), &[2, 5, 16], dev, dtype).detach();
                let mut prof = profiler::profile()
                    .activities([ProfilerActivity::Cpu])
                    .start()
                    .unwrap();
                {
                    let _case = profiler::record_function("gelu_epilogue_case");
                    let h = x.linear(&w1, Some(&b1)).unwrap().gelu_tanh().unwrap();
                    if hooked {
                        h.register_hook(|_| Ok(None)).unwrap();
                    }
                    let y = h.linear(&w2, Some(&b2)).unwrap();
                    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
                }
                prof.stop().unwrap();
                // This test's thread only: the profiler records every thread's ops.
                let events = prof.events();
                let case = events.iter().find(|e| e.name == "gelu_epilogue_case").unwrap();
                let gelu_nodes = events
                    .iter()
                    .filter(|e| {
                        e.name == "GeluTanhBackward0"
                            && e.thread == case.thread
                            && e.start_ns >= case.start_ns
                            && e.end_ns <= case.end_ns
                    })
                    .count();
                let grads = [&x, &w1, &b1, &w2, &b2]
                    .iter()
                    .map(|t| t.grad().unwrap().to_vec_f64().unwrap())
                    .collect();
                (grads, gelu_nodes)
            };
            let (fused, fused_nodes) = run(false);
            let (plain, plain_nodes) = run(true);
            assert_eq!(
                (fused_nodes, plain_nodes),
                (0, 1),
                "{dev} {dtype:?}: GELU's node runs only when hooked"
            );
            for (i, (a, b)) in fused.iter().zip(&plain).enumerate() {
                if dev == Device::Cpu {
                    assert_eq!(a, b, "{dtype:?}: gradient {i} differs on the CPU");
                } else {
                    let t = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                    assert_close_slice(a, b, t, t); // gradient {i}
                }
            }
        }
    }
}

/// Note [Cast twins]: under bf16 autocast on a GPU, LayerNorm writes the bf16 casts of its
/// float32 output and of its input gradient beside them, and the casts that follow take them:
/// the same values as the CPU's cast, and no cast kernel; a second cast computes again.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_layer_norm_writes_its_bf16_casts_beside_its_results_under_autocast_per_cupti() {
    let dev = gpu();
    let (rows, n) = (96, 768);
    let on = |v: Vec<f64>, dims: &[usize]| {
        Tensor::from_slice(&v, dims, Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to(dev)
            .unwrap()
    };
    let x = on(
        values(rows * n, 3).iter().map(|v| 3.0 * v - 0.2).collect(),
        &[rows, n],
    )
    .requires_grad_(true)
    .unwrap();
    let w = on(values(n, 4).iter().map(|v| 1.0 + 0.5 * v).collect(), &[n])
        .requires_grad_(true)
        .unwrap();
    let b = on(values(n, 5), &[n]).requires_grad_(true).unwrap();
    let y = {
        let _bf16 = amp::autocast(DeviceType::Cuda, DType::BF16).unwrap();
        x.layer_norm(&[n], Some(&w), Some(&b), 1e-5).unwrap()
    };
    assert_eq!(y.dtype(), DType::F32);
    let casts = |names: &[String]| names.iter().filter(|k| k.starts_with("cast_")).count();
    let mut cast = None;
    let names = kernels_of(0, || cast = Some(y.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 0, "the output's twin was not taken: {names:?}");
    assert_eq!(cast.take().unwrap().to_vec_f64().unwrap(), cpu_bf16(&y));
    let names = kernels_of(0, || cast = Some(y.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 1, "a taken twin was taken again: {names:?}");
    assert_eq!(cast.take().unwrap().to_vec_f64().unwrap(), cpu_bf16(&y));
    // The input gradient (stored in x.grad as the kernel wrote it).
    let g = on(values(rows * n, 6), &[rows, n]);
    y.backward_with(Some(&g), false).unwrap();
    let dx = x.grad().unwrap();
    let names = kernels_of(0, || cast = Some(dx.to_dtype(DType::BF16).unwrap()));
    assert_eq!(
        casts(&names),
        0,
        "the input gradient's twin was not taken: {names:?}"
    );
    assert_eq!(cast.take().unwrap().to_vec_f64().unwrap(), cpu_bf16(&dx));
    // Without autocast no twin is written.
    let y = x.layer_norm(&[n], Some(&w), Some(&b), 1e-5).unwrap();
    let names = kernels_of(0, || cast = Some(y.to_dtype(DType::BF16).unwrap()));
    assert_eq!(casts(&names), 1, "{names:?}");
}
