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

/// `clip_grad_norm_` over float32 gradients on a GPU takes the multi-tensor norm and multiply
/// (PyTorch's foreach path) and agrees with the per-gradient path on the CPU: the total norm
/// and every clipped gradient, for order 2 and infinity, clipping (max_norm below the norm)
/// and not (above it, the coefficient clamped to 1).
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_clip_grad_norm_equals_the_cpu_path() {
    use ember_core::DType;
    use ember_nn::optim::clip_grad_norm_;
    assert!(ember_core::cuda::is_available(), "needs a CUDA device");
    let dev = Device::Cuda(0);
    let sizes = [3usize, 4096, 5000, 1, 70_000];
    let make = |d: Device| -> Vec<Tensor> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let p = Tensor::zeros([n], DType::F32, d)
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap();
                let g: Vec<f32> = (0..n)
                    .map(|k| (((k * 7 + i * 13) % 29) as f32 - 14.0) * 0.01)
                    .collect();
                p.set_grad(Some(Tensor::from_vec(g, [n], d).unwrap())).unwrap();
                p
            })
            .collect()
    };
    for ord in [2.0, f64::INFINITY] {
        for max_norm in [0.5, 1e6] {
            let (cpu, gpu) = (make(Device::Cpu), make(dev));
            let a = clip_grad_norm_(&cpu, max_norm, ord)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let b = clip_grad_norm_(&gpu, max_norm, ord)
                .unwrap()
                .to(Device::Cpu)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            assert!(
                (a[0] - b[0]).abs() <= 1e-5 * a[0],
                "ord {ord}: total {a:?} vs {b:?}"
            );
            for (p, q) in cpu.iter().zip(&gpu) {
                let (x, y) = (
                    p.grad().unwrap().to_vec::<f32>().unwrap(),
                    q.grad()
                        .unwrap()
                        .to(Device::Cpu)
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap(),
                );
                for (u, v) in x.iter().zip(&y) {
                    assert!(
                        (u - v).abs() <= 1e-5 * u.abs() + 1e-9,
                        "ord {ord} max_norm {max_norm}: {u} vs {v}"
                    );
                }
            }
        }
    }
}
