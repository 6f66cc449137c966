//! The kernel sources (one CUDA C file per op family under `kernels/`), the argument types
//! kernels take, and the one launch function every CUDA op goes through.

use super::runtime::DeviceRuntime;
use crate::{DType, Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;

/// One kernel family: a source file compiled into one CUDA module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Module {
    Copy,
    Elementwise,
    Unary,
    Reduce,
    Softmax,
    Index,
    Random,
    Matmul,
    Rnn,
    Optim,
    Amp,
    Norm,
    Loss,
    Sort,
}

impl Module {
    pub const ALL: [Module; 14] = [
        Module::Copy,
        Module::Elementwise,
        Module::Unary,
        Module::Reduce,
        Module::Softmax,
        Module::Index,
        Module::Random,
        Module::Matmul,
        Module::Rnn,
        Module::Optim,
        Module::Amp,
        Module::Norm,
        Module::Loss,
        Module::Sort,
    ];

    /// The file name without `.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Module::Copy => "copy",
            Module::Elementwise => "elementwise",
            Module::Unary => "unary",
            Module::Reduce => "reduce",
            Module::Softmax => "softmax",
            Module::Index => "index",
            Module::Random => "random",
            Module::Matmul => "matmul",
            Module::Rnn => "rnn",
            Module::Optim => "optim",
            Module::Amp => "amp",
            Module::Norm => "norm",
            Module::Loss => "loss",
            Module::Sort => "sort",
        }
    }

    /// The CUDA C source (without the prelude).
    pub fn source(self) -> &'static str {
        match self {
            Module::Copy => include_str!("../../kernels/copy.cu"),
            Module::Elementwise => include_str!("../../kernels/elementwise.cu"),
            Module::Unary => include_str!("../../kernels/unary.cu"),
            Module::Reduce => include_str!("../../kernels/reduce.cu"),
            Module::Softmax => include_str!("../../kernels/softmax.cu"),
            Module::Index => include_str!("../../kernels/index.cu"),
            Module::Random => include_str!("../../kernels/random.cu"),
            Module::Matmul => include_str!("../../kernels/matmul.cu"),
            Module::Rnn => include_str!("../../kernels/rnn.cu"),
            Module::Optim => include_str!("../../kernels/optim.cu"),
            Module::Amp => include_str!("../../kernels/amp.cu"),
            Module::Norm => include_str!("../../kernels/norm.cu"),
            Module::Loss => include_str!("../../kernels/loss.cu"),
            Module::Sort => include_str!("../../kernels/sort.cu"),
        }
    }
}

/// The dtype's suffix in kernel names (`add_f32`), as in the kernel sources' `EMBER_FOR_ALL_DTYPES`.
pub(crate) fn dtype_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::Bool => "bool",
    }
}

/// A loaded kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function(pub(crate) sys::CUfunction);

// SAFETY: a CUfunction is an immutable handle into a module that is never unloaded; the driver
// allows using it from any thread that has its context current.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

/// Which kernel of a module: a base name and up to two dtypes, named `base_dt1[_dt2]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct KernelKey {
    pub module: Module,
    pub base: &'static str,
    pub dtypes: [Option<DType>; 2],
}

impl KernelKey {
    pub fn new(module: Module, base: &'static str, dtype: DType) -> KernelKey {
        KernelKey {
            module,
            base,
            dtypes: [Some(dtype), None],
        }
    }

    pub fn with2(module: Module, base: &'static str, d1: DType, d2: DType) -> KernelKey {
        KernelKey {
            module,
            base,
            dtypes: [Some(d1), Some(d2)],
        }
    }

    pub fn plain(module: Module, base: &'static str) -> KernelKey {
        KernelKey {
            module,
            base,
            dtypes: [None, None],
        }
    }

    /// The `extern "C"` name in the source.
    pub fn symbol(&self) -> String {
        let mut s = self.base.to_string();
        for d in self.dtypes.iter().flatten() {
            s.push('_');
            s.push_str(dtype_suffix(*d));
        }
        s
    }
}

/// Kernels see at most this many dims per operand (`EMBER_MAX_DIMS` in the prelude).
pub(crate) const MAX_DIMS: usize = 8;

/// The `Strided` struct of the prelude: a shape shared by up to three operands and each one's
/// strides in elements (0 on broadcast dims). Same field order and size (264 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelShape {
    pub ndim: i32,
    pad: i32,
    pub size: [i64; MAX_DIMS],
    pub stride: [[i64; MAX_DIMS]; 3],
}

impl KernelShape {
    /// The shape `dims` with one stride list per operand (at most 3, each `dims.len()` long),
    /// after dropping size-1 dims and merging neighbours that are contiguous in every operand;
    /// an error when more than [`MAX_DIMS`] dims remain.
    pub fn new(op: &'static str, dims: &[usize], strides: &[&[usize]]) -> Result<KernelShape> {
        debug_assert!(strides.len() <= 3 && strides.iter().all(|s| s.len() == dims.len()));
        // Fixed-size scratch (no heap allocation: this runs on every elementwise launch); a
        // view with more unmergeable dims than MAX_DIMS is counted and refused below.
        let mut size = [1i64; MAX_DIMS];
        let mut st = [[0i64; MAX_DIMS]; 3];
        let mut ndim = 0usize;
        for d in 0..dims.len() {
            if dims[d] == 1 {
                continue;
            }
            let mergeable = ndim > 0
                && ndim <= MAX_DIMS
                && strides
                    .iter()
                    .zip(&st)
                    .all(|(s, kept)| kept[ndim - 1] == (s[d] * dims[d]) as i64);
            if mergeable {
                size[ndim - 1] *= dims[d] as i64;
                for (kept, s) in st.iter_mut().zip(strides) {
                    kept[ndim - 1] = s[d] as i64;
                }
            } else {
                if ndim < MAX_DIMS {
                    size[ndim] = dims[d] as i64;
                    for (kept, s) in st.iter_mut().zip(strides) {
                        kept[ndim] = s[d] as i64;
                    }
                }
                ndim += 1;
            }
        }
        if ndim > MAX_DIMS {
            return Err(Error::invalid(
                op,
                format!(
                    "CUDA kernels take at most {MAX_DIMS} dims that cannot be merged, this view has more; \
                     call .contiguous() on a reshaped copy first",
                ),
            ));
        }
        let shape = KernelShape {
            ndim: ndim as i32,
            pad: 0,
            size,
            stride: st,
        };
        Ok(shape)
    }

    /// True when operand `which` is row-major contiguous over the whole shape.
    pub fn is_contiguous(&self, which: usize) -> bool {
        let mut expected = 1i64;
        for d in (0..self.ndim as usize).rev() {
            if self.stride[which][d] != expected {
                return false;
            }
            expected *= self.size[d];
        }
        true
    }

    /// The two-operand copy of `elem`-byte elements over this shape as a copy of 8-byte words
    /// (Note [Copies in words]), when the innermost dim is contiguous in both operands and every
    /// size, stride and address (`addrs`, in bytes) divides into words; else `None`.
    pub fn in_words(&self, elem: usize, addrs: [u64; 2]) -> Option<KernelShape> {
        if elem >= 8 || self.ndim == 0 || addrs.iter().any(|a| a % 8 != 0) {
            return None;
        }
        let per = (8 / elem) as i64;
        let last = self.ndim as usize - 1;
        let divides = |which: usize| {
            self.stride[which][last] == 1 && self.stride[which][..last].iter().all(|s| s % per == 0)
        };
        if self.size[last] % per != 0 || !divides(0) || !divides(1) {
            return None;
        }
        let mut words = *self;
        words.size[last] /= per;
        for which in 0..2 {
            for s in &mut words.stride[which][..last] {
                *s /= per;
            }
        }
        Some(words)
    }

    /// True when operand `which` is the same element for every index (a broadcast scalar).
    pub fn is_scalar(&self, which: usize) -> bool {
        self.stride[which][..self.ndim as usize].iter().all(|&s| s == 0)
    }
}

/// A value a kernel takes by value: plain data whose layout matches the C parameter type.
///
/// # Safety
/// Implementors must be `repr(C)` or primitive types with the size and alignment of the C type
/// the kernels declare for them.
pub(crate) unsafe trait KernelParam {}
// SAFETY: primitives with their C counterparts' size and alignment (u64 also carries
// CUdeviceptr); KernelShape is repr(C) matching the prelude's `Strided`.
unsafe impl KernelParam for u64 {}
unsafe impl KernelParam for i64 {}
unsafe impl KernelParam for u32 {}
unsafe impl KernelParam for i32 {}
unsafe impl KernelParam for u16 {}
unsafe impl KernelParam for u8 {}
unsafe impl KernelParam for f32 {}
unsafe impl KernelParam for f64 {}
unsafe impl KernelParam for KernelShape {}
// The repr(C) structs kernels take implement it beside their definitions: `TensorList`
// (`optim.rs`), `AmpTensorList` (`amp.rs`), `CopyList` (`multi_copy.rs`), `PhiloxArgs`
// (`random.rs`), `ErrorCheck` (`device_errors.rs`); `launch.rs` names them under their C names.

/// Grid and block sizes and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grid {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl Grid {
    /// A 1-D launch for a grid-stride loop over `n` items, `block` threads per block, at most
    /// enough blocks to fill the device a few times over.
    pub fn linear(rt: &DeviceRuntime, n: usize, block: u32) -> Grid {
        let max_blocks = rt.sm_count as usize * 16;
        let blocks = n.div_ceil(block as usize).clamp(1, max_blocks);
        Grid {
            grid: (blocks as u32, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        }
    }
}

impl Grid {
    /// The launch of a multi-tensor kernel (the fused optimizer steps, GradScaler's unscale,
    /// `multi_copy`): 256-thread blocks taking the list's `chunks` grid-stride, at most 8 per
    /// SM (8 such blocks fill an H100 SM's 2048 threads).
    pub fn multi_tensor(rt: &DeviceRuntime, chunks: usize) -> Grid {
        Grid {
            grid: (chunks.clamp(1, rt.sm_count as usize * 8) as u32, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        }
    }

    /// A 1-D launch of exactly enough `block`-thread blocks for `n` threads (for kernels whose
    /// threads each take a fixed share of the work, e.g. the vectorized elementwise loops).
    pub fn exact(n: usize, block: u32) -> Grid {
        let blocks = n.div_ceil(block as usize).clamp(1, i32::MAX as usize);
        Grid {
            grid: (blocks as u32, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// Room for one launch's parameters, aligned for any parameter type (the driver's limit on
/// Hopper is 32 KiB; ember's largest, a fused optimizer's tensor list, takes under 4 KiB).
const PARAM_BYTES: usize = 8192;

#[repr(C, align(16))]
struct ParamBuffer([std::mem::MaybeUninit<u8>; PARAM_BYTES]);

/// Launches `f` on `stream` with `params`, each a reference to one kernel parameter in the
/// order the kernel declares them. Ops reach it through the typed launchers of `launch.rs`
/// (Note [Typed launchers]), which build `params` from a kernel's one declaration; `unary.rs`
/// and `elementwise.rs` still call it directly.
///
/// Note [Launch parameters]: the parameters are packed into one buffer as the kernel's C
/// signature lays them out (each at the next multiple of its alignment) and handed to
/// cuLaunchKernel with `CU_LAUNCH_PARAM_BUFFER_POINTER`, instead of as an array of pointers
/// the driver walks parameter by parameter. Launching is most of the host cost of a small op
/// (about 3-4 us per cuLaunchKernel on the H100 machine), and the packed form measured
/// 80-380 ns less per launch there than the pointer array, for the elementwise kernels'
/// 304 bytes of parameters.
///
/// # Safety
/// `params` must match the kernel's C signature in number, order and type; every device
/// pointer among them must be valid for the accesses the kernel makes, for as long as the
/// stream takes to run it (the caching allocator keeps freed blocks for reuse only on their own
/// stream, so buffers used on the current stream satisfy this); `f` must belong to the context
/// of the device `stream` is on, and that context must be current on this thread.
pub(super) unsafe fn launch(f: Function, grid: Grid, stream: u64, params: &[&dyn KernelParam]) -> Result<()> {
    super::kernel_timing::note_work(stream);
    let mut buf = ParamBuffer([std::mem::MaybeUninit::uninit(); PARAM_BYTES]);
    let mut size = 0usize;
    for &p in params {
        let (bytes, align) = (std::mem::size_of_val(p), std::mem::align_of_val(p));
        let at = size.next_multiple_of(align);
        if at + bytes > PARAM_BYTES {
            return Err(Error::Cuda {
                op: "kernel launch",
                msg: format!("the parameters take more than {PARAM_BYTES} bytes"),
            });
        }
        // SAFETY: `p` is `bytes` readable bytes (a KernelParam is plain data); the destination
        // range lies inside `buf` (checked above) and does not overlap `p`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                p as *const dyn KernelParam as *const u8,
                buf.0.as_mut_ptr().add(at).cast::<u8>(),
                bytes,
            );
        }
        size = at + bytes;
    }
    let as_ptr = |tag: u32| tag as usize as *mut c_void;
    let mut extra = [
        as_ptr(sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT),
        buf.0.as_mut_ptr().cast::<c_void>(),
        as_ptr(sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT),
        (&mut size as *mut usize).cast::<c_void>(),
        as_ptr(sys::CU_LAUNCH_PARAM_END_AS_INT),
    ];
    // SAFETY: the caller's contract; `extra` describes `size` initialized bytes of `buf`, laid
    // out as the kernel's parameters (the padding between them is never read).
    unsafe {
        sys::cuLaunchKernel(
            f.0,
            grid.grid.0,
            grid.grid.1,
            grid.grid.2,
            grid.block.0,
            grid.block.1,
            grid.block.2,
            grid.shared_bytes,
            stream as sys::CUstream,
            std::ptr::null_mut(),
            extra.as_mut_ptr(),
        )
    }
    .result()
    .map_err(|e| Error::Cuda {
        op: "kernel launch",
        msg: format!("{e:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_shape_merges_contiguous_dims_and_drops_ones() {
        // [2, 1, 3, 4] contiguous (strides 12, 12, 4, 1) and a broadcast row (0, 0, 0, 1).
        let s = KernelShape::new("t", &[2, 1, 3, 4], &[&[12, 12, 4, 1], &[0, 0, 0, 1]]).unwrap();
        assert_eq!(s.ndim, 2);
        assert_eq!(&s.size[..2], &[6, 4]);
        assert_eq!(&s.stride[0][..2], &[4, 1]);
        assert_eq!(&s.stride[1][..2], &[0, 1]);
        assert!(s.is_contiguous(0) && !s.is_contiguous(1) && !s.is_scalar(1));
        // A transposed operand keeps both dims.
        let t = KernelShape::new("t", &[3, 4], &[&[1, 3]]).unwrap();
        assert_eq!(
            (t.ndim, t.size[0], t.size[1], t.stride[0][0], t.stride[0][1]),
            (2, 3, 4, 1, 3)
        );
        assert_eq!(std::mem::size_of::<KernelShape>(), 264);
        let scalar = KernelShape::new("t", &[5, 7], &[&[0, 0]]).unwrap();
        assert!(scalar.is_scalar(0));
    }

    #[test]
    fn too_many_dims_is_an_error() {
        let dims = [2usize; 10];
        let strides: Vec<usize> = (0..10).map(|i| 1usize << (2 * (9 - i) + 1)).collect();
        assert!(matches!(
            KernelShape::new("t", &dims, &[&strides]),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn kernel_symbols() {
        assert_eq!(
            KernelKey::new(Module::Elementwise, "binary_add", DType::BF16).symbol(),
            "binary_add_bf16"
        );
        assert_eq!(
            KernelKey::with2(Module::Copy, "cast", DType::F32, DType::I64).symbol(),
            "cast_f32_i64"
        );
    }
}
