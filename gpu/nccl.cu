// nccl.cu: the NCCL communicator of gpu/nccl.h.
#include <nccl.h>

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
    cudaStream_t stream;
};

struct GpuCommOp {
    cudaEvent_t done;
};

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
    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    return g;
}

void gpu_comm_free(GpuComm *g) {
    if (!g) return;
    CUDA_CHECK(cudaStreamSynchronize(g->stream));
    NCCL_CHECK(ncclCommDestroy(g->nccl));
    CUDA_CHECK(cudaStreamDestroy(g->stream));
    free(g);
}

// The NCCL stream waits for the work queued so far on the compute stream.
static void after_compute(GpuComm *g) {
    cudaEvent_t ready;
    CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ready, gpu_stream()));
    CUDA_CHECK(cudaStreamWaitEvent(g->stream, ready, 0));
    CUDA_CHECK(cudaEventDestroy(ready));  // released once the wait no longer needs it
}

static GpuCommOp *queued(GpuComm *g) {
    GpuCommOp *op = (GpuCommOp *)calloc(1, sizeof(GpuCommOp));
    if (!op) fatal("out of memory");
    CUDA_CHECK(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(op->done, g->stream));
    return op;
}

GpuCommOp *gpu_comm_all_reduce_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, CommReduceOp op) {
    after_compute(g);
    NCCL_CHECK(ncclAllReduce(buf, buf, count, nccl_type(dtype), nccl_op(dtype, op), g->nccl, g->stream));
    return queued(g);
}

GpuCommOp *gpu_comm_reduce_scatter_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype,
                                         CommReduceOp op) {
    after_compute(g);
    NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(dtype, op), g->nccl, g->stream));
    return queued(g);
}

GpuCommOp *gpu_comm_all_gather_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype) {
    after_compute(g);
    NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(dtype), g->nccl, g->stream));
    return queued(g);
}

GpuCommOp *gpu_comm_broadcast_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, int root) {
    after_compute(g);
    NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(dtype), root, g->nccl, g->stream));
    return queued(g);
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
