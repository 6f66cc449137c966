//! The CPU backend: [`CpuStorage`] holds a `Vec` of the tensor's dtype; kernels are
//! multi-threaded with rayon above [`PAR_THRESHOLD`] elements, with contiguous fast paths and a
//! general strided path. f16 and bf16 compute through f32.
//!
//! One file per op family (`binary`, `unary`, `reduce`, `matmul`, `index`, `softmax`, `conv`,
//! `pool`, `random`, `optim`, `rnn`, `loss`, `amp`, `norm`), each implementing its family's backend
//! trait (`crate::backend`) for [`CpuStorage`]; this file implements the copies, the base
//! trait and [`CpuDevice`].

pub use crate::backend::host::{with_cpu_storage, CpuElement, CpuStorage};
use crate::backend::CopyOps;
use crate::backend::{BackendDevice, BackendStorage, Distribution, ForeachCopy, PhiloxState};
use crate::dtype::Element;
use crate::layout::Layout;
use crate::memory::check_host_alloc;
use crate::Shape;
use crate::{DType, Device, Result};
use half::{bf16, f16};
use rayon::prelude::*;

pub(crate) mod amp;
mod binary;
mod conv;
mod index;
mod loss;
mod matmul;
mod norm;
pub(crate) mod optim;
pub mod philox;
mod pool;
pub(crate) mod random;
mod reduce;
mod rnn;
mod softmax;
mod sort;
pub(crate) mod threads;
mod unary;

/// Elements below which a kernel stays on the calling thread (rayon's fork cost is ~µs).
pub const PAR_THRESHOLD: usize = 1 << 15;

/// Elements per task when a strided kernel splits its output across threads.
pub const PAR_CHUNK: usize = 1 << 14;

impl CpuStorage {
    /// The elements of `layout` copied into a new row-major storage.
    pub fn contiguous(&self, layout: &Layout) -> CpuStorage {
        with_cpu_storage!(self, v => CpuElement::wrap(gather_strided(v, layout)))
    }
}

/// Converts one element between dtypes with PyTorch's cast semantics (float → int truncates
/// toward zero, anything → bool is `!= 0`); a float of 32 bits or fewer rounds once, as on
/// CUDA (`Element::from_f32`).
#[inline]
pub fn convert<S: Element, D: Element>(x: S) -> D {
    if matches!(S::DTYPE, DType::F32 | DType::F16 | DType::BF16) {
        // Exact in f32.
        D::from_f32(x.to_f64() as f32)
    } else if S::DTYPE.is_floating_point() || D::DTYPE.is_floating_point() {
        D::from_f64(x.to_f64())
    } else {
        D::from_i64(x.to_i64())
    }
}

/// The elements of `layout` in row-major order, copied out of `data`.
pub fn gather_strided<T: Copy + Send + Sync>(data: &[T], layout: &Layout) -> Vec<T> {
    map_strided(data, layout, |x| x)
}

/// `f` applied to each element of `layout`, in row-major order. Parallel above
/// [`PAR_THRESHOLD`]; contiguous layouts read the slice directly.
pub fn map_strided<T, U, F>(data: &[T], layout: &Layout, f: F) -> Vec<U>
where
    T: Copy + Send + Sync,
    U: Send,
    F: Fn(T) -> U + Send + Sync,
{
    let n = layout.numel();
    if let Some(r) = layout.contiguous_range() {
        let src = &data[r];
        return if n >= PAR_THRESHOLD {
            threads::parallel(|| src.par_iter().map(|&x| f(x)).collect())
        } else {
            src.iter().map(|&x| f(x)).collect()
        };
    }
    if n >= PAR_THRESHOLD {
        let mut out = Vec::with_capacity(n);
        let parts: Vec<Vec<U>> = threads::parallel(|| {
            (0..n.div_ceil(PAR_CHUNK))
                .into_par_iter()
                .map(|c| {
                    layout
                        .offsets_from(c * PAR_CHUNK)
                        .take(PAR_CHUNK)
                        .map(|o| f(data[o]))
                        .collect()
                })
                .collect()
        });
        for p in parts {
            out.extend(p);
        }
        return out;
    }
    layout.offsets().map(|o| f(data[o])).collect()
}

impl CopyOps for CpuStorage {
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<CpuStorage> {
        fn cast<S: CpuElement, D: CpuElement>(src: &[S], layout: &Layout) -> CpuStorage {
            D::wrap(map_strided(src, layout, convert::<S, D>))
        }
        fn to<D: CpuElement>(s: &CpuStorage, layout: &Layout) -> CpuStorage {
            with_cpu_storage!(s, v => cast::<_, D>(v, layout))
        }
        check_host_alloc("to_dtype", layout.numel(), dtype)?;
        if self.dtype() == dtype {
            return Ok(self.contiguous(layout));
        }
        Ok(match dtype {
            DType::Bool => to::<bool>(self, layout),
            DType::U8 => to::<u8>(self, layout),
            DType::I32 => to::<i32>(self, layout),
            DType::I64 => to::<i64>(self, layout),
            DType::F16 => to::<f16>(self, layout),
            DType::BF16 => to::<bf16>(self, layout),
            DType::F32 => to::<f32>(self, layout),
            DType::F64 => to::<f64>(self, layout),
        })
    }

    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage> {
        check_host_alloc("contiguous", layout.numel(), self.dtype())?;
        Ok(self.contiguous(layout))
    }

    /// Converts the dtype with PyTorch's cast semantics ([`convert`]).
    fn copy_strided_from(
        &mut self,
        dst_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
    ) -> Result<()> {
        fn copy<S: CpuElement, D: CpuElement>(dst: &mut [D], dl: &Layout, src: &[S], sl: &Layout) {
            if let (Some(d), Some(s)) = (dl.contiguous_range(), sl.contiguous_range()) {
                for (o, &i) in dst[d].iter_mut().zip(&src[s]) {
                    *o = convert::<S, D>(i);
                }
                return;
            }
            for (o, i) in dl.offsets().zip(sl.offsets()) {
                dst[o] = convert::<S, D>(src[i]);
            }
        }
        fn into<D: CpuElement>(dst: &mut [D], dl: &Layout, src: &CpuStorage, sl: &Layout) {
            with_cpu_storage!(src, s => copy(dst, dl, s, sl))
        }
        with_cpu_storage!(self, d => into(d, dst_layout, src, src_layout));
        Ok(())
    }

    /// Pair by pair, each as `copy_` copies it (casting where the dtypes differ), so a list
    /// of the CPU gives the bits its pairs' `copy_` give.
    fn foreach_copy(mut list: ForeachCopy<'_, CpuStorage>) -> Result<()> {
        let run = |e: &crate::backend::Elems<usize>| Layout::new(Shape::from(vec![e.len]), vec![1], e.offset);
        for (d, s) in &list.copies {
            list.written[d.storage].copy_strided_from(&run(d), list.read[s.storage], &run(s))?;
        }
        Ok(())
    }
}

/// The host, as a backend device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDevice;

impl BackendDevice for CpuDevice {
    type Storage = CpuStorage;

    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<CpuStorage> {
        Ok(cpu)
    }

    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<CpuStorage> {
        CpuStorage::full(dtype, n, value)
    }

    fn alloc(&self, dtype: DType, n: usize) -> Result<CpuStorage> {
        self.full(dtype, n, 0.0)
    }

    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: PhiloxState) -> Result<CpuStorage> {
        let state = state.value("random")?;
        // Bernoulli draws through an f64 buffer of `n`.
        let widest = match dist {
            Distribution::Bernoulli { .. } => DType::F64,
            _ => dtype,
        };
        check_host_alloc("random", n, widest)?;
        random::random(dtype, n, dist, state)
    }

    fn arange_i64(&self, start: i64, step: i64, n: usize) -> Result<CpuStorage> {
        check_host_alloc("arange", n, DType::I64)?;
        Ok(CpuStorage::I64((0..n as i64).map(|i| start + i * step).collect()))
    }
}

impl BackendStorage for CpuStorage {
    #[inline]
    fn device(&self) -> Device {
        Device::Cpu
    }

    #[inline]
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::Bool(_) => DType::Bool,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
        }
    }

    #[inline]
    fn len(&self) -> usize {
        with_cpu_storage!(self, v => v.len())
    }
}

/// No fused attention on the CPU: the op layer computes it from its parts (PyTorch's math
/// backend, which its CPU flash kernel matches within rounding).
impl crate::backend::AttentionOps for CpuStorage {}

#[cfg(test)]
mod convert_tests {
    use super::*;

    #[test]
    fn float32_to_bfloat16_rounds_once() {
        // 1 + 2^-8 + 2^-23: above the tie between 1 and 1 + 2^-7 by the f32's last bit, which
        // `bf16::from_f64` does not see (it rounds from the f64's high 32 bits): to even, 1.
        let x = 1.0f32 + 2f32.powi(-8) + 2f32.powi(-23);
        assert_eq!(bf16::from_f64(x as f64).to_f32(), 1.0);
        assert_eq!(convert::<f32, bf16>(x).to_f32(), 1.0 + 2f32.powi(-7));
        // An exact tie still rounds to even; f16 and integers as before.
        assert_eq!(convert::<f32, bf16>(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        assert_eq!(convert::<f32, f16>(x).to_f32(), f16::from_f32(x).to_f32());
        assert_eq!(convert::<f32, i64>(-2.75), -2);
        assert!(convert::<f32, bool>(0.5));
    }
}
