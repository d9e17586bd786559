#!/usr/bin/env bash
# Chapter 11: build/plan's interface and its validation rows.
#  - bad input: one line, exit status 2, before any work;
#  - the output ends with `TPS/GPU <number>`; --trace writes a valid Perfetto file with the
#    trainer's track names; --search lists fitting meshes fastest first;
#  - seed 003's trends hold (throughput per GPU falls with scale, TP 2-4 beats FSDP at 2,048 GPUs);
#  - every row of chapters/11_at_scale/validation.txt (published throughputs of seeds 000 and 001)
#    is predicted within the band stated next to it, and the rows of each table (the name up to its
#    first "-") are ranked as published. Deterministic arithmetic: no timing involved.
set -eu
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
T=${TEST_TMP:?TEST_TMP must name a scratch directory}
PLAN="$BUILD/plan"
tps_of() { "$PLAN" "$@" | tail -1 | sed 's/^TPS\/GPU //'; }

expect_bad() {  # WANTED FLAGS...: exit status 2 and exactly one line on stderr containing WANTED
    local want=$1; shift
    local err rc=0
    err=$("$PLAN" "$@" 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$err" | grep -c .)" -ne 1 ] || [[ "$err" != *"$want"* ]]; then
        echo "FAIL: plan $* -> rc $rc: $err"; exit 1
    fi
    echo "ok: plan $* -> $err"
}
expect_bad "nope" --model nope
expect_bad "--tp must divide" --tp 3
expect_bad "--batch" --batch 0
expect_bad "--top: only with --search" --top 3
expect_bad "--cp-impl: only with --cp above 1" --cp-impl torch-allgather
expect_bad "--cp-impl" --cp 2 --seq-len 8192 --cp-impl allgather
# A flag the configuration would ignore (as the trainer refuses them)
expect_bad "--sac-mm-share: only with --ac selective" --sac-mm-share 0.5
expect_bad "--sac-mm-share: only with --ac selective" --sac-mm-share 0.5 --ac full --search --gpus 8
expect_bad "--async-tp: only with --tp above 1" --async-tp
expect_bad "--zero-stage: only with a shard group" --zero-stage 2
expect_bad "--pp-schedule: only with --pp above 1" --pp-schedule GPipe
expect_bad "--pp-microbatches: only with --pp above 1" --pp-microbatches 4
expect_bad "--pp-virtual-stages: only with --pp above 1" --pp-virtual-stages 2
# --trace may not overwrite the --cluster file it reads (a JSON profile)
printf '{}\n' >"$T/cluster_in.json"
expect_bad "--trace $T/cluster_in.json: is the file --cluster reads" --cluster "$T/cluster_in.json" --trace "$T/cluster_in.json"
[ "$(cat "$T/cluster_in.json")" = "{}" ] || { echo "FAIL: the cluster file was overwritten"; exit 1; }
# Numbers in the wrong unit give a step too long for a trace's clock: refused, no trace written
printf '{"peak_bf16": 1e6, "hbm_bw": 1e6}\n' >"$T/slow_units.json"
expect_bad "beyond a trace's clock" --model llama3_405b --dp-shard 8 --tp 8 --pp 8 --batch 64 \
    --cluster "$T/slow_units.json" --trace "$T/slow_units.pftrace"
[ ! -e "$T/slow_units.pftrace" ] || { echo "FAIL: a trace was written for a refused run"; exit 1; }
expect_bad "--gpus 10" --gpus 10 --tp 4
expect_bad "multiple of the pipeline ranks" --pp 2 --pp-schedule Interleaved1F1B --pp-microbatches 3 --batch 6
expect_bad "missing.json" --cluster "$T/missing.json"
echo '{"gemm_eff": "high"}' > "$T/bad.json"
expect_bad "must be a number" --cluster "$T/bad.json"
echo '{"gemm_eff": 0.5, "warp_drive": 1}' > "$T/unknown.json"
expect_bad "unknown field warp_drive" --cluster "$T/unknown.json"
expect_bad "not a profile" --cluster h100
expect_bad "--trace $T: is a directory" --trace "$T"  # refused before the simulation, not after it
mkfifo "$T/cluster.fifo"
expect_bad "is not a regular file" --cluster "$T/cluster.fifo"  # refused at once, not waited on

# Sizes whose products wrapped an int (65536 x 65536 = 0, then a division by it: SIGFPE), and the
# limits that keep every product in range: 10^6 GPUs, 65,536 micro-batches, 2^31 - 1 tokens a step.
expect_bad "= 4294967296 GPUs: more than 1000000" --dp-shard 65536 --dp-replicate 65536
expect_bad "= 4294967296 GPUs: more than 1000000" --dp-shard 65536 --dp-replicate 65536 --search --top 1
expect_bad "--batch must be a multiple of dp-replicate x dp-shard x pp-microbatches" \
    --pp 2 --pp-microbatches 65536 --dp-shard 65536
expect_bad "--gpus 0: must be between 1" --dp-shard 65536 --dp-replicate 65536 --search --gpus 0
expect_bad "--gpus 0: must be between 1" --gpus 0
expect_bad "--pp-microbatches 65537: must be between 0 and 65536" --pp 2 --pp-microbatches 65537
expect_bad "= 8589934592 tokens per step: more than 2147483647" --batch 1024 --seq-len 8388608
# --pp-microbatches 0 is the default (the schedule's count), not a count of 0 to divide by.
"$PLAN" --search --gpus 8 --pp-microbatches 0 --top 1 >/dev/null || { echo "FAIL: --search --pp-microbatches 0"; exit 1; }
echo "ok: --search --pp-microbatches 0 searches the micro-batches"
# Hand-checked costs on clusters that isolate one term.
# Element-wise traffic under --tp 2 (sequence parallel): only HBM costs time (2 bytes an element at
# 1e6 B/s). A block forward of tiny (h 64, hq 64, hkv 32, F 128; 128 tokens a rank) moves
# tokens/tp x 26 h (norms, residuals) + tokens x (8 (hq + hkv) + 5 F)/tp (RoPE, SwiGLU on the
# rank's heads and features) = 106,496 + 90,112 elements: 0.393 s, and the step 8.004 s (RoPE and
# SwiGLU divided by tp twice gave 6.923 s).
printf '{"peak_bf16": 1e18, "peak_fp8": 1e18, "hbm_bw": 1e6, "nvlink_bw": 1e15, "net_bw": 1e15, "nvlink_lat": 0, "net_lat": 0, "rank_jitter": 0}\n' >"$T/ew_only.json"
got=$("$PLAN" --model tiny --batch 4 --tp 2 --cluster "$T/ew_only.json" | sed -n 's/^step \([0-9.]*\) s:.*/\1/p')
[ "$got" = "8.004" ] || { echo "FAIL: tp 2 element-wise step $got s, want 8.004"; exit 1; }
echo "ok: tp 2 element-wise traffic as counted by hand: step $got s"
# Stragglers: the same run with rank_jitter 0.1 waits 0.1 x E[max of 2 standard normals] (1/sqrt(pi)
# = 0.5641896) x the busy time (8.004 s, all of it compute) = 0.452 s more: 8.456 s. On one GPU
# (--tp 1) there is nobody to wait for.
sed 's/"rank_jitter": 0}/"rank_jitter": 0.1}/' "$T/ew_only.json" >"$T/jitter.json"
line=$("$PLAN" --model tiny --batch 4 --tp 2 --cluster "$T/jitter.json" | grep '^step ')
one=$("$PLAN" --model tiny --batch 4 --cluster "$T/jitter.json" | grep '^step ')
[[ "$line" == "step 8.456 s: "*", stragglers 0.452 s; "* ]] && [[ "$one" == *", stragglers 0.000"*" s; "* ]] ||
    { echo "FAIL: stragglers: '$line' (want step 8.456 s, stragglers 0.452 s), on one GPU '$one' (want 0)"; exit 1; }
echo "ok: stragglers as counted by hand: 2 GPUs wait 0.452 s, one GPU 0 s"
# A pipeline hop between nodes: tp 4 x pp 4 on 8-GPU nodes puts pp ranks 0-1 on one node and 2-3
# on the next; only the network has a latency (1 s). Every micro-batch crosses 1 -> 2 forward and
# 2 -> 1 backward: 6 s of sends (it was 0: every hop was taken as NVLink). On 16-GPU nodes: 0.
printf '{"gpus_per_node": %d, "peak_bf16": 1e18, "peak_fp8": 1e18, "hbm_bw": 1e15, "nvlink_bw": 1e15, "net_bw": 1e15, "nvlink_lat": 0, "net_lat": 1, "rank_jitter": 0}\n' 8 >"$T/net_lat8.json"
printf '{"gpus_per_node": %d, "peak_bf16": 1e18, "peak_fp8": 1e18, "hbm_bw": 1e15, "nvlink_bw": 1e15, "net_bw": 1e15, "nvlink_lat": 0, "net_lat": 1, "rank_jitter": 0}\n' 16 >"$T/net_lat16.json"
got8=$("$PLAN" --model tiny --batch 4 --tp 4 --pp 4 --cluster "$T/net_lat8.json" | sed -n 's/^step \([0-9.]*\) s:.*/\1/p')
got16=$("$PLAN" --model tiny --batch 4 --tp 4 --pp 4 --cluster "$T/net_lat16.json" | sed -n 's/^step \([0-9.]*\) s:.*/\1/p')
[ "$got8" = "6.000" ] && [ "$got16" = "0.000000" ] || { echo "FAIL: pp hops across nodes: $got8 s on 8-GPU nodes (want 6.000), $got16 on 16 (want 0.000000)"; exit 1; }
echo "ok: a pipeline hop between nodes pays the network: $got8 s on 8-GPU nodes, $got16 s on one 16-GPU node"
# Virtual stages given without --pp: checked at a pipeline of 2 (it was refused at pp 1), and only
# pipelines listed.
rows=$("$PLAN" --model llama3_8b --gpus 16 --batch 32 --seq-len 8192 --search --pp-schedule Interleaved1F1B \
    --pp-virtual-stages 2 | awk '$1 ~ /^[0-9]+$/ {print $1, $8}' | sort -u)
[ -n "$rows" ] && ! grep -qvE '^([2-9]|[1-9][0-9]+) Interleaved1F1B$' <<<"$rows" ||
    { echo "FAIL: --search --pp-virtual-stages 2 without --pp listed: $rows"; exit 1; }
echo "ok: --search --pp-virtual-stages 2 without --pp lists pipelines only ($(tr '\n' ' ' <<<"$rows"))"
# A search where nothing fits still ends with the line scripts read.
"$PLAN" --model llama3_405b --search --gpus 8 >"$T/nofit.txt"
[ "$(tail -1 "$T/nofit.txt")" = "TPS/GPU 0" ] && grep -q "^no mesh fits: give more GPUs" "$T/nofit.txt" ||
    { cat "$T/nofit.txt"; echo "FAIL: a search where no mesh fits: not its advice and TPS/GPU 0"; exit 1; }
echo "ok: a search where no mesh fits ends with TPS/GPU 0"
# ... and one where no mesh is valid at all (more GPUs than sequences) says so, not "give more GPUs".
"$PLAN" --search --gpus 1000000 --top 1 >"$T/novalid.txt"
[ "$(tail -1 "$T/novalid.txt")" = "TPS/GPU 0" ] &&
    grep -q "^no mesh of 1000000 GPUs can run this: give a larger --batch or fewer --gpus" "$T/novalid.txt" ||
    { cat "$T/novalid.txt"; echo "FAIL: a search where no mesh is valid: wrong advice"; exit 1; }
echo "ok: a search where no mesh is valid asks for a larger batch or fewer GPUs"

# --fp8 needs FP8 matmuls on the cluster (else every step would take forever: "step inf s") and
# the GPU precision its model is of. A profile without FP8 stays valid without --fp8.
expect_bad "--fp8: cluster a100-sxm-ib has no FP8 matmuls (peak_fp8 0, fp8_gemm_eff 0)" --cluster a100-sxm-ib --fp8
expect_bad "--fp8: cluster cpu has no FP8 matmuls" --cluster cpu --fp8 --search --gpus 8 --top 3
expect_bad "--fp8: only with --precision mixed" --precision fp32 --fp8
echo '{"name": "no-fp8", "peak_fp8": 0, "fp8_gemm_eff": 0, "async_tp_hidden": 0, "power_w": 0, "nvlink_lat": 0,
       "net_lat": 0}' >"$T/no-fp8.json"
expect_bad "--fp8: cluster no-fp8 has no FP8 matmuls" --cluster "$T/no-fp8.json" --fp8
for cluster in h100-sxm-ib a100-sxm-ib cpu "$T/no-fp8.json" "$T/no-fp8.json --precision fp32" "h100-sxm-ib --fp8"; do
    # shellcheck disable=SC2086
    "$PLAN" --model tiny --batch 4 --seq-len 64 --cluster $cluster >/dev/null ||
        { echo "FAIL: --cluster $cluster refused"; exit 1; }
done
echo "ok: every profile, and a file with the fields that may be 0 at 0, accepted"

# A cluster file: one object, every number finite and physical, name a string.
bad_cluster() {  # WANTED JSON: the file is refused with WANTED
    printf '%s\n' "$2" >"$T/c.json"
    expect_bad "--cluster $T/c.json: $1" --cluster "$T/c.json"
}
bad_cluster "hbm_bytes -8e+10: must be from 1e6 to 1e15 bytes" '{"hbm_bytes": -80e9}'
bad_cluster "net_lat -1e-05: must be from 0 to 1 s" '{"net_lat": -10e-6}'
bad_cluster "nvlink_lat -3e-06: must be from 0 to 1 s" '{"nvlink_lat": -3e-6}'
bad_cluster "fp8_gemm_eff -0.357: must be 0 (no FP8) or from 1e-12 to 1" '{"fp8_gemm_eff": -0.357}'
bad_cluster "peak_fp8 -1.979e+15: must be 0 (no FP8) or from 1e6" '{"peak_fp8": -1979e12}'
bad_cluster "gemm_eff 5: must be from 1e-12 to 1" '{"gemm_eff": 5}'
bad_cluster "attn_eff 0: must be from 1e-12 to 1" '{"attn_eff": 0}'
bad_cluster "gemm_eff 1e-300: must be from 1e-12 to 1" '{"gemm_eff": 1e-300, "attn_eff": 1e-300}'  # the step was inf, a search's rows NaN
bad_cluster "fp8_gemm_eff 1e-300: must be 0 (no FP8) or from 1e-12 to 1" '{"fp8_gemm_eff": 1e-300}'
bad_cluster "async_tp_hidden 1.5: must be in [0, 1]" '{"async_tp_hidden": 1.5}'
bad_cluster "field name is 60 bytes: at most 47" '{"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}'  # was cut to 47
bad_cluster "field name holds a control character (byte 1)" '{"name": "a\nb"}'  # split the plan's first line
bad_cluster "peak_bf16 inf: must be a finite number" '{"peak_bf16": 1e999}'
bad_cluster "net_bw 0: must be from 1e6 to 1e15 bytes/s" '{"net_bw": 0}'
bad_cluster "net_bw 40: must be from 1e6 to 1e15 bytes/s" '{"net_bw": 40}'  # GB/s for bytes/s
bad_cluster "peak_bf16 989: must be from 1e6 to 1e18 FLOP/s" '{"peak_bf16": 989}'
bad_cluster "peak_fp8 1979: must be 0 (no FP8) or from 1e6 to 1e18 FLOP/s" '{"peak_fp8": 1979}'
bad_cluster "hbm_bytes 80: must be from 1e6 to 1e15 bytes" '{"hbm_bytes": 80}'
bad_cluster "net_lat 10: must be from 0 to 1 s" '{"net_lat": 10}'  # microseconds for seconds
bad_cluster "power_w -500: must be from 0 to 1e5 W" '{"power_w": -500}'
bad_cluster "gpus_per_node 2.5: must be a whole number from 1 to 1000000" '{"gpus_per_node": 2.5}'
bad_cluster "rank_jitter 2.6: must be from 0 to 0.5 (a relative standard deviation)" '{"rank_jitter": 2.6}'  # percent for a share
bad_cluster "rank_jitter -0.01: must be from 0 to 0.5" '{"rank_jitter": -0.01}'
bad_cluster "gpus_per_node 0: must be a whole number" '{"gpus_per_node": 0}'
bad_cluster "more after the JSON object (at byte 19)" '{"gemm_eff": 0.45} xyz'
bad_cluster "more after the JSON object (at byte 18)" '{"gemm_eff": 0.45}{"gemm_eff": 0.5}'
bad_cluster "field name must be a non-empty string" '{"name": 5}'
bad_cluster "field name must be a non-empty string" '{"name": null}'
bad_cluster "not valid JSON (error near byte 10)" '{"net_bw":NaN}'
bad_cluster "not valid JSON" '{"net_bw":40e9'
bad_cluster "not a JSON object" '[1]'
bad_cluster "field gemm_eff given twice" '{"gemm_eff": 0.45, "gemm_eff": 0.5}'
bad_cluster "unknown field warp_drive" '{"warp_drive": "fast"}'
printf '{}\n' >"$T/empty.json"  # every field the default profile's
[ "$(tps_of --cluster "$T/empty.json")" = "$(tps_of)" ] || { echo "FAIL: {} is not the default profile"; exit 1; }
echo "ok: {} is the default profile"

# --search validates the mesh flags given as a plain run does, before searching.
expect_bad "--tp must divide the query and key/value heads" --search --tp 3
expect_bad "--tp must divide the query and key/value heads" --search --gpus 16 --tp 16
expect_bad "--batch must be a multiple of dp-replicate x dp-shard" --search --dp-shard 3
expect_bad "--gpus 8: not a multiple of the mesh flags given (pp x dp-replicate x dp-shard x cp x tp = 3)" \
    --search --gpus 8 --dp-shard 3
expect_bad "--gpus 16: the mesh has 8" --search --gpus 16 --pp 2 --dp-replicate 1 --dp-shard 2 --cp 1 --tp 2
expect_bad "the sequence length (--seq-len, or the model's) must be a multiple of 2 x cp" --search --gpus 8 --cp 2 --seq-len 8190
# The trainer's own rules (the chapters' checks), no stricter and no looser: without cp any length
# splits (train takes --seq-len 33), and a tied model cannot be pipelined (train refuses it).
"$PLAN" --model small --cluster cpu --batch 2 --seq-len 33 >"$T/seq33.txt" 2>&1 ||
    { cat "$T/seq33.txt"; echo "FAIL: plan refused --seq-len 33 without --cp"; exit 1; }
echo "ok: --seq-len 33 without --cp is planned"
expect_bad "tied embeddings are not supported" --model llama3_1b --pp 2
expect_bad "tied embeddings are not supported" --search --model llama3_1b --gpus 8 --pp 2
# ... and a flag that the dimension a flag fixes makes meaningless is refused, as in the plain run
# (each was accepted and dropped: --pp-virtual-stages 4 listed rows with v 1).
expect_bad "only Interleaved1F1B" --search --gpus 8 --batch 32 --seq-len 2048 --pp 2 --pp-schedule 1F1B \
    --pp-virtual-stages 4
expect_bad "--async-tp: only with --tp above 1" --search --gpus 8 --tp 1 --async-tp
expect_bad "--pp-schedule: only with --pp above 1" --search --gpus 8 --pp 1 --pp-schedule GPipe
expect_bad "--zero-stage: only with a shard group" --search --gpus 8 --dp-shard 1 --cp 1 --zero-stage 2
expect_bad "--cp-impl: only with --cp above 1" --search --gpus 8 --cp 1 --cp-impl torch-allgather
# The header names the data parallelism a mesh has: ZeRO only with a shard group.
[[ "$("$PLAN" --dp-replicate 8 --batch 16 | head -1)" == *"--ac none, DDP, 1F1B"* ]] &&
    [[ "$("$PLAN" --batch 2 | head -1)" == *"--ac none, no dp, 1F1B"* ]] ||
    { echo "FAIL: the header of a run without a shard group: $("$PLAN" --dp-replicate 8 --batch 16 | head -1)"; exit 1; }

# A cluster file overrides the default profile field by field.
echo '{"name": "half", "gemm_eff": 0.225, "fp8_gemm_eff": 0.1785, "attn_eff": 0.108}' > "$T/half.json"
full=$("$PLAN" --dp-shard 8 --batch 16 | sed -n 's/^TPS\/GPU //p')
half=$("$PLAN" --dp-shard 8 --batch 16 --cluster "$T/half.json" | sed -n 's/^TPS\/GPU //p')
awk -v f="$full" -v h="$half" 'BEGIN { exit !(h < 0.6 * f && h > 0.4 * f) }' || { echo "FAIL: half efficiency $half vs $full"; exit 1; }
echo "ok: halved efficiencies: $half vs $full TPS/GPU"

# The output and the trace.
out=$("$PLAN" --model llama3_8b --pp 2 --dp-shard 2 --tp 2 --batch 8 --pp-microbatches 4 --ac full --trace "$T/sim.pftrace")
last=$(printf '%s\n' "$out" | tail -1)
[[ "$last" =~ ^TPS/GPU\ [0-9]+$ ]] || { echo "FAIL: last line '$last'"; exit 1; }
"$PYTHON" tests/py/trace_check.py "$T/sim.pftrace" --expect-slice "block fwd" --expect-slice "block bwd" \
    --expect-slice "all_gather" --expect-slice "reduce_scatter" --expect-slice "batch" --expect-slice "all_reduce" \
    --expect-slice "tp wait" --expect-slice optimizer --expect-slice step --expect-slice "pp wait" \
    --expect-slice "wait for the slowest GPU"
summary=$(traces/trace-summary "$T/sim.pftrace")
printf '%s\n' "$summary" | grep -q "pp1 dp0 cp0 tp0" || { echo "FAIL: trace-summary: $summary"; exit 1; }
echo "ok: trace of 2 pipeline ranks read by trace-summary"
# The printed exposed communication is the trace's: the largest time a rank's compute track waits in
# its comm-wait slices (trace-summary's "exposed"), the first unit's all-gather included (it was
# left out: 0.008 s printed for the 10.8 ms the FSDP trace shows). And MFU is the model FLOPs per
# token (--model-info's) x TPS/GPU over the profile's bf16 peak (989 TFLOP/s).
exposed_check() {  # plan flags...
    local out summary
    out=$("$PLAN" "$@" --trace "$T/exposed.pftrace")
    summary=$(traces/trace-summary "$T/exposed.pftrace")
    awk -v line="$(sed -n 's/.*exposed comm \([0-9.]*\) s.*/\1/p' <<<"$out")" -v summary="$summary" 'BEGIN {
        n = split(summary, rows, "\n")
        for (i = 2; i <= n; i++) { split(rows[i], f, " "); if (f[1] ~ /^[0-9]+$/ && f[4] > worst) worst = f[4] }
        exit !(line != "" && worst > 0 && line - worst / 1000 < 0.0006 && worst / 1000 - line < 0.0006)
    }' || { echo "FAIL: plan $*: exposed comm printed vs the trace's: $out"; echo "$summary"; exit 1; }
    local tps mfu flops
    tps=${out##*TPS/GPU }
    mfu=$(sed -n 's/.*MFU \([0-9.]*\)%.*/\1/p' <<<"$out")
    flops=$("$BUILD/train" --model "$2" --model-info --seq-len 8192 | sed -n 's/.*FLOPs\/token at seq [0-9]*: \([0-9.e+]*\).*/\1/p')
    awk -v t="$tps" -v m="$mfu" -v f="$flops" 'BEGIN { want = 100 * t * f / 989e12; exit !(f > 0 && m - want < 0.06 && want - m < 0.06) }' ||
        { echo "FAIL: plan $*: MFU $mfu%, want TPS/GPU $tps x $flops FLOPs/token / 989 TFLOP/s"; exit 1; }
    echo "ok: plan $*: exposed comm and MFU as the trace and the FLOP count say"
}
exposed_check --model llama3_8b --dp-shard 8 --batch 16 --ac selective --sac-mm-share 0.5
exposed_check --model llama3_8b --pp 2 --dp-shard 2 --tp 2 --batch 8 --pp-microbatches 4 --ac full

# The simulated trace in the trainer's layout: on the same configuration, every track the plan
# writes and every slice name on its comm tracks (and every wait on its compute track) is one the
# trainer's own trace has, so the two open side by side. (The compute track's phases differ: the
# plan draws the units it costs, flat.)
layout_check() {  # ranks, layout flags...
    local np=$1; shift
    # shellcheck disable=SC2086
    $MPIRUN -np "$np" "$BUILD/train" --model tiny --steps 1 --batch 8 --seq-len 32 "$@" --trace "$T/real.pftrace" \
        > "$T/real.log" 2>&1 || { cat "$T/real.log"; echo "FAIL: train $*"; exit 1; }
    "$PLAN" --model tiny --cluster cpu --precision fp32 --batch 8 --seq-len 32 "$@" --trace "$T/plan.pftrace" > /dev/null
    "$PYTHON" - "$T/real.pftrace" "$T/plan.pftrace" "$*" <<'PY'
import sys
from collections import defaultdict
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
def names(path):  # track name -> {(slice name, category)}
    trace = pb.Trace()
    trace.ParseFromString(open(path, "rb").read())
    tracks = {p.track_descriptor.uuid: p.track_descriptor.thread.thread_name for p in trace.packet
              if p.HasField("track_descriptor") and p.track_descriptor.HasField("thread")}
    out = defaultdict(set)
    for p in trace.packet:
        e = p.track_event
        if p.HasField("track_event") and e.type == pb.TrackEvent.TYPE_SLICE_BEGIN and e.track_uuid in tracks:
            out[tracks[e.track_uuid]].add((e.name, e.categories[0] if e.categories else ""))
    return out
real, plan = names(sys.argv[1]), names(sys.argv[2])
problems = [f"track {t} (the trainer's: {sorted(real)})" for t in plan if t not in real]
for track, slices in plan.items():
    for name, cat in slices:
        if (track.startswith("comm:") or cat.endswith("-wait")) and (name, cat) not in real.get(track, set()):
            problems.append(f"{track}: {name!r} ({cat}), the trainer's: {sorted(real.get(track, set()))}")
if problems:
    sys.exit(f"FAIL: plan {sys.argv[3]}: not in the trainer's trace:\n  " + "\n  ".join(problems))
print(f"ok: plan {sys.argv[3]}: tracks {sorted(plan)}, comm and wait names all the trainer's")
PY
}
layout_check 2 --dp-replicate 2
layout_check 2 --dp-shard 2 --zero-stage 3
layout_check 4 --dp-replicate 2 --dp-shard 2 --zero-stage 3
layout_check 4 --pp 2 --tp 2 --pp-microbatches 2

# --search: sorted by TPS/GPU, every listed mesh within memory. Rows: pp tp dp_rep dp_shard cp ac
# zero schedule m v mem step bubble MFU TPS/GPU.
search_rows() { printf '%s\n' "$1" | awk 'NR > 2 && NF == 15'; }
field() { local n=$2; set -- $1; eval "echo \${$n}"; }  # ROW N: the row's Nth field
row_flags() {  # one search row -> the plain run's flags
    set -- $1
    printf -- '--pp %s --tp %s --dp-replicate %s --dp-shard %s --cp %s --ac %s' "$1" "$2" "$3" "$4" "$5" "$6"
    [ "$7" = - ] || printf -- ' --zero-stage %s' "$7"
    [ "$1" = 1 ] || printf -- ' --pp-schedule %s --pp-microbatches %s --pp-virtual-stages %s' "$8" "$9" "${10}"
}
check_search() {  # NAME FLAGS...: sorted, within memory, and each of the first rows and the fastest
                  # pipelined row is what a plain run of its flags predicts
    local name=$1; shift
    local s rows row got base=() a
    s=$("$PLAN" "$@" --search)
    while [ $# -gt 0 ]; do  # the flags without those each row names
        a=$1; shift
        case $a in --pp | --dp-replicate | --dp-shard | --cp | --tp | --ac | --zero-stage) shift ;; *) base+=("$a") ;; esac
    done
    rows=$(search_rows "$s")
    printf '%s\n' "$rows" | awk '{ if (NR > 1 && $15 + 0 > prev + 0) bad = 1; prev = $15; if ($11 + 0 > 89.5) bad = 1 }
        END { exit bad || NR == 0 }' || { echo "FAIL: search ($name) output: $s"; exit 1; }
    while read -r row; do
        # shellcheck disable=SC2046
        got=$(tps_of "${base[@]}" $(row_flags "$row"))
        [ "$got" = "$(field "$row" 15)" ] ||
            { echo "FAIL: search ($name) row '$row': a plain run of its flags gives $got"; exit 1; }
    done < <(printf '%s\n' "$rows" | head -3; printf '%s\n' "$rows" | awk '$1 > 1' | head -1)
    echo "ok: search $name ($(printf '%s\n' "$s" | head -1))"
    search_out=$s
}
# The checkpointing is searched unless given: every row for 70B on 32 GPUs takes the lightest
# policy that fits its mesh (no lighter one fits; the fastest needs selective), and with --ac full
# every row keeps full.
check_search "70B on 32 GPUs" --model llama3_70b --gpus 32 --batch 32
[ "$(field "$(search_rows "$search_out" | head -1)" 6)" != none ] ||
    { echo "FAIL: expected the fastest mesh to need checkpointing: $search_out"; exit 1; }
while read -r row; do
    for lighter in none selective; do
        [ "$lighter" = "$(field "$row" 6)" ] && break
        # shellcheck disable=SC2046
        "$PLAN" --model llama3_70b --gpus 32 --batch 32 $(row_flags "$row" | sed "s/--ac [a-z]*/--ac $lighter/") |
            grep -q "DOES NOT FIT" || { echo "FAIL: '$row' listed, but --ac $lighter fits too"; exit 1; }
    done
done < <(search_rows "$search_out")
echo "ok: search's $(search_rows "$search_out" | wc -l) meshes for 70B on 32 GPUs take the lightest checkpointing that fits"
# --top N: the same first N rows, and only those.
top=$("$PLAN" --model llama3_70b --gpus 32 --batch 32 --search --top 3)
[ "$(search_rows "$top")" = "$(search_rows "$search_out" | head -3)" ] && [ "$(search_rows "$top" | wc -l)" = 3 ] ||
    { echo "FAIL: --top 3: $top"; exit 1; }
echo "ok: --search --top 3 lists the search's first 3 rows"
check_search "70B on 32 GPUs, --ac full" --model llama3_70b --gpus 32 --batch 32 --ac full
search_rows "$search_out" | awk '$6 != "full" { bad = 1 } END { exit bad }' ||
    { echo "FAIL: --ac full given, yet rows with another policy: $search_out"; exit 1; }
# The ZeRO stage too: on a 2 GB/s network some of the 1B's meshes run fastest under ZeRO-2, and no
# stage beats the listed one on the first 5 rows with a shard group.
echo '{"name": "slow-network", "net_bw": 2e9}' >"$T/slow.json"
slow=(--cluster "$T/slow.json" --model llama3_1b --gpus 16 --batch 32 --seq-len 2048)
check_search "1B on a slow network" "${slow[@]}"
search_rows "$search_out" | awk '$7 == 1 || $7 == 2 { seen = 1 } END { exit !seen }' ||
    { echo "FAIL: every mesh under ZeRO-3 on the slow network: $search_out"; exit 1; }
while read -r row; do
    for try_zero in 1 2 3; do
        # shellcheck disable=SC2046
        out=$("$PLAN" "${slow[@]}" $(row_flags "$row" | sed "s/--zero-stage [0-9]/--zero-stage $try_zero/"))
        case $out in *"DOES NOT FIT"*) continue ;; esac
        [ "${out##*TPS/GPU }" -le "$(field "$row" 15)" ] ||
            { echo "FAIL: '$row' listed, but ZeRO-$try_zero gives ${out##*TPS/GPU } TPS/GPU"; exit 1; }
    done
done < <(search_rows "$search_out" | awk '$7 != "-"' | head -5)
echo "ok: search's first 5 meshes with a shard group on a slow network: no ZeRO stage beats the listed one"
# The schedule, micro-batch count and ZeRO stage are searched: on 64 GPUs with 512 sequences, no
# setting of the fastest 8-stage mesh (1F1B or interleaved, every m from 8 that divides the rank's
# batch, ZeRO 1-3) that fits runs faster than the one listed, and the default (1F1B, m = pp, ZeRO-3)
# runs slower.
check_search "70B on 64 GPUs, batch 512" --model llama3_70b --gpus 64 --batch 512 --ac full
row=$(search_rows "$search_out" | awk '$1 == 8' | head -1)
[ -n "$row" ] || { echo "FAIL: no 8-stage mesh in: $search_out"; exit 1; }
read -r pp tp rep shard cp _ zero sched m v _ <<<"$row"
listed=$(field "$row" 15)
mesh=(--model llama3_70b --gpus 64 --batch 512 --ac full --pp 8 --tp "$tp" --dp-replicate "$rep" --dp-shard "$shard" --cp "$cp")
default_tps=$(tps_of "${mesh[@]}")
tried=0
for try_zero in 1 2 3; do
    for try_sched in 1F1B Interleaved1F1B; do
        for ((try_m = 8; try_m <= 512 / (rep * shard); try_m++)); do
            (((512 / (rep * shard)) % try_m == 0)) || continue
            out=$("$PLAN" "${mesh[@]}" --zero-stage "$try_zero" --pp-schedule "$try_sched" --pp-microbatches "$try_m" \
                2>/dev/null) || continue
            case $out in *"DOES NOT FIT"*) continue ;; esac
            tried=$((tried + 1))
            [ "${out##*TPS/GPU }" -le "$listed" ] || { echo "FAIL: search listed '$row', but ZeRO-$try_zero" \
                "$try_sched m=$try_m gives ${out##*TPS/GPU } TPS/GPU"; exit 1; }
        done
    done
done
[ "$tried" -gt 6 ] && [ "$default_tps" -lt "$listed" ] ||
    { echo "FAIL: '$row': $tried settings tried, the default gives $default_tps TPS/GPU"; exit 1; }
echo "ok: search picks ZeRO-$zero $sched with $m micro-batches for pp 8 ($listed TPS/GPU), the best of $tried" \
    "settings (default: $default_tps)"
# The mesh flags given stay fixed: the rows are the whole search's rows with those sizes, in its order.
whole=$(search_rows "$search_out")
check_search "70B on 64 GPUs, --tp 4" --model llama3_70b --gpus 64 --batch 512 --ac full --tp 4
[ "$(search_rows "$search_out")" = "$(printf '%s\n' "$whole" | awk '$2 == 4')" ] ||
    { echo "FAIL: --search --tp 4: $search_out"; exit 1; }
check_search "70B on 64 GPUs, --pp 4 --dp-replicate 1 --dp-shard 2" --model llama3_70b --gpus 64 --batch 512 --ac full \
    --pp 4 --dp-replicate 1 --dp-shard 2
[ "$(search_rows "$search_out")" = "$(printf '%s\n' "$whole" | awk '$1 == 4 && $3 == 1 && $4 == 2')" ] ||
    { echo "FAIL: --search --pp 4 --dp-replicate 1 --dp-shard 2: $search_out"; exit 1; }
# Micro-batch counts other than pp x 2^k: 8B on 8 GPUs with 24 sequences. Each pipelined row's count
# is the best of every one that divides the rank's batch (the search tried only 2, 4, 8: its 8-stage
# row ran 8 micro-batches at 2,348 TPS/GPU where 24 give 4,278).
check_search "8B on 8 GPUs, batch 24" --model llama3_8b --gpus 8 --batch 24
while read -r row; do
    read -r pp tp rep shard cp ac zero sched m v _ <<<"$row"
    for ((try_m = pp; try_m <= 24 / (rep * shard); try_m++)); do
        (((24 / (rep * shard)) % try_m == 0)) || continue
        # shellcheck disable=SC2046
        out=$("$PLAN" --model llama3_8b --gpus 8 --batch 24 $(row_flags "$row" | sed "s/--pp-microbatches [0-9]*/--pp-microbatches $try_m/") \
            2>/dev/null) || continue
        case $out in *"DOES NOT FIT"*) continue ;; esac
        [ "${out##*TPS/GPU }" -le "$(field "$row" 15)" ] ||
            { echo "FAIL: '$row' listed, but $try_m micro-batches give ${out##*TPS/GPU } TPS/GPU"; exit 1; }
    done
done < <(search_rows "$search_out" | awk '$1 > 1')
search_rows "$search_out" | awk '$1 > 1 && $9 % 3 == 0 { seen = 1 } END { exit !seen }' ||
    { echo "FAIL: no pipelined row with a micro-batch count divisible by 3: $search_out"; exit 1; }
echo "ok: search's pipelined rows for 8B with 24 sequences run the best micro-batch count of every divisor"
# cp is searched unless given: 8B at 128k on 8 GPUs (Table 2's row) does not fit without it; the
# fastest mesh has cp > 1, and with --cp 2 every row keeps cp 2.
"$PLAN" --model llama3_8b --gpus 8 --batch 8 --seq-len 131072 --ac full --fp8 --compile | grep -q "DOES NOT FIT" ||
    { echo "FAIL: 8B at 128k without cp was expected not to fit"; exit 1; }
check_search "8B at 128k" --model llama3_8b --gpus 8 --batch 2 --seq-len 131072 --ac full --fp8 --compile
[ "$(field "$(search_rows "$search_out" | head -1)" 5)" -gt 1 ] ||
    { echo "FAIL: the fastest mesh at 128k has cp 1: $search_out"; exit 1; }
check_search "8B at 128k, --cp 2" --model llama3_8b --gpus 8 --batch 2 --seq-len 131072 --ac full --fp8 --compile --cp 2
search_rows "$search_out" | awk '$5 != 2 { bad = 1 } END { exit bad }' ||
    { echo "FAIL: --cp 2 given, yet rows with another cp: $search_out"; exit 1; }

# Seed 003's trends (Llama 2 7B, 4,096 tokens, 2 sequences per GPU): per-GPU throughput falls from
# 128 to 2,048 GPUs under FSDP, and tensor parallelism of 2 or 4 beats pure FSDP at 2,048.
tps() { "$PLAN" --model llama2_7b --seq-len 4096 --ac selective "$@" | sed -n 's/^TPS\/GPU //p'; }
f128=$(tps --gpus 128 --batch 256); f2048=$(tps --gpus 2048 --batch 4096)
t2=$(tps --gpus 2048 --tp 2 --batch 4096); t4=$(tps --gpus 2048 --tp 4 --batch 4096)
if [ "$f2048" -lt "$f128" ] && [ "$t2" -gt "$f2048" ] && [ "$t4" -gt "$f2048" ]; then
    echo "ok: seed 003 trends: FSDP $f128 -> $f2048 TPS/GPU from 128 to 2048 GPUs; at 2048 TP 2 $t2, TP 4 $t4"
else
    echo "FAIL: seed 003 trends: FSDP $f128 -> $f2048; TP 2 $t2, TP 4 $t4 at 2048"; exit 1
fi

# The validation rows.
fails=0 rows=""
while read -r name published band flags; do
    case "$name" in ''|'#'*) continue ;; esac
    # shellcheck disable=SC2086
    tps=$("$PLAN" $flags | sed -n 's/^TPS\/GPU //p')
    err=$(awk -v p="$tps" -v q="$published" 'BEGIN { printf "%+.1f", 100 * (p - q) / q }')
    if awk -v p="$tps" -v q="$published" -v b="$band" 'BEGIN { d = (p - q) / q; exit !(d <= b && d >= -b) }'; then
        echo "ok: $name published $published predicted $tps ($err%, band $band)"
    else
        echo "FAIL: $name published $published predicted $tps ($err%, band $band)"; fails=1
    fi
    rows+="$name $published $tps"$'\n'
done < chapters/11_at_scale/validation.txt
# The ranking: within each table (the name up to its first '-'), every two rows in the published order.
if ranking=$(awk '{ fam = $1; sub(/-.*/, "", fam); n++; f[n] = fam; name[n] = $1; pub[n] = $2; pred[n] = $3 }
        END { bad = 0
              for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
                  if (f[i] == f[j] && (pub[i] - pub[j]) * (pred[i] - pred[j]) <= 0) {
                      printf "%s (%d published, %d predicted) vs %s (%d, %d)\n", name[i], pub[i], pred[i], name[j], pub[j], pred[j]; bad = 1 }
              exit bad }' <<<"$rows"); then
    echo "ok: every table's rows ranked as published"
else
    echo "FAIL: ranked unlike the published rows: $ranking"; fails=1
fi
exit $fails
