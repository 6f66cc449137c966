//! Threads: ember's tensors, autograd, layers and optimizers used from several threads at once
//! give what one thread gives, bit for bit (the kernels are deterministic, and nothing a thread
//! does may leak into another's graph, gradients, optimizer state or stream).
//!
//! Two shapes of concurrent use, each with 8 threads and compared with the same work done on
//! one thread first:
//! - separate models: each thread trains its own model (forward, cross-entropy, backward, Adam)
//!   on its own data;
//! - shared read-only weights: one model whose parameters all threads read at once, each
//!   running forward and taking the gradient of its loss with respect to its own input (not
//!   the shared weights, whose `.grad` nobody writes).
//!
//! On the CPU the model has a convolution, pooling, layer norm and linear layers. On the GPU
//! (tests marked `#[ignore = "needs a CUDA device"]`) each thread makes its own stream current
//! (`torch.cuda.stream(s)` per thread), so the threads' kernels, copies and allocations run
//! side by side; the model there has no convolution, because cuDNN may pick algorithms that
//! accumulate with atomics (not bitwise repeatable) unless `backends::cudnn::set_deterministic`
//! is on, a process-wide switch other tests of this binary read.
//!
//! `EMBER_CONCURRENCY_ROUNDS=N` repeats each test's threaded part N times (default 2), the
//! loop that makes a rare interleaving show: `EMBER_CONCURRENCY_ROUNDS=100 cargo test -p
//! ember-nn --test it concurrency -- --include-ignored` runs all four tests 100 times over.

use ember_core::cuda::{self, Stream};
use ember_core::{autograd, Device, Tensor};
use ember_nn::functional as F;
use ember_nn::optim::{Adam, AdamConfig, Optimizer};
use ember_nn::{Conv2d, Forward, LayerNorm, Linear, Module, ModuleExt};

const THREADS: usize = 8;

/// How many times each test runs its threaded part (`EMBER_CONCURRENCY_ROUNDS`, default 2).
fn rounds() -> usize {
    match std::env::var("EMBER_CONCURRENCY_ROUNDS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("EMBER_CONCURRENCY_ROUNDS={v:?} is not a count of rounds")),
        Err(_) => 2,
    }
}

/// A small classifier of 1×8×8 images into 3 classes touching the common layer kinds (CPU).
#[derive(Module, Clone)]
struct ConvNet {
    conv: Conv2d,
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl Forward for ConvNet {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let h = F::max_pool2d(&self.conv.forward(x)?.relu()?, 2, 2, 0)?;
        let h = h.reshape(&[h.dims()[0] as isize, -1])?;
        self.fc2
            .forward(&self.norm.forward(&self.fc1.forward(&h)?)?.relu()?)
    }
}

/// The same classifier without the convolution (GPU: every kernel bitwise repeatable).
#[derive(Module, Clone)]
struct MlpNet {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
    fc3: Linear,
}

impl Forward for MlpNet {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let h = x.reshape(&[x.dims()[0] as isize, -1])?;
        let h = self.norm.forward(&self.fc1.forward(&h)?)?.gelu()?;
        self.fc3.forward(&self.fc2.forward(&h)?.tanh()?)
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

/// Overwrites every parameter and buffer of `model` with values fixed by `seed`.
fn fix_weights(model: &mut impl Module, seed: usize, device: Device) {
    let state: Vec<(String, Tensor)> = model
        .state_dict()
        .into_iter()
        .enumerate()
        .map(|(k, (name, t))| {
            let v = fixed(t.numel(), seed * 31 + k);
            (name, Tensor::from_vec(v, t.dims().to_vec(), device).unwrap())
        })
        .collect();
    model.load_state_dict(&state, true).unwrap();
}

/// The models the tests train: weights fixed by a seed, on a device.
trait Net: Forward + Sized {
    fn build(seed: usize, device: Device) -> Self;
}

impl Net for ConvNet {
    fn build(seed: usize, device: Device) -> ConvNet {
        let mut n = ConvNet {
            conv: Conv2d::with_config(
                1,
                4,
                3,
                ember_nn::layers::Conv2dConfig {
                    padding: 1.into(),
                    ..Default::default()
                },
                device,
            )
            .unwrap(),
            fc1: Linear::new(64, 16, device).unwrap(),
            norm: LayerNorm::new(&[16], device).unwrap(),
            fc2: Linear::new(16, 3, device).unwrap(),
        };
        fix_weights(&mut n, seed, device);
        n
    }
}

impl Net for MlpNet {
    fn build(seed: usize, device: Device) -> MlpNet {
        let mut n = MlpNet {
            fc1: Linear::new(64, 32, device).unwrap(),
            norm: LayerNorm::new(&[32], device).unwrap(),
            fc2: Linear::new(32, 16, device).unwrap(),
            fc3: Linear::new(16, 3, device).unwrap(),
        };
        fix_weights(&mut n, seed, device);
        n
    }
}

/// A batch of `rows` images and labels fixed by `seed`.
fn batch(rows: usize, seed: usize, device: Device) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(fixed(rows * 64, seed), [rows, 1, 8, 8], device).unwrap();
    let y: Vec<i64> = (0..rows).map(|i| ((i * 7 + seed) % 3) as i64).collect();
    (x, Tensor::from_vec(y, [rows], device).unwrap())
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

/// Runs `f` on the calling thread with a stream of its own current on `device` when that is a
/// GPU (each call takes the next stream of the pool: 8 threads get 8 streams); the stream is
/// synchronized before returning, so whatever `f` returns was read back from it.
fn on_own_stream<R>(device: Device, f: impl FnOnce() -> R) -> R {
    match device {
        Device::Cuda(i) => {
            let s = Stream::new_on(i).unwrap();
            let r = {
                let _guard = cuda::stream(&s);
                f()
            };
            s.synchronize().unwrap();
            r
        }
        _ => f(),
    }
}

/// Job `job`: its own model and data on `device`, `steps` Adam steps on cross-entropy.
fn train<N: Net>(job: usize, steps: usize, device: Device) -> Trained {
    let model = N::build(job, device);
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
        let (x, y) = batch(6, job * 1000 + step, device);
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

/// Every job trained alone, then all at once on 8 threads (each on its own stream on a GPU),
/// `rounds()` times: each job's losses and final weights are the same bits.
fn separate_models<N: Net>(device: Device) {
    const STEPS: usize = 12;
    let alone: Vec<Trained> = (0..THREADS).map(|job| train::<N>(job, STEPS, device)).collect();
    // Different jobs train differently, so equal results below are each job's own.
    assert_ne!(alone[0], alone[1]);
    for round in 0..rounds() {
        let together: Vec<Trained> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|job| s.spawn(move || on_own_stream(device, || train::<N>(job, STEPS, device))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (job, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(
                a, b,
                "job {job} in round {round} on {device}: 8 threads differ from one"
            );
        }
    }
}

/// Output bits and input-gradient bits of the shared model on input batch `seed`.
fn infer<N: Net>(model: &N, seed: usize, device: Device) -> (Vec<u32>, Vec<u32>) {
    let (x, y) = batch(5, seed, device);
    let x = x.requires_grad_(true).unwrap();
    let out = model.forward(&x).unwrap();
    let loss = F::cross_entropy(&out, &y).unwrap();
    let g = autograd::grad(&[loss], &[x], None, false).unwrap();
    let g = g[0].as_ref().expect("the input's gradient");
    (bits(&out), bits(g))
}

/// One model read by 8 threads at once (each on its own stream on a GPU), `rounds()` times:
/// every output and input gradient is the single-threaded one, and the weights stay untouched.
fn shared_weights<N: Net>(device: Device) {
    const PER_THREAD: usize = 12;
    let model = N::build(99, device);
    let before: Vec<Vec<u32>> = model.parameters().iter().map(bits).collect();
    type Seen = Vec<Vec<(Vec<u32>, Vec<u32>)>>;
    let alone: Seen = (0..THREADS)
        .map(|t| {
            (0..PER_THREAD)
                .map(|i| infer(&model, t * 100 + i, device))
                .collect()
        })
        .collect();
    assert_ne!(alone[0][0], alone[1][0]);
    // The weights were written on this thread's stream: the threads' streams read them after.
    if let Device::Cuda(i) = device {
        cuda::synchronize(i).unwrap();
    }
    for round in 0..rounds() {
        let together: Seen = std::thread::scope(|s| {
            let model = &model;
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    s.spawn(move || {
                        on_own_stream(device, || {
                            (0..PER_THREAD)
                                .map(|i| infer(model, t * 100 + i, device))
                                .collect()
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (t, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(
                a, b,
                "thread {t} in round {round} on {device}: 8 threads reading one model differ from one"
            );
        }
    }
    for (p, b) in model.parameters().iter().zip(&before) {
        assert_eq!(&bits(p), b, "the shared weights were not written");
        assert!(
            p.grad().is_none(),
            "no gradient was accumulated into the shared weights"
        );
    }
}

#[test]
fn threads_training_separate_models_match_one_thread() {
    separate_models::<ConvNet>(Device::Cpu);
}

#[test]
fn threads_sharing_read_only_weights_match_one_thread() {
    shared_weights::<ConvNet>(Device::Cpu);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_threads_on_own_streams_training_separate_models_match_one_thread() {
    separate_models::<MlpNet>(crate::common::gpu());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_threads_on_own_streams_sharing_read_only_weights_match_one_thread() {
    shared_weights::<MlpNet>(crate::common::gpu());
}

/// The GPU model's layers run on the CPU too, so its tests' model is checked in CI (the GPU
/// tests compare the GPU with itself, threaded and not).
#[test]
fn mlp_threads_on_the_cpu_match_one_thread() {
    separate_models::<MlpNet>(Device::Cpu);
    shared_weights::<MlpNet>(Device::Cpu);
}
