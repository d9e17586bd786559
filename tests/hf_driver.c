// hf_driver: what tests/t_hf.sh runs on checkpoints that transformers wrote (built as
// build/tests/hf_driver and, in the float64 build, build/tests/hf_driver64).
//
//   hf_driver grads DIR TOKENS OUT   load DIR; one forward and backward on TOKENS (safetensors with
//                                    "inputs" and "targets", I32 (B, T)); write OUT/out.safetensors
//                                    (logits (B, T, vocab), loss F64) and the gradients as an HF
//                                    checkpoint in OUT/grads (HF names and layout), both in `real`
//   hf_driver export DIR OUT [MAX_SHARD_BYTES]   load DIR and export it to OUT
//   hf_driver slices DIR             every tensor-parallel shard (tp 2, 4 where they divide) and some
//                                    flat ranges, read from the file, equal the same slices of the
//                                    whole tensors (bit for bit)
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/06_tensor_parallel/tp.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/safetensors.h"
#include "reference_cpu/hf.h"
#include "reference_cpu/model.h"

#ifdef REF_FLOAT64
#define ST_REAL ST_F64
#else
#define ST_REAL ST_F32
#endif

static void load(const char *dir, Model *m) {
    ModelConfig cfg;
    HfCheckpoint *h = hf_open(dir, &cfg);
    model_init(m, &cfg, 0, ATTN_FLASH);
    hf_read_all(h, &m->table, m->params);
    hf_close(h);
}

static int cmd_grads(const char *dir, const char *tokens, const char *out) {
    Model m;
    load(dir, &m);
    char err[4400];
    StFile *f = st_open(tokens, err, sizeof err);
    if (!f) fatal_input("%s", err);
    const StTensor *in = st_find(f, "inputs");
    if (!in || in->ndim != 2) fatal_input("%s: no 2-d tensor 'inputs'", tokens);
    int B = (int)in->shape[0], T = (int)in->shape[1];
    int64_t shape[3] = {B, T, m.cfg.vocab_size};
    int *inputs = malloc(sizeof(int) * B * T), *targets = malloc(sizeof(int) * B * T);
    if (!st_read(f, "inputs", ST_I32, 2, shape, inputs, err, sizeof err) ||
        !st_read(f, "targets", ST_I32, 2, shape, targets, err, sizeof err))
        fatal_input("%s", err);
    st_close(f);
    ModelActs acts = model_acts_alloc(&m, B, T, AC_NONE);
    model_zero_grads(&m);
    double loss = model_forward(&m, &acts, inputs, targets);
    model_backward(&m, &acts, inputs, 1.0);

    char path[4200];
    snprintf(path, sizeof path, "%s/grads", out);
    hf_export(path, &m.cfg, m.grads, ST_REAL, HF_DEFAULT_MAX_SHARD_BYTES, NULL);
    StWriter *w = st_writer_new();
    if (!st_writer_add(w, "logits", ST_REAL, 3, shape, acts.logits, err, sizeof err) ||
        !st_writer_add(w, "loss", ST_F64, 0, NULL, &loss, err, sizeof err))
        fatal("%s", err);
    snprintf(path, sizeof path, "%s/out.safetensors", out);
    if (!st_write(w, path, err, sizeof err)) fatal("%s", err);
    st_writer_free(w);
    printf("hf_driver: loss %.9g on %d x %d tokens\n", loss, B, T);
    model_acts_free(&acts);
    model_free(&m);
    free(inputs);
    free(targets);
    return 0;
}

// The output is checked as the trainer's --export-hf checks it, before anything is written.
static int cmd_export(const char *dir, const char *out, size_t max_shard_bytes) {
    fileio_check_output("export-hf", out, OUTPUT_DIR);
    if (fileio_same_file(dir, out)) fatal_input("export: %s is the checkpoint being read", out);
    Model m;
    load(dir, &m);
    hf_export_check(out, &m.cfg, ST_F32, max_shard_bytes);
    hf_export(out, &m.cfg, m.params, ST_F32, max_shard_bytes, NULL);
    model_free(&m);
    return 0;
}

// Counts the elements of a and b (n) that differ in their bits; prints the first.
static size_t count_differences(const char *what, const real *a, const real *b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(real)) != 0 && bad++ == 0)
            printf("FAIL %s: element %zu is %.9g, expected %.9g\n", what, i, (double)a[i], (double)b[i]);
    return bad;
}

static int cmd_slices(const char *dir) {
    Model full;
    load(dir, &full);
    ModelConfig cfg = full.cfg;
    ModelConfig unused;
    HfCheckpoint *h = hf_open(dir, &unused);
    size_t bad = 0, checked = 0;
    char what[256];
    for (int tp = 2; tp <= 4; tp *= 2) {
        if (cfg.n_kv_heads % tp || cfg.ffn_dim % tp || cfg.vocab_size % tp) continue;
        for (int rank = 0; rank < tp; rank++) {
            Model local;
            model_init_tp(&local, &cfg, NULL, ATTN_FLASH, tp, rank, false);
            size_t n = local.table.total_numel;
            real *want = malloc(sizeof(real) * n), *got = malloc(sizeof(real) * n);
            tp_scatter_full(&local, full.params, want);  // chapter 6's slicing of the whole tensors
            for (int i = 0; i < local.table.count; i++) {
                const ParamInfo *p = &local.table.items[i];
                hf_read_local_range(h, p, rank, tp, 0, p->numel, got + p->offset);
            }
            snprintf(what, sizeof what, "tp %d rank %d", tp, rank);
            bad += count_differences(what, got, want, n);
            checked += n;
            free(want);
            free(got);
            model_free(&local);
        }
    }
    // Flat ranges (what an FSDP shard asks for): a piece of each tensor that starts mid-row.
    for (int i = 0; i < full.table.count; i++) {
        const ParamInfo *p = &full.table.items[i];
        size_t first = p->numel / 3, count = p->numel / 2;
        real *got = malloc(sizeof(real) * (count + 1));
        hf_read_local_range(h, p, 0, 1, first, count, got);
        snprintf(what, sizeof what, "%s [%zu, %zu)", p->name, first, first + count);
        bad += count_differences(what, got, full.params + p->offset + first, count);
        checked += count;
        free(got);
    }
    hf_close(h);
    model_free(&full);
    printf("hf_driver slices: %zu elements checked, %zu differ\n", checked, bad);
    return bad ? 1 : 0;
}

int main(int argc, char **argv) {
    log_set_program("hf_driver");
    if (argc >= 5 && strcmp(argv[1], "grads") == 0) return cmd_grads(argv[2], argv[3], argv[4]);
    if (argc >= 4 && strcmp(argv[1], "export") == 0) {
        size_t max_shard_bytes = HF_DEFAULT_MAX_SHARD_BYTES;
        if (argc > 4) {  // a whole number of bytes, at least 1
            char *end;
            errno = 0;
            unsigned long long v = strtoull(argv[4], &end, 10);
            if (errno || end == argv[4] || *end || strchr(argv[4], '-') || v < 1 || v > SIZE_MAX)
                fatal_input("export: MAX_SHARD_BYTES %s: must be a whole number of bytes, 1 or more", argv[4]);
            max_shard_bytes = (size_t)v;
        }
        return cmd_export(argv[2], argv[3], max_shard_bytes);
    }
    if (argc >= 3 && strcmp(argv[1], "slices") == 0) return cmd_slices(argv[2]);
    fatal_input("usage: hf_driver grads DIR TOKENS OUT | export DIR OUT [MAX_SHARD_BYTES] | slices DIR");
}
