//! Autocast and the dispatch point: every line of the op table (`ember_core::dispatch::policy`)
//! is checked against PyTorch's autocast lists (written out here, from
//! `aten/src/ATen/autocast_mode.cpp`, independently of the table) by running the op under
//! autocast and looking at the dtype it gives, with an observer confirming that the op passed
//! the dispatch point under its own name; plus the cast cache, nesting, thread-locality and
//! observer nesting.

use crate::common;
use ember_core::amp::{self, Autocast};
use ember_core::dispatch::observer::{self, Observer, OpEnter, OpExit};
use ember_core::dispatch::{policy, CastPolicy};
use ember_core::{fused, DType, Device, DeviceType, Result, Tensor};
use ember_nn::functional as F;
use ember_nn::functional::{Pair, Reduction};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

/// PyTorch's `lower_precision_fp` list, for the ops ember has.
const LOWER: &[&str] = &[
    "matmul",
    "mm",
    "bmm",
    "linear",
    "conv1d",
    "conv2d",
    "scaled_dot_product_attention",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
];

/// PyTorch's `fp32`, `fp32_set_opt_dtype` and `fp32_append_dtype` lists, for the ops ember has.
const FP32: &[&str] = &[
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "reciprocal",
    "rsqrt",
    "tan",
    "asin",
    "acos",
    "sinh",
    "cosh",
    "pow",
    "softplus",
    "softmax",
    "log_softmax",
    "sum",
    "prod",
    "norm",
    "logsumexp",
    "layer_norm",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "binary_cross_entropy_with_logits",
];

/// PyTorch's `promote` list, for the ops ember has.
const PROMOTE: &[&str] = &["scatter_add"];

/// Records the names of the ops entering the dispatch point on one thread, with their depth.
struct Recorder {
    thread: ThreadId,
    seen: Mutex<Vec<(&'static str, usize)>>,
}

impl Observer for Recorder {
    fn on_enter(&self, e: &OpEnter<'_>) {
        if e.thread == self.thread {
            self.seen.lock().unwrap().push((e.op.name, e.depth));
        }
    }
    fn on_exit(&self, _: &OpExit) {}
}

fn record<T>(f: impl FnOnce() -> T) -> (T, Vec<(&'static str, usize)>) {
    let rec = Arc::new(Recorder {
        thread: std::thread::current().id(),
        seen: Mutex::new(Vec::new()),
    });
    let handle = observer::add_observer(rec.clone());
    let out = f();
    drop(handle);
    let seen = rec.seen.lock().unwrap().clone();
    (out, seen)
}

/// Runs the op of table line `name` on small inputs whose floating operands have dtype `d`
/// (the second operand of two-operand ops has dtype `d2`), returning its (first) output.
fn run(name: &str, d: DType, d2: DType, dev: Device) -> Result<Tensor> {
    let x = Tensor::rand([2, 4], DType::F64, dev)?
        .add_scalar(0.5)?
        .to_dtype(d)?;
    let y = Tensor::rand([2, 4], DType::F64, dev)?
        .add_scalar(0.5)?
        .to_dtype(d2)?;
    let sq = |t: DType| -> Result<Tensor> { Tensor::rand([4, 4], DType::F64, dev)?.to_dtype(t) };
    let idx = Tensor::from_vec(vec![1i64, 0], [2], dev)?;
    let idx2 = Tensor::from_vec(vec![0i64, 3, 1, 2, 3, 0, 1, 2], [2, 4], dev)?;
    let cls = Tensor::from_vec(vec![1i64, 3], [2], dev)?;
    let seq = Tensor::rand([3, 2, 4], DType::F64, dev)?.to_dtype(d)?;
    let rnn_w = |gates: usize| -> Result<Vec<Tensor>> {
        let w = || -> Result<Tensor> { Tensor::rand([4 * gates, 4], DType::F64, dev)?.to_dtype(d2) };
        Ok(vec![
            w()?,
            w()?,
            Tensor::zeros([4 * gates], d2, dev)?,
            Tensor::zeros([4 * gates], d2, dev)?,
        ])
    };
    match name {
        "matmul" => x.matmul(&sq(d2)?),
        "mm" => x.mm(&sq(d2)?),
        "bmm" => x.unsqueeze(0)?.bmm(&sq(d2)?.unsqueeze(0)?),
        "linear" => x.linear(&sq(d2)?, Some(&Tensor::zeros([4], d2, dev)?)),
        "conv1d" => F::conv1d(&x.unsqueeze(0)?, &sq(d2)?.reshape(&[4, 2, 2])?, None, 1, 0, 1, 1),
        "conv2d" => F::conv2d(
            &x.reshape(&[1, 2, 2, 2])?,
            &sq(d2)?.reshape(&[2, 2, 2, 2])?,
            None,
            Pair([1, 1]),
            Pair([0, 0]),
            Pair([1, 1]),
            1,
        ),
        "scaled_dot_product_attention" => F::scaled_dot_product_attention(&x, &y, &y),
        "_scaled_dot_product_cudnn_attention" => {
            // Its line casts nothing (it runs inside `scaled_dot_product_attention`, after that
            // line's cast). Where it does not run the problem (the CPU, float32 or mixed
            // dtypes), the math path with autocast off stands for it, as the caller does.
            let (q, k) = (x.reshape(&[1, 1, 2, 4])?, y.reshape(&[1, 1, 2, 4])?);
            match ember_core::ops::attention::scaled_dot_product_cudnn_attention(&q, &k, &k, false, 0.5)? {
                Some(out) => Ok(out),
                None => {
                    let _off = amp::Autocast::new(dev.device_type()).enabled(false).enter()?;
                    F::scaled_dot_product_attention(&q, &k, &k)
                }
            }
        }
        "lstm" | "gru" | "rnn_tanh" | "rnn_relu" => {
            let gates = match name {
                "lstm" => 4,
                "gru" => 3,
                _ => 1,
            };
            let w = rnn_w(gates)?;
            let layers: Vec<&[Tensor]> = vec![&w];
            match name {
                "lstm" => Ok(F::lstm(&seq, None, &layers, 1, false, 0.0, false)?.0),
                "gru" => Ok(F::gru(&seq, None, &layers, 1, false, 0.0, false)?.0),
                "rnn_tanh" => Ok(F::rnn(
                    &seq,
                    None,
                    &layers,
                    F::RnnNonlinearity::Tanh,
                    1,
                    false,
                    0.0,
                    false,
                )?
                .0),
                _ => Ok(F::rnn(
                    &seq,
                    None,
                    &layers,
                    F::RnnNonlinearity::Relu,
                    1,
                    false,
                    0.0,
                    false,
                )?
                .0),
            }
        }
        "lstm_cell" => {
            let w = rnn_w(4)?;
            Ok(F::lstm_cell(&x, None, &w[0], &w[1], Some(&w[2]), Some(&w[3]))?.0)
        }
        "gru_cell" => {
            let w = rnn_w(3)?;
            F::gru_cell(&x, None, &w[0], &w[1], Some(&w[2]), Some(&w[3]))
        }
        "rnn_tanh_cell" | "rnn_relu_cell" => {
            let w = rnn_w(1)?;
            let f = if name == "rnn_tanh_cell" {
                F::rnn_tanh_cell
            } else {
                F::rnn_relu_cell
            };
            f(&x, None, &w[0], &w[1], Some(&w[2]), Some(&w[3]))
        }
        "exp" => x.exp(),
        "expm1" => x.expm1(),
        "log" => x.log(),
        "log2" => x.log2(),
        "log10" => x.log10(),
        "log1p" => x.log1p(),
        "reciprocal" => x.reciprocal(),
        "rsqrt" => x.rsqrt(),
        "tan" => x.tan(),
        "asin" => x.mul_scalar(0.1)?.asin(),
        "acos" => x.mul_scalar(0.1)?.acos(),
        "sinh" => x.sinh(),
        "cosh" => x.cosh(),
        "pow" => x.pow(&y),
        "softplus" => x.softplus(),
        "softmax" => x.softmax(-1),
        "log_softmax" => x.log_softmax(-1),
        "sum" => x.sum_all(),
        "prod" => x.prod_all(),
        "norm" => x.norm(2.0, &[], false),
        "logsumexp" => x.logsumexp(&[1], false),
        "layer_norm" => F::layer_norm(&x, &[4], Some(&Tensor::ones([4], d2, dev)?), None, 1e-5),
        "cross_entropy" => F::cross_entropy(&x, &cls),
        "nll_loss" => F::nll_loss(&x, &cls, None, -100, Reduction::Mean),
        "nll_loss_forward" => x.nll_loss_forward(&cls, None, true, -100),
        "mse_loss" => F::mse_loss(&x, &y, Reduction::Mean),
        "l1_loss" => F::l1_loss(&x, &y, Reduction::Mean),
        "binary_cross_entropy_with_logits" => {
            F::binary_cross_entropy_with_logits(&x, &y.mul_scalar(0.5)?, None, None, Reduction::Mean)
        }
        "scatter_add" => x.scatter_add(1, &idx2, &y),
        "add" => x.add(&y),
        "sub" => x.sub(&y),
        "mul" => x.mul(&y),
        "div" => x.div(&y),
        "maximum" => x.maximum(&y),
        "minimum" => x.minimum(&y),
        "eq" => x.eq(&y),
        "ne" => x.ne(&y),
        "lt" => x.lt(&y),
        "le" => x.le(&y),
        "gt" => x.gt(&y),
        "ge" => x.ge(&y),
        "logical_and" => x.logical_and(&y),
        "logical_or" => x.logical_or(&y),
        "logical_xor" => x.logical_xor(&y),
        "where" => Tensor::where_cond(&x.gt_scalar(0.7)?, &x, &y),
        "clamp" => x.clamp(Some(0.6), Some(1.2)),
        "neg" => x.neg(),
        "abs" => x.abs(),
        "sign" => x.sign(),
        "square" => x.square(),
        "sqrt" => x.sqrt(),
        "exp2" => x.exp2(),
        "sin" => x.sin(),
        "cos" => x.cos(),
        "atan" => x.atan(),
        "tanh" => x.tanh(),
        "erf" => x.erf(),
        "erfc" => x.erfc(),
        "erfinv" => x.erfinv(),
        "xlogy" => x.xlogy(&y),
        "gelu_backward" => x.gelu_backward(&y),
        "gelu_tanh_backward" => x.gelu_tanh_backward(&y),
        // In-place forms: PyTorch's autocast leaves them alone (the result keeps x's dtype).
        "add_" => x.add_(&y),
        "sub_" => x.sub_(&y),
        "mul_" => x.mul_(&y),
        "div_" => x.div_(&y),
        "pow_" => x.pow_(&y),
        "maximum_" => x.maximum_(&y),
        "minimum_" => x.minimum_(&y),
        "xlogy_" => x.xlogy_(&y),
        "floor" => x.floor(),
        "ceil" => x.ceil(),
        "round" => x.round(),
        "trunc" => x.trunc(),
        "sigmoid" => x.sigmoid(),
        "logsigmoid" => x.logsigmoid(),
        "relu" => x.relu(),
        "leaky_relu" => x.leaky_relu(0.1),
        "elu" => x.elu(1.0),
        "hardtanh" => x.hardtanh(-1.0, 1.0),
        "hardsigmoid" => x.hardsigmoid(),
        "hardswish" => x.hardswish(),
        "gelu" => x.gelu(),
        "gelu_tanh" => x.gelu_tanh(),
        "silu" => x.silu(),
        "mish" => x.mish(),
        "softsign" => x.softsign(),
        "mean" => x.mean_all(),
        "max" => x.max_all(),
        "min" => x.min_all(),
        "amax" => x.amax(&[1], false),
        "amin" => x.amin(&[1], false),
        "argmax" => x.argmax(Some(1), false),
        "argmin" => x.argmin(Some(1), false),
        "var" => x.var(&[1], 1.0, false),
        "std" => x.std(&[1], 1.0, false),
        "index_select" => x.index_select(0, &idx),
        "gather" => x.gather(1, &idx2),
        "scatter" => x.scatter(1, &idx2, &y),
        "index_add" => x.index_add(0, &idx, &y),
        "embedding" => Tensor::embedding(&idx, &x),
        "one_hot" => idx.one_hot(3),
        "cat" => Tensor::cat(&[x, y], 0),
        "max_pool2d" => F::max_pool2d(
            &x.reshape(&[1, 2, 2, 2])?,
            Pair([2, 2]),
            Pair([2, 2]),
            Pair([0, 0]),
        ),
        "avg_pool2d" => F::avg_pool2d(
            &x.reshape(&[1, 2, 2, 2])?,
            Pair([2, 2]),
            Pair([2, 2]),
            Pair([0, 0]),
        ),
        "batch_norm" => {
            let c = x.reshape(&[2, 4, 1])?;
            let (rm, rv) = (Tensor::zeros([4], d2, dev)?, Tensor::ones([4], d2, dev)?);
            F::batch_norm(&c, Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)
        }
        "dropout" => F::dropout(&x, 0.5, true),
        // A cast to another dtype (a cast to the same one returns the tensor untouched).
        "to" => x.to_dtype(if d == DType::F64 { DType::F32 } else { DType::F64 }),
        "copy_" => Tensor::zeros([2, 4], d2, dev)?.copy_(&x),
        "_foreach_copy_" => {
            let dst = Tensor::zeros([2, 4], d2, dev)?;
            ember_core::foreach_copy_(std::slice::from_ref(&dst), std::slice::from_ref(&x))?;
            Ok(dst)
        }
        "fill_" => x.fill_(1.0),
        "view" => x.view(&[8]),
        "reshape" => x.reshape(&[4, 2]),
        "permute" => x.permute(&[1, 0]),
        "transpose" => x.transpose(0, 1),
        "narrow" => x.narrow(1, 1, 2),
        "slice" => x.slice(1, 0, 4, 2),
        "select" => x.select(0, 1),
        "unsqueeze" => x.unsqueeze(0),
        "squeeze" => x.unsqueeze(0)?.squeeze_dim(0),
        "expand" => x.unsqueeze(0)?.expand(&[3, 2, 4]),
        "lstm_recurrence" => {
            let gi = Tensor::rand([3, 2, 16], DType::F64, dev)?.to_dtype(d)?;
            let w_hh = Tensor::rand([16, 4], DType::F64, dev)?.to_dtype(d)?;
            let h0 = Tensor::zeros([2, 4], d, dev)?;
            ember_core::ops::rnn::lstm_recurrence(&gi, &w_hh, &h0, &h0)
        }
        "_fused_adam_" | "_fused_sgd_" => {
            let _g = ember_core::no_grad();
            let (p, g) = (x.deep_clone()?, x.ones_like()?);
            if name == "_fused_adam_" {
                let (m, v) = (x.zeros_like()?, x.zeros_like()?);
                let step = fused::AdamStep {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    amsgrad: false,
                    maximize: false,
                    decoupled_weight_decay: false,
                };
                fused::adam_(&[p.clone()], &[g], &[m], &[v], None, &[1.0], &step)?;
            } else {
                let step = fused::SgdStep {
                    lr: 0.1,
                    momentum: 0.0,
                    dampening: 0.0,
                    nesterov: false,
                    weight_decay: 0.0,
                    maximize: false,
                    first_step: true,
                };
                fused::sgd_(&[p.clone()], &[g], None, &step)?;
            }
            Ok(p)
        }
        other => panic!("no runner for op table line {other:?}: add one to this test"),
    }
}

/// PyTorch's dtype for op `name` under `autocast` to `lower`, given what the op gives
/// without autocast (`plain`) on operands of dtypes `d` and `d2`.
fn pytorch_dtype(name: &str, lower: DType, plain: DType, d: DType, d2: DType) -> DType {
    let eligible = |t: DType| t.is_floating_point() && t != DType::F64;
    if LOWER.contains(&name) {
        if eligible(d) || eligible(d2) {
            // Eligible operands are cast; a float64 operand is not (and then wins promotion).
            if d == DType::F64 || d2 == DType::F64 {
                DType::F64
            } else {
                lower
            }
        } else {
            plain
        }
    } else if FP32.contains(&name) {
        if plain.is_floating_point() && plain != DType::F64 {
            DType::F32
        } else {
            plain
        }
    } else if PROMOTE.contains(&name) {
        if eligible(d) || eligible(d2) {
            [d, d2]
                .into_iter()
                .filter(|&t| eligible(t))
                .fold(lower, DType::promote)
        } else {
            plain
        }
    } else {
        plain
    }
}

fn check_every_line(dev: Device, lower: DType) {
    let dt = dev.device_type();
    let mut bad = Vec::new();
    for op in policy::all() {
        // The table agrees with PyTorch's lists.
        let listed = if LOWER.contains(&op.name) {
            CastPolicy::LowerPrecision
        } else if FP32.contains(&op.name) {
            CastPolicy::Fp32
        } else if PROMOTE.contains(&op.name) {
            CastPolicy::Promote
        } else {
            CastPolicy::Inputs
        };
        if op.autocast != listed {
            bad.push(format!(
                "{}: table says {:?}, PyTorch's lists {:?}",
                op.name, op.autocast, listed
            ));
        }
        // The op gives PyTorch's dtype, for float32, lower-precision and mixed operands.
        for (d, d2) in [
            (DType::F32, DType::F32),
            (lower, lower),
            (lower, DType::F32),
            (DType::F64, DType::F64),
        ] {
            let plain = run(op.name, d, d2, dev).map(|t| t.dtype());
            let (got, seen) = record(|| {
                let _ac = amp::autocast(dt, lower).unwrap();
                run(op.name, d, d2, dev)
            });
            match (plain, got) {
                (Ok(plain), Ok(t)) => {
                    let expected = pytorch_dtype(op.name, lower, plain, d, d2);
                    if t.dtype() != expected {
                        bad.push(format!(
                            "{} on ({d}, {d2}): {} under autocast, PyTorch {expected}",
                            op.name,
                            t.dtype()
                        ));
                    }
                }
                // Ops that refuse mixed operands refuse them under autocast too, unless autocast
                // casts them to one dtype.
                (Err(_), Err(_)) if listed == CastPolicy::Inputs => {}
                (Err(_), Ok(t)) if listed != CastPolicy::Inputs => {
                    let expected = pytorch_dtype(op.name, lower, d.promote(d2), d, d2);
                    if t.dtype() != expected {
                        bad.push(format!(
                            "{} on ({d}, {d2}): {} under autocast, PyTorch {expected}",
                            op.name,
                            t.dtype()
                        ));
                    }
                }
                (_, Err(e)) => bad.push(format!("{} on ({d}, {d2}) under autocast: {e}", op.name)),
                (Err(e), Ok(_)) => bad.push(format!(
                    "{} on ({d}, {d2}) fails without autocast ({e}) but runs under it",
                    op.name
                )),
            }
            if !seen.iter().any(|&(n, _)| n == op.name) {
                bad.push(format!(
                    "{} did not pass the dispatch point under its name (saw {seen:?})",
                    op.name
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{} problems:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn every_op_table_line_gives_pytorchs_dtype_on_cpu() {
    check_every_line(Device::Cpu, DType::BF16);
    check_every_line(Device::Cpu, DType::F16);
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_op_table_line_gives_pytorchs_dtype_on_cuda() {
    let dev = common::gpu();
    check_every_line(dev, DType::F16);
    check_every_line(dev, DType::BF16);
}

#[test]
fn a_parameter_is_cast_once_per_region() -> Result<()> {
    let w = Tensor::randn([4, 4], DType::F32, Device::Cpu)?.requires_grad_(true)?;
    let (a, b) = (
        Tensor::randn([2, 4], DType::F32, Device::Cpu)?,
        Tensor::randn([3, 4], DType::F32, Device::Cpu)?,
    );
    let loss = {
        let _ac = amp::autocast(DeviceType::Cpu, DType::BF16)?;
        let ya = a.matmul(&w)?;
        let yb = b.matmul(&w)?;
        // One cast of `w` serves both products.
        assert_eq!(amp::autocast_cache_len(), 1);
        // Inputs that are not leaves requiring grad are not cached.
        let _ = a.exp()?.matmul(&a.t()?)?;
        assert_eq!(amp::autocast_cache_len(), 1);
        ya.to_dtype(DType::F32)?
            .sum_all()?
            .add(&yb.to_dtype(DType::F32)?.sum_all()?)?
    };
    assert_eq!(
        amp::autocast_cache_len(),
        0,
        "closing the outermost region empties the cache"
    );
    loss.backward()?;
    // d/dw Σ(a w) + Σ(b w) = (Σ rows of a + Σ rows of b) as a column, broadcast: both uses reach w.
    let g = w.grad().expect("w has a gradient");
    let col = a.sum_dim(0, false)?.add(&b.sum_dim(0, false)?)?;
    let expected = col.unsqueeze(1)?.expand(&[4, 4])?;
    let (g, e) = (g.to_vec::<f32>()?, expected.contiguous()?.to_vec::<f32>()?);
    for (x, y) in g.iter().zip(&e) {
        assert!((x - y).abs() <= 0.05 * y.abs().max(1.0), "gradient {x} vs {y}");
    }
    // Without the cache, nothing is kept.
    {
        let _ac = Autocast::new(DeviceType::Cpu)
            .dtype(DType::BF16)
            .cache_enabled(false)
            .enter()?;
        let _ = a.matmul(&w)?;
        assert_eq!(amp::autocast_cache_len(), 0);
    }
    Ok(())
}

#[test]
fn regions_nest_and_restore() -> Result<()> {
    let (a, b) = (
        Tensor::ones([2, 2], DType::F32, Device::Cpu)?,
        Tensor::ones([2, 2], DType::F32, Device::Cpu)?,
    );
    assert!(!amp::is_autocast_enabled(DeviceType::Cpu));
    assert_eq!(amp::get_autocast_dtype(DeviceType::Cpu), DType::BF16);
    assert_eq!(amp::get_autocast_dtype(DeviceType::Cuda), DType::F16);
    {
        let _outer = amp::autocast(DeviceType::Cpu, DType::F16)?;
        assert!(amp::is_autocast_enabled(DeviceType::Cpu));
        assert!(
            !amp::is_autocast_enabled(DeviceType::Cuda),
            "CUDA autocast is separate"
        );
        assert_eq!(a.matmul(&b)?.dtype(), DType::F16);
        {
            let _off = Autocast::new(DeviceType::Cpu).enabled(false).enter()?;
            assert!(!amp::is_autocast_enabled(DeviceType::Cpu));
            assert_eq!(a.matmul(&b)?.dtype(), DType::F32);
            {
                let _bf = amp::autocast(DeviceType::Cpu, DType::BF16)?;
                assert_eq!(a.matmul(&b)?.dtype(), DType::BF16);
            }
            assert_eq!(a.matmul(&b)?.dtype(), DType::F32);
        }
        assert_eq!(a.matmul(&b)?.dtype(), DType::F16);
        assert_eq!(amp::get_autocast_dtype(DeviceType::Cpu), DType::F16);
        // Another thread does not see this thread's region.
        let other = std::thread::spawn(move || a.matmul(&b).map(|t| t.dtype()))
            .join()
            .unwrap()?;
        assert_eq!(other, DType::F32);
    }
    assert!(!amp::is_autocast_enabled(DeviceType::Cpu));
    assert_eq!(amp::get_autocast_dtype(DeviceType::Cpu), DType::BF16);
    // Autocast to float32 or an integer dtype is refused.
    assert!(amp::autocast(DeviceType::Cuda, DType::F32).is_err());
    Ok(())
}

#[test]
fn composite_ops_are_one_op_with_their_inner_ops_nested() -> Result<()> {
    // mse_loss is a composite (layer_norm, once one, is a fused op of its own now).
    let x = Tensor::randn([3, 4], DType::F32, Device::Cpu)?;
    let t = Tensor::randn([3, 4], DType::F32, Device::Cpu)?;
    let (y, seen) = record(|| F::mse_loss(&x, &t, Reduction::Mean));
    y?;
    assert_eq!(seen.first(), Some(&("mse_loss", 0)), "{seen:?}");
    assert!(
        seen.len() > 1 && seen[1..].iter().all(|&(_, depth)| depth >= 1),
        "{seen:?}"
    );
    // Under autocast the inner ops keep float32: the composite suspends autocast for its body.
    let (h, ht) = (x.to_dtype(DType::BF16)?, t.to_dtype(DType::BF16)?);
    let y = {
        let _ac = amp::autocast(DeviceType::Cpu, DType::BF16)?;
        F::mse_loss(&h, &ht, Reduction::Mean)?
    };
    assert_eq!(y.dtype(), DType::F32);
    // The fused layer_norm is one op under its name, and autocast runs it in float32.
    let (y, seen) = record(|| F::layer_norm(&x, &[4], None, None, 1e-5));
    y?;
    assert_eq!(seen, vec![("layer_norm", 0)]);
    let y = {
        let _ac = amp::autocast(DeviceType::Cpu, DType::BF16)?;
        F::layer_norm(&h, &[4], None, None, 1e-5)?
    };
    assert_eq!(y.dtype(), DType::F32);
    Ok(())
}

#[test]
fn out_forms_enter_the_dispatch_point_as_their_op() -> Result<()> {
    let a = Tensor::randn([3, 4], DType::F32, Device::Cpu)?;
    let b = Tensor::randn([4], DType::F64, Device::Cpu)?;
    let out = Tensor::zeros([3, 4], DType::F64, Device::Cpu)?;
    let (r, seen) = record(|| a.add_out(&b, &out));
    r?;
    // The promotion cast of `a` is its own op, then `add` enters.
    assert_eq!(seen, [("to", 0), ("add", 0)]);
    // Promoted like the plain op: float32 + float64 lands in the float64 `out`.
    let expected = a.to_dtype(DType::F64)?.add(&b)?;
    assert_eq!(out.to_vec::<f64>()?, expected.to_vec::<f64>()?);
    Ok(())
}
