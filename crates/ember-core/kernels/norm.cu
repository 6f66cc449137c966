// Fused layer normalization (PyTorch's native_layer_norm / native_layer_norm_backward) over
// rows of `n` contiguous elements, with the CPU backend's formulas (`cpu/norm.rs`):
//   forward   mean = Σx / n, var = Σ(x - mean)² / n, rstd = 1 / sqrt(var + eps)
//             y = (x - mean) · rstd · w + b           (w, b optional)
//   backward  xhat = (x - mean) · rstd, dxhat = g · w
//             dx = rstd · (dxhat - mean(dxhat) - xhat · mean(dxhat · xhat))
//             dw = Σ_rows g · xhat, db = Σ_rows g
//           with `addend`, dx is added to it before the one rounding and the sum written to dx
//           (`addend` may be dx itself: Note [Gradients added in place] in
//           `autograd/engine.rs`); the fused residual add's backward is this kernel with the
//           gradient that reached the sum from its other uses as `addend`
//   fused     add_layer_norm: sum = x + res rounded to T, then the forward above over the sum
//             (Note [Fused residual add])
// T (x, y, g, dx) in f32 f64 f16 bf16, W (weight, bias) T or, for f16/bf16 inputs, f32 (as
// PyTorch's mixed-type kernels); A = Acc<T> (f32, f64 for f64) is the math type and the dtype
// of mean and rstd. Each result is rounded once on store.
//
// Geometry: one warp per row (lanes along x, blockDim.y warps a block, grid-stride over rows).
// A row is read with 16-byte vectors when `vec` is 1 (n a multiple of 16 / sizeof(T) and every
// row-major operand 16-byte aligned: the host checks), else element by element. The forward
// reads a row three times (sum, squared deviations, output) and the backward twice; the rereads
// come from L1 (a 768-element bf16 row is 1.5 KiB), or for the backward from L2 once the warps'
// sums fill most of the SM's shared memory. `layer_norm_backward_rows` reads each row of g and x
// once into registers instead (Note [Layer norm backward in registers]).
//
// Parameter gradients, deterministic (no float atomics): every warp adds its rows' g · xhat and
// g into its own accumulator of 2n A's (dynamic shared memory, blockDim.y · 2n · sizeof(A)
// bytes), then the block sums its warps in order into its row of `partial` ([gridDim.x, 2n]);
// with no shared memory (2n A's do not fit), the block is one warp and accumulates straight into
// its row of `partial`. `layer_norm_backward_params` then sums the rows of `partial` in order
// per column (dw from the first n, db from the second n).
//
// Note [Layer norm backward in registers]: GPT-2 runs LayerNorm in f32 under autocast, and its
// backward over [8192, 768] must move 75 MB (read g and x, write dx), ~21 µs at an H200's
// bandwidth. `layer_norm_backward` took 36.2 µs there: its second pass over a row missed L1
// (8 warps' sums of 6 KiB a block, 4 blocks an SM, leave little of it) and its 80 registers fit
// 3 of the 4 blocks an SM the grid asked for, so a quarter ran as a second wave. Rows of at most
// 32 · LN_LANE_ELEMS = 768 elements of a 4- or 2-byte T now take `layer_norm_backward_rows`: a
// lane loads its 24 elements of g and x once (all loads in flight together), both passes read
// registers, the sums accumulate as in `ln_bwd`, and the grid is the 2 blocks an SM its launch
// bounds keep registers for: 26.8 µs in f32 (2.8 TB/s; the sums' kernel 3.5 -> 2.5 µs, half
// the rows of `partial`), bf16 with bf16 weights 24.1 -> 17.3 µs. With 3 blocks an SM (80
// registers, spills) f32 took 31.3 µs, with 1 block 27.8 µs. Longer rows keep the two-pass
// kernel: held in registers they would cost occupancy (NVRTC's register count is the kernel's
// largest path, so the two paths are two kernels; one kernel with both took the [6144, 1024]
// backward from 32.3 to 37.8 µs). Kernel times from the profiler,
// `cuda_layernorm_f32_kernel_time` in `tests/it/layer_norm.rs`.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda_backend/launch.rs`.

__device__ __forceinline__ float ln_rsqrt(float v) { return 1.0f / sqrtf(v); }
__device__ __forceinline__ double ln_rsqrt(double v) { return 1.0 / sqrt(v); }

// V consecutive elements of T, read or written as whole 16-byte words when they fill some (x
// and y: one word; f32 weights or sums beside 8 bf16: two), else element by element.
template <typename T, int V> struct __align__(sizeof(T) * V) LnVec { T v[V]; };
template <typename T, int V> __device__ __forceinline__ LnVec<T, V> ln_load(const T* p) {
    LnVec<T, V> r;
    if (V * sizeof(T) % 16 == 0) {
#pragma unroll
        for (int k = 0; k < (int)(V * sizeof(T) / 16); ++k) ((uint4*)r.v)[k] = ((const uint4*)p)[k];
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) r.v[i] = p[i];
    }
    return r;
}
template <typename T, int V> __device__ __forceinline__ void ln_store(T* p, const LnVec<T, V>& r) {
    if (V * sizeof(T) % 16 == 0) {
#pragma unroll
        for (int k = 0; k < (int)(V * sizeof(T) / 16); ++k) ((uint4*)p)[k] = ((const uint4*)r.v)[k];
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = r.v[i];
    }
}

// The bf16 twin of V stored elements (Note [Cast twins] in `storage/mod.rs`): each the
// correctly rounded cast of the element as stored in T, one 8-byte store for 4 elements.
template <typename T, int V> __device__ __forceinline__ void ln_store_low(bf16* p, const LnVec<T, V>& o) {
    LnVec<bf16, V> l;
#pragma unroll
    for (int i = 0; i < V; ++i) l.v[i] = cast<bf16>(load(o.v[i]));
    if (V * sizeof(bf16) == 8) {
        *(uint2*)p = *(const uint2*)l.v;
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = l.v[i];
    }
}

extern __shared__ __align__(16) unsigned char ln_smem[];

// Blocks of up to 256 threads an SM that `layer_norm_backward_rows`'s launch bounds keep
// registers for (`ROWS_BLOCKS_PER_SM` in `cuda_backend/norm.rs`, its grid).
#define LN_BWD_ROWS_MIN_BLOCKS 2

// Passes 2 and 3 of one row of x (`xr`) whose lane sums of pass 1 are `s`: the mean, the
// squared deviations, rstd, and the output row `yr` (and its bf16 twin `lowr`). Shared by the
// layer norm and the fused residual add (`aln_fwd`), so both reduce a row in the same order.
template <typename T, typename W, int V>
__device__ __forceinline__ void ln_fwd_row(const T* xr, typename Acc<T>::type s, const W* w, const W* b, T* yr,
                                           bf16* lowr, typename Acc<T>::type* mean, typename Acc<T>::type* rstd,
                                           i64 r, i64 n, double eps) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x;
    const i64 step = (i64)32 * V;
    const A m = warp_sum(s) / (A)n;
    A q = (A)0;
    for (i64 c = (i64)lane * V; c < n; c += step) {
        LnVec<T, V> v = ln_load<T, V>(xr + c);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const A d = load(v.v[i]) - m;
            q += d * d;
        }
    }
    const A rs = ln_rsqrt(warp_sum(q) / (A)n + (A)eps);
    if (lane == 0) {
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = rs;
    }
    for (i64 c = (i64)lane * V; c < n; c += step) {
        LnVec<T, V> v = ln_load<T, V>(xr + c);
        LnVec<T, V> o;
        // Weight and bias as vectors too (the host checked their alignment): one load
        // instruction per 16 bytes instead of one per element.
        LnVec<W, V> wv, bv;
        if (w) wv = ln_load<W, V>(w + c);
        if (b) bv = ln_load<W, V>(b + c);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            A t = (load(v.v[i]) - m) * rs;
            if (w) t = t * (A)load(wv.v[i]);
            if (b) t = t + (A)load(bv.v[i]);
            o.v[i] = cast<T>(t);
        }
        ln_store<T, V>(yr + c, o);
        if (lowr) ln_store_low<T, V>(lowr + c, o);
    }
}

template <typename T, typename W, int V>
__device__ void ln_fwd(const T* x, const W* w, const W* b, T* y, bf16* low, typename Acc<T>::type* mean,
                       typename Acc<T>::type* rstd, i64 rows, i64 n, double eps) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x;
    const i64 step = (i64)32 * V;
    for (i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.x * blockDim.y) {
        const T* xr = x + r * n;
        A s = (A)0;
        for (i64 c = (i64)lane * V; c < n; c += step) {
            LnVec<T, V> v = ln_load<T, V>(xr + c);
#pragma unroll
            for (int i = 0; i < V; ++i) s += load(v.v[i]);
        }
        ln_fwd_row<T, W, V>(xr, s, w, b, y + r * n, low ? low + r * n : low, mean, rstd, r, n, eps);
    }
}

// Note [Fused residual add]: `add_layer_norm` (GPT-2's `x = x + proj(..)` then `ln2(x)`, as
// llm.c's `fused_residual_forward`): pass 1 reads a row of x and of the residual once, writes
// their sum rounded to T (`cast<T>(load(x) + load(res))`: the add kernel's value, in A, and for
// a float32 x beside a half residual the mixed add's, Note [Mixed operands] in
// `elementwise.cu`) and sums the rounded values; passes 2 and 3 are the layer norm's
// (`ln_fwd_row`) over the row just written, which each lane reads back from the columns it
// wrote itself. So `normed` is the layer norm of the rounded sum with the same reductions in the
// same order: the same bits as `add` then `layer_norm` when both read the same vector width
// (`vec`, which for the fused kernel also asks x and, of its own dtype, the residual to be
// aligned). R is T, or a half dtype beside a float32 T.
template <typename T, typename R, typename W, int V>
__device__ void aln_fwd(const T* x, const R* res, const W* w, const W* b, T* sum, T* y, bf16* low,
                        typename Acc<T>::type* mean, typename Acc<T>::type* rstd, i64 rows, i64 n, double eps) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x;
    const i64 step = (i64)32 * V;
    for (i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.x * blockDim.y) {
        const T* xr = x + r * n;
        const R* rr = res + r * n;
        T* sr = sum + r * n;
        A s = (A)0;
        for (i64 c = (i64)lane * V; c < n; c += step) {
            LnVec<T, V> v = ln_load<T, V>(xr + c);
            LnVec<R, V> u = ln_load<R, V>(rr + c);
            LnVec<T, V> o;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                o.v[i] = cast<T>((A)load(v.v[i]) + (A)load(u.v[i]));
                s += load(o.v[i]);
            }
            ln_store<T, V>(sr + c, o);
        }
        ln_fwd_row<T, W, V>(sr, s, w, b, y + r * n, low ? low + r * n : low, mean, rstd, r, n, eps);
    }
}

template <typename T, typename W, int V>
__device__ void ln_bwd(const T* g, const T* x, const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
                       const W* w, T* dx, bf16* low, typename Acc<T>::type* partial, i64 rows, i64 n, int shared,
                       const T* addend) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x, warp = threadIdx.y, warps = blockDim.y;
    const i64 step = (i64)32 * V;
    // The warp's accumulator: its slice of shared memory, or (one warp a block) the block's row
    // of `partial`. Each lane adds only to the columns it reads, so no two lanes touch one slot.
    A* acc = 0;
    if (partial) {
        acc = shared ? (A*)ln_smem + (i64)warp * 2 * n : partial + (i64)blockIdx.x * 2 * n;
        for (i64 c = lane; c < 2 * n; c += 32) acc[c] = (A)0;
        __syncwarp();
    }
    for (i64 r = (i64)blockIdx.x * warps + warp; r < rows; r += (i64)gridDim.x * warps) {
        const T* gr = g + r * n;
        const T* xr = x + r * n;
        const A m = mean[r], rs = rstd[r];
        A s1 = (A)0, s2 = (A)0;
        for (i64 c = (i64)lane * V; c < n; c += step) {
            LnVec<T, V> gv = ln_load<T, V>(gr + c), xv = ln_load<T, V>(xr + c);
            LnVec<W, V> wv;
            if (w) wv = ln_load<W, V>(w + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const A xh = (load(xv.v[i]) - m) * rs;
                A dxh = load(gv.v[i]);
                if (w) dxh = dxh * (A)load(wv.v[i]);
                s1 += dxh;
                s2 += dxh * xh;
            }
        }
        s1 = warp_sum(s1) / (A)n;
        s2 = warp_sum(s2) / (A)n;
        T* dr = dx ? dx + r * n : dx;
        const T* ar = addend ? addend + r * n : addend;
        for (i64 c = (i64)lane * V; c < n; c += step) {
            LnVec<T, V> gv = ln_load<T, V>(gr + c), xv = ln_load<T, V>(xr + c);
            LnVec<W, V> wv;
            if (w) wv = ln_load<W, V>(w + c);
            LnVec<T, V> o;
            if (dr && ar) o = ln_load<T, V>(ar + c);
            // The sums as vectors (a lane's V consecutive slots): scalar slots V apart across
            // the lanes would hit a quarter of the shared-memory banks (V = 8, f32).
            LnVec<A, V> aw, ab;
            if (acc) {
                aw = ln_load<A, V>(acc + c);
                ab = ln_load<A, V>(acc + n + c);
            }
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const A gg = load(gv.v[i]);
                const A xh = (load(xv.v[i]) - m) * rs;
                A dxh = gg;
                if (w) dxh = dxh * (A)load(wv.v[i]);
                const A d = (dxh - s1 - xh * s2) * rs;
                o.v[i] = cast<T>(ar ? (A)load(o.v[i]) + d : d);
                if (acc) {
                    aw.v[i] += gg * xh;
                    ab.v[i] += gg;
                }
            }
            if (acc) {
                ln_store<A, V>(acc + c, aw);
                ln_store<A, V>(acc + n + c, ab);
            }
            if (dr) ln_store<T, V>(dr + c, o);
            if (dr && low) ln_store_low<T, V>(low + r * n + c, o);
        }
    }
    if (acc && shared) {
        // The block's warps, summed in order into its row of `partial`.
        __syncthreads();
        A* out = partial + (i64)blockIdx.x * 2 * n;
        for (i64 c = warp * 32 + lane; c < 2 * n; c += (i64)warps * 32) {
            A s = (A)0;
            for (int k = 0; k < warps; ++k) s += ((const A*)ln_smem)[(i64)k * 2 * n + c];
            out[c] = s;
        }
    }
}

// The backward of rows that fit in registers (Note [Layer norm backward in registers]): a
// lane loads its K vectors of a row's g and x (columns (lane + 32k) · V .. + V) once, and both
// passes over the row (the sums, then dx and the parameter sums) read them from registers. The
// parameter sums accumulate per warp in shared memory as in `ln_bwd`. Needs n <= 32 · V · K
// and, when `partial` is set, that shared memory (`shared`).
template <typename T, typename W, int V, int K>
__device__ void ln_bwd_rows(const T* g, const T* x, const typename Acc<T>::type* mean,
                            const typename Acc<T>::type* rstd, const W* w, T* dx, bf16* low,
                            typename Acc<T>::type* partial,
                            i64 rows, i64 n, const T* addend) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x, warp = threadIdx.y, warps = blockDim.y;
    A* acc = 0;
    if (partial) {
        acc = (A*)ln_smem + (i64)warp * 2 * n;
        for (i64 c = lane; c < 2 * n; c += 32) acc[c] = (A)0;
        __syncwarp();
    }
    for (i64 r = (i64)blockIdx.x * warps + warp; r < rows; r += (i64)gridDim.x * warps) {
        const T* gr = g + r * n;
        const T* xr = x + r * n;
        const A m = mean[r], rs = rstd[r];
        LnVec<T, V> gv[K], xv[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const i64 c = (i64)(lane + 32 * k) * V;
            if (c < n) {
                gv[k] = ln_load<T, V>(gr + c);
                xv[k] = ln_load<T, V>(xr + c);
            }
        }
        A s1 = (A)0, s2 = (A)0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const i64 c = (i64)(lane + 32 * k) * V;
            if (c >= n) continue;
            LnVec<W, V> wv;
            if (w) wv = ln_load<W, V>(w + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const A xh = (load(xv[k].v[i]) - m) * rs;
                A dxh = load(gv[k].v[i]);
                if (w) dxh = dxh * (A)load(wv.v[i]);
                s1 += dxh;
                s2 += dxh * xh;
            }
        }
        s1 = warp_sum(s1) / (A)n;
        s2 = warp_sum(s2) / (A)n;
        T* dr = dx ? dx + r * n : dx;
        const T* ar = addend ? addend + r * n : addend;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const i64 c = (i64)(lane + 32 * k) * V;
            if (c >= n) continue;
            LnVec<W, V> wv;
            if (w) wv = ln_load<W, V>(w + c);
            LnVec<A, V> aw, ab;
            if (acc) {
                aw = ln_load<A, V>(acc + c);
                ab = ln_load<A, V>(acc + n + c);
            }
            LnVec<T, V> o;
            if (dr && ar) o = ln_load<T, V>(ar + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const A gg = load(gv[k].v[i]);
                const A xh = (load(xv[k].v[i]) - m) * rs;
                A dxh = gg;
                if (w) dxh = dxh * (A)load(wv.v[i]);
                const A d = (dxh - s1 - xh * s2) * rs;
                o.v[i] = cast<T>(ar ? (A)load(o.v[i]) + d : d);
                if (acc) {
                    aw.v[i] += gg * xh;
                    ab.v[i] += gg;
                }
            }
            if (acc) {
                ln_store<A, V>(acc + c, aw);
                ln_store<A, V>(acc + n + c, ab);
            }
            if (dr) ln_store<T, V>(dr + c, o);
            if (dr && low) ln_store_low<T, V>(low + r * n + c, o);
        }
    }
    if (acc) {
        // The block's warps, summed in order into its row of `partial`.
        __syncthreads();
        A* out = partial + (i64)blockIdx.x * 2 * n;
        for (i64 c = warp * 32 + lane; c < 2 * n; c += (i64)warps * 32) {
            A s = (A)0;
            for (int k = 0; k < warps; ++k) s += ((const A*)ln_smem)[(i64)k * 2 * n + c];
            out[c] = s;
        }
    }
}

// Elements of a row a lane holds in `layer_norm_backward_rows` (rows of up to 768: GPT-2's).
#define LN_LANE_ELEMS 24

// dw[c] = Σ_k partial[k][c], db[c] = Σ_k partial[k][n + c] over the `blocks` rows. A block
// (32, LN_PARAM_ROWS) takes 32 columns (blockIdx.x-strided): thread y sums rows y, y + 32, ...
// in order, then the 32 partial sums of a column are added in order of y: the same split for
// every run, so the result is deterministic. (One thread a column would sum all 528 rows of an
// H200's `partial` as one chain of L2 loads, ~300 cycles each; 32 threads a column cut the
// chain to 17 loads.)
#define LN_PARAM_ROWS 32
template <typename W>
__device__ void ln_params(const typename Acc<W>::type* partial, i64 blocks, i64 n, W* dw, W* db) {
    typedef typename Acc<W>::type A;
    __shared__ A sums[2][LN_PARAM_ROWS][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (i64 c0 = (i64)blockIdx.x * 32; c0 < n; c0 += (i64)gridDim.x * 32) {
        const i64 c = c0 + tx;
        A sw = (A)0, sb = (A)0;
        if (c < n)
            for (i64 k = ty; k < blocks; k += LN_PARAM_ROWS) {
                sw += partial[k * 2 * n + c];
                sb += partial[k * 2 * n + n + c];
            }
        sums[0][ty][tx] = sw;
        sums[1][ty][tx] = sb;
        __syncthreads();
        if (ty < 2 && c < n) {
            A s = (A)0;
            for (int k = 0; k < LN_PARAM_ROWS; ++k) s += sums[ty][k][tx];
            W* out = ty == 0 ? dw : db;
            if (out) out[c] = cast<W>(s);
        }
        __syncthreads();
    }
}

// The kernels: `layer_norm_<T>_<W>`, `layer_norm_backward_<T>_<W>` (vector width 16 bytes when
// `vec`, else 1) and `layer_norm_backward_params_<W>`.
#define EMBER_LAYER_NORM(T, tn, W, wn)                                                                          \
    EMBER_IN_UNIT(layer_norm_##tn##_##wn,                                                                       \
    extern "C" __global__ void layer_norm_##tn##_##wn EMBER_PARAMS_layer_norm(T, W, Acc<T>::type, bf16) {             \
        if (vec) ln_fwd<T, W, 16 / sizeof(T)>(x, w, b, y, low, mean, rstd, rows, n, eps);                            \
        else ln_fwd<T, W, 1>(x, w, b, y, low, mean, rstd, rows, n, eps);                                             \
    })                                                                                                          \
    EMBER_IN_UNIT(layer_norm_backward_##tn##_##wn,                                                              \
    extern "C" __global__ void layer_norm_backward_##tn##_##wn EMBER_PARAMS_layer_norm_backward(T, W, Acc<T>::type, bf16) { \
        if (vec) ln_bwd<T, W, 16 / sizeof(T)>(g, x, mean, rstd, w, dx, low, partial, rows, n, shared, addend);               \
        else ln_bwd<T, W, 1>(g, x, mean, rstd, w, dx, low, partial, rows, n, shared, addend);                                \
    })
EMBER_LAYER_NORM(float, f32, float, f32)
EMBER_LAYER_NORM(double, f64, double, f64)
EMBER_LAYER_NORM(f16, f16, f16, f16)
EMBER_LAYER_NORM(bf16, bf16, bf16, bf16)
EMBER_LAYER_NORM(f16, f16, float, f32)
EMBER_LAYER_NORM(bf16, bf16, float, f32)

// `add_layer_norm_<T>_<W>` (x and the residual of dtype T) and `add_layer_norm_mixed_<R>` (a
// float32 x beside a residual of half dtype R; weight and bias float32): Note [Fused residual
// add]. The grid and vector width are the layer norm's.
#define EMBER_ADD_LAYER_NORM(name, T, R, W)                                                                     \
    EMBER_IN_UNIT(name,                                                                                         \
    extern "C" __global__ void name EMBER_PARAMS_add_layer_norm(T, R, W, Acc<T>::type, bf16) {                  \
        if (vec) aln_fwd<T, R, W, 16 / sizeof(T)>(x, res, w, b, sum, y, low, mean, rstd, rows, n, eps);        \
        else aln_fwd<T, R, W, 1>(x, res, w, b, sum, y, low, mean, rstd, rows, n, eps);                         \
    })
EMBER_ADD_LAYER_NORM(add_layer_norm_f32_f32, float, float, float)
EMBER_ADD_LAYER_NORM(add_layer_norm_f64_f64, double, double, double)
EMBER_ADD_LAYER_NORM(add_layer_norm_f16_f16, f16, f16, f16)
EMBER_ADD_LAYER_NORM(add_layer_norm_bf16_bf16, bf16, bf16, bf16)
EMBER_ADD_LAYER_NORM(add_layer_norm_f16_f32, f16, f16, float)
EMBER_ADD_LAYER_NORM(add_layer_norm_bf16_f32, bf16, bf16, float)
EMBER_ADD_LAYER_NORM(add_layer_norm_mixed_bf16, float, bf16, float)
EMBER_ADD_LAYER_NORM(add_layer_norm_mixed_f16, float, f16, float)

// `layer_norm_backward_rows_<T>_<W>`: rows of at most 32 · LN_LANE_ELEMS elements in registers
// (Note [Layer norm backward in registers]), T of 4 or 2 bytes.
#define EMBER_LAYER_NORM_ROWS(T, tn, W, wn)                                                                     \
    EMBER_IN_UNIT(layer_norm_backward_rows_##tn##_##wn,                                                         \
    extern "C" __global__ void __launch_bounds__(256, LN_BWD_ROWS_MIN_BLOCKS)                                   \
    layer_norm_backward_rows_##tn##_##wn EMBER_PARAMS_layer_norm_backward_rows(T, W, Acc<T>::type, bf16) {           \
        ln_bwd_rows<T, W, 16 / sizeof(T), LN_LANE_ELEMS * sizeof(T) / 16>(g, x, mean, rstd, w, dx, low, partial, rows, n, addend); \
    })
EMBER_LAYER_NORM_ROWS(float, f32, float, f32)
EMBER_LAYER_NORM_ROWS(f16, f16, f16, f16)
EMBER_LAYER_NORM_ROWS(bf16, bf16, bf16, bf16)
EMBER_LAYER_NORM_ROWS(f16, f16, float, f32)
EMBER_LAYER_NORM_ROWS(bf16, bf16, float, f32)

#define EMBER_LAYER_NORM_PARAMS(W, wn)                                                                          \
    EMBER_IN_UNIT(layer_norm_backward_params_##wn,                                                              \
    extern "C" __global__ void layer_norm_backward_params_##wn EMBER_PARAMS_layer_norm_backward_params(W, Acc<W>::type) { \
        ln_params<W>(partial, blocks, n, dw, db);                                                               \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_LAYER_NORM_PARAMS)
