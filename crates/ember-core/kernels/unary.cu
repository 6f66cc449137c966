// Elementwise functions of one operand (math functions and activations), with the CPU
// backend's formulas (`cpu/unary.rs`): f16/bf16 load into f32, compute, and round once on
// store; f32 computes in f32, f64 in f64. Integer inputs of float ops are cast to f32 on the
// host before launch (Note [Unary dtypes] in `ops/unary.rs`), so float kernels see floats only.
//
// Float ops have one kernel per op and dtype (`unary_relu_f32`), each its own compile unit, so a
// program compiles only the ops it uses; the integer kernels switch once on the op (a runtime
// argument, the same for all threads) into a loop specialized for it. `mode` picks the loop
// shape the host found:
//   0: input row-major (16-byte vector loads and stores when both pointers are aligned)
//   1: input of any strides (s.stride[0]); the output is always row-major
//
// Launch contract (grid-stride, any 1-D grid):
//   unary_<op>_T(const T* x, T* out, Strided s, i64 n, i32 op, f64 p0, f64 p1, f64 p2, i32 mode)
//       T in f32 f64 f16 bf16; <op> is the name below (`op` its code, unused: the kernel is
//       the op's own); p0..p2 its parameters:
//        0 neg        1 abs        2 sign       3 square     4 reciprocal 5 sqrt
//        6 rsqrt      7 exp        8 exp2       9 expm1     10 log       11 log2
//       12 log10     13 log1p     14 sin       15 cos       16 tan       17 asin
//       18 acos      19 atan      20 sinh      21 cosh      22 tanh      23 erf
//       24 erfc      25 floor     26 ceil      27 round     28 trunc     29 sigmoid
//       30 logsigmoid 31 relu
//       32 leaky_relu (p0 = negative_slope)
//       33 elu        (p0 = alpha * scale, p1 = scale, p2 = input_scale)
//       34 hardtanh   (p0 = min, p1 = max)
//       35 hardsigmoid 36 hardswish
//       37 gelu       (p0 = 1/sqrt(2))
//       38 gelu_tanh  (p0 = sqrt(2/pi), p1 = kappa)
//       39 silu      40 mish
//       41 softplus   (p0 = beta, p1 = threshold)
//       42 softsign
//       43 add_scalar 44 sub_scalar 45 mul_scalar 46 div_scalar (p0 = the scalar)
//       Parameters are rounded to the compute type once, as the CPU's `R::c(v)` does.
//   unary_int_T(const T* x, T* out, Strided s, i64 n, i32 op, i32 mode)
//       T in i64 i32 u8; op: 0 neg 1 abs 2 sign 3 square 31 relu (wrapping, as Rust's
//       wrapping_* on the CPU; u8: abs and relu are the identity, sign is min(x, 1)).

// Math functions by compute type: the f32 and f64 entry points of CUDA's math library.
template <typename R> struct Math;
// f32 transcendental functions are evaluated in f64 and rounded once: CUDA's f32 versions are
// up to 2 ulp off, the CPU's (glibc) are correctly rounded in nearly all cases, and computing
// in f64 reproduces those roundings, so CPU and GPU agree to the bit almost everywhere. Exact
// operations (abs, sqrt, rounding) stay in f32. Kernels are memory-bound; f64 math is not the limit.
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
#undef EMBER_F64
};

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

template <typename T, int OP>
__device__ __forceinline__ void unary_float(const T* x, T* out, const Strided& s, i64 n, double p0, double p1,
                                            double p2, int mode) {
    typedef typename Acc<T>::type R;
    typedef Math<R> M;
    const R zero = (R)0, one = (R)1, half = (R)0.5;
    const R c0 = (R)p0, c1 = (R)p1, c2 = (R)p2;
    // Only op OP is instantiated (`if constexpr`): each op is its own kernel and compile unit.
#define EMBER_OP(code, expr) \
    if constexpr (OP == code) run(x, out, s, n, mode, [=](R v) -> R { return (expr); });
    EMBER_OP(0, -v)
    EMBER_OP(1, M::abs(v))
    // NaN and +-0 give +0, as PyTorch's `(0 < x) - (x < 0)`.
    EMBER_OP(2, v > zero ? one : (v < zero ? -one : zero))
    EMBER_OP(3, v * v)
    EMBER_OP(4, one / v)
    EMBER_OP(5, M::sqrt(v))
    EMBER_OP(6, one / M::sqrt(v))
    EMBER_OP(7, M::exp(v))
    EMBER_OP(8, M::exp2(v))
    EMBER_OP(9, M::expm1(v))
    EMBER_OP(10, M::log(v))
    EMBER_OP(11, M::log2(v))
    EMBER_OP(12, M::log10(v))
    EMBER_OP(13, M::log1p(v))
    EMBER_OP(14, M::sin(v))
    EMBER_OP(15, M::cos(v))
    EMBER_OP(16, M::tan(v))
    EMBER_OP(17, M::asin(v))
    EMBER_OP(18, M::acos(v))
    EMBER_OP(19, M::atan(v))
    EMBER_OP(20, M::sinh(v))
    EMBER_OP(21, M::cosh(v))
    EMBER_OP(22, M::tanh(v))
    EMBER_OP(23, M::erf(v))
    EMBER_OP(24, M::erfc(v))
    EMBER_OP(25, M::floor(v))
    EMBER_OP(26, M::ceil(v))
    EMBER_OP(27, M::rint(v))  // half to even in the default rounding mode
    EMBER_OP(28, M::trunc(v))
    EMBER_OP(29, one / (one + M::exp(-v)))
    // min(x, 0) - log1p(e^-|x|): no overflow for any x.
    EMBER_OP(30, (v < zero ? v : zero) - M::log1p(M::exp(-M::abs(v))))
    // `x <= 0` rather than `x > 0` so that NaN propagates.
    EMBER_OP(31, v <= zero ? zero : v)
    EMBER_OP(32, v > zero ? v : v * c0)
    EMBER_OP(33, v <= zero ? M::expm1(v * c2) * c0 : v * c1)
    EMBER_OP(34, v < c0 ? c0 : (v > c1 ? c1 : v))
    EMBER_OP(35, hardsigmoid(v))
    EMBER_OP(36, v * hardsigmoid(v))
    EMBER_OP(37, v * half * (one + M::erf(v * c0)))
    EMBER_OP(38, half * v * (one + M::tanh(c0 * (v + c1 * v * v * v))))
    EMBER_OP(39, v / (one + M::exp(-v)))
    EMBER_OP(40, v * M::tanh(M::log1p(M::exp(v))))
    EMBER_OP(41, v * c0 > c1 ? v : M::log1p(M::exp(v * c0)) / c0)
    EMBER_OP(42, v / (one + M::abs(v)))
    EMBER_OP(43, v + c0)
    EMBER_OP(44, v - c0)
    EMBER_OP(45, v * c0)
    EMBER_OP(46, v / c0)
#undef EMBER_OP
}

// M(T, name, code, op) for each float op (the codes above).
#define EMBER_UNARY_OPS(M, T, name)                                                                        \
    M(T, name, 0, neg) M(T, name, 1, abs) M(T, name, 2, sign) M(T, name, 3, square)                       \
    M(T, name, 4, reciprocal) M(T, name, 5, sqrt) M(T, name, 6, rsqrt) M(T, name, 7, exp)                 \
    M(T, name, 8, exp2) M(T, name, 9, expm1) M(T, name, 10, log) M(T, name, 11, log2)                     \
    M(T, name, 12, log10) M(T, name, 13, log1p) M(T, name, 14, sin) M(T, name, 15, cos)                   \
    M(T, name, 16, tan) M(T, name, 17, asin) M(T, name, 18, acos) M(T, name, 19, atan)                    \
    M(T, name, 20, sinh) M(T, name, 21, cosh) M(T, name, 22, tanh) M(T, name, 23, erf)                    \
    M(T, name, 24, erfc) M(T, name, 25, floor) M(T, name, 26, ceil) M(T, name, 27, round)                 \
    M(T, name, 28, trunc) M(T, name, 29, sigmoid) M(T, name, 30, logsigmoid) M(T, name, 31, relu)         \
    M(T, name, 32, leaky_relu) M(T, name, 33, elu) M(T, name, 34, hardtanh) M(T, name, 35, hardsigmoid)   \
    M(T, name, 36, hardswish) M(T, name, 37, gelu) M(T, name, 38, gelu_tanh) M(T, name, 39, silu)         \
    M(T, name, 40, mish) M(T, name, 41, softplus) M(T, name, 42, softsign) M(T, name, 43, add_scalar)     \
    M(T, name, 44, sub_scalar) M(T, name, 45, mul_scalar) M(T, name, 46, div_scalar)

#define EMBER_UNARY_OP(T, name, code, opname)                                                              \
    EMBER_IN_UNIT(unary_##opname##_##name,                                                                 \
    extern "C" __global__ void unary_##opname##_##name(const T* x, T* out, Strided s, i64 n, i32 op,       \
                                                       double p0, double p1, double p2, i32 mode) {        \
        unary_float<T, code>(x, out, s, n, p0, p1, p2, mode);                                              \
    })
#define EMBER_UNARY(T, name) EMBER_UNARY_OPS(EMBER_UNARY_OP, T, name)
EMBER_FOR_FLOAT_DTYPES(EMBER_UNARY)

// Integer ops keep the dtype and wrap: arithmetic runs in the unsigned type of the same width.
template <typename T> struct Wrap;
template <> struct Wrap<i64> { typedef u64 type; };
template <> struct Wrap<i32> { typedef u32 type; };
template <> struct Wrap<u8> { typedef u32 type; };

template <typename T> struct IntOp {
    int op;
    __device__ __forceinline__ T operator()(T v) const {
        typedef typename Wrap<T>::type U;
        const bool is_unsigned = (T)-1 > (T)0;
        switch (op) {
            case 0: return (T)((U)0 - (U)v);
            case 1: return (!is_unsigned && v < (T)0) ? (T)((U)0 - (U)v) : v;
            case 2: return is_unsigned ? (T)(v > (T)0) : (T)((v > (T)0) - (v < (T)0));
            case 3: return (T)((U)v * (U)v);
            default: return v > (T)0 ? v : (T)0;  // 31: relu
        }
    }
};

template <typename T>
__device__ __forceinline__ void unary_int(const T* x, T* out, const Strided& s, i64 n, int op, int mode) {
    switch (op) {
        case 0: map1(x, out, s, n, mode, IntOp<T>{0}); break;
        case 1: map1(x, out, s, n, mode, IntOp<T>{1}); break;
        case 2: map1(x, out, s, n, mode, IntOp<T>{2}); break;
        case 3: map1(x, out, s, n, mode, IntOp<T>{3}); break;
        case 31: map1(x, out, s, n, mode, IntOp<T>{31}); break;
    }
}

#define EMBER_UNARY_INT(T, name)                                                                        \
    EMBER_IN_UNIT(unary_int_##name,                                                                     \
    extern "C" __global__ void unary_int_##name(const T* x, T* out, Strided s, i64 n, i32 op, i32 mode) { \
        unary_int<T>(x, out, s, n, op, mode);                                                            \
    })
EMBER_UNARY_INT(i64, i64)
EMBER_UNARY_INT(i32, i32)
EMBER_UNARY_INT(u8, u8)
