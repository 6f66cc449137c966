//! `backends::cudnn` switches and `ops::conv::convolution` (cuDNN): availability as the loader
//! sees it, `Ok(None)` where cuDNN does not run, and on a GPU forward and all gradients against
//! a direct f64 convolution on the host, for stride, padding, dilation and groups, every float
//! dtype, with benchmark and deterministic on and off.

use crate::common::{self, assert_close_slice, values};
use ember_core::backends::cudnn;
use ember_core::ops::conv::convolution;
use ember_core::{DType, Device, Tensor};
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
fn cpu_tensors_are_not_taken() {
    let x = Tensor::from_slice(&values(2 * 3 * 5 * 5, 1), [2, 3, 5, 5], Device::Cpu).unwrap();
    let w = Tensor::from_slice(&values(4 * 3 * 3 * 3, 2), [4, 3, 3, 3], Device::Cpu).unwrap();
    let y = convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 1], 1).unwrap();
    assert!(y.is_none(), "a CPU convolution must fall back");
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
fn tolerance(dtype: DType, tf32: bool) -> (f64, f64) {
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
    let dev = common::gpu();
    let (rtol, atol) = tolerance(dtype, tf32);
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
        let y = convolution(&x, &w, Some(&b), &stride, &padding, &dilation, cs.groups)
            .unwrap()
            .unwrap_or_else(|| panic!("cuDNN did not take {cs:?}"));
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
    let _guard = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    cudnn::set_enabled(false);
    let off = convolution(&x, &w, None, &[1, 1], &[0, 0], &[1, 1], 1);
    cudnn::set_enabled(true);
    assert!(off.unwrap().is_none(), "disabled cuDNN must fall back");
    // Integer tensors and a kernel larger than the padded input are not cuDNN's.
    let xi = x.to_dtype(DType::I64).unwrap();
    let wi = w.to_dtype(DType::I64).unwrap();
    assert!(convolution(&xi, &wi, None, &[1, 1], &[0, 0], &[1, 1], 1)
        .unwrap()
        .is_none());
    let small = Tensor::from_slice(&values(2 * 3 * 2 * 2, 3), [2, 3, 2, 2], dev).unwrap();
    assert!(convolution(&small, &w, None, &[1, 1], &[0, 0], &[1, 1], 1)
        .unwrap()
        .is_none());
    // A non-contiguous input (a transposed view) gives the same result as its copy.
    let xt = x.transpose(2, 3).unwrap();
    let a = convolution(&xt, &w, None, &[1, 1], &[1, 1], &[1, 1], 1)
        .unwrap()
        .unwrap();
    let b = convolution(&xt.contiguous().unwrap(), &w, None, &[1, 1], &[1, 1], &[1, 1], 1)
        .unwrap()
        .unwrap();
    assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
}
