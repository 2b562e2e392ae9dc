"""Tracker #3: item ids that collide with another item's output keys must not lose outputs without a word.

A model returning weights writes item ``a`` as ``a`` and ``a.attn_weights``: an
input that also holds an item ``a.attn_weights`` used to overwrite one of them
(npz and safetensors alike) and exit 0.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_deploy.batch import BatchRunner
from mha_deploy.batch.items import read_arrays, write_arrays
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.adversarial.conftest import assert_loud, infer, sequences

WEIGHTS = Signature("self", "padding", return_weights=True)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_an_id_taking_another_items_weights_key_is_a_bad_item(tmp_path, export_model, suffix):
    model = export_model(WEIGHTS)[0]
    a, other = sequences((3, 2))
    write_arrays(tmp_path / f"in{suffix}", {"a": a, "a.attn_weights": other})
    out = tmp_path / f"out{suffix}"

    stop = infer(model, tmp_path / f"in{suffix}", out)
    assert_loud(stop, f"in{suffix}: item ", "would overwrite that of item 'a")
    assert not out.exists(), "nothing half written"

    skip = infer(model, tmp_path / f"in{suffix}", out, "--on-error", "skip", "--json")
    assert skip.exit_code == 0, skip.output
    (error,) = json.loads(skip.stdout)["errors"]
    assert "would overwrite" in error["message"] and f"skipped in{suffix}: item " in skip.stderr

    # Whatever was written is exactly the surviving item's results: nothing overwritten.
    session = MHASession(model, provider="cpu")
    survivor = "a" if error["item_id"] == "a.attn_weights" else "a.attn_weights"
    expected, _ = BatchRunner(session).run({survivor: {"x": {"a": a, "a.attn_weights": other}[survivor]}})
    outputs = read_arrays(out)
    keys = {survivor: "output"} | ({"a.attn_weights": "attn_weights"} if survivor == "a" else {})
    assert sorted(outputs) == sorted(keys)
    for key, name in keys.items():
        np.testing.assert_allclose(outputs[key], expected[survivor][name], atol=1e-6)


def test_the_same_id_twice_in_parquet_is_a_bad_item(tmp_path, export_model):
    """Parquet ids are a column: the same id twice would give two rows, or one key in an npz output."""
    from tests.batch.test_datasets import write_parquet

    pq = pytest.importorskip("pyarrow.parquet")
    model = export_model(Signature("self", "padding"))[0]
    a, b = sequences((3, 2))
    write_parquet(tmp_path / "in.parquet", {"a": {"x": a}, "b": {"x": b}})
    table = pq.read_table(tmp_path / "in.parquet")
    ids = table.column("id").to_pylist()
    table = table.set_column(table.schema.get_field_index("id"), "id", [[ids[0], ids[0]]])
    pq.write_table(table, tmp_path / "in.parquet")

    result = infer(model, tmp_path / "in.parquet", tmp_path / "out.npz")
    assert_loud(result, "in.parquet: item 'a': appears twice in this shard")
    skip = infer(model, tmp_path / "in.parquet", tmp_path / "out.npz", "--on-error", "skip")
    assert skip.exit_code == 0, skip.output
    outputs = read_arrays(tmp_path / "out.npz")
    assert list(outputs) == ["a"] and outputs["a"].shape == a.shape, "the first one is kept, the second listed"
    assert "appears twice" in skip.stderr
