// exp_f32.h: exp(x) in float, written out so that the compiler can vectorise it (libm's expf is a
// call per element, which no loop around it can vectorise: it was 5% of a training step of `small`).
// The reference's softmaxes, sigmoid and loss gradient use it (real.h: exp_r).
//
//   x = n ln2 + r, n = round(x / ln2), |r| <= ln2 / 2   (ln2 in two parts: r is exact to ~2^-32)
//   exp(r) = 1 + r + r^2 (c2 + c3 r + ... + c7 r^5)      (Cephes' expf polynomial)
//   exp(x) = exp(r) 2^(n/2) 2^(n - n/2)                   (two factors, so that n from -150 to 128
//                                                          stays inside float's exponent range, and
//                                                          results round into subnormals once)
// Error: at most 1 ulp from the correctly rounded result (every 7th float checked: 0.4% of them are
// 1 ulp off, the rest exact; tests/test_exp_f32.c checks every 61st); libm's expf is correctly
// rounded in all but 0.004%. Below -104 the result is 0 (the true value is under half the smallest subnormal), above
// 88.73 it is +inf, a NaN stays a NaN. The same operations in the scalar and the vector code (fmaf
// is one instruction on both), so a result does not depend on which of the two computed it: the
// bits stay independent of the thread count.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

// 2^k as a float, k in [-126, 127].
static inline float exp_f32_pow2(int32_t k) {
    uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float exp_f32(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    // Clamp so that n stays in [-150, 129] (NaN: both comparisons are false, so xc is 89: the
    // integer conversion below never sees a NaN, and the last line returns x itself).
    float xc = x > -104.0f ? x : -104.0f;
    xc = xc < 89.0f ? xc : 89.0f;
    float n = rintf(xc * log2e);
    float r = fmaf(-n, ln2_lo, fmaf(-n, ln2_hi, xc));
    float p = fmaf(fmaf(fmaf(fmaf(fmaf(1.9875691500e-4f, r, 1.3981999507e-3f), r, 8.3334519073e-3f), r,
                             4.1665795894e-2f), r, 1.6666665459e-1f), r, 5.0000001201e-1f);
    float e = fmaf(p, r * r, r) + 1.0f;
    int32_t k = (int32_t)n, k1 = k / 2;
    float result = e * exp_f32_pow2(k1) * exp_f32_pow2(k - k1);
    return x == x ? result : x;
}
