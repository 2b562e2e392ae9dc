"""Model files that lie: a cache keyed by mtime (tracker #6), edited metadata, malicious pickles.

- ``cp -p`` keeps a file's mtime: the optimized-model cache, keyed by mtime,
  kept serving the model that had been replaced.
- Metadata edited after export (or a graph swapped under it) used to be
  trusted into wrong batching; it is refused with ``ModelFileError``.
- A checkpoint that pickles code is refused without unpickling it, and called unsafe.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.errors import ModelFileError, OptionError
from mha_deploy.metadata import METADATA_KEY, Signature
from mha_deploy.runtime import MHASession
from tests.adversarial.conftest import assert_loud, infer, sequences


def test_optimized_model_cache_follows_a_model_replaced_with_its_mtime_kept(export_model, tmp_path):
    """`cp -p new.onnx mha.onnx` with new.onnx older than the cache: the cache must not serve the old model."""
    source, cache = tmp_path / "mha.onnx", tmp_path / "mha.opt.onnx"
    shutil.copy2(export_model(Signature("self", "causal"))[0], source)
    x = sequences((6,))[0][None]
    old = MHASession(source, provider="cpu", optimized_model_path=cache).run({"x": x})["output"]
    assert MHASession(source, provider="cpu", optimized_model_path=cache).loaded_from == str(cache)

    replacement = tmp_path / "new.onnx"
    shutil.copy2(export_model(Signature("self", "none"))[0], replacement)
    older = cache.stat().st_mtime_ns - 10**9
    os.utime(replacement, ns=(older, older))
    shutil.copy2(replacement, source)  # cp -p
    assert source.stat().st_mtime_ns < cache.stat().st_mtime_ns

    reloaded = MHASession(source, provider="cpu", optimized_model_path=cache)
    assert reloaded.loaded_from == str(source) and reloaded.signature == Signature("self", "none")
    expected = MHASession(replacement, provider="cpu").run({"x": x})["output"]
    np.testing.assert_allclose(reloaded.run({"x": x})["output"], expected, atol=1e-6)
    assert not np.allclose(expected, old, atol=1e-3), "the two models differ (causal or not)"
    assert MHASession(source, provider="cpu", optimized_model_path=cache).loaded_from == str(cache)


def _edit_metadata(source, target, **changes) -> None:
    model = onnx.load(source)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            recorded = json.loads(prop.value)
            for key, value in changes.items():
                (recorded["signature"] if key in recorded["signature"] else recorded)[key] = value
            prop.value = json.dumps(recorded)
    onnx.save(model, target)


@pytest.mark.parametrize(
    ("signature", "fuse", "changes", "message"),
    [
        (Signature("self", "none"), "auto", {"num_heads": 8}, "the graph splits 4 heads, its metadata says 8"),
        (Signature("self", "none"), "none", {"num_heads": 2}, "the graph splits 4 heads, its metadata says 2"),
        (Signature("self", "padding", True), "auto", {"num_heads": 8}, "attn_weights has heads 4 in the graph, 8"),
        (Signature("self", "none"), "auto", {"d_model": 32}, "x has d_model 64 in the graph, 32 in its metadata"),
        (Signature("self", "none"), "auto", {"dtype": "float16"}, "x is float32 in the graph, float16 in its"),
        # Trusted, these would right-pad the keys of a model that sees them: wrong answers for every batch.
        (Signature("self", "none"), "auto", {"mask": "causal"}, "the graph's attention is not causal"),
        (Signature("self", "none"), "none", {"mask": "causal"}, "changes by"),
        (Signature("self", "padding"), "none", {"mask": "padding-causal"}, "when the last token changes"),
        (Signature("self", "none"), "auto", {"return_weights": True}, "do not match its metadata"),
        # Fused ops under the fusion's Ifs (GroupQueryAttention by size, the padding flash path) are read too.
        (Signature("self", "causal"), "auto", {"num_heads": 8}, "the graph splits 4 heads, its metadata says 8"),
        (Signature("self", "causal"), "auto", {"mask": "none"}, "the graph's attention is causal"),
        (Signature("self", "padding"), "auto", {"mask": "padding-causal"}, "the graph's attention is not causal"),
    ],
    ids=["heads-fused", "heads-unfused", "heads-weights", "d_model", "dtype", "causal-fused", "causal-unfused",
         "padding-causal", "weights", "heads-in-if", "causal-in-if", "not-causal-in-if"],
)
def test_edited_metadata_is_refused(tmp_path, export_model, signature, fuse, changes, message):
    edited = tmp_path / "edited.onnx"
    _edit_metadata(export_model(signature, fuse)[0], edited, **changes)
    with pytest.raises(ModelFileError, match=str(edited)) as refused:
        MHASession(edited, provider="cpu")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_edited_metadata_is_refused_by_infer_in_one_line(tmp_path, export_model):
    edited = tmp_path / "edited.onnx"
    _edit_metadata(export_model(Signature("self", "none"), "none")[0], edited, mask="causal")
    np.savez(tmp_path / "in.npz", a=sequences((3,))[0], b=sequences((7,), seed=1)[0])
    assert_loud(infer(edited, tmp_path / "in.npz", tmp_path / "out.npz"), f"{edited}: its output changes by")
    assert not (tmp_path / "out.npz").exists()


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for any code a malicious file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_malicious_checkpoint_is_called_unsafe_and_never_runs(tmp_path, protocol):
    pytest.importorskip("torch")
    marker, checkpoint = tmp_path / "pwned", tmp_path / "evil.pt"
    if protocol == 2:  # a plain pickle, as an attacker writes it
        checkpoint.write_bytes(pickle.dumps({"W_q.weight": _Payload(marker)}, protocol=2))
    else:  # inside torch.save's zip container
        import torch

        torch.save({"W_q.weight": _Payload(marker)}, checkpoint)
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "m.onnx")])
    assert_loud(result, f"checkpoint {checkpoint}: unsafe pickle refused", "io.open" if protocol != 2 else "open")
    assert not marker.exists(), "the payload never ran"
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("container", ["pickle", "torch.save"])
@pytest.mark.parametrize("protocol", [4, 5])
def test_a_protocol_4_malicious_checkpoint_names_the_call_it_would_make(tmp_path, protocol, container):
    """Protocols 4 and 5 name a global with STACK_GLOBAL, which torch's safe loader refuses as "Unsupported
    operand 149": the refusal was the generic "cannot read it as a torch file"."""
    torch = pytest.importorskip("torch")
    marker, checkpoint = tmp_path / "pwned", tmp_path / "evil.pt"
    if container == "pickle":  # as an attacker writes it (a tensor pickled so calls torch's own unsafe loader)
        checkpoint.write_bytes(pickle.dumps({"W_q.weight": _Payload(marker)}, protocol=protocol))
    else:  # a real tensor first: the payload is not the first global
        torch.save({"W_q.weight": torch.zeros(2, 2), "W_k.weight": _Payload(marker)}, checkpoint,
                   pickle_protocol=protocol)
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "m.onnx")])
    assert_loud(result, f"checkpoint {checkpoint}: unsafe pickle refused: it pickles io.open,", "torch.save")
    assert not marker.exists(), "the payload never ran"
    assert not (tmp_path / "m.onnx").exists()


def test_a_sound_protocol_4_checkpoint_is_told_how_to_save_it(tmp_path):
    torch = pytest.importorskip("torch")
    checkpoint = tmp_path / "sound.pt"
    torch.save({"W_q.weight": torch.zeros(2, 2)}, checkpoint, pickle_protocol=4)
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "m.onnx")])
    assert_loud(result, "protocol 4 or later, which torch.load(weights_only=True) does not read", ".safetensors")


@pytest.mark.parametrize("alias", ["same path", "symlink", "hard link"])
def test_an_optimized_model_cache_that_is_the_model_is_refused_and_the_model_kept(export_model, tmp_path, alias):
    source = tmp_path / "mha.onnx"
    shutil.copy(export_model(Signature("self", "padding"))[0], source)
    before = source.read_bytes()
    cache = {"same path": tmp_path / "." / "mha.onnx", "symlink": tmp_path / "link.onnx",
             "hard link": tmp_path / "hard.onnx"}[alias]
    if alias == "symlink":
        cache.symlink_to(source)
    elif alias == "hard link":
        os.link(source, cache)
    with pytest.raises(OptionError, match="is the model itself"):
        MHASession(source, provider="cpu", optimized_model_path=cache)
    assert source.read_bytes() == before


def test_an_unwritable_cache_directory_is_blamed_on_the_cache_not_the_model(export_model, tmp_path):
    """/proc takes no new files, even from root: ORT's own error was "SystemError : 13" on the model."""
    source = export_model(Signature("self", "padding"))[0]
    cache = "/proc/mha-deploy-cache.onnx"
    with pytest.raises(ModelFileError, match=f"^{cache}: cannot write the optimized-model cache"):
        MHASession(source, provider="cpu", optimized_model_path=cache)


# Round 2, defect 8: `triton` wrote repositories for these, which infer and serve refuse; `inspect` showed
# them without a word. All four now share the session's check.
PADDING = Signature("self", "padding")
LIES = [
    pytest.param(PADDING, "auto", {"d_model": 32}, "x has d_model 64 in the graph, 32", id="d_model"),
    pytest.param(PADDING, "auto", {"num_heads": 7}, "the graph splits 4 heads, its metadata says 7", id="7-heads"),
    pytest.param(Signature("self", "none"), "none", {"mask": "causal"}, "changes by", id="none-as-causal"),
]


@pytest.mark.parametrize(("signature", "fuse", "changes", "message"), LIES)
def test_lying_metadata_is_refused_by_triton_and_flagged_by_inspect(tmp_path, export_model, signature, fuse,
                                                                    changes, message):
    edited = tmp_path / "edited.onnx"
    _edit_metadata(export_model(signature, fuse)[0], edited, **changes)
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["triton", str(edited), "--repo", str(repo)])
    assert_loud(result, str(edited), message)
    assert not repo.exists() or list(repo.iterdir()) == []
    report = CliRunner().invoke(main, ["inspect", str(edited)])
    assert report.exit_code == 0, report.output
    assert "warning: its metadata does not describe its graph" in report.stderr and message in report.stderr
    as_json = CliRunner().invoke(main, ["inspect", str(edited), "--json"])
    assert message in json.loads(as_json.stdout)["metadata_problem"]


def test_inspect_of_a_sound_model_warns_of_nothing(export_model):
    result = CliRunner().invoke(main, ["inspect", str(export_model(Signature("self", "padding"))[0])])
    assert result.exit_code == 0 and result.stderr == "", result.output


def test_inspect_into_a_closed_pipe_stops_quietly(export_model):
    """`mha-deploy inspect m.onnx | head -0`: the reader is gone before the first line (was "unexpected")."""
    command = [sys.executable, "-m", "mha_deploy.cli", "inspect", str(export_model(Signature("self", "padding"))[0])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert stderr == b"" and process.returncode == 141, stderr.decode()


@pytest.mark.parametrize(("field", "value"), [("d_model", "64"), ("format", "2"), ("num_heads", 4.0)])
@pytest.mark.parametrize("command", ["inspect", "triton", "infer"])
def test_metadata_fields_of_the_wrong_type_are_one_line_naming_the_file(tmp_path, export_model, field, value,
                                                                       command):
    """Round 2: "64" for 64 was "unexpected TypeError" from wherever it was first used."""
    edited = tmp_path / "edited.onnx"
    _edit_metadata(export_model(PADDING)[0], edited, **{field: value})
    np.savez(tmp_path / "in.npz", a=sequences((3,))[0])
    if command == "infer":
        result = infer(edited, tmp_path / "in.npz", tmp_path / "out.npz")
    else:
        args = ["--repo", str(tmp_path / "repo")] if command == "triton" else []
        result = CliRunner().invoke(main, [command, str(edited), *args])
    assert_loud(result, str(edited), f"metadata {field} is {value!r}, not a positive integer")


def test_export_into_a_directory_that_takes_no_files_is_one_line_naming_the_output(tmp_path):
    """/proc takes no new files, even from root (a read-only output directory was "unexpected")."""
    pytest.importorskip("torch")
    result = CliRunner().invoke(main, ["export", "--d-model", "16", "--heads", "2", "-o", "/proc/mha.onnx"])
    assert_loud(result, "/proc/mha.onnx: cannot write it")
