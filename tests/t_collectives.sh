#!/usr/bin/env bash
# Chapter 1: the ring collectives (chapters/01_collectives/ring.c) against the built-in ones.
#   --check on 2, 3, 4 and 8 ranks (oversubscribed): every collective, dtype and op on sizes 0, 1,
#     N-1, N+1, primes and large ones. Bit-identical where ring.h says so (int32, all-gather, N = 2,
#     chunk N-1; max up to the sign of zero); float sums within N*eps*sum|x| elsewhere. On top of the
#     program's own verdict: on 2 ranks no element may differ at all, on more ranks the float sums
#     must really differ in some bits (else the tolerance was never exercised) and max must show the
#     +0/-0 ties ring.h describes; --tol-scale 0 (demand bit-identity) must fail with exit 1.
#     A NaN wins MAX: with NaNs planted on one rank (each in turn, at the first element of every
#     chunk), all-reduce and reduce-scatter in float32 and float64 must give NaN there on every rank
#     holding the element, ring and built-in alike (exact): four "nan" rows, each with NaNs planted
#     and every one of them found.
#   --bench on 2 and 4 ranks with tiny sizes: the table's columns must agree with each other
#     (algbw = size / time, busbw / algbw = 2(N-1)/N or (N-1)/N, size = count * 4 [* N]).
#   --trace on 3 ranks: the merged file passes the Perfetto schema check, and every ring step is a
#     slice with one flow to the same step on the right neighbour: 2(N-1) steps x ranks x iterations.
#   bad flags exit 2 with one line.
# Each mpirun is bounded by `timeout`. Needs $BUILD/collectives (make) and $PYTHON with `perfetto`.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
export OMP_NUM_THREADS=1
BIN=$BUILD/collectives
OUT=$TEST_TMP/collectives.out

# run N ARGS...: one bounded mpirun; output in $OUT, exit status in $status.
run() {
    local n=$1
    shift
    status=0
    timeout 120 $MPIRUN -np "$n" "$BIN" "$@" >"$OUT" 2>&1 || status=$?
}
fail() {
    echo "FAIL: $*"
    sed 's/^/    /' "$OUT" | tail -40
    exit 1
}
# The --check table: collective dtype op rule elements differ zeros max_abs max_rel max_ratio result.
rows() { grep -E '^(all_reduce|reduce_scatter|all_gather) ' "$OUT"; }
# The NaN rows: nan collective dtype op planted ring_nan builtin_nan wrong result.
nan_rows() { grep -E '^nan +(all_reduce|reduce_scatter) ' "$OUT"; }

for n in 2 3 4 8; do
    start=$SECONDS
    run $n --check
    [ "$status" -eq 0 ] || fail "--check on $n ranks: exit status $status"
    grep -q "^collectives --check: all passed on $n ranks" "$OUT" || fail "--check on $n ranks: no verdict line"
    [ "$(rows | wc -l)" -eq 19 ] || fail "--check on $n ranks: expected 19 rows (collective x dtype x op)"
    if [ $n -eq 2 ]; then
        rows | awk '$6 != 0 { bad = 1; print "differs on 2 ranks: " $0 } END { exit bad }' ||
            fail "2 ranks must be bit-identical everywhere"
    else
        rows | awk '$4 == "tol" && $6 == 0 { bad = 1; print "no rounding difference: " $0 } END { exit bad }' ||
            fail "$n ranks: float sums never differed, so the tolerance was not exercised"
        rows | awk '$4 == "value" && $7 == 0 { bad = 1; print "no +0/-0 tie: " $0 } END { exit bad }' ||
            fail "$n ranks: max showed no +0/-0 tie"
    fi
    [ "$(nan_rows | wc -l)" -eq 4 ] || fail "--check on $n ranks: expected 4 nan rows (all-reduce, reduce-scatter x float32, float64)"
    nan_rows | awk '$5 == 0 || $6 != $5 || $7 != $5 || $8 != 0 || $9 != "ok" { bad = 1; print "NaN lost: " $0 } END { exit bad }' ||
        fail "$n ranks: a NaN planted on one rank must win max everywhere, ring and built-in"
    echo "ok: --check on $n ranks: a NaN on one rank wins max: $(nan_rows | awk '{ p += $5 } END { print p }') planted elements, all NaN in ring and built-in"
    echo "ok: --check on $n ranks in $((SECONDS - start))s: $(rows | awk '$4 == "tol" { d += $6; e += $5 } END {
        if (e) printf "float sums and averages differ from the built-in in %.1f%% of elements, all within tolerance", 100 * d / e;
        else printf "bit-identical everywhere" }')"
done

run 3 --check --tol-scale 0
[ "$status" -eq 1 ] || fail "--check --tol-scale 0 on 3 ranks: exit status $status, want 1"
grep -qE '^collectives \[rank [0-9]\]: FAIL all_reduce float32 sum, count [0-9]+ on 3 ranks: [0-9]+ of [0-9]+ elements break rule tol; worst element [0-9]+: ring .* built-in .* \|diff\| .* \(tol 0\)$' "$OUT" ||
    fail "--tol-scale 0: no failure line naming the worst element"
echo "ok: demanding bit-identity on 3 ranks fails with exit 1: $(grep -m1 'FAIL all_reduce float32 sum' "$OUT")"

# Bench: each row is: collective size count | time algbw busbw | time algbw busbw (ring, built-in).
for n in 2 4; do
    run $n --bench --min-bytes 1024 --max-bytes 65536 --factor 4 --iters 3 --warmup 1
    [ "$status" -eq 0 ] || fail "--bench on $n ranks: exit status $status"
    grep -E '^  (all_reduce|reduce_scatter|all_gather) ' "$OUT" | awk -v n=$n '
        function check(what, got, want, rtol) {
            if (got < want * (1 - rtol) || got > want * (1 + rtol)) { print "row " NR ": " what " " got ", want " want; bad = 1 }
        }
        {
            rows++
            factor = $1 == "all_reduce" ? 2 * (n - 1) / n : (n - 1) / n
            check("size", $2, $3 * 4 * ($1 == "all_reduce" ? 1 : n), 0)
            for (i = 5; i <= 9; i += 4) {     # ring, then built-in
                check("algbw", $(i + 1), $2 / ($i * 1e3), 1e-2)   # bytes / us -> GB/s; time printed to 0.01 us
                check("busbw/algbw", $(i + 2) / $(i + 1), factor, 2e-3)   # 4 significant digits each
            }
        }
        END { if (rows != 12) { print rows " rows, want 12 (3 collectives x 1, 4, 16, 64 KiB)"; bad = 1 } exit bad }' ||
        fail "--bench on $n ranks: inconsistent table"
    echo "ok: --bench on $n ranks: 12 rows, algbw = size/time and busbw/algbw = $([ $n -eq 2 ] && echo "1 and 1/2" || echo "3/2 and 3/4")"
done

# Trace: 3 ranks (chunks of 1024 floats are uneven: 341, 341, 342), 2 ring all-reduces.
TRACE=$TEST_TMP/ring.pftrace
run 3 --trace "$TRACE" --trace-bytes 4096 --trace-iters 2
[ "$status" -eq 0 ] || fail "--trace on 3 ranks: exit status $status"
# Per rank: a process track, "ring" and "comm:world" (the comm stream's own slices and flows).
"$PYTHON" tests/py/trace_check.py "$TRACE" --expect-tracks 9 --expect-slice "ring all_reduce" \
    --expect-slice "reduce-scatter 0" --expect-slice "all-gather 1" --expect-slice sendrecv --expect-slice all_reduce
"$PYTHON" tests/py/check_ring_trace.py "$TRACE" 3 2 1024  # 4096 bytes of float32

echo "== bad flags exit 2 with one line"
expect_error() {  # wanted substring, flags...
    local want=$1
    shift
    local out rc=0
    out=$("$BIN" "$@" 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$out" | grep -c .)" -ne 1 ] || [[ "$out" != *"$want"* ]]; then
        echo "FAIL: collectives $* -> rc $rc: $out"
        exit 1
    fi
    echo "ok: $* -> $out"
}
expect_error "nothing to do"
expect_error "--trace $TEST_TMP: is a directory" --check --trace "$TEST_TMP"  # before the check runs, not after
expect_error "--max-bytes 0: must be between" --bench --max-bytes 0
expect_error "--min-bytes 4096: must not exceed --max-bytes 1024" --bench --min-bytes 4096 --max-bytes 1024
expect_error "--iters: a setting of --bench, which this run does not do" --check --iters 5
expect_error "--seed: a setting of --check, which this run does not do" --bench --seed 5
expect_error "--trace-bytes: a setting of --trace, which this run does not do" --check --trace-bytes 4096
expect_error "whole float32s, multiples of 4 (5, 67108864, 1048576)" --bench --min-bytes 5
expect_error "--iters x: not an integer" --bench --iters x
expect_error "--trace $TEST_TMP/no/such/dir/r.pftrace: directory $TEST_TMP/no/such/dir does not exist" --trace "$TEST_TMP/no/such/dir/r.pftrace"
echo "t_collectives: OK"
