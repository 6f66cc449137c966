//! Threads on the CPU: ember's tensors, autograd, layers and optimizers used from several
//! threads at once give what one thread gives, bit for bit (the CPU kernels are deterministic,
//! and nothing a thread does may leak into another's graph, gradients or optimizer state).
//!
//! Two shapes of concurrent use, each with 8 threads and compared with the same work done on
//! one thread first:
//! - separate models: each thread trains its own model (conv, pooling, layer norm, linear,
//!   cross-entropy, backward, Adam) on its own data;
//! - shared read-only weights: one model whose parameters all threads read at once, each
//!   running forward and taking the gradient of its loss with respect to its own input (not
//!   the shared weights, whose `.grad` nobody writes).

use ember_core::{autograd, Device, Tensor};
use ember_nn::functional as F;
use ember_nn::optim::{Adam, AdamConfig, Optimizer};
use ember_nn::{Conv2d, Forward, LayerNorm, Linear, Module, ModuleExt};

const THREADS: usize = 8;
const CPU: Device = Device::Cpu;

/// A small classifier of 1×8×8 images into 3 classes touching the common layer kinds.
#[derive(Module, Clone)]
struct Net {
    conv: Conv2d,
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let h = F::max_pool2d(&self.conv.forward(x)?.relu()?, 2, 2, 0)?;
        let h = h.reshape(&[h.dims()[0] as isize, -1])?;
        self.fc2
            .forward(&self.norm.forward(&self.fc1.forward(&h)?)?.relu()?)
    }
}

/// Deterministic values in [-0.5, 0.5) from `seed` (no generator: tests running in parallel
/// threads share the default one).
fn fixed(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 1009;
            h as f32 / 1009.0 - 0.5
        })
        .collect()
}

/// The network with weights fixed by `seed`.
fn net(seed: usize) -> Net {
    let mut n = Net {
        conv: Conv2d::with_config(
            1,
            4,
            3,
            ember_nn::layers::Conv2dConfig {
                padding: 1.into(),
                ..Default::default()
            },
            CPU,
        )
        .unwrap(),
        fc1: Linear::new(64, 16, CPU).unwrap(),
        norm: LayerNorm::new(&[16], CPU).unwrap(),
        fc2: Linear::new(16, 3, CPU).unwrap(),
    };
    let state: Vec<(String, Tensor)> = n
        .state_dict()
        .into_iter()
        .enumerate()
        .map(|(k, (name, t))| {
            let v = fixed(t.numel(), seed * 31 + k);
            (name, Tensor::from_vec(v, t.dims().to_vec(), CPU).unwrap())
        })
        .collect();
    n.load_state_dict(&state, true).unwrap();
    n
}

/// A batch of `rows` images and labels fixed by `seed`.
fn batch(rows: usize, seed: usize) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(fixed(rows * 64, seed), [rows, 1, 8, 8], CPU).unwrap();
    let y: Vec<i64> = (0..rows).map(|i| ((i * 7 + seed) % 3) as i64).collect();
    (x, Tensor::from_vec(y, [rows], CPU).unwrap())
}

/// What a training job produced: every step's loss and the final parameters, as bits.
#[derive(Debug, PartialEq)]
struct Trained {
    losses: Vec<u32>,
    params: Vec<Vec<u32>>,
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Job `job`: its own model and data, `steps` Adam steps on cross-entropy.
fn train(job: usize, steps: usize) -> Trained {
    let model = net(job);
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 1e-2,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (x, y) = batch(6, job * 1000 + step);
        opt.zero_grad().unwrap();
        let loss = F::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        losses.push(loss.item::<f32>().unwrap().to_bits());
    }
    Trained {
        losses,
        params: model.parameters().iter().map(bits).collect(),
    }
}

#[test]
fn threads_training_separate_models_match_one_thread() {
    const STEPS: usize = 12;
    const ROUNDS: usize = 2;
    let alone: Vec<Trained> = (0..THREADS).map(|job| train(job, STEPS)).collect();
    // Different jobs train differently, so equal results below are each job's own.
    assert_ne!(alone[0], alone[1]);
    for round in 0..ROUNDS {
        let together: Vec<Trained> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|job| s.spawn(move || train(job, STEPS)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (job, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, b, "job {job} in round {round}: 8 threads differ from one");
        }
    }
}

/// Output bits and input-gradient bits of the shared model on input batch `seed`.
fn infer(model: &Net, seed: usize) -> (Vec<u32>, Vec<u32>) {
    let (x, y) = batch(5, seed);
    let x = x.requires_grad_(true).unwrap();
    let out = model.forward(&x).unwrap();
    let loss = F::cross_entropy(&out, &y).unwrap();
    let g = autograd::grad(&[loss], &[x], None, false).unwrap();
    let g = g[0].as_ref().expect("the input's gradient");
    (bits(&out), bits(g))
}

#[test]
fn threads_sharing_read_only_weights_match_one_thread() {
    const PER_THREAD: usize = 12;
    let model = net(99);
    let before: Vec<Vec<u32>> = model.parameters().iter().map(bits).collect();
    let alone: Vec<Vec<(Vec<u32>, Vec<u32>)>> = (0..THREADS)
        .map(|t| (0..PER_THREAD).map(|i| infer(&model, t * 100 + i)).collect())
        .collect();
    assert_ne!(alone[0][0], alone[1][0]);
    let together: Vec<Vec<(Vec<u32>, Vec<u32>)>> = std::thread::scope(|s| {
        let model = &model;
        let handles: Vec<_> = (0..THREADS)
            .map(|t| s.spawn(move || (0..PER_THREAD).map(|i| infer(model, t * 100 + i)).collect()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        alone, together,
        "8 threads reading one model differ from one thread"
    );
    for (p, b) in model.parameters().iter().zip(&before) {
        assert_eq!(&bits(p), b, "the shared weights were not written");
        assert!(
            p.grad().is_none(),
            "no gradient was accumulated into the shared weights"
        );
    }
}
