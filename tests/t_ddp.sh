#!/usr/bin/env bash
# Chapter 2: DDP against the single-process reference at the same global batch.
# Tolerances (fp32): the data-parallel gradient is the same sum as the reference's, added in another
# order (per-rank matmuls, then the all-reduce), so step-1 gradients differ by ~1e-7 relative.
#   losses:  rtol 1e-5 (they agree to the 6 decimals logged; 1e-5 leaves room for the drift below)
#   params after 20 AdamW steps: rtol 5e-4 of each tensor's max. Adam divides by sqrt(v), so a
#   weight with a tiny gradient moves by ~lr whatever the gradient's last bits: the same drift the
#   PyTorch oracle measures (tests/py/torch_oracle.py). Seen here: 8.6e-6 (dp 2), 1.4e-5 (dp 4),
#   1.6e-5 (dp 8) with OpenBLAS's Cooperlake kernels (an AVX-512 Xeon's: 3.3e-5, 6.2e-5, 6.8e-5).
# Exact (bit-identical) where the arithmetic is the same: overlap on vs off, and ranks that start
# from different weights (--desync-init) vs the same ones, once rank 0's weights are broadcast.
set -eu
source tests/lib.sh
# Step-1 gradients too (rtol 1e-5 of each tensor's largest): with every step's norm above
# --grad-clip 1, an all-reduce that summed where it averages left the losses and weights in bounds.
common=(--model tiny --steps 20 --batch 8 --seed 5 --lr 1e-3 --bucket-mb 0.05)
"$BUILD/train" "${common[@]}" --checkpoint-dir "$T/ref" --dump "$T/ref.dump.safetensors" > "$T/ref.log"
run() {  # name, ranks, extra flags...
    local name=$1 np=$2; shift 2
    $MPIRUN -np "$np" "$BUILD/train" "${common[@]}" --dp-replicate "$np" "$@" --checkpoint-dir "$T/$name" \
        --grad-dump "$T/$name.grads.safetensors" > "$T/$name.log" 2>&1 || { cat "$T/$name.log"; echo "FAIL: run $name"; exit 1; }
}
check_vs_ref() {  # name
    echo "== $1 vs the single process"
    $P --log "$T/$1.log" --log-ref "$T/ref.log" --loss-rtol 1e-5 --grad-norm-rtol 1e-5 \
       --ckpt "$T/$1/step_000020.safetensors" --ckpt-ref "$T/ref/step_000020.safetensors" --param-rtol 5e-4
    $P --ckpt "$T/$1.grads.safetensors" --ckpt-ref "$T/ref.dump.safetensors" --prefix grad. --param-rtol 1e-5
}
run dp2 2
check_vs_ref dp2
run dp4_accum2 4 --grad-accum-steps 2
check_vs_ref dp4_accum2
run dp8 8
check_vs_ref dp8
run dp2_no_overlap 2 --no-overlap
# MFU is per device: the job's model FLOP/s over ranks x --peak-tflops (X GFLOP/s | MFU Y%: Y = X / (2 P) / 10
# for 2 ranks and P TFLOP/s), on every logged step.
$MPIRUN -np 2 "$BUILD/train" --model tiny --steps 4 --batch 8 --dp-replicate 2 --peak-tflops 0.05 > "$T/mfu.log" 2>&1 ||
    { cat "$T/mfu.log"; echo "FAIL: run mfu"; exit 1; }
sed -nE 's/.*\| ([0-9.]+) GFLOP\/s \| MFU ([0-9.]+)%.*/\1 \2/p' "$T/mfu.log" |
    awk '{ n++; want = $1 / (2 * 0.05) / 10; if ($2 < want - 0.06 || $2 > want + 0.06) bad++ }
         END { exit !(n >= 1 && !bad) }' || { grep GFLOP "$T/mfu.log"; echo "FAIL: MFU is not per device"; exit 1; }
echo "ok: MFU over 2 ranks is the job's FLOP rate over 2 x the peak: $(grep -o 'GFLOP/s | MFU [0-9.]*%' "$T/mfu.log" | tail -1)"
echo "== overlap off vs on: bit-identical"
$P --ckpt "$T/dp2_no_overlap/step_000020.safetensors" --ckpt-ref "$T/dp2/step_000020.safetensors" --exact
run dp2_desync 2 --desync-init
# bit-identical below also if --desync-init did nothing: the broadcast's own check says they differed
grep -q "ddp: the replicas' weights were different before the broadcast from rank 0, and are equal after" "$T/dp2_desync.log" &&
    grep -q "ddp: the replicas' weights were equal before the broadcast" "$T/dp2.log" ||
    { grep "ddp: the" "$T/dp2_desync.log" "$T/dp2.log"; echo "FAIL: --desync-init's replicas did not start different"; exit 1; }
echo "== ranks initialised differently, then broadcast: bit-identical to dp2"
$P --ckpt "$T/dp2_desync/step_000020.safetensors" --ckpt-ref "$T/dp2/step_000020.safetensors" --exact

echo "== the gradient traffic against the bucketing formula (tests/py/check_ddp_trace.py)"
# Losses and weights cannot tell one all-reduce per bucket from two: the trace's bytes can.
for overlap in overlap no-overlap; do
    flag=(); [ "$overlap" = overlap ] || flag=(--no-overlap)
    $MPIRUN -np 2 "$BUILD/train" --model tiny --steps 2 --batch 8 --seed 5 --dp-replicate 2 --bucket-mb 0.1 "${flag[@]}" \
        --checkpoint-dir "$T/ddp_trace_$overlap" --trace-json "$T/ddp_trace_$overlap.json" > "$T/ddp_trace_$overlap.log" 2>&1 ||
        { cat "$T/ddp_trace_$overlap.log"; echo "FAIL: run ddp_trace_$overlap"; exit 1; }
    $PYTHON tests/py/check_ddp_trace.py "$T/ddp_trace_$overlap.json" --ckpt "$T/ddp_trace_$overlap/step_000002.safetensors" \
        --bucket-bytes 104857 --expect-$overlap
done

echo "== bad meshes and batches exit 2 with one line"
set +e
expect_error 4 "3" --dp-replicate 3
expect_error 2 "--batch 6: must be divisible" --dp-replicate 2 --batch 6 --grad-accum-steps 2
expect_error 2 "--desync-init: shows DDP" --dp-shard 2 --desync-init
set -e
echo "t_ddp: OK"
