//! Step 2 of the dispatch point: an op's autocast policy applied to its inputs while an
//! autocast region is open for their device type (see [`crate::amp`]). Only floating tensors
//! that are not float64 are cast, as in PyTorch (`is_autocast_eligible`).

use super::policy::{CastPolicy, Op};
use crate::amp;
use crate::{DType, Device, Result, Tensor};

pub(crate) use crate::amp::suspend;

fn eligible(t: &Tensor) -> bool {
    t.dtype().is_floating_point() && t.dtype() != DType::F64
}

/// Casts `inputs` of `op` on `device` as its policy says, when autocast is on there.
#[inline]
pub(crate) fn apply(op: &Op, device: Device, inputs: &mut [Tensor]) -> Result<()> {
    if op.autocast == CastPolicy::Inputs {
        return Ok(());
    }
    let Some(lower) = amp::active_dtype(device.device_type()) else {
        return Ok(());
    };
    let target = match op.autocast {
        CastPolicy::Inputs => return Ok(()),
        CastPolicy::LowerPrecision => lower,
        CastPolicy::Fp32 => DType::F32,
        // PyTorch's `promote_type`: the lower-precision dtype promoted with every eligible input.
        CastPolicy::Promote => inputs
            .iter()
            .filter(|t| eligible(t))
            .fold(lower, |d, t| d.promote(t.dtype())),
    };
    for t in inputs.iter_mut() {
        if eligible(t) && t.dtype() != target {
            *t = if op.autocast == CastPolicy::LowerPrecision {
                amp::cached_cast(t, target)?
            } else {
                t.to_dtype_preserving_strides(target)?
            };
        }
    }
    Ok(())
}
