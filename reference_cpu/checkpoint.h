// checkpoint.h: training state as safetensors, written atomically (temp file + rename).
//
// Tensors: param.<name>, adam_m.<name>, adam_v.<name> for every entry of the parameter table.
// Metadata: format, dtype, model config (JSON), step (optimizer steps completed), seed, data spec,
// batch, seq_len, total_steps. There is no RNG state to save beyond the seed: initialisation and
// data are counter-based, so the data position is the step number itself (common/data.h).
#pragma once
#include <stdint.h>

#include "reference_cpu/model.h"

typedef struct {
    uint64_t seed;
    const char *data_spec;
    int batch, seq_len;
    long long total_steps;
} RunIdentity;

// Exits with status 1 (and leaves any previous file intact) if the write fails.
void checkpoint_save(const char *path, const Model *m, const real *adam_m, const real *adam_v, long long step,
                     const RunIdentity *run);
// Loads into an initialised model of the same config and returns the completed step. A missing,
// truncated or corrupt file, or one from a different run (model, dtype, seed, data, batch, seq_len,
// total steps), exits with status 2 and one line naming the difference.
long long checkpoint_load(const char *path, Model *m, real *adam_m, real *adam_v, const RunIdentity *run);
// A file path is returned as is; for a directory, the step_*.safetensors with the highest step
// (exits 2 if there is none). out holds the result.
const char *checkpoint_resolve(const char *path_or_dir, char *out, size_t out_len);
// "<dir>/step_000123.safetensors"
void checkpoint_path_for_step(const char *dir, long long step, char *out, size_t out_len);
