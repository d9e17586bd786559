// memstats.c: device memory by category (runtime.h's gpu_mem_*), kept by gpu_alloc and gpu_free of
// the CUDA runtime (gpu/runtime.cu) and of the CPU emulator alike. With tracing on, every change
// also draws the counter "gpu mem <category>" on this rank's trace, next to the host's "mem <category>":
// the memory the stream-ordered allocator hands out, at the moment the host queues the allocation.
#include <stdio.h>

#include "common/trace.h"
#include "gpu/runtime.h"

static MemLedger device;

void gpu_mem_account(MemCategory category, size_t bytes, int sign) {
    mem_ledger_account(&device, category, bytes, sign);
    if (trace_enabled()) {
        char name[64];
        snprintf(name, sizeof name, "gpu mem %s", mem_category_name(category));
        trace_counter(name, (double)device.current[category]);
    }
}

size_t gpu_mem_current(MemCategory category) { return device.current[category]; }
size_t gpu_mem_peak(MemCategory category) { return device.peak[category]; }
size_t gpu_mem_current_total(void) { return device.current_total; }
size_t gpu_mem_peak_total(void) { return device.peak_total; }
