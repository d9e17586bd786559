#!/usr/bin/env bash
# The comm stream under mpirun: tests/test_comm_mpi on 2, 3, 4 and 8 ranks (oversubscribed), with a
# traced section checked against the Perfetto schema; once more with every MPI call cut into
# 4000-byte pieces; then the ways a run must end when a rank fails: killed (mpirun notices), hung
# or stopped (the comm timeout fires and names the ranks that did not arrive). Each mpirun is bounded by `timeout`, so a hang fails the test
# instead of stalling it. Needs $BUILD/tests/test_comm_mpi (make) and $PYTHON with `perfetto`.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
BIN=$BUILD/tests/test_comm_mpi
OUT=$TEST_TMP/mpirun.out

# run LIMIT_S N ARGS...: one bounded mpirun; output in $OUT, exit status in $status, time in $took.
run() {
    local limit=$1 n=$2
    shift 2
    local start=$SECONDS
    status=0
    timeout "$limit" $MPIRUN -np "$n" "$BIN" "$@" >"$OUT" 2>&1 || status=$?
    took=$((SECONDS - start))
}
fail() {
    echo "FAIL: $*"
    sed 's/^/    /' "$OUT" | tail -40
    exit 1
}
expect_output() {  # extended regex, what it means
    grep -Eq -- "$1" "$OUT" || fail "$2: no line matches /$1/"
}

for n in 2 3 4 8; do
    run 120 $n --trace "$TEST_TMP/comm_$n.pftrace"
    [ "$status" -eq 0 ] || fail "$n ranks: exit status $status"
    expect_output "^test_comm_mpi: $n ranks: all checks passed" "$n ranks"
    echo "ok: $(grep '^test_comm_mpi:' "$OUT") in ${took}s"
done
# Per rank a process track, "compute" and "comm:world"; every send's flow must end at its receive.
for n in 2 8; do
    "$PYTHON" tests/py/trace_check.py "$TEST_TMP/comm_$n.pftrace" --json "$TEST_TMP/comm_$n.pftrace.json" \
        --expect-tracks $((3 * n)) --expect-slice matmul --expect-slice all_reduce --expect-slice all_gather \
        --expect-slice batch --expect-slice barrier
done

run 120 3 --chunk-bytes 4000
[ "$status" -eq 0 ] || fail "3 ranks, 4000-byte pieces: exit status $status"
expect_output "^test_comm_mpi: 3 ranks: all checks passed" "3 ranks, 4000-byte pieces"
echo "ok: 3 ranks with every MPI call cut to 4000 bytes, in ${took}s"

# Rank 1 dies by SIGKILL in the middle of a loop of all-reduces: mpirun must end the job and name it.
run 60 4 --kill-rank 1 --timeout 10
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "killed rank: exit status $status (124: still running after 60 s)"
expect_output "process rank 1 .*signal 9|did not finish after" "killed rank"
echo "ok: killed rank 1 ended the run in ${took}s, status $status: $(grep -E 'process rank 1|did not finish' "$OUT" | head -1)"

# Rank 1 stops taking part without dying: only the comm timeout (3 s) can end the run.
run 60 4 --hang p2p --hang-rank 1 --timeout 3
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "hung peer: exit status $status"
expect_output "^comm: recv on group world \(4 ranks\) did not finish after 3 s on world rank 0; waiting on peer rank 1 \(world rank 1\)" "hung peer"
echo "ok: hung peer, timeout after ${took}s: $(grep '^comm:' "$OUT" | head -1)"

run 60 4 --hang collective --hang-rank 2 --timeout 3
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "hung collective: exit status $status"
expect_output "^comm: barrier on group world \(4 ranks\) did not finish after 3 s on world rank [013]; did not arrive: world rank 2 \(alive, still at collective 0 of this group; this is 1\)$" "hung collective"
echo "ok: hung collective, timeout after ${took}s: $(grep '^comm:' "$OUT" | head -1)"

# Rank 3 is stopped (SIGSTOP) after two barriers: the others' third barrier times out and names it
# as not answering; the run must end (MPI_Abort), not hang for the default timeout.
run 60 4 --hang stop --hang-rank 3 --timeout 3
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "stopped rank: exit status $status"
expect_output "^comm: barrier on group world \(4 ranks\) did not finish after 3 s on world rank [012]; did not arrive: world rank 3 \(no answer: stopped or dead\)$" "stopped rank"
echo "ok: stopped rank, timeout after ${took}s: $(grep '^comm:' "$OUT" | head -1)"
