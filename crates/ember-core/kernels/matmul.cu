// Batched integer matrix products (float dtypes go through cuBLASLt, see `cuda/blas.rs`):
// out[b] = a[b] @ b[b] for `a` of shape [B.., m, k] and `b` of shape [B.., k, n] with any
// strides, `out` row-major [B.., m, n]. Products and sums wrap on overflow, as the CPU's
// wrapping loop (`cpu/matmul.rs`), so the result is exact and independent of summation order.
//
// A plain shared-memory tiled kernel: each 16x16 block computes one 16x16 output tile, walking
// k in 16-wide steps; blocks stride over tiles in x (columns), y (rows) and z (batches), so any
// grid works. k = 0 writes zeros. T in i64 i32 u8.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

#define EMBER_MM_TILE 16

// Wrapping arithmetic in an unsigned type at least as wide (mod 2^8 of a u32 sum is the u8 sum).
template <typename T> struct MmWrap;
template <> struct MmWrap<i64> { typedef u64 type; };
template <> struct MmWrap<i32> { typedef u32 type; };
template <> struct MmWrap<u8> { typedef u32 type; };

template <typename T>
__device__ __forceinline__ void matmul_tiled(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                             const Strided& s, i64 batch, i64 m, i64 k, i64 n, i64 a_rs,
                                             i64 a_cs, i64 b_rs, i64 b_cs) {
    typedef typename MmWrap<T>::type U;
    __shared__ U ta[EMBER_MM_TILE][EMBER_MM_TILE];
    __shared__ U tb[EMBER_MM_TILE][EMBER_MM_TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    // Every loop bound below depends on block indices only, so all threads of a block take the
    // same trips and reach each __syncthreads together.
    for (i64 bi = blockIdx.z; bi < batch; bi += gridDim.z) {
        const T* ab = a + strided_offset(s, 0, bi);
        const T* bb = b + strided_offset(s, 1, bi);
        T* ob = out + bi * m * n;
        for (i64 r0 = (i64)blockIdx.y * EMBER_MM_TILE; r0 < m; r0 += (i64)gridDim.y * EMBER_MM_TILE) {
            for (i64 c0 = (i64)blockIdx.x * EMBER_MM_TILE; c0 < n; c0 += (i64)gridDim.x * EMBER_MM_TILE) {
                const i64 row = r0 + ty, col = c0 + tx;
                U acc = 0;
                for (i64 q0 = 0; q0 < k; q0 += EMBER_MM_TILE) {
                    ta[ty][tx] = (row < m && q0 + tx < k) ? (U)ab[row * a_rs + (q0 + tx) * a_cs] : (U)0;
                    tb[ty][tx] = (q0 + ty < k && col < n) ? (U)bb[(q0 + ty) * b_rs + col * b_cs] : (U)0;
                    __syncthreads();
#pragma unroll
                    for (int q = 0; q < EMBER_MM_TILE; ++q) acc += ta[ty][q] * tb[q][tx];
                    __syncthreads();
                }
                if (row < m && col < n) ob[row * n + col] = (T)acc;
            }
        }
    }
}

#define EMBER_MATMUL(T, name)                                                                             \
    EMBER_IN_UNIT(matmul_##name,                                                                          \
    extern "C" __global__ void matmul_##name EMBER_PARAMS_matmul(T) {                                     \
        matmul_tiled<T>(a, b, out, s, batch, m, k, n, a_rs, a_cs, b_rs, b_cs);                            \
    })
EMBER_MATMUL(i64, i64)
EMBER_MATMUL(i32, i32)
EMBER_MATMUL(u8, u8)
