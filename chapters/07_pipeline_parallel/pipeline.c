#include "chapters/07_pipeline_parallel/pipeline.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/trace.h"

enum { TAG_ACT = 0, TAG_GRAD = 1 };

// ---- layout ---------------------------------------------------------------------------------------

void pipeline_stage_layers(int n_layers, int n_stages, int stage, int *first, int *end) {
    int base = n_layers / n_stages, extra = n_layers % n_stages;
    *first = stage * base + (stage < extra ? stage : extra);
    *end = *first + base + (stage < extra);
}

const char *pipeline_check(const ModelConfig *cfg, int p, int v) {
    if (cfg->n_layers < p * v)
        return "every stage needs at least one transformer block (layers >= pp x virtual stages)";
    if (cfg->tied)
        return "tied embeddings are not supported: the head on the last stage would need the first stage's "
               "embedding table";
    return NULL;
}

// The stage's units and their range of the flat layout.
static void stage_range(const Model *model, int n_stages, int stage, PipelineChunk *c) {
    int L = model->cfg.n_layers;
    c->stage = stage;
    pipeline_stage_layers(L, n_stages, stage, &c->first_layer, &c->end_layer);
    c->first_unit = stage == 0 ? LAYER_EMBEDDING : c->first_layer;
    c->last_unit = stage == n_stages - 1 ? L : c->end_layer - 1;
    c->offset = model_unit_offset(model, c->first_unit);
    c->numel = model_unit_offset(model, c->last_unit) + model_unit_numel(model, c->last_unit) - c->offset;
}

static PipelineChunk *chunk_of_stage(Pipeline *pl, int stage) { return &pl->chunks[pp_chunk_of_stage(stage, pl->p)]; }

// ---- the stage compute of reference_cpu's model (pipeline_host_compute; ctx: the Model) -----------

static size_t host_boundary_count(void *ctx, int B, int T) {
    const Model *m = ctx;  // (B_micro*T, dim); with tensor + sequence parallelism, this tp rank's rows of it
    return (size_t)model_rows_here(m, B, T) * m->cfg.dim;
}
static void *host_acts_alloc(void *ctx, int B, int T, ActCheckpoint ac, int first, int end) {
    ModelActs *a = malloc(sizeof *a);
    *a = model_acts_alloc_stage(ctx, B, T, ac, first, end);
    return a;
}
static void host_acts_free(void *ctx, void *acts) {
    model_acts_free(acts);
    free(acts);
}
static void *host_stage_input(void *ctx, void *acts, int first) { return ((ModelActs *)acts)->blocks[first].x; }
static void *host_stage_output(void *ctx, void *acts, int end) { return ((ModelActs *)acts)->blocks[end].x; }
static void *host_dx(void *ctx, void *acts) { return ((ModelActs *)acts)->dx; }
static void host_embed_forward(void *ctx, void *acts, const int *inputs) { model_embed_forward(ctx, acts, inputs); }
static void host_blocks_forward(void *ctx, void *acts, int first, int end) {
    model_blocks_forward(ctx, acts, first, end);
}
static double host_head_forward(void *ctx, void *acts, const int *targets) {
    return model_head_forward(ctx, acts, targets);
}
static void host_head_backward(void *ctx, void *acts, double dloss) { model_head_backward(ctx, acts, dloss); }
static void host_blocks_backward(void *ctx, void *acts, int first, int end) {
    model_blocks_backward(ctx, acts, first, end);
}
static void host_embed_backward(void *ctx, void *acts, const int *inputs) { model_embed_backward(ctx, acts, inputs); }

const PipelineCompute pipeline_host_compute = {
    .name = "reference_cpu", .boundary_type = COMM_REAL, .boundary_count = host_boundary_count,
    .acts_alloc = host_acts_alloc, .acts_free = host_acts_free, .stage_input = host_stage_input,
    .stage_output = host_stage_output, .dx = host_dx, .embed_forward = host_embed_forward,
    .blocks_forward = host_blocks_forward, .head_forward = host_head_forward, .head_backward = host_head_backward,
    .blocks_backward = host_blocks_backward, .embed_backward = host_embed_backward};

// ---- UnitStorage: the model reads this rank's units from the chunk buffers ------------------------

static PipelineChunk *chunk_of_unit(Pipeline *pl, int unit) {
    for (int c = 0; c < pl->v; c++)
        if (unit >= pl->chunks[c].first_unit && unit <= pl->chunks[c].last_unit) return &pl->chunks[c];
    fatal("pipeline: unit %d is not on pp rank %d", unit, pl->rank);
}

static const real *storage_params(void *ctx, int unit, ModelPass pass) {
    Pipeline *pl = ctx;
    PipelineChunk *c = chunk_of_unit(pl, unit);
    return c->params + (model_unit_offset(pl->model, unit) - c->offset);
}

static real *storage_grads(void *ctx, int unit) {
    Pipeline *pl = ctx;
    PipelineChunk *c = chunk_of_unit(pl, unit);
    return c->grads + (model_unit_offset(pl->model, unit) - c->offset);
}

// ---- setup --------------------------------------------------------------------------------------

static int shard_ranks(const Pipeline *pl) { return pl->options.shard_group ? comm_size(pl->options.shard_group) : 1; }

// The chunk's weights, the same values the single process gives these elements, into params (host
// memory), or through a host copy uploaded to device memory.
static void fill_chunk_params(Pipeline *pl, PipelineChunk *c, const ParamSource *init) {
    const ParamTable *t = &pl->model->table;
    real *dst = pl->mem->on_device ? mem_alloc(MEM_OTHER, sizeof(real) * c->numel) : c->params;
    for (int i = 0; i < t->count; i++) {
        const ParamInfo *p = &t->items[i];
        if (p->layer >= c->first_unit && p->layer <= c->last_unit)
            param_source_fill(init, p, pl->model->tp.rank, pl->model->tp.size, 0, p->numel,
                                   dst + (p->offset - c->offset));
    }
    if (!pl->mem->on_device) return;
    pl->mem->upload(c->params, dst, sizeof(real) * c->numel);
    mem_free(dst);
}

static void init_chunk(Pipeline *pl, PipelineChunk *c, const ParamSource *init) {
    int N = shard_ranks(pl);
    c->shard = (c->numel + (size_t)N - 1) / (size_t)N;
    c->mine = pl->options.shard_group ? (size_t)comm_rank(pl->options.shard_group) * c->shard : 0;
    c->params = pl->mem->alloc(MEM_PARAMS, sizeof(real) * c->shard * N);
    c->grads = pl->mem->alloc(MEM_GRADS, sizeof(real) * c->shard * N);
    c->adam_m = pl->mem->alloc(MEM_OPTIMIZER, sizeof(real) * c->shard);
    c->adam_v = pl->mem->alloc(MEM_OPTIMIZER, sizeof(real) * c->shard);
    fill_chunk_params(pl, c, init);
    c->last_backward = -1;
    for (int i = 0; i < pl->actions.count; i++) {
        const PpAction *a = &pl->actions.items[i];
        if (a->kind == PP_BACKWARD && a->stage == c->stage) c->last_backward = i;
    }
}

// The layout and the schedule's figures, once (rank 0).
static void log_layout(const Pipeline *pl, const PpSchedule *s, const int *in_flight) {
    const ModelConfig *cfg = &pl->model->cfg;
    log_info("pp: %d ranks x %d virtual stage(s) = %d stages over %d blocks (the first %d stage(s) get one more)",
             pl->p, pl->v, pl->n_stages, cfg->n_layers, cfg->n_layers % pl->n_stages);
    for (int st = 0; st < pl->n_stages; st++) {
        PipelineChunk c;
        stage_range(pl->model, pl->n_stages, st, &c);
        log_info("pp: stage %d on rank %d: %sblocks [%d, %d)%s, %.3fM parameters", st, pp_rank_of_stage(st, pl->p),
                 st == 0 ? "embedding + " : "", c.first_layer, c.end_layer, st == pl->n_stages - 1 ? " + head" : "",
                 c.numel / 1e6);
    }
    char counts[256] = "";
    for (int r = 0, used = 0; r < pl->p && used < (int)sizeof counts; r++)
        used += snprintf(counts + used, sizeof counts - (size_t)used, "%s%d", r ? " " : "", in_flight[r]);
    log_info("pp: %s, %d micro-batches of %d sequence(s); lists valid (no deadlock); activations in flight per rank: "
             "%s; ideal bubble %.1f%% of the step ((p-1)/(v m + p-1) = %.1f%%)",
             pp_schedule_name(s->kind), pl->m, pl->options.micro_batch, counts, 100 * pp_bubble_fraction(s),
             100.0 * (pl->p - 1) / (pl->v * pl->m + pl->p - 1));
    const char *note = pp_schedule_note(s->kind, pl->v);
    if (note) log_info("pp: %s", note);
}

// Every rank builds every list (pure functions of p, m, v), checks them, keeps its own.
static void setup_schedule(Pipeline *pl) {
    PpSchedule s;
    const char *err = pp_schedule_build(pl->options.schedule, pl->p, pl->m, pl->v, &s);
    if (err) fatal_input("--pp-schedule %s: %s", pp_schedule_name(pl->options.schedule), err);
    int *in_flight = calloc((size_t)pl->p, sizeof(int));
    char problem[512];
    if (!pp_validate(&s, in_flight, problem, sizeof problem)) fatal("pipeline: invalid schedule: %s", problem);
    log_layout(pl, &s, in_flight);
    if (pl->options.dot_path && comm_rank(comm_world()) == 0) {
        pp_schedule_write_dot_file(&s, pl->options.dot_path);
        const char *path = pl->options.dot_path;
        log_info("pp: schedule written to %s (dot -Tsvg %s -o schedule.svg)", path, path);
    }
    pl->actions = s.ranks[pl->rank];
    s.ranks[pl->rank] = (PpActionList){0};
    pp_schedule_free(&s);
    free(in_flight);
}

Pipeline *pipeline_create(Model *model, Comm *pp, Comm *dp, const PipelineOptions *options, const ParamSource *init) {
    Pipeline *pl = calloc(1, sizeof *pl);
    pl->model = model, pl->pp = pp, pl->options = *options;
    pl->p = comm_size(pp), pl->rank = comm_rank(pp);
    pl->v = options->virtual_stages, pl->m = options->microbatches, pl->n_stages = pl->p * pl->v;
    pl->compute = options->compute ? options->compute : &pipeline_host_compute;
    pl->ctx = options->compute ? options->compute_ctx : model;
    pl->mem = options->memory ? options->memory : &fsdp_host_memory;
    if (pl->p < 2) fatal("pipeline_create: needs at least 2 pipeline ranks");  // p = 1 hands over in memory: not here
    const char *err = pipeline_check(&model->cfg, pl->p, pl->v);
    if (err) fatal_input("--pp %d x --pp-virtual-stages %d with %d layers: %s", pl->p, pl->v, model->cfg.n_layers, err);
    setup_schedule(pl);
    pl->chunks = calloc((size_t)pl->v, sizeof(PipelineChunk));
    for (int c = 0; c < pl->v; c++) {
        stage_range(model, pl->n_stages, pp_stage_of(pl->rank, c, pl->p), &pl->chunks[c]);
        init_chunk(pl, &pl->chunks[c], init);
    }
    model->storage = (UnitStorage){storage_params, NULL, storage_grads, pl};
    pl->slots = calloc((size_t)(pl->v * pl->m), sizeof(PipelineSlot));
    pl->batches = calloc((size_t)pl->actions.count + 1, sizeof(CommHandle *));
    pl->pending = calloc((size_t)pl->actions.count + 1, sizeof(CommP2P));
    if (dp && comm_size(dp) > 1) {
        DdpRange *ranges = calloc((size_t)pl->v, sizeof(DdpRange));
        for (int c = 0; c < pl->v; c++)
            ranges[c] = (DdpRange){pl->chunks[c].first_unit, pl->chunks[c].last_unit, pl->chunks[c].params,
                                   pl->chunks[c].grads};
        pl->ddp = ddp_create_ranges(model, dp, ranges, pl->v, options->bucket_bytes, options->overlap);
        ddp_broadcast_params(pl->ddp);  // replicas of a stage start equal, whatever each rank initialised
        free(ranges);
    }
    return pl;
}

void pipeline_free(Pipeline *pl) {
    if (!pl) return;
    ddp_free(pl->ddp);
    for (int c = 0; c < pl->v; c++) {
        PipelineChunk *ch = &pl->chunks[c];
        pl->mem->free(ch->params), pl->mem->free(ch->grads), pl->mem->free(ch->adam_m), pl->mem->free(ch->adam_v);
    }
    pl->model->storage = (UnitStorage){0};
    pp_action_list_free(&pl->actions);
    free(pl->chunks), free(pl->slots), free(pl->batches), free(pl->pending);
    free(pl);
}

// ---- the comm batches of a step -------------------------------------------------------------------

// Posts the transfers gathered since the last compute as one operation on the comm stream.
static void flush_batch(Pipeline *pl) {
    if (!pl->n_pending) return;
    pl->batches[++pl->n_batches] = comm_batch_start(pl->pp, pl->pending, pl->n_pending);
    pl->n_pending = 0;
}

static void wait_through(Pipeline *pl, int batch) {
    for (; pl->waited < batch; pl->waited++) comm_wait(pl->batches[pl->waited + 1]);
}

// The main thread blocks on the pipeline: a "pipeline-wait" slice when it really waits, which
// trace-summary counts as bubble.
static void wait_for_input(Pipeline *pl, int batch, const PpAction *a) {
    if (batch <= pl->waited) return;
    int track = trace_track("compute");
    bool blocked = !comm_test(pl->batches[batch]);
    if (blocked) {
        trace_begin(track, "pp wait", "pipeline-wait");  // trace-summary counts it as bubble
        trace_arg_int(track, "microbatch", a->microbatch);
        trace_arg_int(track, "stage", a->stage);
    }
    wait_through(pl, batch);
    if (blocked) trace_end(track);
}

static PipelineSlot *slot_of(Pipeline *pl, int mb, int stage) {
    return &pl->slots[pp_chunk_of_stage(stage, pl->p) * pl->m + mb];
}

// What one boundary transfer moves: boundary_count elements of compute->boundary_type (the host
// model: reals; the GPU model: its bf16 activations as bytes).
static size_t boundary_count(const Pipeline *pl) {
    return pl->compute->boundary_count(pl->ctx, pl->options.micro_batch, pl->options.seq_len);
}
static size_t boundary_bytes(const Pipeline *pl) { return comm_bytes(pl->compute->boundary_type, boundary_count(pl)); }

// Waits for the batches that finished anyway, and frees the activations nothing needs any more.
static void retire_slots(Pipeline *pl, bool wait_all) {
    if (wait_all) wait_through(pl, pl->n_batches);
    while (pl->waited < pl->n_batches && comm_test(pl->batches[pl->waited + 1])) wait_through(pl, pl->waited + 1);
    for (int i = 0; i < pl->v * pl->m; i++) {
        PipelineSlot *s = &pl->slots[i];
        if (s->live && s->backward_done && s->sends_left == 0 && s->send_batch <= pl->waited) {
            pl->compute->acts_free(pl->ctx, s->acts);
            memset(s, 0, sizeof *s);
        }
    }
}

static void add_transfer(Pipeline *pl, const PpAction *a) {
    PipelineSlot *s = slot_of(pl, a->microbatch, a->stage);
    int batch = pl->n_batches + 1;  // the batch being gathered
    CommP2P t = {a->kind == PP_SEND_ACT || a->kind == PP_SEND_GRAD ? COMM_SEND : COMM_RECV, NULL,
                 boundary_count(pl), pl->compute->boundary_type, a->peer,
                 a->kind == PP_SEND_ACT || a->kind == PP_RECV_ACT ? TAG_ACT : TAG_GRAD};
    const PipelineCompute *k = pl->compute;
    // LAB pp: the buffer of each transfer: a send of activations the stage's output (k->stage_output at the chunk's end_layer), a send of gradients the stage input's gradient (k->dx), a receive of activations a new inbox (pl->mem->alloc, MEM_COMM, boundary_bytes), a receive of gradients k->dx, where backward starts; then note the batch in the slot (send_batch and sends_left--, or recv_batch)
    switch (a->kind) {
    case PP_SEND_ACT: t.buf = k->stage_output(pl->ctx, s->acts, chunk_of_stage(pl, a->stage)->end_layer); break;
    case PP_SEND_GRAD: t.buf = k->dx(pl->ctx, s->acts); break;  // gradient of the stage input, after backward
    case PP_RECV_ACT:
        s->inbox = pl->mem->alloc(MEM_COMM, boundary_bytes(pl));
        t.buf = s->inbox;
        break;
    case PP_RECV_GRAD: t.buf = k->dx(pl->ctx, s->acts); break;  // where the stage's backward starts from
    default: fatal("pipeline: action %d is not a transfer", (int)a->kind);
    }
    if (t.kind == COMM_SEND) s->send_batch = batch, s->sends_left--;
    else s->recv_batch = batch;
    // END LAB
    pl->pending[pl->n_pending++] = t;
}

// ---- compute ------------------------------------------------------------------------------------

static void begin_compute_slice(const char *name, const PpAction *a, int p) {
    int track = trace_track("compute");
    trace_begin(track, name, "phase");
    trace_arg_int(track, "microbatch", a->microbatch);
    trace_arg_int(track, "stage", a->stage);
    trace_arg_int(track, "chunk", pp_chunk_of_stage(a->stage, p));
}

static void run_forward(Pipeline *pl, const PpAction *a) {
    PipelineChunk *c = chunk_of_stage(pl, a->stage);
    PipelineSlot *s = slot_of(pl, a->microbatch, a->stage);
    const int S = pl->n_stages, rows = pl->options.micro_batch * pl->options.seq_len;
    const int *inputs = pl->inputs + (size_t)a->microbatch * rows;
    const int *targets = pl->targets + (size_t)a->microbatch * rows;
    const PipelineCompute *k = pl->compute;
    if (a->stage > 0) wait_for_input(pl, s->recv_batch, a);
    s->acts = k->acts_alloc(pl->ctx, pl->options.micro_batch, pl->options.seq_len, pl->options.ac, c->first_layer,
                            c->end_layer);
    s->live = true;
    s->sends_left = (a->stage + 1 < S) + (a->stage > 0);  // its output, and later its input gradient
    begin_compute_slice("forward", a, pl->p);
    if (a->stage == 0) {
        k->embed_forward(pl->ctx, s->acts, inputs);
    } else {
        pl->mem->copy(k->stage_input(pl->ctx, s->acts, c->first_layer), s->inbox, boundary_bytes(pl));
        pl->mem->free(s->inbox);
        s->inbox = NULL;
    }
    k->blocks_forward(pl->ctx, s->acts, c->first_layer, c->end_layer);
    if (a->stage == S - 1) {
        // The micro-batch's loss on the host: on the GPU a wait for the stream per micro-batch on the
        // last stage (its forward is done by then; the backward queues after it).
        double loss = k->head_forward(pl->ctx, s->acts, targets);
        if (!isfinite(loss)) fatal("micro-batch %d: loss is %g; stopping (try a lower --lr)", a->microbatch, loss);
        pl->loss_sum += loss;
    }
    trace_end(trace_track("compute"));
}

static void run_backward(Pipeline *pl, const PpAction *a, int index) {
    PipelineChunk *c = chunk_of_stage(pl, a->stage);
    PipelineSlot *s = slot_of(pl, a->microbatch, a->stage);
    const int *inputs = pl->inputs + (size_t)a->microbatch * pl->options.micro_batch * pl->options.seq_len;
    if (a->stage + 1 < pl->n_stages) wait_for_input(pl, s->recv_batch, a);
    if (pl->ddp) ddp_begin_backward_range(pl->ddp, pp_chunk_of_stage(a->stage, pl->p), index == c->last_backward);
    begin_compute_slice("backward", a, pl->p);
    const PipelineCompute *k = pl->compute;
    if (a->stage == pl->n_stages - 1) k->head_backward(pl->ctx, s->acts, 1.0 / pl->m);  // mean over micro-batches
    k->blocks_backward(pl->ctx, s->acts, c->first_layer, c->end_layer);
    if (a->stage == 0) k->embed_backward(pl->ctx, s->acts, inputs);
    trace_end(trace_track("compute"));
    s->backward_done = true;
}

double pipeline_forward_backward(Pipeline *pl, const int *inputs, const int *targets) {
    pl->inputs = inputs, pl->targets = targets;
    pl->loss_sum = 0;
    pl->n_batches = pl->waited = 0;
    for (int c = 0; c < pl->v; c++) pl->mem->zero(pl->chunks[c].grads, sizeof(real) * pl->chunks[c].numel);
    for (int i = 0; i < pl->actions.count; i++) {
        const PpAction *a = &pl->actions.items[i];
        if (!pp_is_compute(a->kind)) {
            add_transfer(pl, a);
            continue;
        }
        flush_batch(pl);
        retire_slots(pl, false);
        if (a->kind == PP_FORWARD) run_forward(pl, a);
        else run_backward(pl, a, i);
    }
    flush_batch(pl);
    // The end of the step waits for the other stages to drain the pipeline: bubble, not comm.
    int track = trace_track("compute");
    trace_begin(track, "pp drain", "pipeline-wait");
    retire_slots(pl, true);
    trace_end(track);
    if (pl->ddp) ddp_finish_backward(pl->ddp);
    double loss = pl->loss_sum / pl->m;  // 0 on every stage but the last: the sum is that stage's value
    trace_begin(track, "pp drain", "pipeline-wait");
    comm_all_reduce(pl->pp, &loss, 1, COMM_FLOAT64, COMM_SUM);
    trace_end(track);
    return loss;
}

// ---- optimizer ----------------------------------------------------------------------------------

// With tensor parallelism a chunk holds tp slices: the sliced tensors' sums are added over tp, the
// replicated norms' taken once (as tp_sum_of_squares does for a whole model). The memory's own sum
// of squares where it has one (device buffers), else the host's.
static double chunk_sum_of_squares(const Pipeline *pl, const PipelineChunk *c) {
    double (*sum_sq)(const real *, size_t) = pl->mem->sum_of_squares ? pl->mem->sum_of_squares : sum_of_squares;
    if (!pl->options.tp_group) return sum_sq(c->grads, c->numel);
    double sums[2] = {0, 0};  // tp-sliced, replicated
    sum_of_squares_by_tp_split_with(&pl->model->table, c->grads, c->offset, c->numel, sums, sum_sq);
    comm_all_reduce(pl->options.tp_group, sums, 1, COMM_FLOAT64, COMM_SUM);
    return sums[0] + sums[1];
}

double pipeline_grad_norm(Pipeline *pl) {
    double sum = 0;
    for (int c = 0; c < pl->v; c++) sum += chunk_sum_of_squares(pl, &pl->chunks[c]);
    comm_all_reduce(pl->pp, &sum, 1, COMM_FLOAT64, COMM_SUM);
    return sqrt(sum);
}

void pipeline_clip(Pipeline *pl, double grad_norm, double max_norm) {
    double coef = clip_coefficient(grad_norm, max_norm);  // clip_by_global_norm's factor
    if (coef < 1)
        for (int c = 0; c < pl->v; c++) pl->mem->scale(pl->chunks[c].grads, pl->chunks[c].numel, coef);
}

// Elements of the chunk in this rank's optimizer slice (the last ranks' slices may be short or
// empty: the padding is never updated and stays zero).
static size_t slice_len(const PipelineChunk *c) { return zero_slice_len(c->numel, c->shard, c->mine); }

// ZeRO-1: every rank's updated slice into everyone's weights (in the chunks' memory).
static void gather_weights(Pipeline *pl, PipelineChunk *c) {
    real *staging = pl->mem->alloc(MEM_COMM, sizeof(real) * c->shard);
    comm_wait(zero_gather_slices_start(pl->options.shard_group, c->params, c->shard, staging, pl->mem));
    pl->mem->free(staging);
}

void pipeline_adamw_step(Pipeline *pl, long long step, double lr, const AdamWConfig *cfg) {
    for (int c = 0; c < pl->v; c++) {
        PipelineChunk *ch = &pl->chunks[c];
        pl->mem->adamw(ch->params + ch->mine, ch->grads + ch->mine, ch->adam_m, ch->adam_v, slice_len(ch), step, lr,
                       cfg);
        if (pl->options.shard_group) gather_weights(pl, ch);
    }
}

// ---- checkpoints --------------------------------------------------------------------------------

static real *state_of(PipelineChunk *c, StateKind kind) {
    real *const states[] = {[STATE_WEIGHTS] = c->params, [STATE_ADAM_M] = c->adam_m, [STATE_ADAM_V] = c->adam_v,
                            [STATE_GRADS] = c->grads};
    return states[kind];
}

static bool is_moment(StateKind kind) { return kind == STATE_ADAM_M || kind == STATE_ADAM_V; }

// A chunk's AdamW moment in full (numel), gathered over the shard group under ZeRO-1 into `all`
// (shard * N, in the chunks' memory); the chunk's own buffer otherwise.
static real *full_moment(Pipeline *pl, PipelineChunk *c, StateKind kind, real **all) {
    *all = NULL;
    if (!pl->options.shard_group) return state_of(c, kind);
    *all = pl->mem->alloc(MEM_COMM, sizeof(real) * c->shard * shard_ranks(pl));
    comm_all_gather(pl->options.shard_group, state_of(c, kind), *all, c->shard, COMM_REAL);
    return *all;
}

void pipeline_gather_full(Pipeline *pl, StateKind kind, real *flat) {
    int n = 0;
    real **full = calloc((size_t)pl->v, sizeof(real *)), **gathered = calloc((size_t)pl->v, sizeof(real *));
    real **host = calloc((size_t)pl->v, sizeof(real *));
    for (int c = 0; c < pl->v; c++) {  // per chunk: the full tensor to send, on the host
        PipelineChunk *ch = &pl->chunks[c];
        full[c] = is_moment(kind) ? full_moment(pl, ch, kind, &gathered[c]) : state_of(ch, kind);
        if (pl->mem->on_device) {
            host[c] = mem_alloc(MEM_COMM, sizeof(real) * ch->numel);
            pl->mem->download(host[c], full[c], sizeof(real) * ch->numel);
            full[c] = host[c];
        }
    }
    CommP2P *transfers = calloc((size_t)(pl->p * pl->v), sizeof(CommP2P));
    if (pl->rank == 0) {
        for (int st = 0; st < pl->n_stages; st++) {
            PipelineChunk range;
            stage_range(pl->model, pl->n_stages, st, &range);
            int r = pp_rank_of_stage(st, pl->p), chunk = pp_chunk_of_stage(st, pl->p);
            if (r == 0) memcpy(flat + range.offset, full[chunk], sizeof(real) * range.numel);
            else transfers[n++] = (CommP2P){COMM_RECV, flat + range.offset, range.numel, COMM_REAL, r, chunk};
        }
    } else {
        for (int c = 0; c < pl->v; c++) {
            PipelineChunk *ch = &pl->chunks[c];
            transfers[n++] = (CommP2P){COMM_SEND, full[c], ch->numel, COMM_REAL, 0, c};
        }
    }
    comm_wait(comm_batch_start(pl->pp, transfers, n));
    free(transfers);
    for (int c = 0; c < pl->v; c++) {
        if (gathered[c]) pl->mem->free(gathered[c]);
        mem_free(host[c]);
    }
    free(full), free(gathered), free(host);
}

void pipeline_load_full(Pipeline *pl, StateKind kind, const real *flat) {
    for (int c = 0; c < pl->v; c++) {
        PipelineChunk *ch = &pl->chunks[c];
        if (is_moment(kind)) {  // the moments: this rank's slice (all of it without ZeRO-1)
            pl->mem->zero(state_of(ch, kind), sizeof(real) * ch->shard);
            pl->mem->upload(state_of(ch, kind), flat + ch->offset + ch->mine, sizeof(real) * slice_len(ch));
        } else {
            pl->mem->upload(state_of(ch, kind), flat + ch->offset, sizeof(real) * ch->numel);
        }
    }
}
