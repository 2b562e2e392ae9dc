"""Standard ONNX ``Attention`` over 4-D Q/K/V (torch's ``F.scaled_dot_product_attention``) -> upstream's SDPA.

Why this rule exists: at opset 23 torch exports ``F.scaled_dot_product_attention``
(and ``nn.MultiheadAttention``) as one standard ``Attention`` op over
[batch, heads, seq, head_size] inputs. No Softmax is left for the reference
pattern's rules to find, so such a model came out unfused: ORT's CPU kernel for
that op materialises the scores, and none of the kernel choices the chain makes
(flash, padding compaction, GroupQueryAttention, the short-sequence branch)
applied. Rewritten into the private SDPA op that upstream's ``sdpa`` fusion
produces, the op goes down the same chain as the reference attention: ``mha``
folds the head split and merge around it into ``com.microsoft.MultiHeadAttention``
and ``native_mask`` reads its mask.

The mask becomes the additive bias the chain reads (``mask_analysis``):

- bool ``attn_mask`` (True = attend) -> ``Where(attn_mask, 0, FILL)``;
- float ``attn_mask`` -> itself (it is already added to the scores);
- ``is_causal`` -> ``kv_pos[None, :] <= q_pos[:, None]`` from one Range, combined
  with the mask (And for bool, Add of its bias for float). Only when q_len ==
  kv_len is known: with different lengths the op's causal alignment differs
  between runtimes (DESIGN), and the rule leaves it alone.

FILL is -1e9 (the reference's), -1e4 in half precision: finite, so that a row
with no visible key stays finite, as the parity contract asks of padded rows.
The scale is the op's (default 1/sqrt(head_size), as SDPA's).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_FUSION_DOMAIN = "ai.onnxruntime._fusion"
_HALF = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
# Attributes that change what the op computes beyond scaled dot-product attention with a mask.
_UNSUPPORTED = {"softcap": 0.0, "q_num_heads": None, "kv_num_heads": None}


def is_torch_attention(node: ir.Node) -> bool:
    """A standard ``Attention`` over 4-D [batch, heads, seq, head_size] query: what torch exports for
    ``F.scaled_dot_product_attention``. The chain's own standard ``Attention`` ops take 3-D inputs."""
    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        return False
    query = node.inputs[0]
    return query is not None and query.shape is not None and query.shape.rank() == 4


def _fill(dtype: ir.DataType) -> float:
    return -1e4 if dtype in _HALF else -1e9


class SDPAFromAttention(pattern.RewriteRuleClassBase):
    def pattern(self, op, query, key, value):
        return op.Attention(query, key, value, _allow_other_inputs=True, _outputs=["attention"])

    def check(self, context, query, key, value, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        if not is_torch_attention(node):
            return result.fail("query is not 4-D [batch, heads, q_len, head_size]", query)
        if len(node.inputs) > 4:
            return result.fail("the op has past state or nonpad_kv_seqlen inputs", node)
        if any(output.uses() or output.is_graph_output() for output in node.outputs[1:]):
            return result.fail("the op's present state or scores outputs are used", node)
        for name, default in _UNSUPPORTED.items():
            attribute = node.attributes.get(name)
            if attribute is not None and attribute.value != default:
                return result.fail(f"attribute {name}={attribute.value} is not supported", node)
        for tensor in (key, value):
            if tensor.shape is None or tensor.shape.rank() != 4:
                return result.fail(f"{tensor.name} is not 4-D [batch, heads, kv_len, head_size]", tensor)
        if not (query.shape[1] == key.shape[1] == value.shape[1]) or not isinstance(query.shape[1], int):
            return result.fail("query, key and value do not have one known number of heads", node)
        if query.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE, *_HALF):
            return result.fail("query is not floating point", query)
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is not None and mask.dtype not in (ir.DataType.BOOL, query.dtype):
            return result.fail(f"attn_mask is {mask.dtype}, neither bool nor the query's type", mask)
        if node.attributes.get_int("is_causal", 0) and query.shape[2] != key.shape[2]:
            return result.fail("is_causal with q_len and kv_len not known to be equal (alignment differs)", node)
        return result

    def rewrite(self, op, query, key, value, attention, **_):
        node = attention.producer()
        dtype = query.dtype.numpy()
        zero = op.Constant(value=ir.tensor(np.array(0, dtype=dtype)))
        fill = op.Constant(value=ir.tensor(np.array(_fill(query.dtype), dtype=dtype)))
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        keep = mask is not None and mask.dtype == ir.DataType.BOOL  # else additive, or none
        if node.attributes.get_int("is_causal", 0):
            causal = _causal_mask(op, query)
            if keep:
                mask = op.And(mask, causal)
            else:
                causal = op.Where(causal, zero, fill)
                mask = causal if mask is None else op.Add(mask, causal)
        if keep:
            mask = op.Where(mask, zero, fill)
        inputs = [query, key, value] + ([mask] if mask is not None else [])
        scale = node.attributes.get_float("scale", None)
        return op.SDPA(*inputs, scale=scale, key_format="BHSd", _domain=_FUSION_DOMAIN)


def _causal_mask(op, query: ir.Value) -> ir.Value:
    """bool [q_len, q_len], True where key position <= query position: from one Range, as mask_analysis reads it.
    Its shape is set here: shape inference cannot tell a Range's length."""
    q_len = query.shape[2]
    length = op.Squeeze(_query_length(op, query))
    positions = op.Range(
        op.Constant(value=ir.tensor(np.array(0, np.int64))), length, op.Constant(value=ir.tensor(np.array(1, np.int64)))
    )
    keys = op.Unsqueeze(positions, op.Constant(value_ints=[0]))
    queries = op.Unsqueeze(positions, op.Constant(value_ints=[1]))
    causal = op.LessOrEqual(keys, queries)
    for value, shape in ((positions, [q_len]), (keys, [1, q_len]), (queries, [q_len, 1]), (causal, [q_len, q_len])):
        value.shape = ir.Shape(shape)
    positions.dtype = keys.dtype = queries.dtype = ir.DataType.INT64
    causal.dtype = ir.DataType.BOOL
    return causal


def _query_length(op, query: ir.Value) -> ir.Value:
    """[q_len], read before the head split ``Transpose(Reshape(x), perm=[0, 2, 1, 3])`` when there is one:
    another use of those nodes would stop upstream's mha fusion from replacing them ("matched nodes have
    other uses")."""
    transpose = query.producer()
    heads_split = transpose is not None and transpose.op_type == "Transpose"
    if heads_split and list(transpose.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
        reshape = transpose.inputs[0].producer()
        if reshape is not None and reshape.op_type == "Reshape":
            source = reshape.inputs[0]
            if source.shape is not None and source.shape.rank() == 3 and source.shape[1] == query.shape[2]:
                return op.Shape(source, start=1, end=2)
    return op.Shape(query, start=2, end=3)


sdpa_from_attention_rules = pattern.RewriteRuleSet([SDPAFromAttention.rule()])


def fuse_sdpa_from_attention(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return sdpa_from_attention_rules.apply_to_model(model)
