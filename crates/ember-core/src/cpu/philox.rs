//! The Philox4x32-10 block function (Salmon et al., "Parallel random numbers: as easy as 1, 2,
//! 3", SC'11; the same constants as Random123, cuRAND and PyTorch) and the conversions from its
//! 32-bit output words to floats that Note [Philox stream] in `random/mod.rs` specifies.
//!
//! Everything here is a pure function of its arguments, written with wrapping u32/u64 integer
//! arithmetic only, so a CUDA kernel computing the same expressions gets the same bits.

/// First Philox multiplier (applied to counter word 0).
pub const PHILOX_M0: u32 = 0xD251_1F53;
/// Second Philox multiplier (applied to counter word 2).
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Key schedule increment of key word 0 (golden ratio).
pub const PHILOX_W0: u32 = 0x9E37_79B9;
/// Key schedule increment of key word 1 (sqrt(3) - 1).
pub const PHILOX_W1: u32 = 0xBB67_AE85;
/// Rounds of the block function.
pub const PHILOX_ROUNDS: usize = 10;

/// 2^-24, the spacing of 24-bit uniforms.
const TWO_POW_M24: f32 = 1.0 / (1u32 << 24) as f32;
/// 2^-53, the spacing of 53-bit uniforms.
const TWO_POW_M53: f64 = 1.0 / (1u64 << 53) as f64;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

#[inline(always)]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
    let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox4x32-10 of a 128-bit counter (4 little-endian u32 words) under a 64-bit key.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for r in 0..PHILOX_ROUNDS {
        if r > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        c = round(c, k);
    }
    c
}

/// The key for `seed`: its low and high 32-bit halves.
#[inline]
pub fn seed_key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The counter block number `block` (a 64-bit value) in the low two words; the high two are 0.
#[inline]
pub fn block_counter(block: u64) -> [u32; 4] {
    [block as u32, (block >> 32) as u32, 0, 0]
}

/// The four words of counter block `block` under `seed`.
#[inline]
pub fn block(seed: u64, block: u64) -> [u32; 4] {
    philox4x32_10(block_counter(block), seed_key(seed))
}

/// A uniform in [0, 1) with `bits` random bits (1..=24): `(x >> (32 - bits)) * 2^-bits`, exact in
/// f32 (and in f16 for bits <= 11, in bf16 for bits <= 8).
#[inline(always)]
pub fn uniform_bits_f32(x: u32, bits: u32) -> f32 {
    (x >> (32 - bits)) as f32 * (1.0 / (1u32 << bits) as f32)
}

/// A 24-bit uniform in [0, 1): `(x >> 8) * 2^-24`.
#[inline(always)]
pub fn uniform_f32(x: u32) -> f32 {
    (x >> 8) as f32 * TWO_POW_M24
}

/// A 24-bit uniform in (0, 1]: `((x >> 8) + 1) * 2^-24` (the radius input of Box-Muller).
#[inline(always)]
pub fn uniform_open0_f32(x: u32) -> f32 {
    ((x >> 8) + 1) as f32 * TWO_POW_M24
}

/// The 64-bit value of two words, `lo` in the low half.
#[inline(always)]
pub fn join_u64(lo: u32, hi: u32) -> u64 {
    (hi as u64) << 32 | lo as u64
}

/// A 53-bit uniform in [0, 1) from two words: `(join_u64(lo, hi) >> 11) * 2^-53`.
#[inline(always)]
pub fn uniform_f64(lo: u32, hi: u32) -> f64 {
    (join_u64(lo, hi) >> 11) as f64 * TWO_POW_M53
}

/// A 53-bit uniform in (0, 1] from two words: `((join_u64(lo, hi) >> 11) + 1) * 2^-53`.
#[inline(always)]
pub fn uniform_open0_f64(lo: u32, hi: u32) -> f64 {
    ((join_u64(lo, hi) >> 11) + 1) as f64 * TWO_POW_M53
}

/// Box-Muller: two standard normals `(r cos θ, r sin θ)` with `r = sqrt(-2 ln u1)`,
/// `θ = 2π u2`, for `u1` in (0, 1] and `u2` in [0, 1), computed in f64 with [`ln_box_muller`]
/// and [`sin_cos_turns`] (Note [Deterministic transcendentals]), so that the CUDA kernel
/// computing the same operations gets the same bits.
#[inline(always)]
pub fn box_muller(u1: f64, u2: f64) -> (f64, f64) {
    let r = (-2.0 * ln_box_muller(u1)).sqrt();
    let (s, c) = sin_cos_turns(u2);
    (r * c, r * s)
}

// Note [Deterministic transcendentals]
// `ln`, `sin` and `cos` of the platform's libm (glibc, CUDA's libdevice) are not correctly
// rounded and differ between them in the last ulp, so Box-Muller computed with them gives f64
// normals that differ between the CPU and a GPU. The two functions below are fdlibm's
// algorithms (`e_log.c`, `k_sin.c`, `k_cos.c`, the polynomials of Sun's freely
// distributable fdlibm 5.3) written with IEEE-754 `+ - * /` and `sqrt` only, each correctly
// rounded and never contracted to an FMA (Rust never contracts; `kernels/random.cu` spells every
// operation as `__dadd_rn`/`__dmul_rn`/...), so both devices produce the same bits. Accuracy:
// under 1 ulp, as fdlibm's. Range reduction of `2π u2` is exact: `4 u2` is split into a
// quadrant and a fraction in [-1/2, 1/2] without rounding, and only the fraction is multiplied
// by π/2 (as a two-term constant).

/// `ln(x)` for a positive normal `x` (the Box-Muller radius input; fdlibm's `__ieee754_log`).
#[inline(always)]
pub fn ln_box_muller(x: f64) -> f64 {
    const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
    const LG1: f64 = f64::from_bits(0x3FE5_5555_5555_5593);
    const LG2: f64 = f64::from_bits(0x3FD9_9999_9997_FA04);
    const LG3: f64 = f64::from_bits(0x3FD2_4924_9422_9359);
    const LG4: f64 = f64::from_bits(0x3FCC_71C5_1D8E_78AF);
    const LG5: f64 = f64::from_bits(0x3FC7_4664_96CB_03DE);
    const LG6: f64 = f64::from_bits(0x3FC3_9A09_D078_C69F);
    const LG7: f64 = f64::from_bits(0x3FC2_F112_DF3E_5244);
    let bits = x.to_bits();
    let mut hx = (bits >> 32) as i32;
    let lx = bits as u32;
    let mut k = (hx >> 20) - 1023;
    hx &= 0x000F_FFFF;
    let i = (hx + 0x95F64) & 0x10_0000;
    // x normalized into [sqrt(2)/2, sqrt(2)).
    let xn = f64::from_bits(((hx | (i ^ 0x3FF0_0000)) as u64) << 32 | lx as u64);
    k += i >> 20;
    let f = xn - 1.0;
    let dk = k as f64;
    if (0x000F_FFFF & (2 + hx)) < 3 {
        // |f| < 2^-20
        if f == 0.0 {
            return if k == 0 { 0.0 } else { dk * LN2_HI + dk * LN2_LO };
        }
        let r = f * f * (0.5 - 0.333_333_333_333_333_3 * f);
        return if k == 0 {
            f - r
        } else {
            dk * LN2_HI - ((r - dk * LN2_LO) - f)
        };
    }
    let s = f / (2.0 + f);
    let z = s * s;
    let mut i = hx - 0x6147A;
    let w = z * z;
    let j = 0x6B851 - hx;
    let t1 = w * (LG2 + w * (LG4 + w * LG6));
    let t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)));
    i |= j;
    let r = t2 + t1;
    if i > 0 {
        let hfsq = 0.5 * f * f;
        if k == 0 {
            f - (hfsq - s * (hfsq + r))
        } else {
            dk * LN2_HI - ((hfsq - (s * (hfsq + r) + dk * LN2_LO)) - f)
        }
    } else if k == 0 {
        f - s * (f - r)
    } else {
        dk * LN2_HI - ((s * (f - r) - dk * LN2_LO) - f)
    }
}

/// `(sin 2πt, cos 2πt)` for `t` in [0, 1) holding at most 53 significant bits below 2^0 (a
/// Box-Muller angle input), with exact range reduction (Note [Deterministic transcendentals]).
#[inline(always)]
pub fn sin_cos_turns(t: f64) -> (f64, f64) {
    const PIO2_HI: f64 = f64::from_bits(0x3FF9_21FB_5444_2D18);
    const PIO2_LO: f64 = f64::from_bits(0x3C91_A626_3314_5C07);
    let q4 = 4.0 * t; // exact
    let q = (q4 + 0.5).floor(); // the nearest quadrant, 0..=4
    let f = q4 - q; // exact, in [-1/2, 1/2]
    let x = f * PIO2_HI + f * PIO2_LO; // in [-π/4, π/4]
    let (s, c) = (kernel_sin(x), kernel_cos(x));
    match q as u32 & 3 {
        0 => (s, c),
        1 => (c, -s),
        2 => (-s, -c),
        _ => (-c, s),
    }
}

/// fdlibm's `__kernel_sin(x, 0, 0)` for |x| <= π/4.
#[inline(always)]
fn kernel_sin(x: f64) -> f64 {
    const S1: f64 = f64::from_bits(0xBFC5_5555_5555_5549);
    const S2: f64 = f64::from_bits(0x3F81_1111_1110_F8A6);
    const S3: f64 = f64::from_bits(0xBF2A_01A0_19C1_61D5);
    const S4: f64 = f64::from_bits(0x3EC7_1DE3_57B1_FE7D);
    const S5: f64 = f64::from_bits(0xBE5A_E5E6_8A2B_9CEB);
    const S6: f64 = f64::from_bits(0x3DE5_D93A_5ACF_D57C);
    let z = x * x;
    let v = z * x;
    let r = S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)));
    x + v * (S1 + z * r)
}

/// fdlibm's `__kernel_cos(x, 0)` for |x| <= π/4.
#[inline(always)]
fn kernel_cos(x: f64) -> f64 {
    const C1: f64 = f64::from_bits(0x3FA5_5555_5555_554C);
    const C2: f64 = f64::from_bits(0xBF56_C16C_16C1_5177);
    const C3: f64 = f64::from_bits(0x3EFA_01A0_19CB_1590);
    const C4: f64 = f64::from_bits(0xBE92_7E4F_809C_52AD);
    const C5: f64 = f64::from_bits(0x3E21_EE9E_BDB4_B1C4);
    const C6: f64 = f64::from_bits(0xBDA8_FAE9_BE88_38D4);
    let ix = ((x.to_bits() >> 32) as u32) & 0x7FFF_FFFF;
    if ix < 0x3E40_0000 {
        return 1.0; // |x| < 2^-27
    }
    let z = x * x;
    let r = z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))));
    if ix < 0x3FD3_3333 {
        // |x| < 0.3
        return 1.0 - (0.5 * z - z * r);
    }
    let qx = if ix > 0x3FE9_0000 {
        0.28125
    } else {
        f64::from_bits(((ix - 0x0020_0000) as u64) << 32) // x/4
    };
    let hz = 0.5 * z - qx;
    let a = 1.0 - qx;
    a - (hz - z * r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123's `kat_vectors` for philox4x32 with 10 rounds:
    /// counter (4 words), key (2 words), expected output (4 words).
    #[test]
    fn matches_random123_known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            ([0; 4], [0; 2], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (ctr, key, want) in kat {
            assert_eq!(philox4x32_10(ctr, key), want, "counter {ctr:x?} key {key:x?}");
        }
    }

    /// The error of `got` against `want` in units of the last place of `want`.
    fn ulps(got: f64, want: f64) -> f64 {
        let ulp = f64::from_bits(want.abs().to_bits() + 1) - want.abs();
        (got - want).abs() / ulp.max(f64::MIN_POSITIVE)
    }

    #[test]
    fn deterministic_ln_is_within_one_ulp_of_libm() {
        let mut worst = 0.0f64;
        for i in 0..200_000u64 {
            let w = block(7, i);
            for u in [uniform_open0_f64(w[0], w[1]), uniform_open0_f32(w[2]) as f64] {
                worst = worst.max(ulps(ln_box_muller(u), u.ln()));
            }
        }
        for u in [
            1.0,
            0.5,
            f64::EPSILON,
            2f64.powi(-53),
            1.0 - f64::EPSILON / 2.0,
            0.75,
        ] {
            assert!(ulps(ln_box_muller(u), u.ln()) <= 1.0, "ln({u})");
        }
        assert_eq!(ln_box_muller(1.0), 0.0);
        assert!(worst <= 1.0, "worst {worst} ulps");
    }

    #[test]
    fn deterministic_sin_cos_are_within_two_ulps_of_libm() {
        let two_pi = 2.0 * std::f64::consts::PI;
        for i in 0..200_000u64 {
            let w = block(9, i);
            for t in [uniform_f64(w[0], w[1]), uniform_f32(w[2]) as f64] {
                let (s, c) = sin_cos_turns(t);
                let (ws, wc) = (two_pi * t).sin_cos();
                // libm's input 2π·t is itself rounded: compare in absolute terms near zeros.
                assert!(
                    (s - ws).abs() <= 1e-15 && (c - wc).abs() <= 1e-15,
                    "t {t}: {s} {ws}, {c} {wc}"
                );
            }
        }
        assert_eq!(sin_cos_turns(0.0), (0.0, 1.0));
        assert_eq!(sin_cos_turns(0.25), (1.0, 0.0));
        assert_eq!(sin_cos_turns(0.5), (-0.0, -1.0));
    }

    #[test]
    fn uniforms_stay_in_their_intervals() {
        assert_eq!(uniform_f32(0), 0.0);
        assert!(uniform_f32(u32::MAX) < 1.0);
        assert_eq!(uniform_open0_f32(u32::MAX), 1.0);
        assert!(uniform_open0_f32(0) > 0.0);
        assert!(uniform_f64(u32::MAX, u32::MAX) < 1.0);
        assert_eq!(uniform_open0_f64(u32::MAX, u32::MAX), 1.0);
        assert!(half::f16::from_f32(uniform_bits_f32(u32::MAX, 11)).to_f32() < 1.0);
        assert!(half::bf16::from_f32(uniform_bits_f32(u32::MAX, 8)).to_f32() < 1.0);
    }
}
