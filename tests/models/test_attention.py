"""The reference module itself: its math and its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from mha_deploy.errors import ModelConfigError
from mha_deploy.models import MASK_FILL_VALUE, Decoder, Encoder, MultiHeadAttention


@pytest.mark.parametrize(("d_model", "heads"), [(10, 3), (64, 5), (7, 2)])
def test_heads_must_divide_d_model(d_model, heads):
    with pytest.raises(ModelConfigError, match=rf"d_model \({d_model}\) must be divisible by num_heads \({heads}\)"):
        MultiHeadAttention(d_model, heads)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: MultiHeadAttention(0, 8), "d_model and num_heads must be positive, got 0 and 8"),
        (lambda: MultiHeadAttention(64, 0), "d_model and num_heads must be positive, got 64 and 0"),
        (lambda: Encoder(0, 16, 2, 32), "num_layers must be positive, got 0"),
        (lambda: Decoder(1, 16, 2, 0), "d_ff (the feed-forward width) must be positive, got 0"),
        (lambda: Decoder(1, 16, 3, 32), "d_model (16) must be divisible by num_heads (3)"),
    ],
)
def test_bad_sizes_raise_a_catchable_error(build, fragment):
    # A ValueError too, so that code written against earlier releases still catches it.
    with pytest.raises(ModelConfigError) as info:
        build()
    assert isinstance(info.value, ValueError) and fragment in str(info.value)


def test_matches_hand_written_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).eval()
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    out, weights = mha(q, kv, kv, mask)

    def heads(t, linear):
        return linear(t).view(2, -1, 2, 8).transpose(1, 2)

    scores = heads(q, mha.W_q) @ heads(kv, mha.W_k).transpose(-1, -2) / math.sqrt(8)
    scores = torch.where(mask, scores, torch.tensor(MASK_FILL_VALUE))
    expected_weights = scores.softmax(-1)
    expected = mha.W_o((expected_weights @ heads(kv, mha.W_v)).transpose(1, 2).reshape(2, 3, 16))
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(out, expected)
    assert weights[0, :, :, 3:].abs().max() == 0  # masked keys get no weight


def test_fully_masked_row_is_uniform_not_nan():
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 4, 8)
    _, weights = mha(x, x, x, torch.zeros(1, 1, 1, 4, dtype=torch.bool))
    torch.testing.assert_close(weights, torch.full_like(weights, 0.25))
