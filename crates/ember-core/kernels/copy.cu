// Copies, casts and fills: the kernels `.contiguous()`, `.to_dtype()`, `copy_` and fills of
// 8-byte dtypes go through (fills of 1-, 2- and 4-byte dtypes use cuMemset).
//
// Launch contract (all grid-stride, any grid):
//   cast_contig_S_D(const S* src, D* dst, i64 n)            both row-major
//   cast_strided_S_D(const S* src, D* dst, Strided s, i64 n) s.stride[0] = src, s.stride[1] = dst
//   fill_u64(u64* dst, u64 word, i64 n)
// Casts follow the CPU backend: float -> int truncates toward zero, anything -> bool is != 0,
// f16/bf16 round to nearest even.

template <typename S, typename D>
__device__ __forceinline__ void cast_contig(const S* __restrict__ src, D* __restrict__ dst, i64 n) {
    EMBER_KERNEL_LOOP(i, n) { dst[i] = cast<D>(src[i]); }
}

template <typename S, typename D>
__device__ __forceinline__ void cast_strided(const S* __restrict__ src, D* __restrict__ dst, const Strided& s, i64 n) {
    EMBER_KERNEL_LOOP(i, n) {
        Offsets<2> o = strided_offsets<2>(s, i);
        dst[o.v[1]] = cast<D>(src[o.v[0]]);
    }
}

#define EMBER_CAST_TO(D, dname, S, sname)                                                                \
    EMBER_IN_UNIT(cast_contig_##sname##_##dname,                                                         \
    extern "C" __global__ void cast_contig_##sname##_##dname(const S* src, D* dst, i64 n) {             \
        cast_contig<S, D>(src, dst, n);                                                                  \
    })                                                                                                   \
    EMBER_IN_UNIT(cast_strided_##sname##_##dname,                                                        \
    extern "C" __global__ void cast_strided_##sname##_##dname(const S* src, D* dst, Strided s, i64 n) { \
        cast_strided<S, D>(src, dst, s, n);                                                              \
    })
#define EMBER_CAST_FROM(S, sname)                                                                        \
    EMBER_CAST_TO(float, f32, S, sname) EMBER_CAST_TO(double, f64, S, sname) EMBER_CAST_TO(f16, f16, S, sname) \
    EMBER_CAST_TO(bf16, bf16, S, sname) EMBER_CAST_TO(i64, i64, S, sname) EMBER_CAST_TO(i32, i32, S, sname)    \
    EMBER_CAST_TO(u8, u8, S, sname) EMBER_CAST_TO(bool, bool, S, sname)
EMBER_FOR_ALL_DTYPES(EMBER_CAST_FROM)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_fill_u64)
extern "C" __global__ void fill_u64(u64* dst, u64 word, i64 n) {
    EMBER_KERNEL_LOOP(i, n) { dst[i] = word; }
}
#endif
