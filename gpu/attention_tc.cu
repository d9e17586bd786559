// attention_tc.cu: FlashAttention-2 (Dao, 2023) for bf16 tensors on the tensor cores: attention.cu's
// algorithm and tiling -- the same 64-row tiles, online softmax, lse kept, P recomputed in backward,
// a dQ kernel and a dK/dV kernel, causal tiles skipped by a block vote -- with every tile product
// done by mma.sync.m16n8k16 (gpu/mma.cuh): bf16 operands, fp32 accumulators.
//
// Shapes as attention.cu: q, out, dq (B,Tq,H,hd); k, v, dk, dv (B,Tk,KV,hd); lse, D (B,H,Tq), fp32.
// head_dim a multiple of 16 (the k of the instruction), at most 128; tensors 16-byte aligned.
//
// Tiling. A block holds a 64-row tile (queries in forward and dQ, keys in dK/dV) and streams the
// other side's 64-row tiles through shared memory, as bf16 with padded rows (launch.h's
// attn_tc_smem_layout). 4 warps; warp w owns rows 16w .. 16w+15 of the block's tile. For each tile
// of the other side a warp computes its 16 x 64 block of scores with mma -- 8 accumulator tiles of
// 16x8, each summed over head_dim/16 k-steps -- and keeps it in registers: lane (g, t) holds rows g
// and g+8, columns 2t and 2t+1 of each 16x8 tile, so the 4 lanes of a group own two rows together
// and combine their maxima and sums with two butterfly shuffles. The second product multiplies that
// 16 x 64 block (rounded to bf16, as FlashAttention-2 does: the accumulators of two adjacent 16x8
// tiles are already the A fragment of a 16x16 block) by the other tile's 64 x head_dim values into
// head_dim/8 accumulator tiles of 16x8, also in registers: 16 x head_dim per warp.
// Each kernel can also hold a 128-row tile of its own side, 32 rows a warp as two such fragments
// (gpu_attention_set_tile_rows, LLAMA_ATTN_TILE_ROWS=128; the backward kernels' at head_dim <= 64):
// FlashAttention-2's forward tiling, in which each fragment of the other side a warp loads from shared
// memory serves two mma instead of one. The dK/dV kernel's 128 keys take each 64-row query tile in two
// passes of 32 rows, so that its scores stay at 32 registers a lane. The dK/dV kernel holds 128 keys by
// default (where head_dim <= 64), the forward and dQ kernels 64 queries: the fastest mix on an H200.
//
// The grids below are those of the 64-row tiles; with 128 rows the first dimension halves.
//   forward   grid (Tq/64, H, B)   per key tile: S = Q K^T; mask, scale; online softmax per row
//             (m, l in fp32, from the fp32 scores); O = O * correction + bf16(P) V.
//             Writes O / l (bf16) and lse = m + log l (fp32).
//   backward  D = rowsum(dO * O) (attention.cu's kernel), then
//     dQ      grid (Tq/64, H, B)   per key tile: S = Q K^T, dP = dO V^T, P = exp(S scale - lse),
//             dS = P (dP - D) scale, dQ += bf16(dS) K.
//     dK, dV  grid (Tk/64, KV, B)  per query head of the group, per query tile: S^T = K Q^T and
//             dP^T = V dO^T (a row per key), P^T, dS^T; dV += bf16(P^T) dO, dK += bf16(dS^T) Q.
// Masking: a tile wholly visible (in range, and causal with every key at or before every query) skips
// the per-element mask; the barrier after its loads votes on that (__syncthreads_and).
// Each gradient element is summed by one lane of one warp over the tiles in a fixed order (heads,
// then query tiles, then the instruction's own order inside a tile): two runs are bit-identical.
//
// Differences from attention.cu's arithmetic, all FlashAttention-2's: the operands of the second
// products (P, dS) are rounded to bf16; the sums inside a 16-wide k-step are the tensor core's; the
// probabilities' exp is ex2.approx of one fma (numerics.h's exp2_weight), a few ulp off expf.
// Every fragment is loaded from shared memory by ldmatrix (gpu/mma.cuh): four 8x8 blocks per instruction.
// The kernels store their results as bf16 (the model's tensors) or, instantiated for float, as fp32
// (context parallelism's ring, gpu/cp_device.c, which merges and sums its blocks in fp32).
#include "gpu/attention.cuh"
#include "gpu/mma.cuh"

#include <type_traits>

constexpr int SCORE_TILES = ATTN_BC / 8;  // 16x8 accumulator tiles across a warp's 16 x 64 scores
static_assert(ATTN_BR == ATTN_BC && ATTN_TC_ROWS_PER_WARP == 16, "a warp's rows are one m16 fragment");

// 16 bytes: the unit in which tiles move from global to shared memory.
struct alignas(16) Chunk16 {
    uint32_t w[4];
};
// A row past the sequence's end: its chunk of the tile set to zeros at once (no copy).
__device__ __forceinline__ void zero_chunk(bf16 *to) { *reinterpret_cast<Chunk16 *>(to) = Chunk16{{0u, 0u, 0u, 0u}}; }

// The tiles of one side, rows [r0, r0 + ROWS) of head `head` of a (B, T_len, n_heads, hd) bf16 tensor,
// into a shared tile with row stride ld elements, queued 16 bytes at a time by cp.async (gpu/mma.cuh);
// rows past T_len are zeros, stored at once. The caller commits the group, and waits for it before a
// barrier. A kernel makes one TileSource per tensor, for its sequence b, before its loop over tiles.
//
// Where head_dim fills the accumulators (EXACT_HD: 64 or 128, the models' widths) thread t copies chunk
// t % CHUNKS of rows t / CHUNKS, + STEP, + 2 STEP, ... of every tile. Its source pointer and the 64-bit
// row step are worked out once, in the constructor, so that queuing a tile inside the sequence is a
// pointer step and, per chunk, a 64-bit add and the copy, with no row test; only a tile that reaches
// past T_len tests its rows. (Computed per tile from (b, row, head) with every row tested, the copies
// took about 150 of the 580 instructions a visible forward tile issued per thread at head_dim 64, by a
// count of the SASS, against about 40 now.)
// Other head dims take the general loop, its index arithmetic per chunk.
template <int HD_MAX, bool EXACT_HD, int ROWS = ATTN_BR> struct TileSource;

template <int HD, int ROWS> struct TileSource<HD, true, ROWS> {
    static constexpr int CHUNKS = HD / 8, STEP = ATTN_TC_THREADS / CHUNKS;  // 16-byte chunks a row; rows at once
    static_assert(ATTN_TC_THREADS % CHUNKS == 0 && ROWS % STEP == 0, "whole rows per step");
    const bf16 *from;  // this thread's chunk of its first row in sequence b, head 0
    size_t row_elems;  // n_heads hd: from one row to the next
    int T_len;
    __device__ TileSource(const bf16 *src, int b, int T_len_, int n_heads, int /*hd*/) : T_len(T_len_) {
        row_elems = (size_t)n_heads * HD;
        from = src + ((size_t)b * T_len + threadIdx.x / CHUNKS) * row_elems + (threadIdx.x % CHUNKS) * 8;
    }
    __device__ __forceinline__ void copy(bf16 *dst, int ld, int r0, int head) const {
        const int r = threadIdx.x / CHUNKS;
        const bf16 *src = from + (size_t)r0 * row_elems + head * HD;
        const size_t step = (size_t)STEP * row_elems;
        bf16 *to = dst + r * ld + (threadIdx.x % CHUNKS) * 8;
        if (r0 + ROWS <= T_len) {  // every tile but a last, partial one
#pragma unroll
            for (int k = 0; k < ROWS / STEP; k++, src += step) cp_async16(to + k * STEP * ld, src);
            return;
        }
#pragma unroll
        for (int k = 0; k < ROWS / STEP; k++, src += step) {
            if (r0 + r + k * STEP < T_len) cp_async16(to + k * STEP * ld, src);
            else zero_chunk(to + k * STEP * ld);
        }
    }
};

template <int HD_MAX, int ROWS> struct TileSource<HD_MAX, false, ROWS> {
    const bf16 *src;
    int b, T_len, n_heads, hd;
    __device__ TileSource(const bf16 *src_, int b_, int T_len_, int n_heads_, int hd_)
        : src(src_), b(b_), T_len(T_len_), n_heads(n_heads_), hd(hd_) {}
    __device__ __forceinline__ void copy(bf16 *dst, int ld, int r0, int head) const {
        const int chunks = hd / 8, step_rows = blockDim.x / chunks, step_chunks = blockDim.x % chunks;
        int r = threadIdx.x / chunks, c = threadIdx.x % chunks;  // of element e = r chunks + c, stepping by blockDim
        for (int e = threadIdx.x; e < ROWS * chunks; e += blockDim.x) {
            bf16 *to = dst + r * ld + c * 8;
            int t = r0 + r;
            if (t < T_len) cp_async16(to, src + (((size_t)b * T_len + t) * n_heads + head) * hd + c * 8);
            else zero_chunk(to);
            r += step_rows, c += step_chunks;
            if (c >= chunks) c -= chunks, r++;
        }
    }
};

// ---- the streamed side's two stages ------------------------------------------------------------------
// A kernel computes on one stage of the other side's tiles while the next tile is copied into the
// other stage (launch.h's attn_tc_smem_layout). Each step: prefetch tile n + 1 (its positions, a vote
// on whether it can be skipped, its copies queued and committed: one group per step, empty when
// skipped), wait for tile n's group, a barrier, compute on tile n, a barrier (before its stage is
// refilled, two tiles on).
#define SMEM_AT(type, offset) reinterpret_cast<type *>(reinterpret_cast<unsigned char *>(smem) + (offset))

// Row r's position in a streamed tile from r0: read from the stage where positions are given
// (`given`: ring attention's chunks), else r0 + r, and `outside` past T_len, as load_positions writes
// them. With the positions 0..T-1 a stage holds none: its tile's need and visibility are comparisons
// with its first and last row, and its masks compute the positions.
__device__ __forceinline__ int tile_position(const int *pos_s, bool given, int r0, int r, int T_len, int outside) {
    return given ? pos_s[r] : row_position(nullptr, r0 + r, T_len, outside);
}

struct KeyStage {  // the forward and dQ kernels' key tile
    bf16 *K, *V;
    int *pos;
};
__device__ KeyStage key_stage(Chunk16 *smem, const AttnTcSmemLayout &L, int stage) {
    const int at = stage * L.stage_bytes;
    return KeyStage{SMEM_AT(bf16, L.k + at), SMEM_AT(bf16, L.v + at), SMEM_AT(int, L.k_pos + at)};
}
// The key tile at j0 into stage st: its positions (where given), then, unless no query of the block
// (positions up to max_q_pos) can see any of its keys, its K and V queued; the group committed. Returns
// whether the tile is needed, the same on every thread. With positions given (ring attention's chunks) thread
// t < 64 writes position t and the block votes on them (the vote needs no barrier before it); with the
// positions 0..Tk-1 the tile's first key j0 is its earliest, so the test needs no vote and no barrier
// (one barrier a tile fewer). Past the last tile (j0 >= Tk) an empty group, so that the wait for the
// last tile leaves exactly one group in flight as for every other.
template <typename Src>
__device__ __forceinline__ bool prefetch_key_tile(const KeyStage &st, int ld, const Src &k, const Src &v,
                                                  const AttnParams &p, int g, int j0, int max_q_pos) {
    if (j0 >= p.Tk) {
        cp_async_commit();
        return false;
    }
    if (p.k_pos) load_positions(st.pos, p.k_pos, j0, p.Tk, INT_MAX);
    const bool needed =
        !p.causal || (p.k_pos ? __syncthreads_or(threadIdx.x < ATTN_BC && st.pos[threadIdx.x] <= max_q_pos)
                              : j0 <= max_q_pos);
    if (needed) {
        k.copy(st.K, ld, j0, g);
        v.copy(st.V, ld, j0, g);
    }
    cp_async_commit();
    return needed;
}
// Waits for every group but the newest (the next tile's), then the barrier after which the copies of
// every thread are visible, which also votes: true when the whole q_rows x 64 tile (queries from i0,
// positions from min_q_pos; keys from j0) is visible -- every query and key in range and, causal,
// every key at or before every query -- so the kernel can skip the per-element mask: FlashAttention-2
// masks only the tiles that cross the diagonal.
__device__ bool wait_key_tile(const KeyStage &st, const AttnParams &p, int i0, int j0, int min_q_pos,
                              int q_rows = ATTN_BR) {
    cp_async_wait<1>();
    if (!p.k_pos) {  // keys j0.. in order: the last, j0 + 63, is the latest
        __syncthreads();
        return tile_in_range(p, i0, j0, q_rows) && attn_pos_visible(p.causal, min_q_pos, j0 + ATTN_BC - 1);
    }
    return __syncthreads_and(tile_in_range(p, i0, j0, q_rows) &&
                             (threadIdx.x >= ATTN_BC || attn_pos_visible(p.causal, min_q_pos, st.pos[threadIdx.x])));
}

struct QueryStage {  // the dK/dV kernel's query tile
    bf16 *Q, *dO;
    int *pos;
    float *lse, *D;  // per query row: lse and D as read, then lse log2(e) (+inf: the row saw no key) and
                     // D scale (convert_query_row_stats)
};
__device__ QueryStage query_stage(Chunk16 *smem, const AttnTcSmemLayout &L, int stage) {
    const int at = stage * L.stage_bytes;
    return QueryStage{SMEM_AT(bf16, L.q + at), SMEM_AT(bf16, L.dout + at), SMEM_AT(int, L.q_pos + at),
                      SMEM_AT(float, L.lse + at), SMEM_AT(float, L.dvec + at)};
}
// Step n of the dK/dV kernel's walk over its group's query tiles (head g group + n / tiles, tile
// n % tiles) into stage st: the rows' positions (where given), their lse and D queued by cp.async
// (thread t < 64, row t; -inf and 0 stored past Tq), then, unless causal and no query of it reaches the
// block's first key (min_k_pos), its Q and dO queued; the group committed (empty past the last step, as
// prefetch_key_tile). Returns whether the tile is needed, on every thread. The kernel converts lse
// and D in place after its wait (convert_query_row_stats). (Loaded into registers and stored here, each
// step's prefetch stalled the block's first two warps, and at the next barrier all four, for a round
// trip to memory.)
template <typename Src>
__device__ __forceinline__ bool prefetch_query_tile(const QueryStage &st, int ld, const Src &q, const Src &dout,
                                                    const float *lse, const float *dvec, const AttnParams &p, int b,
                                                    int g, int n, int tiles, int min_k_pos) {
    if (n >= p.group * tiles) {
        cp_async_commit();
        return false;
    }
    const int h = g * p.group + n / tiles, i0 = (n % tiles) * ATTN_BR;
    if (p.q_pos) load_positions(st.pos, p.q_pos, i0, p.Tq, INT_MIN);
    if (threadIdx.x < ATTN_BR) {
        const int i = i0 + (int)threadIdx.x;
        if (i < p.Tq) {
            cp_async4(&st.lse[threadIdx.x], &lse[stat_offset(p, b, h, i)]);
            cp_async4(&st.D[threadIdx.x], &dvec[stat_offset(p, b, h, i)]);
        } else {
            st.lse[threadIdx.x] = -INFINITY, st.D[threadIdx.x] = 0.0f;
        }
    }
    // positions i0.. in order (q_pos NULL): the tile's last row in range is its latest, no vote needed
    const bool needed =
        !p.causal || (p.q_pos ? __syncthreads_or(threadIdx.x < ATTN_BR && st.pos[threadIdx.x] >= min_k_pos)
                              : min(i0 + ATTN_BR, p.Tq) - 1 >= min_k_pos);
    if (needed) {
        q.copy(st.Q, ld, i0, h);
        dout.copy(st.dO, ld, i0, h);
    }
    cp_async_commit();
    return needed;
}

// After the step's wait, before its barrier: row threadIdx.x's lse and D (the thread's own copies, which
// its wait made visible to it) into the units the kernel's fmas take: lse times log2(e), +inf for a row
// that saw no key (lse -inf; past Tq among them): every probability of it is then 2^(s - inf) = 0,
// masked (s = -inf) or not, with no test of its own; D times the scale.
__device__ __forceinline__ void convert_query_row_stats(const QueryStage &st, const AttnParams &p) {
    if (threadIdx.x < ATTN_BR) {
        const float l = st.lse[threadIdx.x];
        st.lse[threadIdx.x] = l == -INFINITY ? INFINITY : l * LOG2E_F;
        st.D[threadIdx.x] *= p.scale;
    }
}

// Max or sum over the 4 lanes of a group (the lanes sharing accumulator rows); all get the same bits.
__device__ __forceinline__ float group_max(float x) {
    for (int o = 1; o < 4; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float group_sum(float x) {
    for (int o = 1; o < 4; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---- the two tile products of a warp --------------------------------------------------------------
// A warp owns MT fragments of 16 rows of its block's own tile (MT = 1: a 64-row tile; MT = 2: the
// 128-row tiles, gpu_attention_set_tile_rows). Each B fragment pair read from the other tile serves
// all MT fragments, so with MT = 2 a warp reads the other tile from shared memory half as often per
// product. NT: the 16x8 score tiles across the other side's rows, 8 NT of them (SCORE_TILES, 64 rows;
// the 128-key dK/dV kernel takes a query tile in two passes of 32 rows, NT = 4).
//
// scores (16 MT x 8 NT) = mine[row0 .. row0 + 16 MT) other[0 .. 8 NT)^T: the warp's rows of its own
// tile against the other's rows, both (rows, hd) row-major; scores[m][n] holds rows row0 + 16m ..
// row0 + 16m + 15 against the other's rows 8n .. 8n+7. Each accumulator sums its k-steps in the same
// order whatever MT and NT are, so a score does not depend on them.
template <int HD_MAX, int MT, int NT>
__device__ __forceinline__ void warp_scores(float (&scores)[MT][NT][4], const bf16 *mine, const bf16 *other, int ld,
                                            int row0, int hd) {
    static_assert(NT % 2 == 0, "B fragments come in pairs");
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
            for (int e = 0; e < 4; e++) scores[m][n][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD_MAX / 16; ks++) {
        if (ks * 16 >= hd) break;
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) load_frag_a(a[m], mine, ld, row0 + 16 * m, ks * 16);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t bf[2][2];
            load_frag_b2_from_rows_n(bf, other, ld, n * 8, ks * 16);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                mma_bf16_m16n8k16(scores[m][n], a[m], bf[0]);
                mma_bf16_m16n8k16(scores[m][n + 1], a[m], bf[1]);
            }
        }
    }
}
// acc (16 MT x hd) += bf16(weights) (16 MT x 8 NT) other (8 NT x hd, row-major): the second product,
// summed over the 8 NT rows of `other` in NT / 2 k-steps of 16, in row order; acc[m][n] holds
// dimensions 8n .. 8n+7 of the warp's fragment m. Two calls on rows [0, 32) and [32, 64) add in the
// same order as one call on [0, 64).
template <int HD_MAX, int MT, int NT>
__device__ __forceinline__ void warp_accumulate(float (&acc)[MT][HD_MAX / 8][4], const float (&weights)[MT][NT][4],
                                                const bf16 *other, int ld, int hd) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) frag_a_from_accumulators(a[m], weights[m][2 * kk], weights[m][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < HD_MAX / 8; n += 2) {
            if (n * 8 >= hd) break;  // hd a multiple of 16: the pair is whole
            uint32_t bf[2][2];
            load_frag_b2_from_rows_k(bf, other, ld, kk * 16, n * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                mma_bf16_m16n8k16(acc[m][n], a[m], bf[0]);
                mma_bf16_m16n8k16(acc[m][n + 1], a[m], bf[1]);
            }
        }
    }
}
template <int N> __device__ __forceinline__ void zero(float acc[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
}
// f(m, n, e) for each score a lane holds: fragment m of its rows, 16x8 tile n, accumulator element e
// (row acc_row(e) of the fragment, column 8n + acc_col(e)); unrolled, so every index is a constant.
template <int MT, int NT, typename F> __device__ __forceinline__ void for_each_score(F &&f) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(m, n, e);
}
// row[d] += acc (or = acc, with `set`) for the lane's columns d = 8n + 2t, 8n + 2t + 1 of
// accumulator row `half` (0: row g, 1: row g + 8), each rounded to T (bf16, or fp32: exact) once.
template <int HD_MAX, typename T>
__device__ __forceinline__ void store_row(T *row, const float acc[HD_MAX / 8][4], int half, int hd, bool set) {
#pragma unroll
    for (int n = 0; n < HD_MAX / 8; n++) {
        if (n * 8 >= hd) break;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (e / 2 != half) continue;
            int d = n * 8 + acc_col(e);
            row[d] = from_f32<T>(set ? acc[n][e] : to_f32(row[d]) + acc[n][e]);
        }
    }
}

// The kernels' head_dim: HD_MAX itself where head_dim fills the accumulators (EXACT_HD: the models'
// 64 and 128), a constant, so that the products' k-step loops and the tile copies unroll with no test
// of it; else p.hd, up to HD_MAX (test_gpu_ops' head_dim 16 and 32 cases). Read from p, each k-step
// was a branch (ncu: 0.8 branches per HMMA in the forward) that kept the compiler from loading the
// next fragments early; as a constant, on an H200 at 16 x 2048, the forward went 2.00 -> 1.63 ms and
// the backward 5.68 -> 4.74.
template <int HD_MAX, bool EXACT_HD> __device__ __forceinline__ int head_dim_of(const AttnParams &p) {
    return EXACT_HD ? HD_MAX : p.hd;
}

// ================================ forward ========================================================

// The query tile of this block in the forward and dQ kernels. Causal, the last query tiles see the
// most keys: blockIdx.x 0 takes the last tile, so that the blocks launched last (the grid goes through
// blockIdx.x first) are the shortest and the multiprocessors run out of work together. Any order gives
// the same bits: a block's arithmetic does not depend on when it runs.
__device__ __forceinline__ int query_tile_of_block(const AttnParams &p) {
    return p.causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
}

// MT m16 fragments of query rows per warp: MT = 1, a 64-row query tile (warp w: rows 16w .. 16w+15);
// MT = 2, a 128-row one (warp w: rows 32w .. 32w+31), FlashAttention-2's forward tiling, in which a
// warp's B fragments of K and V serve two fragments of rows. Key tiles are 64 rows either way, and
// a row's arithmetic is the same: the two give the same bits (test_gpu_ops checks it).
template <int HD_MAX, bool EXACT_HD, typename OutT, int MT>
__global__ void __launch_bounds__(ATTN_TC_THREADS)
flash_forward_tc_kernel(OutT *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, AttnParams p) {
    constexpr int BR = ATTN_TC_WARPS * 16 * MT;  // the block's query rows
    const int hd = head_dim_of<HD_MAX, EXACT_HD>(p);
    GPU_DYNAMIC_SMEM(Chunk16, smem);
    const AttnTcSmemLayout L = attn_tc_smem_layout_rows(ATTN_KERNEL_FORWARD, hd, BR);
    bf16 *Qs = SMEM_AT(bf16, L.q);
    int *q_pos_s = SMEM_AT(int, L.q_pos);
    const int i0 = query_tile_of_block(p) * BR, h = blockIdx.y, b = blockIdx.z, g = h / p.group;
    const int row0 = (int)(threadIdx.x / 32) * 16 * MT;  // the warp's first row of the tile

    TileSource<HD_MAX, EXACT_HD, BR>(q, b, p.Tq, p.H, hd).copy(Qs, L.ld, i0, h);
    cp_async_commit();  // Q: waited for with the first key tile
    const TileSource<HD_MAX, EXACT_HD> k_src(k, b, p.Tk, p.KV, hd), v_src(v, b, p.Tk, p.KV, hd);
    int min_q_pos;
    const int max_q_pos = load_query_positions(q_pos_s, p, i0, &min_q_pos, BR);

    OnlineSoftmax st[MT][2];  // of the lane's rows g, g + 8 of each fragment
    float o[MT][HD_MAX / 8][4];  // unnormalised output: sum over keys of exp(s - m) v
#pragma unroll
    for (int m = 0; m < MT; m++) {
        st[m][0] = st[m][1] = OnlineSoftmax{-INFINITY, 0.0f};
        zero<HD_MAX / 8>(o[m]);
    }

    bool next_needed = prefetch_key_tile(key_stage(smem, L, 0), L.ld, k_src, v_src, p, g, 0, max_q_pos);
    for (int j0 = 0, stage = 0; j0 < p.Tk; j0 += ATTN_BC, stage ^= 1) {
        const bool needed = next_needed;
        next_needed =
            prefetch_key_tile(key_stage(smem, L, stage ^ 1), L.ld, k_src, v_src, p, g, j0 + ATTN_BC, max_q_pos);
        const KeyStage kt = key_stage(smem, L, stage);
        const bool full = wait_key_tile(kt, p, i0, j0, min_q_pos, BR);
        if (!needed) continue;
        const bf16 *Ks = kt.K, *Vs = kt.V;
        const int *k_pos_s = kt.pos;

        float s[MT][SCORE_TILES][4];  // S = Q K^T (unscaled), then P: the warp's rows x the tile's 64 keys
        warp_scores<HD_MAX, MT, SCORE_TILES>(s, Qs, Ks, L.ld, row0, hd);
        // The largest score of each of the lane's rows, masked scores set to -inf first where the tile
        // is not wholly visible (a block-wide branch: the full tiles' loop has no per-element test).
        // The scale is positive and rounding monotonic, so max(s) scale is exactly max(s scale).
        if (!full) {
            for_each_score<MT, SCORE_TILES>([&](int m, int n, int e) {
                int r = row0 + 16 * m + acc_row(e), c = n * 8 + acc_col(e);
                if (!(i0 + r < p.Tq && j0 + c < p.Tk &&
                      attn_pos_visible(p.causal, q_pos_s[r], tile_position(k_pos_s, p.k_pos, j0, c, p.Tk, INT_MAX))))
                    s[m][n][e] = -INFINITY;
            });
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < SCORE_TILES; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[m][n][e]);
            float correction[2], weight_sum[2] = {0.0f, 0.0f};
            Exp2Arg arg[2];  // exp(s scale - m) as one fma and one ex2 per score (numerics.h)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                correction[half] = online_softmax_rescale_exp2(&st[m][half], group_max(tile_max[half]) * p.scale);
                arg[half] = exp2_arg(p.scale, st[m][half].m);
            }
#pragma unroll
            for (int n = 0; n < SCORE_TILES; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[m][n][e] = exp2_weight(arg[e / 2], s[m][n][e]);  // a masked score: 2^-inf = 0
                    weight_sum[e / 2] += s[m][n][e];
                }
#pragma unroll
            for (int half = 0; half < 2; half++) online_softmax_add(&st[m][half], group_sum(weight_sum[half]));
#pragma unroll
            for (int n = 0; n < HD_MAX / 8; n++)  // O = O * correction, before + bf16(P) V below
#pragma unroll
                for (int e = 0; e < 4; e++) o[m][n][e] *= correction[e / 2];
        }
        warp_accumulate<HD_MAX, MT, SCORE_TILES>(o, s, Vs, L.ld, hd);  // O += bf16(P) V
        __syncthreads();  // before this stage is refilled with the tile after next
    }
    cp_async_wait<0>();  // no copy outlives the kernel (with Tk = 0 the loop never waited for Q)

#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int n = 0; n < HD_MAX / 8; n++)
            for (int e = 0; e < 4; e++) o[m][n][e] = online_softmax_output(&st[m][e / 2], o[m][n][e]);  // O / l, or 0
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int i = i0 + row0 + 16 * m + lane_group() + 8 * half;
            if (i >= p.Tq) continue;
            store_row<HD_MAX, OutT>(out + q_offset(p, b, i, h), o[m], half, hd, true);
            if (lane_in_group() == 0) lse[stat_offset(p, b, h, i)] = online_softmax_lse(&st[m][half]);
        }
    }
}

// ================================ backward =======================================================
// Blocks per SM that a backward kernel asks the compiler to fit in registers (__launch_bounds__'
// second argument): `blocks` (dQ 4, dK/dV 3) where head_dim is at most 64; 0 (no request) for the
// 128-wide accumulators, which would spill. On an H100 at llama3_1b's shapes (8 x 2048, 32 heads,
// 8 KV heads, head_dim 64): dQ then uses 128 registers, not 152, and 4 blocks fit an SM instead of
// 3 (ncu: 1.75 -> 1.48 ms); dK/dV keeps its 168 registers and 3 blocks (without a request the compiler chose 168 too, and
// with a request of 1 it took 186, leaving room for 2). The whole backward went 4.56 -> 4.30 ms.
// The 128-row variants (MT = 2) ask for nothing: twice the accumulators. With head_dim a constant
// (EXACT_HD) the compiler keeps more loads in flight: at head_dim 64 dQ takes 128 registers, dK/dV
// 168, and the 128-key dK/dV 255 with 58 bytes spilled (66 when measured) -- and yet the backward took 4.74 ms on an
// H200 at 16 x 2048, against 5.33 with only dK/dV's head_dim read from p (242 registers, no spill).
constexpr int min_blocks_hd64(int hd_max, int mt, int blocks) { return hd_max <= 64 && mt == 1 ? blocks : 0; }

// MT m16 fragments of query rows per warp, as the forward kernel: a 64- or a 128-row query tile.
// A row's arithmetic is the same either way (the same bits).
template <int HD_MAX, bool EXACT_HD, typename GradT, int MT>
__global__ void __launch_bounds__(ATTN_TC_THREADS, min_blocks_hd64(HD_MAX, MT, 4))
flash_backward_dq_tc_kernel(GradT *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                            const float *lse, const float *dvec, AttnParams p) {
    constexpr int BR = ATTN_TC_WARPS * 16 * MT;  // the block's query rows
    const int hd = head_dim_of<HD_MAX, EXACT_HD>(p);
    GPU_DYNAMIC_SMEM(Chunk16, smem);
    const AttnTcSmemLayout L = attn_tc_smem_layout_rows(ATTN_KERNEL_BACKWARD_DQ, hd, BR);
    bf16 *Qs = SMEM_AT(bf16, L.q), *dOs = SMEM_AT(bf16, L.dout);
    int *q_pos_s = SMEM_AT(int, L.q_pos);
    const int i0 = query_tile_of_block(p) * BR, h = blockIdx.y, b = blockIdx.z, g = h / p.group;
    const int row0 = (int)(threadIdx.x / 32) * 16 * MT;

    TileSource<HD_MAX, EXACT_HD, BR>(q, b, p.Tq, p.H, hd).copy(Qs, L.ld, i0, h);
    TileSource<HD_MAX, EXACT_HD, BR>(dout, b, p.Tq, p.H, hd).copy(dOs, L.ld, i0, h);
    cp_async_commit();  // Q and dO: waited for with the first key tile
    const TileSource<HD_MAX, EXACT_HD> k_src(k, b, p.Tk, p.KV, hd), v_src(v, b, p.Tk, p.KV, hd);
    int min_q_pos;
    const int max_q_pos = load_query_positions(q_pos_s, p, i0, &min_q_pos, BR);
    // Of the lane's rows g, g + 8 of each fragment (lse -inf: no gradient, past Tq or saw no key):
    // lse, D scale (as dS's fma takes it), and exp(s scale - lse) as one fma and one ex2 (numerics.h);
    // a row with lse -inf has every score masked, so its probabilities are 2^-inf = 0.
    float row_lse[MT][2], row_D[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
        for (int half = 0; half < 2; half++) {
            int i = i0 + row0 + 16 * m + lane_group() + 8 * half;
            row_lse[m][half] = i < p.Tq ? lse[stat_offset(p, b, h, i)] : -INFINITY;
            row_D[m][half] = i < p.Tq ? dvec[stat_offset(p, b, h, i)] * p.scale : 0.0f;
        }
    float acc[MT][HD_MAX / 8][4];  // dQ of the warp's rows
#pragma unroll
    for (int m = 0; m < MT; m++) zero<HD_MAX / 8>(acc[m]);

    bool next_needed = prefetch_key_tile(key_stage(smem, L, 0), L.ld, k_src, v_src, p, g, 0, max_q_pos);
    for (int j0 = 0, stage = 0; j0 < p.Tk; j0 += ATTN_BC, stage ^= 1) {
        const bool needed = next_needed;
        next_needed =
            prefetch_key_tile(key_stage(smem, L, stage ^ 1), L.ld, k_src, v_src, p, g, j0 + ATTN_BC, max_q_pos);
        const KeyStage kt = key_stage(smem, L, stage);
        // full: then every row saw a key of this tile, so its lse is finite
        const bool full = wait_key_tile(kt, p, i0, j0, min_q_pos, BR);
        if (!needed) continue;
        const bf16 *Ks = kt.K, *Vs = kt.V;
        const int *k_pos_s = kt.pos;

        float s[MT][SCORE_TILES][4], dp[MT][SCORE_TILES][4];  // S = Q K^T (then dS) and dP = dO V^T
        warp_scores<HD_MAX, MT, SCORE_TILES>(s, Qs, Ks, L.ld, row0, hd);
        warp_scores<HD_MAX, MT, SCORE_TILES>(dp, dOs, Vs, L.ld, row0, hd);
        if (!full) {  // masked scores to -inf, whose probability 2^-inf is 0 (as forward)
            for_each_score<MT, SCORE_TILES>([&](int m, int n, int e) {
                int r = row0 + 16 * m + acc_row(e), c = n * 8 + acc_col(e);
                if (!(row_lse[m][e / 2] != -INFINITY && j0 + c < p.Tk &&
                      attn_pos_visible(p.causal, q_pos_s[r], tile_position(k_pos_s, p.k_pos, j0, c, p.Tk, INT_MAX))))
                    s[m][n][e] = -INFINITY;
            });
        }
        for_each_score<MT, SCORE_TILES>([&](int m, int n, int e) {
            float prob = exp2_weight(exp2_arg(p.scale, row_lse[m][e / 2]), s[m][n][e]);  // P = exp(S scale - lse)
            s[m][n][e] = prob * fmaf(dp[m][n][e], p.scale, -row_D[m][e / 2]);  // dS = P (dP - D) scale
        });
        warp_accumulate<HD_MAX, MT, SCORE_TILES>(acc, s, Ks, L.ld, hd);  // dQ += bf16(dS) K
        __syncthreads();  // before this stage is refilled
    }
    cp_async_wait<0>();  // as in forward

#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int i = i0 + row0 + 16 * m + lane_group() + 8 * half;
            if (i < p.Tq) store_row<HD_MAX, GradT>(dq + q_offset(p, b, i, h), acc[m], half, hd, false);
        }
}

// MT m16 fragments of keys per warp: MT = 1, a 64-key tile (warp w: keys 16w .. 16w+15), each query
// tile in one pass; MT = 2, a 128-key tile (warp w: keys 32w .. 32w+31), each 64-row query tile in
// two passes of 32 rows, so that the scores keep 32 registers a lane while the accumulators double.
// Each Q and dO fragment a warp loads then serves two fragments of keys. A key's arithmetic is the
// same either way, its sums in the same order (warp_accumulate): the same bits.
template <int HD_MAX, bool EXACT_HD, typename GradT, int MT>
__global__ void __launch_bounds__(ATTN_TC_THREADS, min_blocks_hd64(HD_MAX, MT, 3))
flash_backward_dkdv_tc_kernel(GradT *dk, GradT *dv, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                              const float *lse, const float *dvec, AttnParams p) {
    constexpr int BK = ATTN_TC_WARPS * 16 * MT;  // the block's keys
    constexpr int NT = SCORE_TILES / MT;         // a pass's 16x8 score tiles: 8 NT query rows
    constexpr int PASS_ROWS = 8 * NT;
    const int hd = head_dim_of<HD_MAX, EXACT_HD>(p);
    GPU_DYNAMIC_SMEM(Chunk16, smem);
    const AttnTcSmemLayout L = attn_tc_smem_layout_rows(ATTN_KERNEL_BACKWARD_DKDV, hd, BK);
    bf16 *Ks = SMEM_AT(bf16, L.k), *Vs = SMEM_AT(bf16, L.v);
    int *k_pos_s = SMEM_AT(int, L.k_pos);
    const int j0 = blockIdx.x * BK, g = blockIdx.y, b = blockIdx.z;
    const int row0 = (int)(threadIdx.x / 32) * 16 * MT;  // the warp's first key of the tile

    TileSource<HD_MAX, EXACT_HD, BK>(k, b, p.Tk, p.KV, hd).copy(Ks, L.ld, j0, g);
    TileSource<HD_MAX, EXACT_HD, BK>(v, b, p.Tk, p.KV, hd).copy(Vs, L.ld, j0, g);
    cp_async_commit();  // K and V: waited for with the first query tile
    const TileSource<HD_MAX, EXACT_HD> q_src(q, b, p.Tq, p.H, hd), dout_src(dout, b, p.Tq, p.H, hd);
    load_positions(k_pos_s, p.k_pos, j0, p.Tk, INT_MAX, BK);
    __syncthreads();
    int max_k_pos;
    const int min_k_pos = min_key_position(k_pos_s, &max_k_pos, BK);

    const float scale_log2 = p.scale * LOG2E_F;
    float dk_acc[MT][HD_MAX / 8][4], dv_acc[MT][HD_MAX / 8][4];  // of the warp's keys
#pragma unroll
    for (int m = 0; m < MT; m++) {
        zero<HD_MAX / 8>(dk_acc[m]);
        zero<HD_MAX / 8>(dv_acc[m]);
    }

    // The query tiles of the group's heads, head by head: step n is head g group + n / tiles, tile n % tiles.
    const int tiles = (p.Tq + ATTN_BR - 1) / ATTN_BR, steps = p.group * tiles;
    bool next_needed =
        prefetch_query_tile(query_stage(smem, L, 0), L.ld, q_src, dout_src, lse, dvec, p, b, g, 0, tiles, min_k_pos);
    for (int n = 0, stage = 0; n < steps; n++, stage ^= 1) {
        const int i0 = (n % tiles) * ATTN_BR;  // of head g group + n / tiles
        const bool needed = next_needed;
        next_needed = prefetch_query_tile(query_stage(smem, L, stage ^ 1), L.ld, q_src, dout_src, lse, dvec, p, b, g,
                                          n + 1, tiles, min_k_pos);
        const QueryStage qt = query_stage(smem, L, stage);
        cp_async_wait<1>();
        convert_query_row_stats(qt, p);
        // The whole tile visible (as wait_key_tile's vote): no per-element mask, and every query saw
        // this tile's keys, so its lse is finite. The vote is the barrier after the copies; with the
        // positions 0..Tq-1 the tile's first query, i0, is its earliest, and no vote is needed.
        bool full;
        if (p.q_pos) {
            full = __syncthreads_and(
                tile_in_range(p, i0, j0, ATTN_BR, BK) &&
                (threadIdx.x >= ATTN_BR || attn_pos_visible(p.causal, qt.pos[threadIdx.x], max_k_pos)));
        } else {
            __syncthreads();
            full = tile_in_range(p, i0, j0, ATTN_BR, BK) && attn_pos_visible(p.causal, i0, max_k_pos);
        }
        if (!needed) continue;
        const int *q_pos_s = qt.pos;
        const float *lse2_s = qt.lse, *Ds_s = qt.D;  // lse log2(e) (+inf: saw no key), D scale (prefetch_query_tile)

#pragma unroll
        for (int pass = 0; pass < MT; pass++) {
            const int q0 = pass * PASS_ROWS;  // the pass's first row of the query tile
            const bf16 *Qs = qt.Q + q0 * L.ld, *dOs = qt.dO + q0 * L.ld;
            float st[MT][NT][4], dpt[MT][NT][4];  // S^T = K Q^T (then P^T), dP^T = V dO^T (then dS^T)
            warp_scores<HD_MAX, MT, NT>(st, Ks, Qs, L.ld, row0, hd);
            warp_scores<HD_MAX, MT, NT>(dpt, Vs, dOs, L.ld, row0, hd);
            if (!full) {  // masked scores to -inf, whose probability 2^-inf is 0 (rows with no key: lse2 +inf)
                for_each_score<MT, NT>([&](int m, int t, int e) {
                    int key = row0 + 16 * m + acc_row(e), r = q0 + t * 8 + acc_col(e);  // a row per key, a column per query
                    const int q_pos = tile_position(q_pos_s, p.q_pos, i0, r, p.Tq, INT_MIN);
                    if (!(j0 + key < p.Tk && attn_pos_visible(p.causal, q_pos, k_pos_s[key])))
                        st[m][t][e] = -INFINITY;
                });
            }
            // P^T = exp(S^T scale - lse) = 2^(S^T scale log2(e) - lse log2(e)), and dS^T = P^T (dP^T - D)
            // scale = P^T (dP^T scale - D scale): an fma, an ex2, an fma and a multiply a score.
            for_each_score<MT, NT>([&](int m, int t, int e) {
                int r = q0 + t * 8 + acc_col(e);
                float prob = exp2_fast(fmaf(st[m][t][e], scale_log2, -lse2_s[r]));
                st[m][t][e] = prob;
                dpt[m][t][e] = prob * fmaf(dpt[m][t][e], p.scale, -Ds_s[r]);
            });
            warp_accumulate<HD_MAX, MT, NT>(dv_acc, st, dOs, L.ld, hd);  // dV += bf16(P^T) dO
            warp_accumulate<HD_MAX, MT, NT>(dk_acc, dpt, Qs, L.ld, hd);  // dK += bf16(dS^T) Q
        }
        __syncthreads();  // before this stage is refilled
    }

#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int j = j0 + row0 + 16 * m + lane_group() + 8 * half;
            if (j >= p.Tk) continue;
            store_row<HD_MAX, GradT>(dk + kv_offset(p, b, j, g), dk_acc[m], half, hd, false);
            store_row<HD_MAX, GradT>(dv + kv_offset(p, b, j, g), dv_acc[m], half, hd, false);
        }
}

// ================================ the fragments alone, for tests ====================================

// One warp (gpu_attention_tc_fragment_check in ops.h): a and b (16x16, row-major) into shared tiles,
// b also transposed; c = a b through load_frag_b2_from_rows_k, c_t = a b through
// load_frag_b2_from_rows_n on b^T, e = bf16(c) b with c's accumulators as the A fragment.
constexpr int CHECK_LD = 24;  // as a head_dim 16 tile: 16 + ATTN_TC_PAD
__global__ void mma_fragment_check_kernel(float *c, float *c_t, float *e, const bf16 *a, const bf16 *b) {
    GPU_DYNAMIC_SMEM(Chunk16, smem);
    bf16 *As = SMEM_AT(bf16, 0), *Bs = As + 16 * CHECK_LD, *Bt = Bs + 16 * CHECK_LD;
    for (int x = threadIdx.x; x < 256; x += blockDim.x) {
        int row = x / 16, col = x % 16;
        As[row * CHECK_LD + col] = a[x];
        Bs[row * CHECK_LD + col] = b[x];
        Bt[col * CHECK_LD + row] = b[x];
    }
    __syncthreads();
    uint32_t fa[4];
    load_frag_a(fa, As, CHECK_LD, 0, 0);
    float acc[2][4], acc_t[2][4], acc_e[2][4];
    zero<2>(acc);
    zero<2>(acc_t);
    zero<2>(acc_e);
    uint32_t fb[2][2], fbt[2][2];
    load_frag_b2_from_rows_k(fb, Bs, CHECK_LD, 0, 0);
    load_frag_b2_from_rows_n(fbt, Bt, CHECK_LD, 0, 0);
    for (int n = 0; n < 2; n++) {
        mma_bf16_m16n8k16(acc[n], fa, fb[n]);
        mma_bf16_m16n8k16(acc_t[n], fa, fbt[n]);
    }
    uint32_t fc[4];
    frag_a_from_accumulators(fc, acc[0], acc[1]);
    for (int n = 0; n < 2; n++) mma_bf16_m16n8k16(acc_e[n], fc, fb[n]);
    for (int n = 0; n < 2; n++)
        for (int el = 0; el < 4; el++) {
            int at = acc_row(el) * 16 + n * 8 + acc_col(el);
            c[at] = acc[n][el], c_t[at] = acc_t[n][el], e[at] = acc_e[n][el];
        }
}

// ================================ host side ======================================================

static bool tc_supported(const AttnShape *s) {
    return s->head_dim >= 16 && s->head_dim <= ATTN_MAX_HEAD_DIM && s->head_dim % 16 == 0;
}
static bool aligned16(const void *ptr) { return (uintptr_t)ptr % 16 == 0; }

template <typename Kernel>
static size_t prepare_tc(Kernel kernel, AttnKernel which, int head_dim, int own_rows) {
    size_t bytes = (size_t)attn_tc_smem_layout_rows(which, head_dim, own_rows).bytes;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    // As much of the SM's unified L1/shared memory as shared as it can hold: 4 dQ blocks take 224 KiB.
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    return bytes;
}

// The rows of each kernel's own tile (gpu_attention_set_tile_rows); 0 until first asked for, then from
// LLAMA_ATTN_TILE_ROWS: "R" (all three) or "F,DQ,DKDV", each 64 or 128. By default 64, 64 and 128: on an
// H200 (llama3_1b's attention at 16 x 2048, two runs) the 128-key dK/dV tile took the backward from
// 6.03 to 5.88 ms, while 128-query tiles made the forward slower (2.00 -> 2.26 ms) and dQ slower too.
static GpuAttnTileRows tile_rows;
static bool valid_rows(int rows) { return rows == ATTN_BR || rows == 2 * ATTN_BR; }
static bool valid_tile_rows(GpuAttnTileRows r) { return valid_rows(r.forward) && valid_rows(r.dq) && valid_rows(r.dkdv); }
extern "C" GpuAttnTileRows gpu_attention_tile_rows(void) {
    if (tile_rows.forward == 0) {
        const char *env = getenv("LLAMA_ATTN_TILE_ROWS");
        GpuAttnTileRows r = {ATTN_BR, ATTN_BR, 2 * ATTN_BC};
        if (env && *env) {
            int end = 0, n = sscanf(env, "%d%n,%d,%d%n", &r.forward, &end, &r.dq, &r.dkdv, &end);
            if (n == 1) r.dq = r.dkdv = r.forward;
            if ((n != 1 && n != 3) || env[end] != 0 || !valid_tile_rows(r))
                fatal_input("LLAMA_ATTN_TILE_ROWS=%s: 64 or 128, or three of them (forward,dQ,dK/dV) such as 128,128,64",
                            env);
        }
        tile_rows = r;
    }
    return tile_rows;
}
extern "C" void gpu_attention_set_tile_rows(GpuAttnTileRows rows) {
    if (!valid_tile_rows(rows))
        fatal("gpu_attention_set_tile_rows(%d, %d, %d): 64 or 128 each", rows.forward, rows.dq, rows.dkdv);
    tile_rows = rows;
}

// HD_MAX: the accumulators' size in registers, 64 or 128 (head_dim up to it); EXACT_HD: head_dim is HD_MAX.
// OutT / GradT: bf16 (the model's tensors) or float (context parallelism's ring, which merges and sums
// its blocks' outputs and gradients in fp32).
// MT: fragments of 16 query rows per warp (the query tile: 64 MT rows).
template <int HD_MAX, bool EXACT_HD, typename OutT, int MT>
static void launch_forward_tc(OutT *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const AttnParams &p) {
    constexpr int rows = ATTN_TC_WARPS * 16 * MT;
    size_t smem = prepare_tc(flash_forward_tc_kernel<HD_MAX, EXACT_HD, OutT, MT>, ATTN_KERNEL_FORWARD, p.hd, rows);
    dim3 grid((p.Tq + rows - 1) / rows, p.H, p.B);
    GPU_LAUNCH((flash_forward_tc_kernel<HD_MAX, EXACT_HD, OutT, MT>), grid, ATTN_TC_THREADS, smem, out, lse, q, k, v,
               p);
}
template <int HD_MAX, bool EXACT_HD, typename GradT, int MT>
static void launch_dq_tc(GradT *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, const float *lse,
                         const float *dvec, const AttnParams &p) {
    constexpr int rows = ATTN_TC_WARPS * 16 * MT;
    size_t smem =
        prepare_tc(flash_backward_dq_tc_kernel<HD_MAX, EXACT_HD, GradT, MT>, ATTN_KERNEL_BACKWARD_DQ, p.hd, rows);
    dim3 grid((p.Tq + rows - 1) / rows, p.H, p.B);
    GPU_LAUNCH((flash_backward_dq_tc_kernel<HD_MAX, EXACT_HD, GradT, MT>), grid, ATTN_TC_THREADS, smem, dq, dout, q, k,
               v, lse, dvec, p);
}
template <int HD_MAX, bool EXACT_HD, typename GradT, int MT>
static void launch_dkdv_tc(GradT *dk, GradT *dv, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                           const float *lse, const float *dvec, const AttnParams &p) {
    constexpr int rows = ATTN_TC_WARPS * 16 * MT;
    size_t smem =
        prepare_tc(flash_backward_dkdv_tc_kernel<HD_MAX, EXACT_HD, GradT, MT>, ATTN_KERNEL_BACKWARD_DKDV, p.hd, rows);
    dim3 grid((p.Tk + rows - 1) / rows, p.KV, p.B);
    GPU_LAUNCH((flash_backward_dkdv_tc_kernel<HD_MAX, EXACT_HD, GradT, MT>), grid, ATTN_TC_THREADS, smem, dk, dv, dout,
               q, k, v, lse, dvec, p);
}
template <int HD_MAX, bool EXACT_HD, typename GradT>
static void launch_backward_tc(GradT *dq, GradT *dk, GradT *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                               const bf16 *v, const float *lse, const float *dvec, const AttnParams &p) {
    // The backward kernels' 128-row tiles at head_dim up to 64 only: with 128-wide accumulators they
    // would spill (ptxas, dQ: 1.2 KB).
    if constexpr (HD_MAX <= 64) {
        const GpuAttnTileRows rows = gpu_attention_tile_rows();
        if (rows.dq == 2 * ATTN_BR) launch_dq_tc<HD_MAX, EXACT_HD, GradT, 2>(dq, dout, q, k, v, lse, dvec, p);
        else launch_dq_tc<HD_MAX, EXACT_HD, GradT, 1>(dq, dout, q, k, v, lse, dvec, p);
        if (rows.dkdv == 2 * ATTN_BC) launch_dkdv_tc<HD_MAX, EXACT_HD, GradT, 2>(dk, dv, dout, q, k, v, lse, dvec, p);
        else launch_dkdv_tc<HD_MAX, EXACT_HD, GradT, 1>(dk, dv, dout, q, k, v, lse, dvec, p);
    } else {
        launch_dq_tc<HD_MAX, EXACT_HD, GradT, 1>(dq, dout, q, k, v, lse, dvec, p);
        launch_dkdv_tc<HD_MAX, EXACT_HD, GradT, 1>(dk, dv, dout, q, k, v, lse, dvec, p);
    }
}
template <int HD_MAX, bool EXACT_HD, typename OutT>
static void launch_forward_tc_rows(OutT *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                                   const AttnParams &p) {
    if (gpu_attention_tile_rows().forward == 2 * ATTN_BR)
        launch_forward_tc<HD_MAX, EXACT_HD, OutT, 2>(out, lse, q, k, v, p);
    else
        launch_forward_tc<HD_MAX, EXACT_HD, OutT, 1>(out, lse, q, k, v, p);
}
// The instantiation for head_dim hd: launch(HD_MAX, EXACT_HD) with the accumulators' width (64 or 128) and
// whether hd fills them, each as a std::integral_constant.
template <typename Launch> static void with_head_dim(int hd, Launch &&launch) {
    using hd64 = std::integral_constant<int, 64>;
    using hd128 = std::integral_constant<int, 128>;
    if (hd == 64) launch(hd64{}, std::true_type{});
    else if (hd < 64) launch(hd64{}, std::false_type{});
    else if (hd == 128) launch(hd128{}, std::true_type{});
    else launch(hd128{}, std::false_type{});
}
template <typename OutT>
static void forward_tc(OutT *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const AttnShape *s) {
    AttnParams p = attn_params_of(s);
    if (p.B == 0 || p.Tq == 0) return;
    with_head_dim(p.hd, [&](auto hd_max, auto exact) {
        launch_forward_tc_rows<decltype(hd_max)::value, decltype(exact)::value, OutT>(out, lse, q, k, v, p);
    });
}
// D = rowsum(dO O) from the bf16 dout and out, then the dQ and dK/dV kernels.
template <typename GradT>
static void backward_tc(GradT *dq, GradT *dk, GradT *dv, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                        const bf16 *out, const float *lse, const AttnShape *s) {
    AttnParams p = attn_params_of(s);
    if (p.B == 0 || p.Tq == 0 || p.Tk == 0) return;
    float *dvec = (float *)gpu_scratch_alloc((size_t)p.B * p.H * p.Tq * sizeof(float));
    attention_dvec_bf16(dvec, dout, out, p);
    with_head_dim(p.hd, [&](auto hd_max, auto exact) {
        launch_backward_tc<decltype(hd_max)::value, decltype(exact)::value, GradT>(dq, dk, dv, dout, q, k, v, lse,
                                                                                    dvec, p);
    });
    gpu_scratch_free(dvec);
}

extern "C" bool gpu_attention_bf16_uses_tensor_cores(const AttnShape *s) { return tc_supported(s); }

extern "C" void gpu_attention_forward_bf16(gpu_bf16 *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k,
                                           const gpu_bf16 *v, const AttnShape *s) {
    if (!tc_supported(s) || !aligned16(out) || !aligned16(q) || !aligned16(k) || !aligned16(v)) {
        gpu_attention_forward_bf16_simt(out, lse, q, k, v, s);
        return;
    }
    forward_tc<bf16>(out, lse, q, k, v, s);
}

extern "C" void gpu_attention_backward_bf16(gpu_bf16 *dq, gpu_bf16 *dk, gpu_bf16 *dv, const gpu_bf16 *dout,
                                            const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v,
                                            const gpu_bf16 *out, const float *lse, const AttnShape *s) {
    const void *tensors[] = {dq, dk, dv, dout, q, k, v, out};
    bool aligned = true;
    for (const void *t : tensors) aligned = aligned && aligned16(t);
    if (!tc_supported(s) || !aligned) {
        gpu_attention_backward_bf16_simt(dq, dk, dv, dout, q, k, v, out, lse, s);
        return;
    }
    backward_tc<bf16>(dq, dk, dv, dout, q, k, v, out, lse, s);
}

// bf16 operands, fp32 results (ops.h): the same kernels storing float. The caller checks
// gpu_attention_bf16_uses_tensor_cores and the 16-byte alignment of the bf16 tensors.
extern "C" void gpu_attention_forward_bf16_into_f32(float *out, float *lse, const gpu_bf16 *q, const gpu_bf16 *k,
                                                    const gpu_bf16 *v, const AttnShape *s) {
    if (!tc_supported(s)) fatal("gpu_attention_forward_bf16_into_f32: head_dim %d: not a multiple of 16 up to %d",
                                s->head_dim, ATTN_MAX_HEAD_DIM);
    forward_tc<float>(out, lse, q, k, v, s);
}
extern "C" void gpu_attention_backward_bf16_into_f32(float *dq, float *dk, float *dv, const gpu_bf16 *dout,
                                                     const gpu_bf16 *q, const gpu_bf16 *k, const gpu_bf16 *v,
                                                     const gpu_bf16 *out, const float *lse, const AttnShape *s) {
    if (!tc_supported(s)) fatal("gpu_attention_backward_bf16_into_f32: head_dim %d: not a multiple of 16 up to %d",
                                s->head_dim, ATTN_MAX_HEAD_DIM);
    backward_tc<float>(dq, dk, dv, dout, q, k, v, out, lse, s);
}

extern "C" void gpu_attention_tc_fragment_check(float *c, float *c_t, float *e, const gpu_bf16 *a,
                                                const gpu_bf16 *b) {
    GPU_LAUNCH(mma_fragment_check_kernel, 1, 32, 3 * 16 * CHECK_LD * sizeof(bf16), c, c_t, e, a, b);
}
