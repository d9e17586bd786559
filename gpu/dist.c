// dist.c: device collectives staged through host memory (dist.h).
#include "gpu/dist.h"

#include <stdlib.h>

#include "common/log.h"
#include "gpu/runtime.h"

// One staging buffer, grown as needed and kept: a training loop calls with the same sizes.
static float *staging;
static size_t staging_count;

static float *stage(size_t count) {
    if (count > staging_count) {
        free(staging);
        staging = malloc(sizeof(float) * count);
        if (!staging) fatal("out of host memory staging %zu floats for a GPU collective", count);
        staging_count = count;
    }
    return staging;
}

void gpu_all_reduce(Comm *c, float *device_buf, size_t count, CommReduceOp op) {
    if (comm_size(c) == 1) return;  // a sum, average or max over one rank is the buffer itself
    float *host = stage(count);
    gpu_download(host, device_buf, sizeof(float) * count);
    comm_all_reduce(c, host, count, COMM_FLOAT32, op);
    gpu_upload(device_buf, host, sizeof(float) * count);
}

void gpu_broadcast(Comm *c, float *device_buf, size_t count, int root) {
    if (comm_size(c) == 1) return;
    float *host = stage(count);
    if (comm_rank(c) == root) gpu_download(host, device_buf, sizeof(float) * count);
    comm_broadcast(c, host, count, COMM_FLOAT32, root);
    if (comm_rank(c) != root) gpu_upload(device_buf, host, sizeof(float) * count);
}

void gpu_model_broadcast(Comm *c, GpuModel *m, int root) {
    gpu_broadcast(c, m->params, m->table.total_numel, root);
    gpu_model_refresh_compute_copy(m);
}
