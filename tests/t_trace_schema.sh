#!/usr/bin/env bash
# Checks the files common/trace.c writes against the official Perfetto schema: runs the trace
# unit tests keeping their traces in $TEST_TMP, decodes them with tests/py/trace_check.py, then
# makes sure the checker itself rejects broken variants (a checker that never fails proves
# nothing). Needs $BUILD/tests/test_trace (make) and $PYTHON with the `perfetto` package (make deps).
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:?TEST_TMP must name a scratch directory}
CHECK=tests/py/trace_check.py

TRACE_TEST_OUT="$TEST_TMP" "$BUILD/tests/test_trace"

# Two ranks, each with a process, 2 thread and 2 counter tracks.
"$PYTHON" $CHECK "$TEST_TMP/two_ranks.pftrace" --json "$TEST_TMP/two_ranks.json" \
    --expect-tracks 10 --expect-slice step --expect-slice forward --expect-slice backward \
    --expect-slice send --expect-slice recv --expect-counter "mem params" --expect-counter "mem activations"
"$PYTHON" $CHECK "$TEST_TMP/live.pftrace" --json "$TEST_TMP/live.json" \
    --expect-slice outer --expect-slice inner --expect-counter "mem activations"

# Broken variants of the two-rank trace, one defect each.
"$PYTHON" - "$TEST_TMP" <<'PY'
import json, sys
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
out = sys.argv[1]
source = open(f"{out}/two_ranks.pftrace", "rb").read()
events = lambda t, kind: [p for p in t.packet if p.HasField("track_event") and p.track_event.type == kind]

def variant(name, mutate):
    trace = pb.Trace()
    trace.ParseFromString(source)
    mutate(trace)
    open(f"{out}/broken_{name}.pftrace", "wb").write(trace.SerializeToString())

def unknown_field(t):  # field 999, deep inside a track event
    event = events(t, pb.TrackEvent.TYPE_SLICE_BEGIN)[0].track_event
    event.ParseFromString(event.SerializeToString() + b"\xb8\x3e\x01")

variant("unknown_field", unknown_field)
variant("missing_end", lambda t: t.packet.remove(events(t, pb.TrackEvent.TYPE_SLICE_END)[0]))
variant("no_sequence", lambda t: events(t, pb.TrackEvent.TYPE_COUNTER)[0].ClearField("trusted_packet_sequence_id"))
variant("undeclared_track", lambda t: setattr(events(t, pb.TrackEvent.TYPE_SLICE_BEGIN)[1].track_event, "track_uuid", 12345))
variant("double_flow_start", lambda t: events(t, pb.TrackEvent.TYPE_SLICE_BEGIN)[0].track_event.flow_ids.append(
    next(p.track_event.flow_ids[0] for p in t.packet if p.track_event.flow_ids)))
variant("negative_time", lambda t: setattr(events(t, pb.TrackEvent.TYPE_SLICE_BEGIN)[0], "timestamp", 2**64 - 5))

doc = json.load(open(f"{out}/two_ranks.json"))
x = next(e for e in doc["traceEvents"] if e["ph"] == "X")
x["dur"], x["tid"] = -1, 0
json.dump(doc, open(f"{out}/broken.json", "w"))
PY
expect_rejected() {  # description, checker arguments...
    local what=$1; shift
    if "$PYTHON" $CHECK "$@" >"$TEST_TMP/rejected.log" 2>&1; then
        echo "trace_check accepted a trace with $what:"; cat "$TEST_TMP/rejected.log"; exit 1
    fi
    grep -q "FAIL" "$TEST_TMP/rejected.log" || { echo "trace_check crashed on $what:"; cat "$TEST_TMP/rejected.log"; exit 1; }
    echo "rejected as expected: $what ($(head -1 "$TEST_TMP/rejected.log"))"
}
for defect in unknown_field missing_end no_sequence undeclared_track double_flow_start negative_time; do
    expect_rejected "$defect" "$TEST_TMP/broken_$defect.pftrace"
done
expect_rejected "a missing slice" "$TEST_TMP/two_ranks.pftrace" --expect-slice no_such_slice
expect_rejected "a wrong track count" "$TEST_TMP/two_ranks.pftrace" --expect-tracks 3
expect_rejected "a JSON slice with negative dur and tid 0" "$TEST_TMP/two_ranks.pftrace" --json "$TEST_TMP/broken.json"
echo "t_trace_schema: OK"
