//! Tests of random generation: the Philox known-answer vector, the documented (seed, offset,
//! index) mapping, determinism per seed and per thread count, statistics of each distribution,
//! generator state, in-place fills on views, and errors.
//!
//! Tests that seed and read the process-wide default generators run in a process of their own
//! (other modules' tests draw from them concurrently); tests here that only draw from them hold
//! `DEFAULT_GEN_LOCK`; the others use their own `Generator`, so they can run in parallel.

use crate::common::{self, ReadBack};
use ember_core::random::philox::{block, philox4x32_10};
use ember_core::{autograd, DType, Device, Error, Generator, RngState, Tensor};
use std::sync::Mutex;

static DEFAULT_GEN_LOCK: Mutex<()> = Mutex::new(());

fn lock_defaults() -> std::sync::MutexGuard<'static, ()> {
    DEFAULT_GEN_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

fn mean_var(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    (
        mean,
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0),
    )
}

#[test]
fn philox_matches_random123_known_answer() {
    assert_eq!(
        philox4x32_10([0; 4], [0; 2]),
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    );
    assert_eq!(
        philox4x32_10(
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0]
        ),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
    // Seed 0, block 0 is the all-zero counter and key.
    assert_eq!(block(0, 0), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
}

#[test]
fn values_follow_the_documented_mapping() {
    for device in common::devices() {
        let seed = 0xdead_beef_0123_4567u64;
        let g = Generator::new(seed);
        g.set_state(RngState { seed, offset: 10 });
        let x = Tensor::rand_with([6], DType::F32, device, &g)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (i, &v) in x.iter().enumerate() {
            let w = block(seed, 10 + i as u64 / 4);
            assert_eq!(v, (w[i % 4] >> 8) as f32 * 2f32.powi(-24), "rand f32 element {i}");
        }
        assert_eq!(g.get_state().offset, 12, "6 f32 uniforms use 2 blocks");

        let x = Tensor::rand_with([3], DType::F64, device, &g)
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        for (i, &v) in x.iter().enumerate() {
            let w = block(seed, 12 + i as u64 / 2);
            let bits = ((w[2 * (i % 2) + 1] as u64) << 32 | w[2 * (i % 2)] as u64) >> 11;
            assert_eq!(v, bits as f64 * 2f64.powi(-53), "rand f64 element {i}");
        }
        assert_eq!(g.get_state().offset, 14);

        let z = Tensor::randn_with([2], DType::F32, device, &g)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let w = block(seed, 14);
        let u1 = ((w[0] >> 8) + 1) as f64 * 2f64.powi(-24);
        let u2 = (w[1] >> 8) as f64 * 2f64.powi(-24);
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        assert_eq!(z, vec![(r * theta.cos()) as f32, (r * theta.sin()) as f32]);
        assert_eq!(g.get_state().offset, 15);

        let k = Tensor::randint_with(-3, 7, [5], device, &g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        for (i, &v) in k.iter().enumerate() {
            assert_eq!(v, -3 + (block(seed, 15 + i as u64 / 4)[i % 4] % 10) as i64);
        }
        assert_eq!(g.get_state().offset, 17);
        let _ = Tensor::randperm_with(5, device, &g).unwrap();
        assert_eq!(g.get_state().offset, 20, "randperm uses 2 keys per block");
        let _ = Tensor::rand_with([0], DType::F32, device, &g).unwrap();
        assert_eq!(g.get_state().offset, 20, "an empty draw consumes nothing");
    }
}

#[test]
fn draws_split_at_block_boundaries_equal_one_draw() {
    for device in common::devices() {
        let (a, b) = (Generator::new(11), Generator::new(11));
        let whole = Tensor::randn_with([12], DType::F32, device, &a)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let mut parts = Tensor::randn_with([8], DType::F32, device, &b)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        parts.extend(
            Tensor::randn_with([4], DType::F32, device, &b)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
        );
        assert_eq!(whole, parts);
    }
}

#[test]
fn same_seed_same_numbers_different_seed_different_numbers() {
    for device in common::devices() {
        let draw = |seed: u64| -> Vec<Vec<f64>> {
            let g = Generator::new(seed);
            let mut out: Vec<Vec<f64>> = FLOATS
                .iter()
                .flat_map(|&dt| {
                    [
                        Tensor::rand_with([5, 7], dt, device, &g).unwrap(),
                        Tensor::randn_with([33], dt, device, &g).unwrap(),
                        Tensor::normal_with(2.0, 3.0, [9], dt, device, &g).unwrap(),
                    ]
                })
                .map(|t| t.to_vec_f64().unwrap())
                .collect();
            out.push(
                Tensor::randint_with(0, 1000, [50], device, &g)
                    .unwrap()
                    .to_vec_f64()
                    .unwrap(),
            );
            out.push(
                Tensor::randperm_with(50, device, &g)
                    .unwrap()
                    .to_vec_f64()
                    .unwrap(),
            );
            out
        };
        let (a, b, c) = (draw(1234), draw(1234), draw(1235));
        assert_eq!(a, b);
        for (x, y) in a.iter().zip(&c) {
            assert_ne!(x, y);
        }
        // Consecutive draws from one generator differ.
        let g = Generator::new(5);
        let x = Tensor::rand_with([8], DType::F32, device, &g)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let y = Tensor::rand_with([8], DType::F32, device, &g)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_ne!(x, y);
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let n = 200_003; // above the parallel threshold, not a multiple of 4
    let draw = || -> Vec<Vec<f64>> {
        let g = Generator::new(77);
        let mut out: Vec<Vec<f64>> = FLOATS
            .iter()
            .flat_map(|&dt| {
                [
                    Tensor::rand_with([n], dt, Device::Cpu, &g).unwrap(),
                    Tensor::randn_with([n], dt, Device::Cpu, &g).unwrap(),
                ]
            })
            .map(|t| t.to_vec_f64().unwrap())
            .collect();
        out.push(
            Tensor::randint_with(-5, 1 << 40, [n], Device::Cpu, &g)
                .unwrap()
                .to_vec_f64()
                .unwrap(),
        );
        out.push(
            Tensor::randperm_with(n, Device::Cpu, &g)
                .unwrap()
                .to_vec_f64()
                .unwrap(),
        );
        let p = Tensor::full([n], 0.5, DType::F32, Device::Cpu).unwrap();
        out.push(p.bernoulli_with(&g).unwrap().to_vec_f64().unwrap());
        let x = Tensor::zeros([n / 3, 3], DType::F32, Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        x.normal_with_(1.0, 2.0, &g).unwrap();
        out.push(x.to_vec_f64().unwrap());
        out
    };
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let four = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let serial = one.install(draw);
    assert_eq!(serial, four.install(draw));
    assert_eq!(serial, draw());
}

#[test]
fn uniform_statistics() {
    for device in common::devices() {
        let g = Generator::new(2024);
        for dt in FLOATS {
            let v = Tensor::rand_with([100_000], dt, device, &g)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            assert!(
                v.iter().all(|&x| (0.0..1.0).contains(&x)),
                "{dt}: a value outside [0, 1)"
            );
            let (m, var) = mean_var(&v);
            // 5 standard errors: sd(mean) = 0.0009, sd(var) = 0.0003.
            assert!((m - 0.5).abs() < 0.005, "{dt}: mean {m}");
            assert!((var - 1.0 / 12.0).abs() < 0.002, "{dt}: variance {var}");
        }
        let x = Tensor::zeros([100_000], DType::F64, device).unwrap();
        x.uniform_with_(-2.0, 6.0, &g).unwrap();
        let v = x.to_vec_f64().unwrap();
        assert!(v.iter().all(|&x| (-2.0..6.0).contains(&x)));
        let (m, var) = mean_var(&v);
        assert!((m - 2.0).abs() < 0.04, "mean {m}");
        assert!((var - 64.0 / 12.0).abs() < 0.12, "variance {var}");
    }
}

#[test]
fn normal_statistics() {
    for device in common::devices() {
        let g = Generator::new(99);
        for dt in FLOATS {
            let v = Tensor::randn_with([100_000], dt, device, &g)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            let (m, var) = mean_var(&v);
            // sd(mean) = 0.0032, sd(var) = 0.0045; bf16 rounding adds ~1e-5 variance.
            assert!(m.abs() < 0.016, "{dt}: mean {m}");
            assert!((var - 1.0).abs() < 0.025, "{dt}: variance {var}");
            let inside = v.iter().filter(|x| x.abs() < 1.0).count() as f64 / 1e5;
            assert!((inside - 0.6827).abs() < 0.008, "{dt}: P(|z| < 1) = {inside}");
        }
        let v = Tensor::normal_with(3.0, 2.0, [100_000], DType::F32, device, &g)
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let (m, var) = mean_var(&v);
        assert!(
            (m - 3.0).abs() < 0.032 && (var - 4.0).abs() < 0.1,
            "mean {m}, variance {var}"
        );
        let x = Tensor::zeros([100_000], DType::F64, device).unwrap();
        x.normal_with_(-1.0, 0.5, &g).unwrap();
        let (m, var) = mean_var(&x.to_vec_f64().unwrap());
        assert!(
            (m + 1.0).abs() < 0.008 && (var - 0.25).abs() < 0.007,
            "mean {m}, variance {var}"
        );
    }
}

#[test]
fn bernoulli_statistics_and_dtypes() {
    for device in common::devices() {
        let g = Generator::new(3);
        for dt in [DType::F32, DType::F64, DType::I64, DType::Bool, DType::U8] {
            let x = Tensor::zeros([100_000], dt, device).unwrap();
            x.bernoulli_with_(0.3, &g).unwrap();
            assert_eq!(x.dtype(), dt);
            let v = x.to_vec_f64().unwrap();
            assert!(v.iter().all(|&b| b == 0.0 || b == 1.0));
            let m = v.iter().sum::<f64>() / 1e5;
            assert!((m - 0.3).abs() < 0.0075, "{dt}: mean {m}"); // sd 0.00145
        }
        // Probabilities 0 and 1 are exact; the output keeps the input's dtype.
        let p = common::t64(&[0.0, 1.0, 1.0, 0.0, 1.0], &[5], device);
        let b = p.bernoulli_with(&g).unwrap();
        assert_eq!(b.dtype(), DType::F64);
        assert_eq!(b.to_vec::<f64>().unwrap(), vec![0.0, 1.0, 1.0, 0.0, 1.0]);
        let p = Tensor::full([100_000], 0.75, DType::F32, device).unwrap();
        let m = p
            .bernoulli_with(&g)
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .sum::<f64>()
            / 1e5;
        assert!((m - 0.75).abs() < 0.007, "mean {m}");
        let q = Tensor::zeros([4, 3], DType::F32, device)
            .unwrap()
            .bernoulli_p(1.0)
            .unwrap();
        assert_eq!(q.to_vec::<f32>().unwrap(), vec![1.0; 12]);
        assert_eq!(q.dims(), &[4, 3]);
    }
}

#[test]
fn bernoulli_p_with_draws_what_the_in_place_fill_draws() {
    // Dropout draws its mask with `bernoulli_p_with`: the same values, and the same advance of
    // the generator, as filling an empty tensor with `bernoulli_with_`.
    for device in common::devices() {
        for dtype in [DType::F32, DType::BF16] {
            let (a, b) = (Generator::new(21), Generator::new(21));
            let like = Tensor::zeros([5, 67], dtype, device).unwrap();
            let fresh = like.bernoulli_p_with(0.3, &a).unwrap();
            let filled = Tensor::empty([5, 67], dtype, device).unwrap();
            filled.bernoulli_with_(0.3, &b).unwrap();
            let ones = fresh.to_vec_f64().unwrap().iter().filter(|&&v| v == 1.0).count();
            assert!(
                (60..=140).contains(&ones),
                "{ones} ones of 335 at p = 0.3 on {device:?}"
            );
            assert_eq!(
                fresh.to_vec_f64().unwrap(),
                filled.to_vec_f64().unwrap(),
                "{device:?} {dtype:?}"
            );
            assert_eq!(a.get_state(), b.get_state(), "{device:?} {dtype:?}");
        }
    }
}

#[test]
fn randint_covers_its_range_uniformly() {
    for device in common::devices() {
        let g = Generator::new(8);
        let v = Tensor::randint_with(-3, 7, [100_000], device, &g).unwrap();
        assert_eq!(v.dtype(), DType::I64);
        let mut counts = [0usize; 10];
        for x in v.to_vec::<i64>().unwrap() {
            assert!((-3..7).contains(&x), "{x} outside [-3, 7)");
            counts[(x + 3) as usize] += 1;
        }
        for c in counts {
            assert!((c as f64 / 1e5 - 0.1).abs() < 0.005, "counts {counts:?}");
        }
        // A range wider than 2^32 uses 64-bit draws.
        let big = Tensor::randint_with(i64::MIN, i64::MAX, [1000], device, &g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        assert!(big.iter().any(|&x| x < -(1 << 40)) && big.iter().any(|&x| x > 1 << 40));
        assert!(big.iter().all(|&x| x != i64::MAX));
    }
}

#[test]
fn randperm_is_a_permutation() {
    for device in common::devices() {
        let g = Generator::new(21);
        for n in [0usize, 1, 2, 10, 1000, 100_000] {
            let p = Tensor::randperm_with(n, device, &g).unwrap();
            assert_eq!((p.dtype(), p.dims()), (DType::I64, &[n][..]));
            let v = p.to_vec::<i64>().unwrap();
            let mut sorted = v.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n as i64).collect::<Vec<_>>(), "n = {n}");
            if n >= 10 {
                assert_ne!(v, sorted, "n = {n}: identity permutation");
            }
        }
        // Each position is uniform: element 0 lands everywhere among 4 slots.
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            let v = Tensor::randperm_with(4, device, &g)
                .unwrap()
                .to_vec::<i64>()
                .unwrap();
            seen[v.iter().position(|&x| x == 0).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&c| (60..140).contains(&c)), "{seen:?}");
    }
}

#[test]
fn generator_state_round_trips() {
    for device in common::devices() {
        let g = Generator::new(5);
        let _ = Tensor::rand_with([7], DType::F32, device, &g).unwrap();
        let st = g.get_state();
        assert_eq!(st, RngState { seed: 5, offset: 2 });
        let a = Tensor::randn_with([9], DType::F64, device, &g)
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        g.set_state(st);
        let b = Tensor::randn_with([9], DType::F64, device, &g)
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        assert_eq!(a, b);
        // A clone continues independently from the same state.
        let c = g.clone();
        let x = Tensor::rand_with([3], DType::F32, device, &g)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let y = Tensor::rand_with([3], DType::F32, device, &c)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(x, y);
        assert_eq!(g.initial_seed(), 5);
        g.manual_seed(6);
        assert_eq!(g.get_state(), RngState { seed: 6, offset: 0 });
        let s = g.seed();
        assert_eq!(g.get_state(), RngState { seed: s, offset: 0 });
        assert_eq!(format!("{:?}", Generator::new(3)), "Generator(seed=3, offset=0)");
    }
}

#[test]
fn concurrent_draws_reserve_distinct_blocks() {
    let g = Generator::new(1);
    let parts: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    Tensor::rand_with([100], DType::F32, Device::Cpu, &g)
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(g.get_state().offset, 100);
    let mut all: Vec<u32> = parts.concat().iter().map(|x| x.to_bits()).collect();
    let whole = Tensor::rand_with([400], DType::F32, Device::Cpu, &Generator::new(1)).unwrap();
    let mut expected: Vec<u32> = whole
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    all.sort_unstable();
    expected.sort_unstable();
    assert_eq!(
        all, expected,
        "four draws of 25 blocks each cover blocks 0..100 once"
    );
}

/// It seeds and reads the process-wide default generators, which tests of other modules draw
/// from concurrently, so the body runs in a process of its own.
#[test]
fn default_generators_follow_manual_seed() {
    common::in_own_process(
        "random::default_generators_follow_manual_seed",
        default_generators_follow_manual_seed_body,
    );
}

fn default_generators_follow_manual_seed_body() {
    for device in common::devices() {
        ember_core::manual_seed(42).unwrap();
        assert_eq!(ember_core::initial_seed(), 42);
        assert_eq!(ember_core::get_rng_state(), RngState { seed: 42, offset: 0 });
        let a = Tensor::randn([10], DType::F32, device)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let b = Tensor::randn_with([10], DType::F32, device, &Generator::new(42)).unwrap();
        assert_eq!(a, b.to_vec::<f32>().unwrap());
        ember_core::manual_seed(42).unwrap();
        assert_eq!(
            Tensor::randn([10], DType::F32, device)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            a
        );

        // The state of the device's own default generator (torch.cuda.get_rng_state for GPUs).
        let st = ember_core::default_generator(device).get_state();
        let x = Tensor::rand([6], DType::F32, device)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        ember_core::default_generator(device).set_state(st);
        assert_eq!(
            Tensor::rand([6], DType::F32, device)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            x
        );
    }
    // Every device's default generator, even one first used after seeding, gets the seed.
    ember_core::manual_seed(7).unwrap();
    assert_eq!(ember_core::default_generator(Device::Cuda(3)).initial_seed(), 7);
    let s = ember_core::seed();
    assert_eq!(ember_core::initial_seed(), s);
    assert_eq!(ember_core::default_generator(Device::Cuda(3)).initial_seed(), s);
}

#[test]
fn like_constructors_copy_shape_dtype_device() {
    let _guard = lock_defaults();
    for device in common::devices() {
        let x = Tensor::zeros([2, 3], DType::F64, device).unwrap();
        for y in [x.rand_like().unwrap(), x.randn_like().unwrap()] {
            assert_eq!(
                (y.dims(), y.dtype(), y.device()),
                (&[2, 3][..], DType::F64, device)
            );
            assert!(!y.requires_grad());
        }
        let i = Tensor::zeros([2], DType::I64, device).unwrap();
        assert!(matches!(
            i.rand_like(),
            Err(Error::UnsupportedDType {
                op: "rand",
                dtype: DType::I64,
                ..
            })
        ));
        let r = Tensor::normal(1.0, 0.0, [3], DType::F32, device).unwrap();
        assert_eq!(r.to_vec::<f32>().unwrap(), vec![1.0; 3]);
        assert_eq!(
            Tensor::randint(4, 5, [3], device)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![4; 3]
        );
        assert_eq!(Tensor::randperm(3, device).unwrap().dims(), &[3]);
    }
}

#[test]
fn in_place_fills_write_through_views() {
    for device in common::devices() {
        // A transposed view receives the values a contiguous draw gives, in its own order.
        let base = Tensor::zeros([4, 3], DType::F32, device).unwrap();
        let v = base.t().unwrap();
        let before = base.version();
        let out = v.uniform_with_(0.0, 1.0, &Generator::new(9)).unwrap();
        assert!(out.shares_storage_with(&base));
        assert!(base.version() > before, "in-place fills bump the version counter");
        let expected = Tensor::rand_with([3, 4], DType::F32, device, &Generator::new(9)).unwrap();
        assert_eq!(v.to_vec::<f32>().unwrap(), expected.to_vec::<f32>().unwrap());

        // A narrowed view changes only its own elements.
        let base = Tensor::zeros([4, 5], DType::F64, device).unwrap();
        base.narrow(1, 1, 2)
            .unwrap()
            .normal_with_(10.0, 1.0, &Generator::new(1))
            .unwrap();
        let vals = base.to_vec::<f64>().unwrap();
        for (i, x) in vals.iter().enumerate() {
            if matches!(i % 5, 1 | 2) {
                assert!(*x > 3.0, "element {i} = {x} was not filled");
            } else {
                assert_eq!(*x, 0.0, "element {i} outside the view changed");
            }
        }

        // f16 and bf16 uniforms stay below `high`.
        for dt in [DType::F16, DType::BF16] {
            let x = Tensor::zeros([50_000], dt, device).unwrap();
            x.uniform_(1.0, 2.0).unwrap();
            assert!(
                x.to_vec_f64().unwrap().iter().all(|&v| (1.0..2.0).contains(&v)),
                "{dt}"
            );
        }
    }
}

#[test]
fn in_place_fills_respect_autograd() {
    for device in common::devices() {
        let w = Tensor::zeros([3], DType::F32, device)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        assert!(matches!(w.uniform_(0.0, 1.0), Err(Error::Autograd(_))));
        assert!(matches!(w.normal_(0.0, 1.0), Err(Error::Autograd(_))));
        // Under no_grad (as nn.init) the fill is allowed and the leaf keeps requiring grad.
        {
            let _g = autograd::no_grad();
            w.normal_with_(0.0, 1.0, &Generator::new(2)).unwrap();
        }
        assert!(w.requires_grad() && w.is_leaf());
        assert!(w.to_vec::<f32>().unwrap().iter().any(|&x| x != 0.0));
    }
}

#[test]
fn bad_arguments_are_errors() {
    for device in common::devices() {
        let g = Generator::new(0);
        for dt in [DType::I64, DType::Bool, DType::U8, DType::I32] {
            assert!(matches!(
                Tensor::rand_with([2], dt, device, &g),
                Err(Error::UnsupportedDType { op: "rand", .. })
            ));
            assert!(matches!(
                Tensor::randn_with([2], dt, device, &g),
                Err(Error::UnsupportedDType { op: "randn", .. })
            ));
            let x = Tensor::zeros([2], dt, device).unwrap();
            assert!(matches!(
                x.uniform_(0.0, 1.0),
                Err(Error::UnsupportedDType { op: "uniform_", .. })
            ));
            assert!(matches!(
                x.bernoulli(),
                Err(Error::UnsupportedDType { op: "bernoulli", .. })
            ));
        }
        let err = Tensor::randint_with(3, 3, [2], device, &g).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid argument to randint: expects 'low' to be less than 'high', but got low=3 >= high=3"
        );
        let err = Tensor::normal_with(0.0, -1.0, [2], DType::F32, device, &g).unwrap_err();
        assert!(err.to_string().contains("std >= 0.0"), "{err}");
        let x = Tensor::zeros([2], DType::F32, device).unwrap();
        assert!(matches!(
            x.uniform_(2.0, 1.0),
            Err(Error::InvalidArgument { op: "uniform_", .. })
        ));
        assert!(matches!(
            x.uniform_(0.0, f64::INFINITY),
            Err(Error::InvalidArgument { .. })
        ));
        let err = x.bernoulli_(1.5).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid argument to bernoulli_: expects p to be in [0, 1], but got p=1.5"
        );
        assert!(matches!(x.bernoulli_p(-0.1), Err(Error::InvalidArgument { .. })));
        // (On CUDA a bad probability is reported when the result is read back.)
        let p = common::t64(&[0.5, 1.5], &[2], device);
        let err = p.bernoulli().read_back().unwrap_err();
        assert!(
            err.to_string().contains("probabilities in [0, 1], found 1.5"),
            "{err}"
        );
        let p = common::t64(&[0.5, f64::NAN], &[2], device);
        assert!(matches!(
            p.bernoulli().read_back(),
            Err(Error::InvalidArgument { .. })
        ));
        // An expanded view would write one element several times.
        let e = Tensor::zeros([1, 3], DType::F32, device)
            .unwrap()
            .expand(&[4, 3])
            .unwrap();
        assert!(matches!(
            e.normal_(0.0, 1.0),
            Err(Error::InvalidArgument { op: "normal_", .. })
        ));
    }
    // A GPU that is not there is a typed error, not a panic.
    assert!(matches!(
        Tensor::rand_with([2], DType::F32, Device::Cuda(99), &Generator::new(0)),
        Err(Error::CudaUnavailable { .. } | Error::InvalidArgument { .. })
    ));
}
