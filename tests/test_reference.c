// test_reference.c: fp32 checks of the reference that need no oracle: implementations of the same
// op agree (tolerances.h: FP32_ORDER_*), the generator matches its published answers, init is
// sharding-independent, a step is bit-reproducible, and the shape arithmetic is right.
#include <string.h>

#include "common/rng.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/model.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

// Known-answer vectors for Philox4x32-10 from the Random123 distribution (kat_vectors).
START_TEST(test_philox_known_answers) {
    struct { uint32_t ctr[4], key[2], expect[4]; } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        philox4x32_10(kat[i].ctr, kat[i].key, out);
        for (int j = 0; j < 4; j++)
            ck_assert_msg(out[j] == kat[i].expect[j], "philox vector %d word %d: %08x, expected %08x", i, j, out[j],
                          kat[i].expect[j]);
    }
}
END_TEST

START_TEST(test_normal_moments) {  // 200k draws: mean within 5 sigma (0.011), variance within 0.02
    double sum = 0, sum_sq = 0;
    int n = 200000;
    for (int i = 0; i < n; i++) {
        double x = rng_normal(9, 1, i);
        sum += x, sum_sq += x * x;
    }
    double mean = sum / n, var = sum_sq / n - mean * mean;
    ck_assert_msg(fabs(mean) < 0.011 && fabs(var - 1) < 0.02, "normal: mean %.4f var %.4f", mean, var);
}
END_TEST

// Any slice of a parameter, built on its own, equals the same slice of the whole tensor.
START_TEST(test_init_is_sharding_independent) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    ParamTable t = param_table_build(&cfg);
    for (int i = 0; i < t.count; i++) {
        const ParamInfo *p = &t.items[i];
        real *whole = new_zeros(p->numel), *piece = new_zeros(p->numel);
        param_init_range(p, 1234, 0, p->numel, whole);
        for (int shards = 2; shards <= 8; shards *= 2) {
            size_t per = (p->numel + shards - 1) / shards;
            for (int r = 0; r < shards; r++) {
                size_t first = r * per, count = first >= p->numel ? 0 : (p->numel - first < per ? p->numel - first : per);
                param_init_range(p, 1234, first, count, piece + first);
            }
            expect_equal_bits(p->name, piece, whole, p->numel);
        }
        ck_assert(whole[p->numel / 2] == param_init_value(p, 1234, p->numel / 2));
        free(whole);
        free(piece);
    }
    param_table_free(&t);
}
END_TEST

START_TEST(test_init_statistics) {  // each weight has the std the table promises
    ModelConfig cfg;
    model_config_lookup("small", &cfg);
    ParamTable t = param_table_build(&cfg);
    const char *names[] = {"layers.0.attention.wq.weight", "layers.3.feed_forward.w2.weight", "output.weight"};
    for (int i = 0; i < 3; i++) {
        const ParamInfo *p = param_table_find(&t, names[i]);
        real *w = new_zeros(p->numel);
        param_init_range(p, 5, 0, p->numel, w);
        double std = sqrt(sum_of_squares(w, p->numel) / p->numel);
        ck_assert_msg(fabs(std / p->init_std - 1) < 0.01, "%s: std %.5f, expected %.5f", p->name, std, p->init_std);
        free(w);
    }
    param_table_free(&t);
}
END_TEST

START_TEST(test_matmul_backends_agree) {
    if (!matmul_blas_available()) {  // a build without OpenBLAS has only the loops: nothing to compare
        printf("SKIP: test_matmul_backends_agree: this build has no OpenBLAS\n");
        return;
    }
    int M = 37, K = 300, N = 53;
    real *inp = new_normal(M * K, 1, 1), *w = new_normal(N * K, 1, 2), *dout = new_normal(M * N, 1, 3);
    real *out[2], *dinp[2], *dw[2];
    MatmulBackend backends[2] = {MATMUL_BLAS, MATMUL_LOOP};
    for (int b = 0; b < 2; b++) {
        matmul_set_backend(backends[b]);
        out[b] = new_zeros(M * N), dinp[b] = new_zeros(M * K), dw[b] = new_zeros(N * K);
        matmul_forward(out[b], inp, w, M, K, N);
        matmul_backward(dinp[b], dw[b], dout, inp, w, M, K, N);
    }
    matmul_set_backend(MATMUL_BLAS);
    // Unit-normal inputs: each output is a sum of 300 unit-sized products (|out| ~ sqrt(300) = 17), so
    // one that cancels to near zero still carries ~ sqrt(300) eps_32 x 17 = 2e-5 of absolute rounding:
    // FP32_ORDER_ATOL, sized for unit-scale outputs, x 20.
    expect_close("matmul out (loop vs blas)", out[1], out[0], M * N, FP32_ORDER_RTOL, FP32_ORDER_ATOL * 20);
    expect_close("matmul dinp (loop vs blas)", dinp[1], dinp[0], M * K, FP32_ORDER_RTOL, FP32_ORDER_ATOL * 20);
    expect_close("matmul dweight (loop vs blas)", dw[1], dw[0], N * K, FP32_ORDER_RTOL, FP32_ORDER_ATOL * 20);
    for (int b = 0; b < 2; b++) free(out[b]), free(dinp[b]), free(dw[b]);
    free(inp), free(w), free(dout);
}
END_TEST

// q_std: the queries' scale. At 1 the scores are O(1); at 40 (head_dim 16) they reach about 300,
// where exp overflows float (above 88) unless each row's max is subtracted first, as both kernels
// must. Mutation seen failing: the flash kernel's running max held at 0 (every score-1 test passed).
static void compare_attention_scaled(AttnShape s, double q_std) {
    size_t nq = (size_t)s.B * s.Tq * s.n_heads * s.head_dim, nkv = (size_t)s.B * s.Tk * s.n_kv_heads * s.head_dim;
    size_t nrows = (size_t)s.B * s.n_heads * s.Tq;
    real *q = new_normal(nq, q_std, 4), *k = new_normal(nkv, 1, 5), *v = new_normal(nkv, 1, 6), *dout = new_normal(nq, 1, 7);
    real *probs = new_zeros(nrows * s.Tk), *lse = new_zeros(nrows);
    real *out[2] = {new_zeros(nq), new_zeros(nq)};
    real *dq[2] = {new_zeros(nq), new_zeros(nq)}, *dk[2] = {new_zeros(nkv), new_zeros(nkv)},
         *dv[2] = {new_zeros(nkv), new_zeros(nkv)};
    attention_naive_forward(out[0], probs, q, k, v, &s);
    attention_naive_backward(dq[0], dk[0], dv[0], dout, q, k, v, probs, &s);
    attention_flash_forward(out[1], lse, q, k, v, &s);
    attention_flash_backward(dq[1], dk[1], dv[1], dout, q, k, v, out[1], lse, &s);
    // Scores computed in two orders differ by their last bit, which at q_std times the scale moves
    // each probability by q_std times as much: the tolerances grow with it, and dk's (the score
    // gradients times the queries, q_std each) with its square. At q_std 40 dk was measured 5.9e-4
    // apart (abs) in a clang build, whose sums round otherwise; a running max held at 0 gives inf.
    double rtol = FP32_ORDER_RTOL * q_std, atol = FP32_ORDER_ATOL * q_std;
    expect_close("attention out (flash vs naive)", out[1], out[0], nq, rtol, atol);
    expect_close("attention dq (flash vs naive)", dq[1], dq[0], nq, rtol, atol);
    expect_close("attention dk (flash vs naive)", dk[1], dk[0], nkv, rtol * q_std, atol * q_std);
    expect_close("attention dv (flash vs naive)", dv[1], dv[0], nkv, rtol, atol);
    // lse is the log of the softmax denominator: recompute it from the scores in double
    real *lse_ref = new_zeros(nrows);
    double scale = 1 / sqrt((double)s.head_dim);
    int group = s.n_heads / s.n_kv_heads;
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.n_heads; h++)
            for (int i = 0; i < s.Tq; i++) {
                double sum = 0;
                for (int j = 0; j < s.Tk; j++) {
                    int qp = s.q_pos ? s.q_pos[i] : i, kp = s.k_pos ? s.k_pos[j] : j;
                    if (s.causal && kp > qp) continue;  // invisible (positions: ring attention's chunks)
                    double dot = 0;
                    for (int d = 0; d < s.head_dim; d++)
                        dot += (double)q[(((size_t)b * s.Tq + i) * s.n_heads + h) * s.head_dim + d] *
                               k[(((size_t)b * s.Tk + j) * s.n_kv_heads + h / group) * s.head_dim + d];
                    sum += exp(dot * scale);
                }
                lse_ref[((size_t)b * s.n_heads + h) * s.Tq + i] = (real)log(sum);
            }
    expect_close("attention lse (flash vs double)", lse, lse_ref, nrows, rtol, atol);
    real *owned[] = {q, k, v, dout, probs, lse, lse_ref, out[0], out[1], dq[0], dq[1], dk[0], dk[1], dv[0], dv[1]};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) free(owned[i]);
}
static void compare_attention(AttnShape s) { compare_attention_scaled(s, 1); }

START_TEST(test_attention_flash_matches_naive) {
    compare_attention((AttnShape){2, 130, 130, 4, 2, 16, NULL, NULL, true});  // 3 tiles, the last one partial
    compare_attention((AttnShape){1, 20, 75, 2, 2, 8, NULL, NULL, false});
    // Positions (ring attention's chunks): keys one position behind, so that the second key tile
    // starts at the first query tile's last position and one pair (63, 63) decides whether the tile
    // pair is skipped; then queries far ahead of every key (every tile fully visible: no mask).
    static int q_pos[128], k_pos[128], q_ahead[128];
    for (int i = 0; i < 128; i++) q_pos[i] = i, k_pos[i] = i - 1, q_ahead[i] = 1000 + i;
    compare_attention((AttnShape){2, 128, 128, 4, 2, 16, q_pos, k_pos, true});
    compare_attention((AttnShape){1, 128, 128, 2, 1, 8, q_ahead, k_pos, true});
    // scores of a few hundred (hostile, as after a loss spike): both kernels, and the lse in double
    compare_attention_scaled((AttnShape){2, 130, 130, 4, 2, 16, NULL, NULL, true}, 40);
}
END_TEST

// Cross-entropy at logits offset + N(0, 1) (hostile, as after a loss spike or with a large output
// bias) against float64 on the same fp32 logits; V = 256, a quarter of the targets IGNORE_INDEX.
// dloss = n_valid makes the gradient softmax - onehot, at unit scale. With each row's max and the log
// of its sum of exp(x - max) kept apart, nothing is rounded at the offset's scale:
//   loss: exact in double but for the fp32 log-sum (half an ulp of log V = 5.5: 2.4e-7 a row, less
//         averaged); measured 6e-8 at 1e3, 6e-10 at 1e4. Bound 1e-6.
//   dlogits: exp((x - max) - log-sum) with x - max exact: an fp32 rounding of the exponent, of the
//         log-sum and of the exp, each <= 2.4e-7 relative on a probability <= 1; measured 7.5e-9.
//         Bound 1e-6.
//   each kept row sums to 0 within V fp32 roundings of probabilities that sum to 1: measured 3.2e-7.
//         Bound 2e-6.
// Mistake seen failing: lse = fp32(max + log(sum)), rounded at an ulp of the offset (6e-5 at 1e3,
// 1e-3 at 1e4): loss off by 1.1e-5 and 2.4e-4, dlogits by 2.4e-6 and 2.1e-5, rows summing to 3e-5
// and 4.5e-4.
#define CE_OFFSET_V 256
#define CE_OFFSET_N 16
static void check_cross_entropy_offset(double offset) {
    int N = CE_OFFSET_N, V = CE_OFFSET_V, targets[CE_OFFSET_N], n_valid = 0;
    real *logits = new_normal((size_t)N * V, 1, 19), *stats = new_zeros(2 * (size_t)N);
    real *dlogits = new_zeros((size_t)N * V), *dlogits_ref = new_zeros((size_t)N * V);
    for (size_t i = 0; i < (size_t)N * V; i++) logits[i] = (real)(offset + logits[i]);
    for (int n = 0; n < N; n++) {
        targets[n] = n % 4 == 1 ? IGNORE_INDEX : (int)rng_below(19, 1, n, V);
        n_valid += targets[n] != IGNORE_INDEX;
    }
    double loss_ref = 0;  // float64 on the same fp32 logits
    for (int n = 0; n < N; n++) {
        const real *x = logits + (size_t)n * V;
        double max = -INFINITY, sum = 0;
        for (int j = 0; j < V; j++) max = fmax(max, x[j]);
        for (int j = 0; j < V; j++) sum += exp(x[j] - max);
        if (targets[n] == IGNORE_INDEX) continue;
        loss_ref += (max + log(sum) - x[targets[n]]) / n_valid;
        for (int j = 0; j < V; j++) dlogits_ref[(size_t)n * V + j] = (real)(exp(x[j] - max) / sum - (j == targets[n]));
    }
    double loss = cross_entropy_forward(stats, logits, targets, N, V);
    cross_entropy_backward(dlogits, logits, stats, targets, N, V, n_valid);
    char name[64];
    snprintf(name, sizeof name, "cross-entropy loss at offset %g", offset);
    ck_assert_msg(fabs(loss - loss_ref) <= 1e-6, "%s: %.10g, float64 %.10g (error %.2e)", name, loss, loss_ref,
                  fabs(loss - loss_ref));
    snprintf(name, sizeof name, "cross-entropy dlogits at offset %g", offset);
    expect_close(name, dlogits, dlogits_ref, (size_t)N * V, 0, 1e-6);
    for (int n = 0; n < N; n++) {
        double row = 0;
        for (int j = 0; j < V; j++) row += dlogits[(size_t)n * V + j];
        ck_assert_msg(fabs(row) <= 2e-6, "cross-entropy at offset %g: row %d of dlogits sums to %.2e", offset, n, row);
    }
    free(logits), free(stats), free(dlogits), free(dlogits_ref);
}

START_TEST(test_cross_entropy_large_offset) {
    check_cross_entropy_offset(1e3);
    check_cross_entropy_offset(1e4);
}
END_TEST

START_TEST(test_rope_backward_inverts_forward) {
    RopeTable t = rope_table_build(64, 16, 500000, 0, 1, 4, 8192);
    size_t n = 2 * 64 * 3 * 16;
    real *x = new_normal(n, 1, 8), *y = new_zeros(n);
    memcpy(y, x, sizeof(real) * n);
    rope_forward(y, &t, NULL, 2, 64, 3);
    rope_backward(y, &t, NULL, 2, 64, 3);
    expect_close("rope then its transpose", y, x, n, 1e-6, 1e-6);  // a rotation is orthogonal
    rope_table_free(&t);
    free(x), free(y);
}
END_TEST

// Two identical steps (forward, backward) give bit-identical loss and gradients.
START_TEST(test_step_is_bit_reproducible) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    int B = 3, T = 32, inputs[96], targets[96];
    for (int i = 0; i < B * T; i++) inputs[i] = (int)rng_below(1, 0, i, 256), targets[i] = (int)rng_below(1, 1, i, 256);
    real *grads[2];
    double loss[2];
    for (int run = 0; run < 2; run++) {
        Model m;
        model_init(&m, &cfg, 99, ATTN_FLASH);
        ModelActs acts = model_acts_alloc(&m, B, T, AC_NONE);
        model_zero_grads(&m);
        loss[run] = model_forward(&m, &acts, inputs, targets);
        model_backward(&m, &acts, inputs, 1.0);
        grads[run] = new_zeros(m.table.total_numel);
        memcpy(grads[run], m.grads, sizeof(real) * m.table.total_numel);
        model_acts_free(&acts);
        model_free(&m);
    }
    ck_assert_msg(loss[0] == loss[1], "loss %.17g vs %.17g", loss[0], loss[1]);
    ParamTable t = param_table_build(&cfg);
    expect_equal_bits("gradients of two identical steps", grads[0], grads[1], t.total_numel);
    param_table_free(&t);
    free(grads[0]), free(grads[1]);
}
END_TEST

// Published parameter counts: Llama 3.1 8B 8,030,261,248; 70B 70,553,706,496; Llama 3.2 1B (tied)
// 1,235,814,400; Llama 3.1 405B 405,853,388,800; Llama 2 7B 6,738,415,616.
START_TEST(test_param_counts) {
    struct { const char *name; size_t count; } known[] = {
        {"llama3_8b", 8030261248ULL}, {"llama3_70b", 70553706496ULL}, {"llama3_1b", 1235814400ULL},
        {"llama3_405b", 405853388800ULL}, {"llama2_7b", 6738415616ULL}};
    for (int i = 0; i < 5; i++) {
        ModelConfig c;
        ck_assert(model_config_lookup(known[i].name, &c));
        ck_assert_msg(model_param_count(&c) == known[i].count, "%s: %zu parameters, expected %zu", known[i].name,
                      model_param_count(&c), known[i].count);
        ParamTable t = param_table_build(&c);  // the table and the formula agree
        ck_assert_msg(t.total_numel == known[i].count, "%s table: %zu", known[i].name, t.total_numel);
        param_table_free(&t);
    }
    ModelConfig small;
    model_config_lookup("small", &small);
    ck_assert(model_param_count(&small) > 10000000 && model_param_count(&small) < 30000000);
}
END_TEST

// A checkpoint's or dump's model config: the JSON round trip keeps every field, and an int field that
// holds no int (a fraction, a value past INT_MAX, a string) is refused, naming the field.
static void expect_config_refused(const char *json, const char *field, const char *bad, const char *want) {
    char text[1024], err[256] = "", pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":", field);
    const char *at = strstr(json, pattern), *end = at ? strpbrk(at + strlen(pattern), ",}") : NULL;
    ck_assert_msg(at && end, "no field %s in %s", field, json);
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - json + strlen(pattern)), json, bad, end);
    ModelConfig c;
    ck_assert_msg(!model_config_from_json(text, &c, err, sizeof err), "%s = %s was accepted", field, bad);
    ck_assert_msg(strstr(err, field) && strstr(err, want), "%s = %s: error \"%s\" (wanted the field and \"%s\")",
                  field, bad, err, want);
}

START_TEST(test_config_json) {
    ModelConfig small, back;
    model_config_lookup("small", &small);
    char *json = model_config_to_json(&small), err[256] = "", diff[256] = "";
    ck_assert_msg(model_config_from_json(json, &back, err, sizeof err), "round trip: %s", err);
    ck_assert_msg(model_config_same_shape(&small, &back, diff, sizeof diff), "round trip changed %s", diff);
    expect_config_refused(json, "dim", "384.5", "not a whole number");
    expect_config_refused(json, "n_layers", "1e20", "not a whole number");
    expect_config_refused(json, "n_heads", "-3000000000", "not a whole number");
    expect_config_refused(json, "vocab_size", "\"256\"", "not a number");
    expect_config_refused(json, "rope_theta", "null", "not a number");
    free(json);
}
END_TEST

// 8B at seq 8192: matmul weights = all but the 65 norm vectors and the embedding lookup.
START_TEST(test_flops_per_token) {
    ModelConfig c;
    model_config_lookup("llama3_8b", &c);
    double matmul_params = 8030261248.0 - 65 * 4096.0 - 128256.0 * 4096;
    double expected = 6 * matmul_params + 6.0 * 32 * 4096 * 8192;
    ck_assert_msg(fabs(model_flops_per_token(&c, 8192) / expected - 1) < 1e-12, "flops/token %.6g, expected %.6g",
                  model_flops_per_token(&c, 8192), expected);
    // the per-block figure the trace carries adds up to the same forward count (without the head)
    double per_token_fwd_blocks = c.n_layers * model_block_forward_flops(&c, 1, 8192) / 8192;
    double head_fwd = 2.0 * 128256 * 4096;
    ck_assert_msg(fabs(3 * (per_token_fwd_blocks + head_fwd) / expected - 1) < 1e-9, "block flops disagree");
}
END_TEST

// First AdamW step from zero moments moves each weight by lr (times the sign of its gradient),
// after the decoupled decay: 1 * (1 - 0.1 * 0.1) - 0.1 = 0.89.
START_TEST(test_adamw_first_step) {
    real p[2] = {1, 1}, g[2] = {0.5, -2}, m[2] = {0}, v[2] = {0};
    AdamWConfig cfg = {0.9, 0.95, 1e-8, 0.1};
    adamw_step(p, g, m, v, 2, 1, 0.1, &cfg);
    ck_assert_msg(fabs(p[0] - 0.89) < 1e-6 && fabs(p[1] - 1.09) < 1e-6, "p = %.8f %.8f", p[0], p[1]);
}
END_TEST

START_TEST(test_lr_schedule) {
    LrSchedule s = {1e-3, 0.1, 10, 110, DECAY_COSINE};
    ck_assert(fabs(lr_at(&s, 1) - 1e-4) < 1e-15);
    ck_assert(fabs(lr_at(&s, 10) - 1e-3) < 1e-15);
    ck_assert(fabs(lr_at(&s, 60) - 0.55e-3) < 1e-12);  // halfway down the cosine
    ck_assert(fabs(lr_at(&s, 110) - 1e-4) < 1e-15);
    s.decay = DECAY_LINEAR;
    ck_assert(fabs(lr_at(&s, 60) - 0.55e-3) < 1e-12);
    ck_assert(fabs(lr_at(&s, 35) - (1e-3 - 0.9e-3 * 0.25)) < 1e-12);
}
END_TEST

START_TEST(test_clip_by_global_norm) {
    real g[2] = {3, 4};
    double norm = sqrt(sum_of_squares(g, 2));
    clip_by_global_norm(g, 2, norm, 1.0);
    ck_assert_msg(fabs(norm - 5) < 1e-12 && fabs(g[0] - 0.6) < 1e-6 && fabs(g[1] - 0.8) < 1e-6, "clip %g %g", g[0], g[1]);
    // the factor alone: never above 1 (a small norm is not scaled up), 1 with clipping off
    ck_assert(clip_coefficient(0.5, 1.0) == 1 && clip_coefficient(5.0, 0) == 1);
    ck_assert_msg(fabs(clip_coefficient(5.0, 1.0) - 1.0 / (5.0 + 1e-6)) < 1e-15, "%.17g", clip_coefficient(5.0, 1.0));
}
END_TEST

int main(void) {
    Suite *s = suite_create("reference (fp32)");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_philox_known_answers);
    tcase_add_test(tc, test_normal_moments);
    tcase_add_test(tc, test_init_is_sharding_independent);
    tcase_add_test(tc, test_init_statistics);
    tcase_add_test(tc, test_matmul_backends_agree);
    tcase_add_test(tc, test_attention_flash_matches_naive);
    tcase_add_test(tc, test_cross_entropy_large_offset);
    tcase_add_test(tc, test_rope_backward_inverts_forward);
    tcase_add_test(tc, test_step_is_bit_reproducible);
    tcase_add_test(tc, test_param_counts);
    tcase_add_test(tc, test_config_json);
    tcase_add_test(tc, test_flops_per_token);
    tcase_add_test(tc, test_adamw_first_step);
    tcase_add_test(tc, test_lr_schedule);
    tcase_add_test(tc, test_clip_by_global_norm);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
