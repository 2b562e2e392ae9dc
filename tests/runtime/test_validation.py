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


# --- the max length a file records (a position table's size, --max-length) -----------------------------
MAX_LENGTH = 8


@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "padding")],
                         ids=["self", "cross"])
@pytest.mark.parametrize("length", [MAX_LENGTH, MAX_LENGTH + 1])
def test_a_sequence_longer_than_the_max_length_is_refused_naming_it(signature, length):
    from mha_deploy.errors import InputError
    from mha_deploy.inputs import InputCase, make_inputs

    metadata = ModelMetadata(D, TEST_HEADS, signature, max_length=MAX_LENGTH)
    item = {name: np.zeros((length, D), np.float32) for name in signature.sequence_inputs}
    batch = make_inputs(signature, D, InputCase(2, length, length, "right"))
    problem = validation.item_problem(metadata, item)
    if length <= MAX_LENGTH:
        assert problem is None
        validation.validate_inputs(metadata, batch)
        return
    assert problem.kind == "too_long"
    assert f"is {length} tokens long, this model takes at most {MAX_LENGTH}" in problem.message
    with pytest.raises(InputError, match=f"at most {MAX_LENGTH} "):
        validation.validate_inputs(metadata, batch)


def test_mhasession_refuses_a_sequence_longer_than_the_position_table(own_model):
    """The classifier's position table holds 512 positions: the export records 512 without --max-length, and
    513 tokens are an InputError, not ONNX Runtime's ``Gather ... idx=512``."""
    pytest.importorskip("torch")
    from mha_deploy.errors import InputError

    path, output = own_model("classifier")
    session = MHASession(path, provider="cpu")
    assert session.metadata.max_length == 512 and "max length 512 recorded" in output
    from mha_deploy.model_report import describe_model

    assert "max length 512: a longer sequence is refused" in describe_model(path).text()
    ids, mask = np.ones((1, 513), np.int64), np.ones((1, 513), bool)
    with pytest.raises(InputError, match="input_ids is 513 tokens long, this model takes at most 512"):
        session.run({"input_ids": ids, "attention_mask": mask})
    assert session.run({"input_ids": ids[:, :512], "attention_mask": mask[:, :512]})["output"].shape == (1, 3)
