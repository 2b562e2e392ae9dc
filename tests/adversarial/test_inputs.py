"""Hostile or damaged inputs: each fails loudly, naming the file and the item, or is skipped and listed.

Finite inputs that overflow (1e30) used to give NaN shards with exit 0, and an
unreadable member stopped the run even with ``--on-error skip``. Pickles,
zip bombs and path-like ids already failed safely: kept here so they stay so.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest

from mha_deploy.batch import BatchRunner, datasets
from mha_deploy.batch.items import read_arrays, write_arrays
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.runtime.validation import output_problem
from tests.adversarial.conftest import D, assert_loud, infer, sequences

SIGNATURE = Signature("self", "padding")


@pytest.fixture
def model(export_model):
    return export_model(SIGNATURE)[0]


def _skip(model, source, output):
    result = infer(model, source, output, "--on-error", "skip", "--json")
    assert result.exit_code == 0, result.output
    return {e["item_id"]: e["message"] for e in json.loads(result.stdout)["errors"]}


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_finite_inputs_that_overflow_are_bad_items_not_nan_outputs(tmp_path, model, suffix):
    good, other = sequences((3, 5))
    write_arrays(tmp_path / f"in{suffix}", {"good": good, "huge": np.full((4, D), 1e30, np.float32), "other": other})
    assert np.isfinite(np.full(1, 1e30, np.float32)).all()

    result = infer(model, tmp_path / f"in{suffix}", tmp_path / f"out{suffix}")
    assert_loud(result, f"in{suffix}: item 'huge': output holds NaN or Inf although every input value is finite")
    assert not (tmp_path / f"out{suffix}").exists()

    errors = _skip(model, tmp_path / f"in{suffix}", tmp_path / f"out{suffix}")
    assert list(errors) == ["huge"] and "scale the inputs down" in errors["huge"]
    outputs = read_arrays(tmp_path / f"out{suffix}")
    assert sorted(outputs) == ["good", "other"] and all(np.isfinite(a).all() for a in outputs.values())


def test_output_problem_is_the_servers_check_too():
    """What the HTTP server calls to answer 422 (kind not_finite_output) instead of returning NaN."""
    assert output_problem({"output": np.ones((2, D), np.float32)}) is None
    problem = output_problem({"output": np.ones((2, D), np.float32), "attn_weights": np.full((4, 2, 2), np.nan)})
    assert problem.kind == "not_finite_output" and problem.message.startswith("attn_weights holds NaN or Inf")


def _flip_inside(path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(needle)
    data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_member_is_a_bad_item_that_skip_skips(tmp_path, model):
    good, other = sequences((3, 2))
    np.savez(tmp_path / "in.npz", good=good, damaged=np.full((3, D), 7.0, np.float32), other=other)
    _flip_inside(tmp_path / "in.npz", np.full(4, 7.0, np.float32).tobytes())

    assert_loud(infer(model, tmp_path / "in.npz", tmp_path / "out.npz"), "in.npz: item 'damaged': cannot read")
    errors = _skip(model, tmp_path / "in.npz", tmp_path / "out.npz")
    assert list(errors) == ["damaged"] and "Bad CRC-32" in errors["damaged"]
    assert sorted(read_arrays(tmp_path / "out.npz")) == ["good", "other"]


def test_an_unreadable_file_is_one_line_naming_it(tmp_path, model):
    (tmp_path / "in.npz").write_bytes(b"PK\x03\x04 not really a zip" * 10)
    assert_loud(infer(model, tmp_path / "in.npz", tmp_path / "out.npz"), f"{tmp_path / 'in.npz'}: ")


def test_a_member_name_twice_is_a_bad_item(tmp_path, model):
    good = sequences((3,))[0]
    np.savez(tmp_path / "in.npz", twice=good, good=good)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile: "Duplicate name"
        with zipfile.ZipFile(tmp_path / "in.npz", "a") as archive:
            buffer = io.BytesIO()
            np.save(buffer, np.zeros((5, D), np.float32))
            archive.writestr("twice.npy", buffer.getvalue())
    errors = _skip(model, tmp_path / "in.npz", tmp_path / "out.npz")
    assert list(errors) == ["twice"] and "appears twice in the file" in errors["twice"]


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_member_is_called_unsafe_and_never_unpickled(tmp_path, model):
    marker = tmp_path / "pwned"
    good = sequences((3,))[0]
    np.savez(tmp_path / "in.npz", good=good, evil=np.array([_Payload(marker)], dtype=object))
    assert_loud(infer(model, tmp_path / "in.npz", tmp_path / "out.npz"), "item 'evil':", "pickled Python objects",
                "unsafe")
    errors = _skip(model, tmp_path / "in.npz", tmp_path / "out.npz")
    assert list(errors) == ["evil"] and sorted(read_arrays(tmp_path / "out.npz")) == ["good"]
    assert not marker.exists(), "the payload never ran"


def _npy_member(archive: zipfile.ZipFile, name: str, shape, data: bytes) -> None:
    """A member whose .npy header says ``shape`` (float32), whatever ``data`` holds."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    archive.writestr(f"{name}.npy", header.getvalue() + data)


def test_zip_bombs_cost_nothing(tmp_path, model, monkeypatch):
    """Members that would unpack to far more than they hold are refused from their .npy header alone."""
    good = sequences((3,))[0]
    with zipfile.ZipFile(tmp_path / "in.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("good.npy", _npy_bytes(good), compress_type=zipfile.ZIP_DEFLATED)
        # A header that lies: 2**40 x 64 floats (256 TiB) in a few bytes.
        _npy_member(archive, "liar", (2**40, D), b"\0" * 64)
        # An honest bomb: 64 MiB of zeros in ~64 KiB, in a shape the model cannot take.
        archive.writestr("wide.npy", _npy_bytes(np.zeros((16384, 1024), np.float32)),
                         compress_type=zipfile.ZIP_DEFLATED)
        # An honest bomb the model could take: refused when it would not fit in memory (1 MiB here).
        archive.writestr("long.npy", _npy_bytes(np.zeros((8192, D), np.float32)), compress_type=zipfile.ZIP_DEFLATED)
    assert (tmp_path / "in.npz").stat().st_size < 2**20
    monkeypatch.setattr(datasets, "physical_memory_bytes", lambda: 2**20)

    tracemalloc.start()
    try:
        errors = _skip(model, tmp_path / "in.npz", tmp_path / "out.npz")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated: a bomb was unpacked"
    assert "is damaged: its header declares 281474976710656 bytes of data, the archive holds 64" in errors["liar"]
    assert "x has d_model 1024, this model expects 64" in errors["wide"]
    assert "more than this machine's 0.0 GiB of memory" in errors["long"]
    assert sorted(errors) == ["liar", "long", "wide"] and sorted(read_arrays(tmp_path / "out.npz")) == ["good"]


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".parquet"])
def test_path_like_ids_are_only_keys(tmp_path, model, suffix):
    """Ids are keys inside the output shard, never paths: nothing is written outside --output."""
    ids = ["../../escaped", "/etc/passwd", "a/b/../c", "..", "C:\\windows"]
    arrays = dict(zip(ids, sequences((2, 3, 1, 4, 2)), strict=True))
    if suffix == ".parquet":
        from tests.batch.test_datasets import read_outputs, write_parquet

        write_parquet(tmp_path / "in.parquet", {k: {"x": v} for k, v in arrays.items()})
    else:
        write_arrays(tmp_path / f"in{suffix}", arrays)
        read_outputs = read_arrays
    (tmp_path / "run").mkdir()
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    result = infer(model, tmp_path / f"in{suffix}", tmp_path / "run" / f"out{suffix}")
    assert result.exit_code == 0, result.output
    after = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert sorted(set(after) - set(before)) == sorted(
        [f"run/out{suffix}", f"run/.out{suffix}.mha-deploy.json"]
    ), "only the output and its manifest"
    expected, _ = BatchRunner(MHASession(model, provider="cpu")).run({k: {"x": v} for k, v in arrays.items()})
    outputs = read_outputs(tmp_path / "run" / f"out{suffix}")
    assert sorted(outputs) == sorted(ids)
    for item_id in ids:
        np.testing.assert_allclose(outputs[item_id], expected[item_id]["output"], atol=1e-5)


def test_reading_an_item_file_whole_says_what_a_pickle_is(tmp_path):
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "in.npz", a=np.array([_Payload(marker)], dtype=object))
    with pytest.raises(InputError, match=r"in.npz: cannot read arrays \(it holds pickled Python objects.*unsafe"):
        read_arrays(tmp_path / "in.npz")
    assert not marker.exists()


def _limited_file_size(limit: int):
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".parquet"])
def test_an_output_that_cannot_be_written_is_one_line_naming_it(tmp_path, model, suffix):
    """Round 2: a full disk while writing safetensors was "unexpected SafetensorError"; nothing partial is left."""
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    source = tmp_path / "in.npz"
    np.savez(source, **{f"i{n}": a for n, a in enumerate(sequences([200] * 4))})
    output = tmp_path / "out" / f"o{suffix}"
    command = [sys.executable, "-m", "mha_deploy.cli", "infer", str(model), "--input", str(source), "--output",
               str(output), "--provider", "cpu", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            preexec_fn=_limited_file_size(64 * 1024))
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and line.startswith(f"error: {output}: cannot write it"), result.stderr
    assert "unexpected" not in line
    assert not output.parent.exists(), "no partial output: the directory the job created is gone too"


@pytest.mark.parametrize("column", [["a", "b"], [[1.0, 2.0], [3.0]]], ids=["strings", "flat-lists"])
def test_a_parquet_column_of_the_wrong_type_is_one_line_naming_it(tmp_path, model, column):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "x": column}), source)
    assert_loud(infer(model, source, tmp_path / "out.parquet"), f"{source}: column x is", "list<list<float32>>")
    assert not (tmp_path / "out.parquet").exists()
