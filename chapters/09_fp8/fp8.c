#include "chapters/09_fp8/fp8.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/safetensors.h"

// ================================ scales, quantize, dequantize ===================================

double fp8_scale_from_amax(double amax, Fp8Format f, bool pow2) {
    // LAB fp8: the scale that maps amax to the format's max (amax floored at FP8_AMAX_EPS); with pow2, rounded down to a power of two
    double scale = fp8_format_info(f)->max / (amax > FP8_AMAX_EPS ? amax : FP8_AMAX_EPS);
    if (!pow2) return scale;
    int e;
    frexp(scale, &e);  // scale = m * 2^e, m in [0.5, 1): the power of two at or below it is 2^(e-1)
    return ldexp(1.0, e - 1);
    // END LAB
}

int fp8_n_scales(int rows, int cols, Fp8Granularity g) {
    return g == FP8_PER_TENSOR ? 1 : g == FP8_PER_ROW ? rows : cols;
}

// Which scale element (r, c) uses.
static inline int scale_index(int r, int c, Fp8Granularity g) {
    // LAB fp8: the index of the scale element (r, c) uses: one per tensor, one per row (FP8_PER_ROW) or one per column
    return g == FP8_PER_TENSOR ? 0 : g == FP8_PER_ROW ? r : c;
    // END LAB
}

static inline float max_abs(float m, real x) {
    float a = fabsf((float)x);
    return (a > m || isnan(a)) ? a : m;  // a NaN sticks: the scale must not hide it
}

static float row_amax(const real *row, int cols) {
    float m = 0;
    for (int c = 0; c < cols; c++) m = max_abs(m, row[c]);
    return m;
}

// Over the threads: a max is the same in any order (a NaN sticks whichever way), so the result does
// not depend on how the rows or columns are split.
void fp8_amax(float *amax, const real *x, int rows, int cols, Fp8Granularity g) {
    if (g == FP8_PER_ROW) {
#pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++) amax[r] = row_amax(x + (size_t)r * cols, cols);
    } else if (g == FP8_PER_COL) {
        const int block = 64;  // columns per task: each walks every row over its own columns
#pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < cols; c0 += block) {
            int c1 = c0 + block < cols ? c0 + block : cols;
            for (int c = c0; c < c1; c++) amax[c] = 0;
            for (int r = 0; r < rows; r++)
                for (int c = c0; c < c1; c++) amax[c] = max_abs(amax[c], x[(size_t)r * cols + c]);
        }
    } else {
        float m = 0;
#pragma omp parallel
        {
            float mine = 0;
#pragma omp for schedule(static) nowait
            for (int r = 0; r < rows; r++) mine = max_abs(mine, row_amax(x + (size_t)r * cols, cols));
#pragma omp critical
            m = max_abs(m, mine);
        }
        amax[0] = m;
    }
}

// Every code's value, per format: fp8_to_float's results, looked up in the inner loops.
static float decoded[2][256];
static bool decoded_ready;

static void build_decode_tables(void) {
    if (decoded_ready) return;
    for (int f = 0; f < 2; f++)
        for (int c = 0; c < 256; c++) decoded[f][c] = fp8_to_float((uint8_t)c, (Fp8Format)f);
    decoded_ready = true;
}

// One element: x * scale in fp32, then the saturating cast; and back, q / scale in fp32 (torchao's
// order, so the emulation matches its numbers).
static inline uint8_t quantize_one(real x, float scale, Fp8Format f) { return fp8_from_float((float)x * scale, f); }
static inline real dequantize_one(uint8_t q, float scale, Fp8Format f) { return (real)(decoded[f][q] / scale); }

void fp8_quantize(uint8_t *q, const real *x, int rows, int cols, Fp8Granularity g, const float *scale, Fp8Format f) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            q[i] = quantize_one(x[i], scale[scale_index(r, c, g)], f);
        }
}

void fp8_dequantize(real *x, const uint8_t *q, int rows, int cols, Fp8Granularity g, const float *scale,
                    Fp8Format f) {
    build_decode_tables();
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            x[i] = dequantize_one(q[i], scale[scale_index(r, c, g)], f);
        }
}

// The GEMM's operand: the cast and back (fp8_round_to_grid, the same bits as dequantize_one of
// quantize_one), then the division by the scale.
void fp8_fake_quantize(real *out, const real *x, int rows, int cols, Fp8Granularity g, const float *scale,
                       Fp8Format f) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            float s = scale[scale_index(r, c, g)];
            out[i] = (real)(fp8_round_to_grid((float)x[i] * s, f) / s);
        }
}

int fp8_recipe_parse(const char *name) {
    static const char *names[] = {"tensorwise", "rowwise", "delayed"};
    for (int i = 0; i < 3; i++)
        if (strcmp(name, names[i]) == 0) return i;
    return -1;
}

// ================================ the FP8 linear ================================================

// The operands' roles: delayed scaling keeps one history per role of each linear.
enum { ROLE_INPUT, ROLE_WEIGHT, ROLE_GRAD, N_ROLES };

struct Fp8 {
    Fp8Options o;
    Fp8Groups groups;
    int n_layers, n_slots;  // slots: n_layers * N_PROJ * N_ROLES tensors
    Fp8Hook hook;
    // delayed scaling: per slot the next step's scale, this step's amax so far (local), and the
    // last `amax_history` reduced amaxes (a ring; steps_recorded of them are filled)
    float *scale, *amax_now, *history;
    int steps_recorded, history_pos;
    bool *ran;  // (n_slots) the slots this rank has quantized an operand for (a pipeline stage: its blocks')
    // the two dequantized operands of the GEMM being emulated, and the amaxes and scales of both
    real *qa, *qb;
    size_t qa_cap, qb_cap;
    float *amax, *scales;
    size_t amax_cap, scales_cap;
    // the FP8 all-gather: each projection weight's agreed scale (n_layers * N_PROJ); NULL without it
    float *gathered_scale;
};

static void hook_forward(void *ctx, int layer, Projection p, real *out, const real *inp, const real *weight, int M,
                         int K, int N) {
    fp8_linear_forward(ctx, layer, p, out, inp, weight, M, K, N);
}

static void hook_backward(void *ctx, int layer, Projection p, real *dinp, real *dweight, const real *dout,
                          const real *inp, const real *weight, int M, int K, int N) {
    fp8_linear_backward(ctx, layer, p, dinp, dweight, dout, inp, weight, M, K, N);
}

Fp8 *fp8_create(const Fp8Options *o, int n_layers, Fp8Groups groups) {
    if (o->recipe == FP8_DELAYED && o->amax_history < 1)
        fatal_input("--fp8-amax-history %d: must be at least 1", o->amax_history);
    Fp8 *f = mem_alloc(MEM_OTHER, sizeof *f);
    memset(f, 0, sizeof *f);
    f->o = *o;
    f->groups = groups;
    f->n_layers = n_layers;
    f->n_slots = n_layers * N_PROJ * N_ROLES;
    if (o->recipe == FP8_DELAYED) {
        f->scale = mem_alloc(MEM_OTHER, sizeof(float) * f->n_slots);
        f->amax_now = mem_alloc(MEM_OTHER, sizeof(float) * f->n_slots);
        f->history = mem_alloc(MEM_OTHER, sizeof(float) * f->n_slots * o->amax_history);
        memset(f->scale, 0, sizeof(float) * f->n_slots);
        memset(f->amax_now, 0, sizeof(float) * f->n_slots);
        f->ran = mem_alloc(MEM_OTHER, sizeof(bool) * f->n_slots);
        memset(f->ran, 0, sizeof(bool) * f->n_slots);
    }
    f->hook = (Fp8Hook){hook_forward, hook_backward, f};
    return f;
}

void fp8_free(Fp8 *f) {
    if (!f) return;
    float *owned[] = {f->scale, f->amax_now, f->history, f->amax, f->scales, f->gathered_scale};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
    mem_free(f->ran);
    mem_free(f->qa);
    mem_free(f->qb);
    mem_free(f);
}

Fp8Hook fp8_hook(Fp8 *f) { return f->hook; }

// The GEMM's dequantized operands: scratch reused by every call, counted as "other" memory (not
// as activations, which the trainer's end-of-run line says every micro-batch has freed).
static void grow(real **buf, size_t *cap, size_t n) {
    if (n <= *cap) return;
    mem_free(*buf);
    *buf = mem_alloc(MEM_OTHER, sizeof(real) * n);
    *cap = n;
}

static void grow_f(float **buf, size_t *cap, size_t n) {
    if (n <= *cap) return;
    mem_free(*buf);
    *buf = mem_alloc(MEM_OTHER, sizeof(float) * n);
    *cap = n;
}

static bool group_real(Comm *c) { return c && comm_size(c) > 1; }

static void reduce_max(Comm *c, float *x, size_t n) {
    if (group_real(c) && n) comm_all_reduce(c, x, n, COMM_FLOAT32, COMM_MAX);
}

// One operand of a GEMM: a (rows, cols) matrix scaled per tensor or along the contraction dimension.
typedef struct {
    const real *x;
    int rows, cols;
    Fp8Granularity g;
    Fp8Format format;
    int slot;  // delayed scaling's slot
} Operand;

// The three GEMMs of a linear and the dimension each contracts: K (the features W's rows hold),
// N (the output features) and M (the tokens).
typedef enum { FP8_GEMM_FORWARD, FP8_GEMM_DGRAD, FP8_GEMM_WGRAD } Fp8Gemm;

// The group that splits a GEMM's contraction dimension (row-wise amaxes are reduced over it):
// under tensor parallelism the row-parallel wo and w2 split K, the column-parallel others split
// N; the tokens M are split over dp.
static Comm *contraction_group(const Fp8 *f, Fp8Gemm gemm, Projection p) {
    bool row_parallel = p == PROJ_WO || p == PROJ_W2;
    if (gemm == FP8_GEMM_WGRAD) return f->groups.dp;
    return (gemm == FP8_GEMM_FORWARD) == row_parallel ? f->groups.tp : NULL;
}

// Dynamic scales for both operands from their amaxes, reduced in one call per group: per tensor,
// over tp and dp (together they hold the whole tensor); per row or column, over the group that
// splits the contraction dimension (the other dimension is not reduced over: each rank keeps its
// own rows).
static void dynamic_scales(Fp8 *f, const Operand *a, const Operand *b, Comm *contraction, float *scale_a,
                           float *scale_b) {
    int na = fp8_n_scales(a->rows, a->cols, a->g), nb = fp8_n_scales(b->rows, b->cols, b->g);
    grow_f(&f->amax, &f->amax_cap, (size_t)(na + nb));
    fp8_amax(f->amax, a->x, a->rows, a->cols, a->g);
    fp8_amax(f->amax + na, b->x, b->rows, b->cols, b->g);
    if (a->g == FP8_PER_TENSOR) {
        reduce_max(f->groups.tp, f->amax, (size_t)(na + nb));
        reduce_max(f->groups.dp, f->amax, (size_t)(na + nb));
    } else {
        reduce_max(contraction, f->amax, (size_t)(na + nb));
    }
    bool pow2 = f->o.recipe == FP8_ROWWISE;
    for (int i = 0; i < na; i++) scale_a[i] = (float)fp8_scale_from_amax(f->amax[i], a->format, pow2);
    for (int i = 0; i < nb; i++) scale_b[i] = (float)fp8_scale_from_amax(f->amax[na + i], b->format, pow2);
}

// Delayed: the scales from the history (recording this step's amaxes for fp8_step_end). An operand
// whose history has no non-zero amax yet has no scale (0): before the first step_end, or when the
// tensor was all zeros so far (a projection initialised to zero, and the gradients flowing through
// it). It is scaled from its current amax, as dynamic scaling would (a scale of 0 would turn every
// value into 0 / 0). Every rank of the groups holds the same scales, so all take the same branch.
static void delayed_scales(Fp8 *f, const Operand *a, const Operand *b, float *scale_a, float *scale_b) {
    const Operand *ops[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        float amax;
        fp8_amax(&amax, ops[i]->x, ops[i]->rows, ops[i]->cols, FP8_PER_TENSOR);
        f->amax_now[ops[i]->slot] = max_abs(f->amax_now[ops[i]->slot], amax);
        f->ran[ops[i]->slot] = true;
    }
    *scale_a = f->scale[a->slot];
    *scale_b = f->scale[b->slot];
    if (*scale_a > 0 && *scale_b > 0) return;
    float dynamic_a, dynamic_b;
    dynamic_scales(f, a, b, NULL, &dynamic_a, &dynamic_b);
    if (!(*scale_a > 0)) *scale_a = dynamic_a;
    if (!(*scale_b > 0)) *scale_b = dynamic_b;
}

// out += or = op(a) op(b)^T-style product of the two fake-quantized operands, as `gemm` says.
static void emulated_gemm(Fp8 *f, Fp8Gemm gemm, Projection p, const Operand *a, const Operand *b, real *out, int M,
                          int K, int N) {
    int na = fp8_n_scales(a->rows, a->cols, a->g), nb = fp8_n_scales(b->rows, b->cols, b->g);
    grow_f(&f->scales, &f->scales_cap, (size_t)(na + nb));
    float *sa = f->scales, *sb = f->scales + na;
    if (f->o.recipe == FP8_DELAYED) delayed_scales(f, a, b, sa, sb);
    else dynamic_scales(f, a, b, contraction_group(f, gemm, p), sa, sb);
    grow(&f->qa, &f->qa_cap, (size_t)a->rows * a->cols);
    grow(&f->qb, &f->qb_cap, (size_t)b->rows * b->cols);
    fp8_fake_quantize(f->qa, a->x, a->rows, a->cols, a->g, sa, a->format);
    fp8_fake_quantize(f->qb, b->x, b->rows, b->cols, b->g, sb, b->format);
    if (gemm == FP8_GEMM_FORWARD) matmul_forward(out, f->qa, f->qb, M, K, N);         // x (M,K), w (N,K)
    else if (gemm == FP8_GEMM_DGRAD) matmul_backward(out, NULL, f->qa, NULL, f->qb, M, K, N);  // dy (M,N), w
    else matmul_backward(NULL, out, f->qa, f->qb, NULL, M, K, N);                  // dy (M,N), x (M,K)
}

static int slot_of(const Fp8 *f, int layer, Projection p, int role) {
    if (layer < 0 || layer >= f->n_layers) fatal("fp8: layer %d outside the %d blocks it was created for", layer, f->n_layers);
    return (layer * N_PROJ + (int)p) * N_ROLES + role;
}

// The format of an output gradient: E5M2's range, except rowwise, whose per-row scales already
// follow the range and use E4M3's extra mantissa bit.
static Fp8Format grad_format(const Fp8 *f) { return f->o.recipe == FP8_ROWWISE ? FP8_E4M3 : FP8_E5M2; }

// Per row or per column along the contraction dimension (rowwise), or per tensor.
static Fp8Granularity along(const Fp8 *f, Fp8Granularity rowwise) {
    return f->o.recipe == FP8_ROWWISE ? rowwise : FP8_PER_TENSOR;
}

void fp8_linear_forward(Fp8 *f, int layer, Projection proj, real *out, const real *x, const real *w, int M, int K,
                        int N) {
    // Y (M,N) = X (M,K) W (N,K)^T contracts K: the rows of X and of W
    Operand a = {x, M, K, along(f, FP8_PER_ROW), FP8_E4M3, slot_of(f, layer, proj, ROLE_INPUT)};
    Operand b = {w, N, K, along(f, FP8_PER_ROW), FP8_E4M3, slot_of(f, layer, proj, ROLE_WEIGHT)};
    emulated_gemm(f, FP8_GEMM_FORWARD, proj, &a, &b, out, M, K, N);
}

void fp8_linear_backward(Fp8 *f, int layer, Projection proj, real *dx, real *dw, const real *dy, const real *x,
                         const real *w, int M, int K, int N) {
    if (dx) {  // dX (M,K) += dY (M,N) W (N,K) contracts N: the rows of dY, the columns of W
        Operand a = {dy, M, N, along(f, FP8_PER_ROW), grad_format(f), slot_of(f, layer, proj, ROLE_GRAD)};
        Operand b = {w, N, K, along(f, FP8_PER_COL), FP8_E4M3, slot_of(f, layer, proj, ROLE_WEIGHT)};
        emulated_gemm(f, FP8_GEMM_DGRAD, proj, &a, &b, dx, M, K, N);
    }
    if (dw) {  // dW (N,K) += dY^T (N,M) X (M,K) contracts M: the columns of dY and of X
        Operand a = {dy, M, N, along(f, FP8_PER_COL), grad_format(f), slot_of(f, layer, proj, ROLE_GRAD)};
        Operand b = {x, M, K, along(f, FP8_PER_COL), FP8_E4M3, slot_of(f, layer, proj, ROLE_INPUT)};
        emulated_gemm(f, FP8_GEMM_WGRAD, proj, &a, &b, dw, M, K, N);
    }
}

// ================================ FP8 all-gather under ZeRO-3 ===================================

// Which projection a table entry is, or -1 (norms, embedding, head: they travel in fp32).
static int projection_of(const ParamInfo *p) {
    size_t len = strlen(p->name);
    for (int i = 0; i < N_PROJ; i++) {  // the name ends in ".<projection's name>"
        const char *suffix = projection_param_name((Projection)i);
        size_t n = strlen(suffix);
        if (len > n && p->name[len - n - 1] == '.' && strcmp(p->name + len - n, suffix) == 0) return i;
    }
    return -1;
}

// The part of tensor p inside unit-relative elements [lo, hi) of unit u: [*at, *at + *n), unit-relative.
static bool overlap(const ParamInfo *p, const FsdpUnit *u, size_t lo, size_t hi, size_t *at, size_t *n) {
    if (p->layer != u->unit) return false;
    size_t first = p->offset - u->offset, end = first + p->numel;
    *at = first > lo ? first : lo;
    size_t stop = end < hi ? end : hi;
    *n = stop > *at ? stop - *at : 0;
    return *n > 0;
}

// The elements rank r sends of unit u: [r*S, r*S + S) without the padding.
static void rank_range(const Fsdp *fs, const FsdpUnit *u, int r, size_t *lo, size_t *hi) {
    *lo = (size_t)r * u->shard;
    *hi = *lo + zero_slice_len(u->numel, u->shard, *lo);
}

static size_t wire_width(const ParamInfo *p) { return projection_of(p) >= 0 ? 1 : sizeof(real); }

static float gathered_scale_of(const Fp8 *f, const ParamInfo *p) {
    return f->gathered_scale[p->layer * N_PROJ + projection_of(p)];
}

static int as_int(size_t n) {
    if (n > INT32_MAX) fatal("fp8 all-gather: a piece of %zu elements is more than the casts take at once", n);
    return (int)n;
}

static void codec_prepare(void *ctx, const Fsdp *fs) {
    Fp8 *f = ctx;
    size_t n = (size_t)f->n_layers * N_PROJ;
    for (size_t i = 0; i < n; i++) f->gathered_scale[i] = 0;  // the amaxes first
    const ParamTable *table = &fs->model->table;
    int r = comm_rank(fs->shard_group);
    for (int k = 0; k < fs->n_units; k++) {
        const FsdpUnit *u = &fs->units[k];
        size_t lo, hi, at, len;
        rank_range(fs, u, r, &lo, &hi);
        for (int i = 0; i < table->count; i++) {
            const ParamInfo *p = &table->items[i];
            if (projection_of(p) < 0 || !overlap(p, u, lo, hi, &at, &len)) continue;
            float amax;
            fp8_amax(&amax, u->params_shard + (at - lo), 1, as_int(len), FP8_PER_TENSOR);
            float *slot = &f->gathered_scale[p->layer * N_PROJ + projection_of(p)];
            *slot = max_abs(*slot, amax);
        }
    }
    reduce_max(fs->shard_group, f->gathered_scale, n);
    reduce_max(fs->tp_group, f->gathered_scale, n);     // its other tp slices
    for (size_t i = 0; i < n; i++) f->gathered_scale[i] = (float)fp8_scale_from_amax(f->gathered_scale[i], FP8_E4M3, false);
}

// Bytes of rank r's piece: one per projection element, sizeof(real) per other element.
static size_t range_bytes(const Fsdp *fs, const FsdpUnit *u, int r) {
    const ParamTable *table = &fs->model->table;
    size_t lo, hi, at, len, bytes = 0;
    rank_range(fs, u, r, &lo, &hi);
    for (int i = 0; i < table->count; i++)
        if (overlap(&table->items[i], u, lo, hi, &at, &len)) bytes += len * wire_width(&table->items[i]);
    return bytes;
}

// The same on every rank: the largest rank's (the others are padded with zeros).
static size_t codec_shard_bytes(void *ctx, const Fsdp *fs, const FsdpUnit *u) {
    size_t most = 0;
    for (int r = 0; r < comm_size(fs->shard_group); r++) {
        size_t b = range_bytes(fs, u, r);
        if (b > most) most = b;
    }
    return most ? most : 1;
}

static void codec_encode(void *ctx, const Fsdp *fs, const FsdpUnit *u, unsigned char *out) {
    Fp8 *f = ctx;
    const ParamTable *table = &fs->model->table;
    size_t lo, hi, at, len;
    rank_range(fs, u, comm_rank(fs->shard_group), &lo, &hi);
    memset(out, 0, codec_shard_bytes(ctx, fs, u));
    for (int i = 0; i < table->count; i++) {
        const ParamInfo *p = &table->items[i];
        if (!overlap(p, u, lo, hi, &at, &len)) continue;
        const real *x = u->params_shard + (at - lo);
        if (projection_of(p) >= 0) {
            float scale = gathered_scale_of(f, p);
            fp8_quantize(out, x, 1, as_int(len), FP8_PER_TENSOR, &scale, FP8_E4M3);
        } else {
            memcpy(out, x, sizeof(real) * len);
        }
        out += len * wire_width(p);
    }
}

static void codec_decode(void *ctx, const Fsdp *fs, const FsdpUnit *u, const unsigned char *in, real *full) {
    Fp8 *f = ctx;
    const ParamTable *table = &fs->model->table;
    int N = comm_size(fs->shard_group);
    size_t bytes = codec_shard_bytes(ctx, fs, u);
    memset(full, 0, sizeof(real) * u->shard * (size_t)N);  // the padding
    for (int r = 0; r < N; r++) {
        const unsigned char *from = in + (size_t)r * bytes;
        size_t lo, hi, at, len;
        rank_range(fs, u, r, &lo, &hi);
        for (int i = 0; i < table->count; i++) {
            const ParamInfo *p = &table->items[i];
            if (!overlap(p, u, lo, hi, &at, &len)) continue;
            if (projection_of(p) >= 0) {
                float scale = gathered_scale_of(f, p);
                fp8_dequantize(full + at, from, 1, as_int(len), FP8_PER_TENSOR, &scale, FP8_E4M3);
            } else {
                memcpy(full + at, from, sizeof(real) * len);
            }
            from += len * wire_width(p);
        }
    }
}

FsdpWeightCodec fp8_all_gather_codec(Fp8 *f) {
    if (f->o.recipe != FP8_TENSORWISE) fatal("fp8_all_gather_codec: tensorwise scaling only");
    if (!f->gathered_scale) f->gathered_scale = mem_alloc(MEM_OTHER, sizeof(float) * (size_t)f->n_layers * N_PROJ);
    return (FsdpWeightCodec){codec_prepare, codec_shard_bytes, codec_encode, codec_decode, f, false};  // host buffers
}

// ================================ delayed scaling's history =====================================

static Fp8Format slot_format(const Fp8 *f, int slot) { return slot % N_ROLES == ROLE_GRAD ? grad_format(f) : FP8_E4M3; }

void fp8_step_end(Fp8 *f) {
    if (f->o.recipe != FP8_DELAYED) return;
    int L = f->o.amax_history;
    reduce_max(f->groups.tp, f->amax_now, (size_t)f->n_slots);
    reduce_max(f->groups.dp, f->amax_now, (size_t)f->n_slots);
    for (int s = 0; s < f->n_slots; s++) {
        f->history[(size_t)s * L + f->history_pos] = f->amax_now[s];
        int n = f->steps_recorded + 1 < L ? f->steps_recorded + 1 : L;
        float amax_ref = 0;
        for (int i = 0; i < n; i++) amax_ref = max_abs(amax_ref, f->history[(size_t)s * L + i]);
        // a tensor that was all zeros, or not finite, keeps the scale it had
        if (amax_ref > 0 && isfinite(amax_ref))
            f->scale[s] = (float)(fp8_scale_from_amax(amax_ref, slot_format(f, s), false) * ldexp(1.0, -f->o.margin));
        f->amax_now[s] = 0;
    }
    f->history_pos = (f->history_pos + 1) % L;
    if (f->steps_recorded < L) f->steps_recorded++;
}

float fp8_delayed_scale(const Fp8 *f, int layer, Projection proj, int role) {
    return f->scale ? f->scale[slot_of(f, layer, proj, role)] : 0;
}

// Layout: steps_recorded, history_pos, scale (n_slots), history (n_slots * amax_history). Small
// integers are exact in fp32.
size_t fp8_state_numel(const Fp8 *f) {
    if (f->o.recipe != FP8_DELAYED) return 0;
    return 2 + (size_t)f->n_slots * (1 + (size_t)f->o.amax_history);
}

void fp8_state_get(const Fp8 *f, float *out) {
    if (f->o.recipe != FP8_DELAYED) return;
    out[0] = (float)f->steps_recorded;
    out[1] = (float)f->history_pos;
    memcpy(out + 2, f->scale, sizeof(float) * f->n_slots);
    memcpy(out + 2 + f->n_slots, f->history, sizeof(float) * f->n_slots * f->o.amax_history);
}

void fp8_state_get_own(const Fp8 *f, float *out) {
    fp8_state_get(f, out);
    if (f->o.recipe != FP8_DELAYED) return;
    for (int s = 0; s < f->n_slots; s++) {
        if (f->ran[s]) continue;
        out[2 + s] = 0;
        memset(out + 2 + f->n_slots + (size_t)s * f->o.amax_history, 0, sizeof(float) * f->o.amax_history);
    }
}

void fp8_state_set(Fp8 *f, const float *in) {
    if (f->o.recipe != FP8_DELAYED) return;
    int L = f->o.amax_history;
    if (!(in[0] >= 0 && in[0] <= L && in[1] >= 0 && in[1] < L))
        fatal_input("fp8 state: %g steps at position %g do not fit an amax history of %d", in[0], in[1], L);
    f->steps_recorded = (int)in[0];
    f->history_pos = (int)in[1];
    memcpy(f->scale, in + 2, sizeof(float) * f->n_slots);
    memcpy(f->history, in + 2 + f->n_slots, sizeof(float) * f->n_slots * L);
    memset(f->amax_now, 0, sizeof(float) * f->n_slots);
}

// Metadata pins what the state's layout depends on: the history length and the slots.
// What a saved history is valid for. dp (the ranks splitting the batch's tokens, data and context
// parallel) is part of it: each rank's loss is a mean over its own tokens, so its output gradients,
// and their amaxes, are dp times the single process's. Training straight through any dp gives the
// same numbers (the scales differ by that power of two), but a history written under one dp makes
// scales off by the ratio under another, and the steps after a resume would differ.
void fp8_state_identity(const Fp8Options *o, int n_layers, int dp, char *out, size_t n) {
    snprintf(out, n, "amax_history=%d blocks=%d margin=%d dp=%d", o->amax_history, n_layers, o->margin, dp);
}

static void state_identity(const Fp8 *f, char *out, size_t n) {
    fp8_state_identity(&f->o, f->n_layers, f->groups.dp ? comm_size(f->groups.dp) : 1, out, n);
}

void fp8_state_save(const Fp8 *f, const float *state, long long step, const char *path) {
    size_t n = fp8_state_numel(f);
    char err[1024], identity[128], step_text[32];
    int64_t shape[1] = {(int64_t)n};
    state_identity(f, identity, sizeof identity);
    snprintf(step_text, sizeof step_text, "%lld", step);
    StWriter *w = st_writer_new();
    if (!st_writer_add(w, "fp8.delayed_state", ST_F32, 1, shape, state, err, sizeof err) ||
        !st_writer_add_metadata(w, "fp8", identity, err, sizeof err) ||
        !st_writer_add_metadata(w, "step", step_text, err, sizeof err) || !st_writer_add_data_hash(w, err, sizeof err) ||
        !st_write(w, path, err, sizeof err))
        fatal("fp8 state: %s", err);
    st_writer_free(w);
}

void fp8_state_load(Fp8 *f, const char *path) {
    char err[1024], identity[128];
    StFile *file = st_open(path, err, sizeof err);
    if (!file || !st_check_data_hash(file, err, sizeof err)) fatal_input("--resume with delayed FP8 scaling: %s", err);
    state_identity(f, identity, sizeof identity);
    const char *theirs = st_metadata(file, "fp8");
    if (!theirs || strcmp(theirs, identity) != 0)
        fatal_input("%s: FP8 state written with %s, this run has %s (delayed scaling resumes with the same history "
                    "length, blocks, and data x context parallel degree)", path, theirs ? theirs : "(none)", identity);
    size_t n = fp8_state_numel(f);
    float *state = mem_alloc(MEM_OTHER, sizeof(float) * n);
    int64_t shape[1] = {(int64_t)n};
    if (!st_read(file, "fp8.delayed_state", ST_F32, 1, shape, state, err, sizeof err)) fatal_input("--resume: %s", err);
    fp8_state_set(f, state);
    mem_free(state);
    st_close(file);
}
