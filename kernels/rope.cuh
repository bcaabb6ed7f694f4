// RoPE's rotation at `pos` for one frequency, shared by the decode paths and prefill.
// The angle is formed and reduced in double: a float product pos * inv_freq is off by up to
// pos * 2^-24 radians (0.008 at position 131,072), and the fast-math sincosf the kernels are
// compiled with loses accuracy on large arguments. The reference forward does the same in f64.
// Called once per (head, frequency) per token, so the double work costs nothing measurable.
__device__ __forceinline__ void rope_sincos(unsigned pos, float inv_freq, float* s, float* c) {
    double ds, dc;
    sincos((double)pos * (double)inv_freq, &ds, &dc);
    *s = (float)ds;
    *c = (float)dc;
}
