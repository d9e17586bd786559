#!/usr/bin/env bash
# The labs: skeletons in step with the chapter code, and every grader proven on three kinds of code:
#   the chapter's own code     full marks;
#   the generated skeleton     0 points, stopping at a hole with its hint;
#   each planted mistake       less than full marks (exercises/<lab>/mutants/*.patch, applied to the
#                              chapter's code: realistic bugs, among them the ones that loss-only
#                              checks let through).
# Prints the table (lab, code, score). Everything is graded against the prebuilt libraries with one
# shared cache; mutants and skeletons stop at their first failing check; LAB_JOBS grade at once.
# Also: make exercises never overwrites an edited skeleton, and bad arguments and settings (a lab
# name that leads out of build/, FIRST, GRADE_CHECK_TIMEOUT, two modes, an empty --variant, a
# GRADE_DIR it did not make) exit 2 with one line, before anything is built or removed.
# LABS="ddp pp" grades only those labs. The mutants are deterministic mistakes (a wrong value, a
# crash, a collective out of the formula's order or size), none that only a race would expose.
set -eu -o pipefail
echo "== skeletons up to date (scripts/make_exercises.py --check)"
"$PYTHON" scripts/make_exercises.py --check
export GRADE_CACHE="$TEST_TMP/cache"
mkdir -p "$TEST_TMP/results" "$TEST_TMP/variants"

jobs=()  # "lab kind name variant-dir"
for lab in ${LABS:-$(cd exercises && ls -d */ | tr -d /)}; do
    jobs+=("$lab solution solution -")
    dir=$TEST_TMP/variants/$lab-skeleton
    "$PYTHON" scripts/make_exercises.py --out "$dir" --lab "$lab"
    jobs+=("$lab skeleton skeleton $dir")
    for patch in exercises/"$lab"/mutants/*.patch; do
        [ -f "$patch" ] || continue
        name=$(basename "$patch" .patch) dir=$TEST_TMP/variants/$lab-$name
        while read -r _ dest _; do mkdir -p "$dir/$(dirname "$dest")" && cp "$dest" "$dir/$dest"; done < "exercises/$lab/FILES"
        patch -s -p1 -d "$dir" --no-backup-if-mismatch -r - < "$patch" > "$dir.patch.log" 2>&1 ||
            { cat "$dir.patch.log"; echo "FAIL: $patch no longer applies to the chapter code: update it"; exit 1; }
        jobs+=("$lab mutant $name $dir")
    done
done

grade_one() {  # lab kind name dir -> results/<lab>-<name>: "lab kind name passed total"
    local lab=$1 kind=$2 name=$3 dir=$4 out rc=0
    local args=(--solution)
    [ "$kind" = solution ] || args=(--variant "$dir" --first-failure)
    out=$(GRADE_DIR="$TEST_TMP/grade/$lab-$name" scripts/grade.sh "$lab" "${args[@]}" 2>&1) || rc=$?
    printf '%s\n' "$out" > "$TEST_TMP/results/$lab-$name.log"
    local score; score=$(printf '%s\n' "$out" | sed -n "s|^grade $lab: \([0-9]*\)/\([0-9]*\) checks passed.*|\1 \2|p")
    [ -n "$score" ] || score="0 ?"
    [ "$kind" = skeleton ] && [[ "$out" != *"is yours to write"* ]] && score="$score no-hint"
    echo "$lab $kind $name $score" > "$TEST_TMP/results/$lab-$name"
}
export -f grade_one
export TEST_TMP
start=$SECONDS
printf '%s\n' "${jobs[@]}" | xargs -P "${LAB_JOBS:-3}" -L1 bash -c 'grade_one "$@"' _
echo "== ${#jobs[@]} graded in $((SECONDS - start)) s"

bad=0
printf '%-6s %-10s %-30s %s\n' lab code name score
for job in "${jobs[@]}"; do
    read -r lab kind name _ <<< "$job"
    passed="" total="" extra=""  # a missing result must not reuse the previous job's
    read -r _ _ _ passed total extra < "$TEST_TMP/results/$lab-$name" || true
    verdict=ok
    [ -n "$total" ] || verdict="FAIL: no result"
    case $kind in
        solution) [ "$passed" = "$total" ] || verdict="FAIL: the chapter's code should get full marks" ;;
        skeleton) [ "$passed" = 0 ] && [ -z "${extra:-}" ] || verdict="FAIL: the skeleton should get 0 and name its hole" ;;
        mutant) [ "$passed" != "$total" ] || verdict="FAIL: this mistake gets full marks" ;;
    esac
    # No score line (total "?"): the code was never graded -- it did not compile or link, or the
    # grader could not start -- which proves nothing about the checks, whatever the kind.
    case $total in '' | *[!0-9]*) verdict="FAIL: not graded (no score line: did it build?)" ;; esac
    printf '%-6s %-10s %-30s %s/%s %s\n' "$lab" "$kind" "$name" "$passed" "$total" "$verdict"
    if [ "$verdict" != ok ]; then
        bad=1; sed 's/^/    /' "$TEST_TMP/results/$lab-$name.log"
    fi
done
[ "$bad" -eq 0 ] || { echo "FAIL: a grader is wrong (above)"; exit 1; }

echo "== make exercises keeps a skeleton the student edited"
tree=$TEST_TMP/tree
mkdir -p "$tree" && cp -r scripts chapters reference_cpu exercises "$tree/"
lab=$(cd exercises && ls -d */ | tr -d / | head -1)
file=$(awk '{print $1; exit}' "exercises/$lab/FILES")
echo "// my work" >> "$tree/exercises/$lab/$file"
"$PYTHON" "$tree/scripts/make_exercises.py" | tee "$tree/out.log"
grep -q "edited since they were generated" "$tree/out.log" && [ "$(tail -1 "$tree/exercises/$lab/$file")" = "// my work" ] ||
    { echo "FAIL: make exercises overwrote exercises/$lab/$file"; exit 1; }
"$PYTHON" "$tree/scripts/make_exercises.py" --force > /dev/null
[ "$(tail -1 "$tree/exercises/$lab/$file.edited")" = "// my work" ] && cmp -s "$tree/exercises/$lab/$file" "exercises/$lab/$file" ||
    { echo "FAIL: make exercises FORCE=1 should keep the edited file as $file.edited and regenerate $file"; exit 1; }
echo "// my second try" >> "$tree/exercises/$lab/$file"
"$PYTHON" "$tree/scripts/make_exercises.py" --force > /dev/null
[ "$(tail -1 "$tree/exercises/$lab/$file.edited")" = "// my work" ] &&
    [ "$(tail -1 "$tree/exercises/$lab/$file.edited.2")" = "// my second try" ] ||
    { echo "FAIL: a second FORCE=1 should keep the first $file.edited and the new one as $file.edited.2"; exit 1; }
echo "ok: edited exercises/$lab/$file kept; FORCE=1 keeps it as $file.edited, a second time as $file.edited.2"

echo "== bad arguments and settings: exit 2 and one line naming the problem, before anything is built or removed"
failed=0
refused() {  # what-it-says command... -> exit 2, exactly one line on stderr that says it, no grade directory
    local want=$1 err rc=0; shift
    err=$("$@" 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -eq 2 ] && [ "$(grep -c . <<<"$err")" -eq 1 ] && [[ "$err" == *"$want"* ]] && [ ! -e "$TEST_TMP/grade/refused" ]; then
        echo "ok: $err"
    else
        echo "FAIL: $* -> exit $rc: $err (wanted exit 2, one line with '$want', no $TEST_TMP/grade/refused)"; failed=1
    fi
    rm -rf "$TEST_TMP/grade/refused" "$TEST_TMP/grade/refused.prepare.log"  # a grade that ran: not the next check's
}
# A lab name with a dot-dot once passed (exercises/ring/../../exercises/tp/FILES is there) and
# build/grade-ring/../../exercises/tp -- the student's exercises/tp -- was emptied for the grade. The
# lab is kept aside and put back if it changed, so that the check itself loses nothing if that returns.
tp_sums() { find exercises/tp -type f -print0 | sort -z | xargs -0 sha256sum; }
before=$(tp_sums) && cp -a exercises/tp "$TEST_TMP/tp.kept" && log_was_there=$([ -e exercises/tp.prepare.log ] && echo 1 || echo 0)
refused "unknown lab 'ring/../../exercises/tp'" scripts/grade.sh ring/../../exercises/tp --solution
refused "unknown lab 'ring/../../exercises/tp'" make -s grade LAB=ring/../../exercises/tp BUILD="$BUILD" PYTHON="$PYTHON"
if [ "$(tp_sums)" != "$before" ]; then
    echo "FAIL: grading ring/../../exercises/tp changed exercises/tp (put back from $TEST_TMP/tp.kept)"; failed=1
    rm -rf exercises/tp && cp -a "$TEST_TMP/tp.kept" exercises/tp
    [ "$log_was_there" -eq 1 ] || rm -f exercises/tp.prepare.log  # the grade's log, beside its directory
fi
refused "unknown lab 'no_such_lab'" scripts/grade.sh no_such_lab
refused "unknown lab '..'" env GRADE_DIR="$TEST_TMP/grade/refused" scripts/grade.sh ..
# FIRST=0 is off (any value once turned it on), FIRST=1 on, anything else refused as make reads it.
refused "FIRST=yes: must be 1" make -s grade LAB=ring FIRST=yes BUILD="$BUILD" PYTHON="$PYTHON"
for first in 0 1; do
    command=$(make -n grade LAB=ring FIRST=$first BUILD="$BUILD" PYTHON="$PYTHON" | grep 'scripts/grade.sh' || true)
    [[ "$command" == *--first-failure* ]] && on=1 || on=0
    [ "$on" -eq "$first" ] && echo "ok: FIRST=$first -> $command" ||
        { echo "FAIL: make grade FIRST=$first runs: $command"; failed=1; }
done
refused "GRADE_CHECK_TIMEOUT=abc: must be a positive number of seconds" \
    env GRADE_DIR="$TEST_TMP/grade/refused" GRADE_CHECK_TIMEOUT=abc scripts/grade.sh ring --solution
refused "GRADE_CHECK_TIMEOUT=0: must be a positive number of seconds" \
    env GRADE_DIR="$TEST_TMP/grade/refused" GRADE_CHECK_TIMEOUT=0 scripts/grade.sh ring --solution
# One source of the code graded; a --variant directory without the lab's files is a wrong directory,
# not code that "does not compile: 0 points".
mkdir -p "$TEST_TMP/empty_variant"
refused "give one of --solution and --variant" \
    env GRADE_DIR="$TEST_TMP/grade/refused" scripts/grade.sh ring --solution --variant "$TEST_TMP/empty_variant"
refused "$TEST_TMP/empty_variant/$(awk '{print $2; exit}' exercises/ring/FILES): missing" \
    env GRADE_DIR="$TEST_TMP/grade/refused" scripts/grade.sh ring --variant "$TEST_TMP/empty_variant"
# GRADE_DIR is emptied for each grade: a directory this script did not make is refused, not emptied.
mkdir -p "$TEST_TMP/not_ours" && echo precious > "$TEST_TMP/not_ours/notes.txt"
refused "GRADE_DIR=$TEST_TMP/not_ours: not a directory this script made" \
    env GRADE_DIR="$TEST_TMP/not_ours" scripts/grade.sh ring --solution
[ "$(cat "$TEST_TMP/not_ours/notes.txt")" = precious ] || { echo "FAIL: GRADE_DIR's file is gone"; failed=1; }
[ "$failed" -eq 0 ] || { echo "FAIL: a bad argument or setting was not refused as it should be (above)"; exit 1; }
echo "== no Python for the checks: exit 2 naming make deps, before any grading (not 0 points for the student)"
rc=0
out=$(GRADE_DIR="$TEST_TMP/grade/no-python" PYTHON="$TEST_TMP/no/such/python" scripts/grade.sh ring --solution 2>&1) || rc=$?
[ "$rc" -eq 2 ] && [[ "$out" == *"run make deps first"* ]] && [ ! -e "$TEST_TMP/grade/no-python" ] ||
    { echo "$out"; echo "FAIL: rc $rc"; exit 1; }
echo "ok: $out"
echo "t_exercises: OK"
