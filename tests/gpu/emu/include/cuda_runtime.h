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

// Runs kernel_body once per thread of every block of the grid, with dynamic_smem_bytes of dynamic
// shared memory per block (filled with NaN bytes before each block: reading it before writing it
// shows up). `kernel` identifies the kernel for its shared-memory opt-in.
void emu_launch(const void *kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
                const std::function<void()> &kernel_body);
void *emu_dynamic_smem();

// ---- the runtime API the .cu files call --------------------------------------------------------------
typedef int cudaError_t;
#define cudaSuccess 0
typedef struct EmuStream *cudaStream_t;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char *cudaGetErrorString(cudaError_t) { return "no error (emulated)"; }
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
// Records the opt-in limit; emu_launch refuses more dynamic shared memory than the kernel opted into
// (or 48 KiB without), as the hardware does.
void emu_set_max_dynamic_smem(const void *kernel, int bytes);
template <typename Kernel> cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute, int bytes) {
    emu_set_max_dynamic_smem(reinterpret_cast<const void *>(kernel), bytes);
    return cudaSuccess;
}

// Events: a launch runs to completion before emu_launch returns, so an event's time is the host
// clock when it is recorded.
struct EmuEvent {
    long long ns;
};
typedef EmuEvent *cudaEvent_t;
extern "C" long long now_ns(void);
inline cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new EmuEvent{0};
    return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    e->ns = now_ns();
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->ns - start->ns) * 1e-6);
    return cudaSuccess;
}

// Streams: every launch and copy completes when it is issued, so streams and the waits between
// them have nothing to order.
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = nullptr;
    return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
