#include "reference_cpu/adamw.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void adamw_step(real *params, const real *grads, real *m, real *v, size_t n, long long step, double lr,
                const AdamWConfig *cfg) {
    real b1 = (real)cfg->beta1, b2 = (real)cfg->beta2, eps = (real)cfg->eps;
    // 1 - beta in double, then rounded, as torch.optim.AdamW passes it: 1 - (float)0.99999999 is 0,
    // which would freeze v at 0 and turn the step into lr * m / eps.
    real one_minus_b1 = (real)(1.0 - cfg->beta1), one_minus_b2 = (real)(1.0 - cfg->beta2);
    real decay = (real)(1.0 - lr * cfg->weight_decay);
    real step_size = (real)(lr / (1.0 - pow(cfg->beta1, (double)step)));
    real bias2_sqrt = (real)sqrt(1.0 - pow(cfg->beta2, (double)step));
    // Every multiply-add is an explicit fma: left to the compiler, which products fuse into which
    // sums depends on the code around them (one build's bits would not be another's, nor the GPU's:
    // gpu/numerics.h's adamw_update has the same fmas).
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real g = grads[i];
        m[i] = fma_r(b1, m[i], one_minus_b1 * g);
        v[i] = fma_r(b2, v[i], one_minus_b2 * g * g);
        real denom = sqrt_r(v[i]) / bias2_sqrt + eps;
        params[i] = fma_r(-step_size, m[i] / denom, params[i] * decay);
    }
}

// Fixed blocks of SUM_SQ_BLOCK elements, each summed in the vector lanes' fixed order, then the
// blocks' sums added in block order: the blocks never depend on the thread count, so neither does
// the result. (One running sum in index order cannot vectorise: it was 2% of a step of `small`.)
#define SUM_SQ_BLOCK 8192
static double block_sum_of_squares(const real *x, size_t n) {
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (size_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    return sum;
}

double sum_of_squares(const real *x, size_t n) {
    size_t n_blocks = (n + SUM_SQ_BLOCK - 1) / SUM_SQ_BLOCK;
    if (n_blocks <= 1) return block_sum_of_squares(x, n);
    double *block_sums = malloc(sizeof(double) * n_blocks), sum = 0;
    if (!block_sums) {
        fprintf(stderr, "sum_of_squares: out of memory for %zu block sums\n", n_blocks);
        exit(1);
    }
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < n_blocks; b++) {
        size_t first = b * SUM_SQ_BLOCK, count = n - first < SUM_SQ_BLOCK ? n - first : SUM_SQ_BLOCK;
        block_sums[b] = block_sum_of_squares(x + first, count);
    }
    for (size_t b = 0; b < n_blocks; b++) sum += block_sums[b];
    free(block_sums);
    return sum;
}

void sum_of_squares_by_tp_split_with(const ParamTable *t, const real *buf, size_t first, size_t count, double sums[2],
                                     double (*sum_sq)(const real *x, size_t n)) {
    for (int i = 0; i < t->count; i++) {
        const ParamInfo *p = &t->items[i];
        size_t lo = p->offset > first ? p->offset : first;
        size_t hi = p->offset + p->numel < first + count ? p->offset + p->numel : first + count;
        if (lo >= hi) continue;
        sums[p->tp_split == TP_NONE] += sum_sq(buf + (lo - first), hi - lo);
    }
}

void sum_of_squares_by_tp_split(const ParamTable *t, const real *buf, size_t first, size_t count, double sums[2]) {
    sum_of_squares_by_tp_split_with(t, buf, first, count, sums, sum_of_squares);
}

void scale_inplace(real *x, size_t n, double factor) {
    real f = (real)factor;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= f;
}

double clip_coefficient(double grad_norm, double max_norm) {
    if (max_norm <= 0) return 1;
    double coef = max_norm / (grad_norm + 1e-6);
    return coef < 1 ? coef : 1;
}

double clip_by_global_norm(real *grads, size_t n, double grad_norm, double max_norm) {
    double coef = clip_coefficient(grad_norm, max_norm);
    if (coef < 1) scale_inplace(grads, n, coef);
    return grad_norm;
}

double lr_at(const LrSchedule *s, long long step) {
    if (s->warmup_steps > 0 && step <= s->warmup_steps) return s->peak_lr * (double)step / s->warmup_steps;
    double min_lr = s->peak_lr * s->min_lr_ratio;
    long long decay_steps = s->total_steps - s->warmup_steps;
    if (s->decay == DECAY_CONSTANT || decay_steps <= 0) return s->peak_lr;
    double progress = (double)(step - s->warmup_steps) / decay_steps;
    if (progress > 1) progress = 1;
    if (s->decay == DECAY_LINEAR) return s->peak_lr + (min_lr - s->peak_lr) * progress;
    return min_lr + (s->peak_lr - min_lr) * 0.5 * (1.0 + cos(M_PI * progress));
}
