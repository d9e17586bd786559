"""Checks the ZeRO memory model against the allocator's measured peaks, from three trainer logs
(stage 1, 2, 3 on the same mesh). The trainer prints, per category, the formula's estimate and the
measured peak (chapters/03_fsdp/fsdp.c, fsdp_print_memory_estimate):

  exact formula (plus the padding of each unit to a multiple of N, under 1%):
    optimizer (every stage), params (stages 1-2), grads (stage 1)
  formula plus a few full units (transient): grads (stages 2-3), params (stage 3); the extra must
  be at most MAX_LIVE_UNITS times the largest unit, and more than zero.
And across stages: params(3) < params(2), grads(2) < grads(1). Stage 3 also logs how many
transformer blocks were in full at once, how many its reshard policy and prefetch allow, and how many
were still in full when a backward ended: a block kept gathered too long (a leak that a few units'
slack in bytes would hide) shows in the first or the third.

usage: check_zero_memory.py stage1.log stage2.log stage3.log
       check_zero_memory.py --blocks stage3.log...   (the block counts alone, of any zero-3 runs)
"""
import re
import sys

MAX_LIVE_UNITS = 6   # stage 3 params: embedding + head (kept, default policy) + last block + current
                     # + prefetched; grads: tied embedding + current + 2 reductions in flight
PADDING_SLACK = 1.01

LINE = re.compile(r"^\s+(params|grads|optimizer)\s+\S+\s+=\s+([\d.]+) MiB\s+measured peak\s+([\d.]+) MiB")
UNIT = re.compile(r"largest unit in full is ([\d.]+) MiB")
BLOCKS = re.compile(r"at most (\d+) transformer block\(s\) were in full at once; the reshard policy and prefetch "
                    r"allow (\d+); (\d+) left in full after a backward")


def parse(path):
    found, unit = {}, None
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                found[m.group(1)] = (float(m.group(2)), float(m.group(3)))
            u = UNIT.search(line)
            if u:
                unit = float(u.group(1))
    if len(found) != 3 or unit is None:
        sys.exit(f"{path}: no memory model lines (is it a --dp-shard run?)")
    return found, unit


def parse_blocks(path):
    """The block counts of a zero-3 log (the GPU's prints them without the CPU's memory lines), or None."""
    with open(path) as f:
        found = [BLOCKS.search(line) for line in f]
    found = [b for b in found if b]
    return tuple(int(g) for g in found[-1].groups()) if found else None


def check_blocks(name, blocks):
    """1 on a failure: no line, more blocks in full at once than allowed, or any left after a backward."""
    if blocks is None:
        print(f"{name}: zero-3 blocks in full: not logged  FAIL")
        return 1
    most, allowed, left = blocks
    ok = 1 <= most <= allowed and left == 0
    print(f"{name}: zero-3 blocks in full at once: {most}, the policy allows {allowed}; {left} left after a backward"
          f"  {'ok' if ok else 'FAIL'}")
    return int(not ok)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--blocks":
        sys.exit(1 if sum(check_blocks(p, parse_blocks(p)) for p in sys.argv[2:]) else 0)
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    logs = [parse(p) for p in sys.argv[1:]]
    failures = 0
    for stage, (cats, unit) in enumerate(logs, start=1):
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
    failures += check_blocks(sys.argv[3], parse_blocks(sys.argv[3]))
    p = [c["params"][1] for c, _ in logs]
    g = [c["grads"][1] for c, _ in logs]
    for ok, what in ((p[2] < p[1], f"params peak zero-3 {p[2]} < zero-2 {p[1]}"),
                     (g[1] < g[0], f"grads peak zero-2 {g[1]} < zero-1 {g[0]}")):
        print(f"{what}: {'ok' if ok else 'FAIL'}")
        failures += not ok
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
