"""torch's own attention, rewritten into the reference form before export.

torch exports ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` (and so
``nn.TransformerEncoderLayer``) as the standard ONNX ``Attention`` op over a mask it builds for
itself: ORT's CPU kernel for it materialises the scores, and it refuses the [batch, 1, 1, kv]
padding mask these produce (it wants the query axis explicit), so such a graph does not even run
unfused. Written out the way the reference attention is (projections, heads split with view and
transpose, ``masked_fill`` of the scores, softmax), the same computation exports as the subgraph
the fusion rules know, and gets the same kernels: flash when nothing is padded, key padding as the
op's own mask, causal on GroupQueryAttention.

Exactness: the same arithmetic in the same order as torch's math path (scale folded as
``1 / sqrt(d)`` unless given, bool masks filled with -inf, float masks added). Parity against the
original module, unrewritten, is what every export checks.

A query row with no visible key (left padding under a causal mask makes one): torch's
``F.scaled_dot_product_attention`` returns 0 there (its ``_safe_softmax``), and so does
``nn.MultiheadAttention`` with ``need_weights=False`` (what ``nn.Transformer*`` layers call), both
measured on torch 2.13; with ``need_weights=True`` it takes a plain softmax and returns NaN. The
reference form gives the same: ``Where(IsNaN(p), 0, p)`` after the softmax, the spelling of a safe
softmax the upstream SDPA fusion absorbs, so the fused graph has no trace of it. A NaN left there
would reach real rows through the next layer's keys and values (0 x NaN). torch's fast path
(``_native_multi_head_attention``, taken in eval under ``no_grad`` with bool masks) returns NaN
there instead: parity runs the module with it off (``without_fast_path``), in the semantics torch
documents and trains with.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mha_deploy.errors import ExportError

_TORCH_SDPA = F.scaled_dot_product_attention


def reference_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` in eval, written as the reference attention computes it."""
    if enable_gqa and query.size(-3) != key.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    # [batch, heads, q_len, kv_len]
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        q_len, kv_len = query.size(-2), key.size(-2)
        causal = torch.tril(torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device))
        scores = scores.masked_fill(causal == 0, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # True = attend
            scores = scores.masked_fill(attn_mask == 0, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.matmul(_safe_softmax(scores), value)


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, 0 on a row whose scores are all -inf (torch's ``_safe_softmax``; written with
    IsNaN, which such a row's softmax is everywhere, as the upstream SDPA fusion reads it)."""
    weights = torch.softmax(scores, dim=-1)
    return torch.where(torch.isnan(weights), 0.0, weights)


def _projections(attention: nn.MultiheadAttention):
    # Slices, not chunk(): the exporter folds a Slice of a parameter into a constant, a Split it leaves.
    e = attention.embed_dim
    thirds = (slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e))
    if attention._qkv_same_embed_dim:
        weights = tuple(attention.in_proj_weight[part] for part in thirds)
    else:
        weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
    bias = attention.in_proj_bias
    biases = tuple(bias[part] for part in thirds) if bias is not None else (None, None, None)
    return weights, biases


def reference_multihead_forward(
    self: nn.MultiheadAttention, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False,
):
    """``nn.MultiheadAttention.forward`` in eval, written as the reference attention computes it."""
    if not self.batch_first:  # [seq, batch, embed] -> [batch, seq, embed]
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    batch, q_len, _ = query.shape
    kv_len = key.size(1)
    heads, d_k = self.num_heads, self.head_dim
    (w_q, w_k, w_v), (b_q, b_k, b_v) = _projections(self)
    # [batch, seq, embed] -> [batch, heads, seq, d_k]
    q = F.linear(query, w_q, b_q).view(batch, q_len, heads, d_k).transpose(1, 2)
    k = F.linear(key, w_k, b_k).view(batch, kv_len, heads, d_k).transpose(1, 2)
    v = F.linear(value, w_v, b_v).view(batch, kv_len, heads, d_k).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    if attn_mask is not None:  # [q_len, kv_len] or [batch * heads, q_len, kv_len]; bool True = not allowed
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, heads, q_len, kv_len)
        scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if key_padding_mask is not None:  # [batch, kv_len]; bool True = padding
        if key_padding_mask.dtype == torch.bool:
            keep = ~key_padding_mask
            scores = scores.masked_fill(keep.unsqueeze(1).unsqueeze(2) == 0, float("-inf"))
        else:
            scores = scores + key_padding_mask.unsqueeze(1).unsqueeze(2)
    # torch computes need_weights=True with a plain softmax (NaN on a row with no visible key), and
    # need_weights=False through scaled_dot_product_attention (0 there).
    weights = torch.softmax(scores, dim=-1) if need_weights else _safe_softmax(scores)
    context = torch.matmul(weights, v).transpose(1, 2).contiguous().view(batch, q_len, heads * d_k)
    output = self.out_proj(context)
    if not self.batch_first:
        output = output.transpose(0, 1)
    if not need_weights:
        return output, None
    return output, weights.mean(dim=1) if average_attn_weights else weights


def in_reference_form(module: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``module`` whose ``nn.MultiheadAttention`` s compute in the reference form; how many.

    Their forward is replaced on the instance, so that the code around them (``nn.TransformerEncoderLayer``
    reads their attributes) sees the same modules with the same parameters.
    """
    attentions = [layer for layer in module.modules() if isinstance(layer, nn.MultiheadAttention)]
    if not attentions:
        return module, 0
    module = copy.deepcopy(module)
    for layer in module.modules():
        if isinstance(layer, nn.MultiheadAttention):
            if layer.bias_k is not None or layer.add_zero_attn:
                raise ExportError(
                    "nn.MultiheadAttention with add_bias_kv or add_zero_attn has no reference form: attentions "
                    "that append learned or zero keys are not supported"
                )
            layer.forward = types.MethodType(reference_multihead_forward, layer)
    return module, len(attentions)


@contextlib.contextmanager
def without_fast_path() -> Iterator[None]:
    """torch's fused fast paths (``nn.MultiheadAttention``'s and ``nn.TransformerEncoderLayer``'s) off: the
    module computes through the code the exporter sees, and gives 0, not NaN, on a query row with no
    visible key (the fast path's NaN there reaches real rows of the next layer)."""
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


@contextlib.contextmanager
def reference_attention() -> Iterator[None]:
    """While tracing: ``F.scaled_dot_product_attention`` computes in the reference form, and torch's fast
    paths are off, so that every attention goes through code the exporter sees."""
    F.scaled_dot_product_attention = reference_sdpa
    try:
        with without_fast_path():
            yield
    finally:
        F.scaled_dot_product_attention = _TORCH_SDPA
