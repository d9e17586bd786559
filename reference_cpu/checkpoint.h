// checkpoint.h: training state as safetensors, written atomically (temp file + rename).
//
// Tensors: param.<name>, adam_m.<name>, adam_v.<name> for every entry of the parameter table.
// Metadata: format, dtype, model config (JSON), step (optimizer steps completed), seed, data spec,
// batch, seq_len, total_steps, and the learning-rate schedule (lr, schedule; absent in files
// written before they were added, which still load). There is no RNG state to save beyond the seed: initialisation and
// data are counter-based, so the data position is the step number itself (common/data.h).
#pragma once
#include <stdint.h>

#include "reference_cpu/model.h"

typedef struct {
    uint64_t seed;
    const char *data_spec;
    // What the data is, whatever the spec's spelling (data_identity: the markov chain's parameters,
    // or a file's size and content hash). A resume compares it when the checkpoint records it, and
    // the spec only for checkpoints written before (NULL: not recorded).
    const char *data_identity;
    int batch, seq_len;
    long long total_steps;
    // May change on resume (fine-tuning a schedule is legitimate), but never unnoted: a load logs
    // one line naming the old and the new value.
    double lr;
    const char *schedule;  // "cosine, warmup 2, min_lr_ratio 0.1"
    // The rest of what shapes the updates: "weight_decay 0.1, beta1 0.9, beta2 0.95, eps 1e-08,
    // grad_clip 1, grad_accum 1, fp8 none" (NULL: not recorded).
    const char *settings;
} RunIdentity;

// Exits with status 1 (and leaves any previous file intact) if the write fails, or without writing
// if any weight or AdamW moment is not finite (the last good checkpoint stays the latest).
void checkpoint_save(const char *path, const Model *m, const real *adam_m, const real *adam_v, long long step,
                     const RunIdentity *run);
// Loads into an initialised model of the same config and returns the completed step. A missing,
// truncated or corrupt file, or one from a different run (model, dtype, seed, data, batch, seq_len,
// total steps), exits with status 2 and one line naming the difference (for the model, the first
// config field that differs). So does a step that is not an integer in 0..total_steps.
long long checkpoint_load(const char *path, Model *m, real *adam_m, real *adam_v, const RunIdentity *run);
// The same checks without a model, the data's hash included (read from disk in chunks, never held
// whole): a run can refuse a bad --resume -- truncated, damaged, or from another run -- before it
// writes anything.
// Returns the step it records.
long long checkpoint_check(const char *path, const ModelConfig *cfg, const RunIdentity *run);
// A file path is returned as is; for a directory, the step_*.safetensors with the highest step
// (exits 2 if there is none). out holds the result.
const char *checkpoint_resolve(const char *path_or_dir, char *out, size_t out_len);
// Removes the "*.tmp.<pid>" files in dir whose writer is gone (no process <pid> on this machine):
// what a run killed while checkpointing leaves. A live pid's file is left alone (it may be a run
// writing now). Logs one line per file removed. Call it when a checkpoint directory is opened.
void checkpoint_clean_stale(const char *dir);
// The step of a checkpoint file name as the writer makes it (step_000012.safetensors), or -1.
long long checkpoint_step_of_name(const char *name);
// Takes --checkpoint-dir for this run (one rank, before step 1): an exclusive lock on DIR/.lock that
// lasts as long as the process (another run writing there is refused, naming the process that holds
// it), and refuses a directory holding checkpoints (or delayed FP8's companions of them) unless this
// run resumes from it (resume_path in DIR, whose recorded step is resumed_step), and then one holding
// any later than resumed_step. DIR/.lock must be a regular file, not a link. Exit 2, before step 1.
void checkpoint_dir_claim(const char *dir, const char *resume_path, long long resumed_step);
// The same refusals, read-only, for a directory that may not exist yet (nothing to refuse then):
// called among the checks before any work, so that a directory another run holds or wrote stops
// the run before the model is built and --resume loaded. checkpoint_dir_claim makes them again.
void checkpoint_dir_check(const char *dir, const char *resume_path, long long resumed_step);
// "<dir>/step_000123.safetensors"
void checkpoint_path_for_step(const char *dir, long long step, char *out, size_t out_len);
