#!/usr/bin/env bash
# Chapter 8: context-parallel attention against the single process on 2, 3 and 4 ranks
# (tests/test_cp_mpi.c: ring and alltoall, zigzag and contiguous, GQA and MHA; out, lse, dQ, dK, dV
# within CP_ATTN_RTOL/ATOL, alltoall bit for bit; transfers per forward and backward counted);
# then the cp transfers in the trace of one training step (tests/py/check_cp_trace.py).
set -eu
source tests/lib.sh
for np in 2 3 4; do
    echo "== test_cp_mpi on $np ranks"
    timeout 120 $MPIRUN -np "$np" "$BUILD/tests/test_cp_mpi" --verbose
done

# The trace of one training step: cp transfers counted per layer and micro-batch against the
# formula, as flows between the cp ranks, overlapping the attention blocks.
trace_check() {  # name, ranks, check flags, train flags...
    local name=$1 np=$2 check=$3; shift 3
    echo "== trace: $name"
    timeout 120 $MPIRUN -np "$np" "$BUILD/train" --model tiny --steps 1 --batch 4 "$@" --trace-json "$T/$name.json" \
        > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
    $PYTHON tests/py/check_cp_trace.py "$T/$name.json" --layers 4 $check
}
trace_check cp2 2 "--cp 2" --cp 2
trace_check cp4_accum 4 "--cp 4 --microbatches 2" --cp 4 --grad-accum-steps 2
trace_check cp2_ac_full 2 "--cp 2 --ac-full" --cp 2 --ac full
trace_check cp2_alltoall 2 "--cp 2 --mode alltoall" --cp 2 --cp-mode alltoall
echo "t_cp: OK"
