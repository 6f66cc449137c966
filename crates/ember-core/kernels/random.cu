// Random numbers: Philox4x32-10 draws that reproduce the CPU backend bit for bit. The mapping
// from (seed, offset, element i) to a value is Note [Philox stream] in `random/mod.rs`; this file
// transcribes `random/philox.rs` and `random/cpu.rs` expression by expression:
// - block b of seed s is philox4x32_10([b lo, b hi, 0, 0], [s lo, s hi]); element i of a draw
//   with E elements per block reads block offset + i / E (wrapping u64) at slot i % E;
// - each thread computes whole blocks (one Philox call per E elements) in a grid-stride loop;
// - every `a + b * c` is two separately rounded operations (`__fmul_rn`/`__fadd_rn`,
//   `__dmul_rn`/`__dadd_rn`): NVRTC contracts to FMA by default, the CPU never does;
// - Box-Muller is computed in f64 with fdlibm's log, sin and cos written as the same sequence
//   of correctly rounded operations as `philox.rs` (Note [Deterministic transcendentals]) and
//   the correctly rounded sqrt, so normals of every dtype, f64 included, equal the CPU's;
// - conversions from f64 to f16/bf16 copy what the `half` crate does on the CPU, which is not
//   always a correctly rounded conversion (see `half_f64_to_f16` / `half_f64_to_bf16` below).
//
// Every kernel takes its (seed, offset) as a `PhiloxArgs` (prelude) and reads it with
// `philox_seed_offset` first thing: by value in eager execution, from device memory for a launch
// recorded into a CUDA graph (Note [Philox under graph capture] in `random/mod.rs`), so a replay
// draws from the offset the generator set before it. Below, `seed` and `offset` are those values.
//
// Grid-stride over counter blocks, any grid with blockDim.x a multiple of 32 (bernoulli_T reports
// warp-collectively); outputs row-major, n elements. E (elements per counter block): uniform and
// normal 2 for f64, 4 otherwise (float T only); bernoulli_p and bernoulli 4 (any T); randint_i64
// 4 when range <= 2^32, else 2. f16_mode says how the CPU's half::f16::from_f64 rounds: 0
// correctly (one rounding), 1 through f32 (x86 F16C), 2 half's software routine. bernoulli_T
// records the first probability outside [0, 1] (or NaN), its f64 bits as the value (Note
// [Deferred device errors] in `cuda/device_errors.rs`).
//
// Parameters: `EMBER_PARAMS_<family>`, declared in `kernels!` in `cuda/launch.rs`.

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

struct Words { u32 x[4]; };

// `philox::block(seed, block)`.
__device__ __forceinline__ Words philox_block(u64 seed, u64 block) {
    u32 c0 = (u32)block, c1 = (u32)(block >> 32), c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    Words w;
    w.x[0] = c0;
    w.x[1] = c1;
    w.x[2] = c2;
    w.x[3] = c3;
    return w;
}

// The conversions of `philox.rs` (all exact: small integers times powers of two).
__device__ __forceinline__ float ubits(u32 x, u32 bits) {
    return __fmul_rn((float)(x >> (32 - bits)), 1.0f / (float)(1u << bits));
}
__device__ __forceinline__ float u24(u32 x) { return __fmul_rn((float)(x >> 8), 0x1.0p-24f); }
__device__ __forceinline__ float u24_open0(u32 x) { return __fmul_rn((float)((x >> 8) + 1), 0x1.0p-24f); }
__device__ __forceinline__ u64 join_u64(u32 lo, u32 hi) { return ((u64)hi << 32) | (u64)lo; }
__device__ __forceinline__ double u53(u32 lo, u32 hi) {
    return __dmul_rn((double)(join_u64(lo, hi) >> 11), 0x1.0p-53);
}
__device__ __forceinline__ double u53_open0(u32 lo, u32 hi) {
    return __dmul_rn((double)((join_u64(lo, hi) >> 11) + 1), 0x1.0p-53);
}

// `philox::ln_box_muller`: fdlibm's log for a positive normal x, operation for operation
// (Note [Deterministic transcendentals] in `random/philox.rs`).
__device__ __forceinline__ double ln_box_muller(double x) {
    const double ln2_hi = __longlong_as_double(0x3FE62E42FEE00000ll);
    const double ln2_lo = __longlong_as_double(0x3DEA39EF35793C76ll);
    const double lg1 = __longlong_as_double(0x3FE5555555555593ll);
    const double lg2 = __longlong_as_double(0x3FD999999997FA04ll);
    const double lg3 = __longlong_as_double(0x3FD2492494229359ll);
    const double lg4 = __longlong_as_double(0x3FCC71C51D8E78AFll);
    const double lg5 = __longlong_as_double(0x3FC7466496CB03DEll);
    const double lg6 = __longlong_as_double(0x3FC39A09D078C69Fll);
    const double lg7 = __longlong_as_double(0x3FC2F112DF3E5244ll);
    u64 bits = (u64)__double_as_longlong(x);
    int hx = (int)(bits >> 32);
    u32 lx = (u32)bits;
    int k = (hx >> 20) - 1023;
    hx &= 0x000FFFFF;
    int i = (hx + 0x95F64) & 0x100000;
    double xn = __longlong_as_double((long long)(((u64)(u32)(hx | (i ^ 0x3FF00000)) << 32) | (u64)lx));
    k += i >> 20;
    double f = __dsub_rn(xn, 1.0);
    double dk = (double)k;
    if ((0x000FFFFF & (2 + hx)) < 3) {
        if (f == 0.0) return k == 0 ? 0.0 : __dadd_rn(__dmul_rn(dk, ln2_hi), __dmul_rn(dk, ln2_lo));
        double r = __dmul_rn(__dmul_rn(f, f), __dsub_rn(0.5, __dmul_rn(0.3333333333333333, f)));
        if (k == 0) return __dsub_rn(f, r);
        return __dsub_rn(__dmul_rn(dk, ln2_hi), __dsub_rn(__dsub_rn(r, __dmul_rn(dk, ln2_lo)), f));
    }
    double s = __ddiv_rn(f, __dadd_rn(2.0, f));
    double z = __dmul_rn(s, s);
    int ii = hx - 0x6147A;
    double w = __dmul_rn(z, z);
    int j = 0x6B851 - hx;
    double t1 = __dmul_rn(w, __dadd_rn(lg2, __dmul_rn(w, __dadd_rn(lg4, __dmul_rn(w, lg6)))));
    double t2 = __dmul_rn(z, __dadd_rn(lg1, __dmul_rn(w, __dadd_rn(lg3, __dmul_rn(w, __dadd_rn(lg5, __dmul_rn(w, lg7)))))));
    ii |= j;
    double r = __dadd_rn(t2, t1);
    if (ii > 0) {
        double hfsq = __dmul_rn(__dmul_rn(0.5, f), f);
        if (k == 0) return __dsub_rn(f, __dsub_rn(hfsq, __dmul_rn(s, __dadd_rn(hfsq, r))));
        return __dsub_rn(__dmul_rn(dk, ln2_hi),
                         __dsub_rn(__dsub_rn(hfsq, __dadd_rn(__dmul_rn(s, __dadd_rn(hfsq, r)), __dmul_rn(dk, ln2_lo))), f));
    }
    if (k == 0) return __dsub_rn(f, __dmul_rn(s, __dsub_rn(f, r)));
    return __dsub_rn(__dmul_rn(dk, ln2_hi), __dsub_rn(__dsub_rn(__dmul_rn(s, __dsub_rn(f, r)), __dmul_rn(dk, ln2_lo)), f));
}

// `philox::kernel_sin` and `kernel_cos` (fdlibm, |x| <= pi/4).
__device__ __forceinline__ double kernel_sin(double x) {
    const double s1 = __longlong_as_double((long long)0xBFC5555555555549ull);
    const double s2 = __longlong_as_double(0x3F8111111110F8A6ll);
    const double s3 = __longlong_as_double((long long)0xBF2A01A019C161D5ull);
    const double s4 = __longlong_as_double(0x3EC71DE357B1FE7Dll);
    const double s5 = __longlong_as_double((long long)0xBE5AE5E68A2B9CEBull);
    const double s6 = __longlong_as_double(0x3DE5D93A5ACFD57Cll);
    double z = __dmul_rn(x, x);
    double v = __dmul_rn(z, x);
    double r = __dadd_rn(s2, __dmul_rn(z, __dadd_rn(s3, __dmul_rn(z, __dadd_rn(s4, __dmul_rn(z, __dadd_rn(s5, __dmul_rn(z, s6))))))));
    return __dadd_rn(x, __dmul_rn(v, __dadd_rn(s1, __dmul_rn(z, r))));
}
__device__ __forceinline__ double kernel_cos(double x) {
    const double c1 = __longlong_as_double(0x3FA555555555554Cll);
    const double c2 = __longlong_as_double((long long)0xBF56C16C16C15177ull);
    const double c3 = __longlong_as_double(0x3EFA01A019CB1590ll);
    const double c4 = __longlong_as_double((long long)0xBE927E4F809C52ADull);
    const double c5 = __longlong_as_double(0x3E21EE9EBDB4B1C4ll);
    const double c6 = __longlong_as_double((long long)0xBDA8FAE9BE8838D4ull);
    u32 ix = (u32)((u64)__double_as_longlong(x) >> 32) & 0x7FFFFFFFu;
    if (ix < 0x3E400000u) return 1.0;
    double z = __dmul_rn(x, x);
    double r = __dmul_rn(z, __dadd_rn(c1, __dmul_rn(z, __dadd_rn(c2, __dmul_rn(z, __dadd_rn(c3, __dmul_rn(z, __dadd_rn(c4, __dmul_rn(z, __dadd_rn(c5, __dmul_rn(z, c6)))))))))));
    if (ix < 0x3FD33333u) return __dsub_rn(1.0, __dsub_rn(__dmul_rn(0.5, z), __dmul_rn(z, r)));
    double qx = ix > 0x3FE90000u ? 0.28125 : __longlong_as_double((long long)((u64)(ix - 0x00200000u) << 32));
    double hz = __dsub_rn(__dmul_rn(0.5, z), qx);
    double a = __dsub_rn(1.0, qx);
    return __dsub_rn(a, __dsub_rn(hz, __dmul_rn(z, r)));
}

// `philox::sin_cos_turns`: (sin 2*pi*t, cos 2*pi*t) with exact quadrant reduction.
__device__ __forceinline__ void sin_cos_turns(double t, double& s_out, double& c_out) {
    const double pio2_hi = __longlong_as_double(0x3FF921FB54442D18ll);
    const double pio2_lo = __longlong_as_double(0x3C91A62633145C07ll);
    double q4 = __dmul_rn(4.0, t);
    double q = floor(__dadd_rn(q4, 0.5));
    double f = __dsub_rn(q4, q);
    double x = __dadd_rn(__dmul_rn(f, pio2_hi), __dmul_rn(f, pio2_lo));
    double s = kernel_sin(x), c = kernel_cos(x);
    switch ((u32)q & 3u) {
        case 0: s_out = s; c_out = c; break;
        case 1: s_out = c; c_out = -s; break;
        case 2: s_out = -s; c_out = -c; break;
        default: s_out = -c; c_out = s; break;
    }
}

// `philox::box_muller`: r = sqrt(-2 ln u1), theta = 2*pi*u2, (r cos theta, r sin theta), with the
// deterministic ln/sin/cos above and the correctly rounded sqrt.
__device__ __forceinline__ void box_muller(double u1, double u2, double& z0, double& z1) {
    double r = __dsqrt_rn(__dmul_rn(-2.0, ln_box_muller(u1)));
    double s, c;
    sin_cos_turns(u2, s, c);
    z0 = __dmul_rn(r, c);
    z1 = __dmul_rn(r, s);
}

// half::f16::from_f64 without F16C (half 2.x `binary16/arch.rs::f64_to_f16_fallback`), bit for
// bit; same truncation of the low 32 bits as above.
__device__ __forceinline__ f16 half_f64_to_f16_software(double value) {
    u64 val = (u64)__double_as_longlong(value);
    u32 x = (u32)(val >> 32);
    u32 sign = x & 0x80000000u, exp = x & 0x7FF00000u, man = x & 0x000FFFFFu;
    f16 r;
    if (exp == 0x7FF00000u) {
        u32 nan_bit = (man == 0 && (u32)val == 0) ? 0u : 0x0200u;
        r.bits = (unsigned short)((sign >> 16) | 0x7C00u | nan_bit | (man >> 10));
        return r;
    }
    u32 half_sign = sign >> 16;
    i64 half_exp = ((i64)(exp >> 20) - 1023) + 15;
    if (half_exp >= 0x1F) {
        r.bits = (unsigned short)(half_sign | 0x7C00u);
        return r;
    }
    if (half_exp <= 0) {
        if (10 - half_exp > 21) {
            r.bits = (unsigned short)half_sign;
            return r;
        }
        u32 m = man | 0x00100000u;
        u32 half_man = m >> (u32)(11 - half_exp);
        u32 round_bit = 1u << (u32)(10 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) half_man += 1;
        r.bits = (unsigned short)(half_sign | half_man);
        return r;
    }
    u32 bits = half_sign | ((u32)half_exp << 10) | (man >> 10);
    u32 round_bit = 0x00000200u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) bits += 1;
    r.bits = (unsigned short)bits;
    return r;
}

// half::f16::from_f64 as the host computes it (`f16_mode`, probed by `cuda/random.rs`).
__device__ __forceinline__ f16 half_f64_to_f16(double value, int mode) {
    if (mode == 1) return f32_to_f16(__double2float_rn(value));  // F16C: f64 -> f32 -> f16
    if (mode == 2) return half_f64_to_f16_software(value);
    f16 r;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(r.bits) : "d"(value));
    return r;
}

// `T::from_f64` of the CPU's `Element` impls for the float types, and uniform bits per dtype.
template <typename T> struct FromF64;
template <> struct FromF64<float> {
    static constexpr u32 bits = 24;
    __device__ __forceinline__ static float from(double v, int) { return __double2float_rn(v); }
};
template <> struct FromF64<f16> {
    static constexpr u32 bits = 11;
    __device__ __forceinline__ static f16 from(double v, int mode) { return half_f64_to_f16(v, mode); }
};
template <> struct FromF64<bf16> {
    static constexpr u32 bits = 8;
    __device__ __forceinline__ static bf16 from(double v, int) { return half_f64_to_bf16(v); }
};

#define EMBER_BLOCKS(n, per) (((n) + (per) - 1) / (per))

// `cpu.rs::uniform_narrow`: computed in f32, converted with T::from_f64, `high` maps to `low`.
template <typename T>
__device__ __forceinline__ void uniform_narrow(T* out, i64 n, u64 seed, u64 offset, double low, double high,
                                               int mode) {
    typedef FromF64<T> C;
    float lo = __double2float_rn(low), hi = __double2float_rn(high);
    float range = __fsub_rn(hi, lo);
    T lo_t = C::from((double)lo, mode), hi_t = C::from((double)hi, mode);
    float hi_v = load(hi_t);
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 4)) {
        Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            i64 i = j * 4 + s;
            if (i < n) {
                float v = __fadd_rn(lo, __fmul_rn(ubits(w.x[s], C::bits), range));
                T t = C::from((double)v, mode);
                out[i] = load(t) == hi_v ? lo_t : t;
            }
        }
    }
}

// `cpu.rs::uniform_wide`.
__device__ __forceinline__ void uniform_wide(double* out, i64 n, u64 seed, u64 offset, double low, double high) {
    double range = __dsub_rn(high, low);
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 2)) {
        Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            i64 i = j * 2 + s;
            if (i < n) {
                double v = __dadd_rn(low, __dmul_rn(u53(w.x[2 * s], w.x[2 * s + 1]), range));
                out[i] = v == high ? low : v;
            }
        }
    }
}

// `cpu.rs::normal_narrow`: two Box-Muller pairs per block, mean + std * z in f64, T::from_f64.
template <typename T>
__device__ __forceinline__ void normal_narrow(T* out, i64 n, u64 seed, u64 offset, double mean, double stdev,
                                              int mode) {
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 4)) {
        Words w = philox_block(seed, offset + (u64)j);
        double z[4];
        box_muller((double)u24_open0(w.x[0]), (double)u24(w.x[1]), z[0], z[1]);
        box_muller((double)u24_open0(w.x[2]), (double)u24(w.x[3]), z[2], z[3]);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            i64 i = j * 4 + s;
            if (i < n) out[i] = FromF64<T>::from(__dadd_rn(mean, __dmul_rn(stdev, z[s])), mode);
        }
    }
}

// `cpu.rs::normal_wide`: one pair per block from two 53-bit uniforms.
__device__ __forceinline__ void normal_wide(double* out, i64 n, u64 seed, u64 offset, double mean, double stdev) {
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 2)) {
        Words w = philox_block(seed, offset + (u64)j);
        double z[2];
        box_muller(u53_open0(w.x[0], w.x[1]), u53(w.x[2], w.x[3]), z[0], z[1]);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            i64 i = j * 2 + s;
            if (i < n) out[i] = __dadd_rn(mean, __dmul_rn(stdev, z[s]));
        }
    }
}

#define EMBER_FLOAT_DRAWS(T, name)                                                                            \
    EMBER_IN_UNIT(uniform_##name,                                                                             \
    extern "C" __global__ void uniform_##name EMBER_PARAMS_uniform(T) {                                       \
        u64 seed, offset;                                                                                     \
        philox_seed_offset(rng, seed, offset);                                                                \
        uniform_narrow<T>(out, n, seed, offset, low, high, f16_mode);                                         \
    })                                                                                                        \
    EMBER_IN_UNIT(normal_##name,                                                                              \
    extern "C" __global__ void normal_##name EMBER_PARAMS_normal(T) {                                         \
        u64 seed, offset;                                                                                     \
        philox_seed_offset(rng, seed, offset);                                                                \
        normal_narrow<T>(out, n, seed, offset, mean, stdev, f16_mode);                                          \
    })
EMBER_FLOAT_DRAWS(float, f32)
EMBER_FLOAT_DRAWS(f16, f16)
EMBER_FLOAT_DRAWS(bf16, bf16)

#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_uniform_f64)
extern "C" __global__ void uniform_f64 EMBER_PARAMS_uniform(double) {  // f16_mode unused
    u64 seed, offset;
    philox_seed_offset(rng, seed, offset);
    uniform_wide(out, n, seed, offset, low, high);
}
#endif
#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_normal_f64)
extern "C" __global__ void normal_f64 EMBER_PARAMS_normal(double) {  // f16_mode unused
    u64 seed, offset;
    philox_seed_offset(rng, seed, offset);
    normal_wide(out, n, seed, offset, mean, stdev);
}
#endif

// `cpu.rs::bernoulli_in_place`: 1 when (u24(x_s) as f64) < p, then converted to T like the CPU's
// f64 -> T cast of 1.0 / 0.0.
template <typename T>
__device__ __forceinline__ void bernoulli_p(T* out, i64 n, u64 seed, u64 offset, double p) {
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 4)) {
        Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            i64 i = j * 4 + s;
            if (i < n) out[i] = cast<T>((double)u24(w.x[s]) < p ? 1.0 : 0.0);
        }
    }
}

template <typename T>
__device__ __forceinline__ void bernoulli(const T* __restrict__ prob, const Strided& st, T* __restrict__ out,
                                          i64 n, u64 seed, u64 offset, const ErrorCheck& check) {
    FirstBad first = no_bad();
    EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 4)) {
        Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            i64 i = j * 4 + s;
            if (i < n) {
                double p = (double)load(prob[strided_offset(st, 0, i)]);
                if (!(p >= 0.0 && p <= 1.0)) note_bad(first, (u64)i, __double_as_longlong(p));
                out[i] = cast<T>((double)u24(w.x[s]) < p ? 1.0 : 0.0);
            }
        }
    }
    report_bad(check, first);
}

#define EMBER_BERNOULLI(T, name)                                                                              \
    EMBER_IN_UNIT(bernoulli_p_##name,                                                                         \
    extern "C" __global__ void bernoulli_p_##name EMBER_PARAMS_bernoulli_p(T) {                             \
        u64 seed, offset;                                                                                     \
        philox_seed_offset(rng, seed, offset);                                                                \
        bernoulli_p<T>(out, n, seed, offset, p);                                                              \
    })                                                                                                        \
    EMBER_IN_UNIT(bernoulli_##name,                                                                           \
    extern "C" __global__ void bernoulli_##name EMBER_PARAMS_bernoulli(T) {                                   \
        u64 seed, offset;                                                                                     \
        philox_seed_offset(rng, seed, offset);                                                                \
        bernoulli<T>(prob, s, out, n, seed, offset, check);                                                   \
    })
EMBER_FOR_ALL_DTYPES(EMBER_BERNOULLI)

// `cpu.rs::randint`: low + (x mod range) with wrapping, one word per element when the range fits
// in 32 bits, else one 64-bit pair.
#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_randint_i64)
extern "C" __global__ void randint_i64 EMBER_PARAMS_randint {
    u64 seed, offset;
    philox_seed_offset(rng, seed, offset);
    if (range <= (1ull << 32)) {
        EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 4)) {
            Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                i64 i = j * 4 + s;
                if (i < n) out[i] = (i64)((u64)low + (u64)w.x[s] % range);
            }
        }
    } else {
        EMBER_KERNEL_LOOP(j, EMBER_BLOCKS(n, 2)) {
            Words w = philox_block(seed, offset + (u64)j);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                i64 i = j * 2 + s;
                if (i < n) out[i] = (i64)((u64)low + join_u64(w.x[2 * s], w.x[2 * s + 1]) % range);
            }
        }
    }
}
#endif
