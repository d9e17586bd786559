// attention.cu: causal GQA attention as FlashAttention-2 (Dao, 2023): tiled, online softmax, the
// log-sum-exp kept from forward, the probabilities recomputed in backward. fp32 arithmetic on the
// CUDA cores for both storage types: the readable, checkable version. The fp32 entry points run it;
// the bf16 ones run attention_tc.cu's tensor-core kernels (the same structure, the tile products as
// mma.sync) where those support the shape, and this kernel otherwise and as the _simt variants.
//
// Shapes (as reference_cpu): q, out, dq (B,Tq,H,hd); k, v, dk, dv (B,Tk,KV,hd); lse, D (B,H,Tq).
// Query head h reads kv head g = h / (H/KV). S = scale Q K^T, P = softmax(S) under the causal mask
// (query at position qp sees key at kp iff kp <= qp), O = P V.
//
// Tiling (gpu/launch.h): a block holds one tile of ATTN_BR = 64 query rows or ATTN_BC = 64 key rows
// in shared memory and streams the other side's tiles through it. 256 threads, 4 per row: the
// lanes 4r..4r+3 of a warp own row r; lane `sub` of a row scores the other tile's rows
// sub, sub+4, ..., sub+60 and owns the dimensions d = sub, sub+4, ... of the row's accumulators,
// which live in registers (head_dim <= 128: 32 floats each). The 4 lanes combine their partial
// maxima and sums with butterfly shuffles, so all four hold identical copies of the row's state.
//
//   forward   grid (Tq/64, H, B)   for each key tile: S = Q K^T (64x64), the online softmax
//             update of m and l per row, O = O * correction + P V. Writes O / l and lse = m + log l.
//   backward  D = rowsum(dO * O) (a warp per row; bf16 rows in 16-byte packs, hd/8 lanes), then two kernels, so that every gradient
//             element is summed by one thread in a fixed order (no atomics: reproducible):
//     dQ      grid (Tq/64, H, B)   for each key tile: recompute P = exp(S - lse), dP = dO V^T,
//             dS = P (dP - D) scale, dQ += dS K.
//     dK, dV  grid (Tk/64, KV, B)  for each query head h of the group and each query tile:
//             recompute P and dS (transposed: a row per key), dV += P^T dO, dK += dS^T Q.
//             Heads in order, then query rows in order: the reference's order of summation.
// Recomputing S and dP in both backward kernels costs 2 extra tile products of 5 (1.4x the
// FLOPs of a single-pass backward with atomic dQ), the price of determinism here.
//
// Causal skipping: a tile pair in which no query position reaches the smallest key position does no
// work. Positions may be arbitrary (ring attention passes chunks), so the block votes with
// __syncthreads_or rather than assuming the tiles are ordered.
#include <type_traits>

#include "gpu/attention.cuh"

#define TPR ATTN_THREADS_PER_ROW
constexpr int OTHER_PER_THREAD = ATTN_BC / TPR;        // rows of the other tile a thread scores
constexpr int DIMS_PER_THREAD = ATTN_MAX_HEAD_DIM / TPR;  // accumulator dimensions a thread owns
static_assert(ATTN_BR == ATTN_BC, "the thread mapping assumes square tiles");
static_assert(TPR == 4 && ATTN_THREADS % 32 == 0, "a row's lanes must sit in one warp");

// Rows [r0, r0 + ATTN_BR) of head `head` of a (B, T_len, n_heads, hd) tensor into a shared tile with
// row stride ld, as float; rows past T_len are zero. Consecutive threads read consecutive elements.
template <typename T>
__device__ void load_tile(float *dst, int ld, const T *src, int b, int r0, int T_len, int n_heads, int head, int hd) {
    for (int e = threadIdx.x; e < ATTN_BR * hd; e += blockDim.x) {
        int r = e / hd, d = e % hd, t = r0 + r;
        dst[r * ld + d] = t < T_len ? to_f32(src[(((size_t)b * T_len + t) * n_heads + head) * hd + d]) : 0.0f;
    }
}
// The forward and dQ kernels' step to the key tile at j0: its positions, then, unless no query of
// the block (largest position max_q_pos) can see any of its keys, its K and V. False: skip the tile.
// Either way every thread has passed a barrier after its last read of the previous tile's positions.
template <typename T>
__device__ bool load_key_tile(float *Ks, float *Vs, int *k_pos_s, int ld, const T *k, const T *v, const AttnParams &p,
                              int b, int g, int j0, int max_q_pos) {
    load_positions(k_pos_s, p.k_pos, j0, p.Tk, INT_MAX);
    __syncthreads();
    if (p.causal && !__syncthreads_or(threadIdx.x < ATTN_BC && k_pos_s[threadIdx.x] <= max_q_pos)) return false;
    load_tile(Ks, ld, k, b, j0, p.Tk, p.KV, g, p.hd);
    load_tile(Vs, ld, v, b, j0, p.Tk, p.KV, g, p.hd);
    __syncthreads();
    return true;
}
// Sum or max over the TPR lanes of a row (butterfly: every lane gets the same bits).
__device__ __forceinline__ float row_lanes_sum(float x) {
    for (int o = 1; o < TPR; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float row_lanes_max(float x) {
    for (int o = 1; o < TPR; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// ================================ forward ========================================================

template <typename T>
__global__ void __launch_bounds__(ATTN_THREADS)
flash_forward_kernel(T *out, float *lse, const T *q, const T *k, const T *v, AttnParams p) {
    GPU_DYNAMIC_SMEM(float, smem);
    const AttnSmemLayout L = attn_smem_layout(ATTN_KERNEL_FORWARD, p.hd);
    float *Qs = smem + L.q, *Ks = smem + L.k, *Vs = smem + L.v, *Ps = smem + L.p;
    int *q_pos_s = reinterpret_cast<int *>(smem + L.q_pos), *k_pos_s = reinterpret_cast<int *>(smem + L.k_pos);
    const int i0 = blockIdx.x * ATTN_BR, h = blockIdx.y, b = blockIdx.z, g = h / p.group;
    const int row = threadIdx.x / TPR, sub = threadIdx.x % TPR, i = i0 + row;
    const bool row_valid = i < p.Tq;

    load_tile(Qs, L.ld, q, b, i0, p.Tq, p.H, h, p.hd);
    const int max_q_pos = load_query_positions(q_pos_s, p, i0);  // its barrier also covers Qs

    OnlineSoftmax st = {-INFINITY, 0.0f};
    float acc[DIMS_PER_THREAD];  // unnormalised output: sum over keys of exp(s - m) v, dims sub + 4 dd
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) acc[dd] = 0.0f;

    for (int j0 = 0; j0 < p.Tk; j0 += ATTN_BC) {
        if (!load_key_tile(Ks, Vs, k_pos_s, L.ld, k, v, p, b, g, j0, max_q_pos)) continue;

        // S for this thread's keys c = sub + 4 kk: dot products over d, q_d read once per d.
        float s[OTHER_PER_THREAD];
#pragma unroll
        for (int kk = 0; kk < OTHER_PER_THREAD; kk++) s[kk] = 0.0f;
        const float *q_row = Qs + row * L.ld;
        for (int d = 0; d < p.hd; d++) {
            float qd = q_row[d];
#pragma unroll
            for (int kk = 0; kk < OTHER_PER_THREAD; kk++) s[kk] += qd * Ks[(kk * TPR + sub) * L.ld + d];
        }
        float tile_max = -INFINITY;
#pragma unroll
        for (int kk = 0; kk < OTHER_PER_THREAD; kk++) {
            int c = kk * TPR + sub, j = j0 + c;
            bool visible = row_valid && j < p.Tk && attn_pos_visible(p.causal, q_pos_s[row], k_pos_s[c]);
            s[kk] = visible ? s[kk] * p.scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[kk]);
        }
        float correction = online_softmax_rescale(&st, row_lanes_max(tile_max));
        float weight_sum = 0.0f;
        float *p_row = Ps + row * L.ld_scores;
#pragma unroll
        for (int kk = 0; kk < OTHER_PER_THREAD; kk++) {
            float w = online_softmax_weight(&st, s[kk]);
            weight_sum += w;
            p_row[kk * TPR + sub] = w;
        }
        online_softmax_add(&st, row_lanes_sum(weight_sum));
        __syncwarp();  // the row's P, written by its 4 lanes, is read by the same 4 lanes

        // O = O * correction + P V over the tile's keys in order.
#pragma unroll
        for (int dd = 0; dd < DIMS_PER_THREAD; dd++) acc[dd] *= correction;
        for (int c = 0; c < ATTN_BC; c++) {
            float w = p_row[c];
            const float *v_row = Vs + c * L.ld;
#pragma unroll
            for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
                int d = dd * TPR + sub;
                if (d < p.hd) acc[dd] += w * v_row[d];
            }
        }
        __syncthreads();  // before the next tile overwrites K, V, P and the key positions
    }

    if (!row_valid) return;
    T *o = out + q_offset(p, b, i, h);
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
        int d = dd * TPR + sub;
        if (d < p.hd) o[d] = from_f32<T>(online_softmax_output(&st, acc[dd]));
    }
    if (sub == 0) lse[stat_offset(p, b, h, i)] = online_softmax_lse(&st);
}

// ================================ backward =======================================================

// D (B,H,Tq) = rowsum(dO * O): one warp per query row.
template <typename T>
__global__ void attention_dvec_kernel(float *dvec, const T *dout, const T *out, AttnParams p) {
    size_t n_rows = (size_t)p.B * p.H * p.Tq;
    size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;  // the same for a whole warp
    int lane = threadIdx.x % 32;
    if (w >= n_rows) return;
    int i = (int)(w % p.Tq), h = (int)((w / p.Tq) % p.H), b = (int)(w / ((size_t)p.Tq * p.H));
    size_t at = q_offset(p, b, i, h);
    float sum = 0.0f;
    for (int d = lane; d < p.hd; d += 32) sum += to_f32(dout[at + d]) * to_f32(out[at + d]);
    sum = warp_sum(sum);
    if (lane == 0) dvec[w] = sum;  // w = (b H + h) Tq + i: the layout of lse
}

// The same for bf16 rows in 16-byte packs: LANES = hd / 8 consecutive lanes a row (LANES a power of two,
// so a row never straddles warps), lane l multiplying elements 8l .. 8l+7 of the row's dO and O and
// summing its 8 products in order, then the row's lanes adding their sums by a butterfly (every lane
// ends with the same bits). The order of summation is fixed by hd alone: run to run the same bits.
template <int LANES>
__global__ void attention_dvec_packed_kernel(float *dvec, const bf16 *dout, const bf16 *out, AttnParams p) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "a power of two of lanes a row");
    const size_t n_rows = (size_t)p.B * p.H * p.Tq;
    const size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / LANES;  // the row
    const int lane = (int)(threadIdx.x % LANES);
    float sum = 0.0f;
    if (w < n_rows) {  // no early return: every lane of the warp takes part in the shuffles below
        int i = (int)(w % p.Tq), h = (int)((w / p.Tq) % p.H), b = (int)(w / ((size_t)p.Tq * p.H));
        size_t at = q_offset(p, b, i, h) + (size_t)lane * 8;
        const Pack<bf16, 8> d = load_pack<8>(dout + at, 0), o = load_pack<8>(out + at, 0);
#pragma unroll
        for (int e = 0; e < 8; e++) sum += to_f32(d.v[e]) * to_f32(o.v[e]);
    }
#pragma unroll
    for (int step = LANES / 2; step >= 1; step /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, step);
    if (w < n_rows && lane == 0) dvec[w] = sum;  // w = (b H + h) Tq + i: the layout of lse
}

template <typename T>
__global__ void __launch_bounds__(ATTN_THREADS)
flash_backward_dq_kernel(T *dq, const T *dout, const T *q, const T *k, const T *v, const float *lse,
                         const float *dvec, AttnParams p) {
    GPU_DYNAMIC_SMEM(float, smem);
    const AttnSmemLayout L = attn_smem_layout(ATTN_KERNEL_BACKWARD_DQ, p.hd);
    float *Qs = smem + L.q, *dOs = smem + L.dout, *Ks = smem + L.k, *Vs = smem + L.v, *dSs = smem + L.ds;
    int *q_pos_s = reinterpret_cast<int *>(smem + L.q_pos), *k_pos_s = reinterpret_cast<int *>(smem + L.k_pos);
    const int i0 = blockIdx.x * ATTN_BR, h = blockIdx.y, b = blockIdx.z, g = h / p.group;
    const int row = threadIdx.x / TPR, sub = threadIdx.x % TPR, i = i0 + row;
    const bool row_valid = i < p.Tq;

    load_tile(Qs, L.ld, q, b, i0, p.Tq, p.H, h, p.hd);
    load_tile(dOs, L.ld, dout, b, i0, p.Tq, p.H, h, p.hd);
    const int max_q_pos = load_query_positions(q_pos_s, p, i0);
    const float row_lse = row_valid ? lse[stat_offset(p, b, h, i)] : -INFINITY;
    const float row_D = row_valid ? dvec[stat_offset(p, b, h, i)] : 0.0f;
    const bool row_live = row_lse != -INFINITY;  // a row that saw no key has no gradient

    float acc[DIMS_PER_THREAD];  // dQ of the row, dims sub + 4 dd
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) acc[dd] = 0.0f;

    for (int j0 = 0; j0 < p.Tk; j0 += ATTN_BC) {
        if (!load_key_tile(Ks, Vs, k_pos_s, L.ld, k, v, p, b, g, j0, max_q_pos)) continue;

        float s[OTHER_PER_THREAD], dp[OTHER_PER_THREAD];  // S = Q K^T and dP = dO V^T for keys sub + 4 kk
#pragma unroll
        for (int kk = 0; kk < OTHER_PER_THREAD; kk++) s[kk] = dp[kk] = 0.0f;
        const float *q_row = Qs + row * L.ld, *do_row = dOs + row * L.ld;
        for (int d = 0; d < p.hd; d++) {
            float qd = q_row[d], dod = do_row[d];
#pragma unroll
            for (int kk = 0; kk < OTHER_PER_THREAD; kk++) {
                int c = kk * TPR + sub;
                s[kk] += qd * Ks[c * L.ld + d];
                dp[kk] += dod * Vs[c * L.ld + d];
            }
        }
        float *ds_row = dSs + row * L.ld_scores;
#pragma unroll
        for (int kk = 0; kk < OTHER_PER_THREAD; kk++) {
            int c = kk * TPR + sub, j = j0 + c;
            bool visible = row_live && j < p.Tk && attn_pos_visible(p.causal, q_pos_s[row], k_pos_s[c]);
            float prob = visible ? expf(s[kk] * p.scale - row_lse) : 0.0f;
            ds_row[c] = prob * (dp[kk] - row_D) * p.scale;
        }
        __syncwarp();

        for (int c = 0; c < ATTN_BC; c++) {  // dQ += dS K, keys in order
            float ds = ds_row[c];
            const float *k_row = Ks + c * L.ld;
#pragma unroll
            for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
                int d = dd * TPR + sub;
                if (d < p.hd) acc[dd] += ds * k_row[d];
            }
        }
        __syncthreads();
    }

    if (!row_valid) return;
    T *dq_row = dq + q_offset(p, b, i, h);
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
        int d = dd * TPR + sub;
        if (d < p.hd) dq_row[d] = from_f32<T>(to_f32(dq_row[d]) + acc[dd]);
    }
}

template <typename T>
__global__ void __launch_bounds__(ATTN_THREADS)
flash_backward_dkdv_kernel(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v, const float *lse,
                           const float *dvec, AttnParams p) {
    GPU_DYNAMIC_SMEM(float, smem);
    const AttnSmemLayout L = attn_smem_layout(ATTN_KERNEL_BACKWARD_DKDV, p.hd);
    float *Qs = smem + L.q, *dOs = smem + L.dout, *Ks = smem + L.k, *Vs = smem + L.v;
    float *Pt = smem + L.p, *dSt = smem + L.ds, *lse_s = smem + L.lse, *D_s = smem + L.dvec;
    int *q_pos_s = reinterpret_cast<int *>(smem + L.q_pos), *k_pos_s = reinterpret_cast<int *>(smem + L.k_pos);
    const int j0 = blockIdx.x * ATTN_BC, g = blockIdx.y, b = blockIdx.z;
    const int key = threadIdx.x / TPR, sub = threadIdx.x % TPR, j = j0 + key;
    const bool key_valid = j < p.Tk;

    load_tile(Ks, L.ld, k, b, j0, p.Tk, p.KV, g, p.hd);
    load_tile(Vs, L.ld, v, b, j0, p.Tk, p.KV, g, p.hd);
    load_positions(k_pos_s, p.k_pos, j0, p.Tk, INT_MAX);
    __syncthreads();
    const int min_k_pos = min_key_position(k_pos_s);

    float dk_acc[DIMS_PER_THREAD], dv_acc[DIMS_PER_THREAD];  // of this key row, dims sub + 4 dd
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) dk_acc[dd] = dv_acc[dd] = 0.0f;
    const float *k_row = Ks + key * L.ld, *v_row = Vs + key * L.ld;
    float *p_row = Pt + key * L.ld_scores, *ds_row = dSt + key * L.ld_scores;

    for (int h = g * p.group; h < (g + 1) * p.group; h++)
        for (int i0 = 0; i0 < p.Tq; i0 += ATTN_BR) {
            if (!load_query_tile_stats(q_pos_s, lse_s, D_s, p, lse, dvec, b, h, i0, min_k_pos)) continue;
            load_tile(Qs, L.ld, q, b, i0, p.Tq, p.H, h, p.hd);
            load_tile(dOs, L.ld, dout, b, i0, p.Tq, p.H, h, p.hd);
            __syncthreads();

            // S^T and dP^T for this key and the queries r = sub + 4 ii.
            float s[OTHER_PER_THREAD], dp[OTHER_PER_THREAD];
#pragma unroll
            for (int ii = 0; ii < OTHER_PER_THREAD; ii++) s[ii] = dp[ii] = 0.0f;
            for (int d = 0; d < p.hd; d++) {
                float kd = k_row[d], vd = v_row[d];
#pragma unroll
                for (int ii = 0; ii < OTHER_PER_THREAD; ii++) {
                    int r = ii * TPR + sub;
                    s[ii] += kd * Qs[r * L.ld + d];
                    dp[ii] += vd * dOs[r * L.ld + d];
                }
            }
#pragma unroll
            for (int ii = 0; ii < OTHER_PER_THREAD; ii++) {
                int r = ii * TPR + sub;
                bool visible = key_valid && lse_s[r] != -INFINITY &&
                               attn_pos_visible(p.causal, q_pos_s[r], k_pos_s[key]);
                float prob = visible ? expf(s[ii] * p.scale - lse_s[r]) : 0.0f;
                p_row[r] = prob;
                ds_row[r] = prob * (dp[ii] - D_s[r]) * p.scale;
            }
            __syncwarp();

            for (int r = 0; r < ATTN_BR; r++) {  // dV += P^T dO, dK += dS^T Q, queries in order
                float prob = p_row[r], ds = ds_row[r];
                const float *do_row = dOs + r * L.ld, *q_row = Qs + r * L.ld;
#pragma unroll
                for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
                    int d = dd * TPR + sub;
                    if (d < p.hd) {
                        dv_acc[dd] += prob * do_row[d];
                        dk_acc[dd] += ds * q_row[d];
                    }
                }
            }
            __syncthreads();
        }

    if (!key_valid) return;
    size_t at = kv_offset(p, b, j, g);
#pragma unroll
    for (int dd = 0; dd < DIMS_PER_THREAD; dd++) {
        int d = dd * TPR + sub;
        if (d < p.hd) {
            dk[at + d] = from_f32<T>(to_f32(dk[at + d]) + dk_acc[dd]);
            dv[at + d] = from_f32<T>(to_f32(dv[at + d]) + dv_acc[dd]);
        }
    }
}

// ================================ host side ======================================================

// Opts the kernel into the dynamic shared memory it needs (above the default 48 KB).
template <typename Kernel>
static size_t prepare(Kernel kernel, AttnKernel which, int head_dim) {
    size_t bytes = attn_smem_bytes(which, head_dim);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return bytes;
}

template <typename T>
static void launch_attention_forward(T *out, float *lse, const T *q, const T *k, const T *v, const AttnShape *s) {
    AttnParams p = attn_params_of(s);
    if (p.B == 0 || p.Tq == 0) return;
    size_t smem = prepare(flash_forward_kernel<T>, ATTN_KERNEL_FORWARD, p.hd);
    dim3 grid((p.Tq + ATTN_BR - 1) / ATTN_BR, p.H, p.B);
    GPU_LAUNCH(flash_forward_kernel<T>, grid, ATTN_THREADS, smem, out, lse, q, k, v, p);
}

// D = rowsum(dO * O), one warp per row.
template <typename T> static void launch_dvec(float *dvec, const T *dout, const T *out, const AttnParams &p) {
    size_t n_rows = (size_t)p.B * p.H * p.Tq;
    GPU_LAUNCH(attention_dvec_kernel<T>, (unsigned)((n_rows * 32 + 255) / 256), 256, 0, dvec, dout, out, p);
}
// bf16 rows of head_dim 32, 64 or 128 with 16-byte aligned tensors: hd / 8 lanes a row, each reading
// one 16-byte pack of dO and of O (attention_dvec_packed_kernel). One lane read 4 bytes of each at a
// time before (a warp per row at head_dim 64: 0.31 ms a llama3_1b layer at 16 x 2048 on an H200,
// about 5x the time its 268 MB take at the device's bandwidth).
template <int LANES> static void launch_dvec_packed(float *dvec, const bf16 *dout, const bf16 *out, const AttnParams &p) {
    size_t n_rows = (size_t)p.B * p.H * p.Tq;
    GPU_LAUNCH(attention_dvec_packed_kernel<LANES>, (unsigned)((n_rows * LANES + 255) / 256), 256, 0, dvec, dout, out, p);
}
void attention_dvec_bf16(float *dvec, const bf16 *dout, const bf16 *out, const AttnParams &p) {
    if (p.B == 0 || p.H == 0 || p.Tq == 0) return;
    const bool packed = (uintptr_t)dout % 16 == 0 && (uintptr_t)out % 16 == 0;
    if (packed && p.hd == 64) launch_dvec_packed<8>(dvec, dout, out, p);
    else if (packed && p.hd == 128) launch_dvec_packed<16>(dvec, dout, out, p);
    else if (packed && p.hd == 32) launch_dvec_packed<4>(dvec, dout, out, p);
    else launch_dvec(dvec, dout, out, p);
}

template <typename T>
static void launch_attention_backward(T *dq, T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v,
                                      const T *out, const float *lse, const AttnShape *s) {
    AttnParams p = attn_params_of(s);
    if (p.B == 0 || p.Tq == 0 || p.Tk == 0) return;
    float *dvec = (float *)gpu_scratch_alloc((size_t)p.B * p.H * p.Tq * sizeof(float));
    if constexpr (std::is_same<T, bf16>::value) attention_dvec_bf16(dvec, dout, out, p);  // the tensor cores' D
    else launch_dvec(dvec, dout, out, p);
    size_t smem = prepare(flash_backward_dq_kernel<T>, ATTN_KERNEL_BACKWARD_DQ, p.hd);
    dim3 grid_q((p.Tq + ATTN_BR - 1) / ATTN_BR, p.H, p.B);
    GPU_LAUNCH(flash_backward_dq_kernel<T>, grid_q, ATTN_THREADS, smem, dq, dout, q, k, v, lse, dvec, p);
    smem = prepare(flash_backward_dkdv_kernel<T>, ATTN_KERNEL_BACKWARD_DKDV, p.hd);
    dim3 grid_kv((p.Tk + ATTN_BC - 1) / ATTN_BC, p.KV, p.B);
    GPU_LAUNCH(flash_backward_dkdv_kernel<T>, grid_kv, ATTN_THREADS, smem, dk, dv, dout, q, k, v, lse, dvec, p);
    gpu_scratch_free(dvec);
}

extern "C" void gpu_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                                      const AttnShape *s) {
    launch_attention_forward(out, lse, q, k, v, s);
}
extern "C" void gpu_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                       const float *k, const float *v, const float *out, const float *lse,
                                       const AttnShape *s) {
    launch_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, s);
}
extern "C" void gpu_attention_forward_bf16_simt(gpu_bf16 *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k,
                                                const gpu_bf16 *v, const AttnShape *s) {
    launch_attention_forward(out, lse, q, k, v, s);
}
extern "C" void gpu_attention_backward_bf16_simt(gpu_bf16 *dq, gpu_bf16 *dk, gpu_bf16 *dv, const gpu_bf16 *dout,
                                                 const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v,
                                                 const gpu_bf16 *out, const float *lse, const AttnShape *s) {
    launch_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, s);
}

// ---- ring attention's merge (chapter 8 on device buffers, gpu/cp_device.c) -------------------------------
// One thread per (head, query row) of the block: the row's two weights from numerics.h's lse_merge,
// then its hd outputs. Rows are independent, so any grid gives the same bits.
__global__ void attention_merge_kernel(float *out, float *lse, const float *out_b, const float *lse_b, int q0, int nq,
                                       int Tl, int H, int hd) {
    GRID_STRIDE_LOOP(row, (size_t)H * nq) {  // row = h * nq + i: lse_b's layout
        int h = (int)(row / nq), i = (int)(row % nq);
        float *l = lse + (size_t)h * Tl + q0 + i;
        LseMerge w = lse_merge(*l, lse_b[row]);
        float *o = out + ((size_t)(q0 + i) * H + h) * hd;
        const float *o_b = out_b + ((size_t)i * H + h) * hd;
        for (int d = 0; d < hd; d++) o[d] = o[d] * w.a + o_b[d] * w.b;
        *l = w.merged;
    }
}

extern "C" void gpu_attention_merge(float *out, float *lse, const float *out_b, const float *lse_b, int q0, int nq,
                                    int Tl, int H, int hd) {
    LAUNCH_1D(attention_merge_kernel, (size_t)H * nq, out, lse, out_b, lse_b, q0, nq, Tl, H, hd);
}
