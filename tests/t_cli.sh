#!/usr/bin/env bash
# Bad input: every case exits with status 2 and prints exactly one line naming the problem, and a
# failed run overwrites nothing.
set -u
TRAIN="$BUILD/train"
T="$TEST_TMP"
failures=0
AS_USER=""  # a command prefix that runs train as another user (the read-only directory case below)
expect_error() {  # expected-substring, args...
    local want=$1; shift
    local err rc
    err=$($AS_USER "$TRAIN" "$@" 2>&1 >/dev/null); rc=$?
    local lines; lines=$(printf '%s\n' "$err" | grep -c .)
    if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || [[ "$err" != *"$want"* ]]; then
        echo "FAIL: train $* -> exit $rc, $lines line(s): $err (wanted exit 2, one line with '$want')"
        failures=$((failures + 1))
    else
        echo "ok: train $* -> $err"
    fi
}
expect_error "unknown flag" --no-such-flag
# A flag's value left out: the next flag is not taken as the value (a dump named "--lr" was written,
# and `--checkpoint-dir --steps 1` said "1: unexpected argument"); --flag=VALUE still takes anything.
expect_error "--dump: needs a value, and the next argument --lr is a flag (a value that starts with --: --dump=VALUE)" \
    --model tiny --steps 1 --batch 2 --dump --lr 1e-3
expect_error "--checkpoint-dir: needs a value, and the next argument --steps is a flag" --model tiny --batch 2 \
    --checkpoint-dir --steps 1
[ ! -e ./--lr ] || { echo "FAIL: a file named --lr was written"; failures=$((failures + 1)); }
# A message quoting the user's input stays one line (a newline in it is written as \n), and a
# directory too long to hold its files' names is refused, not cut short to another path.
expect_error "data source 'text:a\\nb': a\\nb: cannot open" --model tiny --steps 1 --data "text:a
b"
# A --data file too large to load is refused by the memory plan (each rank reads it whole, twice its
# size while loading), not met by "read failed" after the model is built.
truncate -s 8T "$T/sparse.txt"  # sparse: no disk used; 16 TiB planned, beyond any machine
expect_error "with its --data file: needs at least" --model tiny --steps 1 --data "text:$T/sparse.txt"
rm -f "$T/sparse.txt"
expect_error "path too long" --steps 1 --init-from "hf:/tmp/$(printf 'a%.0s' $(seq 1 4090))"
# Standard output that cannot be written (a full disk): status 1 and one line, not 0 with the report lost;
# a refusal keeps its status 2 and its own line.
err=$("$TRAIN" --model tiny --model-info 2>&1 >/dev/full); rc=$?
if [ "$rc" -eq 1 ] && [ "$(printf '%s\n' "$err" | grep -c .)" -eq 1 ] && [[ "$err" == *"standard output: write error"* ]]; then
    echo "ok: --model-info into /dev/full -> $err"
else
    echo "FAIL: --model-info into /dev/full -> exit $rc: $err (wanted 1 and one line)"; failures=$((failures + 1))
fi
err=$("$TRAIN" --no-such-flag 2>&1 >/dev/full); rc=$?
[ "$rc" -eq 2 ] && [ "$(printf '%s\n' "$err" | grep -c .)" -eq 1 ] ||
    { echo "FAIL: a refusal with stdout on /dev/full -> exit $rc: $err (wanted 2 and its one line)"; failures=$((failures + 1)); }
expect_error "--steps abc: not an integer" --steps abc
expect_error "--steps 0: must be at least 1" --steps 0
expect_error "--comm-timeout 1e10: must be between 0.1 and 1e+09" --comm-timeout 1e10
# a flag that means something only with another one, without it
expect_error "--export-hf-shard-mb: needs --export-hf" --export-hf-shard-mb 1
expect_error "--compare-rtol: needs --compare" --compare-rtol 0.1
expect_error "--desync-init: needs --dp-replicate 2 or more" --desync-init
expect_error "--model-info: prints the model and exits; --trace would be ignored" --model-info --trace "$T/x.pftrace"
expect_error "--seq-len 0: must be at least 1" --seq-len 0
expect_error "--batch -3: must be at least 1" --batch -3
expect_error "--lr nan: not a finite number" --lr nan
expect_error "--lr 1e-400: too small for a double" --lr 1e-400
expect_error "--seed 99999999999999999999: out of range for a 64-bit integer" --seed 99999999999999999999
expect_error "--model gpt5: must be one of" --model gpt5
expect_error "--attention" --attention slow
expect_error "--steps: needs a value" --steps
expect_error "unexpected argument" stray
expect_error "--warmup-steps 30: must not exceed --steps 20" --warmup-steps 30
expect_error "needs --checkpoint-dir" --checkpoint-every 5
expect_error "--min-lr-ratio: needs a decaying --lr-decay" --lr-decay constant --min-lr-ratio 0.5
expect_error "--min-lr-ratio: --warmup-steps 4 takes all 4 steps, so no step decays" --steps 4 --warmup-steps 4 --min-lr-ratio 0.5
expect_error "--lr-decay: --warmup-steps 4 takes all 4 steps, so no step decays" --steps 4 --warmup-steps 4 --lr-decay linear
expect_error "markov" --data "markov:order=0"
expect_error "no options after the colon" --data "markov:"
expect_error "nofile.txt" --data text:"$T/nofile.txt"
expect_error "does not exist" --trace "$T/no/such/dir/x.pftrace"

# Outputs are checked before step 1 (a probe file is created and removed where each will go): a
# directory where a file is needed, /proc, a regular file where a directory is needed, an empty
# name, a name longer than NAME_MAX, a missing parent, a read-only directory.
mkdir -p "$T/outdir" "$T/readonly"
touch "$T/regular"
long=$(printf 'n%.0s' $(seq 1 250))
expect_error "--trace $T/outdir: is a directory" --trace "$T/outdir"
expect_error "--trace-json $T/outdir: is a directory" --trace-json "$T/outdir"
expect_error "--dump $T/outdir/: is a directory" --dump "$T/outdir/"
expect_error "--grad-dump $T/outdir: is a directory" --grad-dump "$T/outdir"
expect_error "--mesh-dot /proc/llama.dot: cannot create a file there" --mesh-dot /proc/llama.dot
expect_error "--trace /proc/llama.pftrace: cannot create a file there" --trace /proc/llama.pftrace
expect_error "--checkpoint-dir /proc: cannot create files in this directory" --checkpoint-dir /proc
expect_error "--checkpoint-dir $T/regular: exists and is not a directory" --checkpoint-dir "$T/regular"
expect_error "--trace-hta $T/regular: exists and is not a directory" --trace-hta "$T/regular"
expect_error "--trace-hta $T/none/hta: directory $T/none does not exist" --trace-hta "$T/none/hta"
expect_error "--trace: empty path" --trace ""
expect_error "--checkpoint-dir: empty path" --checkpoint-dir ""
expect_error "a name is longer than NAME_MAX" --trace "$T/$long"  # 250 bytes, but its temporary has 260+
expect_error "a name is longer than NAME_MAX" --checkpoint-dir "$T/${long}nnnnnnnnnn"
expect_error "--pp-schedule-dot $T/outdir: is a directory" --pp 2 --pp-schedule-dot "$T/outdir"
# A directory the user may not write to. Root writes anywhere, so as root the case runs as the user
# nobody (setpriv, util-linux) on a copy of train in a directory of its own that nobody can reach
# (the checkout and TEST_TMP may not be).
readonly_dir=$T/readonly TRAIN_ORIG=$TRAIN
if [ "$(id -u)" -eq 0 ]; then
    as_nobody=$(mktemp -d "${TMPDIR:-/tmp}/llama-as-nobody.XXXXXX")
    chmod 755 "$as_nobody" && cp "$TRAIN" "$as_nobody/train" && mkdir "$as_nobody/readonly"
    readonly_dir=$as_nobody/readonly TRAIN=$as_nobody/train
    AS_USER="setpriv --reuid=65534 --regid=65534 --clear-groups"
fi
chmod 555 "$readonly_dir"
expect_error "--trace $readonly_dir/x.pftrace: cannot create a file there (Permission denied)" \
    --trace "$readonly_dir/x.pftrace"
AS_USER="" TRAIN=$TRAIN_ORIG
[ "$(id -u)" -ne 0 ] || rm -rf "$as_nobody"

# Device nodes and FIFOs are never replaced: refused before training (a rename would turn them
# into regular files; as root, --trace /dev/null would destroy /dev/null). Leave a flag out to
# discard its output.
mkfifo "$T/fifo"
expect_error "--trace $T/fifo: is a FIFO" --trace "$T/fifo"
expect_error "--dump $T/fifo: is a FIFO" --dump "$T/fifo"
expect_error "--trace /dev/null: is a device" --trace /dev/null
expect_error "--dump /dev/full: is a device" --dump /dev/full
expect_error "--trace-json /dev/null: is a device" --trace-json /dev/null
[ -p "$T/fifo" ] || { echo "FAIL: $T/fifo is no longer a FIFO"; failures=$((failures + 1)); }
# A symbolic link is not replaced either (the rename would put a file in its place, the target untouched).
echo keep > "$T/link_target"
ln -sfn "$T/link_target" "$T/link"
expect_error "--trace-json $T/link: is a symbolic link" --trace-json "$T/link"
[ -L "$T/link" ] && [ "$(cat "$T/link_target")" = keep ] || { echo "FAIL: the link or its target changed"; failures=$((failures + 1)); }
# A checkpoint directory is one run's: another run's checkpoints there are refused unless this run
# resumes from them (they would be overwritten, and a later --resume could continue the wrong run),
# and so is a directory another live run holds (its lock, DIR/.lock, goes when that process ends).
mkdir -p "$T/other_run"
"$TRAIN" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/other_run" > /dev/null
sum_other=$(sha256sum "$T/other_run/step_000002.safetensors")
expect_error "--checkpoint-dir $T/other_run: holds another run's checkpoints (step_000002.safetensors); --resume" \
    --model tiny --steps 2 --batch 2 --seed 9 --checkpoint-dir "$T/other_run"
[ "$(sha256sum "$T/other_run/step_000002.safetensors")" = "$sum_other" ] ||
    { echo "FAIL: the other run's checkpoint changed"; failures=$((failures + 1)); }
"$TRAIN" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/other_run" --resume "$T/other_run" > /dev/null ||
    { echo "FAIL: resuming into the directory resumed from"; failures=$((failures + 1)); }
# ... but not from an earlier checkpoint of it: the run would replace the later ones with another
# continuation (step_000004 was replaced by an --lr 1e-2 branch, exit 0).
"$TRAIN" --model tiny --steps 4 --batch 2 --checkpoint-every 2 --checkpoint-dir "$T/branch" > /dev/null
sum_later=$(sha256sum "$T/branch/step_000004.safetensors")
expect_error "--checkpoint-dir $T/branch: holds step_000004.safetensors, later than the step_000002.safetensors resumed from" \
    --model tiny --steps 4 --batch 2 --lr 1e-2 --resume "$T/branch/step_000002.safetensors" --checkpoint-dir "$T/branch"
[ "$(sha256sum "$T/branch/step_000004.safetensors")" = "$sum_later" ] ||
    { echo "FAIL: the later checkpoint changed"; failures=$((failures + 1)); }
# ... and that before any work: the checkpoint is not loaded first (on a large model, minutes).
if "$TRAIN" --model tiny --steps 4 --batch 2 --lr 1e-2 --resume "$T/branch/step_000002.safetensors" \
        --checkpoint-dir "$T/branch" 2>/dev/null | grep -q "resumed from"; then
    echo "FAIL: the checkpoint was loaded before the directory was refused"; failures=$((failures + 1))
else
    echo "ok: the directory is refused before the checkpoint is loaded"
fi
# ... nor from a renamed copy of one: its recorded step counts, not its name (it was taken as a
# step unknown and the later checkpoints replaced).
cp "$T/branch/step_000002.safetensors" "$T/branch/keep2.safetensors"
expect_error "--checkpoint-dir $T/branch: holds step_000004.safetensors, later than the keep2.safetensors resumed from" \
    --model tiny --steps 4 --batch 2 --lr 1e-2 --resume "$T/branch/keep2.safetensors" --checkpoint-dir "$T/branch"
[ "$(sha256sum "$T/branch/step_000004.safetensors")" = "$sum_later" ] ||
    { echo "FAIL: the later checkpoint changed (renamed copy resumed)"; failures=$((failures + 1)); }
# The lock file is written (the holder's pid): never through a link, never into a FIFO. A link to the
# training text truncated it to the pid.
mkdir -p "$T/lock_link" "$T/lock_fifo"
for i in $(seq 300); do echo "precious line $i of the training text"; done >"$T/lock_target"
sum_target=$(sha256sum <"$T/lock_target")
ln -s "$T/lock_target" "$T/lock_link/.lock"
expect_error "--checkpoint-dir $T/lock_link: $T/lock_link/.lock is a symbolic link" --model tiny --steps 2 --batch 2 \
    --data "text:$T/lock_target" --checkpoint-dir "$T/lock_link"
[ "$(sha256sum <"$T/lock_target")" = "$sum_target" ] || { echo "FAIL: the file behind .lock was written"; failures=$((failures + 1)); }
mkfifo "$T/lock_fifo/.lock"
expect_error "--checkpoint-dir $T/lock_fifo: $T/lock_fifo/.lock is not a regular file" --model tiny --steps 2 --batch 2 \
    --checkpoint-dir "$T/lock_fifo"
mkdir -p "$T/held"
# -o: flock itself holds the lock while its command (a sleep that records its pid) runs
flock -o "$T/held/.lock" sh -c 'echo $$ > "$0"; exec sleep 60' "$T/held.sleep_pid" > /dev/null 2>&1 &
holder=$!
# the sleep writes its pid only once flock holds the lock: wait for that, not for a fixed time
for _ in $(seq 600); do [ -s "$T/held.sleep_pid" ] && break; sleep 0.1; done
expect_error "--checkpoint-dir $T/held: in use by another run" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/held"
kill "$(cat "$T/held.sleep_pid")" "$holder" 2>/dev/null; wait "$holder" 2>/dev/null || true
"$TRAIN" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/held" > /dev/null ||
    { echo "FAIL: the directory stays locked after its holder ended"; failures=$((failures + 1)); }
# A link to nothing as an output directory: refused before training (mkdir on it failed after it).
ln -sfn "$T/no_such_target" "$T/dangling"
for flag in checkpoint-dir export-hf trace-hta; do
    expect_error "--$flag $T/dangling: a symbolic link whose target does not exist" --"$flag" "$T/dangling"
done
# A new output directory named with a trailing slash is made like one without it.
"$TRAIN" --model tiny --steps 1 --batch 2 --checkpoint-dir "$T/slash_ck/" --trace-hta "$T/slash_hta/" \
    --export-hf "$T/slash_hf/" > "$T/slash.log" 2>&1 &&
    [ -f "$T/slash_ck/step_000001.safetensors" ] && [ -f "$T/slash_hta/rank0.json" ] && [ -f "$T/slash_hf/config.json" ] ||
    { cat "$T/slash.log"; echo "FAIL: output directories named dir/"; failures=$((failures + 1)); }
# Nor a file without write permission (a rename replaces it whoever runs it: root included).
echo keep > "$T/read_only" && chmod 444 "$T/read_only"
expect_error "--grad-dump $T/read_only: is read-only" --grad-dump "$T/read_only"
[ "$(cat "$T/read_only")" = keep ] || { echo "FAIL: the read-only file changed"; failures=$((failures + 1)); }
# A FIFO given as an input is refused at once, not waited on (each under a timeout: a hang is a failure).
"$TRAIN" --model tiny --steps 1 --batch 2 --export-hf "$T/fifo_hf" > /dev/null && rm "$T/fifo_hf/model.safetensors" &&
    mkfifo "$T/fifo_hf/model.safetensors" || { echo "FAIL: could not prepare an export with a FIFO"; failures=$((failures + 1)); }
for flag in "--data text:$T/fifo" "--data tokens:$T/fifo" "--resume $T/fifo" "--compare $T/fifo" \
    "--init-from hf:$T/fifo_hf --steps 1 --batch 2"; do
    err=$(timeout 60 "$TRAIN" $flag 2>&1 >/dev/null); rc=$?
    [ "$rc" -eq 2 ] && [[ "$err" == *"is not a regular file"* ]] && [ "$(grep -c . <<<"$err")" -eq 1 ] ||
        { echo "FAIL: train $flag -> exit $rc: $err"; failures=$((failures + 1)); }
done
echo "ok: a FIFO as --data text:, --data tokens:, --resume, --compare or an --init-from file is refused at once"

# An output may not be one of the run's inputs, nor another output: refused before training.
printf 'some training text, kept as it is. %.0s' $(seq 20) > "$T/corpus.txt"
cp "$T/corpus.txt" "$T/corpus.orig"
expect_error "--trace $T/corpus.txt: is the file --data reads" --data "text:$T/corpus.txt" --trace "$T/corpus.txt"
cmp -s "$T/corpus.txt" "$T/corpus.orig" || { echo "FAIL: the training text was overwritten"; failures=$((failures + 1)); }
expect_error "the same file; one of the two outputs would be lost" --trace "$T/same.out" --trace-json "$T/./same.out"
expect_error "the same file; one of the two outputs would be lost" --dump "$T/d.st" --grad-dump "$T/d.st"
echo keep > "$T/link_a" && ln -f "$T/link_a" "$T/link_b"  # two names of one file
expect_error "--trace $T/link_a and --trace-json $T/link_b: the same file" --trace "$T/link_a" --trace-json "$T/link_b"
[ "$(cat "$T/link_a")" = keep ] || { echo "FAIL: a hard-linked output was written"; failures=$((failures + 1)); }
# nor a file that a directory output writes, nor the directory itself
mkdir -p "$T/ck2" "$T/ex2" "$T/hta2"
expect_error "--trace $T/ck2/step_000001.safetensors: the run writes that into --checkpoint-dir $T/ck2" \
    --trace "$T/ck2/step_000001.safetensors" --checkpoint-dir "$T/ck2"
expect_error "--trace $T/ex2/config.json: the run writes that into --export-hf $T/ex2" \
    --trace "$T/ex2/config.json" --export-hf "$T/ex2"
expect_error "--dump $T/ex2/model.safetensors: the run writes that into --export-hf $T/ex2" \
    --dump "$T/ex2/model.safetensors" --export-hf "$T/ex2"
expect_error "--trace-json $T/hta2/rank0.json: the run writes that into --trace-hta $T/hta2" \
    --trace-json "$T/hta2/rank0.json" --trace-hta "$T/hta2"
expect_error "--grad-dump $T/gx: the run writes that into --export-hf $T/gx" --grad-dump "$T/gx" --export-hf "$T/gx"
# ... nor a directory output that is a name another one writes: the second failed after the training
# (the export found a directory where its model.safetensors goes; the traces were lost).
expect_error "--checkpoint-dir $T/ex2/model.safetensors: the run writes that into --export-hf $T/ex2" \
    --export-hf "$T/ex2" --checkpoint-dir "$T/ex2/model.safetensors"
expect_error "--trace-hta $T/ck2/step_000001.safetensors: the run writes that into --checkpoint-dir $T/ck2" \
    --checkpoint-dir "$T/ck2" --trace-hta "$T/ck2/step_000001.safetensors"
expect_error "--export-hf $T/hta2/rank0.json: the run writes that into --trace-hta $T/hta2" \
    --trace-hta "$T/hta2" --export-hf "$T/hta2/rank0.json"
# ... nor the checkpoint directory's lock file (the trace replaced it)
expect_error "--trace $T/ck2/.lock: the run writes that into --checkpoint-dir $T/ck2" \
    --checkpoint-dir "$T/ck2" --trace "$T/ck2/.lock"
for made in "$T/ex2/model.safetensors" "$T/ck2/step_000001.safetensors" "$T/hta2/rank0.json" "$T/ck2/.lock"; do
    [ ! -e "$made" ] || { echo "FAIL: a refused run made $made"; failures=$((failures + 1)); }
done
# An entry the run will write into an output directory, but that is not a regular file.
mkdir -p "$T/ckd/step_000001.safetensors" "$T/exd/config.json"
expect_error "--checkpoint-dir $T/ckd: $T/ckd/step_000001.safetensors is a directory; the run would write it" \
    --checkpoint-dir "$T/ckd"
expect_error "--export-hf $T/exd/config.json: is a directory" --export-hf "$T/exd"
[ ! -e "$T/exd/model.safetensors" ] || { echo "FAIL: --export-hf wrote before refusing"; failures=$((failures + 1)); }
# scripts/make_token_file.py checks its output the same way, before reading its input.
cp "$T/corpus.txt" "$T/corpus.kept"
echo precious > "$T/readonly.tok" && chmod 444 "$T/readonly.tok"
for out in "$T/fifo" "$T/link" "$T/outdir" "$T/none/x.tok" "$T/corpus.txt" "$T/readonly.tok"; do
    err=$("$PYTHON" scripts/make_token_file.py --text "$T/corpus.txt" "$out" 2>&1 >/dev/null); rc=$?
    [ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] ||
        { echo "FAIL: make_token_file.py to $out -> exit $rc: $err"; failures=$((failures + 1)); }
done
[ -p "$T/fifo" ] && [ -L "$T/link" ] || { echo "FAIL: make_token_file.py replaced a FIFO or a link"; failures=$((failures + 1)); }
cmp -s "$T/corpus.txt" "$T/corpus.kept" && [ "$(cat "$T/readonly.tok")" = precious ] ||
    { echo "FAIL: make_token_file.py replaced its input or a read-only file"; failures=$((failures + 1)); }
echo "ok: make_token_file.py refuses a FIFO, a link, a directory, a missing directory, its input and a read-only file as its output"
# ... a --vocab-size below 1, an input of fewer than 2 tokens, and a write that fails (a file-size
# limit of 1 KiB standing in for a full disk: one line, exit 2, no partial file left behind).
printf 'x' > "$T/one_token.txt"
for args in "--ids $T/one_token.txt --vocab-size 0" "--text $T/one_token.txt"; do
    # shellcheck disable=SC2086
    err=$("$PYTHON" scripts/make_token_file.py $args "$T/small.tok" 2>&1 >/dev/null); rc=$?
    [ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] && [ ! -e "$T/small.tok" ] ||
        { echo "FAIL: make_token_file.py $args -> exit $rc: $err"; failures=$((failures + 1)); }
done
head -c 5000 /dev/zero | tr '\0' a > "$T/five_kb.txt"
err=$( (trap '' XFSZ; ulimit -f 1; "$PYTHON" scripts/make_token_file.py --text "$T/five_kb.txt" "$T/big.tok") 2>&1 >/dev/null); rc=$?
leftover=$(ls "$T" | grep -c '^big\.tok' || true)
[ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] && [ "$leftover" -eq 0 ] ||
    { echo "FAIL: make_token_file.py past a file-size limit -> exit $rc, $leftover file(s) left: $err"; failures=$((failures + 1)); }
echo "ok: make_token_file.py refuses --vocab-size 0 and a 1-token input, and a failed write leaves nothing: $err"
# ... and its own arguments and inputs the same way: argparse's errors on one line (not usage and
# error on four), an option given twice refused (the last would silently win), and an input that is
# not a regular file refused before it is read: a FIFO would block for a writer, /dev/zero would be
# read without end. Under a time limit, so that a regression fails here instead of hanging the suite.
token_file_refuses() {  # what-it-says args...
    local want=$1 err rc; shift
    err=$(timeout 20 "$PYTHON" scripts/make_token_file.py "$@" 2>&1 >/dev/null); rc=$?
    [ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] && [[ "$err" == *"$want"* ]] && [ ! -e "$T/refused.tok" ] ||
        { echo "FAIL: make_token_file.py $* -> exit $rc: $err (wanted exit 2, one line with '$want')"; failures=$((failures + 1)); }
    rm -f "$T/refused.tok"  # written by a run that should have been refused: not the next check's
}
token_file_refuses "--width: invalid choice: 3" --width 3 --text "$T/corpus.txt" "$T/refused.tok"
token_file_refuses "--width given twice" --width 2 --width 4 --text "$T/corpus.txt" "$T/refused.tok"
token_file_refuses "--text given twice" --text "$T/corpus.txt" --text "$T/corpus.txt" "$T/refused.tok"
token_file_refuses "$T/fifo: is a FIFO" --text "$T/fifo" "$T/refused.tok"
token_file_refuses "$T/fifo: is a FIFO" --ids "$T/fifo" "$T/refused.tok"
token_file_refuses "/dev/zero: is a device" --text /dev/zero "$T/refused.tok"
token_file_refuses "$T: is a directory" --ids "$T" "$T/refused.tok"
echo "ok: make_token_file.py refuses a bad --width, an option given twice, a FIFO, a device and a directory as its input"
# scripts/bench_plan.sh (make bench): an argument or a bad setting is refused before any run; a
# setting that the trainer refuses (a batch that 4 pipeline microbatches do not divide) comes back as
# the trainer's own line, not the end of mpirun's notice (3 tiny runs of 3 steps: seconds).
bench_plan_refuses() {  # what-it-says command...
    local want=$1 err rc; shift
    err=$(BUILD="$BUILD" timeout 120 "$@" 2>&1 >/dev/null); rc=$?
    [ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] && [[ "$err" == *"$want"* ]] ||
        { echo "FAIL: $* -> exit $rc: $err (wanted exit 2, one line with '$want')"; failures=$((failures + 1)); }
}
bench_plan_refuses "unexpected argument '--bogus'" scripts/bench_plan.sh --bogus
bench_plan_refuses "PLAN_STEPS=2: must be at least 3" env PLAN_STEPS=2 scripts/bench_plan.sh
bench_plan_refuses "PLAN_MODEL=nope PLAN_SEQ=128: train: --model nope: must be one of" env PLAN_MODEL=nope scripts/bench_plan.sh
bench_plan_refuses "PLAN_ROUNDS=0: must be a positive integer" env PLAN_ROUNDS=0 scripts/bench_plan.sh
bench_plan_refuses "PLAN_BATCH=abc: must be a positive integer" env PLAN_BATCH=abc scripts/bench_plan.sh
bench_plan_refuses "PLAN_BATCH=3: must be even" env PLAN_BATCH=3 scripts/bench_plan.sh
bench_plan_refuses "PP 1F1B (2 ranks, batch 2): train: --batch 2: must be divisible" \
    env PLAN_MODEL=tiny PLAN_SEQ=32 PLAN_BATCH=2 PLAN_STEPS=3 PLAN_ROUNDS=1 MPIRUN="${MPIRUN:-mpirun --oversubscribe}" scripts/bench_plan.sh
echo "ok: bench_plan.sh refuses an argument, too few steps, an unknown model, 0 rounds, a batch that is not an even number, and passes on the trainer's refusal"
# A switch takes no value; --compare runs alone.
expect_error "--model-info=yes: a switch takes no value" --model-info=yes
expect_error "--compare: checks a dump and exits; --trace would be ignored" --compare "$T/x.st" --trace "$T/t.pftrace"
[ -c /dev/null ] && [ -z "$(head -c 1 /dev/null)" ] || { echo "FAIL: /dev/null is not an empty character device"; failures=$((failures + 1)); }
if [ "$(id -u)" -eq 0 ] && mknod "$T/scratch_null" c 1 3 2>/dev/null; then  # a device of our own
    expect_error "--trace $T/scratch_null: is a device" --trace "$T/scratch_null"
    [ -c "$T/scratch_null" ] || { echo "FAIL: the scratch device was replaced"; failures=$((failures + 1)); }
else
    echo "SKIP (part): a scratch character device (mknod needs root)"
fi

# Sizes: checked 64-bit arithmetic, then the planned memory against the machine's (both named).
expect_error "--batch 2000000000 x --seq-len 32: 64000000000 tokens per step, more than 2^31 - 1" --batch 2000000000
expect_error "--seq-len 2147483647: 17179869176 tokens per step" --seq-len 2147483647
expect_error "GiB of physical memory" --n-layers 100000
expect_error "GiB of physical memory" --batch 60000000
# Replicas hold whole copies: 100,000 DDP ranks of 20,000 layers need 513 GiB each (the check divided
# everything by the rank count and let it through); and the processes mpirun starts on this machine
# share its memory.
expect_error "needs at least 513.4 GiB per process" --model small --n-layers 20000 --dp-replicate 100000 \
    --batch 100000 --seq-len 16
err=$(OMPI_COMM_WORLD_LOCAL_SIZE=100000 "$TRAIN" --model small --steps 1 2>&1 >/dev/null); rc=$?
[ "$rc" = 2 ] && [[ "$err" == *"GiB for the 100000 processes on this machine"* ]] ||
    { echo "FAIL: 100000 local processes of small -> exit $rc: $err"; failures=$((failures + 1)); }
expect_error "--zero-stage 2: shards over --dp-shard, which is 1 here" --zero-stage 2
expect_error "--resume $T/missing.safetensors" --resume "$T/missing.safetensors"
expect_error "--bucket-mb 0: must be between" --bucket-mb 0
expect_error "--bucket-mb x: not a number" --bucket-mb x
expect_error "--lr 1e-3x: not a number" --lr 1e-3x
expect_error "--lr inf: not a finite number" --lr inf
expect_error "--grad-accum-steps 0: must be at least 1" --grad-accum-steps 0
# Refused rather than silently resolved: a flag given twice (the last one used to win), blanks
# around a number (' 2' used to pass while '2 ' failed), a data option given twice.
expect_error "--steps: given twice" --steps 2 --steps 3
expect_error "--lr: given twice" --lr 1e-3 --lr=2e-3
expect_error "--steps ' 2': blanks around the number" --steps ' 2'
expect_error "--steps '2 ': blanks around the number" --steps '2 '
expect_error "--lr ' 1e-3': blanks around the number" --lr ' 1e-3'
expect_error "option 'order' is given twice" --data markov:order=1,order=2

# A checkpoint that is truncated, or from another run, is refused; the good one is not touched.
"$TRAIN" --model tiny --steps 2 --batch 2 --checkpoint-dir "$T/ck" >/dev/null || { echo "FAIL: training run"; exit 1; }
good="$T/ck/step_000002.safetensors"
sum_before=$(sha256sum "$good" | cut -d' ' -f1)
head -c 5000 "$good" > "$T/truncated.safetensors"
expect_error "truncated.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/truncated.safetensors"
# ... before any output is written: the diagrams are written once the inputs (data, --resume) are checked
echo keep > "$T/keep.dot"
expect_error "truncated.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/truncated.safetensors" \
    --mesh-dot "$T/keep.dot"
expect_error "data source 'text:$T/no-such-text'" --model tiny --steps 2 --data "text:$T/no-such-text" \
    --mesh-dot "$T/keep.dot"
[ "$(cat "$T/keep.dot")" = keep ] || { echo "FAIL: --mesh-dot was written before the bad input was refused"; failures=$((failures + 1)); }
# ... and the output directories a refused run names are not made
expect_error "data source 'text:$T/no-such-text'" --model tiny --steps 2 --data "text:$T/no-such-text" \
    --checkpoint-dir "$T/new-ck" --trace-hta "$T/new-hta" --export-hf "$T/new-hf"
expect_error "truncated.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/truncated.safetensors" \
    --checkpoint-dir "$T/new-ck"
for d in new-ck new-hta new-hf; do
    [ ! -e "$T/$d" ] || { echo "FAIL: a refused run made its output directory $T/$d"; failures=$((failures + 1)); }
done
# one flipped bit in the tensor data: the hash the checkpoint records no longer matches
"$PYTHON" - "$good" "$T/flipped.safetensors" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
b[8 + struct.unpack("<Q", b[:8])[0] + 1000] ^= 1
open(sys.argv[2], "wb").write(b)
PY
expect_error "flipped.safetensors: the tensor data does not match the hash its writer recorded" --model tiny --steps 2 \
    --batch 2 --resume "$T/flipped.safetensors" --mesh-dot "$T/keep.dot"
# the same for delayed FP8 scaling's companion file (step_N.safetensors.fp8: the amax history)
fp8=(--model tiny --steps 4 --batch 2 --fp8 --fp8-recipe delayed)
"$TRAIN" "${fp8[@]}" --checkpoint-every 2 --checkpoint-dir "$T/ck8" >/dev/null || { echo "FAIL: FP8 run"; exit 1; }
"$PYTHON" - "$T/ck8/step_000002.safetensors.fp8" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
b[8 + struct.unpack("<Q", b[:8])[0] + 4] ^= 1
open(sys.argv[1], "wb").write(b)
PY
expect_error "step_000002.safetensors.fp8: the tensor data does not match the hash" "${fp8[@]}" \
    --resume "$T/ck8/step_000002.safetensors" --mesh-dot "$T/keep.dot"
# the damaged data is found before any output is written, as the truncated file above
[ "$(cat "$T/keep.dot")" = keep ] || { echo "FAIL: --mesh-dot was written before a damaged --resume was refused"; failures=$((failures + 1)); }
# Refusals that need the whole layout come before any output too: a history of another length (the
# FP8 state is read after the model is built), a --tp that does not divide the model, sequence
# parallelism over tokens that do not divide by --tp (both refused once the layout was built, after
# the diagram was written and the checkpoint directory made and locked).
expect_error "FP8 state written with amax_history=1024 blocks=4 margin=0 dp=1, this run has amax_history=8" \
    "${fp8[@]}" --fp8-amax-history 8 --resume "$T/ck8/step_000004.safetensors" --mesh-dot "$T/keep.dot" \
    --checkpoint-dir "$T/new-ck"
expect_error "--tp 3: must divide n_heads 8" --model tiny --steps 2 --tp 3 --mesh-dot "$T/keep.dot" \
    --checkpoint-dir "$T/new-ck"
expect_error "--sequence-parallel: the 33 tokens of a micro-batch must divide by --tp 2" --model tiny --steps 2 \
    --batch 1 --seq-len 33 --tp 2 --sequence-parallel --mesh-dot "$T/keep.dot" --checkpoint-dir "$T/new-ck"
[ "$(cat "$T/keep.dot")" = keep ] && [ ! -e "$T/new-ck" ] ||
    { echo "FAIL: a run refused for its layout wrote --mesh-dot or made --checkpoint-dir"; failures=$((failures + 1)); }
printf 'garbage that is not a safetensors file at all' > "$T/garbage.safetensors"
expect_error "garbage.safetensors" --model tiny --steps 2 --batch 2 --resume "$T/garbage.safetensors"
expect_error "written with --seed 1234, this run has 7 (resume needs the same run settings)" --model tiny --steps 2 \
    --batch 2 --seed 7 --resume "$good"
expect_error "written with --batch 2, this run has 4 (resume needs the same run settings)" --model tiny --steps 2 \
    --batch 4 --resume "$good"
expect_error "written with --seq-len 32, this run has 16 (resume needs the same run settings)" --model tiny --steps 2 \
    --batch 2 --seq-len 16 --resume "$good"
expect_error "written with --steps 2, this run has 3 (resume needs the same run settings)" --model tiny --steps 3 \
    --batch 2 --resume "$good"
expect_error "different shape" --model small --steps 2 --batch 2 --resume "$good"
expect_error "no checkpoint in this directory (the trainer writes step_NNNNNN.safetensors)" --model tiny --steps 2 \
    --batch 2 --resume "$T"
expect_error "--resume: empty path" --model tiny --steps 2 --batch 2 --resume ''
expect_error "truncated.safetensors" --compare "$T/truncated.safetensors"
# a shape mismatch names the first config field that differs
expect_error "first difference, this run vs the checkpoint: n_layers 2 vs 4" --model tiny --n-layers 2 --steps 2 \
    --batch 2 --resume "$good"
# a step that overflows long long, or lies beyond the run's total steps, is refused before any work
# with_meta: a copy of the good checkpoint whose metadata says key = value, without its metadata hash
# (as a checkpoint written before metadata hashes: the value checks are what refuses it);
# with_meta_hashed keeps the hash, which the edit no longer matches.
with_meta() {  # key, value, output
    edit_meta "$@" drop
}
with_meta_hashed() {  # key, value, output
    edit_meta "$@" keep
}
edit_meta() {  # key, value, output, drop|keep
    "${PYTHON:-python3}" - "$good" "$1" "$2" "$3" "$4" <<'PY'
import json, struct, sys
src, key, value, out, hash_kept = sys.argv[1:]
data = open(src, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
header["__metadata__"][key] = value
if hash_kept == "drop":
    del header["__metadata__"]["metadata_hash"]
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(out, "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
PY
}
# with_state: a copy without either hash in which one element of a state tensor is value
with_state() {  # tensor, value, output
    "${PYTHON:-python3}" - "$good" "$1" "$2" "$3" <<'PY'
import sys
sys.path.insert(0, "tests/py")
import numpy as np
import safetensors_io as st
src, name, value, out = sys.argv[1:]
tensors, meta = st.load(src)
tensors[name].flat[3] = np.float32(value)
del meta["data_hash"], meta["metadata_hash"]
st.save(out, tensors, meta)
PY
}
# The data a checkpoint was trained on is what a resume compares, not the spec's spelling: the same
# file as ./corpus.txt or the default chain spelled out resume; a changed file is other data (it
# resumed without a word, and the spelling refused).
cp "$T/corpus.txt" "$T/data_corpus.txt"
"$TRAIN" --model tiny --steps 4 --batch 2 --seq-len 16 --checkpoint-every 2 --data "text:$T/data_corpus.txt" \
    --checkpoint-dir "$T/ck_text" > /dev/null
"$TRAIN" --model tiny --steps 4 --batch 2 --seq-len 16 --data "text:$T/./data_corpus.txt" \
    --resume "$T/ck_text/step_000002.safetensors" > "$T/respelled.log" 2>&1 &&
    "$TRAIN" --model tiny --steps 2 --batch 2 --data markov:order=1,branches=4 \
    --resume "$T/ck/step_000002.safetensors" >> "$T/respelled.log" 2>&1 ||
    { cat "$T/respelled.log"; echo "FAIL: the same data spelled otherwise"; failures=$((failures + 1)); }
# ... and the same tokens in a token file, at 2 or 4 bytes a token (its width was part of the identity)
for width in 2 4; do
    "$PYTHON" scripts/make_token_file.py --text "$T/data_corpus.txt" --width $width "$T/corpus$width.tok" > /dev/null
    "$TRAIN" --model tiny --steps 4 --batch 2 --seq-len 16 --data "tokens:$T/corpus$width.tok" \
        --resume "$T/ck_text/step_000002.safetensors" > "$T/as_tokens.log" 2>&1 ||
        { cat "$T/as_tokens.log"; echo "FAIL: the same text as a $width-byte token file"; failures=$((failures + 1)); }
done
echo "changed" >> "$T/data_corpus.txt"
expect_error "this run's --data text:$T/data_corpus.txt is other data" --model tiny --steps 4 --batch 2 --seq-len 16 \
    --data "text:$T/data_corpus.txt" --resume "$T/ck_text/step_000002.safetensors"
expect_error "is other data (markov:order=2,branches=4,table=0)" --model tiny --steps 2 --batch 2 --data markov:order=2 \
    --resume "$T/ck/step_000002.safetensors"
# the recorded step changed to one the run could be at (2 -> 1, as one flipped bit of "3" would):
# the metadata hash
with_meta_hashed step 1 "$T/step_flipped.safetensors"
expect_error "the metadata does not match the hash its writer recorded" --model tiny --steps 2 --batch 2 \
    --resume "$T/step_flipped.safetensors" --mesh-dot "$T/keep.dot"
# a NaN weight or a negative second moment, in a file without hashes: refused naming the element
with_state param.layers.0.attention.wq.weight nan "$T/nan_weight.safetensors"
expect_error "param.layers.0.attention.wq.weight[3] is nan, which no checkpoint of this trainer holds" \
    --model tiny --steps 2 --batch 2 --resume "$T/nan_weight.safetensors" --mesh-dot "$T/keep.dot"
with_state adam_v.layers.1.feed_forward.w2.weight -1 "$T/negative_v.safetensors"
expect_error "adam_v.layers.1.feed_forward.w2.weight[3] is -1, which no checkpoint of this trainer holds (a second moment below 0)" \
    --model tiny --steps 2 --batch 2 --resume "$T/negative_v.safetensors" --mesh-dot "$T/keep.dot"
[ "$(cat "$T/keep.dot")" = keep ] ||
    { echo "FAIL: --mesh-dot was written before an edited or impossible --resume was refused"; failures=$((failures + 1)); }
# No output overwrites an input: not a shard of a sharded --init-from checkpoint, not delayed FP8's
# companion of the checkpoint resumed from, and no directory output over an input file (each was
# accepted and the input destroyed). --grad-dump (step 1's gradients) with --resume is refused as
# --dump is (it wrote nothing).
"$TRAIN" --model tiny --steps 1 --batch 2 --export-hf "$T/shards" --export-hf-shard-mb 0.2 > /dev/null
expect_error "--trace $T/shards/model-00001-of-00004.safetensors: is a file of the checkpoint --init-from reads" \
    --init-from "hf:$T/shards" --steps 1 --batch 2 --trace "$T/shards/model-00001-of-00004.safetensors"
expect_error "is the file --resume reads ($T/ck8/step_000004.safetensors.fp8)" "${fp8[@]}" \
    --resume "$T/ck8/step_000004.safetensors" --trace "$T/ck8/step_000004.safetensors.fp8"
mkdir -p "$T/hta_in" && cp "$T/corpus.txt" "$T/hta_in/rank0.json"
expect_error "--trace-hta $T/hta_in: is the file --data reads ($T/hta_in/rank0.json)" --model tiny --steps 1 --batch 2 \
    --data "text:$T/hta_in/rank0.json" --trace-hta "$T/hta_in"
cp "$T/ck8/step_000004.safetensors" "$T/ck8_copy"
expect_error "--trace $T/ck8/step_000004.safetensors: is the file --resume reads ($T/ck8/step_000004.safetensors)" "${fp8[@]}" \
    --resume "$T/ck8/step_000004.safetensors" --trace "$T/ck8/step_000004.safetensors"
cmp -s "$T/ck8/step_000004.safetensors" "$T/ck8_copy" || { echo "FAIL: the checkpoint resumed from changed"; failures=$((failures + 1)); }
expect_error "--export-hf $T/shards: is the checkpoint --init-from reads; export to another directory" \
    --init-from "hf:$T/shards" --steps 1 --batch 2 --export-hf "$T/shards"
expect_error "--grad-dump: writes step 1's gradients; it cannot be combined with --resume" "${fp8[@]}" \
    --resume "$T/ck8/step_000004.safetensors" --grad-dump "$T/gd.safetensors"
# --trace-hta into a directory with another run's rank files that this run would not replace.
mkdir -p "$T/hta_old" && echo '{}' > "$T/hta_old/rank1.json"
expect_error "--trace-hta $T/hta_old: holds rank1.json, which this run of 1 rank(s) does not write" --model tiny \
    --steps 1 --batch 2 --trace-hta "$T/hta_old"
# HTA reads every .json and .gz file there as a rank's trace: an old rank file compressed, a
# zero-padded name, another output's JSON.
for old in rank1.json.gz rank00.json other.json; do
    mkdir -p "$T/hta_$old" && echo '{}' > "$T/hta_$old/$old"
    expect_error "--trace-hta $T/hta_$old: holds $old, which this run of 1 rank(s) does not write and HTA would read" \
        --model tiny --steps 1 --batch 2 --trace-hta "$T/hta_$old"
done
mkdir -p "$T/hta_out"
expect_error "--trace-json $T/hta_out/all.json: is inside --trace-hta $T/hta_out, where HTA would read it" \
    --model tiny --steps 1 --batch 2 --trace-hta "$T/hta_out" --trace-json "$T/hta_out/all.json"
expect_error "--export-hf $T/hta_out: is --trace-hta's directory" --model tiny --steps 1 --batch 2 \
    --trace-hta "$T/hta_out" --export-hf "$T/hta_out"
with_meta step 99999999999999999999 "$T/huge_step.safetensors"
expect_error 'bad step "99999999999999999999"' --model tiny --steps 2 --batch 2 --resume "$T/huge_step.safetensors"
with_meta step 3 "$T/step3.safetensors"
expect_error 'bad step "3"' --model tiny --steps 2 --batch 2 --resume "$T/step3.safetensors"
# a run started from a Hugging Face export, resumed without --init-from: the hint names the flag
"$TRAIN" --model tiny --steps 1 --batch 2 --export-hf "$T/hf_start" > /dev/null
"$TRAIN" --init-from "hf:$T/hf_start" --steps 2 --batch 2 --checkpoint-dir "$T/from_hf" > /dev/null
expect_error "that run started from --init-from hf:DIR: give it again" --steps 2 --batch 2 --resume "$T/from_hf"
# the recorded --lr is only reported, but a value no run writes is a damaged file
with_meta lr nan "$T/lr_nan.safetensors"
expect_error 'bad lr "nan"' --model tiny --steps 2 --batch 2 --resume "$T/lr_nan.safetensors"
# --resume DIR takes the latest of the names the trainer writes (step_000002), not step_10 or step_+7,
# whose canonical names (step_000010, step_000007) are not there
mkdir -p "$T/odd_names"
for name in step_000002 step_10 step_+7 step_99999999999999999999999; do cp "$good" "$T/odd_names/$name.safetensors"; done
"$TRAIN" --model tiny --steps 2 --batch 2 --resume "$T/odd_names" > "$T/odd_names.log" 2>&1 &&
    grep -q "resumed from $T/odd_names/step_000002.safetensors after step 2" "$T/odd_names.log" ||
    { cat "$T/odd_names.log"; echo "FAIL: --resume DIR with odd step names"; failures=$((failures + 1)); }
[ "$(sha256sum "$good" | cut -d' ' -f1)" = "$sum_before" ] || { echo "FAIL: checkpoint changed"; failures=$((failures + 1)); }
ls "$T/ck" | grep -q tmp && { echo "FAIL: temporary file left in $T/ck"; failures=$((failures + 1)); }

# Accepted with one log line saying so: --seq-len beyond the model's max_seq_len (the RoPE table
# grows), and resuming with another --lr, schedule or update setting (the checkpoint records them).
"$TRAIN" --model tiny --steps 1 --batch 2 --seq-len 40 > "$T/seq.log" 2>&1 \
    && grep -q "^--seq-len 40: beyond model tiny's max_seq_len 32, which grows to 40" "$T/seq.log" \
    || { echo "FAIL: --seq-len beyond max_seq_len: no log line"; cat "$T/seq.log"; failures=$((failures + 1)); }
"$TRAIN" --model tiny --steps 2 --batch 2 --lr 1e-3 --lr-decay linear --resume "$good" > "$T/lr.log" 2>&1 \
    && grep -q "^resume: --lr changes from 0.0003 (checkpoint) to 0.001" "$T/lr.log" \
    && grep -q '^resume: the schedule changes from "cosine, warmup 0, min_lr_ratio 0.1" (checkpoint) to "linear, warmup 0, min_lr_ratio 0.1"' "$T/lr.log" \
    || { echo "FAIL: resume with another --lr and schedule: no log lines"; cat "$T/lr.log"; failures=$((failures + 1)); }
"$TRAIN" --model tiny --steps 2 --batch 2 --weight-decay 0 --grad-clip 0.5 --resume "$good" > "$T/settings.log" 2>&1 \
    && grep -q '^resume: the settings change from "weight_decay 0.1, beta1 0.9, beta2 0.95, eps 1e-08, grad_clip 1, grad_accum 1, fp8 none" (checkpoint) to "weight_decay 0, beta1 0.9, beta2 0.95, eps 1e-08, grad_clip 0.5, grad_accum 1, fp8 none"' "$T/settings.log" \
    || { echo "FAIL: resume with another weight decay and clip: no log line"; cat "$T/settings.log"; failures=$((failures + 1)); }
"$TRAIN" --model tiny --steps 2 --batch 2 --resume "$good" > "$T/same.log" 2>&1 && ! grep -q "^resume:" "$T/same.log" \
    || { echo "FAIL: resume with the same settings"; cat "$T/same.log"; failures=$((failures + 1)); }

# --help is generated from the flag table and exits 0
help=$("$TRAIN" --help) && grep -q -- "--checkpoint-dir DIR" <<<"$help" || { echo "FAIL: --help"; failures=$((failures + 1)); }
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
