#!/usr/bin/env bash
# Chapter 9: the FP8 all-gather under ZeRO-3 (--fp8-all-gather).
#  1. Bit-identical: with the projections' weights all-gathered as E4M3 bytes, ZeRO-3 trains exactly
#     as it does gathering fp32 (same losses, same weights and AdamW state after 3 steps), over the
#     shard groups that exist: dp-shard 2; dp-shard 2 x tp 2 (the scale's amax is also reduced over tp);
#     HSDP (2 replicas of 2 shards, resharding after every forward); dp-shard 2 x cp 2 (the shard group
#     is dp x cp). Why exact: the gathered values are what the FP8 GEMM multiplies anyway (fp8.h);
#     scales not agreed across the shards (each rank its own amax) change the losses at step 1.
#  2. The bytes: every all-gather of the traced run carries what tests/py/check_fp8_all_gather.py
#     computes from the model's shapes (a block: one byte per projection element; the embedding and
#     head unchanged).
#  3. Bad input exits 2 with one line: without --fp8, with another recipe, without ZeRO-3, with
#     --all-gather-dtype fp32 (another codec for the same all-gather).
set -eu
source tests/lib.sh
common=(--model tiny --steps 3 --batch 8 --seed 5 --lr 1e-3 --fp8)
pair() {  # ranks, layout flags...: the run with and without --fp8-all-gather, compared bit for bit
    local np=$1; shift
    rm -rf "$T/plain" "$T/fp8ag"
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --checkpoint-dir "$T/plain" > "$T/plain.log" 2>&1 ||
        { cat "$T/plain.log"; echo "FAIL: $*"; exit 1; }
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" "$@" --fp8-all-gather --checkpoint-dir "$T/fp8ag" > "$T/fp8ag.log" 2>&1 ||
        { cat "$T/fp8ag.log"; echo "FAIL: $* --fp8-all-gather"; exit 1; }
    grep -q "all-gathers them as E4M3 bytes" "$T/fp8ag.log" || { echo "FAIL: the run does not say it casts the all-gather"; exit 1; }
    $P --log "$T/fp8ag.log" --log-ref "$T/plain.log" --loss-rtol 0
    $P --ckpt "$T/fp8ag/step_000003.safetensors" --ckpt-ref "$T/plain/step_000003.safetensors" --exact \
        --prefix param.,adam_m.,adam_v.
    echo "ok: -np $np $* --fp8-all-gather: bit-identical to the fp32 all-gather"
}
pair 2 --dp-shard 2
pair 4 --dp-shard 2 --tp 2
pair 4 --dp-shard 2 --dp-replicate 2 --reshard-after-forward always
pair 4 --dp-shard 2 --cp 2

echo "== the bytes on the wire"
traced=(--model tiny --steps 2 --batch 8 --seed 5 --fp8 --dp-shard 2)
$MPIRUN -np 2 "$BUILD/train" "${traced[@]}" --trace-json "$T/plain.json" > /dev/null 2>&1
$MPIRUN -np 2 "$BUILD/train" "${traced[@]}" --fp8-all-gather --trace-json "$T/fp8ag.json" > /dev/null 2>&1
$PYTHON tests/py/check_fp8_all_gather.py "$T/plain.json" "$T/fp8ag.json" --dim 64 --n-heads 8 --n-kv-heads 4 \
    --ffn 128 --vocab 256 --ranks 2

echo "== bad input"
set +e  # expect_error's runs fail on purpose
expect_error 2 "needs --fp8" --dp-shard 2 --fp8-all-gather
expect_error 2 "needs --fp8-recipe tensorwise" --dp-shard 2 --fp8 --fp8-recipe rowwise --fp8-all-gather
expect_error 2 "needs --dp-shard 2 or more with --zero-stage 3" --dp-replicate 2 --fp8 --fp8-all-gather
expect_error 2 "needs --dp-shard 2 or more with --zero-stage 3" --dp-shard 2 --zero-stage 2 --fp8 --fp8-all-gather
expect_error 2 "--all-gather-dtype fp32: not with --fp8-all-gather" --dp-shard 2 --fp8 --fp8-all-gather \
    --all-gather-dtype fp32
