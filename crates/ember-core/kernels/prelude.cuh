// ember kernel prelude: prepended by `cuda/nvrtc.rs` to every kernel source before NVRTC
// compiles it (and by the CI compile check), so each `.cu` file can use these names.
//
// Kernel sources are self-contained: NVRTC ships without the CUDA toolkit headers, so there is
// no `#include <cuda_fp16.h>`. f16 and bf16 travel as 16-bit structs and are converted with
// the helpers below (inline PTX for f16, bit arithmetic with round-to-nearest-even for bf16,
// matching the `half` crate the CPU backend uses). Arithmetic on them is done in f32 and rounded
// once on store, as on the CPU.
//
// Conventions every kernel file follows:
// - kernel names are `<op>_<dtype>` (dtype as in Rust: f32 f64 f16 bf16 i64 i32 u8 bool), all
//   `extern "C"`; variants are template parameters instantiated with `EMBER_FOR_ALL_DTYPES`;
// - pointers arrive already offset to the first element of the view; strides are in elements;
// - sizes and indices are 64-bit (`i64`); loops are grid-stride (`EMBER_KERNEL_LOOP`);
// - operands of any layout arrive with a `Strided` descriptor (see below), outputs are row-major
//   unless the kernel says otherwise;
// - every `extern "C"` kernel belongs to a compile unit (Note [Kernel units] in `cuda/kernels.rs`)
//   and is emitted only when its unit is asked for: macro-generated kernels are wrapped in
//   `EMBER_IN_UNIT(unit, definition)`, hand-written ones in
//   `#if defined(EMBER_ALL_UNITS) || defined(EMBER_UNIT_<unit>)` (a `#if` may hold pragmas).

typedef long long i64;
typedef unsigned long long u64;
typedef int i32;
typedef unsigned int u32;
typedef unsigned char u8;

struct __align__(2) f16 { unsigned short bits; };
struct __align__(2) bf16 { unsigned short bits; };

__device__ __forceinline__ float f16_to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ f16 f32_to_f16(float f) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);  // quiet NaN, sign kept
    } else {
        r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
    }
    return r;
}

// half::bf16::from_f64 (half 2.x `bfloat/convert.rs::f64_to_bf16`), bit for bit: it keeps only
// the high 32 bits of the f64 and rounds to nearest even from those, so a tie in them rounds to
// even even when the dropped low bits are not zero.
__device__ __forceinline__ bf16 half_f64_to_bf16(double value) {
    u64 val = (u64)__double_as_longlong(value);
    u32 x = (u32)(val >> 32);
    u32 sign = x & 0x80000000u, exp = x & 0x7FF00000u, man = x & 0x000FFFFFu;
    bf16 r;
    if (exp == 0x7FF00000u) {
        u32 nan_bit = (man == 0 && (u32)val == 0) ? 0u : 0x0040u;
        r.bits = (unsigned short)((sign >> 16) | 0x7F80u | nan_bit | (man >> 13));
        return r;
    }
    u32 half_sign = sign >> 16;
    i64 half_exp = ((i64)(exp >> 20) - 1023) + 127;
    if (half_exp >= 0xFF) {
        r.bits = (unsigned short)(half_sign | 0x7F80u);
        return r;
    }
    if (half_exp <= 0) {
        if (7 - half_exp > 21) {
            r.bits = (unsigned short)half_sign;
            return r;
        }
        u32 m = man | 0x00100000u;
        u32 half_man = m >> (u32)(14 - half_exp);
        u32 round_bit = 1u << (u32)(13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) half_man += 1;
        r.bits = (unsigned short)(half_sign | half_man);
        return r;
    }
    u32 bits = half_sign | ((u32)half_exp << 7) | (man >> 13);
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) bits += 1;
    r.bits = (unsigned short)bits;
    return r;
}

// `Acc<T>::type`: the type arithmetic on T is done in (f32 for the 16-bit floats).
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<f16> { typedef float type; };
template <> struct Acc<bf16> { typedef float type; };

// load/store between storage type T and its arithmetic type.
template <typename T> __device__ __forceinline__ typename Acc<T>::type load(T x) { return x; }
template <> __device__ __forceinline__ float load<f16>(f16 x) { return f16_to_f32(x); }
template <> __device__ __forceinline__ float load<bf16>(bf16 x) { return bf16_to_f32(x); }

// cast<T>(x): converts any arithmetic value to storage type T with the CPU backend's rules
// (float -> int truncates toward zero, anything -> bool is x != 0).
template <typename T> struct CastTo {
    template <typename U> __device__ __forceinline__ static T from(U x) { return (T)x; }
};
template <> struct CastTo<f16> {
    template <typename U> __device__ __forceinline__ static f16 from(U x) { return f32_to_f16((float)x); }
    // f64 -> f16 rounds through f32, as the `half` crate does on x86-64 with F16C (the CPU
    // backend's machines), so both devices give the same bits.
    __device__ __forceinline__ static f16 from(double x) { return f32_to_f16((float)x); }
};
template <> struct CastTo<bf16> {
    template <typename U> __device__ __forceinline__ static bf16 from(U x) { return f32_to_bf16((float)x); }
    __device__ __forceinline__ static bf16 from(double x) { return half_f64_to_bf16(x); }  // as the CPU
};
template <> struct CastTo<bool> {
    template <typename U> __device__ __forceinline__ static bool from(U x) { return x != (U)0; }
};
template <typename T, typename U> __device__ __forceinline__ T cast(U x) { return CastTo<T>::from(x); }
template <typename T> __device__ __forceinline__ T cast(f16 x) { return CastTo<T>::from(f16_to_f32(x)); }
template <typename T> __device__ __forceinline__ T cast(bf16 x) { return CastTo<T>::from(bf16_to_f32(x)); }

// Up to 8 dims per operand after the host merged dims that are contiguous in every operand.
#define EMBER_MAX_DIMS 8

// The shape shared by up to 3 operands of a kernel and each operand's strides (in elements;
// 0 for broadcast dims). Built by `KernelShape` in `cuda/kernels.rs`; same layout, 264 bytes.
struct Strided {
    i32 ndim;
    i32 pad;
    i64 size[EMBER_MAX_DIMS];
    i64 stride[3][EMBER_MAX_DIMS];
};

// Element offset of operand `which` for row-major linear index `i` of the shape.
//
// An index below 2^31 (every tensor of fewer elements) is split into its digits with 32-bit
// division, several times cheaper than 64-bit division, which the GPU has no instruction for;
// the digits left once the index is used up are 0 and add nothing. A dim of 2^31 or more
// elements is larger than such an index: its digit is the whole rest.
__device__ __forceinline__ i64 strided_offset(const Strided& s, int which, i64 i) {
    if (s.ndim == 1) return i * s.stride[which][0];  // merged to one dim: no digits to split
    i64 off = 0;
    if ((u64)i < 0x80000000ull) {
        u32 x = (u32)i;
        for (int d = s.ndim - 1; d >= 0 && x != 0; --d) {
            i64 n = s.size[d];
            if ((u64)n > 0x7fffffffull) {
                off += (i64)x * s.stride[which][d];
                break;
            }
            u32 q = x / (u32)n;
            off += (i64)(x - q * (u32)n) * s.stride[which][d];
            x = q;
        }
        return off;
    }
    for (int d = s.ndim - 1; d >= 0; --d) {
        i64 n = s.size[d];
        i64 q = i / n;
        off += (i - q * n) * s.stride[which][d];
        i = q;
    }
    return off;
}

// The offsets of operands 0..K-1 for linear index `i`, sharing one split of the index into
// digits (as `strided_offset`, whose division it does once for all K operands).
template <int K> struct Offsets { i64 v[K]; };
template <int K> __device__ __forceinline__ Offsets<K> strided_offsets(const Strided& s, i64 i) {
    Offsets<K> o;
    if (s.ndim == 1) {  // merged to one dim: no digits to split
#pragma unroll
        for (int k = 0; k < K; ++k) o.v[k] = i * s.stride[k][0];
        return o;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) o.v[k] = 0;
    if ((u64)i < 0x80000000ull) {
        u32 x = (u32)i;
        for (int d = s.ndim - 1; d >= 0 && x != 0; --d) {
            i64 n = s.size[d];
            u32 r;
            if ((u64)n > 0x7fffffffull) {
                r = x;
                x = 0;
            } else {
                u32 q = x / (u32)n;
                r = x - q * (u32)n;
                x = q;
            }
#pragma unroll
            for (int k = 0; k < K; ++k) o.v[k] += (i64)r * s.stride[k][d];
        }
        return o;
    }
    for (int d = s.ndim - 1; d >= 0; --d) {
        i64 n = s.size[d];
        i64 q = i / n;
#pragma unroll
        for (int k = 0; k < K; ++k) o.v[k] += (i - q * n) * s.stride[k][d];
        i = q;
    }
    return o;
}

#define EMBER_KERNEL_LOOP(i, n)                                                              \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Compile units (Note [Kernel units] in `cuda/kernels.rs`). The runtime compiles a source with
// `-DEMBER_UNIT_<unit>` (e.g. `-DEMBER_UNIT_binary_f32`) to get that unit's kernels only; CI
// compiles with `-DEMBER_ALL_UNITS` to get every kernel of the file. `EMBER_IN_UNIT(u, ...)`
// expands to its definition when `EMBER_UNIT_u` is defined (to 1, as a bare -D does), else to
// nothing: `EMBER_UNIT_u` expands to `1` and `EMBER_PROBE_1` to `~, 1`, whose second item is 1,
// while an undefined `EMBER_UNIT_u` leaves `EMBER_PROBE_EMBER_UNIT_u`, one item, so the 0 after
// it is the second item.
#define EMBER_CAT(a, b) EMBER_CAT_(a, b)
#define EMBER_CAT_(a, b) a##b
#define EMBER_SECOND(a, b, ...) b
#define EMBER_IS_PROBE(...) EMBER_SECOND(__VA_ARGS__, 0, ~)
#define EMBER_PROBE_1 ~, 1
#define EMBER_UNIT_ON(u) EMBER_IS_PROBE(EMBER_CAT(EMBER_PROBE_, EMBER_UNIT_##u))
#define EMBER_WHEN_1(...) __VA_ARGS__
#define EMBER_WHEN_0(...)
#ifdef EMBER_ALL_UNITS
#define EMBER_IN_UNIT(u, ...) __VA_ARGS__
#else
#define EMBER_IN_UNIT(u, ...) EMBER_CAT(EMBER_WHEN_, EMBER_UNIT_ON(u))(__VA_ARGS__)
#endif

// M(type, name) for every dtype ember has.
#define EMBER_FOR_ALL_DTYPES(M) \
    M(float, f32) M(double, f64) M(f16, f16) M(bf16, bf16) M(i64, i64) M(i32, i32) M(u8, u8) M(bool, bool)
#define EMBER_FOR_FLOAT_DTYPES(M) M(float, f32) M(double, f64) M(f16, f16) M(bf16, bf16)

// Warp and block reductions for kernels that reduce (blockDim.x a multiple of 32, <= 1024).
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) {
        T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = (w > v || w != w) ? w : v;  // NaN propagates
    }
    return v;
}

// Deferred device errors (Note [Deferred device errors] in `cuda/device_errors.rs`). An op that
// finds bad input on the device (an index out of range, a probability outside [0, 1], a negative
// integer exponent) does not stop: it skips what it cannot do and records the error in the
// device's error record, which the host checks at its next synchronizing call. The kernel takes
// an `ErrorCheck` by value (its op's code, a launch number and the op's dim and size); each
// thread keeps its first bad element (`FirstBad`, smallest row-major position), and after its
// loops every thread calls `report_bad`, which is warp-collective: the warp's smallest position
// is recorded by one lane, so the record ends up holding the first bad element of the first
// launch that failed, as the CPU reports it. Layouts match `Record` and `ErrorCheck` in
// `device_errors.rs` (64 and 48 bytes).
struct DeviceErrorRecord {
    u32 lock;      // spin lock of the lanes that report (one per warp)
    u32 code;      // 0: no error; else the op's code in the host registry; written last
    u64 launch;    // launch number of the recorded error
    u64 position;  // row-major position of the first bad element in that launch
    i64 value;     // the bad value (f64 bits for probabilities)
    i64 dim;       // the op's dim and size (index errors)
    i64 size;
    u64 reserved[2];
};
struct ErrorCheck {
    DeviceErrorRecord* record;
    u32* doorbell;  // host-mapped: set to 1 after an error is recorded, read by the host for free
                    // (null where the driver cannot map host memory)
    u64 launch;
    u32 code;
    u32 pad;
    i64 dim;
    i64 size;
};
struct FirstBad {
    u64 position;
    i64 value;
};
__device__ __forceinline__ FirstBad no_bad() {
    FirstBad f;
    f.position = ~0ull;
    f.value = 0;
    return f;
}
__device__ __forceinline__ void note_bad(FirstBad& f, u64 position, i64 value) {
    if (position < f.position) {
        f.position = position;
        f.value = value;
    }
}
// Warp-collective (every lane of the warp calls it, converged, blockDim.x a multiple of 32).
__device__ __forceinline__ void report_bad(const ErrorCheck& c, FirstBad f) {
    for (int o = 16; o > 0; o >>= 1) {
        u64 p = __shfl_xor_sync(0xffffffffu, f.position, o);
        i64 v = __shfl_xor_sync(0xffffffffu, f.value, o);
        if (p < f.position) {
            f.position = p;
            f.value = v;
        }
    }
    if ((threadIdx.x & 31u) != 0u || f.position == ~0ull) return;
    volatile DeviceErrorRecord* r = c.record;
    // Without the lock first: an error of an earlier launch, or a smaller position of this one,
    // is already recorded (`code` is written last, so a nonzero code comes with its fields).
    if (r->code != 0u) {
        __threadfence();
        if (r->launch != c.launch || r->position <= f.position) return;
    }
    while (atomicCAS(&c.record->lock, 0u, 1u) != 0u) {
    }
    __threadfence();
    if (r->code == 0u || (r->launch == c.launch && f.position < r->position)) {
        r->launch = c.launch;
        r->position = f.position;
        r->value = f.value;
        r->dim = c.dim;
        r->size = c.size;
        __threadfence();
        r->code = c.code;
    }
    __threadfence();
    atomicExch(&c.record->lock, 0u);
    if (c.doorbell != nullptr) {
        *(volatile u32*)c.doorbell = 1u;
        __threadfence_system();
    }
}

// Philox (seed, offset) of a random kernel (Note [Philox under graph capture] in
// `random/mod.rs`): by value in eager execution (`seed_ptr` null), or read from device memory
// when the launch is recorded into a CUDA graph: the seed at `seed_ptr` and the offset
// `*offset_ptr + offset`, where the generator rewrites `*offset_ptr` before every replay. Same
// layout as `PhiloxArgs` in `cuda/random.rs` (32 bytes).
struct PhiloxArgs {
    u64 seed;
    u64 offset;
    const u64* seed_ptr;
    const u64* offset_ptr;
};
__device__ __forceinline__ void philox_seed_offset(const PhiloxArgs& a, u64& seed, u64& offset) {
    if (a.seed_ptr != nullptr) {
        seed = *a.seed_ptr;
        offset = *a.offset_ptr + a.offset;  // wrapping, as the host's offsets
    } else {
        seed = a.seed;
        offset = a.offset;
    }
}
