#include "reference_cpu/config.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "reference_cpu/real.h"

const char *const MODEL_CONFIG_NAMES = "tiny|small|llama3_1b|llama3_8b|llama3_70b|llama3_405b|llama2_7b";

typedef struct {
    const char *name;
    int dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, max_seq_len;
    bool tied;
    double rope_scaling_factor;
    double rope_theta;  // 0: Llama 3's 500000
} NamedConfig;

// tiny: for tests, divisible enough for tp 4, pp 2 x 2 virtual stages, cp 2 (seq 32 = 4 chunks of 8).
// small: the CPU demo, 10.5M parameters, byte-level vocabulary (256) so text files train as is. The llama3_* entries are the published shapes (Llama 3.2 1B
// ties its output projection; 3.1 models use RoPE scaling for their 128K context).
static const NamedConfig NAMED_CONFIGS[] = {
    {"tiny", 64, 4, 8, 4, 128, 256, 32, false, 0, 0},
    {"small", 384, 6, 6, 2, 1152, 256, 256, false, 0, 0},
    {"llama3_1b", 2048, 16, 32, 8, 8192, 128256, 8192, true, 32, 0},
    {"llama3_8b", 4096, 32, 32, 8, 14336, 128256, 8192, false, 8, 0},
    {"llama3_70b", 8192, 80, 64, 8, 28672, 128256, 8192, false, 8, 0},
    {"llama3_405b", 16384, 126, 128, 8, 53248, 128256, 8192, false, 8, 0},
    // Llama 2 7B (multi-head attention, 32K vocabulary, 4K context, RoPE base 10000): the model of
    // the IBM/Meta FSDP throughput run chapter 11 predicts.
    {"llama2_7b", 4096, 32, 32, 32, 11008, 32000, 4096, false, 0, 10000.0},
};

bool model_config_lookup(const char *name, ModelConfig *out) {
    for (size_t i = 0; i < sizeof NAMED_CONFIGS / sizeof NAMED_CONFIGS[0]; i++) {
        const NamedConfig *n = &NAMED_CONFIGS[i];
        if (strcmp(n->name, name) != 0) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "%s", n->name);
        out->dim = n->dim;
        out->n_layers = n->n_layers;
        out->n_heads = n->n_heads;
        out->n_kv_heads = n->n_kv_heads;
        out->ffn_dim = n->ffn_dim;
        out->vocab_size = n->vocab_size;
        out->max_seq_len = n->max_seq_len;
        out->norm_eps = 1e-5;
        out->rope_theta = n->rope_theta ? n->rope_theta : 500000.0;
        out->tied = n->tied;
        out->rope_scaling_factor = n->rope_scaling_factor;
        out->rope_low_freq_factor = 1.0;
        out->rope_high_freq_factor = 4.0;
        out->rope_original_max_seq_len = 8192;
        return true;
    }
    return false;
}

void model_config_validate(const ModelConfig *c, int seq_len) {
    if (c->dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->ffn_dim <= 0)
        fatal_input("model %s: dim, layers, heads, kv heads and ffn dim must be positive", c->name);
    if (c->dim % c->n_heads != 0)
        fatal_input("model %s: n_heads=%d must divide dim=%d", c->name, c->n_heads, c->dim);
    if (c->n_heads % c->n_kv_heads != 0)
        fatal_input("model %s: n_kv_heads=%d must divide n_heads=%d", c->name, c->n_kv_heads, c->n_heads);
    if (model_head_dim(c) % 2 != 0)
        fatal_input("model %s: head_dim=%d must be even for RoPE", c->name, model_head_dim(c));
    if (c->vocab_size < 2) fatal_input("model %s: vocab_size=%d must be at least 2", c->name, c->vocab_size);
    if (seq_len < 1) fatal_input("--seq-len %d: must be at least 1", seq_len);
    if (!(c->rope_theta > 0)) fatal_input("--rope-theta %g: must be positive", c->rope_theta);
    if (!(c->norm_eps > 0)) fatal_input("model %s: norm_eps %g must be positive", c->name, c->norm_eps);
}

int model_head_dim(const ModelConfig *c) { return c->dim / c->n_heads; }

size_t model_param_count_non_embedding(const ModelConfig *c) {
    size_t h = (size_t)c->dim, hq = (size_t)c->n_heads * model_head_dim(c);
    size_t hkv = (size_t)c->n_kv_heads * model_head_dim(c), f = (size_t)c->ffn_dim;
    size_t per_layer = 2 * h            // attention_norm, ffn_norm
                       + hq * h * 2     // wq, wo
                       + hkv * h * 2    // wk, wv
                       + f * h * 3;     // w1, w2, w3
    return per_layer * (size_t)c->n_layers + h;  // + final norm
}

size_t model_param_count(const ModelConfig *c) {
    size_t embedding = (size_t)c->vocab_size * c->dim;
    return model_param_count_non_embedding(c) + embedding * (c->tied ? 1 : 2);
}

uint64_t model_plan_bytes(const ModelConfig *c, uint64_t micro, uint64_t seq_len, const ModelSplit *split) {
    uint64_t h = (uint64_t)c->dim, hd = (uint64_t)model_head_dim(c), f = (uint64_t)c->ffn_dim;
    uint64_t hq = mem_mul((uint64_t)c->n_heads, hd), hkv = mem_mul((uint64_t)c->n_kv_heads, hd);
    // the same sum as model_param_count_non_embedding, checked
    uint64_t per_layer = mem_add(mem_add(2 * h, mem_mul(2 * h, hq)), mem_add(mem_mul(2 * h, hkv), mem_mul(3 * h, f)));
    uint64_t params = mem_add(mem_mul(per_layer, (uint64_t)c->n_layers), h);
    params = mem_add(params, mem_mul(mem_mul((uint64_t)c->vocab_size, h), c->tied ? 1 : 2));
    // This rank's parameters: its stage's share of the layers, its tensor-parallel slice. Of their
    // four copies, ZeRO shards AdamW's m and v from stage 1, the gradients from 2, the weights at 3;
    // replicas (DDP, HSDP's replicate dimension) hold whole copies.
    uint64_t local = params / (uint64_t)(split->pp * split->tp), N = (uint64_t)split->shard;
    uint64_t state = mem_add(mem_add(split->zero_stage >= 3 ? local / N : local, split->zero_stage >= 2 ? local / N : local),
                             mem_mul(split->zero_stage >= 1 ? local / N : local, 2));
    // Activations of the last stage's rank (the largest): its tokens (the cp share of the sequence),
    // the residual stream of its layers (split over tp only under sequence parallelism), the logits
    // of its vocabulary slice and their gradient.
    uint64_t tokens = mem_mul(micro, seq_len / (uint64_t)split->cp);
    uint64_t layers = ((uint64_t)c->n_layers + (uint64_t)split->pp - 1) / (uint64_t)split->pp;
    uint64_t residual = mem_mul(mem_mul(tokens, h), layers) / (uint64_t)(split->sequence_parallel ? split->tp : 1);
    uint64_t logits = mem_mul(mem_mul(tokens, (uint64_t)c->vocab_size / (uint64_t)split->tp), 2);
    return mem_mul(mem_add(mem_add(state, residual), logits), sizeof(real));
}

double model_flops_per_token(const ModelConfig *c, int seq_len) {
    // Matmul weights: everything but the norms and the embedding lookup; the output projection
    // always multiplies (tied or not).
    double norms = (double)c->dim * (2.0 * c->n_layers + 1);
    double matmul_params = (double)model_param_count_non_embedding(c) - norms + (double)c->vocab_size * c->dim;
    double hq = (double)c->n_heads * model_head_dim(c);
    return 6.0 * matmul_params + 6.0 * c->n_layers * hq * seq_len;
}

char *model_throughput_text(const ModelConfig *c, int seq_len, double tokens_per_s, int devices, double peak_tflops,
                            char *buf, size_t len) {
    double flops_per_s = tokens_per_s * model_flops_per_token(c, seq_len);
    int n = snprintf(buf, len, " | %.1f GFLOP/s", flops_per_s * 1e-9);
    if (peak_tflops > 0 && devices > 0 && n >= 0 && (size_t)n < len)
        snprintf(buf + n, len - n, " | MFU %.1f%%", 100 * flops_per_s / ((double)devices * peak_tflops * 1e12));
    return buf;
}

double model_block_forward_flops(const ModelConfig *c, int B, int T) {
    double hd = model_head_dim(c), hq = c->n_heads * hd, hkv = c->n_kv_heads * hd;
    double matmul_params = 2 * hq * c->dim + 2 * hkv * c->dim + 3.0 * c->ffn_dim * c->dim;
    return 2.0 * B * T * matmul_params + 2.0 * B * hq * (double)T * T;  // QK^T and PV, causal half
}

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdlib.h>

#include "common/json.h"

#define CONFIG_INT_FIELDS(X) \
    X(dim) X(n_layers) X(n_heads) X(n_kv_heads) X(ffn_dim) X(vocab_size) X(max_seq_len) X(rope_original_max_seq_len)
#define CONFIG_DOUBLE_FIELDS(X) \
    X(norm_eps) X(rope_theta) X(rope_scaling_factor) X(rope_low_freq_factor) X(rope_high_freq_factor)

char *model_config_to_json(const ModelConfig *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", c->name);
#define ADD_FIELD(f) cJSON_AddNumberToObject(o, #f, c->f);
    CONFIG_INT_FIELDS(ADD_FIELD)
    CONFIG_DOUBLE_FIELDS(ADD_FIELD)
#undef ADD_FIELD
    cJSON_AddBoolToObject(o, "tied", c->tied);
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

bool model_config_from_json(const char *json, ModelConfig *out, char *err, size_t err_len) {
    cJSON *o = cJSON_Parse(json);
    if (!cJSON_IsObject(o)) {
        snprintf(err, err_len, "model config is not a JSON object");
        cJSON_Delete(o);
        return false;
    }
    memset(out, 0, sizeof *out);
    const cJSON *item;
    bool ok = true;
#define GET_NUMBER(f)                                                                     \
    item = cJSON_GetObjectItemCaseSensitive(o, #f);                                       \
    if (ok && !cJSON_IsNumber(item)) {                                                    \
        snprintf(err, err_len, "model config: field \"%s\" missing or not a number", #f); \
        ok = false;                                                                       \
    }
#define GET_DOUBLE_FIELD(f) \
    GET_NUMBER(f)           \
    if (ok) out->f = item->valuedouble;
    // an int field must hold an int, checked as a double before the conversion (2.5 would become 2,
    // and converting 1e20 to int is undefined)
#define GET_INT_FIELD(f)                                                                                   \
    GET_NUMBER(f)                                                                                          \
    if (ok && !whole_number_in(item->valuedouble, INT_MIN, INT_MAX)) {                                     \
        snprintf(err, err_len, "model config: field \"%s\" = %g is not a whole number that fits an int", #f, \
                 item->valuedouble);                                                                       \
        ok = false;                                                                                        \
    }                                                                                                      \
    if (ok) out->f = (int)item->valuedouble;
    CONFIG_INT_FIELDS(GET_INT_FIELD)
    CONFIG_DOUBLE_FIELDS(GET_DOUBLE_FIELD)
#undef GET_INT_FIELD
#undef GET_DOUBLE_FIELD
#undef GET_NUMBER
    item = cJSON_GetObjectItemCaseSensitive(o, "tied");
    if (ok && !cJSON_IsBool(item)) {
        snprintf(err, err_len, "model config: field \"tied\" missing or not a boolean");
        ok = false;
    }
    if (ok) out->tied = cJSON_IsTrue(item);
    item = cJSON_GetObjectItemCaseSensitive(o, "name");
    snprintf(out->name, sizeof out->name, "%s", cJSON_IsString(item) ? item->valuestring : "custom");
    cJSON_Delete(o);
    return ok;
}

bool model_config_same_shape(const ModelConfig *a, const ModelConfig *b, char *diff, size_t diff_len) {
    // the first field that differs, in the order of the JSON
#define SAME_FIELD(f)                                                                    \
    if (a->f != b->f) {                                                                  \
        snprintf(diff, diff_len, "%s %.10g vs %.10g", #f, (double)a->f, (double)b->f);   \
        return false;                                                                    \
    }
    CONFIG_INT_FIELDS(SAME_FIELD)
    CONFIG_DOUBLE_FIELDS(SAME_FIELD)
    SAME_FIELD(tied)
#undef SAME_FIELD
    return true;
}
