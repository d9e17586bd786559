#!/usr/bin/env bash
# Chapter 11 on this CPU: calibrate build/plan here, then let it predict the trainer's own measured
# step times on 2 ranks (DDP, FSDP, TP with sequence parallelism, PP 1F1B and interleaved 1F1B).
#   calibration  one single-rank step of the per-rank shape (FLOP/s of the whole step: matmuls,
#                attention, element-wise and AdamW folded into one rate) and build/collectives'
#                all-gather at 64 KiB and 4 MiB (alpha and beta of a 2-rank ring)
#   prediction   build/plan --precision fp32 --cluster <the calibrated profile> for each layout
#   measurement  mpirun -np 2 build/train with the same flags; mean step of the last steps
#   rounds       PLAN_ROUNDS times (default 3) the calibration run and every layout, one after the
#                other; each figure is the fastest of the rounds: other work on a shared or virtual
#                machine only ever adds time (single runs move by 15% and more, and a median of 3 still
#                takes a slowed round when two are), so the minimum is the run the machine least
#                disturbed, for the calibration and the layouts alike
# Settings: PLAN_MODEL (small), PLAN_BATCH (8, even), PLAN_SEQ (128), PLAN_STEPS (6, at least 3),
# PLAN_ROUNDS (3); no arguments. A bad setting, or one the trainer refuses (a batch the layout's ranks
# and microbatches do not divide): one line, exit 2.
# Timings, not a test. Each line says PASS when the prediction is within the chapter's 15% goal.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bad settings: one line, exit 2, before any run (a typo must not cost a calibration first).
refuse() { echo "bench_plan: $1" >&2; exit 2; }
[ $# -eq 0 ] || refuse "unexpected argument '$1': it takes none (settings: PLAN_MODEL, PLAN_BATCH, PLAN_SEQ, PLAN_STEPS, PLAN_ROUNDS)"
BUILD=${BUILD:-build}
MODEL=${PLAN_MODEL:-small}
BATCH=${PLAN_BATCH:-8}
SEQ=${PLAN_SEQ:-128}
STEPS=${PLAN_STEPS:-6}
ROUNDS=${PLAN_ROUNDS:-3}
# Whole numbers without a leading zero (bash reads 08 as octal) and short enough for its arithmetic.
count() {  # name value
    [[ "$2" =~ ^[1-9][0-9]{0,8}$ ]] || refuse "$1=$2: must be a positive integer (1 to 999999999)"
}
count PLAN_BATCH "$BATCH"; count PLAN_SEQ "$SEQ"; count PLAN_STEPS "$STEPS"; count PLAN_ROUNDS "$ROUNDS"
# The calibration runs half the batch on one rank: an odd batch would calibrate another shape.
[ $((BATCH % 2)) -eq 0 ] || refuse "PLAN_BATCH=$BATCH: must be even (the calibration runs half of it on one rank)"
# The trainer's timing line averages the steps after its first two (warm-up): none with fewer than 3.
[ "$STEPS" -ge 3 ] || refuse "PLAN_STEPS=$STEPS: must be at least 3 (the trainer times the steps after its first two)"
MPIRUN=${MPIRUN:-mpirun --oversubscribe$( [ "$(id -u)" = 0 ] && echo " --allow-run-as-root")}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for f in "$BUILD/train" "$BUILD/plan" "$BUILD/collectives"; do
    [ -x "$f" ] || { echo "bench_plan: $f not found (run make)" >&2; exit 1; }
done
# A failed run: the program's own one-line message ("train: ...", "train [rank 1]: ..."), which the
# end of the log (mpirun's notice that a rank exited) would cut off, and its exit status (2: it
# refused the settings, such as a batch that the layout's ranks and microbatches do not divide).
# Without such a line (a crash), the log's last lines.
run_failed() {  # what program log status
    local said; said=$(grep -m1 -E "^$2( \[rank [0-9]+\])?: " "$3" || true)
    [ -z "$said" ] || { echo "bench_plan: $1: $said" >&2; exit "$4"; }
    echo "bench_plan: $1: exit $4; the end of its log:" >&2; tail -5 "$3" >&2; exit 1
}
# The model, as the trainer knows it: --model-info prints it (no step runs), or refuses the name.
if ! said=$("$BUILD/train" --model "$MODEL" --seq-len "$SEQ" --model-info 2>&1 > /dev/null); then
    said=$(grep -m1 '^train: ' <<<"$said" || true)
    refuse "PLAN_MODEL=$MODEL PLAN_SEQ=$SEQ: ${said:-the trainer refuses them}"
fi
LOG=$(mktemp -d "${TMPDIR:-/tmp}/llama-plan.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
step_ms() { grep '^timing:' "$1" | tail -1 | tr ' ' '\n' | sed -n 's/^mean_step_ms=//p'; }
shape=(--model "$MODEL" --seq-len "$SEQ")

layouts=("DDP|--dp-replicate 2" "FSDP (ZeRO-3)|--dp-shard 2 --zero-stage 3" "TP + SP|--tp 2 --sequence-parallel"
         "PP 1F1B|--pp 2 --pp-microbatches 4" "PP interleaved|--pp 2 --pp-schedule Interleaved1F1B --pp-virtual-stages 2 --pp-microbatches 4")
fastest() { tr ' ' '\n' | grep . | sort -g | head -1; }
calibrate() { "$BUILD/train" "${shape[@]}" --steps "$STEPS" --batch $((BATCH / 2)) > "$1" 2>&1; }  # log
declare -A times  # name -> the rounds' step times (ms), space-separated
for round in $(seq "$ROUNDS"); do
    # Calibration 1: compute, one rank on the per-rank batch of the data-parallel layouts; two copies
    # at once, so that each gets the share of the cores a rank of the 2-rank runs gets.
    calibrate "$LOG/one.txt" & first=$!
    status=0; calibrate "$LOG/two.txt" || status=$?
    wait "$first" || run_failed "calibration (1 rank, batch $((BATCH / 2)))" train "$LOG/one.txt" $?
    [ "$status" -eq 0 ] || run_failed "calibration (1 rank, batch $((BATCH / 2)))" train "$LOG/two.txt" "$status"
    times[calibration]+=" $(awk -v a="$(step_ms "$LOG/one.txt")" -v b="$(step_ms "$LOG/two.txt")" 'BEGIN { printf "%.1f", (a + b) / 2 }')"
    for entry in "${layouts[@]}"; do
        name=${entry%%|*}; flags=${entry#*|}
        # shellcheck disable=SC2086
        $MPIRUN -np 2 "$BUILD/train" "${shape[@]}" --steps "$STEPS" --batch "$BATCH" $flags > "$LOG/run.txt" 2>&1 ||
            run_failed "$name (2 ranks, batch $BATCH)" train "$LOG/run.txt" $?
        times[$name]+=" $(step_ms "$LOG/run.txt")"
    done
done
one=$(fastest <<<"${times[calibration]}")
# Calibration 2: the 2-rank all-gather (the communicator's own; its time is column 9), at two sizes.
$MPIRUN -np 2 "$BUILD/collectives" --bench --min-bytes 65536 --max-bytes 4194304 --factor 64 --iters 20 > "$LOG/coll.txt" 2>&1 ||
    run_failed "all-gather calibration (2 ranks)" collectives "$LOG/coll.txt" $?
read -r small_us big_us < <(awk '$1 == "all_gather" && $2 == 65536 { s = $9 } $1 == "all_gather" && $2 == 4194304 { b = $9 }
    END { print s, b }' "$LOG/coll.txt")
# t = alpha + S/2 / B for a ring of 2: two sizes give both.
read -r alpha bw < <(awk -v s="$small_us" -v b="$big_us" 'BEGIN {
    beta = (b - s) * 1e-6 / ((4194304 - 65536) / 2); alpha = s * 1e-6 - 32768 * beta
    printf "%.3e %.4e\n", (alpha > 0 ? alpha : 0), 1 / beta }')  # a noisy pair can make alpha negative: none
# The compute rate: plan's prediction for the calibration run at 1 GFLOP/s, scaled to the measurement
# (element-wise ops and AdamW are given an unlimited bandwidth, so the time is FLOPs / rate). No
# straggler wait (rank_jitter 0): the calibration's own run measured this machine's variation.
profile() {  # peak -> JSON
    printf '{"name": "this-cpu", "gpus_per_node": 2, "peak_bf16": %s, "peak_fp8": 0, "gemm_eff": 1, "attn_eff": 1, "async_tp_hidden": 0, "hbm_bw": 1e15, "hbm_bytes": 1e12, "nvlink_bw": %s, "nvlink_lat": %s, "net_bw": %s, "net_lat": %s, "rank_jitter": 0}\n' \
        "$1" "$bw" "$alpha" "$bw" "$alpha"
}
profile 1e9 > "$LOG/unit.json"
unit_s=$("$BUILD/plan" "${shape[@]}" --batch $((BATCH / 2)) --precision fp32 --cluster "$LOG/unit.json" \
    | sed -n 's/^step \([0-9.]*\) s.*/\1/p')
rate=$(awk -v u="$unit_s" -v m="$one" 'BEGIN { printf "%.4e", 1e9 * u / (m / 1000) }')
profile "$rate" > "$LOG/cpu.json"
echo "plan calibration: one rank ${one} ms/step -> ${rate} FLOP/s; all-gather alpha ${alpha} s, beta 1/${bw} B/s"

echo "plan: the fastest of $ROUNDS rounds; the step times of each round (ms): calibration${times[calibration]}"
printf '%-16s %12s %12s %8s\n' "layout (2 ranks)" "measured ms" "predicted ms" "error"
for entry in "${layouts[@]}"; do
    name=${entry%%|*}; flags=${entry#*|}
    measured=$(fastest <<<"${times[$name]}")
    plan_flags=${flags/--sequence-parallel/}
    # shellcheck disable=SC2086
    predicted=$("$BUILD/plan" "${shape[@]}" --batch "$BATCH" $plan_flags --precision fp32 \
        --cluster "$LOG/cpu.json" | sed -n 's/^step \([0-9.]*\) s.*/\1/p')
    awk -v n="$name" -v m="$measured" -v p="$predicted" -v all="${times[$name]}" 'BEGIN {
        e = 100 * (1000 * p - m) / m
        printf "%-16s %12.1f %12.1f %+7.1f%%  %s   (rounds:%s)\n", n, m, 1000 * p, e, (e < 15 && e > -15) ? "PASS" : "MISS", all }'
done
