#include "chapters/11_at_scale/plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/03_fsdp/fsdp.h"
#include "chapters/07_pipeline_parallel/pipeline.h"
#include "chapters/08_context_parallel/cp.h"
#include "common/log.h"
#include "common/trace.h"

// ---- the layout ----------------------------------------------------------------------------------
int plan_gpus(const PlanConfig *p) { return p->pp * p->dp_replicate * p->dp_shard * p->cp * p->tp; }

static int dp_size(const PlanConfig *p) { return p->dp_replicate * p->dp_shard; }
static int shard_size(const PlanConfig *p) { return p->dp_shard * p->cp; }  // FSDP shards over dp_shard x cp
static int n_stages(const PlanConfig *p) { return p->pp * p->virtual_stages; }
// Sequences in one micro-batch on one data-parallel rank.
static int micro_batch(const PlanConfig *p) { return p->batch / dp_size(p) / p->microbatches; }
static bool fsdp(const PlanConfig *p) { return p->dp_shard > 1 || p->cp > 1; }

// The trainer's refusals, from the chapters that own them (tp: the parameter table; cp: the zigzag
// split; pp: the stage split), so that the planner never proposes a layout `train` would refuse.
const char *plan_check(const PlanConfig *p) {
    const ModelConfig *c = &p->model;
    const char *rule = param_tp_rule(c, p->tp);
    if (rule) return rule;
    // 64-bit: a data-parallel size of up to PLAN_MAX_GPUS times the micro-batches passes 2^31.
    if (p->batch % ((long long)dp_size(p) * p->microbatches))
        return "--batch must be a multiple of dp-replicate x dp-shard x pp-microbatches";
    if (cp_layout_check(p->cp, p->seq_len, true))
        return "the sequence length (--seq-len, or the model's) must be a multiple of 2 x cp (zigzag chunks)";
    if (p->tp > 1 && (long long)micro_batch(p) * (p->seq_len / p->cp) % p->tp)
        return "the tokens of a micro-batch must divide over tp (sequence parallel)";
    if (p->pp > 1 && (rule = pipeline_check(c, p->pp, p->virtual_stages))) return rule;
    if (p->pp == 1 && p->schedule == PP_INTERLEAVED_1F1B && p->virtual_stages > 1)
        return "Interleaved1F1B needs --pp > 1";
    return pp_schedule_check(p->schedule, p->pp, p->microbatches, p->virtual_stages);
}

// ---- parameters per unit (one tp rank's slice) ----------------------------------------------------
static double block_params(const ModelConfig *c) {
    return ((double)model_param_count_non_embedding(c) - c->dim) / c->n_layers;
}
static double embedding_params(const ModelConfig *c) { return (double)c->vocab_size * c->dim; }
static double head_params(const ModelConfig *c) { return (c->tied ? 0 : embedding_params(c)) + c->dim; }

// The units of stage `stage`: its blocks, with the embedding on stage 0 and the head on the last.
typedef struct {
    int first, end;
    bool embed, head;
} StageLayout;

static StageLayout stage_layout(const PlanConfig *p, int stage) {
    StageLayout s;
    pipeline_stage_layers(p->model.n_layers, n_stages(p), stage, &s.first, &s.end);
    s.embed = stage == 0;
    s.head = stage == n_stages(p) - 1;
    return s;
}

// Parameters one tp rank holds for the stages of pipeline rank r.
static double rank_params(const PlanConfig *p, int r) {
    double n = 0;
    for (int chunk = 0; chunk < p->virtual_stages; chunk++) {
        StageLayout s = stage_layout(p, pp_stage_of(r, chunk, p->pp));
        n += (s.end - s.first) * block_params(&p->model) + (s.embed ? embedding_params(&p->model) : 0) +
             (s.head ? head_params(&p->model) : 0);
    }
    return n / p->tp;
}

// ---- collectives ------------------------------------------------------------------------------------
int plan_group_per_node(const Cluster *c, int n, int stride) {
    if (stride >= c->gpus_per_node) return 1;
    int g = c->gpus_per_node / stride;
    return g < n ? g : n;
}

// All-gather and reduce-scatter: NCCL runs them only as rings over all n ranks (seed 003), n - 1
// lock-step steps of bytes/n each. Inside a node every step crosses NVLink. Once the ring spans
// nodes every step waits for a network hop, and the network carries (n-1)/n of the buffer: NCCL
// runs one ring per NIC (channels), so the g ranks of the group in a node share the buffer over
// their g NICs (up to NVLink's own rate). The latency term (n - 1) alpha grows with the group:
// what makes large FSDP groups slow (seed 003).
double plan_all_gather_s(const Cluster *c, int n, int stride, double bytes) {
    if (n <= 1) return 0;
    int g = plan_group_per_node(c, n, stride);
    double lat = g == n ? c->nvlink_lat : c->net_lat, bw = g == n ? c->nvlink_bw : fmin(c->nvlink_bw, g * c->net_bw);
    return (n - 1) * lat + (double)(n - 1) / n * bytes / bw;
}

// All-reduce: hierarchical across nodes (NCCL's tree and ring variants reduce inside the node
// first): reduce-scatter over the node's g ranks (NVLink), all-reduce of each 1/g piece among the
// k nodes (one NIC per piece; a pipelined tree: 2 log2(k) network latencies, twice the piece
// over the NIC), all-gather inside the node.
double plan_all_reduce_s(const Cluster *c, int n, int stride, double bytes) {
    if (n <= 1) return 0;
    int g = plan_group_per_node(c, n, stride), k = (n + g - 1) / g;
    double intra = g > 1 ? 2 * ((g - 1) * c->nvlink_lat + (double)(g - 1) / g * bytes / c->nvlink_bw) : 0;
    if (k == 1) return intra;
    return intra + 2 * ceil(log2(k)) * c->net_lat + 2.0 * (k - 1) / k * (bytes / g) / c->net_bw;
}

static double p2p_s(const Cluster *c, bool same_node, double bytes) {
    return same_node ? c->nvlink_lat + bytes / c->nvlink_bw : c->net_lat + bytes / c->net_bw;
}

// Query (and attention output) elements of one micro-batch on one rank: b x s/cp x h_q/tp x head_dim.
// PyTorch's context parallel repeats K and V to the query heads, so each carries as many.
static double cp_query_elems(const PlanConfig *p) {
    const ModelConfig *m = &p->model;
    return (double)micro_batch(p) * p->seq_len / p->cp * m->n_heads * model_head_dim(m) / p->tp;
}

// ---- memory -------------------------------------------------------------------------------------------
// One tp rank's model (shapes only: no RoPE table, nothing allocated), sequence parallel when tp > 1
// as the trainer's --tp runs it.
static Model shape_model(const PlanConfig *p) {
    Model m;
    model_init_shapes(&m, &p->model, ATTN_FLASH, p->tp, 0);
    m.tp.sequence_parallel = p->tp > 1;
    return m;
}

double plan_acts_bytes(const Model *m, int B, int T, ActCheckpoint ac, int first, int end, int in_flight,
                       int elem_bytes) {
    const ModelConfig *c = &m->cfg;
    double per = 1.0 / sizeof(real);  // model_acts_bytes_per_block counts bytes of `real`
    double kept = model_acts_bytes_per_block(m, B, T, ac) * per, all = model_acts_bytes_per_block(m, B, T, AC_NONE) * per;
    double BT = (double)B * T, D = c->dim, R = model_rows_here(m, B, T), F = m->local.ffn_dim, V = m->local.vocab_size;
    double hq = (double)m->local.n_heads * model_head_dim(c), hkv = (double)m->local.n_kv_heads * model_head_dim(c);
    // Kept by every micro-batch in flight: its blocks' tensors and the stage's output or the head's.
    double boundary = end < c->n_layers ? R * D : R * D + BT * D + R + 2 * BT * V + 2 * BT;  // x_final xn rstd logits dlogits ce_stats
    double per_set = (end - first) * kept + boundary;
    // Shared by all: one block's dropped tensors for the recompute (+ its output under full), the
    // backward scratch (dx dx_next dh, dxn, dq dk dv dattn, dgate dup dact) and the SP buffers.
    double recompute = ac == AC_NONE ? 0 : all - kept + (ac == AC_FULL ? R * D : 0);
    double scratch = 3 * R * D + BT * D + 2 * BT * hq + 2 * BT * hkv + 3 * BT * F;
    if (m->tp.sequence_parallel) scratch += BT * D + R * D + D;
    return (in_flight * per_set + recompute + scratch) * elem_bytes;
}

double plan_ffn_hidden_bytes(const ModelConfig *c, int B, int T, int elem_bytes) {
    return (double)c->n_layers * B * T * c->ffn_dim * elem_bytes;
}

// Chapter 7's schedule for p's pipeline settings, and the micro-batches (x chunks) each rank holds
// at once (from its validator). The last one built is kept: --search asks for the same schedule
// again for each ZeRO stage and checkpointing policy it tries.
typedef struct {
    PpScheduleKind kind;
    int pp, m, v;
    bool built;
    PpSchedule s;
    int *in_flight;  // per rank
} PlanSchedule;

static PlanSchedule kept;  // the last schedule built

static void free_kept_schedule(void) {
    if (kept.built) pp_schedule_free(&kept.s), free(kept.in_flight);
    kept.built = false;
}

static const PlanSchedule *schedule_of(const PlanConfig *p) {
    static bool freed_at_exit;
    if (kept.built && kept.kind == p->schedule && kept.pp == p->pp && kept.m == p->microbatches &&
        kept.v == p->virtual_stages)
        return &kept;
    if (!freed_at_exit) atexit(free_kept_schedule), freed_at_exit = true;
    free_kept_schedule();
    const char *err = pp_schedule_build(p->schedule, p->pp, p->microbatches, p->virtual_stages, &kept.s);
    if (err) fatal_input("pipeline schedule: %s", err);
    kept.in_flight = calloc((size_t)p->pp, sizeof(int));
    char problem[256];
    if (!pp_validate(&kept.s, kept.in_flight, problem, sizeof problem)) fatal("invalid schedule: %s", problem);
    kept.kind = p->schedule, kept.pp = p->pp, kept.m = p->microbatches, kept.v = p->virtual_stages;
    kept.built = true;
    return &kept;
}

// Rank r's activations at their peak: its action list replayed, each FORWARD of a chunk adding
// that chunk's set (its blocks' kept tensors and its boundary or the head's logits), each BACKWARD
// freeing one; the largest total, plus the buffers shared by all sets once per rank (or, as the CPU
// trainer's pipeline allocates them, a whole ModelActs per micro-batch in flight: chapter 7). With
// one chunk a rank this is the in-flight count times the set; interleaved, the chunks' sets differ
// (the last stage's holds the logits) and the schedule does not hold as many of each.
static double rank_peak_activations(const PlanConfig *p, const Model *m, int r) {
    int B = micro_batch(p), T = p->seq_len / p->cp, v = p->virtual_stages;
    const PpActionList *list = &schedule_of(p)->s.ranks[r];
    double *set = calloc((size_t)v, sizeof *set), shared = 0, live = 0, peak = 0;
    if (!set) fatal("plan: out of memory");
    for (int chunk = 0; chunk < v; chunk++) {
        StageLayout s = stage_layout(p, pp_stage_of(r, chunk, p->pp));
        shared = plan_acts_bytes(m, B, T, p->ac, s.first, s.end, 0, p->act_bytes);  // the same for every chunk
        set[chunk] = plan_acts_bytes(m, B, T, p->ac, s.first, s.end, 1, p->act_bytes) - (p->acts_per_microbatch ? 0 : shared);
    }
    for (int i = 0; i < list->count; i++) {
        const PpAction *a = &list->items[i];
        if (a->kind == PP_FORWARD) live += set[pp_chunk_of_stage(a->stage, p->pp)];
        if (a->kind == PP_BACKWARD) live -= set[pp_chunk_of_stage(a->stage, p->pp)];
        peak = fmax(peak, live);
    }
    free(set);
    return peak + (p->acts_per_microbatch ? 0 : shared);
}

static PlanMemory rank_memory(const PlanConfig *p, const Model *m, int r, int in_flight) {
    PlanMemory mem = {.in_flight = in_flight, .pp_rank = r};
    double P = rank_params(p, r), N = shard_size(p);
    int stage = fsdp(p) ? p->zero_stage : 0;
    ZeroMemory z = zero_memory_model(stage, P, N, p->master_bytes, p->grad_bytes, p->optim_bytes);
    double biggest = fmax(block_params(&p->model), embedding_params(&p->model)) / p->tp;
    // The master copy: in mixed precision the fp32 master weights are the optimizer's, sharded with
    // its state from stage 1 (each rank updates its shard, then the compute-precision copy is
    // all-gathered: unit_costs' after_step); in fp32 they are the weights the model runs, sharded
    // only by ZeRO-3.
    double master = p->working_bytes && stage >= 1 ? p->master_bytes * P / N : z.params;
    // The compute-precision copy: all of it unless ZeRO-3 shards it; FSDP under a pipeline gathers
    // once per step and keeps it (every micro-batch needs it), otherwise two gathered units (the
    // current one and the prefetched one; in fp32 these are the only extra copy).
    double gathered_bytes = p->working_bytes ? p->working_bytes : p->master_bytes;
    if (stage == 3 && p->pp == 1) mem.weights = master + 2 * biggest * gathered_bytes;
    else mem.weights = master + p->working_bytes * P;
    // Under a pipeline, ZeRO-2/3 reduce once per step, after the last micro-batch (the simulation's
    // reduce_every; PyTorch's pipelining turns FSDP's gradient sync off for the others): until then
    // every micro-batch's gradients accumulate unsharded, in the gradient precision, beside the shards.
    mem.grads = z.grads + (stage >= 2 && p->pp > 1 ? p->grad_bytes * P : 0);
    mem.optimizer = z.optimizer;
    mem.activations = rank_peak_activations(p, m, r);
    // Collective buffers: reduce-scatter inputs of two units (FSDP) or two buckets of one unit
    // (DDP), in the gradient precision.
    if (p->dp_replicate * p->dp_shard * p->cp > 1) mem.comm = 2 * biggest * p->grad_bytes;
    // PyTorch's context parallel: one attention call's K and V gathered whole (cp ranks' shares).
    if (p->cp > 1 && p->cp_impl == CP_IMPL_TORCH_ALLGATHER) mem.comm += p->cp * 2 * cp_query_elems(p) * p->act_bytes;
    mem.total = mem.weights + mem.grads + mem.optimizer + mem.activations + mem.comm;
    return mem;
}

PlanMemory plan_memory(const PlanConfig *p) {
    const int *in_flight = schedule_of(p)->in_flight;
    Model m = shape_model(p);
    PlanMemory worst = {0};
    for (int r = 0; r < p->pp; r++) {
        PlanMemory mem = rank_memory(p, &m, r, in_flight[r]);
        if (r == 0 || mem.total > worst.total) worst = mem;
    }
    model_free(&m);
    return worst;
}

// ---- costs ----------------------------------------------------------------------------------------------
// Seconds for one unit on one micro-batch. The waits are communication the compute stream blocks on
// (tp collectives, the part of the cp ring attention does not hide), drawn on their comm track.
typedef struct {
    double fwd, bwd;             // compute (bwd includes the recompute --ac asks for)
    double fwd_wait, bwd_wait;   // blocking communication after the compute
    int wait_track;              // TRACK_TP or TRACK_CP
    double gather, reduce, replicate;  // FSDP all-gather, reduce-scatter; HSDP/DDP all-reduce
    double flops_fwd;            // model FLOPs of the forward (trace argument)
} UnitCost;

enum { TRACK_COMPUTE, TRACK_SHARD, TRACK_REPLICATE, TRACK_TP, TRACK_CP, TRACK_PP, TRACK_STEPS, N_TRACKS };

// The trainer's track of each (common/mesh.c's group names): FSDP's shard group dp_shard x cp;
// replicas all-reduce over dp_replicate under HSDP, over the whole dp group under DDP.
static const char *track_name(const PlanConfig *p, int track) {
    switch (track) {
    case TRACK_COMPUTE: return "compute";
    case TRACK_SHARD: return "comm:dp_shard_cp";
    case TRACK_REPLICATE: return fsdp(p) ? "comm:dp_replicate" : "comm:dp";
    case TRACK_TP: return "comm:tp";
    case TRACK_CP: return "comm:cp";
    case TRACK_PP: return "comm:pp";
    default: return "steps";
    }
}

// Element-wise traffic of one block's forward, in elements per token. Eager PyTorch runs each
// element-wise op as its own kernel, reading and writing HBM: RMSNorm as ~5 kernels (cast, square
// and mean, rsqrt, scale, weight) = 10 passes over h, twice; two residual adds (3h each); RoPE on
// q and k (cast, complex multiply, cast: 4 passes); SwiGLU's silu (2F) and product (3F).
// torch.compile fuses each group into one kernel that reads its inputs and writes its outputs once:
// norm + residual 3h twice, RoPE 2(hq + hkv), SwiGLU 3F.
// The two parts run on different shares under tensor parallelism with sequence parallelism: the
// norms and residual adds on the rank's tokens/tp rows of the whole h, RoPE and SwiGLU on every
// token of the rank's hq/tp, hkv/tp and F/tp features.
static double elementwise_h_per_token(const PlanConfig *p, double h) { return (p->compile ? 6 : 26) * h; }
static double elementwise_heads_ffn_per_token(const PlanConfig *p, double hq, double hkv, double F) {
    if (p->compile) return 2 * (hq + hkv) + 3 * F;
    return 4 * 2 * (hq + hkv) + 5 * F;
}

// Float8 (torchao) casts each matmul input to FP8 with a scale: read bf16, write 1 byte, once per
// linear input (q, k, v and w1, w3 each cast the same normed activations; wo, w2 their own).
// Compiled, the casts fuse into the producing kernel: only the 1-byte write remains. Under tensor
// parallelism the normed activations are cast on the rank's tokens/tp rows before the all-gather
// (5 h per token of those), the inputs of wo and w2 on every token of the rank's hq/tp and F/tp.
static double fp8_cast_bytes(const PlanConfig *p, double tokens, double h, double hq, double F) {
    double elems = tokens / p->tp * 5 * h + tokens * (hq + F) / p->tp;
    return elems * (p->compile ? 1.0 : 3.0);
}

CpCost plan_cp_costs(const PlanConfig *p, const Cluster *c, double t_attn) {
    CpCost k = {0};
    if (p->cp == 1) return k;
    const ModelConfig *m = &p->model;
    double b = micro_batch(p), Tl = (double)p->seq_len / p->cp, hd = model_head_dim(m);
    double hkv = m->n_kv_heads * hd, tp = p->tp, cp = p->cp, block_attn = t_attn / cp;
    bool local = p->cp * p->tp <= c->gpus_per_node;
    if (p->cp_impl == CP_IMPL_RING) {
        // cp - 1 hops of the rank's K and V (b, T/cp, hkv/tp); every hop but the first hides behind
        // the attention of the previous block. Backward passes K and V cp - 1 times and dK, dV cp
        // times (the last hop brings each rank its own gradients home): 2 cp - 1 hops (chapter 8's
        // count), behind twice the attention.
        double hop = p2p_s(c, local, 2 * b * Tl * hkv / tp * p->act_bytes);
        k.fwd_wait = fmax(0, (cp - 1) * hop - block_attn * (cp - 1));
        k.bwd_wait = fmax(0, (2 * cp - 1) * hop - 2 * block_attn * (cp - 1));
        return k;
    }
    // PyTorch's all-gather implementation: K and V repeated to the query heads (cp_query_elems).
    double q_elems = cp_query_elems(p);
    double gather = plan_all_gather_s(c, p->cp, p->tp, cp * 2 * q_elems * p->act_bytes);
    double dkv_send = p2p_s(c, local, 2 * q_elems * 4);
    bool overlap = !p->compile;
    k.fwd_wait = overlap ? fmax(0, gather - block_attn) : gather;
    k.bwd_wait = (overlap ? fmax(0, gather - 2 * block_attn) : gather) +
                 (overlap ? fmax(0, cp * dkv_send - 2 * block_attn * (cp - 1)) : cp * dkv_send);
    // Forward, each block after the first: its output read (bf16: 2 bytes an element), the fp32
    // running output read and written (8; the lse is head_dim times smaller). Backward, every
    // block: its dQ, dK, dV read and added to fp32 sums (read and written): 3 x (2 + 8) bytes.
    k.fwd_merge = (cp - 1) * q_elems * (p->act_bytes + 8) / c->hbm_bw;
    k.bwd_merge = cp * 3 * q_elems * (p->act_bytes + 8) / c->hbm_bw;
    return k;
}

typedef struct {
    UnitCost block, embed, head;
    double p2p_local, p2p_remote;  // one micro-batch's activations (or their gradient) to another pp rank,
                                   // in the node or across the network (pp_hop_local says which)
    int pp_stride, gpus_per_node;  // for pp_hop_local
    double optimizer;            // AdamW over the rank's shard
    double after_step;           // ZeRO-1/2: the all-gather of the updated weights
} Costs;

static Costs unit_costs(const PlanConfig *p, const Cluster *c) {
    const ModelConfig *m = &p->model;
    Costs k = {0};
    double b = micro_batch(p), T = p->seq_len, Tl = T / p->cp, tp = p->tp, h = m->dim, V = m->vocab_size;
    double hd = model_head_dim(m), hq = m->n_heads * hd, hkv = m->n_kv_heads * hd, F = m->ffn_dim;
    double tokens = b * Tl;  // tokens of a micro-batch on one rank (before the tp split)
    // Matmuls and attention of one block's forward on this rank's share (model_block_forward_flops
    // on the whole sequence: its attention term is 2 b hq T^2, the rest are matmuls).
    double full = model_block_forward_flops(m, (int)b, (int)T), attn_full = 2 * b * hq * T * T;
    double gemm = (full - attn_full) / p->cp / tp, attn = attn_full / p->cp / tp;
    double gemm_rate = p->fp8 ? c->peak_fp8 * c->fp8_gemm_eff : c->peak_bf16 * c->gemm_eff;
    double t_gemm = gemm / gemm_rate, t_attn = attn / (c->peak_bf16 * c->attn_eff);
    double ew_bytes = (tokens / tp * elementwise_h_per_token(p, h) +
                       tokens * elementwise_heads_ffn_per_token(p, hq / tp, hkv / tp, F / tp)) * p->act_bytes +
                      (p->fp8 ? fp8_cast_bytes(p, tokens, h, hq, F) : 0);
    double t_ew = ew_bytes / c->hbm_bw;
    CpCost cpc = plan_cp_costs(p, c, t_attn);
    double fwd = t_gemm + t_attn + t_ew + cpc.fwd_merge;
    // Full: the whole forward again. Selective: the element-wise ops, and the share of the matmuls
    // the policy does not keep (0 for this project's, which keeps every matmul output).
    double recompute = p->ac == AC_FULL ? fwd : p->ac == AC_SELECTIVE ? t_ew + p->sac_mm_share * t_gemm : 0;
    k.block.fwd = fwd;
    k.block.bwd = 2 * (fwd - cpc.fwd_merge) + cpc.bwd_merge + recompute;
    k.block.flops_fwd = gemm + attn;
    // Tensor parallel with sequence parallelism: per block forward two all-gathers and two
    // reduce-scatters of the (tokens, h) activations over tp (ranks adjacent, stride 1); backward
    // the same again, and full recompute repeats the forward's.
    double tp_one = plan_all_gather_s(c, p->tp, 1, tokens * h * p->act_bytes);
    double tp_fwd = 4 * tp_one, tp_bwd = 4 * tp_one + (p->ac == AC_FULL ? 4 * tp_one : 0);
    // AsyncTP splits each collective into pieces that overlap the matmul they feed; the share it
    // hides in practice is a profile parameter (copy engines and SMs are shared, pieces are small).
    if (p->async_tp) tp_fwd *= 1 - c->async_tp_hidden, tp_bwd *= 1 - c->async_tp_hidden;
    // Context parallel: full recompute runs the forward's transfers again.
    double cp_fwd = cpc.fwd_wait, cp_bwd = cpc.bwd_wait + (p->ac == AC_FULL ? cpc.fwd_wait : 0);
    k.block.fwd_wait = tp_fwd + cp_fwd;
    k.block.bwd_wait = tp_bwd + cp_bwd;
    k.block.wait_track = p->tp > 1 ? TRACK_TP : TRACK_CP;
    // Embedding: a gather of rows (bytes); head: the output matmul (vocab-parallel) and the loss,
    // whose element-wise passes read and write (tokens, V/tp) logits in fp32 a few times.
    k.embed.fwd = tokens * h * p->act_bytes / c->hbm_bw;
    k.embed.bwd = 2 * k.embed.fwd;
    double head_gemm = 2 * tokens * h * V / tp;
    double loss_bytes = tokens * V / tp * 4 * 4;
    k.head.fwd = head_gemm / gemm_rate + loss_bytes / c->hbm_bw;
    k.head.bwd = 2 * head_gemm / gemm_rate + loss_bytes / c->hbm_bw;
    k.head.flops_fwd = head_gemm;
    k.head.fwd_wait = k.head.bwd_wait = tp_one;
    k.head.wait_track = TRACK_TP;
    // Data parallel: units all-gathered in the compute precision, gradients reduced in theirs,
    // over the shard group (dp_shard x cp, stride tp) and the replicas (stride dp_shard x cp x tp).
    int N = shard_size(p), shard_stride = p->tp, rep_stride = N * p->tp;
    // What the all-gathers carry: the compute-precision copy, or the weights themselves when
    // there is only one copy (fp32 on the CPU).
    double gathered_bytes = p->working_bytes ? p->working_bytes : p->master_bytes;
    UnitCost *units[3] = {&k.block, &k.embed, &k.head};
    double params[3] = {block_params(m) / tp, embedding_params(m) / tp, head_params(m) / tp};
    for (int i = 0; i < 3; i++) {
        if (fsdp(p)) {
            if (p->zero_stage == 3) units[i]->gather = plan_all_gather_s(c, N, shard_stride, params[i] * gathered_bytes);
            units[i]->reduce = plan_all_gather_s(c, N, shard_stride, params[i] * p->grad_bytes);
            units[i]->replicate = plan_all_reduce_s(c, p->dp_replicate, rep_stride, params[i] / N * p->grad_bytes);
        } else {
            units[i]->replicate = plan_all_reduce_s(c, p->dp_replicate, rep_stride, params[i] * p->grad_bytes);
        }
    }
    // Pipeline: one micro-batch's (tokens/tp, h) boundary tensor; pp is the outermost dimension,
    // so neighbours are dp x cp x tp ranks apart.
    k.pp_stride = dp_size(p) * p->cp * p->tp, k.gpus_per_node = c->gpus_per_node;
    k.p2p_local = p->pp > 1 ? p2p_s(c, true, tokens / tp * h * p->act_bytes) : 0;
    k.p2p_remote = p->pp > 1 ? p2p_s(c, false, tokens / tp * h * p->act_bytes) : 0;
    // AdamW reads and writes the fp32 master weights, m and v, reads the gradient and writes the
    // working copy: ~ (2 x 4) x 3 + 4 + 2 bytes per parameter of the rank's shard.
    double shard = rank_params(p, 0) / (fsdp(p) ? N : 1);
    k.optimizer = shard * 30 / c->hbm_bw;
    if (fsdp(p) && p->zero_stage < 3) k.after_step = plan_all_gather_s(c, N, shard_stride, rank_params(p, 0) * gathered_bytes);
    return k;
}

// ---- the event simulation ---------------------------------------------------------------------------
typedef struct {
    int rank, track;
    double start, end;
    const char *name, *category;
    int microbatch, stage;
    double flops;
} SimSlice;

typedef struct {
    SimSlice *items;
    int count, capacity;
} SliceList;

static void record(SliceList *l, SimSlice s) {
    if (!l) return;
    if (l->count == l->capacity) {
        l->capacity = l->capacity ? 2 * l->capacity : 1024;
        l->items = realloc(l->items, sizeof(SimSlice) * (size_t)l->capacity);
        if (!l->items) fatal("out of memory recording the trace");
    }
    l->items[l->count++] = s;
}

// The per-chunk unit list of a stage, in forward order: embedding?, blocks, head?
typedef struct {
    const UnitCost *cost[512];
    int n;
} ChunkUnits;

typedef struct {
    double clock;                     // compute stream: when it is next free
    double shard_free, rep_free, pp_free;  // comm streams
    double busy, waited;              // compute time; compute time spent waiting on comm
    double idle;                      // compute time spent waiting for a pipeline neighbour
    double first_compute, last_compute;
    int next;                         // next action
    double *gathered;                 // per (chunk, unit): when its all-gather ends; -1 = not gathered
    int *last_backward;               // per chunk: the micro-batch of its last backward
} RankState;

typedef struct {
    double *times;
    int count, capacity, read;
} MessageQueue;

typedef struct {
    const PlanConfig *p;
    const Costs *k;
    ChunkUnits *chunks;               // per stage
    int max_units;
    bool reshard;                     // FSDP frees a unit after its forward (no pipeline)
    bool reduce_every;                // reduce every micro-batch's gradients (no pipeline)
    double *ready_act, *ready_grad;   // per (mb, stage): when the input / output gradient is here
    MessageQueue *queues;             // per (src, dst) rank pair
    SliceList *slices;
} Sim;

// The trainer's name for the wait at the end of backward: DDP's bucket all-reduces (chapter 2), or
// FSDP's reduce-scatters and, with replicas, HSDP's all-reduces (chapter 3), whichever ends last.
static const char *gradient_wait_name(const PlanConfig *p, const RankState *x) {
    if (!fsdp(p)) return "ddp wait";
    return x->rep_free > x->shard_free ? "hsdp all-reduce wait" : "fsdp reduce-scatter wait";
}

static void queue_push(MessageQueue *q, double t) {
    if (q->count == q->capacity) {
        q->capacity = q->capacity ? 2 * q->capacity : 64;
        q->times = realloc(q->times, sizeof(double) * (size_t)q->capacity);
        if (!q->times) fatal("out of memory");
    }
    q->times[q->count++] = t;
}

// Runs compute of `dur` starting no earlier than `ready`; the gap is a wait on communication
// when `comm_wait`, otherwise pipeline idle (bubble).
static double run_compute(Sim *sim, RankState *st, int rank, double ready, double dur, const char *name, int mb,
                          int stage, double flops, bool comm_wait) {
    double start = fmax(st->clock, ready);
    // A wait shows on the compute track as the trainer's do: for a collective ("comm-wait", exposed
    // communication) or for a pipeline neighbour ("pipeline-wait", bubble).
    if (start > st->clock)
        record(sim->slices, (SimSlice){rank, TRACK_COMPUTE, st->clock, start, comm_wait ? "fsdp all-gather wait" : "pp wait",
                                       comm_wait ? "comm-wait" : "pipeline-wait", mb, stage, 0});
    if (st->busy == 0) st->first_compute = start;
    if (comm_wait) st->waited += start - st->clock;  // the first unit's all-gather too
    else if (st->busy > 0) st->idle += start - st->clock;  // before the first compute: the bubble counts it
    st->clock = start + dur;
    st->busy += dur;
    st->last_compute = st->clock;
    record(sim->slices, (SimSlice){rank, TRACK_COMPUTE, start, st->clock, name, "phase", mb, stage, flops});
    return start;
}

// The trainer's names: tp's all-reduces and "tp wait" (chapter 6), the cp ring's batches of
// send/receive and "cp wait" (chapter 8).
static void blocking_wait(Sim *sim, RankState *st, int rank, double dur, int track, int mb) {
    if (dur <= 0) return;
    bool tp = track == TRACK_TP;
    record(sim->slices, (SimSlice){rank, track, st->clock, st->clock + dur, tp ? "all_reduce" : "batch", "comm", mb, -1, 0});
    record(sim->slices, (SimSlice){rank, TRACK_COMPUTE, st->clock, st->clock + dur, tp ? "tp wait" : "cp wait", "comm-wait",
                                   mb, -1, 0});
    st->clock += dur;
    st->waited += dur;
}

// Issues a comm op of `dur` on a stream no earlier than `at`; returns its end.
static double issue(Sim *sim, double *stream, int rank, int track, double at, double dur, const char *name) {
    double start = fmax(*stream, at);
    *stream = start + dur;
    if (dur > 0) record(sim->slices, (SimSlice){rank, track, start, *stream, name, "comm", -1, -1, 0});
    return *stream;
}

static const char *unit_name(const Sim *sim, const UnitCost *u, bool fwd) {
    if (u == &sim->k->embed) return fwd ? "embedding fwd" : "embedding bwd";
    if (u == &sim->k->head) return fwd ? "head fwd" : "head bwd";
    return fwd ? "block fwd" : "block bwd";
}

// One forward or backward of stage `stage` on micro-batch mb: its units in order (reverse for
// backward), each all-gathered first when sharded (the next one prefetched while it computes),
// its gradients reduce-scattered after its backward.
static void run_stage(Sim *sim, RankState *st, int rank, int mb, int stage, bool fwd, double input_ready) {
    const PlanConfig *p = sim->p;
    int chunk = pp_chunk_of_stage(stage, p->pp);
    const ChunkUnits *cu = &sim->chunks[stage];
    double *gathered = st->gathered + (size_t)chunk * sim->max_units;
    bool sync = sim->reduce_every || st->last_backward[chunk] == mb;
    for (int i = 0; i < cu->n; i++) {
        int u = fwd ? i : cu->n - 1 - i, next = fwd ? u + 1 : u - 1;
        const UnitCost *c = cu->cost[u];
        if (c->gather > 0 && gathered[u] < 0)
            gathered[u] = issue(sim, &st->shard_free, rank, TRACK_SHARD, st->clock, c->gather, "all_gather");
        double ready = fmax(gathered[u] < 0 ? 0 : gathered[u], i == 0 ? input_ready : 0);
        // The wait for the all-gather is communication; for the input, pipeline idle.
        bool comm = gathered[u] >= 0 && gathered[u] >= input_ready;
        double start = run_compute(sim, st, rank, ready, fwd ? c->fwd : c->bwd, unit_name(sim, c, fwd), mb, stage,
                                   fwd ? c->flops_fwd : 2 * c->flops_fwd, comm || i > 0);
        if (next >= 0 && next < cu->n && cu->cost[next]->gather > 0 && gathered[next] < 0)  // prefetch depth 1
            gathered[next] = issue(sim, &st->shard_free, rank, TRACK_SHARD, start, cu->cost[next]->gather, "all_gather");
        blocking_wait(sim, st, rank, fwd ? c->fwd_wait : c->bwd_wait, c->wait_track, mb);
        // Forward: FSDP frees the gathered unit (not the last, which backward needs first).
        if (fwd && sim->reshard && u != cu->n - 1) gathered[u] = -1;
        if (!fwd && sim->reshard) gathered[u] = -1;
        if (!fwd && sync) {
            double done = st->clock;
            if (c->reduce > 0) done = issue(sim, &st->shard_free, rank, TRACK_SHARD, done, c->reduce, "reduce_scatter");
            if (c->replicate > 0) issue(sim, &st->rep_free, rank, TRACK_REPLICATE, done, c->replicate, "all_reduce");
        }
    }
}

// Whether pipeline ranks a and b exchange within nodes: every GPU of pp rank a (GPUs a x stride up
// to the next pp rank's) sits in the node of its counterpart in b (pp is the outermost dimension;
// the interleaved schedule's hop from the last rank back to the first is one of them). That holds
// exactly when both ranks' GPUs lie in one node, the same: a rank spanning nodes has a GPU whose
// counterpart, (b - a) x stride >= one node further on, is in another node.
static bool pp_hop_local(const Costs *k, int a, int b) {
    long long g = k->gpus_per_node, s = k->pp_stride;
    long long node_a = a * s / g, node_b = b * s / g;
    return node_a == node_b && node_a == (a * s + s - 1) / g && node_b == (b * s + s - 1) / g;
}

// Advances rank r through its list until it finishes or needs a message not yet sent. Returns true
// if it moved.
static bool advance(Sim *sim, RankState *st, int r, const PpActionList *list) {
    const PlanConfig *p = sim->p;
    int S = n_stages(p), start = st->next;
    while (st->next < list->count) {
        const PpAction *a = &list->items[st->next];
        size_t key = (size_t)a->microbatch * S + a->stage;
        switch (a->kind) {
        case PP_FORWARD:
            run_stage(sim, st, r, a->microbatch, a->stage, true, sim->ready_act[key]);
            if (a->stage + 1 < S && pp_rank_of_stage(a->stage + 1, p->pp) == r)
                sim->ready_act[key + 1] = st->clock;
            break;
        case PP_BACKWARD:
            run_stage(sim, st, r, a->microbatch, a->stage, false, sim->ready_grad[key]);
            if (a->stage > 0 && pp_rank_of_stage(a->stage - 1, p->pp) == r) sim->ready_grad[key - 1] = st->clock;
            break;
        case PP_SEND_ACT:
        case PP_SEND_GRAD: {
            double hop = pp_hop_local(sim->k, r, a->peer) ? sim->k->p2p_local : sim->k->p2p_remote;
            double end = issue(sim, &st->pp_free, r, TRACK_PP, st->clock, hop, "batch");  // as comm_batch_start
            queue_push(&sim->queues[(size_t)r * p->pp + a->peer], end);
            break;
        }
        case PP_RECV_ACT:
        case PP_RECV_GRAD: {
            MessageQueue *q = &sim->queues[(size_t)a->peer * p->pp + r];
            if (q->read == q->count) return st->next > start;  // not sent yet: another rank first
            double t = q->times[q->read++];
            if (a->kind == PP_RECV_ACT) sim->ready_act[key] = t;
            else sim->ready_grad[key] = t;
            break;
        }
        }
        st->next++;
    }
    return st->next > start;
}

static void build_chunks(Sim *sim) {
    const PlanConfig *p = sim->p;
    int S = n_stages(p);
    sim->chunks = calloc((size_t)S, sizeof(ChunkUnits));
    sim->max_units = 0;
    for (int s = 0; s < S; s++) {
        StageLayout l = stage_layout(p, s);
        ChunkUnits *cu = &sim->chunks[s];
        if (l.end - l.first + 2 > 512) fatal_input("at most 510 blocks per stage");
        if (l.embed) cu->cost[cu->n++] = &sim->k->embed;
        for (int b = l.first; b < l.end; b++) cu->cost[cu->n++] = &sim->k->block;
        if (l.head) cu->cost[cu->n++] = &sim->k->head;
        if (cu->n > sim->max_units) sim->max_units = cu->n;
    }
}

typedef struct {
    double step, busy_max, waited_max, bubble;
} SimResult;

// Replays the schedule on every pipeline rank with the unit costs in sim->chunks.
static SimResult simulate(Sim *sim, const PpSchedule *s) {
    const PlanConfig *p = sim->p;
    int P = s->p, S = n_stages(p);
    RankState *st = calloc((size_t)P, sizeof(RankState));
    sim->ready_act = calloc((size_t)s->m * S, sizeof(double));
    sim->ready_grad = calloc((size_t)s->m * S, sizeof(double));
    sim->queues = calloc((size_t)P * P, sizeof(MessageQueue));
    for (int r = 0; r < P; r++) {
        st[r].gathered = malloc(sizeof(double) * (size_t)p->virtual_stages * sim->max_units);
        for (int i = 0; i < p->virtual_stages * sim->max_units; i++) st[r].gathered[i] = -1;
        st[r].last_backward = calloc((size_t)p->virtual_stages, sizeof(int));
        const PpActionList *l = &s->ranks[r];
        for (int i = 0; i < l->count; i++)
            if (l->items[i].kind == PP_BACKWARD) st[r].last_backward[pp_chunk_of_stage(l->items[i].stage, P)] = l->items[i].microbatch;
    }
    for (bool moved = true, done = false; !done;) {
        if (!moved) fatal("the schedule deadlocks in the simulation");
        moved = false;
        done = true;
        for (int r = 0; r < P; r++) {
            moved |= advance(sim, &st[r], r, &s->ranks[r]);
            done &= st[r].next == s->ranks[r].count;
        }
    }
    // The bubble over the pipelined part (first compute to last, all ranks): the time compute
    // streams waited for a neighbour, before their first compute, or after their last. Then the
    // step's end: the gradient reductions drain, the optimizer runs (and ZeRO-1/2 all-gather the
    // new weights).
    SimResult res = {0};
    double first = INFINITY, last = 0, idle = 0;
    for (int r = 0; r < P; r++) first = fmin(first, st[r].first_compute), last = fmax(last, st[r].last_compute);
    for (int r = 0; r < P; r++) idle += st[r].idle + (st[r].first_compute - first) + (last - st[r].last_compute);
    res.bubble = last > first ? idle / (P * (last - first)) : 0;
    for (int r = 0; r < P; r++) {
        RankState *x = &st[r];
        double drained = fmax(x->clock, fmax(x->shard_free, x->rep_free));
        if (drained > x->clock)
            record(sim->slices, (SimSlice){r, TRACK_COMPUTE, x->clock, drained, gradient_wait_name(sim->p, x), "comm-wait",
                                           -1, -1, 0});
        x->waited += drained - x->clock;
        x->clock = drained;
        if (sim->k->optimizer > 0) run_compute(sim, x, r, x->clock, sim->k->optimizer, "optimizer", -1, -1, 0, false);
        if (sim->k->after_step > 0) {
            double end = issue(sim, &x->shard_free, r, TRACK_SHARD, x->clock, sim->k->after_step, "all_gather");
            record(sim->slices, (SimSlice){r, TRACK_COMPUTE, x->clock, end, "fsdp weight all-gather", "comm-wait", -1, -1, 0});
            x->waited += end - x->clock;
            x->clock = end;
        }
        res.step = fmax(res.step, x->clock);
        res.busy_max = fmax(res.busy_max, x->busy);
        res.waited_max = fmax(res.waited_max, x->waited);
    }
    for (int r = 0; r < P; r++) free(st[r].gathered), free(st[r].last_backward);
    for (int i = 0; i < P * P; i++) free(sim->queues[i].times);
    free(sim->queues), free(sim->ready_act), free(sim->ready_grad), free(st);
    return res;
}

// ---- trace ------------------------------------------------------------------------------------------------
static void write_trace(const PlanConfig *p, const SliceList *l, double step, const char *path) {
    TraceRankInput *inputs = calloc((size_t)p->pp, sizeof(TraceRankInput));
    TraceRankData **data = calloc((size_t)p->pp, sizeof(TraceRankData *));
    for (int r = 0; r < p->pp; r++) {
        char name[96];
        // The simulated rank stands for all ranks with its pipeline index; it takes the number of the
        // first of them (dp, cp and tp index 0), as the trainer's trace numbers that rank.
        int rank = r * dp_size(p) * p->cp * p->tp;
        snprintf(name, sizeof name, "rank %d [pp%d dp0 cp0 tp0] (simulated)", rank, r);
        trace_init(rank, name);
        int tracks[N_TRACKS];
        for (int t = 0; t < N_TRACKS; t++) tracks[t] = -1;  // made when first used, as the trainer's are
        tracks[TRACK_STEPS] = trace_track(track_name(p, TRACK_STEPS));
        tracks[TRACK_COMPUTE] = trace_track(track_name(p, TRACK_COMPUTE));
        trace_begin_at(tracks[TRACK_STEPS], "step", "step", 0);
        trace_arg_int(tracks[TRACK_STEPS], "step", 1);
        trace_end_at(tracks[TRACK_STEPS], (int64_t)(step * 1e9));
        for (int i = 0; i < l->count; i++) {
            const SimSlice *s = &l->items[i];
            if (s->rank != r) continue;
            if (tracks[s->track] < 0) tracks[s->track] = trace_track(track_name(p, s->track));
            int t = tracks[s->track];
            trace_begin_at(t, s->name, s->category, (int64_t)(s->start * 1e9));
            if (s->microbatch >= 0) trace_arg_int(t, "microbatch", s->microbatch);
            if (s->stage >= 0) trace_arg_int(t, "stage", s->stage);
            if (s->flops > 0) trace_arg_double(t, "flops", s->flops);
            trace_end_at(t, (int64_t)(s->end * 1e9));
        }
        void *blob;
        size_t len;
        char err[256];
        if (!trace_serialize(&blob, &len)) fatal("could not serialize the trace");
        data[r] = trace_deserialize(blob, len, err, sizeof err);
        free(blob);
        if (!data[r]) fatal("%s", err);
        inputs[r] = (TraceRankInput){data[r], 0};
    }
    trace_shutdown();
    char err[256];
    if (!trace_write_pftrace_ranks(path, inputs, p->pp, err, sizeof err)) fatal("%s", err);
    for (int r = 0; r < p->pp; r++) trace_rank_data_free(data[r]);
    free(data), free(inputs);
}

// ---- step time ------------------------------------------------------------------------------------------------
PlanTime plan_step_time(const PlanConfig *p, const Cluster *c, const char *trace_path) {
    const char *err = plan_check(p);
    if (err) fatal_input("%s", err);
    const PpSchedule *s = &schedule_of(p)->s;
    Costs k = unit_costs(p, c);
    SliceList slices = {0};
    Sim sim = {.p = p, .k = &k, .reshard = p->pp == 1, .reduce_every = p->pp == 1,
               .slices = trace_path ? &slices : NULL};
    build_chunks(&sim);
    SimResult r = simulate(&sim, s);
    int gpus = plan_gpus(p);
    double straggler = plan_straggler_s(gpus, c->rank_jitter, r.busy_max);
    if (trace_path && straggler > 0)
        for (int rank = 0; rank < s->p; rank++)  // every simulated pipeline rank
            record(&slices, (SimSlice){rank, TRACK_COMPUTE, r.step, r.step + straggler, "wait for the slowest GPU",
                                       "comm-wait", -1, -1, 0});
    r.step += straggler;
    if (trace_path) write_trace(p, &slices, r.step, trace_path);
    free(slices.items);
    free(sim.chunks);
    PlanTime t = {.step_s = r.step, .compute_s = r.busy_max, .exposed_comm_s = r.waited_max, .bubble = r.bubble,
                  .straggler_s = straggler};
    double tokens = (double)p->batch * p->seq_len;
    t.tps_per_gpu = tokens / r.step / gpus;
    t.model_tflops = model_flops_per_token(&p->model, p->seq_len) * t.tps_per_gpu / 1e12;
    t.mfu = t.model_tflops * 1e12 / c->peak_bf16;
    return t;
}

// ---- stragglers ---------------------------------------------------------------------------------------
// E[max] = integral of x n phi(x) Phi(x)^(n-1) dx, by Simpson's rule on [-9, 9] (h = 1e-3): beyond it
// the integrand is below 1e-12 for every n up to PLAN_MAX_GPUS. Phi^(n-1) as exp((n-1) log Phi), which
// neither underflows to a wrong 0 nor rounds to 1 too early.
double plan_expected_max_normal(int n) {
    static int cached_n;
    static double cached;
    if (n <= 1) return 0;
    if (n == cached_n) return cached;
    const double lo = -9, hi = 9, h = 1e-3;
    int steps = (int)lround((hi - lo) / h);
    double sum = 0;
    for (int i = 0; i <= steps; i++) {
        double x = lo + i * h, cdf = 0.5 * erfc(-x / sqrt(2.0));
        double f = x * n * 0.3989422804014327 * exp(-0.5 * x * x) * exp((n - 1) * log(cdf));  // 1/sqrt(2 pi)
        sum += f * (i == 0 || i == steps ? 1 : i % 2 ? 4 : 2);
    }
    cached_n = n, cached = sum * h / 3;
    return cached;
}

double plan_straggler_s(int gpus, double jitter, double busy_s) {
    return jitter > 0 ? jitter * plan_expected_max_normal(gpus) * busy_s : 0;
}

double plan_ideal_bubble(PpScheduleKind kind, int p, int m, int v) {
    PpSchedule s;
    const char *err = pp_schedule_build(kind, p, m, v, &s);
    if (err) fatal_input("pipeline schedule: %s", err);
    // One unit per stage costing 1 forward, 2 backward; nothing else.
    PlanConfig cfg = {.pp = p, .virtual_stages = v, .microbatches = m, .schedule = kind, .dp_replicate = 1,
                      .dp_shard = 1, .cp = 1, .tp = 1};
    Costs k = {.block = {.fwd = 1, .bwd = 2}, .pp_stride = 1, .gpus_per_node = 1};  // transfers free wherever they go
    Sim sim = {.p = &cfg, .k = &k, .max_units = 1};
    sim.chunks = calloc((size_t)p * v, sizeof(ChunkUnits));
    for (int i = 0; i < p * v; i++) sim.chunks[i] = (ChunkUnits){.cost = {&k.block}, .n = 1};
    SimResult r = simulate(&sim, &s);
    free(sim.chunks);
    pp_schedule_free(&s);
    return r.bubble;
}
