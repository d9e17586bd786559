// launch.h: launch geometry and shared-memory layouts as pure functions. The kernels use them, and
// tests/test_gpu_host.c checks them on any machine (non-overlapping regions, the H100's limits,
// empty launches).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/hd.h"

// ---- element-wise kernels ----------------------------------------------------------------------------
#define GPU_THREADS_1D 256
#define GPU_MAX_BLOCKS_1D 65536u  // beyond this the kernels' grid-stride loops cover the rest

// Blocks for n elements, one per thread, at most max_blocks. 0 when n == 0: the caller skips the
// launch (a grid of 0 blocks is a launch error).
static inline unsigned grid_1d(size_t n, unsigned threads, unsigned max_blocks) {
    size_t blocks = (n + threads - 1) / threads;
    return blocks < max_blocks ? (unsigned)blocks : max_blocks;
}

// The alignment of a device address: the largest power of two dividing it, capped at 256 (what
// cuBLASLt's heuristic must be told; it assumes 256 unless told otherwise).
static inline unsigned ptr_alignment(uintptr_t address) {
    unsigned a = 256;
    while (a > 1 && address % a != 0) a >>= 1;
    return a;
}

// ---- FlashAttention-2 kernels (gpu/attention.cu) ------------------------------------------------------
// A block owns a tile of ATTN_BR query rows (forward, dQ) or ATTN_BC key rows (dK/dV) of one head,
// with ATTN_THREADS threads: ATTN_THREADS_PER_ROW consecutive lanes share a row. Each thread scores
// ATTN_BC / ATTN_THREADS_PER_ROW keys (or queries) of the other tile and owns head_dim /
// ATTN_THREADS_PER_ROW dimensions of the row's accumulators, in registers.
#define ATTN_BR 64
#define ATTN_BC 64
#define ATTN_THREADS 256
#define ATTN_THREADS_PER_ROW (ATTN_THREADS / ATTN_BR)
#define ATTN_MAX_HEAD_DIM 128
#define ATTN_SMEM_LIMIT 232448  // bytes a block may opt into on sm_90 (227 KiB)

typedef enum { ATTN_KERNEL_FORWARD, ATTN_KERNEL_BACKWARD_DQ, ATTN_KERNEL_BACKWARD_DKDV } AttnKernel;

// Shared memory of one block, in 4-byte words (floats and ints). Tiles with head_dim columns have
// row stride head_dim + 1: head_dim is even, so the stride is odd and the lanes of a warp reading one
// column of different rows hit different banks. Offsets are -1 for regions a kernel does not use.
typedef struct {
    int ld;         // row stride of q, dout, k, v
    int ld_scores;  // row stride of p and ds
    int q, dout;    // (ATTN_BR, head_dim) query-side tiles
    int k, v;       // (ATTN_BC, head_dim) key-side tiles
    int p, ds;      // probabilities and score gradients: (ATTN_BR, ATTN_BC), transposed in dK/dV
    int q_pos, k_pos;  // positions of the tile's rows (ints)
    int lse, dvec;     // per query row: log-sum-exp and D = dO . O (dK/dV only)
    int words;         // total
} AttnSmemLayout;

GPU_HD AttnSmemLayout attn_smem_layout(AttnKernel kernel, int head_dim) {
    AttnSmemLayout L;
    L.ld = head_dim + 1;
    L.q = L.dout = L.k = L.v = L.p = L.ds = L.q_pos = L.k_pos = L.lse = L.dvec = -1;
    int at = 0;
    L.q = at, at += ATTN_BR * L.ld;
    if (kernel != ATTN_KERNEL_FORWARD) L.dout = at, at += ATTN_BR * L.ld;
    L.k = at, at += ATTN_BC * L.ld;
    L.v = at, at += ATTN_BC * L.ld;
    if (kernel == ATTN_KERNEL_BACKWARD_DKDV) {  // p and ds transposed: a row per key
        L.ld_scores = ATTN_BR + 1;
        L.p = at, at += ATTN_BC * L.ld_scores;
        L.ds = at, at += ATTN_BC * L.ld_scores;
    } else {
        L.ld_scores = ATTN_BC + 1;
        if (kernel == ATTN_KERNEL_FORWARD) L.p = at, at += ATTN_BR * L.ld_scores;
        else L.ds = at, at += ATTN_BR * L.ld_scores;
    }
    L.q_pos = at, at += ATTN_BR;
    L.k_pos = at, at += ATTN_BC;
    if (kernel == ATTN_KERNEL_BACKWARD_DKDV) {
        L.lse = at, at += ATTN_BR;
        L.dvec = at, at += ATTN_BR;
    }
    L.words = at;
    return L;
}

static inline size_t attn_smem_bytes(AttnKernel kernel, int head_dim) {
    return (size_t)attn_smem_layout(kernel, head_dim).words * 4;
}

// ---- FlashAttention-2 on the tensor cores (gpu/attention_tc.cu) ----------------------------------------
// The same 64-row tiles (ATTN_BR, ATTN_BC), now with ATTN_TC_WARPS warps per block, each owning 16 of
// the block's rows: the m of mma.m16n8k16. head_dim must be a multiple of 16 (the k of the
// instruction), at most ATTN_MAX_HEAD_DIM.
#define ATTN_TC_WARPS 4
#define ATTN_TC_THREADS (32 * ATTN_TC_WARPS)
#define ATTN_TC_ROWS_PER_WARP (ATTN_BR / ATTN_TC_WARPS)
#define ATTN_TC_PAD 8  // bf16 elements added to every tile row: 16 bytes

// Shared memory of one block, in bytes. The bf16 tiles (64 rows by head_dim) have row stride
// head_dim + 8 elements: rows of whole 16-byte chunks (the tiles are copied 16 bytes at a time), and
// every ldmatrix of gpu/mma.cuh reads 8 rows that fall in 8 different bank quads
// (tests/test_gpu_host.c checks it). Then the positions of the tiles' rows (ints) and, for dK/dV, the
// query tile's lse and D (floats). A kernel holds its own tile (queries in forward and dQ, keys in
// dK/dV) once and streams the other side's through two stages: while it computes on one, the next
// is copied into the other (cp.async). The fixed regions come first, then stage 0's regions, then
// stage 1's in the same order: stage s of a streamed region is at its offset + s * stage_bytes.
// Offsets are -1 for regions a kernel does not use.
typedef struct {
    int ld;               // row stride of the tiles, in bf16 elements
    int q, dout, k, v;    // (rows, head_dim) bf16 tiles: the own tile's rows, or a streamed stage's 64
    int q_pos, k_pos;     // positions of the tiles' rows (ints)
    int lse, dvec;        // per query row (dK/dV only)
    int stage_bytes;      // from a streamed region's stage 0 to its stage 1
    int bytes;            // total
} AttnTcSmemLayout;

// own_rows: the rows of the block's own tile, the side it holds (queries in forward and dQ, keys in
// dK/dV): ATTN_BR, or 2 ATTN_BR for the 128-row tiles (gpu/attention_tc.cu). The streamed side's tiles
// stay 64 rows, so the stages' size does not depend on it (written as a constant: computed as a
// difference of offsets, it cost the dQ kernel a register spill at its 128-register cap).
GPU_HD AttnTcSmemLayout attn_tc_smem_layout_rows(AttnKernel kernel, int head_dim, int own_rows) {
    AttnTcSmemLayout L;
    L.ld = head_dim + ATTN_TC_PAD;
    L.q = L.dout = L.k = L.v = L.q_pos = L.k_pos = L.lse = L.dvec = -1;
    const int tile = ATTN_BR * L.ld * 2, own_tile = own_rows * L.ld * 2;  // ATTN_BR == ATTN_BC
    int at = 0;
    if (kernel != ATTN_KERNEL_BACKWARD_DKDV) {  // own: the query side; streamed: K, V, their positions
        L.q = at, at += own_tile;
        if (kernel == ATTN_KERNEL_BACKWARD_DQ) L.dout = at, at += own_tile;
        L.q_pos = at, at += own_rows * 4;
        L.stage_bytes = 2 * tile + ATTN_BC * 4;
        L.k = at, at += tile;
        L.v = at, at += tile;
        L.k_pos = at, at += ATTN_BC * 4;
    } else {  // own: the key side; streamed: Q, dO and the query rows' positions, lse and D
        L.k = at, at += own_tile;
        L.v = at, at += own_tile;
        L.k_pos = at, at += own_rows * 4;
        L.stage_bytes = 2 * tile + 3 * ATTN_BR * 4;
        L.q = at, at += tile;
        L.dout = at, at += tile;
        L.q_pos = at, at += ATTN_BR * 4;
        L.lse = at, at += ATTN_BR * 4;
        L.dvec = at, at += ATTN_BR * 4;
    }
    at += L.stage_bytes;  // stage 1
    L.bytes = at;
    return L;
}
GPU_HD AttnTcSmemLayout attn_tc_smem_layout(AttnKernel kernel, int head_dim) {
    return attn_tc_smem_layout_rows(kernel, head_dim, ATTN_BR);
}
