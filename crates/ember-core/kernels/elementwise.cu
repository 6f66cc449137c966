// Elementwise ops over two or three operands already broadcast to one shape: arithmetic,
// comparisons, logical ops and `where`. The output is always row-major.
//
// Arithmetic, comparisons and logical ops have one kernel per op and dtype
// (`binary_add_f32`, `compare_lt_i64`, `logical_and`), each its own compile unit, so a program
// compiles only the ops it uses. The ops and their names come from the op tables
// (`backend/table.rs`): each is one line below; which dtypes an arithmetic op has follows the
// table's `ints` and `bools` columns, and CI's NVRTC compile checks that the two agree.
// The `mode` argument picks the loop shape the host found:
//   0: every operand row-major (vectorized 16-byte loads and stores when aligned)
//   1: `a` row-major, `b` one broadcast element      2: `a` one broadcast element, `b` row-major
//   3: any strides (Strided: stride[0] = a, stride[1] = b, stride[2] = cond for `where`)
//
// Parameters: `binary`, `compare`, `logical`, `where_select` and `check_pow_exponent` in
// `cuda/launch.rs`.

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// The vectorized loop of modes 0-2: each thread moves UNROLL packs of 16 bytes per operand per
// iteration, all loads issued before any store, so enough bytes are in flight to reach HBM
// bandwidth with a grid of a few blocks per SM.
template <int MODE, typename In, typename Out, typename F>
__device__ __forceinline__ void vector_loop(const In* __restrict__ a, const In* __restrict__ b,
                                            Out* __restrict__ out, i64 nv, F f) {
    constexpr int V = 16 / sizeof(In) < 16 ? 16 / sizeof(In) : 16;
    constexpr int UNROLL = 4;
    const Pack<In, V>* pa = (const Pack<In, V>*)a;
    const Pack<In, V>* pb = (const Pack<In, V>*)b;
    Pack<Out, V>* po = (Pack<Out, V>*)out;
    const In sa = a[0], sb = b[0];
    const i64 stride = (i64)blockDim.x * gridDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x; base < nv; base += UNROLL * stride) {
        Pack<In, V> x[UNROLL], y[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            i64 i = base + u * stride;
            if (i < nv) {
                if (MODE != 2) x[u] = pa[i];
                if (MODE != 1) y[u] = pb[i];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            i64 i = base + u * stride;
            if (i < nv) {
                Pack<Out, V> r;
#pragma unroll
                for (int k = 0; k < V; ++k) r.v[k] = f(MODE == 2 ? sa : x[u].v[k], MODE == 1 ? sb : y[u].v[k]);
                po[i] = r;
            }
        }
    }
}

// Runs out[i] = f(a[i], b[i]) over the shape in the loop `mode` asks for. `f` takes and returns
// storage types (it converts to the arithmetic type itself).
template <typename In, typename Out, typename F>
__device__ __forceinline__ void for_each2(const In* __restrict__ a, const In* __restrict__ b, Out* __restrict__ out,
                                          const Strided& s, i64 n, int mode, F f) {
    constexpr int V = 16 / sizeof(In) < 16 ? 16 / sizeof(In) : 16;
    if (mode == 3) {
        EMBER_KERNEL_LOOP(i, n) {
            Offsets<2> o = strided_offsets<2>(s, i);
            out[i] = f(a[o.v[0]], b[o.v[1]]);
        }
        return;
    }
    const In* vec_src = mode == 2 ? b : a;
    bool aligned = ((u64)vec_src % (sizeof(In) * V) == 0) && ((u64)out % (sizeof(Out) * V) == 0) &&
                   (mode != 0 || (u64)b % (sizeof(In) * V) == 0);
    i64 done = 0;
    if (aligned) {
        i64 nv = n / V;
        if (mode == 0) vector_loop<0>(a, b, out, nv, f);
        else if (mode == 1) vector_loop<1>(a, b, out, nv, f);
        else vector_loop<2>(a, b, out, nv, f);
        done = nv * V;
    }
    EMBER_KERNEL_LOOP(j, n - done) {
        i64 i = done + j;
        out[i] = f(mode == 2 ? a[0] : a[i], mode == 1 ? b[0] : b[i]);
    }
}

template <typename A> __device__ __forceinline__ A power(A x, A y) {
    // Integers: exponentiation by squaring with wrapping, exponent >= 0 (checked by
    // check_pow_exponent_I, which runs before).
    A r = 1;
    unsigned long long e = (unsigned long long)y;
    while (e) {
        if (e & 1) r = (A)(r * x);
        x = (A)(x * x);
        e >>= 1;
    }
    return r;
}
template <> __device__ __forceinline__ float power<float>(float x, float y) { return powf(x, y); }
template <> __device__ __forceinline__ double power<double>(double x, double y) { return pow(x, y); }

// f32's logarithm in f64, rounded once: CUDA's logf is up to 1 ulp off, the CPU's (glibc) is
// correctly rounded in nearly all cases, and this reproduces it (as `unary.cu`'s f32 math).
__device__ __forceinline__ float log_of(float x) { return (float)log((double)x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

// An arithmetic op: `expr` of `x` and `y` in the arithmetic type A = Acc<T>, stored back as T,
// with its kernel in the float dtypes (`EMBER_BINARY_FLOAT`) or in every dtype but bool
// (`EMBER_BINARY`); `EMBER_BINARY_BOOL(op, f)` adds the bool kernel, `f` the bool functor.
#define EMBER_BINARY_OP(op, expr)                                                                   \
    template <typename T> struct Binary_##op {                                                      \
        __device__ __forceinline__ T operator()(T xs, T ys) const {                                 \
            typedef typename Acc<T>::type A;                                                        \
            A x = load(xs), y = load(ys);                                                           \
            return cast<T>((A)(expr));                                                              \
        }                                                                                           \
    };
#define EMBER_BINARY_KERNEL(op, T, name, F)                                                         \
    EMBER_IN_UNIT(binary_##op##_##name,                                                             \
    extern "C" __global__ void binary_##op##_##name EMBER_PARAMS_binary(T) {                        \
        for_each2(a, b, out, s, n, mode, F());                                                      \
    })
#define EMBER_BINARY_FLOAT(op, expr)                                                                \
    EMBER_BINARY_OP(op, expr)                                                                       \
    EMBER_BINARY_KERNEL(op, float, f32, Binary_##op<float>)                                         \
    EMBER_BINARY_KERNEL(op, double, f64, Binary_##op<double>)                                       \
    EMBER_BINARY_KERNEL(op, f16, f16, Binary_##op<f16>)                                             \
    EMBER_BINARY_KERNEL(op, bf16, bf16, Binary_##op<bf16>)
#define EMBER_BINARY(op, expr)                                                                      \
    EMBER_BINARY_FLOAT(op, expr)                                                                    \
    EMBER_BINARY_KERNEL(op, i64, i64, Binary_##op<i64>)                                             \
    EMBER_BINARY_KERNEL(op, i32, i32, Binary_##op<i32>)                                             \
    EMBER_BINARY_KERNEL(op, u8, u8, Binary_##op<u8>)
#define EMBER_BINARY_BOOL(op, F) EMBER_BINARY_KERNEL(op, bool, bool, F)

struct OrOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x | y; } };
struct AndOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x & y; } };
struct XorOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x ^ y; } };

EMBER_BINARY(add, x + y)
EMBER_BINARY_BOOL(add, OrOp)
EMBER_BINARY(sub, x - y)
EMBER_BINARY(mul, x * y)
EMBER_BINARY_BOOL(mul, AndOp)
// Integers never reach div (true division promotes them to float on the host).
EMBER_BINARY_FLOAT(div, x / y)
EMBER_BINARY(pow, power<A>(x, y))
// NaN propagates, as in PyTorch.
EMBER_BINARY(maximum, (x != x || x > y) ? x : y)
EMBER_BINARY_BOOL(maximum, OrOp)
EMBER_BINARY(minimum, (x != x || x < y) ? x : y)
EMBER_BINARY_BOOL(minimum, AndOp)
// 0 where x == 0 unless y is NaN (PyTorch's `xlogy`).
EMBER_BINARY_FLOAT(xlogy, y != y ? y : (x == (A)0 ? (A)0 : x * log_of(y)))

// Note [Mixed operands]: `a op b` for a float32 operand beside a float16 or bfloat16 one (either
// order), for the ops the table promotes with `CommonMixed` (add, sub, mul): each operand is
// read in its own dtype and the op computed in float32, the value the cast to float32 and the
// f32 kernel give, without the cast's kernel and its float32 copy. GPT-2's residual stream
// (float32) adds each block's bfloat16 output so: 24 casts of [8192, 768] a step. PyTorch's
// TensorIterator computes such pairs in one kernel too. Kernels `binary_<op>_<a>_<b>`, output
// float32; `mode` as above, 4 elements a thread in the vector modes.
template <int MODE, typename TA, typename TB, typename F>
__device__ __forceinline__ void mixed_vector_loop(const TA* __restrict__ a, const TB* __restrict__ b,
                                                  float* __restrict__ out, i64 nv, F f) {
    const Pack<TA, 4>* pa = (const Pack<TA, 4>*)a;
    const Pack<TB, 4>* pb = (const Pack<TB, 4>*)b;
    Pack<float, 4>* po = (Pack<float, 4>*)out;
    const float sa = load(a[0]), sb = load(b[0]);
    EMBER_KERNEL_LOOP(i, nv) {
        Pack<TA, 4> x;
        Pack<TB, 4> y;
        if (MODE != 2) x = pa[i];
        if (MODE != 1) y = pb[i];
        Pack<float, 4> r;
#pragma unroll
        for (int k = 0; k < 4; ++k) r.v[k] = f(MODE == 2 ? sa : load(x.v[k]), MODE == 1 ? sb : load(y.v[k]));
        po[i] = r;
    }
}

template <typename TA, typename TB, typename F>
__device__ __forceinline__ void for_each_mixed(const TA* __restrict__ a, const TB* __restrict__ b,
                                               float* __restrict__ out, const Strided& s, i64 n, int mode, F f) {
    if (mode == 3) {
        EMBER_KERNEL_LOOP(i, n) {
            Offsets<2> o = strided_offsets<2>(s, i);
            out[i] = f(load(a[o.v[0]]), load(b[o.v[1]]));
        }
        return;
    }
    bool aligned = (u64)out % 16 == 0 && (mode == 2 || (u64)a % (4 * sizeof(TA)) == 0) &&
                   (mode == 1 || (u64)b % (4 * sizeof(TB)) == 0);
    i64 done = 0;
    if (aligned) {
        i64 nv = n / 4;
        if (mode == 0) mixed_vector_loop<0>(a, b, out, nv, f);
        else if (mode == 1) mixed_vector_loop<1>(a, b, out, nv, f);
        else mixed_vector_loop<2>(a, b, out, nv, f);
        done = nv * 4;
    }
    EMBER_KERNEL_LOOP(j, n - done) {
        i64 i = done + j;
        out[i] = f(load(mode == 2 ? a[0] : a[i]), load(mode == 1 ? b[0] : b[i]));
    }
}

#define EMBER_BINARY_MIXED_KERNEL(op, TA, an, TB, bn)                                               \
    EMBER_IN_UNIT(binary_##op##_##an##_##bn,                                                        \
    extern "C" __global__ void binary_##op##_##an##_##bn EMBER_PARAMS_binary_mixed(TA, TB) {        \
        for_each_mixed(a, b, out, s, n, mode, Binary_##op<float>());                                \
    })
#define EMBER_BINARY_MIXED(op)                                                                      \
    EMBER_BINARY_MIXED_KERNEL(op, float, f32, bf16, bf16)                                           \
    EMBER_BINARY_MIXED_KERNEL(op, bf16, bf16, float, f32)                                           \
    EMBER_BINARY_MIXED_KERNEL(op, float, f32, f16, f16)                                             \
    EMBER_BINARY_MIXED_KERNEL(op, f16, f16, float, f32)
EMBER_BINARY_MIXED(add)
EMBER_BINARY_MIXED(sub)
EMBER_BINARY_MIXED(mul)

// GELU's backward, `gelu_backward(grad, self)` (x = grad, y = the GELU's input), as the CPU's
// (`cpu/binary.rs`) and PyTorch's `GeluBackwardCUDAKernelImpl`: one kernel instead of the ~19
// elementwise ops of the composite, computed in A and rounded once.
//   erf:  x · (Φ(y) + y φ(y)),  Φ(y) = (1 + erf(y / √2)) / 2,  φ(y) = e^(-y²/2) / √(2π)
//   tanh: with u = √(2/π) (y + κy³), t = tanh u:  x · (½(1 + t) + ½y (1 - t²) √(2/π) (1 + 3κy²))
__device__ __forceinline__ float gb_erf(float v) { return erff(v); }
__device__ __forceinline__ double gb_erf(double v) { return erf(v); }
__device__ __forceinline__ float gb_exp(float v) { return expf(v); }
__device__ __forceinline__ double gb_exp(double v) { return exp(v); }
__device__ __forceinline__ float gb_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double gb_tanh(double v) { return tanh(v); }
template <typename A> __device__ __forceinline__ A gelu_grad(A g, A v) {
    const A cdf = (A)0.5 * ((A)1 + gb_erf(v * (A)0.70710678118654752440));
    const A pdf = gb_exp((A)-0.5 * v * v) * (A)0.39894228040143267794;
    return g * (cdf + v * pdf);
}
template <typename A> __device__ __forceinline__ A gelu_tanh_grad(A g, A v) {
    const A k = (A)0.7978845608028654, kappa = (A)0.044715;
    const A v2 = v * v;
    const A t = gb_tanh(k * (v + kappa * v2 * v));
    return g * ((A)0.5 * ((A)1 + t) + (A)0.5 * v * ((A)1 - t * t) * k * ((A)1 + (A)3 * kappa * v2));
}
EMBER_BINARY_FLOAT(gelu_backward, gelu_grad<A>(x, y))
EMBER_BINARY_FLOAT(gelu_tanh_backward, gelu_tanh_grad<A>(x, y))

// The logical ops of two bool operands.
#define EMBER_LOGICAL(op, F)                                                                        \
    EMBER_IN_UNIT(logical_##op,                                                                     \
    extern "C" __global__ void logical_##op EMBER_PARAMS_logical {                                  \
        for_each2(a, b, out, s, n, mode, F());                                                      \
    })
EMBER_LOGICAL(and, AndOp)
EMBER_LOGICAL(or, OrOp)
EMBER_LOGICAL(xor, XorOp)

#define EMBER_CMP(name, expr)                                                                     \
    template <typename T> struct name {                                                           \
        __device__ __forceinline__ bool operator()(T xs, T ys) const {                            \
            auto x = load(xs);                                                                    \
            auto y = load(ys);                                                                    \
            return expr;                                                                          \
        }                                                                                         \
    };
EMBER_CMP(EqOp, x == y)
EMBER_CMP(NeOp, x != y)
EMBER_CMP(LtOp, x < y)
EMBER_CMP(LeOp, x <= y)
EMBER_CMP(GtOp, x > y)
EMBER_CMP(GeOp, x >= y)

// A comparison: its functor (above) and its kernel in every dtype.
#define EMBER_COMPARE_KERNEL(op, F, T, name)                                                        \
    EMBER_IN_UNIT(compare_##op##_##name,                                                            \
    extern "C" __global__ void compare_##op##_##name EMBER_PARAMS_compare(T) {                      \
        for_each2(a, b, out, s, n, mode, F<T>());                                                   \
    })
#define EMBER_COMPARE(op, F)                                                                        \
    EMBER_COMPARE_KERNEL(op, F, float, f32) EMBER_COMPARE_KERNEL(op, F, double, f64)                \
    EMBER_COMPARE_KERNEL(op, F, f16, f16) EMBER_COMPARE_KERNEL(op, F, bf16, bf16)                   \
    EMBER_COMPARE_KERNEL(op, F, i64, i64) EMBER_COMPARE_KERNEL(op, F, i32, i32)                     \
    EMBER_COMPARE_KERNEL(op, F, u8, u8) EMBER_COMPARE_KERNEL(op, F, bool, bool)
EMBER_COMPARE(eq, EqOp)
EMBER_COMPARE(ne, NeOp)
EMBER_COMPARE(lt, LtOp)
EMBER_COMPARE(le, LeOp)
EMBER_COMPARE(gt, GtOp)
EMBER_COMPARE(ge, GeOp)

#define EMBER_WHERE(T, name)                                                                                  \
    EMBER_IN_UNIT(where_select_##name,                                                                        \
    extern "C" __global__ void where_select_##name EMBER_PARAMS_where_select(T) {                             \
        EMBER_KERNEL_LOOP(i, n) {                                                                             \
            Offsets<3> o = strided_offsets<3>(s, i);                                                          \
            out[i] = cond[o.v[2]] ? a[o.v[0]] : b[o.v[1]];                                                    \
        }                                                                                                     \
    })
EMBER_FOR_ALL_DTYPES(EMBER_WHERE)

// Integer pow's exponent check (the CPU refuses negative exponents): the first negative one is
// recorded for the host to report at its next synchronizing call, so the op never reads back.
#define EMBER_POW_CHECK(I, name)                                                                              \
    EMBER_IN_UNIT(check_pow_exponent_##name,                                                                  \
    extern "C" __global__ void check_pow_exponent_##name EMBER_PARAMS_check_pow_exponent(I) {                 \
        FirstBad first = no_bad();                                                                            \
        EMBER_KERNEL_LOOP(i, n) {                                                                             \
            I e = b[strided_offset(s, 0, i)];                                                                 \
            if (e < 0) note_bad(first, (u64)i, (i64)e);                                                       \
        }                                                                                                     \
        report_bad(check, first);                                                                             \
    })
EMBER_POW_CHECK(i64, i64)
EMBER_POW_CHECK(i32, i32)
