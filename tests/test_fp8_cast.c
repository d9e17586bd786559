// Chapter 9: the fp32 -> FP8 cast (fp8_from_float) against its definition, on any machine: the
// FP8 value nearest |x| among every finite code (decoded by fp8_to_float), a tie going to the even
// code; past the largest finite value, saturation to it; NaN -> 0x7F; the sign bit kept, also on a
// zero. Brute force over the 2^7 magnitudes, so it shares no arithmetic with the cast. The sample:
// every fp32 exponent from 2^-37 to 2^32 (past both formats' range at each end), the top 8 mantissa
// bits in every pattern, and tails that make exact values, ties (bit 19 / 20 and above for the
// formats' normals and subnormals) and near-ties; both signs; inf and NaN. (tests/t_fp8_cast.sh
// also checks against cuda_fp8.h where CUDA's headers are installed; this runs everywhere.)
#include <math.h>
#include <string.h>

#include "chapters/09_fp8/fp8_cast.h"
#include "test_util.h"

static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

// The definition: the nearest finite magnitude code to |x|, ties to the even code, saturating.
static unsigned expected_code(float x, Fp8Format f) {
    const Fp8FormatInfo *fi = fp8_format_info(f);
    if (isnan(x)) return 0x7F;
    unsigned sign = signbit(x) ? 0x80 : 0;
    double a = fabs((double)x);
    if (a >= fi->max) return sign | fi->max_code;
    unsigned best = 0;
    double best_err = INFINITY;
    for (unsigned c = 0; c <= fi->max_code; c++) {
        double err = fabs(a - (double)fp8_to_float((uint8_t)c, f));
        if (err < best_err || (err == best_err && (c & 1) == 0)) best = c, best_err = err;
    }
    return sign | best;
}

static int check_one(uint32_t u, Fp8Format f, int *failures) {
    float x = float_of(u);
    unsigned want = expected_code(x, f), got = fp8_from_float(x, f);
    if (want != got && (*failures)++ < 5)
        printf("%s: fp8_from_float(%.9g = 0x%08x) = 0x%02x, nearest-even saturating code 0x%02x\n",
               fp8_format_info(f)->name, x, u, got, want);
    return want == got;
}

START_TEST(test_cast_definition) {
    static const uint32_t tails[] = {0, 1, 0x3FFF, 0x4000, 0x7FFF};  // the low 15 bits
    for (int fi = 0; fi < 2; fi++) {
        Fp8Format f = (Fp8Format)fi;
        int failures = 0;
        long checked = 0;
        for (uint32_t sign = 0; sign < 2; sign++) {
            for (uint32_t biased = 127 - 37; biased <= 127 + 32; biased++)
                for (uint32_t top = 0; top < 256; top++)
                    for (size_t t = 0; t < sizeof tails / sizeof tails[0]; t++) {
                        check_one(sign << 31 | biased << 23 | top << 15 | tails[t], f, &failures);
                        checked++;
                    }
            // zero, an fp32 subnormal, inf, a quiet and a signalling NaN
            static const uint32_t special[] = {0, 1, 0x7F800000u, 0x7FC00000u, 0x7F800001u};
            for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
                check_one(sign << 31 | special[i], f, &failures), checked++;
        }
        printf("%s: %ld fp32 values cast, %d mismatches\n", fp8_format_info(f)->name, checked, failures);
        fflush(stdout);  // the forked test's lines before a failing assert ends it
        ck_assert_msg(failures == 0, "%s: %d casts differ from round-to-nearest-even with saturation",
                      fp8_format_info(f)->name, failures);
    }
}
END_TEST

// fp8_round_to_grid against the cast and back, bit for bit, over the same sample.
START_TEST(test_round_to_grid) {
    static const uint32_t tails[] = {0, 1, 0x3FFF, 0x4000, 0x7FFF};
    for (int fi = 0; fi < 2; fi++) {
        Fp8Format f = (Fp8Format)fi;
        int failures = 0;
        long checked = 0;
        for (uint32_t sign = 0; sign < 2; sign++) {
            for (uint32_t biased = 0; biased <= 255; biased++)  // every exponent: fp32 subnormals, inf and NaN too
                for (uint32_t top = 0; top < 256; top++)
                    for (size_t t = 0; t < sizeof tails / sizeof tails[0]; t++) {
                        uint32_t u = sign << 31 | biased << 23 | top << 15 | tails[t];
                        float x = float_of(u), want = fp8_to_float(fp8_from_float(x, f), f), got = fp8_round_to_grid(x, f);
                        uint32_t want_bits, got_bits;
                        memcpy(&want_bits, &want, 4), memcpy(&got_bits, &got, 4);
                        if (want_bits != got_bits && failures++ < 5)
                            printf("%s: fp8_round_to_grid(%.9g = 0x%08x) = 0x%08x, the cast and back 0x%08x\n",
                                   fp8_format_info(f)->name, x, u, got_bits, want_bits);
                        checked++;
                    }
        }
        printf("%s: %ld fp32 values rounded to the grid, %d mismatches\n", fp8_format_info(f)->name, checked, failures);
        fflush(stdout);
        ck_assert_msg(failures == 0, "%s: fp8_round_to_grid differs from fp8_to_float(fp8_from_float(x))",
                      fp8_format_info(f)->name);
    }
}
END_TEST

int main(void) {
    Suite *s = suite_create("fp8_cast");
    TCase *tc = tcase_create("fp8_cast");
    tcase_add_test(tc, test_cast_definition);
    tcase_add_test(tc, test_round_to_grid);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
