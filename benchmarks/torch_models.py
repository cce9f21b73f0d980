"""Small GPT-2-like and LLaMA-like PyTorch models, exported to ONNX by bench_models.py (needs torch)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class GptBlock(nn.Module):
    """Pre-LN block: causal multi-head self-attention (explicit masked softmax), then a GELU MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + mask
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, vocab: int, max_seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList(GptBlock(d_model, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        # Additive causal mask; a large negative rather than -inf keeps softmax finite in every runtime.
        self.register_buffer("mask", torch.full((max_seq, max_seq), -1e9).triu(1), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(s))
        mask = self.mask[:s, :s]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, rotary grouped-query attention over past + new keys/values, RMSNorm, SwiGLU MLP."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.gate, self.up = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x, cos, sin, past_k, past_v):
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        group = self.heads // self.kv_heads
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # One new token attends to every cached position, so no causal mask is needed.
        scores = q @ keys.transpose(-2, -1) / math.sqrt(self.head_dim)
        attn = (scores.softmax(-1) @ values).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(attn)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), k, v


class Llama(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, kv_heads: int, vocab: int):
        super().__init__()
        hidden = 256 * math.ceil(8 * d_model / 3 / 256)
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(LlamaBlock(d_model, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.head = RMSNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        head_dim = d_model // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, position_ids, *past):
        freqs = position_ids[..., None].float() * self.inv_freq  # [b, s, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, head_dim], broadcast over heads
        cos, sin = emb.cos(), emb.sin()
        x, presents = self.embed(input_ids), []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, cos, sin, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        return (self.head(self.norm(x)), *presents)


def build_gpt(layers: int, d_model: int, heads: int, vocab: int, max_seq: int) -> nn.Module:
    torch.manual_seed(0)
    return Gpt(layers, d_model, heads, vocab, max_seq).eval()


def build_llama(layers: int, d_model: int, heads: int, kv_heads: int, vocab: int) -> nn.Module:
    torch.manual_seed(0)
    return Llama(layers, d_model, heads, kv_heads, vocab).eval()
