// mma.cuh: one tensor-core instruction, mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, and the
// fragment bookkeeping around it: D (16x8, fp32) = A (16x16, bf16) B (16x8, bf16) + C (16x8, fp32),
// computed by a whole warp, each lane holding a few elements of every operand in registers.
//
// The fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"). Lane l of
// the warp has group g = l / 4 (0..7) and index t = l % 4 (0..3) in its group. A 32-bit register
// holds two bf16, the element with the smaller column (A) or row (B) index in its low half.
//
//   A (16x16, row-major), 4 registers:   a[0] = A[g  ][2t, 2t+1]     a[2] = A[g  ][2t+8, 2t+9]
//                                        a[1] = A[g+8][2t, 2t+1]     a[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, "col": K x N), 2 registers: b[0] = B[2t, 2t+1][g]       b[1] = B[2t+8, 2t+9][g]
//   C, D (16x8, fp32), 4 floats:         c[0] = C[g][2t]    c[1] = C[g][2t+1]
//                                        c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
//
// So the 4 lanes of a group share two rows of C (g and g+8), and the accumulators of two adjacent
// 16x8 tiles of C (columns n0..n0+7 and n0+8..n0+15), rounded to bf16, are exactly the A fragment of
// the 16x16 block at columns n0..n0+15 in the same lanes: FlashAttention-2 feeds S's accumulators
// back as P without moving them (frag_a_from_accumulators).
//
// The emulator (GPU_EMULATOR) cannot run the PTX instruction: there the 32 lanes deposit their
// fragments in a per-warp scratch, meet at a warp barrier, and each computes its own 4 elements of D
// from the fragments of the others, with the same layout; so every index of the tiling runs on the
// CPU and only the instruction itself is left to a device (tests/gpu/test_gpu_ops.c checks both
// against a plain matrix product, tests/gpu/emu/test_emulator.cpp the emulated one alone).
#pragma once
#include <stdint.h>
#include <string.h>

#include "gpu/internal.cuh"

// Two bf16 as one register: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
    return (uint32_t)__bfloat16_as_ushort(lo) | (uint32_t)__bfloat16_as_ushort(hi) << 16;
}
// Two floats rounded to bf16 (nearest even), as one register.
__device__ __forceinline__ uint32_t pack_f32_as_bf16x2(float lo, float hi) {
    return pack_bf16x2(from_f32<bf16>(lo), from_f32<bf16>(hi));
}

#ifdef GPU_EMULATOR
// The lane's bf16 element `half` (0: low, 1: high) of register `reg` of its fragment, as float.
inline float emu_fragment_element(const uint32_t *regs, int reg, int half) {
    return f32_from_bf16_bits((uint16_t)(regs[reg] >> (16 * half)));
}
// d = a b + c over the warp, as the hardware computes it (fp32 sums of exact bf16 products), with
// the layouts above. Blocks run one after another, so a static is one block's scratch: a slot per
// warp and lane.
inline void mma_bf16_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    static uint32_t a_regs[32][32][4], b_regs[32][32][2];  // [warp][lane][register]
    const unsigned warp = (threadIdx.x / 32) % 32, lane = threadIdx.x % 32;
    for (int r = 0; r < 4; r++) a_regs[warp][lane][r] = a[r];
    for (int r = 0; r < 2; r++) b_regs[warp][lane][r] = b[r];
    __syncwarp();
    const int g = (int)lane / 4, t = (int)lane % 4;
    float d[4];
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e / 2), col = 2 * t + e % 2;  // of C, from the layout above
        float sum = c[e];
        for (int kk = 0; kk < 16; kk++) {
            // A[row][kk] lives in lane (row % 8) * 4 + (kk % 8) / 2, register row / 8 + 2 (kk / 8);
            // B[kk][col] in lane col * 4 + (kk % 8) / 2, register kk / 8; both in half kk % 2.
            int k_lane = (kk % 8) / 2, half = kk % 2;
            float a_elem = emu_fragment_element(a_regs[warp][(row % 8) * 4 + k_lane], row / 8 + 2 * (kk / 8), half);
            float b_elem = emu_fragment_element(b_regs[warp][col * 4 + k_lane], kk / 8, half);
            sum += a_elem * b_elem;  // exact: two 8-bit significands
        }
        d[e] = sum;
    }
    __syncwarp();  // every lane has read the scratch before the next mma overwrites it
    for (int e = 0; e < 4; e++) c[e] = d[e];
}
#else
__device__ __forceinline__ void mma_bf16_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// ---- where the calling lane's elements are ------------------------------------------------------
// Its g and t.
__device__ __forceinline__ int lane_group() { return (int)(threadIdx.x % 32) / 4; }
__device__ __forceinline__ int lane_in_group() { return (int)(threadIdx.x % 4); }
// Row (0..15) and column (0..7) of element e (0..3) of its C/D fragment: rows g and g + 8, columns
// 2t and 2t + 1.
__device__ __forceinline__ int acc_row(int e) { return lane_group() + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int e) { return 2 * lane_in_group() + e % 2; }

// ---- ldmatrix: four 8x8 bf16 matrices from shared memory into fragments ------------------------------
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l gives the address of row l % 8 of matrix l / 8 (16
// bytes, 16-byte aligned); register j of lane l receives matrix j's elements at row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 -- the A and B fragment layout above, for one 8x8 block. With .trans
// the matrix is read transposed: rows 2 (l % 4) and 2 (l % 4) + 1 at column l / 4. One instruction
// does what eight 32-bit (or sixteen 16-bit) shared loads and their packing did.
#ifdef GPU_EMULATOR
// The warp's 32 row addresses meet in a per-warp scratch (as mma_bf16_m16n8k16's fragments), and each
// lane reads its elements from the rows the others named.
inline void ldmatrix_x4_emulated(uint32_t r[4], const bf16 *row, bool trans) {
    static const bf16 *rows[32][32];  // [warp][lane]
    const unsigned warp = (threadIdx.x / 32) % 32, lane = threadIdx.x % 32;
    rows[warp][lane] = row;
    __syncwarp();
    const int g = (int)lane / 4, t = (int)lane % 4;
    for (int j = 0; j < 4; j++) {
        const bf16 *const *m = rows[warp] + 8 * j;  // matrix j's rows
        r[j] = trans ? pack_bf16x2(m[2 * t][g], m[2 * t + 1][g]) : pack_bf16x2(m[g][2 * t], m[g][2 * t + 1]);
    }
    __syncwarp();  // every lane has read the scratch before the next ldmatrix overwrites it
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const bf16 *row) { ldmatrix_x4_emulated(r, row, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const bf16 *row) { ldmatrix_x4_emulated(r, row, true); }
#else
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const bf16 *row) {
    unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const bf16 *row) {
    unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
#endif
// ---- cp.async: 16-byte copies from global to shared memory that do not pass through registers ----
// cp_async16 queues a copy (cp_async4: of 4 bytes, a float); cp_async_commit closes the thread's group
// of copies queued since the last commit; cp_async_wait<N> waits until all but the newest N of the
// thread's committed groups are done.
// A copy is visible to the other threads only after their wait and a barrier: the kernels wait, then
// pass a __syncthreads, before reading a streamed tile; the thread that queued a copy may read it after
// its wait alone. (cp.async.cg: cached in L2 only; 4-byte copies take .ca, the only form for them.)
#ifdef GPU_EMULATOR
// Emulated as late as the hardware may do it: a thread's copies wait in its list and are done when
// that thread waits for their group. So a kernel that reads a tile before its wait and barrier reads
// the stale tile here too, and its test fails on the CPU. Blocks run one after another: a slot per thread.
struct EmuAsyncCopy {
    void *dst;
    const void *src;
    int bytes, group;  // group: the thread's commit count when it was queued
};
struct EmuAsyncQueue {
    EmuAsyncCopy copies[64];
    int n, committed;
};
inline EmuAsyncQueue &emu_async_queue() {
    static EmuAsyncQueue queues[1024];
    return queues[threadIdx.x % 1024];
}
inline void emu_cp_async(void *dst, const void *src, int bytes) {
    EmuAsyncQueue &q = emu_async_queue();
    if (q.n == 64) __builtin_trap();  // more copies in flight than any kernel here queues
    q.copies[q.n++] = EmuAsyncCopy{dst, src, bytes, q.committed};
}
inline void cp_async16(void *dst, const void *src) { emu_cp_async(dst, src, 16); }
inline void cp_async4(void *dst, const void *src) { emu_cp_async(dst, src, 4); }
inline void cp_async_commit() { emu_async_queue().committed++; }
template <int N> inline void cp_async_wait() {
    EmuAsyncQueue &q = emu_async_queue();
    int kept = 0;
    for (int i = 0; i < q.n; i++) {
        if (q.copies[i].group < q.committed - N) memcpy(q.copies[i].dst, q.copies[i].src, q.copies[i].bytes);
        else q.copies[kept++] = q.copies[i];
    }
    q.n = kept;
}
#else
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    unsigned at = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(src));
}
__device__ __forceinline__ void cp_async4(void *dst, const void *src) {
    unsigned at = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(at), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif

// The calling lane's matrix (0..3) and row in it (0..7), for the address it gives ldmatrix.
__device__ __forceinline__ int ldmatrix_matrix() { return (int)(threadIdx.x % 32) / 8; }
__device__ __forceinline__ int ldmatrix_row() { return (int)(threadIdx.x % 8); }

// ---- fragments from bf16 tiles in shared memory (row stride ld elements, a multiple of 8; rows
// 16-byte aligned) ------------------------------------------------------------------------------------

// A = tile[r0 .. r0+15][k0 .. k0+15] (the tile row-major, as Q, dO, K, V with dimensions along rows).
// Matrices: 0 rows r0.., columns k0..; 1 rows r0+8..; 2 columns k0+8..; 3 both: a[0..3] above.
__device__ __forceinline__ void load_frag_a(uint32_t a[4], const bf16 *tile, int ld, int r0, int k0) {
    const int m = ldmatrix_matrix();
    ldmatrix_x4(a, tile + (r0 + ldmatrix_row() + 8 * (m & 1)) * ld + k0 + 8 * (m >> 1));
}
// The B fragments of two adjacent 16x8 blocks, columns n0 .. n0+7 (b[0]) and n0+8 .. n0+15 (b[1]),
// where B[k][n] = tile[n0 + n][k0 + k]: the tile holds B transposed, a row per column of B (as K
// holds K^T for S = Q K^T). Matrices: 0 rows n0.., columns k0..; 1 columns k0+8..; 2 rows n0+8..; 3 both.
__device__ __forceinline__ void load_frag_b2_from_rows_n(uint32_t b[2][2], const bf16 *tile, int ld, int n0, int k0) {
    const int m = ldmatrix_matrix();
    uint32_t r[4];
    ldmatrix_x4(r, tile + (n0 + ldmatrix_row() + 8 * (m >> 1)) * ld + k0 + 8 * (m & 1));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// The same pair where B[k][n] = tile[k0 + k][n0 + n]: the tile holds B as it is, a row per row of B
// (as V for O = P V), read transposed. Matrices: 0 rows k0.., columns n0..; 1 rows k0+8..; 2 columns
// n0+8..; 3 both.
__device__ __forceinline__ void load_frag_b2_from_rows_k(uint32_t b[2][2], const bf16 *tile, int ld, int k0, int n0) {
    const int m = ldmatrix_matrix();
    uint32_t r[4];
    ldmatrix_x4_trans(r, tile + (k0 + ldmatrix_row() + 8 * (m & 1)) * ld + n0 + 8 * (m >> 1));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// The A fragment of a 16x16 block from the accumulators of its two 16x8 halves (columns 0..7 in
// left, 8..15 in right), rounded to bf16: the same lanes hold the same elements (see the top).
__device__ __forceinline__ void frag_a_from_accumulators(uint32_t a[4], const float left[4], const float right[4]) {
    a[0] = pack_f32_as_bf16x2(left[0], left[1]);
    a[1] = pack_f32_as_bf16x2(left[2], left[3]);
    a[2] = pack_f32_as_bf16x2(right[0], right[1]);
    a[3] = pack_f32_as_bf16x2(right[2], right[3]);
}
