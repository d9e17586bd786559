"""Llama 3 in plain PyTorch, written independently of the C reference so it can serve as its oracle.

Parameter names and shapes follow Meta's checkpoints (as torchtitan does), so
`dict(model.named_parameters())` has exactly the keys of the C parameter table:
  tok_embeddings.weight (V, D); layers.{i}.attention_norm.weight (D);
  layers.{i}.attention.{wq,wk,wv,wo}.weight; layers.{i}.ffn_norm.weight (D);
  layers.{i}.feed_forward.{w1,w2,w3}.weight; norm.weight (D); output.weight (V, D) unless tied.
Every linear layer is y = x @ W^T with W stored (out_features, in_features).

Only torch >= 1.13 features are used: attention is written with matmuls (no
scaled_dot_product_attention) and RoPE with real arithmetic on interleaved pairs. The benchmark
(scripts/bench_torch.py) may switch attention to torch 2.x's fused scaled_dot_product_attention
by setting Attention.use_sdpa; the oracle never does.
"""
import json
import math
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 128
    vocab_size: int = 256
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tied: bool = False
    rope_scaling_factor: float = 0.0  # 0 = no Llama 3.1 frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    @classmethod
    def from_dict(cls, d):
        """Builds a config from the dump's JSON (unknown keys are ignored, types coerced)."""
        if isinstance(d, str):
            d = json.loads(d)
        kw = {}
        for f in fields(cls):
            if f.name in d:
                kw[f.name] = f.type(d[f.name]) if f.type is not bool else bool(d[f.name])
        return cls(**kw)

    def to_dict(self):
        return asdict(self)


def rope_frequencies(cfg):
    """Per-pair angular frequencies f_i = theta^(-2i/hd), i in [0, hd/2), with the Llama 3.1
    scaling applied when cfg.rope_scaling_factor > 0. Computed in float64 numpy."""
    hd = cfg.head_dim
    i = np.arange(hd // 2, dtype=np.float64)
    freqs = cfg.rope_theta ** (-2.0 * i / hd)
    if cfg.rope_scaling_factor > 0:
        factor = cfg.rope_scaling_factor
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        orig = float(cfg.rope_original_max_seq_len)
        out = np.empty_like(freqs)
        for k, f in enumerate(freqs):
            wavelen = 2.0 * math.pi / f
            if wavelen < orig / high:      # high-frequency pair: unchanged
                out[k] = f
            elif wavelen > orig / low:     # low-frequency pair: divided by the factor
                out[k] = f / factor
            else:                          # in between: blend the two
                smooth = (orig / wavelen - low) / (high - low)
                out[k] = (1.0 - smooth) * f / factor + smooth * f
        freqs = out
    return freqs


def rope_tables(cfg, seq_len, dtype):
    """cos and sin of pos * f_i, each (seq_len, hd/2), angles computed in float64."""
    pos = np.arange(seq_len, dtype=np.float64)
    angles = np.outer(pos, rope_frequencies(cfg))
    return (torch.tensor(np.cos(angles), dtype=dtype), torch.tensor(np.sin(angles), dtype=dtype))


def apply_rope(x, cos, sin):
    """x: (B, T, n_heads, hd). Within each head, the pair (2i, 2i+1) is the complex number
    x[2i] + j x[2i+1], multiplied by exp(j * pos * f_i)."""
    b, t, h, hd = x.shape
    pairs = x.reshape(b, t, h, hd // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    c = cos[:t].view(1, t, 1, hd // 2)
    s = sin[:t].view(1, t, 1, hd // 2)
    out = torch.stack((re * c - im * s, re * s + im * c), dim=-1)
    return out.reshape(b, t, h, hd)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * inv_rms * self.weight


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    use_sdpa = False  # torch >= 2.0 only; the benchmark's switch

    @staticmethod
    def sdpa(q, k, v, group):
        """(B, T, H or KV, hd) each -> (B, H, T, hd) with torch's fused causal attention; GQA
        natively where the version has enable_gqa (2.5+), else by repeating k and v."""
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        sdpa = F.scaled_dot_product_attention
        if group > 1:
            try:
                return sdpa(q, k, v, is_causal=True, enable_gqa=True)
            except TypeError:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return sdpa(q, k, v, is_causal=True)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        hd = self.head_dim
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, hd), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, hd), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, hd)
        # GQA: query head h reads kv head h // (n_heads / n_kv_heads), i.e. each kv head is
        # repeated for a contiguous group of query heads.
        group = self.n_heads // self.n_kv_heads
        if self.use_sdpa:
            return self.wo(self.sdpa(q, k, v, group).transpose(1, 2).reshape(b, t, self.n_heads * hd))
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * hd)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tied else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.to(dtype)
        self._rope = {}

    def rope(self, seq_len, dtype):
        key = (seq_len, dtype)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.cfg, seq_len, dtype)
        return self._rope[key]

    def forward(self, tokens):
        """tokens: (B, T) int64 -> logits (B, T, V)."""
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        w_out = self.tok_embeddings.weight if self.output is None else self.output.weight
        return torch.matmul(x, w_out.t())

    @staticmethod
    def loss(logits, targets):
        """Mean cross-entropy over the targets that are not IGNORE_INDEX."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="mean")

    def param_shapes(self):
        return {name: tuple(p.shape) for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_numpy(self, arrays, prefix=""):
        """Copies arrays[prefix + name] into every parameter; the set of names must match exactly."""
        own = dict(self.named_parameters())
        given = {k[len(prefix):] for k in arrays if k.startswith(prefix)}
        if given != set(own):
            raise ValueError(f"parameter names differ: missing {sorted(set(own) - given)}, "
                             f"unexpected {sorted(given - set(own))}")
        for name, p in own.items():
            a = arrays[prefix + name]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {a.shape} in the file, {tuple(p.shape)} in the model")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)).to(p.dtype))

    def to_numpy(self, grads=False):
        out = {}
        for name, p in self.named_parameters():
            t = p.grad if grads else p
            out[name] = t.detach().cpu().numpy().copy()
        return out

    @torch.no_grad()
    def init_random(self, seed=0, std=0.02):
        """Random init in the spirit of the C reference (normal(0, std); wo and w2 use
        std / sqrt(2 * n_layers); norms 1). Values differ from the C trainer's RNG: benchmark only."""
        g = torch.Generator().manual_seed(seed)
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = resid_std if (".wo." in name or ".w2." in name) else std
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * s)
        return self


def from_numpy(cfg, arrays, dtype=torch.float32, prefix=""):
    """Builds a model with the given config and loads its weights from arrays (name -> ndarray)."""
    model = Llama(cfg, dtype=dtype)
    model.load_numpy(arrays, prefix=prefix)
    return model
