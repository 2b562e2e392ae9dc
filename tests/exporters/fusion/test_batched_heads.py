"""``batched_heads``: attention written with ``torch.bmm`` over heads folded into the batch (DeBERTa-v2's form) fuses
into one MultiHeadAttention, a score term computed from the queries kept as its attention_bias with the mask, and
its scale read off the divisor; a module that folds something else into the batch is left alone."""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.exporters.fusion import user_models as um

D_K = um.D_MODEL // um.HEADS
SCALE_FACTOR = 3  # DeBERTa: 1 + c2p + p2c


class BatchedHeadsAttention(nn.Module):
    """DeBERTa's spelling: heads split to [b, h, s, d], viewed as [b * h, s, d], ``bmm(q, k^T / c)`` plus a term
    from the queries (``relative``: a c2p-like ``bmm(q, table^T)``, [b * h, s, s]) divided by the same c, viewed
    to [b, h, s, s], masked on queries and keys with ``finfo.min``, then ``bmm(probs.view(-1, s, s), v)``."""

    def __init__(self, relative: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(um.D_MODEL, um.D_MODEL) for _ in range(4))
        self.table = nn.Parameter(torch.randn(um.HEADS, 1, D_K))
        self.relative = relative

    def forward(self, x, pad):
        b, s, _ = x.shape

        def heads(p):
            return p(x).view(b, s, um.HEADS, D_K).permute(0, 2, 1, 3).contiguous().view(-1, s, D_K)

        q, k, v = heads(self.q), heads(self.k), heads(self.v)
        scale = math.sqrt(D_K * SCALE_FACTOR)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale)
        if self.relative:
            table = self.table.expand(um.HEADS, s, D_K).repeat(b, 1, 1)  # [b * h, s, d]
            scores = scores + torch.bmm(q, table.transpose(-1, -2)) / scale
        scores = scores.view(-1, um.HEADS, s, s)
        mask = pad[:, None, None, :] & pad[:, None, :, None]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, -1)
        context = torch.bmm(probs.view(-1, s, s), v).view(-1, um.HEADS, s, D_K)
        return self.out(context.permute(0, 2, 1, 3).reshape(b, s, um.D_MODEL))


def test_bmm_attention_with_a_score_term_fuses_with_it_as_the_ops_bias():
    module, plain = um.module_and_export("batched-heads-relative", lambda: BatchedHeadsAttention())
    fused, report = um.fuse(plain)
    (op,) = report.ops
    assert report.rule_counts["batched_heads"] == 2  # the scores' view and the context's
    assert op.op_type == "com.microsoft.MultiHeadAttention" and set(op.mask_inputs) == {"attention_bias"}
    assert "relative score terms with the mask" in op.kernel, op.describe()
    assert abs(op.attributes["scale"] - 1 / math.sqrt(D_K * SCALE_FACTOR)) < 1e-6
    # The mask hides padded queries' rows too: the bias keeps it whole, so every real row matches torch.
    um.assert_parity_with_torch(module, fused)


def test_the_rule_leaves_alone_a_graph_without_the_fold():
    """The reference attention on 4-D heads: nothing for batched_heads to undo."""
    _, plain = um.module_and_export("batched-heads-none",
                                    lambda: um.MaskedAttention(lambda pad, s: pad[:, None, None, :]))
    _, report = um.fuse(plain)
    assert report.rule_counts["batched_heads"] == 0
