// Fused multi-tensor optimizer steps (Adam/AdamW and SGD): one launch updates up to
// EMBER_OPTIM_MAX_TENSORS parameters in place, with their gradients and state tensors; the host
// (`cuda/optim.rs`) loops over groups of that many. Formulas and their order are those of
// `ops/fused_optim.rs` (PyTorch's `_single_tensor_adam` / `_single_tensor_sgd`), and the CPU
// path (`cpu/optim.rs`) computes the same thing in the same order.
//
// Geometry: every tensor is cut into chunks of EMBER_OPTIM_CHUNK elements; `chunk_start` is the
// prefix count of chunks, so chunk c belongs to the tensor t with chunk_start[t] <= c <
// chunk_start[t + 1]. Blocks take chunks grid-stride (c = blockIdx.x, += gridDim.x), so any grid
// size covers every element; threads of a block take elements of the chunk blockDim.x apart,
// EMBER_OPTIM_ILP of them at a time with all loads issued before the arithmetic. Adam reads and
// writes a chunk whose operands are all 16-byte aligned in 16-byte vectors (Note [Adam's memory
// traffic]), the elements past its last whole vector (or of an unaligned chunk) one by one.
//
// Note [Adam's memory traffic]: Adam moves 28 bytes an f32 element (reads p, g, m, v; writes p,
// m, v) and does nothing else worth counting, so its time is its traffic over the bandwidth.
// GPT-2 124M's AdamW step (124.4 M f32 parameters, 148 tensors, 4 launches) took 1148 µs on an
// H200 (3.0 TB/s) with 4-byte accesses, a linear scan from tensor 0 for every chunk's tensor
// and, with device steps, two barriers and two f64 pows each time a block's chunk changed
// tensor. Now: one 16-byte vector per operand per thread (EMBER_OPTIM_VEC_ILP), the scan resumes
// where the block's previous chunk was (chunks only grow), every tensor's step size and
// sqrt(bias_correction2) are computed once per block into shared memory before the block's
// only barrier (issue 40's race came from a shared value written again after a later barrier;
// here nothing in shared memory is written after it), and launch bounds keep 80 registers for
// 3 blocks an SM: 892 µs (3.9 TB/s). Measured the same run: 2 vectors a thread with 2 blocks
// an SM 922 µs, 1 vector with 4 blocks (spills) 985 µs, 4 vectors with 1 block 960 µs.
// Kernel times from the profiler: `cuda_fused_adamw_gpt2_kernel_time` in
// `tests/it/fused_optim.rs`.
//
// Rounding: multiplications and additions go through the `_rn` intrinsics so NVRTC never
// contracts them into FMAs; with IEEE division and sqrt (NVRTC's defaults) f32 and f64 results
// are bit-identical to the CPU path. f16/bf16 are loaded to f32, computed, rounded once on store.
//
// Gradient scaling (GradScaler, PyTorch's `grad_scale=` / `found_inf=` of `_fused_adam_`): both
// are pointers to one f32 in device memory, or null. A nonzero *found_inf makes the whole launch
// return before writing anything; with grad_scale each gradient is divided by *grad_scale before
// the update and the quotient is stored back into the gradient (as PyTorch's fused kernels do).
//
// Learning rate (Note [Capturable optimizer steps] in `cuda/optim.rs`): `lr_ptr` is null (the
// `lr` argument is used) or points at one f64 in device memory that replaces it, so a step
// recorded in a CUDA graph uses the lr of the moment it is replayed. Everything derived from the
// lr (Adam's step size lr / bias_correction1, AdamW's factor 1 - lr * weight_decay, SGD's -lr)
// is formed here in f64, with the host's operations and rounding.
//
// Tensors of a list (`TensorList`): ptr[0] param, ptr[1] grad, then the state tensors (Adam:
// exp_avg, exp_avg_sq, max_exp_avg_sq; SGD: momentum_buffer), every pointer row-major with
// `numel[t]` elements; Adam's f32 step count in ptr[5]. Any grid, blockDim.x a multiple of 32
// (the host uses 256). T in f32 f64 f16 bf16.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs` (with the
// meaning of every pointer, scalar and flag).

#define EMBER_OPTIM_MAX_TENSORS 48
#define EMBER_OPTIM_CHUNK 4096
#define EMBER_OPTIM_ILP 4

// The tensors of one launch. Same layout as `TensorList` in `cuda/optim.rs` (3856 bytes, under
// the 4 KB kernel parameter limit of every driver with the other arguments).
struct TensorList {
    i32 n;
    i32 pad;
    u64 ptr[6][EMBER_OPTIM_MAX_TENSORS];
    i64 numel[EMBER_OPTIM_MAX_TENSORS];
    i64 chunk_start[EMBER_OPTIM_MAX_TENSORS + 1];
    double scalar[2][EMBER_OPTIM_MAX_TENSORS];
};

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// The tensor that chunk `c` belongs to (n <= EMBER_OPTIM_MAX_TENSORS, so a linear scan).
__device__ __forceinline__ int tensor_of_chunk(const TensorList& l, i64 c) {
    int t = 0;
    while (t + 1 < l.n && l.chunk_start[t + 1] <= c) ++t;
    return t;
}

// 16 bytes of T (4 f32, 2 f64, 8 f16/bf16), loaded and stored as one vector.
template <typename T> struct __align__(16) OptimVec {
    enum { N = 16 / sizeof(T) };
    T v[N];
};
template <typename T> __device__ __forceinline__ OptimVec<T> vload(const T* p) {
    OptimVec<T> r;
    *(uint4*)r.v = *(const uint4*)p;
    return r;
}
template <typename T> __device__ __forceinline__ void vstore(T* p, const OptimVec<T>& r) {
    *(uint4*)p = *(const uint4*)r.v;
}

// Adam's scalars shared by every element of a launch, in the math type A.
template <typename A> struct AdamConsts {
    A omb1, beta2, omb2, eps, wd, decay, scale;
    bool amsgrad, maximize, decoupled, has_wd, unscale, twins;
};

// The bf16 casts of a vector of stored T (Note [Cast twins]): 8 bytes for 4 f32, else one by one.
template <typename T> __device__ __forceinline__ void store_low(bf16* p, const OptimVec<T>& r) {
    if (OptimVec<T>::N == 4) {
        u32 w[2];
#pragma unroll
        for (int h = 0; h < 2; ++h)
            w[h] = (u32)cast<bf16>(load(r.v[2 * h])).bits | ((u32)cast<bf16>(load(r.v[2 * h + 1])).bits << 16);
        *(uint2*)p = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int i = 0; i < OptimVec<T>::N; ++i) p[i] = cast<bf16>(load(r.v[i]));
    }
}

// One element's update, in the order of `ops/fused_optim.rs`: p, g (unscaled when `unscale`),
// m, v in and out; x: max_exp_avg_sq in, the max written back out (amsgrad).
template <typename A>
__device__ __forceinline__ void adam_element(const AdamConsts<A>& k, A neg_step_size, A bc2_sqrt, A& pv, A& gv,
                                             A& mv, A& vv, A& x) {
    if (k.unscale) gv = div_rn(gv, k.scale);
    A gu = gv;
    if (k.maximize) gu = -gu;
    if (k.has_wd) {
        if (k.decoupled) pv = mul_rn(pv, k.decay);
        else gu = add_rn(gu, mul_rn(pv, k.wd));
    }
    mv = add_rn(mv, mul_rn(sub_rn(gu, mv), k.omb1));
    vv = add_rn(mul_rn(vv, k.beta2), mul_rn(mul_rn(gu, gu), k.omb2));
    A second = vv;
    if (k.amsgrad) {
        second = (x != x || x > vv) ? x : vv;
        x = second;
    }
    const A denom = add_rn(div_rn(sqrt_rn(second), bc2_sqrt), k.eps);
    pv = add_rn(pv, mul_rn(div_rn(mv, denom), neg_step_size));
}

// Vectors a thread has in flight per operand in the 16-byte path, and Adam blocks of up to 256
// threads an SM that the kernels' launch bounds keep registers for (Note [Adam's memory
// traffic]; `Grid::multi_tensor` launches 8 an SM, which then run in waves).
#define EMBER_OPTIM_VEC_ILP 1
#define EMBER_OPTIM_MIN_BLOCKS 3

template <typename T>
__device__ __forceinline__ void adam(const TensorList& l, double lr_arg, double beta1_, double omb1_, double beta2_,
                                     double omb2_, double eps_, double wd_, const float* grad_scale,
                                     const float* found_inf, const double* lr_ptr, int flags) {
    typedef typename Acc<T>::type A;
    typedef OptimVec<T> Vec;
    const int V = Vec::N;
    if (found_inf && *found_inf != 0.0f) return;  // a skipped step writes nothing (block-uniform)
    const double lr_ = lr_ptr ? *lr_ptr : lr_arg;
    const double decay_ = __dsub_rn(1.0, __dmul_rn(lr_, wd_));  // AdamW: 1 - lr * weight_decay
    AdamConsts<A> k;
    k.omb1 = (A)omb1_;
    k.beta2 = (A)beta2_;
    k.omb2 = (A)omb2_;
    k.eps = (A)eps_;
    k.wd = (A)wd_;
    k.decay = (A)decay_;
    k.scale = grad_scale ? (A)*grad_scale : (A)1;
    k.amsgrad = flags & 1;
    k.maximize = flags & 2;
    k.decoupled = flags & 4;
    k.has_wd = wd_ != 0.0;
    k.unscale = grad_scale != 0;
    k.twins = (flags & 16) && !k.amsgrad;
    const bool device_steps = flags & 8;
    // Every tensor's step size (lr / bias_correction1) and sqrt(bias_correction2), as the host
    // computes them (`ops/fused_optim.rs`): with device steps from the device step count (two
    // double-precision pows, which per thread and chunk would cost more than the update).
    // Written once, before the block's only barrier, and only read after it (Note [Adam's
    // memory traffic]); the early return above is the same for every thread of the block.
    __shared__ double s_step_size[EMBER_OPTIM_MAX_TENSORS], s_bc2_sqrt[EMBER_OPTIM_MAX_TENSORS];
    for (int t = threadIdx.x; t < l.n; t += blockDim.x) {
        if (device_steps) {
            const double step = (double)*(const float*)l.ptr[5][t];
            s_step_size[t] = __ddiv_rn(lr_, __dsub_rn(1.0, pow(beta1_, step)));
            s_bc2_sqrt[t] = __dsqrt_rn(__dsub_rn(1.0, pow(beta2_, step)));
        } else {
            s_step_size[t] = __ddiv_rn(lr_, l.scalar[0][t]);
            s_bc2_sqrt[t] = l.scalar[1][t];
        }
    }
    __syncthreads();
    const i64 total = l.chunk_start[l.n];
    int t = 0;  // the tensor of chunk c: c only grows, so the scan resumes where it stopped
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        while (t + 1 < l.n && l.chunk_start[t + 1] <= c) ++t;
        const i64 begin = (c - l.chunk_start[t]) * EMBER_OPTIM_CHUNK;
        const int len = (int)min((i64)EMBER_OPTIM_CHUNK, l.numel[t] - begin);
        T* __restrict__ p = (T*)l.ptr[0][t] + begin;
        T* __restrict__ g = (T*)l.ptr[1][t] + begin;
        T* __restrict__ m = (T*)l.ptr[2][t] + begin;
        T* __restrict__ v = (T*)l.ptr[3][t] + begin;
        T* __restrict__ vmax = k.amsgrad ? (T*)l.ptr[4][t] + begin : (T*)0;
        // Without amsgrad, ptr[4] may hold the parameter's bf16 twin (Note [Cast twins] in
        // `storage/mod.rs`): each updated element, correctly rounded, written beside it.
        bf16* __restrict__ low = k.twins && l.ptr[4][t] ? (bf16*)l.ptr[4][t] + begin : (bf16*)0;
        const A neg_step_size = (A)(-s_step_size[t]);
        const A bc2_sqrt = (A)s_bc2_sqrt[t];
        // 16-byte vectors when every operand of the chunk is 16-byte aligned (chunk starts are
        // EMBER_OPTIM_CHUNK elements apart, so this is the tensors' own alignment), then the
        // elements past the last whole vector (or all of them) one by one.
        const u64 addr_or = (u64)p | (u64)g | (u64)m | (u64)v | (u64)vmax | (u64)low;
        const int nv = addr_or % 16 == 0 ? len / V : 0;
        for (int base = threadIdx.x; base < nv; base += blockDim.x * EMBER_OPTIM_VEC_ILP) {
            Vec rp[EMBER_OPTIM_VEC_ILP], rg[EMBER_OPTIM_VEC_ILP], rm[EMBER_OPTIM_VEC_ILP],
                rv[EMBER_OPTIM_VEC_ILP], rx[EMBER_OPTIM_VEC_ILP];
#pragma unroll
            for (int j = 0; j < EMBER_OPTIM_VEC_ILP; ++j) {
                const int i = (base + j * blockDim.x) * V;
                if (i < nv * V) {
                    rp[j] = vload(p + i);
                    rg[j] = vload(g + i);
                    rm[j] = vload(m + i);
                    rv[j] = vload(v + i);
                    if (k.amsgrad) rx[j] = vload(vmax + i);
                }
            }
#pragma unroll
            for (int j = 0; j < EMBER_OPTIM_VEC_ILP; ++j) {
                const int i = (base + j * blockDim.x) * V;
                if (i >= nv * V) continue;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    A pv = load(rp[j].v[e]), gv = load(rg[j].v[e]), mv = load(rm[j].v[e]), vv = load(rv[j].v[e]);
                    A x = k.amsgrad ? load(rx[j].v[e]) : (A)0;
                    adam_element(k, neg_step_size, bc2_sqrt, pv, gv, mv, vv, x);
                    rp[j].v[e] = cast<T>(pv);
                    rg[j].v[e] = cast<T>(gv);
                    rm[j].v[e] = cast<T>(mv);
                    rv[j].v[e] = cast<T>(vv);
                    if (k.amsgrad) rx[j].v[e] = cast<T>(x);
                }
                if (k.unscale) vstore(g + i, rg[j]);
                if (k.amsgrad) vstore(vmax + i, rx[j]);
                vstore(p + i, rp[j]);
                if (low) store_low(low + i, rp[j]);
                vstore(m + i, rm[j]);
                vstore(v + i, rv[j]);
            }
        }
        for (int base = nv * V + threadIdx.x; base < len; base += blockDim.x * EMBER_OPTIM_ILP) {
            A rp[EMBER_OPTIM_ILP], rg[EMBER_OPTIM_ILP], rm[EMBER_OPTIM_ILP], rv[EMBER_OPTIM_ILP],
                rx[EMBER_OPTIM_ILP];
#pragma unroll
            for (int j = 0; j < EMBER_OPTIM_ILP; ++j) {
                const int i = base + j * blockDim.x;
                if (i < len) {
                    rp[j] = load(p[i]);
                    rg[j] = load(g[i]);
                    rm[j] = load(m[i]);
                    rv[j] = load(v[i]);
                    rx[j] = k.amsgrad ? load(vmax[i]) : (A)0;
                }
            }
#pragma unroll
            for (int j = 0; j < EMBER_OPTIM_ILP; ++j) {
                const int i = base + j * blockDim.x;
                if (i >= len) continue;
                adam_element(k, neg_step_size, bc2_sqrt, rp[j], rg[j], rm[j], rv[j], rx[j]);
                if (k.unscale) g[i] = cast<T>(rg[j]);
                if (k.amsgrad) vmax[i] = cast<T>(rx[j]);
                p[i] = cast<T>(rp[j]);
                if (low) low[i] = cast<bf16>(load(cast<T>(rp[j])));
                m[i] = cast<T>(rm[j]);
                v[i] = cast<T>(rv[j]);
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void sgd(const TensorList& l, double lr_arg, double momentum_, double omd_, double wd_,
                                    const float* grad_scale, const float* found_inf, const double* lr_ptr,
                                    int flags) {
    typedef typename Acc<T>::type A;
    if (found_inf && *found_inf != 0.0f) return;  // a skipped step writes nothing
    const double lr_ = lr_ptr ? *lr_ptr : lr_arg;
    const A scale = grad_scale ? (A)*grad_scale : (A)1;
    const A neg_lr = (A)(-lr_), momentum = (A)momentum_, omd = (A)omd_, wd = (A)wd_;
    const bool nesterov = flags & 1, maximize = flags & 2, first = flags & 4;
    const bool has_momentum = momentum_ != 0.0;
    const i64 total = l.chunk_start[l.n];
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = tensor_of_chunk(l, c);
        const i64 begin = (c - l.chunk_start[t]) * EMBER_OPTIM_CHUNK;
        const i64 len = min((i64)EMBER_OPTIM_CHUNK, l.numel[t] - begin);
        T* __restrict__ p = (T*)l.ptr[0][t] + begin;
        T* __restrict__ g = (T*)l.ptr[1][t] + begin;
        T* __restrict__ b = has_momentum ? (T*)l.ptr[2][t] + begin : (T*)0;
        for (i64 base = threadIdx.x; base < len; base += (i64)blockDim.x * EMBER_OPTIM_ILP) {
            A rp[EMBER_OPTIM_ILP], rg[EMBER_OPTIM_ILP], rb[EMBER_OPTIM_ILP];
#pragma unroll
            for (int k = 0; k < EMBER_OPTIM_ILP; ++k) {
                const i64 i = base + (i64)k * blockDim.x;
                if (i < len) {
                    rp[k] = load(p[i]);
                    rg[k] = load(g[i]);
                    rb[k] = (has_momentum && !first) ? load(b[i]) : (A)0;
                }
            }
#pragma unroll
            for (int k = 0; k < EMBER_OPTIM_ILP; ++k) {
                const i64 i = base + (i64)k * blockDim.x;
                if (i >= len) continue;
                A pv = rp[k], gv = rg[k];
                if (grad_scale) {
                    gv = div_rn(gv, scale);
                    g[i] = cast<T>(gv);
                }
                if (maximize) gv = -gv;
                if (wd_ != 0.0) gv = add_rn(gv, mul_rn(pv, wd));
                if (has_momentum) {
                    const A buf = first ? gv : add_rn(mul_rn(rb[k], momentum), mul_rn(gv, omd));
                    b[i] = cast<T>(buf);
                    gv = nesterov ? add_rn(gv, mul_rn(buf, momentum)) : buf;
                }
                p[i] = cast<T>(add_rn(pv, mul_rn(gv, neg_lr)));
            }
        }
    }
}

#define EMBER_OPTIM(T, name)                                                                               \
    EMBER_IN_UNIT(adam_##name,                                                                             \
    extern "C" __global__ void __launch_bounds__(256, EMBER_OPTIM_MIN_BLOCKS) adam_##name EMBER_PARAMS_adam(T) {                                           \
        adam<T>(l, lr, beta1, omb1, beta2, omb2, eps, wd, grad_scale, found_inf, lr_ptr, flags);            \
    })                                                                                                     \
    EMBER_IN_UNIT(sgd_##name,                                                                              \
    extern "C" __global__ void sgd_##name EMBER_PARAMS_sgd(T) {                                            \
        sgd<T>(l, lr, momentum, omd, wd, grad_scale, found_inf, lr_ptr, flags);                            \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_OPTIM)

// Adam's device step counts: one thread per tensor, `*ptr[5][t] += 1` unless *found_inf is
// nonzero; launched before the adam_T launches of the same tensors, on the same stream.
#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_increment_steps)
extern "C" __global__ void increment_steps EMBER_PARAMS_increment_steps {
    if (found_inf && *found_inf != 0.0f) return;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < l.n; t += blockDim.x * gridDim.x) {
        float* step = (float*)l.ptr[5][t];
        *step = __fadd_rn(*step, 1.0f);
    }
}
#endif
