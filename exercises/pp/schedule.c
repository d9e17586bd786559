#include "chapters/07_pipeline_parallel/schedule.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/log.h"

static const char *const SCHEDULE_NAMES[] = {"GPipe", "1F1B", "Interleaved1F1B"};

const char *pp_schedule_name(PpScheduleKind kind) { return SCHEDULE_NAMES[kind]; }

bool pp_schedule_parse(const char *name, PpScheduleKind *kind) {
    for (int k = 0; k < 3; k++)
        if (strcmp(name, SCHEDULE_NAMES[k]) == 0) return *kind = (PpScheduleKind)k, true;
    return false;
}

const char *pp_schedule_check(PpScheduleKind kind, int p, int m, int v) {
    if (p < 1 || m < 1 || v < 1) return "pipeline ranks, micro-batches and virtual stages must all be >= 1";
    if (kind != PP_INTERLEAVED_1F1B && v != 1) return "only Interleaved1F1B runs more than one virtual stage per rank";
    if (kind == PP_INTERLEAVED_1F1B && m % p != 0)
        return "Interleaved1F1B needs the micro-batches to be a multiple of the pipeline ranks (Megatron's rule: "
               "they go round the ranks in groups of p)";
    return NULL;
}

const char *pp_schedule_note(PpScheduleKind kind, int v) {
    if (kind == PP_INTERLEAVED_1F1B && v == 1)
        return "Interleaved1F1B with one virtual stage per rank interleaves nothing (2 or more virtual stages do)";
    return NULL;
}

// ---- lists ------------------------------------------------------------------------------------------

void pp_action_list_push(PpActionList *l, PpAction a) {
    if (l->count == l->capacity) {
        l->capacity = l->capacity ? 2 * l->capacity : 16;
        l->items = realloc(l->items, sizeof(PpAction) * (size_t)l->capacity);
        if (!l->items) fatal("pp: out of memory for an action list");
    }
    l->items[l->count++] = a;
}

void pp_action_list_free(PpActionList *l) {
    free(l->items);
    memset(l, 0, sizeof *l);
}

void pp_schedule_free(PpSchedule *s) {
    for (int r = 0; s->ranks && r < s->p; r++) pp_action_list_free(&s->ranks[r]);
    free(s->ranks);
    s->ranks = NULL;
}

// n zeroed elements (and one spare, so that n = 0 is a valid buffer); exits on failure.
static void *zeroed(int n, size_t size) {
    void *x = n >= 0 ? calloc((size_t)n + 1, size) : NULL;
    if (!x) fatal("pp: cannot allocate %d elements of %zu bytes", n, size);
    return x;
}

static int n_stages(const PpSchedule *s) { return s->p * s->v; }

// Is the neighbour of `stage` on the other side (+1 or -1) on another rank? (It always is for p > 1.)
static bool remote_neighbour(int stage, int step, int S, int p) {
    int other = stage + step;
    return other >= 0 && other < S && pp_rank_of_stage(other, p) != pp_rank_of_stage(stage, p);
}

static PpAction action(PpActionKind kind, int mb, int stage, int peer) { return (PpAction){kind, mb, stage, peer}; }

// ---- the compute order of each schedule ---------------------------------------------------------------

static void push_compute(PpActionList *l, PpActionKind kind, int mb, int stage) {
    pp_action_list_push(l, action(kind, mb, stage, -1));
}

static void gpipe_order(int m, int rank, PpActionList *out) {
    for (int mb = 0; mb < m; mb++) push_compute(out, PP_FORWARD, mb, rank);
    for (int mb = 0; mb < m; mb++) push_compute(out, PP_BACKWARD, mb, rank);
}

// Warm-up: rank r runs p - 1 - r forwards before its first backward, the number of micro-batches
// that must enter the pipe before the first one comes back to it. Then one forward, one backward.
static void one_f_one_b_order(int p, int m, int rank, PpActionList *out) {
    // LAB pp: rank r: warm-up of min(p - 1 - r, m) forwards, then one forward and one backward (oldest micro-batch first) until every forward is in, then the remaining backwards (push_compute, stage = rank)
    LAB_HOLE("pp", "rank r: warm-up of min(p - 1 - r, m) forwards, then one forward and one backward (oldest micro-batch first) until every forward is in, then the remaining backwards (push_compute, stage = rank)");
    // END LAB
}

// Megatron-LM's interleaved schedule (forward_backward_pipelining_with_interleaving). The k-th
// forward of a rank runs micro-batch (k / (p v)) p + k % p on chunk (k mod p v) / p: groups of p
// micro-batches through chunk 0, then the same group through chunk 1, ... The k-th backward takes
// the same micro-batch, on the chunks in reverse. Warm-up: 2 (p - 1 - r) + (v - 1) p forwards (all
// of them when m == p), then one forward, one backward, then the remaining backwards.
static void push_interleaved(PpActionList *out, PpActionKind kind, int k, int p, int v, int rank) {
    int mb = (k / (p * v)) * p + k % p, chunk = (k % (p * v)) / p;
    push_compute(out, kind, mb, pp_stage_of(rank, kind == PP_FORWARD ? chunk : v - 1 - chunk, p));
}

static void interleaved_order(int p, int m, int v, int rank, PpActionList *out) {
    int total = m * v;
    int warmup = m == p ? total : 2 * (p - 1 - rank) + (v - 1) * p;
    if (warmup > total) warmup = total;
    for (int k = 0; k < warmup; k++) push_interleaved(out, PP_FORWARD, k, p, v, rank);
    for (int k = 0; k < total - warmup; k++) {
        push_interleaved(out, PP_FORWARD, warmup + k, p, v, rank);
        push_interleaved(out, PP_BACKWARD, k, p, v, rank);
    }
    for (int k = total - warmup; k < total; k++) push_interleaved(out, PP_BACKWARD, k, p, v, rank);
}

static void compute_order(PpScheduleKind kind, int p, int m, int v, int rank, PpActionList *out) {
    if (kind == PP_GPIPE) gpipe_order(m, rank, out);
    else if (kind == PP_1F1B) one_f_one_b_order(p, m, rank, out);
    else interleaved_order(p, m, v, rank, out);
}

// The compute order with each transfer next to its compute: the receive of a compute's input just
// before it, the send of its output just after. Correct data flow, but not yet deadlock-free for
// every schedule (interleaved: two ranks can each send before receiving from the other).
static void with_adjacent_transfers(const PpActionList *order, int p, int S, PpActionList *out) {
    for (int i = 0; i < order->count; i++) {
        PpAction c = order->items[i];
        int mb = c.microbatch, st = c.stage, back = (st + p - 1) % p, next = (st + 1) % p;
        bool with_back = remote_neighbour(st, -1, S, p), with_next = remote_neighbour(st, +1, S, p);
        if (c.kind == PP_FORWARD) {
            if (with_back) pp_action_list_push(out, action(PP_RECV_ACT, mb, st, back));
            pp_action_list_push(out, c);
            if (with_next) pp_action_list_push(out, action(PP_SEND_ACT, mb, st, next));
        } else {
            if (with_next) pp_action_list_push(out, action(PP_RECV_GRAD, mb, st, next));
            pp_action_list_push(out, c);
            if (with_back) pp_action_list_push(out, action(PP_SEND_GRAD, mb, st, back));
        }
    }
}

// ---- indexing every action of a schedule by (kind, micro-batch, stage) ------------------------------

#define N_KINDS 6

static size_t key(const PpSchedule *s, PpActionKind kind, int mb, int stage) {
    return ((size_t)kind * (size_t)s->m + (size_t)mb) * (size_t)n_stages(s) + (size_t)stage;
}

static int *new_table(const PpSchedule *s, int fill) {
    size_t n = (size_t)N_KINDS * (size_t)s->m * (size_t)n_stages(s);
    int *t = malloc(sizeof(int) * n);
    if (!t) fatal("pp: out of memory");
    for (size_t i = 0; i < n; i++) t[i] = fill;
    return t;
}

// The action a transfer pairs with: SEND_ACT(mb, s) with RECV_ACT(mb, s+1), SEND_GRAD(mb, s) with
// RECV_GRAD(mb, s-1), and back.
static PpAction partner_of(const PpAction *a, int p) {
    static const PpActionKind kinds[] = {[PP_SEND_ACT] = PP_RECV_ACT, [PP_RECV_ACT] = PP_SEND_ACT,
                                         [PP_SEND_GRAD] = PP_RECV_GRAD, [PP_RECV_GRAD] = PP_SEND_GRAD};
    int step = a->kind == PP_SEND_ACT || a->kind == PP_RECV_GRAD ? 1 : -1;
    return action(kinds[a->kind], a->microbatch, a->stage + step, pp_rank_of_stage(a->stage, p));
}

static bool is_send(PpActionKind k) { return k == PP_SEND_ACT || k == PP_SEND_GRAD; }
static bool is_recv(PpActionKind k) { return k == PP_RECV_ACT || k == PP_RECV_GRAD; }

// ---- the ideal timeline: forward 1, backward 2, instant transfers -------------------------------------

enum { FORWARD_TIME = 1, BACKWARD_TIME = 2 };

typedef struct {
    int **at;        // at[r][i]: compute start, send time, or for a receive the time its data was sent
    int makespan;
    long busy;       // compute time of all ranks together
} Timeline;

static void timeline_free(Timeline *t, int p) {
    for (int r = 0; t->at && r < p; r++) free(t->at[r]);
    free(t->at);
    t->at = NULL;
}

// When the inputs of compute a are there (the time they were sent, or computed on this rank), or -1
// while one is missing. done[] holds the time each compute finished and each send was sent.
static int ready_time(const PpSchedule *s, const int *done, const PpAction *a) {
    int S = n_stages(s), mb = a->microbatch, st = a->stage, deps[2] = {0, 0};
    if (a->kind == PP_FORWARD && st > 0)
        deps[0] = done[key(s, remote_neighbour(st, -1, S, s->p) ? PP_SEND_ACT : PP_FORWARD, mb, st - 1)];
    if (a->kind == PP_BACKWARD) {
        deps[0] = done[key(s, PP_FORWARD, mb, st)];
        if (st + 1 < S)
            deps[1] = done[key(s, remote_neighbour(st, +1, S, s->p) ? PP_SEND_GRAD : PP_BACKWARD, mb, st + 1)];
    }
    if (deps[0] < 0 || deps[1] < 0) return -1;
    return deps[0] > deps[1] ? deps[0] : deps[1];
}

// Runs every rank's list on its own clock, as the executor does: a compute starts when its rank is
// free and its input has been sent; sends are instant; a receive does not hold the rank up (only
// the compute that needs it waits), and its time is that of its send. False if some rank can never
// go on (a compute whose input is never produced).
static bool simulate(const PpSchedule *s, Timeline *t) {
    int p = s->p, *pos = zeroed(p, sizeof(int)), *clock = zeroed(p, sizeof(int));
    int *done = new_table(s, -1);
    t->at = zeroed(p, sizeof(int *));
    t->makespan = 0, t->busy = 0;
    for (int r = 0; r < p; r++) t->at[r] = zeroed(s->ranks[r].count, sizeof(int));
    bool progress = true, finished = false;
    while (progress && !finished) {
        progress = false, finished = true;
        for (int r = 0; r < p; r++) {
            for (; pos[r] < s->ranks[r].count; pos[r]++) {
                const PpAction *a = &s->ranks[r].items[pos[r]];
                int *slot = &done[key(s, a->kind, a->microbatch, a->stage)];
                if (pp_is_compute(a->kind)) {
                    int ready = ready_time(s, done, a), cost = a->kind == PP_FORWARD ? FORWARD_TIME : BACKWARD_TIME;
                    if (ready < 0) break;
                    int start = clock[r] > ready ? clock[r] : ready;
                    t->at[r][pos[r]] = start, clock[r] = *slot = start + cost, t->busy += cost;
                } else if (is_send(a->kind)) {
                    t->at[r][pos[r]] = *slot = clock[r];
                }
                progress = true;
            }
            finished &= pos[r] == s->ranks[r].count;
            if (clock[r] > t->makespan) t->makespan = clock[r];
        }
    }
    for (int r = 0; r < p && finished; r++)  // each receive at the time of its send
        for (int i = 0; i < s->ranks[r].count; i++) {
            const PpAction *a = &s->ranks[r].items[i];
            if (is_recv(a->kind)) {
                PpAction send = partner_of(a, p);
                t->at[r][i] = done[key(s, send.kind, send.microbatch, send.stage)];
            }
        }
    free(pos), free(clock), free(done);
    if (!finished) timeline_free(t, p);
    return finished;
}

double pp_bubble_fraction(const PpSchedule *s) {
    Timeline t;
    if (!simulate(s, &t)) fatal("pp_bubble_fraction: the lists cannot run to their end (validate them first)");
    timeline_free(&t, s->p);
    return t.makespan ? 1.0 - (double)t.busy / ((double)s->p * t.makespan) : 0.0;
}

// ---- placing the transfers: each list in the order of the ideal timeline -------------------------

typedef struct {
    int time, is_compute, index;
    PpAction a;
} TimedAction;

static int by_time(const void *x, const void *y) {
    const TimedAction *a = x, *b = y;
    if (a->time != b->time) return a->time < b->time ? -1 : 1;
    if (a->is_compute != b->is_compute) return a->is_compute - b->is_compute;  // transfers first
    return a->index - b->index;
}

static void sort_by_timeline(const PpActionList *l, const int *at, PpActionList *out) {
    TimedAction *ta = malloc(sizeof(TimedAction) * (size_t)(l->count + 1));
    for (int i = 0; i < l->count; i++) ta[i] = (TimedAction){at[i], pp_is_compute(l->items[i].kind), i, l->items[i]};
    qsort(ta, (size_t)l->count, sizeof *ta, by_time);
    for (int i = 0; i < l->count; i++) pp_action_list_push(out, ta[i].a);
    free(ta);
}

const char *pp_schedule_build(PpScheduleKind kind, int p, int m, int v, PpSchedule *out) {
    memset(out, 0, sizeof *out);
    const char *err = pp_schedule_check(kind, p, m, v);
    if (err) return err;
    PpSchedule adjacent = {kind, p, m, v, zeroed(p, sizeof(PpActionList))};
    for (int r = 0; r < p; r++) {
        PpActionList order = {0};
        compute_order(kind, p, m, v, r, &order);
        with_adjacent_transfers(&order, p, p * v, &adjacent.ranks[r]);
        pp_action_list_free(&order);
    }
    Timeline t;
    if (!simulate(&adjacent, &t))
        fatal("pp: the %s compute order for p=%d m=%d v=%d cannot run", pp_schedule_name(kind), p, m, v);
    *out = (PpSchedule){kind, p, m, v, zeroed(p, sizeof(PpActionList))};
    for (int r = 0; r < p; r++) sort_by_timeline(&adjacent.ranks[r], t.at[r], &out->ranks[r]);
    timeline_free(&t, p);
    pp_schedule_free(&adjacent);
    return NULL;
}

// One rank's list. The placement needs every rank's timeline, so the whole schedule is built and
// this rank's list kept: p lists of O(m v) actions, nothing next to a training step.
static const char *build_rank(PpScheduleKind kind, int p, int m, int v, int rank, PpActionList *out) {
    memset(out, 0, sizeof *out);
    PpSchedule s;
    const char *err = pp_schedule_build(kind, p, m, v, &s);
    if (err) return err;
    if (rank < 0 || rank >= p) fatal("pp: rank %d of %d pipeline ranks", rank, p);
    *out = s.ranks[rank];
    s.ranks[rank] = (PpActionList){0};
    pp_schedule_free(&s);
    return NULL;
}

const char *pp_gpipe(int p, int m, int rank, PpActionList *out) {
    return build_rank(PP_GPIPE, p, m, 1, rank, out);
}
const char *pp_one_f_one_b(int p, int m, int rank, PpActionList *out) {
    return build_rank(PP_1F1B, p, m, 1, rank, out);
}
const char *pp_interleaved_1f1b(int p, int m, int v, int rank, PpActionList *out) {
    return build_rank(PP_INTERLEAVED_1F1B, p, m, v, rank, out);
}

// ---- formatting ---------------------------------------------------------------------------------

void pp_action_format(const PpAction *a, char *buf, size_t len) {
    static const char *const prefix[] = {"F", "B", "SA", "RA", "SG", "RG"};
    snprintf(buf, len, "%s%ds%d", prefix[a->kind], a->microbatch, a->stage);
}

void pp_action_list_format(const PpActionList *l, char *buf, size_t len) {
    size_t used = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < l->count && used + 1 < len; i++) {
        char one[48];
        pp_action_format(&l->items[i], one, sizeof one);
        used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? " " : "", one);
    }
}

// ---- validation ---------------------------------------------------------------------------------

typedef struct {
    const PpSchedule *s;
    char *err;
    size_t err_len;
} Checker;

static bool fail(Checker *c, int rank, int index, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static bool fail(Checker *c, int rank, int index, const char *fmt, ...) {
    char what[48] = "";
    if (index >= 0) pp_action_format(&c->s->ranks[rank].items[index], what, sizeof what);
    int n = index >= 0 ? snprintf(c->err, c->err_len, "rank %d, action %d (%s): ", rank, index, what)
                       : snprintf(c->err, c->err_len, "rank %d: ", rank);
    va_list ap;
    va_start(ap, fmt);
    if (n >= 0 && (size_t)n < c->err_len) vsnprintf(c->err + n, c->err_len - (size_t)n, fmt, ap);
    va_end(ap);
    return false;
}

// The peer a transfer must name, or -1 if this stage has no such transfer.
static int expected_peer(const PpSchedule *s, const PpAction *a) {
    int S = n_stages(s), step = a->kind == PP_SEND_ACT || a->kind == PP_RECV_GRAD ? +1 : -1;
    return remote_neighbour(a->stage, step, S, s->p) ? pp_rank_of_stage(a->stage + step, s->p) : -1;
}

// Each action well formed and not repeated; where[] gets the index of each one in its rank's list.
static bool check_actions(Checker *c, int *where) {
    const PpSchedule *s = c->s;
    for (int r = 0; r < s->p; r++) {
        for (int i = 0; i < s->ranks[r].count; i++) {
            const PpAction *a = &s->ranks[r].items[i];
            if ((int)a->kind < 0 || a->kind >= N_KINDS) return fail(c, r, -1, "action %d has an unknown kind", i);
            if (a->microbatch < 0 || a->microbatch >= s->m || a->stage < 0 || a->stage >= n_stages(s))
                return fail(c, r, i, "micro-batch or stage out of range (m=%d, %d stages)", s->m, n_stages(s));
            int home = pp_rank_of_stage(a->stage, s->p);
            if (home != r) return fail(c, r, i, "stage %d lives on rank %d", a->stage, home);
            int peer = pp_is_compute(a->kind) ? -1 : expected_peer(s, a);
            if (!pp_is_compute(a->kind) && peer < 0) return fail(c, r, i, "this stage has no such transfer");
            if (a->peer != peer) return fail(c, r, i, "peer %d, expected %d", a->peer, peer);
            int *w = &where[key(s, a->kind, a->microbatch, a->stage)];
            if (*w >= 0) return fail(c, r, i, "repeats action %d", *w);
            *w = i;
        }
    }
    return true;
}

// Every (mb, stage) has its forward, backward and exactly the transfers its neighbours need.
static bool check_complete(Checker *c, const int *where) {
    const PpSchedule *s = c->s;
    for (int st = 0; st < n_stages(s); st++) {
        for (int mb = 0; mb < s->m; mb++) {
            for (int k = 0; k < N_KINDS; k++) {
                PpAction a = action((PpActionKind)k, mb, st, -1);
                bool needed = pp_is_compute(a.kind) || expected_peer(s, &a) >= 0;
                if (needed && where[key(s, a.kind, mb, st)] < 0) {
                    char what[48];
                    pp_action_format(&a, what, sizeof what);
                    return fail(c, pp_rank_of_stage(st, s->p), -1, "%s is missing", what);
                }
            }
        }
    }
    return true;
}

// `before` (if it exists: where >= 0, and it must when required) comes earlier in the same list.
static bool check_before(Checker *c, const int *where, int rank, int index, PpActionKind kind, int mb, int stage,
                         const char *what) {
    int i = where[key(c->s, kind, mb, stage)];
    if (i < 0 || i >= index) {
        char name[48];
        pp_action_format(&(PpAction){kind, mb, stage, -1}, name, sizeof name);
        return fail(c, rank, index, "%s (%s) %s", what, name, i < 0 ? "is not on this rank" : "comes later");
    }
    return true;
}

// What compute i needs from stage (its stage + step): the receive when that stage is on another
// rank, else that stage's compute of the same kind, earlier on this rank.
static bool check_neighbour_input(Checker *c, const int *where, int rank, int index, int step, const char *what) {
    const PpAction *a = &c->s->ranks[rank].items[index];
    int S = n_stages(c->s), st = a->stage;
    if (st + step < 0 || st + step >= S) return true;  // the first stage's input, the last one's gradient
    if (remote_neighbour(st, step, S, c->s->p))
        return check_before(c, where, rank, index, step < 0 ? PP_RECV_ACT : PP_RECV_GRAD, a->microbatch, st, what);
    return check_before(c, where, rank, index, a->kind, a->microbatch, st + step, what);
}

static bool check_order(Checker *c, const int *where) {
    const PpSchedule *s = c->s;
    for (int r = 0; r < s->p; r++) {
        for (int i = 0; i < s->ranks[r].count; i++) {
            const PpAction *a = &s->ranks[r].items[i];
            int mb = a->microbatch, st = a->stage;
            bool ok = true;
            switch (a->kind) {
            case PP_FORWARD: ok = check_neighbour_input(c, where, r, i, -1, "its input"); break;
            case PP_BACKWARD:
                ok = check_before(c, where, r, i, PP_FORWARD, mb, st, "its forward") &&
                     check_neighbour_input(c, where, r, i, +1, "its output gradient");
                break;
            case PP_RECV_GRAD: ok = check_before(c, where, r, i, PP_FORWARD, mb, st, "the forward it lands in"); break;
            case PP_SEND_ACT: ok = check_before(c, where, r, i, PP_FORWARD, mb, st, "the forward it sends"); break;
            case PP_SEND_GRAD: ok = check_before(c, where, r, i, PP_BACKWARD, mb, st, "the backward it sends"); break;
            case PP_RECV_ACT: break;  // may come any time before its forward
            }
            if (!ok) return false;
        }
    }
    return true;
}

// The messages from a to b, in a's order, are the receives on b from a, in b's order.
static bool check_pairing(Checker *c) {
    const PpSchedule *s = c->s;
    for (int a = 0; a < s->p; a++) {
        for (int b = 0; b < s->p; b++) {
            const PpActionList *la = &s->ranks[a], *lb = &s->ranks[b];
            int i = 0, j = 0;
            for (;;) {
                while (i < la->count && !(is_send(la->items[i].kind) && la->items[i].peer == b)) i++;
                while (j < lb->count && !(is_recv(lb->items[j].kind) && lb->items[j].peer == a)) j++;
                if (i == la->count || j == lb->count) break;
                PpAction want = partner_of(&la->items[i], s->p), got = lb->items[j];
                if (got.kind != want.kind || got.microbatch != want.microbatch || got.stage != want.stage) {
                    char sent[48], wanted[48];
                    pp_action_format(&la->items[i], sent, sizeof sent);
                    pp_action_format(&want, wanted, sizeof wanted);
                    return fail(c, b, j, "receives rank %d's message %s, which rank %d sends as %s (needs %s here)", a,
                                sent, a, sent, wanted);
                }
                i++, j++;
            }
        }
    }
    return true;  // counts agree: check_complete found every transfer's partner
}

// The executor's comm streams, step by step. Each rank's list is a sequence of items: a compute,
// or a batch (a run of consecutive transfers). A rank at a compute goes on (its inputs were
// received by earlier batches, which are complete); a rank at a batch has posted it, and goes on
// once every transfer in it has its partner posted: the partner's rank stands at (or has passed)
// the partner's batch. No transfer completes on its own (rendezvous: nothing is buffered).
static bool check_deadlock_free(Checker *c, const int *where) {
    const PpSchedule *s = c->s;
    int p = s->p, **item = zeroed(p, sizeof(int *)), *at = zeroed(p, sizeof(int));
    for (int r = 0; r < p; r++) {  // item[r][i]: the item action i belongs to; item[r][count]: past the end
        const PpActionList *l = &s->ranks[r];
        item[r] = zeroed(l->count, sizeof(int));
        int n = -1;
        for (int i = 0; i < l->count; i++) {
            bool joins = i > 0 && !pp_is_compute(l->items[i].kind) && !pp_is_compute(l->items[i - 1].kind);
            item[r][i] = joins ? n : ++n;
        }
        item[r][l->count] = n + 1;
    }
    bool progress = true, finished = false;
    while (progress && !finished) {
        progress = false, finished = true;
        for (int r = 0; r < p; r++) {
            const PpActionList *l = &s->ranks[r];
            while (at[r] < l->count) {  // at[r]: the first action of the rank's current item
                int end = at[r];
                bool matched = true;
                for (; end < l->count && item[r][end] == item[r][at[r]]; end++) {
                    if (pp_is_compute(l->items[end].kind)) continue;
                    PpAction q = partner_of(&l->items[end], p);
                    int peer = pp_rank_of_stage(q.stage, p);
                    matched &= item[peer][at[peer]] >= item[peer][where[key(s, q.kind, q.microbatch, q.stage)]];
                }
                if (!matched) break;
                at[r] = end;
                progress = true;
            }
            finished &= at[r] == l->count;
        }
    }
    for (int r = 0; r < p && !finished; r++) {  // name the first stuck transfer
        const PpActionList *l = &s->ranks[r];
        for (int i = at[r]; i < l->count && item[r][i] == item[r][at[r]]; i++) {
            PpAction q = partner_of(&l->items[i], p);
            int peer = pp_rank_of_stage(q.stage, p), pi = where[key(s, q.kind, q.microbatch, q.stage)];
            if (item[peer][at[peer]] >= item[peer][pi]) continue;
            char partner[48], peer_at[48];
            pp_action_format(&q, partner, sizeof partner);
            pp_action_format(&s->ranks[peer].items[at[peer]], peer_at, sizeof peer_at);
            fail(c, r, i, "deadlock: its batch waits for rank %d to post %s (its action %d), but rank %d is stuck at "
                 "action %d (%s)", peer, partner, pi, peer, at[peer], peer_at);
            r = p;
            break;
        }
    }
    for (int r = 0; r < p; r++) free(item[r]);
    free(item), free(at);
    return finished;
}

static void count_in_flight(const PpSchedule *s, int *in_flight) {
    for (int r = 0; r < s->p; r++) {
        int live = 0;
        in_flight[r] = 0;
        for (int i = 0; i < s->ranks[r].count; i++) {
            PpActionKind k = s->ranks[r].items[i].kind;
            live += k == PP_FORWARD ? 1 : k == PP_BACKWARD ? -1 : 0;
            if (live > in_flight[r]) in_flight[r] = live;
        }
    }
}

bool pp_validate(const PpSchedule *s, int *in_flight, char *err, size_t err_len) {
    Checker c = {s, err, err_len};
    if (err_len) err[0] = 0;
    if (s->p < 1 || s->m < 1 || s->v < 1 || !s->ranks) {
        snprintf(err, err_len, "p=%d m=%d v=%d: not a schedule", s->p, s->m, s->v);
        return false;
    }
    int *where = new_table(s, -1);
    bool ok = check_actions(&c, where) && check_complete(&c, where) && check_order(&c, where) && check_pairing(&c) &&
              check_deadlock_free(&c, where);
    free(where);
    if (ok && in_flight) count_in_flight(s, in_flight);
    return ok;
}

// ---- Graphviz -----------------------------------------------------------------------------------

// Forward blues and backward oranges, darker for later chunks.
static const char *fill_colour(const PpAction *a, int p) {
    static const char *const forward[] = {"#c6dbef", "#6baed6", "#2171b5", "#08306b"};
    static const char *const backward[] = {"#fdd0a2", "#fd8d3c", "#d94801", "#7f2704"};
    int chunk = pp_chunk_of_stage(a->stage, p) % 4;
    return a->kind == PP_FORWARD ? forward[chunk] : backward[chunk];
}

// Layout: each row is laid out left to right at x = time (DOT_INCH_PER_UNIT per time unit of the
// ideal timeline): invisible spacers fill the idle gaps, computes are boxes as wide as they last
// (less the room of the transfers that follow them), transfers are dots (names in the tooltip).
// Cross-row edges have weight 0 so they do not pull the rows out of shape.
#define DOT_INCH_PER_UNIT 0.55
#define DOT_NODESEP 0.02
#define DOT_POINT 0.05
#define DOT_MIN_BOX 0.34

static void dot_row(const PpSchedule *s, int r, const int *at, FILE *out) {
    const PpActionList *l = &s->ranks[r];
    fprintf(out, "  subgraph cluster_rank%d {\n    label=\"rank %d\"; labeljust=l; color=gray70; rank=same;\n", r, r);
    fprintf(out, "    r%d_start [style=invis, shape=point, width=%g];\n", r, DOT_POINT);
    double cursor = DOT_POINT;  // right edge of the last node, in inches from the row's start
    char previous[32];
    snprintf(previous, sizeof previous, "r%d_start", r);
    for (int i = 0; i < l->count; i++) {
        const PpAction *a = &l->items[i];
        char name[48], node[32];
        pp_action_format(a, name, sizeof name);
        double target = DOT_POINT + at[i] * DOT_INCH_PER_UNIT, gap = target - cursor - 2 * DOT_NODESEP;
        if (gap > 0.01) {  // idle time on this rank
            fprintf(out, "    r%d_gap%d [style=invis, shape=box, fixedsize=true, width=%.3f, label=\"\"];\n", r, i,
                    gap);
            fprintf(out, "    %s -> r%d_gap%d [style=invis];\n", previous, r, i);
            snprintf(previous, sizeof previous, "r%d_gap%d", r, i);
            cursor += gap + DOT_NODESEP;
        }
        snprintf(node, sizeof node, "r%d_%d", r, i);
        double width = DOT_POINT;
        if (pp_is_compute(a->kind)) {  // as long as it lasts, less the room of the transfers after it
            int dots = 0;
            while (i + 1 + dots < l->count && !pp_is_compute(l->items[i + 1 + dots].kind)) dots++;
            width = (a->kind == PP_FORWARD ? FORWARD_TIME : BACKWARD_TIME) * DOT_INCH_PER_UNIT - DOT_NODESEP -
                    dots * (DOT_POINT + DOT_NODESEP);
            if (width < DOT_MIN_BOX) width = DOT_MIN_BOX;  // room for the label; the next spacer catches up
            fprintf(out, "    %s [label=\"%s\", shape=box, fixedsize=true, width=%.3f, fillcolor=\"%s\"];\n", node,
                    name, width, fill_colour(a, s->p));
        } else {
            fprintf(out, "    %s [shape=point, width=%g, tooltip=\"%s\"];\n", node, DOT_POINT, name);
        }
        fprintf(out, "    %s -> %s [style=invis];\n", previous, node);
        snprintf(previous, sizeof previous, "%s", node);
        cursor += DOT_NODESEP + width;
    }
    fprintf(out, "  }\n");
}

void pp_schedule_write_dot(const PpSchedule *s, FILE *out) {
    Timeline t;
    if (!simulate(s, &t)) fatal("pp_schedule_write_dot: the lists cannot run to their end");
    char virtual_stages[32] = "";
    if (s->v > 1) snprintf(virtual_stages, sizeof virtual_stages, ", v=%d", s->v);
    fprintf(out, "// %s schedule: p=%d ranks, m=%d micro-batches, v=%d virtual stages. dot -Tsvg\n",
            pp_schedule_name(s->kind), s->p, s->m, s->v);
    fprintf(out, "digraph pipeline {\n  newrank=true; splines=line; nodesep=%g; ranksep=0.35;\n", DOT_NODESEP);
    fprintf(out, "  label=\"%s, p=%d, m=%d%s on the ideal timeline (forward 1, backward 2): bubble %.1f%% of %d time "
                 "units. F3s1: forward of micro-batch 3 on stage 1; dots: transfers; blue: activations, red: "
                 "gradients\";\n  labelloc=t; fontname=Helvetica; fontsize=12;\n"
                 "  node [fontname=Helvetica, fontsize=8, style=filled, height=0.28, color=gray40];\n",
            pp_schedule_name(s->kind), s->p, s->m, virtual_stages, 100.0 - 100.0 * t.busy / ((double)s->p * t.makespan),
            t.makespan);
    for (int r = 0; r < s->p; r++) dot_row(s, r, t.at[r], out);
    for (int r = 0; r + 1 < s->p; r++) fprintf(out, "  r%d_start -> r%d_start [style=invis, weight=100];\n", r, r + 1);
    int *where = new_table(s, -1);
    for (int r = 0; r < s->p; r++)
        for (int i = 0; i < s->ranks[r].count; i++) {
            const PpAction *a = &s->ranks[r].items[i];
            where[key(s, a->kind, a->microbatch, a->stage)] = i;
        }
    for (int r = 0; r < s->p; r++)
        for (int i = 0; i < s->ranks[r].count; i++) {
            const PpAction *a = &s->ranks[r].items[i];
            if (!is_send(a->kind)) continue;
            PpAction q = partner_of(a, s->p);
            int j = where[key(s, q.kind, q.microbatch, q.stage)];
            const char *colour = a->kind == PP_SEND_ACT ? "#2171b5" : "#cb181d";
            fprintf(out, "  r%d_%d -> r%d_%d [constraint=false, weight=0, penwidth=0.7, arrowsize=0.4, "
                         "color=\"%s\"];\n", r, i, a->peer, j, colour);
        }
    free(where);
    timeline_free(&t, s->p);
    fprintf(out, "}\n");
}

void pp_schedule_write_dot_file(const PpSchedule *s, const char *path) {
    char err[512];
    AtomicFile f;
    if (!atomic_create(&f, path, err, sizeof err)) fatal("pp_schedule_write_dot: %s", err);
    pp_schedule_write_dot(s, f.fp);
    if (!atomic_commit(&f, err, sizeof err)) fatal("pp_schedule_write_dot: %s", err);
}
