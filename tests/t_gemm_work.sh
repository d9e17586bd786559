#!/usr/bin/env bash
# The trainer's timing line counts its step's GEMM work (gemm_gflop_per_step: every matmul and every
# attention tile, 2 M N K each), which `make bench` divides by the sgemm rate for the step's floor.
# Checked against a count made here from the model's shapes, exactly:
#   linear layers: 3 GEMMs of each weight per token (forward, dinp, dweight)
#   flash attention: causal tile pairs of ATTN_Q_TILE x ATTN_KV_TILE (64), the keys of a pair cut back
#     to the last query's position; 2 GEMMs a pair forward (S, PV) and 5 backward (S again, dP, dV,
#     dK, dQ), each 2 x queries x keys x head_dim
#   naive attention: dot-product loops, not GEMMs: none counted
set -euo pipefail
T="$TEST_TMP"
mkdir -p "$T"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# The shapes from the trainer's own table (--model-info's config line), as make bench reads them.
B=1 SEQ=160 STEPS=3
config=$("$BUILD/train" --model small --seq-len $SEQ --model-info 2>&1 | sed -n 's/^config: //p')
[ -n "$config" ] || { echo "FAIL: no config line from --model-info"; exit 1; }
expected() {  # attention kind -> GFLOP a step
    "${PYTHON:-python3}" - "$1" "$config" <<EOF
import json, sys
c = json.loads(sys.argv[2])
dim, layers, heads, kv_heads, ffn, vocab = (c[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"))
hd = dim // heads
tokens = $B * $SEQ
linear = layers * (2 * dim * heads * hd + 2 * dim * kv_heads * hd + 3 * dim * ffn) + dim * vocab
flops = 3 * 2 * tokens * linear
if sys.argv[1] == "flash":
    tile, pairs = 64, 0  # sum over causal tile pairs of queries x keys
    for i0 in range(0, $SEQ, tile):
        i1 = min(i0 + tile, $SEQ)
        for j0 in range(0, i1, tile):
            j1 = min(j0 + tile, i1)  # no key after the tile's last query
            pairs += (i1 - i0) * (j1 - j0)
    flops += (2 + 5) * 2 * hd * pairs * $B * heads * layers
print("%.3f" % (flops / 1e9))
EOF
}
for attention in flash naive; do
    "$BUILD/train" --model small --batch $B --seq-len $SEQ --steps $STEPS --attention $attention >"$T/$attention.log" 2>&1 ||
        { cat "$T/$attention.log"; echo "FAIL: train --attention $attention"; exit 1; }
    got=$(grep '^timing:' "$T/$attention.log" | tr ' ' '\n' | sed -n 's/^gemm_gflop_per_step=//p')
    want=$(expected $attention)
    [ "$got" = "$want" ] || { grep '^timing:' "$T/$attention.log"; echo "FAIL: --attention $attention: gemm_gflop_per_step=$got, counted here $want"; exit 1; }
    echo "ok: --attention $attention: $got GFLOP of GEMMs a step, as counted from the shapes"
done
echo "t_gemm_work: OK"
