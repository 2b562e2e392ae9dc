"""The README's walk-through runs as written, in order; its other commands name options that exist; the user
guide's Python examples run as written."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.metadata import Signature
from tests.conftest import KV_DECODER, TEST_D_MODEL, TEST_HEADS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WALK_THROUGH = "## Five minutes with your own model"
README_PORT = "localhost:8000"  # where the walk-through's client finds its server; the test's is on a free port


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same level."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def shell_commands(body: str) -> list[list[str]]:
    """A bash block's commands, continuation lines joined and comments dropped, as argument lists."""
    joined = body.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def readme_commands() -> list[list[str]]:
    """Every ``mha-deploy`` command in the README: in bash blocks, and in the table's inline code."""
    text = README.read_text()
    commands = [args for lang, body in fenced_blocks(text) if lang == "bash" for args in shell_commands(body)]
    commands += [shlex.split(code) for code in re.findall(r"`(mha-deploy [^`]+)`", text)]
    return [args for args in commands if args[0] == "mha-deploy" and len(args) > 1]


@pytest.mark.parametrize("args", readme_commands(), ids=lambda args: " ".join(args[:2]) + "...")
def test_readme_commands_name_options_that_exist(args):
    """Commands outside the walk-through need files the reader has (a checkpoint, shards): their options are
    checked against the command, whose behaviour its own tests cover."""
    command = main.commands.get(args[1])
    if args[1].startswith("-"):
        assert args[1] in {"--version", "--debug", "--help"}, args
        return
    assert command is not None, f"the README runs an unknown command: {args}"
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    used = [arg.split("=")[0] for arg in args[2:] if arg.startswith("--")]
    assert set(used) <= known, f"{' '.join(args)}: unknown {sorted(set(used) - known)}"


@pytest.mark.auto_provider  # the walk-through runs with the provider users get (auto); it asserts shapes only
def test_readme_walk_through_runs_in_order(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("tritonclient.http")
    from tests.serving.helpers import Server

    blocks = fenced_blocks(section(README.read_text(), WALK_THROUGH))
    assert [lang for lang, _ in blocks].count("bash") >= 4, "the walk-through exports, infers, serves, writes Triton"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the walk-through's `import model`
    monkeypatch.delitem(sys.modules, "model", raising=False)
    server = None
    try:
        for lang, body in blocks:
            if lang == "python" and (named := re.match(r"# (\w+\.py)\b", body)):
                (tmp_path / named[1]).write_text(body)  # a file the reader writes, e.g. model.py
            elif lang == "python":
                if server is not None:
                    body = body.replace(README_PORT, server.url)
                exec(compile(body, str(README), "exec"), {})
            elif lang == "bash":
                for args in shell_commands(body):
                    assert args[0] == "mha-deploy", args
                    if args[1] == "serve":
                        port = args.index("--port")
                        assert f"localhost:{args[port + 1]}" == README_PORT
                        rest = args[3:port] + args[port + 2:]
                        server = Server(Path(args[2]), tmp_path / "server.log", *rest).wait_ready()
                    else:
                        result = CliRunner().invoke(main, args[1:])
                        assert result.exit_code == 0, f"{' '.join(args)}\n{result.output}"
    finally:
        if server is not None:
            server.stop()
        sys.modules.pop("model", None)
    assert server is not None, "the walk-through serves the model"
    printed = capsys.readouterr().out
    assert "100 (3,)" in printed, "infer wrote one row of logits per text, as the comment says"
    assert "(2, 3)" in printed, "the client got a row per text, as the comment says"
    assert (tmp_path / "models" / "classifier" / "config.pbtxt").exists()


GUIDE_EXAMPLES = [ROOT / "docs" / "runtime.md", ROOT / "docs" / "decoding.md"]


# The session example shows provider="auto" and asserts nothing that depends on where it lands.
@pytest.mark.auto_provider
def test_user_guide_python_examples(export_model, tmp_path, monkeypatch, capsys):
    blocks = [body for page in GUIDE_EXAMPLES for lang, body in fenced_blocks(page.read_text()) if lang == "python"]
    # onnxruntime-genai lives in .venv-genai (it brings its own onnxruntime); the calls its example makes are the
    # ones mha_deploy/bench/genai_greedy.py makes there, which tests/runtime/test_genai.py runs.
    blocks = [body for body in blocks if "import onnxruntime_genai" not in body]
    assert len(blocks) >= 3, "the session, the decoder and the decoder stack each have an example"
    path, _ = export_model(Signature("self", "padding"))
    (tmp_path / "mha.onnx").symlink_to(path)
    (tmp_path / "decode.onnx").symlink_to(export_model(Signature("self", "padding-causal", kv_cache=True))[0])
    (tmp_path / "decoder-kv.onnx").symlink_to(export_model(KV_DECODER)[0])
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs", "exec"), {})
    printed = capsys.readouterr().out
    assert "provider " in printed
    assert "[1] [9] 12" in printed, "the KV-cache example prints what its comment says"
    assert f"4 (2, {TEST_HEADS}, 5, {TEST_D_MODEL // TEST_HEADS})" in printed, "so does the decoder stack's"
    assert "[0 1] [9 4] [False  True]" in printed, "and the generation example"
