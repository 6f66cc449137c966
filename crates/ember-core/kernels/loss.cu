// The fused classifier: cross-entropy of logit rows against class indices (PyTorch's
// `F.cross_entropy` for [N, C] logits: class weights, ignore_index, label smoothing, the three
// reductions), as llm.c's fused classifier, with the CPU's formulas (`cpu/loss.rs`). Per row of
// logits x with target t, class weights w (1 without), W = Σ_c w[c], C classes, smoothing ε:
//   lse    = max + log Σ_c exp(x[c] - max)                       (one pass, online max and sum)
//   loss   = (1 - ε)·w[t]·(lse - x[t]) + ε/C·(W·lse - Σ_c w[c]·x[c])
//   dx[j]  = s·((1 - ε)·w[t]·(p[j] - [j = t]) + ε/C·(W·p[j] - w[j])),  p[j] = exp(x[j] - lse)
// with s the row's loss gradient (over Σ w[t] of the counted rows for the mean). Rows whose
// target is `ignore_index` count for nothing and get a zero gradient.
//
// The logits are read once forward and once backward, in their own dtype (16-byte vector
// loads), computed in A = Acc<T> (f32 for f32/f16/bf16, f64 for f64), and the gradient is
// written once in T: nothing of size N·C is kept or written besides the gradient. What the
// forward keeps for the backward: lse (A, [N]) and `total` = [Σ w[t], W] (A).
// Determinism: every sum has a fixed order (each thread's elements in turn, then a fixed
// shuffle tree, then the warps in order); the loss is reduced from per-row values by one block.
//
// Kernels (parameters: `EMBER_PARAMS_<family>` in `cuda_backend/launch.rs`):
//   cross_entropy_<T>_<I>          one block per row (grid-stride over rows), blockDim.x a
//                                  multiple of 32: lse, per-row loss and weight;
//   cross_entropy_reduce_<O>       one block: the per-row values reduced to the loss in O (or
//                                  cast per row for `none`), and `total`;
//   cross_entropy_backward_<T>_<I> one block per row: the gradient row.

#define CE_NONE 0
#define CE_SUM 1
#define CE_MEAN 2
#define CE_BATCH 4  // 16-byte vectors each thread loads at once

__device__ __forceinline__ float ce_exp(float x) { return expf(x); }
__device__ __forceinline__ double ce_exp(double x) { return exp(x); }
__device__ __forceinline__ float ce_log(float x) { return logf(x); }
__device__ __forceinline__ double ce_log(double x) { return log(x); }
__device__ __forceinline__ float ce_neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double ce_neg_inf(double) { return __longlong_as_double(0xfff0000000000000ll); }

// 16 bytes of T: the unit of the vector loads and stores.
template <typename T> struct __align__(16) CePack {
    T v[16 / sizeof(T)];
};
// A pack moved as one 16-byte word. Stored member by member (or through a union) a pack of
// f16/bf16 compiles to four `st.global.v2.u16`, and even a `uint4` store to four
// `st.global.u32` (PTX of NVRTC 13 for sm_90): four times the store instructions and L2 write
// requests of one `st.global.v4.u32`, which `ce_store` therefore writes itself from the
// elements' bits.
__device__ __forceinline__ u32 ce_word(f16 a, f16 b) { return (u32)a.bits | ((u32)b.bits << 16); }
__device__ __forceinline__ u32 ce_word(bf16 a, bf16 b) { return (u32)a.bits | ((u32)b.bits << 16); }
__device__ __forceinline__ uint4 ce_words(const CePack<f16>& p) {
    return make_uint4(ce_word(p.v[0], p.v[1]), ce_word(p.v[2], p.v[3]), ce_word(p.v[4], p.v[5]),
                      ce_word(p.v[6], p.v[7]));
}
__device__ __forceinline__ uint4 ce_words(const CePack<bf16>& p) {
    return make_uint4(ce_word(p.v[0], p.v[1]), ce_word(p.v[2], p.v[3]), ce_word(p.v[4], p.v[5]),
                      ce_word(p.v[6], p.v[7]));
}
__device__ __forceinline__ uint4 ce_words(const CePack<float>& p) {
    return make_uint4(__float_as_uint(p.v[0]), __float_as_uint(p.v[1]), __float_as_uint(p.v[2]),
                      __float_as_uint(p.v[3]));
}
__device__ __forceinline__ uint4 ce_words(const CePack<double>& p) {
    const u64 a = (u64)__double_as_longlong(p.v[0]), b = (u64)__double_as_longlong(p.v[1]);
    return make_uint4((u32)a, (u32)(a >> 32), (u32)b, (u32)(b >> 32));
}
template <typename T> union CeWord {
    CePack<T> p;
    uint4 u;
};
template <typename T> __device__ __forceinline__ CePack<T> ce_load(const CePack<T>* at) {
    CeWord<T> w;
    w.u = *(const uint4*)at;
    return w.p;
}
// `at`: 16-byte aligned device memory (a generic address of global memory, as every storage's).
template <typename T> __device__ __forceinline__ void ce_store(T* at, const CePack<T>& p) {
    const uint4 w = ce_words(p);
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                 : "memory");
}

// The running (max, Σ exp(x - max)) of a set of values. A max of -inf means every value so far
// is -inf (their sum is 0, not exp(-inf - -inf)); a NaN max makes everything NaN.
template <typename A> struct Lse {
    A m, s;
};
template <typename A> __device__ __forceinline__ Lse<A> lse_empty() {
    Lse<A> r;
    r.m = ce_neg_inf((A)0);
    r.s = (A)0;
    return r;
}
template <typename A> __device__ __forceinline__ A lse_scale(const Lse<A>& a, A m) {
    return a.m == ce_neg_inf((A)0) ? (A)0 : a.s * ce_exp(a.m - m);
}
template <typename A> __device__ __forceinline__ Lse<A> lse_merge(const Lse<A>& a, const Lse<A>& b) {
    Lse<A> r;
    r.m = (b.m > a.m || b.m != b.m) ? b.m : a.m;
    if (r.m != r.m) {
        r.s = r.m;
        return r;
    }
    r.s = lse_scale(a, r.m) + lse_scale(b, r.m);
    return r;
}
// Adds k values (k small, a vector's worth): the running max moves once per vector.
template <typename A, int K> __device__ __forceinline__ void lse_push(Lse<A>& a, const A (&x)[K]) {
    A vm = x[0];
#pragma unroll
    for (int i = 1; i < K; ++i) vm = (x[i] > vm || x[i] != x[i]) ? x[i] : vm;
    if (!(vm <= a.m)) {  // a larger max, or NaN
        a.s = lse_scale(a, vm);
        a.m = vm;
    }
    if (a.m == ce_neg_inf((A)0)) return;
    A s = (A)0;
#pragma unroll
    for (int i = 0; i < K; ++i) s += ce_exp(x[i] - a.m);
    a.s += s;
}

__device__ __forceinline__ float shfl_xor_any(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ double shfl_xor_any(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
template <typename A> __device__ __forceinline__ Lse<A> shfl_xor_any(Lse<A> v, int o) {
    Lse<A> r;
    r.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    r.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    return r;
}

// Block-wide combine of one value per thread; every thread gets the result (fixed order: the
// shuffle tree, then the warps in order). Called by every thread the same number of times.
template <typename V, typename F> __device__ __forceinline__ V ce_block_all(V v, F f) {
    __shared__ V sm[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = f(v, shfl_xor_any(v, o));
    const int warps = blockDim.x >> 5;
    if (warps == 1) return v;
    __syncthreads();  // the previous call's readers are done with `sm`
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
    __syncthreads();
    V r = sm[0];
    for (int w = 1; w < warps; ++w) r = f(r, sm[w]);
    return r;
}
struct CeSum {
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct CeLseMerge {
    template <typename A> __device__ __forceinline__ Lse<A> operator()(Lse<A> a, Lse<A> b) const {
        return lse_merge(a, b);
    }
};

// The elements of row `xr` (c of them) that thread `threadIdx.x` of the block takes, in a fixed
// order: `one(j, x)` for the elements before the first 16-byte boundary and after the last,
// `pack(j, xs)` for the 16-byte vectors between (j the first element's column). `vec` false
// takes every element one by one.
template <typename T, typename One, typename Pack>
__device__ __forceinline__ void ce_row(const T* xr, i64 c, bool vec, One one, Pack pack) {
    const int K = 16 / sizeof(T);
    i64 head = c, body = 0;
    if (vec) {
        head = (i64)((16 - ((u64)xr & 15)) & 15) / (i64)sizeof(T);
        if (head > c) head = c;
        body = (c - head) / K;
    }
    for (i64 j = threadIdx.x; j < head; j += blockDim.x) one(j, xr[j]);
    const CePack<T>* xp = (const CePack<T>*)(xr + head);
    // CE_BATCH vectors loaded before any is used, so each thread keeps that many 16-byte loads
    // in flight (one at a time leaves HBM idle: Note [Classifier launch]); the order in which
    // `pack` sees them is the same as one at a time.
    const i64 step = blockDim.x;
    i64 k = threadIdx.x;
    for (; k + (CE_BATCH - 1) * step < body; k += CE_BATCH * step) {
        CePack<T> p[CE_BATCH];
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) p[u] = ce_load(xp + k + u * step);
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) pack(head + (k + u * step) * K, p[u]);
    }
    for (; k < body; k += step) pack(head + k * K, ce_load(xp + k));
    for (i64 j = head + body * K + threadIdx.x; j < c; j += blockDim.x) one(j, xr[j]);
}

template <typename T, typename I>
__device__ void ce_forward(const T* x, const I* target, const typename Acc<T>::type* weight, i64 n, i64 c,
                           i64 ignore_index, double smoothing, typename Acc<T>::type* lse,
                           typename Acc<T>::type* row_loss, typename Acc<T>::type* row_weight, ErrorCheck check) {
    typedef typename Acc<T>::type A;
    const int K = 16 / sizeof(T);
    const A eps = (A)smoothing;
    FirstBad bad = no_bad();
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const T* xr = x + row * c;
        const i64 t = (i64)target[row];
        const bool ignored = t == ignore_index;
        const bool in_range = t >= 0 && t < c;
        if (!ignored && !in_range && threadIdx.x == 0) note_bad(bad, (u64)row, t);
        // Σ_c w[c]·x[c] (or Σ x[c]) and W for the smoothing term, in the same pass.
        const bool smooth = eps != (A)0 && !ignored && in_range;
        Lse<A> acc = lse_empty<A>();
        A wx = (A)0, ws = (A)0;
        ce_row(
            xr, c, true,
            [&](i64 j, T v) {
                A a[1] = {load(v)};
                lse_push(acc, a);
                if (smooth) {
                    const A wj = weight ? weight[j] : (A)1;
                    wx += wj * a[0];
                    ws += wj;
                }
            },
            [&](i64 j, const CePack<T>& p) {
                A a[K];
#pragma unroll
                for (int i = 0; i < K; ++i) a[i] = load(p.v[i]);
                lse_push(acc, a);
                if (smooth) {
#pragma unroll
                    for (int i = 0; i < K; ++i) {
                        const A wj = weight ? weight[j + i] : (A)1;
                        wx += wj * a[i];
                        ws += wj;
                    }
                }
            });
        acc = ce_block_all(acc, CeLseMerge());
        if (smooth) {
            wx = ce_block_all(wx, CeSum());
            ws = ce_block_all(ws, CeSum());
        }
        if (threadIdx.x == 0) {
            const A l = acc.m == ce_neg_inf((A)0) || acc.m != acc.m ? acc.m : acc.m + ce_log(acc.s);
            lse[row] = l;
            A loss = (A)0, wt = (A)0;
            if (!ignored && in_range) {
                wt = weight ? weight[t] : (A)1;
                loss = ((A)1 - eps) * wt * (l - load(xr[t]));
                if (smooth) loss += eps / (A)c * (ws * l - wx);
            }
            row_loss[row] = loss;
            row_weight[row] = wt;
        }
    }
    if (threadIdx.x < 32) report_bad(check, bad);
}

template <typename O>
__device__ void ce_reduce(const typename Acc<O>::type* row_loss, const typename Acc<O>::type* row_weight,
                          const typename Acc<O>::type* weight, i64 n, i64 c, i32 mode, O* out,
                          typename Acc<O>::type* total) {
    typedef typename Acc<O>::type A;
    if (mode == CE_NONE) {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) out[i] = cast<O>(row_loss[i]);
    }
    A l = (A)0, w = (A)0, big_w = (A)0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        l += row_loss[i];
        w += row_weight[i];
    }
    if (weight) {
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) big_w += weight[j];
    }
    l = ce_block_all(l, CeSum());
    w = ce_block_all(w, CeSum());
    big_w = weight ? ce_block_all(big_w, CeSum()) : (A)c;
    if (threadIdx.x == 0) {
        total[0] = w;
        total[1] = big_w;
        if (mode == CE_SUM) out[0] = cast<O>(l);
        if (mode == CE_MEAN) out[0] = cast<O>(l / w);
    }
}

template <typename T, typename I>
__device__ void ce_backward(const T* x, const I* target, const typename Acc<T>::type* weight,
                            const typename Acc<T>::type* lse, const typename Acc<T>::type* total,
                            const typename Acc<T>::type* g, i64 g_stride, i64 n, i64 c, i64 ignore_index,
                            double smoothing, i32 mode, T* grad) {
    typedef typename Acc<T>::type A;
    const int K = 16 / sizeof(T);
    const A eps = (A)smoothing;
    const A divisor = mode == CE_MEAN ? total[0] : (A)1;
    const A big_w = total[1];
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const T* xr = x + row * c;
        T* gr = grad + row * c;
        const i64 t = (i64)target[row];
        const bool counted = t != ignore_index && t >= 0 && t < c;
        // Same offset from a 16-byte boundary: vectors in both (else one element at a time).
        const bool vec = (((u64)xr ^ (u64)gr) & 15) == 0;
        if (!counted) {
            const T zero = cast<T>((A)0);
            ce_row(
                xr, c, vec, [&](i64 j, T) { gr[j] = zero; },
                [&](i64 j, const CePack<T>&) {
                    CePack<T> z;
#pragma unroll
                    for (int i = 0; i < K; ++i) z.v[i] = zero;
                    ce_store(gr + j, z);
                });
            continue;
        }
        const A s = g[row * g_stride] / divisor;
        const A a = s * ((A)1 - eps) * (weight ? weight[t] : (A)1);
        const A b = s * eps / (A)c;
        const A ab = a + b * big_w;
        const A l = lse[row];
        ce_row(
            xr, c, vec,
            [&](i64 j, T v) {
                A d = ab * ce_exp(load(v) - l) - (j == t ? a : (A)0);
                if (eps != (A)0) d -= b * (weight ? weight[j] : (A)1);
                gr[j] = cast<T>(d);
            },
            [&](i64 j, const CePack<T>& p) {
                CePack<T> o;
#pragma unroll
                for (int i = 0; i < K; ++i) {
                    A d = ab * ce_exp(load(p.v[i]) - l) - (j + i == t ? a : (A)0);
                    if (eps != (A)0) d -= b * (weight ? weight[j + i] : (A)1);
                    o.v[i] = cast<T>(d);
                }
                ce_store(gr + j, o);
            });
    }
}

// Note [One-pass classifier]: when the loss's gradient will be the implicit 1 of
// `loss.backward()` (a mean or sum over the rows), the gradient of the logits does not depend on
// anything the backward brings, so the forward writes it (`cross_entropy_forward_grad`) while the
// row is still in registers: each thread holds up to CE_HELD 16-byte vectors of its row (1024
// threads hold 65,536 bf16 classes), so the logits are read once and the gradient written once,
// where the two-kernel path reads them twice. The divisor of the mean, Σ w[t] over the counted
// rows, is summed first from the targets alone (`cross_entropy_totals`, in ce_reduce's order, so
// its bits are the same). The element formula is ce_backward's with g = 1; a gradient other than
// the implicit 1 multiplies it (`cross_entropy_rescale`). Decision and figures: Note [One-pass
// classifier] in `ops/loss.rs`.
#define CE_HELD 8

// Σ w[t] over the counted rows and Σ_c w[c] (W), in ce_reduce's order; one block.
template <typename I, typename A>
__device__ void ce_totals(const I* target, const A* weight, i64 n, i64 c, i64 ignore_index, A* total) {
    A w = (A)0, big_w = (A)0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const i64 t = (i64)target[i];
        const bool counted = t != ignore_index && t >= 0 && t < c;
        w += counted ? (weight ? weight[t] : (A)1) : (A)0;
    }
    if (weight) {
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) big_w += weight[j];
    }
    w = ce_block_all(w, CeSum());
    big_w = weight ? ce_block_all(big_w, CeSum()) : (A)c;
    if (threadIdx.x == 0) {
        total[0] = w;
        total[1] = big_w;
    }
}

// One block per row (grid-stride): ce_forward's row loss and row weight, and the gradient row
// for a loss gradient of 1. Rows are 16-byte aligned, c·sizeof(T) a multiple of 16 and at most
// blockDim.x·CE_HELD vectors long (the launcher checks).
template <typename T, typename I>
__device__ void ce_forward_grad(const T* x, const I* target, const typename Acc<T>::type* weight,
                                const typename Acc<T>::type* total, i64 n, i64 c, i64 ignore_index,
                                double smoothing, i32 mode, typename Acc<T>::type* row_loss,
                                typename Acc<T>::type* row_weight, T* grad, ErrorCheck check) {
    typedef typename Acc<T>::type A;
    const int K = 16 / sizeof(T);
    const i64 vectors = c / K;
    const A eps = (A)smoothing;
    const A divisor = mode == CE_MEAN ? total[0] : (A)1;
    const A big_w = total[1];
    FirstBad bad = no_bad();
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const CePack<T>* xr = (const CePack<T>*)(x + row * c);
        T* gr = grad + row * c;
        const i64 t = (i64)target[row];
        const bool ignored = t == ignore_index;
        const bool in_range = t >= 0 && t < c;
        if (!ignored && !in_range && threadIdx.x == 0) note_bad(bad, (u64)row, t);
        const bool counted = !ignored && in_range;
        const bool smooth = eps != (A)0 && counted;
        CePack<T> p[CE_HELD];
#pragma unroll
        for (int u = 0; u < CE_HELD; ++u) {
            const i64 v = threadIdx.x + (i64)u * blockDim.x;
            if (v < vectors) p[u] = ce_load(xr + v);
        }
        Lse<A> acc = lse_empty<A>();
        A wx = (A)0, ws = (A)0;
#pragma unroll
        for (int u = 0; u < CE_HELD; ++u) {
            const i64 v = threadIdx.x + (i64)u * blockDim.x;
            if (v < vectors) {
                A a[K];
#pragma unroll
                for (int i = 0; i < K; ++i) a[i] = load(p[u].v[i]);
                lse_push(acc, a);
                if (smooth) {
#pragma unroll
                    for (int i = 0; i < K; ++i) {
                        const A wj = weight ? weight[v * K + i] : (A)1;
                        wx += wj * a[i];
                        ws += wj;
                    }
                }
            }
        }
        acc = ce_block_all(acc, CeLseMerge());
        if (smooth) {
            wx = ce_block_all(wx, CeSum());
            ws = ce_block_all(ws, CeSum());
        }
        const A l = acc.m == ce_neg_inf((A)0) || acc.m != acc.m ? acc.m : acc.m + ce_log(acc.s);
        if (threadIdx.x == 0) {
            A loss = (A)0, wt = (A)0;
            if (counted) {
                wt = weight ? weight[t] : (A)1;
                loss = ((A)1 - eps) * wt * (l - load(x[row * c + t]));
                if (smooth) loss += eps / (A)c * (ws * l - wx);
            }
            row_loss[row] = loss;
            row_weight[row] = wt;
        }
        // ce_backward's constants for g = 1.
        const A s = (A)1 / divisor;
        const A a = s * ((A)1 - eps) * (counted && weight ? weight[t] : (A)1);
        const A b = s * eps / (A)c;
        const A ab = a + b * big_w;
#pragma unroll
        for (int u = 0; u < CE_HELD; ++u) {
            const i64 v = threadIdx.x + (i64)u * blockDim.x;
            if (v < vectors) {
                CePack<T> o;
#pragma unroll
                for (int i = 0; i < K; ++i) {
                    A d = (A)0;
                    if (counted) {
                        d = ab * ce_exp(load(p[u].v[i]) - l) - (v * K + i == t ? a : (A)0);
                        if (eps != (A)0) d -= b * (weight ? weight[v * K + i] : (A)1);
                    }
                    o.v[i] = cast<T>(d);
                }
                ce_store(gr + v * K, o);
            }
        }
    }
    if (threadIdx.x < 32) report_bad(check, bad);
}

// out = in · g[0] (A inside, one rounding), over `vectors` 16-byte vectors of T.
template <typename T>
__device__ void ce_rescale(const T* in, const typename Acc<T>::type* g, i64 vectors, T* out) {
    typedef typename Acc<T>::type A;
    const int K = 16 / sizeof(T);
    const A s = g[0];
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += stride) {
        const CePack<T> p = ce_load((const CePack<T>*)in + v);
        CePack<T> o;
#pragma unroll
        for (int i = 0; i < K; ++i) o.v[i] = cast<T>(load(p.v[i]) * s);
        ce_store(out + v * K, o);
    }
}

#define EMBER_CE(T, name, I, iname)                                                                              \
    EMBER_IN_UNIT(cross_entropy_##name##_##iname,                                                                \
    extern "C" __global__ void cross_entropy_##name##_##iname EMBER_PARAMS_cross_entropy(T, I, Acc<T>::type) {    \
        ce_forward<T, I>(x, target, weight, n, c, ignore_index, smoothing, lse, row_loss, row_weight, check);     \
    })                                                                                                           \
    EMBER_IN_UNIT(cross_entropy_backward_##name##_##iname,                                                       \
    extern "C" __global__ void cross_entropy_backward_##name##_##iname                                          \
        EMBER_PARAMS_cross_entropy_backward(T, I, Acc<T>::type) {                                                \
        ce_backward<T, I>(x, target, weight, lse, total, g, g_stride, n, c, ignore_index, smoothing, mode, grad); \
    })                                                                                                           \
    EMBER_IN_UNIT(cross_entropy_forward_grad_##name##_##iname,                                                   \
    extern "C" __global__ void __launch_bounds__(1024) cross_entropy_forward_grad_##name##_##iname              \
        EMBER_PARAMS_cross_entropy_forward_grad(T, I, Acc<T>::type) {                                            \
        ce_forward_grad<T, I>(x, target, weight, total, n, c, ignore_index, smoothing, mode, row_loss,          \
                              row_weight, grad, check);                                                          \
    })                                                                                                           \
    EMBER_IN_UNIT(cross_entropy_totals_##name##_##iname,                                                         \
    extern "C" __global__ void cross_entropy_totals_##name##_##iname                                            \
        EMBER_PARAMS_cross_entropy_totals(T, I, Acc<T>::type) {                                                     \
        ce_totals<I, Acc<T>::type>(target, weight, n, c, ignore_index, total);                                   \
    })
#define EMBER_CE_INDEX(T, name) EMBER_CE(T, name, i64, i64) EMBER_CE(T, name, i32, i32)
EMBER_FOR_FLOAT_DTYPES(EMBER_CE_INDEX)

#define EMBER_CE_RESCALE(T, name)                                                                                \
    EMBER_IN_UNIT(cross_entropy_rescale_##name,                                                                  \
    extern "C" __global__ void cross_entropy_rescale_##name EMBER_PARAMS_cross_entropy_rescale(T, Acc<T>::type) { \
        ce_rescale<T>(input, g, vectors, out);                                                                      \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_CE_RESCALE)

#define EMBER_CE_REDUCE(O, name)                                                                                 \
    EMBER_IN_UNIT(cross_entropy_reduce_##name,                                                                   \
    extern "C" __global__ void cross_entropy_reduce_##name EMBER_PARAMS_cross_entropy_reduce(O, Acc<O>::type) {  \
        ce_reduce<O>(row_loss, row_weight, weight, n, c, mode, out, total);                                      \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_CE_REDUCE)
