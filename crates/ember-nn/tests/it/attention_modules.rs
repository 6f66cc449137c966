//! `nn::MultiheadAttention`: PyTorch's state-dict keys, shapes and init, forward against
//! `functional::multi_head_attention_forward` in every layout, key padding masks (bool and
//! float) against the equivalent attention mask, returned weights, an f64 finite-difference
//! check over every parameter, dropout only in training mode, and CPU-vs-CUDA (ignored).
//! Also the helpers the module tests share (key lists, parameter substitution, GPU checks).

use crate::common::{assert_close, gpu, gradcheck, t64, values};
use ember_core::{manual_seed, DType, Device, Tensor};
use ember_nn::functional as F;
use ember_nn::layers::MultiheadAttentionConfig;
use ember_nn::{Forward, Module, ModuleExt, MultiheadAttention, TensorKind};

const CPU: Device = Device::Cpu;

/// f32 values in [-1, 1) of `shape`.
pub(crate) fn rand32(shape: &[usize], seed: u64) -> Tensor {
    rand64(shape, seed).to_dtype(DType::F32).unwrap()
}

/// f64 values in [-1, 1) of `shape`.
pub(crate) fn rand64(shape: &[usize], seed: u64) -> Tensor {
    t64(&values(shape.iter().product(), seed), shape, CPU)
}

/// The state-dict keys with their shapes.
pub(crate) fn keys_and_shapes(m: &dyn Module) -> Vec<(String, Vec<usize>)> {
    m.state_dict()
        .into_iter()
        .map(|(k, t)| (k, t.dims().to_vec()))
        .collect()
}

/// The state-dict keys.
pub(crate) fn keys(m: &dyn Module) -> Vec<String> {
    m.state_dict().into_iter().map(|(k, _)| k).collect()
}

/// `prefix` + each of `names`.
pub(crate) fn prefixed(prefix: &str, names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("{prefix}{n}")).collect()
}

/// A shallow copy of `m` whose parameters are `params`, in visit order (for gradcheck).
pub(crate) fn with_params<M: Module + Clone>(m: &M, params: &[Tensor]) -> M {
    let mut copy = m.clone();
    let mut i = 0;
    copy.visit_mut("", &mut |_, t, kind| {
        if kind == TensorKind::Parameter {
            *t = params[i].clone();
            i += 1;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(i, params.len(), "parameter count");
    copy
}

/// Checks the gradient of `f(module with params, x)` for every parameter and `x` by finite
/// differences; `m` is converted to f64 first.
pub(crate) fn gradcheck_module<M: Module + Clone>(
    m: &M,
    x: &Tensor,
    f: impl Fn(&M, &Tensor) -> ember_core::Result<Tensor>,
) {
    let mut m = m.clone();
    m.to_dtype(DType::F64).unwrap();
    let mut inputs = m.parameters();
    let n = inputs.len();
    inputs.push(x.to_dtype(DType::F64).unwrap());
    gradcheck(|args| f(&with_params(&m, &args[..n]), &args[n]), &inputs);
}

/// Asserts every parameter of `m` got a finite, not all-zero gradient.
pub(crate) fn assert_grads_reach_every_parameter(m: &dyn Module) {
    for (name, p) in m.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
        assert_eq!(g.dims(), p.dims(), "{name}: gradient shape");
        let v = g.to_vec_f64().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}: gradient not finite");
        assert!(v.iter().any(|&x| x != 0.0), "{name}: gradient is all zeros");
    }
}

/// Runs `f` on `m` (CPU) and on a copy moved to the GPU, back-propagates the same weighted sum
/// of the output on both and compares the outputs and every parameter's gradient.
pub(crate) fn cpu_vs_cuda_module<M: Module + Clone>(
    what: &str,
    m: &M,
    f: impl Fn(&M, Device) -> ember_core::Result<Tensor>,
    rtol: f64,
    atol: f64,
) {
    let gpu = gpu();
    // A clone shares its tensors with `m`, and `to_device` moves them in place: give the GPU
    // copy its own tensors first (PyTorch's `copy.deepcopy(m).to(device)`).
    let mut on_gpu = m.clone();
    on_gpu
        .visit_mut("", &mut |_, t, _| {
            let own = t.detach().deep_clone()?;
            *t = if t.requires_grad() {
                own.requires_grad_(true)?
            } else {
                own
            };
            Ok(())
        })
        .unwrap();
    on_gpu.to_device(gpu).unwrap();
    let run = |m: &M, device: Device| {
        m.zero_grad().unwrap();
        let y = f(m, device).unwrap_or_else(|e| panic!("{what} on {device}: {e}"));
        assert_eq!(y.device(), device, "{what}: output device");
        let w = Tensor::from_slice(&values(y.numel(), 7), y.dims(), device)
            .unwrap()
            .to_dtype(y.dtype())
            .unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        y.to(CPU).unwrap().detach()
    };
    let expected = run(m, CPU);
    let actual = run(&on_gpu, gpu);
    assert_close(&actual, &expected, rtol, atol);
    for ((name, pc), (_, pg)) in m.named_parameters().into_iter().zip(on_gpu.named_parameters()) {
        let gc = pc
            .grad()
            .unwrap_or_else(|| panic!("{what}: {name} has no CPU gradient"));
        let gg = pg
            .grad()
            .unwrap_or_else(|| panic!("{what}: {name} has no GPU gradient"));
        assert_close(&gg.to(CPU).unwrap(), &gc, rtol, atol);
    }
}

fn mha(e: usize, heads: usize, config: MultiheadAttentionConfig) -> MultiheadAttention {
    MultiheadAttention::with_config(e, heads, config, CPU).unwrap()
}

/// The functional form with the module's weights.
fn functional_mha(
    m: &MultiheadAttention,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    need_weights: bool,
) -> (Tensor, Option<Tensor>) {
    F::multi_head_attention_forward(
        q,
        k,
        v,
        m.embed_dim,
        m.num_heads,
        &m.in_proj_weight,
        m.in_proj_bias.as_ref(),
        &m.out_proj.weight,
        m.out_proj.bias.as_ref(),
        mask,
        false,
        m.batch_first,
        need_weights,
    )
    .unwrap()
}

#[test]
fn mha_state_dict_keys_shapes_and_init_are_pytorchs() {
    manual_seed(3).unwrap();
    let m = mha(8, 2, MultiheadAttentionConfig::default());
    assert_eq!(
        keys_and_shapes(&m),
        [
            ("in_proj_weight".to_string(), vec![24, 8]),
            ("in_proj_bias".to_string(), vec![24]),
            ("out_proj.weight".to_string(), vec![8, 8]),
            ("out_proj.bias".to_string(), vec![8]),
        ]
    );
    let no_bias = mha(
        8,
        2,
        MultiheadAttentionConfig {
            bias: false,
            ..Default::default()
        },
    );
    assert_eq!(keys(&no_bias), ["in_proj_weight", "out_proj.weight"]);

    // Xavier uniform on [3E, E]: bound √(6 / (E + 3E)); out_proj as Linear: 1/√E; zero biases.
    let w = m.in_proj_weight.to_vec_f64().unwrap();
    let bound = (6.0 / 32.0f64).sqrt();
    assert!(w.iter().all(|x| x.abs() <= bound));
    assert!(
        w.iter().any(|x| x.abs() > 0.8 * bound),
        "in_proj_weight does not span its range"
    );
    let o = m.out_proj.weight.to_vec_f64().unwrap();
    let bound = 1.0 / 8f64.sqrt();
    assert!(o.iter().all(|x| x.abs() <= bound));
    assert!(o.iter().any(|x| x.abs() > 0.7 * bound));
    for b in [
        m.in_proj_bias.as_ref().unwrap(),
        m.out_proj.bias.as_ref().unwrap(),
    ] {
        assert!(b.to_vec_f64().unwrap().iter().all(|&x| x == 0.0));
    }
    assert!(m.parameters().iter().all(|p| p.requires_grad() && p.is_leaf()));
}

#[test]
fn mha_forward_matches_functional_in_every_layout() {
    for batch_first in [false, true] {
        let m = mha(
            8,
            2,
            MultiheadAttentionConfig {
                batch_first,
                ..Default::default()
            },
        );
        let (q_dims, kv_dims) = if batch_first {
            ([3, 4, 8], [3, 5, 8])
        } else {
            ([4, 3, 8], [5, 3, 8])
        };
        let (q, k, v) = (rand32(&q_dims, 1), rand32(&kv_dims, 2), rand32(&kv_dims, 3));
        let (out, w) = m.forward_attention(&q, &k, &v, None, true, None, false).unwrap();
        let (fo, fw) = functional_mha(&m, &q, &k, &v, None, true);
        assert_eq!(out.dims(), q_dims);
        assert_eq!(w.as_ref().unwrap().dims(), [3, 4, 5]);
        assert_close(&out, &fo, 1e-6, 1e-7);
        assert_close(w.as_ref().unwrap(), fw.as_ref().unwrap(), 1e-6, 1e-7);
        // Forward::forward is self-attention without weights.
        let y = m.forward(&q).unwrap();
        assert_close(&y, &functional_mha(&m, &q, &q, &q, None, false).0, 1e-6, 1e-7);
    }
    // Unbatched.
    let m = mha(4, 2, MultiheadAttentionConfig::default());
    let (q, kv) = (rand32(&[3, 4], 4), rand32(&[2, 4], 5));
    let (out, w) = m
        .forward_attention(&q, &kv, &kv, None, true, None, false)
        .unwrap();
    assert_eq!(out.dims(), [3, 4]);
    assert_eq!(w.unwrap().dims(), [3, 2]);
}

#[test]
fn mha_key_padding_mask_equals_the_expanded_attention_mask() {
    let (n, heads, l, s, e) = (2, 2, 3, 4, 4);
    let m = mha(
        e,
        heads,
        MultiheadAttentionConfig {
            batch_first: true,
            ..Default::default()
        },
    );
    let q = rand32(&[n, l, e], 11);
    let kv = rand32(&[n, s, e], 12);
    // Batch 0 ignores key 3, batch 1 keys 1 and 3.
    let pad = [[false, false, false, true], [false, true, false, true]];
    let kpm_vals: Vec<f64> = pad.iter().flatten().map(|&b| b as u8 as f64).collect();
    let kpm = t64(&kpm_vals, &[n, s], CPU).to_dtype(DType::Bool).unwrap();
    // The same as a per-head [N·heads, L, S] bool mask.
    let mut full = Vec::new();
    for row in &pad {
        for _ in 0..heads * l {
            full.extend(row.iter().map(|&b| b as u8 as f64));
        }
    }
    let attn_mask = t64(&full, &[n * heads, l, s], CPU).to_dtype(DType::Bool).unwrap();
    for need_weights in [false, true] {
        let (out, w) = m
            .forward_attention(&q, &kv, &kv, Some(&kpm), need_weights, None, false)
            .unwrap();
        let (fo, fw) = functional_mha(&m, &q, &kv, &kv, Some(&attn_mask), need_weights);
        assert_close(&out, &fo, 1e-5, 1e-6);
        if need_weights {
            let w = w.unwrap();
            assert_close(&w, fw.as_ref().unwrap(), 1e-5, 1e-6);
            let wv = w.to_vec_f64().unwrap();
            for (i, x) in wv.iter().enumerate() {
                let (b, j) = (i / (l * s), i % s);
                if pad[b][j] {
                    assert_eq!(*x, 0.0, "weight of a padded key");
                }
            }
            for row in wv.chunks(s) {
                assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-5);
            }
        }
    }
    // A float padding mask (-inf where padded) is the same; combined with a causal attn_mask.
    let kpm_f = t64(
        &kpm_vals
            .iter()
            .map(|&b| if b > 0.0 { f64::NEG_INFINITY } else { 0.0 })
            .collect::<Vec<_>>(),
        &[n, s],
        CPU,
    )
    .to_dtype(DType::F32)
    .unwrap();
    let (a, _) = m
        .forward_attention(&q, &kv, &kv, Some(&kpm), false, None, false)
        .unwrap();
    let (b, _) = m
        .forward_attention(&q, &kv, &kv, Some(&kpm_f), false, None, false)
        .unwrap();
    assert_close(&a, &b, 1e-6, 1e-7);
    let causal = t64(&[0., 1., 1., 1., 0., 0., 1., 1., 0., 0., 0., 1.], &[l, s], CPU)
        .to_dtype(DType::Bool)
        .unwrap();
    let both = attn_mask.logical_or(&causal.unsqueeze(0).unwrap()).unwrap();
    let (c, _) = m
        .forward_attention(&q, &kv, &kv, Some(&kpm), false, Some(&causal), false)
        .unwrap();
    let (c_hint, _) = m
        .forward_attention(&q, &kv, &kv, Some(&kpm_f), false, None, true)
        .unwrap();
    let fc = functional_mha(&m, &q, &kv, &kv, Some(&both), false).0;
    assert_close(&c, &fc, 1e-5, 1e-6);
    assert_close(&c_hint, &fc, 1e-5, 1e-6);
    // Wrong padding shape: a typed error.
    let bad = Tensor::zeros([n, s + 1], DType::Bool, CPU).unwrap();
    assert!(m
        .forward_attention(&q, &kv, &kv, Some(&bad), false, None, false)
        .is_err());
}

#[test]
fn mha_gradients_match_finite_differences_for_every_parameter() {
    manual_seed(5).unwrap();
    let m = mha(
        4,
        2,
        MultiheadAttentionConfig {
            batch_first: true,
            ..Default::default()
        },
    );
    // Non-zero biases so their gradients are exercised at a generic point.
    for b in [
        m.in_proj_bias.as_ref().unwrap(),
        m.out_proj.bias.as_ref().unwrap(),
    ] {
        b.detach().uniform_(-0.5, 0.5).unwrap();
    }
    let kpm = t64(&[0., 0., 1., 0., 0., 0.], &[2, 3], CPU)
        .to_dtype(DType::Bool)
        .unwrap();
    let x = rand64(&[2, 3, 4], 21);
    gradcheck_module(&m, &x, |m, x| {
        Ok(m.forward_attention(x, x, x, Some(&kpm), false, None, false)?.0)
    });
    // Cross-attention with the weights as the output.
    let kv = rand64(&[2, 2, 4], 22);
    gradcheck_module(&m, &x, |m, x| {
        let (out, w) = m.forward_attention(x, &kv, &kv, None, true, None, false)?;
        let w = w.expect("need_weights");
        out.sum_all()?.add(&w.mul(&w)?.sum_all()?)
    });
    let y = m.forward(&rand32(&[2, 3, 4], 1)).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_grads_reach_every_parameter(&m);
}

#[test]
fn mha_dropout_only_in_training_mode() {
    manual_seed(9).unwrap();
    let m = mha(
        8,
        2,
        MultiheadAttentionConfig {
            dropout: 0.5,
            ..Default::default()
        },
    );
    let x = rand32(&[5, 2, 8], 31);
    let reference = functional_mha(&m, &x, &x, &x, None, false).0;
    let a = m.forward(&x).unwrap();
    let b = m.forward(&x).unwrap();
    assert_ne!(
        a.to_vec_f64().unwrap(),
        b.to_vec_f64().unwrap(),
        "training: dropout masks differ"
    );
    assert_ne!(a.to_vec_f64().unwrap(), reference.to_vec_f64().unwrap());
    m.eval();
    assert!(!m.is_training() && !m.out_proj.is_training());
    let c = m.forward(&x).unwrap();
    let d = m.forward(&x).unwrap();
    assert_eq!(c.to_vec_f64().unwrap(), d.to_vec_f64().unwrap());
    assert_close(&c, &reference, 1e-6, 1e-7);
}

#[test]
#[ignore = "needs a CUDA device"]
fn mha_cpu_vs_cuda_forward_and_parameter_gradients() {
    manual_seed(13).unwrap();
    let m = mha(
        16,
        4,
        MultiheadAttentionConfig {
            batch_first: true,
            ..Default::default()
        },
    );
    let (q, kv) = (rand32(&[3, 5, 16], 1), rand32(&[3, 7, 16], 2));
    let kpm = t64(
        &values(21, 3)
            .iter()
            .map(|&v| (v > 0.5) as u8 as f64)
            .collect::<Vec<_>>(),
        &[3, 7],
        CPU,
    )
    .to_dtype(DType::Bool)
    .unwrap();
    cpu_vs_cuda_module(
        "MultiheadAttention self",
        &m,
        |m, d| m.forward(&q.to(d)?),
        1e-4,
        1e-5,
    );
    cpu_vs_cuda_module(
        "MultiheadAttention cross + padding + weights",
        &m,
        |m, d| {
            let (q, kv, kpm) = (q.to(d)?, kv.to(d)?, kpm.to(d)?);
            let (out, w) = m.forward_attention(&q, &kv, &kv, Some(&kpm), true, None, false)?;
            let w = w.expect("need_weights");
            out.sum_dims(&[2], false)?.add(&w.mul(&w)?.sum_dims(&[2], false)?)
        },
        1e-4,
        1e-5,
    );
}
