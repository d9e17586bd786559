// ops.h: every op of the Llama 3 forward and backward pass, forward and backward side by side.
// Layouts are row-major; shapes are written as (dim0, dim1, ...). Backward functions ACCUMULATE
// (+=) into their gradient outputs, so callers zero them once and residual branches just add.
// The GPU kernels (gpu/) have the same signatures.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "reference_cpu/real.h"

#define IGNORE_INDEX (-100)  // targets equal to this take no part in the loss (as in PyTorch)

// ---- matmul: the linear layer y = x W^T -----------------------------------------------------
// out (M,N) = inp (M,K) . weight(N,K)^T
void matmul_forward(real *out, const real *inp, const real *weight, int M, int K, int N);
// dinp (M,K) += dout (M,N) . weight (N,K);  dweight (N,K) += dout^T (N,M) . inp (M,K).
// Either gradient output may be NULL to skip it.
void matmul_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                     int M, int K, int N);
typedef enum { MATMUL_BLAS, MATMUL_LOOP } MatmulBackend;
#define MATMUL_BACKEND_NAMES "blas|loop"  // in enum order (the trainer's --matmul choices)
// BLAS (OpenBLAS sgemm/dgemm) is the default when the build found it; LOOP is the plain triple loop.
void matmul_set_backend(MatmulBackend backend);
MatmulBackend matmul_get_backend(void);
bool matmul_blas_available(void);
// Which BLAS kernels run, for logs: "OpenBLAS SkylakeX kernels", and whether OPENBLAS_CORETYPE was set
// because the library had chosen kernels below the CPU's instruction sets (reference_cpu/ops.c).
const char *matmul_blas_kernels(char *out, size_t out_len);
// The CPUs this process's threads may run on: those of all OpenMP places when OMP_PROC_BIND binds
// threads to places, else the process's affinity mask.
int matmul_cpus_usable(void);
int matmul_threads(void);  // OpenMP's thread count for the parallel loops and OpenBLAS (1 without OpenMP)
// FLOPs (2 M N K each) of every GEMM this process has run so far through matmul_forward/backward and
// the attention tiles, whatever the backend (naive attention's dot loops are not GEMMs: not counted):
// the trainer's per-step GEMM work.
double matmul_flops_counted(void);

// ---- embedding -------------------------------------------------------------------------------
// out (N,C) = table[tokens[n]] ; tokens (N) in [0, V)
void embedding_forward(real *out, const int *tokens, const real *table, int N, int C);
void embedding_backward(real *dtable, const real *dout, const int *tokens, int N, int C);
// A table holding rows [row_start, row_start + n_rows) of the full one (vocab-parallel): tokens
// outside it give zero rows forward and no gradient backward.
void embedding_forward_rows(real *out, const int *tokens, const real *table, int N, int C, int row_start, int n_rows);
void embedding_backward_rows(real *dtable, const real *dout, const int *tokens, int N, int C, int row_start,
                             int n_rows);

// ---- RMSNorm: out = inp / sqrt(mean(inp^2) + eps) * weight ----------------------------------
// inp, out (N,C); rstd (N) keeps 1/sqrt(mean + eps) for backward
void rmsnorm_forward(real *out, real *rstd, const real *inp, const real *weight, int N, int C, double eps);
void rmsnorm_backward(real *dinp, real *dweight, const real *dout, const real *inp, const real *weight,
                      const real *rstd, int N, int C);

// ---- RoPE (Meta's interleaved pairs: dims 2i and 2i+1 rotate together) -----------------------
// Table of (max_pos, head_dim/2) cos and sin, for frequencies theta^(-2i/head_dim), optionally
// with Llama 3.1 scaling (factor 0 = off).
typedef struct {
    int max_pos, head_dim;
    real *cos, *sin;  // (max_pos, head_dim/2)
} RopeTable;
RopeTable rope_table_build(int max_pos, int head_dim, double theta, double scaling_factor,
                           double low_freq_factor, double high_freq_factor, int original_max_pos);
void rope_table_free(RopeTable *t);
// x (B,T,n_heads,head_dim) rotated in place; positions (T) or NULL for 0..T-1
void rope_forward(real *x, const RopeTable *t, const int *positions, int B, int T, int n_heads);
// dx (B,T,n_heads,head_dim) rotated back in place (the transpose of the rotation)
void rope_backward(real *dx, const RopeTable *t, const int *positions, int B, int T, int n_heads);

// ---- attention (causal, GQA) -------------------------------------------------------------------
// q (B,Tq,n_heads,hd), k and v (B,Tk,n_kv_heads,hd), out (B,Tq,n_heads,hd). Query head h reads
// kv head h / (n_heads / n_kv_heads). Scale 1/sqrt(hd). With causal, query i sees key j only if
// k_pos[j] <= q_pos[i] (positions NULL = 0..T-1): explicit positions let ring attention reuse
// these functions on chunks of the sequence.
typedef struct {
    int B, Tq, Tk, n_heads, n_kv_heads, head_dim;
    const int *q_pos, *k_pos;
    bool causal;
} AttnShape;
// Naive: materialises the (B,n_heads,Tq,Tk) probabilities, kept for backward.
void attention_naive_forward(real *out, real *probs, const real *q, const real *k, const real *v,
                             const AttnShape *s);
void attention_naive_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                              const real *v, const real *probs, const AttnShape *s);
// Blockwise with online softmax (FlashAttention-2 order): never holds more than a tile of scores;
// returns lse (B,n_heads,Tq), the log-sum-exp of each query's scores (-inf if it saw no key).
// Backward recomputes the probabilities from q, k and lse.
void attention_flash_forward(real *out, real *lse, const real *q, const real *k, const real *v,
                             const AttnShape *s);
void attention_flash_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                              const real *v, const real *out, const real *lse, const AttnShape *s);

// ---- SwiGLU: out = silu(gate) * up -----------------------------------------------------------
void swiglu_forward(real *out, const real *gate, const real *up, size_t n);
// dgate, dup (n) are written, not added to: gate and up are used once, so nothing accumulates into them.
void swiglu_backward(real *dgate, real *dup, const real *dout, const real *gate, const real *up, size_t n);

// ---- cross-entropy, mean over targets != IGNORE_INDEX ----------------------------------------
// logits (N,V), targets (N). stats (N,2) keeps, for backward, each row's max and the log of its sum
// of exp(logit - max), apart: their sum (the log-sum-exp) rounded to fp32 would round at the max's
// scale (an ulp of 6e-5 at logits of 1e3). Returns the mean of (max - target logit) + log-sum, in
// double (0 if every target is ignored).
double cross_entropy_forward(real *stats, const real *logits, const int *targets, int N, int V);
// dlogits (N,V) = dloss * (softmax(logits) - onehot(target)) / n_valid, written (not added to: the
// logits are used once, so nothing accumulates into their gradient); rows whose target is ignored
// are written 0. softmax = exp((logit - max) - log-sum), from the forward's stats.
void cross_entropy_backward(real *dlogits, const real *logits, const real *stats, const int *targets,
                            int N, int V, double dloss);
// The same for the vocabulary columns [v_start, v_start + v_count) alone (a tensor-parallel shard:
// logits and dlogits are (N, v_count)), with the full rows' stats; targets are full-vocabulary ids.
void cross_entropy_backward_columns(real *dlogits, const real *logits, const real *stats, const int *targets, int N,
                                    int v_start, int v_count, double dloss);

// ---- element-wise helpers --------------------------------------------------------------------
void add_inplace(real *x, const real *y, size_t n);  // x += y
void zero_fill(real *x, size_t n);  // x = 0, the threads writing one share each
void copy_fill(real *dst, const real *src, size_t n);  // dst = src, likewise
