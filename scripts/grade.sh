#!/usr/bin/env bash
# Grades a lab: builds the project with your files from exercises/<lab>/ in place of the chapter's,
# in a private copy of the tree, then runs the lab's checks (exercises/<lab>/checks, one shell
# command per line) and prints a score. Your working tree and build/ are not touched.
#
#   scripts/grade.sh LAB              (make grade LAB=ring)
#   scripts/grade.sh LAB --solution   grade the chapter's own code instead (what full marks look like)
#
# Exit status: 0 when every check passes, 1 otherwise, 2 for a bad lab name.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LAB=${1:-}
MODE=${2:-}
LABS=$(cd "$ROOT/exercises" && ls -d */ 2>/dev/null | tr -d / | tr '\n' ' ')
if [ -z "$LAB" ] || [ ! -f "$ROOT/exercises/$LAB/FILES" ]; then
    echo "grade: unknown lab '${LAB}' (labs: $LABS)" >&2
    exit 2
fi
if [ -n "$MODE" ] && [ "$MODE" != "--solution" ]; then
    echo "grade: unknown option '$MODE' (only --solution)" >&2
    exit 2
fi

WORK=${GRADE_DIR:-$ROOT/build/grade-$LAB}
rm -rf "$WORK"
mkdir -p "$WORK/tree"
# The tree without build outputs and git data; the Python venv of the main build is reused.
tar -C "$ROOT" --exclude=./build --exclude=./.git -cf - . | tar -C "$WORK/tree" -xf -
if [ "$MODE" != "--solution" ]; then
    while read -r name dest; do
        cp "$ROOT/exercises/$LAB/$name" "$WORK/tree/$dest"
    done < "$ROOT/exercises/$LAB/FILES"
fi

echo "grade $LAB: building your code (log: $WORK/build.log)"
LAB_WARNINGS="-Wno-unused-parameter -Wno-unused-variable -Wno-unused-but-set-variable -Wno-unused-function"
if ! make -C "$WORK/tree" -j2 BUILD="$WORK/build" EXTRA_CFLAGS="$LAB_WARNINGS" "$WORK/build/train" \
        "$WORK/build/collectives" > "$WORK/build.log" 2>&1; then
    grep -E "error" "$WORK/build.log" | head -20
    echo "grade $LAB: does not compile: 0 points"
    exit 1
fi

PYTHON=${PYTHON:-$ROOT/build/venv/bin/python}
case "$PYTHON" in /*) ;; */*) PYTHON="$ROOT/$PYTHON" ;; esac  # the checks run inside the copy
export BUILD="$WORK/build" PYTHON OMP_NUM_THREADS=1
export MPIRUN_LAB=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
passed=0 total=0
while IFS= read -r check; do
    case "$check" in ''|'#'*) continue ;; esac
    total=$((total + 1))
    export TEST_TMP="$WORK/check$total"
    mkdir -p "$TEST_TMP"
    if (cd "$WORK/tree" && timeout 600 bash -c "$check") < /dev/null > "$WORK/check$total.log" 2>&1; then
        passed=$((passed + 1)); echo "  pass  $check"
    else
        echo "  FAIL  $check"
        grep -E "lab .* is yours to write|FAIL|MISMATCH|error" "$WORK/check$total.log" | head -3 | sed 's/^/        /'
    fi
done < "$ROOT/exercises/$LAB/checks"
echo "grade $LAB: $passed/$total checks passed"
[ "$passed" -eq "$total" ]
