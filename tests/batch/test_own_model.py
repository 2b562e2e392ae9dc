"""`mha-deploy infer` over a user's own classifier (token ids in, one row of logits per item out): npz, Parquet
and JSONL, equal to the module run on each item alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from tests.conftest import user_module  # noqa: E402

# fp32, the module alone against ORT's batched kernels over padded batches.
ATOL, RTOL = 2e-5, 1e-4


def _items(count: int = 24, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"doc{i}": rng.integers(0, 50, size=int(rng.integers(1, 70))) for i in range(count)}


def _alone(items: dict[str, np.ndarray], factory: str = "build") -> dict[str, np.ndarray]:
    module = getattr(user_module("classifier"), factory)().eval()
    with torch.no_grad():
        return {
            key: module(torch.from_numpy(ids)[None], torch.ones(1, len(ids), dtype=torch.bool))[0].numpy()
            for key, ids in items.items()
        }


# build_wide: an export with its tokens packed (token_packing), as wider models are by default
def _write_ids(source, items: dict[str, np.ndarray]) -> None:
    """Token id items as infer reads them: npz keys or JSON lines (Parquet's are written by the test)."""
    if source.suffix == ".npz":
        np.savez(source, **items)
    else:
        source.write_text("".join(json.dumps({"id": key, "input_ids": ids.tolist()}) + "\n"
                                  for key, ids in items.items()))


@pytest.mark.parametrize(("suffix", "factory"),
                         [(".npz", "build"), (".parquet", "build"), (".jsonl", "build"), (".npz", "build_wide")])
def test_infer_equals_the_module_item_by_item(own_model, tmp_path, suffix, factory):
    items = _items()
    # JSONL is read, not written: its outputs go to npz.
    source, target = tmp_path / f"items{suffix}", tmp_path / f"out{'.npz' if suffix == '.jsonl' else suffix}"
    if suffix != ".parquet":
        _write_ids(source, items)
    else:
        pq.write_table(pa.table({"id": list(items), "input_ids": [ids.tolist() for ids in items.values()]}), source)
    path, export_output = own_model("classifier", factory)
    assert ("token packing: 6 MatMul(s)" in export_output) == (factory == "build_wide"), export_output
    result = CliRunner().invoke(main, ["infer", str(path), "--input", str(source), "--output",
                                       str(target), "--batch-size", "8", "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    if target.suffix == ".npz":
        got = dict(np.load(target))
    else:
        table = pq.read_table(target).to_pydict()
        got = {key: np.array(row, np.float32) for key, row in zip(table["id"], table["output"], strict=True)}
    expected = _alone(items, factory)
    assert set(got) == set(expected)
    for key, logits in expected.items():
        assert got[key].shape == (3,)
        np.testing.assert_allclose(got[key], logits, atol=ATOL, rtol=RTOL, err_msg=key)


@pytest.mark.parametrize(("suffix", "bad"), [(".npz", "'bad'"), (".jsonl", "'bad' (line 2)")])
def test_ids_outside_the_vocabulary_are_named(own_model, tmp_path, suffix, bad):
    _write_ids(tmp_path / f"items{suffix}", {"good": np.array([1, 2, 3]), "bad": np.array([4, 99])})
    result = CliRunner().invoke(main, ["infer", str(own_model("classifier")[0]), "--input",
                                       str(tmp_path / f"items{suffix}"), "--output", str(tmp_path / "out.npz"),
                                       "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 1
    assert f"item {bad}: input_ids holds id 99: this model's vocabulary is ids 0 to 49" in result.output
    assert not (tmp_path / "out.npz").exists()


def test_jsonl_ids_are_integers_not_true_false_or_floats(own_model, tmp_path):
    """numpy would read true as id 1; a float id is not a token; an integer item id comes back as its digits."""
    lines = [{"id": 3, "input_ids": [1, 2]}, {"id": "flag", "input_ids": [1, True]},
             {"id": "float", "input_ids": [1, 2.5]}, {"id": "huge", "input_ids": [2**64]}]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["infer", str(own_model("classifier")[0]), "--input",
                                       str(tmp_path / "items.jsonl"), "--output", str(tmp_path / "out.npz"),
                                       "--on-error", "skip", "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    assert np.load(tmp_path / "out.npz").files == ["3"]
    assert "item 'flag' (line 2): input_ids holds true or false among its numbers" in result.output
    assert "item 'float' (line 3): input_ids holds token ids: expected integers, got float64" in result.output
    assert "item 'huge' (line 4): input_ids must hold numbers only" in result.output


def test_an_encoder_decoders_item_is_its_target_with_the_source_beside_it(own_model, tmp_path):
    """In npz, ``<id>`` holds an encoder-decoder's target (its output rows' input) and ``<id>.src`` the source,
    as docs/own-model.md says."""
    rng = np.random.default_rng(4)
    items = {f"s{i}": (rng.integers(0, 40, int(rng.integers(2, 9))), rng.integers(0, 50, int(rng.integers(2, 9))))
             for i in range(5)}
    np.savez(tmp_path / "items.npz", **{key: tgt for key, (_, tgt) in items.items()},
             **{f"{key}.src": src for key, (src, _) in items.items()})
    result = CliRunner().invoke(main, ["infer", str(own_model("seq2seq")[0]), "--input", str(tmp_path / "items.npz"),
                                       "--output", str(tmp_path / "out.npz"), "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    got = dict(np.load(tmp_path / "out.npz"))
    module = user_module("seq2seq").build().eval()
    for key, (src, tgt) in items.items():
        with torch.no_grad():
            expected = module(torch.from_numpy(src)[None], torch.ones(1, len(src), dtype=torch.bool),
                              torch.from_numpy(tgt)[None], torch.ones(1, len(tgt), dtype=torch.bool))[0]
        assert got[key].shape == (len(tgt), 50)
        np.testing.assert_allclose(got[key], expected.numpy(), atol=ATOL, rtol=RTOL, err_msg=key)


def test_an_item_longer_than_the_position_table_is_one_skipped_item(own_model, tmp_path):
    """The classifier's export recorded its position table (512 positions): a 600-token item is skipped with
    the limit named, the others are answered (before, ONNX Runtime's Gather failed the whole run)."""
    items = {"short": np.array([1, 2, 3]), "long": np.ones(600, np.int64), "last": np.array([4, 5])}
    np.savez(tmp_path / "items.npz", **items)
    result = CliRunner().invoke(main, ["infer", str(own_model("classifier")[0]), "--input", str(tmp_path / "items.npz"),
                                       "--output", str(tmp_path / "out.npz"), "--on-error", "skip", "--no-progress",
                                       "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    assert "input_ids is 600 tokens long, this model takes at most 512" in result.output
    got = dict(np.load(tmp_path / "out.npz"))
    assert set(got) == {"short", "last"}
    expected = _alone({key: items[key] for key in got})
    for key, logits in expected.items():
        np.testing.assert_allclose(got[key], logits, atol=ATOL, rtol=RTOL, err_msg=key)
