"""BatchRunner and item files: batched results equal one-by-one results, whatever the padding."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.serving import BatchRunner, MHASession
from mha_deploy.serving.batching import can_pad_keys, plan_batches
from mha_deploy.serving.items import read_items, write_arrays
from mha_deploy.serving.runner import output_arrays
from tests.conftest import SIGNATURES, TEST_D_MODEL, signature_id

D = TEST_D_MODEL
LENGTHS = [5, 1, 17, 5, 9, 33, 2, 17, 1, 40]


def make_items(signature: Signature, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    items = {}
    for index, length in enumerate(LENGTHS):
        if signature.attention == "self":
            item = {"x": rng.standard_normal((length, D), dtype=np.float32)}
        else:
            kv_len = LENGTHS[-1 - index]
            item = {
                "query": rng.standard_normal((length, D), dtype=np.float32),
                "key": rng.standard_normal((kv_len, D), dtype=np.float32),
                "value": rng.standard_normal((kv_len, D), dtype=np.float32),
            }
        items[f"item-{index}"] = item
    return items


def run_one(session: MHASession, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {name: array[None] for name, array in item.items()}
    if session.signature.has_padding_mask:
        kv = item["x" if session.signature.attention == "self" else "key"]
        feeds["key_padding_mask"] = np.ones((1, kv.shape[0]), bool)
    return {name: out[0] for name, out in session.run(feeds).items()}


WITH_WEIGHTS = [Signature("self", "padding", True), Signature("cross", "padding", True)]


@pytest.mark.parametrize("signature", SIGNATURES + WITH_WEIGHTS, ids=signature_id)
def test_batched_equals_one_by_one(export_model, signature):
    session = MHASession(export_model(signature)[0], provider="cpu")
    items = make_items(signature)
    results, stats = BatchRunner(session, batch_size=4).run(items)
    assert list(results) == list(items), "results come back in input order"
    for item_id, item in items.items():
        expected = run_one(session, item)
        for name, array in expected.items():
            np.testing.assert_allclose(results[item_id][name], array, atol=1e-5, rtol=1e-4, err_msg=item_id)
    assert stats.items == len(items) and stats.tokens == sum(LENGTHS)
    assert 0 <= stats.padding_ratio < 1


@pytest.mark.parametrize("signature", SIGNATURES, ids=signature_id)
def test_batches_pad_keys_only_when_the_model_allows(signature):
    items = list(make_items(signature).values())
    kv = "x" if signature.attention == "self" else "key"
    batches = list(plan_batches(items, signature, batch_size=4))
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    assert all(len(b) <= 4 for b in batches)
    if not can_pad_keys(signature):
        assert all(len({items[i][kv].shape[0] for i in b}) == 1 for b in batches)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a[:, :-1], r"item 'item-3': shape \(5, 63\), expected \[seq, 64\]"),
        (lambda a: a.astype(np.float64), r"item 'item-3': dtype float64"),
        (lambda a: a[:0], r"item 'item-3': empty sequence"),
        (lambda a: np.where(np.arange(len(a))[:, None] == 0, np.nan, a).astype(np.float32), "NaN or Inf"),
        (lambda a: a[0], r"item 'item-3': shape \(64,\)"),
    ],
)
def test_bad_item_is_named(export_model, change, message):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    items = make_items(Signature("self", "padding"))
    items["item-3"]["x"] = change(items["item-3"]["x"])
    with pytest.raises(InputError, match=message):
        BatchRunner(session).run(items)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
@pytest.mark.parametrize("attention", ["self", "cross"])
def test_item_files_round_trip(tmp_path, suffix, attention):
    signature = Signature(attention, "padding")
    items = make_items(signature)
    if attention == "self":
        arrays = {item_id: item["x"] for item_id, item in items.items()}
    else:
        arrays = {f"{item_id}.{part}": a for item_id, item in items.items() for part, a in item.items()}
    path = tmp_path / f"items{suffix}"
    write_arrays(path, arrays)
    loaded = read_items(path, signature)
    assert set(loaded) == set(items)
    for item_id, item in items.items():
        for name, array in item.items():
            np.testing.assert_array_equal(loaded[item_id][name], array)
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary files left"


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"a.query": np.zeros((1, D), np.float32), "a.key": np.zeros((1, D), np.float32)}, r"'a' lacks a.value"),
        ({"a": np.zeros((1, D), np.float32)}, r"key 'a' is not <id>.query"),
        ({}, "holds no items"),
    ],
)
def test_malformed_cross_item_files(tmp_path, arrays, message):
    path = tmp_path / "items.npz"
    np.savez(path, **arrays)
    with pytest.raises(InputError, match=message):
        read_items(path, Signature("cross", "padding"))


def test_pickled_npz_is_refused(tmp_path):
    path = tmp_path / "items.npz"
    np.savez(path, a=np.array([{"not": "an array"}], dtype=object))
    with pytest.raises(InputError, match="cannot read arrays"):
        read_items(path, Signature())


def test_output_arrays_names():
    results = {"a": {"output": np.zeros(1), "attn_weights": np.ones(1)}, "b": {"output": np.zeros(2)}}
    assert list(output_arrays(results)) == ["a", "a.attn_weights", "b"]
