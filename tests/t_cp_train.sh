#!/usr/bin/env bash
# Chapter 8 in the trainer: --cp against the single process on the same tokens. Compared: the loss
# at every step, the step-1 gradients (--grad-dump against the reference's --dump) and the
# parameters at the end. Tolerances as tests/t_tp.sh (fp32): losses rtol 1e-5, step-1 gradients
# 1e-5 of each tensor's largest value (the attention softmax assembled from per-rank blocks through
# the log-sum-exp, dK/dV summed over the ring, gradients averaged over cp: measured <= 1e-6), and
# parameters 2e-3: AdamW divides by sqrt(v), so an element whose gradient is near zero moves by up
# to ~lr per step in a direction a last-bit difference can flip. Measured: 6.5e-4 for cp 2 x tp 2
# after 6 steps on one such element of w2 (tp 2 alone: 5.0e-4 on the same element); the gradients,
# compared at 1e-5, are the sharp check.
# Layouts: cp 2 and 4 (ring, zigzag) for 20 steps; all-to-all; contiguous; dp_shard 2 x cp 2;
# cp 2 x tp 2; pp 2 x cp 2; pp 2 x cp 2 x tp 2 (8 ranks); activation checkpointing full and
# selective. Then the trace's cp transfers against the formula, and bad input.
set -eu
source tests/lib.sh
common=(--model tiny --batch 4 --seq-len 32 --seed 7 --lr 1e-3)
reference() {  # steps
    "$BUILD/train" "${common[@]}" --steps "$1" --checkpoint-dir "$T/ref$1" --dump "$T/ref$1_dump.safetensors" \
        > "$T/ref$1.log" 2>&1
}
reference 20
reference 6
run() {  # name, ranks, steps, extra flags...
    local name=$1 np=$2 steps=$3; shift 3
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" --steps "$steps" "$@" --checkpoint-dir "$T/$name" \
        --grad-dump "$T/$name.grads.safetensors" > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
    echo "== $name ($*) vs the single process"
    local ck; ck=$(printf 'step_%06d.safetensors' "$steps")
    $P --log "$T/$name.log" --log-ref "$T/ref$steps.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 --ckpt "$T/$name/$ck" \
       --ckpt-ref "$T/ref$steps/$ck" --param-rtol 2e-3
    $P --ckpt "$T/$name.grads.safetensors" --ckpt-ref "$T/ref${steps}_dump.safetensors" --prefix grad. --param-rtol 1e-5
}
run cp2 2 20 --cp 2
run cp4 4 20 --cp 4
run cp2_alltoall 2 6 --cp 2 --cp-mode alltoall
run cp4_contiguous 4 6 --cp 4 --cp-load-balance off
run cp2_ac_full 2 6 --cp 2 --ac full
run cp2_ac_selective 2 6 --cp 2 --ac selective
run fsdp2_cp2 4 6 --dp-shard 2 --cp 2
run cp2_tp2 4 6 --cp 2 --tp 2
run pp2_cp2 4 6 --pp 2 --cp 2 --pp-microbatches 2
run pp2_cp2_tp2 8 6 --pp 2 --cp 2 --tp 2 --pp-microbatches 2
grep -q "cp: 2 ranks, ring attention, zigzag split: this rank holds 16 of every 32 tokens" "$T/cp2.log" ||
    { echo "FAIL: cp2 did not log its split"; exit 1; }
# the numbers above do not tell the modes apart (both are exact attention): the log and the trace do
grep -q "cp: 2 ranks, all-to-all (Ulysses), zigzag split" "$T/cp2_alltoall.log" ||
    { grep "^cp:" "$T/cp2_alltoall.log"; echo "FAIL: cp2_alltoall did not run all-to-all"; exit 1; }

echo "== the trace's cp transfers"
$MPIRUN -np 2 "$BUILD/train" --model tiny --batch 2 --seq-len 32 --steps 2 --cp 2 --trace-json "$T/cp.json" \
    > "$T/cp_trace.log" 2>&1 || { cat "$T/cp_trace.log"; exit 1; }
$PYTHON tests/py/check_cp_trace.py "$T/cp.json" --cp 2 --layers 4 --microbatches 1 --steps 2
$MPIRUN -np 2 "$BUILD/train" --model tiny --batch 2 --seq-len 32 --steps 1 --cp 2 --ac full --grad-accum-steps 2 \
    --trace-json "$T/cp_ac.json" > "$T/cp_ac.log" 2>&1 || { cat "$T/cp_ac.log"; exit 1; }
$PYTHON tests/py/check_cp_trace.py "$T/cp_ac.json" --cp 2 --layers 4 --microbatches 2 --steps 1 --ac-full
$MPIRUN -np 2 "$BUILD/train" --model tiny --batch 2 --seq-len 32 --steps 1 --cp 2 --cp-mode alltoall \
    --trace-json "$T/cp_a2a.json" > "$T/cp_a2a.log" 2>&1 || { cat "$T/cp_a2a.log"; exit 1; }
$PYTHON tests/py/check_cp_trace.py "$T/cp_a2a.json" --cp 2 --layers 4 --microbatches 1 --steps 1 --mode alltoall

echo "== bad input"
set +e  # expect_error's runs fail on purpose
expect_error 4 "--cp 4 with --seq-len 20: the sequence length must divide by 2 x cp" --cp 4 --seq-len 20
expect_error 8 "both must divide by cp" --cp 4 --tp 2 --cp-mode alltoall  # 2 kv heads per tp rank
expect_error 2 "--attention naive with --cp 2" --cp 2 --attention naive
expect_error 1 "--cp-mode: needs --cp 2 or more" --cp-mode alltoall
set -e
