//! CPU kernels of GradScaler's device side (`ops/amp_scaling.rs`, reached through
//! its `AmpOps` below): the inf/NaN check and unscale of one gradient, and the scale update. The
//! arithmetic is `kernels/amp.cu`'s: each element is loaded to its arithmetic type (f32 for
//! f16/bf16/f32, f64 for f64), checked, then multiplied by the f32 inverse scale (not at all
//! when it is exactly 1) and rounded once on store; the scale update multiplies in f64 and
//! rounds to f32.

use super::optim::{scalar, scalar_mut, OptimAcc, OptimElement};
use super::CpuStorage;
use super::{PAR_CHUNK, PAR_THRESHOLD};
use crate::backend::host::CpuElement;
use crate::backend::{AmpOps, BackendStorage, Elems, ForeachNorm, ScaleUpdate, UnscaleGrads};
use crate::DType;
use crate::Result;
use half::{bf16, f16};
use rayon::prelude::*;

/// Multiplies every element of `values` by `inv_scale` in place; true when any element was inf
/// or NaN before the multiplication.
pub(crate) fn non_finite_check_and_unscale<T: OptimElement>(values: &mut [T], inv_scale: f32) -> bool {
    let piece = |chunk: &mut [T]| -> bool {
        let inv = <T::A as OptimAcc>::from_f64(inv_scale as f64);
        let mut found = false;
        for x in chunk.iter_mut() {
            let v = x.load();
            found |= !is_finite(v);
            if inv_scale != 1.0 {
                *x = T::store(v * inv);
            }
        }
        found
    };
    if values.len() > PAR_THRESHOLD {
        super::threads::parallel(|| {
            values
                .par_chunks_mut(PAR_CHUNK)
                .map(piece)
                .reduce(|| false, |a, b| a | b)
        })
    } else {
        piece(values)
    }
}

/// True for a value that is neither inf nor NaN (`v - v` is 0 exactly for finite values).
#[inline]
#[allow(clippy::eq_op)] // `v - v` is the test itself: NaN for inf and NaN, 0 otherwise.
fn is_finite<A: OptimAcc>(v: A) -> bool {
    let zero = v - v;
    !zero.is_nan()
}

/// `torch._amp_update_scale_` on host values (the rule is in `kernels/amp.cu`'s contract).
pub(crate) fn update_scale(
    scale: &mut f32,
    growth_tracker: &mut i32,
    found_inf: f32,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i32,
) {
    if found_inf != 0.0 {
        *scale = (*scale as f64 * backoff_factor) as f32;
        *growth_tracker = 0;
    } else {
        let successful = growth_tracker.wrapping_add(1);
        if successful == growth_interval {
            let grown = (*scale as f64 * growth_factor) as f32;
            if grown.is_finite() {
                *scale = grown;
            }
            *growth_tracker = 0;
        } else {
            *growth_tracker = successful;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn unscale_multiplies_and_finds_non_finite_values() {
        let mut v = vec![1.0f32, -4.0, 0.5];
        assert!(!non_finite_check_and_unscale(&mut v, 0.25));
        assert_eq!(v, [0.25, -1.0, 0.125]);
        let mut v = vec![1.0f64, f64::NAN, 2.0];
        assert!(non_finite_check_and_unscale(&mut v, 0.5));
        assert_eq!((v[0], v[2]), (0.5, 1.0));
        let mut v = vec![f16::from_f32(2.0), f16::INFINITY];
        assert!(non_finite_check_and_unscale(&mut v, 0.5));
        assert_eq!(v[0], f16::from_f32(1.0));
        let mut v = vec![bf16::from_f32(3.0); 3];
        assert!(!non_finite_check_and_unscale(&mut v, 1.0));
        assert_eq!(v, [bf16::from_f32(3.0); 3]);
    }

    #[test]
    fn unscale_of_a_large_tensor_runs_in_pieces() {
        let mut v = vec![2.0f32; PAR_THRESHOLD + 5];
        *v.last_mut().unwrap() = f32::NEG_INFINITY;
        assert!(non_finite_check_and_unscale(&mut v, 0.5));
        assert!(v[..PAR_THRESHOLD].iter().all(|&x| x == 1.0));
    }

    #[test]
    fn scale_update_rules() {
        let (mut s, mut t) = (1024.0f32, 1);
        update_scale(&mut s, &mut t, 1.0, 2.0, 0.5, 3);
        assert_eq!((s, t), (512.0, 0));
        update_scale(&mut s, &mut t, 0.0, 2.0, 0.5, 3);
        update_scale(&mut s, &mut t, 0.0, 2.0, 0.5, 3);
        assert_eq!((s, t), (512.0, 2));
        update_scale(&mut s, &mut t, 0.0, 2.0, 0.5, 3);
        assert_eq!((s, t), (1024.0, 0));
        update_scale(&mut s, &mut t, f32::NAN, 2.0, 0.5, 3);
        assert_eq!((s, t), (512.0, 0));
        // Growth that would overflow f32 keeps the scale but resets the tracker.
        let (mut s, mut t) = (f32::MAX, 0);
        update_scale(&mut s, &mut t, 0.0, 2.0, 0.5, 1);
        assert_eq!((s, t), (f32::MAX, 0));
    }
}

impl AmpOps for CpuStorage {
    fn non_finite_check_and_unscale(
        mut grads: UnscaleGrads<'_, CpuStorage>,
        found_inf: Elems<&mut CpuStorage>,
        inv_scale: Elems<&CpuStorage>,
    ) -> Result<()> {
        fn run<T: OptimElement>(storage: &mut CpuStorage, g: &Elems<usize>, inv: f32) -> bool {
            let values = &mut T::slice_mut(storage).expect("dtype checked")[g.offset..g.offset + g.len];
            self::non_finite_check_and_unscale(values, inv)
        }
        let inv = scalar::<f32>(&inv_scale);
        let mut found = false;
        for g in &grads.grads {
            let s = &mut *grads.storages[g.storage];
            found |= match s.dtype() {
                DType::F32 => run::<f32>(s, g, inv),
                DType::F64 => run::<f64>(s, g, inv),
                DType::F16 => run::<f16>(s, g, inv),
                DType::BF16 => run::<bf16>(s, g, inv),
                _ => unreachable!("floating dtype checked"),
            };
        }
        if found {
            *scalar_mut::<f32>(found_inf) = 1.0;
        }
        Ok(())
    }

    fn foreach_norm(list: ForeachNorm<'_, CpuStorage>, norms: Elems<&mut CpuStorage>) -> Result<()> {
        // Summed in f64 and rounded once to f32; NaN wins, as on the GPU.
        fn norm<T: CpuElement>(s: &CpuStorage, r: &Elems<usize>, inf_norm: bool) -> f32 {
            let values = &T::slice(s).expect("dtype checked")[r.offset..r.offset + r.len];
            let mut acc = 0f64;
            for v in values.iter().map(|v| v.to_f64()) {
                acc = match inf_norm {
                    true if v.is_nan() || acc.is_nan() => f64::NAN,
                    true => acc.max(v.abs()),
                    false => acc + v * v,
                };
            }
            (if inf_norm { acc } else { acc.sqrt() }) as f32
        }
        let out: Vec<f32> = list
            .tensors
            .iter()
            .map(|r| {
                let s = list.storages[r.storage];
                match s.dtype() {
                    DType::F32 => norm::<f32>(s, r, list.inf_norm),
                    DType::F64 => norm::<f64>(s, r, list.inf_norm),
                    DType::F16 => norm::<f16>(s, r, list.inf_norm),
                    DType::BF16 => norm::<bf16>(s, r, list.inf_norm),
                    _ => unreachable!("floating dtype checked"),
                }
            })
            .collect();
        let dst = f32::slice_mut(norms.storage).expect("f32 checked");
        dst[norms.offset..norms.offset + out.len()].copy_from_slice(&out);
        Ok(())
    }

    fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut CpuStorage>,
        growth_tracker: Elems<&mut CpuStorage>,
        found_inf: Elems<&CpuStorage>,
    ) -> Result<()> {
        self::update_scale(
            scalar_mut::<f32>(scale),
            scalar_mut::<i32>(growth_tracker),
            scalar::<f32>(&found_inf),
            u.growth_factor,
            u.backoff_factor,
            u.growth_interval,
        );
        Ok(())
    }
}
