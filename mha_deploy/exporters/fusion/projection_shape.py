"""``Shape(Add(MatMul(x, W), b), start, end)`` -> ``Shape(x, start, end)`` for leading axes.

Why this rule exists: when upstream's MHA fusion broadcasts a [batch, 1, 1,
kv_len] mask it inserts ``Expand(mask, Concat(1, 1, Shape(query, 1, 2), 1))``
where ``query`` is the biased projection ``Add(MatMul(x, W_q), b_q)``. That extra
use keeps the ``Add`` alive, and upstream's MHA-bias fusion then refuses to fold
the projection bias into the attention op ("matched nodes have other uses"). A
projection keeps every axis but the last, so the shape can be read from its
input instead.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern


class ShapeThroughProjection(pattern.RewriteRuleClassBase):
    def __init__(self):
        # The projection stays (the attention op reads it): only the Shape is replaced.
        super().__init__("ShapeThroughProjection", remove_nodes=False)

    def pattern(self, op, x, weight, bias):
        return op.Shape(op.Add(op.MatMul(x, weight), bias), _outputs=["shape"])

    def check(self, context, x, weight, bias, shape, **_):
        result = pattern.MatchResult()
        node = shape.producer()
        rank = x.shape.rank() if x.shape is not None else None
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", None)
        if rank is None or weight.shape is None or weight.shape.rank() != 2:
            return result.fail("not a projection of a tensor of known rank", x)
        if bias.shape is None or bias.shape.rank() != 1:
            return result.fail("the bias is not a vector", bias)
        if end is None or start < 0 or not 0 < end < rank:
            return result.fail(f"Shape(start={start}, end={end}) reaches the projected axis", node)
        return result

    def rewrite(self, op, x, shape, **_):
        node = shape.producer()
        return op.Shape(x, start=node.attributes.get_int("start", 0), end=node.attributes.get_int("end"))


projection_shape_rules = pattern.RewriteRuleSet([ShapeThroughProjection.rule()])


def fuse_projection_shape(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return projection_shape_rules.apply_to_model(model)
