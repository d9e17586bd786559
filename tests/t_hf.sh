#!/usr/bin/env bash
# Hugging Face Llama interop against transformers' LlamaForCausalLM (tests/py/hf_interop.py): import
# (logits, loss, every gradient; fp32 and float64 builds), per-shard reads, export that transformers
# loads (one file and sharded), bit-identical round trip, and bad files exiting 2 with one line.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:-$(mktemp -d)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if "$PYTHON" tests/py/hf_interop.py --build "$BUILD" --tmp "$TEST_TMP/hf"; then
    echo "t_hf: PASS"
else
    echo "t_hf: FAIL"; exit 1
fi
