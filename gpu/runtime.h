// runtime.h: the CUDA device of this process: one compute stream every op runs on, the cuBLASLt
// handle and workspace, and device memory by category (the same categories as common/mem.h) with
// a report from the CUDA allocator. A C header: the trainer and the tests are C.
//
//   char why[256];
//   if (gpu_device_count(why, sizeof why) == 0) { printf("SKIP: no CUDA device (%s)\n", why); ... }
//   gpu_init(0);
//   float *x = gpu_alloc(MEM_ACTIVATIONS, bytes);       // zeroed, stream-ordered
//   gpu_upload(x, host, bytes);  gpu_rmsnorm_forward(...);  gpu_download(host, y, bytes);
//   gpu_memory_report();
//   gpu_shutdown();
//
// Every op of gpu/ops.h is queued on gpu_stream() and returns at once, like a kernel launch; the
// copies above wait for the stream, so what they read back is complete. A CUDA error anywhere ends
// the run through fatal() with the call, the file and line, and CUDA's message.
//
// Plain C without CUDA's headers, so that the code above the kernels (gpu/model.c) compiles on any
// machine; the stream itself (cudaStream_t) is for the .cu files, in gpu/internal.cuh.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/mem.h"

// How many CUDA devices this process can use: 0 (and the reason in why) when there is no driver,
// no device, or the runtime cannot start. Never fails, so callers can skip cleanly.
int gpu_device_count(char *why, size_t why_len);

// Selects the device, creates the compute stream (non-blocking), the cuBLASLt handle and its
// workspace, and keeps freed memory in the stream-ordered pool. Call once before any op.
void gpu_init(int device);
void gpu_shutdown(void);  // waits for the stream, frees what gpu_init made
bool gpu_initialized(void);
void gpu_synchronize(void);  // waits for everything queued on the compute stream
// "NVIDIA H100 80GB HBM3, 132 SMs, compute capability 9.0" for the device gpu_init selected.
void gpu_device_description(char *out, size_t out_len);

// Device memory, zero-filled, from the stream-ordered allocator (cudaMallocAsync on the compute
// stream), counted per category. 256-byte aligned. Exits with a message on failure.
void *gpu_alloc(MemCategory category, size_t bytes);
void gpu_free(void *ptr);  // NULL is fine
// Stream-ordered scratch on the compute stream (from the same pool as gpu_alloc, neither zeroed nor
// counted in a category): for per-call buffers such as attention's D, the loss's partial sums or
// the ring attention's bf16 copies of a block's operands.
void *gpu_scratch_alloc(size_t bytes);
void gpu_scratch_free(void *ptr);
// Blocking copies (they wait for the work queued before them on the compute stream).
void gpu_upload(void *device_dst, const void *host_src, size_t bytes);
void gpu_download(void *host_dst, const void *device_src, size_t bytes);
// A queued upload: host_src is copied at once into pinned staging memory (so it may be reused as
// soon as this returns) and the copy to the device is queued on the compute stream, without waiting
// for the work queued before it. The staging is a ring of GPU_UPLOAD_SLOTS buffers; a slot is
// reused only once its earlier copy has run, so the host waits only when it is that many uploads
// ahead of the device (counted by gpu_host_waits).
#define GPU_UPLOAD_SLOTS 4
void gpu_upload_queued(void *device_dst, const void *host_src, size_t bytes);
// How many times this process's host has waited for the compute stream so far: every gpu_upload,
// gpu_download and gpu_synchronize, and gpu_upload_queued when its staging slot was still in use.
// (The GPU timeline's flush and the NCCL stream's waits are not counted.) Tests and benchmarks
// count a step's host syncs with it.
long long gpu_host_waits(void);
void gpu_fill_bytes(void *device_dst, int byte, size_t bytes);  // queued memset
void gpu_copy(void *device_dst, const void *device_src, size_t bytes);  // queued device-to-device copy
// Queued copies between the device and pinned host memory (gpu_host_alloc), on the compute stream,
// without waiting: the download's bytes are on the host once the stream has passed it
// (gpu_synchronize), and the upload reads its source when the stream gets to it, so that memory
// must stay unchanged until then. What the staged communication backend moves data with.
void gpu_download_async(void *pinned_dst, const void *device_src, size_t bytes);
void gpu_upload_async(void *device_dst, const void *pinned_src, size_t bytes);
// Page-locked host memory (cudaMallocHost): the device copies it by DMA, without the driver's own
// staging, and the copies above can run asynchronously. Exits with a message on failure.
void *gpu_host_alloc(size_t bytes);
void gpu_host_free(void *ptr);  // NULL is fine; waits for the compute stream first (if any)
// Whether ptr points into device memory (gpu_alloc's, the scratch's, or any other CUDA device or
// managed allocation): how common/comm.c tells device buffers from host ones.
bool gpu_is_device_pointer(const void *ptr);

// Sync-debug mode: the compute stream is synchronised after every kernel launch, so that a fault
// inside a kernel ends the run naming that kernel and the file:line of its launch (otherwise it
// surfaces at the next synchronisation, wherever that is). Slow; for finding a failing kernel.
// Off unless the environment has LLAMA_CUDA_SYNC_DEBUG set (to anything but 0) or a program
// calls gpu_set_sync_debug(true) (the trainer's --cuda-sync-debug).
void gpu_set_sync_debug(bool on);
bool gpu_sync_debug(void);

// The device's free and total memory now (cudaMemGetInfo).
void gpu_memory_info(size_t *free_bytes, size_t *total_bytes);

// Device memory by category, as gpu_alloc and gpu_free count it (gpu/memstats.c).
size_t gpu_mem_current(MemCategory category);
size_t gpu_mem_peak(MemCategory category);
size_t gpu_mem_current_total(void);
size_t gpu_mem_peak_total(void);
// For the allocators: sign +1 for an allocation of bytes, -1 for its free. With tracing on, draws
// the "gpu mem <category>" counter.
void gpu_mem_account(MemCategory category, size_t bytes, int sign);
// Per category current and peak (our accounting), then what the CUDA allocator reports: the
// pool's reserved and used bytes (current and high-water marks) and the device's free/total.
void gpu_memory_report(void);

#ifdef __cplusplus
}
#endif
