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
//!
//! Note [Coalesced reduce]: the way back. `nn::DataParallel` sums each parameter's gradients
//! from every replica on the first device. Through each copy's own backward that was one
//! copy between GPUs and one add per parameter: in a CPU trace of dp_cnn on two H200s, 8
//! copies of 11 to 64 µs and 8 adds of 6 to 19 µs of host time per step, about 290 µs on the
//! thread running the second replica's backward, the step's longest path.
//! [`reduce_add_coalesced`] (PyTorch's, which its `Broadcast`'s backward uses) gathers each
//! device's small gradients into one flat buffer, copies it once, adds the buffers and copies
//! the sum out into fresh tensors (`.grad` then keeps them as they are): five launches for
//! the cnn on two GPUs. PyTorch's `_take_tensors` rule makes the buffers: per dtype, up to
//! `buffer_size`, a larger tensor alone (the small ones on either side of it share a buffer).
//! - Order: the tensors alone are summed first, then the buffers, each last entry first. A
//!   buffer's copy waits for everything queued on its device (all of a replica's backward),
//!   while a gradient computed in row blocks crosses as its rows are written (Note
//!   [Gradients in row blocks]): queued behind a buffer, or behind a larger gradient written
//!   later on the same copy stream, it waited. In a trace of dp_mlp_large on two H200s the
//!   second layer's 40 MB gradient, summed after the first layer's, crossed behind that
//!   layer's four blocks, 0.6 ms after it was written.
//! - A gradient computed in row blocks is added block by block: each block's rows of the sum
//!   are written once that block has crossed, so only the last block's add follows the last
//!   block's copy, not an add of the whole 200 MB (142 us on an H200).

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
    let op = &crate::dispatch::policy::BROADCAST_COALESCED;
    let out = crate::dispatch::enter(op, Device::Cuda(source), |door| {
        let mut out: Vec<Vec<Option<Tensor>>> = vec![vec![None; tensors.len()]; devices.len()];
        for bucket in &buckets(tensors, buffer_size) {
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
                        false => copy.into_copy_of(&tensors[i], door),
                    });
                }
            }
        }
        Ok::<_, Error>(out)
    })?;
    Ok(out
        .into_iter()
        .map(|list| {
            list.into_iter()
                .map(|t| t.expect("every tensor is placed"))
                .collect()
        })
        .collect())
}

/// Sums the tensors of `inputs`, one list per GPU, on GPU `destination`
/// (`torch.cuda.comm.reduce_add_coalesced(inputs, destination, buffer_size)`): entry `j` of
/// the result is the sum of entry `j` of every list. The lists have the same length, their
/// `j`-th tensors the same shape and dtype, and each list's tensors lie on one GPU. Small
/// tensors cross per dtype in flat buffers of at most `buffer_size` bytes, as in
/// [`broadcast_coalesced`]: a gather per list, a copy per other GPU, an add per list after
/// the first and one copy out into the results; a larger tensor, or one left without company,
/// crosses alone (Note [Coalesced reduce]). The results are tensors of their own, not views
/// of a buffer: sums are new tensors, and an entry with a single input already on the
/// destination is that input.
///
/// The inputs are taken: a tensor nothing else holds (a gradient handed on in backward) is
/// read by a copy on a side stream of its device, as [`Tensor::to`] does with a gradient in
/// backward, and a weight gradient computed in row blocks crosses block by block (Note
/// [Gradients in row blocks]).
///
/// An error when `inputs` is empty, the lists differ in length, or their tensors in shape,
/// dtype or device as above.
pub fn reduce_add_coalesced(
    inputs: Vec<Vec<Tensor>>,
    destination: usize,
    buffer_size: usize,
) -> Result<Vec<Tensor>> {
    let Some(first) = inputs.first() else {
        return Err(Error::invalid(
            "reduce_add_coalesced",
            "expected at least one list of tensors; pass one list per device",
        ));
    };
    let n = first.len();
    if let Some((i, list)) = inputs.iter().enumerate().find(|(_, l)| l.len() != n) {
        return Err(Error::invalid(
            "reduce_add_coalesced",
            format!(
                "list {i} holds {} tensors but list 0 holds {n}; every list needs one tensor per entry",
                list.len()
            ),
        ));
    }
    for (i, list) in inputs.iter().enumerate() {
        let device = list.first().map(Tensor::device);
        for (j, (t, f)) in list.iter().zip(first).enumerate() {
            if !matches!(t.device(), Device::Cuda(_)) || Some(t.device()) != device {
                return Err(Error::invalid(
                    "reduce_add_coalesced",
                    format!(
                        "every tensor of a list must be on the same GPU, but tensor {j} of list {i} is on {}",
                        t.device()
                    ),
                ));
            }
            if t.dims() != f.dims() || t.dtype() != f.dtype() {
                return Err(Error::invalid(
                    "reduce_add_coalesced",
                    format!(
                        "tensor {j} of list {i} is {:?} {:?} but tensor {j} of list 0 is {:?} {:?}; the lists must match",
                        t.dtype(), t.dims(), f.dtype(), f.dims()
                    ),
                ));
            }
        }
    }
    let dest = Device::Cuda(destination);
    let groups = buckets(first, buffer_size);
    // The list already on the destination first: the sums start from it.
    let mut lists: Vec<Vec<Option<Tensor>>> = inputs
        .into_iter()
        .map(|l| l.into_iter().map(Some).collect())
        .collect();
    lists.sort_by_key(|l| l.first().and_then(Option::as_ref).map(|t| t.device()) != Some(dest));
    let mut out: Vec<Option<Tensor>> = vec![None; n];
    let add = |acc: Option<Tensor>, t: Tensor| -> Result<Option<Tensor>> {
        Ok(Some(match acc {
            None => t,
            Some(a) => a.add(&t)?,
        }))
    };
    // The tensors alone first, then the buffers (whose copies wait for everything queued
    // on their devices), each last entries first: a module's last parameters get their
    // gradients first in backward (Note [Coalesced reduce]).
    let alone = groups.iter().rev().filter(|g| g.len() == 1);
    for group in alone.chain(groups.iter().rev().filter(|g| g.len() > 1)) {
        if let [j] = group[..] {
            let mut sum = None;
            for list in &mut lists {
                let t = list[j].take().expect("each entry is taken once");
                sum = Some(match sum {
                    None => cross(t, dest)?,
                    Some(acc) => add_crossing(acc, t, dest)?,
                });
            }
            out[j] = sum;
            continue;
        }
        // No handle of ours outlives its entry's turn (a list's tensors are read privately
        // when nothing else holds them), but the last list's, which give the results' shapes.
        let mut sum = None;
        let mut last = Vec::new();
        for list in &mut lists {
            let own: Vec<Tensor> = group
                .iter()
                .map(|&j| list[j].take().expect("each entry is taken once"))
                .collect();
            let Device::Cuda(device) = own[0].device() else {
                unreachable!("checked above: every tensor is on a GPU")
            };
            let members: Vec<&Tensor> = own.iter().collect();
            let (offsets, len) = layout(&members);
            let flat = gather(&members, &offsets, len, device)?;
            sum = add(sum, cross(flat, dest)?)?;
            last = own;
        }
        let sum = sum.expect("there is at least one list");
        let members: Vec<&Tensor> = last.iter().collect();
        let (offsets, _) = layout(&members);
        let fresh = members
            .iter()
            .map(|t| Tensor::empty(t.dims(), t.dtype(), dest))
            .collect::<Result<Vec<_>>>()?;
        crate::foreach_copy_(&fresh, &slots(&sum, &members, &offsets)?)?;
        for (&j, t) in group.iter().zip(fresh) {
            out[j] = Some(t);
        }
    }
    Ok(out
        .into_iter()
        .map(|t| t.expect("every entry is summed"))
        .collect())
}

/// `t` on `dest`, taken: as a gradient handed on in backward is copied (a side stream when
/// nothing else holds it, block by block when computed in row blocks).
fn cross(t: Tensor, dest: Device) -> Result<Tensor> {
    match t.device() == dest {
        true => Ok(t),
        false => t.gradient_to(dest),
    }
}

/// `acc + t` on `dest`, where `acc` lies, `t` taken and crossing as in [`cross`]. A gradient
/// computed in row blocks crosses block by block, and each block's rows of the sum are
/// written once that block has crossed, so only the last block's add follows the last
/// block's copy (Note [Coalesced reduce]).
fn add_crossing(acc: Tensor, t: Tensor, dest: Device) -> Result<Tensor> {
    let Device::Cuda(d) = dest else {
        return acc.add(&cross(t, dest)?);
    };
    let blockwise = t.device() != dest
        && t.rank() == 2
        && t.is_contiguous()
        && t.is_private()
        && acc.dims() == t.dims()
        && acc.dtype() == t.dtype();
    let blocks = match blockwise {
        true => super::take_gradient_row_events(&t),
        false => None,
    };
    let Some(blocks) = blocks.filter(|b| crate::cuda_backend::storage::tile(b, t.dims()[1], t.numel()))
    else {
        return acc.add(&cross(t, dest)?);
    };
    let _no_grad = crate::no_grad();
    let sum = Tensor::empty(acc.dims(), acc.dtype(), dest)?;
    for b in blocks {
        let (start, len) = (b.rows.start, b.rows.len());
        let rows = gradient_rows_to(&t.narrow(0, start, len)?, d, b.event)?;
        acc.narrow(0, start, len)?
            .add_out(&rows, &sum.narrow(0, start, len)?)?;
    }
    Ok(sum)
}

/// The rows of a gradient computed in row blocks (`t`, a contiguous 2-D view of some of its
/// rows on a GPU) on GPU `device`, copied once `written` (the event of the block that wrote
/// them) has completed, on a side stream: neither device's current stream waits for the rest
/// of the gradient's product (Note [Gradients in row blocks]). The caller holds the whole
/// gradient privately, so nothing else writes these rows.
fn gradient_rows_to(t: &Tensor, device: usize, written: crate::cuda_backend::Event) -> Result<Tensor> {
    crate::dispatch::call_with(&crate::dispatch::policy::TO, [t], |[x], door| {
        let rows = crate::cuda_backend::RowBlockEvent {
            rows: 0..x.dims()[0],
            event: written,
        };
        if x.rank() != 2 || !x.is_contiguous() || !matches!(x.device(), Device::Cuda(_)) {
            return Err(Error::invalid(
                "gradient_rows_to",
                "expected a contiguous 2-D tensor on a GPU",
            ));
        }
        let blocks = Some(std::slice::from_ref(&rows));
        let storage = x
            .storage()
            .read()
            .to_device_private(x.layout(), device, blocks, x.dims()[1])?;
        Ok(door.tensor(storage, x.shape()))
    })
}

/// `tensor.to(cuda:device)` for a 2-D tensor on another GPU, copied in `blocks` row blocks
/// that later ops may read as they arrive (Note [Copies in row blocks] in ember-core's
/// `storage/row_blocks.rs`): `linear` with the copy as its weight computes each block of its
/// output's columns once that block's rows are there, so the copy overlaps the product, and
/// the source's own `linear` does not wait for the copy either. Every other op on the copy
/// or the source waits for the whole copy first. Differentiable as [`Tensor::to`] is. One
/// block is one such copy, read once it is complete, with neither device's stream waiting for
/// it. A tensor of another rank, not contiguous, without rows, on the CPU or already on
/// `device`, or `blocks` of 0, is copied as `to` copies it.
pub fn to_in_row_blocks(tensor: &Tensor, device: usize, blocks: usize) -> Result<Tensor> {
    crate::dispatch::call_with(&crate::dispatch::policy::TO, [tensor], |[x], door| {
        let ranges = crate::cuda_backend::row_block_ranges(x.dims().first().copied().unwrap_or(0), blocks);
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
        let copy = door.tensor(crate::storage::Storage::Cuda(storage), x.shape());
        crate::storage::row_blocks::record_copy((x.storage(), from), (copy.storage(), device), events, done);
        Ok(copy.into_copy_of(x, door))
    })
}

/// The indices of `tensors` grouped into flat buffers: per dtype, in order, at most
/// `buffer_size` bytes each; a tensor of `buffer_size` or more alone, the small ones on
/// either side of it in one buffer (as PyTorch's `_take_tensors`).
fn buckets(tensors: &[Tensor], buffer_size: usize) -> Vec<Vec<usize>> {
    let size = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let bytes = size(t);
        let open = buckets
            .iter_mut()
            .rev()
            .filter(|b| !matches!(b[..], [j] if size(&tensors[j]) >= buffer_size))
            .find(|b| tensors[b[0]].dtype() == t.dtype());
        match open {
            _ if bytes >= buffer_size => buckets.push(vec![i]),
            Some(b) if bucket_bytes(tensors, b) + bytes <= buffer_size => b.push(i),
            _ => buckets.push(vec![i]),
        }
    }
    buckets
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
