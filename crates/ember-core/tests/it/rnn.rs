//! Tests of the fused LSTM recurrence (`ops::rnn::lstm_recurrence`): finite-difference
//! gradients, equality with the same recurrence composed from plain tensor ops (values and
//! gradients), `needs` handling, argument errors, and CPU vs CUDA for every float dtype.

use crate::common::{assert_close, cpu_vs_cuda, gpu, gradcheck, tolerance, values};
use ember_core::ops::rnn::lstm_recurrence;
use ember_core::{DType, Device, Error, Result, Tensor};

/// `[gi, w_hh, h0, c0]` for `(T, N, H)`, pseudo-random (gates pre-activations in about [-2, 2]).
fn inputs(t: usize, n: usize, h: usize, dtype: DType, device: Device, seed: u64) -> Vec<Tensor> {
    let make = |dims: &[usize], scale: f64, s: u64| {
        let numel = dims.iter().product();
        let v: Vec<f64> = values(numel, s).iter().map(|x| x * scale).collect();
        Tensor::from_slice(&v, dims, Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to(device)
            .unwrap()
    };
    vec![
        make(&[t, n, 4 * h], 1.5, seed),
        make(&[4 * h, h], 0.5, seed + 1),
        make(&[n, h], 0.8, seed + 2),
        make(&[n, h], 1.0, seed + 3),
    ]
}

/// The same recurrence from plain tensor ops, as `ember-nn`'s `lstm_step` composed it.
fn composed(x: &[Tensor]) -> Result<Tensor> {
    let (gi, w, mut h, mut c) = (&x[0], &x[1], x[2].clone(), x[3].clone());
    let hid = w.dims()[1];
    let w_t = w.t()?;
    let mut rows = Vec::new();
    for t in 0..gi.dims()[0] {
        let a = gi.select(0, t as isize)?.add(&h.matmul(&w_t)?)?;
        let i = a.narrow(-1, 0, hid)?.sigmoid()?;
        let f = a.narrow(-1, hid, hid)?.sigmoid()?;
        let g = a.narrow(-1, 2 * hid, hid)?.tanh()?;
        let o = a.narrow(-1, 3 * hid, hid)?.sigmoid()?;
        c = f.mul(&c)?.add(&i.mul(&g)?)?;
        h = o.mul(&c.tanh()?)?;
        rows.push(h.clone());
    }
    rows.push(c);
    Tensor::stack(&rows, 0)
}

fn fused(x: &[Tensor]) -> Result<Tensor> {
    lstm_recurrence(&x[0], &x[1], &x[2], &x[3])
}

/// The output and the gradients of all four inputs of `f` under a fixed weighting of the
/// output, all flattened into one f64 vector per tensor.
fn value_and_grads(f: fn(&[Tensor]) -> Result<Tensor>, x: &[Tensor]) -> Result<Vec<Tensor>> {
    let x: Vec<Tensor> = x
        .iter()
        .map(|t| t.detach().requires_grad_(true))
        .collect::<Result<_>>()?;
    let out = f(&x)?;
    let w: Vec<f64> = values(out.numel(), 7);
    let w = Tensor::from_slice(&w, out.dims(), Device::Cpu)?
        .to_dtype(out.dtype())?
        .to(out.device())?;
    out.mul(&w)?.sum_all()?.backward()?;
    let mut all = vec![out.detach()];
    for t in &x {
        all.push(t.grad().expect("every input gets a gradient"));
    }
    Ok(all)
}

#[test]
fn gradcheck_all_four_inputs() {
    for (t, n, h) in [(3, 2, 3), (1, 1, 2), (4, 3, 1)] {
        let x = inputs(t, n, h, DType::F64, Device::Cpu, 11);
        gradcheck(fused, &x);
    }
}

#[test]
fn matches_the_composed_recurrence() {
    for dtype in [DType::F64, DType::F32] {
        let (rtol, atol) = match dtype {
            DType::F64 => (1e-12, 1e-12),
            _ => (1e-5, 1e-5),
        };
        // (32, 256) runs the rows in parallel (4 · 32 · 256 gate elements per step).
        for (t, n, h) in [(5, 3, 4), (2, 1, 7), (3, 32, 256)] {
            let x = inputs(t, n, h, dtype, Device::Cpu, 3);
            let got = value_and_grads(fused, &x).unwrap();
            let want = value_and_grads(composed, &x).unwrap();
            assert_eq!(got[0].dims(), &[t + 1, n, h]);
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.dtype(), dtype);
                assert_eq!(a.dims(), b.dims(), "tensor {k}");
                assert_close(a, b, rtol, atol);
            }
        }
    }
}

#[test]
fn hand_computed_single_step() {
    // T = N = H = 1, w_hh = 0: a = gi. gi = (i, f, g, o) = (0, ln 3, atanh 0.5, 0), c0 = 2:
    // σ(i) = 0.5, σ(f) = 0.75, tanh(g) = 0.5 → c = 0.75·2 + 0.5·0.5 = 1.75, h = 0.5 tanh(1.75).
    let gi = Tensor::from_slice(&[0.0, 3f64.ln(), 0.5f64.atanh(), 0.0], [1, 1, 4], Device::Cpu).unwrap();
    let w = Tensor::zeros([4, 1], DType::F64, Device::Cpu).unwrap();
    let h0 = Tensor::zeros([1, 1], DType::F64, Device::Cpu).unwrap();
    let c0 = Tensor::full([1, 1], 2.0, DType::F64, Device::Cpu).unwrap();
    let out = lstm_recurrence(&gi, &w, &h0, &c0).unwrap().to_vec_f64().unwrap();
    assert!((out[0] - 0.5 * 1.75f64.tanh()).abs() < 1e-15, "{out:?}");
    assert!((out[1] - 1.75).abs() < 1e-15, "{out:?}");
}

#[test]
fn non_contiguous_gi_and_low_precision_dtypes() {
    // gi as a transposed view ([N, T, 4H] data seen as [T, N, 4H]), as batch_first produces.
    let x = inputs(4, 3, 5, DType::F64, Device::Cpu, 21);
    let gi_bt = x[0].transpose(0, 1).unwrap().contiguous().unwrap();
    let mut y = x.clone();
    y[0] = gi_bt.transpose(0, 1).unwrap();
    assert!(!y[0].is_contiguous());
    let want = value_and_grads(composed, &x).unwrap();
    let got = value_and_grads(fused, &y).unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert_close(a, b, 1e-12, 1e-12);
    }
    // f16 and bf16 compute in f32 and round on store: close to the f64 result.
    for dtype in [DType::F16, DType::BF16] {
        let (rtol, atol) = if dtype == DType::F16 {
            (1e-2, 1e-2)
        } else {
            (5e-2, 5e-2)
        };
        let low: Vec<Tensor> = x.iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
        let got = value_and_grads(fused, &low).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.dtype(), dtype);
            assert_close(&a.to_dtype(DType::F64).unwrap(), b, rtol, atol);
        }
    }
}

#[test]
fn only_needed_gradients_and_no_node_without_grad() {
    let x = inputs(3, 2, 4, DType::F64, Device::Cpu, 5);
    let out = fused(&x).unwrap();
    assert!(out.grad_fn_name().is_none() && !out.requires_grad());
    // One input at a time requires grad (each of backward's `needs` branches alone).
    for k in 0..4 {
        let grad_of = |f: fn(&[Tensor]) -> Result<Tensor>| -> Tensor {
            let mut y = x.clone();
            y[k] = x[k].detach().requires_grad_(true).unwrap();
            let out = f(&y).unwrap();
            assert!(out.requires_grad());
            out.sum_all().unwrap().backward().unwrap();
            for (j, t) in y.iter().enumerate() {
                assert_eq!(
                    t.grad().is_some(),
                    j == k,
                    "input {j} with only {k} requiring grad"
                );
            }
            y[k].grad().unwrap()
        };
        assert_close(&grad_of(fused), &grad_of(composed), 1e-12, 1e-12);
    }
    let w = x[1].detach().requires_grad_(true).unwrap();
    assert_eq!(
        lstm_recurrence(&x[0], &w, &x[2], &x[3]).unwrap().grad_fn_name(),
        Some("lstm_recurrence")
    );
    // Under no_grad nothing is recorded even when inputs require grad.
    let _g = ember_core::no_grad();
    assert!(lstm_recurrence(&x[0], &w, &x[2], &x[3])
        .unwrap()
        .grad_fn_name()
        .is_none());
}

#[test]
fn gradient_of_h_n_and_c_n_alone() {
    // Only the last h and c feed the loss: the rows of the one output are views of one node.
    let x = inputs(4, 2, 3, DType::F64, Device::Cpu, 8);
    let f = |x: &[Tensor]| -> Result<Tensor> {
        let out = fused(x)?;
        let t = x[0].dims()[0] as isize;
        out.select(0, t - 1)?.mul_scalar(2.0)?.add(&out.select(0, t)?)
    };
    gradcheck(f, &x);
}

#[test]
fn argument_errors() {
    let x = inputs(2, 3, 4, DType::F32, Device::Cpu, 1);
    let (gi, w, h0, c0) = (&x[0], &x[1], &x[2], &x[3]);
    let invalid = |r: Result<Tensor>| matches!(r, Err(Error::InvalidArgument { .. }));
    // w_hh not [4H, H].
    assert!(invalid(lstm_recurrence(gi, &w.narrow(0, 0, 15).unwrap(), h0, c0)));
    assert!(invalid(lstm_recurrence(gi, &w.reshape(&[64]).unwrap(), h0, c0)));
    // gi's gate dim or rank wrong.
    assert!(invalid(lstm_recurrence(&gi.narrow(2, 0, 12).unwrap(), w, h0, c0)));
    assert!(invalid(lstm_recurrence(&gi.select(0, 0).unwrap(), w, h0, c0)));
    // States of the wrong batch or hidden size.
    assert!(invalid(lstm_recurrence(gi, w, &h0.narrow(0, 0, 2).unwrap(), c0)));
    assert!(invalid(lstm_recurrence(gi, w, h0, &c0.narrow(1, 0, 3).unwrap())));
    // An empty sequence.
    assert!(invalid(lstm_recurrence(&gi.narrow(0, 0, 0).unwrap(), w, h0, c0)));
    // Mixed dtypes, integer dtypes.
    let w64 = w.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        lstm_recurrence(gi, &w64, h0, c0),
        Err(Error::DTypeMismatch { .. })
    ));
    let as_int: Vec<Tensor> = x.iter().map(|t| t.to_dtype(DType::I64).unwrap()).collect();
    assert!(matches!(fused(&as_int), Err(Error::UnsupportedDType { .. })));
}

// ---------------------------------------------------------------------------------------
// CPU vs CUDA.

const SHAPES: [(usize, usize, usize); 3] = [(3, 2, 5), (4, 64, 128), (2, 5, 33)];

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_forward_matches_cpu() {
    // Its f32 products go through cuBLASLt: the TF32 test must not switch the precision
    // meanwhile (1.3e-4 relative off in a full parallel run on an H100).
    let _precision = crate::cuda_matmul::lock();
    gpu();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (rtol, atol) = tolerance(dtype);
        let (rtol, atol) = (rtol * 10.0, atol * 10.0);
        for (t, n, h) in SHAPES {
            cpu_vs_cuda(&format!("lstm_recurrence {dtype} {t}x{n}x{h}"), rtol, atol, |d| {
                fused(&inputs(t, n, h, dtype, d, 31))
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_backward_matches_cpu() {
    // Its f32 products go through cuBLASLt: the TF32 test must not switch the precision
    // meanwhile (1.3e-4 relative off in a full parallel run on an H100).
    let _precision = crate::cuda_matmul::lock();
    gpu();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (rtol, atol) = match dtype {
            DType::F64 => (1e-10, 1e-10),
            DType::F32 => (1e-4, 1e-4),
            DType::F16 => (2e-2, 2e-2),
            _ => (1e-1, 1e-1),
        };
        for (t, n, h) in SHAPES {
            for k in 0..5 {
                let what = format!("lstm_recurrence {dtype} {t}x{n}x{h} tensor {k} (0 = out, then grads)");
                cpu_vs_cuda(&what, rtol, atol, |d| {
                    let x = inputs(t, n, h, dtype, d, 41);
                    Ok(value_and_grads(fused, &x)?.swap_remove(k))
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_matches_the_composed_recurrence() {
    // The fused kernels against cuBLASLt + elementwise kernels on the same device (f64: exact
    // up to rounding, independent of the CPU path).
    let d = gpu();
    for (t, n, h) in SHAPES {
        let x = inputs(t, n, h, DType::F64, d, 51);
        let got = value_and_grads(fused, &x).unwrap();
        let want = value_and_grads(composed, &x).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.device(), d);
            assert_close(a, b, 1e-10, 1e-10);
        }
    }
}
