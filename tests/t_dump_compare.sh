#!/usr/bin/env bash
# --dump / --compare: our own dump compares clean; the float64 build's dump compares clean against
# the fp32 reference at the fp32 tolerance; a dump with one perturbed gradient is caught.
set -eu
T="$TEST_TMP"
"$BUILD/train" --model tiny --steps 2 --batch 2 --dump "$T/d32.safetensors" > /dev/null
"$BUILD/train64" --model tiny --steps 2 --batch 2 --dump "$T/d64.safetensors" > /dev/null
# The run that wrote it, again: every tensor bit-identical (deterministic), the loss within 1e-7 (the
# dump holds it in fp32, the run computes it in double: measured 1.3e-8). A 1e-7 bound, not the
# default 1e-4: a comparator that reported a clean run as differing, or let a drift through, fails.
"$BUILD/train" --compare "$T/d32.safetensors" --compare-rtol 1e-7 > "$T/c32.log"
grep -q "all tensors within tolerance" "$T/c32.log"
"$BUILD/train" --compare "$T/d64.safetensors" > "$T/c64.log"
grep -q "all tensors within tolerance" "$T/c64.log"
echo "ok: fp32 reference vs float64 dump: $(sort -k5 -g "$T/c64.log" | grep max_rel | awk '{print $5}' | sort -g | tail -1) max rel"
"$PYTHON" - "$T/d32.safetensors" "$T/bad.safetensors" <<'PY'
import sys
sys.path.insert(0, "tests/py")
import safetensors_io as st
tensors, meta = st.load(sys.argv[1])
g = tensors["grad.layers.1.attention.wk.weight"]
g[3, 5] += 1e-2 * abs(g).max()
st.save(sys.argv[2], tensors, meta)
PY
if "$BUILD/train" --compare "$T/bad.safetensors" > "$T/bad.log"; then echo "FAIL: perturbed dump passed"; exit 1; fi
grep "MISMATCH" "$T/bad.log" | grep -q "grad.layers.1.attention.wk.weight"
grep "layers.1.attention.wk" "$T/bad.log" | grep -q "worst \[197\]"  # (3, 5) in a (32, 64) tensor
echo "ok: a 1% perturbation of one gradient element is reported with its index"
