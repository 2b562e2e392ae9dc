"""Datasets on disk: shard directories and Parquet, read lazily, written mirrored, bad items named."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mha_deploy.batch import BatchRunner
from mha_deploy.batch.datasets import item_arrays, list_shards, open_reader
from mha_deploy.batch.items import read_arrays, write_arrays
from mha_deploy.batch.job import DatasetJob, run_dataset
from mha_deploy.batch.parquet import decode_sequences, encode_nested
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.batch.test_runner import make_items
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL


def write_parquet(path, items, fixed_inner=False, row_group_size=4):
    columns = {"id": list(items)}
    for name in next(iter(items.values())):
        columns[name] = encode_nested([item[name] for item in items.values()], fixed_inner)
    columns["label"] = list(range(len(items)))  # other columns are ignored
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def read_outputs(path) -> dict[str, np.ndarray]:
    """Any output shard -> {<id>: output, <id>.attn_weights: weights}."""
    if path.suffix != ".parquet":
        return read_arrays(path)
    table = pq.read_table(path)
    arrays = {}
    for name in ("output", "attn_weights"):
        if name not in table.column_names:
            continue
        column = table.column(name).combine_chunks()
        for item_id, row in zip(table.column("id").to_pylist(), column.to_pylist(), strict=True):
            key = item_id if name == "output" else f"{item_id}.{name}"
            arrays[key] = np.array(row, np.float32)
    return arrays


def write_jsonl(path, items):
    """One object per line, keyed by input name, as ``infer`` reads them; a blank line and an extra field, which
    it skips and ignores."""
    lines = [json.dumps({"id": item_id, **{name: a.tolist() for name, a in item.items()}, "label": index})
             for index, (item_id, item) in enumerate(items.items())]
    path.write_text("\n".join([*lines[:1], "", *lines[1:]]) + "\n")


def output_path(directory, input_name):
    """Where infer writes a shard's outputs: the same name, ``<stem>.npz`` for JSONL (not written)."""
    name = input_name.replace(".jsonl", ".npz")
    return directory / name


def write_shard(path, items):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        write_parquet(path, items)
    elif path.suffix == ".jsonl":
        write_jsonl(path, items)
    elif next(iter(items.values())).keys() == {"x"}:
        write_arrays(path, {item_id: item["x"] for item_id, item in items.items()})
    else:
        write_arrays(path, {f"{i}.{part}": a for i, item in items.items() for part, a in item.items()})


@pytest.mark.parametrize("fixed_inner", [False, True])
def test_nested_lists_round_trip(fixed_inner):
    arrays = [np.arange(n * 3, dtype=np.float32).reshape(n, 3) for n in (2, 1, 4)]
    column = encode_nested(arrays, fixed_inner)
    assert column.type.value_type == (pa.list_(pa.float32(), 3) if fixed_inner else pa.list_(pa.float32()))
    for got, want in zip(decode_sequences(column.slice(1), 3), arrays[1:], strict=True):
        np.testing.assert_array_equal(got, want)
    weights = [np.ones((2, q, k), np.float32) for q, k in ((1, 3), (2, 2))]
    assert [np.array(row).shape for row in encode_nested(weights).to_pylist()] == [(2, 1, 3), (2, 2, 2)]


@pytest.mark.parametrize(
    ("signature", "suffixes"),
    [
        (Signature("self", "padding"), [".npz", ".safetensors", ".parquet", ".jsonl"]),
        (Signature("cross", "padding", True), [".parquet", ".npz", ".jsonl"]),
        (Signature("self", "none"), [".parquet"]),
    ],
    ids=["self-mixed-formats", "cross-weights", "self-no-mask"],
)
def test_directory_output_mirrors_input(tmp_path, export_model, signature, suffixes):
    """Same shard names and formats, same ids, and the values of the in-memory runner."""
    session = MHASession(export_model(signature)[0], provider="cpu")
    expected_all = {}
    for index, suffix in enumerate(suffixes):
        items = {f"{index}-{k}": v for k, v in make_items(signature, seed=index).items()}
        write_shard(tmp_path / "in" / f"part-{index}{suffix}", items)
        results, _ = BatchRunner(session, batch_size=4).run(items)
        expected_all[f"part-{index}{suffix}"] = results
    (tmp_path / "in" / "_SUCCESS").write_text("")  # Spark's marker: not a shard

    runner = BatchRunner(session, batch_size=3, max_batch_tokens=64, bucket_window=5)
    stats = run_dataset(DatasetJob(tmp_path / "in", tmp_path / "out", session.source), runner)

    assert stats.items == sum(len(r) for r in expected_all.values()) and stats.shards_written == len(suffixes)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted([*(output_path(tmp_path, n).name for n in expected_all), "_mha_deploy_manifest.json"])
    for name, expected in expected_all.items():
        outputs = read_outputs(output_path(tmp_path / "out", name))
        keys = [k for item_id, r in expected.items() for k in [item_id] + [f"{item_id}.attn_weights"] * (len(r) > 1)]
        assert sorted(outputs) == sorted(keys)
        if name.endswith((".npz", ".parquet", ".jsonl")):
            assert [k for k in outputs if "." not in k.partition("-")[2]] == list(expected), "input order kept"
        for item_id, result in expected.items():
            np.testing.assert_allclose(outputs[item_id], result["output"], atol=1e-5, rtol=1e-4)
            if "attn_weights" in result:
                np.testing.assert_allclose(outputs[f"{item_id}.attn_weights"], result["attn_weights"], atol=1e-6)


def test_parquet_fixed_size_lists_give_the_same_layout_back(tmp_path, export_model):
    signature = Signature("self", "padding")
    session = MHASession(export_model(signature)[0], provider="cpu")
    write_parquet(tmp_path / "in.parquet", make_items(signature), fixed_inner=True)
    run_dataset(DatasetJob(tmp_path / "in.parquet", tmp_path / "out.parquet", session.source), BatchRunner(session))
    schema = pq.read_schema(tmp_path / "out.parquet")
    assert schema.names == ["id", "output"]
    assert schema.field("output").type == pa.list_(pa.list_(pa.float32(), D))


def test_readers_count_without_reading_and_stream(tmp_path):
    items = make_items(Signature("self", "padding"))
    write_parquet(tmp_path / "a.parquet", items, row_group_size=3)
    np.savez(tmp_path / "b.npz", **{k: v["x"] for k, v in items.items()})
    write_jsonl(tmp_path / "c.jsonl", items)
    for name in ("a.parquet", "b.npz", "c.jsonl"):
        with open_reader(tmp_path / name, Signature("self", "padding"), D, window=4) as reader:
            assert reader.count() == len(items)
            assert [raw.item_id for raw in reader] == list(items)


def write_bad_items(path):
    """Good items around bad ones, in Parquet or JSONL."""
    good = np.ones((3, D), np.float32).tolist()
    rows = [
        ("ok-1", good),
        ("wide", np.ones((2, D + 1), np.float32).tolist()),
        ("ragged", [[1.0] * D, [1.0] * (D - 1)]),
        ("nan", np.full((2, D), np.nan, np.float32).tolist()),
        ("empty", []),
        ("null", None),
        ("ok-2", good),
    ]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"id": item_id, "x": x}) + "\n" for item_id, x in rows))
        return
    x = pa.array([r[1] for r in rows], pa.list_(pa.list_(pa.float32())))
    table = pa.table({"id": [r[0] for r in rows], "x": x})
    pq.write_table(table, path)


def output_ids(path) -> list[str]:
    return pq.read_table(path).column("id").to_pylist() if path.suffix == ".parquet" else np.load(path).files


@pytest.mark.parametrize(("suffix", "output"), [(".parquet", ".parquet"), (".jsonl", ".npz")])
def test_bad_items_skipped_and_listed(tmp_path, export_model, suffix, output):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    write_bad_items(tmp_path / f"in{suffix}")
    job = DatasetJob(tmp_path / f"in{suffix}", tmp_path / f"out{output}", session.source)
    stats = run_dataset(job, BatchRunner(session, on_error="skip"))
    assert output_ids(tmp_path / f"out{output}") == ["ok-1", "ok-2"]
    errors = {e.item_id: e for e in stats.errors}
    assert sorted(errors) == ["empty", "nan", "null", "ragged", "wide"]
    assert all(e.shard == f"in{suffix}" for e in errors.values())
    assert "x has d_model 65, this model expects 64" in errors["wide"].message
    assert "of different lengths" in errors["ragged"].message
    assert "NaN" in errors["nan"].message and "x is empty" in errors["empty"].message
    if suffix == ".jsonl":  # ids need not find a line: each message names it
        assert errors["nan"].message.startswith("item 'nan' (line 4): x contains NaN")
        assert errors["null"].message.startswith("item 'null' (line 6): x must hold numbers only")
    manifest = json.loads(job.manifest_path.read_text())
    assert len(manifest["shards"][f"in{suffix}"]["skipped_items"]) == 5
    assert "5 bad items skipped" in stats.summary()


@pytest.mark.parametrize(("suffix", "output", "message"), [
    (".parquet", ".parquet", r"in.parquet: item 'wide': x has d_model 65"),
    (".jsonl", ".npz", r"in.jsonl: item 'wide' \(line 2\): x has d_model 65"),
])
def test_bad_item_stops_with_its_shard_and_id(tmp_path, export_model, suffix, output, message):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    write_bad_items(tmp_path / f"in{suffix}")
    job = DatasetJob(tmp_path / f"in{suffix}", tmp_path / f"out{output}", session.source)
    with pytest.raises(InputError, match=message):
        run_dataset(job, BatchRunner(session, bucket_window=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"in{suffix}"], "no output, temporary file or manifest"


def test_jsonl_lines_that_name_no_usable_item_are_bad_items_naming_the_line(tmp_path, export_model):
    """Ids as generate takes them (a string or an integer), and numbers only: numpy would read true as 1."""
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    good = np.ones((2, D)).tolist()
    lines = [
        "not json",
        "[1, 2]",
        json.dumps({"id": 1.5, "x": good}),
        json.dumps({"id": True, "x": good}),
        json.dumps({"id": 7, "x": good}),
        json.dumps({"id": "flag", "x": [[True] + [0.0] * (D - 1)] * 2}),
        json.dumps({"id": "text", "x": [["a"] * D]}),
        json.dumps({"id": "none"}),
        json.dumps({"id": "7", "x": good}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    stats = run_dataset(DatasetJob(tmp_path / "in.jsonl", tmp_path / "out.npz", session.source),
                        BatchRunner(session, on_error="skip"))
    assert np.load(tmp_path / "out.npz").files == ["7"]
    assert [e.message for e in stats.errors] == [
        "item '<line 1>': line 1 is not JSON (Expecting value: line 1 column 1 (char 0))",
        "item '<line 2>': line 2 is not an object with an \"id\"",
        "item '<line 3>': line 3: \"id\" must be a string or an integer, got 1.5",
        "item '<line 4>': line 4: \"id\" must be a string or an integer, got true",
        "item 'flag' (line 6): x holds true or false among its numbers; give numbers only",
        "item 'text' (line 7): x must hold numbers only (no true/false, null, strings or integers past 64 bits)",
        "item 'none' (line 8): lacks field x, which this model reads per item",
        "item '7' (line 9): appears twice in this shard: the second would overwrite the first's outputs",
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: (p / "in").mkdir(), "no .npz, .safetensors, .parquet, .jsonl files"),
        (lambda p: (p / "in.txt").write_text(""), "must end in .npz or .safetensors or .parquet"),
        (lambda p: pq.write_table(pa.table({"id": ["a"]}), p / "in.parquet"), "no column x"),
        (lambda p: (p / "in.parquet").write_bytes(b"nope"), "cannot read Parquet"),
        (lambda p: (p / "in.jsonl").write_bytes(b'{"id": "\xff"}\n'), r"in.jsonl: not UTF-8 text"),
        (lambda p: (p / "in.jsonl").write_text('{"id": "a", "x": [[0.5]], "key_padding_mask": [true]}\n'),
         r"in.jsonl: line 1: field key_padding_mask: key_padding_mask is this model's padding mask"),
    ],
)
def test_unusable_inputs(tmp_path, export_model, make, message):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    make(tmp_path)
    source = next(p for p in tmp_path.iterdir())
    output = tmp_path / ("out" if source.is_dir() else "out.parquet")
    with pytest.raises(InputError, match=message):
        run_dataset(DatasetJob(source, output, session.source), BatchRunner(session))


def test_jsonl_is_read_not_written(tmp_path):
    """A JSONL shard's outputs are float arrays: an npz beside the others, never two inputs' outputs in one."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("")
    with pytest.raises(InputError, match=r"out.jsonl must end in .npz or .safetensors or .parquet \(JSONL is read"):
        list_shards(tmp_path / "in" / "a.jsonl", tmp_path / "out.jsonl")
    (tmp_path / "in" / "b.jsonl").write_text("")
    assert [(s.name, s.output.name) for s in list_shards(tmp_path / "in", tmp_path / "out")] == [
        ("a.jsonl", "a.npz"), ("b.jsonl", "b.npz")]
    np.savez(tmp_path / "in" / "a.npz")
    with pytest.raises(InputError, match=r"a\.jsonl and a\.npz would both write a\.npz"):
        list_shards(tmp_path / "in", tmp_path / "out")


def test_directory_input_needs_directory_output(tmp_path):
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "a.npz", a=np.ones((1, D), np.float32))
    (tmp_path / "out.npz").write_bytes(b"")
    with pytest.raises(InputError, match="must be one too"):
        list_shards(tmp_path / "in", tmp_path / "out.npz")


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
@pytest.mark.parametrize("attention", ["self", "cross"])
def test_item_files_round_trip(tmp_path, suffix, attention):
    signature = Signature(attention, "padding")
    rng = np.random.default_rng(0)
    parts = ("x",) if attention == "self" else ("query", "key", "value")
    lengths = (3, 1, 7)
    items = {f"id{i}": {p: rng.standard_normal((n, D), dtype=np.float32) for p in parts} for i, n in enumerate(lengths)}
    if attention == "self":
        arrays = {item_id: item["x"] for item_id, item in items.items()}
    else:
        arrays = {f"{item_id}.{part}": a for item_id, item in items.items() for part, a in item.items()}
    path = tmp_path / f"items{suffix}"
    write_arrays(path, arrays)
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary files left"
    with open_reader(path, signature, D, window=2) as reader:
        loaded = {raw.item_id: raw.item for raw in reader}
    assert set(loaded) == set(items)
    for item_id, item in items.items():
        for name, array in item.items():
            np.testing.assert_array_equal(loaded[item_id][name], array)


def test_cross_item_file_with_a_foreign_key(tmp_path):
    path = tmp_path / "items.npz"
    np.savez(path, a=np.zeros((1, D), np.float32))
    with pytest.raises(InputError, match=r"key 'a' is not one of <id>.query"), open_reader(
        path, Signature("cross", "padding"), D, window=2
    ):
        pass


def test_cross_item_lacking_a_part_is_reported_by_id(tmp_path):
    path = tmp_path / "items.npz"
    np.savez(path, **{"a.query": np.zeros((1, D), np.float32), "a.key": np.zeros((1, D), np.float32)})
    with open_reader(path, Signature("cross", "padding"), D, window=2) as reader:
        (raw,) = list(reader)
    assert raw.item_id == "a" and raw.item is None and "lacks a.value" in raw.problem


def test_pickled_npz_member_is_a_bad_item_called_unsafe(tmp_path):
    path = tmp_path / "items.npz"
    np.savez(path, a=np.array([{"not": "an array"}], dtype=object), b=np.ones((2, D), np.float32))
    with open_reader(path, Signature(), D, window=2) as reader:
        raw = {item.item_id: item for item in reader}
    assert raw["a"].item is None and "pickled Python objects" in raw["a"].problem and "unsafe" in raw["a"].problem
    assert raw["b"].problem is None and raw["b"].item["x"].shape == (2, D)


def test_output_keys_per_item():
    result = {"output": np.zeros(1), "attn_weights": np.ones(1)}
    assert [key for key, _ in item_arrays("a", result)] == ["a", "a.attn_weights"]
    assert [key for key, _ in item_arrays("b", {"output": np.zeros(2)})] == ["b"]
