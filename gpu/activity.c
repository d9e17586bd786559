// activity.c: GPU activity records to trace slices (activity.h). No CUDA here: gpu/cupti.c feeds it
// on a GPU, tests/test_gpu_activity.c on any machine.
#include "gpu/activity.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/trace.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static GpuActivity *queued;
static size_t n_queued, cap_queued;

void gpu_activity_add(const GpuActivity *a) {
    char *name = strdup(a->name ? a->name : "?");
    if (!name) fatal("out of host memory for a GPU activity record");
    pthread_mutex_lock(&lock);
    if (n_queued == cap_queued) {
        cap_queued = cap_queued ? 2 * cap_queued : 1024;
        queued = realloc(queued, cap_queued * sizeof *queued);
        if (!queued) fatal("out of host memory for GPU activity records");
    }
    queued[n_queued] = *a;
    queued[n_queued++].name = name;
    pthread_mutex_unlock(&lock);
}

const char *gpu_activity_kernel_category(const char *kernel_name) {
    return strncmp(kernel_name, "nccl", 4) == 0 ? "nccl" : "kernel";
}

static const char *category_of(const GpuActivity *a) {
    switch (a->kind) {
    case GPU_ACTIVITY_KERNEL: return gpu_activity_kernel_category(a->name);
    case GPU_ACTIVITY_MEMCPY: return "memcpy";
    default: return "memset";
    }
}

static int by_stream_then_start(const void *pa, const void *pb) {
    const GpuActivity *a = pa, *b = pb;
    if (a->stream != b->stream) return a->stream < b->stream ? -1 : 1;
    if (a->start_ns != b->start_ns) return a->start_ns < b->start_ns ? -1 : 1;
    return a->end_ns < b->end_ns ? -1 : a->end_ns > b->end_ns;
}

// The trace's clock must not go backwards on a track, across emits too: the last end per stream.
typedef struct {
    uint32_t stream;
    int64_t last_end;
} StreamClock;
static StreamClock *clocks;
static size_t n_clocks;

static int64_t *last_end_of(uint32_t stream) {
    for (size_t i = 0; i < n_clocks; i++)
        if (clocks[i].stream == stream) return &clocks[i].last_end;
    clocks = realloc(clocks, (n_clocks + 1) * sizeof *clocks);
    if (!clocks) fatal("out of host memory for the GPU streams' clocks");
    clocks[n_clocks] = (StreamClock){stream, INT64_MIN};
    return &clocks[n_clocks++].last_end;
}

void gpu_activity_emit(int64_t device_to_host_ns) {
    pthread_mutex_lock(&lock);
    GpuActivity *records = queued;
    size_t n = n_queued;
    queued = NULL, n_queued = cap_queued = 0;
    pthread_mutex_unlock(&lock);
    qsort(records, n, sizeof *records, by_stream_then_start);
    for (size_t i = 0; i < n; i++) {
        const GpuActivity *a = &records[i];
        if (trace_enabled()) {
            char track_name[48];
            snprintf(track_name, sizeof track_name, "cuda:stream %u", a->stream);
            int track = trace_track(track_name);
            int64_t *last_end = last_end_of(a->stream);
            int64_t begin = (int64_t)a->start_ns + device_to_host_ns, end = (int64_t)a->end_ns + device_to_host_ns;
            if (begin < *last_end) begin = *last_end;
            if (end < begin) end = begin;
            trace_begin_at(track, a->name, category_of(a), begin);
            if (a->kind != GPU_ACTIVITY_KERNEL) trace_arg_int(track, "bytes", (int64_t)a->bytes);
            trace_end_at(track, end);
            *last_end = end;
        }
        free((char *)a->name);
    }
    free(records);
}
