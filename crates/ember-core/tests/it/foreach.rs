//! `foreach_copy_` (Note [Foreach copies]): every pair copied as `copy_` would, on the CPU pair
//! by pair and on a GPU as one launch for plain lists (the shapes of a DDP bucket: views of one
//! flat tensor filled from separate tensors, and back), pair by pair for the others.

use super::common;
use ember_core::profiler;
use ember_core::{foreach_copy_, DType, Device, Result, Tensor};

/// Sources of several dtypes and sizes (odd byte counts included, so the kernel's byte and
/// word paths both run), on `device`.
fn sources(device: Device) -> Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::arange(0.0, 7.0, 1.0, DType::U8, device)?,
        Tensor::randn([3, 5], DType::F32, device)?,
        Tensor::randn([1], DType::F32, device)?,
        Tensor::randn([130, 257], DType::F32, device)?,
        Tensor::arange(-9.0, 4.0, 1.0, DType::I64, device)?,
        Tensor::randn([33], DType::F16, device)?,
        Tensor::randn([0, 4], DType::F32, device)?,
    ])
}

fn values(ts: &[Tensor]) -> Vec<Vec<f64>> {
    ts.iter().map(|t| t.to_vec_f64().unwrap()).collect()
}

/// Empty destinations shaped as `src`, each its own tensor.
fn separate(src: &[Tensor]) -> Result<Vec<Tensor>> {
    src.iter()
        .map(|s| Tensor::zeros(s.dims(), s.dtype(), s.device()))
        .collect()
}

/// Destinations shaped as `src` (all f32 here) that are views of one flat f32 tensor, as a
/// DDP bucket's slots.
fn bucket(src: &[Tensor]) -> Result<(Tensor, Vec<Tensor>)> {
    let total: usize = src.iter().map(Tensor::numel).sum();
    let flat = Tensor::zeros([total], DType::F32, src[0].device())?;
    let mut offset = 0;
    let mut views = Vec::new();
    for s in src {
        let dims: Vec<isize> = s.dims().iter().map(|&d| d as isize).collect();
        views.push(flat.narrow(0, offset, s.numel())?.view(&dims)?);
        offset += s.numel();
    }
    Ok((flat, views))
}

fn check_copies(device: Device) -> Result<()> {
    let src = sources(device)?;
    let dst = separate(&src)?;
    foreach_copy_(&dst, &src)?;
    assert_eq!(values(&dst), values(&src), "{device}: separate tensors");
    // Into the slots of one flat tensor and back out, as DDP does each step.
    let grads: Vec<Tensor> = src.iter().filter(|s| s.dtype() == DType::F32).cloned().collect();
    let (flat, slots) = bucket(&grads)?;
    let version = flat.version();
    foreach_copy_(&slots, &grads)?;
    assert!(
        flat.version() > version,
        "{device}: writing the slots is a write of the flat tensor"
    );
    let expected: Vec<f64> = grads.iter().flat_map(|g| g.to_vec_f64().unwrap()).collect();
    assert_eq!(flat.to_vec_f64()?, expected, "{device}: into one flat tensor");
    let back = separate(&grads)?;
    foreach_copy_(&back, &slots)?;
    assert_eq!(values(&back), values(&grads), "{device}: out of one flat tensor");
    // What the one-launch path does not take still copies: a transposed source, a dtype
    // conversion, a broadcast.
    let t = Tensor::randn([4, 6], DType::F32, device)?;
    let wide = Tensor::randn([6], DType::F64, device)?;
    let odd = [
        Tensor::zeros([6, 4], DType::F32, device)?,
        Tensor::zeros([6], DType::F32, device)?,
        Tensor::zeros([3, 6], DType::F64, device)?,
    ];
    foreach_copy_(&odd, &[t.t()?, wide.clone(), wide.clone()])?;
    assert_eq!(odd[0].to_vec_f64()?, t.t()?.contiguous()?.to_vec_f64()?);
    assert_eq!(odd[1].to_vec_f64()?, wide.to_dtype(DType::F32)?.to_vec_f64()?);
    assert_eq!(
        odd[2].to_vec_f64()?,
        wide.expand(&[3, 6])?.contiguous()?.to_vec_f64()?
    );
    Ok(())
}

#[test]
fn foreach_copy_copies_every_pair_on_the_cpu() {
    check_copies(Device::Cpu).unwrap();
}

#[test]
fn foreach_copy_rejects_lists_of_different_lengths() {
    let a = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    let err = foreach_copy_(&[a.clone(), a.clone()], &[a]).unwrap_err();
    assert!(err.to_string().contains("same length"), "{err}");
}

#[test]
fn foreach_copy_keeps_copy_s_autograd_rules() {
    let leaf = Tensor::zeros([3], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let src = Tensor::ones([3], DType::F32, Device::Cpu).unwrap();
    let err = foreach_copy_(&[leaf], &[src]).unwrap_err();
    assert!(err.to_string().contains("leaf"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn foreach_copy_on_a_gpu_copies_plain_lists_in_one_op() {
    let gpu = common::gpu();
    check_copies(gpu).unwrap();
    // A plain list passes the dispatch point once, as `_foreach_copy_`, with no `copy_`.
    let src = sources(gpu).unwrap();
    let dst = separate(&src).unwrap();
    let _l = super::profiler::lock();
    let prof = super::profiler::cupti_profile(|| {
        let _r = profiler::record_function("foreach under test");
        foreach_copy_(&dst, &src).unwrap();
        ember_core::cuda::synchronize(0).unwrap();
    });
    let events = prof.events();
    let range = events.iter().find(|e| e.name == "foreach under test").unwrap();
    let inside: Vec<&str> = events
        .iter()
        .filter(|e| e.thread == range.thread && e.start_ns >= range.start_ns && e.end_ns <= range.end_ns)
        .map(|e| e.name.as_str())
        .collect();
    assert_eq!(
        inside.iter().filter(|n| **n == "_foreach_copy_").count(),
        1,
        "{inside:?}"
    );
    assert_eq!(inside.iter().filter(|n| **n == "copy_").count(), 0, "{inside:?}");
    let kernels = prof
        .trace()
        .unwrap()
        .gpu_activities()
        .iter()
        .filter(|k| k.name == "multi_copy")
        .count();
    assert_eq!(kernels, 1, "one launch for {} pairs", src.len());
    assert_eq!(values(&dst), values(&src));
}
