#include "reference_cpu/hf.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/json.h"
#include "common/log.h"

#define HF_CONFIG "config.json"
#define HF_SINGLE "model.safetensors"
#define HF_INDEX "model.safetensors.index.json"

// ---- names -----------------------------------------------------------------------------------

static const struct {
    const char *ours, *hf;
} LAYER_NAMES[] = {
    {"attention_norm.weight", "input_layernorm.weight"},
    {"attention.wq.weight", "self_attn.q_proj.weight"},
    {"attention.wk.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w2.weight", "mlp.down_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},
}, TOP_NAMES[] = {
    {"tok_embeddings.weight", "model.embed_tokens.weight"},
    {"norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

bool hf_name(const char *table_name, char *out, size_t out_len) {
    for (size_t i = 0; i < COUNT(TOP_NAMES); i++)
        if (strcmp(table_name, TOP_NAMES[i].ours) == 0) return snprintf(out, out_len, "%s", TOP_NAMES[i].hf) < (int)out_len;
    int layer, used = 0;
    if (sscanf(table_name, "layers.%d.%n", &layer, &used) != 1 || used == 0) return false;
    for (size_t i = 0; i < COUNT(LAYER_NAMES); i++)
        if (strcmp(table_name + used, LAYER_NAMES[i].ours) == 0)
            return snprintf(out, out_len, "model.layers.%d.%s", layer, LAYER_NAMES[i].hf) < (int)out_len;
    return false;
}

// wq and wk: their rows are permuted between the two RoPE layouts (see hf.h).
static bool has_rope_rows(const char *table_name) {
    size_t n = strlen(table_name);
    return n > 19 && (strcmp(table_name + n - 19, "attention.wq.weight") == 0 ||
                      strcmp(table_name + n - 19, "attention.wk.weight") == 0);
}

// Our row r of a q or k projection -> HF's row: within each head, pair element 2i + j sits at j*hd/2 + i.
static size_t hf_rope_row(size_t r, int head_dim) {
    size_t head = r / (size_t)head_dim, within = r % (size_t)head_dim, half = (size_t)head_dim / 2;
    return head * (size_t)head_dim + (within % 2) * half + within / 2;
}

// ---- config.json -----------------------------------------------------------------------------

static const cJSON *config_item(const cJSON *o, const char *key, const char *path, bool required) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!item && required) fatal_input("%s: missing key \"%s\"", path, key);
    if (item && !cJSON_IsNumber(item) && !cJSON_IsBool(item) && !cJSON_IsString(item) && !cJSON_IsNull(item) &&
        !cJSON_IsObject(item))
        fatal_input("%s: key \"%s\" has an unexpected type", path, key);
    return item;
}

static double config_number(const cJSON *o, const char *key, const char *path, bool required, double fallback) {
    const cJSON *item = config_item(o, key, path, required);
    if (!item || (!required && cJSON_IsNull(item))) return fallback;  // null: the default, as in LlamaConfig
    if (!cJSON_IsNumber(item)) fatal_input("%s: key \"%s\" is not a number", path, key);
    return item->valuedouble;
}

static int config_int(const cJSON *o, const char *key, const char *path, bool required, int fallback) {
    double v = config_number(o, key, path, required, fallback);
    if (!whole_number_in(v, 1, INT_MAX))
        fatal_input("%s: key \"%s\" = %g is not a positive integer up to %d", path, key, v, INT_MAX);
    return (int)v;
}

// A key this reference has no code for must, if present, hold the value it implements.
static void config_expect_string(const cJSON *o, const char *key, const char *want, const char *path) {
    const cJSON *item = config_item(o, key, path, false);
    if (item && !(cJSON_IsString(item) && strcmp(item->valuestring, want) == 0))
        fatal_input("%s: \"%s\" must be \"%s\" (this reference implements only that)", path, key, want);
}

static void config_expect_false(const cJSON *o, const char *key, const char *path) {
    const cJSON *item = config_item(o, key, path, false);
    if (item && !cJSON_IsFalse(item)) fatal_input("%s: \"%s\" must be false (this reference has no biases)", path, key);
}

static void config_expect_zero(const cJSON *o, const char *key, const char *path) {
    const cJSON *item = config_item(o, key, path, false);
    if (item && !(cJSON_IsNumber(item) && item->valuedouble == 0))
        fatal_input("%s: \"%s\" must be 0 (this reference has no dropout)", path, key);
}

// rope_scaling: null/absent, or Llama 3.1's "llama3" frequency scaling.
static void config_rope_scaling(const cJSON *o, const char *path, ModelConfig *cfg) {
    const cJSON *rs = config_item(o, "rope_scaling", path, false);
    if (!rs || cJSON_IsNull(rs)) return;
    if (!cJSON_IsObject(rs)) fatal_input("%s: \"rope_scaling\" is not an object", path);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!type) type = cJSON_GetObjectItemCaseSensitive(rs, "type");  // older files' spelling
    if (!cJSON_IsString(type)) fatal_input("%s: rope_scaling has no \"rope_type\"", path);
    if (strcmp(type->valuestring, "default") == 0) return;
    if (strcmp(type->valuestring, "llama3") != 0)
        fatal_input("%s: unsupported rope_scaling type \"%s\" (supported: llama3, default)", path, type->valuestring);
    char where[4200];
    snprintf(where, sizeof where, "%s: rope_scaling", path);
    cfg->rope_scaling_factor = config_number(rs, "factor", where, true, 0);
    cfg->rope_low_freq_factor = config_number(rs, "low_freq_factor", where, true, 0);
    cfg->rope_high_freq_factor = config_number(rs, "high_freq_factor", where, true, 0);
    cfg->rope_original_max_seq_len = config_int(rs, "original_max_position_embeddings", where, true, 0);
    if (cfg->rope_scaling_factor <= 0 || cfg->rope_high_freq_factor <= cfg->rope_low_freq_factor)
        fatal_input("%s: rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor", path);
}

// dir/config.json parsed (its path into path); exits 2 with one line if it is not a JSON object.
static cJSON *config_json(const char *dir, char path[4096]) {
    char err[4200];
    snprintf(path, 4096, "%s/%s", dir, HF_CONFIG);
    size_t size;
    char *text = (char *)read_whole_file(path, &size, err, sizeof err);
    if (!text) fatal_input("%s", err);
    cJSON *o = cJSON_ParseWithLength(text, size);
    free(text);
    if (!cJSON_IsObject(o)) fatal_input("%s: not a JSON object", path);
    return o;
}

static void read_config(const char *dir, ModelConfig *cfg) {
    char path[4096];
    cJSON *o = config_json(dir, path);
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->name, sizeof cfg->name, "hf");
    cfg->dim = config_int(o, "hidden_size", path, true, 0);
    cfg->n_layers = config_int(o, "num_hidden_layers", path, true, 0);
    cfg->n_heads = config_int(o, "num_attention_heads", path, true, 0);
    cfg->n_kv_heads = config_int(o, "num_key_value_heads", path, false, cfg->n_heads);  // HF's default: no GQA
    cfg->ffn_dim = config_int(o, "intermediate_size", path, true, 0);
    cfg->vocab_size = config_int(o, "vocab_size", path, true, 0);
    cfg->max_seq_len = config_int(o, "max_position_embeddings", path, true, 0);
    cfg->norm_eps = config_number(o, "rms_norm_eps", path, true, 0);
    cfg->rope_theta = config_number(o, "rope_theta", path, false, 10000.0);  // LlamaConfig's default
    // checked here, where the file can be named: a negative epsilon makes RMSNorm's square root NaN
    if (!(cfg->norm_eps > 0) || !isfinite(cfg->norm_eps))
        fatal_input("%s: \"rms_norm_eps\" %g must be positive", path, cfg->norm_eps);
    if (!(cfg->rope_theta > 0) || !isfinite(cfg->rope_theta))
        fatal_input("%s: \"rope_theta\" %g must be positive", path, cfg->rope_theta);
    const cJSON *tied = config_item(o, "tie_word_embeddings", path, false);
    if (tied && !cJSON_IsBool(tied)) fatal_input("%s: \"tie_word_embeddings\" is not a boolean", path);
    cfg->tied = tied && cJSON_IsTrue(tied);  // LlamaConfig's default: false
    config_expect_string(o, "model_type", "llama", path);
    config_expect_string(o, "hidden_act", "silu", path);
    config_expect_false(o, "attention_bias", path);
    config_expect_false(o, "mlp_bias", path);
    config_expect_zero(o, "attention_dropout", path);
    if (cfg->dim % cfg->n_heads == 0) {
        int head_dim = config_int(o, "head_dim", path, false, cfg->dim / cfg->n_heads);
        if (head_dim != cfg->dim / cfg->n_heads)
            fatal_input("%s: head_dim %d is not hidden_size / num_attention_heads = %d", path, head_dim,
                        cfg->dim / cfg->n_heads);
    }
    config_rope_scaling(o, path, cfg);
    cJSON_Delete(o);
    model_config_validate(cfg, 1);
}

// ---- the tensor files ------------------------------------------------------------------------

typedef struct {
    char name[PARAM_NAME_MAX];  // the table's name
    const StFile *file;
    const StTensor *tensor;
    bool rope_rows;
} HfEntry;

struct HfCheckpoint {
    ModelConfig cfg;
    StFile **files;
    int n_files;
    HfEntry *entries;  // one per table entry, in table order
    int n_entries;
    cJSON *weight_map;  // the index's {tensor: shard file}, NULL for a single file
};

static bool file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static StFile *open_shard(const char *dir, const char *file, const char *named_by) {
    char path[4096], err[4400];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (!file_exists(path)) fatal_input("%s: shard '%s' is missing", named_by, file);
    StFile *f = st_open_header(path, err, sizeof err);
    if (!f) fatal_input("%s", err);
    return f;
}

// The opened shard named `file` (NULL: not opened yet).
static StFile *index_shard(const HfCheckpoint *h, const char *dir, const char *file) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    for (int i = 0; i < h->n_files; i++)
        if (strcmp(st_path(h->files[i]), path) == 0) return h->files[i];
    return NULL;
}

// The index's weight_map names the file of each tensor: open each distinct file once.
static void open_index(HfCheckpoint *h, const char *dir, const char *index_path) {
    char err[4200];
    size_t size;
    char *text = (char *)read_whole_file(index_path, &size, err, sizeof err);
    if (!text) fatal_input("%s", err);
    cJSON *o = cJSON_ParseWithLength(text, size);
    free(text);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(o, "weight_map");
    if (!cJSON_IsObject(map)) fatal_input("%s: no \"weight_map\" object", index_path);
    const cJSON *item;
    cJSON_ArrayForEach(item, map) {
        if (!cJSON_IsString(item)) fatal_input("%s: weight_map[\"%s\"] is not a file name", index_path, item->string);
        if (!*item->valuestring) fatal_input("%s: weight_map[\"%s\"] is an empty file name", index_path, item->string);
        if (strchr(item->valuestring, '/')) fatal_input("%s: shard name '%s' has a '/'", index_path, item->valuestring);
        if (index_shard(h, dir, item->valuestring)) continue;
        h->files = realloc(h->files, sizeof *h->files * (size_t)(h->n_files + 1));
        h->files[h->n_files++] = open_shard(dir, item->valuestring, index_path);
    }
    // Every tensor it lists, the model's or not, is where it says (transformers would fail on one that
    // is not; find_tensor checks the model's again, against copies in other shards too)
    cJSON_ArrayForEach(item, map) {
        if (!st_find(index_shard(h, dir, item->valuestring), item->string))
            fatal_input("%s: the weight_map puts tensor '%s' in %s, which does not hold it", index_path, item->string,
                        item->valuestring);
    }
    h->weight_map = cJSON_DetachItemFromObjectCaseSensitive(o, "weight_map");
    cJSON_Delete(o);
}

static bool dtype_supported(StDtype d) { return d == ST_F32 || d == ST_BF16 || d == ST_F16 || d == ST_F64; }

// The one file holding tensor `name` into e (e->tensor NULL: none). A tensor in two shards is refused
// (which copy counts would be the reader's guess), and so is one in another shard than the index
// names: transformers reads each tensor from the shard the index names, so this loader must too.
static void find_tensor(const HfCheckpoint *h, const char *dir, const char *name, HfEntry *e) {
    e->tensor = NULL, e->file = NULL;
    for (int f = 0; f < h->n_files; f++) {
        const StTensor *t = st_find(h->files[f], name);
        if (!t) continue;
        if (e->tensor) fatal_input("%s: tensor '%s' is in both %s and %s", dir, name, st_path(e->file), st_path(h->files[f]));
        e->tensor = t, e->file = h->files[f];
    }
    if (!h->weight_map) return;
    // (open_index found every tensor the weight_map lists in the shard it names, so a tensor listed
    // is there, and the loop above refuses a copy in another shard)
    if (!cJSON_GetObjectItemCaseSensitive(h->weight_map, name))
        fatal_input("%s/%s: the weight_map names no shard for tensor '%s'", dir, HF_INDEX, name);
}

// Finds each table entry's tensor in the files and checks its dtype and shape.
static void match_table(HfCheckpoint *h, const char *dir) {
    ParamTable t = param_table_build(&h->cfg);
    h->entries = calloc((size_t)t.count, sizeof *h->entries);
    h->n_entries = t.count;
    char name[128];
    for (int i = 0; i < t.count; i++) {
        const ParamInfo *p = &t.items[i];
        HfEntry *e = &h->entries[i];
        snprintf(e->name, sizeof e->name, "%s", p->name);
        e->rope_rows = has_rope_rows(p->name);
        if (!hf_name(p->name, name, sizeof name)) fatal("hf: no HF name for '%s'", p->name);
        find_tensor(h, dir, name, e);
        if (!e->tensor) fatal_input("%s: tensor '%s' is missing%s", dir, name, h->cfg.tied ? "" : " (tie_word_embeddings is false)");
        const StTensor *st = e->tensor;
        if (!dtype_supported(st->dtype))
            fatal_input("%s: tensor '%s': dtype %s (supported: F32, BF16, F16, F64)", st_path(e->file), name,
                        st_dtype_name(st->dtype));
        bool same = st->ndim == p->ndim && st->shape[0] == p->shape[0] && (p->ndim == 1 || st->shape[1] == p->shape[1]);
        if (!same) {
            char have[128] = "[", want[64];
            for (int d = 0; d < st->ndim; d++)
                snprintf(have + strlen(have), sizeof have - strlen(have), "%s%" PRId64, d ? ", " : "", st->shape[d]);
            snprintf(want, sizeof want, p->ndim == 1 ? "[%d]" : "[%d, %d]", p->shape[0], p->shape[1]);
            fatal_input("%s: tensor '%s': shape %s], expected %s from config.json", st_path(e->file), name, have, want);
        }
    }
    param_table_free(&t);
    // A layer the config does not have: num_hidden_layers cut short (the model would silently be
    // the first layers only). Other extra tensors (rotary tables of older exports) are ignored.
    for (int f = 0; f < h->n_files; f++)
        for (int i = 0; i < st_count(h->files[f]); i++) {
            const char *tensor = st_tensor(h->files[f], i)->name;
            int layer;
            if (sscanf(tensor, "model.layers.%d.", &layer) == 1 && layer >= h->cfg.n_layers)
                fatal_input("%s: tensor '%s' is a layer beyond config.json's num_hidden_layers %d",
                            st_path(h->files[f]), tensor, h->cfg.n_layers);
            // said, not refused: transformers too ignores it when the config ties the output
            if (h->cfg.tied && strcmp(tensor, "lm_head.weight") == 0)
                log_info("%s: lm_head.weight is not read: config.json ties the output to model.embed_tokens.weight "
                         "(tie_word_embeddings true)", st_path(h->files[f]));
        }
}

HfCheckpoint *hf_open(const char *dir, ModelConfig *cfg) {
    HfCheckpoint *h = calloc(1, sizeof *h);
    read_config(dir, &h->cfg);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, HF_SINGLE);  // transformers looks for this one first
    if (file_exists(path)) {
        h->files = malloc(sizeof *h->files);
        h->files[h->n_files++] = open_shard(dir, HF_SINGLE, dir);
    } else {
        snprintf(path, sizeof path, "%s/%s", dir, HF_INDEX);
        if (!file_exists(path)) fatal_input("%s: neither %s nor %s", dir, HF_SINGLE, HF_INDEX);
        open_index(h, dir, path);
    }
    match_table(h, dir);
    *cfg = h->cfg;
    return h;
}

void hf_close(HfCheckpoint *h) {
    if (!h) return;
    for (int i = 0; i < h->n_files; i++) st_close(h->files[i]);
    free(h->files);
    free(h->entries);
    cJSON_Delete(h->weight_map);
    free(h);
}

// ---- reading ---------------------------------------------------------------------------------

static float half_to_float(uint16_t x) {
    int exponent = (x >> 10) & 0x1f, mantissa = x & 0x3ff;
    float v;
    if (exponent == 0) v = ldexpf((float)mantissa, -24);  // zero and subnormals
    else if (exponent == 31) v = mantissa ? NAN : INFINITY;
    else v = ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (x & 0x8000) ? -v : v;
}

// n elements of dtype at src (unaligned bytes from the file) -> real.
static void convert_to_real(const unsigned char *src, StDtype dtype, size_t n, real *out) {
    for (size_t i = 0; i < n; i++) {
        if (dtype == ST_F32) {
            float v;
            memcpy(&v, src + 4 * i, 4);
            out[i] = (real)v;
        } else if (dtype == ST_F64) {
            double v;
            memcpy(&v, src + 8 * i, 8);
            out[i] = (real)v;
        } else {
            uint16_t b;
            memcpy(&b, src + 2 * i, 2);
            if (dtype == ST_F16) {
                out[i] = (real)half_to_float(b);
            } else {  // bf16: the top half of an fp32
                uint32_t bits = (uint32_t)b << 16;
                float v;
                memcpy(&v, &bits, 4);
                out[i] = (real)v;
            }
        }
    }
}

// Elements [first, first + n) of the tensor as stored in the file -> out.
static void read_elements(const HfEntry *e, size_t first, size_t n, unsigned char *scratch, real *out) {
    size_t es = st_dtype_size(e->tensor->dtype);
    char err[4400];
    if (!st_read_bytes(e->file, e->tensor, first * es, n * es, scratch, err, sizeof err)) fatal("hf: %s", err);
    convert_to_real(scratch, e->tensor->dtype, n, out);
    // A NaN or inf weight would only show as a NaN loss at step 1, blamed on the learning rate.
    for (size_t i = 0; i < n; i++)
        if (!isfinite(out[i])) {
            char name[PARAM_NAME_MAX + 32];  // the file's name for it
            if (!hf_name(e->name, name, sizeof name)) snprintf(name, sizeof name, "%s", e->name);
            // Only the rank that reads this slice sees it (--pp, --tp, --dp-shard split the reads).
            fatal_input_local("%s: tensor '%s' holds %s at element %zu (not a finite weight)", st_path(e->file), name,
                        isnan(out[i]) ? "NaN" : "an infinity", first + i);
        }
}

static const HfEntry *find_entry(const HfCheckpoint *h, const char *name) {
    for (int i = 0; i < h->n_entries; i++)
        if (strcmp(h->entries[i].name, name) == 0) return &h->entries[i];
    fatal("hf: '%s' is not a tensor of this checkpoint", name);
}

#define READ_CHUNK ((size_t)1 << 20)  // elements per read where the slice is contiguous in the file

void hf_read_local_range(const HfCheckpoint *h, const ParamInfo *p, int tp_rank, int tp_size, size_t first,
                         size_t count, real *out) {
    const HfEntry *e = find_entry(h, p->name);
    if (first > p->numel || count > p->numel - first) fatal("hf: range past the end of '%s'", p->name);
    size_t es = st_dtype_size(e->tensor->dtype);
    // Local shape as rows x cols (a vector is one row); the full tensor has tp_size times the split dim.
    size_t rows = p->ndim == 2 ? (size_t)p->shape[0] : 1, cols = p->ndim == 2 ? (size_t)p->shape[1] : (size_t)p->shape[0];
    size_t full_cols = p->tp_split == TP_COLS ? cols * (size_t)tp_size : cols;
    if (!e->rope_rows && p->tp_split != TP_COLS) {
        // The slice is one contiguous range of the file's tensor: a row shard starts at tp_rank * numel.
        size_t base = p->tp_split == TP_ROWS ? (size_t)tp_rank * p->numel : 0;
        unsigned char *scratch = malloc((count < READ_CHUNK ? count : READ_CHUNK) * es + 1);
        for (size_t done = 0; done < count; done += READ_CHUNK) {
            size_t n = count - done < READ_CHUNK ? count - done : READ_CHUNK;
            read_elements(e, base + first + done, n, scratch, out + done);
        }
        free(scratch);
        return;
    }
    // Otherwise row by row: a column shard takes a piece of every row, and q/k rows come from
    // their permuted place.
    unsigned char *scratch = malloc(cols * es);
    int head_dim = model_head_dim(&h->cfg);
    for (size_t done = 0; done < count;) {
        size_t local = first + done, row = local / cols, col = local % cols;
        size_t run = cols - col < count - done ? cols - col : count - done;  // to the end of the row
        size_t full_row = p->tp_split == TP_ROWS ? (size_t)tp_rank * rows + row : row;
        size_t full_col = p->tp_split == TP_COLS ? (size_t)tp_rank * cols + col : col;
        if (e->rope_rows) full_row = hf_rope_row(full_row, head_dim);
        read_elements(e, full_row * full_cols + full_col, run, scratch, out + done);
        done += run;
    }
    free(scratch);
}

static void fill_from_checkpoint(const ParamSource *src, const ParamInfo *p, int tp_rank, int tp_size, size_t first,
                                 size_t count, real *out) {
    hf_read_local_range(src->ctx, p, tp_rank, tp_size, first, count, out);
}

ParamSource hf_param_source(const HfCheckpoint *h) { return (ParamSource){fill_from_checkpoint, 0, h}; }

void hf_read_all(const HfCheckpoint *h, const ParamTable *t, real *flat) {
    for (int i = 0; i < t->count; i++) hf_read_local_range(h, &t->items[i], 0, 1, 0, t->items[i].numel, flat + t->items[i].offset);
}

// ---- export ----------------------------------------------------------------------------------

static void write_text_file(const char *path, const char *text) {
    AtomicFile f;
    char err[4400];
    if (!atomic_create(&f, path, err, sizeof err)) fatal_input("HF export: %s", err);
    fputs(text, f.fp);
    if (!atomic_commit(&f, err, sizeof err)) fatal("HF export: %s", err);
}

// A JSON number that reads back as a float: transformers warns when rope_scaling's factors are
// integers ("factor field must be a float"), and cJSON prints 8.0 as 8.
static void add_float(cJSON *o, const char *key, double v) {
    char text[40];
    snprintf(text, sizeof text, "%.17g", v);
    if (!strpbrk(text, ".eEn")) strcat(text, ".0");
    cJSON_AddRawToObject(o, key, text);
}

char *hf_token_ids_json(const char *dir) {
    static const char *const keys[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    char path[4096];
    cJSON *o = config_json(dir, path), *ids = cJSON_CreateObject();
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const cJSON *item = cJSON_GetObjectItemCaseSensitive(o, keys[i]);
        if (item && !cJSON_IsNull(item)) cJSON_AddItemToObject(ids, keys[i], cJSON_Duplicate(item, true));
    }
    char *out = ids->child ? cJSON_PrintUnformatted(ids) : NULL;
    cJSON_Delete(ids);
    cJSON_Delete(o);
    return out;
}

static void write_config(const char *dir, const ModelConfig *cfg, StDtype dtype, const char *token_ids_json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(arch, cJSON_CreateString("LlamaForCausalLM"));
    cJSON_AddStringToObject(o, "model_type", "llama");
    cJSON_AddNumberToObject(o, "hidden_size", cfg->dim);
    cJSON_AddNumberToObject(o, "num_hidden_layers", cfg->n_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", cfg->n_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", cfg->n_kv_heads);
    cJSON_AddNumberToObject(o, "head_dim", model_head_dim(cfg));
    cJSON_AddNumberToObject(o, "intermediate_size", cfg->ffn_dim);
    cJSON_AddNumberToObject(o, "vocab_size", cfg->vocab_size);
    cJSON_AddNumberToObject(o, "max_position_embeddings", cfg->max_seq_len);
    cJSON_AddNumberToObject(o, "rms_norm_eps", cfg->norm_eps);
    cJSON_AddNumberToObject(o, "rope_theta", cfg->rope_theta);
    if (cfg->rope_scaling_factor > 0) {
        cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
        cJSON_AddStringToObject(rs, "rope_type", "llama3");
        add_float(rs, "factor", cfg->rope_scaling_factor);
        add_float(rs, "low_freq_factor", cfg->rope_low_freq_factor);
        add_float(rs, "high_freq_factor", cfg->rope_high_freq_factor);
        cJSON_AddNumberToObject(rs, "original_max_position_embeddings", cfg->rope_original_max_seq_len);
    } else {
        cJSON_AddNullToObject(o, "rope_scaling");
    }
    cJSON_AddBoolToObject(o, "tie_word_embeddings", cfg->tied);
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddBoolToObject(o, "attention_bias", false);
    cJSON_AddBoolToObject(o, "mlp_bias", false);
    cJSON_AddStringToObject(o, "torch_dtype", dtype == ST_F64 ? "float64" : "float32");
    cJSON *ids = token_ids_json ? cJSON_Parse(token_ids_json) : NULL;
    for (const cJSON *id = ids ? ids->child : NULL; id; id = id->next)
        cJSON_AddItemToObject(o, id->string, cJSON_Duplicate(id, true));
    cJSON_Delete(ids);
    char *text = cJSON_Print(o), path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, HF_CONFIG);
    write_text_file(path, text);
    free(text);
    cJSON_Delete(o);
}

// One tensor in HF's layout and dtype (malloc'd).
static void *hf_layout(const ParamInfo *p, const real *flat, StDtype dtype, int head_dim) {
    size_t cols = p->ndim == 2 ? (size_t)p->shape[1] : p->numel;
    bool rope_rows = has_rope_rows(p->name);
    void *buf = malloc(p->numel * st_dtype_size(dtype) + 1);
    for (size_t i = 0; i < p->numel; i++) {
        size_t row = i / cols, col = i % cols;
        size_t dst = (rope_rows ? hf_rope_row(row, head_dim) : row) * cols + col;
        real v = flat[p->offset + i];
        if (dtype == ST_F64) ((double *)buf)[dst] = (double)v;
        else ((float *)buf)[dst] = (float)v;
    }
    return buf;
}

static void shard_name(char *out, size_t len, int shard, int n_shards) {
    if (n_shards == 1) snprintf(out, len, "%s", HF_SINGLE);
    else snprintf(out, len, "model-%05d-of-%05d.safetensors", shard + 1, n_shards);
}

static void write_shard(const char *dir, const ParamTable *t, const int *shard_of, int shard, int n_shards,
                        const real *flat, StDtype dtype, int head_dim) {
    StWriter *w = st_writer_new();
    void **bufs = calloc((size_t)t->count, sizeof *bufs);
    char name[128], err[4400], file[64], path[4200];
    for (int i = 0; i < t->count; i++) {
        if (shard_of[i] != shard) continue;
        const ParamInfo *p = &t->items[i];
        bufs[i] = hf_layout(p, flat, dtype, head_dim);
        int64_t shape[2] = {p->shape[0], p->shape[1]};
        hf_name(p->name, name, sizeof name);
        if (!st_writer_add(w, name, dtype, p->ndim, shape, bufs[i], err, sizeof err)) fatal("HF export: %s", err);
    }
    // transformers refuses a safetensors file whose metadata does not name its framework.
    if (!st_writer_add_metadata(w, "format", "pt", err, sizeof err)) fatal("HF export: %s", err);
    shard_name(file, sizeof file, shard, n_shards);
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (!st_write(w, path, err, sizeof err)) fatal("HF export: %s", err);
    st_writer_free(w);
    for (int i = 0; i < t->count; i++) free(bufs[i]);
    free(bufs);
}

static void write_index(const char *dir, const ParamTable *t, const int *shard_of, int n_shards, StDtype dtype) {
    cJSON *o = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(o, "metadata");
    cJSON_AddNumberToObject(meta, "total_size", (double)(t->total_numel * st_dtype_size(dtype)));
    cJSON *map = cJSON_AddObjectToObject(o, "weight_map");
    char name[128], file[64], path[4200];
    for (int i = 0; i < t->count; i++) {
        hf_name(t->items[i].name, name, sizeof name);
        shard_name(file, sizeof file, shard_of[i], n_shards);
        cJSON_AddStringToObject(map, name, file);
    }
    char *text = cJSON_Print(o);
    snprintf(path, sizeof path, "%s/%s", dir, HF_INDEX);
    write_text_file(path, text);
    free(text);
    cJSON_Delete(o);
}

// Tensors go to shards in table order; a shard is closed when the next tensor would overflow it.
// shard_of (t->count) gets each tensor's shard; returns the number of shards.
static int assign_shards(const ParamTable *t, StDtype dtype, size_t max_shard_bytes, int *shard_of) {
    int shard = 0;
    size_t in_shard = 0;
    for (int i = 0; i < t->count; i++) {
        size_t bytes = t->items[i].numel * st_dtype_size(dtype);
        if (in_shard > 0 && in_shard + bytes > max_shard_bytes) shard++, in_shard = 0;
        if (shard_of) shard_of[i] = shard;
        in_shard += bytes;
    }
    return shard + 1;
}

// transformers reads model.safetensors first, the index otherwise: an export removes whichever of
// the two an earlier export left in dir that it does not write itself.
static void stale_path(char *out, size_t len, const char *dir, int n_shards) {
    snprintf(out, len, "%s/%s", dir, n_shards == 1 ? HF_INDEX : HF_SINGLE);
}

// Whether name is a shard of an earlier export with another shard count (model-00001-of-00004.safetensors
// beside a new -of-00003 set, or any beside a single file; canonical names only): no index names it
// once this export is complete.
static bool other_shard(const char *name, int n_shards) {
    int shard, of, consumed = 0;
    if (sscanf(name, "model-%5d-of-%5d.safetensors%n", &shard, &of, &consumed) != 2 || name[consumed] != 0) return false;
    char canonical[64];
    snprintf(canonical, sizeof canonical, "model-%05d-of-%05d.safetensors", shard, of);
    return strcmp(canonical, name) == 0 && (n_shards == 1 || of != n_shards);
}

// A file the export will remove once complete must be a regular file that is not read-only (a
// read-only file is kept from being replaced, so from being removed too).
static void check_removable(const char *dir, const char *name) {
    char path[4200];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (lstat(path, &st) != 0) return;
    if (!S_ISREG(st.st_mode))
        fatal_input("HF export %s: %s is not a regular file, and this export would remove it", dir, path);
    if (!(st.st_mode & 0222)) fatal_input("HF export %s: %s is read-only, and this export would remove it", dir, path);
}

void hf_export_check(const char *dir, const ModelConfig *cfg, StDtype dtype, size_t max_shard_bytes) {
    ParamTable t = param_table_build(cfg);
    int n_shards = assign_shards(&t, dtype, max_shard_bytes, NULL);
    param_table_free(&t);
    char path[4200], file[64];
    struct stat st;
    // A directory the export will make (fileio_check_output checked that its parent takes it) holds
    // nothing to replace: only the names are checked.
    bool dir_exists = stat(dir, &st) == 0;
    for (int s = 0; s < n_shards + 2; s++) {  // the shards, then the index (if any) and config.json
        if (s == n_shards && n_shards == 1) continue;
        if (s < n_shards) shard_name(file, sizeof file, s, n_shards);
        snprintf(path, sizeof path, "%s/%s", dir, s < n_shards ? file : s == n_shards ? HF_INDEX : "config.json");
        if (dir_exists) fileio_check_output("export-hf", path, OUTPUT_FILE);
        else fileio_check_output_name("export-hf", path, OUTPUT_FILE);
    }
    stale_path(path, sizeof path, dir, n_shards);
    check_removable(dir, strrchr(path, '/') + 1);
    DIR *d = dir_exists ? opendir(dir) : NULL;
    for (struct dirent *e; d && (e = readdir(d));)
        if (other_shard(e->d_name, n_shards)) check_removable(dir, e->d_name);
    if (d) closedir(d);
}

// dir/name removed if it is a regular file (anything else is never touched).
static void remove_regular(const char *dir, const char *name) {
    char path[4200];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (lstat(path, &st) == 0 && S_ISREG(st.st_mode) && unlink(path) != 0)
        fatal("HF export: cannot remove %s: %s", path, strerror(errno));
}

// The shard files of an earlier export with another shard count: no index names them any more.
static void remove_other_shards(const char *dir, int n_shards) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));)
        if (other_shard(e->d_name, n_shards)) remove_regular(dir, e->d_name);
    closedir(d);
}

void hf_export(const char *dir, const ModelConfig *cfg, const real *flat, StDtype dtype, size_t max_shard_bytes,
               const char *token_ids_json) {
    if (dtype != ST_F32 && dtype != ST_F64) fatal("hf_export: dtype %s (F32 or F64 only)", st_dtype_name(dtype));
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) fatal_input("HF export directory %s: cannot create: %s", dir, strerror(errno));
    ParamTable t = param_table_build(cfg);
    int *shard_of = malloc(sizeof *shard_of * (size_t)t.count);
    int n_shards = assign_shards(&t, dtype, max_shard_bytes, shard_of);
    // Each file is replaced atomically, the set is not: an export stopped half-way over an earlier
    // sharded one would leave new and old shards under the old index, which loads. The old index goes
    // first, so until the new one is written no index names a mixed set.
    if (n_shards > 1) remove_regular(dir, HF_INDEX);
    for (int s = 0; s < n_shards; s++) write_shard(dir, &t, shard_of, s, n_shards, flat, dtype, model_head_dim(cfg));
    if (n_shards > 1) write_index(dir, &t, shard_of, n_shards, dtype);
    write_config(dir, cfg, dtype, token_ids_json);
    // only now, with the new checkpoint complete, and only regular files: the other layout's entry
    // point, and the shards of an earlier export with another shard count
    char stale[4200];
    stale_path(stale, sizeof stale, dir, n_shards);
    remove_regular(dir, strrchr(stale, '/') + 1);
    remove_other_shards(dir, n_shards);
    free(shard_of);
    param_table_free(&t);
}
