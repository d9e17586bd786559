#include "chapters/09_fp8/fp8_cast.h"

#include <math.h>
#include <string.h>

static const Fp8FormatInfo FORMATS[2] = {
    [FP8_E4M3] = {"e4m3", 4, 3, 7, 448.0, 0x7E},
    [FP8_E5M2] = {"e5m2", 5, 2, 15, 57344.0, 0x7B},
};

#define FP8_NAN 0x7Fu
#define FP32_CANONICAL_NAN 0x7FFFFFFFu  // what cuda_fp8.h gives for a NaN, through fp16 and back

const Fp8FormatInfo *fp8_format_info(Fp8Format f) { return &FORMATS[f]; }

static uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

// |x| as a count of the format's quanta at x's binade, rounded to nearest even, then as a code.
// A normal fp32 |x| = s * 2^(e - 23) with s = 1.mantissa in [2^23, 2^24). The FP8 value nearest it
// is n * 2^q with q = max(e, emin) - man_bits (below emin the quantum stops shrinking: subnormals),
// so n = s / 2^shift rounded, shift = q - (e - 23). Its code is ((max(e, emin) - emin) << man_bits) + n:
// for a normal n in [2^m, 2^(m+1)) this puts the biased exponent e - emin + 1 over n's mantissa
// bits, and a rounding carry (n = 2^(m+1)) or a subnormal rounding up to 2^m lands on the next
// binade's code by itself.
static unsigned round_magnitude(uint32_t abs_bits, const Fp8FormatInfo *fi) {
    // LAB fp8: |x| (its fp32 bits) as an FP8 magnitude code: round s = 1.mantissa to the format's quantum at x's binade (never below 2^(1-bias): subnormals), to nearest, ties to even; the code is (binade - emin) << man_bits plus the rounded count
    int e = (int)(abs_bits >> 23) - 127;
    if (e == -127) return 0;  // fp32 zero or subnormal (< 2^-126): far below half the smallest FP8 step
    int emin = 1 - fi->bias, eq = e > emin ? e : emin;
    int shift = eq - fi->man_bits - (e - 23);
    uint32_t s = (abs_bits & 0x7FFFFFu) | 0x800000u;
    if (shift >= 25) return 0;  // s / 2^shift < 1/2 (s < 2^24): rounds to zero, never a tie
    uint32_t n = s >> shift, rest = s & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (n & 1))) n++;
    return ((unsigned)(eq - emin) << fi->man_bits) + n;
    // END LAB
}

uint8_t fp8_from_float(float x, Fp8Format f) {
    // LAB fp8: the saturating cast: NaN -> FP8_NAN (0x7F); otherwise the sign bit over the rounded magnitude (round_magnitude), +-inf and anything past fi->max_code saturating to max_code
    const Fp8FormatInfo *fi = &FORMATS[f];
    uint32_t u = float_bits(x), abs_bits = u & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((u >> 31) << 7);
    if (abs_bits > 0x7F800000u) return FP8_NAN;
    // +-inf, and finite values past max (codes that would be E4M3's NaN, E5M2's inf or NaN, or
    // beyond): saturate.
    unsigned code = abs_bits == 0x7F800000u ? 0xFFu : round_magnitude(abs_bits, fi);
    return sign | (uint8_t)(code > fi->max_code ? fi->max_code : code);
    // END LAB
}

float fp8_to_float(uint8_t code, Fp8Format f) {
    const Fp8FormatInfo *fi = &FORMATS[f];
    int m = fi->man_bits, exp_field = (code & 0x7F) >> m, man = code & ((1 << m) - 1);
    int exp_all_ones = (1 << fi->exp_bits) - 1;
    float sign = (code & 0x80) ? -1.0f : 1.0f;
    int is_nan = f == FP8_E4M3 ? (code & 0x7F) == 0x7F : (exp_field == exp_all_ones && man != 0);
    if (is_nan) {
        uint32_t u = FP32_CANONICAL_NAN;
        float nan;
        memcpy(&nan, &u, sizeof nan);
        return nan;
    }
    if (f == FP8_E5M2 && exp_field == exp_all_ones) return sign * INFINITY;
    if (exp_field == 0) return sign * ldexpf((float)man, 1 - fi->bias - m);  // subnormal (or zero)
    return sign * ldexpf((float)((1 << m) + man), exp_field - fi->bias - m);
}
