#!/usr/bin/env bash
# Runs every test: each compiled suite in $BUILD/tests (Check), then each tests/t_*.sh script
# (end-to-end runs of the trainer, the PyTorch oracle, the trace schema check). Prints one line
# per test and a closing "N passed, N skipped, N failed". A test that prints a line starting with
# "SKIP:" (what it needs is missing here: nvcc, a C++ compiler) counts as skipped, not passed; one
# that passes with a part skipped prints "SKIP (part): why", shown on its PASS line. One that exits 0
# but printed a line starting with "FAIL" fails (a failure it reported and did not exit on): output
# that shows a failure on purpose (a check proven able to fail) is indented or prefixed.
# Runs from the repository root wherever it is started from (BUILD is relative to it).
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
export BUILD PYTHON=${PYTHON:-$BUILD/venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=1 CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-600}
TMP_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/llama-tests.XXXXXX")
trap 'rm -rf "$TMP_ROOT"' EXIT
passed=0 skipped=0 failed=0 failed_names=""
run_one() {  # name, command...
    local name=$1; shift
    local log="$TMP_ROOT/$name.log" start=$SECONDS
    if TEST_TMP="$TMP_ROOT/$name.d" bash -c 'mkdir -p "$TEST_TMP" && "$@"' _ "$@" >"$log" 2>&1; then
        local skip_line; skip_line=$(grep -m1 '^SKIP' "$log" || true)
        local fail_line; fail_line=$(grep -m1 -E '^FAIL([: ]|$)' "$log" || true)
        if [ -n "$fail_line" ]; then  # a failure it reported and did not exit on
            failed=$((failed + 1)); failed_names="$failed_names $name"
            echo "FAIL $name ($((SECONDS - start))s): exited 0 after printing: $fail_line"; sed 's/^/    /' "$log" | tail -60
        elif [[ "$skip_line" == "SKIP:"* ]]; then
            skipped=$((skipped + 1)); echo "SKIP $name ($((SECONDS - start))s): ${skip_line#SKIP: }"
        else
            passed=$((passed + 1)); echo "PASS $name ($((SECONDS - start))s)${skip_line:+ ($skip_line)}"
        fi
    else
        failed=$((failed + 1)); failed_names="$failed_names $name"
        echo "FAIL $name ($((SECONDS - start))s)"; sed 's/^/    /' "$log" | tail -60
    fi
}
suites=0
for t in "$BUILD"/tests/test*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    suites=$((suites + 1))
    run_one "$(basename "$t")" "$t"
done
# An empty or missing $BUILD/tests would otherwise end "0 failed": the C suites were not built.
[ "$suites" -gt 0 ] || { echo "FAIL: no test programs in $BUILD/tests (run make all first)"; failed=$((failed + 1)); }
scripts=0
for t in tests/t_*.sh; do
    [ -f "$t" ] || continue
    scripts=$((scripts + 1))
    run_one "$(basename "$t" .sh)" bash "$t"
done
[ "$scripts" -gt 0 ] || { echo "FAIL: no tests/t_*.sh scripts found"; failed=$((failed + 1)); }
[ -n "$failed_names" ] && echo "failed:$failed_names"
echo "$passed passed, $skipped skipped, $failed failed"
[ "$failed" -eq 0 ]
