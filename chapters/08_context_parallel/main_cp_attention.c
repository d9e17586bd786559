// main_cp_attention.c: build/cp_attention, chapter 8's program. It runs context-parallel attention
// (cp.c) on random q, k, v of one shape, every rank holding its share of the tokens:
//   --check        compares out, lse, dQ, dK and dV on every rank with single-process attention on
//                  the whole sequence (which every rank also computes), and the number of
//                  transfers with the formula; exits 1 on a mismatch. One rank: bit-identical.
//   --trace FILE   records the run as one merged Perfetto trace: the blocks on each rank's compute
//                  track, the K/V rotations on comm:cp, flows between the ranks.
//   always         prints each rank's attention time and the query-key pairs it scored
//                  (zigzag against --cp-load-balance off shows the imbalance).
//
//   mpirun --oversubscribe -np 4 ./build/cp_attention --check
//   mpirun --oversubscribe -np 4 ./build/cp_attention --check --cp-mode alltoall --heads 8 --kv-heads 4
//   mpirun --oversubscribe -np 4 ./build/cp_attention --seq-len 4096 --cp-load-balance off
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/08_context_parallel/cp.h"
#include "common/args.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/rng.h"
#include "common/trace.h"
#include "common/trace_dist.h"
#include "tests/tolerances.h"

static struct {
    bool check;
    const char *trace, *mode, *load_balance;
    int batch, seq_len, heads, kv_heads, head_dim;
    long long seed;
} opt;

static const ArgSpec FLAGS[] = {
    {"check", ARG_BOOL, &opt.check, NULL, "compare with single-process attention; exit 1 on a mismatch",
     .value_name = ""},
    {"cp-mode", ARG_CHOICE, &opt.mode, "ring", "ring attention or all-to-all (Ulysses)", .choices = CP_MODE_NAMES},
    {"cp-load-balance", ARG_CHOICE, &opt.load_balance, "on", "on: zigzag split; off: contiguous chunks",
     .choices = "on|off"},
    {"batch", ARG_INT, &opt.batch, "2", "sequences", .min = 1, .max = 1024},
    {"seq-len", ARG_INT, &opt.seq_len, "48", "tokens per sequence (divisible by 2 x ranks when balanced on 2 or more ranks)", .min = 1,
     .max = 1 << 20},
    {"heads", ARG_INT, &opt.heads, "4", "query heads", .min = 1, .max = 1024},
    {"kv-heads", ARG_INT, &opt.kv_heads, "2", "key/value heads (GQA; divides --heads)", .min = 1, .max = 1024},
    {"head-dim", ARG_INT, &opt.head_dim, "16", "head dimension", .min = 1, .max = 1024},
    {"seed", ARG_LONG, &opt.seed, "3", "seed of the inputs", .min = 0, .max = 9.2e18},
    {"trace", ARG_STRING, &opt.trace, NULL, "write a Perfetto trace of the run", .value_name = "FILE"},
};
#define N_FLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

static real *random_tensor(size_t n, uint64_t stream) {
    real *x = mem_alloc(MEM_OTHER, sizeof(real) * n);
    for (size_t i = 0; i < n; i++) x[i] = (real)rng_normal((uint64_t)opt.seed, stream, i);
    return x;
}

static real *zeros(size_t n) {
    real *x = mem_alloc(MEM_OTHER, sizeof(real) * n);
    memset(x, 0, sizeof(real) * n);
    return x;
}

// Rows of this rank's tokens: (B, T, width) -> (B, Tl, width), token t of sequence b from positions[t].
static void take_rows(const real *full, real *local, const int *positions, int B, int T, int Tl, int width) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tl; t++)
            memcpy(local + ((size_t)b * Tl + t) * width, full + ((size_t)b * T + positions[t]) * width,
                   sizeof(real) * width);
}

// lse (B, H, T) -> (B, H, Tl)
static void take_lse(const real *full, real *local, const int *positions, int B, int H, int T, int Tl) {
    for (int bh = 0; bh < B * H; bh++)
        for (int t = 0; t < Tl; t++) local[(size_t)bh * Tl + t] = full[(size_t)bh * T + positions[t]];
}

// Max |ours - ref| relative to max |ref| (what the tolerance bounds), worst index. Returns pass.
static bool compare(const char *name, const real *ours, const real *ref, size_t n, bool exact, int rank) {
    double max_abs = 0, ref_max = 0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)ours[i] - (double)ref[i]);
        if (isinf(ref[i]) && ours[i] == ref[i]) d = 0;  // -inf lse of a row that saw no key
        if (d > max_abs || d != d) max_abs = d, worst = i;
        if (isfinite(ref[i]) && fabs(ref[i]) > ref_max) ref_max = fabs(ref[i]);
    }
    double rel = max_abs / (ref_max > 0 ? ref_max : 1);
    bool ok = exact ? max_abs == 0 : rel <= CP_ATTENTION_RTOL;
    if (!ok || rank == 0)
        printf("%s rank %d %-4s max_abs %.3e max_rel %.3e worst [%zu] %.9g vs %.9g (%s)\n", ok ? "ok:  " : "FAIL:", rank,
               name, max_abs, rel, worst, (double)ours[worst], (double)ref[worst],
               exact ? "bit-identical required" : "rtol " CP_ATTENTION_RTOL_TEXT);
    return ok;
}

// The merge's empty rows (cp.h): an lse of -inf means no keys, and the output row beside it means
// nothing (NaN here). The ring never merges such a row (step 0 writes the running rows, and every
// later block it merges is fully visible), so the three cases are checked on the merge directly.
static int check_empty_row_merges(void) {
    enum { HD = 4 };
    const real block[HD] = {1, 2, 3, 4}, junk[HD] = {NAN, NAN, NAN, NAN};
    real running[HD], lse, lse_b;
    int failures = 0;
    memcpy(running, junk, sizeof running), lse = -INFINITY, lse_b = 0.5f;  // no keys yet: takes the block's
    cp_host_compute.merge(running, &lse, block, &lse_b, 0, 1, 1, 1, HD);
    failures += !(lse == lse_b && memcmp(running, block, sizeof running) == 0);
    memcpy(running, block, sizeof running), lse = 0.25f, lse_b = -INFINITY;  // the block had none: unchanged
    cp_host_compute.merge(running, &lse, junk, &lse_b, 0, 1, 1, 1, HD);
    failures += !(lse == 0.25f && memcmp(running, block, sizeof running) == 0);
    lse = -INFINITY;  // neither: still none
    cp_host_compute.merge(running, &lse, junk, &lse_b, 0, 1, 1, 1, HD);
    failures += !(lse == -INFINITY);
    printf("%s merge of rows without keys (an lse of -inf on either side or both): %d of 3 wrong\n",
           failures ? "FAIL:" : "ok:  ", failures);
    return failures;
}

// Every rank holds the whole sequence's q, k, v and dout, and with --check the single-process
// reference's out, dq, dk and dv too: refused before any work when that alone cannot fit.
static void check_memory(void) {
    uint64_t per_token = mem_mul((uint64_t)opt.heads + opt.kv_heads, (uint64_t)opt.head_dim);  // q + k (or out + dk...)
    uint64_t tensors = mem_mul(mem_mul((uint64_t)opt.batch, (uint64_t)opt.seq_len), per_token);
    uint64_t bytes = mem_mul(mem_mul(tensors, opt.check ? 4 : 2), sizeof(real));
    char what[160];
    snprintf(what, sizeof what, "--batch %d --seq-len %d --heads %d --kv-heads %d --head-dim %d", opt.batch,
             opt.seq_len, opt.heads, opt.kv_heads, opt.head_dim);
    mem_check_plan(what, bytes, mem_local_processes());
}

int main(int argc, char **argv) {
    ArgSpec flags[N_FLAGS];
    memcpy(flags, FLAGS, sizeof flags);
    args_parse(flags, N_FLAGS, argc, argv, "cp_attention",
               "Context-parallel attention (ring or all-to-all) against single-process attention.");
    if (opt.heads % opt.kv_heads != 0) fatal_input("--kv-heads %d: must divide --heads %d", opt.kv_heads, opt.heads);
    fileio_check_output("trace", opt.trace, OUTPUT_FILE);
    check_memory();
    comm_init(&argc, &argv, &(CommOptions){.trace = opt.trace != NULL});
    Comm *world = comm_world();
    int rank = comm_rank(world), n = comm_size(world);
    log_set_rank(rank);
    Comm *group = comm_split(world, 0, rank, "cp");
    if (opt.trace) {
        char label[64];
        snprintf(label, sizeof label, "rank %d [cp%d]", rank, rank);
        trace_align_clocks(world);
        trace_init(rank, label);
    }
    CpMode mode = (CpMode)args_choice_index(CP_MODE_NAMES, opt.mode);
    // One rank holds the whole sequence in order (cp_layout): no zigzag to report, nor to divide T by.
    bool balanced = strcmp(opt.load_balance, "on") == 0 && n > 1;
    int B = opt.batch, T = opt.seq_len, H = opt.heads, Hkv = opt.kv_heads, hd = opt.head_dim;
    // cp_create's refusals name the trainer's flags (--cp, tensor parallelism); here the cp degree is
    // the rank count.
    if (cp_layout_check(n, T, balanced))
        fatal_input("--seq-len %d on %d ranks: must divide by %s%d (%s)", T, n, balanced ? "2 x " : "", n,
                    balanced ? "zigzag: two chunks per rank; --cp-load-balance off needs only the ranks"
                             : "contiguous: one chunk per rank");
    if (mode == CP_ALLTOALL && (H % n != 0 || Hkv % n != 0))
        fatal_input("--cp-mode alltoall on %d ranks: --heads %d and --kv-heads %d must divide by the ranks", n, H, Hkv);
    ContextParallel *cp = cp_create(group, mode, balanced, B, T, H, Hkv, hd, NULL);
    int Tl = T / n;
    const int *positions = cp_positions(cp);

    // The whole sequence, the same on every rank; this rank's share of it.
    size_t nq = (size_t)B * T * H * hd, nkv = (size_t)B * T * Hkv * hd, lq = nq / n, lkv = nkv / n;
    real *q = random_tensor(nq, 1), *k = random_tensor(nkv, 2), *v = random_tensor(nkv, 3), *dout = random_tensor(nq, 4);
    real *q_l = zeros(lq), *k_l = zeros(lkv), *v_l = zeros(lkv), *dout_l = zeros(lq);
    take_rows(q, q_l, positions, B, T, Tl, H * hd);
    take_rows(k, k_l, positions, B, T, Tl, Hkv * hd);
    take_rows(v, v_l, positions, B, T, Tl, Hkv * hd);
    take_rows(dout, dout_l, positions, B, T, Tl, H * hd);
    real *out_l = zeros(lq), *lse_l = zeros((size_t)B * H * Tl), *dq_l = zeros(lq), *dk_l = zeros(lkv),
         *dv_l = zeros(lkv);

    long long t0 = now_ns();
    cp_attention_forward(cp, out_l, lse_l, q_l, k_l, v_l);
    long long transfers_fwd = cp_transfers(cp);
    cp_attention_backward(cp, dq_l, dk_l, dv_l, dout_l, q_l, k_l, v_l, out_l, lse_l);
    double ms = (now_ns() - t0) * 1e-6;
    long long transfers_bwd = cp_transfers(cp) - transfers_fwd;

    // Each rank's time and the query-key pairs its ranks' blocks scored, for the balance table.
    double mine[2] = {ms, 0}, *all = malloc(sizeof(double) * 2 * n);
    for (int t = 0; t < Tl; t++) mine[1] += positions[t] + 1;  // keys a causal query sees
    comm_all_gather(world, mine, all, 2, COMM_FLOAT64);
    if (rank == 0)
        for (int r = 0; r < n; r++)
            printf("rank %d: attention fwd+bwd %.2f ms, %.0f causal query-key pairs (%s, %s)\n", r, all[2 * r],
                   all[2 * r + 1], opt.mode, balanced ? "zigzag" : "contiguous");
    free(all);

    int failures = 0;
    if (opt.check && rank == 0) failures += check_empty_row_merges();
    if (opt.check) {
        AttnShape s = {B, T, T, H, Hkv, hd, NULL, NULL, true};
        real *out = zeros(nq), *lse = zeros((size_t)B * H * T), *dq = zeros(nq), *dk = zeros(nkv), *dv = zeros(nkv);
        attention_flash_forward(out, lse, q, k, v, &s);
        attention_flash_backward(dq, dk, dv, dout, q, k, v, out, lse, &s);
        real *ref = zeros(lq), *ref_lse = zeros((size_t)B * H * Tl);
        bool exact = n == 1;
        take_rows(out, ref, positions, B, T, Tl, H * hd);
        failures += !compare("out", out_l, ref, lq, exact, rank);
        take_lse(lse, ref_lse, positions, B, H, T, Tl);
        failures += !compare("lse", lse_l, ref_lse, (size_t)B * H * Tl, exact, rank);
        take_rows(dq, ref, positions, B, T, Tl, H * hd);
        failures += !compare("dq", dq_l, ref, lq, exact, rank);
        take_rows(dk, ref, positions, B, T, Tl, Hkv * hd);
        failures += !compare("dk", dk_l, ref, lkv, exact, rank);
        take_rows(dv, ref, positions, B, T, Tl, Hkv * hd);
        failures += !compare("dv", dv_l, ref, lkv, exact, rank);
        // ring: N-1 K/V rotations forward; backward N-1 more and N for dK/dV (the last brings each
        // rank its own). all-to-all: q, k, v, out, lse forward; q, k, v, out, dout, lse, dq, dk, dv back.
        long long want_fwd = mode == CP_RING ? n - 1 : 5, want_bwd = mode == CP_RING ? (n > 1 ? 2 * n - 1 : 0) : 9;
        bool counts_ok = transfers_fwd == want_fwd && transfers_bwd == want_bwd;
        if (!counts_ok || rank == 0)
            printf("%s rank %d transfers: forward %lld (formula %lld), backward %lld (formula %lld)\n",
                   counts_ok ? "ok:  " : "FAIL:", rank, transfers_fwd, want_fwd, transfers_bwd, want_bwd);
        failures += !counts_ok;
        // Backward adds into its gradients (ops.h: callers zero them once, residual branches add):
        // a second call on the same buffers must leave twice the reference (doubling is exact), where
        // one that wrote over what the buffers held would leave a single reference's worth.
        cp_attention_backward(cp, dq_l, dk_l, dv_l, dout_l, q_l, k_l, v_l, out_l, lse_l);
        const struct { const char *name; real *ours, *full; size_t n, width; } grads[3] = {
            {"2 dq", dq_l, dq, lq, (size_t)H * hd}, {"2 dk", dk_l, dk, lkv, (size_t)Hkv * hd},
            {"2 dv", dv_l, dv, lkv, (size_t)Hkv * hd}};
        for (int g = 0; g < 3; g++) {
            take_rows(grads[g].full, ref, positions, B, T, Tl, (int)grads[g].width);
            for (size_t i = 0; i < grads[g].n; i++) ref[i] *= 2;
            failures += !compare(grads[g].name, grads[g].ours, ref, grads[g].n, false, rank);
        }
        mem_free(out), mem_free(lse), mem_free(dq), mem_free(dk), mem_free(dv), mem_free(ref), mem_free(ref_lse);
    }
    comm_all_reduce(world, &failures, 1, COMM_INT32, COMM_SUM);
    if (opt.check && rank == 0)
        printf("%s: %d ranks, %s, %s, B %d T %d heads %d kv heads %d: %d failure(s)\n", failures ? "FAIL" : "PASS", n,
               opt.mode, balanced ? "zigzag" : "contiguous", B, T, H, Hkv, failures);
    if (opt.trace && !trace_gather_and_write(world, opt.trace, NULL)) fatal("could not write the trace");
    if (opt.trace && rank == 0) log_info("trace written to %s", opt.trace);
    cp_free(cp);
    mem_free(q), mem_free(k), mem_free(v), mem_free(dout), mem_free(q_l), mem_free(k_l), mem_free(v_l);
    mem_free(dout_l), mem_free(out_l), mem_free(lse_l), mem_free(dq_l), mem_free(dk_l), mem_free(dv_l);
    comm_free(group);
    trace_shutdown();
    comm_finalize();
    return failures ? 1 : 0;
}
