// comm.c: the Open MPI backend of comm.h, and the comm stream that runs it.
//
// Threads. The main thread only queues operations and waits on them; one worker thread takes them
// in FIFO order and is the only thread that calls MPI between MPI_Init_thread and MPI_Finalize
// (comm_split and comm_free too, queued like the rest). MPI_THREAD_SERIALIZED is therefore enough,
// and it keeps Open MPI on its cheaper, lock-free paths.
//
// Every operation is posted with nonblocking MPI calls and polled with MPI_Test*, so a peer that
// never shows up ends the run with a message after the timeout instead of hanging it.
//
// Who did not arrive. Every member of a group runs the same collectives on it in the same order,
// so each Comm counts the collectives it has started: the k-th all-reduce of rank 0 is the k-th of
// every member. When collective k times out, the rank asks each member, on a private control
// communicator, how many it has started; a member at k or beyond has arrived, one below k has not,
// and one that does not answer within QUERY_GRACE_S is stopped (SIGSTOP), hung outside MPI or dead.
// The worker answers these questions whenever it polls, and every IDLE_TICK_NS while idle.
//
// Reductions never use MPI's own: each element is folded locally in rank order (x0 + x1 + ... +
// x(n-1)), which makes float sums bit-identical on every rank and in every run (COMM.md).
//
// Device buffers. An operation whose buffers the registered device backend calls device memory
// never reaches the worker: comm_start hands it to the backend (gpu/: NCCL, or staging through host
// memory), and the handle only carries the backend's own handle for comm_wait and comm_test.
#include "comm.h"

#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hash.h"
#include "log.h"
#include "trace.h"

#define DEFAULT_TIMEOUT_S COMM_STARTUP_TIMEOUT_S
#define QUERY_GRACE_S 2.0
#define IDLE_TICK_NS 10000000L  // an idle worker answers questions every 10 ms
#define TAG_QUERY 1
#define TAG_REPLY 2
// One MPI call moves at most this much: MPI counts are int, and Open MPI's datatype engine is
// safest well below 2 GiB.
#define MAX_CHUNK_BYTES ((size_t)1 << 30)

struct Comm {
    MPI_Comm mpi;
    char name[48];
    int rank, size;
    int *world_ranks;  // world rank of each member
    uint64_t id;       // the same on every member: a hash of the name and the world ranks
    uint64_t collectives_started;  // worker only; the arrival count the timeout report compares
    Comm *next_live;   // the live communicators, which the worker looks questions up in
    void *device_state;  // what the device backend's attach returned for this group (main thread)
};

typedef enum {
    OP_ALL_REDUCE, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST, OP_ALL_TO_ALL, OP_BARRIER, OP_P2P,
    OP_SPLIT, OP_FINALIZE, OP_FREE, OP_STOP
} OpKind;

// The operations every member of a group must run together, in the same order: they are counted
// (Comm.collectives_started) and their descriptors compared (see "Agreement" below).
static bool is_collective(OpKind kind) { return kind < OP_P2P || kind == OP_SPLIT || kind == OP_FINALIZE; }

struct CommHandle {
    OpKind kind;
    const char *name;  // "all_reduce", "send", ...: names the operation in messages and trace slices
    Comm *comm;
    const void *send;
    void *recv;  // also the in-place buffer of all_reduce and broadcast
    size_t count;
    CommDtype dtype;
    CommReduceOp reduce;
    int root;
    CommP2P *p2p;   // OP_P2P: the caller's list, copied
    uint64_t *seq;  // OP_P2P: the message number of each transfer between its two ranks (flows)
    int n_p2p;
    int color, key;  // OP_SPLIT
    char split_name[48];
    Comm *split_result;
    long long start_ns;  // when the worker began it (the timeout and the trace slice count from here)
    uint64_t collective_number;  // collectives: 1 for the first on its Comm (0 for point to point)
    bool done;           // under stream.lock
    CommHandle *next;
    // An operation on device buffers: the backend that runs it and its handle; never queued here.
    const CommDeviceBackend *backend;
    void *device_op;
};

static struct {
    bool started;
    pthread_t worker;
    pthread_mutex_t lock;
    pthread_cond_t queued, finished;
    CommHandle *head, *tail;
    long long timeout_ns;  // read by the worker, set by comm_set_timeout: __atomic access
    MPI_Comm control;      // questions and answers about arrival, apart from all data traffic
    Comm *live;            // worker only
    size_t chunk_bytes;
    bool trace;
    int tag_ub;
    Comm *world;
    int local_rank, local_size;  // among the world's ranks on this host (MPI_COMM_TYPE_SHARED)
    // Messages so far to and from each world rank, the seq of trace flow ids. Worker only.
    uint64_t *sent, *received;
    // The device backend, and every live group in the order it was made (main thread only): the
    // order in which a new backend is attached to them, the same on every rank.
    const CommDeviceBackend *device;
    Comm **groups;
    int n_groups, cap_groups;
} stream;

static void *checked_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) fatal("comm: out of memory (%zu x %zu bytes)", n, size);
    return p;
}

// ================================================================================================
// Data types
// ================================================================================================

size_t comm_dtype_size(CommDtype dtype) {
    switch (dtype) {
    case COMM_FLOAT32: return sizeof(float);
    case COMM_FLOAT64: return sizeof(double);
    case COMM_INT32: return sizeof(int32_t);
    case COMM_BYTE: return 1;
    }
    fatal("comm: unknown dtype %d", (int)dtype);
}

size_t comm_bytes(CommDtype dtype, size_t count) {
    size_t size = comm_dtype_size(dtype);
    if (count > SIZE_MAX / size) fatal("comm: %zu elements of %zu bytes overflow size_t", count, size);
    return count * size;
}

static MPI_Datatype mpi_dtype(CommDtype dtype) {
    switch (dtype) {
    case COMM_FLOAT32: return MPI_FLOAT;
    case COMM_FLOAT64: return MPI_DOUBLE;
    case COMM_INT32: return MPI_INT32_T;
    case COMM_BYTE: return MPI_BYTE;
    }
    fatal("comm: unknown dtype %d", (int)dtype);
}

// Element i of buf (MPI takes send buffers as const; the cast only serves the pointer arithmetic).
static char *element(const void *buf, CommDtype dtype, size_t i) { return (char *)buf + comm_bytes(dtype, i); }

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// ================================================================================================
// The queue
// ================================================================================================

static CommHandle *new_op(OpKind kind, const char *name, Comm *c) {
    if (!stream.started) fatal("comm: %s before comm_init()", name);
    if (!c) fatal("comm: %s on a NULL communicator", name);
    CommHandle *h = checked_calloc(1, sizeof *h);
    h->kind = kind;
    h->name = name;
    h->comm = c;
    return h;
}

static CommHandle *enqueue(CommHandle *h) {
    pthread_mutex_lock(&stream.lock);
    if (stream.tail)
        stream.tail->next = h;
    else
        stream.head = h;
    stream.tail = h;
    pthread_cond_signal(&stream.queued);
    pthread_mutex_unlock(&stream.lock);
    return h;
}

static void answer_questions(void);

// While the queue is empty the worker wakes every IDLE_TICK_NS to answer arrival questions: a rank
// busy computing is alive and must say so, or it would be reported as stopped.
static CommHandle *dequeue(void) {
    pthread_mutex_lock(&stream.lock);
    while (!stream.head) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += IDLE_TICK_NS;
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&stream.queued, &stream.lock, &until);
        if (stream.head) break;
        pthread_mutex_unlock(&stream.lock);
        answer_questions();
        pthread_mutex_lock(&stream.lock);
    }
    CommHandle *h = stream.head;
    stream.head = h->next;
    if (!stream.head) stream.tail = NULL;
    pthread_mutex_unlock(&stream.lock);
    return h;
}

static void mark_done(CommHandle *h) {
    pthread_mutex_lock(&stream.lock);
    h->done = true;
    pthread_cond_broadcast(&stream.finished);
    pthread_mutex_unlock(&stream.lock);
}

static void wait_done(CommHandle *h) {
    pthread_mutex_lock(&stream.lock);
    while (!h->done) pthread_cond_wait(&stream.finished, &stream.lock);
    pthread_mutex_unlock(&stream.lock);
}

static void free_handle(CommHandle *h) {
    free(h->p2p);
    free(h->seq);
    free(h);
}

void comm_wait(CommHandle *h) {
    if (!h) return;
    if (h->device_op) h->backend->wait(h->device_op);  // the backend's meaning: see comm.h
    else wait_done(h);
    free_handle(h);
}

bool comm_test(CommHandle *h) {
    if (!h) return true;
    if (h->device_op) return h->backend->test(h->device_op);
    pthread_mutex_lock(&stream.lock);
    bool done = h->done;
    pthread_mutex_unlock(&stream.lock);
    return done;
}

// ================================================================================================
// Waiting for MPI requests, with the timeout
// ================================================================================================

// Yield for the first millisecond of an operation, then sleep between tests. MPI progresses only
// inside its calls, so the worker must keep testing, but tests often run more ranks than cores
// (8 ranks on 2 cores) and a rank that spins starves the peer it is waiting for.
#define SPIN_NS 1000000LL
#define POLL_SLEEP_NS 20000L

static double timeout_seconds(void) { return __atomic_load_n(&stream.timeout_ns, __ATOMIC_RELAXED) * 1e-9; }

// ---- arrival questions ----------------------------------------------------------------------------

static Comm *live_comm(uint64_t id) {
    for (Comm *c = stream.live; c; c = c->next_live)
        if (c->id == id) return c;
    return NULL;
}

// Answers every pending question {comm id, k} with {comm id, collectives started on it}
// (UINT64_MAX for a group this rank is not in). Worker only.
static void answer_questions(void) {
    static uint64_t replies[64][2];  // a ring: each send is tiny and gone long before its slot returns
    static int next;
    for (;;) {
        int pending;
        MPI_Status status;
        MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, stream.control, &pending, &status);
        if (!pending) return;
        uint64_t question[2];
        MPI_Recv(question, 2, MPI_UINT64_T, status.MPI_SOURCE, TAG_QUERY, stream.control, MPI_STATUS_IGNORE);
        Comm *c = live_comm(question[0]);
        uint64_t *reply = replies[next++ % 64];
        reply[0] = question[0];
        reply[1] = c ? c->collectives_started : UINT64_MAX;
        MPI_Request req;
        MPI_Isend(reply, 2, MPI_UINT64_T, status.MPI_SOURCE, TAG_REPLY, stream.control, &req);
        MPI_Request_free(&req);
    }
}

// Asks every other member of h's group whether it has started h (collective number k), waiting
// QUERY_GRACE_S for the answers, and writes who has not: "did not arrive: world rank 2 (alive,
// still at collective 5 of this group; this is 6), world rank 3 (no answer: stopped or dead)".
static void who_did_not_arrive(const CommHandle *h, char *out, size_t out_len) {
    const Comm *c = h->comm;
    int n = c->size, me = c->rank;
    uint64_t question[2] = {c->id, h->collective_number}, (*answers)[2] = checked_calloc((size_t)n, sizeof *answers);
    MPI_Request *reqs = checked_calloc(2 * (size_t)n, sizeof *reqs);
    for (int r = 0; r < n; r++) {
        reqs[2 * r] = reqs[2 * r + 1] = MPI_REQUEST_NULL;
        if (r == me) continue;
        MPI_Isend(question, 2, MPI_UINT64_T, c->world_ranks[r], TAG_QUERY, stream.control, &reqs[2 * r]);
        MPI_Irecv(answers[r], 2, MPI_UINT64_T, c->world_ranks[r], TAG_REPLY, stream.control, &reqs[2 * r + 1]);
    }
    long long start = now_ns();
    int all = 0;
    while (!all && now_ns() - start < (long long)(QUERY_GRACE_S * 1e9)) {
        answer_questions();  // the others may be asking this rank at the same time
        MPI_Testall(2 * n, reqs, &all, MPI_STATUSES_IGNORE);
        if (!all) nanosleep(&(struct timespec){.tv_nsec = 1000000L}, NULL);
    }
    int used = snprintf(out, out_len, "did not arrive:");
    bool any = false;
    for (int r = 0; r < n && used < (int)out_len; r++) {
        if (r == me) continue;
        int answered = 0;
        if (reqs[2 * r + 1] != MPI_REQUEST_NULL) MPI_Test(&reqs[2 * r + 1], &answered, MPI_STATUS_IGNORE);
        else answered = 1;
        const char *sep = any ? "," : "";
        if (!answered) {
            used += snprintf(out + used, out_len - (size_t)used, "%s world rank %d (no answer: stopped or dead)", sep,
                             c->world_ranks[r]);
            any = true;
        } else if (answers[r][1] < h->collective_number) {
            used += snprintf(out + used, out_len - (size_t)used, "%s world rank %d (alive, still at collective %llu of this group; this is %llu)", sep,
                             c->world_ranks[r], (unsigned long long)answers[r][1],
                             (unsigned long long)h->collective_number);
            any = true;
        }
    }
    if (!any) snprintf(out, out_len, "every member started it, so one may have died in the middle of it");
    free(answers);
    free(reqs);  // the requests still open are abandoned: MPI_Abort follows
}

__attribute__((noreturn)) static void die_timed_out(const CommHandle *h, MPI_Request *reqs, const int *peers, int n) {
    const Comm *c = h->comm;
    char waiting[1024] = "a rank may have died, or not have started it";
    if (h->collective_number > 0) who_did_not_arrive(h, waiting, sizeof waiting);
    // The first transfer still open names the peer (MPI_Test frees the ones that completed).
    for (int i = 0; peers && i < n; i++) {
        int complete;
        MPI_Test(&reqs[i], &complete, MPI_STATUS_IGNORE);
        if (!complete) {
            snprintf(waiting, sizeof waiting, "waiting on peer rank %d (world rank %d), which may have died",
                     peers[i], c->world_ranks[peers[i]]);
            break;
        }
    }
    fprintf(stderr, "comm: %s on group %s (%d ranks) did not finish after %g s on world rank %d; %s\n", h->name,
            c->name, c->size, timeout_seconds(), stream.world->rank, waiting);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);  // MPI_Abort does not return
}

// Ends the run on an error of the calling rank's own making or its peers' (a mismatched call): one
// line, then MPI_Abort, as the timeout does.
__attribute__((noreturn, format(printf, 2, 3))) static void die(const CommHandle *h, const char *fmt, ...) {
    char why[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    fprintf(stderr, "comm: %s on group %s (%d ranks) failed on world rank %d: %s\n", h->name, h->comm->name,
            h->comm->size, stream.world->rank, why);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

// ---- agreement: every member runs the same collective ----------------------------------------------
//
// MPI matches a group's collectives by their order alone, so members that disagree on what the
// k-th one is (broadcast roots, counts, dtypes, reduce ops, or the kind itself) would either go on
// silently with wrong data or fail deep inside MPI. Each collective therefore starts with an
// all-gather of a 16-byte descriptor, posted just before its first data call and completed
// alongside it (no extra round trip before the data moves), and compared before the operation is
// reported finished. The barrier, comm_split's exchange and comm_finalize's closing barrier are
// this all-gather and nothing else. Worker only: one collective runs at a time.
static struct {
    const CommHandle *h;
    MPI_Request req;
    uint64_t mine[2];
    uint64_t *all;  // 2 words per member
    bool open;      // posted, not completed and checked yet
} agree;

// word 0: kind + 1 (8 bits), dtype (8), reduce op (8), root (32); word 1: the count. Fields a kind
// does not use are 0, so that only what must match is compared.
static void describe(const CommHandle *h, uint64_t d[2]) {
    bool data = h->kind < OP_BARRIER, reduces = h->kind == OP_ALL_REDUCE || h->kind == OP_REDUCE_SCATTER;
    d[0] = (uint64_t)(h->kind + 1) << 56;
    if (data) d[0] |= (uint64_t)h->dtype << 48;
    if (reduces) d[0] |= (uint64_t)h->reduce << 40;
    if (h->kind == OP_BROADCAST) d[0] |= (uint32_t)h->root;
    d[1] = data ? (uint64_t)h->count : 0;
}

static const char *dtype_name(unsigned d) {
    static const char *names[] = {"float32", "float64", "int32", "byte"};
    return d < 4 ? names[d] : "?";
}

// "all_reduce(4 float32, SUM)", "broadcast(1 float32, root 1)", "finalize (comm_finalize)".
static void descriptor_text(const uint64_t d[2], char *out, size_t len) {
    static const char *kinds[] = {[OP_ALL_REDUCE] = "all_reduce", [OP_REDUCE_SCATTER] = "reduce_scatter",
                                  [OP_ALL_GATHER] = "all_gather", [OP_BROADCAST] = "broadcast",
                                  [OP_ALL_TO_ALL] = "all_to_all", [OP_BARRIER] = "barrier", [OP_P2P] = "?",
                                  [OP_SPLIT] = "split", [OP_FINALIZE] = "finalize (comm_finalize)"};
    static const char *ops[] = {"SUM", "AVG", "MAX"};
    unsigned kind = (unsigned)(d[0] >> 56) - 1, dtype = (d[0] >> 48) & 0xff, op = (d[0] >> 40) & 0xff;
    const char *name = kind <= OP_FINALIZE ? kinds[kind] : "?";
    if (kind >= OP_BARRIER)
        snprintf(out, len, "%s", name);
    else if (kind == OP_ALL_REDUCE || kind == OP_REDUCE_SCATTER)
        snprintf(out, len, "%s(%llu %s, %s)", name, (unsigned long long)d[1], dtype_name(dtype), op < 3 ? ops[op] : "?");
    else if (kind == OP_BROADCAST)
        snprintf(out, len, "%s(%llu %s, root %d)", name, (unsigned long long)d[1], dtype_name(dtype), (int)(uint32_t)d[0]);
    else
        snprintf(out, len, "%s(%llu %s)", name, (unsigned long long)d[1], dtype_name(dtype));
}

static void post_agreement(const CommHandle *h) {
    const Comm *c = h->comm;
    describe(h, agree.mine);
    free(agree.all);
    agree.all = checked_calloc(2 * (size_t)c->size, sizeof *agree.all);
    agree.h = h;
    int rc = MPI_Iallgather(agree.mine, 2, MPI_UINT64_T, agree.all, 2, MPI_UINT64_T, c->mpi, &agree.req);
    if (rc != MPI_SUCCESS) die(h, "MPI_Iallgather of the call's descriptor returned error %d", rc);
    agree.open = true;
}

static void check_agreement(const CommHandle *h) {
    const Comm *c = h->comm;
    char mine[96], theirs[96], list[1024] = "";
    int used = 0, differ = 0;
    for (int r = 0; r < c->size; r++) {
        if (agree.all[2 * r] == agree.mine[0] && agree.all[2 * r + 1] == agree.mine[1]) continue;
        descriptor_text(&agree.all[2 * r], theirs, sizeof theirs);
        if (used < (int)sizeof list)
            used += snprintf(list + used, sizeof list - (size_t)used, "%sworld rank %d runs %s", differ ? ", " : "",
                             c->world_ranks[r], theirs);
        differ++;
    }
    if (!differ) return;
    descriptor_text(agree.mine, mine, sizeof mine);
    die(h, "collective %llu of this group: this rank runs %s, but %s; every member must make the same call "
           "(kind, count, dtype, reduce op, root) in the same order",
        (unsigned long long)h->collective_number, mine, list);
}

// Tests the open agreement; compares the descriptors once they are all here.
static void poll_agreement(const CommHandle *h) {
    if (!agree.open || agree.h != h) return;
    int complete;
    int rc = MPI_Test(&agree.req, &complete, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) die(h, "the exchange of the call's descriptor failed (MPI error %d)", rc);
    if (!complete) return;
    agree.open = false;
    check_agreement(h);
}

// An MPI error in h's data calls: most likely the members disagree on the call (a count that does
// not fit the buffers posted), which the agreement says more clearly, if it comes in time.
__attribute__((noreturn)) static void die_mpi_error(const CommHandle *h, int rc) {
    long long start = now_ns();
    while (agree.open && agree.h == h && now_ns() - start < (long long)(QUERY_GRACE_S * 1e9)) {
        poll_agreement(h);
        answer_questions();
        nanosleep(&(struct timespec){.tv_nsec = 1000000L}, NULL);
    }
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, text, &len);
    die(h, "MPI error: %s", text);
}

// One pause of a polling loop, and the timeout: yields for the first millisecond, then answers
// arrival questions and sleeps. reqs/peers/n name what is still open, for the timeout's message.
static void pause_or_time_out(const CommHandle *h, MPI_Request *reqs, const int *peers, int n) {
    long long waited = now_ns() - h->start_ns;
    if (waited > __atomic_load_n(&stream.timeout_ns, __ATOMIC_RELAXED)) die_timed_out(h, reqs, peers, n);
    if (waited < SPIN_NS) {
        sched_yield();
    } else {
        answer_questions();
        nanosleep(&(struct timespec){.tv_nsec = POLL_SLEEP_NS}, NULL);
    }
}

// Waits for reqs (a collective's data calls), testing the collective's agreement as it goes, so
// that members which disagree are named even when the data calls would never complete.
static void wait_requests(const CommHandle *h, MPI_Request *reqs, int n) {
    for (;;) {
        poll_agreement(h);
        int complete;
        int rc = MPI_Testall(n, reqs, &complete, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) die_mpi_error(h, rc);
        if (complete) return;
        pause_or_time_out(h, reqs, NULL, n);
    }
}

// Waits for the agreement of h to complete (it has been checked when this returns).
static void finish_agreement(const CommHandle *h) {
    for (;;) {
        poll_agreement(h);
        if (!agree.open) return;
        pause_or_time_out(h, NULL, NULL, 0);
    }
}

static void wait_request(const CommHandle *h, MPI_Request *req) { wait_requests(h, req, 1); }

// Posts a data call (the communicators return MPI errors instead of aborting: see new_comm).
#define POST(h, call)                                    \
    do {                                                 \
        int post_rc_ = (call);                           \
        if (post_rc_ != MPI_SUCCESS) die_mpi_error(h, post_rc_); \
    } while (0)

// ================================================================================================
// Pieces: every operation moves at most chunk_bytes per MPI call, so counts above INT_MAX work
// ================================================================================================

// Elements per piece when one MPI call carries a piece of each of `blocks` blocks.
static size_t piece_len(CommDtype dtype, int blocks) {
    size_t len = stream.chunk_bytes / comm_dtype_size(dtype) / (size_t)blocks;
    return len ? len : 1;
}

// `len` elements repeated every `stride` elements. In a buffer of one block of `stride` elements
// per rank (all_gather's recv, reduce_scatter's send, all_to_all's both), it selects the same piece
// of every block, so one MPI call with count 1 moves piece [k, k + len) of each block, uncopied.
static MPI_Datatype piece_of_each_block(CommDtype dtype, size_t len, size_t stride) {
    MPI_Datatype piece, strided;
    MPI_Type_contiguous((int)len, mpi_dtype(dtype), &piece);
    MPI_Type_create_resized(piece, 0, (MPI_Aint)comm_bytes(dtype, stride), &strided);
    MPI_Type_free(&piece);
    MPI_Type_commit(&strided);
    return strided;
}

// ================================================================================================
// Reductions, in rank order
// ================================================================================================

// Folds blocks 1..n-1 into out (which holds block 0), element by element, in rank order.
#define FOLD(T, COMBINE)                                             \
    for (int r = 1; r < n; r++) {                                    \
        const T *x_r = (const T *)blocks + (size_t)r * len;          \
        T *acc = out;                                                \
        for (size_t i = 0; i < len; i++) {                           \
            T a = acc[i], x = x_r[i];                                \
            acc[i] = COMBINE;                                        \
        }                                                            \
    }

// out = block 0 (op) block 1 (op) ... (op) block n-1, where block r starts at blocks + r * len.
// The fixed order is what makes float sums identical on every rank and in every run.
static void fold_in_rank_order(const void *blocks, int n, size_t len, void *out, CommDtype dtype, CommReduceOp op) {
    memcpy(out, blocks, comm_bytes(dtype, len));
    bool max = op == COMM_MAX;
    switch (dtype) {
    case COMM_FLOAT32:
        if (max) {
            FOLD(float, x > a || isnan(x) ? x : a)  // NaN wins, so an overflow is never hidden
        } else {
            FOLD(float, a + x)
        }
        break;
    case COMM_FLOAT64:
        if (max) {
            FOLD(double, x > a || isnan(x) ? x : a)
        } else {
            FOLD(double, a + x)
        }
        break;
    case COMM_INT32:
        if (max) {
            FOLD(int32_t, x > a ? x : a)
        } else {
            FOLD(uint32_t, a + x)  // unsigned: an overflow wraps instead of being undefined
        }
        break;
    case COMM_BYTE: fatal("comm: bytes cannot be reduced");
    }
    if (op != COMM_AVG) return;
    for (size_t i = 0; i < len; i++) {
        if (dtype == COMM_FLOAT32) ((float *)out)[i] /= (float)n;
        if (dtype == COMM_FLOAT64) ((double *)out)[i] /= (double)n;
    }
}

// ================================================================================================
// The operations, as the worker runs them
// ================================================================================================

// Rank b owns block b of each piece: it receives every rank's copy of block b (all-to-all), folds
// the copies in rank order, and all-gathers its result back. That is a reduce-scatter plus an
// all-gather, the same 2(n-1)/n of the buffer per rank on the wire as a ring all-reduce, and every
// element is summed once, by one rank, in rank order.
static void run_all_reduce(const CommHandle *h) {
    const Comm *c = h->comm;
    int n = c->size, me = c->rank;
    size_t step = piece_len(h->dtype, 1);
    int *counts = checked_calloc((size_t)n, sizeof *counts), *displs = checked_calloc((size_t)n, sizeof *displs);
    int *my_counts = checked_calloc((size_t)n, sizeof *my_counts);
    int *my_displs = checked_calloc((size_t)n, sizeof *my_displs);
    void *copies = checked_calloc(comm_bytes(h->dtype, (min_size(step, h->count) / (size_t)n + 1) * (size_t)n), 1);
    for (size_t k = 0; k < h->count; k += step) {
        size_t len = min_size(step, h->count - k);
        for (int b = 0; b < n; b++) {
            displs[b] = (int)(len * (size_t)b / (size_t)n);
            counts[b] = (int)(len * (size_t)(b + 1) / (size_t)n) - displs[b];
        }
        for (int r = 0; r < n; r++) {
            my_counts[r] = counts[me];
            my_displs[r] = r * counts[me];
        }
        char *piece = element(h->recv, h->dtype, k);
        MPI_Datatype type = mpi_dtype(h->dtype);
        MPI_Request req;
        POST(h, MPI_Ialltoallv(piece, counts, displs, type, copies, my_counts, my_displs, type, c->mpi, &req));
        wait_request(h, &req);
        fold_in_rank_order(copies, n, (size_t)counts[me], element(piece, h->dtype, (size_t)displs[me]), h->dtype,
                           h->reduce);
        POST(h, MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, piece, counts, displs, type, c->mpi, &req));
        wait_request(h, &req);
    }
    free(copies);
    free(my_displs);
    free(my_counts);
    free(displs);
    free(counts);
}

// reduce_scatter, all_gather and all_to_all: their blocked buffers hold one block of `count`
// elements per rank, and each MPI call moves the same piece [k, k + len) of every block. A
// reduce-scatter is an all-to-all that brings every rank's copy of block `me` here, then the fold
// of all_reduce.
static void run_blocked(const CommHandle *h) {
    const Comm *c = h->comm;
    size_t step = piece_len(h->dtype, c->size);
    MPI_Datatype type = mpi_dtype(h->dtype);
    bool reduce = h->kind == OP_REDUCE_SCATTER;
    void *copies = reduce ? checked_calloc(comm_bytes(h->dtype, min_size(step, h->count) * (size_t)c->size), 1) : NULL;
    for (size_t k = 0; k < h->count; k += step) {
        size_t len = min_size(step, h->count - k);
        MPI_Datatype blocks = piece_of_each_block(h->dtype, len, h->count);
        char *send = element(h->send, h->dtype, k), *recv = element(h->recv, h->dtype, k);
        MPI_Request req;
        if (h->kind == OP_ALL_GATHER)
            POST(h, MPI_Iallgather(send, (int)len, type, recv, 1, blocks, c->mpi, &req));
        else if (h->kind == OP_ALL_TO_ALL)
            POST(h, MPI_Ialltoall(send, 1, blocks, recv, 1, blocks, c->mpi, &req));
        else
            POST(h, MPI_Ialltoall(send, 1, blocks, copies, (int)len, type, c->mpi, &req));
        wait_request(h, &req);
        MPI_Type_free(&blocks);
        if (reduce) fold_in_rank_order(copies, c->size, len, recv, h->dtype, h->reduce);
    }
    free(copies);
}

static void run_broadcast(const CommHandle *h) {
    size_t step = piece_len(h->dtype, 1);
    for (size_t k = 0; k < h->count; k += step) {
        MPI_Request req;
        POST(h, MPI_Ibcast(element(h->recv, h->dtype, k), (int)min_size(step, h->count - k), mpi_dtype(h->dtype),
                           h->root, h->comm->mpi, &req));
        wait_request(h, &req);
    }
}

// The barrier (and comm_finalize's closing one) is the agreement's all-gather alone: no member
// gets every descriptor before every member has posted its own.

// A transfer of 0 elements is still one (empty) message, so sends and receives keep matching.
static size_t pieces_of(const CommP2P *t) {
    size_t step = piece_len(t->dtype, 1);
    return t->count ? (t->count + step - 1) / step : 1;
}

// The message number of each transfer between its two world ranks, for flow ids: both sides count
// the messages between them in stream order, and within one batch in the order of (tag, position),
// which is the order MPI matches them in when both batches hold the same messages.
static void number_messages(const CommHandle *h) {
    int *order = checked_calloc((size_t)h->n_p2p, sizeof *order);
    for (int i = 0; i < h->n_p2p; i++) {
        int j = i;
        for (; j > 0 && h->p2p[order[j - 1]].tag > h->p2p[i].tag; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    for (int i = 0; i < h->n_p2p; i++) {
        const CommP2P *t = &h->p2p[order[i]];
        int peer = h->comm->world_ranks[t->peer];
        h->seq[order[i]] = t->kind == COMM_SEND ? stream.sent[peer]++ : stream.received[peer]++;
    }
    free(order);
}

// A receive's piece has completed: it must hold exactly what was posted (a shorter message would
// otherwise pass silently, and leave the rest of the receive to swallow the next operation's).
static void check_received(const CommHandle *h, const CommP2P *t, size_t len, size_t piece, const MPI_Status *st,
                           bool error_in_status) {
    const Comm *c = h->comm;
    size_t pieces = pieces_of(t);
    char where[160] = "";
    if (pieces > 1)
        snprintf(where, sizeof where, " (piece %zu of %zu of a receive of %zu; large transfers travel as pieces of %zu)",
                 piece + 1, pieces, t->count, piece_len(t->dtype, 1));
    const char *dtype = dtype_name((unsigned)t->dtype);
    if (error_in_status && st->MPI_ERROR != MPI_SUCCESS) {
        int class_ = st->MPI_ERROR;
        MPI_Error_class(st->MPI_ERROR, &class_);
        if (class_ == MPI_ERR_TRUNCATE)
            die(h, "the message from peer rank %d (world rank %d), tag %d, holds more than the %zu %s posted%s; "
                   "a receive's count must equal its send's",
                t->peer, c->world_ranks[t->peer], t->tag, len, dtype, where);
        die_mpi_error(h, st->MPI_ERROR);
    }
    int got = 0;
    MPI_Get_count(st, mpi_dtype(t->dtype), &got);
    if (got == MPI_UNDEFINED)
        die(h, "the message from peer rank %d (world rank %d), tag %d, is not a whole number of %s where %zu were "
               "posted%s; a receive's count and dtype must equal its send's",
            t->peer, c->world_ranks[t->peer], t->tag, dtype, len, where);
    if ((size_t)got != len)
        die(h, "the message from peer rank %d (world rank %d), tag %d, holds %d %s where %zu were posted%s; "
               "a receive's count must equal its send's",
            t->peer, c->world_ranks[t->peer], t->tag, got, dtype, len, where);
}

// Posts every transfer (in pieces), then waits for all of them together: a send never waits for
// a receive queued behind it, which is what makes a ring exchange safe. Each receive's piece is
// checked as it completes.
static void run_p2p(const CommHandle *h) {
    size_t n_requests = 0;
    for (int i = 0; i < h->n_p2p; i++) n_requests += pieces_of(&h->p2p[i]);
    if (n_requests > INT_MAX) fatal("comm: %s on group %s: %zu messages in one batch", h->name, h->comm->name, n_requests);
    MPI_Request *reqs = checked_calloc(n_requests, sizeof *reqs);
    int *peers = checked_calloc(n_requests, sizeof *peers);
    int *transfer = checked_calloc(n_requests, sizeof *transfer), *done = checked_calloc(n_requests, sizeof *done);
    size_t *lens = checked_calloc(n_requests, sizeof *lens), *piece = checked_calloc(n_requests, sizeof *piece);
    MPI_Status *statuses = checked_calloc(n_requests, sizeof *statuses);
    size_t r = 0;
    for (int i = 0; i < h->n_p2p; i++) {
        const CommP2P *t = &h->p2p[i];
        size_t step = piece_len(t->dtype, 1), k = 0, p = 0;
        do {
            size_t len = min_size(step, t->count - k);
            char *at = element(t->buf, t->dtype, k);
            if (t->kind == COMM_SEND)
                POST(h, MPI_Isend(at, (int)len, mpi_dtype(t->dtype), t->peer, t->tag, h->comm->mpi, &reqs[r]));
            else
                POST(h, MPI_Irecv(at, (int)len, mpi_dtype(t->dtype), t->peer, t->tag, h->comm->mpi, &reqs[r]));
            peers[r] = t->peer;
            transfer[r] = i;
            lens[r] = len;
            piece[r++] = p++;
            k += len;
        } while (k < t->count);
    }
    for (size_t left = n_requests; left > 0;) {
        int n_done = 0;
        int rc = MPI_Testsome((int)n_requests, reqs, &n_done, done, statuses);
        if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) die_mpi_error(h, rc);
        if (n_done == MPI_UNDEFINED) break;  // every request is complete (and freed)
        for (int j = 0; j < n_done; j++) {
            const CommP2P *t = &h->p2p[transfer[done[j]]];
            if (t->kind == COMM_RECV)
                check_received(h, t, lens[done[j]], piece[done[j]], &statuses[j], rc == MPI_ERR_IN_STATUS);
            else if (rc == MPI_ERR_IN_STATUS && statuses[j].MPI_ERROR != MPI_SUCCESS)
                die_mpi_error(h, statuses[j].MPI_ERROR);
        }
        left -= (size_t)n_done;
        if (left > 0 && n_done == 0) pause_or_time_out(h, reqs, peers, (int)n_requests);
    }
    number_messages(h);
    free(statuses);
    free(piece);
    free(lens);
    free(done);
    free(transfer);
    free(peers);
    free(reqs);
}

static Comm *new_comm(MPI_Comm mpi, const char *name, int *world_ranks) {
    Comm *c = checked_calloc(1, sizeof *c);
    c->mpi = mpi;
    // MPI errors on the data come back to the worker, which names the operation (and, for a call
    // the members disagree on, what each one called) instead of MPI aborting with its own words.
    MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
    snprintf(c->name, sizeof c->name, "%s", name);
    MPI_Comm_rank(mpi, &c->rank);
    MPI_Comm_size(mpi, &c->size);
    c->world_ranks = world_ranks;
    // FNV-1a over the name and the members: equal on every member, different for other groups
    uint64_t id = fnv1a_string(FNV1A_BASIS, c->name);
    for (int i = 0; i < c->size; i++) id = fnv1a_word(id, (uint64_t)(unsigned)world_ranks[i]);
    c->id = id;
    c->next_live = stream.live;
    stream.live = c;
    return c;
}

// MPI_Comm_split cannot be polled, so: all-gather every rank's (color, key) with the timeout, then
// MPI_Comm_create_group, which involves only the members, who have all just shown up.
static void run_split(CommHandle *h) {
    const Comm *parent = h->comm;
    int n = parent->size, mine[2] = {h->color, h->key};
    int *all = checked_calloc(2 * (size_t)n, sizeof *all);
    MPI_Request req;
    POST(h, MPI_Iallgather(mine, 2, MPI_INT, all, 2, MPI_INT, parent->mpi, &req));
    wait_request(h, &req);
    // The parent ranks of my color, by key and then by parent rank (MPI_Comm_split's order).
    int *members = checked_calloc((size_t)n, sizeof *members), m = 0;
    for (int r = 0; r < n; r++) {
        if (all[2 * r] != h->color) continue;
        int j = m++;
        for (; j > 0 && all[2 * members[j - 1] + 1] > all[2 * r + 1]; j--) members[j] = members[j - 1];
        members[j] = r;
    }
    MPI_Group parent_group, group;
    MPI_Comm_group(parent->mpi, &parent_group);
    MPI_Group_incl(parent_group, m, members, &group);
    MPI_Comm mpi;
    MPI_Comm_create_group(parent->mpi, group, 0, &mpi);
    MPI_Group_free(&group);
    MPI_Group_free(&parent_group);
    int *world_ranks = checked_calloc((size_t)m, sizeof *world_ranks);
    for (int i = 0; i < m; i++) world_ranks[i] = parent->world_ranks[members[i]];
    h->split_result = new_comm(mpi, h->split_name, world_ranks);
    free(members);
    free(all);
}

static void destroy_comm(Comm *c) {
    for (Comm **p = &stream.live; *p; p = &(*p)->next_live)
        if (*p == c) {
            *p = c->next_live;
            break;
        }
    MPI_Comm_free(&c->mpi);
    free(c->world_ranks);
    free(c);
}

static void execute(CommHandle *h) {
    switch (h->kind) {
    case OP_ALL_REDUCE: run_all_reduce(h); break;
    case OP_REDUCE_SCATTER:
    case OP_ALL_GATHER:
    case OP_ALL_TO_ALL: run_blocked(h); break;
    case OP_BROADCAST: run_broadcast(h); break;
    case OP_BARRIER:
    case OP_FINALIZE: break;  // the agreement is the barrier
    case OP_P2P: run_p2p(h); break;
    case OP_SPLIT: run_split(h); break;
    case OP_FREE: destroy_comm(h->comm); break;
    case OP_STOP: break;
    }
}

// ================================================================================================
// Trace: one slice per data operation on "comm:<group>", recorded after it finished
// ================================================================================================

// The size of the whole tensor the operation works on (nccl-tests' "size"): the in-place buffer,
// the larger side of the blocked ones, the sum of a batch's transfers.
static size_t op_bytes(const CommHandle *h) {
    size_t blocks = h->kind == OP_REDUCE_SCATTER || h->kind == OP_ALL_GATHER || h->kind == OP_ALL_TO_ALL
                        ? (size_t)h->comm->size : 1;
    if (h->kind != OP_P2P) return comm_bytes(h->dtype, h->count) * blocks;
    size_t bytes = 0;
    for (int i = 0; i < h->n_p2p; i++) bytes += comm_bytes(h->p2p[i].dtype, h->p2p[i].count);
    return bytes;
}

// "peer" (a world rank) when every transfer goes to one rank, else "peers": "send 3, recv 1, ...".
static void record_peers(int track, const CommHandle *h) {
    const int *world = h->comm->world_ranks;
    bool one_peer = true;
    for (int i = 1; i < h->n_p2p; i++) one_peer &= h->p2p[i].peer == h->p2p[0].peer;
    if (one_peer && h->n_p2p > 0) {
        trace_arg_int(track, "peer", world[h->p2p[0].peer]);
        return;
    }
    char peers[256] = "";
    for (int i = 0, used = 0; i < h->n_p2p && used < (int)sizeof peers; i++)
        used += snprintf(peers + used, sizeof peers - (size_t)used, "%s%s %d", i ? ", " : "",
                         h->p2p[i].kind == COMM_SEND ? "send" : "recv", world[h->p2p[i].peer]);
    trace_arg_str(track, "peers", peers);
}

static void record_flows(int track, const CommHandle *h) {
    int me = stream.world->rank;
    for (int i = 0; i < h->n_p2p; i++) {
        int peer = h->comm->world_ranks[h->p2p[i].peer];
        if (h->p2p[i].kind == COMM_SEND)
            trace_flow_out(track, trace_flow_id(me, peer, h->seq[i]));
        else
            trace_flow_in(track, trace_flow_id(peer, me, h->seq[i]));
    }
}

static void record_slice(const CommHandle *h) {
    if (!stream.trace || !trace_enabled() || h->kind >= OP_SPLIT) return;
    char track_name[64];
    snprintf(track_name, sizeof track_name, "comm:%s", h->comm->name);
    int track = trace_track(track_name);
    trace_begin_at(track, h->name, "comm", h->start_ns);
    trace_arg_str(track, "op", h->name);
    trace_arg_str(track, "group", h->comm->name);
    trace_arg_int(track, "bytes", (int64_t)op_bytes(h));
    size_t count = h->count;
    for (int i = 0; i < h->n_p2p; i++) count += h->p2p[i].count;
    trace_arg_int(track, "count", (int64_t)count);
    if (h->kind == OP_P2P) {
        record_peers(track, h);
        record_flows(track, h);
    }
    trace_end_at(track, now_ns());
}

static void *worker_main(void *unused) {
    (void)unused;
    for (;;) {
        CommHandle *h = dequeue();
        bool stop = h->kind == OP_STOP;
        h->start_ns = now_ns();
        if (is_collective(h->kind)) {
            h->collective_number = ++h->comm->collectives_started;
            post_agreement(h);
        }
        execute(h);
        if (is_collective(h->kind)) finish_agreement(h);
        record_slice(h);
        mark_done(h);
        if (stop) return NULL;
    }
}

// ================================================================================================
// Setup
// ================================================================================================

static void add_group(Comm *c);
static void remove_group(Comm *c);

void comm_init(int *argc, char ***argv, const CommOptions *options) {
    if (stream.started) fatal("comm_init: called twice");
    CommOptions o = options ? *options : (CommOptions){0};
    comm_set_timeout(o.timeout_seconds > 0 ? o.timeout_seconds : DEFAULT_TIMEOUT_S);
    stream.chunk_bytes = o.chunk_bytes && o.chunk_bytes < MAX_CHUNK_BYTES ? o.chunk_bytes : MAX_CHUNK_BYTES;
    stream.trace = o.trace;

    int provided;
    MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
    if (provided < MPI_THREAD_SERIALIZED)
        fatal("comm_init: this MPI offers thread level %d, the comm stream needs MPI_THREAD_SERIALIZED", provided);
    int *tag_ub, has_tag_ub;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub);
    stream.tag_ub = has_tag_ub ? *tag_ub : 32767;  // 32767: the least the standard guarantees

    // A private copy of MPI_COMM_WORLD, so that our messages never match anybody else's.
    MPI_Comm world;
    MPI_Comm_dup(MPI_COMM_WORLD, &world);
    MPI_Comm_dup(MPI_COMM_WORLD, &stream.control);
    int size;
    MPI_Comm_size(world, &size);
    int *world_ranks = checked_calloc((size_t)size, sizeof *world_ranks);
    for (int r = 0; r < size; r++) world_ranks[r] = r;
    stream.world = new_comm(world, "world", world_ranks);
    add_group(stream.world);
    MPI_Comm host;  // the ranks that share this host's memory: one node
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    MPI_Comm_rank(host, &stream.local_rank);
    MPI_Comm_size(host, &stream.local_size);
    MPI_Comm_free(&host);
    log_set_rank(stream.world->rank);  // for launchers other than Open MPI's, whose variables log.c reads
    stream.sent = checked_calloc((size_t)size, sizeof *stream.sent);
    stream.received = checked_calloc((size_t)size, sizeof *stream.received);

    pthread_mutex_init(&stream.lock, NULL);
    pthread_cond_init(&stream.queued, NULL);
    pthread_cond_init(&stream.finished, NULL);
    stream.started = true;
    if (pthread_create(&stream.worker, NULL, worker_main, NULL) != 0) fatal("comm_init: cannot start the comm thread");
}

void comm_set_timeout(double seconds) {
    __atomic_store_n(&stream.timeout_ns, (long long)(seconds * 1e9), __ATOMIC_RELAXED);
}

double comm_timeout(void) { return timeout_seconds(); }

double comm_timeout_for_step(double slowest_step_seconds) {
    double derived = COMM_TIMEOUT_STEP_FACTOR * slowest_step_seconds;
    return derived > COMM_TIMEOUT_FLOOR_S ? derived : COMM_TIMEOUT_FLOOR_S;
}

void comm_finalize(void) {
    if (!stream.started) return;
    comm_set_device_backend(NULL);  // gpu/ normally has done so already, before its device went
    // A last barrier over the world, polled with the timeout like every collective, while the worker
    // still answers arrival questions: MPI_Finalize below cannot be polled, so a peer stopped after
    // its last collective would hang it for ever, and a peer still behind (it skipped a collective)
    // must still be reported as alive by this rank's worker. After it every rank has reached
    // comm_finalize, so MPI_Finalize returns.
    comm_wait(enqueue(new_op(OP_FINALIZE, "finalize", stream.world)));
    comm_wait(enqueue(new_op(OP_STOP, "stop", stream.world)));
    pthread_join(stream.worker, NULL);
    stream.started = false;
    free(agree.all);
    agree.all = NULL;
    // The worker has ended, so the main thread may call MPI again: SERIALIZED allows that.
    destroy_comm(stream.world);
    stream.world = NULL;
    MPI_Comm_free(&stream.control);
    free(stream.sent);
    free(stream.received);
    free(stream.groups);
    stream.groups = NULL;
    stream.n_groups = stream.cap_groups = 0;
    pthread_cond_destroy(&stream.finished);
    pthread_cond_destroy(&stream.queued);
    pthread_mutex_destroy(&stream.lock);
    MPI_Finalize();
}

Comm *comm_world(void) {
    if (!stream.started) fatal("comm_world: comm_init() was not called");
    return stream.world;
}

int comm_rank(const Comm *c) { return c->rank; }
int comm_local_rank(void) { return stream.local_rank; }
int comm_local_size(void) { return stream.local_size; }
int comm_size(const Comm *c) { return c->size; }
const char *comm_name(const Comm *c) { return c->name; }

int comm_world_rank_of(const Comm *c, int r) {
    if (r < 0 || r >= c->size) fatal("comm_world_rank_of: rank %d is not in group %s (%d ranks)", r, c->name, c->size);
    return c->world_ranks[r];
}

Comm *comm_split(Comm *parent, int color, int key, const char *name) {
    CommHandle *h = new_op(OP_SPLIT, "split", parent);
    h->color = color;
    h->key = key;
    snprintf(h->split_name, sizeof h->split_name, "%s", name ? name : "?");
    enqueue(h);
    wait_done(h);
    Comm *c = h->split_result;
    free_handle(h);
    add_group(c);
    if (stream.device) c->device_state = stream.device->attach(c);  // every member is here: collective
    return c;
}

void comm_free(Comm *c) {
    if (!c) return;
    if (c == stream.world) fatal("comm_free: the world communicator is freed by comm_finalize()");
    if (stream.device) stream.device->detach(c, c->device_state);
    remove_group(c);
    comm_wait(enqueue(new_op(OP_FREE, "free", c)));
}

// ---- the device backend ----------------------------------------------------------------------------

static void add_group(Comm *c) {
    if (stream.n_groups == stream.cap_groups) {
        stream.cap_groups = stream.cap_groups ? 2 * stream.cap_groups : 16;
        stream.groups = realloc(stream.groups, (size_t)stream.cap_groups * sizeof *stream.groups);
        if (!stream.groups) fatal("comm: out of memory");
    }
    stream.groups[stream.n_groups++] = c;
}

static void remove_group(Comm *c) {
    int i = 0;
    while (i < stream.n_groups && stream.groups[i] != c) i++;
    if (i == stream.n_groups) fatal("comm_free: group %s is not live", c->name);
    memmove(&stream.groups[i], &stream.groups[i + 1], (size_t)(stream.n_groups - i - 1) * sizeof *stream.groups);
    stream.n_groups--;
}

// Attaching is collective over each group (NCCL makes a communicator per group), and every rank
// made its groups in the same order (comm_split is collective over the parent), so attaching in
// creation order meets the other members group by group.
void comm_set_device_backend(const CommDeviceBackend *backend) {
    if (!stream.started) fatal("comm_set_device_backend before comm_init()");
    for (int i = stream.n_groups - 1; stream.device && i >= 0; i--) {
        stream.device->detach(stream.groups[i], stream.groups[i]->device_state);
        stream.groups[i]->device_state = NULL;
    }
    stream.device = backend;
    for (int i = 0; backend && i < stream.n_groups; i++) stream.groups[i]->device_state = backend->attach(stream.groups[i]);
}

const CommDeviceBackend *comm_device_backend(void) { return stream.device; }

// ================================================================================================
// Starting operations (on the caller's thread: misuse is caught here, before anything is queued)
// ================================================================================================

static void check_rank(const char *op, const Comm *c, int r, const char *what) {
    if (r < 0 || r >= c->size) fatal("comm: %s on group %s: %s %d is not in [0, %d)", op, c->name, what, r, c->size);
}

static void check_reduce(const CommCall *call) {
    if (call->op != COMM_SUM && call->op != COMM_AVG && call->op != COMM_MAX)
        fatal("comm: %s: unknown reduce op %d", call->name, (int)call->op);
    if (call->dtype == COMM_BYTE) fatal("comm: %s: bytes cannot be reduced", call->name);
    if (call->op == COMM_AVG && call->dtype == COMM_INT32)
        fatal("comm: %s: AVG needs a float dtype, not INT32", call->name);
}

static void check_collective(const CommCall *call) {
    const Comm *c = call->comm;
    comm_bytes(call->dtype, call->count);  // checks the dtype and the size
    if (call->count > SIZE_MAX / (size_t)c->size)
        fatal("comm: %s: %zu elements x %d ranks overflow", call->name, call->count, c->size);
    if (call->count && (!call->send || !call->recv))
        fatal("comm: %s on group %s: NULL buffer for %zu elements", call->name, c->name, call->count);
    if (call->kind == COMM_CALL_ALL_REDUCE || call->kind == COMM_CALL_REDUCE_SCATTER) check_reduce(call);
    if (call->kind == COMM_CALL_BROADCAST) check_rank(call->name, c, call->root, "root");
}

static void check_p2p(const CommCall *call) {
    const Comm *c = call->comm;
    const char *name = call->name;
    if (call->n_p2p < 0 || (call->n_p2p && !call->p2p))
        fatal("comm: %s on group %s: bad list of %d transfers", name, c->name, call->n_p2p);
    for (int i = 0; i < call->n_p2p; i++) {
        const CommP2P *t = &call->p2p[i];
        if (t->kind != COMM_SEND && t->kind != COMM_RECV) fatal("comm: %s: transfer %d has unknown kind %d", name, i, (int)t->kind);
        check_rank(name, c, t->peer, "peer");
        comm_bytes(t->dtype, t->count);
        if (t->count && !t->buf) fatal("comm: %s on group %s: transfer %d has a NULL buffer", name, c->name, i);
        if (t->tag < 0 || t->tag > stream.tag_ub)
            fatal("comm: %s on group %s: tag %d is not in [0, %d]", name, c->name, t->tag, stream.tag_ub);
    }
}

// ---- device or host ---------------------------------------------------------------------------------

// How many of call's buffers are device memory, of how many buffers. Those of empty transfers
// count for neither side, so that an empty operation (or transfer) goes where its peers' does
// whatever pointer each rank passes: MPI for an empty operation, the device for an empty transfer
// in a batch that moves data.
static void count_device_buffers(const CommCall *call, int *device, int *buffers) {
    *device = *buffers = 0;
    bool p2p = call->kind == COMM_CALL_P2P;
    int n = p2p ? call->n_p2p : 2;
    for (int i = 0; i < n; i++) {
        const void *b = p2p ? call->p2p[i].buf : i == 0 ? call->send : call->recv;
        if ((p2p ? call->p2p[i].count : call->count) == 0) continue;
        (*buffers)++;
        *device += stream.device->is_device(b);
    }
}

// True when the device backend takes call: all its buffers are device memory.
static bool on_device(const CommCall *call) {
    if (!stream.device) return false;
    int device, buffers;
    count_device_buffers(call, &device, &buffers);
    if (device > 0 && device < buffers)
        fatal("comm: %s on group %s: %d of its %d buffers are device memory and the others host memory; "
              "one operation's buffers must all be on one side",
              call->name, call->comm->name, device, buffers);
    return device > 0;
}

static CommHandle *start_on_device(const CommCall *call) {
    CommHandle *h = new_op(OP_P2P, call->name, call->comm);  // kind unused: never queued
    h->backend = stream.device;
    h->device_op = stream.device->start(call, call->comm->device_state);
    if (!h->device_op) fatal("comm: %s: the %s backend returned no handle", call->name, stream.device->name);
    return h;
}

// ---- on the comm stream (MPI) -----------------------------------------------------------------------

static CommHandle *start_p2p_on_host(const CommCall *call) {
    CommHandle *h = new_op(OP_P2P, call->name, call->comm);
    h->p2p = checked_calloc((size_t)call->n_p2p, sizeof *h->p2p);
    if (call->n_p2p) memcpy(h->p2p, call->p2p, (size_t)call->n_p2p * sizeof *call->p2p);
    h->seq = checked_calloc((size_t)call->n_p2p, sizeof *h->seq);
    h->n_p2p = call->n_p2p;
    return enqueue(h);
}

static CommHandle *start_on_host(const CommCall *call) {
    static const OpKind kinds[] = {[COMM_CALL_ALL_REDUCE] = OP_ALL_REDUCE, [COMM_CALL_REDUCE_SCATTER] = OP_REDUCE_SCATTER,
                                   [COMM_CALL_ALL_GATHER] = OP_ALL_GATHER, [COMM_CALL_BROADCAST] = OP_BROADCAST,
                                   [COMM_CALL_ALL_TO_ALL] = OP_ALL_TO_ALL};
    if (call->kind == COMM_CALL_P2P) return start_p2p_on_host(call);
    CommHandle *h = new_op(kinds[call->kind], call->name, call->comm);
    h->send = call->send;
    h->recv = call->recv;
    h->count = call->count;
    h->dtype = call->dtype;
    h->reduce = call->op;
    h->root = call->root;
    return enqueue(h);
}

CommHandle *comm_start(const CommCall *call) {
    if (!call) fatal("comm_start: NULL call");
    const char *name = call->name ? call->name : "operation";
    if (!stream.started) fatal("comm: %s before comm_init()", name);
    if (!call->comm) fatal("comm: %s on a NULL communicator", name);
    if ((unsigned)call->kind > COMM_CALL_P2P) fatal("comm: %s: unknown kind %d", name, (int)call->kind);
    CommCall checked = *call;
    checked.name = name;
    if (checked.kind == COMM_CALL_P2P) check_p2p(&checked);
    else check_collective(&checked);
    return on_device(&checked) ? start_on_device(&checked) : start_on_host(&checked);
}

CommHandle *comm_all_reduce_start(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op) {
    return comm_start(&(CommCall){.kind = COMM_CALL_ALL_REDUCE, .name = "all_reduce", .comm = c, .send = buf,
                                  .recv = buf, .count = count, .dtype = dtype, .op = op});
}

CommHandle *comm_reduce_scatter_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype,
                                      CommReduceOp op) {
    return comm_start(&(CommCall){.kind = COMM_CALL_REDUCE_SCATTER, .name = "reduce_scatter", .comm = c,
                                  .send = send, .recv = recv, .count = count, .dtype = dtype, .op = op});
}

CommHandle *comm_all_gather_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype) {
    return comm_start(&(CommCall){.kind = COMM_CALL_ALL_GATHER, .name = "all_gather", .comm = c, .send = send,
                                  .recv = recv, .count = count, .dtype = dtype});
}

CommHandle *comm_broadcast_start(Comm *c, void *buf, size_t count, CommDtype dtype, int root) {
    return comm_start(&(CommCall){.kind = COMM_CALL_BROADCAST, .name = "broadcast", .comm = c, .send = buf,
                                  .recv = buf, .count = count, .dtype = dtype, .root = root});
}

CommHandle *comm_all_to_all_start(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype) {
    return comm_start(&(CommCall){.kind = COMM_CALL_ALL_TO_ALL, .name = "all_to_all", .comm = c, .send = send,
                                  .recv = recv, .count = count, .dtype = dtype});
}

CommHandle *comm_barrier_start(Comm *c) { return enqueue(new_op(OP_BARRIER, "barrier", c)); }

static CommHandle *start_p2p(Comm *c, const CommP2P *ops, int n_ops, const char *name) {
    return comm_start(&(CommCall){.kind = COMM_CALL_P2P, .name = name, .comm = c, .p2p = ops, .n_p2p = n_ops});
}

CommHandle *comm_batch_start(Comm *c, const CommP2P *ops, int n_ops) { return start_p2p(c, ops, n_ops, "batch"); }

CommHandle *comm_send_start(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer, int tag) {
    CommP2P t = {COMM_SEND, (void *)buf, count, dtype, peer, tag};
    return start_p2p(c, &t, 1, "send");
}

CommHandle *comm_recv_start(Comm *c, void *buf, size_t count, CommDtype dtype, int peer, int tag) {
    CommP2P t = {COMM_RECV, buf, count, dtype, peer, tag};
    return start_p2p(c, &t, 1, "recv");
}

// ================================================================================================
// Blocking forms
// ================================================================================================

void comm_all_reduce(Comm *c, void *buf, size_t count, CommDtype dtype, CommReduceOp op) {
    comm_wait(comm_all_reduce_start(c, buf, count, dtype, op));
}

void comm_reduce_scatter(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype, CommReduceOp op) {
    comm_wait(comm_reduce_scatter_start(c, send, recv, count, dtype, op));
}

void comm_all_gather(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype) {
    comm_wait(comm_all_gather_start(c, send, recv, count, dtype));
}

void comm_broadcast(Comm *c, void *buf, size_t count, CommDtype dtype, int root) {
    comm_wait(comm_broadcast_start(c, buf, count, dtype, root));
}

void comm_all_to_all(Comm *c, const void *send, void *recv, size_t count, CommDtype dtype) {
    comm_wait(comm_all_to_all_start(c, send, recv, count, dtype));
}

void comm_barrier(Comm *c) { comm_wait(comm_barrier_start(c)); }

void comm_send(Comm *c, const void *buf, size_t count, CommDtype dtype, int peer, int tag) {
    comm_wait(comm_send_start(c, buf, count, dtype, peer, tag));
}

void comm_recv(Comm *c, void *buf, size_t count, CommDtype dtype, int peer, int tag) {
    comm_wait(comm_recv_start(c, buf, count, dtype, peer, tag));
}

void comm_sendrecv(Comm *c, const void *send, size_t send_count, int dst, void *recv, size_t recv_count, int src,
                   CommDtype dtype, int tag) {
    CommP2P pair[2] = {{COMM_SEND, (void *)send, send_count, dtype, dst, tag},
                       {COMM_RECV, recv, recv_count, dtype, src, tag}};
    comm_wait(start_p2p(c, pair, 2, "sendrecv"));
}
