//! Loss modules (`nn.CrossEntropyLoss`, `NLLLoss`, `MSELoss`, `L1Loss`, `BCEWithLogitsLoss`):
//! each equals its functional form with the same options, the builder's options reach the
//! forward, PyTorch's defaults hold, and the weights are buffers that move with the module.

use crate::common::{t64, values};
use ember_core::{DType, Device, Result, Tensor};
use ember_nn::functional::{self as F, Reduction};
use ember_nn::{BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, ModuleExt, NLLLoss};

const CPU: Device = Device::Cpu;
const REDUCTIONS: [Reduction; 3] = [Reduction::None, Reduction::Mean, Reduction::Sum];

fn idx(v: &[i64]) -> Tensor {
    Tensor::from_slice(v, [v.len()], CPU).unwrap()
}

/// Bitwise equality of two results: the module must call the functional form, not a copy.
fn same(a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
}

#[test]
fn cross_entropy_loss_matches_functional_with_every_option() -> Result<()> {
    let x = t64(&values(12, 3), &[4, 3], CPU);
    let t = idx(&[2, 1, 0, 1]);
    let w = t64(&[0.5, 2.0, 3.0], &[3], CPU);
    let d = CrossEntropyLoss::new();
    assert_eq!(
        (d.ignore_index, d.reduction, d.label_smoothing),
        (-100, Reduction::Mean, 0.0)
    );
    assert!(d.weight.is_none());
    same(&d.forward(&x, &t)?, &F::cross_entropy(&x, &t)?);
    for r in REDUCTIONS {
        let m = CrossEntropyLoss::new()
            .weight(w.clone())
            .ignore_index(1)
            .label_smoothing(0.2)
            .reduction(r);
        let f = F::cross_entropy_with(
            &x,
            &t,
            F::CrossEntropyOptions {
                weight: Some(&w),
                ignore_index: 1,
                reduction: r,
                label_smoothing: 0.2,
            },
        )?;
        same(&m.forward(&x, &t)?, &f);
        // Each option changes the result, so none is dropped on the way.
        let without = [
            CrossEntropyLoss::new()
                .ignore_index(1)
                .label_smoothing(0.2)
                .reduction(r),
            CrossEntropyLoss::new()
                .weight(w.clone())
                .label_smoothing(0.2)
                .reduction(r),
            CrossEntropyLoss::new()
                .weight(w.clone())
                .ignore_index(1)
                .reduction(r),
        ];
        for other in without {
            assert_ne!(other.forward(&x, &t)?.to_vec_f64()?, f.to_vec_f64()?);
        }
    }
    // Out-of-range smoothing is refused in forward, as by the functional form.
    assert!(CrossEntropyLoss::new()
        .label_smoothing(1.5)
        .forward(&x, &t)
        .is_err());
    Ok(())
}

#[test]
fn nll_loss_matches_functional_with_every_option() -> Result<()> {
    let x = t64(&values(12, 4), &[4, 3], CPU).log_softmax(1)?;
    let t = idx(&[0, 2, 2, 1]);
    let w = t64(&[1.5, 0.25, 2.0], &[3], CPU);
    same(
        &NLLLoss::new().forward(&x, &t)?,
        &F::nll_loss(&x, &t, None, -100, Reduction::Mean)?,
    );
    for r in REDUCTIONS {
        let m = NLLLoss::new().weight(w.clone()).ignore_index(2).reduction(r);
        let f = F::nll_loss(&x, &t, Some(&w), 2, r)?;
        same(&m.forward(&x, &t)?, &f);
        let unweighted = NLLLoss::new().ignore_index(2).reduction(r).forward(&x, &t)?;
        assert_ne!(unweighted.to_vec_f64()?, f.to_vec_f64()?);
        let unignored = NLLLoss::new().weight(w.clone()).reduction(r).forward(&x, &t)?;
        assert_ne!(unignored.to_vec_f64()?, f.to_vec_f64()?);
    }
    Ok(())
}

#[test]
fn mse_and_l1_loss_match_functional_for_each_reduction() -> Result<()> {
    let x = t64(&values(6, 5), &[2, 3], CPU);
    let y = t64(&values(6, 6), &[2, 3], CPU);
    same(
        &MSELoss::new().forward(&x, &y)?,
        &F::mse_loss(&x, &y, Reduction::Mean)?,
    );
    same(
        &L1Loss::default().forward(&x, &y)?,
        &F::l1_loss(&x, &y, Reduction::Mean)?,
    );
    for r in REDUCTIONS {
        let mse = MSELoss::new().reduction(r);
        assert_eq!(mse.reduction, r);
        same(&mse.forward(&x, &y)?, &F::mse_loss(&x, &y, r)?);
        same(
            &L1Loss::new().reduction(r).forward(&x, &y)?,
            &F::l1_loss(&x, &y, r)?,
        );
    }
    assert_eq!(
        MSELoss::new().reduction(Reduction::None).forward(&x, &y)?.dims(),
        [2, 3]
    );
    Ok(())
}

#[test]
fn bce_with_logits_loss_matches_functional_with_every_option() -> Result<()> {
    let x = t64(&values(8, 7), &[2, 4], CPU);
    let y = t64(&[0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 1.0], &[2, 4], CPU);
    let w = t64(&[0.5, 2.0], &[2, 1], CPU);
    let pw = t64(&[1.0, 3.0, 0.5, 2.0], &[4], CPU);
    same(
        &BCEWithLogitsLoss::new().forward(&x, &y)?,
        &F::binary_cross_entropy_with_logits(&x, &y, None, None, Reduction::Mean)?,
    );
    for r in REDUCTIONS {
        let m = BCEWithLogitsLoss::new()
            .weight(w.clone())
            .pos_weight(pw.clone())
            .reduction(r);
        let f = F::binary_cross_entropy_with_logits(&x, &y, Some(&w), Some(&pw), r)?;
        same(&m.forward(&x, &y)?, &f);
        let no_w = BCEWithLogitsLoss::new()
            .pos_weight(pw.clone())
            .reduction(r)
            .forward(&x, &y)?;
        assert_ne!(no_w.to_vec_f64()?, f.to_vec_f64()?);
        let no_pw = BCEWithLogitsLoss::new()
            .weight(w.clone())
            .reduction(r)
            .forward(&x, &y)?;
        assert_ne!(no_pw.to_vec_f64()?, f.to_vec_f64()?);
    }
    Ok(())
}

#[test]
fn loss_weights_are_buffers_and_move_with_the_module() -> Result<()> {
    let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], CPU)?;
    let mut ce = CrossEntropyLoss::new().weight(w.clone());
    assert!(ce.parameters().is_empty());
    let names: Vec<String> = ce.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight"]);
    ce.to_dtype(DType::F64)?;
    assert_eq!(ce.weight.as_ref().unwrap().dtype(), DType::F64);
    let bce = BCEWithLogitsLoss::new().weight(w.clone()).pos_weight(w);
    let names: Vec<String> = bce.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "pos_weight"]);
    assert!(MSELoss::new().state_dict().is_empty());
    assert!(NLLLoss::new().state_dict().is_empty());
    Ok(())
}
