//! `torch.cuda.comm`: copying many tensors from one GPU to others in few operations.
//!
//! Note [Coalesced broadcast]: `nn::DataParallel` copies every parameter and buffer of the
//! module to each other GPU on every forward. One `to` per tensor costs 9 to 13 µs of host
//! time on an H100 host (an allocation, four event operations and the peer copy), and the
//! cnn of the shared benchmarks has eight: about 100 µs, against 500 µs for a whole step on
//! one GPU. As in PyTorch's `broadcast_coalesced`, the tensors below `buffer_size` bytes are
//! gathered per dtype into flat buffers (one `_foreach_copy_`, one launch), each buffer
//! crosses to each device in one copy, and the copies there are views of it. A tensor of
//! `buffer_size` or more goes alone, with no gather, as does one whose buffer got no other
//! tensor. Unlike PyTorch's function, which is not differentiable, each copy of a tensor that
//! requires grad is differentiable as `Tensor::to`'s result is (PyTorch's `Broadcast`
//! autograd function, which `replicate` uses): its gradient flows back to the source through
//! the same private peer copy. Timed on two H100s, DataParallel's replicate of that cnn
//! went from 137 to 160 µs of host time per step to 72 to 93 µs.

use crate::{Device, Error, Result, Tensor};

/// PyTorch's default `buffer_size` for [`broadcast_coalesced`]: 10 MiB.
pub const DEFAULT_BUFFER_SIZE: usize = 10 * 1024 * 1024;

/// Copies `tensors`, all on GPU `devices[0]`, to every GPU of `devices`
/// (`torch.cuda.comm.broadcast_coalesced(tensors, devices, buffer_size)`): one list per device,
/// in the order of `devices`, the first holding `tensors` themselves. Tensors smaller than
/// `buffer_size` bytes travel together, per dtype, in flat buffers of at most that size, and
/// their copies are views of the buffer on their device; larger ones, and one left without
/// company, travel alone (Note [Coalesced broadcast]). Under grad mode, the copy of a tensor
/// that requires grad carries its gradient back to it, as [`Tensor::to`] does.
///
/// An error when `devices` is empty or a tensor is not on `devices[0]`.
pub fn broadcast_coalesced(
    tensors: &[Tensor],
    devices: &[usize],
    buffer_size: usize,
) -> Result<Vec<Vec<Tensor>>> {
    let Some(&source) = devices.first() else {
        return Err(Error::invalid(
            "broadcast_coalesced",
            "expected at least one device; devices[0] is the one the tensors are on",
        ));
    };
    if let Some(t) = tensors.iter().find(|t| t.device() != Device::Cuda(source)) {
        return Err(Error::invalid(
            "broadcast_coalesced",
            format!(
                "every tensor must be on devices[0] (cuda:{source}), but one is on {}; move it there first",
                t.device()
            ),
        ));
    }
    let mut out: Vec<Vec<Option<Tensor>>> = vec![vec![None; tensors.len()]; devices.len()];
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let bytes = t.numel() * t.dtype().size_in_bytes();
        let open = buckets
            .iter_mut()
            .rev()
            .find(|b| tensors[b[0]].dtype() == t.dtype());
        match open {
            _ if bytes >= buffer_size => buckets.push(vec![i]),
            Some(b) if bucket_bytes(tensors, b) + bytes <= buffer_size => b.push(i),
            _ => buckets.push(vec![i]),
        }
    }
    for bucket in &buckets {
        if let [i] = bucket[..] {
            // Alone: copied from where it lies, with no gather.
            for (j, &d) in devices.iter().enumerate() {
                out[j][i] = Some(tensors[i].to(Device::Cuda(d))?);
            }
            continue;
        }
        let members: Vec<&Tensor> = bucket.iter().map(|&i| &tensors[i]).collect();
        let (offsets, len) = layout(&members);
        let flat = gather(&members, &offsets, len, source)?;
        for (j, &d) in devices.iter().enumerate() {
            let remote = flat.to(Device::Cuda(d))?;
            let copies = slots(&remote, &members, &offsets)?;
            for (&i, copy) in bucket.iter().zip(copies) {
                out[j][i] = Some(match d == source {
                    true => tensors[i].clone(),
                    false => copy.into_copy_of(&tensors[i]),
                });
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|list| {
            list.into_iter()
                .map(|t| t.expect("every tensor is placed"))
                .collect()
        })
        .collect())
}

/// `tensor.to(cuda:device)` for a 2-D tensor on another GPU, copied in `blocks` row blocks
/// that later ops may read as they arrive (Note [Copies in row blocks] in ember-core's
/// `cuda/row_blocks.rs`): `linear` with the copy as its weight computes each block of its
/// output's columns once that block's rows are there, so the copy overlaps the product, and
/// the source's own `linear` does not wait for the copy either. Every other op on the copy
/// or the source waits for the whole copy first. Differentiable as [`Tensor::to`] is. One
/// block is one such copy, read once it is complete, with neither device's stream waiting for
/// it. A tensor of another rank, not contiguous, without rows, on the CPU or already on
/// `device`, or `blocks` of 0, is copied as `to` copies it.
pub fn to_in_row_blocks(tensor: &Tensor, device: usize, blocks: usize) -> Result<Tensor> {
    crate::dispatch::call_with(&crate::dispatch::policy::TO, [tensor], |[x]| {
        let ranges = super::row_block_ranges(x.dims().first().copied().unwrap_or(0), blocks);
        let Device::Cuda(from) = x.device() else {
            return x.to(Device::Cuda(device));
        };
        if from == device || x.rank() != 2 || !x.is_contiguous() || ranges.is_empty() || blocks == 0 {
            return x.to(Device::Cuda(device));
        }
        let (storage, events, done) = match &*x.storage().read() {
            crate::storage::Storage::Cuda(s) => {
                s.to_device_in_row_blocks(x.layout(), device, &ranges, x.dims()[1])?
            }
            _ => return x.to(Device::Cuda(device)),
        };
        let copy = Tensor::from_storage(crate::storage::Storage::Cuda(storage), x.shape());
        super::row_blocks::record_copy((x.storage(), from), (copy.storage(), device), events, done);
        Ok(copy.into_copy_of(x))
    })
}

fn bucket_bytes(tensors: &[Tensor], bucket: &[usize]) -> usize {
    bucket
        .iter()
        .map(|&i| tensors[i].numel() * tensors[i].dtype().size_in_bytes())
        .sum()
}

/// `members` (one dtype) in one new flat tensor of `len` elements on `device`, at `offsets`
/// (from [`layout`]), in one `_foreach_copy_`. The gaps between slots hold nothing: no view
/// covers them, and the buffer's copy carries them along.
fn gather(members: &[&Tensor], offsets: &[usize], len: usize, device: usize) -> Result<Tensor> {
    let flat = Tensor::empty([len], members[0].dtype(), Device::Cuda(device))?;
    let sources = members.iter().map(|t| t.detach()).collect::<Vec<_>>();
    crate::foreach_copy_(&slots(&flat, members, offsets)?, &sources)?;
    Ok(flat)
}

/// Where each copy starts in a flat buffer: [`SLOT_ALIGN`] bytes apart at least.
const SLOT_ALIGN: usize = 256;

/// The element offset of each of `members` in their flat buffer, and the buffer's length.
/// Every slot starts [`SLOT_ALIGN`]-byte aligned, as a tensor of its own would: cuBLASLt
/// chooses its kernels, and whether to fuse a bias, by the alignment of the pointers it gets,
/// so a replica's copies get the kernels, and the numerics, of the tensors they copy.
fn layout(members: &[&Tensor]) -> (Vec<usize>, usize) {
    let per = SLOT_ALIGN / members[0].dtype().size_in_bytes();
    let mut end = 0;
    let offsets = members
        .iter()
        .map(|t| {
            let at = end;
            end = (at + t.numel()).div_ceil(per) * per;
            at
        })
        .collect();
    (offsets, end)
}

/// Views of `flat` in the shapes of `members`, at `offsets`.
fn slots(flat: &Tensor, members: &[&Tensor], offsets: &[usize]) -> Result<Vec<Tensor>> {
    members
        .iter()
        .zip(offsets)
        .map(|(t, &at)| {
            let dims: Vec<isize> = t.dims().iter().map(|&d| d as isize).collect();
            flat.narrow(0, at, t.numel())?.view(&dims)
        })
        .collect()
}
