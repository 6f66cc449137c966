//! Fused attention on CUDA (`ops::attention`, cuDNN's engines) against float64 attention
//! computed on the CPU from the same rounded inputs: the output and the three gradients, causal
//! and not, bfloat16 and float16, head dims 64 and 128, odd sequence lengths, and inputs that are
//! views of one `[B, T, 3, H, D]` projection (GPT-2's layout) as well as contiguous ones.

use crate::common::gpu;
use ember_core::ops::attention::scaled_dot_product_cudnn_attention;
use ember_core::{DType, Device, Result, Tensor};

const CPU: Device = Device::Cpu;

/// `softmax(q kᵀ · scale [causal]) v` and its gradients for `g`, all in float64 on the CPU.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    causal: bool,
    scale: f64,
) -> Result<[Tensor; 4]> {
    let [q, k, v] = [q, k, v].map(|t| t.detach().to(CPU).and_then(|t| t.to_dtype(DType::F64)));
    let (q, k, v) = (
        q?.requires_grad_(true)?,
        k?.requires_grad_(true)?,
        v?.requires_grad_(true)?,
    );
    let mut scores = q.matmul(&k.transpose(-2, -1)?)?.mul_scalar(scale)?;
    if causal {
        let (l, s) = (q.dims()[2], k.dims()[2]);
        let i = Tensor::arange(0.0, l as f64, 1.0, DType::I64, CPU)?.unsqueeze(1)?;
        let j = Tensor::arange(0.0, s as f64, 1.0, DType::I64, CPU)?.unsqueeze(0)?;
        scores = scores.masked_fill(&j.gt(&i)?, f64::NEG_INFINITY)?;
    }
    let out = scores.softmax(-1)?.matmul(&v)?;
    let g = g.to(CPU)?.to_dtype(DType::F64)?;
    out.backward_with(Some(&g), false)?;
    let grad = |t: &Tensor| t.grad().expect("a gradient");
    Ok([out.detach(), grad(&q), grad(&k), grad(&v)])
}

/// The largest `|a - b|` over the largest `|b|` (a relative error of the whole tensor), with a
/// floor of 0.01 under the latter where a gradient is zero but for rounding (dq when each query
/// sees one key: its weights are exactly 1).
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to(CPU).unwrap().to_dtype(DType::F64).unwrap();
    let diff = a
        .sub(b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .item_f64()
        .unwrap();
    let scale = b.abs().unwrap().max_all().unwrap().item_f64().unwrap().max(1e-2);
    diff / scale
}

/// q, k, v `[b, h, t, d]` on the GPU in `dtype`: views of one `[b, t, 3, h, d]` tensor when
/// `packed` (strides `[t·3hd, d, 3hd, 1]`), else contiguous.
fn inputs(b: usize, h: usize, t: usize, d: usize, dtype: DType, packed: bool) -> Result<[Tensor; 3]> {
    let dev = gpu();
    if packed {
        let qkv = Tensor::randn([b, t, 3, h, d], DType::F32, dev)?.to_dtype(dtype)?;
        let part = |i: isize| qkv.select(2, i)?.transpose(1, 2);
        Ok([part(0)?, part(1)?, part(2)?])
    } else {
        let r = || Tensor::randn([b, h, t, d], DType::F32, dev)?.to_dtype(dtype);
        Ok([r()?, r()?, r()?])
    }
}

fn check(b: usize, h: usize, t: usize, d: usize, dtype: DType, causal: bool, packed: bool) {
    let [q, k, v] = inputs(b, h, t, d, dtype, packed).unwrap();
    let (q, k, v) = (
        q.requires_grad_(true).unwrap(),
        k.requires_grad_(true).unwrap(),
        v.requires_grad_(true).unwrap(),
    );
    let scale = 1.0 / (d as f64).sqrt();
    let out = scaled_dot_product_cudnn_attention(&q, &k, &v, causal, scale)
        .unwrap()
        .unwrap_or_else(|| {
            panic!("cuDNN takes {dtype} b={b} h={h} t={t} d={d} causal={causal} packed={packed}")
        });
    assert_eq!(out.dims(), &[b, h, t, d]);
    assert!(out.transpose(1, 2).unwrap().is_contiguous(), "BSHD memory order");
    let g = Tensor::randn([b, h, t, d], DType::F32, gpu())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    out.backward_with(Some(&g), false).unwrap();
    let [r_out, r_dq, r_dk, r_dv] = reference(&q, &k, &v, &g, causal, scale).unwrap();
    // bf16 keeps 8 bits: its rounding of the output and of the weights before `P·V` gives
    // relative errors near 2^-8 of the largest value; f16 near 2^-11.
    let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
    let what = format!("{dtype} b={b} h={h} t={t} d={d} causal={causal} packed={packed}");
    for (name, got, want) in [
        ("out", out.detach(), r_out),
        ("dq", q.grad().unwrap(), r_dq),
        ("dk", k.grad().unwrap(), r_dk),
        ("dv", v.grad().unwrap(), r_dv),
    ] {
        let err = rel_err(&got, &want);
        assert!(err < tol, "{name} of {what}: relative error {err} over {tol}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_matches_float64_gpt2_shapes() {
    for dtype in [DType::BF16, DType::F16] {
        for causal in [true, false] {
            check(2, 3, 128, 64, dtype, causal, true);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_matches_float64_head_dims_and_odd_lengths() {
    for (t, d) in [(1, 64), (77, 64), (257, 128), (64, 128)] {
        for causal in [true, false] {
            check(1, 2, t, d, DType::BF16, causal, false);
        }
    }
    check(2, 2, 100, 128, DType::F16, true, true);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_declines_what_it_does_not_run() {
    let dev = gpu();
    let f32s = Tensor::randn([1, 2, 16, 64], DType::F32, dev).unwrap();
    assert!(
        scaled_dot_product_cudnn_attention(&f32s, &f32s, &f32s, true, 0.125)
            .unwrap()
            .is_none()
    );
    let big = Tensor::randn([1, 1, 16, 256], DType::BF16, dev).unwrap();
    assert!(scaled_dot_product_cudnn_attention(&big, &big, &big, false, 0.1)
        .unwrap()
        .is_none());
}

#[test]
fn cudnn_attention_declines_on_the_cpu() {
    let x = Tensor::randn([1, 2, 4, 8], DType::BF16, CPU).unwrap();
    assert!(scaled_dot_product_cudnn_attention(&x, &x, &x, true, 0.5)
        .unwrap()
        .is_none());
}

/// Note [Attention gradients in one buffer] (`ops/attention.rs`): q, k and v split from one
/// `[b, t, 3·h·d]` projection (GPT-2's `qkv.split(c, 2)`, then heads) get their gradients in one
/// buffer laid out as the projection, which becomes its gradient; compared with float64, and
/// the self-attention of one tensor (q = k = v, which cannot share a buffer) beside it.
#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_gradients_of_one_projection() {
    let (b, h, t, d) = (2, 3, 64, 64);
    let c = h * d;
    for dtype in [DType::BF16, DType::F16] {
        let x = Tensor::randn([b, t, 3 * c], DType::F32, gpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let [q, k, v] = x.split_into(c, 2).unwrap();
        let heads = |p: &Tensor| p.view([b, t, h, d]).unwrap().transpose(1, 2).unwrap();
        let (q, k, v) = (heads(&q), heads(&k), heads(&v));
        let scale = 1.0 / (d as f64).sqrt();
        let out = scaled_dot_product_cudnn_attention(&q, &k, &v, true, scale)
            .unwrap()
            .expect("cuDNN takes GPT-2's layout");
        let g = Tensor::randn([b, h, t, d], DType::F32, gpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        out.backward_with(Some(&g), false).unwrap();
        let [_, r_dq, r_dk, r_dv] = reference(&q, &k, &v, &g, true, scale).unwrap();
        let rows = |r: Tensor| r.transpose(1, 2).unwrap().reshape([b, t, c]).unwrap();
        let want = Tensor::cat(&[rows(r_dq), rows(r_dk), rows(r_dv)], 2).unwrap();
        let got = x.grad().unwrap();
        assert!(got.is_contiguous());
        let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
        let err = rel_err(&got, &want);
        assert!(
            err < tol,
            "{dtype}: the projection's gradient is {err} from float64"
        );

        // q = k = v: three gradients summed into one input.
        let y = Tensor::randn([b, h, t, d], DType::F32, gpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let out = scaled_dot_product_cudnn_attention(&y, &y, &y, false, scale)
            .unwrap()
            .expect("cuDNN takes it");
        out.backward_with(Some(&g), false).unwrap();
        let [_, r_dq, r_dk, r_dv] = reference(&y, &y, &y, &g, false, scale).unwrap();
        let want = r_dq.add(&r_dk).unwrap().add(&r_dv).unwrap();
        let err = rel_err(&y.grad().unwrap(), &want);
        assert!(err < tol, "{dtype}: q = k = v's gradient is {err} from float64");
    }
}

/// The backward's float scratch (row sums and the dQ accumulator) comes from the caching
/// allocator uncleared where cuDNN clears it itself (`cudnn_sdpa.rs`'s module note): run it on
/// blocks that last held NaN and huge values, of exactly the accumulator's size, and compare
/// with float64.
#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_backward_needs_no_zeroed_scratch() {
    let (b, h, t, d) = (2, 3, 128, 64);
    for fill in [f64::NAN, 1e30, -7.0] {
        // Many blocks, so that the backward's scratch lands on one after the forward's and
        // the inputs' allocations took theirs.
        let junk: Vec<Tensor> = (0..64)
            .map(|_| Tensor::full([b * h * t * d], fill, DType::F32, gpu()).unwrap())
            .chain((0..64).map(|_| Tensor::full([b * h * t], fill, DType::F32, gpu()).unwrap()))
            .collect();
        drop(junk);
        check(b, h, t, d, DType::BF16, true, false);
    }
}
