//! The door: every public op of ember-core passes the dispatch point under its PyTorch name.
//!
//! The public functions of the op layer are read from the sources (`pub fn` of `ops/`,
//! `tensor/`, `random/tensor.rs` and the handle's own, `dispatch/tensor_impl.rs`), so a new
//! one fails here until it is listed: either in [`runs`], with the op name an observer must
//! see when it runs, or in [`NOT_OPS`], with the reason it is no op (an accessor, the autograd
//! API, a read of the elements). The methods the elementwise tables generate (`exp`, `add`,
//! `add_`, `eq`, ...) are not written as `pub fn`; each of their lines is run under an
//! observer by ember-nn's autocast test, and their unary entry point is run here for every
//! line of the unary table.

use super::common::{public_functions, seen};
use ember_core::backend::UnaryOp;
use ember_core::ops::{attention, conv, loss, multihead_attention, pool, recurrent};
use ember_core::{amp_scaling, fused, DType, Device, Result, Tensor};
use std::collections::BTreeSet;

/// The sources whose `pub fn`s are the op layer's public functions.
const SOURCES: &[(&str, &'static str)] = &[
    ("ops/amp_scaling.rs", include_str!("../../src/ops/amp_scaling.rs")),
    ("ops/attention.rs", include_str!("../../src/ops/attention.rs")),
    ("ops/batch_norm.rs", include_str!("../../src/ops/batch_norm.rs")),
    ("ops/binary.rs", include_str!("../../src/ops/binary.rs")),
    ("ops/conv.rs", include_str!("../../src/ops/conv.rs")),
    ("ops/dropout.rs", include_str!("../../src/ops/dropout.rs")),
    (
        "ops/conv_composite.rs",
        include_str!("../../src/ops/conv_composite.rs"),
    ),
    ("ops/foreach.rs", include_str!("../../src/ops/foreach.rs")),
    ("ops/fused_optim.rs", include_str!("../../src/ops/fused_optim.rs")),
    ("ops/index.rs", include_str!("../../src/ops/index.rs")),
    ("ops/inplace.rs", include_str!("../../src/ops/inplace.rs")),
    ("ops/loss.rs", include_str!("../../src/ops/loss.rs")),
    ("ops/matmul.rs", include_str!("../../src/ops/matmul.rs")),
    (
        "ops/multihead_attention.rs",
        include_str!("../../src/ops/multihead_attention.rs"),
    ),
    ("ops/norm.rs", include_str!("../../src/ops/norm.rs")),
    ("ops/mod.rs", include_str!("../../src/ops/mod.rs")),
    ("ops/operators.rs", include_str!("../../src/ops/operators.rs")),
    ("ops/pool.rs", include_str!("../../src/ops/pool.rs")),
    ("ops/recurrent.rs", include_str!("../../src/ops/recurrent.rs")),
    ("ops/reduce.rs", include_str!("../../src/ops/reduce.rs")),
    ("ops/rnn.rs", include_str!("../../src/ops/rnn.rs")),
    ("ops/sdpa.rs", include_str!("../../src/ops/sdpa.rs")),
    (
        "ops/slice_scatter.rs",
        include_str!("../../src/ops/slice_scatter.rs"),
    ),
    ("ops/softmax.rs", include_str!("../../src/ops/softmax.rs")),
    ("ops/sort.rs", include_str!("../../src/ops/sort.rs")),
    ("ops/unary.rs", include_str!("../../src/ops/unary.rs")),
    ("ops/view.rs", include_str!("../../src/ops/view.rs")),
    ("tensor/convert.rs", include_str!("../../src/tensor/convert.rs")),
    ("tensor/create.rs", include_str!("../../src/tensor/create.rs")),
    ("tensor/display.rs", include_str!("../../src/tensor/display.rs")),
    ("tensor/literal.rs", include_str!("../../src/tensor/literal.rs")),
    ("tensor/mod.rs", include_str!("../../src/tensor/mod.rs")),
    (
        "dispatch/tensor_impl.rs",
        include_str!("../../src/dispatch/tensor_impl.rs"),
    ),
    ("random/tensor.rs", include_str!("../../src/random/tensor.rs")),
];

/// Public functions that are no ops, and why.
const NOT_OPS: &[(&str, &str)] = &[
    ("parse", "RnnNonlinearity::parse reads a nonlinearity's name"),
    ("shape", "an accessor"),
    ("dims", "an accessor"),
    ("rank", "an accessor"),
    ("size", "an accessor"),
    ("numel", "an accessor"),
    ("dtype", "an accessor"),
    ("device", "an accessor"),
    ("stride", "an accessor"),
    ("storage_offset", "an accessor"),
    ("is_contiguous", "an accessor"),
    ("data_ptr", "an accessor"),
    ("shares_storage_with", "an accessor"),
    ("is_same", "an accessor (identity of two handles)"),
    ("version", "an accessor"),
    ("is_pinned", "an accessor"),
    ("is_leaf", "an accessor"),
    ("grad_fn_name", "an accessor"),
    ("requires_grad", "an accessor"),
    ("retains_grad", "an accessor"),
    ("can_fuse", "a predicate on tensors, no op"),
    ("can_fuse_reading", "a predicate on tensors, no op"),
    ("requires_grad_", "the autograd API: sets a flag"),
    ("grad", "the autograd API"),
    ("set_grad", "the autograd API"),
    ("retain_grad", "the autograd API"),
    ("register_hook", "the autograd API"),
    ("register_post_accumulate_grad_hook", "the autograd API"),
    ("remove", "the autograd API (a hook handle's)"),
    ("detach", "a new handle cut from the graph: no kernel, no data"),
    (
        "swap_storage_",
        "exchanges two storages' elements, no kernel (FSDP's resize of gathered parameters)",
    ),
    (
        "to_device_",
        "moves the storage under every handle (Module::to); its copy is `to`'s",
    ),
    (
        "to_vec",
        "a read of the elements to the host (`tolist`, no aten op)",
    ),
    ("to_vec_f64", "a read of the elements to the host"),
    ("item_f64", "`item` converted to f64"),
    ("scatter_value", "`scatter` with a value"),
];

type Run = Box<dyn Fn() -> Result<()>>;

fn zeros(dims: &[usize]) -> Result<Tensor> {
    Tensor::zeros(dims, DType::F32, Device::Cpu)
}

fn x() -> Result<Tensor> {
    Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 3.0, -0.25, 1.5], [2, 3], Device::Cpu)
}

fn run(f: impl Fn() -> Result<Tensor> + 'static) -> Run {
    Box::new(move || f().map(drop))
}

fn run_list(f: impl Fn() -> Result<Vec<Tensor>> + 'static) -> Run {
    Box::new(move || f().map(drop))
}

/// Every public op: its function's name, the op name an observer must see, and a run of it.
fn runs() -> Vec<(&'static str, &'static str, Run)> {
    let d = Device::Cpu;
    let f32 = DType::F32;
    let idx = || Tensor::from_vec(vec![1i64, 0], [2], Device::Cpu);
    let mask = || Tensor::from_vec(vec![true, false, true, false, false, true], [2, 3], Device::Cpu);
    vec![
        // Factories and random draws.
        (
            "from_vec",
            "tensor",
            run(|| Tensor::from_vec(vec![1.0f32, 2.0], [2], Device::Cpu)),
        ),
        (
            "from_slice",
            "tensor",
            run(|| Tensor::from_slice(&[1.0f32, 2.0], [2], Device::Cpu)),
        ),
        (
            "scalar",
            "scalar_tensor",
            run(move || Tensor::scalar(1.0, f32, d)),
        ),
        ("full", "full", run(move || Tensor::full([2], 3.0, f32, d))),
        ("zeros", "zeros", run(move || Tensor::zeros([2], f32, d))),
        ("ones", "ones", run(move || Tensor::ones([2], f32, d))),
        ("empty", "empty", run(move || Tensor::empty([2], f32, d))),
        ("full_like", "full_like", run(|| x()?.full_like(2.0))),
        ("zeros_like", "zeros_like", run(|| x()?.zeros_like())),
        ("ones_like", "ones_like", run(|| x()?.ones_like())),
        ("empty_like", "empty_like", run(|| x()?.empty_like())),
        (
            "arange",
            "arange",
            run(move || Tensor::arange(0.0, 4.0, 1.0, f32, d)),
        ),
        (
            "linspace",
            "linspace",
            run(move || Tensor::linspace(0.0, 1.0, 5, f32, d)),
        ),
        ("eye", "eye", run(move || Tensor::eye(3, f32, d))),
        ("rand", "rand", run(move || Tensor::rand([2], f32, d))),
        (
            "rand_with",
            "rand",
            run(move || Tensor::rand_with([2], f32, d, &ember_core::Generator::new(1))),
        ),
        ("randn", "randn", run(move || Tensor::randn([2], f32, d))),
        (
            "randn_with",
            "randn",
            run(move || Tensor::randn_with([2], f32, d, &ember_core::Generator::new(1))),
        ),
        (
            "normal",
            "normal",
            run(move || Tensor::normal(1.0, 2.0, [2], f32, d)),
        ),
        (
            "normal_with",
            "normal",
            run(move || Tensor::normal_with(1.0, 2.0, [2], f32, d, &ember_core::Generator::new(1))),
        ),
        ("randint", "randint", run(move || Tensor::randint(0, 5, [2], d))),
        (
            "randint_with",
            "randint",
            run(move || Tensor::randint_with(0, 5, [2], d, &ember_core::Generator::new(1))),
        ),
        ("randperm", "randperm", run(move || Tensor::randperm(5, d))),
        (
            "randperm_with",
            "randperm",
            run(move || Tensor::randperm_with(5, d, &ember_core::Generator::new(1))),
        ),
        ("rand_like", "rand_like", run(|| x()?.rand_like())),
        ("randn_like", "randn_like", run(|| x()?.randn_like())),
        (
            "bernoulli",
            "bernoulli",
            run(|| x()?.clamp(Some(0.0), Some(1.0))?.bernoulli()),
        ),
        (
            "bernoulli_with",
            "bernoulli",
            run(|| {
                x()?.clamp(Some(0.0), Some(1.0))?
                    .bernoulli_with(&ember_core::Generator::new(1))
            }),
        ),
        ("bernoulli_p", "bernoulli", run(|| x()?.bernoulli_p(0.5))),
        (
            "bernoulli_p_with",
            "bernoulli",
            run(|| x()?.bernoulli_p_with(0.5, &ember_core::Generator::new(1))),
        ),
        ("uniform_", "uniform_", run(|| x()?.uniform_(0.0, 1.0))),
        (
            "uniform_with_",
            "uniform_",
            run(|| x()?.uniform_with_(0.0, 1.0, &ember_core::Generator::new(1))),
        ),
        ("normal_", "normal_", run(|| x()?.normal_(0.0, 1.0))),
        (
            "normal_with_",
            "normal_",
            run(|| x()?.normal_with_(0.0, 1.0, &ember_core::Generator::new(1))),
        ),
        ("bernoulli_", "bernoulli_", run(|| x()?.bernoulli_(0.5))),
        (
            "bernoulli_with_",
            "bernoulli_",
            run(|| x()?.bernoulli_with_(0.5, &ember_core::Generator::new(1))),
        ),
        // Copies and casts.
        ("to_dtype", "to", run(|| x()?.to_dtype(DType::F64))),
        (
            "to",
            "to",
            run(|| x()?.to(Device::Cpu).and_then(|t| t.to_dtype(DType::F16))),
        ),
        (
            "to_non_blocking",
            "to",
            run(|| {
                x()?.to_dtype(DType::F64)?
                    .to_non_blocking(Device::Cpu)?
                    .to_dtype(DType::F32)
            }),
        ),
        ("copy_", "copy_", run(|| x()?.copy_(&x()?))),
        (
            "copy_non_blocking_",
            "copy_",
            run(|| x()?.copy_non_blocking_(&x()?)),
        ),
        ("fill_", "fill_", run(|| x()?.fill_(1.0))),
        ("zero_", "zero_", run(|| x()?.zero_())),
        ("contiguous", "contiguous", run(|| x()?.t()?.contiguous())),
        ("deep_clone", "clone", run(|| x()?.deep_clone())),
        (
            "item",
            "item",
            Box::new(|| {
                Tensor::scalar(1.0, DType::F32, Device::Cpu)?
                    .item::<f32>()
                    .map(drop)
            }),
        ),
        // pin_memory needs a CUDA driver: `pin_memory_and_the_gpu_copies_pass_the_dispatch_point`.
        // Views and shapes.
        ("reshape", "reshape", run(|| x()?.reshape(&[3, 2]))),
        ("view", "view", run(|| x()?.view(&[3, 2]))),
        ("permute", "permute", run(|| x()?.permute(&[1, 0]))),
        ("transpose", "transpose", run(|| x()?.transpose(0, 1))),
        ("t", "t", run(|| x()?.t())),
        ("narrow", "narrow", run(|| x()?.narrow(1, 0, 2))),
        ("slice", "slice", run(|| x()?.slice(1, 0, 3, 2))),
        ("select", "select", run(|| x()?.select(0, 1))),
        ("unsqueeze", "unsqueeze", run(|| x()?.unsqueeze(0))),
        ("squeeze", "squeeze", run(|| x()?.unsqueeze(0)?.squeeze())),
        (
            "squeeze_dim",
            "squeeze",
            run(|| x()?.unsqueeze(0)?.squeeze_dim(0)),
        ),
        ("expand", "expand", run(|| x()?.unsqueeze(0)?.expand(&[2, 2, 3]))),
        (
            "broadcast_to",
            "broadcast_to",
            run(|| x()?.broadcast_to(&[2, 2, 3].into())),
        ),
        ("flatten", "flatten", run(|| x()?.flatten(0, 1))),
        ("split", "split", run_list(|| x()?.split(2, 1))),
        (
            "split_with_sizes",
            "split_with_sizes",
            run_list(|| x()?.split_with_sizes(&[1, 2], 1)),
        ),
        ("chunk", "chunk", run_list(|| x()?.chunk(2, 1))),
        (
            "split_into",
            "split",
            Box::new(|| x()?.split_into::<2>(2, 1).map(drop)),
        ),
        (
            "chunk_into",
            "chunk",
            Box::new(|| x()?.chunk_into::<2>(1).map(drop)),
        ),
        ("sort", "sort", Box::new(|| x()?.sort(1, true).map(drop))),
        ("argsort", "argsort", run(|| x()?.argsort(1, false))),
        ("topk", "topk", Box::new(|| x()?.topk(2, 1, true).map(drop))),
        (
            "multinomial",
            "multinomial",
            run(|| x()?.abs()?.multinomial(2, true)),
        ),
        ("tril", "tril", run(|| x()?.tril(0))),
        ("triu", "triu", run(|| x()?.triu(1))),
        (
            "slice_scatter",
            "slice_scatter",
            run(|| x()?.slice_scatter(&Tensor::zeros([2, 2], DType::F32, Device::Cpu)?, 1, 0, 3, 2)),
        ),
        (
            "from_literal",
            "tensor",
            Box::new(|| {
                ember_core::tensor::from_literal([[1.0f32, 2.0], [3.0, 4.0]]);
                Ok(())
            }),
        ),
        (
            "arange_i64",
            "arange",
            run(move || Tensor::arange_i64(0, 4, 1, d)),
        ),
        ("unbind", "unbind", run_list(|| x()?.unbind(0))),
        ("cat", "cat", run(|| Tensor::cat(&[x()?, x()?], 0))),
        ("stack", "stack", run(|| Tensor::stack(&[x()?, x()?], 0))),
        // Elementwise ops written out (the tables' methods are run by ember-nn's autocast test).
        ("unary_op", "exp", run(|| x()?.unary_op(UnaryOp::Exp))),
        ("relu6", "relu6", run(|| x()?.relu6())),
        ("selu", "selu", run(|| x()?.selu())),
        ("celu", "celu", run(|| x()?.celu(1.0))),
        ("elu", "elu", run(|| x()?.elu(1.0))),
        ("leaky_relu", "leaky_relu", run(|| x()?.leaky_relu(0.01))),
        ("hardtanh", "hardtanh", run(|| x()?.hardtanh(-1.0, 1.0))),
        ("softplus", "softplus", run(|| x()?.softplus())),
        ("softplus_with", "softplus", run(|| x()?.softplus_with(2.0, 20.0))),
        (
            "binary_out",
            "add",
            run(|| x()?.binary_out(ember_core::backend::BinaryOp::Add, &x()?, &x()?)),
        ),
        ("add_out", "add", run(|| x()?.add_out(&x()?, &x()?))),
        ("mul_out", "mul", run(|| x()?.mul_out(&x()?, &x()?))),
        ("logical_not", "logical_not", run(move || mask()?.logical_not())),
        (
            "where_cond",
            "where",
            run(move || Tensor::where_cond(&mask()?, &x()?, &x()?)),
        ),
        (
            "masked_fill",
            "masked_fill",
            run(move || x()?.masked_fill(&mask()?, 0.0)),
        ),
        ("clamp", "clamp", run(|| x()?.clamp(Some(0.0), None))),
        ("clamp_min", "clamp_min", run(|| x()?.clamp_min(0.0))),
        ("clamp_max", "clamp_max", run(|| x()?.clamp_max(0.0))),
        ("clamp_", "clamp_", run(|| x()?.clamp_(Some(0.0), None))),
        ("add_scaled_", "add_", run(|| x()?.add_scaled_(&x()?, 2.0))),
        ("addcmul_", "addcmul_", run(|| x()?.addcmul_(&x()?, &x()?, 0.5))),
        (
            "addcdiv_",
            "addcdiv_",
            run(|| x()?.addcdiv_(&x()?, &x()?.exp()?, 0.5)),
        ),
        ("lerp_", "lerp_", run(|| x()?.lerp_(&x()?, 0.5))),
        // Reductions.
        ("sum_all", "sum", run(|| x()?.sum_all())),
        ("sum_dims", "sum", run(|| x()?.sum_dims(&[0], false))),
        ("sum_dim", "sum", run(|| x()?.sum_dim(0, true))),
        ("mean_all", "mean", run(|| x()?.mean_all())),
        ("mean_dims", "mean", run(|| x()?.mean_dims(&[1], false))),
        ("prod_all", "prod", run(|| x()?.prod_all())),
        ("prod_dim", "prod", run(|| x()?.prod_dim(0, false))),
        ("prod_dims", "prod", run(|| x()?.prod_dims(&[0], false))),
        ("max_dim", "max", Box::new(|| x()?.max_dim(1, false).map(drop))),
        ("min_dim", "min", Box::new(|| x()?.min_dim(1, false).map(drop))),
        ("max_all", "max", run(|| x()?.max_all())),
        ("min_all", "min", run(|| x()?.min_all())),
        ("amax", "amax", run(|| x()?.amax(&[1], false))),
        ("amin", "amin", run(|| x()?.amin(&[1], false))),
        ("argmax", "argmax", run(|| x()?.argmax(Some(1), false))),
        ("argmin", "argmin", run(|| x()?.argmin(None, false))),
        ("var", "var", run(|| x()?.var(&[1], 1.0, false))),
        ("std", "std", run(|| x()?.std(&[1], 1.0, false))),
        ("logsumexp", "logsumexp", run(|| x()?.logsumexp(&[1], false))),
        ("norm", "norm", run(|| x()?.norm(2.0, &[1], false))),
        ("softmax", "softmax", run(|| x()?.softmax(1))),
        ("log_softmax", "log_softmax", run(|| x()?.log_softmax(1))),
        // The fused norms (issue 37).
        (
            "layer_norm",
            "layer_norm",
            run(|| x()?.layer_norm(&[3], None, None, 1e-5)),
        ),
        // Indexing.
        (
            "index_select",
            "index_select",
            run(move || x()?.index_select(0, &idx()?)),
        ),
        (
            "gather",
            "gather",
            run(|| {
                x()?.gather(
                    1,
                    &Tensor::from_vec(vec![0i64, 2, 1, 0, 1, 2], [2, 3], Device::Cpu)?,
                )
            }),
        ),
        (
            "scatter",
            "scatter",
            run(|| {
                x()?.scatter(
                    1,
                    &Tensor::from_vec(vec![0i64, 2, 1, 0, 1, 2], [2, 3], Device::Cpu)?,
                    &x()?,
                )
            }),
        ),
        (
            "scatter_add",
            "scatter_add",
            run(|| {
                x()?.scatter_add(
                    1,
                    &Tensor::from_vec(vec![0i64, 2, 1, 0, 1, 2], [2, 3], Device::Cpu)?,
                    &x()?,
                )
            }),
        ),
        (
            "index_add",
            "index_add",
            run(move || x()?.index_add(0, &idx()?, &x()?)),
        ),
        (
            "embedding",
            "embedding",
            run(move || Tensor::embedding(&idx()?, &x()?)),
        ),
        ("one_hot", "one_hot", run(move || idx()?.one_hot(3))),
        (
            "nll_loss_forward",
            "nll_loss_forward",
            Box::new(move || {
                x()?.log_softmax(1)?
                    .nll_loss_forward(&idx()?, None, true, -100)
                    .map(drop)
            }),
        ),
        (
            "scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_cudnn_attention",
            Box::new(move || {
                let q = x()?.unsqueeze(0)?.unsqueeze(0)?;
                attention::scaled_dot_product_cudnn_attention(&q, &q, &q, true, 0.5).map(drop)
            }),
        ),
        (
            "cross_entropy_loss",
            "cross_entropy",
            run(move || x()?.cross_entropy_loss(&idx()?, None, ember_core::Reduction::Mean, -100, 0.0)),
        ),
        // Products, convolution, pooling, batch normalization, the LSTM recurrence.
        ("matmul", "matmul", run(|| x()?.matmul(&x()?.t()?))),
        ("mm", "mm", run(|| x()?.mm(&x()?.t()?))),
        (
            "bmm",
            "bmm",
            run(|| x()?.unsqueeze(0)?.bmm(&x()?.t()?.unsqueeze(0)?)),
        ),
        ("linear", "linear", run(|| x()?.linear(&x()?, None))),
        (
            "convolution",
            "conv2d",
            run(|| {
                conv::convolution(
                    &x()?.reshape(&[1, 1, 2, 3])?,
                    &Tensor::ones([1, 1, 1, 2], DType::F32, Device::Cpu)?,
                    None,
                    &[1, 1],
                    &[0, 0],
                    &[1, 1],
                    1,
                )
            }),
        ),
        (
            "unfold",
            "im2col",
            run(|| conv::unfold(&x()?.reshape(&[1, 1, 2, 3])?, [1, 2], [1, 1], [0, 0], [1, 1])),
        ),
        (
            "pool2d",
            "max_pool2d",
            run(|| {
                pool::pool2d(
                    &x()?.reshape(&[1, 1, 2, 3])?,
                    pool::PoolMode::Max,
                    [1, 2],
                    [1, 1],
                    [0, 0],
                )
            }),
        ),
        (
            "scaled_dot_product_attention",
            "scaled_dot_product_attention",
            run(|| {
                let q = x()?.unsqueeze(0)?;
                ember_core::ops::sdpa::scaled_dot_product_attention(&q, &q, &q, None, 0.0, true, None, false)
            }),
        ),
        // PyTorch's `F.multi_head_attention_forward` is Python over aten ops (no aten op of its
        // own): its projections are `linear`, its attention `scaled_dot_product_attention`.
        (
            "multi_head_attention_forward",
            "scaled_dot_product_attention",
            run(move || {
                let q = Tensor::ones([3, 1, 4], f32, d)?;
                let (w, b) = (Tensor::ones([12, 4], f32, d)?, Tensor::ones([12], f32, d)?);
                let (wo, bo) = (Tensor::ones([4, 4], f32, d)?, Tensor::ones([4], f32, d)?);
                let out = multihead_attention::multi_head_attention_forward(
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
                    None,
                    0.0,
                )?;
                Ok(out.0)
            }),
        ),
        (
            "adaptive_avg_pool2d",
            "adaptive_avg_pool2d",
            run(|| {
                let image =
                    Tensor::arange(0.0, 16.0, 1.0, DType::F32, Device::Cpu)?.reshape(&[1, 1, 4, 4])?;
                pool::adaptive_avg_pool2d(&image, [3, 3])
            }),
        ),
        // Losses.
        (
            "nll_loss",
            "nll_loss",
            run(move || {
                loss::nll_loss(
                    &x()?.log_softmax(-1)?,
                    &idx()?,
                    None,
                    -100,
                    ember_core::Reduction::Mean,
                )
            }),
        ),
        (
            "cross_entropy",
            "cross_entropy",
            run(move || {
                let logits = x()?.unsqueeze(2)?;
                let target = idx()?.unsqueeze(1)?;
                loss::cross_entropy(&logits, &target, None, -100, ember_core::Reduction::Mean, 0.1)
            }),
        ),
        (
            "mse_loss",
            "mse_loss",
            run(|| loss::mse_loss(&x()?, &x()?, ember_core::Reduction::Mean)),
        ),
        (
            "l1_loss",
            "l1_loss",
            run(|| loss::l1_loss(&x()?, &x()?, ember_core::Reduction::Sum)),
        ),
        (
            "binary_cross_entropy_with_logits",
            "binary_cross_entropy_with_logits",
            run(|| {
                loss::binary_cross_entropy_with_logits(
                    &x()?,
                    &x()?.sigmoid()?,
                    None,
                    None,
                    ember_core::Reduction::Mean,
                )
            }),
        ),
        (
            "dropout",
            "dropout",
            run(|| ember_core::ops::dropout::dropout(&x()?, 0.5, true)),
        ),
        (
            "dropout_with",
            "dropout",
            run(|| {
                let gen = ember_core::Generator::new(0);
                ember_core::ops::dropout::dropout_with(&x()?, 0.5, true, &gen)
            }),
        ),
        (
            "rnn_tanh_cell",
            "rnn_tanh_cell",
            run(|| {
                recurrent::rnn_tanh_cell(
                    &zeros(&[1, 3])?,
                    None,
                    &zeros(&[2, 3])?,
                    &zeros(&[2, 2])?,
                    None,
                    None,
                )
            }),
        ),
        (
            "rnn_relu_cell",
            "rnn_relu_cell",
            run(|| {
                recurrent::rnn_relu_cell(
                    &zeros(&[1, 3])?,
                    None,
                    &zeros(&[2, 3])?,
                    &zeros(&[2, 2])?,
                    None,
                    None,
                )
            }),
        ),
        (
            "lstm_cell",
            "lstm_cell",
            run(|| {
                let (h, _) = recurrent::lstm_cell(
                    &zeros(&[1, 3])?,
                    None,
                    &zeros(&[8, 3])?,
                    &zeros(&[8, 2])?,
                    None,
                    None,
                )?;
                Ok(h)
            }),
        ),
        (
            "gru_cell",
            "gru_cell",
            run(|| {
                recurrent::gru_cell(
                    &zeros(&[1, 3])?,
                    None,
                    &zeros(&[6, 3])?,
                    &zeros(&[6, 2])?,
                    None,
                    None,
                )
            }),
        ),
        (
            "rnn",
            "rnn_tanh",
            run(|| {
                let w = [zeros(&[2, 3])?, zeros(&[2, 2])?];
                let tanh = recurrent::RnnNonlinearity::Tanh;
                Ok(recurrent::rnn(&zeros(&[2, 1, 3])?, None, &[&w], tanh, 1, false, 0.0, false)?.0)
            }),
        ),
        (
            "lstm",
            "lstm",
            run(|| {
                let w = [zeros(&[8, 3])?, zeros(&[8, 2])?];
                Ok(recurrent::lstm(&zeros(&[2, 1, 3])?, None, &[&w], 1, false, 0.0, false)?.0)
            }),
        ),
        (
            "gru",
            "gru",
            run(|| {
                let w = [zeros(&[6, 3])?, zeros(&[6, 2])?];
                Ok(recurrent::gru(&zeros(&[2, 1, 3])?, None, &[&w], 1, false, 0.0, false)?.0)
            }),
        ),
        (
            "batch_norm",
            "batch_norm",
            run(|| {
                let stat = Tensor::ones([3], DType::F32, Device::Cpu)?;
                ember_core::ops::batch_norm::batch_norm(
                    &x()?,
                    None,
                    None,
                    Some(&stat),
                    Some(&stat),
                    false,
                    0.1,
                    1e-5,
                )
            }),
        ),
        (
            "lstm_recurrence",
            "lstm_recurrence",
            run(|| {
                let gi = Tensor::zeros([2, 1, 8], DType::F32, Device::Cpu)?;
                let w = Tensor::zeros([8, 2], DType::F32, Device::Cpu)?;
                let h = Tensor::zeros([1, 2], DType::F32, Device::Cpu)?;
                ember_core::ops::rnn::lstm_recurrence(&gi, &w, &h, &h)
            }),
        ),
        // Multi-tensor steps.
        (
            "foreach_copy_",
            "_foreach_copy_",
            Box::new(|| ember_core::foreach_copy_(&[x()?], &[x()?])),
        ),
        ("adam_", "_fused_adam_", Box::new(|| adam(false))),
        ("adam_scaled_", "_fused_adam_", Box::new(|| adam(true))),
        ("sgd_", "_fused_sgd_", Box::new(|| sgd(false))),
        ("sgd_scaled_", "_fused_sgd_", Box::new(|| sgd(true))),
        (
            "non_finite_check_and_unscale_",
            "_amp_foreach_non_finite_check_and_unscale_",
            Box::new(|| {
                let found = Tensor::zeros([1], DType::F32, Device::Cpu)?;
                let inv = Tensor::ones([1], DType::F32, Device::Cpu)?;
                amp_scaling::non_finite_check_and_unscale_(&[x()?], &found, &inv)
            }),
        ),
        (
            "add_layer_norm",
            "add_layer_norm",
            Box::new(|| fused::add_layer_norm(&x()?, &x()?, &[3], None, None, 1e-5).map(drop)),
        ),
        (
            "foreach_norm",
            "_foreach_norm",
            Box::new(|| amp_scaling::foreach_norm(&[x()?, x()?], 2.0).map(drop)),
        ),
        (
            "foreach_mul_",
            "_foreach_mul_",
            Box::new(|| {
                let half = Tensor::from_slice(&[0.5f32], [1], Device::Cpu)?;
                amp_scaling::foreach_mul_(&[x()?], &half)
            }),
        ),
        (
            "update_scale_",
            "_amp_update_scale_",
            Box::new(|| {
                let scale = Tensor::ones([1], DType::F32, Device::Cpu)?;
                let tracker = Tensor::zeros([1], DType::I32, Device::Cpu)?;
                let found = Tensor::zeros([1], DType::F32, Device::Cpu)?;
                amp_scaling::update_scale_(&scale, &tracker, &found, 2.0, 0.5, 2000)
            }),
        ),
    ]
}

fn adam(scaled: bool) -> Result<()> {
    let (p, g, m, v) = (x()?, x()?, x()?.zeros_like()?, x()?.zeros_like()?);
    let cfg = fused::AdamStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: false,
    };
    if scaled {
        let step = Tensor::zeros([], DType::F32, Device::Cpu)?;
        let steps = fused::AdamSteps::Device(std::slice::from_ref(&step));
        fused::adam_scaled_(
            &[p],
            &[g],
            &[m],
            &[v],
            None,
            steps,
            &cfg,
            fused::GradScaling::default(),
            None,
        )
    } else {
        fused::adam_(&[p], &[g], &[m], &[v], None, &[1.0], &cfg)
    }
}

fn sgd(scaled: bool) -> Result<()> {
    let (p, g) = (x()?, x()?);
    let cfg = fused::SgdStep {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        maximize: false,
        first_step: false,
    };
    if scaled {
        fused::sgd_scaled_(&[p], &[g], None, &cfg, fused::GradScaling::default(), None)
    } else {
        fused::sgd_(&[p], &[g], None, &cfg)
    }
}

/// Every source file of the op layer is read above: where the sources are at hand (a
/// checkout, CI), a file of `ops/` or `tensor/` missing from [`SOURCES`] fails here.
fn check_sources_are_complete() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !src.is_dir() {
        return; // a test binary carried to another machine: the names below are still checked
    }
    for dir in ["ops", "tensor"] {
        for entry in std::fs::read_dir(src.join(dir)).expect("the source folder is readable") {
            let name = format!(
                "{dir}/{}",
                entry.expect("a folder entry").file_name().to_string_lossy()
            );
            if name.ends_with(".rs") {
                assert!(
                    SOURCES.iter().any(|(path, _)| *path == name),
                    "{name} is not among door.rs's SOURCES: add it"
                );
            }
        }
    }
}

#[test]
fn every_public_function_of_the_op_layer_is_listed() {
    check_sources_are_complete();
    let listed: BTreeSet<&str> = runs()
        .iter()
        .map(|(f, _, _)| *f)
        .chain(NOT_OPS.iter().map(|(f, _)| *f))
        .chain(["pin_memory"])
        .collect();
    let public = public_functions(SOURCES);
    assert!(
        public.len() > 150,
        "the scan found only {} functions",
        public.len()
    );
    let unlisted: Vec<_> = public.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "public functions of the op layer neither run through the door in `runs` nor listed in NOT_OPS: {unlisted:?}"
    );
    let gone: Vec<_> = listed.difference(&public).collect();
    assert!(
        gone.is_empty(),
        "listed but not public functions of the op layer: {gone:?}"
    );
}

#[test]
fn every_public_op_passes_the_dispatch_point_under_its_name() {
    let mut missed = Vec::new();
    for (function, op, f) in runs() {
        let (result, names) = seen(f);
        if let Err(e) = result {
            missed.push(format!("{function}: failed ({e})"));
        } else if !names.contains(&op) {
            missed.push(format!("{function}: `{op}` not seen (saw {names:?})"));
        }
    }
    assert!(
        missed.is_empty(),
        "ops that went round the door:\n{}",
        missed.join("\n")
    );
}

#[test]
fn every_unary_table_line_passes_the_dispatch_point_under_its_name() -> Result<()> {
    let x = Tensor::from_vec(vec![0.25f64, 0.5, 0.75], [3], Device::Cpu)?;
    for &op in UnaryOp::ALL {
        let (result, names) = seen(|| x.unary_op(op).map(drop));
        result?;
        let name = op.line().name;
        assert!(names.contains(&name), "{name}: not seen (saw {names:?})");
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn pin_memory_and_the_gpu_copies_pass_the_dispatch_point() -> Result<()> {
    let gpu = crate::common::gpu();
    let mut pinned = None;
    let (result, names) = seen(|| {
        pinned = Some(x()?.pin_memory()?);
        Ok(())
    });
    result?;
    assert!(names.contains(&"pin_memory"), "saw {names:?}");
    let pinned = pinned.expect("pinned above");
    let (result, names) = seen(|| pinned.to_non_blocking(gpu).map(drop));
    result?;
    assert!(names.contains(&"to"), "saw {names:?}");
    let dst = Tensor::zeros([2, 3], DType::F32, gpu)?;
    let (result, names) = seen(|| dst.copy_non_blocking_(&pinned).map(drop));
    result?;
    assert!(names.contains(&"copy_"), "saw {names:?}");
    assert_eq!(dst.to_vec::<f32>()?, x()?.to_vec::<f32>()?);
    Ok(())
}
