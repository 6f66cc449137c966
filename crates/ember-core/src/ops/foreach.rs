//! Ops over lists of tensors (PyTorch's `torch._foreach_*`): [`foreach_copy_`].
//!
//! Note [Foreach copies]: `foreach_copy_(dst, src)` is `dst[i].copy_(src[i])` for every `i`,
//! with `copy_`'s semantics (broadcasting, dtype and device conversion, autograd's rules for
//! in-place writes). Where every pair is plain (one CUDA device for all, the same shape within
//! a pair, both contiguous, dtypes equal or both of f32, bf16 and f16, nothing requiring grad,
//! no two destinations overlapping, no storage both written and read) the copies run as one
//! kernel launch per 64 pairs (`cuda_backend/multi_copy.rs`): a pair of one dtype as a byte
//! copy, a pair of two as a cast giving each element the bits `copy_`'s cast kernel gives it
//! (the prelude's conversions, `cast_contig`'s: round to nearest even, a NaN stays a NaN and
//! an infinity an infinity), byte copies and casts mixed in one launch. Any other list takes
//! `copy_` pair by pair. A list whose destinations share a device passes the dispatch point
//! once as `_foreach_copy_` (the profiler's op), either way. A launch costs the host about
//! what one `copy_` costs, so gathering a bucket of gradients (DistributedDataParallel) costs
//! one copy instead of one per parameter. Each written storage's version is bumped once.
//!
//! The casts are PyTorch's `_foreach_copy_` casting too, kept to the dtypes of mixed
//! precision: FSDP packs its f32 shards into the bf16 all-gather input (`param_dtype`) with
//! one call, where one cast kernel per shard took 148 launches a gather for GPT-2 124M, ~292 a
//! step, about 1 ms of GPU time in a 19 ms step (session 49); with one call per gather,
//! `fsdp_gpt2` on one H200 took 18.44 ms a step beside `ddp_gpt2`'s 17.35 in one run, where it
//! had taken 19.22 beside 17.94 (docs/benchmarks.md, session 50 run 4 and session 49 run 9).
//! A pair with f64, an integer or bool on either side is rare in a list and keeps `copy_`. On
//! the CPU every list takes `copy_` pair by pair:
//! the backend's list copy (`CopyOps::foreach_copy`, which takes the same lists and casts as
//! `copy_`) would run the same per-pair loop, so a list saves nothing there, and the profile
//! keeps a `copy_` per pair under `_foreach_copy_` as PyTorch's CPU one does. (The unit tests
//! below run the list path through the CPU backend, so its rules and casts are checked
//! without a GPU.)

use super::fused_optim::Guard;
use crate::backend::step::foreach_copy_casts;
use crate::backend::{Elems, ForeachCopy};
use crate::dispatch::{self, policy};
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};

/// Copies `src[i]` into `dst[i]` for every `i` (`torch._foreach_copy_`), as one launch where
/// the list allows (Note [Foreach copies]); an error when the lists differ in length or a pair
/// cannot be copied (as `copy_` would report it).
pub fn foreach_copy_(dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::invalid(
            "_foreach_copy_",
            format!(
                "expected lists of the same length, got {} destinations and {} sources",
                dst.len(),
                src.len()
            ),
        ));
    }
    let pairwise = || {
        for (d, s) in dst.iter().zip(src) {
            d.copy_(s)?;
        }
        Ok(())
    };
    let one_device = dst
        .iter()
        .all(|d| Some(d.device()) == dst.first().map(Tensor::device));
    if dst.is_empty() || !one_device {
        // Nothing to observe as one list: each copy passes the dispatch point by itself.
        return pairwise();
    }
    let observed: Vec<&Tensor> = dst.iter().collect();
    dispatch::call_list(&policy::FOREACH_COPY, &observed, |_, _| {
        match fused_device(dst, src) {
            Some(_) => copy_fused(dst, src),
            None => pairwise(),
        }
    })
}

/// The CUDA device of a list that takes the one-launch path (Note [Foreach copies]), or `None`.
fn fused_device(dst: &[Tensor], src: &[Tensor]) -> Option<usize> {
    let Some(Device::Cuda(ordinal)) = dst.first().map(Tensor::device) else {
        return None;
    };
    plain_list(dst, src, Device::Cuda(ordinal)).then_some(ordinal)
}

/// Whether every pair of the list is plain on `device` (Note [Foreach copies]): what the
/// backend's list copy takes, whatever the device.
fn plain_list(dst: &[Tensor], src: &[Tensor], device: Device) -> bool {
    let plain = |t: &Tensor| t.device() == device && t.is_contiguous() && !t.requires_grad();
    let pairs_plain = dst.iter().zip(src).all(|(d, s)| {
        plain(d) && plain(s) && foreach_copy_casts(d.dtype(), s.dtype()) && d.dims() == s.dims()
    });
    if !pairs_plain {
        return false;
    }
    // Written ranges, as (storage, first element, end), must not overlap one another, and no
    // storage may be both written and read.
    let mut written: Vec<(usize, usize, usize)> = dst
        .iter()
        .filter(|t| t.numel() > 0)
        .map(|t| {
            (
                t.storage().id(),
                t.storage_offset(),
                t.storage_offset() + t.numel(),
            )
        })
        .collect();
    written.sort_unstable();
    if written.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
        return false;
    }
    let mut written_ids: Vec<usize> = written.iter().map(|w| w.0).collect();
    written_ids.dedup();
    let read_from_written = src
        .iter()
        .any(|s| written_ids.binary_search(&s.storage().id()).is_ok());
    !read_from_written
}

/// The one-launch path of a plain list ([`plain_list`]): locks every storage once (written
/// ones for writing, which bumps their versions), in the order of their ids so that two calls
/// never wait on each other, then hands the element runs to the backend's multi-tensor copy.
fn copy_fused(dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    let mut order: Vec<(usize, bool, &Tensor)> = dst
        .iter()
        .map(|t| (t.storage().id(), true, t))
        .chain(src.iter().map(|t| (t.storage().id(), false, t)))
        .collect();
    order.sort_by_key(|&(id, write, _)| (id, !write));
    order.dedup_by_key(|&mut (id, _, _)| id);
    let mut held: Vec<(usize, Guard<'_>)> = order
        .iter()
        .map(|&(id, write, t)| {
            let guard = if write {
                Guard::Write(t.storage().write())
            } else {
                Guard::Read(t.storage().read())
            };
            (id, guard)
        })
        .collect();
    // Each locked storage's place in the written or the read list, by id.
    let (mut written_ids, mut read_ids) = (Vec::new(), Vec::new());
    for (id, guard) in &held {
        match guard {
            Guard::Write(_) => written_ids.push(*id),
            Guard::Read(_) => read_ids.push(*id),
        }
    }
    let place = |ids: &[usize], t: &Tensor| {
        ids.binary_search(&t.storage().id())
            .map_err(|_| Error::invalid("_foreach_copy_", "a storage of the list was not locked"))
    };
    let run = |storage: usize, t: &Tensor| Elems {
        storage,
        offset: t.storage_offset(),
        len: t.numel(),
    };
    let copies = dst
        .iter()
        .zip(src)
        .filter(|(d, _)| d.numel() > 0)
        .map(|(d, s)| Ok((run(place(&written_ids, d)?, d), run(place(&read_ids, s)?, s))))
        .collect::<Result<Vec<_>>>()?;
    let (mut written, mut read) = (Vec::new(), Vec::new());
    for (_, guard) in held.iter_mut() {
        match guard {
            Guard::Write(g) => written.push(&mut **g),
            Guard::Read(g) => read.push(&**g),
        }
    }
    Storage::foreach_copy(ForeachCopy {
        written,
        read,
        copies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use half::{bf16, f16};

    fn bits(t: &Tensor) -> (DType, Vec<u64>) {
        let v = match t.dtype() {
            DType::F32 => t
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            DType::BF16 => t
                .to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            DType::F16 => t
                .to_vec::<f16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            d => panic!("no bits for {d} here"),
        };
        (t.dtype(), v)
    }

    /// The one-launch path's rules and its list (a GPU list's), run here through the CPU
    /// backend's list copy: every cast between f32, bf16 and f16 and the byte copies, more
    /// pairs than a launch takes, into odd-offset views of flat tensors, give `copy_`'s bits
    /// (NaNs with payloads, infinities, signed zeros, subnormals, rounding ties).
    #[test]
    fn the_list_path_casts_as_copy_does() {
        let cpu = Device::Cpu;
        let specials = [
            0x7fc0_0000u32,
            0xffc0_0000,
            0x7f80_0001,
            0x7fa0_0000,
            0x7f80_0000,
            0xff80_0000,
            0,
            0x8000_0000,
            1,
            0x807f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_1000,
            0x3f80_3000,
            0x477f_efff,
            0x477f_f000,
            0x3300_0000,
            0x33c0_0000,
            0x387f_c000,
            0x7f7f_ffff,
        ];
        let mut values: Vec<f32> = specials.iter().map(|&b| f32::from_bits(b)).collect();
        values.extend((0..200).map(|i| (i as f32 - 100.0) * 0.377));
        let n = values.len();
        let wide = Tensor::from_vec(values, [n], cpu).unwrap();
        let floats = [DType::F32, DType::BF16, DType::F16];
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        let flats: Vec<Tensor> = floats
            .iter()
            .map(|&d| Tensor::zeros([80 * n], d, cpu).unwrap())
            .collect();
        for i in 0..70 {
            let (from, to) = (floats[i % 3], floats[(i / 3) % 3]);
            let len = (i * 13) % n;
            src.push(
                wide.narrow(0, i % 7, len.min(n - i % 7))
                    .unwrap()
                    .to_dtype(from)
                    .unwrap(),
            );
            let len = src[i].numel();
            // Every other destination a view of a flat tensor at an odd offset.
            let d = match i % 2 {
                0 => Tensor::zeros([len], to, cpu).unwrap(),
                _ => flats[(i / 3) % 3].narrow(0, i * n + 1, len).unwrap(),
            };
            dst.push(d);
        }
        assert!(plain_list(&dst, &src, cpu), "a plain list");
        copy_fused(&dst, &src).unwrap();
        for (i, (d, s)) in dst.iter().zip(&src).enumerate() {
            let expected = Tensor::zeros(d.dims(), d.dtype(), cpu).unwrap();
            expected.copy_(s).unwrap();
            assert_eq!(
                bits(d),
                bits(&expected),
                "pair {i}: {} into {}",
                s.dtype(),
                d.dtype()
            );
        }
        // Each written storage's version bumped once, as one write.
        let version = flats[0].version();
        copy_fused(&dst, &src).unwrap();
        assert_eq!(flats[0].version(), version + 1);
    }

    /// What the one-launch path leaves to `copy_`: a pair of f64 or of an integer beside a
    /// float, shapes that differ, a transposed source, a source that is also written.
    #[test]
    fn other_lists_are_not_plain() {
        let cpu = Device::Cpu;
        let t = |dims: &[usize], d| Tensor::zeros(dims, d, cpu).unwrap();
        let f32s = t(&[4], DType::F32);
        assert!(plain_list(&[t(&[4], DType::BF16)], &[f32s.clone()], cpu));
        assert!(!plain_list(&[t(&[4], DType::F64)], &[f32s.clone()], cpu));
        assert!(!plain_list(&[t(&[4], DType::BF16)], &[t(&[4], DType::I64)], cpu));
        assert!(!plain_list(&[t(&[2, 2], DType::BF16)], &[f32s.clone()], cpu));
        assert!(!plain_list(
            &[t(&[3, 2], DType::F16)],
            &[t(&[2, 3], DType::F32).t().unwrap()],
            cpu
        ));
        let flat = t(&[8], DType::F32);
        let (a, b) = (flat.narrow(0, 0, 4).unwrap(), flat.narrow(0, 4, 4).unwrap());
        assert!(!plain_list(
            &[a.to_dtype(DType::BF16).unwrap(), b],
            &[f32s, a],
            cpu
        ));
        assert!(!plain_list(
            &[t(&[4], DType::BF16)],
            &[t(&[4], DType::F32)],
            Device::Cuda(0)
        ));
    }
}
