//! Finding and opening NCCL (`libnccl.so.2`) at run time, and the raw entry points the
//! backend calls.
//!
//! Note [Loading NCCL]: the ABI (the types `ncclUniqueId`, `ncclComm_t`, `ncclDataType_t`,
//! `ncclRedOp_t`) comes from cudarc's `nccl` bindings (the `nccl-02028` feature: NCCL 2.28, what
//! PyTorch's wheels ship on the GPU machines). The library itself is opened here rather than by
//! cudarc's loader, for two reasons: cudarc's loader panics in a lazy static when no candidate
//! opens, and its candidate names (`libnccl.so`, `libnccl.so.13`, `.12`, ... built from the
//! CUDA major version) do not include `libnccl.so.2`, the only name the `nvidia-nccl-cu*` pip
//! wheels install. The candidates are `ember_core::cuda::nccl_candidates` (also what
//! `ember info` reports): `EMBER_NCCL_LIBRARY`, `libnccl.so.2` and `libnccl.so` through the
//! dynamic loader's search, then the pip wheel's file under Python package folders. Nothing
//! found is [`Error::CudaUnavailable`] naming what to install; a missing entry point is the
//! same error, naming the symbol.
//!
//! Every function returns NCCL's `ncclResult_t` as a plain integer (see [`NcclResult`]), so a
//! code this build does not know cannot become an invalid Rust enum value.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use ember_core::{Error, Result};

/// A CUDA stream handle as NCCL takes it (`cudaStream_t`, the same object as a `CUstream`).
pub type RawStream = *mut c_void;

/// `ncclResult_t` as returned: 0 is success, 7 `ncclInProgress`.
pub type NcclResult = c_int;
pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_IN_PROGRESS: NcclResult = 7;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> NcclResult;
type CommOp = unsafe extern "C" fn(ncclComm_t) -> NcclResult;
type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut NcclResult) -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type CommGetLastError = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type Group = unsafe extern "C" fn() -> NcclResult;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    RawStream,
) -> NcclResult;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    RawStream,
) -> NcclResult;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    RawStream,
) -> NcclResult;
type ReduceScatter = AllReduce;
type Send =
    unsafe extern "C" fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, RawStream) -> NcclResult;
type Recv =
    unsafe extern "C" fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, RawStream) -> NcclResult;

/// The opened library and its entry points. Lives for the whole process (never unloaded).
pub struct Nccl {
    /// The file that opened.
    pub path: String,
    /// `ncclGetVersion`'s code, e.g. 22803 for 2.28.3.
    pub version: i32,
    _lib: libloading::Library,
    pub get_unique_id: GetUniqueId,
    pub comm_init_rank: CommInitRank,
    pub comm_destroy: CommOp,
    pub comm_abort: CommOp,
    pub comm_get_async_error: CommGetAsyncError,
    pub get_error_string: GetErrorString,
    pub comm_get_last_error: CommGetLastError,
    pub group_start: Group,
    pub group_end: Group,
    pub all_reduce: AllReduce,
    pub broadcast: Broadcast,
    pub all_gather: AllGather,
    pub reduce_scatter: ReduceScatter,
    pub send: Send,
    pub recv: Recv,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({}, version {})", self.path, self.version)
    }
}

const INSTALL_HINT: &str = "install NCCL 2.x (`pip install nvidia-nccl-cu13`, which PyTorch's CUDA wheels \
     bring, or the libnccl2 package), put its lib folder on LD_LIBRARY_PATH or name the file in \
     EMBER_NCCL_LIBRARY; or use the \"gloo\" (CPU) backend";

/// The library, opened on first use (Note [Loading NCCL]); the same error every time when it
/// cannot be opened.
pub fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(open)
        .as_ref()
        .map_err(|reason| Error::CudaUnavailable {
            reason: reason.clone(),
        })
}

fn open() -> std::result::Result<Nccl, String> {
    // Connections at init (Note [NCCL backend design], Environment): set before NCCL reads its
    // variables, which it does when the first communicator is created.
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
    let env = |k: &str| std::env::var(k).ok();
    open_first(&ember_core::cuda::nccl_candidates(&env))
}

/// Opens the first of `tried` that loads.
fn open_first(tried: &[String]) -> std::result::Result<Nccl, String> {
    for name in tried {
        // SAFETY: opening NCCL runs its library initializers, which have no preconditions; the
        // library is kept open for the life of the process (held by the static `Nccl`).
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            return bind(lib, name.clone());
        }
    }
    Err(format!(
        "the NCCL library (libnccl.so.2) was not found (tried {}); {INSTALL_HINT}",
        tried.join(", ")
    ))
}

fn symbol<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> std::result::Result<T, String> {
    // SAFETY: each `T` below is the C signature of the named NCCL entry point as declared in
    // nccl.h (2.18 and later), with `ncclResult_t` as `int`; the pointer stays valid while
    // `lib` is open, which is the life of the process.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{path} has no entry point {name} ({e}); it is too old: {INSTALL_HINT}"))
}

fn bind(lib: libloading::Library, path: String) -> std::result::Result<Nccl, String> {
    let get_version: GetVersion = symbol(&lib, &path, "ncclGetVersion")?;
    let mut version = 0;
    // SAFETY: the out pointer is valid for one write.
    let rc = unsafe { get_version(&mut version) };
    if rc != NCCL_SUCCESS {
        return Err(format!("ncclGetVersion failed in {path} (code {rc})"));
    }
    if version < 21800 {
        return Err(format!(
            "{path} is NCCL {version}, older than 2.18; {INSTALL_HINT}"
        ));
    }
    Ok(Nccl {
        version,
        get_unique_id: symbol(&lib, &path, "ncclGetUniqueId")?,
        comm_init_rank: symbol(&lib, &path, "ncclCommInitRank")?,
        comm_destroy: symbol(&lib, &path, "ncclCommDestroy")?,
        comm_abort: symbol(&lib, &path, "ncclCommAbort")?,
        comm_get_async_error: symbol(&lib, &path, "ncclCommGetAsyncError")?,
        get_error_string: symbol(&lib, &path, "ncclGetErrorString")?,
        comm_get_last_error: symbol(&lib, &path, "ncclGetLastError")?,
        group_start: symbol(&lib, &path, "ncclGroupStart")?,
        group_end: symbol(&lib, &path, "ncclGroupEnd")?,
        all_reduce: symbol(&lib, &path, "ncclAllReduce")?,
        broadcast: symbol(&lib, &path, "ncclBroadcast")?,
        all_gather: symbol(&lib, &path, "ncclAllGather")?,
        reduce_scatter: symbol(&lib, &path, "ncclReduceScatter")?,
        send: symbol(&lib, &path, "ncclSend")?,
        recv: symbol(&lib, &path, "ncclRecv")?,
        path,
        _lib: lib,
    })
}

impl Nccl {
    /// NCCL's text for `code`, with the communicator's last error message when one is given.
    pub fn describe(&self, code: NcclResult, comm: Option<ncclComm_t>) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { cstr((self.get_error_string)(code)) };
        let last = match comm {
            // SAFETY: `c` is a live communicator (the caller's invariant); the returned string
            // is NUL-terminated and owned by NCCL.
            Some(c) if !c.is_null() => unsafe { cstr((self.comm_get_last_error)(c)) },
            _ => String::new(),
        };
        if last.is_empty() {
            format!("{text} (code {code})")
        } else {
            format!("{text} (code {code}): {last}")
        }
    }
}

/// Copies a C string NCCL returned; empty for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_saying_what_to_install() {
        let e = open_first(&[
            "/nonexistent/libnccl.so.2".to_string(),
            "libnccl-ember-missing.so".to_string(),
        ])
        .unwrap_err();
        assert!(
            e.contains("/nonexistent/libnccl.so.2") && e.contains("pip install nvidia-nccl"),
            "{e}"
        );
    }

    #[test]
    fn a_library_without_nccl_entry_points_is_an_error() {
        // libc opens but has no ncclGetVersion.
        let e = open_first(&["libc.so.6".to_string()]).unwrap_err();
        assert!(e.contains("ncclGetVersion"), "{e}");
    }
}
