"""``MHASession``: an exported model, ready to run, with inputs checked against its metadata."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mha_deploy.errors import ModelFileError
from mha_deploy.metadata import ModelMetadata
from mha_deploy.serving.providers import check_providers, plan_providers
from mha_deploy.serving.validation import validate_inputs

OPTIMIZATION_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class MHASession:
    """One ONNX Runtime session over an mha-deploy model.

    ``run`` is safe to call from many threads at once: it keeps no state between
    calls and ORT's ``InferenceSession.run`` is thread-safe.

    >>> session = MHASession("mha.onnx", provider="cpu")
    >>> session.run({"x": x})["output"]   # x: float32 [batch, seq, d_model]
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        provider: str = "auto",
        threads: int | None = None,
        optimization: str = "all",
    ):
        self.source = "<in-memory model>" if isinstance(model, bytes) else str(model)
        if not isinstance(model, bytes):
            _check_model_path(Path(model))
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
        plan = plan_providers(provider)
        try:
            self._session = ort.InferenceSession(
                model if isinstance(model, bytes) else str(model), options, providers=list(plan.ort_providers)
            )
        except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/... types
            raise ModelFileError(f"{self.source}: ONNX Runtime cannot load it: {exc}") from exc
        self.provider = check_providers(plan, self._session)
        self.provider_note = plan.note
        self.metadata = ModelMetadata.from_props(self._session.get_modelmeta().custom_metadata_map, self.source)
        self._check_io_names()

    @property
    def signature(self):
        return self.metadata.signature

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.signature.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.signature.output_names

    def run(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Validate ``inputs`` (name -> array) and return the outputs by name."""
        feeds = validate_inputs(self.metadata, inputs)
        outputs = self._session.run(list(self.output_names), feeds)
        return dict(zip(self.output_names, outputs, strict=True))

    def __call__(self, **inputs) -> dict[str, np.ndarray]:
        return self.run(inputs)

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"MHASession({self.source!r}, provider={self.provider!r}, d_model={m.d_model}, heads={m.num_heads}, "
            f"attention={m.signature.attention!r}, mask={m.signature.mask!r})"
        )

    def _check_io_names(self) -> None:
        actual_in = tuple(i.name for i in self._session.get_inputs())
        actual_out = tuple(o.name for o in self._session.get_outputs())
        if set(actual_in) != set(self.input_names) or not set(self.output_names) <= set(actual_out):
            raise ModelFileError(
                f"{self.source}: graph inputs {actual_in} / outputs {actual_out} do not match its metadata "
                f"({self.input_names} / {self.output_names}); was the file edited after export?"
            )


def _check_model_path(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, expected an .onnx file")
