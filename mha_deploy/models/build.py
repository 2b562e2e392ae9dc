"""Seeded random models, what ``mha-deploy export`` and ``bench`` start from without a checkpoint.

The same seed gives the same weights in every command, so ``bench MODEL.onnx``
can rebuild the reference of a file exported with default flags.
"""

from __future__ import annotations

import torch

from mha_deploy.models.attention import MultiHeadAttention
from mha_deploy.models.transformer import Decoder, Encoder

STACK_KINDS = {"encoder": Encoder, "decoder": Decoder}


def random_mha(d_model: int, num_heads: int, seed: int = 0) -> MultiHeadAttention:
    """The reference attention with ``torch.manual_seed(seed)`` weights, in eval mode."""
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, num_heads).eval()


def random_stack(
    kind: str, layers: int, d_model: int, num_heads: int, d_ff: int | None = None, seed: int = 0
) -> Encoder | Decoder:
    """A post-norm encoder or decoder stack (``kind``) of seeded weights, in eval mode; ``d_ff`` 4 x d_model."""
    torch.manual_seed(seed)
    return STACK_KINDS[kind](layers, d_model, num_heads, 4 * d_model if d_ff is None else d_ff).eval()
