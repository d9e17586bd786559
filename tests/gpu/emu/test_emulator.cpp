// test_emulator.cpp: the emulator can fail. Kernels with a known answer (shuffles, __syncthreads_or,
// shared memory across warps, dynamic shared memory) must get it; a kernel whose cross-warp read is
// ordered only by a warp barrier must be caught reading stale data; with the argument `deadlock`, a
// barrier that half the block skips must end the run with the emulator's deadlock message
// (tests/t_gpu_emulated.sh checks that exit); with `fault`, a kernel that traps must be reported, by
// its name and launch line in sync-debug mode; `schedule` prints a fingerprint of the scheduler's
// thread order, which GPU_EMU_SEED must change. Also the emulated mma.m16n8k16 (gpu/mma.cuh) against
// a plain matrix product, its fragments built here from the PTX ISA's element formulas, and the bf16
// bit casts it relies on.
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/hash.h"
#include "gpu/internal.cuh"
#include "gpu/mma.cuh"

static int failures;
static void expect(bool ok, const char *what) {
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    failures += !ok;
}

// Each lane gets the sum of its warp's lane ids through a butterfly of shuffles: 0 + ... + 31 = 496.
__global__ void warp_sum_kernel(int *out) {
    int x = (int)threadIdx.x % 32;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

// Only thread 77 votes true in odd blocks (or), and only thread 77 votes false in odd blocks (and).
__global__ void vote_kernel(int *out) {
    int any = __syncthreads_or(blockIdx.x % 2 == 1 && threadIdx.x == 77);
    int all = __syncthreads_and(!(blockIdx.x % 2 == 1 && threadIdx.x == 77));
    out[blockIdx.x * blockDim.x + threadIdx.x] = any + 2 * all;
}

// Warp 1 reads what warp 0 wrote. With a block barrier between them it always sees it; with only a
// warp barrier (`racy`) it may not, and the emulator's run-ahead rounds must make that happen.
__global__ void cross_warp_kernel(int *out, bool racy) {
    __shared__ int value[32];
    if (threadIdx.x < 32) value[threadIdx.x] = (int)blockIdx.x + 1;
    if (racy) __syncwarp();
    else __syncthreads();
    if (threadIdx.x >= 32) out[blockIdx.x * 32 + threadIdx.x - 32] = value[threadIdx.x - 32];
}

// Dynamic shared memory arrives as NaN bytes; a kernel that writes it first reads its own values.
__global__ void dynamic_smem_kernel(float *out) {
    GPU_DYNAMIC_SMEM(float, buffer);
    out[threadIdx.x] = buffer[threadIdx.x];  // before writing: the poison
    __syncthreads();
    buffer[blockDim.x - 1 - threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[blockDim.x + threadIdx.x] = buffer[threadIdx.x];
}

__global__ void divergent_barrier_kernel() {
    if (threadIdx.x < 64) __syncthreads();
}

// A fault in a kernel (as an out-of-bounds address would be on a device).
__global__ void trapping_kernel() {
    if (threadIdx.x == 5) __trap();
}
__global__ void idle_kernel() {}

// Each thread takes a ticket in the order the scheduler runs it (one fiber runs at a time, so the
// plain increment is atomic here); two barriers give the scheduler two more orders to choose.
__global__ void ticket_kernel(int *tickets) {
    __shared__ int next;
    if (threadIdx.x == 0) next = 0;
    for (int round = 0; round < 3; round++) {
        __syncthreads();
        tickets[round * blockDim.x + threadIdx.x] = next++;
        __syncthreads();
        if (threadIdx.x == 0) next = 0;
    }
}

// One warp: d (16x8) = a (16x16) b (16x8), all row-major floats holding bf16 values, through the
// emulated mma. Each lane gathers its fragment elements by the PTX ISA's formulas, element by
// element (A: a0..a7, row g for i in {0,1,4,5} else g+8, column 2t + (i & 1) + 8 (i >= 4); B: b0..b3,
// row 2t + (i & 1) + 8 (i >= 2), column g; C: c0..c3, row g + 8 (i >= 2), column 2t + (i & 1)),
// element i in register i / 2, half i % 2.
__global__ void mma_kernel(float *d, const float *a, const float *b) {
    int lane = (int)threadIdx.x, g = lane / 4, t = lane % 4;
    uint32_t fa[4] = {0, 0, 0, 0}, fb[2] = {0, 0};
    for (int i = 0; i < 8; i++) {
        int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8, col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
        fa[i / 2] |= (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a[row * 16 + col])) << (16 * (i % 2));
    }
    for (int i = 0; i < 4; i++) {
        int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0), col = g;
        fb[i / 2] |= (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b[row * 8 + col])) << (16 * (i % 2));
    }
    float c[4] = {0, 0, 0, 0};
    mma_bf16_m16n8k16(c, fa, fb);
    for (int i = 0; i < 4; i++) d[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = c[i];
}

int main(int argc, char **argv) {
    if (argc > 1 && std::strcmp(argv[1], "deadlock") == 0) {
        GPU_LAUNCH(divergent_barrier_kernel, 1, 128, 0);
        gpu_synchronize();
        std::printf("FAIL: a barrier half the block skips did not deadlock\n");
        return 0;
    }
    // `fault`: a kernel traps, more kernels follow, then the host waits. Without sync-debug mode the
    // error surfaces at the wait (gpu_synchronize); with LLAMA_CUDA_SYNC_DEBUG=1 the launch of
    // trapping_kernel is named, with this file and line (tests/t_gpu_emulated.sh checks both).
    if (argc > 1 && std::strcmp(argv[1], "fault") == 0) {
        GPU_LAUNCH(trapping_kernel, 2, 64, 0);
        GPU_LAUNCH(idle_kernel, 1, 32, 0);
        gpu_synchronize();
        std::printf("FAIL: a trapping kernel was not reported\n");
        return 0;
    }
    // `schedule`: a fingerprint of the order the scheduler ran the threads in (GPU_EMU_SEED changes it).
    if (argc > 1 && std::strcmp(argv[1], "schedule") == 0) {
        std::vector<int> tickets(3 * 128);
        int *tickets_ptr = tickets.data();
        GPU_LAUNCH(ticket_kernel, 1, 128, 0, tickets_ptr);
        gpu_synchronize();
        unsigned long long h = FNV1A_BASIS;
        for (int t : tickets) h = fnv1a_word(h, (unsigned)t);
        std::printf("schedule %016llx\n", h);
        return 0;
    }
    // (The lambda GPU_LAUNCH makes copies its captures const: pass plain pointers.)
    std::vector<int> sums(4 * 64);
    int *sums_ptr = sums.data();
    GPU_LAUNCH(warp_sum_kernel, 4, 64, 0, sums_ptr);
    gpu_synchronize();
    bool ok = true;
    for (int s : sums) ok = ok && s == 496;
    expect(ok, "warp shuffles: every lane has its warp's sum");

    std::vector<int> votes(6 * 128);
    int *votes_ptr = votes.data();
    GPU_LAUNCH(vote_kernel, 6, 128, 0, votes_ptr);
    gpu_synchronize();
    ok = true;
    for (int b = 0; b < 6; b++)
        for (int t = 0; t < 128; t++) ok = ok && votes[b * 128 + t] == (b % 2 ? 1 : 2);
    expect(ok, "__syncthreads_or and __syncthreads_and: one thread's vote reaches all, per block");

    const int blocks = 64;
    std::vector<int> seen(blocks * 32);
    int *seen_ptr = seen.data();
    GPU_LAUNCH(cross_warp_kernel, blocks, 64, 0, seen_ptr, false);
    gpu_synchronize();
    ok = true;
    for (int b = 0; b < blocks; b++)
        for (int l = 0; l < 32; l++) ok = ok && seen[b * 32 + l] == b + 1;
    expect(ok, "cross-warp read after __syncthreads sees the write");
    std::fill(seen.begin(), seen.end(), 0);
    GPU_LAUNCH(cross_warp_kernel, blocks, 64, 0, seen_ptr, true);
    gpu_synchronize();
    int stale = 0;
    for (int b = 0; b < blocks; b++)
        for (int l = 0; l < 32; l++) stale += seen[b * 32 + l] != b + 1;
    expect(stale > 0, "cross-warp read after only __syncwarp is caught reading stale data");

    std::vector<float> smem_out(2 * 96);
    float *smem_out_ptr = smem_out.data();
    GPU_LAUNCH(dynamic_smem_kernel, 1, 96, 96 * sizeof(float), smem_out_ptr);
    gpu_synchronize();
    ok = true;
    for (int t = 0; t < 96; t++) ok = ok && std::isnan(smem_out[t]) && smem_out[96 + t] == (float)(95 - t);
    expect(ok, "dynamic shared memory: poisoned with NaN, then shared by the block");

    // The shared-memory carveout is a percentage (or -1, the default): the hardware's range, checked.
    ok = cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared) == cudaSuccess &&
         cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, -1) == cudaSuccess &&
         cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 101) ==
             cudaErrorInvalidValue;
    expect(ok, "cudaFuncAttributePreferredSharedMemoryCarveout: 100 and -1 accepted, 101 refused");

    // bf16 bit casts: 1.5 is 0x3fc0, -2 is 0xc000, and back.
    ok = __bfloat16_as_ushort(__float2bfloat16_rn(1.5f)) == 0x3fc0 &&
         __bfloat16_as_ushort(__float2bfloat16_rn(-2.0f)) == 0xc000 &&
         __bfloat162float(__ushort_as_bfloat16(0x3fc0)) == 1.5f;
    expect(ok, "__bfloat16_as_ushort / __ushort_as_bfloat16: known bits");

    // The emulated mma: small integers (exact in bf16, and their sums of products in fp32), so the
    // product must match exactly; the values vary along every row and column, so a wrong lane, register
    // or half changes some element.
    std::vector<float> ma(16 * 16), mb(16 * 8), md(16 * 8, -1.0f);
    for (int x = 0; x < 256; x++) ma[x] = (float)((x * 7) % 13 - 6);
    for (int x = 0; x < 128; x++) mb[x] = (float)((x * 5) % 11 - 5);
    float *md_ptr = md.data();
    const float *ma_ptr = ma.data(), *mb_ptr = mb.data();
    GPU_LAUNCH(mma_kernel, 1, 32, 0, md_ptr, ma_ptr, mb_ptr);
    gpu_synchronize();
    ok = true;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 8; j++) {
            float want = 0;
            for (int kk = 0; kk < 16; kk++) want += ma[i * 16 + kk] * mb[kk * 8 + j];
            ok = ok && md[i * 8 + j] == want;
        }
    expect(ok, "emulated mma.m16n8k16: the fragments' product is the matrix product");

    std::printf("test_emulator: %d failed\n", failures);
    return failures ? 1 : 0;
}
