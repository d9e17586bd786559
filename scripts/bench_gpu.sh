#!/usr/bin/env bash
# GPU benchmark (make bench-gpu): training steps (forward, backward, clip, AdamW) of a Llama-shaped
# model on one GPU: ours ($BUILD/bench_gpu, gpu/model.h in bf16 with fp32 master weights) next to
# PyTorch on the same device, eager with SDPA and torch.compile (scripts/bench_torch_gpu.py), with
# the same shapes and the same FLOPs per token. Prints tokens/s, TFLOP/s and MFU (gpu/mfu.h:
# MFU = tokens/s * model_flops_per_token / peak, peak 989 TFLOP/s dense bf16 for an H100 SXM).
# Without a CUDA device it prints SKIP and exits 0.
# Settings: BENCH_GPU_MODEL (llama3_1b), BENCH_GPU_LAYERS (0: the model's), BENCH_GPU_BATCH (4),
# BENCH_GPU_SEQ (2048), BENCH_GPU_STEPS (12), BENCH_GPU_PEAK_TFLOPS (989), BENCH_GPU_TORCH (eager
# compile; empty: ours alone), BENCH_GPU_PYTHON (python3: the one with a CUDA PyTorch),
# BENCH_GPU_TRACE (a file: our run's Perfetto trace, host steps and the GPU timeline).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MODEL=${BENCH_GPU_MODEL:-llama3_1b}
LAYERS=${BENCH_GPU_LAYERS:-0}
BATCH=${BENCH_GPU_BATCH:-4}
SEQ=${BENCH_GPU_SEQ:-2048}
STEPS=${BENCH_GPU_STEPS:-12}
PEAK=${BENCH_GPU_PEAK_TFLOPS:-989}
TORCH_MODES=${BENCH_GPU_TORCH-eager compile}
PY=${BENCH_GPU_PYTHON:-python3}

LOG=$(mktemp -d "${TMPDIR:-/tmp}/llama-bench-gpu.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
field() {  # file, key -> value from the file's last `timing:` line
    grep '^timing:' "$1" | tail -1 | tr ' ' '\n' | sed -n "s/^$2=//p"
}

shapes="--batch $BATCH --seq-len $SEQ --steps $STEPS --layers $LAYERS"
trace=${BENCH_GPU_TRACE:+--trace $BENCH_GPU_TRACE}
echo "bench-gpu: $BUILD/bench_gpu --model $MODEL $shapes $trace"
"$BUILD/bench_gpu" --model "$MODEL" $shapes --peak-tflops "$PEAK" $trace >"$LOG/ours.txt" 2>&1 \
    || { cat "$LOG/ours.txt"; echo "bench-gpu: $BUILD/bench_gpu failed" >&2; exit 1; }
if grep -q '^SKIP' "$LOG/ours.txt"; then cat "$LOG/ours.txt"; exit 0; fi
cat "$LOG/ours.txt"
flops_per_token=$(sed -n 's/.*flops_per_token=\([0-9.e+]*\).*/\1/p' "$LOG/ours.txt")
config_json=$("$BUILD/train" --model "$MODEL" --model-info | sed -n 's/^config: //p')
[ -n "$flops_per_token" ] && [ -n "$config_json" ] || { echo "bench-gpu: could not read the shapes" >&2; exit 1; }

rows=("ours (gpu/, bf16)|$LOG/ours.txt")
for mode in $TORCH_MODES; do
    echo "bench-gpu: $PY scripts/bench_torch_gpu.py --mode $mode <model $MODEL> $shapes"
    if "$PY" scripts/bench_torch_gpu.py --config-json "$config_json" --mode "$mode" $shapes \
        --flops-per-token "$flops_per_token" --peak-tflops "$PEAK" >"$LOG/torch_$mode.txt" 2>&1; then
        grep -E '^(bench_torch_gpu|timing|memory|SKIP)' "$LOG/torch_$mode.txt" || true
        rows+=("PyTorch $mode (SDPA)|$LOG/torch_$mode.txt")
    else
        tail -20 "$LOG/torch_$mode.txt"; echo "bench-gpu: PyTorch $mode failed (left out of the table)"
    fi
done

echo
layers=$([ "$LAYERS" = 0 ] && echo "all layers" || echo "$LAYERS layers")
echo "model $MODEL ($layers), batch $BATCH x $SEQ tokens, $STEPS steps (mean over the last $((STEPS - 2))), peak $PEAK TFLOP/s"
printf "%-26s %12s %12s %10s %8s\n" "" "ms/step" "tokens/s" "TFLOP/s" "MFU"
for row in "${rows[@]}"; do
    name=${row%%|*} file=${row#*|}
    [ -n "$(field "$file" mean_step_ms)" ] || continue
    printf "%-26s %12s %12s %10s %7.1f%%\n" "$name" "$(field "$file" mean_step_ms)" "$(field "$file" tokens_per_s)" \
        "$(field "$file" tflops)" "$(awk -v m="$(field "$file" mfu)" 'BEGIN { print 100 * m }')"
done
