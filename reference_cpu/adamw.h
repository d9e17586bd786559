// adamw.h: the optimizer step, gradient clipping and the learning-rate schedule.
#pragma once
#include <stddef.h>

#include "reference_cpu/params.h"
#include "reference_cpu/real.h"

typedef struct {
    double beta1, beta2, eps, weight_decay;
} AdamWConfig;

// One AdamW step (Loshchilov & Hutter: decoupled weight decay), the same arithmetic as
// torch.optim.AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). step t counts from 1.
// Works on any slice of the flat buffers, so a sharded optimizer calls it on its shard.
void adamw_step(real *params, const real *grads, real *m, real *v, size_t n, long long step, double lr,
                const AdamWConfig *cfg);

double sum_of_squares(const real *x, size_t n);  // in double: fixed blocks, added in block order (adamw.c)
// The same over buf, which holds elements [first, first + count) of the table's flat layout, split
// parameter by parameter (table order): sums[0] += the tensor-parallel-split parameters' parts,
// sums[1] += the replicated ones'. With tensor parallelism only sums[0] is then summed over tp.
void sum_of_squares_by_tp_split(const ParamTable *t, const real *buf, size_t first, size_t count, double sums[2]);
// The same with each parameter's range summed by sum_sq (a device's sum of squares, for buffers in its memory).
void sum_of_squares_by_tp_split_with(const ParamTable *t, const real *buf, size_t first, size_t count, double sums[2],
                                     double (*sum_sq)(const real *x, size_t n));
void scale_inplace(real *x, size_t n, double factor);
// As torch.nn.utils.clip_grad_norm_: scales by max_norm / (norm + 1e-6) when that is < 1.
// Returns the norm before clipping. max_norm <= 0 disables clipping.
double clip_by_global_norm(real *grads, size_t n, double grad_norm, double max_norm);
// The factor it scales by: max_norm / (grad_norm + 1e-6) when that is < 1, else 1 (also for
// max_norm <= 0). Layouts that clip their own buffers (the GPU's) take it from here.
double clip_coefficient(double grad_norm, double max_norm);

typedef enum { DECAY_COSINE, DECAY_LINEAR, DECAY_CONSTANT } LrDecay;
#define LR_DECAY_NAMES "cosine|linear|constant"  // in enum order (the trainer's --lr-decay choices)
typedef struct {
    double peak_lr;
    double min_lr_ratio;  // the decay ends at peak_lr * min_lr_ratio
    long long warmup_steps, total_steps;
    LrDecay decay;
} LrSchedule;
// Step counts from 1. Warmup: peak * step / warmup (so step 1 is not 0). Then decay from peak
// to peak*min_lr_ratio at total_steps.
double lr_at(const LrSchedule *s, long long step);
