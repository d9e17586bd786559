#!/usr/bin/env bash
# The trainer's timeline: decoded with Perfetto's own schema, it has forward and backward slices
# per layer, the optimizer, and memory counters by category; the JSON form is valid too.
set -eu
T="$TEST_TMP"
"$BUILD/train" --model tiny --steps 3 --batch 2 --trace "$T/run.pftrace" --trace-json "$T/run.json" > /dev/null
"$PYTHON" tests/py/trace_check.py "$T/run.pftrace" --json "$T/run.json" \
    --expect-slice "block fwd" --expect-slice "block bwd" --expect-slice "optimizer" --expect-slice "step" \
    --expect-slice "head fwd + loss" --expect-counter "mem params" --expect-counter "mem activations"
