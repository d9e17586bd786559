// test_fp8_groups.c: FP8 linears split over ranks scale exactly as one process does, because every
// amax is MAX-reduced over the group that splits what it covers (chapters/09_fp8/fp8.h). Run alone
// (a world of one, as tests/run_tests.sh does) or under mpirun (tests/t_fp8.sh: 2 and 4 ranks).
//
// Every rank computes the single-process result of one linear (forward, input and weight gradient)
// on the full tensors, then its share of the same linear split three ways, for each recipe and two
// steps (delayed scaling's second step uses the history the first step's reduced amaxes made):
//   data parallel       the tokens M split (groups.dp = world): rows of Y and dX are this rank's
//                        rows of the single result, bit for bit; dW is a partial sum (summed here)
//   column parallel     W's rows N split (groups.tp = world, wq): Y's columns and dW's rows exact;
//                        dX a partial sum
//   row parallel        K split (groups.tp = world, wo): dX's and dW's columns exact; Y a partial sum
// Exact means: the same scales, so the same FP8 operands, through the loop matmul (whose sum for one
// element does not depend on the matrix sizes). Partial sums are compared within FP32_ORDER_RTOL
// of the sum of their terms' magnitudes.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/09_fp8/fp8.h"
#include "common/comm.h"
#include "common/log.h"
#include "common/rng.h"
#include "tests/tolerances.h"

enum { M = 16, K = 32, N = 24 };  // divisible by 1, 2 and 4 ranks

static int failures;

// exact: bit for bit. Otherwise got is a sum over ranks in another order than want's: each element
// within FP32_ORDER_RTOL of the sum of its terms' magnitudes (sum_abs), the bound of a reordered
// fp32 sum (relative to the result itself it would be unbounded where terms cancel).
static void compare(const char *what, const real *got, const real *want, const real *sum_abs, size_t n) {
    double worst = 0;
    size_t at = 0;
    bool bad = false;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        bool ok = sum_abs ? d <= FP32_ORDER_RTOL * (double)sum_abs[i] : got[i] == want[i];
        if (!ok && !bad) at = i, bad = true;
        if (d > worst) worst = d;
    }
    if (!bad) return;
    fprintf(stderr, "rank %d: FAIL %s: %s, max abs err %.3e, first bad index %zu: %.9g vs %.9g\n",
            comm_rank(comm_world()), what, sum_abs ? "beyond FP32_ORDER_RTOL of the terms" : "not bit-identical",
            worst, at, (double)got[at], (double)want[at]);
    failures++;
}

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a (*, ld) matrix.
static real *block(const real *x, int ld, int r0, int rows, int c0, int cols) {
    real *b = malloc(sizeof(real) * rows * cols);
    for (int i = 0; i < rows; i++) memcpy(b + (size_t)i * cols, x + (size_t)(r0 + i) * ld + c0, sizeof(real) * cols);
    return b;
}

static void sum_over(Comm *c, real *x, size_t n) {
    comm_all_reduce(c, x, n, sizeof(real) == 4 ? COMM_FLOAT32 : COMM_FLOAT64, COMM_SUM);
}

typedef struct {
    real *y, *dx, *dw;
} Result;

static Result run_linear(Fp8 *f, Projection p, const real *x, const real *w, const real *dy, int m, int k, int n) {
    Result r = {calloc((size_t)m * n, sizeof(real)), calloc((size_t)m * k, sizeof(real)), calloc((size_t)n * k, sizeof(real))};
    fp8_linear_forward(f, 0, p, r.y, x, w, m, k, n);
    fp8_linear_backward(f, 0, p, r.dx, r.dw, dy, x, w, m, k, n);
    return r;
}

static void free_result(Result *r) { free(r->y), free(r->dx), free(r->dw); }

// The fp32 linear on |x|, |w|, |dy|: each output's sum of its terms' magnitudes (FP8 rounding
// changes them by at most 2^-4 relative, well inside the tolerance's margin).
static Result sum_of_magnitudes(const real *x, const real *w, const real *dy) {
    real ax[M * K], aw[N * K], ady[M * N];
    for (int i = 0; i < M * K; i++) ax[i] = fabs(x[i]);
    for (int i = 0; i < N * K; i++) aw[i] = fabs(w[i]);
    for (int i = 0; i < M * N; i++) ady[i] = fabs(dy[i]);
    Result r = {calloc(M * N, sizeof(real)), calloc(M * K, sizeof(real)), calloc(N * K, sizeof(real))};
    matmul_forward(r.y, ax, aw, M, K, N);
    matmul_backward(r.dx, r.dw, ady, ax, aw, M, K, N);
    return r;
}

// Inputs of step `step`: N(0, 1) times a range that falls by 2^-6 per quarter of the rows and per
// quarter of the columns, so that the ranks' pieces have different amaxes and the pieces with the
// small ones reach FP8's subnormals only under the group's scale (with rowwise power-of-two
// scales, that is the only place where an unreduced amax changes a value). The output gradient is
// small, as gradients are; step 1 is half of step 0 (delayed then scales from the history).
static real value(int i, int rows, int cols, double s, uint64_t stream) {
    int r = i / cols, c = i % cols;
    return (real)(s * ldexp(1.0, -6 * (4 * r / rows) - 6 * (4 * c / cols)) * rng_normal(9, stream, (uint64_t)i));
}

// Zeros make some outputs of each split GEMM come from the small second half of its contraction
// dimension alone, where the group's scale and a local one differ visibly (elsewhere the large
// first half would drown the difference): W[n, k < K/2] = 0 for even n (the row-parallel forward),
// W[n < N/2, k] = 0 for even k (the column-parallel input gradient), dY[m < M/2, n] = 0 for even n
// (the data-parallel weight gradient).
static void make_inputs(real *x, real *w, real *dy, int step) {
    double s = step ? 0.5 : 1.0;
    for (int i = 0; i < M * K; i++) x[i] = value(i, M, K, s, 1);
    for (int i = 0; i < N * K; i++) {
        int n = i / K, k = i % K;
        bool zero = (n % 2 == 0 && k < K / 2) || (k % 2 == 0 && n < N / 2);
        w[i] = zero ? 0 : value(i, N, K, 0.05, 2);
    }
    for (int i = 0; i < M * N; i++) dy[i] = (i / N < M / 2 && i % N % 2 == 0) ? 0 : value(i, M, N, s * 1e-4, 3);
}

static void check_recipe(Fp8Recipe recipe, Comm *world) {
    int W = comm_size(world), r = comm_rank(world);
    Fp8Options o = {recipe, 4, 0};
    Fp8 *single = fp8_create(&o, 1, (Fp8Groups){NULL, NULL});
    Fp8 *dp = fp8_create(&o, 1, (Fp8Groups){NULL, world});
    Fp8 *tp = fp8_create(&o, 1, (Fp8Groups){world, NULL});
    real x[M * K], w[N * K], dy[M * N];
    char what[96];
    for (int step = 0; step < 2; step++) {
        make_inputs(x, w, dy, step);
        Result ref_q = run_linear(single, PROJ_WQ, x, w, dy, M, K, N);
        Result ref_o = run_linear(single, PROJ_WO, x, w, dy, M, K, N);
        Result mag = sum_of_magnitudes(x, w, dy);
        // data parallel: this rank's tokens
        int m = M / W;
        real *xs = block(x, K, r * m, m, 0, K), *dys = block(dy, N, r * m, m, 0, N);
        Result d = run_linear(dp, PROJ_WQ, xs, w, dys, m, K, N);
        sum_over(world, d.dw, (size_t)N * K);
        real *want_y = block(ref_q.y, N, r * m, m, 0, N), *want_dx = block(ref_q.dx, K, r * m, m, 0, K);
        snprintf(what, sizeof what, "recipe %d step %d data parallel", (int)recipe, step);
        compare(what, d.y, want_y, NULL, (size_t)m * N);
        compare(what, d.dx, want_dx, NULL, (size_t)m * K);
        compare(what, d.dw, ref_q.dw, mag.dw, (size_t)N * K);
        free(xs), free(dys), free(want_y), free(want_dx), free_result(&d);
        // column parallel (wq): this rank's output features
        int n = N / W;
        real *ws = block(w, K, r * n, n, 0, K);
        dys = block(dy, N, 0, M, r * n, n);
        Result c = run_linear(tp, PROJ_WQ, x, ws, dys, M, K, n);
        sum_over(world, c.dx, (size_t)M * K);
        want_y = block(ref_q.y, N, 0, M, r * n, n);
        real *want_dw = block(ref_q.dw, K, r * n, n, 0, K);
        snprintf(what, sizeof what, "recipe %d step %d column parallel", (int)recipe, step);
        compare(what, c.y, want_y, NULL, (size_t)M * n);
        compare(what, c.dw, want_dw, NULL, (size_t)n * K);
        compare(what, c.dx, ref_q.dx, mag.dx, (size_t)M * K);
        free(ws), free(dys), free(want_y), free(want_dw), free_result(&c);
        // row parallel (wo): this rank's input features
        int k = K / W;
        xs = block(x, K, 0, M, r * k, k);
        ws = block(w, K, 0, N, r * k, k);
        Result rp = run_linear(tp, PROJ_WO, xs, ws, dy, M, k, N);
        sum_over(world, rp.y, (size_t)M * N);
        want_dx = block(ref_o.dx, K, 0, M, r * k, k);
        want_dw = block(ref_o.dw, K, 0, N, r * k, k);
        snprintf(what, sizeof what, "recipe %d step %d row parallel", (int)recipe, step);
        compare(what, rp.dx, want_dx, NULL, (size_t)M * k);
        compare(what, rp.dw, want_dw, NULL, (size_t)N * k);
        compare(what, rp.y, ref_o.y, mag.y, (size_t)M * N);
        free(xs), free(ws), free(want_dx), free(want_dw), free_result(&rp);
        free_result(&ref_q), free_result(&ref_o), free_result(&mag);
        fp8_step_end(single), fp8_step_end(dp), fp8_step_end(tp);
    }
    fp8_free(single), fp8_free(dp), fp8_free(tp);
}

int main(int argc, char **argv) {
    log_set_program("test_fp8_groups");
    comm_init(&argc, &argv, NULL);
    Comm *world = comm_world();
    if (M % comm_size(world) || N % comm_size(world) || K % comm_size(world))
        fatal_input("%d ranks do not divide M %d, N %d, K %d", comm_size(world), M, N, K);
    matmul_set_backend(MATMUL_LOOP);
    for (int recipe = 0; recipe < 3; recipe++) check_recipe((Fp8Recipe)recipe, world);
    int32_t total = failures;
    comm_all_reduce(world, &total, 1, COMM_INT32, COMM_SUM);
    if (comm_rank(world) == 0) {
        if (total) printf("test_fp8_groups: %d ranks: %d checks failed\n", comm_size(world), total);
        else printf("test_fp8_groups: %d ranks: all checks passed\n", comm_size(world));
    }
    comm_finalize();
    return total ? 1 : 0;
}
