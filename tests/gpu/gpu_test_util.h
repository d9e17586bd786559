// gpu_test_util.h: what the GPU test programs share. Plain programs rather than Check suites (Check
// forks a process per test, and a CUDA context does not survive fork): each comparison prints one
// PASS/FAIL line, main returns 1 if any failed.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
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

// With GPU_TEST_REQUIRE_DEVICE set (make test-gpu sets it), a missing device is not a SKIP: the
// program goes on to gpu_init, which stops with its one clear line ("no CUDA device: why").
static inline bool gpu_test_may_skip(void) {
    const char *env = getenv("GPU_TEST_REQUIRE_DEVICE");
    return !env || !*env || strcmp(env, "0") == 0;
}

// Starts the device, or prints the SKIP line and returns false when there is none.
static inline bool gpu_test_start(const char *program) {
    log_set_program(program);
    char why[256];
    if (gpu_device_count(why, sizeof why) == 0 && gpu_test_may_skip()) {
        printf("SKIP: no CUDA device (%s)\n", why);
        return false;
    }
    gpu_init(0);
    char device[256];
    gpu_device_description(device, sizeof device);
    printf("device 0: %s\n", device);
    return true;
}

// The same for a test under mpirun: starts the communicator, then the device of rank r (r % the
// devices, or r itself with own_device: fewer devices than ranks is then a SKIP). On a SKIP every
// rank has finalized the communicator and returns false.
static inline bool gpu_test_start_ranks(const char *program, int *argc, char ***argv, bool own_device) {
    comm_init(argc, argv, NULL);
    int rank = comm_rank(comm_world()), size = comm_size(comm_world());
    log_set_program(program);
    log_set_rank(rank);
    char why[256];
    int n_devices = gpu_device_count(why, sizeof why);
    if ((n_devices == 0 && gpu_test_may_skip()) || (n_devices > 0 && own_device && n_devices < size)) {
        if (rank == 0 && n_devices == 0) printf("SKIP: no CUDA device (%s)\n", why);
        else if (rank == 0) printf("SKIP: %s needs a GPU per rank: %d ranks, %d devices\n", program, size, n_devices);
        comm_finalize();
        return false;
    }
    gpu_init(n_devices ? rank % n_devices : 0);
    if (rank == 0) {
        char device[256];
        gpu_device_description(device, sizeof device);
        printf("%d ranks on %d device(s): %s\n", size, n_devices, device);
    }
    return true;
}

// The memory report, the device released, the closing line; the exit status.
static inline int gpu_test_finish(const char *program) {
    gpu_memory_report();
    gpu_shutdown();
    printf("%s: %d checks, %d failed\n", program, n_checks, n_failed);
    return n_failed ? 1 : 0;
}
