#!/usr/bin/env bash
# The device mesh under mpirun, beyond what test_comm_mpi checks inside (coordinates and groups of
# every factorization of 2, 3, 4 and 8 ranks, in t_comm.sh): a mesh that does not fit the world
# exits with status 2 and one line; the labels of 8 = pp2 x dp_shard2 x tp2; and the Graphviz file
# renders with `dot -Tsvg` into the expected clusters, nodes and group edges.
set -euo pipefail
BUILD=${BUILD:-build}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}
MPIRUN=${MPIRUN:-mpirun --oversubscribe --allow-run-as-root}
BIN=$BUILD/tests/test_comm_mpi
OUT=$TEST_TMP/mpirun.out
command -v dot >/dev/null || { echo "FAIL: graphviz's dot not found: run 'make deps'"; exit 1; }

run() {  # N ARGS...: output in $OUT, exit status in $status
    local n=$1
    shift
    status=0
    timeout 60 $MPIRUN -np "$n" "$BIN" "$@" >"$OUT" 2>&1 || status=$?
}
fail() {
    echo "FAIL: $*"
    sed 's/^/    /' "$OUT" | tail -30
    exit 1
}

expect_bad_mesh() {  # N "PP DR DS CP TP" message
    run "$1" --mesh $2
    [ "$status" -eq 2 ] || fail "--mesh $2 on $1 ranks: exit status $status, want 2"
    [ "$(grep -cF -- "test_comm_mpi: $3" "$OUT")" -eq 1 ] || fail "--mesh $2 on $1 ranks: want the line '$3' once"
    echo "ok: --mesh $2 on $1 ranks exits 2: $3"
}
expect_bad_mesh 4 "2 1 3 1 1" "--pp 2 x --dp-shard 3 = 6 ranks, but mpirun started 4"
expect_bad_mesh 2 "1 1 2 1 0" "--tp 0: must be at least 1"
expect_bad_mesh 2 "1 1 1 1 1" "every mesh degree is 1 = 1 rank, but mpirun started 2"

# svg_count FILE CLASS: how many <g class="CLASS"> dot drew.
svg_count() { grep -c "<g id=\"[^\"]*\" class=\"$2\"" "$1" || true; }
draw() {  # name N "PP DR DS CP TP" clusters nodes edges
    local dotfile=$TEST_TMP/$1.dot svg=$TEST_TMP/$1.svg
    run "$2" --mesh $3 --mesh-dot "$dotfile"
    [ "$status" -eq 0 ] || fail "--mesh $3: exit status $status"
    dot -Tsvg "$dotfile" -o "$svg" || fail "$dotfile is not valid Graphviz"
    local got="$(svg_count "$svg" cluster) $(svg_count "$svg" node) $(svg_count "$svg" edge)"
    [ "$got" = "$4 $5 $6" ] || fail "$svg: clusters, nodes, edges = $got, want $4 $5 $6"
    echo "ok: --mesh $3 drawn: $4 clusters, $5 nodes, $6 edges"
}
# 2 pp stages x 2 dp replicas = 6 clusters; 4 tp pairs = 4 edges.
draw pp2_ds2_tp2 8 "2 1 2 1 2" 6 8 4
expected="$(for r in 0 1 2 3 4 5 6 7; do
    echo "rank $r [pp$((r / 4)) dp$((r / 2 % 2)) cp0 tp$((r % 2))]"; done)"
[ "$(grep '^rank ' "$OUT" | sort -n -k2)" = "$expected" ] || fail "labels of pp2 x dp_shard2 x tp2"
echo "ok: labels of pp2 x dp_shard2 x tp2"
# dp_replicate2 x dp_shard2 x tp2: 1 + 4 clusters, 4 tp edges; dp2 x cp2 x tp2: 4 tp and 4 cp edges.
draw dr2_ds2_tp2 8 "1 2 2 1 2" 5 8 4
draw ds2_cp2_tp2 8 "1 1 2 2 2" 3 8 8
