//! Typed kernel launchers: the parameter list of every kernel family, declared once in
//! `kernels!` below, and what each declaration generates: a safe Rust launcher taking those
//! parameters, and the C parameter list the `.cu` file defines its kernels with.
//!
//! Note [Typed launchers]: a kernel's signature is written in one place, its family's entry in
//! `kernels!` under its module: `name<T, ..>(param: Kind, ..);` for a family of one kernel
//! (`name_<dtypes>` in the source), `name<T, ..>(param: Kind, ..) in [kernel, ..];` for a family
//! of several kernels with one signature (`kernel_<dtypes>`, e.g. `gather_w1_i64`). From it come
//! - the launcher `launch::name(rt, dtypes, grid, params..)`, or `launch::name(rt, kernel,
//!   dtypes, grid, params..)` with `kernel` one of the constants `launch::name::<kernel>`,
//!   which looks the kernel up (with the dtypes of its symbol) in the family's module and
//!   launches it on the current stream of `rt`'s device through `kernels::launch` (Note [Launch
//!   parameters]), the only `unsafe` block in it;
//! - the C macro `EMBER_PARAMS_name(T, ..)`, which expands to the parenthesized parameter list,
//!   e.g. `(const T* x, T* out, i64 n)`, collected in [`PARAMS_HEADER`], which `nvrtc.rs`
//!   compiles after the prelude and before every source (so it is part of the hashed text,
//!   Note [Kernel cache]). A kernel is defined as
//!   `extern "C" __global__ void softmax_##name EMBER_PARAMS_softmax(T) { ... }`.
//!
//! So a launch site with a wrong count, order or type of arguments does not compile, and a
//! kernel body that uses a parameter the declaration does not have does not compile with NVRTC
//! (CI compiles every source: `every_kernel_source_compiles_with_nvrtc`). A test below checks
//! that every kernel of every source is declared with its family's macro and that every
//! family names kernels its module has.
//!
//! Parameter kinds (a closed set): `In<P>` / `Out<P>` a pointer to elements of `P` the kernel
//! reads / writes (and may read), given as a [`DevPtr`] / [`DevPtrMut`]; `OptIn<P>` /
//! `OptOut<P>` the same or null (`Option`); `i64 i32 u64 u32 u8 f64 f32` by value (C `i64 ..
//! double float`); `Strided` the prelude's struct, given as a `&KernelShape`; and the `repr(C)`
//! structs that implement [`KernelParam`] under the C struct's name (`TensorList`,
//! `AmpTensorList`, `CopyList`, `ErrorCheck`, `PhiloxArgs`), given by reference. `P` is a
//! template parameter of the family or a scalar type (`f32` is C `float`, `f64` `double`).
//!
//! What a launcher checks and what it leaves to its caller: the parameter list matches the
//! kernel (by construction, above), and every device pointer comes from a live storage: only
//! `CudaStorage` hands out `DevPtr`s (their constructor is `unsafe`), and they borrow the
//! storage, so it outlives the launch call; the caching allocator reuses a freed block only in
//! its stream's order, after the kernels enqueued before the free. The list structs carry
//! addresses too, as u64 fields private to the one module that fills them: `optim.rs` and
//! `amp.rs` from `DevPtr`s, `multi_copy.rs` under its `unsafe fn`'s contract, `random.rs` from
//! the generator's capture slots, `device_errors.rs` from the runtime's error records. What a
//! launcher cannot check is that the sizes, strides and offsets passed keep the kernel inside
//! those storages: each family's doc says what its kernels index, and each call site computes
//! the sizes from the layouts of the storages it passes.

use super::amp::AmpTensorList;
use super::device_errors::ErrorCheck;
use super::kernels::{launch, Grid, KernelKey, KernelParam, KernelShape, Module};
use super::multi_copy::CopyList;
use super::optim::TensorList;
use super::random::PhiloxArgs;
use super::runtime::DeviceRuntime;
use super::stream::current_raw;
use crate::backend::op::{BinaryOp, CmpOp, LogicalOp, UnaryOp};
use crate::{DType, Error, Result};
use std::marker::PhantomData;

/// The device address of an operand a kernel reads, borrowed from the storage it lies in
/// (`CudaStorage::dev_ptr`): what an `In<P>` parameter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevPtr<'a> {
    addr: u64,
    storage: PhantomData<&'a ()>,
}

/// The device address of an operand a kernel writes (and may read), borrowed from the storage
/// it lies in (`CudaStorage::dev_ptr_mut`): what an `Out<P>` parameter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevPtrMut<'a> {
    addr: u64,
    storage: PhantomData<&'a ()>,
}

impl<'a> DevPtr<'a> {
    /// # Safety
    /// `addr` lies in device memory that stays allocated for `'a` and is reused after that only
    /// in the order of the stream kernels are launched on (a caching-allocator block of a
    /// storage borrowed for `'a`); the address of an operand with no elements may lie past the
    /// block's end (no kernel dereferences it).
    pub(super) unsafe fn new(addr: u64) -> DevPtr<'a> {
        DevPtr {
            addr,
            storage: PhantomData,
        }
    }

    pub(crate) fn addr(self) -> u64 {
        self.addr
    }
}

impl<'a> DevPtrMut<'a> {
    /// # Safety
    /// As [`DevPtr::new`], for memory the kernel may write.
    pub(super) unsafe fn new(addr: u64) -> DevPtrMut<'a> {
        DevPtrMut {
            addr,
            storage: PhantomData,
        }
    }

    pub(crate) fn addr(self) -> u64 {
        self.addr
    }

    /// The same operand, passed where the kernel only reads it.
    pub(crate) fn read_only(self) -> DevPtr<'a> {
        DevPtr {
            addr: self.addr,
            storage: PhantomData,
        }
    }

    /// The address `bytes` further on, in the same storage: keeping it inside is the caller's
    /// part, as for the sizes it passes (see the module docs).
    pub(crate) fn add_bytes(self, bytes: usize) -> DevPtrMut<'a> {
        DevPtrMut {
            addr: self.addr + bytes as u64,
            storage: PhantomData,
        }
    }
}

/// The key of kernel `name` with the dtypes of its symbol (`softmax_f32`, `cast_contig_f32_i64`,
/// `fill_u64` with none).
fn kernel_key(module: Module, name: &'static str, dtypes: &[DType]) -> Result<KernelKey> {
    Ok(match *dtypes {
        [] => KernelKey::plain(module, name),
        [d] => KernelKey::new(module, name, d),
        [a, b] => KernelKey::with2(module, name, a, b),
        _ => {
            return Err(Error::Cuda {
                op: "kernel launch",
                msg: format!("{name}: kernel names carry at most two dtypes"),
            })
        }
    })
}

/// Launches kernel `key` of `rt`'s device on its current stream with `params`.
///
/// # Safety
/// As `kernels::launch`: `params` match the kernel's C signature, and every device pointer
/// among them is valid for the kernel's accesses in stream order.
#[inline]
unsafe fn run(rt: &DeviceRuntime, key: KernelKey, grid: Grid, params: &[&dyn KernelParam]) -> Result<()> {
    let f = rt.function(key)?;
    // SAFETY: the caller's contract; `f` is loaded in `rt`'s context, which `runtime()` made
    // current on this thread, and the stream is that device's current one.
    unsafe { launch(f, grid, current_raw(rt.ordinal), params) }
}

/// The Rust type a launcher takes for a parameter kind.
macro_rules! rust_type {
    (In<$e:ident>) => { DevPtr<'_> };
    (Out<$e:ident>) => { DevPtrMut<'_> };
    (OptIn<$e:ident>) => { Option<DevPtr<'_>> };
    (OptOut<$e:ident>) => { Option<DevPtrMut<'_>> };
    (Strided) => { &KernelShape };
    (i64) => { i64 };
    (i32) => { i32 };
    (u64) => { u64 };
    (u32) => { u32 };
    (u8) => { u8 };
    (f64) => { f64 };
    (f32) => { f32 };
    ($t:ident) => { &$t };
}

/// A launcher's parameter as the kernel takes it (pointers as their u64 address, 0 for null).
#[rustfmt::skip]
macro_rules! kernel_arg {
    (In, $v:ident) => { &$v.addr() };
    (Out, $v:ident) => { &$v.addr() };
    (OptIn, $v:ident) => { &$v.map_or(0, DevPtr::addr) };
    (OptOut, $v:ident) => { &$v.map_or(0, DevPtrMut::addr) };
    (i64, $v:ident) => { &$v };
    (i32, $v:ident) => { &$v };
    (u64, $v:ident) => { &$v };
    (u32, $v:ident) => { &$v };
    (u8, $v:ident) => { &$v };
    (f64, $v:ident) => { &$v };
    (f32, $v:ident) => { &$v };
    ($t:ident, $v:ident) => { $v };
}

/// The C spelling of an element or scalar type (the prelude typedefs `i64 u64 i32 u32 u8`).
#[rustfmt::skip]
macro_rules! c_type {
    (f32) => { "float" };
    (f64) => { "double" };
    ($t:ident) => { stringify!($t) };
}

/// One parameter of a C parameter list.
#[rustfmt::skip]
macro_rules! c_param {
    (In<$e:ident>, $p:ident) => { concat!("const ", c_type!($e), "* ", stringify!($p)) };
    (OptIn<$e:ident>, $p:ident) => { concat!("const ", c_type!($e), "* ", stringify!($p)) };
    (Out<$e:ident>, $p:ident) => { concat!(c_type!($e), "* ", stringify!($p)) };
    (OptOut<$e:ident>, $p:ident) => { concat!(c_type!($e), "* ", stringify!($p)) };
    ($t:ident, $p:ident) => { concat!(c_type!($t), " ", stringify!($p)) };
}

/// `#define EMBER_PARAMS_<family>(<template params>) (<C parameter list>)`.
macro_rules! c_define {
    ($name:ident $(<$($tp:ident),+>)? ($p0:ident : $k0:ident $(<$e0:ident>)? $(, $p:ident : $k:ident $(<$e:ident>)?)*)) => {
        concat!(
            "#define EMBER_PARAMS_", stringify!($name), $("(", stringify!($($tp),+), ")",)? " (",
            c_param!($k0 $(<$e0>)?, $p0) $(, ", ", c_param!($k $(<$e>)?, $p))*,
            ")\n"
        )
    };
}

/// The launcher of one family: of its one kernel `name`, or of the kernels listed in `[..]`,
/// named by the constants of the module `name` (`launch::gather::gather_w4`).
macro_rules! launcher {
    ($module:ident; $(#[$attr:meta])* $name:ident ($($p:ident : $k:ident $(<$e:ident>)?),+)) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name(rt: &DeviceRuntime, dtypes: &[DType], grid: Grid, $($p: rust_type!($k $(<$e>)?)),+) -> Result<()> {
            let key = kernel_key(Module::$module, stringify!($name), dtypes)?;
            launch_with!(rt, key, grid, $($k $p),+)
        }
    };
    ($module:ident; $(#[$attr:meta])* $name:ident ($($p:ident : $k:ident $(<$e:ident>)?),+) [$($kernel:ident),+]) => {
        /// The kernels of the family of the same name.
        #[allow(non_upper_case_globals)]
        pub(crate) mod $name {
            /// One kernel of the family: only the constants below are values of this type.
            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            pub(crate) struct Name(pub(super) &'static str);
            $(pub(crate) const $kernel: Name = Name(stringify!($kernel));)+
        }
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name(
            rt: &DeviceRuntime,
            kernel: $name::Name,
            dtypes: &[DType],
            grid: Grid,
            $($p: rust_type!($k $(<$e>)?)),+
        ) -> Result<()> {
            let key = kernel_key(Module::$module, kernel.0, dtypes)?;
            launch_with!(rt, key, grid, $($k $p),+)
        }
    };
}

/// The launcher of a family whose kernels an op table names: `op.kernel()`, for `op` of
/// the table's enum (`UnaryOp`, `BinaryOp`, ...), so only that family's kernels are reachable.
macro_rules! op_launcher {
    ($module:ident; $(#[$attr:meta])* $name:ident ($($p:ident : $k:ident $(<$e:ident>)?),+) $op:ident) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name(
            rt: &DeviceRuntime,
            op: $op,
            dtypes: &[DType],
            grid: Grid,
            $($p: rust_type!($k $(<$e>)?)),+
        ) -> Result<()> {
            let key = kernel_key(Module::$module, op.kernel(), dtypes)?;
            launch_with!(rt, key, grid, $($k $p),+)
        }
    };
}

/// The body of every launcher: its parameters, packed, to kernel `key` of its family.
macro_rules! launch_with {
    ($rt:ident, $key:ident, $grid:ident, $($k:ident $p:ident),+) => {
        // SAFETY: the parameters are the family's, in declaration order, each of the Rust type
        // `rust_type!` gives its kind and passed as the C type `c_param!` writes for it (u64
        // for pointers, the primitives, the `repr(C)` structs behind `KernelParam`); `key` is a
        // kernel of this family (made from the family's module and one of its kernel names),
        // and the `.cu` file defines the family's kernels with `EMBER_PARAMS_<family>`, the
        // list generated from this same declaration (checked by the tests below and NVRTC).
        // Every device pointer is a `DevPtr`/`DevPtrMut` borrowed from a storage alive for this
        // call, whose block the caching allocator reuses only in stream order after this launch;
        // the call site's sizes keep the kernel inside those storages (module docs).
        unsafe { run($rt, $key, $grid, &[$(kernel_arg!($k, $p)),+]) }
    };
}

/// The kernel names of a family, for the tests.
#[cfg(test)]
macro_rules! names {
    ($name:ident) => { vec![stringify!($name)] };
    ($name:ident [$($kernel:ident),+]) => { vec![$(stringify!($kernel)),+] };
    ($name:ident by $op:ident) => { $op::ALL.iter().map(|op| op.kernel()).collect() };
}

/// A family's launcher: of one kernel, of a list, or of an op table's kernels.
macro_rules! family_launcher {
    ($module:ident; $(#[$attr:meta])* $name:ident ($($params:tt)+) by $op:ident) => {
        op_launcher! { $module; $(#[$attr])* $name ($($params)+) $op }
    };
    ($module:ident; $(#[$attr:meta])* $name:ident ($($params:tt)+) $($list:tt)?) => {
        launcher! { $module; $(#[$attr])* $name ($($params)+) $($list)? }
    };
}

/// Declares kernel families, grouped by module (kernel source): see Note [Typed launchers].
macro_rules! kernels {
    ($(
        $module:ident {
            $(
                $(#[$attr:meta])*
                $name:ident $(<$($tp:ident),+>)? ($($p:ident : $k:ident $(<$e:ident>)?),+ $(,)?)
                    $(in [$($kernel:ident),+ $(,)?])? $(by $op:ident)?;
            )*
        }
    )*) => {
        $($(
            family_launcher! { $module; $(#[$attr])* $name ($($p : $k $(<$e>)?),+) $([$($kernel),+])? $(by $op)? }
        )*)*

        /// The C parameter list of every kernel family as a macro `EMBER_PARAMS_<family>`,
        /// compiled between the prelude and every kernel source (Note [Typed launchers]).
        pub(crate) const PARAMS_HEADER: &str = concat!(
            "// Kernel parameter lists, generated from `kernels!` in `cuda_backend/launch.rs`.\n",
            $($(c_define!($name $(<$($tp),+>)? ($($p : $k $(<$e>)?),+)),)*)*
        );

        /// Every family: its module, name and kernel names.
        #[cfg(test)]
        fn families() -> Vec<(Module, &'static str, Vec<&'static str>)> {
            vec![$($((Module::$module, stringify!($name), names!($name $([$($kernel),+])? $(by $op)?)),)*)*]
        }
    };
}

/// Declares the `variant` argument of a reduction kernel, once: a Rust enum per op kind, and
/// the C names of its values in [`VARIANTS_HEADER`], compiled after the parameter lists, so
/// `reduce.cu` says `SUM_MEAN` where it reads the variant and no number is written twice.
macro_rules! reduce_variants {
    ($($enum:ident { $($v:ident = $n:literal $c:literal,)* })*) => {
        $(
            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            #[repr(i32)]
            pub(crate) enum $enum {
                $($v = $n,)*
            }
        )*

        /// The C names of every reduction variant (`#define SUM_MEAN 1`, ...).
        pub(crate) const VARIANTS_HEADER: &str = concat!(
            "// Reduction variants, generated from `reduce_variants!` in `cuda_backend/launch.rs`.\n",
            $($("#define ", $c, " ", $n, "\n",)*)*
        );
    };
}

reduce_variants! {
    SumVariant {
        Sum = 0 "SUM_PLAIN",
        Mean = 1 "SUM_MEAN",
        L2 = 2 "SUM_L2",
        L1 = 3 "SUM_L1",
        L0 = 4 "SUM_L0",
        Lp = 5 "SUM_LP",
    }
    MinmaxVariant {
        Max = 0 "MINMAX_MAX",
        Min = 1 "MINMAX_MIN",
        MaxAbs = 2 "MINMAX_MAX_ABS",
        MinAbs = 3 "MINMAX_MIN_ABS",
    }
    ArgVariant {
        Max = 0 "ARG_MAX",
        Min = 1 "ARG_MIN",
    }
    VarVariant {
        Var = 0 "VAR_VAR",
        Std = 1 "VAR_STD",
    }
}

kernels! {
    Unary {
        /// `out[i] = op(x[i])` for the `n` elements of the view `s` (`s.stride[0]` x's strides),
        /// out row-major; `c0..c2` the op's parameters (`UnaryOp::kernel_params`, rounded to
        /// the compute type once; integer kernels ignore them); `mode` 0 for a row-major x
        /// (16-byte vector loads and stores where both are aligned), 1 for any strides.
        /// Grid-stride, any grid. One kernel per op of the unary table and dtype.
        unary<T>(x: In<T>, out: Out<T>, s: Strided, n: i64, c0: f64, c1: f64, c2: f64, mode: i32) by UnaryOp;
    }
    Elementwise {
        /// `out[i] = op(a[i], b[i])` over the `n` elements of the broadcast shape `s`
        /// (`s.stride[0]` a's strides, `[1]` b's), out row-major; `out` may be `a` itself
        /// (in-place ops: each element is read before the same thread writes it). `mode`: 0
        /// both row-major, 1 `b` one broadcast element, 2 `a` one broadcast element (16-byte
        /// vectors where aligned, one thread per 4 vectors), 3 any strides (grid-stride).
        /// Integer pow takes non-negative exponents (checked first by `check_pow_exponent`).
        binary<T>(a: In<T>, b: In<T>, out: Out<T>, s: Strided, n: i64, mode: i32) by BinaryOp;
        /// As `binary` for a float32 operand beside a float16 or bfloat16 one (`A`, `B` either
        /// way), computed and written in float32 (Note [Mixed operands] in `elementwise.cu`);
        /// ops promoted with `CommonMixed` only. Grid-stride, any grid.
        binary_mixed<A, B>(a: In<A>, b: In<B>, out: Out<f32>, s: Strided, n: i64, mode: i32) by BinaryOp;
        /// As `binary`, giving bool.
        compare<T>(a: In<T>, b: In<T>, out: Out<bool>, s: Strided, n: i64, mode: i32) by CmpOp;
        /// As `binary`, on bool operands.
        logical(a: In<bool>, b: In<bool>, out: Out<bool>, s: Strided, n: i64, mode: i32) by LogicalOp;
        /// `out[i] = cond[i] ? a[i] : b[i]` over the `n` elements of `s` (`stride[0]` a,
        /// `[1]` b, `[2]` cond), out row-major. Grid-stride.
        where_select<T>(cond: In<bool>, a: In<T>, b: In<T>, out: Out<T>, s: Strided, n: i64);
        /// Records the first negative of the `n` integer exponents at `s.stride[0]` in the
        /// device's error record (Note [Deferred device errors] in `device_errors.rs`);
        /// blockDim.x a multiple of 32.
        check_pow_exponent<I>(b: In<I>, s: Strided, n: i64, check: ErrorCheck);
    }
    Copy {
        /// `dst[i] = cast(src[i])` for `i < n`, both row-major (casts as the CPU backend's: float
        /// to int truncates toward zero, anything to bool is `!= 0`, f16/bf16 round to nearest
        /// even). Grid-stride, any grid.
        cast_contig<S, D>(src: In<S>, dst: Out<D>, n: i64);
        /// As `cast_contig` over `n` elements of the shape `s`: `s.stride[0]` the source's
        /// strides, `s.stride[1]` the destination's.
        cast_strided<S, D>(src: In<S>, dst: Out<D>, s: Strided, n: i64);
        /// `dst[i] = word` for `i < n` (fills of 8-byte dtypes).
        fill_u64(dst: Out<u64>, word: u64, n: i64);
        /// `dst[i] = start + i * step` for `i < n` (`arange` of int64 on the device).
        arange_i64(dst: Out<i64>, start: i64, step: i64, n: i64);
        /// For every `t < l.n`, `l.len[t]` bytes (`l.kind[t]` EMBER_COPY_BYTES) or `l.len[t]`
        /// elements cast between f32, bf16 and f16 (EMBER_COPY_CAST(src, dst)) from `l.src[t]`
        /// to `l.dst[t]`; no destination overlaps another destination or any source;
        /// `chunk_start[t]` is the prefix count of `len[t].div_ceil(EMBER_COPY_CHUNK)` for a
        /// byte copy, `len[t].div_ceil(EMBER_CAST_CHUNK)` for a cast; blockDim.x a multiple of
        /// 32.
        multi_copy(l: CopyList);
    }
    Reduce {
        /// The first pass of a reduction (Note [CUDA reduction plans], `reduce.cu`): `m`
        /// outputs over `outer`, `k` elements each over `inner` (`stride[0]` the input's), in
        /// chunks of `chunk`; `row` 1 for row mode; `variant` and `param` as `reduce.cu` lists
        /// per op. `R` is the result type (T, or i64 for integer sums and products), `S` the op's
        /// state (at most 32 bytes). With `partial` null it writes `out[o]` (and `idx[o]` for the
        /// arg ops; either may be null there), else only `partial[o * gridDim.y + blockIdx.y]`.
        /// Dynamic shared memory: bx * by states.
        reduce<T, R, S>(
            x: In<T>,
            outer: Strided,
            inner: Strided,
            m: i64,
            k: i64,
            chunk: i64,
            row: i32,
            variant: i32,
            param: f64,
            out: OptOut<R>,
            idx: OptOut<i64>,
            partial: OptOut<S>,
        ) in [reduce_sum, reduce_prod, reduce_minmax, reduce_arg, reduce_lse, reduce_var];
        /// The second pass: combines the `splits` partial states of each of `m` outputs in order
        /// into `out` / `idx` (as the first pass). Row mode, by = 1, grid.y = 1.
        reduce_final<R, S>(
            partial: In<S>,
            m: i64,
            splits: i64,
            variant: i32,
            param: f64,
            out: OptOut<R>,
            idx: OptOut<i64>,
        ) in [
            reduce_sum_final,
            reduce_prod_final,
            reduce_minmax_final,
            reduce_arg_final,
            reduce_lse_final,
            reduce_var_final,
        ];
        /// Column sums (`reduce.cu`'s `cols_sum`): `m` contiguous columns of `k` rows
        /// `row_stride` apart, summed in A = Acc<T>; rows in chunks of `chunk` over gridDim.y;
        /// with `partial` null it writes `out[c]`, else only `partial[blockIdx.y * m + c]`.
        /// m and row_stride multiples of 16 / sizeof(T), x 16-byte aligned, blockDim.y a power
        /// of two; dynamic shared memory: bx * by * (16 / sizeof(T)) A's.
        reduce_cols_sum<T, A>(
            x: In<T>,
            row_stride: i64,
            m: i64,
            k: i64,
            chunk: i64,
            out: OptOut<T>,
            partial: OptOut<A>,
        );
        /// The second pass: `out[c]` = the `splits` partial sums of column c added in order.
        reduce_cols_sum_final<T, A>(partial: In<A>, m: i64, splits: i64, out: Out<T>);
    }
    Softmax {
        /// Softmax (`log` 0) or log_softmax (`log` 1) of `nrows` rows of `k` elements: row r
        /// starts at `rows.stride[0]` (x) and `rows.stride[1]` (out) of its index, and advances
        /// by `xs` / `os` along the row (`softmax.cu` for `row` and the block shape). Dynamic
        /// shared memory: bx * by accumulators.
        softmax<T>(x: In<T>, out: Out<T>, rows: Strided, nrows: i64, k: i64, xs: i64, os: i64, log: i32, row: i32);
        /// The input gradient from the output `y` and its gradient `g`; `rows.stride[0..3]` the
        /// row bases of y, g and out, `ys` / `gs` / `os` their strides along the row.
        softmax_backward<T>(
            y: In<T>,
            g: In<T>,
            out: Out<T>,
            rows: Strided,
            nrows: i64,
            k: i64,
            ys: i64,
            gs: i64,
            os: i64,
            log: i32,
            row: i32,
        );
    }
    Index {
        /// Records the first of the `n` indices (at `s.stride[0]`) outside `[0, check.size)` in
        /// the device's error record (Note [Index range check on CUDA] in `index.rs`).
        check_index<I>(idx: In<I>, s: Strided, n: i64, check: ErrorCheck);
        /// gather / index_select of elements of E (the `_wB` kernel moves B-byte elements) over
        /// the output shape W (`n` positions, row-major out): `out[i] = x[base + v * dim_stride]`
        /// with `s.stride[0]` the base of x and `s.stride[1]` the index position; indices
        /// outside `[0, size)` are skipped.
        gather<E, I>(x: In<E>, idx: In<I>, out: Out<E>, s: Strided, n: i64, dim_stride: i64, size: i64)
            in [gather_w1, gather_w2, gather_w4, gather_w8];
        /// index_select of a row-major x viewed as `[outer, size, inner]` (inner in B-byte units)
        /// into out `[outer, nidx, inner]`; the index is 1-D with stride `istride`.
        select_rows<E, I>(x: In<E>, idx: In<I>, out: Out<E>, outer: i64, nidx: i64, size: i64, inner: i64, istride: i64)
            in [select_rows_w1, select_rows_w2, select_rows_w4, select_rows_w8, select_rows_w16];
        /// Scatter's first pass: `winner` (one u32 per target element, zeroed) gets the largest
        /// position p + 1 writing each target (`s` as for `scatter`).
        scatter_mark<I>(idx: In<I>, winner: Out<u32>, s: Strided, n: i64, dim_stride: i64, size: i64);
        /// Scatter's second pass over W (the index shape): only the winning position (or every
        /// one, racing, with a null `winner`) writes `src` at `base + v * dim_stride`;
        /// `s.stride[0]` the out base (its row-major strides with dim's set to 0), `[1]` the
        /// index, `[2]` the source.
        scatter<E, I>(
            out: Out<E>,
            idx: In<I>,
            src: In<E>,
            winner: OptIn<u32>,
            s: Strided,
            n: i64,
            dim_stride: i64,
            size: i64,
        ) in [scatter_w1, scatter_w2, scatter_w4, scatter_w8];
        /// scatter_add / index_add with atomics: as `scatter` without the winner; W is the index
        /// shape (scatter_add) or the source's (index_add).
        scatter_add<T, I>(out: Out<T>, idx: In<I>, src: In<T>, s: Strided, n: i64, dim_stride: i64, size: i64);
        /// Sets `out[i * classes + v]` (n * classes int64 zeros, set by the host) for the `n`
        /// indices at `s.stride[0]`; records the first index outside `[0, classes)`.
        one_hot<I>(idx: In<I>, s: Strided, n: i64, classes: i64, out: Out<i64>, check: ErrorCheck);
        /// One block (blockDim.x a multiple of 32, at most 1024): `loss` = Σ -w[t] logp[i, t]
        /// over the rows i of the contiguous `[m, c]` logp whose target t is not `ignore_index`
        /// (divided by `total_weight` = Σ w[t] when `mean`), accumulated in `Acc<T>` in a fixed
        /// order (each thread's rows in turn, then the warps' sums in order); `weight` null
        /// means every class weighs 1; records the first target outside `[0, c)` other than
        /// `ignore_index` (those rows count for nothing).
        nll_loss<T, I>(
            logp: In<T>,
            target: In<I>,
            weight: OptIn<T>,
            m: i64,
            c: i64,
            ignore_index: i64,
            mean: i32,
            loss: Out<T>,
            total_weight: Out<T>,
            check: ErrorCheck,
        );
        /// `grad` (m * c zeros, set by the host): each counted row's target element gets
        /// `-w[t] g[0]` (/ `total_weight[0]` when `mean`).
        nll_loss_backward<T, I>(
            g: In<T>,
            target: In<I>,
            weight: OptIn<T>,
            total_weight: In<T>,
            m: i64,
            c: i64,
            ignore_index: i64,
            mean: i32,
            grad: Out<T>,
        );
    }
    Random {
        /// `n` row-major uniforms in `[low, high)`; `f16_mode` says how the CPU's
        /// `half::f16::from_f64` rounds (`f16_mode` in `random.rs`). Grid-stride over counter
        /// blocks, blockDim.x a multiple of 32.
        uniform<T>(out: Out<T>, n: i64, rng: PhiloxArgs, low: f64, high: f64, f16_mode: i32);
        /// `n` row-major normals of `mean` and `stdev`; `f16_mode` as for `uniform`.
        normal<T>(out: Out<T>, n: i64, rng: PhiloxArgs, mean: f64, stdev: f64, f16_mode: i32);
        /// `n` draws of 1 with probability `p`, else 0.
        bernoulli_p<T>(out: Out<T>, n: i64, rng: PhiloxArgs, p: f64);
        /// `n` draws with the probabilities at `s.stride[0]`; records the first probability
        /// outside [0, 1] (or NaN), its f64 bits as the value.
        bernoulli<T>(prob: In<T>, s: Strided, out: Out<T>, n: i64, rng: PhiloxArgs, check: ErrorCheck);
        /// `n` int64 in `[low, low + range)` (`range` >= 1), wrapping.
        randint(out: Out<i64>, n: i64, rng: PhiloxArgs, low: i64, range: u64);
    }
    Matmul {
        /// Batched integer products `out[b] = a[b] @ b[b]`, wrapping; block (16, 16, 1); `s` the
        /// batch dims (ndim 0 when none), `s.stride[0]` a's batch strides, `[1]` b's;
        /// `a_rs`/`a_cs` (`b_rs`/`b_cs`) the row and column strides of one matrix of a (b).
        matmul<T>(
            a: In<T>,
            b: In<T>,
            out: Out<T>,
            s: Strided,
            batch: i64,
            m: i64,
            k: i64,
            n: i64,
            a_rs: i64,
            a_cs: i64,
            b_rs: i64,
            b_cs: i64,
        );
    }
    Rnn {
        /// One forward LSTM step over `[n, hidden]` (gates `[n, 4 hidden]`), every pointer at the
        /// step's rows; `c_prev` and `c` are different rows of one buffer; `c_copy` may be null.
        lstm_forward<T>(
            gi: In<T>,
            hh: In<T>,
            c_prev: In<T>,
            h: Out<T>,
            c: Out<T>,
            c_copy: OptOut<T>,
            gates: Out<T>,
            n: i64,
            hidden: i64,
        );
        /// One backward LSTM step; `dh_rec` may be null; `dc` is read and written in place by the
        /// same thread.
        lstm_backward<T>(
            dh_out: In<T>,
            dh_rec: OptIn<T>,
            gates: In<T>,
            c: In<T>,
            c_prev: In<T>,
            dc: Out<T>,
            dgates: Out<T>,
            n: i64,
            hidden: i64,
        );
    }
    Optim {
        /// Fused Adam/AdamW over the tensors of `l` (`optim.cu` for the formulas): ptr[0] param,
        /// [1] grad, [2] exp_avg, [3] exp_avg_sq, [4] max_exp_avg_sq (read with amsgrad only),
        /// [5] the f32 step count (read with device steps only), `numel[t]` row-major elements
        /// each. Host steps: scalar[0][t] = bias_correction1, scalar[1][t] =
        /// sqrt(bias_correction2); device steps: both computed in f64 from `*ptr[5][t]` (already
        /// incremented by `increment_steps`) with the device's pow. `grad_scale`, `found_inf`
        /// one f32 or null, `lr_ptr` one f64 replacing `lr` or null (Note [Capturable optimizer
        /// steps]). flags: 1 amsgrad, 2 maximize, 4 decoupled weight decay (AdamW), 8 device
        /// steps, 16 (without amsgrad) ptr[4] is the parameter's bf16 twin or null, written with
        /// each updated element's cast (Note [Cast twins]). Any grid, blockDim.x a multiple of 32.
        adam<T>(
            l: TensorList,
            lr: f64,
            beta1: f64,
            omb1: f64,
            beta2: f64,
            omb2: f64,
            eps: f64,
            wd: f64,
            grad_scale: OptIn<f32>,
            found_inf: OptIn<f32>,
            lr_ptr: OptIn<f64>,
            flags: i32,
        );
        /// Fused SGD: ptr[0] param, [1] grad, [2] momentum_buffer (used when momentum != 0);
        /// pointers as for `adam`; flags: 1 nesterov, 2 maximize, 4 first step (the buffer is set
        /// to the gradient).
        sgd<T>(
            l: TensorList,
            lr: f64,
            momentum: f64,
            omd: f64,
            wd: f64,
            grad_scale: OptIn<f32>,
            found_inf: OptIn<f32>,
            lr_ptr: OptIn<f64>,
            flags: i32,
        );
        /// `*ptr[5][t] += 1` for every `t < l.n` unless `*found_inf` is nonzero; launched before
        /// the `adam` launches of the same tensors, on the same stream.
        increment_steps(l: TensorList, found_inf: OptIn<f32>);
    }
    Amp {
        /// GradScaler's unscale: each of the `numel[t]` row-major elements at `l.ptr[t]` is
        /// multiplied by `*inv_scale` in place, and `*found_inf` set to 1 if any was inf or NaN
        /// (T in f32 f64 f16 bf16; `found_inf` and `inv_scale` one f32 each on the same device).
        /// Any grid, blockDim.x a multiple of 32.
        non_finite_check_and_unscale<T>(l: AmpTensorList, found_inf: Out<f32>, inv_scale: In<f32>);
        /// `torch._foreach_norm`'s first half (`amp.cu`): every chunk of the tensors of `l`
        /// (T in f32 f64 f16 bf16) reduced to one f32, its sum of squares (flags & 1: its
        /// largest |x|), into `partials[c]` for `c < l.chunk_start[l.n]`. Any grid.
        foreach_norm_partials<T>(l: AmpTensorList, partials: Out<f32>, flags: i32);
        /// Its second half: tensor t's chunks' partials, in chunk order, reduced into
        /// `norms[t]` (the square root of their sum; flags & 1: their maximum). Any grid.
        foreach_norm_finish(l: AmpTensorList, partials: In<f32>, norms: Out<f32>, flags: i32);
        /// GradScaler's scale update, one thread (`amp.cu` for the rule).
        update_scale(
            scale: Out<f32>,
            growth_tracker: Out<i32>,
            found_inf: In<f32>,
            growth_factor: f64,
            backoff_factor: f64,
            growth_interval: i32,
        );
    }
    Norm {
        /// Layer normalization of `rows` contiguous rows of `n` elements of x into y, with
        /// optional weight and bias (`n` each, W = T or f32 for a half T), and each row's mean
        /// and rstd (`rows` values of A, the math type) when given (`norm.cu` for the formulas
        /// and the geometry: blockDim (32, warps), a warp a row; `vec` 1 reads 16-byte vectors).
        layer_norm<T, W, A, L>(
            x: In<T>,
            w: OptIn<W>,
            b: OptIn<W>,
            y: Out<T>,
            low: OptOut<L>,
            mean: OptOut<A>,
            rstd: OptOut<A>,
            rows: i64,
            n: i64,
            eps: f64,
            vec: i32,
        );
        /// `add_layer_norm`: sum = x + res (res of dtype R: T, or f16/bf16 beside an f32 T in
        /// `add_layer_norm_mixed_<R>`), rounded to T, written to `sum`, then `layer_norm` of
        /// each row of the sum, with the same operands and geometry (Note [Fused residual add]
        /// in `norm.cu`); with `vec`, res is read as 16-byte vectors too when R is T.
        add_layer_norm<T, R, W, A, L>(
            x: In<T>,
            res: In<R>,
            w: OptIn<W>,
            b: OptIn<W>,
            sum: Out<T>,
            y: Out<T>,
            low: OptOut<L>,
            mean: OptOut<A>,
            rstd: OptOut<A>,
            rows: i64,
            n: i64,
            eps: f64,
            vec: i32,
        ) in [add_layer_norm, add_layer_norm_mixed];
        /// The input gradient dx (when given) of `rows` rows of `n` from the output gradient g,
        /// x, the forward's mean and rstd, and the weight (optional), added to `addend` (rows · n
        /// T's, which may be dx itself) when given; when `partial` is given,
        /// each block writes its rows' sums of g · xhat and g into its row of `partial`
        /// ([gridDim.x, 2n] A's), through shared memory (blockDim.y · 2n A's) when `shared`.
        layer_norm_backward<T, W, A, L>(
            g: In<T>,
            x: In<T>,
            mean: In<A>,
            rstd: In<A>,
            w: OptIn<W>,
            dx: OptOut<T>,
            low: OptOut<L>,
            partial: OptOut<A>,
            rows: i64,
            n: i64,
            vec: i32,
            shared: i32,
            addend: OptIn<T>,
        );
        /// `layer_norm_backward` for rows of at most 768 elements (`LN_LANE_ELEMS` a lane) of a
        /// 4- or 2-byte T, all operands 16-byte aligned and n a multiple of 16 bytes, with
        /// `partial` and the shared memory as there (the sums always in shared memory).
        layer_norm_backward_rows<T, W, A, L>(
            g: In<T>,
            x: In<T>,
            mean: In<A>,
            rstd: In<A>,
            w: OptIn<W>,
            dx: OptOut<T>,
            low: OptOut<L>,
            partial: OptOut<A>,
            rows: i64,
            n: i64,
            addend: OptIn<T>,
        );
        /// dw and db (`n` each, when given) summed in order over the `blocks` rows of `partial`.
        layer_norm_backward_params<W, A>(partial: In<A>, blocks: i64, n: i64, dw: OptOut<W>, db: OptOut<W>);
    }
    Loss {
        /// The fused classifier's forward (`loss.cu`): one block per row of the contiguous
        /// `[n, c]` logits x (grid-stride over rows, blockDim.x a multiple of 32, at most 1024):
        /// `lse[r]`, `row_loss[r]` and `row_weight[r]` (w[t], 0 for a row not counted) in A =
        /// Acc<T>; `weight` null means every class weighs 1; records the first target outside
        /// `[0, c)` other than `ignore_index` (that row counts for nothing).
        cross_entropy<T, I, A>(
            x: In<T>,
            target: In<I>,
            weight: OptIn<A>,
            n: i64,
            c: i64,
            ignore_index: i64,
            smoothing: f64,
            lse: Out<A>,
            row_loss: Out<A>,
            row_weight: Out<A>,
            check: ErrorCheck,
        );
        /// One block (blockDim.x a multiple of 32): `total = [Σ row_weight, Σ_c weight[c]]` and
        /// the loss in O (`mode` 0 `none`: `out[r]` per row; 1 the sum; 2 the sum over
        /// total[0]), A = Acc<O>, in a fixed order.
        cross_entropy_reduce<O, A>(
            row_loss: In<A>,
            row_weight: In<A>,
            weight: OptIn<A>,
            n: i64,
            c: i64,
            mode: i32,
            out: Out<O>,
            total: Out<A>,
        );
        /// The gradient `grad` (`[n, c]` T, every element written) from the logits, the
        /// forward's `lse` and `total`, and the loss gradient `g` (A, at `r * g_stride`);
        /// one block per row as the forward.
        cross_entropy_backward<T, I, A>(
            x: In<T>,
            target: In<I>,
            weight: OptIn<A>,
            lse: In<A>,
            total: In<A>,
            g: In<A>,
            g_stride: i64,
            n: i64,
            c: i64,
            ignore_index: i64,
            smoothing: f64,
            mode: i32,
            grad: Out<T>,
        );
    }
    Index {
        /// Deterministic embedding backward, first pass (`index.cu`): one block of 1024
        /// threads per 1024 positions writes its chunk of `keys` (`n`, u64) as
        /// `idx[p] << 32 | p` sorted ascending.
        embedding_sort<I>(idx: In<I>, n: i64, keys: Out<u64>);
        /// Second pass: `out` (`[rows, d]`, every element written) row r = Σ g[p, :] over the
        /// positions in `keys` with index r, in position order, in Acc<T>; with `add`, the sum
        /// is added to what `out` holds (rows never read untouched); one warp per row,
        /// grid-stride, blockDim.x a multiple of 32.
        embedding_backward<T>(g: In<T>, keys: In<u64>, n: i64, d: i64, rows: i64, out: Out<T>, add: i32);
    }
    Sort {
        /// The device sort's first pass (`sort.cu`, Note [Device sort] in `sort.rs`): block b
        /// sorts chunk `b % chunks` (SORT_CHUNK = 2048 elements) of row `b / chunks` of the
        /// contiguous `[rows, n]` x (T any dtype) as (key, position) pairs, in ascending order
        /// of the keys or, with `descending`, of their complements; blockDim.x = P / 2 for a
        /// power of two P >= the chunk (P <= 2048), P * 12 bytes of dynamic shared memory. The
        /// first min(k, chunk) pairs go to `out` (`[rows, k]` int64 positions) when `chunks`
        /// is 1, else to the chunk's run of min(k, 2048) slots in `keys` / `idx`.
        sort_block<T>(
            x: In<T>,
            n: i64,
            k: i64,
            chunks: i64,
            descending: i32,
            keys: OptOut<u64>,
            idx: OptOut<u32>,
            out: OptOut<i64>,
        );
        /// One merge level: the `runs` runs a row of `keys` / `idx` (run r covers elements
        /// `[r span, (r + 1) span)` of its row and holds its first min(k, covered) pairs in
        /// min(k, span) slots) merged two by two into `keys_out` / `idx_out` (runs of
        /// min(k, 2 span) slots), or, when one run a row is left, the first k positions into
        /// `out` (`[rows, k]` int64). Grid-stride, any grid.
        sort_merge(
            keys: In<u64>,
            idx: In<u32>,
            keys_out: OptOut<u64>,
            idx_out: OptOut<u32>,
            out: OptOut<i64>,
            rows: i64,
            n: i64,
            k: i64,
            span: i64,
            runs: i64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::kernels::dtype_suffix;

    #[test]
    fn the_header_spells_each_parameter_list_in_c() {
        assert!(PARAMS_HEADER
            .contains("#define EMBER_PARAMS_cast_strided(S, D) (const S* src, D* dst, Strided s, i64 n)\n"));
        assert!(PARAMS_HEADER.contains(
            "#define EMBER_PARAMS_update_scale (float* scale, i32* growth_tracker, const float* found_inf, \
             double growth_factor, double backoff_factor, i32 growth_interval)\n"
        ));
        assert!(PARAMS_HEADER.contains("(TensorList l, const float* found_inf)"));
        // The reduction variants: one C name per Rust value.
        assert!(VARIANTS_HEADER.contains("#define SUM_MEAN 1\n"));
        assert!(VARIANTS_HEADER.contains("#define MINMAX_MIN_ABS 3\n"));
        assert_eq!(VARIANTS_HEADER.matches("#define ").count(), 14);
    }

    /// `symbol` is kernel `name` followed by dtype suffixes (`softmax_f32`, `scatter_add_f32_i64`).
    fn is_kernel_of(symbol: &str, name: &str) -> bool {
        let Some(rest) = symbol.strip_prefix(name) else {
            return false;
        };
        let mut rest = rest;
        while !rest.is_empty() {
            let next = DType::ALL
                .iter()
                .map(|&d| format!("_{}", dtype_suffix(d)))
                .find(|s| rest.starts_with(s.as_str()));
            match next {
                Some(s) => rest = &rest[s.len()..],
                None => return false,
            }
        }
        true
    }

    #[test]
    fn every_family_names_kernels_of_its_module_and_covers_every_kernel() {
        let mut seen = std::collections::HashSet::new();
        let families = families();
        for (module, family, names) in &families {
            let (module, family) = (*module, *family);
            assert!(seen.insert(family), "family {family} declared twice");
            let symbols: Vec<String> = module.units().iter().flat_map(|u| u.symbols()).collect();
            for name in names {
                assert!(
                    symbols.iter().any(|s| is_kernel_of(s, name)),
                    "{family}: {}.cu has no kernel {name}_<dtypes>",
                    module.name()
                );
            }
        }
        for module in Module::ALL {
            for symbol in module.units().iter().flat_map(|u| u.symbols()) {
                let declared = families
                    .iter()
                    .filter(|(m, _, _)| *m == module)
                    .flat_map(|(_, _, names)| names.iter())
                    .any(|name| is_kernel_of(&symbol, name));
                assert!(declared, "{}.cu: kernel {symbol} has no family", module.name());
            }
        }
    }

    #[test]
    fn sources_define_every_kernel_with_its_family_macro() {
        for module in Module::ALL {
            let source = module.source();
            let mut kernels = 0;
            for (at, _) in source.match_indices("__global__ void ") {
                let rest = &source[at + "__global__ void ".len()..];
                // `__launch_bounds__(...)` before the name.
                let rest = match rest.strip_prefix("__launch_bounds__(") {
                    Some(r) => r[r.find(')').expect("launch bounds close") + 1..]
                        .trim_start_matches(|c: char| c.is_whitespace() || c == '\\'),
                    None => rest,
                };
                let name_end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '#'))
                    .unwrap_or(rest.len());
                // Spaces, or a line continuation inside a macro.
                let after = rest[name_end..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                assert!(
                    after.starts_with("EMBER_PARAMS_"),
                    "{}.cu: kernel {} declares its own parameters",
                    module.name(),
                    &rest[..name_end]
                );
                kernels += 1;
            }
            assert!(kernels > 0, "{}.cu", module.name());
        }
    }
}
