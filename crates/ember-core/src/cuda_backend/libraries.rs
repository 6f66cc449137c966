//! Which CUDA libraries this process can load, for `ember info` and clear errors: the driver,
//! NVRTC, cuBLAS, cuBLASLt, cuRAND, cuDNN and NCCL, each found (with the name that loaded) or
//! missing.

/// One library and the file name that loaded, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryStatus {
    pub name: &'static str,
    /// The file name the dynamic loader opened, or `None` when no candidate loaded.
    pub found: Option<String>,
}

/// The candidates tried for each library, most specific first (CUDA 13 builds).
const LIBRARIES: &[(&str, &[&str])] = &[
    ("driver (libcuda)", &["libcuda.so.1", "libcuda.so"]),
    ("nvrtc", &["libnvrtc.so.13", "libnvrtc.so"]),
    ("cublas", &["libcublas.so.13", "libcublas.so"]),
    ("cublasLt", &["libcublasLt.so.13", "libcublasLt.so"]),
    ("curand", &["libcurand.so.10", "libcurand.so"]),
    ("cudnn", &["libcudnn.so.9", "libcudnn.so"]),
    ("nccl", &["libnccl.so.2", "libnccl.so"]),
];

/// Tries to load each CUDA library; loading only opens the file, it runs no CUDA code. NCCL is
/// also looked for where pip puts it ([`nccl_candidates`]), as the NCCL backend does.
pub fn library_report() -> Vec<LibraryStatus> {
    let env = |k: &str| std::env::var(k).ok();
    LIBRARIES
        .iter()
        .map(|&(name, candidates)| {
            let mut candidates: Vec<String> = candidates.iter().map(|c| c.to_string()).collect();
            if name == "nccl" {
                candidates = nccl_candidates(&env);
            }
            LibraryStatus {
                name,
                found: candidates
                    .into_iter()
                    // SAFETY: opening a shared library runs its initializers; NVIDIA's libraries
                    // have no initializers with preconditions, and the handle is dropped at once.
                    .find(|c| unsafe { libloading::Library::new(c) }.is_ok()),
            }
        })
        .collect()
}

/// Where NCCL (`libnccl.so.2`) is looked for, in order: the file named by
/// `EMBER_NCCL_LIBRARY`, `libnccl.so.2` and `libnccl.so` through the dynamic loader's search
/// (`LD_LIBRARY_PATH`, `ldconfig`), then `nvidia/nccl/lib/libnccl.so.2` in the Python package
/// folders of an active virtual or conda environment, `~/.local`, `/usr/local`, `/usr` and
/// `/opt/conda` (the `nvidia-nccl-cu*` wheels, which `pip install torch` brings, install only
/// `libnccl.so.2`, a name cudarc's own loader does not try). `env` reads variables.
pub fn nccl_candidates(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(p) = env("EMBER_NCCL_LIBRARY").filter(|p| !p.is_empty()) {
        out.push(p);
    }
    out.push("libnccl.so.2".into());
    out.push("libnccl.so".into());
    for packages in python_package_dirs(env) {
        let file = packages.join("nvidia/nccl/lib/libnccl.so.2");
        if file.is_file() {
            out.push(file.to_string_lossy().into_owned());
        }
    }
    out
}

/// The Python package folders (`lib/python3*/{site,dist}-packages`) where pip puts NVIDIA's
/// library wheels (`nvidia/nccl/lib`, `nvidia/cu13/lib`, ...), in the order they are searched:
/// an active virtual or conda environment (`VIRTUAL_ENV`, `CONDA_PREFIX`), `~/.local`,
/// `/usr/local`, `/usr` and `/opt/conda`; only folders that exist. `env` reads variables.
pub(crate) fn python_package_dirs(env: &dyn Fn(&str) -> Option<String>) -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var).filter(|p| !p.is_empty()) {
            prefixes.push(p.into());
        }
    }
    if let Some(home) = env("HOME").filter(|p| !p.is_empty()) {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    let mut out = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let dir = py.join(packages);
                if dir.is_dir() {
                    out.push(dir);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_candidates_start_with_the_override_then_the_loader_names() {
        let env = |k: &str| (k == "EMBER_NCCL_LIBRARY").then(|| "/opt/x/libnccl.so.2".to_string());
        let c = nccl_candidates(&env);
        assert_eq!(c[..3], ["/opt/x/libnccl.so.2", "libnccl.so.2", "libnccl.so"]);
    }

    #[test]
    fn nccl_is_found_in_a_pip_wheel_under_a_virtual_env() {
        let dir = std::env::temp_dir().join(format!("ember-nccl-venv-{}", std::process::id()));
        let lib = dir.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"").unwrap();
        let venv = dir.to_string_lossy().into_owned();
        let env = move |k: &str| (k == "VIRTUAL_ENV").then(|| venv.clone());
        let c = nccl_candidates(&env);
        assert_eq!(
            c[1..3],
            ["libnccl.so", &lib.join("libnccl.so.2").to_string_lossy()]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
