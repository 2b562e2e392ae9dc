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
from torch import nn

from mha_deploy.exporters.graphs import build_attention_mask
from mha_deploy.exporters.torch_export import DEFAULT_OPSET, export_onnx
from mha_deploy.models.transformer import Decoder, Encoder
from mha_deploy.signature import Signature


class EncoderGraph(nn.Module):
    def __init__(self, encoder: Encoder, mask: str = "padding"):
        super().__init__()
        self.encoder = encoder
        self.signature = Signature("self", mask, model="encoder")

    def forward(self, x, key_padding_mask=None):
        seq = x.shape[1]
        mask = build_attention_mask(key_padding_mask, seq, seq, causal=False, device=x.device)
        return self.encoder(x, mask)


class DecoderGraph(nn.Module):
    def __init__(self, decoder: Decoder, mask: str = "padding"):
        super().__init__()
        self.decoder = decoder
        self.signature = Signature("cross", mask, model="decoder")

    def forward(self, x, memory, key_padding_mask=None, memory_padding_mask=None):
        tgt_len, mem_len = x.shape[1], memory.shape[1]
        self_mask = build_attention_mask(key_padding_mask, tgt_len, tgt_len, True, x.device)
        memory_mask = build_attention_mask(memory_padding_mask, tgt_len, mem_len, False, x.device)
        return self.decoder(x, memory, self_mask, memory_mask)


def stack_graph(stack: Encoder | Decoder, mask: str = "padding") -> EncoderGraph | DecoderGraph:
    """The eval-mode export graph of a stack, with its signature."""
    graph_cls = EncoderGraph if isinstance(stack, Encoder) else DecoderGraph
    return graph_cls(stack.eval(), mask).eval()


def export_stack_onnx(graph: EncoderGraph | DecoderGraph, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Export an ``EncoderGraph`` / ``DecoderGraph`` with the dynamic axes of its signature."""
    stack = graph.encoder if isinstance(graph, EncoderGraph) else graph.decoder
    return export_onnx(graph.eval(), graph.signature, stack.d_model, opset)
