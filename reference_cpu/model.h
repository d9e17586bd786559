// model.h: the Llama 3 model as per-block functions on explicit tensors.
//
//   x0 = tok_embeddings[inputs]                                   (B*T, dim)
//   for each block l:  x_{l+1} = block_forward(l, x_l)
//       h   = x + wo( attention( rope(wq(n1)), rope(wk(n1)), wv(n1) ) ),   n1 = rmsnorm(x, attention_norm)
//       out = h + w2( silu(w1(n2)) * w3(n2) ),                              n2 = rmsnorm(h, ffn_norm)
//   logits = output( rmsnorm(x_L, norm) )                         (B*T, vocab)
//   loss   = mean cross-entropy over targets != IGNORE_INDEX
//
// The blocks read their weights through BlockWeights (pointers into any flat buffer laid out by the
// parameter table), so later chapters can run a block on gathered shards, on a pipeline stage,
// or recompute it in backward without touching the math.
#pragma once
#include <stdbool.h>

#include "reference_cpu/config.h"
#include "reference_cpu/ops.h"
#include "reference_cpu/params.h"

typedef enum { ATTN_FLASH, ATTN_NAIVE } AttentionImpl;

// Called by model_backward as soon as the gradients of every parameter owned by `layer` are final
// for this backward (order: n_layers (final norm, output), n_layers-1, ..., 0, LAYER_EMBEDDING).
// Data parallelism starts communicating a bucket of gradients from here, while backward goes on.
typedef void (*GradsReadyHook)(int layer, void *ctx);

typedef struct {
    ModelConfig cfg;
    ParamTable table;
    real *params;  // (table.total_numel) fp32 master weights (float64 in the float64 build)
    real *grads;   // (table.total_numel), same layout
    RopeTable rope;
    AttentionImpl attention;
    GradsReadyHook grads_ready;  // NULL: no hook
    void *grads_ready_ctx;
} Model;

// Pointers to one block's tensors inside a flat buffer laid out by the table (params or grads).
typedef struct {
    real *attention_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w2, *w3;
} BlockWeights;

// Everything one block keeps from forward for backward, for B*T tokens.
typedef struct {
    real *x;             // (BT, dim) block input
    real *xn1, *rstd1;   // (BT, dim) attention_norm output, (BT)
    real *q, *k, *v;     // (BT, n_heads*hd), (BT, n_kv*hd) x2, after RoPE
    real *attn;          // (BT, n_heads*hd) attention output, before wo
    real *attn_stats;    // flash: lse (B, n_heads, T); naive: probabilities (B, n_heads, T, T)
    real *h;             // (BT, dim) residual after attention
    real *xn2, *rstd2;   // (BT, dim), (BT)
    real *gate, *up;     // (BT, ffn) w1 and w3 outputs
    real *act;           // (BT, ffn) silu(gate) * up
} BlockActs;

typedef struct {
    int B, T, n_layers;
    BlockActs *blocks;   // (n_layers)
    real *x_final;       // (BT, dim) output of the last block
    real *xn_final, *rstd_final;
    real *logits;        // (BT, vocab)
    real *lse;           // (BT) cross-entropy log-sum-exp
    const int *targets;  // of the last forward
    // backward scratch, reused by every block
    real *dx, *dx_next, *dxn, *dh, *dq, *dk, *dv, *dattn, *dgate, *dup, *dact, *dlogits;
} ModelActs;

// Allocates params and grads (MEM_PARAMS, MEM_GRADS) and initialises the weights from the seed.
void model_init(Model *m, const ModelConfig *cfg, uint64_t seed, AttentionImpl attention);
void model_free(Model *m);
BlockWeights block_weights(const Model *m, real *flat, int layer);

ModelActs model_acts_alloc(const Model *m, int B, int T);  // MEM_ACTIVATIONS
void model_acts_free(ModelActs *a);

// One block. a->x must hold the block input; writes the block output to out (BT, dim).
void block_forward(const Model *m, const BlockWeights *w, BlockActs *a, real *out, int B, int T);
// dout (BT, dim) is the gradient of the block output; writes the gradient of the block input to
// dinp (overwritten) and accumulates the weight gradients into g. Uses the scratch in acts.
void block_backward(const Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, ModelActs *scratch,
                    const real *dout, real *dinp, int B, int T);

// Whole model. inputs/targets (B*T). Returns the mean loss. acts->logits holds the logits.
double model_forward(const Model *m, ModelActs *acts, const int *inputs, const int *targets);
// Accumulates d(dloss * loss)/d(params) into m->grads (call model_zero_grads first).
void model_backward(Model *m, ModelActs *acts, const int *inputs, double dloss);
void model_zero_grads(Model *m);
