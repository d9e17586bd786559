// test64_gradcheck.c: every op's backward, and the whole model's, against central finite
// differences, in the float64 build of the reference (tolerances.h: FD_*).
// Each op is checked through the scalar L = sum(forward(x) * R) for a fixed random R, whose
// gradient is exactly backward(dout = R).
#include <string.h>

#include "reference_cpu/model.h"
#include "reference_cpu/ops.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

#ifndef REF_FLOAT64
#error "build this test with -DREF_FLOAT64 (the Makefile does for tests/test64_*.c)"
#endif

typedef double (*LossFn)(void *ctx);

static double weighted_sum(const real *out, const real *weights, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += out[i] * weights[i];
    return s;
}

// Compares analytic[i] with (L(x + h e_i) - L(x - h e_i)) / 2h for up to max_checks indices
// spread evenly over x.
static void gradcheck(const char *name, real *x, const real *analytic, size_t n, LossFn loss, void *ctx,
                      size_t max_checks) {
    size_t stride = n > max_checks ? n / max_checks : 1, count = 0;
    real *numeric = new_zeros(n), *expected = new_zeros(n);
    for (size_t i = 0; i < n; i += stride, count++) {
        real saved = x[i];
        x[i] = saved + FD_STEP;
        double plus = loss(ctx);
        x[i] = saved - FD_STEP;
        double minus = loss(ctx);
        x[i] = saved;
        numeric[count] = (plus - minus) / (2 * FD_STEP);
        expected[count] = analytic[i];
    }
    expect_close(name, expected, numeric, count, FD_RTOL, FD_ATOL);
    free(numeric);
    free(expected);
}

// ---- matmul ----------------------------------------------------------------------------------
enum { MM_M = 5, MM_K = 7, MM_N = 6 };
typedef struct { real *inp, *w, *r, *out; } MatmulCtx;
static double matmul_loss(void *p) {
    MatmulCtx *c = p;
    matmul_forward(c->out, c->inp, c->w, MM_M, MM_K, MM_N);
    return weighted_sum(c->out, c->r, MM_M * MM_N);
}
static void check_matmul(MatmulBackend backend) {
    if (backend == MATMUL_BLAS && !matmul_blas_available()) {  // set_backend would fall back to the loops
        printf("SKIP: matmul gradcheck through OpenBLAS: this build has no OpenBLAS\n");
        return;
    }
    matmul_set_backend(backend);
    MatmulCtx c = {new_normal(MM_M * MM_K, 1, 1), new_normal(MM_N * MM_K, 1, 2), new_normal(MM_M * MM_N, 1, 3),
                   new_zeros(MM_M * MM_N)};
    real *dinp = new_zeros(MM_M * MM_K), *dw = new_zeros(MM_N * MM_K);
    matmul_backward(dinp, dw, c.r, c.inp, c.w, MM_M, MM_K, MM_N);
    gradcheck("matmul dinp", c.inp, dinp, MM_M * MM_K, matmul_loss, &c, 1000);
    gradcheck("matmul dweight", c.w, dw, MM_N * MM_K, matmul_loss, &c, 1000);
    matmul_set_backend(MATMUL_BLAS);
}
START_TEST(test_matmul_blas) { check_matmul(MATMUL_BLAS); }
END_TEST
START_TEST(test_matmul_loop) { check_matmul(MATMUL_LOOP); }
END_TEST

// ---- embedding -------------------------------------------------------------------------------
enum { EMB_V = 11, EMB_C = 4, EMB_N = 9 };
static const int EMB_TOKENS[EMB_N] = {3, 0, 3, 10, 7, 3, 1, 0, 5};  // repeats: gradients must add
typedef struct { real *table, *r, *out; } EmbCtx;
static double embedding_loss(void *p) {
    EmbCtx *c = p;
    embedding_forward(c->out, EMB_TOKENS, c->table, EMB_N, EMB_C);
    return weighted_sum(c->out, c->r, EMB_N * EMB_C);
}
START_TEST(test_embedding) {
    EmbCtx c = {new_normal(EMB_V * EMB_C, 1, 4), new_normal(EMB_N * EMB_C, 1, 5), new_zeros(EMB_N * EMB_C)};
    real *dtable = new_zeros(EMB_V * EMB_C);
    embedding_backward(dtable, c.r, EMB_TOKENS, EMB_N, EMB_C);
    gradcheck("embedding dtable", c.table, dtable, EMB_V * EMB_C, embedding_loss, &c, 1000);
}
END_TEST

// ---- RMSNorm ---------------------------------------------------------------------------------
// 4 rows: one chunk of rmsnorm_backward's dweight sums; 150 rows: three chunks of 64, the last partial.
enum { RN_C = 8 };
typedef struct { int n; real *inp, *w, *r, *out, *rstd; } RmsCtx;
static double rmsnorm_loss(void *p) {
    RmsCtx *c = p;
    rmsnorm_forward(c->out, c->rstd, c->inp, c->w, c->n, RN_C, 1e-5);
    return weighted_sum(c->out, c->r, c->n * RN_C);
}
static void check_rmsnorm(int n) {
    RmsCtx c = {n, new_normal(n * RN_C, 1, 6), new_normal(RN_C, 1, 7), new_normal(n * RN_C, 1, 8),
                new_zeros(n * RN_C), new_zeros(n)};
    real *dinp = new_zeros(n * RN_C), *dw = new_zeros(RN_C);
    rmsnorm_loss(&c);
    rmsnorm_backward(dinp, dw, c.r, c.inp, c.w, c.rstd, n, RN_C);
    gradcheck("rmsnorm dinp", c.inp, dinp, n * RN_C, rmsnorm_loss, &c, 1000);
    gradcheck("rmsnorm dweight", c.w, dw, RN_C, rmsnorm_loss, &c, 1000);
}
START_TEST(test_rmsnorm) { check_rmsnorm(4); }
END_TEST
START_TEST(test_rmsnorm_chunks) { check_rmsnorm(150); }
END_TEST

// ---- RoPE ------------------------------------------------------------------------------------
enum { RP_B = 2, RP_T = 5, RP_H = 3, RP_HD = 8, RP_N = RP_B * RP_T * RP_H * RP_HD };
typedef struct { real *x, *r, *tmp; RopeTable table; const int *positions; } RopeCtx;
static double rope_loss(void *p) {
    RopeCtx *c = p;
    memcpy(c->tmp, c->x, sizeof(real) * RP_N);
    rope_forward(c->tmp, &c->table, c->positions, RP_B, RP_T, RP_H);
    return weighted_sum(c->tmp, c->r, RP_N);
}
static void check_rope(double scaling, const int *positions) {
    RopeCtx c = {new_normal(RP_N, 1, 9), new_normal(RP_N, 1, 10), new_zeros(RP_N),
                 rope_table_build(64, RP_HD, 10000.0, scaling, 1, 4, 32), positions};
    real *dx = new_zeros(RP_N);
    memcpy(dx, c.r, sizeof(real) * RP_N);
    rope_backward(dx, &c.table, positions, RP_B, RP_T, RP_H);
    gradcheck("rope dx", c.x, dx, RP_N, rope_loss, &c, 1000);
}
START_TEST(test_rope) { check_rope(0, NULL); }
END_TEST
START_TEST(test_rope_scaled_positions) {
    static const int positions[RP_T] = {7, 8, 40, 41, 63};
    check_rope(8, positions);
}
END_TEST

// ---- attention -------------------------------------------------------------------------------
typedef struct {
    AttnShape s;
    real *q, *k, *v, *r, *out, *stats;
    bool flash;
} AttnCtx;
static size_t q_size(const AttnShape *s) { return (size_t)s->B * s->Tq * s->n_heads * s->head_dim; }
static size_t kv_size(const AttnShape *s) { return (size_t)s->B * s->Tk * s->n_kv_heads * s->head_dim; }
static double attention_loss(void *p) {
    AttnCtx *c = p;
    if (c->flash) attention_flash_forward(c->out, c->stats, c->q, c->k, c->v, &c->s);
    else attention_naive_forward(c->out, c->stats, c->q, c->k, c->v, &c->s);
    return weighted_sum(c->out, c->r, q_size(&c->s));
}
static void check_attention(AttnShape s, bool flash) {
    AttnCtx c = {s, new_normal(q_size(&s), 1, 11), new_normal(kv_size(&s), 1, 12), new_normal(kv_size(&s), 1, 13),
                 new_normal(q_size(&s), 1, 14), new_zeros(q_size(&s)),
                 new_zeros((size_t)s.B * s.n_heads * s.Tq * s.Tk), flash};
    real *dq = new_zeros(q_size(&s)), *dk = new_zeros(kv_size(&s)), *dv = new_zeros(kv_size(&s));
    attention_loss(&c);
    if (flash) attention_flash_backward(dq, dk, dv, c.r, c.q, c.k, c.v, c.out, c.stats, &s);
    else attention_naive_backward(dq, dk, dv, c.r, c.q, c.k, c.v, c.stats, &s);
    gradcheck(flash ? "flash attention dq" : "naive attention dq", c.q, dq, q_size(&s), attention_loss, &c, 2000);
    gradcheck(flash ? "flash attention dk" : "naive attention dk", c.k, dk, kv_size(&s), attention_loss, &c, 2000);
    gradcheck(flash ? "flash attention dv" : "naive attention dv", c.v, dv, kv_size(&s), attention_loss, &c, 2000);
}
// GQA (4 query heads on 2 kv heads), causal
static const AttnShape CAUSAL_GQA = {2, 5, 5, 4, 2, 6, NULL, NULL, true};
// a chunk of queries against a longer key block, no mask (a ring-attention step)
static const AttnShape CROSS_BLOCK = {1, 3, 7, 2, 1, 4, NULL, NULL, false};
// zigzag-like positions: query chunk {0,1,6,7} against keys at {0,1,6,7} with a causal mask
static const int ZIGZAG[4] = {0, 1, 6, 7};
START_TEST(test_attention_naive) {
    check_attention(CAUSAL_GQA, false);
    check_attention(CROSS_BLOCK, false);
}
END_TEST
START_TEST(test_attention_flash) {
    check_attention(CAUSAL_GQA, true);
    check_attention(CROSS_BLOCK, true);
    AttnShape zigzag = {1, 4, 4, 2, 2, 4, ZIGZAG, ZIGZAG, true};
    check_attention(zigzag, true);
}
END_TEST
START_TEST(test_attention_flash_multi_tile) {  // Tk > ATTN_KV_TILE: the online-softmax rescaling runs
    AttnShape s = {1, 70, 70, 2, 1, 4, NULL, NULL, true};
    check_attention(s, true);
}
END_TEST

// ---- SwiGLU ----------------------------------------------------------------------------------
enum { SW_N = 20 };
typedef struct { real *gate, *up, *r, *out; } SwiCtx;
static double swiglu_loss(void *p) {
    SwiCtx *c = p;
    swiglu_forward(c->out, c->gate, c->up, SW_N);
    return weighted_sum(c->out, c->r, SW_N);
}
START_TEST(test_swiglu) {
    SwiCtx c = {new_normal(SW_N, 2, 15), new_normal(SW_N, 1, 16), new_normal(SW_N, 1, 17), new_zeros(SW_N)};
    real *dgate = new_zeros(SW_N), *dup = new_zeros(SW_N);
    swiglu_backward(dgate, dup, c.r, c.gate, c.up, SW_N);
    gradcheck("swiglu dgate", c.gate, dgate, SW_N, swiglu_loss, &c, 1000);
    gradcheck("swiglu dup", c.up, dup, SW_N, swiglu_loss, &c, 1000);
}
END_TEST

// ---- cross-entropy ---------------------------------------------------------------------------
enum { CE_N = 6, CE_V = 9 };
static const int CE_TARGETS[CE_N] = {2, IGNORE_INDEX, 8, 0, 2, IGNORE_INDEX};
typedef struct { real *logits, *stats; } CeCtx;
static double ce_loss(void *p) {
    CeCtx *c = p;
    return cross_entropy_forward(c->stats, c->logits, CE_TARGETS, CE_N, CE_V);
}
START_TEST(test_cross_entropy) {
    CeCtx c = {new_normal(CE_N * CE_V, 3, 18), new_zeros(2 * CE_N)};
    real *dlogits = new_zeros(CE_N * CE_V);
    for (int i = 0; i < CE_N * CE_V; i++) dlogits[i] = NAN;  // the gradient is written, not added to
    ce_loss(&c);
    cross_entropy_backward(dlogits, c.logits, c.stats, CE_TARGETS, CE_N, CE_V, 1.0);
    gradcheck("cross_entropy dlogits", c.logits, dlogits, CE_N * CE_V, ce_loss, &c, 1000);
    for (int j = 0; j < CE_V; j++)  // ignored rows get exactly no gradient
        ck_assert_msg(dlogits[1 * CE_V + j] == 0 && dlogits[5 * CE_V + j] == 0, "ignored row has a gradient");
}
END_TEST

// ---- the whole model -------------------------------------------------------------------------
enum { MODEL_B = 2, MODEL_T = 8 };
typedef struct { Model m; ModelActs acts; int inputs[MODEL_B * MODEL_T], targets[MODEL_B * MODEL_T]; } ModelCtx;
static double model_loss(void *p) {
    ModelCtx *c = p;
    return model_forward(&c->m, &c->acts, c->inputs, c->targets);
}
// Every parameter tensor, sampled at up to 12 elements each (the tiny model has ~330k weights).
static void check_model(bool tied, AttentionImpl attention) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    cfg.tied = tied;
    cfg.n_layers = 2;  // two blocks exercise the block-to-block gradient path; four only cost time
    static ModelCtx c;
    model_init(&c.m, &cfg, 7, attention);
    c.acts = model_acts_alloc(&c.m, MODEL_B, MODEL_T, AC_NONE);
    for (int i = 0; i < MODEL_B * MODEL_T; i++) {
        c.inputs[i] = (int)rng_below(3, 0, i, cfg.vocab_size);
        c.targets[i] = i % 5 == 4 ? IGNORE_INDEX : (int)rng_below(3, 1, i, cfg.vocab_size);
    }
    // random norm weights, so the norm gradients are not at a special point
    for (int i = 0; i < c.m.table.count; i++)
        if (c.m.table.items[i].ndim == 1)
            fill_normal(c.m.params + c.m.table.items[i].offset, c.m.table.items[i].numel, 0.5, 100 + i);
    model_zero_grads(&c.m);
    model_loss(&c);
    model_backward(&c.m, &c.acts, c.inputs, 1.0);
    for (int i = 0; i < c.m.table.count; i++) {
        const ParamInfo *p = &c.m.table.items[i];
        char name[128];
        snprintf(name, sizeof name, "model %s", p->name);
        gradcheck(name, c.m.params + p->offset, c.m.grads + p->offset, p->numel, model_loss, &c, 12);
    }
    // The samples above rarely land on a row of the table the inputs look up (16 of 256 rows): the
    // lookup's own gradient is checked on whole rows, the first input's and one that two positions
    // share (their gradients must add).
    const ParamInfo *emb = param_table_find(&c.m.table, "tok_embeddings.weight");
    int repeated = -1;
    for (int i = 0; i < MODEL_B * MODEL_T && repeated < 0; i++)
        for (int j = i + 1; j < MODEL_B * MODEL_T; j++)
            if (c.inputs[i] == c.inputs[j]) repeated = c.inputs[i];
    ck_assert_msg(emb && repeated >= 0, "the gradcheck's inputs need a token used twice");
    int rows[2] = {c.inputs[0], repeated};
    for (int r = 0; r < 2; r++) {
        size_t at = emb->offset + (size_t)rows[r] * cfg.dim;
        char name[64];
        snprintf(name, sizeof name, "model tok_embeddings row %d", rows[r]);
        gradcheck(name, c.m.params + at, c.m.grads + at, cfg.dim, model_loss, &c, cfg.dim);
    }
    model_acts_free(&c.acts);
    model_free(&c.m);
}
START_TEST(test_model_untied_flash) { check_model(false, ATTN_FLASH); }
END_TEST
START_TEST(test_model_tied_naive) { check_model(true, ATTN_NAIVE); }
END_TEST

int main(void) {
    Suite *s = suite_create("gradcheck (float64, finite differences)");
    TCase *ops = tcase_create("ops");
    tcase_set_timeout(ops, 300);
    tcase_add_test(ops, test_matmul_blas);
    tcase_add_test(ops, test_matmul_loop);
    tcase_add_test(ops, test_embedding);
    tcase_add_test(ops, test_rmsnorm);
    tcase_add_test(ops, test_rmsnorm_chunks);
    tcase_add_test(ops, test_rope);
    tcase_add_test(ops, test_rope_scaled_positions);
    tcase_add_test(ops, test_attention_naive);
    tcase_add_test(ops, test_attention_flash);
    tcase_add_test(ops, test_attention_flash_multi_tile);
    tcase_add_test(ops, test_swiglu);
    tcase_add_test(ops, test_cross_entropy);
    suite_add_tcase(s, ops);
    TCase *model = tcase_create("model");
    tcase_set_timeout(model, 300);
    tcase_add_test(model, test_model_untied_flash);
    tcase_add_test(model, test_model_tied_naive);
    suite_add_tcase(s, model);
    return run_suite(s);
}
