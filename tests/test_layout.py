"""Data flows one way: models -> exporters -> (ONNX file) -> runtime -> batch, serving.

Each layer is imported in a fresh interpreter in which everything above it is
made unimportable, so a stray import of torch (or of a higher layer) fails here.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import mha_deploy

TORCH_SIDE = ("torch", "onnxscript", "mha_deploy.models", "mha_deploy.exporters", "mha_deploy.bench")
# package -> the modules it must never import (directly or through another module).
FORBIDDEN = {
    # Nor model_report, the inspect report: the runtime walks graphs with onnx_nodes.
    "mha_deploy.runtime": (
        *TORCH_SIDE, "mha_deploy.batch", "mha_deploy.serving", "mha_deploy.cli", "mha_deploy.model_report"
    ),
    "mha_deploy.batch": (*TORCH_SIDE, "mha_deploy.serving", "mha_deploy.cli"),
    "mha_deploy.serving": (*TORCH_SIDE, "mha_deploy.cli"),
    "mha_deploy.inputs": (*TORCH_SIDE, "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch", "mha_deploy.serving"),
    "mha_deploy.compare": (*TORCH_SIDE, "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch", "mha_deploy.serving"),
    "mha_deploy.signature": (*TORCH_SIDE, "onnx", "onnxruntime", "mha_deploy.runtime"),
    "mha_deploy.onnx_nodes": (
        *TORCH_SIDE, "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch", "mha_deploy.serving"
    ),
    # What the exporter, the session's load check and inspect read the vocabulary with: onnx only.
    "mha_deploy.token_tables": (
        *TORCH_SIDE, "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch", "mha_deploy.serving"
    ),
    # The CLI reads the batching defaults from it: no onnxruntime.
    "mha_deploy.batching": (*TORCH_SIDE, "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch", "mha_deploy.serving"),
    # The CLI reads the seed range from it: no onnxruntime.
    "mha_deploy.seeds": (*TORCH_SIDE, "onnx", "onnxruntime", "mha_deploy.runtime", "mha_deploy.batch",
                         "mha_deploy.serving"),
}


def _modules(package: str) -> list[str]:
    module = __import__(package, fromlist=["_"])
    if not hasattr(module, "__path__"):
        return [package]
    return [package] + [m.name for m in pkgutil.walk_packages(module.__path__, prefix=f"{package}.")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(package):
    modules = _modules(package)
    # A module set to None in sys.modules raises ImportError when anything imports it.
    code = (
        "import sys\n"
        f"for name in {FORBIDDEN[package]!r}:\n"
        "    sys.modules[name] = None\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{package} imports one of {FORBIDDEN[package]}:\n{result.stderr[-2000:]}"


def test_every_package_is_placed_in_the_layering():
    placed = {name.split(".")[1] for name in FORBIDDEN} | {"models", "exporters", "bench"}
    top_level = {m.name for m in pkgutil.iter_modules(mha_deploy.__path__)}
    # Shared, dependency-free modules every layer may use.
    shared = {"errors", "atomic", "metadata", "model_report", "cli", "checkpoint_names"}
    assert top_level - shared <= placed, f"unplaced modules: {sorted(top_level - shared - placed)}"


def test_public_classes_have_one_name_each():
    """Two public classes of one name (say two ``Decoder``s) make every import and every doc line ambiguous."""
    import inspect

    homes: dict[str, set[str]] = {}
    for module_name in _modules("mha_deploy"):
        module = __import__(module_name, fromlist=["_"])
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and not name.startswith("_") and obj.__module__ == module_name:
                homes.setdefault(name, set()).add(module_name)
    shared = {name: sorted(modules) for name, modules in homes.items() if len(modules) > 1}
    assert not shared, f"public classes defined in more than one module: {shared}"
