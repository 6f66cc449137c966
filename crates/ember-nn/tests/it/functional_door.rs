//! The door for ember-nn's functional API: every public function of `functional/` passes
//! ember-core's dispatch point under its PyTorch name (ember-core's `tests/it/door.rs` does the
//! same for the op layer).
//!
//! The functions are read from the sources (`pub fn` of `src/functional/*.rs`), so a new one
//! fails here until it is listed: either in [`runs`], with the op name an observer must see
//! when it runs, or in [`NOT_OPS`], with the reason it is no op. The re-exports of ember-core's
//! ops (the recurrent layers, `nll_loss`, `mse_loss`, `l1_loss`,
//! `binary_cross_entropy_with_logits`) are run by ember-core's door.

use super::common::{public_functions, seen};
use ember_core::{DType, Device, Result, Tensor};
use ember_nn::functional as F;
use std::collections::BTreeSet;

/// The sources whose `pub fn`s are the functional API.
const SOURCES: &[(&str, &'static str)] = &[
    (
        "activation.rs",
        include_str!("../../src/functional/activation.rs"),
    ),
    ("attention.rs", include_str!("../../src/functional/attention.rs")),
    (
        "attention_mha.rs",
        include_str!("../../src/functional/attention_mha.rs"),
    ),
    ("conv.rs", include_str!("../../src/functional/conv.rs")),
    ("dropout.rs", include_str!("../../src/functional/dropout.rs")),
    ("loss.rs", include_str!("../../src/functional/loss.rs")),
    ("mod.rs", include_str!("../../src/functional/mod.rs")),
    (
        "normalization.rs",
        include_str!("../../src/functional/normalization.rs"),
    ),
    ("pooling.rs", include_str!("../../src/functional/pooling.rs")),
    ("recurrent.rs", include_str!("../../src/functional/recurrent.rs")),
];

/// Public functions that are no ops, and why.
const NOT_OPS: &[(&str, &str)] = &[
    (
        "new",
        "an options builder's defaults (SdpaOptions, CrossEntropyOptions)",
    ),
    ("attn_mask", "an options builder's setter"),
    ("dropout_p", "an options builder's setter"),
    ("is_causal", "an options builder's setter"),
    ("scale", "an options builder's setter"),
    ("enable_gqa", "an options builder's setter"),
    ("weight", "an options builder's setter"),
    ("ignore_index", "an options builder's setter"),
    ("reduction", "an options builder's setter"),
    ("label_smoothing", "an options builder's setter"),
];

type Run = Box<dyn Fn() -> Result<()>>;

fn run(f: impl Fn() -> Result<Tensor> + 'static) -> Run {
    Box::new(move || f().map(drop))
}

fn ones(dims: &[usize]) -> Result<Tensor> {
    Tensor::ones(dims, DType::F32, Device::Cpu)
}

fn x() -> Result<Tensor> {
    Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 3.0, -0.25, 1.5], [2, 3], Device::Cpu)
}

fn target() -> Result<Tensor> {
    Tensor::from_vec(vec![0i64, 2], [2], Device::Cpu)
}

/// An image batch `[1, 1, 4, 4]`.
fn image() -> Result<Tensor> {
    Tensor::arange(0.0, 16.0, 1.0, DType::F32, Device::Cpu)?.reshape(&[1, 1, 4, 4])
}

/// Every public function: its name, the op name an observer must see, and a run of it.
fn runs() -> Vec<(&'static str, &'static str, Run)> {
    vec![
        // Activations.
        ("gelu", "gelu", run(|| F::gelu(&x()?, F::GeluApproximate::None))),
        ("relu", "relu", run(|| F::relu(&x()?))),
        ("silu", "silu", run(|| F::silu(&x()?))),
        ("sigmoid", "sigmoid", run(|| F::sigmoid(&x()?))),
        ("tanh", "tanh", run(|| F::tanh(&x()?))),
        ("softmax", "softmax", run(|| F::softmax(&x()?, -1))),
        ("log_softmax", "log_softmax", run(|| F::log_softmax(&x()?, -1))),
        // Attention.
        (
            "scaled_dot_product_attention",
            "scaled_dot_product_attention",
            run(|| {
                let q = x()?.unsqueeze(0)?;
                F::scaled_dot_product_attention(&q, &q, &q)
            }),
        ),
        (
            "scaled_dot_product_attention_with",
            "scaled_dot_product_attention",
            run(|| {
                let q = x()?.unsqueeze(0)?;
                F::scaled_dot_product_attention_with(&q, &q, &q, F::SdpaOptions::new().is_causal(true))
            }),
        ),
        // PyTorch's `F.multi_head_attention_forward` is Python over aten ops (no aten op of its
        // own): its projections are `linear`, its attention `scaled_dot_product_attention`.
        (
            "multi_head_attention_forward",
            "scaled_dot_product_attention",
            run(|| {
                let q = ones(&[3, 1, 4])?;
                let (w, b) = (ones(&[12, 4])?, ones(&[12])?);
                let (wo, bo) = (ones(&[4, 4])?, ones(&[4])?);
                let out = F::multi_head_attention_forward(
                    &q,
                    &q,
                    &q,
                    4,
                    2,
                    &w,
                    Some(&b),
                    &wo,
                    Some(&bo),
                    None,
                    false,
                    false,
                    false,
                )?;
                Ok(out.0)
            }),
        ),
        (
            "multi_head_attention_forward_with",
            "linear",
            run(|| {
                let q = ones(&[3, 1, 4])?;
                let (w, wo) = (ones(&[12, 4])?, ones(&[4, 4])?);
                let out = F::multi_head_attention_forward_with(
                    &q,
                    &q,
                    &q,
                    4,
                    2,
                    &w,
                    None,
                    &wo,
                    None,
                    None,
                    false,
                    false,
                    false,
                    F::MhaOptions::default(),
                )?;
                Ok(out.0)
            }),
        ),
        // Convolution, linear, pooling.
        (
            "linear",
            "linear",
            run(|| F::linear(&x()?, &ones(&[4, 3])?, None)),
        ),
        (
            "conv2d",
            "conv2d",
            run(|| F::conv2d(&image()?, &ones(&[1, 1, 2, 2])?, None, 1, 0, 1, 1)),
        ),
        (
            "conv1d",
            "conv1d",
            run(|| F::conv1d(&x()?.unsqueeze(0)?, &ones(&[1, 2, 2])?, None, 1, 0, 1, 1)),
        ),
        ("unfold", "im2col", run(|| F::unfold(&image()?, 2, 1, 0, 1))),
        (
            "max_pool2d",
            "max_pool2d",
            run(|| F::max_pool2d(&image()?, 2, 2, 0)),
        ),
        (
            "avg_pool2d",
            "avg_pool2d",
            run(|| F::avg_pool2d(&image()?, 2, 2, 0)),
        ),
        (
            "adaptive_avg_pool2d",
            "adaptive_avg_pool2d",
            run(|| F::adaptive_avg_pool2d(&image()?, 3)),
        ),
        // Dropout, normalization.
        ("dropout", "dropout", run(|| F::dropout(&x()?, 0.5, true))),
        (
            "dropout_with",
            "dropout",
            run(|| F::dropout_with(&x()?, 0.5, true, &ember_core::Generator::new(0))),
        ),
        (
            "batch_norm",
            "batch_norm",
            run(|| {
                let stat = ones(&[3])?;
                F::batch_norm(&x()?, Some(&stat), Some(&stat), None, None, false, 0.1, 1e-5)
            }),
        ),
        (
            "layer_norm",
            "layer_norm",
            run(|| F::layer_norm(&x()?, &[3], None, None, 1e-5)),
        ),
        // Losses.
        (
            "cross_entropy",
            "cross_entropy",
            run(|| F::cross_entropy(&x()?, &target()?)),
        ),
        (
            "cross_entropy_with",
            "cross_entropy",
            run(|| {
                F::cross_entropy_with(
                    &x()?,
                    &target()?,
                    F::CrossEntropyOptions::new().label_smoothing(0.1),
                )
            }),
        ),
    ]
}

/// Where the sources are at hand, a file of `functional/` missing from [`SOURCES`] fails here.
fn check_sources_are_complete() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/functional");
    if !dir.is_dir() {
        return; // a test binary carried to another machine: the names below are still checked
    }
    for entry in std::fs::read_dir(dir).expect("the source folder is readable") {
        let name = entry
            .expect("a folder entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".rs") {
            assert!(
                SOURCES.iter().any(|(path, _)| *path == name),
                "functional/{name} is not among functional_door.rs's SOURCES: add it"
            );
        }
    }
}

#[test]
fn every_public_functional_function_is_listed() {
    check_sources_are_complete();
    let listed: BTreeSet<&str> = runs()
        .iter()
        .map(|(f, _, _)| *f)
        .chain(NOT_OPS.iter().map(|(f, _)| *f))
        .collect();
    let public = public_functions(SOURCES);
    assert!(
        public.len() > 30,
        "the scan found only {} functions",
        public.len()
    );
    let unlisted: Vec<_> = public.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "public functions of ember-nn's functional API neither run in `runs` nor listed in NOT_OPS: {unlisted:?}"
    );
    let gone: Vec<_> = listed.difference(&public).collect();
    assert!(gone.is_empty(), "listed but not public functions: {gone:?}");
}

#[test]
fn every_public_functional_function_passes_the_dispatch_point_under_its_name() {
    let mut missed = Vec::new();
    for (function, op, f) in runs() {
        let (result, names) = seen(f);
        if let Err(e) = result {
            missed.push(format!("{function}: failed ({e})"));
        } else if !names.contains(&op) {
            missed.push(format!("{function}: `{op}` not seen (saw {names:?})"));
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}
