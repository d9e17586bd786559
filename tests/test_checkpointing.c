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

int main(void) {
    Suite *s = suite_create("activation checkpointing (fp32)");
    TCase *tc = tcase_create("checkpointing");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_full_flash_untied);
    tcase_add_test(tc, test_full_naive_tied);
    tcase_add_test(tc, test_selective_flash_tied);
    tcase_add_test(tc, test_selective_naive_untied);
    tcase_add_test(tc, test_bytes_per_block_matches_allocator);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
