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
# a read-only shard of the earlier export is kept from being removed as from being replaced: refused
chmod 444 "$ex/model-00002-of-00003.safetensors"
rc=0
err=$("$BUILD/train" --model small --batch 2 --seq-len 64 --steps 1 --export-hf "$ex" 2>&1 >/dev/null) || rc=$?
[ "$rc" = 2 ] && [[ "$err" == *"model-00002-of-00003.safetensors is read-only, and this export would remove it"* ]] &&
    [ -e "$ex/model-00002-of-00003.safetensors" ] || { echo "t_hf: FAIL: a read-only earlier shard: exit $rc: $err"; exit 1; }
chmod 644 "$ex/model-00002-of-00003.safetensors"
export_to
[ "$(listing)" = "config.json model.safetensors notes.txt " ] || { echo "t_hf: FAIL: 3 shards, then one file: $(listing)"; exit 1; }
echo "ok: a re-export with another shard count leaves only its own files (and notes.txt)"

# A sharded checkpoint is read as its index says, as transformers reads it: a tensor also present in
# another shard (with other values) or found only in another shard than the index names is refused.
# (The loader took the first shard holding the name: other weights than transformers loads.)
"$BUILD/train" --model tiny --batch 2 --seq-len 16 --steps 1 --export-hf "$TEST_TMP/shards" --export-hf-shard-mb 0.2 \
    > "$TEST_TMP/shards.log" 2>&1 || { cat "$TEST_TMP/shards.log"; echo "t_hf: FAIL: sharded export"; exit 1; }
"$PYTHON" - "$TEST_TMP/shards" "$TEST_TMP/dup" "$TEST_TMP/moved" <<'PY'
import json, shutil, sys
sys.path.insert(0, "tests/py")
import numpy as np
import safetensors_io as st
src, dup, moved = sys.argv[1:]
index = json.load(open(f"{src}/model.safetensors.index.json"))["weight_map"]
home = index["model.norm.weight"]
other = next(f for f in sorted(set(index.values())) if f != home)
for out in (dup, moved):
    shutil.copytree(src, out)
tensors, meta = st.load(f"{src}/{other}")
tensors["model.norm.weight"] = np.full(tensors[next(iter(tensors))].shape[-1:], 5.0, np.float32)
st.save(f"{dup}/{other}", tensors, meta)  # a second copy, other values; the index still names `home`
st.save(f"{moved}/{other}", tensors, meta)
tensors, meta = st.load(f"{src}/{home}")
del tensors["model.norm.weight"]
st.save(f"{moved}/{home}", tensors, meta)  # the only copy in `other`, the index names `home`
PY
refused() {  # dir, expected substring
    local err rc=0
    err=$("$BUILD/train" --steps 1 --batch 2 --seq-len 16 --init-from "hf:$1" 2>&1 >/dev/null) || rc=$?
    [ "$rc" = 2 ] && [ "$(printf '%s\n' "$err" | grep -c .)" = 1 ] && [[ "$err" == *"$2"* ]] ||
        { echo "t_hf: FAIL: --init-from hf:$1 -> exit $rc: $err (wanted exit 2, one line with '$2')"; exit 1; }
    echo "ok: $err"
}
refused "$TEST_TMP/dup" "tensor 'model.norm.weight' is in both"
refused "$TEST_TMP/moved" "the weight_map puts tensor 'model.norm.weight' in"
# ... and so is an index listing a tensor that no shard holds (it loaded without a word), or naming
# an empty file ("DIR/: is a directory")
"$PYTHON" - "$TEST_TMP/shards" "$TEST_TMP/extra" "$TEST_TMP/empty_name" <<'PY'
import json, shutil, sys
src, extra, empty_name = sys.argv[1:]
for out, shard in ((extra, None), (empty_name, "")):
    shutil.copytree(src, out)
    path = f"{out}/model.safetensors.index.json"
    index = json.load(open(path))
    index["weight_map"]["model.extra.weight"] = shard if shard is not None else index["weight_map"]["model.norm.weight"]
    json.dump(index, open(path, "w"))
PY
refused "$TEST_TMP/extra" "the weight_map puts tensor 'model.extra.weight' in"
refused "$TEST_TMP/empty_name" "weight_map[\"model.extra.weight\"] is an empty file name"
# A config that ties the output (tie_word_embeddings true) over a checkpoint that also holds an
# lm_head.weight: loaded as transformers loads it (the head is the embedding table), and said.
"$PYTHON" - "$TEST_TMP/shards" "$TEST_TMP/tiedhead" <<'PY'
import json, shutil, sys
src, out = sys.argv[1:]
shutil.copytree(src, out)
config = json.load(open(f"{out}/config.json"))
config["tie_word_embeddings"] = True
json.dump(config, open(f"{out}/config.json", "w"))
PY
"$BUILD/train" --steps 1 --batch 2 --seq-len 16 --init-from "hf:$TEST_TMP/tiedhead" >"$TEST_TMP/tiedhead.log" 2>&1 &&
    grep -q "lm_head.weight is not read: config.json ties the output to model.embed_tokens.weight" "$TEST_TMP/tiedhead.log" ||
    { cat "$TEST_TMP/tiedhead.log"; echo "t_hf: FAIL: a tied config's lm_head.weight dropped without a word"; exit 1; }
echo "ok: a tied config's lm_head.weight is named as not read"
# The test driver's export checks its output and its shard size as the trainer does (it wrote 12-byte
# shards for "12x", and failed on a FIFO with exit 1 after loading).
mkfifo "$TEST_TMP/fifo"
for case in "$TEST_TMP/fifo|exists and is not a directory" "$TEST_TMP/drv 12x|MAX_SHARD_BYTES 12x: must be a whole number" \
            "$TEST_TMP/drv 0|MAX_SHARD_BYTES 0: must be" "$TEST_TMP/shards|is the checkpoint being read"; do
    args=${case%%|*} want=${case#*|} rc=0
    # shellcheck disable=SC2086  # args: the output and the shard size, split on purpose
    err=$("$BUILD/tests/hf_driver" export "$TEST_TMP/shards" $args 2>&1 >/dev/null) || rc=$?
    [ "$rc" = 2 ] && [ "$(printf '%s\n' "$err" | grep -c .)" = 1 ] && [[ "$err" == *"$want"* ]] ||
        { echo "t_hf: FAIL: hf_driver export ... $args -> exit $rc: $err (wanted exit 2, one line with '$want')"; exit 1; }
    echo "ok: $err"
done
[ ! -e "$TEST_TMP/drv" ] || { echo "t_hf: FAIL: a refused export left $TEST_TMP/drv"; exit 1; }
echo "t_hf: PASS"
