//! CUDA graphs: capture, replay, private memory pools, and what a capture refuses.
//!
//! Each GPU test that captures runs its body in a process of its own (`common::in_own_process`): exact memory statistics need a
//! process where no other test allocates, and a capture in the default (global) mode makes
//! "unsafe" CUDA calls of every other thread of the process fail while it lasts.

use crate::common::gpu;
use ember_core::cuda::{self, CUDAGraph, Event, GraphOptions, MempoolId, Stream};
use ember_core::{DType, Device, Error, Tensor};

const MIB: usize = 1 << 20;

/// Runs `body` in a child process running only test `name` (`cuda_graphs::<name>`).
fn in_own_process(name: &str, body: fn()) {
    gpu();
    crate::common::in_own_process(&format!("cuda_graphs::{name}"), body);
}

/// The captured region of most tests: `y = x * 2 + 1` (the intermediate `x * 2` is freed during
/// the capture).
fn step(x: &Tensor) -> Tensor {
    x.mul_scalar(2.0).unwrap().add_scalar(1.0).unwrap()
}

/// PyTorch's recipe: run the region a few times on a side stream before capturing it, so that
/// its kernels are loaded (a first launch loads a module, which must not happen in a capture).
fn warm_up(f: impl Fn()) {
    let side = Stream::new_on(0).unwrap();
    let main = cuda::current_stream(0).unwrap();
    side.wait_stream(&main).unwrap();
    {
        let _g = cuda::stream(&side);
        for _ in 0..3 {
            f();
        }
    }
    main.wait_stream(&side).unwrap();
    // The default generator's device copy of its seed and offset (16 bytes from the caching
    // allocator, made at its first capture and kept, as PyTorch's) exists before any test takes
    // its memory baseline.
    let generator = ember_core::default_generator(Device::Cuda(0));
    generator.begin_capture(0).unwrap();
    generator.end_capture().unwrap();
    cuda::synchronize(0).unwrap();
}

fn host(data: Vec<f32>) -> Tensor {
    let n = data.len();
    Tensor::from_vec(data, [n], Device::Cpu).unwrap()
}

/// Without a GPU the API answers with errors, never a panic; nothing needs a device until a
/// capture begins.
#[test]
fn graph_api_answers_without_a_capture() {
    let mut g = CUDAGraph::new();
    assert!(!g.is_captured());
    assert!(matches!(g.replay(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(g.capture_end(), Err(Error::InvalidArgument { .. })));
    assert!(g.pool().is_err());
    g.reset();
    let (a, b) = (cuda::graph_pool_handle(), cuda::graph_pool_handle());
    assert_ne!(a, b);
    assert_eq!((a.0, b.0), (0, 0), "user pools are (0, n), as PyTorch's");
    assert!(!cuda::is_current_stream_capturing());
    if !cuda::is_available() {
        assert!(matches!(
            g.capture_begin(None),
            Err(Error::CudaUnavailable { .. })
        ));
        assert!(matches!(cuda::graph(&mut g), Err(Error::CudaUnavailable { .. })));
        assert!(!g.is_captured());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn capture_refuses_the_default_stream() {
    let gpu = gpu();
    let mut g = CUDAGraph::new();
    let err = g.capture_begin(None).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { .. }) && err.to_string().contains("default stream"),
        "{err}"
    );
    assert!(!cuda::is_current_stream_capturing());
    assert!(g.pool().is_err() && g.replay().is_err());
    let x = Tensor::ones([8], DType::F32, gpu).unwrap();
    assert_eq!(x.add_scalar(1.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0; 8]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn replay_recomputes_from_new_static_inputs() {
    in_own_process("replay_recomputes_from_new_static_inputs", || {
        let n = 4096;
        let x = Tensor::zeros([n], DType::F32, Device::Cuda(0)).unwrap(); // the static input
        warm_up(|| drop(step(&x)));
        let mut g = CUDAGraph::new();
        let capture = cuda::graph(&mut g).unwrap();
        assert!(cuda::is_current_stream_capturing());
        assert_ne!(capture.stream().as_raw(), 0);
        let y = step(&x); // the static output
        capture.end().unwrap();
        assert!(!cuda::is_current_stream_capturing());
        assert!(g.is_captured());
        assert_eq!(cuda::current_stream(0).unwrap(), cuda::default_stream(0).unwrap());
        for k in 0..5 {
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - k as f32).collect();
            x.copy_(&host(data.clone())).unwrap();
            g.replay().unwrap();
            let want: Vec<f32> = data.iter().map(|v| v * 2.0 + 1.0).collect();
            assert_eq!(y.to_vec::<f32>().unwrap(), want, "replay {k}");
        }
        // A replay on another stream, ordered after the input copy.
        let s = Stream::new_on(0).unwrap();
        x.copy_(&host(vec![10.0; n])).unwrap();
        s.wait_stream(&cuda::current_stream(0).unwrap()).unwrap();
        {
            let _g = cuda::stream(&s);
            g.replay().unwrap();
        }
        cuda::current_stream(0).unwrap().wait_stream(&s).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![21.0; n]);
        // A graph holds one capture: capture_begin again needs reset first.
        assert!(matches!(
            g.capture_begin(None),
            Err(Error::InvalidArgument { .. })
        ));
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn replays_keep_memory_statistics_flat() {
    in_own_process("replays_keep_memory_statistics_flat", || {
        let n = 1 << 20; // 4 MiB of f32: a large-pool block
        let x = Tensor::zeros([n], DType::F32, Device::Cuda(0)).unwrap();
        warm_up(|| drop(step(&x)));
        let mut g = CUDAGraph::new();
        let capture = cuda::graph(&mut g).unwrap();
        let y = step(&x);
        capture.end().unwrap();
        let input = host((0..n).map(|i| (i % 1000) as f32).collect());
        // One round first: the host-to-device copy's staging block gets cached.
        x.copy_(&input).unwrap();
        g.replay().unwrap();
        cuda::synchronize(0).unwrap();
        let stats = || {
            let s = cuda::memory_stats(0);
            (
                cuda::memory_allocated(0),
                cuda::memory_reserved(0),
                s["num_device_alloc"],
                s["segment.all.current"],
            )
        };
        let before = stats();
        for _ in 0..1000 {
            x.copy_(&input).unwrap();
            g.replay().unwrap();
        }
        cuda::synchronize(0).unwrap();
        assert_eq!(stats(), before, "1,000 replays allocate nothing");
        let out = y.to_vec::<f32>().unwrap();
        assert!(out
            .iter()
            .enumerate()
            .all(|(i, &v)| v == (i % 1000) as f32 * 2.0 + 1.0));
        assert_eq!(cuda::memory_allocated(0), before.0);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropping_a_graph_returns_its_pool() {
    in_own_process("dropping_a_graph_returns_its_pool", || {
        let n = 1 << 20; // 4 MiB blocks: the capture takes a 20 MiB segment of its own
        let x = Tensor::ones([n], DType::F32, Device::Cuda(0)).unwrap();
        warm_up(|| drop(step(&x)));
        cuda::empty_cache().unwrap();
        let (allocated0, reserved0) = (cuda::memory_allocated(0), cuda::memory_reserved(0));
        for output_first in [true, false] {
            let mut g = CUDAGraph::new();
            let capture = cuda::graph(&mut g).unwrap();
            let y = step(&x);
            capture.end().unwrap();
            assert_eq!(
                cuda::memory_allocated(0),
                allocated0 + 4 * MIB,
                "the output is allocated; the freed intermediate is not"
            );
            assert_eq!(cuda::memory_reserved(0), reserved0 + 20 * MIB);
            g.replay().unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap()[n - 1], 3.0);
            if output_first {
                drop(y);
                cuda::empty_cache().unwrap();
                assert_eq!(
                    cuda::memory_reserved(0),
                    reserved0 + 20 * MIB,
                    "a live graph's pool keeps its memory through empty_cache"
                );
                assert_eq!(cuda::memory_allocated(0), allocated0);
                drop(g);
            } else {
                drop(g);
                cuda::empty_cache().unwrap();
                assert_eq!(
                    cuda::memory_reserved(0),
                    reserved0 + 20 * MIB,
                    "the output made during capture keeps its segment"
                );
                assert_eq!(y.to_vec::<f32>().unwrap()[0], 3.0, "and stays readable");
                drop(y);
            }
            cuda::empty_cache().unwrap();
            assert_eq!(cuda::memory_reserved(0), reserved0, "output_first {output_first}");
            assert_eq!(cuda::memory_allocated(0), allocated0);
        }
    });
}

/// What cannot be captured, each as the error it gives during a capture (the op's name).
type Refused = (&'static str, fn(&Tensor, &Event) -> ember_core::Result<()>);

const REFUSED: [Refused; 9] = [
    ("Tensor::to_vec", |y, _| y.to_vec::<f32>().map(drop)),
    ("Tensor::item", |y, _| y.narrow(0, 0, 1)?.item::<f32>().map(drop)),
    ("Tensor::to_vec_f64", |y, _| y.to_vec_f64().map(drop)),
    (
        "a copy from the device to host memory (to_vec, item, to(Device::Cpu), printing)",
        |y, _| y.to(Device::Cpu).map(drop),
    ),
    ("a copy from host memory to the device", |y, _| {
        y.copy_(&host(vec![1.0; 1024])).map(drop)
    }),
    ("cuda::synchronize", |_, _| cuda::synchronize(0)),
    ("Stream::synchronize", |_, _| {
        cuda::current_stream(0)?.synchronize()
    }),
    ("Event::query", |_, e| e.query().map(drop)),
    ("empty_cache", |_, _| cuda::empty_cache()),
];

#[test]
#[ignore = "needs a CUDA device"]
fn refused_ops_end_the_capture_and_eager_work_goes_on() {
    in_own_process("refused_ops_end_the_capture_and_eager_work_goes_on", || {
        let gpu = Device::Cuda(0);
        let n = 1024;
        let x = Tensor::ones([n], DType::F32, gpu).unwrap();
        warm_up(|| drop(step(&x)));
        let event = Event::new(false);
        event.record().unwrap();
        cuda::empty_cache().unwrap();
        let (allocated0, reserved0) = (cuda::memory_allocated(0), cuda::memory_reserved(0));
        for (name, refused) in REFUSED {
            let mut g = CUDAGraph::new();
            let capture = cuda::graph(&mut g).unwrap();
            let y = step(&x);
            let err = refused(&y, &event).unwrap_err();
            match &err {
                Error::IllegalDuringCapture { op, device, ended } => {
                    assert_eq!((*op, *device, *ended), (name, gpu, true), "{err}");
                }
                other => panic!("{name}: expected IllegalDuringCapture, got {other}"),
            }
            let msg = err.to_string();
            assert!(msg.contains(name) && msg.contains("capture was ended"), "{msg}");
            assert!(
                !cuda::is_current_stream_capturing(),
                "{name}: the capture was ended"
            );
            // The rest of the region runs eagerly, on the side stream.
            let z = step(&x);
            assert!(
                matches!(capture.end(), Err(Error::IllegalDuringCapture { .. })),
                "{name}"
            );
            assert!(!g.is_captured());
            let replay = g.replay().unwrap_err();
            assert!(replay.to_string().contains("capture failed"), "{replay}");
            // Eager work goes on, ordered after what the region ran.
            assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.0; n], "{name}");
            assert_eq!(step(&x).to_vec::<f32>().unwrap(), vec![3.0; n], "{name}");
            cuda::synchronize(0).unwrap();
            // The graph captures again after reset.
            g.reset();
            let capture = cuda::graph(&mut g).unwrap();
            let y2 = step(&x);
            capture.end().unwrap();
            g.replay().unwrap();
            assert_eq!(y2.to_vec::<f32>().unwrap(), vec![3.0; n], "{name}");
            drop((y, y2, z));
        }
        // A device-wide wait from another thread fails without ending this thread's capture.
        let mut g = CUDAGraph::new();
        let capture = cuda::graph(&mut g).unwrap();
        let y = step(&x);
        let other = std::thread::spawn(|| cuda::synchronize(0)).join().unwrap();
        assert!(
            matches!(other, Err(Error::IllegalDuringCapture { ended: false, .. })),
            "{other:?}"
        );
        assert!(cuda::is_current_stream_capturing());
        capture.end().unwrap();
        g.replay().unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.0; n]);
        drop((g, y));
        cuda::empty_cache().unwrap();
        assert_eq!(cuda::memory_allocated(0), allocated0, "nothing leaked");
        assert_eq!(cuda::memory_reserved(0), reserved0, "every graph pool returned");
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn two_graphs_share_a_pool() {
    in_own_process("two_graphs_share_a_pool", || {
        let n = 4096;
        let x = Tensor::zeros([n], DType::F32, Device::Cuda(0)).unwrap();
        warm_up(|| drop(step(&x).mul_scalar(3.0).unwrap()));
        let pool = cuda::graph_pool_handle();
        let shared = |pool: MempoolId| GraphOptions {
            pool: Some(pool),
            ..Default::default()
        };
        let mut g1 = CUDAGraph::new();
        let capture = cuda::graph_with(&mut g1, shared(pool)).unwrap();
        let t = x.mul_scalar(2.0).unwrap();
        let freed = t.data_ptr();
        let y1 = t.add_scalar(1.0).unwrap();
        drop(t); // freed during g1's capture, into the pool
        capture.end().unwrap();
        assert_eq!(g1.pool().unwrap(), pool);

        let mut g2 = CUDAGraph::new();
        let capture = cuda::graph_with(&mut g2, shared(g1.pool().unwrap())).unwrap();
        let segments = cuda::memory_stats(0)["num_device_alloc"];
        // While g2 captures into the pool, no other capture may.
        let mut g3 = CUDAGraph::new();
        let side = Stream::new_on(0).unwrap();
        {
            let _s = cuda::stream(&side);
            let err = g3.capture_begin(Some(pool)).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        }
        let y2 = y1.mul_scalar(3.0).unwrap(); // consumes g1's output
        assert_eq!(
            y2.data_ptr(),
            freed,
            "g2 reuses the block g1 freed in the shared pool"
        );
        assert_eq!(cuda::memory_stats(0)["num_device_alloc"], segments);
        capture.end().unwrap();
        assert_eq!(g2.pool().unwrap(), pool);

        for k in 0..3 {
            let data: Vec<f32> = (0..n).map(|i| (i + k) as f32).collect();
            x.copy_(&host(data.clone())).unwrap();
            g1.replay().unwrap(); // in capture order
            g2.replay().unwrap();
            let want: Vec<f32> = data.iter().map(|v| (v * 2.0 + 1.0) * 3.0).collect();
            assert_eq!(y2.to_vec::<f32>().unwrap(), want, "round {k}");
        }
        // Dropping one graph leaves the other's memory in place.
        drop(g1);
        cuda::empty_cache().unwrap();
        x.copy_(&host(vec![1.0; n])).unwrap();
        g2.replay().unwrap(); // y1 still holds (x*2+1) of the last round: 3 * that
        let last: Vec<f32> = (0..n).map(|i| ((i + 2) as f32 * 2.0 + 1.0) * 3.0).collect();
        assert_eq!(y2.to_vec::<f32>().unwrap(), last);
    });
}

/// A captured draw from the device's default generator draws new numbers at every replay: the
/// numbers 3 eager runs from the same seed draw, in order, and the generator ends where theirs
/// did (the graph's capture and replay prologues, Note [Philox under graph capture]).
#[test]
#[ignore = "needs a CUDA device"]
fn replays_draw_what_eager_runs_draw_from_the_default_generator() {
    in_own_process(
        "replays_draw_what_eager_runs_draw_from_the_default_generator",
        || {
            let gpu = Device::Cuda(0);
            let x = Tensor::ones([4099], DType::F32, gpu).unwrap();
            let region = || Tensor::rand([4099], DType::F32, gpu).unwrap().add(&x).unwrap();
            warm_up(|| drop(region()));
            ember_core::manual_seed(5).unwrap();
            let eager: Vec<Vec<f32>> = (0..3).map(|_| region().to_vec::<f32>().unwrap()).collect();
            let after = ember_core::default_generator(gpu).get_state();
            ember_core::manual_seed(5).unwrap();
            let mut g = CUDAGraph::new();
            let y = {
                let _capture = cuda::graph(&mut g).unwrap();
                region()
            };
            for (i, expected) in eager.iter().enumerate() {
                g.replay().unwrap();
                assert_eq!(&y.to_vec::<f32>().unwrap(), expected, "replay {i}");
            }
            assert_ne!(eager[0], eager[1]);
            assert_eq!(ember_core::default_generator(gpu).get_state(), after);
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn arange_of_integers_is_made_on_the_device_and_captures() {
    in_own_process("arange_of_integers_is_made_on_the_device_and_captures", || {
        let dev = Device::Cuda(0);
        let positions = || Tensor::arange(0.0, 1000.0, 1.0, DType::I64, dev).unwrap();
        let backwards = || Tensor::arange_i64(7, -8, -3, dev).unwrap();
        warm_up(|| drop((positions(), backwards())));
        let mut g = CUDAGraph::new();
        let capture = cuda::graph(&mut g).unwrap();
        // A host-built tensor would need a copy from pageable memory, which a capture refuses.
        let (a, b) = (positions(), backwards());
        capture.end().unwrap();
        g.replay().unwrap();
        assert_eq!(a.to_vec::<i64>().unwrap(), (0..1000).collect::<Vec<i64>>());
        assert_eq!(b.to_vec::<i64>().unwrap(), vec![7, 4, 1, -2, -5]);
    });
}
