// Chapter 7: the pipeline schedules as pure functions. Hand-derived lists for small cases, the
// validator on every small (p, m, v) and on deliberately broken lists, in-flight counts, and the
// simulated bubble against the formulas.
//
// How the tables were derived (schedule.h): take the schedule's compute order, run it on the ideal
// timeline (forward 1, backward 2; a compute starts when its rank is free and its input has been
// sent), then list each rank's actions by time: a send at the end of its compute, a receive at the
// time of its send; at equal times transfers before computes, and otherwise the order compute-wise.
// Example, 1F1B p=2 m=4, rank 1 (the last stage): F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] ...; rank 0
// sends activation 1 at time 2, so RA1s1 (time 2) comes before B0s1 (time 2, a compute).
#include <string.h>

#include "chapters/07_pipeline_parallel/schedule.h"
#include "test_util.h"

#define LINE 4096

// Megatron's interleaved order, p=2 v=2 (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3), m=4:
//   rank 0 computes F0s0 F1s0 F0s2 F1s2 (warm-up 2(p-1-r) + (v-1)p = 4) F2s0 B0s2 F3s0 B1s2 F2s2 B0s0
//   F3s2 B1s0 B2s2 B3s2 B2s0 B3s0; rank 1 (warm-up 2) F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 ...
// On the timeline rank 0 starts them at 0 1 2 3 4 6 8 9 11 12 14 15 18 21 23 25, rank 1 at
// 1 2 3 4 6 7 9 10 12 13 15 16 18 19 21 23.
// One rank (p = 1): no transfers; the chunks hand over in memory, in Megatron's order.
static const struct {
    PpScheduleKind kind;
    int p, m, v;
    const char *ranks[4];
} TABLES[] = {
    {PP_GPIPE, 2, 2, 1, {"F0s0 SA0s0 F1s0 SA1s0 RG0s0 B0s0 RG1s0 B1s0", "RA0s1 F0s1 RA1s1 F1s1 B0s1 SG0s1 B1s1 SG1s1"}},
    {PP_1F1B, 2, 4, 1,
     {"F0s0 SA0s0 F1s0 SA1s0 RG0s0 B0s0 F2s0 SA2s0 RG1s0 B1s0 F3s0 SA3s0 RG2s0 B2s0 RG3s0 B3s0",
      "RA0s1 F0s1 RA1s1 B0s1 SG0s1 F1s1 B1s1 SG1s1 RA2s1 F2s1 B2s1 SG2s1 RA3s1 F3s1 B3s1 SG3s1"}},
    {PP_1F1B, 4, 4, 1,
     {"F0s0 SA0s0 F1s0 SA1s0 F2s0 SA2s0 F3s0 SA3s0 RG0s0 B0s0 RG1s0 B1s0 RG2s0 B2s0 RG3s0 B3s0",
      "RA0s1 F0s1 SA0s1 RA1s1 F1s1 SA1s1 RA2s1 F2s1 SA2s1 RA3s1 RG0s1 B0s1 SG0s1 F3s1 SA3s1 RG1s1 B1s1 SG1s1 "
      "RG2s1 B2s1 SG2s1 RG3s1 B3s1 SG3s1",
      "RA0s2 F0s2 SA0s2 RA1s2 F1s2 SA1s2 RA2s2 RG0s2 B0s2 SG0s2 F2s2 SA2s2 RG1s2 B1s2 SG1s2 RA3s2 F3s2 SA3s2 "
      "RG2s2 B2s2 SG2s2 RG3s2 B3s2 SG3s2",
      "RA0s3 F0s3 RA1s3 B0s3 SG0s3 F1s3 B1s3 SG1s3 RA2s3 F2s3 B2s3 SG2s3 RA3s3 F3s3 B3s3 SG3s3"}},
    {PP_INTERLEAVED_1F1B, 2, 4, 2,
     {"F0s0 SA0s0 F1s0 SA1s0 RA0s2 F0s2 SA0s2 RA1s2 F1s2 SA1s2 F2s0 SA2s0 RG0s2 B0s2 SG0s2 F3s0 SA3s0 RG1s2 "
      "B1s2 RA2s2 SG1s2 F2s2 SA2s2 RG0s0 B0s0 RA3s2 F3s2 SA3s2 RG1s0 B1s0 RG2s2 B2s2 SG2s2 RG3s2 B3s2 SG3s2 "
      "RG2s0 B2s0 RG3s0 B3s0",
      "RA0s1 F0s1 SA0s1 RA1s1 F1s1 SA1s1 RA0s3 F0s3 RA1s3 B0s3 RA2s1 SG0s3 F1s3 B1s3 RG0s1 SG1s3 RA3s1 F2s1 "
      "SA2s1 B0s1 RG1s1 SG0s1 RA2s3 F3s1 SA3s1 B1s1 SG1s1 RA3s3 F2s3 B2s3 SG2s3 F3s3 B3s3 RG2s1 SG3s3 B2s1 "
      "SG2s1 RG3s1 B3s1 SG3s1"}},
    {PP_GPIPE, 1, 2, 1, {"F0s0 F1s0 B0s0 B1s0"}},
    {PP_INTERLEAVED_1F1B, 1, 2, 2, {"F0s0 F0s1 B0s1 F1s0 B0s0 F1s1 B1s1 B1s0"}},
};

// Each rank's list from the per-rank functions, against the table.
START_TEST(test_hand_derived_lists) {
    for (size_t k = 0; k < sizeof TABLES / sizeof TABLES[0]; k++) {
        PpScheduleKind kind = TABLES[k].kind;
        int p = TABLES[k].p, m = TABLES[k].m, v = TABLES[k].v;
        for (int r = 0; r < p; r++) {
            PpActionList l;
            const char *err = kind == PP_GPIPE  ? pp_gpipe(p, m, r, &l)
                              : kind == PP_1F1B ? pp_one_f_one_b(p, m, r, &l)
                                                : pp_interleaved_1f1b(p, m, v, r, &l);
            ck_assert_msg(!err, "%s p=%d m=%d v=%d: %s", pp_schedule_name(kind), p, m, v, err);
            char got[LINE];
            pp_action_list_format(&l, got, sizeof got);
            ck_assert_msg(strcmp(got, TABLES[k].ranks[r]) == 0, "%s p=%d m=%d v=%d rank %d:\n  got  %s\n  want %s",
                          pp_schedule_name(kind), p, m, v, r, got, TABLES[k].ranks[r]);
            pp_action_list_free(&l);
        }
    }
}
END_TEST

START_TEST(test_invalid_combinations) {
    PpActionList l;
    ck_assert_ptr_nonnull(pp_interleaved_1f1b(4, 6, 2, 0, &l));  // m not a multiple of p
    ck_assert_int_eq(l.count, 0);
    ck_assert_ptr_nonnull(pp_gpipe(0, 4, 0, &l));
    ck_assert_ptr_nonnull(pp_one_f_one_b(2, 0, 0, &l));
    ck_assert_ptr_nonnull(pp_schedule_check(PP_1F1B, 2, 4, 2));  // virtual stages only interleaved
    ck_assert_ptr_null(pp_schedule_check(PP_INTERLEAVED_1F1B, 2, 4, 1));
    PpSchedule s;
    ck_assert_ptr_nonnull(pp_schedule_build(PP_INTERLEAVED_1F1B, 3, 4, 2, &s));
    ck_assert_ptr_null(s.ranks);
}
END_TEST

// What the in-flight counts must be: GPipe keeps all m; 1F1B min(p - r, m); interleaved its
// warm-up + 1, capped at the m v (micro-batch, chunk) pairs.
static int expected_in_flight(PpScheduleKind kind, int p, int m, int v, int r) {
    if (kind == PP_GPIPE) return m;
    if (kind == PP_1F1B) return p - r < m ? p - r : m;
    int total = m * v, warmup = m == p ? total : 2 * (p - 1 - r) + (v - 1) * p;
    return warmup + 1 < total ? warmup + 1 : total;
}

START_TEST(test_every_small_schedule_is_valid) {
    int checked = 0;
    for (int kind = 0; kind < 3; kind++)
        for (int p = 1; p <= 4; p++)
            for (int m = 1; m <= 8; m++)
                for (int v = 1; v <= 3; v++) {
                    PpSchedule s;
                    if (pp_schedule_build((PpScheduleKind)kind, p, m, v, &s)) continue;  // not a valid combination
                    int in_flight[4];
                    char err[512];
                    ck_assert_msg(pp_validate(&s, in_flight, err, sizeof err), "%s p=%d m=%d v=%d: %s",
                                  pp_schedule_name(s.kind), p, m, v, err);
                    for (int r = 0; r < p; r++)
                        ck_assert_msg(in_flight[r] == expected_in_flight(s.kind, p, m, v, r),
                                      "%s p=%d m=%d v=%d rank %d: %d in flight, expected %d", pp_schedule_name(s.kind),
                                      p, m, v, r, in_flight[r], expected_in_flight(s.kind, p, m, v, r));
                    // The ideal bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved.
                    double bubble = pp_bubble_fraction(&s), formula = (double)(p - 1) / (v * m + p - 1);
                    ck_assert_msg(fabs(bubble - formula) < 1e-12, "%s p=%d m=%d v=%d: simulated bubble %.6f, "
                                  "formula %.6f", pp_schedule_name(s.kind), p, m, v, bubble, formula);
                    pp_schedule_free(&s);
                    checked++;
                }
    // GPipe and 1F1B: 4 x 8 each; interleaved: m a multiple of p, 3 values of v: (8 + 4 + 2 + 2) x 3
    ck_assert_int_eq(checked, 32 + 32 + 48);
}
END_TEST

// The lecture's example: 4 stages, 4 micro-batches, best utilisation 16/28.
START_TEST(test_lecture_example) {
    PpSchedule s;
    ck_assert_ptr_null(pp_schedule_build(PP_GPIPE, 4, 4, 1, &s));
    ck_assert_double_eq_tol(1 - pp_bubble_fraction(&s), 16.0 / 28.0, 1e-12);
    pp_schedule_free(&s);
}
END_TEST

// ---- broken lists: each must be rejected with its rule ---------------------------------------------

static PpSchedule build(PpScheduleKind kind, int p, int m, int v) {
    PpSchedule s;
    const char *err = pp_schedule_build(kind, p, m, v, &s);
    ck_assert_msg(!err, "%s", err ? err : "");
    return s;
}

static void expect_invalid(const PpSchedule *s, const char *want) {
    char err[512];
    ck_assert_msg(!pp_validate(s, NULL, err, sizeof err), "accepted a broken schedule (wanted: %s)", want);
    ck_assert_msg(strstr(err, want), "error \"%s\" does not say \"%s\"", err, want);
}

static void move_action(PpActionList *l, int from, int to) {
    PpAction a = l->items[from];
    if (from < to) memmove(&l->items[from], &l->items[from + 1], sizeof(PpAction) * (size_t)(to - from));
    else memmove(&l->items[to + 1], &l->items[to], sizeof(PpAction) * (size_t)(from - to));
    l->items[to] = a;
}

static int find(const PpActionList *l, const char *name) {
    for (int i = 0; i < l->count; i++) {
        char got[48];
        pp_action_format(&l->items[i], got, sizeof got);
        if (strcmp(got, name) == 0) return i;
    }
    ck_abort_msg("%s not in the list", name);
    return -1;
}

// An action moved to where another one stands (or to the front), and the error that must follow.
static const struct {
    PpScheduleKind kind;
    int p, m, rank;
    const char *move, *to;  // to: NULL = the front of the list
    const char *want;
} MOVES[] = {
    // rank 1 of 1F1B p=2 m=4 is RA0s1 F0s1 RA1s1 B0s1 ...: backward before its forward
    {PP_1F1B, 2, 4, 1, "B0s1", "F0s1", "rank 1, action 1 (B0s1): its forward (F0s1) comes later"},
    // rank 1 of GPipe p=2 m=2 is RA0s1 F0s1 RA1s1 F1s1 ...: a forward before its receive
    {PP_GPIPE, 2, 2, 1, "RA1s1", "F1s1", "(F1s1): its input (RA1s1) comes later"},
    // both receives early, in the wrong order: each forward still follows its receive, but the first
    // message rank 0 sends (activation 0) would land in micro-batch 1's buffer
    {PP_GPIPE, 2, 2, 1, "RA1s1", NULL, "receives rank 0's message SA0s0"},
};

START_TEST(test_rejects_misordered_lists) {
    for (size_t k = 0; k < sizeof MOVES / sizeof MOVES[0]; k++) {
        PpSchedule s = build(MOVES[k].kind, MOVES[k].p, MOVES[k].m, 1);
        PpActionList *l = &s.ranks[MOVES[k].rank];
        move_action(l, find(l, MOVES[k].move), MOVES[k].to ? find(l, MOVES[k].to) : 0);
        expect_invalid(&s, MOVES[k].want);
        pp_schedule_free(&s);
    }
}
END_TEST

START_TEST(test_rejects_missing_transfer) {
    PpSchedule s = build(PP_GPIPE, 2, 2, 1);
    PpActionList *l = &s.ranks[0];
    int i = find(l, "SA1s0");
    memmove(&l->items[i], &l->items[i + 1], sizeof(PpAction) * (size_t)(l->count - i - 1));
    l->count--;
    expect_invalid(&s, "SA1s0 is missing");
    pp_schedule_free(&s);
}
END_TEST

START_TEST(test_rejects_repeated_or_misplaced_actions) {
    PpSchedule s = build(PP_GPIPE, 2, 2, 1);
    s.ranks[0].items[find(&s.ranks[0], "F1s0")].microbatch = 0;
    expect_invalid(&s, "repeats action 0");
    pp_schedule_free(&s);
    s = build(PP_GPIPE, 2, 2, 1);
    s.ranks[0].items[find(&s.ranks[0], "SA0s0")].peer = 0;
    expect_invalid(&s, "peer 0, expected 1");
    pp_schedule_free(&s);
    s = build(PP_GPIPE, 2, 2, 1);
    s.ranks[0].items[find(&s.ranks[0], "F1s0")].stage = 1;
    expect_invalid(&s, "stage 1 lives on rank 1");
    pp_schedule_free(&s);
}
END_TEST

// The interleaved lists with every transfer placed next to its compute (receive just before, send
// just after) have the right data flow but deadlock: ranks 0 and 1 each post a gradient send to the
// other before the receive the other one's send is waiting for. This is why the lists follow the
// timeline instead.
START_TEST(test_rejects_deadlock) {
    PpSchedule s = build(PP_INTERLEAVED_1F1B, 2, 4, 2);
    for (int r = 0; r < s.p; r++) {
        PpActionList *l = &s.ranks[r], adjacent = {0};
        for (int i = 0; i < l->count; i++) {
            PpAction c = l->items[i];
            if (!pp_is_compute(c.kind)) continue;
            for (int j = 0; j < l->count; j++) {  // the transfer feeding c goes just before it
                PpAction t = l->items[j];
                bool feeds = t.microbatch == c.microbatch && t.stage == c.stage &&
                             (t.kind == (c.kind == PP_FORWARD ? PP_RECV_ACT : PP_RECV_GRAD));
                if (feeds) pp_action_list_push(&adjacent, t);
            }
            pp_action_list_push(&adjacent, c);
            for (int j = 0; j < l->count; j++) {  // the one it produces just after
                PpAction t = l->items[j];
                bool sends = t.microbatch == c.microbatch && t.stage == c.stage &&
                             (t.kind == (c.kind == PP_FORWARD ? PP_SEND_ACT : PP_SEND_GRAD));
                if (sends) pp_action_list_push(&adjacent, t);
            }
        }
        ck_assert_int_eq(adjacent.count, l->count);
        pp_action_list_free(l);
        *l = adjacent;
    }
    expect_invalid(&s, "deadlock: its batch waits for rank");
    pp_schedule_free(&s);
}
END_TEST

START_TEST(test_dot_output) {
    PpSchedule s = build(PP_INTERLEAVED_1F1B, 2, 2, 2);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    pp_schedule_write_dot(&s, f);
    fclose(f);
    ck_assert_msg(strstr(text, "subgraph cluster_rank1") && strstr(text, "rank=same"), "%s", text);
    ck_assert_msg(strstr(text, "label=\"F1s2\""), "%s", text);
    // one edge per message: 2 micro-batches x 3 stage boundaries x (activation + gradient)
    int edges = 0;
    for (char *at = text; (at = strstr(at, "constraint=false")); at++) edges++;
    ck_assert_int_eq(edges, 12);
    free(text);
    pp_schedule_free(&s);
}
END_TEST

int main(void) {
    Suite *s = suite_create("pipeline schedules");
    TCase *tc = tcase_create("schedules");
    tcase_add_test(tc, test_hand_derived_lists);
    tcase_add_test(tc, test_invalid_combinations);
    tcase_add_test(tc, test_every_small_schedule_is_valid);
    tcase_add_test(tc, test_lecture_example);
    tcase_add_test(tc, test_rejects_misordered_lists);
    tcase_add_test(tc, test_rejects_missing_transfer);
    tcase_add_test(tc, test_rejects_repeated_or_misplaced_actions);
    tcase_add_test(tc, test_rejects_deadlock);
    tcase_add_test(tc, test_dot_output);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
