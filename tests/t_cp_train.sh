#!/usr/bin/env bash
# Chapter 8: training with context parallelism against the single process, alone and composed
# with DDP, FSDP, TP, PP and in 3D. Compared as in tests/t_tp.sh: the loss at every step (rtol 1e-5),
# the step-1 gradients (train --grad-dump vs the reference's --dump, rtol 1e-5 of each tensor's
# largest value) and the parameters after 20 steps (rtol 5e-4: AdamW's 1/sqrt(v) turns last-bit
# gradient differences into ~lr moves). What differs from the single process is summation order
# only: ring attention's merged partial softmaxes (~1e-6 relative, tests/test_cp_mpi.c), and the
# weight gradients summed over the cp ranks' tokens by the all-reduce instead of inside one matmul.
# Exact: full and selective activation checkpointing vs none under cp (the recompute repeats the
# ring with the same numbers).
set -eu
source tests/lib.sh
common=(--model tiny --steps 20 --batch 4 --seed 5 --lr 1e-3)
"$BUILD/train" "${common[@]}" --checkpoint-dir "$T/ref" --dump "$T/ref_dump.safetensors" > "$T/ref.log"
run() {  # name, ranks, extra flags...
    local name=$1 np=$2; shift 2
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/$name" \
        --grad-dump "$T/$name.grads.safetensors" > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
ckpt() { echo "$T/$1/step_000020.safetensors"; }
check_vs_ref() {  # name
    echo "== $1 vs the single process"
    $P --log "$T/$1.log" --log-ref "$T/ref.log" --loss-rtol 1e-5 --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt ref)" \
       --param-rtol 5e-4
    $P --ckpt "$T/$1.grads.safetensors" --ckpt-ref "$T/ref_dump.safetensors" --prefix grad. --param-rtol 1e-5
}

run cp2 2 --cp 2
check_vs_ref cp2
run cp4 4 --cp 4
check_vs_ref cp4
run cp2_contiguous 2 --cp 2 --cp-load-balance off
check_vs_ref cp2_contiguous
run cp2_alltoall 2 --cp 2 --cp-mode alltoall
check_vs_ref cp2_alltoall
run ddp2_cp2 4 --dp-replicate 2 --cp 2
check_vs_ref ddp2_cp2
run fsdp2_cp2 4 --dp-shard 2 --cp 2
check_vs_ref fsdp2_cp2
run cp2_tp2 4 --cp 2 --tp 2
check_vs_ref cp2_tp2
run cp2_tp2_alltoall 4 --cp 2 --tp 2 --cp-mode alltoall
check_vs_ref cp2_tp2_alltoall
run pp2_cp2 4 --pp 2 --cp 2
check_vs_ref pp2_cp2
run fsdp2_cp2_tp2 8 --dp-shard 2 --cp 2 --tp 2
check_vs_ref fsdp2_cp2_tp2
run pp2_cp2_tp2 8 --pp 2 --cp 2 --tp 2
check_vs_ref pp2_cp2_tp2
run cp2_ac_full 2 --cp 2 --ac full
echo "== cp2 with full activation checkpointing vs without: bit-identical"
$P --ckpt "$(ckpt cp2_ac_full)" --ckpt-ref "$(ckpt cp2)" --exact
run cp2_ac_selective 2 --cp 2 --ac selective
echo "== cp2 with selective activation checkpointing vs without: bit-identical"
$P --ckpt "$(ckpt cp2_ac_selective)" --ckpt-ref "$(ckpt cp2)" --exact

echo "== bad input exits 2 with one line"
set +e
expect_error 1 "--cp 3: the sequence length 32 must divide by 2 x cp" --cp 3
expect_error 1 "--cp 3: the sequence length 31 must divide by cp = 3" --cp 3 --cp-load-balance off --seq-len 31
expect_error 1 "--cp-mode alltoall: the 2 kv heads (per tensor-parallel rank) must divide by --cp 4" --cp 4 --tp 2 --cp-mode alltoall
expect_error 1 "--cp 2: needs --attention flash" --cp 2 --attention naive
expect_error 1 "--cp-mode: needs --cp 2 or more" --cp-mode alltoall
expect_error 1 "--cp 2 with --sequence-parallel: not supported" --cp 2 --tp 2 --sequence-parallel
expect_error 1 "--cp 2 with --pp 2 and --dp-shard 2: not supported" --cp 2 --pp 2 --dp-shard 2 --zero-stage 1
expect_error 4 "but mpirun started 4" --cp 2
set -e
echo "t_cp_train: OK"
