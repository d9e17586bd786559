// gpu_test_util.h: what the GPU test programs share. Plain programs rather than Check suites (Check
// forks a process per test, and a CUDA context does not survive fork): each comparison prints one
// PASS/FAIL line, main returns 1 if any failed.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#include "common/log.h"
#include "gpu/runtime.h"

static int n_checks, n_failed;

static inline void report(const char *name, bool ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline void report(const char *name, bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s %-44s ", ok ? "PASS" : "FAIL", name);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    n_checks++;
    n_failed += !ok;
}

// ||got - want||_2 / ||want||_2; NaN if got holds a NaN.
static inline double rel_l2(const float *got, const float *want, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - want[i];
        num += d * d, den += (double)want[i] * want[i];
    }
    return sqrt(num) / (den > 0 ? sqrt(den) : 1);
}

// Starts the device, or prints the SKIP line and returns false when there is none.
static inline bool gpu_test_start(const char *program) {
    log_set_program(program);
    char why[256];
    if (gpu_device_count(why, sizeof why) == 0) {
        printf("SKIP: no CUDA device (%s)\n", why);
        return false;
    }
    gpu_init(0);
    char device[256];
    gpu_device_description(device, sizeof device);
    printf("device 0: %s\n", device);
    return true;
}

// The memory report, the device released, the closing line; the exit status.
static inline int gpu_test_finish(const char *program) {
    gpu_memory_report();
    gpu_shutdown();
    printf("%s: %d checks, %d failed\n", program, n_checks, n_failed);
    return n_failed ? 1 : 0;
}
