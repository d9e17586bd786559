// runtime.cu: the device, its compute stream, device memory by category, and the memory report.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/internal.cuh"
#include "gpu/ops.h"

static bool initialized;
static int device_id;
static cudaStream_t compute_stream;
static cudaMemPool_t pool;

// Our accounting, per MemCategory, as common/mem.c does for host memory. Device memory carries no
// header we could read back, so a small table maps each live pointer to its size and category.
typedef struct {
    void *ptr;
    size_t bytes;
    MemCategory category;
} Allocation;
static Allocation *allocations;
static size_t n_allocations, cap_allocations;
static void free_staging(void);  // gpu_upload_queued's pinned buffers

int gpu_device_count(char *why, size_t why_len) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        if (why && why_len) snprintf(why, why_len, "cudaGetDeviceCount: %s", cudaGetErrorString(err));
        cudaGetLastError();  // clear it: it is not sticky, but leave no trace for later checks
        return 0;
    }
    if (n == 0 && why && why_len) snprintf(why, why_len, "the CUDA runtime sees no device");
    return n;
}

void gpu_init(int device) {
    if (initialized) fatal("gpu_init called twice");
    (void)gpu_attention_tile_rows();  // a bad LLAMA_ATTN_TILE_ROWS stops the program here
    char why[256] = "";
    int n = gpu_device_count(why, sizeof why);
    if (n == 0) fatal("no CUDA device: %s", why);
    if (device < 0 || device >= n) fatal("gpu_init: CUDA device %d requested, %d present", device, n);
    CUDA_CHECK(cudaSetDevice(device));
    device_id = device;
    CUDA_CHECK(cudaStreamCreateWithFlags(&compute_stream, cudaStreamNonBlocking));
    // Freed blocks stay in the pool for the next cudaMallocAsync instead of going back to the
    // driver at every synchronisation: allocation in the training loop then costs no driver call.
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep_everything = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything));
    initialized = true;
}

void gpu_shutdown(void) {
    if (!initialized) return;
    gpu_matmul_shutdown();
    CUDA_CHECK(cudaStreamSynchronize(compute_stream));
    free_staging();
    CUDA_CHECK(cudaStreamDestroy(compute_stream));
    free(allocations);
    allocations = NULL;
    n_allocations = cap_allocations = 0;
    initialized = false;
}

bool gpu_initialized(void) { return initialized; }

cudaStream_t gpu_stream(void) {
    if (!initialized) fatal("a GPU op was called before gpu_init()");
    return compute_stream;
}


void gpu_device_description(char *out, size_t out_len) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device_id));
    snprintf(out, out_len, "%s, %d SMs, compute capability %d.%d", prop.name, prop.multiProcessorCount, prop.major,
             prop.minor);
}

void *gpu_alloc(MemCategory category, size_t bytes) {
    void *ptr = NULL;
    cudaError_t err = cudaMallocAsync(&ptr, bytes ? bytes : 1, gpu_stream());
    if (err != cudaSuccess) {
        size_t free_bytes = 0, total_bytes = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_bytes, &total_bytes);  // best effort: the figures, if the device still answers
        fatal("out of GPU memory allocating %.2f MiB for %s (%s): %.2f MiB in use by this process, the device has "
              "%.2f MiB free of %.2f MiB",
              bytes / 1048576.0, mem_category_name(category), cudaGetErrorString(err),
              gpu_mem_current_total() / 1048576.0, free_bytes / 1048576.0, total_bytes / 1048576.0);
    }
    CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, compute_stream));
    if (n_allocations == cap_allocations) {
        cap_allocations = cap_allocations ? 2 * cap_allocations : 64;
        allocations = (Allocation *)realloc(allocations, cap_allocations * sizeof(Allocation));
        if (!allocations) fatal("out of host memory for the GPU allocation table");
    }
    Allocation *a = &allocations[n_allocations++];
    a->ptr = ptr, a->bytes = bytes, a->category = category;
    gpu_mem_account(category, bytes, +1);
    return ptr;
}

void gpu_free(void *ptr) {
    if (!ptr) return;
    for (size_t i = n_allocations; i-- > 0;) {  // recent allocations are freed first, usually
        if (allocations[i].ptr != ptr) continue;
        gpu_mem_account(allocations[i].category, allocations[i].bytes, -1);
        allocations[i] = allocations[--n_allocations];
        CUDA_CHECK(cudaFreeAsync(ptr, compute_stream));
        return;
    }
    fatal("gpu_free: %p was not allocated by gpu_alloc", ptr);
}

void *gpu_scratch_alloc(size_t bytes) {
    void *ptr = NULL;
    CUDA_CHECK(cudaMallocAsync(&ptr, bytes ? bytes : 1, gpu_stream()));
    return ptr;
}
void gpu_scratch_free(void *ptr) { CUDA_CHECK(cudaFreeAsync(ptr, gpu_stream())); }

static long long host_waits;
long long gpu_host_waits(void) { return host_waits; }

void gpu_synchronize(void) {
    host_waits++;
    CUDA_CHECK(cudaStreamSynchronize(gpu_stream()));
}

void gpu_upload(void *device_dst, const void *host_src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, gpu_stream()));
    host_waits++;
    CUDA_CHECK(cudaStreamSynchronize(compute_stream));  // pageable host memory: the copy may be staged
}
void gpu_download(void *host_dst, const void *device_src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, gpu_stream()));
    host_waits++;
    CUDA_CHECK(cudaStreamSynchronize(compute_stream));
}

// gpu_upload_queued's ring of pinned buffers, each with the event recorded after its last copy.
typedef struct {
    void *host;  // pinned (cudaMallocHost), `bytes` long
    size_t bytes;
    cudaEvent_t copied;
    bool pending;  // a copy from it was queued
} Staging;
static Staging staging[GPU_UPLOAD_SLOTS];
static int next_slot;

void gpu_upload_queued(void *device_dst, const void *host_src, size_t bytes) {
    Staging *s = &staging[next_slot];
    next_slot = (next_slot + 1) % GPU_UPLOAD_SLOTS;
    if (s->pending) {
        cudaError_t state = cudaEventQuery(s->copied);
        if (state == cudaErrorNotReady) {  // its copy has not run yet: wait for it
            (void)cudaGetLastError();      // "not ready" is a state, not an error for the next launch check
            host_waits++;
            state = cudaEventSynchronize(s->copied);
        }
        CUDA_CHECK(state);  // a fault in the work before the copy surfaces here
    }
    if (!s->copied) CUDA_CHECK(cudaEventCreateWithFlags(&s->copied, cudaEventDisableTiming));
    if (s->bytes < bytes) {  // grows to the largest upload (a batch's tokens: once)
        if (s->host) CUDA_CHECK(cudaFreeHost(s->host));
        CUDA_CHECK(cudaMallocHost(&s->host, bytes));
        s->bytes = bytes;
    }
    memcpy(s->host, host_src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(device_dst, s->host, bytes, cudaMemcpyHostToDevice, gpu_stream()));
    CUDA_CHECK(cudaEventRecord(s->copied, gpu_stream()));
    s->pending = true;
}

static void free_staging(void) {
    for (int i = 0; i < GPU_UPLOAD_SLOTS; i++) {
        if (staging[i].host) CUDA_CHECK(cudaFreeHost(staging[i].host));
        if (staging[i].copied) CUDA_CHECK(cudaEventDestroy(staging[i].copied));
        memset(&staging[i], 0, sizeof staging[i]);
    }
    next_slot = 0;
}
void gpu_fill_bytes(void *device_dst, int byte, size_t bytes) {
    CUDA_CHECK(cudaMemsetAsync(device_dst, byte, bytes, gpu_stream()));
}

void gpu_copy(void *device_dst, const void *device_src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice, gpu_stream()));
}

void gpu_download_async(void *pinned_dst, const void *device_src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(pinned_dst, device_src, bytes, cudaMemcpyDeviceToHost, gpu_stream()));
}
void gpu_upload_async(void *device_dst, const void *pinned_src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(device_dst, pinned_src, bytes, cudaMemcpyHostToDevice, gpu_stream()));
}

void *gpu_host_alloc(size_t bytes) {
    void *ptr = NULL;
    cudaError_t err = cudaMallocHost(&ptr, bytes ? bytes : 1);
    if (err != cudaSuccess) fatal("out of pinned host memory allocating %.2f MiB: %s", bytes / 1048576.0, cudaGetErrorString(err));
    return ptr;
}
void gpu_host_free(void *ptr) {
    if (!ptr) return;
    if (initialized) gpu_synchronize();  // a queued copy may still read or write it
    CUDA_CHECK(cudaFreeHost(ptr));
}

// Plain malloc'd memory is cudaMemoryTypeUnregistered, pinned host memory cudaMemoryTypeHost.
bool gpu_is_device_pointer(const void *ptr) {
    cudaPointerAttributes a;
    cudaError_t err = cudaPointerGetAttributes(&a, ptr);
    if (err != cudaSuccess) {  // runtimes before 11 said so for unregistered host memory
        cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void gpu_memory_info(size_t *free_bytes, size_t *total_bytes) { CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes)); }


void gpu_memory_report(void) {
    const double mib = 1024.0 * 1024.0;
    log_info("GPU %d memory by category (MiB):   current      peak", device_id);
    for (int c = 0; c < MEM_N_CATEGORIES; c++)
        log_info("  %-12s %24.2f %9.2f", mem_category_name((MemCategory)c), gpu_mem_current((MemCategory)c) / mib,
                 gpu_mem_peak((MemCategory)c) / mib);
    log_info("  %-12s %24.2f %9.2f", "total", gpu_mem_current_total() / mib, gpu_mem_peak_total() / mib);
    // What the CUDA allocator holds: reserved = taken from the driver (what nvidia-smi shows for
    // this process, less the context), used = handed out to us, scratch included.
    uint64_t reserved = 0, reserved_high = 0, used = 0, used_high = 0;
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_high));
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_high));
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    log_info("  CUDA pool: reserved %.2f MiB (high %.2f), used %.2f MiB (high %.2f); device %.0f of %.0f MiB free",
             reserved / mib, reserved_high / mib, used / mib, used_high / mib, free_bytes / mib, total_bytes / mib);
}
