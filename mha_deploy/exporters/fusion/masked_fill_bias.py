"""``Softmax(Where(cond, FILL, scores))`` -> ``Softmax(Add(scores, Where(cond, FILL, 0)))``.

Why this rule exists: the reference masks with ``masked_fill(mask == 0, -1e9)``,
which torch exports as ``Where(Equal(Cast(mask), 0), -1e9, scores)``. Upstream's
SDPA fusion (``onnxscript.rewriter.ort_fusions.sdpa``) only recognises an
*additive* mask (``Add(scores, mask)``), so on our graphs it fuses nothing. Once
the fill is expressed as an additive bias the whole upstream chain (SDPA -> MHA
-> MHA bias -> packed Attention) applies unchanged.

Replace vs add: on a row with at least one visible key, ``exp(s - 1e9 - max)``
is exactly 0 in fp32, the same as the reference's replaced score, so the two
agree; a row with no visible key differs (it is padding, see the parity
contract). The bias this rule builds is only an intermediate form: the later
``native_mask`` rules read the boolean mask back out of it and hand it to the
fused op's own key-padding / causal inputs, so no float [batch, 1, q, kv] bias
survives when the mask is recognised.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.constant_values import scalar_constant

# Anything at least this negative is a "masked" fill: exp of it underflows to 0.
_MIN_FILL_MAGNITUDE = 1e4


class MaskedFillToBias(pattern.RewriteRuleClassBase):
    def pattern(self, op, cond, fill, scores):
        return op.Softmax(op.Where(cond, fill, scores), axis=-1)

    def check(self, context, cond, fill, scores, **_):
        result = pattern.MatchResult()
        value = scalar_constant(fill)
        if value is None:
            return result.fail("the fill is not a scalar constant", fill)
        if value > -_MIN_FILL_MAGNITUDE:
            return result.fail(f"fill {value} is not a masking value (needs <= -{_MIN_FILL_MAGNITUDE:g})", fill)
        if scores.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            return result.fail("scores are not floating point", scores)
        return result

    def rewrite(self, op, cond, fill, scores, **_):
        dtype = scores.dtype.numpy()
        zero = op.Constant(value=ir.tensor(np.zeros((), dtype=dtype)))
        bias = op.Where(cond, fill, zero)
        return op.Softmax(op.Add(scores, bias), axis=-1)


class NestedMaskedFillToBias(MaskedFillToBias):
    """``Softmax(Add(Where(cond, FILL, scores), bias))`` -> ``Softmax(Add(Add(scores, Where(cond, FILL, 0)),
    bias))``: the inner of two ``masked_fill`` s (torch's decoder layers fill the causal mask, then the key
    padding; ``score_bias_sum`` then adds the two biases up before upstream's SDPA sees them)."""

    def pattern(self, op, cond, fill, scores, outer):
        return op.Softmax(op.Add(op.Where(cond, fill, scores), outer), axis=-1)

    def rewrite(self, op, cond, fill, scores, outer, **_):
        dtype = scores.dtype.numpy()
        zero = op.Constant(value=ir.tensor(np.zeros((), dtype=dtype)))
        return op.Softmax(op.Add(op.Add(scores, op.Where(cond, fill, zero)), outer), axis=-1)


masked_fill_bias_rules = pattern.RewriteRuleSet([MaskedFillToBias.rule(), NestedMaskedFillToBias.rule()])


def fuse_masked_fill_bias(model: ir.Model) -> int:
    """Apply the rules everywhere in ``model`` until none applies (the nested rule matches what the first one
    wrote); the number of rewrites."""
    total = 0
    for _ in range(4):
        count = masked_fill_bias_rules.apply_to_model(model)
        total += count
        if not count:
            break
    return total
