// cuda_runtime.h, the emulator's: what gpu/*.cu uses of CUDA, on the CPU (see ../emu.cpp). Found
// before the real header because the emulator build puts tests/gpu/emu/include first on the path.
//
// A block runs as blockDim fibers (ucontext) on one OS thread; __syncthreads, __syncwarp and the
// warp shuffles switch to a scheduler that releases a barrier once every live fiber of the block (or
// warp) has reached it. Between barriers the fibers run one after another, in an order reshuffled at
// every barrier, so a missing barrier shows up as a result that depends on the order. Blocks run one
// after another, so a function-scope `static` is exactly a block's shared memory.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
extern uint3 threadIdx, blockIdx;  // of the running fiber, set by the scheduler at every switch
extern dim3 blockDim, gridDim;

using std::max;
using std::min;

void __syncthreads();
int __syncthreads_or(int predicate);
int __syncthreads_and(int predicate);
void __syncwarp(unsigned mask = 0xffffffffu);
// Every lane of the warp deposits its value; after a warp barrier each reads its partner's.
void *emu_warp_exchange_slot(unsigned lane);
template <typename T> T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
    unsigned lane = threadIdx.x % 32;
    std::memcpy(emu_warp_exchange_slot(lane), &value, sizeof(T));
    __syncwarp(mask);
    T other;
    std::memcpy(&other, emu_warp_exchange_slot(lane ^ (unsigned)lane_mask), sizeof(T));
    __syncwarp(mask);  // nobody overwrites a slot before its reader has read it
    return other;
}
inline int atomicMin(int *address, int value) {  // one fiber at a time: a plain update is atomic
    int old = *address;
    *address = std::min(old, value);
    return old;
}

// Checks the launch at once, then queues it on stream: kernel_body runs once per thread of every
// block of the grid, with dynamic_smem_bytes of dynamic shared memory per block (filled with NaN
// bytes before each block: reading it before writing it shows up). `kernel` identifies the kernel
// for its shared-memory opt-in.
struct EmuStream;
void emu_launch(const void *kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, EmuStream *stream,
                const std::function<void()> &kernel_body);
void *emu_dynamic_smem();

// ---- the runtime API the .cu files call --------------------------------------------------------------
typedef int cudaError_t;
#define cudaSuccess 0
#define cudaErrorLaunchFailure 719
#define cudaErrorNotReady 600
#define cudaErrorInvalidValue 1
// Streams: each launch, copy, event record and NCCL call is queued on its stream with a simulated
// duration, and nothing runs until the host synchronises (a stream, an event, a blocking copy, a
// free). Then the queued work runs one operation at a time in the order of its simulated
// completion time: an operation starts when its stream is free, no earlier than the host issued
// it and no earlier than the events its stream was told to wait for; a kernel takes as long as it
// has threads, a copy its bytes / 16 (emu.cpp). So a slow kernel on one stream finishes after fast
// work issued later on another, and a missing cudaStreamWaitEvent shows up as stale data.
struct EmuStream;
typedef EmuStream *cudaStream_t;  // nullptr: the compute stream (gpu_stream())
// A kernel that calls __trap() fails: like a fault on the device, the error is sticky and is
// reported by the next synchronisation, not by the launch.
void __trap();
cudaError_t cudaGetLastError();
const char *cudaGetErrorString(cudaError_t err);
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
enum { cudaSharedmemCarveoutDefault = -1, cudaSharedmemCarveoutMaxL1 = 0, cudaSharedmemCarveoutMaxShared = 100 };
// Records the opt-in limit; emu_launch refuses more dynamic shared memory than the kernel opted into
// (or 48 KiB without), as the hardware does. The carveout (a percentage of the unified L1/shared
// memory, or -1) is only a hint to the hardware's scheduler: checked for range, otherwise ignored.
void emu_set_max_dynamic_smem(const void *kernel, int bytes);
template <typename Kernel> cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout)
        return value >= -1 && value <= 100 ? cudaSuccess : cudaErrorInvalidValue;
    emu_set_max_dynamic_smem(reinterpret_cast<const void *>(kernel), value);
    return cudaSuccess;
}

// Events: recorded on a stream as an operation of no duration; its time (host clock, ns) is taken
// when the queue reaches it, so elapsed times are those of the emulated work in between.
struct EmuEvent {
    long long ns;         // host clock when the queue ran the record
    long long sim_done;   // simulated completion time of the work before the record
};
typedef EmuEvent *cudaEvent_t;
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
cudaError_t cudaEventCreate(cudaEvent_t *e);
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
// Nothing runs until the host drains the queue, so asking whether an event has completed runs the
// queue first: the answer is always "complete" (or the sticky error).
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);  // every stream: the emulator drains all queued work
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);

// Queues fn on stream s with a simulated duration (gpu/runtime.h's copies and fills, the emulated
// NCCL and matmuls use it); emu_drain runs everything queued and returns the sticky error, if any.
void emu_enqueue(cudaStream_t s, long long duration, std::function<void()> fn);
cudaError_t emu_drain();
long long emu_copy_duration(size_t bytes);
