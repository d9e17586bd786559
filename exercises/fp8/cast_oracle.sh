#!/usr/bin/env bash
# Lab fp8's check against NVIDIA's cuda_fp8.h: tests/fp8_oracle.cpp linked with your fp8_cast.c (as
# the grader compiled it, $BUILD/../obj/fp8_cast.o) and the project's $LIBCOMMON, then run: every
# code decoded and a dense sample of fp32 values encoded, bit for bit. cuda_fp8.h's conversions are host code, so this needs CUDA's
# headers but no GPU. Without nvcc it says SKIP and passes; build/tests/test_fp8_cast (the cast
# against its definition) checks the same rounding on every machine.
set -eu -o pipefail
nvcc=$(command -v nvcc || true)
if [ -z "$nvcc" ]; then echo "SKIP: nvcc not found, so no cuda_fp8.h to check the casts against"; exit 0; fi
cuda=$(cd "$(dirname "$nvcc")/.." && pwd)
${CXX:-c++} -O2 -std=c++17 -I. -I"$cuda/include" tests/fp8_oracle.cpp "$BUILD/../obj/fp8_cast.o" "$LIBCOMMON" -o "$TEST_TMP/fp8_oracle"
"$TEST_TMP/fp8_oracle"
