#!/usr/bin/env bash
# FP8 across ranks: tests/test_fp8_groups under mpirun on 2 and 4 ranks (one linear split by tokens,
# by output features and by input features equals the single-process FP8 linear, for every recipe,
# because the amaxes are reduced over the right groups).
set -euo pipefail
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
export OMP_NUM_THREADS=1
for n in 2 4; do
    out=$(timeout 120 $MPIRUN -np "$n" "$BUILD/tests/test_fp8_groups" 2>&1) || { echo "FAIL: $n ranks:"; echo "$out" | tail -20; exit 1; }
    grep -q "^test_fp8_groups: $n ranks: all checks passed" <<<"$out" || { echo "FAIL: $n ranks: $out"; exit 1; }
    echo "ok: $(grep '^test_fp8_groups:' <<<"$out")"
done
