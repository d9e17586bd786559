#include "reference_cpu/dump.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "common/safetensors.h"

#define DUMP_FORMAT "llama-ref-dump-v1"
#ifdef REF_FLOAT64
#define ST_REAL ST_F64
#else
#define ST_REAL ST_F32
#endif

static real *copy_of(const real *src, size_t n) {
    real *dst = mem_alloc(MEM_OTHER, sizeof(real) * n);
    memcpy(dst, src, sizeof(real) * n);
    return dst;
}

void dump_begin(DumpRecorder *d, const Model *m, int steps, int B, int T, const AdamWConfig *opt, double grad_clip) {
    memset(d, 0, sizeof *d);
    d->steps = steps, d->B = B, d->T = T;
    d->inputs = mem_alloc(MEM_OTHER, sizeof(int) * (size_t)steps * B * T);
    d->targets = mem_alloc(MEM_OTHER, sizeof(int) * (size_t)steps * B * T);
    d->loss = mem_alloc(MEM_OTHER, sizeof(double) * steps);
    d->grad_norm = mem_alloc(MEM_OTHER, sizeof(double) * steps);
    d->lr = mem_alloc(MEM_OTHER, sizeof(double) * steps);
    d->initial_params = copy_of(m->params, m->table.total_numel);
    d->optimizer = *opt;
    d->grad_clip = grad_clip;
}

void dump_record_step(DumpRecorder *d, const Model *m, const ModelActs *acts, long long step, const int *inputs,
                      const int *targets, double loss, double grad_norm, double lr) {
    size_t BT = (size_t)d->B * d->T, k = (size_t)(step - 1);
    memcpy(d->inputs + k * BT, inputs, sizeof(int) * BT);
    memcpy(d->targets + k * BT, targets, sizeof(int) * BT);
    d->loss[k] = loss, d->grad_norm[k] = grad_norm, d->lr[k] = lr;
    if (step == 1) {
        d->logits = copy_of(acts->logits, BT * m->cfg.vocab_size);
        d->grads = copy_of(m->grads, m->table.total_numel);
    }
}

static void add_tensor(StWriter *w, const char *name, StDtype dtype, int ndim, const int64_t *shape,
                       const void *data) {
    char err[1024];
    if (!st_writer_add(w, name, dtype, ndim, shape, data, err, sizeof err)) fatal("--dump: %s", err);
}

// Adds <prefix><name> for every parameter, viewing into the flat buffer.
static void add_param_tensors(StWriter *w, const Model *m, const char *prefix, const real *flat) {
    char name[PARAM_NAME_MAX + 16];
    for (int i = 0; i < m->table.count; i++) {
        const ParamInfo *p = &m->table.items[i];
        int64_t shape[2] = {p->shape[0], p->shape[1]};
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        add_tensor(w, name, ST_REAL, p->ndim, shape, flat + p->offset);
    }
}

void dump_write_flat(const Model *m, const char *prefix, const real *flat, const char *path, const char *flag) {
    char err[1024];
    StWriter *w = st_writer_new();
    add_param_tensors(w, m, prefix, flat);
    char *config = model_config_to_json(&m->cfg);
    if (!st_writer_add_metadata(w, "config", config, err, sizeof err) || !st_write(w, path, err, sizeof err))
        fatal("%s: %s", flag, err);  // err names the file
    free(config);
    st_writer_free(w);
}

void dump_write(DumpRecorder *d, const Model *m, const char *path) {
    char err[1024], text[512];
    StWriter *w = st_writer_new();
    int64_t batch_shape[3] = {d->steps, d->B, d->T}, step_shape[1] = {d->steps};
    int64_t logits_shape[3] = {d->B, d->T, m->cfg.vocab_size};
    add_tensor(w, "inputs", ST_I32, 3, batch_shape, d->inputs);
    add_tensor(w, "targets", ST_I32, 3, batch_shape, d->targets);
    add_tensor(w, "loss", ST_F64, 1, step_shape, d->loss);
    add_tensor(w, "grad_norm", ST_F64, 1, step_shape, d->grad_norm);
    add_tensor(w, "lr", ST_F64, 1, step_shape, d->lr);
    add_tensor(w, "logits", ST_REAL, 3, logits_shape, d->logits);
    add_param_tensors(w, m, "param.", d->initial_params);
    add_param_tensors(w, m, "grad.", d->grads);
    add_param_tensors(w, m, "final.", m->params);
    char *config = model_config_to_json(&m->cfg);
    snprintf(text, sizeof text,
             "{\"beta1\":%.17g,\"beta2\":%.17g,\"eps\":%.17g,\"weight_decay\":%.17g,\"grad_clip\":%.17g}",
             d->optimizer.beta1, d->optimizer.beta2, d->optimizer.eps, d->optimizer.weight_decay, d->grad_clip);
    const char *keys[] = {"format", "config", "optimizer", "dtype"};
    const char *values[] = {DUMP_FORMAT, config, text, REAL_NAME};
    for (int i = 0; i < 4; i++)
        if (!st_writer_add_metadata(w, keys[i], values[i], err, sizeof err)) fatal("--dump: %s", err);
    snprintf(text, sizeof text, "%d", d->steps);
    if (!st_writer_add_metadata(w, "steps", text, err, sizeof err)) fatal("--dump: %s", err);
    if (!st_write(w, path, err, sizeof err)) fatal("--dump: %s", err);
    st_writer_free(w);
    free(config);
    void *owned[] = {d->inputs, d->targets, d->loss, d->grad_norm, d->lr, d->initial_params, d->logits, d->grads};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) mem_free(owned[i]);
    memset(d, 0, sizeof *d);
}

// ---- --compare ----------------------------------------------------------------------------------

// Reads a floating-point tensor of exactly n elements (F32 or F64) into doubles.
static double *read_as_double(const StFile *f, const char *name, size_t n) {
    const StTensor *t = st_find(f, name);
    if (!t) fatal_input("%s: tensor '%s' missing", st_path(f), name);
    if ((t->dtype != ST_F32 && t->dtype != ST_F64) || t->n_elements != n)
        fatal_input("%s: tensor '%s' is %s with %zu elements, expected F32/F64 with %zu", st_path(f), name,
                    st_dtype_name(t->dtype), t->n_elements, n);
    double *out = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        if (t->dtype == ST_F64) {
            memcpy(&out[i], (const char *)t->data + 8 * i, 8);
        } else {
            float v;
            memcpy(&v, (const char *)t->data + 4 * i, 4);
            out[i] = v;
        }
    }
    return out;
}

// Prints one line and returns true when max|ours - theirs| <= rtol * max|theirs|.
static bool compare_tensor(const char *name, const real *ours, const double *theirs, size_t n, double rtol) {
    double max_abs = 0, max_ref = 0;
    size_t worst = 0;
    bool non_finite = false;  // a NaN or inf on either side: the first one is the worst, and fails
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)ours[i] - theirs[i]);
        if (!isfinite(diff)) {
            if (!non_finite) non_finite = true, worst = i, max_abs = NAN;
        } else if (!non_finite && diff > max_abs) {
            max_abs = diff, worst = i;
        }
        if (fabs(theirs[i]) > max_ref) max_ref = fabs(theirs[i]);
    }
    double rel = max_ref > 0 ? max_abs / max_ref : max_abs;
    bool ok = !non_finite && rel <= rtol;
    printf("  %-44s max_abs %.3e  max_rel %.3e  worst [%zu] ours %.8g theirs %.8g  %s\n", name, max_abs, rel, worst,
           n ? (double)ours[worst] : 0.0, n ? theirs[worst] : 0.0, ok ? "ok" : "MISMATCH");
    return ok;
}

int dump_compare(const char *path, AttentionImpl attention, double rtol) {
    char err[1024], name[PARAM_NAME_MAX + 16];
    StFile *f = st_open(path, err, sizeof err);
    if (!f) fatal_input("--compare: %s", err);
    const char *config_json = st_metadata(f, "config");
    ModelConfig cfg;
    if (!config_json) fatal_input("%s: not a dump (metadata \"config\" missing)", path);
    if (!model_config_from_json(config_json, &cfg, err, sizeof err)) fatal_input("%s: %s", path, err);
    const StTensor *inputs = st_find(f, "inputs"), *targets = st_find(f, "targets");
    if (!inputs || !targets || inputs->dtype != ST_I32 || targets->dtype != ST_I32 || inputs->ndim != 3 ||
        targets->ndim != 3 || memcmp(inputs->shape, targets->shape, 3 * sizeof inputs->shape[0]) != 0)
        fatal_input("%s: needs I32 tensors 'inputs' and 'targets' of the same shape (steps, B, T)", path);
    if (inputs->shape[0] < 1 || inputs->shape[1] < 1 || inputs->shape[2] < 1 || inputs->shape[1] > INT_MAX ||
        inputs->shape[2] > INT_MAX)
        fatal_input("%s: 'inputs' has shape (%lld, %lld, %lld): needs at least one step of B x T tokens", path,
                    (long long)inputs->shape[0], (long long)inputs->shape[1], (long long)inputs->shape[2]);
    int B = (int)inputs->shape[1], T = (int)inputs->shape[2];
    model_config_validate(&cfg, T);
    if (T > cfg.max_seq_len) cfg.max_seq_len = T;
    // what one step of that model at (B, T) allocates at least, refused before allocating (as the trainer does)
    char what[4200];
    snprintf(what, sizeof what, "--compare %s (n_layers %d, dim %d, B %d, T %d)", path, cfg.n_layers, cfg.dim, B, T);
    mem_check_plan(what, model_plan_bytes(&cfg, (uint64_t)B, (uint64_t)T, &(ModelSplit){1, 1, 1, 1, 0, false}), 1);

    Model m;
    model_init(&m, &cfg, 0, attention);
    for (int i = 0; i < m.table.count; i++) {  // their weights, converted to our precision
        const ParamInfo *p = &m.table.items[i];
        snprintf(name, sizeof name, "param.%s", p->name);
        double *w = read_as_double(f, name, p->numel);
        for (size_t j = 0; j < p->numel; j++) m.params[p->offset + j] = (real)w[j];
        free(w);
    }
    size_t BT = (size_t)B * T;
    int *step_inputs = malloc(sizeof(int) * BT), *step_targets = malloc(sizeof(int) * BT);
    memcpy(step_inputs, inputs->data, sizeof(int) * BT);
    memcpy(step_targets, targets->data, sizeof(int) * BT);
    for (size_t i = 0; i < BT; i++)
        if (step_inputs[i] < 0 || step_inputs[i] >= cfg.vocab_size ||
            (step_targets[i] != IGNORE_INDEX && (step_targets[i] < 0 || step_targets[i] >= cfg.vocab_size)))
            fatal_input("%s: token %d at flat index %zu is outside the vocabulary of %d", path,
                        step_inputs[i] < 0 || step_inputs[i] >= cfg.vocab_size ? step_inputs[i] : step_targets[i], i,
                        cfg.vocab_size);

    ModelActs acts = model_acts_alloc(&m, B, T, AC_NONE);
    model_zero_grads(&m);
    real loss = (real)model_forward(&m, &acts, step_inputs, step_targets);
    model_backward(&m, &acts, step_inputs, 1.0);

    printf("compare %s (model %s, B=%d T=%d, rtol %.1e)\n", path, cfg.name, B, T, rtol);
    bool all_ok = true;
    double *their_loss = read_as_double(f, "loss", (size_t)inputs->shape[0]);
    all_ok &= compare_tensor("loss (step 1)", &loss, their_loss, 1, rtol);
    if (st_find(f, "logits")) {
        double *their_logits = read_as_double(f, "logits", BT * cfg.vocab_size);
        all_ok &= compare_tensor("logits", acts.logits, their_logits, BT * cfg.vocab_size, rtol);
        free(their_logits);
    }
    for (int i = 0; i < m.table.count; i++) {
        const ParamInfo *p = &m.table.items[i];
        snprintf(name, sizeof name, "grad.%s", p->name);
        double *g = read_as_double(f, name, p->numel);
        all_ok &= compare_tensor(name, m.grads + p->offset, g, p->numel, rtol);
        free(g);
    }
    printf("compare: %s\n", all_ok ? "all tensors within tolerance" : "MISMATCH");
    free(their_loss);
    free(step_inputs);
    free(step_targets);
    model_acts_free(&acts);
    model_free(&m);
    st_close(f);
    return all_ok ? 0 : 1;
}
