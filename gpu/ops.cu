// ops.cu: the element-wise and row-wise ops of gpu/ops.h (attention is attention.cu, matmul
// matmul.cu). Each op is one templated kernel for the two storage types (float, bf16) with the
// arithmetic in float (or double where the reference sums in double), and a C entry point per type.
//
// Determinism: no atomics on data. Reductions inside a row use a fixed tree (block_sum); reductions
// across rows are split so that the grid fills the device but every sum has a fixed order: RMSNorm's
// dweight in two stages (partials per chunk of rows, then the chunks in order), the embedding's
// dtable by tiles of the table (each element summed by one thread in the reference's row order).
#include <limits.h>

#include <initializer_list>

#include "gpu/internal.cuh"
#include "gpu/numerics.h"
#include "gpu/ops.h"

// The templated host functions that launch the kernels are named launch_<op>: reference_cpu/ops.h
// (included through gpu/ops.h) declares <op> itself, and for fp32 arguments C++ overload resolution
// prefers that exact non-template match -- the GPU entry point would silently run the CPU op.
static_assert(sizeof(real) == sizeof(float), "gpu/ needs the fp32 build of reference_cpu (RopeTable holds real)");

#define ROW_THREADS 256  // one block per row for the row-wise ops (RMSNorm, cross-entropy)

// ---- 16-byte vectors for the element-wise kernels ------------------------------------------------
// An element-wise kernel<..., W> handles packs of W consecutive elements, each loaded and stored as
// one access of W * sizeof(T) bytes (16: one 128-bit load or store per thread and tensor instead of
// W scalar ones). Its launcher runs kernel<W> over the largest multiple of W elements when every
// pointer is aligned to its pack, then kernel<1> over the rest (and over everything otherwise):
// the same per-element arithmetic either way.
// (Pack, load_pack and store_pack: gpu/internal.cuh.)
static bool aligned(const void *p, size_t bytes) { return (uintptr_t)p % bytes == 0; }
// How many of n elements the vector kernel takes: n rounded down to W, or none if some pointer is
// not aligned to its pack.
static size_t vector_part(size_t n, int W, bool all_aligned) { return all_aligned ? n / W * W : 0; }

// The row kernels (RMSNorm, cross-entropy: one block per row) read their rows in packs of W elements
// (16-byte loads) when every row starts 16-byte aligned: with scalar 2-byte loads the loads in
// flight, not the bandwidth, set their speed (about 0.65 TB/s on an H200 for the cross-entropy's).
// Thread i takes packs i, i + blockDim, ... and, within a pack, its elements in order; the block's
// sums are then a fixed tree, so a shape and alignment always sum in the same order.
template <typename T> static bool rows_packed(std::initializer_list<const void *> rows, int len) {
    bool ok = (size_t)len * sizeof(T) % 16 == 0;
    for (const void *p : rows) ok = ok && aligned(p, 16);
    return ok;
}
// f(x[j]) for this thread's elements j of a row of V (a multiple of W) elements.
template <int W, typename T, typename F> __device__ __forceinline__ void for_my_elements(const T *x, int V, F f) {
    for (int p = threadIdx.x; p < V / W; p += blockDim.x) {
        Pack<T, W> v = load_pack<W>(x, p);
#pragma unroll
        for (int k = 0; k < W; k++) f(to_f32(v.v[k]));
    }
}

// ================================ embedding ======================================================

// out (N,C): block n copies row tokens[n] - row_start of the table, or writes zeros if the token is
// not one of this table's rows [row_start, row_start + n_rows) (vocab-parallel shards).
// Out is T, or float for a bf16 table (exact: every bf16 is a float).
template <typename T, typename Out>
__global__ void embedding_forward_kernel(Out *out, const int *tokens, const T *table, int C, int row_start,
                                         int n_rows) {
    int n = blockIdx.x, token = tokens[n];
    bool here = token >= row_start && token - row_start < n_rows;
    Out *o = out + (size_t)n * C;
    if (here) {
        const T *row = table + (size_t)(token - row_start) * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = from_f32<Out>(to_f32(row[c]));
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = from_f32<Out>(0.0f);
    }
}

// dtable (rows, C) += dout (N, C) scattered by token. Two positions with the same token add into the
// same row, so the additions into one element must be ordered. The table is cut into
// EMBED_BWD_TILES tiles of rows (by the rows the tokens actually use, which a first kernel finds:
// the whole-table entry points are not told the vocabulary size), and each block owns one tile of
// rows by blockDim.x columns: it walks all N positions in order, adding the rows of dout whose
// token falls in its tile. Every element of dtable is then summed by one thread, in the
// reference's order (bit-identical in fp32), with no atomics, and the grid spans the vocabulary as
// well as the columns. The tokens are staged through shared memory a chunk at a time.
#define EMBED_BWD_TILES 64
#define EMBED_BWD_THREADS 128

// *rows_used = 1 + the largest row (token - row_start) of the shard [0, n_rows) that a token hits;
// 0 if none. One block.
__global__ void embedding_rows_used_kernel(int *rows_used, const int *tokens, int N, int row_start, int n_rows) {
    __shared__ int best[1024];
    int mine = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        int row = tokens[n] - row_start;
        if (row >= 0 && row < n_rows) mine = max(mine, row + 1);
    }
    best[threadIdx.x] = mine;
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < half) best[threadIdx.x] = max(best[threadIdx.x], best[threadIdx.x + half]);
    }
    if (threadIdx.x == 0) *rows_used = best[0];
}

template <typename T>
__global__ void __launch_bounds__(EMBED_BWD_THREADS)
    embedding_backward_kernel(float *dtable, const T *dout, const int *tokens, int N, int C, int row_start,
                              const int *rows_used) {
    __shared__ int chunk[EMBED_BWD_THREADS];
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int tile_rows = (*rows_used + gridDim.y - 1) / gridDim.y;
    int tile_first = blockIdx.y * tile_rows, tile_end = min(tile_first + tile_rows, *rows_used);
    if (tile_first >= tile_end) return;  // the whole block: no token in this tile
    for (int base = 0; base < N; base += blockDim.x) {
        __syncthreads();  // every thread has read the previous chunk
        chunk[threadIdx.x] = base + (int)threadIdx.x < N ? tokens[base + threadIdx.x] : -1;
        __syncthreads();
        int count = min((int)blockDim.x, N - base);
        for (int i = 0; i < count; i++) {
            int row = chunk[i] - row_start;  // the same for every thread: no divergence
            if (c < C && row >= tile_first && row < tile_end)
                dtable[(size_t)row * C + c] += to_f32(dout[(size_t)(base + i) * C + c]);
        }
    }
}

template <typename T, typename Out>
static void launch_embedding_forward(Out *out, const int *tokens, const T *table, int N, int C, int row_start,
                                     int n_rows) {
    if (N == 0 || C == 0) return;
    GPU_LAUNCH((embedding_forward_kernel<T, Out>), N, 128, 0, out, tokens, table, C, row_start, n_rows);
}
template <typename T>
static void launch_embedding_backward(float *dtable, const T *dout, const int *tokens, int N, int C, int row_start,
                               int n_rows) {
    if (N == 0 || C == 0) return;
    int *rows_used = (int *)gpu_scratch_alloc(sizeof(int));
    GPU_LAUNCH(embedding_rows_used_kernel, 1, 1024, 0, rows_used, tokens, N, row_start, n_rows);
    dim3 grid((C + EMBED_BWD_THREADS - 1) / EMBED_BWD_THREADS, EMBED_BWD_TILES);
    GPU_LAUNCH(embedding_backward_kernel<T>, grid, EMBED_BWD_THREADS, 0, dtable, dout, tokens, N, C, row_start,
               rows_used);
    gpu_scratch_free(rows_used);
}

extern "C" void gpu_embedding_forward(float *out, const int *tokens, const float *table, int N, int C) {
    launch_embedding_forward(out, tokens, table, N, C, 0, INT_MAX);
}
extern "C" void gpu_embedding_backward(float *dtable, const float *dout, const int *tokens, int N, int C) {
    launch_embedding_backward(dtable, dout, tokens, N, C, 0, INT_MAX);
}
extern "C" void gpu_embedding_forward_rows(float *out, const int *tokens, const float *table, int N, int C,
                                           int row_start, int n_rows) {
    launch_embedding_forward(out, tokens, table, N, C, row_start, n_rows);
}
extern "C" void gpu_embedding_backward_rows(float *dtable, const float *dout, const int *tokens, int N, int C,
                                            int row_start, int n_rows) {
    launch_embedding_backward(dtable, dout, tokens, N, C, row_start, n_rows);
}
extern "C" void gpu_embedding_forward_bf16(gpu_bf16 *out, const int *tokens, const gpu_bf16 *table, int N, int C) {
    launch_embedding_forward(out, tokens, table, N, C, 0, INT_MAX);
}
extern "C" void gpu_embedding_backward_bf16(float *dtable, const gpu_bf16 *dout, const int *tokens, int N, int C) {
    launch_embedding_backward(dtable, dout, tokens, N, C, 0, INT_MAX);
}
extern "C" void gpu_embedding_forward_rows_bf16_into_f32(float *out, const int *tokens, const gpu_bf16 *table, int N,
                                                         int C, int row_start, int n_rows) {
    launch_embedding_forward(out, tokens, table, N, C, row_start, n_rows);
}
extern "C" void gpu_embedding_backward_rows_bf16(float *dtable, const gpu_bf16 *dout, const int *tokens, int N, int C,
                                                 int row_start, int n_rows) {
    launch_embedding_backward(dtable, dout, tokens, N, C, row_start, n_rows);
}

// ================================ RMSNorm ========================================================

// Block per row of (N,C): rstd = 1/sqrt(mean(x^2) + eps) with the sum in double (as the reference:
// C can be 16384), then out = x * rstd * weight.
// In packs of W elements (the row kernels above).
template <typename T, int W>
__global__ void rmsnorm_forward_kernel(T *out, float *rstd, const T *inp, const T *weight, int C, double eps) {
    __shared__ double scratch[32];
    size_t row = blockIdx.x;
    const T *x = inp + row * C;
    double sum_sq = 0;
    for_my_elements<W>(x, C, [&](float v) { sum_sq += (double)v * v; });
    sum_sq = block_sum(sum_sq, scratch);
    float r = (float)(1.0 / sqrt(sum_sq / C + eps));
    if (threadIdx.x == 0) rstd[row] = r;
    T *y = out + row * C;
    for (int p = threadIdx.x; p < C / W; p += blockDim.x) {
        Pack<T, W> xv = load_pack<W>(x, p), wv = load_pack<W>(weight, p), yv;
#pragma unroll
        for (int k = 0; k < W; k++) yv.v[k] = from_f32<T>(to_f32(xv.v[k]) * r * to_f32(wv.v[k]));
        store_pack<W>(y, p, yv);
    }
}

// dx_i += r w_i dy_i - x_i r^3 / C * sum_k dy_k w_k x_k  (block per row; the sum in double)
template <typename T, int W>
__global__ void rmsnorm_backward_input_kernel(T *dinp, const T *dout, const T *inp, const T *weight, const float *rstd,
                                              int C) {
    __shared__ double scratch[32];
    size_t row = blockIdx.x;
    const T *x = inp + row * C, *dy = dout + row * C;
    float r = rstd[row];
    double proj = 0;
    for (int p = threadIdx.x; p < C / W; p += blockDim.x) {
        Pack<T, W> xv = load_pack<W>(x, p), dyv = load_pack<W>(dy, p), wv = load_pack<W>(weight, p);
#pragma unroll
        for (int k = 0; k < W; k++) proj += (double)to_f32(dyv.v[k]) * to_f32(wv.v[k]) * to_f32(xv.v[k]);
    }
    proj = block_sum(proj, scratch);
    float coef = (float)(proj * r * r * r / C);
    T *dx = dinp + row * C;
    for (int p = threadIdx.x; p < C / W; p += blockDim.x) {
        Pack<T, W> xv = load_pack<W>(x, p), dyv = load_pack<W>(dy, p), wv = load_pack<W>(weight, p),
                   dxv = load_pack<W>(dx, p);
#pragma unroll
        for (int k = 0; k < W; k++)
            dxv.v[k] = from_f32<T>(to_f32(dxv.v[k]) + (r * to_f32(wv.v[k]) * to_f32(dyv.v[k]) - to_f32(xv.v[k]) * coef));
        store_pack<W>(dx, p, dxv);
    }
}

// dweight_c += sum over rows of dy_c x_c r, in two deterministic stages. Stage 1: block (x, y) sums
// rows [y R, (y+1) R) of its blockDim.x columns, each thread one column in row order, into
// partial[y][c] (R = RMSNORM_DW_ROWS, more only past 65535 chunks: enough blocks to fill the device). Stage 2: thread c
// adds partial[0..chunks)[c] in order to dweight_c. The grouping depends only on N, so the result
// is the same on every run; it is not the reference's single running sum, so fp32 agrees with it
// to rounding (the ops test's 1e-5), not bit for bit.
#define RMSNORM_DW_ROWS 64
template <typename T>
__global__ void rmsnorm_dweight_partial_kernel(float *partial, const T *dout, const T *inp, const float *rstd, int N,
                                               int C, int rows_per_chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    int first = blockIdx.y * rows_per_chunk, end = min(first + rows_per_chunk, N);
    float acc = 0;
    for (int n = first; n < end; n++) acc += to_f32(dout[(size_t)n * C + c]) * to_f32(inp[(size_t)n * C + c]) * rstd[n];
    partial[(size_t)blockIdx.y * C + c] = acc;
}
__global__ void rmsnorm_dweight_sum_kernel(float *dweight, const float *partial, int chunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0;
    for (int j = 0; j < chunks; j++) acc += partial[(size_t)j * C + c];
    dweight[c] += acc;
}

template <typename T>
static void launch_rmsnorm_forward(T *out, float *rstd, const T *inp, const T *weight, int N, int C, double eps) {
    if (N == 0) return;
    if (rows_packed<T>({out, inp, weight}, C))
        GPU_LAUNCH((rmsnorm_forward_kernel<T, 16 / sizeof(T)>), N, ROW_THREADS, 0, out, rstd, inp, weight, C, eps);
    else GPU_LAUNCH((rmsnorm_forward_kernel<T, 1>), N, ROW_THREADS, 0, out, rstd, inp, weight, C, eps);
}
template <typename T>
static void launch_rmsnorm_backward(T *dinp, float *dweight, const T *dout, const T *inp, const T *weight,
                                    const float *rstd, int N, int C) {
    if (N == 0 || C == 0) return;
    if (rows_packed<T>({dinp, dout, inp, weight}, C))
        GPU_LAUNCH((rmsnorm_backward_input_kernel<T, 16 / sizeof(T)>), N, ROW_THREADS, 0, dinp, dout, inp, weight, rstd, C);
    else GPU_LAUNCH((rmsnorm_backward_input_kernel<T, 1>), N, ROW_THREADS, 0, dinp, dout, inp, weight, rstd, C);
    int rows_per_chunk = max(RMSNORM_DW_ROWS, (N + 65534) / 65535);  // grid.y <= 65535
    int chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
    float *partial = (float *)gpu_scratch_alloc(sizeof(float) * (size_t)chunks * C);
    dim3 grid((C + 127) / 128, chunks);
    GPU_LAUNCH(rmsnorm_dweight_partial_kernel<T>, grid, 128, 0, partial, dout, inp, rstd, N, C, rows_per_chunk);
    GPU_LAUNCH(rmsnorm_dweight_sum_kernel, (C + 127) / 128, 128, 0, dweight, partial, chunks, C);
    gpu_scratch_free(partial);
}

extern "C" void gpu_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C,
                                    double eps) {
    launch_rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
}
extern "C" void gpu_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                                     const float *weight, const float *rstd, int N, int C) {
    launch_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}
extern "C" void gpu_rmsnorm_forward_bf16(gpu_bf16 *out, float *rstd, const gpu_bf16 *inp, const gpu_bf16 *weight,
                                         int N, int C, double eps) {
    launch_rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
}
extern "C" void gpu_rmsnorm_backward_bf16(gpu_bf16 *dinp, float *dweight, const gpu_bf16 *dout, const gpu_bf16 *inp,
                                          const gpu_bf16 *weight, const float *rstd, int N, int C) {
    launch_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}

// ================================ RoPE ===========================================================

// W consecutive elements at `at`: one 16-byte pack, or (W = 2) element by element.
template <int W, typename T> __device__ __forceinline__ Pack<T, W> load_pairs(const T *at) {
    if (W != 2) return load_pack<W>(at, 0);
    Pack<T, W> x;
    x.v[0] = at[0], x.v[1] = at[1];
    return x;
}
template <int W, typename T> __device__ __forceinline__ void store_pairs(T *at, const Pack<T, W> &x) {
    if (W != 2) store_pack<W>(at, 0, x);
    else at[0] = x.v[0], at[1] = x.v[1];
}
// The W / 2 pairs of x rotated by the table's angles from `angles` on, times sign.
template <int W, typename T>
__device__ __forceinline__ void rotate_pairs(Pack<T, W> &x, const float *cos_table, const float *sin_table,
                                             size_t angles, float sign) {
#pragma unroll
    for (int j = 0; j < W; j += 2) {
        float x0 = to_f32(x.v[j]), x1 = to_f32(x.v[j + 1]);
        rope_rotate_pair(&x0, &x1, cos_table[angles + j / 2], sign * sin_table[angles + j / 2]);
        x.v[j] = from_f32<T>(x0), x.v[j + 1] = from_f32<T>(x1);
    }
}

// x (B,T,n_heads,head_dim) in place: each pair (2i, 2i+1) rotated by the table's angle at the token's
// position, times `sign` (-1: the transpose, for backward). Thread per W consecutive elements of a
// head (W / 2 pairs): W = 16 / sizeof(T), one 16-byte access, where head_dim divides by it and x is
// 16-byte aligned; otherwise W = 2, element by element (the QKV split below does the same).
template <typename T, int W>
__global__ void rope_kernel(T *x, const float *cos_table, const float *sin_table, const int *positions, int T_len,
                            int n_heads, int hd, size_t n_packs, float sign) {
    int half = hd / 2, packs_per_head = hd / W;
    GRID_STRIDE_LOOP(idx, n_packs) {
        int e0 = (int)(idx % packs_per_head) * W;  // the pack's first element within its head
        size_t row = idx / packs_per_head;         // (b, t, h) flattened
        int t = (int)((row / n_heads) % T_len);
        size_t angles = (size_t)(positions ? positions[t] : t) * half + e0 / 2;
        T *at = x + row * hd + e0;
        Pack<T, W> v = load_pairs<W>(at);
        rotate_pairs<W>(v, cos_table, sin_table, angles, sign);
        store_pairs<W>(at, v);
    }
}

template <typename T>
static void launch_rope(T *x, const RopeTable *t, const int *positions, int B, int T_len, int n_heads, float sign) {
    constexpr int W = 16 / sizeof(T);
    int hd = t->head_dim;
    size_t elements = (size_t)B * T_len * n_heads * hd;
    if (hd % W == 0 && aligned(x, 16))
        LAUNCH_1D((rope_kernel<T, W>), elements / W, x, t->cos, t->sin, positions, T_len, n_heads, hd, elements / W,
                  sign);
    else
        LAUNCH_1D((rope_kernel<T, 2>), elements / 2, x, t->cos, t->sin, positions, T_len, n_heads, hd, elements / 2,
                  sign);
}

// ---- the fused QKV projection's split and merge ----
// fused (B*T, n_heads + 2 n_kv_heads, hd): a token's q heads, k heads, v heads (what one GEMM with
// [wq; wk; wv] writes). Pair by pair (2i, 2i+1) of each head of each token, over the fused heads:
// q and k heads are rotated (sign 1) or rotated back (sign -1, the transpose), v heads copied.
// split: q, k, v <- fused; merge: fused <- q, k, v. Every element is written once (overwrite).
//
// The choice, and its cost: attention's kernels take contiguous q, k, v (B,T,heads,hd), so the fused
// GEMM's output is split once, with RoPE folded in. This kernel reads and writes each fused element
// once (B T (hq + 2 hkv) of each), where the two in-place RoPE kernels it replaces read and wrote
// B T (hq + hkv): the extra traffic is v's copy, B T hkv read and written; the fused buffer is one
// scratch the blocks share (its gradient reuses it in backward). Strided views would save v's copy
// but need a row stride in every attention kernel.
// Thread per W consecutive elements (W / 2 pairs) of one head of one token: W = 16 / sizeof(T) where
// head_dim divides by it and every pointer is 16-byte aligned, each side then read and written as one
// 16-byte pack (the divisions that locate a head are made once a pack instead of once a pair);
// otherwise W = 2, element by element. The same arithmetic per pair either way.
template <typename T, int W>
__global__ void qkv_rope_kernel(T *fused, T *q, T *k, T *v, bool merge, const float *cos_table,
                                const float *sin_table, const int *positions, int T_len, int n_heads, int n_kv_heads,
                                int hd, size_t n_packs, float sign) {
    int heads = n_heads + 2 * n_kv_heads, half = hd / 2, packs_per_head = hd / W;
    GRID_STRIDE_LOOP(idx, n_packs) {
        int e0 = (int)(idx % packs_per_head) * W;  // the pack's first element within its head
        size_t fused_row = idx / packs_per_head;   // (token, fused head) flattened
        int h = (int)(fused_row % heads);
        size_t token = fused_row / heads;
        T *part;
        if (h < n_heads) part = q + (token * n_heads + h) * hd;
        else if (h < n_heads + n_kv_heads) part = k + (token * n_kv_heads + (h - n_heads)) * hd;
        else part = v + (token * n_kv_heads + (h - n_heads - n_kv_heads)) * hd;
        const T *from = merge ? part + e0 : fused + fused_row * hd + e0;
        T *to = merge ? fused + fused_row * hd + e0 : part + e0;
        Pack<T, W> x = load_pairs<W>(from);
        if (h < n_heads + n_kv_heads) {  // q and k: rotated; v: copied
            int t = (int)(token % T_len);
            rotate_pairs<W>(x, cos_table, sin_table, (size_t)(positions ? positions[t] : t) * half + e0 / 2, sign);
        }
        store_pairs<W>(to, x);
    }
}

template <typename T>
static void launch_qkv_rope(T *fused, T *q, T *k, T *v, bool merge, const RopeTable *t, const int *positions, int B,
                            int T_len, int n_heads, int n_kv_heads) {
    constexpr int W = 16 / sizeof(T);
    int hd = t->head_dim;
    size_t elements = (size_t)B * T_len * (n_heads + 2 * n_kv_heads) * hd;
    float sign = merge ? -1.0f : 1.0f;
    if (hd % W == 0 && aligned(fused, 16) && aligned(q, 16) && aligned(k, 16) && aligned(v, 16))
        LAUNCH_1D((qkv_rope_kernel<T, W>), elements / W, fused, q, k, v, merge, t->cos, t->sin, positions, T_len,
                  n_heads, n_kv_heads, hd, elements / W, sign);
    else
        LAUNCH_1D((qkv_rope_kernel<T, 2>), elements / 2, fused, q, k, v, merge, t->cos, t->sin, positions, T_len,
                  n_heads, n_kv_heads, hd, elements / 2, sign);
}

extern "C" void gpu_qkv_split_rope(float *q, float *k, float *v, const float *qkv, const RopeTable *t,
                                   const int *positions, int B, int T, int n_heads, int n_kv_heads) {
    launch_qkv_rope(const_cast<float *>(qkv), q, k, v, false, t, positions, B, T, n_heads, n_kv_heads);
}
extern "C" void gpu_qkv_merge_rope_backward(float *dqkv, const float *dq, const float *dk, const float *dv,
                                            const RopeTable *t, const int *positions, int B, int T, int n_heads,
                                            int n_kv_heads) {
    launch_qkv_rope(dqkv, const_cast<float *>(dq), const_cast<float *>(dk), const_cast<float *>(dv), true, t,
                    positions, B, T, n_heads, n_kv_heads);
}
extern "C" void gpu_qkv_split_rope_bf16(gpu_bf16 *q, gpu_bf16 *k, gpu_bf16 *v, const gpu_bf16 *qkv,
                                        const RopeTable *t, const int *positions, int B, int T, int n_heads,
                                        int n_kv_heads) {
    launch_qkv_rope(const_cast<gpu_bf16 *>(qkv), q, k, v, false, t, positions, B, T, n_heads, n_kv_heads);
}
extern "C" void gpu_qkv_merge_rope_backward_bf16(gpu_bf16 *dqkv, const gpu_bf16 *dq, const gpu_bf16 *dk,
                                                 const gpu_bf16 *dv, const RopeTable *t, const int *positions, int B,
                                                 int T, int n_heads, int n_kv_heads) {
    launch_qkv_rope(dqkv, const_cast<gpu_bf16 *>(dq), const_cast<gpu_bf16 *>(dk), const_cast<gpu_bf16 *>(dv), true, t,
                    positions, B, T, n_heads, n_kv_heads);
}

extern "C" RopeTable gpu_rope_table_upload(const RopeTable *host) {
    RopeTable t = *host;
    size_t bytes = sizeof(float) * (size_t)host->max_pos * (host->head_dim / 2);
    t.cos = (float *)gpu_alloc(MEM_OTHER, bytes);
    t.sin = (float *)gpu_alloc(MEM_OTHER, bytes);
    gpu_upload(t.cos, host->cos, bytes);
    gpu_upload(t.sin, host->sin, bytes);
    return t;
}
extern "C" void gpu_rope_table_free(RopeTable *t) {
    gpu_free(t->cos);
    gpu_free(t->sin);
    t->cos = t->sin = NULL;
}
extern "C" void gpu_rope_forward(float *x, const RopeTable *t, const int *positions, int B, int T, int n_heads) {
    launch_rope(x, t, positions, B, T, n_heads, 1.0f);
}
extern "C" void gpu_rope_backward(float *dx, const RopeTable *t, const int *positions, int B, int T, int n_heads) {
    launch_rope(dx, t, positions, B, T, n_heads, -1.0f);
}
extern "C" void gpu_rope_forward_bf16(gpu_bf16 *x, const RopeTable *t, const int *positions, int B, int T,
                                      int n_heads) {
    launch_rope(x, t, positions, B, T, n_heads, 1.0f);
}
extern "C" void gpu_rope_backward_bf16(gpu_bf16 *dx, const RopeTable *t, const int *positions, int B, int T,
                                       int n_heads) {
    launch_rope(dx, t, positions, B, T, n_heads, -1.0f);
}

// ================================ SwiGLU =========================================================

// Over n_packs packs of W elements (16-byte vectors above).
template <typename T, int W>
__global__ void swiglu_forward_kernel(T *out, const T *gate, const T *up, size_t n_packs) {
    GRID_STRIDE_LOOP(i, n_packs) {
        Pack<T, W> g = load_pack<W>(gate, i), u = load_pack<W>(up, i), y;
        for (int j = 0; j < W; j++) y.v[j] = from_f32<T>(swiglu_value(to_f32(g.v[j]), to_f32(u.v[j])));
        store_pack<W>(out, i, y);
    }
}
template <typename T, int W>
__global__ void swiglu_backward_kernel(T *dgate, T *dup, const T *dout, const T *gate, const T *up, size_t n_packs) {
    GRID_STRIDE_LOOP(i, n_packs) {
        Pack<T, W> dy = load_pack<W>(dout, i), g = load_pack<W>(gate, i), u = load_pack<W>(up, i), dg_out, du_out;
        for (int j = 0; j < W; j++) {  // written, not added to (as reference_cpu's swiglu_backward)
            float dg, du;
            swiglu_grads(to_f32(dy.v[j]), to_f32(g.v[j]), to_f32(u.v[j]), &dg, &du);
            dg_out.v[j] = from_f32<T>(dg);
            du_out.v[j] = from_f32<T>(du);
        }
        store_pack<W>(dgate, i, dg_out);
        store_pack<W>(dup, i, du_out);
    }
}

template <typename T> static void launch_swiglu_forward(T *out, const T *gate, const T *up, size_t n) {
    constexpr int W = 16 / sizeof(T);
    size_t v = vector_part(n, W, aligned(out, 16) && aligned(gate, 16) && aligned(up, 16));
    LAUNCH_1D((swiglu_forward_kernel<T, W>), v / W, out, gate, up, v / W);
    LAUNCH_1D((swiglu_forward_kernel<T, 1>), n - v, out + v, gate + v, up + v, n - v);
}
template <typename T>
static void launch_swiglu_backward(T *dgate, T *dup, const T *dout, const T *gate, const T *up, size_t n) {
    constexpr int W = 16 / sizeof(T);
    size_t v = vector_part(n, W, aligned(dgate, 16) && aligned(dup, 16) && aligned(dout, 16) && aligned(gate, 16) &&
                                     aligned(up, 16));
    LAUNCH_1D((swiglu_backward_kernel<T, W>), v / W, dgate, dup, dout, gate, up, v / W);
    LAUNCH_1D((swiglu_backward_kernel<T, 1>), n - v, dgate + v, dup + v, dout + v, gate + v, up + v, n - v);
}

extern "C" void gpu_swiglu_forward(float *out, const float *gate, const float *up, size_t n) {
    launch_swiglu_forward(out, gate, up, n);
}
extern "C" void gpu_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                    size_t n) {
    launch_swiglu_backward(dgate, dup, dout, gate, up, n);
}
extern "C" void gpu_swiglu_forward_bf16(gpu_bf16 *out, const gpu_bf16 *gate, const gpu_bf16 *up, size_t n) {
    launch_swiglu_forward(out, gate, up, n);
}
extern "C" void gpu_swiglu_backward_bf16(gpu_bf16 *dgate, gpu_bf16 *dup, const gpu_bf16 *dout, const gpu_bf16 *gate,
                                         const gpu_bf16 *up, size_t n) {
    launch_swiglu_backward(dgate, dup, dout, gate, up, n);
}

// ================================ cross-entropy ==================================================
// stats (N,2): block per row of logits (N,V): the row's max, then log of the sum of exp(x - max) (the
// sum in double, as the reference), kept apart (ops.h: their fp32 sum rounds at the max's scale).
template <typename T, int W>
__global__ void cross_entropy_stats_kernel(float *stats, const T *logits, int V) {
    __shared__ float max_scratch[32];
    __shared__ double sum_scratch[32];
    const T *x = logits + (size_t)blockIdx.x * V;
    float row_max = -INFINITY;
    for_my_elements<W>(x, V, [&](float v) { row_max = fmaxf(row_max, v); });
    row_max = block_max(row_max, max_scratch);
    double sum = 0;
    for_my_elements<W>(x, V, [&](float v) { sum += expf(v - row_max); });
    sum = block_sum(sum, sum_scratch);
    if (threadIdx.x == 0) stats[2 * blockIdx.x] = row_max, stats[2 * blockIdx.x + 1] = (float)log(sum);
}

// What the loss kernel hands back to the host.
typedef struct {
    double total;  // sum over valid rows of (max - logit[target]) + log-sum
    int n_valid;
    int bad_row;   // first row whose target is neither IGNORE_INDEX nor in [0, V); INT_MAX if none
} LossSum;

// One block: each thread sums its rows n = tid, tid + blockDim, ... in order, then a fixed tree.
// Writes the sums to *result (for the host), or the mean to *loss (left on the device): NaN if a
// target was out of range, 0 if every target is ignored.
template <typename T>
__global__ void cross_entropy_loss_kernel(LossSum *result, double *loss, const float *stats, const T *logits,
                                          const int *targets, int N, int V) {
    __shared__ double total_scratch[32];
    __shared__ int count_scratch[32];
    __shared__ int bad_row;
    if (threadIdx.x == 0) bad_row = INT_MAX;
    __syncthreads();
    double total = 0;
    int count = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        int t = targets[n];
        if (t == IGNORE_INDEX) continue;
        if (t < 0 || t >= V) {
            atomicMin(&bad_row, n);  // an error report, not data: its order does not matter
            continue;
        }
        total += ((double)stats[2 * n] - to_f32(logits[(size_t)n * V + t])) + stats[2 * n + 1];
        count++;
    }
    total = block_sum(total, total_scratch);
    count = block_sum(count, count_scratch);  // its barriers also order the atomicMin before the read
    if (threadIdx.x == 0 && result) {
        result->total = total;
        result->n_valid = count;
        result->bad_row = bad_row;
    }
    if (threadIdx.x == 0 && loss) *loss = bad_row != INT_MAX ? (double)NAN : count ? total / count : 0.0;
}

template <typename T> static void launch_stats(float *stats, const T *logits, int N, int V) {
    if (rows_packed<T>({logits}, V))
        GPU_LAUNCH((cross_entropy_stats_kernel<T, 16 / sizeof(T)>), N, ROW_THREADS, 0, stats, logits, V);
    else GPU_LAUNCH((cross_entropy_stats_kernel<T, 1>), N, ROW_THREADS, 0, stats, logits, V);
}

template <typename T>
static double launch_cross_entropy_forward(float *stats, const T *logits, const int *targets, int N, int V) {
    if (N == 0) return 0.0;
    launch_stats(stats, logits, N, V);
    LossSum *d_sum = (LossSum *)gpu_scratch_alloc(sizeof(LossSum));
    LossSum sum;
    GPU_LAUNCH(cross_entropy_loss_kernel<T>, 1, 1024, 0, d_sum, (double *)NULL, stats, logits, targets, N, V);
    gpu_download(&sum, d_sum, sizeof sum);
    gpu_scratch_free(d_sum);
    if (sum.bad_row != INT_MAX) fatal("cross-entropy: the target of row %d is outside [0, %d)", sum.bad_row, V);
    return sum.n_valid ? sum.total / sum.n_valid : 0.0;
}

// The same two kernels, the mean left in *loss (device): nothing comes back to the host.
template <typename T>
static void launch_cross_entropy_forward_into(double *loss, float *stats, const T *logits, const int *targets, int N,
                                              int V) {
    if (N == 0) {
        gpu_fill_bytes(loss, 0, sizeof(double));  // all-zero bytes: 0.0
        return;
    }
    launch_stats(stats, logits, N, V);
    GPU_LAUNCH(cross_entropy_loss_kernel<T>, 1, 1024, 0, (LossSum *)NULL, loss, stats, logits, targets, N, V);
}

__global__ void count_valid_targets_kernel(int *n_valid, const int *targets, int N) {
    __shared__ int scratch[32];
    int count = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) count += targets[n] != IGNORE_INDEX;
    count = block_sum(count, scratch);
    if (threadIdx.x == 0) *n_valid = count;
}

// dlogits (N,V) = dloss / n_valid * (softmax(x) - onehot(target)), block per row, written (not
// added to: no fill before it, and dlogits is not read); an ignored row is written 0. The target's
// element gets both terms in the reference's order before its one store.
// Vocab-parallel: the row's columns are vocabulary entries [v_start, v_start + V) (0 otherwise).
// softmax = exp((x - max) - log-sum), from the stats. In packs of W elements as the stats kernel; each
// element's arithmetic is the same for every W.
template <typename T, int W>
__global__ void cross_entropy_backward_kernel(T *dlogits, const T *logits, const float *stats, const int *targets,
                                              const int *n_valid, int v_start, int V, double dloss) {
    int t = targets[blockIdx.x];
    T *dx = dlogits + (size_t)blockIdx.x * V;
    if (t == IGNORE_INDEX) {  // every row is, where n_valid is 0
        Pack<T, W> zeros;
#pragma unroll
        for (int k = 0; k < W; k++) zeros.v[k] = from_f32<T>(0.0f);
        for (int p = threadIdx.x; p < V / W; p += blockDim.x) store_pack<W>(dx, p, zeros);
        return;
    }
    float coef = (float)(dloss / *n_valid), row_max = stats[2 * blockIdx.x], log_sum = stats[2 * blockIdx.x + 1];
    const T *x = logits + (size_t)blockIdx.x * V;
    for (int p = threadIdx.x; p < V / W; p += blockDim.x) {
        Pack<T, W> xv = load_pack<W>(x, p), dv;
#pragma unroll
        for (int k = 0; k < W; k++) {
            float g = coef * expf((to_f32(xv.v[k]) - row_max) - log_sum);
            if (p * W + k + v_start == t) g -= coef;
            dv.v[k] = from_f32<T>(g);
        }
        store_pack<W>(dx, p, dv);
    }
}

template <typename T>
static void launch_cross_entropy_backward(T *dlogits, const T *logits, const float *stats, const int *targets, int N,
                                          int V, double dloss, int v_start = 0) {
    if (N == 0) return;
    int *n_valid = (int *)gpu_scratch_alloc(sizeof(int));
    GPU_LAUNCH(count_valid_targets_kernel, 1, 1024, 0, n_valid, targets, N);
    if (rows_packed<T>({dlogits, logits}, V))
        GPU_LAUNCH((cross_entropy_backward_kernel<T, 16 / sizeof(T)>), N, ROW_THREADS, 0, dlogits, logits, stats,
                   targets, n_valid, v_start, V, dloss);
    else GPU_LAUNCH((cross_entropy_backward_kernel<T, 1>), N, ROW_THREADS, 0, dlogits, logits, stats, targets, n_valid,
                    v_start, V, dloss);
    gpu_scratch_free(n_valid);
}

// ---- vocab-parallel (tensor parallelism): the row's statistics summed over the tp group between kernels ----
// row_max (N): block per row, the max over this rank's columns (in packs of W, as above).
template <int W> __global__ void vocab_parallel_row_max_kernel(float *row_max, const gpu_bf16 *logits, int V) {
    __shared__ float scratch[32];
    const gpu_bf16 *x = logits + (size_t)blockIdx.x * V;
    float best = -INFINITY;
    for_my_elements<W>(x, V, [&](float v) { best = fmaxf(best, v); });
    best = block_max(best, scratch);
    if (threadIdx.x == 0) row_max[blockIdx.x] = best;
}

// sums (2, N): block per row, this rank's sum of exp(x - row_max) in double (cross_entropy_stats_kernel's
// arithmetic), and the target's logit where this rank holds it (0 elsewhere: the sum over ranks is it).
template <int W>
__global__ void vocab_parallel_sums_kernel(double *sums, const gpu_bf16 *logits, const float *row_max,
                                           const int *targets, int N, int v_start, int V) {
    __shared__ double scratch[32];
    int n = blockIdx.x, t = targets[n];
    const gpu_bf16 *x = logits + (size_t)n * V;
    const float m = row_max[n];
    double sum = 0;
    for_my_elements<W>(x, V, [&](float v) { sum += expf(v - m); });
    sum = block_sum(sum, scratch);
    if (threadIdx.x != 0) return;
    sums[n] = sum;
    bool here = t != IGNORE_INDEX && t >= v_start && t < v_start + V;
    sums[N + n] = here ? (double)to_f32(x[t - v_start]) : 0.0;
}

// One block: stats (N,2) = (max, log(sum)) per row, and the mean of (max - target logit) + log-sum
// (cross_entropy_loss_kernel's arithmetic and order).
__global__ void vocab_parallel_loss_kernel(double *loss, float *stats, const float *row_max, const double *sums,
                                           const int *targets, int N) {
    __shared__ double total_scratch[32];
    __shared__ int count_scratch[32];
    double total = 0;
    int count = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        stats[2 * n] = row_max[n], stats[2 * n + 1] = (float)log(sums[n]);
        if (targets[n] == IGNORE_INDEX) continue;
        total += ((double)row_max[n] - (float)sums[N + n]) + stats[2 * n + 1];
        count++;
    }
    total = block_sum(total, total_scratch);
    count = block_sum(count, count_scratch);
    if (threadIdx.x == 0) *loss = count ? total / count : 0.0;
}

extern "C" void gpu_vocab_parallel_row_max_bf16(float *row_max, const gpu_bf16 *logits, int N, int v_count) {
    if (N == 0) return;
    if (rows_packed<gpu_bf16>({logits}, v_count))
        GPU_LAUNCH(vocab_parallel_row_max_kernel<8>, N, ROW_THREADS, 0, row_max, logits, v_count);
    else GPU_LAUNCH(vocab_parallel_row_max_kernel<1>, N, ROW_THREADS, 0, row_max, logits, v_count);
}
extern "C" void gpu_vocab_parallel_sums_bf16(double *sums, const gpu_bf16 *logits, const float *row_max,
                                             const int *targets, int N, int v_start, int v_count) {
    if (N == 0) return;
    if (rows_packed<gpu_bf16>({logits}, v_count))
        GPU_LAUNCH(vocab_parallel_sums_kernel<8>, N, ROW_THREADS, 0, sums, logits, row_max, targets, N, v_start, v_count);
    else GPU_LAUNCH(vocab_parallel_sums_kernel<1>, N, ROW_THREADS, 0, sums, logits, row_max, targets, N, v_start,
                    v_count);
}
extern "C" void gpu_vocab_parallel_loss(double *loss, float *stats, const float *row_max, const double *sums,
                                        const int *targets, int N) {
    if (N == 0) {
        gpu_fill_bytes(loss, 0, sizeof(double));  // all-zero bytes: 0.0
        return;
    }
    GPU_LAUNCH(vocab_parallel_loss_kernel, 1, 1024, 0, loss, stats, row_max, sums, targets, N);
}
extern "C" void gpu_cross_entropy_backward_columns_bf16(gpu_bf16 *dlogits, const gpu_bf16 *logits, const float *stats,
                                                        const int *targets, int N, int v_start, int v_count,
                                                        double dloss) {
    launch_cross_entropy_backward(dlogits, logits, stats, targets, N, v_count, dloss, v_start);
}

extern "C" double gpu_cross_entropy_forward(float *stats, const float *logits, const int *targets, int N, int V) {
    return launch_cross_entropy_forward(stats, logits, targets, N, V);
}
extern "C" void gpu_cross_entropy_forward_into(double *loss, float *stats, const float *logits, const int *targets,
                                               int N, int V) {
    launch_cross_entropy_forward_into(loss, stats, logits, targets, N, V);
}
extern "C" void gpu_cross_entropy_forward_into_bf16(double *loss, float *stats, const gpu_bf16 *logits,
                                                    const int *targets, int N, int V) {
    launch_cross_entropy_forward_into(loss, stats, logits, targets, N, V);
}
extern "C" void gpu_cross_entropy_backward(float *dlogits, const float *logits, const float *stats, const int *targets,
                                           int N, int V, double dloss) {
    launch_cross_entropy_backward(dlogits, logits, stats, targets, N, V, dloss);
}
extern "C" double gpu_cross_entropy_forward_bf16(float *stats, const gpu_bf16 *logits, const int *targets, int N,
                                                 int V) {
    return launch_cross_entropy_forward(stats, logits, targets, N, V);
}
extern "C" void gpu_cross_entropy_backward_bf16(gpu_bf16 *dlogits, const gpu_bf16 *logits, const float *stats,
                                                const int *targets, int N, int V, double dloss) {
    launch_cross_entropy_backward(dlogits, logits, stats, targets, N, V, dloss);
}

// ================================ element-wise ===================================================

// Over n_packs packs of W elements (16-byte vectors above).
template <typename T, int W>
__global__ void add_inplace_kernel(T *x, const T *y, size_t n_packs) {
    GRID_STRIDE_LOOP(i, n_packs) {
        Pack<T, W> a = load_pack<W>(x, i), b = load_pack<W>(y, i);
        for (int j = 0; j < W; j++) a.v[j] = from_f32<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
        store_pack<W>(x, i, a);
    }
}
// Packs of W elements of both types: 16 bytes of the wider one.
template <typename Out, typename In, int W>
__global__ void cast_kernel(Out *out, const In *inp, size_t n_packs) {
    GRID_STRIDE_LOOP(i, n_packs) {
        Pack<In, W> a = load_pack<W>(inp, i);
        Pack<Out, W> b;
        for (int j = 0; j < W; j++) b.v[j] = from_f32<Out>(to_f32(a.v[j]));
        store_pack<W>(out, i, b);
    }
}

// out = bf16(residual + partial), packs of 8 (16 bytes of bf16; the fp32 operand 32).
template <int W>
__global__ void add_f32_into_bf16_kernel(gpu_bf16 *out, const gpu_bf16 *residual, const float *partial,
                                         size_t n_packs) {
    GRID_STRIDE_LOOP(i, n_packs) {
        Pack<gpu_bf16, W> r = load_pack<W>(residual, i), o;
        Pack<float, W> p = load_pack<W>(partial, i);
        for (int j = 0; j < W; j++) o.v[j] = from_f32<gpu_bf16>(to_f32(r.v[j]) + p.v[j]);
        store_pack<W>(out, i, o);
    }
}

template <typename T> static void launch_add_inplace(T *x, const T *y, size_t n) {
    constexpr int W = 16 / sizeof(T);
    size_t v = vector_part(n, W, aligned(x, 16) && aligned(y, 16));
    LAUNCH_1D((add_inplace_kernel<T, W>), v / W, x, y, v / W);
    LAUNCH_1D((add_inplace_kernel<T, 1>), n - v, x + v, y + v, n - v);
}
template <typename Out, typename In> static void launch_cast(Out *out, const In *inp, size_t n) {
    constexpr int W = 16 / (sizeof(Out) > sizeof(In) ? sizeof(Out) : sizeof(In));
    size_t v = vector_part(n, W, aligned(out, sizeof(Out) * W) && aligned(inp, sizeof(In) * W));
    LAUNCH_1D((cast_kernel<Out, In, W>), v / W, out, inp, v / W);
    LAUNCH_1D((cast_kernel<Out, In, 1>), n - v, out + v, inp + v, n - v);
}

extern "C" void gpu_add_inplace(float *x, const float *y, size_t n) { launch_add_inplace(x, y, n); }
extern "C" void gpu_add_inplace_bf16(gpu_bf16 *x, const gpu_bf16 *y, size_t n) { launch_add_inplace(x, y, n); }
extern "C" void gpu_cast_f32_to_bf16(gpu_bf16 *out, const float *inp, size_t n) { launch_cast(out, inp, n); }
extern "C" void gpu_cast_bf16_to_f32(float *out, const gpu_bf16 *inp, size_t n) { launch_cast(out, inp, n); }
extern "C" void gpu_add_f32_into_bf16(gpu_bf16 *out, const gpu_bf16 *residual, const float *partial, size_t n) {
    constexpr int W = 8;
    size_t v = vector_part(n, W, aligned(out, 16) && aligned(residual, 16) && aligned(partial, 32));
    LAUNCH_1D((add_f32_into_bf16_kernel<W>), v / W, out, residual, partial, v / W);
    LAUNCH_1D((add_f32_into_bf16_kernel<1>), n - v, out + v, residual + v, partial + v, n - v);
}

// ================================ AdamW ==========================================================

// One pass: read param, grad, m, v; write param, m, v (and the bf16 copy). The scalars of the step
// are computed once on the host, in double, and rounded to float as reference_cpu/adamw.c does.
// With sum_sq (device), the gradient is clipped on the way in: every thread derives the same
// factor from the global norm, as clip_by_global_norm computes it (in double, used as float).
template <bool WRITE_BF16>
__global__ void adamw_kernel(float *params, bf16 *params_bf16, const float *grads, float *m, float *v, size_t n,
                             AdamWScalars s, const double *sum_sq, double max_norm) {
    float clip = 1.0f;
    if (sum_sq && max_norm > 0) {
        double coef = max_norm / (sqrt(*sum_sq) + 1e-6);
        if (coef < 1) clip = (float)coef;
    }
    GRID_STRIDE_LOOP(i, n) {
        float p = params[i], mi = m[i], vi = v[i];
        adamw_update(&p, &mi, &vi, grads[i] * clip, s);  // x * 1.0f == x: no clip is exact
        params[i] = p, m[i] = mi, v[i] = vi;
        if (WRITE_BF16) params_bf16[i] = from_f32<bf16>(p);
    }
}

static AdamWScalars scalars_of(long long step, double lr, const AdamWConfig *cfg) {
    return adamw_scalars(step, lr, cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay);
}
extern "C" void gpu_adamw_step(float *params, const float *grads, float *m, float *v, size_t n, long long step,
                               double lr, const AdamWConfig *cfg) {
    LAUNCH_1D(adamw_kernel<false>, n, params, NULL, grads, m, v, n, scalars_of(step, lr, cfg), NULL, 0.0);
}
extern "C" void gpu_adamw_step_bf16_copy(float *params, gpu_bf16 *params_bf16, const float *grads, float *m, float *v,
                                         size_t n, long long step, double lr, const AdamWConfig *cfg) {
    LAUNCH_1D(adamw_kernel<true>, n, params, params_bf16, grads, m, v, n, scalars_of(step, lr, cfg), NULL, 0.0);
}
extern "C" void gpu_adamw_step_clipped(float *params, gpu_bf16 *params_bf16, const float *grads, float *m, float *v,
                                       size_t n, long long step, double lr, const AdamWConfig *cfg,
                                       const double *sum_sq, double max_norm) {
    if (params_bf16)
        LAUNCH_1D(adamw_kernel<true>, n, params, params_bf16, grads, m, v, n, scalars_of(step, lr, cfg), sum_sq,
                  max_norm);
    else
        LAUNCH_1D(adamw_kernel<false>, n, params, NULL, grads, m, v, n, scalars_of(step, lr, cfg), sum_sq, max_norm);
}

// ================================ gradient clipping ==============================================

#define SUM_SQ_BLOCKS 1024  // partial sums; fixed, so the order of the additions depends only on n

// Block b sums its contiguous chunk [b*chunk, (b+1)*chunk) in double, then a fixed tree.
__global__ void sum_of_squares_partial_kernel(double *partial, const float *x, size_t n, size_t chunk) {
    __shared__ double scratch[32];
    size_t first = blockIdx.x * chunk, end = min(first + chunk, n);
    double sum = 0;
    for (size_t i = first + threadIdx.x; i < end; i += blockDim.x) sum += (double)x[i] * x[i];
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}
__global__ void sum_partials_kernel(double *total, const double *partial, int n) {
    __shared__ double scratch[32];
    double sum = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += partial[i];
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) *total = sum;
}
__global__ void scale_kernel(float *x, size_t n, float factor) {
    GRID_STRIDE_LOOP(i, n) x[i] *= factor;
}

extern "C" void gpu_sum_of_squares_into(double *sum_sq, const float *x, size_t n) {
    if (n == 0) {
        gpu_fill_bytes(sum_sq, 0, sizeof(double));
        return;
    }
    double *partial = (double *)gpu_scratch_alloc(sizeof(double) * SUM_SQ_BLOCKS);
    size_t chunk = (n + SUM_SQ_BLOCKS - 1) / SUM_SQ_BLOCKS;
    GPU_LAUNCH(sum_of_squares_partial_kernel, SUM_SQ_BLOCKS, 256, 0, partial, x, n, chunk);
    GPU_LAUNCH(sum_partials_kernel, 1, 1024, 0, sum_sq, partial, SUM_SQ_BLOCKS);
    gpu_scratch_free(partial);
}

extern "C" double gpu_sum_of_squares(const float *x, size_t n) {
    double *d_total = (double *)gpu_scratch_alloc(sizeof(double)), total;
    gpu_sum_of_squares_into(d_total, x, n);
    gpu_download(&total, d_total, sizeof total);
    gpu_scratch_free(d_total);
    return total;
}

extern "C" void gpu_scale_inplace(float *x, size_t n, double factor) {
    LAUNCH_1D(scale_kernel, n, x, n, (float)factor);  // reference_cpu: real f = (real)factor
}
