#!/usr/bin/env bash
# CPU benchmark: one training step (forward + backward + clip + AdamW) of the `small` model, the C
# reference ($BUILD/train) against eager PyTorch (scripts/bench_torch.py), same shapes, same
# thread count. Prints both timing lines and a table; ratio = PyTorch time / our time (> 1: we
# are faster). Settings: BENCH_THREADS (2), BENCH_STEPS (12), BENCH_BATCH (8), BENCH_SEQ (256),
# BENCH_MODEL (small). Then scripts/bench_plan.sh: chapter 11's simulator against 2-rank runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
THREADS=${BENCH_THREADS:-2}
STEPS=${BENCH_STEPS:-12}
BATCH=${BENCH_BATCH:-8}
SEQ=${BENCH_SEQ:-256}
MODEL=${BENCH_MODEL:-small}
export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS

for f in "$BUILD/train" "$PYTHON"; do
    [ -x "$f" ] || { echo "bench: $f not found (run make / make deps)" >&2; exit 1; }
done
LOG=$(mktemp -d "${TMPDIR:-/tmp}/llama-bench.XXXXXX")
trap 'rm -rf "$LOG"' EXIT

timing_field() {  # file, key -> value from the file's last `timing:` line
    grep '^timing:' "$1" | tail -1 | tr ' ' '\n' | sed -n "s/^$2=//p"
}

shapes="--steps $STEPS --batch $BATCH --seq-len $SEQ"
# The shapes come from the C trainer's own table: one source of truth for both sides.
config_json=$("$BUILD/train" --model "$MODEL" --model-info | sed -n 's/^config: //p')
[ -n "$config_json" ] || { echo "bench: could not read the config of --model $MODEL" >&2; exit 1; }
echo "bench: $BUILD/train --model $MODEL $shapes  (OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS)"
"$BUILD/train" --model "$MODEL" $shapes >"$LOG/c.txt" 2>&1 || { cat "$LOG/c.txt"; echo "bench: $BUILD/train failed" >&2; exit 1; }
grep '^timing:' "$LOG/c.txt" || { tail -20 "$LOG/c.txt"; echo "bench: no timing line from train" >&2; exit 1; }
echo "bench: $PYTHON scripts/bench_torch.py --config-json <model $MODEL> $shapes --threads $THREADS"
"$PYTHON" scripts/bench_torch.py --config-json "$config_json" $shapes --threads "$THREADS" >"$LOG/torch.txt" 2>&1 \
    || { cat "$LOG/torch.txt"; echo "bench: bench_torch.py failed" >&2; exit 1; }
grep '^timing:' "$LOG/torch.txt"

c_ms=$(timing_field "$LOG/c.txt" mean_step_ms); c_tps=$(timing_field "$LOG/c.txt" tokens_per_s)
t_ms=$(timing_field "$LOG/torch.txt" mean_step_ms); t_tps=$(timing_field "$LOG/torch.txt" tokens_per_s)
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
[ -n "$c_ms" ] && [ -n "$t_ms" ] || { echo "bench: could not parse the timing lines" >&2; exit 1; }

echo
echo "model $MODEL, batch $BATCH, seq $SEQ, $STEPS steps (mean over the last $((STEPS - 2))), threads $THREADS, torch $torch_version"
awk -v cm="$c_ms" -v ct="$c_tps" -v tm="$t_ms" -v tt="$t_tps" 'BEGIN {
    printf "%-22s %14s %14s\n", "", "ms/step", "tokens/s"
    printf "%-22s %14.1f %14.1f\n", "C reference (train)", cm, ct
    printf "%-22s %14.1f %14.1f\n", "PyTorch eager", tm, tt
    printf "ratio PyTorch/C time: %.2f  (> 1: the C reference is faster)\n", tm / cm
}'

# Chapter 11: the simulator calibrated here, predicting the trainer's 2-rank step times.
echo
echo "== build/plan against the trainer on 2 ranks (scripts/bench_plan.sh) =="
BUILD="$BUILD" scripts/bench_plan.sh
