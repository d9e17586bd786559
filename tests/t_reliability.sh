#!/usr/bin/env bash
# Faults and checkpoint hygiene (README: "What is promised, and how it is tested"):
#   - a rank stopped with SIGSTOP ends the job after the comm timeout, and the line names it;
#   - the default comm timeout follows the measured steps (max(60 s, 10 x the slowest step));
#   - temporaries of dead checkpoint writers are removed when the directory is opened, nothing else;
#   - a state that is not finite is never checkpointed: the run stops, the last good one stays;
#   - bad input that only one rank sees (a NaN weight in the slice it reads) is still printed.
# Bad input (exit 2, one line, before any work) is tests/t_cli.sh's.
set -eu
source tests/lib.sh

fail() {
    echo "FAIL: $*"
    exit 1
}

echo "== a rank stopped with SIGSTOP: the others time out and name it"
# Unique flags find this run's processes; rank 1 is the one whose environment says so.
$MPIRUN -np 2 "$BUILD/train" --model tiny --batch 4 --steps 1000000 --dp-replicate 2 --comm-timeout 10 \
    --checkpoint-dir "$T/hung" > "$T/hung.log" 2>&1 &
mpirun_pid=$!
victim=""
for _ in $(seq 1 600); do  # up to 60 s for the ranks to start and reach step 3
    if grep -q "^step     3" "$T/hung.log"; then
        for pid in $(pgrep -f -- "--checkpoint-dir $T/hung" || true); do
            [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = train ] \
                && tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && victim=$pid
        done
        break
    fi
    sleep 0.1
done
[ -n "$victim" ] || { kill "$mpirun_pid"; cat "$T/hung.log"; fail "rank 1 of the hung run not found"; }
kill -STOP "$victim"
status=0
for _ in $(seq 1 600); do  # the job must end on its own, long before 60 s
    kill -0 "$mpirun_pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$mpirun_pid" 2>/dev/null; then
    kill -KILL "$victim" "$mpirun_pid" 2>/dev/null || true
    fail "the job with a stopped rank still runs after 60 s"
fi
wait "$mpirun_pid" || status=$?
kill -KILL "$victim" 2>/dev/null || true  # if the launcher left it behind
[ "$status" -ne 0 ] || fail "the job with a stopped rank exited 0"
grep -Eq "^comm: .* did not finish after 10 s on world rank 0; did not arrive: world rank 1 \(no answer: stopped or dead\)$" \
    "$T/hung.log" || { cat "$T/hung.log"; fail "no line names the stopped rank"; }
echo "ok: $(grep '^comm:' "$T/hung.log" | head -1)"

echo "== the default comm timeout follows the measured steps; --comm-timeout fixes it"
"$BUILD/train" --model tiny --batch 2 --steps 8 > "$T/adaptive.log" 2>&1
grep -Eq "^comm timeout: [0-9]+ s = max\(60 s, 10 x the slowest step \([0-9.]+ s\)\)$" "$T/adaptive.log" \
    || { cat "$T/adaptive.log"; fail "no comm timeout line"; }
# and its number is the formula's: N = max(60, 10 X), to the second it is printed in
sed -nE 's/^comm timeout: ([0-9]+) s = max\(60 s, 10 x the slowest step \(([0-9.]+) s\)\)$/\1 \2/p' "$T/adaptive.log" |
    awk '{ want = 10 * $2 > 60 ? 10 * $2 : 60; d = $1 - want; exit !(NR == 1 && d <= 0.5 && d >= -0.5) }' ||
    fail "the comm timeout is not max(60 s, 10 x the slowest step): $(grep '^comm timeout' "$T/adaptive.log")"
# tiny's steps are far under 6 s: the timeout stays at the 60 s floor, and the line is not repeated
[ "$(grep -c '^comm timeout' "$T/adaptive.log")" = 1 ] ||
    fail "the comm timeout line repeats while its value stays: $(grep -c '^comm timeout' "$T/adaptive.log") lines"
echo "ok: $(grep '^comm timeout' "$T/adaptive.log")"
"$BUILD/train" --model tiny --batch 2 --steps 4 --comm-timeout 30 > "$T/fixed.log" 2>&1
! grep -q "^comm timeout" "$T/fixed.log" || fail "--comm-timeout 30 was changed"

echo "== stale temporaries of dead checkpoint writers are removed, nothing else"
sh -c 'exit 0' &
dead=$!
wait "$dead"
mkdir -p "$T/stale"
stale="$T/stale/step_000001.safetensors.tmp.$dead"
live="$T/stale/step_000001.safetensors.tmp.$$"  # this shell's pid: a writer that is alive
other="$T/stale/notes.tmp.$dead"                # not a checkpoint temporary
fp8_stale="$T/stale/step_000001.safetensors.fp8.tmp.$dead"  # delayed FP8's companion, half-written
touch "$stale" "$live" "$other" "$fp8_stale"
"$BUILD/train" --model tiny --batch 2 --steps 1 --checkpoint-dir "$T/stale" > "$T/stale.log" 2>&1
[ ! -e "$stale" ] || fail "$stale was not removed"
[ ! -e "$fp8_stale" ] || fail "$fp8_stale was not removed"
[ -e "$live" ] && [ -e "$other" ] || fail "a file that is not stale was removed"
grep -q "^removed $stale, left by a writer that is gone" "$T/stale.log" || fail "no log line for the removal"
touch "$stale"  # --resume DIR opens the directory too
"$BUILD/train" --model tiny --batch 2 --steps 1 --resume "$T/stale" > "$T/stale_resume.log" 2>&1
[ ! -e "$stale" ] || fail "--resume DIR left $stale"
echo "ok: $stale removed (by --checkpoint-dir and by --resume DIR); the live writer's and notes.tmp kept"

echo "== a non-finite state is never checkpointed"
# lr 10 without clipping: AdamW's v overflows to inf in float32 within a few steps
status=0
"$BUILD/train" --model tiny --batch 2 --steps 40 --lr 10 --warmup-steps 0 --lr-decay constant --grad-clip 0 \
    --checkpoint-dir "$T/nan" --checkpoint-every 1 > "$T/nan.log" 2>&1 || status=$?
[ "$status" -eq 1 ] || { cat "$T/nan.log"; fail "diverging run: exit status $status, wanted 1"; }
line=$(grep "is not written, the last checkpoint written stays the latest" "$T/nan.log") \
    || { cat "$T/nan.log"; fail "no line says the checkpoint was not written"; }
bad_step=$(sed -n 's/^train: step \([0-9]*\): .*/\1/p' <<<"$line")
latest=$(ls "$T/nan" | sort | tail -1)
[ "$latest" = "$(printf 'step_%06d.safetensors' $((bad_step - 1)))" ] || fail "latest checkpoint $latest, step $bad_step failed"
! ls "$T/nan" | grep -q tmp || fail "a temporary was left in $T/nan"
"$PYTHON" - "$T/nan/$latest" <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file
bad = [name for name, x in load_file(sys.argv[1]).items() if not np.isfinite(x).all()]
sys.exit(f"{sys.argv[1]}: not finite: {bad}" if bad else 0)
PY
echo "ok: $line"
echo "ok: $latest, the latest, is finite everywhere"
echo "== a NaN weight that only rank 1 reads is reported by rank 1"
# --tp 2: rank 1 reads the second half of gate_proj's rows, so only it finds the NaN in the last
# element. fatal_input's "rank 0 says it" would end the job with status 2 and no message.
"$BUILD/train" --model tiny --batch 2 --steps 1 --export-hf "$T/hf_ok" > "$T/hf_export.log" 2>&1 \
    || { cat "$T/hf_export.log"; fail "--export-hf failed"; }
"$PYTHON" - "$T/hf_ok" "$T/hf_nan" <<'PY'
import shutil, sys
from safetensors.numpy import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst)
tensors = load_file(f"{src}/model.safetensors")
w = tensors["model.layers.0.mlp.gate_proj.weight"].copy()
w[-1, -1] = float("nan")
tensors["model.layers.0.mlp.gate_proj.weight"] = w
save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
PY
status=0
timeout 120 $MPIRUN -np 2 "$BUILD/train" --init-from "hf:$T/hf_nan" --tp 2 --batch 2 --steps 1 > "$T/hf_nan.log" 2>&1 || status=$?
[ "$status" -eq 2 ] || { cat "$T/hf_nan.log"; fail "NaN weight on rank 1: exit status $status, wanted 2"; }
grep -Eq "^train \[rank 1\]: $T/hf_nan/model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' holds NaN at element [0-9]+ \(not a finite weight\)$" \
    "$T/hf_nan.log" || { cat "$T/hf_nan.log"; fail "no line names the NaN weight rank 1 found"; }
echo "ok: $(grep 'not a finite weight' "$T/hf_nan.log")"
echo "t_reliability: OK"
