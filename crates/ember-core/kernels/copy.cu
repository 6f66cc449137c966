// Copies, casts and fills: the kernels `.contiguous()`, `.to_dtype()`, `copy_` and fills of
// 8-byte dtypes go through (fills of 1-, 2- and 4-byte dtypes use cuMemset). All grid-stride,
// any grid. Casts follow the CPU backend: float -> int truncates toward zero, anything -> bool
// is != 0, f16/bf16 round to nearest even.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

template <typename T, int V> struct alignas(sizeof(T) * V) CastPack { T v[V]; };

// Four elements a thread where both ends are aligned to four elements (a cast of f32 weights
// to bf16 reads 16 bytes and writes 8 per load), the rest one by one. The thread takes the
// elements (or packs of four) `first`, `first + step`, ...: grid-stride for `cast_contig`,
// block-stride within a chunk for `multi_copy`.
template <typename S, typename D>
__device__ __forceinline__ void cast_run(const S* __restrict__ src, D* __restrict__ dst, i64 n, i64 first, i64 step) {
    constexpr int V = 4;
    i64 done = 0;
    if ((u64)src % (sizeof(S) * V) == 0 && (u64)dst % (sizeof(D) * V) == 0) {
        const i64 nv = n / V;
        const CastPack<S, V>* ps = reinterpret_cast<const CastPack<S, V>*>(src);
        CastPack<D, V>* pd = reinterpret_cast<CastPack<D, V>*>(dst);
        for (i64 i = first; i < nv; i += step) {
            CastPack<S, V> a = ps[i];
            CastPack<D, V> r;
#pragma unroll
            for (int k = 0; k < V; ++k) r.v[k] = cast<D>(a.v[k]);
            pd[i] = r;
        }
        done = nv * V;
    }
    for (i64 j = done + first; j < n; j += step) dst[j] = cast<D>(src[j]);
}

template <typename S, typename D>
__device__ __forceinline__ void cast_contig(const S* __restrict__ src, D* __restrict__ dst, i64 n) {
    cast_run<S, D>(src, dst, n, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)blockDim.x * gridDim.x);
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
    extern "C" __global__ void cast_contig_##sname##_##dname EMBER_PARAMS_cast_contig(S, D) {           \
        cast_contig<S, D>(src, dst, n);                                                                  \
    })                                                                                                   \
    EMBER_IN_UNIT(cast_strided_##sname##_##dname,                                                        \
    extern "C" __global__ void cast_strided_##sname##_##dname EMBER_PARAMS_cast_strided(S, D) {         \
        cast_strided<S, D>(src, dst, s, n);                                                              \
    })
#define EMBER_CAST_FROM(S, sname)                                                                        \
    EMBER_CAST_TO(float, f32, S, sname) EMBER_CAST_TO(double, f64, S, sname) EMBER_CAST_TO(f16, f16, S, sname) \
    EMBER_CAST_TO(bf16, bf16, S, sname) EMBER_CAST_TO(i64, i64, S, sname) EMBER_CAST_TO(i32, i32, S, sname)    \
    EMBER_CAST_TO(u8, u8, S, sname) EMBER_CAST_TO(bool, bool, S, sname)
EMBER_FOR_ALL_DTYPES(EMBER_CAST_FROM)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_fill_u64)
extern "C" __global__ void fill_u64 EMBER_PARAMS_fill_u64 {
    EMBER_KERNEL_LOOP(i, n) { dst[i] = word; }
}
#endif

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_arange_i64)
extern "C" __global__ void arange_i64 EMBER_PARAMS_arange_i64 {
    EMBER_KERNEL_LOOP(i, n) { dst[i] = start + i * step; }
}
#endif

// `foreach_copy_` (`ops/foreach.rs`, launched by `cuda_backend/multi_copy.rs`): up to
// EMBER_COPY_MAX_TENSORS copies of contiguous runs in one launch, each of kind `kind[t]`: a
// byte copy (EMBER_COPY_BYTES, a pair of one dtype) or a cast between f32, bf16 and f16
// (EMBER_COPY_CAST(src, dst), the dtype codes below), converted by the prelude's `cast`, so
// each element gets the bits `cast_contig_<src>_<dst>` (`copy_`) gives it. A byte copy's run
// is cut into chunks of EMBER_COPY_CHUNK bytes, a cast's into chunks of EMBER_CAST_CHUNK
// elements (16 KiB of f32 read or written, as a byte copy's chunk); blocks take chunks
// grid-stride. A byte chunk whose ends and length are 16-byte aligned moves in 16-byte words,
// one aligned to 4 bytes in 4-byte words, any other byte by byte; a cast chunk whose two ends
// are aligned to four elements converts four elements a thread (a 16-byte f32 access beside
// an 8-byte half one, as `cast_contig`), any other element by element.
#define EMBER_COPY_MAX_TENSORS 64
#define EMBER_COPY_CHUNK 16384
#define EMBER_CAST_CHUNK 4096
#define EMBER_COPY_BYTES 0
#define EMBER_COPY_F32 0
#define EMBER_COPY_BF16 1
#define EMBER_COPY_F16 2
#define EMBER_COPY_CAST(src, dst) (1 + 3 * (src) + (dst))

// Same layout as `CopyList` in `cuda_backend/multi_copy.rs` (2128 bytes). `len[t]` counts
// bytes for a byte copy, elements for a cast.
struct CopyList {
    i32 n;
    i32 pad;
    u64 dst[EMBER_COPY_MAX_TENSORS];
    u64 src[EMBER_COPY_MAX_TENSORS];
    i64 len[EMBER_COPY_MAX_TENSORS];
    i64 chunk_start[EMBER_COPY_MAX_TENSORS + 1];
    u8 kind[EMBER_COPY_MAX_TENSORS];
};

template <typename W>
__device__ __forceinline__ void copy_words(char* d, const char* s, i64 len) {
    W* dw = reinterpret_cast<W*>(d);
    const W* sw = reinterpret_cast<const W*>(s);
    for (i64 i = threadIdx.x; i < len / (i64)sizeof(W); i += blockDim.x) dw[i] = sw[i];
}

__device__ __forceinline__ void copy_chunk(u64 dst, u64 src, i64 first, i64 len) {
    char* d = reinterpret_cast<char*>(dst) + first;
    const char* s = reinterpret_cast<const char*>(src) + first;
    const u64 bits = reinterpret_cast<u64>(d) | reinterpret_cast<u64>(s) | (u64)len;
    if ((bits & 15) == 0) {
        copy_words<uint4>(d, s, len);
    } else if ((bits & 3) == 0) {
        copy_words<u32>(d, s, len);
    } else {
        copy_words<u8>(d, s, len);
    }
}

template <typename S, typename D>
__device__ __forceinline__ void cast_chunk(u64 dst, u64 src, i64 first, i64 len) {
    cast_run<S, D>(reinterpret_cast<const S*>(src) + first, reinterpret_cast<D*>(dst) + first, len, threadIdx.x, blockDim.x);
}

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_multi_copy)
extern "C" __global__ void multi_copy EMBER_PARAMS_multi_copy {
    const i64 chunks = l.chunk_start[l.n];
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        int t = 0;
        while (t + 1 < l.n && l.chunk_start[t + 1] <= c) ++t;
        const int kind = l.kind[t];
        const i64 unit = kind == EMBER_COPY_BYTES ? EMBER_COPY_CHUNK : EMBER_CAST_CHUNK;
        const i64 first = (c - l.chunk_start[t]) * unit;
        const i64 rest = l.len[t] - first;
        const i64 len = rest < unit ? rest : unit;
        const u64 d = l.dst[t], s = l.src[t];
        // One chunk, one kind: every thread of the block takes the same branch.
        switch (kind) {
            case EMBER_COPY_BYTES: copy_chunk(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_F32, EMBER_COPY_BF16): cast_chunk<float, bf16>(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_F32, EMBER_COPY_F16): cast_chunk<float, f16>(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_BF16, EMBER_COPY_F32): cast_chunk<bf16, float>(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_BF16, EMBER_COPY_F16): cast_chunk<bf16, f16>(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_F16, EMBER_COPY_F32): cast_chunk<f16, float>(d, s, first, len); break;
            case EMBER_COPY_CAST(EMBER_COPY_F16, EMBER_COPY_BF16): cast_chunk<f16, bf16>(d, s, first, len); break;
            default: break;  // the host sends no other kind
        }
    }
}
#endif
