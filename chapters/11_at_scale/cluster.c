// The cluster profiles. Every number is a parameter of the model, with where it comes from; the
// efficiencies and the H100's rank_jitter are the only ones fitted (see chapters/11_at_scale/README.md,
// "Validation").
#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chapters/11_at_scale/plan.h"
#include "common/fileio.h"
#include "common/json.h"
#include "common/log.h"

static const Cluster PROFILES[] = {
    // torchtitan's Grand Teton hosts (seed 001): 8 H100 SXM per host, 96 GB HBM2e at 2.4 TB/s,
    // 400 Gb/s RDMA per GPU, 500 W. Peaks: the SXM data sheet (989 / 1979 TFLOP/s dense); the
    // 500 W cap and HBM2e lower what is reached, which the efficiencies absorb. NVLink: 450 GB/s
    // per direction, a ring reaching 80% of it; the NIC: 50 GB/s, 80% of it reached. rank_jitter:
    // fitted to Table 3 against Table 1 (the same run on 128 GPUs, 2.7% slower per GPU than on 8).
    {"h100-sxm-ib", 8, 989e12, 1979e12, 0.471, 0.374, 0.224, 0.25, 2.4e12, 96e9, 360e9, 3e-6, 40e9, 10e-6, 500, 0.0264},
    // The IBM/Meta run (seed 000): 8 A100 SXM per host (312 TFLOP/s bf16, no FP8), 80 GB HBM2e at
    // 2.0 TB/s, NVLink 300 GB/s per direction; network assumed 200 Gb/s per GPU (not in the seed);
    // rank_jitter the H100 profile's (nothing in seed 000 measures it).
    {"a100-sxm-ib", 8, 312e12, 0, 0.75, 0, 0.60, 0.25, 2.0e12, 80e9, 240e9, 3e-6, 20e9, 10e-6, 400, 0.0264},
    // The ranks of this project on a CPU: one rank per core, numbers from `make bench`'s calibration
    // are meant to replace these (--cluster FILE.json).
    {"cpu", 1, 50e9, 0, 0.5, 0, 0.5, 0, 10e9, 8e9, 2e9, 20e-6, 2e9, 20e-6, 0, 0},
};

bool cluster_lookup(const char *name, Cluster *c) {
    for (size_t i = 0; i < sizeof PROFILES / sizeof PROFILES[0]; i++)
        if (strcmp(PROFILES[i].name, name) == 0) return *c = PROFILES[i], true;
    return false;
}

// What each number of a profile may physically be, in SI units. The bounds are far outside any real
// machine on both sides; they catch a wrong unit (GB/s written as 40 for 40e9 bytes/s) that would
// otherwise predict a step of years, or one too long for the trace's nanosecond clock.
typedef enum {
    PEAK,          // FLOP/s, 1e6 .. 1e18
    PEAK_OR_ZERO,  // peak_fp8: the same, or 0 (no FP8)
    BANDWIDTH,     // bytes/s, 1e6 .. 1e15
    BYTES,         // hbm_bytes, 1e6 .. 1e15
    LATENCY,       // seconds, 0 (none) .. 1
    POWER,         // watts, 0 (unknown; informational) .. 1e5
    SHARE,         // efficiencies: achieved shares of a peak, 1e-12 .. 1 (1e-300 overflowed the step to inf;
                   // a CPU emulator's calibration measures shares of 1e-8)
    SHARE_OR_ZERO, // fp8_gemm_eff: the same, or 0 (no FP8)
    FRACTION,      // async_tp_hidden: 0 (AsyncTP hides nothing) .. 1
    JITTER,        // rank_jitter: 0 (every rank on time) .. 0.5 (a spread of half the step: the normal
                   // model's slowest of many GPUs would take several steps' time)
} FieldRange;

#define CLUSTER_DOUBLE_FIELDS(X)                                                                            \
    X(peak_bf16, PEAK) X(peak_fp8, PEAK_OR_ZERO) X(gemm_eff, SHARE) X(fp8_gemm_eff, SHARE_OR_ZERO)            \
    X(attn_eff, SHARE) X(async_tp_hidden, FRACTION) X(hbm_bw, BANDWIDTH) X(hbm_bytes, BYTES)              \
    X(nvlink_bw, BANDWIDTH) X(nvlink_lat, LATENCY) X(net_bw, BANDWIDTH) X(net_lat, LATENCY) X(power_w, POWER)  \
    X(rank_jitter, JITTER)

static const struct {
    const char *name;
    size_t offset;
    FieldRange range;
} FIELDS[] = {
#define FIELD(field, range) {#field, offsetof(Cluster, field), range},
    CLUSTER_DOUBLE_FIELDS(FIELD)
#undef FIELD
};
#define N_FIELDS (int)(sizeof FIELDS / sizeof FIELDS[0])
#define GPUS_PER_NODE -1  // the one int field, in field_index's numbering

static double *field_of(Cluster *c, int i) { return (double *)((char *)c + FIELDS[i].offset); }
static double field_value(const Cluster *c, int i) { return *(const double *)((const char *)c + FIELDS[i].offset); }

// The rule v breaks, or NULL. Infinity is no peak or bandwidth (it makes every time 0): refused
// like NaN.
static const char *range_broken(FieldRange range, double v) {
    if (!isfinite(v)) return "must be a finite number";
    switch (range) {
    case PEAK: return v >= 1e6 && v <= 1e18 ? NULL : "must be from 1e6 to 1e18 FLOP/s";
    case PEAK_OR_ZERO: return v == 0 || (v >= 1e6 && v <= 1e18) ? NULL : "must be 0 (no FP8) or from 1e6 to 1e18 FLOP/s";
    case BANDWIDTH: return v >= 1e6 && v <= 1e15 ? NULL : "must be from 1e6 to 1e15 bytes/s";
    case BYTES: return v >= 1e6 && v <= 1e15 ? NULL : "must be from 1e6 to 1e15 bytes";
    case LATENCY: return v >= 0 && v <= 1 ? NULL : "must be from 0 to 1 s";
    case POWER: return v >= 0 && v <= 1e5 ? NULL : "must be from 0 to 1e5 W";
    case SHARE: return v >= 1e-12 && v <= 1 ? NULL : "must be from 1e-12 to 1 (a share of the peak)";
    case SHARE_OR_ZERO: return v == 0 || (v >= 1e-12 && v <= 1) ? NULL : "must be 0 (no FP8) or from 1e-12 to 1";
    case FRACTION: return v >= 0 && v <= 1 ? NULL : "must be in [0, 1]";
    case JITTER: return v >= 0 && v <= 0.5 ? NULL : "must be from 0 to 0.5 (a relative standard deviation)";
    }
    return NULL;
}

const char *cluster_check(const Cluster *c, char *buf, size_t len) {
    if (c->gpus_per_node < 1 || c->gpus_per_node > PLAN_MAX_GPUS) {
        snprintf(buf, len, "gpus_per_node %d: must be a whole number from 1 to %d", c->gpus_per_node, PLAN_MAX_GPUS);
        return buf;
    }
    for (int i = 0; i < N_FIELDS; i++) {
        double v = field_value(c, i);
        const char *broken = range_broken(FIELDS[i].range, v);
        if (broken) return snprintf(buf, len, "%s %g: %s", FIELDS[i].name, v, broken), buf;
    }
    return NULL;
}

// FIELDS' index of a JSON field, GPUS_PER_NODE, or N_FIELDS for an unknown one.
static int field_index(const char *name) {
    if (strcmp(name, "gpus_per_node") == 0) return GPUS_PER_NODE;
    int i = 0;
    while (i < N_FIELDS && strcmp(FIELDS[i].name, name) != 0) i++;
    return i;
}

// One field of the file into c (any but "name"). gpus_per_node is checked before it becomes an int,
// where 2.5 would silently become 2 and 1e12 would not fit.
static void set_field(const char *path, const cJSON *f, Cluster *c) {
    int i = field_index(f->string);
    if (i == N_FIELDS) fatal_input("--cluster %s: unknown field %s", path, f->string);
    if (!cJSON_IsNumber(f)) fatal_input("--cluster %s: field %s must be a number", path, f->string);
    double v = f->valuedouble;
    if (i != GPUS_PER_NODE) {
        *field_of(c, i) = v;
        return;
    }
    if (!whole_number_in(v, 1, PLAN_MAX_GPUS))
        fatal_input("--cluster %s: gpus_per_node %g: must be a whole number from 1 to %d", path, v, PLAN_MAX_GPUS);
    c->gpus_per_node = (int)v;
}

// The file's one object; refuses what follows it (a second object, stray text) instead of
// ignoring it.
static cJSON *parse_object(const char *path) {
    char err[256];
    size_t size;
    unsigned char *text = read_whole_file(path, &size, err, sizeof err);
    if (!text) fatal_input("--cluster %s: %s", path, err);
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithLengthOpts((const char *)text, size, &end, false);
    size_t rest = end ? (size_t)(end - (const char *)text) : 0;  // where the parse stopped, or failed
    while (o && rest < size && isspace(text[rest])) rest++;
    free(text);
    if (!o) fatal_input("--cluster %s: not valid JSON (error near byte %zu)", path, rest);
    if (!cJSON_IsObject(o)) fatal_input("--cluster %s: not a JSON object", path);
    if (rest < size) fatal_input("--cluster %s: more after the JSON object (at byte %zu): one object per file", path, rest);
    return o;
}

void cluster_load_json(const char *path, Cluster *c) {
    cJSON *o = parse_object(path);
    cluster_lookup("h100-sxm-ib", c);
    snprintf(c->name, sizeof c->name, "%s", path);
    for (cJSON *f = o->child; f; f = f->next) {
        for (cJSON *g = o->child; g != f; g = g->next)  // the last would win silently
            if (strcmp(g->string, f->string) == 0) fatal_input("--cluster %s: field %s given twice", path, f->string);
        if (strcmp(f->string, "name") != 0) {
            set_field(path, f, c);
        } else if (cJSON_IsString(f) && f->valuestring[0]) {
            // printed in every plan's first line: whole, and on one line
            size_t n = strlen(f->valuestring);
            if (n >= sizeof c->name)
                fatal_input("--cluster %s: field name is %zu bytes: at most %zu", path, n, sizeof c->name - 1);
            for (size_t i = 0; i < n; i++)
                if ((unsigned char)f->valuestring[i] < 0x20 || f->valuestring[i] == 0x7f)
                    fatal_input("--cluster %s: field name holds a control character (byte %zu)", path, i);
            snprintf(c->name, sizeof c->name, "%s", f->valuestring);
        } else {
            fatal_input("--cluster %s: field name must be a non-empty string", path);
        }
    }
    cJSON_Delete(o);
    char why[160];
    if (cluster_check(c, why, sizeof why)) fatal_input("--cluster %s: %s", path, why);
}
