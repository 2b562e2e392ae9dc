"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mha_deploy.metadata import Signature
from tests.conftest import KV_DECODER, TEST_D_MODEL, TEST_HEADS

README = Path(__file__).resolve().parents[1] / "README.md"


# The example shows provider="auto" and asserts nothing that depends on where it lands.
@pytest.mark.auto_provider
def test_readme_python_example(export_model, tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    path, _ = export_model(Signature("self", "padding"))
    (tmp_path / "mha.onnx").symlink_to(path)
    (tmp_path / "decode.onnx").symlink_to(export_model(Signature("self", "padding-causal", kv_cache=True))[0])
    (tmp_path / "decoder-kv.onnx").symlink_to(export_model(KV_DECODER)[0])
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "provider " in printed
    assert "[1] [9] 12" in printed, "the KV-cache example prints what its comment says"
    assert f"4 (2, {TEST_HEADS}, 5, {TEST_D_MODEL // TEST_HEADS})" in printed, "so does the decoder stack's"
