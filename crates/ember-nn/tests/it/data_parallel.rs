//! `DataParallel`: the batch split over devices, the module replicated, the replicas run on
//! threads and the outputs gathered give the module's own output and, through backward, the
//! full batch's gradients in the original parameters. On the CPU the "devices" are the CPU
//! several times (the replicas then share the parameters, and every path of the wrapper but
//! the copies runs); on two GPUs the replicas are copies on the second one.

use crate::common::assert_close;
use ember_core::{cuda, DType, Device, Error, Tensor};
use ember_nn::{DataParallel, Forward, Linear, Module, ModuleExt, ReLU, Sequential};

#[derive(Module, Clone)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

/// A fresh network with the same weights every call. They are loaded from fixed values, not
/// drawn after `manual_seed`: tests run in parallel threads share the default generator, and
/// another test's draw between the seed and the initialization made two "same" networks differ.
fn net(device: Device) -> Net {
    let mut n = Net {
        fc1: Linear::new(6, 16, Device::Cpu).unwrap(),
        fc2: Linear::new(16, 3, Device::Cpu).unwrap(),
    };
    let fixed: Vec<(String, Tensor)> = n
        .state_dict()
        .into_iter()
        .map(|(name, t)| {
            let k = t.numel();
            let v: Vec<f32> = (0..k)
                .map(|i| ((i * 7 + name.len()) % 13) as f32 / 13.0 - 0.45)
                .collect();
            (name, Tensor::from_vec(v, t.dims().to_vec(), Device::Cpu).unwrap())
        })
        .collect();
    n.load_state_dict(&fixed, true).unwrap();
    n.to_device(device).unwrap();
    n
}

/// Output and parameter gradients of `model` on `x` (loss: the mean of the squared output).
fn run(model: &dyn Forward, x: &Tensor) -> (Tensor, Vec<Tensor>) {
    model.zero_grad().unwrap();
    let y = model.forward(x).unwrap();
    y.square().unwrap().mean_all().unwrap().backward().unwrap();
    let grads = model.parameters().iter().map(|p| p.grad().unwrap()).collect();
    (y.detach(), grads)
}

fn check(devices: Vec<Device>, rows: usize) {
    let x = Tensor::randn([rows, 6], DType::F32, Device::Cpu).unwrap();
    let single = net(devices[0]);
    let (y0, g0) = run(&single, &x.to(devices[0]).unwrap());
    let dp = DataParallel::with_devices(net(devices[0]), devices.clone()).unwrap();
    let (y, g) = run(&dp, &x);
    assert_eq!(y.device(), devices[0], "gathered on the first device");
    assert_eq!(y.dims(), y0.dims());
    assert_close(&y, &y0, 1e-5, 1e-6);
    assert_eq!(g.len(), g0.len());
    for (a, b) in g.iter().zip(&g0) {
        assert_eq!(a.device(), devices[0]);
        assert_close(a, b, 1e-5, 1e-6);
    }
    assert_eq!(dp.named_parameters()[0].0, "module.fc1.weight");
}

/// Through DataParallel the batch gets the module's own gradient when it requires one, and a
/// second backward through a retained graph adds the same gradients again (Note
/// [DataParallel backward]: each replica's pass keeps its graph too).
fn check_input_gradient_and_retained_graph(devices: Vec<Device>, rows: usize) {
    let x = Tensor::randn([rows, 6], DType::F32, Device::Cpu).unwrap();
    let loss =
        |model: &dyn Forward, x: &Tensor| model.forward(x).unwrap().square().unwrap().mean_all().unwrap();
    let single = net(devices[0]);
    // Fresh leaves each (on the CPU `to` hands back the tensor itself).
    let leaf = || {
        let t = x.to(devices[0]).unwrap().deep_clone().unwrap();
        t.requires_grad_(true).unwrap()
    };
    let x0 = leaf();
    loss(&single, &x0).backward().unwrap();
    let dp = DataParallel::with_devices(net(devices[0]), devices.clone()).unwrap();
    let x1 = leaf();
    let l = loss(&dp, &x1);
    l.backward_with(None, true).unwrap();
    assert_close(&x1.grad().unwrap(), &x0.grad().unwrap(), 1e-5, 1e-6);
    l.backward_with(None, false).unwrap();
    assert_close(
        &x1.grad().unwrap(),
        &x0.grad().unwrap().mul_scalar(2.0).unwrap(),
        1e-5,
        1e-6,
    );
    for (p, q) in dp.parameters().iter().zip(single.parameters()) {
        let twice = q.grad().unwrap().mul_scalar(2.0).unwrap();
        assert_close(&p.grad().unwrap(), &twice, 1e-5, 1e-6);
    }
    // The graph is gone after a backward that did not retain it.
    assert!(l.backward().is_err());
}

#[derive(Module, Clone)]
struct Partly {
    used: Linear,
    unused: Linear,
}

impl Forward for Partly {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        self.used.forward(x)
    }
}

/// A parameter the forward never reads gets no gradient, the others theirs; a frozen one
/// neither, and no replica needs it to.
fn check_unused_and_frozen_parameters(devices: Vec<Device>) {
    let dp = DataParallel::with_devices(
        Partly {
            used: Linear::new(6, 3, devices[0]).unwrap(),
            unused: Linear::new(6, 3, devices[0]).unwrap(),
        },
        devices.clone(),
    )
    .unwrap();
    dp.module()
        .used
        .bias
        .as_ref()
        .unwrap()
        .requires_grad_(false)
        .unwrap();
    let x = Tensor::randn([8, 6], DType::F32, devices[0]).unwrap();
    dp.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
    let m = dp.module();
    let expected = x.sum_dim(0, true).unwrap().expand(&[3, 6]).unwrap();
    assert_close(&m.used.weight.grad().unwrap(), &expected, 1e-5, 1e-5);
    assert!(m.used.bias.as_ref().unwrap().grad().is_none(), "frozen");
    assert!(m.unused.weight.grad().is_none(), "never read");
}

#[test]
fn data_parallel_over_cpu_replicas_gives_the_full_batch_gradients() {
    check_input_gradient_and_retained_graph(vec![Device::Cpu; 3], 10);
    check_unused_and_frozen_parameters(vec![Device::Cpu; 2]);
    check(vec![Device::Cpu; 3], 10);
    // Fewer rows than devices: as many chunks as rows.
    check(vec![Device::Cpu; 3], 2);
    // One device, and none: the module itself.
    check(vec![Device::Cpu], 4);
    let x = Tensor::randn([4, 6], DType::F32, Device::Cpu).unwrap();
    let dp = DataParallel::with_devices(net(Device::Cpu), []).unwrap();
    assert_close(
        &dp.forward(&x).unwrap(),
        &net(Device::Cpu).forward(&x).unwrap(),
        0.0,
        0.0,
    );
}

/// How [`Faulty`]'s backward behaves: 0 as the identity, 1 an error, 2 a panic on the
/// replicas' worker threads (Note [DataParallel workers]) and the identity elsewhere.
static FAULT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

#[derive(Module, Clone)]
struct Faulty {
    fc: Linear,
}

impl Forward for Faulty {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        let y = self.fc.forward(x)?;
        let fault = FAULT.load(std::sync::atomic::Ordering::SeqCst);
        Ok(ember_core::autograd::custom_op(
            "faulty",
            &[&y],
            y.detach(),
            move |g, _| {
                let on_worker = std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with("DataParallel"));
                match fault {
                    1 => Err(Error::invalid("faulty", "backward refused")),
                    2 if on_worker => panic!("a replica's backward panics on purpose"),
                    _ => Ok(vec![Some(g.clone())]),
                }
            },
        ))
    }
}

/// Note [DataParallel backward]: an error in a replica's backward pass is backward's error,
/// a panic on a worker's thread is an error that names the replica's device, and the wrapper
/// and its workers go on: the next step gets the full batch's gradients.
#[test]
fn data_parallel_backward_errors_and_panics_fail_backward_and_the_wrapper_lives_on() {
    let dp = DataParallel::with_devices(
        Faulty {
            fc: Linear::new(6, 3, Device::Cpu).unwrap(),
        },
        vec![Device::Cpu; 2],
    )
    .unwrap();
    let x = Tensor::randn([8, 6], DType::F32, Device::Cpu).unwrap();
    let step = |fault: u8| {
        FAULT.store(fault, std::sync::atomic::Ordering::SeqCst);
        dp.zero_grad().unwrap();
        dp.forward(&x).unwrap().sum_all().unwrap().backward()
    };
    let e = step(1).unwrap_err();
    assert!(e.to_string().contains("backward refused"), "{e}");
    let e = step(2).unwrap_err();
    assert!(e.to_string().contains("panicked in its backward"), "{e}");
    assert!(e.to_string().contains("cpu"), "{e}");
    step(0).unwrap();
    let expected = x.sum_dim(0, true).unwrap().expand(&[3, 6]).unwrap();
    assert_close(&dp.module().fc.weight.grad().unwrap(), &expected, 1e-5, 1e-5);
}

#[test]
fn data_parallel_argument_errors() {
    // The module may be built on the CPU (PyTorch's order: wrap, then move) but must be on
    // the first device when the forward runs; no GPU is needed to see the error.
    let dp = DataParallel::with_devices(net(Device::Cpu), [Device::Cuda(0)]).unwrap();
    let x = Tensor::randn([4, 6], DType::F32, Device::Cpu).unwrap();
    let e = dp.forward(&x).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                op: "DataParallel",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("device_ids[0]") && e.to_string().contains("fc1.weight"),
        "{e}"
    );
    // A batch of different width is the module's own error, from the replica's thread.
    let dp = DataParallel::with_devices(net(Device::Cpu), vec![Device::Cpu; 2]).unwrap();
    let bad = Tensor::randn([4, 5], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(dp.forward(&bad), Err(Error::ShapeMismatch { .. })));
}

#[test]
fn data_parallel_wraps_a_cpu_sequential() {
    // `nn.DataParallel(nn.Sequential(...))`: a Sequential is Clone, so it can be wrapped; on a
    // machine without GPUs the wrapper calls it as it is.
    let model = Sequential::new().with(net(Device::Cpu)).with(ReLU::new());
    let expected = model
        .forward(&Tensor::ones([5, 6], DType::F32, Device::Cpu).unwrap())
        .unwrap();
    let dp = DataParallel::new(model).unwrap();
    if !cuda::is_available() {
        let y = dp
            .forward(&Tensor::ones([5, 6], DType::F32, Device::Cpu).unwrap())
            .unwrap();
        assert_close(&y, &expected, 0.0, 0.0);
    }
    // Over two CPU "devices" the replicas are clones of the Sequential.
    let dp = DataParallel::with_devices(dp.module().clone(), vec![Device::Cpu; 2]).unwrap();
    let (y, grads) = run(&dp, &Tensor::ones([5, 6], DType::F32, Device::Cpu).unwrap());
    assert_close(&y, &expected.detach(), 1e-6, 1e-6);
    assert_eq!(grads.len(), 4);
}

#[test]
#[ignore = "needs two CUDA devices"]
fn data_parallel_over_two_gpus_gives_the_full_batch_gradients() {
    assert!(cuda::device_count() >= 2, "this test needs two CUDA devices");
    check(vec![Device::Cuda(0), Device::Cuda(1)], 64);
    check(vec![Device::Cuda(0), Device::Cuda(1)], 1);
    check_input_gradient_and_retained_graph(vec![Device::Cuda(0), Device::Cuda(1)], 10);
    check_unused_and_frozen_parameters(vec![Device::Cuda(0), Device::Cuda(1)]);
    // Module on cuda:1, devices [1, 0]: gathered on cuda:1.
    check(vec![Device::Cuda(1), Device::Cuda(0)], 9);
    // The module not on device_ids[0] is an error naming it, at the forward.
    let dp = DataParallel::with_devices(net(Device::Cuda(0)), [Device::Cuda(1), Device::Cuda(0)]).unwrap();
    let x = Tensor::randn([4, 3], DType::F32, Device::Cuda(1)).unwrap();
    let e = dp.forward(&x).unwrap_err();
    assert!(e.to_string().contains("device_ids[0]"), "{e}");
    // PyTorch's tutorial order: wrap a CPU Sequential, then move the wrapper.
    let model = Sequential::new()
        .with(Linear::new(3, 6, Device::Cpu).unwrap())
        .with(ReLU::new());
    let mut dp = DataParallel::new(model).unwrap();
    dp.to_device(Device::Cuda(0)).unwrap();
    let y = dp
        .forward(&Tensor::randn([8, 3], DType::F32, Device::Cuda(0)).unwrap())
        .unwrap();
    assert_eq!((y.dims(), y.device()), (&[8usize, 6][..], Device::Cuda(0)));
}

/// A hand-written module whose `visit_mut` reaches one tensor fewer than its `visit`.
#[derive(Clone)]
struct Lopsided {
    w: Tensor,
    b: Tensor,
}

impl Module for Lopsided {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, ember_nn::TensorKind)) {
        f(&format!("{prefix}w"), &self.w, ember_nn::TensorKind::Parameter);
        f(&format!("{prefix}b"), &self.b, ember_nn::TensorKind::Parameter);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, ember_nn::TensorKind) -> ember_core::Result<()>,
    ) -> ember_core::Result<()> {
        f(
            &format!("{prefix}w"),
            &mut self.w,
            ember_nn::TensorKind::Parameter,
        )
    }

    fn set_training(&self, _: bool) {}

    fn is_training(&self) -> bool {
        true
    }
}

impl Forward for Lopsided {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        x.matmul(&self.w)?.add(&self.b)
    }
}

#[test]
fn data_parallel_refuses_a_module_whose_visits_disagree() {
    let m = Lopsided {
        w: Tensor::ones([3, 2], DType::F32, Device::Cpu).unwrap(),
        b: Tensor::zeros([2], DType::F32, Device::Cpu).unwrap(),
    };
    let x = Tensor::ones([4, 3], DType::F32, Device::Cpu).unwrap();
    // The module itself runs; replicating it is refused with a typed error that says why.
    assert_eq!(m.forward(&x).unwrap().dims(), [4, 2]);
    let dp = DataParallel::with_devices(m, vec![Device::Cpu; 2]).unwrap();
    let e = dp.forward(&x).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("visit_mut reaches fewer tensors than visit"),
        "{e}"
    );
}

/// Note [DataParallel row blocks]: the replica's copy of a 128 MiB weight gets its gradient in
/// 4 row blocks, and each block crosses back to the first GPU on its own, once written: the
/// step moves the weight out in four 32 MiB copies and its gradient back in four more
/// (CUPTI's records of copies between GPUs). The gradients equal one GPU's on the full batch.
#[test]
#[ignore = "needs two CUDA devices"]
fn data_parallel_copies_a_large_weight_gradient_back_in_row_blocks_two_gpus() {
    use ember_core::profiler::{self, CudaTimingSource, ProfilerActivity};
    assert!(cuda::device_count() >= 2, "this test needs two CUDA devices");
    let wide = |device: Device| {
        let w: Vec<f32> = (0..8192 * 4096)
            .map(|i| ((i * 7) % 13) as f32 / 1300.0 - 0.005)
            .collect();
        let mut fc = Linear::new(4096, 8192, Device::Cpu).unwrap();
        {
            let _g = ember_core::no_grad();
            fc.weight
                .copy_(&Tensor::from_vec(w, [8192usize, 4096], Device::Cpu).unwrap())
                .unwrap();
            fc.bias.as_ref().unwrap().zero_().unwrap();
        }
        fc.to_device(device).unwrap();
        fc
    };
    let x: Vec<f32> = (0..16 * 4096)
        .map(|i| ((i * 5) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(x, [16usize, 4096], Device::Cpu)
        .unwrap()
        .to(Device::Cuda(0))
        .unwrap();
    let (_, expected) = run(&wide(Device::Cuda(0)), &x);
    let dp = DataParallel::with_devices(wide(Device::Cuda(0)), [Device::Cuda(0), Device::Cuda(1)]).unwrap();
    run(&dp, &x); // warm-up: the workers start, the plans are made
    let mut prof = profiler::profile()
        .activities([ProfilerActivity::Cpu, ProfilerActivity::Cuda])
        .start()
        .unwrap();
    let (_, got) = run(&dp, &x);
    cuda::synchronize(0).unwrap();
    cuda::synchronize(1).unwrap();
    prof.stop().unwrap();
    for (g, e) in got.iter().zip(&expected) {
        assert_close(g, e, 1e-4, 1e-5);
    }
    assert_eq!(prof.cuda_timing_source(), Some(CudaTimingSource::Cupti));
    let trace = prof.trace().unwrap();
    let crossings: Vec<u64> = trace
        .gpu_activities()
        .iter()
        .filter(|a| a.name == "Memcpy PtoP (Device -> Device)")
        .map(|a| a.bytes)
        .collect();
    let count = |bytes: u64| crossings.iter().filter(|&&b| b == bytes).count();
    assert_eq!(
        count(128 << 20),
        0,
        "the weight crosses in blocks only: {crossings:?}"
    );
    assert_eq!(
        count(32 << 20),
        8,
        "the weight out and its gradient back, four blocks each: {crossings:?}"
    );
}
