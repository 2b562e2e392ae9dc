"""Batches of inputs beyond token ids: segment ids padded beside their tokens, images and audio stacked (no length
axis, nothing padded); and `mha-deploy infer` over npz, safetensors, JSONL and Parquet items of BERT with segment
ids, ViT and Whisper's encoder, equal to the module run on each item alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_deploy.batch.planner import BatchLimits, collate, plan_batches, split_outputs
from mha_deploy.metadata import Signature
from mha_deploy.signature import TensorSpec

IDS = TensorSpec("input_ids", "tokens", "int64", ("batch", "seq"), vocab=96)
MASK = TensorSpec("attention_mask", "padding_mask", "bool", ("batch", "seq"), marks="input_ids")
SEGMENTS = TensorSpec("token_type_ids", "segments", "int64", ("batch", "seq"), vocab=2)
IMAGE = TensorSpec("pixel_values", "image", "model", ("batch", 3, 4, 4))
PATCHES = TensorSpec("last_hidden_state", "output", "model", ("batch", 5, 8))
HIDDEN = TensorSpec("hidden", "output", "model", ("batch", "seq", 8))
# fp32, the module alone against ORT's batched kernels over padded batches.
ATOL, RTOL = 2e-5, 1e-4


def test_images_stack_without_padding_and_batch_by_count():
    signature = Signature.custom((IMAGE,), (PATCHES,))
    rng = np.random.default_rng(0)
    items = [{"pixel_values": rng.standard_normal((3, 4, 4)).astype(np.float32)} for _ in range(5)]
    assert plan_batches(items, signature, BatchLimits(batch_size=2)) == [[0, 1], [2, 3], [4]]
    batch = collate(items[:3], signature)
    assert batch.feeds.keys() == {"pixel_values"} and batch.lengths == [{}, {}, {}]
    np.testing.assert_array_equal(batch.feeds["pixel_values"], np.stack([item["pixel_values"] for item in items[:3]]))
    assert batch.real_tokens == batch.padded_tokens == 3
    outputs = {"last_hidden_state": np.arange(3 * 5 * 8, dtype=np.float32).reshape(3, 5, 8)}
    assert [r["last_hidden_state"].shape for r in split_outputs(outputs, batch, signature)] == [(5, 8)] * 3


def test_segment_ids_pad_with_their_tokens():
    signature = Signature.custom((IDS, MASK, SEGMENTS), (HIDDEN,), ("seq",))
    items = [{"input_ids": np.array([5, 6, 7]), "token_type_ids": np.array([0, 1, 1])},
             {"input_ids": np.array([8]), "token_type_ids": np.array([1])}]
    batch = collate(items, signature)
    assert batch.feeds["token_type_ids"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.feeds["attention_mask"].tolist() == [[True, True, True], [True, False, False]]


# --- infer over the exported files ------------------------------------------------------------------------------


def _items(file: str, count: int = 7, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Items as a dataset holds them: unpadded ids of varying lengths with segments 0 then 1 (a sentence pair), or
    whole images / audio features."""
    rng = np.random.default_rng(seed)
    items = {}
    for i in range(count):
        if file == "hf_segments":
            length = int(rng.integers(3, 20))
            split = int(rng.integers(1, length))
            items[f"pair{i}"] = {"input_ids": rng.integers(0, 96, length),
                                 "token_type_ids": (np.arange(length) >= split).astype(np.int64)}
        else:
            shape = (3, 32, 32) if file == "hf_vision" else (8, 32)
            name = "pixel_values" if file == "hf_vision" else "input_features"
            items[f"x{i}"] = {name: rng.standard_normal(shape).astype(np.float32)}
    return items


def _alone(file: str, items) -> dict[str, dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    from tests.conftest import user_module

    module = user_module(file).build().eval()
    expected = {}
    with torch.no_grad():
        for key, item in items.items():
            feeds = {name: torch.from_numpy(value)[None] for name, value in item.items()}
            if "input_ids" in feeds:
                feeds["attention_mask"] = torch.ones_like(feeds["input_ids"])
            result = module(**feeds)
            expected[key] = {name: value[0].numpy() for name, value in result.items() if value is not None}
    return expected


def _write(source, items, flat: bool = False) -> None:
    """npz / safetensors keys (``<id>`` for the first input, ``<id>.<input>`` for the others), JSON lines, or
    Parquet columns (``flat``: each image as one flat list)."""
    first = next(iter(next(iter(items.values()))))
    if source.suffix in (".npz", ".safetensors"):
        arrays = {key if name == first else f"{key}.{name}": value for key, item in items.items()
                  for name, value in item.items()}
        if source.suffix == ".npz":
            np.savez(source, **arrays)
        else:
            from safetensors.numpy import save_file

            save_file(arrays, str(source))
    elif source.suffix == ".jsonl":
        source.write_text("".join(json.dumps({"id": key, **{n: v.tolist() for n, v in item.items()}}) + "\n"
                                  for key, item in items.items()))
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        columns = {"id": list(items)}
        for name in next(iter(items.values())):
            columns[name] = [(item[name].ravel() if flat else item[name]).tolist() for item in items.values()]
        pq.write_table(pa.table(columns), source)


def _read(target, names) -> dict[str, dict[str, np.ndarray]]:
    if target.suffix == ".npz":
        arrays = dict(np.load(target))
        ids = {key.split(".")[0] for key in arrays}
        return {key: {name: arrays[f"{key}.{name}"] for name in names} for key in ids}
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(target).to_pydict()
    return {key: {name: np.array(table[name][row], np.float32) for name in names}
            for row, key in enumerate(table["id"])}


@pytest.mark.parametrize(("file", "suffix", "flat"), [
    ("hf_segments", ".npz", False), ("hf_segments", ".jsonl", False), ("hf_segments", ".parquet", False),
    ("hf_vision", ".npz", False), ("hf_vision", ".safetensors", False), ("hf_vision", ".jsonl", False),
    ("hf_vision", ".parquet", False), ("hf_vision", ".parquet", True),
    ("hf_audio", ".jsonl", False), ("hf_audio", ".parquet", True),
], ids=lambda value: value if isinstance(value, str) else ("flat" if value else "nested"))
def test_infer_equals_the_module_item_by_item(own_model, tmp_path, file, suffix, flat):
    from click.testing import CliRunner

    from mha_deploy.cli import main

    items = _items(file)
    source = tmp_path / f"items{suffix}"
    target = tmp_path / ("out.parquet" if suffix == ".parquet" else "out.npz")
    _write(source, items, flat)
    path, _ = own_model(file)
    result = CliRunner().invoke(main, ["infer", str(path), "--input", str(source), "--output", str(target),
                                       "--batch-size", "3", "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    expected = _alone(file, items)
    got = _read(target, next(iter(expected.values())))
    assert set(got) == set(expected)
    for key, outputs in expected.items():
        for name, want in outputs.items():
            np.testing.assert_allclose(got[key][name], want, atol=ATOL, rtol=RTOL, err_msg=f"{key} {name}")


@pytest.mark.parametrize(("file", "bad", "words"), [
    ("hf_vision", {"pixel_values": np.zeros((3, 16, 32), np.float32)},
     r"pixel_values has height 16 \(expected 32\): this model takes images of \[channels, height, width\] = "
     r"\[3, 32, 32\]"),
    ("hf_audio", {"input_features": np.zeros((8, 40), np.float32)}, r"input_features has frames 40 \(expected 32\)"),
    ("hf_segments", {"input_ids": np.array([3, 4, 5]), "token_type_ids": np.array([0, 1, 2])},
     "token_type_ids holds id 2: its segment table has 2 rows in this model, so segment ids are 0 to 1"),
], ids=["image", "audio", "segments"])
def test_a_bad_item_is_skipped_naming_its_input_and_bound(own_model, tmp_path, file, bad, words):
    import re

    from click.testing import CliRunner

    from mha_deploy.cli import main

    items = {**_items(file, count=2), "bad": bad}
    _write(tmp_path / "items.jsonl", items)
    result = CliRunner().invoke(main, ["infer", str(own_model(file)[0]), "--input", str(tmp_path / "items.jsonl"),
                                       "--output", str(tmp_path / "out.npz"), "--on-error", "skip", "--no-progress",
                                       "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    assert re.search(r"item 'bad' \(line 3\): " + words, result.output), result.output
    assert {key.split(".")[0] for key in np.load(tmp_path / "out.npz").files} == set(items) - {"bad"}
