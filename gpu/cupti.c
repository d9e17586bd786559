// cupti.c: GPU activity records from CUPTI's activity API (activity.h), built where libcupti is found.
// CUPTI fills buffers we hand it with records of finished work (kernels, NCCL's among them; copies;
// fills) and gives them back full, or at a flush, on a thread of its own; each record becomes a
// GpuActivity. Device timestamps are CUPTI's clock (cuptiGetTimestamp); the host clock of the trace
// (now_ns) is read next to it once at start, and the difference moves every record.
#include <cupti.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/trace.h"
#include "gpu/activity.h"

#define BUFFER_BYTES (8u << 20)  // per buffer CUPTI asks for
#define RECORD_ALIGN 8           // CUPTI's required alignment of a buffer

static bool running;
static int64_t device_to_host_ns;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(RECORD_ALIGN, BUFFER_BYTES);
    if (!*buffer) fatal("out of host memory for a CUPTI activity buffer");
    *size = BUFFER_BYTES;
    *max_records = 0;  // as many as fit
}

static const char *copy_name(uint8_t kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy";
    }
}

static void record(const CUpti_Activity *r) {
    GpuActivity a = {0};
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        a = (GpuActivity){GPU_ACTIVITY_KERNEL, k->name, k->streamId, k->start, k->end, 0};
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *c = (const CUpti_ActivityMemcpy6 *)r;
        a = (GpuActivity){GPU_ACTIVITY_MEMCPY, copy_name(c->copyKind), c->streamId, c->start, c->end, c->bytes};
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *s = (const CUpti_ActivityMemset4 *)r;
        a = (GpuActivity){GPU_ACTIVITY_MEMSET, "memset", s->streamId, s->start, s->end, s->bytes};
        break;
    }
    default: return;
    }
    gpu_activity_add(&a);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) record(r);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        log_info("CUPTI dropped %zu activity records (the timeline misses them)", dropped);
    free(buffer);
}

static bool failed(CUptiResult status, const char *call, char *why, size_t why_len) {
    if (status == CUPTI_SUCCESS) return false;
    const char *text = NULL;
    cuptiGetResultString(status, &text);
    snprintf(why, why_len, "%s: %s", call, text ? text : "unknown CUPTI error");
    return true;
}

bool gpu_activity_start(char *why, size_t why_len) {
    if (running) return true;
    static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                               CUPTI_ACTIVITY_KIND_MEMSET};
    if (failed(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks",
               why, why_len))
        return false;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (failed(cuptiActivityEnable(kinds[i]), "cuptiActivityEnable", why, why_len)) {
            for (size_t j = 0; j < i; j++) cuptiActivityDisable(kinds[j]);
            return false;
        }
    uint64_t device_now = 0;
    if (failed(cuptiGetTimestamp(&device_now), "cuptiGetTimestamp", why, why_len)) return false;
    device_to_host_ns = now_ns() - (int64_t)device_now;
    running = true;
    return true;
}

bool gpu_activity_running(void) { return running; }

void gpu_activity_flush(void) {
    if (!running) return;
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    gpu_activity_emit(device_to_host_ns);
}

void gpu_activity_stop(void) {
    if (!running) return;
    gpu_activity_flush();
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET);
    running = false;
}
