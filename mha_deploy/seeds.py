"""Seeds: what range they take and how a run's batches derive theirs (no onnxruntime, so that the CLI can
declare its options without loading it)."""

from __future__ import annotations

# Seeds are unsigned 64-bit integers, the range torch.manual_seed takes, so that a seed means the same elsewhere.
SEED_LIMIT = 2**64


def offset_seed(seed: int, offset: int) -> int:
    """The seed of batch (or choice) ``offset`` of a run seeded ``seed``: their sum, wrapped into the seed range."""
    return (seed + offset) % SEED_LIMIT
