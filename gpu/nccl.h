// nccl.h (gpu/): collectives and point-to-point transfers on device buffers over NCCL, on a CUDA
// stream of their own, with the start/wait shape of common/comm.h. Built where the Makefile finds
// NCCL (HAVE_NCCL). It is also comm.h's "nccl" device backend (gpu/comm_device.h), which makes a
// GpuComm for every group: programs use comm_* on device buffers, and this layer directly only to
// test it.
//
//   GpuComm *g = gpu_comm_create(dp);                 // collective over dp (an MPI group)
//   GpuCommOp *op = gpu_comm_all_reduce_start(g, grads, n, COMM_FLOAT32, COMM_AVG);
//   ... more kernels on the compute stream ...        // overlap: NCCL runs on its own stream
//   gpu_comm_wait(op);                                // the compute stream waits for it
//
// Bootstrap: rank 0 of the group asks NCCL for a unique id and the MPI communicator broadcasts it
// (comm_broadcast), then every rank joins with ncclCommInitRank on its current device (gpu_init's).
// NCCL needs one device per rank: ranks that share a GPU use the staged backend instead.
//
// One comm stream. Every GpuComm of the process queues on the same NCCL stream, so operations run
// one after another in the order they were started, whatever their group, as on comm.h's comm
// stream: an all-reduce started on the result of a reduce-scatter of another group (HSDP) reads
// that result.
//
// Ordering, the CUDA way: *_start records an event on the compute stream and makes the NCCL stream
// wait for it (so the operation reads what the kernels queued before it wrote), queues the
// operation, and records its completion event; gpu_comm_wait makes the compute stream wait for
// that event. Neither blocks the host; gpu_comm_sync does. Buffers belong to the operation from
// start until what follows the wait on the compute stream. Reductions are NCCL's: reproducible run
// to run for a fixed setup, but not the MPI backend's rank-order folds.
//
// Point to point (gpu_comm_batch_start): the transfers go inside ncclGroupStart/End, so a ring
// exchange's sends and receives progress together. NCCL matches a pair's messages in the order they
// are posted and has no tags: each batch is posted in (tag, position) order, which is the order MPI
// matches the same batch in, so a batch pair that matches on MPI matches here. Empty transfers move
// nothing (NCCL skips them).
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
void gpu_comm_free(GpuComm *g);     // waits for the NCCL stream

// As comm.h's, on device buffers; dtype COMM_FLOAT32, COMM_FLOAT64, COMM_INT32 or COMM_BYTE (no
// reduction on bytes).
GpuCommOp *gpu_comm_all_reduce_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, CommReduceOp op);
GpuCommOp *gpu_comm_reduce_scatter_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype,
                                         CommReduceOp op);
GpuCommOp *gpu_comm_all_gather_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype);
GpuCommOp *gpu_comm_broadcast_start(GpuComm *g, void *buf, size_t count, CommDtype dtype, int root);
// send (count * size): block r goes to rank r; recv (count * size): block r came from rank r.
GpuCommOp *gpu_comm_all_to_all_start(GpuComm *g, const void *send, void *recv, size_t count, CommDtype dtype);
// Every transfer of ops (peers are ranks of the group), in one NCCL group.
GpuCommOp *gpu_comm_batch_start(GpuComm *g, const CommP2P *ops, int n_ops);
void gpu_comm_wait(GpuCommOp *op);  // the compute stream waits; frees op
void gpu_comm_sync(GpuCommOp *op);  // the host waits; frees op
bool gpu_comm_test(GpuCommOp *op);  // has it finished on the device? (the op still needs a wait)

#ifdef __cplusplus
}
#endif
