"""A compact Llama in PyTorch: the PyTorch peer of the flashcpp decode engine (`python -m flashcpp.bench engine`).

gpt-fast style, written for this project: Hugging Face config.json and safetensors in, bf16 weights with
q/k/v and gate/up fused into one GEMM each, GQA, RoPE with Llama-3 scaling, a static KV cache
(B, Hkv, max_len, D) written with index_copy_, causal prefill and fixed-shape one-token decode steps that
torch.compile(mode="reduce-overhead") and torch.cuda.CUDAGraph can capture. The numerics follow
transformers' LlamaForCausalLM (RMSNorm in fp32, cos/sin computed in fp32 and rounded to the model dtype,
rotation and residual adds in the model dtype, bf16 logits), so the two agree to bf16 rounding.

Attention reads the first n positions of the static cache with a mask (j <= position), as gpt-fast
does over its whole cache; n comes in as a tensor (kv_pos = arange(n)) so torch.compile keeps it dynamic
and one compile per batch size serves every context. GQA without copies: the G = Hq/Hkv query heads that
share a KV head are folded into the query-length axis of SDPA.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, float]] = None  # {"rope_type": "llama3", factor, low/high_freq_factor, ...}
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, path: str) -> "LlamaArgs":
        """From a config.json (or a directory holding one); both the transformers 4 keys (rope_theta,
        rope_scaling) and the transformers 5 ones (rope_parameters) are understood."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            c = json.load(f)
        rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
        theta = float(c.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "llama3"):
            raise ValueError(f"rope_type {rtype!r} is not supported (supported: default, llama3)")
        heads = int(c["num_attention_heads"])
        return cls(vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
                   intermediate_size=int(c["intermediate_size"]), n_layers=int(c["num_hidden_layers"]),
                   n_heads=heads, n_kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                   rope_scaling=dict(rope, rope_type=rtype) if rtype == "llama3" else None,
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def rope_inv_freq(a: LlamaArgs) -> torch.Tensor:
    """head_dim/2 inverse frequencies in fp32, with the Llama-3 (3.1) smooth long-context scaling."""
    d = a.head_dim
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = a.rope_scaling
    if not s:
        return inv
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    # long wavelengths (> old/lo) are slowed down by `factor`, short ones (< old/hi) kept, the band between
    # is interpolated linearly in old/wavelen
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    t = (old / wavelen - lo) / (hi - lo)
    mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(mid, (1 - t) * scaled / factor + t * scaled, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in the neox (half-split) layout that Hugging Face Llama checkpoints use."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.hq, self.hkv, self.d = a.n_heads, a.n_kv_heads, a.head_dim
        self.wqkv = nn.Linear(a.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=False)
        self.wo = nn.Linear(self.hq * self.d, a.hidden_size, bias=False)
        # registered buffers (set by Llama.setup_caches): torch.compile's CUDA graphs treat them as static
        # inputs that may be mutated in place
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, input_pos, mask, n: int):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = _rotate(q.view(b, t, self.hq, self.d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, t, self.hkv, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        g = self.hq // self.hkv  # query heads h = kv*g + i share KV head kv: fold them into the row axis
        o = F.scaled_dot_product_attention(q.reshape(b, self.hkv, g * t, self.d), self.k_cache[:, :, :n],
                                           self.v_cache[:, :, :n], attn_mask=mask)
        return self.wo(o.view(b, self.hq, t, self.d).transpose(1, 2).reshape(b, t, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.w13 = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)  # [gate; up]
        self.w2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.attn = Attention(a)
        self.mlp_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, input_pos, mask, n: int):
        h = x + self.attn(self.attn_norm(x), cos, sin, input_pos, mask, n)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)

    def setup_caches(self, batch: int, max_len: int) -> None:
        """Fresh zeroed KV caches (batch, Hkv, max_len, D); positions >= max_len cannot be decoded."""
        w = self.lm_head.weight
        for blk in self.layers:
            shape = (batch, blk.attn.hkv, max_len, blk.attn.d)
            blk.attn.k_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
            blk.attn.v_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)

    def fill_caches_random(self, length: int, seed: int = 0) -> None:
        """Positions [0, length) of every cache get random values: a context "pre-filled" without a
        prefill (what it holds does not change the speed of a decode step)."""
        g = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for blk in self.layers:
            for c in (blk.attn.k_cache, blk.attn.v_cache):
                c[:, :, :length].normal_(generator=g)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, kv_pos: Optional[torch.Tensor] = None):
        """idx (B, T) token ids at positions input_pos (T,) -> logits (B, T, vocab) in the weight dtype.
        Attention reads cache positions kv_pos = arange(n) (default: the whole cache); passing it as a
        tensor lets torch.compile keep n dynamic, so caches sized for the longest context serve every
        shorter one at the cost of the shorter one."""
        x = self.embed(idx)
        freqs = input_pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if kv_pos is None:
            kv_pos = torch.arange(self.layers[0].attn.k_cache.shape[2], device=idx.device)
        n = kv_pos.shape[0]
        t, a = idx.shape[1], self.args
        g = a.n_heads // a.n_kv_heads
        mask = kv_pos[None, :] <= input_pos[:, None]  # (T, n)
        mask = mask[None, None, None].expand(1, 1, g, t, n).reshape(1, 1, g * t, n)
        for blk in self.layers:
            x = blk(x, cos, sin, input_pos, mask, n)
        return self.lm_head(self.norm(x))

    @classmethod
    def from_pretrained(cls, model_dir: str, device="cuda", dtype=torch.bfloat16) -> "Llama":
        """Loads a Hugging Face Llama checkpoint (config.json + *.safetensors, sharded or not)."""
        from safetensors.torch import load_file

        a = LlamaArgs.from_hf_config(model_dir)
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        hf: Dict[str, torch.Tensor] = {}
        for f in files:
            hf.update(load_file(f, device=str(device)))
        hf = {k: v.to(dtype) for k, v in hf.items()}

        def take(name):
            if name not in hf:
                raise KeyError(f"{name} missing from the checkpoint in {model_dir}")
            return hf.pop(name)

        sd = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
        head = hf.pop("lm_head.weight", None)
        if head is None and not a.tie_word_embeddings:
            raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
        sd["lm_head.weight"] = sd["embed.weight"] if a.tie_word_embeddings or head is None else head
        for i in range(a.n_layers):
            p = f"model.layers.{i}."
            sd[f"layers.{i}.attn.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            sd[f"layers.{i}.attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
            sd[f"layers.{i}.mlp.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"),
                                                          take(p + "mlp.up_proj.weight")])
            sd[f"layers.{i}.mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
            sd[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
            sd[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
        if hf:
            raise KeyError(f"unexpected tensors in the checkpoint: {sorted(hf)[:5]}")
        with torch.device("meta"):
            model = cls(a)
        model.load_state_dict(sd, strict=True, assign=True)
        model.inv_freq = rope_inv_freq(a).to(device)
        return model.requires_grad_(False).eval()


def _decode_body(model: Llama, tok: torch.Tensor, input_pos: torch.Tensor, kv_pos: Optional[torch.Tensor]):
    logits = model(tok, input_pos, kv_pos)[:, -1]
    return logits.argmax(dim=-1, keepdim=True), logits


# Two entry points with separate code objects, so torch.compile under two modes keeps two cache entries.
def decode_one(model: Llama, tok: torch.Tensor, input_pos: torch.Tensor,
               kv_pos: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One greedy decode step: tok (B, 1) at position input_pos (1,) -> (next token (B, 1), logits (B, V))."""
    return _decode_body(model, tok, input_pos, kv_pos)


def decode_one_default(model: Llama, tok: torch.Tensor, input_pos: torch.Tensor, kv_pos: Optional[torch.Tensor] = None):
    """decode_one, for torch.compile(mode="default") under a manually captured CUDA graph."""
    return _decode_body(model, tok, input_pos, kv_pos)


@torch.no_grad()
def greedy(model: Llama, prompt: torch.Tensor, new_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill prompt (B, P), then new_tokens - 1 decode steps feeding the greedy token. Returns
    (generated ids (B, new_tokens), logits (B, P + new_tokens - 1, V) in fp32) in the layout of
    `flashcpp decode --dump-logits`: row P-1+s holds the logits after feeding generated token s."""
    b, p = prompt.shape
    dev = prompt.device
    model.setup_caches(b, 64 * math.ceil((p + new_tokens) / 64))  # (SDPA wants mask rows 16-aligned)
    logits = model(prompt, torch.arange(p, device=dev)).float()
    rows, toks = [logits], []
    tok = logits[:, -1].argmax(-1, keepdim=True)
    for s in range(1, new_tokens):
        toks.append(tok)
        nxt, lg = decode_one(model, tok, torch.tensor([p - 1 + s], device=dev))
        rows.append(lg.float()[:, None])
        tok = nxt
    toks.append(tok)
    return torch.cat(toks, dim=1), torch.cat(rows, dim=1)
