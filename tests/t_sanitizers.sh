#!/usr/bin/env bash
# The C code under AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer: the programs and
# unit suites built with -fsanitize=address,undefined,float-cast-overflow (a double converted to an
# int it does not fit: GCC's "undefined" leaves that check out) into $BUILD/sanitize (-O1 and frame
# pointers, so reports name their lines), then the trainer's layouts, a resume, the planner, the
# chapter tools and the suites run there. A run fails on its first report (out-of-bounds access,
# use after free, undefined behaviour, or memory still allocated at exit that no pointer reaches),
# and the check also fails on a report in the output whatever the exit status. Leaks are checked
# in the project's code only: Open MPI keeps what MPI_Init allocates past MPI_Finalize
# (tests/lsan.supp).
set -eu
S="$BUILD/sanitize"
T="$TEST_TMP"
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
programs=(train plan cp_attention collectives pp_schedule)
suites=(test_reference test_fp8 test_fp8_groups test_checkpointing test_safetensors test_data test_plan
        test_pp_schedule test_trace)
# One build for both: CFLAGS through the environment (the Makefile adds its own flags to it; on the
# command line it would replace them), CXX for the GPU kernels on the CPU emulator (tests/gpu/emu),
# whose ring attention test runs the tensor-core attention kernels' portable path, the fp32 ones and
# the merges. (test_gpu_ops is clean too, but its fibers make it ten times slower under ASan: 3.5
# minutes.)
CFLAGS="-O1 -g -march=native -fno-omit-frame-pointer" make -s BUILD="$S" \
    EXTRA_CFLAGS="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all" \
    CXX="${CXX:-g++} -g -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all" \
    "${programs[@]/#/$S/}" "${suites[@]/#/$S/tests/}" "$S/tests/emu/test_gpu_cp"
echo "ok: built with -fsanitize=address,undefined,float-cast-overflow in $S"

export ASAN_OPTIONS="detect_leaks=1:fast_unwind_on_malloc=0:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-600}  # Check's per-test limit: sanitized code runs slower
mpi=($MPIRUN -x ASAN_OPTIONS -x LSAN_OPTIONS -x UBSAN_OPTIONS)
n_checked=0

# check NAME COMMAND...: COMMAND must exit 0 with no sanitizer report in its output.
check() {
    local name=$1; shift
    local log="$T/$name.log" rc=0
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ] || grep -qE "ERROR: (Address|Leak)Sanitizer|runtime error:" "$log"; then
        echo "FAIL: $name (exit $rc): $*"
        if grep -qE "Sanitizer|runtime error:" "$log"; then grep -E -A40 "Sanitizer|runtime error:" "$log" | head -80
        else tail -20 "$log"; fi
        exit 1
    fi
    n_checked=$((n_checked + 1))
    echo "ok: $name"
}

for s in "${suites[@]}"; do check "$s" "$S/tests/$s"; done

# One process (2 threads): checkpoints and a trace written, then a resume from them; FP8, the naive
# attention and the loop matmuls.
export OMP_NUM_THREADS=2
check single "$S/train" --model tiny --steps 4 --ac full --checkpoint-dir "$T/ck" --checkpoint-every 2 \
    --trace "$T/single.pftrace"
check resume "$S/train" --model tiny --steps 4 --ac full --resume "$T/ck/step_000002.safetensors"
check single_fp8 "$S/train" --model tiny --steps 3 --fp8 --ac selective --attention naive --matmul loop

# Ranks (one thread each): every parallel module, and their compositions.
export OMP_NUM_THREADS=1
check ddp "${mpi[@]}" -np 2 "$S/train" --model tiny --steps 3 --dp-replicate 2
check hsdp "${mpi[@]}" -np 4 "$S/train" --model tiny --steps 3 --dp-replicate 2 --dp-shard 2 --zero-stage 3 \
    --trace "$T/hsdp.pftrace"
check zero2_fp8 "${mpi[@]}" -np 2 "$S/train" --model tiny --steps 3 --dp-shard 2 --zero-stage 2 --fp8
check tp_sp "${mpi[@]}" -np 4 "$S/train" --model tiny --steps 3 --tp 2 --sequence-parallel --dp-shard 2
check pp_interleaved_zero1 "${mpi[@]}" -np 4 "$S/train" --model tiny --steps 3 --pp 2 \
    --pp-schedule Interleaved1F1B --pp-virtual-stages 2 --pp-microbatches 4 --dp-shard 2 --zero-stage 1
check pp_gpipe_ac "${mpi[@]}" -np 2 "$S/train" --model tiny --steps 3 --pp 2 --pp-schedule GPipe --ac full
check cp_fp8 "${mpi[@]}" -np 2 "$S/train" --model tiny --steps 3 --cp 2 --fp8 --ac full
check cp_tp "${mpi[@]}" -np 4 "$S/train" --model tiny --steps 3 --cp 2 --tp 2

# The emulated GPU kernels (ASan warns that it cannot follow the fibers' stack switches fully; a
# false positive would still fail here, none has been seen).
check gpu_cp_emulated "${mpi[@]}" -np 2 "$S/tests/emu/test_gpu_cp"

# The chapter tools and the planner.
check cp_attention_ring "${mpi[@]}" -np 2 "$S/cp_attention" --check
check cp_attention_alltoall "${mpi[@]}" -np 2 "$S/cp_attention" --check --cp-mode alltoall
check collectives "${mpi[@]}" -np 3 "$S/collectives" --check
check pp_schedule "$S/pp_schedule" --schedule Interleaved1F1B --pp 4 --microbatches 8 --virtual-stages 2 \
    --dot "$T/pp.dot"
check plan_search "$S/plan" --model llama3_8b --gpus 16 --batch 32 --search --top 3
check plan_trace "$S/plan" --model llama3_70b --gpus 64 --batch 128 --pp 8 --pp-schedule Interleaved1F1B \
    --pp-virtual-stages 2 --pp-microbatches 16 --trace "$T/plan.pftrace"
echo "ok: $n_checked runs clean under AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer"
