"""A small GPT written with its KV cache by hand, in Optimum's naming, exported with torch.onnx.export:
what a user who writes the cache-aware forward themselves gets, and a file the generation loop must run."""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, D_MODEL, HEADS, LAYERS, MAX_POSITIONS = 64, 32, 4, 2, 128
HEAD_DIM = D_MODEL // HEADS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, allowed, past_key, past_value):
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        key, value = torch.cat([past_key, k], 2), torch.cat([past_value, v], 2)  # [batch, heads, past + seq, d]
        scores = (q @ key.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~allowed, -1e9)
        attended = (scores.softmax(-1) @ value).transpose(1, 2).reshape(batch, seq, D_MODEL)
        x = x + self.proj(attended)
        return x + self.mlp(self.ln2(x)), key, value


class CachedGPT(nn.Module):
    """forward(input_ids, attention_mask [batch, past + seq], position_ids, past k0, v0, k1, v1...) ->
    (logits, present k0, v0, ...)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(MAX_POSITIONS, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        seq, total = input_ids.shape[1], attention_mask.shape[1]
        # A new token sees the real keys at or before its own place in the cache.
        causal = torch.arange(total)[None, :] <= torch.arange(seq)[:, None] + (total - seq)
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        x = self.tokens(input_ids) + self.positions(position_ids)
        presents = []
        for i, block in enumerate(self.blocks):
            x, key, value = block(x, allowed, past[2 * i], past[2 * i + 1])
            presents += [key, value]
        return (self.head(self.ln(x)), *presents)


def cache_names(prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]


def build(seed: int = 0) -> CachedGPT:
    torch.manual_seed(seed)
    model = CachedGPT().eval()
    with torch.no_grad():  # weights larger than torch's initial ones, so that the next token is not a near tie
        for parameter in model.parameters():
            parameter.mul_(3.0)
    return model


def export(model: CachedGPT, path) -> None:
    batch, seq, past = 2, 3, 4  # all different, so that no axis is specialised
    args = (
        torch.randint(0, VOCAB, (batch, seq)),
        torch.ones(batch, past + seq, dtype=torch.int64),
        torch.arange(past, past + seq).expand(batch, seq),
        *(torch.randn(batch, HEADS, past, HEAD_DIM) for _ in range(2 * LAYERS)),
    )
    dynamic = torch.export.Dim.DYNAMIC
    torch.onnx.export(
        model, args, str(path), dynamo=True,
        input_names=["input_ids", "attention_mask", "position_ids", *cache_names("past_key_values")],
        output_names=["logits", *cache_names("present")],
        dynamic_shapes=({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic},
                        tuple({0: dynamic, 2: dynamic} for _ in range(2 * LAYERS))),
    )
