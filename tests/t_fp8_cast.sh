#!/usr/bin/env bash
# FP8 casts (chapters/09_fp8/fp8_cast.c) bit-exact against NVIDIA's cuda_fp8.h host conversions:
# every code of both formats decoded, and a dense sample of fp32 patterns encoded (every exponent,
# every kept-bits pattern, tie and sticky tails; see tests/fp8_oracle.cpp). The oracle needs CUDA's
# headers, so it is built where the Makefile finds nvcc; elsewhere this script says SKIP.
set -euo pipefail
BUILD=${BUILD:-build}
oracle="$BUILD/tests/fp8_oracle"
if [ ! -x "$oracle" ]; then
    if command -v nvcc >/dev/null 2>&1; then echo "FAIL: nvcc is here but $oracle was not built (make)"; exit 1; fi
    echo "SKIP: nvcc not found, so no cuda_fp8.h to check the casts against"
    exit 0
fi
"$oracle"
