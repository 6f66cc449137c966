// Indexing by index tensors (`ops/index.rs`, CPU reference `cpu/index.rs`): index_select and
// gather (reads), scatter / scatter_value / scatter_add / index_add (out-of-place writes into a
// row-major copy of self), one_hot, and the index range check they all share.
//
// Every kernel walks a "position" shape W with a Strided descriptor of up to three operands, as
// the CPU kernels do: operand 0 is the indexed tensor with the indexed dim's stride set to 0 (the
// base offset of each position), operand 1 gives the position of the index value of each
// position, operand 2 (writes) the source element. The target is `base + index * dim_stride`.
//
// Index range: the host launches `check_index_I` over the index tensor before the op; it records
// the first index outside [0, size) in the device's error record (`report_bad` in the prelude),
// which the host reports at its next synchronizing call (Note [Deferred device errors] in
// `cuda/device_errors.rs`): nothing is read back, so the ops can be captured into CUDA graphs.
// The op kernels themselves skip out-of-range indices, so they never touch memory out of bounds;
// their output is unspecified when an error was recorded.
//
// Scatter (last write wins, as on the CPU): two passes. `scatter_mark_I` stores, for every target
// element, the largest row-major position p (as p + 1, in a u32 buffer zeroed by the host) that
// writes it (atomicMax); `scatter_wB_I` then lets only that position write. The result is
// deterministic and equal to the CPU's sequential loop. When W has 2^32 - 1 positions or more
// the host passes a null `winner` and duplicate indices race (documented departure).
// scatter_add / index_add accumulate with atomics, so with repeated indices the float sums are
// in an unspecified order (equal to the CPU up to rounding; exact for integers).
//
// Grid-stride loops, any grid; I is the index type, i64 or i32; B the element width in bytes of
// the dtype-agnostic moves, 1 2 4 8 (16 for select_rows).
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

// An opaque element of B bytes, for kernels that only move elements.
struct __align__(16) U128 { u64 lo, hi; };
template <int B> struct Bytes;
template <> struct Bytes<1> { typedef u8 type; };
template <> struct Bytes<2> { typedef unsigned short type; };
template <> struct Bytes<4> { typedef u32 type; };
template <> struct Bytes<8> { typedef u64 type; };
template <> struct Bytes<16> { typedef U128 type; };

template <typename I> __device__ __forceinline__ bool in_range(I v, i64 size) {
    return (i64)v >= 0 && (i64)v < size;
}

template <typename I>
__device__ __forceinline__ void check_index(const I* idx, const Strided& s, i64 n, const ErrorCheck& check) {
    FirstBad first = no_bad();
    EMBER_KERNEL_LOOP(i, n) {
        I v = idx[strided_offset(s, 0, i)];
        if (!in_range(v, check.size)) note_bad(first, (u64)i, (i64)v);
    }
    report_bad(check, first);
}

template <typename E, typename I>
__device__ __forceinline__ void gather(const E* __restrict__ x, const I* __restrict__ idx, E* __restrict__ out,
                                       const Strided& s, i64 n, i64 dim_stride, i64 size) {
    EMBER_KERNEL_LOOP(i, n) {
        i64 v = (i64)idx[strided_offset(s, 1, i)];
        if (v >= 0 && v < size) out[i] = x[strided_offset(s, 0, i) + v * dim_stride];
    }
}

template <typename E, typename I>
__device__ __forceinline__ void select_rows(const E* __restrict__ x, const I* __restrict__ idx, E* __restrict__ out,
                                            i64 outer, i64 nidx, i64 size, i64 inner, i64 istride) {
    i64 n = outer * nidx * inner;
    EMBER_KERNEL_LOOP(u, n) {
        i64 col = u % inner;
        i64 r = u / inner;
        i64 c = r % nidx;
        i64 o = r / nidx;
        i64 v = (i64)idx[c * istride];
        if (v >= 0 && v < size) out[u] = x[(o * size + v) * inner + col];
    }
}

template <typename I>
__device__ __forceinline__ void scatter_mark(const I* __restrict__ idx, u32* winner, const Strided& s, i64 n,
                                             i64 dim_stride, i64 size) {
    EMBER_KERNEL_LOOP(i, n) {
        i64 v = (i64)idx[strided_offset(s, 1, i)];
        if (v >= 0 && v < size) atomicMax(winner + strided_offset(s, 0, i) + v * dim_stride, (u32)(i + 1));
    }
}

template <typename E, typename I>
__device__ __forceinline__ void scatter(E* out, const I* __restrict__ idx, const E* __restrict__ src,
                                        const u32* __restrict__ winner, const Strided& s, i64 n, i64 dim_stride,
                                        i64 size) {
    EMBER_KERNEL_LOOP(i, n) {
        i64 v = (i64)idx[strided_offset(s, 1, i)];
        if (v < 0 || v >= size) continue;
        i64 t = strided_offset(s, 0, i) + v * dim_stride;
        if (winner == nullptr || winner[t] == (u32)(i + 1)) out[t] = src[strided_offset(s, 2, i)];
    }
}

// Atomic `*p += v` with the CPU's per-element semantics: floats add (f16/bf16 in f32, rounded
// once per add), integers wrap, booleans or.
template <typename T> struct AtomicAdd;
template <> struct AtomicAdd<float> {
    __device__ __forceinline__ static void add(float* p, float v) { atomicAdd(p, v); }
};
template <> struct AtomicAdd<double> {
    __device__ __forceinline__ static void add(double* p, double v) { atomicAdd(p, v); }
};
template <> struct AtomicAdd<i32> {
    __device__ __forceinline__ static void add(i32* p, i32 v) { atomicAdd(p, v); }
};
template <> struct AtomicAdd<i64> {
    __device__ __forceinline__ static void add(i64* p, i64 v) {
        atomicAdd((unsigned long long*)p, (unsigned long long)v);  // two's complement: wraps
    }
};
template <> struct AtomicAdd<bool> {
    __device__ __forceinline__ static void add(bool* p, bool v) {
        if (v) *p = true;  // `or`: every racing writer stores the same byte
    }
};
// Sub-word types: compare-and-swap on the aligned 32-bit word holding the element (device
// buffers are 512-byte aligned and sized in multiples of 512 bytes, so the word is in bounds).
template <typename T, typename F> __device__ __forceinline__ void cas_add(T* p, F combine) {
    u32* word = (u32*)((u64)p & ~(u64)3);
    u32 shift = (u32)((u64)p & 3) * 8;
    u32 mask = (sizeof(T) == 1 ? 0xffu : 0xffffu) << shift;
    u32 old = *word, assumed;
    do {
        assumed = old;
        u32 cur = (assumed & mask) >> shift;
        u32 next = combine(cur);
        old = atomicCAS(word, assumed, (assumed & ~mask) | ((next << shift) & mask));
    } while (old != assumed);
}
template <> struct AtomicAdd<u8> {
    __device__ __forceinline__ static void add(u8* p, u8 v) {
        cas_add(p, [v](u32 cur) { return (cur + (u32)v) & 0xffu; });
    }
};
template <> struct AtomicAdd<f16> {
    __device__ __forceinline__ static void add(f16* p, f16 v) {
        float fv = f16_to_f32(v);
        cas_add(p, [fv](u32 cur) {
            f16 c;
            c.bits = (unsigned short)cur;
            return (u32)f32_to_f16(f16_to_f32(c) + fv).bits;
        });
    }
};
template <> struct AtomicAdd<bf16> {
    __device__ __forceinline__ static void add(bf16* p, bf16 v) {
        float fv = bf16_to_f32(v);
        cas_add(p, [fv](u32 cur) {
            bf16 c;
            c.bits = (unsigned short)cur;
            return (u32)f32_to_bf16(bf16_to_f32(c) + fv).bits;
        });
    }
};

template <typename T, typename I>
__device__ __forceinline__ void scatter_add(T* out, const I* __restrict__ idx, const T* __restrict__ src,
                                            const Strided& s, i64 n, i64 dim_stride, i64 size) {
    EMBER_KERNEL_LOOP(i, n) {
        i64 v = (i64)idx[strided_offset(s, 1, i)];
        if (v < 0 || v >= size) continue;
        AtomicAdd<T>::add(out + strided_offset(s, 0, i) + v * dim_stride, src[strided_offset(s, 2, i)]);
    }
}

template <typename I>
__device__ __forceinline__ void one_hot(const I* __restrict__ idx, const Strided& s, i64 n, i64 classes, i64* out,
                                        const ErrorCheck& check) {
    FirstBad first = no_bad();
    EMBER_KERNEL_LOOP(i, n) {
        i64 v = (i64)idx[strided_offset(s, 0, i)];
        if (v >= 0 && v < classes) out[i * classes + v] = 1;
        else note_bad(first, (u64)i, v);
    }
    report_bad(check, first);
}

template <typename T, typename I>
__device__ __forceinline__ void nll_loss(const T* __restrict__ logp, const I* __restrict__ target,
                                         const T* __restrict__ weight, i64 m, i64 c, i64 ignore, int mean,
                                         T* loss, T* total, const ErrorCheck& check) {
    typedef typename Acc<T>::type A;
    __shared__ A warp_loss[32], warp_weight[32];
    FirstBad first = no_bad();
    A l = (A)0, w = (A)0;
    for (i64 i = threadIdx.x; i < m; i += blockDim.x) {
        const i64 t = (i64)target[i];
        if (t == ignore) continue;
        if (t < 0 || t >= c) {
            note_bad(first, (u64)i, t);
            continue;
        }
        const A wt = weight ? load(weight[t]) : (A)1;
        l -= wt * load(logp[i * c + t]);
        w += wt;
    }
    report_bad(check, first);
    l = warp_sum(l);
    w = warp_sum(w);
    if ((threadIdx.x & 31) == 0) {
        warp_loss[threadIdx.x >> 5] = l;
        warp_weight[threadIdx.x >> 5] = w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        A sl = (A)0, sw = (A)0;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) {
            sl += warp_loss[k];
            sw += warp_weight[k];
        }
        *loss = cast<T>(mean ? sl / sw : sl);
        *total = cast<T>(sw);
    }
}

template <typename T, typename I>
__device__ __forceinline__ void nll_loss_backward(const T* __restrict__ g, const I* __restrict__ target,
                                                  const T* __restrict__ weight, const T* __restrict__ total, i64 m,
                                                  i64 c, i64 ignore, int mean, T* __restrict__ grad) {
    typedef typename Acc<T>::type A;
    A scale = load(g[0]);
    if (mean) scale = scale / load(total[0]);
    EMBER_KERNEL_LOOP(i, m) {
        const i64 t = (i64)target[i];
        if (t == ignore || t < 0 || t >= c) continue;
        const A wt = weight ? load(weight[t]) : (A)1;
        grad[i * c + t] = cast<T>(-wt * scale);
    }
}

#define EMBER_NLL_LOSS(T, name, I, iname)                                                                       \
    EMBER_IN_UNIT(nll_loss_##name##_##iname,                                                                    \
    extern "C" __global__ void nll_loss_##name##_##iname EMBER_PARAMS_nll_loss(T, I) {                          \
        nll_loss<T, I>(logp, target, weight, m, c, ignore_index, mean, loss, total_weight, check);               \
    })                                                                                                          \
    EMBER_IN_UNIT(nll_loss_backward_##name##_##iname,                                                           \
    extern "C" __global__ void nll_loss_backward_##name##_##iname EMBER_PARAMS_nll_loss_backward(T, I) {        \
        nll_loss_backward<T, I>(g, target, weight, total_weight, m, c, ignore_index, mean, grad);                \
    })
#define EMBER_NLL_LOSS_I64(T, name) EMBER_NLL_LOSS(T, name, i64, i64)
#define EMBER_NLL_LOSS_I32(T, name) EMBER_NLL_LOSS(T, name, i32, i32)

#define EMBER_INDEX_KERNELS(I, iname)                                                                         \
    EMBER_IN_UNIT(check_index_##iname,                                                                        \
    extern "C" __global__ void check_index_##iname EMBER_PARAMS_check_index(I) {                               \
        check_index<I>(idx, s, n, check);                                                                       \
    })                                                                                                          \
    EMBER_IN_UNIT(scatter_mark_##iname,                                                                         \
    extern "C" __global__ void scatter_mark_##iname EMBER_PARAMS_scatter_mark(I) {                              \
        scatter_mark<I>(idx, winner, s, n, dim_stride, size);                                                   \
    })                                                                                                          \
    EMBER_IN_UNIT(one_hot_##iname,                                                                              \
    extern "C" __global__ void one_hot_##iname EMBER_PARAMS_one_hot(I) {                                        \
        one_hot<I>(idx, s, n, classes, out, check);                                                             \
    })

#define EMBER_MOVE_KERNELS(B, I, iname)                                                                         \
    EMBER_IN_UNIT(gather_w##B##_##iname,                                                                        \
    extern "C" __global__ void gather_w##B##_##iname EMBER_PARAMS_gather(Bytes<B>::type, I) {                 \
        gather<Bytes<B>::type, I>(x, idx, out, s, n, dim_stride, size);                                         \
    })                                                                                                          \
    EMBER_IN_UNIT(scatter_w##B##_##iname,                                                                       \
    extern "C" __global__ void scatter_w##B##_##iname EMBER_PARAMS_scatter(Bytes<B>::type, I) {               \
        scatter<Bytes<B>::type, I>(out, idx, src, winner, s, n, dim_stride, size);                              \
    })

#define EMBER_SELECT_ROWS(B, I, iname)                                                                          \
    EMBER_IN_UNIT(select_rows_w##B##_##iname,                                                                   \
    extern "C" __global__ void select_rows_w##B##_##iname EMBER_PARAMS_select_rows(Bytes<B>::type, I) {       \
        select_rows<Bytes<B>::type, I>(x, idx, out, outer, nidx, size, inner, istride);                         \
    })

#define EMBER_SCATTER_ADD(T, name, I, iname)                                                                    \
    EMBER_IN_UNIT(scatter_add_##name##_##iname,                                                                 \
    extern "C" __global__ void scatter_add_##name##_##iname EMBER_PARAMS_scatter_add(T, I) {                  \
        scatter_add<T, I>(out, idx, src, s, n, dim_stride, size);                                               \
    })
#define EMBER_SCATTER_ADD_I64(T, name) EMBER_SCATTER_ADD(T, name, i64, i64)
#define EMBER_SCATTER_ADD_I32(T, name) EMBER_SCATTER_ADD(T, name, i32, i32)

#define EMBER_FOR_INDEX_TYPE(I, iname)                                                                          \
    EMBER_INDEX_KERNELS(I, iname)                                                                               \
    EMBER_MOVE_KERNELS(1, I, iname) EMBER_MOVE_KERNELS(2, I, iname) EMBER_MOVE_KERNELS(4, I, iname)             \
    EMBER_MOVE_KERNELS(8, I, iname)                                                                             \
    EMBER_SELECT_ROWS(1, I, iname) EMBER_SELECT_ROWS(2, I, iname) EMBER_SELECT_ROWS(4, I, iname)                \
    EMBER_SELECT_ROWS(8, I, iname) EMBER_SELECT_ROWS(16, I, iname)

EMBER_FOR_INDEX_TYPE(i64, i64)
EMBER_FOR_INDEX_TYPE(i32, i32)
EMBER_FOR_ALL_DTYPES(EMBER_SCATTER_ADD_I64)
EMBER_FOR_ALL_DTYPES(EMBER_SCATTER_ADD_I32)
EMBER_FOR_FLOAT_DTYPES(EMBER_NLL_LOSS_I64)
EMBER_FOR_FLOAT_DTYPES(EMBER_NLL_LOSS_I32)

// ---- Deterministic embedding backward (Note [Deterministic embedding backward] in
// `cuda_backend/index.rs`) ----
// The weight gradient of a read of table rows at n indices: out[r, :] = Σ g[p, :] over the
// positions p with idx[p] = r, in the order of p, accumulated in Acc<T> and written once
// (rows never read get 0: no zero fill, no atomics); with `add`, the sum is added to the row
// `out` holds and rows never read are left (Note [Gradients added in place] in
// `autograd/engine.rs`).
//   embedding_sort_<I>      one block of EMB_CHUNK threads per chunk of EMB_CHUNK positions:
//                           the chunk's (index << 32 | position) keys sorted (bitonic, in
//                           shared memory), so each chunk is a run sorted by index, then
//                           position;
//   embedding_backward_<T>  one warp per table row (grid-stride): the row's segment in each
//                           run by binary search (lane b searches run b), then the segments'
//                           gradient rows summed run by run, position by position;
//                           EMB_COLS columns per lane at a time.
#define EMB_CHUNK 1024
#define EMB_COLS 8

template <typename I> __device__ void emb_sort(const I* idx, i64 n, u64* keys) {
    __shared__ u64 sk[EMB_CHUNK];
    const i64 base = (i64)blockIdx.x * EMB_CHUNK;
    for (int i = threadIdx.x; i < EMB_CHUNK; i += blockDim.x) {
        const i64 p = base + i;
        sk[i] = p < n ? ((u64)(i64)idx[p] << 32) | (u64)p : ~0ull;  // padding sorts last
    }
    __syncthreads();
    for (int k = 2; k <= EMB_CHUNK; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < EMB_CHUNK; i += blockDim.x) {
                const int o = i ^ j;
                if (o > i) {
                    const u64 a = sk[i], b = sk[o];
                    if ((a > b) == ((i & k) == 0)) {
                        sk[i] = b;
                        sk[o] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < EMB_CHUNK; i += blockDim.x)
        if (base + i < n) keys[base + i] = sk[i];
}

// The first position in keys[lo, hi) whose key is >= `key`.
__device__ __forceinline__ i64 emb_lower_bound(const u64* keys, i64 lo, i64 hi, u64 key) {
    while (lo < hi) {
        const i64 m = (lo + hi) >> 1;
        if (keys[m] < key) lo = m + 1;
        else hi = m;
    }
    return lo;
}

// Lane l's segment of row r in run b0 + l (empty past the last run).
__device__ __forceinline__ void emb_segment(const u64* keys, i64 n, i64 r, i64 b0, i64 nruns, i64& s, i64& e) {
    const i64 b = b0 + (threadIdx.x & 31);
    s = e = 0;
    if (b < nruns) {
        const i64 lo = b * EMB_CHUNK, hi = min(n, lo + EMB_CHUNK);
        s = emb_lower_bound(keys, lo, hi, (u64)r << 32);
        e = emb_lower_bound(keys, s, hi, (u64)(r + 1) << 32);
    }
}

// Adds the gradient rows of the segments held by the warp's lanes (runs b0..b0+31, in order)
// to `acc` (columns c0 + lane + 32 k).
template <typename T>
__device__ __forceinline__ void emb_add(const T* g, const u64* keys, i64 d, i64 c0, i64 s, i64 e, int runs,
                                        typename Acc<T>::type (&acc)[EMB_COLS], bool& touched) {
    const int lane = threadIdx.x & 31;
    for (int q = 0; q < runs; ++q) {
        const i64 qs = __shfl_sync(0xffffffffu, s, q), qe = __shfl_sync(0xffffffffu, e, q);
        touched = touched || qs < qe;
        for (i64 p = qs; p < qe; ++p) {
            const T* gr = g + (i64)(keys[p] & 0xffffffffull) * d;
#pragma unroll
            for (int k = 0; k < EMB_COLS; ++k) {
                const i64 col = c0 + lane + 32 * k;
                if (col < d) acc[k] += load(gr[col]);
            }
        }
    }
}

template <typename T>
__device__ void emb_backward(const T* g, const u64* keys, i64 n, i64 d, i64 rows, T* out, int add) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x & 31;
    const i64 warps = blockDim.x >> 5;
    const i64 nruns = (n + EMB_CHUNK - 1) / EMB_CHUNK;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        i64 s = 0, e = 0;
        if (nruns <= 32) emb_segment(keys, n, r, 0, nruns, s, e);  // once for every column
        for (i64 c0 = 0; c0 < d; c0 += 32 * EMB_COLS) {
            A acc[EMB_COLS];
#pragma unroll
            for (int k = 0; k < EMB_COLS; ++k) acc[k] = (A)0;
            bool touched = false;  // the same in every lane (the segments are shuffled)
            if (nruns <= 32) {
                emb_add<T>(g, keys, d, c0, s, e, (int)nruns, acc, touched);
            } else {
                for (i64 b0 = 0; b0 < nruns; b0 += 32) {
                    emb_segment(keys, n, r, b0, nruns, s, e);
                    emb_add<T>(g, keys, d, c0, s, e, (int)min((i64)32, nruns - b0), acc, touched);
                }
            }
            // With `add`, a row never read keeps what `out` holds.
            if (add && !touched) continue;
            T* orow = out + r * d;
#pragma unroll
            for (int k = 0; k < EMB_COLS; ++k) {
                const i64 col = c0 + lane + 32 * k;
                if (col < d) orow[col] = cast<T>(add ? (A)load(orow[col]) + acc[k] : acc[k]);
            }
        }
    }
}

#define EMBER_EMB_SORT(I, iname)                                                                                 \
    EMBER_IN_UNIT(embedding_sort_##iname,                                                                        \
    extern "C" __global__ void embedding_sort_##iname EMBER_PARAMS_embedding_sort(I) {                           \
        emb_sort<I>(idx, n, keys);                                                                               \
    })
EMBER_EMB_SORT(i64, i64)
EMBER_EMB_SORT(i32, i32)

#define EMBER_EMB_BACKWARD(T, name)                                                                              \
    EMBER_IN_UNIT(embedding_backward_##name,                                                                     \
    extern "C" __global__ void embedding_backward_##name EMBER_PARAMS_embedding_backward(T) {                    \
        emb_backward<T>(g, keys, n, d, rows, out, add);                                                               \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_EMB_BACKWARD)
