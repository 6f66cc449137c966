//! `foreach_copy_` (Note [Foreach copies]): every pair copied as `copy_` would, on the CPU pair
//! by pair and on a GPU as one launch for plain lists (the shapes of a DDP bucket: views of one
//! flat tensor filled from separate tensors, and back), pair by pair for the others.

use super::common;
use ember_core::profiler;
use ember_core::{foreach_copy_, DType, Device, Result, Tensor};
use half::{bf16, f16};

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
    // What the one-launch path does not take still copies: a transposed source, a conversion
    // from f64 (the list casts only between f32, bf16 and f16), a broadcast.
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
fn foreach_copy_on_a_gpu_copies_plain_lists_in_one_op_per_cupti() {
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
    // Only the kernels that ops inside the range launched: the profiler records every
    // thread's, and another test's list copy beside this one made it count two (session 55,
    // core `it` run whole).
    let inside_range = |i: usize| {
        let e = &events[i];
        e.thread == range.thread && e.start_ns >= range.start_ns && e.end_ns <= range.end_ns
    };
    let kernels = prof
        .trace()
        .unwrap()
        .gpu_activities()
        .iter()
        .filter(|k| k.name == "multi_copy" && k.event.is_some_and(inside_range))
        .count();
    assert_eq!(kernels, 1, "one launch for {} pairs", src.len());
    assert_eq!(values(&dst), values(&src));
}

// ---- Casts in the list (f32, bf16, f16): the bits `copy_` gives, pair by pair ----

/// f32 values a cast to bf16 or f16 must get exactly right: NaNs (quiet, signalling, with
/// payloads, negative), infinities, signed zeros, f32 subnormals, values on and beside the
/// rounding ties of bf16 (8 bits of mantissa) and f16 (11), f16's overflow edge (65504 is its
/// largest, 65520 the first that rounds to infinity) and subnormals (2^-24 the smallest, 2^-25
/// a tie to zero), f32's largest; then `n - specials` pseudo-random bit patterns (any exponent,
/// NaNs and subnormals among them).
fn f32_bits_sweep(n: usize) -> Vec<f32> {
    let specials = [
        0x7fc0_0000u32, // NaN
        0xffc0_0000,    // -NaN
        0x7f80_0001,    // signalling NaN, low payload
        0x7fa0_0000,    // signalling NaN, high payload
        0x7fbf_ffff,
        0x7f80_0000, // inf
        0xff80_0000, // -inf
        0x0000_0000,
        0x8000_0000, // -0
        0x0000_0001, // smallest f32 subnormal
        0x807f_ffff, // largest negative f32 subnormal
        0x0000_8000, // f32 subnormal on a bf16 tie
        0x3f80_8000, // 1 + 2^-8: bf16 tie, to even (1)
        0x3f81_8000, // bf16 tie, to even (up)
        0x3f80_8001, // just above a bf16 tie
        0x3f80_7fff, // just below
        0x3f80_1000, // 1 + 2^-11: f16 tie, to even (1)
        0x3f80_3000, // f16 tie, up
        0x3f80_1001,
        0x477f_e000, // 65504, f16's largest
        0x477f_efff, // rounds down to 65504
        0x477f_f000, // 65520: f16 infinity
        0x47c3_5000, // 1e5: f16 infinity
        0x3380_0000, // 2^-24: f16's smallest subnormal
        0x3300_0000, // 2^-25: a tie, to zero
        0x33c0_0000, // 3 * 2^-25: a tie, to even (2^-23)
        0x3880_0000, // 2^-14: f16's smallest normal
        0x387f_c000, // just below it: an f16 subnormal
        0x7f7f_ffff, // f32's largest: bf16 and f16 infinity
        0xff7f_ffff,
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let random = std::iter::repeat_with(move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 32) as u32
    });
    specials
        .into_iter()
        .chain(random)
        .take(n.max(specials.len()))
        .map(f32::from_bits)
        .collect()
}

/// Every bf16 bit pattern, then every f16 one (65536 each: all NaNs, subnormals, both zeros).
fn every_half(device: Device) -> Result<(Tensor, Tensor)> {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<bf16> = all.iter().map(|&x| bf16::from_bits(x)).collect();
    let h: Vec<f16> = all.iter().map(|&x| f16::from_bits(x)).collect();
    Ok((
        Tensor::from_vec(b, [256, 256], device)?,
        Tensor::from_vec(h, [65536], device)?,
    ))
}

/// A flat tensor of `dtype` full of `sentinel` and views of it, one per shape, at `first`
/// and then one element apart (odd offsets, as `narrow` gives FSDP's slots).
fn views_of(
    shapes: &[Vec<usize>],
    dtype: DType,
    first: usize,
    device: Device,
) -> Result<(Tensor, Vec<Tensor>)> {
    let total: usize = first
        + shapes
            .iter()
            .map(|s| s.iter().product::<usize>() + 1)
            .sum::<usize>();
    let flat = Tensor::full([total], 7.0, dtype, device)?;
    let mut at = first;
    let mut views = Vec::new();
    for s in shapes {
        let n: usize = s.iter().product();
        let dims: Vec<isize> = s.iter().map(|&d| d as isize).collect();
        views.push(flat.narrow(0, at, n)?.view(&dims)?);
        at += n + 1;
    }
    Ok((flat, views))
}

/// Runs `foreach_copy_(dst, src)` and checks every destination against `copy_` of its pair
/// into a fresh tensor of its dtype and shape, bit for bit.
fn check_against_copy(what: &str, dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    foreach_copy_(dst, src)?;
    for (i, (d, s)) in dst.iter().zip(src).enumerate() {
        let expected = Tensor::zeros(d.dims(), d.dtype(), d.device())?;
        expected.copy_(s)?;
        assert_eq!(
            common::bits(d),
            common::bits(&expected),
            "{what}: pair {i}, {} {:?} into {}",
            s.dtype(),
            s.dims(),
            d.dtype()
        );
    }
    Ok(())
}

/// A list that casts every way between f32, bf16 and f16, beside byte copies, into separate
/// tensors and into odd-offset views of flat ones (from odd-offset views too), with empty
/// pairs, equals `copy_` pair by pair bit for bit; the flat tensors' gaps keep their values.
fn check_casts(device: Device) -> Result<()> {
    let wide = Tensor::from_vec(f32_bits_sweep(20011), [20011], device)?;
    let (every_bf16, every_f16) = every_half(device)?;
    let src = vec![
        wide.clone(),
        wide.clone(),
        every_bf16.clone(),
        every_bf16.clone(),
        every_f16.clone(),
        every_f16.clone(),
        wide.narrow(0, 3, 5001)?, // f32 -> f32, a byte copy
        every_bf16.reshape([65536])?,
        Tensor::arange(0.0, 7.0, 1.0, DType::U8, device)?,
        Tensor::zeros([0], DType::F32, device)?,
        Tensor::zeros([0, 4], DType::F16, device)?,
    ];
    let into = [
        DType::BF16,
        DType::F16,
        DType::F32,
        DType::F16,
        DType::F32,
        DType::BF16,
        DType::F32,
        DType::BF16,
        DType::U8,
        DType::BF16,
        DType::F32,
    ];
    let dst = src
        .iter()
        .zip(into)
        .map(|(s, d)| Tensor::zeros(s.dims(), d, device))
        .collect::<Result<Vec<_>>>()?;
    check_against_copy(&format!("{device}: separate tensors"), &dst, &src)?;

    // FSDP's shape: f32 shards (here views of one f32 tensor at odd offsets) into odd-offset
    // views of one bf16 tensor, and of one f16 tensor; and back out into f32.
    let sizes = [1usize, 4, 5, 767, 768, 4097, 9000, 3];
    let shapes: Vec<Vec<usize>> = sizes.iter().map(|&n| vec![n]).collect();
    let (_, shards) = views_of(&shapes, DType::F32, 1, device)?;
    let mut at = 0;
    for s in &shards {
        let n = s.numel();
        s.copy_(&wide.narrow(0, at, n)?)?;
        at += n;
    }
    for (dtype, first) in [(DType::BF16, 1), (DType::F16, 3), (DType::BF16, 0)] {
        let (flat, slots) = views_of(&shapes, dtype, first, device)?;
        check_against_copy(
            &format!("{device}: shards into {dtype} slots at {first}"),
            &slots,
            &shards,
        )?;
        // Nothing outside the slots was written: the gaps hold the sentinel.
        let mut gaps = vec![true; flat.numel()];
        let mut at = first;
        for n in sizes {
            gaps[at..at + n].iter_mut().for_each(|g| *g = false);
            at += n + 1;
        }
        let v = flat.to_vec_f64()?;
        for (i, _) in gaps.iter().enumerate().filter(|(_, &g)| g) {
            assert_eq!(v[i], 7.0, "{device}: {dtype} element {i} outside the slots");
        }
        let (_, back) = views_of(&shapes, DType::F32, 2, device)?;
        check_against_copy(&format!("{device}: {dtype} slots back into f32"), &back, &slots)?;
    }
    Ok(())
}

/// More pairs than one launch takes (64), every kind in turn, of sizes 0 to 150.
fn check_long_list(device: Device) -> Result<()> {
    let kinds = [
        (DType::F32, DType::BF16),
        (DType::BF16, DType::F32),
        (DType::F32, DType::F16),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F16),
        (DType::F16, DType::BF16),
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
    ];
    let wide = Tensor::from_vec(f32_bits_sweep(200), [200], device)?;
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for i in 0..150 {
        let (from, to) = kinds[i % kinds.len()];
        let n = (i * 7) % 151;
        src.push(wide.narrow(0, i % 50, n)?.to_dtype(from)?);
        dst.push(Tensor::zeros([n], to, device)?);
    }
    check_against_copy(&format!("{device}: 150 pairs"), &dst, &src)
}

#[test]
fn foreach_copy_casts_as_copy_does_on_the_cpu() {
    check_casts(Device::Cpu).unwrap();
    check_long_list(Device::Cpu).unwrap();
}

#[test]
fn foreach_copy_with_casts_rejects_lists_of_different_lengths() {
    let a = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([2], DType::BF16, Device::Cpu).unwrap();
    let err = foreach_copy_(&[b.clone(), b.clone()], &[a.clone()]).unwrap_err();
    assert!(err.to_string().contains("same length"), "{err}");
    let err = foreach_copy_(&[b], &[a.clone(), a]).unwrap_err();
    assert!(err.to_string().contains("same length"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_foreach_copy_casts_as_copy_does() {
    let gpu = common::gpu();
    check_casts(gpu).unwrap();
    check_long_list(gpu).unwrap();
}

/// The list path's launches: one `multi_copy` for a list of up to 64 pairs that mixes byte
/// copies and every cast, and no cast kernel or device copy beside it; FSDP's GPT-2 gather (148
/// f32 shards into views of one bf16 buffer) in 3, where `copy_` pair by pair launched 148
/// cast kernels.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_foreach_copy_with_casts_launches_one_kernel_per_64_pairs() {
    common::gpu();
    common::in_own_process(
        "foreach::cuda_foreach_copy_with_casts_launches_one_kernel_per_64_pairs",
        foreach_copy_with_casts_launches_one_kernel_per_64_pairs_body,
    );
}

fn foreach_copy_with_casts_launches_one_kernel_per_64_pairs_body() {
    let gpu = common::gpu();
    let (every_bf16, every_f16) = every_half(gpu).unwrap();
    let wide = Tensor::from_vec(f32_bits_sweep(9001), [9001], gpu).unwrap();
    let src = vec![
        wide.clone(),
        wide.clone(),
        every_bf16.clone(),
        every_bf16.clone(),
        every_f16.clone(),
        every_f16.clone(),
        wide.narrow(0, 1, 77).unwrap(),
        every_f16.narrow(0, 5, 33).unwrap(),
        Tensor::zeros([0], DType::BF16, gpu).unwrap(),
    ];
    let into = [
        DType::BF16,
        DType::F16,
        DType::F32,
        DType::F16,
        DType::F32,
        DType::BF16,
        DType::F32,
        DType::F16,
        DType::F32,
    ];
    let dst: Vec<Tensor> = src
        .iter()
        .zip(into)
        .map(|(s, d)| Tensor::zeros(s.dims(), d, gpu).unwrap())
        .collect();
    let names = common::kernels_of(1, || foreach_copy_(&dst, &src).unwrap());
    assert_eq!(names, ["multi_copy"], "one launch for {} pairs", src.len());
    check_against_copy("mixed list", &dst, &src).unwrap();

    // FSDP's gather for GPT-2 124M: 148 shards, f32, into one bf16 input.
    let shapes: Vec<Vec<usize>> = (0..148)
        .map(|i| vec![[768, 2304, 3072, 589824][i % 4] / 8 + i % 3])
        .collect();
    let shards: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::randn(s.as_slice(), DType::F32, gpu).unwrap())
        .collect();
    let (_, slots) = views_of(&shapes, DType::BF16, 1, gpu).unwrap();
    let names = common::kernels_of(1, || foreach_copy_(&slots, &shards).unwrap());
    assert_eq!(names, ["multi_copy"; 3], "148 pairs, 64 a launch");
    check_against_copy("FSDP's gather", &slots, &shards).unwrap();
}
