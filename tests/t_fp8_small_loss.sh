#!/usr/bin/env bash
# Chapter 9's training check: `small` for 150 steps of the built-in data at make run's settings, in
# fp32 and with --fp8 under each recipe; each FP8 run's final loss must be within 2% of the fp32
# run's (the bar the chapter sets for a short run). Prints both losses. One of the longest tests of
# make test: on 2 idle cores about 40 s for the fp32 run and a minute per recipe (the emulation adds
# two passes over every GEMM operand).
#   BUILD=build TEST_TMP=DIR bash tests/t_fp8_small_loss.sh [RECIPE...]   (default: all three)
set -euo pipefail
BUILD=${BUILD:-build}
OUT=${TEST_TMP:-$(mktemp -d "${TMPDIR:-/tmp}/fp8-small.XXXXXX")}
recipes=("${@:-tensorwise rowwise delayed}")
read -r -a recipes <<<"${recipes[*]}"
flags=(--model small --steps 150 --batch 4 --seq-len 128 --lr 1e-3 --log-every 10)
final_loss() { grep '^step   150 ' "$1" | sed 's/.*| loss \([0-9.]*\) .*/\1/'; }
"$BUILD/train" "${flags[@]}" > "$OUT/fp32.log"
ref=$(final_loss "$OUT/fp32.log")
[ -n "$ref" ] || { echo "FAIL: the fp32 run printed no step 150"; exit 1; }
failed=0
for r in "${recipes[@]}"; do
    "$BUILD/train" "${flags[@]}" --fp8 --fp8-recipe "$r" > "$OUT/$r.log"
    got=$(final_loss "$OUT/$r.log")
    if [ -n "$got" ] && awk -v a="$got" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.02 * b) }'; then
        echo "ok: --fp8-recipe $r: final loss $got, fp32 $ref (within 2%)"
    else
        echo "FAIL: --fp8-recipe $r: final loss ${got:-none}, fp32 $ref (more than 2% apart)"; failed=1
    fi
done
exit $failed
