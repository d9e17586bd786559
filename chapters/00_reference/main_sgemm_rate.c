// sgemm_rate: the machine's matmul rate through the reference's own matmul_forward (OpenBLAS
// sgemm where it is linked), the ceiling `make bench` measures the model's FLOP rate against.
//
//   ./build/sgemm_rate --n 2048 --reps 5
//   sgemm: n=2048 reps=5 median_ms=... gflops=...
//
// Threads: OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, as for build/train.
#include <stdio.h>
#include <stdlib.h>

#include "common/args.h"
#include "common/log.h"
#include "common/mem.h"
#include "reference_cpu/ops.h"

static struct {
    int n, reps;
} opt;

static const ArgSpec FLAGS[] = {
    {"n", ARG_INT, &opt.n, "2048", "matrix size: (n,n) . (n,n)^T", .min = 64, .max = 16384},
    {"reps", ARG_INT, &opt.reps, "5", "timed repetitions after one warm-up; the median is printed", .min = 1,
     .max = 100},
};

static int compare_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    args_parse(FLAGS, (int)(sizeof FLAGS / sizeof FLAGS[0]), argc, argv, "sgemm_rate",
               "times matmul_forward on (n,n) matrices and prints its GFLOP/s");
    size_t nn = (size_t)opt.n * opt.n;
    real *a = mem_alloc(MEM_OTHER, sizeof(real) * nn), *b = mem_alloc(MEM_OTHER, sizeof(real) * nn),
         *c = mem_alloc(MEM_OTHER, sizeof(real) * nn);
    for (size_t i = 0; i < nn; i++) a[i] = (real)((i % 7) - 3) * 0.01f, b[i] = (real)((i % 5) - 2) * 0.01f;
    long long *ns = malloc(sizeof(long long) * opt.reps);
    matmul_forward(c, a, b, opt.n, opt.n, opt.n);  // warm-up: thread pool start, page faults
    for (int r = 0; r < opt.reps; r++) {
        long long t0 = now_ns();
        matmul_forward(c, a, b, opt.n, opt.n, opt.n);
        ns[r] = now_ns() - t0;
    }
    qsort(ns, opt.reps, sizeof ns[0], compare_ll);
    double median_s = ns[opt.reps / 2] * 1e-9;
    char kernels[192];
    printf("sgemm: n=%d reps=%d backend=%s median_ms=%.2f gflops=%.1f\n", opt.n, opt.reps,
           matmul_get_backend() == MATMUL_BLAS ? "blas" : "loop", median_s * 1e3,
           2.0 * opt.n * opt.n * opt.n / median_s * 1e-9);
    printf("kernels: %s\n", matmul_blas_kernels(kernels, sizeof kernels));
    free(ns);
    mem_free(a);
    mem_free(b);
    mem_free(c);
    return 0;
}
