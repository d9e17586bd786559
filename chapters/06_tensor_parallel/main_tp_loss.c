// main_tp_loss.c: build/tp_loss, chapter 6's check of the vocab-parallel cross-entropy (tp.c) on
// inputs that training on the built-in data never produces. Every rank builds the same full logits
// and targets, keeps its slice of the vocabulary, and runs the loss the model would call
// (tp_install's loss_forward and loss_backward); the result must match cross_entropy_forward /
// cross_entropy_backward on the full logits, on every rank:
//   small   logits ~ U(-3, 3), a quarter of the targets IGNORE_INDEX
//   wide    logits ~ U(-1000, 1000): the max must be the group's true max (a max summed over the
//           ranks underflows every exp), targets ignored as above
//   shifted logits ~ 1000 + U(-5, 5): exp(logit) overflows without the max subtraction
//   far     logits ~ 1e5 + U(-5, 5): max + log(sum) formed in fp32 rounds at the max's scale (an
//           ulp of 1e5 is 0.008, a thousandth of the loss); the loss must keep them apart (tp.c)
//   ignored every target IGNORE_INDEX: the loss is 0, not 0/0
//   negative logits ~ -1000 + U(-5, 5): every logit below 0, so a max that starts from 0 instead of
//           -inf is wrong (every exp underflows: the loss comes out -inf)
// The mean loss must be taken over the valid targets only (the reference's), which the ignored
// targets of every case tell apart from a mean over all tokens.
//
//   mpirun --oversubscribe -np 4 ./build/tp_loss      (exits 1 on a mismatch, naming it)
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/06_tensor_parallel/tp.h"
#include "common/args.h"
#include "common/comm.h"
#include "common/log.h"
#include "reference_cpu/ops.h"
#include "tests/tolerances.h"

#define TOKENS 37  // not a multiple of anything in particular
#define VOCAB 60   // divides over 1, 2, 3, 4, 5 and 6 ranks

typedef enum { CASE_SMALL, CASE_WIDE, CASE_SHIFTED, CASE_FAR, CASE_IGNORED, CASE_NEGATIVE, N_CASES } Case;
static const char *CASE_NAMES[N_CASES] = {"small", "wide", "shifted", "far", "ignored", "negative"};

static uint64_t rng_state;
static double uniform(double lo, double hi) {  // same sequence on every rank
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

// logits (TOKENS, VOCAB) and targets (TOKENS) of a case, identical on every rank.
static void make_inputs(Case c, real *logits, int *targets) {
    rng_state = 12345 + (uint64_t)c;
    for (int i = 0; i < TOKENS * VOCAB; i++) {
        if (c == CASE_WIDE) logits[i] = (real)uniform(-1000, 1000);
        else if (c == CASE_SHIFTED) logits[i] = (real)(1000 + uniform(-5, 5));
        else if (c == CASE_FAR) logits[i] = (real)(1e5 + uniform(-5, 5));
        else if (c == CASE_NEGATIVE) logits[i] = (real)(-1000 + uniform(-5, 5));  // a max found from 0 is wrong
        else logits[i] = (real)uniform(-3, 3);
    }
    for (int n = 0; n < TOKENS; n++) {
        int t = (int)uniform(0, VOCAB);
        targets[n] = c == CASE_IGNORED || n % 4 == 1 ? IGNORE_INDEX : t;
    }
}

// |ours - ref| <= TP_LOSS_RTOL * max(|ref|, 1); prints the worst entry when it fails.
static int compare(const char *what, const char *case_name, const real *ours, const real *ref, int n) {
    double worst = 0;
    int at = 0;
    for (int i = 0; i < n; i++) {
        double err = fabs((double)ours[i] - ref[i]) / fmax(fabs((double)ref[i]), 1.0);
        if (!(err <= worst)) worst = err, at = i;  // NaN counts as worst
        if (isnan(err)) break;
    }
    if (worst <= TP_LOSS_RTOL) return 0;
    log_info("tp_loss: FAIL case %s: %s[%d] = %.9g, want %.9g (rel err %.3g > %g)", case_name, what, at,
             (double)ours[at], (double)ref[at], worst, TP_LOSS_RTOL);
    return 1;
}

static int run_case(Model *m, Case c) {
    int tp = comm_size(m->tp.ctx), rank = comm_rank(m->tp.ctx), v_count = VOCAB / tp, v_start = rank * v_count;
    real *logits = malloc(sizeof(real) * TOKENS * VOCAB), *local = malloc(sizeof(real) * TOKENS * v_count);
    real *stats_ref = malloc(sizeof(real) * 2 * TOKENS), *stats = malloc(sizeof(real) * 2 * TOKENS);
    real *dlogits_ref = malloc(sizeof(real) * TOKENS * VOCAB), *dlogits = malloc(sizeof(real) * TOKENS * v_count);
    // NaN where the gradient goes: the loss's backward writes every element (ignored rows 0), adding to none
    for (size_t i = 0; i < (size_t)TOKENS * VOCAB; i++) dlogits_ref[i] = NAN;
    for (size_t i = 0; i < (size_t)TOKENS * v_count; i++) dlogits[i] = NAN;
    real *dlogits_ref_local = malloc(sizeof(real) * TOKENS * v_count);
    int targets[TOKENS];
    make_inputs(c, logits, targets);
    for (int n = 0; n < TOKENS; n++)
        memcpy(local + (size_t)n * v_count, logits + (size_t)n * VOCAB + v_start, sizeof(real) * v_count);

    double loss_ref = cross_entropy_forward(stats_ref, logits, targets, TOKENS, VOCAB);
    cross_entropy_backward(dlogits_ref, logits, stats_ref, targets, TOKENS, VOCAB, 1.0);
    double loss = m->tp.loss_forward(m->tp.ctx, stats, local, targets, TOKENS, v_start, v_count);
    m->tp.loss_backward(m->tp.ctx, dlogits, local, stats, targets, TOKENS, v_start, v_count, 1.0);
    for (int n = 0; n < TOKENS; n++)
        memcpy(dlogits_ref_local + (size_t)n * v_count, dlogits_ref + (size_t)n * VOCAB + v_start, sizeof(real) * v_count);

    real loss_r = (real)loss, loss_ref_r = (real)loss_ref;
    int bad = compare("loss", CASE_NAMES[c], &loss_r, &loss_ref_r, 1);
    bad += compare("stats (max, log-sum)", CASE_NAMES[c], stats, stats_ref, 2 * TOKENS);
    bad += compare("dlogits", CASE_NAMES[c], dlogits, dlogits_ref_local, TOKENS * v_count);
    if (!bad) log_info("tp_loss: ok   case %-7s loss %.6f on %d ranks", CASE_NAMES[c], loss, tp);
    free(logits), free(local), free(stats_ref), free(stats), free(dlogits_ref), free(dlogits), free(dlogits_ref_local);
    return bad;
}

int main(int argc, char **argv) {
    args_parse(NULL, 0, argc, argv, "tp_loss",
               "Chapter 6: the vocab-parallel cross-entropy against the single process's on large logits and "
               "ignored targets. Run under mpirun (1 to 6 ranks).");
    comm_init(&argc, &argv, &(CommOptions){0});
    Comm *world = comm_world();
    if (VOCAB % comm_size(world)) fatal_input("%d ranks do not divide the vocabulary of %d", comm_size(world), VOCAB);
    Model m = {0};
    m.tp.size = comm_size(world), m.tp.rank = comm_rank(world);
    tp_install(&m, world, false);
    int failures = 0;
    for (Case c = 0; c < N_CASES; c++) failures += run_case(&m, c);
    comm_all_reduce(world, &failures, 1, COMM_INT32, COMM_SUM);
    if (failures) log_info("tp_loss: %d mismatches (the lines above name them)", failures);
    comm_finalize();
    return failures ? 1 : 0;
}
