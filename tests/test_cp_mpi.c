// test_cp_mpi.c: context-parallel attention (chapters/08_context_parallel) against single-process
// blockwise attention, under mpirun. The world is the cp group; tests/t_cp.sh runs it on 2, 3 and 4
// ranks; alone (one rank, as tests/run_tests.sh runs every test_*) it checks cp = 1.
//
// Every rank builds the same full-sequence Q, K, V and output gradient from fixed seeds, runs the
// reference (attention_flash_forward/backward over the whole sequence) by itself, then its share
// through cp_attention_forward/backward, and compares out, lse, dQ, dK, dV on its own tokens:
//   ring       within CP_ATTN_RTOL / CP_ATTN_ATOL (tests/tolerances.h): the sums run in another order;
//   alltoall   bit for bit: each rank runs the single process's computation on whole heads;
//   cp = 1     bit for bit (the module calls the single-process function).
// Cases: ring and alltoall x zigzag and contiguous x GQA and MHA; the refusals of cp_check; and the
// number of transfers one forward and backward start (ring: N-1 + (N-1) + N per layer).
//
//   test_cp_mpi [--verbose]   --verbose: rank 0 prints each case's largest errors
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/08_context_parallel/cp.h"
#include "common/comm.h"
#include "common/log.h"
#include "common/rng.h"
#include "tests/tolerances.h"

static int failures, verbose;

__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...) {
    fprintf(stderr, "rank %d: FAIL: ", comm_rank(comm_world()));
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    failures++;
}

static real *normal(size_t n, uint64_t stream) {
    real *x = malloc(sizeof(real) * n);
    for (size_t i = 0; i < n; i++) x[i] = (real)rng_normal(7, stream, i);
    return x;
}
static real *zeros(size_t n) { return calloc(n, sizeof(real)); }

// |got - want| <= atol + rtol |want| everywhere (rtol < 0: bit for bit); prints the worst element.
static void compare(const char *what, const char *name, const real *got, const real *want, size_t n, double rtol,
                    double atol) {
    double max_abs = 0, max_rel = 0, worst_excess = -1;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]), rel = d / (fabs((double)want[i]) > 0 ? fabs((double)want[i]) : 1);
        double excess = rtol < 0 ? (got[i] == want[i] ? -1 : d + 1) : d - (atol + rtol * fabs((double)want[i]));
        if (d > max_abs) max_abs = d;
        if (rel > max_rel) max_rel = rel;
        if (excess > worst_excess) worst_excess = excess, worst = i;
    }
    if (!(worst_excess <= 0))
        fail("%s %s: max abs err %.3e, max rel err %.3e, worst index %zu: got %.9g want %.9g (%s)", what, name,
             max_abs, max_rel, worst, (double)got[worst], (double)want[worst], rtol < 0 ? "bit for bit" : "tolerance");
    else if (verbose && comm_rank(comm_world()) == 0)
        printf("  %-34s %-4s max abs err %.2e  max rel err %.2e\n", what, name, max_abs, max_rel);
}

typedef struct {
    CpMode mode;
    bool load_balance;
    int n_heads, n_kv_heads;
} Case;

static void run_case(Comm *group, const Case *tc) {
    int N = comm_size(group), B = 2, hd = 8, T = 2 * N * 12, H = tc->n_heads, KV = tc->n_kv_heads;
    char what[96];
    snprintf(what, sizeof what, "%s %s H=%d KV=%d cp=%d", tc->mode == CP_RING ? "ring" : "alltoall",
             tc->load_balance ? "zigzag" : "contiguous", H, KV, N);
    size_t q_n = (size_t)B * T * H * hd, kv_n = (size_t)B * T * KV * hd, lse_n = (size_t)B * H * T;
    real *q = normal(q_n, 1), *k = normal(kv_n, 2), *v = normal(kv_n, 3), *dout = normal(q_n, 4);
    // the single process over the whole sequence
    real *out = zeros(q_n), *lse = zeros(lse_n), *dq = zeros(q_n), *dk = zeros(kv_n), *dv = zeros(kv_n);
    AttnShape full = {B, T, T, H, KV, hd, NULL, NULL, true};
    attention_flash_forward(out, lse, q, k, v, &full);
    attention_flash_backward(dq, dk, dv, dout, q, k, v, out, lse, &full);

    CpAttention *cp = cp_create(group, tc->mode, tc->load_balance, T, KV);
    int L = cp_local_len(cp);
    const int *pos = cp_positions(cp);
    size_t lq = (size_t)B * L * H * hd, lkv = (size_t)B * L * KV * hd, llse = (size_t)B * H * L;
    real *q_l = zeros(lq), *k_l = zeros(lkv), *v_l = zeros(lkv), *dout_l = zeros(lq);
    cp_take_rows(cp, q_l, q, B, H * hd);
    cp_take_rows(cp, k_l, k, B, KV * hd);
    cp_take_rows(cp, v_l, v, B, KV * hd);
    cp_take_rows(cp, dout_l, dout, B, H * hd);
    real *out_l = zeros(lq), *lse_l = zeros(llse), *dq_l = zeros(lq), *dk_l = zeros(lkv), *dv_l = zeros(lkv);
    AttnShape local = {B, L, L, H, KV, hd, NULL, NULL, true};
    long before = cp_transfers(cp);
    cp_attention_forward(cp, out_l, lse_l, q_l, k_l, v_l, &local);
    long forward_transfers = cp_transfers(cp) - before;
    cp_attention_backward(cp, dq_l, dk_l, dv_l, dout_l, q_l, k_l, v_l, out_l, lse_l, &local);
    long backward_transfers = cp_transfers(cp) - before - forward_transfers;

    // the reference's values on this rank's tokens
    real *want_out = zeros(lq), *want_lse = zeros(llse), *want_dq = zeros(lq), *want_dk = zeros(lkv), *want_dv = zeros(lkv);
    cp_take_rows(cp, want_out, out, B, H * hd);
    cp_take_rows(cp, want_dq, dq, B, H * hd);
    cp_take_rows(cp, want_dk, dk, B, KV * hd);
    cp_take_rows(cp, want_dv, dv, B, KV * hd);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < L; i++) want_lse[((size_t)b * H + h) * L + i] = lse[((size_t)b * H + h) * T + pos[i]];

    bool exact = N == 1 || tc->mode == CP_ALLTOALL;
    double rtol = exact ? -1 : CP_ATTN_RTOL, atol = CP_ATTN_ATOL;
    compare(what, "out", out_l, want_out, lq, rtol, atol);
    compare(what, "lse", lse_l, want_lse, llse, rtol, atol);
    compare(what, "dq", dq_l, want_dq, lq, rtol, atol);
    compare(what, "dk", dk_l, want_dk, lkv, rtol, atol);
    compare(what, "dv", dv_l, want_dv, lkv, rtol, atol);

    // transfers: ring forward N-1 K/V hops; backward N-1 K/V hops + N dK/dV hops. alltoall: Q, K, V
    // in and out + lse out forward; Q, K, V, out, dout, lse in and dQ, dK, dV out backward.
    long want_fwd = N == 1 ? 0 : tc->mode == CP_RING ? N - 1 : 5, want_bwd = N == 1 ? 0 : tc->mode == CP_RING ? 2 * N - 1 : 9;
    if (forward_transfers != want_fwd || backward_transfers != want_bwd)
        fail("%s: %ld forward and %ld backward transfers, expected %ld and %ld", what, forward_transfers,
             backward_transfers, want_fwd, want_bwd);
    cp_free(cp);
    real *all[] = {q, k, v, dout, out, lse, dq, dk, dv, q_l, k_l, v_l, dout_l, out_l, lse_l, dq_l, dk_l, dv_l,
                   want_out, want_lse, want_dq, want_dk, want_dv};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) free(all[i]);
}

static void check_refusals(int N) {
    if (cp_check(N, CP_RING, true, 2 * N, 1)) fail("cp_check refused a valid zigzag layout");
    if (N > 1 && !cp_check(N, CP_RING, true, 2 * N + N, 1)) fail("cp_check accepted seq len %d with cp %d", 3 * N, N);
    if (N > 1 && !cp_check(N, CP_ALLTOALL, true, 2 * N, N + 1)) fail("cp_check accepted alltoall with %d kv heads", N + 1);
    if (N > 1 && cp_check(N, CP_RING, true, 2 * N, N + 1)) fail("cp_check refused ring with %d kv heads", N + 1);
    if (cp_check(N, CP_RING, false, N, 1)) fail("cp_check refused a contiguous split of %d tokens", N);
}

int main(int argc, char **argv) {
    comm_init(&argc, &argv, NULL);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--verbose")) verbose = 1;
        else fatal_input("test_cp_mpi: unknown argument %s", argv[i]);
    }
    Comm *group = comm_split(comm_world(), 0, comm_rank(comm_world()), "cp");
    int N = comm_size(group);
    check_refusals(N);
    for (int lb = 1; lb >= 0; lb--) {
        Case ring_cases[] = {{CP_RING, lb, 4, 2}, {CP_RING, lb, 3, 3}};   // GQA (group 2), MHA
        Case a2a_cases[] = {{CP_ALLTOALL, lb, 2 * N, N}, {CP_ALLTOALL, lb, N, N}};
        for (int i = 0; i < 2; i++) run_case(group, &ring_cases[i]);
        for (int i = 0; i < 2; i++) run_case(group, &a2a_cases[i]);
    }
    int total = failures;
    comm_all_reduce(comm_world(), &total, 1, COMM_INT32, COMM_SUM);
    if (comm_rank(comm_world()) == 0) printf("test_cp_mpi: %d ranks, %s\n", N, total ? "FAILED" : "OK");
    comm_free(group);
    comm_finalize();
    return total ? 1 : 0;
}
