#include "reference_cpu/model.h"

#include <stddef.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"


void model_init_shapes(Model *m, const ModelConfig *cfg, AttentionImpl attention, int tp_size, int tp_rank) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->table = param_table_build_tp(cfg, tp_size);
    m->attention = attention;
    m->tp = (TensorParallel){.size = tp_size, .rank = tp_rank};
    int vocab = cfg->vocab_size / tp_size;
    m->local = (LocalShape){cfg->n_heads / tp_size, cfg->n_kv_heads / tp_size, cfg->ffn_dim / tp_size, vocab,
                            tp_rank * vocab};
}

void model_init_tp(Model *m, const ModelConfig *cfg, const ParamSource *init, AttentionImpl attention, int tp_size,
                   int tp_rank, bool allocate) {
    model_init_shapes(m, cfg, attention, tp_size, tp_rank);
    m->rope = rope_table_build(cfg->max_seq_len, model_head_dim(cfg), cfg->rope_theta, cfg->rope_scaling_factor,
                               cfg->rope_low_freq_factor, cfg->rope_high_freq_factor, cfg->rope_original_max_seq_len);
    if (!allocate) return;
    m->params = mem_alloc(MEM_PARAMS, sizeof(real) * m->table.total_numel);
    m->grads = mem_alloc(MEM_GRADS, sizeof(real) * m->table.total_numel);
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        param_source_fill(init, p, tp_rank, tp_size, 0, p->numel, m->params + p->offset);
    }
}

void model_init_unallocated(Model *m, const ModelConfig *cfg, AttentionImpl attention) {
    model_init_tp(m, cfg, NULL, attention, 1, 0, false);
}

void model_init(Model *m, const ModelConfig *cfg, uint64_t seed, AttentionImpl attention) {
    ParamSource init = param_source_seed(seed);
    model_init_tp(m, cfg, &init, attention, 1, 0, true);
}

// ---- tensor parallelism: the sums over the tp group (nothing without it) ------------------------
static void *tp_sum_start(const Model *m, real *buf, size_t n) {
    return m->tp.size > 1 ? m->tp.sum_start(m->tp.ctx, buf, n) : NULL;
}

static void tp_wait(const Model *m, void *pending) {
    if (pending) m->tp.wait(m->tp.ctx, pending);
}

static void tp_sum(const Model *m, real *buf, size_t n) { tp_wait(m, tp_sum_start(m, buf, n)); }

int model_rows_here(const Model *m, int B, int T) { return m->tp.sequence_parallel ? B * T / m->tp.size : B * T; }

// The (BT, D) rows a column-parallel linear reads, from this rank's R rows: the rows themselves,
// or (sequence parallel) all-gathered into `full`.
static const real *gather_rows(const Model *m, const real *rows, real *full, size_t rows_n) {
    if (!m->tp.sequence_parallel) return rows;
    tp_wait(m, m->tp.gather_start(m->tp.ctx, rows, full, rows_n));
    return full;
}

// Where a row-parallel linear writes its partial (BT, D) sums: straight into the R rows they sum
// into (no sequence parallelism: R = BT, summed in place), or into the shared `full` buffer,
// reduce-scattered by sum_partial_start.
static real *partial_target(const Model *m, real *rows, real *full) { return m->tp.sequence_parallel ? full : rows; }

static void *sum_partial_start(const Model *m, real *partial, real *rows, size_t rows_n) {
    if (!m->tp.sequence_parallel) return tp_sum_start(m, rows, rows_n);
    return m->tp.sum_scatter_start(m->tp.ctx, partial, rows, rows_n);
}

// RMSNorm on this rank's R rows, then the full (BT, D) output a column-parallel linear reads.
static void norm_then_gather(const Model *m, ModelActs *s, real *out_full, real *rstd, const real *inp,
                             const real *weight, int R, int D) {
    real *rows = m->tp.sequence_parallel ? s->sp_rows : out_full;
    rmsnorm_forward(rows, rstd, inp, weight, R, D, m->cfg.norm_eps);
    gather_rows(m, rows, out_full, (size_t)R * D);
}

// RMSNorm backward on this rank's R rows. Under sequence parallelism the weight's gradient from
// these rows is a partial sum over the sequence: summed over tp before it is accumulated.
static void norm_backward(const Model *m, ModelActs *s, real *dinp, real *dweight, const real *dout, const real *inp,
                          const real *weight, const real *rstd, int R, int D) {
    if (!m->tp.sequence_parallel) {
        rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, R, D);
        return;
    }
    zero_fill(s->sp_norm_grad, (size_t)D);
    rmsnorm_backward(dinp, s->sp_norm_grad, dout, inp, weight, rstd, R, D);
    tp_sum(m, s->sp_norm_grad, (size_t)D);
    add_inplace(dweight, s->sp_norm_grad, (size_t)D);
}

// Forward FLOPs of one block on this rank (the trace's "flops" argument).
static double block_flops_here(const Model *m, int B, int T) {
    return model_block_forward_flops(&m->cfg, B, T) / m->tp.size;
}

void model_free(Model *m) {
    mem_free(m->params);
    mem_free(m->grads);
    rope_table_free(&m->rope);
    param_table_free(&m->table);
}

void model_zero_grads(Model *m) {
    if (m->grads) zero_fill(m->grads, m->table.total_numel);
}

size_t model_unit_offset(const Model *m, int unit) {
    int first, end;
    param_table_layer_range(&m->table, unit, &first, &end);
    return m->table.items[first].offset;
}

size_t model_unit_numel(const Model *m, int unit) {
    int first, end;
    param_table_layer_range(&m->table, unit, &first, &end);
    const ParamInfo *last = &m->table.items[end - 1];
    return last->offset + last->numel - m->table.items[first].offset;
}

BlockWeights block_weights(const Model *m, real *unit_buffer, int layer) {
    int first, end;
    param_table_layer_range(&m->table, layer, &first, &end);
    const ParamInfo *p = &m->table.items[first];  // the table order of params.h
    size_t base = p[0].offset;
    real *u = unit_buffer;
    BlockWeights w = {u + p[0].offset - base, u + p[1].offset - base, u + p[2].offset - base,
                      u + p[3].offset - base, u + p[4].offset - base, u + p[5].offset - base,
                      u + p[6].offset - base, u + p[7].offset - base, u + p[8].offset - base, layer};
    return w;
}

// ---- unit storage: the default is the flat buffers; FSDP installs its own ----------------------
static const real *unit_params(const Model *m, int unit, ModelPass pass) {
    if (m->storage.params) return m->storage.params(m->storage.ctx, unit, pass);
    return m->params + model_unit_offset(m, unit);
}

static void unit_params_done(const Model *m, int unit, ModelPass pass) {
    if (m->storage.params_done) m->storage.params_done(m->storage.ctx, unit, pass);
}

static real *unit_grads(const Model *m, int unit) {
    if (m->storage.grads) return m->storage.grads(m->storage.ctx, unit);
    return m->grads + model_unit_offset(m, unit);
}

// A tensor of `unit` by name, inside that unit's buffer.
static real *unit_tensor(const Model *m, const real *unit_buffer, int unit, const char *name) {
    const ParamInfo *p = param_table_find(&m->table, name);
    return (real *)unit_buffer + (p->offset - model_unit_offset(m, unit));
}

// ---- activations ---------------------------------------------------------------------------------
static real *alloc_acts(size_t n) { return mem_alloc(MEM_ACTIVATIONS, sizeof(real) * n); }

// The fields of BlockActs, with their sizes and which checkpointing modes keep them per block.
typedef struct {
    size_t offset;     // offsetof(BlockActs, field)
    size_t numel;
    bool kept_full, kept_selective;
} ActField;

#define N_ACT_FIELDS 14

// Selective policy: keep the block input, the matmul outputs (q, k, v after RoPE, gate, up), the
// attention output with its log-sum-exp and the residual h; recompute the RMSNorms and SwiGLU
// (element-wise, cheap) and, with naive attention, the (T, T) probabilities.
static void act_fields(const Model *m, int B, int T, ActField f[N_ACT_FIELDS]) {
    const ModelConfig *c = &m->cfg;
    const LocalShape *s = &m->local;
    size_t BT = (size_t)B * T, D = c->dim, F = s->ffn_dim, R = (size_t)model_rows_here(m, B, T);
    size_t hq = (size_t)s->n_heads * model_head_dim(c), hkv = (size_t)s->n_kv_heads * model_head_dim(c);
    bool naive = m->attention == ATTN_NAIVE;
    size_t stats = naive ? (size_t)B * s->n_heads * T * T : (size_t)B * s->n_heads * T;
#define FIELD(i, name, n, full, sel) f[i] = (ActField){offsetof(BlockActs, name), (n), (full), (sel)}
    // LAB ac: the 14 fields of BlockActs in order (x xn1 rstd1 q k v attn attn_stats h xn2 rstd2 gate up act) with their sizes; full keeps only the block input x; selective keeps x, the matmul outputs q k v gate up, attn, h, and the attention statistics unless attention is naive (its (T, T) probabilities are recomputed)
    LAB_HOLE("ac", "the 14 fields of BlockActs in order (x xn1 rstd1 q k v attn attn_stats h xn2 rstd2 gate up act) with their sizes; full keeps only the block input x; selective keeps x, the matmul outputs q k v gate up, attn, h, and the attention statistics unless attention is naive (its (T, T) probabilities are recomputed)");
    // END LAB
#undef FIELD
}

static bool field_kept(const ActField *f, ActCheckpoint ac) {
    return ac == AC_NONE || (ac == AC_FULL ? f->kept_full : f->kept_selective);
}

static real **field_ptr(BlockActs *b, const ActField *f) { return (real **)((char *)b + f->offset); }

size_t model_acts_bytes_per_block(const Model *m, int B, int T, ActCheckpoint ac) {
    ActField f[N_ACT_FIELDS];
    act_fields(m, B, T, f);
    size_t n = 0;
    for (int i = 0; i < N_ACT_FIELDS; i++)
        if (field_kept(&f[i], ac)) n += f[i].numel;
    return n * sizeof(real);
}

void model_recompute_flops(const Model *m, int B, int T, ActCheckpoint ac, double *matmul_flops,
                           double *elementwise_flops) {
    const ModelConfig *c = &m->cfg;
    double BT = (double)B * T, hq = (double)m->local.n_heads * model_head_dim(c);
    // element-wise cost, counted per element: RMSNorm 4 (square, add, two multiplies), SwiGLU 5
    // (exp, add, divide, two multiplies)
    double norms = 2 * 4 * BT * c->dim, swiglu = 5 * BT * m->local.ffn_dim;
    *matmul_flops = *elementwise_flops = 0;
    if (ac == AC_FULL) {
        *matmul_flops = block_flops_here(m, B, T);
        *elementwise_flops = norms + swiglu;
    } else if (ac == AC_SELECTIVE) {
        if (m->attention == ATTN_NAIVE) *matmul_flops = 2.0 * B * hq * (double)T * T;  // QK^T and PV again
        *elementwise_flops = norms + swiglu;
    }
}

ModelActs model_acts_alloc(const Model *m, int B, int T, ActCheckpoint ac) {
    return model_acts_alloc_stage(m, B, T, ac, 0, m->cfg.n_layers);
}

ModelActs model_acts_alloc_stage(const Model *m, int B, int T, ActCheckpoint ac, int first, int end) {
    const ModelConfig *c = &m->cfg;
    size_t BT = (size_t)B * T, D = c->dim, F = m->local.ffn_dim, V = m->local.vocab_size;
    size_t R = (size_t)model_rows_here(m, B, T);
    size_t hq = (size_t)m->local.n_heads * model_head_dim(c), hkv = (size_t)m->local.n_kv_heads * model_head_dim(c);
    ModelActs a = {.B = B, .T = T, .n_layers = c->n_layers, .ac = ac, .first = first, .end = end};
    ActField f[N_ACT_FIELDS];
    act_fields(m, B, T, f);
    a.blocks = mem_alloc(MEM_OTHER, sizeof(BlockActs) * c->n_layers);
    for (int i = 0; i < N_ACT_FIELDS; i++) {
        if (!field_kept(&f[i], ac)) *field_ptr(&a.recompute, &f[i]) = alloc_acts(f[i].numel);
        for (int l = first; l < end; l++)
            if (field_kept(&f[i], ac)) *field_ptr(&a.blocks[l], &f[i]) = alloc_acts(f[i].numel);
    }
    if (ac == AC_FULL) a.recompute_out = alloc_acts(R * D);
    if (end < c->n_layers) {
        a.blocks[end].x = alloc_acts(R * D);  // the stage's output, the next stage's input
    } else {
        a.x_final = alloc_acts(R * D);
        a.xn_final = alloc_acts(BT * D);
        a.rstd_final = alloc_acts(R);
        a.logits = alloc_acts(BT * V);
        a.ce_stats = alloc_acts(2 * BT);
        a.dlogits = alloc_acts(BT * V);
    }
    a.dx = alloc_acts(R * D);
    a.dx_next = alloc_acts(R * D);
    a.dxn = alloc_acts(BT * D);
    a.dh = alloc_acts(R * D);
    if (m->tp.sequence_parallel) {
        a.sp_full = alloc_acts(BT * D);
        a.sp_rows = alloc_acts(R * D);
        a.sp_norm_grad = alloc_acts(D);
    }
    a.dq = alloc_acts(BT * hq);
    a.dk = alloc_acts(BT * hkv);
    a.dv = alloc_acts(BT * hkv);
    a.dattn = alloc_acts(BT * hq);
    a.dgate = alloc_acts(BT * F);
    a.dup = alloc_acts(BT * F);
    a.dact = alloc_acts(BT * F);
    return a;
}

static void free_block_acts(BlockActs *b) {
    real *owned[] = {b->x, b->xn1, b->rstd1, b->q, b->k, b->v, b->attn, b->attn_stats,
                     b->h, b->xn2, b->rstd2, b->gate, b->up, b->act};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
}

void model_acts_free(ModelActs *a) {
    for (int l = 0; l < a->n_layers; l++) free_block_acts(&a->blocks[l]);
    free_block_acts(&a->recompute);
    mem_free(a->blocks);
    real *owned[] = {a->recompute_out, a->x_final, a->xn_final, a->rstd_final, a->logits, a->ce_stats, a->dx,
                     a->dx_next, a->dxn, a->dh, a->dq, a->dk, a->dv, a->dattn, a->dgate, a->dup, a->dact,
                     a->dlogits, a->sp_full, a->sp_rows, a->sp_norm_grad};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
    memset(a, 0, sizeof *a);
}

_Static_assert(sizeof(BlockActs) == N_ACT_FIELDS * sizeof(real *), "BlockActs holds only the tensor pointers");

BlockActs block_acts_view(const ModelActs *a, int l) {
    BlockActs v = a->blocks[l];
    real **fields = (real **)&v;
    real *const *shared = (real *const *)&a->recompute;
    for (size_t i = 0; i < sizeof v / sizeof(real *); i++)
        if (!fields[i]) fields[i] = shared[i];
    return v;
}

// A block's projection: through the FP8 hook when there is one (chapter 9), else in fp32.
static void linear_forward(const Model *m, const BlockWeights *w, Projection p, real *out, const real *inp,
                           const real *weight, int M, int K, int N) {
    if (m->fp8) m->fp8->forward(m->fp8->ctx, w->layer, p, out, inp, weight, M, K, N);
    else matmul_forward(out, inp, weight, M, K, N);
}

static void linear_backward(const Model *m, const BlockWeights *w, Projection p, real *dinp, real *dweight,
                            const real *dout, const real *inp, const real *weight, int M, int K, int N) {
    if (m->fp8) m->fp8->backward(m->fp8->ctx, w->layer, p, dinp, dweight, dout, inp, weight, M, K, N);
    else matmul_backward(dinp, dweight, dout, inp, weight, M, K, N);
}

static AttnShape attn_shape(const Model *m, int B, int T) {
    AttnShape s = {B, T, T, m->local.n_heads, m->local.n_kv_heads, model_head_dim(&m->cfg), NULL, NULL, true};
    return s;
}

void block_forward(const Model *m, const BlockWeights *w, BlockActs *a, ModelActs *scratch, real *out, int B, int T) {
    const ModelConfig *c = &m->cfg;
    const LocalShape *local = &m->local;
    int BT = B * T, R = model_rows_here(m, B, T), D = c->dim, F = local->ffn_dim, hd = model_head_dim(c);
    int hq = local->n_heads * hd, hkv = local->n_kv_heads * hd;
    AttnShape s = attn_shape(m, B, T);
    // attention half: h = x + wo(attention(rope(q), rope(k), v))
    norm_then_gather(m, scratch, a->xn1, a->rstd1, a->x, w->attention_norm, R, D);
    linear_forward(m, w, PROJ_WQ, a->q, a->xn1, w->wq, BT, D, hq);
    linear_forward(m, w, PROJ_WK, a->k, a->xn1, w->wk, BT, D, hkv);
    linear_forward(m, w, PROJ_WV, a->v, a->xn1, w->wv, BT, D, hkv);
    rope_forward(a->q, &m->rope, m->cp.positions, B, T, local->n_heads);
    rope_forward(a->k, &m->rope, m->cp.positions, B, T, local->n_kv_heads);
    if (m->cp.attention_forward) m->cp.attention_forward(m->cp.ctx, a->attn, a->attn_stats, a->q, a->k, a->v);
    else if (m->attention == ATTN_NAIVE) attention_naive_forward(a->attn, a->attn_stats, a->q, a->k, a->v, &s);
    else attention_flash_forward(a->attn, a->attn_stats, a->q, a->k, a->v, &s);
    real *partial = partial_target(m, a->h, scratch->sp_full);
    linear_forward(m, w, PROJ_WO, partial, a->attn, w->wo, BT, hq, D);
    // row-parallel wo: each tp rank holds its heads' share of the sum
    tp_wait(m, sum_partial_start(m, partial, a->h, (size_t)R * D));
    add_inplace(a->h, a->x, (size_t)R * D);
    // feed-forward half: out = h + w2(silu(w1(n2)) * w3(n2))
    norm_then_gather(m, scratch, a->xn2, a->rstd2, a->h, w->ffn_norm, R, D);
    linear_forward(m, w, PROJ_W1, a->gate, a->xn2, w->w1, BT, D, F);
    linear_forward(m, w, PROJ_W3, a->up, a->xn2, w->w3, BT, D, F);
    swiglu_forward(a->act, a->gate, a->up, (size_t)BT * F);
    partial = partial_target(m, out, scratch->sp_full);
    linear_forward(m, w, PROJ_W2, partial, a->act, w->w2, BT, F, D);
    tp_wait(m, sum_partial_start(m, partial, out, (size_t)R * D));  // row-parallel w2
    add_inplace(out, a->h, (size_t)R * D);
}

// Input gradients first, then weight gradients: under tensor parallelism the input gradient's sum
// over the tp group runs on the comm stream while the weight-gradient matmuls compute (the same
// numbers either way: the two never touch the same buffer).
void block_backward(const Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, ModelActs *scratch,
                    const real *dout, real *dinp, int B, int T) {
    const ModelConfig *c = &m->cfg;
    const LocalShape *local = &m->local;
    int BT = B * T, R = model_rows_here(m, B, T), D = c->dim, F = local->ffn_dim, hd = model_head_dim(c);
    int hq = local->n_heads * hd, hkv = local->n_kv_heads * hd;
    AttnShape s = attn_shape(m, B, T);
    // feed-forward half, in reverse. The residual passes dout straight to dh.
    copy_fill(scratch->dh, dout, (size_t)R * D);
    const real *dout_full = gather_rows(m, dout, scratch->sp_full, (size_t)R * D);  // what w2 multiplied
    zero_fill(scratch->dact, (size_t)BT * F);
    linear_backward(m, w, PROJ_W2, scratch->dact, g->w2, dout_full, a->act, w->w2, BT, F, D);
    swiglu_backward(scratch->dgate, scratch->dup, scratch->dact, a->gate, a->up, (size_t)BT * F);
    zero_fill(scratch->dxn, (size_t)BT * D);
    linear_backward(m, w, PROJ_W1, scratch->dxn, NULL, scratch->dgate, a->xn2, w->w1, BT, D, F);
    linear_backward(m, w, PROJ_W3, scratch->dxn, NULL, scratch->dup, a->xn2, w->w3, BT, D, F);
    real *dxn_rows = m->tp.sequence_parallel ? scratch->sp_rows : scratch->dxn;
    void *pending = sum_partial_start(m, scratch->dxn, dxn_rows, (size_t)R * D);  // column-parallel w1, w3
    linear_backward(m, w, PROJ_W1, NULL, g->w1, scratch->dgate, a->xn2, w->w1, BT, D, F);
    linear_backward(m, w, PROJ_W3, NULL, g->w3, scratch->dup, a->xn2, w->w3, BT, D, F);
    tp_wait(m, pending);
    norm_backward(m, scratch, scratch->dh, g->ffn_norm, dxn_rows, a->h, w->ffn_norm, a->rstd2, R, D);
    // attention half. dinp starts as the residual's copy of dh.
    copy_fill(dinp, scratch->dh, (size_t)R * D);
    const real *dh_full = gather_rows(m, scratch->dh, scratch->sp_full, (size_t)R * D);  // what wo multiplied
    zero_fill(scratch->dattn, (size_t)BT * hq);
    linear_backward(m, w, PROJ_WO, scratch->dattn, g->wo, dh_full, a->attn, w->wo, BT, hq, D);
    zero_fill(scratch->dq, (size_t)BT * hq);
    zero_fill(scratch->dk, (size_t)BT * hkv);
    zero_fill(scratch->dv, (size_t)BT * hkv);
    if (m->cp.attention_backward)
        m->cp.attention_backward(m->cp.ctx, scratch->dq, scratch->dk, scratch->dv, scratch->dattn, a->q, a->k, a->v,
                                 a->attn, a->attn_stats);
    else if (m->attention == ATTN_NAIVE)
        attention_naive_backward(scratch->dq, scratch->dk, scratch->dv, scratch->dattn, a->q, a->k, a->v, a->attn_stats, &s);
    else
        attention_flash_backward(scratch->dq, scratch->dk, scratch->dv, scratch->dattn, a->q, a->k, a->v, a->attn, a->attn_stats, &s);
    rope_backward(scratch->dq, &m->rope, m->cp.positions, B, T, local->n_heads);
    rope_backward(scratch->dk, &m->rope, m->cp.positions, B, T, local->n_kv_heads);
    zero_fill(scratch->dxn, (size_t)BT * D);
    linear_backward(m, w, PROJ_WQ, scratch->dxn, NULL, scratch->dq, a->xn1, w->wq, BT, D, hq);
    linear_backward(m, w, PROJ_WK, scratch->dxn, NULL, scratch->dk, a->xn1, w->wk, BT, D, hkv);
    linear_backward(m, w, PROJ_WV, scratch->dxn, NULL, scratch->dv, a->xn1, w->wv, BT, D, hkv);
    pending = sum_partial_start(m, scratch->dxn, dxn_rows, (size_t)R * D);  // column-parallel wq, wk, wv
    linear_backward(m, w, PROJ_WQ, NULL, g->wq, scratch->dq, a->xn1, w->wq, BT, D, hq);
    linear_backward(m, w, PROJ_WK, NULL, g->wk, scratch->dk, a->xn1, w->wk, BT, D, hkv);
    linear_backward(m, w, PROJ_WV, NULL, g->wv, scratch->dv, a->xn1, w->wv, BT, D, hkv);
    tp_wait(m, pending);
    norm_backward(m, scratch, dinp, g->attention_norm, dxn_rows, a->x, w->attention_norm, a->rstd1, R, D);
}

// Selective checkpointing: rebuild the element-wise results from the kept matmul outputs, with the
// same calls as block_forward (so the same bits).
static void block_recompute_selective(const Model *m, const BlockWeights *w, BlockActs *a, ModelActs *scratch, int B,
                                      int T) {
    int BT = B * T, R = model_rows_here(m, B, T), D = m->cfg.dim, F = m->local.ffn_dim;
    // LAB ac: rebuild what selective dropped, with the same calls as block_forward: the attention norm (xn1, rstd1 from x), with naive attention the probabilities (attention_naive_forward), the ffn norm (xn2, rstd2 from h), and SwiGLU (act from gate and up)
    LAB_HOLE("ac", "rebuild what selective dropped, with the same calls as block_forward: the attention norm (xn1, rstd1 from x), with naive attention the probabilities (attention_naive_forward), the ffn norm (xn2, rstd2 from h), and SwiGLU (act from gate and up)");
    // END LAB
}

// Rebuilds what checkpointing dropped from block l's kept activations, before its backward.
static void block_recompute(const Model *m, const BlockWeights *w, ModelActs *acts, BlockActs *view, int l) {
    if (acts->ac == AC_NONE) return;
    int track = trace_track("compute");
    trace_begin(track, "block recompute", "recompute");
    trace_arg_int(track, "layer", l);
    trace_arg_str(track, "ac", acts->ac == AC_FULL ? "full" : "selective");
    // LAB ac: full: run the block forward again from the kept input (into recompute_out); selective: block_recompute_selective
    LAB_HOLE("ac", "full: run the block forward again from the kept input (into recompute_out); selective: block_recompute_selective");
    // END LAB
    trace_end(track);
}

// The head reads norm.weight from its own unit and the output weight from its unit, or from the
// embedding's when tied.
static int output_unit(const Model *m) { return m->cfg.tied ? LAYER_EMBEDDING : m->cfg.n_layers; }
static const char *output_name(const Model *m) { return m->cfg.tied ? "tok_embeddings.weight" : "output.weight"; }

static void check_seq_len(const Model *m, int T) {
    if (T > m->cfg.max_seq_len) fatal_input("--seq-len %d: longer than the model's max_seq_len %d", T, m->cfg.max_seq_len);
}

void model_embed_forward(const Model *m, ModelActs *acts, const int *inputs) {
    check_seq_len(m, acts->T);
    const real *embedding = unit_params(m, LAYER_EMBEDDING, PASS_FORWARD);
    int BT = acts->B * acts->T, R = model_rows_here(m, acts->B, acts->T), D = m->cfg.dim;
    real *partial = partial_target(m, acts->blocks[0].x, acts->sp_full);
    embedding_forward_rows(partial, inputs, embedding, BT, D, m->local.vocab_start, m->local.vocab_size);
    tp_wait(m, sum_partial_start(m, partial, acts->blocks[0].x, (size_t)R * D));  // vocab-parallel: one rank has each row
    unit_params_done(m, LAYER_EMBEDDING, PASS_FORWARD);
}

void model_blocks_forward(const Model *m, ModelActs *acts, int first, int end) {
    const ModelConfig *c = &m->cfg;
    int B = acts->B, T = acts->T, L = c->n_layers;
    check_seq_len(m, T);
    int track = trace_track("compute");
    for (int l = first; l < end; l++) {
        BlockWeights w = block_weights(m, (real *)unit_params(m, l, PASS_FORWARD), l);
        BlockActs view = block_acts_view(acts, l);
        real *out = l + 1 < L ? acts->blocks[l + 1].x : acts->x_final;
        trace_begin(track, "block fwd", "forward");
        trace_arg_int(track, "layer", l);
        trace_arg_double(track, "flops", block_flops_here(m, B, T));
        block_forward(m, &w, &view, acts, out, B, T);
        trace_end(track);
        unit_params_done(m, l, PASS_FORWARD);
    }
}

double model_head_forward(const Model *m, ModelActs *acts, const int *targets) {
    const ModelConfig *c = &m->cfg;
    int BT = acts->B * acts->T, D = c->dim, V = m->local.vocab_size, L = c->n_layers;
    int track = trace_track("compute");
    trace_begin(track, "head fwd + loss", "forward");
    const real *head = unit_params(m, L, PASS_FORWARD);
    const real *out_unit = c->tied ? unit_params(m, LAYER_EMBEDDING, PASS_FORWARD) : head;
    norm_then_gather(m, acts, acts->xn_final, acts->rstd_final, acts->x_final, unit_tensor(m, head, L, "norm.weight"),
                     model_rows_here(m, acts->B, acts->T), D);
    matmul_forward(acts->logits, acts->xn_final, unit_tensor(m, out_unit, output_unit(m), output_name(m)), BT, D, V);
    acts->targets = targets;
    double loss = m->tp.size == 1 ? cross_entropy_forward(acts->ce_stats, acts->logits, targets, BT, V)
                                   : m->tp.loss_forward(m->tp.ctx, acts->ce_stats, acts->logits, targets, BT,
                                                        m->local.vocab_start, V);
    trace_end(track);
    if (c->tied) unit_params_done(m, LAYER_EMBEDDING, PASS_FORWARD);
    unit_params_done(m, L, PASS_FORWARD);
    return loss;
}

double model_forward(const Model *m, ModelActs *acts, const int *inputs, const int *targets) {
    model_embed_forward(m, acts, inputs);
    model_blocks_forward(m, acts, 0, m->cfg.n_layers);
    return model_head_forward(m, acts, targets);
}

static void notify_grads_ready(const Model *m, int layer) {
    if (m->grads_ready) m->grads_ready(layer, m->grads_ready_ctx);
}

// Loss -> logits -> final norm: the head's gradients, and the gradient of the last block's output
// in acts->dx.
void model_head_backward(Model *m, ModelActs *acts, double dloss) {
    const ModelConfig *c = &m->cfg;
    int BT = acts->B * acts->T, D = c->dim, V = m->local.vocab_size, L = c->n_layers;
    int track = trace_track("compute");
    trace_begin(track, "head bwd", "backward");
    const real *head = unit_params(m, L, PASS_BACKWARD);
    const real *out_unit = c->tied ? unit_params(m, LAYER_EMBEDDING, PASS_BACKWARD) : head;
    real *head_grads = unit_grads(m, L);
    real *out_grads = c->tied ? unit_grads(m, LAYER_EMBEDDING) : head_grads;
    if (m->tp.size == 1)
        cross_entropy_backward(acts->dlogits, acts->logits, acts->ce_stats, acts->targets, BT, V, dloss);
    else
        m->tp.loss_backward(m->tp.ctx, acts->dlogits, acts->logits, acts->ce_stats, acts->targets, BT,
                            m->local.vocab_start, V, dloss);
    zero_fill(acts->dxn, (size_t)BT * D);
    real *w_out = unit_tensor(m, out_unit, output_unit(m), output_name(m));
    matmul_backward(acts->dxn, NULL, acts->dlogits, acts->xn_final, w_out, BT, D, V);
    int R = model_rows_here(m, acts->B, acts->T);
    real *dxn_rows = m->tp.sequence_parallel ? acts->sp_rows : acts->dxn;
    void *pending = sum_partial_start(m, acts->dxn, dxn_rows, (size_t)R * D);  // vocab-parallel output projection
    matmul_backward(NULL, unit_tensor(m, out_grads, output_unit(m), output_name(m)), acts->dlogits, acts->xn_final,
                    w_out, BT, D, V);
    tp_wait(m, pending);
    zero_fill(acts->dx, (size_t)R * D);
    norm_backward(m, acts, acts->dx, unit_tensor(m, head_grads, L, "norm.weight"), dxn_rows, acts->x_final,
                  unit_tensor(m, head, L, "norm.weight"), acts->rstd_final, R, D);
    if (c->tied) unit_params_done(m, LAYER_EMBEDDING, PASS_BACKWARD);
    unit_params_done(m, L, PASS_BACKWARD);
    trace_end(track);
    // final norm and output are done (tied: the output weight is tok_embeddings, notified last)
    notify_grads_ready(m, L);
}

void model_blocks_backward(Model *m, ModelActs *acts, int first, int end) {
    int B = acts->B, T = acts->T;
    int track = trace_track("compute");
    for (int l = end - 1; l >= first; l--) {
        real *unit = (real *)unit_params(m, l, PASS_BACKWARD);
        BlockWeights w = block_weights(m, unit, l), g = block_weights(m, unit_grads(m, l), l);
        BlockActs view = block_acts_view(acts, l);
        block_recompute(m, &w, acts, &view, l);
        trace_begin(track, "block bwd", "backward");
        trace_arg_int(track, "layer", l);
        trace_arg_double(track, "flops", 2 * block_flops_here(m, B, T));
        block_backward(m, &w, &g, &view, acts, acts->dx, acts->dx_next, B, T);
        trace_end(track);
        unit_params_done(m, l, PASS_BACKWARD);
        notify_grads_ready(m, l);
        real *swap = acts->dx;
        acts->dx = acts->dx_next;
        acts->dx_next = swap;
    }
}

// The lookup's backward needs no weights, only the embedding's gradient buffer.
void model_embed_backward(Model *m, ModelActs *acts, const int *inputs) {
    int R = model_rows_here(m, acts->B, acts->T), D = m->cfg.dim;
    const real *dx_full = gather_rows(m, acts->dx, acts->sp_full, (size_t)R * D);
    embedding_backward_rows(unit_grads(m, LAYER_EMBEDDING), dx_full, inputs, acts->B * acts->T, D,
                            m->local.vocab_start, m->local.vocab_size);
    notify_grads_ready(m, LAYER_EMBEDDING);
}

void model_backward(Model *m, ModelActs *acts, const int *inputs, double dloss) {
    model_head_backward(m, acts, dloss);
    model_blocks_backward(m, acts, 0, m->cfg.n_layers);
    model_embed_backward(m, acts, inputs);
}
