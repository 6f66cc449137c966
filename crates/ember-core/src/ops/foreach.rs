//! Ops over lists of tensors (PyTorch's `torch._foreach_*`): [`foreach_copy_`].
//!
//! Note [Foreach copies]: `foreach_copy_(dst, src)` is `dst[i].copy_(src[i])` for every `i`,
//! with `copy_`'s semantics (broadcasting, dtype and device conversion, autograd's rules for
//! in-place writes). Where every pair is plain (one CUDA device for all, the same dtype and
//! shape within a pair, both contiguous, nothing requiring grad, no two destinations
//! overlapping, no storage both written and read) the copies run as one kernel launch per 64
//! pairs (`cuda_backend/multi_copy.rs`); any other list takes `copy_` pair by pair. A list whose
//! destinations share a device passes the dispatch point once as `_foreach_copy_` (the
//! profiler's op), either way. A launch costs the host about what one `copy_` costs, so
//! gathering a bucket of gradients (DistributedDataParallel) costs one copy instead of one per
//! parameter. Each written storage's version is bumped once.

use super::fused_optim::Guard;
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
    let plain = |t: &Tensor| t.device() == Device::Cuda(ordinal) && t.is_contiguous() && !t.requires_grad();
    let pairs_plain = dst
        .iter()
        .zip(src)
        .all(|(d, s)| plain(d) && plain(s) && d.dtype() == s.dtype() && d.dims() == s.dims());
    if !pairs_plain {
        return None;
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
        return None;
    }
    let mut written_ids: Vec<usize> = written.iter().map(|w| w.0).collect();
    written_ids.dedup();
    let read_from_written = src
        .iter()
        .any(|s| written_ids.binary_search(&s.storage().id()).is_ok());
    (!read_from_written).then_some(ordinal)
}

/// The one-launch path: locks every storage once (written ones for writing, which bumps their
/// versions), in the order of their ids so that two calls never wait on each other, then hands
/// the element runs to the backend's multi-tensor copy.
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
