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

/// Tries to load each CUDA library; loading only opens the file, it runs no CUDA code.
pub fn library_report() -> Vec<LibraryStatus> {
    LIBRARIES
        .iter()
        .map(|&(name, candidates)| LibraryStatus {
            name,
            found: candidates
                .iter()
                // SAFETY: opening a shared library runs its initializers; NVIDIA's libraries
                // have no initializers with preconditions, and the handle is dropped at once.
                .find(|c| unsafe { libloading::Library::new(**c) }.is_ok())
                .map(|c| c.to_string()),
        })
        .collect()
}
