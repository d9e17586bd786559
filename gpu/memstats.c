// memstats.c: device memory by category (runtime.h's gpu_mem_*), kept by gpu_alloc and gpu_free of
// the CUDA runtime (gpu/runtime.cu) and of the CPU emulator alike. With tracing on, every change
// also draws the counter "gpu mem <category>" on this rank's trace, next to the host's "mem <category>":
// the memory the stream-ordered allocator hands out, at the moment the host queues the allocation.
#include <stdio.h>

#include "common/trace.h"
#include "gpu/runtime.h"

static size_t current_bytes[MEM_N_CATEGORIES], peak_bytes[MEM_N_CATEGORIES], current_total, peak_total;

void gpu_mem_account(MemCategory category, size_t bytes, int sign) {
    if (sign > 0) current_bytes[category] += bytes, current_total += bytes;
    else current_bytes[category] -= bytes, current_total -= bytes;
    if (current_bytes[category] > peak_bytes[category]) peak_bytes[category] = current_bytes[category];
    if (current_total > peak_total) peak_total = current_total;
    if (trace_enabled()) {
        char name[64];
        snprintf(name, sizeof name, "gpu mem %s", mem_category_name(category));
        trace_counter(name, (double)current_bytes[category]);
    }
}

size_t gpu_mem_current(MemCategory category) { return current_bytes[category]; }
size_t gpu_mem_peak(MemCategory category) { return peak_bytes[category]; }
size_t gpu_mem_current_total(void) { return current_total; }
size_t gpu_mem_peak_total(void) { return peak_total; }
