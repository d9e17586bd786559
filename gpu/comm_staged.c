// comm_staged.c: the staged device backend of common/comm.h (gpu/comm_device.h): MPI on pinned host
// copies of device buffers. For ranks that share a GPU (NCCL refuses them) and builds without NCCL;
// its reductions are common/comm.c's bit-reproducible rank-order folds.
//
// One operation: two steps on the caller's thread at start, one on the comm worker, one at wait.
//   start  1. every input is copied down into pinned staging memory, queued on the compute stream
//             (so after the kernels that wrote it), and the host waits for the stream: MPI must not
//             send the bytes before they are there;
//          2. the same operation is started on the staging memory (comm_start on host memory: MPI,
//             on the comm worker, in order with every other operation of the rank);
//   worker 3. MPI runs it;
//   wait   4. the host waits for the MPI operation, then queues the copies of the outputs up on the
//             compute stream: the kernels queued after comm_wait run after them.
// So start blocks the host until the compute stream has caught up (the price of staging), and the
// MPI part overlaps whatever the host queues on the device in the meantime.
//
// Order between staged operations. comm.h promises that an operation reads what an earlier one
// writes even before that one was waited for (FSDP: a reduce-scatter, then an all-reduce of its
// result). Here the earlier result reaches the device only in step 4, so start first finishes
// (step 4) every earlier operation up to the last one whose outputs overlap the new inputs. Copies
// up are always queued in start order: finishing an operation finishes those started before it,
// which the FIFO worker has already run.
//
// Staging memory is a pool of pinned buffers, one per operation in flight. A buffer returns to the
// pool as soon as its copies up are queued, before they have run: the next operation that takes it
// waits for the compute stream (step 1) before MPI may write into it, and by then the stream has
// run those copies.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "gpu/comm_device.h"
#include "gpu/runtime.h"

// A piece of device memory and its place in the operation's staging buffer.
typedef struct {
    void *device;
    size_t offset, bytes;
} Region;

typedef struct Staging {
    void *host;  // pinned
    size_t bytes;
    struct Staging *next;  // in the pool
} Staging;

typedef struct StagedOp {
    CommHandle *mpi;  // the operation on the staging memory; NULL once finished (step 4 done)
    Staging *staging;
    Region *down, *up;  // inputs to copy down at start, outputs to copy up when finished
    int n_down, n_up;
    struct StagedOp *next;  // the unfinished operations, in start order
} StagedOp;

static struct {
    StagedOp *head, *tail;  // unfinished, in start order
    Staging *pool;
    int groups_attached;
} staged;

static void *checked_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) fatal("staged comm: out of host memory");
    return p;
}

// ---- staging memory ---------------------------------------------------------------------------------

#define MIN_STAGING_BYTES ((size_t)1 << 16)

// The smallest pooled buffer of at least `bytes`, or a new one.
static Staging *take_staging(size_t bytes) {
    Staging **best = NULL;
    for (Staging **s = &staged.pool; *s; s = &(*s)->next)
        if ((*s)->bytes >= bytes && (!best || (*s)->bytes < (*best)->bytes)) best = s;
    if (best) {
        Staging *s = *best;
        *best = s->next;
        return s;
    }
    Staging *s = checked_calloc(1, sizeof *s);
    s->bytes = bytes > MIN_STAGING_BYTES ? bytes : MIN_STAGING_BYTES;
    s->host = gpu_host_alloc(s->bytes);
    return s;
}

static void give_back(Staging *s) {
    s->next = staged.pool;
    staged.pool = s;
}

static void free_pool(void) {
    while (staged.pool) {
        Staging *s = staged.pool;
        staged.pool = s->next;
        gpu_host_free(s->host);
        free(s);
    }
}

// ---- the layout of one operation in its staging buffer -----------------------------------------------

enum { DOWN = 1, UP = 2 };

// Places `bytes` of device memory at the end of the staging layout (*used), to be copied down,
// up or both; returns its offset.
static size_t place(StagedOp *op, size_t *used, const void *device, size_t bytes, int copies) {
    size_t offset = *used;
    *used += (bytes + 63) / 64 * 64;
    if (copies & DOWN) op->down[op->n_down++] = (Region){(void *)device, offset, bytes};
    if (copies & UP) op->up[op->n_up++] = (Region){(void *)device, offset, bytes};
    return offset;
}

// Lays call's buffers out (offsets of its send and recv buffers, or of each transfer in at[]) and
// returns the staging bytes it needs. An in-place buffer is staged once, and copied both ways (an
// all-reduce) or one way (a broadcast: down at the root, up elsewhere).
static size_t lay_out(StagedOp *op, const CommCall *call, size_t *send_at, size_t *recv_at, size_t *at) {
    int n = comm_size(call->comm);
    size_t block = comm_bytes(call->dtype, call->count), used = 0;
    switch (call->kind) {
    case COMM_CALL_ALL_REDUCE: *send_at = *recv_at = place(op, &used, call->recv, block, DOWN | UP); break;
    case COMM_CALL_BROADCAST:
        *send_at = *recv_at = place(op, &used, call->recv, block, comm_rank(call->comm) == call->root ? DOWN : UP);
        break;
    case COMM_CALL_REDUCE_SCATTER:  // send (n blocks), recv (1 block)
        *send_at = place(op, &used, call->send, block * n, DOWN);
        *recv_at = place(op, &used, call->recv, block, UP);
        break;
    case COMM_CALL_ALL_GATHER:  // send (1 block), recv (n blocks)
        *send_at = place(op, &used, call->send, block, DOWN);
        *recv_at = place(op, &used, call->recv, block * n, UP);
        break;
    case COMM_CALL_ALL_TO_ALL:  // n blocks each way
        *send_at = place(op, &used, call->send, block * n, DOWN);
        *recv_at = place(op, &used, call->recv, block * n, UP);
        break;
    case COMM_CALL_P2P:  // empty transfers stay as they are: MPI still sends their empty message
        for (int i = 0; i < call->n_p2p; i++) {
            const CommP2P *t = &call->p2p[i];
            if (t->count) at[i] = place(op, &used, t->buf, comm_bytes(t->dtype, t->count), t->kind == COMM_SEND ? DOWN : UP);
        }
        break;
    }
    return used;
}

// ---- finishing: the MPI part waited for, the outputs queued up ------------------------------------

static void copy_up(const StagedOp *op) {
    for (int i = 0; i < op->n_up; i++)
        gpu_upload_async(op->up[i].device, (char *)op->staging->host + op->up[i].offset, op->up[i].bytes);
}

// Finishes the unfinished operations in start order, through `last`.
static void finish_through(const StagedOp *last) {
    for (;;) {
        StagedOp *op = staged.head;
        if (!op) fatal("staged comm: finishing an operation that is not in flight");
        comm_wait(op->mpi);  // the host blocks until MPI is done with the staging memory
        op->mpi = NULL;
        copy_up(op);  // on the compute stream: before every kernel queued from now on
        give_back(op->staging);  // reusable now: see the header
        op->staging = NULL;
        staged.head = op->next;
        if (!staged.head) staged.tail = NULL;
        if (op == last) return;
    }
}

static bool overlap(const Region *a, const Region *b) {
    uintptr_t a0 = (uintptr_t)a->device, b0 = (uintptr_t)b->device;
    return a->bytes && b->bytes && a0 < b0 + b->bytes && b0 < a0 + a->bytes;
}

// Before op reads its inputs: the last unfinished operation that writes any of them, or NULL.
static const StagedOp *last_writer_of_inputs(const StagedOp *op) {
    const StagedOp *last = NULL;
    for (const StagedOp *w = staged.head; w; w = w->next)
        for (int i = 0; i < w->n_up; i++)
            for (int j = 0; j < op->n_down; j++)
                if (overlap(&w->up[i], &op->down[j])) last = w;
    return last;
}

// ---- the backend's functions ------------------------------------------------------------------------

static void copy_down(const StagedOp *op) {
    for (int i = 0; i < op->n_down; i++)
        gpu_download_async((char *)op->staging->host + op->down[i].offset, op->down[i].device, op->down[i].bytes);
    // Step 1's wait, also when nothing was copied: MPI may write the staging buffer from now on, and
    // the compute stream must be past the copies up that last read it (and the host must hold the
    // inputs before MPI sends them).
    gpu_synchronize();
}

static void *staged_start(const CommCall *call, void *group_state) {
    (void)group_state;
    int n_regions = (call->kind == COMM_CALL_P2P ? call->n_p2p : 0) + 2;
    StagedOp *op = checked_calloc(1, sizeof *op);
    op->down = checked_calloc((size_t)n_regions, sizeof *op->down);
    op->up = checked_calloc((size_t)n_regions, sizeof *op->up);
    size_t send_at = 0, recv_at = 0, *at = checked_calloc((size_t)n_regions, sizeof *at);
    size_t bytes = lay_out(op, call, &send_at, &recv_at, at);

    const StagedOp *writer = last_writer_of_inputs(op);
    if (writer) finish_through(writer);  // its result must be on the device before we copy it down
    op->staging = take_staging(bytes);
    copy_down(op);

    // The same operation on the staging memory: host buffers, so comm.c runs it through MPI.
    char *host = op->staging->host;
    CommCall on_host = *call;
    CommP2P *p2p = NULL;
    if (call->kind == COMM_CALL_P2P) {
        p2p = checked_calloc((size_t)call->n_p2p, sizeof *p2p);
        for (int i = 0; i < call->n_p2p; i++) {
            p2p[i] = call->p2p[i];
            if (p2p[i].count) p2p[i].buf = host + at[i];
        }
        on_host.p2p = p2p;
    } else {
        on_host.send = host + send_at;
        on_host.recv = host + recv_at;
    }
    op->mpi = comm_start(&on_host);
    free(p2p);
    free(at);

    if (staged.tail) staged.tail->next = op;
    else staged.head = op;
    staged.tail = op;
    return op;
}

static bool staged_test(void *handle) {
    StagedOp *op = handle;
    return !op->mpi || comm_test(op->mpi);
}

static void staged_wait(void *handle) {
    StagedOp *op = handle;
    if (op->mpi) finish_through(op);
    free(op->down);
    free(op->up);
    free(op);
}

static bool staged_is_device(const void *ptr) { return gpu_is_device_pointer(ptr); }

// No state per group: the staging pool is the process's, freed when the last group lets go.
static void *staged_attach(Comm *c) {
    staged.groups_attached++;
    return c;
}

static void staged_detach(Comm *c, void *group_state) {
    (void)c, (void)group_state;
    if (--staged.groups_attached > 0) return;
    if (staged.tail) finish_through(staged.tail);  // operations never waited for: let them land
    free_pool();
}

static const CommDeviceBackend staged_backend = {
    .name = "staged",
    .is_device = staged_is_device,
    .attach = staged_attach,
    .detach = staged_detach,
    .start = staged_start,
    .test = staged_test,
    .wait = staged_wait,
};

const CommDeviceBackend *gpu_staged_backend(void) { return &staged_backend; }
