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
[ "$(sha256sum "$good" | cut -d' ' -f1)" = "$sum_before" ] || { echo "FAIL: checkpoint changed"; failures=$((failures + 1)); }
ls "$T/ck" | grep -q tmp && { echo "FAIL: temporary file left in $T/ck"; failures=$((failures + 1)); }

# --help is generated from the flag table and exits 0
"$TRAIN" --help | grep -q -- "--checkpoint-dir DIR" || { echo "FAIL: --help"; failures=$((failures + 1)); }
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
