// Softmax and log_softmax along one dim of any strided input, and their backward from the
// saved output, as the CPU backend (`cpu/softmax.rs`) computes them:
//   softmax     y = exp(x - max) * (1 / Σ exp(x - max))
//   log_softmax y = (x - max) - log Σ exp(x - max)
//   backward    softmax: dx = y (g - Σ g y)      log_softmax: dx = g - exp(y) Σ g
// f16/bf16 compute in f32, f32 in f32, f64 in f64; results are rounded once on store.
//
// Geometry: a "row" is the K elements along the dim for one index of the other dims. `rows`
// is a merged `Strided` over the other dims (row-major row index r) whose stride[w] gives the
// base offset of row r in operand w; along the row, operand w advances by its own stride
// (xs / ys / gs / os). The output is row-major over the full shape. The block is (bx, by):
//   row mode (`row` = 1): by rows per block, bx lanes (x, a multiple of 32) read each row
//       (the dim is the last one in memory: lanes read consecutive elements);
//   col mode (`row` = 0): bx rows per block (neighbouring rows adjacent in memory, e.g.
//       softmax over dim 0), by lanes (y, a power of two) per row.
// blockIdx.x strides over groups of rows. The forward reads each row three times (max, Σ exp,
// outputs) and the backward twice; the rereads of a row come from L1/L2.
// Dynamic shared memory: bx * by * sizeof(A) bytes (A = f32 or f64). T in f32 f64 f16 bf16.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

__device__ __forceinline__ float sm_exp(float x) { return expf(x); }
__device__ __forceinline__ double sm_exp(double x) { return exp(x); }
__device__ __forceinline__ float sm_log(float x) { return logf(x); }
__device__ __forceinline__ double sm_log(double x) { return log(x); }
__device__ __forceinline__ float sm_neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double sm_neg_inf(double) { return __longlong_as_double(0xfff0000000000000ll); }

struct SumF {
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct MaxF {  // NaN propagates, as the CPU's max_nan
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return (b > a || b != b) ? b : a; }
};

extern __shared__ __align__(16) unsigned char softmax_smem[];

// Combines `v` over the lanes of each row; every lane gets the result. Called by all threads
// of the block the same number of times.
template <typename A, typename F> __device__ __forceinline__ A row_allreduce(A v, F f, int row) {
    A* sm = (A*)softmax_smem;
    const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
    if (row) {
        // bx is a multiple of 32, so every warp lies inside one row.
        for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (bx == 32) return v;
        const int warps = bx >> 5;
        __syncthreads();  // the previous call's readers are done with `sm`
        if ((tx & 31) == 0) sm[ty * warps + (tx >> 5)] = v;
        __syncthreads();
        A r = sm[ty * warps];
        for (int w = 1; w < warps; ++w) r = f(r, sm[ty * warps + w]);
        return r;
    }
    __syncthreads();
    sm[ty * bx + tx] = v;
    __syncthreads();
    for (int h = by >> 1; h > 0; h >>= 1) {
        if (ty < h) {
            v = f(v, sm[(ty + h) * bx + tx]);
            sm[ty * bx + tx] = v;
        }
        __syncthreads();
    }
    return sm[tx];
}

__device__ __forceinline__ i64 row_base(const Strided& s, int which, i64 r) {
    if (s.ndim == 0) return 0;
    if (s.ndim == 1) return r * s.stride[which][0];
    return strided_offset(s, which, r);
}

template <typename T>
__device__ void softmax_fwd(const T* x, T* out, const Strided& rows, i64 nrows, i64 k, i64 xs, i64 os, int log,
                            int row) {
    typedef typename Acc<T>::type A;
    const int lane = row ? threadIdx.x : threadIdx.y, lanes = row ? blockDim.x : blockDim.y;
    const int slot = row ? threadIdx.y : threadIdx.x, slots = row ? blockDim.y : blockDim.x;
    const i64 groups = (nrows + slots - 1) / slots;
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const i64 r = g * slots + slot;
        const bool live = r < nrows;
        const T* xr = x;
        T* orow = out;
        if (live) {
            xr = x + row_base(rows, 0, r);
            orow = out + row_base(rows, 1, r);
        }
        A m = sm_neg_inf((A)0);
        if (live)
            for (i64 j = lane; j < k; j += lanes) m = MaxF()(m, load(xr[j * xs]));
        m = row_allreduce(m, MaxF(), row);
        A s = (A)0;
        if (live)
            for (i64 j = lane; j < k; j += lanes) s += sm_exp(load(xr[j * xs]) - m);
        s = row_allreduce(s, SumF(), row);
        if (!live) continue;
        if (log) {
            const A ls = sm_log(s);
            for (i64 j = lane; j < k; j += lanes) orow[j * os] = cast<T>((load(xr[j * xs]) - m) - ls);
        } else {
            const A inv = (A)1 / s;
            for (i64 j = lane; j < k; j += lanes) orow[j * os] = cast<T>(sm_exp(load(xr[j * xs]) - m) * inv);
        }
    }
}

template <typename T>
__device__ void softmax_bwd(const T* y, const T* g, T* out, const Strided& rows, i64 nrows, i64 k, i64 ys, i64 gs,
                            i64 os, int log, int row) {
    typedef typename Acc<T>::type A;
    const int lane = row ? threadIdx.x : threadIdx.y, lanes = row ? blockDim.x : blockDim.y;
    const int slot = row ? threadIdx.y : threadIdx.x, slots = row ? blockDim.y : blockDim.x;
    const i64 groups = (nrows + slots - 1) / slots;
    for (i64 b = blockIdx.x; b < groups; b += gridDim.x) {
        const i64 r = b * slots + slot;
        const bool live = r < nrows;
        const T* yr = y;
        const T* gr = g;
        T* orow = out;
        if (live) {
            yr = y + row_base(rows, 0, r);
            gr = g + row_base(rows, 1, r);
            orow = out + row_base(rows, 2, r);
        }
        A s = (A)0;
        if (live) {
            if (log)
                for (i64 j = lane; j < k; j += lanes) s += load(gr[j * gs]);
            else
                for (i64 j = lane; j < k; j += lanes) s += load(yr[j * ys]) * load(gr[j * gs]);
        }
        s = row_allreduce(s, SumF(), row);
        if (!live) continue;
        for (i64 j = lane; j < k; j += lanes) {
            const A yv = load(yr[j * ys]), gv = load(gr[j * gs]);
            orow[j * os] = cast<T>(log ? gv - sm_exp(yv) * s : yv * (gv - s));
        }
    }
}

#define EMBER_SOFTMAX(T, name)                                                                                   \
    EMBER_IN_UNIT(softmax_##name,                                                                                \
    extern "C" __global__ void softmax_##name EMBER_PARAMS_softmax(T) {                                          \
        softmax_fwd<T>(x, out, rows, nrows, k, xs, os, log, row);                                                \
    })                                                                                                           \
    EMBER_IN_UNIT(softmax_backward_##name,                                                                       \
    extern "C" __global__ void softmax_backward_##name EMBER_PARAMS_softmax_backward(T) {                        \
        softmax_bwd<T>(y, g, out, rows, nrows, k, ys, gs, os, log, row);                                         \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_SOFTMAX)
