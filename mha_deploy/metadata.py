"""The contract between an exported ONNX file and everything that runs it.

This module is imported by both sides of the file boundary (exporters write the
metadata, serving reads it), so it must stay free of torch and onnx imports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from mha_deploy.errors import ExportError, ModelFileError

ATTENTION_KINDS = ("self", "cross")
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

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ExportError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.mask not in MASK_MODES:
            raise ExportError(f"mask must be one of {', '.join(MASK_MODES)}, got {self.mask!r}")
        if self.is_causal and self.attention == "cross":
            raise ExportError(
                f"mask {self.mask!r} needs self-attention: a causal mask orders queries and keys of "
                "one sequence, which cross-attention does not have (use --mask padding or none)"
            )

    @property
    def has_padding_mask(self) -> bool:
        return self.mask in ("padding", "padding-causal")

    @property
    def is_causal(self) -> bool:
        return self.mask in ("causal", "padding-causal")

    @property
    def sequence_inputs(self) -> tuple[str, ...]:
        return ("x",) if self.attention == "self" else ("query", "key", "value")

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.sequence_inputs + (("key_padding_mask",) if self.has_padding_mask else ())

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
