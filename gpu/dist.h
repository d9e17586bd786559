// dist.h: the GPU model's one data-parallel helper beyond common/comm.h, whose comm_* calls take
// device buffers once gpu_comm_backend_init (gpu/comm_device.h) has registered a backend (NCCL, or
// MPI staged through pinned host memory). Gradients are averaged with comm_all_reduce itself; a
// model is broadcast with gpu_model_broadcast, which also refreshes the bf16 copy. The kernels
// queued after a blocking call see its result; the host reads it through the compute stream.
//
//   gpu_comm_backend_init(GPU_COMM_AUTO);
//   gpu_model_broadcast(dp, &m, 0);                               // every replica starts from rank 0's
//   gpu_model_backward(&m, 1.0);
//   comm_all_reduce(dp, m.grads, m.table.total_numel, COMM_FLOAT32, COMM_AVG);  // the dp average
#pragma once
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/comm.h"
#include "gpu/model.h"

// The root's weights to every rank: the fp32 master weights, then each rank's bf16 compute copy
// refreshed from them (the root's too: its fp32 weights may be new, e.g. a loaded checkpoint).
// Use this, not comm_broadcast on m->params: a stale bf16 copy would train on the old weights.
void gpu_model_broadcast(Comm *c, GpuModel *m, int root);

#ifdef __cplusplus
}
#endif
