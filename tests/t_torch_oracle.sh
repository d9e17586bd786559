#!/usr/bin/env bash
# End-to-end: the C trainer (float64 and float32 builds) writes a dump of a 10-step run of the tiny
# model; the PyTorch oracle rebuilds everything and compares (logits, loss, every gradient, every
# step's loss and grad norm, final parameters). Also runs the oracle's own self-test.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:-$(mktemp -d)}
ORACLE=tests/py/torch_oracle.py
RUN="--model tiny --steps 10 --batch 4 --seq-len 32 --seed 1"

status=0
echo "== oracle self-test (no C trainer)"
"$PYTHON" "$ORACLE" --self-test --tmp "$TEST_TMP/selftest" || status=1

for prog in train64 train; do
    dump="$TEST_TMP/$prog.safetensors"
    echo "== $BUILD/$prog $RUN --dump $dump"
    "$BUILD/$prog" $RUN --dump "$dump" >"$TEST_TMP/$prog.log" 2>&1 \
        || { cat "$TEST_TMP/$prog.log"; echo "$prog failed"; status=1; continue; }
    tail -3 "$TEST_TMP/$prog.log"
    echo "== $ORACLE $dump"
    "$PYTHON" "$ORACLE" "$dump" || status=1
done
# Ignored targets (IGNORE_INDEX), which the trainer's data never holds: a one-step dump written by
# torch in float64 (tests/py/torch_dump.py), replayed by --compare: the float64 build to 1e-10
# (measured: equal to the last bits), the float one at its default tolerance. A mean over every
# target instead of the kept ones passed every other test.
for ignore in some row all; do
    dump="$TEST_TMP/torch_ignore_$ignore.safetensors"
    "$PYTHON" tests/py/torch_dump.py "$dump" --ignore "$ignore" || { status=1; continue; }
    "$BUILD/train64" --compare "$dump" --compare-rtol 1e-10 > "$TEST_TMP/compare64_$ignore.log" &&
        "$BUILD/train" --compare "$dump" > "$TEST_TMP/compare32_$ignore.log" ||
        { cat "$TEST_TMP"/compare*_"$ignore".log | grep -v " ok$"; echo "FAIL: --compare of torch's dump, --ignore $ignore"; status=1; }
done
# AdamW with betas near 1, where 1 - beta rounded from a float beta is 0 (v frozen at 0, the step
# lr * m / eps: the float build's loss went to 1.6e5 at step 2) or off by a large factor; torch
# computes 1 - beta in double.
for betas in "--beta2 0.99999999" "--beta1 0.999999 --beta2 0.9999999"; do
    dump="$TEST_TMP/betas.safetensors"
    echo "== $BUILD/train $RUN $betas"
    # shellcheck disable=SC2086
    "$BUILD/train" $RUN $betas --dump "$dump" >"$TEST_TMP/betas.log" 2>&1 \
        || { cat "$TEST_TMP/betas.log"; echo "train $betas failed"; status=1; continue; }
    "$PYTHON" "$ORACLE" "$dump" --quiet || status=1
done
[ "$status" -eq 0 ] && echo "t_torch_oracle: PASS" || echo "t_torch_oracle: FAIL"
exit "$status"
