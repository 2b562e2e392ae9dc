"""Seeded random models: the same seed gives the same weights, whichever command builds them."""

from __future__ import annotations

import pytest
import torch

from mha_deploy.errors import ModelConfigError
from mha_deploy.models import Decoder, Encoder
from mha_deploy.models.build import random_mha, random_stack


def test_random_mha_is_the_seeds():
    a, b, c = random_mha(16, 2, seed=3), random_mha(16, 2, seed=3), random_mha(16, 2, seed=4)
    assert not a.training
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["W_q.weight"], c.state_dict()["W_q.weight"])


@pytest.mark.parametrize(("kind", "cls"), [("encoder", Encoder), ("decoder", Decoder)])
def test_random_stack_of_each_kind(kind, cls):
    stack = random_stack(kind, 2, 16, 2, seed=1)
    assert isinstance(stack, cls) and not stack.training
    again = random_stack(kind, 2, 16, 2, seed=1)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in stack.state_dict().items())


def test_sizes_the_model_refuses_are_model_config_errors():
    with pytest.raises(ModelConfigError, match="divisible"):
        random_mha(16, 3)
