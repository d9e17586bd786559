// ring.c: the ring collectives of ring.h, on top of comm_sendrecv alone (one send to the right
// neighbour and one receive from the left per step, queued together so neither waits for the other).
#include "ring.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/trace.h"

// Every ring message carries this tag. One tag is enough: the comm stream runs one transfer at a
// time, and MPI delivers the messages between two ranks in the order they were sent.
#define RING_TAG 1
// trace_flow_id() takes world ranks below this.
#define MAX_FLOW_RANKS 4096

static int mod(int a, int n) { return ((a % n) + n) % n; }

size_t ring_chunk_begin(size_t count, int n, int k) {
    // floor(k * count / n) without overflowing k * count: count = q * n + rem.
    size_t q = count / (size_t)n, rem = count % (size_t)n;
    return q * (size_t)k + rem * (size_t)k / (size_t)n;
}

static size_t chunk_len(size_t count, int n, int k) {
    return ring_chunk_begin(count, n, k + 1) - ring_chunk_begin(count, n, k);
}

// Element i of buf, as a byte pointer.
static char *at(const void *buf, CommDtype dtype, size_t i) { return (char *)buf + comm_bytes(dtype, i); }

// Scratch space, kept from one call to the next and grown when a call needs more. Allocating a few
// MiB afresh on every call gets new pages from the kernel each time (glibc maps large blocks
// directly), and faulting them in doubled the time of a 4 MiB all-reduce in --bench. Ring
// collectives run on one thread, so one buffer serves them all.
static void *scratch(size_t bytes) {
    static void *buf;
    static size_t size;
    if (bytes > size) {
        free(buf);
        buf = malloc(bytes);
        if (!buf) fatal("ring: out of memory (%zu bytes of scratch)", bytes);
        size = bytes;
    }
    return buf;
}

// ================================================================================================
// The reduction of one chunk: dst = first (op) second, element by element
// ================================================================================================

// dst may be first or second itself (the in-place all-reduce): each element depends only on the
// same element of the inputs. One loop per op: with the op tested inside a single loop, GCC 12 did
// not vectorize it, and summing 512K floats took 195 us instead of 89 on this machine. MAX lets a
// NaN win (as comm.c does), so an overflow on one rank is never hidden; on a tie it keeps `first`,
// which only shows for +0 against -0.
#define DEFINE_COMBINE(NAME, T, ADD_T, IS_NAN)                                         \
    static void NAME(T *dst, const T *first, const T *second, size_t len, bool max) { \
        if (max) {                                                                     \
            for (size_t i = 0; i < len; i++) {                                         \
                T a = first[i], b = second[i];                                         \
                dst[i] = b > a || IS_NAN(b) ? b : a;                                   \
            }                                                                          \
        } else {                                                                       \
            for (size_t i = 0; i < len; i++) dst[i] = (T)((ADD_T)first[i] + (ADD_T)second[i]); \
        }                                                                              \
    }
#define NEVER_NAN(x) false
DEFINE_COMBINE(combine_f32, float, float, isnan)
DEFINE_COMBINE(combine_f64, double, double, isnan)
DEFINE_COMBINE(combine_i32, int32_t, uint32_t, NEVER_NAN)  // unsigned addition: an overflow wraps

// AVG reduces like SUM and divides once at the end (divide_chunk).
static void combine(void *dst, const void *first, const void *second, size_t len, CommDtype dtype, CommReduceOp op) {
    bool max = op == COMM_MAX;
    switch (dtype) {
    case COMM_FLOAT32: combine_f32(dst, first, second, len, max); break;
    case COMM_FLOAT64: combine_f64(dst, first, second, len, max); break;
    case COMM_INT32: combine_i32(dst, first, second, len, max); break;
    case COMM_BYTE: fatal("ring: bytes cannot be reduced");
    }
}

static void divide_chunk(void *buf, size_t len, CommDtype dtype, int n) {
    for (size_t i = 0; i < len; i++) {
        if (dtype == COMM_FLOAT32) ((float *)buf)[i] /= (float)n;
        if (dtype == COMM_FLOAT64) ((double *)buf)[i] /= (double)n;
    }
}

// Misuse is a bug in the caller: it ends the run with exit status 1, as comm.c does.
static void check_reduce(const char *name, CommDtype dtype, CommReduceOp op) {
    if (op != COMM_SUM && op != COMM_AVG && op != COMM_MAX) fatal("ring: %s: unknown reduce op %d", name, (int)op);
    if (dtype != COMM_FLOAT32 && dtype != COMM_FLOAT64 && dtype != COMM_INT32)
        fatal("ring: %s: dtype %d cannot be reduced", name, (int)dtype);
    if (op == COMM_AVG && dtype == COMM_INT32) fatal("ring: %s: AVG needs a float dtype, not INT32", name);
}

static void check_buffers(const char *name, const Comm *c, const void *send, const void *recv, size_t count) {
    if (count > SIZE_MAX / (size_t)comm_size(c)) fatal("ring: %s: %zu elements x %d ranks overflow", name, count, comm_size(c));
    if (count && (!send || !recv)) fatal("ring: %s on group %s: NULL buffer for %zu elements", name, comm_name(c), count);
}

// ================================================================================================
// One step: send a chunk right, receive one from the left, as a trace slice with its flows
// ================================================================================================

// Messages this process has sent to / received from each world rank through the ring, counted
// whether or not a trace is being recorded: the two ends of a message count it at the same
// position, which names its flow. Ring collectives run on the calling thread only.
static uint32_t sent_to[MAX_FLOW_RANKS], received_from[MAX_FLOW_RANKS];

static uint64_t next_flow_seq(uint32_t *counter, int world_rank) {
    if (world_rank >= MAX_FLOW_RANKS) return 0;
    return RING_FLOW_SEQ0 + counter[world_rank]++ % RING_FLOW_SEQ0;
}

typedef struct {
    Comm *c;
    CommDtype dtype;
    const char *phase;  // "reduce-scatter" or "all-gather"
    int step;
    int send_chunk, recv_chunk;
} Step;

// Opens the step's slice on "ring", with its args and both flow ends, and returns the track for
// trace_end(). When no trace is being recorded every trace_* call returns at once.
static int step_begin(const Step *s, size_t send_len) {
    int me = comm_world_rank_of(s->c, comm_rank(s->c)), n = comm_size(s->c);
    int right = comm_world_rank_of(s->c, (comm_rank(s->c) + 1) % n);
    int left = comm_world_rank_of(s->c, mod(comm_rank(s->c) - 1, n));
    uint64_t out_seq = next_flow_seq(sent_to, right), in_seq = next_flow_seq(received_from, left);
    if (!trace_enabled()) return 0;
    int track = trace_track("ring");
    char name[48];
    snprintf(name, sizeof name, "%s %d", s->phase, s->step);
    trace_begin(track, name, "ring");
    trace_arg_int(track, "step", s->step);
    trace_arg_str(track, "phase", s->phase);
    trace_arg_int(track, "chunk", s->send_chunk);
    trace_arg_int(track, "recv_chunk", s->recv_chunk);
    trace_arg_int(track, "bytes", (int64_t)comm_bytes(s->dtype, send_len));
    trace_arg_int(track, "peer", right);
    trace_arg_int(track, "from", left);
    if (me < MAX_FLOW_RANKS && right < MAX_FLOW_RANKS && left < MAX_FLOW_RANKS) {
        trace_flow_out(track, trace_flow_id(me, right, out_seq));
        trace_flow_in(track, trace_flow_id(left, me, in_seq));
    }
    return track;
}

// Sends send_len elements to the right neighbour while receiving recv_len from the left one.
static void exchange(const Step *s, const void *send, size_t send_len, void *recv, size_t recv_len) {
    int n = comm_size(s->c), me = comm_rank(s->c);
    comm_sendrecv(s->c, send, send_len, (me + 1) % n, recv, recv_len, mod(me - 1, n), s->dtype, RING_TAG);
}

// The slice around a whole collective: "ring all_reduce" with what it moves.
static int collective_begin(const char *name, const Comm *c, size_t count, size_t bytes) {
    if (!trace_enabled()) return 0;
    int track = trace_track("ring");
    char slice[48];
    snprintf(slice, sizeof slice, "ring %s", name);
    trace_begin(track, slice, "collective");
    trace_arg_str(track, "group", comm_name(c));
    trace_arg_int(track, "ranks", comm_size(c));
    trace_arg_int(track, "count", (int64_t)count);
    trace_arg_int(track, "bytes", (int64_t)bytes);  // the whole tensor, nccl-tests' "size"
    return track;
}

// ================================================================================================
// The two passes
// ================================================================================================

// Reduce-scatter over the chunks of `in` (chunk k = elements [ring_chunk_begin(total, n, k), ...)).
// On return `out` (the length of chunk `me`) holds chunk `me` reduced over every rank. `in` is only
// read, so `out` may be chunk `me` of `in` itself (the in-place all-reduce).
//
// Two scratch buffers of the largest chunk take turns: one holds the partial being sent, the other
// receives the next one. At step s the partial received from the left covers the ranks from
// (chunk + 1) up to (me - 1); this rank's contribution goes after it, so that every chunk is
// combined in the order it travels. Rank 0 is the exception: what reaches it has come round from
// the higher ranks, so its own (lowest) contribution goes first. That keeps the rank-order fold
// wherever a chunk's path allows it (ring.h: N = 2 and chunk N - 1).
static void reduce_scatter_pass(Comm *c, const void *in, size_t total, void *out, CommDtype dtype, CommReduceOp op) {
    int n = comm_size(c), me = comm_rank(c);
    size_t largest = comm_bytes(dtype, chunk_len(total, n, 0) + 1);  // chunk sizes differ by at most one
    char *partial = scratch(2 * largest), *incoming = partial + largest;
    // LAB ring: N-1 steps; at step s send chunk (me-s-1) (your own data at s = 0, then the partial you received) to the right, receive chunk (me-s-2) from the left with exchange(), combine it with your own copy of that chunk (rank 0: its own first), into out at the last step
    LAB_HOLE("ring", "N-1 steps; at step s send chunk (me-s-1) (your own data at s = 0, then the partial you received) to the right, receive chunk (me-s-2) from the left with exchange(), combine it with your own copy of that chunk (rank 0: its own first), into out at the last step");
    // END LAB
}

// All-gather in place: chunk `me` of buf is this rank's; on return every chunk is filled.
static void all_gather_pass(Comm *c, void *buf, size_t total, CommDtype dtype) {
    int n = comm_size(c), me = comm_rank(c);
    // LAB ring: N-1 steps; at step s send chunk (me-s) of buf to the right and receive chunk (me-s-1) from the left into its place in buf (exchange(), step_begin/trace_end around it)
    LAB_HOLE("ring", "N-1 steps; at step s send chunk (me-s) of buf to the right and receive chunk (me-s-1) from the left into its place in buf (exchange(), step_begin/trace_end around it)");
    // END LAB
}

// ================================================================================================
// The collectives
// ================================================================================================

// buf (count): reduce-scatter leaves chunk `me` reduced (and divided, for AVG) in place; the
// all-gather then hands every rank every reduced chunk. 2(N - 1) steps.
void ring_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op) {
    check_reduce("all_reduce", dtype, op);
    check_buffers("all_reduce", c, buf, buf, count);
    int n = comm_size(c), me = comm_rank(c);
    int track = collective_begin("all_reduce", c, count, comm_bytes(dtype, count));
    void *mine = at(buf, dtype, ring_chunk_begin(count, n, me));
    reduce_scatter_pass(c, buf, count, mine, dtype, op);
    if (op == COMM_AVG) divide_chunk(mine, chunk_len(count, n, me), dtype, n);
    all_gather_pass(c, buf, count, dtype);
    trace_end(track);
}

// send (count * N) is N chunks of exactly `count`; recv (count) gets chunk `me`. N - 1 steps.
void ring_reduce_scatter(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype, CommReduceOp op) {
    check_reduce("reduce_scatter", dtype, op);
    check_buffers("reduce_scatter", c, send, recv, count);
    int n = comm_size(c);
    size_t total = count * (size_t)n;
    int track = collective_begin("reduce_scatter", c, count, comm_bytes(dtype, total));
    if (n == 1)
        memcpy(recv, send, comm_bytes(dtype, count));  // nothing to reduce with
    else
        reduce_scatter_pass(c, send, total, recv, dtype, op);
    if (op == COMM_AVG) divide_chunk(recv, count, dtype, n);
    trace_end(track);
}

// recv (count * N): this rank's send goes into block `me`, then N - 1 steps fill the others.
void ring_all_gather(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype) {
    check_buffers("all_gather", c, send, recv, count);
    int n = comm_size(c), me = comm_rank(c);
    size_t total = count * (size_t)n;
    int track = collective_begin("all_gather", c, count, comm_bytes(dtype, total));
    void *mine = at(recv, dtype, ring_chunk_begin(total, n, me));
    if (count && mine != send) memmove(mine, send, comm_bytes(dtype, count));
    all_gather_pass(c, recv, total, dtype);
    trace_end(track);
}
