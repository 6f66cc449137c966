//! The property-based bad-input suite (issue 14): random shapes (empty, 0-d, size 1, sizes near
//! the address-space limit), dims (in and out of range), dtypes, sizes and values (NaN, ±inf,
//! i64::MAX after a cast) through every public op family on the CPU. Every call must return
//! `Ok` or a typed `Err`, never panic; a result that says `Ok` must be readable.
//!
//! Runs in CI with a fixed seed and [`DEFAULT_CASES`] cases per family; more on demand:
//! `PROPTEST_CASES=5000 cargo test -p ember-core --test it props::` (and `PROPTEST_RNG_SEED=N`
//! for another fixed seed). Huge sizes only reach ops that fail fast (a view, or an output that
//! is refused before any work): a reduction over an expanded 2^40-element view would be slow, not
//! wrong, in PyTorch as in ember.

use ember_core::backend::PoolMode;
use ember_core::ops::conv::{convolution, unfold};
use ember_core::ops::pool::pool2d;
use ember_core::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestCaseError};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Cases per family in CI (each case makes dozens of op calls).
const DEFAULT_CASES: u32 = 1000;
/// The fixed seed of CI runs.
const DEFAULT_SEED: u64 = 14;

const CPU: Device = Device::Cpu;

const DTYPES: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool,
];

fn config() -> ProptestConfig {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    ProptestConfig {
        cases: env("PROPTEST_CASES").map_or(DEFAULT_CASES, |c| c as u32),
        rng_seed: RngSeed::Fixed(env("PROPTEST_RNG_SEED").unwrap_or(DEFAULT_SEED)),
        failure_persistence: None,
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    }
}

/// Sizes near the address-space limit: every tensor of them is refused or out of memory.
const HUGE: [usize; 3] = [1 << 40, 1 << 62, usize::MAX];

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![12 => 0usize..4, 2 => Just(5usize), 1 => proptest::sample::select(HUGE.to_vec())]
}

fn small_size() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..4, Just(5usize)]
}

fn dim() -> impl Strategy<Value = isize> {
    prop_oneof![8 => -4isize..4, 1 => -9isize..9, 1 => Just(isize::MIN), 1 => Just(isize::MAX)]
}

fn isize_size() -> impl Strategy<Value = isize> {
    prop_oneof![8 => -1isize..6, 1 => Just(-7isize), 1 => Just(1isize << 40), 1 => Just(isize::MAX)]
}

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DTYPES.to_vec())
}

/// The values a tensor is filled with.
#[derive(Debug, Clone, Copy)]
enum Fill {
    Range,
    Special,
    SmallInts,
}

fn fill() -> impl Strategy<Value = Fill> {
    prop_oneof![Just(Fill::Range), Just(Fill::Special), Just(Fill::SmallInts)]
}

/// A tensor to make: its shape, dtype, values, and whether it is a transposed view.
#[derive(Debug, Clone)]
struct Spec {
    dims: Vec<usize>,
    dtype: DType,
    fill: Fill,
    transposed: bool,
}

fn spec_with(sizes: impl Strategy<Value = usize>) -> impl Strategy<Value = Spec> {
    (
        proptest::collection::vec(sizes, 0..5),
        dtype(),
        fill(),
        any::<bool>(),
    )
        .prop_map(|(dims, dtype, fill, transposed)| Spec {
            dims,
            dtype,
            fill,
            transposed,
        })
}

/// A small tensor: at most 5^4 elements, so every op may compute on it.
fn small() -> impl Strategy<Value = Spec> {
    spec_with(small_size())
}

/// Any shape, huge ones included.
fn any_shape() -> impl Strategy<Value = Spec> {
    spec_with(size())
}

/// Runs `f`; a panic fails the property with `what` and the panic's message.
fn call<T>(what: &str, f: impl FnOnce() -> Result<T>) -> std::result::Result<Option<T>, TestCaseError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(Some(v)),
        Ok(Err(e)) => {
            // A typed error with a message that says something.
            let msg = e.to_string();
            prop_assert!(msg.len() > 10, "{what}: empty error message {e:?}");
            if let Error::OutOfMemory { requested, .. } = e {
                prop_assert!(requested > 0, "{what}: {msg}");
            }
            Ok(None)
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(TestCaseError::fail(format!("{what} panicked: {msg}")))
        }
    }
}

/// Runs `f` and, when it returns a tensor, checks that the tensor is consistent and readable.
fn op(what: &str, f: impl FnOnce() -> Result<Tensor>) -> std::result::Result<Option<Tensor>, TestCaseError> {
    let t = call(what, f)?;
    if let Some(t) = &t {
        check_tensor(what, t)?;
    }
    Ok(t)
}

fn ops(what: &str, f: impl FnOnce() -> Result<Vec<Tensor>>) -> std::result::Result<(), TestCaseError> {
    if let Some(ts) = call(what, f)? {
        for t in &ts {
            check_tensor(what, t)?;
        }
    }
    Ok(())
}

/// An `Ok` tensor: numel is the product of its dims, and a small one reads back in full.
fn check_tensor(what: &str, t: &Tensor) -> std::result::Result<(), TestCaseError> {
    let numel = t.dims().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    prop_assert_eq!(numel, Some(t.numel()), "{}: shape {:?}", what, t.dims());
    if t.numel() <= 4096 {
        let v = call(&format!("{what} read back"), || t.to_vec_f64())?;
        prop_assert_eq!(v.map(|v| v.len()), Some(t.numel()), "{}: read back", what);
    }
    Ok(())
}

/// The tensor `s` describes, or `None` where its shape cannot exist (an error, checked).
fn make(s: &Spec) -> std::result::Result<Option<Tensor>, TestCaseError> {
    let numel = s.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let t = match numel {
        Some(n) if n <= 4096 => {
            let values: Vec<f64> = (0..n)
                .map(|i| match s.fill {
                    Fill::Range => i as f64 - 2.0,
                    Fill::Special => [f64::NAN, f64::INFINITY, -0.0, f64::NEG_INFINITY, 1e308, -3.5][i % 6],
                    Fill::SmallInts => (i * 7 % 5) as f64 - 1.0,
                })
                .collect();
            // A shape of few elements can still have an extent too large ([0, 2^62, 2^62]).
            let Some(base) = call("from_vec", || Tensor::from_vec(values, s.dims.as_slice(), CPU))? else {
                return Ok(None);
            };
            call("to_dtype", || base.to_dtype(s.dtype))?.expect("every cast is defined")
        }
        // Huge: a broadcast view of one element (creation of the full tensor is checked too).
        _ => {
            call("zeros (huge)", || Tensor::zeros(s.dims.as_slice(), s.dtype, CPU))?;
            let one = Tensor::ones([], s.dtype, CPU).expect("a scalar");
            let sizes: Vec<isize> = s.dims.iter().map(|&d| d as isize).collect();
            match op("expand (huge)", || one.expand(&sizes))? {
                Some(t) => t,
                None => return Ok(None),
            }
        }
    };
    if s.transposed && t.rank() >= 2 {
        return op("transpose", || t.transpose(0, -1));
    }
    Ok(Some(t))
}

/// Creation from sizes and ranges.
fn creation(s: &Spec, n: usize, f: f64) -> std::result::Result<(), TestCaseError> {
    let shape = s.dims.as_slice();
    op("zeros", || Tensor::zeros(shape, s.dtype, CPU))?;
    op("full", || Tensor::full(shape, f, s.dtype, CPU))?;
    op("rand", || Tensor::rand(shape, s.dtype, CPU))?;
    op("randn", || Tensor::randn(shape, s.dtype, CPU))?;
    op("normal", || Tensor::normal(f, f.abs(), shape, s.dtype, CPU))?;
    op("randint", || Tensor::randint(-3, n as i64, shape, CPU))?;
    op("randperm", || Tensor::randperm(n, CPU))?;
    op("eye", || Tensor::eye(n, s.dtype, CPU))?;
    op("linspace", || Tensor::linspace(-f, f, n, s.dtype, CPU))?;
    op("arange", || Tensor::arange(0.0, n as f64, f, s.dtype, CPU))?;
    op("arange", || Tensor::arange(f, 3.0, 0.5, s.dtype, CPU))?;
    let values = vec![1.0f32; n.min(64)];
    op("from_vec", || Tensor::from_vec(values, shape, CPU))?;
    Ok(())
}

/// Views and shape ops with random dims and sizes.
fn views(
    t: &Tensor,
    d: &[isize],
    sizes: &[isize],
    n: usize,
    small: bool,
) -> std::result::Result<(), TestCaseError> {
    let (d0, d1) = (d[0], d[1]);
    op("size", || {
        t.size(d0)
            .map(|s| Tensor::scalar(s as f64, DType::F64, CPU).unwrap())
    })?;
    op("reshape", || t.reshape(sizes))?;
    op("view", || t.view(sizes))?;
    op("expand", || t.expand(sizes))?;
    op("permute", || t.permute(&d[..t.rank().min(d.len())]))?;
    op("transpose", || t.transpose(d0, d1))?;
    op("t", || t.t())?;
    op("narrow", || t.narrow(d0, n, sizes[0].unsigned_abs()))?;
    op("slice", || t.slice(d0, d1, sizes[0], n))?;
    op("select", || t.select(d0, d1))?;
    op("unsqueeze", || t.unsqueeze(d0))?;
    op("squeeze_dim", || t.squeeze_dim(d0))?;
    op("squeeze", || t.squeeze())?;
    op("flatten", || t.flatten(d0, d1))?;
    op("contiguous", || t.contiguous())?;
    if small {
        ops("split", || t.split(n, d0))?;
        ops("split_with_sizes", || {
            t.split_with_sizes(&sizes.iter().map(|s| s.unsigned_abs()).collect::<Vec<_>>(), d0)
        })?;
        ops("chunk", || t.chunk(n, d0))?;
        ops("unbind", || t.unbind(d0))?;
        op("cat", || Tensor::cat(&[t, t], d0))?;
        op("stack", || Tensor::stack(&[t, t], d0))?;
    }
    Ok(())
}

/// Elementwise ops, one and two operands, and dtype conversion.
fn elementwise(a: &Tensor, b: &Tensor, f: f64, dt: DType) -> std::result::Result<(), TestCaseError> {
    op("to_dtype", || a.to_dtype(dt))?;
    op("add", || a.add(b))?;
    op("sub", || a.sub(b))?;
    op("mul", || a.mul(b))?;
    op("div", || a.div(b))?;
    op("pow", || a.pow(b))?;
    op("maximum", || a.maximum(b))?;
    op("add_scalar", || a.add_scalar(f))?;
    op("pow_scalar", || a.pow_scalar(f))?;
    op("eq", || a.eq(b))?;
    op("lt", || a.lt(b))?;
    op("logical_and", || a.logical_and(b))?;
    op("logical_not", || a.logical_not())?;
    op("where_cond", || Tensor::where_cond(&a.gt_scalar(0.0)?, a, b))?;
    op("masked_fill", || a.masked_fill(b, f))?;
    op("clamp", || a.clamp(Some(-f), Some(f)))?;
    op("neg", || a.neg())?;
    op("abs", || a.abs())?;
    op("exp", || a.exp())?;
    op("log", || a.log())?;
    op("sqrt", || a.sqrt())?;
    op("tanh", || a.tanh())?;
    op("sigmoid", || a.sigmoid())?;
    op("relu", || a.relu())?;
    op("gelu", || a.gelu())?;
    op("floor", || a.floor())?;
    op("erf", || a.erf())?;
    op("leaky_relu", || a.leaky_relu(f))?;
    op("hardtanh", || a.hardtanh(-f, f))?;
    op("softplus", || a.softplus_with(f, f))?;
    Ok(())
}

/// Reductions, softmax, matrix products, indexing, convolution and pooling (small operands).
fn compute(a: &Tensor, b: &Tensor, d: &[isize], n: usize, f: f64) -> std::result::Result<(), TestCaseError> {
    let (d0, d1) = (d[0], d[1]);
    op("sum_all", || a.sum_all())?;
    op("sum_dims", || a.sum_dims(d, n % 2 == 0))?;
    op("mean_dims", || a.mean_dims(&d[..2], true))?;
    op("prod_dim", || a.prod_dim(d0, false))?;
    op("max_dim", || a.max_dim(d0, true).map(|(v, _)| v))?;
    op("argmax", || a.argmax(Some(d0), false))?;
    op("argmin", || a.argmin(None, false))?;
    op("max_all", || a.max_all())?;
    op("amax", || a.amax(&d[..1], false))?;
    op("var", || a.var(&d[..1], f, true))?;
    op("std", || a.std(&[], 1.0, false))?;
    op("logsumexp", || a.logsumexp(&d[..2], false))?;
    op("norm", || a.norm(f, &d[..1], false))?;
    op("softmax", || a.softmax(d0))?;
    op("log_softmax", || a.log_softmax(d1))?;
    op("matmul", || a.matmul(b))?;
    op("mm", || a.mm(b))?;
    op("bmm", || a.bmm(b))?;
    op("linear", || a.linear(b, None))?;
    op("index_select", || a.index_select(d0, b))?;
    op("gather", || a.gather(d0, b))?;
    op("scatter", || a.scatter(d0, b, a))?;
    op("scatter_add", || a.scatter_add(d0, b, a))?;
    op("index_add", || a.index_add(d0, b, a))?;
    op("embedding", || Tensor::embedding(b, a))?;
    op("one_hot", || b.one_hot(n as i64 - 1))?;
    op("one_hot", || b.one_hot(-1))?;
    op("bernoulli", || a.bernoulli())?;
    op("bernoulli_p", || a.bernoulli_p(f))?;
    let k = [n.max(1), (n % 3).max(1)];
    let s = [(n % 2) + 1, 1];
    op("convolution", || convolution(a, b, None, &s, &[n, 0], &[1, n], 1))?;
    op("convolution 1d", || convolution(a, b, None, &[n], &[n], &[1], n))?;
    op("unfold", || unfold(a, k, [1, 1], [n, 0], s))?;
    op("max_pool2d", || pool2d(a, PoolMode::Max, k, s, [n / 2, 0]))?;
    op("avg_pool2d", || pool2d(a, PoolMode::Avg, k, s, [0, n / 2]))?;
    Ok(())
}

/// In-place ops on a copy of `a` (so `a` stays as it was).
fn inplace(a: &Tensor, b: &Tensor, f: f64) -> std::result::Result<(), TestCaseError> {
    let Some(x) = call("deep_clone", || a.deep_clone())? else {
        return Ok(());
    };
    op("copy_", || x.copy_(b))?;
    op("fill_", || x.fill_(f))?;
    op("add_", || x.add_(b))?;
    op("mul_scalar_", || x.mul_scalar_(f))?;
    op("clamp_", || x.clamp_(Some(f), None))?;
    op("lerp_", || x.lerp_(b, f))?;
    op("addcmul_", || x.addcmul_(b, b, f))?;
    op("uniform_", || x.uniform_(-f, f))?;
    op("normal_", || x.normal_(f, 1.0))?;
    op("bernoulli_", || x.bernoulli_(f))?;
    op("zero_", || x.zero_())?;
    Ok(())
}

/// A differentiable chain on a float copy of `a`, then backward.
fn autograd(a: &Tensor, b: &Tensor, d: &[isize]) -> std::result::Result<(), TestCaseError> {
    if !a.dtype().is_floating_point() {
        return Ok(());
    }
    let Some(x) = call("requires_grad_", || a.detach().deep_clone()?.requires_grad_(true))? else {
        return Ok(());
    };
    let chains: [(&str, &dyn Fn() -> Result<Tensor>); 5] = [
        ("mul+sum", &|| x.mul(b)?.sum_all()),
        ("softmax+mean", &|| x.softmax(d[0])?.mean_all()),
        ("narrow+tanh", &|| {
            x.flatten(0, -1)?.narrow(0, 0, 1)?.tanh()?.sum_all()
        }),
        ("logsumexp", &|| x.logsumexp(&d[..1], false)?.sum_all()),
        ("matmul", &|| x.matmul(b)?.sum_all()),
    ];
    for (name, chain) in chains {
        if let Some(y) = call(name, chain)? {
            call(&format!("{name} backward"), || y.backward())?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn creation_never_panics(s in any_shape(), n in size(), f in prop_oneof![Just(0.0), Just(1.0), Just(-2.5), Just(f64::NAN), Just(f64::INFINITY), Just(5e-324)]) {
        creation(&s, n, f)?;
    }

    #[test]
    fn views_never_panic(s in any_shape(), d in proptest::collection::vec(dim(), 2..5), sizes in proptest::collection::vec(isize_size(), 0..5), n in size()) {
        let small = s.dims.iter().all(|&d| d <= 5);
        if let Some(t) = make(&s)? {
            let mut sizes = sizes;
            if sizes.is_empty() {
                sizes.push(1);
            }
            views(&t, &d, &sizes, n, small)?;
        }
    }

    #[test]
    fn elementwise_never_panics(a in any_shape(), b in any_shape(), f in prop_oneof![Just(0.5), Just(-1.0), Just(f64::NAN), Just(1e300)], dt in dtype()) {
        if let (Some(x), Some(y)) = (make(&a)?, make(&b)?) {
            elementwise(&x, &y, f, dt)?;
        }
    }

    #[test]
    fn compute_ops_never_panic(a in small(), b in small(), d in proptest::collection::vec(dim(), 2..4), n in small_size(), f in prop_oneof![Just(0.5), Just(2.0), Just(-1.0), Just(f64::NAN)]) {
        if let (Some(x), Some(y)) = (make(&a)?, make(&b)?) {
            compute(&x, &y, &d, n, f)?;
            // Indices of an integer dtype, as index ops want them.
            if let Some(idx) = call("to_dtype i64", || y.to_dtype(DType::I64))? {
                compute(&x, &idx, &d, n, f)?;
            }
        }
    }

    #[test]
    fn inplace_and_autograd_never_panic(a in small(), b in small(), d in proptest::collection::vec(dim(), 2..4), f in prop_oneof![Just(0.5), Just(2.0), Just(f64::NAN)]) {
        if let (Some(x), Some(y)) = (make(&a)?, make(&b)?) {
            inplace(&x, &y, f)?;
            autograd(&x, &y, &d)?;
        }
    }
}
