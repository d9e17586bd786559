// test_gpu_nccl.c: gpu/nccl.h's collectives (`make test-gpu` runs it alone: NCCL with a world of
// one rank; under mpirun with one GPU per rank it checks N ranks). Values are small integers, so
// every sum is exact in any order and the results are compared bit for bit.
//
// The ordering test: a slow kernel scales the buffer on the compute stream right before an
// out-of-place all-gather is started, and a quick one scales the head of the result right after the
// wait. The expected values hold only if the NCCL stream waited for the first kernel and the
// compute stream for the collective; the emulator's streams (simulated durations) run the work in
// the wrong order when either wait is missing.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "gpu/nccl.h"
#include "gpu/ops.h"
#include "tests/gpu/gpu_test_util.h"

static void check_values(const char *name, const float *got, const float *want, size_t n) {
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (got[i] != want[i]) bad = i;
    if (bad == n) report(name, true, "%zu values exact", n);
    else report(name, false, "[%zu] = %g, expected %g", bad, got[bad], want[bad]);
}

int main(int argc, char **argv) {
    if (!gpu_test_start_ranks("test_gpu_nccl", &argc, &argv, true)) return 0;
    Comm *world = comm_world();
    int rank = comm_rank(world), size = comm_size(world);
    GpuComm *g = gpu_comm_create(world);

    size_t n = 4099;  // not a multiple of anything
    float *host = malloc(sizeof(float) * n * size), *want = malloc(sizeof(float) * n * size);
    float *got = malloc(sizeof(float) * n * size);
    float *buf = gpu_alloc(MEM_COMM, sizeof(float) * n), *all = gpu_alloc(MEM_COMM, sizeof(float) * n * size);
    char name[64];

    // all-reduce SUM: rank r holds (i % 97) + r; the sum is size (i % 97) + size (size - 1) / 2.
    for (size_t i = 0; i < n; i++) host[i] = (float)(i % 97) + rank;
    for (size_t i = 0; i < n; i++) want[i] = (float)(size * (i % 97)) + (float)(size * (size - 1) / 2);
    gpu_upload(buf, host, sizeof(float) * n);
    gpu_comm_sync(gpu_comm_all_reduce_start(g, buf, n, COMM_FLOAT32, COMM_SUM));
    gpu_download(got, buf, sizeof(float) * n);
    snprintf(name, sizeof name, "all-reduce sum (%d ranks)", size);
    check_values(name, got, want, n);

    // Ordering, two ways an out-of-place all-gather can go wrong (an in-place collective on one rank
    // moves nothing, so it could not show either). The buffer is large enough that scaling it takes
    // longer than gathering it: (1) without the NCCL stream waiting for the compute stream, the
    // all-gather would copy the buffer before the slow kernel has scaled it; (2) without the compute
    // stream waiting for the all-gather, a quick kernel on the first elements of the result would run
    // before the gather lands and be overwritten. On the emulator, streams run with simulated
    // durations (tests/gpu/emu), and deleting either event wait in gpu/nccl.cu fails this check.
    size_t big = (size_t)1 << 16, head = 256;
    float *bsend = gpu_alloc(MEM_COMM, sizeof(float) * big), *brecv = gpu_alloc(MEM_COMM, sizeof(float) * big * size);
    float *bhost = malloc(sizeof(float) * big * size), *bwant = malloc(sizeof(float) * big * size);
    for (size_t i = 0; i < big; i++) bhost[i] = (float)(rank + 2 * (int)(i % 61));
    for (int r = 0; r < size; r++)
        for (size_t i = 0; i < big; i++) {
            float v = 3.0f * (float)(r + 2 * (int)(i % 61));
            bwant[r * big + i] = r == 0 && i < head ? 0.5f * v : v;
        }
    gpu_upload(bsend, bhost, sizeof(float) * big);
    gpu_scale_inplace(bsend, big, 3.0);  // slow: every element
    GpuCommOp *op = gpu_comm_all_gather_start(g, bsend, brecv, big, COMM_FLOAT32);
    gpu_comm_wait(op);
    gpu_scale_inplace(brecv, head, 0.5);  // quick: the first elements only
    gpu_download(bhost, brecv, sizeof(float) * big * size);
    check_values("streams ordered by events (all-gather)", bhost, bwant, big * size);
    gpu_free(bsend), gpu_free(brecv);
    free(bhost), free(bwant);

    // all-reduce AVG of (i % 97) * size + r * size: the average is (i % 97) * size + size (size - 1) / 2.
    for (size_t i = 0; i < n; i++) host[i] = (float)((i % 97) * size + rank * size);
    for (size_t i = 0; i < n; i++) want[i] = (float)((i % 97) * size) + (float)(size * (size - 1)) / 2;
    gpu_upload(buf, host, sizeof(float) * n);
    gpu_comm_sync(gpu_comm_all_reduce_start(g, buf, n, COMM_FLOAT32, COMM_AVG));
    gpu_download(got, buf, sizeof(float) * n);
    check_values("all-reduce avg", got, want, n);

    // all-gather: block r of the result is rank r's 1000 r + i.
    for (size_t i = 0; i < n; i++) host[i] = (float)(1000 * rank + (int)(i % 500));
    for (int r = 0; r < size; r++)
        for (size_t i = 0; i < n; i++) want[r * n + i] = (float)(1000 * r + (int)(i % 500));
    gpu_upload(buf, host, sizeof(float) * n);
    gpu_comm_sync(gpu_comm_all_gather_start(g, buf, all, n, COMM_FLOAT32));
    gpu_download(got, all, sizeof(float) * n * size);
    check_values("all-gather", got, want, n * size);

    // reduce-scatter SUM: every rank sends block b = b + (i % 13); rank r receives size (r + (i % 13)).
    for (int b = 0; b < size; b++)
        for (size_t i = 0; i < n; i++) host[b * n + i] = (float)(b + (int)(i % 13));
    for (size_t i = 0; i < n; i++) want[i] = (float)(size * (rank + (int)(i % 13)));
    gpu_upload(all, host, sizeof(float) * n * size);
    gpu_comm_sync(gpu_comm_reduce_scatter_start(g, all, buf, n, COMM_FLOAT32, COMM_SUM));
    gpu_download(got, buf, sizeof(float) * n);
    check_values("reduce-scatter sum", got, want, n);

    // broadcast from the last rank.
    for (size_t i = 0; i < n; i++) host[i] = rank == size - 1 ? (float)(7 * (i % 11)) : -1.0f;
    for (size_t i = 0; i < n; i++) want[i] = (float)(7 * (i % 11));
    gpu_upload(buf, host, sizeof(float) * n);
    gpu_comm_sync(gpu_comm_broadcast_start(g, buf, n, COMM_FLOAT32, size - 1));
    gpu_download(got, buf, sizeof(float) * n);
    check_values("broadcast", got, want, n);

    int failed = n_failed;
    comm_all_reduce(world, &failed, 1, COMM_INT32, COMM_SUM);
    if (rank == 0) printf("test_gpu_nccl: %d checks, %d failed\n", n_checks * size, failed);  // over all ranks
    gpu_free(buf), gpu_free(all);
    gpu_comm_free(g);
    gpu_shutdown();
    free(host), free(want), free(got);
    comm_finalize();
    return failed ? 1 : 0;
}
