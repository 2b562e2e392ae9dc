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
- A KV-cache decoder (``Signature.cache_pairs``) is two graphs behind one If
  (``exporters.kv_cache``): ``DecoderPrefillGraph``, the first call, is
  ``DecoderGraph`` (each layer's keys/values are attached to it after fusion);
  ``DecoderKVCacheGraph``, every later call, attends over the caches and reads
  memory only through them.
"""

from __future__ import annotations

import onnx
from torch import nn

from mha_deploy.exporters.graphs import attend_to_heads, attend_with_cache, build_attention_mask
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
        return self.decoder(x, memory, *self.masks(x, memory, key_padding_mask, memory_padding_mask))

    @staticmethod
    def masks(x, memory, key_padding_mask, memory_padding_mask):
        """The reference masks of the causal self-attention and of the cross-attention over memory."""
        tgt_len, mem_len = x.shape[1], memory.shape[1]
        self_mask = build_attention_mask(key_padding_mask, tgt_len, tgt_len, True, x.device)
        memory_mask = build_attention_mask(memory_padding_mask, tgt_len, mem_len, False, x.device)
        return self_mask, memory_mask


class DecoderPrefillGraph(DecoderGraph):
    """A KV-cache decoder's first call before its caches are attached: ``DecoderGraph`` (so that its fusion
    applies unchanged), also returning the input of each layer after the first (``layer_inputs``), from
    which ``exporters.kv_cache.attach_caches`` projects that layer's keys and values."""

    def forward(self, x, memory, key_padding_mask=None, memory_padding_mask=None):
        self_mask, memory_mask = self.masks(x, memory, key_padding_mask, memory_padding_mask)
        layer_inputs = []
        for index, layer in enumerate(self.decoder.layers):
            if index:
                layer_inputs.append(x)
            x = layer(x, memory, self_mask, memory_mask)
        return (x, *layer_inputs)

    def layer_inputs(self) -> tuple[str, ...]:
        """The names of the extra outputs, in order: layer i's input for i >= 1 (layer 0's is ``x``)."""
        return tuple(f"layer_input.{index}" for index in range(1, len(self.decoder.layers)))


class DecoderKVCacheGraph(nn.Module):
    """A KV-cache decoder's later calls: ``(x, memory, *caches, [key_padding_mask, memory_padding_mask])`` in
    ``signature``'s input order -> ``(output, *presents)``. Each layer's self-attention appends x's keys and
    values to its cache (``attend_with_cache``); its cross-attention reads memory's keys/values from its
    encoder cache, returned unchanged, so memory itself is not read."""

    variadic_from = 2  # caches and masks arrive as *args: their number depends on the layers

    def __init__(self, decoder: Decoder, signature: Signature):
        super().__init__()
        self.decoder = decoder
        self.signature = signature

    def forward(self, x, memory, *caches_and_masks):
        layers = self.decoder.layers
        caches, masks = caches_and_masks[: 4 * len(layers)], caches_and_masks[4 * len(layers):]
        key_padding_mask, memory_padding_mask = masks if masks else (None, None)
        presents = []
        for index, layer in enumerate(layers):
            past_key, past_value, encoder_key, encoder_value = caches[4 * index: 4 * index + 4]
            memory_mask = build_attention_mask(memory_padding_mask, x.shape[1], encoder_key.shape[2], False, x.device)
            new_cache = []

            def self_attend(h, layer=layer, past_key=past_key, past_value=past_value, out=new_cache):
                output, present_key, present_value = attend_with_cache(
                    layer.self_attn, h, past_key, past_value, key_padding_mask
                )
                out += [present_key, present_value]
                return output

            def cross_attend(h, layer=layer, keys=encoder_key, values=encoder_value, mask=memory_mask):
                return attend_to_heads(layer.cross_attn, h, keys, values, mask)

            x = layer.combine(x, self_attend, cross_attend)
            presents += [*new_cache, encoder_key, encoder_value]
        return (x, *presents)


def stack_graph(stack: Encoder | Decoder, mask: str = "padding") -> EncoderGraph | DecoderGraph:
    """The eval-mode export graph of a stack, with its signature."""
    graph_cls = EncoderGraph if isinstance(stack, Encoder) else DecoderGraph
    return graph_cls(stack.eval(), mask).eval()


def decoder_cache_graphs(decoder: Decoder, signature: Signature) -> tuple[DecoderPrefillGraph, DecoderKVCacheGraph]:
    """The eval-mode graphs of a KV-cache decoder's first call and of its later calls."""
    return DecoderPrefillGraph(decoder.eval(), signature.mask).eval(), DecoderKVCacheGraph(decoder, signature).eval()


def export_stack_onnx(
    graph: nn.Module, opset: int = DEFAULT_OPSET, output_names: tuple[str, ...] | None = None
) -> onnx.ModelProto:
    """Export a stack's graph with the dynamic axes of its signature (``output_names`` as ``export_onnx``)."""
    stack = graph.encoder if isinstance(graph, EncoderGraph) else graph.decoder
    return export_onnx(graph.eval(), graph.signature, stack.d_model, opset, stack.num_heads, output_names)
