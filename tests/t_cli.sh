#!/usr/bin/env bash
# Bad input: every case exits with status 2 and prints exactly one line naming the problem, and a
# failed run overwrites nothing.
set -u
TRAIN="$BUILD/train"
T="$TEST_TMP"
failures=0
expect_error() {  # expected-substring, args...
    local want=$1; shift
    local err rc
    err=$("$TRAIN" "$@" 2>&1 >/dev/null); rc=$?
    local lines; lines=$(printf '%s\n' "$err" | grep -c .)
    if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || [[ "$err" != *"$want"* ]]; then
        echo "FAIL: train $* -> exit $rc, $lines line(s): $err (wanted exit 2, one line with '$want')"
        failures=$((failures + 1))
    else
        echo "ok: train $* -> $err"
    fi
}
expect_error "unknown flag" --no-such-flag
expect_error "--steps abc: not an integer" --steps abc
expect_error "--steps 0: must be at least 1" --steps 0
expect_error "--seq-len 0: must be at least 1" --seq-len 0
expect_error "--batch -3: must be at least 1" --batch -3
expect_error "--lr nan: not a finite number" --lr nan
expect_error "--model gpt5: must be one of" --model gpt5
expect_error "--attention" --attention slow
expect_error "--steps: needs a value" --steps
expect_error "unexpected argument" stray
expect_error "--warmup-steps 30: must not exceed --steps 20" --warmup-steps 30
expect_error "needs --checkpoint-dir" --checkpoint-every 5
expect_error "markov" --data "markov:order=0"
expect_error "nofile.txt" --data text:"$T/nofile.txt"
expect_error "does not exist" --trace "$T/no/such/dir/x.pftrace"
expect_error "--resume $T/missing.safetensors" --resume "$T/missing.safetensors"
expect_error "--bucket-mb 0: must be between" --bucket-mb 0
expect_error "--bucket-mb x: not a finite number" --bucket-mb x
expect_error "--grad-accum-steps 0: must be at least 1" --grad-accum-steps 0
# Refused rather than silently resolved: a flag given twice (the last one used to win), blanks
# around a number (' 2' used to pass while '2 ' failed), a data option given twice.
expect_error "--steps: given twice" --steps 2 --steps 3
expect_error "--lr: given twice" --lr 1e-3 --lr=2e-3
expect_error "--steps ' 2': blanks around the number" --steps ' 2'
expect_error "--steps '2 ': blanks around the number" --steps '2 '
expect_error "--lr ' 1e-3': blanks around the number" --lr ' 1e-3'
expect_error "option 'order' is given twice" --data markov:order=1,order=2

# A checkpoint that is truncated, or from another run, is refused; the good one is not touched.
"$TRAIN" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/ck" >/dev/null || { echo "FAIL: training run"; exit 1; }
good="$T/ck/step_000002.safetensors"
sum_before=$(sha256sum "$good" | cut -d' ' -f1)
head -c 5000 "$good" > "$T/truncated.safetensors"
expect_error "truncated.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/truncated.safetensors"
printf 'garbage that is not a safetensors file at all' > "$T/garbage.safetensors"
expect_error "garbage.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/garbage.safetensors"
expect_error "--seed" --model tiny --steps 2 --batch 2 --seed 7 --resume "$good"
expect_error "--batch" --model tiny --steps 2 --batch 4 --resume "$good"
expect_error "different shape" --model small --steps 2 --batch 2 --resume "$good"
expect_error "no step_" --model tiny --steps 2 --batch 2 --resume "$T"
expect_error "truncated.safetensors" --compare "$T/truncated.safetensors"
# a shape mismatch names the first config field that differs
expect_error "first difference, this run vs the checkpoint: n_layers 2 vs 4" --model tiny --n-layers 2 --steps 2 \
    --batch 2 --resume "$good"
# a step that overflows long long, or lies beyond the run's total steps, is refused before any work
with_step() {  # step, output: a copy of the good checkpoint whose metadata says `step`
    "${PYTHON:-python3}" - "$good" "$1" "$2" <<'PY'
import json, struct, sys
src, step, out = sys.argv[1:]
data = open(src, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
header["__metadata__"]["step"] = step
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(out, "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
PY
}
with_step 99999999999999999999 "$T/huge_step.safetensors"
expect_error 'bad step "99999999999999999999"' --model tiny --steps 2 --batch 2 --resume "$T/huge_step.safetensors"
with_step 3 "$T/step3.safetensors"
expect_error 'bad step "3"' --model tiny --steps 2 --batch 2 --resume "$T/step3.safetensors"
[ "$(sha256sum "$good" | cut -d' ' -f1)" = "$sum_before" ] || { echo "FAIL: checkpoint changed"; failures=$((failures + 1)); }
ls "$T/ck" | grep -q tmp && { echo "FAIL: temporary file left in $T/ck"; failures=$((failures + 1)); }

# --help is generated from the flag table and exits 0
"$TRAIN" --help | grep -q -- "--checkpoint-dir DIR" || { echo "FAIL: --help"; failures=$((failures + 1)); }
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
