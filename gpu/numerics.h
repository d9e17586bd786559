// numerics.h: the per-element arithmetic of the GPU kernels, written once for both compilers.
// nvcc compiles these into the kernels (__host__ __device__); the C compiler compiles the same
// text into tests/test_gpu_host.c, which checks it against reference_cpu on this machine, GPU or
// not. So what the host tests verify is the kernels' own arithmetic, not a copy of it.
//
//   bf16:      round-to-nearest-even conversion (common/bf16.h, shared with the host code)
//   SwiGLU:    silu and its derivative in the reference's order of operations
//   RoPE:      one pair rotation
//   AdamW:     the step's scalars (computed on the host, as reference_cpu/adamw.c does) and the
//              update of one element in the same formula order
//   attention: the online-softmax state of one query row (FlashAttention-2), and visibility;
//              ring attention's log-sum-exp merge of partial results
#pragma once
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "common/bf16.h"
#include "common/hd.h"
#include "reference_cpu/exp_f32.h"

// exp: the device's expf in the kernels; on the host (tests/test_gpu_host.c, the CPU emulator) the
// reference's own exp (reference_cpu/exp_f32.h), so that a host check of a formula compares the
// formula and not two exps a last bit apart (SwiGLU's derivative amplifies that bit near its zero).
GPU_HD float exp_kernel(float x) {
#ifdef __CUDA_ARCH__
    return expf(x);
#else
    return exp_f32(x);
#endif
}

// ---- SwiGLU: out = silu(gate) * up, silu(g) = g * sigmoid(g) -----------------------------------------
GPU_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_kernel(-x)); }
GPU_HD float swiglu_value(float gate, float up) { return gate * sigmoid_f32(gate) * up; }
// d/dgate and d/dup of dout * silu(gate) * up; silu'(g) = s(g) (1 + g (1 - s(g))).
GPU_HD void swiglu_grads(float dout, float gate, float up, float *dgate, float *dup) {
    float sg = sigmoid_f32(gate);
    *dgate = dout * up * sg * (1 + gate * (1 - sg));
    *dup = dout * gate * sg;
}

// ---- RoPE: rotate the pair (x0, x1) by the angle whose cosine and sine are c and s ----------------------
// Backward passes -s (the transpose of a rotation is its inverse).
GPU_HD void rope_rotate_pair(float *x0, float *x1, float c, float s) {
    float a = *x0, b = *x1;
    *x0 = a * c - b * s;
    *x1 = a * s + b * c;
}

// ---- AdamW ---------------------------------------------------------------------------------------------
// The scalars of one step, rounded to float exactly as reference_cpu/adamw.c rounds them.
typedef struct {
    float beta1, beta2, eps;
    float one_minus_beta1, one_minus_beta2;  // in double, then rounded (1 - (float)0.99999999 is 0)
    float decay;       // 1 - lr * weight_decay
    float step_size;   // lr / (1 - beta1^t)
    float bias2_sqrt;  // sqrt(1 - beta2^t)
} AdamWScalars;

static inline AdamWScalars adamw_scalars(long long step, double lr, double beta1, double beta2, double eps,
                                         double weight_decay) {
    AdamWScalars s;
    s.beta1 = (float)beta1;
    s.beta2 = (float)beta2;
    s.one_minus_beta1 = (float)(1.0 - beta1);
    s.one_minus_beta2 = (float)(1.0 - beta2);
    s.eps = (float)eps;
    s.decay = (float)(1.0 - lr * weight_decay);
    s.step_size = (float)(lr / (1.0 - pow(beta1, (double)step)));
    s.bias2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
    return s;
}

// One element: p *= decay; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= step_size * m / (sqrt(v) / bias2_sqrt + eps). The order of every operation is adamw.c's.
GPU_HD void adamw_update(float *param, float *m, float *v, float g, AdamWScalars s) {
    float m_new = fmaf(s.beta1, *m, s.one_minus_beta1 * g);  // explicit fmas, as adamw.c: the same bits
    float v_new = fmaf(s.beta2, *v, s.one_minus_beta2 * g * g);
    float denom = sqrtf(v_new) / s.bias2_sqrt + s.eps;
    *param = fmaf(-s.step_size, m_new / denom, *param * s.decay);
    *m = m_new;
    *v = v_new;
}

// ---- attention -----------------------------------------------------------------------------------------
// Causal visibility by positions, as reference_cpu: query at position qp sees key at kp iff kp <= qp.
GPU_HD bool attn_pos_visible(bool causal, int q_pos, int k_pos) { return !causal || k_pos <= q_pos; }

// The running state of one query row in FlashAttention-2's forward: m is the largest score seen,
// l the sum of exp(score - m) over the keys seen. Both start at (-inf, 0).
typedef struct {
    float m, l;
} OnlineSoftmax;

// Folds in a tile whose largest visible score is tile_max (-inf: the tile had no visible key).
// Returns the factor by which the row's output accumulator (a sum of exp(score - m) * v) must be
// multiplied so that it is relative to the new m; the caller then adds the tile's exp(s - m) v
// and passes the sum of the tile's exp(s - m) to online_softmax_add. While the row has seen no
// visible key, m stays -inf and nothing may be exponentiated against it: exp(-inf - -inf) is NaN.
GPU_HD float online_softmax_rescale(OnlineSoftmax *st, float tile_max) {
    float m_new = tile_max > st->m ? tile_max : st->m;
    if (m_new == -INFINITY) return 1.0f;            // still nothing visible: state unchanged
    float correction = exp_kernel(st->m - m_new);         // exp(-inf) = 0 on the first visible tile
    st->l *= correction;
    st->m = m_new;
    return correction;
}
// exp(score - m) for a score of the current tile (0 for a masked score, -inf).
GPU_HD float online_softmax_weight(const OnlineSoftmax *st, float score) {
    return score == -INFINITY ? 0.0f : exp_kernel(score - st->m);
}
// The tensor-core kernels' exp, whose weights are rounded to bf16 (2^-9 relative) before their
// product: 2^x as one instruction, ex2.approx.ftz (results below 2^-126 flushed to 0; its error, about
// 2 ulp, is far below that rounding), where __expf's non-ftz form spends five more instructions
// per call on the flushed range. 2^-inf = 0 exactly, so a masked score (-inf) needs no test.
// The kernels fold the scale and log2(e) into one fma: exp(s scale - m) = 2^(s scale log2e - m log2e)
// (exp2_arg). On the host, exp2f.
GPU_HD float exp2_fast(float x) {
#ifdef __CUDA_ARCH__
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}
#define LOG2E_F 1.4426950408889634f
// The fma's two constants for a row whose largest scaled score (or lse) is m: exp(s scale - m) =
// exp2_fast(fmaf(s, c.scale_log2, c.neg_m_log2)). m = -inf (the row has seen nothing visible) gives
// 0 for the offset, so that masked scores (-inf) still give 0 and never NaN.
typedef struct {
    float scale_log2, neg_m_log2;
} Exp2Arg;
GPU_HD Exp2Arg exp2_arg(float scale, float m) {
    Exp2Arg c;
    c.scale_log2 = scale * LOG2E_F;
    c.neg_m_log2 = m == -INFINITY ? 0.0f : -m * LOG2E_F;
    return c;
}
GPU_HD float exp2_weight(Exp2Arg c, float s) { return exp2_fast(fmaf(s, c.scale_log2, c.neg_m_log2)); }
// online_softmax_rescale with its factor exp(m_old - m_new) as one ex2 of (m_old - m_new) log2(e),
// the tensor-core forward's (attention_tc.cu): its probabilities are ex2s already, and expf took a
// dozen instructions per row and tile. m_old = -inf (the first visible tile) gives 2^-inf = 0.
GPU_HD float online_softmax_rescale_exp2(OnlineSoftmax *st, float tile_max) {
    float m_new = tile_max > st->m ? tile_max : st->m;
    if (m_new == -INFINITY) return 1.0f;  // still nothing visible: state unchanged
    float correction = exp2_fast((st->m - m_new) * LOG2E_F);
    st->l *= correction;
    st->m = m_new;
    return correction;
}
GPU_HD void online_softmax_add(OnlineSoftmax *st, float tile_weight_sum) { st->l += tile_weight_sum; }
// The row's log-sum-exp, and an element of its output from the accumulator: -inf and 0 when the
// row saw no key (as in reference_cpu, which ring attention relies on to merge such rows away).
GPU_HD float online_softmax_lse(const OnlineSoftmax *st) { return st->l > 0 ? st->m + logf(st->l) : -INFINITY; }
GPU_HD float online_softmax_output(const OnlineSoftmax *st, float acc) { return st->l > 0 ? acc / st->l : 0.0f; }

// Ring attention's merge (chapter 8's merge_row): a query row's running (o, lse) and one block's
// partial (o_b, lse_b) become o' = a o + b o_b, lse' = merged, with
//   merged = max + log1p(exp(min - max)),  a = exp(lse - merged),  b = exp(lse_b - merged).
// A -inf lse_b (the block had no key for this row) keeps the row (a = 1, b = 0); a -inf lse (no key
// yet) takes the block's (a = 0, b = 1): exact copies, as merge_row's early returns.
typedef struct {
    float merged, a, b;
} LseMerge;
GPU_HD LseMerge lse_merge(float lse, float lse_b) {
    LseMerge r = {lse, 1.0f, 0.0f};
    if (lse_b == -INFINITY) return r;
    if (lse == -INFINITY) {
        r.merged = lse_b, r.a = 0.0f, r.b = 1.0f;
        return r;
    }
    float hi = lse > lse_b ? lse : lse_b, lo = lse > lse_b ? lse_b : lse;
    r.merged = hi + log1pf(exp_kernel(lo - hi));
    r.a = exp_kernel(lse - r.merged), r.b = exp_kernel(lse_b - r.merged);
    return r;
}
