// The pointwise halves of a fused LSTM time step (`ops/rnn.rs`, Note [Fused LSTM recurrence]),
// with the CPU backend's formulas (`cpu/rnn.rs`). The recurrent GEMMs run in cuBLASLt between
// launches; these kernels do everything else of a step in one pass, one thread per (n, j) of
// the [N, H] state, reading the four gates of row n at j, H+j, 2H+j, 3H+j (order i, f, g, o).
// f16/bf16 compute in f32, f32 in f32, f64 in f64; results are rounded once on store.
//
// Every pointer arrives already offset to the step's rows; all operands are row-major:
// gates-shaped operands are [N, 4H], state-shaped ones [N, H].
//
// Forward, step t:
//   a = gi + hh (pre-activation gates); i, f, o = sigmoid(a), g = tanh(a)
//   c = f * c_prev + i * g;  h = o * tanh(c)
//   writes h, c (and c again into c_copy when it is not null: the last step's c_T goes into
//   the output's last row), and the activated gates (i, f, g, o) for backward.
// Backward, step t (dc holds dc_t on entry and dc_{t-1} on exit, in place):
//   dh = dh_out + dh_rec (dh_rec may be null: no recurrent gradient on the last step)
//   tc = tanh(c);  dct = dc + dh * o * (1 - tc^2)
//   da_i = dct * g * i (1 - i);  da_f = dct * c_prev * f (1 - f);  da_g = dct * i * (1 - g^2)
//   da_o = dh * tc * o (1 - o);  dc_prev = dct * f
//
// Grid-stride, any 1-D grid; T in f32 f64 f16 bf16; n = N, hidden = H. Aliasing: c and c_prev
// are different rows of one buffer; dc is read and written by the same thread only; no other
// operands overlap.
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

__device__ __forceinline__ float rnn_exp(float x) { return expf(x); }
__device__ __forceinline__ double rnn_exp(double x) { return exp(x); }
__device__ __forceinline__ float rnn_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double rnn_tanh(double x) { return tanh(x); }
template <typename A> __device__ __forceinline__ A rnn_sigmoid(A x) { return (A)1 / ((A)1 + rnn_exp(-x)); }

template <typename T>
__device__ __forceinline__ void lstm_forward(const T* __restrict__ gi, const T* __restrict__ hh,
                                             const T* __restrict__ c_prev, T* __restrict__ h,
                                             T* __restrict__ c, T* __restrict__ c_copy,
                                             T* __restrict__ gates, i64 n, i64 hidden) {
    typedef typename Acc<T>::type A;
    EMBER_KERNEL_LOOP(idx, n * hidden) {
        const i64 row = idx / hidden;
        const i64 j = idx - row * hidden;
        const i64 g0 = row * 4 * hidden + j;  // gate i of (row, j); f, g, o follow at +H
        const A ig = rnn_sigmoid(load(gi[g0]) + load(hh[g0]));
        const A fg = rnn_sigmoid(load(gi[g0 + hidden]) + load(hh[g0 + hidden]));
        const A gg = rnn_tanh(load(gi[g0 + 2 * hidden]) + load(hh[g0 + 2 * hidden]));
        const A og = rnn_sigmoid(load(gi[g0 + 3 * hidden]) + load(hh[g0 + 3 * hidden]));
        const A cv = fg * load(c_prev[idx]) + ig * gg;
        const T cs = cast<T>(cv);
        c[idx] = cs;
        if (c_copy != nullptr) c_copy[idx] = cs;
        // h from the stored (rounded) c, as a composed f16 step would compute it.
        h[idx] = cast<T>(og * rnn_tanh(load(cs)));
        gates[g0] = cast<T>(ig);
        gates[g0 + hidden] = cast<T>(fg);
        gates[g0 + 2 * hidden] = cast<T>(gg);
        gates[g0 + 3 * hidden] = cast<T>(og);
    }
}

template <typename T>
__device__ __forceinline__ void lstm_backward(const T* __restrict__ dh_out, const T* __restrict__ dh_rec,
                                              const T* __restrict__ gates, const T* __restrict__ c,
                                              const T* __restrict__ c_prev, T* __restrict__ dc,
                                              T* __restrict__ dgates, i64 n, i64 hidden) {
    typedef typename Acc<T>::type A;
    const A one = (A)1;
    EMBER_KERNEL_LOOP(idx, n * hidden) {
        const i64 row = idx / hidden;
        const i64 j = idx - row * hidden;
        const i64 g0 = row * 4 * hidden + j;
        const A ig = load(gates[g0]);
        const A fg = load(gates[g0 + hidden]);
        const A gg = load(gates[g0 + 2 * hidden]);
        const A og = load(gates[g0 + 3 * hidden]);
        A dh = load(dh_out[idx]);
        if (dh_rec != nullptr) dh += load(dh_rec[idx]);
        const A tc = rnn_tanh(load(c[idx]));
        const A dct = load(dc[idx]) + dh * og * (one - tc * tc);
        dgates[g0] = cast<T>(dct * gg * ig * (one - ig));
        dgates[g0 + hidden] = cast<T>(dct * load(c_prev[idx]) * fg * (one - fg));
        dgates[g0 + 2 * hidden] = cast<T>(dct * ig * (one - gg * gg));
        dgates[g0 + 3 * hidden] = cast<T>(dh * tc * og * (one - og));
        dc[idx] = cast<T>(dct * fg);
    }
}

#define EMBER_RNN(T, name)                                                                             \
    EMBER_IN_UNIT(lstm_forward_##name,                                                                 \
    extern "C" __global__ void lstm_forward_##name EMBER_PARAMS_lstm_forward(T) {                   \
        lstm_forward<T>(gi, hh, c_prev, h, c, c_copy, gates, n, hidden);                             \
    })                                                                                               \
    EMBER_IN_UNIT(lstm_backward_##name,                                                              \
    extern "C" __global__ void lstm_backward_##name EMBER_PARAMS_lstm_backward(T) {                  \
        lstm_backward<T>(dh_out, dh_rec, gates, c, c_prev, dc, dgates, n, hidden);                    \
    })
EMBER_FOR_FLOAT_DTYPES(EMBER_RNN)
#undef EMBER_RNN
