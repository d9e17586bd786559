#include "chapters/03_fsdp/fsdp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"


static FsdpUnit *unit_of(Fsdp *f, int unit) { return &f->units[unit + 1]; }  // embedding (-1) is first
static int n_ranks(const Fsdp *f) { return comm_size(f->shard_group); }
static size_t padded(const FsdpUnit *u, const Fsdp *f) { return u->shard * (size_t)n_ranks(f); }
static real *alloc_real(const Fsdp *f, MemCategory category, size_t n) {
    return f->mem->alloc(category, sizeof(real) * n);
}

// ---- the memory the buffers live in ------------------------------------------------------------------
// The host's operations. Every buffer the module allocates goes through f->mem, so the same logic runs
// on the device's table (gpu/fsdp_device.c) with nothing else changed: comm.h takes both kinds of buffer.
static void host_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void host_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void host_add(real *acc, const real *x, size_t n) {
    for (size_t i = 0; i < n; i++) acc[i] += x[i];
}
// bf16 from `real`: in the float64 build through float first (two roundings; the all-gather is a
// float32 build's feature, the float64 build only keeps it compiling).
static void host_to_bf16(uint16_t *out, const real *x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = bf16_bits_from_f32((float)x[i]);
}
static void host_from_bf16(real *out, const uint16_t *in, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = f32_from_bf16_bits(in[i]);
}
const FsdpMemory fsdp_host_memory = {.name = "host", .on_device = false, .alloc = mem_alloc, .free = mem_free,
                                     .copy = host_copy, .zero = host_zero, .upload = host_copy,
                                     .download = host_copy, .add = host_add, .scale = scale_inplace,
                                     .adamw = adamw_step, .sum_of_squares = NULL, .to_bf16 = host_to_bf16,
                                     .from_bf16 = host_from_bf16};

// ---- the bf16 all-gather: a codec over the memory's own casts (fsdp.h) ------------------------------
static void bf16_prepare(void *ctx, const Fsdp *f) { (void)ctx, (void)f; }  // nothing to agree on
static size_t bf16_shard_bytes(void *ctx, const Fsdp *f, const FsdpUnit *u) {
    (void)ctx, (void)f;
    return sizeof(uint16_t) * u->shard;
}
static void bf16_encode(void *ctx, const Fsdp *f, const FsdpUnit *u, unsigned char *out) {
    (void)ctx;
    f->mem->to_bf16((uint16_t *)out, u->params_shard, u->shard);  // the padding is zero: 0x0000
}
static void bf16_decode(void *ctx, const Fsdp *f, const FsdpUnit *u, const unsigned char *in, real *full) {
    (void)ctx;
    f->mem->from_bf16(full, (const uint16_t *)in, u->shard * (size_t)comm_size(f->shard_group));
}
const FsdpWeightCodec fsdp_bf16_codec = {bf16_prepare, bf16_shard_bytes, bf16_encode, bf16_decode, NULL, true};

// A slice on the compute track for the time the main thread waits on the comm stream: this is the
// exposed communication trace-summary reports.
static void wait_exposed(CommHandle *h, const char *what, int unit) {
    if (!h) return;
    int track = trace_track("compute");
    trace_begin(track, what, "comm-wait");
    trace_arg_int(track, "unit", unit);
    comm_wait(h);
    trace_end(track);
}

// ---- weights: all-gather before use, free after (stage 3) ---------------------------------------
// Counts the transformer blocks in full (gathered or being gathered): the reshard policy and the
// prefetch bound them (the current block and the next), which fsdp_print_block_counts reports.
static void count_block_full(Fsdp *f, const FsdpUnit *u, int change) {
    if (u->unit < 0 || u->unit >= f->model->cfg.n_layers) return;  // the embedding and the head
    f->blocks_full += change;
    if (f->blocks_full > f->most_blocks_full) f->most_blocks_full = f->blocks_full;
}

// Without a codec the shards are gathered straight into the full buffer; with one, this rank's
// encoded shard is gathered into everyone's encoded bytes, decoded when the gather is awaited.
static void start_gather(Fsdp *f, FsdpUnit *u) {
    if (u->full) return;  // gathered already, or in flight
    u->full = alloc_real(f, MEM_PARAMS, padded(u, f));
    count_block_full(f, u, +1);
    const FsdpWeightCodec *codec = f->options.codec;
    if (!codec) {
        u->gather = comm_all_gather_start(f->shard_group, u->params_shard, u->full, u->shard, COMM_REAL);
        return;
    }
    size_t bytes = codec->shard_bytes(codec->ctx, f, u);
    u->wire_shard = f->mem->alloc(MEM_COMM, bytes);
    u->wire_full = f->mem->alloc(MEM_COMM, bytes * (size_t)n_ranks(f));
    codec->encode(codec->ctx, f, u, u->wire_shard);
    u->gather = comm_all_gather_start(f->shard_group, u->wire_shard, u->wire_full, bytes, COMM_BYTE);
}

static void free_wire(const Fsdp *f, FsdpUnit *u) {
    f->mem->free(u->wire_shard);
    f->mem->free(u->wire_full);
    u->wire_shard = u->wire_full = NULL;
}

// Waits for u's all-gather (the wait is exposed communication) and, with a codec, decodes it.
static void await_gather(Fsdp *f, FsdpUnit *u) {
    if (!u->gather) return;
    wait_exposed(u->gather, "fsdp all-gather wait", u->unit);
    u->gather = NULL;
    const FsdpWeightCodec *codec = f->options.codec;
    if (codec && u->wire_full) codec->decode(codec->ctx, f, u, u->wire_full, u->full);
    free_wire(f, u);
}

static void release_full(Fsdp *f, FsdpUnit *u) {
    if (u->full) count_block_full(f, u, -1);
    f->mem->free(u->full);
    u->full = NULL;
}

// A gather nobody will use (the end of backward, teardown): waited for and dropped with the weights.
static void drop_gather(Fsdp *f, FsdpUnit *u) {
    comm_wait(u->gather);
    u->gather = NULL;
    free_wire(f, u);
    release_full(f, u);
}

// The unit that runs after `idx` in this pass, whose all-gather can start now, or -1. Forward
// runs the units in index order, backward in reverse; `frontier` is the furthest unit launched in
// this pass, so a unit used twice (the tied embedding, again in the head) prefetches nothing.
// Backward needs no weights for the embedding (its gradient is a scatter-add): it stops at block 0.
static int next_to_prefetch(const Fsdp *f, int idx, ModelPass pass) {
    int next = pass == PASS_FORWARD ? idx + 1 : idx - 1;
    bool beyond = pass == PASS_FORWARD ? next > f->frontier : next < f->frontier;
    return beyond && next >= 1 - (pass == PASS_FORWARD) && next < f->n_units ? next : -1;
}

static const real *storage_params(void *ctx, int unit, ModelPass pass) {
    Fsdp *f = ctx;
    FsdpUnit *u = unit_of(f, unit);
    if (f->options.stage < 3) return u->full;
    // LAB fsdp: make sure u's all-gather is started (start_gather), wait for it (await_gather), then with options.prefetch start the next unit's (next_to_prefetch) and move f->frontier; return the gathered weights
    LAB_HOLE("fsdp", "make sure u's all-gather is started (start_gather), wait for it (await_gather), then with options.prefetch start the next unit's (next_to_prefetch) and move f->frontier; return the gathered weights");
    // END LAB
}

static void storage_params_done(void *ctx, int unit, ModelPass pass) {
    Fsdp *f = ctx;
    FsdpUnit *u = unit_of(f, unit);
    if (f->options.stage < 3) return;
    if (pass == PASS_FORWARD && !u->reshard_after_forward) return;  // backward uses it soon
    release_full(f, u);
}

// ---- gradients: reduce-scatter each unit as soon as its backward ends ----------------------------
static real *storage_grads(void *ctx, int unit) {
    Fsdp *f = ctx;
    FsdpUnit *u = unit_of(f, unit);
    if (!u->full_grads) u->full_grads = alloc_real(f, MEM_GRADS, padded(u, f));  // stages 2-3, zeroed
    return u->full_grads;
}

// Folds a finished reduction into the rank's gradient shard and frees what only the reduction
// needed. Stage 1 reduces once per step, so the shard is the result; stages 2-3 add micro-batches.
static void retire_reduce(Fsdp *f, FsdpUnit *u) {
    if (!u->reduce) return;
    wait_exposed(u->reduce, "fsdp reduce-scatter wait", u->unit);
    wait_exposed(u->replicate_reduce, "hsdp all-reduce wait", u->unit);
    u->reduce = u->replicate_reduce = NULL;
    if (f->options.stage == 1) {
        f->mem->copy(u->grads_shard, u->reduced, sizeof(real) * u->shard);
    } else {
        f->mem->add(u->grads_shard, u->reduced, u->shard);
        f->mem->free(u->full_grads);
        u->full_grads = NULL;
    }
    f->mem->free(u->reduced);
    u->reduced = NULL;
}

static void start_reduce(Fsdp *f, FsdpUnit *u) {
    // LAB fsdp: allocate u->reduced (S elements, MEM_COMM), reduce-scatter u->full_grads into it (average over the shard group); with HSDP queue an all-reduce (average) of it over the replicate group behind
    LAB_HOLE("fsdp", "allocate u->reduced (S elements, MEM_COMM), reduce-scatter u->full_grads into it (average over the shard group); with HSDP queue an all-reduce (average) of it over the replicate group behind");
    // END LAB
}

static bool reduce_finished(const FsdpUnit *u) {
    return comm_test(u->reduce) && (!u->replicate_reduce || comm_test(u->replicate_reduce));
}

// Stages 2-3 free a unit's full gradients as soon as its reduction is done, so only a few units'
// worth are alive at once: the finished ones are retired at each grads-ready, and at most
// MAX_REDUCES_IN_FLIGHT stay queued (the oldest is waited for, like FSDP's rate limiter).
#define MAX_REDUCES_IN_FLIGHT 2

static void retire_finished_reduces(Fsdp *f) {
    int in_flight = 0;
    for (int i = 0; i < f->n_units; i++) in_flight += f->units[i].reduce != NULL;
    for (int i = f->n_units - 1; i >= 0; i--) {  // backward launches the high indices first: oldest first
        FsdpUnit *u = &f->units[i];
        if (!u->reduce) continue;
        if (in_flight > MAX_REDUCES_IN_FLIGHT || reduce_finished(u)) {
            retire_reduce(f, u);
            in_flight--;
        }
    }
}

static void on_grads_ready(int unit, void *ctx) {
    Fsdp *f = ctx;
    if (f->options.stage == 1 && !f->sync) return;  // stage 1 accumulates full gradients locally
    start_reduce(f, unit_of(f, unit));
    if (f->options.stage > 1) retire_finished_reduces(f);
}

// ---- setup ----------------------------------------------------------------------------------------
// Writes the initial values of elements [first, first + count) of unit u's flat range into out.
static void init_unit_range(const Model *m, const FsdpUnit *u, const ParamSource *init, size_t first, size_t count,
                            real *out) {
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        if (p->layer != u->unit) continue;
        size_t p_first = p->offset - u->offset, p_end = p_first + p->numel;  // unit-relative
        size_t lo = p_first > first ? p_first : first, hi = p_end < first + count ? p_end : first + count;
        if (lo < hi) param_source_fill(init, p, m->tp.rank, m->tp.size, lo - p_first, hi - lo, out + (lo - first));
    }
}

// The same into f's memory: on the device, through a host buffer uploaded once.
static void init_unit_into(const Fsdp *f, const FsdpUnit *u, const ParamSource *init, size_t first, size_t count,
                           real *dst) {
    if (!f->mem->on_device) {
        init_unit_range(f->model, u, init, first, count, dst);
        return;
    }
    real *host = mem_alloc(MEM_OTHER, sizeof(real) * (count ? count : 1));
    init_unit_range(f->model, u, init, first, count, host);
    f->mem->upload(dst, host, sizeof(real) * count);
    mem_free(host);
}

static void prepare_codec(Fsdp *f) {
    if (f->options.codec) f->options.codec->prepare(f->options.codec->ctx, f);
}

static bool reshard_after_forward(const Fsdp *f, int unit) {
    int L = f->model->cfg.n_layers;
    switch (f->options.reshard) {
    case RESHARD_ALWAYS: return true;
    case RESHARD_NEVER: return false;
    default: return unit >= 0 && unit < L - 1;  // root units and the last block stay gathered
    }
}

Fsdp *fsdp_create(Model *model, Comm *shard_group, Comm *replicate_group, Comm *tp_group,
                  const FsdpOptions *options, const ParamSource *init) {
    if (model->params) fatal("fsdp_create: the model must come from model_init_unallocated");
    Fsdp *f = calloc(1, sizeof *f);
    f->model = model, f->shard_group = shard_group, f->replicate_group = replicate_group, f->tp_group = tp_group;
    f->options = *options;
    f->mem = options->memory ? options->memory : &fsdp_host_memory;
    if (f->mem->on_device && options->codec && !options->codec->any_memory)
        fatal("fsdp_create: %s buffers take no host-only weight codec", f->mem->name);
    int N = comm_size(shard_group), r = comm_rank(shard_group), L = model->cfg.n_layers;
    f->n_units = L + 2;
    f->units = calloc((size_t)f->n_units, sizeof(FsdpUnit));
    size_t max_shard = 0;
    for (int idx = 0; idx < f->n_units; idx++) {
        FsdpUnit *u = &f->units[idx];
        u->unit = idx - 1;
        u->offset = model_unit_offset(model, u->unit);
        u->numel = model_unit_numel(model, u->unit);
        u->shard = (u->numel + (size_t)N - 1) / (size_t)N;
        u->reshard_after_forward = reshard_after_forward(f, u->unit);
        u->adam_m = alloc_real(f, MEM_OPTIMIZER, u->shard);
        u->adam_v = alloc_real(f, MEM_OPTIMIZER, u->shard);
        size_t mine = (size_t)r * u->shard;  // first element of this rank's shard
        size_t owned = zero_slice_len(u->numel, u->shard, mine);
        if (options->stage < 3) {  // the full copy lives all step; the shard is a slice of it
            u->full = alloc_real(f, MEM_PARAMS, padded(u, f));
            init_unit_into(f, u, init, 0, u->numel, u->full);
            u->params_shard = u->full + mine;
        } else {
            u->params_shard = alloc_real(f, MEM_PARAMS, u->shard);
            init_unit_into(f, u, init, mine, owned, u->params_shard);
        }
        if (options->stage == 1) {
            u->full_grads = alloc_real(f, MEM_GRADS, padded(u, f));
            u->grads_shard = u->full_grads + mine;
        } else {
            u->grads_shard = alloc_real(f, MEM_GRADS, u->shard);
        }
        if (u->shard > max_shard) max_shard = u->shard;
    }
    if (options->stage < 3) f->staging = alloc_real(f, MEM_COMM, max_shard);
    if (options->codec && options->stage != 3) fatal("fsdp_create: a weight codec needs stage 3");
    prepare_codec(f);
    f->frontier = -1;
    model->storage = (UnitStorage){storage_params, storage_params_done, storage_grads, f};
    model->grads_ready = on_grads_ready;
    model->grads_ready_ctx = f;
    return f;
}

void fsdp_free(Fsdp *f) {
    if (!f) return;
    f->model->storage = (UnitStorage){0};
    f->model->grads_ready = NULL;
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        if (u->gather) drop_gather(f, u);
        retire_reduce(f, u);
        if (f->options.stage == 3) f->mem->free(u->params_shard);
        if (f->options.stage != 1) f->mem->free(u->grads_shard);
        real *owned[] = {u->adam_m, u->adam_v, u->full, u->full_grads};
        for (size_t k = 0; k < sizeof owned / sizeof owned[0]; k++) f->mem->free(owned[k]);
    }
    f->mem->free(f->staging);
    free(f->units);
    free(f);
}

// ---- the step ---------------------------------------------------------------------------------------
void fsdp_zero_grads(Fsdp *f) {
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        if (f->options.stage == 1) f->mem->zero(u->full_grads, sizeof(real) * padded(u, f));
        else f->mem->zero(u->grads_shard, sizeof(real) * u->shard);
    }
}

void fsdp_begin_backward(Fsdp *f, bool sync) {
    f->sync = sync;
    f->frontier = f->n_units;  // backward starts at the head
}

// Waits for the reductions, and reshards what is still gathered (stage 3: the untied embedding,
// which backward never asks for), so every micro-batch's forward starts from shards.
void fsdp_end_backward(Fsdp *f) {
    for (int i = f->n_units - 1; i >= 0; i--) retire_reduce(f, &f->units[i]);  // in launch order
    if (f->options.stage == 3) {
        if (f->blocks_full > f->most_blocks_left) f->most_blocks_left = f->blocks_full;  // a block kept too long
        for (int i = 0; i < f->n_units; i++) drop_gather(f, &f->units[i]);
    }
    f->frontier = -1;  // the next forward starts at the embedding
}

double fsdp_grad_norm(Fsdp *f) {
    double sums[2] = {0, 0};  // tp-sharded parameters, tp-replicated ones (the padding is zero: not counted)
    int r = comm_rank(f->shard_group);
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        size_t mine = (size_t)r * u->shard, owned = zero_slice_len(u->numel, u->shard, mine);
        if (f->mem->sum_of_squares && !f->tp_group) sums[0] += f->mem->sum_of_squares(u->grads_shard, owned);
        else if (f->mem->sum_of_squares)  // the memory's sum, parameter by parameter
            sum_of_squares_by_tp_split_with(&f->model->table, u->grads_shard, u->offset + mine, owned, sums,
                                            f->mem->sum_of_squares);
        else sum_of_squares_by_tp_split(&f->model->table, u->grads_shard, u->offset + mine, owned, sums);
    }
    comm_all_reduce(f->shard_group, sums, 2, COMM_FLOAT64, COMM_SUM);  // replicas hold equal shards
    if (f->tp_group) comm_all_reduce(f->tp_group, sums, 1, COMM_FLOAT64, COMM_SUM);  // replicated: same everywhere
    return sqrt(sums[0] + sums[1]);
}

void fsdp_clip(Fsdp *f, double grad_norm, double max_norm) {
    double coef = clip_coefficient(grad_norm, max_norm);  // clip_by_global_norm's factor
    if (coef >= 1) return;
    for (int i = 0; i < f->n_units; i++) f->mem->scale(f->units[i].grads_shard, f->units[i].shard, coef);
}

size_t zero_slice_len(size_t numel, size_t shard, size_t mine) {
    return mine >= numel ? 0 : (numel - mine < shard ? numel - mine : shard);
}

// The slice is copied by `copy` (memcpy on the host, gpu_copy on the device).
CommHandle *zero_gather_slices_start(Comm *group, real *full, size_t shard, real *staging, const FsdpMemory *mem) {
    mem = mem ? mem : &fsdp_host_memory;
    mem->copy(staging, full + (size_t)comm_rank(group) * shard, sizeof(real) * shard);
    return comm_all_gather_start(group, staging, full, shard, COMM_REAL);
}

// Stages 1-2: every rank's updated shard goes back into everyone's full copy.
static void gather_updated_weights(Fsdp *f) {
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        wait_exposed(zero_gather_slices_start(f->shard_group, u->full, u->shard, f->staging, f->mem),
                     "fsdp weight all-gather", u->unit);
    }
}

void fsdp_adamw_step(Fsdp *f, long long step, double lr, const AdamWConfig *cfg) {
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        f->mem->adamw(u->params_shard, u->grads_shard, u->adam_m, u->adam_v, u->shard, step, lr, cfg);
    }
    if (f->options.stage < 3) gather_updated_weights(f);
    prepare_codec(f);  // the weights changed
}

static real *shard_of(FsdpUnit *u, StateKind kind) {
    real *shards[] = {[STATE_WEIGHTS] = u->params_shard, [STATE_ADAM_M] = u->adam_m, [STATE_ADAM_V] = u->adam_v,
                      [STATE_GRADS] = u->grads_shard};
    return shards[kind];
}

void fsdp_gather_full(Fsdp *f, StateKind kind, real *flat) {
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        real *all = alloc_real(f, MEM_COMM, padded(u, f));
        comm_all_gather(f->shard_group, shard_of(u, kind), all, u->shard, COMM_REAL);
        f->mem->download(flat + u->offset, all, sizeof(real) * u->numel);
        f->mem->free(all);
    }
}

void fsdp_load_full(Fsdp *f, StateKind kind, const real *flat) {
    int r = comm_rank(f->shard_group);
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        real *dst = shard_of(u, kind);
        size_t mine = (size_t)r * u->shard;
        f->mem->zero(dst, sizeof(real) * u->shard);
        f->mem->upload(dst, flat + u->offset + mine, sizeof(real) * zero_slice_len(u->numel, u->shard, mine));
    }
    if (kind == STATE_WEIGHTS && f->options.stage < 3) gather_updated_weights(f);
    if (kind == STATE_WEIGHTS) prepare_codec(f);
}

// ---- memory model ----------------------------------------------------------------------------------
ZeroMemory zero_memory_model(int stage, double P, double N, double weight_bytes, double grad_bytes,
                             double optim_bytes) {
    return (ZeroMemory){.params = weight_bytes * P / (stage >= 3 ? N : 1),
                        .grads = grad_bytes * P / (stage >= 2 ? N : 1),
                        .optimizer = optim_bytes * P / (stage >= 1 ? N : 1)};
}

// Stage 3: how many blocks may be in full at once. Resharded after forward, a block is in full while
// it runs, and with prefetch so is the next one (the last block, kept from forward, is backward's
// first); never resharded, every block stays in full from its forward to its backward.
static int blocks_full_bound(const Fsdp *f) {
    int L = f->model->cfg.n_layers, bound = f->options.prefetch ? 2 : 1;
    if (f->options.reshard == RESHARD_NEVER) bound = L;
    return bound < L ? bound : L;
}

void fsdp_print_memory_estimate(const Fsdp *f) {
    double P = (double)f->model->table.total_numel, N = n_ranks(f), MiB = 1048576.0, b = sizeof(real);
    double biggest = 0;  // elements of the largest padded unit: the transient full buffers
    for (int i = 0; i < f->n_units; i++)
        if (f->units[i].shard * N > biggest) biggest = (double)f->units[i].shard * N;
    int stage = f->options.stage;
    ZeroMemory z = zero_memory_model(stage, P, N, b, b, 2 * b);
    log_info("zero-%d memory model: P = %.0f parameters, N = %d shards, b = %zu bytes; the largest unit in full "
             "is %.4f MiB (stages 2-3 hold a few of those at a time on top of the formula)",
             stage, P, (int)N, sizeof(real), b * biggest / MiB);
    MemCategory cats[3] = {MEM_PARAMS, MEM_GRADS, MEM_OPTIMIZER};
    const char *formula[3] = {stage < 3 ? "bP" : "bP/N", stage == 1 ? "bP" : "bP/N", "2bP/N"};
    double est[3] = {z.params, z.grads, z.optimizer};
    for (int c = 0; c < 3; c++)
        log_info("  %-10s %-6s = %9.4f MiB   measured peak %9.4f MiB", mem_category_name(cats[c]), formula[c],
                 est[c] / MiB, mem_peak(cats[c]) / MiB);
    fsdp_print_block_counts(f);
}

void fsdp_print_block_counts(const Fsdp *f) {
    if (f->options.stage != 3) return;
    log_info("  at most %d transformer block(s) were in full at once; the reshard policy and prefetch allow %d; "
             "%d left in full after a backward",
             f->most_blocks_full, blocks_full_bound(f), f->most_blocks_left);
}
