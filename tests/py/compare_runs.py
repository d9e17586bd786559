"""Compares two training runs of build/train: the per-step losses and gradient norms in their logs and the parameters
in their final checkpoints. For each parameter prints max abs error, max relative error
(max|a - b| / max|b|) and the worst index; exits 1 if a loss or a parameter is off by more than
its tolerance, or is not finite. --exact compares the stored bytes (so -0.0 against +0.0 is a
mismatch). --prefix takes a comma-separated list (param.,adam_m.,adam_v.: the weights and both AdamW
moments); a tensor with one of the prefixes in only one of the two files is a mismatch. With --param-norm-rtol the bound is on ||a - b|| / ||b|| (Frobenius norms) instead:
for FP8 runs, where one element rounding to the neighbouring FP8 value moves a few gradient
entries by several percent of the tensor's largest while leaving the tensor as a whole close.

    compare_runs.py --log A.log --log-ref REF.log --ckpt A.safetensors --ckpt-ref REF.safetensors \\
                    --loss-rtol 1e-6 --param-rtol 1e-4 [--exact]
"""
import argparse
import re
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import safetensors_io  # noqa: E402

STEP = re.compile(r"^step +(\d+) \| loss ([0-9.eE+-]+)")
GRAD_NORM = re.compile(r"^step +(\d+) \| .*\| grad_norm ([0-9.eE+-]+|nan|inf|-nan) ")


def losses(path):
    with open(path) as f:
        return {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, f) if m}


def grad_norms(path):
    """step -> (value, the unit of its last printed digit): the log rounds it to a few decimals."""
    out = {}
    with open(path) as f:
        for m in map(GRAD_NORM.match, f):
            if m:
                text = m.group(2)
                decimals = len(text.split(".")[1]) if "." in text and "e" not in text.lower() else 0
                out[int(m.group(1))] = (float(text), 10.0 ** -decimals if decimals else 0.0)
    return out


def compare_grad_norms(log, log_ref, rtol):
    """The logged gradient norm (before clipping) within rtol plus one unit of the digit the log rounds
    it to (rtol 0: the printed values equal, no digit of slack): a gradient N times too large (a sum
    where a mean belongs) leaves the losses and, through clipping and AdamW's scale invariance, the
    weights alone, but not this. Returns 1 on a mismatch."""
    ours, ref = grad_norms(log), grad_norms(log_ref)
    if not ref or set(ours) != set(ref):
        print(f"FAIL: grad_norm logged at other steps: {sorted(ours)} vs {sorted(ref)}")
        return 1
    def slack(s):
        return max(ours[s][1], ref[s][1]) if rtol > 0 else 0.0
    over = [(s, ours[s][0], ref[s][0]) for s in ref
            if not abs(ours[s][0] - ref[s][0]) <= rtol * abs(ref[s][0]) + slack(s)]
    print(f"grad_norm: {len(ref)} steps, within rtol {rtol:.1e}" + (" + one printed digit" if rtol > 0 else "")
          + (f"  MISMATCH at step {over[0][0]}: {over[0][1]} vs {over[0][2]}" if over else ""))
    return int(bool(over))


def same_value_note(a, b):
    """Why two tensors of equal values fail --exact."""
    if a.dtype != b.dtype:
        return f" (equal values, dtype {a.dtype} vs {b.dtype})"
    return " (equal values, other bytes: a zero of the other sign)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log"), ap.add_argument("--log-ref")
    ap.add_argument("--ckpt"), ap.add_argument("--ckpt-ref")
    ap.add_argument("--loss-rtol", type=float, default=0.0)
    ap.add_argument("--grad-norm-rtol", type=float, default=None,
                    help="also compare the logged grad_norm: relative bound, plus one unit of its last printed "
                         "digit; 0: the printed values must be equal (not compared without it)")
    ap.add_argument("--param-rtol", type=float, default=0.0)
    ap.add_argument("--param-norm-rtol", type=float, default=None,
                    help="bound ||a - b|| / ||b|| per tensor instead of max|a - b| / max|b|")
    ap.add_argument("--exact", action="store_true", help="require bit-identical tensors (the stored bytes)")
    ap.add_argument("--prefix", default="param.",
                    help="tensors compared in the --ckpt files, comma-separated prefixes (grad. for --grad-dump "
                         "files against a --dump; param.,adam_m.,adam_v. for the whole training state)")
    args = ap.parse_args()
    failures = 0
    if args.log:
        ours, ref = losses(args.log), losses(args.log_ref)
        if not ref or set(ours) != set(ref):
            print(f"FAIL: logged steps differ: {sorted(ours)} vs {sorted(ref)}")
            return 1
        # A NaN or inf loss in either log is a mismatch (NaN compares false with every bound).
        errs = [abs(ours[s] - ref[s]) / abs(ref[s]) if np.isfinite(ours[s]) and np.isfinite(ref[s]) else np.inf
                for s in ref]
        worst = max(errs)
        print(f"loss: {len(ref)} steps, max rel err {worst:.3e} (rtol {args.loss_rtol:.1e})"
              f"{'  MISMATCH' if worst > args.loss_rtol else ''}")
        failures += worst > args.loss_rtol
        if args.grad_norm_rtol is not None:
            failures += compare_grad_norms(args.log, args.log_ref, args.grad_norm_rtol)
    if args.ckpt:
        ours, _ = safetensors_io.load(args.ckpt)
        ref, _ = safetensors_io.load(args.ckpt_ref)
        worst_rel = 0.0
        matched = 0
        by_norm = args.param_norm_rtol is not None
        what, bound = ("norm rel err", args.param_norm_rtol) if by_norm else ("max rel err", args.param_rtol)
        prefixes = tuple(args.prefix.split(","))
        for name in sorted(set(ours) - set(ref)):
            if name.startswith(prefixes):
                print(f"  {name:44s} only in {args.ckpt}  MISMATCH")
                failures += 1
        for name in sorted(ref):
            if not name.startswith(prefixes):
                continue
            matched += 1
            if name not in ours or ours[name].shape != ref[name].shape:
                print(f"  {name:44s} {'missing' if name not in ours else f'shape {ours[name].shape} vs {ref[name].shape}'}"
                      f"  MISMATCH")
                failures += 1
                continue
            a, b = ours[name].astype(np.float64), ref[name].astype(np.float64)
            # A NaN or inf anywhere is a mismatch (NaN compares false with every bound: count it apart).
            nonfinite = int(np.count_nonzero(~np.isfinite(a)) + np.count_nonzero(~np.isfinite(b)))
            diff = np.abs(a - b)
            diff[np.isnan(diff)] = np.inf
            idx = int(np.argmax(diff))
            scale = np.abs(b[np.isfinite(b)]).max() if np.isfinite(b).any() else 0.0
            rel = diff.flat[idx] / max(scale, 1e-30)
            norm_rel = (np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) if nonfinite == 0 else np.inf
            measured = norm_rel if by_norm else rel
            worst_rel = max(worst_rel, measured)
            same_bytes = ours[name].dtype == ref[name].dtype and ours[name].tobytes() == ref[name].tobytes()
            bad = nonfinite > 0 or (not same_bytes if args.exact else not measured <= bound)
            if bad or diff.max() > 0 and measured == worst_rel:
                print(f"  {name:44s} max_abs {diff.max():.3e} max_rel {rel:.3e} norm_rel {norm_rel:.3e} worst [{idx}] "
                      f"{a.flat[idx]:.9g} vs {b.flat[idx]:.9g}{f' ({nonfinite} not finite)' if nonfinite else ''}"
                      f"{same_value_note(ours[name], ref[name]) if bad and nonfinite == 0 and diff.max() == 0 else ''}"
                      f"{'  MISMATCH' if bad else ''}")
            failures += bad
        if matched == 0:
            print(f"  no tensor named {args.prefix.replace(',', '* or ')}* in {args.ckpt_ref}  MISMATCH")
            failures += 1
        print(f"{args.prefix.replace(',', '*, ')}* tensors{' after the last step' if args.prefix == 'param.' else ''}: "
              f"{what} {worst_rel:.3e} "
              f"({'exact required' if args.exact else f'rtol {bound:.1e}'})")
    if failures:
        print(f"FAIL: {failures} mismatches (marked MISMATCH above)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
