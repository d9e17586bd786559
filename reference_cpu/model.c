#include "reference_cpu/model.h"

#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

void model_init(Model *m, const ModelConfig *cfg, uint64_t seed, AttentionImpl attention) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->table = param_table_build(cfg);
    m->params = mem_alloc(MEM_PARAMS, sizeof(real) * m->table.total_numel);
    m->grads = mem_alloc(MEM_GRADS, sizeof(real) * m->table.total_numel);
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        param_init_range(p, seed, 0, p->numel, m->params + p->offset);
    }
    m->rope = rope_table_build(cfg->max_seq_len, model_head_dim(cfg), cfg->rope_theta, cfg->rope_scaling_factor,
                               cfg->rope_low_freq_factor, cfg->rope_high_freq_factor, cfg->rope_original_max_seq_len);
    m->attention = attention;
}

void model_free(Model *m) {
    mem_free(m->params);
    mem_free(m->grads);
    rope_table_free(&m->rope);
    param_table_free(&m->table);
}

void model_zero_grads(Model *m) { memset(m->grads, 0, sizeof(real) * m->table.total_numel); }

BlockWeights block_weights(const Model *m, real *flat, int layer) {
    int first, end;
    param_table_layer_range(&m->table, layer, &first, &end);
    const ParamInfo *p = &m->table.items[first];  // the table order of params.h
    BlockWeights w = {flat + p[0].offset, flat + p[1].offset, flat + p[2].offset, flat + p[3].offset,
                      flat + p[4].offset, flat + p[5].offset, flat + p[6].offset, flat + p[7].offset,
                      flat + p[8].offset};
    return w;
}

static real *alloc_acts(size_t n) { return mem_alloc(MEM_ACTIVATIONS, sizeof(real) * n); }

ModelActs model_acts_alloc(const Model *m, int B, int T) {
    const ModelConfig *c = &m->cfg;
    size_t BT = (size_t)B * T, D = c->dim, F = c->ffn_dim, V = c->vocab_size;
    size_t hq = (size_t)c->n_heads * model_head_dim(c), hkv = (size_t)c->n_kv_heads * model_head_dim(c);
    size_t stats = m->attention == ATTN_NAIVE ? (size_t)B * c->n_heads * T * T : (size_t)B * c->n_heads * T;
    ModelActs a = {.B = B, .T = T, .n_layers = c->n_layers};
    a.blocks = mem_alloc(MEM_OTHER, sizeof(BlockActs) * c->n_layers);
    for (int l = 0; l < c->n_layers; l++) {
        BlockActs *b = &a.blocks[l];
        b->x = alloc_acts(BT * D);
        b->xn1 = alloc_acts(BT * D);
        b->rstd1 = alloc_acts(BT);
        b->q = alloc_acts(BT * hq);
        b->k = alloc_acts(BT * hkv);
        b->v = alloc_acts(BT * hkv);
        b->attn = alloc_acts(BT * hq);
        b->attn_stats = alloc_acts(stats);
        b->h = alloc_acts(BT * D);
        b->xn2 = alloc_acts(BT * D);
        b->rstd2 = alloc_acts(BT);
        b->gate = alloc_acts(BT * F);
        b->up = alloc_acts(BT * F);
        b->act = alloc_acts(BT * F);
    }
    a.x_final = alloc_acts(BT * D);
    a.xn_final = alloc_acts(BT * D);
    a.rstd_final = alloc_acts(BT);
    a.logits = alloc_acts(BT * V);
    a.lse = alloc_acts(BT);
    a.dx = alloc_acts(BT * D);
    a.dx_next = alloc_acts(BT * D);
    a.dxn = alloc_acts(BT * D);
    a.dh = alloc_acts(BT * D);
    a.dq = alloc_acts(BT * hq);
    a.dk = alloc_acts(BT * hkv);
    a.dv = alloc_acts(BT * hkv);
    a.dattn = alloc_acts(BT * hq);
    a.dgate = alloc_acts(BT * F);
    a.dup = alloc_acts(BT * F);
    a.dact = alloc_acts(BT * F);
    a.dlogits = alloc_acts(BT * V);
    return a;
}

void model_acts_free(ModelActs *a) {
    for (int l = 0; l < a->n_layers; l++) {
        BlockActs *b = &a->blocks[l];
        real *owned[] = {b->x, b->xn1, b->rstd1, b->q, b->k, b->v, b->attn, b->attn_stats,
                         b->h, b->xn2, b->rstd2, b->gate, b->up, b->act};
        for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
    }
    mem_free(a->blocks);
    real *owned[] = {a->x_final, a->xn_final, a->rstd_final, a->logits, a->lse, a->dx, a->dx_next, a->dxn,
                     a->dh, a->dq, a->dk, a->dv, a->dattn, a->dgate, a->dup, a->dact, a->dlogits};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
    memset(a, 0, sizeof *a);
}

static AttnShape attn_shape(const Model *m, int B, int T) {
    AttnShape s = {B, T, T, m->cfg.n_heads, m->cfg.n_kv_heads, model_head_dim(&m->cfg), NULL, NULL, true};
    return s;
}

void block_forward(const Model *m, const BlockWeights *w, BlockActs *a, real *out, int B, int T) {
    const ModelConfig *c = &m->cfg;
    int BT = B * T, D = c->dim, F = c->ffn_dim, hd = model_head_dim(c);
    int hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    AttnShape s = attn_shape(m, B, T);
    // attention half: h = x + wo(attention(rope(q), rope(k), v))
    rmsnorm_forward(a->xn1, a->rstd1, a->x, w->attention_norm, BT, D, c->norm_eps);
    matmul_forward(a->q, a->xn1, w->wq, BT, D, hq);
    matmul_forward(a->k, a->xn1, w->wk, BT, D, hkv);
    matmul_forward(a->v, a->xn1, w->wv, BT, D, hkv);
    rope_forward(a->q, &m->rope, NULL, B, T, c->n_heads);
    rope_forward(a->k, &m->rope, NULL, B, T, c->n_kv_heads);
    if (m->attention == ATTN_NAIVE) attention_naive_forward(a->attn, a->attn_stats, a->q, a->k, a->v, &s);
    else attention_flash_forward(a->attn, a->attn_stats, a->q, a->k, a->v, &s);
    matmul_forward(a->h, a->attn, w->wo, BT, hq, D);
    add_inplace(a->h, a->x, (size_t)BT * D);
    // feed-forward half: out = h + w2(silu(w1(n2)) * w3(n2))
    rmsnorm_forward(a->xn2, a->rstd2, a->h, w->ffn_norm, BT, D, c->norm_eps);
    matmul_forward(a->gate, a->xn2, w->w1, BT, D, F);
    matmul_forward(a->up, a->xn2, w->w3, BT, D, F);
    swiglu_forward(a->act, a->gate, a->up, (size_t)BT * F);
    matmul_forward(out, a->act, w->w2, BT, F, D);
    add_inplace(out, a->h, (size_t)BT * D);
}

static void zero(real *x, size_t n) { memset(x, 0, sizeof(real) * n); }

void block_backward(const Model *m, const BlockWeights *w, const BlockWeights *g, BlockActs *a, ModelActs *scratch,
                    const real *dout, real *dinp, int B, int T) {
    const ModelConfig *c = &m->cfg;
    int BT = B * T, D = c->dim, F = c->ffn_dim, hd = model_head_dim(c);
    int hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    AttnShape s = attn_shape(m, B, T);
    // feed-forward half, in reverse. The residual passes dout straight to dh.
    memcpy(scratch->dh, dout, sizeof(real) * BT * D);
    zero(scratch->dact, (size_t)BT * F);
    matmul_backward(scratch->dact, g->w2, dout, a->act, w->w2, BT, F, D);
    zero(scratch->dgate, (size_t)BT * F);
    zero(scratch->dup, (size_t)BT * F);
    swiglu_backward(scratch->dgate, scratch->dup, scratch->dact, a->gate, a->up, (size_t)BT * F);
    zero(scratch->dxn, (size_t)BT * D);
    matmul_backward(scratch->dxn, g->w1, scratch->dgate, a->xn2, w->w1, BT, D, F);
    matmul_backward(scratch->dxn, g->w3, scratch->dup, a->xn2, w->w3, BT, D, F);
    rmsnorm_backward(scratch->dh, g->ffn_norm, scratch->dxn, a->h, w->ffn_norm, a->rstd2, BT, D);
    // attention half. dinp starts as the residual's copy of dh.
    memcpy(dinp, scratch->dh, sizeof(real) * BT * D);
    zero(scratch->dattn, (size_t)BT * hq);
    matmul_backward(scratch->dattn, g->wo, scratch->dh, a->attn, w->wo, BT, hq, D);
    zero(scratch->dq, (size_t)BT * hq);
    zero(scratch->dk, (size_t)BT * hkv);
    zero(scratch->dv, (size_t)BT * hkv);
    if (m->attention == ATTN_NAIVE)
        attention_naive_backward(scratch->dq, scratch->dk, scratch->dv, scratch->dattn, a->q, a->k, a->v, a->attn_stats, &s);
    else
        attention_flash_backward(scratch->dq, scratch->dk, scratch->dv, scratch->dattn, a->q, a->k, a->v, a->attn, a->attn_stats, &s);
    rope_backward(scratch->dq, &m->rope, NULL, B, T, c->n_heads);
    rope_backward(scratch->dk, &m->rope, NULL, B, T, c->n_kv_heads);
    zero(scratch->dxn, (size_t)BT * D);
    matmul_backward(scratch->dxn, g->wq, scratch->dq, a->xn1, w->wq, BT, D, hq);
    matmul_backward(scratch->dxn, g->wk, scratch->dk, a->xn1, w->wk, BT, D, hkv);
    matmul_backward(scratch->dxn, g->wv, scratch->dv, a->xn1, w->wv, BT, D, hkv);
    rmsnorm_backward(dinp, g->attention_norm, scratch->dxn, a->x, w->attention_norm, a->rstd1, BT, D);
}

static const real *output_weight(const Model *m) {
    const char *name = m->cfg.tied ? "tok_embeddings.weight" : "output.weight";
    return m->params + param_table_find(&m->table, name)->offset;
}

double model_forward(const Model *m, ModelActs *acts, const int *inputs, const int *targets) {
    const ModelConfig *c = &m->cfg;
    int B = acts->B, T = acts->T, BT = B * T, D = c->dim, V = c->vocab_size;
    if (T > c->max_seq_len) fatal_input("--seq-len %d: longer than the model's max_seq_len %d", T, c->max_seq_len);
    const real *embedding = m->params + param_table_find(&m->table, "tok_embeddings.weight")->offset;
    int track = trace_track("compute");
    embedding_forward(acts->blocks[0].x, inputs, embedding, BT, D);
    for (int l = 0; l < c->n_layers; l++) {
        BlockWeights w = block_weights(m, m->params, l);
        real *out = l + 1 < c->n_layers ? acts->blocks[l + 1].x : acts->x_final;
        trace_begin(track, "block fwd", "forward");
        trace_arg_int(track, "layer", l);
        trace_arg_double(track, "flops", model_block_forward_flops(c, B, T));
        block_forward(m, &w, &acts->blocks[l], out, B, T);
        trace_end(track);
    }
    trace_begin(track, "head fwd + loss", "forward");
    const real *final_norm = m->params + param_table_find(&m->table, "norm.weight")->offset;
    rmsnorm_forward(acts->xn_final, acts->rstd_final, acts->x_final, final_norm, BT, D, c->norm_eps);
    matmul_forward(acts->logits, acts->xn_final, output_weight(m), BT, D, V);
    acts->targets = targets;
    double loss = cross_entropy_forward(acts->lse, acts->logits, targets, BT, V);
    trace_end(track);
    return loss;
}

static void notify_grads_ready(const Model *m, int layer) {
    if (m->grads_ready) m->grads_ready(layer, m->grads_ready_ctx);
}

void model_backward(Model *m, ModelActs *acts, const int *inputs, double dloss) {
    const ModelConfig *c = &m->cfg;
    int B = acts->B, T = acts->T, BT = B * T, D = c->dim, V = c->vocab_size;
    const ParamInfo *out_p = param_table_find(&m->table, c->tied ? "tok_embeddings.weight" : "output.weight");
    const ParamInfo *norm_p = param_table_find(&m->table, "norm.weight");
    const ParamInfo *emb_p = param_table_find(&m->table, "tok_embeddings.weight");
    int track = trace_track("compute");
    // head: loss -> logits -> final norm
    trace_begin(track, "head bwd", "backward");
    zero(acts->dlogits, (size_t)BT * V);
    cross_entropy_backward(acts->dlogits, acts->logits, acts->lse, acts->targets, BT, V, dloss);
    zero(acts->dxn, (size_t)BT * D);
    matmul_backward(acts->dxn, m->grads + out_p->offset, acts->dlogits, acts->xn_final, m->params + out_p->offset,
                    BT, D, V);
    zero(acts->dx, (size_t)BT * D);
    rmsnorm_backward(acts->dx, m->grads + norm_p->offset, acts->dxn, acts->x_final, m->params + norm_p->offset,
                     acts->rstd_final, BT, D);
    trace_end(track);
    // final norm and output are done (tied: the output weight is tok_embeddings, notified last)
    notify_grads_ready(m, c->n_layers);
    // blocks in reverse; dx holds the gradient of the current block's output
    for (int l = c->n_layers - 1; l >= 0; l--) {
        BlockWeights w = block_weights(m, m->params, l), g = block_weights(m, m->grads, l);
        trace_begin(track, "block bwd", "backward");
        trace_arg_int(track, "layer", l);
        trace_arg_double(track, "flops", 2 * model_block_forward_flops(c, B, T));
        block_backward(m, &w, &g, &acts->blocks[l], acts, acts->dx, acts->dx_next, B, T);
        trace_end(track);
        notify_grads_ready(m, l);
        real *swap = acts->dx;
        acts->dx = acts->dx_next;
        acts->dx_next = swap;
    }
    embedding_backward(m->grads + emb_p->offset, acts->dx, inputs, BT, D);
    notify_grads_ready(m, LAYER_EMBEDDING);
}
