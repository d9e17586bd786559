"""PyTorch oracle for the C reference trainer.

    torch_oracle.py DUMP.safetensors [--dtype float32|float64]
        Rebuilds the model of the dump (format llama-ref-dump-v1, written by `train --dump`) in
        PyTorch, loads param.*, and checks: step-1 logits and loss, every step-1 gradient, then
        replays every step (clip_grad_norm_, AdamW with the dump's lr[k]) checking loss[k] and
        grad_norm[k], and finally every final.* parameter. Exit status 1 if anything is out of
        tolerance.

    torch_oracle.py --self-test [--tmp DIR]
        Needs no C trainer. Checks the oracle itself: (1) the torch forward against a loop-by-loop
        numpy implementation of the spec, (2) float64 autograd against central finite differences,
        (3) a float64 dump written by torch and replayed (exercises the dump reader and comparisons;
        errors must be ~0), (4) float32 torch against a float64 torch dump rounded to float32: the
        float32 tolerances below must hold for torch's own rounding error, with margin.

Error measure for each tensor: max_abs = max|a - b|, max_rel = max|a - b| / max|b| (b = torch),
plus the index of the worst element.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
from llama_torch import IGNORE_INDEX, Llama, LlamaConfig, rope_frequencies  # noqa: E402

# ---- tolerances (max_rel = max|c - torch| / max|torch| per tensor) -----------------------------
# Measured against build/train{,64} --model tiny --steps 10 --batch 4 --seq-len 32, seeds 1..5,
# peak lr 3e-4 (the test's setting), 1e-3 and 3e-3.
#
# float64 dumps (build/train64): the C code and torch evaluate the same formulas in the same
# precision; only the order of summations (matmul blocking, softmax/norm reductions) differs.
# Measured: logits <= 8e-16, loss <= 5e-16, gradients <= 2e-15, grad norms <= 2e-14, final
# parameters <= 2e-14 at lr 3e-4 and <= 1.1e-12 at lr 3e-3 (the Adam amplification described
# below, starting from 1e-16 instead of 1e-7). 1e-10 leaves room for bigger models and longer runs
# while still catching any formula difference (a 1e-6 change in one gradient element fails).
F64_LOGITS_REL = 1e-10
F64_LOSS_REL = 1e-10        # every step's loss
F64_GRAD_REL = 1e-10        # step-1 gradients, per tensor
F64_GRAD_NORM_REL = 1e-10   # every step's pre-clipping gradient norm
F64_FINAL_REL = 1e-10       # parameters after the last step
# float32 dumps (build/train): both sides round at every op, in different orders (blocked BLAS
# vs MKL/OpenBLAS-in-torch matmuls, different exp/rsqrt, double vs float accumulators), so they
# differ by a few float32 ulps (2^-24 ~ 6e-8) relative to a tensor's largest element.
# Measured: logits <= 3.3e-7, step-1 loss <= 7.2e-8, step-1 gradients <= 1.0e-6 (worst in
# attention projections). torch fp32 against the float64 truth (self-test) is of the same size:
# logits 3.8e-7, gradients 8.1e-7.
F32_LOGITS_REL = 5e-6
F32_LOSS_REL = 1e-6         # step-1 loss: a mean over B*T log-probabilities
F32_GRAD_REL = 1e-5         # step-1 gradients
# After step 1 the two fp32 trajectories separate: AdamW's update m / (sqrt(v) + eps) has size
# ~lr whatever the gradient's size, so an element whose gradient is tiny or nearly cancels (its
# relative error is large) moves by a visibly different amount on each side; the difference
# grows with lr and the number of steps and feeds back into later losses and gradients.
# Measured over 10 steps: losses <= 1.9e-7, grad norms <= 2.2e-7 at lr 3e-4 and <= 2.7e-6 at
# lr 3e-3; final parameters <= 3.7e-5 at lr 3e-4, <= 9e-5 at 1e-3, <= 2.2e-4 at 3e-3 (a few
# elements: at lr 3e-3, 138 of 180800 above 1e-5; the median element agrees to 1.4e-7).
F32_STEP_LOSS_REL = 2e-6    # losses of steps 2..n
F32_GRAD_NORM_REL = 2e-5    # grad norms of steps 1..n
F32_FINAL_REL = 5e-4        # final parameters (valid up to peak lr ~3e-3 over 10 steps)

TOLERANCES = {
    "float64": dict(logits=F64_LOGITS_REL, loss=F64_LOSS_REL, step_loss=F64_LOSS_REL,
                    grad=F64_GRAD_REL, grad_norm=F64_GRAD_NORM_REL, final=F64_FINAL_REL),
    "float32": dict(logits=F32_LOGITS_REL, loss=F32_LOSS_REL, step_loss=F32_STEP_LOSS_REL,
                    grad=F32_GRAD_REL, grad_norm=F32_GRAD_NORM_REL, final=F32_FINAL_REL),
}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
DUMP_FORMAT = "llama-ref-dump-v1"


# ---- comparison --------------------------------------------------------------------------------
class Report:
    def __init__(self, quiet=False):
        self.failures = []
        self.worst = {}  # kind -> largest max_rel seen
        self.quiet = quiet

    def compare(self, name, kind, got, want, tol):
        """got: from the dump (C); want: from torch. Both converted to float64 before comparing."""
        a = np.asarray(got, dtype=np.float64)
        b = np.asarray(want, dtype=np.float64)
        if a.shape != b.shape:
            self.failures.append(name)
            print(f"{name:44s} shape {a.shape} in the dump, {b.shape} in torch  FAIL")
            return False
        diff = np.abs(a - b)
        if not np.all(np.isfinite(a)):
            max_abs, idx = float("inf"), np.unravel_index(np.argmax(~np.isfinite(a)), a.shape)
        else:
            flat = int(np.argmax(diff)) if diff.size else 0
            idx = np.unravel_index(flat, a.shape) if a.ndim else ()
            max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(b).max()) if b.size else 0.0
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        ok = max_rel <= tol
        self.worst[kind] = max(self.worst.get(kind, 0.0), max_rel)
        if not ok:
            self.failures.append(name)
        if not self.quiet or not ok:
            where = "[" + ",".join(str(int(i)) for i in idx) + "]" if a.ndim else "-"
            print(f"{name:44s} max_abs {max_abs:9.3e}  max_rel {max_rel:9.3e}  worst {where:14s} "
                  f"(c {a[idx] if a.ndim else float(a):+.9e} torch {b[idx] if b.ndim else float(b):+.9e})"
                  f"  tol {tol:.0e}  {'ok' if ok else 'FAIL'}")
        return ok

    def summary(self):
        print("worst max_rel per kind: " + ", ".join(f"{k} {v:.3e}" for k, v in self.worst.items()))
        if self.failures:
            print(f"FAILED: {len(self.failures)} out of tolerance: {' '.join(self.failures[:20])}"
                  + (" ..." if len(self.failures) > 20 else ""))
        return not self.failures


# ---- the replay --------------------------------------------------------------------------------
def grad_global_norm(params):
    return torch.norm(torch.stack([torch.norm(p.grad.detach(), 2) for p in params]), 2)


def train_steps(model, inputs, targets, lrs, opt_cfg, on_step):
    """Runs len(lrs) steps of clip + AdamW. on_step(k, logits, loss, grad_norm) is called after each
    backward, before clipping and the update (so model grads are the unclipped gradients)."""
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=float(lrs[0]), betas=(opt_cfg["beta1"], opt_cfg["beta2"]),
                            eps=opt_cfg["eps"], weight_decay=opt_cfg["weight_decay"])
    clip = float(opt_cfg.get("grad_clip", 0.0))
    for k in range(len(lrs)):
        opt.zero_grad(set_to_none=True)
        tok = torch.from_numpy(np.asarray(inputs[k], dtype=np.int64))
        tgt = torch.from_numpy(np.asarray(targets[k], dtype=np.int64))
        logits = model(tok)
        loss = Llama.loss(logits, tgt)
        loss.backward()
        norm = grad_global_norm(params)
        on_step(k, logits, loss, norm)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for group in opt.param_groups:
            group["lr"] = float(lrs[k])
        opt.step()


def check_dump(path, dtype_name=None, quiet=False):
    tensors, meta = safetensors_io.load(path)
    if meta.get("format") != DUMP_FORMAT:
        raise SystemExit(f"{path}: format {meta.get('format')!r}, expected {DUMP_FORMAT!r}")
    cfg = LlamaConfig.from_dict(json.loads(meta["config"]))
    opt_cfg = {k: float(v) for k, v in json.loads(meta["optimizer"]).items()}
    steps = int(meta["steps"])
    dump_dtype = "float64" if tensors["logits"].dtype == np.float64 else "float32"
    dtype_name = dtype_name or dump_dtype
    tol = TOLERANCES["float32" if "float32" in (dtype_name, dump_dtype) else "float64"]
    dtype = TORCH_DTYPES[dtype_name]
    torch.manual_seed(0)
    model = Llama(cfg, dtype=dtype)
    model.load_numpy(tensors, prefix="param.")
    inputs, targets = tensors["inputs"], tensors["targets"]
    lrs = tensors["lr"]
    print(f"oracle: {path}: dump {dump_dtype}, torch {dtype_name} (torch {torch.__version__}); "
          f"config {json.dumps(cfg.to_dict())}; optimizer {json.dumps(opt_cfg)}; steps {steps}; "
          f"batch {inputs.shape[1]} seq {inputs.shape[2]}")
    assert inputs.shape[0] == steps and len(lrs) == steps, "steps in the metadata vs the tensors"
    rep = Report(quiet=quiet)

    def on_step(k, logits, loss, norm):
        if k == 0:
            rep.compare("logits", "logits", tensors["logits"], logits.detach().numpy(), tol["logits"])
            rep.compare("loss[0]", "loss", tensors["loss"][0], loss.item(), tol["loss"])
            for name, p in model.named_parameters():
                rep.compare("grad." + name, "grad", tensors["grad." + name], p.grad.numpy(), tol["grad"])
        else:
            rep.compare(f"loss[{k}]", "step_loss", tensors["loss"][k], loss.item(), tol["step_loss"])
        rep.compare(f"grad_norm[{k}]", "grad_norm", tensors["grad_norm"][k], norm.item(), tol["grad_norm"])

    train_steps(model, inputs, targets, lrs, opt_cfg, on_step)
    for name, p in model.named_parameters():
        rep.compare("final." + name, "final", tensors["final." + name], p.detach().numpy(), tol["final"])
    return rep.summary()


# ---- self-test ---------------------------------------------------------------------------------
# A config whose head_dim (8) puts RoPE's four frequency pairs in all three Llama 3.1 scaling
# branches (wavelengths 6.3, 167 kept; 4443 blended; 1.2e5 divided by 8), with GQA groups of 2.
SELF_TEST_CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=23,
                            max_seq_len=9, rope_scaling_factor=8.0)
SELF_TEST_OPT = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def numpy_reference_forward(cfg, w, tokens):
    """The spec written out element by element in float64 numpy (independent of llama_torch's
    vectorised code): complex RoPE, explicit kv head h // group, explicit causal loop."""
    hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    i = np.arange(hd // 2)
    f = cfg.rope_theta ** (-2.0 * i / hd)
    if cfg.rope_scaling_factor > 0:
        wl = 2 * np.pi / f
        orig, lo, hi, fac = (cfg.rope_original_max_seq_len, cfg.rope_low_freq_factor,
                             cfg.rope_high_freq_factor, cfg.rope_scaling_factor)
        smooth = (orig / wl - lo) / (hi - lo)
        f = np.where(wl < orig / hi, f, np.where(wl > orig / lo, f / fac, (1 - smooth) * f / fac + smooth * f))

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g

    def rope(v, t):  # v: (n, hd) for one position
        z = (v[:, 0::2] + 1j * v[:, 1::2]) * np.exp(1j * t * f)
        out = np.empty_like(v)
        out[:, 0::2], out[:, 1::2] = z.real, z.imag
        return out

    B, T = tokens.shape
    x = w["tok_embeddings.weight"][tokens]
    for layer in range(cfg.n_layers):
        p = lambda s: w[f"layers.{layer}.{s}.weight"]  # noqa: E731
        n1 = rms(x, p("attention_norm"))
        att = np.zeros((B, T, H * hd))
        for b in range(B):
            q = np.stack([rope((n1[b, t] @ p("attention.wq").T).reshape(H, hd), t) for t in range(T)])
            k = np.stack([rope((n1[b, t] @ p("attention.wk").T).reshape(KV, hd), t) for t in range(T)])
            v = (n1[b] @ p("attention.wv").T).reshape(T, KV, hd)
            for h in range(H):
                kvh = h // (H // KV)
                for t in range(T):
                    s = np.array([q[t, h] @ k[u, kvh] for u in range(t + 1)]) / math.sqrt(hd)
                    a = np.exp(s - s.max())
                    a /= a.sum()
                    att[b, t, h * hd:(h + 1) * hd] = a @ v[:t + 1, kvh]
        h_ = x + att @ p("attention.wo").T
        n2 = rms(h_, p("ffn_norm"))
        g = n2 @ p("feed_forward.w1").T
        x = h_ + ((g / (1 + np.exp(-g))) * (n2 @ p("feed_forward.w3").T)) @ p("feed_forward.w2").T
    out_w = w["tok_embeddings.weight"] if cfg.tied else w["output.weight"]
    return rms(x, w["norm.weight"]) @ out_w.T


def random_batch(cfg, B, T, steps, rng):
    inputs = rng.integers(0, cfg.vocab_size, size=(steps, B, T)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, size=(steps, B, T)).astype(np.int32)
    targets[:, 0, :2] = IGNORE_INDEX  # a few ignored targets
    return inputs, targets


def make_dump(path, cfg, opt_cfg, steps, B, T, store_dtype, seed=0):
    """Writes a dump in the C trainer's format computed by torch in float64. Parameters are first
    rounded to store_dtype so that the dump is exactly consistent with what it stores."""
    rng = np.random.default_rng(seed)
    model = Llama(cfg, dtype=torch.float64).init_random(seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(store_dtype).to(torch.float64))
    inputs, targets = random_batch(cfg, B, T, steps, rng)
    lrs = np.array([1e-3 * min(1.0, (k + 1) / 3) for k in range(steps)], dtype=np.float64)
    out = {"inputs": inputs, "targets": targets}
    npd = np.float32 if store_dtype == torch.float32 else np.float64
    for name, a in model.to_numpy().items():
        out["param." + name] = a.astype(npd)
    losses, norms = np.zeros(steps), np.zeros(steps)

    def on_step(k, logits, loss, norm):
        losses[k], norms[k] = loss.item(), norm.item()
        if k == 0:
            out["logits"] = logits.detach().numpy().astype(npd)
            for name, g in model.to_numpy(grads=True).items():
                out["grad." + name] = g.astype(npd)

    train_steps(model, inputs, targets, lrs, opt_cfg, on_step)
    out.update(loss=losses, grad_norm=norms, lr=lrs)
    for name, a in model.to_numpy().items():
        out["final." + name] = a.astype(npd)
    safetensors_io.save(path, out, {"format": DUMP_FORMAT, "config": json.dumps(cfg.to_dict()),
                                    "optimizer": json.dumps(opt_cfg), "steps": str(steps)})


def self_test(tmp):
    torch.manual_seed(0)
    ok = True
    rng = np.random.default_rng(1)
    # (1) forward against the numpy loops, untied with Llama 3.1 RoPE scaling, and tied without.
    f = rope_frequencies(SELF_TEST_CFG)
    base = LlamaConfig(**{**SELF_TEST_CFG.to_dict(), "rope_scaling_factor": 0.0})
    n_scaled = int(np.sum(np.abs(f - rope_frequencies(base)) > 0))
    print(f"self-test: rope frequencies {np.array2string(f, precision=4)} ({n_scaled} of {len(f)} scaled)")
    for tied in (False, True):
        cfg = LlamaConfig(**{**SELF_TEST_CFG.to_dict(), "tied": tied,
                             "rope_scaling_factor": 0.0 if tied else 8.0})
        model = Llama(cfg, dtype=torch.float64).init_random(seed=3, std=0.3)
        with torch.no_grad():  # non-trivial norm weights
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.2)
        tokens = rng.integers(0, cfg.vocab_size, size=(2, cfg.max_seq_len))
        want = numpy_reference_forward(cfg, model.to_numpy(), tokens)
        got = model(torch.from_numpy(tokens)).detach().numpy()
        rel = np.abs(got - want).max() / np.abs(want).max()
        good = rel < 1e-12
        ok &= good
        print(f"self-test: forward vs numpy spec loops (tied={tied}): max_rel {rel:.2e} (tol 1e-12) "
              f"{'ok' if good else 'FAIL'}")

        # (2) float64 autograd against central differences, 3 elements of every parameter.
        tgt = rng.integers(0, cfg.vocab_size, size=tokens.shape)
        tgt[0, :2] = IGNORE_INDEX
        tok_t, tgt_t = torch.from_numpy(tokens), torch.from_numpy(tgt)
        model.zero_grad()
        Llama.loss(model(tok_t), tgt_t).backward()
        worst = 0.0
        eps_fd = 1e-5
        for name, p in model.named_parameters():
            g = p.grad.numpy().ravel()
            scale = np.abs(g).max()
            picks = list(rng.choice(p.numel(), size=2, replace=False)) + [int(np.argmax(np.abs(g)))]
            for j in picks:
                with torch.no_grad():
                    flat = p.view(-1)
                    orig = flat[j].item()
                    flat[j] = orig + eps_fd
                    lp = Llama.loss(model(tok_t), tgt_t).item()
                    flat[j] = orig - eps_fd
                    lm = Llama.loss(model(tok_t), tgt_t).item()
                    flat[j] = orig
                fd = (lp - lm) / (2 * eps_fd)
                worst = max(worst, abs(fd - g[j]) / scale)
        good = worst < 1e-7
        ok &= good
        print(f"self-test: autograd vs finite differences (tied={tied}, {3 * len(list(model.parameters()))} "
              f"elements): max |fd - grad| / max|grad| {worst:.2e} (tol 1e-7) {'ok' if good else 'FAIL'}")

    # (3) float64 dump written by torch, checked by torch: exercises the reader and comparisons.
    tiny = LlamaConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=256,
                       max_seq_len=32)
    p64 = os.path.join(tmp, "selftest_f64.safetensors")
    make_dump(p64, tiny, SELF_TEST_OPT, steps=10, B=4, T=32, store_dtype=torch.float64)
    print("self-test: float64 torch dump vs float64 torch replay")
    good = check_dump(p64, quiet=True)
    ok &= good
    # (4) the same in float32: torch float32 against float64 truth rounded to float32. The C fp32
    # trainer differs from torch fp32 by about as much as each differs from the truth, so these
    # errors should sit well inside the float32 tolerances.
    p32 = os.path.join(tmp, "selftest_f32.safetensors")
    make_dump(p32, tiny, SELF_TEST_OPT, steps=10, B=4, T=32, store_dtype=torch.float32)
    print("self-test: float64 torch dump (stored float32) vs float32 torch replay")
    good = check_dump(p32, quiet=True)
    ok &= good
    # (5) the comparisons must catch a small error: one gradient element off by 1e-6 relative
    # (far below anything visible in the loss) must fail the float64 check.
    tensors, meta = safetensors_io.load(p64)
    g = tensors["grad.layers.1.attention.wk.weight"]
    g[3, 5] += 1e-6 * np.abs(g).max()
    bad = os.path.join(tmp, "selftest_f64_bad.safetensors")
    safetensors_io.save(bad, tensors, meta)
    print("self-test: the same float64 dump with one gradient element off by 1e-6 (must be caught)")
    caught = not check_dump(bad, quiet=True)
    ok &= caught
    print(f"self-test: corrupted dump {'caught' if caught else 'NOT caught'}")
    print("self-test: " + ("PASS" if ok else "FAIL"))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", nargs="?", help="safetensors dump written by train --dump")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="torch dtype (default: the dump's)")
    ap.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    ap.add_argument("--self-test", action="store_true", help="check the oracle itself (no dump needed)")
    ap.add_argument("--tmp", help="folder for the self-test dumps (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2") or 2))
    if args.self_test:
        if args.tmp:
            os.makedirs(args.tmp, exist_ok=True)
            return 0 if self_test(args.tmp) else 1
        with tempfile.TemporaryDirectory() as tmp:
            return 0 if self_test(tmp) else 1
    if not args.dump:
        ap.error("a dump path or --self-test is required")
    return 0 if check_dump(args.dump, args.dtype, args.quiet) else 1


if __name__ == "__main__":
    sys.exit(main())
