#!/usr/bin/env bash
# ZeRO-3's bf16 weight all-gather (--all-gather-dtype bf16: chapter 3's fsdp_bf16_codec, torchtitan's
# mixed-precision policy of bf16 parameters and fp32 gradient reduction), checked exactly:
#   CPU: what the bf16 all-gather changes is the weights the forward and backward see, rounded to
#     bf16 (the master weights, gradients and AdamW stay fp32). So 2 ranks gathering weights W in
#     bf16 must give the step-1 losses and gradients of 2 ranks gathering bf16(W) in fp32, bit for
#     bit: the same ZeRO-3 arithmetic on the same numbers. (W: a trained tiny model exported with
#     --export-hf; bf16(W): the same file rounded to nearest even by numpy, loaded with --init-from.)
#   GPU (the emulator): the GPU model casts every gathered unit to bf16 before it computes, and
#     bf16(widen(bf16(w))) == bf16(w), so ZeRO-3 with the bf16 all-gather equals the fp32 all-gather
#     exactly, losses and gradients over 2 steps (auto picks bf16 on the GPU: the log says which).
#   Both: half the bytes on the wire, from the comm layer's own byte count on its trace slices.
#   Refusals: bf16 without ZeRO-3's all-gather, and with --fp8-all-gather.
# Mutations tried (each failed a check here): the encode rounding by truncation instead of to
# nearest even (the CPU oracle, max_rel 4e-3); decode writing rank 0's shard for every rank (both);
# the codec dropped in gpu/strategy.c (the GPU byte count: the numbers themselves cannot tell).
set -eu
source tests/lib.sh
common=(--model tiny --steps 2 --batch 2 --seq-len 16 --seed 5 --lr 1e-3)

echo "== CPU: bf16 all-gather of W == fp32 all-gather of bf16(W)"
"$BUILD/train" --model tiny --steps 3 --batch 2 --seq-len 16 --seed 9 --export-hf "$T/w" > "$T/export.log" 2>&1 ||
    { cat "$T/export.log"; echo "FAIL: export"; exit 1; }
"$PYTHON" - "$T/w" "$T/w_bf16" <<'PY'
import shutil, sys
import numpy as np
sys.path.insert(0, "tests/py")
import safetensors_io
src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst)
tensors, meta = safetensors_io.load(f"{src}/model.safetensors")
def bf16(x):  # round to nearest even, kept as float32
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)
rounded = {k: bf16(v) for k, v in tensors.items()}
changed = sum(int((rounded[k] != tensors[k]).sum()) for k in tensors)
assert changed > 0, "no weight changed by the rounding: the check below would prove nothing"
safetensors_io.save(f"{dst}/model.safetensors", rounded, meta)
print(f"ok: bf16(W) written ({changed} weights changed by the rounding)")
PY
cpu_run() {  # name, init dir, dtype
    $MPIRUN -np 2 "$BUILD/train" --init-from "hf:$2" --steps 1 --batch 2 --seq-len 16 --seed 5 --lr 1e-3 \
        --dp-shard 2 --all-gather-dtype "$3" --grad-dump "$T/$1.grads.safetensors" > "$T/$1.log" 2>&1 ||
        { cat "$T/$1.log"; echo "FAIL: run $1"; exit 1; }
}
cpu_run cpu_bf16 "$T/w" bf16
cpu_run cpu_f32_rounded "$T/w_bf16" fp32
cpu_run cpu_f32 "$T/w" fp32
grep -q "weights all-gathered in bf16" "$T/cpu_bf16.log" || { echo "FAIL: cpu_bf16 did not gather in bf16"; exit 1; }
$P --log "$T/cpu_bf16.log" --log-ref "$T/cpu_f32_rounded.log" --ckpt "$T/cpu_bf16.grads.safetensors" \
    --ckpt-ref "$T/cpu_f32_rounded.grads.safetensors" --prefix grad. --exact
# And it is a change: the fp32 all-gather of W itself differs (else the check above proves nothing).
if $P --ckpt "$T/cpu_bf16.grads.safetensors" --ckpt-ref "$T/cpu_f32.grads.safetensors" --prefix grad. --exact \
    > "$T/differs.txt"; then
    echo "FAIL: the bf16 all-gather left the gradients bit-identical to the fp32 one"; exit 1
fi
echo "ok: the fp32 all-gather of W gives other gradients"

# The bytes on the wire, from the all_gather slices the comm layer traces (args.bytes; on host and
# device buffers alike), in order per rank, in runs without --grad-dump (whose gradient gathers are
# fp32 either way): each bf16 all-gather must move exactly half of its fp32 counterpart.
half_bytes() {  # bf16.json fp32.json
    "$PYTHON" - "$1" "$2" <<'PY'
import sys
from collections import defaultdict
sys.path.insert(0, "traces")
from trace_summary import load_chrome_events
def gathers(path):
    per_rank = defaultdict(list)
    events = [e for e in load_chrome_events(path) if e.get("name") == "all_gather" and "bytes" in e.get("args", {})]
    for e in sorted(events, key=lambda e: e["ts"]):
        per_rank[e["pid"]].append(e["args"]["bytes"])
    return per_rank
bf16, f32 = gathers(sys.argv[1]), gathers(sys.argv[2])
if not f32 or sorted(bf16) != sorted(f32):
    sys.exit(f"FAIL: all-gather slices on ranks {sorted(bf16)} (bf16) vs {sorted(f32)} (fp32)")
for rank in f32:
    a, b = bf16[rank], f32[rank]
    if len(a) != len(b) or any(2 * x != y for x, y in zip(a, b)):
        sys.exit(f"FAIL: rank {rank}: bf16 all-gathers {a} bytes, fp32 {b}: want each exactly half")
print(f"ok: {len(b)} all-gathers per rank, {sum(a)} bytes in bf16 against {sum(b)} in fp32 (rank {rank})")
PY
}
traced() {  # program, dtype, json, flags...
    local program=$1 dtype=$2 json=$3; shift 3
    $MPIRUN -np 2 "$program" --init-from "hf:$T/w" --steps 1 --batch 2 --seq-len 16 --dp-shard 2 \
        --all-gather-dtype "$dtype" --trace-json "$json" "$@" > "$json.log" 2>&1 ||
        { cat "$json.log"; echo "FAIL: traced run $json"; exit 1; }
}
traced "$BUILD/train" bf16 "$T/bf16.json"
traced "$BUILD/train" fp32 "$T/fp32.json"
half_bytes "$T/bf16.json" "$T/fp32.json"

echo "== refusals"
expect_error 2 "--all-gather-dtype bf16: casts ZeRO-3's weight all-gather" --dp-replicate 2 --all-gather-dtype bf16
expect_error 2 "--all-gather-dtype bf16: casts ZeRO-3's weight all-gather" --dp-shard 2 --zero-stage 2 --all-gather-dtype bf16
expect_error 2 "--all-gather-dtype bf16: not with --fp8-all-gather" --dp-shard 2 --fp8 --fp8-all-gather --all-gather-dtype bf16

EMU_TRAIN="$BUILD/tests/emu/train"
if [ ! -x "$EMU_TRAIN" ]; then
    if command -v "${CXX:-g++}" >/dev/null 2>&1; then echo "FAIL: $EMU_TRAIN missing (make)"; exit 1; fi
    echo "SKIP (GPU part): no C++ compiler, so no emulated GPU trainer"; exit 0
fi
echo "== GPU (emulated): ZeRO-3 with the bf16 all-gather == with the fp32 one, exactly"
gpu_run() {  # name, dtype
    $MPIRUN -np 2 "$EMU_TRAIN" "${common[@]}" --device cuda --dp-shard 2 --zero-stage 3 --all-gather-dtype "$2" \
        --grad-dump "$T/$1.grads.safetensors" > "$T/$1.log" 2>&1 || { cat "$T/$1.log"; echo "FAIL: run $1"; exit 1; }
}
gpu_run gpu_auto auto
gpu_run gpu_f32 fp32
grep -q "weights all-gathered in bf16" "$T/gpu_auto.log" || { echo "FAIL: auto did not gather in bf16 on the GPU"; exit 1; }
grep -q "fp32 weights gathered" "$T/gpu_f32.log" || { echo "FAIL: fp32 was not fp32 on the GPU"; exit 1; }
$P --log "$T/gpu_auto.log" --log-ref "$T/gpu_f32.log" --ckpt "$T/gpu_auto.grads.safetensors" \
    --ckpt-ref "$T/gpu_f32.grads.safetensors" --prefix grad. --exact
traced "$EMU_TRAIN" auto "$T/gpu_bf16.json" --device cuda
traced "$EMU_TRAIN" fp32 "$T/gpu_fp32.json" --device cuda
half_bytes "$T/gpu_bf16.json" "$T/gpu_fp32.json"
echo "t_all_gather_bf16: PASS"
