"""``mha-deploy``: a thin Click layer over the library, one module per command.

Heavy modules (torch, onnxruntime) are imported inside the commands that need
them, so ``--help`` is instant and serving commands never load torch. Importing
a command's module registers it on ``main``.
"""

from __future__ import annotations

from mha_deploy.cli import (  # noqa: F401  (registers them)
    bench,
    export,
    genai_config,
    generate,
    infer,
    inspect,
    optimize,
    serve,
    triton,
)
from mha_deploy.cli.group import main

__all__ = ["main"]
