"""The contract between an exported ONNX file and everything that runs it.

This module is imported by both sides of the file boundary (exporters write the
metadata, serving reads it), so it must stay free of torch and onnx imports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from mha_deploy.errors import ExportError, ModelFileError

ATTENTION_KINDS = ("self", "cross")
# A lone reference MHA, or a post-norm Transformer stack built from it.
MODEL_KINDS = ("mha", "encoder", "decoder")
MASK_MODES = ("none", "padding", "causal", "padding-causal")
METADATA_KEY = "mha_deploy"
# Bumped when the meaning of a recorded field changes.
METADATA_FORMAT = 1


@dataclass(frozen=True)
class Signature:
    """Which inputs and outputs an exported model has, and what they mean."""

    attention: str = "self"
    mask: str = "none"
    return_weights: bool = False
    # "encoder": x -> output with self-attention layers; "decoder": x (target) and
    # memory -> output, causal self-attention then cross-attention over memory.
    model: str = "mha"

    def __post_init__(self):
        if self.model not in MODEL_KINDS:
            raise ExportError(f"model must be one of {', '.join(MODEL_KINDS)}, got {self.model!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ExportError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.mask not in MASK_MODES:
            raise ExportError(f"mask must be one of {', '.join(MASK_MODES)}, got {self.mask!r}")
        if self.model != "mha":
            self._check_stack()
        elif self.is_causal and self.attention == "cross":
            raise ExportError(
                f"mask {self.mask!r} needs self-attention: a causal mask orders queries and keys of "
                "one sequence, which cross-attention does not have (use --mask padding or none)"
            )

    def _check_stack(self) -> None:
        attention = "self" if self.model == "encoder" else "cross"
        if self.attention != attention:
            raise ExportError(f"--model {self.model} has {attention}-attention inputs, not {self.attention!r}")
        if self.mask not in ("none", "padding"):
            raise ExportError(
                f"--model {self.model} takes --mask none or padding"
                + (" (its self-attention is always causal)" if self.model == "decoder" else "")
            )
        if self.return_weights:
            raise ExportError(f"--model {self.model} has several attentions: --return-weights is for a lone MHA")

    @property
    def has_padding_mask(self) -> bool:
        return self.mask in ("padding", "padding-causal")

    @property
    def is_causal(self) -> bool:
        return self.mask in ("causal", "padding-causal")

    @property
    def sequence_inputs(self) -> tuple[str, ...]:
        if self.model == "decoder":
            return ("x", "memory")
        return ("x",) if self.attention == "self" else ("query", "key", "value")

    @property
    def padding_masks(self) -> dict[str, str]:
        """Each bool padding-mask input -> the sequence input whose positions it marks."""
        if not self.has_padding_mask:
            return {}
        if self.model == "decoder":
            return {"key_padding_mask": "x", "memory_padding_mask": "memory"}
        return {"key_padding_mask": "x" if self.attention == "self" else "key"}

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.sequence_inputs + tuple(self.padding_masks)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("output", "attn_weights") if self.return_weights else ("output",)


@dataclass
class ParityReport:
    """What the export-time comparison of ONNX Runtime against torch measured."""

    passed: bool
    atol: float
    rtol: float
    max_abs_err: float
    # Smallest atol that would have passed at the given rtol, and vice versa.
    required_atol: float
    required_rtol: float
    shapes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # Largest ||actual - reference|| / ||reference|| over real query rows, per output and shape.
    rel_err: float = 0.0
    # When set (quantized models), parity means rel_err <= rel_budget instead of the atol/rtol test.
    rel_budget: float | None = None

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        if self.rel_budget is not None:
            return (
                f"parity {verdict} over {len(self.shapes)} shapes ({', '.join(self.shapes)}): "
                f"relative error {self.rel_err:.3%} (budget {self.rel_budget:.1%}), max abs err {self.max_abs_err:.3g}"
            )
        return (
            f"parity {verdict} over {len(self.shapes)} shapes ({', '.join(self.shapes)}): "
            f"max abs err {self.max_abs_err:.3g} (tolerance atol={self.atol:g} rtol={self.rtol:g}; "
            f"would pass with atol >= {self.required_atol:.3g} at this rtol, "
            f"or rtol >= {self.required_rtol:.3g} at this atol)"
        )


@dataclass
class ModelMetadata:
    """Everything a session needs to know about an exported model."""

    d_model: int
    num_heads: int
    signature: Signature
    dtype: str = "float32"
    opset: int = 23
    fusion: str = "none"
    quantization: str = "none"
    # Stacks: how many layers, and the feed-forward width.
    layers: int = 1
    d_ff: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    parity: ParityReport | None = None
    format: int = METADATA_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "model") -> ModelMetadata:
        try:
            raw = json.loads(text)
            raw["signature"] = Signature(**raw["signature"])
            if raw.get("parity") is not None:
                raw["parity"] = ParityReport(**raw["parity"])
            metadata = cls(**raw)
        except (ValueError, TypeError, KeyError, ExportError) as exc:
            raise ModelFileError(f"{source}: unreadable mha-deploy metadata ({exc})") from exc
        if metadata.format > METADATA_FORMAT:
            raise ModelFileError(
                f"{source}: metadata format {metadata.format} is newer than this mha-deploy "
                f"understands ({METADATA_FORMAT}); upgrade mha-deploy"
            )
        return metadata

    @classmethod
    def from_props(cls, props: dict[str, str], source: str = "model") -> ModelMetadata:
        if METADATA_KEY not in props:
            raise ModelFileError(
                f"{source}: no mha-deploy metadata in this ONNX file; export it with `mha-deploy export`"
            )
        return cls.from_json(props[METADATA_KEY], source)
