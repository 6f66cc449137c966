// Elementwise functions of one operand (math functions and activations), with the CPU
// backend's formulas (`cpu/unary.rs`): f16/bf16 load into f32, compute, and round once on
// store; f32 computes in f32, f64 in f64. Integer inputs of float ops are cast to f32 on the
// host before launch (Note [Unary dtypes] in `ops/unary.rs`), so float kernels see floats only.
//
// One kernel per op and dtype, `unary_<op>_<T>`, each its own compile unit, so a program
// compiles only the ops it uses. The ops and their names come from the op table
// (`backend/table.rs`): each is one line below, `EMBER_UNARY(op, expression)` for the float
// dtypes (f32 f64 f16 bf16) and `EMBER_UNARY_INT(op, expression)` for the integer ones (i64
// i32 u8) of the ops that keep integers; CI's NVRTC compile checks that the two lists agree.
// `mode` picks the loop shape the host found:
//   0: input row-major (16-byte vector loads and stores when both pointers are aligned)
//   1: input of any strides (s.stride[0]); the output is always row-major
//
// Parameters: `unary` in `cuda/launch.rs`.

// Math functions by compute type: the f32 and f64 entry points of CUDA's math library.
template <typename R> struct Math;
// f32 transcendental functions are evaluated in f64 and rounded once: CUDA's f32 versions are
// up to 2 ulp off, the CPU's (glibc) are correctly rounded in nearly all cases, and computing
// in f64 reproduces those roundings, so CPU and GPU agree to the bit almost everywhere. Exact
// operations (abs, sqrt, rounding) stay in f32. With 4-byte elements the kernels stay
// memory-bound; the 2-byte dtypes use `MathF32` below.
template <> struct Math<float> {
#define EMBER_F32(name, fn) __device__ __forceinline__ static float name(float x) { return ::fn(x); }
#define EMBER_F32_VIA_F64(name, fn) \
    __device__ __forceinline__ static float name(float x) { return (float)::fn((double)x); }
    EMBER_F32(abs, fabsf) EMBER_F32(sqrt, sqrtf) EMBER_F32(floor, floorf) EMBER_F32(ceil, ceilf)
    EMBER_F32(rint, rintf) EMBER_F32(trunc, truncf)
    EMBER_F32_VIA_F64(exp, exp) EMBER_F32_VIA_F64(exp2, exp2) EMBER_F32_VIA_F64(expm1, expm1)
    EMBER_F32_VIA_F64(log, log) EMBER_F32_VIA_F64(log2, log2) EMBER_F32_VIA_F64(log10, log10)
    EMBER_F32_VIA_F64(log1p, log1p) EMBER_F32_VIA_F64(sin, sin) EMBER_F32_VIA_F64(cos, cos)
    EMBER_F32_VIA_F64(tan, tan) EMBER_F32_VIA_F64(asin, asin) EMBER_F32_VIA_F64(acos, acos)
    EMBER_F32_VIA_F64(atan, atan) EMBER_F32_VIA_F64(sinh, sinh) EMBER_F32_VIA_F64(cosh, cosh)
    EMBER_F32_VIA_F64(tanh, tanh) EMBER_F32_VIA_F64(erf, erf) EMBER_F32_VIA_F64(erfc, erfc)
    EMBER_F32_VIA_F64(erfinv, erfinv)
#undef EMBER_F32
#undef EMBER_F32_VIA_F64
};
template <> struct Math<double> {
#define EMBER_F64(name, fn) __device__ __forceinline__ static double name(double x) { return ::fn(x); }
    EMBER_F64(abs, fabs) EMBER_F64(sqrt, sqrt) EMBER_F64(exp, exp) EMBER_F64(exp2, exp2)
    EMBER_F64(expm1, expm1) EMBER_F64(log, log) EMBER_F64(log2, log2) EMBER_F64(log10, log10)
    EMBER_F64(log1p, log1p) EMBER_F64(sin, sin) EMBER_F64(cos, cos) EMBER_F64(tan, tan)
    EMBER_F64(asin, asin) EMBER_F64(acos, acos) EMBER_F64(atan, atan) EMBER_F64(sinh, sinh)
    EMBER_F64(cosh, cosh) EMBER_F64(tanh, tanh) EMBER_F64(erf, erf) EMBER_F64(erfc, erfc)
    EMBER_F64(floor, floor) EMBER_F64(ceil, ceil) EMBER_F64(rint, rint) EMBER_F64(trunc, trunc)
    EMBER_F64(erfinv, erfinv)
#undef EMBER_F64
};

// The math of f16 and bf16 kernels: CUDA's f32 functions, computed in f32 and rounded once to
// the 8- or 11-bit mantissa. Their error (at most 2 ulp of f32) changes the rounded result only
// for values within 2 f32 ulps of a rounding midpoint, while f64 math made GPT-2's tanh-GELU
// (25M bf16 elements) compute-bound at 0.9 TB/s, 111 µs a call; in f32, 37 µs (2.7 TB/s;
// docs/benchmarks.md, session 44).
struct MathF32 {
#define EMBER_F32(name, fn) __device__ __forceinline__ static float name(float x) { return ::fn(x); }
    EMBER_F32(abs, fabsf) EMBER_F32(sqrt, sqrtf) EMBER_F32(floor, floorf) EMBER_F32(ceil, ceilf)
    EMBER_F32(rint, rintf) EMBER_F32(trunc, truncf) EMBER_F32(exp, expf) EMBER_F32(exp2, exp2f)
    EMBER_F32(expm1, expm1f) EMBER_F32(log, logf) EMBER_F32(log2, log2f) EMBER_F32(log10, log10f)
    EMBER_F32(log1p, log1pf) EMBER_F32(sin, sinf) EMBER_F32(cos, cosf) EMBER_F32(tan, tanf)
    EMBER_F32(asin, asinf) EMBER_F32(acos, acosf) EMBER_F32(atan, atanf) EMBER_F32(sinh, sinhf)
    EMBER_F32(cosh, coshf) EMBER_F32(tanh, tanhf) EMBER_F32(erf, erff) EMBER_F32(erfc, erfcf)
    EMBER_F32(erfinv, erfinvf)
#undef EMBER_F32
};

// The math functions of a storage type's kernels.
template <typename T> struct MathOf { typedef Math<T> type; };
template <> struct MathOf<f16> { typedef MathF32 type; };
template <> struct MathOf<bf16> { typedef MathF32 type; };

template <typename T, int V> struct alignas(sizeof(T) * V) UPack { T v[V]; };

// out[i] = f(x[i]) over the `n` elements of the view: `f` maps storage type to storage type.
template <typename T, typename F>
__device__ __forceinline__ void map1(const T* __restrict__ x, T* __restrict__ out, const Strided& s, i64 n,
                                     int mode, F f) {
    constexpr int V = 16 / sizeof(T);
    if (mode != 0) {
        EMBER_KERNEL_LOOP(i, n) { out[i] = f(x[strided_offset(s, 0, i)]); }
        return;
    }
    i64 done = 0;
    if ((u64)x % 16 == 0 && (u64)out % 16 == 0) {
        i64 nv = n / V;
        const UPack<T, V>* px = (const UPack<T, V>*)x;
        UPack<T, V>* po = (UPack<T, V>*)out;
        EMBER_KERNEL_LOOP(i, nv) {
            UPack<T, V> a = px[i], r;
#pragma unroll
            for (int k = 0; k < V; ++k) r.v[k] = f(a.v[k]);
            po[i] = r;
        }
        done = nv * V;
    }
    EMBER_KERNEL_LOOP(j, n - done) { out[done + j] = f(x[done + j]); }
}

// Wraps a compute-type function `g(R) -> R` into a storage-type one.
template <typename T, typename G> struct Lift {
    G g;
    __device__ __forceinline__ T operator()(T v) const { return cast<T>(g(load(v))); }
};
template <typename T, typename G>
__device__ __forceinline__ void run(const T* x, T* out, const Strided& s, i64 n, int mode, G g) {
    map1(x, out, s, n, mode, Lift<T, G>{g});
}

// `min(max(x + 3, 0), 6) / 6`, NaN propagating, as the CPU's `hardsigmoid`.
template <typename R> __device__ __forceinline__ R hardsigmoid(R x) {
    R t = x + (R)3;
    t = t < (R)0 ? (R)0 : t;
    t = (R)6 < t ? (R)6 : t;
    return t / (R)6;
}

// A float op: `expr` of the value `v` and the parameters `c0..c2`, all in the compute type R
// (`M` the math functions, `MathOf` the storage type; `zero`, `one`, `half` R's constants), and
// the op's kernel in each float dtype.
#define EMBER_UNARY(op, expr)                                                                       \
    template <typename R, typename M> struct Unary_##op {                                           \
        R c0, c1, c2;                                                                               \
        __device__ __forceinline__ R operator()(R v) const {                                        \
            const R zero = (R)0, one = (R)1, half = (R)0.5;                                         \
            return (expr);                                                                          \
        }                                                                                           \
    };                                                                                              \
    EMBER_UNARY_KERNEL(op, float, f32) EMBER_UNARY_KERNEL(op, double, f64)                          \
    EMBER_UNARY_KERNEL(op, f16, f16) EMBER_UNARY_KERNEL(op, bf16, bf16)
#define EMBER_UNARY_KERNEL(op, T, name)                                                             \
    EMBER_IN_UNIT(unary_##op##_##name,                                                              \
    extern "C" __global__ void unary_##op##_##name EMBER_PARAMS_unary(T) {                         \
        typedef typename Acc<T>::type R;                                                            \
        run(x, out, s, n, mode, Unary_##op<R, MathOf<T>::type>{(R)c0, (R)c1, (R)c2});               \
    })

EMBER_UNARY(neg, -v)
EMBER_UNARY(abs, M::abs(v))
// NaN and +-0 give +0, as PyTorch's `(0 < x) - (x < 0)`.
EMBER_UNARY(sign, v > zero ? one : (v < zero ? -one : zero))
EMBER_UNARY(square, v * v)
EMBER_UNARY(reciprocal, one / v)
EMBER_UNARY(sqrt, M::sqrt(v))
EMBER_UNARY(rsqrt, one / M::sqrt(v))
EMBER_UNARY(exp, M::exp(v))
EMBER_UNARY(exp2, M::exp2(v))
EMBER_UNARY(expm1, M::expm1(v))
EMBER_UNARY(log, M::log(v))
EMBER_UNARY(log2, M::log2(v))
EMBER_UNARY(log10, M::log10(v))
EMBER_UNARY(log1p, M::log1p(v))
EMBER_UNARY(sin, M::sin(v))
EMBER_UNARY(cos, M::cos(v))
EMBER_UNARY(tan, M::tan(v))
EMBER_UNARY(asin, M::asin(v))
EMBER_UNARY(acos, M::acos(v))
EMBER_UNARY(atan, M::atan(v))
EMBER_UNARY(sinh, M::sinh(v))
EMBER_UNARY(cosh, M::cosh(v))
EMBER_UNARY(tanh, M::tanh(v))
EMBER_UNARY(erf, M::erf(v))
EMBER_UNARY(erfc, M::erfc(v))
EMBER_UNARY(erfinv, M::erfinv(v))
EMBER_UNARY(floor, M::floor(v))
EMBER_UNARY(ceil, M::ceil(v))
EMBER_UNARY(round, M::rint(v))  // half to even in the default rounding mode
EMBER_UNARY(trunc, M::trunc(v))
EMBER_UNARY(sigmoid, one / (one + M::exp(-v)))
// min(x, 0) - log1p(e^-|x|): no overflow for any x.
EMBER_UNARY(logsigmoid, (v < zero ? v : zero) - M::log1p(M::exp(-M::abs(v))))
// `x <= 0` rather than `x > 0` so that NaN propagates.
EMBER_UNARY(relu, v <= zero ? zero : v)
EMBER_UNARY(leaky_relu, v > zero ? v : v * c0)                            // c0 = negative_slope
EMBER_UNARY(elu, v <= zero ? M::expm1(v * c2) * c0 : v * c1)              // alpha * scale, scale, input_scale
EMBER_UNARY(hardtanh, v < c0 ? c0 : (v > c1 ? c1 : v))                    // min, max
EMBER_UNARY(hardsigmoid, hardsigmoid(v))
EMBER_UNARY(hardswish, v * hardsigmoid(v))
// 1/sqrt(2), rounded to R once as the CPU's `c(FRAC_1_SQRT_2)`.
EMBER_UNARY(gelu, v * half * (one + M::erf(v * (R)0.70710678118654752440)))
// sqrt(2/pi) as the CPU computes it in f64, and kappa, each rounded to R once.
EMBER_UNARY(gelu_tanh, half * v * (one + M::tanh((R)0.7978845608028654 * (v + (R)0.044715 * v * v * v))))
EMBER_UNARY(silu, v / (one + M::exp(-v)))
EMBER_UNARY(mish, v * M::tanh(M::log1p(M::exp(v))))
EMBER_UNARY(softplus, v * c0 > c1 ? v : M::log1p(M::exp(v * c0)) / c0)   // beta, threshold
EMBER_UNARY(softsign, v / (one + M::abs(v)))
EMBER_UNARY(add_scalar, v + c0)
EMBER_UNARY(sub_scalar, v - c0)
EMBER_UNARY(mul_scalar, v * c0)
EMBER_UNARY(div_scalar, v / c0)

// Integer ops keep the dtype and wrap: arithmetic runs in the unsigned type U of the same width
// (as Rust's wrapping_* on the CPU; u8: abs and relu are the identity, sign is min(x, 1)).
template <typename T> struct Wrap;
template <> struct Wrap<i64> { typedef u64 type; };
template <> struct Wrap<i32> { typedef u32 type; };
template <> struct Wrap<u8> { typedef u32 type; };

// An integer op: `expr` of the value `v` of type T (`U` the wrapping type, `is_unsigned`), and
// its kernel in each integer dtype (the float kernels' signature; c0..c2 unused).
#define EMBER_UNARY_INT(op, expr)                                                                   \
    template <typename T> struct UnaryInt_##op {                                                    \
        __device__ __forceinline__ T operator()(T v) const {                                        \
            typedef typename Wrap<T>::type U;                                                       \
            const bool is_unsigned = (T)-1 > (T)0;                                                  \
            return (expr);                                                                          \
        }                                                                                           \
    };                                                                                              \
    EMBER_UNARY_INT_KERNEL(op, i64) EMBER_UNARY_INT_KERNEL(op, i32) EMBER_UNARY_INT_KERNEL(op, u8)
#define EMBER_UNARY_INT_KERNEL(op, T)                                                               \
    EMBER_IN_UNIT(unary_##op##_##T,                                                                 \
    extern "C" __global__ void unary_##op##_##T EMBER_PARAMS_unary(T) {                            \
        map1(x, out, s, n, mode, UnaryInt_##op<T>());                                               \
    })

EMBER_UNARY_INT(neg, (T)((U)0 - (U)v))
EMBER_UNARY_INT(abs, (!is_unsigned && v < (T)0) ? (T)((U)0 - (U)v) : v)
EMBER_UNARY_INT(sign, is_unsigned ? (T)(v > (T)0) : (T)((v > (T)0) - (v < (T)0)))
EMBER_UNARY_INT(square, (T)((U)v * (U)v))
EMBER_UNARY_INT(relu, v > (T)0 ? v : (T)0)
