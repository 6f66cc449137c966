// Gradient scaling for mixed precision (GradScaler's device side, PyTorch's
// `aten/src/ATen/native/cuda/AmpKernels.cu`): the fused inf/NaN check and unscale of many
// gradients, and the scale update. Both read their scalars (inverse scale, found-inf flag,
// scale, growth tracker) from device memory, so the host never waits for the device and the
// whole step can be captured in a CUDA graph. The host side is `cuda/amp.rs`; the CPU path
// (`cpu/amp.rs`) computes the same thing in the same order.
//
// Geometry of the multi-tensor kernel: as `optim.cu` (every tensor cut into chunks of
// EMBER_AMP_CHUNK elements, `chunk_start` the prefix count of chunks, blocks take chunks
// grid-stride, threads of a block take elements of the chunk blockDim.x apart).
//
// Arithmetic: each element is loaded to its arithmetic type (f32 for f16/bf16/f32, f64 for
// f64); a value that is inf or NaN sets *found_inf = 1; the value is multiplied by the f32
// inverse scale (skipped when it is exactly 1, as PyTorch does) with `_rn` intrinsics and
// rounded once on store. Many threads may store 1.0f into found_inf at once: they all store
// the same value, so the outcome does not depend on their order.
//
// Scale update (one thread): found_inf != 0 -> scale *= backoff_factor, growth_tracker = 0;
// otherwise growth_tracker += 1, and when it reaches growth_interval scale *= growth_factor
// (kept only when the result is finite) and growth_tracker = 0. The products are taken in f64
// and rounded to f32, as `(*current_scale) * growth_factor` in PyTorch's kernel.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

#define EMBER_AMP_MAX_TENSORS 128
#define EMBER_AMP_CHUNK 4096

// The tensors of one launch. Same layout as `AmpTensorList` in `cuda/amp.rs` (3088 bytes).
struct AmpTensorList {
    i32 n;
    i32 pad;
    u64 ptr[EMBER_AMP_MAX_TENSORS];
    i64 numel[EMBER_AMP_MAX_TENSORS];
    i64 chunk_start[EMBER_AMP_MAX_TENSORS + 1];
};

__device__ __forceinline__ bool amp_is_finite(float x) { return fabsf(x) <= 3.402823466e+38f; }
__device__ __forceinline__ bool amp_is_finite(double x) { return fabs(x) <= 1.7976931348623157e+308; }
__device__ __forceinline__ float amp_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double amp_mul(double a, double b) { return __dmul_rn(a, b); }

// The tensor that chunk `c` belongs to (n <= EMBER_AMP_MAX_TENSORS, a linear scan).
__device__ __forceinline__ int amp_tensor_of_chunk(const AmpTensorList& l, i64 c) {
    int t = 0;
    while (t + 1 < l.n && l.chunk_start[t + 1] <= c) ++t;
    return t;
}

template <typename T>
__device__ __forceinline__ void non_finite_check_and_unscale(const AmpTensorList& l, float* found_inf,
                                                             const float* inv_scale) {
    typedef typename Acc<T>::type A;
    const float inv_f = *inv_scale;
    const bool identity = inv_f == 1.0f;
    const A inv = (A)inv_f;
    bool found = false;
    const i64 total = l.chunk_start[l.n];
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = amp_tensor_of_chunk(l, c);
        const i64 begin = (c - l.chunk_start[t]) * EMBER_AMP_CHUNK;
        const i64 len = min((i64)EMBER_AMP_CHUNK, l.numel[t] - begin);
        T* __restrict__ p = (T*)l.ptr[t] + begin;
        for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
            const A v = load(p[i]);
            if (!amp_is_finite(v)) found = true;
            if (!identity) p[i] = cast<T>(amp_mul(v, inv));
        }
    }
    if (found) *found_inf = 1.0f;
}

#define EMBER_AMP_UNSCALE(T, name)                                                                   \
    EMBER_IN_UNIT(non_finite_check_and_unscale_##name,                                               \
    extern "C" __global__ void non_finite_check_and_unscale_##name                                   \
        EMBER_PARAMS_non_finite_check_and_unscale(T) {                                               \
        non_finite_check_and_unscale<T>(l, found_inf, inv_scale);                                    \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_AMP_UNSCALE)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_update_scale)
extern "C" __global__ void update_scale EMBER_PARAMS_update_scale {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (*found_inf != 0.0f) {  // NaN counts as found, as `if (*found_inf)` in PyTorch
        *scale = (float)__dmul_rn((double)*scale, backoff_factor);
        *growth_tracker = 0;
    } else {
        // A successful step: the tracker counts it before comparing with the interval.
        const i32 successful = *growth_tracker + 1;
        if (successful == growth_interval) {
            const float grown = (float)__dmul_rn((double)*scale, growth_factor);
            if (amp_is_finite(grown)) *scale = grown;  // never grow past f32's range to inf
            *growth_tracker = 0;
        } else {
            *growth_tracker = successful;
        }
    }
}
#endif

// The norms of many tensors (`torch._foreach_norm`, for `clip_grad_norm_`), in two launches a
// list of tensors, each deterministic: `foreach_norm_partials` reduces every chunk (the
// geometry above) to one f32, the sum of its squares (flags & 1: the largest |x|), into
// partials[c]; `foreach_norm_finish` reduces each tensor's chunks, one block a tensor in chunk
// order, into norms[t]: the square root of the sum (flags & 1: the maximum). Squares are taken
// and summed in f32 (f64 for f64 tensors) with `_rn` intrinsics; a NaN anywhere makes the norm
// NaN and an inf element makes it inf, as PyTorch's. blockDim.x a multiple of 32, <= 1024.
template <typename A> __device__ __forceinline__ A norm_combine(A a, A b, bool inf_norm) {
    if (inf_norm) return (b > a || b != b) ? b : a;
    return a + b;
}

template <typename A> __device__ __forceinline__ A norm_block_reduce(A v, bool inf_norm) {
    __shared__ A warps[32];
    v = inf_norm ? warp_max(v) : warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // a previous call's reads of `warps` are done
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    v = lane < nwarps ? warps[lane] : (A)0;
    if (warp == 0) v = inf_norm ? warp_max(v) : warp_sum(v);
    return v;  // valid in thread 0
}

template <typename T>
__device__ __forceinline__ void foreach_norm_partials(const AmpTensorList& l, float* partials, int flags) {
    typedef typename Acc<T>::type A;
    const bool inf_norm = flags & 1;
    const i64 total = l.chunk_start[l.n];
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = amp_tensor_of_chunk(l, c);
        const i64 begin = (c - l.chunk_start[t]) * EMBER_AMP_CHUNK;
        const i64 len = min((i64)EMBER_AMP_CHUNK, l.numel[t] - begin);
        const T* __restrict__ p = (const T*)l.ptr[t] + begin;
        A acc = (A)0;
        for (i64 i = threadIdx.x; i < len; i += blockDim.x) {
            const A v = load(p[i]);
            acc = norm_combine(acc, inf_norm ? (A)fabs(v) : amp_mul(v, v), inf_norm);
        }
        acc = norm_block_reduce(acc, inf_norm);
        if (threadIdx.x == 0) partials[c] = (float)acc;
    }
}

#define EMBER_AMP_NORM(T, name)                                                                      \
    EMBER_IN_UNIT(foreach_norm_partials_##name,                                                      \
    extern "C" __global__ void foreach_norm_partials_##name EMBER_PARAMS_foreach_norm_partials(T) {  \
        foreach_norm_partials<T>(l, partials, flags);                                                \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_AMP_NORM)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_foreach_norm_finish)
extern "C" __global__ void foreach_norm_finish EMBER_PARAMS_foreach_norm_finish {
    const bool inf_norm = flags & 1;
    for (int t = blockIdx.x; t < l.n; t += gridDim.x) {
        float acc = 0.0f;
        for (i64 c = l.chunk_start[t] + threadIdx.x; c < l.chunk_start[t + 1]; c += blockDim.x) {
            acc = norm_combine(acc, partials[c], inf_norm);
        }
        acc = norm_block_reduce(acc, inf_norm);
        if (threadIdx.x == 0) norms[t] = inf_norm ? acc : __fsqrt_rn(acc);
    }
}
#endif
