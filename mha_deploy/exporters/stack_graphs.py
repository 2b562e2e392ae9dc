"""Export-graph wrappers for encoder/decoder stacks, and their ONNX export.

Like ``graphs``, each module's ``forward`` is exactly the exported model's I/O
contract and, run eagerly, the torch side of parity checks. Masks come in as
boolean key padding masks (True = real token) and become the reference's
0 = masked masks inside the graph:

- ``EncoderGraph``: inputs ``x`` [batch, seq, d_model] and, with padding,
  ``key_padding_mask`` [batch, seq]; output ``output``.
- ``DecoderGraph``: inputs ``x`` (target) [batch, tgt_len, d_model], ``memory``
  [batch, mem_len, d_model], optionally ``key_padding_mask`` [batch, tgt_len]
  (target padding, the same meaning as for self-attention models) and
  ``memory_padding_mask`` [batch, mem_len]; output ``output``. Self-attention
  is causal, cross-attention sees every real memory position.
"""

from __future__ import annotations

import onnx
import torch
from torch import nn
from torch.export import Dim

from mha_deploy.exporters.graphs import build_attention_mask
from mha_deploy.exporters.torch_export import DEFAULT_OPSET, TRACE_BATCH, TRACE_KV_LEN, TRACE_Q_LEN, export_traced
from mha_deploy.models.transformer import Decoder, Encoder


class EncoderGraph(nn.Module):
    def __init__(self, encoder: Encoder, padding: bool = True):
        super().__init__()
        self.encoder = encoder
        self.padding = padding

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("x", "key_padding_mask") if self.padding else ("x",)

    def forward(self, x, key_padding_mask=None):
        seq = x.shape[1]
        mask = build_attention_mask(key_padding_mask, seq, seq, causal=False, device=x.device)
        return self.encoder(x, mask)

    def sample_inputs(self) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(TRACE_BATCH, TRACE_Q_LEN, self.encoder.d_model, generator=gen)
        padding = torch.ones(TRACE_BATCH, TRACE_Q_LEN, dtype=torch.bool)
        return (x, padding) if self.padding else (x,)

    def dynamic_shapes(self) -> tuple[dict[int, Dim], ...]:
        batch, seq = Dim("batch"), Dim("seq")
        return ({0: batch, 1: seq}, {0: batch, 1: seq}) if self.padding else ({0: batch, 1: seq},)


class DecoderGraph(nn.Module):
    def __init__(self, decoder: Decoder, target_padding: bool = True, memory_padding: bool = True):
        super().__init__()
        self.decoder = decoder
        self.target_padding = target_padding
        self.memory_padding = memory_padding

    @property
    def input_names(self) -> tuple[str, ...]:
        names = ["x", "memory"]
        names += ["key_padding_mask"] if self.target_padding else []
        names += ["memory_padding_mask"] if self.memory_padding else []
        return tuple(names)

    def forward(self, x, memory, *padding_masks):
        masks = dict(zip(self.input_names[2:], padding_masks, strict=True))
        tgt_len, mem_len = x.shape[1], memory.shape[1]
        self_mask = build_attention_mask(masks.get("key_padding_mask"), tgt_len, tgt_len, True, x.device)
        memory_mask = build_attention_mask(masks.get("memory_padding_mask"), tgt_len, mem_len, False, x.device)
        return self.decoder(x, memory, self_mask, memory_mask)

    def sample_inputs(self) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(0)
        d_model = self.decoder.d_model
        inputs = [
            torch.randn(TRACE_BATCH, TRACE_Q_LEN, d_model, generator=gen),
            torch.randn(TRACE_BATCH, TRACE_KV_LEN, d_model, generator=gen),
        ]
        if self.target_padding:
            inputs.append(torch.ones(TRACE_BATCH, TRACE_Q_LEN, dtype=torch.bool))
        if self.memory_padding:
            inputs.append(torch.ones(TRACE_BATCH, TRACE_KV_LEN, dtype=torch.bool))
        return tuple(inputs)

    def dynamic_shapes(self) -> tuple:
        batch, tgt, mem = Dim("batch"), Dim("tgt_seq"), Dim("mem_seq")
        shapes = [{0: batch, 1: tgt}, {0: batch, 1: mem}]
        shapes += [{0: batch, 1: tgt}] if self.target_padding else []
        shapes += [{0: batch, 1: mem}] if self.memory_padding else []
        # forward takes the masks as *padding_masks: one entry for the whole tuple,
        # and none at all when there are no masks (torch.export counts the inputs given).
        return (shapes[0], shapes[1], tuple(shapes[2:])) if shapes[2:] else (shapes[0], shapes[1])


def export_stack_onnx(graph: EncoderGraph | DecoderGraph, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Export an ``EncoderGraph`` / ``DecoderGraph`` (eval mode) with dynamic batch and sequence axes."""
    graph = graph.eval()
    return export_traced(graph, graph.sample_inputs(), graph.dynamic_shapes(), graph.input_names, ["output"], opset)
