"""The classifier with its attention on torch's F.scaled_dot_product_attention (boolean mask, True = attend)."""

import torch.nn.functional as F
from classifier import Block, TextClassifier
from torch import nn

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")


class SDPAAttention(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.inner = attention

    def forward(self, q, k, v, mask=None):
        a = self.inner
        b = q.size(0)
        q = a.W_q(q).view(b, -1, a.num_heads, a.d_k).transpose(1, 2)
        k = a.W_k(k).view(b, -1, a.num_heads, a.d_k).transpose(1, 2)
        v = a.W_v(v).view(b, -1, a.num_heads, a.d_k).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return a.W_o(out.transpose(1, 2).contiguous().view(b, -1, a.num_heads * a.d_k))


def with_sdpa(model: TextClassifier) -> TextClassifier:
    """``model`` with each block's attention computed by F.scaled_dot_product_attention (same weights)."""
    for block in model.blocks:
        assert isinstance(block, Block)
        block.attn = SDPAAttention(block.attn)
    return model


def build():
    from classifier import build as build_classifier

    return with_sdpa(build_classifier())
