#!/usr/bin/env bash
# Hugging Face Llama interop against transformers' LlamaForCausalLM (tests/py/hf_interop.py): import
# (logits, loss, every gradient; fp32 and float64 builds), per-shard reads, export that transformers
# loads (one file and sharded), bit-identical round trip, bad files exiting 2 with one line; and
# the trainer's --init-from hf:DIR / --export-hf DIR under single, tp, ZeRO-3, pp and tp x dp-shard.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:-$(mktemp -d)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
export OMPI_MCA_rmaps_base_oversubscribe=1
"$PYTHON" tests/py/hf_interop.py --build "$BUILD" --tmp "$TEST_TMP/hf" --mpirun "$MPIRUN" || { echo "t_hf: FAIL"; exit 1; }

# Exporting again into a directory replaces the earlier export whole: the shards of another shard
# count go once the new set is complete (they would sit beside it, named by no index), and no other
# file is touched.
ex=$TEST_TMP/reexport
export_to() { "$BUILD/train" --model small --batch 2 --seq-len 64 --steps 1 --export-hf "$ex" "$@" > "$ex.log" 2>&1 ||
    { cat "$ex.log"; echo "t_hf: FAIL: --export-hf $*"; exit 1; }; }
listing() { (cd "$ex" && ls | tr '\n' ' '); }
export_to --export-hf-shard-mb 10
echo keep > "$ex/notes.txt"
export_to --export-hf-shard-mb 15
[ "$(listing)" = "config.json model-00001-of-00003.safetensors model-00002-of-00003.safetensors model-00003-of-00003.safetensors model.safetensors.index.json notes.txt " ] ||
    { echo "t_hf: FAIL: 5 shards, then 3: $(listing)"; exit 1; }
export_to
[ "$(listing)" = "config.json model.safetensors notes.txt " ] || { echo "t_hf: FAIL: 3 shards, then one file: $(listing)"; exit 1; }
echo "ok: a re-export with another shard count leaves only its own files (and notes.txt)"
echo "t_hf: PASS"
