#!/usr/bin/env bash
# Chapter 7: pipeline parallelism against the single process at the same global batch: every
# schedule at p = 2 and 4, m = p and 2p, v = 1 and 2; an uneven split; PP x DDP; resume; the
# schedule diagram; a traced run's bubble; activation memory by schedule; bad layouts.
#
# Compared: the loss at every step, the step-1 gradients (--grad-dump, gathered from the stages)
# and the parameters after 20 steps.
# Tolerances (fp32). Against the plain single process (one micro-batch of 8): losses rtol 1e-5,
# step-1 gradients rtol 1e-5 of each tensor's max, parameters after 20 AdamW steps rtol 5e-4, as
# in t_ddp.sh and t_tp.sh: the pipeline splits the batch into micro-batches, so each weight
# gradient is a sum of m matmuls instead of one, the same terms added in another order (~1e-6
# relative at step 1), which AdamW's 1/sqrt(v) turns into ~lr moves of weights with tiny gradients
# over 20 steps (seen: up to 1.3e-4, 8 layers interleaved at m = 8; 3.9e-4 with an AVX-512 Xeon's
# BLAS kernels).
# Exact (bit-identical): pipelining does not change the per-sample arithmetic, only where it runs.
# Each stage runs the same functions on the same micro-batch shapes, and accumulates its gradients
# in micro-batch order 0..m-1 under every schedule, as the single process does with
# --grad-accum-steps m. The global norm is summed per stage and then over stages, in another order
# than the single process's one pass, and could in principle differ in its last double bit; in
# these runs it never changes the clipping factor, so every run is required to match
# `--grad-accum-steps m` bit for bit (losses, step-1 gradients and parameters). Likewise PP x DDP against DDP with the
# same micro-batches, and a resumed run against one straight through.
set -eu
T="$TEST_TMP"
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
export OMP_NUM_THREADS=1
P="$PYTHON tests/py/compare_runs.py"
source tests/lib.sh
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3 --bucket-mb 0.05)
ref() {  # name, extra flags...
    local name=$1; shift
    "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/$name" --grad-dump "$(grads "$name")" > "$T/$name.log"
}
run() {  # name, ranks, extra flags... (step-1 gradients dumped unless the run resumes: it has no step 1)
    local name=$1 np=$2; shift 2
    local dump=(--grad-dump "$(grads "$name")")
    [[ " $* " == *" --resume "* ]] && dump=()
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/$name" "${dump[@]}" \
        > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
ckpt() { echo "$T/$1/step_000020.safetensors"; }
grads() { echo "$T/$1.grads.safetensors"; }
check_vs_ref() {  # name, reference
    echo "== $1 vs the single process ($2)"
    $P --log "$T/$1.log" --log-ref "$T/$2.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt "$2")" \
       --param-rtol 5e-4
    $P --ckpt "$(grads "$1")" --ckpt-ref "$(grads "$2")" --prefix grad. --param-rtol 1e-5
}
check_exact() {  # name, reference, what
    echo "== $1 vs $2 ($3): bit-identical losses, step-1 gradients and parameters"
    $P --log "$T/$1.log" --log-ref "$T/$2.log" --loss-rtol 0 --grad-norm-rtol 0 --ckpt "$(ckpt "$1")" --ckpt-ref "$(ckpt "$2")" --exact
    $P --ckpt "$(grads "$1")" --ckpt-ref "$(grads "$2")" --prefix grad. --exact
}

ref ref
ref ref8 --n-layers 8
for m in 2 4 8; do ref "ref_accum$m" --grad-accum-steps "$m"; done
for m in 4 8; do ref "ref8_accum$m" --n-layers 8 --grad-accum-steps "$m"; done

# Every schedule; Interleaved1F1B also with v = 2 (4 stages of tiny's 4 layers at p = 2, 8 stages
# of 8 layers at p = 4).
for p in 2 4; do
    for m in "$p" $((2 * p)); do
        for schedule in GPipe 1F1B Interleaved1F1B; do
            name="pp${p}_${schedule}_m$m"
            run "$name" "$p" --pp "$p" --pp-schedule "$schedule" --pp-microbatches "$m"
            check_vs_ref "$name" ref
            check_exact "$name" "ref_accum$m" "--grad-accum-steps $m"
        done
        layers=(); reference=ref; [ "$p" -eq 4 ] && layers=(--n-layers 8) && reference=ref8
        name="pp${p}_Interleaved1F1B_v2_m$m"
        run "$name" "$p" --pp "$p" --pp-schedule Interleaved1F1B --pp-virtual-stages 2 --pp-microbatches "$m" \
            "${layers[@]}"
        check_vs_ref "$name" "$reference"
        check_exact "$name" "${reference}_accum$m" "--grad-accum-steps $m"
    done
done

# Uneven: 4 layers on 3 stages (2, 1, 1 blocks).
run pp3_uneven 3 --pp 3 --pp-schedule GPipe --pp-microbatches 4
grep -q "stage 0 on rank 0: embedding + blocks \[0, 2)" "$T/pp3_uneven.log" || { echo "FAIL: split"; exit 1; }
check_vs_ref pp3_uneven ref
check_exact pp3_uneven ref_accum4 "--grad-accum-steps 4"

# PP x DDP: 2 stages x 2 replicas. The replicas of a stage average their gradients (DDP over the
# stage's units) as DDP alone does with the same micro-batches. With --desync-init each replica
# starts from other weights (seed + dp rank) until each stage's broadcast makes them equal.
run ddp2_accum2 2 --dp-replicate 2 --grad-accum-steps 2
run pp2_dp2 4 --pp 2 --dp-replicate 2 --pp-microbatches 2
check_vs_ref pp2_dp2 ref
check_exact pp2_dp2 ddp2_accum2 "DDP alone, --grad-accum-steps 2"
run pp2_dp2_interleaved 4 --pp 2 --dp-replicate 2 --pp-schedule Interleaved1F1B --pp-virtual-stages 2 \
    --pp-microbatches 2 --desync-init
check_exact pp2_dp2_interleaved ddp2_accum2 "interleaved, desynchronised init, vs DDP alone"
grep -q "ddp: the replicas' weights were different before the broadcast from rank 0, and are equal after" \
    "$T/pp2_dp2_interleaved.log" || { echo "FAIL: --desync-init's stage replicas did not start different"; exit 1; }
# ZeRO-1 per stage (--dp-shard --zero-stage 1): the AdamW state sharded, each rank updating its
# slice of every chunk: element-wise the same arithmetic as DDP's full update, so bit-identical to
# pp2_dp2; and its sharded moments must survive a checkpoint (resume at step 10, bit-identical).
run pp2_zero1 4 --pp 2 --dp-shard 2 --zero-stage 1 --pp-microbatches 2
check_exact pp2_zero1 pp2_dp2 "pp x ddp (the same sums, the optimizer sharded)"
$MPIRUN -np 4 "$BUILD/train" "${common[@]}" --pp 2 --dp-shard 2 --zero-stage 1 --pp-microbatches 2 \
    --checkpoint-dir "$T/zero1_resume" --checkpoint-every 10 > "$T/zero1_resume_a.log" 2>&1
rm "$T/zero1_resume/step_000020.safetensors"
run zero1_resume 4 --pp 2 --dp-shard 2 --zero-stage 1 --pp-microbatches 2 --resume "$T/zero1_resume/step_000010.safetensors"
echo "== zero-1 per stage, resumed at step 10 vs straight through: bit-identical"
$P --ckpt "$(ckpt zero1_resume)" --ckpt-ref "$(ckpt pp2_zero1)" --exact

# Resume: 10 steps, then 10 more from the gathered checkpoint, equals 20 in one go; the checkpoint
# holds the whole model, so the single process resumes from it too.
args=(--pp 2 --pp-schedule Interleaved1F1B --pp-virtual-stages 2 --pp-microbatches 4)
$MPIRUN -np 2 "$BUILD/train" "${common[@]}" "${args[@]}" --checkpoint-dir "$T/resume" --checkpoint-every 10 \
    > "$T/resume_a.log" 2>&1
cp -r "$T/resume" "$T/resume_single"
rm "$T/resume/step_000020.safetensors" "$T/resume_single/step_000020.safetensors"
run resume 2 "${args[@]}" --resume "$T/resume/step_000010.safetensors"
echo "== resumed at step 10 vs straight through: bit-identical"
$P --ckpt "$(ckpt resume)" --ckpt-ref "$(ckpt pp2_Interleaved1F1B_v2_m4)" --exact
"$BUILD/train" "${common[@]}" --grad-accum-steps 4 --resume "$T/resume_single/step_000010.safetensors" \
    --checkpoint-dir "$T/resume_single" > "$T/resume_single.log"
echo "== the single process resumed from the pipeline's step-10 checkpoint: bit-identical"
$P --ckpt "$(ckpt resume_single)" --ckpt-ref "$(ckpt ref_accum4)" --exact

# Activations in flight, as the memory counters see them on rank 0 (the first stage): GPipe holds
# all 8 micro-batches, 1F1B at most p = 4.
peak() { activations_peak "$T/$1.log"; }
echo "== activation peak on rank 0, p=4 m=8: GPipe $(peak pp4_GPipe_m8) MiB, 1F1B $(peak pp4_1F1B_m8) MiB (ratio 8/4)"
awk -v g="$(peak pp4_GPipe_m8)" -v f="$(peak pp4_1F1B_m8)" 'BEGIN { r = g / f; exit !(r > 1.96 && r < 2.04) }' \
    || { echo "FAIL: GPipe / 1F1B activation peak is not 2"; exit 1; }

# The schedule as Graphviz, from the trainer.
command -v dot >/dev/null || { echo "FAIL: graphviz's dot not found: run 'make deps'"; exit 1; }
$MPIRUN -np 2 "$BUILD/train" --model tiny --steps 1 --batch 4 --pp 2 --pp-schedule Interleaved1F1B \
    --pp-virtual-stages 2 --pp-microbatches 2 --pp-schedule-dot "$T/schedule.dot" > "$T/dot.log" 2>&1
dot -Tsvg "$T/schedule.dot" -o "$T/schedule.svg"
n=$(grep -c "<title>r[01]_[0-9]*&#45;&gt;r[01]_[0-9]*</title>" "$T/schedule.svg")
echo "== schedule.svg: $n edges between actions (2 micro-batches x 3 boundaries x 2 directions = 12 transfers)"
[ "$(grep -c 'constraint=false' "$T/schedule.dot")" -eq 12 ] && [ "$n" -eq 12 ] ||
    { echo "FAIL: transfer edges (want 12 in the .dot and in the rendered .svg)"; exit 1; }

# A traced run per schedule, p = 2, m = 2, with enough compute per micro-batch (small, 4 layers,
# 2 x 64 tokens) for the pipeline to show over the transfers. trace-summary prints its columns;
# pp_bubble.py prints the bubble as the formula defines it (tests/py/pp_bubble.py). Measured bubbles
# depend on the machine's load, so they are printed, not asserted (timing comparisons belong in
# `make bench`). Asserted, because deterministic: the schedule's simulated bubble in the trainer's
# log (GPipe (p-1)/(m+p-1) = 33.3%, interleaved v=2 (p-1)/(v m+p-1) = 20.0%), and every rank running
# exactly its schedule list's forwards and backwards, in order, in every step (the lists from
# build/pp_schedule). The trace itself must be valid Perfetto with one flow per transfer
# (trace_check.py: every flow has one start and one end).
traced=(--model small --n-layers 4 --seq-len 64 --steps 4 --batch 4 --pp 2 --pp-microbatches 2)
for schedule in GPipe Interleaved1F1B; do
    v=$([ $schedule = GPipe ] && echo 1 || echo 2)
    ideal=$([ $schedule = GPipe ] && echo 33.3 || echo 20.0)
    $MPIRUN -np 2 "$BUILD/train" "${traced[@]}" --pp-schedule "$schedule" --pp-virtual-stages $v \
        --trace "$T/$schedule.pftrace" --trace-json "$T/$schedule.json" \
        > "$T/trace_$schedule.log" 2>&1 || { cat "$T/trace_$schedule.log"; echo "FAIL: traced $schedule"; exit 1; }
    echo "== $schedule, trace-summary:"
    traces/trace-summary "$T/$schedule.pftrace"
    $PYTHON tests/py/pp_bubble.py "$T/$schedule.json" | sed "s/^/   $schedule (measured, not asserted) /"
    grep -q "pp: $schedule, .*ideal bubble $ideal% of the step" "$T/trace_$schedule.log" \
        || { echo "FAIL: $schedule: the log does not give the simulated bubble $ideal%"; exit 1; }
    "$BUILD/pp_schedule" --schedule "$schedule" --pp 2 --microbatches 2 --virtual-stages $v > "$T/lists_$schedule.txt"
    $PYTHON tests/py/pp_bubble.py "$T/$schedule.json" --expect-lists "$T/lists_$schedule.txt" \
        || { echo "FAIL: $schedule: the trace's order differs from the schedule"; exit 1; }
done
# pp_schedule: a schedule too large to print and simulate is refused before any work (it ran for
# minutes, then out of memory with exit 1), and Interleaved1F1B with v = 1 says it interleaves nothing.
rc=0; err=$("$BUILD/pp_schedule" --pp 4096 --microbatches 4096 2>&1 >/dev/null) || rc=$?
[ "$rc" -eq 2 ] && [[ "$err" == *"(micro-batch, stage) pairs: more than the 262144 this program prints"* ]] ||
    { echo "FAIL: pp_schedule --pp 4096 --microbatches 4096 -> rc $rc: $err"; exit 1; }
"$BUILD/pp_schedule" --schedule Interleaved1F1B --pp 2 --microbatches 4 | grep -q "^note: Interleaved1F1B with one virtual stage per rank interleaves nothing" ||
    { echo "FAIL: pp_schedule Interleaved1F1B --virtual-stages 1 gives no note"; exit 1; }
mkdir -p "$T/dot_dir"
rc=0; err=$("$BUILD/pp_schedule" --dot "$T/dot_dir" 2>&1 >/dev/null) || rc=$?
[ "$rc" -eq 2 ] && [ "$err" = "pp_schedule: --dot $T/dot_dir: is a directory; give a file name" ] ||
    { echo "FAIL: pp_schedule --dot DIRECTORY -> rc $rc: $err"; exit 1; }
echo "ok: pp_schedule refuses 16M pairs (exit 2), a directory as --dot, and notes Interleaved1F1B with v = 1"
$PYTHON tests/py/trace_check.py "$T/GPipe.pftrace" --json "$T/GPipe.json" --expect-slice "pp wait" \
    --expect-slice forward --expect-slice backward --expect-slice batch
# trace-summary's bubble% (pipeline-wait slices and idle time over each rank's span), printed only.
traces/trace-summary --json "$T/GPipe.pftrace" | $PYTHON -c '
import json, sys
rows = json.load(sys.stdin)["ranks"]
print("== trace-summary GPipe bubble% (measured, not asserted): "
      + ", ".join("%.1f" % r["bubble_pct"] for r in rows) + " (ideal 33.3)")
sys.exit(0 if len(rows) == 2 else 1)' || { echo "FAIL: trace-summary: not 2 ranks"; exit 1; }

echo "== bad layouts exit 2 with one line"
set +e
expect_error 2 "multiple of the pipeline ranks" --pp 2 --pp-schedule Interleaved1F1B --pp-microbatches 3
expect_error 4 "at least one transformer block" --pp 4 --pp-schedule Interleaved1F1B --pp-virtual-stages 2
expect_error 2 "only Interleaved1F1B" --pp 2 --pp-virtual-stages 2
expect_error 3 "--pp 2 = 2 ranks, but mpirun started 3" --pp 2
expect_error 4 "pipeline stages shard only the optimizer state; add --zero-stage 1" --pp 2 --dp-shard 2
expect_error 2 "--batch 8: must be divisible by data-parallel ranks (1) x --pp-microbatches (3)" --pp 2 \
    --pp-microbatches 3
expect_error 1 "--pp-virtual-stages: needs --pp 2" --pp-virtual-stages 2
expect_error 2 "with --pp the micro-batches are --pp-microbatches" --pp 2 --grad-accum-steps 2
expect_error 2 "tied embeddings" --pp 2 --model llama3_1b --n-layers 2 --seq-len 8
set -e
echo "t_pp: OK"
