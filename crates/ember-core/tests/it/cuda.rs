//! The CUDA device runtime: discovery and properties. GPU tests are ignored where no GPU is;
//! on a GPU machine they run with `--include-ignored` and `CUDA_TESTS_REQUIRED=1`.

use ember_core::{cuda, DType, Device, Error, Tensor};

/// Fails (instead of passing silently) when a GPU test runs where a GPU is required but absent.
fn require_gpu() {
    if std::env::var_os("CUDA_TESTS_REQUIRED").is_some() || cuda::device_count() > 0 {
        assert!(
            cuda::is_available(),
            "CUDA_TESTS_REQUIRED is set but no CUDA device was found"
        );
    } else {
        panic!("this test needs a CUDA device; run it on a GPU machine with CUDA_TESTS_REQUIRED=1");
    }
}

#[test]
fn without_a_gpu_cuda_is_reported_unavailable_not_panicking() {
    if cuda::is_available() {
        return;
    }
    assert_eq!(cuda::device_count(), 0);
    assert!(cuda::driver_version().is_none() || cuda::device_count() == 0);
    assert!(matches!(
        cuda::get_device_properties(0),
        Err(Error::CudaUnavailable { .. })
    ));
    let err = Tensor::zeros([2], DType::F32, Device::Cuda(0)).unwrap_err();
    assert!(matches!(err, Error::CudaUnavailable { .. }), "{err}");
    assert!(err.to_string().contains("CUDA is not available"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn devices_and_properties() {
    require_gpu();
    let n = cuda::device_count();
    assert!(n >= 1);
    for i in 0..n {
        let p = cuda::get_device_properties(i).unwrap();
        assert!(!p.name.is_empty());
        assert_eq!(cuda::get_device_name(i).unwrap(), p.name);
        assert_eq!(cuda::get_device_capability(i).unwrap(), (p.major, p.minor));
        assert!(p.major >= 7, "{p:?}");
        assert!(p.total_memory > 1 << 30, "{p:?}");
        assert!(p.multi_processor_count > 0 && p.warp_size == 32, "{p:?}");
        println!("cuda:{i} {p:?}");
    }
    assert!(matches!(
        cuda::get_device_properties(n),
        Err(Error::InvalidArgument { .. })
    ));
    let archs = cuda::get_arch_list();
    assert!(
        !archs.is_empty() && archs.iter().all(|a| a.starts_with("sm_")),
        "{archs:?}"
    );
    let v = cuda::driver_version().unwrap();
    assert!(v >= 12000, "driver CUDA version {v}");
    let libs = cuda::library_report();
    assert!(
        libs.iter()
            .any(|l| l.name.starts_with("driver") && l.found.is_some()),
        "{libs:?}"
    );
    println!("driver {v}, archs {archs:?}, libraries {libs:?}");
}

/// Every kernel source compiles with NVRTC for the architectures ember targets. Needs only
/// libnvrtc (no GPU): CI installs it (`pip install nvidia-cuda-nvrtc`) and runs this test.
#[test]
#[ignore = "needs libnvrtc.so.13 (CI and GPU machines have it)"]
fn every_kernel_source_compiles_with_nvrtc() {
    let (major, minor) = cuda::nvrtc_version().expect("libnvrtc.so.13 must be loadable for this test");
    // One thread per architecture: NVRTC is thread-safe, and CI has two cores.
    std::thread::scope(|scope| {
        let jobs: Vec<_> = ["sm_80", "sm_90"]
            .into_iter()
            .map(|arch| scope.spawn(move || (arch, cuda::compile_all_kernels(arch))))
            .collect();
        for job in jobs {
            let (arch, compiled) = job.join().unwrap();
            let compiled = compiled.unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert_eq!(compiled.len(), cuda::Module::ALL.len());
            for (name, bytes) in compiled {
                assert!(bytes > 1000, "{name}.cu for {arch}: cubin of {bytes} bytes");
                println!("nvrtc {major}.{minor} {arch}: {name}.cu -> {bytes} bytes");
            }
        }
    });
    // A syntax error is reported with NVRTC's log, not a panic.
    let err = cuda::nvrtc_compile(
        "broken",
        "extern \"C\" __global__ void k() { int x = ; }",
        "sm_90",
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::Cuda { .. }) && err.to_string().contains("broken.cu"),
        "{err}"
    );
}
