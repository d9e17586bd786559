#!/usr/bin/env bash
# GPU benchmark (make bench-gpu): training steps (forward, backward, clip, AdamW) of a Llama-shaped
# model on one GPU: ours ($BUILD/bench_gpu, gpu/model.h in bf16 with fp32 master weights) next to
# PyTorch on the same device in the same run, eager with SDPA and torch.compile
# (scripts/bench_torch_gpu.py), with the same shapes and the same FLOPs per token. For each
# sequence length: tokens/s, TFLOP/s and MFU against the peak (989 TFLOP/s dense bf16, H100 SXM) by
# the project's FLOP count and by torchtitan's 12*L*h*q*T attention convention (gpu/mfu.h); then
# one layer's attention alone, ours against SDPA (scripts/bench_attention_torch_gpu.py); then this
# GPU's profile for chapter 11's planner (bench_gpu --gemm-only and the attention alone, through
# scripts/gpu_profile.py, written to $BUILD/gpu-profile-MODEL-SEQ.json) and the planner's prediction
# of the step measured above with it (build/plan --cluster that file; with all the model's layers).
# Without a CUDA device it prints SKIP and exits 0.
# Settings: BENCH_GPU_MODEL (llama3_1b), BENCH_GPU_LAYERS (0: the model's), BENCH_GPU_BATCH (0:
# the largest batch that fits ours, given to PyTorch too; halved for both while PyTorch runs out
# of memory), BENCH_GPU_SEQS ("2048 8192"),
# BENCH_GPU_STEPS (12), BENCH_GPU_PEAK_TFLOPS (989), BENCH_GPU_TORCH (eager compile; empty: ours
# alone), BENCH_GPU_PYTHON (python3: the one with a CUDA PyTorch), BENCH_GPU_TRACE (a file: the
# Perfetto trace of 4 more steps of ours at the first sequence length, host steps and the GPU
# timeline with every kernel where CUPTI records them; not the timed run).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MODEL=${BENCH_GPU_MODEL:-llama3_1b}
LAYERS=${BENCH_GPU_LAYERS:-0}
BATCH=${BENCH_GPU_BATCH:-0}
SEQS=${BENCH_GPU_SEQS:-${BENCH_GPU_SEQ:-2048 8192}}
STEPS=${BENCH_GPU_STEPS:-12}
PEAK=${BENCH_GPU_PEAK_TFLOPS:-989}
TORCH_MODES=${BENCH_GPU_TORCH-eager compile}
PY=${BENCH_GPU_PYTHON:-python3}

LOG=$(mktemp -d "${TMPDIR:-/tmp}/llama-bench-gpu.XXXXXX")
trap 'rm -rf "$LOG"' EXIT
field() {  # file, line prefix, key -> value from the file's last line with that prefix
    grep "^$2" "$1" | tail -1 | tr ' ' '\n' | sed -n "s/^$3=//p"
}
config_json=$("$BUILD/train" --model "$MODEL" --model-info | sed -n 's/^config: //p')
[ -n "$config_json" ] || { echo "bench-gpu: could not read the model's config" >&2; exit 1; }
summary=()

for SEQ in $SEQS; do
    shapes="--seq-len $SEQ --steps $STEPS --n-layers $LAYERS"
    # Ours at the asked batch (0: the largest that fits ours), then PyTorch at the batch ours ran. If
    # PyTorch runs out of memory there (its eager step keeps more activations), both again at half
    # the batch, so that the table compares one batch.
    want=$BATCH
    while :; do
        echo "bench-gpu: $BUILD/bench_gpu --model $MODEL --batch $want $shapes"
        "$BUILD/bench_gpu" --model "$MODEL" --batch "$want" $shapes --peak-tflops "$PEAK" >"$LOG/ours.txt" 2>&1 \
            || { cat "$LOG/ours.txt"; echo "bench-gpu: $BUILD/bench_gpu failed" >&2; exit 1; }
        if grep -q '^SKIP' "$LOG/ours.txt"; then cat "$LOG/ours.txt"; exit 0; fi
        cat "$LOG/ours.txt"
        flops=$(sed -n 's/.* flops_per_token=\([0-9.e+]*\).*/\1/p' "$LOG/ours.txt")
        flops_titan=$(sed -n 's/.*flops_per_token_titan=\([0-9.e+]*\).*/\1/p' "$LOG/ours.txt")
        batch=$(sed -n 's/.* batch=\([0-9]*\) x.*/\1/p' "$LOG/ours.txt")
        [ -n "$flops" ] && [ -n "$flops_titan" ] && [ -n "$batch" ] || { echo "bench-gpu: could not read the shapes" >&2; exit 1; }

        rows=("ours (gpu/, bf16)|$LOG/ours.txt")
        out_of_memory=""
        for mode in $TORCH_MODES; do
            echo "bench-gpu: $PY scripts/bench_torch_gpu.py --mode $mode <model $MODEL> --batch $batch $shapes"
            if "$PY" scripts/bench_torch_gpu.py --config-json "$config_json" --mode "$mode" --batch "$batch" $shapes \
                --flops-per-token "$flops" --peak-tflops "$PEAK" >"$LOG/torch_$mode.txt" 2>&1; then
                grep -E '^(bench_torch_gpu|timing|memory|SKIP)' "$LOG/torch_$mode.txt" || true
                rows+=("PyTorch $mode (SDPA)|$LOG/torch_$mode.txt")
            elif grep -qi "out of memory" "$LOG/torch_$mode.txt"; then
                out_of_memory="$out_of_memory $mode"
            else
                tail -20 "$LOG/torch_$mode.txt"; echo "bench-gpu: PyTorch $mode failed (left out of the table)"
            fi
        done
        [ -n "$out_of_memory" ] && [ "$batch" -gt 1 ] || break
        want=$((batch / 2))
        echo "bench-gpu: PyTorch ($out_of_memory ) ran out of memory at batch $batch: ours and PyTorch again at $want"
    done
    [ -z "$out_of_memory" ] || echo "bench-gpu: PyTorch ($out_of_memory ) ran out of memory even at batch 1 (left out)"

    # The trace from a run of its own (4 steps), so that CUPTI's per-kernel records cost the timed run nothing.
    if [ -n "${BENCH_GPU_TRACE:-}" ] && [ ${#summary[@]} -eq 0 ]; then
        "$BUILD/bench_gpu" --model "$MODEL" --batch "$batch" --seq-len "$SEQ" --steps 4 --n-layers "$LAYERS" \
            --trace "$BENCH_GPU_TRACE" >"$LOG/traced.txt" 2>&1 || { cat "$LOG/traced.txt"; echo "bench-gpu: traced run failed" >&2; exit 1; }
        grep '^trace:' "$LOG/traced.txt"
        echo "bench-gpu: the costliest kernels: traces/trace-summary $BENCH_GPU_TRACE --kernels 20"
    fi

    layers=$([ "$LAYERS" = 0 ] && echo "all layers" || echo "$LAYERS layers")
    table="model $MODEL ($layers), batch $batch x $SEQ tokens, $STEPS steps (mean over the last $((STEPS - 2))), peak $PEAK TFLOP/s"
    table+=$'\n'$(printf "%-26s %10s %12s %10s %8s %11s" "" "ms/step" "tokens/s" "TFLOP/s" "MFU" "MFU(titan)")
    for row in "${rows[@]}"; do
        name=${row%%|*} file=${row#*|}
        tps=$(field "$file" timing: tokens_per_s)
        [ -n "$tps" ] || continue
        table+=$'\n'$(awk -v n="$name" -v ms="$(field "$file" timing: mean_step_ms)" -v tps="$tps" -v f="$flops" \
            -v ft="$flops_titan" -v peak="$PEAK" 'BEGIN {
            printf "%-26s %10.1f %12.0f %10.1f %7.1f%% %10.1f%%", n, ms, tps, tps * f / 1e12,
                   100 * tps * f / (peak * 1e12), 100 * tps * ft / (peak * 1e12) }')
    done

    # Attention alone: one layer's, the same batch and sequence, ours against SDPA.
    "$BUILD/bench_gpu" --model "$MODEL" --batch "$batch" --seq-len "$SEQ" --steps "$STEPS" --attention-only \
        >"$LOG/attn_ours.txt" 2>&1 || { cat "$LOG/attn_ours.txt"; echo "bench-gpu: attention-only failed" >&2; exit 1; }
    read -r H KV HD < <(sed -n 's/.* heads=\([0-9]*\) kv_heads=\([0-9]*\) head_dim=\([0-9]*\).*/\1 \2 \3/p' "$LOG/attn_ours.txt")
    if [ -n "$TORCH_MODES" ]; then
        "$PY" scripts/bench_attention_torch_gpu.py --batch "$batch" --seq-len "$SEQ" --heads "$H" --kv-heads "$KV" \
            --head-dim "$HD" --steps "$STEPS" >"$LOG/attn_torch.txt" 2>&1 || tail -5 "$LOG/attn_torch.txt"
    fi
    table+=$'\n'$(printf "attention alone (one layer) %10s %10s %12s %12s" "fwd ms" "bwd ms" "fwd TFLOP/s" "bwd TFLOP/s")
    for row in "ours|$LOG/attn_ours.txt" "PyTorch SDPA|$LOG/attn_torch.txt"; do
        name=${row%%|*} file=${row#*|}
        [ -n "$(field "$file" attention: fwd_ms)" ] || continue
        [ "$name" = ours ] && name="ours, tiles $(field "$file" attention: rows)"
        table+=$'\n'$(printf "  %-25s %10s %10s %12s %12s" "$name" "$(field "$file" attention: fwd_ms)" \
            "$(field "$file" attention: bwd_ms)" "$(field "$file" attention: fwd_tflops)" "$(field "$file" attention: bwd_tflops)")
    done
    # The other tile sizes (64 or 128 rows of the side each kernel holds: forward,dQ,dK/dV), timed in
    # the same run; same bits: yes when the results equal the first's bit for bit.
    val() { tr ' ' '\n' <<<"$line" | sed -n "s/^$1=//p"; }  # the key's value on $line
    while read -r line; do
        table+=$'\n'$(printf "  %-25s %10s %10s %12s %12s  same bits: %s" "ours, tiles $(val rows)" "$(val fwd_ms)" \
            "$(val bwd_ms)" "$(val fwd_tflops)" "$(val bwd_tflops)" "$(val same_bits)")
    done < <(grep '^attention-tiles:' "$LOG/attn_ours.txt")

    # This GPU as a cluster profile (chapter 11), and the planner's prediction of our step with it.
    "$BUILD/bench_gpu" --model "$MODEL" --batch "$batch" --seq-len "$SEQ" --steps "$STEPS" --gemm-only \
        >"$LOG/gemm_ours.txt" 2>&1 || { cat "$LOG/gemm_ours.txt"; echo "bench-gpu: gemm-only failed" >&2; exit 1; }
    grep '^gemm:' "$LOG/gemm_ours.txt"
    profile="$BUILD/gpu-profile-$MODEL-$SEQ.json"
    python3 scripts/gpu_profile.py --gemm "$LOG/gemm_ours.txt" --attention "$LOG/attn_ours.txt" --peak-tflops "$PEAK" \
        --name "bench_gpu on this GPU, $MODEL at $SEQ tokens" --out "$profile"
    if [ "$LAYERS" = 0 ]; then
        plan_args=(--model "$MODEL" --cluster "$profile" --gpus 1 --batch "$batch" --seq-len "$SEQ")
        predicted=$("$BUILD/plan" "${plan_args[@]}" | sed -n 's/^step \([0-9.]*\) s.*/\1/p')
        measured=$(field "$LOG/ours.txt" timing: mean_step_ms)
        table+=$'\n'$(awk -v p="$predicted" -v m="$measured" -v f="$profile" 'BEGIN {
            printf "build/plan --cluster %s: step %.1f ms predicted, %.1f measured (%+.1f%%)", f, p * 1e3, m,
                   100 * (p * 1e3 - m) / m }')
    fi
    summary+=("$table")
    echo; echo "$table"  # now as well as at the end: a run stopped during the next length keeps this one
done

for table in "${summary[@]}"; do echo; echo "$table"; done
