// main_collectives.c: build/collectives, chapter 1's program. It runs the ring collectives of
// ring.c next to the communicator's built-in ones (common/comm.c):
//   --check        compares them on many sizes, dtypes and ops, and exits 1 on a mismatch;
//   --bench        times both over message sizes: time, algbw and busbw (nccl-tests' definitions);
//   --trace FILE   records a few ring all-reduces as one merged Perfetto trace: every step a slice,
//                  every message a flow arrow from the sending rank to the receiving one.
//
//   mpirun --oversubscribe -np 4 ./build/collectives --check
//   mpirun --oversubscribe -np 4 ./build/collectives --bench --max-bytes 16777216
//   mpirun --oversubscribe -np 4 ./build/collectives --trace ring.pftrace
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chapters/01_collectives/ring.h"
#include "common/args.h"
#include "common/comm.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/trace.h"
#include "common/trace_dist.h"

#define MAX_BENCH_BYTES 1e9  // per buffer; args.c prints bounds with %g

static struct {
    bool check, bench;
    const char *trace;
    long long seed, min_bytes, max_bytes, trace_bytes;
    double tol_scale;
    int factor, iters, warmup, trace_iters;
} opt;

static const ArgSpec FLAGS[] = {
    {"check", ARG_BOOL, &opt.check, NULL,
     "compare ring and built-in collectives (sizes, dtypes, ops); exit 1 on a mismatch", .value_name = ""},
    {"seed", ARG_LONG, &opt.seed, "1", "--check: seed of the inputs", .min = 0, .max = 9.2e18},
    {"tol-scale", ARG_DOUBLE, &opt.tol_scale, "1",
     "--check: multiply the float tolerance by this (0: demand bit-identity, and see where it fails)", .min = 0,
     .max = 1e6},
    {"bench", ARG_BOOL, &opt.bench, NULL, "time ring and built-in collectives over message sizes (float32 sum)",
     .value_name = ""},
    {"min-bytes", ARG_LONG, &opt.min_bytes, "1024", "--bench: smallest message (the whole buffer, nccl-tests' size)",
     .min = 4, .max = MAX_BENCH_BYTES},
    {"max-bytes", ARG_LONG, &opt.max_bytes, "67108864", "--bench: largest message", .min = 4, .max = MAX_BENCH_BYTES},
    {"factor", ARG_INT, &opt.factor, "4", "--bench: each size is the previous one times this", .min = 2, .max = 1024},
    {"iters", ARG_INT, &opt.iters, "10", "--bench: timed operations per size and implementation", .min = 1,
     .max = 1e6},
    {"warmup", ARG_INT, &opt.warmup, "3", "--bench: untimed operations before them", .min = 0, .max = 1e6},
    {"trace", ARG_STRING, &opt.trace, NULL, "record a few ring all-reduces as a Perfetto trace (.pftrace)",
     .value_name = "FILE"},
    {"trace-bytes", ARG_LONG, &opt.trace_bytes, "1048576", "--trace: bytes per all-reduce (float32)", .min = 4,
     .max = MAX_BENCH_BYTES},
    {"trace-iters", ARG_INT, &opt.trace_iters, "3", "--trace: ring all-reduces to record", .min = 1, .max = 1000},
};
#define N_FLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

typedef enum { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER } Collective;
static const char *const COLLECTIVE_NAMES[] = {"all_reduce", "reduce_scatter", "all_gather"};
static const char *const DTYPE_NAMES[] = {"float32", "float64", "int32", "byte"};
static const char *const OP_NAMES[] = {"sum", "avg", "max"};

static void *checked_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of memory (%zu bytes)", bytes);
    return p;
}

// ================================================================================================
// --check: inputs
// ================================================================================================

// splitmix64's finalizer: every output bit depends on every input bit.
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// 64 random bits for element g of rank r's input: a pure function, so any rank can compute any
// rank's input (the tolerance needs sum_r |x_r[g]|).
static uint64_t input_bits(int rank, size_t g) {
    return mix64(mix64((uint64_t)opt.seed * 0x9e3779b97f4a7c15ULL + (uint64_t)rank) ^ (uint64_t)g);
}

// Float inputs: a mantissa uniform in [-1, 1) times 2^e, e uniform in [-8, 8], so sums mix signs
// and magnitudes and really round. Two elements in every 61 are zeros whose MAX ties +0 (even
// ranks) against -0 (odd ranks), so the order of the comparisons shows in the sign of the result:
// at g % 61 == 40 on every rank, at g % 61 == 17 on every rank but 0, which holds -1 there.
static double float_input(CommDtype dtype, int rank, size_t g) {
    if (g % 61 == 17 && rank == 0) return -1.0;
    if (g % 61 == 17 || g % 61 == 40) return rank % 2 ? -0.0 : 0.0;
    uint64_t bits = input_bits(rank, g);
    double mantissa = (double)(bits >> 11) / 9007199254740992.0 * 2.0 - 1.0;  // 53 bits
    double x = ldexp(mantissa, (int)(bits % 17) - 8);
    return dtype == COMM_FLOAT32 ? (double)(float)x : x;
}

// buf (len) = rank r's input. INT32: any 32-bit pattern, so sums overflow and wrap.
static void fill_input(void *buf, CommDtype dtype, int rank, size_t len) {
    for (size_t g = 0; g < len; g++) {
        if (dtype == COMM_FLOAT32) ((float *)buf)[g] = (float)float_input(dtype, rank, g);
        if (dtype == COMM_FLOAT64) ((double *)buf)[g] = float_input(dtype, rank, g);
        if (dtype == COMM_INT32) ((int32_t *)buf)[g] = (int32_t)(uint32_t)input_bits(rank, g);
    }
}

// ================================================================================================
// --check: comparing ring and built-in, element by element
// ================================================================================================

// What a ring result must satisfy against the built-in one (ring.h explains why):
//   BITS       bit-identical: int32, all-gather, N = 2, and chunk N - 1 (which both fold in rank order)
//   VALUE      equal as numbers: float MAX; +0 and -0 tie, and which one survives depends on order
//   TOLERANCE  float SUM and AVG on N > 2 ranks, in chunks other than N - 1 (below)
typedef enum { BITS, VALUE, TOLERANCE } Rule;
static const char *const RULE_NAMES[] = {"bits", "value", "tol"};

typedef struct {
    Collective collective;
    CommDtype dtype;
    CommReduceOp op;
    size_t count;  // the `count` argument: the buffer for all-reduce, one block for the other two
    int n, me;
} Case;

// The rule of a whole collective; elements of chunk N - 1 are held to BITS whatever it says.
static Rule case_rule(Collective collective, CommDtype dtype, CommReduceOp op, int n) {
    if (collective == ALL_GATHER || dtype == COMM_INT32 || n <= 2) return BITS;
    return op == COMM_MAX ? VALUE : TOLERANCE;
}

// Elements of the reduced vector (all-reduce: count; reduce-scatter: count * N, rank r holding
// block r). Chunk N - 1 begins where ring.c's split puts it.
static Rule element_rule(const Case *k, size_t g) {
    size_t total = k->collective == ALL_REDUCE ? k->count : k->count * (size_t)k->n;
    if (g >= ring_chunk_begin(total, k->n, k->n - 1)) return BITS;
    return case_rule(k->collective, k->dtype, k->op, k->n);
}

// The tolerance on element g. Recursive summation of N terms in any order is within
// (N - 1) * u * sum|x| of the exact sum, u = eps / 2 the unit roundoff (to first order; Higham,
// "Accuracy and Stability of Numerical Algorithms", 4.2). Two orders are therefore within
// (N - 1) * eps * sum|x| of each other; we allow N * eps * sum|x|, the one eps * sum|x| of slack
// covering the second-order terms. AVG divides both sums by N, shrinking their difference N times,
// and each division rounds once (at most eps/2 of |avg| <= sum|x| / N each): (N + 1) / N * eps *
// sum|x| covers it. The bound is on the worst case; typical differences are far smaller (the
// max err/tol column).
static double tolerance(const Case *k, size_t g) {
    double sum_abs = 0;
    for (int r = 0; r < k->n; r++) sum_abs += fabs(float_input(k->dtype, r, g));
    double eps = k->dtype == COMM_FLOAT32 ? FLT_EPSILON : DBL_EPSILON;
    double terms = k->op == COMM_AVG ? (k->n + 1.0) / k->n : k->n;
    return opt.tol_scale * terms * eps * sum_abs;
}

// Element i as a double (exact for every dtype --check uses: float32, float64, int32).
static double element_value(const void *buf, CommDtype dtype, size_t i) {
    if (dtype == COMM_FLOAT32) return ((const float *)buf)[i];
    if (dtype == COMM_FLOAT64) return ((const double *)buf)[i];
    return ((const int32_t *)buf)[i];
}

// Per (collective, dtype, op), over every size; doubles so that one all-reduce combines ranks.
typedef struct {
    double elements, differ, zero_signs, failures;  // counts (summed over ranks)
    double max_abs, max_rel, max_ratio;             // worst |diff|, |diff|/|built-in|, |diff|/tol
} Stats;

// The worst mismatch of one case on this rank, for the failure line.
typedef struct {
    size_t failures, index;
    double score, ring, builtin, diff, tol;
    Rule rule;
} Worst;

// Judges element i of this rank's output (element g of the reduced vector), which differs from the
// built-in's in its bits: updates the statistics, and the worst failure when the rule rejects it.
static void judge(const Case *k, size_t g, size_t i, double ring, double builtin, Stats *st, Worst *w) {
    double diff = fabs(ring - builtin), rel = builtin != 0 ? diff / fabs(builtin) : diff;
    if (ring == 0 && builtin == 0) st->zero_signs++;
    if (diff > st->max_abs || isnan(diff)) st->max_abs = diff;
    if (rel > st->max_rel || isnan(rel)) st->max_rel = rel;
    Rule rule = element_rule(k, g);
    double tol = rule == TOLERANCE ? tolerance(k, g) : 0;
    double score = rule != TOLERANCE ? diff : tol > 0 ? diff / tol : diff > 0 ? INFINITY : 0;
    if (rule == TOLERANCE && (score > st->max_ratio || isnan(score))) st->max_ratio = score;
    bool ok = rule == VALUE ? ring == builtin : rule == TOLERANCE && diff <= tol;
    if (ok) return;
    if (w->failures++ == 0 || !(score <= w->score)) {  // the first failure, or a worse one (NaN is worst)
        w->index = i;
        w->score = score;
        w->ring = ring;
        w->builtin = builtin;
        w->diff = diff;
        w->tol = tol;
        w->rule = rule;
    }
}

// Compares this rank's len output elements; element i is element first + i of the reduced vector.
// Prints one line for a case that breaks its rule, naming the worst element by its index i.
static void compare(const Case *k, const void *ring, const void *builtin, size_t len, size_t first, Stats *st) {
    size_t size = comm_dtype_size(k->dtype);
    Worst worst = {0};
    for (size_t i = 0; i < len; i++) {
        st->elements++;
        if (memcmp((const char *)ring + i * size, (const char *)builtin + i * size, size) == 0) continue;
        st->differ++;
        judge(k, first + i, i, element_value(ring, k->dtype, i), element_value(builtin, k->dtype, i), st, &worst);
    }
    if (!worst.failures) return;
    st->failures += (double)worst.failures;
    char tol[40] = "";
    if (worst.rule == TOLERANCE) snprintf(tol, sizeof tol, " (tol %.3g)", worst.tol);
    // One write per line, so that lines from several ranks do not interleave.
    fprintf(stderr,
            "collectives [rank %d]: FAIL %s %s %s, count %zu on %d ranks: %zu of %zu elements break rule %s; "
            "worst element %zu: ring %.17g built-in %.17g |diff| %.3g rel %.3g%s\n",
            k->me, COLLECTIVE_NAMES[k->collective], DTYPE_NAMES[k->dtype],
            k->collective == ALL_GATHER ? "-" : OP_NAMES[k->op], k->count, k->n,
            worst.failures, len, RULE_NAMES[worst.rule], worst.index, worst.ring, worst.builtin, worst.diff,
            worst.builtin != 0 ? worst.diff / fabs(worst.builtin) : worst.diff, tol);
}

// Runs one collective both ways on the same input `in` (all-reduce and all-gather: count elements;
// reduce-scatter: count * N), into ring and built-in (all-gather: count * N; the others: count).
static void run_both(const Case *k, const void *in, void *ring, void *builtin) {
    Comm *world = comm_world();
    size_t count = k->count, bytes = comm_bytes(k->dtype, count);
    switch (k->collective) {
    case ALL_REDUCE:
        memcpy(ring, in, bytes);
        memcpy(builtin, in, bytes);
        ring_all_reduce(world, ring, count, k->dtype, k->op);
        comm_all_reduce(world, builtin, count, k->dtype, k->op);
        break;
    case REDUCE_SCATTER:
        ring_reduce_scatter(world, in, ring, count, k->dtype, k->op);
        comm_reduce_scatter(world, in, builtin, count, k->dtype, k->op);
        break;
    case ALL_GATHER:
        ring_all_gather(world, in, ring, count, k->dtype);
        comm_all_gather(world, in, builtin, count, k->dtype);
        break;
    }
}

// Runs one collective both ways on the same input and compares what this rank got.
static void run_case(const Case *k, Stats *st) {
    size_t n = (size_t)k->n, count = k->count;
    size_t in_len = k->collective == REDUCE_SCATTER ? count * n : count;
    size_t out_len = k->collective == ALL_GATHER ? count * n : count;
    void *in = checked_malloc(comm_bytes(k->dtype, in_len));
    void *ring = checked_malloc(comm_bytes(k->dtype, out_len)), *builtin = checked_malloc(comm_bytes(k->dtype, out_len));
    fill_input(in, k->dtype, k->me, in_len);
    run_both(k, in, ring, builtin);
    compare(k, ring, builtin, out_len, k->collective == REDUCE_SCATTER ? (size_t)k->me * count : 0, st);
    free(builtin);
    free(ring);
    free(in);
}

static int compare_sizes(const void *a, const void *b) {
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

// The counts --check tries: 0, 1, N - 1, N, N + 1 (empty chunks, chunks of one, uneven chunks),
// primes (never divisible by N) and large ones (the largest, 262147, is prime too); sorted, without
// repeats. Returns how many.
#define N_CHECK_SIZES 13
static int check_sizes(int n, size_t sizes[N_CHECK_SIZES]) {
    size_t wanted[N_CHECK_SIZES] = {0, 1, 2, (size_t)n - 1, (size_t)n, (size_t)n + 1, 7, 13, 97, 1009, 10007, 65537,
                                    262147};
    qsort(wanted, N_CHECK_SIZES, sizeof wanted[0], compare_sizes);
    int m = 0;
    for (int i = 0; i < N_CHECK_SIZES; i++)
        if (m == 0 || wanted[i] != sizes[m - 1]) sizes[m++] = wanted[i];
    return m;
}

// ================================================================================================
// --check: a NaN wins MAX
// ================================================================================================

// MAX lets a NaN win (comm.h; ring.c's combine), so that an overflow on one rank never vanishes in
// the maximum. The table's inputs hold no NaN, so MAX runs again on the same inputs with NaNs
// planted on one rank, the source: at the first element of every non-empty chunk of the reduced
// vector (all-reduce: ring.c's chunks; reduce-scatter: the blocks, which are its chunks too). Every
// chunk starts on some rank and is combined on the others, the received partial first (on rank 0,
// second), so with each rank in turn the source a NaN is sent as it is, and is either operand of a
// combine. Exact, no tolerance: a planted element is NaN in both the ring's and the built-in's
// output on every rank that holds it; every other element is equal as numbers (the table's rule).
typedef struct {
    double planted, ring_nan, builtin_nan, wrong;  // elements, summed over ranks and runs
} NanStats;

// planted (total): whether element g of the reduced vector (total elements in n chunks) is planted.
static void mark_chunk_heads(bool *planted, size_t total, int n) {
    memset(planted, 0, total * sizeof *planted);
    for (int k = 0; k < n; k++) {
        size_t begin = ring_chunk_begin(total, n, k);
        if (begin < ring_chunk_begin(total, n, k + 1)) planted[begin] = true;
    }
}

static void set_nan(void *buf, CommDtype dtype, size_t g) {
    if (dtype == COMM_FLOAT32) ((float *)buf)[g] = NAN;
    if (dtype == COMM_FLOAT64) ((double *)buf)[g] = NAN;
}

// One MAX collective (all-reduce or reduce-scatter, float) with the NaNs on rank `source`.
static void run_nan_case(const Case *k, int source, NanStats *st) {
    size_t count = k->count, total = k->collective == REDUCE_SCATTER ? count * (size_t)k->n : count;
    size_t first = k->collective == REDUCE_SCATTER ? (size_t)k->me * count : 0;  // where our output starts
    void *in = checked_malloc(comm_bytes(k->dtype, total));
    void *ring = checked_malloc(comm_bytes(k->dtype, count)), *builtin = checked_malloc(comm_bytes(k->dtype, count));
    bool *planted = checked_malloc(total * sizeof *planted);
    mark_chunk_heads(planted, total, k->n);
    fill_input(in, k->dtype, k->me, total);
    for (size_t g = 0; g < total; g++)
        if (planted[g] && k->me == source) set_nan(in, k->dtype, g);
    run_both(k, in, ring, builtin);
    size_t wrong = 0, worst = 0;
    for (size_t i = 0; i < count; i++) {
        double r = element_value(ring, k->dtype, i), b = element_value(builtin, k->dtype, i);
        bool nan_here = planted[first + i];
        st->planted += nan_here;
        st->ring_nan += nan_here && isnan(r);
        st->builtin_nan += nan_here && isnan(b);
        if (nan_here ? isnan(r) && isnan(b) : r == b) continue;
        if (wrong++ == 0) worst = i;
    }
    st->wrong += (double)wrong;
    if (wrong)
        fprintf(stderr,
                "collectives [rank %d]: FAIL %s %s max with NaNs on rank %d, count %zu on %d ranks: %zu of %zu "
                "elements wrong; first: element %zu (%s): ring %.17g built-in %.17g\n",
                k->me, COLLECTIVE_NAMES[k->collective], DTYPE_NAMES[k->dtype], source, count, k->n, wrong, count,
                worst, planted[first + worst] ? "NaN planted, must win" : "no NaN planted",
                element_value(ring, k->dtype, worst), element_value(builtin, k->dtype, worst));
    free(planted);
    free(builtin);
    free(ring);
    free(in);
}

// Counts above this add nothing here but time: the planted elements are N per vector whatever its
// size, and the smaller counts already give empty, single-element and uneven chunks.
#define NAN_MAX_COUNT 1009

// All-reduce and reduce-scatter, float32 and float64 MAX, over every size up to NAN_MAX_COUNT and
// every source rank: one line each. Returns the number of wrong elements (all ranks).
static double run_nan_check(const size_t *sizes, int n_sizes) {
    Comm *world = comm_world();
    int n = comm_size(world), me = comm_rank(world);
    log_info("NaN in max (counts up to %d): each rank in turn plants a NaN at the first element of every chunk;",
             NAN_MAX_COUNT);
    log_info("            there the ring's and the built-in's result must be NaN on every rank holding the element,");
    log_info("            and elsewhere equal as numbers");
    log_info("%-7s %-15s %-8s %-4s %10s %10s %12s %8s  %s", "nan", "collective", "dtype", "op", "planted", "ring_nan",
             "builtin_nan", "wrong", "result");
    double wrong = 0;
    const CommDtype dtypes[] = {COMM_FLOAT32, COMM_FLOAT64};
    for (int col = ALL_REDUCE; col <= REDUCE_SCATTER; col++) {
        for (int d = 0; d < 2; d++) {
            NanStats st = {0};
            for (int source = 0; source < n; source++)
                for (int s = 0; s < n_sizes && sizes[s] <= NAN_MAX_COUNT; s++)
                    run_nan_case(&(Case){(Collective)col, dtypes[d], COMM_MAX, sizes[s], n, me}, source, &st);
            double sums[4] = {st.planted, st.ring_nan, st.builtin_nan, st.wrong};
            comm_all_reduce(world, sums, 4, COMM_FLOAT64, COMM_SUM);
            wrong += sums[3];
            log_info("%-7s %-15s %-8s %-4s %10.0f %10.0f %12.0f %8.0f  %s", "nan", COLLECTIVE_NAMES[col],
                     DTYPE_NAMES[dtypes[d]], "max", sums[0], sums[1], sums[2], sums[3], sums[3] ? "FAIL" : "ok");
        }
    }
    return wrong;
}

// Every (collective, dtype, op) over every size. Returns the number of failing elements (all ranks).
static double run_check(void) {
    Comm *world = comm_world();
    int n = comm_size(world), me = comm_rank(world);
    size_t sizes[N_CHECK_SIZES];
    int n_sizes = check_sizes(n, sizes);
    char list[256] = "";
    for (int i = 0, used = 0; i < n_sizes; i++)
        used += snprintf(list + used, sizeof list - (size_t)used, "%s%zu", i ? " " : "", sizes[i]);
    log_info("collectives --check: %d ranks, seed %lld, counts %s%s", n, opt.seed, list,
             opt.tol_scale != 1 ? " (tolerance scaled by --tol-scale)" : "");
    log_info("rules: bits = bit-identical; value = equal numbers (+0 and -0 may differ in sign);");
    log_info("       tol = |ring - built-in| <= N*eps*sum_r|x_r| (avg: (N+1)/N*eps*sum_r|x_r|), chunk N-1 bit-identical");
    log_info("%-15s %-8s %-4s %-5s %10s %8s %6s %12s %12s %12s  %s", "collective", "dtype", "op", "rule", "elements",
             "differ", "zeros", "max_abs_err", "max_rel_err", "max_err/tol", "result");
    double failures = 0;
    const CommDtype dtypes[] = {COMM_FLOAT32, COMM_FLOAT64, COMM_INT32};
    for (int col = ALL_REDUCE; col <= ALL_GATHER; col++) {
        for (int d = 0; d < 3; d++) {
            for (int op = COMM_SUM; op <= COMM_MAX; op++) {
                if (dtypes[d] == COMM_INT32 && op == COMM_AVG) continue;  // AVG needs a float dtype
                if (col == ALL_GATHER && op != COMM_SUM) continue;        // all-gather has no op
                Stats st = {0};
                for (int s = 0; s < n_sizes; s++)
                    run_case(&(Case){(Collective)col, dtypes[d], (CommReduceOp)op, sizes[s], n, me}, &st);
                double sums[4] = {st.elements, st.differ, st.zero_signs, st.failures};
                double maxes[3] = {st.max_abs, st.max_rel, st.max_ratio};
                comm_all_reduce(world, sums, 4, COMM_FLOAT64, COMM_SUM);
                comm_all_reduce(world, maxes, 3, COMM_FLOAT64, COMM_MAX);
                failures += sums[3];
                log_info("%-15s %-8s %-4s %-5s %10.0f %8.0f %6.0f %12.3g %12.3g %12.3g  %s", COLLECTIVE_NAMES[col],
                         DTYPE_NAMES[dtypes[d]], col == ALL_GATHER ? "-" : OP_NAMES[op],
                         RULE_NAMES[case_rule((Collective)col, dtypes[d], (CommReduceOp)op, n)], sums[0], sums[1],
                         sums[2], maxes[0], maxes[1], maxes[2], sums[3] ? "FAIL" : "ok");
            }
        }
    }
    failures += run_nan_check(sizes, n_sizes);
    if (failures)
        log_info("collectives --check: %.0f elements FAILED on %d ranks (the lines above name them)", failures, n);
    else
        log_info("collectives --check: all passed on %d ranks", n);
    return failures;
}

// ================================================================================================
// --bench
// ================================================================================================

// nccl-tests' bus bandwidth factor (its doc/PERFORMANCE.md): what each rank's link must carry
// per byte of the operation's size S, for the best possible algorithm.
static double busbw_factor(Collective collective, int n) {
    return collective == ALL_REDUCE ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
}

// big: the whole tensor (all-reduce's buffer, reduce-scatter's input, all-gather's output);
// small: one rank's block. count as comm.h takes it.
static void run_once(Collective collective, bool ring, void *big, void *small, size_t count) {
    Comm *w = comm_world();
    switch (collective) {
    case ALL_REDUCE: (ring ? ring_all_reduce : comm_all_reduce)(w, big, count, COMM_FLOAT32, COMM_SUM); break;
    case REDUCE_SCATTER:
        (ring ? ring_reduce_scatter : comm_reduce_scatter)(w, big, small, count, COMM_FLOAT32, COMM_SUM);
        break;
    case ALL_GATHER: (ring ? ring_all_gather : comm_all_gather)(w, small, big, count, COMM_FLOAT32); break;
    }
}

// Seconds per operation: each rank's mean over --iters operations (after --warmup untimed ones,
// started together after a barrier), then the slowest rank's, since an operation is done only
// when every rank is done.
static double time_collective(Collective collective, bool ring, void *big, void *small, size_t count) {
    Comm *world = comm_world();
    for (int i = 0; i < opt.warmup; i++) run_once(collective, ring, big, small, count);
    comm_barrier(world);
    long long start = now_ns();
    for (int i = 0; i < opt.iters; i++) run_once(collective, ring, big, small, count);
    double seconds = (double)(now_ns() - start) * 1e-9 / opt.iters;
    comm_all_reduce(world, &seconds, 1, COMM_FLOAT64, COMM_MAX);
    return seconds;
}

static void run_bench(void) {
    int n = comm_size(comm_world());
    size_t max_elements = (size_t)opt.max_bytes / sizeof(float);
    size_t small_bytes = (max_elements / (size_t)n + 1) * sizeof(float);
    float *big = checked_malloc(max_elements * sizeof(float)), *small = checked_malloc(small_bytes);
    // Zeros: the in-place all-reduce sums the buffer into itself again and again, and zeros stay
    // finite (ones would reach inf after ~128 sums on 2 ranks). Writing them also maps every page
    // before the clock starts.
    memset(big, 0, max_elements * sizeof(float));
    memset(small, 0, small_bytes);
    log_info("collectives --bench: %d ranks, float32 sum, %d warmup + %d timed operations per size;", n, opt.warmup,
             opt.iters);
    log_info("# time = mean per operation, slowest rank; size S = the whole tensor in bytes (nccl-tests);");
    log_info("# algbw = S / time, busbw = algbw * factor, in GB/s (1e9 bytes/s); count = the call's count argument");
    for (int col = ALL_REDUCE; col <= ALL_GATHER; col++) {
        log_info("#");
        log_info("# %s: busbw factor %s = %.4f", COLLECTIVE_NAMES[col], col == ALL_REDUCE ? "2(N-1)/N" : "(N-1)/N",
                 busbw_factor((Collective)col, n));
        log_info("# %-13s %12s %11s | %-32s | %-32s", "", "", "", "ring", "built-in");
        log_info("# %-13s %12s %11s | %10s %10s %10s | %10s %10s %10s", "collective", "size(B)", "count", "time(us)",
                 "algbw", "busbw", "time(us)", "algbw", "busbw");
        for (long long size = opt.min_bytes; size <= opt.max_bytes; size *= opt.factor) {
            // Whole elements, and for reduce-scatter and all-gather whole blocks of N (nccl-tests
            // rounds the same way): S is what actually moves.
            size_t count = (size_t)size / sizeof(float) / (col == ALL_REDUCE ? 1 : (size_t)n);
            size_t bytes = count * sizeof(float) * (col == ALL_REDUCE ? 1 : (size_t)n);
            if (count == 0) continue;
            double t_ring = time_collective((Collective)col, true, big, small, count);
            double t_builtin = time_collective((Collective)col, false, big, small, count);
            double alg_ring = (double)bytes / t_ring * 1e-9, alg_builtin = (double)bytes / t_builtin * 1e-9;
            double factor = busbw_factor((Collective)col, n);
            log_info("  %-13s %12zu %11zu | %10.2f %10.4g %10.4g | %10.2f %10.4g %10.4g", COLLECTIVE_NAMES[col], bytes,
                     count, t_ring * 1e6, alg_ring, alg_ring * factor, t_builtin * 1e6, alg_builtin,
                     alg_builtin * factor);
        }
    }
    free(small);
    free(big);
}

// ================================================================================================
// --trace
// ================================================================================================

// A few ring all-reduces, then one built-in all-reduce for comparison, recorded on every rank and
// merged by rank 0 into one file (as the trainer does: clocks aligned first, then trace_init).
// With CommOptions.trace on, the comm stream also records its transfers on "comm:world".
static void run_trace(const char *path) {
    Comm *world = comm_world();
    int n = comm_size(world), me = comm_rank(world);
    size_t count = (size_t)opt.trace_bytes / sizeof(float);
    float *buf = checked_malloc(count * sizeof(float));
    fill_input(buf, COMM_FLOAT32, me, count);
    trace_align_clocks(world);
    char label[32];
    snprintf(label, sizeof label, "rank %d", me);
    trace_init(me, label);
    for (int i = 0; i < opt.trace_iters; i++) ring_all_reduce(world, buf, count, COMM_FLOAT32, COMM_AVG);
    comm_all_reduce(world, buf, count, COMM_FLOAT32, COMM_AVG);
    bool written = trace_gather_and_write(world, path, NULL);
    trace_shutdown();
    free(buf);
    if (!written) fatal("could not write the trace to %s", path);
    log_info("trace written to %s: %d ring all-reduces of %zu bytes on %d ranks, %d steps each (one flow per step"
             " and rank), then one built-in all-reduce; open it at https://ui.perfetto.dev",
             path, opt.trace_iters, count * sizeof(float), n, 2 * (n - 1));
}

int main(int argc, char **argv) {
    args_parse(FLAGS, N_FLAGS, argc, argv, "collectives",
               "Chapter 1: ring all-reduce, reduce-scatter and all-gather from point-to-point transfers, checked "
               "and timed against the built-in collectives. Run under mpirun.");
    if (!opt.check && !opt.bench && !opt.trace) fatal_input("nothing to do: give --check, --bench and/or --trace FILE");
    // A setting of a mode that does not run would be ignored: refused (each one's help names its mode).
    static const struct {
        const char *flag, *mode;
    } settings[] = {{"seed", "check"},  {"tol-scale", "check"}, {"min-bytes", "bench"},   {"max-bytes", "bench"},
                    {"factor", "bench"}, {"iters", "bench"},     {"warmup", "bench"},      {"trace-bytes", "trace"},
                    {"trace-iters", "trace"}};
    for (size_t i = 0; i < sizeof settings / sizeof settings[0]; i++)
        if (args_given(FLAGS, N_FLAGS, settings[i].flag) && !args_given(FLAGS, N_FLAGS, settings[i].mode))
            fatal_input("--%s: a setting of --%s, which this run does not do", settings[i].flag, settings[i].mode);
    if (opt.min_bytes % 4 || opt.max_bytes % 4 || opt.trace_bytes % 4)
        fatal_input("--min-bytes, --max-bytes and --trace-bytes: whole float32s, multiples of 4 (%lld, %lld, %lld)",
                    opt.min_bytes, opt.max_bytes, opt.trace_bytes);
    if (opt.min_bytes > opt.max_bytes)
        fatal_input("--min-bytes %lld: must not exceed --max-bytes %lld", opt.min_bytes, opt.max_bytes);
    fileio_check_output("trace", opt.trace, OUTPUT_FILE);  // now, not after the run

    comm_init(&argc, &argv, &(CommOptions){.trace = opt.trace != NULL});
    double failures = opt.check ? run_check() : 0;
    if (opt.bench) run_bench();
    if (opt.trace) run_trace(opt.trace);
    comm_finalize();
    return failures ? 1 : 0;
}
