"""Hugging Face Llama interop against transformers' own LlamaForCausalLM.

    hf_interop.py --build BUILD --tmp DIR [--case NAME]

For each case below, transformers builds a tiny LlamaForCausalLM with random weights of its own
and writes it with save_pretrained (safetensors). Then:
  import   BUILD/tests/hf_driver grads loads it and runs one forward and backward: its logits, loss
           and every gradient must equal HF's (fp32 build vs HF in fp32; float64 build vs HF in
           float64, fp32 weights cases only);
  slices   hf_driver slices: every tensor-parallel shard and some flat ranges read from the file
           equal the same slices of the whole tensors, bit for bit;
  export   hf_driver export writes it back (one file, and shards with a tiny size limit): transformers
           loads the result and gives the same logits bit for bit, and the tensors are bit-identical
           to the ones transformers saved (fp32 cases; bf16/f16 come back as their fp32 values).
Then bad files (hf_driver must exit 2 with one line): a missing config key, a shape mismatch, an
unsupported rope_scaling type, a missing shard.
Then the trainer (BUILD/train --init-from hf:DIR --export-hf OUT): its step-1 logits and loss (--dump)
equal HF's on the same tokens; with lr 0 the export is bit-identical to the input under every layout
(single, --tp 2, --dp-shard 2 (ZeRO-3), --pp 2, --tp 2 x --dp-shard 2: each rank read only its part;
--device cuda on the CUDA emulator where it is built);
a sharded export loads in transformers; bad flags exit 2.

Error measure per tensor: max_rel = max|ours - HF| / max|HF|, as tests/py/torch_oracle.py.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

import safetensors.torch  # noqa: E402 (bf16 tensors, which numpy lacks)

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

# ---- tolerances (max_rel = max|ours - HF| / max|HF| per tensor) --------------------------------
# fp32: both sides round at every op, in different orders (OpenBLAS vs torch's matmuls, blockwise
# vs full softmax, float vs double accumulators), so they differ by a few fp32 ulps (2^-24 ~ 6e-8)
# relative to a tensor's largest element, more where a gradient sums many such terms. These are
# the bounds tests/py/torch_oracle.py uses for the same model against its own torch Llama.
# Measured over the cases below: logits <= 3.6e-7, loss <= 8.1e-8, gradients <= 7.2e-7.
F32_LOGITS_REL = 5e-6
F32_LOSS_REL = 1e-6
F32_GRAD_REL = 1e-5
# float64: the same formulas in the same precision, only the order of sums differs: ~1e-16 per op.
# Measured: logits <= 6.6e-16, loss <= 2e-16, gradients <= 1.4e-15. 1e-12 leaves room and still
# catches any difference of formula (HF's fp32 logits alone, left in, showed as 7e-8).
F64_REL = 1e-12

B, T = 2, 16
IGNORE_INDEX = -100


def tiny_config(tied, rope_scaling, kv_heads=2):
    # dim 64, 4 heads of 16 (8 RoPE pairs), GQA 4:2, vocab divisible by 4 for the tp 4 slices.
    # rope theta 10000 and original_max_position_embeddings 16 put the 8 frequencies on both sides
    # of and inside llama3's interpolation band, so every branch of its scaling is used.
    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                       rope_scaling=rope_scaling, attn_implementation="eager",
                       bos_token_id=90, eos_token_id=[91, 92])


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "untied": dict(tied=False, rope_scaling=None),
    "tied": dict(tied=True, rope_scaling=None),
    "untied_llama3": dict(tied=False, rope_scaling=LLAMA3),
    "tied_llama3_mha": dict(tied=True, rope_scaling=LLAMA3, kv_heads=4),
    "bf16": dict(tied=True, rope_scaling=LLAMA3, dtype=torch.bfloat16),
    "f16_sharded": dict(tied=False, rope_scaling=None, dtype=torch.float16, shard="20KB"),
}


def max_rel(ours, ref):
    """(max|ours - ref| / max|ref|, max|ours - ref|, the worst flat index); inf at the first element
    that is not finite on either side, so a NaN fails every bound."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    bad = ~(np.isfinite(ours) & np.isfinite(ref))
    if bad.any():
        return float("inf"), float("inf"), int(np.argmax(bad))
    diff = np.abs(ours - ref)
    worst = int(np.argmax(diff)) if diff.size else 0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return (float(diff.max()) / scale if scale > 0 else float(diff.max())), float(diff.max()), worst


class Checker:
    def __init__(self):
        self.failures = 0

    def close(self, what, ours, ref, tol):
        rel, abs_err, worst = max_rel(ours, ref)
        ok = rel <= tol and ours.shape == ref.shape
        print(f"  {'ok  ' if ok else 'FAIL'} {what}: max_rel {rel:.2e} (tol {tol:.0e}), max_abs {abs_err:.2e},"
              f" worst index {worst}")
        self.failures += not ok
        return rel

    def true(self, what, cond, detail=""):
        print(f"  {'ok  ' if cond else 'FAIL'} {what}{': ' + detail if detail else ''}")
        self.failures += not cond


def run(cmd, expect_rc=0):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if expect_rc is not None and p.returncode != expect_rc:
        print(f"  FAIL {' '.join(cmd)} -> rc {p.returncode}\n{p.stdout}{p.stderr}")
        raise SystemExit(1)
    return p


# ---- HF in float64 ----------------------------------------------------------------------------
# transformers 4.44 computes four things in fp32 whatever the model's dtype: the RMSNorm (it casts
# to float32), the attention softmax (dtype=torch.float32), the RoPE angles (inv_freq and
# position ids .float()) and the logits (hf_reference applies lm_head itself). For the float64 comparison these run in the model's dtype; the RoPE
# frequencies are then computed in float64 by the same formulas as transformers' (default and llama3).
def inv_freq_f64(cfg):
    hd = cfg.hidden_size // cfg.num_attention_heads
    freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rs = cfg.rope_scaling
    if not rs:
        return freq
    factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
        rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old / low, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


@contextmanager
def hf_in_float64(cfg):
    inv_freq = inv_freq_f64(cfg)

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        angles = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    softmax = torch.nn.functional.softmax

    def softmax_in_input_dtype(x, dim=None, dtype=None, **kw):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype, **kw)

    saved = (modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward)
    modeling_llama.LlamaRMSNorm.forward = rms_forward
    modeling_llama.LlamaRotaryEmbedding.forward = rope_forward
    torch.nn.functional.softmax = softmax_in_input_dtype
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward = saved
        torch.nn.functional.softmax = softmax


# ---- one case ---------------------------------------------------------------------------------
def hf_reference(model, inputs, targets):
    """Logits, loss and {HF name: gradient} of one forward and backward (loss: mean cross-entropy
    over targets != IGNORE_INDEX, as the reference computes it; HF's own `labels` path shifts by
    one). LlamaForCausalLM.forward casts the logits to fp32, so the head is applied here: the body
    (model.model) and lm_head are HF's, and the logits keep the model's dtype."""
    model.zero_grad()
    logits = model.lm_head(model.model(input_ids=inputs).last_hidden_state)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    return logits.detach().numpy(), float(loss), grads


def read_hf_dir(path):
    """{name: torch tensor} of every tensor of an HF checkpoint directory (single file or shards)."""
    index = os.path.join(path, "model.safetensors.index.json")
    files = ["model.safetensors"] if os.path.exists(os.path.join(path, "model.safetensors")) else \
        sorted(set(json.load(open(index))["weight_map"].values()))
    tensors = {}
    for f in files:
        tensors.update(safetensors.torch.load_file(os.path.join(path, f)))
    return tensors


def compare_import(chk, driver, model_dir, tokens, out, model, inputs, targets, f64):
    os.makedirs(out, exist_ok=True)
    run([driver, "grads", model_dir, tokens, out])
    ours, _ = safetensors_io.load(os.path.join(out, "out.safetensors"))
    our_grads = {n: t.numpy() for n, t in read_hf_dir(os.path.join(out, "grads")).items()}
    logits, loss, grads = hf_reference(model, inputs, targets)
    tag = "f64" if f64 else "f32"
    chk.close(f"{tag} logits", ours["logits"], logits, F64_REL if f64 else F32_LOGITS_REL)
    chk.close(f"{tag} loss", np.array(ours["loss"]), np.array(loss), F64_REL if f64 else F32_LOSS_REL)
    worst, worst_name = 0.0, ""
    for name, g in grads.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the same tensor as embed_tokens, whose gradient holds both uses
        if name not in our_grads:
            chk.true(f"{tag} gradient {name}", False, "missing from the export")
            continue
        rel, _, _ = max_rel(our_grads[name], g)
        if not rel <= worst:
            worst, worst_name = rel, name
        if not rel <= (F64_REL if f64 else F32_GRAD_REL):
            chk.close(f"{tag} grad {name}", our_grads[name], g, F64_REL if f64 else F32_GRAD_REL)
    chk.true(f"{tag} all {len(grads)} gradients", worst <= (F64_REL if f64 else F32_GRAD_REL),
             f"worst max_rel {worst:.2e} ({worst_name})")


def compare_export(chk, driver, model_dir, out, shard_bytes, model, inputs, exact_bits):
    args = [driver, "export", model_dir, out] + ([str(shard_bytes)] if shard_bytes else [])
    run(args)
    shards = [f for f in os.listdir(out) if f.startswith("model-")]
    if shard_bytes:
        chk.true(f"export in {len(shards)} shards + index", len(shards) > 1 and
                 os.path.exists(os.path.join(out, "model.safetensors.index.json")))
    back = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        want = model(input_ids=inputs).logits
        got = back(input_ids=inputs).logits
    chk.true("transformers loads the export: same logits, bit for bit", torch.equal(got, want),
             f"max abs diff {float((got - want).abs().max()):.2e}")
    saved, exported = read_hf_dir(model_dir), read_hf_dir(out)
    same_names = set(saved) == set(exported)
    if exact_bits:
        same = same_names and all(saved[n].dtype == exported[n].dtype and saved[n].numpy().tobytes() ==
                                  exported[n].numpy().tobytes() for n in saved)
        chk.true("round trip: every tensor bit-identical", same)
    else:
        same = same_names and all(torch.equal(saved[n].float(), exported[n]) for n in saved)
        chk.true("round trip: every tensor equal to the file's values in fp32", same)


def run_case(chk, build, tmp, name, spec):
    print(f"== case {name}")
    torch.manual_seed(sum(map(ord, name)))
    cfg = tiny_config(spec["tied"], spec["rope_scaling"], spec.get("kv_heads", 2))
    model = LlamaForCausalLM(cfg)
    dtype = spec.get("dtype", torch.float32)
    model_dir = os.path.join(tmp, name, "hf")
    model.to(dtype).save_pretrained(model_dir, safe_serialization=True, max_shard_size=spec.get("shard", "5GB"))
    # The reference: what transformers computes in fp32 from the saved files (bf16/f16: their values
    # upcast; loading anew also recomputes the RoPE frequencies, which .to(bf16) rounded).
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", torch_dtype=torch.float32)
    inputs = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    targets[0, 3] = IGNORE_INDEX
    tokens = os.path.join(tmp, name, "tokens.safetensors")
    safetensors_io.save(tokens, {"inputs": inputs.numpy().astype(np.int32), "targets": targets.numpy().astype(np.int32)})

    compare_import(chk, f"{build}/tests/hf_driver", model_dir, tokens, os.path.join(tmp, name, "f32"),
                   model, inputs, targets, False)
    if dtype == torch.float32:  # float64 on the fp32 weights: HF in float64 with its fp32 casts lifted
        with hf_in_float64(cfg):
            compare_import(chk, f"{build}/tests/hf_driver64", model_dir, tokens, os.path.join(tmp, name, "f64"),
                           model.double(), inputs, targets, True)
        model = model.float()
    p = run([f"{build}/tests/hf_driver", "slices", model_dir], expect_rc=None)
    chk.true("tensor-parallel shards and flat ranges read from the file", p.returncode == 0, p.stdout.strip())
    compare_export(chk, f"{build}/tests/hf_driver", model_dir, os.path.join(tmp, name, "export"), 0, model, inputs,
                   dtype == torch.float32)
    compare_export(chk, f"{build}/tests/hf_driver", model_dir, os.path.join(tmp, name, "export_sharded"), 30000,
                   model, inputs, dtype == torch.float32)
    return model_dir


# ---- bad files ----------------------------------------------------------------------------------
def expect_bad(chk, build, tmp, what, good_dir, mutate, wanted):
    bad = os.path.join(tmp, "bad", what.replace(" ", "_"))
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(good_dir, bad)
    mutate(bad)
    p = run([f"{build}/tests/hf_driver", "export", bad, bad + ".out"], expect_rc=None)
    lines = p.stderr.strip().splitlines()
    ok = p.returncode == 2 and len(lines) == 1 and wanted in lines[0] and not os.path.exists(bad + ".out")
    chk.true(f"bad file, {what}: exit 2, one line", ok, f"rc {p.returncode}: {p.stderr.strip()}")


def edit_config(change):
    def mutate(d):
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        change(cfg)
        json.dump(cfg, open(path, "w"))
    return mutate


def bad_files(chk, build, tmp, single_dir, sharded_dir):
    print("== bad files")
    expect_bad(chk, build, tmp, "missing config key", single_dir,
               edit_config(lambda c: c.pop("hidden_size")), 'missing key "hidden_size"')
    expect_bad(chk, build, tmp, "shape mismatch", single_dir,
               edit_config(lambda c: c.update(intermediate_size=128)), "shape [96, 64], expected [128, 64]")
    expect_bad(chk, build, tmp, "fewer layers in config.json than in the weights", single_dir,
               edit_config(lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] - 1)),
               "is a layer beyond config.json's num_hidden_layers")
    expect_bad(chk, build, tmp, "negative rms_norm_eps", single_dir,
               edit_config(lambda c: c.update(rms_norm_eps=-1)), '"rms_norm_eps" -1 must be positive')
    expect_bad(chk, build, tmp, "zero rope_theta", single_dir,
               edit_config(lambda c: c.update(rope_theta=0)), 'config.json: "rope_theta" 0 must be positive')
    expect_bad(chk, build, tmp, "unsupported rope scaling", single_dir,
               edit_config(lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
               'unsupported rope_scaling type "yarn"')
    expect_bad(chk, build, tmp, "attention dropout", single_dir,
               edit_config(lambda c: c.update(attention_dropout=0.1)), '"attention_dropout" must be 0')
    expect_bad(chk, build, tmp, "missing shard", sharded_dir,
               lambda d: os.remove(os.path.join(d, sorted(f for f in os.listdir(d) if f.startswith("model-"))[-1])),
               "is missing")
    expect_bad(chk, build, tmp, "untied config without lm_head", single_dir,
               edit_config(lambda c: c.update(tie_word_embeddings=False)), "'lm_head.weight' is missing")
    expect_bad(chk, build, tmp, "a NaN weight", single_dir, with_nan_weight,
               "tensor 'model.norm.weight' holds NaN at element 3 (not a finite weight)")


def with_nan_weight(d):
    """Element 3 of model.norm.weight set to NaN (a quiet NaN's bits in whatever dtype it is stored)."""
    path = os.path.join(d, "model.safetensors")
    tensors, meta = safetensors_io.load(path)
    w = tensors["model.norm.weight"]
    w.flat[3] = 0x7FC0 if w.dtype == np.uint16 else np.nan  # bf16 is kept as its 16-bit pattern
    safetensors_io.save(path, tensors, meta)


# ---- the trainer ------------------------------------------------------------------------------
def trainer(chk, build, tmp, model_dir, mpirun):
    print("== trainer: --init-from hf:DIR, --export-hf")
    common = ["--init-from", f"hf:{model_dir}", "--batch", "4", "--seq-len", str(T), "--steps", "2"]
    dump = os.path.join(tmp, "trainer", "dump.safetensors")
    os.makedirs(os.path.dirname(dump), exist_ok=True)
    run([f"{build}/train"] + common + ["--dump", dump])
    d, _ = safetensors_io.load(dump)
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", torch_dtype=torch.float32)
    inputs, targets = torch.tensor(d["inputs"][0]).long(), torch.tensor(d["targets"][0]).long()
    with torch.no_grad():
        logits = model.lm_head(model.model(input_ids=inputs).last_hidden_state)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    chk.close("train --init-from --dump: step-1 logits vs HF", d["logits"], logits.numpy(), F32_LOGITS_REL)
    chk.close("train --init-from --dump: step-1 loss vs HF", np.array(d["loss"][0]), np.array(float(loss)), F32_LOSS_REL)

    saved = read_hf_dir(model_dir)
    layouts = [(1, []), (2, ["--tp", "2"]), (2, ["--dp-shard", "2", "--zero-stage", "3"]), (2, ["--pp", "2"]),
               (4, ["--tp", "2", "--dp-shard", "2"])]
    # --device cuda: the GPU model on the CUDA emulator (built with the GPU tests where a C++ compiler is)
    emulated = os.path.join(build, "tests", "emu", "train")
    if os.path.exists(emulated):
        layouts.append((1, ["--device", "cuda"]))
    for np_, flags in layouts:
        out = os.path.join(tmp, "trainer", "export_" + "_".join(f.strip("-") for f in flags) if flags else "single")
        program = emulated if "cuda" in flags else f"{build}/train"
        cmd = ([] if np_ == 1 else mpirun + ["-np", str(np_)]) + [program] + common + \
            ["--lr", "0", "--export-hf", out] + flags
        p = run(cmd, expect_rc=None)
        if p.returncode != 0:
            chk.true(f"train {' '.join(flags)}", False, p.stderr.strip()[-500:])
            continue
        back = read_hf_dir(out)
        same = set(back) == set(saved) and all(back[n].numpy().tobytes() == saved[n].numpy().tobytes() for n in saved)
        chk.true(f"lr 0, {np_} rank(s) {' '.join(flags) or '(single process)'}: export bit-identical to the input", same)
    # The special tokens' ids go through (transformers would take bos 1, eos 2 without them, and
    # generate() stop at token 2), and rope_scaling's factors are written as floats (integers make
    # transformers warn on every load).
    source, exported = LlamaConfig.from_pretrained(model_dir), LlamaConfig.from_pretrained(out)
    ids = lambda c: (c.bos_token_id, c.eos_token_id)
    chk.true("export keeps the special tokens' ids", ids(exported) == ids(source) == (90, [91, 92]),
             f"source {ids(source)}, export {ids(exported)}")
    rope = json.load(open(os.path.join(out, "config.json"))).get("rope_scaling") or {}
    chk.true("export writes rope_scaling's factors as floats",
             all(isinstance(rope.get(k, 0.0), float) for k in ("factor", "low_freq_factor", "high_freq_factor")), str(rope))

    out = os.path.join(tmp, "trainer", "export_sharded")
    run([f"{build}/train"] + common + ["--export-hf", out, "--export-hf-shard-mb", "0.03"])
    shards = [f for f in os.listdir(out) if f.startswith("model-")]
    trained = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        moved = float((trained(input_ids=inputs).logits - model(input_ids=inputs).logits).abs().max())
    chk.true(f"2 trained steps exported in {len(shards)} shards: transformers loads them", len(shards) > 1 and moved > 0,
             f"logits moved by {moved:.2e}")

    for flags, wanted in [(["--init-from", model_dir], "expected hf:DIR"),
                          (["--init-from", f"hf:{model_dir}", "--model", "tiny"], "--model: not with --init-from"),
                          (["--init-from", f"hf:{tmp}/no_such_dir"], "config.json"),
                          (["--init-from", f"hf:{model_dir}", "--export-hf", dump], "is not a directory")]:
        p = run([f"{build}/train", "--steps", "1"] + flags, expect_rc=None)
        lines = p.stderr.strip().splitlines()
        chk.true(f"train {' '.join(flags[-2:])}: exit 2, one line", p.returncode == 2 and len(lines) == 1 and
                 wanted in lines[0], f"rc {p.returncode}: {p.stderr.strip()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--case", action="append", help="run only these cases (default: all)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe", help="how to start ranks")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    chk = Checker()
    dirs = {}
    for name in args.case or CASES:
        dirs[name] = run_case(chk, args.build, args.tmp, name, CASES[name])
    if "tied" in dirs and "f16_sharded" in dirs:
        bad_files(chk, args.build, args.tmp, dirs["tied"], dirs["f16_sharded"])
    if "untied_llama3" in dirs:
        trainer(chk, args.build, args.tmp, dirs["untied_llama3"], args.mpirun.split())
    print(f"hf_interop: {'PASS' if chk.failures == 0 else f'FAIL ({chk.failures} checks)'}")
    return 1 if chk.failures else 0


if __name__ == "__main__":
    sys.exit(main())
