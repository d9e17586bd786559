// attention.cuh: what the two FlashAttention-2 implementations share -- attention.cu (fp32 on the
// CUDA cores, both storage types) and attention_tc.cu (bf16 on the tensor cores): the parameters of
// a call, where a row lives in the (B, T, heads, head_dim) tensors and in the (B, H, Tq) row
// statistics, the positions of a tile's rows, and D = rowsum(dO * O) for the backward pass.
#pragma once
#include <limits.h>
#include <math.h>

#include "gpu/internal.cuh"
#include "gpu/numerics.h"
#include "gpu/ops.h"

struct AttnParams {
    int B, Tq, Tk, H, KV, hd, group;
    const int *q_pos, *k_pos;  // device, or NULL for 0..T-1
    bool causal;
    float scale;
};

// Checks the shape (head_dim even, at most ATTN_MAX_HEAD_DIM; n_heads a multiple of n_kv_heads).
static inline AttnParams attn_params_of(const AttnShape *s) {
    if (s->head_dim < 2 || s->head_dim > ATTN_MAX_HEAD_DIM || s->head_dim % 2)
        fatal("gpu attention: head_dim %d must be even and at most %d", s->head_dim, ATTN_MAX_HEAD_DIM);
    if (s->n_kv_heads < 1 || s->n_heads % s->n_kv_heads)
        fatal("gpu attention: n_heads %d must be a multiple of n_kv_heads %d", s->n_heads, s->n_kv_heads);
    if (s->n_heads > 65535 || s->B > 65535) fatal("gpu attention: B %d and n_heads %d must be < 65536", s->B, s->n_heads);
    AttnParams p;
    p.B = s->B, p.Tq = s->Tq, p.Tk = s->Tk, p.H = s->n_heads, p.KV = s->n_kv_heads, p.hd = s->head_dim;
    p.group = s->n_heads / s->n_kv_heads;
    p.q_pos = s->q_pos, p.k_pos = s->k_pos, p.causal = s->causal;
    p.scale = (float)(1.0 / sqrt((double)s->head_dim));  // as reference_cpu
    return p;
}

__device__ __forceinline__ size_t q_offset(const AttnParams &p, int b, int i, int h) {
    return (((size_t)b * p.Tq + i) * p.H + h) * p.hd;
}
__device__ __forceinline__ size_t kv_offset(const AttnParams &p, int b, int j, int g) {
    return (((size_t)b * p.Tk + j) * p.KV + g) * p.hd;
}
__device__ __forceinline__ size_t stat_offset(const AttnParams &p, int b, int h, int i) {
    return ((size_t)b * p.H + h) * p.Tq + i;
}

// Positions of rows [r0, r0 + rows); rows past T_len get `outside`, chosen so that they see
// nothing (queries: INT_MIN) or are seen by nothing (keys: INT_MAX).
// (row_position: one row t's, the positions read from pos or, with pos NULL, t itself.)
__device__ __forceinline__ int row_position(const int *pos, int t, int T_len, int outside) {
    return t < T_len ? (pos ? pos[t] : t) : outside;
}
__device__ inline void load_positions(int *dst, const int *pos, int r0, int T_len, int outside, int rows = ATTN_BR) {
    for (int r = threadIdx.x; r < rows; r += blockDim.x) dst[r] = row_position(pos, r0 + r, T_len, outside);
}
// Loads the query tile's positions (rows of them); returns the largest (every thread gets it), and
// the smallest in *min_q_pos where asked. Its barrier also covers whatever the block wrote to shared
// memory before the call.
__device__ inline int load_query_positions(int *q_pos_s, const AttnParams &p, int i0, int *min_q_pos = nullptr,
                                           int rows = ATTN_BR) {
    load_positions(q_pos_s, p.q_pos, i0, p.Tq, INT_MIN, rows);
    __syncthreads();
    int max_q_pos = INT_MIN, smallest = INT_MAX;
    for (int r = 0; r < rows; r++) max_q_pos = max(max_q_pos, q_pos_s[r]), smallest = min(smallest, q_pos_s[r]);
    if (min_q_pos) *min_q_pos = smallest;
    return max_q_pos;
}
// The smallest position of a key tile (rows of them) already in shared memory, and the largest in
// *max_k_pos where asked.
__device__ inline int min_key_position(const int *k_pos_s, int *max_k_pos = nullptr, int rows = ATTN_BC) {
    int min_k_pos = INT_MAX, largest = INT_MIN;
    for (int c = 0; c < rows; c++) min_k_pos = min(min_k_pos, k_pos_s[c]), largest = max(largest, k_pos_s[c]);
    if (max_k_pos) *max_k_pos = largest;
    return min_k_pos;
}
// The tensor-core kernels' test for skipping the mask: the tile of q_rows queries from i0 and k_rows
// keys from j0 lies inside (Tq, Tk).
__device__ inline bool tile_in_range(const AttnParams &p, int i0, int j0, int q_rows = ATTN_BR, int k_rows = ATTN_BC) {
    return i0 + q_rows <= p.Tq && j0 + k_rows <= p.Tk;
}

// The positions, lse and D of query tile i0 of head h (rows past Tq: -inf and 0); thread t < 64 writes
// row t. No barrier.
__device__ inline void load_query_rows(int *q_pos_s, float *lse_s, float *D_s, const AttnParams &p, const float *lse,
                                       const float *dvec, int b, int h, int i0) {
    load_positions(q_pos_s, p.q_pos, i0, p.Tq, INT_MIN);
    for (int r = threadIdx.x; r < ATTN_BR; r += blockDim.x) {
        bool valid = i0 + r < p.Tq;
        lse_s[r] = valid ? lse[stat_offset(p, b, h, i0 + r)] : -INFINITY;
        D_s[r] = valid ? dvec[stat_offset(p, b, h, i0 + r)] : 0.0f;
    }
}
// The dK/dV kernels' step to query tile i0 of head h: load_query_rows, then false, on every thread,
// when the tile can be skipped: causal, and no query of it reaches the block's first key (min_k_pos).
// Either way every thread has passed a barrier after writing them.
__device__ inline bool load_query_tile_stats(int *q_pos_s, float *lse_s, float *D_s, const AttnParams &p,
                                             const float *lse, const float *dvec, int b, int h, int i0,
                                             int min_k_pos) {
    load_query_rows(q_pos_s, lse_s, D_s, p, lse, dvec, b, h, i0);
    __syncthreads();
    return !p.causal || __syncthreads_or(threadIdx.x < ATTN_BR && q_pos_s[threadIdx.x] >= min_k_pos);
}

// D (B,H,Tq) = rowsum(dO * O) for bf16 tensors, queued on the compute stream (attention.cu).
void attention_dvec_bf16(float *dvec, const bf16 *dout, const bf16 *out, const AttnParams &p);
