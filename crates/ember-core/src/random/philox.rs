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
/// `θ = 2π u2`, for `u1` in (0, 1] and `u2` in [0, 1), computed in f64.
#[inline(always)]
pub fn box_muller(u1: f64, u2: f64) -> (f64, f64) {
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
    (r * c, r * s)
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
