#include "reference_cpu/params.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/rng.h"

#define INIT_STD 0.02

static void add_param(ParamTable *t, int capacity, const char *name, int rows, int cols, int layer, TpSplit split,
                      ParamInit init, double std) {
    if (t->count >= capacity) fatal("parameter table overflow");
    ParamInfo *p = &t->items[t->count++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = cols > 0 ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->numel = (size_t)rows * (cols > 0 ? (size_t)cols : 1);
    p->offset = t->total_numel;
    p->layer = layer;
    p->tp_split = split;
    p->init = init;
    p->init_std = std;
    t->total_numel += p->numel;
}

const char *projection_param_name(Projection p) {
    static const char *const names[N_PROJ] = {"attention.wq.weight",    "attention.wk.weight",
                                              "attention.wv.weight",    "attention.wo.weight",
                                              "feed_forward.w1.weight", "feed_forward.w2.weight",
                                              "feed_forward.w3.weight"};
    return names[p];
}

ParamTable param_table_build(const ModelConfig *c) {
    ParamTable t = {0};
    int capacity = 9 * c->n_layers + 3;
    t.items = calloc((size_t)capacity, sizeof(ParamInfo));
    int hd = model_head_dim(c), hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    double residual_std = INIT_STD / sqrt(2.0 * c->n_layers);
    char name[PARAM_NAME_MAX];
    add_param(&t, capacity, "tok_embeddings.weight", c->vocab_size, c->dim, LAYER_EMBEDDING, TP_ROWS, INIT_NORMAL, INIT_STD);
    for (int l = 0; l < c->n_layers; l++) {
#define LAYER_PARAM(suffix, rows, cols, split, init, std)                  \
    snprintf(name, sizeof name, "layers.%d.%s", l, suffix);               \
    add_param(&t, capacity, name, rows, cols, l, split, init, std)
        LAYER_PARAM("attention_norm.weight", c->dim, 0, TP_NONE, INIT_ONES, 0);
        LAYER_PARAM(projection_param_name(PROJ_WQ), hq, c->dim, TP_ROWS, INIT_NORMAL, INIT_STD);
        LAYER_PARAM(projection_param_name(PROJ_WK), hkv, c->dim, TP_ROWS, INIT_NORMAL, INIT_STD);
        LAYER_PARAM(projection_param_name(PROJ_WV), hkv, c->dim, TP_ROWS, INIT_NORMAL, INIT_STD);
        LAYER_PARAM(projection_param_name(PROJ_WO), c->dim, hq, TP_COLS, INIT_NORMAL, residual_std);
        LAYER_PARAM("ffn_norm.weight", c->dim, 0, TP_NONE, INIT_ONES, 0);
        LAYER_PARAM(projection_param_name(PROJ_W1), c->ffn_dim, c->dim, TP_ROWS, INIT_NORMAL, INIT_STD);
        LAYER_PARAM(projection_param_name(PROJ_W2), c->dim, c->ffn_dim, TP_COLS, INIT_NORMAL, residual_std);
        LAYER_PARAM(projection_param_name(PROJ_W3), c->ffn_dim, c->dim, TP_ROWS, INIT_NORMAL, INIT_STD);
#undef LAYER_PARAM
    }
    add_param(&t, capacity, "norm.weight", c->dim, 0, c->n_layers, TP_NONE, INIT_ONES, 0);
    if (!c->tied)
        add_param(&t, capacity, "output.weight", c->vocab_size, c->dim, c->n_layers, TP_ROWS, INIT_NORMAL, INIT_STD);
    return t;
}

const char *param_tp_rule(const ModelConfig *c, int tp_size) {
    if (c->n_heads % tp_size || c->n_kv_heads % tp_size || c->ffn_dim % tp_size || c->vocab_size % tp_size)
        return "--tp must divide the query and key/value heads, the FFN size and the vocabulary";
    return NULL;
}

void param_check_tp(const ModelConfig *c, int tp_size) {
    if (param_tp_rule(c, tp_size))
        fatal_input("--tp %d: must divide n_heads %d, n_kv_heads %d, ffn_dim %d and vocab_size %d of model %s",
                    tp_size, c->n_heads, c->n_kv_heads, c->ffn_dim, c->vocab_size, c->name);
}

ParamTable param_table_build_tp(const ModelConfig *c, int tp_size) {
    param_check_tp(c, tp_size);
    ParamTable t = param_table_build(c);
    t.total_numel = 0;
    for (int i = 0; i < t.count; i++) {  // same order and names; split dimensions divided, offsets redone
        ParamInfo *p = &t.items[i];
        if (p->tp_split != TP_NONE) p->shape[p->tp_split] /= tp_size;
        p->numel = (size_t)p->shape[0] * (p->ndim == 2 ? (size_t)p->shape[1] : 1);
        p->offset = t.total_numel;
        t.total_numel += p->numel;
    }
    return t;
}

void param_init_local_range(const ParamInfo *p, int tp_rank, int tp_size, uint64_t seed, size_t first, size_t count,
                            real *out) {
    if (p->tp_split == TP_NONE) {
        param_init_range(p, seed, first, count, out);
    } else if (p->tp_split == TP_ROWS) {  // this rank's rows are one contiguous block of the full tensor
        param_init_range(p, seed, (size_t)tp_rank * p->numel + first, count, out);
    } else {  // TP_COLS: local row i, column j is full element i * (cols * tp) + tp_rank * cols + j
        size_t cols = (size_t)p->shape[1], full_cols = cols * (size_t)tp_size;
        for (size_t done = 0; done < count;) {
            size_t local = first + done, row = local / cols, col = local % cols;
            size_t run = cols - col < count - done ? cols - col : count - done;  // to the end of the row
            param_init_range(p, seed, row * full_cols + (size_t)tp_rank * cols + col, run, out + done);
            done += run;
        }
    }
}

static void fill_from_seed(const ParamSource *src, const ParamInfo *p, int tp_rank, int tp_size, size_t first,
                           size_t count, real *out) {
    param_init_local_range(p, tp_rank, tp_size, src->seed, first, count, out);
}

ParamSource param_source_seed(uint64_t seed) { return (ParamSource){fill_from_seed, seed, NULL}; }

void param_table_free(ParamTable *t) {
    free(t->items);
    memset(t, 0, sizeof *t);
}

const ParamInfo *param_table_find(const ParamTable *t, const char *name) {
    for (int i = 0; i < t->count; i++)
        if (strcmp(t->items[i].name, name) == 0) return &t->items[i];
    return NULL;
}

void param_table_layer_range(const ParamTable *t, int layer, int *first, int *end) {
    *first = *end = -1;
    for (int i = 0; i < t->count; i++) {
        if (t->items[i].layer != layer) continue;
        if (*first < 0) *first = i;
        *end = i + 1;
    }
}

real param_init_value(const ParamInfo *p, uint64_t seed, size_t element_index) {
    if (p->init == INIT_ONES) return 1;
    return (real)(p->init_std * rng_normal(seed, hash_string(p->name), element_index));
}

void param_init_range(const ParamInfo *p, uint64_t seed, size_t first, size_t count, real *out) {
    if (p->init == INIT_ONES) {
        for (size_t i = 0; i < count; i++) out[i] = 1;
        return;
    }
    uint64_t stream = hash_string(p->name);  // the same stream param_init_value uses, hashed once
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < count; i++) out[i] = (real)(p->init_std * rng_normal(seed, stream, first + i));
}
