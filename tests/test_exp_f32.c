// exp_f32 (reference_cpu/exp_f32.h, the reference's exp_r in fp32) against exp in double rounded
// to float (the correctly rounded result but for double rounding, which cannot move it by an ulp):
//  - at most 1 ulp off, on every 61st float of all 2^32 (about 70 million; a full sweep, every 7th
//    float, measured 1 ulp at most and 0.4% of results 1 ulp off), and on every float near the
//    edges: the smallest normal and subnormal results (x near -87.34 and -103.28), overflow (near
//    88.72) and 0;
//  - the specials: -inf -> 0, +inf -> +inf, NaN -> NaN, far below -104 -> 0, above 88.73 -> +inf;
//  - the same bits from the scalar code and from a loop the compiler vectorises (the reference's
//    results must not depend on which elements a thread's slice leaves to the scalar remainder).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "reference_cpu/exp_f32.h"
#include "test_util.h"

static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
// Floats in order as integers (so that a difference counts ulps across zero).
static int64_t ordinal(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i < 0 ? (int64_t)INT32_MIN - i : i;
}

typedef struct {
    int64_t worst;
    float worst_x;
    long checked, off;
} UlpStats;

static void check_x(float x, UlpStats *st) {
    if (isnan(x)) return;
    float want = (float)exp((double)x), got = exp_f32(x);
    int64_t d = llabs(ordinal(got) - ordinal(want));
    if (d > st->worst) st->worst = d, st->worst_x = x;
    st->off += d != 0;
    st->checked++;
}

START_TEST(test_within_one_ulp) {
    UlpStats st = {0};
    for (uint64_t u = 0; u < (1ull << 32); u += 61) check_x(float_of((uint32_t)u), &st);
    const float edges[] = {-87.33654f, -103.278929f, -103.972077f, 88.7228394f, 1e-8f, 0.0f};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) {  // 20000 floats each side of each edge
        float lo = edges[i], hi = edges[i];
        for (int k = 0; k < 20000; k++) {
            lo = nextafterf(lo, -INFINITY), hi = nextafterf(hi, INFINITY);
            check_x(lo, &st), check_x(hi, &st);
        }
    }
    printf("exp_f32: %ld floats, %ld (%.3f%%) off the correctly rounded exp, at most %lld ulp (x = %.9g: %.9g, "
           "correctly rounded %.9g)\n", st.checked, st.off, 100.0 * st.off / st.checked, (long long)st.worst,
           st.worst_x, exp_f32(st.worst_x), (float)exp((double)st.worst_x));
    fflush(stdout);
    ck_assert_msg(st.worst <= 1, "exp_f32 is %lld ulp off at x = %.9g", (long long)st.worst, st.worst_x);
}
END_TEST

START_TEST(test_specials) {
    ck_assert_msg(exp_f32(-INFINITY) == 0 && !signbit(exp_f32(-INFINITY)), "exp(-inf) = %g", exp_f32(-INFINITY));
    ck_assert_msg(exp_f32(-1000.0f) == 0, "exp(-1000) = %g", exp_f32(-1000.0f));
    ck_assert_msg(isinf(exp_f32(INFINITY)) && exp_f32(INFINITY) > 0, "exp(inf) = %g", exp_f32(INFINITY));
    ck_assert_msg(isinf(exp_f32(88.73f)) && isinf(exp_f32(1000.0f)), "exp(88.73) = %g", exp_f32(88.73f));
    ck_assert_msg(isnan(exp_f32(NAN)) && isnan(exp_f32(-NAN)), "exp(NaN) = %g", exp_f32(NAN));
    ck_assert_msg(exp_f32(0.0f) == 1.0f && exp_f32(-0.0f) == 1.0f, "exp(0) = %.9g", exp_f32(0.0f));
}
END_TEST

// The vectorised loop and the scalar function give the same bits (the loop's tail runs scalar code).
START_TEST(test_vector_equals_scalar) {
    enum { N = 1 << 16 };
    static float x[N], y[N];
    for (int i = 0; i < N; i++) x[i] = -110.0f + 200.0f * (float)i / N + 1e-3f * (float)(i % 7);
#pragma omp simd
    for (int i = 0; i < N; i++) y[i] = exp_f32(x[i]);
    int differ = 0;
    for (int i = 0; i < N; i++) {
        volatile float xi = x[i];  // a scalar call the compiler cannot fold into the loop above
        float s = exp_f32(xi);
        if (memcmp(&s, &y[i], sizeof s) != 0 && differ++ < 5)
            printf("exp_f32(%.9g): vector %.9g, scalar %.9g\n", x[i], y[i], s);
    }
    ck_assert_msg(differ == 0, "%d of %d results differ between the vector and the scalar code", differ, N);
}
END_TEST

int main(void) {
    Suite *s = suite_create("exp_f32");
    TCase *tc = tcase_create("exp_f32");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_within_one_ulp);
    tcase_add_test(tc, test_specials);
    tcase_add_test(tc, test_vector_equals_scalar);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
