// test_gpu_host.c: the parts of gpu/ that run without a GPU, tested on every machine. The kernels'
// per-element arithmetic (gpu/numerics.h), their launch geometry and shared-memory layouts
// (gpu/launch.h) and the cuBLASLt operand plan (gpu/matmul_plan.h) are plain C compiled into the
// kernels by nvcc and into this test by the C compiler, so what passes here is what the GPU runs.
// What needs a device (the kernels' thread mapping, cuBLASLt itself) is tests/gpu/test_gpu_ops.c.
#include <string.h>

#include "gpu/launch.h"
#include "gpu/matmul_plan.h"
#include "gpu/mfu.h"
#include "gpu/numerics.h"
#include "reference_cpu/adamw.h"
#include "reference_cpu/config.h"
#include "reference_cpu/ops.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

// ---- bf16 rounding ---------------------------------------------------------------------------------
// An independent definition of round-to-nearest-even: take the two bf16 values around x (the one
// truncation gives and the next one up in magnitude) and pick the nearer by exact arithmetic in
// double, the even one on a tie. Past the largest finite bf16 the next value up is 2^128 (IEEE
// rounds as if the exponent were unbounded, and such a result is infinity).
static uint16_t bf16_nearest_even_reference(float x) {
    if (isnan(x)) return 0x7fff;
    uint16_t lo = (uint16_t)(f32_as_bits(x) >> 16);  // |lo| <= |x|, same sign
    if (isinf(x) || (double)f32_from_bf16_bits(lo) == (double)x) return lo;
    uint16_t hi = (uint16_t)(lo + 1);               // next bf16 up in magnitude, same sign
    double sign = signbit(x) ? -1 : 1;
    double lo_value = f32_from_bf16_bits(lo);
    double hi_value = (hi & 0x7fff) == 0x7f80 ? sign * 0x1p128 : (double)f32_from_bf16_bits(hi);
    double d_lo = fabs((double)x - lo_value), d_hi = fabs(hi_value - (double)x);
    if (d_lo != d_hi) return d_lo < d_hi ? lo : hi;
    return (lo & 1) ? hi : lo;
}

static void expect_bf16(uint32_t bits, uint16_t want, const char *why) {
    float x = f32_from_bits(bits);
    uint16_t got = bf16_bits_from_f32(x);
    ck_assert_msg(got == want, "bf16(0x%08x) = 0x%04x, expected 0x%04x (%s)", bits, got, want, why);
}

START_TEST(test_bf16_rounding_edge_cases) {
    expect_bf16(0x3f800000, 0x3f80, "1.0 is exact");
    expect_bf16(0x3f808000, 0x3f80, "tie, even kept half stays");
    expect_bf16(0x3f818000, 0x3f82, "tie, odd kept half rounds up");
    expect_bf16(0x3f808001, 0x3f81, "just above the tie");
    expect_bf16(0x3f807fff, 0x3f80, "just below the tie");
    expect_bf16(0xbf818000, 0xbf82, "negative tie rounds away from zero when odd");
    expect_bf16(0x3fffffff, 0x4000, "carry into the exponent");
    expect_bf16(0x7f7fffff, 0x7f80, "largest float rounds to +inf");
    expect_bf16(0x7f7f7fff, 0x7f7f, "largest finite bf16 neighbourhood stays finite");
    expect_bf16(0xff7fffff, 0xff80, "-largest float rounds to -inf");
    expect_bf16(0x7f800000, 0x7f80, "+inf");
    expect_bf16(0xff800000, 0xff80, "-inf");
    expect_bf16(0x7fc00000, 0x7fff, "quiet NaN becomes the canonical NaN");
    expect_bf16(0x7f800001, 0x7fff, "signalling NaN: never rounded up to inf");
    expect_bf16(0xffffffff, 0x7fff, "negative NaN with every mantissa bit");
    expect_bf16(0x00000000, 0x0000, "+0");
    expect_bf16(0x80000000, 0x8000, "-0");
    expect_bf16(0x00000001, 0x0000, "smallest subnormal rounds to 0");
    expect_bf16(0x00008000, 0x0000, "subnormal tie to even (0)");
    expect_bf16(0x00018000, 0x0002, "subnormal tie to even (up)");
    expect_bf16(0x007fffff, 0x0080, "largest subnormal rounds up to the smallest normal");
    expect_bf16(0x80008001, 0x8001, "negative subnormal above the tie");
}
END_TEST

// Every kept half (all 65536 bf16 values, NaNs and infinities included) with the dropped halves
// that decide rounding, then a stride through all 2^32 floats.
START_TEST(test_bf16_rounding_matches_nearest_even) {
    static const uint32_t dropped[] = {0x0000, 0x0001, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff, 0x1234, 0x9abc};
    size_t checked = 0;
    for (uint32_t kept = 0; kept < 0x10000; kept++)
        for (size_t d = 0; d < sizeof dropped / sizeof dropped[0]; d++) {
            uint32_t bits = kept << 16 | dropped[d];
            float x = f32_from_bits(bits);
            uint16_t got = bf16_bits_from_f32(x), want = bf16_nearest_even_reference(x);
            ck_assert_msg(got == want, "bf16(0x%08x) = 0x%04x, nearest-even reference 0x%04x", bits, got, want);
            checked++;
        }
    for (uint64_t bits = 7; bits <= 0xffffffffu; bits += 9973) {
        float x = f32_from_bits((uint32_t)bits);
        uint16_t got = bf16_bits_from_f32(x), want = bf16_nearest_even_reference(x);
        ck_assert_msg(got == want, "bf16(0x%08x) = 0x%04x, nearest-even reference 0x%04x", (uint32_t)bits, got, want);
        checked++;
    }
    ck_assert(checked > 1000000);
}
END_TEST

START_TEST(test_bf16_round_trip) {  // bf16 -> float -> bf16 is the identity on every non-NaN value
    for (uint32_t b = 0; b < 0x10000; b++) {
        float x = f32_from_bf16_bits((uint16_t)b);
        if (isnan(x)) continue;
        ck_assert_msg(bf16_bits_from_f32(x) == b, "bf16 0x%04x does not survive a round trip", b);
        ck_assert(bf16_round(x) == x || (x == 0 && bf16_round(x) == 0));
    }
}
END_TEST

// ---- element-wise arithmetic against reference_cpu/ops.c ----------------------------------------------
// Same formulas in the same order, compiled by the same compiler: any difference is a contraction
// into a fused multiply-add chosen differently, a few ulp. A wrong formula is off by far more.
#define SAME_FORMULA_RTOL 1e-6
#define SAME_FORMULA_ATOL 1e-12

START_TEST(test_swiglu_matches_reference) {
    size_t n = 5000;
    float *gate = new_normal(n, 3.0, 1), *up = new_normal(n, 1.0, 2), *dout = new_normal(n, 1.0, 3);
    float *ref = new_zeros(n), *got = new_zeros(n);
    float *dgate_ref = new_normal(n, 1.0, 4), *dup_ref = new_normal(n, 1.0, 5);
    float *dgate = malloc(n * sizeof(float)), *dup = malloc(n * sizeof(float));
    memcpy(dgate, dgate_ref, n * sizeof(float));
    memcpy(dup, dup_ref, n * sizeof(float));
    swiglu_forward(ref, gate, up, n);
    swiglu_backward(dgate_ref, dup_ref, dout, gate, up, n);
    for (size_t i = 0; i < n; i++) {
        got[i] = swiglu_value(gate[i], up[i]);
        float dg, du;
        swiglu_grads(dout[i], gate[i], up[i], &dg, &du);
        dgate[i] = dg, dup[i] = du;  // the kernel overwrites, like the reference
    }
    expect_close("swiglu out", got, ref, n, SAME_FORMULA_RTOL, SAME_FORMULA_ATOL);
    expect_close("swiglu dgate", dgate, dgate_ref, n, SAME_FORMULA_RTOL, SAME_FORMULA_ATOL);
    expect_close("swiglu dup", dup, dup_ref, n, SAME_FORMULA_RTOL, SAME_FORMULA_ATOL);
    free(gate), free(up), free(dout), free(ref), free(got), free(dgate_ref), free(dup_ref), free(dgate), free(dup);
}
END_TEST

// The kernel's loop: pair i of head h of token t at position pos rotates by table (pos, i).
static void rope_with_pairs(float *x, const RopeTable *t, const int *positions, int B, int T, int H, float sign) {
    int half = t->head_dim / 2;
    for (int b = 0; b < B; b++)
        for (int tt = 0; tt < T; tt++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < half; i++) {
                    int pos = positions ? positions[tt] : tt;
                    float *v = x + (((size_t)b * T + tt) * H + h) * t->head_dim;
                    rope_rotate_pair(&v[2 * i], &v[2 * i + 1], t->cos[(size_t)pos * half + i],
                                     sign * t->sin[(size_t)pos * half + i]);
                }
}

START_TEST(test_rope_pairs_match_reference) {
    int B = 2, T = 9, H = 3, hd = 16;
    RopeTable t = rope_table_build(64, hd, 500000.0, 8.0, 1.0, 4.0, 32);
    int positions[9] = {5, 0, 63, 7, 7, 1, 30, 2, 11};
    size_t n = (size_t)B * T * H * hd;
    for (int use_positions = 0; use_positions < 2; use_positions++)
        for (int backward = 0; backward < 2; backward++) {
            float *ref = new_normal(n, 1.0, 10 + use_positions), *got = malloc(n * sizeof(float));
            memcpy(got, ref, n * sizeof(float));
            const int *pos = use_positions ? positions : NULL;
            if (backward) rope_backward(ref, &t, pos, B, T, H);
            else rope_forward(ref, &t, pos, B, T, H);
            rope_with_pairs(got, &t, pos, B, T, H, backward ? -1.0f : 1.0f);
            expect_close(backward ? "rope backward" : "rope forward", got, ref, n, SAME_FORMULA_RTOL, 1e-7);
            free(ref), free(got);
        }
    rope_table_free(&t);
}
END_TEST

START_TEST(test_adamw_update_matches_reference) {
    size_t n = 4000;
    AdamWConfig cfg = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *p_ref = new_normal(n, 0.02, 20), *m_ref = new_zeros(n), *v_ref = new_zeros(n);
    float *p = malloc(n * sizeof(float)), *m = new_zeros(n), *v = new_zeros(n);
    memcpy(p, p_ref, n * sizeof(float));
    for (long long step = 1; step <= 5; step++) {
        float *g = new_normal(n, step == 3 ? 1e-6 : 1.0, 20 + step);  // tiny gradients: eps matters
        double lr = 1e-3 * step;
        adamw_step(p_ref, g, m_ref, v_ref, n, step, lr, &cfg);
        AdamWScalars s = adamw_scalars(step, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
        for (size_t i = 0; i < n; i++) adamw_update(&p[i], &m[i], &v[i], g[i], s);
        free(g);
    }
    expect_close("adamw params", p, p_ref, n, SAME_FORMULA_RTOL, 1e-10);
    expect_close("adamw m", m, m_ref, n, SAME_FORMULA_RTOL, 1e-12);
    expect_close("adamw v", v, v_ref, n, SAME_FORMULA_RTOL, 1e-18);
    free(p_ref), free(m_ref), free(v_ref), free(p), free(m), free(v);
}
END_TEST

// ---- the online softmax of the attention kernels ---------------------------------------------------
START_TEST(test_online_softmax_edge_cases) {
    OnlineSoftmax st = {-INFINITY, 0};
    ck_assert(online_softmax_rescale(&st, -INFINITY) == 1.0f);  // a fully masked tile first
    ck_assert(st.m == -INFINITY && st.l == 0);
    ck_assert(online_softmax_weight(&st, -INFINITY) == 0);
    ck_assert(online_softmax_lse(&st) == -INFINITY && online_softmax_output(&st, 0) == 0);
    ck_assert(online_softmax_rescale(&st, 2.0f) == 0.0f);  // first visible tile: old state weighs 0
    ck_assert(st.m == 2.0f);
    online_softmax_add(&st, online_softmax_weight(&st, 2.0f) + online_softmax_weight(&st, 2.0f - logf(3)));
    float c = online_softmax_rescale(&st, -INFINITY);  // a masked tile later changes nothing
    ck_assert(c == 1.0f && st.m == 2.0f);
    c = online_softmax_rescale(&st, 3.0f);
    ck_assert(fabsf(c - expf(-1.0f)) < 1e-7f);
    ck_assert(fabsf(online_softmax_lse(&st) - (2.0f + logf(4.0f / 3))) < 1e-6f);
}
END_TEST

// The forward kernel's per-row recurrence, tile by tile over ATTN_BC keys with its masking (a
// score is -inf when the key is past Tk or not visible), run on the host and compared with the
// reference's naive attention: validates the online-softmax helpers as the kernel strings them.
static void attention_rows_host(float *out, float *lse, const float *q, const float *k, const float *v,
                                const AttnShape *s) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    float scale = (float)(1.0 / sqrt((double)hd));
    float acc[ATTN_MAX_HEAD_DIM], w[ATTN_BC];
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->n_heads; h++)
            for (int i = 0; i < s->Tq; i++) {
                const float *qi = q + (((size_t)b * s->Tq + i) * s->n_heads + h) * hd;
                OnlineSoftmax st = {-INFINITY, 0};
                memset(acc, 0, sizeof acc);
                for (int j0 = 0; j0 < s->Tk; j0 += ATTN_BC) {
                    float tile_max = -INFINITY;
                    for (int c = 0; c < ATTN_BC; c++) {
                        int j = j0 + c;
                        bool vis = j < s->Tk && attn_pos_visible(s->causal, s->q_pos ? s->q_pos[i] : i,
                                                                 s->k_pos ? s->k_pos[j] : j);
                        float score = -INFINITY;
                        if (vis) {
                            const float *kj = k + (((size_t)b * s->Tk + j) * s->n_kv_heads + h / group) * hd;
                            float dot = 0;
                            for (int d = 0; d < hd; d++) dot += qi[d] * kj[d];
                            score = dot * scale;
                        }
                        w[c] = score;
                        tile_max = fmaxf(tile_max, score);
                    }
                    float correction = online_softmax_rescale(&st, tile_max), sum = 0;
                    for (int d = 0; d < hd; d++) acc[d] *= correction;
                    for (int c = 0; c < ATTN_BC; c++) {
                        w[c] = online_softmax_weight(&st, w[c]);
                        sum += w[c];
                        if (w[c] == 0) continue;
                        const float *vj = v + (((size_t)b * s->Tk + j0 + c) * s->n_kv_heads + h / group) * hd;
                        for (int d = 0; d < hd; d++) acc[d] += w[c] * vj[d];
                    }
                    online_softmax_add(&st, sum);
                }
                float *o = out + (((size_t)b * s->Tq + i) * s->n_heads + h) * hd;
                for (int d = 0; d < hd; d++) o[d] = online_softmax_output(&st, acc[d]);
                lse[((size_t)b * s->n_heads + h) * s->Tq + i] = online_softmax_lse(&st);
            }
}

START_TEST(test_attention_row_recurrence_matches_reference) {
    // Tk spans three tiles. With positions: queries 0..3 sit before every key (no visible key: output
    // 0, lse -inf); the keys run backwards, so the first tile (positions 149..86) is fully masked for
    // the queries at 28..84, which see keys only in later tiles.
    int B = 2, Tq = 20, Tk = 150, H = 4, KV = 2, hd = 16;
    int *q_pos = malloc(sizeof(int) * Tq), *k_pos = malloc(sizeof(int) * Tk);
    for (int i = 0; i < Tq; i++) q_pos[i] = i < 4 ? -1 - i : 7 * i;
    for (int j = 0; j < Tk; j++) k_pos[j] = Tk - 1 - j;
    for (int variant = 0; variant < 3; variant++) {
        AttnShape s = {B, variant == 2 ? Tq : Tk, Tk, H, KV, hd, NULL, NULL, variant != 1};
        if (variant == 2) s.q_pos = q_pos, s.k_pos = k_pos;
        size_t nq = (size_t)B * s.Tq * H * hd, nk = (size_t)B * Tk * KV * hd, nl = (size_t)B * H * s.Tq;
        float *q = new_normal(nq, 1.0, 30), *k = new_normal(nk, 1.0, 31), *v = new_normal(nk, 1.0, 32);
        float *out = new_zeros(nq), *out_naive = new_zeros(nq), *out_ref = new_zeros(nq);
        float *lse = new_zeros(nl), *lse_ref = new_zeros(nl), *probs = new_zeros(nl * Tk);
        attention_rows_host(out, lse, q, k, v, &s);
        attention_naive_forward(out_naive, probs, q, k, v, &s);  // the output, from whole softmax rows
        attention_flash_forward(out_ref, lse_ref, q, k, v, &s);  // the lse, and the output again
        expect_close("attention rows out vs naive", out, out_naive, nq, FP32_ORDER_RTOL, FP32_ORDER_ATOL);
        expect_close("attention rows out vs flash", out, out_ref, nq, FP32_ORDER_RTOL, FP32_ORDER_ATOL);
        for (size_t r = 0; r < nl; r++)  // an infinite lse (a row that sees no key) must be the same infinity
            ck_assert_msg(isinf(lse_ref[r]) ? lse[r] == lse_ref[r] : fabsf(lse[r] - lse_ref[r]) <= 1e-5f * (1 + fabsf(lse_ref[r])),
                          "variant %d: lse[%zu] = %g, reference %g", variant, r, lse[r], lse_ref[r]);
        if (variant == 2) ck_assert(isinf(lse[0]) && out[0] == 0);  // query at position -1 sees nothing
        free(q), free(k), free(v), free(out), free(out_naive), free(out_ref), free(lse), free(lse_ref), free(probs);
    }
    free(q_pos), free(k_pos);
}
END_TEST

// ---- geometry ---------------------------------------------------------------------------------------------
START_TEST(test_grid_and_alignment) {
    ck_assert_uint_eq(grid_1d(0, 256, GPU_MAX_BLOCKS_1D), 0);  // empty: no launch
    ck_assert_uint_eq(grid_1d(1, 256, GPU_MAX_BLOCKS_1D), 1);
    ck_assert_uint_eq(grid_1d(256, 256, GPU_MAX_BLOCKS_1D), 1);
    ck_assert_uint_eq(grid_1d(257, 256, GPU_MAX_BLOCKS_1D), 2);
    ck_assert_uint_eq(grid_1d((size_t)1 << 40, 256, GPU_MAX_BLOCKS_1D), GPU_MAX_BLOCKS_1D);  // capped, no overflow
    ck_assert_uint_eq(ptr_alignment(0x7f0000000000u), 256);
    ck_assert_uint_eq(ptr_alignment(0x7f0000000100u + 4), 4);
    ck_assert_uint_eq(ptr_alignment(0x7f0000000100u + 2), 2);
    ck_assert_uint_eq(ptr_alignment(0x7f0000000100u + 64), 64);
    ck_assert_uint_eq(ptr_alignment(0x7f0000000101u), 1);
}
END_TEST

// Every region of every attention kernel's shared memory lies inside the block's allocation, no
// two overlap, and at the largest head_dim all three fit the sm_90 opt-in limit.
START_TEST(test_attention_smem_layouts) {
    for (int kernel = ATTN_KERNEL_FORWARD; kernel <= ATTN_KERNEL_BACKWARD_DKDV; kernel++)
        for (int hd = 2; hd <= ATTN_MAX_HEAD_DIM; hd += 2) {
            AttnSmemLayout L = attn_smem_layout((AttnKernel)kernel, hd);
            ck_assert_int_eq(L.ld % 2, 1);        // odd row stride: no bank conflicts down a column
            ck_assert_int_eq(L.ld_scores % 2, 1);
            bool dkdv = kernel == ATTN_KERNEL_BACKWARD_DKDV;
            int score_rows = dkdv ? ATTN_BC : ATTN_BR;
            struct { int at, words; const char *name; } r[] = {
                {L.q, ATTN_BR * L.ld, "q"},       {L.dout, ATTN_BR * L.ld, "dout"},
                {L.k, ATTN_BC * L.ld, "k"},       {L.v, ATTN_BC * L.ld, "v"},
                {L.p, score_rows * L.ld_scores, "p"}, {L.ds, score_rows * L.ld_scores, "ds"},
                {L.q_pos, ATTN_BR, "q_pos"},      {L.k_pos, ATTN_BC, "k_pos"},
                {L.lse, ATTN_BR, "lse"},          {L.dvec, ATTN_BR, "dvec"},
            };
            int n = sizeof r / sizeof r[0], used = 0;
            for (int a = 0; a < n; a++) {
                if (r[a].at < 0) continue;
                used += r[a].words;
                ck_assert_msg(r[a].at + r[a].words <= L.words, "kernel %d hd %d: %s past the end", kernel, hd, r[a].name);
                for (int b = a + 1; b < n; b++)
                    if (r[b].at >= 0)
                        ck_assert_msg(r[a].at + r[a].words <= r[b].at || r[b].at + r[b].words <= r[a].at,
                                      "kernel %d hd %d: %s and %s overlap", kernel, hd, r[a].name, r[b].name);
            }
            ck_assert_int_eq(used, L.words);  // no gaps either
            // What each kernel reads must exist.
            ck_assert(L.q >= 0 && L.k >= 0 && L.v >= 0 && L.q_pos >= 0 && L.k_pos >= 0);
            ck_assert(kernel == ATTN_KERNEL_FORWARD ? L.p >= 0 && L.dout < 0 : L.dout >= 0 && L.ds >= 0);
            ck_assert(!dkdv || (L.p >= 0 && L.lse >= 0 && L.dvec >= 0));
        }
    ck_assert_uint_le(attn_smem_bytes(ATTN_KERNEL_FORWARD, ATTN_MAX_HEAD_DIM), ATTN_SMEM_LIMIT);
    ck_assert_uint_le(attn_smem_bytes(ATTN_KERNEL_BACKWARD_DQ, ATTN_MAX_HEAD_DIM), ATTN_SMEM_LIMIT);
    ck_assert_uint_le(attn_smem_bytes(ATTN_KERNEL_BACKWARD_DKDV, ATTN_MAX_HEAD_DIM), ATTN_SMEM_LIMIT);
    // Forward at head_dim 64: q, k, v with stride 65, p with stride 65, positions.
    ck_assert_uint_eq(attn_smem_bytes(ATTN_KERNEL_FORWARD, 64), 4u * (3 * 64 * 65 + 64 * 65 + 128));
}
END_TEST

// The tensor-core kernels' layouts (gpu/attention_tc.cu): regions inside the allocation, apart, with
// no gaps; tiles and tile rows 16-byte aligned (the kernels store 16-byte chunks); within the sm_90
// opt-in limit; and every fragment load of gpu/mma.cuh (an ldmatrix) free of bank conflicts at every
// head_dim the kernels take: lanes that hit the same bank read the same 4-byte word.
static bool conflict_free(const long byte_addr[32]) {
    for (int a = 0; a < 32; a++)
        for (int b = a + 1; b < 32; b++) {
            long wa = byte_addr[a] / 4, wb = byte_addr[b] / 4;
            if (wa % 32 == wb % 32 && wa != wb) return false;
        }
    return true;
}
START_TEST(test_attention_tc_smem_layouts) {
    // Each kernel with a 64-row own tile and with the 128-row one (two fragments of rows a warp).
    for (int variant = 0; variant < 2 * (ATTN_KERNEL_BACKWARD_DKDV + 1); variant++)
        for (int hd = 16; hd <= ATTN_MAX_HEAD_DIM; hd += 16) {
            int kernel = variant % (ATTN_KERNEL_BACKWARD_DKDV + 1);
            int own_rows = variant <= ATTN_KERNEL_BACKWARD_DKDV ? ATTN_BR : 2 * ATTN_BR;
            AttnTcSmemLayout L = attn_tc_smem_layout_rows((AttnKernel)kernel, hd, own_rows);
            ck_assert_int_eq(L.ld * 2 % 16, 0);
            // Every region, and the second stage of the streamed ones (the other side's 64-row tile: K,
            // V and positions in forward and dQ; Q, dO, positions, lse and D in dK/dV).
            const bool keys_streamed = kernel != ATTN_KERNEL_BACKWARD_DKDV;
            int q_rows = keys_streamed ? own_rows : ATTN_BR, k_rows = keys_streamed ? ATTN_BC : own_rows;
            int q_tile = q_rows * L.ld * 2, k_tile = k_rows * L.ld * 2;
            struct { int at, bytes; const char *name; bool streamed; } base[] = {
                {L.q, q_tile, "q", !keys_streamed},        {L.dout, q_tile, "dout", !keys_streamed},
                {L.k, k_tile, "k", keys_streamed},         {L.v, k_tile, "v", keys_streamed},
                {L.q_pos, q_rows * 4, "q_pos", !keys_streamed}, {L.k_pos, k_rows * 4, "k_pos", keys_streamed},
                {L.lse, ATTN_BR * 4, "lse", true},        {L.dvec, ATTN_BR * 4, "dvec", true},
            };
            struct { int at, bytes; const char *name; } r[16];
            int n = 0, used = 0;
            for (int a = 0; a < 8; a++) {
                r[n].at = base[a].at, r[n].bytes = base[a].bytes, r[n++].name = base[a].name;
                if (base[a].at >= 0 && base[a].streamed)
                    r[n].at = base[a].at + L.stage_bytes, r[n].bytes = base[a].bytes, r[n++].name = "(stage 1)";
            }
            for (int a = 0; a < n; a++) {
                if (r[a].at < 0) continue;
                used += r[a].bytes;
                ck_assert_msg(r[a].at % 16 == 0, "kernel %d hd %d: %s not 16-byte aligned", kernel, hd, r[a].name);
                ck_assert_msg(r[a].at + r[a].bytes <= L.bytes, "kernel %d hd %d: %s past the end", kernel, hd, r[a].name);
                for (int b = a + 1; b < n; b++)
                    if (r[b].at >= 0)
                        ck_assert_msg(r[a].at + r[a].bytes <= r[b].at || r[b].at + r[b].bytes <= r[a].at,
                                      "kernel %d hd %d: %s and %s overlap", kernel, hd, r[a].name, r[b].name);
            }
            ck_assert_int_eq(used, L.bytes);
            ck_assert(L.q >= 0 && L.k >= 0 && L.v >= 0 && L.q_pos >= 0 && L.k_pos >= 0);
            ck_assert(kernel == ATTN_KERNEL_FORWARD ? L.dout < 0 : L.dout >= 0);
            ck_assert(kernel == ATTN_KERNEL_BACKWARD_DKDV ? L.lse >= 0 && L.dvec >= 0 : L.lse < 0 && L.dvec < 0);
            ck_assert_int_le(L.bytes, ATTN_SMEM_LIMIT);

            // Every fragment load of gpu/mma.cuh is an ldmatrix.x4, which reads its 4 matrices one
            // after another: 8 rows of 16 bytes each, at element row ld + column, for rows r0 .. r0+7
            // and a column a multiple of 8. Any r0, any such column: the 8 rows' 4-word pieces must
            // lie in 8 different bank quads (then the 32 words hit 32 banks).
            for (int r0 = 0; r0 < 16; r0++)
                for (int col = 0; col < hd; col += 8) {
                    long bytes[32];  // word l % 4 of row r0 + l / 4
                    for (int l = 0; l < 32; l++) bytes[l] = 2L * ((r0 + l / 4) * L.ld + col) + 4 * (l % 4);
                    ck_assert_msg(conflict_free(bytes), "hd %d: ldmatrix of rows %d.. at column %d has bank conflicts",
                                  hd, r0, col);
                }
        }
    // Forward at head_dim 64: the q tile of 64 rows by 72 bf16 and its positions, then two stages
    // of k and v tiles and their positions.
    AttnTcSmemLayout f64 = attn_tc_smem_layout(ATTN_KERNEL_FORWARD, 64);
    ck_assert_int_eq(f64.stage_bytes, 2 * 64 * 72 * 2 + 64 * 4);
    ck_assert_int_eq(f64.bytes, 64 * 72 * 2 + 64 * 4 + 2 * f64.stage_bytes);
    // The 128-row variant: the q tile and its positions twice as large, the stages the same.
    AttnTcSmemLayout f64x2 = attn_tc_smem_layout_rows(ATTN_KERNEL_FORWARD, 64, 128);
    ck_assert_int_eq(f64x2.stage_bytes, f64.stage_bytes);
    ck_assert_int_eq(f64x2.bytes, 128 * 72 * 2 + 128 * 4 + 2 * f64.stage_bytes);
    // dK/dV at head_dim 64: k and v tiles and their positions, then two stages of q and dout tiles
    // and the query rows' positions, lse and D; with 128 keys the k and v tiles double.
    AttnTcSmemLayout d64 = attn_tc_smem_layout(ATTN_KERNEL_BACKWARD_DKDV, 64);
    ck_assert_int_eq(d64.stage_bytes, 2 * 64 * 72 * 2 + 3 * 64 * 4);
    ck_assert_int_eq(d64.bytes, 2 * 64 * 72 * 2 + 64 * 4 + 2 * d64.stage_bytes);
    AttnTcSmemLayout d64x2 = attn_tc_smem_layout_rows(ATTN_KERNEL_BACKWARD_DKDV, 64, 128);
    ck_assert_int_eq(d64x2.stage_bytes, d64.stage_bytes);
    ck_assert_int_eq(d64x2.bytes, 2 * 128 * 72 * 2 + 128 * 4 + 2 * d64.stage_bytes);
}
END_TEST

// ---- the cuBLASLt plan, executed by a plain column-major GEMM ---------------------------------------
static float op_at(const float *x, bool trans, int ld, int row, int col) {  // op(X)[row, col]
    return trans ? x[col + (size_t)row * ld] : x[row + (size_t)col * ld];
}

// D = op(A) op(B) + beta C, column-major, as BLAS defines it (cuBLASLt's C and D may be two
// tensors), for every product of the plan's strided batch; sums in double.
static void gemm_colmajor_into(const GemmPlan *p, const float *A, const float *B, const float *C, float *D) {
    for (int b = 0; b < p->batch; b++) {
        const float *Ab = A + b * p->stride_a, *Bb = B + b * p->stride_b, *Cb = C + b * p->stride_c;
        float *Db = D + b * p->stride_c;
        for (int j = 0; j < p->n; j++)
            for (int i = 0; i < p->m; i++) {
                double sum = 0;
                for (int l = 0; l < p->k; l++)
                    sum += (double)op_at(Ab, p->trans_a, p->lda, i, l) * op_at(Bb, p->trans_b, p->ldb, l, j);
                size_t at = i + (size_t)j * p->ldc;
                Db[at] = (float)(sum + p->beta * Cb[at]);
            }
    }
}
// C = op(A) op(B) + beta C.
static void gemm_colmajor(const GemmPlan *p, const float *A, const float *B, float *C) { gemm_colmajor_into(p, A, B, C, C); }

static size_t operand_elements(GemmOperand o, int M, int K, int N) {
    return o == GEMM_INP ? (size_t)M * K : o == GEMM_WEIGHT ? (size_t)N * K : (size_t)M * N;
}

START_TEST(test_matmul_plan_matches_reference) {
    int M = 37, K = 29, N = 23;  // all different, none a multiple of another: a swapped dimension fails
    float *inp = new_normal((size_t)M * K, 1.0, 40), *weight = new_normal((size_t)N * K, 1.0, 41);
    float *dout = new_normal((size_t)M * N, 1.0, 42);
    const float *tensor[] = {[GEMM_INP] = inp, [GEMM_WEIGHT] = weight, [GEMM_DOUT] = dout};
    for (int kind = GEMM_FORWARD; kind <= GEMM_BACKWARD_WEIGHT; kind++) {
        GemmPlan p = gemm_plan((GemmKind)kind, M, K, N);
        // Shapes: op(A) is (m,k), op(B) is (k,n), storage covers exactly the tensor, lds are valid.
        ck_assert_int_eq(p.trans_a ? p.a_cols : p.a_rows, p.m);
        ck_assert_int_eq(p.trans_a ? p.a_rows : p.a_cols, p.k);
        ck_assert_int_eq(p.trans_b ? p.b_cols : p.b_rows, p.k);
        ck_assert_int_eq(p.trans_b ? p.b_rows : p.b_cols, p.n);
        ck_assert_uint_eq((size_t)p.a_rows * p.a_cols, operand_elements(p.a, M, K, N));
        ck_assert_uint_eq((size_t)p.b_rows * p.b_cols, operand_elements(p.b, M, K, N));
        ck_assert(p.lda >= p.a_rows && p.ldb >= p.b_rows && p.ldc >= p.m);

        size_t n_out = kind == GEMM_FORWARD ? (size_t)M * N : kind == GEMM_BACKWARD_INPUT ? (size_t)M * K : (size_t)N * K;
        ck_assert_uint_eq((size_t)p.m * p.n, n_out);
        float *got = new_normal(n_out, 1.0, 43), *want = malloc(n_out * sizeof(float));  // backward accumulates
        memcpy(want, got, n_out * sizeof(float));
        gemm_colmajor(&p, tensor[p.a], tensor[p.b], got);
        if (kind == GEMM_FORWARD) matmul_forward(want, inp, weight, M, K, N);
        else if (kind == GEMM_BACKWARD_INPUT) matmul_backward(want, NULL, dout, inp, weight, M, K, N);
        else matmul_backward(NULL, want, dout, inp, weight, M, K, N);
        const char *names[] = {"plan forward", "plan input gradient", "plan weight gradient"};
        expect_close(names[kind], got, want, n_out, FP32_ORDER_RTOL, FP32_ORDER_ATOL);
        free(got), free(want);
    }
    free(inp), free(weight), free(dout);
}
END_TEST

// A strided batch of two products: every operand at a stride of its own (each a little more than the
// operand, so the batches leave gaps; all different, so a stride taken from the wrong operand reads
// the wrong data), against reference_cpu's matmuls on each product's operands. The gaps of the
// output stay as they were. Then a shared operand (stride 0), as W1 and W3 share their input.
static void check_batched_plan(GemmKind kind, int M, int K, int N, const long long stride[3], const char *name) {
    const int count = 2;
    size_t size[3] = {[GEMM_INP] = (size_t)M * K, [GEMM_WEIGHT] = (size_t)N * K, [GEMM_DOUT] = (size_t)M * N};
    GemmOperand out_like = kind == GEMM_FORWARD ? GEMM_DOUT : kind == GEMM_BACKWARD_INPUT ? GEMM_INP : GEMM_WEIGHT;
    size_t n_out = size[out_like];
    GemmBatch batch = {.count = count, .stride = {stride[0], stride[1], stride[2]}, .out_stride = (long long)n_out + 5};
    float *tensor[3];
    for (int o = 0; o < 3; o++) tensor[o] = new_normal(size[o] + stride[o] * (count - 1), 1.0, 50 + o);
    size_t out_total = n_out + batch.out_stride * (count - 1);
    float *got = new_normal(out_total, 1.0, 53), *want = malloc(out_total * sizeof(float));
    memcpy(want, got, out_total * sizeof(float));  // the gaps stay; backward accumulates into the rest
    GemmPlan p = gemm_plan_batched(kind, M, K, N, &batch);
    gemm_colmajor(&p, tensor[p.a], tensor[p.b], got);
    for (int b = 0; b < count; b++) {
        const float *inp = tensor[GEMM_INP] + b * stride[GEMM_INP], *w = tensor[GEMM_WEIGHT] + b * stride[GEMM_WEIGHT];
        const float *dout = tensor[GEMM_DOUT] + b * stride[GEMM_DOUT];
        float *out = want + b * batch.out_stride;
        if (kind == GEMM_FORWARD) matmul_forward(out, inp, w, M, K, N);
        else if (kind == GEMM_BACKWARD_INPUT) matmul_backward(out, NULL, dout, inp, w, M, K, N);
        else matmul_backward(NULL, out, dout, inp, w, M, K, N);
    }
    expect_close(name, got, want, out_total, FP32_ORDER_RTOL, FP32_ORDER_ATOL);
    for (int o = 0; o < 3; o++) free(tensor[o]);
    free(got), free(want);
}

START_TEST(test_matmul_plan_batched) {
    int M = 37, K = 29, N = 23;
    const long long distinct[3] = {[GEMM_INP] = 37 * 29 + 1, [GEMM_WEIGHT] = 23 * 29 + 2, [GEMM_DOUT] = 37 * 23 + 3};
    check_batched_plan(GEMM_FORWARD, M, K, N, distinct, "batched plan forward");
    check_batched_plan(GEMM_BACKWARD_INPUT, M, K, N, distinct, "batched plan input gradient");
    check_batched_plan(GEMM_BACKWARD_WEIGHT, M, K, N, distinct, "batched plan weight gradient");
    // gpu/model.c's two: W1|W3 forward (input shared, weights w3 - w1 apart: the weight, then w2's
    // transpose-shaped gap of the same size) and their weight gradients (the same, dout batched).
    const long long w13_forward[3] = {[GEMM_INP] = 0, [GEMM_WEIGHT] = 2 * 23 * 29, [GEMM_DOUT] = 0};
    const long long w13_weight[3] = {[GEMM_INP] = 0, [GEMM_WEIGHT] = 0, [GEMM_DOUT] = 37 * 23};
    check_batched_plan(GEMM_FORWARD, M, K, N, w13_forward, "batched plan W1|W3 forward");
    check_batched_plan(GEMM_BACKWARD_WEIGHT, M, K, N, w13_weight, "batched plan W1|W3 weight gradient");
}
END_TEST

// The residual in the epilogue: D = op(A) op(B) + C with C the residual and D the output, a poisoned
// tensor of its own: must equal matmul_forward then the residual's add.
START_TEST(test_matmul_plan_residual) {
    int M = 37, K = 29, N = 23;
    size_t ny = (size_t)M * N;
    float *inp = new_normal((size_t)M * K, 1.0, 60), *weight = new_normal((size_t)N * K, 1.0, 61);
    float *residual = new_normal(ny, 1.0, 62), *got = malloc(ny * sizeof(float)), *want = malloc(ny * sizeof(float));
    float *residual_before = malloc(ny * sizeof(float));
    memcpy(residual_before, residual, ny * sizeof(float));
    for (size_t i = 0; i < ny; i++) got[i] = NAN;
    GemmPlan p = gemm_plan_residual(M, K, N);
    const float *tensor[] = {[GEMM_INP] = inp, [GEMM_WEIGHT] = weight, [GEMM_DOUT] = NULL};
    gemm_colmajor_into(&p, tensor[p.a], tensor[p.b], residual, got);
    matmul_forward(want, inp, weight, M, K, N);
    for (size_t i = 0; i < ny; i++) want[i] += residual[i];
    expect_close("plan forward + residual", got, want, ny, FP32_ORDER_RTOL, FP32_ORDER_ATOL);
    expect_equal_bits("residual left as it was", residual, residual_before, ny);
    free(inp), free(weight), free(residual), free(got), free(want), free(residual_before);
}
END_TEST

// ---- MFU ----------------------------------------------------------------------------------------------------
START_TEST(test_mfu_formula) {
    ModelConfig c;
    ck_assert(model_config_lookup("llama3_8b", &c));
    double f = model_flops_per_token(&c, 8192);
    // By hand: 6 * (matmul weights) + 6 * L * h_q * s.
    double hd = 128, per_layer = 4096.0 * 4096 * 2 + 2.0 * 4096 * 8 * hd + 3.0 * 4096 * 14336;
    double by_hand = 6 * (32 * per_layer + 128256.0 * 4096) + 6.0 * 32 * 4096 * 8192;
    ck_assert_msg(fabs(f - by_hand) <= 1e-9 * by_hand, "flops/token %.6g, by hand %.6g", f, by_hand);
    // 1e6 tokens in 2 s at that cost on one H100: 5e5 tok/s * f / 989e12.
    Throughput t = throughput(1e6, 2.0, f, PEAK_FLOPS_H100_SXM_BF16_DENSE);
    ck_assert(fabs(t.tokens_per_s - 5e5) < 1e-6);
    ck_assert(fabs(t.flops_per_s - 5e5 * f) <= 1e-9 * t.flops_per_s);
    ck_assert(fabs(t.mfu - 5e5 * f / 989e12) < 1e-12);
}
END_TEST

int main(void) {
    Suite *s = suite_create("gpu host side");
    TCase *tc = tcase_create("gpu host");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_bf16_rounding_edge_cases);
    tcase_add_test(tc, test_bf16_rounding_matches_nearest_even);
    tcase_add_test(tc, test_bf16_round_trip);
    tcase_add_test(tc, test_swiglu_matches_reference);
    tcase_add_test(tc, test_rope_pairs_match_reference);
    tcase_add_test(tc, test_adamw_update_matches_reference);
    tcase_add_test(tc, test_online_softmax_edge_cases);
    tcase_add_test(tc, test_attention_row_recurrence_matches_reference);
    tcase_add_test(tc, test_grid_and_alignment);
    tcase_add_test(tc, test_attention_smem_layouts);
    tcase_add_test(tc, test_attention_tc_smem_layouts);
    tcase_add_test(tc, test_matmul_plan_matches_reference);
    tcase_add_test(tc, test_matmul_plan_batched);
    tcase_add_test(tc, test_matmul_plan_residual);
    tcase_add_test(tc, test_mfu_formula);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
