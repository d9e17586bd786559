# tests/lib.sh: what the multi-rank end-to-end scripts share (source it after `set -eu`; needs
# $BUILD, $PYTHON and $TEST_TMP from tests/run_tests.sh).
T="$TEST_TMP"
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
export OMP_NUM_THREADS=1  # oversubscribed ranks: one thread each
P="$PYTHON tests/py/compare_runs.py"

# expect_error RANKS WANTED FLAGS...: the trainer under mpirun must exit with status 2 (bad input),
# and print exactly one line of its own (starting "train") that contains WANTED.
expect_error() {
    local np=$1 want=$2; shift 2
    local out rc
    # --model tiny --steps 1 unless the case gives its own (a flag given twice is itself an error)
    local defaults=()
    [[ " $* " == *" --model "* ]] || defaults+=(--model tiny)
    [[ " $* " == *" --steps "* ]] || defaults+=(--steps 1)
    out=$($MPIRUN -np "$np" "$BUILD/train" "${defaults[@]}" "$@" 2>&1 >/dev/null) && rc=0 || rc=$?  # also under set -e
    local ours; ours=$(printf '%s\n' "$out" | grep '^train' || true)
    if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$ours" | grep -c .)" -ne 1 ] || [[ "$ours" != *"$want"* ]]; then
        echo "FAIL: -np $np $* -> rc $rc: $out"; exit 1
    fi
    echo "ok: -np $np $* -> $ours"
}

# activations_peak LOG: the activations row's peak (MiB, rank 0) in the memory table a run ends with
# (not the "activations held after the last step" line).
activations_peak() { awk '$1 == "activations" && NF == 3 {print $3}' "$1"; }
