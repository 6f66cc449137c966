//! `backends::cudnn` switches and `ops::conv::convolution` through cuDNN: availability as the
//! loader sees it, the composite fallback where cuDNN does not run, and on a GPU forward and all
//! gradients against a direct f64 convolution on the host, for stride, padding, dilation and
//! groups, every float dtype, with benchmark and deterministic on and off; and `ops::pool::pool2d`
//! (cuDNN max and average pooling), forward and input gradient against direct pooling on the
//! host. The checks take the device, so `conv.rs` runs the same ones on the CPU backend.

use crate::common::{self, assert_close_slice, values};
use ember_core::backends::cudnn;
use ember_core::ops::conv::convolution;
use ember_core::ops::pool::{pool2d, PoolMode};
use ember_core::{DType, Device, Error, Tensor};
use std::sync::Mutex;

/// The switches are process-wide: tests that set them run one at a time and restore them.
static SWITCHES: Mutex<()> = Mutex::new(());

#[test]
fn switches_get_and_set() {
    let _guard = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    // PyTorch's defaults.
    assert!(cudnn::enabled());
    assert!(!cudnn::benchmark());
    assert!(!cudnn::deterministic());
    assert!(cudnn::allow_tf32());
    cudnn::set_enabled(false);
    cudnn::set_benchmark(true);
    cudnn::set_deterministic(true);
    cudnn::set_allow_tf32(false);
    assert!(!cudnn::enabled() && cudnn::benchmark() && cudnn::deterministic() && !cudnn::allow_tf32());
    cudnn::set_enabled(true);
    cudnn::set_benchmark(false);
    cudnn::set_deterministic(false);
    cudnn::set_allow_tf32(true);
    assert!(cudnn::enabled() && !cudnn::benchmark() && !cudnn::deterministic() && cudnn::allow_tf32());
}

#[test]
fn availability_matches_the_loader() {
    // `library_report` opens libcudnn.so.9 / libcudnn.so with the dynamic loader itself.
    let report = ember_core::cuda::library_report();
    let loads = report
        .iter()
        .find(|l| l.name == "cudnn")
        .expect("cudnn in the library report")
        .found
        .is_some();
    assert_eq!(cudnn::is_available(), loads);
    assert_eq!(cudnn::version().is_some(), loads);
    if let Some(v) = cudnn::version() {
        assert!(v >= 8000, "cudnnGetVersion gave {v}");
    }
}

#[test]
fn bad_arguments_are_errors() {
    let x = Tensor::from_slice(&values(2 * 3 * 5 * 5, 1), [2, 3, 5, 5], Device::Cpu).unwrap();
    let w = Tensor::from_slice(&values(4 * 3 * 3 * 3, 2), [4, 3, 3, 3], Device::Cpu).unwrap();
    // groups that do not divide the channels, geometry of the wrong length, a wrong bias, a
    // weight of another rank, another dtype.
    assert!(convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 1], 2).is_err());
    assert!(convolution(&x, &w, None, &[1], &[0, 0], &[1, 1], 1).is_err());
    let b = Tensor::zeros([3], DType::F64, Device::Cpu).unwrap();
    assert!(convolution(&x, &w, Some(&b), &[1, 1], &[0, 0], &[1, 1], 1).is_err());
    let w3 = w.reshape(&[4, 3, 9]).unwrap();
    assert!(convolution(&x, &w3, None, &[1, 1], &[0, 0], &[1, 1], 1).is_err());
    let w32 = w.to_dtype(DType::F32).unwrap();
    assert!(convolution(&x, &w32, None, &[1, 1], &[0, 0], &[1, 1], 1).is_err());
}

// ---------------------------------------------------------------------------------------------
// GPU: against a direct convolution on the host.

/// One problem in 2-d form (1-d ones have `h == 1`, `kh == 1`).
#[derive(Debug, Clone, Copy)]
struct Case {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    one_d: bool,
}

impl Case {
    fn out(&self) -> [usize; 2] {
        let k = [self.kh, self.kw];
        let hw = [self.h, self.w];
        [0, 1].map(|d| (hw[d] + 2 * self.padding[d] - self.dilation[d] * (k[d] - 1) - 1) / self.stride[d] + 1)
    }

    /// `(y, dx, dw, db)` of `y = conv(x, w) + b` with output gradient `gy`, all in f64.
    #[allow(clippy::type_complexity)]
    fn reference(
        &self,
        x: &[f64],
        w: &[f64],
        b: &[f64],
        gy: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let [oh, ow] = self.out();
        let (cg, og) = (self.c / self.groups, self.o / self.groups);
        let mut y = vec![0.0; self.n * self.o * oh * ow];
        let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; self.o]);
        for n in 0..self.n {
            for o in 0..self.o {
                let g = o / og;
                for i in 0..oh {
                    for j in 0..ow {
                        let yi = ((n * self.o + o) * oh + i) * ow + j;
                        let mut acc = b[o];
                        db[o] += gy[yi];
                        for ci in 0..cg {
                            let c = g * cg + ci;
                            for a in 0..self.kh {
                                for e in 0..self.kw {
                                    let r = (i * self.stride[0] + a * self.dilation[0]) as i64
                                        - self.padding[0] as i64;
                                    let s = (j * self.stride[1] + e * self.dilation[1]) as i64
                                        - self.padding[1] as i64;
                                    if r < 0 || s < 0 || r >= self.h as i64 || s >= self.w as i64 {
                                        continue;
                                    }
                                    let xi = ((n * self.c + c) * self.h + r as usize) * self.w + s as usize;
                                    let wi = ((o * cg + ci) * self.kh + a) * self.kw + e;
                                    acc += x[xi] * w[wi];
                                    dx[xi] += gy[yi] * w[wi];
                                    dw[wi] += gy[yi] * x[xi];
                                }
                            }
                        }
                        y[yi] = acc;
                    }
                }
            }
        }
        (y, dx, dw, db)
    }

    fn x_dims(&self) -> Vec<usize> {
        if self.one_d {
            vec![self.n, self.c, self.w]
        } else {
            vec![self.n, self.c, self.h, self.w]
        }
    }

    fn w_dims(&self) -> Vec<usize> {
        if self.one_d {
            vec![self.o, self.c / self.groups, self.kw]
        } else {
            vec![self.o, self.c / self.groups, self.kh, self.kw]
        }
    }

    fn y_dims(&self) -> Vec<usize> {
        let [oh, ow] = self.out();
        if self.one_d {
            vec![self.n, self.o, ow]
        } else {
            vec![self.n, self.o, oh, ow]
        }
    }

    fn geometry(&self) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
        let d = usize::from(self.one_d);
        (
            self.stride[d..].to_vec(),
            self.padding[d..].to_vec(),
            self.dilation[d..].to_vec(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
fn case(
    n: usize,
    c: usize,
    hw: [usize; 2],
    o: usize,
    k: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Case {
    Case {
        n,
        c,
        h: hw[0],
        w: hw[1],
        o,
        kh: k[0],
        kw: k[1],
        stride,
        padding,
        dilation,
        groups,
        one_d: false,
    }
}

fn cases() -> Vec<Case> {
    let mut one_d = case(2, 3, [1, 12], 5, [1, 3], [1, 2], [0, 1], [1, 2], 1);
    one_d.one_d = true;
    let mut one_d_grouped = case(3, 4, [1, 9], 6, [1, 2], [1, 1], [0, 2], [1, 1], 2);
    one_d_grouped.one_d = true;
    vec![
        case(2, 3, [8, 8], 4, [3, 3], [1, 1], [0, 0], [1, 1], 1),
        case(2, 3, [8, 7], 4, [3, 3], [2, 2], [1, 1], [1, 1], 1),
        case(2, 4, [9, 7], 6, [3, 2], [2, 1], [1, 0], [1, 2], 2),
        case(1, 6, [5, 5], 6, [3, 3], [1, 1], [1, 1], [1, 1], 6),
        case(3, 2, [10, 10], 4, [1, 1], [3, 3], [0, 0], [1, 1], 1),
        case(2, 4, [7, 6], 4, [2, 3], [2, 2], [2, 2], [2, 2], 2),
        one_d,
        one_d_grouped,
    ]
}

/// Values rounded to `dtype` (what the GPU computes from), back as f64.
fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
    let t = Tensor::from_slice(v, [v.len()], Device::Cpu).unwrap();
    t.to_dtype(dtype).unwrap().to_vec_f64().unwrap()
}

/// `(rtol, atol)` for a sum of about 100 products of values in [-1, 1).
pub(crate) fn tolerance(dtype: DType, tf32: bool) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-10, 1e-10),
        DType::F32 if tf32 => (5e-3, 5e-3),
        DType::F32 => (1e-4, 1e-4),
        DType::F16 => (1e-2, 3e-2),
        _ => (3e-2, 1.5e-1),
    }
}

/// Runs every case in `dtype` on the GPU and checks output and gradients; returns the
/// gradients of the last case (to compare runs bitwise).
fn check_all(dtype: DType, tf32: bool) -> Vec<Vec<f64>> {
    check_conv(common::gpu(), dtype, tolerance(dtype, tf32))
}

/// Runs every case in `dtype` on `dev` and checks output and gradients within `(rtol, atol)`;
/// returns the gradients of the last case.
pub(crate) fn check_conv(dev: Device, dtype: DType, (rtol, atol): (f64, f64)) -> Vec<Vec<f64>> {
    let mut last = vec![];
    for (k, cs) in cases().into_iter().enumerate() {
        let seed = 10 * k as u64;
        let x0 = rounded(&values(cs.n * cs.c * cs.h * cs.w, seed), dtype);
        let w0 = rounded(&values(cs.o * cs.c / cs.groups * cs.kh * cs.kw, seed + 1), dtype);
        let b0 = rounded(&values(cs.o, seed + 2), dtype);
        let [oh, ow] = cs.out();
        let gy0 = rounded(&values(cs.n * cs.o * oh * ow, seed + 3), dtype);
        let (ry, rdx, rdw, rdb) = cs.reference(&x0, &w0, &b0, &gy0);
        let on_gpu = |v: &[f64], dims: &[usize]| {
            Tensor::from_slice(v, dims, Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to(dev)
                .unwrap()
                .requires_grad_(true)
                .unwrap()
        };
        let (x, w, b) = (
            on_gpu(&x0, &cs.x_dims()),
            on_gpu(&w0, &cs.w_dims()),
            on_gpu(&b0, &[cs.o]),
        );
        let (stride, padding, dilation) = cs.geometry();
        let y = convolution(&x, &w, Some(&b), &stride, &padding, &dilation, cs.groups).unwrap();
        assert_eq!(y.dims(), cs.y_dims().as_slice(), "{cs:?}");
        assert_eq!(y.dtype(), dtype);
        let what = format!("{dtype} {cs:?}");
        eprintln!("checking {what}");
        assert_close_slice(&y.to_vec_f64().unwrap(), &ry, rtol, atol);
        let gy = Tensor::from_slice(&gy0, cs.y_dims(), Device::Cpu)
            .unwrap()
            .to(dev)
            .unwrap();
        y.to_dtype(DType::F64)
            .unwrap()
            .mul(&gy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads: Vec<Vec<f64>> = [&x, &w, &b]
            .iter()
            .map(|t| t.grad().unwrap().to_vec_f64().unwrap())
            .collect();
        assert_close_slice(&grads[0], &rdx, rtol, atol);
        assert_close_slice(&grads[1], &rdw, rtol, atol);
        assert_close_slice(&grads[2], &rdb, rtol, atol);
        last = grads;
    }
    last
}

/// Runs `f` with the switches set, restoring the defaults afterwards.
fn with_switches<T>(benchmark: bool, deterministic: bool, tf32: bool, f: impl FnOnce() -> T) -> T {
    let _guard = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    cudnn::set_benchmark(benchmark);
    cudnn::set_deterministic(deterministic);
    cudnn::set_allow_tf32(tf32);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    cudnn::set_benchmark(false);
    cudnn::set_deterministic(false);
    cudnn::set_allow_tf32(true);
    out.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn gpu_with_cudnn() {
    common::gpu();
    assert!(
        cudnn::is_available(),
        "this test needs cuDNN (libcudnn.so.9) on the GPU machine"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_conv_matches_direct_convolution_all_dtypes() {
    gpu_with_cudnn();
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        with_switches(false, false, true, || check_all(dtype, true));
    }
    with_switches(false, false, false, || check_all(DType::F32, false));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_conv_benchmark_mode() {
    gpu_with_cudnn();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Twice: the first finds and caches the algorithms, the second reuses them.
        with_switches(true, false, true, || check_all(dtype, true));
        with_switches(true, false, true, || check_all(dtype, true));
    }
    with_switches(true, false, false, || check_all(DType::F32, false));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_conv_deterministic_mode_repeats_bitwise() {
    gpu_with_cudnn();
    for benchmark in [false, true] {
        for dtype in [DType::F32, DType::F16] {
            let a = with_switches(benchmark, true, true, || check_all(dtype, true));
            let b = with_switches(benchmark, true, true, || check_all(dtype, true));
            assert_eq!(
                a, b,
                "deterministic gradients differ between runs ({dtype}, benchmark {benchmark})"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_disabled_or_unsupported_falls_back() {
    gpu_with_cudnn();
    let dev = common::gpu();
    let x = Tensor::from_slice(&values(2 * 3 * 5 * 5, 1), [2, 3, 5, 5], dev).unwrap();
    let w = Tensor::from_slice(&values(4 * 3 * 3 * 3, 2), [4, 3, 3, 3], dev).unwrap();
    let on = convolution(&x, &w, None, &[1, 1], &[1, 1], &[1, 1], 1).unwrap();
    let off = {
        let _guard = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
        cudnn::set_enabled(false);
        let off = convolution(&x, &w, None, &[1, 1], &[1, 1], &[1, 1], 1);
        cudnn::set_enabled(true);
        off.unwrap()
    };
    // Disabled cuDNN takes the composite path, with the same result.
    assert_close_slice(
        &off.to_vec_f64().unwrap(),
        &on.to_vec_f64().unwrap(),
        1e-12,
        1e-12,
    );
    // Integer convolution is refused on every device, as PyTorch refuses it.
    let xi = x.mul_scalar(4.0).unwrap().to_dtype(DType::I64).unwrap();
    let wi = w.mul_scalar(4.0).unwrap().to_dtype(DType::I64).unwrap();
    let cpu = |t: &Tensor| t.to(Device::Cpu).unwrap();
    for (x, w) in [(xi.clone(), wi.clone()), (cpu(&xi), cpu(&wi))] {
        let e = convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 1], 1).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    }
    // A kernel larger than the padded input is an error on every device.
    let small = Tensor::from_slice(&values(2 * 3 * 2 * 2, 3), [2, 3, 2, 2], dev).unwrap();
    assert!(convolution(&small, &w, None, &[1, 1], &[0, 0], &[1, 1], 1).is_err());
    // A non-contiguous input (a transposed view) gives the same result as its copy.
    let xt = x.transpose(2, 3).unwrap();
    let a = convolution(&xt, &w, None, &[1, 1], &[1, 1], &[1, 1], 1).unwrap();
    let b = convolution(&xt.contiguous().unwrap(), &w, None, &[1, 1], &[1, 1], &[1, 1], 1).unwrap();
    assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Pooling (`ops::pool::pool2d`): against direct pooling on the host.

/// One pooling problem: input `[n, c, h, w]`, kernel, stride, padding.
#[derive(Debug, Clone, Copy)]
struct PoolCase {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
}

fn pool_case(n: usize, c: usize, hw: [usize; 2], k: [usize; 2], s: [usize; 2], p: [usize; 2]) -> PoolCase {
    PoolCase {
        n,
        c,
        h: hw[0],
        w: hw[1],
        k,
        s,
        p,
    }
}

/// Every plane has at most 256 elements, so that its values (distinct integers / 16, see
/// [`pool_input`]) are exact in bf16 and no window holds a tie.
fn pool_cases() -> Vec<PoolCase> {
    vec![
        pool_case(2, 3, [8, 8], [2, 2], [2, 2], [0, 0]),
        pool_case(2, 2, [9, 7], [3, 3], [2, 2], [1, 1]),
        pool_case(1, 3, [10, 11], [3, 2], [1, 2], [1, 1]),
        pool_case(2, 2, [12, 12], [3, 3], [3, 3], [0, 0]),
        pool_case(1, 2, [7, 9], [5, 3], [2, 1], [2, 1]),
        pool_case(3, 1, [6, 6], [1, 1], [2, 2], [0, 0]),
        pool_case(1, 2, [5, 5], [5, 5], [1, 1], [2, 2]),
        pool_case(2, 1, [16, 16], [4, 2], [3, 2], [2, 1]),
    ]
}

impl PoolCase {
    fn out(&self) -> [usize; 2] {
        let hw = [self.h, self.w];
        [0, 1].map(|d| (hw[d] + 2 * self.p[d] - self.k[d]) / self.s[d] + 1)
    }

    /// `(y, dx)` of max (`max`) or average pooling (padding counted) with output gradient
    /// `gy`, in f64; max pooling's gradient goes to the first maximum of each window.
    fn reference(&self, max: bool, x: &[f64], gy: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let [oh, ow] = self.out();
        let mut y = vec![0.0; self.n * self.c * oh * ow];
        let mut dx = vec![0.0; x.len()];
        let area = (self.k[0] * self.k[1]) as f64;
        for plane in 0..self.n * self.c {
            for i in 0..oh {
                for j in 0..ow {
                    let yi = (plane * oh + i) * ow + j;
                    let mut inside = vec![];
                    for a in 0..self.k[0] {
                        for e in 0..self.k[1] {
                            let r = (i * self.s[0] + a) as i64 - self.p[0] as i64;
                            let q = (j * self.s[1] + e) as i64 - self.p[1] as i64;
                            if r >= 0 && q >= 0 && r < self.h as i64 && q < self.w as i64 {
                                inside.push((plane * self.h + r as usize) * self.w + q as usize);
                            }
                        }
                    }
                    assert!(
                        !inside.is_empty(),
                        "padding <= kernel / 2 keeps windows non-empty"
                    );
                    if max {
                        let mut best = inside[0];
                        for &xi in &inside[1..] {
                            if x[xi] > x[best] {
                                best = xi;
                            }
                        }
                        y[yi] = x[best];
                        dx[best] += gy[yi];
                    } else {
                        y[yi] = inside.iter().map(|&xi| x[xi]).sum::<f64>() / area;
                        for &xi in &inside {
                            dx[xi] += gy[yi] / area;
                        }
                    }
                }
            }
        }
        (y, dx)
    }
}

/// Per plane a random permutation of `0..h·w`, centred and divided by 16: distinct values,
/// exact in every float dtype for planes of at most 256 elements.
fn pool_input(cs: &PoolCase, seed: u64) -> Vec<f64> {
    let hw = cs.h * cs.w;
    assert!(hw <= 256, "bf16 holds the integers up to 256 exactly");
    let mut x = Vec::with_capacity(cs.n * cs.c * hw);
    for plane in 0..cs.n * cs.c {
        let keys = values(hw, seed + plane as u64);
        let mut order: Vec<usize> = (0..hw).collect();
        order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
        let mut rank = vec![0usize; hw];
        for (r, &i) in order.iter().enumerate() {
            rank[i] = r;
        }
        x.extend(rank.iter().map(|&r| (r as f64 - (hw / 2) as f64) / 16.0));
    }
    x
}

/// `(rtol, atol)` for pooling: max pooling is exact; averages and gradient sums round once
/// per addition in the dtype at worst.
fn pool_tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (5e-3, 1e-2),
        _ => (2e-2, 5e-2),
    }
}

/// Runs every pooling case in `dtype` on the GPU, forward and input gradient.
fn check_pooling(dtype: DType, mode: PoolMode) {
    check_pool(common::gpu(), dtype, mode)
}

/// Runs every pooling case in `dtype` on `dev`, forward and input gradient.
pub(crate) fn check_pool(dev: Device, dtype: DType, mode: PoolMode) {
    let (rtol, atol) = pool_tolerance(dtype);
    for (k, cs) in pool_cases().into_iter().enumerate() {
        let seed = 100 * k as u64;
        let x0 = pool_input(&cs, seed);
        let [oh, ow] = cs.out();
        let y_dims = [cs.n, cs.c, oh, ow];
        let gy0 = rounded(&values(cs.n * cs.c * oh * ow, seed + 99), dtype);
        let (ry, rdx) = cs.reference(mode == PoolMode::Max, &x0, &gy0);
        let x = Tensor::from_slice(&x0, [cs.n, cs.c, cs.h, cs.w], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to(dev)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let what = format!("{mode:?} {dtype} {cs:?}");
        eprintln!("checking {what}");
        let y = pool2d(&x, mode, cs.k, cs.s, cs.p).unwrap();
        assert_eq!(y.dims(), y_dims.as_slice(), "{what}");
        assert_eq!(y.dtype(), dtype, "{what}");
        assert_close_slice(&y.to_vec_f64().unwrap(), &ry, rtol, atol);
        let gy = Tensor::from_slice(&gy0, y_dims, Device::Cpu)
            .unwrap()
            .to(dev)
            .unwrap();
        y.to_dtype(DType::F64)
            .unwrap()
            .mul(&gy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dx = x.grad().unwrap();
        assert_eq!(dx.dtype(), dtype, "{what}");
        assert_close_slice(&dx.to_vec_f64().unwrap(), &rdx, rtol, atol);
    }
}

#[test]
fn pooling_reference_is_right() {
    // The host reference itself, on a hand-computed 1x1x3x3 case: kernel 2, stride 1, pad 0.
    let cs = pool_case(1, 1, [3, 3], [2, 2], [1, 1], [0, 0]);
    let x = [1.0, 5.0, 2.0, 4.0, 3.0, 9.0, 0.0, 8.0, 7.0];
    let gy = [1.0, 2.0, 3.0, 4.0];
    let (y, dx) = cs.reference(true, &x, &gy);
    assert_eq!(y, [5.0, 9.0, 8.0, 9.0]);
    assert_eq!(dx, [0.0, 1.0, 0.0, 0.0, 0.0, 6.0, 0.0, 3.0, 0.0]);
    let (y, dx) = cs.reference(false, &x, &gy);
    assert_eq!(y, [13.0 / 4.0, 19.0 / 4.0, 15.0 / 4.0, 27.0 / 4.0]);
    assert_eq!(dx, [0.25, 0.75, 0.5, 1.0, 2.5, 1.5, 0.75, 1.75, 1.0]);
    // Padding counts in the average's divisor: kernel 3, pad 1 on a 1x1 input.
    let one = pool_case(1, 1, [1, 1], [3, 3], [1, 1], [1, 1]);
    assert_eq!(one.reference(false, &[9.0], &[1.0]).0, [1.0]);
    assert_eq!(one.reference(true, &[-9.0], &[1.0]).0, [-9.0]);
}

#[test]
fn pooling_bad_arguments_are_errors() {
    let x = Tensor::from_slice(&values(2 * 3 * 6 * 6, 1), [2, 3, 6, 6], Device::Cpu).unwrap();
    for mode in [PoolMode::Max, PoolMode::Avg] {
        // A 3-D input, a zero kernel or stride, padding over half the kernel.
        let x3 = x.reshape(&[6, 6, 6]).unwrap();
        assert!(pool2d(&x3, mode, [2, 2], [2, 2], [0, 0]).is_err());
        assert!(pool2d(&x, mode, [0, 2], [2, 2], [0, 0]).is_err());
        assert!(pool2d(&x, mode, [2, 2], [2, 0], [0, 0]).is_err());
        assert!(pool2d(&x, mode, [3, 3], [1, 1], [2, 1]).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_max_pool2d_matches_direct_pooling_all_dtypes() {
    gpu_with_cudnn();
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        check_pooling(dtype, PoolMode::Max);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_avg_pool2d_matches_direct_pooling_all_dtypes() {
    gpu_with_cudnn();
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        check_pooling(dtype, PoolMode::Avg);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_pooling_disabled_or_unsupported_falls_back() {
    gpu_with_cudnn();
    let dev = common::gpu();
    let x = Tensor::from_slice(&values(2 * 3 * 6 * 6, 1), [2, 3, 6, 6], dev).unwrap();
    for mode in [PoolMode::Max, PoolMode::Avg] {
        let on = pool2d(&x, mode, [3, 3], [2, 2], [1, 1]).unwrap();
        let off = {
            let _guard = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
            cudnn::set_enabled(false);
            let off = pool2d(&x, mode, [3, 3], [2, 2], [1, 1]);
            cudnn::set_enabled(true);
            off.unwrap()
        };
        // Disabled cuDNN takes the composite path, with the same result.
        assert_close_slice(
            &off.to_vec_f64().unwrap(),
            &on.to_vec_f64().unwrap(),
            1e-12,
            1e-12,
        );
    }
    // Integer tensors and a window larger than the padded input are errors; an empty batch
    // (not cuDNN's) runs the composite path.
    let xi = x.to_dtype(DType::I64).unwrap();
    assert!(pool2d(&xi, PoolMode::Max, [2, 2], [2, 2], [0, 0]).is_err());
    assert!(pool2d(&x, PoolMode::Avg, [9, 9], [1, 1], [1, 1]).is_err());
    let empty = Tensor::zeros([0, 3, 6, 6], DType::F32, dev).unwrap();
    let y = pool2d(&empty, PoolMode::Max, [2, 2], [2, 2], [0, 0]).unwrap();
    assert_eq!(y.dims(), [0, 3, 3, 3]);
    // A non-contiguous input (a transposed view) gives the same result as its copy.
    let xt = x.transpose(2, 3).unwrap();
    for mode in [PoolMode::Max, PoolMode::Avg] {
        let a = pool2d(&xt, mode, [3, 3], [2, 2], [1, 1]).unwrap();
        let b = pool2d(&xt.contiguous().unwrap(), mode, [3, 3], [2, 2], [1, 1]).unwrap();
        assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap(), "{mode:?}");
    }
    check_nan_and_padding(dev);
}

/// Max pooling propagates NaN (as PyTorch) and treats padding as -inf (all-negative input).
pub(crate) fn check_nan_and_padding(dev: Device) {
    let mut v = vec![-1.0f32; 16];
    v[5] = f32::NAN;
    let xn = Tensor::from_slice(&v, [1, 1, 4, 4], dev).unwrap();
    let y = pool2d(&xn, PoolMode::Max, [2, 2], [2, 2], [0, 0])
        .unwrap()
        .to_vec_f64()
        .unwrap();
    assert!(y[0].is_nan(), "NaN in the first window: {y:?}");
    assert_eq!(&y[1..], &[-1.0, -1.0, -1.0]);
    let neg = Tensor::from_slice(&[-3.0f32; 4], [1, 1, 2, 2], dev).unwrap();
    let y = pool2d(&neg, PoolMode::Max, [3, 3], [1, 1], [1, 1])
        .unwrap()
        .to_vec_f64()
        .unwrap();
    assert_eq!(y, [-3.0; 4], "padding must not win over negative values");
}
