// The device sort of `sort`, `argsort` and `topk` (`cuda_backend/sort.rs`, Note [Device sort]
// there): the first k positions of each of `rows` contiguous rows of n elements, in PyTorch's
// order, as the CPU backend (`cpu/sort.rs`) finds them:
//   - every element becomes a 64-bit key whose unsigned order is the order asked for
//     (`sort_key`: floats by their bits with the sign folded, -0.0 as 0.0, every NaN above
//     +inf; integers offset to unsigned; descending is the key's complement), and the pair
//     (key, position) is sorted lexicographically: positions are distinct, so the order is
//     total and ties keep their positions (stable) though no step below is stable itself;
//   - `sort_block_<T>`: one block a chunk of SORT_CHUNK elements of a row (a whole row when it
//     fits), blockDim.x = P / 2 threads for a power of two P >= the chunk, a bitonic sort of the
//     P (key, position) pairs in dynamic shared memory (P * 12 bytes; padding pairs sort last),
//     then the first min(k, chunk) pairs written: to `out` as int64 positions when the row is
//     one chunk, else to the chunk's run in `keys` / `idx` (runs of cap = min(k, SORT_CHUNK)
//     slots, row after row);
//   - `sort_merge`: one level of a merge of the runs, two by two, keeping only the first k of
//     each merged run (the first k of a union are among the first k of its parts): input run r
//     covers elements [r * span, (r + 1) * span) of its row and holds its first
//     min(k, covered) pairs in slots of cap = min(k, span); each pair's place in the merged run
//     is its place in its own run plus the number of pairs of the partner run before it (a
//     binary search: the pairs are distinct, so no two land on one place). One thread a slot,
//     grid-stride. The last level (one run a row left) writes the positions to `out`.
// Keys are read from x through `load`-free bit tests, so no value is rounded. Positions are
// u32 (n < 2^32 - 1, checked by the host; 0xffffffff marks padding).

#define SORT_CHUNK 2048

// The order-preserving key of one element, ascending (NaN above every number, -0.0 == 0.0).
__device__ __forceinline__ u64 sort_key(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffffffull;  // NaN, whatever its sign
    if ((u & 0x7fffffffu) == 0) u = 0;                        // -0.0 sorts as 0.0
    return (u & 0x80000000u) ? (u64)(~u) : (u64)(u | 0x80000000u);
}
__device__ __forceinline__ u64 sort_key(double x) {
    u64 u = (u64)__double_as_longlong(x);
    if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return ~0ull;
    if ((u & 0x7fffffffffffffffull) == 0) u = 0;
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}
__device__ __forceinline__ u64 sort_key_half(u32 b, u32 inf) {
    if ((b & 0x7fffu) > inf) return 0xffffull;
    if ((b & 0x7fffu) == 0) b = 0;
    return (b & 0x8000u) ? (u64)(~b & 0xffffu) : (u64)(b | 0x8000u);
}
__device__ __forceinline__ u64 sort_key(f16 x) { return sort_key_half(x.bits, 0x7c00u); }
__device__ __forceinline__ u64 sort_key(bf16 x) { return sort_key_half(x.bits, 0x7f80u); }
__device__ __forceinline__ u64 sort_key(i64 x) { return (u64)x ^ 0x8000000000000000ull; }
__device__ __forceinline__ u64 sort_key(i32 x) { return (u64)((u32)x ^ 0x80000000u); }
__device__ __forceinline__ u64 sort_key(u8 x) { return (u64)x; }
__device__ __forceinline__ u64 sort_key(bool x) { return x ? 1ull : 0ull; }

// (ka, ia) after (kb, ib) in the lexicographic order of the pairs.
__device__ __forceinline__ bool sort_after(u64 ka, u32 ia, u64 kb, u32 ib) {
    return ka > kb || (ka == kb && ia > ib);
}

extern __shared__ __align__(16) unsigned char sort_smem[];

template <typename T>
__device__ __forceinline__ void sort_block(const T* __restrict__ x, i64 n, i64 k, i64 chunks, int descending,
                                           u64* keys, u32* idx, i64* out) {
    const int P = blockDim.x * 2;
    u64* sk = (u64*)sort_smem;
    u32* si = (u32*)(sk + P);
    const i64 row = (i64)blockIdx.x / chunks, c = (i64)blockIdx.x - row * chunks;
    const i64 start = c * SORT_CHUNK;
    const i64 len = min((i64)SORT_CHUNK, n - start);
    const T* xr = x + row * n + start;
    const u64 flip = descending ? ~0ull : 0ull;
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        if (i < len) {
            sk[i] = sort_key(xr[i]) ^ flip;
            si[i] = (u32)(start + i);
        } else {
            sk[i] = ~0ull;
            si[i] = 0xffffffffu;
        }
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (P >> 1); t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1));  // the lower of the pair
                const int o = i + stride;
                const u64 ka = sk[i], kb = sk[o];
                const u32 ia = si[i], ib = si[o];
                // Ascending where bit `size` of i is clear, descending where set.
                if (sort_after(ka, ia, kb, ib) == ((i & size) == 0)) {
                    sk[i] = kb;
                    sk[o] = ka;
                    si[i] = ib;
                    si[o] = ia;
                }
            }
            __syncthreads();
        }
    }
    const i64 m = min(k, len);
    if (out != 0) {
        for (int i = threadIdx.x; i < m; i += blockDim.x) out[row * k + i] = (i64)si[i];
    } else {
        const i64 cap = min(k, (i64)SORT_CHUNK);
        const i64 base = (row * chunks + c) * cap;
        for (int i = threadIdx.x; i < m; i += blockDim.x) {
            keys[base + i] = sk[i];
            idx[base + i] = si[i];
        }
    }
}

#define EMBER_SORT_BLOCK(T, name)                                                                  \
    EMBER_IN_UNIT(sort_block_##name,                                                               \
    extern "C" __global__ void __launch_bounds__(1024) sort_block_##name EMBER_PARAMS_sort_block(T) { \
        sort_block<T>(x, n, k, chunks, descending, keys, idx, out);                                \
    })
EMBER_FOR_ALL_DTYPES(EMBER_SORT_BLOCK)

// The pairs run `r` of a level holds: its first k of the elements it covers.
__device__ __forceinline__ i64 sort_run_len(i64 r, i64 n, i64 k, i64 span) {
    return min(k, min(n, (r + 1) * span) - r * span);
}

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_sort_merge)
extern "C" __global__ void sort_merge EMBER_PARAMS_sort_merge {
    const i64 cap = min(k, span), runs_out = (runs + 1) >> 1, cap_out = min(k, 2 * span);
    const i64 per_row = runs * cap, per_row_out = runs_out * cap_out;
    const i64 total = rows * per_row;
    EMBER_KERNEL_LOOP(t, total) {
        const i64 row = t / per_row, rem = t - row * per_row;
        const i64 r = rem / cap, i = rem - r * cap;
        const i64 la = sort_run_len(r, n, k, span);
        if (i >= la) continue;
        const i64 partner = r ^ 1;
        const i64 lb = partner < runs ? sort_run_len(partner, n, k, span) : 0;
        const u64* kr = keys + row * per_row;
        const u32* ir = idx + row * per_row;
        const u64 key = kr[r * cap + i];
        const u32 id = ir[r * cap + i];
        // The partner's pairs before this one.
        const u64* pk = kr + partner * cap;
        const u32* pi = ir + partner * cap;
        i64 lo = 0, hi = lb;
        while (lo < hi) {
            const i64 mid = (lo + hi) >> 1;
            if (sort_after(key, id, pk[mid], pi[mid])) lo = mid + 1;
            else hi = mid;
        }
        const i64 pos = i + lo;
        if (pos >= min(k, la + lb)) continue;
        if (out != 0) {
            out[row * k + pos] = (i64)id;
        } else {
            const i64 o = row * per_row_out + (r >> 1) * cap_out + pos;
            keys_out[o] = key;
            idx_out[o] = id;
        }
    }
}
#endif
