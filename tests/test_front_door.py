"""The front door: the README's first code block is what a newcomer runs on a fresh machine (the main job, and
the tests CI runs), and set-up says what it installed and what to run next."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.test_readme import README, fenced_blocks, shell_commands

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_first_block_sets_up_and_runs_the_demo_and_the_tests():
    lang, body = fenced_blocks(README.read_text())[0]
    assert lang == "bash"
    assert shell_commands(body) == [["scripts/demo.sh"], ["scripts/test.sh"]]
    for script in ("demo.sh", "test.sh"):
        path = ROOT / "scripts" / script
        assert os.access(path, os.X_OK), f"{path} must be executable"
        assert "scripts/setup.sh" in path.read_text(), f"{script} sets up first"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "exec scripts/test.sh" in ci, "CI runs exactly the README's test command"


def test_the_readme_fits_a_first_read():
    """What it is, the set-up, five minutes with your own model, generation and the commands; detail lives in
    docs/ (the README had grown to 389 lines)."""
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail into docs/"
    headings = [line for line in lines if line.startswith("## ")]
    first_read = ["## Install", "## Five minutes with your own model", "## What fusion buys on your own model"]
    assert headings[:3] == first_read
    assert {"## Generate text", "## Commands"} <= set(headings)


def test_setup_says_what_it_installed_and_what_to_run_next(tmp_path):
    """setup.sh against a .venv whose pip is a stand-in (the install itself is pip's), its summary read from the
    environment these tests run in."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shim = repo / ".venv" / "bin" / "python"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$@" >> "{tmp_path}/pip.log"; '
                    f'exit 0; fi\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    # .venv-genai as setup.sh left it for this run of the tests (onnxruntime-genai already there: nothing installed)
    genai = repo / ".venv-genai" / "bin" / "python"
    genai.parent.mkdir(parents=True)
    genai.write_text(f'#!/bin/sh\nexec "{ROOT / ".venv-genai" / "bin" / "python"}" "$@"\n')
    genai.chmod(0o755)

    run = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "torch==2.13.0" in (tmp_path / "pip.log").read_text()
    summary, genai_summary, *rest = run.stdout.strip().splitlines()
    assert summary.startswith("set up .venv: Python ") and ", torch " in summary and "onnxruntime" in summary
    assert genai_summary.startswith("set up .venv-genai: onnxruntime-genai ")
    assert rest[0] == "next:" and [line.split()[0] for line in rest[1:]] == [
        "scripts/demo.sh", "scripts/test.sh", "source"]

    quiet = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), "--no-next"], capture_output=True,
                           text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout.strip().splitlines() == [summary, genai_summary]
