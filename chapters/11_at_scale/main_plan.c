// plan: memory per GPU and predicted step time of a training run on a cluster, before running it.
//
//   ./build/plan --model llama3_8b --dp-shard 8 --batch 16 --seq-len 8192 --ac selective
//   ./build/plan --model llama3_70b --gpus 256 --tp 8 --batch 512 --fp8 --compile --ac full
//   ./build/plan --model llama3_70b --gpus 256 --batch 512 --search   (mesh, ZeRO, schedule, AC)
//   ./build/plan ... --trace sim.pftrace      (the simulated step, same tracks as the trainer's)
//
// The mesh flags are the trainer's. The last line is `TPS/GPU <number>` for scripts.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/11_at_scale/plan.h"
#include "common/args.h"
#include "common/fileio.h"
#include "common/log.h"

static struct {
    const char *model, *cluster, *ac, *schedule, *trace, *precision, *cp_impl;
    int gpus, dp_replicate, dp_shard, cp, tp, pp, batch, seq_len, zero_stage, microbatches, virtual_stages, top;
    bool fp8, compile, async_tp, search;
    double sac_mm_share;
} opt;

#define UNBOUNDED 1e9
// The flags that fix a dimension of --search (the rest of the flags are the run's, never searched).
#define SEARCH_FIXES \
    "--pp --dp-replicate --dp-shard --cp --tp --zero-stage --pp-schedule --pp-microbatches --pp-virtual-stages --ac"
static ArgSpec flags[] = {
    {"model", ARG_STRING, &opt.model, "llama3_8b", "model config (the trainer's names)", .value_name = "NAME"},
    {"cluster", ARG_STRING, &opt.cluster, "h100-sxm-ib", "cluster profile: " CLUSTER_NAMES ", or a JSON file", .value_name = "NAME|FILE"},
    // No default (0 in opt): the mesh's product. The mesh's own product is checked in mesh_gpus.
    {"gpus", ARG_INT, &opt.gpus, NULL, "GPUs in all (default: the mesh's product; else --dp-shard fills the rest)",
     .min = 1, .max = PLAN_MAX_GPUS},
    {"dp-replicate", ARG_INT, &opt.dp_replicate, "1", "data-parallel replicas (DDP, or HSDP's outer dim)", .min = 1,
     .max = PLAN_MAX_GPUS},
    {"dp-shard", ARG_INT, &opt.dp_shard, "1", "data-parallel shards (FSDP)", .min = 1, .max = PLAN_MAX_GPUS},
    {"cp", ARG_INT, &opt.cp, "1", "context-parallel ranks (ring attention)", .min = 1, .max = 1024},
    {"cp-impl", ARG_CHOICE, &opt.cp_impl, "ring",
     "with --cp: ring (chapter 8's: the kv heads' K and V hop by hop behind the attention) or torch-allgather "
     "(PyTorch's context_parallel as seed 001's runs used it: K and V repeated to the query heads and "
     "all-gathered per attention call, dK and dV sent in fp32, fp32 merges; under --compile nothing overlaps)",
     .choices = CP_IMPL_NAMES},
    {"tp", ARG_INT, &opt.tp, "1", "tensor-parallel ranks (with sequence parallelism)", .min = 1, .max = 1024},
    {"pp", ARG_INT, &opt.pp, "1", "pipeline ranks", .min = 1, .max = 1024},
    {"batch", ARG_INT, &opt.batch, "16", "global batch, sequences", .min = 1, .max = UNBOUNDED},
    {"seq-len", ARG_INT, &opt.seq_len, "0", "tokens per sequence (0: the model's)", .min = 0, .max = UNBOUNDED},
    {"ac", ARG_CHOICE, &opt.ac, "none", "activation checkpointing", .choices = AC_MODE_NAMES},
    {"sac-mm-share", ARG_DOUBLE, &opt.sac_mm_share, "0",
     "--ac selective: share of the forward matmuls recomputed (0: this project's policy; torchtitan's op-level "
     "policy recomputes every second matmul: 0.5)", .min = 0, .max = 1},
    {"zero-stage", ARG_INT, &opt.zero_stage, "3", "ZeRO stage of the shard group", .min = 1, .max = 3},
    {"pp-schedule", ARG_CHOICE, &opt.schedule, "1F1B", "pipeline schedule", .choices = PP_SCHEDULE_NAMES},
    {"pp-microbatches", ARG_INT, &opt.microbatches, "0", "micro-batches per step (0: pp, or 2 pp interleaved)",
     .min = 0, .max = PLAN_MAX_MICROBATCHES},
    {"pp-virtual-stages", ARG_INT, &opt.virtual_stages, "0", "chunks per pipeline rank (0: 1, or 2 interleaved)",
     .min = 0, .max = 64},
    {"fp8", ARG_BOOL, &opt.fp8, NULL, "matmuls in FP8 (Float8 training)", .choices = NULL},
    {"compile", ARG_BOOL, &opt.compile, NULL, "element-wise ops fused (torch.compile)", .choices = NULL},
    {"async-tp", ARG_BOOL, &opt.async_tp, NULL, "tp collectives overlapped with their matmuls", .choices = NULL},
    {"precision", ARG_CHOICE, &opt.precision, "mixed", "mixed: bf16 compute, fp32 master/grads/AdamW; fp32: the CPU trainer",
     .choices = "mixed|fp32"},
    {"trace", ARG_STRING, &opt.trace, NULL, "write the simulated step as a Perfetto trace", .value_name = "FILE"},
    {"search", ARG_BOOL, &opt.search, NULL,
     "list the meshes that fit on --gpus, fastest first, each with its best ZeRO stage, schedule, micro-batches and "
     "--ac; each of " SEARCH_FIXES " given stays fixed", .choices = NULL},
    {"top", ARG_INT, &opt.top, "0", "with --search: list only the N fastest (0: all)", .min = 0, .max = UNBOUNDED},
};
#define N_FLAGS (int)(sizeof flags / sizeof flags[0])

static Cluster load_cluster(void) {
    Cluster c;
    if (cluster_lookup(opt.cluster, &c)) {
        char why[160];  // the built-in profiles keep the rules a file must: a slip there is a bug, not bad input
        if (cluster_check(&c, why, sizeof why)) fatal("profile %s: %s", c.name, why);
        return c;
    }
    if (strchr(opt.cluster, '.') || strchr(opt.cluster, '/')) return cluster_load_json(opt.cluster, &c), c;
    fatal_input("--cluster %s: not a profile (%s) nor a .json file", opt.cluster, CLUSTER_NAMES);
}

// The GPUs of the mesh flags, refused above PLAN_MAX_GPUS. In double, where the product of five
// flags (up to 10^6 x 10^6 x 1024^3) cannot wrap as it would in an int (65536 x 65536 = 0) or
// even a long; exact up to 2^53, and any larger product is refused anyway.
static int mesh_gpus(const PlanConfig *p) {
    double n = (double)p->pp * p->dp_replicate * p->dp_shard * p->cp * p->tp;
    if (n > PLAN_MAX_GPUS)
        fatal_input("pp x dp-replicate x dp-shard x cp x tp = %d x %d x %d x %d x %d = %.0f GPUs: more than %d", p->pp,
                    p->dp_replicate, p->dp_shard, p->cp, p->tp, n, PLAN_MAX_GPUS);
    return (int)n;
}

// The tokens of a step, refused above PLAN_MAX_TOKENS (a micro-batch's tokens are an int in the
// model's shapes: 1024 x 8M tokens would wrap and shrink the activations counted).
static void check_tokens(const PlanConfig *p) {
    long long tokens = (long long)p->batch * p->seq_len;
    if (tokens > PLAN_MAX_TOKENS)
        fatal_input("--batch %d x --seq-len %d = %lld tokens per step: more than %lld", p->batch, p->seq_len, tokens,
                    PLAN_MAX_TOKENS);
}

static PlanConfig config_from_flags(void) {
    PlanConfig p = {0};
    if (!model_config_lookup(opt.model, &p.model))
        fatal_input("--model %s: unknown (one of %s)", opt.model, MODEL_CONFIG_NAMES);
    p.seq_len = opt.seq_len ? opt.seq_len : p.model.max_seq_len;
    model_config_validate(&p.model, p.seq_len);
    p.batch = opt.batch;
    check_tokens(&p);
    p.dp_replicate = opt.dp_replicate, p.dp_shard = opt.dp_shard, p.cp = opt.cp, p.tp = opt.tp, p.pp = opt.pp;
    mesh_gpus(&p);  // from here on every product of the mesh's sizes fits an int
    if (opt.gpus) {
        long rest = (long)p.dp_replicate * p.cp * p.tp * p.pp;
        if (!args_given(flags, N_FLAGS, "dp-shard") && !opt.search) {
            if (opt.gpus % rest) fatal_input("--gpus %d: not a multiple of dp-replicate x cp x tp x pp = %ld", opt.gpus, rest);
            p.dp_shard = (int)(opt.gpus / rest);
        } else if (rest * p.dp_shard != opt.gpus && !opt.search) {
            fatal_input("--gpus %d: the mesh has %ld", opt.gpus, rest * p.dp_shard);
        }
    }
    p.ac = (ActCheckpoint)args_choice_index(AC_MODE_NAMES, opt.ac);
    p.sac_mm_share = opt.sac_mm_share;
    p.zero_stage = opt.zero_stage;
    pp_schedule_parse(opt.schedule, &p.schedule);
    bool interleaved = p.schedule == PP_INTERLEAVED_1F1B;
    p.virtual_stages = opt.virtual_stages ? opt.virtual_stages : interleaved ? 2 : 1;
    p.microbatches = opt.microbatches ? opt.microbatches : p.pp * (interleaved ? 2 : 1);
    p.fp8 = opt.fp8, p.compile = opt.compile, p.async_tp = opt.async_tp;
    p.cp_impl = (CpImpl)args_choice_index(CP_IMPL_NAMES, opt.cp_impl);
    bool fp32 = strcmp(opt.precision, "fp32") == 0;
    // The FP8 model is Float8 training on GPUs: matmuls at the FP8 peak, casts that read bf16
    // inputs. fp32 is the CPU trainer, whose --fp8 emulates FP8 with fp32 matmuls: nothing here
    // would predict it.
    if (p.fp8 && fp32)
        fatal_input("--fp8: only with --precision mixed (the FP8 model casts bf16 inputs; fp32 is the CPU trainer, "
                    "whose FP8 is emulated in fp32 matmuls)");
    // mixed: bf16 activations and gathered weights; fp32 master weights, gradients (reduced in
    // fp32, as torchtitan does) and AdamW m, v. fp32: the CPU trainer, one copy of everything.
    p.act_bytes = fp32 ? 4 : 2;
    p.master_bytes = 4, p.grad_bytes = 4, p.optim_bytes = 8;
    p.working_bytes = fp32 ? 0 : 2;
    p.acts_per_microbatch = fp32;  // the CPU trainer's pipeline: one ModelActs per micro-batch in flight
    return p;
}

// --fp8 runs the matmuls at peak_fp8 x fp8_gemm_eff: a cluster without FP8 (an A100, a CPU) would
// make every step infinitely long.
static void check_fp8(const PlanConfig *p, const Cluster *c) {
    if (p->fp8 && (c->peak_fp8 <= 0 || c->fp8_gemm_eff <= 0))
        fatal_input("--fp8: cluster %s has no FP8 matmuls (peak_fp8 %g, fp8_gemm_eff %g)", c->name, c->peak_fp8,
                    c->fp8_gemm_eff);
}

static const double GiB = 1073741824.0;

// A trace's clock counts int64 nanoseconds: about 292 years. A step of more than 1e9 s (the cluster's
// numbers in the wrong units, or a model far too big for it) is refused before the trace is written.
#define PLAN_MAX_TRACED_STEP_S 1e9

static void print_plan(const PlanConfig *p, const Cluster *c) {
    PlanMemory m = plan_memory(p);
    if (opt.trace) {
        double step_s = plan_step_time(p, c, NULL).step_s;
        if (!(step_s <= PLAN_MAX_TRACED_STEP_S))
            fatal_input("--trace %s: the step would take %.3g s, beyond a trace's clock (%g s); check the cluster's "
                        "units (FLOP/s, bytes/s, s)", opt.trace, step_s, PLAN_MAX_TRACED_STEP_S);
    }
    PlanTime t = plan_step_time(p, c, opt.trace);
    char data_parallel[16] = "no dp";  // the stage only where there is a shard group
    if (p->dp_shard * p->cp > 1) snprintf(data_parallel, sizeof data_parallel, "ZeRO-%d", p->zero_stage);
    else if (p->dp_replicate > 1) snprintf(data_parallel, sizeof data_parallel, "DDP");
    printf("%s on %d GPUs of %s: pp %d x dp_replicate %d x dp_shard %d x cp %d x tp %d; batch %d x %d tokens; "
           "--ac %s, %s, %s m=%d v=%d%s%s%s%s\n",
           p->model.name, plan_gpus(p), c->name, p->pp, p->dp_replicate, p->dp_shard, p->cp, p->tp, p->batch,
           p->seq_len, opt.ac, data_parallel, pp_schedule_name(p->schedule), p->microbatches, p->virtual_stages,
           p->fp8 ? ", fp8" : "", p->compile ? ", compile" : "", p->async_tp ? ", async tp" : "",
           p->cp > 1 && p->cp_impl == CP_IMPL_TORCH_ALLGATHER ? ", cp torch-allgather" : "");
    printf("memory per GPU (GiB, pp rank %d, %d micro-batches in flight): weights %.2f  grads %.2f  optimizer %.2f  "
           "activations %.2f  comm %.2f  total %.2f of %.1f%s\n",
           m.pp_rank, m.in_flight, m.weights / GiB, m.grads / GiB, m.optimizer / GiB, m.activations / GiB,
           m.comm / GiB, m.total / GiB, c->hbm_bytes / GiB, m.total > c->hbm_bytes ? "  DOES NOT FIT" : "");
    // milliseconds shown in full below a second (a CPU rank's step; scripts/bench_plan.sh reads it)
    int digits = t.step_s < 1 ? 6 : 3;
    printf("step %.*f s: compute %.*f s, exposed comm %.*f s, bubble %.1f%%, stragglers %.*f s; %.0f model TFLOP/s per "
           "GPU, MFU %.1f%%\n",
           digits, t.step_s, digits, t.compute_s, digits, t.exposed_comm_s, 100 * t.bubble, digits, t.straggler_s,
           t.model_tflops, 100 * t.mfu);
    if (opt.trace) printf("trace: %s\n", opt.trace);
    printf("TPS/GPU %.0f\n", t.tps_per_gpu);
}

// --search: every mesh of --gpus ranks over (pp, dp_replicate, dp_shard, cp, tp): each of pp,
// dp_replicate, cp and tp at the value given, else at each power of two (tp within a node, pp up
// to 64), and dp_shard the rest (only meshes where that is the value given, when given). Each
// mesh is listed with the fastest of its settings that fits, among: ZeRO stage 1, 2 or 3 where
// there is a shard group (unless --zero-stage is given); for pp > 1, 1F1B and interleaved 1F1B
// with 2 chunks a rank (unless --pp-schedule is given), at each micro-batch count from pp up that
// divides the rank's batch, up to PLAN_MAX_MICROBATCHES (unless --pp-microbatches is given; the
// counts a schedule cannot run, plan_check skips); and the lightest checkpointing that fits, none, then selective,
// then full (unless --ac is given: recomputing only adds compute, so a lighter policy that fits
// is never slower). Between settings as fast, the one needing less memory. The batch and the rest
// stay as given.
typedef struct {
    PlanConfig p;
    PlanMemory m;
    PlanTime t;
} Candidate;

// Fastest first; between equals (the same tokens per GPU with every transfer hidden: cp often ties
// with dp_shard), the simpler mesh: less cp, then tp, pp and replication.
static int by_tps(const void *a, const void *b) {
    const PlanConfig *p = &((const Candidate *)a)->p, *q = &((const Candidate *)b)->p;
    double x = ((const Candidate *)a)->t.tps_per_gpu, y = ((const Candidate *)b)->t.tps_per_gpu;
    if (x != y) return (x < y) - (x > y);
    int keys[][2] = {{p->cp, q->cp}, {p->tp, q->tp}, {p->pp, q->pp}, {p->dp_replicate, q->dp_replicate}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (keys[i][0] != keys[i][1]) return keys[i][0] < keys[i][1] ? -1 : 1;
    return 0;
}

static bool flag_given(const char *name) { return args_given(flags, N_FLAGS, name); }
// --pp-microbatches 0 is its default (the schedule's own count), not a count to hold the search to.
static bool microbatches_fixed(void) { return opt.microbatches > 0; }

// The sizes --search tries for a mesh dimension: the flag's value when given, else each power of
// two up to limit (at most PLAN_MAX_GPUS: 20 of them). Returns how many.
static int sizes_to_try(const char *flag, int given, int limit, int out[32]) {
    if (flag_given(flag)) return out[0] = given, 1;
    int n = 0;
    for (int size = 1; size <= limit; size *= 2) out[n++] = size;
    return n;
}

// The schedules a mesh with pp pipeline ranks is tried with; returns how many.
static int schedules_to_try(const PlanConfig *base, int pp, PpScheduleKind out[2]) {
    if (pp == 1) return out[0] = PP_1F1B, 1;
    if (flag_given("pp-schedule")) return out[0] = base->schedule, 1;
    return out[0] = PP_1F1B, out[1] = PP_INTERLEAVED_1F1B, 2;
}

// The ZeRO stages a mesh is tried with: one where there is no shard group (the stage means nothing).
static int zero_stages_to_try(const PlanConfig *mesh, int out[3]) {
    if (flag_given("zero-stage") || mesh->dp_shard * mesh->cp == 1) return out[0] = mesh->zero_stage, 1;
    return out[0] = 1, out[1] = 2, out[2] = 3, 3;
}

// The checkpointing policies a mesh is tried with, lightest first.
static int acs_to_try(const PlanConfig *base, ActCheckpoint out[3]) {
    if (flag_given("ac")) return out[0] = base->ac, 1;
    return out[0] = AC_NONE, out[1] = AC_SELECTIVE, out[2] = AC_FULL, 3;
}

// The lightest checkpointing under which p fits, into *k with its step simulated (false: none).
static bool lightest_fitting_ac(PlanConfig p, const Cluster *c, Candidate *k) {
    ActCheckpoint acs[3];
    for (int i = 0, n = acs_to_try(&p, acs); i < n; i++) {
        p.ac = acs[i];
        PlanMemory m = plan_memory(&p);
        if (m.total > c->hbm_bytes) continue;
        *k = (Candidate){.p = p, .m = m, .t = plan_step_time(&p, c, NULL)};
        return true;
    }
    return false;
}

// The fastest settings of the mesh that fit into *best (false: none fits). *valid: some setting
// passed plan_check, fitting or not.
static bool best_settings(const PlanConfig *mesh, const Cluster *c, Candidate *best, bool *valid) {
    PpScheduleKind kinds[2];
    int stages[3], n_kinds = schedules_to_try(mesh, mesh->pp, kinds), n_stages = zero_stages_to_try(mesh, stages);
    int rank_batch = mesh->batch / (mesh->dp_replicate * mesh->dp_shard);
    bool found = false;
    for (int s = 0; s < n_kinds; s++) {
        PlanConfig p = *mesh;
        p.schedule = kinds[s];
        bool interleaved = p.schedule == PP_INTERLEAVED_1F1B;
        p.virtual_stages = interleaved ? (opt.virtual_stages ? opt.virtual_stages : 2) : 1;
        int m_first = mesh->pp, m_last = rank_batch;
        if (mesh->pp == 1) m_first = m_last = 1;
        else if (microbatches_fixed()) m_first = m_last = opt.microbatches;
        if (m_last > PLAN_MAX_MICROBATCHES) m_last = PLAN_MAX_MICROBATCHES;
        for (int m = m_first; m <= m_last; m++) {
            if (rank_batch % m) continue;  // a micro-batch count divides the rank's sequences
            for (int z = 0; z < n_stages; z++) {  // innermost, with the checkpointing: the same schedule
                p.microbatches = m, p.zero_stage = stages[z];
                if (plan_check(&p)) continue;
                *valid = true;
                Candidate k;
                if (!lightest_fitting_ac(p, c, &k)) continue;
                bool faster = found && k.t.tps_per_gpu > best->t.tps_per_gpu;
                bool as_fast_smaller = found && k.t.tps_per_gpu == best->t.tps_per_gpu && k.m.total < best->m.total;
                if (!found || faster || as_fast_smaller) *best = k, found = true;
            }
        }
    }
    return found;
}

static void print_candidates(const Candidate *found, int n) {
    printf("%4s %4s %8s %8s %4s %-9s %4s %-16s %4s %2s %10s %10s %8s %8s %6s\n", "pp", "tp", "dp_rep", "dp_shard",
           "cp", "ac", "zero", "schedule", "m", "v", "mem GiB", "step s", "bubble", "MFU", "TPS/GPU");
    for (int i = 0; i < n; i++) {
        const PlanConfig *p = &found[i].p;
        char zero[8] = "-", ac[16];
        if (p->dp_shard * p->cp > 1) snprintf(zero, sizeof zero, "%d", p->zero_stage);
        printf("%4d %4d %8d %8d %4d %-9s %4s %-16s %4d %2d %10.1f %10.3f %7.1f%% %7.1f%% %6.0f\n", p->pp, p->tp,
               p->dp_replicate, p->dp_shard, p->cp, args_choice_name(AC_MODE_NAMES, p->ac, ac, sizeof ac), zero,
               p->pp > 1 ? pp_schedule_name(p->schedule) : "-", p->microbatches, p->virtual_stages,
               found[i].m.total / GiB, found[i].t.step_s, 100 * found[i].t.bubble, 100 * found[i].t.mfu,
               found[i].t.tps_per_gpu);
    }
}

// Refuses, before searching, what no mesh of the search could run: the mesh flags given must divide
// --gpus (all five given: make it), and the flags given, with every searched dimension at its
// smallest (1; m = pp, 1F1B unless --pp-schedule is given), must pass plan_check, with the plain
// run's message. Each of its rules only gets stricter as the searched dimensions grow (more
// data-parallel ranks or micro-batches to divide the batch by, smaller micro-batches to divide
// over tp, more stages), so a flag that breaks one here breaks it in every mesh.
// A setting only a pipeline has, given (virtual stages, the interleaved schedule): the search then
// lists pipelines only, and checks the flags at the smallest one.
static bool pipeline_setting_given(const PlanConfig *base) {
    return opt.virtual_stages > 1 || (flag_given("pp-schedule") && base->schedule == PP_INTERLEAVED_1F1B);
}

static void check_search_flags(const PlanConfig *base, int gpus) {
    const char *mesh_flags[] = {"pp", "dp-replicate", "dp-shard", "cp", "tp"};
    int fixed = 0, all_fixed = 1;
    for (int i = 0; i < 5; i++) fixed += flag_given(mesh_flags[i]), all_fixed &= flag_given(mesh_flags[i]);
    int given = plan_gpus(base);  // the dimensions not given are 1
    if (fixed && gpus % given)
        fatal_input("--gpus %d: not a multiple of the mesh flags given (pp x dp-replicate x dp-shard x cp x tp = %d)",
                    gpus, given);
    if (all_fixed && given != gpus) fatal_input("--gpus %d: the mesh has %d", gpus, given);
    PlanConfig least = *base;
    // without --pp: checked at the smallest pipeline, 2 ranks (at 1 it would always be refused)
    if (!flag_given("pp") && pipeline_setting_given(base) && gpus % 2 == 0) least.pp = 2;
    if (least.pp == 1 || !flag_given("pp-schedule")) least.schedule = PP_1F1B;  // as schedules_to_try's first
    bool interleaved = least.schedule == PP_INTERLEAVED_1F1B;
    least.virtual_stages = opt.virtual_stages ? opt.virtual_stages : interleaved ? 2 : 1;  // given: checked as given
    least.microbatches = least.pp == 1 ? 1 : microbatches_fixed() ? opt.microbatches : least.pp;
    const char *err = plan_check(&least);
    if (err) fatal_input("%s", err);
}

static void search(const PlanConfig *base, const Cluster *c) {
    int gpus = opt.gpus ? opt.gpus : plan_gpus(base);
    check_search_flags(base, gpus);
    int tps[32], cps[32], pps[32], reps[32];
    int n_tp = sizes_to_try("tp", base->tp, c->gpus_per_node < gpus ? c->gpus_per_node : gpus, tps);
    int n_cp = sizes_to_try("cp", base->cp, gpus, cps);
    int n_pp = sizes_to_try("pp", base->pp, 64 < gpus ? 64 : gpus, pps);
    int n_rep = sizes_to_try("dp-replicate", base->dp_replicate, gpus, reps);
    Candidate *found = NULL;
    int n = 0, tried = 0;
    // Products in 64 bits: each factor is at most PLAN_MAX_GPUS, and a partial product over gpus
    // is dropped before it is multiplied again.
    for (int i = 0; i < n_tp; i++)
        for (int j = 0; j < n_cp; j++)
            for (int k = 0; k < n_pp; k++)
                for (int l = 0; l < n_rep; l++) {
                    long long rest = (long long)tps[i] * cps[j];
                    if (rest > gpus || (rest *= pps[k]) > gpus || (rest *= reps[l]) > gpus || gpus % rest) continue;
                    PlanConfig mesh = *base;
                    mesh.tp = tps[i], mesh.cp = cps[j], mesh.pp = pps[k], mesh.dp_replicate = reps[l];
                    mesh.dp_shard = (int)(gpus / rest);
                    if (flag_given("dp-shard") && mesh.dp_shard != base->dp_shard) continue;
                    if (mesh.pp == 1 && pipeline_setting_given(base)) continue;
                    bool valid = false;
                    Candidate best;
                    bool fits = best_settings(&mesh, c, &best, &valid);
                    tried += valid;
                    if (!fits) continue;
                    found = realloc(found, sizeof(Candidate) * (size_t)(n + 1));
                    found[n++] = best;
                }
    qsort(found, (size_t)n, sizeof(Candidate), by_tps);
    printf("%s on %d GPUs of %s, batch %d x %d%s%s%s: %d of %d meshes fit in %.1f GiB (searched:%s%s%s%s%s%s%s%s%s)\n",
           base->model.name, gpus, c->name, base->batch, base->seq_len, base->fp8 ? ", fp8" : "",
           base->compile ? ", compile" : "", base->cp_impl == CP_IMPL_TORCH_ALLGATHER ? ", cp torch-allgather" : "", n,
           tried, c->hbm_bytes / GiB, flag_given("pp") ? "" : " pp",
           flag_given("dp-replicate") ? "" : " dp_rep", flag_given("dp-shard") ? "" : " dp_shard",
           flag_given("cp") ? "" : " cp", flag_given("tp") ? "" : " tp", flag_given("ac") ? "" : " ac",
           flag_given("zero-stage") ? "" : " zero", flag_given("pp-schedule") ? "" : " schedule",
           microbatches_fixed() ? "" : " m");
    if (n) print_candidates(found, opt.top && opt.top < n ? opt.top : n);
    else if (tried == 0)  // every mesh broke a rule (most often: more data-parallel ranks than sequences)
        printf("no mesh of %d GPUs can run this: give a larger --batch or fewer --gpus, or fix fewer mesh flags\n", gpus);
    else printf("no mesh fits: give more GPUs, a smaller batch or --seq-len, or let --ac and --zero-stage be searched\n");
    printf("TPS/GPU %.0f\n", n ? found[0].t.tps_per_gpu : 0.0);  // scripts read the last line: 0, nothing runs
    free(found);
}

// A flag the configuration would ignore is refused (as the trainer does), not echoed into a plan
// that does not use it. Under --search the mesh, the stage, the schedule and --ac may still be
// chosen, so only what is fixed counts there.
// Whether a mesh dimension is the value given: always outside --search, where the flag fixes it.
static bool fixed(const char *flag) { return !opt.search || flag_given(flag); }

static void refuse_ignored(const PlanConfig *p) {
    if (flag_given("sac-mm-share") && fixed("ac") && p->ac != AC_SELECTIVE)
        fatal_input("--sac-mm-share: only with --ac selective (the share of matmuls it recomputes)");
    if (p->async_tp && p->tp == 1 && fixed("tp")) fatal_input("--async-tp: only with --tp above 1 (or --search)");
    if (flag_given("zero-stage") && p->dp_shard == 1 && p->cp == 1 && fixed("dp-shard") && fixed("cp"))
        fatal_input("--zero-stage: only with a shard group, --dp-shard or --cp above 1 (or --search)");
    const char *pp_flags[] = {"pp-schedule", "pp-microbatches", "pp-virtual-stages"};
    for (int i = 0; i < 3; i++)
        if (flag_given(pp_flags[i]) && p->pp == 1 && fixed("pp"))
            fatal_input("--%s: only with --pp above 1 (or --search)", pp_flags[i]);
    if (flag_given("cp-impl") && p->cp == 1 && fixed("cp")) fatal_input("--cp-impl: only with --cp above 1 (or --search)");
}

int main(int argc, char **argv) {
    args_parse(flags, N_FLAGS, argc, argv, "plan",
               "memory per GPU and simulated step time of a training run on a cluster model");
    fileio_check_output("trace", opt.trace, OUTPUT_FILE);
    Cluster profile;
    if (opt.trace && !cluster_lookup(opt.cluster, &profile) && fileio_same_file(opt.trace, opt.cluster))
        fatal_input("--trace %s: is the file --cluster reads; the run would overwrite it", opt.trace);
    Cluster c = load_cluster();
    PlanConfig p = config_from_flags();
    check_fp8(&p, &c);
    if (flag_given("top") && !opt.search) fatal_input("--top: only with --search");
    refuse_ignored(&p);
    if (opt.search) {
        if (opt.trace) fatal_input("--trace: not with --search");
        search(&p, &c);
        return 0;
    }
    const char *err = plan_check(&p);
    if (err) fatal_input("%s", err);
    print_plan(&p, &c);
    return 0;
}
