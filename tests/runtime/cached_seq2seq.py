"""A small encoder-decoder written with its caches by hand in Optimum's seq2seq naming, exported with
torch.onnx.export as two files: the encoder (input_ids, attention_mask -> last_hidden_state) and the decoder
(input_ids, encoder_attention_mask, encoder_hidden_states, past_key_values.{i}.decoder|encoder.key|value ->
logits, present.*). The decoder takes no attention mask of its own: every target row starts at the start id."""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.runtime.cached_gpt import D_MODEL, HEAD_DIM, HEADS, MAX_POSITIONS, VOCAB, Block

LAYERS = 2
START_ID = 2


def _heads(x):
    return x.view(x.shape[0], x.shape[1], HEADS, HEAD_DIM).transpose(1, 2)  # [batch, heads, seq, head_dim]


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.q, self.kv, self.proj = (nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, D_MODEL),
                                               nn.Linear(D_MODEL, 2 * D_MODEL), nn.Linear(D_MODEL, D_MODEL))

    def forward(self, x, memory, memory_mask, past_key, past_value):
        # The source's keys and values: projected on the first call (empty past), read from the cache after
        # (memory sliced past the cache's length is then empty): no branch for the exporter to specialise.
        k, v = (_heads(t) for t in self.kv(memory[:, past_key.shape[2] :]).chunk(2, -1))
        key, value = torch.cat([past_key, k], 2), torch.cat([past_value, v], 2)
        scores = _heads(self.q(self.ln(x))) @ key.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~memory_mask[:, None, None, :].bool(), -1e9)
        attended = (scores.softmax(-1) @ value).transpose(1, 2).reshape(x.shape)
        return x + self.proj(attended), key, value


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(MAX_POSITIONS, D_MODEL)
        self.block, self.ln = Block(), nn.LayerNorm(D_MODEL)

    def forward(self, input_ids, attention_mask):
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        empty = x.new_zeros(x.shape[0], HEADS, 0, HEAD_DIM)
        x, _, _ = self.block(x, attention_mask[:, None, None, :].bool(), empty, empty)
        return self.ln(x)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(MAX_POSITIONS, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.cross = nn.ModuleList(CrossAttention() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids, encoder_attention_mask, encoder_hidden_states, past):
        past_len, seq = past[0].shape[2], input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(past_len, past_len + seq))
        allowed = torch.arange(past_len + seq)[None, :] <= torch.arange(seq)[:, None] + past_len
        presents = []
        for i, (block, cross) in enumerate(zip(self.blocks, self.cross, strict=True)):
            x, key, value = cross(x, encoder_hidden_states, encoder_attention_mask, past[4 * i + 2], past[4 * i + 3])
            x, self_key, self_value = block(x, allowed[None, None], past[4 * i], past[4 * i + 1])
            presents += [self_key, self_value, key, value]
        return (self.head(self.ln(x)), *presents)


def cache_names(prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{part}.{kind}" for i in range(LAYERS) for part in ("decoder", "encoder")
            for kind in ("key", "value")]


def build(seed: int = 0) -> tuple[Encoder, Decoder]:
    torch.manual_seed(seed)
    encoder, decoder = Encoder().eval(), Decoder().eval()
    with torch.no_grad():  # larger than torch's initial weights, so that the next token is not a near tie
        for parameter in [*encoder.parameters(), *decoder.parameters()]:
            parameter.mul_(3.0)
    return encoder, decoder


def export(encoder: Encoder, decoder: Decoder, encoder_path, decoder_path) -> None:
    dynamic = torch.export.Dim.DYNAMIC
    batch, source, target, past = 2, 5, 3, 4  # all different, so that no axis is specialised
    ids, mask = torch.randint(0, VOCAB, (batch, source)), torch.ones(batch, source, dtype=torch.int64)
    torch.onnx.export(encoder, (ids, mask), str(encoder_path), dynamo=True,
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_shapes=({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}))
    caches = []
    for _ in range(LAYERS):
        caches += [torch.randn(batch, HEADS, past, HEAD_DIM) for _ in range(2)]
        caches += [torch.randn(batch, HEADS, source, HEAD_DIM) for _ in range(2)]
    args = (torch.randint(0, VOCAB, (batch, target)), mask, torch.randn(batch, source, D_MODEL), tuple(caches))
    torch.onnx.export(
        decoder, args, str(decoder_path), dynamo=True,
        input_names=["input_ids", "encoder_attention_mask", "encoder_hidden_states",
                     *cache_names("past_key_values")],
        output_names=["logits", *cache_names("present")],
        dynamic_shapes=({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic},
                        tuple({0: dynamic, 2: dynamic} for _ in caches)),
    )
