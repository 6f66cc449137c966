//! NVTX ranges and marks for Nsight Systems and other CUDA tools (`torch.cuda.nvtx`), through
//! NVTX3's injection mechanism: no `libnvToolsExt` is needed (the GPU machines have none).
//!
//! Note [NVTX injection]: NVTX3 is header-only; a program's NVTX calls go through a table of
//! function pointers that starts empty. On the first call the program reads
//! `NVTX_INJECTION64_PATH` (set by the tool that launched it, e.g. `nsys profile`), loads that
//! library and calls its `InitializeInjectionNvtx2` with a `GetExportTable` function; the
//! tool asks it for the callbacks table (export table id 1) and calls
//! `GetModuleFunctionTable(module, &table, &size)` for each module, writing its own
//! functions into the slots it is given. ember does the same with its own tables (six modules
//! with 16, 9, 15, 7, 16 and 7 slots: core, CUDA, OpenCL, CUDA runtime, core2, sync) and calls
//! the core slots it uses: `nvtxMarkA` (2), `nvtxRangePushA` (9), `nvtxRangePop` (11). With
//! no tool (the variable unset, the library missing, or its initializer failing) every call
//! returns at once after one check of an initialized `OnceLock`, and allocates nothing.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

/// Slots per module, in module order (module ids 1..=6).
const MODULE_SLOTS: [usize; 6] = [16, 9, 15, 7, 16, 7];
const ALL_SLOTS: usize = 16 + 9 + 15 + 7 + 16 + 7;
/// Core module slots.
const CORE_MARK_A: usize = 2;
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;
/// `nvtxInitialize`: slot 15 of the core2 module (which starts after the first four).
const CORE2_INITIALIZE: usize = 16 + 9 + 15 + 7 + 15;
/// The NVTX API version ember implements.
const NVTX_VERSION: u32 = 3;
/// What the NVTX functions return without a tool (`NVTX_NO_PUSH_POP_TRACKING`).
const NO_TRACKING: i32 = -2;

/// The function slots tools write into, and the table of pointers to them tools are handed.
struct Tables {
    slots: [*mut c_void; ALL_SLOTS],
    slot_ptrs: [*mut *mut c_void; ALL_SLOTS],
}

static TABLES: AtomicPtr<Tables> = AtomicPtr::new(std::ptr::null_mut());

#[repr(C)]
struct CallbacksTable {
    struct_size: usize,
    get_module_function_table: unsafe extern "C" fn(c_int, *mut *mut *mut *mut c_void, *mut c_uint) -> c_int,
}

#[repr(C)]
struct VersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: extern "C" fn(u32),
}

static CALLBACKS: CallbacksTable = CallbacksTable {
    struct_size: std::mem::size_of::<CallbacksTable>(),
    get_module_function_table,
};

static VERSION_INFO: VersionInfo = VersionInfo {
    struct_size: std::mem::size_of::<VersionInfo>(),
    version: NVTX_VERSION,
    reserved0: 0,
    set_injection_nvtx_version,
};

extern "C" fn set_injection_nvtx_version(_version: u32) {}

extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        1 => (&CALLBACKS as *const CallbacksTable).cast(),
        3 => (&VERSION_INFO as *const VersionInfo).cast(),
        _ => std::ptr::null(),
    }
}

/// # Safety
/// Called by the tool with valid (or null) output pointers, while `TABLES` is set.
unsafe extern "C" fn get_module_function_table(
    module: c_int,
    out_table: *mut *mut *mut *mut c_void,
    out_size: *mut c_uint,
) -> c_int {
    let tables = TABLES.load(Ordering::Acquire);
    let Some(m) = usize::try_from(module).ok().and_then(|m| m.checked_sub(1)) else {
        return 0;
    };
    if tables.is_null() || m >= MODULE_SLOTS.len() {
        return 0;
    }
    let offset: usize = MODULE_SLOTS[..m].iter().sum();
    // SAFETY: `tables` points at the leaked `Tables` of `injection` (never freed); `offset`
    // plus the module's slot count stays within `slot_ptrs`; the outputs are the tool's.
    unsafe {
        if !out_table.is_null() {
            *out_table = (*tables).slot_ptrs.as_mut_ptr().add(offset);
        }
        if !out_size.is_null() {
            *out_size = MODULE_SLOTS[m] as c_uint;
        }
    }
    1
}

/// The tool's functions ember calls.
struct Injected {
    mark_a: Option<unsafe extern "C" fn(*const c_char)>,
    range_push_a: Option<unsafe extern "C" fn(*const c_char) -> c_int>,
    range_pop: Option<unsafe extern "C" fn() -> c_int>,
}

// SAFETY: plain function pointers into a library that stays loaded; NVTX functions are
// thread-safe by contract.
unsafe impl Send for Injected {}
unsafe impl Sync for Injected {}

fn injection() -> Option<&'static Injected> {
    static INJECTED: OnceLock<Option<Injected>> = OnceLock::new();
    INJECTED.get_or_init(load).as_ref()
}

/// Loads the tool named by `NVTX_INJECTION64_PATH` (Note [NVTX injection]).
fn load() -> Option<Injected> {
    let path = std::env::var_os("NVTX_INJECTION64_PATH")?;
    type Init = unsafe extern "C" fn(extern "C" fn(u32) -> *const c_void) -> c_int;
    // SAFETY: loading the tool's library runs its initializers; that is what the user asked
    // for by starting the program under the tool.
    let lib = unsafe { libloading::Library::new(&path) }.ok()?;
    // SAFETY: `InitializeInjectionNvtx2` has this signature in every NVTX injection library.
    let init: Init = *unsafe { lib.get::<Init>(b"InitializeInjectionNvtx2\0") }.ok()?;
    let mut tables = Box::new(Tables {
        slots: [std::ptr::null_mut(); ALL_SLOTS],
        slot_ptrs: [std::ptr::null_mut(); ALL_SLOTS],
    });
    for i in 0..ALL_SLOTS {
        tables.slot_ptrs[i] = &mut tables.slots[i];
    }
    let tables = Box::into_raw(tables);
    TABLES.store(tables, Ordering::Release);
    // SAFETY: the tool calls back into `get_export_table` and fills the slots of the leaked
    // tables during this call (they live for the rest of the process).
    let ok = unsafe { init(get_export_table) } == 1;
    // The library stays loaded: the slots point into it.
    std::mem::forget(lib);
    if !ok {
        return None;
    }
    // SAFETY: the tool has finished writing; slots hold null or functions of the NVTX
    // signatures of their ids.
    unsafe {
        let slots = &(*tables).slots;
        let get = |i: usize| slots[i];
        if let Some(initialize) = (!get(CORE2_INITIALIZE).is_null()).then(|| {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_void)>(get(CORE2_INITIALIZE))
        }) {
            initialize(std::ptr::null());
        }
        Some(Injected {
            mark_a: (!get(CORE_MARK_A).is_null()).then(|| std::mem::transmute(get(CORE_MARK_A))),
            range_push_a: (!get(CORE_RANGE_PUSH_A).is_null())
                .then(|| std::mem::transmute(get(CORE_RANGE_PUSH_A))),
            range_pop: (!get(CORE_RANGE_POP).is_null()).then(|| std::mem::transmute(get(CORE_RANGE_POP))),
        })
    }
}

/// True when an NVTX tool is attached (its calls are recorded).
pub fn is_enabled() -> bool {
    injection().is_some()
}

fn c_message(msg: &str) -> CString {
    CString::new(msg.replace('\0', " ")).unwrap_or_default()
}

/// Opens a nested range (`torch.cuda.nvtx.range_push`): the depth of the new range (from 0),
/// or a negative number when no tool records ranges.
pub fn range_push(msg: &str) -> i32 {
    let Some(f) = injection().and_then(|i| i.range_push_a) else {
        return NO_TRACKING;
    };
    let msg = c_message(msg);
    // SAFETY: the tool's nvtxRangePushA with a NUL-terminated string that outlives the call.
    unsafe { f(msg.as_ptr()) }
}

/// Closes the innermost range (`torch.cuda.nvtx.range_pop`): the depth of the closed range, or
/// a negative number when no tool records ranges.
pub fn range_pop() -> i32 {
    let Some(f) = injection().and_then(|i| i.range_pop) else {
        return NO_TRACKING;
    };
    // SAFETY: the tool's nvtxRangePop.
    unsafe { f() }
}

/// Marks an instant (`torch.cuda.nvtx.mark`).
pub fn mark(msg: &str) {
    if let Some(f) = injection().and_then(|i| i.mark_a) {
        let msg = c_message(msg);
        // SAFETY: the tool's nvtxMarkA with a NUL-terminated string that outlives the call.
        unsafe { f(msg.as_ptr()) }
    }
}

/// A range closed when dropped (`with torch.cuda.nvtx.range(msg):`).
#[must_use = "the range closes when the guard drops"]
pub struct Range(());

/// Opens a range until the returned guard drops.
pub fn range(msg: &str) -> Range {
    range_push(msg);
    Range(())
}

impl Drop for Range {
    fn drop(&mut self) {
        range_pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_tool_calls_do_nothing() {
        if std::env::var_os("NVTX_INJECTION64_PATH").is_some() {
            return; // running under a tool
        }
        assert!(!is_enabled());
        assert_eq!(range_push("x"), NO_TRACKING);
        mark("m");
        {
            let _r = range("scoped");
        }
        assert_eq!(range_pop(), NO_TRACKING);
    }

    #[test]
    fn module_tables_have_the_slots_tools_expect() {
        assert_eq!(MODULE_SLOTS.iter().sum::<usize>(), ALL_SLOTS);
        assert!(CORE2_INITIALIZE < ALL_SLOTS);
    }
}
