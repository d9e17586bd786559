#!/usr/bin/env bash
# A second compiler: the trainer and the reference's unit suites built with clang (and its OpenMP
# runtime, LLVM's libomp) into $BUILD/clang. There:
# - the unit suites pass;
# - the process runs one OpenMP runtime: OpenBLAS's OpenMP build asks for libgomp, and the Makefile
#   hands it libomp instead ($BUILD/clang/omp). With both loaded, OMP_PROC_BIND=true ran every thread
#   on one CPU;
# - tests/t_determinism.sh passes as it does for the GCC build: bit-identical reruns and resumes,
#   the same bits for 1 and 2 threads, all CPUs under OMP_PROC_BIND;
# - step 1's gradients equal the GCC build's within 1e-5 of each tensor's largest entry. Not bit for
#   bit: the two compilers fuse a * b + c into one FMA in different places, and vectorise different
#   loops (measured: 5.4e-7).
set -eu
C="$BUILD/clang"
T="$TEST_TMP"
command -v clang >/dev/null || { echo "FAIL: clang not found (make deps installs it)"; exit 1; }
suites=(test_reference test64_gradcheck test_exp_f32 test_checkpointing test_fp8 test_data test_plan test_pp_schedule)
make -s BUILD="$C" CC=clang CXX=clang++ "$C/train" "${suites[@]/#/$C/tests/}"
echo "ok: built with $(clang --version | head -1) in $C"

for s in "${suites[@]}"; do
    "$C/tests/$s" >"$T/$s.log" 2>&1 || { tail -n 30 "$T/$s.log"; echo "FAIL: $s (clang build)"; exit 1; }
done
echo "ok: ${#suites[@]} unit suites pass"

runtimes=$(ldd "$C/train" | grep -oE 'lib(gomp|omp|iomp5)[.]so[.0-9]*' | sort -u | tr '\n' ' ')
[ "$(echo $runtimes | wc -w)" -eq 1 ] || { echo "FAIL: $C/train loads OpenMP runtimes: $runtimes"; exit 1; }
echo "ok: one OpenMP runtime: $runtimes"

mkdir -p "$T/determinism"
BUILD="$C" TEST_TMP="$T/determinism" bash tests/t_determinism.sh

common=(--model tiny --steps 1 --batch 4 --seed 11)
"$BUILD/train" "${common[@]}" --dump "$T/gcc.safetensors" >"$T/gcc.log" 2>&1
"$C/train" "${common[@]}" --grad-dump "$T/clang.safetensors" >"$T/clang.log" 2>&1
"$PYTHON" tests/py/compare_runs.py --ckpt "$T/clang.safetensors" --ckpt-ref "$T/gcc.safetensors" --prefix grad. \
    --param-rtol 1e-5
echo "ok: step 1's gradients, clang against GCC"
