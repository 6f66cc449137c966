//! Host elements: [`CpuStorage`], a `Vec` of one dtype. The CPU backend computes on it
//! (`crate::cpu`), and every backend reads and writes it for copies to and from the host
//! ([`crate::backend::CopyOps::to_cpu`], [`crate::backend::BackendDevice::storage_from_cpu`]): so
//! it is vocabulary, not CPU backend, and a GPU backend names it without importing the CPU's.

use crate::dtype::Element;
use crate::DType;
use half::{bf16, f16};

/// Elements of one CPU tensor storage.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    Bool(Vec<bool>),
    U8(Vec<u8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Applies `$body` with `$v` bound to the typed `Vec` (or slice) inside a [`CpuStorage`];
/// every arm must produce the same type.
#[doc(hidden)]
#[macro_export]
macro_rules! with_cpu_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::backend::host::CpuStorage::Bool($v) => $body,
            $crate::backend::host::CpuStorage::U8($v) => $body,
            $crate::backend::host::CpuStorage::I32($v) => $body,
            $crate::backend::host::CpuStorage::I64($v) => $body,
            $crate::backend::host::CpuStorage::F16($v) => $body,
            $crate::backend::host::CpuStorage::BF16($v) => $body,
            $crate::backend::host::CpuStorage::F32($v) => $body,
            $crate::backend::host::CpuStorage::F64($v) => $body,
        }
    };
}

/// A Rust element type that a [`CpuStorage`] variant holds.
pub trait CpuElement: Element {
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! cpu_element {
    ($t:ty, $variant:ident) => {
        impl CpuElement for $t {
            #[inline]
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            #[inline]
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            #[inline]
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
cpu_element!(bool, Bool);
cpu_element!(u8, U8);
cpu_element!(i32, I32);
cpu_element!(i64, I64);
cpu_element!(f16, F16);
cpu_element!(bf16, BF16);
cpu_element!(f32, F32);
cpu_element!(f64, F64);

impl CpuStorage {
    /// `n` copies of `value` converted to `dtype`; `Error::OutOfMemory` when host memory for
    /// them cannot be reserved (Note [Fallible host allocation] in `memory.rs`), so that an
    /// oversized request is an error, not an abort.
    pub fn full(dtype: DType, n: usize, value: f64) -> crate::Result<CpuStorage> {
        fn fill<T: CpuElement>(n: usize, value: f64) -> crate::Result<CpuStorage> {
            let v = crate::memory::try_filled("full", n, T::DTYPE, T::from_f64(value))?;
            Ok(T::wrap(v))
        }
        match dtype {
            DType::Bool => fill::<bool>(n, value),
            DType::U8 => fill::<u8>(n, value),
            DType::I32 => fill::<i32>(n, value),
            DType::I64 => fill::<i64>(n, value),
            DType::F16 => fill::<f16>(n, value),
            DType::BF16 => fill::<bf16>(n, value),
            DType::F32 => fill::<f32>(n, value),
            DType::F64 => fill::<f64>(n, value),
        }
    }
}
pub use with_cpu_storage;
