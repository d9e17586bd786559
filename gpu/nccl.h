// nccl.h (gpu/): collectives on device buffers over NCCL, on a CUDA stream of their own, with the
// start/wait shape of common/comm.h. Built where the Makefile finds NCCL (HAVE_NCCL).
//
//   GpuComm *g = gpu_comm_create(dp);                 // collective over dp (an MPI group)
//   GpuCommOp *op = gpu_comm_all_reduce_start(g, grads, n, COMM_AVG);
//   ... more kernels on the compute stream ...        // overlap: NCCL runs on its own stream
//   gpu_comm_wait(op);                                // the compute stream waits for it
//
// Bootstrap: rank 0 of the group asks NCCL for a unique id and the MPI communicator broadcasts it
// (comm_broadcast), then every rank joins with ncclCommInitRank on its current device (gpu_init's).
// NCCL needs one device per rank: ranks that share a GPU use gpu/dist.h (the MPI backend) instead.
//
// Ordering, the CUDA way: *_start records an event on the compute stream and makes the NCCL stream
// wait for it (so the collective reads what the kernels queued before it wrote), queues the
// collective, and records its completion event; gpu_comm_wait makes the compute stream wait for
// that event. Neither blocks the host; gpu_comm_sync does. Buffers belong to the collective from
// start until what follows the wait on the compute stream. Reductions are NCCL's: reproducible run
// to run for a fixed setup, but not the MPI backend's rank-order folds.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/comm.h"

typedef struct GpuComm GpuComm;
typedef struct GpuCommOp GpuCommOp;

GpuComm *gpu_comm_create(Comm *c);  // collective over c; needs gpu_init
void gpu_comm_free(GpuComm *g);     // waits for its stream

// As comm.h's, on device buffers; dtype COMM_FLOAT32, COMM_FLOAT64, COMM_INT32 or COMM_BYTE (no
// reduction on bytes).
GpuCommOp *gpu_comm_all_reduce_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, CommReduceOp op);
GpuCommOp *gpu_comm_reduce_scatter_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype,
                                         CommReduceOp op);
GpuCommOp *gpu_comm_all_gather_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype);
GpuCommOp *gpu_comm_broadcast_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, int root);
void gpu_comm_wait(GpuCommOp *op);  // the compute stream waits; frees op
void gpu_comm_sync(GpuCommOp *op);  // the host waits; frees op

#ifdef __cplusplus
}
#endif
