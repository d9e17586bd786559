// model.h: the Llama 3 model of reference_cpu/model.h on one GPU, from the kernels of gpu/ops.h:
// the same parameter table (flat layout, names, init from the seed), the same block math in the
// same order, the same loss, AdamW and global-norm clipping. One device per process. Sharding plugs
// in as on the CPU model: chapter 3's FSDP module installs UnitStorage (GpuUnitView below;
// gpu/strategy.c, --dp-shard); so do chapter 7's pipeline stages, which run through the stage entry
// points at the end of this file (gpu/pipeline_device.h, --pp). Tensor parallelism (Megatron,
// chapter 6) is built in: see "Tensor parallelism" below (gpu_model_init_tp; gpu/strategy.c, --tp).
// Context parallelism: chapter 8's ring on device buffers for attention
// (gpu_model_set_context_parallel, --cp). Activation checkpointing: AC_FULL keeps each block's input
// alone and recomputes the block before its backward; AC_SELECTIVE keeps the matmul and attention
// outputs (x, q, k, v, attn, lse, h, gate, up) and recomputes the RMSNorms and SwiGLU (chapter 5's
// policy). Both give bit-identical gradients.
//
//   GpuModel m;
//   gpu_model_init(&m, &cfg, seed, GPU_BF16, B, T);
//   gpu_model_zero_grads(&m);
//   gpu_model_forward_queued(&m, inputs, targets);         // host token arrays (B*T); no wait
//   gpu_model_backward(&m, 1.0);
//   gpu_model_step(&m, step, lr, &adam, 1.0);              // clip to 1.0, then AdamW, on the device
//   double loss = gpu_model_loss(&m);                      // only when it is logged: a wait
//   double norm = gpu_model_grad_norm(&m);                 // likewise
//
// That step makes no host wait until the loss or the norm is read (gpu_host_waits counts them); under
// tensor parallelism gpu_model_step waits once, for the norm's sum over the tp group.
// gpu_model_forward is the queued forward followed by gpu_model_loss: one wait, for callers that
// want the number at once (the trainer's --device cuda, gpu/strategy.c).
//
// The block, as launched (fp32 and bf16; with FP8 linears, m->fp8, the separate projections and
// add kernels of reference_cpu's block_forward, since each FP8 linear casts its own weight with its
// own scale): one GEMM for [wq; wk; wv] (adjacent in the table) whose output a split kernel turns
// into q and k with RoPE and v; one strided-batched GEMM for W1 and W3 (two products, weights
// w3 - w1 apart, outputs gate and up adjacent); the two residual adds in the epilogues of the wo and
// w2 GEMMs. Backward mirrors it, and adds each half's input gradient into dx in place (the
// residuals pass the output's gradient through), with no copy.
//
// With tracing on (common/trace.h), each piece -- embedding, every block, the head, forward and
// backward, and the optimizer step -- is a slice on the GPU timeline (gpu/timeline.h), named as
// reference_cpu's model names its host slices.
//
// Precision. GPU_FP32 computes everything in fp32 (compared with the reference by
// tests/gpu/test_gpu_model.c). GPU_BF16 keeps fp32 master weights, gradients and moments, and a
// bf16 copy of the weights (refreshed by the fused AdamW) that forward and backward read;
// activations are bf16, per-row statistics fp32.
//
// Tensor parallelism (gpu_model_init_tp, GPU_BF16 only; FP8 linears and sequence parallelism too). The
// model holds tp rank r's shards, the table and shapes of model_init_tp (m->local: this rank's heads,
// kv heads, ffn columns and vocab rows; the weights its slices of the seed's, so the same model as
// the one-GPU one): wq wk wv w1 w3 and the output split by rows, wo w2 by columns, the embedding by
// vocabulary rows. Where reference_cpu's model calls TensorParallel.sum_start, this one sums over
// m->tp with comm.h on the device buffer: after wo and w2 (forward), the input gradients of
// [wq; wk; wv], of W1|W3 and of the head before the norms' backward, and the vocab-parallel lookup.
// Each sum is in fp32: comm.h has no bf16, and an fp32 sum is also the better one -- the GEMM
// writes its fp32 accumulators unrounded into m->tp_partial (BT, D), the all-reduce adds them, and
// one kernel rounds the total to bf16 (after wo and w2 adding the residual first: the residual
// epilogue of the one-GPU GEMM cannot apply to a partial sum). So each stored value is rounded once,
// as on one GPU, and differs from it only by the order of the fp32 sum (all-reducing bf16 partials
// would add a rounding per rank, and the 2-byte transfer would halve the bytes). The loss is
// vocab-parallel as chapters/06_tensor_parallel/tp.c's (an all-reduce MAX of each row's max, one
// all-reduce SUM of the sums of exp and the target's logit), the gradient norm sums the split
// entries' squares over the group and counts the replicated norm weights once (gpu_model_grad_sum_sq).
//
// Sequence parallelism (GpuTensorParallel.sequence_parallel; Megatron-SP, chapter 6's
// --sequence-parallel). The residual stream is split by tokens: each tp rank keeps R = BT / tp of the
// flattened (B*T) rows -- rank r rows [r R, (r + 1) R) -- of every block's input x and h, of x_final
// and of the gradient dx, and runs the RMSNorms and the residual adds on those rows alone. Before a
// column-parallel projection the norm's output rows are all-gathered into the (BT, D) input (xn1,
// xn2, xn_final; bf16 bytes, a copy); a row-parallel projection's fp32 partial (BT, D) is
// reduce-scattered, not all-reduced, into this rank's rows (m->tp_rows), then the residual added and
// rounded once. comm.h folds every element in rank order whichever collective sums it, so each row
// gets the same bits as the all-reduce gives it. Backward mirrors it: dx's rows are all-gathered
// (m->sp_full) before the row-parallel projections' backward and the embedding's, the column-parallel
// input gradients reduce-scattered. A norm weight's gradient from R rows is a partial sum over the
// sequence, summed over the group (m->sp_norm_grad) before it is added: the one result that differs
// from plain TP, by the order of an fp32 sum. The vocab-parallel logits and loss stay on all BT rows.
#pragma once
#include <stdint.h>

#include "gpu/ops.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/config.h"
#include "reference_cpu/model.h"  // ActCheckpoint
#include "reference_cpu/params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { GPU_FP32, GPU_BF16 } GpuPrecision;

// Tensor parallelism: this rank's place in the tp group (NULL or size 1: none).
typedef struct {
    struct Comm *group;      // the tp group
    int size, rank;
    bool sequence_parallel;  // the residual stream split by tokens over the group (above)
} GpuTensorParallel;

// Word offsets of one block's tensors in the flat parameter layout.
typedef struct {
    size_t attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
} GpuBlockOffsets;

// What one block keeps from forward for backward (device; activation dtype, stats fp32). gate and
// up are one (2, BT, F) buffer, up = gate + BT F elements: the batched W1|W3 GEMM's two outputs.
typedef struct {
    void *x, *xn1, *q, *k, *v, *attn, *h, *xn2, *gate, *up, *act;
    float *rstd1, *rstd2, *lse;
} GpuBlockActs;

// Where the blocks read one unit's weights and write its gradients (the table's units: index
// unit + 1, the embedding first). Without storage: views into params (or params_bf16) and grads,
// set once. With storage (m->storage, as reference_cpu's UnitStorage): set when the unit starts
// and dropped when it ends; in GPU_BF16 the unit's fp32 weights are cast into `cast`, a bf16 copy of
// that unit alone, which lives as long as the view.
typedef struct {
    size_t offset, numel;  // the unit's range in the flat layout
    const void *weights;   // the unit's first weight in the compute precision (bf16 or fp32)
    const float *master;   // the unit's first weight in fp32 (the FP8 linears cast from these)
    float *grads;          // the unit's first gradient (fp32)
    gpu_bf16 *cast;        // with storage in GPU_BF16: the bf16 copy of the unit's weights, else NULL
} GpuUnitView;

typedef struct {
    ModelConfig cfg;
    ParamTable table;
    GpuPrecision precision;
    size_t act_size;                  // bytes per activation element: 4 (fp32) or 2 (bf16)
    int B, T;
    ActCheckpoint ac;                 // AC_FULL: blocks[l > 0] share block 0's buffers but x;
                                      // AC_SELECTIVE: only its xn1, xn2, act, rstd1, rstd2
    bool fp8;                         // the blocks' projections as FP8 linears (gpu/fp8.h; set after init)
    struct Comm *fp8_tokens;          // with fp8 under data parallelism: the replicas (amaxes reduced), else NULL
    float *params, *grads, *adam_m, *adam_v;  // (table.total_numel) fp32 on the device
    gpu_bf16 *params_bf16;            // the compute copy (GPU_BF16), else NULL
    RopeTable rope;                   // device copy of reference_cpu's table
    GpuBlockOffsets *offsets;         // (n_layers), host
    size_t tok_embeddings, norm, output;  // offsets; output == tok_embeddings when tied
    GpuBlockActs *blocks;             // (n_layers)
    void *x_final, *xn_final, *logits;
    float *rstd_final, *ce_stats;     // (R), (BT, 2) the loss's row max and log-sum (gpu/ops.h)
    void *qkv;                        // (BT, hq + 2 hkv): the fused QKV GEMM's output, then its gradient
    // backward scratch, shared by the blocks. dx: the residual stream's gradient, updated in place
    // block by block. dq, dk, dv are one buffer (one zero-fill), and so are dgate, dup (dup = dgate + BT F).
    void *dx, *dxn, *dq, *dk, *dv, *dattn, *dgate, *dup, *dact, *dlogits;
    int *inputs, *targets;            // device copies of the last batch (B*T)
    double *loss;                     // device: the last forward's mean loss
    double *grad_sum_sq;              // device: the last step's gradient sum of squares
    GpuUnitView *units;               // (n_layers + 2), host: embedding, blocks, head
    // Sharded (gpu_model_init_sharded): params, grads, adam_m, adam_v and params_bf16 are NULL and the
    // units' fp32 weights and gradients come from storage, device pointers (chapter 3's FSDP module on
    // device memory installs it, gpu/strategy.c); grads_ready is called as each unit's gradients are
    // final, in reference_cpu's order (head, blocks last to first, embedding).
    UnitStorage storage;
    GradsReadyHook grads_ready;
    void *grads_ready_ctx;
    // Tensor parallelism (gpu_model_init_tp; above). Without it tp is NULL, tp_size 1 and local the
    // config's shapes.
    struct Comm *tp;                  // the tp group, or NULL
    int tp_size, tp_rank;
    bool sequence_parallel;           // the residual stream's rows split over tp (above)
    int rows;                         // R, the rows of the residual stream here: BT / tp_size with
                                      // sequence parallelism, else BT
    LocalShape local;                 // the heads, kv heads, ffn columns and vocab rows computed here
    float *tp_partial;                // (BT, D) fp32: a row-parallel output's or an input gradient's partial sum
    float *tp_rows;                   // sequence parallel: (R, D) fp32, this rank's rows of that sum
    void *sp_rows, *sp_full;          // sequence parallel: (R, D) a norm's output rows, (BT, D) gathered rows
    float *sp_norm_grad;              // sequence parallel: (D) a norm weight's gradient from these rows
    float *tp_row_max;                // (BT) the vocab-parallel loss's row max, then the group's
    double *tp_sums;                  // (2, BT) its sums of exp, then its target logits, summed over the group
    double *tp_sq;                    // (table.count) each entry's gradient sum of squares (the norm)
    // Context parallelism (gpu_model_set_context_parallel; NULL: none): this rank's T tokens of each
    // sequence sit at the global positions `positions` (device, T), by which RoPE rotates, and
    // attention covers the whole sequence through chapter 8's ring on device buffers
    // (gpu/cp_device.h), which computes in fp32: in GPU_BF16, q, k, v (and in backward the output and
    // its gradient) are cast up into cp_staging and the results cast back to bf16.
    struct ContextParallel *cp;
    int *positions;
    float *cp_staging;  // GPU_BF16: (4 BT hq + 4 BT hkv) fp32; GPU_FP32: NULL
} GpuModel;

// Builds the table, initialises the weights exactly as model_init does (on the host, then copied),
// allocates the optimizer state and the activations for batches of B sequences of T tokens. Stops
// (before allocating) if gpu_model_plan_bytes is more than the device's free memory.
void gpu_model_init(GpuModel *m, const ModelConfig *cfg, uint64_t seed, GpuPrecision precision, int B, int T);
// The same with the weights from init (params.h: the seed, or a Hugging Face checkpoint).
void gpu_model_init_from(GpuModel *m, const ModelConfig *cfg, const ParamSource *init, GpuPrecision precision, int B,
                         int T, ActCheckpoint ac);
// Tensor-parallel rank tp->rank of tp->size over tp->group (GPU_BF16; tp NULL or of size 1:
// gpu_model_init_from): the table, shapes and weights of this rank's shards (model.h's "Tensor
// parallelism"; with tp->sequence_parallel, "Sequence parallelism": B * T must divide by tp->size).
void gpu_model_init_tp(GpuModel *m, const ModelConfig *cfg, const ParamSource *init, GpuPrecision precision, int B,
                       int T, ActCheckpoint ac, const GpuTensorParallel *tp);
// The same shapes and activations without the weights, gradients and optimizer state (NULL): for
// storage that shards them. The caller sets m->storage (and grads_ready) before the first forward;
// forward and backward then work (the FP8 linears too, from each unit's fp32 weights); gpu_model_step
// does not (it needs m->params).
void gpu_model_init_sharded(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                            ActCheckpoint ac);
// The same for tensor-parallel rank tp->rank: this rank's table and shapes, the weights from storage
// (FSDP over the tp shards: --tp with --dp-shard).
void gpu_model_init_sharded_tp(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                               ActCheckpoint ac, const GpuTensorParallel *tp);
void gpu_model_free(GpuModel *m);
// Context parallelism: cp (chapters/08_context_parallel/cp.h, created on gpu_cp_compute for this
// model's B and heads; the caller keeps and frees it) and this rank's positions (host, T). Allocates
// the device positions and the fp32 staging, which gpu_model_free releases.
void gpu_model_set_context_parallel(GpuModel *m, struct ContextParallel *cp, const int *positions);
// The device memory gpu_model_init will allocate (bytes, as gpu_alloc counts them):
// init compares it with the device's free memory and stops with both figures when it does not fit.
size_t gpu_model_plan_bytes(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac);
void gpu_model_zero_grads(GpuModel *m);
// After m->params was written other than by gpu_model_step (a broadcast, a loaded checkpoint): the
// bf16 compute copy is cast again from the fp32 master weights (nothing to do in GPU_FP32).
void gpu_model_refresh_compute_copy(GpuModel *m);
// inputs, targets: host arrays of B*T tokens (the targets checked on the host: one outside [0, V)
// other than IGNORE_INDEX stops the run). Queues the forward pass, the batch's upload included
// (gpu_upload_queued), and leaves the mean loss in m->loss on the device: no wait for the stream.
void gpu_model_forward_queued(GpuModel *m, const int *inputs, const int *targets);
// The last forward's mean loss (waits for the stream: call it when the loss is logged).
double gpu_model_loss(const GpuModel *m);
// gpu_model_forward_queued, then gpu_model_loss: returns the mean loss, after one wait.
double gpu_model_forward(GpuModel *m, const int *inputs, const int *targets);
// Accumulates d(dloss * loss)/d(params) into m->grads, for the batch of the last forward.
void gpu_model_backward(GpuModel *m, double dloss);
// As the trainer's step: the global gradient norm, clipping to max_norm (<= 0: none), AdamW -- two
// passes on the device (the sum of squares, then AdamW with the clip folded in) and no wait for the
// host. m->grads are left unscaled.
void gpu_model_step(GpuModel *m, long long step, double lr, const AdamWConfig *adam, double max_norm);
// The last step's gradient norm before clipping (waits for the stream: call it when logging).
double gpu_model_grad_norm(const GpuModel *m);
// The gradients' global sum of squares now (waits): under tensor parallelism the whole model's, the
// split entries summed over the group and the replicated norm weights counted once (collective over
// the tp group). gpu_model_step under tensor parallelism takes it so (one wait for the host).
double gpu_model_grad_sum_sq(const GpuModel *m);

// ---- pipeline stages (chapter 7's executor, through gpu/pipeline_device.h) -----------------------------
// A stage holds blocks [first, end), with the embedding when first == 0 and the head when end ==
// n_layers. The executor keeps one GpuStageActs per (chunk, micro-batch) in flight; the model's own
// per-block activations are not used (gpu_model_init_stages does not keep them), its backward
// scratch (qkv, dxn, dq, ..., dlogits) is shared, since the stream runs one stage's kernels at a time.
// With activation checkpointing the same holds of the model's block 0 set: every stage block keeps
// what the policy keeps (its input; with selective also q, k, v, attn, lse, h, gate, up) and
// recomputes the rest into that shared set before its backward, the stage's last block included.
// Weights and gradients come, unit by unit, from m->storage (the executor's chunk buffers, device
// pointers): a sharded model, as with FSDP. The entry points run what gpu_model_forward_queued and
// gpu_model_backward run, on these activations; a stage's kernels read them as the model's own by
// being installed in the model (m->blocks and the head's buffers) for the call's duration.
typedef struct {
    int first, end;           // blocks [first, end)
    GpuBlockActs *blocks;     // (n_layers): [first, end) allocated; blocks[first].x is the stage input
    void *out;                // (R, D): the stage output (block end's input, or the head's input x_final)
    void *dx;                 // (R, D): the gradient of out on entry to backward, of the stage input after
                              // (R = m->rows: BT, or this tp rank's rows under sequence parallelism)
    int *inputs;              // (BT) device: stage 0's tokens, for the embedding's backward; else NULL
    // the last stage: the head's activations and the targets (else NULL)
    void *xn_final, *logits;
    float *rstd_final, *ce_stats;  // (R), (BT, 2) the loss's row max and log-sum (gpu/ops.h)
    int *targets;
} GpuStageActs;

// The model for pipeline stages: gpu_model_init_sharded_tp (weights and gradients from storage; tp
// NULL: none), then the per-block activations, the head's, dx and the token buffers released
// (GpuStageActs hold them; the memory check before allocating still counts them once).
void gpu_model_init_stages(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                           ActCheckpoint ac, const GpuTensorParallel *tp);
// MEM_ACTIVATIONS, at the model's B and T, what the model's checkpointing keeps of each block.
GpuStageActs *gpu_model_stage_acts_alloc(const GpuModel *m, int first, int end);
void gpu_model_stage_acts_free(const GpuModel *m, GpuStageActs *a);  // stream-ordered, as gpu_free
// inputs: host tokens (B*T) -> blocks[0].x (queued upload, kept for the backward).
void gpu_model_stage_embed_forward(GpuModel *m, GpuStageActs *a, const int *inputs);
// blocks[first].x -> out.
void gpu_model_stage_blocks_forward(GpuModel *m, GpuStageActs *a);
// out -> the head and the loss against targets (host, B*T); returns the mean loss: waits for the stream.
double gpu_model_stage_head_forward(GpuModel *m, GpuStageActs *a, const int *targets);
// d(dloss * loss) -> dx (overwritten), the head's gradients accumulated.
void gpu_model_stage_head_backward(GpuModel *m, GpuStageActs *a, double dloss);
// dx: the gradient of out -> of blocks[first].x, in place; the blocks' gradients accumulated.
void gpu_model_stage_blocks_backward(GpuModel *m, GpuStageActs *a);
// dx -> the embedding's gradients (the forward's tokens).
void gpu_model_stage_embed_backward(GpuModel *m, GpuStageActs *a);

#ifdef __cplusplus
}
#endif
