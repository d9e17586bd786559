// config.h: model shapes. The named configs and the formulas that depend only on shapes:
// parameter count and training FLOPs per token (used for MFU by later chapters).
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    char name[32];
    int dim;           // model width h
    int n_layers;      // L
    int n_heads;       // query heads
    int n_kv_heads;    // key/value heads (GQA: n_heads % n_kv_heads == 0)
    int ffn_dim;       // SwiGLU hidden size
    int vocab_size;
    int max_seq_len;   // default --seq-len and RoPE table length
    double norm_eps;   // RMSNorm epsilon, 1e-5
    double rope_theta; // 500000 for Llama 3
    bool tied;         // output projection shares tok_embeddings (Llama 3.2 1B/3B)
    // Llama 3.1 RoPE frequency scaling (off when rope_scaling_factor == 0)
    double rope_scaling_factor;       // 8
    double rope_low_freq_factor;      // 1
    double rope_high_freq_factor;     // 4
    int rope_original_max_seq_len;    // 8192
} ModelConfig;

// Looks up tiny, small, llama3_1b, llama3_8b, llama3_70b, llama3_405b, llama2_7b. Returns false if unknown.
bool model_config_lookup(const char *name, ModelConfig *out);
extern const char *const MODEL_CONFIG_NAMES;  // "tiny|small|llama3_1b|..." for the flag table

// Exits with status 2 and one line if the shapes are inconsistent (heads not dividing dim, ...).
void model_config_validate(const ModelConfig *c, int seq_len);

int model_head_dim(const ModelConfig *c);
// Every parameter, embedding and output projection included (output counted once when tied).
size_t model_param_count(const ModelConfig *c);
size_t model_param_count_non_embedding(const ModelConfig *c);
// How a layout splits the model over ranks, for model_plan_bytes: pipeline stages, tensor-parallel
// ranks (with sequence parallelism or not), context-parallel ranks, and ZeRO's shard group
// (dp_shard x cp) with its stage (0 without one). Replicas split nothing.
typedef struct {
    int pp, tp, cp, shard, zero_stage;
    bool sequence_parallel;
} ModelSplit;
// A lower bound of the bytes the largest process allocates to train c on micro-batches of (micro,
// seq_len) in that layout (all 1, stage 0: alone): four copies of its parameters (weights,
// gradients, AdamW m and v; ZeRO's shards), the residual stream every block keeps for backward
// (under every --ac), and the logits with their gradient. In checked 64-bit arithmetic (mem_mul):
// UINT64_MAX when it does not fit. The trainer hands it to mem_check_plan() before allocating.
uint64_t model_plan_bytes(const ModelConfig *c, uint64_t micro, uint64_t seq_len, const ModelSplit *split);
// Training (forward + backward) FLOPs per token at sequence length seq_len:
//   6 * N + 6 * L * h_q * seq_len
// where N counts every weight that takes part in a matmul (the embedding lookup does not; the
// output projection does) and the second term is QK^T and PV: 2 matmuls, 2*seq*h_q each forward,
// x3 for forward+backward, halved because the causal mask skips the upper triangle.
// h_q = n_heads * head_dim. See chapters/00_reference/README.md for the derivation.
double model_flops_per_token(const ModelConfig *c, int seq_len);
// The trainer's throughput figure for its log line: " | X GFLOP/s" of model FLOPs at tokens_per_s
// (the whole job's), and " | MFU Y%" when peak_tflops > 0: gpu/mfu.h's definition, per device,
// so the job's FLOP rate over `devices` x the peak of one (recomputation is not credited).
// Written into buf (len bytes); returns buf.
char *model_throughput_text(const ModelConfig *c, int seq_len, double tokens_per_s, int devices, double peak_tflops,
                            char *buf, size_t len);
// Forward FLOPs of one transformer block on B sequences of T tokens (matmuls and causal attention);
// its backward costs twice that. Trace slices carry these as their "flops" argument.
double model_block_forward_flops(const ModelConfig *c, int B, int T);

// JSON form of the config, stored in checkpoints and dumps. The string is malloc'd.
char *model_config_to_json(const ModelConfig *c);
// Fills out from JSON; false with a message in err if a field is missing or has the wrong type.
bool model_config_from_json(const char *json, ModelConfig *out, char *err, size_t err_len);
// True when the shapes and numerics-relevant fields agree (the name may differ); otherwise false,
// and diff names the first field that differs with a's value first ("n_layers 4 vs 8").
bool model_config_same_shape(const ModelConfig *a, const ModelConfig *b, char *diff, size_t diff_len);
