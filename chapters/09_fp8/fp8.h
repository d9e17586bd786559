// fp8.h: FP8 training (chapter 9). Scaling recipes, quantize / dequantize, and FP8 linears whose
// three GEMMs (forward Y = X W^T, dX = dY W, dW = dY^T X) run on FP8 operands, emulated on the CPU:
// each operand is quantized to FP8 and dequantized back, then the fp32 matmul of reference_cpu/ops.h
// multiplies them. The product of two FP8 values is exact in fp32, so this differs from a tensor-core
// FP8 GEMM only in the order and precision of the sums.
//
// A scale multiplies a tensor into the FP8 range before the cast: q = fp8(x * scale), and x ~ q /
// scale. Computed in double, stored as fp32. Each operand is scaled along the dimension its GEMM
// contracts (the rows of X and W for Y = X W^T, the columns of W and the rows of dY for dX = dY W,
// the columns of dY and X for dW = dY^T X), so every scale factors out of the GEMM's sums.
//
//   tensorwise  one scale per tensor, fp8_max / max(amax, 1e-12) (torchao's default). Inputs and
//               weights E4M3, output gradients E5M2.
//   rowwise     one scale per row along the contraction dimension, rounded down to a power of two
//               (an exact multiply); every operand E4M3 (torchao's rowwise).
//   delayed     one scale per tensor from the max of the last `amax_history` steps' amaxes and a
//               margin: fp8_max * 2^-margin / amax_ref, updated after each step (fp8_step_end);
//               the old scale stays if amax_ref is 0 or not finite (TransformerEngine's recipe).
//               A tensor with no history yet (the first step) is scaled as tensorwise.
//
// Ranks that hold pieces of the same tensor must use the same scale: every amax is MAX-reduced over
// the groups that split what it covers (Fp8Groups): tp for features, dp for tokens. Then a run on
// several ranks scales exactly as one process does.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "chapters/03_fsdp/fsdp.h"
#include "chapters/09_fp8/fp8_cast.h"
#include "common/comm.h"
#include "reference_cpu/model.h"

typedef enum { FP8_TENSORWISE, FP8_ROWWISE, FP8_DELAYED } Fp8Recipe;
#define FP8_RECIPE_NAMES "tensorwise|rowwise|delayed"  // in enum order (the trainer's --fp8-recipe)
#define FP8_AMAX_HISTORY_DEFAULT 1024
#define FP8_AMAX_EPS 1e-12  // the smallest amax a scale is computed from (an all-zero tensor)

// How many scales a (rows, cols) matrix gets: one, one per row (the amax over its columns), or one
// per column (the amax over its rows).
typedef enum { FP8_PER_TENSOR, FP8_PER_ROW, FP8_PER_COL } Fp8Granularity;

// ---- scales, quantize, dequantize (the building blocks) ---------------------------------------
// fp8_max / max(amax, FP8_AMAX_EPS) in double; pow2: rounded down to a power of two.
double fp8_scale_from_amax(double amax, Fp8Format f, bool pow2);
// Number of scales of a (rows, cols) matrix: 1, rows or cols.
int fp8_n_scales(int rows, int cols, Fp8Granularity g);
// amax (fp8_n_scales) = max |x| over what each scale covers (NaN propagates).
void fp8_amax(float *amax, const real *x, int rows, int cols, Fp8Granularity g);
// q (rows*cols) = fp8(x * scale), rounded to nearest even, saturating.
void fp8_quantize(uint8_t *q, const real *x, int rows, int cols, Fp8Granularity g, const float *scale, Fp8Format f);
// x (rows*cols) = q / scale.
void fp8_dequantize(real *x, const uint8_t *q, int rows, int cols, Fp8Granularity g, const float *scale,
                    Fp8Format f);
// out = dequantize(quantize(x)) in one pass (out may be x): the value an FP8 GEMM multiplies.
void fp8_fake_quantize(real *out, const real *x, int rows, int cols, Fp8Granularity g, const float *scale,
                       Fp8Format f);

// ---- FP8 linears -------------------------------------------------------------------------------
typedef struct {
    Fp8Recipe recipe;
    int amax_history;  // delayed: steps kept (>= 1)
    int margin;        // delayed: scale = fp8_max * 2^-margin / amax_ref
} Fp8Options;

// Groups an amax is MAX-reduced over (NULL or a group of one: nothing to reduce). tp: the ranks
// holding slices of a weight's features (tensor parallel); dp: the ranks holding other tokens of
// the batch (data parallel, FSDP, context parallel). Weights that are replicated or gathered in
// full see the same amax everywhere, so reducing them over dp changes nothing.
typedef struct {
    Comm *tp, *dp;
} Fp8Groups;

typedef struct Fp8 Fp8;

// n_layers: the model's blocks (delayed keeps state for each of their projections).
Fp8 *fp8_create(const Fp8Options *o, int n_layers, Fp8Groups groups);
void fp8_free(Fp8 *f);
// The hook that makes a Model run its projections through f (m->fp8 = &hook).
Fp8Hook fp8_hook(Fp8 *f);

// One linear y = x W^T of block `layer` (proj: which projection; its tensor-parallel split says
// which contraction dimension tp splits). Same shapes and accumulation as matmul_forward /
// matmul_backward: out (M,N) = x (M,K) W (N,K)^T;  dx (M,K) += dy W;  dw (N,K) += dy^T x, either NULL.
void fp8_linear_forward(Fp8 *f, int layer, Projection proj, real *out, const real *x, const real *w, int M, int K,
                        int N);
void fp8_linear_backward(Fp8 *f, int layer, Projection proj, real *dx, real *dw, const real *dy, const real *x,
                         const real *w, int M, int K, int N);

// After each optimizer step. Delayed: this step's amaxes (MAX-reduced over the groups, one call per
// group) join the history and give the next step's scales. Other recipes: nothing.
void fp8_step_end(Fp8 *f);

// Delayed scaling's state as fp32 values, for checkpoints: restoring it resumes bit-identically.
// (0 for the other recipes, which keep no state between steps.)
size_t fp8_state_numel(const Fp8 *f);
void fp8_state_get(const Fp8 *f, float *out);
void fp8_state_set(Fp8 *f, const float *in);
// The same with the slots of the blocks this rank has not run at 0 (a pipeline stage's share; every
// value is >= 0, so a MAX over the stages gives the whole state, each slot from the stage that
// updates it: a copy set by fp8_state_set is never updated where its block does not run).
void fp8_state_get_own(const Fp8 *f, float *out);
// A state as a file next to a checkpoint (safetensors: the state as one F32 tensor, the recipe's
// settings and the checkpoint's step as metadata, "fp8" and "step"). Load exits 2 with one line if
// the file is missing, corrupt or written with another --fp8-amax-history or number of blocks.
void fp8_state_save(const Fp8 *f, const float *state, long long step, const char *path);
void fp8_state_load(Fp8 *f, const char *path);
// The settings a saved state is recorded with (its metadata "fp8"), and a resume must match: for
// checking a state file before the Fp8 exists. dp: the data x context parallel degree.
void fp8_state_identity(const Fp8Options *o, int n_layers, int dp, char *out, size_t n);
// The scale delayed scaling will use next for block `layer`'s projection `proj`, operand `role`
// (0 input, 1 weight, 2 output gradient): for tests and logs. 0 until the first fp8_step_end.
float fp8_delayed_scale(const Fp8 *f, int layer, Projection proj, int role);

// ---- FP8 all-gather under ZeRO-3 (torchtitan's float8 all-gather) -----------------------------
// The codec (chapter 3's FsdpWeightCodec) that sends the seven projections' weights through stage
// 3's all-gather as E4M3 bytes instead of fp32: each projection gets one scale s, from the amax of its
// shards MAX-reduced over the shard group and tp, agreed after every weight update (prepare), so every
// rank casts its shard onto the same grid. The norms travel in fp32. Decoded, the gathered weights
// are exactly the values the FP8 GEMMs multiply: their amax is 448/s rounded to fp32, the tensorwise
// scale computed from it is s again (fp32 division rounds 448/(448/s) back to s: checked for every
// fp32 amax of a binade), and re-casting a value that is already on the grid returns its code. So a
// run gives bit-identical results with and without it; only the bytes on the wire change (a quarter
// for the projections). Tensorwise only: rowwise needs the weight scaled along K for the forward GEMM
// and along N for dX, two casts that one gathered copy cannot serve; delayed takes its scales from
// a history, not from the weights being sent.
FsdpWeightCodec fp8_all_gather_codec(Fp8 *f);

// Recipe by name (FP8_RECIPE_NAMES); -1 if unknown.
int fp8_recipe_parse(const char *name);
