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
if "$PYTHON" tests/py/hf_interop.py --build "$BUILD" --tmp "$TEST_TMP/hf" --mpirun "$MPIRUN"; then
    echo "t_hf: PASS"
else
    echo "t_hf: FAIL"; exit 1
fi
