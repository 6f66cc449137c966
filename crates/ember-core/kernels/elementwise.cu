// Elementwise ops over two or three operands already broadcast to one shape: arithmetic,
// comparisons, logical ops and `where`. The output is always row-major.
//
// Arithmetic and comparisons have one kernel per op and dtype (`binary_add_f32`), each its own
// compile unit, so a program compiles only the ops it uses; the logical ops share one kernel
// that switches once on the op (a runtime argument, the same for all threads).
// The `mode` argument picks the loop shape the host found:
//   0: every operand row-major (vectorized 16-byte loads and stores when aligned)
//   1: `a` row-major, `b` one broadcast element      2: `a` one broadcast element, `b` row-major
//   3: any strides (Strided: stride[0] = a, stride[1] = b, stride[2] = cond for `where`)
//
// Launch contract:
//   binary_<op>_T(const T* a, const T* b, T* out, Strided s, i64 n, i32 op, i32 mode)
//       <op> (code): add (0) sub (1) mul (2) div (3) pow (4) maximum (5) minimum (6)
//       (ops::binary::BinaryOp order); `op` is the code, unused (the kernel is the op's own);
//       integers: div is not launched (true division promotes to float on the host), pow takes
//       non-negative exponents (a negative one gives an unspecified element; the host launches
//       check_pow_exponent_I first); bool: add/maximum are `or`, the others `and`
//   check_pow_exponent_I(const I* b, Strided s, i64 n, ErrorCheck check)        I in i64 i32
//       records the first negative exponent (s.stride[0] = the exponents' strides) in the
//       device's error record (Note [Deferred device errors] in `cuda/device_errors.rs`);
//       blockDim.x a multiple of 32
//   compare_<op>_T(const T* a, const T* b, bool* out, Strided s, i64 n, i32 op, i32 mode)
//       <op> (code): eq (0) ne (1) lt (2) le (3) gt (4) ge (5); `op` unused as above
//   logical(const bool* a, const bool* b, bool* out, Strided s, i64 n, i32 op, i32 mode)
//       op: 0 and 1 or 2 xor
//   where_T(const bool* cond, const T* a, const T* b, T* out, Strided s, i64 n)

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

// Arithmetic in Acc<T>, stored back as T.
#define EMBER_ARITH(name, expr)                                                                  \
    template <typename T> struct name {                                                          \
        __device__ __forceinline__ T operator()(T xs, T ys) const {                              \
            typedef typename Acc<T>::type A;                                                     \
            A x = load(xs), y = load(ys);                                                        \
            return cast<T>((A)(expr));                                                           \
        }                                                                                        \
    };
EMBER_ARITH(AddOp, x + y)
EMBER_ARITH(SubOp, x - y)
EMBER_ARITH(MulOp, x * y)
EMBER_ARITH(DivOp, x / y)
EMBER_ARITH(MaxOp, (x != x || x > y) ? x : y)
EMBER_ARITH(MinOp, (x != x || x < y) ? x : y)

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
EMBER_ARITH(PowOp, power<A>(x, y))

// One kernel per op and dtype (its own compile unit, Note [Kernel units] in `kernel_units.rs`):
// `binary_<op>_T` runs op OP only (`if constexpr`, so the other ops are not even instantiated).
template <typename T, int OP>
__device__ __forceinline__ void binary(const T* a, const T* b, T* out, const Strided& s, i64 n, int mode) {
    if constexpr (OP == 0) for_each2(a, b, out, s, n, mode, AddOp<T>());
    if constexpr (OP == 1) for_each2(a, b, out, s, n, mode, SubOp<T>());
    if constexpr (OP == 2) for_each2(a, b, out, s, n, mode, MulOp<T>());
    if constexpr (OP == 3) for_each2(a, b, out, s, n, mode, DivOp<T>());
    if constexpr (OP == 4) for_each2(a, b, out, s, n, mode, PowOp<T>());
    if constexpr (OP == 5) for_each2(a, b, out, s, n, mode, MaxOp<T>());
    if constexpr (OP == 6) for_each2(a, b, out, s, n, mode, MinOp<T>());
}

struct OrOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x | y; } };
struct AndOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x & y; } };
struct XorOp { __device__ __forceinline__ bool operator()(bool x, bool y) const { return x ^ y; } };

// bool: add and maximum are `or`, the others `and`.
template <int OP>
__device__ __forceinline__ void binary_bool(const bool* a, const bool* b, bool* out, const Strided& s, i64 n,
                                            int mode) {
    if constexpr (OP == 0 || OP == 5) for_each2(a, b, out, s, n, mode, OrOp());
    else for_each2(a, b, out, s, n, mode, AndOp());
}

// M(T, name, code, op) for each binary op, in `BinaryOp` order (the `op` codes above).
#define EMBER_BINARY_OPS(M, T, name)                                                                \
    M(T, name, 0, add) M(T, name, 1, sub) M(T, name, 2, mul) M(T, name, 3, div) M(T, name, 4, pow) \
    M(T, name, 5, maximum) M(T, name, 6, minimum)

#define EMBER_BINARY_OP(T, name, code, opname)                                                      \
    EMBER_IN_UNIT(binary_##opname##_##name,                                                         \
    extern "C" __global__ void binary_##opname##_##name(const T* a, const T* b, T* out, Strided s, \
                                                        i64 n, i32 op, i32 mode) {                  \
        binary<T, code>(a, b, out, s, n, mode);                                                     \
    })
#define EMBER_BINARY_BOOL_OP(T, name, code, opname)                                                 \
    EMBER_IN_UNIT(binary_##opname##_##name,                                                         \
    extern "C" __global__ void binary_##opname##_##name(const T* a, const T* b, T* out, Strided s, \
                                                        i64 n, i32 op, i32 mode) {                  \
        binary_bool<code>(a, b, out, s, n, mode);                                                   \
    })
#define EMBER_BINARY(T, name) EMBER_BINARY_OPS(EMBER_BINARY_OP, T, name)
EMBER_BINARY(float, f32)
EMBER_BINARY(double, f64)
EMBER_BINARY(f16, f16)
EMBER_BINARY(bf16, bf16)
EMBER_BINARY(i64, i64)
EMBER_BINARY(i32, i32)
EMBER_BINARY(u8, u8)
EMBER_BINARY_OPS(EMBER_BINARY_BOOL_OP, bool, bool)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_logical)
extern "C" __global__ void logical(const bool* a, const bool* b, bool* out, Strided s, i64 n, i32 op, i32 mode) {
    switch (op) {
        case 0: for_each2(a, b, out, s, n, mode, AndOp()); break;
        case 1: for_each2(a, b, out, s, n, mode, OrOp()); break;
        case 2: for_each2(a, b, out, s, n, mode, XorOp()); break;
    }
}
#endif

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

// M(T, name, code, op, functor) for each comparison (the `op` codes above).
#define EMBER_COMPARE_OPS(M, T, name) \
    M(T, name, 0, eq, EqOp) M(T, name, 1, ne, NeOp) M(T, name, 2, lt, LtOp) M(T, name, 3, le, LeOp) \
    M(T, name, 4, gt, GtOp) M(T, name, 5, ge, GeOp)
#define EMBER_COMPARE_OP(T, name, code, opname, Op)                                                    \
    EMBER_IN_UNIT(compare_##opname##_##name,                                                           \
    extern "C" __global__ void compare_##opname##_##name(const T* a, const T* b, bool* out, Strided s, \
                                                         i64 n, i32 op, i32 mode) {                    \
        for_each2(a, b, out, s, n, mode, Op<T>());                                                     \
    })
#define EMBER_COMPARE(T, name) EMBER_COMPARE_OPS(EMBER_COMPARE_OP, T, name)
EMBER_FOR_ALL_DTYPES(EMBER_COMPARE)

#define EMBER_WHERE(T, name)                                                                                  \
    EMBER_IN_UNIT(where_##name,                                                                               \
    extern "C" __global__ void where_##name(const bool* c, const T* a, const T* b, T* out, Strided s, i64 n) { \
        EMBER_KERNEL_LOOP(i, n) {                                                                             \
            Offsets<3> o = strided_offsets<3>(s, i);                                                          \
            out[i] = c[o.v[2]] ? a[o.v[0]] : b[o.v[1]];                                                       \
        }                                                                                                     \
    })
EMBER_FOR_ALL_DTYPES(EMBER_WHERE)

// Integer pow's exponent check (the CPU refuses negative exponents): the first negative one is
// recorded for the host to report at its next synchronizing call, so the op never reads back.
#define EMBER_POW_CHECK(I, name)                                                                              \
    EMBER_IN_UNIT(check_pow_exponent_##name,                                                                  \
    extern "C" __global__ void check_pow_exponent_##name(const I* b, Strided s, i64 n, ErrorCheck check) {    \
        FirstBad first = no_bad();                                                                            \
        EMBER_KERNEL_LOOP(i, n) {                                                                             \
            I e = b[strided_offset(s, 0, i)];                                                                 \
            if (e < 0) note_bad(first, (u64)i, (i64)e);                                                       \
        }                                                                                                     \
        report_bad(check, first);                                                                             \
    })
EMBER_POW_CHECK(i64, i64)
EMBER_POW_CHECK(i32, i32)
