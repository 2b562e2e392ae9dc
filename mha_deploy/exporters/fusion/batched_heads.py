"""Attention over heads folded into the batch (``torch.bmm`` on [batch * heads, seq, head_dim]) -> the same
attention on [batch, heads, seq, head_dim], which upstream's SDPA and MHA fusions read.

Why this rule exists: DeBERTa-v2 splits the heads to [batch, heads, seq, head_dim] as everyone does, then views
them as [batch * heads, seq, head_dim] for ``torch.bmm``: its scores are ``bmm(q, k^T / c)`` plus its relative
terms (c2p + p2c, also [batch * heads, q, kv], divided by the same c), viewed to [batch, heads, q, kv] for the mask
and the Softmax, and its context ``bmm(probs.view(-1, q, kv), v)`` is viewed back to [batch, heads, seq, head_dim]
before the heads merge. Upstream's patterns take 4-D queries, keys and values only, so none of its attentions
fused. Two rules undo the fold:

    scores   Reshape(Add(MatMul(Reshape(q4), Div(Transpose(Reshape(k4), [0, 2, 1]), c)), rel), [-1, H, q, kv])
             -> Add(MatMul(q4, Div(Transpose(k4, [0, 1, 3, 2]), c)), Reshape(rel, [-1, H, q, kv]))
    context  Reshape(MatMul(Reshape(probs4), Reshape(v4)), [-1, H, kv, head_dim]) -> MatMul(probs4, v4)

Both are exact: a row-major view of [batch, heads, ...] as [batch * heads, ...] and back is the identity, and a
batched MatMul over batch * heads is the 4-D one over [batch, heads]. The relative terms stay a bias added to
the scores, which ``score_bias_sum`` sums with the mask and ``native_mask`` keeps as the op's attention_bias.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern


def _heads(value: ir.Value) -> tuple[int, int] | None:
    """(heads, head_dim) of a [batch, heads, seq, head_dim] value with both static, else None."""
    shape = value.shape
    if shape is None or shape.rank() != 4 or not all(isinstance(dim, int) for dim in (shape[1], shape[3])):
        return None
    return shape[1], shape[3]


def _folds(value: ir.Value, heads: int, width: int) -> bool:
    """Whether ``value`` (a Reshape's output) is a [batch * heads, seq, width] view: rank 3, last dim ``width``."""
    shape = value.shape
    return shape is not None and shape.rank() == 3 and shape[2] == width and shape[0] != heads


def _unfolds(value: ir.Value, heads: int, width) -> bool:
    """Whether ``value`` (a Reshape's output) is [batch, heads, seq, width] (``width`` None: any last dim)."""
    shape = value.shape
    return (shape is not None and shape.rank() == 4 and shape[1] == heads
            and (width is None or shape[3] == width))


class BatchedHeadScores(pattern.RewriteRuleClassBase):
    # The [batch * heads, ...] views of q and k stay out of the pattern: DeBERTa's relative terms read them too.
    def pattern(self, op, q3, k3, scale, rel, heads_shape):
        scores = op.MatMul(q3, op.Div(op.Transpose(k3, perm=[0, 2, 1]), scale))
        return op.Reshape(op.Add(scores, rel), heads_shape, _outputs=["scores4"])

    def check(self, context, q3, k3, scale, rel, scores4, **_):
        result = pattern.MatchResult()
        q4, k4 = _unfolded(q3), _unfolded(k3)
        found = None if q4 is None or k4 is None else _heads(q4)
        if found is None or _heads(k4) != found:
            return result.fail("queries and keys are not views of [batch, heads, seq, head_dim] (static heads)", q3)
        heads, width = found
        if not (_folds(q3, heads, width) and _folds(k3, heads, width)
                and q3.shape[1] == q4.shape[2] and k3.shape[1] == k4.shape[2]):
            return result.fail("the queries and keys are not viewed as [batch * heads, seq, head_dim]", q3)
        if not _unfolds(scores4, heads, None):
            return result.fail("the scores are not viewed back to [batch, heads, q, kv]", scores4)
        if scale.const_value is None or scale.const_value.size != 1:
            return result.fail("the key is not divided by one constant", scale)
        if rel.shape is None or rel.shape.rank() != 3:
            return result.fail("the term added to the scores is not [batch * heads, q, kv]", rel)
        self._q4, self._k4 = q4, k4
        return result

    def rewrite(self, op, scale, rel, heads_shape, **_):
        scores = op.MatMul(self._q4, op.Div(op.Transpose(self._k4, perm=[0, 1, 3, 2]), scale))
        return op.Add(scores, op.Reshape(rel, heads_shape))


def _unfolded(value: ir.Value) -> ir.Value | None:
    """What ``value`` is a Reshape of, when that is 4-D."""
    node = value.producer()
    if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
        return None
    source = node.inputs[0]
    return source if source.shape is not None and source.shape.rank() == 4 else None


class BatchedHeadContext(pattern.RewriteRuleClassBase):
    def pattern(self, op, probs4, v4, p_rows, v_rows, heads_shape):
        context = op.MatMul(op.Reshape(probs4, p_rows, _outputs=["p3"]), op.Reshape(v4, v_rows, _outputs=["v3"]))
        return op.Reshape(context, heads_shape, _outputs=["context4"])

    def check(self, context, probs4, v4, p3, v3, context4, **_):
        result = pattern.MatchResult()
        found = _heads(v4)
        if found is None:
            return result.fail("the values are not [batch, heads, seq, head_dim] with static heads", v4)
        heads, width = found
        probs = probs4.producer()
        if probs is None or probs.op_type != "Softmax" or not _unfolds(probs4, heads, None):
            return result.fail("the probabilities are not a Softmax over [batch, heads, q, kv]", probs4)
        if not (_folds(v3, heads, width) and p3.shape is not None and p3.shape.rank() == 3):
            return result.fail("the probabilities and values are not viewed as [batch * heads, ...]", v3)
        if not _unfolds(context4, heads, width):
            return result.fail("the context is not viewed back to [batch, heads, seq, head_dim]", context4)
        return result

    def rewrite(self, op, probs4, v4, **_):
        return op.MatMul(probs4, v4)


batched_heads_rules = pattern.RewriteRuleSet([BatchedHeadScores.rule(), BatchedHeadContext.rule()])


def fuse_batched_heads(model: ir.Model) -> int:
    """Apply the rules everywhere in ``model``; the number of rewrites."""
    return batched_heads_rules.apply_to_model(model)
