// Chapter 9: FP8. Scales, quantize / dequantize and the emulated FP8 GEMMs, measured by SQNR
// against fp32 (torchao's thresholds), the outlier case that separates tensorwise from rowwise
// scaling, delayed scaling's history, and the FP8 hook in the model. (The casts themselves are
// checked bit for bit against cuda_fp8.h by tests/t_fp8_cast.sh.)
#include <string.h>

#include "chapters/09_fp8/fp8.h"
#include "common/mem.h"
#include "test_util.h"
#include "tolerances.h"

// 20 log10(|ref| / |ref - got|)
static double sqnr_db(const real *ref, const real *got, size_t n) {
    double s = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)ref[i] - (double)got[i];
        s += (double)ref[i] * ref[i];
        e += d * d;
    }
    return 10 * log10(s / e);
}

static void expect_sqnr(const char *what, const real *ref, const real *got, size_t n, double min_db) {
    double db = sqnr_db(ref, got, n);
    printf("%s: SQNR %.2f dB (at least %.1f, at most %.1f)\n", what, db, min_db, FP8_SQNR_MAX_DB);
    ck_assert_msg(db >= min_db, "%s: SQNR %.2f dB < %.1f dB", what, db, min_db);
    ck_assert_msg(db <= FP8_SQNR_MAX_DB, "%s: SQNR %.2f dB > %.1f dB: nothing was quantized to FP8", what, db,
                  FP8_SQNR_MAX_DB);
}

static Fp8 *new_fp8(Fp8Recipe r, int n_layers) {
    Fp8Options o = {r, FP8_AMAX_HISTORY_DEFAULT, 0};
    return fp8_create(&o, n_layers, (Fp8Groups){NULL, NULL});
}

START_TEST(test_scale_from_amax) {
    ck_assert(fp8_scale_from_amax(2.0, FP8_E4M3, false) == 224.0);
    ck_assert(fp8_scale_from_amax(1.0, FP8_E5M2, false) == 57344.0);
    ck_assert(fp8_scale_from_amax(0.0, FP8_E4M3, false) == 448.0 / FP8_AMAX_EPS);
    // rowwise rounds down to a power of two: 448 / 3 = 149.3 -> 128; 448 / 448 = 1 -> 1
    ck_assert(fp8_scale_from_amax(3.0, FP8_E4M3, true) == 128.0);
    ck_assert(fp8_scale_from_amax(448.0, FP8_E4M3, true) == 1.0);
    // ... and below 1 too (448 / 1000 = 0.448 -> 0.25, 448 / 449 -> 0.5): a truncating log2 rounds
    // those up, and amax x scale passes E4M3's 448. Down means amax x scale <= max for every amax.
    ck_assert(fp8_scale_from_amax(1000.0, FP8_E4M3, true) == 0.25);
    ck_assert(fp8_scale_from_amax(449.0, FP8_E4M3, true) == 0.5);
    for (double amax = 1e-3; amax < 1e7; amax *= 1.37)
        for (Fp8Format f = FP8_E4M3; f <= FP8_E5M2; f++) {
            double scale = fp8_scale_from_amax(amax, f, true), max = f == FP8_E4M3 ? 448.0 : 57344.0;
            ck_assert_msg(amax * scale <= max && amax * scale * 2 > max, "amax %g: power-of-two scale %g", amax, scale);
        }
    ck_assert_int_eq(fp8_recipe_parse("rowwise"), FP8_ROWWISE);
    ck_assert_int_eq(fp8_recipe_parse("delayed"), FP8_DELAYED);
    ck_assert_int_eq(fp8_recipe_parse("blockwise"), -1);
}
END_TEST

// Rowwise scales are powers of two: a row with amax 3 gets 128 (not 448/3), so 1.1 -> 140.8 ->
// 144 (E4M3's step is 16 there) -> 1.125, and 3 -> 384 -> 3 exactly. Through an identity weight
// (rows of amax 1, scale 256, exact) the output is the fake-quantized input itself.
START_TEST(test_rowwise_power_of_two) {
    enum { K = 4 };
    real x[K] = {3, (real)1.1, 0, -2}, w[K * K] = {0}, y[K];
    for (int i = 0; i < K; i++) w[i * K + i] = 1;
    Fp8Options o = {FP8_ROWWISE, 1, 0};
    Fp8 *f = fp8_create(&o, 1, (Fp8Groups){NULL, NULL});
    fp8_linear_forward(f, 0, PROJ_WQ, y, x, w, 1, K, K);
    real want[K] = {3, (real)1.125, 0, -2};
    expect_equal_bits("rowwise output through an identity", y, want, K);
    fp8_free(f);
}
END_TEST

// Quantize then dequantize a Gaussian tensor, scaled per tensor: the amax maps to the format's max,
// so the largest element is exact, and the whole tensor keeps >= 25 dB in either format.
START_TEST(test_cast_sqnr) {
    enum { R = 64, C = 256 };
    real *x = new_normal(R * C, 1.0, 1), *y = new_zeros(R * C);
    uint8_t *q = malloc(R * C);
    for (int fi = 0; fi < 2; fi++) {
        Fp8Format f = (Fp8Format)fi;
        float amax, scale;
        fp8_amax(&amax, x, R, C, FP8_PER_TENSOR);
        scale = (float)fp8_scale_from_amax(amax, f, false);
        fp8_quantize(q, x, R, C, FP8_PER_TENSOR, &scale, f);
        fp8_dequantize(y, q, R, C, FP8_PER_TENSOR, &scale, f);
        expect_sqnr(fp8_format_info(f)->name, x, y, R * C, FP8_SQNR_CAST_DB);
        int hits = 0;
        for (int i = 0; i < R * C; i++) hits += (q[i] & 0x7F) == fp8_format_info(f)->max_code;
        ck_assert_msg(hits >= 1, "%s: the amax element should land on max", fp8_format_info(f)->name);
        // the one-pass fake quantization is the same numbers
        real *z = new_zeros(R * C);
        fp8_fake_quantize(z, x, R, C, FP8_PER_TENSOR, &scale, f);
        expect_equal_bits("fake quantize vs quantize + dequantize", z, y, R * C);
        free(z);
    }
    free(x), free(y), free(q);
}
END_TEST

// The three GEMMs of a linear against fp32, per recipe and projection (each projection has its own
// scales and history; a format or scale mix-up can hit one alone): forward output, input and weight
// gradients.
static void check_linear(Fp8Recipe r, Projection p, double min_out_db, double min_dx_db, double min_dw_db) {
    enum { M = 128, K = 96, N = 64 };
    Fp8 *f = new_fp8(r, 1);
    real *x = new_normal(M * K, 1.0, 2), *w = new_normal(N * K, 0.05, 3), *dy = new_normal(M * N, 1e-4, 4);
    real *y = new_zeros(M * N), *y8 = new_zeros(M * N);
    real *dx = new_zeros(M * K), *dx8 = new_zeros(M * K), *dw = new_zeros(N * K), *dw8 = new_zeros(N * K);
    matmul_forward(y, x, w, M, K, N);
    matmul_backward(dx, dw, dy, x, w, M, K, N);
    fp8_linear_forward(f, 0, p, y8, x, w, M, K, N);
    fp8_linear_backward(f, 0, p, dx8, NULL, dy, x, w, M, K, N);
    fp8_linear_backward(f, 0, p, NULL, dw8, dy, x, w, M, K, N);
    char what[96];
    snprintf(what, sizeof what, "recipe %d, %s: output", (int)r, projection_param_name(p));
    expect_sqnr(what, y, y8, M * N, min_out_db);
    snprintf(what, sizeof what, "recipe %d, %s: input gradient", (int)r, projection_param_name(p));
    expect_sqnr(what, dx, dx8, M * K, min_dx_db);
    snprintf(what, sizeof what, "recipe %d, %s: weight gradient", (int)r, projection_param_name(p));
    expect_sqnr(what, dw, dw8, N * K, min_dw_db);
    fp8_free(f);
    free(x), free(w), free(dy), free(y), free(y8), free(dx), free(dx8), free(dw), free(dw8);
}

// A single FP8 GEMM (both operands quantized, fp32 accumulation) keeps >= 25 dB; the gradients,
// with an E5M2 operand (tensorwise, delayed), the linear's thresholds.
START_TEST(test_gemm_sqnr) {
    for (int p = 0; p < N_PROJ; p++) {
        check_linear(FP8_TENSORWISE, (Projection)p, FP8_SQNR_GEMM_DB, FP8_SQNR_LINEAR_DGRAD_DB, FP8_SQNR_LINEAR_WGRAD_DB);
        check_linear(FP8_ROWWISE, (Projection)p, FP8_SQNR_GEMM_DB, FP8_SQNR_GEMM_DB, FP8_SQNR_GEMM_DB);
        check_linear(FP8_DELAYED, (Projection)p, FP8_SQNR_GEMM_DB, FP8_SQNR_LINEAR_DGRAD_DB, FP8_SQNR_LINEAR_WGRAD_DB);
    }
}
END_TEST

// Outliers: a few tokens whose activations are 10^5 times the rest (the "massive activations" of
// LLMs reach 10^3 to 10^4). With one scale per tensor the outliers take the range and the ordinary
// rows fall into E4M3's subnormals or to zero; one scale per row keeps each row's precision.
START_TEST(test_outliers_tensorwise_vs_rowwise) {
    enum { M = 64, K = 128, N = 32 };
    real *x = new_normal(M * K, 1.0, 5), *w = new_normal(N * K, 0.05, 6);
    for (int r = 0; r < M; r += 16)
        for (int c = 0; c < K; c++) x[r * K + c] *= 1e5;
    real *y = new_zeros(M * N), *yt = new_zeros(M * N), *yr = new_zeros(M * N);
    matmul_forward(y, x, w, M, K, N);
    Fp8 *t = new_fp8(FP8_TENSORWISE, 1), *rw = new_fp8(FP8_ROWWISE, 1);
    fp8_linear_forward(t, 0, PROJ_WQ, yt, x, w, M, K, N);
    fp8_linear_forward(rw, 0, PROJ_WQ, yr, x, w, M, K, N);
    // SQNR over the ordinary rows only (the outlier rows are fine either way)
    double s = 0, et = 0, er = 0;
    for (int r = 0; r < M; r++) {
        if (r % 16 == 0) continue;
        for (int c = 0; c < N; c++) {
            double ref = y[r * N + c];
            s += ref * ref;
            et += (ref - yt[r * N + c]) * (ref - yt[r * N + c]);
            er += (ref - yr[r * N + c]) * (ref - yr[r * N + c]);
        }
    }
    double db_t = 10 * log10(s / et), db_r = 10 * log10(s / er);
    printf("outliers: ordinary rows' output SQNR: tensorwise %.2f dB, rowwise %.2f dB\n", db_t, db_r);
    ck_assert_msg(db_r >= FP8_SQNR_GEMM_DB, "rowwise on the ordinary rows: %.2f dB", db_r);
    ck_assert_msg(db_t < 10.0, "tensorwise on the ordinary rows: %.2f dB (expected the outliers to crush them)", db_t);
    fp8_free(t), fp8_free(rw);
    free(x), free(w), free(y), free(yt), free(yr);
}
END_TEST

// Delayed scaling: the first step is scaled dynamically; after each fp8_step_end the scale is
// fp8_max * 2^-margin / max(history); a history of zeros keeps the old scale; the history forgets
// after L steps; the state round-trips and resumes with the same scales.
START_TEST(test_delayed_history) {
    enum { M = 4, K = 8, N = 4 };
    Fp8Options o = {FP8_DELAYED, 2, 1};
    Fp8 *f = fp8_create(&o, 2, (Fp8Groups){NULL, NULL});
    real x[M * K], w[N * K], y[M * N];
    const double amaxes[] = {2.0, 8.0, 0.0, 0.0, 1.0, 0.5};  // the input's amax at each step
    const double refs[] = {2.0, 8.0, 8.0, 8.0, 1.0, 1.0};    // max of the last 2 (two zeros: kept)
    for (int step = 0; step < 6; step++) {
        for (int i = 0; i < M * K; i++) x[i] = (real)(amaxes[step] * (i % 2 ? -1 : 0.5));
        for (int i = 0; i < N * K; i++) w[i] = (real)0.25;
        fp8_linear_forward(f, 1, PROJ_W2, y, x, w, M, K, N);
        fp8_step_end(f);
        float want = (float)(448.0 / 2 / refs[step]), got = fp8_delayed_scale(f, 1, PROJ_W2, 0);
        ck_assert_msg(got == want, "step %d: input scale %g, expected %g", step, got, want);
        ck_assert(fp8_delayed_scale(f, 1, PROJ_W2, 1) == (float)(448.0 / 2 / 0.25));
        ck_assert(fp8_delayed_scale(f, 0, PROJ_W2, 0) == 0);  // never used: no scale yet
    }
    // one more step (amax 4, written at position 0 of the history), then save, run a step on each of
    // two copies, compare: the restored copy writes the next amax where the original does
    for (int i = 0; i < M * K; i++) x[i] = (real)(i == 3 ? 4.0 : 0.0);
    fp8_linear_forward(f, 1, PROJ_W2, y, x, w, M, K, N);
    fp8_step_end(f);
    size_t n = fp8_state_numel(f);
    float *state = malloc(sizeof(float) * n);
    fp8_state_get(f, state);
    Fp8 *g = fp8_create(&o, 2, (Fp8Groups){NULL, NULL});
    fp8_state_set(g, state);
    real ya[M * N], yb[M * N];
    for (int i = 0; i < M * K; i++) x[i] = (real)(0.1 * i);
    fp8_linear_forward(f, 1, PROJ_W2, ya, x, w, M, K, N);
    fp8_linear_forward(g, 1, PROJ_W2, yb, x, w, M, K, N);
    expect_equal_bits("output after restoring the state", ya, yb, M * N);
    fp8_step_end(f), fp8_step_end(g);
    ck_assert(fp8_delayed_scale(f, 1, PROJ_W2, 0) == (float)(448.0 / 2 / 4));  // 4 is still in the history
    ck_assert(fp8_delayed_scale(f, 1, PROJ_W2, 0) == fp8_delayed_scale(g, 1, PROJ_W2, 0));
    free(state);
    fp8_free(f), fp8_free(g);
}
END_TEST

// The gradient operand of an FP8 backward, exactly: with W the identity, dX is dY as the GEMM
// multiplied it, so it must equal dY fake-quantized with the recipe's format, granularity and scale
// (compared as numbers, rtol and atol 0: an underflow to -0 sums to +0). dY spans 2^0 down to 2^-31,
// so that a scale half as large, or E4M3 where E5M2 belongs, moves its small values to another grid.
static void expect_grad_operand(Fp8 *f, const real *dy, int M, int N, Fp8Granularity g, const float *scale,
                                Fp8Format format, const char *what) {
    real *w = new_zeros((size_t)N * N), *dx = new_zeros((size_t)M * N), *want = new_zeros((size_t)M * N);
    for (int n = 0; n < N; n++) w[(size_t)n * N + n] = 1;  // exact in E4M3 at every scale used here
    fp8_linear_backward(f, 0, PROJ_W2, dx, NULL, dy, NULL, w, M, N, N);
    fp8_fake_quantize(want, dy, M, N, g, scale, format);
    expect_close(what, dx, want, (size_t)M * N, 0, 0);
    free(w), free(dx), free(want);
}

START_TEST(test_grad_operand_exact) {
    enum { M = 4, N = 64 };
    real dy[M * N], dy2[M * N];
    for (int i = 0; i < M * N; i++) {
        double mantissa = 1 + (i * 37 % 64) / 64.0;
        dy[i] = (real)((i % 3 ? 1 : -1) * mantissa * ldexp(1, -(i % 32)));
        dy2[i] = 4 * dy[i];
    }
    Fp8Groups none = {NULL, NULL};
    // tensorwise: one scale, E5M2
    Fp8Options tensorwise = {FP8_TENSORWISE, 1, 0};
    Fp8 *f = fp8_create(&tensorwise, 1, none);
    float amax, scale;
    fp8_amax(&amax, dy, M, N, FP8_PER_TENSOR);
    scale = (float)fp8_scale_from_amax(amax, FP8_E5M2, false);
    expect_grad_operand(f, dy, M, N, FP8_PER_TENSOR, &scale, FP8_E5M2, "tensorwise dY (E5M2, amax scale)");
    fp8_free(f);
    // rowwise: a power-of-two scale per row of dY (the contraction runs along it), E4M3
    Fp8Options rowwise = {FP8_ROWWISE, 1, 0};
    f = fp8_create(&rowwise, 1, none);
    float amax_rows[M], scale_rows[M];
    fp8_amax(amax_rows, dy, M, N, FP8_PER_ROW);
    for (int m = 0; m < M; m++) scale_rows[m] = (float)fp8_scale_from_amax(amax_rows[m], FP8_E4M3, true);
    expect_grad_operand(f, dy, M, N, FP8_PER_ROW, scale_rows, FP8_E4M3, "rowwise dY (E4M3, per row, 2^k)");
    fp8_free(f);
    // delayed: the first step from the current amax; then from the history, E5M2's max x 2^-margin over
    // it, which saturates dY x 4
    Fp8Options delayed = {FP8_DELAYED, 2, 1};
    f = fp8_create(&delayed, 1, none);
    expect_grad_operand(f, dy, M, N, FP8_PER_TENSOR, &scale, FP8_E5M2, "delayed dY, step 1 (current amax)");
    fp8_step_end(f);
    float history_scale = (float)(57344.0 / 2 / amax);
    ck_assert_msg(fp8_delayed_scale(f, 0, PROJ_W2, 2) == history_scale, "delayed gradient scale %g, expected %g",
                  fp8_delayed_scale(f, 0, PROJ_W2, 2), history_scale);
    expect_grad_operand(f, dy2, M, N, FP8_PER_TENSOR, &history_scale, FP8_E5M2, "delayed dY x 4, step 2 (history)");
    fp8_free(f);
}
END_TEST

// A tensor that is all zeros at the first step (a projection initialised to zero) has no scale after
// it: at the next step, with values, it is scaled from its current amax, giving the outputs of
// current (tensorwise) scaling, not 0 / 0 = NaN everywhere. Mutation seen failing: the scale of 0
// used as it is (every output NaN).
START_TEST(test_delayed_zero_first_step) {
    enum { M = 4, K = 8, N = 4 };
    Fp8Options delayed = {FP8_DELAYED, 4, 0}, current = {FP8_TENSORWISE, 1, 0};
    Fp8 *f = fp8_create(&delayed, 1, (Fp8Groups){NULL, NULL}), *g = fp8_create(&current, 1, (Fp8Groups){NULL, NULL});
    real x[M * K], w[N * K], y[M * N], want[M * N];
    for (int i = 0; i < N * K; i++) w[i] = (real)(0.25 - 0.03 * i);
    for (int i = 0; i < M * K; i++) x[i] = 0;
    fp8_linear_forward(f, 0, PROJ_WO, y, x, w, M, K, N);
    fp8_step_end(f);
    ck_assert(fp8_delayed_scale(f, 0, PROJ_WO, 0) == 0);  // no amax yet: no scale
    for (int i = 0; i < M * K; i++) x[i] = (real)(0.1 * i - 1.3);
    fp8_linear_forward(f, 0, PROJ_WO, y, x, w, M, K, N);  // x from its current amax, w from the history
    fp8_linear_forward(g, 0, PROJ_WO, want, x, w, M, K, N);
    expect_equal_bits("delayed after an all-zero first step vs tensorwise", y, want, M * N);
    fp8_step_end(f);
    float amax = 0;
    for (int i = 0; i < M * K; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    ck_assert(fp8_delayed_scale(f, 0, PROJ_WO, 0) == (float)fp8_scale_from_amax(amax, FP8_E4M3, false));
    fp8_free(f), fp8_free(g);
}
END_TEST

// An input with an infinity (an overflow upstream) must not set the scale to 448 / inf = 0, which
// would quantize every value of that tensor to 0 for as long as the infinity stays in the history:
// the scale stays where it was until the history holds finite amaxes only.
START_TEST(test_delayed_nonfinite_amax) {
    enum { M = 4, K = 8, N = 4 };
    Fp8Options o = {FP8_DELAYED, 2, 1};
    Fp8 *f = fp8_create(&o, 2, (Fp8Groups){NULL, NULL});
    real x[M * K], w[N * K], y[M * N];
    for (int i = 0; i < N * K; i++) w[i] = (real)0.25;
    const double amaxes[] = {2.0, INFINITY, 1.0, 1.0};
    const double refs[] = {2.0, 2.0, 2.0, 1.0};  // the scale of amax 2 kept while inf is in the last 2
    for (int step = 0; step < 4; step++) {
        for (int i = 0; i < M * K; i++) x[i] = (real)(i == 5 ? amaxes[step] : 0.125);
        fp8_linear_forward(f, 1, PROJ_W2, y, x, w, M, K, N);
        fp8_step_end(f);
        float want = (float)(448.0 / 2 / refs[step]), got = fp8_delayed_scale(f, 1, PROJ_W2, 0);
        ck_assert_msg(got == want, "step %d (amax %g): input scale %g, expected %g", step, amaxes[step], got, want);
    }
    fp8_free(f);
}
END_TEST

// The model with the FP8 hook: the loss stays within 1% of fp32 and the gradients keep the linear's
// SQNR; without the hook, nothing changes; with full activation checkpointing the recompute
// quantizes the same tensors with the same scales, so the gradients are the same bits.
static double model_step(const ModelConfig *cfg, Fp8 *f, ActCheckpoint ac, real *grads) {
    enum { B = 2, T = 16 };
    int inputs[B * T], targets[B * T];
    for (int i = 0; i < B * T; i++) {
        inputs[i] = (int)rng_below(3, 0, (uint64_t)i, (uint64_t)cfg->vocab_size);
        targets[i] = (int)rng_below(3, 1, (uint64_t)i, (uint64_t)cfg->vocab_size);
    }
    Model m;
    model_init(&m, cfg, 7, ATTN_FLASH);
    Fp8Hook hook;
    if (f) hook = fp8_hook(f), m.fp8 = &hook;
    ModelActs acts = model_acts_alloc(&m, B, T, ac);
    model_zero_grads(&m);
    double loss = model_forward(&m, &acts, inputs, targets);
    model_backward(&m, &acts, inputs, 1.0);
    memcpy(grads, m.grads, sizeof(real) * m.table.total_numel);
    model_acts_free(&acts);
    model_free(&m);
    return loss;
}

START_TEST(test_model_hook) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    ParamTable t = param_table_build(&cfg);
    real *g32 = new_zeros(t.total_numel), *g8 = new_zeros(t.total_numel), *g8ac = new_zeros(t.total_numel);
    double l32 = model_step(&cfg, NULL, AC_NONE, g32);
    for (int r = 0; r < 3; r++) {
        Fp8 *f = new_fp8((Fp8Recipe)r, cfg.n_layers);
        double l8 = model_step(&cfg, f, AC_NONE, g8);
        printf("recipe %d: loss %.6f, fp32 %.6f\n", r, l8, l32);
        ck_assert_msg(l8 != l32, "recipe %d: the FP8 hook did not run (loss equals fp32's)", r);
        ck_assert_msg(fabs(l8 - l32) <= FP8_LOSS_RTOL * l32, "recipe %d: loss %.6f vs fp32 %.6f", r, l8, l32);
        // every projection's weight gradient in every layer (a bug in one projection, such as w2's
        // input cast to E5M2 or its output scaled, leaves the loss near ln(vocab) at this step)
        for (int l = 0; l < cfg.n_layers; l++)
            for (int p = 0; p < N_PROJ; p++) {
                char name[96];
                snprintf(name, sizeof name, "layers.%d.%s", l, projection_param_name(p));
                const ParamInfo *w = param_table_find(&t, name);
                ck_assert_msg(w != NULL, "no parameter %s", name);
                char what[128];
                snprintf(what, sizeof what, "recipe %d: %s gradient in the model", r, name);
                expect_sqnr(what, g32 + w->offset, g8 + w->offset, w->numel, FP8_SQNR_LINEAR_WGRAD_DB);
            }
        double l8ac = model_step(&cfg, f, AC_FULL, g8ac);
        ck_assert_msg(l8ac == l8, "recipe %d: loss with AC %.17g vs %.17g", r, l8ac, l8);
        expect_equal_bits("FP8 gradients with full AC vs without", g8ac, g8, t.total_numel);
        fp8_free(f);
    }
    free(g32), free(g8), free(g8ac);
    param_table_free(&t);
}
END_TEST

int main(void) {
    Suite *s = suite_create("fp8");
    TCase *tc = tcase_create("fp8");
    tcase_add_test(tc, test_scale_from_amax);
    tcase_add_test(tc, test_rowwise_power_of_two);
    tcase_add_test(tc, test_cast_sqnr);
    tcase_add_test(tc, test_gemm_sqnr);
    tcase_add_test(tc, test_outliers_tensorwise_vs_rowwise);
    tcase_add_test(tc, test_delayed_history);
    tcase_add_test(tc, test_grad_operand_exact);
    tcase_add_test(tc, test_delayed_zero_first_step);
    tcase_add_test(tc, test_delayed_nonfinite_amax);
    tcase_add_test(tc, test_model_hook);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
