#!/usr/bin/env bash
# Chapter 8: context-parallel attention against the single process on 2, 3 and 4 ranks
# (tests/test_cp_mpi.c: ring and alltoall, zigzag and contiguous, GQA and MHA; out, lse, dQ, dK, dV
# within CP_ATTN_RTOL/ATOL, alltoall bit for bit; transfers per forward and backward counted).
set -eu
source tests/lib.sh
for np in 2 3 4; do
    echo "== test_cp_mpi on $np ranks"
    timeout 120 $MPIRUN -np "$np" "$BUILD/tests/test_cp_mpi" --verbose
done
echo "t_cp: OK"
