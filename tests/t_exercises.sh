#!/usr/bin/env bash
# The labs: skeletons in step with the chapter code, and every grader giving full marks to the
# chapter's own code and failing the empty skeleton (with the hole's hint in its output).
set -eu -o pipefail
echo "== skeletons up to date (scripts/make_exercises.py --check)"
"$PYTHON" scripts/make_exercises.py --check
for lab in $(cd exercises && ls -d */ | tr -d /); do
    echo "== lab $lab: the chapter's code gets full marks"
    GRADE_DIR="$TEST_TMP/$lab-solution" scripts/grade.sh "$lab" --solution | tail -1
    echo "== lab $lab: the skeleton fails every check, stopping at a hole"
    set +e
    out=$(GRADE_DIR="$TEST_TMP/$lab-skeleton" scripts/grade.sh "$lab" 2>&1); rc=$?
    set -e
    printf '%s\n' "$out" | tail -1
    total=$(grep -cv '^\(#\|$\)' "exercises/$lab/checks")
    if [ "$rc" -ne 1 ] || [[ "$out" != *"grade $lab: 0/$total checks passed"* ]] || [[ "$out" != *"is yours to write"* ]]; then
        printf '%s\n' "$out"; echo "FAIL: the $lab skeleton should score 0/$total and name its hole"; exit 1
    fi
done
echo "== a bad lab name exits 2"
set +e
scripts/grade.sh no_such_lab; rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "FAIL: rc $rc"; exit 1; }
echo "t_exercises: OK"
