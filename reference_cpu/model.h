// model.h: the Llama 3 model as per-block functions on explicit tensors.
//
//   x0 = tok_embeddings[inputs]                                   (B*T, dim)
//   for each block l:  x_{l+1} = block_forward(l, x_l)
//       h   = x + wo( attention( rope(wq(n1)), rope(wk(n1)), wv(n1) ) ),   n1 = rmsnorm(x, attention_norm)
//       out = h + w2( silu(w1(n2)) * w3(n2) ),                              n2 = rmsnorm(h, ffn_norm)
//   logits = output( rmsnorm(x_L, norm) )                         (B*T, vocab)
//   loss   = mean cross-entropy over targets != IGNORE_INDEX
//
// Units. The parameters are grouped into units, the `layer` of the parameter table: the embedding
// (LAYER_EMBEDDING), each block (0..n_layers-1) and the head (n_layers: final norm and output).
// Each unit is one contiguous range of the table's flat layout, and the model only ever asks for a
// whole unit, through UnitStorage: by default the unit's range of m->params / m->grads; FSDP
// (chapter 3) installs storage that all-gathers a unit's shards before use and frees them after.
// The blocks read their weights through BlockWeights, pointers into a unit's buffer, so the same
// math runs on full weights, on gathered shards, on a pipeline stage, or in a recompute.
//
// Activation checkpointing (chapter 5) is a property of the activations: ModelActs allocated with
// AC_FULL keeps only each block's input and recomputes the block's forward in backward;
// AC_SELECTIVE keeps the matmul outputs and recomputes the cheap element-wise ops. The recompute
// runs the same functions on the same inputs, so the gradients are bit-identical.
#pragma once
#include <stdbool.h>

#include "reference_cpu/config.h"
#include "reference_cpu/ops.h"
#include "reference_cpu/params.h"

typedef enum { ATTN_FLASH, ATTN_NAIVE } AttentionImpl;
#define ATTENTION_IMPL_NAMES "flash|naive"  // in enum order (the trainer's --attention choices)

// Called by model_backward as soon as the gradients of every parameter owned by `layer` are final
// for this backward (order: n_layers (final norm, output), n_layers-1, ..., 0, LAYER_EMBEDDING).
// Data parallelism starts communicating a bucket of gradients from here, while backward goes on.
typedef void (*GradsReadyHook)(int layer, void *ctx);

typedef enum { PASS_FORWARD, PASS_BACKWARD } ModelPass;

// Where the model finds a unit's weights and gradients. Every call names the unit (a table
// `layer`). The pointers returned address the unit's first parameter; the unit's tensors follow in
// table order (unit-relative offsets: ParamInfo.offset - unit_offset).
typedef struct {
    // The unit's full weights, valid until the matching params_done.
    const real *(*params)(void *ctx, int unit, ModelPass pass);
    void (*params_done)(void *ctx, int unit, ModelPass pass);
    // Where backward accumulates (+=) the unit's gradients; final when grads_ready(unit) is called.
    real *(*grads)(void *ctx, int unit);
    void *ctx;
} UnitStorage;

// Tensor parallelism (chapter 6, Megatron). The model holds one tp rank's shards (the table from
// param_table_build_tp): wq wk wv w1 w3 and the output split by rows (this rank's heads, ffn
// columns, vocab rows), wo w2 by columns. It calls these where the partial results must be summed
// over the tp group: after wo and w2 (forward), before the norms' backward (the input gradients of
// the column-parallel linears), after the vocab-parallel embedding lookup and the head's input
// gradient. The loss over a vocab shard needs the group too. size == 1: none of this runs.
//
// Sequence parallel (sequence_parallel): between the linears, the residual stream, the norms and
// their inputs hold only this rank's rows (tokens [rank*R, (rank+1)*R), R = B*T/size); the full
// rows a column-parallel linear reads are all-gathered, and a row-parallel linear's partial sums
// are reduce-scattered back to rows instead of all-reduced. Same volume, 1/size of those
// activations. The norm weights' gradients are then partial sums over rows: summed over tp.
typedef struct {
    int size, rank;
    bool sequence_parallel;
    // In-place sum of buf (n) over the tp group, started on the comm stream; wait finishes it.
    void *(*sum_start)(void *ctx, real *buf, size_t n);
    // Sequence parallel: full (size * n) = every rank's shard (n), in rank order; and shard (n) =
    // this rank's block of the sum over the group of full (size * n).
    void *(*gather_start)(void *ctx, const real *shard, real *full, size_t n);
    void *(*sum_scatter_start)(void *ctx, const real *full, real *shard, size_t n);
    void (*wait)(void *ctx, void *pending);
    // Cross-entropy over logits split by vocabulary: logits (BT, v_count) hold vocab entries
    // [v_start, v_start + v_count). Same results as cross_entropy_forward/backward on the full logits
    // (stats (BT, 2): the whole rows' max and log-sum, ops.h).
    double (*loss_forward)(void *ctx, real *stats, const real *logits, const int *targets, int BT, int v_start,
                           int v_count);
    void (*loss_backward)(void *ctx, real *dlogits, const real *logits, const real *stats, const int *targets, int BT,
                          int v_start, int v_count, double dloss);
    void *ctx;
} TensorParallel;

// Context parallelism (chapter 8). This rank holds T tokens of each longer sequence, at the global
// positions `positions` (T, the same for every sequence): RoPE rotates by them, and attention over
// the whole sequence goes through the callbacks, with attention_flash_forward/backward's meaning on
// the local tokens (q, k, v after RoPE; lse (B, heads, T); backward accumulates into dq, dk, dv).
// attention_forward == NULL: no context parallelism.
typedef struct {
    const int *positions;
    void (*attention_forward)(void *ctx, real *out, real *lse, const real *q, const real *k, const real *v);
    void (*attention_backward)(void *ctx, real *dq, real *dk, real *dv, const real *dout, const real *q,
                               const real *k, const real *v, const real *out, const real *lse);
    void *ctx;
} ContextParallelHooks;

// FP8 linears (chapter 9, chapters/09_fp8/fp8.h). When Model.fp8 is set, the seven projections of
// every block run their GEMMs through it instead of matmul_forward / matmul_backward (same shapes,
// same accumulation), quantizing the operands to FP8 first; `layer` and the projection name the
// linear (delayed scaling keeps state per linear). The embedding, norms, attention and the output
// head stay in full precision. NULL: the matmuls themselves, bit for bit.
// (Projection, the seven in a fixed order, is in params.h beside the parameters' names.)
typedef struct {
    void (*forward)(void *ctx, int layer, Projection p, real *out, const real *inp, const real *weight, int M, int K,
                    int N);
    void (*backward)(void *ctx, int layer, Projection p, real *dinp, real *dweight, const real *dout,
                     const real *inp, const real *weight, int M, int K, int N);
    void *ctx;
} Fp8Hook;

// This rank's share of the sharded dimensions (the config's values without tensor parallelism).
typedef struct {
    int n_heads, n_kv_heads, ffn_dim, vocab_size, vocab_start;
} LocalShape;

typedef enum { AC_NONE, AC_FULL, AC_SELECTIVE } ActCheckpoint;
#define AC_MODE_NAMES "none|full|selective"  // in enum order (the trainer's --ac choices)

typedef struct {
    ModelConfig cfg;
    ParamTable table;
    real *params;  // (table.total_numel) fp32 master weights (float64 in the float64 build); NULL if sharded
    real *grads;   // (table.total_numel), same layout; NULL if sharded
    RopeTable rope;
    AttentionImpl attention;
    GradsReadyHook grads_ready;  // NULL: no hook
    void *grads_ready_ctx;
    UnitStorage storage;         // .params == NULL: m->params and m->grads
    TensorParallel tp;           // .size == 1: no tensor parallelism
    ContextParallelHooks cp;     // .attention_forward == NULL: no context parallelism
    LocalShape local;            // the shapes this rank computes with
    const Fp8Hook *fp8;          // NULL: fp32 projections
} Model;

// Pointers to one block's tensors inside a flat buffer laid out by the table (params or grads).
typedef struct {
    real *attention_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w1, *w2, *w3;
    int layer;  // the block these belong to
} BlockWeights;

// Everything one block keeps from forward for backward, for B*T tokens (heads and ffn columns:
// this tensor-parallel rank's; with sequence parallelism x, rstd1, h and rstd2 hold this rank's
// R = B*T/tp rows, the gathered xn1 and xn2 all of them). With checkpointing, the
// fields a mode drops point into ModelActs.recompute, shared by every block (see block_acts_view).
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
    int first, end;      // the blocks this set holds: [first, end) (all of them but for a pipeline stage)
    ActCheckpoint ac;
    BlockActs *blocks;   // (n_layers) what each block keeps; with checkpointing, the dropped fields are NULL
    BlockActs recompute; // one block's dropped fields, rebuilt in backward (all NULL without checkpointing)
    real *recompute_out; // (BT, dim) where a full recompute writes the block output (not needed again)
    real *x_final;       // (BT, dim) output of the last block (NULL, like the head's buffers, unless end == n_layers)
    real *xn_final, *rstd_final;
    real *logits;        // (BT, vocab)
    real *ce_stats;      // (BT, 2) cross-entropy: each row's max logit and log of sum of exp(logit - max)
    const int *targets;  // of the last forward
    // backward scratch, reused by every block (dx, dx_next, dh: R rows under sequence parallelism)
    real *dx, *dx_next, *dxn, *dh, *dq, *dk, *dv, *dattn, *dgate, *dup, *dact, *dlogits;
    // sequence parallel only: (BT, dim) gathered rows or partial sums, (R, dim) a norm's output
    // before its all-gather or a reduce-scatter's result, (dim) a norm weight's partial gradient
    real *sp_full, *sp_rows, *sp_norm_grad;
} ModelActs;

// Allocates params and grads (MEM_PARAMS, MEM_GRADS) and initialises the weights from the seed.
void model_init(Model *m, const ModelConfig *cfg, uint64_t seed, AttentionImpl attention);
// The same without params and grads (NULL): for storage that shards them (FSDP).
void model_init_unallocated(Model *m, const ModelConfig *cfg, AttentionImpl attention);
// Tensor-parallel rank tp_rank of tp_size: the table and shapes of this rank's shards; with
// allocate, its params and grads, the params filled from init (this rank's slices of the full
// tensors; init may be NULL without allocate). The caller installs m->tp
// (chapters/06_tensor_parallel/tp.h) before the first forward.
void model_init_tp(Model *m, const ModelConfig *cfg, const ParamSource *init, AttentionImpl attention, int tp_size,
                   int tp_rank, bool allocate);
// Only the parameter table and this rank's shapes: no RoPE table, nothing allocated; enough to count
// bytes and FLOPs (chapter 11's planner builds one for every layout it tries), not to run.
void model_init_shapes(Model *m, const ModelConfig *cfg, AttentionImpl attention, int tp_size, int tp_rank);
void model_free(Model *m);
// Unit ranges in the flat layout (in elements).
size_t model_unit_offset(const Model *m, int unit);
size_t model_unit_numel(const Model *m, int unit);
// Block `layer`'s tensors inside its unit buffer (as returned by UnitStorage.params or .grads).
BlockWeights block_weights(const Model *m, real *unit_buffer, int layer);

// MEM_ACTIVATIONS. ac chooses what each block keeps for backward.
ModelActs model_acts_alloc(const Model *m, int B, int T, ActCheckpoint ac);
// For a pipeline stage holding blocks [first, end): their activations, blocks[end].x (the stage's
// output) when end < n_layers, or the head's buffers when end == n_layers.
ModelActs model_acts_alloc_stage(const Model *m, int B, int T, ActCheckpoint ac, int first, int end);
void model_acts_free(ModelActs *a);
// Block l's activations: its own buffers, with the fields checkpointing dropped taken from
// a->recompute.
BlockActs block_acts_view(const ModelActs *a, int l);
// Bytes ModelActs keeps per block and in the shared recompute buffers, for each mode (the
// estimate chapter 5 prints next to the measured peak).
size_t model_acts_bytes_per_block(const Model *m, int B, int T, ActCheckpoint ac);
// Forward FLOPs a backward adds per block to rebuild what ac dropped: matmul + attention FLOPs as
// model_block_forward_flops counts them, and element-wise ops (norms, SwiGLU) separately.
void model_recompute_flops(const Model *m, int B, int T, ActCheckpoint ac, double *matmul_flops,
                           double *elementwise_flops);

// One block. a->x must hold the block input; writes the block output to out (BT, dim; R rows
// under sequence parallelism). Uses the sequence-parallel scratch in acts.
void block_forward(const Model *m, const BlockWeights *w, BlockActs *a, ModelActs *scratch, real *out, int B, int T);
// Rows of the residual stream this rank holds: B*T, or B*T/tp under sequence parallelism.
int model_rows_here(const Model *m, int B, int T);
// dout (BT, dim) is the gradient of the block output; writes the gradient of the block input to
// dinp (overwritten) and accumulates the weight gradients into g. Uses the scratch in acts.
void block_backward(const Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, ModelActs *scratch,
                    const real *dout, real *dinp, int B, int T);

// Whole model. inputs/targets (B*T). Returns the mean loss. acts->logits holds the logits.
double model_forward(const Model *m, ModelActs *acts, const int *inputs, const int *targets);
// Accumulates d(dloss * loss)/d(params) into m->grads (call model_zero_grads first).
void model_backward(Model *m, ModelActs *acts, const int *inputs, double dloss);

// The same in pieces, for pipeline stages (model_forward is embed, blocks [0, L), head):
void model_embed_forward(const Model *m, ModelActs *acts, const int *inputs);   // -> blocks[0].x
// Blocks [first, end): reads blocks[first].x, writes blocks[end].x (x_final when end == n_layers).
void model_blocks_forward(const Model *m, ModelActs *acts, int first, int end);
double model_head_forward(const Model *m, ModelActs *acts, const int *targets); // x_final -> loss
void model_head_backward(Model *m, ModelActs *acts, double dloss);              // -> acts->dx
// Reads acts->dx (gradient of block end-1's output), leaves the gradient of blocks[first].x in acts->dx.
void model_blocks_backward(Model *m, ModelActs *acts, int first, int end);
void model_embed_backward(Model *m, ModelActs *acts, const int *inputs);        // reads acts->dx
void model_zero_grads(Model *m);
