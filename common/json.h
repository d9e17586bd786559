// json.h: whole numbers from JSON, the one check every reader here uses (checkpoint and dump headers'
// model configs, safetensors shapes and offsets, Hugging Face config.json, the planner's cluster
// files). JSON has only doubles: the value must be a number, have no fraction, and lie in [lo, hi],
// all compared as doubles before any cast, so that 2.5 is refused instead of becoming 2, and 1e20 or
// a NaN never reaches an integer conversion (undefined behaviour in C).
#pragma once
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

// lo and hi must lie within +-2^53, where every whole double is exact.
static inline bool whole_number_in(double v, double lo, double hi) { return v >= lo && v <= hi && v == floor(v); }

// *out = item's value when it is a number that whole_number_in accepts; false (out untouched) otherwise.
static inline bool json_whole_number(const cJSON *item, double lo, double hi, int64_t *out) {
    if (!cJSON_IsNumber(item) || !whole_number_in(item->valuedouble, lo, hi)) return false;
    *out = (int64_t)item->valuedouble;
    return true;
}
