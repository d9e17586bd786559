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
# A NaN anywhere fails, with its index: not only in a tensor's last element (a NaN worst was
# replaced by the next element's finite difference, and the dump compared clean). Also an inf.
"$PYTHON" - "$T/d32.safetensors" "$T/nan.safetensors" "$T/zero.safetensors" <<'PY'
import sys
import numpy as np
sys.path.insert(0, "tests/py")
import safetensors_io as st
tensors, meta = st.load(sys.argv[1])
tensors["logits"].flat[0] = np.nan
tensors["grad.layers.0.attention.wq.weight"].flat[5] = np.inf
st.save(sys.argv[2], tensors, meta)
# no steps at all: (0, B, T) inputs and targets, an empty loss
tensors["inputs"] = tensors["inputs"][:0].copy()
tensors["targets"] = tensors["targets"][:0].copy()
tensors["loss"] = tensors["loss"][:0].copy()
st.save(sys.argv[3], tensors, meta)
PY
if "$BUILD/train" --compare "$T/nan.safetensors" > "$T/nan.log"; then cat "$T/nan.log"; echo "FAIL: a dump with a NaN passed"; exit 1; fi
grep -E "^  logits .*worst \[0\].*MISMATCH" "$T/nan.log" > /dev/null &&
    grep -E "grad.layers.0.attention.wq.weight .*worst \[5\].*MISMATCH" "$T/nan.log" > /dev/null ||
    { cat "$T/nan.log"; echo "FAIL: the NaN and the inf not reported at their index"; exit 1; }
echo "ok: a NaN (logits[0]) and an inf (a gradient's element 5) fail, at their index"
set +e
"$BUILD/train" --compare "$T/zero.safetensors" > "$T/zero.log" 2>&1
rc=$?
set -e
[ "$rc" = 2 ] && [ "$(wc -l < "$T/zero.log")" = 1 ] && grep -q "at least one step" "$T/zero.log" ||
    { cat "$T/zero.log"; echo "FAIL: a dump of no steps: exit $rc, want 2 and one line"; exit 1; }
echo "ok: a dump of no steps is refused: $(cat "$T/zero.log")"
# A dump's model config is checked as the trainer checks its flags, before anything is allocated: a
# norm_eps of -1 ran (every value NaN), 1e6 layers ran out of memory (exit 1), 2.5 heads became 2.
"$PYTHON" - "$T/d32.safetensors" "$T" <<'PY'
import json, sys
sys.path.insert(0, "tests/py")
import safetensors_io as st
tensors, meta = st.load(sys.argv[1])
for name, field, value in [("eps", "norm_eps", -1), ("layers", "n_layers", 1000000), ("heads", "n_heads", 2.5)]:
    config = json.loads(meta["config"])
    config[field] = value
    st.save(f"{sys.argv[2]}/cfg_{name}.safetensors", tensors, dict(meta, config=json.dumps(config)))
PY
for case in "eps|norm_eps -1 must be positive" "layers|needs at least" "heads|\"n_heads\" = 2.5 is not a whole number"; do
    name=${case%%|*} want=${case#*|}
    set +e
    "$BUILD/train" --compare "$T/cfg_$name.safetensors" > "$T/cfg_$name.log" 2>&1
    rc=$?
    set -e
    [ "$rc" = 2 ] && [ "$(wc -l < "$T/cfg_$name.log")" = 1 ] && grep -qF -- "$want" "$T/cfg_$name.log" ||
        { cat "$T/cfg_$name.log"; echo "FAIL: a dump with a bad $name: exit $rc, want 2 and one line with '$want'"; exit 1; }
    echo "ok: $(cat "$T/cfg_$name.log")"
done
