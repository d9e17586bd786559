// Chapter 5: activation checkpointing. The recompute runs the same functions on the same inputs,
// so every mode must give the loss and the gradients of no checkpointing bit for bit, for both
// attention kernels and for tied and untied embeddings, while keeping fewer activations.
#include <string.h>

#include "common/mem.h"
#include "reference_cpu/model.h"
#include "test_util.h"

enum { B = 3, T = 32 };  // tiny: max_seq_len 32

typedef struct {
    double loss;
    real *grads;             // (total_numel) after one forward + backward
    size_t kept_bytes;       // MEM_ACTIVATIONS allocated by model_acts_alloc
} StepOut;

static void make_batch(int *inputs, int *targets, int vocab) {
    for (int i = 0; i < B * T; i++) {
        inputs[i] = (int)rng_below(3, 0, (uint64_t)i, (uint64_t)vocab);
        targets[i] = (int)rng_below(3, 1, (uint64_t)i, (uint64_t)vocab);
    }
}

// Two micro-batches, so the recompute buffers are reused with other data in between.
static StepOut run_step(const ModelConfig *cfg, AttentionImpl attention, ActCheckpoint ac) {
    int inputs[B * T], targets[B * T], inputs2[B * T];
    make_batch(inputs, targets, cfg->vocab_size);
    for (int i = 0; i < B * T; i++) inputs2[i] = (inputs[i] + 7) % cfg->vocab_size;
    Model m;
    model_init(&m, cfg, 11, attention);
    size_t before = mem_current(MEM_ACTIVATIONS);
    ModelActs acts = model_acts_alloc(&m, B, T, ac);
    StepOut out = {.kept_bytes = mem_current(MEM_ACTIVATIONS) - before};
    model_zero_grads(&m);
    out.loss = model_forward(&m, &acts, inputs, targets);
    model_backward(&m, &acts, inputs, 0.5);
    out.loss += model_forward(&m, &acts, inputs2, targets);
    model_backward(&m, &acts, inputs2, 0.5);
    out.grads = new_zeros(m.table.total_numel);
    memcpy(out.grads, m.grads, sizeof(real) * m.table.total_numel);
    model_acts_free(&acts);
    model_free(&m);
    return out;
}

static void check_mode(bool tied, AttentionImpl attention, ActCheckpoint ac) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    cfg.tied = tied;
    StepOut ref = run_step(&cfg, attention, AC_NONE), got = run_step(&cfg, attention, ac);
    ck_assert_msg(got.loss == ref.loss, "loss %.17g with checkpointing vs %.17g without", got.loss, ref.loss);
    ParamTable t = param_table_build(&cfg);
    char name[96];
    for (int i = 0; i < t.count; i++) {
        const ParamInfo *p = &t.items[i];
        snprintf(name, sizeof name, "grad %s (ac %d)", p->name, (int)ac);
        expect_equal_bits(name, got.grads + p->offset, ref.grads + p->offset, p->numel);
    }
    // Less memory kept: the per-block saving times the blocks, minus the one shared recompute set.
    ck_assert_msg(got.kept_bytes < ref.kept_bytes, "activations %zu bytes with checkpointing, %zu without",
                  got.kept_bytes, ref.kept_bytes);
    param_table_free(&t);
    free(ref.grads);
    free(got.grads);
}

START_TEST(test_full_flash_untied) { check_mode(false, ATTN_FLASH, AC_FULL); }
END_TEST
START_TEST(test_full_naive_tied) { check_mode(true, ATTN_NAIVE, AC_FULL); }
END_TEST
START_TEST(test_selective_flash_tied) { check_mode(true, ATTN_FLASH, AC_SELECTIVE); }
END_TEST
START_TEST(test_selective_naive_untied) { check_mode(false, ATTN_NAIVE, AC_SELECTIVE); }
END_TEST

// The estimate chapter 5 prints (bytes kept per block) is what the allocator counts: the blocks'
// own buffers are exactly n_layers x model_acts_bytes_per_block, and the mode order holds.
START_TEST(test_bytes_per_block_matches_allocator) {
    ModelConfig cfg;
    model_config_lookup("tiny", &cfg);
    Model m;
    model_init(&m, &cfg, 1, ATTN_FLASH);
    size_t per_mode[3];
    for (int ac = AC_NONE; ac <= AC_SELECTIVE; ac++) {
        per_mode[ac] = model_acts_bytes_per_block(&m, B, T, (ActCheckpoint)ac);
        size_t before = mem_current(MEM_ACTIVATIONS);
        ModelActs acts = model_acts_alloc(&m, B, T, (ActCheckpoint)ac);
        size_t total = mem_current(MEM_ACTIVATIONS) - before;
        // the rest: the shared recompute set (what one block drops), the head and backward scratch
        size_t shared = per_mode[AC_NONE] - per_mode[ac];
        size_t kept_by_blocks = total - shared - (ac == AC_FULL ? sizeof(real) * B * T * cfg.dim : 0);
        model_acts_free(&acts);
        ModelActs none = model_acts_alloc(&m, B, T, AC_NONE);
        size_t scratch = mem_current(MEM_ACTIVATIONS) - before - (size_t)cfg.n_layers * per_mode[AC_NONE];
        model_acts_free(&none);
        ck_assert_msg(kept_by_blocks - scratch == (size_t)cfg.n_layers * per_mode[ac],
                      "ac %d: blocks keep %zu bytes, estimate %zu", ac, kept_by_blocks - scratch,
                      (size_t)cfg.n_layers * per_mode[ac]);
    }
    ck_assert(per_mode[AC_FULL] < per_mode[AC_SELECTIVE] && per_mode[AC_SELECTIVE] < per_mode[AC_NONE]);
    double mm, ew;
    model_recompute_flops(&m, B, T, AC_FULL, &mm, &ew);
    ck_assert(mm == model_block_forward_flops(&cfg, B, T) && ew > 0);
    model_recompute_flops(&m, B, T, AC_SELECTIVE, &mm, &ew);
    ck_assert(mm == 0 && ew > 0);  // flash: selective recomputes no matmul
    model_recompute_flops(&m, B, T, AC_NONE, &mm, &ew);
    ck_assert(mm == 0 && ew == 0);
    model_free(&m);
}
END_TEST

// What each block keeps, per mode, pinned to a sum over the named tensors of BlockActs with their
// shapes (tiny at B = 3, T = 32: BT = 96 rows, D = 64, 8 query heads and 4 kv heads of head_dim
// hd = D / 8 = 8, ffn F = 128), in elements of `real`:
//   x            (BT, D)          block input                      every mode
//   xn1, rstd1   (BT, D), (BT)    attention_norm output, 1/rms      none (recomputed otherwise)
//   q            (BT, Hq hd)      after RoPE                       none, selective
//   k, v         (BT, Hkv hd)     after RoPE                       none, selective
//   attn         (BT, Hq hd)      attention output, before wo      none, selective
//   attn_stats   flash: lse (B, Hq, T); naive: probabilities (B, Hq, T, T)
//                                                                  none; selective with flash only
//   h            (BT, D)          residual after attention         none, selective
//   xn2, rstd2   (BT, D), (BT)    ffn_norm output, 1/rms            none
//   gate, up     (BT, F)          w1 and w3 outputs                none, selective
//   act          (BT, F)          silu(gate) * up                  none
// Full keeps the block input alone; selective every matmul output, the attention's and the
// residual, recomputing the norms and SwiGLU (and naive attention's (T, T) probabilities).
static void check_bytes_per_block(AttentionImpl attention) {
    ModelConfig c;
    ck_assert(model_config_lookup("tiny", &c));
    Model m;
    model_init_shapes(&m, &c, attention, 1, 0);
    bool naive = attention == ATTN_NAIVE;
    size_t BT = (size_t)B * T, D = c.dim, F = c.ffn_dim, Hq = c.n_heads, Hkv = c.n_kv_heads, hd = D / Hq;
    size_t x = BT * D, xn1 = BT * D, rstd1 = BT, q = BT * Hq * hd, k = BT * Hkv * hd, v = BT * Hkv * hd;
    size_t attn = BT * Hq * hd, stats = naive ? (size_t)B * Hq * T * T : (size_t)B * Hq * T, h = BT * D;
    size_t xn2 = BT * D, rstd2 = BT, gate = BT * F, up = BT * F, act = BT * F;
    size_t want[3];
    want[AC_NONE] = x + xn1 + rstd1 + q + k + v + attn + stats + h + xn2 + rstd2 + gate + up + act;
    want[AC_FULL] = x;
    want[AC_SELECTIVE] = x + q + k + v + attn + (naive ? 0 : stats) + h + gate + up;
    const char *const names[3] = {"none", "full", "selective"};
    for (int ac = AC_NONE; ac <= AC_SELECTIVE; ac++) {
        size_t got = model_acts_bytes_per_block(&m, B, T, (ActCheckpoint)ac), bytes = want[ac] * sizeof(real);
        ck_assert_msg(got == bytes,
                      "--ac %s, %s attention, tiny at B %d T %d: %zu bytes kept per block, want %zu (%+lld elements; "
                      "act, gate and up are %zu each, xn1 and xn2 %zu, q and attn %zu, k and v %zu, stats %zu)",
                      names[ac], naive ? "naive" : "flash", B, T, got, bytes,
                      ((long long)got - (long long)bytes) / (long long)sizeof(real), act, xn1, q, k, stats);
    }
    model_free(&m);
}

START_TEST(test_bytes_per_block_from_shapes) {
    check_bytes_per_block(ATTN_FLASH);
    check_bytes_per_block(ATTN_NAIVE);
}
END_TEST

int main(void) {
    Suite *s = suite_create("activation checkpointing (fp32)");
    TCase *tc = tcase_create("checkpointing");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_full_flash_untied);
    tcase_add_test(tc, test_full_naive_tied);
    tcase_add_test(tc, test_selective_flash_tied);
    tcase_add_test(tc, test_selective_naive_untied);
    tcase_add_test(tc, test_bytes_per_block_matches_allocator);
    tcase_add_test(tc, test_bytes_per_block_from_shapes);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
