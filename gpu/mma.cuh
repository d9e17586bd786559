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

#include "gpu/internal.cuh"

// Two bf16 as one register: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
    return (uint32_t)__bfloat16_as_ushort(lo) | (uint32_t)__bfloat16_as_ushort(hi) << 16;
}
// Two floats rounded to bf16 (nearest even), as one register.
__device__ __forceinline__ uint32_t pack_f32_as_bf16x2(float lo, float hi) {
    return pack_bf16x2(from_f32<bf16>(lo), from_f32<bf16>(hi));
}
// Two consecutive bf16 in (shared) memory, p 4-byte aligned, as one register.
__device__ __forceinline__ uint32_t load_bf16x2(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }

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

// ---- fragments from bf16 tiles in shared memory (row stride ld elements, even) --------------------

// A = tile[r0 .. r0+15][k0 .. k0+15] (the tile row-major, as Q, dO, K, V with dimensions along rows).
__device__ __forceinline__ void load_frag_a(uint32_t a[4], const bf16 *tile, int ld, int r0, int k0) {
    const bf16 *p = tile + (r0 + lane_group()) * ld + k0 + 2 * lane_in_group();
    a[0] = load_bf16x2(p);
    a[1] = load_bf16x2(p + 8 * ld);
    a[2] = load_bf16x2(p + 8);
    a[3] = load_bf16x2(p + 8 * ld + 8);
}
// B[k][n] = tile[n0 + n][k0 + k]: the tile holds B transposed, a row per column of B (as K holds
// K^T for S = Q K^T). The pairs along k are adjacent in memory: one 32-bit load per register.
__device__ __forceinline__ void load_frag_b_from_rows_n(uint32_t b[2], const bf16 *tile, int ld, int n0, int k0) {
    const bf16 *p = tile + (n0 + lane_group()) * ld + k0 + 2 * lane_in_group();
    b[0] = load_bf16x2(p);
    b[1] = load_bf16x2(p + 8);
}
// B[k][n] = tile[k0 + k][n0 + n]: the tile holds B as it is, a row per row of B (as V for O = P V).
// The pairs along k are a row apart: two 16-bit loads per register.
__device__ __forceinline__ void load_frag_b_from_rows_k(uint32_t b[2], const bf16 *tile, int ld, int k0, int n0) {
    const bf16 *p = tile + (k0 + 2 * lane_in_group()) * ld + n0 + lane_group();
    b[0] = pack_bf16x2(p[0], p[ld]);
    b[1] = pack_bf16x2(p[8 * ld], p[9 * ld]);
}
// The A fragment of a 16x16 block from the accumulators of its two 16x8 halves (columns 0..7 in
// left, 8..15 in right), rounded to bf16: the same lanes hold the same elements (see the top).
__device__ __forceinline__ void frag_a_from_accumulators(uint32_t a[4], const float left[4], const float right[4]) {
    a[0] = pack_f32_as_bf16x2(left[0], left[1]);
    a[1] = pack_f32_as_bf16x2(left[2], left[3]);
    a[2] = pack_f32_as_bf16x2(right[0], right[1]);
    a[3] = pack_f32_as_bf16x2(right[2], right[3]);
}
