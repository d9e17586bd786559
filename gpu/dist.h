// dist.h: collectives on device buffers through common/comm.h's MPI communicator, staged through
// host memory: copy down, the comm stream's collective, copy up. Two PCIe copies per call make it
// slower than NCCL, but it works whatever devices the ranks have -- several ranks on one GPU
// included, which NCCL refuses -- and its reductions are the MPI backend's bit-reproducible
// rank-order folds (common/COMM.md). Blocking, like the comm_* blocking forms.
//
//   gpu_model_backward(&m, 1.0);
//   gpu_model_broadcast(dp, &m, 0);                                 // every replica starts from rank 0's
//   gpu_all_reduce(dp, m.grads, m.table.total_numel, COMM_AVG);   // data parallel: the dp average
#pragma once
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/comm.h"
#include "gpu/model.h"

// device_buf (count fp32) becomes the reduction over c's ranks.
void gpu_all_reduce(Comm *c, float *device_buf, size_t count, CommReduceOp op);
// The root's device_buf (count fp32) is copied to every rank's.
void gpu_broadcast(Comm *c, float *device_buf, size_t count, int root);
// The root's weights to every rank: the fp32 master weights, then each rank's bf16 compute copy
// refreshed from them (the root's too: its fp32 weights may be new, e.g. a loaded checkpoint).
// Use this, not gpu_broadcast on m->params, for a model: a stale bf16 copy would train on the old
// weights.
void gpu_model_broadcast(Comm *c, GpuModel *m, int root);

#ifdef __cplusplus
}
#endif
