//! Backward over graphs that span devices: each GPU's share runs on that GPU's engine thread,
//! the calling thread keeps its own device's nodes, the leaves, hooks and callbacks (Note
//! [Device threads] in `autograd/engine.rs`).

use crate::common::{gpu, two_gpus};
use ember_core::{autograd, DType, Device, Error, Tensor};
use std::sync::{Arc, Mutex};

/// The name of the thread running the caller.
fn here() -> String {
    std::thread::current().name().unwrap_or("unnamed").to_string()
}

/// `x * 2` whose backward writes down the thread it ran on.
fn doubled_noting_thread(x: &Tensor, seen: &Arc<Mutex<Vec<String>>>) -> Tensor {
    let seen = seen.clone();
    autograd::custom_op(
        "double",
        &[x],
        x.detach().mul_scalar(2.0).unwrap(),
        move |g, _| {
            seen.lock().unwrap().push(here());
            Ok(vec![Some(g.mul_scalar(2.0)?)])
        },
    )
}

/// Backward from the sum of `t` moved to the CPU: the root lies on the CPU, so every GPU node
/// of the graph runs on the GPU's engine thread.
fn backward_from_the_cpu(t: &Tensor) -> ember_core::Result<()> {
    t.to(Device::Cpu)?.sum_all()?.backward()
}

fn host(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, [v.len()], Device::Cpu).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_gpu_share_of_a_cpu_rooted_graph_runs_on_the_gpu_thread() {
    let d = gpu();
    let Device::Cuda(ordinal) = d else { unreachable!() };
    let caller = here();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let x = host(&[1.0, -2.0, 3.0]).requires_grad_(true).unwrap();
    let w = Tensor::from_slice(&[0.5f32, 1.5, -1.0], [3], d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    // w's post-accumulate hook and a tensor hook on a GPU intermediate stay on this thread.
    let hook_threads = Arc::new(Mutex::new(Vec::new()));
    let h = hook_threads.clone();
    let _post = w
        .register_post_accumulate_grad_hook(move |_| {
            h.lock().unwrap().push(here());
            Ok(())
        })
        .unwrap();
    let on_gpu = x.to(d).unwrap();
    let y = doubled_noting_thread(&on_gpu.mul(&w).unwrap(), &seen);
    let h = hook_threads.clone();
    let z = y.exp().unwrap();
    let _hook = z
        .register_hook(move |_| {
            h.lock().unwrap().push(here());
            Ok(None)
        })
        .unwrap();
    let z = doubled_noting_thread(&z, &seen);
    backward_from_the_cpu(&z).unwrap();

    let gpu_thread = format!("autograd cuda:{ordinal}");
    assert_eq!(*seen.lock().unwrap(), [gpu_thread.clone(), gpu_thread]);
    assert_eq!(*hook_threads.lock().unwrap(), [caller.clone(), caller]);
    // d/dx sum(2 exp(2 x w)) = 4 w exp(2 x w), and d/dw = 4 x exp(2 x w).
    let (xs, ws) = ([1.0f32, -2.0, 3.0], [0.5f32, 1.5, -1.0]);
    let gx = x.grad().unwrap().to_vec::<f32>().unwrap();
    let gw = w.grad().unwrap().to_vec::<f32>().unwrap();
    for i in 0..3 {
        let e = (2.0 * xs[i] * ws[i]).exp();
        assert!((gx[i] - 4.0 * ws[i] * e).abs() <= 1e-4 * e.max(1.0), "{gx:?}");
        assert!((gw[i] - 4.0 * xs[i] * e).abs() <= 1e-4 * e.max(1.0), "{gw:?}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_error_or_panic_on_a_gpu_thread_fails_backward_and_the_thread_lives_on() {
    let d = gpu();
    let x = host(&[1.0, 2.0]).requires_grad_(true).unwrap();
    let failing = autograd::custom_op(
        "failing",
        &[&x.to(d).unwrap()],
        Tensor::zeros([2], DType::F32, d).unwrap(),
        |_, _| Err(Error::Autograd("failing's backward gave up".into())),
    );
    let err = backward_from_the_cpu(&failing).unwrap_err();
    assert!(err.to_string().contains("failing's backward gave up"), "{err}");

    let panicking = autograd::custom_op(
        "panicking",
        &[&x.to(d).unwrap()],
        Tensor::zeros([2], DType::F32, d).unwrap(),
        |_, _| panic!("panicking's backward"),
    );
    let err = backward_from_the_cpu(&panicking).unwrap_err();
    assert!(err.to_string().contains("panicked on a device thread"), "{err}");

    // The GPU's thread still serves the next backward.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let y = doubled_noting_thread(&x.to(d).unwrap(), &seen);
    backward_from_the_cpu(&y).unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [2.0, 2.0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_checkpoint_recomputed_on_a_gpu_thread_gives_the_plain_gradients() {
    let d = gpu();
    let x = host(&[0.3, -0.7, 1.1, 0.2]).requires_grad_(true).unwrap();
    let segment = |t: &[Tensor]| t[0].tanh()?.mul(&t[0])?.exp();
    let plain = segment(&[x.to(d).unwrap()]).unwrap();
    let expected = autograd::grad(
        &[plain.to(Device::Cpu).unwrap().sum_all().unwrap()],
        &[x.clone()],
        None,
        false,
    )
    .unwrap()[0]
        .clone()
        .unwrap();
    // The checkpoint's node lies on the GPU, so its recomputation and inner backward run on
    // the GPU's thread, entirely there.
    let checkpointed = autograd::checkpoint(segment, &[x.to(d).unwrap()]).unwrap();
    backward_from_the_cpu(&checkpointed).unwrap();
    let (got, want) = (
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        expected.to_vec::<f32>().unwrap(),
    );
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5, "{got:?} vs {want:?}");
    }
}

/// Runs on a two-GPU machine (`--skip two_gpus` elsewhere).
#[test]
#[ignore = "needs two CUDA devices"]
fn backward_over_two_gpus_runs_the_second_gpus_nodes_on_its_thread() {
    let (d0, d1) = two_gpus();
    let caller = here();
    let seen0 = Arc::new(Mutex::new(Vec::new()));
    let seen1 = Arc::new(Mutex::new(Vec::new()));
    let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4], d0)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    // Two branches, as DataParallel's replicas: one on each GPU, summed on the first.
    let mut total = None::<Tensor>;
    for _ in 0..3 {
        let a = doubled_noting_thread(&w.mul_scalar(0.5).unwrap(), &seen0)
            .sin()
            .unwrap();
        let b = doubled_noting_thread(&w.to(d1).unwrap().mul_scalar(0.5).unwrap(), &seen1)
            .sin()
            .unwrap()
            .to(d0)
            .unwrap();
        let s = a.add(&b).unwrap();
        total = Some(match total {
            Some(t) => t.add(&s).unwrap(),
            None => s,
        });
    }
    total.unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(*seen0.lock().unwrap(), vec![caller; 3]);
    assert_eq!(*seen1.lock().unwrap(), vec!["autograd cuda:1".to_string(); 3]);
    // Each branch is sin(w) (2 * 0.5 w inside), three times over two branches: 6 cos(w).
    let g = w.grad().unwrap().to_vec::<f32>().unwrap();
    for (i, gi) in g.iter().enumerate() {
        let want = 6.0 * ((i + 1) as f32).cos();
        assert!((gi - want).abs() <= 1e-4, "{g:?}");
    }
}
