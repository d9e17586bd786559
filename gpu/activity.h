// activity.h: every kernel, copy and fill the GPU runs, as slices of this rank's trace, one thread
// track per CUDA stream ("cuda:stream <id>"), next to the host's "compute" and "comm:<group>" tracks
// and the marked regions of "cuda:compute" (timeline.h). The records come from CUPTI's activity API
// (gpu/cupti.c): the device's own start and end of each kernel, NCCL's included, which a host-side
// timer cannot see. Where CUPTI cannot run (no libcupti at build time, the emulator, a driver that
// refuses profiling) gpu_activity_start says why and the timeline keeps the marked regions alone.
//
//   if (!gpu_activity_start(why, sizeof why)) log_info("per-kernel timeline off: %s", why);
//   ... steps ...;  gpu_timeline_flush();   // syncs, then gpu_activity_flush() emits the records
//   gpu_activity_stop();
//
// What a slice says: name = the kernel's (mangled) name, "memcpy HtoD" / "DtoH" / "DtoD" / ... or
// "memset"; category "nccl" for NCCL's kernels (what trace-summary counts as GPU communication),
// else "kernel", "memcpy" or "memset"; args: bytes for copies and fills.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { GPU_ACTIVITY_KERNEL, GPU_ACTIVITY_MEMCPY, GPU_ACTIVITY_MEMSET } GpuActivityKind;

// One record, on the device's clock (ns). name is copied.
typedef struct {
    GpuActivityKind kind;
    const char *name;
    uint32_t stream;
    uint64_t start_ns, end_ns;
    uint64_t bytes;  // copies and fills; 0 for kernels
} GpuActivity;

// Starts recording (CUPTI). False, with the reason in why, where it cannot.
bool gpu_activity_start(char *why, size_t why_len);
bool gpu_activity_running(void);
// Delivers what the device has finished (CUPTI's buffers) and emits every record collected so far as
// trace slices, oldest first on each stream. Call with the device idle (gpu_timeline_flush does).
void gpu_activity_flush(void);
void gpu_activity_stop(void);

// ---- the part that does not need CUDA (gpu/activity.c; tested on the host) -----------------------
// Queues one record (thread-safe: CUPTI delivers buffers on a thread of its own).
void gpu_activity_add(const GpuActivity *a);
// Emits the queued records as slices and forgets them. device_to_host_ns is added to every device
// time to put it on the trace's clock (the host's now_ns); a slice that would start before the
// previous one on its stream ended (two records overlapping, or the clocks' rounding) is moved to
// that end, as a stream runs its work one after the other.
void gpu_activity_emit(int64_t device_to_host_ns);
// The category of a kernel's slice: "nccl" for NCCL's kernels (their names begin with "nccl"), else
// "kernel".
const char *gpu_activity_kernel_category(const char *kernel_name);

#ifdef __cplusplus
}
#endif
