#!/usr/bin/env bash
# The GPU side on any machine. Where nvcc exists: every gpu/*.cu compiles for sm_90a with the
# Makefile's flags and prints nothing at all (no warning, no remark); the GPU test programs link
# and, without a CUDA device, print one SKIP line and exit 0 (with a device they must pass), and so
# does build/bench_gpu. The Makefile's guard: with nvcc hidden, the GPU targets say SKIP and build
# nothing. Where nvcc does not exist this script says SKIP. (tests/test_gpu_host.c and
# tests/test_gpu_model_host.c, the host-side parts, run in every build.)
set -euo pipefail
BUILD=${BUILD:-build}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}

out=$(make --no-print-directory -s NVCC= gpu 2>&1)
[[ "$out" == "SKIP: nvcc not found"* ]] || { echo "FAIL: make gpu without nvcc printed: $out"; exit 1; }
echo "ok: without nvcc, make gpu says: $out"

if ! command -v nvcc >/dev/null 2>&1; then
    echo "SKIP: nvcc not found: the GPU sources were not compiled"
    exit 0
fi

flags=$(make --no-print-directory -s print-nvccflags)
for src in gpu/*.cu; do
    obj="$TEST_TMP/$(basename "$src" .cu).o"
    # shellcheck disable=SC2086  # the flags are words
    if ! msg=$(nvcc $flags -c "$src" -o "$obj" 2>&1); then
        echo "FAIL: $src does not compile:"; echo "$msg"; exit 1
    fi
    [ -z "$msg" ] || { echo "FAIL: $src: the compiler said something:"; echo "$msg"; exit 1; }
    echo "ok: $src compiles for sm_90a without a diagnostic"
done

# A .cu entry point must launch kernels, never fall through to the CPU op of the same name: none of
# the objects may call a function that reference_cpu defines (C++ overload resolution picks an
# exact non-template match over the templated launcher; that sent gpu_rmsnorm_forward's fp32 path to
# the CPU rmsnorm_forward on device pointers once).
ref_defined=$(nm --defined-only -g "$BUILD/libref32.a" 2>/dev/null | awk 'NF == 3 {print $3}' | sort -u)
[ -n "$ref_defined" ] || { echo "FAIL: no symbols read from $BUILD/libref32.a (make)"; exit 1; }
for obj in "$TEST_TMP"/*.o; do
    calls=$(nm -u "$obj" | awk '{print $2}' | sort -u | comm -12 - <(echo "$ref_defined") | tr '\n' ' ')
    [ -z "$calls" ] || { echo "FAIL: $(basename "$obj" .o).cu calls reference_cpu's $calls"; exit 1; }
done
echo "ok: no GPU object calls a reference_cpu function"

have_gpu=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then have_gpu=yes; fi
shopt -s nullglob
programs=("$BUILD"/tests/gpu/test_*)
[ ${#programs[@]} -gt 0 ] || { echo "FAIL: no GPU test program in $BUILD/tests/gpu (make gpu)"; exit 1; }
for t in "${programs[@]}"; do
    [[ "$t" == *.d ]] && continue
    status=0
    msg=$("$t" 2>&1) || status=$?
    if [ "$have_gpu" = no ]; then
        [ "$status" -eq 0 ] && [[ "$msg" == "SKIP: no CUDA device"* ]] ||
            { echo "FAIL: $t without a GPU: status $status, output: $msg"; exit 1; }
        echo "ok: $t without a GPU: $msg"
    else
        [ "$status" -eq 0 ] || { echo "FAIL: $t on the GPU: status $status"; echo "$msg" | tail -40; exit 1; }
        echo "ok: $t on the GPU: $(echo "$msg" | tail -1)"
    fi
done

# make test-gpu on a machine without a device must fail, with one clear line from gpu_init.
if [ "$have_gpu" = no ]; then
    status=0
    msg=$(GPU_TEST_REQUIRE_DEVICE=1 "$BUILD/tests/gpu/test_gpu_ops" 2>&1) || status=$?
    [ "$status" -ne 0 ] && grep -q 'no CUDA device: ' <<<"$msg" ||
        { echo "FAIL: GPU_TEST_REQUIRE_DEVICE=1 without a device: status $status, output: $msg"; exit 1; }
    echo "ok: with a device required and none present: $(grep 'no CUDA device' <<<"$msg")"
fi

# The benchmark program: SKIP without a device; with one, a few steps of tiny must print a timing line.
status=0
msg=$("$BUILD/bench_gpu" --model tiny --batch 2 --seq-len 32 --steps 3 --warmup 1 2>&1) || status=$?
if [ "$have_gpu" = no ]; then
    [ "$status" -eq 0 ] && [[ "$msg" == "SKIP: no CUDA device"* ]] ||
        { echo "FAIL: bench_gpu without a GPU: status $status, output: $msg"; exit 1; }
    echo "ok: bench_gpu without a GPU: $msg"
else
    [ "$status" -eq 0 ] && grep -q '^timing:' <<<"$msg" || { echo "FAIL: bench_gpu on the GPU: $msg"; exit 1; }
    echo "ok: bench_gpu on the GPU: $(grep '^timing:' <<<"$msg")"
fi
