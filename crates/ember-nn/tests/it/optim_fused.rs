//! `AdamW(..., fused=True)`: the fused flag (Note [Fused or per-tensor] in `optim/adam.rs`).

use ember_core::{Device, Error, Tensor};
use ember_nn::optim::{AdamConfig, AdamW, Optimizer};

/// Two parameters; with `strided`, the second is a non-contiguous leaf, which the fused step
/// does not take.
fn params(strided: bool) -> Vec<Tensor> {
    let a = Tensor::from_vec((0..6).map(|i| i as f32 * 0.1).collect(), [2, 3], Device::Cpu).unwrap();
    let b = Tensor::from_vec(
        (0..6).map(|i| 1.0 - i as f32 * 0.1).collect(),
        [3, 2],
        Device::Cpu,
    )
    .unwrap();
    let b = if strided {
        b.t().unwrap().detach()
    } else {
        b.t().unwrap().contiguous().unwrap()
    };
    vec![a.requires_grad_(true).unwrap(), b.requires_grad_(true).unwrap()]
}

fn step(fused: Option<bool>, strided: bool) -> ember_core::Result<Vec<Vec<f32>>> {
    let ps = params(strided);
    let mut opt = AdamW::new(
        ps.clone(),
        AdamConfig {
            fused,
            ..AdamConfig::adamw()
        },
    )?;
    for p in &ps {
        p.square()?.sum_all()?.backward()?;
    }
    opt.step()?;
    ps.iter().map(|p| p.contiguous()?.to_vec::<f32>()).collect()
}

#[test]
fn fused_true_refuses_what_the_fused_step_cannot_take() {
    let e = step(Some(true), true).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { op: "adam", .. }), "{e}");
    assert!(
        e.to_string().contains("parameter 1") && e.to_string().contains("fused"),
        "{e}"
    );
    // All contiguous: fused=True runs, and all three paths agree.
    let fused = step(Some(true), false).unwrap();
    let single = step(Some(false), false).unwrap();
    let auto = step(None, true).unwrap();
    for (a, b) in fused.iter().flatten().zip(single.iter().flatten()) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }
    for (a, b) in fused.iter().flatten().zip(auto.iter().flatten()) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }
    assert_eq!(AdamConfig::default().fused, None);
}
