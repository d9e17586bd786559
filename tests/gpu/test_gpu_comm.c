// test_gpu_comm.c: common/comm.h on device buffers, through the backend gpu/comm_device.h chose
// (LLAMA_GPU_COMM=nccl|staged picks one; t_gpu_emulated runs both on 1, 2 and 4 ranks of the CPU
// emulator, whose NCCL is emulated). Run alone, or under mpirun.
//
//   every call the chapters make: all-reduce (sum, avg, max; float32, int32), reduce-scatter,
//   all-gather (float32, float64), broadcast (float32, bytes), all-to-all, a ring batch, a batch
//   whose two messages each way are posted in opposite tag orders on the two sides, sendrecv,
//   send/recv -- each on device buffers against the same call on host buffers (common/comm.c's MPI,
//   the reference). Tolerance: exact. The data are integers below 2^24 (sums too), so every sum is
//   exact in any order and an average of multiples of the rank count is exact too; any difference
//   is a wrong element, not rounding.
//   ordering: a slow kernel scales a buffer, an out-of-place all-gather of it is started and
//   waited for, and a quick kernel scales the head of the result. The expected values hold only if
//   the all-gather read the buffer after the slow kernel and the quick kernel ran after the
//   all-gather landed. The emulator's streams run queued work in simulated-time order, so a
//   missing event wait shows.
//   stream order between operations: a reduce-scatter, then at once (no wait between) an
//   all-reduce over another group of the head of its result: it must reduce the reduce-scatter's
//   result. Waited for in reverse order.
//   comm_test on a device operation becomes true, then comm_wait still orders.
// `test_gpu_comm mixed` starts an all-gather from device memory into host memory, which must end
// the run with comm.c's message (t_gpu_emulated checks it).
//
// Mutations tried on the emulator (each fails this test; see gpu/README.md): NCCL's compute-stream
// event wait before the operation deleted; its wait on the operation's event in gpu_comm_wait
// deleted; one NCCL stream per group instead of one per process; the batch posted in list order
// instead of (tag, position) order; the staged backend's gpu_synchronize after the copies down
// deleted; its finishing of the earlier operation that writes a new operation's input skipped.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "gpu/comm_device.h"
#include "gpu/ops.h"
#include "tests/gpu/gpu_test_util.h"

static int rank, size;

// ---- buffers ------------------------------------------------------------------------------------------

static void *host_alloc(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) fatal("out of memory");
    return p;
}

static void *to_device(const void *host, size_t bytes) {
    void *d = gpu_alloc(MEM_COMM, bytes);
    gpu_upload(d, host, bytes);
    return d;
}

// The device buffer's bytes on the host (waits for the compute stream: the result is complete).
static void *from_device(const void *device, size_t bytes) {
    void *h = host_alloc(bytes);
    gpu_download(h, device, bytes);
    return h;
}

// x[i] = rank-dependent small integer: (i * 7 + 13 * rank + salt) % 101, times `scale`.
static void fill(void *buf, CommDtype dtype, size_t n, int salt, int scale) {
    for (size_t i = 0; i < n; i++) {
        int v = (int)((i * 7 + 13 * (size_t)rank + (size_t)salt) % 101) * scale;
        switch (dtype) {
        case COMM_FLOAT32: ((float *)buf)[i] = (float)v; break;
        case COMM_FLOAT64: ((double *)buf)[i] = v; break;
        case COMM_INT32: ((int32_t *)buf)[i] = v; break;
        case COMM_BYTE: ((unsigned char *)buf)[i] = (unsigned char)v; break;
        }
    }
}

static double value(const void *buf, CommDtype dtype, size_t i) {
    switch (dtype) {
    case COMM_FLOAT32: return ((const float *)buf)[i];
    case COMM_FLOAT64: return ((const double *)buf)[i];
    case COMM_INT32: return ((const int32_t *)buf)[i];
    case COMM_BYTE: return ((const unsigned char *)buf)[i];
    }
    return 0;
}

// Exact comparison (see the header): on failure the number of wrong elements, the largest absolute
// and relative difference and where it is.
static void check_exact(const char *name, const void *got, const void *want, size_t n, CommDtype dtype) {
    size_t wrong = 0, worst = 0;
    double worst_abs = 0;
    for (size_t i = 0; i < n; i++) {
        double g = value(got, dtype, i), w = value(want, dtype, i), d = fabs(g - w);
        if (memcmp((const char *)got + comm_bytes(dtype, i), (const char *)want + comm_bytes(dtype, i),
                   comm_dtype_size(dtype)) == 0)
            continue;
        if (wrong++ == 0 || d > worst_abs || isnan(d)) worst = i, worst_abs = d;
    }
    char label[96];
    snprintf(label, sizeof label, "%s (rank %d of %d)", name, rank, size);
    if (!wrong) {
        report(label, true, "%zu values exact", n);
        return;
    }
    double w = value(want, dtype, worst);
    report(label, false, "%zu of %zu differ; worst [%zu] = %g, expected %g: abs %g, rel %g", wrong, n, worst,
           value(got, dtype, worst), w, worst_abs, w != 0 ? worst_abs / fabs(w) : worst_abs);
}

// ---- one collective both ways ----------------------------------------------------------------------------

typedef enum { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, ALL_TO_ALL } Collective;

// Runs `what` on device copies of the inputs, then on the host inputs (the reference), and compares
// the outputs. count is comm.h's (elements per block for the blocked collectives).
static void both_ways(const char *name, Collective what, size_t count, CommDtype dtype, CommReduceOp op, int scale) {
    size_t in_n = what == REDUCE_SCATTER || what == ALL_TO_ALL ? count * size : count;
    size_t out_n = what == ALL_GATHER || what == ALL_TO_ALL ? count * size : count;
    size_t in_bytes = comm_bytes(dtype, in_n), out_bytes = comm_bytes(dtype, out_n);
    void *send = host_alloc(in_bytes), *recv = host_alloc(out_bytes);
    fill(send, dtype, in_n, (int)what, scale);
    bool in_place = what == ALL_REDUCE || what == BROADCAST;
    if (in_place) memcpy(recv, send, in_bytes);
    void *dsend = to_device(send, in_bytes), *drecv = in_place ? dsend : gpu_alloc(MEM_COMM, out_bytes);
    int root = size - 1;
    CommHandle *h = NULL;
    for (int pass = 0; pass < 2; pass++) {  // pass 0: device buffers; pass 1: host buffers (MPI)
        void *s = pass ? (in_place ? recv : send) : dsend, *r = pass ? recv : drecv;
        switch (what) {
        case ALL_REDUCE: h = comm_all_reduce_start(comm_world(), r, count, dtype, op); break;
        case REDUCE_SCATTER: h = comm_reduce_scatter_start(comm_world(), s, r, count, dtype, op); break;
        case ALL_GATHER: h = comm_all_gather_start(comm_world(), s, r, count, dtype); break;
        case BROADCAST: h = comm_broadcast_start(comm_world(), r, count, dtype, root); break;
        case ALL_TO_ALL: h = comm_all_to_all_start(comm_world(), s, r, count, dtype); break;
        }
        if (pass == 0 && what == ALL_TO_ALL)
            while (!comm_test(h)) {}  // comm_test on a device operation: becomes true, the wait still orders
        comm_wait(h);
    }
    void *got = from_device(drecv, out_bytes);
    check_exact(name, got, recv, out_n, dtype);
    free(got), free(send), free(recv);
    gpu_free(dsend);
    if (!in_place) gpu_free(drecv);
}

// ---- point to point ------------------------------------------------------------------------------------

// A batch of transfers (peers and counts from `ops`; every send's data from fill(salt = its index))
// on device buffers, then the same on host buffers; compares what each receive got.
static void batch_both_ways(const char *name, const CommP2P *ops, int n_ops, const char *how) {
    void **host = host_alloc(sizeof(void *) * (size_t)n_ops), **dev = host_alloc(sizeof(void *) * (size_t)n_ops);
    CommP2P *on_dev = host_alloc(sizeof(CommP2P) * (size_t)n_ops), *on_host = host_alloc(sizeof(CommP2P) * (size_t)n_ops);
    for (int i = 0; i < n_ops; i++) {
        size_t bytes = comm_bytes(ops[i].dtype, ops[i].count);
        host[i] = host_alloc(bytes);
        if (ops[i].kind == COMM_SEND) fill(host[i], ops[i].dtype, ops[i].count, 1000 + i, 1);
        dev[i] = to_device(host[i], bytes);
        on_dev[i] = ops[i], on_host[i] = ops[i];
        on_dev[i].buf = dev[i], on_host[i].buf = host[i];
    }
    for (int pass = 0; pass < 2; pass++) {
        CommP2P *list = pass ? on_host : on_dev;
        if (strcmp(how, "batch") == 0) comm_wait(comm_batch_start(comm_world(), list, n_ops));
        else if (strcmp(how, "sendrecv") == 0)
            comm_sendrecv(comm_world(), list[0].buf, list[0].count, list[0].peer, list[1].buf, list[1].count,
                          list[1].peer, list[0].dtype, list[0].tag);
        else if (list[0].kind == COMM_SEND)
            comm_send(comm_world(), list[0].buf, list[0].count, list[0].dtype, list[0].peer, list[0].tag);
        else
            comm_recv(comm_world(), list[0].buf, list[0].count, list[0].dtype, list[0].peer, list[0].tag);
    }
    for (int i = 0; i < n_ops; i++) {
        if (ops[i].kind == COMM_RECV) {
            size_t bytes = comm_bytes(ops[i].dtype, ops[i].count);
            void *got = from_device(dev[i], bytes);
            char label[64];
            snprintf(label, sizeof label, "%s, receive %d", name, i);
            check_exact(label, got, host[i], ops[i].count, ops[i].dtype);
            free(got);
        }
        gpu_free(dev[i]);
        free(host[i]);
    }
    free(host), free(dev), free(on_dev), free(on_host);
}

static void point_to_point(void) {
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    size_t n = 20011;  // 80 KB: more than the emulated NCCL's 64 KiB pipe holds at once
    CommP2P ring[2] = {{COMM_SEND, NULL, n, COMM_FLOAT32, right, 3}, {COMM_RECV, NULL, n, COMM_FLOAT32, left, 3}};
    batch_both_ways("ring batch (send right, recv left)", ring, 2, "batch");
    // Two messages each way with tags 1 and 0: sent in the order (tag 1, tag 0), received in the
    // order (tag 0, tag 1). MPI matches by tag; NCCL has no tags and matches in posting order, so
    // each batch must be posted in (tag, position) order for the data to land where MPI puts it.
    CommP2P tags[4] = {{COMM_SEND, NULL, 300, COMM_FLOAT32, right, 1}, {COMM_SEND, NULL, 300, COMM_FLOAT32, right, 0},
                       {COMM_RECV, NULL, 300, COMM_FLOAT32, left, 0}, {COMM_RECV, NULL, 300, COMM_FLOAT32, left, 1}};
    batch_both_ways("batch, tags posted in opposite orders", tags, 4, "batch");
    batch_both_ways("sendrecv", ring, 2, "sendrecv");
    if (size < 2) return;  // a lone send to itself would wait for a receive queued behind it
    // One direction: even ranks send to the next rank, which receives (a last even rank sits out).
    if (rank % 2 == 0 && rank + 1 < size) {
        CommP2P send = {COMM_SEND, NULL, 777, COMM_INT32, rank + 1, 9};
        batch_both_ways("send", &send, 1, "send");
    } else if (rank % 2 == 1) {
        CommP2P recv = {COMM_RECV, NULL, 777, COMM_INT32, rank - 1, 9};
        batch_both_ways("recv", &recv, 1, "recv");
    }
}

// ---- ordering --------------------------------------------------------------------------------------------

// The slow kernel scales every element of the send buffer by 3 right before the all-gather starts;
// the quick one scales the first `head` elements of the result by 0.5 right after the wait.
static void ordering(void) {
    size_t big = (size_t)1 << 16, head = 256;
    float *send = host_alloc(sizeof(float) * big), *want = host_alloc(sizeof(float) * big * size);
    for (size_t i = 0; i < big; i++) send[i] = (float)(rank + 2 * (int)(i % 61));
    for (int r = 0; r < size; r++)
        for (size_t i = 0; i < big; i++) {
            float v = 3.0f * (float)(r + 2 * (int)(i % 61));
            want[r * big + i] = r == 0 && i < head ? 0.5f * v : v;
        }
    float *dsend = to_device(send, sizeof(float) * big), *drecv = gpu_alloc(MEM_COMM, sizeof(float) * big * size);
    gpu_scale_inplace(dsend, big, 3.0);  // slow: every element
    CommHandle *h = comm_all_gather_start(comm_world(), dsend, drecv, big, COMM_FLOAT32);
    comm_wait(h);
    gpu_scale_inplace(drecv, head, 0.5);  // quick: the head only
    float *got = from_device(drecv, sizeof(float) * big * size);
    check_exact("ordering: slow kernel, all-gather, quick kernel", got, want, big * size, COMM_FLOAT32);
    free(got), free(send), free(want);
    gpu_free(dsend), gpu_free(drecv);
}

// A reduce-scatter over the world into R, then at once an all-reduce of R's head over `pairs` (ranks
// 2k and 2k+1): it must reduce what the reduce-scatter wrote. The head is short, so on the emulator an
// all-reduce that did not wait for the reduce-scatter would finish first and read R's old contents.
static void stream_order(Comm *pairs) {
    size_t count = 4096, head = 64;
    float *send = host_alloc(sizeof(float) * count * size), *r = host_alloc(sizeof(float) * count);
    fill(send, COMM_FLOAT32, count * size, 5, 1);
    float *dsend = to_device(send, sizeof(float) * count * size), *dr = gpu_alloc(MEM_COMM, sizeof(float) * count);
    CommHandle *rs = comm_reduce_scatter_start(comm_world(), dsend, dr, count, COMM_FLOAT32, COMM_SUM);
    CommHandle *ar = comm_all_reduce_start(pairs, dr, head, COMM_FLOAT32, COMM_SUM);
    comm_wait(ar);  // in reverse order: the all-reduce's wait covers the reduce-scatter too
    comm_wait(rs);
    float *got = from_device(dr, sizeof(float) * count);
    comm_reduce_scatter(comm_world(), send, r, count, COMM_FLOAT32, COMM_SUM);  // the reference
    comm_all_reduce(pairs, r, head, COMM_FLOAT32, COMM_SUM);
    check_exact("stream order: reduce-scatter, then all-reduce of its result", got, r, count, COMM_FLOAT32);
    free(got), free(send), free(r);
    gpu_free(dsend), gpu_free(dr);
}

// One all-gather from device memory into host memory: comm.c must refuse it.
static void mixed(void) {
    float *d = gpu_alloc(MEM_COMM, sizeof(float) * 16), *h = host_alloc(sizeof(float) * 16 * size);
    comm_all_gather(comm_world(), d, h, 16, COMM_FLOAT32);
    printf("FAIL: an all-gather from device into host memory was accepted\n");
    exit(3);
}

int main(int argc, char **argv) {
    if (!gpu_test_start_ranks("test_gpu_comm", &argc, &argv, false)) return 0;
    rank = comm_rank(comm_world()), size = comm_size(comm_world());
    gpu_comm_backend_init(GPU_COMM_AUTO);
    if (rank == 0) printf("backend: %s (%s)\n", gpu_comm_backend_name(), gpu_comm_backend_reason());
    if (argc > 1 && strcmp(argv[1], "mixed") == 0) mixed();
    Comm *pairs = comm_split(comm_world(), rank / 2, rank, "pairs");  // attached as it is made

    size_t n = 5003;  // not a multiple of anything
    both_ways("all-reduce sum", ALL_REDUCE, n, COMM_FLOAT32, COMM_SUM, 1);
    both_ways("all-reduce avg", ALL_REDUCE, n, COMM_FLOAT32, COMM_AVG, size);  // multiples of size: exact
    both_ways("all-reduce max", ALL_REDUCE, n, COMM_FLOAT32, COMM_MAX, 1);
    both_ways("all-reduce sum int32", ALL_REDUCE, n, COMM_INT32, COMM_SUM, 1);
    both_ways("reduce-scatter sum", REDUCE_SCATTER, n, COMM_FLOAT32, COMM_SUM, 1);
    both_ways("reduce-scatter avg", REDUCE_SCATTER, n, COMM_FLOAT32, COMM_AVG, size);
    both_ways("all-gather", ALL_GATHER, n, COMM_FLOAT32, COMM_SUM, 1);
    both_ways("all-gather float64", ALL_GATHER, n, COMM_FLOAT64, COMM_SUM, 1);
    both_ways("broadcast from the last rank", BROADCAST, n, COMM_FLOAT32, COMM_SUM, 1);
    both_ways("broadcast bytes", BROADCAST, n, COMM_BYTE, COMM_SUM, 1);
    both_ways("all-to-all (comm_test, then wait)", ALL_TO_ALL, n, COMM_FLOAT32, COMM_SUM, 1);
    point_to_point();
    ordering();
    stream_order(pairs);

    comm_free(pairs);
    int failed = n_failed, checks = n_checks;
    comm_all_reduce(comm_world(), &failed, 1, COMM_INT32, COMM_SUM);
    comm_all_reduce(comm_world(), &checks, 1, COMM_INT32, COMM_SUM);
    if (rank == 0) printf("test_gpu_comm: %d checks, %d failed\n", checks, failed);  // over all ranks
    gpu_comm_backend_shutdown();
    gpu_shutdown();
    comm_finalize();
    return failed ? 1 : 0;
}
