//! Runtime compilation of ember's kernel sources with NVRTC, for the exact architecture of the
//! device (`sm_90` on an H100), one compile unit at a time (Note [Kernel units] in
//! `kernel_units.rs`), and the on-disk cache of the results.
//!
//! Note [Kernel cache]: each unit's cubin is written to `$EMBER_KERNEL_CACHE` (default
//! `$XDG_CACHE_HOME/ember/kernels`, else `~/.cache/ember/kernels`) under a name made of the
//! source file, the unit, the architecture, the NVRTC version and a 64-bit FNV-1a hash of the
//! full source text (the prelude, the parameter lists of `launch.rs` and the file) and the
//! compile options. A changed source or parameter list, another GPU generation or another
//! NVRTC gives another name, so stale entries are never loaded. Entries are written to a
//! temporary file and renamed into place, so a crash or two processes compiling at once never
//! leave a half-written cubin behind. A cache that cannot be written (read-only home) only costs
//! the compile time.

use super::kernel_units::Unit;
use super::kernels::Module;
use super::launch::{PARAMS_HEADER, VARIANTS_HEADER};
use crate::{Error, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The prelude every kernel source is compiled with (see `kernels/prelude.cuh`).
pub(crate) const PRELUDE: &str = include_str!("../../kernels/prelude.cuh");

/// The loaded NVRTC's `(major, minor)` version, or why NVRTC cannot be used.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    static VERSION: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to open the library; it calls no NVRTC function.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "the NVRTC library (libnvrtc.so.13) was not found; install the CUDA toolkit \
                            or `pip install nvidia-cuda-nvrtc` and add its lib folder to LD_LIBRARY_PATH"
                        .into(),
                );
            }
            let (mut major, mut minor) = (0, 0);
            // SAFETY: the library is loaded; both out pointers are valid for writes.
            unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
                .result()
                .map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
            Ok((major, minor))
        })
        .clone()
        .map_err(|reason| Error::CudaUnavailable { reason })
}

/// Compiles `source` (the prelude and the kernels' parameter lists, `launch::PARAMS_HEADER`,
/// prepended) for `arch` (e.g. `"sm_90"`) into a cubin, or a
/// [`Error::Cuda`] carrying NVRTC's log. The kernel sources emit their kernels only for the
/// units asked for (Note [Kernel units]): see [`compile_units`].
pub fn compile(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    compile_with(name, source, arch, &[])
}

/// Compiles `source` as [`compile`] does, with extra NVRTC options (`-D...`).
pub(crate) fn compile_with(name: &str, source: &str, arch: &str, extra: &[String]) -> Result<Vec<u8>> {
    nvrtc_version()?;
    let text = format!("{PRELUDE}\n{PARAMS_HEADER}\n{VARIANTS_HEADER}\n#line 1 \"{name}.cu\"\n{source}");
    let fail = |what: &str, e: &dyn std::fmt::Debug| Error::Cuda {
        op: "nvrtc",
        msg: format!("{what} of kernel source {name}.cu failed: {e:?}"),
    };
    let src = CString::new(text).map_err(|e| fail("reading", &e))?;
    let file = CString::new(format!("{name}.cu")).map_err(|e| fail("naming", &e))?;
    let prog = result::create_program(&src, Some(&file)).map_err(|e| fail("nvrtcCreateProgram", &e))?;
    let options = options(arch, extra);
    // SAFETY: `prog` is a live program created above; it is destroyed exactly once below.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let outcome = match compiled {
        Ok(()) => cubin(prog).map_err(|e| fail("nvrtcGetCUBIN", &e)),
        Err(_) => {
            // SAFETY: `prog` is live; the log is read before the program is destroyed.
            let log = unsafe { result::get_program_log(prog) }.unwrap_or_default();
            let log: Vec<u8> = log.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            let with = if extra.is_empty() {
                String::new()
            } else {
                format!(" with {}", extra.join(" "))
            };
            Err(Error::Cuda {
                op: "nvrtc",
                msg: format!(
                    "kernel source {name}.cu does not compile for {arch}{with}:\n{}",
                    String::from_utf8_lossy(&log)
                ),
            })
        }
    };
    // SAFETY: `prog` is live and not used after this call.
    let _ = unsafe { result::destroy_program(prog) };
    outcome
}

fn options(arch: &str, extra: &[String]) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    options.extend(extra.iter().cloned());
    options
}

/// Compiles the units `units` of `module` together into one cubin (CI's check; the runtime
/// compiles one unit at a time through `compile_unit_cached`).
pub fn compile_units(module: Module, units: &[Unit], arch: &str) -> Result<Vec<u8>> {
    let defines: Vec<String> = units.iter().map(Unit::define).collect();
    compile_with(module.name(), module.source(), arch, &defines)
}

fn cubin(prog: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, cudarc::nvrtc::result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is a valid out pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported for the cubin.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }.result()?;
    Ok(buf)
}

/// The cubin of `unit` for `arch` through the disk cache of Note [Kernel cache]; `on_miss` runs
/// before compiling when the cache has no entry for it.
pub(crate) fn compile_unit_cached(unit: &Unit, arch: &str, on_miss: impl FnOnce()) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let name = unit.module.name();
    let source = unit.module.source();
    let extra = [unit.define()];
    let mut hash = fnv1a(PRELUDE.as_bytes(), 0xcbf2_9ce4_8422_2325);
    hash = fnv1a(PARAMS_HEADER.as_bytes(), hash);
    hash = fnv1a(VARIANTS_HEADER.as_bytes(), hash);
    hash = fnv1a(source.as_bytes(), hash);
    for option in options(arch, &extra) {
        hash = fnv1a(option.as_bytes(), fnv1a(b"\0", hash));
    }
    let key = format!(
        "{name}.{}-{arch}-nvrtc{major}.{minor}-{hash:016x}.cubin",
        unit.name
    );
    let path = cache_dir().map(|d| d.join(key));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(bytes);
    }
    on_miss();
    let started = std::time::Instant::now();
    let bytes = compile_with(name, source, arch, &extra)?;
    if std::env::var_os("EMBER_KERNEL_LOG").is_some_and(|v| !v.is_empty() && v != "0") {
        eprintln!(
            "ember: compiled {name}.cu unit {} for {arch} in {:.2} s (thread {})",
            unit.name,
            started.elapsed().as_secs_f64(),
            std::thread::current().name().unwrap_or("unnamed"),
        );
    }
    if let Some(path) = path {
        let _ = write_atomically(&path, &bytes);
    }
    Ok(bytes)
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("EMBER_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ember").join("kernels"))
}

fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().expect("cache entries live in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".tmp-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// 64-bit FNV-1a, continuing from `hash`: a stable hash (std's is not promised to stay the same
/// across Rust versions).
fn fnv1a(bytes: &[u8], mut hash: u64) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b"", 0xcbf2_9ce4_8422_2325), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a", 0xcbf2_9ce4_8422_2325), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar", 0xcbf2_9ce4_8422_2325), 0x8594_4171_f739_67e8);
    }
}
