//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
//! counter-based generator, so the draw for (seed, position, token) is a pure function of
//! those three and needs no state carried from step to step. The CUDA twin is
//! `kernels/sampling/philox.cuh`; both must produce the same bits.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Ten rounds of Philox4x32 on `ctr` under `key`.
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key[0] = key[0].wrapping_add(W0);
            key[1] = key[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, ctr[0]);
        let (hi1, lo1) = mulhilo(M1, ctr[2]);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

/// The 32 random bits drawn for `token` at sequence position `pos` under `seed`.
pub fn draw_bits(seed: u64, pos: u64, token: u32) -> u32 {
    philox4x32_10(
        [token, pos as u32, (pos >> 32) as u32, 0],
        [seed as u32, (seed >> 32) as u32],
    )[0]
}

/// Standard Gumbel noise −ln(−ln u) for `token` at `pos`, with u = (bits + ½)·2⁻³² in (0, 1):
/// never 0 or 1, so the noise is always finite. Computed in f64, as on the GPU.
pub fn gumbel(seed: u64, pos: u64, token: u32) -> f64 {
    let u = (draw_bits(seed, pos, token) as f64 + 0.5) * (1.0 / 4_294_967_296.0);
    -(-u.ln()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer vectors of Random123 (kat_vectors, "philox4x32 10": counter, key, output).
    #[test]
    fn random123_known_answers() {
        let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0; 4],
                [0; 2],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
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
        for (ctr, key, want) in cases {
            assert_eq!(
                philox4x32_10(ctr, key),
                want,
                "ctr {ctr:08x?} key {key:08x?}"
            );
        }
    }

    #[test]
    fn gumbel_noise_is_finite_and_has_the_right_mean() {
        // E[Gumbel] = Euler–Mascheroni γ ≈ 0.5772; the std of the mean of 100k draws is ~0.004.
        let n = 100_000u32;
        let mut sum = 0.0;
        for i in 0..n {
            let g = gumbel(7, 3, i);
            assert!(g.is_finite());
            sum += g;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5772).abs() < 0.02, "mean {mean}");
    }
}
