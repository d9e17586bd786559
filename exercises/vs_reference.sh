#!/usr/bin/env bash
# One grader check: RANKS FLAGS... trains tiny for 2 steps under mpirun and compares it with the
# single process (the unmodified trainer, $REF_TRAIN, run once and shared by every check):
#   the step-1 gradients (train --grad-dump vs the reference's --dump), rtol 1e-5 of each tensor's
#     largest value as in tests/t_tp.sh: a gradient N times too large is caught here even though
#     clipping and AdamW's scale invariance would hide it in the losses;
#   the loss at both steps, rtol 1e-5 (a loss-only mismatch fails too);
#   the weights after step 2, rtol 5e-4 (tests/t_fsdp.sh).
# MODEL: the model flags of both runs (default --model tiny; e.g. --init-from hf:DIR for a model with
# tied embeddings, exercises/tied_tiny.sh). TRACE_CHECK="KIND ARGS" also records the run's trace and checks its structure with
# tests/py/check_KIND_trace.py TRACE ARGS (the chapters' own checks); {ckpt} in ARGS is the run's
# last checkpoint. REF_FLAGS: flags of the reference run too (e.g. --grad-accum-steps 2, --fp8); its
# step-1 gradients then come from its --grad-dump. EXACT=1:
# gradients and weights must be bit-identical (activation checkpointing recomputes the same bits).
# FREED=1: after the last step no rank holds activations (the trainer's "activations held after
# the last step" line, the most on any rank, is 0.00 MiB): a schedule that never frees what it sent
# computes the same numbers while its memory grows every step, on whichever stage sends.
set -eu -o pipefail
np=$1; shift
model=(${MODEL:---model tiny})
common=("${model[@]}" --steps 2 --batch 8 --seed 5 --lr 1e-3)
ref_flags=(${REF_FLAGS:-})
ref=$REF_CACHE/vs_reference$(echo "${MODEL:-}${REF_FLAGS:-}" | tr -c 'a-z0-9\n' _)
dump=(--dump "$ref/dump.safetensors")  # the step-1 gradients (--dump records a plain single-process step)
[ -z "${REF_FLAGS:-}" ] || dump=(--grad-dump "$ref/dump.safetensors")  # with the flags: the same step's gradients
(
    flock 9
    [ -f "$ref/done" ] || { mkdir -p "$ref" && "$REF_TRAIN" "${common[@]}" "${ref_flags[@]}" --checkpoint-dir "$ref" \
        "${dump[@]}" > "$ref/train.log" && touch "$ref/done"; }
) 9> "$REF_CACHE/vs_reference.lock"
trace=()
[ -n "${TRACE_CHECK:-}" ] && trace=(--trace-json "$TEST_TMP/trace.json")
echo "mpirun -np $np train ${common[*]} $*"
$MPIRUN_LAB -np "$np" "$BUILD/train" "${common[@]}" "${ref_flags[@]}" "$@" --checkpoint-dir "$TEST_TMP/run" \
    --grad-dump "$TEST_TMP/grads.safetensors" "${trace[@]}" > "$TEST_TMP/train.log" 2>&1 \
    || { cat "$TEST_TMP/train.log"; echo "FAIL: the run stopped (log above)"; exit 1; }
compare="$PYTHON tests/py/compare_runs.py"
exact=()
[ -z "${EXACT:-}" ] || exact=(--exact)
echo "== step-1 gradients vs the single process"
$compare --ckpt "$TEST_TMP/grads.safetensors" --ckpt-ref "$ref/dump.safetensors" --prefix grad. --param-rtol 1e-5 "${exact[@]}"
echo "== losses and weights vs the single process"
$compare --log "$TEST_TMP/train.log" --log-ref "$ref/train.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 \
    --ckpt "$TEST_TMP/run/step_000002.safetensors" --ckpt-ref "$ref/step_000002.safetensors" --param-rtol 5e-4 "${exact[@]}"
if [ -n "${FREED:-}" ]; then
    held=$(sed -n 's/^activations held after the last step, the most on any rank: \([0-9.]*\) MiB$/\1/p' "$TEST_TMP/train.log")
    echo "== activations held after the last step, the most on any rank: ${held:-?} MiB (want 0.00)"
    [ "$held" = "0.00" ] || { echo "FAIL: ${held:-?} MiB of activations still held after the last step: what a" \
        "micro-batch sent or received is never freed (1F1B must hold at most p micro-batches)"; exit 1; }
fi
if [ -n "${TRACE_CHECK:-}" ]; then
    read -r kind args <<< "${TRACE_CHECK//\{ckpt\}/$TEST_TMP/run/step_000002.safetensors}"
    echo "== the trace: check_${kind}_trace.py $args"
    $PYTHON "tests/py/check_${kind}_trace.py" "$TEST_TMP/trace.json" $args
fi
