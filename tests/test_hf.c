// test_hf: HF checkpoints written by hf_export and read back, without Python (tests/t_hf.sh checks
// the same code against transformers itself).
//   - export then import gives every weight back bit for bit, from one file and from shards;
//   - the config comes back with the same shape (tied and untied, with and without llama3 scaling);
//   - each tensor-parallel rank's shard (tp 2 and 4: row and column splits, permuted q/k rows) and
//     flat ranges starting mid-row, read from the file, equal the seed's values of those elements
//     (param_init_local_range: an oracle independent of the file layout);
//   - wq/wk rows in the file are in HF's half-split order: row j*hd/2 + i of a head holds our row 2i + j.
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/safetensors.h"
#include "reference_cpu/hf.h"
#include "reference_cpu/model.h"
#include "tests/test_util.h"

#define SEED 7

static char *tmp_dir(void) {
    char *d = strdup("/tmp/test_hf.XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(d));
    return d;
}

// Removes dir and the files in it.
static void remove_dir(char *dir) {
    DIR *d = opendir(dir);
    char path[512];
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(dir);
    free(dir);
}

static int count_files(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d) closedir(d);
    return n;
}

// Bit-equality of n elements with one Check assertion (one per element is slow over a whole model).
static void expect_same(const char *what, const real *got, const real *want, size_t n) {
    size_t i = 0;
    while (i < n && memcmp(&got[i], &want[i], sizeof(real)) == 0) i++;
    ck_assert_msg(i == n, "%s: first difference at element %zu: %.9g, expected %.9g", what, i,
                  (double)got[i < n ? i : 0], (double)want[i < n ? i : 0]);
}

static ModelConfig tiny(bool tied, bool llama3) {
    ModelConfig c;
    ck_assert(model_config_lookup("tiny", &c));
    c.tied = tied;
    if (llama3) c.rope_scaling_factor = 8, c.rope_original_max_seq_len = 16;
    return c;
}

// Exports the seed's weights of cfg to a new directory (shards of at most max_bytes) and opens it.
static HfCheckpoint *export_and_open(const ModelConfig *cfg, size_t max_bytes, Model *m, char **dir) {
    model_init(m, cfg, SEED, ATTN_FLASH);
    *dir = tmp_dir();
    hf_export(*dir, cfg, m->params, ST_F32, max_bytes, NULL);
    ModelConfig back, want = *cfg;
    HfCheckpoint *h = hf_open(*dir, &back);
    if (want.rope_scaling_factor == 0)  // without scaling, config.json has no scaling parameters
        want.rope_low_freq_factor = want.rope_high_freq_factor = want.rope_original_max_seq_len = 0;
    char diff[256];
    ck_assert_msg(model_config_same_shape(&back, &want, diff, sizeof diff),
                  "config.json does not give the exported config back: %s", diff);
    return h;
}

static void check_round_trip(bool tied, bool llama3, size_t max_bytes) {
    ModelConfig cfg = tiny(tied, llama3);
    Model m;
    char *dir;
    HfCheckpoint *h = export_and_open(&cfg, max_bytes, &m, &dir);
    real *back = new_zeros(m.table.total_numel);
    hf_read_all(h, &m.table, back);
    expect_same("round trip", back, m.params, m.table.total_numel);
    int shards = count_files(dir, "model-");
    ck_assert_msg(max_bytes < 100000 ? shards > 1 : shards == 0, "%d shard files for a limit of %zu bytes", shards,
                  max_bytes);
    free(back);
    hf_close(h);
    model_free(&m);
    remove_dir(dir);
}

START_TEST(test_round_trip_single_file) { check_round_trip(false, false, HF_DEFAULT_MAX_SHARD_BYTES); }
END_TEST
START_TEST(test_round_trip_shards_tied_llama3) { check_round_trip(true, true, 40000); }
END_TEST

START_TEST(test_shard_reads_equal_the_seed) {
    ModelConfig cfg = tiny(false, false);
    Model m;
    char *dir;
    HfCheckpoint *h = export_and_open(&cfg, 50000, &m, &dir);
    for (int tp = 1; tp <= 4; tp *= 2) {
        ParamTable t = param_table_build_tp(&cfg, tp);
        for (int rank = 0; rank < tp; rank++)
            for (int i = 0; i < t.count; i++) {
                const ParamInfo *p = &t.items[i];
                // the whole shard, then a range from a third of the way in to five sixths
                size_t ranges[2][2] = {{0, p->numel}, {p->numel / 3, p->numel / 2}};
                for (int r = 0; r < 2; r++) {
                    size_t first = ranges[r][0], count = ranges[r][1];
                    real *got = new_zeros(count), *want = new_zeros(count);
                    hf_read_local_range(h, p, rank, tp, first, count, got);
                    param_init_local_range(p, rank, tp, SEED, first, count, want);
                    char what[128];
                    snprintf(what, sizeof what, "%s tp %d rank %d [%zu, +%zu)", p->name, tp, rank, first, count);
                    expect_same(what, got, want, count);
                    free(got);
                    free(want);
                }
            }
        param_table_free(&t);
    }
    hf_close(h);
    model_free(&m);
    remove_dir(dir);
}
END_TEST

// The file's q rows are HF's order: head h's row j*hd/2 + i is our row 2i + j.
START_TEST(test_q_rows_in_hf_order) {
    ModelConfig cfg = tiny(false, false);
    Model m;
    char *dir;
    HfCheckpoint *h = export_and_open(&cfg, HF_DEFAULT_MAX_SHARD_BYTES, &m, &dir);
    hf_close(h);
    char path[512], err[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    StFile *f = st_open(path, err, sizeof err);
    ck_assert_msg(f != NULL, "%s", err);
    const StTensor *q = st_find(f, "model.layers.1.self_attn.q_proj.weight");
    ck_assert_ptr_nonnull(q);
    const ParamInfo *p = param_table_find(&m.table, "layers.1.attention.wq.weight");
    int hd = model_head_dim(&cfg), half = hd / 2, cols = p->shape[1];
    float *file = malloc(q->n_bytes);
    ck_assert(st_copy_to(q, file, q->n_bytes, err, sizeof err));
    for (int head = 0; head < cfg.n_heads; head++)
        for (int i = 0; i < half; i++)
            for (int j = 0; j < 2; j++) {
                const float *hf_row = file + (size_t)(head * hd + j * half + i) * cols;
                const real *our_row = m.params + p->offset + (size_t)(head * hd + 2 * i + j) * cols;
                for (int c = 0; c < cols; c++) ck_assert_float_eq(hf_row[c], (float)our_row[c]);
            }
    free(file);
    st_close(f);
    model_free(&m);
    remove_dir(dir);
}
END_TEST

int main(void) {
    Suite *s = suite_create("hf");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);  // reads every shard of a model element by element: seconds on a loaded machine
    tcase_add_test(tc, test_round_trip_single_file);
    tcase_add_test(tc, test_round_trip_shards_tied_llama3);
    tcase_add_test(tc, test_shard_reads_equal_the_seed);
    tcase_add_test(tc, test_q_rows_in_hf_order);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
