//! Issue 11: a whole training step (forward, loss, backward, fused optimizer step, and the
//! GradScaler's scale/step/update) captured once into a CUDA graph and replayed with new data
//! copied into static inputs gives bitwise what eager steps give, dropout included; an fp16 step
//! replayed on a poisoned batch skips the update and backs the scale off; replays leave the
//! memory statistics flat; and `make_graphed_callables` graphs a module's forward and backward
//! inside an eager training loop.
//!
//! The GPU tests run in a process of their own: a capture in global mode refuses other
//! threads' unsafe CUDA calls, and `cuda::graph` empties the cache.

use crate::common::{self, in_own_process};
use ember_core::cuda::{self, make_graphed_callables, CUDAGraph, Callable, GraphedOptions, Stream};
use ember_core::{DType, Device, Error, Result, Tensor};
use ember_nn::amp::{GradScaler, GradScalerConfig};
use ember_nn::functional::cross_entropy;
use ember_nn::graphs::make_graphed_module;
use ember_nn::optim::{Adam, AdamConfig, Optimizer};
use ember_nn::{Dropout, Forward, Linear, ModuleExt, ReLU, Sequential};

const FEATURES: usize = 16;
const CLASSES: usize = 4;
const BATCH: usize = 8;

/// Linear(16, 32) ReLU [Dropout(0.3)] Linear(32, 4), built after seeding every generator.
fn model(dropout: bool, device: Device) -> Sequential {
    ember_core::manual_seed(7).unwrap();
    let mut m = Sequential::new();
    m.push(Linear::new(FEATURES, 32, device).unwrap());
    m.push(ReLU::new());
    if dropout {
        m.push(Dropout::new(0.3).unwrap());
    }
    m.push(Linear::new(32, CLASSES, device).unwrap());
    m
}

/// Batch `i`: inputs `[8, 16]` and labels `[8]` on `device`; `poisoned` puts an inf in x.
fn batch(i: u64, poisoned: bool, device: Device) -> (Tensor, Tensor) {
    let mut x: Vec<f32> = common::values(BATCH * FEATURES, 100 + i)
        .iter()
        .map(|&v| v as f32)
        .collect();
    if poisoned {
        x[5] = f32::INFINITY;
    }
    let y: Vec<i64> = (0..BATCH as u64)
        .map(|k| ((k * 7 + i * 3) % CLASSES as u64) as i64)
        .collect();
    (
        Tensor::from_slice(&x, [BATCH, FEATURES], Device::Cpu)
            .unwrap()
            .to(device)
            .unwrap(),
        Tensor::from_slice(&y, [BATCH], Device::Cpu)
            .unwrap()
            .to(device)
            .unwrap(),
    )
}

fn loss_of(m: &Sequential, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    cross_entropy(&m.forward(x)?, y)
}

fn adam(m: &Sequential) -> Adam {
    Adam::new(
        m.parameters(),
        AdamConfig {
            lr: 0.01,
            ..Default::default()
        },
    )
    .unwrap()
}

/// The bits of every parameter.
fn bits(m: &Sequential) -> Vec<Vec<u32>> {
    m.parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// A training step: forward and loss (under fp16 autocast with `scaler`), backward, step.
fn step(
    m: &Sequential,
    opt: &mut Adam,
    scaler: Option<&mut GradScaler>,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    match scaler {
        None => {
            let loss = loss_of(m, x, y)?;
            loss.backward()?;
            opt.step()?;
            Ok(loss)
        }
        Some(scaler) => {
            let loss = {
                let _a = ember_core::amp::autocast(ember_core::DeviceType::Cuda, DType::F16)?;
                loss_of(m, x, y)?
            };
            scaler.scale(&loss)?.backward()?;
            scaler.step(opt)?;
            scaler.update()?;
            Ok(loss)
        }
    }
}

/// `warmup` eager steps on a side stream on batches `0..warmup` (copied into the static
/// `x`/`y`), then the step captured with the gradients released before; returns the graph and
/// the static loss.
fn capture_step(
    m: &Sequential,
    opt: &mut Adam,
    mut scaler: Option<&mut GradScaler>,
    (x, y): (&Tensor, &Tensor),
    warmup: u64,
) -> (CUDAGraph, Tensor) {
    let device = x.device();
    let side = Stream::new().unwrap();
    let main = cuda::current_stream(cuda::current_device()).unwrap();
    side.wait_stream(&main).unwrap();
    {
        let _s = cuda::stream(&side);
        for i in 0..warmup {
            let (bx, by) = batch(i, false, device);
            x.copy_(&bx).unwrap();
            y.copy_(&by).unwrap();
            opt.zero_grad().unwrap();
            step(m, opt, scaler.as_deref_mut(), x, y).unwrap();
        }
    }
    main.wait_stream(&side).unwrap();
    opt.zero_grad().unwrap();
    let mut g = CUDAGraph::new();
    let loss = {
        let _c = cuda::graph(&mut g).unwrap();
        step(m, opt, scaler, x, y).unwrap()
    };
    (g, loss)
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_replayed_step_with_dropout_equals_eager_steps() {
    in_own_process(
        "graphed_training::cuda_replayed_step_with_dropout_equals_eager_steps",
        || {
            let device = common::gpu();
            let (warmup, replays) = (3u64, 20u64);

            let eager = model(true, device);
            let mut opt = adam(&eager);
            let mut eager_losses = Vec::new();
            for i in 0..warmup + replays {
                let (x, y) = batch(i, false, device);
                opt.zero_grad().unwrap();
                eager_losses.push(step(&eager, &mut opt, None, &x, &y).unwrap().item_f64().unwrap());
            }

            let graphed = model(true, device);
            let mut opt = adam(&graphed);
            let (x, y) = batch(0, false, device);
            let (g, static_loss) = capture_step(&graphed, &mut opt, None, (&x, &y), warmup);
            for i in warmup..warmup + replays {
                let (bx, by) = batch(i, false, device);
                x.copy_(&bx).unwrap();
                y.copy_(&by).unwrap();
                g.replay().unwrap();
                assert_eq!(
                    static_loss.item_f64().unwrap().to_bits(),
                    eager_losses[i as usize].to_bits(),
                    "loss of step {i}"
                );
            }
            // Eager dropout draws a new mask each step, so equal parameters mean each replay did too.
            assert_eq!(bits(&graphed), bits(&eager), "parameters after {replays} replays");
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_replayed_fp16_step_skips_a_poisoned_batch_and_backs_off() {
    in_own_process(
        "graphed_training::cuda_replayed_fp16_step_skips_a_poisoned_batch_and_backs_off",
        || {
            let device = common::gpu();
            let warmup = 3u64;
            let poisoned = |i: u64| i == 6;
            let config = GradScalerConfig {
                growth_interval: 3,
                ..Default::default()
            };

            // Eager: parameters and scale after each step.
            let eager = model(false, device);
            let mut opt = adam(&eager);
            let mut scaler = GradScaler::with_config(config).unwrap();
            let mut expected = Vec::new();
            for i in 0..10 {
                let (x, y) = batch(i, poisoned(i), device);
                opt.zero_grad().unwrap();
                step(&eager, &mut opt, Some(&mut scaler), &x, &y).unwrap();
                expected.push((bits(&eager), scaler.get_scale().unwrap()));
            }

            let graphed = model(false, device);
            let mut opt = adam(&graphed);
            let mut scaler = GradScaler::with_config(config).unwrap();
            let (x, y) = batch(0, false, device);
            let (g, _) = capture_step(&graphed, &mut opt, Some(&mut scaler), (&x, &y), warmup);
            for i in warmup..10 {
                let (bx, by) = batch(i, poisoned(i), device);
                x.copy_(&bx).unwrap();
                y.copy_(&by).unwrap();
                let before = (bits(&graphed), scaler.get_scale().unwrap());
                g.replay().unwrap();
                let after = (bits(&graphed), scaler.get_scale().unwrap());
                assert_eq!(after, expected[i as usize], "step {i}: graphed and eager differ");
                if poisoned(i) {
                    assert_eq!(after.0, before.0, "the poisoned step {i} changed the parameters");
                    assert_eq!(
                        after.1,
                        before.1 / 2.0,
                        "the poisoned step {i} did not back the scale off"
                    );
                } else {
                    assert_ne!(after.0, before.0, "step {i} left the parameters alone");
                }
            }
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_memory_stays_flat_over_1000_replays() {
    in_own_process(
        "graphed_training::cuda_memory_stays_flat_over_1000_replays",
        || {
            let device = common::gpu();
            let Device::Cuda(d) = device else { unreachable!() };
            let m = model(true, device);
            let mut opt = adam(&m);
            let (x, y) = batch(0, false, device);
            let (g, loss) = capture_step(&m, &mut opt, None, (&x, &y), 3);
            let data: Vec<(Tensor, Tensor)> = (0..4).map(|i| batch(i, false, device)).collect();
            g.replay().unwrap();
            cuda::synchronize(d).unwrap();
            let stats = || {
                let s = cuda::memory_stats(d);
                (
                    cuda::memory_allocated(d),
                    cuda::memory_reserved(d),
                    s["allocation.all.current"],
                    s["segment.all.current"],
                )
            };
            let before = stats();
            let first_loss = loss.item_f64().unwrap();
            for i in 0..1000 {
                let (bx, by) = &data[i % data.len()];
                x.copy_(bx).unwrap();
                y.copy_(by).unwrap();
                g.replay().unwrap();
            }
            cuda::synchronize(d).unwrap();
            let after = stats();
            assert_eq!(after, before, "memory statistics moved over 1,000 replays");
            assert!(
                loss.item_f64().unwrap() < first_loss,
                "1,000 replays did not train"
            );
        },
    );
}

/// The eager model and the graphed one (`make_graphed_callables` over its forward) trained with
/// the same batches and an eager Adam; gradients are accumulated over two batches per step.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_graphed_callable_trains_as_the_eager_module() {
    in_own_process(
        "graphed_training::cuda_graphed_callable_trains_as_the_eager_module",
        || {
            let device = common::gpu();
            let train = |m: &Sequential, forward: &dyn Fn(&Tensor) -> Result<Tensor>| -> Vec<u32> {
                let mut opt = adam(m);
                let mut losses = Vec::new();
                for s in 0..4u64 {
                    opt.zero_grad().unwrap();
                    for k in 0..2 {
                        let (x, y) = batch(2 * s + k, false, device);
                        let loss = cross_entropy(&forward(&x).unwrap(), &y).unwrap();
                        loss.backward().unwrap();
                        losses.push(loss.to_vec::<f32>().unwrap()[0].to_bits());
                    }
                    opt.step().unwrap();
                }
                losses
            };

            let eager = model(false, device);
            let eager_losses = train(&eager, &|x| eager.forward(x));

            // The core form, on a plain function of the module.
            let graphed_model = model(false, device);
            let f = |a: &[Tensor]| graphed_model.forward(&a[0]);
            let graphed = make_graphed_callables(
                &[Callable {
                    func: &f,
                    sample_args: vec![batch(0, false, device).0],
                    params: graphed_model.parameters(),
                }],
                GraphedOptions::default(),
            )
            .unwrap();
            let callable = &graphed[0];
            let graphed_losses = train(&graphed_model, &|x| callable.call(&[x.clone()]));
            assert_eq!(graphed_losses, eager_losses, "losses");
            assert_eq!(bits(&graphed_model), bits(&eager), "parameters");

            // The module form.
            let module = make_graphed_module(model(false, device), &batch(0, false, device).0).unwrap();
            let module_losses = train(module.module(), &|x| module.forward(x));
            assert_eq!(module_losses, eager_losses, "losses of the graphed module");
            assert_eq!(
                bits(module.module()),
                bits(&eager),
                "parameters of the graphed module"
            );

            // Another shape is refused while training, and the graphs still work after; in eval
            // mode the module runs eagerly, any batch size.
            let wrong = Tensor::zeros([3, FEATURES], DType::F32, device).unwrap();
            assert!(matches!(
                callable.call(&[wrong.clone()]),
                Err(Error::InvalidArgument { .. })
            ));
            assert!(matches!(
                module.forward(&wrong),
                Err(Error::InvalidArgument { .. })
            ));
            callable.call(&[batch(0, false, device).0]).unwrap();
            module.eval();
            assert_eq!(module.forward(&wrong).unwrap().dims(), &[3, CLASSES]);
        },
    );
}

#[test]
fn make_graphed_callables_refuses_cpu_tensors_and_frozen_parameters() {
    let m = model(false, Device::Cpu);
    let f = |a: &[Tensor]| m.forward(&a[0]);
    let sample = vec![batch(0, false, Device::Cpu).0];
    let err = make_graphed_callables(
        &[Callable {
            func: &f,
            sample_args: sample.clone(),
            params: m.parameters(),
        }],
        GraphedOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("CPU tensor"), "{err}");

    let frozen = m.parameters()[0].detach();
    let err = make_graphed_callables(
        &[Callable {
            func: &f,
            sample_args: sample,
            params: vec![frozen],
        }],
        GraphedOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
}
