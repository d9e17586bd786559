#!/usr/bin/env bash
# The GPU kernels on the CPU: tests/gpu/test_gpu_ops.c and test_gpu_model.c -- the checks `make
# test-gpu` runs on a GPU -- built against gpu/*.cu compiled as C++ with the emulator of
# tests/gpu/emu (threads as fibers, real barriers, a scheduler that lets warps run ahead of each
# other to expose missing barriers; GPU_EMU_SEED picks its orders) and streams that run queued work
# in simulated-time order (so a missing event wait between streams shows). Every check must pass. First the emulator's own test: known
# answers, a missing barrier caught, a divergent barrier ending as a deadlock, a faulting kernel
# named in sync-debug mode (LLAMA_CUDA_SYNC_DEBUG=1), the seed changing the order. Needs a C++ compiler
# (else SKIP). Then test_gpu_ddp on 4 ranks (DDP through the staged backend, one emulated GPU),
# test_gpu_comm (comm.h on device buffers) through each backend on 1, 2 and 4 ranks, test_gpu_cp
# (chapter 8's ring on device buffers) on 1, 2 and 4 ranks, and last the GPU timeline of a traced
# step against the Perfetto schema.
set -euo pipefail
BUILD=${BUILD:-build}
EMU=$BUILD/tests/emu
if [ ! -x "$EMU/test_emulator" ]; then
    if command -v "${CXX:-g++}" >/dev/null 2>&1; then echo "FAIL: $EMU/test_emulator missing (make)"; exit 1; fi
    echo "SKIP: no C++ compiler, so no emulated GPU test"
    exit 0
fi
"$EMU/test_emulator" || { echo "FAIL: the emulator's own test"; exit 1; }
status=0
out=$("$EMU/test_emulator" deadlock 2>&1) || status=$?
[ "$status" -eq 1 ] && grep -q 'emulator: deadlock in block' <<<"$out" ||
    { echo "FAIL: a divergent barrier did not end as a deadlock (status $status): $out"; exit 1; }
echo "ok: a divergent barrier ends the run: $out"

# A kernel that faults: reported at the next wait, and by its name and launch line in sync-debug mode.
status=0
out=$("$EMU/test_emulator" fault 2>&1) || status=$?
[ "$status" -eq 1 ] && grep -q 'CUDA error at gpu_synchronize' <<<"$out" ||
    { echo "FAIL: a trapping kernel was not reported at the next wait (status $status): $out"; exit 1; }
status=0
out=$(LLAMA_CUDA_SYNC_DEBUG=1 "$EMU/test_emulator" fault 2>&1) || status=$?
[ "$status" -eq 1 ] && grep -q 'in kernel trapping_kernel launched at tests/gpu/emu/test_emulator.cpp:[0-9]' <<<"$out" ||
    { echo "FAIL: LLAMA_CUDA_SYNC_DEBUG=1 did not name the trapping kernel (status $status): $out"; exit 1; }
echo "ok: sync-debug mode names the failing kernel: $out"

# The scheduler's seed: the same seed gives the same thread order, another seed another order.
a=$(GPU_EMU_SEED=1 "$EMU/test_emulator" schedule) b=$(GPU_EMU_SEED=1 "$EMU/test_emulator" schedule)
c=$(GPU_EMU_SEED=2 "$EMU/test_emulator" schedule)
[ "$a" = "$b" ] && [ "$a" != "$c" ] || { echo "FAIL: GPU_EMU_SEED: seed 1 gave '$a' then '$b', seed 2 '$c'"; exit 1; }
echo "ok: GPU_EMU_SEED reproduces an order and changes it ($a, $c)"
# A model that does not fit: gpu_model_init stops before allocating, with the planned and free figures.
status=0
out=$(GPU_EMU_DEVICE_BYTES=1000000 "$EMU/test_gpu_model" 2>&1) || status=$?
[ "$status" -eq 1 ] && grep -qE 'out of GPU memory: the model needs [0-9.]+ MiB .* the device has 0.95 MiB free' <<<"$out" ||
    { echo "FAIL: a model larger than the device (status $status): $(tail -2 <<<"$out")"; exit 1; }
echo "ok: $(grep 'out of GPU memory' <<<"$out")"
# Everything below runs under GPU_EMU_SEED as given (default 0); a failure names the seed to rerun with.
echo "scheduler seed: GPU_EMU_SEED=${GPU_EMU_SEED:-0}"

shopt -s nullglob
programs=()
for p in "$EMU"/test_gpu_*; do [[ "$p" == *.d ]] || programs+=("$p"); done
[ ${#programs[@]} -gt 0 ] || { echo "FAIL: no emulated GPU test in $EMU (make)"; exit 1; }
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}
for p in "${programs[@]}"; do
    status=0
    args=()
    [[ "$p" == */test_gpu_model ]] && args=(--trace "$TEST_TMP/gpu_timeline.pftrace")
    out=$("$p" "${args[@]}" 2>&1) || status=$?
    summary=$(grep -E '^test_gpu_[a-z0-9]+: [0-9]+ checks, [0-9]+ failed$' <<<"$out" || true)
    if [ "$status" -ne 0 ] || [[ "$summary" != *", 0 failed" ]] || grep -q '^SKIP' <<<"$out"; then
        echo "FAIL: $p (status $status, GPU_EMU_SEED=${GPU_EMU_SEED:-0})"; grep -E '^(FAIL|SKIP)|emulator|error' <<<"$out" | head -20; tail -3 <<<"$out"; exit 1
    fi
    echo "ok: $p on the CPU emulator: $summary"
done

# Data parallelism through comm.h's device backend (staged: 4 ranks sharing the emulated GPU).
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
status=0
out=$(timeout 300 $MPIRUN -np 4 "$EMU/test_gpu_ddp" 2>&1) || status=$?
summary=$(grep -E '^test_gpu_ddp: [0-9]+ checks, 0 failed$' <<<"$out" || true)
[ "$status" -eq 0 ] && [ -n "$summary" ] || { echo "FAIL: 4-rank test_gpu_ddp (status $status)"; tail -20 <<<"$out"; exit 1; }
echo "ok: $EMU/test_gpu_ddp on 4 ranks: $summary"

# comm.h on device buffers through each backend, forced by LLAMA_GPU_COMM (the emulated NCCL lets
# ranks share the one device), on 1, 2 and 4 ranks: every call against the same call on host buffers,
# the ordering against kernels, the order between operations.
for np in 1 2 4; do
    for backend in nccl staged; do
        status=0
        out=$(LLAMA_GPU_COMM=$backend timeout 300 $MPIRUN -x LLAMA_GPU_COMM -np $np "$EMU/test_gpu_comm" 2>&1) || status=$?
        summary=$(grep -E '^test_gpu_comm: [0-9]+ checks, 0 failed$' <<<"$out" || true)
        [ "$status" -eq 0 ] && [ -n "$summary" ] && grep -q "^backend: $backend (LLAMA_GPU_COMM=$backend)" <<<"$out" ||
            { echo "FAIL: test_gpu_comm, $backend backend on $np ranks (status $status)"; grep -E '^(FAIL|backend)|error' <<<"$out" | head -20; tail -3 <<<"$out"; exit 1; }
        echo "ok: $EMU/test_gpu_comm, $backend backend on $np ranks: $summary"
    done
done
# One operation from device into host memory is refused with comm.c's message.
status=0
out=$("$EMU/test_gpu_comm" mixed 2>&1) || status=$?
[ "$status" -eq 1 ] && grep -q 'buffers are device memory and the others host memory' <<<"$out" ||
    { echo "FAIL: an all-gather from device into host memory was not refused (status $status): $(tail -2 <<<"$out")"; exit 1; }
echo "ok: device and host buffers in one operation: $(grep -o 'comm: all_gather.*' <<<"$out")"

# Chapter 8's ring attention on device buffers (gpu/cp_device.h) against the same ring on host buffers
# and against the whole sequence's attention, on 1, 2 and 4 ranks (NCCL or staged: the backend
# chooses), zigzag and contiguous; the all-to-all mode refused on device buffers with one line.
for np in 1 2 4; do
    status=0
    out=$(timeout 300 $MPIRUN -np $np "$EMU/test_gpu_cp" 2>&1) || status=$?
    summary=$(grep -E '^test_gpu_cp: [0-9]+ checks, 0 failed$' <<<"$out" || true)
    [ "$status" -eq 0 ] && [ -n "$summary" ] ||
        { echo "FAIL: test_gpu_cp on $np ranks (status $status)"; grep -E '^FAIL|error' <<<"$out" | head -20; tail -3 <<<"$out"; exit 1; }
    echo "ok: $EMU/test_gpu_cp on $np ranks: $summary"
done
# The FP8 linears' tensor-parallel pieces on 2 ranks (staged backend), against chapter 9's.
status=0
out=$(timeout 300 $MPIRUN -np 2 "$EMU/test_gpu_fp8" 2>&1) || status=$?
summary=$(grep -E '^test_gpu_fp8: [0-9]+ checks, 0 failed$' <<<"$out" || true)
[ "$status" -eq 0 ] && [ -n "$summary" ] && grep -q '^PASS fp8 tp row-parallel rank 1 dW' <<<"$out" ||
    { echo "FAIL: test_gpu_fp8 on 2 ranks (status $status)"; grep -E '^FAIL|error' <<<"$out" | head -20; tail -3 <<<"$out"; exit 1; }
echo "ok: $EMU/test_gpu_fp8 on 2 ranks (tensor parallel): $summary"
status=0
out=$($MPIRUN -np 2 "$EMU/test_gpu_cp" alltoall 2>&1) || status=$?
[ "$status" -ne 0 ] && grep -q -- '--cp-mode alltoall on device buffers' <<<"$out" ||
    { echo "FAIL: the all-to-all on device buffers was not refused (status $status): $(tail -3 <<<"$out")"; exit 1; }
echo "ok: $(grep -o -- '--cp-mode alltoall on device buffers.*' <<<"$out" | head -1)"

# make bench-gpu's plumbing on the emulator (its times are the emulator's, not a GPU's): our steps,
# the attention and the GEMMs alone, this "GPU" as a chapter 11 profile (scripts/gpu_profile.py),
# and build/plan's prediction of the measured step with that profile.
mkdir -p "$TEST_TMP/bench_gpu"
for f in train plan; do ln -sfn "$(cd "$BUILD" && pwd)/$f" "$TEST_TMP/bench_gpu/$f"; done
ln -sfn "$(cd "$EMU" && pwd)/bench_gpu" "$TEST_TMP/bench_gpu/bench_gpu"
out=$(BUILD="$TEST_TMP/bench_gpu" BENCH_GPU_MODEL=tiny BENCH_GPU_SEQS=32 BENCH_GPU_BATCH=2 BENCH_GPU_STEPS=3 \
    BENCH_GPU_TORCH= BENCH_GPU_TRACE="$TEST_TMP/bench_gpu/traced.pftrace" bash scripts/bench_gpu.sh 2>&1) ||
    { echo "FAIL: scripts/bench_gpu.sh on the emulator"; tail -20 <<<"$out"; exit 1; }
# BENCH_GPU_TRACE: a traced run of its own, which says which timeline it recorded, and its file
grep -q "^trace: the marked regions only (per-kernel records off: the CPU emulator has no CUPTI)" <<<"$out" &&
    [ -s "$TEST_TMP/bench_gpu/traced.pftrace" ] || { echo "FAIL: BENCH_GPU_TRACE's run"; tail -20 <<<"$out"; exit 1; }
profile="$TEST_TMP/bench_gpu/gpu-profile-tiny-32.json"
grep -qE '^gemm: tokens=64 bf16_flops=[0-9.e+]+ bf16_ms=[0-9.e+-]+ fp8_flops=[0-9.e+]+ fp8_ms=[0-9.e+-]+ ' <<<"$out" &&
    grep -qE "^build/plan --cluster $profile: step [0-9.]+ ms predicted, [0-9.]+ measured" <<<"$out" &&
    "$PYTHON" -c 'import json, sys
p = json.load(open(sys.argv[1]))
need = ["peak_bf16", "peak_fp8", "gemm_eff", "fp8_gemm_eff", "attn_eff", "hbm_bw", "hbm_bytes"]
sys.exit(0 if all(p.get(k, 0) > 0 for k in need) else 1)' "$profile" ||
    { echo "FAIL: bench_gpu.sh's profile and prediction"; tail -20 <<<"$out"; cat "$profile" 2>/dev/null; exit 1; }
echo "ok: $(grep '^build/plan --cluster' <<<"$out")"
grep -qE "^  ours, tiles 64,64,128 " <<<"$out" ||
    { echo "FAIL: bench_gpu.sh's row for the attention kernels' default tiles 64,64,128"; tail -20 <<<"$out"; exit 1; }
for rows in 64,64,64 128,128,64 128,128,128; do
    grep -qE "^  ours, tiles $rows .* same bits: yes$" <<<"$out" ||
        { echo "FAIL: bench_gpu.sh's row for the attention kernels' tiles $rows"; tail -20 <<<"$out"; exit 1; }
done
# --attention-only times the kernels' tile sizes and compares their results bit for bit: on `small`
# (head_dim 64) the tensor-core kernels, with the default tiles (64-row query tiles in the forward and
# dQ kernels, a 128-row key tile in dK/dV), then 64 rows in all three, 128 in the forward and dQ
# kernels with 64 in dK/dV, and 128 in all three.
out=$("$EMU/bench_gpu" --model small --batch 1 --seq-len 192 --steps 2 --warmup 1 --attention-only 2>&1) ||
    { echo "FAIL: bench_gpu --attention-only on small"; tail -5 <<<"$out"; exit 1; }
for line in "attention: .* rows=64,64,128 " "attention-tiles: rows=64,64,64 " "attention-tiles: rows=128,128,64 " \
    "attention-tiles: rows=128,128,128 "; do
    [ "$(grep -cE "^$line" <<<"$out")" -eq 1 ] ||
        { echo "FAIL: the attention kernels' 64- and 128-row tiles, no line $line: $(grep attention <<<"$out")"; exit 1; }
done
[ "$(grep -c 'same_bits=yes$' <<<"$out")" -eq 3 ] ||
    { echo "FAIL: the attention kernels' tiles gave other bits: $(grep attention-tiles <<<"$out")"; exit 1; }
echo "ok: $(grep attention-tiles <<<"$out" | tr '\n' ';')"
# PyTorch out of memory at ours' batch: both again at half of it, one table. A stand-in for PyTorch's
# script: out of memory above batch 1 (as CUDA words it), else a timing line; no attention line.
cat > "$TEST_TMP/bench_gpu/fake_torch" <<'FAKE'
#!/usr/bin/env bash
batch=$(sed -n 's/.*--batch \([0-9]*\).*/\1/p' <<<"$*")
[ "$batch" -le 1 ] || { echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"; exit 1; }
echo "timing: steps=3 measured=1 mean_step_ms=10.0 tokens_per_s=3200.0 tflops=0.01 mfu=0.0001 last_loss=5.0"
FAKE
chmod +x "$TEST_TMP/bench_gpu/fake_torch"
out=$(BUILD="$TEST_TMP/bench_gpu" BENCH_GPU_MODEL=tiny BENCH_GPU_SEQS=32 BENCH_GPU_BATCH=2 BENCH_GPU_STEPS=3 \
    BENCH_GPU_TORCH=eager BENCH_GPU_PYTHON="$TEST_TMP/bench_gpu/fake_torch" bash scripts/bench_gpu.sh 2>&1) ||
    { echo "FAIL: scripts/bench_gpu.sh with PyTorch out of memory"; tail -20 <<<"$out"; exit 1; }
grep -q "^bench-gpu: PyTorch ( eager ) ran out of memory at batch 2: ours and PyTorch again at 1" <<<"$out" &&
    grep -q "^model tiny (all layers), batch 1 x 32 tokens" <<<"$out" && grep -q "^PyTorch eager (SDPA) .* 3200 " <<<"$out" &&
    grep -q "^ours (gpu/, bf16) " <<<"$out" ||
    { echo "FAIL: bench_gpu.sh did not retry at half the batch"; tail -30 <<<"$out"; exit 1; }
echo "ok: PyTorch out of memory at batch 2: ours and PyTorch compared at batch 1"
# A run that left no line is refused by the profile's maker: exit 2, one line.
echo "SKIP: no CUDA device" > "$TEST_TMP/bench_gpu/skipped.txt"
status=0
out=$("$PYTHON" scripts/gpu_profile.py --gemm "$TEST_TMP/bench_gpu/skipped.txt" --attention "$TEST_TMP/bench_gpu/skipped.txt" \
    --peak-tflops 989 --out "$TEST_TMP/bench_gpu/none.json" 2>&1) || status=$?
[ "$status" -eq 2 ] && [ "$(grep -c . <<<"$out")" -eq 1 ] && [ ! -e "$TEST_TMP/bench_gpu/none.json" ] ||
    { echo "FAIL: gpu_profile.py on a skipped run (status $status): $out"; exit 1; }
echo "ok: $out"

# The traced step's GPU timeline, next to the host's slices, against the Perfetto schema: one
# process track, "compute" and "cuda:compute".
"$PYTHON" tests/py/trace_check.py "$TEST_TMP/gpu_timeline.pftrace" --expect-tracks 3 --expect-slice "step 1" \
    --expect-slice "embedding fwd" --expect-slice "block fwd" --expect-slice "head fwd + loss" \
    --expect-slice "head bwd" --expect-slice "block bwd" --expect-slice "embedding bwd" --expect-slice optimizer
