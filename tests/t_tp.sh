#!/usr/bin/env bash
# Chapter 6: tensor parallelism against the single process, alone and with DDP / FSDP / PP.
# Compared: the loss at every step, the step-1 gradients (train --grad-dump, gathered to full
# tensors, against the reference's --dump) and the parameters after 20 steps.
# Tolerances (fp32):
#   losses rtol 1e-5 and parameters rtol 5e-4, as in tests/t_ddp.sh (a sum in another order;
#   AdamW's 1/sqrt(v) turns last-bit gradient differences into ~lr moves over 20 steps);
#   step-1 gradients rtol 1e-5 of each tensor's largest value: a tp rank's partial products (its
#   heads, its ffn columns, its vocabulary rows) are summed by the all-reduce instead of inside one
#   matmul, and the softmax's normaliser is built from per-shard sums; that changes the rounding of
#   a few fp32 operations, ~1e-7 relative, far below 1e-5.
# Exact: activation checkpointing on vs off under tp (the recompute repeats the all-reduces), with
# and without sequence parallel.
set -eu
source tests/lib.sh
# The loss on inputs training never produces (logits ~ +-1e3, ignored targets): build/tp_loss.
for np in 1 2 3 4; do
    $MPIRUN -np "$np" "$BUILD/tp_loss" || { echo "FAIL: tp_loss on $np ranks"; exit 1; }
done
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3)
"$BUILD/train" "${common[@]}" --checkpoint-dir "$T/ref" --dump "$T/ref_dump.safetensors" > "$T/ref.log"
run() {  # name, ranks, extra flags...
    local name=$1 np=$2; shift 2
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/$name" \
        --grad-dump "$T/$name.grads.safetensors" > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
ckpt() { echo "$T/$1/step_000020.safetensors"; }
check_vs_ref() {  # name
    echo "== $1 vs the single process"
    $P --log "$T/$1.log" --log-ref "$T/ref.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt ref)" \
       --param-rtol 5e-4
    $P --ckpt "$T/$1.grads.safetensors" --ckpt-ref "$T/ref_dump.safetensors" --prefix grad. --param-rtol 1e-5
}

run tp2 2 --tp 2
check_vs_ref tp2
run tp4 4 --tp 4
check_vs_ref tp4
run tp2_ddp2 4 --tp 2 --dp-replicate 2
check_vs_ref tp2_ddp2
run tp2_fsdp2 4 --tp 2 --dp-shard 2
check_vs_ref tp2_fsdp2
run tp2_zero1 4 --tp 2 --dp-shard 2 --zero-stage 1
check_vs_ref tp2_zero1
run tp2_sp 2 --tp 2 --sequence-parallel
check_vs_ref tp2_sp
run tp4_sp 4 --tp 4 --sequence-parallel
check_vs_ref tp4_sp
run tp2_sp_fsdp2 4 --tp 2 --sequence-parallel --dp-shard 2 --ac selective
check_vs_ref tp2_sp_fsdp2
run tp2_sp_ac 2 --tp 2 --sequence-parallel --ac full
echo "== tp2 + sequence parallel with full activation checkpointing vs without: bit-identical"
$P --ckpt "$(ckpt tp2_sp_ac)" --ckpt-ref "$(ckpt tp2_sp)" --exact
# With pipeline parallelism (chapter 7): 2D pp x tp, and 3D pp x dp x tp on 8 ranks (DDP, and
# ZeRO-1: the AdamW state sharded over dp_shard).
run pp2_tp2 4 --pp 2 --tp 2
check_vs_ref pp2_tp2
run pp2_tp2_sp 4 --pp 2 --tp 2 --sequence-parallel --pp-schedule GPipe
check_vs_ref pp2_tp2_sp
run pp2_dp2_tp2 8 --pp 2 --dp-replicate 2 --tp 2 --pp-microbatches 2
check_vs_ref pp2_dp2_tp2
run pp2_zero1_tp2 8 --pp 2 --dp-shard 2 --zero-stage 1 --tp 2 --pp-microbatches 2  # 3D with a sharded optimizer
check_vs_ref pp2_zero1_tp2
run tp2_accum 2 --tp 2 --grad-accum-steps 2 --attention naive
"$BUILD/train" "${common[@]}" --grad-accum-steps 2 --attention naive --checkpoint-dir "$T/ref_naive" \
    --grad-dump "$T/ref_naive.grads.safetensors" > "$T/ref_naive.log"
echo "== tp2, naive attention, 2 micro-batches vs the single process"
$P --log "$T/tp2_accum.log" --log-ref "$T/ref_naive.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 --ckpt "$(ckpt tp2_accum)" \
   --ckpt-ref "$(ckpt ref_naive)" --param-rtol 5e-4
$P --ckpt "$T/tp2_accum.grads.safetensors" --ckpt-ref "$T/ref_naive.grads.safetensors" --prefix grad. --param-rtol 1e-5

run tp2_ac 2 --tp 2 --ac full
echo "== tp2 with full activation checkpointing vs without: bit-identical"
$P --ckpt "$(ckpt tp2_ac)" --ckpt-ref "$(ckpt tp2)" --exact

echo "== the trace: tp all-reduces on comm:tp, sized tokens x dim"
$MPIRUN -np 2 "$BUILD/train" --model tiny --steps 1 --batch 4 --tp 2 --trace-json "$T/tp.json" > "$T/tp_trace.log" 2>&1
$PYTHON tests/py/check_tp_trace.py "$T/tp.json" --layers 4 --tokens $((4 * 32)) --dim 64
$MPIRUN -np 2 "$BUILD/train" --model tiny --steps 1 --batch 4 --tp 2 --sequence-parallel --trace-json "$T/tp_sp.json" \
    > "$T/tp_sp_trace.log" 2>&1
$PYTHON tests/py/check_tp_trace.py "$T/tp_sp.json" --layers 4 --tokens $((4 * 32)) --dim 64 --sequence-parallel

echo "== bad input exits 2 with one line"
set +e
expect_error 4 "--tp 4: must divide" --tp 4 --model small
expect_error 3 "--tp 3: must divide" --tp 3
expect_error 4 "but mpirun started 4" --tp 2
expect_error 1 "--sequence-parallel: needs --tp 2" --sequence-parallel
expect_error 4 "--sequence-parallel: the 3 tokens" --tp 4 --sequence-parallel --batch 1 --seq-len 3
set -e
echo "t_tp: OK"
