#!/usr/bin/env bash
# The comm stream under mpirun: tests/test_comm_mpi on 2, 3, 4 and 8 ranks (oversubscribed), with a
# traced section checked against the Perfetto schema; once more with every MPI call cut into
# 4000-byte pieces; then the ways a run must end when a rank fails: killed (mpirun notices), hung
# or stopped (the comm timeout fires and names the ranks that did not arrive, also around
# comm_finalize); and calls the ranks do not agree on (a collective's kind, count, dtype, op or
# root; a receive's count), each of which must end the run with a line saying what differs. Each mpirun is bounded by `timeout`, so a hang fails the test
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

# A rank that stops taking part: only the comm timeout (3 s) can end the run, and its line must say
# who did not arrive and why.
timeout_case() {  # LIMIT N KIND RANK REGEX WHAT
    local limit=$1 n=$2 kind=$3 rank=$4 regex=$5 what=$6
    run "$limit" "$n" --hang "$kind" --hang-rank "$rank" --timeout 3
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "$what: exit status $status (124: still running after $limit s)"
    expect_output "$regex" "$what"
    echo "ok: $what, timeout after ${took}s: $(grep '^comm:' "$OUT" | head -1)"
}
# Rank 1 stops taking part without dying.
timeout_case 60 4 p2p 1 "^comm: recv on group world \(4 ranks\) did not finish after 3 s on world rank 0; waiting on peer rank 1 \(world rank 1\)" "hung peer"
timeout_case 60 4 collective 2 "^comm: barrier on group world \(4 ranks\) did not finish after 3 s on world rank [013]; did not arrive: world rank 2 \(alive, still at collective 0 of this group; this is 1\)$" "hung collective"
# Rank 3 is stopped (SIGSTOP) after two barriers: the others' third barrier times out and names it
# as not answering; the run must end (MPI_Abort), not hang for the default timeout.
timeout_case 60 4 stop 3 "^comm: barrier on group world \(4 ranks\) did not finish after 3 s on world rank [012]; did not arrive: world rank 3 \(no answer: stopped or dead\)$" "stopped rank"
# Rank 1 stops (SIGSTOP) after its last collective, while the others are in comm_finalize: its
# closing barrier is polled like every collective, so the timeout names the stopped rank (an
# unpolled MPI_Finalize waited for ever).
timeout_case 30 4 late 1 "^comm: finalize on group world \(4 ranks\) did not finish after 3 s on world rank [023]; did not arrive: world rank 1 \(no answer: stopped or dead\)$" "rank stopped before comm_finalize"
# Rank 1 skips a barrier of a subgroup and goes on to comm_finalize: the others' barrier times
# out, and rank 1, still in comm_finalize's barrier, answers that it is behind (it was reported as
# "no answer" when comm_finalize stopped its comm thread at once). Rank 1's own finalize barrier
# times out at about the same moment: whichever line comes first ends the run, and either must
# name the others as alive and where they are.
skip_barrier="^comm: barrier on group sub \(3 ranks\) did not finish after 3 s on world rank [02]; did not arrive: world rank 1 \(alive, still at collective 1 of this group; this is 2\)$"
skip_finalize="^comm: finalize on group world \(3 ranks\) did not finish after 3 s on world rank 1; did not arrive: world rank 0 \(alive, still at collective 1 of this group; this is 2\), world rank 2 \(alive, still at collective 1 of this group; this is 2\)$"
timeout_case 30 3 skip 1 "$skip_barrier|$skip_finalize" "rank that skipped a barrier and finished"

# Calls that do not match: rank 1 calls what the others do not. Each must end the run with one line
# that says what differs (they went through silently, or failed inside MPI, or timed out).
mismatch() {  # CASE N REGEX [ARGS...]
    local case=$1 n=$2 regex=$3
    shift 3
    run 30 "$n" --mismatch "$case" --timeout 5 "$@"
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "mismatch $case: exit status $status"
    ! grep -q "went unnoticed" "$OUT" || fail "mismatch $case: went unnoticed"
    expect_output "$regex" "mismatch $case"
    echo "ok: mismatch $case in ${took}s: $(grep -E "$regex" "$OUT" | head -1)"
}
disagree="failed on world rank [023]: collective 1 of this group: this rank runs"
mismatch root 3 "^comm: broadcast on group world \(3 ranks\) $disagree broadcast\(4 float32, root 0\), but world rank 1 runs broadcast\(4 float32, root 1\); "
mismatch op 4 "^comm: all_reduce on group world \(4 ranks\) $disagree all_reduce\(4 float32, SUM\), but world rank 1 runs all_reduce\(4 float32, MAX\); "
mismatch count 3 "^comm: all_reduce on group world \(3 ranks\) $disagree all_reduce\(4 float32, SUM\), but world rank 1 runs all_reduce\(5 float32, SUM\); "
mismatch count 3 "^comm: all_reduce on group world \(3 ranks\) $disagree all_reduce\(4 float32, SUM\), but world rank 1 runs all_reduce\(5 float32, SUM\); " --chunk-bytes 8
mismatch dtype 2 "^comm: all_reduce on group world \(2 ranks\) $disagree all_reduce\(4 float32, SUM\), but world rank 1 runs all_reduce\(4 int32, SUM\); "
mismatch kind 3 "^comm: all_reduce on group world \(3 ranks\) $disagree all_reduce\(4 float32, SUM\), but world rank 1 runs all_gather\(4 float32\); "
mismatch finalize 3 "^comm: barrier on group world \(3 ranks\) failed on world rank [02]: collective 2 of this group: this rank runs barrier, but world rank 1 runs finalize \(comm_finalize\); "
recv="^comm: recv on group world \(2 ranks\) failed on world rank 1: the message from peer rank 0 \(world rank 0\), tag 7,"
mismatch recv-short 2 "$recv holds 3 float32 where 5 were posted; a receive's count must equal its send's$"
mismatch recv-long 2 "$recv holds more than the 3 float32 posted; a receive's count must equal its send's$"
mismatch recv-pieces 2 "$recv holds 500 float32 where 1000 were posted \(piece 1 of 2 of a receive of 1500; " --chunk-bytes 4000
