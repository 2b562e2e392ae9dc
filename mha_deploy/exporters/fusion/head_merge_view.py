"""``Reshape(Transpose(x, [0, 2, 1, 3]), rows)`` -> ``Reshape(Reshape(Transpose(x), [0, 0, -1]), rows)`` when the
heads are merged straight into a shape other than [batch, seq, d].

Why this rule exists: GPT-2's Conv1D is ``addmm(bias, x.view(-1, x.size(-1)), weight)``, so its output
projection reads the attention's merged heads flattened to [batch * seq, d] in one Reshape. Upstream's MHA
fusion takes the Reshape after the head merge as the attention's [batch, seq, d] output without reading its
shape, and the Gemm after it then gets the op's 3-D output: ORT refuses to run it ("left.NumDimensions() == 2").
Merging the heads to [batch, seq, d] first gives the fusion the Reshape it expects, and the flattening stays
after the op. Two row-major Reshapes are the one they compose to, so the rewrite changes no value.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_HEAD_MERGE = [0, 2, 1, 3]


class HeadMergeToRows(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, shape):
        return op.Reshape(op.Transpose(x, perm=_HEAD_MERGE), shape, _outputs=["merged"])

    def check(self, context, x, shape, merged, **_):
        result = pattern.MatchResult()
        if x.shape is None or x.shape.rank() != 4:
            return result.fail("not a [batch, heads, seq, head_dim] tensor", x)
        rank = merged.shape.rank() if merged.shape is not None else None
        if rank is None and shape.shape is not None and shape.shape.rank() == 1:
            rank = shape.shape[0] if isinstance(shape.shape[0], int) else None
        if rank is None or rank == 3:
            return result.fail("the heads are merged into [batch, seq, d] (or a shape of unknown rank)", merged)
        if merged.producer().attributes.get_int("allowzero", 0):
            return result.fail("allowzero Reshape", merged)
        return result

    def rewrite(self, op, x, shape, **_):
        rows = op.Reshape(op.Transpose(x, perm=_HEAD_MERGE), op.Constant(value=ir.tensor(np.array([0, 0, -1],
                                                                                                   np.int64))))
        return op.Reshape(rows, shape)


head_merge_view_rules = pattern.RewriteRuleSet([HeadMergeToRows.rule()])


def fuse_head_merge_view(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return head_merge_view_rules.apply_to_model(model)
