#!/usr/bin/env bash
# Chapter 8: context-parallel attention (build/cp_attention --check) against single-process
# attention on the whole sequence: out, lse, dQ, dK, dV within CP_ATTENTION_RTOL (tests/tolerances.h)
# and the transfer counts against the formula, at 1 (bit-identical), 2, 3 and 4 ranks; ring and
# all-to-all, zigzag and contiguous splits, GQA and MHA. Then bad layouts: exit 2 with one line.
set -eu
source tests/lib.sh
check() {  # ranks, flags...
    local np=$1; shift
    out=$($MPIRUN -np "$np" "$BUILD/cp_attention" --check "$@" 2>&1) || { echo "$out"; echo "FAIL: -np $np $*"; exit 1; }
    grep '^PASS' <<<"$out"
}
for np in 1 2 3 4; do
    check "$np" --seq-len 48 --heads 4 --kv-heads 2                        # ring, zigzag, GQA
    check "$np" --seq-len 48 --heads 4 --kv-heads 4 --cp-load-balance off   # ring, contiguous, MHA
done
check 2 --seq-len 48 --heads 8 --kv-heads 4 --cp-mode alltoall
check 3 --seq-len 48 --heads 6 --kv-heads 3 --cp-mode alltoall --cp-load-balance off
check 4 --seq-len 48 --heads 8 --kv-heads 4 --cp-mode alltoall
check 4 --seq-len 48 --heads 4 --kv-heads 4 --cp-mode alltoall --batch 3
expect_cp_error() {  # ranks, wanted, flags...
    local np=$1 want=$2; shift 2
    out=$($MPIRUN -np "$np" "$BUILD/cp_attention" "$@" 2>&1 >/dev/null) && rc=0 || rc=$?
    ours=$(grep '^cp_attention' <<<"$out" || true)
    # every rank may print it: one distinct line
    [ "$rc" -eq 2 ] && [ "$(sort -u <<<"$ours" | grep -c .)" -eq 1 ] && [[ "$ours" == *"$want"* ]] ||
        { echo "FAIL: -np $np $* -> rc $rc: $out"; exit 1; }
    echo "ok: -np $np $* -> $(head -1 <<<"$ours")"
}
# in this program's terms: its flags and its rank count (it has no --cp and no tensor parallelism)
expect_cp_error 4 "--seq-len 44 on 4 ranks: must divide by 2 x 4 (zigzag" --seq-len 44
expect_cp_error 4 "--seq-len 42 on 4 ranks: must divide by 4 (contiguous" --seq-len 42 --cp-load-balance off
expect_cp_error 4 "--cp-mode alltoall on 4 ranks: --heads 4 and --kv-heads 2 must divide by the ranks" \
    --cp-mode alltoall --heads 4 --kv-heads 2
# an output path that is a directory is refused before any work
mkdir -p "$TEST_TMP/trace_dir"
expect_cp_error 1 "--trace $TEST_TMP/trace_dir: is a directory; give a file name" --check --trace "$TEST_TMP/trace_dir"
# what cannot fit in memory is refused before any work (it ran out of memory with exit 1)
expect_cp_error 1 "needs at least" --seq-len 1048576 --batch 1024 --heads 1024 --kv-heads 1024 --head-dim 1024
