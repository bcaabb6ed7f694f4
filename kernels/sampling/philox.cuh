// Philox4x32-10 (Salmon et al., SC'11), bit-identical to src/sampling/philox.rs: the random
// bits for (seed, position, token) are a pure function of the three, so any thread of any
// kernel can draw any token's noise without state.

#define SMP_PHILOX_M0 0xD2511F53u
#define SMP_PHILOX_M1 0xCD9E8D57u
#define SMP_PHILOX_W0 0x9E3779B9u
#define SMP_PHILOX_W1 0xBB67AE85u

__device__ __forceinline__ uint4 smp_philox4x32_10(uint4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r > 0) { k0 += SMP_PHILOX_W0; k1 += SMP_PHILOX_W1; }
        const unsigned int hi0 = __umulhi(SMP_PHILOX_M0, c.x), lo0 = SMP_PHILOX_M0 * c.x;
        const unsigned int hi1 = __umulhi(SMP_PHILOX_M1, c.z), lo1 = SMP_PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Gumbel noise -ln(-ln u), u = (bits + 1/2) 2^-32, in double precision as on the host (fast
// math only touches single precision), so both sides perturb a logit by the same amount.
__device__ __forceinline__ double smp_gumbel(unsigned int seed_lo, unsigned int seed_hi, unsigned long long pos,
                                             unsigned int token) {
    const uint4 r = smp_philox4x32_10(make_uint4(token, (unsigned int)pos, (unsigned int)(pos >> 32), 0u), seed_lo, seed_hi);
    const double u = ((double)r.x + 0.5) * (1.0 / 4294967296.0);
    return -log(-log(u));
}
