#!/usr/bin/env bash
# CPU benchmark: one training step (forward + backward + clip + AdamW) of the `small` model, the C
# reference ($BUILD/train) against PyTorch on the same CPU, same shapes, same thread count, same run:
#
#   sgemm             the machine's matmul ceiling: $BUILD/sgemm_rate (2048^3, the OpenBLAS the C side
#                     links), measured right before each program
#   C reference       $BUILD/train
#   torch 2.x eager   the newest PyTorch from PyPI (fused scaled_dot_product_attention with GQA,
#                     fused AdamW), installed on first use into $BUILD/bench-venv
#   torch 2.x compile the same under torch.compile
#   torch <debian>    the project venv's PyTorch ($PYTHON, Debian's 1.13): the oracle's matmul attention
#
# The programs run one after another in each of BENCH_ROUNDS rounds (interleaved, so a load change on
# a shared machine hits them alike); each figure is the fastest round's mean step time of that program
# (other work only ever adds time, so the fastest round is the one the machine least disturbed). The table gives ms/step, model GFLOP/s (model_flops_per_token x tokens/s, as MFU counts them),
# that rate as a % of the sgemm rate, and time / C time (> 1: the C reference is faster).
#
# Without network (no PyPI) the torch 2.x lines are skipped with a message; the exit status is nonzero
# only when the C side fails. Refresh the PyTorch 2.x install with `rm -rf $BUILD/bench-venv`.
# Settings: BENCH_THREADS (2), BENCH_STEPS (12), BENCH_BATCH (8), BENCH_SEQ (256), BENCH_MODEL (small),
# BENCH_ROUNDS (1), BENCH_TORCH2 (1; 0 skips the PyTorch 2.x lines), BENCH_COMPILE (1), BENCH_VENV
# ($BUILD/bench-venv). Then scripts/bench_plan.sh: chapter 11's simulator against 2-rank runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
THREADS=${BENCH_THREADS:-2}
STEPS=${BENCH_STEPS:-12}
BATCH=${BENCH_BATCH:-8}
SEQ=${BENCH_SEQ:-256}
MODEL=${BENCH_MODEL:-small}
ROUNDS=${BENCH_ROUNDS:-1}
TORCH2=${BENCH_TORCH2:-1}
COMPILE=${BENCH_COMPILE:-1}
VENV2=${BENCH_VENV:-$BUILD/bench-venv}
export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS

# The trainer prints its timing line after 3 steps (the first two are left out of its mean), and
# torch.compile's run warms up 3 more.
[[ "$STEPS" =~ ^[0-9]+$ ]] && [ "$STEPS" -ge 4 ] || { echo "bench: BENCH_STEPS=$STEPS: at least 4" >&2; exit 2; }
for f in "$BUILD/train" "$BUILD/sgemm_rate"; do
    [ -x "$f" ] || { echo "bench: $f not found (run make)" >&2; exit 1; }
done
LOG=$(mktemp -d "${TMPDIR:-/tmp}/llama-bench.XXXXXX")
trap 'rm -rf "$LOG"' EXIT

timing_field() {  # file, key -> value from the file's last `timing:` line
    grep '^timing:' "$1" | tail -1 | tr ' ' '\n' | sed -n "s/^$2=//p"
}

# PyTorch 2.x on demand: the CPU-only wheel where download.pytorch.org answers, else PyPI's.
ensure_torch2() {
    [ "$TORCH2" = 1 ] || { echo "bench: BENCH_TORCH2=0: no PyTorch 2.x lines"; return 1; }
    if [ -x "$VENV2/bin/python" ] && "$VENV2/bin/python" -c 'import torch, numpy' 2>/dev/null; then return 0; fi
    echo "bench: installing the newest PyTorch into $VENV2 (once; minutes)"
    python3 -m venv "$VENV2" >"$LOG/venv.txt" 2>&1 || { cat "$LOG/venv.txt"; echo "bench: python3 -m venv failed: no PyTorch 2.x lines"; return 1; }
    if ! "$VENV2/bin/pip" install --timeout 20 --retries 1 --index-url https://download.pytorch.org/whl/cpu torch numpy \
            >"$LOG/pip.txt" 2>&1 \
        && ! "$VENV2/bin/pip" install --timeout 20 --retries 1 torch numpy >>"$LOG/pip.txt" 2>&1; then
        tail -3 "$LOG/pip.txt"
        echo "bench: could not install PyTorch from download.pytorch.org or PyPI (offline?): no PyTorch 2.x lines"
        rm -rf "$VENV2"
        return 1
    fi
}

shapes="--steps $STEPS --batch $BATCH --seq-len $SEQ"
# The shapes come from the C trainer's own table: one source of truth for every side.
"$BUILD/train" --model "$MODEL" --seq-len "$SEQ" --model-info >"$LOG/info.txt" 2>&1 || true
config_json=$(sed -n 's/^config: //p' "$LOG/info.txt")
flops_per_token=$(sed -n 's/.*FLOPs\/token at seq [0-9]*: \([0-9.e+-]*\).*/\1/p' "$LOG/info.txt")
[ -n "$config_json" ] && [ -n "$flops_per_token" ] || { cat "$LOG/info.txt"; echo "bench: could not read --model $MODEL" >&2; exit 1; }

# The programs: name | command. A torch line that fails is reported and dropped; the C line may not fail.
programs=("C reference|$BUILD/train --model $MODEL $shapes")
torch_cmd="scripts/bench_torch.py --config-json '$config_json' $shapes --threads $THREADS"
if ensure_torch2; then
    v2=$("$VENV2/bin/python" -c 'import torch; print(torch.__version__)')
    programs+=("torch $v2 eager|$VENV2/bin/python $torch_cmd --attention sdpa --fused-adamw")
    [ "$COMPILE" = 1 ] && programs+=("torch $v2 compile|$VENV2/bin/python $torch_cmd --attention sdpa --fused-adamw --compile --warmup 3")
fi
if [ -x "$PYTHON" ]; then
    v1=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "?")
    programs+=("torch $v1 eager|$PYTHON $torch_cmd --attention matmul")
else
    echo "bench: $PYTHON not found: no line for the project venv's PyTorch"
fi

echo "bench: $MODEL, batch $BATCH x seq $SEQ, $STEPS steps, $THREADS threads, $ROUNDS round(s); load: $(uptime | sed 's/.*load/load/')"
# sgemm is measured right before each program: on a shared machine the load changes from one
# program to the next, and each program's % of sgemm compares it with its own neighbourhood.
# Each round starts one program later than the last (round 2: the second program first, ...), so
# that no program always runs in the same place of the sequence (say, right after the slowest).
n_programs=${#programs[@]}
for ((r = 1; r <= ROUNDS; r++)); do
    for ((k = 0; k < n_programs; k++)); do
        i=$(((k + r - 1) % n_programs))
        name=${programs[$i]%%|*} cmd=${programs[$i]#*|}
        out=$LOG/p$i.r$r.txt
        "$BUILD/sgemm_rate" --n 2048 --reps 5 | tee "$LOG/sgemm.txt"
        sgemm=$(sed -n 's/.*gflops=//p' "$LOG/sgemm.txt")
        echo "bench: round $r: $name: $cmd"
        if eval "$cmd" >"$out" 2>&1 && grep -q '^timing:' "$out"; then
            grep '^timing:' "$out" | tail -1
            # ms, sgemm just before, and (the C side) its GEMM GFLOP a step
            echo "$(timing_field "$out" mean_step_ms) $sgemm $(timing_field "$out" gemm_gflop_per_step)" >>"$LOG/p$i.runs"
        else
            tail -5 "$out"
            [ "$i" = 0 ] && { echo "bench: $BUILD/train failed" >&2; exit 1; }
            echo "bench: $name failed: left out"
        fi
    done
done

# A program's fastest round ("ms sgemm"): its time, and the sgemm rate measured right before it.
fastest_run() { sort -g -k1,1 "$1" | head -1; }
c_ms=$(fastest_run "$LOG/p0.runs" | cut -d' ' -f1)

echo
echo "model $MODEL, batch $BATCH, seq $SEQ, $STEPS steps (mean over the measured ones; the fastest of $ROUNDS round(s)), threads $THREADS"
echo "model FLOPs/token $flops_per_token; sgemm: OpenBLAS 2048^3 on $THREADS threads, measured before each program"
printf "%-26s %10s %10s %13s %8s %9s %9s\n" "" "ms/step" "tokens/s" "model GFLOP/s" "sgemm" "% sgemm" "time / C"
for i in "${!programs[@]}"; do
    [ -s "$LOG/p$i.runs" ] || continue
    read -r ms sgemm <<<"$(fastest_run "$LOG/p$i.runs")"
    awk -v name="${programs[$i]%%|*}" -v ms="$ms" -v c="$c_ms" -v tokens=$((BATCH * SEQ)) \
        -v fpt="$flops_per_token" -v sgemm="$sgemm" 'BEGIN {
        tps = tokens / (ms / 1e3); gf = tps * fpt / 1e9
        printf "%-26s %10.1f %10.1f %13.1f %8.1f %8.1f%% %9.2f\n", name, ms, tps, gf, sgemm, 100 * gf / sgemm, ms / c
    }'
done
echo "time / C > 1: the C reference is faster. Load after the run: $(uptime | sed 's/.*load/load/')"

# The C step's floor: its GEMMs' work (every matmul and attention tile, counted by the trainer) at
# the sgemm rate. No step that runs these GEMMs through this BLAS can be faster; the rest of the C
# time is the element-wise work and the GEMMs that run below the 2048^3 rate (small tiles).
read -r ms sgemm gemm_gflop <<<"$(fastest_run "$LOG/p0.runs")"
eager_ms="" eager_name=""  # the first eager PyTorch that ran: 2.x where it was installed
for i in "${!programs[@]}"; do
    name=${programs[$i]%%|*}
    if [ -z "$eager_ms" ] && [ -s "$LOG/p$i.runs" ] && [[ "$name" == *" eager" ]]; then
        eager_ms=$(fastest_run "$LOG/p$i.runs" | cut -d' ' -f1) eager_name=$name
    fi
done
if [ -n "$gemm_gflop" ]; then
    awk -v ms="$ms" -v sgemm="$sgemm" -v g="$gemm_gflop" -v eager="$eager_ms" -v eager_name="$eager_name" 'BEGIN {
        floor = 1e3 * g / sgemm
        printf "C GEMM floor: %.1f GFLOP of GEMMs a step at %.1f GFLOP/s = %.1f ms; the step takes %.1f ms, %.1f ms (%.1f%%) above it\n",
            g, sgemm, floor, ms, ms - floor, 100 * (ms - floor) / ms
        if (eager != "")
            printf "0.8 x %s = %.1f ms: %.1f ms above that floor\n", eager_name, 0.8 * eager, 0.8 * eager - floor
    }'
fi

# The goals the C step is held to, each with this run's figures: its time at most 0.8 x eager PyTorch
# 2.x's, below torch.compile's, and its model FLOP rate at least 80% of the sgemm rate measured before it.
compile_ms=""
for i in "${!programs[@]}"; do
    name=${programs[$i]%%|*}
    [[ "$name" == "torch 2"*" compile" ]] && [ -s "$LOG/p$i.runs" ] && compile_ms=$(fastest_run "$LOG/p$i.runs" | cut -d' ' -f1)
done
awk -v ms="$ms" -v sgemm="$sgemm" -v tokens=$((BATCH * SEQ)) -v fpt="$flops_per_token" -v eager="$eager_ms" \
    -v eager_name="$eager_name" -v compiled="$compile_ms" 'function verdict(ok) { return ok ? "met" : "NOT met" }
    BEGIN {
        pct = 100 * tokens / (ms / 1e3) * fpt / 1e9 / sgemm
        if (eager != "" && eager_name ~ /^torch 2/)
            printf "goal: C time / %s time = %.3f (at most 0.8): %s\n", eager_name, ms / eager, verdict(ms <= 0.8 * eager)
        if (compiled != "")
            printf "goal: C time / torch.compile time = %.3f (below 1): %s\n", ms / compiled, verdict(ms < compiled)
        printf "goal: C model FLOP rate = %.1f%% of sgemm (at least 80%%): %s\n", pct, verdict(pct >= 80)
    }'

# Chapter 11: the simulator calibrated here, predicting the trainer's 2-rank step times.
echo
echo "== build/plan against the trainer on 2 ranks (scripts/bench_plan.sh) =="
BUILD="$BUILD" scripts/bench_plan.sh
