// hf.h: Hugging Face Llama checkpoints in and out (config.json + model.safetensors, or shards listed
// by model.safetensors.index.json), as transformers' LlamaForCausalLM writes and reads them.
//
// Names. HF's names map one to one onto the parameter table (params.h):
//   model.embed_tokens.weight                   tok_embeddings.weight
//   model.layers.{i}.input_layernorm.weight     layers.{i}.attention_norm.weight
//   model.layers.{i}.self_attn.{q,k,v,o}_proj   layers.{i}.attention.w{q,k,v,o}
//   model.layers.{i}.post_attention_layernorm   layers.{i}.ffn_norm
//   model.layers.{i}.mlp.{gate,down,up}_proj    layers.{i}.feed_forward.w{1,2,3}
//   model.norm.weight                           norm.weight
//   lm_head.weight                              output.weight (absent, and ignored, when tied)
//
// RoPE layout. This reference rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's
// checkpoints do; HF rotates halves (x[i], x[i + hd/2]). The two give the same attention scores when
// the rows of wq and wk are permuted within each head: our row 2i + j of a head is HF's row
// j * hd/2 + i (j = 0, 1). Import applies it, export inverts it; wv, wo and everything else are
// taken as they are.
//
// Shards. hf_open reads config.json and the safetensors headers only; hf_read_local_range then
// reads the bytes of one slice of one tensor, so each rank of any mesh (a tensor-parallel shard,
// a pipeline stage's units, an FSDP flat range) reads only what it holds.
//
// Bad input (a missing config key, an unsupported rope_scaling type, a tensor missing or of the wrong
// shape or dtype, a shard the index names that is not there) exits with status 2 and one line, from
// hf_open, before any weight is read.
#pragma once
#include <stddef.h>

#include "common/safetensors.h"
#include "reference_cpu/config.h"
#include "reference_cpu/params.h"

typedef struct HfCheckpoint HfCheckpoint;

// Opens checkpoint directory dir and fills cfg from its config.json. Checks that every tensor of the
// table for cfg is present with its shape, in F32, BF16, F16 or F64.
HfCheckpoint *hf_open(const char *dir, ModelConfig *cfg);
void hf_close(HfCheckpoint *h);  // NULL is fine

// Elements [first, first + count) of tensor-parallel rank tp_rank's shard of p, in the layout of
// this reference (q/k rows permuted), converted to real. p comes from param_table_build
// (tp_size 1) or param_table_build_tp. The same contract as param_init_local_range, so a trainer
// can take weights from either.
void hf_read_local_range(const HfCheckpoint *h, const ParamInfo *p, int tp_rank, int tp_size, size_t first,
                         size_t count, real *out);
// The same as a ParamSource (params.h), for the model, FSDP and the pipeline to initialise from:
// each rank then reads only the elements it holds. h must stay open while they are built.
ParamSource hf_param_source(const HfCheckpoint *h);
// Every tensor of table t (tp_size 1) into flat (t->total_numel).
void hf_read_all(const HfCheckpoint *h, const ParamTable *t, real *flat);

// HF name of a table entry ("model.layers.3.self_attn.q_proj.weight"); false if name is not one.
bool hf_name(const char *table_name, char *out, size_t out_len);

// Writes dir/config.json and the tensors of flat (laid out by param_table_build(cfg)) in HF's
// layout as dtype (ST_F32, or ST_F64 for the float64 build's gradients): one model.safetensors,
// or model-0000i-of-0000N.safetensors files of at most max_shard_bytes each (a tensor larger
// than that gets a file of its own) and model.safetensors.index.json when more than one is needed.
// Creates dir if needed; every file is written atomically. token_ids_json (hf_token_ids_json's, or
// NULL) adds the special tokens' ids to config.json: without them transformers takes LlamaConfig's
// defaults (bos 1, eos 2), and generate() would stop at token 2.
#define HF_DEFAULT_MAX_SHARD_BYTES ((size_t)5 << 30)  // transformers' save_pretrained default: 5 GB
void hf_export(const char *dir, const ModelConfig *cfg, const real *flat, StDtype dtype, size_t max_shard_bytes,
               const char *token_ids_json);
// The special tokens' ids in dir/config.json (bos_token_id, eos_token_id -- a number or a list --
// and pad_token_id, those present), as one JSON object's text for hf_export (free it), or NULL when
// it names none. Exits 2 with one line if the file cannot be read.
char *hf_token_ids_json(const char *dir);
// Before the run: every file hf_export would write in dir can be (fileio_check_output), and the
// file it would remove is a regular one. Exits 2 with one line otherwise.
void hf_export_check(const char *dir, const ModelConfig *cfg, StDtype dtype, size_t max_shard_bytes);
