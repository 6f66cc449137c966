//! The capture-safe CUDA path (issue 11, first part): errors found on the device are reported
//! at the next synchronizing call and ops never read back (Note [Deferred device errors]);
//! random kernels read Philox `(seed, offset)` from device memory while a generator captures,
//! drawing what eager execution draws (Note [Philox under graph capture]); fused optimizer
//! steps read the lr, step counts and bias corrections on the device (Note [Capturable
//! optimizer steps]); peer copies do not wait. The last tests record ember's ops into CUDA
//! graphs (`cuda::CUDAGraph`), driving the generator's capture hooks by hand
//! (`Generator::{begin_capture, end_capture, replay_prologue}`), and replay them.

use crate::common::{self, ReadBack};
use ember_core::cuda::{self, CUDAGraph, Event, Stream};
use ember_core::fused::{adam_scaled_, sgd_scaled_, AdamStep, AdamSteps, GradScaling, SgdStep};
use ember_core::{DType, Device, Error, Generator, RngState, Tensor};

fn idx(values: &[i64], dev: Device) -> Tensor {
    Tensor::from_slice(values, [values.len()], dev).unwrap()
}

fn iota(rows: usize, cols: usize, dev: Device) -> Tensor {
    let v: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    Tensor::from_slice(&v, [rows, cols], dev).unwrap()
}

/// Host waits of this thread while `f` runs.
fn waits<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = cuda::host_sync_count();
    let out = f();
    (out, cuda::host_sync_count() - before)
}

/// Runs `body` in a child process running only test `name` (`cuda_capture::<name>`): a capture
/// in the default (global) mode makes the CUDA calls of every other thread of the process that
/// are unsafe during capture fail while it lasts, and a graph capture drives the default
/// generator of its device, which other tests draw from.
fn in_own_process(name: &str, body: fn()) {
    common::gpu();
    common::in_own_process(&format!("cuda_capture::{name}"), body);
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_index_out_of_range_is_reported_at_the_next_synchronize() {
    let gpu = common::gpu();
    let x = iota(10, 3, gpu);
    // The op returns at once, without waiting for the device.
    let (r, n) = waits(|| x.index_select(0, &idx(&[1, 12, 3], gpu)));
    assert!(r.is_ok(), "the op itself does not fail: {:?}", r.err());
    assert_eq!(n, 0, "index_select waited for the device");
    let err = cuda::synchronize(0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 12,
                dim: 0,
                size: 10
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "index 12 is out of bounds for dimension 0 with size 10 in index_select"
    );
    // Reported once; the device stays usable.
    cuda::synchronize(0).unwrap();
    assert_eq!(
        x.index_select(0, &idx(&[2], gpu))
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        [6.0, 7.0, 8.0]
    );
    // Stream and event synchronizations report too.
    let s = Stream::new_on(0).unwrap();
    {
        let _g = cuda::stream(&s);
        x.gather(1, &Tensor::from_slice(&[0i64, 5], [1, 2], gpu).unwrap())
            .unwrap();
    }
    assert!(matches!(
        s.synchronize(),
        Err(Error::IndexOutOfRange {
            op: "gather",
            index: 5,
            dim: 1,
            size: 3
        })
    ));
    s.synchronize().unwrap();
    x.index_add(0, &idx(&[-1], gpu), &iota(1, 3, gpu)).unwrap();
    let e = Event::new(false);
    e.record().unwrap();
    assert!(matches!(
        e.synchronize(),
        Err(Error::IndexOutOfRange {
            op: "index_add",
            index: -1,
            ..
        })
    ));
    e.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_first_failing_op_and_its_first_bad_index_win() {
    let gpu = common::gpu();
    let x = iota(4, 2, gpu);
    // Many bad indices across many blocks: the first in row-major order is named.
    let mut bad: Vec<i64> = (0..100_000).map(|i| i % 4).collect();
    bad[70_001] = 9;
    bad[99_999] = -5;
    bad[31_337] = 7;
    x.index_select(0, &idx(&bad, gpu)).unwrap();
    // A later failing op does not replace the first error.
    x.scatter_add(0, &Tensor::from_slice(&[0i64, 11], [1, 2], gpu).unwrap(), &x)
        .unwrap();
    let err = x.sum_all().unwrap().item::<f32>().unwrap_err();
    assert!(
        matches!(
            err,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 7,
                dim: 0,
                size: 4
            }
        ),
        "{err}"
    );
    cuda::synchronize(0).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn checked_ops_do_not_wait_for_the_device() {
    let gpu = common::gpu();
    let w = iota(50, 8, gpu);
    let i = idx(&[3, 0, 49, 7, 7], gpu);
    let g = Tensor::from_slice(&[1i64, 0, 4, 2, 7, 7, 0, 1], [1, 8], gpu).unwrap();
    let probs = Tensor::rand([1000], DType::F32, gpu).unwrap();
    let ints = Tensor::from_slice(&[2i64, 3, 4], [3], gpu).unwrap();
    let gen = Generator::new(3);
    cuda::synchronize(0).unwrap();
    let (_, n) = waits(|| {
        w.index_select(0, &i).unwrap();
        Tensor::embedding(&i, &w).unwrap();
        w.gather(0, &g).unwrap();
        w.scatter_add(0, &g, &w).unwrap();
        w.index_add(0, &i, &iota(5, 8, gpu)).unwrap();
        i.one_hot(50).unwrap();
        probs.bernoulli_with(&gen).unwrap();
        ints.pow(&ints).unwrap();
    });
    assert_eq!(n, 0, "a checked op waited for the device");
    cuda::synchronize(0).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_probabilities_and_negative_exponents_are_reported_at_the_read_back() {
    let gpu = common::gpu();
    let mut p = vec![0.25f64; 5000];
    p[4000] = -0.5;
    p[1234] = f64::NAN;
    let t = Tensor::from_slice(&p, [5000], gpu).unwrap();
    let err = t.bernoulli().read_back().unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument to bernoulli: expected all probabilities in [0, 1], found NaN"
    );
    let b = Tensor::from_slice(&[2i32, 2], [2], gpu).unwrap();
    let e = Tensor::from_slice(&[1i32, -3], [2], gpu).unwrap();
    let err = b.pow(&e).read_back().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { op: "pow", .. }), "{err}");
    cuda::synchronize(0).unwrap();
}

/// Every random op, in every dtype it takes, drawn with a generator that is capturing (the
/// kernels read `(seed, offset)` through device pointers) equals the eager draw from the same
/// state, bit for bit; the capture reports the blocks it consumed and leaves the host offset
/// alone; `replay_prologue` advances it.
#[test]
#[ignore = "needs a CUDA device"]
fn draws_through_device_pointers_equal_draws_by_value() {
    let gpu = common::gpu();
    type Draw = Box<dyn Fn(&Generator) -> Tensor>;
    let mut draws: Vec<(String, Draw)> = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        draws.push((
            format!("rand {dtype}"),
            Box::new(move |g| Tensor::rand_with([1003], dtype, gpu, g).unwrap()),
        ));
        draws.push((
            format!("normal {dtype}"),
            Box::new(move |g| Tensor::normal_with(1.0, 2.0, [517], dtype, gpu, g).unwrap()),
        ));
        draws.push((
            format!("uniform_ {dtype}"),
            Box::new(move |g| {
                let t = Tensor::zeros([33, 7], dtype, gpu).unwrap();
                t.uniform_with_(-2.0, 3.0, g).unwrap()
            }),
        ));
        draws.push((
            format!("bernoulli(tensor) {dtype}"),
            Box::new(move |g| {
                Tensor::full([999], 0.3, dtype, gpu)
                    .unwrap()
                    .bernoulli_with(g)
                    .unwrap()
            }),
        ));
    }
    for dtype in common::ALL_DTYPES {
        draws.push((
            format!("bernoulli_ {dtype}"),
            Box::new(move |g| {
                let t = Tensor::zeros([4097], dtype, gpu).unwrap();
                t.bernoulli_with_(0.7, g).unwrap()
            }),
        ));
    }
    draws.push((
        "randint".into(),
        Box::new(move |g| Tensor::randint_with(-5, 1 << 40, [301], gpu, g).unwrap()),
    ));
    for state in [
        RngState { seed: 42, offset: 0 },
        RngState {
            seed: 0x0123_4567_89ab_cdef,
            offset: u64::MAX - 7,
        },
    ] {
        for (what, draw) in &draws {
            let g = Generator::new(0);
            g.set_state(state);
            let eager = draw(&g);
            let eager_again = draw(&g);
            let consumed = g.get_state().offset.wrapping_sub(state.offset);
            g.set_state(state);
            let ptrs = g.begin_capture(0).unwrap();
            assert!(ptrs.seed_ptr != 0 && ptrs.offset_ptr != 0);
            assert!(g.is_capturing());
            let captured = draw(&g);
            let captured_again = draw(&g);
            let increment = g.end_capture().unwrap();
            assert_eq!(increment, consumed, "{what}: blocks the capture consumed");
            assert_eq!(g.get_state(), state, "{what}: the capture moved the host offset");
            for (a, b, k) in [(&captured, &eager, 0), (&captured_again, &eager_again, 1)] {
                assert_eq!(
                    a.to_dtype(DType::F64)
                        .unwrap()
                        .to_vec::<f64>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    b.to_dtype(DType::F64)
                        .unwrap()
                        .to_vec::<f64>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    "{what} {state:?}: draw {k} through device pointers"
                );
            }
            g.replay_prologue(0, increment).unwrap();
            assert_eq!(g.get_state().offset, state.offset.wrapping_add(increment));
        }
    }
    // Misuse is an error, never a panic.
    let g = Generator::new(1);
    assert!(g.end_capture().is_err());
    assert!(g.replay_prologue(0, 4).is_err(), "never captured on cuda:0");
    g.begin_capture(0).unwrap();
    assert!(g.begin_capture(0).is_err());
    assert!(g.replay_prologue(0, 4).is_err());
    assert!(Tensor::randperm_with(10, gpu, &g).is_err());
    assert!(Tensor::rand_with([4], DType::F32, Device::Cpu, &g).is_err());
    g.end_capture().unwrap();
}

// ---- real CUDA graphs (cuda::CUDAGraph) -----------------------------------------------------

/// A Bernoulli mask (what dropout draws) recorded into a graph draws a fresh mask at every
/// replay, each equal to the eager draw from the generator's state at that replay (computed on
/// the CPU, which gives the same bits).
#[test]
#[ignore = "needs a CUDA device"]
fn a_captured_draw_draws_new_numbers_at_every_replay() {
    in_own_process(
        "a_captured_draw_draws_new_numbers_at_every_replay",
        a_captured_draw_draws_new_numbers_at_every_replay_body,
    );
}

fn a_captured_draw_draws_new_numbers_at_every_replay_body() {
    let gpu = common::gpu();
    let n = 10_000;
    let gen = Generator::new(11);
    let mask = Tensor::empty([n], DType::F32, gpu).unwrap();
    // Warm-up: the kernel is loaded before the capture.
    mask.bernoulli_with_(0.5, &gen).unwrap();
    cuda::synchronize(0).unwrap();
    let start = RngState {
        seed: 11,
        offset: 1000,
    };
    gen.set_state(start);
    // Before the stream capture begins: writes the state to the device.
    gen.begin_capture(0).unwrap();
    let mut graph = CUDAGraph::new();
    {
        let _capture = cuda::graph(&mut graph).unwrap();
        mask.bernoulli_with_(0.5, &gen).unwrap();
    }
    let increment = gen.end_capture().unwrap();
    assert!(graph.is_captured());
    assert_eq!(increment, n.div_ceil(4) as u64);
    let mut masks = Vec::new();
    for replay in 0..3u64 {
        gen.replay_prologue(0, increment).unwrap();
        graph.replay().unwrap();
        let got = mask.to_vec::<f32>().unwrap();
        let cpu = Generator::new(0);
        cpu.set_state(RngState {
            seed: 11,
            offset: start.offset + replay * increment,
        });
        let expected = Tensor::zeros([n], DType::F32, Device::Cpu)
            .unwrap()
            .bernoulli_with_(0.5, &cpu)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got, expected, "replay {replay}");
        masks.push(got);
    }
    assert_ne!(masks[0], masks[1]);
    assert_eq!(gen.get_state().offset, start.offset + 3 * increment);
}

/// An index op recorded into a graph checks its indices at every replay: a bad index copied
/// into the graph's static index tensor is reported by the next synchronizing call, naming the
/// op, and the graph replays fine again once the index is fixed.
#[test]
#[ignore = "needs a CUDA device"]
fn an_index_error_in_a_replayed_graph_is_reported_at_the_next_synchronize() {
    in_own_process(
        "an_index_error_in_a_replayed_graph_is_reported_at_the_next_synchronize",
        an_index_error_in_a_replayed_graph_is_reported_at_the_next_synchronize_body,
    );
}

fn an_index_error_in_a_replayed_graph_is_reported_at_the_next_synchronize_body() {
    let gpu = common::gpu();
    let x = iota(10, 3, gpu);
    let i = idx(&[1, 2, 3], gpu);
    x.index_select(0, &i).unwrap(); // warm-up
    cuda::synchronize(0).unwrap();
    let mut graph = CUDAGraph::new();
    let y = {
        let _capture = cuda::graph(&mut graph).unwrap();
        x.index_select(0, &i).unwrap()
    };
    graph.replay().unwrap();
    assert_eq!(
        y.to_vec::<f32>().unwrap(),
        [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    );
    i.copy_(&idx(&[0, 42, 1], gpu)).unwrap();
    graph.replay().unwrap();
    let err = cuda::synchronize(0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::IndexOutOfRange {
                op: "index_select",
                index: 42,
                dim: 0,
                size: 10
            }
        ),
        "{err}"
    );
    i.copy_(&idx(&[9, 0, 1], gpu)).unwrap();
    graph.replay().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap()[..3], [27.0, 28.0, 29.0]);
}

/// A fused Adam step with device step counts and a device lr, recorded once and replayed
/// with the lr changed between replays (as an LR scheduler does through `set_lr`), equals the
/// same steps run eagerly on the CPU with those learning rates; an SGD step likewise.
#[test]
#[ignore = "needs a CUDA device"]
fn a_captured_optimizer_step_follows_the_lr_between_replays() {
    in_own_process(
        "a_captured_optimizer_step_follows_the_lr_between_replays",
        a_captured_optimizer_step_follows_the_lr_between_replays_body,
    );
}

fn a_captured_optimizer_step_follows_the_lr_between_replays_body() {
    let gpu = common::gpu();
    let lrs = [0.1, 0.01, 0.05, 0.2];
    let sizes = [5usize, 4096 + 3, 70];
    let make = |d: Device, seed: u64| -> Vec<Tensor> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v: Vec<f32> = common::values(n, seed + i as u64)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                Tensor::from_slice(&v, [n], d).unwrap()
            })
            .collect()
    };
    let zeros = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(|t| t.zeros_like().unwrap()).collect() };
    let adam = AdamStep {
        lr: lrs[0],
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: true,
    };
    let sgd = SgdStep {
        lr: lrs[0],
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        maximize: false,
        first_step: false,
    };
    // Reference on the CPU: eager steps with the lr by value.
    let (pc, gc) = (make(Device::Cpu, 1), make(Device::Cpu, 100));
    let (mc, vc) = (zeros(&pc), zeros(&pc));
    let qc = make(Device::Cpu, 1);
    let bc = zeros(&qc);
    let steps_c: Vec<Tensor> = sizes
        .iter()
        .map(|_| Tensor::scalar(0.0, DType::F32, Device::Cpu).unwrap())
        .collect();
    for &lr in &lrs {
        let a = AdamStep { lr, ..adam };
        adam_scaled_(
            &pc,
            &gc,
            &mc,
            &vc,
            None,
            AdamSteps::Device(&steps_c),
            &a,
            GradScaling::default(),
            None,
        )
        .unwrap();
        ember_core::fused::sgd_(&qc, &gc, Some(&bc), &SgdStep { lr, ..sgd }).unwrap();
    }
    // On the GPU: the first step eagerly (warm-up), the others as replays of one graph.
    let (pg, gg) = (make(gpu, 1), make(gpu, 100));
    let (mg, vg) = (zeros(&pg), zeros(&pg));
    let qg = make(gpu, 1);
    let bg = zeros(&qg);
    let steps_g: Vec<Tensor> = sizes
        .iter()
        .map(|_| Tensor::scalar(0.0, DType::F32, gpu).unwrap())
        .collect();
    let lr = Tensor::scalar(lrs[0], DType::F64, gpu).unwrap();
    let sgd_lr = Tensor::scalar(lrs[0], DType::F64, gpu).unwrap();
    let step = || {
        adam_scaled_(
            &pg,
            &gg,
            &mg,
            &vg,
            None,
            AdamSteps::Device(&steps_g),
            &adam,
            GradScaling::default(),
            Some(&lr),
        )
        .unwrap();
        sgd_scaled_(&qg, &gg, Some(&bg), &sgd, GradScaling::default(), Some(&sgd_lr)).unwrap();
    };
    step();
    cuda::synchronize(0).unwrap();
    let mut graph = CUDAGraph::new();
    {
        let _capture = cuda::graph(&mut graph).unwrap();
        step();
    }
    assert!(graph.is_captured());
    for &l in &lrs[1..] {
        // What an LR scheduler's set_lr does: a write into the device tensor, on the stream.
        let _ng = ember_core::no_grad();
        lr.fill_(l).unwrap();
        sgd_lr.fill_(l).unwrap();
        graph.replay().unwrap();
    }
    cuda::synchronize(0).unwrap();
    for (k, t) in steps_g.iter().enumerate() {
        assert_eq!(t.item::<f32>().unwrap(), lrs.len() as f32, "step count {k}");
    }
    for (what, got, want) in [("adam", &pg, &pc), ("sgd", &qg, &qc)] {
        for (k, (a, b)) in got.iter().zip(want).enumerate() {
            // Adam's bias corrections use the device's pow: equal to ~1 ulp.
            common::assert_close(&a.to(Device::Cpu).unwrap(), b, 1e-6, 1e-7);
            if what == "sgd" {
                assert_eq!(
                    a.to_vec::<f32>().unwrap(),
                    b.to_vec::<f32>().unwrap(),
                    "sgd param {k}"
                );
            }
        }
    }
}

/// Note [Casts a captured step keeps]: a captured step that casts float32 parameters to bf16
/// and then steps them with the fused Adam keeps the casts from one replay to the next (the
/// capture takes the last eager step's twins as the casts' buffers, and the captured step
/// writes them), and still equals the same steps run eagerly: replay after replay, after a
/// write to a parameter outside the graph, and after another graph that writes a parameter
/// was replayed in between.
#[test]
#[ignore = "needs a CUDA device"]
fn a_captured_step_keeps_its_parameter_casts_between_replays() {
    in_own_process(
        "a_captured_step_keeps_its_parameter_casts_between_replays",
        a_captured_step_keeps_its_parameter_casts_between_replays_body,
    );
}

fn a_captured_step_keeps_its_parameter_casts_between_replays_body() {
    let gpu = common::gpu();
    let sizes = [[64usize, 96], [4096 + 3, 5], [7, 1]];
    let adam = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        amsgrad: false,
        maximize: false,
        decoupled_weight_decay: true,
    };
    // Two identical sets of parameters, optimizer state and gradient buffers: one stepped
    // eagerly, one by the graph.
    struct Run {
        p: Vec<Tensor>,
        g: Vec<Tensor>,
        m: Vec<Tensor>,
        v: Vec<Tensor>,
        steps: Vec<Tensor>,
        lr: Tensor,
    }
    let run = || Run {
        p: sizes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v: Vec<f32> = common::values(s[0] * s[1], 7 + i as u64)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                Tensor::from_slice(&v, *s, gpu).unwrap()
            })
            .collect(),
        g: sizes
            .iter()
            .map(|s| Tensor::zeros(*s, DType::F32, gpu).unwrap())
            .collect(),
        m: sizes
            .iter()
            .map(|s| Tensor::zeros(*s, DType::F32, gpu).unwrap())
            .collect(),
        v: sizes
            .iter()
            .map(|s| Tensor::zeros(*s, DType::F32, gpu).unwrap())
            .collect(),
        steps: sizes
            .iter()
            .map(|_| Tensor::scalar(0.0, DType::F32, gpu).unwrap())
            .collect(),
        lr: Tensor::scalar(adam.lr, DType::F64, gpu).unwrap(),
    };
    // The "forward and backward": each gradient is computed from the parameter's bf16 cast
    // (as a linear under autocast reads its weight), so a stale cast changes the step.
    let step = |r: &Run| {
        for (p, g) in r.p.iter().zip(&r.g) {
            let w = p.to_dtype(DType::BF16).unwrap();
            g.copy_(&w.mul_scalar(0.5).unwrap().add_scalar(-0.25).unwrap())
                .unwrap();
        }
        adam_scaled_(
            &r.p,
            &r.g,
            &r.m,
            &r.v,
            None,
            AdamSteps::Device(&r.steps),
            &adam,
            GradScaling::default(),
            Some(&r.lr),
        )
        .unwrap();
    };
    let (eager, graphed) = (run(), run());
    let same = |when: &str| {
        cuda::synchronize(0).unwrap();
        for (k, (a, b)) in eager.p.iter().zip(&graphed.p).enumerate() {
            assert_eq!(
                a.to_vec::<f32>().unwrap(),
                b.to_vec::<f32>().unwrap(),
                "parameter {k} {when}"
            );
        }
    };
    // Warm-up (kernels loaded, and the bf16 twins the casts asked for written by the eager
    // step), then capture one step.
    step(&eager);
    step(&graphed);
    cuda::synchronize(0).unwrap();
    let mut graph = CUDAGraph::new();
    {
        let _capture = cuda::graph(&mut graph).unwrap();
        step(&graphed);
    }
    assert!(graph.is_captured());
    assert_eq!(graph.kept_casts(), sizes.len(), "every parameter's cast is kept");
    for k in 0..3 {
        step(&eager);
        graph.replay().unwrap();
        same(&format!("after replay {k}"));
    }
    // A write outside the graph: the next replay casts the new values first.
    {
        let _ng = ember_core::no_grad();
        eager.p[0].mul_scalar_(0.5).unwrap();
        graphed.p[0].mul_scalar_(0.5).unwrap();
    }
    step(&eager);
    graph.replay().unwrap();
    same("after a write outside the graph");
    // Another graph writing a parameter, replayed in between (replays count no versions).
    let mut other = CUDAGraph::new();
    {
        let _capture = cuda::graph(&mut other).unwrap();
        let _ng = ember_core::no_grad();
        graphed.p[1].add_scalar_(1.0).unwrap();
    }
    other.replay().unwrap();
    {
        let _ng = ember_core::no_grad();
        eager.p[1].add_scalar_(1.0).unwrap();
    }
    step(&eager);
    graph.replay().unwrap();
    same("after another graph wrote a parameter");
    // A capture whose step writes the parameters before casting them keeps nothing: the
    // eager step's twins are no longer their casts by then.
    step(&graphed);
    let mut late = CUDAGraph::new();
    {
        let _capture = cuda::graph(&mut late).unwrap();
        adam_scaled_(
            &graphed.p,
            &graphed.g,
            &graphed.m,
            &graphed.v,
            None,
            AdamSteps::Device(&graphed.steps),
            &adam,
            GradScaling::default(),
            Some(&graphed.lr),
        )
        .unwrap();
        step(&graphed);
    }
    assert_eq!(late.kept_casts(), 0, "written before the cast: nothing kept");
}

/// A copy from one GPU to another enqueues and returns without waiting, and the data arrives.
#[test]
#[ignore = "needs two CUDA devices"]
fn peer_copies_between_two_gpus_do_not_wait() {
    let (d0, d1) = common::two_gpus();
    let host = iota(300, 200, Device::Cpu);
    let a = host.to(d0).unwrap().mul_scalar(2.0).unwrap();
    cuda::synchronize(0).unwrap();
    let (b, n) = waits(|| a.to(d1).unwrap().add_scalar(1.0).unwrap());
    assert_eq!(n, 0, "the peer copy waited for a device");
    let want: Vec<f32> = host
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| 2.0 * x + 1.0)
        .collect();
    assert_eq!(b.to_vec::<f32>().unwrap(), want);
    // From a side stream of the source to the target's default stream.
    let s = Stream::new_on(0).unwrap();
    let c = {
        let _g = cuda::stream(&s);
        let big = a.mul_scalar(3.0).unwrap();
        big.to(d1).unwrap()
    };
    let want: Vec<f32> = host.to_vec::<f32>().unwrap().iter().map(|x| 6.0 * x).collect();
    assert_eq!(c.to_vec::<f32>().unwrap(), want);
}
