// Reductions over a set of dims of any strided input: sum, prod, mean, max/min (and the
// ±inf norms), argmax/argmin (with values for torch.max(x, dim)), logsumexp, var/std and
// vector norms. Semantics are the CPU backend's (`cpu/reduce.rs`): f16/bf16 compute in f32,
// f32 in f32, f64 in f64; integer and bool sums/products in wrapping i64; NaN propagates
// through max/min; argmax/argmin take the first occurrence, a NaN counting as the extreme.
//
// Geometry: the host splits the input's dims into kept dims (`outer`, M outputs, row-major
// over the kept dims) and reduced dims (`inner`, K elements per output, row-major over the
// reduced dims in their order; that linear index is what argmax returns). Each is a merged
// `Strided` whose stride[0] are the input's strides. The block is (bx, by) threads:
//   row mode (`row` = 1): by outputs per block, bx lanes (x) share one output (reduced dims
//       contiguous, K large: lanes read consecutive elements);
//   col mode (`row` = 0): bx outputs per block, by lanes (y) share one output (outputs
//       adjacent in memory, e.g. a sum over dim 0: neighbouring threads read neighbouring
//       outputs; by = 1 is a thread per output).
// The lane count is a power of two. blockIdx.x strides over groups of outputs, blockIdx.y
// picks a chunk of `chunk` elements of K: with gridDim.y > 1 each block writes its partial
// state to `partial[o * gridDim.y + blockIdx.y]` and a second launch (`*_final_*`) combines
// the partials of each output in a fixed order (deterministic, no atomics).
// Dynamic shared memory: bx * by * sizeof(State) bytes (State <= 32 bytes).
//
// Parameters: `EMBER_PARAMS_reduce(T, R, S)` and `EMBER_PARAMS_reduce_final(R, S)`, declared in
// `kernels!` in `cuda/launch.rs`: T the input dtype, R the result type (`OP::Out`: T, or i64
// for integer sums/products), S the op's accumulator (`OP::State`). Ops, dtypes, `variant` (its
// names are `reduce_variants!` in `cuda_backend/launch.rs`, defined before this file) and `param`:
//   sum  (all dtypes)  float variant: SUM_PLAIN, SUM_MEAN (param = K), SUM_L2, SUM_L1, SUM_L0
//                      (count of nonzeros), SUM_LP (param = p); ints: sum
//   prod (all dtypes)
//   minmax (all)       variant: MINMAX_MAX, MINMAX_MIN, MINMAX_MAX_ABS (inf norm),
//                      MINMAX_MIN_ABS (-inf norm)
//   arg  (all)         variant: ARG_MAX, ARG_MIN; Out = T values and i64 indices
//   lse  (floats)      log Σ exp(x), shifted by the running max
//   var  (floats)      Welford/Chan; variant VAR_VAR, VAR_STD; param = correction

template <typename T> struct IsFloat { static const bool value = false; };
template <> struct IsFloat<float> { static const bool value = true; };
template <> struct IsFloat<double> { static const bool value = true; };
template <> struct IsFloat<f16> { static const bool value = true; };
template <> struct IsFloat<bf16> { static const bool value = true; };

__device__ __forceinline__ float inf_of(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double inf_of(double) { return __longlong_as_double(0x7ff0000000000000ll); }

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
template <typename A> __device__ __forceinline__ A m_abs(A x) { return x; }  // never used on ints

// Identities of max and min in the arithmetic type of T.
template <typename T> struct Limits;
template <> struct Limits<float> {
    __device__ static float lowest() { return -inf_of(0.0f); }
    __device__ static float highest() { return inf_of(0.0f); }
};
template <> struct Limits<double> {
    __device__ static double lowest() { return -inf_of(0.0); }
    __device__ static double highest() { return inf_of(0.0); }
};
template <> struct Limits<f16> : Limits<float> {};
template <> struct Limits<bf16> : Limits<float> {};
template <> struct Limits<i64> {
    __device__ static i64 lowest() { return (i64)0x8000000000000000ull; }
    __device__ static i64 highest() { return (i64)0x7fffffffffffffffull; }
};
template <> struct Limits<i32> {
    __device__ static i32 lowest() { return (i32)0x80000000u; }
    __device__ static i32 highest() { return 0x7fffffff; }
};
template <> struct Limits<u8> {
    __device__ static u8 lowest() { return 0; }
    __device__ static u8 highest() { return 255; }
};
template <> struct Limits<bool> {
    __device__ static bool lowest() { return false; }
    __device__ static bool highest() { return true; }
};

// `b` replaces `a` as the running max (min): strictly larger (smaller), or a NaN over a number.
template <typename A> __device__ __forceinline__ bool better(A b, A a, bool max) {
    return (max ? b > a : b < a) || (b != b && a == a);
}

// Wrapping i64 arithmetic (signed overflow is undefined in C++, unsigned wraps).
__device__ __forceinline__ i64 wrap_add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
__device__ __forceinline__ i64 wrap_mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }

// ---- ops: init(), add(state, element, index), merge(state, state), store(state, out, idx, o)

template <typename T> struct FloatSumOp {
    typedef typename Acc<T>::type A;
    typedef A State;
    typedef T Out;
    int variant;
    double param;
    __device__ State init() const { return (A)0; }
    __device__ __forceinline__ void add(State& s, T xs, i64) const {
        A x = load(xs);
        switch (variant) {
            case SUM_L2: s += x * x; break;
            case SUM_L1: s += m_abs(x); break;
            case SUM_L0: s += x != (A)0 ? (A)1 : (A)0; break;
            case SUM_LP: s += m_pow(m_abs(x), (A)param); break;
            default: s += x;
        }
    }
    __device__ __forceinline__ void merge(State& s, State o) const { s += o; }
    __device__ void store(State s, Out* out, i64*, i64 o) const {
        A r = s;
        if (variant == SUM_MEAN) r = s / (A)param;
        else if (variant == SUM_L2) r = m_sqrt(s);
        else if (variant == SUM_LP) r = m_pow(s, (A)(1.0 / param));
        out[o] = cast<T>(r);
    }
};

template <typename T> struct FloatProdOp {
    typedef typename Acc<T>::type A;
    typedef A State;
    typedef T Out;
    int variant;
    double param;
    __device__ State init() const { return (A)1; }
    __device__ __forceinline__ void add(State& s, T x, i64) const { s *= load(x); }
    __device__ __forceinline__ void merge(State& s, State o) const { s *= o; }
    __device__ void store(State s, Out* out, i64*, i64 o) const { out[o] = cast<T>(s); }
};

// Integer and bool sum (PROD = false) or product in wrapping i64.
template <typename T, bool PROD> struct IntFoldOp {
    typedef i64 State;
    typedef i64 Out;
    int variant;
    double param;
    __device__ State init() const { return PROD ? 1 : 0; }
    __device__ __forceinline__ void add(State& s, T x, i64) const { merge(s, (i64)x); }
    __device__ __forceinline__ void merge(State& s, State o) const { s = PROD ? wrap_mul(s, o) : wrap_add(s, o); }
    __device__ void store(State s, Out* out, i64*, i64 o) const { out[o] = s; }
};

template <typename T> struct MinMaxOp {
    typedef typename Acc<T>::type A;
    typedef A State;
    typedef T Out;
    int variant;  // MINMAX_*
    double param;
    __device__ State init() const { return is_min() ? Limits<T>::highest() : Limits<T>::lowest(); }
    __device__ __forceinline__ bool is_min() const { return variant == MINMAX_MIN || variant == MINMAX_MIN_ABS; }
    __device__ __forceinline__ void add(State& s, T xs, i64) const {
        A x = load(xs);
        if (variant == MINMAX_MAX_ABS || variant == MINMAX_MIN_ABS) x = m_abs(x);
        merge(s, x);
    }
    __device__ __forceinline__ void merge(State& s, State o) const {
        if (better(o, s, !is_min())) s = o;
    }
    __device__ void store(State s, Out* out, i64*, i64 o) const { out[o] = cast<T>(s); }
};

template <typename A> struct ArgState {
    A v;
    i64 i;
};

template <typename T> struct ArgOp {
    typedef typename Acc<T>::type A;
    typedef ArgState<A> State;
    typedef T Out;
    int variant;  // ARG_MAX or ARG_MIN
    double param;
    __device__ State init() const {
        State s;
        s.v = variant == ARG_MIN ? Limits<T>::highest() : Limits<T>::lowest();
        s.i = Limits<i64>::highest();  // "no element yet": loses every tie
        return s;
    }
    __device__ __forceinline__ void add(State& s, T x, i64 j) const {
        State e;
        e.v = load(x);
        e.i = j;
        merge(s, e);
    }
    // Better value wins; equal values (or two NaNs) keep the lower index.
    __device__ __forceinline__ void merge(State& s, State o) const {
        bool max = variant == ARG_MAX;
        if (better(o.v, s.v, max) || (!better(s.v, o.v, max) && o.i < s.i)) s = o;
    }
    __device__ void store(State s, Out* out, i64* idx, i64 o) const {
        if (out) out[o] = cast<T>(s.v);
        if (idx) idx[o] = s.i;
    }
};

template <typename A> struct LseState {
    A m;  // running max (NaN once a NaN was seen)
    A s;  // Σ exp(x - m)
};

template <typename T> struct LseOp {
    typedef typename Acc<T>::type A;
    typedef LseState<A> State;
    typedef T Out;
    int variant;
    double param;
    __device__ State init() const {
        State s;
        s.m = -inf_of((A)0);
        s.s = (A)0;
        return s;
    }
    __device__ __forceinline__ void add(State& s, T xs, i64) const {
        State e;
        e.m = load(xs);
        e.s = (A)1;
        merge(s, e);
    }
    __device__ __forceinline__ void merge(State& a, State b) const {
        if (b.m != b.m) {  // NaN propagates
            a.m = b.m;
            return;
        }
        if (a.m != a.m || b.m == -inf_of((A)0)) return;  // nothing to add
        if (a.m == -inf_of((A)0)) {
            a = b;
            return;
        }
        if (b.m > a.m) {
            a.s = a.s * m_exp(a.m - b.m) + b.s;
            a.m = b.m;
        } else {
            a.s += b.s * m_exp(b.m - a.m);  // NaN when both are +inf; the result is m then
        }
    }
    __device__ void store(State s, Out* out, i64*, i64 o) const {
        A m = s.m;
        bool special = m != m || m == inf_of((A)0) || m == -inf_of((A)0);
        out[o] = cast<T>(special ? m : m + m_log(s.s));
    }
};

template <typename A> struct VarState {
    A mean;
    A m2;  // Σ (x - mean)^2
    i64 n;
};

template <typename T> struct VarOp {
    typedef typename Acc<T>::type A;
    typedef VarState<A> State;
    typedef T Out;
    int variant;  // VAR_VAR or VAR_STD
    double param;  // correction
    __device__ State init() const {
        State s;
        s.mean = (A)0;
        s.m2 = (A)0;
        s.n = 0;
        return s;
    }
    __device__ __forceinline__ void add(State& s, T xs, i64) const {
        A x = load(xs);
        s.n += 1;
        A d = x - s.mean;
        s.mean += d / (A)s.n;
        s.m2 += d * (x - s.mean);
    }
    __device__ __forceinline__ void merge(State& a, State b) const {
        if (b.n == 0) return;
        if (a.n == 0) {
            a = b;
            return;
        }
        i64 n = a.n + b.n;
        A d = b.mean - a.mean;
        A fb = (A)b.n / (A)n;
        a.mean += d * fb;
        a.m2 += b.m2 + d * d * ((A)a.n * fb);
        a.n = n;
    }
    __device__ void store(State s, Out* out, i64*, i64 o) const {
        double denom = (double)s.n - param;
        A v = s.m2 / (A)(denom > 0.0 ? denom : 0.0);
        out[o] = cast<T>(variant == VAR_STD ? m_sqrt(v) : v);
    }
};

// ---- the generic kernel body

// Element offset of linear index `i` of `s` (operand 0), with the common 0/1-dim cases cheap.
__device__ __forceinline__ i64 offset_of(const Strided& s, i64 i) {
    if (s.ndim == 0) return 0;
    if (s.ndim == 1) return i * s.stride[0][0];
    return strided_offset(s, 0, i);
}

// Reads input elements (first pass).
template <typename T> struct InputSrc {
    const T* x;
    template <typename Op>
    __device__ __forceinline__ void apply(const Op& op, typename Op::State& s, i64 off, i64 j) const {
        op.add(s, x[off], j);
    }
};

// Reads partial states (second pass).
template <typename S> struct PartialSrc {
    const S* p;
    template <typename Op>
    __device__ __forceinline__ void apply(const Op& op, typename Op::State& s, i64 off, i64) const {
        op.merge(s, p[off]);
    }
};

extern __shared__ __align__(16) unsigned char reduce_smem[];

template <typename Op, typename Src>
__device__ __forceinline__ void reduce_body(const Op& op, const Src& src, const Strided& outer, const Strided& inner,
                                            i64 m, i64 k, i64 chunk, int row, typename Op::Out* out, i64* idx,
                                            typename Op::State* partial) {
    typedef typename Op::State State;
    static_assert(sizeof(State) <= 32, "the host sizes partial buffers for 32-byte states");
    State* sm = (State*)reduce_smem;
    const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x;
    const int lane = row ? tx : ty, lanes = row ? blockDim.x : blockDim.y;
    const int slot = row ? ty : tx, slots = row ? blockDim.y : blockDim.x;
    const int me = ty * bx + tx;
    const int step = row ? 1 : bx;  // distance in `sm` between neighbouring lanes
    const i64 j0 = (i64)blockIdx.y * chunk;
    const i64 j1 = j0 + chunk < k ? j0 + chunk : k;
    const i64 groups = (m + slots - 1) / slots;
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const i64 o = g * slots + slot;
        State s = op.init();
        if (o < m) {
            const i64 base = offset_of(outer, o);
            if (inner.ndim <= 1) {
                const i64 st = inner.ndim == 1 ? inner.stride[0][0] : 0;
#pragma unroll 4
                for (i64 j = j0 + lane; j < j1; j += lanes) src.apply(op, s, base + j * st, j);
            } else {
                for (i64 j = j0 + lane; j < j1; j += lanes) src.apply(op, s, base + strided_offset(inner, 0, j), j);
            }
        }
        // Tree over the lanes of each output; lower lanes (lower indices) stay on the left.
        sm[me] = s;
        __syncthreads();
        for (int h = lanes >> 1; h > 0; h >>= 1) {
            if (lane < h) {
                op.merge(s, sm[me + h * step]);
                sm[me] = s;
            }
            __syncthreads();
        }
        if (lane == 0 && o < m) {
            if (partial) partial[o * gridDim.y + blockIdx.y] = s;
            else op.store(s, out, idx, o);
        }
    }
}

#define EMBER_REDUCE(opname, OP, T, name)                                                                        \
    EMBER_IN_UNIT(reduce_##opname##_##name,                                                                      \
    extern "C" __global__ void reduce_##opname##_##name EMBER_PARAMS_reduce(T, OP::Out, OP::State) {                \
        OP op;                                                                                                     \
        op.variant = variant;                                                                                      \
        op.param = param;                                                                                          \
        InputSrc<T> src;                                                                                           \
        src.x = x;                                                                                                 \
        reduce_body(op, src, outer, inner, m, k, chunk, row, out, idx, partial);                                   \
    })                                                                                                             \
    EMBER_IN_UNIT(reduce_##opname##_##name,                                                                        \
    extern "C" __global__ void reduce_##opname##_final_##name EMBER_PARAMS_reduce_final(OP::Out, OP::State) {     \
        OP op;                                                                                                     \
        op.variant = variant;                                                                                      \
        op.param = param;                                                                                          \
        PartialSrc<OP::State> src;                                                                                 \
        src.p = partial;                                                                                           \
        Strided outer, inner;                                                                                      \
        outer.ndim = 1;                                                                                            \
        outer.size[0] = m;                                                                                         \
        outer.stride[0][0] = splits;                                                                               \
        inner.ndim = 1;                                                                                            \
        inner.size[0] = splits;                                                                                    \
        inner.stride[0][0] = 1;                                                                                    \
        reduce_body(op, src, outer, inner, m, splits, splits, 1, out, idx, (OP::State*)0);                         \
    })

#define EMBER_REDUCE_FLOAT(T, name)                         \
    EMBER_REDUCE(sum, FloatSumOp<T>, T, name)               \
    EMBER_REDUCE(prod, FloatProdOp<T>, T, name)             \
    EMBER_REDUCE(lse, LseOp<T>, T, name)                    \
    EMBER_REDUCE(var, VarOp<T>, T, name)
#define EMBER_REDUCE_ANY(T, name)                           \
    EMBER_REDUCE(minmax, MinMaxOp<T>, T, name)              \
    EMBER_REDUCE(arg, ArgOp<T>, T, name)

// Template arguments with a comma cannot pass through a macro parameter: name them first.
template <typename T> struct IntSum : IntFoldOp<T, false> {};
template <typename T> struct IntProd : IntFoldOp<T, true> {};

EMBER_FOR_FLOAT_DTYPES(EMBER_REDUCE_FLOAT)
EMBER_FOR_ALL_DTYPES(EMBER_REDUCE_ANY)
EMBER_REDUCE(sum, IntSum<i64>, i64, i64)
EMBER_REDUCE(prod, IntProd<i64>, i64, i64)
EMBER_REDUCE(sum, IntSum<i32>, i32, i32)
EMBER_REDUCE(prod, IntProd<i32>, i32, i32)
EMBER_REDUCE(sum, IntSum<u8>, u8, u8)
EMBER_REDUCE(prod, IntProd<u8>, u8, u8)
EMBER_REDUCE(sum, IntSum<bool>, bool, bool)
EMBER_REDUCE(prod, IntProd<bool>, bool, bool)

// Column sums of a matrix whose m columns are contiguous and whose k rows are `row_stride`
// apart: out[c] = Σ_r x[r, c] in A = Acc<T>, a plain sum over dim 0 (a linear layer's bias
// gradient: its [rows, out_features] output gradient summed over the rows). The generic col mode
// above reads one element per thread per load; here each thread owns V = 16 / sizeof(T) adjacent
// columns and reads them as one 16-byte word, UNROLL rows at a time with every load issued
// before the adds, so enough bytes are in flight to reach HBM bandwidth. Block (bx, by): x over
// column words, y over rows (by a power of two); the chunk of rows `blockIdx.y` selects is read
// by the block's rows r ≡ ty (mod by), the by partial sums are added in a fixed tree order, and
// with gridDim.y > 1 each chunk's sums go to partial[blockIdx.y * m + c] for
// `reduce_cols_sum_final` to add in chunk order (deterministic, no atomics).
// Needs m % V == 0, row_stride % V == 0 and x 16-byte aligned (the host checks).
// Dynamic shared memory: bx * by * V accumulators.
template <typename T, int V> struct alignas(16) ColPack { T v[V]; };

template <typename T>
__device__ __forceinline__ void cols_sum(const T* __restrict__ x, i64 row_stride, i64 m, i64 k, i64 chunk,
                                         T* __restrict__ out, typename Acc<T>::type* __restrict__ partial) {
    typedef typename Acc<T>::type A;
    constexpr int V = 16 / sizeof(T);
    constexpr int UNROLL = 4;
    A* sm = (A*)reduce_smem;
    const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
    const i64 words = m / V;
    const i64 w = (i64)blockIdx.x * bx + tx;
    const i64 j0 = (i64)blockIdx.y * chunk;
    const i64 j1 = j0 + chunk < k ? j0 + chunk : k;
    A acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = (A)0;
    if (w < words) {
        const T* col = x + w * V;
        for (i64 r = j0 + ty; r < j1; r += (i64)UNROLL * by) {
            ColPack<T, V> p[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const i64 ru = r + (i64)u * by;
                if (ru < j1) p[u] = *(const ColPack<T, V>*)(col + ru * row_stride);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (r + (i64)u * by < j1) {
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] += load(p[u].v[v]);
                }
            }
        }
    }
    A* mine = sm + ((i64)ty * bx + tx) * V;
#pragma unroll
    for (int v = 0; v < V; ++v) mine[v] = acc[v];
    __syncthreads();
    for (int h = by >> 1; h > 0; h >>= 1) {
        if (ty < h) {
            const A* other = mine + (i64)h * bx * V;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                acc[v] += other[v];
                mine[v] = acc[v];
            }
        }
        __syncthreads();
    }
    if (ty != 0 || w >= words) return;
    if (partial) {
#pragma unroll
        for (int v = 0; v < V; ++v) partial[(i64)blockIdx.y * m + w * V + v] = acc[v];
    } else {
        ColPack<T, V> r;
#pragma unroll
        for (int v = 0; v < V; ++v) r.v[v] = cast<T>(acc[v]);
        *(ColPack<T, V>*)(out + w * V) = r;
    }
}

// The second pass: a warp per column, each lane adding every 32nd chunk's sum in order, then a
// shuffle tree (a fixed order: deterministic; no long running sum, which would lose the
// accuracy the first pass's short chains and trees keep).
template <typename T>
__device__ __forceinline__ void cols_sum_final(const typename Acc<T>::type* __restrict__ partial, i64 m, i64 splits,
                                               T* __restrict__ out) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < m; c += warps) {
        A s = (A)0;
        for (i64 j = lane; j < splits; j += 32) s += partial[j * m + c];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) out[c] = cast<T>(s);
    }
}

#define EMBER_REDUCE_COLS(T, name)                                                                                \
    EMBER_IN_UNIT(reduce_cols_sum_##name,                                                                         \
    extern "C" __global__ void reduce_cols_sum_##name EMBER_PARAMS_reduce_cols_sum(T, Acc<T>::type) {             \
        cols_sum<T>(x, row_stride, m, k, chunk, out, partial);                                                    \
    })                                                                                                            \
    EMBER_IN_UNIT(reduce_cols_sum_##name,                                                                         \
    extern "C" __global__ void reduce_cols_sum_final_##name EMBER_PARAMS_reduce_cols_sum_final(T, Acc<T>::type) { \
        cols_sum_final<T>(partial, m, splits, out);                                                               \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_REDUCE_COLS)
