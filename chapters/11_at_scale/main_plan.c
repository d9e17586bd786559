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
    const char *model, *cluster, *ac, *schedule, *trace, *precision;
    int gpus, dp_replicate, dp_shard, cp, tp, pp, batch, seq_len, zero_stage, microbatches, virtual_stages, top;
    bool fp8, compile, async_tp, search;
    double sac_mm_share;
} opt;

#define UNBOUNDED 1e9
static ArgSpec flags[] = {
    {"model", ARG_STRING, &opt.model, "llama3_8b", "model config (the trainer's names)", .value_name = "NAME"},
    {"cluster", ARG_STRING, &opt.cluster, "h100-sxm-ib", "cluster profile: " CLUSTER_NAMES ", or a JSON file", .value_name = "NAME|FILE"},
    {"gpus", ARG_INT, &opt.gpus, "0", "GPUs in all (0: the mesh's product; else --dp-shard fills the rest)", .min = 0,
     .max = UNBOUNDED},
    {"dp-replicate", ARG_INT, &opt.dp_replicate, "1", "data-parallel replicas (DDP, or HSDP's outer dim)", .min = 1,
     .max = UNBOUNDED},
    {"dp-shard", ARG_INT, &opt.dp_shard, "1", "data-parallel shards (FSDP)", .min = 1, .max = UNBOUNDED},
    {"cp", ARG_INT, &opt.cp, "1", "context-parallel ranks (ring attention)", .min = 1, .max = 1024},
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
     .min = 0, .max = UNBOUNDED},
    {"pp-virtual-stages", ARG_INT, &opt.virtual_stages, "0", "chunks per pipeline rank (0: 1, or 2 interleaved)",
     .min = 0, .max = 64},
    {"fp8", ARG_BOOL, &opt.fp8, NULL, "matmuls in FP8 (Float8 training)", .choices = NULL},
    {"compile", ARG_BOOL, &opt.compile, NULL, "element-wise ops fused (torch.compile)", .choices = NULL},
    {"async-tp", ARG_BOOL, &opt.async_tp, NULL, "tp collectives overlapped with their matmuls", .choices = NULL},
    {"precision", ARG_CHOICE, &opt.precision, "mixed", "mixed: bf16 compute, fp32 master/grads/AdamW; fp32: the CPU trainer",
     .choices = "mixed|fp32"},
    {"trace", ARG_STRING, &opt.trace, NULL, "write the simulated step as a Perfetto trace", .value_name = "FILE"},
    {"search", ARG_BOOL, &opt.search, NULL, "list the meshes that fit on --gpus, fastest first, each with its best ZeRO stage, schedule, micro-batches and --ac (flags given stay fixed)", .choices = NULL},
    {"top", ARG_INT, &opt.top, "0", "with --search: list only the N fastest (0: all)", .min = 0, .max = UNBOUNDED},
};
#define N_FLAGS (int)(sizeof flags / sizeof flags[0])

static Cluster load_cluster(void) {
    Cluster c;
    if (cluster_lookup(opt.cluster, &c)) return c;
    if (strchr(opt.cluster, '.') || strchr(opt.cluster, '/')) return cluster_load_json(opt.cluster, &c), c;
    fatal_input("--cluster %s: not a profile (%s) nor a .json file", opt.cluster, CLUSTER_NAMES);
}

static PlanConfig config_from_flags(void) {
    PlanConfig p = {0};
    if (!model_config_lookup(opt.model, &p.model))
        fatal_input("--model %s: unknown (one of %s)", opt.model, MODEL_CONFIG_NAMES);
    p.seq_len = opt.seq_len ? opt.seq_len : p.model.max_seq_len;
    model_config_validate(&p.model, p.seq_len);
    p.dp_replicate = opt.dp_replicate, p.dp_shard = opt.dp_shard, p.cp = opt.cp, p.tp = opt.tp, p.pp = opt.pp;
    if (opt.gpus) {
        long rest = (long)p.dp_replicate * p.cp * p.tp * p.pp;
        if (!args_given(flags, N_FLAGS, "dp-shard") && !opt.search) {
            if (opt.gpus % rest) fatal_input("--gpus %d: not a multiple of dp-replicate x cp x tp x pp = %ld", opt.gpus, rest);
            p.dp_shard = (int)(opt.gpus / rest);
        } else if (rest * p.dp_shard != opt.gpus && !opt.search) {
            fatal_input("--gpus %d: the mesh has %ld", opt.gpus, rest * p.dp_shard);
        }
    }
    p.batch = opt.batch;
    p.ac = (ActCheckpoint)args_choice_index(AC_MODE_NAMES, opt.ac);
    p.sac_mm_share = opt.sac_mm_share;
    p.zero_stage = opt.zero_stage;
    pp_schedule_parse(opt.schedule, &p.schedule);
    bool interleaved = p.schedule == PP_INTERLEAVED_1F1B;
    p.virtual_stages = opt.virtual_stages ? opt.virtual_stages : interleaved ? 2 : 1;
    p.microbatches = opt.microbatches ? opt.microbatches : p.pp * (interleaved ? 2 : 1);
    p.fp8 = opt.fp8, p.compile = opt.compile, p.async_tp = opt.async_tp;
    bool fp32 = strcmp(opt.precision, "fp32") == 0;
    // mixed: bf16 activations and gathered weights; fp32 master weights, gradients (reduced in
    // fp32, as torchtitan does) and AdamW m, v. fp32: the CPU trainer, one copy of everything.
    p.act_bytes = fp32 ? 4 : 2;
    p.master_bytes = 4, p.grad_bytes = 4, p.optim_bytes = 8;
    p.working_bytes = fp32 ? 0 : 2;
    return p;
}

static const double GiB = 1073741824.0;

static void print_plan(const PlanConfig *p, const Cluster *c) {
    PlanMemory m = plan_memory(p);
    PlanTime t = plan_step_time(p, c, opt.trace);
    printf("%s on %d GPUs of %s: pp %d x dp_replicate %d x dp_shard %d x cp %d x tp %d; batch %d x %d tokens; "
           "--ac %s, ZeRO-%d, %s m=%d v=%d%s%s%s\n",
           p->model.name, plan_gpus(p), c->name, p->pp, p->dp_replicate, p->dp_shard, p->cp, p->tp, p->batch,
           p->seq_len, opt.ac, p->zero_stage, pp_schedule_name(p->schedule), p->microbatches, p->virtual_stages,
           p->fp8 ? ", fp8" : "", p->compile ? ", compile" : "", p->async_tp ? ", async tp" : "");
    printf("memory per GPU (GiB, pp rank %d, %d micro-batches in flight): weights %.2f  grads %.2f  optimizer %.2f  "
           "activations %.2f  comm %.2f  total %.2f of %.1f%s\n",
           m.pp_rank, m.in_flight, m.weights / GiB, m.grads / GiB, m.optimizer / GiB, m.activations / GiB,
           m.comm / GiB, m.total / GiB, c->hbm_bytes / GiB, m.total > c->hbm_bytes ? "  DOES NOT FIT" : "");
    printf("step %.3f s: compute %.3f s, exposed comm %.3f s, bubble %.1f%%; %.0f model TFLOP/s per GPU, MFU %.1f%%\n",
           t.step_s, t.compute_s, t.exposed_comm_s, 100 * t.bubble, t.model_tflops, 100 * t.mfu);
    if (opt.trace) printf("trace: %s\n", opt.trace);
    printf("TPS/GPU %.0f\n", t.tps_per_gpu);
}

// --search: every mesh of --gpus ranks over (pp, dp_replicate, dp_shard, cp, tp), tp within a node,
// cp tried at each power of two unless --cp is given. Each mesh is listed with the fastest of its
// settings that fits, among: ZeRO stage 1, 2 or 3 where there is a shard group (unless
// --zero-stage is given); for pp > 1, 1F1B and interleaved 1F1B with 2 chunks a rank (unless
// --pp-schedule is given), at each micro-batch count pp x 2^k dividing the rank's batch (unless
// --pp-microbatches is given); and the lightest checkpointing that fits, none, then selective,
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
        else if (flag_given("pp-microbatches")) m_first = m_last = opt.microbatches;
        for (int m = m_first; m <= m_last; m *= 2)
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

static void search(const PlanConfig *base, const Cluster *c) {
    int gpus = opt.gpus ? opt.gpus : plan_gpus(base), cp_max = flag_given("cp") ? base->cp : gpus;
    Candidate *found = NULL;
    int n = 0, tried = 0;
    for (int tp = 1; tp <= c->gpus_per_node && tp <= gpus; tp *= 2)
        for (int cp = flag_given("cp") ? base->cp : 1; cp <= cp_max && cp * tp <= gpus; cp *= 2)
            for (int pp = 1; pp <= 64 && pp * cp * tp <= gpus; pp *= 2)
                for (int rep = 1; rep * pp * cp * tp <= gpus; rep *= 2) {
                    long rest = (long)tp * cp * pp * rep;
                    if (gpus % rest) continue;
                    PlanConfig mesh = *base;
                    mesh.tp = tp, mesh.cp = cp, mesh.pp = pp, mesh.dp_replicate = rep;
                    mesh.dp_shard = (int)(gpus / rest);
                    bool valid = false;
                    Candidate best;
                    bool fits = best_settings(&mesh, c, &best, &valid);
                    tried += valid;
                    if (!fits) continue;
                    found = realloc(found, sizeof(Candidate) * (size_t)(n + 1));
                    found[n++] = best;
                }
    qsort(found, (size_t)n, sizeof(Candidate), by_tps);
    printf("%s on %d GPUs of %s, batch %d x %d%s%s: %d of %d meshes fit in %.1f GiB (searched:%s%s%s%s%s)\n",
           base->model.name, gpus, c->name, base->batch, base->seq_len, base->fp8 ? ", fp8" : "",
           base->compile ? ", compile" : "", n, tried, c->hbm_bytes / GiB, flag_given("cp") ? "" : " cp",
           flag_given("ac") ? "" : " ac", flag_given("zero-stage") ? "" : " zero",
           flag_given("pp-schedule") ? "" : " schedule", flag_given("pp-microbatches") ? "" : " m");
    print_candidates(found, opt.top && opt.top < n ? opt.top : n);
    if (n) printf("TPS/GPU %.0f\n", found[0].t.tps_per_gpu);
    free(found);
}

int main(int argc, char **argv) {
    args_parse(flags, N_FLAGS, argc, argv, "plan",
               "memory per GPU and simulated step time of a training run on a cluster model");
    fileio_check_output("trace", opt.trace, OUTPUT_FILE);
    Cluster c = load_cluster();
    PlanConfig p = config_from_flags();
    if (flag_given("top") && !opt.search) fatal_input("--top: only with --search");
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
