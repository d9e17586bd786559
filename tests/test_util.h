// test_util.h: comparisons for the Check suites that print, on failure, the tensor name, the max
// abs and max rel error and the worst index.
#pragma once
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "reference_cpu/real.h"

// Element-wise |a - b| <= atol + rtol * |b|. Reports the element that exceeds its bound the most.
static inline void expect_close(const char *name, const real *a, const real *b, size_t n, double rtol, double atol) {
    double max_abs = 0, max_rel = 0, worst_excess = 0;
    size_t worst = 0;
    int failed = 0;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)a[i] - (double)b[i]), bound = atol + rtol * fabs((double)b[i]);
        double rel = diff / (fabs((double)b[i]) > 0 ? fabs((double)b[i]) : 1);
        if (diff > max_abs) max_abs = diff;
        if (rel > max_rel) max_rel = rel;
        if (!(diff <= bound) && (!failed || diff - bound > worst_excess)) worst_excess = diff - bound, worst = i, failed = 1;
    }
    ck_assert_msg(!failed, "%s: max abs err %.3e, max rel err %.3e, worst index %zu: got %.10g expected %.10g (rtol %.1e atol %.1e)",
                  name, max_abs, max_rel, worst, (double)a[worst], (double)b[worst], rtol, atol);
}

// Bit for bit: the bytes compared, so +0 and -0 differ and a NaN equals only the same NaN.
static inline void expect_equal_bits(const char *name, const real *a, const real *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(memcmp(&a[i], &b[i], sizeof(real)) == 0, "%s: first difference at index %zu: %.10g vs %.10g",
                      name, i, (double)a[i], (double)b[i]);
}

// Fills x with N(0, std) values from a counter-based stream (reproducible per test).
static inline void fill_normal(real *x, size_t n, double std, uint64_t stream) {
    for (size_t i = 0; i < n; i++) x[i] = (real)(std * rng_normal(42, stream, i));
}

static inline real *new_normal(size_t n, double std, uint64_t stream) {
    real *x = malloc(sizeof(real) * (n ? n : 1));
    fill_normal(x, n, std, stream);
    return x;
}

static inline real *new_zeros(size_t n) { return calloc(n ? n : 1, sizeof(real)); }

// Runs every test of the suite (forked, as Check does by default) and returns main's exit status.
static inline int run_suite(Suite *suite) {
    SRunner *runner = srunner_create(suite);
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed ? 1 : 0;
}
