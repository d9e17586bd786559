// internal.cuh: what the .cu files of gpu/ share and nothing outside needs: error checks, kernel
// launches, the conversions between storage types and float, block-wide reductions.
//
// The same sources also build for tests/gpu/emu, which runs the kernels on the CPU (GPU_EMULATOR:
// its own cuda_runtime.h and cuda_bf16.h come first on the include path); the only two constructs a
// header cannot emulate, the <<<>>> launch and extern __shared__, are the macros below.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "gpu/launch.h"
#include "gpu/runtime.h"

extern "C" {
#include "common/log.h"
}

// Every CUDA runtime call is checked; a failure ends the run naming the call and where it was.
#define CUDA_CHECK(call)                                                                              \
    do {                                                                                              \
        cudaError_t err_ = (call);                                                                    \
        if (err_ != cudaSuccess) fatal("CUDA error: %s at %s:%d: %s", #call, __FILE__, __LINE__,   \
                                       cudaGetErrorString(err_));                                     \
    } while (0)

cudaStream_t gpu_stream(void);  // the compute stream every op is queued on (runtime.cu)

// kernel<<<grid, block, dynamic shared bytes, compute stream>>>(args), and the kernel's dynamic
// shared memory as `type *name`.
#ifdef GPU_EMULATOR
#define GPU_LAUNCH_RAW(kernel, grid, block, smem_bytes, ...)                                                 \
    emu_launch(reinterpret_cast<const void *>(&kernel), dim3(grid), dim3(block), (smem_bytes), gpu_stream(), \
               [=] { kernel(__VA_ARGS__); })
#define GPU_DYNAMIC_SMEM(type, name) type *name = static_cast<type *>(emu_dynamic_smem())
#else
#define GPU_LAUNCH_RAW(kernel, grid, block, smem_bytes, ...) \
    kernel<<<(grid), (block), (smem_bytes), gpu_stream()>>>(__VA_ARGS__)
#define GPU_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif
// Every launch is checked where it is made, naming the kernel and the launch's file:line. A bad
// configuration (too much shared memory, too many threads) shows up at once; a fault inside the
// kernel (an illegal address, a trap) only at the next synchronisation, which may be far away --
// unless sync-debug mode is on (LLAMA_CUDA_SYNC_DEBUG=1, or gpu_set_sync_debug), which
// synchronises after every launch so that the failing kernel is the one named.
#define GPU_LAUNCH(kernel, grid, block, smem_bytes, ...)                \
    do {                                                                \
        GPU_LAUNCH_RAW(kernel, grid, block, smem_bytes, __VA_ARGS__);   \
        gpu_launch_check(#kernel, __FILE__, __LINE__);                  \
    } while (0)

static inline void gpu_launch_check(const char *kernel, const char *file, int line) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) fatal("CUDA error launching %s at %s:%d: %s", kernel, file, line, cudaGetErrorString(err));
    if (!gpu_sync_debug()) return;
    err = cudaStreamSynchronize(gpu_stream());
    if (err != cudaSuccess)
        fatal("CUDA error in kernel %s launched at %s:%d: %s (sync-debug mode: synchronised after the launch)", kernel,
              file, line, cudaGetErrorString(err));
}

// Grid-stride loop over [0, n): each launch covers any n with at most GPU_MAX_BLOCKS_1D blocks.
#define GRID_STRIDE_LOOP(i, n) \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

// Launches an element-wise kernel over n elements, nothing for n == 0.
#define LAUNCH_1D(kernel, n, ...)                                                                    \
    do {                                                                                             \
        unsigned blocks_ = grid_1d((n), GPU_THREADS_1D, GPU_MAX_BLOCKS_1D);                          \
        if (blocks_) {                                                                               \
            GPU_LAUNCH(kernel, blocks_, GPU_THREADS_1D, 0, __VA_ARGS__);                             \
        }                                                                                            \
    } while (0)

void gpu_matmul_shutdown(void);  // matmul.cu: destroys the cuBLASLt handle, plans and workspace

// ---- storage types: tensors are float or bf16 in memory, arithmetic is always float -------------
typedef __nv_bfloat16 bf16;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// cvt.rn.bf16.f32: round to nearest even, the rounding gpu/numerics.h's bf16_bits_from_f32 spells out.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// ---- 16-byte packs ------------------------------------------------------------------------------
// W consecutive elements moved as one access of W * sizeof(T) bytes (16: one 128-bit load or store
// per thread); element i of load_pack / store_pack is the pack at p + i W.
template <typename T, int W> struct alignas(sizeof(T) * W) Pack {
    T v[W];
};
template <int W, typename T> __device__ __forceinline__ Pack<T, W> load_pack(const T *p, size_t i) {
    return reinterpret_cast<const Pack<T, W> *>(p)[i];
}
template <int W, typename T> __device__ __forceinline__ void store_pack(T *p, size_t i, const Pack<T, W> &x) {
    reinterpret_cast<Pack<T, W> *>(p)[i] = x;
}

// ---- block-wide reductions (blockDim.x a multiple of 32, at most 1024) ----------------------------
// Every thread gets the result. The order of the additions depends only on blockDim.x, so results
// are the same run to run. `scratch` holds 32 values; it may be reused by the next call.
template <typename V> __device__ __forceinline__ V warp_sum(V x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <typename V> __device__ V block_sum(V x, V *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    x = warp_sum(x);
    __syncthreads();  // a previous call may still be reading scratch
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : V(0);
    return warp_sum(x);
}
__device__ __forceinline__ float block_max(float x, float *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : -INFINITY;
    return warp_max(x);
}
