#include "reference_cpu/adamw.h"

#include <math.h>

void adamw_step(real *params, const real *grads, real *m, real *v, size_t n, long long step, double lr,
                const AdamWConfig *cfg) {
    real b1 = (real)cfg->beta1, b2 = (real)cfg->beta2, eps = (real)cfg->eps;
    real decay = (real)(1.0 - lr * cfg->weight_decay);
    real step_size = (real)(lr / (1.0 - pow(cfg->beta1, (double)step)));
    real bias2_sqrt = (real)sqrt(1.0 - pow(cfg->beta2, (double)step));
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real g = grads[i];
        params[i] *= decay;
        m[i] = b1 * m[i] + (1 - b1) * g;
        v[i] = b2 * v[i] + (1 - b2) * g * g;
        real denom = sqrt_r(v[i]) / bias2_sqrt + eps;
        params[i] -= step_size * (m[i] / denom);
    }
}

double sum_of_squares(const real *x, size_t n) {
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
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
