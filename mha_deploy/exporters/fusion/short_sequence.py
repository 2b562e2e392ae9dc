"""Contrib MHA (mask-free, padded, causal) -> ``If(short, standard Attention, MultiHeadAttention)``, with its
bias moved out.

Why this rule exists: ORT 1.31's CPU ``MultiHeadAttention`` runs its flash
kernel whenever it has no mask, and on short sequences that kernel's fixed
costs per (batch, head) dominate; the standard ``Attention`` op's kernel, which
materialises the [batch, heads, q_len, kv_len] scores, is about twice as fast
there. Op alone, d_model 512, 8 heads, 2 threads, fp32, medians of interleaved
calls (MHA vs Attention, ms): (32,64) 3.3 vs 1.7, (128,64) 15.8 vs 8.0, (8,128)
2.1 vs 1.4, (64,128) 19.6 vs 13.4, (4,256) 3.0 vs 2.3, (16,256) 13.2 vs 11.5,
(2,512) 5.1 vs 4.7, (1,1024) 9.3 vs 9.5; the flash kernel holds nothing of
[q_len, kv_len], the other holds all of it.

With a key padding mask the same holds against every path padding_flash has:
the masked MHA kernel, and the flash one after gathering the real keys. The
standard op takes the mask as an additive attn_mask, which ORT's CPU kernel
wants as [batch, 1, q_len, kv_len] (it does not broadcast over the queries), so
the graph expands it, within the bounds only. Op alone, one run (ms, Attention
with the expanded mask vs MHA with key_padding_mask): (32,64) 1.8 vs 3.7,
(8,128) 1.5 vs 2.2, (128,64) 8.8 vs 18.0, (4,256) 3.1 vs 4.2, (16,256) 13.6 vs
16.5; (2,512) 6.3 vs 6.7 and (1,1024) 12.3 vs 11.0, beyond the bounds.

``Attention`` has no bias input, and an Add per projection costs what it saves
(0.3-0.5 ms each at (32,64)). Two of the three are not needed:

- the key bias adds ``(q + b_q) . b_k`` to every score of a query row, the same
  for all its keys, and a softmax does not change when its row is shifted: it is
  dropped, exactly (masked keys included: their fill swamps the shift);
- the value bias comes out of the attention unchanged (each row of
  probabilities sums to 1: sum_j p_j (v_j + b_v) = sum_j p_j v_j + b_v), so it
  is added to the op's output, where ``output_bias`` folds it into the output
  projection's bias.

So the op becomes::

    Add(If(kv_len <= SHORT_KEYS_MAX and scores <= SHORT_SCORES_MAX_BYTES,
           Attention(q + b_q, k, v[, attn_mask][, is_causal]),
           MultiHeadAttention(q + b_q, k, v[, key_padding_mask][, unidirectional])), b_v)

and causal_gqa and padding_flash, which run next, rewrite a causal or masked
MultiHeadAttention of the long branch. Whole block with the value bias folded, against the flash op
alone, same shapes, one interleaved run (ms): (32,64) 15.6 vs 17.2, (8,128) 9.0
vs 9.8, (128,64) 64.4 vs 70.6, (4,256) 9.5 vs 9.9, (16,256) 39.3 vs 41.0;
(1,1024) 16.0 vs 15.5, where the flash kernel stays. The bytes bound keeps a
long batch of short rows from materialising much: 64 MB is (128,128) at 8 heads.

Causal self-attention: the standard op with ``is_causal`` (and the padding
mask, additive, for padding-causal: exact on every real query, which sees a
real key, itself) against GroupQueryAttention's materialising path, what
causal_gqa runs on short sequences; op alone, one run, with denormals flushed
as ``MHASession`` does (``mha_deploy.runtime.denormals``; without, the
standard op's masked probabilities made it the slower one: 3.3 vs 3.1 ms at
(32,64)), ms: (32,64) 1.4 vs 2.5, (8,128) 1.2 vs 1.6, (4,256) 2.1 vs 2.4;
beyond the bounds (1,512) 2.3 vs 2.0, (2,512) 4.3 vs 3.9, (1,1024) 9.5 vs 7.7.
Causal ops over another sequence (q_len != kv_len) keep their op.

Only ops in the model's graph (not in a branch) with a [3 * hidden] bias are
rewritten.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._context import TapeBuilder

from mha_deploy.exporters.fusion.compaction import int64
from mha_deploy.exporters.fusion.contrib_mha import (
    ATTENTION_BIAS,
    BIAS,
    KEY_PADDING_MASK,
    ContribMHARule,
    has_inputs_from,
    move_bias_out,
    optional_input,
)
from mha_deploy.exporters.fusion.mask_analysis import dims_match, finite_fill
from mha_deploy.exporters.fusion.op_branches import (
    copied_attributes,
    in_subgraph,
    op_branch,
    score_bytes,
    tag_kernel,
    tape_branch,
)
from mha_deploy.onnx_nodes import LONG_KERNEL

# Longest key sequence that takes the standard Attention op (module docstring).
SHORT_KEYS_MAX = 256
# Largest [batch, heads, q_len, kv_len] score tensor it may materialise.
SHORT_SCORES_MAX_BYTES = 64 * 2**20
# The standard Attention op is in the default domain from opset 23.
_ATTENTION_OPSET = 23


class ShortSequence(ContribMHARule):
    def __init__(self, keys_max: int = SHORT_KEYS_MAX, scores_max_bytes: int = SHORT_SCORES_MAX_BYTES) -> None:
        super().__init__()
        self.keys_max, self.scores_max_bytes = keys_max, scores_max_bytes

    def check(self, context, query, key, value, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        if in_subgraph(context):
            return result.fail("the op is inside a subgraph (an If branch)", node)
        if context.model.opset_imports.get("", 0) < _ATTENTION_OPSET:
            return result.fail(f"the model's opset is below {_ATTENTION_OPSET} (no standard Attention)", node)
        if len(node.outputs) != 1 or has_inputs_from(node, ATTENTION_BIAS):
            return result.fail("the op has an attention_bias or past/present state", node)
        for value_ in (query, key, value):
            if value_ is None or value_.shape is None or value_.shape.rank() != 3:
                return result.fail("query/key/value must be 3-D [batch, seq, hidden]", node)
        causal = node.attributes.get_int("unidirectional", 0)
        if causal and not (dims_match(key, list(query.shape)) and dims_match(value, list(query.shape))):
            # is_causal aligns queries and keys at their first position: one sequence only.
            return result.fail("the op is causal over keys other than its queries' sequence", key)
        hidden = query.shape[2]
        if not isinstance(hidden, int) or attention.dtype is None:
            return result.fail("hidden size or dtype unknown", query)
        bias = optional_input(node, BIAS)
        if bias is None or bias.shape is None or list(bias.shape) != [3 * hidden]:
            return result.fail("bias is not [3 * hidden]", bias or node)
        mask = optional_input(node, KEY_PADDING_MASK)
        if mask is not None and (mask.dtype != ir.DataType.INT32 or mask.shape is None or mask.shape.rank() != 2):
            return result.fail("key_padding_mask is not int32 [batch, kv_len]", mask)
        return result

    def rewrite(self, op, query, key, value, attention, **_):
        node = attention.producer()
        num_heads = node.attributes.get_int("num_heads")
        q, value_bias = move_bias_out(op, query, optional_input(node, BIAS))
        mask = optional_input(node, KEY_PADDING_MASK)
        # int64 [1], as If takes a one-element condition
        kv_len = op.Shape(key, start=1, end=2)
        scores = score_bytes(op, q, key, num_heads, attention.dtype.itemsize)
        short = op.And(
            op.LessOrEqual(kv_len, int64(op, self.keys_max)),
            op.LessOrEqual(scores, int64(op, self.scores_max_bytes)),
        )
        scale = node.attributes.get_float("scale", None)
        scaled = {"scale": scale} if scale is not None else {}
        base = attention.name or node.name or "attention"
        causal = node.attributes.get_int("unidirectional", 0)
        attributes = {"q_num_heads": num_heads, "kv_num_heads": num_heads, **scaled}
        if causal:
            attributes["is_causal"] = 1
        standard = _standard_branch(q, key, value, mask, attributes, attention, f"{base}_short")
        # The op itself, on the biased query and without its bias: causal_gqa and padding_flash, which run
        # next, rewrite a causal or masked one there.
        long = op_branch(
            "com.microsoft",
            "MultiHeadAttention",
            [q, key, value, None, mask],
            copied_attributes(node),
            f"{base}_flash" if mask is None and not causal else f"{base}_long",
            like=attention,
        )
        output = op.If(short, then_branch=standard, else_branch=long)
        tag_kernel(output, short_sequence_kernel(LONG_KERNEL, self.keys_max, self.scores_max_bytes / 2**20))
        return op.Add(output, value_bias)


def short_sequence_kernel(long_kernel: str, keys_max: int, scores_max_mb: float) -> str:
    """What this rule's If runs on ORT's CPU provider: ``long_kernel`` (its else branch's) beyond the bounds,
    the standard Attention op, which materialises the scores, within them."""
    return f"{long_kernel}; up to {keys_max:d} keys and {scores_max_mb:g} MB of scores the standard Attention op " \
        "(materialising)"


def _standard_branch(q, key, value, mask, attributes, attention: ir.Value, name: str) -> ir.Graph:
    """The standard Attention op on ``q``, ``key``, ``value``; with ``mask`` (int32 [batch, kv_len], 0 =
    padding) as an additive attn_mask [batch, 1, q_len, kv_len]: ORT 1.31's CPU kernel does not broadcast it
    over the queries. The fill is half the dtype's lowest value: a padded key's probability is 0 in any row
    with a real key, and a row without one averages its values as the reference does (its scores are all the
    fill, whatever the products)."""
    if mask is None:
        return op_branch("", "Attention", [q, key, value], attributes, name, like=attention)
    op = TapeBuilder()
    dtype = attention.dtype.numpy()
    zero, fill = (op.Constant(value=ir.tensor(np.array(x, dtype))) for x in (0, finite_fill(-np.inf, dtype)))
    additive = op.Unsqueeze(op.Where(op.Cast(mask, to=ir.DataType.BOOL), zero, fill), int64(op, [1, 2]))
    rows = op.Concat(int64(op, [1, 1]), op.Shape(q, start=1, end=2), int64(op, [1]), axis=0)
    output = op.Attention(q, key, value, op.Expand(additive, rows), **attributes)
    return tape_branch(op, output, attention, name)


def short_sequence_rules_with(keys_max: int, scores_max_bytes: int) -> pattern.RewriteRuleSet:
    """The rule with other bounds (tests take both branches on small shapes)."""
    return pattern.RewriteRuleSet([ShortSequence.rule(keys_max, scores_max_bytes)])


short_sequence_rules = short_sequence_rules_with(SHORT_KEYS_MAX, SHORT_SCORES_MAX_BYTES)


def fuse_short_sequence(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return short_sequence_rules.apply_to_model(model)
