#!/usr/bin/env bash
# Grades a lab: compiles your file(s) from exercises/<lab>/ in place of the chapter's, links the
# programs the lab's checks run against the project's prebuilt libraries (so only your file is
# compiled), then runs the checks (exercises/<lab>/checks, one shell command per line) and prints a
# score. Your working tree and build/'s programs are not touched: everything goes to build/grade-<lab>.
#
#   scripts/grade.sh LAB                   (make grade LAB=ring)
#   scripts/grade.sh LAB --solution        the chapter's own code: what full marks look like
#   scripts/grade.sh LAB --variant DIR     the files at DIR/<their path in the tree> (tests/t_exercises.sh:
#                                          generated skeletons, planted mistakes)
#   ... --first-failure                    stop at the first failing check (the rest count as failed)
#
# Each check runs under a time limit (GRADE_CHECK_TIMEOUT, 120 s): a check that hits it is reported
# as a possible deadlock. Exit status: 0 when every check passes, 1 otherwise, 2 for bad arguments
# or settings (one line, before anything is built or removed). GRADE_DIR and GRADE_CACHE move the two
# directories it empties; each must be new, empty, or one it made before.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# Bad arguments or settings: one line (a newline in a name shown as \n), exit 2, before anything is
# built or removed.
refuse() { echo "grade: ${1//$'\n'/\\n}" >&2; exit 2; }
usage() { refuse "$1 (usage: grade.sh LAB [--solution | --variant DIR] [--first-failure]; labs: $LABS)"; }
# The labs: the directories under exercises/ with a FILES list. The name given must be one of them,
# letter for letter: it becomes part of paths this script empties (build/grade-LAB), so a name
# with a slash or a dot-dot (ring/../../exercises/tp) must never reach them.
LABS=$(cd "$ROOT/exercises" && for dir in */; do [ -f "$dir/FILES" ] && printf '%s ' "${dir%/}"; done)
LABS=${LABS% }
LAB=${1:-}
[[ "$LAB" =~ ^[A-Za-z0-9_-]+$ ]] && [ -f "$ROOT/exercises/$LAB/FILES" ] || usage "unknown lab '${LAB}'"
shift
MODE=student VARIANT= FIRST_FAILURE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --solution | --variant)  # one source of the code graded: a second would silently win
            [ "$MODE" = student ] || usage "$1: give one of --solution and --variant, once"
            if [ "$1" = --solution ]; then MODE=solution
            else
                [ $# -ge 2 ] && [ -d "$2" ] || usage "--variant needs a directory"
                MODE=variant; VARIANT=$(cd "$2" && pwd); shift
            fi ;;
        --first-failure) [ "$FIRST_FAILURE" -eq 0 ] || usage "--first-failure given twice"; FIRST_FAILURE=1 ;;
        *) usage "unknown option '$1'" ;;
    esac
    shift
done
# Every file the lab grades is there, before anything is built: a missing one is a wrong --variant
# directory or a skeleton never generated, not code that "does not compile: 0 points".
while read -r name dest _; do
    case $MODE in
        student) file=$ROOT/exercises/$LAB/$name fix="make exercises writes the skeletons" ;;
        solution) file=$ROOT/$dest fix="the chapter's code is missing from the tree" ;;
        variant) file=$VARIANT/$dest fix="--variant DIR holds the lab's files at their paths in the tree" ;;
    esac
    [ -f "$file" ] || refuse "$file: missing ($fix)"
done < "$ROOT/exercises/$LAB/FILES"
# The time limit of a check, as timeout(1) takes it: seconds, a fraction allowed; 0 would mean none.
CHECK_TIMEOUT=${GRADE_CHECK_TIMEOUT:-120}
[[ "$CHECK_TIMEOUT" =~ ^[0-9]+(\.[0-9]+)?$ ]] && [[ "$CHECK_TIMEOUT" =~ [1-9] ]] ||
    refuse "GRADE_CHECK_TIMEOUT=$CHECK_TIMEOUT: must be a positive number of seconds (120, 20, 2.5)"

BUILD=${BUILD:-build}
case "$BUILD" in /*) LIBDIR=$BUILD ;; *) LIBDIR=$ROOT/$BUILD ;; esac
# The two directories this script empties: its own places under $LIBDIR, named from the lab, or the
# ones GRADE_DIR and GRADE_CACHE name -- those only when they are new, empty, or marked as made by
# this script (.grade-dir), so that a mistyped path never deletes someone's files.
WORK=${GRADE_DIR:-$LIBDIR/grade-$LAB}
CACHE=${GRADE_CACHE:-$LIBDIR/grade-cache}
ours() {  # dir -> whether it is new, empty or one this script made
    [ ! -e "$1" ] || { [ -d "$1" ] && { [ -f "$1/.grade-dir" ] || [ -z "$(ls -A "$1" 2>/dev/null)" ]; }; }
}
[ -z "${GRADE_DIR:-}" ] || ours "$WORK" ||
    refuse "GRADE_DIR=$WORK: not a directory this script made (no .grade-dir in it); name a new or empty one"
[ -z "${GRADE_CACHE:-}" ] || ours "$CACHE" ||
    refuse "GRADE_CACHE=$CACHE: not a directory this script made (no .grade-dir in it); name a new or empty one"
LAB_DIR=$ROOT/exercises/$LAB
# Skeletons leave parameters and variables unused until they are written.
LAB_WARNINGS="-Wno-unused-parameter -Wno-unused-variable -Wno-unused-but-set-variable -Wno-unused-function"

# ---- the prebuilt part, shared by every grade of every lab (built once, under a lock) -----------
# flags.sh: the Makefile's compiler flags; obj/NAME.o: the main file of each program a lab's checks
# run (chapters/*/main_NAME.c, the trainer, or a test suite tests/NAME.c), compiled when first
# needed; bin/train: the unmodified trainer, the single-process reference of the checks.
# The checks' Python (numpy, perfetto) is the venv `make deps` builds: without it every check that
# reads a trace or a checkpoint would fail, and the grade would blame your code.
PYTHON=${PYTHON:-$LIBDIR/venv/bin/python}
case "$PYTHON" in /*) ;; */*) PYTHON="$ROOT/$PYTHON" ;; esac
"$PYTHON" -c 'import numpy' 2>/dev/null ||
    { echo "grade: $PYTHON cannot import numpy: run make deps first (it builds the Python the checks use)" >&2; exit 2; }
mkdir -p "$CACHE" && touch "$CACHE/.grade-dir"
programs=$(sed -n 's/^# programs: *//p' "$LAB_DIR/checks")
main_of() {  # program name -> its main source
    case $1 in
        train) echo "$ROOT/chapters/10_trainer/train.c" ;;
        test_*) echo "$ROOT/tests/$1.c" ;;
        *) ls "$ROOT"/chapters/*/main_"$1".c 2>/dev/null | head -1 ;;
    esac
}
# The libraries, brought up to date with the tree (make does nothing when they are), then the cache.
prepare_cache() {
    local lib
    for lib in libref32.a libcommon.a; do
        make -s -C "$ROOT" BUILD="$LIBDIR" "$LIBDIR/$lib" || { echo "grade: cannot build $lib"; return 1; }
    done
    if ! { [ -f "$CACHE/stamp" ] && [ "$CACHE/stamp" -nt "$LIBDIR/libref32.a" ] && [ "$CACHE/stamp" -nt "$LIBDIR/libcommon.a" ]; }; then
        rm -rf "$CACHE/obj" "$CACHE/bin" "$CACHE/ref" && mkdir -p "$CACHE/obj" "$CACHE/bin" "$CACHE/ref"
        make -s -C "$ROOT" BUILD="$LIBDIR" print-lab-build > "$CACHE/flags.sh" || return 1
        touch "$CACHE/stamp"
    fi
    source "$CACHE/flags.sh"
    local program main
    for program in train $programs; do
        object_current "$program" && continue
        main=$(main_of "$program")
        [ -f "$main" ] || { echo "grade: $LAB_DIR/checks: no program '$program'"; return 1; }
        (cd "$ROOT" && $LAB_CC $LAB_CFLAGS -MMD -MF "$CACHE/obj/$program.d" -c "$main" -o "$CACHE/obj/$program.o") ||
            return 1
    done
    [ -f "$CACHE/bin/train" ] && [ "$CACHE/bin/train" -nt "$CACHE/obj/train.o" ] && return 0
    $LAB_CC "$CACHE/obj/train.o" "$LIBDIR/libref32.a" "$LIBDIR/libcommon.a" $LAB_LDLIBS -o "$CACHE/bin/train" || return 1
    # ref/: the reference runs of bin/train; a new trainer (an updated train.c) runs them again
    rm -rf "$CACHE/ref" && mkdir -p "$CACHE/ref"
}
# Whether obj/NAME.o is there and newer than its main source and every header that source includes
# (the compiler's dependency list, obj/NAME.d): an edited or updated trainer, main_*.c or test suite
# is compiled again, not graded from its old object.
object_current() {  # program
    local object=$CACHE/obj/$1.o deps=$CACHE/obj/$1.d file
    [ -f "$object" ] && [ -f "$deps" ] || return 1
    for file in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$deps"); do
        [ -f "$ROOT/$file" ] && file=$ROOT/$file
        [ -f "$file" ] && [ "$object" -nt "$file" ] || return 1
    done
}
mkdir -p "$(dirname "$WORK")"
(flock 9 && prepare_cache) 9> "$CACHE/lock" > "$WORK.prepare.log" 2>&1 \
    || { cat "$WORK.prepare.log" >&2; echo "grade: cannot prepare $CACHE" >&2; exit 2; }
source "$CACHE/flags.sh"

# ---- your file(s), compiled and linked into the programs the checks run ---------------------------
rm -rf "$WORK" && mkdir -p "$WORK/build" "$WORK/obj" && touch "$WORK/.grade-dir"
cp "$LIBDIR/libref32.a" "$WORK/build/libref32.a"
yours=""
echo "grade $LAB: building $([ $MODE = solution ] && echo "the chapter's code" || echo "your code") (log: $WORK/build.log)"
while read -r name dest _; do
    case $MODE in
        student) src=$LAB_DIR/$name; yours="$yours exercises/$LAB/$name" ;;
        solution) src=$ROOT/$dest ;;
        variant) src=$VARIANT/$dest ;;
    esac
    member=$(basename "$dest" .c).o
    # -iquote: the file's own #include "x.h" finds the chapter's headers wherever the file is.
    if ! (cd "$ROOT" && $LAB_CC $LAB_CFLAGS $LAB_WARNINGS -iquote "$(dirname "$ROOT/$dest")" -c "$src" \
            -o "$WORK/obj/$member") >> "$WORK/build.log" 2>&1; then
        grep -E "error" "$WORK/build.log" | head -20
        echo "grade $LAB: $src does not compile: 0 points"
        exit 1
    fi
    ar d "$WORK/build/libref32.a" "$member"  # the chapter's version of it; yours is linked instead
done < "$LAB_DIR/FILES"
for program in $programs; do
    extra=""
    case $program in test_*) extra=$LAB_CHECK_LIBS ;; esac
    if ! $LAB_CC "$CACHE/obj/$program.o" "$WORK"/obj/*.o "$WORK/build/libref32.a" "$LIBDIR/libcommon.a" $extra $LAB_LDLIBS \
            -o "$WORK/build/$program" >> "$WORK/build.log" 2>&1; then
        grep -E "error|undefined" "$WORK/build.log" | head -10
        echo "grade $LAB: does not link: 0 points"
        exit 1
    fi
done

# ---- the checks ----------------------------------------------------------------------------------
export BUILD="$WORK/build" PYTHON OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export LIBCOMMON="$LIBDIR/libcommon.a"  # for checks that link your object themselves (fp8's cast_oracle.sh)
export REF_TRAIN="$CACHE/bin/train" REF_CACHE="$CACHE/ref"
export MPIRUN_LAB=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}

# The lines of a failed check's log worth reading: MPI errors first, then the first lines a checker
# marked as failing (they may sit above a summary table), then the last lines that are not mpirun's
# boilerplate about which process exited; each line once.
explain() {  # log
    grep -m1 "is yours to write" "$1" | sed 's/^/        /'
    grep -m3 "MPI_ERR" "$1" | sed 's/^/        /'
    {
        grep -m3 -E '(^|[^A-Za-z])FAIL|MISMATCH' "$1"
        grep -vE '^[[:space:]]*$|^-{10,}|^\[[^]]*\] \*\*\*|Primary job|prterun|mpirun (noticed|detected|has exited)|Process name:|Exit code:|exited on signal|This may have caused|Local host:|Node:|^ *PID|normally terminate|\] \[ *[0-9]+\] |Per user-direction|non-zero status|job aborted|MPI_ABORT was invoked|You may or may not|NOTE: invoking|the job to be terminated|MPI_ERR' "$1" \
            | grep -v "is yours to write" | awk '!seen[$0]++' | tail -4
    } | awk '!seen[$0]++' | sed 's/^/        /'
}

passed=0 total=$(grep -cvE '^[[:space:]]*(#|$)' "$LAB_DIR/checks") number=0 stopped=0
while IFS= read -r check; do
    case "$check" in ''|'#'*) continue ;; esac
    number=$((number + 1))
    if [ "$stopped" -eq 1 ]; then echo "  --    $check"; continue; fi
    export TEST_TMP="$WORK/check$number"
    log=$WORK/check$number.log
    mkdir -p "$TEST_TMP"
    (cd "$ROOT" && timeout -k 5 "$CHECK_TIMEOUT" bash -c "$check") < /dev/null > "$log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1)); echo "  pass  $check"
        continue
    fi
    echo "  FAIL  $check"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] &&
        echo "        stopped after ${CHECK_TIMEOUT} s: a possible deadlock (a send no rank receives, a collective that some ranks skip)"
    echo "        log: $log"
    explain "$log"
    [ "$FIRST_FAILURE" -eq 1 ] && stopped=1
done < "$LAB_DIR/checks"
[ "$stopped" -eq 1 ] && note=" (stopped at the first failure)" || note=""
echo "grade $LAB: $passed/$total checks passed$note"
if [ "$passed" -ne "$total" ] && [ -n "$yours" ]; then
    echo "hint: your code is in$yours; exercises/$LAB/README.md says what each check expects"
fi
[ "$passed" -eq "$total" ]
