//! PyTorch conformance of mixed precision, group `autocast` of `tests/fixtures/conformance_amp/`
//! (96 cases made by PyTorch 2.11 on an H200; the header of the shared `gen_amp_reference.py`
//! describes them): each op runs under `amp::autocast` with the case's dtype (or inside a
//! nested `enabled(false)` region), its outputs must have exactly PyTorch's dtypes and values
//! within the case's tolerance; then backward runs outside autocast with PyTorch's upstream
//! gradients, and the input gradients (of the inputs' own dtypes) must match.
//!
//! Ops map to ember through the `core` and `nn` groups' tables; `chain` is the MLP loss of the
//! generator, built as the generator's graph. One PyTorch quirk is not copied (see the shared
//! conformance README): its cuDNN LSTM casts to float16 under bfloat16 autocast, so for
//! `bf16_lstm` ember's result is bfloat16, compared with PyTorch's float16 values at bfloat16
//! tolerance. One reference is off and replaced by a float64 recomputation ([`F64_REFERENCE`]);
//! the fixtures' README lists both.

use super::compare::compare;
use super::fixture::{Case, Fixture, Reference};
use super::kwargs::Kwargs;
use super::runner::Fail;
use super::{core_ops, nn_ops};
use crate::common;
use ember_core::amp::{self, Autocast};
use ember_core::{DType, Device, Tensor};
use ember_nn::functional as F;

static MANIFEST: &str = include_str!("../../fixtures/conformance_amp/manifest.json");
static REFERENCE: &[u8] = include_bytes!("../../fixtures/conformance_amp/reference.safetensors");

pub fn fixture() -> Fixture {
    Fixture::parse(MANIFEST, REFERENCE)
}

/// How a case runs: autocast to a dtype, or a nested disabled region inside float16 autocast.
#[derive(Clone, Copy)]
enum Mode {
    Autocast(DType),
    DisabledInside,
}

fn mode(case: &Case) -> Result<Mode, Fail> {
    match case.raw["autocast"].as_str() {
        Some("float16") => Ok(Mode::Autocast(DType::F16)),
        Some("bfloat16") => Ok(Mode::Autocast(DType::BF16)),
        Some("disabled-inside") => Ok(Mode::DisabledInside),
        other => Err(Fail::Failed(format!("runner: unknown autocast mode {other:?}"))),
    }
}

/// The generator's `chain`: the MLP loss `cross_entropy(linear(relu(linear(x, w1, b1)), w2, b2), y)`,
/// returning the logits and the loss.
///
/// The graph is the generator's: its lambda writes the MLP twice, once for the returned logits
/// and once inside `cross_entropy`, so PyTorch's backward has two separate logits nodes whose
/// gradients reach the weights through two matmuls, each rounded to the autocast dtype, and
/// meet only at the (float32) leaves. Feeding one logits tensor to both outputs instead sums
/// the two upstream gradients in one half-precision tensor first, where the small loss term
/// loses its low bits, and the input gradients drift from PyTorch's.
fn chain(x: &[Tensor]) -> Result<Vec<Tensor>, Fail> {
    let [x, y, w1, b1, w2, b2] = x else {
        return Err(Fail::Failed(format!(
            "runner: chain takes 6 inputs, the case has {}",
            x.len()
        )));
    };
    let mlp = || F::linear(&F::linear(x, w1, Some(b1))?.relu()?, w2, Some(b2));
    let logits = mlp()?;
    let loss = F::cross_entropy(&mlp()?, y)?;
    Ok(vec![logits, loss])
}

/// The generator's `lstm`: `nn.LSTM(input_size, hidden_size, num_layers, batch_first)` over
/// `x` with zero initial states, returning the output sequence.
fn lstm(kw: &Kwargs, x: &[Tensor]) -> Result<Vec<Tensor>, Fail> {
    kw.only(&["input_size", "hidden_size", "num_layers", "batch_first"])?;
    let layers = kw.usize("num_layers")?;
    let Some((input, weights)) = x.split_first().filter(|(_, w)| w.len() == 4 * layers) else {
        return Err(Fail::Failed(format!(
            "runner: lstm with {layers} layer(s) takes an input and {} weights, the case has {} tensors",
            4 * layers,
            x.len()
        )));
    };
    let per_layer: Vec<&[Tensor]> = weights.chunks(4).collect();
    let (out, _) = F::lstm(
        input,
        None,
        &per_layer,
        layers,
        kw.bool_or("batch_first", false)?,
        0.0,
        false,
    )?;
    Ok(vec![out])
}

fn forward(op: &str, id: &str, kw: &Kwargs, x: &[Tensor]) -> Result<Vec<Tensor>, Fail> {
    if op == "chain" {
        chain(x)
    } else if op == "lstm" {
        lstm(kw, x)
    } else if nn_ops::MAPPED.contains(&op) {
        nn_ops::forward(op, id, kw, x)
    } else {
        core_ops::forward(op, id, kw, x)
    }
}

/// The dtype ember must produce for output `i` of `case`, when it is not PyTorch's.
fn expected_dtype_override(case: &Case, mode: Mode) -> Option<DType> {
    match mode {
        Mode::Autocast(DType::BF16) if case.op == "lstm" => Some(DType::BF16),
        _ => None,
    }
}

/// Cases whose PyTorch reference is off, compared on every device against a float64
/// recomputation from the same inputs ([`batch_norm_f64`]) instead, with the reason (the
/// fixtures' README lists them too).
const F64_REFERENCE: &[(&str, &str)] = &[(
    "bf16_batch_norm_train",
    "PyTorch's CUDA batch norm backward for a bfloat16 input rounds its partial sums of the \
     weight and bias gradients to bfloat16, so those two reference gradients carry bfloat16 \
     rounding of every partial sum",
)];

/// The case's outputs and input gradients of a training-mode `batch_norm` (inputs x,
/// running_mean, running_var, weight, bias; outputs y and the updated running stats; upstream
/// gradient of y), computed in float64 from the stored inputs, each under the name of the
/// PyTorch reference it stands for and with that reference's dtype and shape.
fn batch_norm_f64(fx: &Fixture, case: &Case) -> Result<Vec<(String, Reference)>, Fail> {
    let kw = Kwargs(&case.kwargs);
    kw.only(&["training", "momentum", "eps"])?;
    if !kw.bool_or("training", false)? {
        return Err(Fail::Failed(
            "runner: batch_norm_f64 recomputes training mode only".into(),
        ));
    }
    let (momentum, eps) = (kw.f64("momentum")?, kw.f64("eps")?);
    let read = |name: &str| fx.reference(case, name).map_err(Fail::Failed);
    let [x, rm, rv, w, b] = &case.inputs[..] else {
        return Err(Fail::Failed(format!(
            "runner: batch_norm takes 5 inputs, the case has {}",
            case.inputs.len()
        )));
    };
    let (x, rm, rv, w, b) = (read(x)?, read(rm)?, read(rv)?, read(w)?, read(b)?);
    let gy = read(
        case.grad_out
            .first()
            .ok_or(Fail::Failed("runner: no grad_out0".into()))?,
    )?;
    let c = x.shape[1];
    let inner: usize = x.shape[2..].iter().product();
    let n = x.values.len() / c;
    // Element indices of channel `ch` in the row-major [N, C, *] input.
    let channel =
        |ch: usize| (0..x.shape[0]).flat_map(move |i| (0..inner).map(move |j| (i * c + ch) * inner + j));
    let mut y = vec![0.0; x.values.len()];
    let mut gx = vec![0.0; x.values.len()];
    let (mut new_rm, mut new_rv, mut gw, mut gb) = (vec![0.0; c], vec![0.0; c], vec![0.0; c], vec![0.0; c]);
    for ch in 0..c {
        let mean = channel(ch).map(|k| x.values[k]).sum::<f64>() / n as f64;
        let var = channel(ch).map(|k| (x.values[k] - mean).powi(2)).sum::<f64>() / n as f64;
        let inv = 1.0 / (var + eps).sqrt();
        let xhat = |k: usize| (x.values[k] - mean) * inv;
        for k in channel(ch) {
            y[k] = xhat(k) * w.values[ch] + b.values[ch];
        }
        new_rm[ch] = (1.0 - momentum) * rm.values[ch] + momentum * mean;
        new_rv[ch] = (1.0 - momentum) * rv.values[ch] + momentum * var * n as f64 / (n - 1) as f64;
        gb[ch] = channel(ch).map(|k| gy.values[k]).sum();
        gw[ch] = channel(ch).map(|k| gy.values[k] * xhat(k)).sum();
        for k in channel(ch) {
            gx[k] = w.values[ch] * inv / n as f64 * (n as f64 * gy.values[k] - gb[ch] - xhat(k) * gw[ch]);
        }
    }
    let like = |r: &Reference, values: Vec<f64>| Reference {
        dtype: r.dtype,
        shape: r.shape.clone(),
        values,
    };
    let grad = |input: &str| {
        case.grad_of(input)
            .map(str::to_owned)
            .ok_or_else(|| Fail::Failed(format!("runner: the case has no gradient of {input}")))
    };
    let [o0, o1, o2] = &case.outputs[..] else {
        return Err(Fail::Failed(
            "runner: batch_norm has 3 outputs (y, running_mean, running_var)".into(),
        ));
    };
    Ok(vec![
        (o0.clone(), like(&read(o0)?, y)),
        (o1.clone(), like(&read(o1)?, new_rm)),
        (o2.clone(), like(&read(o2)?, new_rv)),
        (grad(&case.inputs[0])?, like(&x, gx)),
        (grad(&case.inputs[3])?, like(&w, gw)),
        (grad(&case.inputs[4])?, like(&b, gb)),
    ])
}

fn run(fx: &Fixture, case: &Case, device: Device) -> Result<(), Fail> {
    let mode = mode(case)?;
    let load = |name: &String| fx.tensor(case, name, device).map_err(Fail::Failed);
    let mut inputs = Vec::with_capacity(case.inputs.len());
    for name in &case.inputs {
        let t = load(name)?;
        inputs.push(if case.grad_of(name).is_some() {
            t.requires_grad_(true)?
        } else {
            t
        });
    }
    let outputs = {
        let dt = device.device_type();
        let _outer = match mode {
            Mode::Autocast(d) => amp::autocast(dt, d)?,
            Mode::DisabledInside => amp::autocast(dt, DType::F16)?,
        };
        let _inner = match mode {
            Mode::DisabledInside => Some(Autocast::new(dt).enabled(false).enter()?),
            Mode::Autocast(_) => None,
        };
        forward(&case.op, &case.id, &Kwargs(&case.kwargs), &inputs).map_err(|f| f.context("forward"))?
    };
    if outputs.len() != case.outputs.len() {
        return Err(Fail::Failed(format!(
            "forward: {} outputs, PyTorch has {}",
            outputs.len(),
            case.outputs.len()
        )));
    }
    let recomputed = if F64_REFERENCE.iter().any(|(id, _)| *id == case.id) {
        Some(batch_norm_f64(fx, case)?)
    } else {
        None
    };
    let reference = |name: &str| match &recomputed {
        Some(r) => r
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .ok_or_else(|| Fail::Failed(format!("runner: no float64 recomputation of {name}"))),
        None => fx.reference(case, name).map_err(Fail::Failed),
    };
    let mut misses = Vec::new();
    let mut graph_outputs = Vec::new();
    for (out, name) in outputs.iter().zip(&case.outputs) {
        let mut r = reference(name)?;
        if let Some(d) = expected_dtype_override(case, mode) {
            r.dtype = d;
        }
        if let Err(m) = compare(out, &r, case.rtol, case.atol) {
            misses.push(format!("output {name}: {m}"));
        }
        if out.requires_grad() {
            graph_outputs.push(out.clone());
        }
    }
    if !case.grad_out.is_empty() {
        // Upstream gradients in each output's dtype (PyTorch's are stored in the output's).
        let grad_out = case
            .grad_out
            .iter()
            .zip(&graph_outputs)
            .map(|(n, o)| Ok(load(n)?.to_dtype(o.dtype())?))
            .collect::<Result<Vec<_>, Fail>>()?;
        let wrt: Vec<(&String, &Tensor)> = case
            .inputs
            .iter()
            .zip(&inputs)
            .filter(|(n, _)| case.grad_of(n).is_some())
            .collect();
        let targets: Vec<Tensor> = wrt.iter().map(|(_, t)| (*t).clone()).collect();
        match ember_core::autograd::grad(&graph_outputs, &targets, Some(&grad_out), false) {
            Ok(grads) => {
                for ((name, x), g) in wrt.iter().zip(grads) {
                    let r = reference(case.grad_of(name).expect("filtered above"))?;
                    let g = match g {
                        Some(g) => g,
                        None => x.zeros_like()?,
                    };
                    if let Err(m) = compare(&g, &r, case.rtol, case.atol) {
                        misses.push(format!("grad of {name}: {m}"));
                    }
                }
            }
            Err(e) => misses.push(format!("backward: {e}")),
        }
    }
    if misses.is_empty() {
        Ok(())
    } else {
        Err(Fail::Failed(misses.join("; ")))
    }
}

/// Runs every `autocast` case on `device`; returns (passed, failures). With
/// `EMBER_CONFORMANCE_CASES=id,id,...` only the named cases run (to tell which case a
/// compute-sanitizer report comes from), and the calling test then fails on its count: it
/// checked less than the group.
fn run_group(fx: &Fixture, device: Device) -> (usize, Vec<String>) {
    let only = std::env::var("EMBER_CONFORMANCE_CASES").ok();
    let chosen = |id: &str| only.as_deref().is_none_or(|o| o.split(',').any(|c| c == id));
    let mut passed = 0;
    let mut failed = Vec::new();
    for case in fx.cases.iter().filter(|c| c.group == "autocast" && chosen(&c.id)) {
        match run(fx, case, device) {
            Ok(()) => passed += 1,
            Err(Fail::Failed(m) | Fail::Skipped(m)) => failed.push(format!("{} ({}): {m}", case.id, case.op)),
        }
    }
    println!(
        "conformance autocast on {device}: {} ran, {passed} passed, {} failed{}",
        passed + failed.len(),
        failed.len(),
        if only.is_some() {
            " (EMBER_CONFORMANCE_CASES chose them: this run cannot pass)"
        } else {
            ""
        }
    );
    for f in &failed {
        println!("  FAILED  {f}");
    }
    (passed, failed)
}

#[test]
#[ignore = "needs a CUDA device"]
fn autocast_cases_on_cuda() {
    let fx = fixture();
    let n = fx.cases.iter().filter(|c| c.group == "autocast").count();
    assert_eq!(n, 91, "the manifest's autocast group");
    let (passed, failed) = run_group(&fx, common::gpu());
    assert!(
        failed.is_empty(),
        "{} autocast cases failed (see above)",
        failed.len()
    );
    assert_eq!(passed, n);
}

/// Cases whose reference the CPU cannot reproduce, with the reason. `bf16_multihead_attention`
/// compares the key projection's bias gradient, which is zero in exact arithmetic (softmax
/// ignores a constant added to every key), so both sides hold bfloat16 rounding noise of about
/// the case's absolute tolerance; the CPU's summation order gives different noise than the
/// H200's kernels. It runs on CUDA with the others.
const CPU_DIFFERS: &[&str] = &["bf16_multihead_attention"];

/// CPU autocast runs the same policy table; the CPU computes half-precision ops through f32
/// with one rounding per op, like the GPU, so PyTorch's CUDA references hold there too, but
/// for [`CPU_DIFFERS`].
#[test]
fn autocast_cases_on_cpu() {
    let fx = fixture();
    let n = fx.cases.iter().filter(|c| c.group == "autocast").count();
    let (passed, failed) = run_group(&fx, Device::Cpu);
    let unexpected: Vec<&String> = failed
        .iter()
        .filter(|f| !CPU_DIFFERS.iter().any(|id| f.starts_with(&format!("{id} "))))
        .collect();
    assert!(
        unexpected.is_empty(),
        "{} autocast cases failed on the CPU (see above)",
        unexpected.len()
    );
    assert!(passed >= n - CPU_DIFFERS.len());
}

/// The float64 recomputation stands in for PyTorch only where PyTorch is off: for every
/// [`F64_REFERENCE`] case it must reproduce PyTorch's output, running statistics and input
/// gradient at the case's tolerance, so a mistake in the recomputation cannot hide behind it.
#[test]
fn float64_recomputation_agrees_with_pytorch_where_pytorch_is_exact() {
    let fx = fixture();
    for (id, _) in F64_REFERENCE {
        let case = fx
            .cases
            .iter()
            .find(|c| c.id == *id)
            .expect("the case is in the manifest");
        let recomputed = match batch_norm_f64(&fx, case) {
            Ok(r) => r,
            Err(Fail::Failed(m) | Fail::Skipped(m)) => panic!("{id}: {m}"),
        };
        let off = ["weight", "bias"].map(|n| case.grad_of(n).expect("gradient of weight and bias"));
        for (name, ours) in &recomputed {
            let theirs = fx.reference(case, name).expect("reference tensor");
            let worst = ours
                .values
                .iter()
                .zip(&theirs.values)
                .map(|(a, b)| (a - b).abs() / (case.atol + case.rtol * b.abs()))
                .fold(0.0, f64::max);
            let abs = ours
                .values
                .iter()
                .zip(&theirs.values)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            println!(
                "{id} {name}: largest |float64 - PyTorch| is {abs:.3e}, {worst:.3} of the case's tolerance"
            );
            if !off.contains(&name.as_str()) {
                assert!(
                    worst <= 1.0,
                    "{id} {name}: the float64 recomputation misses PyTorch's value"
                );
            }
        }
    }
}
