// plan.h: a memory planner and step-time simulator for a training run on a GPU cluster.
//
// It answers two questions before a run is launched: does this layout fit in memory, and how many
// tokens per second per GPU will it reach? Nothing is measured at scale; everything comes from
// formulas the earlier chapters check at small scale:
//   memory       the ZeRO model of chapter 3 (zero_memory_model), the activation bytes chapter 5
//                counts (model_acts_bytes_per_block), the micro-batches chapter 7's schedules keep
//                in flight (pp_validate)
//   compute      FLOPs of model_block_forward_flops over a roofline: FLOPs / (peak x efficiency)
//                for matmuls and attention, bytes / HBM bandwidth for element-wise ops
//   collectives  chapter 1's alpha-beta cost per link: all-gather and reduce-scatter as NCCL's
//                flat rings (NVLink inside a node, the network once they span nodes), all-reduce
//                hierarchical (inside the node, then across nodes on 1/g of the data per NIC)
//   the step     every pipeline rank's action list from chapter 7 (pp_schedule_build), replayed as
//                an event simulation with one compute stream and one comm stream per group, under
//                the runtime's overlap rules (FSDP prefetch of one unit, per-unit reduce-scatter and
//                DDP buckets, blocking TP collectives, CP ring overlapped with attention).
// Ranks that differ only in their data-parallel, context or tensor index do the same work at the
// same time, so one representative per pipeline rank is simulated.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "chapters/07_pipeline_parallel/schedule.h"
#include "reference_cpu/config.h"
#include "reference_cpu/model.h"

// ---- the cluster --------------------------------------------------------------------------------
typedef struct {
    char name[48];
    int gpus_per_node;
    double peak_bf16, peak_fp8;   // dense tensor-core FLOP/s
    double gemm_eff, fp8_gemm_eff; // achieved share of the peak on the model's matmuls
    double attn_eff;              // achieved share of the bf16 peak in the attention kernel
    double async_tp_hidden;       // share of the tp collectives' time AsyncTP hides behind matmuls
    double hbm_bw;                // bytes/s (element-wise ops are costed at this bandwidth)
    double hbm_bytes;             // memory per GPU
    double nvlink_bw, nvlink_lat; // per GPU per direction, bytes/s achieved by a ring; seconds per hop
    double net_bw, net_lat;       // between nodes, per GPU (one NIC each), bytes/s; seconds per hop
    double power_w;               // informational: the profile's power limit
    double rank_jitter;           // relative standard deviation of one GPU's busy time in a step,
                                  // independent from GPU to GPU (0: every rank on time); see
                                  // plan_straggler_s
} Cluster;

#define CLUSTER_NAMES "h100-sxm-ib|a100-sxm-ib|cpu"
// Fills c with the named profile; false if there is none.
bool cluster_lookup(const char *name, Cluster *c);
// Reads a JSON profile: one object with the fields of Cluster, by name; a missing field keeps the
// default profile's value, anything after the object is refused. Exits with status 2 and one line
// on a bad file, a field that is not a number (name: not a string) or a number cluster_check refuses.
void cluster_load_json(const char *path, Cluster *c);
// NULL if every number of c is finite and physical: peaks, bandwidths and memory > 0, latencies and
// power >= 0, efficiencies from 1e-12 to 1, gpus_per_node 1 to PLAN_MAX_GPUS. peak_fp8, fp8_gemm_eff
// and async_tp_hidden may be 0 (no FP8 matmuls, as on an A100; AsyncTP hiding nothing). Else the
// first field that is not, with its value and the rule, in buf (len bytes), which it returns.
const char *cluster_check(const Cluster *c, char *buf, size_t len);

// ---- limits ----------------------------------------------------------------------------------------
// The most GPUs a plan may have (the product of its mesh, or --gpus), well beyond any cluster
// trained on. Below it every product of mesh sizes fits the ints the plan keeps them in.
#define PLAN_MAX_GPUS 1000000
// The most micro-batches per step: the simulation replays every one of them on every pipeline
// rank (65,536 on 64 ranks take seconds and a GiB).
#define PLAN_MAX_MICROBATCHES 65536
// The most tokens per step (batch x seq_len): the model's shapes count a micro-batch's tokens in an int.
#define PLAN_MAX_TOKENS 2147483647LL

// ---- the run -------------------------------------------------------------------------------------
// How context parallelism moves K and V (--cp-impl):
//   CP_IMPL_RING             chapter 8's ring: each rank's K and V (its kv heads, in the compute
//                            precision) hop cp - 1 times, each hop hidden behind the previous block's
//                            attention; backward K, V and dK, dV 2 cp - 1 hops.
//   CP_IMPL_TORCH_ALLGATHER  PyTorch's context_parallel as torchtitan ran it in seed 001 (torch of
//                            2024-12-23): K and V repeated to every query head (repeat_kv before SDPA),
//                            all-gathered in one collective per attention call (forward, recompute and
//                            backward each gather again); dK and dV passed around the ring in fp32, cp
//                            sends; every block's output merged into an fp32 running output, the
//                            gradients summed in fp32. Under --compile each collective is waited on right
//                            after it starts (traced functional collectives), so none overlaps compute;
//                            eager, the all-gather overlaps the first block and the dK, dV sends the
//                            next blocks.
typedef enum { CP_IMPL_RING, CP_IMPL_TORCH_ALLGATHER } CpImpl;
#define CP_IMPL_NAMES "ring|torch-allgather"  // in enum order (plan's --cp-impl choices)

typedef struct {
    ModelConfig model;
    int dp_replicate, dp_shard, cp, tp, pp; // mesh, outermost first: pp, dp_replicate, dp_shard, cp, tp
    int batch, seq_len;                     // global batch (sequences), tokens per sequence
    ActCheckpoint ac;
    double sac_mm_share;                    // selective: share of the forward matmuls recomputed
    int zero_stage;                         // 1-3 with dp_shard > 1 (3 = FSDP)
    PpScheduleKind schedule;
    int microbatches, virtual_stages;       // per step, per pp rank
    bool fp8, compile, async_tp;
    CpImpl cp_impl;                         // with cp > 1
    int act_bytes;                          // bytes per activation element: 2 (bf16 on GPUs), 4 (fp32 CPU)
    int master_bytes, working_bytes, grad_bytes, optim_bytes;  // per parameter (see plan_memory)
    bool acts_per_microbatch;               // each micro-batch in flight has its own activation buffers,
                                            // the shared ones included (the CPU trainer's pipeline)
} PlanConfig;

int plan_gpus(const PlanConfig *p);
// NULL if the layout is consistent (heads and batch divide, schedule valid, ...), else the rule broken.
const char *plan_check(const PlanConfig *p);

// ---- memory ---------------------------------------------------------------------------------------
// Bytes per GPU by category, on the pipeline rank holding the most.
//   weights    master copy (master_bytes per parameter, sharded by ZeRO-3, and from ZeRO-1 when
//              there is a working copy: then it is the optimizer's) + the working copy in the
//              compute precision (working_bytes: the gathered units of FSDP, or all of them when the
//              copy is kept: stages 1-2, or FSDP under a pipeline, which gathers once per step)
//   grads      grad_bytes per parameter, ZeRO-2/3 sharded; under a pipeline, ZeRO-2/3 also hold the
//              unsharded gradients the micro-batches accumulate until the step's one reduce-scatter
//   optimizer  optim_bytes per parameter (AdamW m and v: 8), ZeRO-1/2/3 sharded
//   activations  at the peak of the rank's action list, the sets its micro-batches hold (each
//              chunk's blocks x bytes kept per block under --ac, and its boundary or the head's
//              logits), plus the buffers the micro-batches share (plan_acts_bytes), or, with
//              acts_per_microbatch, a whole set of them per micro-batch in flight
//   comm       buffers of the collectives in flight: two units' reduce-scatter inputs (FSDP), two
//              buckets (DDP), PyTorch's context parallel's gathered K and V (tensor parallelism's
//              gathers land in the activations' buffers: nothing here)
typedef struct {
    double weights, grads, optimizer, activations, comm, total;
    int in_flight;     // micro-batches (x chunks) whose activations the rank holds at its peak
    int pp_rank;       // the rank where this peak is
} PlanMemory;
PlanMemory plan_memory(const PlanConfig *p);

// Activation bytes of one pipeline chunk holding blocks [first, end) on B sequences of T tokens,
// as model_acts_alloc_stage allocates them for model m (every buffer x elem_bytes / sizeof(real)):
// in_flight sets of per-block tensors plus one set of the shared buffers (the recompute block,
// the head or the stage's output, the backward scratch). tests/test_plan.c checks it against the
// counting allocator exactly.
double plan_acts_bytes(const Model *m, int B, int T, ActCheckpoint ac, int first, int end, int in_flight,
                       int elem_bytes);

// The FFN's hidden activation (B, T, ffn_dim) of every layer, elem_bytes each: the one tensor
// seed 002's 405B example counts (the SwiGLU product; the reference keeps gate and up as well).
double plan_ffn_hidden_bytes(const ModelConfig *c, int B, int T, int elem_bytes);

// ---- step time ------------------------------------------------------------------------------------
typedef struct {
    double step_s, tps_per_gpu, mfu;
    double compute_s;        // busy time of the busiest compute stream (compute only)
    double exposed_comm_s;   // the longest time a compute stream waited on communication (blocking
                             // TP/CP collectives, FSDP's gathers, the step's last reductions)
    double bubble;           // pipeline: 1 - busy / (p x step), the idle share of the compute streams
    double straggler_s;      // the wait for the slowest GPU (plan_straggler_s), included in step_s
    double model_tflops;     // achieved model FLOP/s per GPU (no recompute), in TFLOP/s
} PlanTime;

// Simulates one optimizer step; with trace_path, writes the simulated timeline there (Perfetto,
// one process per pipeline rank, tracks compute, comm:<group>, steps).
PlanTime plan_step_time(const PlanConfig *p, const Cluster *c, const char *trace_path);

// Stragglers. The simulation's ranks are identical and on time; a real GPU's busy time varies from
// step to step (clocks under a power cap, memory refresh, the host's interruptions, a slow link).
// Every step ends with collectives over all `gpus` (the gradient norm's all-reduce for clipping,
// FSDP's and DDP's reductions), so it lasts as long as its slowest GPU. With busy times
// busy x (1 + jitter x Z), Z standard normal and independent per GPU, the step waits on average
//   jitter x E[max of gpus standard normals] x busy
// more than the simulated one: 0 on one GPU, 0.56 jitter x busy on 2, 2.51 on 100, 3.9 on 10,000.
double plan_straggler_s(int gpus, double jitter, double busy_s);
// E[max(Z_1..Z_n)] for n independent standard normals (0 for n = 1), by quadrature to ~1e-9.
double plan_expected_max_normal(int n);

// The pipeline schedule replayed alone with forward = 1, backward = 2 and instant transfers: the
// bubble fraction the simulator finds (tests compare it with (p-1)/(m+p-1) and (p-1)/(v m+p-1)).
double plan_ideal_bubble(PpScheduleKind kind, int p, int m, int v);

// ---- collectives (alpha-beta) ----------------------------------------------------------------------
// A group of n ranks, `stride` ranks apart in the global numbering (tp innermost): how many of
// them share a node, and the time of an all-gather or reduce-scatter of `bytes` (the full buffer:
// a flat ring, NVLink inside a node, the network once it spans nodes) and of an all-reduce
// (hierarchical: inside the node, then across nodes on 1/g of the buffer per NIC).
int plan_group_per_node(const Cluster *c, int n, int stride);
double plan_all_gather_s(const Cluster *c, int n, int stride, double bytes);
double plan_all_reduce_s(const Cluster *c, int n, int stride, double bytes);

// Context parallel's cost per block and micro-batch on one rank, by p->cp_impl: the waits it adds
// to the forward and to the backward (transfers not hidden behind compute; full recompute adds the
// forward's again), and the element-wise time of merging the blocks' partial outputs (forward,
// repeated by recompute) and of summing their gradients in fp32 (backward). t_attn: the rank's
// attention time in the block's forward, cp blocks of equal work (load-balanced). All 0 at cp 1.
typedef struct {
    double fwd_wait, bwd_wait, fwd_merge, bwd_merge;
} CpCost;
CpCost plan_cp_costs(const PlanConfig *p, const Cluster *c, double t_attn);
