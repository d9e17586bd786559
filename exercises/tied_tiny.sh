#!/usr/bin/env bash
# exercises/tied_tiny.sh DIR: `tiny` with tied embeddings (the output layer reads the embedding
# table, as Llama 3.2 1B does) as a Hugging Face checkpoint in DIR, for the checks that need a unit
# used twice (train --init-from hf:DIR). Made once: tiny's seeded weights exported, its config
# marked tied and lm_head.weight left out. Safe to run from several checks at once.
set -eu -o pipefail
dir=$1
(
    flock 9
    [ -f "$dir/done" ] && exit 0
    rm -rf "$dir" "$dir.export"
    "${REF_TRAIN:-$BUILD/train}" --model tiny --steps 1 --batch 2 --seq-len 16 --lr 0 --export-hf "$dir.export" > /dev/null
    "$PYTHON" - "$dir.export" <<'PY'
import json, os, sys
sys.path.insert(0, "tests/py")
import safetensors_io
d = sys.argv[1]
config = json.load(open(os.path.join(d, "config.json")))
config["tie_word_embeddings"] = True
json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=1)
tensors, metadata = safetensors_io.load(os.path.join(d, "model.safetensors"))
del tensors["lm_head.weight"]
safetensors_io.save(os.path.join(d, "model.safetensors"), tensors, metadata)
PY
    mv "$dir.export" "$dir" && touch "$dir/done"
) 9> "$dir.lock"
