"""The one validator's memory check: an item too long for the attention a model materialises is refused in words.

The machine's memory is replaced by a small figure, so the limit is reached by
items of a few hundred tokens and nothing large is allocated.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from mha_deploy.batch import BatchRunner
from mha_deploy.metadata import ModelMetadata, Signature
from mha_deploy.runtime import MHASession, validation
from mha_deploy.serving.http.parsing import RequestError, RequestLimits, parse_request
from tests.conftest import TEST_D_MODEL, TEST_HEADS

D = TEST_D_MODEL
MEMORY = 64 * 2**20  # the machine's memory as these tests pretend it is


@pytest.fixture
def small_machine(monkeypatch):
    monkeypatch.setattr(validation, "physical_memory_bytes", lambda: MEMORY)


def longest_item(fusion: str) -> int:
    """The longest self-attention item that stays within half of MEMORY for ``fusion``."""
    copies = validation.SCORE_COPIES[fusion]
    return int((validation.ITEM_MEMORY_SHARE * MEMORY / (copies * TEST_HEADS * 4)) ** 0.5)


@pytest.mark.parametrize("fusion", ["none", "onnx"])
def test_items_beyond_memory_are_a_problem_for_models_that_materialise_scores(small_machine, fusion):
    metadata = ModelMetadata(D, TEST_HEADS, Signature("self", "padding"), fusion=fusion)
    limit = longest_item(fusion)
    fits = {"x": np.zeros((limit, D), np.float32)}
    too_long = {"x": np.zeros((limit + 1, D), np.float32)}
    assert validation.item_problem(metadata, fits) is None
    problem = validation.item_problem(metadata, too_long)
    assert problem.kind == "too_long_for_memory"
    assert f"{limit + 1} x {limit + 1} tokens" in problem.message and "--fuse mha" in problem.message


def test_cross_attention_counts_queries_times_keys(small_machine):
    metadata = ModelMetadata(D, TEST_HEADS, Signature("cross", "padding"), fusion="none")
    limit = longest_item("none")
    keys = limit * limit // 4 + limit  # 4 queries x this many keys > limit x limit pairs
    item = {name: np.zeros((length, D), np.float32) for name, length in (("query", 4), ("key", keys), ("value", keys))}
    assert validation.item_problem(metadata, item).kind == "too_long_for_memory"


def test_tiled_kernels_have_no_such_limit(small_machine):
    metadata = ModelMetadata(D, TEST_HEADS, Signature("self", "padding-causal"), fusion="mha")
    assert validation.item_problem(metadata, {"x": np.zeros((4 * longest_item("none"), D), np.float32)}) is None


@pytest.fixture(scope="module")
def unfused(export_model):
    return MHASession(export_model(Signature("self", "padding"), "none")[0], provider="cpu")


def test_the_runner_skips_the_item_and_the_server_answers_422(small_machine, unfused):
    too_long = np.zeros((longest_item("none") + 1, D), np.float32)
    results, stats = BatchRunner(unfused, on_error="skip").run(
        {"ok": {"x": np.ones((5, D), np.float32)}, "long": {"x": too_long}})
    assert set(results) == {"ok"} and [e.item_id for e in stats.errors] == ["long"]
    assert "attention scores" in stats.errors[0].message
    buffer = io.BytesIO()  # the same item as an .npy request body
    np.save(buffer, too_long)
    with pytest.raises(RequestError) as refused:
        parse_request(buffer.getvalue(), "application/x-npy", unfused.metadata, RequestLimits(max_item_tokens=10**6))
    assert (refused.value.status, refused.value.kind) == (422, "too_long_for_memory")
