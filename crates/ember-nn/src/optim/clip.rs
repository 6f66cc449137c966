//! Gradient clipping (`torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`): both scale or
//! clamp the `.grad` of each parameter in place and skip parameters without a gradient.
//!
//! `clip_grad_norm_` follows PyTorch's order of operations: the norm of each gradient, the norm
//! of those norms (stacked), `coef = clamp(1 / (total + 1e-6) * max_norm, max = 1)`, then every
//! gradient multiplied by `coef`, always (no branch on the host, so no device sync).

use ember_core::{DType, Device, Result, Tensor};

/// Scales the gradients of `params` so that their joint `norm_type`-norm is at most `max_norm`
/// (`torch.nn.utils.clip_grad_norm_` with `error_if_nonfinite=False`); returns the total norm
/// before clipping as a 0-d tensor (0.0 in f32 on the CPU when no parameter has a gradient).
/// `norm_type` may be `f64::INFINITY` (the largest absolute value).
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Tensor> {
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.grad()).collect();
    if grads.is_empty() {
        return Tensor::scalar(0.0, DType::F32, Device::Cpu);
    }
    let _g = ember_core::no_grad();
    let device = grads[0].device();
    // PyTorch's foreach path: float32 gradients on one GPU take one multi-tensor norm and one
    // multi-tensor multiply (a few launches for any number of gradients); the others a norm
    // and a multiply each. Neither reads anything back.
    let foreach = device.is_cuda()
        && (norm_type == 2.0 || norm_type == f64::INFINITY)
        && grads
            .iter()
            .all(|g| g.device() == device && g.dtype() == DType::F32);
    let norms = if foreach {
        ember_core::fused::foreach_norm(&grads, norm_type)?
    } else {
        let norms = grads
            .iter()
            .map(|g| g.norm(norm_type, &[], false)?.to(device))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&norms, 0)?
    };
    let total_norm = norms.norm(norm_type, &[], false)?;
    // `max_norm / t` is `t.reciprocal() * max_norm` in PyTorch (`Tensor.__rtruediv__`).
    let clip_coef = total_norm.add_scalar(1e-6)?.reciprocal()?.mul_scalar(max_norm)?;
    let clip_coef = clip_coef.clamp(None, Some(1.0))?;
    if foreach {
        ember_core::fused::foreach_mul_(&grads, &clip_coef.reshape([1])?)?;
    } else {
        for g in &grads {
            g.mul_(&clip_coef.to(g.device())?)?;
        }
    }
    Ok(total_norm)
}

/// Clamps every gradient of `params` to `[-clip_value, clip_value]` in place
/// (`torch.nn.utils.clip_grad_value_`).
pub fn clip_grad_value_(params: &[Tensor], clip_value: f64) -> Result<()> {
    let _g = ember_core::no_grad();
    for g in params.iter().filter_map(|p| p.grad()) {
        g.clamp_(Some(-clip_value), Some(clip_value))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_with_grad(grad: &[f64]) -> Tensor {
        let p = Tensor::zeros([grad.len()], DType::F64, Device::Cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        p.set_grad(Some(Tensor::from_slice(grad, [grad.len()], Device::Cpu).unwrap()))
            .unwrap();
        p
    }

    fn grad(p: &Tensor) -> Vec<f64> {
        p.grad().unwrap().to_vec_f64().unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + b.abs())
    }

    #[test]
    fn l2_norm_scales_down() {
        // Gradients [3, 4] and [12]: total norm √(9 + 16 + 144) = 13; coef = 6.5 / (13 + 1e-6).
        let (a, b, c) = (
            param_with_grad(&[3.0, 4.0]),
            param_with_grad(&[12.0]),
            param_with_grad(&[0.0]),
        );
        c.set_grad(None).unwrap();
        let total = clip_grad_norm_(&[a.clone(), b.clone(), c.clone()], 6.5, 2.0).unwrap();
        assert_eq!(total.rank(), 0);
        assert!(close(total.item_f64().unwrap(), 13.0));
        let coef = 6.5 / (13.0 + 1e-6);
        let (ga, gb) = (grad(&a), grad(&b));
        assert!(close(ga[0], 3.0 * coef) && close(ga[1], 4.0 * coef) && close(gb[0], 12.0 * coef));
        assert!(c.grad().is_none());
    }

    #[test]
    fn small_norm_is_left_alone() {
        // Total norm 5 < 10: coef clamps to 1 and the gradients are unchanged.
        let a = param_with_grad(&[3.0, -4.0]);
        let total = clip_grad_norm_(std::slice::from_ref(&a), 10.0, 2.0).unwrap();
        assert!(close(total.item_f64().unwrap(), 5.0));
        assert_eq!(grad(&a), [3.0, -4.0]);
    }

    #[test]
    fn inf_and_one_norms() {
        // inf: max |g| = 4 over both params; coef = 2 / (4 + 1e-6).
        let (a, b) = (param_with_grad(&[3.0, -4.0]), param_with_grad(&[1.0]));
        let total = clip_grad_norm_(&[a.clone(), b.clone()], 2.0, f64::INFINITY).unwrap();
        assert!(close(total.item_f64().unwrap(), 4.0));
        assert!(close(grad(&a)[1], -4.0 * 2.0 / (4.0 + 1e-6)));
        // 1-norm: |3| + |-4| + |1| = 8.
        let (a, b) = (param_with_grad(&[3.0, -4.0]), param_with_grad(&[1.0]));
        let total = clip_grad_norm_(&[a, b.clone()], 1.0, 1.0).unwrap();
        assert!(close(total.item_f64().unwrap(), 8.0));
        assert!(close(grad(&b)[0], 1.0 / (8.0 + 1e-6)));
    }

    #[test]
    fn no_grads_gives_zero() {
        let p = Tensor::zeros([2], DType::F64, Device::Cpu).unwrap();
        let total = clip_grad_norm_(&[p], 1.0, 2.0).unwrap();
        assert_eq!(total.item_f64().unwrap(), 0.0);
        assert!(clip_grad_norm_(&[param_with_grad(&[1.0])], 1.0, f64::NAN).is_err());
    }

    #[test]
    fn clip_by_value() {
        let a = param_with_grad(&[-3.0, 0.5, 2.0]);
        clip_grad_value_(std::slice::from_ref(&a), 1.0).unwrap();
        assert_eq!(grad(&a), [-1.0, 0.5, 1.0]);
    }
}
