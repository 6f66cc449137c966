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

/// Every kernel source compiles with NVRTC for the architectures ember targets, and its compile
/// units (Note [Kernel units]) are what `Module::units` lists: every file compiled with all its
/// listed units defines exactly the kernels of the whole file, and a unit compiled alone defines
/// its own kernels and no others. Needs only libnvrtc (no GPU): CI installs it
/// (`pip install nvidia-cuda-nvrtc`) and runs this test.
#[test]
#[ignore = "needs libnvrtc.so.13 (CI and GPU machines have it)"]
fn every_kernel_source_compiles_with_nvrtc() {
    use std::collections::BTreeSet;
    let (major, minor) = cuda::nvrtc_version().expect("libnvrtc.so.13 must be loadable for this test");
    let started = std::time::Instant::now();
    // Two threads (CI has two cores; NVRTC is thread-safe): every file whole for sm_80, and every
    // file with its listed units for sm_90, then one unit alone per file.
    let (whole, listed) = std::thread::scope(|scope| {
        let whole = scope.spawn(|| cuda::compile_all_kernels("sm_80"));
        let listed = scope.spawn(|| {
            cuda::Module::ALL
                .iter()
                .map(|&m| {
                    let units = m.units();
                    let all = cuda::compile_units(m, &units, "sm_90")?;
                    let alone = cuda::compile_units(m, &units[units.len() / 2..][..1], "sm_90")?;
                    Ok((m, units, all, alone))
                })
                .collect::<ember_core::Result<Vec<_>>>()
        });
        (whole.join().unwrap(), listed.join().unwrap())
    });
    let whole = whole.unwrap_or_else(|e| panic!("sm_80: {e}"));
    let listed = listed.unwrap_or_else(|e| panic!("sm_90: {e}"));
    assert_eq!(whole.len(), cuda::Module::ALL.len());
    for ((name, whole_cubin), (module, units, all, alone)) in whole.iter().zip(&listed) {
        assert_eq!(*name, module.name());
        let expected: BTreeSet<String> = units.iter().flat_map(|u| u.symbols()).collect();
        let whole_kernels = kernel_names(whole_cubin);
        assert_eq!(
            whole_kernels.symmetric_difference(&expected).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{name}.cu: kernels of the whole file vs. the units Module::units lists"
        );
        assert_eq!(
            kernel_names(all),
            expected,
            "{name}.cu with every listed unit defined"
        );
        let unit = &units[units.len() / 2];
        assert_eq!(
            kernel_names(alone),
            unit.symbols().into_iter().collect::<BTreeSet<_>>(),
            "{name}.cu with only {} defined",
            unit.define()
        );
        println!(
            "nvrtc {major}.{minor}: {name}.cu, {} kernels in {} units -> {} bytes (sm_80), {} alone -> {} bytes",
            expected.len(),
            units.len(),
            whole_cubin.len(),
            unit.name,
            alone.len()
        );
    }
    println!("compiled in {:.1} s", started.elapsed().as_secs_f64());
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

/// The kernels a cubin defines: the global function symbols of its ELF symbol table.
fn kernel_names(cubin: &[u8]) -> std::collections::BTreeSet<String> {
    let u16_at = |o: usize| u16::from_le_bytes(cubin[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&cubin[..5], b"\x7fELF\x02", "a 64-bit ELF cubin");
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let mut names = std::collections::BTreeSet::new();
    for i in 0..shnum {
        let sh = section(i);
        if u32_at(sh + 4) != 2 {
            continue; // not SHT_SYMTAB
        }
        let strtab = u64_at(section(u32_at(sh + 40)) + 24);
        let (offset, size) = (u64_at(sh + 24), u64_at(sh + 32));
        for sym in (offset..offset + size).step_by(24) {
            let info = cubin[sym + 4];
            // STT_FUNC, STB_GLOBAL, defined here.
            if info & 0xf == 2 && info >> 4 == 1 && u16_at(sym + 6) != 0 {
                let name = &cubin[strtab + u32_at(sym)..];
                let end = name.iter().position(|&b| b == 0).unwrap();
                names.insert(String::from_utf8_lossy(&name[..end]).into_owned());
            }
        }
    }
    names
}
