//! `nn::TransformerEncoderLayer`, `TransformerDecoderLayer`, the stacks and `Transformer`:
//! PyTorch's state-dict keys and shapes, deep-copied layers, Xavier re-init, forward against a
//! composition of the functional ops (post- and pre-norm, both layouts, ReLU and GELU), the
//! causal mask, masks passed through, an f64 finite-difference check of an encoder layer,
//! gradients reaching every parameter, dropout only in training mode, and CPU-vs-CUDA (ignored).

use crate::attention_modules::{
    assert_grads_reach_every_parameter, cpu_vs_cuda_module, gradcheck_module, keys, keys_and_shapes,
    prefixed, rand32, rand64,
};
use crate::common::{assert_close, t64};
use ember_core::{manual_seed, DType, Device, Tensor};
use ember_nn::functional as F;
use ember_nn::layers::{
    DecoderMasks, EncoderMasks, TransformerActivation, TransformerConfig, TransformerLayerConfig,
    TransformerMasks,
};
use ember_nn::{
    Forward, LayerNorm, Module, ModuleExt, MultiheadAttention, Transformer, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer,
};

const CPU: Device = Device::Cpu;

const ATTN: [&str; 4] = [
    "in_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
];
const FF: [&str; 4] = ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"];

/// PyTorch's `TransformerEncoderLayer` state-dict keys.
fn encoder_layer_keys(prefix: &str) -> Vec<String> {
    let mut k = prefixed(&format!("{prefix}self_attn."), &ATTN);
    k.extend(prefixed(prefix, &FF));
    k.extend(prefixed(
        prefix,
        &["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"],
    ));
    k
}

/// PyTorch's `TransformerDecoderLayer` state-dict keys.
fn decoder_layer_keys(prefix: &str) -> Vec<String> {
    let mut k = prefixed(&format!("{prefix}self_attn."), &ATTN);
    k.extend(prefixed(&format!("{prefix}multihead_attn."), &ATTN));
    k.extend(prefixed(prefix, &FF));
    k.extend(prefixed(
        prefix,
        &[
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
            "norm3.weight",
            "norm3.bias",
        ],
    ));
    k
}

fn small(dropout: f64, batch_first: bool, norm_first: bool) -> TransformerLayerConfig {
    TransformerLayerConfig {
        dim_feedforward: 12,
        dropout,
        batch_first,
        norm_first,
        ..Default::default()
    }
}

fn mha(m: &MultiheadAttention, q: &Tensor, kv: &Tensor, mask: Option<&Tensor>) -> Tensor {
    F::multi_head_attention_forward(
        q,
        kv,
        kv,
        m.embed_dim,
        m.num_heads,
        &m.in_proj_weight,
        m.in_proj_bias.as_ref(),
        &m.out_proj.weight,
        m.out_proj.bias.as_ref(),
        mask,
        false,
        m.batch_first,
        false,
    )
    .unwrap()
    .0
}

fn ln(n: &LayerNorm, x: &Tensor) -> Tensor {
    F::layer_norm(
        x,
        &n.normalized_shape,
        n.weight.as_ref(),
        n.bias.as_ref(),
        n.config.eps,
    )
    .unwrap()
}

fn ff(l1: &ember_nn::Linear, l2: &ember_nn::Linear, act: TransformerActivation, x: &Tensor) -> Tensor {
    let h = F::linear(x, &l1.weight, l1.bias.as_ref()).unwrap();
    let h = match act {
        TransformerActivation::Relu => h.relu().unwrap(),
        TransformerActivation::Gelu => h.gelu().unwrap(),
    };
    F::linear(&h, &l2.weight, l2.bias.as_ref()).unwrap()
}

/// The encoder layer composed from the functional ops (no dropout).
fn encoder_reference(l: &TransformerEncoderLayer, x: &Tensor, mask: Option<&Tensor>) -> Tensor {
    if l.norm_first {
        let n = ln(&l.norm1, x);
        let x = x.add(&mha(&l.self_attn, &n, &n, mask)).unwrap();
        x.add(&ff(&l.linear1, &l.linear2, l.activation, &ln(&l.norm2, &x)))
            .unwrap()
    } else {
        let x = ln(&l.norm1, &x.add(&mha(&l.self_attn, x, x, mask)).unwrap());
        ln(
            &l.norm2,
            &x.add(&ff(&l.linear1, &l.linear2, l.activation, &x)).unwrap(),
        )
    }
}

/// The decoder layer composed from the functional ops (post-norm, no dropout).
fn decoder_reference(
    l: &TransformerDecoderLayer,
    x: &Tensor,
    mem: &Tensor,
    tgt_mask: Option<&Tensor>,
) -> Tensor {
    let x = ln(&l.norm1, &x.add(&mha(&l.self_attn, x, x, tgt_mask)).unwrap());
    let x = ln(&l.norm2, &x.add(&mha(&l.multihead_attn, &x, mem, None)).unwrap());
    ln(
        &l.norm3,
        &x.add(&ff(&l.linear1, &l.linear2, l.activation, &x)).unwrap(),
    )
}

#[test]
fn transformer_state_dict_keys_and_shapes_are_pytorchs() {
    let enc = TransformerEncoderLayer::with_config(8, 2, small(0.1, false, false), CPU).unwrap();
    assert_eq!(keys(&enc), encoder_layer_keys(""));
    let shapes: Vec<Vec<usize>> = keys_and_shapes(&enc).into_iter().map(|(_, s)| s).collect();
    assert_eq!(
        shapes,
        [
            vec![24, 8],
            vec![24],
            vec![8, 8],
            vec![8],
            vec![12, 8],
            vec![12],
            vec![8, 12],
            vec![8],
            vec![8],
            vec![8],
            vec![8],
            vec![8]
        ]
    );
    let dec = TransformerDecoderLayer::with_config(8, 2, small(0.1, false, false), CPU).unwrap();
    assert_eq!(keys(&dec), decoder_layer_keys(""));
    // PyTorch's default dim_feedforward is 2048.
    let default = TransformerEncoderLayer::new(8, 2, CPU).unwrap();
    assert_eq!(default.linear1.weight.dims(), [2048, 8]);

    let stack = TransformerEncoder::new(&enc, 2, Some(LayerNorm::new(&[8], CPU).unwrap())).unwrap();
    let mut expected = encoder_layer_keys("layers.0.");
    expected.extend(encoder_layer_keys("layers.1."));
    expected.extend(prefixed("", &["norm.weight", "norm.bias"]));
    assert_eq!(keys(&stack), expected);
    let dstack = TransformerDecoder::new(&dec, 1, None).unwrap();
    assert_eq!(keys(&dstack), decoder_layer_keys("layers.0."));

    let config = TransformerConfig {
        num_encoder_layers: 2,
        num_decoder_layers: 1,
        dim_feedforward: 12,
        ..Default::default()
    };
    let t = Transformer::with_config(8, 2, config, CPU).unwrap();
    let mut expected = encoder_layer_keys("encoder.layers.0.");
    expected.extend(encoder_layer_keys("encoder.layers.1."));
    expected.extend(prefixed("encoder.", &["norm.weight", "norm.bias"]));
    expected.extend(decoder_layer_keys("decoder.layers.0."));
    expected.extend(prefixed("decoder.", &["norm.weight", "norm.bias"]));
    assert_eq!(keys(&t), expected);

    // bias=False drops every bias, LayerNorm's included.
    let nb = TransformerEncoderLayer::with_config(
        8,
        2,
        TransformerLayerConfig {
            bias: false,
            ..small(0.1, false, false)
        },
        CPU,
    )
    .unwrap();
    assert_eq!(
        keys(&nb),
        [
            "self_attn.in_proj_weight",
            "self_attn.out_proj.weight",
            "linear1.weight",
            "linear2.weight",
            "norm1.weight",
            "norm2.weight"
        ]
    );
}

#[test]
fn stacks_deep_copy_their_layer_and_transformer_reinitializes_with_xavier() {
    manual_seed(1).unwrap();
    let enc = TransformerEncoderLayer::with_config(8, 2, small(0.0, false, false), CPU).unwrap();
    let stack = TransformerEncoder::new(&enc, 2, None).unwrap();
    let (a, b) = (&stack.layers[0].linear1.weight, &stack.layers[1].linear1.weight);
    assert_eq!(a.to_vec_f64().unwrap(), enc.linear1.weight.to_vec_f64().unwrap());
    assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    assert!(!a.shares_storage_with(b) && !a.shares_storage_with(&enc.linear1.weight));
    assert!(a.requires_grad() && a.is_leaf());
    a.detach().fill_(0.5).unwrap();
    assert_ne!(
        b.to_vec_f64().unwrap(),
        a.to_vec_f64().unwrap(),
        "layers are separate tensors"
    );

    let config = TransformerConfig {
        num_encoder_layers: 2,
        num_decoder_layers: 2,
        dim_feedforward: 12,
        ..Default::default()
    };
    let t = Transformer::with_config(8, 2, config, CPU).unwrap();
    for (name, p) in t.named_parameters() {
        let v = p.to_vec_f64().unwrap();
        if p.rank() > 1 {
            let (fan_out, fan_in) = (p.dims()[0], p.dims()[1]);
            let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
            assert!(v.iter().all(|x| x.abs() <= bound), "{name}: not Xavier uniform");
            assert!(
                v.iter().any(|x| x.abs() > 0.7 * bound),
                "{name}: does not span the Xavier range"
            );
        } else if name.contains("norm") && name.ends_with("weight") {
            assert!(v.iter().all(|&x| x == 1.0), "{name}: LayerNorm weights stay ones");
        } else if name.contains("norm") || name.contains("in_proj_bias") || name.contains("out_proj.bias") {
            assert!(v.iter().all(|&x| x == 0.0), "{name}: stays zeros");
        }
    }
    // Re-initialized per layer: the copies no longer agree.
    let e = &t.encoder.layers;
    assert_ne!(
        e[0].linear1.weight.to_vec_f64().unwrap(),
        e[1].linear1.weight.to_vec_f64().unwrap()
    );
}

#[test]
fn encoder_layer_matches_the_functional_composition() {
    manual_seed(2).unwrap();
    for (batch_first, norm_first, activation) in [
        (false, false, TransformerActivation::Relu),
        (true, false, TransformerActivation::Gelu),
        (false, true, TransformerActivation::Relu),
        (true, true, TransformerActivation::Gelu),
    ] {
        let config = TransformerLayerConfig {
            activation,
            ..small(0.1, batch_first, norm_first)
        };
        let layer = TransformerEncoderLayer::with_config(8, 2, config, CPU).unwrap();
        layer.eval();
        let dims = if batch_first { [2, 5, 8] } else { [5, 2, 8] };
        let x = rand32(&dims, 1);
        let y = layer.forward(&x).unwrap();
        assert_eq!(y.dims(), dims);
        assert_close(&y, &encoder_reference(&layer, &x, None), 1e-5, 1e-6);
        // A mask is passed to self-attention.
        let mask = Transformer::generate_square_subsequent_mask(5, CPU).unwrap();
        let masked = layer
            .forward_with(
                &x,
                EncoderMasks {
                    mask: Some(&mask),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_close(&masked, &encoder_reference(&layer, &x, Some(&mask)), 1e-5, 1e-6);
        let hinted = layer
            .forward_with(
                &x,
                EncoderMasks {
                    is_causal: true,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_close(&hinted, &masked, 1e-5, 1e-6);
        // PyTorch's two-argument `layer(src, src_mask)`, on the layer and on a stack.
        assert_close(&layer.forward_with(&x, &mask).unwrap(), &masked, 0.0, 0.0);
        let stack = TransformerEncoder::new(&layer, 2, None).unwrap();
        let explicit = stack
            .forward_with(
                &x,
                EncoderMasks {
                    mask: Some(&mask),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_close(&stack.forward_with(&x, &mask).unwrap(), &explicit, 0.0, 0.0);
    }
}

#[test]
fn decoder_and_stacks_match_the_functional_composition() {
    manual_seed(3).unwrap();
    let layer = TransformerDecoderLayer::with_config(8, 2, small(0.1, true, false), CPU).unwrap();
    layer.eval();
    let (tgt, mem) = (rand32(&[2, 4, 8], 1), rand32(&[2, 6, 8], 2));
    let mask = Transformer::generate_square_subsequent_mask(4, CPU).unwrap();
    let masks = DecoderMasks {
        tgt_mask: Some(&mask),
        ..Default::default()
    };
    let y = layer.forward_with(&tgt, &mem, masks).unwrap();
    assert_eq!(y.dims(), [2, 4, 8]);
    assert_close(
        &y,
        &decoder_reference(&layer, &tgt, &mem, Some(&mask)),
        1e-5,
        1e-6,
    );
    // `layer(tgt, memory)`: the inherent two-input forward is forward_with without masks.
    assert_close(
        &layer.forward(&tgt, &mem).unwrap(),
        &decoder_reference(&layer, &tgt, &mem, None),
        1e-5,
        1e-6,
    );

    let stack = TransformerDecoder::new(&layer, 2, Some(LayerNorm::new(&[8], CPU).unwrap())).unwrap();
    stack.eval();
    let mut expected = tgt.clone();
    for l in &stack.layers {
        expected = decoder_reference(l, &expected, &mem, Some(&mask));
    }
    let expected = ln(stack.norm.as_ref().unwrap(), &expected);
    assert_close(
        &stack.forward_with(&tgt, &mem, masks).unwrap(),
        &expected,
        1e-5,
        1e-6,
    );

    let enc_layer = TransformerEncoderLayer::with_config(8, 2, small(0.1, true, false), CPU).unwrap();
    let enc = TransformerEncoder::new(&enc_layer, 2, None).unwrap();
    enc.eval();
    assert!(!enc.layers[1].dropout1.is_training() && !enc.layers[0].self_attn.is_training());
    let expected = encoder_reference(
        &enc.layers[1],
        &encoder_reference(&enc.layers[0], &mem, None),
        None,
    );
    assert_close(&enc.forward(&mem).unwrap(), &expected, 1e-5, 1e-6);
}

#[test]
fn transformer_masks_and_causality() {
    let m = Transformer::generate_square_subsequent_mask(3, CPU).unwrap();
    let inf = f64::NEG_INFINITY;
    assert_eq!(m.dtype(), DType::F32);
    assert_eq!(
        m.to_vec_f64().unwrap(),
        [0.0, inf, inf, 0.0, 0.0, inf, 0.0, 0.0, 0.0]
    );

    manual_seed(4).unwrap();
    let config = TransformerConfig {
        num_encoder_layers: 2,
        num_decoder_layers: 2,
        dim_feedforward: 12,
        batch_first: true,
        ..Default::default()
    };
    let t = Transformer::with_config(8, 2, config, CPU).unwrap();
    t.eval();
    let (src, tgt) = (rand32(&[2, 5, 8], 1), rand32(&[2, 4, 8], 2));
    let mask = Transformer::generate_square_subsequent_mask(4, CPU).unwrap();
    let with_mask = TransformerMasks {
        tgt_mask: Some(&mask),
        ..Default::default()
    };
    let y = t.forward_with(&src, &tgt, with_mask).unwrap();
    assert_eq!(y.dims(), [2, 4, 8]);
    // The same as encoder then decoder.
    let memory = t.encoder.forward(&src).unwrap();
    let expected = t
        .decoder
        .forward_with(
            &tgt,
            &memory,
            DecoderMasks {
                tgt_mask: Some(&mask),
                ..Default::default()
            },
        )
        .unwrap();
    assert_close(&y, &expected, 1e-6, 1e-7);
    let hinted = t
        .forward_with(
            &src,
            &tgt,
            TransformerMasks {
                tgt_is_causal: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_close(&hinted, &y, 1e-5, 1e-6);
    // Causal: changing the last target step leaves the earlier outputs as they were.
    let tgt2 = Tensor::cat(&[tgt.narrow(1, 0, 3).unwrap(), rand32(&[2, 1, 8], 3)], 1).unwrap();
    let y2 = t.forward_with(&src, &tgt2, with_mask).unwrap();
    assert_close(
        &y2.narrow(1, 0, 3).unwrap(),
        &y.narrow(1, 0, 3).unwrap(),
        1e-5,
        1e-6,
    );
    assert_ne!(
        y2.narrow(1, 3, 1).unwrap().to_vec_f64().unwrap(),
        y.narrow(1, 3, 1).unwrap().to_vec_f64().unwrap()
    );
    // Without the mask the earlier outputs see the change.
    let free = t.forward_with(&src, &tgt, TransformerMasks::default()).unwrap();
    let free2 = t.forward_with(&src, &tgt2, TransformerMasks::default()).unwrap();
    assert_ne!(
        free.narrow(1, 0, 1).unwrap().to_vec_f64().unwrap(),
        free2.narrow(1, 0, 1).unwrap().to_vec_f64().unwrap()
    );
    // A padded source key is ignored: changing it changes nothing.
    let pad = t64(&[0., 0., 0., 0., 1., 0., 0., 0., 0., 1.], &[2, 5], CPU)
        .to_dtype(DType::Bool)
        .unwrap();
    let src2 = Tensor::cat(&[src.narrow(1, 0, 4).unwrap(), rand32(&[2, 1, 8], 5)], 1).unwrap();
    let padded = |s: &Tensor| {
        let masks = TransformerMasks {
            src_key_padding_mask: Some(&pad),
            memory_key_padding_mask: Some(&pad),
            ..with_mask
        };
        t.forward_with(s, &tgt, masks).unwrap()
    };
    assert_close(&padded(&src2), &padded(&src), 1e-5, 1e-6);
    // `transformer(src, tgt)`: the two-input forward is forward_with without masks.
    assert_eq!(
        t.forward(&src, &tgt).unwrap().to_vec_f64().unwrap(),
        free.to_vec_f64().unwrap()
    );
    // Errors: batch or feature mismatch.
    assert!(t.forward_with(&src, &rand32(&[3, 4, 8], 6), with_mask).is_err());
    assert!(t.forward_with(&src, &rand32(&[2, 4, 6], 6), with_mask).is_err());
    assert!(t.forward(&src, &rand32(&[3, 4, 8], 6)).is_err());
}

#[test]
fn encoder_layer_gradients_match_finite_differences() {
    manual_seed(5).unwrap();
    for norm_first in [false, true] {
        let config = TransformerLayerConfig {
            dim_feedforward: 6,
            dropout: 0.0,
            batch_first: true,
            norm_first,
            activation: TransformerActivation::Gelu,
            ..Default::default()
        };
        let layer = TransformerEncoderLayer::with_config(4, 2, config, CPU).unwrap();
        // Generic LayerNorm and attention biases, so their gradients are checked too.
        for p in layer.parameters() {
            if p.rank() == 1 {
                p.detach().uniform_(0.5, 1.5).unwrap();
            }
        }
        let pad = t64(&[0., 0., 1., 0., 0., 0.], &[2, 3], CPU)
            .to_dtype(DType::Bool)
            .unwrap();
        let x = rand64(&[2, 3, 4], 7);
        gradcheck_module(&layer, &x, |m, x| {
            m.forward_with(
                x,
                EncoderMasks {
                    key_padding_mask: Some(&pad),
                    ..Default::default()
                },
            )
        });
    }
}

#[test]
fn transformer_gradients_reach_every_parameter() {
    manual_seed(6).unwrap();
    let config = TransformerConfig {
        num_encoder_layers: 1,
        num_decoder_layers: 2,
        dim_feedforward: 12,
        ..Default::default()
    };
    let t = Transformer::with_config(8, 2, config, CPU).unwrap();
    let (src, tgt) = (rand32(&[5, 2, 8], 1), rand32(&[4, 2, 8], 2));
    let y = t
        .forward_with(
            &src,
            &tgt,
            TransformerMasks {
                tgt_is_causal: true,
                ..Default::default()
            },
        )
        .unwrap();
    let w = rand32(y.dims(), 3);
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert_grads_reach_every_parameter(&t);
}

#[test]
fn transformer_dropout_only_in_training_mode() {
    manual_seed(7).unwrap();
    let layer = TransformerEncoderLayer::with_config(8, 2, small(0.1, false, false), CPU).unwrap();
    let x = rand32(&[6, 2, 8], 1);
    let a = layer.forward(&x).unwrap();
    let b = layer.forward(&x).unwrap();
    assert_ne!(
        a.to_vec_f64().unwrap(),
        b.to_vec_f64().unwrap(),
        "training: dropout masks differ"
    );
    layer.eval();
    assert!(!layer.dropout.is_training() && !layer.self_attn.is_training() && !layer.norm1.is_training());
    let c = layer.forward(&x).unwrap();
    assert_eq!(
        c.to_vec_f64().unwrap(),
        layer.forward(&x).unwrap().to_vec_f64().unwrap()
    );
    assert_close(&c, &encoder_reference(&layer, &x, None), 1e-5, 1e-6);

    let t = Transformer::with_config(
        8,
        2,
        TransformerConfig {
            num_encoder_layers: 1,
            num_decoder_layers: 1,
            dim_feedforward: 12,
            ..Default::default()
        },
        CPU,
    )
    .unwrap();
    let tgt = rand32(&[3, 2, 8], 2);
    let a = t.forward_with(&x, &tgt, TransformerMasks::default()).unwrap();
    assert_ne!(
        a.to_vec_f64().unwrap(),
        t.forward_with(&x, &tgt, TransformerMasks::default())
            .unwrap()
            .to_vec_f64()
            .unwrap()
    );
    t.eval();
    assert!(!t.decoder.layers[0].multihead_attn.is_training() && !t.encoder.is_training());
    let c = t.forward_with(&x, &tgt, TransformerMasks::default()).unwrap();
    assert_eq!(
        c.to_vec_f64().unwrap(),
        t.forward_with(&x, &tgt, TransformerMasks::default())
            .unwrap()
            .to_vec_f64()
            .unwrap()
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn transformer_modules_cpu_vs_cuda_forward_and_parameter_gradients() {
    manual_seed(8).unwrap();
    let (src, tgt) = (rand32(&[3, 7, 16], 1), rand32(&[3, 5, 16], 2));
    let pad = t64(
        &[
            0., 0., 0., 0., 0., 0., 1., 0., 0., 0., 0., 0., 1., 1., 0., 0., 0., 0., 0., 0., 0.,
        ],
        &[3, 7],
        CPU,
    )
    .to_dtype(DType::Bool)
    .unwrap();
    for norm_first in [false, true] {
        let config = TransformerLayerConfig {
            activation: TransformerActivation::Gelu,
            ..small(0.0, true, norm_first)
        };
        let enc = TransformerEncoderLayer::with_config(16, 4, config, CPU).unwrap();
        cpu_vs_cuda_module(
            "TransformerEncoderLayer",
            &enc,
            |m, d| {
                let pad = pad.to(d)?;
                m.forward_with(
                    &src.to(d)?,
                    EncoderMasks {
                        key_padding_mask: Some(&pad),
                        ..Default::default()
                    },
                )
            },
            1e-4,
            1e-5,
        );
        let dec = TransformerDecoderLayer::with_config(16, 4, config, CPU).unwrap();
        cpu_vs_cuda_module(
            "TransformerDecoderLayer",
            &dec,
            |m, d| {
                let pad = pad.to(d)?;
                let masks = DecoderMasks {
                    tgt_is_causal: true,
                    memory_key_padding_mask: Some(&pad),
                    ..Default::default()
                };
                m.forward_with(&tgt.to(d)?, &src.to(d)?, masks)
            },
            1e-4,
            1e-5,
        );
    }
    let config = TransformerConfig {
        num_encoder_layers: 2,
        num_decoder_layers: 2,
        dim_feedforward: 32,
        dropout: 0.0,
        batch_first: true,
        ..Default::default()
    };
    let t = Transformer::with_config(16, 4, config, CPU).unwrap();
    cpu_vs_cuda_module(
        "Transformer",
        &t,
        |m, d| {
            let mask = Transformer::generate_square_subsequent_mask(5, d)?;
            let pad = pad.to(d)?;
            let masks = TransformerMasks {
                tgt_mask: Some(&mask),
                src_key_padding_mask: Some(&pad),
                memory_key_padding_mask: Some(&pad),
                ..Default::default()
            };
            m.forward_with(&src.to(d)?, &tgt.to(d)?, masks)
        },
        1e-4,
        1e-5,
    );
}
