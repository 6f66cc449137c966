//! Group "nn": each case's PyTorch `op` + `kwargs` mapped to `ember_nn::functional`, computing
//! exactly what `nn_cases` in `gen_reference.py` computes (PyTorch's defaults filled in where
//! the generator relies on them, e.g. `max_pool2d`'s stride = kernel_size).
//!
//! An op without an arm here is reported as skipped ("not mapped").

use super::kwargs::Kwargs;
use super::runner::Fail;
use ember_core::{DType, Result as EResult, Tensor};
use ember_nn::functional as F;
use ember_nn::functional::{Pair, Reduction};

/// The ops this table maps.
pub const MAPPED: &[&str] = &[
    "linear",
    "conv2d",
    "conv1d",
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "batch_norm",
    "layer_norm",
    "scaled_dot_product_attention",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "binary_cross_entropy_with_logits",
    "lstm",
    "gru",
    "rnn",
    "multihead_attention",
];

/// A kwarg that is an int or a pair of ints.
fn pair(kw: &Kwargs, name: &str) -> Result<Option<Pair>, Fail> {
    let Some(d) = kw.opt_dims(name)? else {
        return Ok(None);
    };
    match d.as_slice() {
        [n] if *n >= 0 => Ok(Some(Pair::from(*n as usize))),
        [h, w] if *h >= 0 && *w >= 0 => Ok(Some(Pair([*h as usize, *w as usize]))),
        _ => Err(Fail::Failed(format!(
            "runner: kwarg {name}={d:?} is not an int or a pair"
        ))),
    }
}

fn usize_or(kw: &Kwargs, name: &str, default: usize) -> Result<usize, Fail> {
    match kw.opt_dim(name)? {
        None => Ok(default),
        Some(d) if d >= 0 => Ok(d as usize),
        Some(d) => Err(Fail::Failed(format!("runner: kwarg {name}={d} is negative"))),
    }
}

fn reduction(kw: &Kwargs) -> Result<Reduction, Fail> {
    Ok(Reduction::parse(kw.opt_str("reduction")?.unwrap_or("mean"))?)
}

/// The per-layer weight lists `[w_ih, w_hh, b_ih, b_hh]` of a recurrent case (inputs after the
/// states are the state dict's `weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, ...`).
fn layer_weights<'a>(kw: &Kwargs, params: &'a [Tensor]) -> Result<(Vec<&'a [Tensor]>, usize), Fail> {
    let layers = usize_or(kw, "num_layers", 1)?;
    if params.len() != 4 * layers {
        return Err(Fail::Failed(format!(
            "runner: {layers} layer(s) need {} weights, the case has {}",
            4 * layers,
            params.len()
        )));
    }
    Ok((params.chunks(4).collect(), layers))
}

/// PyTorch's outputs of `case`, computed with ember from `x` (the inputs in manifest order).
pub fn forward(op: &str, _id: &str, kw: &Kwargs, x: &[Tensor]) -> Result<Vec<Tensor>, Fail> {
    let one = |t: EResult<Tensor>| -> Result<Vec<Tensor>, Fail> { Ok(vec![t?]) };
    let arity = |n: usize| -> Result<(), Fail> {
        if x.len() == n {
            Ok(())
        } else {
            Err(Fail::Failed(format!(
                "runner: {op} takes {n} inputs, the case has {}",
                x.len()
            )))
        }
    };
    match op {
        "linear" => {
            arity(3)?;
            kw.only(&[])?;
            one(F::linear(&x[0], &x[1], Some(&x[2])))
        }
        "conv2d" => {
            arity(3)?;
            kw.only(&["stride", "padding", "dilation", "groups"])?;
            let p = |n: &str| pair(kw, n).map(|p| p.unwrap_or(Pair([1, 1])));
            let padding = pair(kw, "padding")?.unwrap_or(Pair([0, 0]));
            one(F::conv2d(
                &x[0],
                &x[1],
                Some(&x[2]),
                p("stride")?,
                padding,
                p("dilation")?,
                usize_or(kw, "groups", 1)?,
            ))
        }
        "conv1d" => {
            arity(3)?;
            kw.only(&["stride", "padding", "dilation", "groups"])?;
            one(F::conv1d(
                &x[0],
                &x[1],
                Some(&x[2]),
                usize_or(kw, "stride", 1)?,
                usize_or(kw, "padding", 0)?,
                usize_or(kw, "dilation", 1)?,
                usize_or(kw, "groups", 1)?,
            ))
        }
        "max_pool2d" | "avg_pool2d" => {
            arity(1)?;
            kw.only(&["kernel_size", "stride", "padding"])?;
            let kernel = pair(kw, "kernel_size")?
                .ok_or_else(|| Fail::Failed("runner: kernel_size is missing".into()))?;
            let stride = pair(kw, "stride")?.unwrap_or(kernel);
            let padding = pair(kw, "padding")?.unwrap_or(Pair([0, 0]));
            one(if op == "max_pool2d" {
                F::max_pool2d(&x[0], kernel, stride, padding)
            } else {
                F::avg_pool2d(&x[0], kernel, stride, padding)
            })
        }
        "adaptive_avg_pool2d" => {
            arity(1)?;
            kw.only(&["output_size"])?;
            let size = pair(kw, "output_size")?
                .ok_or_else(|| Fail::Failed("runner: output_size is missing".into()))?;
            one(F::adaptive_avg_pool2d(&x[0], size))
        }
        "batch_norm" => {
            // (input, running_mean, running_var, weight, bias); training also returns the
            // running stats after the in-place update.
            arity(5)?;
            kw.only(&["training", "momentum", "eps"])?;
            let training = kw.bool_or("training", false)?;
            let momentum = kw.opt_f64("momentum")?.unwrap_or(0.1);
            let eps = kw.opt_f64("eps")?.unwrap_or(1e-5);
            let out = F::batch_norm(
                &x[0],
                Some(&x[1]),
                Some(&x[2]),
                Some(&x[3]),
                Some(&x[4]),
                training,
                momentum,
                eps,
            )?;
            Ok(if training {
                vec![out, x[1].clone(), x[2].clone()]
            } else {
                vec![out]
            })
        }
        "layer_norm" => {
            arity(3)?;
            kw.only(&["normalized_shape", "eps"])?;
            let shape: Vec<usize> = kw.dims("normalized_shape")?.iter().map(|&d| d as usize).collect();
            let eps = kw.opt_f64("eps")?.unwrap_or(1e-5);
            one(F::layer_norm(&x[0], &shape, Some(&x[1]), Some(&x[2]), eps))
        }
        "scaled_dot_product_attention" => {
            arity(3)?;
            kw.only(&["is_causal"])?;
            let causal = kw.bool_or("is_causal", false)?;
            one(F::scaled_dot_product_attention_with(
                &x[0],
                &x[1],
                &x[2],
                F::SdpaOptions {
                    attn_mask: None,
                    dropout_p: 0.0,
                    is_causal: causal,
                    scale: None,
                    enable_gqa: false,
                },
            ))
        }
        "cross_entropy" => {
            arity(2)?;
            kw.only(&["reduction", "ignore_index", "label_smoothing"])?;
            let ignore = kw.opt_dim("ignore_index")?.unwrap_or(-100) as i64;
            let smoothing = kw.opt_f64("label_smoothing")?.unwrap_or(0.0);
            one(F::cross_entropy_with(
                &x[0],
                &x[1],
                F::CrossEntropyOptions {
                    weight: None,
                    ignore_index: ignore,
                    reduction: reduction(kw)?,
                    label_smoothing: smoothing,
                },
            ))
        }
        "nll_loss" => {
            arity(2)?;
            kw.only(&["reduction", "ignore_index"])?;
            let ignore = kw.opt_dim("ignore_index")?.unwrap_or(-100) as i64;
            one(F::nll_loss(&x[0], &x[1], None, ignore, reduction(kw)?))
        }
        "mse_loss" | "l1_loss" => {
            arity(2)?;
            kw.only(&["reduction"])?;
            let r = reduction(kw)?;
            one(if op == "mse_loss" {
                F::mse_loss(&x[0], &x[1], r)
            } else {
                F::l1_loss(&x[0], &x[1], r)
            })
        }
        "binary_cross_entropy_with_logits" => {
            arity(2)?;
            kw.only(&["reduction"])?;
            one(F::binary_cross_entropy_with_logits(
                &x[0],
                &x[1],
                None,
                None,
                reduction(kw)?,
            ))
        }
        "lstm" | "gru" | "rnn" => {
            // (x, h0[, c0], weights...) -> (output, h_n[, c_n])
            kw.only(&["input_size", "hidden_size", "num_layers", "batch_first"])?;
            let states = if op == "lstm" { 2 } else { 1 };
            if x.len() < 1 + states {
                return Err(Fail::Failed(format!("runner: {op} has only {} inputs", x.len())));
            }
            let (weights, layers) = layer_weights(kw, &x[1 + states..])?;
            let batch_first = kw.bool_or("batch_first", false)?;
            let (input_size, hidden) = (kw.usize("input_size")?, kw.usize("hidden_size")?);
            if x[0].dims().last() != Some(&input_size) || x[1].dims().last() != Some(&hidden) {
                return Err(Fail::Failed(format!(
                    "runner: input_size {input_size} / hidden_size {hidden} disagree with x {} / h0 {}",
                    x[0].shape(),
                    x[1].shape()
                )));
            }
            Ok(match op {
                "lstm" => {
                    let (out, (h, c)) = F::lstm(
                        &x[0],
                        Some((&x[1], &x[2])),
                        &weights,
                        layers,
                        batch_first,
                        0.0,
                        false,
                    )?;
                    vec![out, h, c]
                }
                "gru" => {
                    let (out, h) = F::gru(&x[0], Some(&x[1]), &weights, layers, batch_first, 0.0, false)?;
                    vec![out, h]
                }
                _ => {
                    let (out, h) = F::rnn(
                        &x[0],
                        Some(&x[1]),
                        &weights,
                        F::RnnNonlinearity::Tanh,
                        layers,
                        batch_first,
                        0.0,
                        false,
                    )?;
                    vec![out, h]
                }
            })
        }
        "multihead_attention" => {
            // (query, key, value, in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias);
            // attn_mask="causal" is the bool mask triu(ones(L, S), 1) (true = may not attend).
            arity(7)?;
            kw.only(&[
                "embed_dim",
                "num_heads",
                "batch_first",
                "attn_mask",
                "need_weights",
            ])?;
            let batch_first = kw.bool_or("batch_first", false)?;
            // The module's default, as the mixed-precision cases call it: the explicit path
            // (scores in the input dtype, softmax, then the weighted sum) whose roundings
            // bfloat16 shows. The float64 case was made with need_weights=False (PyTorch's
            // sdpa), which agrees with it to float64 rounding.
            let need_weights = kw.bool_or("need_weights", true)?;
            let mask = match kw.opt_str("attn_mask")? {
                None => None,
                Some("causal") => {
                    let t = if batch_first { 1 } else { 0 };
                    let (l, s) = (x[0].dims()[t], x[1].dims()[t]);
                    let dev = x[0].device();
                    let i = Tensor::arange(0.0, l as f64, 1.0, DType::I64, dev)?.unsqueeze(1)?;
                    let j = Tensor::arange(0.0, s as f64, 1.0, DType::I64, dev)?.unsqueeze(0)?;
                    Some(j.gt(&i)?)
                }
                Some(m) => return Err(Fail::unmapped(format!("attn_mask={m:?}"))),
            };
            let (out, _) = F::multi_head_attention_forward(
                &x[0],
                &x[1],
                &x[2],
                kw.usize("embed_dim")?,
                kw.usize("num_heads")?,
                &x[3],
                Some(&x[4]),
                &x[5],
                Some(&x[6]),
                mask.as_ref(),
                false,
                batch_first,
                need_weights,
            )?;
            Ok(vec![out])
        }
        _ => Err(Fail::unmapped(format!(
            "op {op:?} has no ember call in the runner yet"
        ))),
    }
}
