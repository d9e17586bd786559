"""Chapter 9's FP8 all-gather on the wire: the all-gather slices of two Chrome traces of the same
ZeRO-3 run, one with fp32 all-gathers and one with --fp8-all-gather, matched in order per rank.

    check_fp8_all_gather.py FP32.json FP8.json --dim D --n-heads H --n-kv-heads K --ffn F --vocab V --ranks N

What each all-gather must carry is computed here from the model's shapes, independently of the
trainer: a unit of U elements is padded to N x S (S = ceil(U / N)); in fp32 the gather moves 4 x S x N
bytes. With FP8, rank r sends its slice [r S, r S + S) of the unit (without the padding), one byte per
element of a projection (wq wk wv wo w1 w2 w3) and four per other element (the norms); every rank's
part is padded to the largest, so a block's gather moves N x that. The embedding and the head have no
projection and move the same bytes either way. Exit 1, naming the first mismatch, otherwise one line
with the totals and their ratio.
"""
import argparse
import pathlib
import sys
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "traces"))  # trace_summary
from trace_summary import load_chrome_events  # noqa: E402


def gathers(path):
    """The all_gather slices' byte counts, per process (rank), in time order."""
    events = load_chrome_events(path)
    per_rank = defaultdict(list)
    for e in sorted((e for e in events if e.get("name") == "all_gather" and "bytes" in e.get("args", {})),
                    key=lambda e: e["ts"]):
        per_rank[e["pid"]].append(e["args"]["bytes"])
    return per_rank


def block_tensors(a):
    """(elements, bytes per element in FP8 mode) of one block's tensors, in the table's order."""
    hd = a.dim // a.n_heads
    q, kv = a.n_heads * hd, a.n_kv_heads * hd
    shapes = [(a.dim, 4), (q * a.dim, 1), (kv * a.dim, 1), (kv * a.dim, 1), (a.dim * q, 1), (a.dim, 4),
              (a.ffn * a.dim, 1), (a.dim * a.ffn, 1), (a.ffn * a.dim, 1)]
    return shapes


def wire_bytes(tensors, n):
    """fp32 bytes and FP8 bytes of one unit's all-gather over n ranks."""
    total = sum(e for e, _ in tensors)
    s = -(-total // n)
    per_rank = []
    for r in range(n):
        lo, hi = r * s, min(r * s + s, total)
        b, start = 0, 0
        for elements, width in tensors:
            overlap = max(0, min(hi, start + elements) - max(lo, start))
            b += overlap * width
            start += elements
        per_rank.append(b)
    return 4 * s * n, max(per_rank) * n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fp32")
    ap.add_argument("fp8")
    for flag in ("dim", "n-heads", "n-kv-heads", "ffn", "vocab", "ranks"):
        ap.add_argument("--" + flag, type=int, required=True)
    a = ap.parse_args()
    block_fp32, block_fp8 = wire_bytes(block_tensors(a), a.ranks)
    embedding_fp32, _ = wire_bytes([(a.vocab * a.dim, 4)], a.ranks)
    head_fp32, _ = wire_bytes([(a.dim, 4), (a.vocab * a.dim, 4)], a.ranks)
    expected = {block_fp32: block_fp8, embedding_fp32: embedding_fp32, head_fp32: head_fp32}
    if len(expected) != 3:
        sys.exit("check_fp8_all_gather: the units' fp32 sizes coincide; pick shapes that tell them apart")
    plain, fp8 = gathers(a.fp32), gathers(a.fp8)
    if sorted(plain) != sorted(fp8) or not plain:
        sys.exit(f"FAIL: ranks with all-gathers differ: {sorted(plain)} vs {sorted(fp8)}")
    totals = [0, 0]
    for rank in sorted(plain):
        if len(plain[rank]) != len(fp8[rank]):
            sys.exit(f"FAIL: rank {rank}: {len(plain[rank])} all-gathers in fp32, {len(fp8[rank])} with FP8")
        for i, (b32, b8) in enumerate(zip(plain[rank], fp8[rank])):
            if b32 not in expected:
                sys.exit(f"FAIL: rank {rank} all-gather {i}: {b32} bytes in fp32 is no unit's 4 x S x N "
                         f"(block {block_fp32}, embedding {embedding_fp32}, head {head_fp32})")
            if b8 != expected[b32]:
                sys.exit(f"FAIL: rank {rank} all-gather {i}: {b8} bytes with FP8, expected {expected[b32]} "
                         f"(fp32: {b32})")
            totals[0] += b32
            totals[1] += b8
    print(f"ok: all-gather bytes {totals[0]} in fp32, {totals[1]} with FP8 ({totals[1] / totals[0]:.3f}x); "
          f"a block {block_fp32} -> {block_fp8} ({block_fp8 / block_fp32:.3f}x)")


if __name__ == "__main__":
    main()
