#!/usr/bin/env bash
# One grader check: RANKS FLAGS... trains tiny for 20 steps under mpirun and compares the loss at
# every step and the weights after the last one with the single process (tolerances of
# tests/t_fsdp.sh: loss rtol 1e-5, weights rtol 5e-4).
set -eu
np=$1; shift
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3)
[ -f "$TEST_TMP/ref/step_000020.safetensors" ] || "$BUILD/train" "${common[@]}" --checkpoint-dir "$TEST_TMP/ref" > "$TEST_TMP/ref.log"
$MPIRUN_LAB -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$TEST_TMP/run" > "$TEST_TMP/run.log" 2>&1 \
    || { grep -m1 "is yours to write" "$TEST_TMP/run.log" || tail -5 "$TEST_TMP/run.log"; exit 1; }
"$PYTHON" tests/py/compare_runs.py --log "$TEST_TMP/run.log" --log-ref "$TEST_TMP/ref.log" --loss-rtol 1e-5 \
    --ckpt "$TEST_TMP/run/step_000020.safetensors" --ckpt-ref "$TEST_TMP/ref/step_000020.safetensors" --param-rtol 5e-4
