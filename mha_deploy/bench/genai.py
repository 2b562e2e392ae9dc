"""onnxruntime-genai beside mha-deploy: it runs in ``.venv-genai`` (scripts/setup.sh), an environment of its own
since it brings its own onnxruntime, through ``genai_greedy.py`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mha_deploy.errors import MHADeployError

REPOSITORY = Path(__file__).resolve().parents[2]
_SCRIPT = Path(__file__).with_name("genai_greedy.py")


def genai_python() -> Path | None:
    """The python of the onnxruntime-genai environment: ``$MHA_DEPLOY_GENAI_PYTHON``, else the repository's
    ``.venv-genai``; None when neither exists (scripts/setup.sh makes it)."""
    given = os.environ.get("MHA_DEPLOY_GENAI_PYTHON")
    path = Path(given) if given else REPOSITORY / ".venv-genai" / "bin" / "python"
    return path if path.exists() else None


@dataclass(frozen=True)
class GenaiRun:
    """What ``genai_greedy.py`` reports: each row of the last run (prompt, padding, new tokens), the wall time
    of each run, the subprocess's peak RSS."""

    sequences: list[list[int]]
    seconds: list[float]
    peak_rss_mb: float

    def new_tokens(self, width: int) -> list[list[int]]:
        """Each row's tokens after the ``width`` prompt columns."""
        return [row[width:] for row in self.sequences]


def run_genai_greedy(model_dir: str | os.PathLike, prompts: list[list[int]], max_length: int, repeats: int = 1,
                     warmup: bool = False, timeout: float = 1800) -> GenaiRun:
    """Greedy generation by onnxruntime-genai from ``model_dir`` (a model and its ``genai_config.json``) over
    ``prompts`` (one width, right-padded with the config's pad id) up to ``max_length`` tokens per row, ``repeats``
    timed runs (after an untimed short one with ``warmup``) in one fresh process."""
    python = genai_python()
    if python is None:
        raise MHADeployError("no onnxruntime-genai environment: run scripts/setup.sh (it makes .venv-genai)")
    with tempfile.TemporaryDirectory() as scratch:
        request = Path(scratch) / "request.json"
        request.write_text(json.dumps({"model_dir": str(model_dir), "prompts": prompts, "max_length": max_length,
                                       "repeats": repeats, "warmup": warmup}))
        done = subprocess.run([str(python), str(_SCRIPT), str(request)], capture_output=True, text=True,
                              timeout=timeout)
    if done.returncode != 0:
        raise MHADeployError(f"onnxruntime-genai failed on {model_dir}: {done.stderr.strip()[-2000:]}")
    return GenaiRun(**json.loads(done.stdout.strip().splitlines()[-1]))
