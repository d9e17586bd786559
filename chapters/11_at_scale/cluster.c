// The cluster profiles. Every number is a parameter of the model, with where it comes from; the
// efficiencies are the only ones fitted (see chapters/11_at_scale/README.md, "Where the numbers
// come from").
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/11_at_scale/plan.h"
#include "common/fileio.h"
#include "common/log.h"

static const Cluster PROFILES[] = {
    // torchtitan's Grand Teton hosts (seed 001): 8 H100 SXM per host, 96 GB HBM2e at 2.4 TB/s,
    // 400 Gb/s RDMA per GPU, 500 W. Peaks: the SXM data sheet (989 / 1979 TFLOP/s dense); the
    // 500 W cap and HBM2e lower what is reached, which the efficiencies absorb. NVLink: 450 GB/s
    // per direction, a ring reaching 80% of it; the NIC: 50 GB/s, 80% of it reached.
    {"h100-sxm-ib", 8, 989e12, 1979e12, 0.45, 0.357, 0.216, 0.25, 2.4e12, 96e9, 360e9, 3e-6, 40e9, 10e-6, 500},
    // The IBM/Meta run (seed 000): 8 A100 SXM per host (312 TFLOP/s bf16, no FP8), 80 GB HBM2e at
    // 2.0 TB/s, NVLink 300 GB/s per direction; network assumed 200 Gb/s per GPU (not in the seed).
    {"a100-sxm-ib", 8, 312e12, 0, 0.75, 0, 0.60, 0.25, 2.0e12, 80e9, 240e9, 3e-6, 20e9, 10e-6, 400},
    // The ranks of this project on a CPU: one rank per core, numbers from `make bench`'s calibration
    // are meant to replace these (--cluster FILE.json).
    {"cpu", 1, 50e9, 0, 0.5, 0, 0.5, 0, 10e9, 8e9, 2e9, 20e-6, 2e9, 20e-6, 0},
};

bool cluster_lookup(const char *name, Cluster *c) {
    for (size_t i = 0; i < sizeof PROFILES / sizeof PROFILES[0]; i++)
        if (strcmp(PROFILES[i].name, name) == 0) return *c = PROFILES[i], true;
    return false;
}

#define CLUSTER_DOUBLE_FIELDS(X)                                                                          \
    X(peak_bf16) X(peak_fp8) X(gemm_eff) X(fp8_gemm_eff) X(attn_eff) X(async_tp_hidden) X(hbm_bw) X(hbm_bytes) X(nvlink_bw) \
    X(nvlink_lat) X(net_bw) X(net_lat) X(power_w)

void cluster_load_json(const char *path, Cluster *c) {
    char err[256];
    size_t size;
    unsigned char *text = read_whole_file(path, &size, err, sizeof err);
    if (!text) fatal_input("--cluster %s: %s", path, err);
    cJSON *o = cJSON_ParseWithLength((const char *)text, size);
    free(text);
    if (!cJSON_IsObject(o)) fatal_input("--cluster %s: not a JSON object", path);
    cluster_lookup("h100-sxm-ib", c);
    snprintf(c->name, sizeof c->name, "%s", path);
    for (cJSON *f = o->child; f; f = f->next) {
        bool known = false;
        if (strcmp(f->string, "name") == 0 && cJSON_IsString(f)) {
            snprintf(c->name, sizeof c->name, "%s", f->valuestring);
            continue;
        }
        if (!cJSON_IsNumber(f)) fatal_input("--cluster %s: field %s must be a number", path, f->string);
        if (strcmp(f->string, "gpus_per_node") == 0) c->gpus_per_node = (int)f->valuedouble, known = true;
#define SET(field) \
        if (strcmp(f->string, #field) == 0) c->field = f->valuedouble, known = true;
        CLUSTER_DOUBLE_FIELDS(SET)
#undef SET
        if (!known) fatal_input("--cluster %s: unknown field %s", path, f->string);
    }
    cJSON_Delete(o);
    if (c->gpus_per_node < 1 || c->peak_bf16 <= 0 || c->gemm_eff <= 0 || c->attn_eff <= 0 || c->hbm_bw <= 0 ||
        c->nvlink_bw <= 0 || c->net_bw <= 0)
        fatal_input("--cluster %s: gpus_per_node, peaks, efficiencies and bandwidths must be positive", path);
}
