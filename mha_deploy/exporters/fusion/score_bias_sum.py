"""``Softmax(Add(Add(scores, a), b))`` -> ``Softmax(Add(scores, Add(a, b)))``.

Why this rule exists: upstream's SDPA fusion reads one additive mask between the
scores and the Softmax. T5 adds two: its relative position bias, then the mask
(``scores += position_bias_masked``, which the exporter's optimizer splits back
into two Adds), so no attention of T5 matched ("None of the alternatives
matched"). Summing the two terms first gives upstream the one bias it reads;
``native_mask`` then reads that sum term by term (``mask_probe``): the mask goes
to the op's own key-padding input / causal flag, the position bias stays its
``attention_bias``. The sum is exact up to float addition order, and a masking
fill swamps any finite bias either way.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

# What produces scores: the q.kT MatMul, or it scaled.
_SCORE_PRODUCERS = {"MatMul", "Mul", "Div"}


def _is_scores(value: ir.Value) -> bool:
    """Whether ``value`` is q.kT (or it scaled): a MatMul, possibly under one Mul/Div by a constant."""
    node = value.producer()
    if node is None or node.op_type not in _SCORE_PRODUCERS or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "MatMul":
        return True
    first = node.inputs[0].producer()
    return first is not None and first.op_type == "MatMul"


class ScoreBiasSum(pattern.RewriteRuleClassBase):
    def pattern(self, op, scores, first, second):
        return op.Softmax(op.Add(op.Add(scores, first), second), axis=-1)

    def check(self, context, scores, first, second, **_):
        result = pattern.MatchResult()
        if not _is_scores(scores):
            return result.fail("the innermost Add's first operand is not the scores MatMul", scores)
        if any(_is_scores(term) for term in (first, second)):
            return result.fail("a term added to the scores is itself a MatMul", first)
        # (A term a rule before just built has no type yet.)
        if any(term.dtype not in (None, scores.dtype) for term in (first, second)):
            return result.fail("the terms are not of the scores' float type", scores)
        return result

    def rewrite(self, op, scores, first, second, **_):
        return op.Softmax(op.Add(scores, op.Add(first, second)), axis=-1)


score_bias_sum_rules = pattern.RewriteRuleSet([ScoreBiasSum.rule()])


def fuse_score_bias_sum(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return score_bias_sum_rules.apply_to_model(model)
