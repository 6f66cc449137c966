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
// EMBER_OPTIM_ILP of them at a time with all loads issued before the arithmetic.
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

template <typename T>
__device__ __forceinline__ void adam(const TensorList& l, double lr_arg, double beta1_, double omb1_, double beta2_,
                                     double omb2_, double eps_, double wd_, const float* grad_scale,
                                     const float* found_inf, const double* lr_ptr, int flags) {
    typedef typename Acc<T>::type A;
    if (found_inf && *found_inf != 0.0f) return;  // a skipped step writes nothing
    const double lr_ = lr_ptr ? *lr_ptr : lr_arg;
    const double decay_ = __dsub_rn(1.0, __dmul_rn(lr_, wd_));  // AdamW: 1 - lr * weight_decay
    const A omb1 = (A)omb1_, beta2 = (A)beta2_, omb2 = (A)omb2_, eps = (A)eps_, wd = (A)wd_, decay = (A)decay_;
    const bool amsgrad = flags & 1, maximize = flags & 2, decoupled = flags & 4, device_steps = flags & 8;
    const A scale = grad_scale ? (A)*grad_scale : (A)1;
    // Device steps: the step size and sqrt(bias_correction2) of tensor `prev_t`, computed by
    // thread 0 into `s_scalars` and copied by every thread into `dev_scalars` (see below).
    __shared__ double s_scalars[2];
    double dev_scalars[2] = {0.0, 0.0};
    int prev_t = -1;
    const i64 total = l.chunk_start[l.n];
    for (i64 c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = tensor_of_chunk(l, c);
        const i64 begin = (c - l.chunk_start[t]) * EMBER_OPTIM_CHUNK;
        const i64 len = min((i64)EMBER_OPTIM_CHUNK, l.numel[t] - begin);
        T* __restrict__ p = (T*)l.ptr[0][t] + begin;
        T* __restrict__ g = (T*)l.ptr[1][t] + begin;
        T* __restrict__ m = (T*)l.ptr[2][t] + begin;
        T* __restrict__ v = (T*)l.ptr[3][t] + begin;
        T* __restrict__ vmax = amsgrad ? (T*)l.ptr[4][t] + begin : (T*)0;
        double step_size = device_steps ? 0.0 : __ddiv_rn(lr_, l.scalar[0][t]), bc2_sqrt_ = l.scalar[1][t];
        if (device_steps) {
            // As the host computes them (`ops/fused_optim.rs`), from the device step count:
            // two double-precision pows, computed once per tensor by one thread and shared
            // through shared memory (per thread and chunk they cost more than the update).
            // Every thread knows `t` (the loop over chunks is uniform across the block), so the
            // test, and with it the barriers, is uniform; `s_scalars` is read only between the
            // second barrier and the first one of the next tensor, and written only between
            // the two (a flag in shared memory written there too raced with its reads).
            if (t != prev_t) {
                __syncthreads();  // every thread has read the previous values
                if (threadIdx.x == 0) {
                    const double step = (double)*(const float*)l.ptr[5][t];
                    s_scalars[0] = __ddiv_rn(lr_, __dsub_rn(1.0, pow(beta1_, step)));
                    s_scalars[1] = __dsqrt_rn(__dsub_rn(1.0, pow(beta2_, step)));
                }
                __syncthreads();
                dev_scalars[0] = s_scalars[0];
                dev_scalars[1] = s_scalars[1];
                prev_t = t;
            }
            step_size = dev_scalars[0];
            bc2_sqrt_ = dev_scalars[1];
        }
        const A neg_step_size = (A)(-step_size);
        const A bc2_sqrt = (A)bc2_sqrt_;
        for (i64 base = threadIdx.x; base < len; base += (i64)blockDim.x * EMBER_OPTIM_ILP) {
            A rp[EMBER_OPTIM_ILP], rg[EMBER_OPTIM_ILP], rm[EMBER_OPTIM_ILP], rv[EMBER_OPTIM_ILP],
                rx[EMBER_OPTIM_ILP];
#pragma unroll
            for (int k = 0; k < EMBER_OPTIM_ILP; ++k) {
                const i64 i = base + (i64)k * blockDim.x;
                if (i < len) {
                    rp[k] = load(p[i]);
                    rg[k] = load(g[i]);
                    rm[k] = load(m[i]);
                    rv[k] = load(v[i]);
                    rx[k] = amsgrad ? load(vmax[i]) : (A)0;
                }
            }
#pragma unroll
            for (int k = 0; k < EMBER_OPTIM_ILP; ++k) {
                const i64 i = base + (i64)k * blockDim.x;
                if (i >= len) continue;
                A pv = rp[k], gv = rg[k], mv = rm[k], vv = rv[k];
                if (grad_scale) {
                    gv = div_rn(gv, scale);
                    g[i] = cast<T>(gv);
                }
                if (maximize) gv = -gv;
                if (wd_ != 0.0) {
                    if (decoupled) pv = mul_rn(pv, decay);
                    else gv = add_rn(gv, mul_rn(pv, wd));
                }
                mv = add_rn(mv, mul_rn(sub_rn(gv, mv), omb1));
                vv = add_rn(mul_rn(vv, beta2), mul_rn(mul_rn(gv, gv), omb2));
                A second = vv;
                if (amsgrad) {
                    const A x = rx[k];
                    second = (x != x || x > vv) ? x : vv;
                    vmax[i] = cast<T>(second);
                }
                const A denom = add_rn(div_rn(sqrt_rn(second), bc2_sqrt), eps);
                pv = add_rn(pv, mul_rn(div_rn(mv, denom), neg_step_size));
                p[i] = cast<T>(pv);
                m[i] = cast<T>(mv);
                v[i] = cast<T>(vv);
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
    extern "C" __global__ void adam_##name EMBER_PARAMS_adam(T) {                                           \
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
