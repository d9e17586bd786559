#!/usr/bin/env bash
# Chapters 3-5 under mpirun: ZeRO stages 1-3 at 2, 4 and 8 ranks, HSDP, activation checkpointing
# with DDP and FSDP, resume of sharded state, memory by stage, the ZeRO-3 timeline (prefetch, and each
# reshard policy's all-gathers per step), bad input.
# Tolerances (fp32), as in tests/t_ddp.sh: the sharded gradient is the reference's sum added in
# another order (per-rank matmuls, then the reduce-scatter's rank-order sum), so
#   losses: rtol 1e-5; params after 20 AdamW steps: rtol 5e-4 of each tensor's max (AdamW's
#   1/sqrt(v) turns last-bit gradient differences on tiny gradients into ~lr moves).
#   Seen: 8.6e-6 (2 ranks, every stage), 4.3e-5 (4), 1.6e-5 (8) with OpenBLAS's Cooperlake kernels
#   (an AVX-512 Xeon's kernels: 3.3e-5 at 2 ranks, 1.1e-4 at 8).
# Exact (bit-identical) where the arithmetic is the same: reshard-after-forward policies, prefetch
# on/off and activation checkpointing change when and where values live, never the sums.
set -eu
source tests/lib.sh
# Step-1 gradients too (rtol 1e-5 of each tensor's largest, as tests/t_tp.sh): with every step's
# norm above --grad-clip 1, clipping and AdamW's scale invariance left the losses and weights of a
# reduce-scatter that summed where it averages (N times the gradient) within their bounds.
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3)
"$BUILD/train" "${common[@]}" --checkpoint-dir "$T/ref" --dump "$T/ref.dump.safetensors" > "$T/ref.log"
run() {  # name, ranks, extra flags... (a run that resumes has no step 1 to dump)
    local name=$1 np=$2; shift 2
    local dump=(--grad-dump "$T/$name.grads.safetensors")
    [[ " $* " != *" --resume "* ]] || dump=()
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/$name" "${dump[@]}" \
        > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
ckpt() { echo "$T/$1/step_000020.safetensors"; }
check_vs_ref() {  # name [reference name]
    local ref=${2:-ref}
    echo "== $1 vs the single process"
    $P --log "$T/$1.log" --log-ref "$T/$ref.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt "$ref")" \
       --param-rtol 5e-4
    $P --ckpt "$T/$1.grads.safetensors" --ckpt-ref "$T/$ref.dump.safetensors" --prefix grad. --param-rtol 1e-5
}
check_exact() {  # name, reference name, what
    echo "== $1 vs $2 ($3): bit-identical"
    $P --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt "$2")" --exact
}

for np in 2 4 8; do
    for stage in 1 2 3; do
        run "z${stage}_np$np" "$np" --dp-shard "$np" --zero-stage "$stage"
        check_vs_ref "z${stage}_np$np"
    done
done
# 3 ranks: no unit of tiny divides by 3, so every shard is padded (chapter 3: S = ceil(U / N)); a
# batch of 6 against its own single process.
common=(--model tiny --steps 20 --batch 6 --seed 5 --lr 1e-3)
"$BUILD/train" "${common[@]}" --checkpoint-dir "$T/ref_b6" --dump "$T/ref_b6.dump.safetensors" > "$T/ref_b6.log"
for stage in 1 2 3; do
    run "z${stage}_np3" 3 --dp-shard 3 --zero-stage "$stage"
    check_vs_ref "z${stage}_np3" ref_b6
done
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3)
run z2_np2_accum 2 --dp-shard 2 --zero-stage 2 --grad-accum-steps 2
check_vs_ref z2_np2_accum
run z1_np2_accum 2 --dp-shard 2 --zero-stage 1 --grad-accum-steps 4
check_vs_ref z1_np2_accum

# ZeRO-3 policies: memory changes, arithmetic does not.
run z3_always 2 --dp-shard 2 --reshard-after-forward always
check_exact z3_always z3_np2 "reshard always vs default"
run z3_never 2 --dp-shard 2 --reshard-after-forward never --no-overlap
check_exact z3_never z3_np2 "reshard never, no prefetch vs default"

# HSDP: shard within pairs, replicate across them. Against the reference and against plain FSDP
# over the same 4 ranks (the same averages, in another grouping: tolerance, not bits).
run hsdp_2x2 4 --dp-replicate 2 --dp-shard 2
check_vs_ref hsdp_2x2
echo "== hsdp 2x2 vs fsdp 4"
$P --ckpt "$(ckpt hsdp_2x2)" --ckpt-ref "$(ckpt z3_np4)" --param-rtol 5e-4
run hsdp_2x2_z2 4 --dp-replicate 2 --dp-shard 2 --zero-stage 2
check_vs_ref hsdp_2x2_z2

# Activation checkpointing: recompute is exact, under every data-parallel scheme.
run z3_ac_full 2 --dp-shard 2 --ac full
check_exact z3_ac_full z3_np2 "ac full vs none, zero-3"
run z1_ac_selective 2 --dp-shard 2 --zero-stage 1 --ac selective
check_exact z1_ac_selective z1_np2 "ac selective vs none, zero-1"
run z2_ac_full 2 --dp-shard 2 --zero-stage 2 --ac full
check_exact z2_ac_full z2_np2 "ac full vs none, zero-2"
run ddp_np2 2 --dp-replicate 2
run ddp_ac_selective 2 --dp-replicate 2 --ac selective
check_exact ddp_ac_selective ddp_np2 "ac selective vs none, ddp"
"$BUILD/train" "${common[@]}" --ac full --checkpoint-dir "$T/ref_ac_full" > "$T/ref_ac_full.log"
check_exact ref_ac_full ref "ac full vs none, single process"
"$BUILD/train" "${common[@]}" --ac selective --checkpoint-dir "$T/ref_ac_selective" > "$T/ref_ac_selective.log"
check_exact ref_ac_selective ref "ac selective vs none, single process"
# Equal results would also come from not checkpointing at all: the measured activation peak must
# fall by what the run's "ac" line promises (X MiB x N blocks, minus the shared recompute buffers),
# within 10% (the promise counts the blocks' buffers, the peak everything alive at that moment).
for ac in selective full; do
    promise=$(sed -nE "s/^ac $ac: .*saves ([0-9.]+) MiB x ([0-9]+) blocks, minus ([0-9.]+) MiB.*/\1 x \2 - \3/p" "$T/ref_ac_$ac.log")
    saved=$(awk -v a="$(activations_peak "$T/ref.log")" -v b="$(activations_peak "$T/ref_ac_$ac.log")" 'BEGIN { print a - b }')
    awk -v p="$promise" -v s="$saved" 'BEGIN { split(p, f, " "); want = f[1] * f[3] - f[5]
        exit !(want > 0 && s > 0.9 * want && s < 1.1 * want) }' ||
        { echo "FAIL: --ac $ac saved $saved MiB of activations, its log promised $promise MiB"; exit 1; }
    echo "ok: --ac $ac: the activation peak falls by $saved MiB; its log promised $promise MiB"
done

# Resume: 10 steps, then 10 more from the gathered checkpoint, equals 20 in one go.
$MPIRUN -np 2 "$BUILD/train" "${common[@]}" --dp-shard 2 --checkpoint-dir "$T/resume" --checkpoint-every 10 \
    > "$T/resume_a.log" 2>&1
rm "$T/resume/step_000020.safetensors"
run resume 2 --dp-shard 2 --resume "$T/resume/step_000010.safetensors"
check_exact resume z3_np2 "zero-3 resumed at step 10 vs straight through"

echo "== memory: measured peaks against the stage's formula (tests/py/check_zero_memory.py)"
$PYTHON tests/py/check_zero_memory.py "$T/z1_np4.log" "$T/z2_np4.log" "$T/z3_np4.log"
# the default policy with prefetch allows two blocks in full at once (the running one and the next),
# and every zero-3 run above kept no more than its policy allows, and none past its backward
grep -q "the reshard policy and prefetch allow 2; " "$T/z3_np4.log" ||
    { echo "FAIL: zero-3 with prefetch does not allow 2 blocks in full at once"; exit 1; }
$PYTHON tests/py/check_zero_memory.py --blocks "$T"/z3_np{2,3,4,8}.log "$T"/{z3_always,z3_never,z3_ac_full,hsdp_2x2,resume}.log

echo "== the ZeRO-3 timeline: with prefetch the next unit's weights are gathered before each block, without none overlaps"
trace_run() {  # name, extra flags
    local name=$1; shift
    $MPIRUN -np 2 "$BUILD/train" --model small --steps 2 --batch 4 --seq-len 64 --dp-shard 2 "$@" \
        --trace "$T/$name.pftrace" --trace-json "$T/$name.json" > "$T/$name.log" 2>&1 \
        || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
trace_run trace_prefetch
trace_run trace_no_prefetch --no-overlap
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_prefetch.json" --expect-prefetch "$T/trace_no_prefetch.json" --expect-gathers 13
# The reshard policies by their all-gathers per step (small: 6 blocks; the default's 13 just above).
trace_run trace_always --reshard-after-forward always
trace_run trace_never --reshard-after-forward never
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_always.json" --expect-gathers 15
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_never.json" --expect-gathers 8
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_no_prefetch.json" --expect-no-gather-overlap
# The gathers' order, and the gradients reduce-scattered (not all-reduced) on the shard group, HSDP's
# all-reduced over the replicas: what equal losses cannot show.
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_prefetch.json" --expect-prefetch-order --expect-reduce-formula --shard 2
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_no_prefetch.json" --expect-no-prefetch-order --expect-reduce-formula --shard 2
$MPIRUN -np 4 "$BUILD/train" --model tiny --steps 2 --batch 8 --dp-replicate 2 --dp-shard 2 --trace-json "$T/trace_hsdp.json" \
    > "$T/trace_hsdp.log" 2>&1 || { cat "$T/trace_hsdp.log"; echo "FAIL: run trace_hsdp"; exit 1; }
$PYTHON tests/py/check_fsdp_trace.py "$T/trace_hsdp.json" --expect-prefetch-order --expect-reduce-formula --shard 2 --replicate 2
traces/trace-summary "$T/trace_prefetch.pftrace"
traces/trace-summary "$T/trace_no_prefetch.pftrace"

echo "== bad input exits 2 with one line"
set +e
expect_error 2 "--zero-stage 4: must be between 1 and 3" --dp-shard 2 --zero-stage 4
expect_error 2 "--zero-stage 0: must be between 1 and 3" --dp-shard 2 --zero-stage 0
expect_error 2 "--ac partial: must be one of none|full|selective" --dp-shard 2 --ac partial
expect_error 4 "but mpirun started 4" --dp-shard 3
expect_error 4 "but mpirun started 4" --dp-shard 2 --dp-replicate 3
expect_error 2 "--reshard-after-forward sometimes" --dp-shard 2 --reshard-after-forward sometimes
set -e
echo "t_fsdp: OK"
