// model.c: reference_cpu/model.c's forward and backward on the GPU (see model.h). The block
// functions follow block_forward and block_backward, so that the fp32 model computes what the
// reference computes, in the same order for every element; where several of the reference's calls
// become one launch, the launch sums each element in the order the calls did (a fused GEMM's inner
// dimension is the calls' inner dimensions one after another, a batch is the calls side by side, a
// residual epilogue adds what the add kernel added). tests/test_gpu_model_host.c checks that bit for
// bit with reference_cpu's plain-loop matmuls, whose order is defined (one product after another
// over the inner dimension); cuBLASLt sums in blocks of its own choosing, as OpenBLAS does, and
// tests/gpu/test_gpu_model.c bounds the difference.
#include "gpu/model.h"
#include "gpu/fp8.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "chapters/08_context_parallel/cp.h"
#include "common/comm.h"
#include "common/log.h"
#include "gpu/runtime.h"
#include "gpu/timeline.h"

// ---- the ops in the model's precision ---------------------------------------------------------------------
// Activations are void*: fp32 or bf16 by m->precision. Weights are read from the compute copy
// (params, or params_bf16), gradients always accumulate into the fp32 m->grads.
#define BF16(m) ((m)->precision == GPU_BF16)

// The unit holding flat offset `offset`: weights and gradients are read through its view (model.h,
// GpuUnitView), the whole model's buffers or a unit's gathered weights alike. A scan of the
// n_layers + 2 ranges, which a block's few lookups make negligible next to its kernels.
static const GpuUnitView *view_of(const GpuModel *m, size_t offset) {
    for (int i = 0; i < m->cfg.n_layers + 2; i++) {
        const GpuUnitView *v = &m->units[i];
        if (offset >= v->offset && offset < v->offset + v->numel) return v;
    }
    fatal("gpu model: offset %zu is in no unit", offset);
}
static const void *weight(const GpuModel *m, size_t offset) {
    const GpuUnitView *v = view_of(m, offset);
    if (!v->weights) fatal("gpu model: the unit at offset %zu is read outside its storage's params/params_done", offset);
    size_t i = offset - v->offset;
    return BF16(m) ? (const void *)((const gpu_bf16 *)v->weights + i) : (const void *)((const float *)v->weights + i);
}
// The fp32 weight at `offset` (the FP8 linears' operand): the master weights, or the unit's gathered
// fp32 weights when storage shards them.
static const float *master_weight(const GpuModel *m, size_t offset) {
    const GpuUnitView *v = view_of(m, offset);
    if (!v->master) fatal("gpu model: the unit at offset %zu is read outside its storage's params/params_done", offset);
    return v->master + (offset - v->offset);
}
static float *grad(const GpuModel *m, size_t offset) {
    const GpuUnitView *v = view_of(m, offset);
    if (!v->grads) fatal("gpu model: the gradients at offset %zu were asked for outside backward", offset);
    return v->grads + (offset - v->offset);
}

static void matmul_fwd(const GpuModel *m, void *out, const void *inp, const void *w, int M, int K, int N) {
    if (BF16(m)) gpu_matmul_forward_bf16(out, inp, w, M, K, N);
    else gpu_matmul_forward(out, inp, w, M, K, N);
}
static void matmul_bwd(const GpuModel *m, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                       int M, int K, int N) {
    if (BF16(m)) gpu_matmul_backward_bf16(dinp, dw, dout, inp, w, M, K, N);
    else gpu_matmul_backward(dinp, dw, dout, inp, w, M, K, N);
}
// The first writer of dinp: overwrites it (no zero-fill before), dw still accumulates.
static void matmul_bwd_first(const GpuModel *m, void *dinp, float *dw, const void *dout, const void *inp,
                             const void *w, int M, int K, int N) {
    if (BF16(m)) gpu_matmul_backward_overwrite_bf16(dinp, dw, dout, inp, w, M, K, N);
    else gpu_matmul_backward_overwrite(dinp, dw, dout, inp, w, M, K, N);
}
// A block's projection (the weight at offset w_off): with FP8 on, chapter 9's FP8 linear on the fp32
// master weights (gpu/fp8.h); else the matmul in the model's precision. first: dinp's first writer.
// Under tensor parallelism a projection is column-parallel (wq, wk, wv, w1, w3: this rank's rows of W,
// its output's columns) or row-parallel (wo, w2: W's columns, its input's); FP8 reduces the amaxes of
// the operands split over the tp group over it (fp8_groups).
typedef enum { COLUMN_PARALLEL, ROW_PARALLEL } LinearSplit;
static GpuFp8Groups fp8_groups(const GpuModel *m, LinearSplit split) {
    GpuFp8Groups g = {m->fp8_tokens, NULL, m->tp, NULL};
    if (split == COLUMN_PARALLEL) g.dy_columns = m->tp;
    else g.x_columns = m->tp;
    return g;
}
static void linear_fwd(const GpuModel *m, LinearSplit split, void *out, const void *inp, size_t w_off, int M, int K,
                       int N) {
    GpuFp8Groups g = fp8_groups(m, split);
    if (m->fp8) gpu_fp8_linear_forward(out, inp, master_weight(m, w_off), M, K, N, BF16(m), &g);
    else matmul_fwd(m, out, inp, weight(m, w_off), M, K, N);
}
static void linear_bwd(const GpuModel *m, LinearSplit split, void *dinp, bool first, float *dw, const void *dout,
                       const void *inp, size_t w_off, int M, int K, int N) {
    GpuFp8Groups g = fp8_groups(m, split);
    if (m->fp8) gpu_fp8_linear_backward(dinp, first, dw, dout, inp, master_weight(m, w_off), M, K, N, BF16(m), &g);
    else if (first) matmul_bwd_first(m, dinp, dw, dout, inp, weight(m, w_off), M, K, N);
    else matmul_bwd(m, dinp, dw, dout, inp, weight(m, w_off), M, K, N);
}
// Tensor parallel: a column-parallel projection's input gradient, dout W (this rank's rows of W), as
// an fp32 partial sum into m->tp_partial (overwritten, or added to with accumulate) for the group's
// all-reduce; FP8, or bf16 operands.
static void linear_bwd_input_partial(const GpuModel *m, bool accumulate, const void *dout, size_t w_off, int M, int K,
                                     int N) {
    GpuFp8Groups g = fp8_groups(m, COLUMN_PARALLEL);
    if (m->fp8)
        gpu_fp8_linear_backward_input_partial(m->tp_partial, accumulate, dout, master_weight(m, w_off), M, K, N,
                                              BF16(m), &g);
    else gpu_matmul_backward_input_bf16_into_f32(m->tp_partial, dout, weight(m, w_off), M, K, N, accumulate);
}
// The RMSNorms run on the residual stream's rows here (m->rows: all BT, or this rank's share under
// sequence parallelism).
static void rmsnorm_fwd(const GpuModel *m, void *out, float *rstd, const void *inp, const void *w) {
    int N = m->rows, C = m->cfg.dim;
    if (BF16(m)) gpu_rmsnorm_forward_bf16(out, rstd, inp, w, N, C, m->cfg.norm_eps);
    else gpu_rmsnorm_forward(out, rstd, inp, w, N, C, m->cfg.norm_eps);
}
static void rmsnorm_bwd(const GpuModel *m, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                        const float *rstd) {
    int N = m->rows, C = m->cfg.dim;
    if (BF16(m)) gpu_rmsnorm_backward_bf16(dinp, dw, dout, inp, w, rstd, N, C);
    else gpu_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
}
static void rope(const GpuModel *m, void *x, int n_heads, bool backward) {
    if (BF16(m)) (backward ? gpu_rope_backward_bf16 : gpu_rope_forward_bf16)(x, &m->rope, m->positions, m->B, m->T, n_heads);
    else (backward ? gpu_rope_backward : gpu_rope_forward)(x, &m->rope, m->positions, m->B, m->T, n_heads);
}
static AttnShape attn_shape(const GpuModel *m) {
    AttnShape s = {m->B, m->T, m->T, m->local.n_heads, m->local.n_kv_heads, model_head_dim(&m->cfg), NULL, NULL, true};
    return s;
}
// ---- context parallelism: attention over the whole sequence through chapter 8's ring --------------------------
// The ring works in fp32 (gpu/cp_device.h). In GPU_BF16 the bf16 tensors are cast up into the staging
// (exactly: every bf16 is an fp32) and the results rounded back to bf16 once, as the bf16 attention
// kernels round their outputs.
typedef struct {
    float *q, *k, *v, *out, *dout, *dq, *dk, *dv;
} CpStaging;
static size_t q_elements(const GpuModel *m) { return (size_t)m->B * m->T * m->local.n_heads * model_head_dim(&m->cfg); }
static size_t kv_elements(const GpuModel *m) {
    return (size_t)m->B * m->T * m->local.n_kv_heads * model_head_dim(&m->cfg);
}
static CpStaging cp_staging(const GpuModel *m) {
    size_t nq = q_elements(m), nkv = kv_elements(m);
    float *p = m->cp_staging;
    CpStaging s = {p, p + nq, p + nq + nkv, p + nq + 2 * nkv, p + 2 * nq + 2 * nkv, p + 3 * nq + 2 * nkv,
                   p + 4 * nq + 2 * nkv, p + 4 * nq + 3 * nkv};
    return s;
}
static void cp_attention_fwd(const GpuModel *m, GpuBlockActs *a) {
    if (!BF16(m)) {
        cp_attention_forward(m->cp, a->attn, a->lse, a->q, a->k, a->v);
        return;
    }
    CpStaging s = cp_staging(m);
    gpu_cast_bf16_to_f32(s.q, a->q, q_elements(m));
    gpu_cast_bf16_to_f32(s.k, a->k, kv_elements(m));
    gpu_cast_bf16_to_f32(s.v, a->v, kv_elements(m));
    cp_attention_forward(m->cp, s.out, a->lse, s.q, s.k, s.v);
    gpu_cast_f32_to_bf16(a->attn, s.out, q_elements(m));
}
// dq, dk, dv are zero-filled before (block backward), so the bf16 path's cast equals accumulating.
static void cp_attention_bwd(const GpuModel *m, const GpuBlockActs *a) {
    if (!BF16(m)) {
        cp_attention_backward(m->cp, m->dq, m->dk, m->dv, m->dattn, a->q, a->k, a->v, a->attn, a->lse);
        return;
    }
    CpStaging s = cp_staging(m);
    size_t nq = q_elements(m), nkv = kv_elements(m);
    gpu_cast_bf16_to_f32(s.q, a->q, nq);
    gpu_cast_bf16_to_f32(s.k, a->k, nkv);
    gpu_cast_bf16_to_f32(s.v, a->v, nkv);
    gpu_cast_bf16_to_f32(s.out, a->attn, nq);
    gpu_cast_bf16_to_f32(s.dout, m->dattn, nq);
    gpu_fill_bytes(s.dq, 0, sizeof(float) * (nq + 2 * nkv));  // dq, dk, dv: adjacent
    cp_attention_backward(m->cp, s.dq, s.dk, s.dv, s.dout, s.q, s.k, s.v, s.out, a->lse);
    gpu_cast_f32_to_bf16(m->dq, s.dq, nq);
    gpu_cast_f32_to_bf16(m->dk, s.dk, nkv);
    gpu_cast_f32_to_bf16(m->dv, s.dv, nkv);
}

static void attention_fwd(const GpuModel *m, GpuBlockActs *a) {
    AttnShape s = attn_shape(m);
    if (m->cp) cp_attention_fwd(m, a);
    else if (BF16(m)) gpu_attention_forward_bf16(a->attn, a->lse, a->q, a->k, a->v, &s);
    else gpu_attention_forward(a->attn, a->lse, a->q, a->k, a->v, &s);
}
static void attention_bwd(const GpuModel *m, const GpuBlockActs *a) {
    AttnShape s = attn_shape(m);
    if (m->cp) cp_attention_bwd(m, a);
    else if (BF16(m)) gpu_attention_backward_bf16(m->dq, m->dk, m->dv, m->dattn, a->q, a->k, a->v, a->attn, a->lse, &s);
    else gpu_attention_backward(m->dq, m->dk, m->dv, m->dattn, a->q, a->k, a->v, a->attn, a->lse, &s);
}
static void swiglu_fwd(const GpuModel *m, void *out, const void *gate, const void *up, size_t n) {
    if (BF16(m)) gpu_swiglu_forward_bf16(out, gate, up, n);
    else gpu_swiglu_forward(out, gate, up, n);
}
static void swiglu_bwd(const GpuModel *m, void *dgate, void *dup, const void *dout, const void *gate, const void *up,
                       size_t n) {
    if (BF16(m)) gpu_swiglu_backward_bf16(dgate, dup, dout, gate, up, n);
    else gpu_swiglu_backward(dgate, dup, dout, gate, up, n);
}
// Pointer arithmetic on activations, whose element size is m->act_size.
static void *act_at(const GpuModel *m, void *base, size_t elements) { return (char *)base + elements * m->act_size; }

static void matmul_fwd_residual(const GpuModel *m, void *out, const void *residual, const void *inp, const void *w,
                                int M, int K, int N) {
    if (BF16(m)) gpu_matmul_forward_residual_bf16(out, residual, inp, w, M, K, N);
    else gpu_matmul_forward_residual(out, residual, inp, w, M, K, N);
}
static void matmul_fwd_batched(const GpuModel *m, void *out, const void *inp, const void *w, int M, int K, int N,
                               int batch, long long out_stride, long long inp_stride, long long w_stride) {
    if (BF16(m)) gpu_matmul_forward_batched_bf16(out, inp, w, M, K, N, batch, out_stride, inp_stride, w_stride);
    else gpu_matmul_forward_batched(out, inp, w, M, K, N, batch, out_stride, inp_stride, w_stride);
}
static void matmul_bwd_weight_batched(const GpuModel *m, float *dw, const void *dout, const void *inp, int M, int K,
                                      int N, int batch, long long dw_stride, long long dout_stride,
                                      long long inp_stride) {
    if (BF16(m)) gpu_matmul_backward_weight_batched_bf16(dw, dout, inp, M, K, N, batch, dw_stride, dout_stride, inp_stride);
    else gpu_matmul_backward_weight_batched(dw, dout, inp, M, K, N, batch, dw_stride, dout_stride, inp_stride);
}
static void qkv_split_rope(const GpuModel *m, GpuBlockActs *a) {
    const LocalShape *c = &m->local;
    if (BF16(m)) gpu_qkv_split_rope_bf16(a->q, a->k, a->v, m->qkv, &m->rope, m->positions, m->B, m->T, c->n_heads, c->n_kv_heads);
    else gpu_qkv_split_rope(a->q, a->k, a->v, m->qkv, &m->rope, m->positions, m->B, m->T, c->n_heads, c->n_kv_heads);
}
static void qkv_merge_rope_bwd(const GpuModel *m) {
    const LocalShape *c = &m->local;
    if (BF16(m))
        gpu_qkv_merge_rope_backward_bf16(m->qkv, m->dq, m->dk, m->dv, &m->rope, m->positions, m->B, m->T, c->n_heads, c->n_kv_heads);
    else gpu_qkv_merge_rope_backward(m->qkv, m->dq, m->dk, m->dv, &m->rope, m->positions, m->B, m->T, c->n_heads, c->n_kv_heads);
}
static void add(const GpuModel *m, void *x, const void *y, size_t n) {
    if (BF16(m)) gpu_add_inplace_bf16(x, y, n);
    else gpu_add_inplace(x, y, n);
}
static void zero(const GpuModel *m, void *x, size_t n) { gpu_fill_bytes(x, 0, n * m->act_size); }

// ---- init --------------------------------------------------------------------------------------------------
static size_t offset_of(const ParamTable *t, const char *name) {
    const ParamInfo *p = param_table_find(t, name);
    if (!p) fatal("gpu model: no parameter %s in the table", name);
    return p->offset;
}

static size_t block_offset(const ParamTable *t, int layer, const char *suffix) {
    char name[PARAM_NAME_MAX];
    snprintf(name, sizeof name, "layers.%d.%s", layer, suffix);
    return offset_of(t, name);
}

// Every device buffer of the model, in one place. With plan != NULL nothing is allocated: the bytes
// are summed into *plan (what gpu_model_init compares with the device's free memory before it
// allocates anything).
static void *device_buffer(size_t *plan, MemCategory category, size_t bytes) {
    if (!plan) return gpu_alloc(category, bytes);
    *plan += bytes;
    return NULL;
}

// A block's activations in three groups, by what checkpointing does with them: its input (always
// kept), what selective checkpointing keeps (the matmul and attention outputs: x is not among them),
// and what it recomputes (the norms' outputs and statistics, SwiGLU's output). The shared set (the
// model's block 0) owns all three; any other block owns its input, plus the kept group unless --ac
// full, plus the recomputed group only without checkpointing. What a block does not own is the
// shared set's.
typedef enum { BLOCK_INPUT, BLOCK_KEPT, BLOCK_RECOMPUTED } BlockGroup;
static bool block_owns(const GpuModel *m, bool shared_set, BlockGroup group) {
    if (shared_set || group == BLOCK_INPUT || m->ac == AC_NONE) return true;
    return m->ac == AC_SELECTIVE && group == BLOCK_KEPT;
}

// The groups of a's buffers it owns (block_owns), at the model's B, T and shapes; the rest of *a is
// left as it is (the shared set's pointers). plan: count the bytes instead of allocating.
static void block_acts_alloc(const GpuModel *m, GpuBlockActs *a, bool shared_set, size_t *plan) {
    const LocalShape *local = &m->local;  // this tp rank's heads and ffn columns
    size_t BT = (size_t)m->B * m->T, D = m->cfg.dim, F = local->ffn_dim, hd = model_head_dim(&m->cfg);
    size_t hq = local->n_heads * hd, hkv = local->n_kv_heads * hd, as = m->act_size;
#define ACTS(count) device_buffer(plan, MEM_ACTIVATIONS, (count) * as)
#define STATS(count) (float *)device_buffer(plan, MEM_ACTIVATIONS, (count) * sizeof(float))
    size_t R = (size_t)m->rows;  // the residual stream's rows here (sequence parallel: BT / tp)
    if (block_owns(m, shared_set, BLOCK_INPUT)) a->x = ACTS(R * D);
    if (block_owns(m, shared_set, BLOCK_KEPT)) {
        a->h = ACTS(R * D);
        a->q = ACTS(BT * hq), a->attn = ACTS(BT * hq), a->k = ACTS(BT * hkv), a->v = ACTS(BT * hkv);
        a->gate = ACTS(2 * BT * F);  // gate, then up: the batched GEMM's outputs
        a->up = plan ? NULL : act_at(m, a->gate, BT * F);
        a->lse = STATS((size_t)m->B * local->n_heads * m->T);
    }
    if (block_owns(m, shared_set, BLOCK_RECOMPUTED)) {
        a->xn1 = ACTS(BT * D), a->xn2 = ACTS(BT * D), a->act = ACTS(BT * F);
        a->rstd1 = STATS(R), a->rstd2 = STATS(R);
    }
#undef ACTS
#undef STATS
}

// sharded: no weights, gradients or moments (their storage holds them).
static void model_buffers(GpuModel *m, size_t *plan, bool sharded) {
    const ModelConfig *cfg = &m->cfg;
    size_t n = m->table.total_numel, as = m->act_size;
    if (!sharded) {
        m->params = device_buffer(plan, MEM_PARAMS, sizeof(float) * n);
        m->grads = device_buffer(plan, MEM_GRADS, sizeof(float) * n);
        m->adam_m = device_buffer(plan, MEM_OPTIMIZER, sizeof(float) * n);
        m->adam_v = device_buffer(plan, MEM_OPTIMIZER, sizeof(float) * n);
        if (BF16(m)) m->params_bf16 = device_buffer(plan, MEM_PARAMS, sizeof(uint16_t) * n);
    }
    size_t rope_bytes = sizeof(float) * (size_t)cfg->max_seq_len * (model_head_dim(cfg) / 2);
    if (plan) {  // gpu_rope_table_upload's cos and sin
        device_buffer(plan, MEM_OTHER, rope_bytes), device_buffer(plan, MEM_OTHER, rope_bytes);
    } else {
        RopeTable host_rope = rope_table_build(cfg->max_seq_len, model_head_dim(cfg), cfg->rope_theta,
                                               cfg->rope_scaling_factor, cfg->rope_low_freq_factor,
                                               cfg->rope_high_freq_factor, cfg->rope_original_max_seq_len);
        m->rope = gpu_rope_table_upload(&host_rope);
        rope_table_free(&host_rope);
    }

    const LocalShape *local = &m->local;  // this tp rank's heads, ffn columns and vocab rows
    size_t BT = (size_t)m->B * m->T, D = cfg->dim, F = local->ffn_dim, V = local->vocab_size, hd = model_head_dim(cfg);
    size_t hq = local->n_heads * hd, hkv = local->n_kv_heads * hd, R = (size_t)m->rows;
#define ACTS(count) device_buffer(plan, MEM_ACTIVATIONS, (count) * as)
#define STATS(count) (float *)device_buffer(plan, MEM_ACTIVATIONS, (count) * sizeof(float))
    // Full activation checkpointing keeps each block's input alone; the rest of a block's activations
    // live in block 0's set, which every block's forward, and its recomputation before its backward,
    // reuses. Selective keeps the kept fields (block_owns) per block and shares the recomputed ones.
    for (int l = 0; l < cfg->n_layers; l++) {
        GpuBlockActs *a = &m->blocks[l];
        if (l > 0 && m->ac != AC_NONE) *a = m->blocks[0];
        block_acts_alloc(m, a, l == 0, plan);
    }
    m->x_final = ACTS(R * D), m->xn_final = ACTS(BT * D);
    m->logits = ACTS(BT * V), m->dlogits = ACTS(BT * V);
    m->rstd_final = STATS(R), m->ce_stats = STATS(2 * BT);
    m->qkv = ACTS(BT * (hq + 2 * hkv));
    m->dx = ACTS(R * D), m->dxn = ACTS(BT * D);
    m->dq = ACTS(BT * (hq + 2 * hkv)), m->dattn = ACTS(BT * hq);  // dq, then dk, then dv: one zero-fill
    m->dk = plan ? NULL : act_at(m, m->dq, BT * hq);
    m->dv = plan ? NULL : act_at(m, m->dk, BT * hkv);
    m->dgate = ACTS(2 * BT * F), m->dact = ACTS(BT * F);  // dgate, then dup: one zero-fill, one batched GEMM
    m->dup = plan ? NULL : act_at(m, m->dgate, BT * F);
#undef ACTS
#undef STATS
    m->inputs = device_buffer(plan, MEM_OTHER, sizeof(int) * BT);
    m->targets = device_buffer(plan, MEM_OTHER, sizeof(int) * BT);
    m->loss = device_buffer(plan, MEM_OTHER, sizeof(double));
    m->grad_sum_sq = device_buffer(plan, MEM_OTHER, sizeof(double));
    if (m->tp_size > 1) {  // tensor parallelism's fp32 partial sums and the vocab-parallel loss's statistics
        m->tp_partial = device_buffer(plan, MEM_ACTIVATIONS, sizeof(float) * BT * D);
        m->tp_row_max = device_buffer(plan, MEM_ACTIVATIONS, sizeof(float) * BT);
        m->tp_sums = device_buffer(plan, MEM_ACTIVATIONS, sizeof(double) * 2 * BT);
        m->tp_sq = device_buffer(plan, MEM_OTHER, sizeof(double) * m->table.count);
    }
    if (m->sequence_parallel) {  // the row shares of the sums, the norms' rows, the gathered rows
        m->tp_rows = device_buffer(plan, MEM_ACTIVATIONS, sizeof(float) * R * D);
        m->sp_rows = device_buffer(plan, MEM_ACTIVATIONS, as * R * D);
        m->sp_full = device_buffer(plan, MEM_ACTIVATIONS, as * BT * D);
        m->sp_norm_grad = device_buffer(plan, MEM_OTHER, sizeof(float) * D);
    }
}

// The model's fields that the buffers' sizes depend on: tensor-parallel rank tp->rank of tp->size holds
// the table and shapes of its shards (model_init_tp's; tp NULL: the whole model), and under sequence
// parallelism its share of the residual stream's rows.
static void model_shape_tp(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                           ActCheckpoint ac, const GpuTensorParallel *tp) {
    int tp_size = tp ? tp->size : 1, tp_rank = tp ? tp->rank : 0;
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->ac = ac;
    m->tp_size = tp_size, m->tp_rank = tp_rank;
    m->sequence_parallel = tp_size > 1 && tp->sequence_parallel;
    if (m->sequence_parallel && (B * T) % tp_size)  // the trainer refuses this before any work (refuse_layout)
        fatal("gpu model: sequence parallelism needs B * T = %d rows divisible by tp %d", B * T, tp_size);
    m->rows = m->sequence_parallel ? B * T / tp_size : B * T;
    m->table = tp_size > 1 ? param_table_build_tp(cfg, tp_size) : param_table_build(cfg);  // exits 2 unless tp divides
    int vocab = cfg->vocab_size / tp_size;
    m->local = (LocalShape){cfg->n_heads / tp_size, cfg->n_kv_heads / tp_size, cfg->ffn_dim / tp_size, vocab,
                            tp_rank * vocab};
    m->precision = precision;
    m->act_size = precision == GPU_BF16 ? 2 : 4;
    m->B = B, m->T = T;
    m->blocks = mem_alloc(MEM_OTHER, sizeof(GpuBlockActs) * cfg->n_layers);
}

static size_t plan_bytes_tp(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac,
                            bool sharded, const GpuTensorParallel *tp) {
    GpuModel m;
    model_shape_tp(&m, cfg, precision, B, T, ac, tp);
    size_t plan = 0;
    model_buffers(&m, &plan, sharded);
    mem_free(m.blocks);
    param_table_free(&m.table);
    return plan;
}
static size_t plan_bytes(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac,
                         bool sharded) {
    return plan_bytes_tp(cfg, precision, B, T, ac, sharded, NULL);
}

size_t gpu_model_plan_bytes(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac) {
    return plan_bytes(cfg, precision, B, T, ac, false);
}

void gpu_model_init(GpuModel *m, const ModelConfig *cfg, uint64_t seed, GpuPrecision precision, int B, int T) {
    ParamSource init = param_source_seed(seed);
    gpu_model_init_from(m, cfg, &init, precision, B, T, AC_NONE);
}

// Stops before allocating anything if the planned buffers do not fit in the device's free memory
// (sharded: the activations alone; the storage's shards and gathered units are its own to count).
static void check_plan_tp(const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac,
                          bool sharded, const GpuTensorParallel *tp) {
    if (T > cfg->max_seq_len) fatal_input("--seq-len %d: longer than the model's max_seq_len %d", T, cfg->max_seq_len);
    size_t planned = plan_bytes_tp(cfg, precision, B, T, ac, sharded, tp), free_bytes = 0, total_bytes = 0;
    gpu_memory_info(&free_bytes, &total_bytes);
    if (planned > free_bytes)
        fatal("out of GPU memory: the model needs %.2f MiB (%s, batch %d x %d tokens), the device has %.2f MiB free "
              "of %.2f MiB",
              planned / 1048576.0, precision == GPU_BF16 ? "bf16" : "fp32", B, T, free_bytes / 1048576.0,
              total_bytes / 1048576.0);
}

// The block offsets, the units' ranges and their default views (the whole model's buffers; NULL when
// sharded: storage fills them unit by unit).
static void model_layout(GpuModel *m) {
    const ModelConfig *cfg = &m->cfg;
    int L = cfg->n_layers;
    m->offsets = mem_alloc(MEM_OTHER, sizeof(GpuBlockOffsets) * L);
    for (int l = 0; l < L; l++) {
        GpuBlockOffsets *o = &m->offsets[l];
        o->attention_norm = block_offset(&m->table, l, "attention_norm.weight");
        o->wq = block_offset(&m->table, l, projection_param_name(PROJ_WQ));
        o->wk = block_offset(&m->table, l, projection_param_name(PROJ_WK));
        o->wv = block_offset(&m->table, l, projection_param_name(PROJ_WV));
        o->wo = block_offset(&m->table, l, projection_param_name(PROJ_WO));
        o->ffn_norm = block_offset(&m->table, l, "ffn_norm.weight");
        o->w1 = block_offset(&m->table, l, projection_param_name(PROJ_W1));
        o->w2 = block_offset(&m->table, l, projection_param_name(PROJ_W2));
        o->w3 = block_offset(&m->table, l, projection_param_name(PROJ_W3));
        // The fused QKV GEMM reads [wq; wk; wv] as one (hq + 2 hkv, D) weight, and its gradient likewise.
        size_t hd = model_head_dim(cfg), D = cfg->dim;
        if (o->wk != o->wq + m->local.n_heads * hd * D || o->wv != o->wk + m->local.n_kv_heads * hd * D)
            fatal("gpu model: layer %d's wq, wk, wv are not adjacent in the parameter table", l);
    }
    m->tok_embeddings = offset_of(&m->table, "tok_embeddings.weight");
    m->norm = offset_of(&m->table, "norm.weight");
    m->output = cfg->tied ? m->tok_embeddings : offset_of(&m->table, "output.weight");
    m->units = mem_alloc(MEM_OTHER, sizeof(GpuUnitView) * (L + 2));
    for (int i = 0; i < m->table.count; i++) {  // each unit is one contiguous range of the table
        const ParamInfo *p = &m->table.items[i];
        GpuUnitView *v = &m->units[p->layer + 1];
        if (v->numel == 0 || p->offset < v->offset) v->offset = p->offset;
        v->numel += p->numel;
    }
    for (int u = 0; u < L + 2 && m->params; u++) {
        GpuUnitView *v = &m->units[u];
        v->weights = BF16(m) ? (const void *)(m->params_bf16 + v->offset) : (const void *)(m->params + v->offset);
        v->master = m->params + v->offset;
        v->grads = m->grads + v->offset;
    }
}

// What every init does first: refuse what does not fit (before allocating), the shapes (this tp
// rank's), the buffers (sharded: without the weights, gradients and moments).
static void model_setup(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T, ActCheckpoint ac,
                        bool sharded, const GpuTensorParallel *tp) {
    if (tp && tp->size > 1 && precision != GPU_BF16) fatal("gpu model: tensor parallelism runs in GPU_BF16 only");
    check_plan_tp(cfg, precision, B, T, ac, sharded, tp);
    model_shape_tp(m, cfg, precision, B, T, ac, tp);
    m->tp = tp && tp->size > 1 ? tp->group : NULL;
    model_buffers(m, NULL, sharded);
}

void gpu_model_init_tp(GpuModel *m, const ModelConfig *cfg, const ParamSource *init, GpuPrecision precision, int B,
                       int T, ActCheckpoint ac, const GpuTensorParallel *tp) {
    model_setup(m, cfg, precision, B, T, ac, false, tp);
    size_t n = m->table.total_numel;

    // The reference's weights: element j of parameter p is a pure function of (init, p, j), so the
    // ranges can be filled in parallel (under tensor parallelism: this rank's slices of them).
    float *host = mem_alloc(MEM_OTHER, sizeof(float) * n);
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        const size_t chunk = 1 << 20;
#pragma omp parallel for schedule(dynamic, 1)
        for (size_t first = 0; first < p->numel; first += chunk) {
            size_t count = p->numel - first < chunk ? p->numel - first : chunk;
            param_source_fill(init, p, m->tp_rank, m->tp_size, first, count, host + p->offset + first);
        }
    }
    gpu_upload(m->params, host, sizeof(float) * n);
    mem_free(host);
    gpu_model_refresh_compute_copy(m);

    model_layout(m);
}

void gpu_model_init_from(GpuModel *m, const ModelConfig *cfg, const ParamSource *init, GpuPrecision precision, int B,
                         int T, ActCheckpoint ac) {
    gpu_model_init_tp(m, cfg, init, precision, B, T, ac, NULL);
}

void gpu_model_init_sharded_tp(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                               ActCheckpoint ac, const GpuTensorParallel *tp) {
    model_setup(m, cfg, precision, B, T, ac, true, tp);
    model_layout(m);
}

void gpu_model_init_sharded(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                            ActCheckpoint ac) {
    gpu_model_init_sharded_tp(m, cfg, precision, B, T, ac, NULL);
}

// One block's whole activation set (up lives in gate's).
static void block_acts_free(GpuBlockActs *a) {
    void *owned[] = {a->x, a->xn1, a->q, a->k, a->v, a->attn, a->h, a->xn2, a->gate, a->act, a->rstd1, a->rstd2, a->lse};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
}

// a's own buffers (block_owns): the whole set, or its input and (selective) the kept group.
static void block_acts_free_owned(const GpuModel *m, GpuBlockActs *a, bool shared_set) {
    if (block_owns(m, shared_set, BLOCK_RECOMPUTED)) {
        block_acts_free(a);
        return;
    }
    gpu_free(a->x);
    if (block_owns(m, shared_set, BLOCK_KEPT)) {
        void *kept[] = {a->q, a->k, a->v, a->attn, a->h, a->gate, a->lse};
        for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) gpu_free(kept[i]);
    }
}

void gpu_model_free(GpuModel *m) {
    for (int l = m->cfg.n_layers - 1; l >= 0; l--) block_acts_free_owned(m, &m->blocks[l], l == 0);
    void *owned[] = {m->params, m->grads, m->adam_m, m->adam_v, m->params_bf16, m->x_final, m->xn_final,
                     m->logits, m->rstd_final, m->ce_stats, m->qkv, m->dx, m->dxn,
                     m->dq /* and dk, dv */, m->dattn, m->dgate /* and dup */, m->dact, m->dlogits, m->inputs,
                     m->targets, m->loss, m->grad_sum_sq, m->tp_partial, m->tp_row_max, m->tp_sums, m->tp_sq,
                     m->tp_rows, m->sp_rows, m->sp_full, m->sp_norm_grad};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
    gpu_rope_table_free(&m->rope);
    gpu_free(m->positions);
    gpu_free(m->cp_staging);
    mem_free(m->blocks);
    mem_free(m->offsets);
    mem_free(m->units);
    param_table_free(&m->table);
    memset(m, 0, sizeof *m);
}

void gpu_model_set_context_parallel(GpuModel *m, struct ContextParallel *cp, const int *positions) {
    m->cp = cp;
    m->positions = gpu_alloc(MEM_OTHER, sizeof(int) * m->T);
    gpu_upload(m->positions, positions, sizeof(int) * m->T);
    if (BF16(m)) m->cp_staging = gpu_alloc(MEM_ACTIVATIONS, sizeof(float) * (4 * q_elements(m) + 4 * kv_elements(m)));
}

void gpu_model_refresh_compute_copy(GpuModel *m) {
    if (BF16(m) && m->params_bf16) gpu_cast_f32_to_bf16(m->params_bf16, m->params, m->table.total_numel);
}

void gpu_model_zero_grads(GpuModel *m) {
    if (m->grads) gpu_fill_bytes(m->grads, 0, sizeof(float) * m->table.total_numel);  // sharded: the storage's
}

// ---- unit storage: where each unit's weights and gradients are (model.h, GpuUnitView) ---------------------
// Without storage the views are the whole model's buffers and these do nothing. With it, a unit's
// weights are asked for before the unit runs and released after, as reference_cpu's model does, and
// in GPU_BF16 cast to a bf16 copy of the unit alone. The cast: FSDP gathers the fp32 master shards
// (the module's all-gather, the same as the CPU's) and each rank rounds the unit to bf16 here, which
// gives the same bf16 weights the one-GPU model's AdamW writes into params_bf16 (both round to
// nearest even), so a sharded step computes what the single GPU computes. With the module's bf16
// all-gather (chapter 3's fsdp_bf16_codec, the GPU's default) `full` holds bf16 values widened to
// fp32, and the cast gives the same bf16 weights again. The FP8 linears read `full` itself (master).
static void unit_begin(GpuModel *m, int unit, ModelPass pass) {
    if (!m->storage.params) return;
    GpuUnitView *v = &m->units[unit + 1];
    const float *full = m->storage.params(m->storage.ctx, unit, pass);
    v->master = full;
    if (!BF16(m)) {
        v->weights = full;
        return;
    }
    v->cast = gpu_alloc(MEM_PARAMS, sizeof(gpu_bf16) * v->numel);
    gpu_cast_f32_to_bf16(v->cast, full, v->numel);
    v->weights = v->cast;
}

static void unit_end(GpuModel *m, int unit, ModelPass pass) {
    if (!m->storage.params) return;
    GpuUnitView *v = &m->units[unit + 1];
    gpu_free(v->cast);  // stream-ordered: after the kernels that read it
    v->cast = NULL;
    v->weights = NULL;
    v->master = NULL;
    if (m->storage.params_done) m->storage.params_done(m->storage.ctx, unit, pass);
}

// Where backward accumulates the unit's gradients, until grads_ready.
static void unit_grads_begin(GpuModel *m, int unit) {
    if (m->storage.grads) m->units[unit + 1].grads = m->storage.grads(m->storage.ctx, unit);
}

static void unit_grads_ready(GpuModel *m, int unit) {
    if (m->storage.grads) m->units[unit + 1].grads = NULL;
    if (m->grads_ready) m->grads_ready(unit, m->grads_ready_ctx);
}

// ---- tensor parallelism: the sums over the tp group (model.h; nothing runs them without it) ---------------
// A partial result of (BT, D) in m->tp_partial, fp32, summed over the group (comm.h on the device
// buffer): all-reduced in place, or under sequence parallelism reduce-scattered into this rank's rows
// (m->tp_rows). Returns the m->rows rows of the sum that this rank keeps.
static const float *tp_sum_partial(const GpuModel *m) {
    size_t n = (size_t)m->rows * m->cfg.dim;
    if (m->sequence_parallel) {
        comm_reduce_scatter(m->tp, m->tp_partial, m->tp_rows, n, COMM_FLOAT32, COMM_SUM);
        return m->tp_rows;
    }
    comm_all_reduce(m->tp, m->tp_partial, n, COMM_FLOAT32, COMM_SUM);
    return m->tp_partial;
}

// The sum of tp_sum_partial rounded once to bf16 into dst (m->rows rows).
static void tp_sum_into_bf16(const GpuModel *m, void *dst) {
    gpu_cast_f32_to_bf16(dst, tp_sum_partial(m), (size_t)m->rows * m->cfg.dim);
}

// ---- sequence parallelism (model.h): the residual stream's rows, and the (BT, D) tensors around them ----------
// The (BT, D) activations a column-parallel projection (or the embedding's backward) reads, from the
// m->rows rows of this rank: the rows themselves, or under sequence parallelism all-gathered into
// full (bf16 bytes in rank order: rank r's rows are rows [r R, (r + 1) R)).
static const void *gather_rows(const GpuModel *m, const void *rows, void *full) {
    if (!m->sequence_parallel) return rows;
    comm_all_gather(m->tp, rows, full, (size_t)m->rows * m->cfg.dim * m->act_size, COMM_BYTE);
    return full;
}

// out_full (BT, D) = RMSNorm of the rows inp: on this rank's rows, then gathered (sequence parallel).
static void norm_then_gather(const GpuModel *m, void *out_full, float *rstd, const void *inp, const void *w) {
    void *rows = m->sequence_parallel ? m->sp_rows : out_full;
    rmsnorm_fwd(m, rows, rstd, inp, w);
    gather_rows(m, rows, out_full);
}

// RMSNorm's backward on this rank's rows. Under sequence parallelism the weight's gradient from them
// is a partial sum over the sequence: summed over the group before it is accumulated into dw.
static void norm_bwd(const GpuModel *m, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                     const float *rstd) {
    if (!m->sequence_parallel) {
        rmsnorm_bwd(m, dinp, dw, dout, inp, w, rstd);
        return;
    }
    size_t D = m->cfg.dim;
    gpu_fill_bytes(m->sp_norm_grad, 0, sizeof(float) * D);
    rmsnorm_bwd(m, dinp, m->sp_norm_grad, dout, inp, w, rstd);
    comm_all_reduce(m->tp, m->sp_norm_grad, D, COMM_FLOAT32, COMM_SUM);
    gpu_add_inplace(dw, m->sp_norm_grad, D);
}

// ---- forward -----------------------------------------------------------------------------------------------
// The fused launches (fp32 and bf16) and, with FP8 linears on, reference_cpu's separate calls: an FP8
// linear casts its weight with that weight's own tensorwise scale, so [wq; wk; wv] or W1|W3 as one
// operand would change the scales; and the FP8 GEMM's output is stored by a kernel of its own, which
// takes no residual.

// q, k (rotated) and v from xn1. Fused: one GEMM with [wq; wk; wv] into m->qkv (BT, hq + 2 hkv),
// then one kernel that splits it with RoPE (gpu/ops.h; its cost: v's copy, see ops.cu).
static void qkv_forward(const GpuModel *m, const GpuBlockOffsets *o, GpuBlockActs *a) {
    const LocalShape *c = &m->local;
    int BT = m->B * m->T, D = m->cfg.dim, hd = model_head_dim(&m->cfg), hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    if (m->fp8) {
        linear_fwd(m, COLUMN_PARALLEL, a->q, a->xn1, o->wq, BT, D, hq);
        linear_fwd(m, COLUMN_PARALLEL, a->k, a->xn1, o->wk, BT, D, hkv);
        linear_fwd(m, COLUMN_PARALLEL, a->v, a->xn1, o->wv, BT, D, hkv);
        rope(m, a->q, c->n_heads, false);
        rope(m, a->k, c->n_kv_heads, false);
        return;
    }
    matmul_fwd(m, m->qkv, a->xn1, weight(m, o->wq), BT, D, hq + 2 * hkv);
    qkv_split_rope(m, a);
}

// out = residual + inp W^T (W at w_off): the add in the GEMM's epilogue, or a separate add after an
// FP8 linear.
// Tensor parallel (wo, w2 are row-parallel: this rank's heads' or ffn columns' share of the inner
// dimension): the partial product in fp32, summed over the group, then added to the residual and
// rounded once (the epilogue's arithmetic, the sum in another order); under sequence parallelism on
// this rank's rows of out and residual alone.
static void linear_fwd_residual(const GpuModel *m, void *out, const void *residual, const void *inp, size_t w_off,
                                int M, int K, int N) {
    if (m->tp) {
        GpuFp8Groups g = fp8_groups(m, ROW_PARALLEL);
        if (m->fp8) gpu_fp8_linear_forward_partial(m->tp_partial, inp, master_weight(m, w_off), M, K, N, BF16(m), &g);
        else gpu_matmul_forward_bf16_into_f32(m->tp_partial, inp, weight(m, w_off), M, K, N);
        gpu_add_f32_into_bf16(out, residual, tp_sum_partial(m), (size_t)m->rows * N);
        return;
    }
    if (m->fp8) {
        linear_fwd(m, ROW_PARALLEL, out, inp, w_off, M, K, N);
        add(m, out, residual, (size_t)M * N);
        return;
    }
    matmul_fwd_residual(m, out, residual, inp, weight(m, w_off), M, K, N);
}

// gate = xn2 W1^T and up = xn2 W3^T: one strided batch of two products (the weights w3 - w1 apart
// in the table, the outputs BT F apart, the input shared).
static void gate_up_forward(const GpuModel *m, const GpuBlockOffsets *o, GpuBlockActs *a) {
    int BT = m->B * m->T, D = m->cfg.dim, F = m->local.ffn_dim;
    if (m->fp8) {
        linear_fwd(m, COLUMN_PARALLEL, a->gate, a->xn2, o->w1, BT, D, F);
        linear_fwd(m, COLUMN_PARALLEL, a->up, a->xn2, o->w3, BT, D, F);
        return;
    }
    long long w_stride = (long long)o->w3 - (long long)o->w1;
    matmul_fwd_batched(m, a->gate, a->xn2, weight(m, o->w1), BT, D, F, 2, (long long)BT * F, 0, w_stride);
}

// As block_forward: h = x + wo(attention(rope(wq n1), rope(wk n1), wv n1)), n1 = rmsnorm(x);
//                out = h + w2(silu(w1 n2) * w3 n2), n2 = rmsnorm(h)
static void gpu_block_forward(const GpuModel *m, int l, void *out) {
    const GpuBlockOffsets *o = &m->offsets[l];
    GpuBlockActs *a = &m->blocks[l];
    const ModelConfig *c = &m->cfg;
    int BT = m->B * m->T, D = c->dim, F = m->local.ffn_dim, hq = m->local.n_heads * model_head_dim(c);
    norm_then_gather(m, a->xn1, a->rstd1, a->x, weight(m, o->attention_norm));
    qkv_forward(m, o, a);
    attention_fwd(m, a);
    linear_fwd_residual(m, a->h, a->x, a->attn, o->wo, BT, hq, D);
    norm_then_gather(m, a->xn2, a->rstd2, a->h, weight(m, o->ffn_norm));
    gate_up_forward(m, o, a);
    swiglu_fwd(m, a->act, a->gate, a->up, (size_t)BT * F);
    linear_fwd_residual(m, out, a->h, a->act, o->w2, BT, F, D);
}

// The host has the targets: a bad one stops the run here, naming it, which the queued loss could
// only report as NaN.
static void check_targets(const GpuModel *m, const int *targets) {
    int BT = m->B * m->T, V = m->cfg.vocab_size;
    for (int n = 0; n < BT; n++)
        if (targets[n] != IGNORE_INDEX && (targets[n] < 0 || targets[n] >= V))
            fatal("cross-entropy: the target of row %d is outside [0, %d)", n, V);
}

// ---- the embedding and the head, for the whole model and for a pipeline stage ------------------------------
// The buffers they use outside the blocks: the model's own (model_head) or a stage's (stage_head).
typedef struct {
    void *x_final;           // (R, D) the last block's output, the head's input (model.h: R = m->rows)
    void *xn_final, *logits; // (BT, D) the final norm's output, (BT, V) the head's
    float *rstd_final, *ce_stats;  // (R), (BT, 2) the loss's row max and log-sum (ops.h)
    const int *targets;      // device (BT)
} GpuHead;

// x0 = the rows of the tokens (device, BT). Vocab-parallel: this rank's rows of the table (zero rows
// for the other tokens) in fp32, summed over the group (one rank holds each token: exact); under
// sequence parallelism x0 is this rank's rows of that sum.
static void embed_forward(GpuModel *m, const int *inputs, void *x0) {
    int BT = m->B * m->T, D = m->cfg.dim;
    gpu_timeline_begin("embedding fwd", "forward");
    unit_begin(m, LAYER_EMBEDDING, PASS_FORWARD);
    const void *table = weight(m, m->tok_embeddings);
    if (m->tp) {
        gpu_embedding_forward_rows_bf16_into_f32(m->tp_partial, inputs, table, BT, D, m->local.vocab_start,
                                                 m->local.vocab_size);
        tp_sum_into_bf16(m, x0);
    } else if (BF16(m)) gpu_embedding_forward_bf16(x0, inputs, table, BT, D);
    else gpu_embedding_forward(x0, inputs, table, BT, D);
    unit_end(m, LAYER_EMBEDDING, PASS_FORWARD);
    gpu_timeline_end();
}

// The mean loss into m->loss. Vocab-parallel (tp.c's loss_forward on the device): per token the max
// over the whole vocabulary (all-reduce MAX), then this rank's sum of exp(logit - max) and the target's
// logit where this rank holds it (one all-reduce SUM of both), then the row stats and the mean.
static void loss_forward(GpuModel *m, const GpuHead *h) {
    int BT = m->B * m->T, V = m->local.vocab_size;
    if (m->tp) {
        gpu_vocab_parallel_row_max_bf16(m->tp_row_max, h->logits, BT, V);
        comm_all_reduce(m->tp, m->tp_row_max, (size_t)BT, COMM_FLOAT32, COMM_MAX);
        gpu_vocab_parallel_sums_bf16(m->tp_sums, h->logits, m->tp_row_max, h->targets, BT, m->local.vocab_start, V);
        comm_all_reduce(m->tp, m->tp_sums, 2 * (size_t)BT, COMM_FLOAT64, COMM_SUM);
        gpu_vocab_parallel_loss(m->loss, h->ce_stats, m->tp_row_max, m->tp_sums, h->targets, BT);
    } else if (BF16(m)) gpu_cross_entropy_forward_into_bf16(m->loss, h->ce_stats, h->logits, h->targets, BT, V);
    else gpu_cross_entropy_forward_into(m->loss, h->ce_stats, h->logits, h->targets, BT, V);
}

// The final norm, the output projection and the loss (into m->loss, queued).
static void head_forward(GpuModel *m, const GpuHead *h) {
    const ModelConfig *c = &m->cfg;
    int BT = m->B * m->T, D = c->dim, V = m->local.vocab_size, L = c->n_layers;
    gpu_timeline_begin("head fwd + loss", "forward");
    unit_begin(m, L, PASS_FORWARD);
    if (c->tied) unit_begin(m, LAYER_EMBEDDING, PASS_FORWARD);  // the output projection is tok_embeddings
    norm_then_gather(m, h->xn_final, h->rstd_final, h->x_final, weight(m, m->norm));
    matmul_fwd(m, h->logits, h->xn_final, weight(m, m->output), BT, D, V);
    if (c->tied) unit_end(m, LAYER_EMBEDDING, PASS_FORWARD);
    unit_end(m, L, PASS_FORWARD);
    loss_forward(m, h);
    gpu_timeline_end();
}

static GpuHead model_head(const GpuModel *m) {
    return (GpuHead){m->x_final, m->xn_final, m->logits, m->rstd_final, m->ce_stats, m->targets};
}

// Blocks [first, end) on m->blocks (each reads its x, the next block's x is its output), the last
// block's output to out.
static void blocks_forward(GpuModel *m, int first, int end, void *out) {
    for (int l = first; l < end; l++) {
        gpu_timeline_begin("block fwd", "forward");
        gpu_timeline_arg_int("layer", l);
        unit_begin(m, l, PASS_FORWARD);
        gpu_block_forward(m, l, l + 1 < end ? m->blocks[l + 1].x : out);
        unit_end(m, l, PASS_FORWARD);
        gpu_timeline_end();
    }
}

void gpu_model_forward_queued(GpuModel *m, const int *inputs, const int *targets) {
    int BT = m->B * m->T;
    check_targets(m, targets);
    gpu_upload_queued(m->inputs, inputs, sizeof(int) * BT);
    gpu_upload_queued(m->targets, targets, sizeof(int) * BT);
    embed_forward(m, m->inputs, m->blocks[0].x);
    blocks_forward(m, 0, m->cfg.n_layers, m->x_final);
    GpuHead head = model_head(m);
    head_forward(m, &head);
}

double gpu_model_loss(const GpuModel *m) {
    double loss;
    gpu_download(&loss, m->loss, sizeof loss);
    return loss;
}

double gpu_model_forward(GpuModel *m, const int *inputs, const int *targets) {
    gpu_model_forward_queued(m, inputs, targets);
    return gpu_model_loss(m);
}

// ---- backward ----------------------------------------------------------------------------------------------
// dxn = dqkv [wq; wk; wv] (overwriting) and d[wq; wk; wv] += dqkv^T xn1, from dq, dk, dv (rotated
// back): fused, one merge kernel into m->qkv (reused: forward is done with it) and one GEMM of each
// kind over hq + 2 hkv outputs. The input gradient's inner dimension runs over q's, then k's, then
// v's columns, as the reference's three accumulating calls do.
// Tensor parallel (column-parallel: this rank's heads): dxn is this rank's partial sum, in fp32,
// summed over the group before the norm's backward reads it.
static void qkv_backward(const GpuModel *m, const GpuBlockOffsets *o, const GpuBlockActs *a) {
    const LocalShape *c = &m->local;
    int BT = m->B * m->T, D = m->cfg.dim, hd = model_head_dim(&m->cfg), hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    if (m->fp8) {
        rope(m, m->dq, c->n_heads, true);
        rope(m, m->dk, c->n_kv_heads, true);
        if (m->tp) {  // the three products into one fp32 partial sum, summed over the group
            linear_bwd_input_partial(m, false, m->dq, o->wq, BT, D, hq);
            linear_bwd_input_partial(m, true, m->dk, o->wk, BT, D, hkv);
            linear_bwd_input_partial(m, true, m->dv, o->wv, BT, D, hkv);
            tp_sum_into_bf16(m, m->dxn);
        } else {
            linear_bwd(m, COLUMN_PARALLEL, m->dxn, true, NULL, m->dq, a->xn1, o->wq, BT, D, hq);
            linear_bwd(m, COLUMN_PARALLEL, m->dxn, false, NULL, m->dk, a->xn1, o->wk, BT, D, hkv);
            linear_bwd(m, COLUMN_PARALLEL, m->dxn, false, NULL, m->dv, a->xn1, o->wv, BT, D, hkv);
        }
        linear_bwd(m, COLUMN_PARALLEL, NULL, false, grad(m, o->wq), m->dq, a->xn1, o->wq, BT, D, hq);
        linear_bwd(m, COLUMN_PARALLEL, NULL, false, grad(m, o->wk), m->dk, a->xn1, o->wk, BT, D, hkv);
        linear_bwd(m, COLUMN_PARALLEL, NULL, false, grad(m, o->wv), m->dv, a->xn1, o->wv, BT, D, hkv);
        return;
    }
    qkv_merge_rope_bwd(m);
    if (m->tp) {
        linear_bwd_input_partial(m, false, m->qkv, o->wq, BT, D, hq + 2 * hkv);
        tp_sum_into_bf16(m, m->dxn);
        matmul_bwd(m, NULL, grad(m, o->wq), m->qkv, a->xn1, weight(m, o->wq), BT, D, hq + 2 * hkv);
        return;
    }
    matmul_bwd_first(m, m->dxn, grad(m, o->wq), m->qkv, a->xn1, weight(m, o->wq), BT, D, hq + 2 * hkv);
}

// dxn = dgate W1 (overwriting) + dup W3: two GEMMs, the first writer with beta = 0 (a sum of two
// products with different weights is not a strided batch); dW1, dW3 += (dgate, dup)^T xn2: one
// strided batch of two products (the gradients w3 - w1 apart, as the weights).
// Tensor parallel (column-parallel: this rank's ffn columns): both products into one fp32 partial
// sum, summed over the group, rounded once into dxn.
static void gate_up_backward(const GpuModel *m, const GpuBlockOffsets *o, const GpuBlockActs *a) {
    int BT = m->B * m->T, D = m->cfg.dim, F = m->local.ffn_dim;
    if (m->tp) {
        linear_bwd_input_partial(m, false, m->dgate, o->w1, BT, D, F);
        linear_bwd_input_partial(m, true, m->dup, o->w3, BT, D, F);
        tp_sum_into_bf16(m, m->dxn);
    } else {
        linear_bwd(m, COLUMN_PARALLEL, m->dxn, true, NULL, m->dgate, a->xn2, o->w1, BT, D, F);
        linear_bwd(m, COLUMN_PARALLEL, m->dxn, false, NULL, m->dup, a->xn2, o->w3, BT, D, F);
    }
    if (m->fp8) {
        linear_bwd(m, COLUMN_PARALLEL, NULL, false, grad(m, o->w1), m->dgate, a->xn2, o->w1, BT, D, F);
        linear_bwd(m, COLUMN_PARALLEL, NULL, false, grad(m, o->w3), m->dup, a->xn2, o->w3, BT, D, F);
        return;
    }
    long long stride = (long long)o->w3 - (long long)o->w1;
    matmul_bwd_weight_batched(m, grad(m, o->w1), m->dgate, a->xn2, BT, D, F, 2, stride, (long long)BT * F, 0);
}

// As block_backward. dx (BT, D) holds the gradient of the block's output on entry and of its input on
// return: each residual passes the gradient through unchanged, so each half adds its branch's input
// gradient (its norm's backward) to dx in place, where the reference copies dout to dh and dh to
// dinp before adding the same values.
static void gpu_block_backward(const GpuModel *m, int l, void *dx) {
    const GpuBlockOffsets *o = &m->offsets[l];
    const GpuBlockActs *a = &m->blocks[l];
    const ModelConfig *c = &m->cfg;
    int BT = m->B * m->T, D = c->dim, F = m->local.ffn_dim, hd = model_head_dim(c);
    int hq = m->local.n_heads * hd, hkv = m->local.n_kv_heads * hd;
    // feed-forward half, in reverse: w2's gradients read dx (sequence parallel: its rows gathered)
    // before the ffn norm's backward adds to it
    const void *dout = gather_rows(m, dx, m->sp_full);
    linear_bwd(m, ROW_PARALLEL, m->dact, true, grad(m, o->w2), dout, a->act, o->w2, BT, F, D);
    swiglu_bwd(m, m->dgate, m->dup, m->dact, a->gate, a->up, (size_t)BT * F);
    gate_up_backward(m, o, a);
    norm_bwd(m, dx, grad(m, o->ffn_norm), m->dxn, a->h, weight(m, o->ffn_norm), a->rstd2);  // dx is dh now
    // attention half
    const void *dh = gather_rows(m, dx, m->sp_full);
    linear_bwd(m, ROW_PARALLEL, m->dattn, true, grad(m, o->wo), dh, a->attn, o->wo, BT, hq, D);
    zero(m, m->dq, (size_t)BT * (hq + 2 * hkv));  // dq, dk, dv: attention's backward accumulates
    attention_bwd(m, a);
    qkv_backward(m, o, a);
    norm_bwd(m, dx, grad(m, o->attention_norm), m->dxn, a->x, weight(m, o->attention_norm), a->rstd1);
}

// dlogits = the loss's gradient, dxn = dlogits W_out (the head's input gradient). Vocab-parallel: on
// this rank's columns (the stats are the whole row's), and dxn summed over the group in fp32.
static void loss_and_logits_backward(GpuModel *m, const GpuHead *h, double dloss) {
    int BT = m->B * m->T, D = m->cfg.dim, V = m->local.vocab_size;
    if (m->tp) {
        gpu_cross_entropy_backward_columns_bf16(m->dlogits, h->logits, h->ce_stats, h->targets, BT,
                                                m->local.vocab_start, V, dloss);
        gpu_matmul_backward_input_bf16_into_f32(m->tp_partial, m->dlogits, weight(m, m->output), BT, D, V, false);
        tp_sum_into_bf16(m, m->dxn);
        return;
    }
    if (BF16(m)) gpu_cross_entropy_backward_bf16(m->dlogits, h->logits, h->ce_stats, h->targets, BT, V, dloss);
    else gpu_cross_entropy_backward(m->dlogits, h->logits, h->ce_stats, h->targets, BT, V, dloss);
    matmul_bwd_first(m, m->dxn, NULL, m->dlogits, h->xn_final, weight(m, m->output), BT, D, V);
}

// The head's backward (model_head_backward): loss -> logits -> final norm, into dx (overwritten).
// Tied: the embedding's gradients are asked for here and reported with the lookup's (embed_backward).
static void head_backward(GpuModel *m, const GpuHead *h, void *dx, double dloss) {
    const ModelConfig *c = &m->cfg;
    int BT = m->B * m->T, D = c->dim, V = m->local.vocab_size, L = c->n_layers;
    gpu_timeline_begin("head bwd", "backward");
    unit_begin(m, L, PASS_BACKWARD);
    unit_grads_begin(m, L);
    if (c->tied) unit_begin(m, LAYER_EMBEDDING, PASS_BACKWARD), unit_grads_begin(m, LAYER_EMBEDDING);
    loss_and_logits_backward(m, h, dloss);
    matmul_bwd(m, NULL, grad(m, m->output), m->dlogits, h->xn_final, weight(m, m->output), BT, D, V);
    zero(m, dx, (size_t)m->rows * D);  // RMSNorm's backward accumulates
    norm_bwd(m, dx, grad(m, m->norm), m->dxn, h->x_final, weight(m, m->norm), h->rstd_final);
    if (c->tied) unit_end(m, LAYER_EMBEDDING, PASS_BACKWARD);
    unit_end(m, L, PASS_BACKWARD);
    gpu_timeline_end();
    unit_grads_ready(m, L);  // tied: the output weight's gradient is tok_embeddings', ready with the embedding
}

// The lookup's backward (model_embed_backward) into this rank's rows of the table (vocab-parallel:
// only its tokens), from dx (the first block input's gradient) and the forward's tokens (device).
// Tied: after the output projection's contribution, as the reference.
static void embed_backward(GpuModel *m, const int *inputs, const void *dx) {
    int BT = m->B * m->T, D = m->cfg.dim;
    gpu_timeline_begin("embedding bwd", "backward");
    if (!m->cfg.tied) unit_grads_begin(m, LAYER_EMBEDDING);  // tied: since the head's backward
    float *dtable = grad(m, m->tok_embeddings);
    if (m->tp)
        gpu_embedding_backward_rows_bf16(dtable, gather_rows(m, dx, m->sp_full), inputs, BT, D, m->local.vocab_start,
                                         m->local.vocab_size);
    else if (BF16(m)) gpu_embedding_backward_bf16(dtable, dx, inputs, BT, D);
    else gpu_embedding_backward(dtable, dx, inputs, BT, D);
    gpu_timeline_end();
    unit_grads_ready(m, LAYER_EMBEDDING);
}

// Selective checkpointing (block_recompute_selective): the norms from the kept x and h, SwiGLU from
// the kept gate and up, with block_forward's kernels on the same inputs (the same bits).
static void gpu_block_recompute_selective(const GpuModel *m, int l) {
    const GpuBlockOffsets *o = &m->offsets[l];
    GpuBlockActs *a = &m->blocks[l];
    norm_then_gather(m, a->xn1, a->rstd1, a->x, weight(m, o->attention_norm));
    norm_then_gather(m, a->xn2, a->rstd2, a->h, weight(m, o->ffn_norm));
    swiglu_fwd(m, a->act, a->gate, a->up, (size_t)m->B * m->T * m->local.ffn_dim);
}

// Block l's backward as a unit: its weights and gradient buffers asked for, with recompute (AC)
// its activations again first, dx (the gradient of its output) turned into its input's in place, and
// its gradients reported final. The recompute rebuilds what the block does not own (block_owns) into
// the shared set (the last block's are still there from forward). Full: the whole block from its
// saved input; its output, unread, goes to x_final, which the head's backward has read already and
// the next forward writes again. The same kernels on the same inputs: the same bits.
static void block_backward_unit(GpuModel *m, int l, void *dx, bool recompute) {
    unit_begin(m, l, PASS_BACKWARD);
    unit_grads_begin(m, l);
    if (recompute) {
        gpu_timeline_begin("block recompute", "recompute");
        gpu_timeline_arg_int("layer", l);
        if (m->ac == AC_FULL) gpu_block_forward(m, l, m->x_final);
        else gpu_block_recompute_selective(m, l);
        gpu_timeline_end();
    }
    gpu_timeline_begin("block bwd", "backward");
    gpu_timeline_arg_int("layer", l);
    gpu_block_backward(m, l, dx);
    unit_end(m, l, PASS_BACKWARD);
    gpu_timeline_end();
    unit_grads_ready(m, l);
}

// Blocks [first, end) on m->blocks, last to first (model_blocks_backward), each turning dx into its
// input's gradient in place. AC recomputes every block but the model's last, whose activations
// forward left in the shared set; a pipeline stage (recompute_all) recomputes every block, since other
// micro-batches' forwards have used the shared set since.
static void blocks_backward(GpuModel *m, int first, int end, void *dx, bool recompute_all) {
    for (int l = end - 1; l >= first; l--)
        block_backward_unit(m, l, dx, m->ac != AC_NONE && (recompute_all || l < m->cfg.n_layers - 1));
}

void gpu_model_backward(GpuModel *m, double dloss) {
    GpuHead head = model_head(m);
    head_backward(m, &head, m->dx, dloss);
    blocks_backward(m, 0, m->cfg.n_layers, m->dx, false);
    embed_backward(m, m->inputs, m->dx);
}

// ---- optimizer step ----------------------------------------------------------------------------------------
// Under tensor parallelism, as tp_sum_of_squares (chapters/06_tensor_parallel/tp.c): each table entry's
// sum of squares on the device, all brought back with one wait; the tp-split entries' summed over the
// group, the replicated ones (the norm weights, the same on every tp rank) counted once.
static double tp_grad_sum_sq(const GpuModel *m) {
    const ParamTable *t = &m->table;
    for (int i = 0; i < t->count; i++)
        gpu_sum_of_squares_into(m->tp_sq + i, m->grads + t->items[i].offset, t->items[i].numel);
    double *per_entry = mem_alloc(MEM_OTHER, sizeof(double) * t->count);
    gpu_download(per_entry, m->tp_sq, sizeof(double) * t->count);
    double sums[2] = {0, 0};  // tp-split, replicated
    for (int i = 0; i < t->count; i++) sums[t->items[i].tp_split == TP_NONE] += per_entry[i];
    mem_free(per_entry);
    comm_all_reduce(m->tp, sums, 1, COMM_FLOAT64, COMM_SUM);  // the split entries only
    return sums[0] + sums[1];
}

double gpu_model_grad_sum_sq(const GpuModel *m) {
    if (!m->grads) fatal("gpu_model_grad_sum_sq: a sharded model's gradients are its storage's");
    return m->tp ? tp_grad_sum_sq(m) : gpu_sum_of_squares(m->grads, m->table.total_numel);
}

void gpu_model_step(GpuModel *m, long long step, double lr, const AdamWConfig *adam, double max_norm) {
    if (!m->params) fatal("gpu_model_step: a sharded model steps through its storage (chapter 3's module)");
    size_t n = m->table.total_numel;
    gpu_timeline_begin("optimizer", "optimizer");
    if (m->tp) {  // the group's sum needs the host (one wait), then it goes back where AdamW reads it
        double sum_sq = tp_grad_sum_sq(m);
        gpu_upload(m->grad_sum_sq, &sum_sq, sizeof sum_sq);
    } else gpu_sum_of_squares_into(m->grad_sum_sq, m->grads, n);
    gpu_adamw_step_clipped(m->params, m->params_bf16, m->grads, m->adam_m, m->adam_v, n, step, lr, adam,
                           m->grad_sum_sq, max_norm);  // clip_by_global_norm, folded in
    gpu_timeline_end();
}

double gpu_model_grad_norm(const GpuModel *m) {
    double sum_sq;
    gpu_download(&sum_sq, m->grad_sum_sq, sizeof sum_sq);
    return sqrt(sum_sq);
}

// ---- pipeline stages (model.h, GpuStageActs) ----------------------------------------------------------------
// The functions gpu_model_forward_queued and gpu_model_backward call (embed_forward, blocks_forward,
// head_forward, and their backwards), on one (chunk, micro-batch)'s activations. The block functions read m->blocks[l]: a stage's blocks are installed there for the
// call (an array of n_layers whose [first, end) the stage allocated) and the model's own put back.

void gpu_model_init_stages(GpuModel *m, const ModelConfig *cfg, GpuPrecision precision, int B, int T,
                           ActCheckpoint ac, const GpuTensorParallel *tp) {
    gpu_model_init_sharded_tp(m, cfg, precision, B, T, AC_NONE, tp);
    // With AC, block 0's set stays as the shared set every stage's blocks recompute into, less what
    // those blocks own themselves (block_owns), and x_final as the sink of a full recompute's unread
    // output.
    for (int l = ac == AC_NONE ? 0 : 1; l < cfg->n_layers; l++) {
        GpuBlockActs *a = &m->blocks[l];
        block_acts_free(a);
        memset(a, 0, sizeof *a);
    }
    m->ac = ac;
    if (ac != AC_NONE) {
        GpuBlockActs *shared = &m->blocks[0], all = *shared;
        block_acts_free_owned(m, shared, false);
        if (ac == AC_FULL) shared->x = NULL;  // all but the input
        else *shared = (GpuBlockActs){.xn1 = all.xn1, .xn2 = all.xn2, .act = all.act, .rstd1 = all.rstd1,
                                      .rstd2 = all.rstd2};  // the recomputed group
    }
    void **held[] = {&m->xn_final, &m->logits, (void **)&m->rstd_final, (void **)&m->ce_stats, &m->dx,
                     (void **)&m->inputs, (void **)&m->targets, ac == AC_FULL ? NULL : &m->x_final};
    for (size_t i = 0; i < sizeof held / sizeof held[0]; i++)
        if (held[i]) gpu_free(*held[i]), *held[i] = NULL;
}

GpuStageActs *gpu_model_stage_acts_alloc(const GpuModel *m, int first, int end) {
    const ModelConfig *cfg = &m->cfg;
    size_t BT = (size_t)m->B * m->T, R = (size_t)m->rows, D = cfg->dim, V = m->local.vocab_size, as = m->act_size;
    GpuStageActs *s = mem_alloc(MEM_OTHER, sizeof *s);
    s->first = first, s->end = end;
    s->blocks = mem_alloc(MEM_OTHER, sizeof(GpuBlockActs) * cfg->n_layers);
    for (int l = first; l < end; l++) {  // as model_buffers; with AC, around the model's shared set
        GpuBlockActs *a = &s->blocks[l];
        if (m->ac != AC_NONE) *a = m->blocks[0];
        block_acts_alloc(m, a, false, NULL);
    }
#define ACTS(count) gpu_alloc(MEM_ACTIVATIONS, (count) * as)
#define STATS(count) (float *)gpu_alloc(MEM_ACTIVATIONS, (count) * sizeof(float))
    s->out = ACTS(R * D), s->dx = ACTS(R * D);  // the residual stream's rows here (model.h)
    if (first == 0) s->inputs = gpu_alloc(MEM_OTHER, sizeof(int) * BT);
    if (end == cfg->n_layers) {
        s->xn_final = ACTS(BT * D), s->logits = ACTS(BT * V);
        s->rstd_final = STATS(R), s->ce_stats = STATS(2 * BT);
        s->targets = gpu_alloc(MEM_OTHER, sizeof(int) * BT);
    }
#undef ACTS
#undef STATS
    return s;
}

void gpu_model_stage_acts_free(const GpuModel *m, GpuStageActs *s) {
    if (!s) return;
    for (int l = s->first; l < s->end; l++) block_acts_free_owned(m, &s->blocks[l], false);
    void *owned[] = {s->out, s->dx, s->inputs, s->xn_final, s->logits, s->rstd_final, s->ce_stats, s->targets};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) gpu_free(owned[i]);
    mem_free(s->blocks);
    mem_free(s);
}

void gpu_model_stage_embed_forward(GpuModel *m, GpuStageActs *s, const int *inputs) {
    gpu_upload_queued(s->inputs, inputs, sizeof(int) * m->B * m->T);
    embed_forward(m, s->inputs, s->blocks[0].x);
}

void gpu_model_stage_blocks_forward(GpuModel *m, GpuStageActs *s) {
    GpuBlockActs *own = m->blocks;
    m->blocks = s->blocks;
    blocks_forward(m, s->first, s->end, s->out);
    m->blocks = own;
}

static GpuHead stage_head(const GpuStageActs *s) {
    return (GpuHead){s->out, s->xn_final, s->logits, s->rstd_final, s->ce_stats, s->targets};
}

double gpu_model_stage_head_forward(GpuModel *m, GpuStageActs *s, const int *targets) {
    if (m->cfg.tied) fatal("gpu model: a pipeline's head needs its own output weight (untied)");
    check_targets(m, targets);
    gpu_upload_queued(s->targets, targets, sizeof(int) * m->B * m->T);
    GpuHead head = stage_head(s);
    head_forward(m, &head);
    return gpu_model_loss(m);
}

void gpu_model_stage_head_backward(GpuModel *m, GpuStageActs *s, double dloss) {
    GpuHead head = stage_head(s);
    head_backward(m, &head, s->dx, dloss);
}

void gpu_model_stage_blocks_backward(GpuModel *m, GpuStageActs *s) {
    GpuBlockActs *own = m->blocks;
    m->blocks = s->blocks;
    blocks_backward(m, s->first, s->end, s->dx, true);
    m->blocks = own;
}

void gpu_model_stage_embed_backward(GpuModel *m, GpuStageActs *s) { embed_backward(m, s->inputs, s->dx); }
