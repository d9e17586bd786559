// nccl.cu: the NCCL communicator of gpu/nccl.h, and comm.h's "nccl" device backend built on it.
#include <nccl.h>

#include "gpu/comm_device.h"
#include "gpu/internal.cuh"
#include "gpu/nccl.h"

#define NCCL_CHECK(call)                                                                              \
    do {                                                                                              \
        ncclResult_t r_ = (call);                                                                     \
        if (r_ != ncclSuccess) fatal("NCCL error: %s at %s:%d: %s", #call, __FILE__, __LINE__,       \
                                     ncclGetErrorString(r_));                                         \
    } while (0)

struct GpuComm {
    Comm *group;
    ncclComm_t nccl;
};

struct GpuCommOp {
    cudaEvent_t done;
};

// The NCCL stream: one for every GpuComm of the process (nccl.h), made with the first, destroyed
// with the last.
static cudaStream_t nccl_stream;
static int n_comms;

static ncclDataType_t nccl_type(CommDtype dtype) {
    switch (dtype) {
    case COMM_FLOAT32: return ncclFloat32;
    case COMM_FLOAT64: return ncclFloat64;
    case COMM_INT32: return ncclInt32;
    case COMM_BYTE: return ncclUint8;
    }
    fatal("gpu_comm: unknown dtype %d", (int)dtype);
}

static ncclRedOp_t nccl_op(CommDtype dtype, CommReduceOp op) {
    if (dtype == COMM_BYTE) fatal("gpu_comm: bytes cannot be reduced");
    if (op == COMM_AVG && dtype != COMM_FLOAT32 && dtype != COMM_FLOAT64) fatal("gpu_comm: AVG needs a float dtype");
    switch (op) {
    case COMM_SUM: return ncclSum;
    case COMM_AVG: return ncclAvg;
    case COMM_MAX: return ncclMax;
    }
    fatal("gpu_comm: unknown reduction %d", (int)op);
}

GpuComm *gpu_comm_create(Comm *c) {
    GpuComm *g = (GpuComm *)calloc(1, sizeof(GpuComm));
    if (!g) fatal("out of memory");
    g->group = c;
    ncclUniqueId id;
    if (comm_rank(c) == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    comm_broadcast(c, &id, sizeof id, COMM_BYTE, 0);
    NCCL_CHECK(ncclCommInitRank(&g->nccl, comm_size(c), id, comm_rank(c)));
    if (n_comms++ == 0) CUDA_CHECK(cudaStreamCreateWithFlags(&nccl_stream, cudaStreamNonBlocking));
    return g;
}

void gpu_comm_free(GpuComm *g) {
    if (!g) return;
    CUDA_CHECK(cudaStreamSynchronize(nccl_stream));
    NCCL_CHECK(ncclCommDestroy(g->nccl));
    if (--n_comms == 0) CUDA_CHECK(cudaStreamDestroy(nccl_stream));
    free(g);
}

// The NCCL stream waits for the work queued so far on the compute stream.
static void after_compute(void) {
    cudaEvent_t ready;
    CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ready, gpu_stream()));
    CUDA_CHECK(cudaStreamWaitEvent(nccl_stream, ready, 0));
    CUDA_CHECK(cudaEventDestroy(ready));  // released once the wait no longer needs it
}

// The event that marks the end of what was just queued on the NCCL stream.
static GpuCommOp *queued(void) {
    GpuCommOp *op = (GpuCommOp *)calloc(1, sizeof(GpuCommOp));
    if (!op) fatal("out of memory");
    CUDA_CHECK(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(op->done, nccl_stream));
    return op;
}

GpuCommOp *gpu_comm_all_reduce_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, CommReduceOp op) {
    after_compute();
    NCCL_CHECK(ncclAllReduce(buf, buf, count, nccl_type(dtype), nccl_op(dtype, op), g->nccl, nccl_stream));
    return queued();
}

GpuCommOp *gpu_comm_reduce_scatter_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype,
                                         CommReduceOp op) {
    after_compute();
    NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(dtype, op), g->nccl, nccl_stream));
    return queued();
}

GpuCommOp *gpu_comm_all_gather_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype) {
    after_compute();
    NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(dtype), g->nccl, nccl_stream));
    return queued();
}

GpuCommOp *gpu_comm_broadcast_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, int root) {
    after_compute();
    NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(dtype), root, g->nccl, nccl_stream));
    return queued();
}

// Block r of send to rank r, block r of recv from rank r, all in one NCCL group.
GpuCommOp *gpu_comm_all_to_all_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype) {
    after_compute();
    size_t block = comm_bytes(dtype, count);
    if (count) {
        NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < comm_size(g->group); r++) {
            NCCL_CHECK(ncclSend((const char *)send + r * block, count, nccl_type(dtype), r, g->nccl, nccl_stream));
            NCCL_CHECK(ncclRecv((char *)recv + r * block, count, nccl_type(dtype), r, g->nccl, nccl_stream));
        }
        NCCL_CHECK(ncclGroupEnd());
    }
    return queued();
}

// The order NCCL posts a batch in: by tag, then by position (MPI's matching order; see nccl.h).
static int *posting_order(const CommP2P *ops, int n_ops) {
    int *order = (int *)calloc(n_ops ? n_ops : 1, sizeof(int));
    if (!order) fatal("out of memory");
    for (int i = 0; i < n_ops; i++) {
        int j = i;
        for (; j > 0 && ops[order[j - 1]].tag > ops[i].tag; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    return order;
}

GpuCommOp *gpu_comm_batch_start(GpuComm *g, const CommP2P *ops, int n_ops) {
    after_compute();
    int *order = posting_order(ops, n_ops);
    NCCL_CHECK(ncclGroupStart());  // every transfer in flight at once: a ring exchange cannot deadlock
    for (int k = 0; k < n_ops; k++) {
        const CommP2P *t = &ops[order[k]];
        if (t->count == 0) continue;
        if (t->kind == COMM_SEND)
            NCCL_CHECK(ncclSend(t->buf, t->count, nccl_type(t->dtype), t->peer, g->nccl, nccl_stream));
        else
            NCCL_CHECK(ncclRecv(t->buf, t->count, nccl_type(t->dtype), t->peer, g->nccl, nccl_stream));
    }
    NCCL_CHECK(ncclGroupEnd());
    free(order);
    return queued();
}

void gpu_comm_wait(GpuCommOp *op) {
    CUDA_CHECK(cudaStreamWaitEvent(gpu_stream(), op->done, 0));
    CUDA_CHECK(cudaEventDestroy(op->done));
    free(op);
}

void gpu_comm_sync(GpuCommOp *op) {
    CUDA_CHECK(cudaEventSynchronize(op->done));
    CUDA_CHECK(cudaEventDestroy(op->done));
    free(op);
}

bool gpu_comm_test(GpuCommOp *op) {
    cudaError_t err = cudaEventQuery(op->done);
    if (err == cudaErrorNotReady) return false;
    CUDA_CHECK(err);
    return true;
}

// ================================================================================================
// comm.h's "nccl" device backend: a GpuComm per group, each call mapped onto the functions above
// ================================================================================================

static bool nccl_is_device(const void *ptr) { return gpu_is_device_pointer(ptr); }
static void *nccl_attach(Comm *c) { return gpu_comm_create(c); }
static void nccl_detach(Comm *, void *group_state) { gpu_comm_free((GpuComm *)group_state); }

static void *nccl_start(const CommCall *call, void *group_state) {
    GpuComm *g = (GpuComm *)group_state;
    switch (call->kind) {
    case COMM_CALL_ALL_REDUCE: return gpu_comm_all_reduce_start(g, call->recv, call->count, call->dtype, call->op);
    case COMM_CALL_REDUCE_SCATTER:
        return gpu_comm_reduce_scatter_start(g, call->send, call->recv, call->count, call->dtype, call->op);
    case COMM_CALL_ALL_GATHER: return gpu_comm_all_gather_start(g, call->send, call->recv, call->count, call->dtype);
    case COMM_CALL_BROADCAST: return gpu_comm_broadcast_start(g, call->recv, call->count, call->dtype, call->root);
    case COMM_CALL_ALL_TO_ALL: return gpu_comm_all_to_all_start(g, call->send, call->recv, call->count, call->dtype);
    case COMM_CALL_P2P: return gpu_comm_batch_start(g, call->p2p, call->n_p2p);
    }
    fatal("nccl backend: %s: unknown kind %d", call->name, (int)call->kind);
}

static bool nccl_test(void *op) { return gpu_comm_test((GpuCommOp *)op); }
static void nccl_wait(void *op) { gpu_comm_wait((GpuCommOp *)op); }  // an event wait: the host goes on

// name, is_device, attach, detach, start, test, wait
static const CommDeviceBackend nccl_backend = {"nccl", nccl_is_device, nccl_attach, nccl_detach,
                                               nccl_start, nccl_test, nccl_wait};

const CommDeviceBackend *gpu_nccl_backend(void) { return &nccl_backend; }
