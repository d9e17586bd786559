"""Checks the ZeRO memory model against the allocator's measured peaks, from three trainer logs
(stage 1, 2, 3 on the same mesh). The trainer prints, per category, the formula's estimate and the
measured peak (chapters/03_fsdp/fsdp.c, fsdp_print_memory_estimate):

  exact formula (plus the padding of each unit to a multiple of N, under 1%):
    optimizer (every stage), params (stages 1-2), grads (stage 1)
  formula plus a few full units (transient): grads (stages 2-3), params (stage 3); the extra must
  be at most MAX_LIVE_UNITS times the largest unit, and more than zero.
And across stages: params(3) < params(2), grads(2) < grads(1). Stage 3 also logs how many
transformer blocks were in full at once and how many its reshard policy and prefetch allow: a block
kept gathered too long (a leak a few units' slack in bytes would hide) shows there.

usage: check_zero_memory.py stage1.log stage2.log stage3.log
"""
import re
import sys

MAX_LIVE_UNITS = 6   # stage 3 params: embedding + head (kept, default policy) + last block + current
                     # + prefetched; grads: tied embedding + current + 2 reductions in flight
PADDING_SLACK = 1.01

LINE = re.compile(r"^\s+(params|grads|optimizer)\s+\S+\s+=\s+([\d.]+) MiB\s+measured peak\s+([\d.]+) MiB")
UNIT = re.compile(r"largest unit in full is ([\d.]+) MiB")
BLOCKS = re.compile(r"at most (\d+) transformer block\(s\) were in full at once; the reshard policy and prefetch allow (\d+)")


def parse(path):
    found, unit, blocks = {}, None, None
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                found[m.group(1)] = (float(m.group(2)), float(m.group(3)))
            u = UNIT.search(line)
            if u:
                unit = float(u.group(1))
            b = BLOCKS.search(line)
            if b:
                blocks = (int(b.group(1)), int(b.group(2)))
    if len(found) != 3 or unit is None:
        sys.exit(f"{path}: no memory model lines (is it a --dp-shard run?)")
    return found, unit, blocks


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    logs = [parse(p) for p in sys.argv[1:]]
    failures = 0
    for stage, (cats, unit, _) in enumerate(logs, start=1):
        for cat, (est, peak) in cats.items():
            transient = (cat == "grads" and stage >= 2) or (cat == "params" and stage == 3)
            if transient:
                ok = est < peak <= est + MAX_LIVE_UNITS * unit + 1e-4
                rule = f"est < peak <= est + {MAX_LIVE_UNITS} x {unit:.4f}"
            else:
                ok = est - 1e-4 <= peak <= est * PADDING_SLACK + 1e-4
                rule = f"est <= peak <= est x {PADDING_SLACK}"
            print(f"zero-{stage} {cat:9s} estimate {est:8.4f} MiB  peak {peak:8.4f} MiB  ({rule})  "
                  f"{'ok' if ok else 'FAIL'}")
            failures += not ok
    blocks = logs[2][2]
    if blocks is None:
        print("zero-3 blocks in full at once: not logged  FAIL")
        failures += 1
    else:
        ok = 1 <= blocks[0] <= blocks[1]
        print(f"zero-3 blocks in full at once: {blocks[0]}, the policy allows {blocks[1]}  {'ok' if ok else 'FAIL'}")
        failures += not ok
    p = [c["params"][1] for c, _, _ in logs]
    g = [c["grads"][1] for c, _, _ in logs]
    for ok, what in ((p[2] < p[1], f"params peak zero-3 {p[2]} < zero-2 {p[1]}"),
                     (g[1] < g[0], f"grads peak zero-2 {g[1]} < zero-1 {g[0]}")):
        print(f"{what}: {'ok' if ok else 'FAIL'}")
        failures += not ok
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
