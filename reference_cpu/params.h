// params.h: the named parameter table. Every later module (FSDP, TP, PP, checkpoints, dumps)
// works off this table, never off hand-written per-tensor code.
//
// Names follow Meta's Llama checkpoints (as torchtitan does):
//   tok_embeddings.weight                 (vocab, dim)
//   layers.{i}.attention_norm.weight      (dim)
//   layers.{i}.attention.wq.weight        (n_heads*head_dim, dim)      y = x W^T
//   layers.{i}.attention.wk.weight        (n_kv_heads*head_dim, dim)
//   layers.{i}.attention.wv.weight        (n_kv_heads*head_dim, dim)
//   layers.{i}.attention.wo.weight        (dim, n_heads*head_dim)
//   layers.{i}.ffn_norm.weight            (dim)
//   layers.{i}.feed_forward.w1.weight     (ffn_dim, dim)   gate
//   layers.{i}.feed_forward.w2.weight     (dim, ffn_dim)   down
//   layers.{i}.feed_forward.w3.weight     (ffn_dim, dim)   up
//   norm.weight                           (dim)
//   output.weight                         (vocab, dim)     absent when tied
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "reference_cpu/config.h"
#include "reference_cpu/real.h"

#define PARAM_NAME_MAX 64
#define LAYER_EMBEDDING (-1)  // `layer` of tok_embeddings; norm and output use layer = n_layers

// Which dimension Megatron tensor parallelism splits (later chapters): rows = output features of a
// column-parallel linear (wq wk wv w1 w3) and the vocab of the embedding/output; cols = input
// features of a row-parallel linear (wo w2); none = replicated (norm weights).
typedef enum { TP_NONE = -1, TP_ROWS = 0, TP_COLS = 1 } TpSplit;

// The kinds of per-parameter state a layout holds in the table's flat layout: what checkpoints save
// (weights and AdamW's two moments) and what --grad-dump writes (gradients).
typedef enum { STATE_WEIGHTS, STATE_ADAM_M, STATE_ADAM_V, STATE_GRADS } StateKind;
#define N_CHECKPOINT_STATES 3  // STATE_WEIGHTS, STATE_ADAM_M, STATE_ADAM_V

typedef enum { INIT_ONES, INIT_NORMAL } ParamInit;

typedef struct {
    char name[PARAM_NAME_MAX];
    int ndim;         // 1 or 2
    int shape[2];     // row-major; shape[1] unused when ndim == 1
    size_t numel;
    size_t offset;    // into the flat parameter (and gradient) buffer, in elements
    int layer;        // LAYER_EMBEDDING, 0..n_layers-1, or n_layers for the final norm and output
    TpSplit tp_split;
    ParamInit init;
    double init_std;  // INIT_NORMAL only
} ParamInfo;

typedef struct {
    ParamInfo *items;
    int count;
    size_t total_numel;
} ParamTable;

// Builds the table in the order above. Index of each block's first and one-past-last entry
// are found with param_table_layer_range.
ParamTable param_table_build(const ModelConfig *c);
void param_table_free(ParamTable *t);
// The table of one tensor-parallel rank: the same entries, with the TP_ROWS / TP_COLS dimension
// divided by tp_size (exits 2 if tp_size does not divide the heads, kv heads, ffn_dim, vocab).
ParamTable param_table_build_tp(const ModelConfig *c, int tp_size);
void param_check_tp(const ModelConfig *c, int tp_size);  // that refusal alone, before any table is built
// The rule param_check_tp enforces, as a message (NULL: tp_size splits c): for callers that report
// instead of exiting (chapter 11's planner).
const char *param_tp_rule(const ModelConfig *c, int tp_size);
const ParamInfo *param_table_find(const ParamTable *t, const char *name);  // NULL if absent

// The seven projections of a block, in a fixed order (FP8 keeps its scales per layer and projection),
// and each one's parameter name within its block: projection_param_name(PROJ_WQ) is
// "attention.wq.weight", the table's entry "layers.<l>.attention.wq.weight".
typedef enum { PROJ_WQ, PROJ_WK, PROJ_WV, PROJ_WO, PROJ_W1, PROJ_W2, PROJ_W3, N_PROJ } Projection;
const char *projection_param_name(Projection p);
void param_table_layer_range(const ParamTable *t, int layer, int *first, int *end);

// Where a rank's initial weights come from. Every module that builds weights (the model, FSDP's
// shards, pipeline stages) asks for exactly the elements it holds, with one call whose contract is
// param_init_local_range's: elements [first, first + count) of tp rank tp_rank's shard of p. The
// seed is the default source; a checkpoint reader is another (hf_param_source, reference_cpu/hf.h),
// which then reads only those elements.
typedef struct ParamSource ParamSource;
struct ParamSource {
    void (*fill)(const ParamSource *src, const ParamInfo *p, int tp_rank, int tp_size, size_t first, size_t count,
                 real *out);
    uint64_t seed;    // the seed source's
    const void *ctx;  // another source's state (an open checkpoint)
};
ParamSource param_source_seed(uint64_t seed);
static inline void param_source_fill(const ParamSource *src, const ParamInfo *p, int tp_rank, int tp_size,
                                     size_t first, size_t count, real *out) {
    src->fill(src, p, tp_rank, tp_size, first, count, out);
}

// Init std: normal(0, 0.02) for embeddings and input projections; wo and w2 (the projections that
// write into the residual stream) use 0.02 / sqrt(2 * n_layers), as GPT-2 and torchtitan do; norms 1.
// Element j of parameter p gets  std * rng_normal(seed, hash(p.name), j): the value does not
// depend on which rank builds it or how the tensor is sharded.
real param_init_value(const ParamInfo *p, uint64_t seed, size_t element_index);
void param_init_range(const ParamInfo *p, uint64_t seed, size_t first, size_t count, real *out);
// The same for elements [first, first + count) of tensor-parallel rank tp_rank's shard of p (p from
// param_table_build_tp): each element gets the value of the element it is in the full tensor.
void param_init_local_range(const ParamInfo *p, int tp_rank, int tp_size, uint64_t seed, size_t first, size_t count,
                            real *out);
