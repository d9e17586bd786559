// dist.h: the GPU model's data-parallel helpers on device buffers, through common/comm.h: every comm_*
// call takes device buffers once gpu_comm_backend_init (gpu/comm_device.h) has registered a
// backend, which decides how they move (NCCL, or MPI staged through pinned host memory). These are
// comm.h's blocking forms, start + wait: the kernels queued after them see the result; the host
// reads it through the compute stream (gpu_download).
//
//   gpu_comm_backend_init(GPU_COMM_AUTO);
//   gpu_model_broadcast(dp, &m, 0);                               // every replica starts from rank 0's
//   gpu_model_backward(&m, 1.0);
//   gpu_all_reduce(dp, m.grads, m.table.total_numel, COMM_AVG);   // data parallel: the dp average
#pragma once
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/comm.h"
#include "gpu/model.h"

// device_buf (count fp32) becomes the reduction over c's ranks: comm_all_reduce on it.
void gpu_all_reduce(Comm *c, float *device_buf, size_t count, CommReduceOp op);
// The root's device_buf (count fp32) is copied to every rank's: comm_broadcast on it.
void gpu_broadcast(Comm *c, float *device_buf, size_t count, int root);
// The root's weights to every rank: the fp32 master weights, then each rank's bf16 compute copy
// refreshed from them (the root's too: its fp32 weights may be new, e.g. a loaded checkpoint).
// Use this, not gpu_broadcast on m->params, for a model: a stale bf16 copy would train on the old
// weights.
void gpu_model_broadcast(Comm *c, GpuModel *m, int root);

#ifdef __cplusplus
}
#endif
