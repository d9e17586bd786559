// schedule.h: pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as per-rank lists of actions.
//
// Stages. The model is cut into S = p * v stages: p pipeline ranks, v virtual stages (chunks) per
// rank. Stage s lives on rank s % p as its chunk s / p (Megatron's round-robin layout): with
// p = 4, v = 2, rank 0 holds stages 0 and 4, rank 1 stages 1 and 5, ... so every micro-batch goes
// round the ranks v times. With v = 1, rank r holds stage r.
//
// Actions. A schedule is, for each rank, the ordered list of what it does in one optimizer step:
//   FORWARD  (mb, s)  run stage s forward on micro-batch mb
//   BACKWARD (mb, s)  run it backward
//   SEND_ACT (mb, s)  send stage s's output to the rank of stage s + 1
//   RECV_ACT (mb, s)  receive stage s's input from the rank of stage s - 1
//   SEND_GRAD(mb, s)  send the gradient of stage s's input to the rank of stage s - 1
//   RECV_GRAD(mb, s)  receive the gradient of stage s's output from the rank of stage s + 1
// `stage` is always the stage of the rank holding the list, `peer` the pp rank at the other end.
// Stages that follow each other on one rank (only when p = 1) hand tensors over in memory: no
// transfer actions.
//
// The three schedules differ only in the order of the computes on each rank:
//   GPipe        all m forwards, then all m backwards (m micro-batches in flight)
//   1F1B         p - 1 - r forwards to fill the pipe, then one forward, one backward, ..., then the
//                remaining backwards (at most p - r micro-batches in flight on rank r)
//   Interleaved  1F1B over the v chunks (Megatron's order: micro-batches in groups of p, the
//                forwards of a group visit chunk 0, 1, ..., the backwards chunk v-1, ..., 0)
// Where the transfers go is one rule for all three: each rank's list is its actions in the order
// of the ideal timeline (forward 1 time unit, backward 2, transfers instant): a send right after
// the compute that produced it, a receive at the moment its data is sent. Both ends of every
// transfer then stand at the same point of the timeline, which is what makes the lists below
// deadlock-free (pp_validate checks it).
//
// The executor (pipeline.c) runs a list and nothing else, with these rules:
//   1. consecutive transfers in a list (those between two computes) are ONE comm_batch_start:
//      every Isend and Irecv posted, then all of them waited for together;
//   2. the comm stream runs batches one at a time, each to completion, in list order;
//   3. a compute waits for the batch that received its input; sends are waited for later.
// A batch completes once the peer has posted the matching transfer of each of its transfers (no
// message is assumed small enough to be buffered). pp_validate simulates exactly this.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef enum { PP_FORWARD, PP_BACKWARD, PP_SEND_ACT, PP_RECV_ACT, PP_SEND_GRAD, PP_RECV_GRAD } PpActionKind;

typedef struct {
    PpActionKind kind;
    int microbatch;
    int stage;  // virtual stage, 0..S-1, held by this rank
    int peer;   // pp rank at the other end of a transfer; -1 for FORWARD and BACKWARD
} PpAction;

typedef struct {
    PpAction *items;
    int count, capacity;
} PpActionList;

typedef enum { PP_GPIPE, PP_1F1B, PP_INTERLEAVED_1F1B } PpScheduleKind;
#define PP_SCHEDULE_NAMES "GPipe|1F1B|Interleaved1F1B"  // in enum order (the --pp-schedule choices)
const char *pp_schedule_name(PpScheduleKind kind);
// The kind called `name` (one of PP_SCHEDULE_NAMES); false if there is none.
bool pp_schedule_parse(const char *name, PpScheduleKind *kind);

// Every rank's list: ranks[r] for r in 0..p-1.
typedef struct {
    PpScheduleKind kind;
    int p, m, v;
    PpActionList *ranks;
} PpSchedule;

static inline int pp_rank_of_stage(int stage, int p) { return stage % p; }
static inline int pp_chunk_of_stage(int stage, int p) { return stage / p; }
static inline int pp_stage_of(int rank, int chunk, int p) { return chunk * p + rank; }
static inline bool pp_is_compute(PpActionKind k) { return k == PP_FORWARD || k == PP_BACKWARD; }

// NULL if (kind, p, m, v) can be scheduled, else the rule it breaks (a constant string):
// p, m, v >= 1; GPipe and 1F1B have v = 1; Interleaved1F1B needs m to be a multiple of p.
const char *pp_schedule_check(PpScheduleKind kind, int p, int m, int v);
// A valid choice worth a word (NULL: none): Interleaved1F1B with v = 1 interleaves nothing.
const char *pp_schedule_note(PpScheduleKind kind, int v);

// The list of rank `rank` (pure functions of their arguments). Return NULL and fill *out (which
// the caller frees with pp_action_list_free), or return the broken rule and leave *out empty.
const char *pp_gpipe(int p, int m, int rank, PpActionList *out);
const char *pp_one_f_one_b(int p, int m, int rank, PpActionList *out);
const char *pp_interleaved_1f1b(int p, int m, int v, int rank, PpActionList *out);

// All ranks' lists of a schedule (pp_schedule_free frees them); same return convention.
const char *pp_schedule_build(PpScheduleKind kind, int p, int m, int v, PpSchedule *out);
void pp_schedule_free(PpSchedule *s);
void pp_action_list_free(PpActionList *l);
void pp_action_list_push(PpActionList *l, PpAction a);

// Checks a schedule, all ranks' lists together (s->kind is not used: any lists can be checked):
//  - every (mb, stage) is forwarded and backwarded exactly once, on the rank holding the stage,
//    with exactly the transfers its neighbours need, each naming the right peer;
//  - on each rank: a forward after its input (its RECV_ACT, or the forward of stage - 1 when that
//    stage is on the same rank); a backward after its own forward and after its output gradient
//    (its RECV_GRAD, or the backward of stage + 1 on the same rank); a RECV_GRAD after the
//    forward it belongs to (it lands in that forward's activations); a send after the compute
//    producing what it sends;
//  - the k-th message rank a sends to rank b is the k-th one b receives from a, for every pair
//    (so MPI's in-order matching pairs the right buffers, and the flows in the trace are right);
//  - no deadlock under the executor's rules above: a step-by-step simulation of every rank's
//    comm stream, where a batch completes once each of its transfers' partners is posted, must
//    run every list to its end.
// Returns true if all hold; otherwise false, with the first violation in err ("rank 1, action 7
// (F2s1): ..."). in_flight (p entries, may be NULL) receives, per rank, the most (micro-batch,
// stage) pairs whose forward has run and whose backward has not: the activations a rank holds.
bool pp_validate(const PpSchedule *s, int *in_flight, char *err, size_t err_len);

// The ideal bubble fraction of valid lists: run every list with forward = 1, backward = 2 time
// units and instant transfers (a receive waits for its send); 1 - busy / (p * makespan), the idle
// share of p ranks over the whole step. GPipe and 1F1B give (p-1)/(m+p-1), interleaved
// (p-1)/(v*m+p-1): a bubble of (p-1)/m, resp. (p-1)/(v*m), of the useful time.
double pp_bubble_fraction(const PpSchedule *s);

// "F3s1", "B0s4", "SA3s1" (send act), "RA", "SG", "RG": microbatch, then stage.
void pp_action_format(const PpAction *a, char *buf, size_t len);
// The list as one line of formatted actions separated by spaces (buf is always terminated).
void pp_action_list_format(const PpActionList *l, char *buf, size_t len);

// Graphviz: one row per rank (a cluster with rank=same), its actions as nodes in list order;
// blue edges carry activations from a send to its receive, red edges gradients. Forwards and
// backwards are coloured by chunk. Render with `dot -Tsvg file.dot -o file.svg`.
void pp_schedule_write_dot(const PpSchedule *s, FILE *out);
// The same into path, written atomically; exits with status 1 if it cannot be written.
void pp_schedule_write_dot_file(const PpSchedule *s, const char *path);
