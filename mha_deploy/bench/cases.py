"""What a bench runs: mask modes, shapes, and the inputs of each, from the one data loader (numpy only)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from mha_deploy.errors import OptionError
from mha_deploy.inputs import InputCase, make_inputs
from mha_deploy.signature import MASK_MODES, Signature

DEFAULT_SHAPES = ((8, 128), (1, 1024), (32, 64), (1, 4096))
# One shape, so that a default bench stays short (each is measured in fresh processes, per ORT path and
# arena setting); the figures in the docs were taken at 1x4096,32x512 and 2x4096.
DEFAULT_MEMORY_SHAPES = ((1, 1024),)
# Unmasked and causal: what one pays for causality.
DEFAULT_MASK_MODES = ("none", "causal")

_MODE = re.compile(r"(?P<mask>[a-z-]+?)(?:-(?P<padded>\d+(?:\.\d+)?)%)?")


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'8x128,1x1024' -> ((8, 128), (1, 1024))."""
    shapes = []
    for part in text.split(","):
        try:
            batch, seq = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise OptionError(f"shape {part!r} is not BATCHxSEQ (e.g. 8x128)") from None
        if batch < 1 or seq < 1:
            raise OptionError(f"shape {part!r} must have batch and seq >= 1")
        shapes.append((batch, seq))
    return tuple(shapes)


def parse_sizes(text: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024): the square MatMul sizes of the GEMM yardstick."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise OptionError(f"sizes {text!r} are not a comma-separated list of integers (e.g. 512,1024)") from None
    if not sizes or min(sizes) < 1:
        raise OptionError(f"sizes {text!r} must all be >= 1")
    return sizes


@dataclass(frozen=True)
class MaskMode:
    """A model's mask mode, and for padding masks how many keys the bench's inputs pad.

    ``padded_pct`` 0 (the default) keeps every key real, so that a padding row
    times the mask's cost alone; ``padding-25%`` pads the last quarter of every
    batch row's keys (the same for every row, so that backends do equal work).
    """

    mask: str = "none"
    padded_pct: float = 0.0

    def __post_init__(self):
        if self.mask not in MASK_MODES:
            raise OptionError(f"mask mode {self.label!r}: the mask must be one of {', '.join(MASK_MODES)}")
        if self.padded_pct and not self.signature.has_padding_mask:
            raise OptionError(f"mask mode {self.label!r}: only padding masks can pad keys (e.g. padding-25%)")
        if not 0 <= self.padded_pct < 100:
            raise OptionError(f"mask mode {self.label!r}: the padded share of keys must be below 100%")

    @classmethod
    def parse(cls, text: str) -> MaskMode:
        """'padding' -> MaskMode('padding'); 'padding-25%' -> MaskMode('padding', 25.0)."""
        match = _MODE.fullmatch(text.strip().lower())
        if match is None:
            raise OptionError(
                f"mask mode {text!r} is not one of {', '.join(MASK_MODES)}, optionally with a padded share "
                "of keys (e.g. padding-25%)"
            )
        return cls(match["mask"], float(match["padded"] or 0))

    @property
    def label(self) -> str:
        return f"{self.mask}-{self.padded_pct:g}%" if self.padded_pct else self.mask

    @property
    def signature(self) -> Signature:
        """The self-attention model this mode benches (``padding-25%`` shares the ``padding`` model)."""
        return Signature("self", self.mask)

    def real_keys(self, length: int) -> int:
        return max(1, length - round(length * self.padded_pct / 100))

    def inputs(
        self, d_model: int, batch: int, seq: int, seed: int = 0, signature: Signature | None = None
    ) -> dict[str, np.ndarray]:
        """float32 inputs of one shape: every key real, or the last ``padded_pct`` of them padded.

        ``signature``: another model of this mask mode (cross-attention, say); default the mode's own.
        """
        signature = signature or self.signature
        feeds = make_inputs(signature, d_model, InputCase(batch, seq, seq, "none"), seed)
        for name in signature.padding_masks:
            feeds[name][:, self.real_keys(feeds[name].shape[1]):] = False
        return feeds


def parse_mask_modes(texts: Iterable[str]) -> tuple[MaskMode, ...]:
    """Mask mode labels, each possibly a comma-separated list ('none,padding-25%'), without repeats."""
    modes = [MaskMode.parse(part) for text in texts for part in text.split(",") if part.strip()]
    if not modes:
        raise OptionError(f"give at least one mask mode ({', '.join(MASK_MODES)}, or e.g. padding-25%)")
    return tuple(dict.fromkeys(modes))
